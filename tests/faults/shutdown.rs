//! Graceful shutdown of the real binary: SIGTERM under load turns `/readyz`
//! to 503 at once, keeps serving through the drain, finishes what is in
//! flight and exits 0; a request stuck on a frozen Redis cannot hold up exit
//! past a bounded time.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{self, cluster, show, Daemon};

/// What became of one request sent on a connection of its own.
enum Outcome {
    /// A complete answer with this status.
    Answered(u16),
    /// The connection was refused (or reset before it was established):
    /// nothing listens any more.
    Refused,
    /// Anything else: reset, closed before a complete answer, no answer.
    Broken(String),
}

/// Sends one `POST path` on a new connection (`Connection: close`) and
/// reads the whole answer.
async fn post_once(addr: SocketAddr, path: &str) -> Outcome {
    let mut c = match TcpStream::connect(addr).await {
        Ok(c) => c,
        // A reset during the handshake is the listener closing while this
        // connection waited in its backlog: refused too, nothing was sent.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            return Outcome::Refused
        }
        Err(e) => return Outcome::Broken(format!("connect: {e}")),
    };
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    if let Err(e) = c.write_all(head.as_bytes()).await {
        return Outcome::Broken(format!("write: {e}"));
    }
    let mut got = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut got)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Outcome::Broken(format!("read after {} bytes: {e}", got.len())),
        Err(_) => return Outcome::Broken("no answer within 10 s".into()),
    }
    let text = String::from_utf8_lossy(&got);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Outcome::Broken(format!("closed before a complete head: {text:?}"));
    };
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|h| h.get(..3)?.parse().ok());
    match status {
        Some(status) if body.len() == length => Outcome::Answered(status),
        _ => Outcome::Broken(format!("an incomplete answer: {text:?}")),
    }
}

/// Clients keep sending holds, each on a new connection, from before the
/// SIGTERM until the process has exited. Through the whole drain every hold
/// must be served (201), including holds sent at its very end; a request
/// in flight when the listener closes must be answered; after that, new
/// connections may only be refused, never reset or left unanswered.
#[tokio::test]
async fn sigterm_under_load_drains_and_exits_zero() {
    let _serial = common::exclusive().await;
    let drain = Duration::from_millis(1500);
    let mut d = Daemon::start(&["--shutdown-drain-ms", "1500"]).await;
    let sh = show("drain");
    let exited = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for w in 0..2 {
        let (addr, sh, exited) = (d.addr, sh.clone(), exited.clone());
        clients.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut i = 0;
            while !exited.load(Ordering::Relaxed) {
                i += 1;
                let started = Instant::now();
                let outcome = post_once(addr, &format!("/v1/shows/{sh}/seats/W{w}-{i}/hold")).await;
                if matches!(outcome, Outcome::Refused) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen.push((started, Instant::now(), outcome));
            }
            seen
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let http = reqwest::Client::new();
    let sent = Instant::now();
    d.signal("TERM");
    common::wait_readyz(&http, &d.base, 503, Duration::from_millis(1000)).await;
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
    // A hold that is still in flight when the drain ends (its master is
    // frozen across that moment) must be finished, not cut.
    let (_, drain_master) = common::slot_and_master(&sh).await;
    let mut i = 0;
    let (slow_show, slow_master) = loop {
        i += 1;
        let candidate = format!("{sh}-slow{i}");
        let (_, master) = common::slot_and_master(&candidate).await;
        if master != drain_master {
            break (candidate, master);
        }
    };
    tokio::time::sleep(
        (sent + drain - Duration::from_millis(600)).saturating_duration_since(Instant::now()),
    )
    .await;
    cluster().pause(slow_master).expect("SIGSTOP");
    let slow = tokio::spawn({
        let addr = d.addr;
        async move { post_once(addr, &format!("/v1/shows/{slow_show}/seats/S1/hold")).await }
    });
    tokio::time::sleep(
        (sent + drain + Duration::from_millis(300)).saturating_duration_since(Instant::now()),
    )
    .await;
    cluster().resume(slow_master).expect("SIGCONT");
    let code = d.wait_exit(Duration::from_secs(8)).await;
    let exit_after = sent.elapsed();
    match slow.await.expect("slow hold") {
        Outcome::Answered(201) => {}
        Outcome::Answered(status) => {
            panic!("the hold in flight at the drain's end answered {status}")
        }
        Outcome::Refused => panic!("the hold in flight at the drain's end was refused"),
        Outcome::Broken(why) => panic!("the hold in flight at the drain's end was cut: {why}"),
    }
    exited.store(true, Ordering::Relaxed);

    let (mut served_in_drain, mut refused, mut total) = (0, 0, 0);
    let mut last_served = Duration::ZERO;
    for c in clients {
        let seen = c.await.expect("client");
        // Once refused, never served again: the listener is gone.
        let first_refused = seen
            .iter()
            .position(|(_, _, o)| matches!(o, Outcome::Refused));
        for (i, (started, ended, outcome)) in seen.iter().enumerate() {
            total += 1;
            match outcome {
                Outcome::Answered(201) => {
                    assert!(
                        first_refused.is_none_or(|r| i < r),
                        "served after a refused connection"
                    );
                    if *started > sent + not_ready_after {
                        served_in_drain += 1;
                        last_served = last_served.max(ended.duration_since(sent));
                    }
                }
                Outcome::Refused => refused += 1,
                Outcome::Answered(status) => panic!(
                    "a hold sent {:?} after SIGTERM answered {status}",
                    started.checked_duration_since(sent)
                ),
                Outcome::Broken(why) => panic!(
                    "a hold sent {:?} after SIGTERM broke: {why}",
                    started.checked_duration_since(sent)
                ),
            }
        }
    }
    eprintln!(
        "{total} holds; /readyz 503 after {not_ready_after:?}; {served_in_drain} served in the drain, \
         the last ending {last_served:?} after SIGTERM; {refused} refused; exit {code:?} after {exit_after:?}"
    );
    assert_eq!(code, Some(0));
    // At once; the bound leaves room for the `kill` process on a busy
    // machine.
    assert!(
        not_ready_after < Duration::from_millis(1000),
        "{not_ready_after:?}"
    );
    assert!(
        exit_after >= drain,
        "exited {exit_after:?} after SIGTERM, before the drain ended"
    );
    assert!(
        served_in_drain > 20,
        "holds served during the drain: {served_in_drain}"
    );
    assert!(
        last_served >= drain - Duration::from_millis(200),
        "the last hold served ended {last_served:?} after SIGTERM: not served to the end of the drain"
    );
}

#[tokio::test]
async fn a_request_stuck_on_redis_cannot_hold_up_exit() {
    let _serial = common::exclusive().await;
    let mut d = Daemon::start(&["--shutdown-drain-ms", "0", "--redis-timeout-ms", "1500"]).await;
    let sh = show("stuck");

    let (_, master) = common::slot_and_master(&sh).await;
    cluster().pause(master).expect("SIGSTOP the master");
    let url = format!("{}/v1/shows/{sh}/seats/E7/hold", d.base);
    let stuck = tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).send().await;
        r.map(|r| r.status().as_u16()).map_err(|e| e.to_string())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = Instant::now();
    d.signal("TERM");
    let code = d.wait_exit(Duration::from_secs(6)).await;
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
    common::heal(&[], &[]).await;
}
