//! The direct path: seathold sends each script straight to the master of its
//! slot, from its own slot map, over one connection per master. When a slot
//! moves to another master, the first request after the move is redirected
//! (`MOVED`), goes over the cluster connection instead and still succeeds;
//! then the slot map catches up and requests go direct again. This binary
//! moves slots, so it has its own cluster (one per test binary).

mod common;

use std::time::Duration;

use common::{cluster, eventually, master_ports, node, server, show};

const FALLBACKS: &str = "seathold_redis_direct_fallbacks_total";

async fn cluster_cmd<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    let mut cmd = redis::cmd("CLUSTER");
    for a in args {
        cmd.arg(*a);
    }
    cmd.query_async(&mut node(port).await).await
}

async fn my_id(port: u16) -> String {
    cluster_cmd(port, &["MYID"]).await.expect("CLUSTER MYID")
}

/// Moves the empty `slot` from master `from` to master `to`, the way
/// `redis-cli --cluster reshard` does: IMPORTING, MIGRATING, then NODE on
/// the target, the source and every other master.
async fn move_empty_slot(slot: u16, from: u16, to: u16) {
    let keys: i64 = cluster_cmd(from, &["COUNTKEYSINSLOT", &slot.to_string()])
        .await
        .expect("COUNTKEYSINSLOT");
    assert_eq!(keys, 0, "slot {slot} must be empty to move it this way");
    let (from_id, to_id) = (my_id(from).await, my_id(to).await);
    let slot = slot.to_string();
    cluster_cmd::<()>(to, &["SETSLOT", &slot, "IMPORTING", &from_id])
        .await
        .expect("IMPORTING");
    cluster_cmd::<()>(from, &["SETSLOT", &slot, "MIGRATING", &to_id])
        .await
        .expect("MIGRATING");
    cluster_cmd::<()>(to, &["SETSLOT", &slot, "NODE", &to_id])
        .await
        .expect("NODE on the target");
    cluster_cmd::<()>(from, &["SETSLOT", &slot, "NODE", &to_id])
        .await
        .expect("NODE on the source");
    for other in master_ports().await {
        if other != from && other != to {
            cluster_cmd::<()>(other, &["SETSLOT", &slot, "NODE", &to_id])
                .await
                .expect("NODE on another master");
        }
    }
}

#[tokio::test]
async fn moved_slots_are_followed_without_a_failed_request() {
    // Alone in this binary: it moves slots, and it reads the process-wide
    // fallback counter (see common::exclusive).
    let _alone = common::exclusive().await;
    let s = server().await;
    let masters = master_ports().await;
    assert_eq!(masters.len(), 3);
    // The direct connections open right after the first successful probe.
    s.wait_direct(Duration::from_secs(5)).await;
    let keyspace = seathold::keys::KeySpace::new("seat-hold:");
    let before = s.metric(FALLBACKS).await;

    // Five times: a fresh show's (empty) slot moves to another master, and
    // the very next hold of that show must succeed and land on the new one.
    let mut last = String::new();
    for round in 0..5 {
        let sh = show(&format!("moved{round}"));
        let slot = keyspace.show_slot(&sh);
        let from = cluster()
            .master_port_for_slot(slot)
            .await
            .expect("master of the slot");
        let to = *masters
            .iter()
            .find(|&&p| p != from)
            .expect("another master");
        move_empty_slot(slot, from, to).await;

        let (status, body) = s
            .call("POST", &format!("/v1/shows/{sh}/seats/A1/hold"), None)
            .await;
        assert_eq!(status, 201, "hold right after the move: {body}");
        let token = body["holdToken"].as_str().expect("token");
        let value: Option<String> = redis::cmd("GET")
            .arg(format!("seat-hold:{{show:{sh}}}:A1"))
            .query_async(&mut node(to).await)
            .await
            .expect("GET on the new master");
        assert_eq!(
            value.as_deref(),
            Some(token),
            "the seat is on the new master"
        );
        last = sh;
    }
    // The slot map is refreshed every 500 ms, so the first hold after a
    // move meets the old master nearly every time; over five moves it did.
    let after = s.metric(FALLBACKS).await;
    assert!(
        after > before,
        "no hold was redirected after five slot moves ({before} -> {after})"
    );
    assert!(
        after - before <= 5.0,
        "one redirected hold per move at most, got {}",
        after - before
    );

    // Then the map catches up: holds of a moved show go direct again.
    eventually(
        Duration::from_secs(3),
        "holds to go direct again",
        || async {
            let f0 = s.metric(FALLBACKS).await;
            for i in 0..10 {
                let (status, body) = s
                    .call(
                        "POST",
                        &format!("/v1/shows/{last}/seats/B{i}-{f0}/hold"),
                        None,
                    )
                    .await;
                assert_eq!(status, 201, "{body}");
            }
            s.metric(FALLBACKS).await == f0
        },
    )
    .await;
    eprintln!(
        "routing: 5 slot moves, {} hold(s) redirected and served over the cluster connection",
        after - before
    );
    s.stop().await;
}

/// Scripts that requests send to one master at about the same time share a
/// write (`cluster::batch`), and each still gets its own answer: of two
/// concurrent holds of a seat exactly one wins, and a seat key of another
/// type fails only the holds of that seat, with the 500 it always gave.
#[tokio::test]
async fn concurrent_scripts_share_writes_and_keep_their_own_answers() {
    // Alone in this binary: the direct write and script counters are
    // process-wide, and the holds of the slot-moving test above (one script
    // per write) would move them too.
    let _alone = common::exclusive().await;
    let s = server().await;
    s.wait_direct(Duration::from_secs(5)).await;
    let sh = show("batched");
    let foreign = format!("seat-hold:{{show:{sh}}}:X0");
    let master = cluster()
        .master_port_for_slot(seathold::keys::KeySpace::new("seat-hold:").show_slot(&sh))
        .await
        .expect("master of the slot");
    let _: () = redis::cmd("HSET")
        .arg(&foreign)
        .arg("owner")
        .arg("legacy")
        .query_async(&mut node(master).await)
        .await
        .expect("HSET");
    let text = s.metrics().await;
    let (writes, scripts) = (
        common::series(&text, "seathold_redis_direct_writes_total"),
        common::series(&text, "seathold_redis_direct_scripts_total"),
    );

    // 60 seats asked for twice each, and the foreign key four times, all
    // at once.
    let mut seats: Vec<String> = (0..60)
        .flat_map(|i| [format!("S{i}"), format!("S{i}")])
        .collect();
    seats.extend(std::iter::repeat_n("X0".to_owned(), 4));
    let answers = futures_util::future::join_all(seats.iter().map(|seat| {
        let path = format!("/v1/shows/{sh}/seats/{seat}/hold");
        let s = &s;
        async move { (seat.clone(), s.call("POST", &path, None).await) }
    }))
    .await;

    let mut by_seat: std::collections::BTreeMap<String, Vec<u16>> = Default::default();
    for (seat, (status, body)) in answers {
        if status == 201 {
            let expected = format!("seat-hold:{{show:{sh}}}:{seat}");
            let token: Option<String> = redis::cmd("GET")
                .arg(&expected)
                .query_async(&mut node(master).await)
                .await
                .expect("GET");
            assert_eq!(
                token.as_deref(),
                body["holdToken"].as_str(),
                "the answer of {seat} carries the token that holds {seat}"
            );
        }
        by_seat.entry(seat).or_default().push(status);
    }
    for (seat, mut statuses) in by_seat {
        statuses.sort_unstable();
        let want = if seat == "X0" {
            vec![500; 4]
        } else {
            vec![201, 409]
        };
        assert_eq!(statuses, want, "answers for {seat}");
    }
    let text = s.metrics().await;
    let writes = common::series(&text, "seathold_redis_direct_writes_total") - writes;
    let scripts = common::series(&text, "seathold_redis_direct_scripts_total") - scripts;
    assert!(
        scripts >= 124.0,
        "every hold went the direct path: {scripts} scripts"
    );
    assert!(
        writes < scripts / 2.0,
        "124 concurrent holds took {writes} writes for {scripts} scripts"
    );
    s.stop().await;
}

/// Seeds named otherwise than the cluster names its nodes (a host name where
/// `CLUSTER SLOTS` reports addresses, as in most deployments behind DNS), or
/// whose first entry is down, still give a ready daemon whose confirms (sent
/// straight to the master of the slot, from the daemon's own slot map) work.
#[tokio::test]
async fn seeds_named_otherwise_than_the_cluster_names_its_nodes_are_served() {
    let _shared = common::shared().await;
    let by_name: Vec<String> = cluster()
        .seed_urls()
        .iter()
        .map(|url| url.replace("127.0.0.1", "localhost"))
        .collect();
    assert!(
        by_name.iter().all(|url| url.contains("localhost")),
        "{by_name:?}"
    );
    // A port nothing listens on, first; then the cluster's nodes by address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let first_down: Vec<String> = std::iter::once(format!("redis://127.0.0.1:{closed}"))
        .chain(cluster().seed_urls())
        .collect();
    for seeds in [by_name, first_down] {
        let s = common::server_with(seathold::config::Options {
            redis_nodes: seeds.clone(),
            ..common::options()
        })
        .await;
        let show = show("seeds");
        let held = s.hold(&show, &["E7"]).await;
        let token = held["holdToken"].as_str().expect("token");
        let (status, body) = s.confirm(&show, token).await;
        assert_eq!(status, 200, "confirm with seeds {seeds:?}: {body}");
        s.stop().await;
    }
}
