//! Every body the API answers with, typed, each built by one constructor.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::ids::{HoldToken, HolderId, PoolId, SeatId, ShowId};

/// One seat of a multi-show hold: `{"show":…,"seat":…}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SeatRef {
    pub show: ShowId,
    pub seat: SeatId,
}

/// The seats of a hold, shaped as the route that made it answers them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Seats {
    /// Made under `/v1/shows/{show}/…`: seat ids of the home show.
    Show(Vec<SeatId>),
    /// Made with `POST /v1/holds`: `{show, seat}` pairs.
    Multi(Vec<SeatRef>),
}

impl Seats {
    /// Number of seats.
    pub fn len(&self) -> usize {
        match self {
            Self::Show(s) => s.len(),
            Self::Multi(s) => s.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(show, seat)` of every seat, in order.
    pub fn pairs<'a>(
        &'a self,
        home: &'a ShowId,
    ) -> impl Iterator<Item = (&'a ShowId, &'a SeatId)> + 'a {
        // One of the two slices is empty; chaining them avoids boxing.
        let (plain, multi): (&[SeatId], &[SeatRef]) = match self {
            Self::Show(seats) => (seats, &[]),
            Self::Multi(seats) => (&[], seats),
        };
        plain
            .iter()
            .map(move |seat| (home, seat))
            .chain(multi.iter().map(|r| (&r.show, &r.seat)))
    }

    /// Whether the seats name their shows (made with `POST /v1/holds`).
    pub fn is_multi(&self) -> bool {
        matches!(self, Self::Multi(_))
    }

    /// The record's kind letter: `s` or `m`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Show(_) => "s",
            Self::Multi(_) => "m",
        }
    }
}

/// Units of one pool in a hold: `{"show":…,"pool":…,"quantity":…}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolUnits {
    pub show: ShowId,
    pub pool: PoolId,
    pub quantity: u32,
}

/// The pool units of a hold, shaped as the route that made it answers
/// them: `{"floor":2}` under `/v1/shows/{show}/…`, a list for `POST /v1/holds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Pools {
    Show(BTreeMap<PoolId, u32>),
    Multi(Vec<PoolUnits>),
}

impl Pools {
    pub fn is_empty(&self) -> bool {
        match self {
            Self::Show(p) => p.is_empty(),
            Self::Multi(p) => p.is_empty(),
        }
    }
}

/// One show's part of a hold: its seats and pool units.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShowPart {
    pub seats: Vec<SeatId>,
    pub pools: Vec<(PoolId, u32)>,
}

impl ShowPart {
    /// Seats plus pool units.
    pub fn units(&self) -> u64 {
        self.seats.len() as u64 + self.pools.iter().map(|(_, q)| u64::from(*q)).sum::<u64>()
    }

    /// The part as events and deadline entries name it: seat ids and
    /// `@pool=quantity`, joined with spaces.
    pub fn items(&self) -> String {
        let mut out: Vec<String> = self.seats.iter().map(|s| s.to_string()).collect();
        out.extend(self.pools.iter().map(|(p, q)| format!("@{p}={q}")));
        out.join(" ")
    }
}

/// What a hold holds: seats, pool units, and the holder it counts against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    pub seats: Seats,
    pub pools: Vec<PoolUnits>,
    pub holder: Option<HolderId>,
}

impl Contents {
    /// Seats only, for no holder.
    pub fn seats(seats: Seats) -> Self {
        Self {
            seats,
            pools: Vec::new(),
            holder: None,
        }
    }

    /// Seats plus pool units.
    pub fn units(&self) -> u64 {
        self.seats.len() as u64
            + self
                .pools
                .iter()
                .map(|p| u64::from(p.quantity))
                .sum::<u64>()
    }

    /// Whether it holds nothing at all.
    pub fn is_empty(&self) -> bool {
        self.units() == 0
    }

    /// The pools as the route answers them.
    pub fn pools_view(&self) -> Pools {
        match self.seats {
            Seats::Show(_) => Pools::Show(
                self.pools
                    .iter()
                    .map(|p| (p.pool.clone(), p.quantity))
                    .collect(),
            ),
            Seats::Multi(_) => Pools::Multi(self.pools.clone()),
        }
    }

    /// Every involved show (sorted) with its part.
    pub fn by_show(&self, home: &ShowId) -> BTreeMap<ShowId, ShowPart> {
        let mut parts: BTreeMap<ShowId, ShowPart> = BTreeMap::new();
        for (show, seat) in self.seats.pairs(home) {
            parts
                .entry(show.clone())
                .or_default()
                .seats
                .push(seat.clone());
        }
        for p in &self.pools {
            parts
                .entry(p.show.clone())
                .or_default()
                .pools
                .push((p.pool.clone(), p.quantity));
        }
        parts
    }

    /// The record's kind: `s` or `m`, and `|<holder>` when there is one.
    pub fn kind(&self) -> String {
        match &self.holder {
            Some(h) => format!("{}|{}", self.seats.kind(), h.as_str()),
            None => self.seats.kind().to_owned(),
        }
    }

    /// The record form: `show/seat` and `show/@pool=quantity`, joined by
    /// spaces.
    pub fn encode(&self, home: &ShowId) -> String {
        // One item per seat and per pool (not per unit: a pool's quantity
        // may be up to u32::MAX, and 16 bytes each would ask for 64 GiB).
        let mut out = String::with_capacity((self.seats.len() + self.pools.len()) * 24);
        let mut push = |item: std::fmt::Arguments<'_>| {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(&item.to_string());
        };
        for (show, seat) in self.seats.pairs(home) {
            push(format_args!("{show}/{seat}"));
        }
        for p in &self.pools {
            push(format_args!("{}/@{}={}", p.show, p.pool, p.quantity));
        }
        out
    }

    /// Reads the record form back; `None` when it is not one.
    pub fn decode(kind: &str, encoded: &str, home: &ShowId) -> Option<Self> {
        let (kind, holder) = match kind.split_once('|') {
            Some((k, h)) => (k, Some(HolderId::parse(h).ok()?)),
            None => (kind, None),
        };
        let mut seats = Vec::new();
        let mut pools = Vec::new();
        for item in encoded.split(' ').filter(|i| !i.is_empty()) {
            let (show, rest) = item.split_once('/')?;
            let show = ShowId::parse(show).ok()?;
            match rest.strip_prefix('@') {
                Some(units) => {
                    let (pool, quantity) = units.split_once('=')?;
                    pools.push(PoolUnits {
                        show,
                        pool: PoolId::parse(pool).ok()?,
                        quantity: quantity.parse().ok()?,
                    });
                }
                None => seats.push((show, SeatId::parse(rest).ok()?)),
            }
        }
        let seats = match kind {
            "s" if seats.iter().all(|(s, _)| s == home) => {
                Seats::Show(seats.into_iter().map(|(_, seat)| seat).collect())
            }
            "m" => Seats::Multi(
                seats
                    .into_iter()
                    .map(|(show, seat)| SeatRef { show, seat })
                    .collect(),
            ),
            _ => return None,
        };
        Some(Self {
            seats,
            pools,
            holder,
        })
    }
}

/// A pool's figures: `GET /v1/shows/{show}/pools/{pool}`.
#[derive(Debug, Clone, Serialize)]
pub struct Pool {
    pub show: ShowId,
    pub pool: PoolId,
    pub capacity: i64,
    pub held: i64,
    pub sold: i64,
    pub available: i64,
}

impl Pool {
    pub fn new(show: ShowId, pool: PoolId, capacity: i64, held: i64, sold: i64) -> Self {
        Self {
            show,
            pool,
            capacity,
            held,
            sold,
            available: (capacity - held - sold).max(0),
        }
    }
}

/// A show's settings: `PUT /v1/shows/{show}/settings`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    pub show: ShowId,
    pub max_per_holder: u64,
}

/// A pool a hold could not take enough units of.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Shortfall {
    /// Set for holds made with `POST /v1/holds`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show: Option<ShowId>,
    pub pool: PoolId,
    pub requested: u32,
    pub available: i64,
}

/// A live hold, as the API answers it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    pub hold_token: HoldToken,
    pub show: ShowId,
    pub seats: Seats,
    #[serde(skip_serializing_if = "Pools::is_empty")]
    pub pools: Pools,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<HolderId>,
    pub expires_in_ms: i64,
    pub expires_at: String,
    pub fence: i64,
}

impl Hold {
    /// A hold whose remaining time `pttl` was read at Redis time `now_ms`.
    pub fn new(
        hold_token: HoldToken,
        show: ShowId,
        contents: Contents,
        fence: i64,
        pttl: i64,
        now_ms: i64,
    ) -> Self {
        Self {
            hold_token,
            show,
            pools: contents.pools_view(),
            holder: contents.holder,
            seats: contents.seats,
            expires_in_ms: pttl,
            expires_at: iso_millis(now_ms + pttl),
            fence,
        }
    }
}

/// A seat's state as the seat scripts report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Free,
    /// With its remaining time, when Redis knows it.
    Held(Option<i64>),
    Sold,
}

impl State {
    /// From a script's `(state, pttl)` pair: 0 free, 1 held, 2 sold.
    pub fn from_reply(state: i64, pttl: i64) -> Self {
        match state {
            0 => Self::Free,
            2 => Self::Sold,
            _ => Self::Held((pttl >= 0).then_some(pttl)),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Held(_) => "held",
            Self::Sold => "sold",
        }
    }

    fn expires_in_ms(self) -> Option<i64> {
        match self {
            Self::Held(pttl) => pttl,
            _ => None,
        }
    }
}

/// The state of one seat: `GET /v1/shows/{show}/seats/{seat}` (with
/// `show`), one entry of the batch form (without), or one seat of a
/// conflict's `taken` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SeatState {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show: Option<ShowId>,
    pub seat: SeatId,
    /// `free`, `held` or `sold`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<i64>,
}

impl SeatState {
    pub fn new(show: Option<ShowId>, seat: SeatId, state: State) -> Self {
        Self {
            show,
            seat,
            state: state.name(),
            expires_in_ms: state.expires_in_ms(),
        }
    }
}

/// The batch form: `{"show":…,"seats":{"E7":{…},…}}`.
#[derive(Debug, Clone, Serialize)]
pub struct SeatStates {
    pub show: ShowId,
    pub seats: BTreeMap<SeatId, SeatState>,
}

impl SeatStates {
    pub fn new(show: ShowId, states: impl IntoIterator<Item = SeatState>) -> Self {
        Self {
            show,
            seats: states.into_iter().map(|s| (s.seat.clone(), s)).collect(),
        }
    }
}

/// A seat that a hold could not take: its state, `held` or `sold`, with
/// `show` for holds made with `POST /v1/holds`.
pub type Taken = SeatState;

/// The slot of one seat (or pool) of a refused cross-slot hold.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SeatSlot {
    pub show: ShowId,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seat: Option<SeatId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    pub slot: u16,
}

/// A confirmation, sent with 200 or, when replication fell short, inside the
/// 503 `not_replicated` body.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Confirmation {
    pub hold_token: HoldToken,
    pub show: ShowId,
    pub seats: Seats,
    #[serde(skip_serializing_if = "Pools::is_empty")]
    pub pools: Pools,
    pub fence: i64,
    pub replicas: i64,
}

/// `{"status":…}` of the health routes, with `reason` when not ready.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Health {
    pub fn up(status: &'static str) -> Self {
        Self {
            status,
            reason: None,
        }
    }

    pub fn not_ready(reason: String) -> Self {
        Self {
            status: "not_ready",
            reason: Some(reason),
        }
    }
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

    fn id<T>(parse: fn(&str) -> Result<T, crate::error::Error>, s: &str) -> T {
        parse(s).expect("a valid id")
    }

    #[test]
    fn contents_roundtrip() {
        let home = id(ShowId::parse, "42");
        let s = Contents::seats(Seats::Show(vec![
            id(SeatId::parse, "E7"),
            id(SeatId::parse, "E8"),
        ]));
        assert_eq!(s.encode(&home), "42/E7 42/E8");
        assert_eq!(Contents::decode("s", "42/E7 42/E8", &home), Some(s));
        let m = Contents {
            seats: Seats::Multi(vec![
                SeatRef {
                    show: id(ShowId::parse, "42"),
                    seat: id(SeatId::parse, "E7"),
                },
                SeatRef {
                    show: id(ShowId::parse, "43"),
                    seat: id(SeatId::parse, "A1"),
                },
            ]),
            pools: vec![PoolUnits {
                show: id(ShowId::parse, "43"),
                pool: id(PoolId::parse, "floor"),
                quantity: 3,
            }],
            holder: Some(id(HolderId::parse, "al@x:1")),
        };
        assert_eq!(m.encode(&home), "42/E7 43/A1 43/@floor=3");
        assert_eq!(m.kind(), "m|al@x:1");
        assert_eq!(
            Contents::decode(&m.kind(), &m.encode(&home), &home),
            Some(m.clone())
        );
        let parts = m.by_show(&home);
        assert_eq!(parts[&id(ShowId::parse, "43")].items(), "A1 @floor=3");
        assert_eq!(parts[&id(ShowId::parse, "43")].units(), 4);
        assert_eq!(Contents::decode("s", "42/E7 43/E8", &home), None);
    }
}
