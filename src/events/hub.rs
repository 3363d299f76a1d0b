//! One Redis reader per show per instance, fanned out to all of this
//! instance's subscribers of the show.
//!
//! The first subscriber of a show starts a reader task: `XREAD BLOCK` on the
//! show's stream over a connection of its own to the slot's master (a
//! blocking read would stall a shared multiplexed connection), from the
//! stream's newest entry on. A subscriber waits until the reader has pinned
//! that position ([`Feed::started`]) before it reads what it missed with
//! [`super::read`], so that nothing falls between the two. Each event goes to a broadcast channel; a
//! subscriber that falls more than [`BUFFER`] events behind loses its place
//! in the channel and reads what it missed from the stream
//! ([`super::sse`]). The reader stops when its
//! last subscriber has gone and the show's seat view is idle, or at
//! shutdown ([`Hub::close`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Value;
use tokio::sync::{broadcast, watch};

use super::view::SeatView;
use super::{Cursor, Event, EventId};
use crate::cluster::Cluster;
use crate::error::Error;
use crate::ids::ShowId;
use crate::keys::KeySpace;

/// Events a subscriber may fall behind before it reads what it missed
/// from the stream instead.
pub const BUFFER: usize = 1024;

/// How long one XREAD blocks when no seat view needs a shorter bound; the
/// reader checks for subscribers between.
pub const BLOCK_MS: u64 = 2_000;

/// How often a reader checks that the stream still has its position,
/// besides after a failed read or a full reply (one `events.lua` call).
const CHECK_POSITION_MS: u64 = 1_000;

/// The per-show readers of this instance.
pub struct Hub {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    shows: Mutex<HashMap<ShowId, Feed>>,
    /// How long one XREAD blocks.
    block: Duration,
    /// The streams' length cap (`--events-max-len`).
    max_len: u64,
    /// Turns true at shutdown: every reader stops, views in use or not.
    closed: watch::Sender<bool>,
    /// Most readers at once (`--max-event-readers`).
    max_readers: usize,
}

/// What a show's reader sends its subscribers.
#[derive(Clone)]
pub enum Live {
    /// The show's next event.
    Event(Arc<Event>),
    /// Events after the reader's position were trimmed away before it read
    /// them (it was cut off or behind): a subscriber ends its stream, and
    /// its client resumes from its last id (410 if that is gone too).
    Gap,
}

/// One show's reader, as its subscribers see it.
#[derive(Clone)]
pub struct Feed {
    tx: broadcast::Sender<Live>,
    /// Turns true once the reader has pinned its starting position: every
    /// event after it will be sent.
    pub started: watch::Receiver<bool>,
    /// When (ms of [`mono_ms`], this machine's monotonic clock) the reader
    /// last knew it had every event: when it sent the last XREAD that came
    /// back short. A reader that
    /// blocks no longer than its bound proves it is current this way.
    pub current_at: Arc<AtomicU64>,
    /// The show's seat view, once one was asked for.
    view: Arc<Mutex<Option<Arc<SeatView>>>>,
}

/// A view not asked for this long is dropped (and with it, when no
/// subscriber is left, the show's reader).
const VIEW_IDLE_MS: u64 = 30_000;

impl Hub {
    /// A hub of at most `max_readers` readers, which block at most `block`
    /// per XREAD, of streams capped at about `max_len` entries.
    pub fn new(
        cluster: Arc<Cluster>,
        keys: KeySpace,
        block: Duration,
        max_len: u64,
        max_readers: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            max_readers,
            cluster,
            keys,
            shows: Mutex::new(HashMap::new()),
            block,
            max_len,
            closed: watch::Sender::new(false),
        })
    }

    /// Entries in one reply from which a gap after the reader's position
    /// is possible: `XADD MAXLEN ~` keeps at least the cap, so a read
    /// after a trimmed position answers at least this many.
    fn gap_possible_at(&self) -> usize {
        usize::try_from(self.max_len)
            .unwrap_or(usize::MAX)
            .min(BUFFER)
    }

    /// The streams' length cap (`--events-max-len`), handed to reads of
    /// them (events.lua no longer needs it to tell a trimmed stream: the
    /// scripts count their own deletions).
    pub fn max_len(&self) -> u64 {
        self.max_len
    }

    /// Stops every reader (at shutdown, once the event streams have ended):
    /// a reader otherwise runs while its show's seat view is in use, and an
    /// embedded server would leave its connections open after it stopped.
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// A subscription to `show`'s events, and its feed; starts the show's
    /// reader when it has none. `None` when it has none and the hub is at
    /// its limit of readers.
    pub fn subscribe(self: &Arc<Self>, show: &ShowId) -> Option<(broadcast::Receiver<Live>, Feed)> {
        // Subscribed under the hub's lock, before a new reader can look.
        self.feed(show, self.max_readers, |feed| {
            (feed.tx.subscribe(), feed.clone())
        })
    }

    /// The seat view of `show`, kept current by the show's reader (started
    /// when it has none); with a view made just now, the reader's
    /// [`Feed::started`], which turns true once every event after the
    /// reader's starting position will reach the view. `None` when the show
    /// has no reader and the hub is at its limit of readers.
    pub fn view(
        self: &Arc<Self>,
        show: &ShowId,
        max_lag_ms: u64,
    ) -> Option<(Arc<SeatView>, Option<watch::Receiver<bool>>)> {
        self.feed(show, self.max_readers / 2, |feed| {
            let mut view = feed
                .view
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(view) = view.as_ref() {
                return (Arc::clone(view), None);
            }
            let new = Arc::new(SeatView::new(Arc::clone(&feed.current_at), max_lag_ms));
            *view = Some(Arc::clone(&new));
            (new, Some(feed.started.clone()))
        })
    }

    /// The view of `show`, if it has a reader with a view attached; starts
    /// nothing.
    pub fn existing_view(&self, show: &ShowId) -> Option<Arc<SeatView>> {
        self.lock().get(show)?.current_view()
    }

    /// Runs `with` on the feed of `show` under the hub's lock, so that what
    /// it attaches is there before the reader (started here when the show
    /// has none) first checks for users; `None` when a reader would have to
    /// start and `limit` readers run. Seat views start readers only up to
    /// half the hub's limit (rounded down: none with a limit of 1): reads
    /// need no token, and reads of made-up shows would otherwise take every
    /// reader from the event streams.
    fn feed<T>(
        self: &Arc<Self>,
        show: &ShowId,
        limit: usize,
        with: impl FnOnce(&Feed) -> T,
    ) -> Option<T> {
        let mut shows = self.lock();
        if let Some(feed) = shows.get(show) {
            return Some(with(feed));
        }
        if shows.len() >= limit {
            metrics::counter!(crate::metrics::EVENT_READERS_REFUSED).increment(1);
            return None;
        }
        let (tx, _) = broadcast::channel(BUFFER);
        let (started_tx, started) = watch::channel(false);
        let feed = Feed {
            tx,
            started,
            current_at: Arc::new(AtomicU64::new(0)),
            view: Arc::new(Mutex::new(None)),
        };
        let answer = with(&feed);
        shows.insert(show.clone(), feed.clone());
        metrics::gauge!(crate::metrics::EVENT_READERS).set(shows.len() as f64);
        let me = Arc::clone(self);
        let show = show.clone();
        tokio::spawn(async move { me.read(show, feed, started_tx).await });
        Some(answer)
    }

    /// Readers running (shows with subscribers on this instance).
    pub fn readers(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ShowId, Feed>> {
        // One map operation per lock: a poisoned lock guards a whole map.
        self.shows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The reader of `show`: XREAD BLOCK until no subscriber is left.
    async fn read(self: Arc<Self>, show: ShowId, feed: Feed, started: watch::Sender<bool>) {
        let (tx, current_at) = (&feed.tx, &feed.current_at);
        let stream = self.keys.events(&show);
        let slot = crate::keys::slot(stream.as_bytes());
        let mut last: Option<EventId> = None;
        let mut conn: Option<redis::aio::MultiplexedConnection> = None;
        let mut backoff = Duration::from_millis(50);
        // Whether a read failed since the last one that succeeded: the next
        // reply is applied only once nothing after `last` proves trimmed.
        let mut resumed = false;
        let mut checked_at = mono_ms();
        // The stream's entries-added at the last check.
        let mut added = 0;
        let mut closed = self.closed.subscribe();
        // Under the hub's lock, so that a new subscriber either finds this
        // reader's sender or starts a new reader.
        let retire = |shows: &mut HashMap<ShowId, Feed>| {
            shows.remove(&show);
            metrics::gauge!(crate::metrics::EVENT_READERS).set(shows.len() as f64);
        };
        loop {
            {
                let mut shows = self.lock();
                if *closed.borrow() || (tx.receiver_count() == 0 && !feed.view_in_use()) {
                    retire(&mut shows);
                    return;
                }
            }
            let Some(c) = conn.as_mut() else {
                conn = self.connect(slot).await;
                if conn.is_none() {
                    // As after a failed read: the master may be failing
                    // over, and what the view learned from Redis's answers
                    // meanwhile (before the first pin too) may be gone from
                    // the next one. The first read after it checks.
                    resumed = true;
                    back_off(&mut backoff).await;
                }
                continue;
            };
            let Some(from) = last else {
                // Pin the starting position before the first read, so that
                // an event written meanwhile is not skipped.
                let asked_at = mono_ms();
                last = self.newest(c, &stream).await;
                if last.is_some() {
                    backoff = Duration::from_millis(50);
                    current_at.store(asked_at, Ordering::Release);
                    started.send_replace(true);
                } else {
                    // Refused (ACL, LOADING, MOVED) or broken: pause as
                    // after a failed XREAD, not reconnect in a tight loop.
                    conn = None;
                    resumed = true;
                    back_off(&mut backoff).await;
                }
                continue;
            };
            let mut xread = redis::cmd("XREAD");
            xread
                .arg("COUNT")
                .arg(BUFFER)
                .arg("BLOCK")
                .arg(self.block.as_millis() as u64)
                .arg("STREAMS")
                .arg(&stream)
                .arg(from.to_string());
            // What a reply holds is current as of when it was asked for,
            // not when it is handled: a reply that waited (a stalled
            // process, a busy machine) says nothing of what was written
            // meanwhile.
            // Right behind it, the stream's first entry: trimming removes
            // entries from the head only, so when the position is still at
            // or after it, nothing after the position was trimmed away (a
            // cheap check of every reply, whatever cap trimmed the stream).
            let mut pipe = redis::pipe();
            pipe.add_command(xread)
                .cmd("XRANGE")
                .arg(&stream)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1);
            let asked_at = mono_ms();
            let reply = tokio::select! {
                reply = pipe.query_async::<(Value, Value)>(c) => reply,
                _ = closed.wait_for(|c| *c) => {
                    retire(&mut self.lock());
                    return;
                }
            };
            match reply {
                Ok((reply, head)) => {
                    backoff = Duration::from_millis(50);
                    let count = entries(&reply).count();
                    // The position is before the stream's first entry: the
                    // entries after it may be gone (trimmed, by whatever cap,
                    // or the stream deleted and begun again above it). A
                    // position of 0-0 (a stream that was empty) always is.
                    let head_past = from != EventId::ZERO
                        && match &head {
                            Value::Array(first) => first
                                .first()
                                .and_then(super::entry_id)
                                .is_some_and(|first| first > from),
                            _ => false,
                        };
                    // XREAD after an id that was trimmed away answers from
                    // the oldest entry kept, silently: events written while
                    // this reader was cut off or behind (more than the cap)
                    // would be lost to the view and the subscribers. After
                    // a failover, the new master may not have the reader's
                    // last events at all: the transitions they told of were
                    // undone, and later ids may even be below them (a new
                    // master whose clock is behind).
                    // And now and then in any case: a stream deleted (by
                    // delete-show) and begun again by later holds goes on
                    // above the position with no error and no gap in
                    // sight, while the view still knows the old seats. The
                    // new stream lacks the position, or, once the reader
                    // has moved into it, was given fewer entries than the
                    // old one (entries-added only grows in one stream).
                    let due = mono_ms().saturating_sub(checked_at) >= CHECK_POSITION_MS;
                    if resumed || due || head_past || count >= self.gap_possible_at() {
                        checked_at = mono_ms();
                        let checked = self.lost_after(&show, from).await.map(|kept| {
                            let lost = kept.is_none_or(|now| now < added);
                            added = kept.unwrap_or(0);
                            lost
                        });
                        match checked {
                            // Back after a failed read (a failover breaks
                            // the reader's connection): what the view
                            // learned from Redis's answers, and from the
                            // deadline index, may be gone from a new master
                            // that never had it (a sale not replicated yet),
                            // and no event will say so. Its events since
                            // are all there: it starts over from them.
                            Ok(false) if resumed => {
                                if let Some(view) = feed.current_view() {
                                    view.forget();
                                }
                            }
                            Ok(false) => {}
                            Ok(true) => {
                                // Entries in this reply are the first after
                                // the gap: the view learns from them. None
                                // may mean that the stream goes on below a
                                // position it lost (a new master whose clock
                                // is behind): start over from its newest
                                // entry, as a new reader.
                                if count == 0 {
                                    // Subscribers arriving meanwhile wait
                                    // for the new position, as for a new
                                    // reader's: before the gap is told, so
                                    // that one arriving after it (which
                                    // does not hear of it) cannot read up to
                                    // a position below the one the reader
                                    // then pins, and miss what lies between.
                                    started.send_replace(false);
                                }
                                lost_events(&show, &feed);
                                if count == 0 {
                                    last = None;
                                    added = 0;
                                    resumed = false;
                                    continue;
                                }
                            }
                            Err(err) => {
                                tracing::debug!(%show, error = %err, "event reader failed; reconnecting");
                                conn = None;
                                resumed = true;
                                back_off(&mut backoff).await;
                                continue;
                            }
                        }
                        resumed = false;
                    }
                    let view = feed.current_view();
                    // A full reply may leave more behind it (a backlog after
                    // a reconnection): only a shorter one proves the reader
                    // reached the end of the stream.
                    let full = count >= BUFFER;
                    for entry in entries(&reply) {
                        // Past every entry, an event or not: an entry that is
                        // not one (written by hand) was read again at once,
                        // in a loop, while the position stayed before it.
                        if let Some(id) = super::entry_id(entry) {
                            last = Some(id);
                        }
                        let Some(event) = Event::from_entry(&show, entry) else {
                            continue;
                        };
                        if let Some(view) = &view {
                            view.apply(&event);
                        }
                        // No receiver right now is fine: the loop checks.
                        let _ = tx.send(Live::Event(Arc::new(event)));
                    }
                    // After the events went out: a view that sees this time
                    // has applied everything written before it.
                    if !full {
                        current_at.store(asked_at, Ordering::Release);
                    }
                }
                Err(err) => {
                    tracing::debug!(%show, error = %err, "event reader failed; reconnecting");
                    conn = None;
                    resumed = true;
                    back_off(&mut backoff).await;
                }
            }
        }
    }

    /// `None` when the reader cannot go on exactly from `from`: entries
    /// after it may have been trimmed away, or the stream no longer has it
    /// (a failover lost it, or the stream was deleted). events.lua's rule
    /// for 410 `events_expired`. Otherwise the stream's entries-added.
    async fn lost_after(&self, show: &ShowId, from: EventId) -> Result<Option<u64>, Error> {
        let deadline = self.cluster.deadline();
        match super::read(
            &self.cluster,
            &self.keys,
            &deadline,
            show,
            Cursor::Resume(from),
            super::Span::new(1, self.max_len),
        )
        .await
        {
            Ok(read) => Ok(Some(read.added)),
            Err(Error::EventsExpired) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// The id of the newest entry of `stream` ("0-0" when there is none).
    async fn newest(
        &self,
        conn: &mut redis::aio::MultiplexedConnection,
        stream: &str,
    ) -> Option<EventId> {
        let reply: Value = redis::cmd("XREVRANGE")
            .arg(stream)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(conn)
            .await
            .ok()?;
        let newest = match &reply {
            Value::Array(entries) => entries.first().and_then(|e| match e {
                Value::Array(parts) => parts.first().and_then(super::text),
                _ => None,
            }),
            _ => None,
        };
        Some(
            newest
                .and_then(|id| EventId::parse(&id))
                .unwrap_or(EventId::ZERO),
        )
    }

    /// A connection of the reader's own to the master of `slot`.
    async fn connect(&self, slot: u16) -> Option<redis::aio::MultiplexedConnection> {
        let master = self.cluster.topology().master_of(slot)?.to_owned();
        let client = self.cluster.node_client(&master).ok()?;
        // Each XREAD blocks up to BLOCK_MS: the response timeout must allow it.
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.cluster.timeout()))
            .set_response_timeout(Some(self.block + self.cluster.timeout()));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .ok()
    }
}

/// Waits `backoff`, then doubles it, up to a second: a reader's pause after
/// a failed connection or read.
async fn back_off(backoff: &mut Duration) {
    tokio::time::sleep(*backoff).await;
    *backoff = (*backoff * 2).min(Duration::from_secs(1));
}

/// The reader of `show` may have missed events: its view forgets what it
/// knew, and its subscribers end their streams (their clients resume from
/// their last ids, and get 410 if those are gone too).
fn lost_events(show: &ShowId, feed: &Feed) {
    tracing::warn!(%show, "the show's reader cannot go on from its position (events after it were trimmed before it read them, or a failover lost it); its seat view starts over and its event streams end");
    metrics::counter!(crate::metrics::EVENT_READER_GAPS).increment(1);
    if let Some(view) = feed.current_view() {
        view.forget();
    }
    let _ = feed.tx.send(Live::Gap);
}

impl Feed {
    fn current_view(&self) -> Option<Arc<SeatView>> {
        self.view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether the show's view was asked for lately; an idle one is dropped.
    fn view_in_use(&self) -> bool {
        let mut view = self
            .view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let idle = view.as_ref().is_some_and(|v| {
            mono_ms().saturating_sub(v.last_used.load(Ordering::Relaxed)) > VIEW_IDLE_MS
        });
        if idle {
            *view = None;
        }
        view.is_some()
    }
}

/// The entries of an XREAD reply `[[stream, [entry, ...]]]`.
fn entries(reply: &Value) -> impl Iterator<Item = &Value> {
    let list = match reply {
        Value::Array(streams) => streams.first().and_then(|s| match s {
            Value::Array(parts) => match parts.get(1) {
                Some(Value::Array(entries)) => Some(entries.as_slice()),
                _ => None,
            },
            _ => None,
        }),
        _ => None,
    };
    list.unwrap_or_default().iter()
}

/// A monotonic clock in ms (from the first call, plus one, so never 0):
/// for how long ago something happened, which a step of the system clock
/// must not change (a reader stalled while the clock stepped back would
/// otherwise pass for current).
pub fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    start.elapsed().as_millis() as u64 + 1
}

/// This machine's clock in ms since the Unix epoch as it read at the first
/// call, advanced by the monotonic clock since: it never steps when the
/// system clock is set back or forward (both follow NTP's slewing), so an
/// offset measured against it, such as the seat view's lead of Redis's
/// clock, stays true across such a step. Against the system clock, a step
/// back made the view reckon Redis's time too early by the step, and hold
/// seats it knew as held for that much longer (until an event said
/// otherwise).
pub fn steady_now_ms() -> i64 {
    static START: std::sync::OnceLock<(std::time::Instant, u64)> = std::sync::OnceLock::new();
    let (start, wall) = START.get_or_init(|| (std::time::Instant::now(), now_ms()));
    i64::try_from(*wall).unwrap_or(0) + i64::try_from(start.elapsed().as_millis()).unwrap_or(0)
}

/// This machine's clock, ms since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
