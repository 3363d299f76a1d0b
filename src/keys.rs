//! Identifier rules, the key schema and Redis Cluster hash slots.
//!
//! Every key seathold writes for a show carries the hash tag `{show:<id>}`,
//! so all of one show's keys live in one slot and a Lua script may touch them
//! together. Seat keys are exactly the reference article's
//! `<prefix>{show:<show>}:<seat>`; every other key continues the tag with `#`
//! instead of `:`, so it can never equal a seat key of any valid seat id.

use std::fmt::Write as _;

use crate::ids::valid_id;

/// Number of hash slots in a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// Default key prefix, the reference article's.
pub const DEFAULT_PREFIX: &str = "seat-hold:";

/// Value prefix that marks a sold seat. A hold token is a UUID and can never
/// start with it.
pub const SOLD_PREFIX: &str = "sold:";

/// Whether `prefix` can serve as a key prefix: braces would change the hash
/// tag of every key, so they are refused.
pub fn valid_prefix(prefix: &str) -> bool {
    !prefix.contains(['{', '}'])
}

/// The hash slot Redis Cluster assigns to `key`: CRC16/XMODEM of the hash tag
/// (the bytes between the first `{` and the first `}` after it, when that is
/// not empty), else of the whole key, modulo 16384.
pub fn slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16::State::<crc16::XMODEM>::calculate(hashed) % SLOTS
}

/// Builds the keys of one deployment (one key prefix).
#[derive(Debug, Clone)]
pub struct KeySpace {
    prefix: String,
}

impl KeySpace {
    /// A key space with the given prefix; the caller has checked it with
    /// [`valid_prefix`].
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// The configured prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn tagged(&self, show: &str, extra: usize) -> String {
        let mut key = String::with_capacity(self.prefix.len() + show.len() + 8 + extra);
        key.push_str(&self.prefix);
        key.push_str("{show:");
        key.push_str(show);
        key.push('}');
        key
    }

    /// `<prefix>{show:<show>}:<seat>`: holds the token while held (with the
    /// hold's TTL), `sold:<token>` without TTL once sold.
    pub fn seat<S: AsRef<str> + ?Sized, T: AsRef<str> + ?Sized>(
        &self,
        show: &S,
        seat: &T,
    ) -> String {
        let (show, seat) = (show.as_ref(), seat.as_ref());
        let mut key = self.tagged(show, seat.len() + 1);
        key.push(':');
        key.push_str(seat);
        key
    }

    /// `<prefix>{show:<show>}#<kind>:<token>`: a record of one hold.
    fn record(&self, show: &str, kind: &str, token: &str) -> String {
        let mut key = self.tagged(show, kind.len() + token.len() + 2);
        key.push('#');
        key.push_str(kind);
        key.push(':');
        key.push_str(token);
        key
    }

    /// `<prefix>{show:<show>}#hold:<token>`: the hold record, under the
    /// hold's home show, with the hold's TTL.
    pub fn hold_record(
        &self,
        show: &(impl AsRef<str> + ?Sized),
        token: &(impl AsRef<str> + ?Sized),
    ) -> String {
        self.record(show.as_ref(), "hold", token.as_ref())
    }

    /// `<prefix>{show:<show>}#sale:<token>`: the record of a confirmed hold,
    /// kept without TTL so a repeated confirm answers the same.
    pub fn sale_record(
        &self,
        show: &(impl AsRef<str> + ?Sized),
        token: &(impl AsRef<str> + ?Sized),
    ) -> String {
        self.record(show.as_ref(), "sale", token.as_ref())
    }

    /// `<prefix>{show:<show>}#expired:<token>`: with `--events off`, the
    /// claim of the instance that counts the expiry of hold `token` (see
    /// [`crate::expiry`]).
    pub fn expiry_claim(
        &self,
        show: &(impl AsRef<str> + ?Sized),
        token: &(impl AsRef<str> + ?Sized),
    ) -> String {
        self.record(show.as_ref(), "expired", token.as_ref())
    }

    /// `<prefix>{show:<show>}#idem:<key>`: the outcome recorded under an
    /// idempotency key, scoped to the request's home show.
    pub fn idempotency(&self, show: &(impl AsRef<str> + ?Sized), key: &str) -> String {
        self.record(show.as_ref(), "idem", key)
    }

    /// `<prefix>{show:<show>}`: what every key of the show starts with.
    pub fn show_tag(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.tagged(show.as_ref(), 0)
    }

    /// `<prefix>{show:<show>}#<name>`: one of the show's own keys.
    fn show_key(&self, show: &str, name: &str) -> String {
        let mut key = self.tagged(show, name.len() + 1);
        key.push('#');
        key.push_str(name);
        key
    }

    /// `<prefix>{show:<show>}#fence`: the show's fence counter (with
    /// events off; with events on the stream ids give the fences).
    pub fn fence(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.show_key(show.as_ref(), "fence")
    }

    /// `<prefix>{show:<show>}#events`: the show's event stream.
    pub fn events(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.show_key(show.as_ref(), "events")
    }

    /// `<prefix>{show:<show>}#events-deleted`: how many entries the scripts
    /// deleted from the show's event stream themselves (an event rewritten
    /// under another id, or undone), so that a trim is told from those.
    pub fn events_deleted(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.show_key(show.as_ref(), "events-deleted")
    }

    /// `<prefix>{show:<show>}#deadlines`: the show's deadline index, a
    /// sorted set of its live holds scored with their expiry.
    pub fn deadlines(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.show_key(show.as_ref(), "deadlines")
    }

    /// `<prefix>{show:<show>}#pool:<pool>`: a pool's hash (`capacity`,
    /// `held`, `sold`).
    pub fn pool(&self, show: &(impl AsRef<str> + ?Sized), pool: &str) -> String {
        self.record(show.as_ref(), "pool", pool)
    }

    /// `<prefix>{show:<show>}#pool-holds:<pool>`: the pool's live holds,
    /// `<quantity>:<token>` scored with their expiry.
    pub fn pool_holds(&self, show: &(impl AsRef<str> + ?Sized), pool: &str) -> String {
        self.record(show.as_ref(), "pool-holds", pool)
    }

    /// `<prefix>{show:<show>}#settings`: the show's settings (a hash).
    pub fn settings(&self, show: &(impl AsRef<str> + ?Sized)) -> String {
        self.show_key(show.as_ref(), "settings")
    }

    /// `<prefix>{show:<show>}#holder:<holder>`: a holder's live holds in the
    /// show, `<units>:<token>` scored with their expiry.
    pub fn holder(&self, show: &(impl AsRef<str> + ?Sized), holder: &str) -> String {
        self.record(show.as_ref(), "holder", holder)
    }

    /// `<prefix>{show:<show>}#holder-sold:<holder>`: the units a holder
    /// bought in the show.
    pub fn holder_sold(&self, show: &(impl AsRef<str> + ?Sized), holder: &str) -> String {
        self.record(show.as_ref(), "holder-sold", holder)
    }

    /// The pub/sub channel on which a stopping instance names the shows it
    /// would have swept, for the instances that go on (not a key: Redis
    /// Cluster forwards a PUBLISH to every node).
    pub fn handover_channel(&self) -> String {
        format!("{}sweep-handover", self.prefix)
    }

    /// `<prefix>{show:.scan.<n>}#scan-lease`: which instance scans a
    /// master for deadline indexes this period (`events::sweep`); `n` picks
    /// a hash tag whose slot is on that master. No show's own keys end in
    /// `#scan-lease`.
    pub fn scan_lease(&self, n: u32) -> String {
        self.show_key(&format!(".scan.{n}"), "scan-lease")
    }

    /// If `key` is a deadline index of this key space, its show.
    pub fn parse_deadlines<'k>(&self, key: &'k str) -> Option<&'k str> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        let show = rest.strip_prefix("{show:")?.strip_suffix("}#deadlines")?;
        valid_id(show).then_some(show)
    }

    /// If `key` is a hold record key of this key space, the home show and
    /// the token. Used to recognise expiry events of holds.
    pub fn parse_hold_record<'k>(&self, key: &'k str) -> Option<(&'k str, &'k str)> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        let rest = rest.strip_prefix("{show:")?;
        let close = rest.find('}')?;
        let (show, tail) = rest.split_at(close);
        let token = tail.strip_prefix("}#hold:")?;
        (valid_id(show) && !token.is_empty()).then_some((show, token))
    }

    /// The slot of every key of `show`.
    pub fn show_slot(&self, show: &(impl AsRef<str> + ?Sized)) -> u16 {
        let show = show.as_ref();
        let mut tag = String::with_capacity(show.len() + 5);
        let _ = write!(tag, "show:{show}");
        slot(tag.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_schema() {
        let ks = KeySpace::new(DEFAULT_PREFIX);
        assert_eq!(ks.seat("42", "E7"), "seat-hold:{show:42}:E7");
        assert_eq!(ks.fence("42"), "seat-hold:{show:42}#fence");
        let token = crate::ids::HoldToken::new();
        let rec = ks.hold_record("42", &token);
        assert_eq!(
            rec,
            format!("seat-hold:{{show:42}}#hold:{}", token.as_str())
        );
        assert_eq!(ks.parse_hold_record(&rec), Some(("42", token.as_str())));
        assert_eq!(ks.parse_hold_record("seat-hold:{show:42}:E7"), None);
        assert_eq!(ks.parse_hold_record("other:{show:42}#hold:t"), None);
        assert_eq!(ks.parse_deadlines(&ks.deadlines("42")), Some("42"));
        assert_eq!(ks.parse_deadlines(&ks.events("42")), None);
        let s = ks.show_slot("42");
        for key in [
            ks.seat("42", "E7"),
            rec,
            ks.fence("42"),
            ks.sale_record("42", &token),
            ks.events("42"),
            ks.deadlines("42"),
            ks.pool("42", "floor"),
            ks.pool_holds("42", "floor"),
            ks.settings("42"),
            ks.holder("42", "a@b"),
            ks.holder_sold("42", "a@b"),
        ] {
            assert_eq!(slot(key.as_bytes()), s);
        }
    }

    #[test]
    fn slot_known_values() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(slot(b"123456789"), 0x31c3 % SLOTS);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag: the whole key is hashed (CRC16 of all of it).
        assert_eq!(slot(b"foo{}{bar}"), 8363);
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"foo{bar}{zap}"), slot(b"bar"));
        assert_eq!(slot(b"{}"), 15257);
        assert_eq!(slot(b"{bar"), 4015);
    }
}
