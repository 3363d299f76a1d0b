//! The cluster connection's upkeep: making it (and making it anew), the
//! readiness probe that is also the slot map's refresh, and installing a
//! new slot map (direct connections, scripts on new masters).

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Value};
use tokio::sync::watch;

use super::{direct, Cluster, Deadline, RedisFault, Topology};
use crate::error::Error;
use crate::keys::SLOTS;
use crate::metrics as m;

/// Probes in a row that timed out on every node after which the cluster
/// connection is made anew.
const PROBE_TIMEOUTS_TO_RECONNECT: u32 = 2;

impl Cluster {
    /// Background work: connect (and reconnect), keep the slot map and
    /// readiness current. Ends when `shutdown` turns true.
    pub async fn maintain(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let interval = Duration::from_millis(500);
        let mut last = Instant::now();
        let mut first = true;
        loop {
            // Every 500 ms, or after 50 ms when the direct path found the
            // slot map stale (a redirect or a broken connection).
            if first || last.elapsed() >= interval || self.stale.load(Ordering::Relaxed) {
                first = false;
                last = Instant::now();
                // A probe waiting on Redis (up to a Redis timeout to
                // connect or ask, another to load scripts on new masters)
                // is dropped at shutdown rather than waited for: nothing
                // after shutdown needs what it would install.
                tokio::select! {
                    () = self.check_once() => {}
                    _ = shutdown.wait_for(|s| *s) => return,
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        }
    }

    /// One round of [`Cluster::maintain`]: connect when there is no
    /// cluster connection, then probe; a connection whose probes timed out
    /// [`PROBE_TIMEOUTS_TO_RECONNECT`] times in a row is dropped, and made
    /// anew by the next round.
    async fn check_once(self: &Arc<Self>) {
        if self.routing().conn.is_none() {
            if let Err(why) = self.connect().await {
                self.readiness.set_cluster(false, &why);
                return;
            }
        }
        self.stale.store(false, Ordering::Relaxed);
        match self.probe().await {
            Ok(()) => {
                self.readiness.set_cluster(true, "Redis Cluster is ready");
                self.connect_direct();
            }
            Err(why) => {
                self.readiness.set_cluster(false, &why);
                // Every node timed out twice in a row: Redis may be that
                // slow, or the cluster connection may be wedged, which the
                // cluster client does not mend (a storm of ASK redirects on
                // it, the slot moving, wedged it for good: probes never left
                // the client, and the daemon stayed unready after the move
                // ended). A new one costs a connection per node.
                if self.probe_timeouts.load(Ordering::Relaxed) >= PROBE_TIMEOUTS_TO_RECONNECT {
                    self.probe_timeouts.store(0, Ordering::Relaxed);
                    tracing::warn!("Redis probes timed out {PROBE_TIMEOUTS_TO_RECONNECT} times in a row; making the cluster connection anew");
                    self.routing_mut().conn = None;
                }
            }
        }
    }

    /// Makes the shared cluster connection; answers why it could not.
    async fn connect(&self) -> Result<(), String> {
        let connect = async { Ok(self.client.get_async_connection().await?) };
        match Deadline::after(self.timeout).within(connect).await {
            Ok(conn) => {
                tracing::info!("connected to Redis Cluster");
                self.routing_mut().conn = Some(conn);
                Ok(())
            }
            Err(Error::RedisUnavailable(RedisFault::Timeout, _)) => {
                // A TLS client on a plain port waits for a ServerHello
                // that never comes: a timeout is all it sees.
                let hint = if self.tls_seeds {
                    " (are these ports TLS ports? rediss:// needs tls-port on the nodes)"
                } else {
                    ""
                };
                Err(format!("cannot connect to Redis Cluster: timed out{hint}"))
            }
            Err(Error::RedisUnavailable(fault, detail)) => {
                let hint = if fault == RedisFault::Auth {
                    " (Redis rejected the credentials: check --redis-username and --redis-password)"
                } else {
                    ""
                };
                Err(format!("cannot connect to Redis Cluster: {detail}{hint}"))
            }
            Err(other) => Err(format!("cannot connect to Redis Cluster: {other}")),
        }
    }

    /// One readiness probe, itself the round trip that proves Redis answers:
    /// a fresh slot map (installed, with scripts loaded on new masters) that
    /// covers every slot, from a node that reports `cluster_state:ok`.
    async fn probe(&self) -> Result<(), String> {
        let conn = self.conn().map_err(|e| e.to_string())?;
        let answer = match self.ask_a_node(conn).await {
            Ok(answer) => {
                self.probe_timeouts.store(0, Ordering::Relaxed);
                answer
            }
            Err(err) => {
                let timed_out = matches!(err, Error::RedisUnavailable(RedisFault::Timeout, _));
                if timed_out {
                    self.probe_timeouts.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.probe_timeouts.store(0, Ordering::Relaxed);
                }
                if let Error::RedisUnavailable(fault, _) = &err {
                    metrics::counter!(m::REDIS_ERRORS, "kind" => fault.label()).increment(1);
                }
                return Err(format!("Redis probe failed: {err}"));
            }
        };
        if !answer.ok {
            // Its slot map may be stale (a master cut off from the cluster
            // bus keeps the map it had): the installed one stays.
            return Err(format!(
                "Redis reports cluster_state other than ok ({})",
                answer.addr
            ));
        }
        let topo = Topology::from_cluster_slots(&answer.slots, &answer.addr)
            .ok_or("unexpected CLUSTER SLOTS reply")?;
        self.install_topology(topo).await;
        let covered = self.topology().covered_slots();
        if covered != u32::from(SLOTS) {
            return Err(format!("only {covered} of 16384 slots are served"));
        }
        Ok(())
    }

    /// `CLUSTER SLOTS` and `CLUSTER INFO` of one node: the node that answered
    /// `ok` last time, then the current masters in turn (by the addresses
    /// the cluster gives them, which are the cluster client's names for its
    /// connections), then any node the cluster client is connected to (before
    /// the first slot map, and when no master of the last one answers). The
    /// first node that answers `cluster_state:ok` within the probe's time
    /// wins; failing that, the first that answered at all. `addr` names the
    /// node, so that a slot map's unnamed endpoints (`""`, `?`, NULL) can be
    /// read as that node; any node is named as the first seed, as the
    /// cluster client names those endpoints itself.
    ///
    /// The seeds are not asked by their own names: the cluster client keeps
    /// connections only under the names the cluster gives, and a seed
    /// written otherwise (a host name where the cluster reports addresses,
    /// or a seed that is down) is no connection of it. Asking by such a name
    /// failed, and made the client rebuild every connection from the seeds,
    /// at every probe: the daemon never became ready.
    async fn ask_a_node(&self, mut conn: ClusterConnection) -> Result<NodeAnswer, Error> {
        use redis::cluster_routing::SingleNodeRoutingInfo;
        // The node that answered last time first: asking a master that just
        // died (the first in address order, every 500 ms until its replica
        // took over) made the cluster client drop and rebuild every node
        // connection from the seeds, up to 8 times per probe (150 new
        // connections to the other masters in 8 s, against 24 when a later
        // master died).
        let last = self
            .last_asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut candidates: Vec<Option<String>> = last.into_iter().map(Some).collect();
        for addr in &self.topology().masters {
            if !candidates.iter().any(|c| c.as_ref() == Some(addr)) {
                candidates.push(Some(addr.clone()));
            }
        }
        candidates.push(None);
        let deadline = Deadline::after(self.timeout);
        let mut failure =
            Error::RedisUnavailable(RedisFault::NotConnected, "no node to ask".into());
        let mut not_ok = None;
        for candidate in candidates {
            let (route, addr) = match &candidate {
                Some(addr) => {
                    let Some((host, port)) = addr
                        .rsplit_once(':')
                        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
                    else {
                        continue;
                    };
                    (SingleNodeRoutingInfo::ByAddress { host, port }, addr)
                }
                None => (SingleNodeRoutingInfo::Random, &self.seed_addr),
            };
            let mut pipe = redis::pipe();
            pipe.add_command(cluster_cmd("SLOTS"))
                .add_command(cluster_cmd("INFO"));
            let ask = async {
                let mut replies = conn.route_pipeline(pipe, 0, 2, route).await?.into_iter();
                let (Some(slots), Some(info)) = (replies.next(), replies.next()) else {
                    return Err(Error::Internal(
                        "CLUSTER SLOTS and INFO: short reply".into(),
                    ));
                };
                let info = String::from_redis_value(info).map_err(redis::RedisError::from)?;
                Ok((slots, info))
            };
            // Half of what is left for each node: a black-holed master
            // leaves time to ask another.
            let budget = Deadline::after(deadline.remaining() / 2);
            match budget.within(ask).await {
                Ok((slots, info)) => {
                    let answer = NodeAnswer {
                        ok: info.lines().any(|l| l.trim() == "cluster_state:ok"),
                        addr: addr.clone(),
                        slots,
                    };
                    if !answer.ok {
                        // A node cut off from the others: not asked first
                        // next time, and another may know better.
                        not_ok.get_or_insert(answer);
                        continue;
                    }
                    *self
                        .last_asked
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = candidate;
                    return Ok(answer);
                }
                Err(err) => failure = err,
            }
        }
        not_ok.ok_or(failure)
    }

    async fn install_topology(&self, topo: Topology) {
        let topo = {
            let mut routing = self.routing_mut();
            if *routing.topology == topo {
                return;
            }
            let topo = Arc::new(topo);
            routing.topology = Arc::clone(&topo);
            // Direct connections to nodes that are no longer masters go.
            routing
                .direct
                .retain(|addr, _| topo.masters.iter().any(|m| m.as_str() == &**addr));
            direct::publish(&routing.direct);
            // And so do the idle confirm connections to them.
            self.confirm_pool.keep_only(&topo.masters);
            topo
        };
        tracing::info!(masters = ?topo.masters, "Redis Cluster topology changed");
        metrics::counter!(m::TOPOLOGY_CHANGES).increment(1);
        metrics::gauge!(m::MASTERS).set(topo.masters.len() as f64);
        // New masters (a promoted replica) get the scripts now, not on the
        // first NOSCRIPT.
        if let Err(e) = self.load_scripts().await {
            tracing::warn!(error = %e, "could not load scripts on every master");
        }
        self.topology_changed.send_replace(topo);
    }

    /// Forces a fresh slot map, after a MOVED or a failed node.
    pub async fn refresh_topology(&self) {
        if let Err(why) = self.probe().await {
            tracing::warn!(reason = %why, "topology refresh failed");
        }
    }
}

/// What one node said of the cluster, for a readiness probe.
struct NodeAnswer {
    /// The node, `host:port`.
    addr: String,
    /// Its `CLUSTER SLOTS` reply.
    slots: Value,
    /// Whether its `CLUSTER INFO` says `cluster_state:ok`.
    ok: bool,
}

fn cluster_cmd(sub: &str) -> Cmd {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg(sub);
    cmd
}
