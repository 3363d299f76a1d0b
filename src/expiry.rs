//! Redis's own keyspace events of expired hold records: with events on, a
//! hint that wakes the sweeper of the record's show (see
//! [`crate::events::sweep`], which writes the `expired` event and counts it);
//! with `--events off`, the count of expired holds itself. Every instance
//! hears every expiry, so with events off the instance that counts one is
//! the one whose `SET <prefix>{show:<show>}#expired:<token> 1 NX PX 60000`
//! succeeds: the sum over instances is the number of expiries heard. (A
//! claim lost in a failover may let a second instance count the same
//! expiry; a claim that fails leaves it uncounted.)
//!
//! Keyspace notifications are node-local: each master publishes the keys it
//! expires on its own `__keyevent@0__:expired` channel, and nothing is
//! forwarded across the cluster. So seathold keeps one subscription per
//! master and follows the slot map (a replica promoted after a failover, a
//! master added). A record expires only when its hold was neither released
//! nor confirmed (both delete it). Redis emits `expired` when it deletes the
//! key, on access or in its background sweep, so a notification can trail
//! the TTL by seconds, and one is lost while nobody listens: good enough to
//! wake the sweeper early, never the record of an expiry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cluster::{Cluster, Deadline};
use crate::events::sweep::Sweeper;
use crate::keys::KeySpace;
use crate::metrics as m;

/// The channel of expired-key events of database 0.
pub const CHANNEL: &str = "__keyevent@0__:expired";

/// Shared state of the per-master subscribers.
struct Shared {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    subscribed: AtomicUsize,
    /// Woken by each expired hold record; `None` with events off.
    sweeper: Option<Arc<Sweeper>>,
    /// How often an idle subscription is pinged.
    ping_interval: Duration,
    /// Masters on which events are off and could not be turned on.
    disabled: AtomicUsize,
}

/// Runs the subscribers until `shutdown` turns true.
pub async fn run(
    cluster: Arc<Cluster>,
    keys: KeySpace,
    ping_interval: Duration,
    sweeper: Option<Arc<Sweeper>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut topology = cluster.watch_topology();
    let shared = Arc::new(Shared {
        cluster,
        keys,
        subscribed: AtomicUsize::new(0),
        sweeper,
        ping_interval,
        disabled: AtomicUsize::new(0),
    });
    let mut tasks: HashMap<String, JoinHandle<()>> = HashMap::new();
    loop {
        let masters = topology.borrow_and_update().masters.clone();
        tasks.retain(|addr, task| {
            let keep = masters.contains(addr);
            if !keep {
                tracing::info!(%addr, "no longer a master: dropping its expiry subscription");
                task.abort();
            }
            keep
        });
        for addr in masters {
            tasks.entry(addr.clone()).or_insert_with(|| {
                tracing::info!(%addr, "subscribing to expiry events");
                tokio::spawn(subscribe(Arc::clone(&shared), addr))
            });
        }
        tokio::select! {
            changed = topology.changed() => if changed.is_err() { break },
            _ = shutdown.wait_for(|s| *s) => break,
        }
    }
    for task in tasks.into_values() {
        task.abort();
    }
}

/// Marks a master subscribed (or enabled) for as long as the guard lives,
/// so an aborted task never leaves the gauges counting it.
struct Flag<'a> {
    count: &'a AtomicUsize,
    gauge: &'static str,
    set: AtomicBool,
    invert: bool,
}

impl<'a> Flag<'a> {
    fn new(count: &'a AtomicUsize, gauge: &'static str, invert: bool) -> Self {
        Self {
            count,
            gauge,
            set: AtomicBool::new(false),
            invert,
        }
    }

    /// Sets the gauge to what the count says now.
    fn publish(&self) {
        let _one_at_a_time = publishing();
        self.publish_locked();
    }

    fn publish_locked(&self) {
        let n = self.count.load(Ordering::Relaxed) as f64;
        let value = if self.invert {
            f64::from(u8::from(n == 0.0))
        } else {
            n
        };
        metrics::gauge!(self.gauge).set(value);
    }

    /// Whether this master is marked.
    fn get(&self) -> bool {
        self.set.load(Ordering::Relaxed)
    }

    fn set(&self, on: bool) {
        let _one_at_a_time = publishing();
        if self.set.swap(on, Ordering::Relaxed) != on {
            if on {
                self.count.fetch_add(1, Ordering::Relaxed);
            } else {
                self.count.fetch_sub(1, Ordering::Relaxed);
            }
            self.publish_locked();
        }
    }
}

/// Held while a count changes and its gauge is set, as one step: the
/// masters' tasks run at once, and one that read the count before
/// another changed it could set the gauge after that other did, leaving
/// the older reading for good.
fn publishing() -> std::sync::MutexGuard<'static, ()> {
    static PUBLISHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // Nothing under the lock can be left half-done by a panic.
    PUBLISHING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for Flag<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// Subscribes to one master's expiry events, reconnecting until aborted.
async fn subscribe(shared: Arc<Shared>, addr: String) {
    let subscribed = Flag::new(&shared.subscribed, m::EXPIRY_SUBSCRIPTIONS, false);
    let disabled = Flag::new(&shared.disabled, m::KEYSPACE_EVENTS_ENABLED, true);
    let timeout = shared.cluster.timeout();
    let first = Duration::from_millis(100);
    let mut backoff = first;
    loop {
        let started = std::time::Instant::now();
        match session(&shared, &addr, &subscribed, &disabled, timeout).await {
            Ok(()) => tracing::warn!(%addr, "expiry event stream ended; resubscribing"),
            Err(err) => tracing::warn!(%addr, error = %err, "expiry subscription failed; retrying"),
        }
        // The pause grows while attempts fail in a row, not over the
        // process's life: a subscription that was up for a while (the
        // master restarted, a proxy cut it) is made again at once. Before,
        // from the fifth end on, every resubscription waited 2 s, with the
        // master's notifications and hand-overs unheard meanwhile.
        if subscribed.get() && started.elapsed() >= Duration::from_secs(1) {
            backoff = first;
        }
        subscribed.set(false);
        metrics::counter!(m::EXPIRY_RESUBSCRIPTIONS).increment(1);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn session(
    shared: &Shared,
    addr: &str,
    subscribed: &Flag<'_>,
    disabled: &Flag<'_>,
    timeout: Duration,
) -> Result<(), String> {
    let client = shared
        .cluster
        .node_client(addr)
        .map_err(|e| e.to_string())?;
    turn_on_events(&client, addr, disabled, timeout).await?;
    let bounded = |what: &'static str| move |_| format!("{what} timed out");
    let pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
        .await
        .map_err(bounded("connect"))?
        .map_err(|e| e.to_string())?;
    let (mut sink, mut stream) = pubsub.split();
    tokio::time::timeout(timeout, sink.subscribe(CHANNEL))
        .await
        .map_err(bounded("subscribe"))?
        .map_err(|e| e.to_string())?;
    // With events on, also the shows a stopping instance hands over (a
    // PUBLISH reaches every node, so each master's subscription hears it;
    // the sweeper reads each show once). An ACL written for an older
    // version may not allow the channel: then expiries go on without it.
    let handover = shared.keys.handover_channel();
    if shared.sweeper.is_some() {
        match tokio::time::timeout(timeout, sink.subscribe(&handover)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(%addr, channel = %handover, error = %err,
                "cannot subscribe to the channel on which stopping instances hand their shows over; \
                 their holds' expired events wait for Redis's notifications (see cluster/acl.conf)"),
            Err(_) => return Err("subscribe timed out".into()),
        }
    }
    subscribed.set(true);
    // Notifications sent while nobody listened are lost: have the sweeper
    // look for what they would have said.
    if let Some(sweeper) = &shared.sweeper {
        sweeper.rescan();
    }

    // A ping now and then notices a half-open connection (a node that
    // vanished without closing the socket).
    let mut ping = tokio::time::interval(shared.ping_interval);
    ping.tick().await;
    loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else { return Ok(()) };
                let key = std::str::from_utf8(msg.get_payload_bytes()).unwrap_or_default();
                if msg.get_channel_name() == handover {
                    if let Some(sweeper) = &shared.sweeper {
                        sweeper.take_over(key);
                    }
                    continue;
                }
                if let Some((show, token)) = shared.keys.parse_hold_record(key) {
                    match &shared.sweeper {
                        Some(sweeper) => sweeper.record_expired(show, token),
                        None => count_once(shared, show, token),
                    }
                }
            }
            _ = ping.tick() => {
                // A subscribed connection answers PING with ["pong", ""], not a string.
                let pong: Result<Result<redis::Value, _>, _> = tokio::time::timeout(timeout, sink.ping()).await;
                match pong {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(format!("ping failed: {e}")),
                    Err(_) => return Err("ping timed out".into()),
                }
            }
        }
    }
}

/// How long the claim of an expiry is kept: every instance hears the
/// notification within moments, or never (pub/sub keeps nothing).
const CLAIM_MS: u64 = 60_000;

/// With `--events off`: counts the expiry of hold `token` of `show` when
/// this instance is the first to claim it (see the module's text).
fn count_once(shared: &Shared, show: &str, token: &str) {
    let Ok(mut conn) = shared.cluster.conn() else {
        return;
    };
    let key = shared.keys.expiry_claim(show, token);
    let timeout = shared.cluster.timeout();
    tokio::spawn(async move {
        let claim = async {
            let claimed: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(1)
                .arg("NX")
                .arg("PX")
                .arg(CLAIM_MS)
                .query_async(&mut conn)
                .await?;
            Ok::<_, crate::error::Error>(claimed.is_some())
        };
        match Deadline::after(timeout).within(claim).await {
            Ok(true) => metrics::counter!(m::HOLD_EXPIRIES).increment(1),
            Ok(false) => {}
            Err(err) => tracing::debug!(%key, error = %err, "cannot claim an expiry; not counted"),
        }
    });
}

/// Makes sure the master emits the events: `E` (keyevent channel) with `x`
/// (expired), or `A` (all, which includes `x`); `disabled` says when it
/// cannot. Fails only when the master cannot be reached.
async fn turn_on_events(
    client: &redis::Client,
    addr: &str,
    disabled: &Flag<'_>,
    timeout: Duration,
) -> Result<(), String> {
    let connect = async { Ok(client.get_multiplexed_async_connection().await?) };
    let mut conn = Deadline::after(timeout)
        .within(connect)
        .await
        .map_err(|e| e.to_string())?;
    match ensure_events(&mut conn, timeout).await {
        Ok(changed) => {
            disabled.set(false);
            disabled.publish();
            if changed {
                tracing::info!(%addr, "turned on notify-keyspace-events for expired keys");
            }
        }
        Err(err) => {
            disabled.set(true);
            tracing::warn!(%addr, error = %err,
                "cannot turn on expired-key events on this master; expired events of other instances' holds on it come up to --sweep-scan-interval-ms late \
                 (with --events off, seathold_hold_expiries_total misses its expiries). \
                 Set notify-keyspace-events to include E and x in redis.conf");
        }
    }
    Ok(())
}

/// Adds `E` and `x` to the master's `notify-keyspace-events` when missing.
/// Answers whether it changed anything.
async fn ensure_events(
    conn: &mut redis::aio::MultiplexedConnection,
    timeout: Duration,
) -> Result<bool, String> {
    let work = async {
        let (_, flags): (String, String) = redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query_async(conn)
            .await?;
        let has_expired = flags.contains('x') || flags.contains('A');
        if flags.contains('E') && has_expired {
            return Ok(false);
        }
        let mut wanted = flags.clone();
        if !flags.contains('E') {
            wanted.push('E');
        }
        if !has_expired {
            wanted.push('x');
        }
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg(&wanted)
            .query_async(conn)
            .await?;
        Ok::<_, redis::RedisError>(true)
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("CONFIG timed out".into()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::Flag;

    /// A recorder of one gauge, whatever its name.
    struct OneGauge(Arc<AtomicU64>);

    impl Recorder for OneGauge {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(Arc::clone(&self.0))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// The masters' tasks subscribe at the same time, each with its own
    /// flag on the shared count: the gauge ends at the count. Before, a
    /// task could read the count, then another task add to it and publish,
    /// and then the first publish its older reading, which stayed (seen as
    /// `seathold_expiry_subscriptions 2` of 3 subscribed masters for the
    /// life of an instance, in 1 start of about 30, and the alert fired).
    #[test]
    fn concurrent_flags_leave_the_gauge_at_the_count() {
        const TASKS: usize = 3;
        let gauge = Arc::new(AtomicU64::new(0));
        let recorder = OneGauge(Arc::clone(&gauge));
        for round in 0..3_000 {
            let count = AtomicUsize::new(0);
            let start = Barrier::new(TASKS);
            std::thread::scope(|scope| {
                for _ in 0..TASKS {
                    scope.spawn(|| {
                        metrics::with_local_recorder(&recorder, || {
                            let flag = Flag::new(&count, "gauge", false);
                            start.wait();
                            flag.set(true);
                            // Kept set: the flag's drop would clear it.
                            std::mem::forget(flag);
                        });
                    });
                }
            });
            let published = f64::from_bits(gauge.load(Ordering::SeqCst));
            assert_eq!(published, TASKS as f64, "round {round}");
        }
    }
}
