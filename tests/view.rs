//! The local seat view (issue 14) against a real Redis Cluster: conflict
//! storms answered without Redis, never a grant, never a refusal of a seat
//! free for longer than `--view-max-lag-ms`, reads equal to Redis's, holds
//! made before the view existed, writers outside seathold, a reader that is
//! not current, and the switches.
//!
//! Every test counts process-wide metrics (`seathold_view_answers_total`)
//! or a master's `INFO commandstats`, so each takes the binary's lock
//! exclusively. The daemons of a test share the process's metrics: only
//! the daemon under test (A) has a view; the others (B) run with
//! `view_max_lag_ms: 0`, so that every answer they give comes from Redis.

mod common;

use std::time::{Duration, Instant};

use common::{
    eventually, exclusive, node_calls, options, redis, series, server_with, show, slot_and_master,
    TestServer,
};
use futures_util::StreamExt;
use seathold::config::Options;
use serde_json::{json, Value};

/// The view's lag bound in these tests: the default.
const LAG_MS: u64 = 250;

/// A daemon whose every show gets a view at its first request a view could
/// answer (a read, or a hold Redis refuses).
fn with_view() -> Options {
    Options {
        view_min_rate: 0,
        ..options()
    }
}

/// A daemon without a view: everything it answers comes from Redis.
fn without_view() -> Options {
    Options {
        view_max_lag_ms: 0,
        ..options()
    }
}

/// `seathold_view_answers_total{kind}` of this process.
async fn answers(s: &TestServer, kind: &str) -> f64 {
    series(
        &s.metrics().await,
        &format!("seathold_view_answers_total{{kind=\"{kind}\"}}"),
    )
}

/// `POST /v1/shows/{show}/seats/{seat}/hold` with an optional `ttlMs`.
async fn hold_one(s: &TestServer, sh: &str, seat: &str, ttl_ms: Option<u64>) -> (u16, Value) {
    let path = format!("/v1/shows/{sh}/seats/{seat}/hold");
    match ttl_ms {
        Some(ttl) => s.post(&path, json!({ "ttlMs": ttl })).await,
        None => s.call("POST", &path, None).await,
    }
}

/// Holds one seat; panics unless 201. Answers the token.
async fn held(s: &TestServer, sh: &str, seat: &str, ttl_ms: Option<u64>) -> String {
    let (status, body) = hold_one(s, sh, seat, ttl_ms).await;
    assert_eq!(status, 201, "hold {sh}/{seat}: {body}");
    body["holdToken"].as_str().expect("token").to_owned()
}

async fn release(s: &TestServer, sh: &str, token: &str) {
    let (status, body) = s
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{token}"), None)
        .await;
    assert_eq!(status, 204, "release {sh} {token}: {body}");
}

async fn seat_state(s: &TestServer, sh: &str, seat: &str) -> Value {
    let (status, body) = s.get(&format!("/v1/shows/{sh}/seats/{seat}")).await;
    assert_eq!(status, 200, "GET {sh}/{seat}: {body}");
    body
}

/// Waits until `s`'s view of `sh` is current and knows `seat` taken (held
/// or sold by its events): a read of it is answered by the view. The first
/// read also creates the view (`view_min_rate: 0`).
async fn wait_view(s: &TestServer, sh: &str, seat: &str) {
    eventually(
        Duration::from_secs(5),
        "the view to answer a read",
        || async {
            let before = answers(s, "read").await;
            seat_state(s, sh, seat).await;
            answers(s, "read").await > before
        },
    )
    .await;
}

/// Gives `sh` a view on `s` that sees every later event: a read makes it
/// (reads count toward a view; granted holds do not), and a seat held
/// after that and answered by the view proves its reader has started.
async fn start_view(s: &TestServer, sh: &str) {
    seat_state(s, sh, "V0").await;
    held(s, sh, "V0", None).await;
    wait_view(s, sh, "V0").await;
}

/// One answer of a storm: the seat asked for, status, body, and when the
/// request was sent and answered.
struct Answer {
    seat: String,
    status: u16,
    body: Value,
    sent: Instant,
    done: Instant,
}

/// `n` single-seat holds of `seats` (round robin), `parallel` in flight.
async fn storm(
    s: &TestServer,
    sh: &str,
    seats: &[String],
    n: usize,
    parallel: usize,
) -> Vec<Answer> {
    futures_util::stream::iter(0..n)
        .map(|i| {
            let seat = seats[i % seats.len()].clone();
            async move {
                let sent = Instant::now();
                let (status, body) = hold_one(s, sh, &seat, None).await;
                Answer {
                    seat,
                    status,
                    body,
                    sent,
                    done: Instant::now(),
                }
            }
        })
        .buffer_unordered(parallel)
        .collect()
        .await
}

/// The remaining time of a seat key in Redis (PTTL), and when it was read.
async fn pttl(sh: &str, seat: &str) -> (i64, Instant) {
    let mut r = redis().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(format!("seat-hold:{{show:{sh}}}:{seat}"))
        .query_async(&mut r)
        .await
        .expect("PTTL");
    (ttl, Instant::now())
}

/// The `evalsha` calls of the master at `port` (every seathold script).
async fn evalsha(port: u16) -> u64 {
    node_calls(port, "evalsha").await
}

/// Asserts that every answer of a storm is the 409 Redis would give: the
/// one seat asked for, held, with `expiresInMs` within the lag bound (plus
/// a little) of its key's PTTL.
fn assert_refusals(answers: &[Answer], pttls: &std::collections::HashMap<String, (i64, Instant)>) {
    let slack = (LAG_MS + 100) as i64;
    for a in answers {
        assert_eq!(a.status, 409, "{}: {}", a.seat, a.body);
        assert_eq!(a.body["error"], "seats_taken", "{}", a.body);
        let taken = a.body["taken"].as_array().expect("taken");
        assert_eq!(taken.len(), 1, "{}", a.body);
        assert_eq!(taken[0]["seat"], a.seat.as_str(), "{}", a.body);
        assert_eq!(taken[0]["state"], "held", "{}", a.body);
        assert!(taken[0].get("show").is_none(), "{}", a.body);
        let (ttl, at) = pttls[&a.seat];
        let since = |t: Instant| t.saturating_duration_since(at).as_millis() as i64;
        let (low, high) = (ttl - since(a.done) - slack, ttl - since(a.sent) + slack);
        let got = taken[0]["expiresInMs"].as_i64().expect("expiresInMs");
        assert!(
            (low..=high).contains(&got),
            "{}: expiresInMs {got} outside {low}..={high} (PTTL {ttl})",
            a.seat
        );
    }
}

/// Runs `round` until it answers `Ok`, at most 3 times. The view answers
/// while its reader is current, which it is but for moments (a reply
/// handled late on a busy machine): a storm may meet one, and what it
/// sends to Redis meanwhile is not the view's. Every round asserts its
/// answers; a view that never answers fails all three.
async fn in_3_rounds<F, Fut>(mut round: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut failed = Vec::new();
    for _ in 0..3 {
        match round().await {
            Ok(()) => return,
            Err(why) => failed.push(why),
        }
    }
    panic!("in 3 rounds: {failed:#?}");
}

/// A storm of `n` holds of `seats` (`parallel` in flight), every one a
/// 409, of which the view answers at least `least` (in 3 rounds at most).
async fn view_storm(
    a: &TestServer,
    sh: &str,
    seats: &[String],
    (n, parallel): (usize, usize),
    least: f64,
    what: &str,
) {
    in_3_rounds(|| async {
        let c0 = answers(a, "conflict").await;
        for answer in storm(a, sh, seats, n, parallel).await {
            assert_eq!(answer.status, 409, "{}", answer.body);
        }
        match answers(a, "conflict").await - c0 {
            got if got >= least => Ok(()),
            got => Err(format!("{what}: the view answered {got} of {n} conflicts")),
        }
    })
    .await;
}

/// 1. A conflict storm: 500 single-seat holds (20 in flight) of 10 held
///    seats, once the view is current, are all the 409 Redis would give,
///    and at least 90% of them reach no Redis node: the view's conflict
///    counter grows by at least 450, and the slot master's `evalsha` calls
///    by at most 50 beyond its quiet rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_storm_is_answered_without_redis() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("storm");
    let (_, master) = slot_and_master(&sh).await;
    let seats: Vec<String> = (1..=10).map(|i| format!("E{i}")).collect();
    for seat in &seats {
        held(&a, &sh, seat, None).await;
    }
    wait_view(&a, &sh, &seats[0]).await;
    let mut pttls = std::collections::HashMap::new();
    for seat in &seats {
        pttls.insert(seat.clone(), pttl(&sh, seat).await);
    }

    // The master's own rate of evalsha while nothing is asked of it.
    let quiet = Instant::now();
    let q0 = evalsha(master).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let background = (evalsha(master).await - q0) as f64 / quiet.elapsed().as_secs_f64();

    in_3_rounds(|| async {
        let (c0, e0, started) = (
            answers(&a, "conflict").await,
            evalsha(master).await,
            Instant::now(),
        );
        let result = storm(&a, &sh, &seats, 500, 20).await;
        let took = started.elapsed().as_secs_f64();
        let (c1, e1) = (answers(&a, "conflict").await, evalsha(master).await);

        assert_refusals(&result, &pttls);
        if c1 - c0 < 450.0 {
            return Err(format!(
                "only {} of 500 conflicts were answered by the view",
                c1 - c0
            ));
        }
        let allowed = 50.0 + background * took;
        if (e1 - e0) as f64 > allowed {
            return Err(format!(
                "the master ran {} evalsha during the storm (allowed {allowed:.0}, quiet rate {background:.1}/s)",
                e1 - e0
            ));
        }
        Ok(())
    })
    .await;
}

/// A show of `tag` whose view on `a` knows E7 held: the show, the hold's
/// token, and `seathold_event_reader_gaps_total` so far.
async fn view_knows_e7_held(a: &TestServer, tag: &str) -> (String, String, f64) {
    let sh = show(tag);
    start_view(a, &sh).await;
    let token = held(a, &sh, "E7", None).await;
    wait_view(a, &sh, "E7").await;
    let gaps = series(&a.metrics().await, "seathold_event_reader_gaps_total");
    (sh, token, gaps)
}

/// After [`release_behind_a_trim`]: the reader of `sh` on `a` finds the gap
/// (more than `gaps`), its view starts over, and E7 is granted.
async fn assert_gap_found_and_e7_granted(a: &TestServer, sh: &str, gaps: f64) {
    eventually(
        Duration::from_secs(5),
        "the reader to find the gap",
        || async { series(&a.metrics().await, "seathold_event_reader_gaps_total") > gaps },
    )
    .await;
    wait_view(a, sh, "Z300").await;
    let (status, body) = hold_one(a, sh, "E7", None).await;
    assert_eq!(status, 201, "E7 is free in Redis: {body}");
}

/// Releases E7 of `sh` (hold `token`) by hand, with its `released` event,
/// then writes 300 more events, all with `XADD MAXLEN ~ cap`: the release's
/// event is trimmed away.
async fn release_behind_a_trim(sh: &str, token: &str, cap: u64) {
    let ks = seathold::keys::KeySpace::new("seat-hold:");
    let _: () = redis::cmd("EVAL")
        .arg(
            "redis.call('DEL', KEYS[2], KEYS[3]) \
             redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 't', 'released', \
               'r', ARGV[1], 's', 'E7') \
             for i = 1, 300 do \
               redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 't', 'held', \
                 'r', '00000000000000ff', 's', 'Z' .. i, 'l', '600000') \
             end",
        )
        .arg(3)
        .arg(ks.events(sh))
        .arg(ks.seat(sh, "E7"))
        .arg(ks.hold_record(sh, token))
        .arg("0123456789abcdef")
        .arg(cap)
        .query_async(&mut redis().await)
        .await
        .expect("EVAL");
}

/// 1b. A reader that never failed can still miss events: more than
///    `--events-max-len` written at once (here by one script: the release
///    of a seat the view knows held, then 300 more) are trimmed before its
///    next XREAD, which then starts at the oldest entry kept. The reader
///    finds the gap and the view forgets what it knew: the released seat
///    is granted by Redis, not refused from the stale view until the old
///    hold's expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_that_missed_trimmed_events_forgets_them() {
    let _lock = exclusive().await;
    let a = server_with(Options {
        events_max_len: 100,
        ..with_view()
    })
    .await;
    let (sh, token, gaps) = view_knows_e7_held(&a, "trimmed").await;

    release_behind_a_trim(&sh, &token, 100).await;

    assert_gap_found_and_e7_granted(&a, &sh, gaps).await;
}

/// The same when the stream is trimmed by a writer with a smaller cap
/// than this instance's (`--events-max-len` differs between instances, as
/// while it is changed): the reader finds the gap whatever cap trimmed
/// the stream. Before, it looked for one only when a reply held at least
/// its own cap's worth of entries (up to 1,024), so a reply after a trim
/// to a smaller cap passed unchecked, and the view refused E7, released
/// and free in Redis, for the rest of its hold's TTL (a reviewer's find).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_finds_events_trimmed_under_a_smaller_cap() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let (sh, token, gaps) = view_knows_e7_held(&a, "trimmed-small").await;

    release_behind_a_trim(&sh, &token, 1).await;
    let ks = seathold::keys::KeySpace::new("seat-hold:");
    let mut r = redis().await;
    let kept: usize = redis::cmd("XLEN")
        .arg(ks.events(&sh))
        .query_async(&mut r)
        .await
        .expect("XLEN");
    assert!(
        kept < 1_024,
        "a reply after the trim is short: {kept} entries kept"
    );

    assert_gap_found_and_e7_granted(&a, &sh, gaps).await;
}

/// 2. The view never grants. With one seat it knows free (held and
///    released) and one it knows held, a hold of both is refused, naming
///    only the held one; a hold of free seats is granted, by Redis (its
///    master ran a script, and the view answered no conflict).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_never_grants() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("grants");
    let (_, master) = slot_and_master(&sh).await;
    start_view(&a, &sh).await;
    for seat in ["F1", "F2"] {
        let token = held(&a, &sh, seat, None).await;
        release(&a, &sh, &token).await;
    }
    // T1's event comes after F1's and F2's `released`: once the view
    // answers T1, it knows F1 and F2 free.
    held(&a, &sh, "T1", None).await;
    wait_view(&a, &sh, "T1").await;
    // A storm first: the view answers conflicts of this show.
    view_storm(&a, &sh, &["T1".to_owned()], (50, 10), 45.0, "T1 held").await;

    let (status, body) = a
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["F1", "T1"]}),
        )
        .await;
    assert_eq!(status, 409, "a free seat with a taken one: {body}");
    let taken = body["taken"].as_array().expect("taken");
    assert_eq!(taken.len(), 1, "{body}");
    assert_eq!(taken[0]["seat"], "T1", "{body}");

    let (c0, e0) = (answers(&a, "conflict").await, evalsha(master).await);
    let (status, body) = a
        .post(
            &format!("/v1/shows/{sh}/holds"),
            json!({"seats": ["F1", "F2"]}),
        )
        .await;
    assert_eq!(status, 201, "free seats: {body}");
    assert!(evalsha(master).await > e0, "a grant that no script made");
    assert_eq!(answers(&a, "conflict").await, c0);
}

/// 3. The view never refuses a seat free for longer than the lag bound.
///    30 times, with a seat A's view saw held by A (and refused: the view
///    knew it), released through B: after the bound plus 50 ms, A grants
///    it. A hold of B with `ttlMs` 800 is granted by A 800 + 250 + 100 ms
///    later. And a hold whose end is within the bound is left to Redis:
///    the view answers none of its conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seat_free_for_longer_than_the_bound_is_granted() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let b = server_with(without_view()).await;
    let sh = show("free");
    held(&a, &sh, "A0", None).await;
    wait_view(&a, &sh, "A0").await;

    let c0 = answers(&a, "conflict").await;
    for i in 1..=30 {
        let seat = format!("R{i}");
        let token = held(&a, &sh, &seat, None).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (status, body) = hold_one(&a, &sh, &seat, None).await;
        assert_eq!(status, 409, "{seat} is held: {body}");
        release(&b, &sh, &token).await;
        tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
        let (status, body) = hold_one(&a, &sh, &seat, None).await;
        assert_eq!(
            status,
            201,
            "round {i}: {seat} released through B {} ms ago was refused by A: {body}",
            LAG_MS + 50
        );
    }
    let refused = answers(&a, "conflict").await - c0;
    assert!(
        refused >= 24.0,
        "the view answered only {refused} of the 30 refusals: the test proves nothing"
    );

    // Expiry: no event says the seat is free, its time does.
    held(&b, &sh, "X1", Some(800)).await;
    tokio::time::sleep(Duration::from_millis(800 + LAG_MS + 100)).await;
    let (status, body) = hold_one(&a, &sh, "X1", None).await;
    assert_eq!(
        status,
        201,
        "a hold that ended {} ms ago: {body}",
        LAG_MS + 100
    );

    // A hold ending within the bound: Redis answers its conflicts. Its end
    // on this machine's clock is at least the request's sending plus the
    // time Redis gave it (Redis ran it after it was sent): while that says
    // the hold has less than the bound left, it has. The requests stop
    // 150 ms before that end, so that the last one still meets the hold on
    // a slow machine (each is a round trip through the daemon).
    let sent = Instant::now();
    let (status, body) = hold_one(&b, &sh, "X2", Some(1000)).await;
    assert_eq!(status, 201, "{body}");
    let left = body["expiresInMs"].as_u64().expect("expiresInMs");
    let ends = sent + Duration::from_millis(left);
    tokio::time::sleep_until((ends - Duration::from_millis(LAG_MS - 50)).into()).await;
    let c0 = answers(&a, "conflict").await;
    let mut asked = 0;
    while asked == 0 || ends.saturating_duration_since(Instant::now()) > Duration::from_millis(150)
    {
        let (status, body) = hold_one(&a, &sh, "X2", None).await;
        assert_eq!(status, 409, "{body}");
        asked += 1;
    }
    assert_eq!(
        answers(&a, "conflict").await,
        c0,
        "the view refused a seat whose hold ends within the lag bound"
    );
}

/// Writes `n` stream entries that are no event to `sh`'s stream in one
/// step: the reader reads through them before it reaches what comes next,
/// while its view stays current (within the lag bound) all along.
async fn backlog(sh: &str, n: u32) {
    let ks = seathold::keys::KeySpace::new("seat-hold:");
    let _: () = redis::cmd("EVAL")
        .arg("for i = 1, tonumber(ARGV[1]) do redis.call('XADD', KEYS[1], '*', 'x', i) end")
        .arg(1)
        .arg(ks.events(sh))
        .arg(n)
        .query_async(&mut redis().await)
        .await
        .expect("EVAL");
}

/// 3b. What this instance has just changed is never answered from what
///    its view knew before: a seat it released reads free and is granted
///    again at once, a seat it sold reads sold, a hold it extended reads
///    with its new expiry, a seat a PATCH gave back reads free. Each time
///    the view knew the seat held, and its reader had 3,000 entries to
///    read through (no events) before the change's event: within the lag
///    bound, so the view was current. Before, the view answered from its
///    older knowledge (a review saw 3 in 200 reads of a seat just released
///    say "held", 4 in 200 after a confirm, and a re-hold refused 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_this_instance_changed_is_not_answered_from_before() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("own");
    start_view(&a, &sh).await;
    let reads = answers(&a, "read").await;
    for round in 1..=3 {
        // Released, then held again at once.
        let seat = format!("R{round}");
        let token = held(&a, &sh, &seat, None).await;
        wait_view(&a, &sh, &seat).await;
        backlog(&sh, 3_000).await;
        release(&a, &sh, &token).await;
        let state = seat_state(&a, &sh, &seat).await;
        assert_eq!(state["state"], "free", "round {round}, released: {state}");
        let token = held(&a, &sh, &seat, None).await;

        // Sold.
        wait_view(&a, &sh, &seat).await;
        backlog(&sh, 3_000).await;
        let (status, body) = a.confirm(&sh, &token).await;
        assert_eq!(status, 200, "{body}");
        let state = seat_state(&a, &sh, &seat).await;
        assert_eq!(state["state"], "sold", "round {round}, confirmed: {state}");

        // Extended from the default 300 s to 600 s.
        let seat = format!("X{round}");
        let token = held(&a, &sh, &seat, None).await;
        wait_view(&a, &sh, &seat).await;
        backlog(&sh, 3_000).await;
        let (status, body) = a.extend(&sh, &token, 600_000).await;
        assert_eq!(status, 200, "{body}");
        let state = seat_state(&a, &sh, &seat).await;
        assert!(
            state["expiresInMs"].as_u64().is_some_and(|ms| ms > 500_000),
            "round {round}, extended to 600 s: {state}"
        );

        // A PATCH gives the seat back for another.
        let (gone, new) = (format!("P{round}"), format!("Q{round}"));
        let token = held(&a, &sh, &gone, None).await;
        wait_view(&a, &sh, &gone).await;
        backlog(&sh, 3_000).await;
        let (status, body) = a
            .call(
                "PATCH",
                &format!("/v1/shows/{sh}/holds/{token}"),
                Some(json!({"add": [new], "remove": [gone]})),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let state = seat_state(&a, &sh, &gone).await;
        assert_eq!(state["state"], "free", "round {round}, given back: {state}");
    }
    // The view did answer meanwhile: the reads above waited for it.
    assert!(answers(&a, "read").await - reads >= 12.0);
}

/// 4. Reads from the view equal what Redis says: a seat sold, held, free
///    (held and released), held by a writer outside seathold (also one the
///    view saw freed), never touched, and sold before the view existed;
///    one by one and with `?ids=`. The view answers the reads of the seats
///    it knows taken, and never says "free".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_from_the_view_equal_redis() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let b = server_with(without_view()).await;
    let sh = show("reads");
    // Sold through B before A ever saw the show: the view cannot know it.
    let early = held(&b, &sh, "S0", None).await;
    let (status, body) = b
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{early}/confirm"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");

    start_view(&a, &sh).await;
    let sold = held(&a, &sh, "S1", None).await;
    let (status, body) = a
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{sold}/confirm"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let freed = held(&a, &sh, "F1", None).await;
    release(&a, &sh, &freed).await;
    // Freed through seathold, then taken by a writer outside it (the
    // reference design's raw SET NX PX), which writes no event: the view
    // knows F2 as free from its `released` event.
    let taken = held(&a, &sh, "F2", None).await;
    release(&a, &sh, &taken).await;
    for seat in ["W1", "F2"] {
        let _: () = redis::cmd("SET")
            .arg(format!("seat-hold:{{show:{sh}}}:{seat}"))
            .arg("7d2f2b4e-0d5c-4b7e-9a53-1f6a4f1c2d3e")
            .arg("NX")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut redis().await)
            .await
            .expect("raw SET");
    }
    // H1's event comes after F2's `released`: once the view answers H1,
    // it has applied that too.
    held(&a, &sh, "H1", None).await;
    wait_view(&a, &sh, "S1").await;
    wait_view(&a, &sh, "H1").await;
    let state = seat_state(&a, &sh, "F2").await;
    assert_eq!(
        state["state"], "held",
        "a raw SET on a seat the view saw freed: {state}"
    );

    let close = |view: &Value, redis: &Value| {
        assert_eq!(
            view["state"], redis["state"],
            "view {view} vs Redis {redis}"
        );
        assert_eq!(view["seat"], redis["seat"], "view {view} vs Redis {redis}");
        match (view["expiresInMs"].as_i64(), redis["expiresInMs"].as_i64()) {
            (Some(v), Some(r)) => assert!(
                (v - r).abs() <= (LAG_MS + 100) as i64,
                "view {view} vs Redis {redis}"
            ),
            (v, r) => assert_eq!(v, r, "view {view} vs Redis {redis}"),
        }
    };
    // Every answer equals Redis's. The view answers while its reader is
    // current, which it is but for moments (a reply being handled late on
    // a busy machine): up to 3 rounds for it to answer S1 and H1.
    let seats = ["S0", "S1", "H1", "F1", "F2", "W1", "N1"];
    for round in 1..=3 {
        let r0 = answers(&a, "read").await;
        for seat in seats {
            let view = seat_state(&a, &sh, seat).await;
            let redis = seat_state(&b, &sh, seat).await;
            close(&view, &redis);
        }
        if answers(&a, "read").await - r0 >= 2.0 {
            break;
        }
        assert!(
            round < 3,
            "in 3 rounds the view never answered both reads of S1 and H1"
        );
    }
    let known = "S1,H1";
    for round in 1..=3 {
        let r0 = answers(&a, "read").await;
        for ids in [known.to_owned(), seats.join(",")] {
            let (sa, view) = a.get(&format!("/v1/shows/{sh}/seats?ids={ids}")).await;
            let (sb, redis) = b.get(&format!("/v1/shows/{sh}/seats?ids={ids}")).await;
            assert_eq!((sa, sb), (200, 200), "{view} {redis}");
            for seat in ids.split(',') {
                close(&view["seats"][seat], &redis["seats"][seat]);
            }
        }
        if answers(&a, "read").await - r0 >= 1.0 {
            break;
        }
        assert!(round < 3, "in 3 rounds the view answered no batch read");
    }
}

/// 5. Holds made before the view existed (through B, before A ever saw the
///    show) are learned from the deadline index: A's first request makes
///    the view, and a storm against those seats is then answered by it.
///    A hold of several of those seats that gives one back (PATCH through
///    B) frees it in the view too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_made_before_the_view_are_learned() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let b = server_with(without_view()).await;
    let sh = show("early");
    let seats: Vec<String> = (1..=5).map(|i| format!("P{i}")).collect();
    for seat in &seats {
        held(&b, &sh, seat, None).await;
    }
    let both = b.hold(&sh, &["M1", "M2"]).await;
    let both = both["holdToken"].as_str().expect("token").to_owned();
    let mut pttls = std::collections::HashMap::new();
    for seat in &seats {
        pttls.insert(seat.clone(), pttl(&sh, seat).await);
    }

    // A's first request of the show makes its view.
    seat_state(&a, &sh, "P1").await;
    tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
    in_3_rounds(|| async {
        let c0 = answers(&a, "conflict").await;
        let result = storm(&a, &sh, &seats, 100, 10).await;
        assert_refusals(&result, &pttls);
        match answers(&a, "conflict").await - c0 {
            n if n >= 90.0 => Ok(()),
            n => Err(format!(
                "the view answered {n} of 100 conflicts over holds it should have learned"
            )),
        }
    })
    .await;

    // M2 given back by B: A's view must not keep it held.
    // (Answered by the view once its reader is current: on a loaded
    // machine the first try may find it lagging and go to Redis.)
    eventually(Duration::from_secs(3), "the view to know M2", || async {
        let c0 = answers(&a, "conflict").await;
        let (status, body) = hold_one(&a, &sh, "M2", None).await;
        assert_eq!(status, 409, "{body}");
        answers(&a, "conflict").await - c0 == 1.0
    })
    .await;
    let (status, body) = b
        .call(
            "PATCH",
            &format!("/v1/shows/{sh}/holds/{both}"),
            Some(json!({"remove": ["M2"]})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
    let (status, body) = hold_one(&a, &sh, "M2", None).await;
    assert_eq!(
        status,
        201,
        "M2, given back {} ms ago, was refused: {body}",
        LAG_MS + 50
    );
}

/// 6. A writer outside seathold: a seat held by a raw `SET … NX PX` is
///    refused (by Redis: the view has no event of it), and once a raw `DEL`
///    frees it, A grants it at once: the view learned nothing held from
///    Redis's 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_hold_is_refused_by_redis_and_not_remembered() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("raw");
    held(&a, &sh, "A1", None).await;
    wait_view(&a, &sh, "A1").await;
    let key = format!("seat-hold:{{show:{sh}}}:E7");
    let mut r = redis().await;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("3b0c8a2e-5f14-4c1d-8e7a-2b9d6c4f1a08")
        .arg("NX")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut r)
        .await
        .expect("raw SET");
    let c0 = answers(&a, "conflict").await;
    for _ in 0..3 {
        let (status, body) = hold_one(&a, &sh, "E7", None).await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(body["taken"][0]["seat"], "E7", "{body}");
        assert_eq!(body["taken"][0]["state"], "held", "{body}");
    }
    assert_eq!(answers(&a, "conflict").await, c0, "Redis answers those");
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("raw DEL");
    let (status, body) = hold_one(&a, &sh, "E7", None).await;
    assert_eq!(status, 201, "E7 freed by a raw DEL: {body}");
}

/// 7. A view whose reader is not current answers nothing. `CLIENT PAUSE
///    1500 ALL` on the slot's master stalls the reader: its XREAD is not
///    answered, so `current_at` stops moving. (Killing the reader's
///    connection is not robust: the reader reconnects within 50 ms, before
///    the view ever counts as stale.) Requests sent while the pause lasts,
///    more than the lag bound after it began, wait for Redis (and are
///    answered when it ends, within `--redis-timeout-ms`): the view
///    answers neither their conflicts nor their reads. Once the pause is
///    over the view answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_whose_reader_is_not_current_answers_nothing() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("stale");
    let (_, master) = slot_and_master(&sh).await;
    let seats: Vec<String> = (1..=4).map(|i| format!("K{i}")).collect();
    for seat in &seats {
        held(&a, &sh, seat, None).await;
    }
    wait_view(&a, &sh, &seats[0]).await;
    view_storm(&a, &sh, &seats, (20, 5), 18.0, "the view was answering").await;

    common::pause_clients(master, 1500, "ALL").await;
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_millis(LAG_MS + 250)).await;
    let (c0, r0) = (answers(&a, "conflict").await, answers(&a, "read").await);
    // All sent at once: one after another, only the first went out during
    // the pause, and a later one could meet the view current again.
    let paths: Vec<String> = seats
        .iter()
        .map(|seat| format!("/v1/shows/{sh}/seats/{seat}"))
        .collect();
    let reads = futures_util::future::join_all(paths.iter().map(|path| a.get(path)));
    let (result, reads) = tokio::join!(storm(&a, &sh, &seats, 20, 20), reads);
    let (c1, r1) = (answers(&a, "conflict").await, answers(&a, "read").await);
    for a in &result {
        assert_eq!(a.status, 409, "{}", a.body);
        // Sent while the master was paused, answered only after.
        assert!(
            a.done.duration_since(paused) >= Duration::from_millis(1400),
            "answered {:?} into the pause: {}",
            a.done.duration_since(paused),
            a.body
        );
    }
    for (status, body) in &reads {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["state"], "held", "{body}");
    }
    assert_eq!(
        c1, c0,
        "the view answered conflicts while its reader was stalled"
    );
    assert_eq!(
        r1, r0,
        "the view answered reads while its reader was stalled"
    );

    // Current again: the view answers.
    tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
    view_storm(&a, &sh, &seats, (20, 5), 18.0, "the view answers again").await;
}

/// 8. The switches: `--view-max-lag-ms 0` turns the view off (a storm goes
///    to Redis, the counter stays put), and with `--view-min-rate 1000` a
///    few requests never make a view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switches_turn_the_view_off() {
    let _lock = exclusive().await;
    for (name, opts) in [
        ("--view-max-lag-ms 0", without_view()),
        (
            "--view-min-rate 1000",
            Options {
                view_min_rate: 1000,
                ..options()
            },
        ),
    ] {
        let a = server_with(opts).await;
        let sh = show("off");
        let (_, master) = slot_and_master(&sh).await;
        let seats: Vec<String> = (1..=5).map(|i| format!("O{i}")).collect();
        for seat in &seats {
            held(&a, &sh, seat, None).await;
        }
        tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
        let (c0, r0, e0) = (
            answers(&a, "conflict").await,
            answers(&a, "read").await,
            evalsha(master).await,
        );
        for a in storm(&a, &sh, &seats, 30, 1).await {
            assert_eq!(a.status, 409, "{}", a.body);
        }
        for seat in &seats {
            seat_state(&a, &sh, seat).await;
        }
        assert_eq!(answers(&a, "conflict").await, c0, "{name}: conflicts");
        assert_eq!(answers(&a, "read").await, r0, "{name}: reads");
        assert!(evalsha(master).await - e0 >= 35, "{name}: Redis answered");
        a.stop().await;
    }
}

/// An `expired` event comes when the sweeper writes it: up to a second
/// after the hold's key expired (a scan later for another instance's
/// holds), and by then the seat may be held again. Here B's hold of E1
/// (`ttlMs` 1500) loses its key early (a raw `DEL`, standing for "expired,
/// and taken again before the sweep"), B holds E1 again, and B's sweeper
/// then writes the first hold's `expired`: A's view must still say held,
/// as Redis does, and keep refusing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_expiry_does_not_free_a_seat_held_again() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let b = server_with(without_view()).await;
    let sh = show("late");
    // Long enough for the view to be made and answer while the hold has
    // more than the lag bound left.
    held(&b, &sh, "E1", Some(3000)).await;
    wait_view(&a, &sh, "E1").await;
    let _: () = redis::cmd("DEL")
        .arg(format!("seat-hold:{{show:{sh}}}:E1"))
        .query_async(&mut redis().await)
        .await
        .expect("raw DEL");
    held(&b, &sh, "E1", None).await;
    eventually(
        Duration::from_secs(8),
        "the first hold's expired event",
        || async {
            let (_, page) = b
                .get(&format!("/v1/shows/{sh}/events?after=0-0&limit=100"))
                .await;
            page["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|e| e["type"] == "expired"))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
    let view = seat_state(&a, &sh, "E1").await;
    let redis = seat_state(&b, &sh, "E1").await;
    assert_eq!(redis["state"], "held", "{redis}");
    assert_eq!(view["state"], "held", "A says {view}, Redis {redis}");
    // Refused every time, by the view once its reader is current (it is
    // but for moments on a busy machine).
    for round in 1..=3 {
        let c0 = answers(&a, "conflict").await;
        let (status, body) = hold_one(&a, &sh, "E1", None).await;
        assert_eq!(status, 409, "{body}");
        if answers(&a, "conflict").await - c0 == 1.0 {
            break;
        }
        assert!(round < 3, "in 3 tries the view never refused E1");
    }
}

/// A view made while a seat it learns from the deadline index is being
/// released: the release may fall between the index read and the moment
/// the new reader pins its starting position, and neither would see it.
/// 30 rounds, each a new show whose E1 B holds: A's first request (which
/// makes the view) and B's release race; 300 ms later A must grant E1.
/// Then A's view answers a read of E1 (held by A now): the round's view
/// was made and is in use, so the race was the view's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_view_is_made_is_not_lost() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let b = server_with(without_view()).await;
    let mut refused = Vec::new();
    let r0 = answers(&a, "read").await;
    for round in 0..30u64 {
        let sh = show("race");
        let token = held(&b, &sh, "E1", None).await;
        let first = async {
            seat_state(&a, &sh, "E1").await;
        };
        let release = async {
            tokio::time::sleep(Duration::from_micros(250 * (round % 3))).await;
            release(&b, &sh, &token).await;
        };
        tokio::join!(first, release);
        tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
        let (status, body) = hold_one(&a, &sh, "E1", None).await;
        if status != 201 {
            refused.push(format!("round {round}: {status} {body}"));
            continue;
        }
        wait_view(&a, &sh, "E1").await;
    }
    assert!(refused.is_empty(), "released seats refused: {refused:#?}");
    let read = answers(&a, "read").await - r0;
    assert!(
        read >= 30.0,
        "the views answered {read} reads in 30 rounds: the test proves nothing"
    );
}

/// 9. Only requests a view could answer make a show busy: 30 granted holds
///    of one show (every show gets a view at its first such request here)
///    start no stream reader (its master serves no XREAD) and no view; the
///    first hold Redis refuses starts both, and later conflicts are the
///    view's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn granted_holds_alone_start_no_view() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("grants");
    let (_, master) = slot_and_master(&sh).await;
    let (x0, c0) = (
        node_calls(master, "xread").await,
        answers(&a, "conflict").await,
    );
    for i in 1..=30 {
        held(&a, &sh, &format!("G{i}"), None).await;
    }
    tokio::time::sleep(Duration::from_millis(LAG_MS + 50)).await;
    assert_eq!(
        node_calls(master, "xread").await,
        x0,
        "granted holds started a stream reader"
    );
    let (status, body) = hold_one(&a, &sh, "G1", None).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(answers(&a, "conflict").await, c0, "a view answered at once");
    eventually(
        Duration::from_secs(5),
        "the view to answer a conflict",
        || async {
            let before = answers(&a, "conflict").await;
            let (status, body) = hold_one(&a, &sh, "G2", None).await;
            assert_eq!(status, 409, "{body}");
            answers(&a, "conflict").await > before
        },
    )
    .await;
    assert!(node_calls(master, "xread").await > x0, "no stream reader");
}

/// Seat views start stream readers only in the lower half of
/// `--max-event-readers`: reads need no token, and reads of made-up shows
/// took every reader before, so that an event stream of a real show got 503
/// `overloaded` for as long as the reads went on.
#[tokio::test]
async fn views_leave_event_streams_half_the_readers() {
    let _lock = exclusive().await;
    let a = server_with(Options {
        max_event_readers: 4,
        ..with_view()
    })
    .await;
    for i in 1..=4 {
        seat_state(&a, &show(&format!("made-up-{i}")), "A1").await;
    }
    assert_eq!(a.metric("seathold_event_readers").await, 2.0);
    let streams = [show("live-1"), show("live-2")];
    let mut open = Vec::new();
    for sh in &streams {
        let resp = a.events_stream(sh, None).await;
        assert_eq!(resp.status().as_u16(), 200, "the event stream of {sh}");
        open.push(resp);
    }
    assert_eq!(a.metric("seathold_event_readers").await, 4.0);
    // A view of a show whose stream is read already needs no reader.
    let (status, _) = hold_one(&a, &streams[0], "A1", None).await;
    assert_eq!(status, 201);
    wait_view(&a, &streams[0], "A1").await;
}

/// `GET url`'s JSON.
async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON")
}

/// A daemon that stalled (a paused VM or container, CPU throttling,
/// swapping) answers nothing from a view that missed events meanwhile.
/// Here the daemon A (its own process, with a view) is stopped with
/// SIGSTOP while B releases two seats A's view knows held; the reply of
/// A's last XREAD (nothing new, when its block ran out) waits in A's
/// socket. Reads of one seat and a hold of the other sent to A while it is
/// stopped are answered once it resumes, 1.4 s after the release: free,
/// and 201.
/// Before, the view counted itself current from when a reply was handled,
/// not from when it was asked for, so the stale reply handled first made
/// the view current again and the requests behind it were answered "held"
/// and 409 by the view, more than five times the lag bound after the seat
/// was freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_stalled_does_not_answer_from_a_stale_view() {
    let _lock = exclusive().await;
    let a = common::Daemon::start(&["--view-min-rate", "0"]).await;
    let b = server_with(without_view()).await;
    let http = reqwest::Client::new();
    let a_reads = || async {
        series(
            &a.metrics().await,
            "seathold_view_answers_total{kind=\"read\"}",
        )
    };
    for trial in 0..3 {
        let sh = show(&format!("stall-{trial}"));
        let token = held(&b, &sh, "E7", Some(60_000)).await;
        let read_token = held(&b, &sh, "E8", Some(60_000)).await;
        let url = format!("{}/v1/shows/{sh}/seats/E8", a.base);
        eventually(
            Duration::from_secs(5),
            "A's view to answer a read",
            || async {
                let before = a_reads().await;
                let read = get_json(&http, &url).await;
                assert_eq!(read["state"], "held", "{read}");
                a_reads().await > before
            },
        )
        .await;

        a.signal("STOP");
        tokio::time::sleep(Duration::from_millis(400)).await;
        release(&b, &sh, &token).await;
        release(&b, &sh, &read_token).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        // Sent to the stopped daemon: each waits in its socket. (Reads of
        // the seat not held again: one answered after the hold would
        // rightly say held.)
        let reads: Vec<_> = (0..10)
            .map(|_| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move { get_json(&http, &url).await })
            })
            .collect();
        let hold = {
            let (http, base, sh) = (http.clone(), a.base.clone(), sh.clone());
            tokio::spawn(async move {
                let resp = http
                    .post(format!("{base}/v1/shows/{sh}/seats/E7/hold"))
                    .json(&json!({"ttlMs": 60_000}))
                    .send()
                    .await
                    .expect("hold");
                let status = resp.status().as_u16();
                (status, resp.json::<Value>().await.expect("JSON"))
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.signal("CONT");
        for read in reads {
            let read = read.await.expect("read task");
            assert_eq!(
                read["state"], "free",
                "trial {trial}: a read answered after the stall: {read}"
            );
        }
        let (status, body) = hold.await.expect("hold task");
        assert_eq!(
            status, 201,
            "trial {trial}: a hold answered after the stall: {body}"
        );
    }
}

/// A view whose reader lost its connection (as in a failover) forgets what
/// it learned from Redis's answers: the new master may lack a sale the old
/// one had (a confirm not yet replicated when it died), and no event will
/// ever say so. Here a sale Redis answered (a 409 "sold" the view learned)
/// is then deleted by hand, and the reader's connection killed: the seat
/// is granted once the reader is back. Before, the view went on refusing it
/// as sold for as long as it was asked for, since the reader's position was
/// still in the stream and nothing looked lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_reconnected_forgets_what_it_learned() {
    let _lock = exclusive().await;
    let a = server_with(with_view()).await;
    let sh = show("relearn");
    let (_, master) = slot_and_master(&sh).await;
    start_view(&a, &sh).await;
    let key = format!("seat-hold:{{show:{sh}}}:E7");
    let mut r = redis().await;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("sold:3b0c8a2e-5f14-4c1d-8e7a-2b9d6c4f1a08")
        .query_async(&mut r)
        .await
        .expect("a sale, by hand");
    // Redis refuses it as sold; the view learns that and answers next.
    eventually(
        Duration::from_secs(5),
        "the view to refuse E7 as sold",
        || async {
            let c0 = answers(&a, "conflict").await;
            let (status, body) = hold_one(&a, &sh, "E7", None).await;
            assert_eq!(status, 409, "{body}");
            assert_eq!(body["taken"][0]["state"], "sold", "{body}");
            answers(&a, "conflict").await > c0
        },
    )
    .await;
    // The sale is lost, as in a failover, and the reader's connection
    // breaks, as in one.
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("DEL");
    let clients = common::client_list(master).await;
    let readers: Vec<&String> = clients
        .iter()
        .filter(|c| common::reads_a_stream(c))
        .filter_map(|c| c.get("id"))
        .collect();
    assert!(!readers.is_empty(), "no reader on the master: {clients:?}");
    let mut m = common::node(master).await;
    for id in readers {
        let _: redis::Value = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async(&mut m)
            .await
            .expect("CLIENT KILL");
    }
    let killed = Instant::now();
    loop {
        let (status, body) = hold_one(&a, &sh, "E7", None).await;
        if status == 201 {
            break;
        }
        assert_eq!(status, 409, "{body}");
        assert!(
            killed.elapsed() < Duration::from_secs(3),
            "E7 still refused {:?} after the reader reconnected: {body}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
