//! Talking to single nodes: connections and commands with timeouts, and
//! reading their answers (`INFO`, `CLUSTER INFO`, `CLUSTER SLOTS`) to tell
//! whether the cluster is healthy.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, Value};

use crate::cluster::Topology;

use super::layout::{shards, Shard};
use super::{DevError, LocalCluster, SLOT_COUNT};

/// Timeout for one connection attempt or one command during setup and checks.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Timeout of the start-up probe (`INFO server`), which is repeated until the
/// server answers; a local Redis answers in well under a millisecond.
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

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

/// `host:port` of the node on `port`, as `CLUSTER SLOTS` names it.
pub(super) fn node_addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

pub(super) fn node_url(port: u16) -> String {
    format!("redis://{}", node_addr(port))
}

pub(super) fn cluster_cmd(sub: &str) -> redis::Cmd {
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
pub(super) async fn connect(port: u16) -> Result<MultiplexedConnection, DevError> {
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
pub(super) async fn query<T: FromRedisValue>(
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
pub(super) async fn server_pid(port: u16) -> Result<u32, DevError> {
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

/// `key:value` lines of `INFO` / `CLUSTER INFO`.
fn info_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == key).then(|| v.trim())
    })
}

/// Checks `CLUSTER INFO` for a healthy, fully assigned cluster of
/// `known_nodes` nodes (if given).
pub(super) fn check_cluster_info(
    port: u16,
    info: &str,
    known_nodes: Option<usize>,
) -> Option<Waiting> {
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
pub(super) fn check_replication(port: u16, text: &str) -> Option<Waiting> {
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

pub(super) fn value_str(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// `CLUSTER SLOTS` of the node on `port`, read by the daemon's own parser.
pub(super) async fn slot_map(
    con: &mut MultiplexedConnection,
    port: u16,
) -> Result<Topology, DevError> {
    let reply: Value = query(con, port, cluster_cmd("SLOTS")).await?;
    Topology::from_cluster_slots(&reply, &node_addr(port)).ok_or_else(|| DevError::Protocol {
        port,
        command: "CLUSTER SLOTS".into(),
        detail: format!("{reply:?}"),
    })
}

impl LocalCluster {
    /// One round of [`LocalCluster::wait_until_ok`]: `None` when healthy.
    pub(super) async fn check_healthy(&self) -> Option<Waiting> {
        let live = self.live_ports();
        if live.is_empty() {
            return Waiting::new(0, "any node to be running and not paused");
        }
        let live_addrs: Vec<String> = live.iter().map(|&p| node_addr(p)).collect();
        let mut reference: Option<(u16, Vec<Shard>)> = None;
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
                Ok::<_, DevError>(Ok(shards(&slot_map(&mut con, port).await?)))
            }
            .await;
            let view = match round {
                Ok(Ok(view)) => view,
                Ok(Err(w)) => return Some(w),
                Err(e) => return Waiting::new(port, format!("port {port} to answer ({e})")),
            };
            for shard in &view {
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
