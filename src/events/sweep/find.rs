//! Finding the shows that holds of other instances make due: scans of the
//! masters for deadline indexes (the periodic ones under a scan lease, so
//! one instance per master and period makes them) and reads of the
//! earliest deadline of the shows whose hold records Redis said expired.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::Sweeper;
use crate::ids::ShowId;
use crate::metrics as m;

/// How long after the first of a burst of expiry notifications the
/// notified shows' deadlines are read, so that the burst shares one read
/// per master.
const CHECK_AFTER: Duration = Duration::from_millis(5);

impl Sweeper {
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
    pub(super) async fn check_notified(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut conns: HashMap<String, redis::aio::MultiplexedConnection> = HashMap::new();
        loop {
            tokio::select! {
                _ = self.check.notified() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            tokio::time::sleep(CHECK_AFTER).await;
            let shows: Vec<(ShowId, bool)> = std::mem::take(
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
            let mut by_master: HashMap<&str, Vec<(String, ShowId, bool)>> = HashMap::new();
            for (show, handed_over) in shows {
                let key = self.keys.deadlines(&show);
                match topology.master_of(crate::keys::slot(key.as_bytes())) {
                    Some(master) => {
                        by_master
                            .entry(master)
                            .or_default()
                            .push((key, show, handed_over))
                    }
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
                    let keys: Vec<&str> = found.iter().map(|(key, ..)| key.as_str()).collect();
                    earliest(conn, &keys).await
                };
                let answer = crate::cluster::Deadline::after(self.cluster.timeout())
                    .within(read)
                    .await;
                match answer {
                    Ok((now_ms, earliest)) => {
                        for ((_, show, handed_over), at) in found.iter().zip(earliest) {
                            // Due once Redis's clock is past it, as in
                            // sweep.lua; a later one is another hold's, whose
                            // own instance sweeps it (or whose record's
                            // expiry is heard in turn), unless that instance
                            // stopped and handed the show over.
                            match at.map(|at| at as u64) {
                                Some(at) if at < now_ms => self.due_at(show, Instant::now()),
                                Some(at) if *handed_over => self.schedule(show, at - now_ms),
                                _ => {}
                            }
                        }
                    }
                    Err(err) => {
                        tracing::debug!(%master, error = %err, "reading deadlines of notified shows failed; sweeping them");
                        conns.remove(master);
                        for (_, show, _) in &found {
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
    pub(super) async fn scan_every(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
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
