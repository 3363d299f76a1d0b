//! The shipped monitoring against a real Prometheus: `cluster/prometheus.yml`
//! (its targets rewritten to a test daemon, its intervals to 1 s so the test
//! does not wait 15 s per step) with `cluster/alerts.yml` scrapes a real
//! seathold; every alert rule then evaluates without error, every query of
//! `cluster/grafana-dashboard.json` runs, and the core series have samples.
//! `tests/ops_assets.rs` checks the names; this checks the PromQL.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{eventually, server, show};
use serde_json::Value;

fn asset(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The `prometheus` server binary on PATH.
fn prometheus_binary() -> PathBuf {
    common::required(
        "prometheus",
        "the scrape test runs the Prometheus server: install it (Debian/Ubuntu: \
         `sudo apt-get install prometheus`, then `sudo systemctl disable --now prometheus`; \
         or the release tarball from prometheus.io)",
    )
}

/// `cluster/prometheus.yml` scraping only `target`, every second.
fn scrape_config(target: &str) -> String {
    let mut text = asset("cluster/prometheus.yml");
    for (from, to) in [
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ("scrape_timeout: 10s", "scrape_timeout: 1s"),
        (
            "          - seathold-1.internal:8080\n",
            &format!("          - {target}\n"),
        ),
        ("          - seathold-2.internal:8080\n", ""),
        ("          - seathold-3.internal:8080\n", ""),
    ] {
        assert!(
            text.contains(from),
            "cluster/prometheus.yml no longer has {from:?}: update this test"
        );
        text = text.replace(from, to);
    }
    text
}

/// Every `expr` of the dashboard's panels, nested ones included.
fn dashboard_queries(panels: &Value, out: &mut Vec<(String, String)>) {
    for panel in panels.as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let title = panel["title"].as_str().unwrap_or("?").to_owned();
                out.push((title, expr.to_owned()));
            }
        }
        dashboard_queries(&panel["panels"], out);
    }
}

/// A dashboard query as Grafana would send it with "All" selected:
/// `$__rate_interval` becomes 1m, every other `$variable` `.*`.
fn as_sent(expr: &str) -> String {
    let expr = expr
        .replace("$__rate_interval", "1m")
        .replace("$__interval", "1m");
    let mut out = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' {
            while chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
            {
                chars.next();
            }
            out.push_str(".*");
        } else {
            out.push(c);
        }
    }
    out
}

/// A running Prometheus; killed on drop.
struct Prometheus {
    base: String,
    http: reqwest::Client,
    log: PathBuf,
    _child: tokio::process::Child,
}

impl Prometheus {
    async fn start(dir: &Path, target: &str) -> Self {
        std::fs::write(dir.join("prometheus.yml"), scrape_config(target)).expect("write config");
        std::fs::write(dir.join("alerts.yml"), asset("cluster/alerts.yml")).expect("write rules");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = dir.join("prometheus.log");
        let child = tokio::process::Command::new(prometheus_binary())
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let prometheus = Self {
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
            log,
            _child: child,
        };
        let ready = format!("{}/-/ready", prometheus.base);
        let http = prometheus.http.clone();
        eventually(
            Duration::from_secs(30),
            "Prometheus to be ready",
            || async {
                http.get(&ready)
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            },
        )
        .await;
        prometheus
    }

    /// `GET /api/v1/<path>`: the `data` of a successful answer, or the error.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let mut query = form_urlencoded::Serializer::new(String::new());
        for (k, v) in params {
            query.append_pair(k, v);
        }
        let url = format!("{}/api/v1/{path}?{}", self.base, query.finish());
        let answer: Value = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        if answer["status"] == "success" {
            Ok(answer["data"].clone())
        } else {
            Err(format!("{}: {}", answer["errorType"], answer["error"]))
        }
    }

    /// The instant vector of `expr` (panics on an error).
    async fn query(&self, expr: &str) -> Vec<Value> {
        match self.api("query", &[("query", expr)]).await {
            Ok(data) => data["result"].as_array().cloned().unwrap_or_default(),
            Err(err) => panic!("{expr}: {err}\n{}", self.log_text()),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

#[tokio::test]
async fn shipped_rules_and_dashboard_evaluate_against_a_real_prometheus() {
    let s = server().await;
    s.hold(&show("prom"), &["E7", "E8"]).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let target = s.addr.to_string();
    let prom = Prometheus::start(dir.path(), &target).await;

    // A scrape, taken after the hold.
    eventually(
        Duration::from_secs(30),
        "a scrape of the test daemon",
        || async {
            let up = prom.query("up{job=\"seathold\"} == 1").await;
            let holds = prom.query("seathold_holds_total >= 1").await;
            !up.is_empty() && !holds.is_empty()
        },
    )
    .await;

    for series in [
        "seathold_holds_total",
        "seathold_seats_held_total",
        "seathold_hold_conflicts_total",
        "seathold_hold_expiries_total",
        "seathold_cluster_ready",
        "seathold_http_request_duration_seconds_bucket",
        "seathold_redis_command_duration_seconds_bucket",
        "seathold_redis_errors_total",
        "seathold_build_info",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
    ] {
        let found = prom.query(&format!("{series}{{job=\"seathold\"}}")).await;
        assert!(!found.is_empty(), "{series} has no samples in Prometheus");
        assert!(
            found
                .iter()
                .all(|v| v["metric"]["instance"] == target.as_str()),
            "{series}: {found:?}"
        );
    }

    // Every rule of alerts.yml, as Prometheus loaded it: evaluated, and
    // without error. Then each expression once more through the query API.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let rules = loop {
        let rules: Vec<Value> = match prom.api("rules", &[]).await {
            Ok(data) => data["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect(),
            Err(_) => Vec::new(),
        };
        if !rules.is_empty() && rules.iter().all(|r| r["health"] != "unknown") {
            break rules;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rules not evaluated within 30 s: {rules:?}\n{}",
            prom.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let shipped = asset("cluster/alerts.yml").matches("- alert:").count();
    assert_eq!(rules.len(), shipped, "Prometheus loaded every alert");
    for rule in &rules {
        assert_eq!(
            rule["health"], "ok",
            "alert {} fails to evaluate: {}",
            rule["name"], rule["lastError"]
        );
        prom.query(rule["query"].as_str().expect("query")).await;
    }

    // Every dashboard query, as Grafana sends it with "All" selected.
    let dashboard: Value =
        serde_json::from_str(&asset("cluster/grafana-dashboard.json")).expect("dashboard JSON");
    let mut queries = Vec::new();
    dashboard_queries(&dashboard["panels"], &mut queries);
    assert!(
        queries.len() >= 15,
        "only {} dashboard queries",
        queries.len()
    );
    for (title, expr) in &queries {
        let sent = as_sent(expr);
        if let Err(err) = prom.api("query", &[("query", &sent)]).await {
            panic!("panel {title:?}: {sent}: {err}");
        }
    }
    // The core panels show data, not "No data".
    for expr in [
        "sum(rate(seathold_holds_total{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]))",
        "seathold_cluster_ready{job=~\"$job\",instance=~\"$instance\"}",
    ] {
        // rate() needs two scrapes in its window.
        eventually(Duration::from_secs(15), expr, || async {
            !prom.query(&as_sent(expr)).await.is_empty()
        })
        .await;
    }
    // The dashboard's variables: label_values(seathold_cluster_ready, job)
    // and then the instances of that job.
    let jobs = prom
        .api("label/job/values", &[("match[]", "seathold_cluster_ready")])
        .await
        .expect("job values");
    assert_eq!(jobs, serde_json::json!(["seathold"]));
    let instances = prom
        .api(
            "label/instance/values",
            &[("match[]", "seathold_cluster_ready{job=~\"seathold\"}")],
        )
        .await
        .expect("instance values");
    assert_eq!(instances, serde_json::json!([target]));
    s.stop().await;
}

#[test]
fn grafana_variables_become_what_all_selects() {
    assert_eq!(
        as_sent("sum(rate(x{job=~\"$job\",instance=~\"$instance\"}[$__rate_interval]))"),
        "sum(rate(x{job=~\".*\",instance=~\".*\"}[1m]))"
    );
}
