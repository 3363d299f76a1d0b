//! Changing a live hold by token: extend, release, confirm.

use redis::Value;

use super::lookup::{Found, Record};
use super::plan::{ints, replay_of, Tail};
use super::{count, Answer, Service};
use crate::cluster::{Deadline, Wait};
use crate::error::Error;
use crate::idempotency::{Idem, Recorded};
use crate::ids::{HoldToken, ShowId};
use crate::metrics as m;
use crate::model::{Confirmation, Contents, Hold};

impl Service {
    /// The live hold `token` that an extend or a change (PATCH) acts on, or
    /// the answer its `Idempotency-Key` recorded, replayed (as an extend
    /// answers, the expiry current).
    pub(super) async fn live_hold(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Result<Record, Answer<Hold>>, Error> {
        let lookup = self.lookup(deadline, show, token, idem, false).await?;
        if let (Some(recorded), Some(idem)) = (lookup.recorded, idem) {
            let recorded = Recorded::parse(&recorded, idem)?;
            let hold = replay_extend(
                show,
                token.clone(),
                Some(lookup.found),
                lookup.now_ms,
                &recorded,
            )?;
            return Ok(Err(Answer::replayed(hold)));
        }
        match lookup.found {
            Found::Hold(rec) => Ok(Ok(rec)),
            _ => Err(Error::HoldNotFound),
        }
    }

    /// The hold record's key, the key of every seat of the hold, then the
    /// tail's keys.
    fn hold_keys(
        &self,
        show: &ShowId,
        token: &HoldToken,
        contents: &Contents,
        tail: &Tail,
    ) -> Vec<String> {
        let mut key_list = Vec::with_capacity(3 + contents.seats.len() + tail.keys.len());
        key_list.push(self.keys.hold_record(show, token));
        key_list.extend(
            contents
                .seats
                .pairs(show)
                .map(|(s, seat)| self.keys.seat(s, seat)),
        );
        key_list.extend(tail.keys.iter().cloned());
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
            rec.contents,
            rec.fence,
            rec.pttl,
            rec.now_ms,
        ))
    }

    /// Sets the remaining time of hold `token` to `ttl_ms`.
    ///
    /// Extend, release and confirm act on the hold as read by its lookup;
    /// their scripts refuse (-7) when the record's fence has changed since
    /// (a PATCH came in between, and the keys read may miss its seats),
    /// and the hold is read again, as [`Service::modify`] does. The
    /// request's deadline bounds the rounds.
    pub async fn extend(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        ttl_ms: Option<u64>,
        idem: Option<&Idem>,
    ) -> Result<Answer<Hold>, Error> {
        let ttl = self.ttl(ttl_ms)?;
        until_unchanged(|| self.extend_once(deadline, show, &token, ttl, idem)).await
    }

    /// One round of [`Service::extend`]: `None` when the hold changed
    /// between its lookup and the script.
    async fn extend_once(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        ttl: u64,
        idem: Option<&Idem>,
    ) -> Result<Option<Answer<Hold>>, Error> {
        let token = token.clone();
        let rec = match self.live_hold(deadline, show, &token, idem).await? {
            Ok(rec) => rec,
            Err(replayed) => return Ok(Some(replayed)),
        };
        let run = self.run_key(idem);
        let tail = Tail::new(self, show, &rec.contents, &token, false);
        let mut key_list = self.hold_keys(show, &token, &rec.contents, &tail);
        key_list.push(self.keys.idempotency(show, run.idem.key.as_str()));
        let max = self.limits.max_hold_lifetime_ms;
        let reply: Result<Vec<Value>, Error> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().extend, &key_list, |c| {
                c.arg(token.as_str())
                    .arg(ttl)
                    .arg(max)
                    .arg(&run.idem.fingerprint)
                    .arg(run.ttl_ms);
                tail.push(c);
                c.arg(rec.fence);
            })
            .await;
        self.changed_here(show, &rec.contents);
        let reply = reply?;
        if let Some((recorded, now)) = replay_of(&reply) {
            // A resend of this very script (under the daemon's own key), or
            // a concurrent twin of this request that won the race: the
            // record and Redis's time of this reply tell the expiry.
            let recorded = Recorded::parse(&recorded, &run.idem)?;
            let now = now.unwrap_or(rec.now_ms);
            let hold = replay_extend(show, token, None, now, &recorded)?;
            if run.own {
                // The first run's answer: counted and swept as it would
                // have been, at the expiry it set.
                count(m::EXTENDS, 1);
                tail.count_events("extended");
                let shows: Vec<ShowId> = rec.contents.by_show(show).into_keys().collect();
                self.schedule_sweep(&shows, u64::try_from(hold.expires_in_ms).unwrap_or(ttl));
            }
            return Ok(Some(Answer::replayed_under(hold, &run)));
        }
        match ints(&reply).unwrap_or_default().as_slice() {
            [1, fence, pttl, now] => {
                count(m::EXTENDS, 1);
                tail.count_events("extended");
                let shows: Vec<ShowId> = rec.contents.by_show(show).into_keys().collect();
                self.schedule_sweep(&shows, ttl);
                Ok(Some(Answer::fresh(Hold::new(
                    token,
                    show.clone(),
                    rec.contents,
                    *fence,
                    *pttl,
                    *now,
                ))))
            }
            [-7] => Ok(None),
            [0] => Err(Error::HoldNotFound),
            [-1, created, now] => Err(Error::LifetimeExceeded {
                max_ms: max,
                remaining_ms: i64::try_from(max).unwrap_or(i64::MAX) - (now - created),
            }),
            _ => Err(Error::Internal(format!(
                "unexpected reply of extend.lua: {reply:?}"
            ))),
        }
    }

    /// Releases hold `token`: its seats become free where they still carry
    /// it, its pool units go back.
    /// Looks again when a PATCH changed the hold meanwhile (see
    /// [`Service::extend`]).
    pub async fn release(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Answer<()>, Error> {
        until_unchanged(|| self.release_once(deadline, show, &token, idem)).await
    }

    /// One round of [`Service::release`].
    async fn release_once(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Option<Answer<()>>, Error> {
        let lookup = self.lookup(deadline, show, token, idem, false).await?;
        if let (Some(recorded), Some(idem)) = (lookup.recorded, idem) {
            Recorded::parse(&recorded, idem)?;
            return Ok(Some(Answer::replayed(())));
        }
        let Found::Hold(rec) = lookup.found else {
            return Err(Error::HoldNotFound);
        };
        let run = self.run_key(idem);
        let tail = Tail::new(self, show, &rec.contents, token, false);
        let mut key_list = self.hold_keys(show, token, &rec.contents, &tail);
        key_list.push(self.keys.idempotency(show, run.idem.key.as_str()));
        let reply: Result<Value, Error> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().release, &key_list, |c| {
                c.arg(token.as_str())
                    .arg(&run.idem.fingerprint)
                    .arg(run.ttl_ms);
                tail.push(c);
                c.arg(rec.fence);
            })
            .await;
        self.changed_here(show, &rec.contents);
        let reply = reply?;
        match reply {
            Value::Int(1) => {
                count(m::RELEASES, 1);
                tail.count_events("released");
                Ok(Some(Answer::fresh(())))
            }
            Value::Int(-7) => Ok(None),
            Value::Int(0) => Err(Error::HoldNotFound),
            Value::Array(reply) => {
                let (recorded, _) = replay_of(&reply)
                    .ok_or_else(|| Error::Internal("unexpected reply of release.lua".into()))?;
                Recorded::parse(&recorded, &run.idem)?;
                if run.own {
                    // The first run's answer: counted as it would have been.
                    count(m::RELEASES, 1);
                    tail.count_events("released");
                }
                Ok(Some(Answer::replayed_under((), &run)))
            }
            other => Err(Error::Internal(format!(
                "unexpected reply of release.lua: {other:?}"
            ))),
        }
    }

    /// Sells hold `token`, then waits for replicas to have the sale (see
    /// [`crate::cluster::Cluster::eval_and_wait`]). A confirmed token
    /// confirms again with the same answer; so does a repeat under the same
    /// `idem`, which confirms and waits again, so that its 200 still means
    /// "replicated". Looks again when a PATCH changed the hold meanwhile
    /// (see [`Service::extend`]).
    pub async fn confirm(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Answer<Confirmation>, Error> {
        until_unchanged(|| self.confirm_once(deadline, show, &token, idem)).await
    }

    /// One round of [`Service::confirm`].
    async fn confirm_once(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Option<Answer<Confirmation>>, Error> {
        let token = token.clone();
        let lookup = self.lookup(deadline, show, &token, idem, true).await?;
        let replayed = match (lookup.recorded, idem) {
            (Some(recorded), Some(idem)) => {
                Recorded::parse(&recorded, idem)?;
                true
            }
            _ => false,
        };
        let rec = match lookup.found {
            Found::Hold(rec) | Found::Sale(rec) => rec,
            Found::Nothing => return Err(Error::HoldNotFound),
        };
        let tail = Tail::new(self, show, &rec.contents, &token, false);
        let mut key_list = self.hold_keys(show, &token, &rec.contents, &tail);
        key_list.insert(1, self.keys.sale_record(show, &token));
        // A replay confirms again without recording again.
        let (idem_key, fingerprint) = self.idem_args(show, idem.filter(|_| !replayed));
        key_list.extend(idem_key);
        let wait = Wait {
            replicas: self.limits.confirm_wait_replicas,
            timeout_ms: self.limits.confirm_wait_timeout_ms,
        };
        let answered = self
            .cluster
            .eval_and_wait(
                deadline,
                &self.cluster.scripts().confirm,
                &key_list,
                |c| {
                    c.arg(token.as_str())
                        .arg(fingerprint)
                        .arg(self.limits.idempotency_ttl_ms);
                    tail.push(c);
                    c.arg(rec.fence);
                },
                // Nothing was sold when the hold is gone or changed: no WAIT.
                |reply: &Vec<i64>| (!matches!(reply.first(), Some(0 | -3 | -7))).then_some(wait),
            )
            .await;
        self.changed_here(show, &rec.contents);
        // A failure is not recorded (API 1.1): the script may have recorded
        // this key's 200 before the WAIT fell short or the deadline passed.
        let recording = idem.filter(|_| !replayed);
        let (reply, replicas): (Vec<i64>, i64) = match answered {
            Ok(answered) => answered,
            Err(err) => {
                if let Some(idem) = recording {
                    self.forget_idempotency(show, idem, None).await;
                }
                return Err(err);
            }
        };
        let (first, fence) = match reply.as_slice() {
            [0] => return Err(Error::HoldNotFound),
            // Changed since it was read, or its key recorded since it was
            // looked up (a concurrent request under the same key): read
            // both again.
            [-7 | -3] => return Ok(None),
            [state @ (1 | 2), fence] => (*state == 1, *fence),
            other => {
                return Err(Error::Internal(format!(
                    "unexpected reply of confirm.lua: {other:?}"
                )))
            }
        };
        if first {
            count(m::CONFIRMS, 1);
            tail.count_events("confirmed");
        }
        let confirmation = Confirmation {
            hold_token: token,
            show: show.clone(),
            pools: rec.contents.pools_view(),
            seats: rec.contents.seats,
            fence,
            replicas,
        };
        if replicas < i64::from(wait.replicas) {
            count(m::CONFIRMS_NOT_REPLICATED, 1);
            tracing::warn!(%show, replicas, wanted = wait.replicas, "confirm not replicated in time");
            if let Some(idem) = recording {
                self.forget_idempotency(show, idem, Some(deadline)).await;
            }
            return Err(Error::NotReplicated(Box::new(confirmation)));
        }
        Ok(Some(if replayed {
            Answer::replayed(confirmation)
        } else {
            Answer::fresh(confirmation)
        }))
    }
}

impl Service {
    /// Removes what a confirm recorded under `idem` when it is answered
    /// with a failure, so that the retry runs again as a fresh request
    /// (and records its own answer); a record of another request under
    /// the same key stays (`lua/forget.lua`). Best effort: when Redis cannot be
    /// reached the record stays, and the retry, which confirms and waits
    /// again anyway, is marked replayed. Awaited within the request's
    /// `deadline` after a `WAIT` fell short (Redis answers, and the retry
    /// must find no record; the WAIT left time for this); in the
    /// background after a Redis failure (`None`), so that the 503 is not
    /// delayed by a second wait on a Redis that did not answer.
    async fn forget_idempotency(&self, show: &ShowId, idem: &Idem, deadline: Option<&Deadline>) {
        let keys = [self.keys.idempotency(show, idem.key.as_str())];
        let fingerprint = idem.fingerprint.clone();
        let cluster = std::sync::Arc::clone(&self.cluster);
        let show = show.clone();
        let within = deadline.copied();
        let forget = async move {
            let deadline = within.unwrap_or_else(|| cluster.deadline());
            let script = &cluster.scripts().forget;
            let forgot: Result<i64, Error> = cluster
                .eval(&deadline, script, &keys, |c| {
                    c.arg(&fingerprint);
                })
                .await;
            if let Err(err) = forgot {
                tracing::warn!(%show, error = %err, "could not remove the idempotency record of a failed confirm");
            }
        };
        if within.is_some() {
            forget.await;
        } else {
            tokio::spawn(forget);
        }
    }
}

/// Runs `round` (read the hold, then change it in a script that checks the
/// fence it read) until a round answers: `None` means a concurrent change
/// came between the read and the script. Every round's Redis work is bound
/// by the request's deadline, which ends the rounds.
pub(super) async fn until_unchanged<T, F, Fut>(mut round: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Error>>,
{
    loop {
        if let Some(answer) = round().await? {
            return Ok(answer);
        }
    }
}

/// An extend's recorded outcome `200 <fence> <at> <kind> <items>`, answered
/// again with the hold's current remaining time while it lives. `found` is
/// what a lookup found of the hold; `None` when none was made (the script
/// itself answered the record), and then the recorded expiry tells.
pub(super) fn replay_extend(
    show: &ShowId,
    token: HoldToken,
    found: Option<Found>,
    now_ms: i64,
    recorded: &Recorded,
) -> Result<Hold, Error> {
    let (fence, at) = (recorded.int(0)?, recorded.int(1)?);
    let unreadable = || Error::Internal("unreadable idempotency record of an extend".into());
    // The recorded seats and pools, which go with the recorded fence, even
    // when the hold changed again since; only the expiry is current.
    let kind = recorded.fields.get(2).ok_or_else(unreadable)?;
    let contents = Contents::decode(kind, &recorded.rest(3), show).ok_or_else(unreadable)?;
    let pttl = match found {
        Some(Found::Hold(rec)) => rec.pttl,
        // Gone (released, sold or expired): no time left, whatever the
        // record says, lest the client think it still holds the seats.
        Some(_) => 0,
        None => (at - now_ms).max(0),
    };
    Ok(Hold::new(
        token,
        show.clone(),
        contents,
        fence,
        pttl,
        now_ms,
    ))
}
