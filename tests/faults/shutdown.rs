//! Graceful shutdown of the real binary: SIGTERM under load turns `/readyz`
//! to 503 at once, keeps serving through the drain, finishes what is in
//! flight and exits 0; a request stuck on a frozen Redis cannot hold up exit
//! past a bounded time.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cluster, show};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn start(extra: &[&str]) -> Daemon {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-nodes", &cluster().seed_urls().join(",")])
        .args(extra)
        .env("SEATHOLD_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn seathold");
    let daemon = Daemon {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    let http = reqwest::Client::new();
    common::wait_readyz(&http, &daemon.base, 200, Duration::from_secs(30)).await;
    daemon
}

fn signal(pid: u32, sig: &str) {
    // The shell's kill builtin: no procps needed.
    let ok = Command::new("/bin/sh")
        .args(["-c", &format!("kill -{sig} {pid}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

/// Waits for the child to exit, up to `limit`; answers its exit code.
async fn wait_exit(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test]
async fn sigterm_under_load_drains_and_exits_zero() {
    let _serial = SERIAL.lock().await;
    let mut d = start(&["--shutdown-drain-ms", "1500"]).await;
    let sh = show("drain");
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (base, sh, stop) = (d.base.clone(), sh.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            // Keep-alive connections, as a load balancer would hold.
            let http = reqwest::Client::new();
            let mut statuses = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let r = http
                    .post(format!("{base}/v1/shows/{sh}/seats/W{w}-{i}/hold"))
                    .send()
                    .await;
                statuses.push(r.map(|r| r.status().as_u16()).map_err(|e| e.to_string()));
            }
            statuses
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let http = reqwest::Client::new();
    let sent = Instant::now();
    signal(d.child.id(), "TERM");
    common::wait_readyz(&http, &d.base, 503, Duration::from_millis(500)).await;
    let not_ready_after = sent.elapsed();
    // The load balancer takes a while to notice; meanwhile requests,
    // new connections included, are still served.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let fresh = reqwest::Client::new()
        .get(format!("{}/healthz", d.base))
        .send()
        .await
        .map(|r| r.status().as_u16());
    assert_eq!(
        fresh.ok(),
        Some(200),
        "a new connection during the drain is served"
    );
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for w in workers {
        for r in w.await.expect("worker") {
            total += 1;
            match r {
                Ok(201 | 503) => {}
                other => panic!("a request failed during the drain: {other:?}"),
            }
        }
    }
    let code = wait_exit(&mut d.child, Duration::from_secs(8)).await;
    eprintln!(
        "{total} requests; /readyz 503 after {not_ready_after:?}; exit {code:?} after {:?}",
        sent.elapsed()
    );
    assert_eq!(code, Some(0));
    assert!(
        not_ready_after < Duration::from_millis(300),
        "{not_ready_after:?}"
    );
    assert!(
        sent.elapsed() >= Duration::from_millis(1500),
        "served for the whole drain"
    );
    assert!(total > 20, "there was load: {total}");
}

#[tokio::test]
async fn a_request_stuck_on_redis_cannot_hold_up_exit() {
    let _serial = SERIAL.lock().await;
    let mut d = start(&["--shutdown-drain-ms", "0", "--redis-timeout-ms", "1500"]).await;
    let sh = show("stuck");
    let slot = seathold::keys::KeySpace::new("seat-hold:").show_slot(&sh);
    let master = cluster().master_port_for_slot(slot).await.expect("master");
    cluster().pause(master).expect("SIGSTOP the master");
    let url = format!("{}/v1/shows/{sh}/seats/E7/hold", d.base);
    let stuck = tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).send().await;
        r.map(|r| r.status().as_u16()).map_err(|e| e.to_string())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = Instant::now();
    signal(d.child.id(), "TERM");
    let code = wait_exit(&mut d.child, Duration::from_secs(6)).await;
    let took = sent.elapsed();
    cluster().resume(master).expect("SIGCONT the master");
    assert_eq!(
        stuck.await.expect("task"),
        Ok(503),
        "the stuck request ends with 503"
    );
    assert_eq!(code, Some(0));
    assert!(
        took < Duration::from_millis(1500 + 1500),
        "exit took {took:?}"
    );
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy again");
}
