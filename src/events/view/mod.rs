//! The local seat view: what this instance knows of a busy show's seats
//! from the show's event stream, to answer conflicts and reads without
//! Redis.
//!
//! During an on-sale most requests for a hot show are conflicts (thousands
//! clicking the same good seats) and seat-map reads, and every one of them
//! costs the show's single master. The show's reader ([`super::hub`])
//! already sees every transition; it applies each to the show's view before
//! it reads on. The view answers:
//!
//! - a hold one of whose seats it knows to be sold, or held with an expiry
//!   safely in the future on Redis's clock, with the same 409 Redis would
//!   give, when it knows the state of every seat of the request;
//! - a read of seats it knows to be sold, or held safely beyond the lag
//!   bound; a seat its events left free is read from Redis, since a writer
//!   outside seathold may have taken it since (see [`SeatView::states`]).
//!
//! It never grants: a request that may succeed always goes to Redis. It only
//! answers while its reader is current, that is when the reader's last XREAD
//! (which blocks at most a third of `--view-max-lag-ms`), counted from when
//! it was sent, came back within `--view-max-lag-ms`; otherwise, after a restart, and for seats it has
//! seen no event of, Redis answers. The one trade-off: a seat released a
//! few milliseconds ago may still be refused for up to that bound, exactly
//! as if another customer had won it. Writers outside seathold (a raw
//! `SET`/`DEL` on the seat keys) write no events; the view does not see
//! them, which is why it never answers "free".

mod seats;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::hub::{now_ms, Hub};
use crate::cluster::Cluster;
use crate::ids::{SeatId, ShowId};
use crate::keys::KeySpace;

pub use seats::{LiveHold, SeatView};

/// The views of this instance: one per busy show.
pub struct Views {
    hub: Arc<Hub>,
    cluster: Arc<Cluster>,
    keys: KeySpace,
    max_lag_ms: u64,
    /// Requests per second a view could answer (reads, refused holds) that
    /// make a show busy enough for one.
    min_rate: u32,
    /// Such requests per show in the current second, and the second of the
    /// last pruning (once a second, not per request).
    traffic: Mutex<Traffic>,
}

/// Per show: (second, requests in it); and the second last pruned.
type Traffic = (HashMap<ShowId, (u64, u32)>, u64);

impl Views {
    pub fn new(
        hub: Arc<Hub>,
        cluster: Arc<Cluster>,
        keys: KeySpace,
        max_lag_ms: u64,
        min_rate: u32,
    ) -> Self {
        Self {
            hub,
            cluster,
            keys,
            max_lag_ms,
            min_rate,
            traffic: Mutex::new((HashMap::new(), 0)),
        }
    }

    /// The view of `show` if it has one, without counting a request: what a
    /// hold consults. A hold that Redis then refuses counts (`for_show`); one
    /// that Redis grants does not, as no view could have answered it: a
    /// show whose holds all succeed gets no view, and no reader to feed one.
    pub fn existing(&self, show: &ShowId) -> Option<Arc<SeatView>> {
        self.hub.existing_view(show)
    }

    /// The view of `show` when it is busy enough to have one, counting this
    /// request, which a view could have answered (a read, or a hold Redis
    /// refused); `None` sends a read to Redis as it is.
    pub fn for_show(&self, show: &ShowId) -> Option<Arc<SeatView>> {
        let second = now_ms() / 1000;
        let busy = {
            let mut guard = self
                .traffic
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (traffic, pruned) = &mut *guard;
            if *pruned != second {
                traffic.retain(|_, (s, _)| *s == second);
                *pruned = second;
            }
            let (at, count) = match traffic.get_mut(show) {
                Some(entry) => entry,
                None => traffic.entry(show.clone()).or_insert((second, 0)),
            };
            if *at != second {
                *at = second;
                *count = 0;
            }
            *count = count.saturating_add(1);
            *count >= self.min_rate
        };
        if !busy {
            return None;
        }
        let (view, started) = self.hub.view(show, self.max_lag_ms)?;
        if let Some(started) = started {
            self.learn_live_holds(show, Arc::clone(&view), started);
        }
        Some(view)
    }

    /// Teaches a new view the show's live holds from its deadline index,
    /// which only seathold writes: the seats of holds made before the view
    /// existed are known at once. The index is read once the reader has
    /// pinned its starting position (`started`): a change after the read is
    /// then an event the view will apply, not one between the read and the
    /// reader's start that neither would see. Entries are learned as of the
    /// view's position before the read, so a change the view applies
    /// meanwhile wins.
    fn learn_live_holds(
        &self,
        show: &ShowId,
        view: Arc<SeatView>,
        mut started: tokio::sync::watch::Receiver<bool>,
    ) {
        let (cluster, key) = (Arc::clone(&self.cluster), self.keys.deadlines(show));
        tokio::spawn(async move {
            // Err: the reader stopped before it started (its view idle).
            if started.wait_for(|s| *s).await.is_err() {
                return;
            }
            let position = view.position();
            let Ok(mut conn) = cluster.conn() else { return };
            // With Redis's time: the index's deadlines are on its clock,
            // and no event may have told the view that clock yet.
            let read = async {
                let ((seconds, micros), entries): ((i64, i64), Vec<(String, f64)>) = redis::pipe()
                    .cmd("TIME")
                    .cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(&mut conn)
                    .await?;
                Ok((seconds * 1000 + micros / 1000, entries))
            };
            let Ok((redis_ms, entries)) = cluster.deadline().within(read).await else {
                return;
            };
            view.learn_redis_time(redis_ms);
            let holds: Vec<LiveHold> = entries
                .iter()
                .filter_map(|(member, until)| {
                    // "<ref> <fence> <items>"; pool units start with '@'.
                    // "<ref> > <key>" links a hold of several shows to the
                    // next show's index (hold.lua): no seats of this show.
                    let mut parts = member.splitn(3, ' ');
                    let reference = parts.next()?.to_owned();
                    parts
                        .next()
                        .filter(|f| f.bytes().all(|b| b.is_ascii_digit()))?;
                    let seats = parts
                        .next()
                        .unwrap_or_default()
                        .split(' ')
                        .filter_map(|s| SeatId::parse(s).ok())
                        .collect();
                    Some(LiveHold {
                        reference,
                        seats,
                        until: *until as i64,
                    })
                })
                .collect();
            view.learn_holds(position, &holds);
        });
    }
}
