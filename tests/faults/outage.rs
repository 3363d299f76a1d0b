//! Redis gone or frozen: seathold answers 503 within its Redis timeout, says
//! it is not ready, stays alive, and serves again by itself when Redis is
//! back, without a restart. The tests here stop the whole cluster, so they
//! take the lock exclusively and leave it healthy.

use std::time::{Duration, Instant};

use crate::common::{self, cluster, options, server_with, show};

/// Options with a 1 s Redis timeout, so that these tests wait little on a
/// cluster that is gone; the confirm wait must stay below it (a longer one
/// is refused at start).
fn short_timeouts() -> seathold::config::Options {
    let mut opts = options();
    opts.redis_timeout_ms = 1_000;
    opts.confirm_wait_timeout_ms = 500;
    opts
}

#[tokio::test]
async fn frozen_redis_answers_503_in_time_and_recovers_by_itself() {
    let _serial = common::exclusive().await;
    let s = server_with(short_timeouts()).await;
    let sh = show("frozen");
    s.hold(&sh, &["before"]).await;

    let ports: Vec<u16> = cluster().nodes().iter().map(|n| n.port).collect();
    for &p in &ports {
        cluster().pause(p).expect("SIGSTOP");
    }
    let frozen_at = Instant::now();
    let mut slowest = Duration::ZERO;
    for i in 0..5 {
        let started = Instant::now();
        let (status, body) = s
            .call("POST", &format!("/v1/shows/{sh}/seats/F{i}/hold"), None)
            .await;
        slowest = slowest.max(started.elapsed());
        common::assert_error(status, &body, 503, "redis_unavailable");
    }
    let (status, _) = s.get(&format!("/v1/shows/{sh}/seats/before")).await;
    assert_eq!(status, 503);
    assert!(
        slowest < Duration::from_millis(1_500),
        "a request waited {slowest:?} on a 1000 ms Redis timeout"
    );
    common::eventually(Duration::from_secs(5), "/readyz to turn 503", || async {
        s.get("/readyz").await.0 == 503
    })
    .await;
    assert_eq!(
        s.get("/healthz").await.0,
        200,
        "alive while Redis is frozen"
    );
    assert!(s.metrics().await.contains("seathold_cluster_ready 0"));
    eprintln!(
        "frozen: slowest answer {slowest:?}; not ready within {:?}",
        frozen_at.elapsed()
    );

    for &p in &ports {
        cluster().resume(p).expect("SIGCONT");
    }
    let resumed_at = Instant::now();
    common::eventually(
        Duration::from_secs(30),
        "holds to succeed again",
        || async {
            s.call("POST", &format!("/v1/shows/{sh}/seats/after/hold"), None)
                .await
                .0
                == 201
        },
    )
    .await;
    let recovered = resumed_at.elapsed();
    common::eventually(Duration::from_secs(10), "/readyz 200 again", || async {
        s.get("/readyz").await.0 == 200
    })
    .await;
    eprintln!("frozen: serving again {recovered:?} after SIGCONT");
    // The operations guide's figure (about 0.4 s), with room for a loaded
    // machine (the readiness probe runs every 500 ms, and six nodes wake).
    assert!(
        recovered < Duration::from_secs(2),
        "serving again only {recovered:?} after SIGCONT"
    );
    common::heal(&[], &[]).await;
}

#[tokio::test]
async fn starts_before_the_cluster_and_becomes_ready_when_it_appears() {
    let _serial = common::exclusive().await;
    let nodes = cluster().nodes();
    for n in &nodes {
        cluster().kill(n.port).expect("kill");
    }
    // seathold starts with every seed refusing connections.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let opts = short_timeouts();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(seathold::server::run(opts, listener, async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let base = format!("http://{addr}");
    common::eventually(Duration::from_secs(5), "/healthz", || async {
        http.get(format!("{base}/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    let r = http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .expect("readyz");
    assert_eq!(r.status().as_u16(), 503);
    let started = Instant::now();
    let r = http
        .post(format!("{base}/v1/shows/{}/seats/A1/hold", show("early")))
        .send()
        .await
        .expect("hold");
    assert_eq!(r.status().as_u16(), 503);
    assert!(started.elapsed() < Duration::from_millis(1_500));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .expect("readyz")
            .status()
            .as_u16(),
        503
    );

    // The cluster appears.
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    common::heal(&[], &ports).await;
    let appeared = Instant::now();
    common::wait_readyz(&http, &base, 200, Duration::from_secs(15)).await;
    let ready = appeared.elapsed();
    eprintln!("ready {ready:?} after the cluster came up");
    // The operations guide's figure (about 0.4 s), with room for a loaded
    // machine (the readiness probe runs every 500 ms).
    assert!(
        ready < Duration::from_secs(2),
        "ready only {ready:?} after the cluster came up"
    );
    let r = http
        .post(format!("{base}/v1/shows/{}/seats/A1/hold", show("late")))
        .send()
        .await
        .expect("hold");
    assert_eq!(r.status().as_u16(), 201);
    let _ = stop.send(());
    task.await.expect("task").expect("run");
}

/// Holds run out while every Redis node is gone: their shows' sweeps fail,
/// and the sweeper pauses each master's sweeps instead of retrying every
/// due show four times a second (which, with the cluster gone and the
/// failures immediate, came to 47,000 failed sweeps and as many log lines a
/// second). When the cluster is back, the sweeps resume by themselves.
#[tokio::test]
async fn sweeps_pause_while_the_cluster_is_gone_and_resume_after() {
    let _serial = common::exclusive().await;
    let s = server_with(short_timeouts()).await;
    const SHOWS: usize = 40;
    let failures = "seathold_sweep_failures_total";
    for i in 0..SHOWS {
        let (status, body) = s
            .post(
                &format!("/v1/shows/{}/seats/A1/hold", show(&format!("gone{i}"))),
                serde_json::json!({"ttlMs": 1_000}),
            )
            .await;
        assert_eq!(status, 201, "{body}");
    }
    let before = s.metric(failures).await;
    let nodes = cluster().nodes();
    for n in &nodes {
        cluster().kill(n.port).expect("kill");
    }
    // Every hold runs out in the first second; two more seconds of
    // sweeps that cannot succeed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failed = s.metric(failures).await - before;
    eprintln!("cluster gone: {failed} failed sweeps of {SHOWS} due shows in 3 s");
    assert!(failed >= 1.0, "no sweep was even tried");
    assert!(
        failed < SHOWS as f64,
        "{failed} failed sweeps of {SHOWS} due shows in 3 s: the sweeper retried them instead of pausing"
    );

    // The nodes come back (empty: the test cluster keeps no data). The
    // paused masters are tried again, and sweeps resume: a new 300 ms hold
    // on each show gets its `expired` event.
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    common::heal(&[], &ports).await;
    s.wait_ready(Duration::from_secs(15)).await;
    let back = Instant::now();
    let keys = seathold::keys::KeySpace::new("seat-hold:");
    let mut shows = Vec::new();
    for i in 0..SHOWS {
        let sh = show(&format!("back{i}"));
        let (status, body) = s
            .post(
                &format!("/v1/shows/{sh}/seats/A1/hold"),
                serde_json::json!({"ttlMs": 300}),
            )
            .await;
        assert_eq!(status, 201, "{body}");
        shows.push(sh);
    }
    let r = common::redis().await;
    for sh in &shows {
        common::eventually(
            Duration::from_secs(5),
            &format!("the expired event of {sh}"),
            || async {
                let events: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                    .arg(keys.events(sh))
                    .arg("-")
                    .arg("+")
                    .query_async(&mut r.clone())
                    .await
                    .expect("XRANGE");
                events
                    .iter()
                    .any(|(_, f)| f.iter().any(|(k, v)| k == "t" && v == "expired"))
            },
        )
        .await;
    }
    eprintln!(
        "cluster back: every new hold's expired event within {:?}",
        back.elapsed()
    );
    s.stop().await;
}
