//! A throwaway local Redis Cluster, for `seathold dev`, the integration tests,
//! failover tests and benchmarks.
//!
//! [`LocalCluster::start`] launches `masters * (1 + replicas_per_master)`
//! `redis-server` processes on free loopback ports, each in its own folder of
//! a fresh temporary directory, and joins them into a cluster with plain
//! per-node commands (`CLUSTER ADDSLOTSRANGE`, `CLUSTER MEET`,
//! `CLUSTER REPLICATE`) instead of `redis-cli --cluster create`, because the
//! latter refuses fewer than three masters and benchmarks want a single one.
//!
//! # Why the processes cannot outlive us
//!
//! Tests keep one cluster in a `static`, which is never dropped, and a
//! developer may kill `seathold dev` with `kill -9`; neither must leave
//! `redis-server`s behind. Every `redis-server` is therefore paired with a tiny
//! watchdog: a `/bin/sh` whose standard input is a pipe (the *lifeline*) whose
//! only write end is held by this process. However this process ends, the
//! kernel closes that write end, the watchdog's `read` sees end-of-file, and it
//! `kill -9`s its `redis-server` and removes the node's folder (and the
//! temporary directory once it is empty). An orderly stop first writes a line
//! to the lifeline, which makes the watchdog exit without killing anything.
//!
//! This was preferred over `prctl(PR_SET_PDEATHSIG)` because that needs the
//! `libc` crate and an `unsafe` `pre_exec`, is tied to the spawning *thread*
//! (a short-lived test thread would take the servers with it), and does not
//! exist on macOS; the pipe works everywhere `/bin/sh` does. Both the
//! `redis-server` and its watchdog are direct children of this process, so we
//! reap both, and the pid we signal is always one we have not reaped yet,
//! so it cannot have been reused by an unrelated process. (The only window is
//! a `redis-server` that exits by itself and is reaped by us just before this
//! process dies: the watchdog would then signal a pid that is free; pids are
//! handed out sequentially, so that needs a full wrap-around in that instant.)
//!
//! Signals other than `SIGKILL` (which `std` can send) are sent with the
//! shell's `kill` builtin, which keeps this module free of `unsafe` and of new
//! dependencies.
//!
//! Each server runs in its own process group, so a Ctrl-C in the terminal
//! reaches only `seathold dev`, which then stops the cluster in order.
//!
//! # TLS
//!
//! With [`ClusterOptions::tls`] every node also listens on a TLS port of its
//! own ([`NodeInfo::tls_port`], seeds from [`LocalCluster::tls_seed_urls`]),
//! and the cluster bus and replication run over TLS (`tls-cluster yes`,
//! `tls-replication yes`). The plain port stays open: this module sets the
//! cluster up and checks it over plain TCP. Clients need not present a
//! certificate (`tls-auth-clients optional`), but one signed by the CA is
//! verified if they do.
//!
//! Redis 7 names the TLS ports in `CLUSTER SLOTS`, `CLUSTER NODES` and
//! `MOVED`/`ASK` redirections to clients connected over TLS, and the plain
//! ports to the others, so a cluster client seeded with `rediss://` URLs
//! follows the TLS ports and one seeded with `redis://` URLs the plain ones;
//! `CLUSTER SHARDS` gives every client both, as `port` and `tls-port`.
//! Replicas replicate from their master's TLS port.
//!
//! With `tls-cluster yes` Redis would put the cluster bus on the TLS port plus
//! 10000; `cluster-port` keeps it on the plain port plus 10000
//! ([`BUS_PORT_OFFSET`]), so `CLUSTER MEET` with a plain port, the bus ports
//! of [`NodeInfo`] and the port allocation stay as without TLS.
//!
//! The certificate files are copied into every node's folder at start
//! (`redis-server` reads them from there, also on
//! [`LocalCluster::restart`]), so the caller may delete its own copies once
//! [`LocalCluster::start`] returns; [`LocalCluster::tls_files`] names the
//! cluster's copies, e.g. the CA for a client.

use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, Value};

/// Number of hash slots in a Redis Cluster.
pub const SLOT_COUNT: u16 = 16384;

/// The cluster bus of a node listens on its client port plus this offset.
pub const BUS_PORT_OFFSET: u16 = 10000;

/// Client ports are chosen from this range. With the bus offset the bus ports
/// land in 30000..=32767, so neither stays inside Linux's default ephemeral
/// range (32768..=60999), where outgoing connections would keep taking them.
const PORT_RANGE: std::ops::RangeInclusive<u16> = 20000..=22767;

/// How often readiness conditions are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// Timeout for one connection attempt or one command during setup and checks.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Timeout of the start-up probe (`INFO server`), which is repeated until the
/// server answers; a local Redis answers in well under a millisecond.
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

/// How long `redis-server`s get to exit after `SIGTERM` before `SIGKILL`.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// How many times a node may be moved to other ports because its own were
/// taken between our check and its start (another cluster starting at once).
const PORT_ATTEMPTS: usize = 8;

/// Lines of a node's log quoted in errors.
const LOG_TAIL_LINES: usize = 20;

/// File in the node folder that receives the server's stdout and stderr
/// (config errors are printed there before `logfile` takes effect).
const STDIO_LOG: &str = "stdio.log";
/// The server's own log file, in the node folder.
const REDIS_LOG: &str = "redis.log";

/// Names of the copies of [`TlsFiles`] in each node folder.
const TLS_CERT: &str = "tls-node.crt";
const TLS_KEY: &str = "tls-node.key";
const TLS_CA: &str = "tls-ca.crt";

/// The watchdog run by `/bin/sh -c`; `$1` is the server pid, `$2` the node
/// folder, `$3` the temporary directory. A line on stdin means "stand down";
/// end-of-file means the owner is gone.
const WATCHDOG_SCRIPT: &str = r#"if read -r line; then exit 0; fi
kill -9 "$1" 2>/dev/null
rm -rf "$2"
rmdir "$3" 2>/dev/null
exit 0"#;

/// Sends the signal `$1` to the pids that follow it.
const KILL_SCRIPT: &str = r#"sig="$1"; shift; kill -s "$sig" "$@""#;

/// Everything that can go wrong while running a local cluster.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    /// No `redis-server` executable on `PATH`.
    #[error(
        "redis-server was not found on PATH; install it, e.g. `sudo apt-get install redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"
    )]
    RedisServerNotFound,
    /// An explicitly given `redis-server` path is missing or not executable.
    #[error("redis-server binary {} does not exist or is not executable", path.display())]
    RedisServerNotExecutable {
        /// The path that was given.
        path: PathBuf,
    },
    /// [`ClusterOptions`] that cannot describe a cluster.
    #[error("invalid cluster options: {0}")]
    InvalidOptions(String),
    /// A file-system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Every port of the range was tried and none was free.
    #[error(
        "no free port pair (port and port+{BUS_PORT_OFFSET}) found on 127.0.0.1 in {PORT_RANGE:?}"
    )]
    NoFreePorts,
    /// A `redis-server` exited or misbehaved.
    #[error("redis-server on port {port}: {reason}{log_tail}")]
    Node {
        /// The node's client port.
        port: u16,
        /// What happened.
        reason: String,
        /// The end of the node's log files, starting with a newline, or empty.
        log_tail: String,
    },
    /// A condition was not reached before its deadline.
    #[error("timed out after {waited:?} waiting for {what}{log_tail}")]
    Timeout {
        /// How long we waited.
        waited: Duration,
        /// The condition that was not met, naming the node it was last
        /// missing on.
        what: String,
        /// The end of that node's log files, starting with a newline, or empty.
        log_tail: String,
    },
    /// No node of this cluster uses that port.
    #[error("no node of this cluster uses port {0}")]
    UnknownNode(u16),
    /// The node was killed (or exited) and has not been restarted.
    #[error("the node on port {0} is not running")]
    NotRunning(u16),
    /// [`LocalCluster::restart`] on a node that is running.
    #[error("the node on port {0} is already running")]
    AlreadyRunning(u16),
    /// A slot number of 16384 or more.
    #[error("slot {0} is out of range (0..={max})", max = SLOT_COUNT - 1)]
    InvalidSlot(u16),
    /// The shell's `kill` could not deliver a signal.
    #[error("sending SIG{signal} to pid(s) {pids:?} failed: {detail}")]
    Signal {
        /// The signal name without `SIG`.
        signal: &'static str,
        /// The target pids.
        pids: Vec<u32>,
        /// Why.
        detail: String,
    },
    /// A command sent to a node failed.
    #[error("redis command `{command}` on port {port} failed: {source}")]
    Redis {
        /// The node's client port.
        port: u16,
        /// The command, e.g. `CLUSTER SLOTS`.
        command: String,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },
    /// A node answered something this module does not understand.
    #[error("unexpected reply to `{command}` from port {port}: {detail}")]
    Protocol {
        /// The node's client port.
        port: u16,
        /// The command.
        command: String,
        /// What was wrong with the reply.
        detail: String,
    },
    /// No running node could answer.
    #[error("no running node of the cluster answered: {0}")]
    NoLiveNode(String),
}

fn io_error(context: impl Into<String>) -> impl FnOnce(io::Error) -> DevError {
    let context = context.into();
    move |source| DevError::Io { context, source }
}

/// The role a node was started in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Serves a share of the slots.
    Master,
    /// Replicates a master and may be promoted in a failover.
    Replica,
}

/// How to build a [`LocalCluster`].
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of masters; the slots are split evenly between them. One is
    /// allowed (benchmarks compare one master with three).
    pub masters: usize,
    /// Replicas attached to each master.
    pub replicas_per_master: usize,
    /// `cluster-node-timeout` in milliseconds: how long a node may be
    /// unreachable before it is failed over. Small values make failover tests
    /// fast.
    pub node_timeout_ms: u64,
    /// Extra `redis.conf` directives, written after the defaults so they
    /// override them, e.g. `("notify-keyspace-events", "Ex")`. The value is
    /// written verbatim, so multi-argument directives work; quote values that
    /// contain spaces yourself.
    pub extra_config: Vec<(String, String)>,
    /// The `redis-server` binary: a bare name is looked up on `PATH`, a path
    /// with a `/` is used as is.
    pub redis_server: PathBuf,
    /// Deadline for the whole of [`LocalCluster::start`], and for each
    /// [`LocalCluster::restart`].
    pub start_timeout: Duration,
    /// When set, every node also serves TLS on a port of its own, and the
    /// cluster bus and replication use TLS (see the module docs). Needs a
    /// `redis-server` built with TLS (`BUILD_TLS=yes`; Debian's and
    /// Homebrew's are).
    pub tls: Option<TlsFiles>,
}

/// PEM files for a TLS-enabled [`LocalCluster`]; [`LocalCluster::start`]
/// copies them into the node folders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate every node presents: to clients, and to its peers on the
    /// cluster bus and replication links, so it should be valid for both
    /// server and client authentication and name the address clients use
    /// (e.g. `IP:127.0.0.1`).
    pub cert: PathBuf,
    /// Private key of `cert`.
    pub key: PathBuf,
    /// CA that signed `cert`: nodes verify each other, and client
    /// certificates when a client offers one, against it.
    pub ca: PathBuf,
}

impl Default for ClusterOptions {
    /// Three masters with one replica each, a 2 s node timeout, `redis-server`
    /// from `PATH`, a 30 s start deadline and no TLS.
    fn default() -> Self {
        ClusterOptions {
            masters: 3,
            replicas_per_master: 1,
            node_timeout_ms: 2000,
            extra_config: Vec::new(),
            redis_server: PathBuf::from("redis-server"),
            start_timeout: Duration::from_secs(30),
            tls: None,
        }
    }
}

impl ClusterOptions {
    fn validate(&self) -> Result<(), DevError> {
        let invalid = |msg: String| Err(DevError::InvalidOptions(msg));
        if self.masters == 0 || self.masters > usize::from(SLOT_COUNT) {
            return invalid(format!(
                "masters must be in 1..={SLOT_COUNT}, not {}",
                self.masters
            ));
        }
        let total = self
            .masters
            .saturating_mul(self.replicas_per_master.saturating_add(1));
        if total > 500 {
            return invalid(format!(
                "{total} nodes is more than the 500 a local cluster allows"
            ));
        }
        if self.node_timeout_ms == 0 {
            return invalid("node_timeout_ms must be positive".into());
        }
        for (key, value) in &self.extra_config {
            let bad = |s: &str| s.contains(['\n', '\r']);
            if key.trim().is_empty() || key.contains(char::is_whitespace) || bad(value) {
                return invalid(format!("bad extra_config directive {key:?} {value:?}"));
            }
        }
        if let Some(tls) = &self.tls {
            for (what, path) in [("cert", &tls.cert), ("key", &tls.key), ("ca", &tls.ca)] {
                if !path.is_file() {
                    return invalid(format!(
                        "tls.{what} {} is not a readable file",
                        path.display()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A snapshot of one node, as returned by [`LocalCluster::nodes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Client port on 127.0.0.1.
    pub port: u16,
    /// Cluster bus port (`port + 10000`, also with TLS).
    pub bus_port: u16,
    /// TLS client port on 127.0.0.1, when the cluster was started with
    /// [`ClusterOptions::tls`].
    pub tls_port: Option<u16>,
    /// Pid of the `redis-server`, or `None` while it is killed.
    pub pid: Option<u32>,
    /// Whether it is stopped with `SIGSTOP` by [`LocalCluster::pause`].
    pub paused: bool,
    /// The role it was created with; failovers change the live role, see
    /// [`LocalCluster::current_role`].
    pub initial_role: Role,
    /// For a replica, the port of the master it was created under.
    pub initial_master_port: Option<u16>,
    /// The node's folder: `redis.conf`, `nodes.conf`, `redis.log`.
    pub dir: PathBuf,
}

/// The processes of one running node.
struct NodeProcess {
    server: Child,
    watchdog: Child,
    /// Write end of the watchdog's stdin; `None` once released.
    lifeline: Option<ChildStdin>,
}

impl NodeProcess {
    fn pid(&self) -> u32 {
        self.server.id()
    }

    /// Tells the watchdog to exit without killing, and reaps it. Must happen
    /// before the server is reaped, so that the watchdog can never signal a
    /// pid that has been freed.
    fn release_watchdog(&mut self) {
        if let Some(mut lifeline) = self.lifeline.take() {
            // EPIPE here means the watchdog is already gone: nothing to stop.
            let _ = lifeline.write_all(b"release\n");
        }
        if wait_with_grace(&mut self.watchdog, Duration::from_secs(1)).is_none() {
            // Its pid is still ours (not reaped), so this is safe.
            let _ = self.watchdog.kill();
            let _ = self.watchdog.wait();
        }
    }

    /// `Some(status)` if the server has exited (it is then reaped and the
    /// watchdog released).
    fn exited(&mut self) -> Option<ExitStatus> {
        match self.server.try_wait() {
            Ok(Some(status)) => {
                self.release_watchdog();
                Some(status)
            }
            Ok(None) => None,
            // ECHILD and the like: we cannot learn anything more; treat the
            // server as gone rather than signalling a pid we cannot vouch for.
            Err(_) => {
                self.release_watchdog();
                Some(ExitStatus::default())
            }
        }
    }

    /// `SIGKILL` the server and reap both processes.
    fn kill_now(&mut self) {
        let _ = self.server.kill();
        self.release_watchdog();
        let _ = self.server.wait();
    }
}

impl Drop for NodeProcess {
    /// A safety net: a process table entry that is dropped while its server
    /// runs takes the server with it. After an orderly stop both children are
    /// already reaped and this does nothing (`std` remembers their status and
    /// sends no signal).
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Waits up to `grace` for `child` to exit, polling.
fn wait_with_grace(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => return None,
        }
    }
}

struct Node {
    port: u16,
    /// Set when the cluster has TLS.
    tls_port: Option<u16>,
    dir: PathBuf,
    conf: PathBuf,
    initial_role: Role,
    /// Index of the master a replica was created under.
    initial_master: Option<usize>,
    process: Option<NodeProcess>,
    paused: bool,
}

impl Node {
    /// Whether the server is up (reaping it if it has exited by itself).
    fn is_running(&mut self) -> bool {
        if let Some(process) = self.process.as_mut() {
            if process.exited().is_some() {
                self.process = None;
                self.paused = false;
            }
        }
        self.process.is_some()
    }

    /// Running and not paused: able to answer commands.
    fn is_live(&mut self) -> bool {
        self.is_running() && !self.paused
    }
}

/// A running local Redis Cluster. Dropping it (or [`LocalCluster::stop`])
/// terminates every `redis-server` and removes the temporary directory.
///
/// All methods take `&self`, so one cluster can sit in a `static` shared by
/// many tests. It holds no connections or tasks of any tokio runtime (each
/// call opens its own short-lived connections), so it may be used from
/// several runtimes, e.g. one per `#[tokio::test]`.
pub struct LocalCluster {
    nodes: Mutex<Vec<Node>>,
    masters: usize,
    /// The first node's copies of the TLS files, when the cluster has TLS.
    tls_files: Option<TlsFiles>,
    redis_server: PathBuf,
    start_timeout: Duration,
    /// `None` only after [`LocalCluster::stop`] took it.
    temp_dir: Option<tempfile::TempDir>,
    /// Path of `temp_dir`, kept for [`LocalCluster::dir`] after `stop`.
    dir: PathBuf,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("dir", &self.dir)
            .field("nodes", &self.nodes())
            .finish()
    }
}

/// One node's part in the slot map: `start..=end` served by `master`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotRange {
    start: u16,
    end: u16,
    master: u16,
    /// Sorted replica ports.
    replicas: Vec<u16>,
}

/// A condition not met yet, and on which node.
struct Waiting {
    port: u16,
    what: String,
}

impl Waiting {
    fn new(port: u16, what: impl Into<String>) -> Option<Waiting> {
        Some(Waiting {
            port,
            what: what.into(),
        })
    }
}

/// How a freshly spawned server's start ended.
enum Launch {
    Ready,
    PortTaken,
}

impl LocalCluster {
    /// Starts `redis-server`s, builds the cluster and waits until it is fully
    /// formed: every node sees all nodes and `cluster_state:ok` with all 16384
    /// slots assigned, every replica's link to its master is up, and every
    /// node reports the same slot map. Fails after
    /// [`ClusterOptions::start_timeout`] with an error naming what did not
    /// happen and quoting the log of the node concerned; whatever was started
    /// is stopped again, also when the future is dropped before it finishes
    /// (e.g. Ctrl-C during start).
    pub async fn start(opts: ClusterOptions) -> Result<LocalCluster, DevError> {
        opts.validate()?;
        let redis_server = resolve_redis_server(&opts.redis_server)?;
        let started_at = Instant::now();
        let deadline = started_at + opts.start_timeout;
        let temp_dir = tempfile::Builder::new()
            .prefix("seathold-dev-")
            .tempdir()
            .map_err(io_error("creating the cluster's temporary directory"))?;
        let dir = temp_dir.path().to_path_buf();
        let total = opts.masters * (1 + opts.replicas_per_master);
        let mut nodes = Vec::with_capacity(total);
        for index in 0..total {
            let node_dir = dir.join(format!("node-{index}"));
            fs::create_dir(&node_dir)
                .map_err(io_error(format!("creating {}", node_dir.display())))?;
            let (initial_role, initial_master) = if index < opts.masters {
                (Role::Master, None)
            } else {
                (Role::Replica, Some((index - opts.masters) % opts.masters))
            };
            nodes.push(Node {
                port: 0,
                tls_port: None,
                conf: node_dir.join("redis.conf"),
                dir: node_dir,
                initial_role,
                initial_master,
                process: None,
                paused: false,
            });
        }
        // From here on, dropping `cluster` on an error cleans everything up.
        let cluster = LocalCluster {
            tls_files: opts
                .tls
                .as_ref()
                .and_then(|_| nodes.first())
                .map(|n| node_tls_files(&n.dir)),
            nodes: Mutex::new(nodes),
            masters: opts.masters,
            redis_server,
            start_timeout: opts.start_timeout,
            temp_dir: Some(temp_dir),
            dir,
        };
        cluster.copy_tls_files(&opts)?;
        cluster.launch_all(&opts, deadline).await?;
        cluster.form(deadline).await?;
        tracing::info!(
            dir = %cluster.dir.display(),
            ports = ?cluster.nodes().iter().map(|n| n.port).collect::<Vec<_>>(),
            tls_ports = ?cluster.nodes().iter().filter_map(|n| n.tls_port).collect::<Vec<_>>(),
            elapsed_ms = started_at.elapsed().as_millis() as u64,
            "local redis cluster is ready"
        );
        Ok(cluster)
    }

    /// [`LocalCluster::start`] for synchronous callers such as a `static`
    /// initializer. It runs on its own thread with its own runtime, so it
    /// works inside or outside a tokio runtime (it blocks the caller).
    pub fn start_blocking(opts: ClusterOptions) -> Result<LocalCluster, DevError> {
        let thread = std::thread::Builder::new()
            .name("seathold-dev-start".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(io_error("building a tokio runtime"))?;
                runtime.block_on(LocalCluster::start(opts))
            })
            .map_err(io_error("spawning the cluster start thread"))?;
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// `redis://127.0.0.1:PORT` for every node, to seed a cluster client.
    pub fn seed_urls(&self) -> Vec<String> {
        self.lock().iter().map(|n| node_url(n.port)).collect()
    }

    /// `rediss://127.0.0.1:TLSPORT` for every node, to seed a cluster client
    /// over TLS (it needs the CA of [`LocalCluster::tls_files`]); empty when
    /// the cluster was started without [`ClusterOptions::tls`].
    pub fn tls_seed_urls(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter_map(|n| n.tls_port)
            .map(|port| format!("rediss://127.0.0.1:{port}"))
            .collect()
    }

    /// The cluster's own copies of its TLS files (in the first node's
    /// folder; valid until the cluster stops), or `None` without TLS. Their
    /// `ca` is what a client needs to trust the nodes.
    pub fn tls_files(&self) -> Option<&TlsFiles> {
        self.tls_files.as_ref()
    }

    /// A snapshot of every node, masters first in creation order.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut nodes = self.lock();
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        nodes
            .iter_mut()
            .map(|n| {
                n.is_running();
                NodeInfo {
                    port: n.port,
                    bus_port: n.port.saturating_add(BUS_PORT_OFFSET),
                    tls_port: n.tls_port,
                    pid: n.process.as_ref().map(NodeProcess::pid),
                    paused: n.paused,
                    initial_role: n.initial_role,
                    initial_master_port: n.initial_master.map(|i| ports[i]),
                    dir: n.dir.clone(),
                }
            })
            .collect()
    }

    /// The temporary directory holding one folder per node.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The port of the master currently serving `slot`, according to the
    /// live cluster (`CLUSTER SLOTS` on every running node, majority wins),
    /// so it reflects failovers once the nodes have agreed on them; call
    /// [`LocalCluster::wait_until_ok`] first after killing a node.
    pub async fn master_port_for_slot(&self, slot: u16) -> Result<u16, DevError> {
        if slot >= SLOT_COUNT {
            return Err(DevError::InvalidSlot(slot));
        }
        let mut votes: Vec<(u16, usize)> = Vec::new();
        let mut last_error = String::from("no node is running");
        for port in self.live_ports() {
            let answer = async {
                let mut con = connect(port).await?;
                cluster_slots(&mut con, port).await
            }
            .await;
            match answer {
                Ok(ranges) => {
                    let owner = ranges.iter().find(|r| r.start <= slot && slot <= r.end);
                    match owner {
                        Some(range) => match votes.iter_mut().find(|(p, _)| *p == range.master) {
                            Some((_, count)) => *count += 1,
                            None => votes.push((range.master, 1)),
                        },
                        None => last_error = format!("port {port} sees slot {slot} unassigned"),
                    }
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        // Ties go to the answer heard first, i.e. from the lowest node.
        let mut best: Option<(u16, usize)> = None;
        for (port, count) in votes {
            if best.is_none_or(|(_, c)| count > c) {
                best = Some((port, count));
            }
        }
        best.map(|(port, _)| port)
            .ok_or(DevError::NoLiveNode(last_error))
    }

    /// The role the node on `port` has now (`ROLE`), which differs from
    /// [`NodeInfo::initial_role`] after a failover.
    pub async fn current_role(&self, port: u16) -> Result<Role, DevError> {
        self.with_node(port, |n| {
            if n.is_running() {
                Ok(())
            } else {
                Err(DevError::NotRunning(port))
            }
        })?;
        let mut con = connect(port).await?;
        let reply: Value = query(&mut con, port, redis::cmd("ROLE")).await?;
        let role = match &reply {
            Value::Array(items) => items.first().and_then(value_str),
            _ => None,
        };
        match role.as_deref() {
            Some("master") => Ok(Role::Master),
            Some("slave") | Some("replica") => Ok(Role::Replica),
            _ => Err(DevError::Protocol {
                port,
                command: "ROLE".into(),
                detail: format!("{reply:?}"),
            }),
        }
    }

    /// `SIGKILL`s the node on `port` (and reaps it), as a crash would. Its
    /// folder stays, so [`LocalCluster::restart`] can bring it back.
    pub fn kill(&self, port: u16) -> Result<(), DevError> {
        self.with_node(port, |node| {
            if !node.is_running() {
                return Err(DevError::NotRunning(port));
            }
            if let Some(mut process) = node.process.take() {
                process.kill_now();
            }
            node.paused = false;
            tracing::debug!(port, "killed redis-server");
            Ok(())
        })
        .map(|_| ())
    }

    /// `SIGSTOP`s the node on `port`: it keeps its sockets but stops
    /// answering, like a hung machine. Undo with [`LocalCluster::resume`].
    pub fn pause(&self, port: u16) -> Result<(), DevError> {
        self.signal_node(port, "STOP", true)
    }

    /// `SIGCONT`s a node stopped by [`LocalCluster::pause`].
    pub fn resume(&self, port: u16) -> Result<(), DevError> {
        self.signal_node(port, "CONT", false)
    }

    /// Starts a killed node again with its folder and `redis.conf`; it
    /// rejoins with the identity saved in its `nodes.conf` (a killed master
    /// that was failed over comes back as a replica). Waits until it answers;
    /// use [`LocalCluster::wait_until_ok`] to wait for the cluster to settle.
    pub async fn restart(&self, port: u16) -> Result<(), DevError> {
        let index = self.with_node(port, |node| {
            if node.is_running() {
                return Err(DevError::AlreadyRunning(port));
            }
            self.spawn_into(node)
        })?;
        let deadline = Instant::now() + self.start_timeout;
        match self.wait_launched(index, deadline).await? {
            Launch::Ready => Ok(()),
            Launch::PortTaken => Err(DevError::Node {
                port,
                reason: "could not restart: its port was taken by another process".into(),
                log_tail: self.log_tail_of_port(port),
            }),
        }
    }

    /// Waits until the cluster is healthy over the nodes that are running and
    /// not paused: each reports `cluster_state:ok` with all 16384 slots
    /// assigned, each replica's master link is up, all report the same slot
    /// map, and that map names only such nodes (so after a master is killed
    /// this returns once its replica has taken over and everyone knows it).
    pub async fn wait_until_ok(&self, timeout: Duration) -> Result<(), DevError> {
        let started = Instant::now();
        loop {
            let waiting = self.check_healthy().await;
            let Some(waiting) = waiting else {
                return Ok(());
            };
            if started.elapsed() >= timeout {
                return Err(self.timeout_error(started, waiting));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Stops every `redis-server` (`SIGTERM`, then `SIGKILL` after a few
    /// seconds), reaps them and removes the temporary directory; the same as
    /// dropping the cluster, spelled out. Blocks for as long as the servers
    /// take to exit (normally well under a second). A folder that cannot be
    /// removed is logged, not returned: there is nothing a caller could do.
    pub fn stop(self) {
        drop(self);
    }

    // ----- internals -----

    fn lock(&self) -> MutexGuard<'_, Vec<Node>> {
        // A panic while holding the lock leaves the node table consistent
        // enough (each field is updated atomically), so carry on.
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the node using `port`; returns its index on success.
    fn with_node(
        &self,
        port: u16,
        f: impl FnOnce(&mut Node) -> Result<(), DevError>,
    ) -> Result<usize, DevError> {
        let mut nodes = self.lock();
        let index = nodes
            .iter()
            .position(|n| n.port == port)
            .ok_or(DevError::UnknownNode(port))?;
        f(&mut nodes[index])?;
        Ok(index)
    }

    fn live_ports(&self) -> Vec<u16> {
        self.lock()
            .iter_mut()
            .filter_map(|n| n.is_live().then_some(n.port))
            .collect()
    }

    fn signal_node(&self, port: u16, signal: &'static str, pause: bool) -> Result<(), DevError> {
        self.with_node(port, |node| {
            // `is_running` reaps a server that exited, so a pid we signal is
            // never one that could have been reused.
            if !node.is_running() {
                return Err(DevError::NotRunning(port));
            }
            if let Some(process) = node.process.as_ref() {
                send_signal(signal, &[process.pid()])?;
            }
            node.paused = pause;
            tracing::debug!(port, signal, "signalled redis-server");
            Ok(())
        })
        .map(|_| ())
    }

    /// Spawns the node's server with its `redis.conf`.
    fn spawn_node(&self, index: usize) -> Result<(), DevError> {
        let mut nodes = self.lock();
        self.spawn_into(&mut nodes[index])
    }

    /// Spawns `node`'s server; the caller holds the lock, so that checking
    /// that a node is down and starting it is one step.
    fn spawn_into(&self, node: &mut Node) -> Result<(), DevError> {
        let process = spawn_server(&self.redis_server, &node.conf, &node.dir, &self.dir)?;
        tracing::debug!(
            port = node.port,
            pid = process.pid(),
            "spawned redis-server"
        );
        node.process = Some(process);
        node.paused = false;
        Ok(())
    }

    /// Gives every node free ports and waits until each answers `PING` as
    /// itself; a node whose ports were taken meanwhile moves to others.
    async fn launch_all(&self, opts: &ClusterOptions, deadline: Instant) -> Result<(), DevError> {
        let total = self.lock().len();
        for index in 0..total {
            self.configure_node(index, opts)?;
            self.spawn_node(index)?;
        }
        for index in 0..total {
            let mut attempts = 1;
            while let Launch::PortTaken = self.wait_launched(index, deadline).await? {
                if attempts >= PORT_ATTEMPTS {
                    let port = self.lock()[index].port;
                    return Err(DevError::Node {
                        port,
                        reason: format!("its ports were taken {PORT_ATTEMPTS} times in a row"),
                        log_tail: self.log_tail_of_port(port),
                    });
                }
                attempts += 1;
                let node_dir = self.lock()[index].dir.clone();
                // A bus-port clash happens after nodes.conf was written with
                // the old port: start over as a brand-new node. The old logs
                // go too, so that their "Address already in use" cannot be
                // mistaken for the outcome of the next attempt.
                for name in ["nodes.conf", REDIS_LOG, STDIO_LOG] {
                    let path = node_dir.join(name);
                    match fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io_error(format!("removing {}", path.display()))(e)),
                    }
                }
                self.configure_node(index, opts)?;
                self.spawn_node(index)?;
            }
        }
        Ok(())
    }

    /// Copies the TLS files into every node folder (see the module docs).
    fn copy_tls_files(&self, opts: &ClusterOptions) -> Result<(), DevError> {
        let Some(tls) = &opts.tls else {
            return Ok(());
        };
        for node in self.lock().iter() {
            let copies = node_tls_files(&node.dir);
            for (from, to) in [
                (&tls.cert, &copies.cert),
                (&tls.key, &copies.key),
                (&tls.ca, &copies.ca),
            ] {
                fs::copy(from, to).map_err(io_error(format!(
                    "copying {} to {}",
                    from.display(),
                    to.display()
                )))?;
            }
            // The key is a secret; the folder is ours alone anyway.
            fs::set_permissions(&copies.key, fs::Permissions::from_mode(0o600))
                .map_err(io_error(format!("restricting {}", copies.key.display())))?;
        }
        Ok(())
    }

    /// Picks fresh ports for a node and writes its `redis.conf`.
    fn configure_node(&self, index: usize, opts: &ClusterOptions) -> Result<(), DevError> {
        let port = allocate_port()?;
        // Taken from the same sequence, so it differs from every other port
        // of this process's clusters (its unused port+10000 is only checked).
        let tls_port = match opts.tls {
            Some(_) => Some(allocate_port()?),
            None => None,
        };
        let mut nodes = self.lock();
        let node = &mut nodes[index];
        node.port = port;
        node.tls_port = tls_port;
        let config = render_config(port, tls_port, &node.dir, opts)?;
        fs::write(&node.conf, config).map_err(io_error(format!("writing {}", node.conf.display())))
    }

    /// Waits until the freshly spawned node answers as itself (its
    /// `process_id` matches, so we are not talking to some other cluster's
    /// server that got the port first).
    async fn wait_launched(&self, index: usize, deadline: Instant) -> Result<Launch, DevError> {
        let started = Instant::now();
        loop {
            let (port, pid, dir) = {
                let mut nodes = self.lock();
                let node = &mut nodes[index];
                let exited = node.process.as_mut().map(NodeProcess::exited);
                match exited {
                    None => return Err(DevError::NotRunning(node.port)),
                    Some(Some(status)) => {
                        node.process = None;
                        let log_tail = log_tail(&node.dir);
                        if log_tail.contains("Address already in use") {
                            tracing::debug!(port = node.port, "port taken, moving the node");
                            return Ok(Launch::PortTaken);
                        }
                        let hint = if node.tls_port.is_some()
                            && log_tail.contains("Bad directive")
                            && log_tail.contains("tls-")
                        {
                            "; this redis-server seems to be built without TLS support \
                             (Redis needs `make BUILD_TLS=yes`; Debian's and Homebrew's \
                             packages have it)"
                        } else {
                            ""
                        };
                        return Err(DevError::Node {
                            port: node.port,
                            reason: format!("exited during startup ({status}){hint}"),
                            log_tail,
                        });
                    }
                    Some(None) => {}
                }
                let pid = node.process.as_ref().map(NodeProcess::pid);
                (node.port, pid, node.dir.clone())
            };
            if let Ok(answered_pid) = server_pid(port).await {
                if Some(answered_pid) == pid {
                    return Ok(Launch::Ready);
                }
            }
            if Instant::now() >= deadline {
                return Err(DevError::Timeout {
                    waited: started.elapsed(),
                    what: format!("redis-server on port {port} to answer PING"),
                    log_tail: log_tail(&dir),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Joins the launched nodes into a cluster and waits for it to settle.
    async fn form(&self, deadline: Instant) -> Result<(), DevError> {
        let started = Instant::now();
        let (ports, initial_masters): (Vec<u16>, Vec<Option<usize>>) = self
            .lock()
            .iter()
            .map(|n| (n.port, n.initial_master))
            .unzip();
        let mut cons = Vec::with_capacity(ports.len());
        let mut ids = Vec::with_capacity(ports.len());
        for &port in &ports {
            let mut con = connect(port).await?;
            let id: String = query(&mut con, port, cluster_cmd("MYID")).await?;
            ids.push(id);
            cons.push(con);
        }

        // Slots: master i serves an even, contiguous share.
        let expected = self.expected_slot_map(&ports, &initial_masters);
        for range in &expected {
            let i = ports.iter().position(|&p| p == range.master).unwrap_or(0);
            add_slots(&mut cons[i], range.master, range.start, range.end).await?;
        }

        // Everyone meets the first node; gossip does the rest.
        for (i, &port) in ports.iter().enumerate().skip(1) {
            let mut meet = cluster_cmd("MEET");
            meet.arg("127.0.0.1").arg(ports[0]);
            let _: Value = query(&mut cons[i], port, meet).await?;
        }
        loop {
            let waiting = self.check_all_known(&ports, &ids, &mut cons).await?;
            if self.keep_waiting(started, deadline, waiting)? {
                tokio::time::sleep(POLL_INTERVAL).await;
            } else {
                break;
            }
        }

        // Replicas attach to their masters. REPLICATE can fail until the
        // replica has heard that the target is a master, so retry.
        let mut pending: Vec<usize> = (0..ports.len())
            .filter(|&i| initial_masters[i].is_some())
            .collect();
        while !pending.is_empty() {
            let mut still = Vec::new();
            let mut waiting = None;
            for &i in &pending {
                let master = initial_masters[i].unwrap_or(0);
                let mut replicate = cluster_cmd("REPLICATE");
                replicate.arg(&ids[master]);
                if let Err(e) = query::<Value>(&mut cons[i], ports[i], replicate).await {
                    waiting = Waiting::new(
                        ports[i],
                        format!("CLUSTER REPLICATE of port {} to succeed ({e})", ports[i]),
                    );
                    still.push(i);
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            self.ensure_all_running()?;
            if self.keep_waiting(started, deadline, waiting)? {
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        }

        loop {
            let waiting = self.check_formed(&ports, &expected, &mut cons).await?;
            if self.keep_waiting(started, deadline, waiting)? {
                tokio::time::sleep(POLL_INTERVAL).await;
            } else {
                return Ok(());
            }
        }
    }

    /// `Ok(true)` to poll again, `Ok(false)` when done, an error past the
    /// deadline.
    fn keep_waiting(
        &self,
        started: Instant,
        deadline: Instant,
        waiting: Option<Waiting>,
    ) -> Result<bool, DevError> {
        match waiting {
            None => Ok(false),
            Some(w) if Instant::now() >= deadline => Err(self.timeout_error(started, w)),
            Some(_) => Ok(true),
        }
    }

    fn timeout_error(&self, started: Instant, waiting: Waiting) -> DevError {
        DevError::Timeout {
            waited: started.elapsed(),
            what: waiting.what,
            log_tail: self.log_tail_of_port(waiting.port),
        }
    }

    fn log_tail_of_port(&self, port: u16) -> String {
        let dir = self
            .lock()
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.dir.clone());
        dir.map(|d| log_tail(&d)).unwrap_or_default()
    }

    /// During start every node must stay up; report the first that did not.
    fn ensure_all_running(&self) -> Result<(), DevError> {
        let mut nodes = self.lock();
        for node in nodes.iter_mut() {
            if !node.is_running() {
                return Err(DevError::Node {
                    port: node.port,
                    reason: "exited while the cluster was being formed".into(),
                    log_tail: log_tail(&node.dir),
                });
            }
        }
        Ok(())
    }

    fn expected_slot_map(
        &self,
        ports: &[u16],
        initial_masters: &[Option<usize>],
    ) -> Vec<SlotRange> {
        let slots = usize::from(SLOT_COUNT);
        (0..self.masters)
            .map(|i| {
                let start = i * slots / self.masters;
                let end = (i + 1) * slots / self.masters - 1;
                let mut replicas: Vec<u16> = (0..ports.len())
                    .filter(|&r| initial_masters[r] == Some(i))
                    .map(|r| ports[r])
                    .collect();
                replicas.sort_unstable();
                SlotRange {
                    start: slot_u16(start),
                    end: slot_u16(end),
                    master: ports[i],
                    replicas,
                }
            })
            .collect()
    }

    async fn check_all_known(
        &self,
        ports: &[u16],
        ids: &[String],
        cons: &mut [MultiplexedConnection],
    ) -> Result<Option<Waiting>, DevError> {
        self.ensure_all_running()?;
        for (i, &port) in ports.iter().enumerate() {
            let text: String = query(&mut cons[i], port, cluster_cmd("NODES")).await?;
            let known: BTreeSet<&str> = text
                .lines()
                .filter_map(|line| {
                    let mut fields = line.split_whitespace();
                    let id = fields.next()?;
                    let flags = fields.nth(1)?;
                    (!flags.contains("handshake") && !flags.contains("noaddr")).then_some(id)
                })
                .collect();
            if let Some(missing) = ids.iter().position(|id| !known.contains(id.as_str())) {
                return Ok(Waiting::new(
                    port,
                    format!(
                        "port {port} to learn about port {} through CLUSTER MEET",
                        ports[missing]
                    ),
                ));
            }
        }
        Ok(None)
    }

    async fn check_formed(
        &self,
        ports: &[u16],
        expected: &[SlotRange],
        cons: &mut [MultiplexedConnection],
    ) -> Result<Option<Waiting>, DevError> {
        self.ensure_all_running()?;
        for (i, &port) in ports.iter().enumerate() {
            let info: String = query(&mut cons[i], port, cluster_cmd("INFO")).await?;
            if let Some(w) = check_cluster_info(port, &info, Some(ports.len())) {
                return Ok(Some(w));
            }
        }
        for (i, &port) in ports.iter().enumerate() {
            let mut info = redis::cmd("INFO");
            info.arg("replication");
            let text: String = query(&mut cons[i], port, info).await?;
            if let Some(w) = check_replication(port, &text) {
                return Ok(Some(w));
            }
        }
        for (i, &port) in ports.iter().enumerate() {
            let view = cluster_slots(&mut cons[i], port).await?;
            if view != expected {
                return Ok(Waiting::new(
                    port,
                    format!(
                        "port {port}'s CLUSTER SLOTS to match the planned layout \
                         (has {view:?}, want {expected:?})"
                    ),
                ));
            }
        }
        Ok(None)
    }

    /// One round of [`LocalCluster::wait_until_ok`]: `None` when healthy.
    async fn check_healthy(&self) -> Option<Waiting> {
        let live = self.live_ports();
        if live.is_empty() {
            return Waiting::new(0, "any node to be running and not paused");
        }
        let mut reference: Option<(u16, Vec<SlotRange>)> = None;
        for &port in &live {
            let round = async {
                let mut con = connect(port).await?;
                let info: String = query(&mut con, port, cluster_cmd("INFO")).await?;
                if let Some(w) = check_cluster_info(port, &info, None) {
                    return Ok(Err(w));
                }
                let mut replication = redis::cmd("INFO");
                replication.arg("replication");
                let text: String = query(&mut con, port, replication).await?;
                if let Some(w) = check_replication(port, &text) {
                    return Ok(Err(w));
                }
                Ok::<_, DevError>(Ok(cluster_slots(&mut con, port).await?))
            }
            .await;
            let view = match round {
                Ok(Ok(view)) => view,
                Ok(Err(w)) => return Some(w),
                Err(e) => return Waiting::new(port, format!("port {port} to answer ({e})")),
            };
            for range in &view {
                for node in std::iter::once(&range.master).chain(&range.replicas) {
                    if !live.contains(node) {
                        return Waiting::new(
                            port,
                            format!(
                                "port {port} to stop listing port {node}, which is not running, \
                                 in CLUSTER SLOTS (slots {}-{})",
                                range.start, range.end
                            ),
                        );
                    }
                }
            }
            match &reference {
                None => reference = Some((port, view)),
                Some((ref_port, ref_view)) if *ref_view != view => {
                    return Waiting::new(
                        port,
                        format!(
                            "ports {ref_port} and {port} to agree on CLUSTER SLOTS \
                             ({ref_view:?} vs {view:?})"
                        ),
                    );
                }
                Some(_) => {}
            }
        }
        None
    }

    /// Orderly stop of every process; used by `stop` and `Drop`.
    fn shutdown_processes(&mut self) {
        let nodes = self.nodes.get_mut().unwrap_or_else(PoisonError::into_inner);
        let mut running: Vec<&mut NodeProcess> = nodes
            .iter_mut()
            .filter_map(|n| {
                n.paused = false;
                n.process.as_mut()
            })
            .collect();
        // Stand the watchdogs down first (they must not outlive our reaping).
        for process in running.iter_mut() {
            process.release_watchdog();
        }
        let pids: Vec<u32> = running.iter().map(|p| p.pid()).collect();
        // TERM, and CONT so that paused servers can act on it.
        let signalled = !pids.is_empty()
            && send_signal("TERM", &pids).is_ok()
            && send_signal("CONT", &pids).is_ok();
        let deadline = Instant::now()
            + if signalled {
                SHUTDOWN_GRACE
            } else {
                Duration::ZERO
            };
        for process in running.iter_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            if wait_with_grace(&mut process.server, left).is_none() {
                tracing::warn!(
                    pid = process.pid(),
                    "redis-server ignored SIGTERM; killing it"
                );
                let _ = process.server.kill();
                let _ = process.server.wait();
            }
        }
        for node in nodes.iter_mut() {
            node.process = None;
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.shutdown_processes();
        if let Some(temp_dir) = self.temp_dir.take() {
            if let Err(e) = temp_dir.close() {
                tracing::warn!(dir = %self.dir.display(), error = %e, "could not remove the dev cluster directory");
            }
        }
    }
}

/// Finds `redis-server` on `PATH`.
pub fn find_redis_server() -> Result<PathBuf, DevError> {
    resolve_redis_server(Path::new("redis-server"))
}

/// A bare name is searched on `PATH`; anything with a `/` must exist and be
/// executable.
fn resolve_redis_server(program: &Path) -> Result<PathBuf, DevError> {
    if program.components().count() > 1 || program.is_absolute() {
        return if is_executable(program) {
            Ok(program.to_path_buf())
        } else {
            Err(DevError::RedisServerNotExecutable {
                path: program.to_path_buf(),
            })
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
        .ok_or(DevError::RedisServerNotFound)
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn node_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// Where a node folder keeps its copies of the TLS files.
fn node_tls_files(node_dir: &Path) -> TlsFiles {
    TlsFiles {
        cert: node_dir.join(TLS_CERT),
        key: node_dir.join(TLS_KEY),
        ca: node_dir.join(TLS_CA),
    }
}

fn slot_u16(slot: usize) -> u16 {
    u16::try_from(slot).unwrap_or(SLOT_COUNT - 1)
}

/// Spawns a `redis-server` and its watchdog (see the module docs).
fn spawn_server(
    redis_server: &Path,
    conf: &Path,
    node_dir: &Path,
    cluster_dir: &Path,
) -> Result<NodeProcess, DevError> {
    let stdio_path = node_dir.join(STDIO_LOG);
    let stdio = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stdio_path)
        .map_err(io_error(format!("opening {}", stdio_path.display())))?;
    let stdio_err = stdio
        .try_clone()
        .map_err(io_error(format!("duplicating {}", stdio_path.display())))?;
    let mut server = Command::new(redis_server)
        .arg(conf)
        .current_dir(node_dir)
        .stdin(Stdio::null())
        .stdout(stdio)
        .stderr(stdio_err)
        .process_group(0)
        .spawn()
        .map_err(io_error(format!("starting {}", redis_server.display())))?;
    let watchdog = Command::new("/bin/sh")
        .arg("-c")
        .arg(WATCHDOG_SCRIPT)
        .arg("seathold-dev-watchdog")
        .arg(server.id().to_string())
        .arg(node_dir)
        .arg(cluster_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match watchdog {
        Ok(mut watchdog) => {
            let lifeline = watchdog.stdin.take();
            let mut process = NodeProcess {
                server,
                watchdog,
                lifeline,
            };
            if process.lifeline.is_none() {
                process.kill_now();
                return Err(DevError::Io {
                    context: "starting the redis-server watchdog".into(),
                    source: io::Error::other("no stdin pipe"),
                });
            }
            Ok(process)
        }
        Err(e) => {
            let _ = server.kill();
            let _ = server.wait();
            Err(DevError::Io {
                context: "starting the redis-server watchdog (/bin/sh)".into(),
                source: e,
            })
        }
    }
}

/// Sends `signal` (a name such as `TERM`) to `pids`, which must be unreaped
/// children of ours.
fn send_signal(signal: &'static str, pids: &[u32]) -> Result<(), DevError> {
    let failed = |detail: String| DevError::Signal {
        signal,
        pids: pids.to_vec(),
        detail,
    };
    let output = Command::new("/bin/sh")
        .arg("-c")
        .arg(KILL_SCRIPT)
        .arg("seathold-dev-kill")
        .arg(signal)
        .args(pids.iter().map(u32::to_string))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| failed(format!("could not run /bin/sh: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(
            String::from_utf8_lossy(&output.stderr).trim().to_string(),
        ))
    }
}

/// Next candidate port: a per-process random start, then sequential, so
/// clusters within one process never pick the same port and concurrent
/// processes rarely do (collisions are still detected and retried).
fn allocate_port() -> Result<u16, DevError> {
    static BASE: OnceLock<u32> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(*PORT_RANGE.end() - *PORT_RANGE.start()) + 1;
    let base = *BASE.get_or_init(|| {
        // RandomState is seeded from the OS; mix in pid and time anyway.
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        hasher.write_u128(nanos);
        (hasher.finish() % u64::from(span)) as u32
    });
    for _ in 0..span {
        let offset = (base + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = *PORT_RANGE.start() + offset as u16;
        if port_is_free(port) && port_is_free(port + BUS_PORT_OFFSET) {
            return Ok(port);
        }
    }
    Err(DevError::NoFreePorts)
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// `redis.conf` for one node. Later directives override earlier ones, so
/// `extra_config` comes last. With `tls_port`, the node serves TLS there with
/// the copies of the TLS files in its folder.
fn render_config(
    port: u16,
    tls_port: Option<u16>,
    node_dir: &Path,
    opts: &ClusterOptions,
) -> Result<String, DevError> {
    let dir = node_dir.to_str().ok_or_else(|| {
        DevError::InvalidOptions(format!(
            "temporary directory {} is not valid UTF-8",
            node_dir.display()
        ))
    })?;
    let log = node_dir.join(REDIS_LOG);
    let log = log.to_str().unwrap_or(REDIS_LOG);
    let mut conf = String::new();
    // Why some of these: diskless sync with no delay makes replicas sync at
    // once; `repl-ping-replica-period 1` moves replication offsets every
    // second instead of every ten, and Redis leaves a replica whose offset is
    // still 0 out of CLUSTER SLOTS, so without it a fresh cluster needs ~10 s
    // before its replicas are visible. Writing to a String cannot fail.
    let _ = write!(
        conf,
        "# Generated by seathold dev; removed when the cluster stops.\n\
         port {port}\n\
         bind 127.0.0.1\n\
         protected-mode no\n\
         daemonize no\n\
         dir {dir}\n\
         logfile {log}\n\
         cluster-enabled yes\n\
         cluster-config-file nodes.conf\n\
         cluster-node-timeout {timeout}\n\
         cluster-require-full-coverage yes\n\
         save \"\"\n\
         appendonly no\n\
         repl-diskless-sync yes\n\
         repl-diskless-sync-delay 0\n\
         repl-ping-replica-period 1\n",
        dir = conf_quote(dir),
        log = conf_quote(log),
        timeout = opts.node_timeout_ms,
    );
    if let Some(tls_port) = tls_port {
        let files = node_tls_files(node_dir);
        let path = |p: &Path| conf_quote(&p.to_string_lossy());
        // `cluster-port`: with tls-cluster the bus would otherwise move to
        // tls-port + 10000 (see the module docs).
        let _ = write!(
            conf,
            "tls-port {tls_port}\n\
             tls-cert-file {cert}\n\
             tls-key-file {key}\n\
             tls-ca-cert-file {ca}\n\
             tls-cluster yes\n\
             tls-replication yes\n\
             tls-auth-clients optional\n\
             cluster-port {bus}\n",
            cert = path(&files.cert),
            key = path(&files.key),
            ca = path(&files.ca),
            bus = port.saturating_add(BUS_PORT_OFFSET),
        );
    }
    for (key, value) in &opts.extra_config {
        let _ = writeln!(conf, "{key} {value}");
    }
    Ok(conf)
}

/// Double-quotes a value for redis.conf (which splits on spaces and
/// understands backslash escapes inside quotes).
fn conf_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// The end of a node's logs, formatted for an error message (starts with a
/// newline), or empty if there is nothing to show.
fn log_tail(node_dir: &Path) -> String {
    let mut out = String::new();
    for name in [REDIS_LOG, STDIO_LOG] {
        let path = node_dir.join(name);
        let Ok(bytes) = fs::read(&path) else { continue };
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.is_empty() {
            continue;
        }
        // The folder is removed with the cluster, so name the file by the
        // node folder's name rather than by a path that will not exist.
        let node = node_dir
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let _ = write!(out, "\n--- last lines of {node}/{name} ---");
        for line in &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..] {
            let _ = write!(out, "\n{line}");
        }
    }
    out
}

fn cluster_cmd(sub: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg(sub);
    cmd
}

/// Human-readable name of a command, for errors.
fn command_name(cmd: &redis::Cmd) -> String {
    cmd.args_iter()
        .take(2)
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => "<cursor>".into(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A fresh connection to one node, with connect and response timeouts.
async fn connect(port: u16) -> Result<MultiplexedConnection, DevError> {
    connect_within(port, COMMAND_TIMEOUT).await
}

async fn connect_within(port: u16, timeout: Duration) -> Result<MultiplexedConnection, DevError> {
    let fail = |source| DevError::Redis {
        port,
        command: "connect".into(),
        source,
    };
    let client = redis::Client::open(node_url(port)).map_err(fail)?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    match tokio::time::timeout(
        timeout,
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await
    {
        Ok(result) => result.map_err(fail),
        Err(_) => Err(DevError::Timeout {
            waited: timeout,
            what: format!("a connection to port {port}"),
            log_tail: String::new(),
        }),
    }
}

/// Runs one command with a timeout.
async fn query<T: FromRedisValue>(
    con: &mut MultiplexedConnection,
    port: u16,
    cmd: redis::Cmd,
) -> Result<T, DevError> {
    query_within(con, port, cmd, COMMAND_TIMEOUT).await
}

async fn query_within<T: FromRedisValue>(
    con: &mut MultiplexedConnection,
    port: u16,
    cmd: redis::Cmd,
    timeout: Duration,
) -> Result<T, DevError> {
    match tokio::time::timeout(timeout, cmd.query_async::<T>(con)).await {
        Ok(result) => result.map_err(|source| DevError::Redis {
            port,
            command: command_name(&cmd),
            source,
        }),
        Err(_) => Err(DevError::Timeout {
            waited: timeout,
            what: format!("a reply to `{}` from port {port}", command_name(&cmd)),
            log_tail: String::new(),
        }),
    }
}

/// The pid of whatever server answers on `port`. The short timeout keeps
/// a port held by something that is not Redis from delaying the detection
/// that our own server exited.
async fn server_pid(port: u16) -> Result<u32, DevError> {
    let mut con = connect_within(port, PROBE_TIMEOUT).await?;
    let mut info = redis::cmd("INFO");
    info.arg("server");
    let text: String = query_within(&mut con, port, info, PROBE_TIMEOUT).await?;
    info_field(&text, "process_id")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| DevError::Protocol {
            port,
            command: "INFO server".into(),
            detail: "no process_id".into(),
        })
}

/// `CLUSTER ADDSLOTSRANGE`, or `CLUSTER ADDSLOTS` on servers older than 7.0.
async fn add_slots(
    con: &mut MultiplexedConnection,
    port: u16,
    start: u16,
    end: u16,
) -> Result<(), DevError> {
    let mut range = cluster_cmd("ADDSLOTSRANGE");
    range.arg(start).arg(end);
    match query::<Value>(con, port, range).await {
        Ok(_) => Ok(()),
        Err(DevError::Redis { source, .. })
            if source
                .to_string()
                .to_lowercase()
                .contains("unknown subcommand") =>
        {
            let mut slots = cluster_cmd("ADDSLOTS");
            slots.arg((start..=end).collect::<Vec<u16>>());
            query::<Value>(con, port, slots).await.map(|_| ())
        }
        Err(e) => Err(e),
    }
}

/// `key:value` lines of `INFO` / `CLUSTER INFO`.
fn info_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == key).then(|| v.trim())
    })
}

/// Checks `CLUSTER INFO` for a healthy, fully assigned cluster of
/// `known_nodes` nodes (if given).
fn check_cluster_info(port: u16, info: &str, known_nodes: Option<usize>) -> Option<Waiting> {
    let state = info_field(info, "cluster_state").unwrap_or("?");
    if state != "ok" {
        return Waiting::new(
            port,
            format!("port {port} to report cluster_state:ok (has {state})"),
        );
    }
    let assigned = info_field(info, "cluster_slots_assigned").unwrap_or("?");
    if assigned != SLOT_COUNT.to_string() {
        return Waiting::new(
            port,
            format!("port {port} to see all {SLOT_COUNT} slots assigned (sees {assigned})"),
        );
    }
    if let Some(n) = known_nodes {
        let known = info_field(info, "cluster_known_nodes").unwrap_or("?");
        if known != n.to_string() {
            return Waiting::new(
                port,
                format!("port {port} to know {n} nodes (knows {known})"),
            );
        }
    }
    None
}

/// For a replica, checks `INFO replication` for an established master link.
fn check_replication(port: u16, text: &str) -> Option<Waiting> {
    if info_field(text, "role") != Some("slave") {
        return None;
    }
    let link = info_field(text, "master_link_status").unwrap_or("?");
    if link == "up" {
        return None;
    }
    Waiting::new(
        port,
        format!("replica on port {port} to report master_link_status:up (has {link})"),
    )
}

fn value_str(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

fn value_int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(i) => Some(*i),
        other => value_str(other)?.parse().ok(),
    }
}

/// `CLUSTER SLOTS` of one node, normalized (sorted ranges, sorted replicas).
async fn cluster_slots(
    con: &mut MultiplexedConnection,
    port: u16,
) -> Result<Vec<SlotRange>, DevError> {
    let reply: Value = query(con, port, cluster_cmd("SLOTS")).await?;
    parse_cluster_slots(&reply).ok_or_else(|| DevError::Protocol {
        port,
        command: "CLUSTER SLOTS".into(),
        detail: format!("{reply:?}"),
    })
}

fn parse_cluster_slots(reply: &Value) -> Option<Vec<SlotRange>> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let node_port = |node: &Value| -> Option<u16> {
        let Value::Array(fields) = node else {
            return None;
        };
        u16::try_from(value_int(fields.get(1)?)?).ok()
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(items) = entry else {
            return None;
        };
        let start = u16::try_from(value_int(items.first()?)?).ok()?;
        let end = u16::try_from(value_int(items.get(1)?)?).ok()?;
        let master = node_port(items.get(2)?)?;
        let mut replicas = items[3..]
            .iter()
            .map(node_port)
            .collect::<Option<Vec<u16>>>()?;
        replicas.sort_unstable();
        ranges.push(SlotRange {
            start,
            end,
            master,
            replicas,
        });
    }
    ranges.sort_by_key(|r| r.start);
    Some(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_has_defaults_then_overrides() {
        let opts = ClusterOptions {
            extra_config: vec![("appendonly".into(), "yes".into())],
            ..ClusterOptions::default()
        };
        let conf = render_config(21000, None, Path::new("/tmp/a b"), &opts).unwrap_or_default();
        assert!(conf.contains("port 21000\n"));
        assert!(conf.contains("dir \"/tmp/a b\"\n"));
        assert!(conf.contains("cluster-node-timeout 2000\n"));
        assert!(!conf.contains("tls"), "{conf}");
        let default_at = conf.find("appendonly no").unwrap_or(usize::MAX);
        let override_at = conf.find("appendonly yes").unwrap_or(0);
        assert!(default_at < override_at);
    }

    #[test]
    fn tls_config_keeps_the_bus_on_the_plain_port() {
        let opts = ClusterOptions {
            tls: Some(TlsFiles {
                cert: "/x/c".into(),
                key: "/x/k".into(),
                ca: "/x/a".into(),
            }),
            ..ClusterOptions::default()
        };
        let conf =
            render_config(21000, Some(21001), Path::new("/tmp/n"), &opts).unwrap_or_default();
        for line in [
            "port 21000\n",
            "tls-port 21001\n",
            "tls-cert-file \"/tmp/n/tls-node.crt\"\n",
            "tls-key-file \"/tmp/n/tls-node.key\"\n",
            "tls-ca-cert-file \"/tmp/n/tls-ca.crt\"\n",
            "tls-cluster yes\n",
            "tls-replication yes\n",
            "tls-auth-clients optional\n",
            "cluster-port 31000\n",
        ] {
            assert!(conf.contains(line), "{line:?} missing from {conf}");
        }
        // Missing files are refused before anything starts.
        assert!(matches!(opts.validate(), Err(DevError::InvalidOptions(_))));
    }

    #[test]
    fn options_are_validated() {
        let zero = ClusterOptions {
            masters: 0,
            ..ClusterOptions::default()
        };
        assert!(matches!(zero.validate(), Err(DevError::InvalidOptions(_))));
        let newline = ClusterOptions {
            extra_config: vec![("save".into(), "\"\"\nport 1".into())],
            ..ClusterOptions::default()
        };
        assert!(matches!(
            newline.validate(),
            Err(DevError::InvalidOptions(_))
        ));
        assert!(ClusterOptions::default().validate().is_ok());
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
                Value::Array(vec![]),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(8192),
                Value::Int(16383),
                node(2),
                node(9),
                node(4),
            ]),
            Value::Array(vec![Value::Int(0), Value::Int(8191), node(1)]),
        ]);
        let ranges = parse_cluster_slots(&reply).unwrap_or_default();
        assert_eq!(
            ranges,
            vec![
                SlotRange {
                    start: 0,
                    end: 8191,
                    master: 1,
                    replicas: vec![]
                },
                SlotRange {
                    start: 8192,
                    end: 16383,
                    master: 2,
                    replicas: vec![4, 9]
                },
            ]
        );
    }

    #[test]
    fn missing_binary_error_says_how_to_install() {
        let err = resolve_redis_server(Path::new("seathold-no-such-redis-server"));
        let msg = err.map(|_| String::new()).unwrap_or_else(|e| e.to_string());
        assert!(msg.contains("redis-server was not found on PATH"), "{msg}");
        assert!(msg.contains("sudo apt-get install redis-server"), "{msg}");
        assert!(msg.contains("brew install redis"), "{msg}");
    }

    #[test]
    fn allocated_ports_are_distinct_and_bindable() {
        let a = allocate_port().unwrap_or(0);
        let b = allocate_port().unwrap_or(0);
        assert!(PORT_RANGE.contains(&a) && PORT_RANGE.contains(&b));
        assert_ne!(a, b);
    }
}
