//! The one error type of [`crate::dev`].

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use super::conf::PORT_RANGE;
use super::{BUS_PORT_OFFSET, SLOT_COUNT};

/// Everything that can go wrong while running a local cluster.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    /// No `redis-server` executable on `PATH`.
    #[error(
        "redis-server was not found on PATH; install it, e.g. `sudo apt-get install redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"
    )]
    RedisServerNotFound,
    /// A `redis-server` older than seathold needs.
    #[error(
        "{} is Redis {found}; seathold needs Redis 7.0 or newer (its scripts call PEXPIRETIME). Install a newer redis-server, e.g. Debian 12's or Ubuntu 24.04's package, or one from packages.redis.io",
        path.display()
    )]
    RedisServerTooOld {
        /// The binary.
        path: PathBuf,
        /// Its major.minor version.
        found: String,
    },
    /// An explicitly given `redis-server` path is missing or not executable.
    #[error("redis-server binary {} does not exist or is not executable", path.display())]
    RedisServerNotExecutable {
        /// The path that was given.
        path: PathBuf,
    },
    /// [`ClusterOptions`](super::ClusterOptions) that cannot describe a cluster.
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
    /// [`LocalCluster::restart`](super::LocalCluster::restart) on a node that
    /// is running.
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

pub(super) fn io_error(context: impl Into<String>) -> impl FnOnce(io::Error) -> DevError {
    let context = context.into();
    move |source| DevError::Io { context, source }
}
