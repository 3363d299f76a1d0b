//! `expired` events, exactly once, within a second of the TTL.
//!
//! Every live hold is in its shows' deadline indexes (sorted sets scored with
//! its expiry, written by the same script as the hold). [`Sweeper`] runs
//! `lua/sweep.lua` for a show when its next deadline has passed; the script
//! removes each due entry and appends its event in one step, with Redis's
//! clock deciding what is due, so two instances can never both write one.
//!
//! Which shows to sweep, and when, comes from four places: this instance's
//! own holds and extends (their deadlines), Redis's keyspace notifications of
//! expired hold records (a hint, node-local and possibly late, that covers
//! the holds other instances made), the links of holds of several shows
//! (the record lives under the home show only, so its notification names
//! that show; each show's index links the hold to the next show's, and a
//! sweep that finds a link due sweeps that show next), and a scan of every master for deadline
//! indexes at start, whenever notifications may have been lost (a
//! subscription restarted, the slot map changed) and every
//! `--sweep-scan-interval-ms` (60 s), which covers notifications lost
//! unnoticed; the periodic scan of a master is made by one instance per
//! period, the one that takes the master's scan lease. A scan reads each
//! index's earliest deadline (a cheap read, pipelined) and schedules the
//! show then: sweeping every show found would cost one script run per show
//! with live holds every scan. A hold that expires while no instance runs
//! gets its event when one starts.
//!
//! Layout: this file has the sweeper and its loop; `due` keeps which shows
//! are due when (and the pauses of failing masters); `find` finds the shows
//! that other instances' holds make due (scans of the masters, reads after
//! Redis's expiry notifications).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::ids::ShowId;
use crate::keys::KeySpace;
use crate::metrics as m;

mod due;
mod find;
mod key;
mod recent;

use due::{Due, PauseChange, Swept, PAUSE_FIRST, PAUSE_MAX};

/// How long after a deadline (on Redis's clock) its show is swept: a few
/// ms late rather than early, as the local clock and Redis's may differ by
/// a round trip, and Redis counts a hold due only after its expiry ms.
const LATE_MS: u64 = 5;

/// Most shows named in one handover message.
const HANDOVER_CHUNK: usize = 1_000;

/// Most holds one sweep expires (the next sweep follows at once).
const BATCH: usize = 200;

/// How long a failed sweep's run id is kept for the next sweep of its show
/// (a failing master's sweeps retry within 2 s).
const RUN_KEPT: Duration = Duration::from_secs(60);

/// How far before a failed run was sent its resend looks for its events
/// (sweep.lua): Redis's clock may be behind this machine's.
const RUN_SKEW_MS: u64 = 5_000;

/// Most sweeps in flight at once. Each waits a round trip to its master
/// (milliseconds at an on-sale's peak, behind the holds queued there), so
/// the sweeps run side by side: with 8 at a time and a batch waiting for
/// its slowest, 15,000 holds/s of 2 s on random shows expired at 3,000/s
/// and their events came seconds late.
const PARALLEL: usize = 256;

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
    /// Shows whose hold records Redis said expired (false), or that a
    /// stopping instance handed over (true), to read the earliest deadline
    /// of ([`Sweeper::check_notified`]): a notified show is swept when its
    /// earliest deadline has passed, a show handed over also scheduled for
    /// a later one.
    notified: Mutex<HashMap<ShowId, bool>>,
    check: Notify,
    /// The pause between periodic scans.
    scan_every: Duration,
    /// This instance, in the scan leases it takes.
    instance: String,
    /// The run id of each show's last sweep that failed (it may have run,
    /// its answer lost) and when it was sent (ms since the Unix epoch), for
    /// the show's next sweep: that run then answers what the first wrote
    /// too, and its events are counted.
    failed_runs: Mutex<std::collections::HashMap<ShowId, FailedRun>>,
}

/// A sweep run whose answer was lost.
struct FailedRun {
    id: String,
    /// When it was sent, ms since the Unix epoch (this machine's clock).
    sent_ms: u64,
    /// When it failed, for forgetting it.
    at: Instant,
}

/// A hold ref (16 hex digits, as sweep.lua answers it) as a number, as
/// [`crate::ids::HoldToken::ref_number`] gives it.
fn ref_number(hold_ref: &str) -> Option<u64> {
    u64::from_str_radix(hold_ref, 16).ok()
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
            notified: Mutex::new(HashMap::new()),
            check: Notify::new(),
            scan_every,
            instance: uuid::Uuid::new_v4().to_string(),
            failed_runs: Mutex::default(),
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
        let before = due.waiting();
        let earliest = due.set(show, at, true);
        // Every hold comes here: the gauge (a registry lookup) only when
        // the number of shows changed.
        if due.waiting() != before {
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
        self.notify(show, false);
    }

    /// A show whose earliest deadline is worth reading now
    /// ([`Sweeper::check_notified`]).
    fn notify(&self, show: ShowId, handed_over: bool) {
        let first = {
            let mut notified = self
                .notified
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *notified.entry(show).or_default() |= handed_over;
            notified.len() == 1
        };
        if first {
            self.check.notify_one();
        }
    }

    /// At shutdown: names every show this instance would have swept on
    /// [`KeySpace::handover_channel`], where the other instances hear it
    /// ([`Sweeper::take_over`]) and sweep those shows on time. Without it
    /// they learn of this instance's holds from Redis's expiry
    /// notifications, seconds late on masters with many keys that have a
    /// TTL, or from the periodic scan. Best effort: a crashed instance
    /// hands nothing over.
    pub async fn hand_over(&self) {
        let shows = self.lock().shows();
        if shows.is_empty() {
            return;
        }
        let channel = self.keys.handover_channel();
        let publish = async {
            let mut conn = self.cluster.conn()?;
            for chunk in shows.chunks(HANDOVER_CHUNK) {
                let names: Vec<&str> = chunk.iter().map(ShowId::as_str).collect();
                let () = redis::cmd("PUBLISH")
                    .arg(&channel)
                    .arg(names.join("\n"))
                    .query_async(&mut conn)
                    .await?;
            }
            Ok::<_, crate::error::Error>(())
        };
        match crate::cluster::Deadline::after(self.cluster.timeout())
            .within(publish)
            .await
        {
            Ok(()) => tracing::info!(
                shows = shows.len(),
                "handed the shows this instance sweeps over to the other instances"
            ),
            Err(err) => tracing::warn!(shows = shows.len(), error = %err,
                "could not hand the shows this instance sweeps over; other instances find their expiries from Redis's notifications or the periodic scan"),
        }
    }

    /// Another instance stopped and named the shows it swept (`payload`,
    /// one per line): their earliest deadlines are read and scheduled, as
    /// after an expiry notification.
    pub fn take_over(&self, payload: &str) {
        for show in payload.lines().filter_map(|s| ShowId::parse(s).ok()) {
            self.notify(show, true);
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
        // Sweeps in flight may have written events: their answers (each
        // within its Redis deadline) are counted, not dropped.
        while in_flight.next().await.is_some() {}
    }

    /// The run of `show`'s next sweep: a failed run's id and the stream id
    /// from which it may have written, or a new id and "".
    fn run_id(&self, show: &ShowId) -> (String, String, u64) {
        let now_ms = super::hub::now_ms();
        let mut failed = self
            .failed_runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match failed.remove(show) {
            Some(run) if run.at.elapsed() < RUN_KEPT => {
                let since = run.sent_ms.saturating_sub(RUN_SKEW_MS).to_string();
                (run.id, since, run.sent_ms)
            }
            _ => {
                let id = format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0);
                (id, String::new(), now_ms)
            }
        }
    }

    /// Keeps `show`'s failed run for its next sweep.
    fn run_failed(&self, show: &ShowId, id: String, sent_ms: u64) {
        let mut failed = self
            .failed_runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = Instant::now();
        // Shows another instance swept meanwhile are never swept here again.
        if failed.len() >= 1024 {
            failed.retain(|_, run| at.duration_since(run.at) < RUN_KEPT);
        }
        failed.insert(show.clone(), FailedRun { id, sent_ms, at });
    }

    /// One sweep of `show`: answers when to sweep it next (ms; `None` when
    /// its index is empty) and the refs of the holds it expired, or `None`
    /// when it failed.
    async fn sweep(&self, show: &ShowId) -> Option<(Option<u64>, Vec<u64>)> {
        let (run, since, sent_ms) = self.run_id(show);
        let retry_since = sent_ms.saturating_sub(RUN_SKEW_MS).to_string();
        let sends = AtomicU32::new(0);
        let keys = [self.keys.deadlines(show), self.keys.events(show)];
        let deadline = self.cluster.deadline();
        let script = &self.cluster.scripts().sweep;
        let reply: Result<Vec<redis::Value>, _> = self
            .cluster
            .eval(&deadline, script, &keys, |c| {
                // Every send after the first is a resend of this run: the
                // direct connection broke, and the cluster connection sends
                // the script again (it may have run).
                let resend = sends.fetch_add(1, Ordering::Relaxed) > 0;
                let since = if resend && since.is_empty() {
                    &retry_since
                } else {
                    &since
                };
                c.arg(self.max_len).arg(BATCH).arg(&run).arg(since);
            })
            .await;
        match reply.as_deref() {
            Ok(
                [redis::Value::Int(written), redis::Value::Int(next), redis::Value::Array(links), redis::Value::Int(counted), refs @ ..],
            ) => {
                // A hold of several shows links each show's index to the
                // next: their entries of the same holds are due now too.
                for link in links {
                    if let redis::Value::BulkString(key) = link {
                        if let Some(show) = std::str::from_utf8(key)
                            .ok()
                            .and_then(|key| self.keys.parse_deadlines(key))
                        {
                            self.hint(show);
                        }
                    }
                }
                // One event per show, and a hold of several shows is
                // counted by one of them (sweep.lua).
                if *written > 0 {
                    let n = u64::try_from(*written).unwrap_or(0);
                    metrics::counter!(m::EVENTS, "type" => "expired").increment(n);
                }
                if *counted > 0 {
                    let n = u64::try_from(*counted).unwrap_or(0);
                    metrics::counter!(m::HOLD_EXPIRIES).increment(n);
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
                self.run_failed(show, run, sent_ms);
                metrics::counter!(m::SWEEP_FAILURES).increment(1);
                tracing::debug!(%show, error = %err, "sweep failed");
                None
            }
        }
    }
}
