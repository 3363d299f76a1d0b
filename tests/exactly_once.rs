//! Exactly once under retries and timeouts (API 1.1), against a real Redis
//! Cluster: idempotency keys and their replays, no orphan holds after a 503,
//! resends of a release that answer 204, fences that never repeat, even
//! across a failover that loses writes.
//!
//! One cluster for the binary. Tests that disturb it (pauses, kill -9) or
//! that measure what a master did (`INFO commandstats`) take `EXCLUSIVE`
//! for writing; every other test takes it for reading, so they run side by
//! side but never during a disturbance.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cluster, options, server_with, show, TestServer};
use redis::{AsyncCommands, Value as RValue};
use seathold::config::Options;
use seathold::idempotency::{Idem, IdemKey};
use seathold::keys::KeySpace;
use seathold::scripts::Scripts;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::RwLock;

static EXCLUSIVE: RwLock<()> = RwLock::const_new(());

/// 2^53: the first integer JavaScript cannot tell from its neighbour.
const JS_SAFE: i64 = 1 << 53;

fn keys() -> KeySpace {
    KeySpace::new("seat-hold:")
}

/// Options with a short Redis deadline, so that a pause outlives it.
fn fast() -> Options {
    Options {
        redis_timeout_ms: 500,
        confirm_wait_timeout_ms: 300,
        ..options()
    }
}

/// The port of the master serving `show`'s slot now.
async fn master_of(show: &str) -> u16 {
    cluster()
        .master_port_for_slot(keys().show_slot(show))
        .await
        .expect("master of the show's slot")
}

/// An HTTP answer: status, whether it says `Idempotent-Replayed: true`, and
/// the JSON body (Null when empty).
#[derive(Debug)]
struct Reply {
    status: u16,
    replayed: bool,
    body: Value,
}

/// Sends `method path` with an optional JSON body and `Idempotency-Key`.
async fn send(
    s: &TestServer,
    method: &str,
    path: &str,
    body: Option<Value>,
    key: Option<&str>,
) -> Reply {
    reply(common::request_at(&s.http, &s.base, method, path, body, key).await).await
}

/// `resp` as a [`Reply`].
async fn reply(resp: reqwest::Response) -> Reply {
    let status = resp.status().as_u16();
    let replayed = match resp.headers().get("idempotent-replayed") {
        None => false,
        Some(v) => {
            assert_eq!(v, "true", "Idempotent-Replayed is only ever true");
            true
        }
    };
    let bytes = resp.bytes().await.expect("body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("a JSON body")
    };
    Reply {
        status,
        replayed,
        body,
    }
}

fn token_of(hold: &Value) -> String {
    hold["holdToken"].as_str().expect("holdToken").to_owned()
}

fn fence_of(hold: &Value) -> i64 {
    hold["fence"].as_i64().expect("fence")
}

/// A unique idempotency key.
fn idem_key(tag: &str) -> String {
    format!("{tag}:{}", uuid::Uuid::new_v4().simple())
}

async fn get_opt(key: &str) -> Option<String> {
    let mut r = common::redis().await;
    r.get(key).await.expect("GET")
}

async fn pttl(key: &str) -> i64 {
    let mut r = common::redis().await;
    r.pttl(key).await.expect("PTTL")
}

/// The fence written in the hold record of `token` (`<fence> <created> …`).
async fn record_fence(show: &str, token: &str) -> Option<i64> {
    let record = get_opt(&keys().hold_record(show, token)).await?;
    record.split(' ').next()?.parse().ok()
}

/// `INFO <section>` of one node as name -> value.
async fn info(port: u16, section: &str) -> BTreeMap<String, String> {
    let mut c = common::node(port).await;
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut c)
        .await
        .expect("INFO");
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// Calls per command on one node (`INFO commandstats`).
async fn calls(port: u16) -> BTreeMap<String, u64> {
    info(port, "commandstats")
        .await
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("cmdstat_")?.to_owned();
            let n = v
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name, n))
        })
        .collect()
}

/// Redis's clock on one node, in ms.
async fn redis_ms(port: u16) -> i64 {
    let mut c = common::node(port).await;
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(&mut c).await.expect("TIME");
    s * 1000 + us / 1000
}

async fn seat_state(s: &TestServer, show: &str, seat: &str) -> Value {
    let (status, body) = s.get(&format!("/v1/shows/{show}/seats/{seat}")).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Waits up to 5 s for `seat` of `show` to read free.
async fn wait_free(s: &TestServer, show: &str, seat: &str) {
    common::eventually(Duration::from_secs(5), "the seat to be free", || async {
        seat_state(s, show, seat).await["state"] == "free"
    })
    .await;
}

/// `CLIENT PAUSE ms WRITE` on a node.
async fn pause_writes(port: u16, ms: u64) {
    common::pause_clients(port, ms, "WRITE").await;
}

/// A TCP proxy for one upstream. While `lose` is set, the next reply that
/// comes back from upstream is swallowed and the client's connection is
/// closed instead: the request took effect, its answer was lost.
struct Proxy {
    port: u16,
    lose: Arc<AtomicBool>,
    lost: Arc<tokio::sync::Notify>,
}

impl Proxy {
    async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let lose = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(tokio::sync::Notify::new());
        let (lose2, lost2) = (Arc::clone(&lose), Arc::clone(&lost));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let (lose, lost) = (Arc::clone(&lose2), Arc::clone(&lost2));
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if lose.swap(false, Ordering::SeqCst) {
                            // Drop both sides: the reply never arrives.
                            lost.notify_one();
                            break;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    up.abort();
                });
            }
        });
        Self { port, lose, lost }
    }

    /// A Redis connection through the proxy.
    async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection through the proxy")
    }

    /// The next reply is lost.
    fn lose_next_reply(&self) {
        self.lose.store(true, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------
// 1. A hold answered 503 while its master pauses writes.
// ---------------------------------------------------------------------

/// Pauses writes on `show`'s master for `pause_ms` and sends a one-seat
/// hold meanwhile; answers the reply and when the pause ends.
async fn hold_during_pause(
    s: &TestServer,
    show: &str,
    seat: &str,
    key: Option<&str>,
    pause_ms: u64,
) -> (Reply, Instant) {
    let master = master_of(show).await;
    pause_writes(master, pause_ms).await;
    let paused_until = Instant::now() + Duration::from_millis(pause_ms);
    let started = Instant::now();
    let reply = send(
        s,
        "POST",
        &format!("/v1/shows/{show}/seats/{seat}/hold"),
        None,
        key,
    )
    .await;
    let took = started.elapsed();
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.body["error"], "redis_unavailable", "{reply:?}");
    assert!(
        took < Duration::from_millis(1_500),
        "the Redis deadline (500 ms) bounds the request: it took {took:?}"
    );
    assert!(
        Instant::now() < paused_until,
        "the 503 came while the master was still paused"
    );
    (reply, paused_until)
}

async fn sleep_until(at: Instant) {
    tokio::time::sleep_until(at.into()).await;
}

/// Without an Idempotency-Key, a hold answered 503 leaves no seat held: the
/// daemon releases (or forestalls) it in the background once Redis answers
/// again, counts it, and a retry gets the seat.
#[tokio::test]
async fn hold_answered_503_without_key_leaves_no_seat_held() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(fast()).await;
    let sh = show("orphan");
    // Connections and the slot map are in place before the pause.
    s.hold(&sh, &["warm"]).await;
    let orphans = s.metric("seathold_orphan_releases_total").await;

    let (_, paused_until) = hold_during_pause(&s, &sh, "A1", None, 2_500).await;
    sleep_until(paused_until).await;
    let resumed = Instant::now();
    s.wait_metric(
        "seathold_orphan_releases_total",
        orphans + 1.0,
        Duration::from_secs(5),
    )
    .await;
    common::eventually(Duration::from_secs(5), "the seat to be free again", || {
        let s = &s;
        let sh = &sh;
        async move { seat_state(s, sh, "A1").await["state"] == "free" }
    })
    .await;
    eprintln!(
        "orphan: free again {:?} after the pause ended",
        resumed.elapsed()
    );
    assert_eq!(
        get_opt(&keys().seat(&sh, "A1")).await,
        None,
        "no seat key left in Redis"
    );
    // Still free a little later: the abandoned script cannot take it late.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seat_state(&s, &sh, "A1").await["state"], "free");
    let retry = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/seats/A1/hold"),
        None,
        None,
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed);
    assert_eq!(
        get_opt(&keys().seat(&sh, "A1")).await.as_deref(),
        Some(token_of(&retry.body).as_str())
    );
}

/// With `--events off`, a hold answered 503 and abandoned is not counted in
/// `seathold_hold_expiries_total` when its tombstone (the record's key,
/// kept for the hold's TTL so that a late script writes nothing) expires:
/// the abandon claims the expiry the tombstone's notification would
/// otherwise count. A hold that runs out is counted as ever. Before, every
/// hold answered 503 without an Idempotency-Key counted one expiry of a
/// hold that was released (or never made). The daemon is a process of its
/// own with a key prefix of its own: with events off it counts the
/// expiries it hears, and no other test's.
#[tokio::test]
async fn an_abandoned_hold_is_not_counted_as_an_expiry_with_events_off() {
    let _x = EXCLUSIVE.write().await;
    let d = common::Daemon::start(&[
        "--events",
        "off",
        "--redis-timeout-ms",
        "500",
        "--key-prefix",
        "abandon-off:",
    ])
    .await;
    let http = reqwest::Client::new();
    let metric = |name: &'static str| {
        let d = &d;
        async move { common::series(&d.metrics().await, name) }
    };
    let sh = show("ab-off");
    let hold = |seat: &'static str, ttl: u64| {
        let (http, base, sh) = (http.clone(), d.base.clone(), sh.clone());
        async move {
            let resp = http
                .post(format!("{base}/v1/shows/{sh}/seats/{seat}/hold"))
                .json(&json!({ "ttlMs": ttl }))
                .send()
                .await
                .expect("hold");
            let status = resp.status().as_u16();
            (
                status,
                common::lenient_json(&resp.bytes().await.expect("body")),
            )
        }
    };
    let prefixed = KeySpace::new("abandon-off:");
    let slot = prefixed.show_slot(&sh);
    let master = cluster()
        .master_port_for_slot(slot)
        .await
        .expect("master of the show's slot");
    let mut node = common::node(master).await;
    // Connections in place; and the control, a hold that runs out.
    let (status, control) = hold("C1", 2_500).await;
    assert_eq!(status, 201, "{control}");
    let control = prefixed.hold_record(&sh, &token_of(&control));
    let left: i64 = node.pttl(&control).await.expect("PTTL");
    assert!(
        (1..=2_500).contains(&left),
        "the control's record {control}: PTTL {left}"
    );
    let (expiries, orphans) = (
        metric("seathold_hold_expiries_total").await,
        metric("seathold_orphan_releases_total").await,
    );
    pause_writes(master, 1_500).await;
    let (status, body) = hold("A1", 2_000).await;
    assert_eq!(status, 503, "a hold during the pause: {body}");
    common::eventually(Duration::from_secs(5), "the hold abandoned", || async {
        metric("seathold_orphan_releases_total").await > orphans
    })
    .await;
    // The abandoned hold's tombstone: the one other record of the show,
    // kept for the hold's TTL (2 s from the abandon).
    let records = prefixed.hold_record(&sh, "");
    let (_, in_slot) = common::keys_in_slot(slot).await;
    let others: Vec<&String> = in_slot
        .iter()
        .filter(|k| k.starts_with(&records) && **k != control)
        .collect();
    assert_eq!(
        others.len(),
        1,
        "records of {sh} besides the control: {in_slot:?}"
    );
    let tombstone = others[0].clone();
    let value: Option<String> = node.get(&tombstone).await.expect("GET");
    assert_eq!(value.as_deref(), Some("abandoned"), "{tombstone}");
    let left: i64 = node.pttl(&tombstone).await.expect("PTTL");
    assert!(
        (1..=2_000).contains(&left),
        "the tombstone {tombstone}: PTTL {left}"
    );
    // The abandon claimed the expiry, for longer than the tombstone lasts.
    let abandoned = tombstone.strip_prefix(&records).expect("a token");
    let claim = prefixed.expiry_claim(&sh, abandoned);
    let claimed: i64 = node.pttl(&claim).await.expect("PTTL");
    assert!(claimed > left, "the claim {claim}: PTTL {claimed}");
    // Redis deletes a key whose TTL is over (and notifies its expiry) when
    // it is read, or when its background cycle samples it, which can take
    // seconds: each record is read until it is gone, so that both
    // notifications come now (the control's, 2.5 s, and the tombstone's).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut left = Vec::new();
        for key in [&control, &tombstone] {
            let exists: bool = node.exists(key).await.expect("EXISTS");
            if exists {
                left.push(key.clone());
            }
        }
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "records still in Redis 10 s after the abandon: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    common::eventually(Duration::from_secs(5), "the control's expiry", || async {
        metric("seathold_hold_expiries_total").await > expiries
    })
    .await;
    // Both notifications have come well within this.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        metric("seathold_hold_expiries_total").await,
        expiries + 1.0,
        "the control's expiry alone"
    );
}

/// With an Idempotency-Key nothing is abandoned, and the retry with the
/// same key answers the hold Redis has. Under `CLIENT PAUSE` Redis drops
/// the paused script of a connection that closes, and the daemon closes the
/// connection of a script that timed out: so the first attempt usually
/// never ran and the retry is a first run; were it to run, the retry is its
/// replay. Either way exactly one hold, and the answer is that hold.
#[tokio::test]
async fn hold_answered_503_with_key_under_client_pause_is_found_by_the_retry() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(fast()).await;
    let sh = show("orphan-key");
    s.hold(&sh, &["warm"]).await;
    let orphans = s.metric("seathold_orphan_releases_total").await;
    let key = idem_key("pause");

    let (_, paused_until) = hold_during_pause(&s, &sh, "B1", Some(&key), 2_500).await;
    sleep_until(paused_until).await;
    // Time for an abandon to happen, would the daemon start one.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        s.metric("seathold_orphan_releases_total").await,
        orphans,
        "nothing abandoned when the request carried a key"
    );
    let recorded = get_opt(&keys().idempotency(&sh, &key)).await;
    let in_redis = get_opt(&keys().seat(&sh, "B1")).await;
    assert_eq!(
        recorded.is_some(),
        in_redis.is_some(),
        "a hold exists exactly when its outcome is recorded: {recorded:?} {in_redis:?}"
    );
    eprintln!(
        "client pause: the first attempt {} once the pause ended",
        if recorded.is_some() {
            "ran"
        } else {
            "never ran"
        }
    );
    let retry = hold_again(&s, &sh, "B1", &key).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.replayed, recorded.is_some(), "{retry:?}");
    let token = token_of(&retry.body);
    if let Some(first) = &in_redis {
        assert_eq!(first, &token, "the retry answers the first attempt's hold");
    }
    assert_the_very_hold(&s, &sh, "B1", &retry.body).await;
    // A second retry is a replay of that one hold.
    let again = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/seats/B1/hold"),
        None,
        Some(&key),
    )
    .await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    assert_eq!(again.body["holdToken"], retry.body["holdToken"]);
    assert_eq!(again.body["fence"], retry.body["fence"]);
}

/// The answer is the hold Redis has: the seat carries its token, the
/// record its fence, and its remaining time is current.
async fn assert_the_very_hold(s: &TestServer, show: &str, seat: &str, hold: &Value) {
    let token = token_of(hold);
    assert_eq!(
        get_opt(&keys().seat(show, seat)).await.as_deref(),
        Some(token.as_str()),
        "the seat in Redis carries the answered token"
    );
    assert_eq!(
        record_fence(show, &token).await,
        Some(fence_of(hold)),
        "the fence of the hold record"
    );
    let expires = hold["expiresInMs"].as_i64().expect("expiresInMs");
    let ttl = pttl(&keys().seat(show, seat)).await;
    assert!(
        expires >= ttl && expires - ttl < 2_000 && expires <= 300_000,
        "current remaining time: answered {expires}, Redis {ttl}"
    );
    assert_eq!(seat_state(s, show, seat).await["state"], "held");
}

/// SIGSTOPs `show`'s master for `freeze_ms` (under the node timeout, so no
/// failover) and sends a one-seat hold meanwhile: the daemon answers 503 and
/// closes the connection, but the script is already in the master's socket
/// buffer and runs when the master wakes, after the 503. Answers the reply
/// and the moment the master resumed.
async fn hold_while_master_frozen(
    s: &TestServer,
    show: &str,
    seat: &str,
    key: Option<&str>,
    freeze_ms: u64,
) -> (Reply, Instant) {
    let master = master_of(show).await;
    let thaw = common::Frozen::new(master);
    let frozen = Instant::now();
    let reply = send(
        s,
        "POST",
        &format!("/v1/shows/{show}/seats/{seat}/hold"),
        None,
        key,
    )
    .await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.body["error"], "redis_unavailable", "{reply:?}");
    assert!(
        frozen.elapsed() < Duration::from_millis(freeze_ms),
        "the 503 came while the master was frozen"
    );
    sleep_until(frozen + Duration::from_millis(freeze_ms)).await;
    drop(thaw);
    (reply, Instant::now())
}

/// Waits until the outcome of a hold sent under `key` is recorded (its
/// script ran late, after its 503).
async fn wait_recorded(show: &str, key: &str) {
    common::eventually(
        Duration::from_secs(5),
        "the late script to record its outcome",
        || async { get_opt(&keys().idempotency(show, key)).await.is_some() },
    )
    .await;
}

/// The client's retry of a hold of `seat` under `key`.
async fn hold_again(s: &TestServer, show: &str, seat: &str, key: &str) -> Reply {
    send(
        s,
        "POST",
        &format!("/v1/shows/{show}/seats/{seat}/hold"),
        None,
        Some(key),
    )
    .await
}

/// A hold without a key whose script ran late, after its 503: the daemon
/// releases it in the background (or had forestalled it with a tombstone),
/// counts it, and the seat is free again within seconds.
#[tokio::test]
async fn hold_run_late_after_its_503_without_key_is_released() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(fast()).await;
    let sh = show("late");
    let warm = s.hold(&sh, &["warm"]).await;
    let orphans = s.metric("seathold_orphan_releases_total").await;

    let (_, resumed) = hold_while_master_frozen(&s, &sh, "A1", None, 1_200).await;
    s.wait_metric(
        "seathold_orphan_releases_total",
        orphans + 1.0,
        Duration::from_secs(5),
    )
    .await;
    common::eventually(Duration::from_secs(5), "the seat to be free again", || {
        let (s, sh) = (&s, &sh);
        async move { seat_state(s, sh, "A1").await["state"] == "free" }
    })
    .await;
    let ran = get_opt(&keys().fence(&sh))
        .await
        .and_then(|f| f.parse::<i64>().ok())
        != Some(fence_of(&warm));
    eprintln!(
        "late hold: free again {:?} after the master woke; the late script {}",
        resumed.elapsed(),
        if ran {
            "ran and was released"
        } else {
            "was forestalled"
        }
    );
    assert_eq!(get_opt(&keys().seat(&sh, "A1")).await, None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(seat_state(&s, &sh, "A1").await["state"], "free");
    let retry = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/seats/A1/hold"),
        None,
        None,
    )
    .await;
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
}

/// A hold with a key whose script ran late, after its 503: nothing is
/// abandoned, and the retry with the same key answers that very hold,
/// marked as replayed.
#[tokio::test]
async fn hold_run_late_after_its_503_with_key_is_replayed_to_the_retry() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(fast()).await;
    let sh = show("late-key");
    s.hold(&sh, &["warm"]).await;
    let orphans = s.metric("seathold_orphan_releases_total").await;
    let key = idem_key("late");

    let _ = hold_while_master_frozen(&s, &sh, "B1", Some(&key), 1_200).await;
    wait_recorded(&sh, &key).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        s.metric("seathold_orphan_releases_total").await,
        orphans,
        "nothing abandoned when the request carried a key"
    );
    let first = get_opt(&keys().seat(&sh, "B1"))
        .await
        .expect("the late hold holds the seat");
    let retry = hold_again(&s, &sh, "B1", &key).await;
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    assert_eq!(token_of(&retry.body), first, "the very hold Redis has");
    assert_the_very_hold(&s, &sh, "B1", &retry.body).await;
}

/// A hold whose answer was lost (its master froze past the Redis timeout,
/// then ran the script) and that the client's retry got from its
/// `Idempotency-Key` still has its `expired` event within a second of its
/// expiry: the instance that answers the replay has the show swept then.
/// Before, no instance did (the first answered 503 before the script ran;
/// a replay scheduled nothing), and the event waited for Redis's expiry
/// notification (seconds late on a master with millions of keys with a
/// TTL) or for the periodic scan. Here notifications are off on the show's
/// master and the scan is an hour away.
#[tokio::test]
async fn a_replayed_hold_expires_on_time_without_notifications() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(Options {
        default_ttl_ms: 3_000,
        sweep_scan_interval_ms: 3_600_000,
        ..fast()
    })
    .await;
    let sh = show("replay-expiry");
    let _quiet = common::NoNotifications::on(master_of(&sh).await).await;
    let key = idem_key("replay-expiry");

    let _ = hold_while_master_frozen(&s, &sh, "C1", Some(&key), 1_200).await;
    wait_recorded(&sh, &key).await;
    let retry = hold_again(&s, &sh, "C1", &key).await;
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    let left = retry.body["expiresInMs"].as_u64().expect("expiresInMs");
    let expires = Instant::now() + Duration::from_millis(left);
    common::eventually(
        Duration::from_millis(left + 1_500),
        "the replayed hold's expired event",
        || async { events_of(&sh, "expired").await == 1 },
    )
    .await;
    let late = Instant::now().saturating_duration_since(expires);
    eprintln!("expired event {late:?} after the replayed hold's expiry");
    assert!(
        late < Duration::from_millis(1_000),
        "expired event {late:?} after the hold's expiry"
    );
}

/// A client that gives up first (its own timeout, shorter than the
/// daemon's) and closes the connection while its hold waits on a frozen
/// master never learns the token either: the hold must not stay behind
/// when the script runs after all.
#[tokio::test]
async fn hold_whose_client_gave_up_leaves_no_seat_held() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(fast()).await;
    let sh = show("gave-up");
    s.hold(&sh, &["warm"]).await;
    let master = master_of(&sh).await;
    let orphans = s.metric("seathold_orphan_releases_total").await;
    let thaw = common::Frozen::new(master);
    let frozen = Instant::now();
    let conn = send_raw_hold(&s, &sh, "A1").await;
    // The client's own timeout, before the daemon's.
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(conn);
    sleep_until(frozen + Duration::from_millis(1_200)).await;
    drop(thaw);
    s.wait_metric(
        "seathold_orphan_releases_total",
        orphans + 1.0,
        Duration::from_secs(5),
    )
    .await;
    wait_free(&s, &sh, "A1").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(get_opt(&keys().seat(&sh, "A1")).await, None);
}

/// A client that hangs up while its hold waits on the master does not cost
/// the daemon its direct connection to that master: only a script the
/// request's deadline cancelled says the connection is slow. Every hang-up
/// dropped it, so under overload, when clients give up first, the masters'
/// traffic kept moving to the slower cluster connection while new direct
/// connections were opened.
#[tokio::test]
async fn a_client_hanging_up_keeps_the_direct_connection() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(options()).await;
    let sh = show("hang-up");
    s.hold(&sh, &["warm"]).await;
    let master = master_of(&sh).await;
    let mut admin = common::node(master).await;
    // Clients only: a replica's link to the master (flag S) may be made
    // again meanwhile, after an earlier test froze the master (a fresh-clone
    // CI saw link 13, made when the cluster was created, go).
    let ids = |list: String| -> std::collections::BTreeSet<String> {
        list.lines()
            .filter(|l| {
                l.split(' ')
                    .find_map(|kv| kv.strip_prefix("flags="))
                    .is_some_and(|f| !f.contains('S'))
            })
            .filter_map(|l| l.split(' ').find_map(|kv| kv.strip_prefix("id=")))
            .map(str::to_owned)
            .collect()
    };
    let list = || redis::cmd("CLIENT").arg("LIST").clone();
    // The connections that stay: a daemon that just became ready also
    // opens short-lived ones (its expiry setup's CONFIG GET, its first
    // scans of the deadline indexes), which may be in one snapshot.
    s.wait_direct(Duration::from_secs(5)).await;
    let first = ids(list().query_async(&mut admin).await.expect("CLIENT LIST"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = ids(list().query_async(&mut admin).await.expect("CLIENT LIST"));
    let before: std::collections::BTreeSet<String> = first.intersection(&second).cloned().collect();
    pause_writes(master, 400).await;
    let conn = send_raw_hold(&s, &sh, "A1").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let after = ids(list().query_async(&mut admin).await.expect("CLIENT LIST"));
    let gone: Vec<_> = before.difference(&after).collect();
    assert!(gone.is_empty(), "connections closed: {gone:?}");
    // The hold the client never learned of was released.
    wait_free(&s, &sh, "A1").await;
}

/// Sends a one-seat hold over a connection of its own, without waiting for
/// the answer: the caller decides when the client gives up (drops it).
async fn send_raw_hold(s: &TestServer, show: &str, seat: &str) -> TcpStream {
    let mut conn = TcpStream::connect(s.addr).await.expect("connect");
    conn.write_all(
        format!(
            "POST /v1/shows/{show}/seats/{seat}/hold HTTP/1.1\r\nHost: seathold\r\n\
             Content-Length: 0\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("send the hold");
    conn
}

/// Runs hold.lua for one seat of `show` as the daemon does, without a key.
async fn run_hold_script(show: &str, seat: &str, token: &str, ttl_ms: u64) -> Vec<i64> {
    let ks = keys();
    let script_keys = vec![
        ks.hold_record(show, token),
        ks.fence(show),
        ks.seat(show, seat),
    ];
    let mut conn = common::redis().await;
    Scripts::embedded()
        .hold
        .run(&mut conn, &script_keys, |c| {
            // The short form of one seat: events off, the record's tail,
            // ref, seat and cap (unused with events off), no key.
            c.arg(token)
                .arg(ttl_ms)
                .arg(0)
                .arg(format!("s {show}/{seat}"))
                .arg("")
                .arg(seat)
                .arg(0);
        })
        .await
        .expect("hold.lua")
}

/// Runs hold.lua in its general form, as the daemon does for a hold of
/// `units` of `show`'s pool `floor` and no seat, events off, no key.
async fn run_pool_hold_script(show: &str, token: &str, units: u32) -> Vec<i64> {
    let ks = keys();
    let script_keys = vec![
        ks.hold_record(show, token),
        ks.fence(show),
        ks.pool(show, "floor"),
        ks.pool_holds(show, "floor"),
    ];
    let mut conn = common::redis().await;
    Scripts::embedded()
        .hold
        .run(&mut conn, &script_keys, |c| {
            // token, TTL, F, kind, items, fingerprint, its TTL, E, cap,
            // ref, S, P, H, default holder limit; then P quantities.
            c.arg(token)
                .arg(60_000)
                .arg(1)
                .arg("s")
                .arg(format!("{show}/@floor={units}"))
                .arg("")
                .arg(0)
                .arg(0)
                .arg(0)
                .arg("0123456789abcdef")
                .arg(0)
                .arg(1)
                .arg(0)
                .arg(0)
                .arg(units);
        })
        .await
        .expect("hold.lua")
}

/// A hold of pool units and no seat, resent by the daemon after its reply
/// was lost, answers as its first run did and takes nothing more: the
/// "already held" check looked at the first seat only, so the resend
/// counted the first run's own units against it (409 `pool_exhausted`, or
/// a 500 when the pool had room), and the units stayed held under a token
/// the client never got.
#[tokio::test]
async fn pool_hold_resent_answers_as_its_first_run() {
    let _r = EXCLUSIVE.read().await;
    let ks = keys();
    let mut conn = common::redis().await;
    for capacity in [2, 10] {
        let sh = show("pool-resend");
        let () = conn
            .hset(ks.pool(&sh, "floor"), "capacity", capacity)
            .await
            .expect("HSET");
        let token = uuid::Uuid::new_v4().to_string();
        let first = run_pool_hold_script(&sh, &token, 2).await;
        assert_eq!((first[0], first.len()), (1, 4), "{first:?}");
        let again = run_pool_hold_script(&sh, &token, 2).await;
        assert_eq!(again[0], 1, "capacity {capacity}: {again:?}");
        assert_eq!(again[1], first[1], "the same fence: {again:?}");
        let held: i64 = conn
            .hget(ks.pool(&sh, "floor"), "held")
            .await
            .expect("HGET");
        assert_eq!(held, 2, "capacity {capacity}: units held once");
        let holds: Vec<String> = conn
            .zrange(ks.pool_holds(&sh, "floor"), 0, -1)
            .await
            .expect("ZRANGE");
        assert_eq!(holds, [format!("2:{token}")]);
    }
}

/// Runs abandon.lua for a one-seat hold.
async fn run_abandon_script(show: &str, seat: &str, token: &str, ttl_ms: u64) -> i64 {
    let ks = keys();
    // Events off: the claim of the hold's expiry comes last.
    let script_keys = vec![
        ks.hold_record(show, token),
        ks.seat(show, seat),
        ks.expiry_claim(show, token),
    ];
    let mut conn = common::redis().await;
    Scripts::embedded()
        .abandon
        .run(&mut conn, &script_keys, |c| {
            // Events off (E, cap, ref), no pools (P), no holder (H).
            c.arg(token).arg(ttl_ms).arg(0).arg(0).arg("").arg(0).arg(0);
        })
        .await
        .expect("abandon.lua")
}

/// An abandoned hold never comes back, whichever arrives first: abandon.lua
/// before hold.lua (the script still queued) leaves a tombstone that makes
/// hold.lua write nothing; abandon.lua after hold.lua releases the seat, and
/// a late resend of the same hold.lua (the daemon resends a script whose
/// connection broke) does not take it again. Another holder's seat is never
/// touched.
#[tokio::test]
async fn abandoned_hold_never_comes_back() {
    let _r = EXCLUSIVE.read().await;
    let sh = show("abandon");
    let ks = keys();
    let fence_before = get_opt(&ks.fence(&sh)).await;

    // Abandon first, the hold's script arrives afterwards.
    let t1 = uuid::Uuid::new_v4().to_string();
    assert_eq!(run_abandon_script(&sh, "A1", &t1, 60_000).await, 0);
    assert_eq!(
        get_opt(&ks.hold_record(&sh, &t1)).await.as_deref(),
        Some("abandoned")
    );
    let ttl = pttl(&ks.hold_record(&sh, &t1)).await;
    assert!(
        ttl > 0 && ttl <= 60_000,
        "the tombstone lives as long as the hold would: {ttl}"
    );
    assert_eq!(run_hold_script(&sh, "A1", &t1, 60_000).await, vec![-4]);
    assert_eq!(get_opt(&ks.seat(&sh, "A1")).await, None, "nothing held");
    assert_eq!(
        get_opt(&ks.fence(&sh)).await,
        fence_before,
        "no fence spent"
    );

    // The hold ran, then was abandoned, then its script came again.
    let t2 = uuid::Uuid::new_v4().to_string();
    let ran = run_hold_script(&sh, "A2", &t2, 60_000).await;
    assert_eq!(ran[0], 1, "{ran:?}");
    assert_eq!(run_abandon_script(&sh, "A2", &t2, 60_000).await, 1);
    assert_eq!(get_opt(&ks.seat(&sh, "A2")).await, None, "released");
    let again = run_hold_script(&sh, "A2", &t2, 60_000).await;
    assert_eq!(
        get_opt(&ks.seat(&sh, "A2")).await,
        None,
        "a late resend of the abandoned hold took the seat again: {again:?}"
    );
    assert_eq!(again, vec![-4]);
    // Abandoning again changes nothing.
    assert_eq!(run_abandon_script(&sh, "A2", &t2, 60_000).await, 0);

    // Someone else's seat is left alone.
    let t3 = uuid::Uuid::new_v4().to_string();
    assert_eq!(run_hold_script(&sh, "A3", &t3, 60_000).await[0], 1);
    let bob = uuid::Uuid::new_v4().to_string();
    let mut r = common::redis().await;
    let () = r
        .set(ks.seat(&sh, "A3"), &bob)
        .await
        .expect("Bob holds A3 now");
    assert_eq!(run_abandon_script(&sh, "A3", &t3, 60_000).await, 1);
    assert_eq!(get_opt(&ks.seat(&sh, "A3")).await, Some(bob));
}

// ---------------------------------------------------------------------
// 2. Idempotency keys.
// ---------------------------------------------------------------------

/// What the slot's master did: write commands, dirty changes, keys in the
/// slot.
#[derive(Debug, PartialEq)]
struct Writes {
    commands: BTreeMap<String, u64>,
    dirty: String,
    keys_in_slot: i64,
}

const WRITE_COMMANDS: &[&str] = &[
    "set",
    "del",
    "unlink",
    "pexpire",
    "pexpireat",
    "expire",
    "incr",
    "incrby",
    "getdel",
    "getex",
    "hset",
    "xadd",
    "setex",
    "psetex",
    "rename",
];

async fn writes(port: u16, slot: u16) -> Writes {
    let commands = calls(port)
        .await
        .into_iter()
        .filter(|(k, _)| WRITE_COMMANDS.contains(&k.as_str()))
        .collect();
    let dirty = info(port, "persistence")
        .await
        .remove("rdb_changes_since_last_save")
        .expect("rdb_changes_since_last_save");
    let mut c = common::node(port).await;
    let keys_in_slot: i64 = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query_async(&mut c)
        .await
        .expect("COUNTKEYSINSLOT");
    Writes {
        commands,
        dirty,
        keys_in_slot,
    }
}

/// Two confirms of different holds sent at the same moment under one
/// Idempotency-Key: one sells its hold (200), the other is 422
/// `idempotency_key_reused` and sells nothing. Both may find no record when
/// they look it up before their scripts run; confirm.lua checks the key
/// again in the step that sells. Before, both answered 200 and both holds
/// were sold (the second overwrote the first's record).
#[tokio::test]
async fn concurrent_confirms_under_one_key_sell_once() {
    let _x = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("confirm-race");
    for round in 0..20 {
        let a = token_of(&s.hold(&sh, &[&format!("A{round}")]).await);
        let b = token_of(&s.hold(&sh, &[&format!("B{round}")]).await);
        let key = idem_key(&format!("confirm-race-{round}"));
        let confirm = |token: &str| {
            let path = format!("/v1/shows/{sh}/holds/{token}/confirm");
            let (s, key) = (&s, key.clone());
            async move { send(s, "POST", &path, None, Some(&key)).await }
        };
        let (ra, rb) = tokio::join!(confirm(&a), confirm(&b));
        let mut statuses = [ra.status, rb.status];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 422], "round {round}: {ra:?} {rb:?}");
        let (loser, seat) = if ra.status == 422 {
            (&ra, format!("A{round}"))
        } else {
            (&rb, format!("B{round}"))
        };
        assert_eq!(loser.body["error"], "idempotency_key_reused", "{loser:?}");
        assert_eq!(
            seat_state(&s, &sh, &seat).await["state"],
            "held",
            "round {round}: the refused confirm sold nothing"
        );
    }
}

/// The same key with the same request answers the same hold again, marked,
/// and writes nothing: no write command on the master, no key added, the
/// seat's TTL not reset. Each replay is counted once.
#[tokio::test]
async fn hold_replay_answers_the_same_hold_and_writes_nothing() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(options()).await;
    let sh = show("replay");
    let (slot, master) = (keys().show_slot(&sh), master_of(&sh).await);
    let key = idem_key("hold");
    let path = format!("/v1/shows/{sh}/holds");
    let body = json!({"seats": ["E7", "E8"], "ttlMs": 60000});

    let first = send(&s, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed, "a first run is no replay");
    let seat_key = keys().seat(&sh, "E7");
    let replays = s.metric("seathold_idempotent_replays_total").await;
    let before = writes(master, slot).await;
    let ttl_before = pttl(&seat_key).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    // The same body, its keys in another order and other white space: the
    // same request.
    let reordered = json!({"ttlMs": 60000, "seats": ["E7", "E8"]});
    for again_body in [body.clone(), reordered] {
        let again = send(&s, "POST", &path, Some(again_body), Some(&key)).await;
        assert_eq!(again.status, 201, "{again:?}");
        assert!(again.replayed, "{again:?}");
        for field in ["holdToken", "fence", "seats", "show"] {
            assert_eq!(again.body[field], first.body[field], "{field}");
        }
        let (a, b) = (
            first.body["expiresInMs"].as_i64().expect("expiresInMs"),
            again.body["expiresInMs"].as_i64().expect("expiresInMs"),
        );
        assert!(
            b < a && b > a - 5_000,
            "the current remaining time: {b} after {a}"
        );
    }
    let after = writes(master, slot).await;
    assert_eq!(after, before, "a replay writes nothing");
    let ttl_after = pttl(&seat_key).await;
    assert!(
        ttl_after < ttl_before - 50,
        "the seat's TTL was not reset: {ttl_before} then {ttl_after}"
    );
    assert_eq!(
        s.metric("seathold_idempotent_replays_total").await,
        replays + 2.0,
        "each replay counted once"
    );
    assert_eq!(
        get_opt(&seat_key).await.as_deref(),
        Some(token_of(&first.body).as_str())
    );
}

/// The same key with another request is 422 and changes nothing; malformed
/// keys are 400 before anything is written.
#[tokio::test]
async fn key_reuse_is_422_and_invalid_keys_are_400() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("reuse");
    let key = idem_key("reuse");
    let path = format!("/v1/shows/{sh}/holds");
    let first = send(
        &s,
        "POST",
        &path,
        Some(json!({"seats": ["A1"]})),
        Some(&key),
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");

    // Another body, another route of the same show, another method.
    let token = token_of(&first.body);
    for (method, p, body) in [
        ("POST", path.clone(), Some(json!({"seats": ["A2"]}))),
        (
            "POST",
            path.clone(),
            Some(json!({"seats": ["A1"], "ttlMs": 1000})),
        ),
        ("POST", format!("/v1/shows/{sh}/seats/A3/hold"), None),
        (
            "POST",
            format!("/v1/shows/{sh}/holds/{token}/extend"),
            Some(json!({"ttlMs": 1000})),
        ),
        ("DELETE", format!("/v1/shows/{sh}/holds/{token}"), None),
        (
            "POST",
            format!("/v1/shows/{sh}/holds/{token}/confirm"),
            None,
        ),
        (
            "PATCH",
            format!("/v1/shows/{sh}/holds/{token}"),
            Some(json!({"add": ["A4"]})),
        ),
        // The multi-show route: its home show is the first seat's.
        (
            "POST",
            "/v1/holds".to_owned(),
            Some(json!({"seats": [{"show": sh, "seat": "A2"}]})),
        ),
    ] {
        let r = send(&s, method, &p, body, Some(&key)).await;
        assert_eq!(r.status, 422, "{method} {p}: {r:?}");
        assert_eq!(r.body["error"], "idempotency_key_reused", "{r:?}");
        assert!(r.body["message"].is_string());
        assert!(!r.replayed);
    }
    for seat in ["A2", "A3", "A4"] {
        assert_eq!(seat_state(&s, &sh, seat).await["state"], "free", "{seat}");
    }
    // The hold is untouched: not extended, released or confirmed.
    let (status, read) = s.get(&format!("/v1/shows/{sh}/holds/{token}")).await;
    assert_eq!(status, 200);
    assert!(read["expiresInMs"].as_i64().expect("expiresInMs") > 200_000);

    // The key is scoped to the home show: another show may use it.
    let other = show("reuse-other");
    let r = send(
        &s,
        "POST",
        &format!("/v1/shows/{other}/holds"),
        Some(json!({"seats": ["A2"]})),
        Some(&key),
    )
    .await;
    assert_eq!((r.status, r.replayed), (201, false), "{r:?}");

    let long = "a".repeat(256);
    let longest = "b".repeat(255);
    for bad in ["a b", long.as_str(), "", "a/b", "~internal", "é"] {
        for (method, p, body) in [
            (
                "POST",
                format!("/v1/shows/{sh}/holds"),
                Some(json!({"seats": ["C1"]})),
            ),
            ("POST", format!("/v1/shows/{sh}/seats/C1/hold"), None),
            (
                "POST",
                format!("/v1/shows/{sh}/holds/{token}/extend"),
                Some(json!({"ttlMs": 1000})),
            ),
            ("DELETE", format!("/v1/shows/{sh}/holds/{token}"), None),
            (
                "POST",
                format!("/v1/shows/{sh}/holds/{token}/confirm"),
                None,
            ),
            (
                "PATCH",
                format!("/v1/shows/{sh}/holds/{token}"),
                Some(json!({"add": ["C1"]})),
            ),
            (
                "POST",
                "/v1/holds".to_owned(),
                Some(json!({"seats": [{"show": sh, "seat": "C1"}]})),
            ),
        ] {
            let mut req = s
                .http
                .request(method.parse().expect("method"), format!("{}{p}", s.base))
                .header(
                    "Idempotency-Key",
                    reqwest::header::HeaderValue::from_bytes(bad.as_bytes()).expect("header"),
                );
            if let Some(body) = body {
                req = req.json(&body);
            }
            let resp = req.send().await.expect("request");
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.expect("json");
            assert_eq!(status, 400, "{method} {p} key {bad:?}: {body}");
            assert_eq!(body["error"], "invalid_idempotency_key", "{body}");
        }
    }
    assert_eq!(seat_state(&s, &sh, "C1").await["state"], "free");
    let (status, read) = s.get(&format!("/v1/shows/{sh}/holds/{token}")).await;
    assert_eq!(status, 200, "the hold survived every refused request");
    assert!(read["expiresInMs"].as_i64().expect("expiresInMs") > 200_000);
    // 255 characters of the alphabet are fine.
    let r = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/seats/C1/hold"),
        None,
        Some(&longest),
    )
    .await;
    assert_eq!(r.status, 201, "{r:?}");
}

/// Failures are not recorded: a hold refused 409 under a key runs again
/// when retried with that key, and gets the seat once it is free.
#[tokio::test]
async fn failures_are_not_recorded() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("failure");
    let alice = s.hold(&sh, &["F1"]).await;
    let key = idem_key("failure");
    let path = format!("/v1/shows/{sh}/holds");
    let body = json!({"seats": ["F2", "F1"]});
    let refused = send(&s, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.body["error"], "seats_taken");
    assert_eq!(get_opt(&keys().idempotency(&sh, &key)).await, None);
    let again = send(&s, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (409, false), "{again:?}");

    let gone = send(
        &s,
        "DELETE",
        &format!("/v1/shows/{sh}/holds/{}", token_of(&alice)),
        None,
        None,
    )
    .await;
    assert_eq!(gone.status, 204);
    let granted = send(&s, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!(
        (granted.status, granted.replayed),
        (201, false),
        "{granted:?}"
    );
    let replay = send(&s, "POST", &path, Some(body), Some(&key)).await;
    assert_eq!((replay.status, replay.replayed), (201, true), "{replay:?}");
    assert_eq!(replay.body["holdToken"], granted.body["holdToken"]);

    // A 404 under a key is not recorded either.
    let ghost = format!("/v1/shows/{sh}/holds/{}", uuid::Uuid::new_v4());
    let rkey = idem_key("failure-404");
    for _ in 0..2 {
        let r = send(&s, "DELETE", &ghost, None, Some(&rkey)).await;
        assert_eq!((r.status, r.replayed), (404, false), "{r:?}");
    }
    assert_eq!(get_opt(&keys().idempotency(&sh, &rkey)).await, None);
}

/// `POST /v1/holds` under a key: a retry answers the same hold, marked
/// replayed, and writes nothing; the record lives under the home show (the
/// first seat's), so the same key is free for a hold whose first seat is
/// of the other show; another request under the key is 422.
#[tokio::test]
async fn multi_show_hold_replays_under_its_home_show() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let a = show("multi-key");
    let ks = keys();
    let slot = ks.show_slot(&a);
    let b = (0..400_000)
        .map(|i| format!("{a}-{i}"))
        .find(|b| ks.show_slot(b) == slot)
        .expect("a show in the same slot");
    let key = idem_key("multi");
    let body =
        json!({"seats": [{"show": a, "seat": "E1"}, {"show": b, "seat": "E1"}], "ttlMs": 60000});
    let first = send(&s, "POST", "/v1/holds", Some(body.clone()), Some(&key)).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    assert_eq!(first.body["show"], json!(a), "{first:?}");
    assert!(get_opt(&ks.idempotency(&a, &key)).await.is_some());
    assert_eq!(get_opt(&ks.idempotency(&b, &key)).await, None);

    let events_before = events_of(&a, "held").await + events_of(&b, "held").await;
    let again = send(&s, "POST", "/v1/holds", Some(body), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    for field in ["holdToken", "fence", "seats", "show"] {
        assert_eq!(again.body[field], first.body[field], "{field}");
    }
    let left = again.body["expiresInMs"].as_i64().expect("expiresInMs");
    assert!((1..=60_000).contains(&left), "{again:?}");
    assert_eq!(
        events_of(&a, "held").await + events_of(&b, "held").await,
        events_before,
        "a replay writes no event"
    );

    // Another request under the key, home show a: 422, nothing held.
    let other = send(
        &s,
        "POST",
        "/v1/holds",
        Some(json!({"seats": [{"show": a, "seat": "E2"}, {"show": b, "seat": "E2"}]})),
        Some(&key),
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.body["error"], "idempotency_key_reused");
    assert_eq!(seat_state(&s, &a, "E2").await["state"], "free");
    assert_eq!(seat_state(&s, &b, "E2").await["state"], "free");

    // Home show b: another scope, a fresh hold.
    let scoped = send(
        &s,
        "POST",
        "/v1/holds",
        Some(json!({"seats": [{"show": b, "seat": "E3"}, {"show": a, "seat": "E3"}]})),
        Some(&key),
    )
    .await;
    assert_eq!((scoped.status, scoped.replayed), (201, false), "{scoped:?}");
    assert_ne!(scoped.body["holdToken"], first.body["holdToken"]);
}

/// Two daemons on one cluster share the records: the second answers the
/// first one's outcome, and refuses another request under the key.
#[tokio::test]
async fn two_daemons_share_idempotency_records() {
    let _r = EXCLUSIVE.read().await;
    let a = server_with(options()).await;
    let b = server_with(options()).await;
    let sh = show("two");
    let key = idem_key("two");
    let path = format!("/v1/shows/{sh}/holds");
    let body = json!({"seats": ["D1", "D2"]});
    let first = send(&a, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let again = send(&b, "POST", &path, Some(body.clone()), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    for field in ["holdToken", "fence", "seats", "show"] {
        assert_eq!(again.body[field], first.body[field], "{field}");
    }
    let other = send(
        &b,
        "POST",
        &path,
        Some(json!({"seats": ["D3"]})),
        Some(&key),
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.body["error"], "idempotency_key_reused");
    assert_eq!(seat_state(&a, &sh, "D3").await["state"], "free");

    // A release through A, replayed through B.
    let token = token_of(&first.body);
    let rkey = idem_key("two-release");
    let rel = format!("/v1/shows/{sh}/holds/{token}");
    let r1 = send(&a, "DELETE", &rel, None, Some(&rkey)).await;
    assert_eq!((r1.status, r1.replayed), (204, false), "{r1:?}");
    let r2 = send(&b, "DELETE", &rel, None, Some(&rkey)).await;
    assert_eq!((r2.status, r2.replayed), (204, true), "{r2:?}");
}

/// An extend replayed answers 200 with the hold's current remaining time,
/// not the one recorded, and does not extend again.
#[tokio::test]
async fn extend_replay_answers_current_expiry() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("extend");
    let hold = s.hold(&sh, &["E1"]).await;
    let token = token_of(&hold);
    let path = format!("/v1/shows/{sh}/holds/{token}/extend");
    let key = idem_key("extend");
    let first = send(&s, "POST", &path, Some(json!({"ttlMs": 60000})), Some(&key)).await;
    assert_eq!((first.status, first.replayed), (200, false), "{first:?}");
    assert_eq!(first.body["fence"], hold["fence"]);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let again = send(&s, "POST", &path, Some(json!({"ttlMs": 60000})), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(again.body["fence"], hold["fence"]);
    assert_eq!(again.body["holdToken"], json!(token));
    assert_eq!(again.body["seats"], json!(["E1"]));
    let remaining = again.body["expiresInMs"].as_i64().expect("expiresInMs");
    assert!(
        remaining < 59_950 && remaining > 50_000,
        "the replay did not extend again: {remaining}"
    );

    // Extended to 120 s without a key; the replay tells the current time.
    let plain = send(&s, "POST", &path, Some(json!({"ttlMs": 120000})), None).await;
    assert_eq!(plain.status, 200, "{plain:?}");
    let again = send(&s, "POST", &path, Some(json!({"ttlMs": 60000})), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    let remaining = again.body["expiresInMs"].as_i64().expect("expiresInMs");
    assert!(
        remaining > 110_000,
        "expiresInMs is current, not the recorded 60 s: {remaining}"
    );
    let seat_ttl = pttl(&keys().seat(&sh, "E1")).await;
    assert!(
        seat_ttl > 110_000,
        "the replay left the seat's TTL: {seat_ttl}"
    );

    // After the hold is gone the replay still answers its recorded outcome.
    let gone = send(
        &s,
        "DELETE",
        &format!("/v1/shows/{sh}/holds/{token}"),
        None,
        None,
    )
    .await;
    assert_eq!(gone.status, 204);
    let again = send(&s, "POST", &path, Some(json!({"ttlMs": 60000})), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(again.body["fence"], hold["fence"]);
    assert_eq!(again.body["seats"], json!(["E1"]));
    assert_eq!(seat_state(&s, &sh, "E1").await["state"], "free");
}

/// Two copies of one extend sent at once with the same key (a client that
/// retried before its first try answered): both answer 200 with the new
/// remaining time. The copy that loses the race learns of the other from
/// the script's replay; it answered the remaining time it had read before
/// the script ran (here 20 s instead of 300 s).
#[tokio::test]
async fn concurrent_twins_of_an_extend_answer_the_new_expiry() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("twins");
    let mut replays = 0;
    for i in 0..12 {
        let made = send(
            &s,
            "POST",
            &format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": [format!("T{i}")], "ttlMs": 20_000})),
            None,
        )
        .await;
        assert_eq!(made.status, 201, "{made:?}");
        let path = format!("/v1/shows/{sh}/holds/{}/extend", token_of(&made.body));
        let key = idem_key("twins");
        let body = json!({"ttlMs": 300_000});
        let (a, b) = tokio::join!(
            send(&s, "POST", &path, Some(body.clone()), Some(&key)),
            send(&s, "POST", &path, Some(body.clone()), Some(&key)),
        );
        for r in [&a, &b] {
            assert_eq!(r.status, 200, "{r:?}");
            let left = r.body["expiresInMs"].as_i64().expect("expiresInMs");
            assert!(
                (290_000..=300_000).contains(&left),
                "a twin answered {left} ms left: {r:?}"
            );
        }
        replays += usize::from(a.replayed) + usize::from(b.replayed);
    }
    eprintln!("12 pairs of twins: {replays} replays");
    assert!(replays >= 12, "every pair has one replay: {replays}");
}

/// A release replayed answers 204 again, marked, also after the hold is
/// gone; without the key the same DELETE is 404.
#[tokio::test]
async fn release_replay_answers_204_after_the_hold_is_gone() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("release");
    let hold = s.hold(&sh, &["R1", "R2"]).await;
    let path = format!("/v1/shows/{sh}/holds/{}", token_of(&hold));
    let key = idem_key("release");
    let first = send(&s, "DELETE", &path, None, Some(&key)).await;
    assert_eq!((first.status, first.replayed), (204, false), "{first:?}");
    for _ in 0..2 {
        let again = send(&s, "DELETE", &path, None, Some(&key)).await;
        assert_eq!((again.status, again.replayed), (204, true), "{again:?}");
        assert_eq!(again.body, Value::Null);
    }
    let plain = send(&s, "DELETE", &path, None, None).await;
    assert_eq!(plain.status, 404, "{plain:?}");
    // Someone else holds R1 now: the replay does not release it.
    let bob = s.hold(&sh, &["R1"]).await;
    let again = send(&s, "DELETE", &path, None, Some(&key)).await;
    assert_eq!((again.status, again.replayed), (204, true), "{again:?}");
    assert_eq!(
        get_opt(&keys().seat(&sh, "R1")).await.as_deref(),
        Some(token_of(&bob).as_str()),
        "Bob's hold is untouched"
    );
}

/// A confirm replayed answers 200 again with the same body, marked.
#[tokio::test]
async fn confirm_replay_answers_200() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("confirm");
    let hold = s.hold(&sh, &["C1", "C2"]).await;
    let path = format!("/v1/shows/{sh}/holds/{}/confirm", token_of(&hold));
    let key = idem_key("confirm");
    let first = send(&s, "POST", &path, None, Some(&key)).await;
    assert_eq!((first.status, first.replayed), (200, false), "{first:?}");
    assert_eq!(first.body["fence"], hold["fence"]);
    let again = send(&s, "POST", &path, None, Some(&key)).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    for field in ["holdToken", "show", "seats", "fence"] {
        assert_eq!(again.body[field], first.body[field], "{field}");
    }
    assert!(again.body["replicas"].as_i64().is_some_and(|n| n >= 1));
    for seat in ["C1", "C2"] {
        assert_eq!(seat_state(&s, &sh, seat).await["state"], "sold");
    }
}

// ---------------------------------------------------------------------
// 3. A release whose reply was lost.
// ---------------------------------------------------------------------

/// release.lua run through a proxy that loses its reply: the release took
/// effect with its record; the same script sent again answers the replay
/// `{-3, "<fingerprint> 204"}` (which the daemon answers 204), and the
/// daemon answers the client's retry with that key 204, marked.
#[tokio::test]
async fn release_script_resent_after_a_lost_reply_answers_the_replay() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("lost");
    let hold = s.hold(&sh, &["L1", "L2"]).await;
    let token = token_of(&hold);
    let master = master_of(&sh).await;
    let proxy = Proxy::start(master).await;
    let mut via_proxy = proxy.redis().await;

    // The request the daemon would make for DELETE with this key.
    let path = format!("/v1/shows/{sh}/holds/{token}");
    let client_key = idem_key("lost");
    let idem = Idem::new(
        IdemKey::parse(client_key.as_bytes()).expect("key"),
        "DELETE",
        &path,
        b"",
    );
    let ks = keys();
    let script_keys = vec![
        ks.hold_record(&sh, &token),
        ks.seat(&sh, "L1"),
        ks.seat(&sh, "L2"),
        ks.idempotency(&sh, idem.key.as_str()),
    ];
    let release = Scripts::embedded().release;
    let fence = fence_of(&hold);
    let args = |c: &mut redis::Cmd| {
        // Events off (E, cap, ref), no pools (P), no holder (H), then the
        // fence the lookup read.
        c.arg(&token)
            .arg(&idem.fingerprint)
            .arg(86_400_000)
            .arg(0)
            .arg(0)
            .arg("")
            .arg(0)
            .arg(0)
            .arg(fence);
    };

    proxy.lose_next_reply();
    let lost: redis::RedisResult<RValue> = tokio::time::timeout(
        Duration::from_secs(5),
        release.run(&mut via_proxy, &script_keys, args),
    )
    .await
    .expect("the lost reply ends in an error, not a hang");
    assert!(lost.is_err(), "the reply was lost: {lost:?}");
    tokio::time::timeout(Duration::from_secs(1), proxy.lost.notified())
        .await
        .expect("the proxy swallowed a reply");
    // It took effect.
    for seat in ["L1", "L2"] {
        assert_eq!(get_opt(&ks.seat(&sh, seat)).await, None, "{seat} released");
    }
    assert_eq!(get_opt(&ks.hold_record(&sh, &token)).await, None);

    // Sent again, directly: the replay, naming the first run's outcome.
    let mut direct = common::node(master).await;
    let again: RValue = release
        .run(&mut direct, &script_keys, args)
        .await
        .expect("release.lua again");
    let expected = format!("{} 204", idem.fingerprint);
    assert_eq!(
        again,
        RValue::Array(vec![
            RValue::Int(-3),
            RValue::BulkString(expected.clone().into_bytes())
        ]),
        "the resend answers the replay"
    );
    // The daemon's own kind of key (no client key) behaves the same.
    let internal = Idem::internal();
    let hold2 = s.hold(&sh, &["L3"]).await;
    let token2 = token_of(&hold2);
    let keys2 = vec![
        ks.hold_record(&sh, &token2),
        ks.seat(&sh, "L3"),
        ks.idempotency(&sh, internal.key.as_str()),
    ];
    let fence2 = fence_of(&hold2);
    let args2 = |c: &mut redis::Cmd| {
        c.arg(&token2)
            .arg(&internal.fingerprint)
            .arg(60_000)
            .arg(0)
            .arg(0)
            .arg("")
            .arg(0)
            .arg(0)
            .arg(fence2);
    };
    // The first connection died with its lost reply: a new one.
    let mut via_proxy = proxy.redis().await;
    proxy.lose_next_reply();
    let lost: redis::RedisResult<RValue> = tokio::time::timeout(
        Duration::from_secs(5),
        release.run(&mut via_proxy, &keys2, args2),
    )
    .await
    .expect("no hang");
    assert!(lost.is_err(), "{lost:?}");
    tokio::time::timeout(Duration::from_secs(1), proxy.lost.notified())
        .await
        .expect("the proxy swallowed the second reply");
    let again: RValue = release
        .run(&mut direct, &keys2, args2)
        .await
        .expect("again");
    assert_eq!(
        again,
        RValue::Array(vec![
            RValue::Int(-3),
            RValue::BulkString(b"daemon 204".to_vec())
        ])
    );
    assert_eq!(get_opt(&ks.seat(&sh, "L3")).await, None);

    // The client's retry of the DELETE with its key: 204, marked.
    let retry = send(&s, "DELETE", &path, None, Some(&client_key)).await;
    assert_eq!((retry.status, retry.replayed), (204, true), "{retry:?}");
    let plain = send(&s, "DELETE", &path, None, None).await;
    assert_eq!(plain.status, 404, "without the key it is gone: {plain:?}");
}

/// The events of `show` of one type.
async fn events_of(show: &str, kind: &str) -> usize {
    let mut r = common::redis().await;
    let entries: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg(keys().events(show))
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .expect("XRANGE");
    entries
        .iter()
        .filter(|(_, f)| f.get("t").map(String::as_str) == Some(kind))
        .count()
}

/// Runs `script` through a proxy that loses its reply, then sends it again
/// directly, as the daemon resends a script whose connection broke after
/// sending; answers the second run's reply.
async fn run_twice_losing_the_first_reply(
    master: u16,
    script: &seathold::scripts::Script,
    keys: &[String],
    args: impl Fn(&mut redis::Cmd),
) -> RValue {
    let proxy = Proxy::start(master).await;
    let mut via_proxy = proxy.redis().await;
    proxy.lose_next_reply();
    let lost: redis::RedisResult<RValue> = tokio::time::timeout(
        Duration::from_secs(5),
        script.run(&mut via_proxy, keys, &args),
    )
    .await
    .expect("the lost reply ends in an error, not a hang");
    assert!(lost.is_err(), "the reply was lost: {lost:?}");
    tokio::time::timeout(Duration::from_secs(1), proxy.lost.notified())
        .await
        .expect("the proxy swallowed a reply");
    let mut direct = common::node(master).await;
    script
        .run(&mut direct, keys, &args)
        .await
        .expect("the resend")
}

/// The daemon's own idempotency records (`#idem:~…`) in `show`'s slot.
async fn own_records(show: &str) -> Vec<(String, i64)> {
    let (_, keys_found) = common::keys_in_slot(keys().show_slot(show)).await;
    let prefix = keys().idempotency(show, "~");
    let mut out = Vec::new();
    for k in keys_found.into_iter().filter(|k| k.starts_with(&prefix)) {
        let v = get_opt(&k).await.unwrap_or_default();
        out.push((v, pttl(&k).await));
    }
    out
}

/// extend.lua and modify.lua run under the daemon's own key, as the daemon
/// now runs every extend and PATCH without a client's key, answer a resend
/// after a lost reply with the first run's record and Redis's time
/// (`{-3, record, now}`), and change nothing more: one `extended` and one
/// `modified` event. Without a key a resent extend wrote a second event
/// (and near the lifetime cap answered 422), and a resent PATCH was refused
/// (its first run had changed the hold). A plain extend and PATCH through
/// the daemon leave such a record, kept at most 60 s.
#[tokio::test]
async fn extend_and_modify_resent_after_a_lost_reply_change_once() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("resent");
    let hold = s.hold(&sh, &["X1"]).await;
    let token = token_of(&hold);
    let hold_ref = seathold::ids::HoldToken::parse(&token)
        .expect("token")
        .hold_ref();
    let master = master_of(&sh).await;
    let ks = keys();
    let scripts = Scripts::embedded();
    let own = Idem::internal();

    // extend.lua: events on (E = 1), no pools, no holder.
    let extend_keys = vec![
        ks.hold_record(&sh, &token),
        ks.seat(&sh, "X1"),
        ks.deadlines(&sh),
        ks.events(&sh),
        ks.idempotency(&sh, own.key.as_str()),
    ];
    let extend_args = |c: &mut redis::Cmd| {
        c.arg(&token)
            .arg(200_000)
            .arg(3_600_000)
            .arg(&own.fingerprint)
            .arg(60_000)
            .arg(1)
            .arg(10_000)
            .arg(&hold_ref)
            .arg(0)
            .arg(0)
            .arg("X1")
            .arg(fence_of(&hold));
    };
    let again =
        run_twice_losing_the_first_reply(master, &scripts.extend, &extend_keys, extend_args).await;
    let RValue::Array(again) = again else {
        panic!("extend.lua answered {again:?}");
    };
    match again.as_slice() {
        [RValue::Int(-3), RValue::BulkString(record), RValue::Int(now)] => {
            let record = String::from_utf8_lossy(record);
            assert!(record.starts_with("daemon 200 "), "{record}");
            let at: i64 = record.split(' ').nth(3).expect("at").parse().expect("ms");
            assert!(
                (199_000..=200_000).contains(&(at - now)),
                "{record} at {now}"
            );
        }
        other => panic!("the resend extended again: {other:?}"),
    }
    assert_eq!(events_of(&sh, "extended").await, 1, "one extended event");

    // modify.lua: add X2 to the hold.
    let record = get_opt(&ks.hold_record(&sh, &token)).await.expect("record");
    let fields: Vec<&str> = record.splitn(3, ' ').collect();
    let (fence, tail) = (fields[0].to_owned(), fields[2].to_owned());
    let new_record = format!("{tail} {sh}/X2");
    let own2 = Idem::internal();
    let modify_keys = vec![
        ks.hold_record(&sh, &token),
        ks.fence(&sh),
        ks.seat(&sh, "X1"),
        ks.seat(&sh, "X2"),
        ks.deadlines(&sh),
        ks.events(&sh),
        ks.idempotency(&sh, own2.key.as_str()),
    ];
    let modify_args = |c: &mut redis::Cmd| {
        c.arg(&token)
            .arg(&new_record)
            .arg(&hold_ref)
            .arg(&own2.fingerprint)
            .arg(60_000)
            .arg(1) // K
            .arg(0) // R
            .arg(1) // A
            .arg(0) // U
            .arg(0) // H
            .arg(0)
            .arg(1) // E
            .arg(10_000)
            .arg("X1")
            .arg("X1 X2")
            .arg(1)
            .arg(2)
            .arg(&fence);
    };
    let again =
        run_twice_losing_the_first_reply(master, &scripts.modify, &modify_keys, modify_args).await;
    let RValue::Array(again) = again else {
        panic!("modify.lua answered {again:?}");
    };
    assert!(
        matches!(again.as_slice(), [RValue::Int(-3), RValue::BulkString(r), RValue::Int(_)] if r.starts_with(b"daemon 200 ")),
        "the resend changed the hold again or was refused: {again:?}"
    );
    assert_eq!(events_of(&sh, "modified").await, 1, "one modified event");
    let (status, seats) = s.get(&format!("/v1/shows/{sh}/holds/{token}")).await;
    assert_eq!(status, 200, "{seats}");
    assert_eq!(seats["seats"], json!(["X1", "X2"]));

    // Through the daemon without a key: its own records.
    let before = own_records(&sh).await.len();
    let extended = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/holds/{token}/extend"),
        Some(json!({"ttlMs": 100_000})),
        None,
    )
    .await;
    assert_eq!(
        (extended.status, extended.replayed),
        (200, false),
        "{extended:?}"
    );
    let patched = send(
        &s,
        "PATCH",
        &format!("/v1/shows/{sh}/holds/{token}"),
        Some(json!({"remove": ["X2"]})),
        None,
    )
    .await;
    assert_eq!(
        (patched.status, patched.replayed),
        (200, false),
        "{patched:?}"
    );
    let records = own_records(&sh).await;
    assert_eq!(records.len(), before + 2, "{records:?}");
    for (record, ttl) in &records {
        assert!(record.starts_with("daemon 200 "), "{record}");
        assert!(*ttl > 0 && *ttl <= 60_000, "{record}: PTTL {ttl}");
    }
}

/// At HTTP level: a DELETE whose 204 was lost on the way back (the daemon
/// answered, the client's connection dropped) and resent by the client
/// with the same key answers 204.
#[tokio::test]
async fn delete_resent_after_a_lost_http_reply_answers_204() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("lost-http");
    let hold = s.hold(&sh, &["H1"]).await;
    let token = token_of(&hold);
    let path = format!("/v1/shows/{sh}/holds/{token}");
    let key = idem_key("lost-http");
    let proxy = Proxy::start(s.addr.port()).await;

    proxy.lose_next_reply();
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port))
        .await
        .expect("connect to the proxy");
    conn.write_all(
        format!(
            "DELETE {path} HTTP/1.1\r\nHost: seathold\r\nIdempotency-Key: {key}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("send the DELETE");
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut got))
        .await
        .expect("the proxy closes the connection");
    assert!(got.is_empty(), "the reply was lost: {got:?}");
    tokio::time::timeout(Duration::from_secs(1), proxy.lost.notified())
        .await
        .expect("the daemon answered and the proxy swallowed it");
    assert_eq!(
        get_opt(&keys().seat(&sh, "H1")).await,
        None,
        "the release took effect"
    );

    let retry = send(&s, "DELETE", &path, None, Some(&key)).await;
    assert_eq!((retry.status, retry.replayed), (204, true), "{retry:?}");
    let plain = send(&s, "DELETE", &path, None, None).await;
    assert_eq!(plain.status, 404, "{plain:?}");
}

// ---------------------------------------------------------------------
// 4. Fences across a failover that loses writes.
// ---------------------------------------------------------------------

/// `GET key` on one node, replica or master (`READONLY` first).
async fn node_get(port: u16, key: &str) -> Option<String> {
    let mut c = common::node(port).await;
    let () = redis::cmd("READONLY")
        .query_async(&mut c)
        .await
        .expect("READONLY");
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("GET on the node")
}

/// The replica of the master on `master` (from its INFO replication).
async fn replica_of(master: u16) -> u16 {
    let info = info(master, "replication").await;
    let line = info
        .iter()
        .find(|(k, _)| k.starts_with("slave"))
        .map(|(_, v)| v.clone())
        .expect("the master has a replica");
    line.split(',')
        .find_map(|kv| kv.strip_prefix("port="))
        .and_then(|p| p.parse().ok())
        .expect("the replica's port")
}

/// Puts the cluster back should the test fail half-way: the replica
/// resumed, the killed master restarted.
struct Restore {
    replica: u16,
    master: u16,
    armed: bool,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let _ = cluster().resume(self.replica);
        let master = self.master;
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let _ = cluster().restart(master).await;
                let _ = cluster().wait_until_ok(Duration::from_secs(30)).await;
            });
        })
        .join();
    }
}

/// A show's fence strictly increases across a failover that lost the last
/// holds (and the fence counter with them): the replica stopped before
/// those holds, the master killed, the replica promoted.
#[tokio::test]
async fn fence_never_repeats_across_a_failover_that_loses_writes() {
    let _x = EXCLUSIVE.write().await;
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("a healthy cluster to start from");
    let s = server_with(options()).await;
    let sh = show("failover");
    let slot = keys().show_slot(&sh);
    let master = master_of(&sh).await;
    let replica = replica_of(master).await;
    let mut fences = vec![fence_of(&s.hold(&sh, &["F0"]).await)];
    // The replica has F0 before it stops.
    common::eventually(Duration::from_secs(5), "the replica to have F0", || async {
        node_get(replica, &keys().seat(&sh, "F0")).await.is_some()
    })
    .await;

    // A live seat map of the show, subscribed before the holds that the
    // failover will lose.
    let gaps = s.metric("seathold_event_reader_gaps_total").await;
    let mut stream = s.events_stream(&sh, None).await;
    assert_eq!(stream.status(), 200);
    let (seen_tx, mut seen) = tokio::sync::watch::channel(String::new());
    let subscriber = tokio::spawn(async move {
        while let Ok(Some(chunk)) = stream.chunk().await {
            seen_tx.send_modify(|text| text.push_str(&String::from_utf8_lossy(&chunk)));
        }
    });

    let mut restore = Restore {
        replica,
        master,
        armed: true,
    };
    // SIGSTOP alone loses nothing: the kernel keeps buffering the
    // replication stream for the stopped replica, which reads it all when
    // it resumes. So the master also drops the link: what it writes from
    // now on reaches no replica.
    cluster().pause(replica).expect("SIGSTOP the replica");
    let mut m = common::node(master).await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut m)
        .await
        .expect("CLIENT KILL TYPE replica");
    assert_eq!(killed, 1, "the master dropped its replica's link");
    for i in 1..=5 {
        fences.push(fence_of(&s.hold(&sh, &[&format!("F{i}")]).await));
    }
    let last = *fences.iter().max().expect("fences");
    let last_id = format!("{}-{}", last / 1000, last % 1000);
    tokio::time::timeout(
        Duration::from_secs(5),
        seen.wait_for(|text| text.contains(&format!("id: {last_id}\n"))),
    )
    .await
    .expect("the subscriber saw the last hold's event")
    .expect("subscriber");
    cluster().kill(master).expect("kill -9 the master");
    cluster().resume(replica).expect("SIGCONT the replica");

    // Redis promotes the replica by itself; if it will not, take over.
    let promoted = async {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(15) {
            if cluster().master_port_for_slot(slot).await.ok() == Some(replica) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
    .await;
    if !promoted {
        eprintln!("failover: no election; CLUSTER FAILOVER TAKEOVER on the replica");
        let mut c = common::node(replica).await;
        let () = redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .arg("TAKEOVER")
            .query_async(&mut c)
            .await
            .expect("CLUSTER FAILOVER TAKEOVER");
    }
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("the replica promoted");
    assert_eq!(master_of(&sh).await, replica);

    // The holds after the stop were lost, their `held` events (whose ids
    // gave their fences) with them.
    let mut r = common::node(replica).await;
    let newest: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
        .arg(keys().events(&sh))
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut r)
        .await
        .expect("XREVRANGE");
    let kept = newest
        .first()
        .and_then(|(id, _)| seathold::events::EventId::parse(id))
        .map(|id| id.fence());
    assert!(
        kept.is_some_and(|f| f < last),
        "the promoted replica lost the last events: {kept:?} < {last}"
    );
    let lost = node_get(replica, &keys().seat(&sh, "F5")).await;
    assert_eq!(lost, None, "the last hold was lost in the failover");

    // Holds of the show again: every fence is above every earlier one.
    let mut after = Vec::new();
    for seat in ["F5", "G1", "G2"] {
        let started = Instant::now();
        let hold = loop {
            let r = send(
                &s,
                "POST",
                &format!("/v1/shows/{sh}/seats/{seat}/hold"),
                None,
                None,
            )
            .await;
            if r.status == 201 {
                break r.body;
            }
            assert!(
                r.status == 503 && started.elapsed() < Duration::from_secs(10),
                "a hold on the new master: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        after.push(fence_of(&hold));
    }
    eprintln!("failover: fences before {fences:?}, newest fence on the promoted replica {kept:?}, after {after:?}");
    for f in &after {
        assert!(
            *f > last,
            "fence {f} repeats or goes back: before {fences:?}"
        );
        assert!(*f < JS_SAFE);
    }
    assert!(after.windows(2).all(|w| w[0] < w[1]), "{after:?}");

    // The seat map saw `held` events that the promoted replica never had:
    // its stream ends (the show's reader found its position gone), and its
    // cursor answers 410, so that it reloads the seats instead of showing
    // F1-F5 held forever. Before, the stream went on after the lost ids.
    tokio::time::timeout(Duration::from_secs(10), subscriber)
        .await
        .expect("the subscriber's stream ended after the failover")
        .expect("subscriber");
    assert!(s.metric("seathold_event_reader_gaps_total").await > gaps);
    let r = s.events_stream(&sh, Some(&last_id)).await;
    assert_eq!(r.status().as_u16(), 410, "Last-Event-ID {last_id}");

    restore.armed = false;
    cluster()
        .restart(master)
        .await
        .expect("restart the old master");
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy again");
}

// ---------------------------------------------------------------------
// 5. Fences are JavaScript-safe and follow Redis's clock.
// ---------------------------------------------------------------------

/// A fence is at least Redis `TIME` in ms x 1000 at the hold, below 2^53,
/// strictly increasing per show, and above a counter set ahead of the
/// clock (max(last + 1, time)).
#[tokio::test]
async fn fences_follow_redis_time_and_stay_js_safe() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("fence");
    let master = master_of(&sh).await;

    let t0 = redis_ms(master).await;
    let hold = s.hold(&sh, &["T1"]).await;
    let t1 = redis_ms(master).await;
    let f = fence_of(&hold);
    assert!(
        f >= t0 * 1000 && f <= (t1 + 1) * 1000,
        "fence {f} is Redis's time x 1000 ({t0}..{t1} ms)"
    );
    assert!(f < JS_SAFE, "{f} < 2^53");
    assert_eq!(
        hold["fence"].as_f64().map(|x| x as i64),
        Some(f),
        "a double reads it exactly"
    );

    // Concurrent holds of one show: all different, increasing in order of
    // their records.
    let mut tasks = Vec::new();
    for i in 0..40 {
        let (http, base, sh) = (s.http.clone(), s.base.clone(), sh.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v1/shows/{sh}/seats/P{i}/hold"))
                .send()
                .await
                .expect("hold");
            assert_eq!(r.status().as_u16(), 201);
            r.json::<Value>().await.expect("json")["fence"]
                .as_i64()
                .expect("fence")
        }));
    }
    let mut burst = Vec::new();
    for t in tasks {
        burst.push(t.await.expect("task"));
    }
    let t2 = redis_ms(master).await;
    burst.sort_unstable();
    burst.dedup();
    assert_eq!(burst.len(), 40, "no fence handed out twice");
    assert!(burst[0] > f);
    assert!(*burst.last().expect("last") <= (t2 + 1) * 1000 + 40 && burst[39] < JS_SAFE);

    // A stream ahead of the clock (a master whose clock ran ahead before a
    // failover left its last event there): the next fence is last + 1, not
    // the clock. With events on, a show's stream ids give its fences.
    let ahead = (t2 + 60_000) * 1000;
    let mut r = common::redis().await;
    let _: String = redis::cmd("XADD")
        .arg(keys().events(&sh))
        .arg(format!("{}-0", t2 + 60_000))
        .arg("t")
        .arg("test")
        .query_async(&mut r)
        .await
        .expect("XADD ahead of the clock");
    let next = fence_of(&s.hold(&sh, &["T2"]).await);
    assert_eq!(next, ahead + 1);

    // A multi-show hold exceeds the last fences of both shows, and both
    // shows' later fences exceed it.
    let ks = keys();
    let slot = ks.show_slot(&sh);
    let other = (0..400_000)
        .map(|i| format!("{sh}-{i}"))
        .find(|b| ks.show_slot(b) == slot)
        .expect("a show in the same slot");
    let (status, multi) = s
        .post(
            "/v1/holds",
            json!({"seats": [{"show": other, "seat": "M1"}, {"show": sh, "seat": "M1"}]}),
        )
        .await;
    assert_eq!(status, 201, "{multi}");
    let fm = fence_of(&multi);
    assert_eq!(fm, ahead + 2, "above the higher of both shows' last fences");
    let o = fence_of(&s.hold(&other, &["M2"]).await);
    let n = fence_of(&s.hold(&sh, &["M2"]).await);
    assert!(
        o > fm && n > fm && o < JS_SAFE && n < JS_SAFE,
        "{o} {n} > {fm}"
    );
}

/// A hold with a key whose script ran but whose reply was lost with
/// seathold's own connection: seathold sends the script again (over the
/// cluster connection), and the resend finds the first run's idempotency
/// record. That record names this very request's token (a client's own
/// repeat would have made a new one), so the answer is the first run's:
/// 201 without `Idempotent-Replayed`, and the hold is counted. Before,
/// the client's only request was answered as a replay and never counted.
///
/// The master is kept busy for 400 ms by a script of this test; meanwhile
/// the hold's script arrives, and then the kill of every connection the
/// daemon has to that master. Redis runs them in that order once free,
/// and the kill drops the hold's reply before it is written. Whether the
/// hold's first run came before the kill is read from the master's count
/// of `EVALSHA`s (two runs); the attempts where it did not prove nothing
/// and are repeated, up to 6.
#[tokio::test]
async fn hold_resent_by_the_daemon_after_a_lost_reply_is_not_a_replay() {
    let _x = EXCLUSIVE.write().await;
    let s = server_with(options()).await;
    s.wait_direct(Duration::from_secs(10)).await;
    let mut proved = 0;
    for attempt in 0..6 {
        let sh = show("resent");
        let master = master_of(&sh).await;
        s.hold(&sh, &["W0"]).await;
        let mut blocker = common::node(master).await;
        let mut killer = common::node(master).await;
        let ours: Vec<i64> = vec![
            redis::cmd("CLIENT")
                .arg("ID")
                .query_async(&mut blocker)
                .await
                .expect("CLIENT ID"),
            redis::cmd("CLIENT")
                .arg("ID")
                .query_async(&mut killer)
                .await
                .expect("CLIENT ID"),
        ];
        // The daemon's connections to the master (not the replica's link).
        let theirs: Vec<i64> = common::client_list(master)
            .await
            .iter()
            .filter(|c| c.get("flags").is_some_and(|f| f == "N"))
            .filter_map(|c| c.get("id")?.parse().ok())
            .filter(|id| !ours.contains(id))
            .collect();
        let holds0 = s.metric("seathold_holds_total").await;
        let evalsha0 = calls(master).await.get("evalsha").copied().unwrap_or(0);
        let busy = tokio::spawn(async move {
            let _: RValue = redis::cmd("EVAL")
                .arg(
                    "local t = redis.call('TIME') local s = t[1] * 1e6 + t[2] \
                     repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 400000 return 1",
                )
                .arg(0)
                .query_async(&mut blocker)
                .await
                .unwrap_or(RValue::Nil);
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let key = idem_key("resent");
        let path = format!("/v1/shows/{sh}/seats/R1/hold");
        let kill = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut pipe = redis::pipe();
            for id in &theirs {
                pipe.cmd("CLIENT").arg("KILL").arg("ID").arg(*id).ignore();
            }
            let _: RValue = pipe.query_async(&mut killer).await.unwrap_or(RValue::Nil);
        };
        let (reply, ()) = tokio::join!(send(&s, "POST", &path, None, Some(&key)), kill);
        busy.await.expect("busy script");
        assert_eq!(reply.status, 201, "attempt {attempt}: {reply:?}");
        let runs = calls(master).await.get("evalsha").copied().unwrap_or(0) - evalsha0;
        if runs < 2 {
            continue;
        }
        proved += 1;
        assert!(
            !reply.replayed,
            "attempt {attempt}: the client's only request answered as a replay: {reply:?}"
        );
        assert_eq!(
            s.metric("seathold_holds_total").await - holds0,
            1.0,
            "attempt {attempt}: the hold is counted once"
        );
        // The client's own repeat is the replay, of the same hold.
        let again = send(&s, "POST", &path, None, Some(&key)).await;
        assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
        assert_eq!(token_of(&again.body), token_of(&reply.body));
        break;
    }
    assert!(
        proved > 0,
        "no attempt ran the hold's script before the kill"
    );
}

/// A resend whose path spells the same ids with other percent-encoding
/// (`/v1/shows/4%32` for show `42`, as a proxy or client library may
/// normalise a retry) is the same request: it replays. Before, the
/// fingerprint hashed the path as sent, so the resend answered 422
/// `idempotency_key_reused`.
#[tokio::test]
async fn a_resend_with_the_path_encoded_differently_replays() {
    let _x = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("encoded");
    let key = idem_key("encoded");
    let body = json!({"seats": ["E7"]});
    let first = send(
        &s,
        "POST",
        &format!("/v1/shows/{sh}/holds"),
        Some(body.clone()),
        Some(&key),
    )
    .await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // Every character of the show id percent-encoded.
    let encoded: String = sh.bytes().map(|b| format!("%{b:02X}")).collect();
    let again = send(
        &s,
        "POST",
        &format!("/v1/shows/{encoded}/holds"),
        Some(body),
        Some(&key),
    )
    .await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert!(again.replayed, "the resend is answered from the record");
    assert_eq!(token_of(&again.body), token_of(&first.body));
    // Seat ids and tokens are path ids too.
    let token = token_of(&first.body);
    let release_key = idem_key("encoded-release");
    let released = send(
        &s,
        "DELETE",
        &format!("/v1/shows/{sh}/holds/{token}"),
        None,
        Some(&release_key),
    )
    .await;
    assert_eq!(released.status, 204);
    let encoded_token = token.replace('-', "%2D");
    let again = send(
        &s,
        "DELETE",
        &format!("/v1/shows/{encoded}/holds/{encoded_token}"),
        None,
        Some(&release_key),
    )
    .await;
    assert_eq!(again.status, 204, "{:?}", again.body);
    assert!(again.replayed);
}

/// A PATCH that runs between another change's lookup of the hold and its
/// script (both queued behind a write pause of the master) is not half
/// undone: the confirm sells the seat the PATCH added, the release frees
/// it, the extend moves it. Each script checks the fence its lookup read,
/// as modify.lua does, and the daemon looks again when it changed. Two
/// instances, as behind a load balancer: one daemon's requests to a node
/// share a connection, which the pause holds in order. Before,
/// they acted on the seats they had looked up: E9 stayed held by a token
/// whose record was gone (confirm, release), or kept its old expiry while
/// the rest of the hold moved (extend).
#[tokio::test]
async fn a_change_racing_a_patch_acts_on_the_hold_as_patched() {
    let _x = EXCLUSIVE.write().await;
    let slow = || Options {
        redis_timeout_ms: 3_000,
        ..options()
    };
    let s = server_with(slow()).await;
    let other = server_with(slow()).await;
    for op in ["confirm", "release", "extend"] {
        let sh = show(&format!("race-{op}"));
        let hold = s.hold(&sh, &["E7"]).await;
        let token = token_of(&hold);
        let master = master_of(&sh).await;
        common::pause_clients(master, 700, "WRITE").await;
        let patch = {
            let (http, base, path) = (
                other.http.clone(),
                other.base.clone(),
                format!("/v1/shows/{sh}/holds/{token}"),
            );
            tokio::spawn(async move {
                common::request_at(
                    &http,
                    &base,
                    "PATCH",
                    &path,
                    Some(json!({"add": ["E9"]})),
                    None,
                )
                .await
                .status()
                .as_u16()
            })
        };
        // The change goes once the PATCH's script waits on the paused master
        // (a blocked client running a script): its script runs first.
        common::eventually(
            Duration::from_secs(1),
            "the PATCH's script waiting on the paused master",
            || async {
                common::client_list(master).await.iter().any(|c| {
                    c.get("cmd")
                        .is_some_and(|cmd| cmd == "evalsha" || cmd == "eval")
                        && c.get("flags").is_some_and(|f| f.contains('b'))
                })
            },
        )
        .await;
        let change = match op {
            "confirm" => {
                send(
                    &s,
                    "POST",
                    &format!("/v1/shows/{sh}/holds/{token}/confirm"),
                    None,
                    None,
                )
                .await
            }
            "release" => {
                send(
                    &s,
                    "DELETE",
                    &format!("/v1/shows/{sh}/holds/{token}"),
                    None,
                    None,
                )
                .await
            }
            _ => {
                send(
                    &s,
                    "POST",
                    &format!("/v1/shows/{sh}/holds/{token}/extend"),
                    Some(json!({"ttlMs": 900_000})),
                    None,
                )
                .await
            }
        };
        assert_eq!(patch.await.expect("PATCH"), 200, "{op}: the PATCH");
        let seat = |name: &str| keys().seat(&sh, name);
        if op != "release" {
            assert_eq!(change.status, 200, "{op}: {change:?}");
            assert_eq!(
                change.body["seats"],
                json!(["E7", "E9"]),
                "{op}: {change:?}"
            );
        }
        match op {
            "confirm" => {
                for name in ["E7", "E9"] {
                    assert_eq!(
                        get_opt(&seat(name)).await,
                        Some(format!("sold:{token}")),
                        "{op}: {name} sold"
                    );
                }
                let again = send(
                    &s,
                    "POST",
                    &format!("/v1/shows/{sh}/holds/{token}/confirm"),
                    None,
                    None,
                )
                .await;
                assert_eq!(again.status, 200, "{op}: confirmed again: {again:?}");
            }
            "release" => {
                assert_eq!(change.status, 204, "{op}: {change:?}");
                for name in ["E7", "E9"] {
                    assert_eq!(get_opt(&seat(name)).await, None, "{op}: {name} free");
                }
            }
            _ => {
                for name in ["E7", "E9"] {
                    let left = pttl(&seat(name)).await;
                    assert!(left > 800_000, "{op}: {name} extended ({left} ms left)");
                }
            }
        }
    }
}

/// Sends `method path` with `body` as raw bytes (JSON when not empty) and
/// every key in `keys` as an `Idempotency-Key` header of its own.
async fn send_raw(s: &TestServer, method: &str, path: &str, body: &str, keys: &[&str]) -> Reply {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = s.http.request(method, format!("{}{path}", s.base));
    if !body.is_empty() {
        req = req
            .header("content-type", "application/json")
            .body(body.to_owned());
    }
    for key in keys {
        req = req.header("Idempotency-Key", *key);
    }
    reply(req.send().await.expect("request")).await
}

/// A client that writes the same request in other words (a number as
/// 60000.0, an absent field as null, no body as `{}`) gets its replay, not
/// 422; a request that differs in value still gets 422.
#[tokio::test]
async fn the_same_request_in_other_words_is_replayed() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("words");
    let path = format!("/v1/shows/{sh}/holds");
    let key = idem_key("words");
    let first = send_raw(
        &s,
        "POST",
        &path,
        r#"{"seats":["A1"],"ttlMs":60000}"#,
        &[&key],
    )
    .await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    for again in [
        r#"{ "ttlMs" : 60000.0 , "seats" : [ "A1" ] }"#,
        r#"{"seats":["A1"],"ttlMs":60000,"holder":null}"#,
        r#"{"seats":["A1"],"ttlMs":6e4}"#,
    ] {
        let r = send_raw(&s, "POST", &path, again, &[&key]).await;
        assert_eq!((r.status, r.replayed), (201, true), "{again}: {r:?}");
        assert_eq!(r.body["holdToken"], first.body["holdToken"], "{again}");
    }
    for other in [r#"{"seats":["A1"],"ttlMs":60001}"#, r#"{"seats":["A1"]}"#] {
        let r = send_raw(&s, "POST", &path, other, &[&key]).await;
        common::assert_error(r.status, &r.body, 422, "idempotency_key_reused");
    }

    // The single-seat route: no body and an empty object are one request.
    let one = format!("/v1/shows/{sh}/seats/A2/hold");
    let key = idem_key("words-one");
    let first = send_raw(&s, "POST", &one, "", &[&key]).await;
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    for again in ["{}", r#"{"ttlMs":null}"#, ""] {
        let r = send_raw(&s, "POST", &one, again, &[&key]).await;
        assert_eq!((r.status, r.replayed), (201, true), "{again:?}: {r:?}");
        assert_eq!(r.body["holdToken"], first.body["holdToken"]);
    }
    // And so for a confirm.
    let token = token_of(&first.body);
    let confirm = format!("/v1/shows/{sh}/holds/{token}/confirm");
    let key = idem_key("words-confirm");
    let first = send_raw(&s, "POST", &confirm, "", &[&key]).await;
    assert_eq!((first.status, first.replayed), (200, false), "{first:?}");
    let again = send_raw(&s, "POST", &confirm, "{}", &[&key]).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
}

/// Two `Idempotency-Key` headers are one too many: 400 before anything is
/// written, not a request recorded under the first.
#[tokio::test]
async fn two_idempotency_keys_are_refused() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("two-keys");
    let (a, b) = (idem_key("two-a"), idem_key("two-b"));
    for (path, body) in [
        (format!("/v1/shows/{sh}/holds"), r#"{"seats":["K9"]}"#),
        (format!("/v1/shows/{sh}/seats/K9/hold"), ""),
    ] {
        let r = send_raw(&s, "POST", &path, body, &[&a, &b]).await;
        common::assert_error(r.status, &r.body, 400, "invalid_idempotency_key");
        assert_eq!(seat_state(&s, &sh, "K9").await["state"], "free", "{path}");
    }
    for key in [&a, &b] {
        let r = send_raw(
            &s,
            "POST",
            &format!("/v1/shows/{sh}/holds"),
            r#"{"seats":["K9"]}"#,
            &[key],
        )
        .await;
        assert_eq!(
            (r.status, r.replayed),
            (201, false),
            "{key} was never used: {r:?}"
        );
        let token = token_of(&r.body);
        let gone = send(
            &s,
            "DELETE",
            &format!("/v1/shows/{sh}/holds/{token}"),
            None,
            None,
        )
        .await;
        assert_eq!(gone.status, 204);
    }
}

/// A replay of a hold, extend or change whose hold is gone (released here)
/// says it has no time left: not the recorded expiry counted down, which
/// told a client that retried that it still held seats now free.
#[tokio::test]
async fn a_replay_of_a_gone_hold_has_no_time_left() {
    let _r = EXCLUSIVE.read().await;
    let s = server_with(options()).await;
    let sh = show("gone-replay");
    let hold = (
        "POST",
        format!("/v1/shows/{sh}/holds"),
        Some(json!({"seats": ["A1"], "ttlMs": 300000})),
    );
    let key = idem_key("gone-hold");
    let made = send(&s, hold.0, &hold.1, hold.2.clone(), Some(&key)).await;
    assert_eq!(made.status, 201, "{made:?}");
    let token = token_of(&made.body);
    let changes = [
        (
            idem_key("gone-extend"),
            "POST",
            format!("/v1/shows/{sh}/holds/{token}/extend"),
            Some(json!({"ttlMs": 300000})),
        ),
        (
            idem_key("gone-patch"),
            "PATCH",
            format!("/v1/shows/{sh}/holds/{token}"),
            Some(json!({"add": ["A2"]})),
        ),
    ];
    for (k, method, path, body) in &changes {
        let r = send(&s, method, path, body.clone(), Some(k)).await;
        assert_eq!(
            (r.status, r.replayed),
            (200, false),
            "{method} {path}: {r:?}"
        );
    }
    // While the hold lives, a replay tells its time left.
    let again = send(&s, hold.0, &hold.1, hold.2.clone(), Some(&key)).await;
    assert_eq!((again.status, again.replayed), (201, true), "{again:?}");
    assert!(again.body["expiresInMs"].as_i64().expect("expiresInMs") > 200_000);

    let gone = send(
        &s,
        "DELETE",
        &format!("/v1/shows/{sh}/holds/{token}"),
        None,
        None,
    )
    .await;
    assert_eq!(gone.status, 204, "{gone:?}");
    let mut replays = vec![(key, hold.0, hold.1, hold.2, 201)];
    replays.extend(changes.into_iter().map(|(k, m, p, b)| (k, m, p, b, 200)));
    for (k, method, path, body, status) in replays {
        let r = send(&s, method, &path, body, Some(&k)).await;
        assert_eq!(
            (r.status, r.replayed),
            (status, true),
            "{method} {path}: {r:?}"
        );
        assert_eq!(r.body["holdToken"], json!(token), "{r:?}");
        assert_eq!(r.body["expiresInMs"], json!(0), "{method} {path}: {r:?}");
    }
}

/// A confirm answered 503 removes the record it made under its key, so
/// that the retry runs again, but never the record of another request
/// under the same key (before, a plain DEL removed whatever was there, and
/// the other request's retry would have run twice).
#[tokio::test]
async fn a_failed_confirm_forgets_only_its_own_record() {
    let _r = EXCLUSIVE.read().await;
    let sh = show("forget");
    let record = vec![keys().idempotency(&sh, "k1")];
    let mut conn = common::redis().await;
    let forget = Scripts::embedded().forget;
    for (stored, removed) in [
        (Some("other 201 tok 17 99"), false),
        (Some("mine2 200 17"), false),
        (Some("mine 200 17"), true),
        (None, false),
    ] {
        if let Some(stored) = stored {
            let () = conn.set(&record[0], stored).await.expect("SET");
        }
        let answer: i64 = forget
            .run(&mut conn, &record, |c| {
                c.arg("mine");
            })
            .await
            .expect("forget.lua");
        assert_eq!(answer, i64::from(removed), "{stored:?}");
        let left = get_opt(&record[0]).await;
        assert_eq!(
            left.is_none(),
            removed || stored.is_none(),
            "{stored:?}: {left:?}"
        );
    }

    // Through the API: a confirm whose WAIT falls short (3 replicas asked
    // of one) is 503 and leaves no record, so its retry runs again.
    let s = server_with(Options {
        confirm_wait_replicas: 3,
        confirm_wait_timeout_ms: 300,
        ..options()
    })
    .await;
    let token = token_of(&s.hold(&sh, &["F1"]).await);
    let key = idem_key("forget");
    let path = format!("/v1/shows/{sh}/holds/{token}/confirm");
    for attempt in 0..2 {
        let r = send(&s, "POST", &path, None, Some(&key)).await;
        assert_eq!(
            (r.status, r.replayed),
            (503, false),
            "attempt {attempt}: {r:?}"
        );
        assert_eq!(r.body["error"], "not_replicated", "{r:?}");
        assert_eq!(
            get_opt(&keys().idempotency(&sh, &key)).await,
            None,
            "attempt {attempt}"
        );
    }
}

/// A confirm whose `WAIT` loses its connection (the master closes it while
/// the WAIT blocks) made the sale before it: the seat is sold, the answer is
/// 503 `not_replicated` with the sale, as when the WAIT falls short, and
/// the sale is counted, with its `confirmed` event. A retry finds the seat
/// sold, which is not a sale of its own: without this count, no instance
/// counted it. The daemon is a process of its own, so its counters are its
/// requests only.
#[tokio::test]
async fn a_confirm_whose_wait_breaks_is_counted_and_not_replicated() {
    let _r = EXCLUSIVE.read().await;
    // Three replicas asked of one: the WAIT blocks until its timeout.
    let d = common::Daemon::start(&[
        "--confirm-wait-replicas",
        "3",
        "--confirm-wait-timeout-ms",
        "2500",
        "--redis-timeout-ms",
        "5000",
    ])
    .await;
    let http = reqwest::Client::new();
    let sh = show("wait-broken");
    let (status, body) = common::call_at(
        &http,
        &d.base,
        "POST",
        &format!("/v1/shows/{sh}/seats/W1/hold"),
        None,
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let token = token_of(&body);
    let before = common::scrape(&d.metrics().await);
    let (_, master) = common::slot_and_master(&sh).await;
    let path = format!("/v1/shows/{sh}/holds/{token}/confirm");
    let confirm = common::call_at(&http, &d.base, "POST", &path, None);
    let kill = async {
        // The daemon's connection that runs the WAIT (its local port is
        // the client's port in CLIENT LIST): no other test's.
        let limit = Instant::now() + Duration::from_secs(2);
        loop {
            let waiting = common::clients_of(d.pid(), master)
                .await
                .into_iter()
                .find(|c| c.get("cmd").map(String::as_str) == Some("wait"));
            if let Some(c) = waiting {
                let killed: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(&c["id"])
                    .query_async(&mut common::node(master).await)
                    .await
                    .expect("CLIENT KILL");
                assert_eq!(killed, 1);
                return;
            }
            assert!(Instant::now() < limit, "no WAIT of the daemon on {master}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let ((status, body), ()) = tokio::join!(confirm, kill);
    common::assert_error(status, &body, 503, "not_replicated");
    assert_eq!(body["seats"], json!(["W1"]), "{body}");
    assert_eq!(body["replicas"], 0, "{body}");
    let seat = get_opt(&keys().seat(&sh, "W1")).await.expect("the seat");
    assert!(seat.starts_with("sold:"), "{seat}");
    let wanted = [
        ("seathold_confirms_total", 1.0),
        ("seathold_confirms_not_replicated_total", 1.0),
        ("seathold_events_total{type=\"confirmed\"}", 1.0),
    ];
    let after = common::scrape(&d.metrics().await);
    for (series, delta) in wanted {
        let moved =
            after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0);
        assert_eq!(moved, delta, "{series}");
    }
}

/// A client that hangs up while its request waits on Redis takes nothing
/// back: Redis made the release and the sale, so both are counted (the
/// counters and the request histogram), as if the client had stayed. A new
/// hold whose client hung up is abandoned instead, and its request counted
/// in the histogram as 499. The daemon is a process of its own, so its
/// counters are its requests only.
#[tokio::test]
async fn a_client_that_hangs_up_leaves_its_changes_counted() {
    let _x = EXCLUSIVE.write().await;
    let d = common::Daemon::start(&["--confirm-wait-replicas", "0"]).await;
    let http = reqwest::Client::new();
    let sh = show("hangup");
    let mut tokens = Vec::new();
    for seat in ["A1", "A2"] {
        let (status, body) = common::call_at(
            &http,
            &d.base,
            "POST",
            &format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": [seat]})),
        )
        .await;
        assert_eq!(status, 201, "{body}");
        tokens.push(token_of(&body));
    }
    let before = common::scrape(&d.metrics().await);
    let (_, master) = common::slot_and_master(&sh).await;
    pause_writes(master, 1000).await;
    let release = http
        .delete(format!("{}/v1/shows/{sh}/holds/{}", d.base, tokens[0]))
        .timeout(Duration::from_millis(200))
        .send();
    let confirm = http
        .post(format!(
            "{}/v1/shows/{sh}/holds/{}/confirm",
            d.base, tokens[1]
        ))
        .timeout(Duration::from_millis(200))
        .send();
    let hold = http
        .post(format!("{}/v1/shows/{sh}/seats/A3/hold", d.base))
        .timeout(Duration::from_millis(200))
        .send();
    let (release, confirm, hold) = tokio::join!(release, confirm, hold);
    assert!(
        release.is_err() && confirm.is_err() && hold.is_err(),
        "the pause outlived the clients' patience: {release:?} {confirm:?} {hold:?}"
    );

    let route = "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/holds/{token}\",status=\"204\"}";
    let confirm_route = "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/holds/{token}/confirm\",status=\"200\"}";
    // A new hold is not finished for a client that went: it is abandoned
    // (nobody else will learn its token), and its request is in the
    // histogram as 499.
    let gone_route = "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/seats/{seat}/hold\",status=\"499\"}";
    // (series, delta): the abandon writes a `released` event too.
    let wanted = [
        ("seathold_releases_total", 1.0),
        ("seathold_confirms_total", 1.0),
        ("seathold_events_total{type=\"released\"}", 2.0),
        ("seathold_events_total{type=\"confirmed\"}", 1.0),
        (route, 1.0),
        (confirm_route, 1.0),
        (gone_route, 1.0),
        ("seathold_orphan_releases_total", 1.0),
    ];
    let mut moved = Vec::new();
    let limit = Instant::now() + Duration::from_secs(5);
    while Instant::now() < limit {
        let after = common::scrape(&d.metrics().await);
        moved = wanted
            .iter()
            .map(|(s, want)| {
                let d =
                    after.get(*s).copied().unwrap_or(0.0) - before.get(*s).copied().unwrap_or(0.0);
                (*s, d, *want)
            })
            .collect();
        if moved.iter().all(|(_, d, want)| d == want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        moved.iter().all(|(_, d, want)| d == want),
        "(series, moved, wanted): {moved:?}"
    );
    let (_, a1) = common::call_at(
        &http,
        &d.base,
        "GET",
        &format!("/v1/shows/{sh}/seats/A1"),
        None,
    )
    .await;
    let (_, a2) = common::call_at(
        &http,
        &d.base,
        "GET",
        &format!("/v1/shows/{sh}/seats/A2"),
        None,
    )
    .await;
    assert_eq!(
        (a1["state"].as_str(), a2["state"].as_str()),
        (Some("free"), Some("sold"))
    );
    let (_, a3) = common::call_at(
        &http,
        &d.base,
        "GET",
        &format!("/v1/shows/{sh}/seats/A3"),
        None,
    )
    .await;
    assert_eq!(a3["state"], "free", "the hold no client learned of: {a3}");
}
