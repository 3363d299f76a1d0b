//! The hold operations: typed ids in, one script, a shaped answer.
//!
//! The ids arrive parsed (see [`crate::ids`]); what is left to check without
//! Redis is checked here first (seat count, duplicates, TTL range, hash
//! slots), so a bad request never costs a round trip, and a multi-seat hold
//! whose keys span slots is refused before any command for it is sent.

use std::sync::Arc;

use redis::Value;

use crate::cluster::{Cluster, Deadline, Wait};
use crate::error::Error;
use crate::ids::{HoldToken, SeatId, ShowId};
use crate::keys::{self, KeySpace};
use crate::metrics as m;
use crate::model::{Confirmation, Hold, SeatSlot, Seats, State, Taken};

/// Limits from the command line.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub max_hold_lifetime_ms: u64,
    pub max_seats_per_hold: usize,
    pub confirm_wait_replicas: u32,
    pub confirm_wait_timeout_ms: u64,
}

/// A live hold record read back from Redis.
struct Record {
    pttl: i64,
    now_ms: i64,
    seats: Seats,
    fence: i64,
}

/// What `lookup.lua` found under a token.
enum Found {
    Nothing,
    /// A live hold.
    Hold(Record),
    /// A confirmed hold (only when the sale record was asked for).
    Sale(Record),
}

/// The hold service: the operations behind the routes.
pub struct Service {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    limits: Limits,
}

impl Service {
    pub fn new(cluster: Arc<Cluster>, keys: KeySpace, limits: Limits) -> Self {
        Self {
            cluster,
            keys,
            limits,
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

    /// Holds `seats`, all or nothing. `home` is the show whose routes
    /// serve the hold afterwards.
    pub async fn hold(
        &self,
        deadline: &Deadline,
        home: &ShowId,
        seats: Seats,
        ttl_ms: Option<u64>,
    ) -> Result<Hold, Error> {
        if seats.is_empty() {
            return Err(Error::InvalidRequest(
                "seats must name at least one seat".into(),
            ));
        }
        self.check_count(seats.len())?;
        // Every later step walks the seats as (show, seat) pairs: collect
        // them once. At most --max-seats-per-hold of them (checked above),
        // so comparing pairs beats hashing them.
        let pairs: Vec<(&ShowId, &SeatId)> = seats.pairs(home).collect();
        for (i, pair) in pairs.iter().enumerate() {
            if pairs[..i].contains(pair) {
                let (show, seat) = pair;
                return Err(Error::DuplicateSeat(if seats.is_multi() {
                    format!("{show}/{seat}")
                } else {
                    seat.to_string()
                }));
            }
        }
        let ttl = self.ttl(ttl_ms)?;

        let token = HoldToken::new();
        let mut shows: Vec<&ShowId> = pairs.iter().map(|&(show, _)| show).collect();
        shows.sort_unstable();
        shows.dedup();
        let mut key_list = Vec::with_capacity(1 + shows.len() + seats.len());
        key_list.push(self.keys.hold_record(home, &token));
        key_list.extend(shows.iter().map(|show| self.keys.fence(show)));
        key_list.extend(pairs.iter().map(|&(show, seat)| self.keys.seat(show, seat)));
        if shows.len() > 1 {
            check_one_slot(&key_list, shows.len(), &pairs)?;
        }

        let encoded = seats.encode(home);
        let fences = shows.len();
        let reply: Vec<i64> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().hold, &key_list, |c| {
                c.arg(token.as_str())
                    .arg(ttl)
                    .arg(fences)
                    .arg(seats.kind())
                    .arg(&encoded);
            })
            .await?;

        match reply.as_slice() {
            [1, fence, pttl, now] => {
                count(m::HOLDS, 1);
                count(m::SEATS_HELD, seats.len() as u64);
                Ok(Hold::new(token, home.clone(), seats, *fence, *pttl, *now))
            }
            [0, rest @ ..] if !rest.is_empty() && rest.len() % 3 == 0 => {
                count(m::HOLD_CONFLICTS, 1);
                Err(Error::SeatsTaken(taken(rest, &pairs, seats.is_multi())))
            }
            other => Err(Error::Internal(format!(
                "unexpected reply of hold.lua: {other:?}"
            ))),
        }
    }

    async fn lookup(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        with_sale: bool,
    ) -> Result<Found, Error> {
        let mut key_list = vec![self.keys.hold_record(show, token)];
        if with_sale {
            key_list.push(self.keys.sale_record(show, token));
        }
        let reply: Vec<Value> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().lookup, &key_list, |_| {})
            .await?;
        let int = |v: Option<&Value>| match v {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        };
        let found =
            int(reply.first()).ok_or_else(|| Error::Internal("bad reply of lookup.lua".into()))?;
        if found == 0 {
            return Ok(Found::Nothing);
        }
        // "<fence> <created_ms> <kind> <seats>", see lua/hold.lua.
        let unreadable = || Error::Internal(format!("unreadable hold record for {show}"));
        let Some(Value::BulkString(raw)) = reply.get(3) else {
            return Err(unreadable());
        };
        let record = std::str::from_utf8(raw).map_err(|_| unreadable())?;
        let mut parts = record.splitn(4, ' ');
        let (Some(fence), Some(_created), Some(kind), Some(encoded)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(unreadable());
        };
        let record = Record {
            pttl: int(reply.get(1)).unwrap_or(-1),
            now_ms: int(reply.get(2)).unwrap_or(0),
            seats: Seats::decode(kind, encoded, show).ok_or_else(unreadable)?,
            fence: fence.parse().map_err(|_| unreadable())?,
        };
        Ok(if found == 1 {
            Found::Hold(record)
        } else {
            Found::Sale(record)
        })
    }

    /// The live hold record of `token`, or 404.
    async fn live(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
    ) -> Result<Record, Error> {
        match self.lookup(deadline, show, token, false).await? {
            Found::Hold(rec) => Ok(rec),
            _ => Err(Error::HoldNotFound),
        }
    }

    /// The hold record's key, then the key of every seat of the hold.
    fn record_and_seat_keys(&self, show: &ShowId, token: &HoldToken, seats: &Seats) -> Vec<String> {
        let mut key_list = Vec::with_capacity(2 + seats.len());
        key_list.push(self.keys.hold_record(show, token));
        key_list.extend(seats.pairs(show).map(|(s, seat)| self.keys.seat(s, seat)));
        key_list
    }

    /// The live hold `token` of `show`.
    pub async fn get(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
    ) -> Result<Hold, Error> {
        let rec = self.live(deadline, show, &token).await?;
        Ok(Hold::new(
            token,
            show.clone(),
            rec.seats,
            rec.fence,
            rec.pttl,
            rec.now_ms,
        ))
    }

    /// Sets the remaining time of hold `token` to `ttl_ms`.
    pub async fn extend(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        ttl_ms: Option<u64>,
    ) -> Result<Hold, Error> {
        let ttl = self.ttl(ttl_ms)?;
        let rec = self.live(deadline, show, &token).await?;
        let key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        let max = self.limits.max_hold_lifetime_ms;
        let reply: Vec<i64> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().extend, &key_list, |c| {
                c.arg(token.as_str()).arg(ttl).arg(max);
            })
            .await?;
        match reply.as_slice() {
            [1, fence, pttl, now] => {
                count(m::EXTENDS, 1);
                Ok(Hold::new(
                    token,
                    show.clone(),
                    rec.seats,
                    *fence,
                    *pttl,
                    *now,
                ))
            }
            [0] => Err(Error::HoldNotFound),
            [-1, created, now] => Err(Error::LifetimeExceeded {
                max_ms: max,
                remaining_ms: i64::try_from(max).unwrap_or(i64::MAX) - (now - created),
            }),
            other => Err(Error::Internal(format!(
                "unexpected reply of extend.lua: {other:?}"
            ))),
        }
    }

    /// Releases hold `token`: its seats become free where they still carry it.
    pub async fn release(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
    ) -> Result<(), Error> {
        let rec = self.live(deadline, show, &token).await?;
        let key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        let released: i64 = self
            .cluster
            .eval(deadline, &self.cluster.scripts().release, &key_list, |c| {
                c.arg(token.as_str());
            })
            .await?;
        if released == 1 {
            count(m::RELEASES, 1);
            Ok(())
        } else {
            Err(Error::HoldNotFound)
        }
    }

    /// Sells hold `token`, then waits for replicas to have the sale (see
    /// [`Cluster::eval_and_wait`]). A confirmed token confirms again with the
    /// same answer.
    pub async fn confirm(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
    ) -> Result<Confirmation, Error> {
        let rec = match self.lookup(deadline, show, &token, true).await? {
            Found::Hold(rec) | Found::Sale(rec) => rec,
            Found::Nothing => return Err(Error::HoldNotFound),
        };
        let mut key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        key_list.insert(1, self.keys.sale_record(show, &token));
        let wait = Wait {
            replicas: self.limits.confirm_wait_replicas,
            timeout_ms: self.limits.confirm_wait_timeout_ms,
        };
        let (reply, replicas): (Vec<i64>, i64) = self
            .cluster
            .eval_and_wait(
                deadline,
                &self.cluster.scripts().confirm,
                &key_list,
                |c| {
                    c.arg(token.as_str());
                },
                // Nothing was sold when the hold is gone: no WAIT.
                |reply: &Vec<i64>| (reply.first() != Some(&0)).then_some(wait),
            )
            .await?;
        let (first, fence) = match reply.as_slice() {
            [0] => return Err(Error::HoldNotFound),
            [state @ (1 | 2), fence] => (*state == 1, *fence),
            other => {
                return Err(Error::Internal(format!(
                    "unexpected reply of confirm.lua: {other:?}"
                )))
            }
        };
        if first {
            count(m::CONFIRMS, 1);
        }
        let confirmation = Confirmation {
            hold_token: token,
            show: show.clone(),
            seats: rec.seats,
            fence,
            replicas,
        };
        if replicas < i64::from(wait.replicas) {
            count(m::CONFIRMS_NOT_REPLICATED, 1);
            tracing::warn!(%show, replicas, wanted = wait.replicas, "confirm not replicated in time");
            return Err(Error::NotReplicated(confirmation));
        }
        Ok(confirmation)
    }

    /// The states of `seats` of `show`, in order.
    pub async fn seat_states(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        seats: &[SeatId],
    ) -> Result<Vec<State>, Error> {
        self.check_count(seats.len())?;
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

/// The seats a conflict names: `hold.lua` answers `(index, state, pttl)`
/// triples, the index 1-based into `pairs`.
fn taken(triples: &[i64], pairs: &[(&ShowId, &SeatId)], multi: bool) -> Vec<Taken> {
    triples
        .chunks_exact(3)
        .filter_map(|c| {
            let (show, seat) = pairs.get(usize::try_from(c[0]).ok()?.checked_sub(1)?)?;
            let show = multi.then(|| (*show).clone());
            Some(Taken::new(
                show,
                (*seat).clone(),
                State::from_reply(c[1], c[2]),
            ))
        })
        .collect()
}

/// Refuses keys of several shows that do not share one hash slot, naming
/// the slot of every seat (`pairs`, whose keys follow the record and `fences`
/// fence keys in `key_list`). Keys of one show share a tag by construction.
fn check_one_slot(
    key_list: &[String],
    fences: usize,
    pairs: &[(&ShowId, &SeatId)],
) -> Result<(), Error> {
    let slots: Vec<u16> = key_list.iter().map(|k| keys::slot(k.as_bytes())).collect();
    if slots.iter().all(|&s| s == slots[0]) {
        return Ok(());
    }
    count(m::CROSS_SLOT_REJECTIONS, 1);
    let detail = pairs
        .iter()
        .zip(&slots[1 + fences..])
        .map(|(&(show, seat), &slot)| SeatSlot {
            show: show.clone(),
            seat: seat.clone(),
            slot,
        })
        .collect();
    Err(Error::CrossSlot(detail))
}

fn count(name: &'static str, by: u64) {
    metrics::counter!(name).increment(by);
}
