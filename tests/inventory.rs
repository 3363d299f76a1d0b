//! Inventory beyond numbered seats (API 1.1) against a real Redis Cluster:
//! pools with capacity, pool units in holds (all or nothing with seats, also
//! in `POST /v1/holds`), holder limits, `PATCH` of a hold, capacity changes,
//! and release, confirm and extend of pool holds.
//!
//! The flash sales and the metric checks run against `seathold serve`
//! processes (each with its own metrics); the rest against in-process
//! servers. Every show id is unique, so the tests run side by side.

mod common;

use std::time::{Duration, Instant};

use common::{assert_error, keys_in_slot, options, redis, scrape, server_with, show, Daemon};
use futures_util::StreamExt;
use redis::AsyncCommands;
use serde_json::{json, Value};

/// One seathold instance, in-process or a `seathold serve` process.
#[derive(Clone)]
struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    fn new(base: &str) -> Self {
        Self {
            base: base.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .pool_max_idle_per_host(256)
                .build()
                .expect("client"),
        }
    }

    /// `method path` with an optional JSON body and `Idempotency-Key`:
    /// status, JSON body (Null when empty) and whether it was replayed.
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> (u16, Value, bool) {
        let resp = common::request_at(&self.http, &self.base, method, path, body, key).await;
        let status = resp.status().as_u16();
        let replayed = resp
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let bytes = resp.bytes().await.expect("body");
        (status, common::lenient_json(&bytes), replayed)
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, body, _) = self.send(method, path, body, None).await;
        (status, body)
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(body)).await
    }

    async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("PUT", path, Some(body)).await
    }

    async fn patch(&self, path: &str, body: Value) -> (u16, Value) {
        self.call("PATCH", path, Some(body)).await
    }

    /// Creates or resizes pool `pool` of `show`; panics unless 200.
    async fn set_pool(&self, show: &str, pool: &str, capacity: u64) -> Value {
        let (status, body) = self
            .put(
                &format!("/v1/shows/{show}/pools/{pool}"),
                json!({ "capacity": capacity }),
            )
            .await;
        assert_eq!(status, 200, "PUT pool {show}/{pool}: {body}");
        body
    }

    /// `GET` of a pool: (capacity, held, sold, available); panics unless 200.
    async fn pool(&self, show: &str, pool: &str) -> (i64, i64, i64, i64) {
        let (status, body) = self.get(&format!("/v1/shows/{show}/pools/{pool}")).await;
        assert_eq!(status, 200, "GET pool {show}/{pool}: {body}");
        figures(&body)
    }

    /// `POST /v1/shows/{show}/holds` with `body`.
    async fn hold(&self, show: &str, body: Value) -> (u16, Value) {
        self.post(&format!("/v1/shows/{show}/holds"), body).await
    }

    /// Holds; panics unless 201. Answers the hold's token.
    async fn hold_ok(&self, show: &str, body: Value) -> String {
        let (status, hold) = self.hold(show, body.clone()).await;
        assert_eq!(status, 201, "hold {show} {body}: {hold}");
        token(&hold)
    }

    async fn metrics(&self) -> std::collections::BTreeMap<String, f64> {
        scrape(&common::metrics_at(&self.http, &self.base).await)
    }
}

fn token(hold: &Value) -> String {
    hold["holdToken"].as_str().expect("holdToken").to_owned()
}

/// (capacity, held, sold, available) of a pool body.
fn figures(body: &Value) -> (i64, i64, i64, i64) {
    let n = |f: &str| body[f].as_i64().unwrap_or_else(|| panic!("{f} in {body}"));
    (n("capacity"), n("held"), n("sold"), n("available"))
}

/// The counter `name` (unlabelled), 0 when absent.
fn counter(metrics: &std::collections::BTreeMap<String, f64>, name: &str) -> f64 {
    metrics.get(name).copied().unwrap_or(0.0)
}

/// What the show's slot holds of the show's own keys: `CLUSTER
/// COUNTKEYSINSLOT` less the keys of other shows that share the slot, and
/// the names of the show's keys. Other tests of this binary run beside
/// this one; their shows may fall in the same slot.
async fn show_keys(sh: &str) -> (u64, Vec<String>) {
    let (count, names) = keys_in_slot(common::slot_of(sh)).await;
    let tag = format!("{{show:{sh}}}");
    let others = names.iter().filter(|k| !k.contains(&tag)).count() as u64;
    let own: Vec<String> = names.into_iter().filter(|k| k.contains(&tag)).collect();
    (count.saturating_sub(others), own)
}

/// Every key of `show` with its type and value, for "nothing written".
async fn snapshot(sh: &str) -> Vec<(String, String)> {
    let (_, names) = show_keys(sh).await;
    let mut r = redis().await;
    let mut out = Vec::new();
    for key in names {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut r)
            .await
            .expect("TYPE");
        let value = match kind.as_str() {
            "string" => r.get::<_, String>(&key).await.expect("GET"),
            "hash" => format!(
                "{:?}",
                r.hgetall::<_, std::collections::BTreeMap<String, String>>(&key)
                    .await
                    .expect("HGETALL")
            ),
            "zset" => format!(
                "{:?}",
                r.zrange_withscores::<_, Vec<(String, f64)>>(&key, 0, -1)
                    .await
                    .expect("ZRANGE")
            ),
            "stream" => format!(
                "{}",
                redis::cmd("XLEN")
                    .arg(&key)
                    .query_async::<u64>(&mut r)
                    .await
                    .expect("XLEN")
            ),
            other => other.to_owned(),
        };
        out.push((key, value));
    }
    out
}

/// Runs `f` over `items` with at most `width` in flight; answers the
/// results in completion order.
async fn bounded<I, F, Fut, T>(items: I, width: usize, f: F) -> Vec<T>
where
    I: IntoIterator,
    F: Fn(I::Item) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    futures_util::stream::iter(items.into_iter().map(f))
        .buffer_unordered(width)
        .collect()
        .await
}

/// The flash sale: `holders` one-unit holds of pool `coupons` (capacity
/// 100), by as many holders, spread over `apis`, 200 in flight. Answers
/// the tokens granted; asserts that every other answer is 409
/// `pool_exhausted` with the pool named empty.
async fn flash_sale(apis: &[Api], sh: &str, holders: usize, ttl_ms: u64) -> Vec<String> {
    let answers = bounded(0..holders, 200, |i| {
        let api = apis[i % apis.len()].clone();
        let sh = sh.to_owned();
        async move {
            api.hold(
                &sh,
                json!({"pools": {"coupons": 1}, "holder": format!("h{i}"), "ttlMs": ttl_ms}),
            )
            .await
        }
    })
    .await;
    let mut granted = Vec::new();
    for (status, body) in answers {
        match status {
            201 => {
                assert_eq!(body["pools"], json!({"coupons": 1}), "{body}");
                assert_eq!(body["seats"], json!([]), "{body}");
                granted.push(token(&body));
            }
            409 => {
                assert_error(status, &body, 409, "pool_exhausted");
                assert_eq!(
                    body["pools"],
                    json!([{"pool": "coupons", "requested": 1, "available": 0}]),
                    "{body}"
                );
            }
            _ => panic!("unexpected answer {status}: {body}"),
        }
    }
    assert_eq!(
        granted.len(),
        100,
        "exactly the capacity is granted, of {holders}"
    );
    granted
}

/// How long the sale's holds live. The contract's example is 1 s, but
/// 5,000 requests through debug builds on two shared cores take longer
/// than that: holds of the first winners would expire mid-sale and give
/// their units to later buyers (correctly), so "exactly 100" needs every
/// request answered within one TTL (here 3-5 s, two sales side by side).
/// The sale asserts that it was. That holds of 1 s come back 1.5 s later
/// is shown apart (`short_holds_expire`).
const SALE_TTL_MS: u64 = 15_000;

/// 5,000 holders race for 100 coupons through two daemons: exactly 100
/// win, 4,900 get `pool_exhausted`, and after the holds' TTL the pool is
/// whole again, with no release and no expiry event needed.
async fn coupon_sale(extra: &[&str]) {
    let _guard = common::shared().await;
    let d1 = Daemon::start(extra).await;
    let d2 = Daemon::start(extra).await;
    let apis = [Api::new(&d1.base), Api::new(&d2.base)];
    let sh = show("coupons");
    let created = apis[0].set_pool(&sh, "coupons", 100).await;
    assert_eq!(figures(&created), (100, 0, 0, 100), "{created}");

    let started = Instant::now();
    let granted = flash_sale(&apis, &sh, 5_000, SALE_TTL_MS).await;
    let sold_out = Instant::now();
    let took = sold_out - started;
    eprintln!("coupon sale ({extra:?}): 5,000 holds answered in {took:?}");
    assert!(
        took < Duration::from_millis(SALE_TTL_MS),
        "the sale took {took:?}, longer than its holds live"
    );
    let (_, held, sold, available) = apis[1].pool(&sh, "coupons").await;
    assert_eq!((held, sold, available), (100, 0, 0), "after the sale");
    let distinct: std::collections::HashSet<&String> = granted.iter().collect();
    assert_eq!(distinct.len(), 100);

    // Every hold was granted before `sold_out`: half a second past its TTL
    // after that, each has expired on Redis's clock. Nothing has touched
    // the pool since (no sweep, no notification: its hash still says 100
    // held), and the next hold's script gives the units back itself: all
    // 100 can be held at once.
    tokio::time::sleep_until((sold_out + Duration::from_millis(SALE_TTL_MS + 500)).into()).await;
    let raw_held: i64 = redis()
        .await
        .hget(format!("seat-hold:{{show:{sh}}}#pool:coupons"), "held")
        .await
        .expect("HGET held");
    assert_eq!(
        raw_held, 100,
        "something pruned the pool before a script read it"
    );
    apis[0]
        .hold_ok(&sh, json!({"pools": {"coupons": 100}, "ttlMs": 60000}))
        .await;
    for api in &apis {
        assert_eq!(api.pool(&sh, "coupons").await, (100, 100, 0, 0));
    }
}

/// Short holds come back 1.5 s after a 1 s TTL: `GET` of the pool (its
/// own script prunes) shows them available, from either daemon.
async fn short_holds_expire(apis: &[Api]) {
    let sh = show("short");
    apis[0].set_pool(&sh, "coupons", 100).await;
    let answers = bounded(0..100, 50, |i| {
        let api = apis[i % apis.len()].clone();
        let sh = sh.clone();
        async move {
            api.hold(
                &sh,
                json!({"pools": {"coupons": 1}, "holder": format!("h{i}"), "ttlMs": 1000}),
            )
            .await
        }
    })
    .await;
    assert!(answers.iter().all(|(s, _)| *s == 201), "{answers:?}");
    let (status, body) = apis[0]
        .hold(&sh, json!({"pools": {"coupons": 1}, "ttlMs": 1000}))
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for api in apis {
        assert_eq!(api.pool(&sh, "coupons").await, (100, 0, 0, 100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coupon_flash_sale_expires_by_itself() {
    coupon_sale(&[]).await;
    let d1 = Daemon::start(&[]).await;
    let d2 = Daemon::start(&[]).await;
    short_holds_expire(&[Api::new(&d1.base), Api::new(&d2.base)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coupon_flash_sale_with_events_off_then_confirm_sixty() {
    coupon_sale(&["--events", "off"]).await;

    let _guard = common::shared().await;
    let d1 = Daemon::start(&["--events", "off"]).await;
    let d2 = Daemon::start(&["--events", "off"]).await;
    let apis = [Api::new(&d1.base), Api::new(&d2.base)];
    short_holds_expire(&apis).await;

    // A second sale, where 60 of the 100 winners pay before their holds
    // expire: 60 sold, the other 40 come back.
    let sh = show("coupons2");
    apis[0].set_pool(&sh, "coupons", 100).await;
    let started = Instant::now();
    let ttl = SALE_TTL_MS;
    let granted = flash_sale(&apis, &sh, 5_000, ttl).await;
    // Every hold was granted by now: half a second past its TTL after
    // this, each unconfirmed one has expired on Redis's clock.
    let sold_out = Instant::now();
    let confirmed = bounded(granted.iter().take(60).enumerate(), 30, |(i, t)| {
        let api = apis[i % 2].clone();
        let path = format!("/v1/shows/{sh}/holds/{t}/confirm");
        async move { api.call("POST", &path, None).await }
    })
    .await;
    for (status, body) in &confirmed {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["pools"], json!({"coupons": 1}), "{body}");
    }
    assert!(
        started.elapsed() < Duration::from_millis(ttl),
        "the confirms came too late ({:?}) to prove anything",
        started.elapsed()
    );
    assert_eq!(apis[0].pool(&sh, "coupons").await, (100, 40, 60, 0));
    tokio::time::sleep_until((sold_out + Duration::from_millis(ttl + 500)).into()).await;
    assert_eq!(apis[1].pool(&sh, "coupons").await, (100, 0, 60, 40));
    // Confirmed holds are sales; the rest are gone.
    let (status, body) = apis[0]
        .get(&format!("/v1/shows/{sh}/holds/{}", granted[99]))
        .await;
    assert_error(status, &body, 404, "hold_not_found");
}

/// All or nothing across seats and pool units, in both hold routes: a
/// short pool, a taken seat, or both, and nothing is written.
#[tokio::test]
async fn seats_and_units_all_or_nothing() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("mixed");
    api.set_pool(&sh, "floor", 5).await;
    // Someone holds 3 of 5 floor units, someone else seat B2.
    api.hold_ok(&sh, json!({"pools": {"floor": 3}, "ttlMs": 60000}))
        .await;
    api.hold_ok(&sh, json!({"seats": ["B2"], "ttlMs": 60000}))
        .await;
    let seats_free = |seats: &'static [&'static str]| {
        let api = api.clone();
        let sh = sh.clone();
        async move {
            let (status, body) = api
                .get(&format!("/v1/shows/{sh}/seats?ids={}", seats.join(",")))
                .await;
            assert_eq!(status, 200, "{body}");
            for seat in seats {
                assert_eq!(body["seats"][seat]["state"], "free", "{seat}: {body}");
            }
        }
    };

    let before = snapshot(&sh).await;
    let count_before = show_keys(&sh).await;

    // 1. The floor is short: pool_exhausted, the seats stay free.
    let (status, body) = api
        .hold(
            &sh,
            json!({"seats": ["A1", "A2"], "pools": {"floor": 3}, "ttlMs": 60000}),
        )
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": 3, "available": 2}]),
        "{body}"
    );
    assert!(body.get("taken").is_none(), "{body}");
    seats_free(&["A1", "A2"]).await;
    assert_eq!(api.pool(&sh, "floor").await, (5, 3, 0, 2));

    // 2. A seat is taken, the floor has enough: seats_taken.
    let (status, body) = api
        .hold(
            &sh,
            json!({"seats": ["A1", "B2"], "pools": {"floor": 2}, "ttlMs": 60000}),
        )
        .await;
    assert_error(status, &body, 409, "seats_taken");
    let taken = body["taken"].as_array().expect("taken");
    assert_eq!(taken.len(), 1, "{body}");
    assert_eq!(
        (&taken[0]["seat"], &taken[0]["state"]),
        (&json!("B2"), &json!("held"))
    );
    assert!(body.get("pools").is_none(), "{body}");
    seats_free(&["A1"]).await;
    assert_eq!(api.pool(&sh, "floor").await, (5, 3, 0, 2));

    // 3. Both: seats_taken, naming the seat and the pool.
    let (status, body) = api
        .hold(
            &sh,
            json!({"seats": ["A1", "B2"], "pools": {"floor": 3}, "ttlMs": 60000}),
        )
        .await;
    assert_error(status, &body, 409, "seats_taken");
    assert_eq!(body["taken"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(body["taken"][0]["seat"], "B2", "{body}");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": 3, "available": 2}]),
        "{body}"
    );
    seats_free(&["A1"]).await;

    // Nothing of the three was written: the same keys with the same
    // values (the event stream's length included).
    assert_eq!(show_keys(&sh).await, count_before);
    assert_eq!(snapshot(&sh).await, before);

    // The same in POST /v1/holds, whose answers name the shows.
    let multi = |elements: Value| json!({"seats": elements, "ttlMs": 60000});
    let (status, body) = api
        .post(
            "/v1/holds",
            multi(json!([
                {"show": sh, "seat": "A1"},
                {"show": sh, "seat": "A2"},
                {"show": sh, "pool": "floor", "quantity": 3}
            ])),
        )
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"show": sh, "pool": "floor", "requested": 3, "available": 2}]),
        "{body}"
    );
    let (status, body) = api
        .post(
            "/v1/holds",
            multi(json!([
                {"show": sh, "seat": "B2"},
                {"show": sh, "pool": "floor", "quantity": 1}
            ])),
        )
        .await;
    assert_error(status, &body, 409, "seats_taken");
    assert_eq!(body["taken"][0]["show"], json!(sh), "{body}");
    assert!(body.get("pools").is_none(), "{body}");
    let (status, body) = api
        .post(
            "/v1/holds",
            multi(json!([
                {"show": sh, "seat": "A1"},
                {"show": sh, "seat": "B2"},
                {"show": sh, "pool": "floor", "quantity": 4}
            ])),
        )
        .await;
    assert_error(status, &body, 409, "seats_taken");
    // B2 was held above with a TTL of 60 s.
    let taken = common::taken_without_expiry(&body, 60_000);
    assert_eq!(
        taken,
        json!([{"show": sh, "seat": "B2", "state": "held"}]),
        "{body}"
    );
    assert_eq!(
        body["pools"],
        json!([{"show": sh, "pool": "floor", "requested": 4, "available": 2}]),
        "{body}"
    );
    assert_eq!(snapshot(&sh).await, before);

    // And a multi hold that fits takes both, answering pools as a list.
    let (status, hold) = api
        .post(
            "/v1/holds",
            multi(json!([
                {"show": sh, "seat": "A1"},
                {"show": sh, "pool": "floor", "quantity": 2}
            ])),
        )
        .await;
    assert_eq!(status, 201, "{hold}");
    assert_eq!(hold["seats"], json!([{"show": sh, "seat": "A1"}]));
    assert_eq!(
        hold["pools"],
        json!([{"show": sh, "pool": "floor", "quantity": 2}])
    );
    assert_eq!(api.pool(&sh, "floor").await, (5, 5, 0, 0));
    let (status, read) = api
        .get(&format!("/v1/shows/{sh}/holds/{}", token(&hold)))
        .await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["pools"], hold["pools"]);
}

/// Holder limits: the limit counts live holds and sales, a release makes
/// room, concurrent requests of one holder never pass it, the
/// `--max-per-holder` default, invalid holders and pools, and the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_limit() {
    let _guard = common::shared().await;
    let d1 = Daemon::start(&[]).await;
    let d2 = Daemon::start(&[]).await;
    let (a, b) = (Api::new(&d1.base), Api::new(&d2.base));
    let before = (a.metrics().await, b.metrics().await);
    let sh = show("limit");
    let (status, body) = a
        .put(
            &format!("/v1/shows/{sh}/settings"),
            json!({"maxPerHolder": 4}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["maxPerHolder"], 4, "{body}");
    a.set_pool(&sh, "floor", 100).await;
    let mut rejections = 0.0;
    let mut units = 0.0;

    // alice holds 3: two seats and a floor unit.
    let seats = a
        .hold_ok(
            &sh,
            json!({"seats": ["A1", "A2"], "holder": "alice", "ttlMs": 60000}),
        )
        .await;
    let unit = b
        .hold_ok(
            &sh,
            json!({"pools": {"floor": 1}, "holder": "alice", "ttlMs": 60000}),
        )
        .await;
    units += 1.0;
    // Two more would make 5.
    let two_more =
        json!({"seats": ["A3"], "pools": {"floor": 1}, "holder": "alice", "ttlMs": 60000});
    let (status, body) = a.hold(&sh, two_more.clone()).await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(
        (&body["limit"], &body["current"], &body["requested"]),
        (&json!(4), &json!(3), &json!(2)),
        "{body}"
    );
    rejections += 1.0;
    // Nothing was taken by the refusal.
    let (_, state) = a.get(&format!("/v1/shows/{sh}/seats/A3")).await;
    assert_eq!(state["state"], "free");
    assert_eq!(a.pool(&sh, "floor").await.1, 1);
    // Another holder is not limited by alice.
    a.hold_ok(
        &sh,
        json!({"seats": ["Z1", "Z2", "Z3", "Z4"], "holder": "bob", "ttlMs": 60000}),
    )
    .await;

    // Releasing the unit makes room for two.
    let (status, _) = b
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{unit}"), None)
        .await;
    assert_eq!(status, 204);
    let pair = b.hold_ok(&sh, two_more.clone()).await;
    units += 1.0;
    // Now 4: one more is refused.
    let (status, body) = b
        .hold(&sh, json!({"seats": ["A9"], "holder": "alice"}))
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(
        (&body["current"], &body["requested"]),
        (&json!(4), &json!(1))
    );
    rejections += 1.0;

    // Sold seats count too: alice buys A1 and A2 and gives the pair back;
    // she still has 2 of her 4.
    let (status, body) = a
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{seats}/confirm"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = a
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{pair}"), None)
        .await;
    assert_eq!(status, 204);
    let (status, body) = a
        .hold(
            &sh,
            json!({"seats": ["A5", "A6"], "pools": {"floor": 1}, "holder": "alice"}),
        )
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(
        (&body["limit"], &body["current"], &body["requested"]),
        (&json!(4), &json!(2), &json!(3)),
        "{body}"
    );
    rejections += 1.0;
    b.hold_ok(
        &sh,
        json!({"seats": ["A5"], "pools": {"floor": 1}, "holder": "alice"}),
    )
    .await;
    units += 1.0;

    // carol sends 20 single-seat holds at once through both daemons:
    // exactly 4 are granted.
    let answers = bounded(0..20, 20, |i| {
        let api = if i % 2 == 0 { a.clone() } else { b.clone() };
        let sh = sh.clone();
        async move {
            api.hold(
                &sh,
                json!({"seats": [format!("C{i}")], "holder": "carol", "ttlMs": 60000}),
            )
            .await
        }
    })
    .await;
    let granted = answers.iter().filter(|(s, _)| *s == 201).count();
    for (status, body) in answers.iter().filter(|(s, _)| *s != 201) {
        assert_error(*status, body, 409, "holder_limit");
    }
    assert_eq!(granted, 4, "{answers:?}");
    rejections += 16.0;

    // Invalid holders and pools are refused before Redis.
    for holder in [
        json!(""),
        json!("has space"),
        json!("x".repeat(129)),
        json!(7),
        json!("a/b"),
    ] {
        let (status, body) = a
            .hold(&sh, json!({"seats": ["D1"], "holder": holder}))
            .await;
        assert_error(status, &body, 400, "invalid_holder");
    }
    let (status, body) = a
        .post(
            &format!("/v1/shows/{sh}/seats/D1/hold"),
            json!({"holder": "no spaces allowed"}),
        )
        .await;
    assert_error(status, &body, 400, "invalid_holder");
    for pool in ["a b", "{x}", "p:q", &"p".repeat(65)] {
        let (status, body) = a.hold(&sh, json!({"pools": {pool: 1}})).await;
        assert_error(status, &body, 400, "invalid_pool");
        let (status, body) = a
            .post(
                "/v1/holds",
                json!({"seats": [{"show": sh, "pool": pool, "quantity": 1}]}),
            )
            .await;
        assert_error(status, &body, 400, "invalid_pool");
    }
    let (status, body) = a
        .put(
            &format!("/v1/shows/{sh}/pools/a%20b"),
            json!({"capacity": 1}),
        )
        .await;
    assert_error(status, &body, 400, "invalid_pool");
    // A holder id may use the characters the contract names.
    a.hold_ok(
        &sh,
        json!({"seats": ["D2"], "holder": "user:42@example.com_x.y-z", "ttlMs": 60000}),
    )
    .await;

    // The counters moved by exactly what happened, summed over both.
    let after = (a.metrics().await, b.metrics().await);
    let moved = |name: &str| {
        counter(&after.0, name) + counter(&after.1, name)
            - counter(&before.0, name)
            - counter(&before.1, name)
    };
    assert_eq!(moved("seathold_holder_limit_rejections_total"), rejections);
    assert_eq!(moved("seathold_pool_units_held_total"), units);
}

/// `--max-per-holder` is the limit of shows whose settings name none; a
/// show's settings win over it.
#[tokio::test]
async fn max_per_holder_default() {
    let _guard = common::shared().await;
    let s = server_with(seathold::config::Options {
        max_per_holder: 2,
        ..options()
    })
    .await;
    let api = Api::new(&s.base);
    let sh = show("default-limit");
    api.hold_ok(&sh, json!({"seats": ["A1", "A2"], "holder": "dave"}))
        .await;
    let (status, body) = api
        .hold(&sh, json!({"seats": ["A3"], "holder": "dave"}))
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(
        (&body["limit"], &body["current"], &body["requested"]),
        (&json!(2), &json!(2), &json!(1)),
        "{body}"
    );
    // Holds without a holder are not limited.
    api.hold_ok(&sh, json!({"seats": ["B1", "B2", "B3"]})).await;

    let other = show("own-limit");
    let (status, body) = api
        .put(
            &format!("/v1/shows/{other}/settings"),
            json!({"maxPerHolder": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    api.hold_ok(
        &other,
        json!({"seats": ["A1", "A2", "A3"], "holder": "dave"}),
    )
    .await;
    let (status, body) = api
        .hold(&other, json!({"seats": ["A4"], "holder": "dave"}))
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(body["limit"], 3, "{body}");
}

/// The events of `show` from the start.
async fn events(api: &Api, sh: &str) -> Vec<Value> {
    let (status, body) = api
        .get(&format!("/v1/shows/{sh}/events?after=0-0&limit=1000"))
        .await;
    assert_eq!(status, 200, "{body}");
    body["events"].as_array().expect("events").clone()
}

fn hold_ref(token: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Milliseconds since the epoch of an `expiresAt` ("2026-11-30T12:00:00.000Z").
fn millis(at: &Value) -> i64 {
    let at = at.as_str().expect("expiresAt");
    let n = |r: std::ops::Range<usize>| -> i64 {
        at.get(r)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not a timestamp: {at}"))
    };
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 24 + n(11..13)) * 60 + n(14..16)) * 60_000 + n(17..19) * 1000 + n(20..23)
}

/// PATCH of a hold: seats in and out and a pool grown in one call under
/// the same token and expiry; conflicts change nothing; idempotent replays.
#[tokio::test]
async fn patch_a_hold() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("patch");
    api.set_pool(&sh, "floor", 10).await;
    let (status, hold) = api
        .hold(
            &sh,
            json!({"seats": ["E7", "E8"], "pools": {"floor": 2}, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{hold}");
    let t = token(&hold);
    let path = format!("/v1/shows/{sh}/holds/{t}");
    // Someone else holds E10 and 5 floor units: 3 are left.
    api.hold_ok(
        &sh,
        json!({"seats": ["E10"], "pools": {"floor": 5}, "ttlMs": 60000}),
    )
    .await;

    let (status, changed) = api
        .patch(
            &path,
            json!({"add": ["E9"], "remove": ["E7"], "pools": {"floor": 3}}),
        )
        .await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(changed["holdToken"], json!(t));
    assert_eq!(changed["seats"], json!(["E8", "E9"]));
    assert_eq!(changed["pools"], json!({"floor": 3}));
    let drift = millis(&changed["expiresAt"]) - millis(&hold["expiresAt"]);
    assert!(drift.abs() <= 1, "the expiry moved by {drift} ms");
    let fence = changed["fence"].as_i64().expect("fence");
    assert!(
        fence > hold["fence"].as_i64().expect("fence"),
        "{changed} after {hold}"
    );
    let (_, states) = api.get(&format!("/v1/shows/{sh}/seats?ids=E7,E8,E9")).await;
    assert_eq!(states["seats"]["E7"]["state"], "free", "{states}");
    assert_eq!(states["seats"]["E9"]["state"], "held", "{states}");
    let mut r = redis().await;
    let e9: String = r
        .get(format!("seat-hold:{{show:{sh}}}:E9"))
        .await
        .expect("GET E9");
    assert_eq!(e9, t, "E9 is held by the token");
    // The added seat expires with the hold, to the millisecond.
    let expire_at = |key: String| {
        let mut r = r.clone();
        async move {
            redis::cmd("PEXPIRETIME")
                .arg(key)
                .query_async::<i64>(&mut r)
                .await
                .expect("PEXPIRETIME")
        }
    };
    let (e8, e9) = (
        expire_at(format!("seat-hold:{{show:{sh}}}:E8")).await,
        expire_at(format!("seat-hold:{{show:{sh}}}:E9")).await,
    );
    assert_eq!((e8, e9), (millis(&hold["expiresAt"]), e8));
    assert_eq!(api.pool(&sh, "floor").await, (10, 8, 0, 2));
    let (status, read) = api.get(&path).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(
        (&read["seats"], &read["pools"], &read["fence"]),
        (&changed["seats"], &changed["pools"], &changed["fence"])
    );

    // The `modified` event names the new contents and fence.
    let modified: Vec<Value> = events(&api, &sh)
        .await
        .into_iter()
        .filter(|e| e["type"] == "modified")
        .collect();
    assert_eq!(modified.len(), 1, "{modified:?}");
    let e = &modified[0];
    assert_eq!(e["holdRef"], json!(hold_ref(&t)), "{e}");
    assert_eq!(e["seats"], json!(["E8", "E9"]), "{e}");
    assert_eq!(e["pools"], json!({"floor": 3}), "{e}");
    assert_eq!(e["fence"], json!(fence), "{e}");
    assert_eq!(e["expiresAt"], changed["expiresAt"], "{e}");

    // Conflicts change nothing.
    let unchanged = |api: Api, path: String, want: Value| async move {
        let (status, read) = api.get(&path).await;
        assert_eq!(status, 200, "{read}");
        for f in ["seats", "pools", "fence", "expiresAt"] {
            assert_eq!(read[f], want[f], "{f}: {read} vs {want}");
        }
    };
    let before = snapshot(&sh).await;
    let (status, body) = api
        .patch(&path, json!({"add": ["E10"], "remove": ["E8"]}))
        .await;
    assert_error(status, &body, 409, "seats_taken");
    assert_eq!(body["taken"][0]["seat"], "E10", "{body}");
    unchanged(api.clone(), path.clone(), changed.clone()).await;
    let (status, body) = api
        .patch(&path, json!({"add": ["E11"], "pools": {"floor": 6}}))
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": 6, "available": 5}]),
        "{body}"
    );
    unchanged(api.clone(), path.clone(), changed.clone()).await;
    let (_, state) = api.get(&format!("/v1/shows/{sh}/seats/E11")).await;
    assert_eq!(state["state"], "free");
    // A taken seat and a short pool: both named, as a hold names them.
    let (status, body) = api
        .patch(&path, json!({"add": ["E10", "E12"], "pools": {"floor": 6}}))
        .await;
    assert_error(status, &body, 409, "seats_taken");
    assert_eq!(body["taken"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(body["taken"][0]["seat"], "E10", "{body}");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": 6, "available": 5}]),
        "{body}"
    );
    unchanged(api.clone(), path.clone(), changed.clone()).await;
    // Removing every seat and unit is a release: 400.
    let (status, body) = api
        .patch(
            &path,
            json!({"remove": ["E8", "E9"], "pools": {"floor": 0}}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    unchanged(api.clone(), path.clone(), changed.clone()).await;
    assert_eq!(
        snapshot(&sh).await,
        before,
        "the refused changes wrote nothing"
    );

    // A stale token: 404.
    let stale = uuid::Uuid::new_v4();
    let (status, body) = api
        .patch(
            &format!("/v1/shows/{sh}/holds/{stale}"),
            json!({"add": ["F1"]}),
        )
        .await;
    assert_error(status, &body, 404, "hold_not_found");

    // With an Idempotency-Key, a repeat answers the first outcome again and
    // changes nothing more.
    let change = json!({"add": ["E11"], "pools": {"floor": 1}});
    let (status, first, replayed) = api
        .send("PATCH", &path, Some(change.clone()), Some("patch-1"))
        .await;
    assert_eq!((status, replayed), (200, false), "{first}");
    assert_eq!(first["seats"], json!(["E8", "E9", "E11"]));
    assert_eq!(api.pool(&sh, "floor").await, (10, 6, 0, 4));
    // A repeat: replayed, with the first outcome.
    let repeat = |when: &'static str| {
        let (api, path, change, first) = (&api, &path, &change, &first);
        async move {
            let (status, again, replayed) = api
                .send("PATCH", path, Some(change.clone()), Some("patch-1"))
                .await;
            assert_eq!((status, replayed), (200, true), "{when}: {again}");
            for f in ["holdToken", "seats", "pools", "fence", "expiresAt"] {
                assert_eq!(again[f], first[f], "{f} {when}");
            }
        }
    };
    repeat("at once").await;
    assert_eq!(api.pool(&sh, "floor").await, (10, 6, 0, 4));
    let (status, body, _) = api
        .send(
            "PATCH",
            &path,
            Some(json!({"add": ["E12"]})),
            Some("patch-1"),
        )
        .await;
    assert_error(status, &body, 422, "idempotency_key_reused");

    // After another change of the hold, a repeat still answers the first
    // outcome (its seats, pools and fence), only its expiry current: before,
    // it paired the hold's seats of now with the first outcome's fence.
    let (status, later) = api.patch(&path, json!({"remove": ["E11"]})).await;
    assert_eq!(status, 200, "{later}");
    repeat("after a later change").await;
    let (status, undo) = api.patch(&path, json!({"add": ["E11"]})).await;
    assert_eq!(status, 200, "{undo}");

    // The released hold's token is stale too, and its units came back.
    let (status, _) = api.call("DELETE", &path, None).await;
    assert_eq!(status, 204);
    let (status, body) = api.patch(&path, json!({"add": ["F1"]})).await;
    assert_error(status, &body, 404, "hold_not_found");
    assert_eq!(api.pool(&sh, "floor").await, (10, 5, 0, 5));
    let (_, states) = api
        .get(&format!("/v1/shows/{sh}/seats?ids=E8,E9,E11"))
        .await;
    for seat in ["E8", "E9", "E11"] {
        assert_eq!(states["seats"][seat]["state"], "free", "{states}");
    }
}

/// A hold made with `POST /v1/holds` whose seats and units are all in the
/// home show changes like any other, keeping its shape (`{show, seat}`
/// elements, a list of pools); one that spans two shows is refused with
/// 400, as its other show's seats cannot be named in a PATCH. Before, every
/// hold made with `POST /v1/holds` was refused.
#[tokio::test]
async fn patch_a_hold_made_with_post_v1_holds() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("patchm");
    api.set_pool(&sh, "floor", 10).await;
    api.set_pool(&sh, "aisle", 10).await;
    let (status, hold) = api
        .post(
            "/v1/holds",
            json!({"seats": [
                {"show": sh, "seat": "A1"},
                {"show": sh, "seat": "A2"},
                {"show": sh, "pool": "floor", "quantity": 1},
                {"show": sh, "pool": "aisle", "quantity": 1}
            ], "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{hold}");
    let t = token(&hold);
    let path = format!("/v1/shows/{sh}/holds/{t}");
    let (status, changed) = api
        .patch(
            &path,
            json!({"add": ["A3"], "remove": ["A1"], "pools": {"floor": 2}}),
        )
        .await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(
        changed["seats"],
        json!([{"show": sh, "seat": "A2"}, {"show": sh, "seat": "A3"}]),
        "{changed}"
    );
    assert_eq!(
        changed["pools"],
        // In the order they were held, not by pool id.
        json!([
            {"show": sh, "pool": "floor", "quantity": 2},
            {"show": sh, "pool": "aisle", "quantity": 1}
        ]),
        "{changed}"
    );
    assert!(
        changed["fence"].as_i64() > hold["fence"].as_i64(),
        "{changed} after {hold}"
    );
    let (status, read) = api.get(&path).await;
    assert_eq!(status, 200, "{read}");
    for f in ["seats", "pools", "fence", "expiresAt"] {
        assert_eq!(read[f], changed[f], "{f}: {read} vs {changed}");
    }
    let (_, states) = api.get(&format!("/v1/shows/{sh}/seats?ids=A1,A2,A3")).await;
    assert_eq!(states["seats"]["A1"]["state"], "free", "{states}");
    assert_eq!(states["seats"]["A3"]["state"], "held", "{states}");
    assert_eq!(api.pool(&sh, "floor").await, (10, 2, 0, 8));
    // Under an Idempotency-Key, a repeat answers the same shape again.
    let mut answers = Vec::new();
    for replay in [false, true] {
        let change = json!({"add": ["A4"]});
        let (status, body, replayed) = api
            .send("PATCH", &path, Some(change), Some("patchm-1"))
            .await;
        assert_eq!((status, replayed), (200, replay), "{body}");
        answers.push(body);
    }
    let (first, again) = (&answers[0], &answers[1]);
    for f in ["seats", "pools", "fence"] {
        assert_eq!(again[f], first[f], "{f}: {again} vs {first}");
    }
    let (status, changed) = api.patch(&path, json!({"remove": ["A4"]})).await;
    assert_eq!(status, 200, "{changed}");
    // A taken seat: 409, nothing changes.
    api.hold_ok(&sh, json!({"seats": ["B1"], "ttlMs": 60000}))
        .await;
    let (status, body) = api.patch(&path, json!({"add": ["B1"]})).await;
    assert_error(status, &body, 409, "seats_taken");
    let (_, read) = api.get(&path).await;
    assert_eq!(read["seats"], changed["seats"], "{read}");
    // Confirmed, it is sold as changed.
    let (status, sold) = api.call("POST", &format!("{path}/confirm"), None).await;
    assert_eq!(status, 200, "{sold}");
    assert_eq!(sold["seats"], changed["seats"], "{sold}");
    assert_eq!(api.pool(&sh, "floor").await, (10, 0, 2, 8));

    // Two shows of one slot: the other show's seats cannot be named.
    let other = common::show_where("patchm", |slot| slot == common::slot_of(&sh));
    let (status, two) = api
        .post(
            "/v1/holds",
            json!({"seats": [
                {"show": sh, "seat": "C1"},
                {"show": other, "seat": "C1"}
            ], "ttlMs": 60000}),
        )
        .await;
    assert_eq!(status, 201, "{two}");
    let path = format!("/v1/shows/{sh}/holds/{}", token(&two));
    let (status, body) = api.patch(&path, json!({"add": ["C2"]})).await;
    assert_error(status, &body, 400, "invalid_request");
    let (_, read) = api.get(&path).await;
    assert_eq!(read["seats"], two["seats"], "{read}");
}

/// A PATCH that would take a holder past its limit is refused whole.
#[tokio::test]
async fn patch_within_the_holder_limit() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("patch-limit");
    api.put(
        &format!("/v1/shows/{sh}/settings"),
        json!({"maxPerHolder": 4}),
    )
    .await;
    api.set_pool(&sh, "floor", 10).await;
    let t = api
        .hold_ok(
            &sh,
            json!({"seats": ["A1"], "pools": {"floor": 1}, "holder": "erin"}),
        )
        .await;
    let path = format!("/v1/shows/{sh}/holds/{t}");
    let (status, body) = api
        .patch(&path, json!({"add": ["A2"], "pools": {"floor": 3}}))
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(
        (&body["limit"], &body["current"], &body["requested"]),
        (&json!(4), &json!(2), &json!(3)),
        "{body}"
    );
    assert_eq!(api.pool(&sh, "floor").await.1, 1);
    // Up to the limit is fine, and the new size counts afterwards.
    let (status, body) = api
        .patch(&path, json!({"add": ["A2"], "pools": {"floor": 2}}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api
        .hold(&sh, json!({"seats": ["A3"], "holder": "erin"}))
        .await;
    assert_error(status, &body, 409, "holder_limit");
    assert_eq!(body["current"], 4, "{body}");
    // Shrinking makes room.
    let (status, body) = api.patch(&path, json!({"pools": {"floor": 1}})).await;
    assert_eq!(status, 200, "{body}");
    api.hold_ok(&sh, json!({"seats": ["A3"], "holder": "erin"}))
        .await;
}

/// A holder's set of live holds goes with its last hold: a holder who never
/// comes back leaves no key behind, whether or not a limit applies (it once
/// kept every expired entry, and the key, until that holder held again in
/// a show with a limit). Its expiry follows holds, extends and changes.
#[tokio::test]
async fn holder_sets_go_with_their_last_hold() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("holder-ttl");
    let key = format!("seat-hold:{{show:{sh}}}#holder:alice");
    let r = redis().await;
    let pttl = || {
        let (key, mut r) = (key.clone(), r.clone());
        async move {
            redis::cmd("PTTL")
                .arg(&key)
                .query_async::<i64>(&mut r)
                .await
                .expect("PTTL")
        }
    };

    let short = api
        .hold_ok(
            &sh,
            json!({"seats": ["A1"], "holder": "alice", "ttlMs": 1200}),
        )
        .await;
    let t = pttl().await;
    assert!(
        (1..=1200).contains(&t),
        "holder set PTTL {t} after a 1200 ms hold"
    );
    let long = api
        .hold_ok(
            &sh,
            json!({"seats": ["A2"], "holder": "alice", "ttlMs": 2400}),
        )
        .await;
    let t = pttl().await;
    assert!((1201..=2400).contains(&t), "PTTL {t} after a 2400 ms hold");
    let (status, body) = api
        .post(
            &format!("/v1/shows/{sh}/holds/{long}/extend"),
            json!({"ttlMs": 4500}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = pttl().await;
    assert!(
        (2401..=4500).contains(&t),
        "PTTL {t} after an extend to 4500 ms"
    );
    let (status, body) = api
        .patch(
            &format!("/v1/shows/{sh}/holds/{long}"),
            json!({"add": ["A3"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(pttl().await > 2400, "a change keeps the expiry");

    // The short hold expired; the long one keeps the set.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(
        api.get(&format!("/v1/shows/{sh}/holds/{short}")).await.0,
        404
    );
    assert!(pttl().await > 0);
    // Then it expires too, and the set with it.
    tokio::time::sleep(Duration::from_millis(3600)).await;
    assert_eq!(pttl().await, -2, "the holder set outlived its holds");
}

/// A holder that always has a live hold (a box office, a reseller) keeps
/// its set alive: each new hold of it drops the entries of its holds that
/// expired, with or without a limit, so the set holds the live ones and
/// those that expired since its last hold. Before, entries were pruned
/// only while a limit applied, and without one the set kept every hold
/// that holder ever made.
#[tokio::test]
async fn a_holder_that_always_holds_keeps_no_expired_entries() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("kiosk");
    let key = format!("seat-hold:{{show:{sh}}}#holder:kiosk");
    api.hold_ok(
        &sh,
        json!({"seats": ["K0"], "holder": "kiosk", "ttlMs": 600000}),
    )
    .await;
    for i in 0..30 {
        api.hold_ok(
            &sh,
            json!({"seats": [format!("S{i}")], "holder": "kiosk", "ttlMs": 100}),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.hold_ok(
        &sh,
        json!({"seats": ["K1"], "holder": "kiosk", "ttlMs": 600000}),
    )
    .await;
    let mut r = redis().await;
    let entries: Vec<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut r)
        .await
        .expect("ZRANGE");
    assert_eq!(entries.len(), 2, "only the two live holds: {entries:?}");
}

/// Capacity lowered below what is held: the holds stay valid, no new hold
/// is granted, `available` stays at 0; raising it lets holds through.
#[tokio::test]
async fn capacity_below_held() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("shrink");
    api.set_pool(&sh, "floor", 10).await;
    let h1 = api
        .hold_ok(&sh, json!({"pools": {"floor": 4}, "ttlMs": 60000}))
        .await;
    let h2 = api
        .hold_ok(&sh, json!({"pools": {"floor": 3}, "ttlMs": 60000}))
        .await;
    let lowered = api.set_pool(&sh, "floor", 5).await;
    assert_eq!(figures(&lowered), (5, 7, 0, 0), "{lowered}");
    assert_eq!(api.pool(&sh, "floor").await, (5, 7, 0, 0));

    let (status, body) = api.hold(&sh, json!({"pools": {"floor": 1}})).await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": 1, "available": 0}])
    );
    // The existing holds can be read, extended, confirmed.
    let (status, read) = api.get(&format!("/v1/shows/{sh}/holds/{h1}")).await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["pools"], json!({"floor": 4}));
    let (status, extended) = api
        .post(
            &format!("/v1/shows/{sh}/holds/{h1}/extend"),
            json!({"ttlMs": 120000}),
        )
        .await;
    assert_eq!(status, 200, "{extended}");
    let (status, sold) = api
        .call("POST", &format!("/v1/shows/{sh}/holds/{h2}/confirm"), None)
        .await;
    assert_eq!(status, 200, "{sold}");
    assert_eq!(api.pool(&sh, "floor").await, (5, 4, 3, 0));
    // Even fully sold beyond capacity, available is 0, never negative.
    let (status, _) = api
        .call("POST", &format!("/v1/shows/{sh}/holds/{h1}/confirm"), None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(api.pool(&sh, "floor").await, (5, 0, 7, 0));
    let (status, body) = api.hold(&sh, json!({"pools": {"floor": 1}})).await;
    assert_error(status, &body, 409, "pool_exhausted");

    // Raised again, holds go through.
    let raised = api.set_pool(&sh, "floor", 20).await;
    assert_eq!(figures(&raised), (20, 0, 7, 13));
    api.hold_ok(&sh, json!({"pools": {"floor": 13}})).await;
    assert_eq!(api.pool(&sh, "floor").await, (20, 13, 7, 0));
    // The same capacity again (a repeated PUT, or the daemon's resend of
    // its script) changes nothing and writes no second event.
    let again = api.set_pool(&sh, "floor", 20).await;
    assert_eq!(figures(&again), (20, 13, 7, 0));

    let changes: Vec<Value> = events(&api, &sh)
        .await
        .into_iter()
        .filter(|e| e["type"] == "pool_changed")
        .map(|e| e["pools"].clone())
        .collect();
    assert_eq!(
        changes,
        vec![
            json!({"floor": 10}),
            json!({"floor": 5}),
            json!({"floor": 20})
        ]
    );

    // A pool that was never created.
    let (status, body) = api.get(&format!("/v1/shows/{sh}/pools/balcony")).await;
    assert_error(status, &body, 404, "not_found");
    let (status, body) = api.hold(&sh, json!({"pools": {"balcony": 1}})).await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"pool": "balcony", "requested": 1, "available": 0}])
    );
    // Reading it created nothing either.
    let (status, _) = api.get(&format!("/v1/shows/{sh}/pools/balcony")).await;
    assert_eq!(status, 404);

    // The largest quantity a request may name (4294967295), on each route
    // that takes one, is refused like any other that is short, and the
    // daemon lives on (it once reserved 16 bytes per unit for the hold's
    // record, 64 GiB here, before asking Redis, and aborted).
    let most = u64::from(u32::MAX);
    let (status, body) = api.hold(&sh, json!({"pools": {"floor": most}})).await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(
        body["pools"],
        json!([{"pool": "floor", "requested": most, "available": 0}])
    );
    let (status, body) = api
        .post(
            "/v1/holds",
            json!({"seats": [{"show": sh, "pool": "balcony", "quantity": most}]}),
        )
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    let held = api.hold_ok(&sh, json!({"seats": ["S1"]})).await;
    let (status, body) = api
        .patch(
            &format!("/v1/shows/{sh}/holds/{held}"),
            json!({"pools": {"floor": most}}),
        )
        .await;
    assert_error(status, &body, 409, "pool_exhausted");
    assert_eq!(api.pool(&sh, "floor").await, (20, 13, 7, 0));
}

/// Release gives units back, confirm turns them sold (once, however often
/// it is repeated), and extend moves a pool hold's expiry.
#[tokio::test]
async fn release_confirm_extend_of_pool_holds() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("units");
    api.set_pool(&sh, "floor", 10).await;

    let t = api
        .hold_ok(
            &sh,
            json!({"seats": ["A1"], "pools": {"floor": 2}, "ttlMs": 60000}),
        )
        .await;
    assert_eq!(api.pool(&sh, "floor").await, (10, 2, 0, 8));
    let (status, _) = api
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{t}"), None)
        .await;
    assert_eq!(status, 204);
    assert_eq!(api.pool(&sh, "floor").await, (10, 0, 0, 10));
    let (status, _) = api
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{t}"), None)
        .await;
    assert_eq!(status, 404);
    assert_eq!(api.pool(&sh, "floor").await, (10, 0, 0, 10));

    let t = api
        .hold_ok(&sh, json!({"pools": {"floor": 3}, "ttlMs": 60000}))
        .await;
    let confirm = format!("/v1/shows/{sh}/holds/{t}/confirm");
    for _ in 0..2 {
        let (status, body) = api.call("POST", &confirm, None).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["pools"], json!({"floor": 3}), "{body}");
        assert_eq!(api.pool(&sh, "floor").await, (10, 0, 3, 7));
    }
    // A sale cannot be released.
    let (status, _) = api
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{t}"), None)
        .await;
    assert_eq!(status, 404);
    assert_eq!(api.pool(&sh, "floor").await, (10, 0, 3, 7));

    // Two holds of 1 s; one is extended to 5 s. After 1.5 s only the
    // extended one counts.
    let kept = api
        .hold_ok(&sh, json!({"pools": {"floor": 2}, "ttlMs": 1000}))
        .await;
    api.hold_ok(&sh, json!({"pools": {"floor": 1}, "ttlMs": 1000}))
        .await;
    let (status, body) = api
        .post(
            &format!("/v1/shows/{sh}/holds/{kept}/extend"),
            json!({"ttlMs": 5000}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(api.pool(&sh, "floor").await, (10, 3, 3, 4));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(api.pool(&sh, "floor").await, (10, 2, 3, 5));
    let (status, body) = api.get(&format!("/v1/shows/{sh}/holds/{kept}")).await;
    assert_eq!(status, 200, "{body}");
    // Holding the rest works, one more does not: the extended hold's units
    // are really held.
    api.hold_ok(&sh, json!({"pools": {"floor": 5}, "ttlMs": 60000}))
        .await;
    let (status, body) = api.hold(&sh, json!({"pools": {"floor": 1}})).await;
    assert_error(status, &body, 409, "pool_exhausted");
    // Confirming the extended hold sells its 2.
    let (status, _) = api
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{kept}/confirm"),
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(api.pool(&sh, "floor").await, (10, 5, 5, 0));
}

/// A hold whose pool units were already given back (a script pruned its
/// entry when Redis's clock had passed its expiry) is not confirmed or
/// extended, even while its record and seats are still there, as after a
/// clock stepped back (NTP, or a failover to a node whose clock is behind)
/// before Redis deleted them. Confirm sold the units again, over the
/// capacity, and extend kept a live hold whose units were free. The prune
/// is made here by hand: what it leaves (no entry, `held` lowered) with the
/// record in place.
#[tokio::test]
async fn units_given_back_are_not_sold_or_extended() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("given-back");
    api.set_pool(&sh, "floor", 6).await;
    let mut r = redis().await;
    let holds = format!("seat-hold:{{show:{sh}}}#pool-holds:floor");
    let pool = format!("seat-hold:{{show:{sh}}}#pool:floor");
    let mut given_back = Vec::new();
    for seat in ["G1", "G2", "G3"] {
        let t = api
            .hold_ok(
                &sh,
                json!({"seats": [seat], "pools": {"floor": 2}, "ttlMs": 60000}),
            )
            .await;
        let removed: i64 = redis::cmd("ZREM")
            .arg(&holds)
            .arg(format!("2:{t}"))
            .query_async(&mut r)
            .await
            .expect("ZREM");
        assert_eq!(removed, 1);
        let _: i64 = redis::cmd("HINCRBY")
            .arg(&pool)
            .arg("held")
            .arg(-2)
            .query_async(&mut r)
            .await
            .expect("HINCRBY");
        given_back.push(t);
    }
    // The 6 units are free again, and taken by others.
    assert_eq!(api.pool(&sh, "floor").await, (6, 0, 0, 6));
    api.hold_ok(&sh, json!({"pools": {"floor": 6}, "ttlMs": 60000}))
        .await;
    let (status, body) = api
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{}/confirm", given_back[0]),
            None,
        )
        .await;
    assert_error(status, &body, 404, "hold_not_found");
    let (status, body) = api
        .post(
            &format!("/v1/shows/{sh}/holds/{}/extend", given_back[1]),
            json!({"ttlMs": 120000}),
        )
        .await;
    assert_error(status, &body, 404, "hold_not_found");
    // A PATCH that leaves the pool alone took the units back unchecked.
    let (status, body) = api
        .patch(
            &format!("/v1/shows/{sh}/holds/{}", given_back[2]),
            json!({"add": ["G9"]}),
        )
        .await;
    assert_error(status, &body, 404, "hold_not_found");
    assert_eq!(api.pool(&sh, "floor").await, (6, 6, 0, 0), "never oversold");
    for (t, seat) in given_back.iter().zip(["G1", "G2", "G3"]) {
        let state: String = redis::cmd("GET")
            .arg(format!("seat-hold:{{show:{sh}}}:{seat}"))
            .query_async(&mut r)
            .await
            .expect("GET");
        assert_eq!(&state, t, "{seat}: nothing changed");
    }
}

/// A hold whose entry in its holder's set is gone (pruned by a master
/// whose clock ran ahead, then alive again after a failover to one whose
/// clock is behind) counts towards no limit: extending it would let it
/// live on outside the limit, as a hold whose units were given back would
/// (above). It is refused the same way, and the limit still holds.
#[tokio::test]
async fn a_hold_its_holder_no_longer_counts_is_not_extended() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("holder-pruned");
    let (status, body) = api
        .put(
            &format!("/v1/shows/{sh}/settings"),
            json!({"maxPerHolder": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = api
        .hold_ok(
            &sh,
            json!({"seats": ["H1", "H2"], "holder": "bob", "ttlMs": 60000}),
        )
        .await;
    let mut r = redis().await;
    let removed: i64 = redis::cmd("ZREM")
        .arg(format!("seat-hold:{{show:{sh}}}#holder:bob"))
        .arg(format!("2:{t}"))
        .query_async(&mut r)
        .await
        .expect("ZREM");
    assert_eq!(removed, 1);
    let (status, body) = api
        .post(
            &format!("/v1/shows/{sh}/holds/{t}/extend"),
            json!({"ttlMs": 120000}),
        )
        .await;
    assert_error(status, &body, 404, "hold_not_found");
    // Nothing changed: the hold keeps its first expiry.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(format!("seat-hold:{{show:{sh}}}:H1"))
        .query_async(&mut r)
        .await
        .expect("PTTL");
    assert!((0..=60_000).contains(&pttl), "PTTL {pttl}");
}

/// Adds an entry a minute ahead of now at sequence 999 to `show`'s event
/// stream, so that the next `XADD *` would answer that millisecond with
/// sequence 1000; answers that millisecond.
async fn stream_at_999_a_minute_ahead(show: &str) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis();
    let ahead = i64::try_from(now).expect("ms") + 60_000;
    let _: String = redis::cmd("XADD")
        .arg(format!("seat-hold:{{show:{show}}}#events"))
        .arg(format!("{ahead}-999"))
        .arg("t")
        .arg("test")
        .query_async(&mut redis().await)
        .await
        .expect("XADD");
    ahead
}

/// A change's fence exceeds every earlier fence of the show and is never
/// repeated by a later hold, also when the stream's ids carry on past 999
/// in one millisecond (a master whose clock is behind the last id, as
/// after a failover): the change then moves to the next millisecond, as a
/// hold does.
#[tokio::test]
async fn patch_fences_past_999_events_in_one_millisecond() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("patch-fence");
    let t = api
        .hold_ok(&sh, json!({"seats": ["A1"], "ttlMs": 60000}))
        .await;
    // The stream's last id is a minute ahead, sequence 999: the next XADD *
    // answers that millisecond with sequence 1000.
    let ahead = stream_at_999_a_minute_ahead(&sh).await;
    let (status, changed) = api
        .patch(&format!("/v1/shows/{sh}/holds/{t}"), json!({"add": ["A2"]}))
        .await;
    assert_eq!(status, 200, "{changed}");
    let (status, later) = api.hold(&sh, json!({"seats": ["A3"]})).await;
    assert_eq!(status, 201, "{later}");
    let (changed, later) = (
        changed["fence"].as_i64().expect("fence"),
        later["fence"].as_i64().expect("fence"),
    );
    assert_eq!(
        changed,
        (ahead + 1) * 1000,
        "the change moved to the next ms"
    );
    assert!(
        later > changed,
        "a later hold's fence {later} <= the change's {changed}"
    );
}

/// A single-seat hold (the script's fast path) whose stream id would carry
/// a sequence past 999 moves to the next millisecond as every other write
/// does: its fence is that millisecond x 1000, its `held` event has that id,
/// and no event is left behind at the id it gave up.
#[tokio::test]
async fn hold_fences_past_999_events_in_one_millisecond() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("hold-fence");
    let stream = format!("seat-hold:{{show:{sh}}}#events");
    let ahead = stream_at_999_a_minute_ahead(&sh).await;
    let mut r = redis().await;
    let (status, held) = api
        .post(&format!("/v1/shows/{sh}/seats/B1/hold"), json!({}))
        .await;
    assert_eq!(status, 201, "{held}");
    assert_eq!(held["fence"].as_i64(), Some((ahead + 1) * 1000), "{held}");
    let ids: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .expect("XRANGE");
    let ids: Vec<&str> = ids.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [format!("{ahead}-999"), format!("{}-0", ahead + 1)],
        "the held event moved to the next ms, nothing left at {ahead}-1000"
    );
    let (status, later) = api.hold(&sh, json!({"seats": ["B2"]})).await;
    assert_eq!(status, 201, "{later}");
    assert!(later["fence"].as_i64() > held["fence"].as_i64(), "{later}");
}

/// Concurrent PATCHes of one hold each apply to what the hold is when they
/// run: all succeed, none is lost, and the seats, pool units and holder
/// count left behind are exactly the hold's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_patches_of_one_hold() {
    let _guard = common::shared().await;
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("patch-race");
    api.set_pool(&sh, "floor", 1000).await;
    let t = api
        .hold_ok(
            &sh,
            json!({"seats": ["A0"], "pools": {"floor": 1}, "holder": "pat", "ttlMs": 60000}),
        )
        .await;
    let path = format!("/v1/shows/{sh}/holds/{t}");
    let answers = bounded(1..=16, 16, |i| {
        let api = api.clone();
        let path = path.clone();
        async move {
            api.patch(
                &path,
                json!({"add": [format!("A{i}")], "pools": {"floor": i + 1}}),
            )
            .await
        }
    })
    .await;
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    let (status, hold) = api.get(&path).await;
    assert_eq!(status, 200, "{hold}");
    let mut seats: Vec<String> = hold["seats"]
        .as_array()
        .expect("seats")
        .iter()
        .map(|s| s.as_str().expect("seat").to_owned())
        .collect();
    seats.sort();
    let mut all: Vec<String> = (0..=16).map(|i| format!("A{i}")).collect();
    all.sort();
    assert_eq!(seats, all, "every PATCH added its seat: {hold}");
    let units = hold["pools"]["floor"].as_i64().expect("floor units");
    assert_eq!(
        api.pool(&sh, "floor").await.1,
        units,
        "the pool holds what the hold has"
    );

    let mut r = redis().await;
    let members = |key: String| {
        let mut r = r.clone();
        async move {
            r.zrange::<_, Vec<String>>(key, 0, -1)
                .await
                .expect("ZRANGE")
        }
    };
    let pool_holds = members(format!("seat-hold:{{show:{sh}}}#pool-holds:floor")).await;
    assert_eq!(pool_holds, vec![format!("{units}:{t}")]);
    let holder = members(format!("seat-hold:{{show:{sh}}}#holder:pat")).await;
    assert_eq!(holder, vec![format!("{}:{t}", 17 + units)]);

    // Released, it leaves nothing behind.
    let (status, _) = api.call("DELETE", &path, None).await;
    assert_eq!(status, 204);
    assert_eq!(api.pool(&sh, "floor").await, (1000, 0, 0, 1000));
    let (_, states) = api
        .get(&format!("/v1/shows/{sh}/seats?ids={}", all.join(",")))
        .await;
    for seat in &all {
        assert_eq!(states["seats"][seat]["state"], "free", "{seat}: {states}");
    }
    let left: i64 = r
        .zcard(format!("seat-hold:{{show:{sh}}}#holder:pat"))
        .await
        .expect("ZCARD");
    assert_eq!(left, 0);
}

/// A hold with pool units or a holder takes its time from `TIME`, not from
/// its event's id: its `held` event carries that expiry, the one the hold
/// answered (and its `expired` event will name). Before, the event's
/// expiry was the id's time plus the TTL, a millisecond or more later for
/// about 3 holds in 100 (a reviewer's find).
#[tokio::test]
async fn a_pool_holds_event_names_the_expiry_the_hold_answered() {
    let s = server_with(options()).await;
    let api = Api::new(&s.base);
    let sh = show("pool-expiry");
    api.set_pool(&sh, "ga", 1_000).await;
    let answers: Vec<Value> = futures_util::stream::iter(0..300)
        .map(|i| {
            let (api, sh) = (api.clone(), sh.clone());
            async move {
                let (status, body) = api
                    .hold(&sh, json!({"pools": {"ga": 1}, "holder": format!("h{i}")}))
                    .await;
                assert_eq!(status, 201, "{body}");
                body
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut held = std::collections::HashMap::new();
    let mut after: Option<String> = None;
    loop {
        let query = after
            .as_ref()
            .map_or("limit=1000".to_owned(), |a| format!("after={a}&limit=1000"));
        let (status, page) = api.get(&format!("/v1/shows/{sh}/events?{query}")).await;
        assert_eq!(status, 200, "{page}");
        let events = page["events"].as_array().expect("events");
        if events.is_empty() {
            break;
        }
        for e in events.iter().filter(|e| e["type"] == "held") {
            held.insert(
                e["holdRef"].as_str().expect("ref").to_owned(),
                e["expiresAt"].clone(),
            );
        }
        after = page["next"].as_str().map(str::to_owned);
    }
    let differ: Vec<(Value, Value)> = answers
        .iter()
        .filter_map(|hold| {
            let token = hold["holdToken"].as_str().expect("token");
            let event = held.get(&hold_ref(token)).cloned().unwrap_or(Value::Null);
            (event != hold["expiresAt"]).then(|| (hold["expiresAt"].clone(), event))
        })
        .collect();
    assert!(
        differ.is_empty(),
        "(hold, held event) expiries that differ: {differ:?}"
    );
}
