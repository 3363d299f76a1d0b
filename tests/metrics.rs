//! Counters move by exactly what happened. One test in this binary, so no
//! other test's requests share the process-wide recorder.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{scrape, show};
use serde_json::json;

/// The expiry subscriptions' keep-alive ping interval here.
const PING_MS: u64 = 500;

fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, series: &str) -> f64 {
    after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0)
}

#[tokio::test]
async fn counters_follow_a_known_sequence() {
    let mut opts = common::options();
    opts.expiry_ping_interval_ms = PING_MS;
    let s = common::server_with(opts).await;
    let sh = show("metrics");
    let other = show("metrics-x");
    // Expiry events are only seen once every master's subscription is up.
    s.wait_metric(
        "seathold_expiry_subscriptions",
        3.0,
        Duration::from_secs(10),
    )
    .await;
    let subscribed = std::time::Instant::now();
    let before = scrape(&s.metrics().await);

    // 3 holds, 6 seats.
    let a = s.hold(&sh, &["A1", "A2"]).await;
    let (status, b) = s
        .call("POST", &format!("/v1/shows/{sh}/seats/B1/hold"), None)
        .await;
    assert_eq!(status, 201);
    let c = s.hold(&sh, &["C1", "C2", "C3"]).await;
    // 2 conflicts.
    assert_eq!(
        s.call("POST", &format!("/v1/shows/{sh}/seats/A1/hold"), None)
            .await
            .0,
        409
    );
    assert_eq!(
        s.post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["Z1", "C3"]})
        )
        .await
        .0,
        409
    );
    // 1 cross-slot refusal.
    let ks = seathold::keys::KeySpace::new("seat-hold:");
    let far = (0..)
        .map(|i| format!("{other}-{i}"))
        .find(|x| ks.show_slot(x) != ks.show_slot(&sh))
        .expect("another slot");
    let (status, _) = s
        .post(
            "/v1/holds",
            json!({"seats": [{"show": sh, "seat": "X1"}, {"show": far, "seat": "X1"}]}),
        )
        .await;
    assert_eq!(status, 422);
    // 1 release (and a stale one that counts nothing).
    let ta = a["holdToken"].as_str().expect("token");
    assert_eq!(
        s.call("DELETE", &format!("/v1/shows/{sh}/holds/{ta}"), None)
            .await
            .0,
        204
    );
    assert_eq!(
        s.call("DELETE", &format!("/v1/shows/{sh}/holds/{ta}"), None)
            .await
            .0,
        404
    );
    // 2 extends.
    let tb = b["holdToken"].as_str().expect("token");
    for _ in 0..2 {
        assert_eq!(
            s.post(
                &format!("/v1/shows/{sh}/holds/{tb}/extend"),
                json!({"ttlMs": 60000})
            )
            .await
            .0,
            200
        );
    }
    // 1 confirm; the idempotent repeat is not a second sale.
    let tc = c["holdToken"].as_str().expect("token");
    for _ in 0..2 {
        assert_eq!(
            s.call("POST", &format!("/v1/shows/{sh}/holds/{tc}/confirm"), None)
                .await
                .0,
            200
        );
    }
    // A short hold that expires in Redis: the fourth hold, seventh seat.
    let (status, _) = s
        .post(
            &format!("/v1/shows/{sh}/seats/D1/hold"),
            json!({"ttlMs": 300}),
        )
        .await;
    assert_eq!(status, 201);

    // Redis emits `expired` when it deletes the key, which can trail the TTL.
    let mut after = scrape(&s.metrics().await);
    for _ in 0..300 {
        if delta(&before, &after, "seathold_hold_expiries_total") >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = scrape(&s.metrics().await);
    }
    let expect = [
        ("seathold_holds_total", 4.0),
        ("seathold_seats_held_total", 7.0),
        ("seathold_hold_conflicts_total", 2.0),
        ("seathold_cross_slot_rejections_total", 1.0),
        ("seathold_releases_total", 1.0),
        ("seathold_extends_total", 2.0),
        ("seathold_confirms_total", 1.0),
        ("seathold_hold_expiries_total", 1.0),
        ("seathold_redis_errors_total{kind=\"timeout\"}", 0.0),
        ("seathold_redis_errors_total{kind=\"io\"}", 0.0),
        ("seathold_redis_errors_total{kind=\"other\"}", 0.0),
        (
            "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/holds\",status=\"201\"}",
            2.0,
        ),
        (
            "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/seats/{seat}/hold\",status=\"409\"}",
            1.0,
        ),
        ("seathold_http_request_duration_seconds_count{route=\"/v1/holds\",status=\"422\"}", 1.0),
        (
            "seathold_http_request_duration_seconds_count{route=\"/v1/shows/{show}/holds/{token}\",status=\"204\"}",
            1.0,
        ),
    ];
    let mut wrong = Vec::new();
    for (series, want) in expect {
        let got = delta(&before, &after, series);
        if got != want {
            wrong.push(format!("{series}: moved by {got}, expected {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{}\n\n{}",
        wrong.join("\n"),
        s.metrics().await
    );

    // No raw path or id ever becomes a label.
    let text = s.metrics().await;
    assert!(!text.contains(&sh), "a show id leaked into a label");
    assert!(!text.contains(ta), "a token leaked into a label");
    assert!(text.contains("seathold_cluster_ready 1"));
    assert!(
        text.contains("seathold_expiry_subscriptions 3"),
        "one subscription per master:\n{text}"
    );
    assert!(text.contains("seathold_keyspace_events_enabled 1"));
    assert!(text.contains("seathold_redis_command_duration_seconds_bucket{op=\"hold\""));

    // The subscriptions stay up: past two of their keep-alive pings, none
    // was lost and made again.
    tokio::time::sleep(
        Duration::from_millis(2 * PING_MS + 300).saturating_sub(subscribed.elapsed()),
    )
    .await;
    let text = s.metrics().await;
    assert!(
        text.contains("seathold_expiry_resubscriptions_total 0"),
        "{text}"
    );
    assert!(text.contains("seathold_expiry_subscriptions 3"));
}
