//! Whether the cluster is healthy, and waiting until it is: what a node's
//! `CLUSTER INFO`, `INFO replication` and slot map say is still missing.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use super::layout::{shards, Shard};
use super::probe::{cluster_cmd, connect, info_field, node_addr, query, slot_map};
use super::{DevError, LocalCluster, POLL_INTERVAL, SLOT_COUNT};

/// A condition not met yet, and on which node.
pub(super) struct Waiting {
    pub(super) port: u16,
    pub(super) what: String,
}

impl Waiting {
    pub(super) fn new(port: u16, what: impl Into<String>) -> Option<Waiting> {
        Some(Waiting {
            port,
            what: what.into(),
        })
    }
}

impl LocalCluster {
    /// Polls `check` until it finds nothing to wait for. Once `timeout` has
    /// passed since `started`, fails with what it waited for last, quoting
    /// the log of the node concerned.
    pub(super) async fn poll_until(
        &self,
        started: Instant,
        timeout: Duration,
        mut check: impl AsyncFnMut() -> Result<Option<Waiting>, DevError>,
    ) -> Result<(), DevError> {
        loop {
            let Some(waiting) = check().await? else {
                return Ok(());
            };
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(DevError::Timeout {
                    waited,
                    what: waiting.what,
                    log_tail: self.log_tail_of_port(waiting.port),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// One round of [`LocalCluster::wait_until_ok`]: `None` when healthy.
    pub(super) async fn check_healthy(&self) -> Option<Waiting> {
        let live = self.live_ports();
        if live.is_empty() {
            return Waiting::new(0, "any node to be running and not paused");
        }
        let live_addrs: Vec<String> = live.iter().map(|&p| node_addr(p)).collect();
        let mut reference: Option<(u16, Vec<Shard>)> = None;
        for &port in &live {
            let view = match healthy_view(port).await {
                Ok(view) => view,
                Err(waiting) => return Some(waiting),
            };
            if let Some(waiting) = listing_the_dead(port, &view, &live_addrs) {
                return Some(waiting);
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
}

/// The slot map of the node on `port` if it reports a healthy cluster, or
/// what it is waiting for.
async fn healthy_view(port: u16) -> Result<Vec<Shard>, Waiting> {
    let round = async {
        let mut con = connect(port).await?;
        if let Some(w) = cluster_info_waiting(&mut con, port, None).await? {
            return Ok(Err(w));
        }
        if let Some(w) = replication_waiting(&mut con, port).await? {
            return Ok(Err(w));
        }
        Ok::<_, DevError>(Ok(shards(&slot_map(&mut con, port).await?)))
    };
    round.await.unwrap_or_else(|e| {
        Err(Waiting {
            port,
            what: format!("port {port} to answer ({e})"),
        })
    })
}

/// A node of `view` (seen by `port`) that is not among `live_addrs`.
fn listing_the_dead(port: u16, view: &[Shard], live_addrs: &[String]) -> Option<Waiting> {
    for shard in view {
        for node in std::iter::once(&shard.master).chain(&shard.replicas) {
            if !live_addrs.contains(node) {
                return Waiting::new(
                    port,
                    format!(
                        "port {port} to stop listing {node}, which is not running, \
                         in CLUSTER SLOTS (slots {}-{})",
                        shard.start, shard.end
                    ),
                );
            }
        }
    }
    None
}

/// `CLUSTER INFO` of the node on `port`, checked by [`check_cluster_info`].
pub(super) async fn cluster_info_waiting(
    con: &mut MultiplexedConnection,
    port: u16,
    known_nodes: Option<usize>,
) -> Result<Option<Waiting>, DevError> {
    let info: String = query(con, port, cluster_cmd("INFO")).await?;
    Ok(check_cluster_info(port, &info, known_nodes))
}

/// `INFO replication` of the node on `port`, checked by
/// [`check_replication`].
pub(super) async fn replication_waiting(
    con: &mut MultiplexedConnection,
    port: u16,
) -> Result<Option<Waiting>, DevError> {
    let mut info = redis::cmd("INFO");
    info.arg("replication");
    let text: String = query(con, port, info).await?;
    Ok(check_replication(port, &text))
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
