//! Which shows are due when: this instance's schedule of deadlines, the
//! holds it expired lately, and the pauses of masters whose sweeps failed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::key::{hash_of, Key, KeyView};
use super::recent::Recent;
use crate::ids::ShowId;

/// A show already due this soon needs nothing more for an expiry
/// notification: its sweep expires every hold due by then.
const SWEEP_SOON: Duration = Duration::from_millis(50);

/// How long a master's sweeps wait after one failed, before one sweep tries
/// it again; doubled after each failed try, up to [`PAUSE_MAX`]. Without
/// the pause every due show of a master that refuses connections was
/// retried every 250 ms: with the whole cluster gone, 47,000 failed sweeps
/// (and as many log lines) a second and more than a core; with a master
/// that does not answer, all [`PARALLEL`](super::PARALLEL) sweeps waited on it while the
/// other masters' expiries waited for a free place.
pub(super) const PAUSE_FIRST: Duration = Duration::from_millis(250);

/// The most sweeps of one master in flight at once. A master that stops
/// answering (a stopped process, lost packets) is paused only once its
/// first sweep fails, after the Redis timeout: until then its due shows,
/// during an on-sale hundreds, would take every one of the
/// [`PARALLEL`](super::PARALLEL) places, and the other masters' expiries
/// would wait the whole timeout for one.
pub(super) const PER_MASTER: usize = super::PARALLEL / 2;
pub(super) const PAUSE_MAX: Duration = Duration::from_secs(2);

/// The shows to sweep, by show and in deadline order: scheduling and taking
/// the next due shows cost a logarithm of the shows known, not their
/// number, as every hold schedules its show.
///
/// Both are B-trees, which grow a node at a time. A hash map by show
/// doubled its table now and then and rehashed every show under the lock
/// that every hold takes (a show stays here until its hold expires): with
/// single-seat holds on new shows for 20 s, the slowest answer took 90-112
/// ms instead of 17-28, and p99 was 10.8 ms instead of 8.2 (five
/// alternating wrk runs of each on `seathold dev`); at 2 million shows one
/// doubling alone took 0.5-0.8 s.
#[derive(Default)]
pub(super) struct Due {
    by_show: BTreeMap<Key, Instant>,
    order: BTreeSet<(Instant, Key)>,
    /// Shows being swept now, with what came for them meanwhile: not
    /// started again until that sweep answers, and kept out of `order`, so
    /// taking the next due shows never steps over them.
    running: HashMap<ShowId, Meanwhile>,
    /// Holds this instance wrote the `expired` event of lately.
    expired: Recent,
    /// Masters whose last sweep failed, by address.
    paused: HashMap<Arc<str>, Paused>,
    /// Per master: its sweeps in flight, and its due shows that wait for
    /// one of them to end (it has [`PER_MASTER`] in flight).
    on_master: HashMap<Arc<str>, OnMaster>,
}

/// The sweeps of one master in flight, and its shows waiting for a place,
/// by deadline: a freed place goes to the oldest, which keeps its deadline
/// (were it due "now", every show due meanwhile would pass it).
#[derive(Default)]
struct OnMaster {
    running: usize,
    waiting: BTreeSet<(Instant, ShowId)>,
}

/// The sweeps of a master whose last sweep failed.
struct Paused {
    /// When one sweep may try the master again.
    until: Instant,
    /// The pause before `until`.
    pause: Duration,
    /// The show whose sweep is trying the master again: its answer ends
    /// the pause, or makes it longer.
    probe: Option<ShowId>,
    /// The master's other shows that came due meanwhile, due again when
    /// the pause ends.
    parked: Vec<ShowId>,
}

/// What a sweep came to.
#[derive(Debug, PartialEq)]
pub(super) enum Swept {
    /// It answered: the holds it expired, and when the show's next deadline
    /// is due (`None`: its index is empty).
    Done {
        next: Option<Instant>,
        holds: Vec<u64>,
    },
    /// It failed (the master refused, did not answer in time, or is not
    /// known).
    Failed,
}

/// A change of a master's pause, to log outside the lock.
#[derive(Debug, PartialEq)]
pub(super) enum PauseChange {
    Paused,
    Resumed { parked: usize },
}

/// What came for a show while it was being swept.
#[derive(Default)]
struct Meanwhile {
    /// The earliest time it was scheduled for.
    at: Option<Instant>,
    /// Holds whose records Redis said expired: a sweep again only for those
    /// this sweep did not expire.
    records: Vec<u64>,
}

impl Due {
    /// Sets `show` due at `at`, or earlier if it already was; answers
    /// whether `at` is now the earliest deadline of all (the loop must wake).
    /// A show being swept is only noted: the sweep's answer reschedules it.
    pub(super) fn set(&mut self, show: &ShowId, at: Instant, only_earlier: bool) -> bool {
        if let Some(meanwhile) = self.running.get_mut(show) {
            meanwhile.at = Some(meanwhile.at.map_or(at, |a| a.min(at)));
            return false;
        }
        let hash = hash_of(show);
        let known = self
            .by_show
            .get(&(hash, show.as_str()) as &dyn KeyView)
            .copied();
        if only_earlier && known.is_some_and(|old| at >= old) {
            return false;
        }
        let key = Key {
            hash,
            show: show.clone(),
        };
        if let Some(old) = known {
            self.order.remove(&(old, key.clone()));
        }
        self.by_show.insert(key.clone(), at);
        self.order.insert((at, key));
        self.order.first().is_some_and(|(first, _)| *first == at)
    }

    /// Redis said the record of hold `hold` of `show` expired at or before
    /// `now`: answers whether the show may need a sweep now. Not when this
    /// instance wrote that hold's event already, nor while a sweep of the
    /// show runs (its answer tells whether it expired that hold), nor when
    /// one is due within [`SWEEP_SOON`].
    pub(super) fn record_expired(&mut self, show: &ShowId, hold: u64, now: Instant) -> bool {
        if self.expired.contains(now, hold) {
            return false;
        }
        // A sweep of the show is due within moments anyway (this
        // instance's own hold, heard before its timer fired).
        if self
            .by_show
            .get(&(hash_of(show), show.as_str()) as &dyn KeyView)
            .is_some_and(|at| *at <= now + SWEEP_SOON)
        {
            return false;
        }
        match self.running.get_mut(show) {
            Some(meanwhile) => {
                meanwhile.records.push(hold);
                false
            }
            None => true,
        }
    }

    /// Takes up to `n` shows due by `now`, in deadline order, with their
    /// masters (`master_of`), and marks them running. A show of a paused
    /// master is parked instead, unless the pause is over and no other
    /// show is trying that master yet: then it is the one that tries.
    pub(super) fn start(
        &mut self,
        now: Instant,
        n: usize,
        master_of: impl Fn(&ShowId) -> Arc<str>,
    ) -> Vec<(ShowId, Arc<str>)> {
        self.wake_paused(now);
        let mut shows = Vec::new();
        while shows.len() < n {
            match self.order.first() {
                Some((at, _)) if *at <= now => {}
                _ => break,
            }
            let Some((at, key)) = self.order.pop_first() else {
                break;
            };
            self.by_show.remove(&key);
            let show = key.show;
            let master = master_of(&show);
            if let Some(paused) = self.paused.get_mut(&master) {
                if now < paused.until || paused.probe.is_some() {
                    paused.parked.push(show);
                    continue;
                }
                paused.probe = Some(show.clone());
            }
            let on = self.on_master.entry(Arc::clone(&master)).or_default();
            if on.running >= PER_MASTER {
                on.waiting.insert((at, show));
                continue;
            }
            on.running += 1;
            self.running.insert(show.clone(), Meanwhile::default());
            shows.push((show, master));
        }
        shows
    }

    /// Makes one parked show of each master whose pause is over due now,
    /// to try the master again.
    fn wake_paused(&mut self, now: Instant) {
        let mut wake = Vec::new();
        for paused in self.paused.values_mut() {
            if paused.until <= now && paused.probe.is_none() {
                if let Some(show) = paused.parked.pop() {
                    wake.push(show);
                }
            }
        }
        for show in wake {
            self.set(&show, now, true);
        }
    }

    /// A sweep of `show` on `master` came to `swept` at `now`. Answered: it
    /// expired `holds`, and the show is due again at `next`, or earlier if
    /// it was scheduled for earlier while the sweep ran, or at once if Redis
    /// meanwhile said a record expired whose hold the sweep did not expire;
    /// a pause of its master ends. Failed: the master's sweeps pause (or
    /// pause longer, when this one was trying it again), and the show waits
    /// for the pause to end.
    pub(super) fn finish(
        &mut self,
        show: &ShowId,
        master: &Arc<str>,
        swept: Swept,
        now: Instant,
    ) -> Option<PauseChange> {
        let meanwhile = self.running.remove(show).unwrap_or_default();
        self.place_freed(master, now);
        let Swept::Done { next, holds } = swept else {
            // What Redis said meanwhile is still to do: the show stays due.
            return self.failed(show, master, now);
        };
        for hold in &holds {
            self.expired.insert(now, *hold);
        }
        let unswept = meanwhile.records.iter().any(|r| !holds.contains(r));
        let at = [next, meanwhile.at, unswept.then_some(now)]
            .into_iter()
            .flatten()
            .min();
        if let Some(at) = at {
            self.set(show, at, true);
        }
        let paused = self.paused.remove(master)?;
        Some(self.resume(paused, now))
    }

    /// A sweep of `show` on `master` failed: see [`Due::finish`].
    fn failed(&mut self, show: &ShowId, master: &Arc<str>, now: Instant) -> Option<PauseChange> {
        match self.paused.get_mut(master) {
            Some(paused) => {
                if paused.probe.as_ref() == Some(show) {
                    paused.probe = None;
                    paused.pause = (paused.pause * 2).min(PAUSE_MAX);
                    paused.until = now + paused.pause;
                }
                paused.parked.push(show.clone());
                None
            }
            None => {
                self.paused.insert(
                    Arc::clone(master),
                    Paused {
                        until: now + PAUSE_FIRST,
                        pause: PAUSE_FIRST,
                        probe: None,
                        parked: vec![show.clone()],
                    },
                );
                Some(PauseChange::Paused)
            }
        }
    }

    /// A sweep of `master` ended: one of its shows waiting for a place is
    /// due now.
    fn place_freed(&mut self, master: &Arc<str>, now: Instant) {
        let Some(on) = self.on_master.get_mut(master) else {
            return;
        };
        on.running = on.running.saturating_sub(1);
        let next = on.waiting.pop_first();
        if on.running == 0 && on.waiting.is_empty() {
            self.on_master.remove(master);
        }
        if let Some((at, show)) = next {
            self.set(&show, at.min(now), true);
        }
    }

    /// Ends a pause: its parked shows are due now.
    fn resume(&mut self, paused: Paused, now: Instant) -> PauseChange {
        let parked = paused.parked.len();
        for show in paused.parked {
            self.set(&show, now, true);
        }
        PauseChange::Resumed { parked }
    }

    /// The slot map changed: the pauses of nodes that are no longer masters
    /// end (their slots are served by others now).
    pub(super) fn masters_changed(&mut self, masters: &[String], now: Instant) -> usize {
        let gone: Vec<Arc<str>> = self
            .paused
            .keys()
            .filter(|addr| !masters.iter().any(|m| m.as_str() == &***addr))
            .cloned()
            .collect();
        for addr in &gone {
            if let Some(paused) = self.paused.remove(addr) {
                self.resume(paused, now);
            }
        }
        // Shows waiting for a place on a node that is no master now are
        // due at once (on their new master); its sweeps in flight still end.
        let mut woken = BTreeSet::new();
        for (addr, on) in &mut self.on_master {
            if !masters.iter().any(|m| m.as_str() == &**addr) {
                woken.append(&mut on.waiting);
            }
        }
        for (at, show) in woken {
            self.set(&show, at.min(now), true);
        }
        gone.len()
    }

    /// When the next show is due, or a master's pause ends.
    pub(super) fn first(&self) -> Option<Instant> {
        let pauses = self
            .paused
            .values()
            .filter(|p| p.probe.is_none() && !p.parked.is_empty())
            .map(|p| p.until);
        self.order
            .first()
            .map(|(at, _)| *at)
            .into_iter()
            .chain(pauses)
            .min()
    }

    /// Every show this instance sweeps (waiting, being swept, or parked),
    /// once each.
    pub(super) fn shows(&self) -> Vec<ShowId> {
        let mut shows: std::collections::BTreeSet<&ShowId> =
            self.by_show.keys().map(|k| &k.show).collect();
        shows.extend(self.running.keys());
        shows.extend(self.paused.values().flat_map(|p| p.parked.iter()));
        shows.extend(
            self.on_master
                .values()
                .flat_map(|o| o.waiting.iter().map(|(_, s)| s)),
        );
        shows.into_iter().cloned().collect()
    }

    /// Shows waiting for their time (not being swept, not parked).
    pub(super) fn waiting(&self) -> usize {
        self.by_show.len()
    }

    /// Shows this instance sweeps (waiting, being swept, or parked).
    pub(super) fn len(&self) -> usize {
        self.by_show.len()
            + self.running.len()
            + self.paused.values().map(|p| p.parked.len()).sum::<usize>()
            + self
                .on_master
                .values()
                .map(|o| o.waiting.len())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::super::recent::REMEMBER;
    use super::*;

    fn show(s: &str) -> ShowId {
        ShowId::parse(s).expect("a show id")
    }

    /// Every show on master "m".
    fn one_master(_: &ShowId) -> Arc<str> {
        Arc::from("m")
    }

    /// Shows whose id starts with "x" on master "x", the others on "m".
    fn two_masters(show: &ShowId) -> Arc<str> {
        Arc::from(if show.as_str().starts_with('x') {
            "x"
        } else {
            "m"
        })
    }

    fn started(due: &mut Due, now: Instant, n: usize) -> Vec<ShowId> {
        due.start(now, n, one_master)
            .into_iter()
            .map(|(show, _)| show)
            .collect()
    }

    fn done(due: &mut Due, s: &str, next: Option<Instant>, holds: &[u64], now: Instant) {
        let swept = Swept::Done {
            next,
            holds: holds.to_vec(),
        };
        assert_eq!(due.finish(&show(s), &Arc::from("m"), swept, now), None);
    }

    #[test]
    fn due_shows_start_in_deadline_order_and_only_once() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        assert!(due.set(&show("b"), ms(20), true));
        assert!(due.set(&show("a"), ms(10), true));
        assert!(!due.set(&show("c"), ms(500), true));
        // Only an earlier time moves a show with only_earlier.
        assert!(!due.set(&show("a"), ms(30), true));
        assert_eq!(started(&mut due, ms(25), 8), [show("a"), show("b")]);
        assert_eq!(due.len(), 3);
        // Running shows are not started again, nor are they the next
        // deadline, whatever is scheduled for them meanwhile.
        assert!(!due.set(&show("a"), ms(0), false));
        assert_eq!(due.first(), Some(ms(500)));
        assert!(started(&mut due, ms(100), 8).is_empty());
        assert_eq!(due.len(), 3);
        // Their sweeps answer: the earlier of the answer and what was
        // scheduled meanwhile wins; an empty index without any is gone.
        done(&mut due, "a", Some(ms(1_000)), &[], ms(100));
        done(&mut due, "b", None, &[], ms(100));
        assert_eq!(due.len(), 2);
        assert_eq!(due.first(), Some(ms(0)));
        assert_eq!(started(&mut due, ms(600), 1), [show("a")]);
        assert_eq!(started(&mut due, ms(600), 8), [show("c")]);
        done(&mut due, "a", None, &[], ms(600));
        done(&mut due, "c", Some(ms(2_000)), &[], ms(600));
        assert_eq!(due.len(), 1);
        assert_eq!(due.first(), Some(ms(2_000)));
    }

    #[test]
    fn expired_records_need_a_sweep_only_for_holds_not_swept() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        due.set(&show("a"), ms(0), true);
        assert_eq!(started(&mut due, ms(0), 8), [show("a")]);
        // Notifications during the sweep wait for its answer.
        assert!(!due.record_expired(&show("a"), 7, ms(1)));
        assert!(!due.record_expired(&show("a"), 8, ms(1)));
        // It expired hold 7 but not 8: sweep again at once.
        done(&mut due, "a", None, &[7], ms(2));
        assert_eq!(due.first(), Some(ms(2)));
        assert_eq!(started(&mut due, ms(2), 8), [show("a")]);
        done(&mut due, "a", None, &[8], ms(3));
        assert_eq!(due.len(), 0);
        // Later notifications of holds it expired need nothing; of others,
        // a sweep.
        assert!(!due.record_expired(&show("a"), 7, ms(4)));
        assert!(!due.record_expired(&show("b"), 8, ms(4)));
        assert!(due.record_expired(&show("a"), 9, ms(4)));
        // A show due within SWEEP_SOON needs nothing more; later, it does.
        due.set(&show("c"), ms(30), true);
        assert!(!due.record_expired(&show("c"), 10, ms(4)));
        due.set(&show("d"), ms(500), true);
        assert!(due.record_expired(&show("d"), 11, ms(4)));
        // It forgets after REMEMBER to twice that.
        let later = now + REMEMBER * 2 + Duration::from_millis(10);
        assert!(due.record_expired(&show("a"), 7, later));
    }

    /// A master that does not answer takes at most PER_MASTER of the sweeps
    /// in flight, however many of its shows are due first: the others'
    /// shows still start, and their expiries are not late by the hung
    /// master's timeout. Its other due shows wait for one of its sweeps to
    /// end, and one starts as each ends.
    #[test]
    fn one_master_takes_at_most_its_share_of_the_sweeps() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        // 200 shows of master "x" due first, then 100 of "m".
        for i in 0..200 {
            due.set(&show(&format!("x{i}")), ms(0), false);
        }
        for i in 0..100 {
            due.set(&show(&format!("m{i}")), ms(1), false);
        }
        let first = due.start(ms(5), 256, two_masters);
        let on_x = first.iter().filter(|(_, m)| &**m == "x").count();
        assert_eq!(on_x, PER_MASTER, "x's share");
        assert_eq!(first.len() - on_x, 100, "every show of m starts");
        assert_eq!(due.len(), 300);
        // Nothing more starts while x's sweeps run: no busy loop.
        assert!(due.start(ms(6), 256, two_masters).is_empty());
        assert_eq!(due.first(), None);
        // One of x's sweeps ends: one of its waiting shows is due again.
        let (done_x, _) = first.iter().find(|(_, m)| &**m == "x").cloned().expect("x");
        let swept = Swept::Done {
            next: None,
            holds: vec![],
        };
        assert_eq!(due.finish(&done_x, &Arc::from("x"), swept, ms(7)), None);
        // Due at once, by its own deadline (long past).
        assert_eq!(due.first(), Some(ms(0)));
        let next = due.start(ms(7), 256, two_masters);
        assert_eq!(next.len(), 1);
        assert_eq!(&*next[0].1, "x");
        assert_eq!(due.len(), 299);
        // A failed sweep frees its place too (its show is parked by the
        // pause), and the slot map dropping x wakes every waiting show.
        assert_eq!(
            due.finish(&next[0].0, &Arc::from("x"), Swept::Failed, ms(8)),
            Some(PauseChange::Paused)
        );
        due.masters_changed(&["m".to_owned()], ms(9));
        assert_eq!(due.waiting(), 200 - PER_MASTER - 2 + 1 + 1);
    }

    /// A master whose sweeps are all in flight while new shows keep coming
    /// due: each place that frees goes to the waiting show with the oldest
    /// deadline, so none waits without bound behind newer ones (the last
    /// show to wait used to take each freed place, and start at "now",
    /// after every show that came due before it).
    #[test]
    fn a_waiting_show_is_not_passed_by_newer_ones() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let x: Arc<str> = Arc::from("x");
        let mut due = Due::default();
        for i in 0..PER_MASTER {
            due.set(&show(&format!("x{i}")), ms(0), false);
        }
        assert_eq!(due.start(ms(1), 256, two_masters).len(), PER_MASTER);
        due.set(&show("xold"), ms(1), false);
        assert!(due.start(ms(2), 256, two_masters).is_empty());
        let mut i = 0;
        let mut free = (0..PER_MASTER).map(|i| show(&format!("x{i}")));
        let done = || Swept::Done {
            next: None,
            holds: vec![],
        };
        // Newer shows come due and wait too; then sweeps end one by one.
        for round in 0..5 {
            for _ in 0..3 {
                i += 1;
                due.set(&show(&format!("xnew{i}")), ms(2 + i), false);
            }
            let at = ms(100 + round);
            assert!(due.start(at, 256, two_masters).is_empty());
            let ended = free.next().expect("a sweep in flight");
            due.finish(&ended, &x, done(), at);
            let next = due.start(at, 256, two_masters);
            assert_eq!(next.len(), 1, "one place freed, one show starts");
            if round == 0 {
                assert_eq!(next[0].0, show("xold"), "the oldest deadline first");
            } else {
                // Then the newer ones, oldest deadline first.
                assert_eq!(next[0].0, show(&format!("xnew{round}")));
            }
        }
    }

    /// The schedule finds a show by its borrowed (hash, id) as by its key:
    /// a later deadline leaves each of many shows as it was, an earlier one
    /// moves it, and none is scheduled twice.
    #[test]
    fn shows_are_found_by_their_borrowed_keys() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let mut due = Due::default();
        let shows: Vec<ShowId> = (0..1000).map(|i| show(&format!("s{i}"))).collect();
        for s in &shows {
            due.set(s, ms(100), true);
        }
        for s in &shows {
            assert!(!due.set(s, ms(200), true), "{s} later");
        }
        assert_eq!((due.waiting(), due.order.len()), (1000, 1000));
        assert!(due.set(&shows[500], ms(50), true), "the earliest now");
        assert_eq!((due.waiting(), due.order.len()), (1000, 1000));
        let first = due.start(ms(60), 8, two_masters);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].0, shows[500]);
    }

    #[test]
    fn a_failed_sweep_pauses_its_master_and_one_show_tries_again() {
        let now = Instant::now();
        let ms = |n: u64| now + Duration::from_millis(n);
        let m: Arc<str> = Arc::from("m");
        let mut due = Due::default();
        // Due in this order (shows due at one instant go in their hashes'
        // order).
        for (i, s) in (0u64..).zip(["a", "b", "c", "xa"]) {
            due.set(&show(s), now - Duration::from_micros(4 - i), true);
        }
        let first = due.start(ms(0), 2, two_masters);
        assert_eq!(
            first,
            [(show("a"), Arc::clone(&m)), (show("b"), Arc::clone(&m))]
        );
        // The first failure pauses master m; one in flight meanwhile is
        // parked without making the pause longer.
        assert_eq!(
            due.finish(&show("a"), &m, Swept::Failed, ms(1)),
            Some(PauseChange::Paused)
        );
        assert_eq!(due.finish(&show("b"), &m, Swept::Failed, ms(2)), None);
        // Its other due shows are parked; another master's are not.
        assert_eq!(
            due.start(ms(3), 8, two_masters),
            [(show("xa"), Arc::from("x"))]
        );
        assert_eq!(due.len(), 4);
        // The pause ends 250 ms after the failure: one show tries.
        assert_eq!(due.first(), Some(ms(1) + PAUSE_FIRST));
        assert!(due.start(ms(200), 8, two_masters).is_empty());
        let probe = due.start(ms(251), 8, two_masters);
        assert_eq!(probe.len(), 1);
        let (probe, _) = probe.into_iter().next().expect("a probe");
        assert!(due.start(ms(251), 8, two_masters).is_empty());
        // It fails too: twice the pause.
        assert_eq!(due.finish(&probe, &m, Swept::Failed, ms(260)), None);
        assert_eq!(due.first(), Some(ms(260) + PAUSE_FIRST * 2));
        assert!(due.start(ms(700), 8, two_masters).is_empty());
        let (probe, _) = due.start(ms(760), 8, two_masters)[0].clone();
        // Now it answers: the pause ends and every parked show is due.
        let swept = Swept::Done {
            next: None,
            holds: Vec::new(),
        };
        assert_eq!(
            due.finish(&probe, &m, swept, ms(770)),
            Some(PauseChange::Resumed { parked: 2 })
        );
        let mut rest: Vec<ShowId> = due
            .start(ms(770), 8, two_masters)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        rest.sort();
        let mut want = vec![show("a"), show("b"), show("c")];
        want.retain(|s| *s != probe);
        assert_eq!(rest, want);
        // The pause is capped.
        due.finish(&rest[0], &m, Swept::Failed, ms(800));
        for i in 0..10u64 {
            let at = due.first().expect("a pause");
            let (p, _) = due.start(at, 8, two_masters)[0].clone();
            due.finish(&p, &m, Swept::Failed, at + Duration::from_millis(i));
        }
        let at = due.first().expect("a pause");
        assert!(at <= ms(800) + PAUSE_MAX * 11 + Duration::from_millis(100));
        // A slot map without master m ends its pause (the other show of
        // `rest` is still being swept).
        assert_eq!(due.masters_changed(&["x".to_owned()], at), 1);
        let again = due.start(at, 8, two_masters);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].0, rest[0]);
    }
}
