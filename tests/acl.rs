//! Least privilege: seathold works as the ACL user of `cluster/acl.conf`,
//! which can touch only keys under `seat-hold:` and run only the commands
//! seathold needs; a wrong password keeps it not ready, with a clear reason.

mod common;

use std::time::Duration;

use common::{cluster, options, server_with, show};
use redis::AsyncCommands;

const PASSWORD: &str = "acl-test-password-1";

/// The rules of user `seathold` from `cluster/acl.conf`, switched on with a
/// test password: the test runs the very ACL operators are told to use.
fn seathold_rules() -> Vec<String> {
    let acl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/acl.conf"))
        .expect("cluster/acl.conf");
    let line = acl
        .lines()
        .find(|l| l.starts_with("user seathold "))
        .expect("a `user seathold` line in cluster/acl.conf");
    line.split_whitespace()
        .skip(2)
        .filter(|r| !r.starts_with('>') && !r.starts_with('#'))
        .map(|r| {
            if r == "off" {
                "on".to_owned()
            } else {
                r.to_owned()
            }
        })
        .chain([format!(">{PASSWORD}")])
        .collect()
}

async fn install_user() {
    set_user("seathold", &seathold_rules()).await;
}

#[tokio::test]
async fn works_as_the_least_privileged_acl_user() {
    // Alone: every connection that runs a script below must be seathold's.
    let _alone = common::exclusive().await;
    install_user().await;
    let mut opts = options();
    opts.redis_username = Some("seathold".into());
    opts.redis_password = Some(PASSWORD.into());
    let s = server_with(opts).await;
    let sh = show("acl");
    let hold = s.hold(&sh, &["A1", "A2"]).await;
    let t = hold["holdToken"].as_str().expect("token");
    assert_eq!(s.get(&format!("/v1/shows/{sh}/holds/{t}")).await.0, 200);
    assert_eq!(
        s.get(&format!("/v1/shows/{sh}/seats?ids=A1,A2,A3")).await.0,
        200
    );
    assert_eq!(
        s.post(
            &format!("/v1/shows/{sh}/holds/{t}/extend"),
            serde_json::json!({"ttlMs": 60000})
        )
        .await
        .0,
        200
    );
    let (status, body) = s
        .call("POST", &format!("/v1/shows/{sh}/holds/{t}/confirm"), None)
        .await;
    assert_eq!(status, 200, "{body}");
    let t2 = s.hold(&sh, &["B1"]).await["holdToken"]
        .as_str()
        .expect("token")
        .to_owned();
    assert_eq!(
        s.call("DELETE", &format!("/v1/shows/{sh}/holds/{t2}"), None)
            .await
            .0,
        204
    );
    let (status, _) = s
        .post(
            &format!("/v1/shows/{sh}/seats/C1/hold"),
            serde_json::json!({"ttlMs": 200}),
        )
        .await;
    assert_eq!(status, 201);
    s.wait_metric("seathold_hold_expiries_total", 1.0, Duration::from_secs(15))
        .await;

    // The scripts ran as that user: on every master, each connection whose
    // last command was one of the daemon's is authenticated as `seathold`,
    // and some of them ran scripts.
    let daemon_commands = [
        "evalsha",
        "eval",
        "evalsha_ro",
        "eval_ro",
        "wait",
        "script|load",
        "cluster|slots",
        "cluster|info",
        "subscribe",
        "ssubscribe",
        "ping",
        "config|get",
    ];
    let mut scripts_run = 0;
    for port in common::master_ports().await {
        for client in common::client_list(port).await {
            let cmd = client.get("cmd").map(String::as_str).unwrap_or_default();
            if daemon_commands.contains(&cmd) {
                assert_eq!(
                    client.get("user").map(String::as_str),
                    Some("seathold"),
                    "a connection that ran {cmd} on {port}: {client:?}"
                );
                scripts_run += usize::from(cmd.starts_with("eval"));
            }
        }
    }
    assert!(
        scripts_run > 0,
        "no connection of user seathold ran a script"
    );

    // The user can do nothing else.
    let mut direct = redis::Client::open(format!(
        "redis://seathold:{PASSWORD}@127.0.0.1:{}",
        cluster().nodes()[0].port
    ))
    .expect("client")
    .get_multiplexed_async_connection()
    .await
    .expect("connect as seathold");
    let denied: Result<(), _> = direct.set("not-ours", "x").await;
    assert!(
        denied.is_err_and(|e| e.code() == Some("NOPERM")),
        "a key outside the prefix"
    );
    let denied: Result<(), _> = redis::cmd("FLUSHALL").query_async(&mut direct).await;
    assert!(
        denied.is_err_and(|e| e.code() == Some("NOPERM")),
        "FLUSHALL"
    );
    let denied: Result<Vec<String>, _> = direct.keys("*").await;
    assert!(denied.is_err_and(|e| e.code() == Some("NOPERM")), "KEYS");
}

#[tokio::test]
async fn a_wrong_password_keeps_it_not_ready_and_says_why() {
    let _shared = common::shared().await;
    install_user().await;
    let mut opts = options();
    opts.redis_username = Some("seathold".into());
    opts.redis_password = Some("not-the-password".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(seathold::server::run(opts, listener, async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let reason = loop {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            assert_eq!(r.status().as_u16(), 503);
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            let reason = body["reason"].as_str().unwrap_or_default().to_owned();
            if reason.contains("credentials") {
                break reason;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no clear reason in /readyz: {reason}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        reason.contains("WRONGPASS") || reason.to_lowercase().contains("auth"),
        "{reason}"
    );
    assert_eq!(
        http.get(format!("{base}/healthz"))
            .send()
            .await
            .expect("healthz")
            .status()
            .as_u16(),
        200
    );
    let r = http
        .post(format!("{base}/v1/shows/x/seats/A1/hold"))
        .send()
        .await
        .expect("hold");
    assert_eq!(r.status().as_u16(), 503);
    let _ = stop.send(());
    task.await.expect("task").expect("run");
}

#[tokio::test]
async fn the_doctor_passes_the_acl_rights_of_the_least_privileged_user() {
    install_user().await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_seathold"))
        .arg("doctor")
        .args(["--redis-nodes", &cluster().seed_urls().join(",")])
        .args(["--redis-username", "seathold"])
        .env("SEATHOLD_REDIS_PASSWORD", PASSWORD)
        .output()
        .await
        .expect("run seathold doctor");
    let report = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<_> = report
        .lines()
        .filter(|l| l.contains("  acl ") || l.contains("  scripts:"))
        .collect();
    assert_eq!(lines.len(), 4, "three masters and the scripts:\n{report}");
    for line in lines {
        assert!(
            line.starts_with("PASS"),
            "cluster/acl.conf's user is enough:\n{report}"
        );
    }
}

/// `rejected_calls` of XREVRANGE (its refusals by ACL), over every master.
async fn rejected_xrevrange() -> u64 {
    let mut total = 0;
    for port in common::master_ports().await {
        let mut c = common::node(port).await;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut c)
            .await
            .expect("INFO commandstats");
        total += info
            .lines()
            .find(|l| l.starts_with("cmdstat_xrevrange:"))
            .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

/// A show's event reader whose first read is refused (here by ACL; also
/// `LOADING` while a master restarts, or `MOVED` before the slot map is
/// new) tries again after a pause that grows, as it does when a later read
/// fails, instead of at once: it once reconnected and read again in a
/// tight loop for as long as a subscriber waited.
#[tokio::test]
async fn an_event_reader_whose_reads_are_refused_backs_off() {
    let _shared = common::shared().await;
    let rules: Vec<String> = seathold_rules()
        .into_iter()
        .chain(["-xrevrange".to_owned()])
        .collect();
    set_user("seathold-noxrev", &rules).await;
    let mut opts = options();
    opts.redis_username = Some("seathold-noxrev".into());
    opts.redis_password = Some(PASSWORD.into());
    let s = server_with(opts).await;
    let before = rejected_xrevrange().await;
    // The subscription waits for its reader's first read, which never
    // succeeds: 503 after the request's deadline (--redis-timeout-ms, 2 s).
    let r = s
        .http
        .get(format!("{}/v1/shows/{}/events", s.base, show("noxrev")))
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 503, "{:?}", r.text().await);
    let refused = rejected_xrevrange().await - before;
    // 50 + 100 + 200 + 400 + 800 ms of pauses fit in 2 s: about 6 tries.
    assert!(
        (1..=12).contains(&refused),
        "{refused} refused XREVRANGEs in 2 s"
    );
}

/// Sets `rules` on user `name` on every node.
async fn set_user(name: &str, rules: &[String]) {
    for n in cluster().nodes() {
        let mut c = common::node(n.port).await;
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(name)
            .arg(rules)
            .query_async(&mut c)
            .await
            .expect("ACL SETUSER");
    }
}

/// A show's reader cut off (here its XREAD refused) while more than
/// `--events-max-len` events are written, among them the release of a
/// seat its view knew held: when it reads again, XREAD silently starts at
/// the oldest entry kept. The reader notices the gap: the view forgets
/// what it knew (the released seat is granted, not refused from the stale
/// view until the old hold's expiry) and the show's event streams end, so
/// that their clients resume from their last ids.
#[tokio::test]
async fn a_reader_that_missed_trimmed_events_starts_over() {
    let _shared = common::shared().await;
    let user = "seathold-gap";
    let rules = seathold_rules();
    set_user(user, &rules).await;
    let mut opts = options();
    opts.redis_username = Some(user.into());
    opts.redis_password = Some(PASSWORD.into());
    opts.view_min_rate = 0;
    opts.events_max_len = 100;
    let s = server_with(opts).await;
    let sh = show("gap");
    let view_reads = |s: &common::TestServer| {
        let s = s.base.clone();
        async move {
            let text = reqwest::get(format!("{s}/metrics"))
                .await
                .expect("metrics")
                .text()
                .await
                .expect("text");
            common::series(&text, "seathold_view_answers_total{kind=\"read\"}")
        }
    };
    // A view of the show that knows E7 held.
    assert_eq!(s.get(&format!("/v1/shows/{sh}/seats/V0")).await.0, 200);
    let hold = s.hold(&sh, &["E7"]).await;
    let token = hold["holdToken"].as_str().expect("token").to_owned();
    common::eventually(Duration::from_secs(5), "the view to know E7", || async {
        let before = view_reads(&s).await;
        s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
        view_reads(&s).await > before
    })
    .await;
    // A live subscriber.
    let mut events = s
        .http
        .get(format!("{}/v1/shows/{sh}/events", s.base))
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("SSE");
    assert_eq!(events.status().as_u16(), 200);
    let ended = tokio::spawn(async move { while let Ok(Some(_)) = events.chunk().await {} });

    // Cut the reader off; meanwhile E7 is released and 300 more events
    // trim the release away (the cap is 100).
    let cut: Vec<String> = rules.iter().cloned().chain(["-xread".to_owned()]).collect();
    set_user(user, &cut).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, body) = s
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{token}"), None)
        .await;
    assert_eq!(status, 204, "{body}");
    let mut r = common::redis().await;
    let _: () = redis::cmd("EVAL")
        .arg(
            "for i = 1, 300 do \
               redis.call('XADD', KEYS[1], 'MAXLEN', '~', '100', '*', 't', 'held', \
                 'r', '00000000000000ff', 's', 'Z' .. i, 'l', '600000') \
             end",
        )
        .arg(1)
        .arg(seathold::keys::KeySpace::new("seat-hold:").events(&sh))
        .query_async(&mut r)
        .await
        .expect("EVAL");
    let restored: Vec<String> = rules.iter().cloned().chain(["+xread".to_owned()]).collect();
    set_user(user, &restored).await;

    // The reader is back and current: a seat of the kept events is read
    // from the view.
    common::eventually(Duration::from_secs(5), "the view to read again", || async {
        let before = view_reads(&s).await;
        s.get(&format!("/v1/shows/{sh}/seats/Z300")).await;
        view_reads(&s).await > before
    })
    .await;
    let (status, body) = s
        .post(
            &format!("/v1/shows/{sh}/seats/E7/hold"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 201, "E7 is free in Redis: {body}");
    tokio::time::timeout(Duration::from_secs(5), ended)
        .await
        .expect("the event stream ended after the gap")
        .expect("reader task");
}
