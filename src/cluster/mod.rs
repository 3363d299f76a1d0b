//! The connection to Redis Cluster: one multiplexed cluster connection shared
//! by every request, the slot map, readiness, and the dedicated per-master
//! connections that confirms need for `WAIT`.
//!
//! Scripts take a direct path when they can: every key of a script is in one
//! slot, known before anything is sent, so [`Cluster::eval`] looks the slot's
//! master up in its own slot map and sends EVALSHA over a multiplexed
//! connection to that master, skipping the cluster client's routing task (a
//! channel hop and a task wake-up per request). Whenever the direct path
//! cannot answer (no connection to that master yet, `MOVED`, `ASK`,
//! `TRYAGAIN`, `CLUSTERDOWN`, a replica's `READONLY`, a broken connection),
//! the request goes over the cluster connection instead, which follows
//! redirects and reconnects, and the slot map is refreshed.
//!
//! The cluster connection is made in the background and remade when it
//! fails, so the daemon starts (and answers `/healthz`) before the cluster is
//! reachable, and is simply not ready until it is.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo,
    Value,
};
use tokio::sync::watch;

use crate::error::{Error, RedisFault};
use crate::keys::SLOTS;

mod topology;
pub use topology::{SlotRange, Topology};
use crate::scripts::{Script, Scripts};

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
    #[error("no Redis seed nodes given (--redis-nodes / SEATHOLD_REDIS_NODES)")]
    NoNodes,
    #[error("Redis node URL {url:?} is not usable: {reason}")]
    BadUrl { url: String, reason: String },
}

/// Whether a script that failed on the direct path with `err` should go over
/// the cluster connection: the node refused it because the slot is elsewhere
/// or the cluster is changing (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`,
/// `MASTERDOWN`, `LOADING`, `READONLY`), or the connection is broken. This is
/// what the cluster client itself retries on; script errors and timeouts are
/// answered as they are.
fn rerouted(err: &redis::RedisError) -> bool {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    match err.kind() {
        K::Server(
            S::Moved | S::Ask | S::TryAgain | S::ClusterDown | S::MasterDown | S::BusyLoading,
        )
        | K::Server(S::ReadOnly) => true,
        K::Io => !err.is_timeout(),
        _ => err.is_connection_dropped() || err.is_connection_refusal(),
    }
}

fn publish_direct(direct: &HashMap<Arc<str>, MultiplexedConnection>) {
    metrics::gauge!(crate::metrics::DIRECT_CONNECTIONS).set(direct.len() as f64);
}

/// The Redis side of the daemon.
pub struct Cluster {
    client: ClusterClient,
    conn: RwLock<Option<ClusterConnection>>,
    /// Template for dedicated connections: credentials and TLS of the first seed.
    node_template: ConnectionInfo,
    tls: Option<redis::TlsCertificates>,
    /// Whether the seeds are `rediss://`.
    tls_seeds: bool,
    /// `host:port` of the first seed: whom an unnamed endpoint in a slot map
    /// refers to.
    seed_addr: String,
    topology: RwLock<Arc<Topology>>,
    /// Idle dedicated connections per master, for confirm + WAIT.
    confirm_pool: Mutex<HashMap<String, Vec<MultiplexedConnection>>>,
    /// One shared multiplexed connection per master (`host:port`), for the
    /// direct path of scripts. Opened by [`Cluster::maintain`].
    direct: RwLock<HashMap<Arc<str>, MultiplexedConnection>>,
    /// Set when the direct path met a redirect or a broken connection: the
    /// next `maintain` round refreshes the slot map at once.
    stale: AtomicBool,
    /// Masters a direct connection is being opened to.
    connecting: Mutex<std::collections::HashSet<String>>,
    scripts: Scripts,
    timeout: Duration,
    ready: AtomicBool,
    /// The last readiness verdict, for logs and `/readyz`.
    reason: Mutex<String>,
    topology_changed: watch::Sender<Arc<Topology>>,
}

impl Cluster {
    /// Checks the options and builds the client; connects nothing yet.
    pub fn new(opts: &RedisOptions, scripts: Scripts) -> Result<Arc<Self>, ConfigError> {
        if opts.nodes.is_empty() {
            return Err(ConfigError::NoNodes);
        }
        let mut infos = Vec::with_capacity(opts.nodes.len());
        for url in &opts.nodes {
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| ConfigError::BadUrl {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
            if !matches!(
                info.addr(),
                ConnectionAddr::Tcp(..) | ConnectionAddr::TcpTls { .. }
            ) {
                return Err(ConfigError::BadUrl {
                    url: url.clone(),
                    reason: "Redis Cluster needs a TCP address".into(),
                });
            }
            let mut settings = info.redis_settings().clone();
            if let Some(user) = &opts.username {
                settings = settings.set_username(user);
            }
            if let Some(pass) = &opts.password {
                settings = settings.set_password(pass);
            }
            infos.push(info.set_redis_settings(settings));
        }
        let node_template = infos[0].clone();
        let tls_seeds = matches!(node_template.addr(), ConnectionAddr::TcpTls { .. });
        let seed_addr = node_template.addr().to_string();
        let mut builder = ClusterClientBuilder::new(infos.clone())
            .connection_timeout(opts.timeout)
            .response_timeout(opts.timeout)
            .retries(2)
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
            url: opts.nodes.join(","),
            reason: e.to_string(),
        })?;
        let (topology_changed, _) = watch::channel(Arc::new(Topology::default()));
        Ok(Arc::new(Self {
            client,
            conn: RwLock::new(None),
            node_template,
            tls: opts.tls.clone(),
            tls_seeds,
            seed_addr,
            topology: RwLock::new(Arc::new(Topology::default())),
            confirm_pool: Mutex::new(HashMap::new()),
            direct: RwLock::new(HashMap::new()),
            stale: AtomicBool::new(false),
            connecting: Mutex::new(std::collections::HashSet::new()),
            scripts,
            timeout: opts.timeout,
            ready: AtomicBool::new(false),
            reason: Mutex::new("not connected to Redis Cluster yet".into()),
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

    /// Whether the cluster can serve holds, as last checked in the background.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The current slot map.
    pub fn topology(&self) -> Arc<Topology> {
        self.topology
            .read()
            .map(|t| Arc::clone(&t))
            .unwrap_or_default()
    }

    /// Notified with every new slot map.
    pub fn watch_topology(&self) -> watch::Receiver<Arc<Topology>> {
        self.topology_changed.subscribe()
    }

    /// A handle on the shared cluster connection (a cheap clone of a
    /// multiplexed connection), or 503 while there is none.
    pub fn conn(&self) -> Result<ClusterConnection, Error> {
        self.conn
            .read()
            .ok()
            .and_then(|c| c.clone())
            .ok_or_else(|| {
                Error::RedisUnavailable(
                    RedisFault::NotConnected,
                    "no connection to Redis Cluster yet".into(),
                )
            })
    }

    /// Runs `fut`, Redis operation `op`, with the Redis timeout; records its
    /// latency and, on failure, counts the fault.
    pub async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let start = Instant::now();
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(Error::RedisUnavailable(
                RedisFault::Timeout,
                format!(
                    "no answer from Redis within {} ms",
                    self.timeout.as_millis()
                ),
            )),
        };
        match &result {
            Err(Error::RedisUnavailable(fault, detail)) => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "kind" => fault.label())
                    .increment(1);
                tracing::warn!(kind = fault.label(), %detail, "Redis request failed");
            }
            Err(Error::Internal(detail)) => tracing::error!(%detail, "unexpected Redis reply"),
            _ => {}
        }
        metrics::histogram!(crate::metrics::REDIS_DURATION, "op" => op)
            .record(start.elapsed().as_secs_f64());
        result
    }

    /// Runs `script`, bounded by the Redis timeout and timed under the
    /// script's name: straight to the master of its keys' slot when there is
    /// a direct connection to it, otherwise (or when that master redirects
    /// or its connection broke) over the cluster connection. `keys` must
    /// all be in one slot; the callers check that before anything is sent.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
    ) -> Result<T, Error> {
        self.bounded(script.name(), async {
            if let Some((addr, mut conn)) = keys.first().and_then(|k| self.direct_for(k)) {
                match script.run(&mut conn, keys, &args).await {
                    Ok(value) => return Ok(value),
                    Err(err) if !rerouted(&err) => return Err(err.into()),
                    Err(err) => {
                        tracing::debug!(%addr, error = %err, "direct path failed; using the cluster connection");
                        metrics::counter!(crate::metrics::DIRECT_FALLBACKS).increment(1);
                        self.direct_failed(&addr, &err);
                    }
                }
            }
            let mut conn = self.conn()?;
            Ok(script.run(&mut conn, keys, args).await?)
        })
        .await
    }

    /// The master serving `key`'s slot and the direct connection to it, if
    /// there is one.
    fn direct_for(&self, key: &str) -> Option<(Arc<str>, MultiplexedConnection)> {
        let topology = self.topology();
        let addr = topology.master_of(crate::keys::slot(key.as_bytes()))?;
        let direct = self.direct.read().ok()?;
        let (addr, conn) = direct.get_key_value(addr)?;
        Some((Arc::clone(addr), conn.clone()))
    }

    /// After the direct path to `addr` failed with `err`: a broken
    /// connection is dropped (the next `maintain` round opens a new one), and
    /// either way the slot map is refreshed soon.
    fn direct_failed(&self, addr: &str, err: &redis::RedisError) {
        if !matches!(err.kind(), redis::ErrorKind::Server(_)) {
            if let Ok(mut direct) = self.direct.write() {
                direct.remove(addr);
                publish_direct(&direct);
            }
        }
        self.stale.store(true, Ordering::Relaxed);
    }

    /// Opens, in the background, a direct connection to every master that
    /// has none and is not being connected to already; a master that cannot
    /// be reached never holds up the readiness probe.
    fn connect_direct(self: &Arc<Self>) {
        let topology = self.topology();
        for addr in &topology.masters {
            let have = self
                .direct
                .read()
                .map(|d| d.contains_key(addr.as_str()))
                .unwrap_or(true);
            let started = !have
                && self
                    .connecting
                    .lock()
                    .map(|mut c| c.insert(addr.clone()))
                    .unwrap_or(false);
            if !started {
                continue;
            }
            let (me, addr) = (Arc::clone(self), addr.clone());
            tokio::spawn(async move {
                match me.open_direct(&addr).await {
                    Ok(conn) => {
                        tracing::debug!(%addr, "direct connection to master open");
                        // Only while it is still a master.
                        if me.topology().masters.binary_search(&addr).is_ok() {
                            if let Ok(mut direct) = me.direct.write() {
                                direct.insert(Arc::from(addr.as_str()), conn);
                                publish_direct(&direct);
                            }
                        }
                    }
                    Err(err) => {
                        tracing::warn!(%addr, error = %err, "cannot open a direct connection to master");
                    }
                }
                if let Ok(mut connecting) = me.connecting.lock() {
                    connecting.remove(&addr);
                }
            });
        }
    }

    async fn open_direct(&self, addr: &str) -> Result<MultiplexedConnection, Error> {
        let client = self.node_client(addr)?;
        // No response timeout of its own: every use is bounded by `bounded`,
        // which also counts the timeout; the connect is bounded below.
        let config = AsyncConnectionConfig::new().set_response_timeout(None);
        let connect = client.get_multiplexed_async_connection_with_config(&config);
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(conn) => Ok(conn?),
            Err(_) => Err(Error::RedisUnavailable(
                RedisFault::Timeout,
                format!(
                    "no connection to {addr} within {} ms",
                    self.timeout.as_millis()
                ),
            )),
        }
    }

    /// Background work: connect (and reconnect), keep the slot map and
    /// readiness current. Ends when `shutdown` turns true.
    pub async fn maintain(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let interval = Duration::from_millis(500);
        let mut last = Instant::now();
        self.check_once().await;
        loop {
            // Every 500 ms, or after 50 ms when the direct path found the
            // slot map stale (a redirect or a broken connection).
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
            if last.elapsed() >= interval || self.stale.load(Ordering::Relaxed) {
                last = Instant::now();
                self.check_once().await;
            }
        }
    }

    async fn check_once(self: &Arc<Self>) {
        let connected = self.conn.read().map(|c| c.is_some()).unwrap_or(false);
        if !connected {
            match tokio::time::timeout(self.timeout, self.client.get_async_connection()).await {
                Ok(Ok(conn)) => {
                    tracing::info!("connected to Redis Cluster");
                    if let Ok(mut slot) = self.conn.write() {
                        *slot = Some(conn);
                    }
                }
                Ok(Err(err)) => {
                    let hint = if RedisFault::of(&err) == RedisFault::Auth {
                        " (Redis rejected the credentials: check --redis-username and --redis-password)"
                    } else {
                        ""
                    };
                    self.set_ready(
                        false,
                        &format!("cannot connect to Redis Cluster: {err}{hint}"),
                    );
                    return;
                }
                Err(_) => {
                    // A TLS client on a plain port waits for a ServerHello
                    // that never comes: a timeout is all it sees.
                    let hint = if self.tls_seeds {
                        " (are these ports TLS ports? rediss:// needs tls-port on the nodes)"
                    } else {
                        ""
                    };
                    self.set_ready(
                        false,
                        &format!("cannot connect to Redis Cluster: timed out{hint}"),
                    );
                    return;
                }
            }
        }
        self.stale.store(false, Ordering::Relaxed);
        let ready = self.probe().await;
        match ready {
            Ok(()) => {
                self.set_ready(true, "Redis Cluster is ready");
                self.connect_direct();
            }
            Err(why) => self.set_ready(false, &why),
        }
    }

    /// One readiness probe, itself the round trip that proves Redis answers:
    /// a fresh slot map (installed, with scripts loaded on new masters) that
    /// covers every slot, and a node that reports `cluster_state:ok`.
    async fn probe(&self) -> Result<(), String> {
        let mut conn = self.conn().map_err(|e| e.to_string())?;
        let work = async {
            let slots: Value = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut conn)
                .await?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>((slots, info))
        };
        let (slots, info) = match tokio::time::timeout(self.timeout, work).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "kind" => RedisFault::of(&e).label()).increment(1);
                return Err(format!("Redis probe failed: {e}"));
            }
            Err(_) => {
                metrics::counter!(crate::metrics::REDIS_ERRORS, "kind" => RedisFault::Timeout.label()).increment(1);
                return Err("Redis probe timed out".into());
            }
        };
        let topo = Topology::from_cluster_slots(&slots, &self.seed_addr).ok_or("unexpected CLUSTER SLOTS reply")?;
        self.install_topology(topo).await;
        if !info.lines().any(|l| l.trim() == "cluster_state:ok") {
            return Err("Redis reports cluster_state other than ok".into());
        }
        let covered = self.topology().covered_slots();
        if covered != u32::from(SLOTS) {
            return Err(format!("only {covered} of 16384 slots are served"));
        }
        Ok(())
    }

    async fn install_topology(&self, topo: Topology) {
        if *self.topology() == topo {
            return;
        }
        tracing::info!(masters = ?topo.masters, "Redis Cluster topology changed");
        metrics::counter!(crate::metrics::TOPOLOGY_CHANGES).increment(1);
        metrics::gauge!(crate::metrics::MASTERS).set(topo.masters.len() as f64);
        let topo = Arc::new(topo);
        if let Ok(mut t) = self.topology.write() {
            *t = Arc::clone(&topo);
        }
        // Direct connections to nodes that are no longer masters go.
        if let Ok(mut direct) = self.direct.write() {
            direct.retain(|addr, _| topo.masters.iter().any(|m| m.as_str() == &**addr));
            publish_direct(&direct);
        }
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
            Ok::<_, redis::RedisError>(())
        };
        match tokio::time::timeout(self.timeout, load).await {
            Ok(r) => r.map_err(Error::from),
            Err(_) => Err(Error::RedisUnavailable(
                RedisFault::Timeout,
                "SCRIPT LOAD timed out".into(),
            )),
        }
    }

    fn set_ready(&self, ready: bool, why: &str) {
        let was = self.ready.swap(ready, Ordering::Relaxed);
        metrics::gauge!(crate::metrics::CLUSTER_READY).set(if ready { 1.0 } else { 0.0 });
        let Ok(mut reason) = self.reason.lock() else {
            return;
        };
        // Log changes only: the probe runs twice a second.
        if was != ready || *reason != why {
            if ready {
                tracing::info!("{why}");
            } else {
                tracing::warn!(reason = why, "not ready");
            }
            why.clone_into(&mut reason);
        }
    }

    /// Why the cluster is not ready (or that it is), as last found.
    pub fn readiness(&self) -> String {
        self.reason.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Takes an idle dedicated connection to the master at `addr`, or opens
    /// one. Only one request uses such a connection at a time, because
    /// `WAIT` blocks it and counts its writes.
    pub async fn dedicated(&self, addr: &str) -> Result<MultiplexedConnection, Error> {
        if let Some(conn) = self
            .confirm_pool
            .lock()
            .ok()
            .and_then(|mut p| p.get_mut(addr).and_then(Vec::pop))
        {
            return Ok(conn);
        }
        let client = self.node_client(addr)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        Ok(client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
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

    /// Gives a dedicated connection back after a clean use.
    pub fn give_back(&self, addr: &str, conn: MultiplexedConnection) {
        if let Ok(mut pool) = self.confirm_pool.lock() {
            let idle = pool.entry(addr.to_owned()).or_default();
            // Bounded: a burst of confirms must not leave many idle sockets.
            if idle.len() < 16 {
                idle.push(conn);
            }
        }
    }

    /// Drops the idle dedicated connections to `addr`, after one failed.
    pub fn forget(&self, addr: &str) {
        if let Ok(mut pool) = self.confirm_pool.lock() {
            pool.remove(addr);
        }
    }

    /// Forces a fresh slot map, after a MOVED or a failed node.
    pub async fn refresh_topology(&self) {
        if let Err(why) = self.probe().await {
            tracing::warn!(reason = %why, "topology refresh failed");
        }
    }
}
