//! Changing what a hold holds: `PATCH /v1/shows/{show}/holds/{token}`,
//! `lua/modify.lua`.

use std::collections::BTreeMap;

use redis::Value;

use super::change::replay_extend;
use super::plan::{ints, refusal, replay_of};
use super::{Answer, RunKey, Service};
use crate::cluster::Deadline;
use crate::error::Error;
use crate::idempotency::{Idem, Recorded};
use crate::ids::{HoldToken, PoolId, SeatId, ShowId};
use crate::metrics as m;
use crate::model::{Contents, Hold, PoolUnits, SeatRef, Seats};

/// A change: seats to add and to give back, and new pool quantities (0
/// gives a pool's units back).
#[derive(Debug, Clone, Default)]
pub struct Change {
    pub add: Vec<SeatId>,
    pub remove: Vec<SeatId>,
    pub pools: BTreeMap<PoolId, u32>,
}

impl Service {
    /// Changes hold `token` of `show` under the same token and expiry, all
    /// or nothing; answers the hold with its new fence.
    ///
    /// The change is computed from the hold as read, and modify.lua applies
    /// it only while the hold is still that one (the same fence): when a
    /// concurrent change came first, the hold is read again and the change
    /// computed anew, so none is lost. The request's deadline bounds the
    /// retries.
    pub async fn modify(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        change: Change,
        idem: Option<&Idem>,
    ) -> Result<Answer<Hold>, Error> {
        super::change::until_unchanged(|| self.modify_once(deadline, show, &token, &change, idem))
            .await
    }

    /// One attempt of [`Service::modify`]: `None` when the hold changed
    /// between reading it and the script.
    async fn modify_once(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        change: &Change,
        idem: Option<&Idem>,
    ) -> Result<Option<Answer<Hold>>, Error> {
        let token = token.clone();
        let rec = match self.live_hold(deadline, show, &token, idem).await? {
            Ok(rec) => rec,
            Err(replayed) => return Ok(Some(replayed)),
        };
        let old = rec.contents;
        let new = self.changed(show, &old, change)?;

        let run = self.run_key(idem);
        let (keys, kept, pool_ids) = self.modify_keys(show, &token, &old, change, &run)?;
        let events = self.limits.events_max_len;
        let quantity = |c: &Contents, pool: &PoolId| {
            c.pools
                .iter()
                .find(|p| &p.pool == pool)
                .map_or(0, |p| p.quantity)
        };
        let items = |c: &Contents| c.by_show(show).remove(show).unwrap_or_default().items();
        let record = format!("{} {}", new.kind(), new.encode(show));
        let reply: Result<Vec<Value>, Error> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().modify, &keys, |c| {
                c.arg(token.as_str())
                    .arg(&record)
                    .arg(token.hold_ref())
                    .arg(&run.idem.fingerprint)
                    .arg(run.ttl_ms)
                    .arg(kept)
                    .arg(change.remove.len())
                    .arg(change.add.len())
                    .arg(pool_ids.len())
                    .arg(usize::from(old.holder.is_some()))
                    .arg(self.limits.max_per_holder)
                    .arg(usize::from(events.is_some()))
                    .arg(events.unwrap_or(0))
                    .arg(items(&old))
                    .arg(items(&new))
                    .arg(old.units())
                    .arg(new.units())
                    .arg(rec.fence);
                for pool in &pool_ids {
                    c.arg(quantity(&old, pool)).arg(quantity(&new, pool));
                }
            })
            .await;
        self.changed_here(show, &old);
        self.changed_here(show, &new);
        let reply = reply?;
        if let Some((recorded, now)) = replay_of(&reply) {
            // A resend of this very script (under the daemon's own key), or
            // a concurrent twin of this request that won the race.
            let recorded = Recorded::parse(&recorded, &run.idem)?;
            let now = now.unwrap_or(rec.now_ms);
            let hold = replay_extend(show, token, None, now, &recorded)?;
            if run.own && events.is_some() {
                metrics::counter!(m::EVENTS, "type" => "modified").increment(1);
            }
            return Ok(Some(Answer::replayed_under(hold, &run)));
        }
        match ints(&reply).unwrap_or_default().as_slice() {
            [1, fence, pttl, now] => {
                if events.is_some() {
                    metrics::counter!(m::EVENTS, "type" => "modified").increment(1);
                }
                Ok(Some(Answer::fresh(Hold::new(
                    token,
                    show.clone(),
                    new,
                    *fence,
                    *pttl,
                    *now,
                ))))
            }
            [-7] => Ok(None),
            [0] => Err(Error::HoldNotFound),
            reply => {
                let pairs: Vec<(&ShowId, &SeatId)> = change.add.iter().map(|s| (show, s)).collect();
                let pools: Vec<PoolUnits> = pool_ids
                    .iter()
                    .map(|pool| PoolUnits {
                        show: show.clone(),
                        pool: (*pool).clone(),
                        quantity: quantity(&new, pool),
                    })
                    .collect();
                Err(refusal(reply, &pairs, &pools, false).unwrap_or_else(|| {
                    Error::Internal(format!("unexpected reply of modify.lua: {reply:?}"))
                }))
            }
        }
    }
    /// The keys of `lua/modify.lua` for changing `old` by `change`, the
    /// number of seats kept, and every pool the hold had or will have.
    fn modify_keys<'a>(
        &self,
        show: &ShowId,
        token: &HoldToken,
        old: &'a Contents,
        change: &'a Change,
        run: &RunKey<'_>,
    ) -> Result<(Vec<String>, usize, Vec<&'a PoolId>), Error> {
        let old_seats = home_seats(show, old)?;
        let kept: Vec<&SeatId> = old_seats
            .iter()
            .filter(|s| !change.remove.contains(s))
            .collect();
        let mut pool_ids: Vec<&PoolId> = old.pools.iter().map(|p| &p.pool).collect();
        pool_ids.extend(change.pools.keys());
        pool_ids.sort_unstable();
        pool_ids.dedup();
        let mut keys = vec![self.keys.hold_record(show, token), self.keys.fence(show)];
        keys.extend(kept.iter().map(|s| self.keys.seat(show, s)));
        keys.extend(change.remove.iter().map(|s| self.keys.seat(show, s)));
        keys.extend(change.add.iter().map(|s| self.keys.seat(show, s)));
        for pool in &pool_ids {
            keys.push(self.keys.pool(show, pool.as_str()));
            keys.push(self.keys.pool_holds(show, pool.as_str()));
        }
        if let Some(holder) = &old.holder {
            keys.push(self.keys.settings(show));
            keys.push(self.keys.holder(show, holder.as_str()));
            keys.push(self.keys.holder_sold(show, holder.as_str()));
        }
        if self.limits.events_max_len.is_some() {
            keys.push(self.keys.deadlines(show));
            keys.push(self.keys.events(show));
        }
        keys.push(self.keys.idempotency(show, run.idem.key.as_str()));
        Ok((keys, kept.len(), pool_ids))
    }

    /// The hold's contents after `change`, checked without Redis.
    fn changed(&self, show: &ShowId, old: &Contents, change: &Change) -> Result<Contents, Error> {
        let seats = home_seats(show, old)?;
        for seat in &change.remove {
            if !seats.contains(seat) {
                return Err(Error::InvalidRequest(format!(
                    "seat {seat} is not in this hold"
                )));
            }
        }
        let mut new_seats: Vec<SeatId> = seats
            .iter()
            .filter(|s| !change.remove.contains(s))
            .cloned()
            .collect();
        for seat in &change.add {
            if new_seats.contains(seat) || change.remove.contains(seat) {
                return Err(Error::DuplicateSeat(seat.to_string()));
            }
            new_seats.push(seat.clone());
        }
        self.check_count(new_seats.len())?;
        // In the hold's order (a hold made with POST /v1/holds answers its
        // pools as sent), new pools after.
        let mut pools: Vec<(PoolId, u32)> = old
            .pools
            .iter()
            .map(|p| (p.pool.clone(), p.quantity))
            .collect();
        for (pool, quantity) in &change.pools {
            match pools.iter_mut().find(|(p, _)| p == pool) {
                Some(entry) => entry.1 = *quantity,
                None => pools.push((pool.clone(), *quantity)),
            }
        }
        pools.retain(|(_, q)| *q > 0);
        self.check_count(pools.len())?;
        // A hold made with POST /v1/holds keeps its shape.
        let new_seats = if old.seats.is_multi() {
            Seats::Multi(
                new_seats
                    .into_iter()
                    .map(|seat| SeatRef {
                        show: show.clone(),
                        seat,
                    })
                    .collect(),
            )
        } else {
            Seats::Show(new_seats)
        };
        let new = Contents {
            seats: new_seats,
            pools: pools
                .into_iter()
                .map(|(pool, quantity)| PoolUnits {
                    show: show.clone(),
                    pool,
                    quantity,
                })
                .collect(),
            holder: old.holder.clone(),
        };
        if new.is_empty() {
            return Err(Error::InvalidRequest(
                "a change may not give back every seat and unit; release the hold instead".into(),
            ));
        }
        Ok(new)
    }
}

/// The seats of `old`, a hold of `show` alone: made under
/// `/v1/shows/{show}/…`, or with `POST /v1/holds` naming no other show (a
/// PATCH names seats and pools of the route's show only). A hold of
/// several shows cannot be changed.
fn home_seats(show: &ShowId, old: &Contents) -> Result<Vec<SeatId>, Error> {
    let only_home = old.pools.iter().all(|p| &p.show == show);
    match &old.seats {
        Seats::Show(seats) => Ok(seats.clone()),
        Seats::Multi(seats) if only_home && seats.iter().all(|r| &r.show == show) => {
            Ok(seats.iter().map(|r| r.seat.clone()).collect())
        }
        Seats::Multi(_) => Err(Error::InvalidRequest(
            "a hold of several shows cannot be changed; release it and hold again".into(),
        )),
    }
}
