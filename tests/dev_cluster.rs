//! The local Redis Cluster launcher (`seathold::dev`) against real
//! `redis-server` processes: layout, slot map, single master, failover and
//! restart, pause/resume, cleanup on drop, and no orphans when the owning
//! process exits without dropping its cluster.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::{AsyncCommands, Value};
use seathold::dev::{ClusterOptions, DevError, LocalCluster, NodeInfo, Role, SLOT_COUNT};

/// The binary's shared 3x1 cluster, kept in a `static` that is never dropped
/// (as the other test binaries do); the orphan test below shows why that is
/// safe.
fn shared() -> &'static LocalCluster {
    static CLUSTER: OnceLock<LocalCluster> = OnceLock::new();
    CLUSTER.get_or_init(
        || match LocalCluster::start_blocking(ClusterOptions::default()) {
            Ok(cluster) => cluster,
            Err(err) => panic!("cannot start the test Redis Cluster: {err}"),
        },
    )
}

async fn connect(port: u16) -> MultiplexedConnection {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a redis url");
    tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .expect("connecting in time")
    .expect("connecting")
}

/// RESP2 maps arrive as flat key/value arrays.
fn pairs(value: &Value) -> BTreeMap<String, Value> {
    let items: Vec<(Value, Value)> = match value {
        Value::Map(map) => map.clone(),
        Value::Array(flat) => flat
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| (c[0].clone(), c[1].clone()))
            .collect(),
        other => panic!("not a map: {other:?}"),
    };
    items
        .into_iter()
        .map(|(k, v)| {
            (
                redis::from_redis_value::<String>(k).expect("a string key"),
                v,
            )
        })
        .collect()
}

fn int(value: &Value) -> i64 {
    redis::from_redis_value::<i64>(value.clone()).expect("an integer")
}

fn string(value: &Value) -> String {
    redis::from_redis_value::<String>(value.clone()).expect("a string")
}

/// One shard of `CLUSTER SHARDS`: its slot ranges, master port and replica
/// ports.
#[derive(Debug)]
struct Shard {
    ranges: Vec<(u16, u16)>,
    master: u16,
    replicas: Vec<u16>,
}

async fn cluster_shards(port: u16) -> Vec<Shard> {
    let mut con = connect(port).await;
    let reply: Value = redis::cmd("CLUSTER")
        .arg("SHARDS")
        .query_async(&mut con)
        .await
        .expect("CLUSTER SHARDS");
    let Value::Array(shards) = reply else {
        panic!("CLUSTER SHARDS: {reply:?}")
    };
    shards
        .iter()
        .map(|shard| {
            let shard = pairs(shard);
            let Some(Value::Array(slots)) = shard.get("slots") else {
                panic!("no slots in {shard:?}")
            };
            let ranges = slots
                .chunks(2)
                .map(|c| (int(&c[0]) as u16, int(&c[1]) as u16))
                .collect();
            let Some(Value::Array(nodes)) = shard.get("nodes") else {
                panic!("no nodes in {shard:?}")
            };
            let mut master = None;
            let mut replicas = Vec::new();
            for node in nodes {
                let node = pairs(node);
                let port = int(&node["port"]) as u16;
                match string(&node["role"]).as_str() {
                    "master" => master = Some(port),
                    _ => replicas.push(port),
                }
            }
            replicas.sort_unstable();
            Shard {
                ranges,
                master: master.expect("a master in every shard"),
                replicas,
            }
        })
        .collect()
}

/// `(start, end, master port)` from `CLUSTER SLOTS` on one node.
async fn cluster_slots(port: u16) -> Vec<(u16, u16, u16)> {
    let mut con = connect(port).await;
    let reply: Vec<Vec<Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut con)
        .await
        .expect("CLUSTER SLOTS");
    let mut ranges: Vec<(u16, u16, u16)> = reply
        .iter()
        .map(|r| {
            let Value::Array(master) = &r[2] else {
                panic!("bad CLUSTER SLOTS entry {r:?}")
            };
            (int(&r[0]) as u16, int(&r[1]) as u16, int(&master[1]) as u16)
        })
        .collect();
    ranges.sort_unstable();
    ranges
}

fn assert_covers_all_slots(ranges: &[(u16, u16, u16)]) {
    let mut next = 0u32;
    for &(start, end, _) in ranges {
        assert_eq!(
            u32::from(start),
            next,
            "gap or overlap before slot {start}: {ranges:?}"
        );
        next = u32::from(end) + 1;
    }
    assert_eq!(
        next,
        u32::from(SLOT_COUNT),
        "slots not covered to the end: {ranges:?}"
    );
}

fn by_role(nodes: &[NodeInfo], role: Role) -> Vec<&NodeInfo> {
    nodes.iter().filter(|n| n.initial_role == role).collect()
}

#[cfg(target_os = "linux")]
fn process_alive(pid: u32) -> bool {
    // A zombie is dead for our purposes (whoever inherited it reaps it).
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z') | Some('X')
        ),
        Err(_) => false,
    }
}

#[cfg(not(target_os = "linux"))]
fn process_alive(pid: u32) -> bool {
    Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("kill -0 {pid} 2>/dev/null"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn port_answers(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

#[tokio::test]
async fn three_masters_with_one_replica_each_cover_every_slot() {
    let cluster = shared();
    let nodes = cluster.nodes();
    assert_eq!(nodes.len(), 6);
    let masters = by_role(&nodes, Role::Master);
    let replicas = by_role(&nodes, Role::Replica);
    assert_eq!((masters.len(), replicas.len()), (3, 3));
    for node in &nodes {
        assert!(node.pid.is_some() && !node.paused, "{node:?}");
        assert_eq!(node.bus_port, node.port + 10000);
        assert!(node.dir.starts_with(cluster.dir()), "{node:?}");
        assert!(node.dir.join("redis.conf").is_file());
        assert_eq!(
            cluster.current_role(node.port).await.expect("ROLE"),
            node.initial_role
        );
    }
    // Each master got exactly one replica.
    for master in &masters {
        let mine: Vec<_> = replicas
            .iter()
            .filter(|r| r.initial_master_port == Some(master.port))
            .collect();
        assert_eq!(mine.len(), 1, "replicas of {}: {mine:?}", master.port);
    }
    let urls = cluster.seed_urls();
    assert_eq!(urls.len(), 6);
    assert!(urls.contains(&format!("redis://127.0.0.1:{}", masters[0].port)));

    // Every node sees the same, complete slot map.
    let reference = cluster_slots(nodes[0].port).await;
    assert_covers_all_slots(&reference);
    for node in &nodes[1..] {
        assert_eq!(
            cluster_slots(node.port).await,
            reference,
            "view of {}",
            node.port
        );
    }

    // CLUSTER SHARDS: three shards, each one master and its replica.
    let shards = cluster_shards(nodes[3].port).await;
    assert_eq!(shards.len(), 3, "{shards:?}");
    let mut owner = BTreeMap::new();
    for shard in &shards {
        let replica = nodes
            .iter()
            .find(|n| n.initial_master_port == Some(shard.master))
            .expect("the shard's master has a replica");
        assert_eq!(shard.replicas, vec![replica.port], "{shard:?}");
        for &(start, end) in &shard.ranges {
            owner.insert(start, (end, shard.master));
        }
    }
    let master_of = |slot: u16| {
        owner
            .range(..=slot)
            .next_back()
            .filter(|(_, (end, _))| slot <= *end)
            .map(|(_, (_, master))| *master)
            .expect("slot covered by CLUSTER SHARDS")
    };
    let mut samples: Vec<u16> = vec![0, 1, 8191, 8192, SLOT_COUNT - 1];
    for &(start, end, _) in &reference {
        samples.extend([start, end]);
    }
    samples.extend((0..SLOT_COUNT).step_by(997));
    for slot in samples {
        assert_eq!(
            cluster
                .master_port_for_slot(slot)
                .await
                .expect("master_port_for_slot"),
            master_of(slot),
            "slot {slot}"
        );
    }
    assert!(matches!(
        cluster.master_port_for_slot(SLOT_COUNT).await,
        Err(DevError::InvalidSlot(_))
    ));

    // A real cluster client can use it.
    let client = ClusterClient::new(urls).expect("a cluster client");
    let mut con = client
        .get_async_connection()
        .await
        .expect("a cluster connection");
    for i in 0..20 {
        let key = format!("dev-cluster-test:{i}");
        let () = con.set(&key, i).await.expect("SET");
        let back: i32 = con.get(&key).await.expect("GET");
        assert_eq!(back, i);
    }
    cluster
        .wait_until_ok(Duration::from_secs(5))
        .await
        .expect("healthy");
}

#[tokio::test]
async fn a_single_master_without_replicas_is_a_working_cluster() {
    let cluster = LocalCluster::start(ClusterOptions {
        masters: 1,
        replicas_per_master: 0,
        extra_config: vec![("notify-keyspace-events".into(), "Ex".into())],
        ..ClusterOptions::default()
    })
    .await
    .expect("a 1-master cluster");
    let nodes = cluster.nodes();
    assert_eq!(nodes.len(), 1);
    let port = nodes[0].port;
    cluster
        .wait_until_ok(Duration::from_secs(5))
        .await
        .expect("healthy");
    for slot in [0, 5000, SLOT_COUNT - 1] {
        assert_eq!(
            cluster.master_port_for_slot(slot).await.expect("owner"),
            port
        );
    }
    let mut con = connect(port).await;
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut con)
        .await
        .expect("INFO");
    assert!(info.contains("cluster_state:ok"), "{info}");
    assert!(info.contains("cluster_size:1"), "{info}");
    let events: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query_async(&mut con)
        .await
        .expect("CONFIG GET");
    assert!(
        events[1].contains('E') && events[1].contains('x'),
        "{events:?}"
    );

    // Paused, it stops answering; resumed, it answers again.
    cluster.pause(port).expect("SIGSTOP");
    assert!(cluster.nodes()[0].paused);
    let ping_cmd = redis::cmd("PING");
    let ping = ping_cmd.query_async::<String>(&mut con);
    assert!(tokio::time::timeout(Duration::from_millis(300), ping)
        .await
        .is_err());
    cluster.resume(port).expect("SIGCONT");
    let mut con = connect(port).await;
    let pong: String = redis::cmd("PING")
        .query_async(&mut con)
        .await
        .expect("PING");
    assert_eq!(pong, "PONG");

    // Killed, it is gone; restarted from its folder, it owns all slots again.
    let pid = cluster.nodes()[0].pid.expect("a pid");
    cluster.kill(port).expect("SIGKILL");
    assert!(!process_alive(pid));
    assert_eq!(cluster.nodes()[0].pid, None);
    assert!(matches!(cluster.kill(port), Err(DevError::NotRunning(p)) if p == port));
    assert!(matches!(cluster.pause(port), Err(DevError::NotRunning(_))));
    assert!(matches!(cluster.kill(1), Err(DevError::UnknownNode(1))));
    cluster.restart(port).await.expect("restart");
    assert!(matches!(
        cluster.restart(port).await,
        Err(DevError::AlreadyRunning(_))
    ));
    cluster
        .wait_until_ok(Duration::from_secs(10))
        .await
        .expect("healthy again");
    assert_eq!(cluster.master_port_for_slot(42).await.expect("owner"), port);
    cluster.stop();
}

#[tokio::test]
async fn a_killed_master_is_replaced_by_its_replica_and_rejoins_as_replica() {
    let cluster = LocalCluster::start(ClusterOptions {
        node_timeout_ms: 2000,
        ..ClusterOptions::default()
    })
    .await
    .expect("a 3x1 cluster");
    let master = cluster
        .master_port_for_slot(0)
        .await
        .expect("owner of slot 0");
    let nodes = cluster.nodes();
    let replica = nodes
        .iter()
        .find(|n| n.initial_master_port == Some(master))
        .expect("slot 0's master has a replica")
        .port;

    let killed_at = Instant::now();
    cluster.kill(master).expect("kill the master");
    cluster
        .wait_until_ok(Duration::from_secs(15))
        .await
        .expect("the cluster recovers");
    let took = killed_at.elapsed();
    assert_eq!(
        cluster.master_port_for_slot(0).await.expect("new owner"),
        replica
    );
    assert_eq!(
        cluster.current_role(replica).await.expect("ROLE"),
        Role::Master
    );
    // An election that misses its majority is tried again only after
    // twice the failover auth timeout (8 s here): within the 15 s waited.
    assert!(took < Duration::from_secs(15), "failover took {took:?}");
    eprintln!("failover took {took:?}");

    cluster
        .restart(master)
        .await
        .expect("restart the old master");
    cluster
        .wait_until_ok(Duration::from_secs(15))
        .await
        .expect("the old master rejoins");
    assert_eq!(
        cluster.current_role(master).await.expect("ROLE"),
        Role::Replica
    );
    assert_eq!(
        cluster.master_port_for_slot(0).await.expect("owner"),
        replica
    );
}

#[tokio::test]
async fn dropping_a_cluster_stops_its_processes_and_removes_its_folder() {
    let cluster = LocalCluster::start(ClusterOptions {
        masters: 1,
        replicas_per_master: 1,
        ..ClusterOptions::default()
    })
    .await
    .expect("a 1x1 cluster");
    let dir = cluster.dir().to_path_buf();
    let nodes = cluster.nodes();
    let pids: Vec<u32> = nodes.iter().filter_map(|n| n.pid).collect();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&pid| process_alive(pid)));
    // A paused node must not hold the stop up.
    cluster.pause(nodes[1].port).expect("SIGSTOP");
    let started = Instant::now();
    drop(cluster);
    eprintln!("drop took {:?}", started.elapsed());
    assert!(!dir.exists(), "{} still exists", dir.display());
    for &pid in &pids {
        assert!(!process_alive(pid), "pid {pid} still runs");
    }
    for node in &nodes {
        assert!(!port_answers(node.port), "port {} still answers", node.port);
    }
}

#[test]
fn a_missing_redis_server_says_how_to_install_it() {
    assert!(seathold::dev::find_redis_server().is_ok());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let start = |redis_server: &str| {
        runtime.block_on(LocalCluster::start(ClusterOptions {
            redis_server: PathBuf::from(redis_server),
            ..ClusterOptions::default()
        }))
    };
    match start("seathold-test-no-such-redis-server") {
        Err(err @ DevError::RedisServerNotFound) => {
            let msg = err.to_string();
            assert!(msg.contains("sudo apt-get install redis-server"), "{msg}");
            assert!(msg.contains("brew install redis"), "{msg}");
        }
        other => panic!("expected RedisServerNotFound, got {other:?}"),
    }
    assert!(matches!(
        start("/nonexistent/redis-server"),
        Err(DevError::RedisServerNotExecutable { .. })
    ));
}

#[tokio::test]
async fn a_node_that_cannot_start_is_reported_with_its_log() {
    let result = LocalCluster::start(ClusterOptions {
        masters: 1,
        replicas_per_master: 0,
        extra_config: vec![("seathold-no-such-directive".into(), "1".into())],
        ..ClusterOptions::default()
    })
    .await;
    let err = result.expect_err("redis-server rejects an unknown directive");
    let msg = err.to_string();
    assert!(matches!(err, DevError::Node { .. }), "{msg}");
    // redis-server's own complaint, quoted from the node's log.
    assert!(msg.contains("seathold-no-such-directive"), "{msg}");
    eprintln!("{msg}");
}
