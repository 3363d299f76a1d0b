//! The connection to Redis Cluster: one multiplexed cluster connection shared
//! by every request, the slot map, readiness, and the dedicated per-master
//! connections that confirms need for `WAIT`.
//!
//! Scripts take a direct path when they can: every key of a script is in one
//! slot, known before anything is sent, so [`Cluster::eval`] looks the slot's
//! master up in its own slot map and sends EVALSHA over a multiplexed
//! connection to that master, skipping the cluster client's routing task (a
//! channel hop and a task wake-up per request). The scripts queued for one
//! master at about the same time go to it in one write (`batch`). Whenever
//! the direct path cannot answer (no connection to that master yet, `MOVED`,
//! `TRYAGAIN`, `CLUSTERDOWN`, a replica's `READONLY`, a broken connection),
//! the request goes over the cluster connection instead, which follows
//! redirects and reconnects, and the slot map is refreshed. An `ASK` (the
//! slot is moving) is followed on a dedicated connection to the node it
//! names, `ASKING` and the script in one pipeline.
//!
//! The cluster connection is made in the background, and made anew when
//! probes time out on it twice in a row (see [`Cluster::check_once`]), so
//! the daemon starts (and answers `/healthz`) before the cluster is
//! reachable, and is simply not ready until it is.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo, Value};
use tokio::sync::watch;

use crate::error::Error;
use crate::keys::SLOTS;
use crate::metrics as m;
use crate::scripts::{Script, Scripts};

mod batch;
mod confirm;
mod deadline;
mod direct;
mod fault;
mod readiness;
mod topology;

pub use confirm::Wait;
pub use deadline::Deadline;
pub use fault::{classify, RedisFault, Retry};
pub use readiness::Readiness;
pub use topology::{SlotRange, Topology};

/// Probes in a row that timed out on every node after which the cluster
/// connection is made anew.
const PROBE_TIMEOUTS_TO_RECONNECT: u32 = 2;

/// How to reach the cluster.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Seed nodes, `redis://` or `rediss://` URLs.
    pub nodes: Vec<String>,
    /// ACL user name, when not in the URLs.
    pub username: Option<String>,
    /// Password, when not in the URLs.
    pub password: Option<String>,
    /// The longest any request waits on Redis.
    pub timeout: Duration,
    /// CA and client certificates for `rediss://` nodes.
    pub tls: Option<redis::TlsCertificates>,
}

/// Errors of the cluster configuration, found before anything connects.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no Redis seed nodes given (--redis-nodes / SEATHOLD_REDIS_NODES); to try seathold on a local cluster it starts itself, run `seathold dev`")]
    NoNodes,
    #[error("Redis node URL {url:?} is not usable: {reason}")]
    BadUrl { url: String, reason: String },
    /// The client makes every connection TLS once it has certificates,
    /// whatever the URL says: a plain port would never answer.
    #[error("TLS certificates given, but the seed node {url} is a plain redis:// URL: give the nodes' TLS ports as rediss:// URLs, or no TLS files")]
    PlainSeedWithTls { url: String },
    /// The client sends AUTH only with a password: a user name alone would
    /// be ignored, and seathold would run as `default`.
    #[error("--redis-username needs a password; for a nopass ACL user give any --redis-password")]
    UsernameWithoutPassword,
    #[error("Redis node URL {url:?} names user {user} but no password, and no --redis-password is given: Redis would not be sent AUTH and seathold would run as `default`; give a password (for a nopass ACL user any --redis-password)")]
    UrlUserWithoutPassword { url: String, user: String },
}

/// What requests route by, under one lock so that a reader never sees a
/// slot map from one probe and direct connections from another.
#[derive(Default)]
struct Routing {
    /// The shared cluster connection, once made.
    conn: Option<ClusterConnection>,
    /// The current slot map.
    topology: Arc<Topology>,
    /// One shared multiplexed connection per master (`host:port`), for the
    /// direct path of scripts.
    direct: HashMap<Arc<str>, batch::Batched>,
}

/// The Redis side of the daemon.
pub struct Cluster {
    client: ClusterClient,
    /// Template for per-node connections: credentials and TLS of the first seed.
    node_template: ConnectionInfo,
    tls: Option<redis::TlsCertificates>,
    /// Whether the seeds are `rediss://`.
    tls_seeds: bool,
    /// `host:port` of the first seed: whom an unnamed endpoint in a slot map
    /// refers to.
    seed_addr: String,
    routing: RwLock<Routing>,
    /// Set when the direct path met a redirect or a broken connection: the
    /// next `maintain` round refreshes the slot map at once.
    stale: AtomicBool,
    /// Masters a direct connection is being opened to.
    connecting: Mutex<HashSet<String>>,
    /// The node that answered the last probe: asked first next time.
    last_asked: Mutex<Option<String>>,
    /// Probes in a row that timed out on every node asked (see
    /// [`Cluster::check_once`]).
    probe_timeouts: std::sync::atomic::AtomicU32,
    /// Idle dedicated connections for confirm + `WAIT`.
    confirm_pool: confirm::Pool,
    scripts: Scripts,
    timeout: Duration,
    readiness: Arc<Readiness>,
    topology_changed: watch::Sender<Arc<Topology>>,
}

impl Cluster {
    /// Checks the options and builds the client; connects nothing yet.
    /// `readiness` receives the background probe's verdicts.
    pub fn new(
        opts: &RedisOptions,
        scripts: Scripts,
        readiness: Arc<Readiness>,
    ) -> Result<Arc<Self>, ConfigError> {
        if opts.nodes.is_empty() {
            return Err(ConfigError::NoNodes);
        }
        let infos = opts
            .nodes
            .iter()
            .map(|url| seed_info(url, opts))
            .collect::<Result<Vec<_>, _>>()?;
        if opts.tls.is_some() {
            let plain = opts
                .nodes
                .iter()
                .zip(&infos)
                .find(|(_, info)| !matches!(info.addr(), ConnectionAddr::TcpTls { .. }));
            if let Some((url, _)) = plain {
                return Err(ConfigError::PlainSeedWithTls {
                    url: redact_url(url),
                });
            }
        }
        let node_template = infos[0].clone();
        let tls_seeds = matches!(node_template.addr(), ConnectionAddr::TcpTls { .. });
        let seed_addr = node_template.addr().to_string();
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(opts.timeout)
            .response_timeout(opts.timeout)
            // TRYAGAIN and CLUSTERDOWN while slots move are retried with
            // backoff; the request's deadline bounds the retries overall.
            .retries(8)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some(user) = &opts.username {
            builder = builder.username(user);
        }
        if let Some(pass) = &opts.password {
            builder = builder.password(pass);
        }
        if let Some(certs) = &opts.tls {
            builder = builder.certs(certs.clone());
        }
        let client = builder.build().map_err(|e| ConfigError::BadUrl {
            url: opts
                .nodes
                .iter()
                .map(|url| redact_url(url))
                .collect::<Vec<_>>()
                .join(","),
            reason: e.to_string(),
        })?;
        let (topology_changed, _) = watch::channel(Arc::new(Topology::default()));
        Ok(Arc::new(Self {
            client,
            node_template,
            tls: opts.tls.clone(),
            tls_seeds,
            seed_addr,
            routing: RwLock::new(Routing::default()),
            stale: AtomicBool::new(false),
            connecting: Mutex::new(HashSet::new()),
            last_asked: Mutex::new(None),
            probe_timeouts: std::sync::atomic::AtomicU32::new(0),
            confirm_pool: confirm::Pool::default(),
            scripts,
            timeout: opts.timeout,
            readiness,
            topology_changed,
        }))
    }

    /// The scripts this cluster runs.
    pub fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    /// The longest a request waits on Redis.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A deadline for one request's Redis work.
    pub fn deadline(&self) -> Deadline {
        Deadline::after(self.timeout)
    }

    /// The current slot map.
    pub fn topology(&self) -> Arc<Topology> {
        Arc::clone(&self.routing().topology)
    }

    /// Notified with every new slot map.
    pub fn watch_topology(&self) -> watch::Receiver<Arc<Topology>> {
        self.topology_changed.subscribe()
    }

    // Every write under the routing lock is a single assignment, insert or
    // remove: a panic elsewhere cannot leave it half-changed, so a poisoned
    // lock still guards consistent state and is used as it is.
    fn routing(&self) -> RwLockReadGuard<'_, Routing> {
        self.routing.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn routing_mut(&self) -> RwLockWriteGuard<'_, Routing> {
        self.routing.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn mark_stale(&self) {
        self.stale.store(true, Ordering::Relaxed);
    }

    /// A handle on the shared cluster connection (a cheap clone of a
    /// multiplexed connection), or 503 while there is none.
    pub fn conn(&self) -> Result<ClusterConnection, Error> {
        self.routing().conn.clone().ok_or_else(|| {
            Error::RedisUnavailable(
                RedisFault::NotConnected,
                "no connection to Redis Cluster yet".into(),
            )
        })
    }

    /// Runs `script` within `deadline`, timed under the script's name:
    /// straight to the master of its keys' slot when there is a direct
    /// connection to it, otherwise (or when that master redirects or its
    /// connection broke) over the cluster connection. `keys` must all be in
    /// one slot; the callers check that before anything is sent.
    pub async fn eval<T: FromRedisValue>(
        &self,
        deadline: &Deadline,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
    ) -> Result<T, Error> {
        deadline
            .run(script.name(), async {
                if let Some((addr, mut conn)) = keys.first().and_then(|k| self.direct_for(k)) {
                    // Armed while the script is in flight: should the
                    // deadline cancel it, that connection may be black-holed,
                    // so it is dropped and the slot map refreshed.
                    let mut in_flight = direct::InFlight::new(self, &addr, &conn, deadline);
                    let result = script.run(&mut conn, keys, &args).await;
                    in_flight.disarm();
                    match result {
                        Ok(value) => return Ok(value),
                        Err(err) if classify(&err).1 == Retry::No => return Err(err.into()),
                        Err(err) => {
                            tracing::debug!(%addr, error = %err, "direct path failed; using the cluster connection");
                            metrics::counter!(m::DIRECT_FALLBACKS).increment(1);
                            self.direct_failed(&addr, &conn, &err);
                            // The slot is moving: the node it names runs the
                            // script after ASKING on a dedicated connection
                            // (see `eval_asked`), not the cluster client.
                            if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask) {
                                if let Some((to, _)) = err.redirect_node() {
                                    let to = to.to_owned();
                                    return self.eval_asked(deadline, script, keys, &args, to).await;
                                }
                            }
                        }
                    }
                }
                // The cluster connection follows MOVED and ASK and retries
                // TRYAGAIN, 8 times in all; while a busy slot moves, ASK to
                // the importing node and TRYAGAIN there (it lacks some of
                // the script's keys until the move ends) use those up fast.
                // A move that lasts longer is waited out here, for as long
                // as the deadline allows. A script refused with a redirect,
                // TRYAGAIN or CLUSTERDOWN did not run; one that ran on an
                // earlier try answers a resend as its first run did.
                let mut conn = self.conn()?;
                let mut waits = 0;
                loop {
                    match script.run(&mut conn, keys, &args).await {
                        Err(err) if matches!(classify(&err).1, Retry::Later | Retry::Elsewhere) => {
                            if classify(&err).1 == Retry::Elsewhere {
                                self.mark_stale();
                            }
                            waits += 1;
                            tokio::time::sleep(later_pause(waits)).await;
                        }
                        result => return Ok(result?),
                    }
                }
            })
            .await
    }

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

    /// `SCRIPT LOAD` of every script on every master.
    pub async fn load_scripts(&self) -> Result<(), Error> {
        let mut conn = self.conn()?;
        let load = async {
            for script in self.scripts.all() {
                let _: Value = redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(script.body())
                    .query_async(&mut conn)
                    .await?;
            }
            Ok(())
        };
        Deadline::after(self.timeout).within(load).await
    }

    /// A client for one node (`host:port`), with the seeds' credentials and
    /// TLS settings.
    pub fn node_client(&self, addr: &str) -> Result<redis::Client, Error> {
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| Error::Internal(format!("bad node address {addr}")))?;
        let node_addr = match self.node_template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        let info = self.node_template.clone().set_addr(node_addr);
        Ok(match &self.tls {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
            None => redis::Client::open(info)?,
        })
    }

    /// Forces a fresh slot map, after a MOVED or a failed node.
    pub async fn refresh_topology(&self) {
        if let Err(why) = self.probe().await {
            tracing::warn!(reason = %why, "topology refresh failed");
        }
    }
}

/// The pause before the `n`th retry of a `TRYAGAIN`, `CLUSTERDOWN` or
/// `LOADING`: 10, 20, 40, then 50 ms.
fn later_pause(n: u32) -> Duration {
    Duration::from_millis((5u64 << n.min(4)).min(50))
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

/// The connection info of one seed URL, with the configured credentials.
fn seed_info(url: &str, opts: &RedisOptions) -> Result<ConnectionInfo, ConfigError> {
    let bad = |reason: String| ConfigError::BadUrl {
        url: redact_url(url),
        reason,
    };
    let info = url.into_connection_info().map_err(|e| {
        if url.contains("://") {
            bad(e.to_string())
        } else {
            bad(format!(
                "{e}; seed nodes are URLs: redis://{} (or rediss:// for TLS)",
                redact_url(url)
            ))
        }
    })?;
    if !matches!(
        info.addr(),
        ConnectionAddr::Tcp(..) | ConnectionAddr::TcpTls { .. }
    ) {
        return Err(bad("Redis Cluster needs a TCP address".into()));
    }
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &opts.username {
        settings = settings.set_username(user);
    }
    if let Some(pass) = &opts.password {
        settings = settings.set_password(pass);
    }
    if let (Some(user), None) = (settings.username(), settings.password()) {
        return Err(if opts.username.is_some() {
            ConfigError::UsernameWithoutPassword
        } else {
            ConfigError::UrlUserWithoutPassword {
                url: redact_url(url),
                user: user.to_owned(),
            }
        });
    }
    Ok(info.set_redis_settings(settings))
}

/// `url` fit for a message or a log line: the password of its user info,
/// if any, replaced with `***` (`redis://user:***@host:port`). Works on
/// seeds without a scheme too (`user:pass@host:port`), and on passwords
/// with unescaped `/` or `@` (everything before the last `@` is user info).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let Some((userinfo, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn redact_url_hides_the_password_only() {
        for (url, shown) in [
            ("redis://127.0.0.1:7000", "redis://127.0.0.1:7000"),
            ("rediss://user@h:1", "rediss://user@h:1"),
            ("redis://user:pw@h:1", "redis://user:***@h:1"),
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            ("redis://u:p/w@x@h:1", "redis://u:***@h:1"),
            ("u:pw@h:1", "u:***@h:1"),
            ("h:1", "h:1"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
