//! Starting the nodes: free ports, a `redis.conf`, a server, and waiting
//! until it answers as itself; a node whose ports were taken meanwhile moves
//! to others.

use std::fs;
use std::io;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Instant;

use super::error::io_error;
use super::probe::server_pid;
use super::process::{log_tail, spawn_server, NodeProcess, REDIS_LOG, STDIO_LOG};
use super::{ClusterOptions, DevError, LocalCluster, Node, POLL_INTERVAL};

/// How many times a node may be moved to other ports because its own were
/// taken between our check and its start (another cluster starting at once).
const PORT_ATTEMPTS: usize = 8;

/// How a freshly spawned server's start ended.
pub(super) enum Launch {
    Ready,
    PortTaken,
}

impl LocalCluster {
    /// Spawns the node's server with its `redis.conf`.
    fn spawn_node(&self, index: usize) -> Result<(), DevError> {
        let mut nodes = self.lock();
        self.spawn_into(&mut nodes[index])
    }

    /// Spawns `node`'s server; the caller holds the lock, so that checking
    /// that a node is down and starting it is one step.
    pub(super) fn spawn_into(&self, node: &mut Node) -> Result<(), DevError> {
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
    pub(super) async fn launch_all(
        &self,
        opts: &ClusterOptions,
        deadline: Instant,
    ) -> Result<(), DevError> {
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
                forget_the_old_start(&node_dir)?;
                self.configure_node(index, opts)?;
                self.spawn_node(index)?;
            }
        }
        Ok(())
    }

    /// Waits until the freshly spawned node answers as itself (its
    /// `process_id` matches, so we are not talking to some other cluster's
    /// server that got the port first).
    pub(super) async fn wait_launched(
        &self,
        index: usize,
        deadline: Instant,
    ) -> Result<Launch, DevError> {
        let started = Instant::now();
        loop {
            let (port, pid, dir) = {
                let mut nodes = self.lock();
                let node = &mut nodes[index];
                let exited = node.process.as_mut().map(NodeProcess::exited);
                match exited {
                    None => return Err(DevError::NotRunning(node.port)),
                    Some(Some(status)) => return startup_exit(node, status),
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
}

/// A bus-port clash happens after nodes.conf was written with the old port:
/// start over as a brand-new node. The old logs go too, so that their
/// "Address already in use" cannot be mistaken for the outcome of the next
/// attempt.
fn forget_the_old_start(node_dir: &Path) -> Result<(), DevError> {
    for name in ["nodes.conf", REDIS_LOG, STDIO_LOG] {
        let path = node_dir.join(name);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error(format!("removing {}", path.display()))(e)),
        }
    }
    Ok(())
}

/// What a server that exited during startup means: its port was taken, or an
/// error quoting its log.
fn startup_exit(node: &mut Node, status: ExitStatus) -> Result<Launch, DevError> {
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
    Err(DevError::Node {
        port: node.port,
        reason: format!("exited during startup ({status}){hint}"),
        log_tail,
    })
}
