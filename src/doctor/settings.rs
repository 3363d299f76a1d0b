//! The `redis.conf` settings seathold depends on, read with `CONFIG GET`
//! from every node: a replica runs with its own settings once promoted.

use std::collections::BTreeMap;

use super::{list, Check, Nodes, Status};

/// `cluster-node-timeout` outside this range is worth a look: below it a
/// busy node is failed over needlessly, above it a dead master's slots
/// answer 503 for that long.
const NODE_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 1_000..=15_000;

/// One setting: its name, and the verdict and advice for a value.
struct Setting {
    name: &'static str,
    judge: fn(&str) -> Status,
    fix: &'static str,
}

const SETTINGS: [Setting; 4] = [
    Setting {
        name: "notify-keyspace-events",
        judge: |v| {
            let expired = v.contains('x') || v.contains('A');
            if v.contains('E') && expired {
                Status::Pass
            } else {
                Status::Fail
            }
        },
        fix: "set notify-keyspace-events Ex in every node's redis.conf: these events wake the sweeper for holds other instances made (without them their expired events come up to --sweep-scan-interval-ms late), and with --events off expiries are counted from them (seathold's own CONFIG SET at start is lost when a node restarts)",
    },
    Setting {
        name: "appendonly",
        judge: |v| if v == "yes" { Status::Pass } else { Status::Fail },
        fix: "set appendonly yes (with appendfsync everysec) in every node's redis.conf: sold seats have no TTL and must survive a restart",
    },
    Setting {
        name: "maxmemory-policy",
        judge: |v| {
            if v == "noeviction" {
                Status::Pass
            } else {
                Status::Fail
            }
        },
        fix: "set maxmemory-policy noeviction in every node's redis.conf: an evicted hold or sale is silently lost",
    },
    Setting {
        name: "cluster-node-timeout",
        judge: |v| match v.parse::<u64>() {
            Ok(ms) if NODE_TIMEOUT_MS.contains(&ms) => Status::Pass,
            _ => Status::Warn,
        },
        fix: "set cluster-node-timeout between 1000 and 15000 ms (cluster/redis.conf uses 5000): a failover takes about that long plus 1-2 s, and too short a timeout fails busy nodes over",
    },
];

/// One line per setting, naming which nodes have which value.
pub(super) async fn check(nodes: &Nodes) -> Vec<Check> {
    // setting -> value -> nodes
    let mut seen: BTreeMap<&str, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for (addr, mut conn) in nodes.all() {
        for setting in &SETTINGS {
            let reply: redis::RedisResult<BTreeMap<String, String>> = nodes
                .query(&mut conn, redis::cmd("CONFIG").arg("GET").arg(setting.name))
                .await;
            let value = match reply {
                Ok(map) => map
                    .get(setting.name)
                    .map(|v| format!("{v:?}"))
                    .unwrap_or_else(|| "(not reported)".into()),
                Err(err) => format!("(CONFIG GET failed: {err})"),
            };
            seen.entry(setting.name)
                .or_default()
                .entry(value)
                .or_default()
                .push(addr.to_owned());
        }
    }
    SETTINGS
        .iter()
        .map(|setting| {
            let values = seen.remove(setting.name).unwrap_or_default();
            let mut status = Status::Pass;
            let mut found = Vec::new();
            for (value, addrs) in &values {
                let raw = value.trim_matches('"');
                let verdict = if value.starts_with('"') {
                    (setting.judge)(raw)
                } else {
                    Status::Fail
                };
                status = status.max(verdict);
                if values.len() == 1 {
                    found.push(format!("{value} on all {} nodes", addrs.len()));
                } else {
                    found.push(format!("{value} on {}", list(addrs)));
                }
            }
            Check::new(status, setting.name, found.join("; "), setting.fix)
        })
        .collect()
}

/// The oldest Redis seathold runs on: its scripts call `PEXPIRETIME` (7.0).
const MIN_VERSION: (u32, u32) = (7, 0);

/// The Redis version of every node, from `INFO server`: an older node
/// (a replica too, which may be promoted) serves holds but fails every
/// read, extend and confirm with a script error.
pub(super) async fn version(nodes: &Nodes) -> Check {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut status = Status::Pass;
    for (addr, mut conn) in nodes.all() {
        let reply: redis::RedisResult<String> = nodes
            .query(&mut conn, redis::cmd("INFO").arg("server"))
            .await;
        let version = match reply {
            Ok(info) => info
                .lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .map_or_else(|| "(not reported)".to_owned(), |v| v.trim().to_owned()),
            Err(err) => format!("(INFO failed: {err})"),
        };
        let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
        let ok = matches!((parts.next(), parts.next()), (Some(Some(major)), Some(Some(minor))) if (major, minor) >= MIN_VERSION);
        if !ok {
            status = Status::Fail;
        }
        seen.entry(version).or_default().push(addr.to_owned());
    }
    let found = if seen.len() == 1 {
        seen.iter()
            .map(|(v, addrs)| format!("{v} on all {} nodes", addrs.len()))
            .collect::<Vec<_>>()
    } else {
        seen.iter()
            .map(|(v, addrs)| format!("{v} on {}", list(addrs)))
            .collect()
    };
    Check::new(
        status,
        "redis version",
        found.join("; "),
        "every node needs Redis 7.0 or newer (seathold's scripts call PEXPIRETIME); upgrade the others",
    )
}
