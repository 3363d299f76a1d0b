//! Redis gone or frozen: seathold answers 503 within its Redis timeout, says
//! it is not ready, stays alive, and serves again by itself when Redis is
//! back, without a restart. The tests here stop the whole cluster, so they
//! take `SERIAL` and leave it healthy.

mod common;

use std::time::{Duration, Instant};

use common::{cluster, options, server_with, show};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn frozen_redis_answers_503_in_time_and_recovers_by_itself() {
    let _serial = SERIAL.lock().await;
    let mut opts = options();
    opts.redis_timeout_ms = 1_000;
    opts.confirm_wait_timeout_ms = 500;
    let s = server_with(opts).await;
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
        assert_eq!(
            (status, body["error"].as_str()),
            (503, Some("redis_unavailable")),
            "{body}"
        );
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
    common::eventually(Duration::from_secs(10), "/readyz 200 again", || async {
        s.get("/readyz").await.0 == 200
    })
    .await;
    eprintln!(
        "frozen: serving again {:?} after SIGCONT",
        resumed_at.elapsed()
    );
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
}

#[tokio::test]
async fn starts_before_the_cluster_and_becomes_ready_when_it_appears() {
    let _serial = SERIAL.lock().await;
    let nodes = cluster().nodes();
    for n in &nodes {
        cluster().kill(n.port).expect("kill");
    }
    // seathold starts with every seed refusing connections.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut opts = options();
    opts.redis_timeout_ms = 1_000;
    opts.confirm_wait_timeout_ms = 500;
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
    for n in &nodes {
        cluster().restart(n.port).await.expect("restart");
    }
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy");
    let appeared = Instant::now();
    common::wait_readyz(&http, &base, 200, Duration::from_secs(15)).await;
    eprintln!("ready {:?} after the cluster came up", appeared.elapsed());
    let r = http
        .post(format!("{base}/v1/shows/{}/seats/A1/hold", show("late")))
        .send()
        .await
        .expect("hold");
    assert_eq!(r.status().as_u16(), 201);
    let _ = stop.send(());
    task.await.expect("task").expect("run");
}
