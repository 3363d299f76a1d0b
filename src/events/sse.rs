//! The Server-Sent Events body of `GET /v1/shows/{show}/events`.
//!
//! A subscriber first gets what it missed (after its `Last-Event-ID` or
//! `?after=`, read from Redis in pages), then the show's live events from
//! this instance's one reader of the show ([`super::hub`]), each once and in
//! order. A comment line every heartbeat keeps proxies from closing an idle
//! stream. The body is fed through a small bounded channel: a client that
//! stops reading fills it, and once it has stayed full for [`STALL`] the
//! client is disconnected (its connection closed), so the daemon's memory
//! stays bounded whatever its clients do. A client that reads but falls
//! more than [`super::hub::BUFFER`] events behind the reader (a burst
//! larger than that, read at once) reads what it missed from the stream,
//! as a resuming client does, and goes on with the live events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::{broadcast, mpsc, watch};

use super::hub::{Feed, Live};
use super::{read, Cursor, Event, EventId, Events, Span};
use crate::cluster::{Cluster, Deadline};
use crate::error::Error;
use crate::ids::ShowId;
use crate::keys::KeySpace;
use crate::metrics as m;

/// Frames a client may have unread before it is disconnected.
const CLIENT_BUFFER: usize = 64;

/// A page of what a resuming client missed.
const PAGE: usize = 1000;

/// The response body of an SSE subscription.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What one subscription needs.
pub struct Subscription {
    pub cluster: Arc<Cluster>,
    pub keys: KeySpace,
    pub show: ShowId,
    /// The streams' length cap (`--events-max-len`).
    pub max_len: u64,
    /// Turns true when the server closes: the stream ends.
    pub closing: watch::Receiver<bool>,
    /// Closes the client's connection; used when it stopped reading.
    pub disconnect: Option<crate::http::Disconnect>,
}

/// Subscribes to `sub.show` from `cursor`. Fails (410 `events_expired`, or
/// 503) before any byte is sent, so the status can still say so. The
/// request's `deadline` bounds the wait for the show's reader and the first
/// read together, as it bounds all of any request's Redis work.
pub async fn subscribe(
    events: &Events,
    sub: Subscription,
    deadline: &Deadline,
    cursor: Cursor,
) -> Result<Body, Error> {
    let (live, feed) = events.hub.subscribe(&sub.show).ok_or(Error::Overloaded)?;
    wait_started(deadline, feed).await?;
    let opening = Span {
        before: true,
        ..Span::new(PAGE, sub.max_len)
    };
    let first = read(
        &sub.cluster,
        &sub.keys,
        deadline,
        &sub.show,
        cursor,
        opening,
    )
    .await?;
    let newest = first.newest;
    let start = match cursor {
        Cursor::After(id) | Cursor::Resume(id) => id,
        Cursor::Start => EventId::ZERO,
        Cursor::Newest => newest,
    };
    // An id the stream had (a client's `Last-Event-ID`, checked exactly by
    // the read above, or its newest entry), unlike a `?after=` position.
    let read = matches!(cursor, Cursor::Resume(_) | Cursor::Newest) && start > EventId::ZERO;
    // The id the opening frame announces, which a client whose connection
    // breaks before any event resumes from (as `Last-Event-ID`, checked
    // exactly). A `?after=` position is no event when a client made it
    // from a time; while nothing follows it yet, the newest event (before
    // it), or 0-0 on a stream without one, resumes the same; when entries
    // follow it, the newest entry at or before it does (0-0 when none).
    let announced = match cursor {
        // The last entry read when none was an event (written by hand):
        // an entry, which a resume finds exactly.
        Cursor::After(_) if first.events.is_empty() => first.last.unwrap_or(newest),
        Cursor::After(_) => first.before.unwrap_or(EventId::ZERO),
        _ => start,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CLIENT_BUFFER);
    tokio::spawn(feed_client(
        sub,
        events.heartbeat,
        live,
        first,
        (announced, Position { id: start, read }),
        tx,
    ));
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|bytes| (Ok::<_, Infallible>(Frame::data(bytes)), rx))
    });
    Ok(StreamBody::new(frames).boxed_unsync())
}

/// Waits until the show's reader has pinned its start (see [`Feed`]).
async fn wait_started(deadline: &Deadline, mut feed: Feed) -> Result<(), Error> {
    deadline
        .within(async {
            feed.started
                .wait_for(|started| *started)
                .await
                .map(|_| ())
                .map_err(|_| Error::Internal("the event reader ended".into()))
        })
        .await
}

/// Counts a subscriber while alive.
struct Subscribed;

impl Subscribed {
    fn new() -> Self {
        metrics::gauge!(m::EVENT_SUBSCRIBERS).increment(1.0);
        Self
    }
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        metrics::gauge!(m::EVENT_SUBSCRIBERS).decrement(1.0);
    }
}

/// Why a client's stream ended.
enum End {
    /// The client left, or the server closes.
    Gone,
    /// It fell too far behind.
    TooSlow,
}

/// Writes the opening frame (announcing `announced`), the missed events
/// (`first`, then further pages after `start`), then the live ones, to one
/// client.
async fn feed_client(
    mut sub: Subscription,
    heartbeat: Duration,
    mut live: broadcast::Receiver<Live>,
    first: super::Read,
    (announced, start): (EventId, Position),
    tx: mpsc::Sender<Bytes>,
) {
    let _subscribed = Subscribed::new();
    let mut cursor = start;
    let end = async {
        // A comment first: the client sees the stream open at once. With
        // it, the position the stream starts from as an event id of no
        // event: a client whose connection breaks before any event then
        // resumes from there (EventSource sends the last id it was given),
        // not from whatever is newest when it comes back, which would skip
        // what was written meanwhile.
        send(
            &tx,
            Bytes::from(format!(": seathold events\nid: {announced}\n\n")),
        )
        .await?;
        catch_up(&sub, &tx, &mut cursor, first).await?;
        let mut beat = tokio::time::interval(heartbeat);
        beat.tick().await;
        loop {
            tokio::select! {
                event = live.recv() => match event {
                    // Events may be missing: end, and let the client
                    // resume from its last id.
                    Ok(Live::Gap) => return Err(End::Gone),
                    Ok(Live::Event(event)) if event.event_id > cursor.id => {
                        cursor.advance(event.event_id);
                        // A full buffer is no verdict yet: a burst (a
                        // sweep's 200 expiries, read at once) fills it
                        // faster than the connection drains it. A client
                        // that takes nothing for a while has stopped.
                        send(&tx, frame(&event)).await?;
                        delivered(&event);
                    }
                    Ok(_) => {}
                    // Behind the reader by more than the channel keeps: a
                    // burst (a backlog the reader read in replies back to
                    // back) outran a client that reads. What it missed is
                    // in the stream: it reads that from there, as a
                    // resuming client does, then goes on with the live
                    // events after it (the channel keeps the newest). A
                    // client that stopped reading is still ended by
                    // [`send`], once its buffer stayed full for [`STALL`].
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        tracing::debug!(show = %sub.show, "event subscriber behind the reader; catching up from the stream");
                        let page = read_after(&sub, cursor).await?;
                        catch_up(&sub, &tx, &mut cursor, page).await?;
                    }
                    Err(broadcast::error::RecvError::Closed) => return Err(End::Gone),
                },
                _ = beat.tick() => send(&tx, Bytes::from_static(b": keep-alive\n\n")).await?,
                () = closed(&mut sub.closing) => return Err(End::Gone),
                _ = tx.closed() => return Err(End::Gone),
            }
        }
    };
    let result: Result<(), End> = end.await;
    match result {
        Err(End::TooSlow) => {
            // Closed, not just ended: a client that does not read would
            // keep the connection, and what is buffered for it, forever.
            if let Some(disconnect) = &sub.disconnect {
                disconnect.now();
            }
            metrics::counter!(m::EVENT_SUBSCRIBERS_DROPPED).increment(1);
            tracing::debug!(show = %sub.show, "event subscriber too slow; disconnected");
        }
        // The connection closed it first: its client took nothing for as
        // long as a connection waits (`--header-read-timeout-ms`), before
        // its buffer here stayed full for [`STALL`] (events come slowly).
        Err(End::Gone) if sub.disconnect.as_ref().is_some_and(|d| d.was_stalled()) => {
            metrics::counter!(m::EVENT_SUBSCRIBERS_DROPPED).increment(1);
            tracing::debug!(show = %sub.show, "event subscriber took nothing; its connection closed");
        }
        _ => {}
    }
}

/// Sends the events of `page` and of the pages after it, up to the
/// stream's newest, advancing `cursor`.
async fn catch_up(
    sub: &Subscription,
    tx: &mpsc::Sender<Bytes>,
    cursor: &mut Position,
    mut page: super::Read,
) -> Result<(), End> {
    loop {
        for event in &page.events {
            if event.event_id > cursor.id {
                send(tx, frame(event)).await?;
                cursor.advance(event.event_id);
            }
        }
        // Past entries that are not events too.
        if let Some(last) = page.last {
            cursor.advance(last);
        }
        if page.entries < PAGE {
            return Ok(());
        }
        page = read_after(sub, *cursor).await?;
    }
}

/// Where a client's stream is: the last entry it was sent or read past,
/// or, before any, where it started.
#[derive(Clone, Copy)]
struct Position {
    id: EventId,
    /// Whether `id` is an entry read from the stream, which a read after it
    /// must find exactly (a failover may have lost it, with the changes its
    /// client saw up to it), not a position (`?after=`, perhaps made from a
    /// time).
    read: bool,
}

impl Position {
    /// Moves past the entry `id` read from the stream, if it is later.
    fn advance(&mut self, id: EventId) {
        if id > self.id {
            self.id = id;
            self.read = true;
        }
    }
}

/// A page of the events after `cursor`, within a Redis request's deadline
/// of its own. A failed read (events after it trimmed away, an entry it was
/// sent gone, or Redis unavailable) ends the stream: the client resumes
/// from its last id, and learns of either by its 410. Exact after an entry
/// read, so that a client that fell behind its show's reader when the
/// reader found its position gone ends too: the reader's gap signal, sent
/// before the entries of the reply that showed the gap, may have left the
/// channel before it was read, pushed out by them.
async fn read_after(sub: &Subscription, cursor: Position) -> Result<super::Read, End> {
    read(
        &sub.cluster,
        &sub.keys,
        &sub.cluster.deadline(),
        &sub.show,
        if cursor.read {
            Cursor::Resume(cursor.id)
        } else {
            Cursor::After(cursor.id)
        },
        Span::new(PAGE, sub.max_len),
    )
    .await
    .map_err(|_| End::Gone)
}

/// Completes when `closing` turns true (or its sender is gone).
async fn closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

/// How long a client may leave its buffer full before it counts as one
/// that stopped reading.
const STALL: Duration = Duration::from_secs(5);

/// Sends `bytes`, waiting a little for a slow client, never for long.
async fn send(tx: &mpsc::Sender<Bytes>, bytes: Bytes) -> Result<(), End> {
    match tokio::time::timeout(STALL, tx.send(bytes)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(End::Gone),
        Err(_) => Err(End::TooSlow),
    }
}

/// One SSE frame: `id`, `event` and `data` lines.
fn frame(event: &Event) -> Bytes {
    let data = serde_json::to_string(event).unwrap_or_default();
    Bytes::from(format!(
        "id: {}\nevent: {}\ndata: {data}\n\n",
        event.id, event.kind
    ))
}

/// Records the time from the event (its id's ms, Redis's clock) to now.
fn delivered(event: &Event) {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let seconds = now_ms.saturating_sub(event.event_id.ms) as f64 / 1000.0;
    m::hot::observe(m::EVENT_DELIVERY, &[], seconds);
}
