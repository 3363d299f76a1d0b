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

mod conf;
mod error;
mod form;
mod health;
mod launch;
mod layout;
mod node;
mod options;
mod probe;
mod process;

pub use error::DevError;
pub use options::{ClusterOptions, TlsFiles};

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use conf::node_tls_files;
use error::io_error;
use launch::Launch;
use layout::port_of;
use node::Node;
use probe::{connect, node_url, role, slot_map};
use process::{log_tail, resolve_redis_server, send_signal, NodeProcess};

/// Hash slots in a Redis Cluster (the daemon's own constant).
pub use crate::keys::SLOTS as SLOT_COUNT;

/// The cluster bus of a node listens on its client port plus this offset.
pub const BUS_PORT_OFFSET: u16 = 10000;

/// How often readiness conditions are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// The role a node was started in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Serves a share of the slots.
    Master,
    /// Replicates a master and may be promoted in a failover.
    Replica,
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
        process::check_version(&redis_server)?;
        let started_at = Instant::now();
        let deadline = started_at + opts.start_timeout;
        let temp_dir = tempfile::Builder::new()
            .prefix("seathold-dev-")
            .tempdir()
            .map_err(io_error("creating the cluster's temporary directory"))?;
        let dir = temp_dir.path().to_path_buf();
        let nodes = Node::create_all(&dir, &opts)?;
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
                slot_map(&mut con, port).await
            }
            .await;
            match answer {
                Ok(topology) => {
                    let owner = topology.master_of(slot).and_then(port_of);
                    match owner {
                        Some(master) => match votes.iter_mut().find(|(p, _)| *p == master) {
                            Some((_, count)) => *count += 1,
                            None => votes.push((master, 1)),
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
        role(port).await
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
        self.poll_until(Instant::now(), timeout, async || {
            Ok(self.check_healthy().await)
        })
        .await
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

    fn log_tail_of_port(&self, port: u16) -> String {
        let dir = self
            .lock()
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.dir.clone());
        dir.map(|d| log_tail(&d)).unwrap_or_default()
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
