//! Granting a hold: `lua/hold.lua`, its answers, its replays, and what
//! happens to a hold whose answer never reached its client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Value;

use super::lookup::Found;
use super::plan::{check_one_slot, ints, refusal, replay_of, Tail};
use super::{count, Answer, Service};
use crate::cluster::{Deadline, RedisFault};
use crate::error::Error;
use crate::events::view::SeatView;
use crate::idempotency::{Idem, Recorded};
use crate::ids::{HoldToken, SeatId, ShowId};
use crate::metrics as m;
use crate::model::{Contents, Hold, Seats, Taken};

impl Service {
    /// Holds `contents`, all or nothing. `home` is the show whose routes
    /// serve the hold afterwards. With `idem`, the outcome is recorded in
    /// the same script and a repeat answers it again.
    pub async fn hold(
        &self,
        deadline: &Deadline,
        home: &ShowId,
        contents: Contents,
        ttl_ms: Option<u64>,
        idem: Option<&Idem>,
    ) -> Result<Answer<Hold>, Error> {
        self.check_contents(home, &contents)?;
        let ttl = self.ttl(ttl_ms)?;
        check_one_slot(home, &contents)?;
        let view = self.consult_view(home, &contents, idem)?;

        let token = HoldToken::new();
        let pairs: Vec<(&ShowId, &SeatId)> = contents.seats.pairs(home).collect();
        let HoldKeys {
            keys: key_list,
            seat_keys,
            shows,
            fences,
            tail,
        } = self.grant_keys(home, &contents, &token, idem);
        let (_, fingerprint) = self.idem_args(home, idem);
        let (encoded, kind) = (contents.encode(home), contents.kind());
        // Without a key, nobody can find this hold again unless its answer
        // arrives: it is abandoned when the script may have run but the
        // request ends without that answer, by a 503 or by being dropped
        // (the client closed its connection first).
        let mut in_flight = InFlight {
            service: self,
            token: &token,
            seat_keys: &seat_keys,
            home,
            contents: &contents,
            shows: &shows,
            ttl_ms: ttl,
            armed: idem.is_none(),
            sweep: idem.is_some(),
        };
        let reply: Result<Vec<Value>, Error> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().hold, &key_list, |c| {
                c.arg(token.as_str()).arg(ttl);
                if tail.fits_short_form(seat_keys.len(), fences) {
                    let idem = idem.map(|_| (fingerprint, self.limits.idempotency_ttl_ms));
                    tail.push_for_single_seat(c, &kind, &encoded, idem);
                    return;
                }
                c.arg(fences)
                    .arg(&kind)
                    .arg(&encoded)
                    .arg(fingerprint)
                    .arg(self.limits.idempotency_ttl_ms);
                tail.push_for_hold(c, seat_keys.len(), self.limits.max_per_holder);
            })
            .await;
        let unanswered = reply.as_ref().is_err_and(may_have_run);
        in_flight.armed &= unanswered;
        in_flight.sweep &= unanswered;
        drop(in_flight);
        let reply = reply?;
        if let (Some((recorded, _)), Some(idem)) = (replay_of(&reply), idem) {
            let recorded = Recorded::parse(&recorded, idem)?;
            // The token is this request's own: the record is of this very
            // request's first run, whose answer was lost with its
            // connection before seathold sent the script again (the
            // client's own repeat makes a new token). Answered, counted
            // and swept as the first run would have been.
            let own = recorded.fields.first().map(String::as_str) == Some(token.as_str());
            if own {
                self.counted(&contents, &tail);
            }
            let hold = self
                .replay_hold(deadline, home, contents, &recorded)
                .await?;
            // The hold's sweep, at its real remaining time: the instance
            // whose answer was lost may never have scheduled it (it
            // answered 503 before the script ran), and no other has.
            self.schedule_sweep(&shows, u64::try_from(hold.expires_in_ms).unwrap_or(0));
            return Ok(if own {
                Answer::fresh(hold)
            } else {
                Answer::replayed(hold)
            });
        }
        match ints(&reply).unwrap_or_default().as_slice() {
            [1, fence, pttl, now] => {
                // The time left, not the TTL: a resend of a script that had
                // run (answered as the first run) comes later than it.
                self.granted(
                    &contents,
                    &tail,
                    &shows,
                    u64::try_from(*pttl).unwrap_or(ttl),
                );
                Ok(Answer::fresh(Hold::new(
                    token,
                    home.clone(),
                    contents,
                    *fence,
                    *pttl,
                    *now,
                )))
            }
            reply => {
                let multi = contents.seats.is_multi();
                let err = refusal(reply, &pairs, &contents.pools, multi).unwrap_or_else(|| {
                    Error::Internal(format!("unexpected reply of hold.lua: {reply:?}"))
                });
                if let Error::SeatsTaken(taken, _) = &err {
                    match &view {
                        Some((view, position)) => view.learn_sold(*position, &sold(taken)),
                        // A refusal a view could have given: it counts
                        // toward giving the show one.
                        None if view_may_answer(&contents, idem) => {
                            self.view(home);
                        }
                        None => {}
                    }
                }
                Err(err)
            }
        }
    }

    /// The keys of `lua/hold.lua` for holding `contents` under `token`.
    fn grant_keys(
        &self,
        home: &ShowId,
        contents: &Contents,
        token: &HoldToken,
        idem: Option<&Idem>,
    ) -> HoldKeys {
        let shows: Vec<ShowId> = contents.by_show(home).into_keys().collect();
        let seat_keys: Vec<String> = contents
            .seats
            .pairs(home)
            .map(|(show, seat)| self.keys.seat(show, seat))
            .collect();
        let tail = Tail::new(self, home, contents, token, true);
        // With events on, the stream ids give the fences.
        let fences = if self.limits.events_max_len.is_some() {
            0
        } else {
            shows.len()
        };
        let mut keys = Vec::with_capacity(2 + fences + seat_keys.len() + tail.keys.len());
        keys.push(self.keys.hold_record(home, token));
        keys.extend(shows.iter().take(fences).map(|show| self.keys.fence(show)));
        keys.extend(seat_keys.iter().cloned());
        keys.extend(tail.keys.iter().cloned());
        keys.extend(self.idem_args(home, idem).0);
        HoldKeys {
            keys,
            seat_keys,
            shows,
            fences,
            tail,
        }
    }

    /// A busy show's view may know that a hold cannot succeed: then the
    /// answer is its 409. It never grants, and it does not answer for pools,
    /// holders, or requests whose outcome must be recorded under an
    /// idempotency key. Answers the view and its position for learning from
    /// the answer Redis gives instead.
    fn consult_view(
        &self,
        home: &ShowId,
        contents: &Contents,
        idem: Option<&Idem>,
    ) -> Result<Option<(Arc<SeatView>, u64)>, Error> {
        let Seats::Show(seats) = &contents.seats else {
            return Ok(None);
        };
        if !view_may_answer(contents, idem) {
            return Ok(None);
        }
        let Some(view) = self.existing_view(home) else {
            return Ok(None);
        };
        if let Some(taken) = view.refusal(seats) {
            count(m::HOLD_CONFLICTS, 1);
            m::hot::count(m::VIEW_ANSWERS, &[("kind", "conflict")], 1);
            let taken = taken
                .into_iter()
                .map(|(seat, state)| Taken::new(None, seat, state))
                .collect();
            return Err(Error::SeatsTaken(taken, Vec::new()));
        }
        let position = view.position();
        Ok(Some((view, position)))
    }

    /// What needs no Redis: something to hold, at most
    /// `--max-seats-per-hold` seats and as many pools, nothing twice.
    fn check_contents(&self, home: &ShowId, contents: &Contents) -> Result<(), Error> {
        if contents.is_empty() {
            return Err(Error::InvalidRequest(
                "a hold must name at least one seat or pool unit".into(),
            ));
        }
        self.check_count(contents.seats.len())?;
        self.check_count(contents.pools.len())?;
        // At most --max-seats-per-hold of each (checked above), so comparing
        // pairs beats hashing them.
        let pairs: Vec<(&ShowId, &SeatId)> = contents.seats.pairs(home).collect();
        for (i, pair) in pairs.iter().enumerate() {
            if pairs[..i].contains(pair) {
                let (show, seat) = pair;
                return Err(Error::DuplicateSeat(if contents.seats.is_multi() {
                    format!("{show}/{seat}")
                } else {
                    seat.to_string()
                }));
            }
        }
        for (i, p) in contents.pools.iter().enumerate() {
            if contents.pools[..i]
                .iter()
                .any(|q| q.show == p.show && q.pool == p.pool)
            {
                return Err(Error::InvalidRequest(format!(
                    "pool {}/{} is named more than once",
                    p.show, p.pool
                )));
            }
        }
        Ok(())
    }

    /// Counts a granted hold and schedules the sweep of its shows.
    fn granted(&self, contents: &Contents, tail: &Tail, shows: &[ShowId], ttl: u64) {
        self.counted(contents, tail);
        self.schedule_sweep(shows, ttl);
    }

    /// Counts a granted hold and its `held` events.
    fn counted(&self, contents: &Contents, tail: &Tail) {
        count(m::HOLDS, 1);
        count(m::SEATS_HELD, contents.seats.len() as u64);
        let units: u64 = contents.pools.iter().map(|p| u64::from(p.quantity)).sum();
        count(m::POOL_UNITS_HELD, units);
        tail.count_events("held");
    }

    /// A hold's recorded outcome `201 <token> <fence> <at>`, answered again
    /// with the hold's current remaining time while it lives.
    async fn replay_hold(
        &self,
        deadline: &Deadline,
        home: &ShowId,
        contents: Contents,
        recorded: &Recorded,
    ) -> Result<Hold, Error> {
        let token = HoldToken::parse(recorded.fields.first().map_or("", String::as_str))?;
        let fence = recorded.int(1)?;
        let lookup = self.lookup(deadline, home, &token, None, false).await?;
        let pttl = match lookup.found {
            Found::Hold(rec) => rec.pttl,
            // Gone (released, sold or expired): no time left, lest the
            // client think it still holds the seats.
            _ => 0,
        };
        Ok(Hold::new(
            token,
            home.clone(),
            contents,
            fence,
            pttl,
            lookup.now_ms,
        ))
    }

    /// Releases (or forestalls) in the background the hold `token` whose
    /// request ended without an answer (503, or dropped with its client)
    /// after its script may have reached Redis, until that succeeds or the
    /// hold would have expired anyway.
    fn abandon_later(&self, token: HoldToken, keys: Vec<String>, ttl_ms: u64, tail: Tail) {
        // Called from a drop, which can happen outside a runtime (at exit).
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "no runtime to abandon a hold left without an answer; it expires by itself"
            );
            return;
        };
        let cluster = Arc::clone(&self.cluster);
        let mut running = self.orphans.start(token.ref_number());
        runtime.spawn(async move {
            let give_up = Instant::now() + Duration::from_millis(ttl_ms);
            let mut backoff = Duration::from_millis(50);
            loop {
                let deadline = cluster.deadline();
                let script = &cluster.scripts().abandon;
                let attempt = cluster.eval(&deadline, script, &keys, |c| {
                    c.arg(token.as_str()).arg(ttl_ms);
                    tail.push(c);
                });
                // At shutdown an attempt starts again with a whole Redis
                // timeout, which the drain gives it (the script is safe to
                // run twice).
                let Some(done): Option<Result<i64, Error>> = running.unless_closing(attempt).await
                else {
                    continue;
                };
                match done {
                    Ok(released) => {
                        count(m::ORPHAN_RELEASES, 1);
                        if released == 1 {
                            tail.count_events("released");
                        }
                        tracing::info!(released = released == 1, "abandoned a hold left without an answer");
                        return;
                    }
                    Err(err) if Instant::now() >= give_up => {
                        tracing::warn!(error = %err, "gave up abandoning a hold left without an answer; it expires by itself");
                        return;
                    }
                    Err(_) => {
                        running.pause(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
        });
    }
}

/// What [`Service::grant_keys`] lays out.
struct HoldKeys {
    /// Every key of the script, in its order.
    keys: Vec<String>,
    seat_keys: Vec<String>,
    /// The involved shows, sorted.
    shows: Vec<ShowId>,
    /// Fence keys (only with events off).
    fences: usize,
    tail: Tail,
}

/// A hold script in flight for a request without an `Idempotency-Key`.
/// Dropped while armed (the request failed after its script may have run,
/// or the request itself was dropped because its client went away), it has
/// the hold abandoned in the background: nobody else will ever learn its
/// token.
struct InFlight<'a> {
    service: &'a Service,
    token: &'a HoldToken,
    seat_keys: &'a [String],
    home: &'a ShowId,
    contents: &'a Contents,
    shows: &'a [ShowId],
    ttl_ms: u64,
    /// Abandon the hold (no idempotency key: nobody can find it again).
    armed: bool,
    /// Sweep its shows when it expires (an idempotency key keeps it for the
    /// client's retry, which may never come; no other instance has its
    /// deadline, and Redis's expiry notification can be seconds late).
    sweep: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.sweep {
            self.service.schedule_sweep(self.shows, self.ttl_ms);
        }
        if !self.armed {
            return;
        }
        let s = self.service;
        let tail = Tail::new(s, self.home, self.contents, self.token, false);
        let mut keys = Vec::with_capacity(1 + self.seat_keys.len() + tail.keys.len());
        keys.push(s.keys.hold_record(self.home, self.token));
        keys.extend(self.seat_keys.iter().cloned());
        keys.extend(tail.keys.iter().cloned());
        if s.limits.events_max_len.is_none() {
            // With events off: the claim of the expiry its tombstone would
            // otherwise count (abandon.lua).
            keys.push(s.keys.expiry_claim(self.home, self.token));
        }
        s.abandon_later(self.token.clone(), keys, self.ttl_ms, tail);
    }
}

/// Whether a seat view may answer a hold of `contents`: seats of one show,
/// no pool, no holder, no outcome to record under an idempotency key.
fn view_may_answer(contents: &Contents, idem: Option<&Idem>) -> bool {
    matches!(
        (&contents.seats, &contents.holder, idem),
        (Seats::Show(_), None, None)
    ) && contents.pools.is_empty()
}

/// What a 409 of Redis says about its seats that a seat view may learn:
/// only sold seats. A held seat may be held by a writer outside seathold
/// (the reference design's raw `SET … NX PX`), whose release writes no
/// event; a sale is always seathold's own.
fn sold(taken: &[Taken]) -> Vec<SeatId> {
    taken
        .iter()
        .filter(|t| t.state == "sold")
        .map(|t| t.seat.clone())
        .collect()
}

/// Whether the script of a request that failed with `err` may have run:
/// it timed out, or its connection broke after sending.
fn may_have_run(err: &Error) -> bool {
    matches!(
        err,
        Error::RedisUnavailable(RedisFault::Timeout | RedisFault::Io, _)
    )
}
