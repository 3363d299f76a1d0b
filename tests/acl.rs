//! Least privilege: seathold works as the ACL user of `cluster/acl.conf`,
//! which can touch only keys under `seat-hold:` and run only the commands
//! seathold needs; a wrong password keeps it not ready, with a clear reason.

mod common;

use std::time::Duration;

use common::{cluster, options, server_with, show};
use redis::AsyncCommands;
use serde_json::json;

const PASSWORD: &str = "acl-test-password-1";

/// The rules of user `seathold` from `cluster/acl.conf`, switched on with a
/// test password as cluster/README.md tells operators to (`off resetpass`
/// becomes `on resetpass #<SHA-256 of the password>`): the test runs the
/// very ACL operators are told to use.
fn seathold_rules() -> Vec<String> {
    use sha2::Digest as _;
    let acl = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/acl.conf"))
        .expect("cluster/acl.conf");
    let line = acl
        .lines()
        .find(|l| l.starts_with("user seathold "))
        .expect("a `user seathold` line in cluster/acl.conf");
    assert!(
        line.contains(" off resetpass "),
        "cluster/README.md tells operators to replace `off resetpass`: {line}"
    );
    let hash = hex::encode(sha2::Sha256::digest(PASSWORD.as_bytes()));
    line.replacen(" off resetpass ", &format!(" on resetpass #{hash} "), 1)
        .split_whitespace()
        .skip(2)
        .map(str::to_owned)
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

    // Pools, holder limits and changes: the scripts' hash, counter and
    // pruning commands (the file once lacked them: every such request was
    // answered 503, NOPERM inside the script).

    let call = |method: &'static str, path: String, body: Option<serde_json::Value>| {
        let s = &s;
        async move {
            let (status, body) = s.call(method, &path, body).await;
            assert!(status < 300, "{method} {path}: {status} {body}");
            body
        }
    };
    call(
        "PUT",
        format!("/v1/shows/{sh}/pools/floor"),
        Some(json!({"capacity": 10})),
    )
    .await;
    call(
        "PUT",
        format!("/v1/shows/{sh}/settings"),
        Some(json!({"maxPerHolder": 8})),
    )
    .await;
    call("GET", format!("/v1/shows/{sh}/pools/floor"), None).await;
    let mut tokens = Vec::new();
    for seat in ["D1", "D2"] {
        let made = call(
            "POST",
            format!("/v1/shows/{sh}/holds"),
            Some(json!({"seats": [seat], "pools": {"floor": 2}, "holder": "alice"})),
        )
        .await;
        tokens.push(made["holdToken"].as_str().expect("token").to_owned());
    }
    call(
        "PATCH",
        format!("/v1/shows/{sh}/holds/{}", tokens[0]),
        Some(json!({"add": ["D3"], "pools": {"floor": 3}})),
    )
    .await;
    call(
        "POST",
        format!("/v1/shows/{sh}/holds/{}/extend", tokens[0]),
        Some(json!({"ttlMs": 60000})),
    )
    .await;
    call(
        "POST",
        format!("/v1/shows/{sh}/holds/{}/confirm", tokens[0]),
        None,
    )
    .await;
    call(
        "DELETE",
        format!("/v1/shows/{sh}/holds/{}", tokens[1]),
        None,
    )
    .await;
    let pool = call("GET", format!("/v1/shows/{sh}/pools/floor"), None).await;
    assert_eq!(
        (&pool["held"], &pool["sold"]),
        (&json!(0), &json!(3)),
        "{pool}"
    );

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

/// What `seathold doctor` reports on the test cluster as ACL user `user`.
async fn doctor_report(user: &str) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_seathold"))
        .arg("doctor")
        .args(["--redis-nodes", &cluster().seed_urls().join(",")])
        .args(["--redis-username", user])
        .env("SEATHOLD_REDIS_PASSWORD", PASSWORD)
        .output()
        .await
        .expect("run seathold doctor");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn the_doctor_passes_the_acl_rights_of_the_least_privileged_user() {
    let _shared = common::shared().await;
    install_user().await;
    let report = doctor_report("seathold").await;
    let lines: Vec<_> = report
        .lines()
        .filter(|l| l.contains("  acl ") || l.contains("  scripts:"))
        .collect();
    assert_eq!(
        lines.len(),
        7,
        "three masters, three replicas and the scripts:\n{report}"
    );
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
    let r = s.events_stream(&show("noxrev"), None).await;
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
        set_user_at(n.port, name, rules).await;
    }
}

/// `ACL SETUSER name rules…` on the node at `port` only.
async fn set_user_at(port: u16, name: &str, rules: &[String]) {
    let mut c = common::node(port).await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(name)
        .arg(rules)
        .query_async(&mut c)
        .await
        .expect("ACL SETUSER");
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
    let mut events = s.events_stream(&sh, None).await;
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

/// The `+command` rules of user `seathold` in `cluster/acl.conf`, lower
/// case (`xinfo|stream`, `cluster|slots`, …).
fn granted() -> std::collections::BTreeSet<String> {
    seathold_rules()
        .iter()
        .filter_map(|r| r.strip_prefix('+'))
        .map(str::to_lowercase)
        .collect()
}

/// Every command the Lua scripts call (ACLs apply inside scripts too) and
/// every one the daemon sends itself is granted to user `seathold`. The
/// file once lacked the hash, counter and pruning commands of pools and
/// holder limits (`HGET`, `HINCRBY`, `INCRBY`, `ZREMRANGEBYSCORE`, …) and
/// `ASKING`: every pool, settings and holder request, and every request
/// to a slot being moved, failed with NOPERM.
#[test]
fn the_acl_grants_every_command_seathold_sends() {
    let mut needed = std::collections::BTreeSet::new();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/lua");
    for entry in std::fs::read_dir(dir).expect("lua/") {
        let path = entry.expect("entry").path();
        // Run by `seathold delete-show` as an operator (user `admin`),
        // never by the daemon: user `seathold` may not delete shows.
        if path.file_name().is_some_and(|n| n == "delete_show.lua") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("script");
        for call in text.split("redis.call('").skip(1) {
            let command = call.split('\'').next().unwrap_or_default().to_lowercase();
            // XINFO is called as XINFO STREAM.
            needed.insert(if command == "xinfo" {
                "xinfo|stream".to_owned()
            } else {
                command
            });
        }
    }
    assert!(needed.len() > 20, "the scripts' commands: {needed:?}");
    // Sent by the daemon itself: scripts, event readers, the sweeper's
    // scans and leases, confirm's WAIT, ASK redirects, connections and the
    // slot map, expiry notifications.
    needed.extend(
        [
            "evalsha",
            "eval",
            "script|load",
            "asking",
            "xread",
            "xrevrange",
            "zrange",
            "scan",
            "set",
            "del",
            "time",
            "wait",
            "ping",
            "info",
            "cluster|slots",
            "cluster|info",
            "auth",
            "subscribe",
            "unsubscribe",
            "publish",
            "config|get",
        ]
        .map(str::to_owned),
    );
    let granted = granted();
    let missing: Vec<_> = needed.difference(&granted).collect();
    assert!(
        missing.is_empty(),
        "cluster/acl.conf does not grant user seathold {missing:?}"
    );
    // And nothing more (least privilege), apart from what the redis crate
    // sends on its own: the cluster client's slot map (CLUSTER SHARDS on
    // newer servers), replica reads and RESP3 handshakes, and the pattern
    // subscriptions of its pub/sub API. The file once granted INCR and
    // PEXPIRE, which nothing sends.
    let library: std::collections::BTreeSet<String> = [
        "cluster|shards",
        "readonly",
        "hello",
        "psubscribe",
        "punsubscribe",
    ]
    .map(str::to_owned)
    .into();
    let extra: Vec<_> = granted
        .difference(&needed)
        .filter(|c| !library.contains(*c))
        .collect();
    assert!(
        extra.is_empty(),
        "cluster/acl.conf grants user seathold {extra:?}, which nothing sends"
    );
}

/// A redis-server started with `cluster/acl.conf` as its `aclfile` starts:
/// Redis refuses to load an ACL file with anything but `user` lines (the
/// file once began with comments, and every node pointed at it aborted at
/// start). Its users ship disabled, so the server answers NOAUTH.
#[test]
fn redis_server_starts_with_the_acl_file() {
    let redis = common::required(
        "redis-server",
        "install it: apt-get update && apt-get install -y redis-server",
    );
    let dir = std::env::temp_dir().join(format!("seathold-acl-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let acl = dir.join("acl.conf");
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/acl.conf"),
        &acl,
    )
    .expect("copy acl.conf");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = std::process::Command::new(redis)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--aclfile")
        .arg(&acl)
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .spawn()
        .expect("start redis-server");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let answer = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let log = std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default();
            panic!("redis-server exited ({status}) with cluster/acl.conf:\n{log}");
        }
        if let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            conn.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            conn.write_all(b"PING\r\n").expect("PING");
            let mut buf = [0u8; 256];
            let n = conn.read(&mut buf).unwrap_or(0);
            break String::from_utf8_lossy(&buf[..n]).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(answer.starts_with("-NOAUTH"), "PING answered {answer:?}");
}

/// A command a script calls that the ACL does not grant is an operator's
/// misconfiguration, not a bug: 503 `redis_unavailable`, counted as
/// `kind="auth"`, with Redis's words in the log. It was answered 500
/// `internal` ("a bug or foreign data"), counted as `protocol`.
#[tokio::test]
async fn a_script_refused_by_the_acl_is_503_and_counted_as_auth() {
    let _shared = common::shared().await;
    let rules: Vec<String> = seathold_rules()
        .into_iter()
        .chain(["-hincrby".to_owned(), "-hset".to_owned()])
        .collect();
    set_user("seathold-nohash", &rules).await;
    let mut opts = options();
    opts.redis_username = Some("seathold-nohash".into());
    opts.redis_password = Some(PASSWORD.into());
    let s = server_with(opts).await;
    let auth = r#"seathold_redis_errors_total{kind="auth"}"#;
    let before = common::series(&s.metrics().await, auth);
    let (status, body) = s
        .call(
            "PUT",
            &format!("/v1/shows/{}/pools/floor", show("nohash")),
            Some(json!({"capacity": 10})),
        )
        .await;
    common::assert_error(status, &body, 503, "redis_unavailable");
    let after = common::series(&s.metrics().await, auth);
    assert_eq!(after - before, 1.0, "{body}");
}

/// The doctor's scratch keys expire within a minute even when the user may
/// not delete them (or the doctor is stopped halfway): its `PEXPIREAT` set
/// the scratch key's expiry to the year 5138, and the stream, index and
/// hash it made never had one.
#[tokio::test]
async fn the_doctors_scratch_keys_expire_when_it_cannot_delete_them() {
    // Alone: it reads every doctor scratch key of the cluster, and another
    // doctor's keys have no TTL for a moment, then go.
    let _alone = common::exclusive().await;
    let rules: Vec<String> = seathold_rules()
        .into_iter()
        .chain(["-del".to_owned()])
        .collect();
    set_user("seathold-nodel", &rules).await;
    let report = doctor_report("seathold-nodel").await;
    assert!(
        report.contains("+del"),
        "the refused DEL is reported:\n{report}"
    );
    // The advice names the user (cluster/acl.conf does not grant ACL
    // WHOAMI; it said "(the configured user)").
    assert!(
        report.contains("ACL SETUSER seathold-nodel"),
        "advice to paste:\n{report}"
    );
    let mut scratch = 0;
    for port in common::master_ports().await {
        let mut conn = common::node(port).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("seat-hold:{seathold-doctor-*")
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        for key in keys {
            let ttl: i64 = conn.pttl(&key).await.expect("PTTL");
            assert!((1..=60_000).contains(&ttl), "{key} on {port}: PTTL {ttl}");
            scratch += 1;
        }
    }
    assert!(scratch >= 3, "the scratch keys left behind: {scratch}");
}

/// A hold answered 503 whose script ran after all is released in the
/// background; at shutdown the daemon gives such releases one Redis
/// timeout more instead of dropping them with the process. Here the hold
/// waits in a frozen master's socket past its 503 and runs when the master
/// thaws, while its release (abandon.lua, whose first call is a `GET` the
/// hold's own calls do without) is refused by the ACL until just after
/// SIGTERM: before, the daemon exited at once and the seat stayed held for
/// the hold's whole TTL.
#[tokio::test]
async fn a_release_pending_at_shutdown_gets_one_more_redis_timeout() {
    let _alone = common::exclusive().await;
    let user = "seathold-drain";
    set_user(user, &seathold_rules()).await;
    let no_get: Vec<String> = seathold_rules()
        .into_iter()
        .chain(["-get".to_owned()])
        .collect();
    let sh = show("drain");
    let (_, master) = common::slot_and_master(&sh).await;
    let mut daemon = common::Daemon::start(&[
        "--redis-username",
        user,
        "--redis-password",
        PASSWORD,
        "--redis-timeout-ms",
        "600",
        "--shutdown-drain-ms",
        "0",
    ])
    .await;
    set_user(user, &no_get).await;

    let thaw = common::Frozen::new(master);
    let frozen = std::time::Instant::now();
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/shows/{sh}/seats/A1/hold", daemon.base))
        .json(&json!({"ttlMs": 60000}))
        .send()
        .await
        .expect("hold");
    assert_eq!(answer.status().as_u16(), 503);
    tokio::time::sleep_until((frozen + Duration::from_millis(1000)).into()).await;
    drop(thaw);
    let seat = format!("seat-hold:{{show:{sh}}}:A1");
    let mut r = common::redis().await;
    common::eventually(Duration::from_secs(5), "the hold's script to run", || {
        let (mut r, seat) = (r.clone(), seat.clone());
        async move { r.exists::<_, bool>(&seat).await.unwrap_or(false) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The daemon stops within about 100 ms of SIGTERM unless it waits for
    // the release; the drain gives it 600 ms more.
    // The rights come back 200 ms after it (on the show's master first:
    // the other five nodes' take a round trip each).
    daemon.signal("TERM");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, master) = common::slot_and_master(&sh).await;
    set_user_at(master, user, &seathold_rules()).await;
    set_user(user, &seathold_rules()).await;
    assert_eq!(
        daemon.wait_exit(Duration::from_secs(10)).await,
        Some(0),
        "exit code"
    );
    let held: Option<String> = r.get(&seat).await.expect("GET");
    assert_eq!(
        held, None,
        "the seat of the hold answered 503 is still held after the daemon stopped"
    );
}
