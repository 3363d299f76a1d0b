//! TLS to Redis (`rediss://`) end to end: a 3-master, 1-replica cluster whose
//! nodes also serve TLS, with a throwaway CA and node certificate made
//! in-process (rcgen); seathold seeded with the `rediss://` URLs and
//! `--redis-ca-file` serves the whole API over it (holds, reads, extend,
//! confirm with `WAIT` on a dedicated connection, release, expiry events),
//! and `CLIENT LIST` shows that its connections are on the TLS ports. Without
//! the CA, or with `rediss://` URLs that point at plain ports, it never becomes
//! ready and `/readyz` says why. And what makes the cluster client follow the
//! TLS ports: nodes name them in `CLUSTER SLOTS` to TLS clients (and the plain
//! ports to plain clients).
//!
//! The tests fail (never skip) when `redis-server` is missing, with a
//! message saying how to install it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{show, TestServer};
use redis::aio::MultiplexedConnection;
use seathold::config::Options;
use seathold::dev::{ClusterOptions, LocalCluster, TlsFiles};
use serde_json::{json, Value};

/// This binary's cluster. The certificates are made in a temporary folder
/// that is removed once the cluster has started: the cluster keeps copies in
/// its node folders (see `seathold::dev`), and seathold is given the CA copy.
fn cluster() -> &'static LocalCluster {
    static CLUSTER: OnceLock<LocalCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let pki = tempfile::Builder::new()
            .prefix("seathold-tls-test-")
            .tempdir()
            .expect("a temporary folder for the certificates");
        let files = make_certificates(pki.path());
        let started = LocalCluster::start_blocking(ClusterOptions {
            tls: Some(files),
            ..ClusterOptions::default()
        });
        match started {
            Ok(cluster) => cluster,
            // Says how to install redis-server when it is missing.
            Err(err) => panic!("cannot start the TLS test Redis Cluster: {err}"),
        }
    })
}

/// A CA and a node certificate it signed (P-256 keys, for `127.0.0.1` and
/// `localhost`, usable as server and as client certificate, as the cluster
/// bus needs), written into `dir`. Made in-process with rcgen, so the tests
/// need nothing beyond Rust and redis-server.
fn make_certificates(dir: &Path) -> TlsFiles {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.distinguished_name
        .push(DnType::CommonName, "seathold test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key"))
        .expect("CA certificate");

    let mut node = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .expect("node parameters");
    node.distinguished_name
        .push(DnType::CommonName, "localhost");
    node.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let node_key = KeyPair::generate().expect("node key");
    let node_cert = node.signed_by(&node_key, &ca).expect("node certificate");

    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path
    };
    TlsFiles {
        ca: write("ca.crt", ca.pem()),
        cert: write("node.crt", node_cert.pem()),
        key: write("node.key", node_key.serialize_pem()),
    }
}

/// Options for a seathold on `seeds`, trusting `ca`.
fn options(seeds: Vec<String>, ca: Option<PathBuf>) -> Options {
    Options {
        redis_nodes: seeds,
        redis_ca_file: ca,
        listen: "127.0.0.1:0".parse().expect("an address"),
        shutdown_drain_ms: Some(0),
        ..Options::default()
    }
}

fn ca_file() -> PathBuf {
    cluster()
        .tls_files()
        .expect("the cluster has TLS")
        .ca
        .clone()
}

/// A seathold that is not expected to become ready: its base URL, and what
/// stops it when dropped.
struct Unready {
    base: String,
    http: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start_unready(opts: Options) -> Unready {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(seathold::server::run(opts, listener, async {
        let _ = stopped.await;
    }));
    Unready {
        base: format!("http://{addr}"),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("client"),
        _stop: stop,
    }
}

impl Unready {
    async fn readyz(&self) -> Option<(u16, Value)> {
        let resp = self
            .http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .ok()?;
        let status = resp.status().as_u16();
        Some((status, resp.json().await.ok()?))
    }

    /// Waits until `/readyz` reports a failed connection attempt (rather than
    /// "not connected yet"), then checks that it stays 503 for a while.
    /// Answers the reason given.
    async fn stays_unready(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        let reason = loop {
            if let Some((status, body)) = self.readyz().await {
                assert_eq!(status, 503, "seathold must not become ready: {body}");
                let reason = body["reason"].as_str().unwrap_or_default().to_owned();
                if reason.starts_with("cannot connect") {
                    break reason;
                }
            }
            assert!(
                Instant::now() < deadline,
                "/readyz never reported a failed connection"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // A few more rounds of the twice-a-second readiness check.
        for _ in 0..15 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (status, body) = self.readyz().await.expect("/readyz answers");
            assert_eq!(status, 503, "seathold must not become ready: {body}");
            assert_eq!(body["status"], "not_ready", "{body}");
        }
        reason
    }
}

/// The client name of this file's own connections to the nodes, so that
/// `CLIENT LIST` can tell them from seathold's (which have no name), also
/// when a test running in parallel has one open.
const PROBE: &str = "seathold-tls-test-probe";

/// A plain (non-TLS) connection to a node, for looking at it from outside.
async fn plain(port: u16) -> MultiplexedConnection {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a URL");
    named(client).await
}

/// A connection of `client`, named [`PROBE`].
async fn named(client: redis::Client) -> MultiplexedConnection {
    let mut con = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .expect("connecting in time")
    .expect("connecting");
    let () = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(PROBE)
        .query_async(&mut con)
        .await
        .expect("CLIENT SETNAME");
    con
}

/// One line of `CLIENT LIST` as `field -> value`.
fn client_fields(line: &str) -> BTreeMap<&str, &str> {
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect()
}

/// The local port a client is connected to (`laddr=127.0.0.1:PORT`).
fn local_port(client: &BTreeMap<&str, &str>) -> Option<u16> {
    client.get("laddr")?.rsplit_once(':')?.1.parse().ok()
}

/// The clients of a node on its TLS port and on its plain port, leaving out
/// replication links (flags `S` and `M`) and this file's own connections.
async fn clients(
    con: &mut MultiplexedConnection,
    plain_port: u16,
    tls_port: u16,
) -> (Vec<String>, Vec<String>) {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(con)
        .await
        .expect("CLIENT LIST");
    let (mut on_tls, mut on_plain) = (Vec::new(), Vec::new());
    for line in list.lines() {
        let c = client_fields(line);
        let flags = c.get("flags").copied().unwrap_or_default();
        if flags.contains('S') || flags.contains('M') || c.get("name") == Some(&PROBE) {
            continue;
        }
        match local_port(&c) {
            Some(p) if p == tls_port => on_tls.push(line.to_owned()),
            Some(p) if p == plain_port => on_plain.push(line.to_owned()),
            _ => {}
        }
    }
    (on_tls, on_plain)
}

#[tokio::test]
async fn the_api_works_over_tls() {
    let cluster = cluster();
    let nodes = cluster.nodes();
    assert!(nodes.iter().all(|n| n.tls_port.is_some()), "{nodes:?}");
    let seeds = cluster.tls_seed_urls();
    assert_eq!(seeds.len(), 6, "{seeds:?}");
    assert!(seeds.iter().all(|s| s.starts_with("rediss://127.0.0.1:")));

    let s = common::server_with(options(seeds, Some(ca_file()))).await;
    // Expiry events are only seen once every master's subscription is up.
    s.wait_metric(
        "seathold_expiry_subscriptions",
        3.0,
        Duration::from_secs(10),
    )
    .await;

    let sh = show("tls");
    // Hold, read, extend.
    let (status, hold) = s
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["E7", "E8"], "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{hold}");
    let t = hold["holdToken"].as_str().expect("holdToken").to_owned();
    let (status, read) = s.get(&format!("/v1/shows/{sh}/holds/{t}")).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["seats"], json!(["E7", "E8"]));
    assert_eq!(read["fence"], hold["fence"]);
    let (status, ext) = s.extend(&sh, &t, 120000).await;
    assert_eq!(status, 200, "{ext}");
    assert!(
        ext["expiresInMs"].as_i64().is_some_and(|v| v > 119_000),
        "{ext}"
    );
    let (status, seat) = s.get(&format!("/v1/shows/{sh}/seats/E7")).await;
    assert_eq!((status, seat["state"].as_str()), (200, Some("held")));

    // Confirm: script, then WAIT on a dedicated TLS connection to the master.
    let (status, sale) = s
        .post(&format!("/v1/shows/{sh}/holds/{t}/confirm"), json!({}))
        .await;
    assert_eq!(status, 200, "{sale}");
    assert_eq!(sale["seats"], json!(["E7", "E8"]));
    assert!(sale["replicas"].as_i64().is_some_and(|n| n >= 1), "{sale}");
    let (_, seats) = s.get(&format!("/v1/shows/{sh}/seats?ids=E7,E8")).await;
    assert!(
        seats.to_string().matches("\"sold\"").count() == 2,
        "{seats}"
    );

    // Release.
    let other = s.hold(&sh, &["F1"]).await;
    let other = other["holdToken"].as_str().expect("holdToken");
    let (status, _) = s
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{other}"), None)
        .await;
    assert_eq!(status, 204);
    let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/F1")).await;
    assert_eq!(seat["state"], "free", "{seat}");

    // A short hold runs out; its expiry arrives over the TLS subscription.
    let (status, short) = s
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["G1"], "ttlMs": 300}),
        )
        .await;
    assert_eq!(status, 201, "{short}");
    s.wait_metric("seathold_hold_expiries_total", 1.0, Duration::from_secs(10))
        .await;
    let (_, seat) = s.get(&format!("/v1/shows/{sh}/seats/G1")).await;
    assert_eq!(seat["state"], "free", "{seat}");

    assert_connections_are_tls(cluster, &s, &sh).await;
    s.stop().await;
}

/// seathold's connections are all on the nodes' TLS ports: every master has
/// its expiry subscription there (`sub=2`: the expiry and handover
/// channels), the show's master the confirm connection that ran `WAIT`, and no node has a client on its plain port
/// that ran any command (other than this check's own connection).
async fn assert_connections_are_tls(cluster: &LocalCluster, s: &TestServer, sh: &str) {
    // Only connections opened here, and kept open, so that none of ours can
    // linger in a node's client list after we are done with it.
    let sold_seat = seathold::keys::KeySpace::new("seat-hold:").seat(sh, "E7");
    let mut report = String::new();
    let mut masters = 0;
    let mut show_master = None;
    for node in cluster.nodes() {
        let tls_port = node.tls_port.expect("a TLS port");
        let mut con = plain(node.port).await;
        let (on_tls, on_plain) = clients(&mut con, node.port, tls_port).await;
        report.push_str(&format!(
            "node {} (TLS {tls_port}):\n  TLS: {on_tls:#?}\n  plain: {on_plain:#?}\n",
            node.port
        ));
        let ran_commands: Vec<&String> = on_plain
            .iter()
            .filter(|l| client_fields(l).get("cmd") != Some(&"NULL"))
            .collect();
        assert!(
            ran_commands.is_empty(),
            "a client used the plain port of {}: {ran_commands:#?}",
            node.port
        );
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let info: String = info.query_async(&mut con).await.expect("INFO");
        if !info.lines().any(|l| l.trim() == "role:master") {
            continue;
        }
        masters += 1;
        // The expiry channel, and with events on the handover channel.
        let subscribed = on_tls.iter().any(|l| {
            client_fields(l)
                .get("sub")
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| n >= 1)
        });
        assert!(
            subscribed,
            "no expiry subscription on the TLS port of master {}:\n{report}",
            node.port
        );
        // Only the show's master answers for its key; the others say MOVED.
        let mut exists = redis::cmd("EXISTS");
        exists.arg(&sold_seat);
        if exists.query_async::<i64>(&mut con).await.ok() == Some(1) {
            show_master = Some(node.port);
            let waited = on_tls
                .iter()
                .any(|l| client_fields(l).get("cmd") == Some(&"wait"));
            assert!(
                waited,
                "no confirm connection (last command WAIT) on the TLS port of {}:\n{report}",
                node.port
            );
        }
    }
    assert_eq!(masters, 3, "{report}");
    assert!(show_master.is_some(), "no master has {sold_seat}");

    // The daemon is still fine after all that.
    let (status, _) = s.get("/readyz").await;
    assert_eq!(status, 200);
}

/// The ports of a `CLUSTER SLOTS` reply, masters and replicas.
fn slot_ports(reply: &redis::Value) -> std::collections::BTreeSet<u16> {
    let mut ports = std::collections::BTreeSet::new();
    let redis::Value::Array(ranges) = reply else {
        panic!("CLUSTER SLOTS: {reply:?}");
    };
    for range in ranges {
        let redis::Value::Array(items) = range else {
            panic!("CLUSTER SLOTS entry: {range:?}");
        };
        for node in items.iter().skip(2) {
            let redis::Value::Array(fields) = node else {
                panic!("CLUSTER SLOTS node: {node:?}");
            };
            let port: i64 = redis::from_redis_value(fields[1].clone()).expect("a port");
            ports.insert(u16::try_from(port).expect("a port"));
        }
    }
    ports
}

/// What the cluster client follows: a node names the TLS ports to a TLS
/// client and the plain ports to a plain one; replicas replicate over TLS.
#[tokio::test]
async fn tls_clients_are_shown_tls_ports() {
    let cluster = cluster();
    let nodes = cluster.nodes();
    let plain_ports: std::collections::BTreeSet<u16> = nodes.iter().map(|n| n.port).collect();
    let tls_ports: std::collections::BTreeSet<u16> =
        nodes.iter().filter_map(|n| n.tls_port).collect();
    let first = &nodes[0];
    let ca = std::fs::read(ca_file()).expect("the CA");
    let tls_client = redis::Client::build_with_tls(
        format!("rediss://127.0.0.1:{}", first.tls_port.expect("a TLS port")),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )
    .expect("a TLS client");
    let mut tls = named(tls_client).await;
    let mut slots = redis::cmd("CLUSTER");
    slots.arg("SLOTS");
    let over_tls: redis::Value = slots.query_async(&mut tls).await.expect("SLOTS");
    assert_eq!(slot_ports(&over_tls), tls_ports);
    let mut con = plain(first.port).await;
    let over_plain: redis::Value = slots.query_async(&mut con).await.expect("SLOTS");
    assert_eq!(slot_ports(&over_plain), plain_ports);

    for replica in nodes.iter().filter(|n| n.initial_master_port.is_some()) {
        let mut info = redis::cmd("INFO");
        info.arg("replication");
        let text: String = info
            .query_async(&mut plain(replica.port).await)
            .await
            .expect("INFO");
        let master_port = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("master_port:"))
            .and_then(|p| p.parse::<u16>().ok());
        assert!(
            master_port.is_some_and(|p| tls_ports.contains(&p)),
            "replica {} replicates from a plain port:\n{text}",
            replica.port
        );
    }
}

#[tokio::test]
async fn without_the_ca_it_stays_unready_and_says_why() {
    let d = start_unready(Options {
        redis_timeout_ms: 1000,
        confirm_wait_timeout_ms: 500,
        ..options(cluster().tls_seed_urls(), None)
    })
    .await;
    let reason = d.stays_unready().await;
    assert!(
        reason.to_lowercase().contains("certificate") || reason.contains("UnknownIssuer"),
        "the reason should name the untrusted certificate: {reason}"
    );
    eprintln!("rediss:// without the CA: {reason}");
}

#[tokio::test]
async fn rediss_to_plain_ports_never_becomes_ready() {
    // The CA is right, but these ports do not speak TLS: readiness in the
    // test above therefore needed a real TLS session.
    let seeds: Vec<String> = cluster()
        .nodes()
        .iter()
        .map(|n| format!("rediss://127.0.0.1:{}", n.port))
        .collect();
    let d = start_unready(Options {
        redis_timeout_ms: 1000,
        confirm_wait_timeout_ms: 500,
        ..options(seeds, Some(ca_file()))
    })
    .await;
    let reason = d.stays_unready().await;
    assert!(
        reason.contains("TLS ports"),
        "the reason should suggest the ports are not TLS: {reason}"
    );
    eprintln!("rediss:// to plain ports: {reason}");
}
