//! Counters move by exactly what happened; a fresh daemon shows every metric
//! from the start. One in-process server in this binary, so no other test's
//! requests share the process-wide recorder; the fresh daemon is the real
//! binary, in a process of its own.

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
    let before_text = s.metrics().await;
    let before = scrape(&before_text);

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
        assert_eq!(s.extend(&sh, tb, 60000).await.0, 200);
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
    let mut after_text = s.metrics().await;
    let mut after = scrape(&after_text);
    for _ in 0..300 {
        if delta(&before, &after, "seathold_hold_expiries_total") >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        after_text = s.metrics().await;
        after = scrape(&after_text);
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
    // No Redis error of any kind, not only of the kinds named above.
    let errors = "seathold_redis_errors_total";
    let errors_moved =
        common::series_sum(&after_text, errors) - common::series_sum(&before_text, errors);
    if errors_moved != 0.0 {
        wrong.push(format!(
            "{errors} (every kind): moved by {errors_moved}, expected 0"
        ));
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

/// Every metric name that src/metrics.rs declares (`pub const X: &str =
/// "seathold_…";`).
fn declared_names() -> Vec<String> {
    include_str!("../src/metrics.rs")
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("pub const ")?;
            let (_, value) = rest.split_once(": &str = \"")?;
            Some(value.strip_suffix("\";")?.to_owned())
        })
        .collect()
}

/// Names of a text exposition's samples (`name{…} v`, `name v`).
fn sample_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_fresh_daemon_shows_every_metric_and_its_process() {
    let declared = declared_names();
    assert!(declared.len() >= 24, "parsed too few names: {declared:?}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // No Redis needed to be scraped: the daemon serves /metrics at once.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["--redis-nodes", "redis://127.0.0.1:1"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .kill_on_drop(true)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run seathold");
    // A bare connect is not a request: the first request is the scrape.
    common::eventually(Duration::from_secs(10), "the daemon to listen", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let scrape_text = || async {
        reqwest::get(&url)
            .await
            .expect("scrape")
            .text()
            .await
            .expect("text")
    };
    let first = scrape_text().await;
    let names = sample_names(&first);
    let has = |names: &std::collections::BTreeSet<String>, name: &str| {
        names.contains(name) || names.contains(&format!("{name}_bucket"))
    };
    let missing: Vec<_> = declared
        .iter()
        .filter(|n| !has(&names, n) && *n != "seathold_http_request_duration_seconds")
        .collect();
    assert!(missing.is_empty(), "missing at start: {missing:?}\n{first}");
    for script in ["hold", "release", "extend", "confirm", "lookup", "seats"] {
        assert!(
            first.contains(&format!(
                "seathold_redis_command_duration_seconds_count{{op=\"{script}\"}} 0"
            )),
            "{script}'s latency histogram at zero:\n{first}"
        );
    }
    assert!(
        first.contains(&format!(
            "seathold_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{first}"
    );
    // Request latency is labelled by status, so it appears with the first
    // request: that scrape.
    let second = scrape_text().await;
    assert!(
        second.contains(
            "seathold_http_request_duration_seconds_count{route=\"/metrics\",status=\"200\"} 1"
        ),
        "{second}"
    );

    let value = |name: &str| -> f64 {
        scrape(&second)
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} missing:\n{second}"))
    };
    let rss = value("process_resident_memory_bytes");
    assert!(rss > 1e6 && rss < 1e9, "RSS {rss}");
    assert!(value("process_open_fds") >= 3.0);
    let cpu_before = value("process_cpu_seconds_total");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let started = value("process_start_time_seconds");
    assert!(
        (now - started).abs() < 120.0,
        "started at {started}, now {now}"
    );
    // The CPU counter follows the process's CPU time: a burst of scrapes
    // moves it (it counts in clock ticks, so one scrape alone may not), and
    // never past the wall-clock time since the start on every core.
    let cpu_of = |text: &str| -> f64 {
        scrape(text)
            .get("process_cpu_seconds_total")
            .copied()
            .unwrap_or_else(|| panic!("process_cpu_seconds_total missing:\n{text}"))
    };
    let mut cpu = cpu_before;
    for _ in 0..100 {
        for _ in 0..20 {
            scrape_text().await;
        }
        cpu = cpu_of(&scrape_text().await);
        if cpu > cpu_before {
            break;
        }
    }
    assert!(
        cpu > cpu_before,
        "process_cpu_seconds_total stayed at {cpu_before} through 2,100 scrapes"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let lived = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
        - started;
    assert!(
        cpu <= (lived + 1.0) * cores,
        "{cpu} s of CPU in {lived} s on {cores} cores"
    );
    let _ = child.kill().await;
}
