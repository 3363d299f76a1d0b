//! Shared test support: one real Redis Cluster per test binary (started from
//! the `redis-server` on PATH), in-process seathold servers on port 0, unique
//! show ids, and direct Redis access for checking what seathold wrote.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use seathold::config::Options;
use seathold::dev::{ClusterOptions, LocalCluster};
use serde_json::Value;
use tokio::sync::oneshot;

/// The cluster of this test binary: 3 masters, 1 replica each, keyspace
/// expiry events on. Started on first use from a thread of its own so that it
/// outlives every test's runtime.
pub fn cluster() -> &'static LocalCluster {
    static CLUSTER: OnceLock<LocalCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let started = std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(LocalCluster::start(ClusterOptions {
                extra_config: vec![("notify-keyspace-events".into(), "Ex".into())],
                ..Default::default()
            }))
        })
        .join()
        .expect("the cluster start thread");
        match started {
            Ok(cluster) => cluster,
            // The message says how to install redis-server when it is
            // missing; tests never skip silently.
            Err(err) => panic!("cannot start the test Redis Cluster: {err}"),
        }
    })
}

/// A show id no other test uses.
pub fn show(tag: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{tag}-{n}-{nanos:x}")
}

/// A seathold server running in this test's runtime.
pub struct TestServer {
    pub addr: SocketAddr,
    pub base: String,
    pub http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), seathold::server::StartError>>>,
}

/// Default options against the test cluster.
pub fn options() -> Options {
    Options {
        redis_nodes: cluster().seed_urls(),
        listen: "127.0.0.1:0".parse().expect("addr"),
        shutdown_drain_ms: Some(0),
        ..Options::default()
    }
}

/// A server with default options, ready.
pub async fn server() -> TestServer {
    server_with(options()).await
}

/// A server with the given options, ready (its /readyz answered 200).
pub async fn server_with(opts: Options) -> TestServer {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(seathold::server::run(opts, listener, async {
        let _ = stopped.await;
    }));
    let server = TestServer {
        addr,
        base: format!("http://{addr}"),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .expect("client"),
        stop: Some(stop),
        task: Some(task),
    };
    // A client of its own that keeps no connection open afterwards: tests of
    // connection limits start from none.
    let probe = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    wait_readyz(&probe, &server.base, 200, Duration::from_secs(30)).await;
    server
}

impl TestServer {
    pub async fn wait_ready(&self, limit: Duration) {
        wait_readyz(&self.http, &self.base, 200, limit).await;
    }

    /// Sends a request; answers status and JSON body (Null when empty).
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        call_at(&self.http, &self.base, method, path, body).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(body)).await
    }

    /// Holds `seats` of `show`; panics unless 201. Answers the hold.
    pub async fn hold(&self, show: &str, seats: &[&str]) -> Value {
        let (status, body) = self
            .post(
                &format!("/v1/shows/{show}/holds"),
                serde_json::json!({"seats": seats}),
            )
            .await;
        assert_eq!(status, 201, "hold {show} {seats:?}: {body}");
        body
    }

    /// `POST …/holds/{token}/extend` with `ttlMs`: status and body.
    /// `POST …/holds/{token}/confirm`: the status and body.
    pub async fn confirm(&self, show: &str, token: &str) -> (u16, Value) {
        self.call(
            "POST",
            &format!("/v1/shows/{show}/holds/{token}/confirm"),
            None,
        )
        .await
    }

    pub async fn extend(&self, show: &str, token: &str, ttl_ms: u64) -> (u16, Value) {
        self.post(
            &format!("/v1/shows/{show}/holds/{token}/extend"),
            serde_json::json!({ "ttlMs": ttl_ms }),
        )
        .await
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> String {
        metrics_at(&self.http, &self.base).await
    }

    /// The value of an unlabelled series in `/metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        series(&self.metrics().await, name)
    }

    /// Opens `GET /v1/shows/{show}/events` as an event stream (SSE), resumed
    /// after `last_event_id` when given; answers the response as it came.
    pub async fn events_stream(
        &self,
        show: &str,
        last_event_id: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .get(format!("{}/v1/shows/{show}/events", self.base))
            .header("accept", "text/event-stream");
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id);
        }
        req.send().await.expect("an event-stream request")
    }

    /// Waits until the series `name` reaches at least `value`.
    pub async fn wait_metric(&self, name: &str, value: f64, limit: Duration) {
        eventually(limit, &format!("{name} >= {value}"), || async {
            self.metric(name).await >= value
        })
        .await;
    }

    /// Waits until every master of the test cluster (3) has a direct
    /// connection: they open right after the first successful probe.
    pub async fn wait_direct(&self, limit: Duration) {
        self.wait_metric("seathold_redis_direct_connections", 3.0, limit)
            .await;
    }

    /// Stops the server (graceful shutdown) and waits for it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task").expect("server result");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Sends `method path` to the daemon at `base`, with an optional JSON
/// `body` and `Idempotency-Key`; answers the response, its body unread.
pub async fn request_at(
    http: &reqwest::Client,
    base: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
    idempotency_key: Option<&str>,
) -> reqwest::Response {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = http.request(method, format!("{base}{path}"));
    if let Some(body) = body {
        req = req.json(&body);
    }
    if let Some(key) = idempotency_key {
        req = req.header("Idempotency-Key", key);
    }
    req.send().await.expect("request")
}

/// A response body as JSON: Null when empty, a string when not JSON.
pub fn lenient_json(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into()))
    }
}

/// Sends `method path` (with a JSON `body`) to the daemon at `base`;
/// answers status and JSON body (Null when empty, a string when not JSON).
pub async fn call_at(
    http: &reqwest::Client,
    base: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let resp = request_at(http, base, method, path, body, None).await;
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("body");
    (status, lenient_json(&bytes))
}

/// A direct cluster connection, for checking and arranging Redis state.
pub async fn redis() -> ClusterConnection {
    ClusterClient::new(cluster().seed_urls())
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("cluster connection")
}

/// Whether the hold record of `token` of `show` exists in Redis.
pub async fn hold_record_exists(r: &mut ClusterConnection, show: &str, token: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(format!("seat-hold:{{show:{show}}}#hold:{token}"))
        .query_async(r)
        .await
        .expect("EXISTS")
}

/// A plain connection to one node.
pub async fn node(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("node connection")
}

/// Ports of the current masters.
pub async fn master_ports() -> Vec<u16> {
    let mut ports = Vec::new();
    for n in cluster().nodes() {
        let Ok(Ok(mut c)) = tokio::time::timeout(Duration::from_secs(2), async {
            redis::Client::open(format!("redis://127.0.0.1:{}", n.port))?
                .get_multiplexed_async_connection()
                .await
        })
        .await
        else {
            continue;
        };
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await
            .unwrap_or_default();
        if info.lines().any(|l| l.trim() == "role:master") {
            ports.push(n.port);
        }
    }
    ports
}

/// Counters of one command in `INFO commandstats`: calls, rejected calls,
/// failed calls.
pub type CommandStat = [u64; 3];

/// `INFO commandstats` of one node: command -> its counters.
pub async fn node_command_stats(port: u16) -> BTreeMap<String, CommandStat> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut node(port).await)
        .await
        .expect("INFO commandstats");
    let mut stats = BTreeMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        stats.insert(
            name.to_owned(),
            [
                field("calls"),
                field("rejected_calls"),
                field("failed_calls"),
            ],
        );
    }
    stats
}

/// The `calls` of one command on one node (0 when it never ran).
pub async fn node_calls(port: u16, command: &str) -> u64 {
    node_command_stats(port)
        .await
        .get(command)
        .map_or(0, |s| s[0])
}

/// `INFO commandstats` of every master: (port, command) -> its counters.
pub async fn command_stats() -> BTreeMap<(u16, String), CommandStat> {
    let mut all = BTreeMap::new();
    for port in master_ports().await {
        for (name, stat) in node_command_stats(port).await {
            all.insert((port, name), stat);
        }
    }
    all
}

/// What moved between two [`command_stats`] snapshots: every (port, command)
/// whose counters differ, with the increase of each counter.
pub fn stats_delta(
    before: &BTreeMap<(u16, String), CommandStat>,
    after: &BTreeMap<(u16, String), CommandStat>,
) -> BTreeMap<(u16, String), CommandStat> {
    let zero = [0; 3];
    after
        .keys()
        .chain(before.keys())
        .filter_map(|k| {
            let (a, b) = (
                after.get(k).unwrap_or(&zero),
                before.get(k).unwrap_or(&zero),
            );
            (a != b).then(|| (k.clone(), [0, 1, 2].map(|i| a[i].wrapping_sub(b[i]))))
        })
        .collect()
}

/// The keys of `slot` on the master serving it: the count from `CLUSTER
/// COUNTKEYSINSLOT` and the names from `CLUSTER GETKEYSINSLOT`, sorted.
pub async fn keys_in_slot(slot: u16) -> (u64, Vec<String>) {
    let master = cluster()
        .master_port_for_slot(slot)
        .await
        .expect("master of the slot");
    let mut c = node(master).await;
    let count: u64 = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query_async(&mut c)
        .await
        .expect("CLUSTER COUNTKEYSINSLOT");
    let mut keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100_000)
        .query_async(&mut c)
        .await
        .expect("CLUSTER GETKEYSINSLOT");
    keys.sort();
    (count, keys)
}

/// The slot of `show`'s keys and the port of the master serving it.
pub async fn slot_and_master(show: &str) -> (u16, u16) {
    let slot = seathold::keys::KeySpace::new("seat-hold:").show_slot(show);
    let master = cluster()
        .master_port_for_slot(slot)
        .await
        .expect("master of the slot");
    (slot, master)
}

/// The port of the (first) replica of the master on `master`, from its
/// `INFO replication`.
pub async fn replica_of(master: u16) -> u16 {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut node(master).await)
        .await
        .expect("INFO replication");
    info.lines()
        .filter(|l| l.starts_with("slave"))
        .find_map(|l| {
            l.split(',')
                .find_map(|kv| kv.strip_prefix("port="))?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("master {master} has no replica:\n{info}"))
}

/// `CLIENT LIST` of one node, one map of fields per connection.
pub async fn client_list(port: u16) -> Vec<BTreeMap<String, String>> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut node(port).await)
        .await
        .expect("CLIENT LIST");
    list.lines()
        .map(|l| {
            l.split(' ')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

/// The connections of process `pid` (a daemon the test started) among
/// `CLIENT LIST` of the node at `port`: a client's port there is a local
/// port of the process. No other test's.
pub async fn clients_of(pid: u32, port: u16) -> Vec<BTreeMap<String, String>> {
    let ours = local_ports(pid);
    client_list(port)
        .await
        .into_iter()
        .filter(|c| {
            c.get("addr")
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
                .is_some_and(|p| ours.contains(&p))
        })
        .collect()
}

/// Whether a `CLIENT LIST` entry is a show's event reader. A reader
/// pipelines `XREAD BLOCK` with `XRANGE` (a check of the stream's head):
/// between two blocks its last command is `xrange`, for as long as the
/// daemon takes to handle one reply and send the next (about 7% of the
/// time with the default 83 ms block, under a thousand subscribers).
pub fn reads_a_stream(client: &BTreeMap<String, String>) -> bool {
    client
        .get("cmd")
        .is_some_and(|cmd| cmd == "xread" || cmd == "xrange")
}

/// `CLIENT PAUSE ms mode` on the node at `port` (`WRITE`: scripts and
/// writes wait, reads go on; `ALL`: everything waits).
pub async fn pause_clients(port: u16, ms: u64, mode: &str) {
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg(mode)
        .query_async(&mut node(port).await)
        .await
        .expect("CLIENT PAUSE");
}

/// A node stopped with `SIGSTOP`, like a hung machine, and resumed
/// (`SIGCONT`) when dropped: a test that fails meanwhile still leaves the
/// shared cluster running.
pub struct Frozen(u16);

impl Frozen {
    pub fn new(port: u16) -> Self {
        cluster().pause(port).expect("SIGSTOP the node");
        Self(port)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = cluster().resume(self.0);
    }
}

/// Brings the cluster back to health after a test changed its shape:
/// resumes the nodes in `paused`, restarts the nodes in `killed`, and waits
/// until every node agrees on a full slot map.
pub async fn heal(paused: &[u16], killed: &[u16]) {
    for &port in paused {
        cluster().resume(port).expect("SIGCONT");
    }
    for &port in killed {
        cluster().restart(port).await.expect("restart the node");
    }
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy again");
}

/// The one serialisation lock of a test binary. A test that changes the
/// cluster's shape (kills, freezes, moves slots) or that needs every other
/// test of its binary quiet (it counts Redis commands, or process-wide
/// metrics) takes it [`exclusive`]ly; every other test of such a binary
/// takes it [`shared`], so that it never runs beside one of those.
fn lock() -> &'static tokio::sync::RwLock<()> {
    static LOCK: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());
    &LOCK
}

/// Runs alone in its binary: see [`lock`]. Starts from a healthy cluster
/// even when an earlier exclusive test failed before healing it: paused
/// nodes are resumed and killed nodes restarted first.
pub async fn exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    let guard = lock().write().await;
    let nodes = cluster().nodes();
    let paused: Vec<u16> = nodes.iter().filter(|n| n.paused).map(|n| n.port).collect();
    let killed: Vec<u16> = nodes
        .iter()
        .filter(|n| n.pid.is_none())
        .map(|n| n.port)
        .collect();
    if !paused.is_empty() || !killed.is_empty() {
        heal(&paused, &killed).await;
    }
    guard
}

/// Runs beside other shared tests, never beside an exclusive one.
pub async fn shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    lock().read().await
}

/// Asserts an error answer: its status, its `error` code and a non-empty
/// human `message`.
#[track_caller]
pub fn assert_error(status: u16, body: &Value, want_status: u16, code: &str) {
    assert_eq!(
        (status, body["error"].as_str()),
        (want_status, Some(code)),
        "expected {want_status} {code}, got {status}: {body}"
    );
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "an error without a message: {body}"
    );
}

/// Waits until `GET {base}/readyz` answers `status`.
pub async fn wait_readyz(http: &reqwest::Client, base: &str, status: u16, limit: Duration) {
    eventually(limit, &format!("/readyz to answer {status}"), || async {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == status)
    })
    .await;
}

/// Polls `check` every 20 ms until it is true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `seathold serve` process of the real binary against the test cluster;
/// killed (SIGKILL) when dropped if it is still running.
pub struct Daemon {
    pub child: std::process::Child,
    pub addr: SocketAddr,
    pub base: String,
}

impl Daemon {
    /// Starts `seathold serve` on a free port with `extra` flags and waits
    /// until its `/readyz` answers 200.
    ///
    /// The port is free when picked, not reserved: another test's process
    /// may bind it before this one does. That one would then answer
    /// `/readyz` in this one's place (and the test would talk to a daemon
    /// it did not start, stopped by another test at any moment), so the
    /// process must be seen listening on the port itself; one that exits
    /// (address in use) is started again on another port.
    pub async fn start(extra: &[&str]) -> Daemon {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port");
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seathold"));
            // Only the flags here: nothing a developer's shell exports.
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("SEATHOLD_") {
                    cmd.env_remove(name);
                }
            }
            let child = cmd
                .arg("serve")
                .args(["--listen", &addr.to_string()])
                .args(["--redis-nodes", &cluster().seed_urls().join(",")])
                .args(extra)
                .env("SEATHOLD_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .spawn()
                .expect("spawn seathold");
            let mut daemon = Daemon {
                child,
                addr,
                base: format!("http://{addr}"),
            };
            let started = Instant::now();
            let listening = loop {
                if let Ok(Some(_)) = daemon.child.try_wait() {
                    break false;
                }
                if local_ports(daemon.pid()).contains(&port) {
                    break true;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "seathold did not listen on {addr} within 30 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            if !listening {
                continue;
            }
            wait_readyz(
                &reqwest::Client::new(),
                &daemon.base,
                200,
                Duration::from_secs(30),
            )
            .await;
            return daemon;
        }
        panic!("seathold could not listen on any of 5 free ports");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` (e.g. "TERM") with the shell's kill builtin: no procps
    /// needed.
    pub fn signal(&self, sig: &str) {
        let pid = self.pid();
        let ok = std::process::Command::new("/bin/sh")
            .args(["-c", &format!("kill -{sig} {pid}")])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} {pid}");
    }

    /// Waits for the process to exit, up to `limit`; answers its exit code
    /// (None: still running, or killed by a signal).
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        metrics_at(&reqwest::Client::new(), &self.base).await
    }
}

/// The local TCP ports of a process's sockets, listening or connected
/// (from /proc): whether it listens on a port, and which connections of a
/// Redis node's `CLIENT LIST` are its own.
pub fn local_ports(pid: u32) -> std::collections::HashSet<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut ports = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && inodes.contains(f[9]) {
                if let Some(port) = f[1]
                    .rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
                {
                    ports.insert(port);
                }
            }
        }
    }
    ports
}

/// `GET {base}/metrics` as text.
pub async fn metrics_at(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

/// Reads a `seathold dev` child's stdout until its banner is complete (the
/// last line is the second curl example), within 60 s; answers the lines.
/// A thread keeps draining afterwards: a closed pipe would fail the daemon's
/// later output, and a silent child cannot hang the test.
pub fn read_banner(child: &mut std::process::Child) -> Vec<String> {
    use std::io::{BufRead, BufReader};
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !lines.iter().any(|l: &String| l.contains("curl -s http")) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => lines.push(line),
            Err(_) => panic!("no banner from seathold dev; so far: {lines:#?}"),
        }
    }
    lines
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parses Prometheus text into `name{labels}` -> value.
pub fn scrape(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

// ----- fault and resharding helpers (tests/faults.rs, tests/reshard.rs) -----

/// The value of one series of a `/metrics` text, labels included as
/// rendered (`name{kind="protocol"}`); 0 when absent.
pub fn series(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// The sum of every series of counter `name` (all label values).
pub fn series_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = if rest.starts_with('{') {
                rest.split_once("} ")?.1
            } else {
                rest.strip_prefix(' ')?
            };
            value.trim().parse::<f64>().ok()
        })
        .sum()
}

/// `CLUSTER <args>` on the node at `port`.
pub async fn cluster_cmd<T: redis::FromRedisValue>(
    port: u16,
    args: &[&str],
) -> redis::RedisResult<T> {
    let mut cmd = redis::cmd("CLUSTER");
    for a in args {
        cmd.arg(*a);
    }
    cmd.query_async(&mut node(port).await).await
}

/// The node id of the node at `port`.
pub async fn node_id(port: u16) -> String {
    cluster_cmd(port, &["MYID"]).await.expect("CLUSTER MYID")
}

/// A slot move by hand, step by step, as `redis-cli --cluster reshard`
/// does it: [`SlotMove::begin`] (IMPORTING on the target, MIGRATING on the
/// source), [`SlotMove::migrate_keys`] (`MIGRATE` of every key), then
/// [`SlotMove::finish`] (`SETSLOT NODE` on the target, the source and every
/// other master).
pub struct SlotMove {
    pub slot: u16,
    pub from: u16,
    pub to: u16,
    from_id: String,
    to_id: String,
}

impl SlotMove {
    /// A move of `slot` from the master at `from` to the one at `to`,
    /// started.
    pub async fn begin(slot: u16, from: u16, to: u16) -> Self {
        let mv = Self::new(slot, from, to).await;
        mv.start().await;
        mv
    }

    /// A move, with the nodes' ids looked up, not started yet: for a test
    /// that must start it within a short window.
    pub async fn new(slot: u16, from: u16, to: u16) -> Self {
        Self {
            slot,
            from,
            to,
            from_id: node_id(from).await,
            to_id: node_id(to).await,
        }
    }

    /// IMPORTING on the target, then MIGRATING on the source.
    pub async fn start(&self) {
        let s = self.slot.to_string();
        cluster_cmd::<()>(self.to, &["SETSLOT", &s, "IMPORTING", &self.from_id])
            .await
            .expect("SETSLOT IMPORTING");
        cluster_cmd::<()>(self.from, &["SETSLOT", &s, "MIGRATING", &self.to_id])
            .await
            .expect("SETSLOT MIGRATING");
    }

    /// Migrates every key of the slot from the source to the target;
    /// answers how many.
    pub async fn migrate_keys(&self) -> usize {
        let s = self.slot.to_string();
        let keys: Vec<String> = cluster_cmd(self.from, &["GETKEYSINSLOT", &s, "1000"])
            .await
            .expect("GETKEYSINSLOT");
        if !keys.is_empty() {
            let mut cmd = redis::cmd("MIGRATE");
            cmd.arg("127.0.0.1")
                .arg(self.to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            let _: () = cmd
                .query_async(&mut node(self.from).await)
                .await
                .expect("MIGRATE");
        }
        keys.len()
    }

    /// Assigns the slot to the target everywhere.
    pub async fn finish(&self) {
        let s = self.slot.to_string();
        cluster_cmd::<()>(self.to, &["SETSLOT", &s, "NODE", &self.to_id])
            .await
            .expect("SETSLOT NODE on the target");
        cluster_cmd::<()>(self.from, &["SETSLOT", &s, "NODE", &self.to_id])
            .await
            .expect("SETSLOT NODE on the source");
        for other in master_ports().await {
            if other != self.from && other != self.to {
                cluster_cmd::<()>(other, &["SETSLOT", &s, "NODE", &self.to_id])
                    .await
                    .expect("SETSLOT NODE on another master");
            }
        }
    }
}

/// A show id (starting with `tag`) whose slot satisfies `wanted`.
pub fn show_where(tag: &str, wanted: impl Fn(u16) -> bool) -> String {
    let keys = seathold::keys::KeySpace::new("seat-hold:");
    loop {
        let sh = show(tag);
        if wanted(keys.show_slot(&sh)) {
            return sh;
        }
    }
}

/// The slot of `show`'s keys under the default prefix.
pub fn slot_of(show: &str) -> u16 {
    seathold::keys::KeySpace::new("seat-hold:").show_slot(show)
}

/// The first of `names` found on PATH.
pub fn on_path(names: &[&str]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

/// `name` on PATH, or a panic that says what needs it and how to install
/// it (`why`): tests never skip silently.
pub fn required(name: &str, why: &str) -> std::path::PathBuf {
    on_path(&[name]).unwrap_or_else(|| panic!("`{name}` is not on PATH; {why}"))
}

/// The `taken` list of a 409 with each `expiresInMs` taken out, after
/// checking that it is an integer from 1 to `ttl_ms` (what is left of a
/// hold of that TTL): the rest can then be compared exactly.
pub fn taken_without_expiry(body: &Value, ttl_ms: i64) -> Value {
    let mut taken = body["taken"].clone();
    for seat in taken.as_array_mut().into_iter().flatten() {
        if seat["state"] != "held" {
            continue;
        }
        let left = seat
            .as_object_mut()
            .and_then(|t| t.remove("expiresInMs"))
            .and_then(|v| v.as_i64());
        assert!(
            left.is_some_and(|v| v > 0 && v <= ttl_ms),
            "expiresInMs of {seat} must be an integer in 1..={ttl_ms}: {body}"
        );
    }
    taken
}

/// Keyspace notifications of one master off until dropped (then as they
/// were): only seathold's own timers can then tell it that a hold there
/// ran out.
pub struct NoNotifications {
    port: u16,
    flags: String,
}

impl NoNotifications {
    pub async fn on(port: u16) -> Self {
        let mut node = node(port).await;
        let (_, flags): (String, String) = redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query_async(&mut node)
            .await
            .expect("CONFIG GET");
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("")
            .query_async(&mut node)
            .await
            .expect("CONFIG SET");
        Self { port, flags }
    }
}

impl Drop for NoNotifications {
    fn drop(&mut self) {
        let url = format!("redis://127.0.0.1:{}", self.port);
        let set = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .and_then(|mut c| {
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg("notify-keyspace-events")
                    .arg(&self.flags)
                    .query::<()>(&mut c)
            });
        if let Err(err) = set {
            eprintln!(
                "cannot restore notify-keyspace-events on {}: {err}",
                self.port
            );
        }
    }
}
