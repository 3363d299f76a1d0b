//! The hold operations: typed ids in, one script, a shaped answer.
//!
//! The ids arrive parsed (see [`crate::ids`]); what is left to check without
//! Redis is checked here first (seat count, duplicates, TTL range, hash
//! slots), so a bad request never costs a round trip, and a hold whose keys
//! span slots is refused before any command for it is sent.
//!
//! - [`grant`](self): `hold`, its answers and replays, abandoning holds
//!   whose answer never arrived.
//! - `change`: `get`, `extend`, `release`, `confirm`.
//! - `inventory`: pools and show settings.
//! - `modify`: changing a hold's seats and pool units (`PATCH`).
//! - `lookup`: reading a hold back by token.
//! - `plan`: the pool, holder and event keys and arguments every write
//!   script takes, and the readers of script replies.

use std::sync::Arc;

use crate::cluster::{Cluster, Deadline};
use crate::error::Error;
use crate::events::sweep::Sweeper;
use crate::events::view::{SeatView, Views};
use crate::idempotency::Idem;
use crate::ids::{SeatId, ShowId};
use crate::keys::KeySpace;
use crate::metrics as m;
use crate::model::{Contents, Seats, State};

mod change;
mod grant;
mod inventory;
mod lookup;
mod modify;
mod orphans;
mod plan;

pub use modify::Change;

/// Limits from the command line.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub max_hold_lifetime_ms: u64,
    pub max_seats_per_hold: usize,
    pub confirm_wait_replicas: u32,
    pub confirm_wait_timeout_ms: u64,
    /// How long the outcome under an `Idempotency-Key` is kept.
    pub idempotency_ttl_ms: u64,
    /// The cap of each show's event stream; `None` with events off.
    pub events_max_len: Option<u64>,
    /// Most seats plus pool units per holder and show, where a show's
    /// settings name none (0: no limit).
    pub max_per_holder: u64,
}

/// How long the daemon's own idempotency record of a change is kept: long
/// enough for any resend of its script within one request's deadline
/// (`timeout`, `--redis-timeout-ms`), and a minute at least. A fixed minute
/// was too short for a timeout of a minute or more: a resend could miss the
/// first run's record and change the hold again.
fn own_record_ttl_ms(timeout: std::time::Duration) -> u64 {
    let timeout = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    timeout.saturating_mul(2).max(60_000)
}

/// The idempotency key a change's script runs under (release, extend,
/// modify): the client's, or without one a key of the daemon's own. The
/// daemon resends a script whose connection broke after sending; the resend
/// then finds the first run's record and answers as it did, where it would
/// otherwise change the hold again (a second `extended` event, or a PATCH
/// refused because the first run already made it).
struct RunKey<'a> {
    idem: std::borrow::Cow<'a, Idem>,
    ttl_ms: u64,
    /// The daemon's own key: a replay under it is the first run's answer
    /// to this very request, not a replay for the client.
    own: bool,
}

impl<T> Answer<T> {
    /// `value` replayed under `key`: for the client, or (the daemon's own
    /// key) as the first run's answer.
    fn replayed_under(value: T, key: &RunKey<'_>) -> Self {
        if key.own {
            Self::fresh(value)
        } else {
            Self::replayed(value)
        }
    }
}

/// An answer, and whether it was replayed from an idempotency record.
#[derive(Debug)]
pub struct Answer<T> {
    pub value: T,
    pub replayed: bool,
}

impl<T> Answer<T> {
    fn fresh(value: T) -> Self {
        Self {
            value,
            replayed: false,
        }
    }

    fn replayed(value: T) -> Self {
        metrics::counter!(m::IDEMPOTENT_REPLAYS).increment(1);
        Self {
            value,
            replayed: true,
        }
    }
}

/// The hold service: the operations behind the routes.
pub struct Service {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    limits: Limits,
    /// Told of every deadline this instance sets (events on).
    sweeper: Option<Arc<Sweeper>>,
    /// The local seat views of busy shows (events on, view on).
    views: Option<Arc<Views>>,
    /// Releases of holds left without an answer, running in the background.
    orphans: Arc<orphans::Orphans>,
}

impl Service {
    pub fn new(
        cluster: Arc<Cluster>,
        keys: KeySpace,
        limits: Limits,
        sweeper: Option<Arc<Sweeper>>,
        views: Option<Arc<Views>>,
    ) -> Self {
        Self {
            cluster,
            keys,
            limits,
            sweeper,
            views,
            orphans: Arc::default(),
        }
    }

    /// At shutdown: gives the background releases of holds left without an
    /// answer up to `bound` to finish, each trying again at once; answers
    /// how many did not (their holds expire by themselves).
    pub async fn drain_orphans(&self, bound: std::time::Duration) -> usize {
        self.orphans.drain(bound).await
    }

    /// The seat view of `show` when it is busy enough for one, counting this
    /// request (a read, or a hold Redis refused) toward that.
    fn view(&self, show: &ShowId) -> Option<Arc<SeatView>> {
        self.views.as_ref()?.for_show(show)
    }

    /// The view of `show` if it has one; counts nothing, starts nothing.
    fn existing_view(&self, show: &ShowId) -> Option<Arc<SeatView>> {
        self.views.as_ref()?.existing(show)
    }

    /// Tells the views of the shows of `contents` (a hold of `home`) that
    /// this instance has just changed its seats, or may have (Redis did
    /// not answer): they answer none of them until their readers have read
    /// the change ([`SeatView::changed_here`]).
    fn changed_here(&self, home: &ShowId, contents: &Contents) {
        if self.views.is_none() {
            return;
        }
        if let Seats::Show(seats) = &contents.seats {
            if let Some(view) = self.existing_view(home) {
                view.changed_here(seats.iter().map(SeatId::as_str));
            }
            return;
        }
        let mut pairs: Vec<(&ShowId, &SeatId)> = contents.seats.pairs(home).collect();
        pairs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for show in pairs.chunk_by(|a, b| a.0 == b.0) {
            if let Some(view) = self.existing_view(show[0].0) {
                view.changed_here(show.iter().map(|(_, seat)| seat.as_str()));
            }
        }
    }

    /// The cluster this service runs on.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The key space.
    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Has the sweeper look at `shows` when `ttl_ms` has passed.
    fn schedule_sweep(&self, shows: &[ShowId], ttl_ms: u64) {
        if let Some(sweeper) = &self.sweeper {
            for show in shows {
                sweeper.schedule(show, ttl_ms);
            }
        }
    }

    fn ttl(&self, ttl_ms: Option<u64>) -> Result<u64, Error> {
        let ttl = ttl_ms.unwrap_or(self.limits.default_ttl_ms);
        if ttl == 0 || ttl > self.limits.max_ttl_ms {
            return Err(Error::InvalidTtl(format!(
                "ttlMs must be a positive integer of at most {}",
                self.limits.max_ttl_ms
            )));
        }
        Ok(ttl)
    }

    fn check_count(&self, count: usize) -> Result<(), Error> {
        if count > self.limits.max_seats_per_hold {
            return Err(Error::TooManySeats(self.limits.max_seats_per_hold));
        }
        Ok(())
    }

    /// The key a change runs under (see [`RunKey`]).
    fn run_key<'a>(&self, idem: Option<&'a Idem>) -> RunKey<'a> {
        match idem {
            Some(idem) => RunKey {
                idem: std::borrow::Cow::Borrowed(idem),
                ttl_ms: self.limits.idempotency_ttl_ms,
                own: false,
            },
            None => RunKey {
                idem: std::borrow::Cow::Owned(Idem::internal()),
                ttl_ms: own_record_ttl_ms(self.cluster.timeout()),
                own: true,
            },
        }
    }

    /// The idempotency key of `idem` under `show`, and the script argument
    /// that goes with it: its fingerprint, or "" when none.
    fn idem_args<'a>(&self, show: &ShowId, idem: Option<&'a Idem>) -> (Option<String>, &'a str) {
        match idem {
            Some(idem) => (
                Some(self.keys.idempotency(show, idem.key.as_str())),
                idem.fingerprint.as_str(),
            ),
            None => (None, ""),
        }
    }

    /// The states of `seats` of `show`, in order.
    pub async fn seat_states(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        seats: &[SeatId],
    ) -> Result<Vec<State>, Error> {
        self.check_count(seats.len())?;
        let Some(mut states) = self.view(show).and_then(|v| v.states(seats)) else {
            return self.read_seats(deadline, show, seats).await;
        };
        if states.iter().all(Option::is_some) {
            m::hot::count(m::VIEW_ANSWERS, &[("kind", "read")], 1);
            return Ok(states.into_iter().flatten().collect());
        }
        // The view answers the taken seats it knows; Redis the others.
        let (ask, unknown): (Vec<usize>, Vec<SeatId>) = (0..seats.len())
            .filter(|&i| states[i].is_none())
            .map(|i| (i, seats[i].clone()))
            .unzip();
        let read = self.read_seats(deadline, show, &unknown).await?;
        for (i, state) in ask.into_iter().zip(read) {
            states[i] = Some(state);
        }
        Ok(states.into_iter().flatten().collect())
    }

    /// The states of `seats` of `show` as Redis has them, in order.
    async fn read_seats(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        seats: &[SeatId],
    ) -> Result<Vec<State>, Error> {
        let key_list: Vec<String> = seats.iter().map(|s| self.keys.seat(show, s)).collect();
        let reply: Vec<i64> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().seats, &key_list, |_| {})
            .await?;
        if reply.len() != 2 * seats.len() {
            return Err(Error::Internal("bad reply of seats.lua".into()));
        }
        Ok(reply
            .chunks_exact(2)
            .map(|c| State::from_reply(c[0], c[1]))
            .collect())
    }
}

fn count(name: &'static str, by: u64) {
    m::hot::count(name, &[], by);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn own_records_outlive_a_requests_deadline() {
        assert_eq!(super::own_record_ttl_ms(Duration::from_secs(2)), 60_000);
        assert_eq!(super::own_record_ttl_ms(Duration::from_secs(90)), 180_000);
        assert_eq!(super::own_record_ttl_ms(Duration::MAX), u64::MAX);
    }
}
