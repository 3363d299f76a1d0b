//! Joining launched nodes into the planned cluster: slot assignment,
//! `CLUSTER MEET`, replicas, and waiting until every node reports the
//! planned layout.

use std::collections::BTreeSet;
use std::time::Instant;

use redis::aio::MultiplexedConnection;
use redis::Value;

use super::health::{cluster_info_waiting, replication_waiting, Waiting};
use super::layout::{planned, shards, Shard};
use super::probe::{cluster_cmd, connect, query, slot_map};
use super::process::log_tail;
use super::{DevError, LocalCluster};

/// The launched nodes being joined, in node-table order, each with a
/// connection of its own.
struct Members {
    ports: Vec<u16>,
    /// Index of the master a replica is created under.
    initial_masters: Vec<Option<usize>>,
    /// Each node's `CLUSTER MYID`.
    ids: Vec<String>,
    cons: Vec<MultiplexedConnection>,
}

impl LocalCluster {
    /// Joins the launched nodes into a cluster and waits for it to settle.
    pub(super) async fn form(&self, deadline: Instant) -> Result<(), DevError> {
        let started = Instant::now();
        let timeout = deadline.saturating_duration_since(started);
        let mut members = self.members().await?;

        // Slots: master i serves an even, contiguous share.
        let expected = planned(self.masters, &members.ports, &members.initial_masters);
        for (i, shard) in expected.iter().enumerate() {
            add_slots(
                &mut members.cons[i],
                members.ports[i],
                shard.start,
                shard.end,
            )
            .await?;
        }

        members.meet_the_first().await?;
        self.poll_until(started, timeout, async || {
            self.check_all_known(&mut members).await
        })
        .await?;

        // Replicas attach to their masters. REPLICATE can fail until the
        // replica has heard that the target is a master, so retry.
        let mut pending: Vec<usize> = (0..members.ports.len())
            .filter(|&i| members.initial_masters[i].is_some())
            .collect();
        self.poll_until(started, timeout, async || {
            let waiting = members.replicate(&mut pending).await;
            if pending.is_empty() {
                return Ok(None);
            }
            self.ensure_all_running()?;
            Ok(waiting)
        })
        .await?;

        self.poll_until(started, timeout, async || {
            self.check_formed(&mut members, &expected).await
        })
        .await
    }

    /// Connects to every node and learns its id.
    async fn members(&self) -> Result<Members, DevError> {
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
        Ok(Members {
            ports,
            initial_masters,
            ids,
            cons,
        })
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

    async fn check_all_known(&self, members: &mut Members) -> Result<Option<Waiting>, DevError> {
        self.ensure_all_running()?;
        let Members {
            ports, ids, cons, ..
        } = members;
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
        members: &mut Members,
        expected: &[Shard],
    ) -> Result<Option<Waiting>, DevError> {
        self.ensure_all_running()?;
        let Members { ports, cons, .. } = members;
        for (i, &port) in ports.iter().enumerate() {
            let waiting = cluster_info_waiting(&mut cons[i], port, Some(ports.len())).await?;
            if waiting.is_some() {
                return Ok(waiting);
            }
        }
        for (i, &port) in ports.iter().enumerate() {
            let waiting = replication_waiting(&mut cons[i], port).await?;
            if waiting.is_some() {
                return Ok(waiting);
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

impl Members {
    /// Everyone meets the first node; gossip does the rest.
    async fn meet_the_first(&mut self) -> Result<(), DevError> {
        let first = self.ports[0];
        for (i, &port) in self.ports.iter().enumerate().skip(1) {
            let mut meet = cluster_cmd("MEET");
            meet.arg("127.0.0.1").arg(first);
            let _: Value = query(&mut self.cons[i], port, meet).await?;
        }
        Ok(())
    }

    /// `CLUSTER REPLICATE` for each node of `pending` (indexes of replicas);
    /// keeps those that failed in `pending`, and says what the last failure
    /// waits for.
    async fn replicate(&mut self, pending: &mut Vec<usize>) -> Option<Waiting> {
        let mut still = Vec::new();
        let mut waiting = None;
        for &i in pending.iter() {
            let master = self.initial_masters[i].unwrap_or(0);
            let mut replicate = cluster_cmd("REPLICATE");
            replicate.arg(&self.ids[master]);
            let port = self.ports[i];
            if let Err(e) = query::<Value>(&mut self.cons[i], port, replicate).await {
                waiting = Waiting::new(
                    port,
                    format!("CLUSTER REPLICATE of port {port} to succeed ({e})"),
                );
                still.push(i);
            }
        }
        *pending = still;
        waiting
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
