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
use crate::idempotency::{Idem, Recorded};
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
    /// How long the outcome under an `Idempotency-Key` is kept.
    pub idempotency_ttl_ms: u64,
}

/// How long the daemon's own idempotency record of a release is kept: long
/// enough for any resend of its script within one request's deadline.
const INTERNAL_IDEMPOTENCY_TTL_MS: u64 = 60_000;

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

/// A lookup's answer: the hold, Redis's clock, and the idempotency record
/// of the request, if one was asked for and exists.
struct Lookup {
    found: Found,
    now_ms: i64,
    recorded: Option<String>,
}

/// The integers of a script's reply, or `None` when one element is not.
fn ints(reply: &[Value]) -> Option<Vec<i64>> {
    reply
        .iter()
        .map(|v| match v {
            Value::Int(i) => Some(*i),
            _ => None,
        })
        .collect()
}

/// A reply's string element (an idempotency record).
fn text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok(),
        Some(Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The `{-3, record}` reply of a write script whose idempotency record
/// already exists.
fn replay_of(reply: &[Value]) -> Option<String> {
    match reply {
        [Value::Int(-3), record] => text(Some(record)),
        _ => None,
    }
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

    /// The idempotency key of `idem` under `show`, and the script
    /// arguments that go with it: fingerprint and TTL, or "" when none.
    fn idem_args<'a>(&self, show: &ShowId, idem: Option<&'a Idem>) -> (Option<String>, &'a str) {
        match idem {
            Some(idem) => (
                Some(self.keys.idempotency(show, idem.key.as_str())),
                idem.fingerprint.as_str(),
            ),
            None => (None, ""),
        }
    }

    /// Holds `seats`, all or nothing. `home` is the show whose routes
    /// serve the hold afterwards. With `idem`, the outcome is recorded in
    /// the same script and a repeat answers it again.
    pub async fn hold(
        &self,
        deadline: &Deadline,
        home: &ShowId,
        seats: Seats,
        ttl_ms: Option<u64>,
        idem: Option<&Idem>,
    ) -> Result<Answer<Hold>, Error> {
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
        let seat_keys: Vec<String> = pairs
            .iter()
            .map(|&(show, seat)| self.keys.seat(show, seat))
            .collect();
        let mut key_list = Vec::with_capacity(2 + shows.len() + seats.len());
        key_list.push(self.keys.hold_record(home, &token));
        key_list.extend(shows.iter().map(|show| self.keys.fence(show)));
        key_list.extend(seat_keys.iter().cloned());
        if shows.len() > 1 {
            check_one_slot(&key_list, shows.len(), &pairs)?;
        }
        let (idem_key, fingerprint) = self.idem_args(home, idem);
        key_list.extend(idem_key);

        let encoded = seats.encode(home);
        let fences = shows.len();
        // Without a key, no one can find this hold again unless its answer
        // arrives: abandon it when the script may have run but the request
        // ends without that answer, by a 503 or by being dropped (the client
        // closed its connection first).
        let mut in_flight = HoldInFlight {
            service: self,
            token: &token,
            record: &key_list[0],
            seats: &seat_keys,
            ttl_ms: ttl,
            armed: idem.is_none(),
        };
        let reply: Result<Vec<Value>, Error> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().hold, &key_list, |c| {
                c.arg(token.as_str())
                    .arg(ttl)
                    .arg(fences)
                    .arg(seats.kind())
                    .arg(&encoded)
                    .arg(fingerprint)
                    .arg(self.limits.idempotency_ttl_ms);
            })
            .await;
        in_flight.armed &= reply.as_ref().is_err_and(may_have_run);
        drop(in_flight);
        let reply = reply?;
        if let (Some(recorded), Some(idem)) = (replay_of(&reply), idem) {
            let recorded = Recorded::parse(&recorded, idem)?;
            return self.replay_hold(deadline, home, seats, &recorded).await;
        }
        match ints(&reply).unwrap_or_default().as_slice() {
            [1, fence, pttl, now] => {
                count(m::HOLDS, 1);
                count(m::SEATS_HELD, seats.len() as u64);
                Ok(Answer::fresh(Hold::new(
                    token,
                    home.clone(),
                    seats,
                    *fence,
                    *pttl,
                    *now,
                )))
            }
            [0, rest @ ..] if !rest.is_empty() && rest.len() % 3 == 0 => {
                count(m::HOLD_CONFLICTS, 1);
                Err(Error::SeatsTaken(taken(rest, &pairs, seats.is_multi())))
            }
            _ => Err(Error::Internal(format!(
                "unexpected reply of hold.lua: {reply:?}"
            ))),
        }
    }

    /// A hold's recorded outcome `201 <token> <fence> <at>`, answered again
    /// with the hold's current remaining time while it lives.
    async fn replay_hold(
        &self,
        deadline: &Deadline,
        home: &ShowId,
        seats: Seats,
        recorded: &Recorded,
    ) -> Result<Answer<Hold>, Error> {
        let token = HoldToken::parse(recorded.fields.first().map_or("", String::as_str))?;
        let (fence, at) = (recorded.int(1)?, recorded.int(2)?);
        let lookup = self.lookup(deadline, home, &token, None, false).await?;
        let pttl = match lookup.found {
            Found::Hold(rec) => rec.pttl,
            _ => (at - lookup.now_ms).max(0),
        };
        Ok(Answer::replayed(Hold::new(
            token,
            home.clone(),
            seats,
            fence,
            pttl,
            lookup.now_ms,
        )))
    }

    /// Releases (or forestalls) in the background the hold `token` whose
    /// request ended without an answer (503, or dropped with its client)
    /// after its script may have reached Redis, until that succeeds or the
    /// hold would have expired anyway. `keys` are the record's and the
    /// seats'.
    fn abandon_later(&self, token: HoldToken, keys: Vec<String>, ttl_ms: u64) {
        // Called from a drop, which can happen outside a runtime (at exit).
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "no runtime to abandon a hold left without an answer; it expires by itself"
            );
            return;
        };
        let cluster = Arc::clone(&self.cluster);
        runtime.spawn(async move {
            let give_up = std::time::Instant::now() + std::time::Duration::from_millis(ttl_ms);
            let mut backoff = std::time::Duration::from_millis(50);
            loop {
                let deadline = cluster.deadline();
                let script = &cluster.scripts().abandon;
                let done: Result<i64, Error> = cluster
                    .eval(&deadline, script, &keys, |c| {
                        c.arg(token.as_str()).arg(ttl_ms);
                    })
                    .await;
                match done {
                    Ok(released) => {
                        count(m::ORPHAN_RELEASES, 1);
                        tracing::info!(released = released == 1, "abandoned a hold left without an answer");
                        return;
                    }
                    Err(err) if std::time::Instant::now() >= give_up => {
                        tracing::warn!(error = %err, "gave up abandoning a hold left without an answer; it expires by itself");
                        return;
                    }
                    Err(_) => {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(std::time::Duration::from_secs(1));
                    }
                }
            }
        });
    }

    /// Reads the hold `token` (and its sale, with `with_sale`), and the
    /// record under `idem`'s key when given.
    async fn lookup(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        idem: Option<&Idem>,
        with_sale: bool,
    ) -> Result<Lookup, Error> {
        let mut key_list = vec![
            self.keys.hold_record(show, token),
            self.keys.sale_record(show, token),
        ];
        key_list.extend(self.idem_args(show, idem).0);
        let reply: Vec<Value> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().lookup, &key_list, |c| {
                c.arg(if with_sale { "1" } else { "0" });
            })
            .await?;
        let int = |v: Option<&Value>| match v {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        };
        let unreadable = || Error::Internal(format!("unreadable reply of lookup.lua for {show}"));
        let found = int(reply.first()).ok_or_else(unreadable)?;
        let now_ms = int(reply.get(2)).ok_or_else(unreadable)?;
        let recorded = text(reply.get(4));
        if found == 0 {
            return Ok(Lookup {
                found: Found::Nothing,
                now_ms,
                recorded,
            });
        }
        // "<fence> <created_ms> <kind> <seats>", see lua/hold.lua.
        let raw = text(reply.get(3)).ok_or_else(unreadable)?;
        let mut parts = raw.splitn(4, ' ');
        let (Some(fence), Some(_created), Some(kind), Some(encoded)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(unreadable());
        };
        let record = Record {
            pttl: int(reply.get(1)).unwrap_or(-1),
            now_ms,
            seats: Seats::decode(kind, encoded, show).ok_or_else(unreadable)?,
            fence: fence.parse().map_err(|_| unreadable())?,
        };
        let found = if found == 1 {
            Found::Hold(record)
        } else {
            Found::Sale(record)
        };
        Ok(Lookup {
            found,
            now_ms,
            recorded,
        })
    }

    /// The hold record's key, then the key of every seat of the hold.
    fn record_and_seat_keys(&self, show: &ShowId, token: &HoldToken, seats: &Seats) -> Vec<String> {
        let mut key_list = Vec::with_capacity(3 + seats.len());
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
        match self
            .lookup(deadline, show, &token, None, false)
            .await?
            .found
        {
            Found::Hold(rec) => Ok(Hold::new(
                token,
                show.clone(),
                rec.seats,
                rec.fence,
                rec.pttl,
                rec.now_ms,
            )),
            _ => Err(Error::HoldNotFound),
        }
    }

    /// Sets the remaining time of hold `token` to `ttl_ms`.
    pub async fn extend(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        ttl_ms: Option<u64>,
        idem: Option<&Idem>,
    ) -> Result<Answer<Hold>, Error> {
        let ttl = self.ttl(ttl_ms)?;
        let lookup = self.lookup(deadline, show, &token, idem, false).await?;
        if let (Some(recorded), Some(idem)) = (lookup.recorded, idem) {
            let recorded = Recorded::parse(&recorded, idem)?;
            return replay_extend(show, token, lookup.found, lookup.now_ms, &recorded);
        }
        let Found::Hold(rec) = lookup.found else {
            return Err(Error::HoldNotFound);
        };
        let mut key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        let (idem_key, fingerprint) = self.idem_args(show, idem);
        key_list.extend(idem_key);
        let max = self.limits.max_hold_lifetime_ms;
        let reply: Vec<Value> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().extend, &key_list, |c| {
                c.arg(token.as_str())
                    .arg(ttl)
                    .arg(max)
                    .arg(fingerprint)
                    .arg(self.limits.idempotency_ttl_ms);
            })
            .await?;
        if let (Some(recorded), Some(idem)) = (replay_of(&reply), idem) {
            // A concurrent twin of this request won the race.
            let recorded = Recorded::parse(&recorded, idem)?;
            return replay_extend(show, token, Found::Hold(rec), lookup.now_ms, &recorded);
        }
        match ints(&reply).unwrap_or_default().as_slice() {
            [1, fence, pttl, now] => {
                count(m::EXTENDS, 1);
                Ok(Answer::fresh(Hold::new(
                    token,
                    show.clone(),
                    rec.seats,
                    *fence,
                    *pttl,
                    *now,
                )))
            }
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

    /// Releases hold `token`: its seats become free where they still carry it.
    pub async fn release(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Answer<()>, Error> {
        let lookup = self.lookup(deadline, show, &token, idem, false).await?;
        if let (Some(recorded), Some(idem)) = (lookup.recorded, idem) {
            Recorded::parse(&recorded, idem)?;
            return Ok(Answer::replayed(()));
        }
        let Found::Hold(rec) = lookup.found else {
            return Err(Error::HoldNotFound);
        };
        // Without a client's key, a key of the daemon's own: a resend of the
        // script then finds it and answers 204 as the first run did.
        let internal;
        let (idem, ttl, own_key) = match idem {
            Some(idem) => (idem, self.limits.idempotency_ttl_ms, false),
            None => {
                internal = Idem::internal();
                (&internal, INTERNAL_IDEMPOTENCY_TTL_MS, true)
            }
        };
        let mut key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        key_list.push(self.keys.idempotency(show, idem.key.as_str()));
        let reply: Value = self
            .cluster
            .eval(deadline, &self.cluster.scripts().release, &key_list, |c| {
                c.arg(token.as_str()).arg(&idem.fingerprint).arg(ttl);
            })
            .await?;
        match reply {
            Value::Int(1) => {
                count(m::RELEASES, 1);
                Ok(Answer::fresh(()))
            }
            Value::Int(0) => Err(Error::HoldNotFound),
            Value::Array(reply) => {
                let recorded = replay_of(&reply)
                    .ok_or_else(|| Error::Internal("unexpected reply of release.lua".into()))?;
                Recorded::parse(&recorded, idem)?;
                // The daemon's own resend is no replay for the client.
                Ok(if own_key {
                    count(m::RELEASES, 1);
                    Answer::fresh(())
                } else {
                    Answer::replayed(())
                })
            }
            other => Err(Error::Internal(format!(
                "unexpected reply of release.lua: {other:?}"
            ))),
        }
    }

    /// Sells hold `token`, then waits for replicas to have the sale (see
    /// [`Cluster::eval_and_wait`]). A confirmed token confirms again with the
    /// same answer; so does a repeat under the same `idem`, which confirms
    /// and waits again, so that its 200 still means "replicated".
    pub async fn confirm(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: HoldToken,
        idem: Option<&Idem>,
    ) -> Result<Answer<Confirmation>, Error> {
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
        let mut key_list = self.record_and_seat_keys(show, &token, &rec.seats);
        key_list.insert(1, self.keys.sale_record(show, &token));
        let (idem_key, fingerprint) = self.idem_args(show, idem);
        // A replay confirms again without recording again.
        let (idem_key, fingerprint) = if replayed {
            (None, "")
        } else {
            (idem_key, fingerprint)
        };
        key_list.extend(idem_key);
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
                    c.arg(token.as_str())
                        .arg(fingerprint)
                        .arg(self.limits.idempotency_ttl_ms);
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
        Ok(if replayed {
            Answer::replayed(confirmation)
        } else {
            Answer::fresh(confirmation)
        })
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

/// A hold script in flight for a request without an `Idempotency-Key`.
/// Dropped while armed (the request failed after its script may have run,
/// or the request itself was dropped because its client went away), it has
/// the hold abandoned in the background: no one else will ever learn its
/// token.
struct HoldInFlight<'a> {
    service: &'a Service,
    token: &'a HoldToken,
    record: &'a str,
    seats: &'a [String],
    ttl_ms: u64,
    armed: bool,
}

impl Drop for HoldInFlight<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut keys = Vec::with_capacity(1 + self.seats.len());
            keys.push(self.record.to_owned());
            keys.extend(self.seats.iter().cloned());
            self.service
                .abandon_later(self.token.clone(), keys, self.ttl_ms);
        }
    }
}

/// Whether the script of a request that failed with `err` may have run:
/// it timed out, or its connection broke after sending.
fn may_have_run(err: &Error) -> bool {
    use crate::cluster::RedisFault;
    matches!(
        err,
        Error::RedisUnavailable(RedisFault::Timeout | RedisFault::Io, _)
    )
}

/// An extend's recorded outcome `200 <fence> <at> <kind> <seats>`, answered
/// again with the hold's current remaining time while it lives.
fn replay_extend(
    show: &ShowId,
    token: HoldToken,
    found: Found,
    now_ms: i64,
    recorded: &Recorded,
) -> Result<Answer<Hold>, Error> {
    let (fence, at) = (recorded.int(0)?, recorded.int(1)?);
    let unreadable = || Error::Internal("unreadable idempotency record of an extend".into());
    let (seats, pttl) = match found {
        Found::Hold(rec) => (rec.seats, rec.pttl),
        _ => {
            let kind = recorded.fields.get(2).ok_or_else(unreadable)?;
            let seats = Seats::decode(kind, &recorded.rest(3), show).ok_or_else(unreadable)?;
            (seats, (at - now_ms).max(0))
        }
    };
    Ok(Answer::replayed(Hold::new(
        token,
        show.clone(),
        seats,
        fence,
        pttl,
        now_ms,
    )))
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
