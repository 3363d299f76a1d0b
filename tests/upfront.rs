//! What is refused before Redis is touched: seathold's slot function against
//! Redis's own `CLUSTER KEYSLOT`, cross-slot multi-seat holds, and invalid
//! requests, each proven not to reach Redis by the masters' `INFO
//! commandstats` (the whole map of every master, not a list of commands)
//! and by the keys of their slots. Tests that count commands take the lock
//! exclusively, so that no other test of this binary sends any command
//! meanwhile; the others take it shared.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{show, CommandStat, TestServer};
use rand::{Rng, SeedableRng};
use seathold::keys::{slot, KeySpace};
use serde_json::{json, Value};

/// What the daemon itself sends in the background, on a timer (its
/// readiness probe, every 500 ms): left out of the comparison, and bounded.
const BACKGROUND: [&str; 2] = ["cluster|slots", "cluster|info"];

/// What Redis sends itself: each replica's `REPLCONF ACK` to its master,
/// once a second. Left out of the comparison: whether one falls inside the
/// measured window is a matter of timing, and it is not seathold's.
const REPLICATION: [&str; 1] = ["replconf"];

/// A server whose background sends nothing but its readiness probe: expiry
/// subscriptions and direct connections up, no keep-alive pings, and
/// events off (each subscription that starts asks the sweeper for a scan of
/// every master, which could land inside a measured window).
async fn quiet_server() -> TestServer {
    let mut opts = common::options();
    opts.expiry_ping_interval_ms = 3_600_000;
    opts.events = seathold::config::Switch::Off;
    let s = common::server_with(opts).await;
    s.wait_metric(
        "seathold_expiry_subscriptions",
        3.0,
        Duration::from_secs(10),
    )
    .await;
    s.wait_direct(Duration::from_secs(10)).await;
    s
}

/// Proof that nothing reached Redis between [`Untouched::begin`] and
/// [`Untouched::check`]: every master's whole `INFO commandstats` moved by
/// exactly what one round of our own probing moves it by (measured just
/// before), apart from the daemon's background probe and Redis's own
/// replication acknowledgements, and the keys of the
/// given slots are the same.
struct Untouched {
    probe_round: BTreeMap<(u16, String), CommandStat>,
    stats: BTreeMap<(u16, String), CommandStat>,
    slots: Vec<(u16, (u64, Vec<String>))>,
    started: Instant,
}

fn without_background(
    mut delta: BTreeMap<(u16, String), CommandStat>,
) -> (BTreeMap<(u16, String), CommandStat>, u64) {
    let mut probes = 0;
    delta.retain(|(_, cmd), stat| {
        let background = BACKGROUND.contains(&cmd.as_str());
        if cmd == BACKGROUND[0] {
            probes += stat[0];
        }
        !background && !REPLICATION.contains(&cmd.as_str())
    });
    (delta, probes)
}

impl Untouched {
    async fn begin(slots: &[u16]) -> Untouched {
        let mut keys = Vec::new();
        for &slot in slots {
            keys.push((slot, common::keys_in_slot(slot).await));
        }
        let first = common::command_stats().await;
        let stats = common::command_stats().await;
        let (probe_round, _) = without_background(common::stats_delta(&first, &stats));
        Untouched {
            probe_round,
            stats,
            slots: keys,
            started: Instant::now(),
        }
    }

    async fn check(self, what: &str) {
        let stats = common::command_stats().await;
        let elapsed = self.started.elapsed();
        let (moved, probes) = without_background(common::stats_delta(&self.stats, &stats));
        assert_eq!(
            moved, self.probe_round,
            "{what} reached Redis: the commands that ran (port, command: [calls, rejected, failed]) \
             differ from one round of the test's own probing"
        );
        let most = elapsed.as_millis() as u64 / 500 + 3 * 2;
        assert!(
            probes <= most,
            "{probes} CLUSTER SLOTS in {elapsed:?}: more than the daemon's readiness probe sends"
        );
        for (slot, before) in self.slots {
            assert_eq!(
                common::keys_in_slot(slot).await,
                before,
                "{what} wrote to slot {slot}"
            );
        }
    }
}

#[tokio::test]
async fn slot_function_equals_cluster_keyslot() {
    let _shared = common::shared().await;
    let port = common::cluster().nodes()[0].port;
    let mut node = common::node(port).await;
    let mut keys: Vec<Vec<u8>> = [
        "",
        "{}",
        "{{a}}",
        "a{}b{c}",
        "{a}{b}",
        "no braces",
        "{",
        "}",
        "}{",
        "a{b",
        "a}b{c}",
        "{a",
        "{}{a}",
        "{{}}",
        "seat-hold:{show:42}:E7",
        "seat-hold:{show:42}#hold:x",
        "foo",
        "123456789",
        "{user1000}.following",
    ]
    .iter()
    .map(|k| k.as_bytes().to_vec())
    .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let alphabet = b"ab{}:-_.0123456789XYZ";
    for i in 0..10_000 {
        let len = rng.random_range(0..24);
        let key: Vec<u8> = if i % 4 == 0 {
            // Arbitrary bytes too: the slot is over bytes, not characters.
            (0..len).map(|_| rng.random::<u8>()).collect()
        } else {
            (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect()
        };
        keys.push(key);
    }
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(key);
    }
    let theirs: Vec<u16> = pipe.query_async(&mut node).await.expect("CLUSTER KEYSLOT");
    assert_eq!(theirs.len(), keys.len());
    let mismatches: Vec<_> = keys
        .iter()
        .zip(&theirs)
        .filter(|(k, &s)| slot(k) != s)
        .map(|(k, s)| (String::from_utf8_lossy(k).into_owned(), *s, slot(k)))
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} mismatches, e.g. {:?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(5)]
    );
}

#[tokio::test]
async fn cross_slot_holds_are_refused_before_redis() {
    let _quiet = common::exclusive().await;
    let s = quiet_server().await;
    let ks = KeySpace::new("seat-hold:");
    let a = show("xa");
    let b = (0..)
        .map(|i| format!("{a}-{i}"))
        .find(|b| ks.show_slot(b) != ks.show_slot(&a))
        .expect("another slot");
    let untouched = Untouched::begin(&[ks.show_slot(&a), ks.show_slot(&b)]).await;
    let (status, body) = s
        .post(
            "/v1/holds",
            json!({"seats": [{"show": a, "seat": "E7"}, {"show": b, "seat": "A1"}, {"show": a, "seat": "E8"}]}),
        )
        .await;
    untouched.check("a cross-slot hold").await;
    common::assert_error(status, &body, 422, "cross_slot");

    // The slots named are Redis's own.
    let mut node = common::node(common::cluster().nodes()[0].port).await;
    let expected: Vec<(String, &str)> =
        vec![(a.clone(), "E7"), (b.clone(), "A1"), (a.clone(), "E8")];
    let slots = body["slots"].as_array().expect("slots");
    assert_eq!(slots.len(), 3);
    for ((show, seat), got) in expected.iter().zip(slots) {
        let key = format!("seat-hold:{{show:{show}}}:{seat}");
        let theirs: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&key)
            .query_async(&mut node)
            .await
            .expect("keyslot");
        assert_eq!(got, &json!({"show": show, "seat": seat, "slot": theirs}));
    }

    let (_, seat) = s.get(&format!("/v1/shows/{a}/seats/E7")).await;
    assert_eq!(seat["state"], "free");
    let metrics = s.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("seathold_cross_slot_rejections_total") && !l.ends_with(" 0")),
        "{metrics}"
    );
}

#[tokio::test]
async fn validation_errors_never_reach_redis() {
    let _quiet = common::exclusive().await;
    let s = quiet_server().await;
    let sh = show("bad");
    let long = "x".repeat(65);
    let many: Vec<String> = (0..21).map(|i| format!("M{i}")).collect();
    let holds = format!("/v1/shows/{sh}/holds");
    let json_cases: Vec<(String, Value, &str)> = vec![
        (
            holds.clone(),
            json!({"seats": ["E7", "E7"]}),
            "duplicate_seat",
        ),
        (holds.clone(), json!({"seats": []}), "invalid_request"),
        (holds.clone(), json!({"seats": many}), "too_many_seats"),
        (
            holds.clone(),
            json!({"seats": ["E7"], "ttlMs": 0}),
            "invalid_ttl",
        ),
        (
            holds.clone(),
            json!({"seats": ["E7"], "ttlMs": -5}),
            "invalid_ttl",
        ),
        (
            holds.clone(),
            json!({"seats": ["E7"], "ttlMs": 1.5}),
            "invalid_ttl",
        ),
        (
            holds.clone(),
            json!({"seats": ["E7"], "ttlMs": "100"}),
            "invalid_ttl",
        ),
        (
            holds.clone(),
            json!({"seats": ["E7"], "ttlMs": 1_800_001}),
            "invalid_ttl",
        ),
        (holds.clone(), json!({"seats": ["E 7"]}), "invalid_seat"),
        (holds.clone(), json!({"seats": ["E{7}"]}), "invalid_seat"),
        (
            holds.clone(),
            json!({"seats": [long.clone()]}),
            "invalid_seat",
        ),
        (holds.clone(), json!({"seats": ["é"]}), "invalid_seat"),
        (holds.clone(), json!({"seats": [""]}), "invalid_seat"),
        (
            holds.clone(),
            json!({"seats": ["E7"], "colour": "red"}),
            "invalid_request",
        ),
        (holds.clone(), json!({"seats": [7]}), "invalid_request"),
        (holds.clone(), json!({"seat": ["E7"]}), "invalid_request"),
        (holds.clone(), json!(["E7"]), "invalid_request"),
        (
            format!("/v1/shows/{long}/holds"),
            json!({"seats": ["E7"]}),
            "invalid_show",
        ),
        (
            "/v1/shows/a:b/holds".into(),
            json!({"seats": ["E7"]}),
            "invalid_show",
        ),
        (
            "/v1/shows/a%7Bb%7D/holds".into(),
            json!({"seats": ["E7"]}),
            "invalid_show",
        ),
        (
            "/v1/shows/%C3%A9/holds".into(),
            json!({"seats": ["E7"]}),
            "invalid_show",
        ),
        (
            format!("/v1/shows/{sh}/seats/E%20/hold"),
            json!({}),
            "invalid_seat",
        ),
        (
            format!("/v1/shows/{sh}/seats/E7/hold"),
            json!({"ttlMs": 0}),
            "invalid_ttl",
        ),
        (
            format!("/v1/shows/{sh}/seats/E7/hold"),
            json!({"ttl": 5}),
            "invalid_request",
        ),
        ("/v1/holds".into(), json!({"seats": []}), "invalid_request"),
        (
            "/v1/holds".into(),
            json!({"seats": [{"show": "a", "seat": "b", "x": 1}]}),
            "invalid_request",
        ),
        (
            "/v1/holds".into(),
            json!({"seats": [{"show": "a/b", "seat": "b"}]}),
            "invalid_show",
        ),
        (
            "/v1/holds".into(),
            json!({"seats": [{"show": "a", "seat": "b"}, {"show": "a", "seat": "b"}]}),
            "duplicate_seat",
        ),
    ];
    let ks = KeySpace::new("seat-hold:");
    let untouched =
        Untouched::begin(&[ks.show_slot(&sh), ks.show_slot("a"), ks.show_slot("42")]).await;
    for (path, body, code) in &json_cases {
        let (status, answer) = s.post(path, body.clone()).await;
        common::assert_error(status, &answer, 400, code);
    }
    let raw = |body: &'static str, ctype: Option<&'static str>| {
        let mut req = s.http.post(format!("{}{holds}", s.base)).body(body);
        if let Some(ctype) = ctype {
            req = req.header("content-type", ctype);
        }
        req
    };
    let cases = [
        (
            raw("{\"seats\":[\"E7\"]", Some("application/json")),
            400,
            "invalid_request",
        ),
        (
            raw("not json", Some("application/json")),
            400,
            "invalid_request",
        ),
        (raw("", Some("application/json")), 400, "invalid_request"),
        (
            raw("{\"seats\":[\"E7\"]}", Some("text/plain")),
            415,
            "unsupported_media_type",
        ),
        (
            raw("{\"seats\":[\"E7\"]}", None),
            415,
            "unsupported_media_type",
        ),
    ];
    for (req, want_status, code) in cases {
        let r = req.send().await.expect("send");
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("json");
        common::assert_error(status, &body, want_status, code);
    }
    // A key given twice inside an object of the body (JSON text, as a
    // `json!` map cannot hold it): before, the last one silently won, so
    // `{"seat":"E7","seat":"E8"}` held E8 alone and `{"floor":1,"floor":5}`
    // five units; a key given twice at the top was already 400.
    let multi = format!("{}/v1/holds", s.base);
    let twice = [
        (
            "POST",
            multi.clone(),
            r#"{"seats":[{"show":"a","seat":"E7","seat":"E8"}]}"#,
        ),
        (
            "POST",
            multi.clone(),
            r#"{"seats":[{"show":"a","pool":"floor","quantity":1,"quantity":5}]}"#,
        ),
        (
            "POST",
            format!("{}{holds}", s.base),
            r#"{"seats":["E7"],"pools":{"floor":1,"floor":5}}"#,
        ),
        (
            "POST",
            format!("{}{holds}", s.base),
            r#"{"seats":["E7"],"ttlMs":1000,"ttlMs":2000}"#,
        ),
        (
            "PATCH",
            format!(
                "{}/v1/shows/{sh}/holds/3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b",
                s.base
            ),
            r#"{"pools":{"floor":1,"floor":2}}"#,
        ),
    ];
    for (method, url, body) in twice {
        let r = s
            .http
            .request(method.parse().expect("method"), &url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        let answer: Value = r.json().await.expect("json");
        assert_eq!(status, 400, "{method} {body}: {answer}");
        common::assert_error(status, &answer, 400, "invalid_request");
    }
    let huge = json!({"seats": ["E7"], "pad": "x".repeat(70_000)}).to_string();
    let r = s
        .http
        .post(format!("{}{holds}", s.base))
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 413);
    assert_eq!(
        r.json::<Value>().await.expect("json")["error"],
        "payload_too_large"
    );
    let (status, body) = s
        .call("POST", "/v1/shows/42/holds/not-a-token/confirm", None)
        .await;
    common::assert_error(status, &body, 404, "hold_not_found");
    // A PATCH naming a seat twice, to add or to remove: before, a seat
    // removed twice (or 10,000 times) went to Redis, and the hold was
    // changed as if named once.
    let patch = format!("/v1/shows/{sh}/holds/3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b");
    for change in [
        json!({"remove": ["E7", "E7"]}),
        json!({"add": ["E9", "E9"]}),
    ] {
        let (status, body) = s.call("PATCH", &patch, Some(change.clone())).await;
        common::assert_error(status, &body, 400, "duplicate_seat");
    }

    untouched.check("a request refused up front").await;
}
