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
//! indexes at start and every [`SCAN_EVERY`] (which covers a restart of every
//! instance). A scan reads each index's earliest deadline (a cheap read,
//! pipelined) and schedules the show then: sweeping every show found would
//! cost one script run per show with live holds every scan. A hold that
//! expires while no instance runs gets its event when one starts.

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

/// How often every master is scanned for deadline indexes.
pub const SCAN_EVERY: Duration = Duration::from_secs(10);

/// Most holds one sweep expires (the next sweep follows at once).
const BATCH: usize = 200;

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
    /// When each known show's next deadline passes (local clock).
    due: Mutex<Due>,
    wake: Notify,
}

/// The shows to sweep, by show and in deadline order: scheduling and taking
/// the next due shows cost a logarithm of the shows known, not their
/// number, as every hold schedules its show.
#[derive(Default)]
struct Due {
    by_show: HashMap<ShowId, Instant>,
    order: BTreeSet<(Instant, ShowId)>,
    /// Shows being swept now: not started again until that sweep answers
    /// (a show scheduled meanwhile waits in `order`).
    running: HashSet<ShowId>,
    /// Shows both running and waiting (scheduled again while swept).
    both: usize,
}

impl Due {
    /// Sets `show` due at `at`, or earlier if it already was; answers
    /// whether `at` is now the earliest deadline of all (the loop must wake).
    fn set(&mut self, show: &ShowId, at: Instant, only_earlier: bool) -> bool {
        if let Some(old) = self.by_show.get(show).copied() {
            if only_earlier && at >= old {
                return false;
            }
            self.order.remove(&(old, show.clone()));
        }
        if self.by_show.insert(show.clone(), at).is_none() && self.running.contains(show) {
            self.both += 1;
        }
        self.order.insert((at, show.clone()));
        self.order.first().is_some_and(|(first, _)| *first == at)
    }

    /// Takes up to `n` shows due by `now` that are not being swept, in
    /// deadline order, and marks them running.
    fn start(&mut self, now: Instant, n: usize) -> Vec<ShowId> {
        let ready: Vec<(Instant, ShowId)> = self
            .order
            .iter()
            .take_while(|(at, _)| *at <= now)
            .filter(|(_, show)| !self.running.contains(show))
            .take(n)
            .cloned()
            .collect();
        for (at, show) in &ready {
            self.order.remove(&(*at, show.clone()));
            self.by_show.remove(show);
            self.running.insert(show.clone());
        }
        ready.into_iter().map(|(_, show)| show).collect()
    }

    /// A sweep of `show` answered: due again at `next` (None: its index is
    /// empty), unless it was scheduled earlier while the sweep ran.
    fn finish(&mut self, show: &ShowId, next: Option<Instant>) {
        if self.running.remove(show) && self.by_show.contains_key(show) {
            self.both -= 1;
        }
        if let Some(at) = next {
            self.set(show, at, true);
        }
    }

    /// The earliest deadline of a show not being swept.
    fn first(&self) -> Option<Instant> {
        self.order
            .iter()
            .find(|(_, show)| !self.running.contains(show))
            .map(|(at, _)| *at)
    }

    /// Shows this instance sweeps (waiting or being swept).
    fn len(&self) -> usize {
        self.by_show.len() + self.running.len() - self.both
    }
}

impl Sweeper {
    pub fn new(cluster: Arc<Cluster>, keys: KeySpace, max_len: u64) -> Arc<Self> {
        Arc::new(Self {
            cluster,
            keys,
            max_len,
            due: Mutex::new(Due::default()),
            wake: Notify::new(),
        })
    }

    /// `show` has a deadline `in_ms` from now (or earlier): sweep it then.
    pub fn schedule(&self, show: &ShowId, in_ms: u64) {
        let at = Instant::now() + Duration::from_millis(in_ms);
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

    /// A hint that `show` may have a deadline due now (an expired hold
    /// record seen in a keyspace notification, or a scan).
    pub fn hint(&self, show: &str) {
        if let Ok(show) = ShowId::parse(show) {
            self.schedule(&show, 0);
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
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        loop {
            let room = PARALLEL - in_flight.len();
            if room > 0 {
                for show in self.lock().start(Instant::now(), room) {
                    let this = Arc::clone(&self);
                    in_flight.push(async move {
                        let next = this.sweep(&show).await;
                        (show, next)
                    });
                }
            }
            let sleep_until = self
                .lock()
                .first()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            tokio::select! {
                Some((show, next)) = in_flight.next(), if !in_flight.is_empty() => {
                    let next = next.map(|ms| Instant::now() + Duration::from_millis(ms));
                    let mut due = self.lock();
                    due.finish(&show, next);
                    metrics::gauge!(m::SWEPT_SHOWS).set(due.len() as f64);
                }
                _ = tokio::time::sleep_until(sleep_until), if in_flight.len() < PARALLEL => {}
                _ = self.wake.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        scanner.abort();
    }

    /// Scans every master for deadline indexes once the slot map is known,
    /// then every [`SCAN_EVERY`], until `stop` turns true.
    async fn scan_every(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let pause = if self.cluster.topology().covered_slots() > 0 {
                self.scan().await;
                SCAN_EVERY
            } else {
                Duration::from_millis(100)
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// One sweep of `show`: answers when to sweep it next (ms), or `None`
    /// when its index is empty.
    async fn sweep(&self, show: &ShowId) -> Option<u64> {
        let keys = [self.keys.deadlines(show), self.keys.events(show)];
        let deadline = self.cluster.deadline();
        let script = &self.cluster.scripts().sweep;
        let reply: Result<Vec<i64>, _> = self
            .cluster
            .eval(&deadline, script, &keys, |c| {
                c.arg(self.max_len).arg(BATCH);
            })
            .await;
        match reply.as_deref() {
            Ok([written, next]) => {
                if *written > 0 {
                    let n = u64::try_from(*written).unwrap_or(0);
                    metrics::counter!(m::HOLD_EXPIRIES).increment(n);
                    metrics::counter!(m::EVENTS, "type" => "expired").increment(n);
                }
                // A few ms late rather than early: the local clock and
                // Redis's may differ by the round trip.
                u64::try_from(*next).ok().map(|ms| ms + 5)
            }
            Ok(other) => {
                tracing::error!(reply = ?other, "unexpected reply of sweep.lua");
                Some(1_000)
            }
            Err(err) => {
                metrics::counter!(m::SWEEP_FAILURES).increment(1);
                tracing::debug!(%show, error = %err, "sweep failed; retrying");
                Some(250)
            }
        }
    }

    /// Finds every show with a deadline index on every master.
    async fn scan(&self) {
        let pattern = format!("{}{{show:*}}#deadlines", glob_escape(self.keys.prefix()));
        for master in self.cluster.topology().masters.clone() {
            if let Err(err) = self.scan_master(&master, &pattern).await {
                tracing::debug!(%master, error = %err, "scan for deadline indexes failed");
            }
        }
    }

    async fn scan_master(&self, master: &str, pattern: &str) -> Result<(), crate::error::Error> {
        let client = self.cluster.node_client(master)?;
        let deadline = crate::cluster::Deadline::after(self.cluster.timeout());
        let mut conn = deadline
            .within(async { Ok(client.get_multiplexed_async_connection().await?) })
            .await?;
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
            let shows: Vec<&str> = keys
                .iter()
                .filter_map(|key| self.keys.parse_deadlines(key))
                .collect();
            if !shows.is_empty() {
                self.schedule_found(&mut conn, &keys, &shows).await;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Schedules the shows of one page of a scan at their earliest deadline,
    /// read with one pipelined `ZRANGE … 0 0 WITHSCORES` per index and
    /// Redis's `TIME`: a scan costs Redis a cheap read per show, not a run
    /// of sweep.lua, and a show known already is moved only to an earlier
    /// deadline. A page that cannot be read that way (a slot moved since
    /// the SCAN, a node lost) has all its shows swept now instead.
    async fn schedule_found(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
        keys: &[String],
        shows: &[&str],
    ) {
        let read = async {
            let mut pipe = redis::pipe();
            pipe.cmd("TIME");
            for key in keys
                .iter()
                .filter(|k| self.keys.parse_deadlines(k).is_some())
            {
                pipe.cmd("ZRANGE").arg(key).arg(0).arg(0).arg("WITHSCORES");
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
            Ok::<_, crate::error::Error>((now_ms, earliest))
        };
        match crate::cluster::Deadline::after(self.cluster.timeout())
            .within(read)
            .await
        {
            Ok((now_ms, earliest)) => {
                for (show, at) in shows.iter().zip(earliest) {
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
                for show in shows {
                    self.hint(show);
                }
            }
        }
    }
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
