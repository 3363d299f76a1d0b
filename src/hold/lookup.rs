//! Reading a hold (or its sale) back by token: `lua/lookup.lua`.

use redis::Value;

use super::plan::text;
use super::Service;
use crate::cluster::Deadline;
use crate::error::Error;
use crate::idempotency::Idem;
use crate::ids::{HoldToken, ShowId};
use crate::model::Contents;

/// A hold or sale record read back from Redis.
pub(super) struct Record {
    pub pttl: i64,
    pub now_ms: i64,
    pub contents: Contents,
    pub fence: i64,
}

/// What `lookup.lua` found under a token.
pub(super) enum Found {
    Nothing,
    /// A live hold.
    Hold(Record),
    /// A confirmed hold (only when the sale record was asked for).
    Sale(Record),
}

/// A lookup's answer: the hold, Redis's clock, and the idempotency record
/// of the request, if one was asked for and exists.
pub(super) struct Lookup {
    pub found: Found,
    pub now_ms: i64,
    pub recorded: Option<String>,
}

impl Service {
    /// Reads the hold `token` (and its sale, with `with_sale`), and the
    /// record under `idem`'s key when given.
    pub(super) async fn lookup(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
        idem: Option<&Idem>,
        with_sale: bool,
    ) -> Result<Lookup, Error> {
        let mut key_list = vec![
            self.keys.hold_record(show, token),
            self.keys.sale_record(show, token),
        ];
        key_list.extend(self.idem_args(show, idem).0);
        let reply: Vec<Value> = self
            .cluster
            .eval(deadline, &self.cluster.scripts().lookup, &key_list, |c| {
                c.arg(if with_sale { "1" } else { "0" });
            })
            .await?;
        let int = |v: Option<&Value>| match v {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        };
        let unreadable = || Error::Internal(format!("unreadable reply of lookup.lua for {show}"));
        let found = int(reply.first()).ok_or_else(unreadable)?;
        let now_ms = int(reply.get(2)).ok_or_else(unreadable)?;
        let recorded = text(reply.get(4));
        if found == 0 {
            return Ok(Lookup {
                found: Found::Nothing,
                now_ms,
                recorded,
            });
        }
        let raw = text(reply.get(3)).ok_or_else(unreadable)?;
        let (fence, contents) = parse_record(&raw, show).ok_or_else(unreadable)?;
        let record = Record {
            pttl: int(reply.get(1)).unwrap_or(-1),
            now_ms,
            contents,
            fence,
        };
        let found = if found == 1 {
            Found::Hold(record)
        } else {
            Found::Sale(record)
        };
        Ok(Lookup {
            found,
            now_ms,
            recorded,
        })
    }

    /// The live hold record of `token`, or 404.
    pub(super) async fn live(
        &self,
        deadline: &Deadline,
        show: &ShowId,
        token: &HoldToken,
    ) -> Result<Record, Error> {
        match self.lookup(deadline, show, token, None, false).await?.found {
            Found::Hold(rec) => Ok(rec),
            _ => Err(Error::HoldNotFound),
        }
    }
}

/// A record `<fence> <created_ms> <kind> <items>` (see `lua/hold.lua`).
pub(super) fn parse_record(raw: &str, home: &ShowId) -> Option<(i64, Contents)> {
    let mut parts = raw.splitn(4, ' ');
    let (Some(fence), Some(_created), Some(kind), Some(items)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    Some((fence.parse().ok()?, Contents::decode(kind, items, home)?))
}
