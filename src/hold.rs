//! Hold operations: validate, check slots, run one script, shape the answer.
//!
//! Every rule that can be checked without Redis is checked here first, so a
//! bad request never costs a round trip, and a multi-seat hold whose keys
//! span slots is refused before any command for it is sent.

use std::sync::Arc;

use redis::Value;
use serde::Serialize;

use crate::cluster::Cluster;
use crate::error::{Confirmation, Error, RedisFault, SeatSlot, Taken};
use crate::keys::{self, KeySpace};
use crate::metrics as m;

/// Limits from the command line.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub max_hold_lifetime_ms: u64,
    pub max_seats_per_hold: usize,
    pub confirm_wait_replicas: u32,
    pub confirm_wait_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_ttl_ms: 300_000,
            max_ttl_ms: 1_800_000,
            max_hold_lifetime_ms: 7_200_000,
            max_seats_per_hold: 20,
            confirm_wait_replicas: 1,
            confirm_wait_timeout_ms: 1_000,
        }
    }
}

/// One seat of a multi-show hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeatRef {
    pub show: String,
    pub seat: String,
}

/// The seats of a hold, shaped as the route that made it answers them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Seats {
    /// Made under `/v1/shows/{show}/…`: seat ids of the home show.
    Show(Vec<String>),
    /// Made with `POST /v1/holds`: `{show, seat}` pairs.
    Multi(Vec<SeatRef>),
}

impl Seats {
    fn len(&self) -> usize {
        match self {
            Self::Show(s) => s.len(),
            Self::Multi(s) => s.len(),
        }
    }

    /// `(show, seat)` of every seat, in order.
    fn pairs<'a>(&'a self, home: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        // One of the two slices is empty; chaining them avoids boxing.
        let (plain, multi): (&[String], &[SeatRef]) = match self {
            Self::Show(seats) => (seats, &[]),
            Self::Multi(seats) => (&[], seats),
        };
        plain
            .iter()
            .map(move |seat| (home, seat.as_str()))
            .chain(multi.iter().map(|r| (r.show.as_str(), r.seat.as_str())))
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Show(_) => "s",
            Self::Multi(_) => "m",
        }
    }

    /// The record form: `show/seat` joined by spaces.
    fn encode(&self, home: &str) -> String {
        let mut out = String::with_capacity(self.len() * 16);
        for (i, (show, seat)) in self.pairs(home).enumerate() {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(show);
            out.push('/');
            out.push_str(seat);
        }
        out
    }

    fn decode(kind: &str, encoded: &str, home: &str) -> Option<Self> {
        let mut pairs = Vec::new();
        for item in encoded.split(' ') {
            let (show, seat) = item.split_once('/')?;
            if !keys::valid_id(show) || !keys::valid_id(seat) {
                return None;
            }
            pairs.push((show, seat));
        }
        match kind {
            "s" if pairs.iter().all(|(s, _)| *s == home) => Some(Self::Show(
                pairs.into_iter().map(|(_, seat)| seat.to_owned()).collect(),
            )),
            "m" => Some(Self::Multi(
                pairs
                    .into_iter()
                    .map(|(show, seat)| SeatRef {
                        show: show.to_owned(),
                        seat: seat.to_owned(),
                    })
                    .collect(),
            )),
            _ => None,
        }
    }
}

/// A live hold, as the API answers it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    pub hold_token: String,
    pub show: String,
    pub seats: Seats,
    pub expires_in_ms: i64,
    pub expires_at: String,
    pub fence: i64,
}

/// The state of one seat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SeatState {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seat: Option<String>,
    /// `free`, `held` or `sold`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<i64>,
}

/// A hold or sale record read back from Redis.
struct Record {
    /// 1 = live hold, 2 = confirmed.
    found: i64,
    pttl: i64,
    now_ms: i64,
    seats: Seats,
    fence: i64,
}

/// The hold service: the operations behind the routes.
pub struct Service {
    cluster: Arc<Cluster>,
    keys: KeySpace,
    limits: Limits,
}

impl Service {
    pub fn new(cluster: Arc<Cluster>, keys: KeySpace, limits: Limits) -> Self {
        Self {
            cluster,
            keys,
            limits,
        }
    }

    /// The cluster this service runs on.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// The key space.
    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    fn ttl(&self, ttl_ms: Option<u64>) -> Result<u64, Error> {
        let ttl = ttl_ms.unwrap_or(self.limits.default_ttl_ms);
        if ttl == 0 || ttl > self.limits.max_ttl_ms {
            return Err(Error::InvalidTtl(format!(
                "ttlMs must be a positive integer of at most {}",
                self.limits.max_ttl_ms
            )));
        }
        Ok(ttl)
    }

    /// Holds `seats`, all or nothing. `home` is the show whose routes
    /// serve the hold afterwards.
    pub async fn hold(&self, home: &str, seats: Seats, ttl_ms: Option<u64>) -> Result<Hold, Error> {
        if !keys::valid_id(home) {
            return Err(Error::InvalidShow);
        }
        if seats.len() == 0 {
            return Err(Error::InvalidRequest(
                "seats must name at least one seat".into(),
            ));
        }
        // Every later step walks the seats as (show, seat) pairs: collect
        // them once.
        let pairs: Vec<(&str, &str)> = seats.pairs(home).collect();
        for (show, seat) in &pairs {
            if !keys::valid_id(show) {
                return Err(Error::InvalidShow);
            }
            if !keys::valid_id(seat) {
                return Err(Error::InvalidSeat);
            }
        }
        if pairs.len() > self.limits.max_seats_per_hold {
            return Err(Error::TooManySeats(self.limits.max_seats_per_hold));
        }
        // At most --max-seats-per-hold seats (checked above, so this stays
        // cheap): comparing pairs beats hashing them.
        for (i, (show, seat)) in pairs.iter().enumerate() {
            if pairs[..i].contains(&(show, seat)) {
                let name = match &seats {
                    Seats::Show(_) => (*seat).to_owned(),
                    Seats::Multi(_) => format!("{show}/{seat}"),
                };
                return Err(Error::DuplicateSeat(name));
            }
        }
        let ttl = self.ttl(ttl_ms)?;

        let token = uuid::Uuid::new_v4().hyphenated().to_string();
        let mut shows: Vec<&str> = pairs.iter().map(|&(show, _)| show).collect();
        shows.sort_unstable();
        shows.dedup();
        let mut key_list = Vec::with_capacity(1 + shows.len() + seats.len());
        key_list.push(self.keys.hold_record(home, &token));
        key_list.extend(shows.iter().map(|show| self.keys.fence(show)));
        key_list.extend(pairs.iter().map(|&(show, seat)| self.keys.seat(show, seat)));

        // The slot check: keys of one show share a tag by construction (and
        // the direct path computes their slot once to route them), but seats
        // of several shows only share a slot when their tags collide.
        let slots: Vec<u16> = if shows.len() > 1 {
            key_list.iter().map(|k| keys::slot(k.as_bytes())).collect()
        } else {
            Vec::new()
        };
        if slots.iter().any(|&s| s != slots[0]) {
            m_counter(m::CROSS_SLOT_REJECTIONS, 1);
            let first_seat = 1 + shows.len();
            let detail = pairs
                .iter()
                .zip(&slots[first_seat..])
                .map(|(&(show, seat), &slot)| SeatSlot {
                    show: show.to_owned(),
                    seat: seat.to_owned(),
                    slot,
                })
                .collect();
            return Err(Error::CrossSlot(detail));
        }

        let encoded = seats.encode(home);
        let fences = shows.len();
        let reply: Vec<i64> = self
            .cluster
            .eval(&self.cluster.scripts().hold, &key_list, |c| {
                c.arg(&token)
                    .arg(ttl)
                    .arg(fences)
                    .arg(seats.kind())
                    .arg(&encoded);
            })
            .await?;

        match reply.as_slice() {
            [1, fence, pttl, now] => {
                m_counter(m::HOLDS, 1);
                m_counter(m::SEATS_HELD, seats.len() as u64);
                Ok(Hold {
                    hold_token: token,
                    show: home.to_owned(),
                    seats,
                    expires_in_ms: *pttl,
                    expires_at: iso_millis(now + pttl),
                    fence: *fence,
                })
            }
            [0, rest @ ..] if !rest.is_empty() && rest.len() % 3 == 0 => {
                m_counter(m::HOLD_CONFLICTS, 1);
                let multi = matches!(seats, Seats::Multi(_));
                let taken = rest
                    .chunks_exact(3)
                    .filter_map(|c| {
                        let (show, seat) =
                            pairs.get(usize::try_from(c[0]).ok()?.checked_sub(1)?)?;
                        Some(Taken {
                            show: multi.then(|| (*show).to_owned()),
                            seat: (*seat).to_owned(),
                            state: if c[1] == 2 { "sold" } else { "held" },
                            expires_in_ms: (c[1] != 2 && c[2] >= 0).then_some(c[2]),
                        })
                    })
                    .collect();
                Err(Error::SeatsTaken(taken))
            }
            other => Err(Error::Internal(format!(
                "unexpected reply of hold.lua: {other:?}"
            ))),
        }
    }

    /// Canonical token, or 404 without asking Redis: a token that is not a
    /// lowercase hyphenated UUID was never issued.
    fn check_token<'t>(&self, show: &str, token: &'t str) -> Result<&'t str, Error> {
        if !keys::valid_id(show) {
            return Err(Error::InvalidShow);
        }
        match uuid::Uuid::try_parse(token) {
            Ok(u) if u.hyphenated().to_string() == token => Ok(token),
            _ => Err(Error::HoldNotFound),
        }
    }

    async fn lookup(
        &self,
        show: &str,
        token: &str,
        with_sale: bool,
    ) -> Result<Option<Record>, Error> {
        let mut key_list = vec![self.keys.hold_record(show, token)];
        if with_sale {
            key_list.push(self.keys.sale_record(show, token));
        }
        let reply: Vec<Value> = self
            .cluster
            .eval(&self.cluster.scripts().lookup, &key_list, |_| {})
            .await?;
        let int = |v: Option<&Value>| match v {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        };
        let found =
            int(reply.first()).ok_or_else(|| Error::Internal("bad reply of lookup.lua".into()))?;
        if found == 0 {
            return Ok(None);
        }
        let (pttl, now_ms) = (
            int(reply.get(1)).unwrap_or(-1),
            int(reply.get(2)).unwrap_or(0),
        );
        // "<fence> <created_ms> <kind> <seats>", see lua/hold.lua.
        let unreadable = || Error::Internal(format!("unreadable hold record for {show}"));
        let Some(Value::BulkString(raw)) = reply.get(3) else {
            return Err(unreadable());
        };
        let record = std::str::from_utf8(raw).map_err(|_| unreadable())?;
        let mut parts = record.splitn(4, ' ');
        let (Some(fence), Some(_created), Some(kind), Some(encoded)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(unreadable());
        };
        let seats = Seats::decode(kind, encoded, show).ok_or_else(unreadable)?;
        Ok(Some(Record {
            found,
            pttl,
            now_ms,
            seats,
            fence: fence.parse().map_err(|_| unreadable())?,
        }))
    }

    fn seat_keys(&self, show: &str, seats: &Seats) -> Vec<String> {
        seats
            .pairs(show)
            .map(|(s, seat)| self.keys.seat(s, seat))
            .collect()
    }

    /// The live hold `token` of `show`.
    pub async fn get(&self, show: &str, token: &str) -> Result<Hold, Error> {
        let token = self.check_token(show, token)?;
        match self.lookup(show, token, false).await? {
            Some(rec) if rec.found == 1 => Ok(Hold {
                hold_token: token.to_owned(),
                show: show.to_owned(),
                seats: rec.seats,
                expires_in_ms: rec.pttl,
                expires_at: iso_millis(rec.now_ms + rec.pttl),
                fence: rec.fence,
            }),
            _ => Err(Error::HoldNotFound),
        }
    }

    /// Sets the remaining time of hold `token` to `ttl_ms`.
    pub async fn extend(
        &self,
        show: &str,
        token: &str,
        ttl_ms: Option<u64>,
    ) -> Result<Hold, Error> {
        let token = self.check_token(show, token)?;
        let ttl = self.ttl(ttl_ms)?;
        let Some(rec) = self
            .lookup(show, token, false)
            .await?
            .filter(|r| r.found == 1)
        else {
            return Err(Error::HoldNotFound);
        };
        let mut key_list = vec![self.keys.hold_record(show, token)];
        key_list.extend(self.seat_keys(show, &rec.seats));
        let max = self.limits.max_hold_lifetime_ms;
        let reply: Vec<i64> = self
            .cluster
            .eval(&self.cluster.scripts().extend, &key_list, |c| {
                c.arg(token).arg(ttl).arg(max);
            })
            .await?;
        match reply.as_slice() {
            [1, fence, pttl, now] => {
                m_counter(m::EXTENDS, 1);
                Ok(Hold {
                    hold_token: token.to_owned(),
                    show: show.to_owned(),
                    seats: rec.seats,
                    expires_in_ms: *pttl,
                    expires_at: iso_millis(now + pttl),
                    fence: *fence,
                })
            }
            [0] => Err(Error::HoldNotFound),
            [-1, created, now] => Err(Error::LifetimeExceeded {
                max_ms: max,
                remaining_ms: i64::try_from(max).unwrap_or(i64::MAX) - (now - created),
            }),
            other => Err(Error::Internal(format!(
                "unexpected reply of extend.lua: {other:?}"
            ))),
        }
    }

    /// Releases hold `token`: its seats become free where they still carry it.
    pub async fn release(&self, show: &str, token: &str) -> Result<(), Error> {
        let token = self.check_token(show, token)?;
        let Some(rec) = self
            .lookup(show, token, false)
            .await?
            .filter(|r| r.found == 1)
        else {
            return Err(Error::HoldNotFound);
        };
        let mut key_list = vec![self.keys.hold_record(show, token)];
        key_list.extend(self.seat_keys(show, &rec.seats));
        let released: i64 = self
            .cluster
            .eval(&self.cluster.scripts().release, &key_list, |c| {
                c.arg(token);
            })
            .await?;
        if released == 1 {
            m_counter(m::RELEASES, 1);
            Ok(())
        } else {
            Err(Error::HoldNotFound)
        }
    }

    /// Sells hold `token`, then waits for replicas to have the sale.
    ///
    /// `WAIT` blocks the connection it is sent on and counts only that
    /// connection's writes, so the script and the `WAIT` go together over a
    /// dedicated connection to the slot's master, never over the shared one.
    pub async fn confirm(&self, show: &str, token: &str) -> Result<Confirmation, Error> {
        let token = self.check_token(show, token)?;
        let Some(rec) = self.lookup(show, token, true).await? else {
            return Err(Error::HoldNotFound);
        };
        let mut key_list = vec![
            self.keys.hold_record(show, token),
            self.keys.sale_record(show, token),
        ];
        key_list.extend(self.seat_keys(show, &rec.seats));
        let slot = keys::slot(key_list[0].as_bytes());
        let wait_for = self.limits.confirm_wait_replicas;
        let wait_ms = self.limits.confirm_wait_timeout_ms;

        let (first, fence, replicas) = self
            .cluster
            .bounded("confirm", async {
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    let addr = match self.cluster.topology().master_of(slot) {
                        Some(addr) => addr.to_owned(),
                        None => {
                            self.cluster.refresh_topology().await;
                            self.cluster
                                .topology()
                                .master_of(slot)
                                .map(str::to_owned)
                                .ok_or_else(|| {
                                    Error::RedisUnavailable(
                                        RedisFault::Cluster,
                                        format!("no master serves slot {slot}"),
                                    )
                                })?
                        }
                    };
                    let mut conn = self.cluster.dedicated(&addr).await?;
                    let reply: Result<Vec<i64>, redis::RedisError> = self
                        .cluster
                        .scripts()
                        .confirm
                        .run(&mut conn, &key_list, |c| {
                            c.arg(token);
                        })
                        .await;
                    let reply = match reply {
                        Ok(r) => r,
                        Err(e) if moved(&e) && attempt < 3 => {
                            // The slot moved (failover, resharding), or this
                            // node was demoted to replica: learn the new
                            // owner and try there.
                            self.cluster.forget(&addr);
                            self.cluster.refresh_topology().await;
                            continue;
                        }
                        Err(e) => {
                            // Its idle siblings are likely as dead as it is.
                            self.cluster.forget(&addr);
                            self.cluster.refresh_topology().await;
                            return Err(e.into());
                        }
                    };
                    let (first, fence) = match reply.as_slice() {
                        [0] => return Err(Error::HoldNotFound),
                        [state @ (1 | 2), fence] => (*state == 1, *fence),
                        other => {
                            return Err(Error::Internal(format!(
                                "unexpected reply of confirm.lua: {other:?}"
                            )))
                        }
                    };
                    let replicas: i64 = if wait_for > 0 {
                        redis::cmd("WAIT")
                            .arg(wait_for)
                            .arg(wait_ms)
                            .query_async(&mut conn)
                            .await?
                    } else {
                        0
                    };
                    self.cluster.give_back(&addr, conn);
                    return Ok((first, fence, replicas));
                }
            })
            .await?;

        if first {
            m_counter(m::CONFIRMS, 1);
        }
        let confirmation = Confirmation {
            hold_token: token.to_owned(),
            show: show.to_owned(),
            seats: serde_json::to_value(&rec.seats).unwrap_or_default(),
            fence,
            replicas,
        };
        if replicas < i64::from(wait_for) {
            m_counter(m::CONFIRMS_NOT_REPLICATED, 1);
            tracing::warn!(%show, replicas, wanted = wait_for, "confirm not replicated in time");
            return Err(Error::NotReplicated(confirmation));
        }
        Ok(confirmation)
    }

    /// The states of `seats` of `show`.
    pub async fn seat_states(&self, show: &str, seats: &[&str]) -> Result<Vec<SeatState>, Error> {
        if !keys::valid_id(show) {
            return Err(Error::InvalidShow);
        }
        if seats.is_empty() {
            return Err(Error::InvalidRequest("name at least one seat".into()));
        }
        if seats.iter().any(|s| !keys::valid_id(s)) {
            return Err(Error::InvalidSeat);
        }
        if seats.len() > self.limits.max_seats_per_hold {
            return Err(Error::TooManySeats(self.limits.max_seats_per_hold));
        }
        let key_list: Vec<String> = seats.iter().map(|s| self.keys.seat(show, s)).collect();
        let reply: Vec<i64> = self
            .cluster
            .eval(&self.cluster.scripts().seats, &key_list, |_| {})
            .await?;
        if reply.len() != 2 * seats.len() {
            return Err(Error::Internal("bad reply of seats.lua".into()));
        }
        Ok(reply
            .chunks_exact(2)
            .map(|c| SeatState {
                show: None,
                seat: None,
                state: match c[0] {
                    0 => "free",
                    2 => "sold",
                    _ => "held",
                },
                expires_in_ms: (c[0] == 1 && c[1] >= 0).then_some(c[1]),
            })
            .collect())
    }
}

/// Whether `err` says the slot is now served elsewhere.
fn moved(err: &redis::RedisError) -> bool {
    err.redirect_node().is_some()
        || err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

fn m_counter(name: &'static str, by: u64) {
    metrics::counter!(name).increment(by);
}

/// `2026-11-30T12:00:00.000Z` for a Unix time in milliseconds.
///
/// The calendar arithmetic is the `time` crate's; the digits are written
/// here, because `OffsetDateTime::format` interprets its format description
/// on every call and was 4% of the daemon's instructions per hold
/// (callgrind). The test checks it against `format` over a wide range.
pub fn iso_millis(ms: i64) -> String {
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000) else {
        return String::new();
    };
    let (year, month, day) = t.to_calendar_date();
    let (hour, minute, second, milli) = t.to_hms_milli();
    if !(0..=9999).contains(&year) {
        return String::new();
    }
    let mut out = [0u8; 24];
    let mut put = |at: usize, value: u32, digits: usize| {
        let mut v = value;
        for i in (at..at + digits).rev() {
            out[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, year.unsigned_abs(), 4);
    put(5, u32::from(u8::from(month)), 2);
    put(8, u32::from(day), 2);
    put(11, u32::from(hour), 2);
    put(14, u32::from(minute), 2);
    put(17, u32::from(second), 2);
    put(20, u32::from(milli), 3);
    for (at, sep) in [
        (4, b'-'),
        (7, b'-'),
        (10, b'T'),
        (13, b':'),
        (16, b':'),
        (19, b'.'),
        (23, b'Z'),
    ] {
        out[at] = sep;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso() {
        assert_eq!(iso_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_millis(1_796_040_000_123), "2026-11-30T12:00:00.123Z");
        // Against the time crate's own formatter, from 1970 to 9999, with a
        // stride that visits every millisecond digit, second, hour, leap day.
        let format = time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
        );
        let mut ms: i64 = 0;
        while ms < 253_402_300_799_999 {
            let want = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .unwrap()
                .format(&format)
                .unwrap();
            assert_eq!(iso_millis(ms), want, "at {ms} ms");
            ms += 2_718_281_829;
        }
    }

    #[test]
    fn seats_roundtrip() {
        let s = Seats::Show(vec!["E7".into(), "E8".into()]);
        assert_eq!(s.encode("42"), "42/E7 42/E8");
        assert_eq!(Seats::decode("s", "42/E7 42/E8", "42"), Some(s));
        let m = Seats::Multi(vec![
            SeatRef {
                show: "42".into(),
                seat: "E7".into(),
            },
            SeatRef {
                show: "43".into(),
                seat: "A1".into(),
            },
        ]);
        assert_eq!(Seats::decode("m", &m.encode("42"), "42"), Some(m));
        assert_eq!(Seats::decode("s", "42/E7 43/E8", "42"), None);
    }
}
