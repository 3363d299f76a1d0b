//! Resharding under load, with the real `redis-cli --cluster reshard`: while
//! client tasks hold and release seats of one busy show and of a few quiet
//! ones, the busy show's slot and 100 others move from one master to
//! another and back, again and again. Every answer is 201, 204, 409 or 503
//! and none times out; shows whose slots stay put see no failure at all;
//! the cluster is healthy afterwards and no seat is left held. This binary
//! moves slots for seconds, so it has its own cluster.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cluster, cluster_cmd, master_ports, node_id, server, show, slot_of};

/// Slots moved each way: the source's lowest 101, the busy show's among them.
const MOVED_SLOTS: u16 = 101;
const LOAD: Duration = Duration::from_secs(5);
const BUSY_SEATS: usize = 20;

/// The `redis-cli` on PATH; panics with how to install it when there is
/// none (tests never skip silently).
fn redis_cli() -> PathBuf {
    common::required(
        "redis-cli",
        "the resharding test runs `redis-cli --cluster reshard`: install it \
         (Debian/Ubuntu: `sudo apt-get install redis-tools`; macOS: `brew install redis`)",
    )
}

/// The lowest `n` slots the master at `port` serves, by its own CLUSTER
/// SLOTS.
async fn lowest_slots(port: u16, n: u16) -> Vec<u16> {
    use redis::Value;
    let ranges: Vec<Value> = cluster_cmd(port, &["SLOTS"]).await.expect("CLUSTER SLOTS");
    let mut owned = Vec::new();
    for range in &ranges {
        let Value::Array(parts) = range else { continue };
        if let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (parts.first(), parts.get(1), parts.get(2))
        {
            if master.get(1) == Some(&Value::Int(i64::from(port))) {
                let (start, end) = (u16::try_from(*start), u16::try_from(*end));
                owned.extend(start.expect("a slot")..=end.expect("a slot"));
            }
        }
    }
    owned.sort_unstable();
    owned.truncate(usize::from(n));
    owned
}

/// `redis-cli --cluster reshard` of the lowest `MOVED_SLOTS` slots of `from`.
async fn reshard(from: u16, to: u16) {
    let (from_id, to_id) = (node_id(from).await, node_id(to).await);
    let moving = lowest_slots(from, MOVED_SLOTS).await;
    let cli = redis_cli();
    let out = tokio::process::Command::new(&cli)
        .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
        .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
        .args(["--cluster-slots", &MOVED_SLOTS.to_string(), "--cluster-yes"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cli.display()));
    assert!(
        out.status.success(),
        "redis-cli --cluster reshard {from} -> {to}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The nodes learn the new owner by gossip, which carries the target's
    // config epoch. Rarely (once in the runs of 2026-11-30) a master kept
    // the old owner of a slot for 30 s and more: Redis's own open issue
    // redis/redis#2969, "nodes have a different slots mapping after a
    // reshard". What is under test is seathold during the move, not
    // Redis's gossip after it, so the test settles the map as an operator
    // would: `SETSLOT NODE` of every moved slot, first on the target (which
    // also closes an IMPORTING state left open, seen in CI on 2026-12-02
    // and 2026-12-03, and bumps its epoch), then on every other master.
    if let Err(err) = cluster().wait_until_ok(Duration::from_secs(10)).await {
        eprintln!(
            "masters disagree 10 s after a reshard ({err}); CLUSTER SETSLOT <slot> NODE {to} \
             for the {} moved slots",
            moving.len()
        );
        let others = master_ports().await.into_iter().filter(|&p| p != to);
        for port in std::iter::once(to).chain(others) {
            for slot in &moving {
                let slot = slot.to_string();
                let set: redis::RedisResult<()> =
                    cluster_cmd(port, &["SETSLOT", &slot, "NODE", &to_id]).await;
                if let Err(e) = set {
                    eprintln!("CLUSTER SETSLOT {slot} NODE {to} on {port}: {e}");
                }
            }
        }
        cluster()
            .wait_until_ok(Duration::from_secs(30))
            .await
            .expect("cluster healthy after a reshard");
    }
}

/// Holds a random seat of `show` and releases it, until `stop`; answers
/// every status, or the error of a request that got none.
async fn client(
    base: String,
    show: String,
    seats: usize,
    stop: Arc<AtomicBool>,
) -> Vec<Result<u16, String>> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut answers = Vec::new();
    let mut n = rand::random::<u64>();
    while !stop.load(Ordering::Relaxed) {
        n = n
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let seat = (n >> 33) as usize % seats;
        let hold = http
            .post(format!("{base}/v1/shows/{show}/seats/S{seat}/hold"))
            .send()
            .await;
        let resp = match hold {
            Ok(resp) => resp,
            Err(err) => {
                answers.push(Err(format!("hold: {err}")));
                continue;
            }
        };
        let status = resp.status().as_u16();
        answers.push(Ok(status));
        if status != 201 {
            continue;
        }
        let body: serde_json::Value = resp.json().await.expect("hold body");
        let token = body["holdToken"].as_str().expect("token").to_owned();
        // A release answered 503 is sent again: a resend answers 204.
        for _ in 0..20 {
            match http
                .delete(format!("{base}/v1/shows/{show}/holds/{token}"))
                .send()
                .await
            {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    answers.push(Ok(status));
                    if status != 503 {
                        break;
                    }
                }
                Err(err) => answers.push(Err(format!("release: {err}"))),
            }
        }
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_and_releases_ride_out_a_reshard_under_load() {
    // Without redis-cli, fail at once with how to install it, before the load.
    redis_cli();
    let s = server().await;
    s.wait_direct(Duration::from_secs(5)).await;
    let source = cluster().master_port_for_slot(0).await.expect("slot 0");
    let target = cluster()
        .master_port_for_slot(16383)
        .await
        .expect("slot 16383");
    assert_ne!(source, target);
    assert_eq!(master_ports().await.len(), 3);

    let busy = common::show_where("busy", |slot| slot < MOVED_SLOTS);
    // One quiet show per master, in slots that never move.
    let mut quiet: BTreeMap<u16, String> = BTreeMap::new();
    while quiet.len() < 3 {
        let sh = show("quiet");
        let slot = slot_of(&sh);
        if slot < 1000 {
            continue;
        }
        let master = cluster().master_port_for_slot(slot).await.expect("master");
        quiet.entry(master).or_insert(sh);
    }

    let text = s.metrics().await;
    let errors_before = common::series_sum(&text, "seathold_redis_errors_total");
    let timeouts_before = common::series(&text, r#"seathold_redis_errors_total{kind="timeout"}"#);

    let stop = Arc::new(AtomicBool::new(false));
    let mut busy_clients = Vec::new();
    for _ in 0..5 {
        busy_clients.push(tokio::spawn(client(
            s.base.clone(),
            busy.clone(),
            BUSY_SEATS,
            stop.clone(),
        )));
    }
    let mut quiet_clients = Vec::new();
    for sh in quiet.values() {
        quiet_clients.push((
            sh.clone(),
            tokio::spawn(client(s.base.clone(), sh.clone(), 1000, stop.clone())),
        ));
    }

    let started = Instant::now();
    let mut moves = 0;
    while started.elapsed() < LOAD || moves == 0 {
        reshard(source, target).await;
        assert_eq!(
            cluster().master_port_for_slot(slot_of(&busy)).await.ok(),
            Some(target),
            "the busy show's slot moved"
        );
        reshard(target, source).await;
        moves += 2;
    }
    let moving_for = started.elapsed();
    stop.store(true, Ordering::Relaxed);

    let mut busy_counts: BTreeMap<u16, usize> = BTreeMap::new();
    for c in busy_clients {
        for answer in c.await.expect("busy client") {
            match answer {
                Ok(status @ (201 | 204 | 409 | 503)) => {
                    *busy_counts.entry(status).or_default() += 1;
                }
                other => panic!("busy show: {other:?}"),
            }
        }
    }
    let mut quiet_total = 0;
    for (sh, c) in quiet_clients {
        for answer in c.await.expect("quiet client") {
            quiet_total += 1;
            assert!(
                matches!(answer, Ok(201 | 204)),
                "quiet show {sh} (slot {}): {answer:?}",
                slot_of(&sh)
            );
        }
    }
    // A request for a moving slot is retried within its deadline: a 503
    // may only be a deadline that ran out, never a retry given up early.
    let text = s.metrics().await;
    let errors = common::series_sum(&text, "seathold_redis_errors_total") - errors_before;
    let timeouts =
        common::series(&text, r#"seathold_redis_errors_total{kind="timeout"}"#) - timeouts_before;
    eprintln!(
        "Redis errors: {errors} ({timeouts} timeouts); {moves} reshards of {MOVED_SLOTS} slots in {moving_for:?}; busy show: {busy_counts:?}; quiet shows: {quiet_total} answers, all 201/204"
    );
    assert!(
        busy_counts.get(&201).copied().unwrap_or(0) > 20,
        "{busy_counts:?}"
    );
    assert_eq!(
        errors,
        timeouts,
        "every Redis error was a deadline that ran out: {:?}",
        text.lines()
            .filter(|l| l.starts_with("seathold_redis_errors_total{"))
            .collect::<Vec<_>>()
    );
    assert!(quiet_total > 20, "the quiet shows had load: {quiet_total}");

    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
    // Every hold was released, and every hold answered 503 was abandoned:
    // no seat stays held.
    let ids: Vec<String> = (0..BUSY_SEATS).map(|i| format!("S{i}")).collect();
    let path = format!("/v1/shows/{busy}/seats?ids={}", ids.join(","));
    common::eventually(Duration::from_secs(10), "every busy seat free", || async {
        let (status, states) = s.get(&path).await;
        status == 200
            && states["seats"]
                .as_object()
                .is_some_and(|m| m.values().all(|v| v["state"] == "free"))
    })
    .await;
    s.stop().await;
}
