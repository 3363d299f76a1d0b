//! How the sweeper's schedule keys its shows.

use crate::ids::ShowId;

/// A show as the schedule's B-trees hold it: a hash of its id first, so
/// that a search compares integers kept in the trees' nodes and reads a
/// show's id (a string on the heap) only when two hashes are equal. Keyed
/// by the id alone, every step of a search read one: with single-seat holds
/// on new shows, hundreds of thousands of shows wait, and each hold's
/// search read tens of them (0.5-1.9 us of the daemon's 28 us per hold,
/// `cluster/bench/ab.sh`, random shows).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Key {
    pub(super) hash: u64,
    pub(super) show: ShowId,
}

/// A show's hash for [`Key`]. A fixed seed: the hash orders the trees, it
/// guards nothing.
pub(super) fn hash_of(show: &ShowId) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::default().hash_one(show.as_str())
}

/// A [`Key`] to look up without making one: `(hash, id)` borrowed, so that
/// a hold of a show scheduled already copies nothing.
pub(super) trait KeyView {
    fn parts(&self) -> (u64, &str);
}

impl KeyView for Key {
    fn parts(&self) -> (u64, &str) {
        (self.hash, self.show.as_str())
    }
}

impl KeyView for (u64, &str) {
    fn parts(&self) -> (u64, &str) {
        *self
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn KeyView + '_ {}

impl PartialOrd for dyn KeyView + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// As [`Key`]'s own order: the hash, then the id's bytes.
impl Ord for dyn KeyView + '_ {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl<'a> std::borrow::Borrow<dyn KeyView + 'a> for Key {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}
