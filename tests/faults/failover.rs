//! Failures of Redis itself: a master killed under load. The tests of this
//! binary change the cluster's shape, so they take `SERIAL` and leave the
//! cluster healthy again (the killed node restarted, as a replica).

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{cluster, server, show};
use serde_json::Value;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The slot of `show`'s keys and the port of the master serving it.
async fn slot_and_master(show: &str) -> (u16, u16) {
    let slot = seathold::keys::KeySpace::new("seat-hold:").show_slot(show);
    let master = cluster()
        .master_port_for_slot(slot)
        .await
        .expect("master of the slot");
    (slot, master)
}

#[tokio::test]
async fn master_killed_under_load_fails_over_and_counts_expiries_on_the_new_master() {
    let _serial = SERIAL.lock().await;
    let s = server().await;
    let sh = show("failover");
    let (slot, master) = slot_and_master(&sh).await;

    // Steady holds on the show's slot, each a fresh seat.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (http, base, sh, stop) = (s.http.clone(), s.base.clone(), sh.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let started = Instant::now();
                let r = http
                    .post(format!("{base}/v1/shows/{sh}/seats/W{w}-{i}/hold"))
                    .send()
                    .await;
                let (status, body) = match r {
                    Ok(r) => (
                        r.status().as_u16(),
                        r.json::<Value>().await.unwrap_or(Value::Null),
                    ),
                    Err(e) => panic!("transport error: {e}"),
                };
                seen.push((started, started.elapsed(), status, body));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed_at = Instant::now();
    cluster().kill(master).expect("kill the master");
    // When Redis itself has promoted the replica, for comparison.
    let promoted = tokio::spawn(async move {
        loop {
            if let Ok(port) = cluster().master_port_for_slot(slot).await {
                if port != master {
                    return killed_at.elapsed();
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // Wait for the first success after the kill.
    let mut recovered_at = None;
    while killed_at.elapsed() < Duration::from_secs(20) {
        let (status, _) = s
            .call(
                "POST",
                &format!(
                    "/v1/shows/{sh}/seats/probe-{}/hold",
                    killed_at.elapsed().as_millis()
                ),
                None,
            )
            .await;
        if status == 201 && killed_at.elapsed() > Duration::from_millis(100) {
            recovered_at = Some(Instant::now());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.expect("worker"));
    }
    let recovered_at = recovered_at.expect("holds on the slot never succeeded again within 20 s");

    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut failing_from = None::<Instant>;
    let mut failing_to = None::<Instant>;
    for (started, took, status, body) in &all {
        *statuses.entry(*status).or_default() += 1;
        assert!(
            matches!(status, 201 | 503),
            "only 201 or 503 during a failover, got {status}: {body}"
        );
        assert!(
            *took < Duration::from_millis(3_000),
            "a request took {took:?}: the Redis timeout must bound it"
        );
        if *status == 503 {
            assert_eq!(body["error"], "redis_unavailable", "{body}");
            failing_from = Some(failing_from.map_or(*started, |f: Instant| f.min(*started)));
            failing_to =
                Some(failing_to.map_or(*started + *took, |t: Instant| t.max(*started + *took)));
        }
    }
    let window = recovered_at - killed_at;
    let promoted = promoted.await.expect("promotion");
    eprintln!(
        "failover: {} requests {statuses:?}; holds on the slot failed for {:?}; kill to first success {window:?}; \
         kill to the replica's promotion {promoted:?}",
        all.len(),
        failing_to.zip(failing_from).map(|(t, f)| t - f)
    );
    assert!(
        window < Duration::from_secs(5),
        "failover window {window:?} is not under 5 s"
    );
    assert!(statuses.get(&201).copied().unwrap_or(0) > 10);

    // The promoted replica expires keys now: its expiry is counted too.
    let new_master = cluster()
        .master_port_for_slot(slot)
        .await
        .expect("new master");
    assert_ne!(new_master, master);
    // A subscription to the new master.
    s.wait_metric(
        "seathold_expiry_subscriptions",
        3.0,
        Duration::from_secs(10),
    )
    .await;
    let before = s.metric("seathold_hold_expiries_total").await;
    let (status, _) = s
        .post(
            &format!("/v1/shows/{sh}/seats/short/hold"),
            serde_json::json!({"ttlMs": 200}),
        )
        .await;
    assert_eq!(status, 201);
    // The expiry on the new master is counted.
    s.wait_metric(
        "seathold_hold_expiries_total",
        before + 1.0,
        Duration::from_secs(15),
    )
    .await;

    cluster()
        .restart(master)
        .await
        .expect("restart the old master");
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy again");
}

#[tokio::test]
async fn confirmed_sales_survive_a_master_crash() {
    let _serial = SERIAL.lock().await;
    let s = server().await;
    let sh = show("durable");
    let (_, master) = slot_and_master(&sh).await;

    // 200 holds to confirm.
    let mut tokens = Vec::new();
    for i in 0..200 {
        let hold = s.hold(&sh, &[&format!("S{i}")]).await;
        tokens.push((
            format!("S{i}"),
            hold["holdToken"].as_str().expect("token").to_owned(),
        ));
    }
    // Plain holds keep coming while the confirms run and the master dies:
    // acknowledged but, with asynchronous replication, not guaranteed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let plain = {
        let (http, base, sh, stop) = (s.http.clone(), s.base.clone(), sh.clone(), stop.clone());
        tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let seat = format!("P{i}");
                if let Ok(r) = http
                    .post(format!("{base}/v1/shows/{sh}/seats/{seat}/hold"))
                    .send()
                    .await
                {
                    if r.status() == 201 {
                        let body: Value = r.json().await.unwrap_or(Value::Null);
                        acked.push((
                            seat,
                            body["holdToken"].as_str().unwrap_or_default().to_owned(),
                        ));
                    }
                }
            }
            acked
        })
    };
    // Confirm them, 8 at a time; every one must be acknowledged by a replica.
    let mut confirms = Vec::new();
    for chunk in tokens.chunks(25) {
        let chunk = chunk.to_vec();
        let (http, base, sh) = (s.http.clone(), s.base.clone(), sh.clone());
        confirms.push(tokio::spawn(async move {
            for (_, token) in &chunk {
                let r = http
                    .post(format!("{base}/v1/shows/{sh}/holds/{token}/confirm"))
                    .send()
                    .await
                    .expect("confirm");
                assert_eq!(r.status().as_u16(), 200);
                let body: Value = r.json().await.expect("json");
                assert!(body["replicas"].as_i64().is_some_and(|n| n >= 1), "{body}");
            }
        }));
    }
    for c in confirms {
        c.await.expect("confirms");
    }
    // Right after the last acknowledgement, the master crashes.
    cluster().kill(master).expect("kill -9 the master");
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = plain.await.expect("plain holds");
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("failover");

    let mut r = common::redis().await;
    let mut lost_sales = Vec::new();
    for (seat, token) in &tokens {
        let v: Option<String> =
            redis::AsyncCommands::get(&mut r, format!("seat-hold:{{show:{sh}}}:{seat}"))
                .await
                .expect("get");
        if v.as_deref() != Some(&format!("sold:{token}")) {
            lost_sales.push(seat.clone());
        }
    }
    let mut lost_holds = 0;
    for (seat, token) in &acked {
        let v: Option<String> =
            redis::AsyncCommands::get(&mut r, format!("seat-hold:{{show:{sh}}}:{seat}"))
                .await
                .expect("get");
        if v.as_deref() != Some(token.as_str()) {
            lost_holds += 1;
        }
    }
    eprintln!(
        "durability: {} confirmed sales, {} lost; {} acknowledged plain holds, {lost_holds} lost in the crash",
        tokens.len(),
        lost_sales.len(),
        acked.len()
    );
    assert!(
        lost_sales.is_empty(),
        "confirmed sales lost: {lost_sales:?}"
    );
    // And seathold serves the sold seats as sold after the failover.
    common::eventually(
        Duration::from_secs(10),
        "seathold to read from the new master",
        || async { s.get(&format!("/v1/shows/{sh}/seats/S199")).await.1["state"] == "sold" },
    )
    .await;

    cluster()
        .restart(master)
        .await
        .expect("restart the old master");
    cluster()
        .wait_until_ok(Duration::from_secs(30))
        .await
        .expect("cluster healthy again");
}
