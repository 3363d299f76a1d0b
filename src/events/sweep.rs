//! `expired` events, exactly once, within a second of the TTL.
//!
//! Every live hold is in its shows' deadline indexes (sorted sets scored with
//! its expiry, written by the same script as the hold). [`Sweeper`] runs
//! `lua/sweep.lua` for a show when its next deadline has passed; the script
//! removes each due entry and appends its event in one step, with Redis's
//! clock deciding what is due, so two instances can never both write one.
//!
//! Which shows to sweep, and when, comes from three places: this instance's
//! own holds and extends (their deadlines), Redis's keyspace notifications of
//! expired hold records (a hint, node-local and possibly late, that covers
//! the holds other instances made), and a scan of every master for deadline
//! indexes at start, whenever notifications may have been lost (a
//! subscription restarted, the slot map changed) and every
//! `--sweep-scan-interval-ms` (60 s), which covers notifications lost
//! unnoticed; the periodic scan of a master is made by one instance per
//! period, the one that takes the master's scan lease. A scan reads each
//! index's earliest deadline (a cheap read, pipelined) and schedules the
//! show then: sweeping every show found would cost one script run per show
//! with live holds every scan. A hold that expires while no instance runs
//! gets its event when one starts.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::ids::ShowId;
use crate::keys::KeySpace;
use crate::metrics as m;

/// How long after a deadline (on Redis's clock) its show is swept: a few
/// ms late rather than early, as the local clock and Redis's may differ by
/// a round trip, and Redis counts a hold due only after its expiry ms.
const LATE_MS: u64 = 5;

/// How long after the first of a burst of expiry notifications the
/// notified shows' deadlines are read, so that the burst shares one read
/// per master.
const CHECK_AFTER: Duration = Duration::from_millis(5);

/// A show already due this soon needs nothing more for an expiry
/// notification: its sweep expires every hold due by then.
const SWEEP_SOON: Duration = Duration::from_millis(50);

/// Most holds one sweep expires (the next sweep follows at once).
const BATCH: usize = 200;

/// Most sweeps in flight at once. Each waits a round trip to its master
/// (milliseconds at an on-sale's peak, behind the holds queued there), so
/// the sweeps run side by side: with 8 at a time and a batch waiting for
/// its slowest, 15,000 holds/s of 2 s on random shows expired at 3,000/s
/// and their events came seconds late.
const PARALLEL: usize = 256;

/// How long a master's sweeps wait after one failed, before one sweep tries
/// it again; doubled after each failed try, up to [`PAUSE_MAX`]. Without
/// the pause every due show of a master that refuses connections was
/// retried every 250 ms: with the whole cluster gone, 47,000 failed sweeps
/// (and as many log lines) a second and more than a core; with a master
/// that does not answer, all [`PARALLEL`] sweeps waited on it while the
/// other masters' expiries waited for a free place.
const PAUSE_FIRST: Duration = Duration::from_millis(250);
const PAUSE_MAX: Duration = Duration::from_secs(2);

/// Sweeps the deadline indexes of the shows that have some.
pub struct Sweeper {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    max_len: u64,
    /// When each known show's next deadline passes (local clock), and the
    /// holds this instance expired lately.
    due: Mutex<Due>,
    wake: Notify,
    /// Asks for a scan of the masters now (see [`Sweeper::rescan`]).
    rescan: Notify,
    /// Shows whose hold records Redis said expired, to read the earliest
    /// deadline of ([`Sweeper::check_notified`]).
    notified: Mutex<HashSet<ShowId>>,
    check: Notify,
    /// The pause between periodic scans.
    scan_every: Duration,
    /// This instance, in the scan leases it takes.
    instance: String,
}

/// How long a hold this instance expired is remembered: Redis's expiry
/// notification of its record, which comes after the record is deleted
/// (usually within a second, seconds under heavy expiry load), is then
/// known to need no sweep.
const REMEMBER: Duration = Duration::from_secs(10);

/// The refs of the holds this instance expired in the last [`REMEMBER`] to
/// twice that: two generations, the older dropped whole.
struct Recent {
    current: HashSet<u64>,
    older: HashSet<u64>,
    since: Instant,
}

impl Default for Recent {
    fn default() -> Self {
        Self {
            current: HashSet::new(),
            older: HashSet::new(),
            since: Instant::now(),
        }
    }
}

impl Recent {
    fn rotate(&mut self, now: Instant) {
        let age = now.duration_since(self.since);
        if age >= REMEMBER {
            self.older = std::mem::take(&mut self.current);
            if age >= REMEMBER * 2 {
                self.older.clear();
            }
            self.since = now;
        }
    }

    fn insert(&mut self, now: Instant, hold: u64) {
        self.rotate(now);
        self.current.insert(hold);
    }

    fn contains(&mut self, now: Instant, hold: u64) -> bool {
        self.rotate(now);
        self.current.contains(&hold) || self.older.contains(&hold)
    }
}

/// A hold ref (16 hex digits, as sweep.lua answers it) as a number, as
/// [`crate::ids::HoldToken::ref_number`] gives it.
fn ref_number(hold_ref: &str) -> Option<u64> {
    u64::from_str_radix(hold_ref, 16).ok()
}

/// The shows to sweep, by show and in deadline order: scheduling and taking
/// the next due shows cost a logarithm of the shows known, not their
/// number, as every hold schedules its show.
#[derive(Default)]
struct Due {
    by_show: HashMap<ShowId, Instant>,
    order: BTreeSet<(Instant, ShowId)>,
    /// Shows being swept now, with what came for them meanwhile: not
    /// started again until that sweep answers, and kept out of `order`, so
    /// taking the next due shows never steps over them.
    running: HashMap<ShowId, Meanwhile>,
    /// Holds this instance wrote the `expired` event of lately.
    expired: Recent,
    /// Masters whose last sweep failed, by address.
    paused: HashMap<Arc<str>, Paused>,
}

/// The sweeps of a master whose last sweep failed.
struct Paused {
    /// When one sweep may try the master again.
    until: Instant,
    /// The pause before `until`.
    pause: Duration,
    /// The show whose sweep is trying the master again: its answer ends
    /// the pause, or makes it longer.
    probe: Option<ShowId>,
    /// The master's other shows that came due meanwhile, due again when
    /// the pause ends.
    parked: Vec<ShowId>,
}

/// What a sweep came to.
#[derive(Debug, PartialEq)]
enum Swept {
    /// It answered: the holds it expired, and when the show's next deadline
    /// is due (`None`: its index is empty).
    Done {
        next: Option<Instant>,
        holds: Vec<u64>,
    },
    /// It failed (the master refused, did not answer in time, or is not
    /// known).
    Failed,
}

/// A change of a master's pause, to log outside the lock.
#[derive(Debug, PartialEq)]
enum PauseChange {
    Paused,
    Resumed { parked: usize },
}

/// What came for a show while it was being swept.
#[derive(Default)]
struct Meanwhile {
    /// The earliest time it was scheduled for.
    at: Option<Instant>,
    /// Holds whose records Redis said expired: a sweep again only for those
    /// this sweep did not expire.
    records: Vec<u64>,
}

impl Due {
    /// Sets `show` due at `at`, or earlier if it already was; answers
    /// whether `at` is now the earliest deadline of all (the loop must wake).
    /// A show being swept is only noted: the sweep's answer reschedules it.
    fn set(&mut self, show: &ShowId, at: Instant, only_earlier: bool) -> bool {
        if let Some(meanwhile) = self.running.get_mut(show) {
            meanwhile.at = Some(meanwhile.at.map_or(at, |a| a.min(at)));
            return false;
        }
        if let Some(old) = self.by_show.get(show).copied() {
            if only_earlier && at >= old {
                return false;
            }
            self.order.remove(&(old, show.clone()));
        }
        self.by_show.insert(show.clone(), at);
        self.order.insert((at, show.clone()));
        self.order.first().is_some_and(|(first, _)| *first == at)
    }

    /// Redis said the record of hold `hold` of `show` expired at or before
    /// `now`: answers whether the show may need a sweep now. Not when this
    /// instance wrote that hold's event already, nor while a sweep of the
    /// show runs (its answer tells whether it expired that hold), nor when
    /// one is due within [`SWEEP_SOON`].
    fn record_expired(&mut self, show: &ShowId, hold: u64, now: Instant) -> bool {
        if self.expired.contains(now, hold) {
            return false;
        }
        // A sweep of the show is due within moments anyway (this
        // instance's own hold, heard before its timer fired).
        if self
            .by_show
            .get(show)
            .is_some_and(|at| *at <= now + SWEEP_SOON)
        {
            return false;
        }
        match self.running.get_mut(show) {
            Some(meanwhile) => {
                meanwhile.records.push(hold);
                false
            }
            None => true,
        }
    }

    /// Takes up to `n` shows due by `now`, in deadline order, with their
    /// masters (`master_of`), and marks them running. A show of a paused
    /// master is parked instead, unless the pause is over and no other
    /// show is trying that master yet: then it is the one that tries.
    fn start(
        &mut self,
        now: Instant,
        n: usize,
        master_of: impl Fn(&ShowId) -> Arc<str>,
    ) -> Vec<(ShowId, Arc<str>)> {
        self.wake_paused(now);
        let mut shows = Vec::new();
        while shows.len() < n {
            match self.order.first() {
                Some((at, _)) if *at <= now => {}
                _ => break,
            }
            let Some((_, show)) = self.order.pop_first() else {
                break;
            };
            self.by_show.remove(&show);
            let master = master_of(&show);
            if let Some(paused) = self.paused.get_mut(&master) {
                if now < paused.until || paused.probe.is_some() {
                    paused.parked.push(show);
                    continue;
                }
                paused.probe = Some(show.clone());
            }
            self.running.insert(show.clone(), Meanwhile::default());
            shows.push((show, master));
        }
        shows
    }

    /// Makes one parked show of each master whose pause is over due now,
    /// to try the master again.
    fn wake_paused(&mut self, now: Instant) {
        let mut wake = Vec::new();
        for paused in self.paused.values_mut() {
            if paused.until <= now && paused.probe.is_none() {
                if let Some(show) = paused.parked.pop() {
                    wake.push(show);
                }
            }
        }
        for show in wake {
            self.set(&show, now, true);
        }
    }

    /// A sweep of `show` on `master` came to `swept` at `now`. Answered: it
    /// expired `holds`, and the show is due again at `next`, or earlier if
    /// it was scheduled for earlier while the sweep ran, or at once if Redis
    /// meanwhile said a record expired whose hold the sweep did not expire;
    /// a pause of its master ends. Failed: the master's sweeps pause (or
    /// pause longer, when this one was trying it again), and the show waits
    /// for the pause to end.
    fn finish(
        &mut self,
        show: &ShowId,
        master: &Arc<str>,
        swept: Swept,
        now: Instant,
    ) -> Option<PauseChange> {
        let meanwhile = self.running.remove(show).unwrap_or_default();
        let Swept::Done { next, holds } = swept else {
            // What Redis said meanwhile is still to do: the show stays due.
            return self.failed(show, master, now);
        };
        for hold in &holds {
            self.expired.insert(now, *hold);
        }
        let unswept = meanwhile.records.iter().any(|r| !holds.contains(r));
        let at = [next, meanwhile.at, unswept.then_some(now)]
            .into_iter()
            .flatten()
            .min();
        if let Some(at) = at {
            self.set(show, at, true);
        }
        let paused = self.paused.remove(master)?;
        Some(self.resume(paused, now))
    }

    /// A sweep of `show` on `master` failed: see [`Due::finish`].
    fn failed(&mut self, show: &ShowId, master: &Arc<str>, now: Instant) -> Option<PauseChange> {
        match self.paused.get_mut(master) {
            Some(paused) => {
                if paused.probe.as_ref() == Some(show) {
                    paused.probe = None;
                    paused.pause = (paused.pause * 2).min(PAUSE_MAX);
                    paused.until = now + paused.pause;
                }
                paused.parked.push(show.clone());
                None
            }
            None => {
                self.paused.insert(
                    Arc::clone(master),
                    Paused {
                        until: now + PAUSE_FIRST,
                        pause: PAUSE_FIRST,
                        probe: None,
                        parked: vec![show.clone()],
                    },
                );
                Some(PauseChange::Paused)
            }
        }
    }

    /// Ends a pause: its parked shows are due now.
    fn resume(&mut self, paused: Paused, now: Instant) -> PauseChange {
        let parked = paused.parked.len();
        for show in paused.parked {
            self.set(&show, now, true);
        }
        PauseChange::Resumed { parked }
    }

    /// The slot map changed: the pauses of nodes that are no longer masters
    /// end (their slots are served by others now).
    fn masters_changed(&mut self, masters: &[String], now: Instant) -> usize {
        let gone: Vec<Arc<str>> = self
            .paused
            .keys()
            .filter(|addr| !masters.iter().any(|m| m.as_str() == &***addr))
            .cloned()
            .collect();
        for addr in &gone {
            if let Some(paused) = self.paused.remove(addr) {
                self.resume(paused, now);
            }
        }
        gone.len()
    }

    /// When the next show is due, or a master's pause ends.
    fn first(&self) -> Option<Instant> {
        let pauses = self
            .paused
            .values()
            .filter(|p| p.probe.is_none() && !p.parked.is_empty())
            .map(|p| p.until);
        self.order
            .first()
            .map(|(at, _)| *at)
            .into_iter()
            .chain(pauses)
            .min()
    }

    /// Shows this instance sweeps (waiting, being swept, or parked).
    fn len(&self) -> usize {
        self.by_show.len()
            + self.running.len()
            + self.paused.values().map(|p| p.parked.len()).sum::<usize>()
    }
}

impl Sweeper {
    pub fn new(
        cluster: Arc<Cluster>,
        keys: KeySpace,
        max_len: u64,
        scan_every: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            cluster,
            keys,
            max_len,
            due: Mutex::new(Due::default()),
            wake: Notify::new(),
            rescan: Notify::new(),
            notified: Mutex::new(HashSet::new()),
            check: Notify::new(),
            scan_every,
            instance: uuid::Uuid::new_v4().to_string(),
        })
    }

    /// `show` has a deadline `in_ms` from now (or earlier) on Redis's
    /// clock: sweep it [`LATE_MS`] after. Redis counts a hold as due only
    /// once its clock is past the expiry millisecond, so a sweep timed to the
    /// millisecond often found nothing and had to run again.
    pub fn schedule(&self, show: &ShowId, in_ms: u64) {
        self.due_at(
            show,
            Instant::now() + Duration::from_millis(in_ms + LATE_MS),
        );
    }

    /// Sweep `show` at `at`, or earlier if it already was due earlier.
    fn due_at(&self, show: &ShowId, at: Instant) {
        let mut due = self.lock();
        let before = due.by_show.len();
        let earliest = due.set(show, at, true);
        // Every hold comes here: the gauge (a registry lookup) only when
        // the number of shows changed.
        if due.by_show.len() != before {
            metrics::gauge!(m::SWEPT_SHOWS).set(due.len() as f64);
        }
        drop(due);
        // The loop sleeps until the earliest deadline: it needs waking only
        // when this one comes before it.
        if earliest {
            self.wake.notify_one();
        }
    }

    /// A hint that `show` may have a deadline due now (a scan page whose
    /// deadlines could not be read).
    pub fn hint(&self, show: &str) {
        if let Ok(show) = ShowId::parse(show) {
            self.due_at(&show, Instant::now());
        }
    }

    /// Redis's notification that the record of hold `token` of `show`
    /// expired: a hint that the show may have a deadline due now. Nothing
    /// when this instance wrote that hold's `expired` event already or is
    /// sweeping the show (the notification then repeats what the sweep did:
    /// answering each with a sweep doubled the sweeps of an instance's own
    /// holds). Otherwise the show's earliest deadline is read first
    /// ([`Sweeper::check_notified`]): every instance hears every expiry,
    /// and the hold's own instance has usually swept it by then.
    pub fn record_expired(&self, show: &str, token: &str) {
        let Ok(show) = ShowId::parse(show) else {
            return;
        };
        let hold = crate::ids::HoldToken::parse(token)
            .ok()
            .map(|t| t.ref_number());
        let now = Instant::now();
        if let Some(hold) = hold {
            if !self.lock().record_expired(&show, hold, now) {
                return;
            }
        }
        let first = {
            let mut notified = self
                .notified
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            notified.insert(show);
            notified.len() == 1
        };
        if first {
            self.check.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Due> {
        // One map operation per lock: a poisoned lock guards a whole map.
        self.due
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sweeps until `stop` turns true: every due show, up to [`PARALLEL`]
    /// at once, each started as soon as one answers. The masters are scanned
    /// by a task of their own ([`Sweeper::scan_every`]), so a long scan
    /// never holds sweeps up.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let scanner = tokio::spawn(Arc::clone(&self).scan_every(stop.clone()));
        let checker = tokio::spawn(Arc::clone(&self).check_notified(stop.clone()));
        let mut topology = self.cluster.watch_topology();
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        loop {
            let room = PARALLEL - in_flight.len();
            if room > 0 {
                let slots = self.cluster.topology();
                let master_of = |show: &ShowId| -> Arc<str> {
                    Arc::from(slots.master_of(self.keys.show_slot(show)).unwrap_or(""))
                };
                for (show, master) in self.lock().start(Instant::now(), room, master_of) {
                    let this = Arc::clone(&self);
                    in_flight.push(async move {
                        let swept = this.sweep(&show).await;
                        (show, master, swept)
                    });
                }
            }
            let sleep_until = self
                .lock()
                .first()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            tokio::select! {
                Some((show, master, swept)) = in_flight.next(), if !in_flight.is_empty() => {
                    let now = Instant::now();
                    let swept = match swept {
                        Some((next, holds)) => Swept::Done {
                            next: next.map(|ms| now + Duration::from_millis(ms)),
                            holds,
                        },
                        None => Swept::Failed,
                    };
                    let mut due = self.lock();
                    let change = due.finish(&show, &master, swept, now);
                    metrics::gauge!(m::SWEPT_SHOWS).set(due.len() as f64);
                    drop(due);
                    match change {
                        Some(PauseChange::Paused) => tracing::warn!(
                            %master,
                            "a sweep failed: sweeps of this master's shows pause, one tries again in {} ms, then every {} ms at most",
                            PAUSE_FIRST.as_millis(),
                            PAUSE_MAX.as_millis()
                        ),
                        Some(PauseChange::Resumed { parked }) => tracing::info!(
                            %master,
                            parked,
                            "a sweep succeeded again: sweeps of this master's shows resume"
                        ),
                        None => {}
                    }
                }
                _ = tokio::time::sleep_until(sleep_until), if in_flight.len() < PARALLEL => {}
                _ = self.wake.notified() => {}
                Ok(()) = topology.changed() => {
                    let masters = topology.borrow_and_update().masters.clone();
                    let ended = self.lock().masters_changed(&masters, Instant::now());
                    if ended > 0 {
                        tracing::info!(ended, "slot map changed: sweeps of masters that were paused and are masters no more resume on the new ones");
                    }
                }
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        scanner.abort();
        checker.abort();
    }

    /// Reads, for the shows whose hold records Redis said expired, each
    /// show's earliest deadline, and sweeps a show only when one is due:
    /// with N instances each expiry is heard N times, and answering each
    /// with a sweep cost the masters N runs of sweep.lua per expiry where
    /// one writes the event (the hold's own instance sweeps at its
    /// deadline, usually before the notification comes). A read is a
    /// `ZRANGE … 0 0 WITHSCORES` per show, pipelined per master with
    /// Redis's `TIME`, a few milliseconds after the first notification so
    /// that those that come together share it. When the read fails, the
    /// shows are swept.
    async fn check_notified(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut conns: HashMap<String, redis::aio::MultiplexedConnection> = HashMap::new();
        loop {
            tokio::select! {
                _ = self.check.notified() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            tokio::time::sleep(CHECK_AFTER).await;
            let shows: Vec<ShowId> = std::mem::take(
                &mut *self
                    .notified
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            )
            .into_iter()
            .collect();
            let topology = self.cluster.topology();
            // Connections to nodes that are no longer masters go.
            conns.retain(|addr, _| topology.masters.iter().any(|m| m == addr));
            let mut by_master: HashMap<&str, Vec<(String, ShowId)>> = HashMap::new();
            for show in shows {
                let key = self.keys.deadlines(&show);
                match topology.master_of(crate::keys::slot(key.as_bytes())) {
                    Some(master) => by_master.entry(master).or_default().push((key, show)),
                    None => self.due_at(&show, Instant::now()),
                }
            }
            for (master, found) in by_master {
                let read = async {
                    let conn = match conns.get_mut(master) {
                        Some(conn) => conn,
                        None => {
                            let client = self.cluster.node_client(master)?;
                            let conn = client.get_multiplexed_async_connection().await?;
                            conns.entry(master.to_owned()).or_insert(conn)
                        }
                    };
                    let keys: Vec<&str> = found.iter().map(|(key, _)| key.as_str()).collect();
                    earliest(conn, &keys).await
                };
                let answer = crate::cluster::Deadline::after(self.cluster.timeout())
                    .within(read)
                    .await;
                match answer {
                    Ok((now_ms, earliest)) => {
                        for ((_, show), at) in found.iter().zip(earliest) {
                            // Due once Redis's clock is past it, as in
                            // sweep.lua; a later one is another hold's, whose
                            // own instance sweeps it (or whose record's
                            // expiry is heard in turn).
                            if at.is_some_and(|at| (at as u64) < now_ms) {
                                self.due_at(show, Instant::now());
                            }
                        }
                    }
                    Err(err) => {
                        tracing::debug!(%master, error = %err, "reading deadlines of notified shows failed; sweeping them");
                        conns.remove(master);
                        for (_, show) in &found {
                            self.due_at(show, Instant::now());
                        }
                    }
                }
            }
        }
    }

    /// Asks for a scan of every master now: expiry notifications may have
    /// been lost (a subscription to a master's notifications just started,
    /// after a gap). Requests during a scan start one more after it.
    pub fn rescan(&self) {
        self.rescan.notify_one();
    }

    /// Scans every master for deadline indexes once the slot map is known,
    /// then whenever [`Sweeper::rescan`] asks or the slot map changes
    /// (forced scans), and otherwise every `scan_every`, each master only
    /// when this instance takes its scan lease, until `stop` turns true.
    async fn scan_every(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut topology = self.cluster.watch_topology();
        let mut periodic = false;
        loop {
            let pause = if self.cluster.topology().covered_slots() > 0 {
                topology.borrow_and_update();
                self.scan(periodic).await;
                self.scan_every
            } else {
                Duration::from_millis(100)
            };
            periodic = tokio::select! {
                _ = tokio::time::sleep(pause) => true,
                _ = self.rescan.notified() => false,
                Ok(()) = topology.changed() => false,
                _ = stop.wait_for(|s| *s) => return,
            };
        }
    }

    /// One sweep of `show`: answers when to sweep it next (ms; `None` when
    /// its index is empty) and the refs of the holds it expired, or `None`
    /// when it failed.
    async fn sweep(&self, show: &ShowId) -> Option<(Option<u64>, Vec<u64>)> {
        let keys = [self.keys.deadlines(show), self.keys.events(show)];
        let deadline = self.cluster.deadline();
        let script = &self.cluster.scripts().sweep;
        let reply: Result<Vec<redis::Value>, _> = self
            .cluster
            .eval(&deadline, script, &keys, |c| {
                c.arg(self.max_len).arg(BATCH);
            })
            .await;
        match reply.as_deref() {
            Ok([redis::Value::Int(written), redis::Value::Int(next), refs @ ..]) => {
                if *written > 0 {
                    let n = u64::try_from(*written).unwrap_or(0);
                    metrics::counter!(m::HOLD_EXPIRIES).increment(n);
                    metrics::counter!(m::EVENTS, "type" => "expired").increment(n);
                }
                let holds = refs
                    .iter()
                    .filter_map(|r| match r {
                        redis::Value::BulkString(bytes) => {
                            std::str::from_utf8(bytes).ok().and_then(ref_number)
                        }
                        _ => None,
                    })
                    .collect();
                Some((u64::try_from(*next).ok().map(|ms| ms + LATE_MS), holds))
            }
            Ok(other) => {
                tracing::error!(reply = ?other, "unexpected reply of sweep.lua");
                Some((Some(1_000), Vec::new()))
            }
            Err(err) => {
                metrics::counter!(m::SWEEP_FAILURES).increment(1);
                tracing::debug!(%show, error = %err, "sweep failed");
                None
            }
        }
    }

    /// Finds every show with a deadline index on every master; a periodic
    /// scan skips the masters whose scan lease another instance holds.
    async fn scan(&self, periodic: bool) {
        let pattern = format!("{}{{show:*}}#deadlines", glob_escape(self.keys.prefix()));
        for master in self.cluster.topology().masters.clone() {
            if let Err(err) = self.scan_master(&master, &pattern, periodic).await {
                tracing::debug!(%master, error = %err, "scan for deadline indexes failed");
            }
        }
    }

    async fn scan_master(
        &self,
        master: &str,
        pattern: &str,
        periodic: bool,
    ) -> Result<(), crate::error::Error> {
        let client = self.cluster.node_client(master)?;
        let deadline = crate::cluster::Deadline::after(self.cluster.timeout());
        let mut conn = deadline
            .within(async { Ok(client.get_multiplexed_async_connection().await?) })
            .await?;
        let kind = if !periodic {
            "forced"
        } else if self.take_lease(&mut conn, master).await {
            "periodic"
        } else {
            "skipped"
        };
        metrics::counter!(m::SWEEP_SCANS, "kind" => kind).increment(1);
        if kind == "skipped" {
            return Ok(());
        }
        let mut cursor = 0u64;
        loop {
            let page = async {
                let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .arg("TYPE")
                    .arg("zset")
                    .query_async(&mut conn)
                    .await?;
                Ok((next, keys))
            };
            let (next, keys) = crate::cluster::Deadline::after(self.cluster.timeout())
                .within(page)
                .await?;
            let found: Vec<(&str, &str)> = keys
                .iter()
                .filter_map(|key| Some((key.as_str(), self.keys.parse_deadlines(key)?)))
                .collect();
            if !found.is_empty() {
                self.schedule_found(&mut conn, &found).await;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Takes `master`'s scan lease for this period: `SET … NX PX` of a key
    /// in one of its slots, kept a tenth shorter than the period, so that
    /// each period one instance scans each master (with N instances, a
    /// scan every period instead of N). Answers whether to scan: also when
    /// the lease cannot be read (no key of the master's slots is known, a
    /// slot moved, an error), as a scan too many costs less than none.
    async fn take_lease(&self, conn: &mut redis::aio::MultiplexedConnection, master: &str) -> bool {
        let topology = self.cluster.topology();
        let Some(key) = (0..4_096)
            .map(|n| self.keys.scan_lease(n))
            .find(|key| topology.master_of(crate::keys::slot(key.as_bytes())) == Some(master))
        else {
            return true;
        };
        let lease_ms = u64::try_from(self.scan_every.as_millis() * 9 / 10).unwrap_or(u64::MAX);
        let take = async {
            let taken: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&self.instance)
                .arg("NX")
                .arg("PX")
                .arg(lease_ms)
                .query_async(conn)
                .await?;
            Ok::<_, crate::error::Error>(taken.is_some())
        };
        match crate::cluster::Deadline::after(self.cluster.timeout())
            .within(take)
            .await
        {
            Ok(taken) => taken,
            Err(err) => {
                tracing::debug!(%master, error = %err, "cannot take the scan lease; scanning");
                true
            }
        }
    }

    /// Schedules the shows of one page of a scan at their earliest deadline,
    /// read with one pipelined `ZRANGE … 0 0 WITHSCORES` per index and
    /// Redis's `TIME`: a scan costs Redis a cheap read per show, not a run
    /// of sweep.lua, and a show known already is moved only to an earlier
    /// deadline. A page that cannot be read that way (a slot moved since
    /// the SCAN, a node lost) has all its shows swept now instead.
    /// `found`: each deadline index of the page and its show.
    async fn schedule_found(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
        found: &[(&str, &str)],
    ) {
        let keys: Vec<&str> = found.iter().map(|(key, _)| *key).collect();
        let read = earliest(conn, &keys);
        match crate::cluster::Deadline::after(self.cluster.timeout())
            .within(read)
            .await
        {
            Ok((now_ms, earliest)) => {
                for ((_, show), at) in found.iter().zip(earliest) {
                    // An empty index (its last entry swept since the SCAN)
                    // needs nothing.
                    let (Some(at), Ok(show)) = (at, ShowId::parse(show)) else {
                        continue;
                    };
                    // Scores are whole ms of Redis's clock.
                    let in_ms = (at as u64).saturating_sub(now_ms);
                    self.schedule(&show, in_ms);
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "reading deadlines of a scan page failed; sweeping its shows");
                for (_, show) in found {
                    self.hint(show);
                }
            }
        }
    }
}

/// Redis's time (ms) and the earliest deadline in each of the deadline
/// indexes `keys` (`None`: empty or gone), in one pipeline: `TIME`, then
/// `ZRANGE … 0 0 WITHSCORES` per index.
async fn earliest(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[&str],
) -> Result<(u64, Vec<Option<f64>>), crate::error::Error> {
    let mut pipe = redis::pipe();
    pipe.cmd("TIME");
    for key in keys {
        pipe.cmd("ZRANGE").arg(*key).arg(0).arg(0).arg("WITHSCORES");
    }
    let mut replies: Vec<redis::Value> = pipe.query_async(conn).await?;
    let (secs, micros): (u64, u64) =
        redis::from_redis_value(replies.remove(0)).map_err(redis::RedisError::from)?;
    let now_ms = secs * 1_000 + micros / 1_000;
    let mut earliest = Vec::with_capacity(replies.len());
    for reply in replies {
        let first: Vec<(String, f64)> =
            redis::from_redis_value(reply).map_err(redis::RedisError::from)?;
        earliest.push(first.first().map(|(_, score)| *score));
    }
    Ok((now_ms, earliest))
}

/// `prefix` with the glob characters of SCAN's MATCH escaped.
fn glob_escape(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(s: &str) -> ShowId {
        ShowId::parse(s).expect("a show id")
    }

    /// Every show on master "m".
    fn one_master(_: &ShowId) -> Arc<str> {
        Arc::from("m")
    }

    /// Shows whose id starts with "x" on master "x", the others on "m".
    fn two_masters(show: &ShowId) -> Arc<str> {
        Arc::from(if show.as_str().starts_with('x') {
            "x"
        } else {
            "m"
        })
    }

    fn started(due: &mut Due, now: Instant, n: usize) -> Vec<ShowId> {
        due.start(now, n, one_master)
            .into_iter()
            .map(|(show, _)| show)
            .collect()
    }

    fn done(due: &mut Due, s: &str, next: Option<Instant>, holds: &[u64], now: Instant) {
        let swept = Swept::Done {
            next,
            holds: holds.to_vec(),
        };
        assert_eq!(due.finish(&show(s), &Arc::from("m"), swept, now), None);
    }

    #[test]
    fn due_shows_start_in_deadline_order_and_only_once() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        assert!(due.set(&show("b"), ms(20), true));
        assert!(due.set(&show("a"), ms(10), true));
        assert!(!due.set(&show("c"), ms(500), true));
        // Only an earlier time moves a show with only_earlier.
        assert!(!due.set(&show("a"), ms(30), true));
        assert_eq!(started(&mut due, ms(25), 8), [show("a"), show("b")]);
        assert_eq!(due.len(), 3);
        // Running shows are not started again, nor are they the next
        // deadline, whatever is scheduled for them meanwhile.
        assert!(!due.set(&show("a"), ms(0), false));
        assert_eq!(due.first(), Some(ms(500)));
        assert!(started(&mut due, ms(100), 8).is_empty());
        assert_eq!(due.len(), 3);
        // Their sweeps answer: the earlier of the answer and what was
        // scheduled meanwhile wins; an empty index without any is gone.
        done(&mut due, "a", Some(ms(1_000)), &[], ms(100));
        done(&mut due, "b", None, &[], ms(100));
        assert_eq!(due.len(), 2);
        assert_eq!(due.first(), Some(ms(0)));
        assert_eq!(started(&mut due, ms(600), 1), [show("a")]);
        assert_eq!(started(&mut due, ms(600), 8), [show("c")]);
        done(&mut due, "a", None, &[], ms(600));
        done(&mut due, "c", Some(ms(2_000)), &[], ms(600));
        assert_eq!(due.len(), 1);
        assert_eq!(due.first(), Some(ms(2_000)));
    }

    #[test]
    fn expired_records_need_a_sweep_only_for_holds_not_swept() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        due.set(&show("a"), ms(0), true);
        assert_eq!(started(&mut due, ms(0), 8), [show("a")]);
        // Notifications during the sweep wait for its answer.
        assert!(!due.record_expired(&show("a"), 7, ms(1)));
        assert!(!due.record_expired(&show("a"), 8, ms(1)));
        // It expired hold 7 but not 8: sweep again at once.
        done(&mut due, "a", None, &[7], ms(2));
        assert_eq!(due.first(), Some(ms(2)));
        assert_eq!(started(&mut due, ms(2), 8), [show("a")]);
        done(&mut due, "a", None, &[8], ms(3));
        assert_eq!(due.len(), 0);
        // Later notifications of holds it expired need nothing; of others,
        // a sweep.
        assert!(!due.record_expired(&show("a"), 7, ms(4)));
        assert!(!due.record_expired(&show("b"), 8, ms(4)));
        assert!(due.record_expired(&show("a"), 9, ms(4)));
        // A show due within SWEEP_SOON needs nothing more; later, it does.
        due.set(&show("c"), ms(30), true);
        assert!(!due.record_expired(&show("c"), 10, ms(4)));
        due.set(&show("d"), ms(500), true);
        assert!(due.record_expired(&show("d"), 11, ms(4)));
        // It forgets after REMEMBER to twice that.
        let later = now + REMEMBER * 2 + Duration::from_millis(10);
        assert!(due.record_expired(&show("a"), 7, later));
    }

    #[test]
    fn a_failed_sweep_pauses_its_master_and_one_show_tries_again() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let m: Arc<str> = Arc::from("m");
        let mut due = Due::default();
        for s in ["a", "b", "c", "xa"] {
            due.set(&show(s), ms(0), true);
        }
        let first = due.start(ms(0), 2, two_masters);
        assert_eq!(
            first,
            [(show("a"), Arc::clone(&m)), (show("b"), Arc::clone(&m))]
        );
        // The first failure pauses master m; one in flight meanwhile is
        // parked without making the pause longer.
        assert_eq!(
            due.finish(&show("a"), &m, Swept::Failed, ms(1)),
            Some(PauseChange::Paused)
        );
        assert_eq!(due.finish(&show("b"), &m, Swept::Failed, ms(2)), None);
        // Its other due shows are parked; another master's are not.
        assert_eq!(
            due.start(ms(3), 8, two_masters),
            [(show("xa"), Arc::from("x"))]
        );
        assert_eq!(due.len(), 4);
        // The pause ends 250 ms after the failure: one show tries.
        assert_eq!(due.first(), Some(ms(1) + PAUSE_FIRST));
        assert!(due.start(ms(200), 8, two_masters).is_empty());
        let probe = due.start(ms(251), 8, two_masters);
        assert_eq!(probe.len(), 1);
        let (probe, _) = probe.into_iter().next().expect("a probe");
        assert!(due.start(ms(251), 8, two_masters).is_empty());
        // It fails too: twice the pause.
        assert_eq!(due.finish(&probe, &m, Swept::Failed, ms(260)), None);
        assert_eq!(due.first(), Some(ms(260) + PAUSE_FIRST * 2));
        assert!(due.start(ms(700), 8, two_masters).is_empty());
        let (probe, _) = due.start(ms(760), 8, two_masters)[0].clone();
        // Now it answers: the pause ends and every parked show is due.
        let swept = Swept::Done {
            next: None,
            holds: Vec::new(),
        };
        assert_eq!(
            due.finish(&probe, &m, swept, ms(770)),
            Some(PauseChange::Resumed { parked: 2 })
        );
        let mut rest: Vec<ShowId> = due
            .start(ms(770), 8, two_masters)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        rest.sort();
        let mut want = vec![show("a"), show("b"), show("c")];
        want.retain(|s| *s != probe);
        assert_eq!(rest, want);
        // The pause is capped.
        due.finish(&rest[0], &m, Swept::Failed, ms(800));
        for i in 0..10u64 {
            let at = due.first().expect("a pause");
            let (p, _) = due.start(at, 8, two_masters)[0].clone();
            due.finish(&p, &m, Swept::Failed, at + Duration::from_millis(i));
        }
        let at = due.first().expect("a pause");
        assert!(at <= ms(800) + PAUSE_MAX * 11 + Duration::from_millis(100));
        // A slot map without master m ends its pause (the other show of
        // `rest` is still being swept).
        assert_eq!(due.masters_changed(&["x".to_owned()], at), 1);
        let again = due.start(at, 8, two_masters);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].0, rest[0]);
    }
}
