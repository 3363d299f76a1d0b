//! The entries of a [`LocalCluster`](super::LocalCluster)'s node table: one
//! `redis-server` each, with its ports, folder and role, and its process
//! while it runs.

use std::fs;
use std::path::{Path, PathBuf};

use super::error::io_error;
use super::process::NodeProcess;
use super::{ClusterOptions, DevError, Role};

pub(super) struct Node {
    pub(super) port: u16,
    /// Set when the cluster has TLS.
    pub(super) tls_port: Option<u16>,
    pub(super) dir: PathBuf,
    pub(super) conf: PathBuf,
    pub(super) initial_role: Role,
    /// Index of the master a replica was created under.
    pub(super) initial_master: Option<usize>,
    pub(super) process: Option<NodeProcess>,
    pub(super) paused: bool,
}

impl Node {
    /// The nodes `opts` asks for, masters first, each with a fresh folder
    /// `node-<index>` in `dir`; ports are given at launch.
    pub(super) fn create_all(dir: &Path, opts: &ClusterOptions) -> Result<Vec<Node>, DevError> {
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
        Ok(nodes)
    }

    /// Whether the server is up (reaping it if it has exited by itself).
    pub(super) fn is_running(&mut self) -> bool {
        if let Some(process) = self.process.as_mut() {
            if process.exited().is_some() {
                self.process = None;
                self.paused = false;
            }
        }
        self.process.is_some()
    }

    /// Running and not paused: able to answer commands.
    pub(super) fn is_live(&mut self) -> bool {
        self.is_running() && !self.paused
    }
}
