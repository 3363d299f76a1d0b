//! Soak: mixed load against the real binary. Every answer must be a success
//! or a 409 conflict, no Redis error may occur, the holds left to run out
//! must be counted as expiries, and the daemon's memory (RSS, read from
//! `/proc`: the test fails where it cannot be read) must stay flat after
//! warm-up.
//!
//! The default run is short (10 s), for `cargo test`. The long run sets the
//! duration in seconds with `SEATHOLD_SOAK_SECS`, in a release build:
//!
//! ```text
//! SEATHOLD_SOAK_SECS=600 cargo test --release --test soak -- --nocapture
//! ```

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{show, Daemon};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// The resident set of process `pid` in KiB; panics when `/proc` cannot
/// tell, so that the memory check can never pass by not measuring.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status:\n{status}"))
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    conflicts: AtomicU64,
    holds: AtomicU64,
    confirms: AtomicU64,
    releases: AtomicU64,
    extends: AtomicU64,
    reads: AtomicU64,
    /// When each hold left to expire was made, and its TTL.
    abandoned: Mutex<Vec<(Instant, Duration)>>,
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

#[tokio::test]
async fn mixed_load_keeps_memory_flat_and_answers_only_successes_and_conflicts() {
    let secs: u64 = std::env::var("SEATHOLD_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let daemon = Daemon::start(&[]).await;
    let (pid, base) = (daemon.pid(), daemon.base.clone());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let prefix = show("soak");
    let mut workers = Vec::new();
    for w in 0..16u64 {
        let (http, base, stop, tally, prefix) = (
            http.clone(),
            base.clone(),
            stop.clone(),
            tally.clone(),
            prefix.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w);
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                // A new show every 20 s, 8 of them at a time, 1000 seats each:
                // enough contention for conflicts, seats coming back as holds
                // expire or are released.
                let epoch = started.elapsed().as_secs() / 20;
                let sh = format!("{prefix}-{epoch}-{}", rng.random_range(0..8));
                let n = rng.random_range(1..=4);
                let seats: Vec<String> = (0..n)
                    .map(|_| format!("S{}", rng.random_range(0..1000)))
                    .collect();
                let mut seats_unique = seats.clone();
                seats_unique.sort();
                seats_unique.dedup();
                // Long enough for the follow-up (extend, confirm, release)
                // of a stalled worker to find its hold.
                let ttl_ms = rng.random_range(1500..4000);
                let r = http
                    .post(format!("{base}/v1/shows/{sh}/holds"))
                    .json(&json!({"seats": seats_unique, "ttlMs": ttl_ms}))
                    .send()
                    .await
                    .expect("hold request");
                match r.status().as_u16() {
                    201 => {
                        tally.holds.fetch_add(1, Ordering::Relaxed);
                        let hold: Value = r.json().await.expect("json");
                        let t = hold["holdToken"].as_str().expect("token").to_owned();
                        let url = format!("{base}/v1/shows/{sh}/holds/{t}");
                        let mut ttl = Duration::from_millis(ttl_ms);
                        if rng.random_bool(0.3) {
                            let r = http
                                .post(format!("{url}/extend"))
                                .json(&json!({"ttlMs": 3000}))
                                .send()
                                .await
                                .expect("extend");
                            assert_eq!(r.status(), 200, "extend");
                            tally.extends.fetch_add(1, Ordering::Relaxed);
                            ttl = Duration::from_millis(3000);
                        }
                        match rng.random_range(0..10) {
                            0 => {
                                let r = http
                                    .post(format!("{url}/confirm"))
                                    .send()
                                    .await
                                    .expect("confirm");
                                assert_eq!(r.status(), 200, "confirm");
                                tally.confirms.fetch_add(1, Ordering::Relaxed);
                            }
                            1..=5 => {
                                let r = http.delete(&url).send().await.expect("release");
                                assert_eq!(r.status(), 204, "release");
                                tally.releases.fetch_add(1, Ordering::Relaxed);
                            }
                            // The rest are abandoned and expire in Redis.
                            _ => tally
                                .abandoned
                                .lock()
                                .expect("abandoned")
                                .push((Instant::now(), ttl)),
                        }
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    409 => {
                        tally.conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!(
                        "hold answered {other}: {}",
                        r.text().await.unwrap_or_default()
                    ),
                }
                let r = http
                    .get(format!(
                        "{base}/v1/shows/{sh}/seats?ids={}",
                        seats_unique.join(",")
                    ))
                    .send()
                    .await
                    .expect("read");
                assert_eq!(r.status(), 200, "read");
                tally.reads.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }

    let started = Instant::now();
    let mut samples = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        samples.push(rss_kib(pid));
        if workers.iter().any(|w| w.is_finished()) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await
            .expect("a worker saw an answer other than success or 409");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let expiries: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("seathold_hold_expiries_total ")?
                .parse()
                .ok()
        })
        .expect("seathold_hold_expiries_total in /metrics");
    // Every abandoned hold can expire; those whose TTL ran out more than
    // a second ago (Redis's active expiry and the event's way) must have.
    let (abandoned, ran_out) = {
        let list = tally.abandoned.lock().expect("abandoned");
        let now = Instant::now();
        let ran_out = list
            .iter()
            .filter(|(at, ttl)| *at + *ttl + Duration::from_secs(1) < now)
            .count();
        (list.len() as f64, ran_out as f64)
    };
    let errors: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("seathold_redis_errors_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();

    // Warm-up is the first fifth; compare the middle to the end.
    let n = samples.len();
    assert!(n >= 10, "too few samples: {n}");
    let mut middle = samples[n / 5..n * 3 / 5].to_vec();
    let mut end = samples[n * 3 / 5..].to_vec();
    let (mid, last) = (median(&mut middle), median(&mut end));
    let g = |x: &AtomicU64| x.load(Ordering::Relaxed);
    eprintln!(
        "soak {elapsed:.0} s: {} holds ({:.0}/s), {} conflicts, {} extends, {} releases, {} confirms, {} reads, \
         {expiries} expiries counted ({ran_out} abandoned holds ran out of {abandoned}), {errors} Redis errors; RSS median {mid} KiB after warm-up, {last} KiB at the end, \
         max {} KiB",
        g(&tally.holds),
        g(&tally.holds) as f64 / elapsed,
        g(&tally.conflicts),
        g(&tally.extends),
        g(&tally.releases),
        g(&tally.confirms),
        g(&tally.reads),
        samples.iter().max().unwrap_or(&0),
    );
    assert_eq!(errors, 0.0, "Redis errors during the soak");
    assert!(
        expiries >= ran_out && expiries <= abandoned,
        "{expiries} expiries counted; {ran_out} abandoned holds had run out, {abandoned} were abandoned"
    );
    assert!(
        ran_out > 0.0,
        "no abandoned hold ran out: the run was too short"
    );
    assert!(
        g(&tally.conflicts) > 0 && g(&tally.holds) > 100,
        "the load had holds and conflicts"
    );
    // The allocator keeps what it freed for a while, so the end's median
    // spreads: the same build grew by -1% to +9% over eight local runs
    // (2026-12-02, and so did the build before this pass's changes), and
    // by 14% in one CI run. A quarter plus 1 MiB still fails a leak of
    // more than about 3.5 KB per hold (at some 760 holds/s, the medians
    // are 4 s apart).
    assert!(
        last <= mid + mid / 4 + 1024,
        "RSS grew from {mid} KiB to {last} KiB after warm-up"
    );
}
