//! Events: every transition of a hold, written by the hold scripts to the
//! show's Redis Stream in the same step as the transition (see
//! `lua/hold.lua`), read back here.
//!
//! - [`sweep`]: `expired` events, exactly once, from each show's deadline
//!   index (`lua/sweep.lua`); keyspace notifications only wake it early.
//! - [`hub`]: one Redis reader per show per instance, fanned out to every
//!   subscriber of the show on this instance.
//! - [`sse`]: the Server-Sent Events body of `GET /v1/shows/{show}/events`.
//! - [`view`]: the local seat view of busy shows, fed by their readers.
//!
//! An entry's fields are short (`t` type, `r` hold ref, `s` items: seat ids
//! and `@pool=units`, `f` fence, `l` TTL, `x` expiry); this module turns
//! them into the contract's JSON (`seats`, and `pools` when there are units;
//! a `pool_changed` event's `pools` holds the pool's new capacity).

use std::sync::Arc;

use redis::Value;
use serde::Serialize;

use crate::cluster::{Cluster, Deadline};
use crate::error::Error;
use crate::ids::ShowId;
use crate::keys::KeySpace;
use crate::model::iso_millis;

pub mod hub;
pub mod sse;
pub mod sweep;
pub mod view;

/// Most events one poll may ask for.
pub const MAX_LIMIT: usize = 1000;

/// A stream id, `<ms>-<seq>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId {
    pub ms: u64,
    pub seq: u64,
}

impl EventId {
    /// Before every event.
    pub const ZERO: Self = Self { ms: 0, seq: 0 };

    /// Parses `<ms>-<seq>` (or `<ms>`, as `<ms>-0`).
    pub fn parse(raw: &str) -> Option<Self> {
        let (ms, seq) = raw.split_once('-').unwrap_or((raw, "0"));
        Some(Self {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }

    /// Parses a client's cursor (`?after=`, `Last-Event-ID`): `<ms>-<seq>`
    /// or `<ms>`, each 1-19 ASCII digits and nothing else (no sign, no
    /// white space), as the OpenAPI document's `EventCursor` says.
    pub fn from_cursor(raw: &str) -> Option<Self> {
        let digits = |s: &str| (1..=19).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
        let (ms, seq) = raw.split_once('-').unwrap_or((raw, "0"));
        if !(digits(ms) && digits(seq)) {
            return None;
        }
        Self::parse(raw)
    }

    /// The fence of the hold whose `held` event has this id (see
    /// `lua/hold.lua`): ms x 1000 + sequence.
    pub fn fence(self) -> i64 {
        i64::try_from(self.ms * 1000 + self.seq).unwrap_or(i64::MAX)
    }
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// One event, as the API answers it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub show: ShowId,
    pub seats: Vec<String>,
    /// Pool units (`pool_changed`: the pool's new capacity).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub pools: std::collections::BTreeMap<String, u64>,
    pub hold_ref: String,
    pub fence: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// `expires_at` in ms on Redis's clock.
    #[serde(skip)]
    pub expires_at_ms: Option<i64>,
    pub at: String,
    /// The parsed id, for ordering and delivery times.
    #[serde(skip)]
    pub event_id: EventId,
}

/// The id of an XRANGE/XREAD entry `[id, [field, value, ...]]`.
pub fn entry_id(entry: &Value) -> Option<EventId> {
    match entry {
        Value::Array(parts) => EventId::parse(&text(parts.first()?)?),
        _ => None,
    }
}

impl Event {
    /// An XRANGE/XREAD entry `[id, [field, value, ...]]` of `show`'s stream;
    /// `None` for an entry seathold did not write: no type, or a type that
    /// is not a word (it goes on an SSE `event:` line, which a line break
    /// would end).
    pub fn from_entry(show: &ShowId, entry: &Value) -> Option<Self> {
        let Value::Array(parts) = entry else {
            return None;
        };
        let [id, Value::Array(fields)] = parts.as_slice() else {
            return None;
        };
        let id = text(id)?;
        let event_id = EventId::parse(&id)?;
        let get = |name: &str| {
            fields
                .chunks_exact(2)
                .find(|kv| text(&kv[0]).as_deref() == Some(name))
                .and_then(|kv| text(&kv[1]))
        };
        let kind = get("t")
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))?;
        let hold_ref = get("r").unwrap_or_default();
        let items = get("s").unwrap_or_default();
        let mut seats = Vec::new();
        let mut pools = std::collections::BTreeMap::new();
        for item in items.split(' ').filter(|x| !x.is_empty()) {
            match item.strip_prefix('@').and_then(|p| p.split_once('=')) {
                Some((pool, n)) => {
                    pools.insert(pool.to_owned(), n.parse().unwrap_or(0));
                }
                None => seats.push(item.to_owned()),
            }
        }
        let at_ms = i64::try_from(event_id.ms).ok()?;
        // A `held` or `modified` event's fence (and a `held` event's expiry)
        // come from its id: the script could not know the id before it
        // wrote the entry.
        let (fence, expires_ms) = match kind.as_str() {
            // Its expiry is the id's time plus the TTL, or `x` when the
            // hold's time came from TIME rather than from the id (pools, a
            // holder: lua/hold.lua).
            "held" => (
                event_id.fence(),
                get("x").and_then(|x| x.parse::<i64>().ok()).or_else(|| {
                    get("l")
                        .and_then(|l| l.parse::<i64>().ok())
                        .map(|l| at_ms + l)
                }),
            ),
            // A change's new fence is its event's id too (lua/modify.lua).
            "modified" => (
                event_id.fence(),
                get("x").and_then(|x| x.parse::<i64>().ok()),
            ),
            _ => (
                get("f").and_then(|f| f.parse().ok()).unwrap_or(0),
                get("x").and_then(|x| x.parse::<i64>().ok()),
            ),
        };
        Some(Self {
            id,
            kind,
            show: show.clone(),
            seats,
            pools,
            hold_ref,
            fence,
            expires_at: expires_ms.map(iso_millis),
            expires_at_ms: expires_ms,
            at: iso_millis(at_ms),
            event_id,
        })
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// A page of events: `{"events":[…],"next":"<id>"}`.
#[derive(Debug, Serialize)]
pub struct Page {
    pub events: Vec<Event>,
    pub next: String,
}

/// Where a reader starts: after a given position, after an event it was
/// given, or after the newest.
#[derive(Debug, Clone, Copy)]
pub enum Cursor {
    /// After a position (`?after=`, possibly made from a time, `<ms>`): 410
    /// only when events after it were trimmed away.
    After(EventId),
    /// After an event this reader had from the stream (`Last-Event-ID`, a
    /// show reader's own position): also 410 when the stream no longer has
    /// it, though it is not older than the stream (a failover lost it, and
    /// the transitions the reader saw up to it were undone).
    Resume(EventId),
    Newest,
    /// Everything the stream keeps, never 410: a poll that sent no cursor.
    /// (0-0 sent as a cursor is a position before every entry, 410 once
    /// the stream was trimmed: an empty stream answers it as its position.)
    Start,
}

/// What [`read`] read.
pub struct Read {
    /// The events among the entries read.
    pub events: Vec<Event>,
    /// How many entries were read, events or not (`limit`: there may be
    /// more).
    pub entries: usize,
    /// The id of the last entry read, an event or not: where to go on from
    /// (past entries that are not events, written by hand).
    pub last: Option<EventId>,
    /// The stream's newest id (0-0 when it has none).
    pub newest: EventId,
    /// After a position (`Cursor::After`) followed by entries, when asked
    /// for ([`Span::before`]): the newest entry at or before it (0-0 when
    /// none), an id a resume finds exactly.
    pub before: Option<EventId>,
    /// How many entries the stream was ever given (XINFO's entries-added):
    /// it only grows, unless the stream was deleted and begun again.
    pub added: u64,
}

/// How much of a stream [`read`] reads, and what else it answers.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Most entries to answer.
    pub limit: usize,
    /// The streams' length cap (`--events-max-len`), passed to events.lua,
    /// which tells a trimmed stream by the scripts' count of their own
    /// deletions instead (`#events-deleted`), whatever cap trimmed it.
    pub max_len: u64,
    /// After a position (`Cursor::After`) followed by entries, also
    /// [`Read::before`]: for an SSE stream's opening frame.
    pub before: bool,
}

impl Span {
    /// Up to `limit` entries of streams capped at about `max_len`.
    pub fn new(limit: usize, max_len: u64) -> Self {
        Self {
            limit,
            max_len,
            before: false,
        }
    }
}

/// Reads up to `span.limit` entries of `show`'s stream after `cursor`: 410
/// `events_expired` when some after the cursor were trimmed away, or
/// (`Cursor::Resume`) the stream no longer has the cursor's event.
pub async fn read(
    cluster: &Cluster,
    keys: &KeySpace,
    deadline: &Deadline,
    show: &ShowId,
    cursor: Cursor,
    span: Span,
) -> Result<Read, Error> {
    let stream = [keys.events(show), keys.events_deleted(show)];
    let (from, exact) = match cursor {
        Cursor::After(id) => (id.to_string(), "0"),
        Cursor::Resume(id) => (id.to_string(), "1"),
        Cursor::Newest => ("$".to_owned(), "0"),
        Cursor::Start => ("0-0".to_owned(), "0"),
    };
    let everything = matches!(cursor, Cursor::Start);
    let reply: Vec<Value> = cluster
        .eval(deadline, &cluster.scripts().events, &stream, |c| {
            c.arg(&from)
                .arg(span.limit)
                .arg(exact)
                .arg(span.max_len)
                .arg(if span.before { "1" } else { "0" })
                .arg(if everything { "1" } else { "0" });
        })
        .await?;
    match reply.as_slice() {
        [Value::Int(0)] => Err(Error::EventsExpired),
        [Value::Int(1), Value::Array(entries), newest, before, Value::Int(added)] => {
            let newest = text(newest)
                .and_then(|id| EventId::parse(&id))
                .unwrap_or(EventId::ZERO);
            let before = text(before).and_then(|id| EventId::parse(&id));
            Ok(Read {
                events: entries
                    .iter()
                    .filter_map(|e| Event::from_entry(show, e))
                    .collect(),
                entries: entries.len(),
                last: entries.last().and_then(entry_id),
                newest,
                before,
                added: u64::try_from(*added).unwrap_or(0),
            })
        }
        _ => Err(Error::Internal(format!(
            "unexpected reply of events.lua: {reply:?}"
        ))),
    }
}

/// The event machinery of one daemon: the sweeper and the per-show hub.
pub struct Events {
    pub sweeper: Arc<sweep::Sweeper>,
    pub hub: Arc<hub::Hub>,
    /// How often an SSE stream without events sends a comment line.
    pub heartbeat: std::time::Duration,
    /// The local seat views of busy shows; `None` when off.
    pub views: Option<Arc<view::Views>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn ids_and_fences() {
        let id = EventId::parse("1764504000000-7").expect("id");
        assert_eq!(id.fence(), 1_764_504_000_000_007);
        assert_eq!(id.to_string(), "1764504000000-7");
        assert_eq!(EventId::parse("5"), Some(EventId { ms: 5, seq: 0 }));
        assert!(EventId::parse("x-1").is_none());
        assert_eq!(EventId::from_cursor("5"), Some(EventId { ms: 5, seq: 0 }));
        assert_eq!(EventId::from_cursor("5-7"), Some(EventId { ms: 5, seq: 7 }));
        assert_eq!(
            EventId::from_cursor("9999999999999999999-9999999999999999999"),
            Some(EventId {
                ms: 9_999_999_999_999_999_999,
                seq: 9_999_999_999_999_999_999
            })
        );
        for bad in [
            "",
            "+5",
            " 5",
            "5 ",
            "5-",
            "-5",
            "5--1",
            "5-+1",
            "a",
            "12345678901234567890",
        ] {
            assert_eq!(EventId::from_cursor(bad), None, "{bad:?}");
        }
        assert!(EventId::parse("1764504000000-7") > EventId::parse("1764504000000-6"));
    }

    #[test]
    fn held_entry_becomes_the_contract_json() {
        let show = ShowId::parse("42").expect("show");
        let entry = Value::Array(vec![
            bulk("1764504000000-17"),
            Value::Array(vec![
                bulk("t"),
                bulk("held"),
                bulk("r"),
                bulk("9f86d081884c7d65"),
                bulk("s"),
                bulk("E7 E8"),
                bulk("l"),
                bulk("300000"),
            ]),
        ]);
        let e = Event::from_entry(&show, &entry).expect("event");
        let json = serde_json::to_value(&e).expect("json");
        assert_eq!(
            json,
            serde_json::json!({"id":"1764504000000-17","type":"held","show":"42",
                "seats":["E7","E8"],"holdRef":"9f86d081884c7d65","fence":1_764_504_000_000_017_i64,
                "expiresAt":"2025-11-30T12:05:00.000Z","at":"2025-11-30T12:00:00.000Z"})
        );
    }
}
