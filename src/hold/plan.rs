//! What a write script needs besides its own keys: the keys and arguments
//! of the hold's pools, holder and events (the "tail" every write script
//! takes in the same order), and the small readers of script replies.

use std::collections::BTreeMap;

use redis::{Cmd, Value};

use super::Service;
use crate::error::Error;
use crate::ids::{HoldToken, SeatId, ShowId};
use crate::keys;
use crate::metrics as m;
use crate::model::{Contents, PoolUnits, SeatSlot, Shortfall, ShowPart, State, Taken};

/// The tail of a write script, for one hold: per pool (its hash and holds),
/// per show with a holder (its settings for hold.lua, the holder's holds and
/// bought units), per show with events (deadline index and stream).
pub(super) struct Tail {
    pub keys: Vec<String>,
    /// Shows with events (0 with events off).
    events: usize,
    max_len: u64,
    hold_ref: String,
    /// Per show with events: its items ("E7 @floor=2").
    items: Vec<String>,
    /// Per pool: the units held.
    quantities: Vec<u32>,
    /// Per show with a holder: its units.
    units: Vec<u64>,
}

impl Tail {
    /// The tail of the hold `token` of `home` with `contents`; hold.lua also
    /// reads each show's settings (`with_settings`).
    pub fn new(
        service: &Service,
        home: &ShowId,
        contents: &Contents,
        token: &HoldToken,
        with_settings: bool,
    ) -> Self {
        let ks = &service.keys;
        // In show-id order: every script of a hold names its shows alike,
        // and sweep.lua counts a hold of several shows by that order.
        let parts: BTreeMap<ShowId, ShowPart> = contents.by_show(home);
        let mut keys = Vec::new();
        for p in &contents.pools {
            keys.push(ks.pool(&p.show, p.pool.as_str()));
            keys.push(ks.pool_holds(&p.show, p.pool.as_str()));
        }
        let mut units = Vec::new();
        if let Some(holder) = &contents.holder {
            for (show, part) in &parts {
                if with_settings {
                    keys.push(ks.settings(show));
                }
                keys.push(ks.holder(show, holder.as_str()));
                keys.push(ks.holder_sold(show, holder.as_str()));
                units.push(part.units());
            }
        }
        let max_len = service.limits.events_max_len;
        let mut items = Vec::new();
        if max_len.is_some() {
            for (show, part) in &parts {
                keys.push(ks.deadlines(show));
                keys.push(ks.events(show));
                items.push(part.items());
            }
        }
        Self {
            keys,
            events: items.len(),
            max_len: max_len.unwrap_or(0),
            hold_ref: token.hold_ref(),
            items,
            quantities: contents.pools.iter().map(|p| p.quantity).collect(),
            units,
        }
    }

    /// `E`, the cap, the ref, `P`, `H`, then items, quantities and units:
    /// the argument tail of release, extend, confirm and abandon.
    pub fn push(&self, cmd: &mut Cmd) {
        cmd.arg(self.events)
            .arg(self.max_len)
            .arg(&self.hold_ref)
            .arg(self.quantities.len())
            .arg(self.units.len());
        self.push_lists(cmd);
    }

    /// hold.lua's tail: `E`, the cap, the ref, `S`, `P`, `H`, the default
    /// holder limit, then items, quantities and units.
    pub fn push_for_hold(&self, cmd: &mut Cmd, seats: usize, holder_limit: u64) {
        cmd.arg(self.events)
            .arg(self.max_len)
            .arg(&self.hold_ref)
            .arg(seats)
            .arg(self.quantities.len())
            .arg(self.units.len())
            .arg(holder_limit);
        self.push_lists(cmd);
    }

    /// Whether hold.lua takes this hold in its short form: one seat (so
    /// one show), no pools, no holder, and that show's events or fence
    /// counter (`fences`).
    pub fn fits_short_form(&self, seats: usize, fences: usize) -> bool {
        seats == 1
            && self.quantities.is_empty()
            && self.units.is_empty()
            && self.events + fences == 1
    }

    /// hold.lua's short form after the token and TTL: events on or off,
    /// the record's tail (`<kind> <items>`), the ref, the seat, the cap,
    /// then the fingerprint and record TTL of an idempotency key, if any.
    /// Every argument costs the master about 700 instructions, whatever the
    /// script does with it (see hold.lua).
    pub fn push_for_single_seat(
        &self,
        cmd: &mut Cmd,
        kind: &str,
        items: &str,
        idem: Option<(&str, u64)>,
    ) {
        cmd.arg(if self.events > 0 { "1" } else { "0" })
            .arg(format!("{kind} {items}"))
            .arg(&self.hold_ref)
            .arg(self.items.first().map_or("", String::as_str))
            .arg(self.max_len);
        if let Some((fingerprint, ttl_ms)) = idem {
            cmd.arg(fingerprint).arg(ttl_ms);
        }
    }

    fn push_lists(&self, cmd: &mut Cmd) {
        for items in &self.items {
            cmd.arg(items);
        }
        for q in &self.quantities {
            cmd.arg(q);
        }
        for u in &self.units {
            cmd.arg(u);
        }
    }

    /// Counts the events of type `kind` the script wrote, one per show.
    pub fn count_events(&self, kind: &'static str) {
        if self.events > 0 {
            m::hot::count(m::EVENTS, &[("type", kind)], self.events as u64);
        }
    }
}

/// The integers of a script's reply (numbers or digits), or `None` when
/// one element is neither.
pub(super) fn ints(reply: &[Value]) -> Option<Vec<i64>> {
    reply
        .iter()
        .map(|v| match v {
            Value::Int(i) => Some(*i),
            // hold.lua's single-seat path answers digits (see there).
            Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        })
        .collect()
}

/// A reply's string element (a record).
pub(super) fn text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::BulkString(b)) => String::from_utf8(b.clone()).ok(),
        Some(Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The `{-3, record}` reply of a write script whose idempotency record
/// already exists.
pub(super) fn replay_of(reply: &[Value]) -> Option<(String, Option<i64>)> {
    match reply {
        [Value::Int(-3), record] => Some((text(Some(record))?, None)),
        [Value::Int(-3), record, Value::Int(now)] => Some((text(Some(record))?, Some(*now))),
        _ => None,
    }
}

/// The seats a conflict names: the scripts answer `(index, state, pttl)`
/// triples, the index 1-based into `pairs`.
pub(super) fn taken(triples: &[i64], pairs: &[(&ShowId, &SeatId)], multi: bool) -> Vec<Taken> {
    triples
        .chunks_exact(3)
        .filter_map(|c| {
            let (show, seat) = pairs.get(usize::try_from(c[0]).ok()?.checked_sub(1)?)?;
            let show = multi.then(|| (*show).clone());
            Some(Taken::new(
                show,
                (*seat).clone(),
                State::from_reply(c[1], c[2]),
            ))
        })
        .collect()
}

/// The 409 a write script's refusal stands for, counted: `{0, seat
/// triples}` (taken seats), `{-5, n, n seat values, pool triples (index,
/// requested, available)}` (short pools, maybe taken seats too), `{-6,
/// limit, current, requested}` (past the holder limit). `None` for any
/// other reply. `pairs` and `pools` are what the triples' indexes count.
pub(super) fn refusal(
    reply: &[i64],
    pairs: &[(&ShowId, &SeatId)],
    pools: &[PoolUnits],
    multi: bool,
) -> Option<Error> {
    let err = match reply {
        [0, rest @ ..] if !rest.is_empty() && rest.len() % 3 == 0 => {
            Error::SeatsTaken(taken(rest, pairs, multi), Vec::new())
        }
        [-5, n, rest @ ..] => {
            let n = usize::try_from(*n).ok()?.min(rest.len());
            let (seats, short) = rest.split_at(n);
            let short: Vec<Shortfall> = short
                .chunks_exact(3)
                .filter_map(|c| {
                    let p = pools.get(usize::try_from(c[0]).ok()?.checked_sub(1)?)?;
                    Some(Shortfall {
                        show: multi.then(|| p.show.clone()),
                        pool: p.pool.clone(),
                        requested: u32::try_from(c[1]).ok()?,
                        available: c[2],
                    })
                })
                .collect();
            if seats.is_empty() {
                Error::PoolExhausted(short)
            } else {
                Error::SeatsTaken(taken(seats, pairs, multi), short)
            }
        }
        [-6, limit, current, requested] => {
            metrics::counter!(m::HOLDER_LIMIT_REJECTIONS).increment(1);
            Error::HolderLimit {
                limit: *limit,
                current: *current,
                requested: *requested,
            }
        }
        _ => return None,
    };
    m::hot::count(m::HOLD_CONFLICTS, &[], 1);
    Some(err)
}

/// Refuses a hold whose shows do not share one hash slot, naming the slot
/// of every seat and pool. Every key of a hold carries one of its shows'
/// tags, so the shows decide; the keys of the home show share its tag, so
/// only other shows' slots are computed (most holds name none).
pub(super) fn check_one_slot(home: &ShowId, contents: &Contents) -> Result<(), Error> {
    let slot = |show: &ShowId| keys::slot(format!("{{show:{show}}}").as_bytes());
    let mut first = None;
    let seats = contents.seats.pairs(home).map(|(show, _)| show);
    let pools = contents.pools.iter().map(|p| &p.show);
    if seats
        .chain(pools)
        .all(|show| show == home || *first.get_or_insert_with(|| slot(home)) == slot(show))
    {
        return Ok(());
    }
    metrics::counter!(m::CROSS_SLOT_REJECTIONS).increment(1);
    let mut detail: Vec<SeatSlot> = contents
        .seats
        .pairs(home)
        .map(|(show, seat)| SeatSlot {
            show: show.clone(),
            seat: Some(seat.clone()),
            pool: None,
            slot: slot(show),
        })
        .collect();
    detail.extend(contents.pools.iter().map(|p| SeatSlot {
        show: p.show.clone(),
        seat: None,
        pool: Some(p.pool.clone()),
        slot: slot(&p.show),
    }));
    Err(Error::CrossSlot(detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn ints_reads_numbers_and_digits_alike() {
        // hold.lua's single-seat path answers {1, fence, ttl, created} as
        // digits; the general path answers numbers.
        let digits = [
            Value::Int(1),
            bulk("1764633600123004"),
            bulk("300000"),
            bulk("1764633600123"),
        ];
        assert_eq!(
            ints(&digits),
            Some(vec![1, 1_764_633_600_123_004, 300_000, 1_764_633_600_123])
        );
        assert_eq!(ints(&[Value::Int(-4)]), Some(vec![-4]));
        assert_eq!(ints(&[bulk("-6")]), Some(vec![-6]));
    }

    #[test]
    fn ints_refuses_anything_else() {
        // {-3, <idempotency record>}: the record is not an integer.
        assert_eq!(ints(&[Value::Int(-3), bulk("fp 201 t 1 2")]), None);
        assert_eq!(ints(&[bulk("12x")]), None);
        assert_eq!(ints(&[bulk("")]), None);
        assert_eq!(ints(&[Value::Nil]), None);
    }
}
