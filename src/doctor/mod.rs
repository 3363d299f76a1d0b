//! `seathold doctor`: checks a Redis Cluster before an on-sale, the way
//! seathold will use it, and says what to change.
//!
//! Every check prints one line, `PASS|WARN|FAIL  <check>: <what was found>`,
//! followed by `; <what to change>` when it warns or fails. The checks:
//!
//! - [`topology`]: cluster state and slot coverage, a replica behind every
//!   master, the nodes' clocks (replicas too).
//! - [`settings`]: the `redis.conf` settings seathold depends on, on every
//!   node (a replica is a master after a failover).
//! - [`rights`]: the configured user's ACL rights, proven by running every
//!   command seathold needs on a scratch key of the doctor's own.
//! - [`scripts`]: the embedded Lua scripts load on every master.
//!
//! It writes only its scratch keys (`<prefix>{seathold-doctor-<random>}`,
//! deleted at the end, and set with a 60 s TTL in case the delete is refused)
//! and the script cache.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{Cmd, FromRedisValue, IntoConnectionInfo, Value};

use crate::cluster::{Cluster, Readiness, Topology};
use crate::config::Options;
use crate::scripts::Scripts;
use crate::server::StartError;

mod rights;
mod scripts;
mod settings;
mod topology;

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    Pass,
    Warn,
    Fail,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
        })
    }
}

/// One check's line.
#[derive(Debug, Clone)]
pub struct Check {
    pub status: Status,
    /// What was checked, e.g. `appendonly`.
    pub name: String,
    /// What was found.
    pub found: String,
    /// What to change; printed only for warnings and failures.
    pub fix: String,
}

impl Check {
    fn pass(name: impl Into<String>, found: impl Into<String>) -> Self {
        Self::new(Status::Pass, name, found, "")
    }

    fn new(
        status: Status,
        name: impl Into<String>,
        found: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            status,
            name: name.into(),
            found: found.into(),
            fix: fix.into(),
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}  {}: {}", self.status, self.name, self.found)?;
        if self.status != Status::Pass && !self.fix.is_empty() {
            write!(f, "; {}", self.fix)?;
        }
        Ok(())
    }
}

/// Every check's line, in the order they ran.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// Whether any check failed (the exit code is then 1).
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for check in &self.checks {
            writeln!(f, "{check}")?;
        }
        Ok(())
    }
}

/// Runs every check against the cluster that `opts` names. Configuration
/// errors (no seed nodes, a bad URL, an unreadable TLS file) are errors,
/// as for `serve`; everything found in the cluster is a line of the report.
pub async fn run(opts: &Options) -> Result<Report, StartError> {
    let redis = opts.redis()?;
    let cluster = Cluster::new(&redis, Scripts::embedded(), Arc::new(Readiness::default()))?;
    let mut report = Report::default();
    let nodes = match Nodes::discover(cluster, &redis.nodes, redis.timeout).await {
        Ok(nodes) => nodes,
        Err(why) => {
            report.checks.push(Check::new(
                Status::Fail,
                "connection",
                why,
                "check --redis-nodes, the credentials and the TLS flags",
            ));
            return Ok(report);
        }
    };
    for (addr, conn) in &nodes.conns {
        if let Err(why) = conn {
            report.checks.push(Check::new(
                Status::Fail,
                format!("reach {addr}"),
                why.clone(),
                "every node in the slot map must answer seathold",
            ));
        }
    }
    report.checks.extend(topology::state(&nodes));
    report
        .checks
        .push(topology::replicas(&nodes, opts.confirm_wait_replicas));
    report.checks.push(settings::version(&nodes).await);
    report.checks.extend(settings::check(&nodes).await);
    report.checks.push(topology::clocks(&nodes).await);
    report.checks.extend(rights::check(&nodes, opts).await);
    report.checks.push(scripts::check(&nodes).await);
    Ok(report)
}

/// The cluster as one seed node describes it, with a connection to every
/// node of its slot map.
struct Nodes {
    /// Makes clients for single nodes with the configured credentials.
    cluster: Arc<Cluster>,
    timeout: Duration,
    topo: Topology,
    /// `CLUSTER INFO` of the seed that answered.
    info: String,
    /// `host:port` of that seed.
    seed: String,
    /// Every master and replica, with its connection or why there is none.
    conns: BTreeMap<String, Result<MultiplexedConnection, String>>,
}

impl Nodes {
    /// Asks the seeds in turn for the slot map, then connects to every node.
    async fn discover(
        cluster: Arc<Cluster>,
        seeds: &[String],
        timeout: Duration,
    ) -> Result<Self, String> {
        let (topo, info, seed) = slot_map(&cluster, seeds, timeout).await?;
        let mut conns = BTreeMap::new();
        let replicas = topo.ranges().iter().flat_map(|r| r.replicas.iter());
        for addr in topo.masters.iter().chain(replicas) {
            if !conns.contains_key(addr) {
                let conn = connect(&cluster, addr, timeout).await;
                conns.insert(addr.clone(), conn);
            }
        }
        Ok(Self {
            cluster,
            timeout,
            topo,
            info,
            seed,
            conns,
        })
    }

    /// The masters' connections (those that could be made).
    fn masters(&self) -> impl Iterator<Item = (&str, MultiplexedConnection)> {
        self.topo.masters.iter().filter_map(|addr| {
            let conn = self.conns.get(addr)?.as_ref().ok()?;
            Some((addr.as_str(), conn.clone()))
        })
    }

    /// Every node's connection (those that could be made).
    fn all(&self) -> impl Iterator<Item = (&str, MultiplexedConnection)> {
        self.conns
            .iter()
            .filter_map(|(addr, conn)| Some((addr.as_str(), conn.as_ref().ok()?.clone())))
    }

    /// Sends `cmd` on `conn` within the Redis timeout.
    async fn query<T: FromRedisValue>(
        &self,
        conn: &mut MultiplexedConnection,
        cmd: &Cmd,
    ) -> redis::RedisResult<T> {
        query(conn, cmd, self.timeout).await
    }
}

/// The slot map and `CLUSTER INFO` from the first of `seeds` that answers,
/// and its `host:port`.
pub(crate) async fn slot_map(
    cluster: &Cluster,
    seeds: &[String],
    timeout: Duration,
) -> Result<(Topology, String, String), String> {
    let mut failures = Vec::new();
    for url in seeds {
        let Ok(info) = url.as_str().into_connection_info() else {
            continue;
        };
        let seed = info.addr().to_string();
        let answer = async {
            let mut conn = connect(cluster, &seed, timeout).await?;
            let slots: Value = query(&mut conn, redis::cmd("CLUSTER").arg("SLOTS"), timeout)
                .await
                .map_err(|e| e.to_string())?;
            let info: String = query(&mut conn, redis::cmd("CLUSTER").arg("INFO"), timeout)
                .await
                .map_err(|e| e.to_string())?;
            let topo = Topology::from_cluster_slots(&slots, &seed)
                .ok_or_else(|| "unexpected CLUSTER SLOTS reply".to_owned())?;
            Ok::<_, String>((topo, info))
        };
        match answer.await {
            Ok((topo, info)) => return Ok((topo, info, seed)),
            Err(why) => failures.push(format!("{seed}: {why}")),
        }
    }
    Err(format!(
        "no seed node answered CLUSTER SLOTS ({})",
        failures.join("; ")
    ))
}

/// A connection to one node, with the seeds' credentials and TLS, within
/// `timeout`.
pub(crate) async fn connect(
    cluster: &Cluster,
    addr: &str,
    timeout: Duration,
) -> Result<MultiplexedConnection, String> {
    let client = cluster.node_client(addr).map_err(|e| e.to_string())?;
    match tokio::time::timeout(timeout, client.get_multiplexed_async_connection()).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(err)) => Err(format!("cannot connect: {err}")),
        Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
    }
}

pub(crate) async fn query<T: FromRedisValue>(
    conn: &mut MultiplexedConnection,
    cmd: &Cmd,
    timeout: Duration,
) -> redis::RedisResult<T> {
    match tokio::time::timeout(timeout, cmd.query_async(conn)).await {
        Ok(result) => result,
        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {} ms", timeout.as_millis()),
        ))),
    }
}

/// `a, b, c`.
fn list<T: AsRef<str>>(items: &[T]) -> String {
    items
        .iter()
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ")
}
