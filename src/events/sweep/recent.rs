//! The holds this instance expired lately: Redis's notification of such a
//! hold's record needs no sweep.

use std::collections::HashSet;
use std::time::Duration;

use tokio::time::Instant;

/// How long a hold this instance expired is remembered: Redis's expiry
/// notification of its record, which comes after the record is deleted
/// (usually within a second, seconds under heavy expiry load), is then
/// known to need no sweep.
pub(super) const REMEMBER: Duration = Duration::from_secs(10);

/// The refs of the holds this instance expired in the last [`REMEMBER`] to
/// twice that: two generations, the older dropped whole.
pub(super) struct Recent {
    current: HashSet<u64>,
    older: HashSet<u64>,
    since: Instant,
}

impl Default for Recent {
    fn default() -> Self {
        Self {
            current: HashSet::new(),
            older: HashSet::new(),
            since: Instant::now(),
        }
    }
}

impl Recent {
    fn rotate(&mut self, now: Instant) {
        let age = now.duration_since(self.since);
        if age >= REMEMBER {
            // The new generation starts at the size of the last one: grown
            // from empty, it rehashed itself under the sweeper's lock every
            // time it doubled, with every hold waiting.
            let size = self.current.len();
            self.older = std::mem::replace(&mut self.current, HashSet::with_capacity(size));
            if age >= REMEMBER * 2 {
                self.older.clear();
            }
            self.since = now;
        }
    }

    pub(super) fn insert(&mut self, now: Instant, hold: u64) {
        self.rotate(now);
        self.current.insert(hold);
    }

    pub(super) fn contains(&mut self, now: Instant, hold: u64) -> bool {
        self.rotate(now);
        self.current.contains(&hold) || self.older.contains(&hold)
    }
}
