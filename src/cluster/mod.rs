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
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo, Value};
use tokio::sync::watch;

use crate::error::Error;
use crate::metrics as m;
use crate::scripts::{Script, Scripts};

mod batch;
mod confirm;
mod deadline;
mod direct;
mod fault;
mod probe;
mod readiness;
mod topology;

pub use confirm::Wait;
pub use deadline::Deadline;
pub use fault::{classify, RedisFault, Retry};
pub use readiness::Readiness;
pub use topology::{SlotRange, Topology};

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
}

/// The pause before the `n`th retry of a `TRYAGAIN`, `CLUSTERDOWN` or
/// `LOADING`: 10, 20, 40, then 50 ms.
fn later_pause(n: u32) -> Duration {
    Duration::from_millis((5u64 << n.min(4)).min(50))
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
