//! Every body the API answers with, typed, each built by one constructor.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::ids::{HoldToken, SeatId, ShowId};

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

    /// The record form: `show/seat` joined by spaces.
    pub fn encode(&self, home: &ShowId) -> String {
        let mut out = String::with_capacity(self.len() * 16);
        for (i, (show, seat)) in self.pairs(home).enumerate() {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(show.as_str());
            out.push('/');
            out.push_str(seat.as_str());
        }
        out
    }

    /// Reads the record form back; `None` when it is not one.
    pub fn decode(kind: &str, encoded: &str, home: &ShowId) -> Option<Self> {
        let mut pairs = Vec::new();
        for item in encoded.split(' ') {
            let (show, seat) = item.split_once('/')?;
            pairs.push((ShowId::parse(show).ok()?, SeatId::parse(seat).ok()?));
        }
        match kind {
            "s" if pairs.iter().all(|(s, _)| s == home) => Some(Self::Show(
                pairs.into_iter().map(|(_, seat)| seat).collect(),
            )),
            "m" => Some(Self::Multi(
                pairs
                    .into_iter()
                    .map(|(show, seat)| SeatRef { show, seat })
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
    pub hold_token: HoldToken,
    pub show: ShowId,
    pub seats: Seats,
    pub expires_in_ms: i64,
    pub expires_at: String,
    pub fence: i64,
}

impl Hold {
    /// A hold whose remaining time `pttl` was read at Redis time `now_ms`.
    pub fn new(
        hold_token: HoldToken,
        show: ShowId,
        seats: Seats,
        fence: i64,
        pttl: i64,
        now_ms: i64,
    ) -> Self {
        Self {
            hold_token,
            show,
            seats,
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

/// The slot of one seat of a refused cross-slot hold.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SeatSlot {
    pub show: ShowId,
    pub seat: SeatId,
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
    fn seats_roundtrip() {
        let home = id(ShowId::parse, "42");
        let s = Seats::Show(vec![id(SeatId::parse, "E7"), id(SeatId::parse, "E8")]);
        assert_eq!(s.encode(&home), "42/E7 42/E8");
        assert_eq!(Seats::decode("s", "42/E7 42/E8", &home), Some(s));
        let m = Seats::Multi(vec![
            SeatRef {
                show: id(ShowId::parse, "42"),
                seat: id(SeatId::parse, "E7"),
            },
            SeatRef {
                show: id(ShowId::parse, "43"),
                seat: id(SeatId::parse, "A1"),
            },
        ]);
        assert_eq!(Seats::decode("m", &m.encode(&home), &home), Some(m));
        assert_eq!(Seats::decode("s", "42/E7 43/E8", &home), None);
    }
}
