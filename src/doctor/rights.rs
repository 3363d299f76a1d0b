//! The configured user's ACL rights, proven rather than read: on every
//! master the doctor runs each command seathold needs, on a scratch key of
//! its own in a slot of that master, and deletes the key again. On every
//! replica it runs the same commands, which Redis checks against the ACL
//! before it redirects them to the master (`MOVED`): a promoted replica
//! runs with its own ACL.
//!
//! The scratch key is `<prefix>{seathold-doctor-<random>}`: under the key
//! prefix, so a user limited to `~seat-hold:*` (cluster/acl.conf) may touch
//! it; its hash tag is not `{show:…}`, so it is never a seat key.

use redis::aio::MultiplexedConnection;
use redis::Cmd;

use super::{list, Check, Nodes, Status};
use crate::config::Options;
use crate::keys;

/// The channel seathold subscribes to on every master for expiry events.
const EXPIRED_CHANNEL: &str = "__keyevent@0__:expired";

/// A tiny script that reads its key, as seathold's scripts do; ACLs apply
/// inside scripts too.
const PROBE_SCRIPT: &str = "return redis.call('PTTL', KEYS[1])";

/// One command to try: the ACL rule that allows it, and the command.
struct Try {
    rule: &'static str,
    cmd: Cmd,
}

/// The commands seathold sends itself or from its scripts, on `key`; the
/// `DEL` that cleans up comes last.
fn tries(key: &str, handover: &str) -> Vec<Try> {
    let sha = redis::Script::new(PROBE_SCRIPT).get_hash().to_owned();
    let t = |rule: &'static str, parts: &[&str]| {
        let mut cmd = redis::cmd(parts[0]);
        for part in &parts[1..] {
            cmd.arg(*part);
        }
        Try { rule, cmd }
    };
    let stream = format!("{key}#events");
    let index = format!("{key}#deadlines");
    let pool = format!("{key}#pool");
    let stream = stream.as_str();
    let index = index.as_str();
    let pool = pool.as_str();
    // A minute from now: every scratch key expires by itself should the DEL
    // be refused (or the doctor be stopped halfway).
    let soon = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() + 60_000)
        .to_string();
    vec![
        // The TTL makes the key go by itself should the DEL be refused.
        t("+set", &["SET", key, "0", "PX", "60000"]),
        t("+get", &["GET", key]),
        t("+mget", &["MGET", key]),
        t("+exists", &["EXISTS", key]),
        t("+incrby", &["INCRBY", key, "1"]),
        t("+pttl", &["PTTL", key]),
        t("+pexpiretime", &["PEXPIRETIME", key]),
        t("+pexpireat", &["PEXPIREAT", key, &soon]),
        t(
            "+xadd",
            &["XADD", stream, "MAXLEN", "~", "100", "*", "t", "doctor"],
        ),
        t("+pexpireat", &["PEXPIREAT", stream, &soon]),
        t("+xrange", &["XRANGE", stream, "-", "+", "COUNT", "1"]),
        t("+xrevrange", &["XREVRANGE", stream, "+", "-", "COUNT", "1"]),
        t("+xread", &["XREAD", "COUNT", "1", "STREAMS", stream, "0-0"]),
        t("+xinfo|stream", &["XINFO", "STREAM", stream]),
        t("+xdel", &["XDEL", stream, "0-1"]),
        t("+zadd", &["ZADD", index, "1", "doctor"]),
        t("+pexpireat", &["PEXPIREAT", index, &soon]),
        t("+zrangebyscore", &["ZRANGEBYSCORE", index, "-inf", "+inf"]),
        t("+zrange", &["ZRANGE", index, "0", "0", "WITHSCORES"]),
        t("+zscore", &["ZSCORE", index, "doctor"]),
        t("+zrem", &["ZREM", index, "doctor"]),
        t(
            "+zremrangebyscore",
            &["ZREMRANGEBYSCORE", index, "-inf", "(0"],
        ),
        t("+hset", &["HSET", pool, "capacity", "0"]),
        t("+pexpireat", &["PEXPIREAT", pool, &soon]),
        t("+hincrby", &["HINCRBY", pool, "held", "0"]),
        t("+hget", &["HGET", pool, "capacity"]),
        t("+hmget", &["HMGET", pool, "capacity", "held"]),
        t("+asking", &["ASKING"]),
        t("+scan", &["SCAN", "0", "MATCH", "none", "COUNT", "1"]),
        t("+del", &["DEL", stream, index, pool]),
        t("+script|load", &["SCRIPT", "LOAD", PROBE_SCRIPT]),
        t("+evalsha", &["EVALSHA", &sha, "1", key]),
        t("+eval", &["EVAL", PROBE_SCRIPT, "1", key]),
        t("+time", &["TIME"]),
        t("+info", &["INFO", "replication"]),
        t("+cluster|slots", &["CLUSTER", "SLOTS"]),
        t("+cluster|info", &["CLUSTER", "INFO"]),
        t("+wait", &["WAIT", "0", "100"]),
        t("+config|get", &["CONFIG", "GET", "notify-keyspace-events"]),
        // An empty handover names no show: the instances that hear it do
        // nothing.
        t("+publish", &["PUBLISH", handover, ""]),
        t("+del", &["DEL", key]),
    ]
}

/// A scratch key whose slot `master` serves.
fn scratch_key(nodes: &Nodes, master: &str, prefix: &str) -> Option<String> {
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    (0..100_000)
        .map(|i| format!("{prefix}{{seathold-doctor-{}-{i}}}", &nonce[..12]))
        .find(|key| nodes.topo.master_of(keys::slot(key.as_bytes())) == Some(master))
}

/// One line per node. Replicas too: a promoted replica runs with its own
/// ACL. On a replica a command the ACL lets through answers `MOVED` (or
/// `WAIT` refuses a replica), so only a refusal is a verdict, and nothing
/// is written there.
pub(super) async fn check(nodes: &Nodes, opts: &Options) -> Vec<Check> {
    let mut checks = Vec::new();
    for (addr, mut conn) in nodes.all() {
        let replica = !nodes.topo.masters.iter().any(|m| m == addr);
        let user = whoami(nodes, &mut conn, opts.redis_username.as_deref()).await;
        let key = if replica {
            format!("{}{{seathold-doctor-replica}}", opts.key_prefix)
        } else {
            match scratch_key(nodes, addr, &opts.key_prefix) {
                Some(key) => key,
                None => continue,
            }
        };
        let mut denied = Vec::new();
        let mut failed = Vec::new();
        let mut tried = 0;
        let handover = crate::keys::KeySpace::new(opts.key_prefix.as_str()).handover_channel();
        for Try { rule, cmd } in tries(&key, &handover) {
            tried += 1;
            match nodes.query::<redis::Value>(&mut conn, &cmd).await {
                Err(err) if !(replica && let_through(&err)) => {
                    judge(rule, &err, &opts.key_prefix, &mut denied, &mut failed);
                }
                _ => {}
            }
        }
        tried += 2;
        if let Err(err) = subscribe(nodes, addr, &handover).await {
            judge(
                "+subscribe +ping",
                &err,
                &opts.key_prefix,
                &mut denied,
                &mut failed,
            );
        }
        let (name, done) = if replica {
            (
                format!("acl {addr} (replica)"),
                "its key commands answered MOVED, as a replica's do once the ACL let them through"
                    .to_owned(),
            )
        } else {
            (format!("acl {addr}"), format!("scratch key {key} deleted"))
        };
        checks.push(if denied.is_empty() && failed.is_empty() {
            Check::pass(
                name,
                format!("user {user} may run all {tried} commands seathold needs ({done})"),
            )
        } else if denied.is_empty() {
            Check::new(
                Status::Fail,
                name,
                format!("user {user}: {}", list(&failed)),
                "see the errors; every node must serve these commands",
            )
        } else {
            let mut found = format!("user {user} is denied {}", list(&denied));
            if !failed.is_empty() {
                found += &format!("; other errors: {}", list(&failed));
            }
            Check::new(
                Status::Fail,
                name,
                found,
                format!(
                    "grant them (ACL SETUSER {user} {}); cluster/acl.conf lists every right seathold needs",
                    denied.join(" ")
                ),
            )
        });
    }
    checks
}

/// Whether a replica's error says the ACL let the command through: it
/// redirected it to the master, or refused `WAIT` as a replica.
fn let_through(err: &redis::RedisError) -> bool {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    matches!(err.kind(), K::Server(S::Moved | S::Ask | S::ReadOnly))
        || err.to_string().contains("cannot be used with replica")
}

/// Files a refusal under `denied` as the ACL rule to grant, anything else
/// under `failed`.
fn judge(
    rule: &str,
    err: &redis::RedisError,
    prefix: &str,
    denied: &mut Vec<String>,
    failed: &mut Vec<String>,
) {
    let text = err.to_string();
    // `NoPerm: …` from a command, `NOPERM …` inside a script's error.
    if !text.to_ascii_uppercase().contains("NOPERM") {
        failed.push(format!("{rule}: {text}"));
        return;
    }
    let grant = if text.contains("access one of the keys") {
        format!("~{prefix}*")
    } else if text.contains("access one of the channels") {
        format!("&__keyevent@*__:expired &{prefix}sweep-handover")
    } else {
        rule.to_owned()
    };
    if !denied.contains(&grant) {
        denied.push(grant);
    }
}

/// The user the connection is authenticated as.
/// The user the doctor runs as: `ACL WHOAMI` (which cluster/acl.conf does
/// not grant), else `--redis-username`, else `default` (no username is
/// Redis's default user), so that the advice names a user to paste.
async fn whoami(
    nodes: &Nodes,
    conn: &mut MultiplexedConnection,
    configured: Option<&str>,
) -> String {
    match nodes
        .query::<String>(conn, redis::cmd("ACL").arg("WHOAMI"))
        .await
    {
        Ok(user) => user,
        Err(_) => configured.unwrap_or("default").to_owned(),
    }
}

/// `SUBSCRIBE` to the expiry channel and the handover channel and `PING`
/// while subscribed, as the expiry subscriber does, on a connection of its
/// own.
async fn subscribe(nodes: &Nodes, addr: &str, handover: &str) -> redis::RedisResult<()> {
    let client = nodes
        .cluster
        .node_client(addr)
        .map_err(|e| redis::RedisError::from(std::io::Error::other(e.to_string())))?;
    let work = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(EXPIRED_CHANNEL).await?;
        pubsub.subscribe(handover).await?;
        let _: redis::Value = pubsub.ping().await?;
        pubsub.unsubscribe(EXPIRED_CHANNEL).await?;
        pubsub.unsubscribe(handover).await
    };
    match tokio::time::timeout(nodes.timeout, work).await {
        Ok(result) => result,
        Err(_) => {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time").into())
        }
    }
}
