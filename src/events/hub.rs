//! One Redis reader per show per instance, fanned out to all of this
//! instance's subscribers of the show.
//!
//! The first subscriber of a show starts a reader task: `XREAD BLOCK` on the
//! show's stream over a connection of its own to the slot's master (a
//! blocking read would stall a shared multiplexed connection), from the
//! stream's newest entry on. A subscriber waits until the reader has pinned
//! that position ([`Feed::started`]) before it reads what it missed with
//! [`super::read`], so that nothing falls between the two. Each event goes to a broadcast channel; a
//! subscriber that falls more than [`BUFFER`] events behind is dropped by the
//! channel (and disconnected by [`super::sse`]). The reader stops when its
//! last subscriber has gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Value;
use tokio::sync::{broadcast, watch};

use super::{Event, EventId};
use crate::cluster::Cluster;
use crate::ids::ShowId;
use crate::keys::KeySpace;

/// Events a subscriber may fall behind before it is dropped.
pub const BUFFER: usize = 1024;

/// How long one XREAD blocks; the reader checks for subscribers between.
const BLOCK_MS: u64 = 2_000;

/// The per-show readers of this instance.
pub struct Hub {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    shows: Mutex<HashMap<ShowId, Feed>>,
}

/// One show's reader, as its subscribers see it.
#[derive(Clone)]
pub struct Feed {
    tx: broadcast::Sender<Arc<Event>>,
    /// Turns true once the reader has pinned its starting position: every
    /// event after it will be sent.
    pub started: watch::Receiver<bool>,
}

impl Hub {
    pub fn new(cluster: Arc<Cluster>, keys: KeySpace) -> Arc<Self> {
        Arc::new(Self {
            cluster,
            keys,
            shows: Mutex::new(HashMap::new()),
        })
    }

    /// A subscription to `show`'s events, and its feed; starts the show's
    /// reader when it has none.
    pub fn subscribe(self: &Arc<Self>, show: &ShowId) -> (broadcast::Receiver<Arc<Event>>, Feed) {
        let mut shows = self.lock();
        if let Some(feed) = shows.get(show) {
            return (feed.tx.subscribe(), feed.clone());
        }
        let (tx, rx) = broadcast::channel(BUFFER);
        let (started_tx, started) = watch::channel(false);
        let feed = Feed { tx, started };
        shows.insert(show.clone(), feed.clone());
        metrics::gauge!(crate::metrics::EVENT_READERS).set(shows.len() as f64);
        let (me, show, tx) = (Arc::clone(self), show.clone(), feed.tx.clone());
        tokio::spawn(async move { me.read(show, tx, started_tx).await });
        (rx, feed)
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
    async fn read(
        self: Arc<Self>,
        show: ShowId,
        tx: broadcast::Sender<Arc<Event>>,
        started: watch::Sender<bool>,
    ) {
        let stream = self.keys.events(&show);
        let slot = crate::keys::slot(stream.as_bytes());
        let mut last: Option<EventId> = None;
        let mut conn: Option<redis::aio::MultiplexedConnection> = None;
        let mut backoff = Duration::from_millis(50);
        loop {
            {
                // Stop under the lock, so that a new subscriber either finds
                // this reader's sender or starts a new reader.
                let mut shows = self.lock();
                if tx.receiver_count() == 0 {
                    metrics::gauge!(crate::metrics::EVENT_READERS).set((shows.len() - 1) as f64);
                    shows.remove(&show);
                    return;
                }
            }
            let Some(c) = conn.as_mut() else {
                conn = self.connect(slot).await;
                if conn.is_none() {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                continue;
            };
            let Some(from) = last else {
                // Pin the starting position before the first read, so that
                // an event written meanwhile is not skipped.
                last = self.newest(c, &stream).await;
                if last.is_some() {
                    started.send_replace(true);
                } else {
                    conn = None;
                }
                continue;
            };
            let reply: Result<Value, _> = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(BUFFER)
                .arg("BLOCK")
                .arg(BLOCK_MS)
                .arg("STREAMS")
                .arg(&stream)
                .arg(from.to_string())
                .query_async(c)
                .await;
            match reply {
                Ok(reply) => {
                    backoff = Duration::from_millis(50);
                    for event in entries(&reply).filter_map(|e| Event::from_entry(&show, e)) {
                        last = Some(event.event_id);
                        // No receiver right now is fine: the loop checks.
                        let _ = tx.send(Arc::new(event));
                    }
                }
                Err(err) => {
                    tracing::debug!(%show, error = %err, "event reader failed; reconnecting");
                    conn = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
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
            .set_response_timeout(Some(
                Duration::from_millis(BLOCK_MS) + self.cluster.timeout(),
            ));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .ok()
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
