//! `seathold delete-show`, the real binary against the shared cluster: a
//! show that is over leaves no key behind (sold seats, sale records, its
//! event stream, pools, settings and idempotency records included) while
//! another show of the same slot keeps every key; `--dry-run` deletes
//! nothing; a show with a seat still held, or an expiry no daemon has
//! written yet, is refused unless `--force`; a bad show id is a
//! configuration error.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{keys_in_slot, options, server_with, show, show_where, slot_of, TestServer};
use serde_json::json;

/// `seathold delete-show` on the shared cluster with `args`.
fn delete_show_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seathold"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SEATHOLD_") {
            cmd.env_remove(name);
        }
    }
    cmd.arg("delete-show")
        .args(["--redis-nodes", &common::cluster().seed_urls().join(",")])
        .args(args);
    cmd
}

/// Runs `seathold delete-show` on the shared cluster with `args`; answers
/// the exit code and stdout plus stderr.
fn delete_show(args: &[&str]) -> (Option<i32>, String) {
    let out = delete_show_command(args)
        .output()
        .expect("run seathold delete-show");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The keys of `sh` on its master, sorted.
async fn keys_of(sh: &str) -> Vec<String> {
    let tag = format!("seat-hold:{{show:{sh}}}");
    keys_in_slot(slot_of(sh))
        .await
        .1
        .into_iter()
        .filter(|k| k.starts_with(&tag))
        .collect()
}

/// Holds `seats` of `sh`; answers the token.
async fn hold(s: &TestServer, sh: &str, seats: &[&str]) -> String {
    let (status, body) = s
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": seats, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    body["holdToken"].as_str().expect("token").to_owned()
}

/// Gives `sh` a pool `floor` of 10 units.
async fn put_pool(s: &TestServer, sh: &str) {
    let (status, body) = s
        .call(
            "PUT",
            &format!("/v1/shows/{sh}/pools/floor"),
            Some(json!({"capacity": 10})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

async fn state(s: &TestServer, sh: &str, seat: &str) -> String {
    let (status, body) = s.get(&format!("/v1/shows/{sh}/seats/{seat}")).await;
    assert_eq!(status, 200, "{body}");
    body["state"].as_str().expect("state").to_owned()
}

#[tokio::test]
async fn a_show_that_is_over_leaves_no_key_and_its_neighbour_keeps_all() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let sh = show("over");
    let neighbour = show_where("over", |slot| slot == slot_of(&sh));

    // Everything a show writes: sold seats and their sale record, a
    // released hold, a pool, settings, an Idempotency-Key's record, events.
    put_pool(&s, &sh).await;
    let (status, body) = s
        .call(
            "PUT",
            &format!("/v1/shows/{sh}/settings"),
            Some(json!({"maxPerHolder": 8})),
        )
        .await;
    assert!(status == 200 || status == 204, "{status} {body}");
    let sold = hold(&s, &sh, &["E1", "E2"]).await;
    let (status, body) = s.confirm(&sh, &sold).await;
    assert_eq!(status, 200, "{body}");
    let released = hold(&s, &sh, &["E3"]).await;
    let answer = common::request_at(
        &s.http,
        &s.base,
        "DELETE",
        &format!("/v1/shows/{sh}/holds/{released}"),
        None,
        Some("release-e3"),
    )
    .await;
    assert_eq!(answer.status().as_u16(), 204);
    let units = s
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"pools": {"floor": 2}, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(units.0, 201, "{}", units.1);
    let token = units.1["holdToken"].as_str().expect("token").to_owned();
    let (status, body) = s.confirm(&sh, &token).await;
    assert_eq!(status, 200, "{body}");

    // The neighbour, in the same slot: a seat sold and one held.
    let other = hold(&s, &neighbour, &["F1"]).await;
    let (status, body) = s.confirm(&neighbour, &other).await;
    assert_eq!(status, 200, "{body}");
    hold(&s, &neighbour, &["F2"]).await;

    let before = keys_of(&sh).await;
    let neighbour_before = keys_of(&neighbour).await;
    for part in [
        "}:E1",
        "}:E2",
        "}#sale:",
        "}#events",
        "}#pool",
        "}#settings",
        "}#idem:release-e3",
    ] {
        assert!(
            before.iter().any(|k| k.contains(part)),
            "no key with {part:?} among {before:?}"
        );
    }

    let (code, out) = delete_show(&["--dry-run", &sh]);
    assert_eq!(code, Some(0), "{out}");
    let line = format!(
        "would delete  show {sh}: keys {}, seats sold 2, holds live 0 (",
        before.len()
    );
    assert!(out.contains(&line), "{line:?} not in {out}");
    assert_eq!(keys_of(&sh).await, before, "--dry-run deleted keys");

    let (code, out) = delete_show(&[&sh]);
    assert_eq!(code, Some(0), "{out}");
    let line = format!(
        "deleted  show {sh}: keys {}, seats sold 2, holds live 0 (",
        before.len()
    );
    assert!(out.contains(&line), "{line:?} not in {out}");
    assert!(out.contains(&format!(", slot {}", slot_of(&sh))), "{out}");
    assert_eq!(keys_of(&sh).await, Vec::<String>::new(), "keys left");
    assert_eq!(
        keys_of(&neighbour).await,
        neighbour_before,
        "the neighbour's keys changed"
    );

    // The daemon sees a show that never sold anything; the neighbour is
    // as it was.
    assert_eq!(state(&s, &sh, "E1").await, "free");
    assert_eq!(state(&s, &neighbour, "F1").await, "sold");
    assert_eq!(state(&s, &neighbour, "F2").await, "held");
    hold(&s, &sh, &["E1"]).await;

    // No key at all (a mistyped id, or deleted already): said, exit 1.
    let empty = show("none");
    let (code, out) = delete_show(&[&empty]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("not found  show {empty}: no keys (")),
        "{out}"
    );
}

/// Pool units are held too: a show whose only live hold takes units of its
/// pool, and a show whose pool lends units to a hold of another show of
/// the same slot, are refused like a show with a seat held.
#[tokio::test]
async fn a_show_with_pool_units_held_is_refused() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let ga = show("ga");
    let lender = show_where("ga", |slot| slot == slot_of(&ga));
    for sh in [&ga, &lender] {
        put_pool(&s, sh).await;
    }
    let (status, body) = s
        .post(
            &format!("/v1/shows/{ga}/holds"),
            json!({"pools": {"floor": 3}, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    // A hold of `ga`'s seat and `lender`'s units: its record is `ga`'s.
    let (status, body) = s
        .post(
            "/v1/holds",
            json!({"seats": [
                {"show": ga, "seat": "Z1"},
                {"show": lender, "pool": "floor", "quantity": 2}
            ], "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    for (sh, live) in [(&ga, 2), (&lender, 1)] {
        let before = keys_of(sh).await;
        let (code, out) = delete_show(&[sh]);
        assert_eq!(code, Some(1), "{out}");
        let said = format!(
            "refused  show {sh}: keys {}, seats sold 0, holds live {live} (",
            before.len()
        );
        assert!(out.contains(&said), "{said:?} not in {out}");
        assert_eq!(keys_of(sh).await, before, "a refused show lost keys");
    }
}

#[tokio::test]
async fn a_show_with_a_seat_held_is_refused_unless_forced() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let sh = show("live");
    let sold = hold(&s, &sh, &["A1"]).await;
    let (status, body) = s.confirm(&sh, &sold).await;
    assert_eq!(status, 200, "{body}");
    hold(&s, &sh, &["A2", "A3"]).await;
    let done = show("done");
    let token = hold(&s, &done, &["B1"]).await;
    let (status, body) = s.confirm(&done, &token).await;
    assert_eq!(status, 200, "{body}");
    let before = keys_of(&sh).await;

    // Refused; the next show of the same command is deleted all the same.
    let (code, out) = delete_show(&[&sh, &done, "--force=false"]);
    assert_eq!(code, Some(2), "--force takes no value: {out}");
    assert_eq!(state(&s, &done, "B1").await, "sold");
    let (code, out) = delete_show(&[&sh, &done]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("deleted  show {done}: keys ")),
        "{out}"
    );
    assert_eq!(keys_of(&done).await, Vec::<String>::new());
    assert!(
        out.contains(&format!(
            "refused  show {sh}: keys {}, seats sold 1, holds live 1 (",
            before.len()
        )),
        "{out}"
    );
    assert!(out.contains("--force"), "says how to go on: {out}");
    assert_eq!(keys_of(&sh).await, before, "a refused show lost keys");

    let (code, out) = delete_show(&["--force", &sh]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&format!("deleted  show {sh}:")), "{out}");
    assert_eq!(keys_of(&sh).await, Vec::<String>::new());
    assert_eq!(state(&s, &sh, "A2").await, "free");

    // Not a show id, or none: configuration errors, nothing deleted.
    let (code, out) = delete_show(&["no/show"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("is not a show id"), "{out}");
    let (code, out) = delete_show(&[]);
    assert_eq!(code, Some(2), "{out}");
    assert_eq!(state(&s, &done, "B1").await, "free");
}

/// A hold whose time ran out while no daemon ran, so that no `expired`
/// event was written for it yet, counts as live: deleting its show then
/// would lose that expiry (and, for a hold of several shows, the one event
/// of them that counts it in `seathold_hold_expiries_total`). Once a daemon
/// has swept it, the show is deleted.
#[tokio::test]
async fn a_show_with_an_expiry_not_yet_written_is_refused() {
    let _guard = common::shared().await;
    let sh = show("unswept");
    // A key prefix of its own: no other test's daemon sweeps this show.
    let prefix = format!("{sh}:");
    let mut opts = options();
    opts.key_prefix.clone_from(&prefix);
    let s = server_with(opts.clone()).await;
    let (status, body) = s
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["A1"], "ttlMs": 1500}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    s.stop().await;
    tokio::time::sleep(std::time::Duration::from_millis(2_000)).await;

    let (code, out) = delete_show(&["--key-prefix", &prefix, &sh]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("refused  show {sh}: keys "))
            && out.contains(", seats sold 0, holds live 1 ("),
        "{out}"
    );

    // A daemon that starts sweeps it; then the show goes.
    let s = server_with(opts).await;
    common::eventually(
        std::time::Duration::from_secs(5),
        "the expired event",
        || async {
            let (_, page) = s.get(&format!("/v1/shows/{sh}/events?after=0-0")).await;
            page["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e["type"] == "expired"))
        },
    )
    .await;
    let (code, out) = delete_show(&["--key-prefix", &prefix, &sh]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("deleted  show {sh}: keys ")) && out.contains("holds live 0 ("),
        "{out}"
    );
    s.stop().await;
}

/// A hold made after the command found no live hold, and before its keys
/// went, stops the deletion: the show's keys are deleted by a script that
/// first checks, on Redis's clock, that none of them (and no hold in the
/// show's deadline index or a pool's holds) belongs to a live hold. Here the
/// master holds writes back (`CLIENT PAUSE WRITE`) while a hold and then
/// the command's deletion queue up behind it, in that order. Before, the
/// deletion went ahead and took the new hold's deadline entry, pool and
/// settings with it: its `expired` event was never written, and its pool
/// units were not counted.
#[tokio::test]
async fn a_hold_made_while_the_show_is_deleted_stops_the_deletion() {
    let _guard = common::exclusive().await;
    // Time for the command to start while the hold waits on the master.
    let mut opts = options();
    opts.redis_timeout_ms = 15_000;
    opts.confirm_wait_timeout_ms = 1_000;
    let s = server_with(opts).await;
    // A round where another script of the daemon (a sweep) waited on the
    // master in the hold's place may let the deletion go first: then the
    // hold finds the pool deleted (409), as it should, and the round is
    // played again.
    for round in 1..=3 {
        if deletion_after_a_hold(&s, round).await {
            return;
        }
    }
    panic!("in 3 rounds the deletion never queued up behind the hold");
}

/// One round of the test above; false when the deletion ran first.
async fn deletion_after_a_hold(s: &TestServer, round: u32) -> bool {
    let sh = show(&format!("raced{round}"));
    put_pool(s, &sh).await;
    let sold = hold(s, &sh, &["E1"]).await;
    let (status, body) = s.confirm(&sh, &sold).await;
    assert_eq!(status, 200, "{body}");
    let before = keys_of(&sh).await;
    let (_, master) = common::slot_and_master(&sh).await;

    // Commands waiting on the master: of the process `pid`, or any script.
    let waiting = |pid: Option<u32>| async move {
        let own = pid.map(common::local_ports).unwrap_or_default();
        common::client_list(master)
            .await
            .iter()
            .filter(|c| {
                c["flags"].contains('b')
                    && (pid.is_some() || c["cmd"].starts_with("eval"))
                    && pid.is_none_or(|_| {
                        c["addr"]
                            .rsplit(':')
                            .next()
                            .and_then(|p| p.parse().ok())
                            .is_some_and(|p: u16| own.contains(&p))
                    })
            })
            .count()
    };
    common::pause_clients(master, 20_000, "WRITE").await;
    let holding = {
        let (http, base, sh) = (s.http.clone(), s.base.clone(), sh.clone());
        tokio::spawn(async move {
            let answer = common::request_at(
                &http,
                &base,
                "POST",
                &format!("/v1/shows/{sh}/holds"),
                Some(json!({"seats": ["E2"], "pools": {"floor": 2}, "ttlMs": 60000})),
                None,
            )
            .await;
            let status = answer.status().as_u16();
            (
                status,
                answer.json::<serde_json::Value>().await.expect("json"),
            )
        })
    };
    common::eventually(Duration::from_secs(5), "the hold waiting", || async {
        waiting(None).await > 0
    })
    .await;
    let deleting = delete_show_command(&[&sh])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run seathold delete-show");
    let pid = deleting.id();
    common::eventually(Duration::from_secs(10), "the deletion waiting", || async {
        waiting(Some(pid)).await > 0
    })
    .await;
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut common::node(master).await)
        .await
        .expect("CLIENT UNPAUSE");

    let (status, body) = holding.await.expect("hold task");
    let out = tokio::task::spawn_blocking(move || deleting.wait_with_output())
        .await
        .expect("join")
        .expect("delete-show output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if status == 409 {
        // The pool was gone: the deletion went first.
        assert_eq!(body["error"], "pool_exhausted", "{body}");
        assert_eq!(out.status.code(), Some(0), "{text}");
        eprintln!("round {round}: the deletion went first\n{text}");
        return false;
    }
    assert_eq!(status, 201, "{body}");
    let token = body["holdToken"].as_str().expect("token");
    assert_eq!(out.status.code(), Some(1), "{text}");
    let said = format!("interrupted  show {sh}: keys {}, deleted 0 (", before.len());
    assert!(
        text.contains(&said)
            && text.contains("a hold was made on the show while it was being deleted"),
        "{said:?} not in {text}"
    );
    let after = keys_of(&sh).await;
    for key in &before {
        assert!(
            after.contains(key),
            "{key} deleted under a live hold: {after:?}"
        );
    }
    assert!(
        after.iter().any(|k| k.ends_with("#deadlines")),
        "the new hold's deadline index: {after:?}"
    );
    let (status, body) = s.get(&format!("/v1/shows/{sh}/holds/{token}")).await;
    assert_eq!(status, 200, "{body}");
    let (status, pool) = s.get(&format!("/v1/shows/{sh}/pools/floor")).await;
    assert_eq!(status, 200, "{pool}");
    assert_eq!(pool["held"], 2, "{pool}");
    assert_eq!(state(s, &sh, "E1").await, "sold");
    assert_eq!(state(s, &sh, "E2").await, "held");
    true
}

/// A daemon whose seat view knew a deleted show's sold seats forgets them
/// within about a second, however often the show is asked for: its stream
/// reader finds that its position is gone (the stream was deleted, and a
/// new one started by the next holds), starts over, and the seats are
/// free. Before, the reader went on with the new stream as if nothing had
/// happened, and every hold attempt kept the view alive: a seat sold
/// before the deletion was refused as sold for as long as it was asked for
/// (more than 40 s in a review), while reads of it said free.
#[tokio::test]
async fn a_view_forgets_the_sold_seats_of_a_deleted_show() {
    let _guard = common::shared().await;
    let s = server_with(seathold::config::Options {
        view_min_rate: 0,
        ..options()
    })
    .await;
    let sh = show("reused");
    let token = hold(&s, &sh, &["E7"]).await;
    let (status, body) = s.confirm(&sh, &token).await;
    assert_eq!(status, 200, "{body}");
    // A hold of E7 refused as sold: the view has it (from the `confirmed`
    // event, or from Redis's answer), and answers from now on.
    let path = format!("/v1/shows/{sh}/seats/E7/hold");
    for _ in 0..20 {
        let (status, body) = s.post(&path, json!({"ttlMs": 60000})).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["taken"][0]["state"], "sold", "{body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (code, out) = delete_show(&[&sh]);
    assert_eq!(code, Some(0), "{out}");
    // New activity makes a new stream, which the old reader would follow.
    hold(&s, &sh, &["F1"]).await;
    granted_within_3_s(&s, &path).await;
}

/// The same when the deleted show's new stream soon has more entries than
/// the old one had (four holds right after the deletion, the reader's
/// periodic check a while before): the reader finds the new stream's first
/// entry past its position in the reply that moves into it. Before, it
/// noticed a deleted stream only by a check that ran every second and
/// compared entries-added, which the new stream had already passed, and E7
/// stayed sold in the view (more than 3 s in a review).
#[tokio::test]
async fn a_view_forgets_a_deleted_show_begun_again_by_more_holds() {
    let _guard = common::shared().await;
    let s = server_with(seathold::config::Options {
        view_min_rate: 0,
        ..options()
    })
    .await;
    let sh = show("reused-more");
    let token = hold(&s, &sh, &["E7"]).await;
    let (status, body) = s.confirm(&sh, &token).await;
    assert_eq!(status, 200, "{body}");
    let path = format!("/v1/shows/{sh}/seats/E7/hold");
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(2500) {
        let (status, body) = s.post(&path, json!({"ttlMs": 60000})).await;
        assert_eq!(status, 409, "{body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (code, out) = delete_show(&[&sh]);
    assert_eq!(code, Some(0), "{out}");
    for seat in ["X0", "X1", "X2", "X3"] {
        hold(&s, &sh, &[seat]).await;
    }
    granted_within_3_s(&s, &path).await;
}

/// Holds at `path` (a seat of a deleted show) every 100 ms until granted;
/// fails if it is still refused 3 s after the first try.
async fn granted_within_3_s(s: &common::TestServer, path: &str) {
    let deleted = std::time::Instant::now();
    loop {
        let (status, body) = s.post(path, json!({"ttlMs": 60000})).await;
        if status == 201 {
            break;
        }
        assert_eq!(status, 409, "{body}");
        assert!(
            deleted.elapsed() < std::time::Duration::from_secs(3),
            "E7 of the deleted show still refused {:?} after: {body}",
            deleted.elapsed()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
