//! One test per fault fixed in the review of issue 10 (and in later reviews of
//! shutdown), each against the real
//! Redis Cluster of this binary (and the real binary where a signal is
//! involved). Every test here failed on the code before its fix; the
//! deliberately broken change each was checked against is named in its doc.
//!
//! Tests that change the cluster (CONFIG SET, CLIENT PAUSE, slot moves) or
//! read process-wide gauges take [`LOCK`] exclusively; the others share it.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    cluster, master_ports, node, options, series, series_sum, server, server_with, show, slot_of,
    SlotMove,
};
use seathold::config::Options;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::RwLock;

/// Exclusive for tests that change the cluster or read process-wide gauges.
static LOCK: RwLock<()> = RwLock::const_new(());

const ERRORS: &str = "seathold_redis_errors_total";
const DIRECT: &str = "seathold_redis_direct_connections";

/// The real binary, killed when dropped.
struct Daemon {
    child: Child,
    base: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// `seathold serve` on a free port against `seeds`, not waited for.
    fn spawn(seeds: &str, extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let child = Command::new(env!("CARGO_BIN_EXE_seathold"))
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--redis-nodes", seeds])
            .args(extra)
            .env("SEATHOLD_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn seathold");
        Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// `seathold serve` against the test cluster, once `/readyz` answers
    /// 200.
    async fn start(extra: &[&str]) -> Self {
        let daemon = Self::spawn(&cluster().seed_urls().join(","), extra);
        common::wait_readyz(
            &reqwest::Client::new(),
            &daemon.base,
            200,
            Duration::from_secs(30),
        )
        .await;
        daemon
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id();
        let ok = Command::new("/bin/sh")
            .args(["-c", &format!("kill -{sig} {pid}")])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} {pid}");
    }

    async fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

/// The process-wide metrics of the in-process servers, rendered without a
/// connection (for when connections are the thing being counted).
fn local_metrics() -> String {
    seathold::metrics::install().render()
}

/// Fault 1. Broken change: `Readiness::set_cluster` publishing the probe's
/// own verdict (`ok`) instead of `is_ready()`: the probe set
/// `seathold_cluster_ready` back to 1 within 500 ms of SIGTERM.
#[tokio::test]
async fn cluster_ready_stays_zero_through_the_shutdown_drain() {
    let _shared = LOCK.read().await;
    let mut d = Daemon::start(&["--shutdown-drain-ms", "3000"]).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let scrape = || async {
        series(
            &common::metrics_at(&http, &d.base).await,
            "seathold_cluster_ready",
        )
    };
    assert_eq!(scrape().await, 1.0, "ready before the signal");
    let sent = Instant::now();
    d.signal("TERM");
    // At once, but the signal goes through a `kill` process on a machine
    // that may be busy.
    common::wait_readyz(&http, &d.base, 503, Duration::from_millis(1000)).await;
    let mut samples = 0;
    // 1.5 s of the 3 s drain: three rounds of the 500 ms readiness probe.
    while sent.elapsed() < Duration::from_millis(1800) {
        let ready = http
            .get(format!("{}/readyz", d.base))
            .send()
            .await
            .expect("readyz during the drain")
            .status()
            .as_u16();
        let gauge = scrape().await;
        assert_eq!(ready, 503, "/readyz at {:?} after SIGTERM", sent.elapsed());
        assert_eq!(
            gauge,
            0.0,
            "seathold_cluster_ready at {:?} after SIGTERM (sample {samples})",
            sent.elapsed()
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(samples >= 5, "only {samples} samples");
    assert_eq!(d.wait_exit(Duration::from_secs(8)).await, Some(0));
    assert!(sent.elapsed() >= Duration::from_millis(3000), "drained 3 s");
}

/// Sets `cluster-preferred-endpoint-type` on every node; restores `ip`
/// when dropped, also when the test fails.
struct EndpointType;

impl EndpointType {
    async fn set(value: &str) -> Self {
        for n in cluster().nodes() {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-preferred-endpoint-type")
                .arg(value)
                .query_async(&mut node(n.port).await)
                .await
                .expect("CONFIG SET cluster-preferred-endpoint-type");
        }
        Self
    }
}

impl Drop for EndpointType {
    fn drop(&mut self) {
        for n in cluster().nodes() {
            let restored = redis::Client::open(format!("redis://127.0.0.1:{}", n.port))
                .and_then(|c| c.get_connection())
                .and_then(|mut c| {
                    redis::cmd("CONFIG")
                        .arg("SET")
                        .arg("cluster-preferred-endpoint-type")
                        .arg("ip")
                        .query::<()>(&mut c)
                });
            if let Err(err) = restored {
                eprintln!("could not restore the endpoint type on {}: {err}", n.port);
            }
        }
    }
}

/// Fault 2. Redis 7.0 answers NULL hosts in CLUSTER SLOTS with
/// `cluster-preferred-endpoint-type unknown-endpoint`. Broken change:
/// `topology::endpoint` refusing a NULL host (`Value::Nil => return None`):
/// the slot map never parsed and the daemon never became ready.
#[tokio::test]
async fn null_endpoints_in_cluster_slots_still_make_the_daemon_ready() {
    let _exclusive = LOCK.write().await;
    let restore = EndpointType::set("unknown-endpoint").await;
    let port = master_ports().await[0];
    let slots: redis::Value = common::cluster_cmd(port, &["SLOTS"])
        .await
        .expect("CLUSTER SLOTS");
    let redis::Value::Array(ranges) = &slots else {
        panic!("CLUSTER SLOTS: {slots:?}")
    };
    let nil_hosts = ranges
        .iter()
        .filter_map(|r| match r {
            redis::Value::Array(fields) => fields.get(2),
            _ => None,
        })
        .filter(|master| matches!(master, redis::Value::Array(f) if f.first() == Some(&redis::Value::Nil)))
        .count();
    assert_eq!(
        nil_hosts,
        ranges.len(),
        "every master host is NULL: {slots:?}"
    );

    let s = server().await;
    // The daemon's own slot map names the right ports: it opens a direct
    // connection to each of the three masters.
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(5)).await;
    for tag in ["null-a", "null-b", "null-c", "null-d"] {
        let sh = show(tag);
        let hold = s.hold(&sh, &["E1", "E2"]).await;
        let token = hold["holdToken"].as_str().expect("token");
        let (status, body) = s.confirm(&sh, token).await;
        assert_eq!(status, 200, "confirm: {body}");
        let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/E2")).await;
        assert_eq!(seat["state"], "sold");
    }
    s.stop().await;
    drop(restore);
    let port = master_ports().await[0];
    let slots: redis::Value = common::cluster_cmd(port, &["SLOTS"])
        .await
        .expect("CLUSTER SLOTS");
    assert!(
        !format!("{slots:?}").contains("Nil"),
        "the endpoint type is ip again: {slots:?}"
    );
}

/// Fault 3. Broken change: the refused connection served by hyper (its 503
/// written only after a request arrived): a client that sends nothing got
/// nothing. Also found: the refused connection was counted in
/// `seathold_http_connections` (4 with a limit of 3) while it was refused.
#[tokio::test]
async fn connections_past_the_limit_are_refused_at_accept() {
    let _exclusive = LOCK.write().await;
    let mut s = server_with(Options {
        max_connections: 3,
        ..options()
    })
    .await;
    // The readiness check's keep-alive connection goes with its client.
    s.http = reqwest::Client::new();
    let gauge = || series(&local_metrics(), "seathold_http_connections");
    common::eventually(Duration::from_secs(5), "no open connection", || async {
        gauge() == 0.0
    })
    .await;

    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(
            tokio::net::TcpStream::connect(s.addr)
                .await
                .expect("connect"),
        );
    }
    common::eventually(Duration::from_secs(5), "3 open connections", || async {
        gauge() == 3.0
    })
    .await;
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut max = 0.0f64;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                max = max.max(series(&local_metrics(), "seathold_http_connections"));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            max
        })
    };

    // The fourth sends nothing and still gets its answer, then the close.
    let started = Instant::now();
    let mut fourth = tokio::net::TcpStream::connect(s.addr)
        .await
        .expect("connect");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(3), fourth.read_to_end(&mut answer)).await;
    let took = started.elapsed();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(read.is_ok(), "not closed within 3 s; got {answer:?}");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert!(answer.contains("\"overloaded\""), "{answer:?}");
    assert!(took < Duration::from_millis(1000), "closed after {took:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let max = sampler.await.expect("sampler");
    assert!(max <= 3.0, "seathold_http_connections reached {max}");

    // The idle ones go; then a normal request is served.
    drop(idle);
    common::eventually(Duration::from_secs(5), "connections closed", || async {
        gauge() == 0.0
    })
    .await;
    let sh = show("conns");
    let (status, body) = s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
    assert_eq!((status, body["state"].as_str()), (200, Some("free")));
    // A request on a served connection still works with others refused.
    let mut raw = tokio::net::TcpStream::connect(s.addr)
        .await
        .expect("connect");
    raw.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut resp = Vec::new();
    raw.read_to_end(&mut resp).await.expect("read");
    assert!(resp.starts_with(b"HTTP/1.1 200"));
    s.stop().await;
}

/// Fault 4. Broken change: the direct path without its `InFlight` guard (a
/// script cancelled by the request's deadline left its connection in
/// place): `seathold_redis_direct_connections` stayed at 3 through the pause.
#[tokio::test]
async fn a_direct_connection_that_times_out_is_dropped_and_replaced() {
    let _exclusive = LOCK.write().await;
    let s = server_with(Options {
        redis_timeout_ms: 300,
        confirm_wait_timeout_ms: 100,
        ..options()
    })
    .await;
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(5)).await;
    let sh = show("paused");
    let master = cluster()
        .master_port_for_slot(slot_of(&sh))
        .await
        .expect("master of the show");
    s.hold(&sh, &["A1"]).await;
    let topology_changes = s.metric("seathold_topology_changes_total").await;

    // Long enough that three holds of 300 ms each fit in it on a loaded
    // machine.
    common::pause_clients(master, 3000, "WRITE").await;
    let paused = Instant::now();
    let mut fewest = f64::MAX;
    for i in 0..3 {
        let sent = Instant::now();
        let (status, body) = s
            .post(
                &format!("/v1/shows/{sh}/holds"),
                json!({"seats": [format!("P{i}")]}),
            )
            .await;
        let took = sent.elapsed();
        assert_eq!(status, 503, "hold during the pause: {body}");
        assert_eq!(body["error"], "redis_unavailable");
        assert!(
            took < Duration::from_millis(1300),
            "answered after {took:?}"
        );
        fewest = fewest.min(s.metric(DIRECT).await);
    }
    assert!(
        paused.elapsed() < Duration::from_millis(2900),
        "still paused"
    );
    assert!(
        fewest < 3.0,
        "the timed-out direct connection was dropped (gauge at least {fewest})"
    );

    // Right after the pause a hold succeeds, with no topology change.
    tokio::time::sleep(Duration::from_millis(3000).saturating_sub(paused.elapsed())).await;
    let after = Instant::now();
    let (status, body) = s
        .post(&format!("/v1/shows/{sh}/holds"), json!({"seats": ["Q1"]}))
        .await;
    assert_eq!(status, 201, "first hold after the pause: {body}");
    // Within the deadline: not after a reconnection's back-off.
    assert!(after.elapsed() < Duration::from_millis(1000));
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(3)).await;
    assert_eq!(
        s.metric("seathold_topology_changes_total").await,
        topology_changes,
        "no topology change was needed"
    );
    // The holds answered 503 ran once the pause ended; each was abandoned.
    for i in 0..3 {
        common::eventually(Duration::from_secs(5), "the 503 holds released", || async {
            let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/P{i}")).await;
            seat["state"] == "free"
        })
        .await;
    }
    s.stop().await;
}

/// Fault 5. Broken change: `classify` without its WRONGTYPE / script-error
/// arm (the error was `Other`, answered 503 "try again"); with the old
/// `hold.lua` (seats written without NX) the multi-seat hold also
/// overwrote the hash and answered 201.
#[tokio::test]
async fn a_foreign_key_type_is_a_500_and_is_never_overwritten() {
    let _shared = LOCK.read().await;
    let s = server().await;
    let sh = show("wrongtype");
    let key = format!("seat-hold:{{show:{sh}}}:E7");
    let mut r = common::redis().await;
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("owner")
        .arg("legacy")
        .query_async(&mut r)
        .await
        .expect("HSET");
    let protocol = r#"seathold_redis_errors_total{kind="protocol"}"#;
    let before = series(&s.metrics().await, protocol);

    for (path, body) in [
        (
            format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": ["E7"]})),
        ),
        (format!("/v1/shows/{sh}/seats/E7/hold"), None),
        (
            format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": ["E6", "E7"]})),
        ),
    ] {
        let (status, answer) = s.call("POST", &path, body.clone()).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (500, Some("internal")),
            "{path} {body:?}: {answer}"
        );
    }
    let kind: String = redis::cmd("TYPE")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("TYPE");
    assert_eq!(kind, "hash");
    let owner: Option<String> = redis::cmd("HGET")
        .arg(&key)
        .arg("owner")
        .query_async(&mut r)
        .await
        .expect("HGET");
    assert_eq!(owner.as_deref(), Some("legacy"));
    let (_, e6) = s.get(&format!("/v1/shows/{sh}/seats/E6")).await;
    assert_eq!(e6["state"], "free", "E6 was not left held: {e6}");
    let e6_key: i64 = redis::cmd("EXISTS")
        .arg(format!("seat-hold:{{show:{sh}}}:E6"))
        .query_async(&mut r)
        .await
        .expect("EXISTS");
    assert_eq!(e6_key, 0);
    let after = series(&s.metrics().await, protocol);
    assert!(after >= before + 3.0, "protocol errors {before} -> {after}");
    s.stop().await;
}

/// Fault 6. Broken change: `+config|set` back on the seathold line (as it
/// was). tests/acl.rs runs the daemon under this file.
#[test]
fn the_acl_does_not_grant_config_set() {
    let acl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/acl.conf"))
        .expect("cluster/acl.conf");
    let line = acl
        .lines()
        .find(|l| l.starts_with("user seathold "))
        .expect("a seathold user");
    let rules: Vec<&str> = line.split_whitespace().collect();
    for granted in [
        "+config|set",
        "+config",
        "+@all",
        "+@admin",
        "+@dangerous",
        "allcommands",
    ] {
        assert!(!rules.contains(&granted), "seathold is granted {granted}");
    }
    assert!(rules.contains(&"+config|get"));
    assert!(rules.contains(&"-@all"));
}

/// Fault 7. Broken changes: `Segments::of` without percent-decoding (400
/// `invalid_show`), a trailing slash read as an empty token (405), and
/// confirm's body not decoded as `EmptyBody` (200, sold).
#[tokio::test]
async fn http_edges_decoding_trailing_slash_and_confirm_bodies() {
    let _shared = LOCK.read().await;
    let s = server().await;
    let sh = show("edge");
    let encoded: String = sh
        .char_indices()
        .map(|(i, c)| {
            if i == 0 {
                format!("%{:02X}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect();
    assert_ne!(encoded, sh);

    let (status, hold) = s
        .call(
            "POST",
            &format!("/v1/shows/{encoded}/seats/E%37/hold"),
            None,
        )
        .await;
    assert_eq!(status, 201, "{hold}");
    assert_eq!(hold["show"], sh.as_str());
    assert_eq!(hold["seats"], json!(["E7"]));
    let (status, seat) = s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
    assert_eq!(
        (status, seat["state"].as_str()),
        (200, Some("held")),
        "{seat}"
    );
    let (_, seat) = s.get(&format!("/v1/shows/{encoded}/seats/E%37")).await;
    assert_eq!(seat["seat"], "E7");

    let (status, body) = s
        .post(&format!("/v1/shows/{sh}/holds/"), json!({"seats": ["E8"]}))
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (404, Some("not_found")),
        "{body}"
    );

    let token = hold["holdToken"].as_str().expect("token");
    let confirm = format!("/v1/shows/{sh}/holds/{token}/confirm");
    let (status, body) = s.post(&confirm, json!({"ttlMs": 1000})).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("invalid_request")),
        "{body}"
    );
    let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
    assert_eq!(seat["state"], "held", "nothing sold: {seat}");
    let (status, body) = s.post(&confirm, json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
    assert_eq!(seat["state"], "sold");

    let other = s.hold(&sh, &["E9"]).await;
    let token = other["holdToken"].as_str().expect("token");
    let (status, body) = s
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{token}/confirm"),
            None,
        )
        .await;
    assert_eq!(status, 200, "confirm without a body: {body}");
    s.stop().await;
}

/// Fault 8. Broken changes: the confirm path of before (a redirect sent
/// back to the slot map's master, three attempts, no `ASKING`, TRYAGAIN
/// not retried) and the cluster client's 2 retries: the confirm sent while
/// the slot was MIGRATING answered 503.
///
/// While a slot is MIGRATING, Redis answers a multi-key script whose keys
/// are not all present `ASK` on the source and `TRYAGAIN` on the target
/// (confirm's sale record does not exist before the confirm), so a confirm
/// cannot complete until the move does: it is retried within its deadline
/// and answers 200 once the slot is assigned.
#[tokio::test]
async fn confirms_follow_a_slot_that_moves() {
    let _exclusive = LOCK.write().await;
    let s = server().await;
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(5)).await;
    let (sh, slot, from, to) = show_to_move("moving").await;
    let a = s.hold(&sh, &["A1", "A2"]).await;
    let b = s.hold(&sh, &["B1"]).await;
    let confirm_path = |hold: &serde_json::Value| {
        format!(
            "/v1/shows/{sh}/holds/{}/confirm",
            hold["holdToken"].as_str().expect("token")
        )
    };
    let text = s.metrics().await;
    let errors = series_sum(&text, ERRORS);
    let fallbacks = series(&text, "seathold_redis_direct_fallbacks_total");

    // In the middle: MIGRATING, every key of the slot already on the target.
    let mv = SlotMove::begin(slot, from, to).await;
    let migrated = mv.migrate_keys().await;
    assert!(migrated >= 5, "migrated {migrated} keys");
    let asked = redis::cmd("GET")
        .arg(format!("seat-hold:{{show:{sh}}}:A1"))
        .query_async::<Option<String>>(&mut node(from).await)
        .await
        .expect_err("the old master redirects");
    assert_eq!(asked.code(), Some("ASK"), "{asked}");
    let url = format!("{}{}", s.base, confirm_path(&a));
    let http = s.http.clone();
    let sent = Instant::now();
    let confirm = tokio::spawn(async move {
        let resp = http.post(url).send().await.expect("confirm");
        let status = resp.status().as_u16();
        (
            status,
            resp.text().await.unwrap_or_default(),
            sent.elapsed(),
        )
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    mv.finish().await;
    let (status, body, took) = confirm.await.expect("confirm task");
    assert_eq!(
        status, 200,
        "confirm during the move: {body} after {took:?}"
    );
    assert!(
        took >= Duration::from_millis(250),
        "the confirm waited for the move ({took:?})"
    );

    // After: the slot moves back at once; the daemon's slot map is stale
    // and the old owner answers MOVED.
    let back = SlotMove::begin(slot, to, from).await;
    back.migrate_keys().await;
    back.finish().await;
    let (status, body) = s.post(&confirm_path(&b), json!({})).await;
    assert_eq!(status, 200, "confirm after the move: {body}");

    for seat in ["A1", "A2", "B1"] {
        let (_, state) = s.get(&format!("/v1/shows/{sh}/seats/{seat}")).await;
        assert_eq!(state["state"], "sold", "{seat}: {state}");
    }
    let text = s.metrics().await;
    assert_eq!(series_sum(&text, ERRORS), errors, "no Redis error answered");
    assert!(
        series(&text, "seathold_redis_direct_fallbacks_total") > fallbacks,
        "the daemon met the redirects"
    );
    s.stop().await;
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
}

/// A storm of requests for a slot that is moving: 200 reads of seats that
/// do not exist, 64 at a time, while the slot is MIGRATING (every one
/// redirected with `ASK`). The cluster client followed an ASK with `ASKING`
/// and the command sent apart on its shared connection, where another
/// request could use the flag up: the importing node answered MOVED, 1-3
/// of the 200 reads answered 200, and the churn wedged that connection for
/// good in most such storms (a reviewer's find, 5 of 5 at 64 at a time):
/// every probe timed out, and the daemon stayed unready after the move
/// ended. Now the daemon follows an ASK itself, `ASKING` and the script in
/// one pipeline on a dedicated connection: every read is answered, and the
/// importing node sends no MOVED; and a probe that times out twice in a row
/// has the cluster connection made anew, should it wedge however.
#[tokio::test]
async fn a_storm_of_asks_leaves_the_daemon_ready() {
    use futures_util::StreamExt;
    let _exclusive = LOCK.write().await;
    let s = server().await;
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(5)).await;
    let (sh, slot, from, to) = show_to_move("ask-storm").await;
    let moved_errors = |port: u16| async move {
        let info: String = redis::cmd("INFO")
            .arg("errorstats")
            .query_async(&mut node(port).await)
            .await
            .expect("INFO errorstats");
        info.lines()
            .find_map(|l| l.strip_prefix("errorstat_MOVED:count="))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let moved_before = moved_errors(to).await;
    let mv = SlotMove::begin(slot, from, to).await;
    let statuses: Vec<u16> = futures_util::stream::iter(0..200)
        .map(|i| {
            let (http, url) = (
                s.http.clone(),
                format!("{}/v1/shows/{sh}/seats/S{i}", s.base),
            );
            async move {
                http.get(url)
                    .send()
                    .await
                    .map_or(0, |r| r.status().as_u16())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let moved = moved_errors(to).await - moved_before;
    eprintln!("ask storm: {ok} of 200 reads answered 200 during the move, {moved} MOVED from the importing node");
    assert_eq!(ok, 200, "{statuses:?}");
    assert_eq!(
        moved, 0,
        "the importing node answered MOVED: ASKING was used up"
    );
    mv.finish().await;
    let back = SlotMove::begin(slot, to, from).await;
    back.finish().await;
    s.wait_ready(Duration::from_secs(20)).await;
    let (status, state) = s.get(&format!("/v1/shows/{sh}/seats/S1")).await;
    assert_eq!(status, 200, "{state}");
    let hold = s.hold(&sh, &["S1"]).await;
    assert!(hold["holdToken"].is_string(), "{hold}");
    s.stop().await;
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
}

/// A new show id with `tag`, its slot, the master that serves it and
/// another master to move it to.
async fn show_to_move(tag: &str) -> (String, u16, u16, u16) {
    let sh = show(tag);
    let slot = slot_of(&sh);
    let from = cluster().master_port_for_slot(slot).await.expect("master");
    let to = master_ports()
        .await
        .into_iter()
        .find(|p| *p != from)
        .expect("another master");
    (sh, slot, from, to)
}

/// Fault 8, the confirm's own retry loop. The confirm's read-only lookup
/// passes while the old master is paused for writes (`CLIENT PAUSE WRITE`
/// holds only the sale script, queued on its dedicated connection); the
/// slot turns MIGRATING meanwhile, so when the pause ends the sale script
/// meets `TRYAGAIN` on the old master (Redis 7.0.15 answers a multi-key
/// command TRYAGAIN when some of its keys are there and some not: the sale
/// record never is) until the move finishes 300 ms later, then `MOVED`.
/// Broken changes: the confirm path of before (three attempts, TRYAGAIN
/// not retried: 503) and TRYAGAIN counted as a redirect (503 after five
/// attempts, with most of the deadline left).
#[tokio::test]
async fn a_confirm_meeting_tryagain_is_retried_within_its_deadline() {
    let _exclusive = LOCK.write().await;
    let s = server().await;
    s.wait_metric(DIRECT, 3.0, Duration::from_secs(5)).await;
    let (sh, slot, from, to) = show_to_move("asked").await;
    let hold = s.hold(&sh, &["A1", "A2"]).await;
    let url = format!(
        "{}/v1/shows/{sh}/holds/{}/confirm",
        s.base,
        hold["holdToken"].as_str().expect("token")
    );
    let errors = series_sum(&s.metrics().await, ERRORS);
    // Its nodes' ids looked up now: the move starts within the pause.
    let mv = SlotMove::new(slot, from, to).await;

    common::pause_clients(from, 400, "WRITE").await;
    let paused = Instant::now();
    let http = s.http.clone();
    let confirm = tokio::spawn(async move {
        let resp = http.post(url).send().await.expect("confirm");
        let status = resp.status().as_u16();
        (
            status,
            resp.text().await.unwrap_or_default(),
            paused.elapsed(),
        )
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    mv.start().await;
    assert!(
        paused.elapsed() < Duration::from_millis(400),
        "still paused"
    );
    tokio::time::sleep(Duration::from_millis(700).saturating_sub(paused.elapsed())).await;
    if confirm.is_finished() {
        let (status, body, took) = confirm.await.expect("confirm task");
        mv.migrate_keys().await;
        mv.finish().await;
        panic!("the confirm gave up during the move: {status} {body} after {took:?}");
    }
    mv.migrate_keys().await;
    mv.finish().await;
    let (status, body, took) = confirm.await.expect("confirm task");
    assert_eq!(status, 200, "{body} after {took:?}");
    for seat in ["A1", "A2"] {
        let (_, state) = s.get(&format!("/v1/shows/{sh}/seats/{seat}")).await;
        assert_eq!(state["state"], "sold", "{seat}: {state}");
    }
    assert_eq!(series_sum(&s.metrics().await, ERRORS), errors);
    s.stop().await;
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
}

/// A request whose head arrived during the drain and whose body takes
/// most of `--body-read-timeout-ms` is still answered at shutdown: the
/// wait for requests in flight covers reading the body and then Redis.
/// Before, it was the Redis timeout plus 1 s (1.5 s here), and the
/// connection was closed with no answer after the hold may have run.
#[tokio::test]
async fn a_request_whose_body_is_slow_is_answered_at_shutdown() {
    let _shared = LOCK.read().await;
    let mut d = Daemon::start(&[
        "--shutdown-drain-ms",
        "200",
        "--redis-timeout-ms",
        "500",
        "--body-read-timeout-ms",
        "4000",
    ])
    .await;
    let addr = d.base.trim_start_matches("http://").to_owned();
    let sh = show("slow-body");
    let body = br#"{"ttlMs": 60000}"#;
    let mut c = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    c.write_all(
        format!(
            "POST /v1/shows/{sh}/seats/S1/hold HTTP/1.1\r\nHost: x\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("head");
    tokio::time::sleep(Duration::from_millis(100)).await;
    d.signal("TERM");
    // The body, a byte at a time over 2.5 s.
    for b in body.iter() {
        tokio::time::sleep(Duration::from_millis(2500 / body.len() as u64)).await;
        c.write_all(&[*b]).await.expect("a byte of the body");
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 201"), "answer: {answer:?}");
    assert_eq!(d.wait_exit(Duration::from_secs(8)).await, Some(0));
}

/// Reads one HTTP/1.1 response with a `content-length` from `c`: its head
/// (lowercased) and its body.
async fn read_response(c: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    try_read_response(c)
        .await
        .expect("connection closed before a response")
}

/// [`read_response`], or `None` when the connection ends (or breaks) before
/// any byte of a response.
async fn try_read_response(c: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = c.read(&mut byte).await.unwrap_or(0);
        if n == 0 && buf.is_empty() {
            return None;
        }
        assert!(n > 0, "connection closed within a response's head: {buf:?}");
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse().expect("content-length"))
        .expect("a content-length");
    let mut body = vec![0u8; len];
    c.read_exact(&mut body).await.expect("a response's body");
    Some((head, body))
}

/// Once shutdown has started, every answer says `connection: close`, and
/// the connection ends after it: a client on a keep-alive connection goes
/// to a new one (another instance, once the load balancer has seen
/// `/readyz`) instead of sending its next request on a connection that the
/// end of the drain closes unread. Before, answers during the drain kept
/// the connection open, and a review's 8 keep-alive clients lost a request
/// each in 5 to 7 of 8 connections at the end of a 1 s drain.
#[tokio::test]
async fn answers_during_the_drain_close_their_keep_alive_connection() {
    let _shared = LOCK.read().await;
    let mut d = Daemon::start(&["--shutdown-drain-ms", "3000"]).await;
    let http = reqwest::Client::new();
    let addr = d.base.trim_start_matches("http://").to_owned();
    let sh = show("drain-close");
    let mut c = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let hold = |seat: &str| {
        let body = r#"{"ttlMs": 60000}"#;
        format!(
            "POST /v1/shows/{sh}/seats/{seat}/hold HTTP/1.1\r\nHost: x\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    c.write_all(hold("K1").as_bytes())
        .await
        .expect("first hold");
    let (head, _) = read_response(&mut c).await;
    assert!(
        head.starts_with("http/1.1 201"),
        "before the signal: {head}"
    );
    assert!(
        !head.contains("connection: close"),
        "before the signal the connection is kept: {head}"
    );

    let sent = Instant::now();
    d.signal("TERM");
    common::wait_readyz(&http, &d.base, 503, Duration::from_millis(1000)).await;
    c.write_all(hold("K2").as_bytes())
        .await
        .expect("a hold during the drain");
    let (head, _) = read_response(&mut c).await;
    assert!(head.starts_with("http/1.1 201"), "during the drain: {head}");
    assert!(
        head.contains("connection: close"),
        "an answer during the drain closes its connection: {head}"
    );
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_millis(1000), c.read_to_end(&mut rest)).await;
    assert!(
        matches!(ended, Ok(Ok(0))),
        "the connection ends after that answer: {ended:?} {rest:?}"
    );
    assert!(
        sent.elapsed() < Duration::from_millis(2500),
        "well before the drain's end: {:?}",
        sent.elapsed()
    );
    // Probes and the API document say so too.
    let probe = http
        .get(format!("{}/readyz", d.base))
        .send()
        .await
        .expect("readyz during the drain");
    assert_eq!(probe.status(), 503);
    assert_eq!(
        probe
            .headers()
            .get("connection")
            .and_then(|v| v.to_str().ok()),
        Some("close"),
        "/readyz during the drain"
    );
    assert_eq!(d.wait_exit(Duration::from_secs(8)).await, Some(0));
}

/// Clients on keep-alive connections that send holds back to back through
/// a SIGTERM, going to a new connection when an answer says `connection:
/// close`, lose none: every request that reached the daemon is answered,
/// and the only failure is a connection refused once the drain is over
/// (nothing was sent, so retrying elsewhere is safe). Before, most of the
/// eight connections had a request sent and never answered at the end of
/// the drain (its seat left free): a hold without an Idempotency-Key cannot
/// be retried safely after that.
#[tokio::test]
async fn keep_alive_clients_lose_no_request_at_shutdown() {
    let _shared = LOCK.read().await;
    let mut d = Daemon::start(&["--shutdown-drain-ms", "1000"]).await;
    let addr = d.base.trim_start_matches("http://").to_owned();
    let sh = show("drain-busy");
    let signalled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (addr, sh) = (addr.clone(), sh.clone());
        let signalled = std::sync::Arc::clone(&signalled);
        workers.push(tokio::spawn(async move {
            let (mut answered, mut after_signal, mut connections) = (0u32, 0u32, 0u32);
            let mut conn: Option<tokio::net::TcpStream> = None;
            for i in 0.. {
                let fresh = conn.is_none();
                let c = match &mut conn {
                    Some(c) => c,
                    None => match tokio::net::TcpStream::connect(&addr).await {
                        Ok(c) => {
                            connections += 1;
                            conn.insert(c)
                        }
                        Err(_) => break,
                    },
                };
                let body = r#"{"ttlMs": 60000}"#;
                let request = format!(
                    "POST /v1/shows/{sh}/seats/W{w}-{i}/hold HTTP/1.1\r\nHost: x\r\n\
                     content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let answer = match c.write_all(request.as_bytes()).await {
                    Ok(()) => try_read_response(c).await,
                    Err(_) => None,
                };
                let Some((head, _)) = answer else {
                    // A connection the kernel accepted after the daemon's
                    // last accept is reset as the listener closes (no
                    // server can help that): the first request on a new
                    // connection, no byte of an answer, and the daemon
                    // gone for the next connect. Nothing reached it.
                    let closed = signalled.load(std::sync::atomic::Ordering::Relaxed)
                        && tokio::net::TcpStream::connect(&addr).await.is_err();
                    assert!(
                        fresh && closed,
                        "worker {w}: hold W{w}-{i} sent and never answered (connection {connections})"
                    );
                    break;
                };
                assert!(head.starts_with("http/1.1 201"), "hold W{w}-{i}: {head}");
                answered += 1;
                if signalled.load(std::sync::atomic::Ordering::Relaxed) {
                    after_signal += 1;
                }
                if head.contains("connection: close") {
                    conn = None;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (answered, after_signal)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    signalled.store(true, std::sync::atomic::Ordering::Relaxed);
    d.signal("TERM");
    let mut during = 0;
    for w in workers {
        let (answered, after_signal) = w.await.expect("worker");
        assert!(answered > 0, "every worker was answered");
        during += after_signal;
    }
    assert!(during > 0, "holds were answered during the drain");
    assert_eq!(d.wait_exit(Duration::from_secs(8)).await, Some(0));
}

/// A readiness probe that is waiting on Redis when SIGTERM comes does not
/// hold up the exit: the probe stops with the other background tasks.
/// Here the only seed accepts connections and never answers, so every
/// probe waits its whole Redis timeout (4 s); the daemon serves `/healthz`
/// meanwhile and, with no drain and nothing in flight, must exit well
/// within that. Before, the probe ran to its end first (and one that found
/// a new slot map could take a second Redis timeout loading scripts), so
/// shutdown took up to 3 Redis timeouts past the drain, not the 2
/// documented.
#[tokio::test]
async fn a_probe_waiting_on_redis_does_not_delay_the_exit() {
    let _shared = LOCK.read().await;
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a black-hole seed");
    let seed = hole.local_addr().expect("its address");
    // Accepts and keeps every connection, reads nothing, answers nothing.
    let keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((c, _)) = hole.accept().await {
            held.push(c);
        }
    });
    let mut d = Daemon::spawn(
        &format!("redis://{seed}"),
        &["--redis-timeout-ms", "4000", "--shutdown-drain-ms", "0"],
    );
    let http = reqwest::Client::new();
    let up = Instant::now();
    loop {
        let alive = http.get(format!("{}/healthz", d.base)).send().await;
        if alive.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "never served /healthz"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ready = http
        .get(format!("{}/readyz", d.base))
        .send()
        .await
        .expect("readyz");
    assert_eq!(
        ready.status(),
        503,
        "a seed that never answers is not ready"
    );
    // Mid-probe: the first one started at launch and waits 4 s.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let sent = Instant::now();
    d.signal("TERM");
    assert_eq!(
        d.wait_exit(Duration::from_secs(10)).await,
        Some(0),
        "exit after SIGTERM"
    );
    assert!(
        sent.elapsed() < Duration::from_millis(1500),
        "exited {:?} after SIGTERM, waiting for the probe",
        sent.elapsed()
    );
    keep.abort();
}

/// A second SIGTERM (or Ctrl-C) during the drain stops the daemon at once,
/// with exit code 130: an operator at a terminal need not wait out a long
/// drain or reach for SIGKILL. Before, further signals were ignored and
/// the process took the whole drain (10 s here).
#[tokio::test]
async fn a_second_signal_stops_at_once() {
    let _shared = LOCK.read().await;
    let mut d = Daemon::start(&["--shutdown-drain-ms", "10000"]).await;
    let http = reqwest::Client::new();
    d.signal("TERM");
    common::wait_readyz(&http, &d.base, 503, Duration::from_millis(2000)).await;
    let again = Instant::now();
    d.signal("TERM");
    assert_eq!(d.wait_exit(Duration::from_secs(5)).await, Some(130));
    assert!(
        again.elapsed() < Duration::from_secs(2),
        "stopped {:?} after the second signal",
        again.elapsed()
    );
}

/// A master out of memory (`maxmemory` reached, `noeviction`) refuses a
/// script's first write that needs memory with `OOM` (the error names the
/// script): holds and a confirm are 503 `redis_unavailable` (try again:
/// memory may be freed, a node added), not 500 `internal` as a script error
/// that retrying cannot mend; nothing is written, and the hold goes through
/// once memory is back. (An extend goes through: its first write,
/// `PEXPIRE`, needs no memory, and Redis lets a script that wrote go on.)
#[tokio::test]
async fn a_master_out_of_memory_is_503_not_500() {
    struct Restore(u16);
    impl Drop for Restore {
        fn drop(&mut self) {
            let port = self.0;
            std::thread::spawn(move || {
                let client =
                    redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("client");
                let mut c = client.get_connection().expect("connection");
                let _: () = redis::cmd("CONFIG")
                    .arg("SET")
                    .arg("maxmemory")
                    .arg("0")
                    .query(&mut c)
                    .expect("CONFIG SET maxmemory 0");
            })
            .join()
            .expect("restore maxmemory");
        }
    }
    let _x = LOCK.write().await;
    let s = server().await;
    let sh = show("oom");
    let held = s.hold(&sh, &["A1"]).await;
    let token = held["holdToken"].as_str().expect("token").to_owned();
    let (_, master) = common::slot_and_master(&sh).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query_async(&mut node(master).await)
        .await
        .expect("CONFIG SET maxmemory 1");
    let restore = Restore(master);
    for (method, path, body) in [
        ("POST", format!("/v1/shows/{sh}/seats/B1/hold"), None),
        (
            "POST",
            format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": ["B1", "B2"]})),
        ),
        (
            "POST",
            format!("/v1/shows/{sh}/holds/{token}/confirm"),
            None,
        ),
    ] {
        let (status, answer) = s.call(method, &path, body).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (503, Some("redis_unavailable")),
            "{method} {path}: {answer}"
        );
    }
    drop(restore);
    let (_, b1) = s.get(&format!("/v1/shows/{sh}/seats/B1")).await;
    assert_eq!(b1["state"], "free", "{b1}");
    s.hold(&sh, &["B1", "B2"]).await;
    s.stop().await;
}
