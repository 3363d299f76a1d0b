//! Talking to single nodes: addresses, connections and commands with
//! timeouts, and reading single answers (`INFO` fields, `ROLE`, the slot map
//! of `CLUSTER SLOTS`).

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, FromRedisValue, Value};

use crate::cluster::Topology;

use super::{DevError, Role};

/// Timeout for one connection attempt or one command during setup and checks.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Timeout of the start-up probe (`INFO server`), which is repeated until the
/// server answers; a local Redis answers in well under a millisecond.
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

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
pub(super) fn info_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == key).then(|| v.trim())
    })
}

fn value_str(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// The role the node on `port` has now (`ROLE`).
pub(super) async fn role(port: u16) -> Result<Role, DevError> {
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
