//! The command line: bad configuration stops start-up with one clear message,
//! every flag has an environment variable, and `--help` explains them. And
//! the logs: coloured only on a terminal and without `NO_COLOR`, JSON lists
//! as JSON arrays, a debug line per request naming method, route, show,
//! status, duration and peer.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seathold"));
    cmd.args(args).env_remove("SEATHOLD_REDIS_NODES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    // A configuration that should have been refused may start a daemon
    // instead: it is stopped after 20 s (code None) rather than hanging
    // the test.
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run seathold");
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = read(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(status) = child.try_wait().expect("wait for seathold") {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = format!(
        "{}{}",
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default()
    );
    (code, text)
}

/// Arguments, environment, and a word the error message must contain.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

#[test]
fn bad_configuration_stops_start_up_with_a_clear_message() {
    let cases: &[Case] = &[
        (
            &["serve", "--listen", "127.0.0.1:0"],
            &[],
            "no Redis seed nodes",
        ),
        // A bare `seathold` points at `seathold dev`.
        (&[], &[], "run `seathold dev`"),
        // A seed without a scheme: the message shows the URL to write.
        (
            &["--redis-nodes", "127.0.0.1:7000", "--listen", "127.0.0.1:0"],
            &[],
            "redis://127.0.0.1:7000",
        ),
        // `dev` makes its own cluster: Redis settings are refused, not
        // silently ignored.
        (
            &["dev", "--listen", "127.0.0.1:0", "--redis-username", "bob"],
            &[],
            "does not use --redis-username",
        ),
        (
            &["dev", "--listen", "127.0.0.1:0"],
            &[("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1")],
            "does not use --redis-nodes",
        ),
        (
            &["--redis-nodes", "not a url", "--listen", "127.0.0.1:0"],
            &[],
            "not a url",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--default-ttl-ms",
                "9000",
                "--max-ttl-ms",
                "8000",
            ],
            &[],
            "--default-ttl-ms",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--max-ttl-ms",
                "9000000",
            ],
            &[],
            "--max-hold-lifetime-ms",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--key-prefix",
                "a{b}:",
            ],
            &[],
            "braces",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--confirm-wait-timeout-ms",
                "5000",
            ],
            &[],
            "--redis-timeout-ms",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[
                ("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1"),
                ("SEATHOLD_MAX_SEATS_PER_HOLD", "0"),
            ],
            "--max-seats-per-hold",
        ),
        (&["--default-ttl-ms", "soon"], &[], "invalid value"),
        // A value given equal to its default is given, not a default that
        // a contradicting flag may lower: it was silently lowered, while
        // any other value was refused.
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--max-ttl-ms",
                "1800000",
                "--max-hold-lifetime-ms",
                "600000",
            ],
            &[],
            "--max-ttl-ms (1800000) must be at most --max-hold-lifetime-ms (600000)",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--max-ttl-ms",
                "100000",
            ],
            &[("SEATHOLD_DEFAULT_TTL_MS", "300000")],
            "--default-ttl-ms (300000) must be positive and at most --max-ttl-ms (100000)",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--confirm-wait-timeout-ms",
                "1000",
                "--redis-timeout-ms",
                "1000",
            ],
            &[],
            "--confirm-wait-timeout-ms (1000) must be below --redis-timeout-ms (1000)",
        ),
        // A user name without a password: the Redis client sends AUTH only
        // with a password, so the daemon ran as `default`, silently.
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--redis-username",
                "seathold",
            ],
            &[],
            "--redis-username needs a password; for a nopass ACL user give any --redis-password",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[("SEATHOLD_REDIS_NODES", "redis://seathold@127.0.0.1:1")],
            "names user seathold but no password",
        ),
        // Ceilings: from about 1e17 ms every hold answered 500 (Lua
        // formats such numbers as floats), and expiries past the year 9999
        // gave an empty expiresAt.
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--default-ttl-ms",
                "315360000001",
                "--max-ttl-ms",
                "315360000001",
                "--max-hold-lifetime-ms",
                "315360000001",
            ],
            &[],
            "--default-ttl-ms (315360000001) must be at most 315360000000",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--max-hold-lifetime-ms",
                "18446744073709551615",
            ],
            &[],
            "--max-hold-lifetime-ms (18446744073709551615) must be at most 315360000000",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[
                ("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1"),
                ("SEATHOLD_IDEMPOTENCY_TTL_MS", "100000000000000000"),
            ],
            "--idempotency-ttl-ms (100000000000000000) must be at most 315360000000",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--events-max-len",
                "1000000001",
            ],
            &[],
            "--events-max-len (1000000001) must be at most 1000000000",
        ),
        // A token no client can send in `Authorization: Bearer` (a trailing
        // newline from a secret file, a space, a control character,
        // non-ASCII): every guarded route would answer 401 forever.
        (
            &["--listen", "127.0.0.1:0"],
            &[
                ("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1"),
                ("SEATHOLD_API_TOKEN", "0123456789abcdef0123\n"),
            ],
            "--api-token must be visible ASCII",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--api-token",
                " 0123456789abcdef0123",
            ],
            &[],
            "--api-token must be visible ASCII",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--api-token",
                "0123456789 abcdef\t0123",
            ],
            &[],
            "--api-token must be visible ASCII",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--api-token",
                "0123456789abcdéf0123",
            ],
            &[],
            "--api-token must be visible ASCII",
        ),
        (
            &[
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--log",
                "info,seathold=loud",
            ],
            &[],
            "--log filter \"info,seathold=loud\"",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[
                ("SEATHOLD_REDIS_NODES", "redis://127.0.0.1:1"),
                ("SEATHOLD_LOG", "=info"),
            ],
            "\"=info\"",
        ),
    ];
    for (args, env, needle) in cases {
        let (code, text) = run(args, env);
        assert_eq!(
            code,
            Some(2),
            "{args:?} {env:?} should fail start-up:\n{text}"
        );
        assert!(
            text.contains(needle),
            "{args:?}: message should mention {needle:?}:\n{text}"
        );
        assert!(
            text.lines().filter(|l| !l.trim().is_empty()).count() <= 4,
            "one clear message, not a dump:\n{text}"
        );
    }

    // A configuration that cannot work is named before the port is tried:
    // with the port taken (another instance, a leftover `seathold dev`),
    // the message said only "address in use", and the missing seeds or
    // the bad URL came after the user had freed it.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = busy.local_addr().expect("addr").to_string();
    for (args, needle) in [
        (vec!["serve", "--listen", &port], "no Redis seed nodes"),
        (
            vec!["--redis-nodes", "not a url", "--listen", &port],
            "not a url",
        ),
        (
            vec![
                "--redis-nodes",
                "rediss://127.0.0.1:1",
                "--redis-ca-file",
                "/nonexistent/ca.pem",
                "--listen",
                &port,
            ],
            "/nonexistent/ca.pem",
        ),
    ] {
        let (code, text) = run(&args, &[]);
        assert_eq!(code, Some(2), "{args:?}:\n{text}");
        assert!(
            text.contains(needle),
            "{args:?}: should name {needle:?}:\n{text}"
        );
    }
    // A valid configuration on a taken port is not a configuration error:
    // exit 1, which a supervisor restarts (the old instance may still be
    // stopping), where it gives up on 2 (cluster/seathold.service).
    let args = ["--redis-nodes", "redis://127.0.0.1:1", "--listen", &port];
    let (code, text) = run(&args, &[]);
    assert_eq!(code, Some(1), "{args:?}:\n{text}");
    assert!(text.contains("cannot listen on"), "{text}");
    assert!(text.contains("--listen picks another address"), "{text}");
    drop(busy);
}

#[test]
fn help_names_every_flag_and_its_environment_variable() {
    let (code, help) = run(&["serve", "--help"], &[]);
    assert_eq!(code, Some(0));
    for (flag, env) in [
        ("--listen", "SEATHOLD_LISTEN"),
        ("--redis-nodes", "SEATHOLD_REDIS_NODES"),
        ("--redis-username", "SEATHOLD_REDIS_USERNAME"),
        ("--redis-password", "SEATHOLD_REDIS_PASSWORD"),
        ("--key-prefix", "SEATHOLD_KEY_PREFIX"),
        ("--default-ttl-ms", "SEATHOLD_DEFAULT_TTL_MS"),
        ("--max-ttl-ms", "SEATHOLD_MAX_TTL_MS"),
        ("--max-hold-lifetime-ms", "SEATHOLD_MAX_HOLD_LIFETIME_MS"),
        ("--max-seats-per-hold", "SEATHOLD_MAX_SEATS_PER_HOLD"),
        ("--confirm-wait-replicas", "SEATHOLD_CONFIRM_WAIT_REPLICAS"),
        (
            "--confirm-wait-timeout-ms",
            "SEATHOLD_CONFIRM_WAIT_TIMEOUT_MS",
        ),
        ("--redis-timeout-ms", "SEATHOLD_REDIS_TIMEOUT_MS"),
        ("--shutdown-drain-ms", "SEATHOLD_SHUTDOWN_DRAIN_MS"),
        ("--log-format", "SEATHOLD_LOG_FORMAT"),
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
        assert!(help.contains(env), "--help lacks {env}");
    }
    let (code, help) = run(&["dev", "--help"], &[]);
    assert_eq!(code, Some(0));
    assert!(
        help.contains("--masters") && help.contains("--listen"),
        "{help}"
    );
}

/// Runs the daemon (against nothing, for a second) the way a terminal
/// would, through `script`'s pseudo-terminal; answers what it printed.
fn on_a_terminal(no_color: Option<&str>) -> String {
    let bin = env!("CARGO_BIN_EXE_seathold");
    let script = common::required(
        "script",
        "the terminal test runs the daemon on a pseudo-terminal through it: install \
         util-linux (Debian/Ubuntu: `sudo apt-get install bsdutils`)",
    );
    let mut cmd = Command::new(script);
    cmd.args(["-qec"])
        .arg(format!(
            "timeout -s INT 1 {bin} --redis-nodes redis://127.0.0.1:1 --listen 127.0.0.1:0 --shutdown-drain-ms 0"
        ))
        .arg("/dev/null")
        .env_remove("NO_COLOR");
    if let Some(value) = no_color {
        cmd.env("NO_COLOR", value);
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run `script` (util-linux; apt-get install bsdutils): {e}")
    });
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn logs_are_coloured_only_on_a_terminal_without_no_color() {
    const ESC: &str = "\x1b[";
    let tty = on_a_terminal(None);
    assert!(tty.contains("serving HTTP"), "{tty}");
    assert!(tty.contains(ESC), "a terminal gets colours:\n{tty}");
    let plain = on_a_terminal(Some("1"));
    assert!(plain.contains("serving HTTP"), "{plain}");
    assert!(!plain.contains(ESC), "NO_COLOR=1 turns them off:\n{plain}");
    // An empty NO_COLOR does not count (no-color.org).
    assert!(on_a_terminal(Some("")).contains(ESC));

    // Not a terminal: a pipe, as under systemd or a log collector.
    let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args([
            "--redis-nodes",
            "redis://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
        ])
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped())
        .spawn()
        .expect("run seathold");
    let lines = stderr_lines(&mut child);
    let first = lines
        .recv_timeout(Duration::from_secs(10))
        .expect("a log line");
    let _ = child.kill();
    let _ = child.wait();
    assert!(!first.contains(ESC), "a pipe gets no colours: {first:?}");
}

/// The child's stderr, line by line.
/// What a started daemon (its stderr piped) wrote until it said "serving
/// HTTP", or until 10 s passed; then stops it.
fn until_serving(child: &mut std::process::Child) -> String {
    let lines = stderr_lines(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = String::new();
    while !seen.contains("serving HTTP") {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => seen.push_str(&format!("{line}\n")),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    seen
}

fn stderr_lines(child: &mut std::process::Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// JSON log lines, kept as read so that a search may find an earlier one.
struct JsonLog {
    lines: mpsc::Receiver<String>,
    seen: Vec<Value>,
}

impl JsonLog {
    /// The first line for which `pick` is true, waiting up to 30 s for it.
    fn find(&mut self, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
        if let Some(found) = self.seen.iter().find(|v| pick(v)) {
            return found.clone();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no log line {what} within 30 s"));
            let value: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            self.seen.push(value.clone());
            if pick(&value) {
                return value;
            }
        }
    }
}

/// A request over a fresh connection; answers its status and our address.
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).expect("connect");
    let local = conn.local_addr().expect("local addr").to_string();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut answer = String::new();
    let _ = conn.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, local)
}

/// `seathold` against the test cluster with JSON logs and `args`, once it
/// serves: the process, its log and its HTTP address.
fn serve_with_json_logs(args: &[&str]) -> (std::process::Child, JsonLog, String) {
    let seeds = common::cluster().seed_urls().join(",");
    let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["--redis-nodes", &seeds, "--listen", "127.0.0.1:0"])
        .args(["--log-format", "json"])
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run seathold");
    let mut log = JsonLog {
        lines: stderr_lines(&mut child),
        seen: Vec::new(),
    };
    let serving = log.find("serving HTTP", |v| v["fields"]["message"] == "serving HTTP");
    let addr = serving["fields"]["addr"].as_str().expect("addr").to_owned();
    (child, log, addr)
}

#[test]
fn json_logs_carry_lists_as_arrays_and_a_debug_line_per_request() {
    let (mut child, mut log, addr) = serve_with_json_logs(&["--log", "info,seathold=debug"]);

    let topology = log.find("about the topology", |v| {
        v["fields"]["message"] == "Redis Cluster topology changed"
    });
    let masters = topology["fields"]["masters"]
        .as_array()
        .unwrap_or_else(|| panic!("masters is a JSON array: {topology}"));
    assert_eq!(masters.len(), 3, "{topology}");
    assert!(masters
        .iter()
        .all(|m| m.as_str().is_some_and(|m| m.starts_with("127.0.0.1:"))));

    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&addr, "/readyz").0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let show = common::show("logs");
    let (status, peer) = get(&addr, &format!("/v1/shows/{show}/seats/E7"));
    assert_eq!(status, 200);
    let line = log.find("for the request", |v| {
        v["fields"]["message"] == "request" && v["fields"]["peer"] == peer.as_str()
    });
    let _ = child.kill();
    let _ = child.wait();
    let f = &line["fields"];
    assert_eq!(line["level"], "DEBUG", "{line}");
    assert_eq!(f["method"], "GET", "{line}");
    assert_eq!(f["route"], "/v1/shows/{show}/seats/{seat}", "{line}");
    assert_eq!(f["show"], show.as_str(), "{line}");
    assert_eq!(f["status"], 200, "{line}");
    assert!(f["micros"].as_u64().is_some_and(|m| m > 0), "{line}");
    // A route without a show has no show field.
    let probe = log.find("for a probe", |v| v["fields"]["route"] == "/readyz");
    assert!(probe["fields"].get("show").is_none(), "{probe}");
}

/// A bound set alone lowers the defaults it would contradict instead of
/// stopping start-up: `--max-hold-lifetime-ms 3000` lowers `--max-ttl-ms`
/// (and with it `--default-ttl-ms`), `--redis-timeout-ms 500` lowers
/// `--confirm-wait-timeout-ms`; small `--events-max-len` and
/// `--idempotency-ttl-ms` and a short `--api-token` (warned about) are
/// accepted. Each of these stopped start-up with exit code 2, so a
/// deployment or test suite that set one of the contract's flags alone
/// could not start the daemon.
#[test]
fn a_bound_set_alone_lowers_the_defaults_it_contradicts() {
    let (mut child, mut log, addr) = serve_with_json_logs(&[
        "--max-hold-lifetime-ms",
        "3000",
        "--redis-timeout-ms",
        "500",
        "--events-max-len",
        "10",
        "--idempotency-ttl-ms",
        "500",
        "--api-token",
        "secret",
    ]);
    for flag in [
        "--max-ttl-ms",
        "--default-ttl-ms",
        "--confirm-wait-timeout-ms",
    ] {
        log.find(flag, |v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(&format!("{flag} lowered")))
        });
    }
    log.find("the short token's warning", |v| {
        v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--api-token is shorter"))
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&addr, "/readyz").0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A hold without ttlMs lives at most the lifetime.
    let show = common::show("settle");
    let mut conn = TcpStream::connect(&addr).expect("connect");
    write!(
        conn,
        "POST /v1/shows/{show}/seats/A1/hold HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut answer = String::new();
    let _ = conn.read_to_string(&mut answer);
    let _ = child.kill();
    let _ = child.wait();
    // Each said once: the settings are settled once (main and the server
    // both settled them, and the token's warning came twice). The lines before
    // "serving HTTP" are all in `seen`.
    for what in [
        "--api-token is shorter",
        "--max-ttl-ms lowered",
        "--default-ttl-ms lowered",
        "--confirm-wait-timeout-ms lowered",
    ] {
        let said = log
            .seen
            .iter()
            .filter(|v| {
                v["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(what))
            })
            .count();
        assert_eq!(said, 1, "{what:?} logged {said} times: {:?}", log.seen);
    }
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or_default())
        .expect("a JSON hold");
    let left = body["expiresInMs"].as_i64().expect("expiresInMs");
    assert!((1..=3000).contains(&left), "{body}");
}

/// TLS files with a plain `redis://` seed are refused: the Redis client
/// switches every connection to TLS once it has certificates, so the daemon
/// spoke TLS to the plain ports and only ever timed out. And a TLS file that
/// holds no certificate (or no key) is named with its flag: a CA file
/// without one gave an empty trust store, every connection then failing
/// with `UnknownIssuer`.
#[test]
fn tls_files_need_tls_seeds_and_pem_contents() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let pair =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("a certificate");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8 path").to_owned()
    };
    let cert = write("cert.pem", &pair.cert.pem());
    let key = write("key.pem", &pair.signing_key.serialize_pem());
    let junk = write("junk.pem", "not a PEM file\n");
    let tls = "rediss://127.0.0.1:1";
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec![
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--redis-ca-file",
                &cert,
            ],
            vec!["--redis-ca-file", "redis://127.0.0.1:1", "rediss://"],
        ),
        (
            vec![
                "--redis-nodes",
                "rediss://127.0.0.1:1,redis://127.0.0.1:2",
                "--redis-cert-file",
                &cert,
                "--redis-key-file",
                &key,
            ],
            vec!["--redis-cert-file", "redis://127.0.0.1:2"],
        ),
        (
            vec!["--redis-nodes", tls, "--redis-ca-file", &junk],
            vec!["--redis-ca-file", &junk, "no PEM certificate"],
        ),
        (
            vec!["--redis-nodes", tls, "--redis-ca-file", &key],
            vec!["--redis-ca-file", &key, "no PEM certificate"],
        ),
        (
            vec![
                "--redis-nodes",
                tls,
                "--redis-cert-file",
                &junk,
                "--redis-key-file",
                &key,
            ],
            vec!["--redis-cert-file", &junk, "no PEM certificate"],
        ),
        (
            vec![
                "--redis-nodes",
                tls,
                "--redis-cert-file",
                &cert,
                "--redis-key-file",
                &cert,
            ],
            vec!["--redis-key-file", &cert, "no PEM private key"],
        ),
    ];
    for (mut args, needles) in cases {
        args.extend(["--listen", "127.0.0.1:0"]);
        for sub in ["serve", "doctor"] {
            let mut argv = vec![sub];
            argv.extend(&args);
            let (code, text) = run(&argv, &[]);
            assert_eq!(code, Some(2), "{argv:?} should fail start-up:\n{text}");
            for needle in &needles {
                assert!(
                    text.contains(needle),
                    "{argv:?}: should name {needle:?}:\n{text}"
                );
            }
            assert!(!text.contains("is not usable"), "{argv:?}:\n{text}");
        }
    }
    // Good files with TLS seeds pass the checks (and the daemon starts,
    // not ready, as nothing listens there).
    let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["--redis-nodes", tls, "--listen", "127.0.0.1:0"])
        .args(["--redis-ca-file", &cert, "--redis-cert-file", &cert])
        .args(["--redis-key-file", &key])
        .stderr(Stdio::piped())
        .spawn()
        .expect("run seathold");
    let seen = until_serving(&mut child);
    assert!(seen.contains("serving HTTP"), "{seen}");
}

/// Passwords in seed URLs are not echoed: the start-up errors that name a
/// URL (of serve, doctor and delete-show) show `user:***@`, and `--help`
/// does not print SEATHOLD_REDIS_NODES's value.
#[test]
fn seed_url_passwords_are_not_echoed() {
    const SECRET: &str = "s3cr3tPW";
    let cases: &[(&[&str], &str)] = &[
        // No scheme: the hint shows the URL to write.
        (
            &["--redis-nodes", "user:s3cr3tPW@127.0.0.1:7000"],
            "redis://user:***@127.0.0.1:7000",
        ),
        (
            &["--redis-nodes", "redis://user:s3cr3tPW@127.0.0.1:notaport"],
            "redis://user:***@127.0.0.1:notaport",
        ),
        // TLS and plain seeds mixed.
        (
            &[
                "--redis-nodes",
                "rediss://user:s3cr3tPW@127.0.0.1:1,redis://user:s3cr3tPW@127.0.0.1:2",
            ],
            "user:***@127.0.0.1:2",
        ),
        (
            &[
                "--redis-nodes",
                "redis://user:s3cr3tPW@127.0.0.1:1",
                "--redis-ca-file",
                "/nonexistent/ca.pem",
            ],
            "redis://user:***@127.0.0.1:1",
        ),
    ];
    for (args, needle) in cases {
        for sub in [&["serve"][..], &["doctor"], &["delete-show", "42"]] {
            let mut argv = sub.to_vec();
            argv.extend(*args);
            argv.extend(["--listen", "127.0.0.1:0"]);
            let (code, text) = run(&argv, &[]);
            assert_ne!(code, Some(0), "{argv:?}:\n{text}");
            assert!(code.is_some(), "{argv:?} should stop at once:\n{text}");
            assert!(
                !text.contains(SECRET),
                "{argv:?} echoes the password:\n{text}"
            );
            assert!(
                text.contains(needle),
                "{argv:?}: should name {needle:?}:\n{text}"
            );
        }
    }
    let (code, help) = run(
        &["serve", "--help"],
        &[("SEATHOLD_REDIS_NODES", "redis://user:s3cr3tPW@127.0.0.1:1")],
    );
    assert_eq!(code, Some(0), "{help}");
    assert!(help.contains("SEATHOLD_REDIS_NODES"), "{help}");
    assert!(
        !help.contains(SECRET),
        "--help echoes the password:\n{help}"
    );
}

/// `seathold delete-show` exits 2 on bad Redis flags, as serve and doctor
/// do (it exited 1, the code of a refused show or a failed Redis).
#[test]
fn delete_show_exits_2_on_bad_redis_flags() {
    for (args, needle) in [
        (&["delete-show", "42"][..], "no Redis seed nodes"),
        (
            &["delete-show", "--redis-nodes", "not a url", "42"],
            "not a url",
        ),
        (
            &[
                "delete-show",
                "--redis-nodes",
                "redis://bob@127.0.0.1:1",
                "42",
            ],
            "no password",
        ),
    ] {
        let (code, text) = run(args, &[]);
        assert_eq!(code, Some(2), "{args:?}:\n{text}");
        assert!(
            text.contains(needle),
            "{args:?}: should name {needle:?}:\n{text}"
        );
    }
}

/// `--max-seats-per-hold` near its ceiling with the default
/// `--max-body-bytes`: a hold of that many 64-character seat ids (about
/// 67 KB) would get 413, so start-up warns (and goes on).
#[test]
fn a_body_limit_too_small_for_the_largest_hold_is_warned_about() {
    let warned = |args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
            .args([
                "--redis-nodes",
                "redis://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
            ])
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .expect("run seathold");
        let seen = until_serving(&mut child);
        assert!(
            seen.contains("serving HTTP"),
            "{args:?} should start:\n{seen}"
        );
        seen.contains("--max-body-bytes (65536) is below 70 bytes per seat")
    };
    assert!(warned(&["--max-seats-per-hold", "1000"]));
    assert!(!warned(&["--max-seats-per-hold", "20"]));
    assert!(!warned(&[
        "--max-seats-per-hold",
        "1000",
        "--max-body-bytes",
        "70000"
    ]));
}
