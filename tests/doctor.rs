//! `seathold doctor`, the real binary against real clusters: a well-set one
//! passes every check and exits 0; a badly-set one gets a FAIL or WARN line
//! for each thing that is wrong, naming what to change, and exits 1; a user
//! without some rights is told which to grant. The doctor leaves no key
//! behind.

use std::process::Command;

use seathold::dev::{ClusterOptions, LocalCluster};

/// Runs `seathold doctor` with `args`; answers the exit code and stdout.
fn doctor(args: &[&str]) -> (Option<i32>, String) {
    doctor_with(args, &[])
}

/// [`doctor`] with environment variables `env` set.
fn doctor_with(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .arg("doctor")
        .args(args)
        .env_remove("SEATHOLD_REDIS_NODES")
        .env_remove("SEATHOLD_REDIS_USERNAME")
        .env_remove("SEATHOLD_REDIS_PASSWORD")
        .envs(env.iter().copied())
        .output()
        .expect("run seathold doctor");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (out.status.code(), format!("{stdout}{stderr}"))
}

/// Starts a cluster with `opts` and runs the doctor against it as the
/// default user; answers the cluster, its seeds, the exit code and report.
fn start_and_check(opts: ClusterOptions) -> (LocalCluster, String, Option<i32>, String) {
    // The message says how to install redis-server when it is missing.
    let cluster = LocalCluster::start_blocking(opts)
        .unwrap_or_else(|e| panic!("cannot start a test Redis Cluster: {e}"));
    let seeds = cluster.seed_urls().join(",");
    let (code, report) = doctor(&["--redis-nodes", &seeds]);
    (cluster, seeds, code, report)
}

fn config(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The line of check `name` (`<STATUS>  <name>: …`), or a panic showing
/// the whole report.
fn line<'r>(report: &'r str, name: &str) -> &'r str {
    report
        .lines()
        .find(|l| {
            l.get(6..)
                .is_some_and(|rest| rest.starts_with(&format!("{name}:")))
        })
        .unwrap_or_else(|| panic!("no line for {name:?} in:\n{report}"))
}

/// Runs `f` on a plain connection to every node of `cluster`.
fn each_node(cluster: &LocalCluster, f: impl Fn(&mut redis::Connection)) {
    for node in cluster.nodes() {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}", node.port))
            .and_then(|c| c.get_connection())
            .expect("node connection");
        f(&mut conn);
    }
}

/// Keys on every node of `cluster`, summed.
fn keys(cluster: &LocalCluster) -> u64 {
    let total = std::sync::atomic::AtomicU64::new(0);
    each_node(cluster, |c| {
        let n: u64 = redis::cmd("DBSIZE").query(c).expect("DBSIZE");
        total.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    });
    total.into_inner()
}

#[test]
fn a_well_set_cluster_passes_every_check() {
    let (cluster, seeds, code, report) = start_and_check(ClusterOptions {
        node_timeout_ms: 5000,
        extra_config: config(&[
            ("appendonly", "yes"),
            ("notify-keyspace-events", "Ex"),
            ("maxmemory-policy", "noeviction"),
        ]),
        ..Default::default()
    });
    assert_eq!(code, Some(0), "{report}");
    for l in report.lines() {
        assert!(l.starts_with("PASS  "), "every check passes:\n{report}");
        assert!(!l.contains("; "), "a pass gives no advice:\n{l}");
    }
    assert!(line(&report, "slot coverage").contains("all 16384 slots served by 3 masters"));
    assert!(line(&report, "replicas").contains("every master (3) has at least 1 replica"));
    assert!(line(&report, "appendonly").contains("\"yes\" on all 6 nodes"));
    assert!(line(&report, "redis version").contains(" on all 6 nodes"));
    assert!(line(&report, "notify-keyspace-events").contains("on all 6 nodes"));
    assert!(line(&report, "cluster-node-timeout").contains("\"5000\""));
    assert!(
        line(&report, "clocks").contains("the 6 nodes' clocks (masters and replicas) are within")
    );
    let scripts = seathold::scripts::Scripts::embedded().all().len();
    assert!(line(&report, "scripts").contains(&format!(
        "all {scripts} scripts of lua/ load on all 3 masters"
    )));
    let acl: Vec<_> = report.lines().filter(|l| l.contains("  acl ")).collect();
    assert_eq!(acl.len(), 6, "one ACL line per node:\n{report}");
    for l in acl {
        assert!(
            l.contains("PASS") && l.contains("user default may run all "),
            "{l}"
        );
    }
    assert_eq!(keys(&cluster), 0, "the scratch keys are gone");

    // Replicas with a narrower ACL than their masters: each would run with
    // it once promoted. The check ran on masters only and passed.
    each_node(&cluster, |c| {
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(c).expect("ROLE");
        let replica = matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"slave");
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", "narrow", "on", ">doctor-secret", "~seat-hold:*"]);
        setuser.arg(&["&*", "+@all"]);
        if replica {
            setuser.arg("-evalsha");
        }
        let _: () = setuser.query(c).expect("ACL SETUSER");
    });
    let (code, report) = doctor(&[
        "--redis-nodes",
        &seeds,
        "--redis-username",
        "narrow",
        "--redis-password",
        "doctor-secret",
    ]);
    assert_eq!(code, Some(1), "{report}");
    let acl: Vec<_> = report.lines().filter(|l| l.contains("  acl ")).collect();
    assert_eq!(acl.len(), 6, "one ACL line per node:\n{report}");
    for l in acl {
        if l.contains("(replica)") {
            assert!(
                l.starts_with("FAIL") && l.contains("user narrow is denied +evalsha"),
                "{l}"
            );
        } else {
            assert!(l.starts_with("PASS"), "{l}");
        }
    }
}

#[test]
fn a_badly_set_cluster_gets_a_line_for_each_problem_and_exit_1() {
    let (cluster, seeds, code, report) = start_and_check(ClusterOptions {
        replicas_per_master: 0,
        node_timeout_ms: 20_000,
        extra_config: config(&[
            ("appendonly", "no"),
            ("notify-keyspace-events", "\"\""),
            ("maxmemory-policy", "allkeys-lru"),
        ]),
        ..Default::default()
    });
    assert_eq!(code, Some(1), "{report}");
    for (name, status, found, fix) in [
        (
            "appendonly",
            "FAIL",
            "\"no\" on all 3 nodes",
            "set appendonly yes",
        ),
        ("replicas", "FAIL", "too few replicas", "at least 1 replica"),
        (
            "notify-keyspace-events",
            "FAIL",
            "\"\" on all 3 nodes",
            "notify-keyspace-events Ex",
        ),
        (
            "maxmemory-policy",
            "FAIL",
            "\"allkeys-lru\"",
            "maxmemory-policy noeviction",
        ),
        (
            "cluster-node-timeout",
            "WARN",
            "\"20000\"",
            "between 1000 and 15000",
        ),
    ] {
        let l = line(&report, name);
        assert!(l.starts_with(status), "{name} should be {status}: {l}");
        assert!(l.contains(found), "{name} should report {found:?}: {l}");
        assert!(
            l.contains("; ") && l.contains(fix),
            "{name} should say {fix:?}: {l}"
        );
    }
    // What is right is still reported as right.
    assert!(
        line(&report, "slot coverage").starts_with("PASS"),
        "{report}"
    );
    assert!(line(&report, "scripts").starts_with("PASS"), "{report}");

    // A user without WAIT and PEXPIRETIME, and limited to another prefix.
    each_node(&cluster, |c| {
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", "limited", "on", ">doctor-secret", "~seat-hold:*"])
            .arg(&["&*", "+@all", "-wait", "-pexpiretime"])
            .query(c)
            .expect("ACL SETUSER");
    });
    let (code, report) = doctor(&[
        "--redis-nodes",
        &seeds,
        "--redis-username",
        "limited",
        "--redis-password",
        "doctor-secret",
    ]);
    assert_eq!(code, Some(1), "{report}");
    let acl: Vec<_> = report.lines().filter(|l| l.contains("  acl ")).collect();
    assert_eq!(
        acl.len(),
        3,
        "one ACL line per node (no replicas):\n{report}"
    );
    for l in acl {
        assert!(l.starts_with("FAIL"), "{l}");
        assert!(
            l.contains("user limited is denied +pexpiretime, +wait"),
            "{l}"
        );
        assert!(l.contains("ACL SETUSER limited +pexpiretime +wait"), "{l}");
    }
    let (_, report) = doctor(&[
        "--redis-nodes",
        &seeds,
        "--redis-username",
        "limited",
        "--redis-password",
        "doctor-secret",
        "--key-prefix",
        "elsewhere:",
    ]);
    assert!(
        line(&report, "scripts").starts_with("PASS"),
        "scripts need no key rights:\n{report}"
    );
    assert!(report.contains("~elsewhere:*"), "{report}");
    assert_eq!(keys(&cluster), 0, "the scratch keys are gone");
}

#[test]
fn no_cluster_is_a_failed_check_and_no_seed_a_config_error() {
    let (code, report) = doctor(&["--redis-nodes", "redis://127.0.0.1:1"]);
    assert_eq!(code, Some(1), "{report}");
    let l = line(&report, "connection");
    assert!(l.starts_with("FAIL") && l.contains("127.0.0.1:1"), "{l}");
    assert!(l.contains("check --redis-nodes"), "{l}");

    let (code, report) = doctor(&[]);
    assert_eq!(code, Some(2), "{report}");
    assert!(report.contains("no Redis seed nodes"), "{report}");

    // Settings `serve` refuses are a configuration error here too, before
    // any check: the doctor vouches for what `serve` would run.
    for bad in [
        &["--key-prefix", "a{b}:"][..],
        &[
            "--confirm-wait-timeout-ms",
            "5000",
            "--redis-timeout-ms",
            "2000",
        ][..],
    ] {
        let args = [&["--redis-nodes", "redis://127.0.0.1:1"][..], bad].concat();
        let (code, report) = doctor(&args);
        assert_eq!(code, Some(2), "{bad:?}: {report}");
        assert!(!report.contains("FAIL"), "{bad:?}: no check ran: {report}");
    }

    // A value set by environment variable is set, not a default that a
    // contradicting flag may lower: start-up stops. It was taken for the
    // default (the defaults were read with the environment too) and
    // silently lowered to the lifetime.
    let (code, report) = doctor_with(
        &[
            "--redis-nodes",
            "redis://127.0.0.1:1",
            "--max-hold-lifetime-ms",
            "1000",
        ],
        &[("SEATHOLD_MAX_TTL_MS", "5000")],
    );
    assert_eq!(code, Some(2), "{report}");
    assert!(report.contains("--max-ttl-ms (5000)"), "{report}");
}
