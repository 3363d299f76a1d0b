//! Joining launched nodes into the planned cluster: slot assignment,
//! `CLUSTER MEET`, replicas, and waiting until every node reports the
//! planned layout.

use std::collections::BTreeSet;
use std::time::Instant;

use redis::aio::MultiplexedConnection;
use redis::Value;

use super::layout::{planned, shards, Shard};
use super::probe::{
    check_cluster_info, check_replication, cluster_cmd, connect, query, slot_map, Waiting,
};
use super::process::log_tail;
use super::{DevError, LocalCluster, POLL_INTERVAL};

impl LocalCluster {
    /// Joins the launched nodes into a cluster and waits for it to settle.
    pub(super) async fn form(&self, deadline: Instant) -> Result<(), DevError> {
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
        let expected = planned(self.masters, &ports, &initial_masters);
        for (i, shard) in expected.iter().enumerate() {
            add_slots(&mut cons[i], ports[i], shard.start, shard.end).await?;
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
        expected: &[Shard],
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
            let view = shards(&slot_map(&mut cons[i], port).await?);
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
