//! The cluster's shape: its state and slot coverage, a replica behind every
//! master, and the nodes' clocks.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{list, Check, Nodes, Status};
use crate::keys::SLOTS;

/// Clocks further apart than this are worth a look; fences compare the
/// masters' `TIME` (the contract assumes they agree to within a second).
const CLOCK_WARN_MS: f64 = 250.0;
/// Past this, a failover can hand out a fence lower than one already given.
const CLOCK_FAIL_MS: f64 = 1000.0;

/// `cluster_state:ok` and all 16384 slots served.
pub(super) fn state(nodes: &Nodes) -> Vec<Check> {
    let field = |name: &str| {
        nodes
            .info
            .lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or("?")
            .to_owned()
    };
    let state = field("cluster_state");
    let state_check = if state == "ok" {
        Check::pass(
            "cluster state",
            format!("cluster_state:ok (asked {})", nodes.seed),
        )
    } else {
        Check::new(
            Status::Fail,
            "cluster state",
            format!("cluster_state:{state} (asked {})", nodes.seed),
            "fix the cluster (redis-cli --cluster check <node>) before the on-sale",
        )
    };
    let covered = nodes.topo.covered_slots();
    let masters = nodes.topo.masters.len();
    let coverage = if covered == u32::from(SLOTS) {
        Check::pass(
            "slot coverage",
            format!("all {SLOTS} slots served by {masters} masters"),
        )
    } else {
        Check::new(
            Status::Fail,
            "slot coverage",
            format!("{covered} of {SLOTS} slots served by {masters} masters"),
            "assign every slot (redis-cli --cluster fix <node>); shows in unserved slots get 503",
        )
    };
    vec![state_check, coverage]
}

/// A replica behind every master, and at least `--confirm-wait-replicas`.
pub(super) fn replicas(nodes: &Nodes, wanted: u32) -> Check {
    let mut per_master: BTreeMap<&str, usize> = nodes
        .topo
        .masters
        .iter()
        .map(|m| (m.as_str(), usize::MAX))
        .collect();
    for range in nodes.topo.ranges() {
        let n = per_master
            .entry(nodes.topo.master_of_range(range))
            .or_insert(usize::MAX);
        *n = (*n).min(range.replicas.len());
    }
    let lacking: Vec<String> = per_master
        .iter()
        .filter(|(_, n)| **n < wanted.max(1) as usize)
        .map(|(m, n)| format!("{m} ({n})"))
        .collect();
    let fewest = per_master.values().copied().min().unwrap_or(0);
    if lacking.is_empty() {
        return Check::pass(
            "replicas",
            format!(
                "every master ({}) has at least {fewest} replica(s)",
                per_master.len()
            ),
        );
    }
    Check::new(
        Status::Fail,
        "replicas",
        format!("masters with too few replicas: {}", list(&lacking)),
        format!(
            "give every master at least {} replica(s): a failover without one loses its slots, and confirms wait for --confirm-wait-replicas ({wanted}) replicas",
            wanted.max(1)
        ),
    )
}

/// Every node's `TIME`, each against this host's clock at the middle of its
/// round trip, so that the spread is the nodes' disagreement. Replicas too:
/// a promoted replica's clock dates the fences it gives (a replica behind
/// the others can hand out a fence lower than one already given).
pub(super) async fn clocks(nodes: &Nodes) -> Check {
    let mut offsets = Vec::new();
    let mut failed = Vec::new();
    let mut worst_rtt = Duration::ZERO;
    for (addr, mut conn) in nodes.all() {
        let before = SystemTime::now();
        let reply: redis::RedisResult<(u64, u64)> =
            nodes.query(&mut conn, &redis::cmd("TIME")).await;
        let after = SystemTime::now();
        match reply {
            Ok((secs, micros)) => {
                let rtt = after.duration_since(before).unwrap_or_default();
                worst_rtt = worst_rtt.max(rtt);
                let local = (before + rtt / 2)
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1000.0;
                let remote = secs as f64 * 1000.0 + micros as f64 / 1000.0;
                offsets.push((addr.to_owned(), remote - local));
            }
            Err(err) => failed.push(format!("{addr}: {err}")),
        }
    }
    if !failed.is_empty() {
        return Check::new(
            Status::Fail,
            "clocks",
            format!("TIME failed on {}", list(&failed)),
            "seathold's scripts need TIME; see the ACL check",
        );
    }
    let min = offsets.iter().map(|o| o.1).fold(f64::INFINITY, f64::min);
    let max = offsets
        .iter()
        .map(|o| o.1)
        .fold(f64::NEG_INFINITY, f64::max);
    let spread = if offsets.is_empty() { 0.0 } else { max - min };
    let found = format!(
        "the {} nodes' clocks (masters and replicas) are within {spread:.0} ms of each other (measured to about {} ms)",
        offsets.len(),
        worst_rtt.as_millis().max(1)
    );
    let fix = "synchronise the nodes' clocks (chrony or systemd-timesyncd against one NTP source): fences stay ordered across a failover only while the clocks agree to within a second";
    if spread > CLOCK_FAIL_MS {
        Check::new(Status::Fail, "clocks", found, fix)
    } else if spread > CLOCK_WARN_MS {
        Check::new(Status::Warn, "clocks", found, fix)
    } else {
        Check::pass("clocks", found)
    }
}
