//! The operations assets in `cluster/` against a real seathold: every metric
//! that `cluster/alerts.yml` and `cluster/grafana-dashboard.json` query must
//! be exported on `/metrics`, so that a renamed or dropped metric breaks this
//! test instead of silently emptying a dashboard panel or disarming an alert.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{server, show};

const ALERTS: &str = "cluster/alerts.yml";
const DASHBOARD: &str = "cluster/grafana-dashboard.json";

/// Metrics the API contract fixes and that both assets must use.
const CONTRACT: &[&str] = &[
    "seathold_cluster_ready",
    "seathold_hold_conflicts_total",
    "seathold_hold_expiries_total",
    "seathold_http_request_duration_seconds",
];

/// Every metric the API contract fixes (version 1 and 1.1), and the ones an
/// SRE needs at an on-sale besides: how much the seat views answer without
/// Redis, and which versions run (a rolling upgrade). The dashboard charts
/// each of them, so that none is exported for nobody to look at.
const CHARTED: &[&str] = &[
    "seathold_holds_total",
    "seathold_seats_held_total",
    "seathold_hold_conflicts_total",
    "seathold_hold_expiries_total",
    "seathold_releases_total",
    "seathold_extends_total",
    "seathold_confirms_total",
    "seathold_cross_slot_rejections_total",
    "seathold_http_request_duration_seconds",
    "seathold_redis_errors_total",
    "seathold_cluster_ready",
    "seathold_orphan_releases_total",
    "seathold_idempotent_replays_total",
    "seathold_events_total",
    "seathold_event_subscribers",
    "seathold_event_delivery_seconds",
    "seathold_pool_units_held_total",
    "seathold_holder_limit_rejections_total",
    "seathold_view_answers_total",
    "seathold_build_info",
];

/// Series suffixes of a histogram (or summary) in the text exposition.
const SERIES_SUFFIXES: &[&str] = &["_bucket", "_sum", "_count"];

fn read_asset(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Every `seathold_[a-z0-9_]+` identifier in `text`, with a histogram's
/// `_bucket` / `_sum` / `_count` suffix taken off (the name that `# TYPE`
/// declares).
fn metric_names(text: &str) -> BTreeSet<String> {
    const PREFIX: &str = "seathold_";
    let bytes = text.as_bytes();
    let is_ident = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(found) = text[from..].find(PREFIX) {
        let start = from + found;
        let mut end = start + PREFIX.len();
        while end < bytes.len() && is_ident(bytes[end]) {
            end += 1;
        }
        from = end;
        // Part of a longer identifier (`my_seathold_x`, `Xseathold_`): not ours.
        if start > 0 && (is_ident(bytes[start - 1]) || bytes[start - 1].is_ascii_uppercase()) {
            continue;
        }
        let name = text[start..end].trim_end_matches('_');
        if name.len() < PREFIX.len() {
            continue;
        }
        let base = SERIES_SUFFIXES
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(base.to_owned());
    }
    names
}

/// Metric names of a Prometheus text exposition: those declared by
/// `# TYPE name kind` and those of sample lines (`name{…} v` or `name v`).
fn exported_names(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.split_whitespace().next() {
                names.insert(name.to_owned());
            }
        } else if !line.is_empty() && !line.starts_with('#') {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// Whether `name` (a base name) is on `/metrics`: as itself (a counter or
/// gauge sample, or a `# TYPE` line), or as a histogram's series.
fn is_exported(exported: &BTreeSet<String>, name: &str) -> bool {
    exported.contains(name)
        || SERIES_SUFFIXES
            .iter()
            .any(|s| exported.contains(&format!("{name}{s}")))
}

fn missing(exported: &BTreeSet<String>, wanted: &BTreeSet<String>) -> Vec<String> {
    wanted
        .iter()
        .filter(|n| !is_exported(exported, n))
        .cloned()
        .collect()
}

#[test]
fn scan_finds_metric_names_and_strips_histogram_suffixes() {
    let text = r#"
        expr: sum(rate(seathold_http_request_duration_seconds_bucket{route="x"}[5m]))
        "expr": "seathold_cluster_ready{job=~\"$job\"} == 0",
        seathold_holds_total / seathold_redis_command_duration_seconds_count
        SeatholdNotReady, job="seathold", my_seathold_thing, "seathold_" prefix
    "#;
    let names: Vec<String> = metric_names(text).into_iter().collect();
    assert_eq!(
        names,
        [
            "seathold_cluster_ready",
            "seathold_holds_total",
            "seathold_http_request_duration_seconds",
            "seathold_redis_command_duration_seconds",
        ]
    );
    let exported = exported_names(
        "# HELP seathold_x_seconds x\n# TYPE seathold_x_seconds histogram\n\
         seathold_x_seconds_bucket{le=\"0.5\"} 1\nseathold_y_total 3\nseathold_z{kind=\"a\"} 0\n",
    );
    assert!(is_exported(&exported, "seathold_x_seconds"));
    assert!(is_exported(&exported, "seathold_y_total"));
    assert!(is_exported(&exported, "seathold_z"));
    assert!(!is_exported(&exported, "seathold_y"));
}

#[test]
fn assets_name_the_contract_metrics() {
    for asset in [ALERTS, DASHBOARD] {
        let names = metric_names(&read_asset(asset));
        for name in CONTRACT {
            assert!(
                names.contains(*name),
                "{asset} does not use the contract metric {name}; it uses {names:?}"
            );
        }
    }
}

#[test]
fn the_dashboard_charts_every_fixed_metric() {
    let names = metric_names(&read_asset(DASHBOARD));
    let absent: Vec<&str> = CHARTED
        .iter()
        .copied()
        .filter(|name| !names.contains(*name))
        .collect();
    assert!(absent.is_empty(), "{DASHBOARD} has no panel for {absent:?}");
}

#[test]
fn dashboard_is_importable_json() {
    let dash: serde_json::Value =
        serde_json::from_str(&read_asset(DASHBOARD)).expect("the dashboard is valid JSON");
    assert!(
        dash["__inputs"]
            .as_array()
            .is_some_and(|i| i.iter().any(|i| i["name"] == "DS_PROMETHEUS")),
        "the dashboard declares the DS_PROMETHEUS datasource input"
    );
    let panels = dash["panels"].as_array().expect("panels");
    let mut queries = 0;
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries += 1;
            assert_eq!(
                target["datasource"]["uid"], "${DS_PROMETHEUS}",
                "panel {:?} queries another datasource",
                panel["title"]
            );
            assert!(
                target["expr"]
                    .as_str()
                    .is_some_and(|e| e.contains("seathold_")),
                "panel {:?} has a query without a seathold metric: {target}",
                panel["title"]
            );
        }
    }
    assert!(queries >= 15, "only {queries} queries in the dashboard");
}

#[tokio::test]
async fn every_metric_in_alerts_and_dashboard_is_exported() {
    let mut wanted = BTreeSet::new();
    for asset in [ALERTS, DASHBOARD] {
        let names = metric_names(&read_asset(asset));
        assert!(!names.is_empty(), "no seathold metric found in {asset}");
        wanted.extend(names);
    }

    let s = server().await;
    // A hold gives the HTTP and Redis latency histograms their first samples
    // (histograms appear on /metrics only once something was recorded).
    s.hold(&show("ops"), &["E7"]).await;

    // Some gauges (expiry subscriptions, keyspace events) are set by
    // background tasks shortly after the server is ready: give them time,
    // then report everything still missing at once.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (absent, exposition) = loop {
        let exposition = s.metrics().await;
        let absent = missing(&exported_names(&exposition), &wanted);
        if absent.is_empty() || Instant::now() >= deadline {
            break (absent, exposition);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        absent.is_empty(),
        "{ALERTS} / {DASHBOARD} query metrics that seathold does not export: {absent:?}\n\
         --- /metrics ---\n{exposition}"
    );
    s.stop().await;
}

/// A port whose cluster bus port (+10000) is free too.
fn free_node_port(taken: &[u16]) -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        if port < 55_000
            && !taken.contains(&port)
            && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
    }
}

/// `n` distinct free node ports (see [`free_node_port`]).
fn node_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        ports.push(free_node_port(&ports));
    }
    ports
}

/// Runs `cluster/start-cluster.sh` with `options`, data in `data`, nodes on
/// `ports` (failing with how to install them when the Redis tools are
/// missing).
fn start_cluster(options: &[&str], data: &Path, ports: &[u16]) -> std::process::Output {
    let why = "install it: apt-get update && apt-get install -y redis-server redis-tools";
    common::required("redis-server", why);
    common::required("redis-cli", why);
    std::process::Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/start-cluster.sh"))
        .args(options)
        .arg(data)
        .args(ports.iter().map(u16::to_string))
        .output()
        .expect("run start-cluster.sh")
}

/// Stops the nodes of `data` and deletes it (`cluster/stop-cluster.sh -x`).
fn stop_cluster(data: &Path) -> std::process::Output {
    std::process::Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/stop-cluster.sh"))
        .arg("-x")
        .arg(data)
        .output()
        .expect("run stop-cluster.sh")
}

/// The moment `cluster/start-cluster.sh` says "cluster ready", the cluster
/// passes `seathold doctor`. Before, it said so about 3 s before Redis 7.0
/// listed the replicas in CLUSTER SLOTS, and a doctor run right after it
/// failed "masters with too few replicas" (3 runs out of 3). Its data
/// folder's name has a space: the script wrote the nodes' paths into their
/// configuration unquoted, and Redis refused `dir /tmp/my dir/…`.
#[test]
fn a_cluster_the_script_calls_ready_passes_the_doctor() {
    let data = std::env::temp_dir().join(format!(
        "seathold ready cluster-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let ports = node_ports(6);
    let out = start_cluster(&["-r", "1", "-t", "60"], &data, &ports);
    let doctor = std::process::Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["doctor", "--redis-nodes"])
        .arg(format!("redis://127.0.0.1:{}", ports[0]))
        .output()
        .expect("run seathold doctor");
    let stopped = stop_cluster(&data);
    assert!(
        out.status.success(),
        "start-cluster.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&doctor.stdout);
    assert!(
        doctor.status.success() && report.contains("PASS  replicas"),
        "seathold doctor right after \"cluster ready\":\n{report}{}",
        String::from_utf8_lossy(&doctor.stderr)
    );
    assert!(stopped.status.success(), "stop-cluster.sh: {stopped:?}");
    assert!(
        String::from_utf8_lossy(&stopped.stdout).contains("stopped 6 node(s)"),
        "stop-cluster.sh stops every node: {}",
        String::from_utf8_lossy(&stopped.stdout)
    );
}

/// `cluster/start-cluster.sh` brings a cluster up from a template whose
/// `dir` cannot be used here. The shipped template names /var/lib/redis,
/// which an ordinary user cannot write and a host without a Redis package
/// lacks; Redis changes into `dir` while it reads its configuration, and
/// the script included the template before the node's own `dir`, so every
/// node stopped with "FATAL CONFIG FILE ERROR … dir /var/lib/redis".
#[test]
fn start_cluster_does_not_use_the_templates_dir() {
    let scratch = std::env::temp_dir().join(format!(
        "seathold-start-cluster-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let shipped = read_asset("cluster/redis.conf");
    assert!(
        shipped.contains("\ndir /var/lib/redis\n"),
        "the template's dir"
    );
    let template = scratch.join("redis.conf");
    std::fs::write(
        &template,
        shipped.replace(
            "\ndir /var/lib/redis\n",
            "\ndir /nonexistent/seathold-test\n",
        ),
    )
    .expect("template");
    let data = scratch.join("nodes");
    let ports = node_ports(3);
    let template = template.to_string_lossy().into_owned();
    let out = start_cluster(&["-c", &template, "-r", "0", "-t", "30"], &data, &ports);
    let stopped = stop_cluster(&data);
    let log = std::fs::read_to_string(data.join(ports[0].to_string()).join("redis.log"))
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(
        out.status.success(),
        "start-cluster.sh failed:\n{}{}\n{log}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cluster ready"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Without replicas, the command it suggests must not wait for one at
    // every confirm (503 not_replicated each time).
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("--confirm-wait-replicas 0"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stopped.status.success(),
        "stop-cluster.sh: {}",
        String::from_utf8_lossy(&stopped.stderr)
    );
}
