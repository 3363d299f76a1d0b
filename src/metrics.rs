//! Metric names and the Prometheus recorder.
//!
//! The names marked "contract" are fixed by the API document: dashboards and
//! alerts depend on them.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Holds granted (contract).
pub const HOLDS: &str = "seathold_holds_total";
/// Seats in granted holds (contract).
pub const SEATS_HELD: &str = "seathold_seats_held_total";
/// Hold requests refused with 409 (contract).
pub const HOLD_CONFLICTS: &str = "seathold_hold_conflicts_total";
/// Holds that expired without release or confirm, counted by the instance
/// that wrote their `expired` event (for a hold of several shows, the
/// event of its last show), so the sum over instances is the truth
/// (contract).
pub const HOLD_EXPIRIES: &str = "seathold_hold_expiries_total";
/// Holds released (contract).
pub const RELEASES: &str = "seathold_releases_total";
/// Holds extended (contract).
pub const EXTENDS: &str = "seathold_extends_total";
/// Holds confirmed (contract).
pub const CONFIRMS: &str = "seathold_confirms_total";
/// Multi-seat holds refused with 422 `cross_slot` (contract).
pub const CROSS_SLOT_REJECTIONS: &str = "seathold_cross_slot_rejections_total";
/// Request latency by route template and status (contract).
pub const HTTP_DURATION: &str = "seathold_http_request_duration_seconds";
/// Redis errors by kind (contract).
pub const REDIS_ERRORS: &str = "seathold_redis_errors_total";
/// 1 when `/readyz` answers 200 (contract).
pub const CLUSTER_READY: &str = "seathold_cluster_ready";

/// Holds answered 503 whose token the daemon released (or forestalled) in
/// the background so that no seat stays held by nobody (contract, 1.1).
pub const ORPHAN_RELEASES: &str = "seathold_orphan_releases_total";
/// Requests answered from an idempotency record (contract, 1.1).
pub const IDEMPOTENT_REPLAYS: &str = "seathold_idempotent_replays_total";

/// Pool units in granted holds (contract, 1.1).
pub const POOL_UNITS_HELD: &str = "seathold_pool_units_held_total";
/// Hold requests refused with 409 `holder_limit` (contract, 1.1).
pub const HOLDER_LIMIT_REJECTIONS: &str = "seathold_holder_limit_rejections_total";
/// Events this instance wrote to the shows' streams, by `type` (contract, 1.1).
pub const EVENTS: &str = "seathold_events_total";
/// The `type`s of events this version writes.
pub const EVENT_TYPES: [&str; 7] = [
    "held",
    "extended",
    "released",
    "confirmed",
    "expired",
    "modified",
    "pool_changed",
];
/// Event-stream subscribers (SSE clients) of this instance (contract, 1.1).
pub const EVENT_SUBSCRIBERS: &str = "seathold_event_subscribers";
/// Event time (its stream id) to its write to a subscriber (contract, 1.1).
pub const EVENT_DELIVERY: &str = "seathold_event_delivery_seconds";
/// Requests answered from a local seat view, by `kind` (conflict, read).
pub const VIEW_ANSWERS: &str = "seathold_view_answers_total";
/// Shows whose stream this instance reads (one reader per show).
pub const EVENT_READERS: &str = "seathold_event_readers";
/// Requests that needed a new show reader past `--max-event-readers` (an
/// SSE stream answered 503, or a read or refusal of a busy show answered
/// by Redis instead of a seat view).
pub const EVENT_READERS_REFUSED: &str = "seathold_event_readers_refused_total";
/// Subscribers disconnected because they fell too far behind.
pub const EVENT_SUBSCRIBERS_DROPPED: &str = "seathold_event_subscribers_dropped_total";
/// Times a show's reader found events after its position trimmed away
/// while it was cut off or behind (its view started over, its
/// subscribers' streams ended).
pub const EVENT_READER_GAPS: &str = "seathold_event_reader_gaps_total";
/// Sweeps of a show's deadline index that failed (Redis unavailable).
pub const SWEEP_FAILURES: &str = "seathold_sweep_failures_total";
/// Scans of a master for deadline indexes, by `kind`: `forced` (start, a
/// restarted subscription, a changed slot map), `periodic` (this instance
/// took the master's scan lease) and `skipped` (another instance had it).
pub const SWEEP_SCANS: &str = "seathold_sweep_scans_total";
/// Shows with live holds this instance sweeps.
pub const SWEPT_SHOWS: &str = "seathold_swept_shows";

/// Confirms whose sale reached fewer replicas than required in time.
pub const CONFIRMS_NOT_REPLICATED: &str = "seathold_confirms_not_replicated_total";
/// Scripts sent again with EVAL after a NOSCRIPT, by script.
pub const SCRIPT_RELOADS: &str = "seathold_script_reloads_total";
/// Redis Cluster topology changes seen.
pub const TOPOLOGY_CHANGES: &str = "seathold_topology_changes_total";
/// Masters in the current topology.
pub const MASTERS: &str = "seathold_redis_masters";
/// HTTP requests being served.
pub const HTTP_IN_FLIGHT: &str = "seathold_http_requests_in_flight";
/// Open HTTP connections.
pub const HTTP_CONNECTIONS: &str = "seathold_http_connections";
/// HTTP requests (and connections) refused with 503 at the in-flight limit
/// (or the connection limit).
pub const HTTP_OVERLOADED: &str = "seathold_http_overloaded_total";
/// Latency of each Redis operation (one script run, or a WAIT), by `op`.
pub const REDIS_DURATION: &str = "seathold_redis_command_duration_seconds";
/// Scripts that went over the cluster connection because the direct path to
/// the slot's master redirected (`MOVED`, `ASK`, ...) or its connection broke.
pub const DIRECT_FALLBACKS: &str = "seathold_redis_direct_fallbacks_total";
/// Writes of the direct path to the masters (see `cluster::batch`).
pub const DIRECT_WRITES: &str = "seathold_redis_direct_writes_total";
/// Scripts sent over the direct path: divided by `DIRECT_WRITES`, how many
/// scripts went to a master in one write.
pub const DIRECT_SCRIPTS: &str = "seathold_redis_direct_scripts_total";
/// Masters with an open direct connection (normally every master).
pub const DIRECT_CONNECTIONS: &str = "seathold_redis_direct_connections";
/// Masters whose keyspace expiry events seathold is subscribed to.
pub const EXPIRY_SUBSCRIPTIONS: &str = "seathold_expiry_subscriptions";
/// Expiry subscriptions lost and made again (a master restarted or
/// unreachable); steady growth means expiries go uncounted.
pub const EXPIRY_RESUBSCRIPTIONS: &str = "seathold_expiry_resubscriptions_total";
/// 1 when every master emits the expired-key events the expiry counter
/// needs; 0 when one does not and seathold could not turn them on.
pub const KEYSPACE_EVENTS_ENABLED: &str = "seathold_keyspace_events_enabled";

/// Always 1, labelled with the version of this binary.
pub const BUILD_INFO: &str = "seathold_build_info";

/// The process's own metrics (`process_resident_memory_bytes`,
/// `process_cpu_seconds_total`, `process_open_fds`,
/// `process_start_time_seconds`, ...), read from `/proc` at each scrape.
fn process() -> &'static metrics_process::Collector {
    static COLLECTOR: std::sync::OnceLock<metrics_process::Collector> = std::sync::OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// The text of `/metrics`, with the process metrics read just before.
pub fn render(handle: &PrometheusHandle) -> String {
    process().collect();
    handle.render()
}

/// The recorder's handle, once [`install`] ran.
static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// Installs the global Prometheus recorder and returns the handle that
/// renders `/metrics`. Safe to call more than once in one process (tests):
/// later calls return a handle on the first recorder.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".into()),
                    &[
                        0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25,
                        0.5, 1.0, 2.5, 5.0,
                    ],
                )
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding
            // program); then our handle renders only what we record through
            // it, which is nothing, and we say so.
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            process().describe();
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(HOLDS, "Holds granted.");
    describe_counter!(SEATS_HELD, "Seats in granted holds.");
    describe_counter!(
        HOLD_CONFLICTS,
        "Hold requests (and changes of holds) refused with 409: seats_taken, pool_exhausted or holder_limit."
    );
    describe_counter!(
        HOLD_EXPIRIES,
        "Holds that expired without release or confirm: those whose expired event this instance wrote (a hold of several shows once, by its last show's event; with --events off, the expiries it claimed first)."
    );
    describe_counter!(
        EVENTS,
        "Events this instance wrote to the shows' streams, by type; summed over instances, the true figure."
    );
    describe_gauge!(
        EVENT_SUBSCRIBERS,
        "Event-stream (SSE) subscribers of this instance."
    );
    describe_histogram!(
        EVENT_DELIVERY,
        Unit::Seconds,
        "Time from an event (its stream id, Redis's clock) to its write to a subscriber."
    );
    describe_gauge!(
        EVENT_READERS,
        "Shows whose stream this instance reads: one reader per show."
    );
    describe_counter!(
        EVENT_READERS_REFUSED,
        "Requests that needed a new show reader past --max-event-readers: an event stream answered 503, or a busy show's request answered by Redis instead of a seat view."
    );
    describe_counter!(RELEASES, "Holds released.");
    describe_counter!(POOL_UNITS_HELD, "Pool units in granted holds.");
    describe_counter!(
        VIEW_ANSWERS,
        "Requests answered from a local seat view without Redis, by kind (conflict, read)."
    );
    describe_counter!(
        HOLDER_LIMIT_REJECTIONS,
        "Hold requests refused with 409 holder_limit."
    );
    describe_counter!(
        ORPHAN_RELEASES,
        "Holds answered 503 that the daemon released (or forestalled) in the background."
    );
    describe_counter!(
        IDEMPOTENT_REPLAYS,
        "Requests answered again from the outcome recorded under their Idempotency-Key."
    );
    describe_counter!(EXTENDS, "Holds extended.");
    describe_counter!(CONFIRMS, "Holds confirmed (sold).");
    describe_counter!(
        CROSS_SLOT_REJECTIONS,
        "Multi-seat holds refused with 422 cross_slot."
    );
    describe_histogram!(
        HTTP_DURATION,
        Unit::Seconds,
        "HTTP request latency by route template and status."
    );
    describe_counter!(REDIS_ERRORS, "Redis errors by kind.");
    describe_gauge!(CLUSTER_READY, "1 when /readyz answers 200.");
    describe_counter!(
        CONFIRMS_NOT_REPLICATED,
        "Confirms answered 503 not_replicated."
    );
    describe_counter!(SCRIPT_RELOADS, "Scripts re-sent with EVAL after NOSCRIPT.");
    describe_counter!(
        DIRECT_FALLBACKS,
        "Scripts sent over the cluster connection because the direct path to the slot's master redirected or broke."
    );
    describe_counter!(
        DIRECT_WRITES,
        "Writes of the direct path to the masters; each carries every script queued for that master at the time."
    );
    describe_counter!(
        DIRECT_SCRIPTS,
        "Scripts sent over the direct path; divided by seathold_redis_direct_writes_total, the scripts per write."
    );
    describe_gauge!(
        DIRECT_CONNECTIONS,
        "Masters with an open direct connection for scripts; normally equal to seathold_redis_masters."
    );
    describe_counter!(TOPOLOGY_CHANGES, "Redis Cluster slot map changes seen.");
    describe_gauge!(MASTERS, "Masters in the current Redis Cluster slot map.");
    describe_gauge!(HTTP_IN_FLIGHT, "HTTP requests being served.");
    describe_gauge!(HTTP_CONNECTIONS, "Open HTTP connections.");
    describe_counter!(
        HTTP_OVERLOADED,
        "Requests refused with 503 at the in-flight limit, and connections refused at the connection limit."
    );
    describe_histogram!(
        REDIS_DURATION,
        Unit::Seconds,
        "Latency of Redis operations by op."
    );
    describe_gauge!(
        EXPIRY_SUBSCRIPTIONS,
        "Masters whose expiry events seathold is subscribed to."
    );
    describe_counter!(
        EXPIRY_RESUBSCRIPTIONS,
        "Expiry subscriptions lost and made again."
    );
    describe_counter!(
        EVENT_SUBSCRIBERS_DROPPED,
        "Event subscribers disconnected because they stopped reading (took nothing from their buffer for 5 s, or from their connection for --header-read-timeout-ms)."
    );
    describe_counter!(
        EVENT_READER_GAPS,
        "Times a show's event reader could not go on from its position: events after it trimmed away (cut off or behind), its position lost in a failover, or its stream deleted."
    );
    describe_counter!(
        SWEEP_FAILURES,
        "Sweeps of a show's deadline index that failed (expired events delayed)."
    );
    describe_gauge!(SWEPT_SHOWS, "Shows with deadlines this instance sweeps.");
    describe_counter!(
        SWEEP_SCANS,
        "Scans of a master for deadline indexes, by kind: forced (start, a restarted subscription, a changed slot map), periodic (this instance held the master's scan lease), skipped (another instance did)."
    );
    describe_gauge!(BUILD_INFO, "Always 1; the version label names the build.");
    describe_gauge!(
        KEYSPACE_EVENTS_ENABLED,
        "1 when every master emits expired-key events; 0 when expiries cannot be counted."
    );
}

/// Registers every series whose labels are known in advance at zero, so
/// that dashboards and alerts see them before the first event. The request
/// latency histogram is labelled by status too, so its series appear with
/// the first request (a load balancer's first probe).
pub fn register_zeroes() {
    for name in [
        HOLDS,
        SEATS_HELD,
        HOLD_CONFLICTS,
        HOLD_EXPIRIES,
        RELEASES,
        EXTENDS,
        CONFIRMS,
        CROSS_SLOT_REJECTIONS,
        ORPHAN_RELEASES,
        IDEMPOTENT_REPLAYS,
        CONFIRMS_NOT_REPLICATED,
        TOPOLOGY_CHANGES,
        HTTP_OVERLOADED,
        EXPIRY_RESUBSCRIPTIONS,
        DIRECT_FALLBACKS,
        DIRECT_WRITES,
        DIRECT_SCRIPTS,
        EVENT_SUBSCRIBERS_DROPPED,
        EVENT_READER_GAPS,
        EVENT_READERS_REFUSED,
        SWEEP_FAILURES,
        POOL_UNITS_HELD,
        HOLDER_LIMIT_REJECTIONS,
    ] {
        metrics::counter!(name).increment(0);
    }
    for kind in EVENT_TYPES {
        metrics::counter!(EVENTS, "type" => kind).increment(0);
    }
    let _ = metrics::histogram!(EVENT_DELIVERY);
    for kind in ["conflict", "read"] {
        metrics::counter!(VIEW_ANSWERS, "kind" => kind).increment(0);
    }
    for kind in ["forced", "periodic", "skipped"] {
        metrics::counter!(SWEEP_SCANS, "kind" => kind).increment(0);
    }
    for kind in crate::cluster::RedisFault::ALL {
        metrics::counter!(REDIS_ERRORS, "kind" => kind.label()).increment(0);
    }
    for script in crate::scripts::Scripts::embedded().all() {
        metrics::counter!(SCRIPT_RELOADS, "script" => script.name()).increment(0);
        // Registered without a sample: the exporter renders zero counts.
        let _ = metrics::histogram!(REDIS_DURATION, "op" => script.name());
    }
    // Set whole by the probe and the direct connections.
    for gauge in [CLUSTER_READY, DIRECT_CONNECTIONS, MASTERS] {
        metrics::gauge!(gauge).set(0.0);
    }
    // Registered, not reset: a second server in one process (tests) must
    // not zero what the first one counts (the up-and-down counts never
    // come back from a reset).
    for gauge in [
        HTTP_IN_FLIGHT,
        HTTP_CONNECTIONS,
        EXPIRY_SUBSCRIPTIONS,
        EVENT_SUBSCRIBERS,
        EVENT_READERS,
        SWEPT_SHOWS,
    ] {
        metrics::gauge!(gauge).increment(0.0);
    }
    // 1 until a master is found without expired-key events (see expiry.rs);
    // 0 would read as "off" and, held, fire the alert.
    metrics::gauge!(KEYSPACE_EVENTS_ENABLED).set(1.0);
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    process().collect();
}

/// Drains the recorder's histogram buffers every 5 s until `stop` turns
/// true: a scrape drains them too, but without scrapes they would pile up.
pub async fn upkeep(handle: PrometheusHandle, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => handle.run_upkeep(),
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The metrics of the request path, recorded through handles kept per
/// thread.
///
/// `metrics::counter!` and its siblings look their metric up in the
/// recorder's registry on every call: they build its key (labels and all),
/// hash it and read the registry's shard under its lock. Under single-seat
/// holds that was about 5% of the daemon's CPU (`perf record`), for the
/// seven lookups each request made. A handle stays valid for the recorder's
/// life (the exporter has no idle timeout, so no metric is ever removed),
/// so each thread looks a metric up once and then only adds to it. Names
/// and label values are `&'static str`: a key is their addresses and
/// lengths.
///
/// Before [`install`] (or with another program's recorder) these record
/// through the macros, uncached: a handle taken before the recorder exists
/// would record nowhere forever.
pub mod hot {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use metrics::{Counter, Gauge, Histogram, Label};

    /// A static string by address and length.
    type Part = (usize, usize);
    /// A metric's name and up to two labels, each key and value.
    type Key = [Part; 5];

    fn part(s: &'static str) -> Part {
        (s.as_ptr() as usize, s.len())
    }

    fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
        debug_assert!(labels.len() <= 2, "{name}: more labels than a key holds");
        let mut key = [(0, 0); 5];
        key[0] = part(name);
        for (i, (k, v)) in labels.iter().take(2).enumerate() {
            key[1 + 2 * i] = part(k);
            key[2 + 2 * i] = part(v);
        }
        key
    }

    fn labels(labels: &[(&'static str, &'static str)]) -> Vec<Label> {
        labels.iter().map(|&(k, v)| Label::new(k, v)).collect()
    }

    /// A few integers to hash: foldhash takes a few instructions where
    /// std's SipHash took about a thousand per lookup (callgrind). The keys
    /// are our own static strings, so a fixed seed is safe.
    type Map<V> = HashMap<Key, V, foldhash::fast::FixedState>;

    #[derive(Default)]
    struct Handles {
        counters: Map<Counter>,
        gauges: Map<Gauge>,
        histograms: Map<Histogram>,
    }

    thread_local! {
        static HANDLES: RefCell<Handles> = RefCell::default();
    }

    /// Applies `apply` to this thread's handle on metric `name` with
    /// `labels` in `map`, made by `make` the first time; before the
    /// recorder is installed, or while the thread's handles are being torn
    /// down (a guard dropped as the thread exits), to a handle made for
    /// this call only.
    fn record<H>(
        map: fn(&mut Handles) -> &mut Map<H>,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
        make: impl Fn() -> H,
        apply: impl Fn(&H),
    ) {
        let cached = super::HANDLE.get().is_some()
            && HANDLES
                .try_with(|h| {
                    let mut h = h.borrow_mut();
                    apply(map(&mut h).entry(key(name, labels)).or_insert_with(&make));
                })
                .is_ok();
        if !cached {
            apply(&make());
        }
    }

    /// Adds `by` to counter `name` with `labels` (at most two).
    pub fn count(name: &'static str, labels: &[(&'static str, &'static str)], by: u64) {
        record(
            |h| &mut h.counters,
            name,
            labels,
            || metrics::counter!(name, self::labels(labels)),
            |c| c.increment(by),
        );
    }

    /// Adds `delta` (negative: subtracts) to gauge `name`, without labels.
    pub fn gauge_add(name: &'static str, delta: f64) {
        record(
            |h| &mut h.gauges,
            name,
            &[],
            || metrics::gauge!(name),
            |g| g.increment(delta),
        );
    }

    /// Records `value` in histogram `name` with `labels` (at most two).
    pub fn observe(name: &'static str, labels: &[(&'static str, &'static str)], value: f64) {
        record(
            |h| &mut h.histograms,
            name,
            labels,
            || metrics::histogram!(name, self::labels(labels)),
            |m| m.record(value),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::hot;

    #[test]
    fn hot_handles_record_into_the_same_metrics_as_the_macros() {
        let handle = super::install();
        hot::count("seathold_test_hot_total", &[("kind", "a")], 2);
        hot::count("seathold_test_hot_total", &[("kind", "a")], 1);
        hot::count("seathold_test_hot_total", &[("kind", "b")], 7);
        metrics::counter!("seathold_test_hot_total", "kind" => "a").increment(3);
        // another thread has its own handles on the same metric
        std::thread::spawn(|| hot::count("seathold_test_hot_total", &[("kind", "a")], 5))
            .join()
            .unwrap();
        hot::gauge_add("seathold_test_hot_gauge", 2.0);
        hot::gauge_add("seathold_test_hot_gauge", -0.5);
        for _ in 0..3 {
            hot::observe(
                "seathold_test_hot_seconds",
                &[("route", "/x"), ("status", "201")],
                0.001,
            );
        }
        let text = handle.render();
        for line in [
            "seathold_test_hot_total{kind=\"a\"} 11",
            "seathold_test_hot_total{kind=\"b\"} 7",
            "seathold_test_hot_gauge 1.5",
            "seathold_test_hot_seconds_count{route=\"/x\",status=\"201\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    /// A second server in one process (tests run several) keeps what the
    /// first one counted up: its start set `seathold_expiry_subscriptions`
    /// and the HTTP gauges to 0 process-wide, the first server's
    /// subscriptions then read 0 for good, and a test waiting for its 3
    /// (tests/tls.rs, beside tests starting servers of their own) waited in
    /// vain.
    #[test]
    fn a_second_servers_start_keeps_the_counted_gauges() {
        let handle = super::install();
        let counted = [
            super::EXPIRY_SUBSCRIPTIONS,
            super::HTTP_CONNECTIONS,
            super::HTTP_IN_FLIGHT,
            super::EVENT_SUBSCRIBERS,
        ];
        for gauge in counted {
            hot::gauge_add(gauge, 3.0);
        }
        let value = |text: &str, gauge: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(gauge)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{gauge} in\n{text}"))
        };
        let before = handle.render();
        super::register_zeroes();
        let after = handle.render();
        for gauge in counted {
            assert!(value(&before, gauge) >= 3.0, "{gauge} in\n{before}");
            assert_eq!(value(&after, gauge), value(&before, gauge), "{gauge}");
        }
    }
}
