//! One show's seat view: what its events (and Redis's answers) told this
//! instance about each seat, and what it may answer from that (see the
//! parent module).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::events::hub::{mono_ms, steady_now_ms};
use crate::events::Event;
use crate::ids::SeatId;
use crate::model::State;

/// A live hold of a show's deadline index.
pub struct LiveHold {
    /// Its public ref, as its events name it.
    pub reference: String,
    pub seats: Vec<SeatId>,
    /// Its deadline, ms on Redis's clock.
    pub until: i64,
}

/// What the view knows of one seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    Free,
    /// Held until this time, ms on Redis's clock.
    Held(i64),
    Sold,
}

/// One show's view.
pub struct SeatView {
    seats: Mutex<ViewState>,
    /// When the reader last knew it had every event (ms, this machine's
    /// monotonic clock, [`mono_ms`]).
    current_at: Arc<AtomicU64>,
    /// How far Redis's clock may be ahead of this machine's, in ms, as seen
    /// from the events (their id time minus the time they arrived): taking
    /// the largest keeps "safely in the future" safe.
    clock_ahead: AtomicI64,
    /// When the view was last asked ([`mono_ms`]).
    pub last_used: AtomicU64,
    max_lag_ms: u64,
}

#[derive(Default)]
struct ViewState {
    /// Each known seat, and the position (events applied) of its last change.
    seats: HashMap<String, (Known, u64)>,
    /// The seats of each live hold, by hold ref, so that a `modified` event
    /// (which names the new seats) frees the ones it gave back.
    holds: HashMap<String, Vec<String>>,
    /// Events applied so far.
    applied: u64,
    /// The position at which the view last forgot everything, or pruned
    /// what it knew: what Redis answered before it may predate events the
    /// view never saw, or whose effect it dropped.
    forgotten: u64,
    /// How many seats or holds it may know before [`ViewState::prune_if_large`].
    prune_at: usize,
    /// Seats this instance changed itself, and when ([`mono_ms`], once
    /// Redis answered): the view answers none of them until its reader has
    /// read past that moment ([`SeatView::changed_here`]).
    changed: HashMap<String, u64>,
    /// When this instance changed more seats than `changed` keeps: the
    /// view answers nothing until its reader has read past that moment.
    all_changed_at: u64,
}

/// The fewest seats or holds a view prunes at (see [`ViewState::prune_if_large`]).
const PRUNE_AT: usize = 4096;

impl ViewState {
    /// Drops the seats known free, holds over by `now` (Redis's clock as
    /// the view reckons it, no later than it is but by a sample's delivery
    /// time, or after a failover to a master whose clock is behind: a hold
    /// dropped early is then answered by Redis, never refused here) and
    /// the holds of no seat held, once the view knows more than `prune_at`
    /// of either: clients that hold and release ever new seat ids would
    /// otherwise grow it without bound. Sold seats and live holds stay.
    /// Redis's answers to requests sent before are not learned afterwards
    /// (they may predate a release whose free seat was dropped).
    fn prune_if_large(&mut self, now: i64) {
        if self.seats.len() <= self.prune_at && self.holds.len() <= self.prune_at {
            return;
        }
        self.seats.retain(|_, (known, _)| match known {
            Known::Free => false,
            Known::Held(until) => *until > now,
            Known::Sold => true,
        });
        let seats = &self.seats;
        self.holds.retain(|_, held| {
            held.iter()
                .any(|s| matches!(seats.get(s), Some((Known::Held(_), _))))
        });
        self.applied += 1;
        self.forgotten = self.applied;
        self.prune_at = PRUNE_AT.max(2 * self.seats.len().max(self.holds.len()));
    }
}

impl SeatView {
    pub fn new(current_at: Arc<AtomicU64>, max_lag_ms: u64) -> Self {
        Self {
            seats: Mutex::new(ViewState {
                prune_at: PRUNE_AT,
                ..ViewState::default()
            }),
            current_at,
            clock_ahead: AtomicI64::new(i64::MIN),
            last_used: AtomicU64::new(mono_ms()),
            max_lag_ms,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ViewState> {
        // Each change under the lock is a few map operations on plain
        // values: a panic cannot leave them half-done.
        self.seats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies one event of the show (the reader calls this in order).
    pub fn apply(&self, event: &Event) {
        let ahead = i64::try_from(event.event_id.ms).unwrap_or(0) - steady_now_ms();
        self.clock_ahead.fetch_max(ahead, Ordering::Relaxed);
        let until = event
            .expires_at_ms
            .unwrap_or(i64::try_from(event.event_id.ms).unwrap_or(0));
        let mut state = self.lock();
        state.applied += 1;
        let at = state.applied;
        let known = match event.kind.as_str() {
            "held" | "extended" | "modified" => Known::Held(until),
            "confirmed" => Known::Sold,
            "released" | "expired" => Known::Free,
            _ => return,
        };
        if event.kind == "modified" {
            if let Some(before) = state.holds.get(&event.hold_ref).cloned() {
                for seat in before.iter().filter(|s| !event.seats.contains(s)) {
                    state.seats.insert(seat.clone(), (Known::Free, at));
                }
            }
        }
        for seat in &event.seats {
            // The sweeper writes an `expired` event up to a second after
            // the hold's key expired (a scan later for another instance's
            // holds): the seat may be held again by then. It frees only a
            // seat held until no later than the expired hold's deadline.
            let stale = event.kind == "expired"
                && !matches!(state.seats.get(seat), Some((Known::Held(held), _)) if *held <= until);
            if !stale {
                state.seats.insert(seat.clone(), (known, at));
            }
        }
        if matches!(known, Known::Held(_)) {
            state
                .holds
                .insert(event.hold_ref.clone(), event.seats.clone());
        } else {
            state.holds.remove(&event.hold_ref);
        }
        state.prune_if_large(self.redis_now_at_least());
    }

    /// Redis's time `redis_ms`, read just now (with the deadline index a
    /// new view learns its holds from): Redis's lead over this machine's
    /// clock, until events tell it too.
    pub fn learn_redis_time(&self, redis_ms: i64) {
        // Read after Redis answered: short of its lead by the reply's
        // travel, as an event's sample is by its delivery.
        let ahead = redis_ms - steady_now_ms();
        self.clock_ahead.fetch_max(ahead, Ordering::Relaxed);
    }

    /// Redis's time now, no later than it is: each sample (an event's id
    /// time minus this machine's time when it arrived) is below Redis's
    /// lead by the event's delivery time. `i64::MIN` before any event.
    fn redis_now_at_least(&self) -> i64 {
        match self.clock_ahead.load(Ordering::Relaxed) {
            i64::MIN => i64::MIN,
            ahead => steady_now_ms() + ahead,
        }
    }

    #[cfg(test)]
    fn sizes_changed(&self) -> usize {
        self.lock().changed.len()
    }

    #[cfg(test)]
    fn sizes(&self) -> (usize, usize) {
        let state = self.lock();
        (state.seats.len(), state.holds.len())
    }

    /// Forgets every seat and hold: its reader may have missed events
    /// (trimmed away while it was cut off), so what the view knew may be
    /// stale. It knows again what later events and Redis's answers tell it;
    /// meanwhile Redis answers.
    pub fn forget(&self) {
        let mut state = self.lock();
        state.seats.clear();
        state.holds.clear();
        state.applied += 1;
        state.forgotten = state.applied;
    }

    /// Whether the reader is current within the lag bound.
    fn is_current(&self) -> bool {
        let at = self.current_at.load(Ordering::Acquire);
        at > 0 && mono_ms().saturating_sub(at) <= self.max_lag_ms
    }

    /// This instance has just changed `seats` (released, sold, extended,
    /// given back or taken them; or may have, when Redis did not answer):
    /// the view answers none of them until its reader has read past this
    /// moment. Otherwise a client that released a seat and asked again at
    /// once could be told what the view knew before its own change ("held",
    /// 409) until the reader caught up, within the lag bound; other
    /// instances' changes are still seen up to that bound late, as
    /// documented. A read the reader asks for after now brings the change's
    /// event (written before Redis answered), and its time is what
    /// `current_at` holds once it is applied.
    pub fn changed_here<'s>(&self, seats: impl IntoIterator<Item = &'s str>) {
        let now = mono_ms();
        let current = self.current_at.load(Ordering::Acquire);
        let mut state = self.lock();
        if state.changed.len() >= PRUNE_AT {
            state.changed.retain(|_, at| *at >= current);
            if state.changed.len() >= PRUNE_AT {
                // A reader that does not keep up with this instance's own
                // changes: answer nothing of the show until it has.
                state.changed.clear();
                state.all_changed_at = now;
                return;
            }
        }
        for seat in seats {
            state.changed.insert(seat.to_owned(), now);
        }
    }

    /// Redis's time now as the view reckons it: this machine's clock plus
    /// the most Redis was seen ahead (by the events' ids; behind when
    /// Redis's clock is, so that the `expiresInMs` the view answers are
    /// Redis's own), or this machine's clock before any sample. Each
    /// sample falls short of Redis's lead by its event's delivery time, a
    /// millisecond or so, which the lag bound's margin covers.
    pub fn redis_now(&self) -> i64 {
        match self.clock_ahead.load(Ordering::Relaxed) {
            i64::MIN => steady_now_ms(),
            ahead => steady_now_ms() + ahead,
        }
    }

    /// What the view knows of `seats` while it is current: `Some` for a
    /// seat it has seen an event of (or learned from Redis), `None` for one
    /// it has not, or whose hold ends within the lag bound (Redis decides).
    fn known(&self, seats: &[SeatId]) -> Option<Vec<Option<State>>> {
        self.last_used.store(mono_ms(), Ordering::Relaxed);
        if !self.is_current() {
            return None;
        }
        let now = self.redis_now();
        let margin = i64::try_from(self.max_lag_ms).unwrap_or(i64::MAX);
        // Read after the lock is taken: `changed_here` marks under it. The
        // reader stores its time (Release) after it applied the events the
        // time covers: a time seen here (Acquire) comes with them.
        let state = self.lock();
        let current = self.current_at.load(Ordering::Acquire);
        if state.all_changed_at >= current {
            return None;
        }
        Some(
            seats
                .iter()
                .map(|seat| {
                    if state
                        .changed
                        .get(seat.as_str())
                        .is_some_and(|at| *at >= current)
                    {
                        return None;
                    }
                    Self::answer(&state, seat, now, margin)
                })
                .collect(),
        )
    }

    /// What the view knows of `seat` (see [`SeatView::known`]).
    fn answer(state: &ViewState, seat: &SeatId, now: i64, margin: i64) -> Option<State> {
        match state.seats.get(seat.as_str())?.0 {
            Known::Free => Some(State::Free),
            Known::Sold => Some(State::Sold),
            Known::Held(until) if until - now > margin => Some(State::Held(Some(until - now))),
            Known::Held(_) => None,
        }
    }

    /// The states of `seats` a read may be answered with, `None` for each
    /// seat Redis must answer; `None` in all when the reader is not
    /// current. Only taken seats (sold, or held safely beyond the lag
    /// bound) are answered: a seat the events left free may have been
    /// taken since by a writer outside seathold (the reference design's raw
    /// `SET ... NX PX`, which writes no event), or by this instance's own
    /// hold whose event the reader has not read yet. A read never says
    /// "free" from the view, as a hold never succeeds from it.
    pub fn states(&self, seats: &[SeatId]) -> Option<Vec<Option<State>>> {
        let mut known = self.known(seats)?;
        for state in &mut known {
            if *state == Some(State::Free) {
                *state = None;
            }
        }
        Some(known)
    }

    /// The position to pass to [`SeatView::learn`] for a request sent to
    /// Redis now.
    pub fn position(&self) -> u64 {
        self.lock().applied
    }

    /// Learns the seats that Redis answered sold as of `position` (the
    /// view's position when the request was sent). A seat that changed in
    /// the view since `position` keeps the newer state. Only sales: a held
    /// seat's `expiresInMs` is Redis's as it answered, and the time the
    /// answer took to come would make it end later here than in Redis
    /// (its event tells the view when it ends).
    pub fn learn_sold(&self, position: u64, sold: &[SeatId]) {
        let mut state = self.lock();
        if position < state.forgotten {
            return;
        }
        for seat in sold {
            if state
                .seats
                .get(seat.as_str())
                .is_some_and(|(_, at)| *at > position)
            {
                continue;
            }
            state
                .seats
                .insert(seat.to_string(), (Known::Sold, position));
        }
    }

    /// Learns the live holds of the show's deadline index as it was after
    /// `position`: their seats held until their deadlines, and which seats
    /// each holds, so that a later `modified` event frees the seats it
    /// gives back. A seat that changed in the view since `position` keeps
    /// the newer state.
    pub fn learn_holds(&self, position: u64, holds: &[LiveHold]) {
        let mut state = self.lock();
        if position < state.forgotten {
            return;
        }
        for hold in holds {
            // An event since `position` named the hold's seats as they are
            // now (a PATCH may have given some back that the index, read
            // before it, still lists): nothing here is newer.
            if state.holds.contains_key(&hold.reference) {
                continue;
            }
            let mut learned = false;
            for seat in &hold.seats {
                if state
                    .seats
                    .get(seat.as_str())
                    .is_some_and(|(_, at)| *at > position)
                {
                    continue;
                }
                state
                    .seats
                    .insert(seat.to_string(), (Known::Held(hold.until), position));
                learned = true;
            }
            // A hold whose every seat changed since is over or known.
            if learned {
                let seats = hold.seats.iter().map(ToString::to_string).collect();
                state.holds.insert(hold.reference.clone(), seats);
            }
        }
    }

    /// The taken seats of a hold of `seats`, when the view can tell for
    /// sure that the hold would be refused; `None` sends it to Redis.
    pub fn refusal(&self, seats: &[SeatId]) -> Option<Vec<(SeatId, State)>> {
        let known = self.known(seats)?;
        if known.iter().any(Option::is_none) {
            return None;
        }
        let taken: Vec<(SeatId, State)> = seats
            .iter()
            .cloned()
            .zip(known.into_iter().flatten())
            .filter(|(_, s)| *s != State::Free)
            .collect();
        (!taken.is_empty()).then_some(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::hub::now_ms;
    use crate::events::EventId;
    use crate::ids::ShowId;

    fn event(kind: &str, seats: &[&str], reference: &str, expires: Option<i64>) -> Event {
        let ms = now_ms();
        Event {
            id: format!("{ms}-0"),
            kind: kind.into(),
            show: ShowId::parse("42").expect("show"),
            seats: seats.iter().map(|s| (*s).to_owned()).collect(),
            pools: Default::default(),
            hold_ref: reference.into(),
            fence: 1,
            expires_at: None,
            expires_at_ms: expires,
            at: String::new(),
            event_id: EventId { ms, seq: 0 },
        }
    }

    fn seat(s: &str) -> SeatId {
        SeatId::parse(s).expect("seat")
    }

    /// A live hold of the deadline index.
    fn live(reference: &str, seats: &[&str], until: i64) -> LiveHold {
        LiveHold {
            reference: reference.into(),
            seats: seats.iter().map(|s| seat(s)).collect(),
            until,
        }
    }

    /// A view whose reader is current now (lag bound 250 ms), and the
    /// reader's clock, which a test may set back.
    fn current_view() -> (Arc<AtomicU64>, SeatView) {
        let current = Arc::new(AtomicU64::new(mono_ms()));
        let view = SeatView::new(Arc::clone(&current), 250);
        (current, view)
    }

    /// A Redis whose clock is behind this machine's (its events' ids 5 s
    /// early): the view reckons Redis's time as Redis keeps it, so a hold
    /// it knows answers the time Redis gives it. Before, the view never
    /// reckoned Redis's clock behind this machine's, and answered 55 s.
    #[test]
    fn a_redis_clock_behind_is_reckoned_as_it_is() {
        let (_current, view) = current_view();
        let mut held = event("held", &["E7"], "r1", None);
        let redis_now = held.event_id.ms as i64 - 5_000;
        held.event_id.ms = redis_now as u64;
        held.expires_at_ms = Some(redis_now + 60_000);
        view.apply(&held);
        let Some(State::Held(Some(left))) = view.known(&[seat("E7")]).expect("current")[0] else {
            panic!("E7 held");
        };
        assert!((59_000..=60_000).contains(&left), "{left} ms left");
    }

    #[test]
    fn refuses_only_what_it_knows_taken_and_never_when_behind() {
        let (current, view) = current_view();
        let later = now_ms() as i64 + 60_000;
        view.apply(&event("held", &["E7", "E8"], "r1", Some(later)));
        view.apply(&event("released", &["E9"], "r0", None));
        // Known held: refused; unknown seat in the request: Redis decides.
        assert!(view.refusal(&[seat("E7")]).is_some());
        assert!(view.refusal(&[seat("E7"), seat("A1")]).is_none());
        // Known free only: never answered from the view (it never grants).
        assert!(view.refusal(&[seat("E9")]).is_none());
        // A hold that ends within the lag bound: Redis decides.
        view.apply(&event("held", &["B1"], "r2", Some(now_ms() as i64 + 100)));
        assert!(view.refusal(&[seat("B1")]).is_none());
        // Released, and a modify that gives E8 back.
        view.apply(&event("modified", &["E7"], "r1", Some(later)));
        assert_eq!(view.known(&[seat("E8")]), Some(vec![Some(State::Free)]));
        // A read of a seat known free goes to Redis.
        assert_eq!(view.states(&[seat("E8")]), Some(vec![None]));
        view.apply(&event("confirmed", &["E7"], "r1", None));
        assert_eq!(view.states(&[seat("E7")]), Some(vec![Some(State::Sold)]));
        // Learned from a 409 of Redis: known from then on, unless an event
        // changed the seat after the request was sent.
        let before = view.position();
        view.learn_sold(before, &[seat("A1")]);
        assert!(view.refusal(&[seat("A1")]).is_some());
        let stale = view.position();
        view.apply(&event("released", &["C1"], "r9", None));
        view.learn_sold(stale, &[seat("C1")]);
        assert_eq!(view.known(&[seat("C1")]), Some(vec![Some(State::Free)]));
        // A hold learned from the deadline index that gives a seat back.
        let before = view.position();
        let later = now_ms() as i64 + 60_000;
        view.learn_holds(before, &[live("r7", &["M1", "M2"], later)]);
        assert!(view.refusal(&[seat("M2")]).is_some());
        view.apply(&event("modified", &["M1"], "r7", Some(later)));
        assert_eq!(view.known(&[seat("M2")]), Some(vec![Some(State::Free)]));
        // A late expiry of an earlier hold of a seat held again.
        let first = now_ms() as i64 + 300;
        view.apply(&event("held", &["D1"], "r10", Some(first)));
        view.apply(&event("held", &["D1"], "r11", Some(later)));
        view.apply(&event("expired", &["D1"], "r10", Some(first)));
        assert!(view.refusal(&[seat("D1")]).is_some());
        view.apply(&event("expired", &["D1"], "r11", Some(later)));
        assert_eq!(view.known(&[seat("D1")]), Some(vec![Some(State::Free)]));
        // A reader that fell behind: nothing is answered.
        current.store(mono_ms().saturating_sub(1_000), Ordering::Relaxed);
        assert!(view.refusal(&[seat("E7")]).is_none());
    }

    /// Holds learned from the deadline index before any event are timed
    /// by Redis's clock, which may be ahead of this machine's: the read
    /// brings Redis's time too, so a hold that is over on Redis's clock is
    /// not refused however far this machine's clock is behind (before, the
    /// view took this machine's clock for Redis's until the first event,
    /// and refused a seat free for as long as the clocks differed).
    #[test]
    fn holds_learned_before_any_event_are_timed_by_redis_clock() {
        let (_current, view) = current_view();
        // Redis is 10 s ahead; the hold ended there a second ago.
        let redis_now = now_ms() as i64 + 10_000;
        let position = view.position();
        view.learn_redis_time(redis_now);
        view.learn_holds(position, &[live("r1", &["E7"], redis_now - 1_000)]);
        assert!(
            view.refusal(&[seat("E7")]).is_none(),
            "a hold over on Redis's clock"
        );
        // One that lives on there is refused.
        view.learn_holds(position, &[live("r2", &["E8"], redis_now + 60_000)]);
        assert!(view.refusal(&[seat("E8")]).is_some());
    }

    /// A PATCH that gives a seat back while the view reads the deadline
    /// index: its `modified` event (after the read's position) names the
    /// hold's seats now, and the index (read before) its old ones. The seat
    /// given back must not be learned as held: nothing would free it.
    #[test]
    fn a_patch_while_the_index_is_read_gives_its_seat_back() {
        let (_current, view) = current_view();
        let later = now_ms() as i64 + 60_000;
        let position = view.position();
        view.apply(&event("modified", &["E7"], "r1", Some(later)));
        view.learn_holds(position, &[live("r1", &["E7", "E8"], later)]);
        assert!(view.refusal(&[seat("E7")]).is_some());
        assert_eq!(
            view.known(&[seat("E8")]),
            Some(vec![None]),
            "E8 is Redis's to answer"
        );
        view.apply(&event("released", &["E7"], "r1", None));
        assert!(view.refusal(&[seat("E8")]).is_none());
    }

    /// Seats this instance changed are answered by Redis until the reader
    /// has read past the change; more of them than the view keeps, while
    /// its reader does not move, make it answer nothing until it has.
    #[test]
    fn seats_changed_here_wait_for_the_reader() {
        let (current, view) = current_view();
        let later = now_ms() as i64 + 60_000;
        view.apply(&event("held", &["E7", "E8"], "r1", Some(later)));
        view.changed_here(["E7"]);
        assert_eq!(view.known(&[seat("E7")]), Some(vec![None]));
        assert!(view.refusal(&[seat("E8")]).is_some(), "E8 is not changed");
        // A read asked after the change has brought its event.
        std::thread::sleep(std::time::Duration::from_millis(2));
        current.store(mono_ms(), Ordering::Relaxed);
        assert!(view.refusal(&[seat("E7")]).is_some());

        let many: Vec<String> = (0..PRUNE_AT + 1).map(|i| format!("C{i}")).collect();
        for seat in &many {
            view.changed_here([seat.as_str()]);
        }
        assert!(view.refusal(&[seat("E8")]).is_none(), "all wait now");
        assert!(view.sizes_changed() < PRUNE_AT);
        std::thread::sleep(std::time::Duration::from_millis(2));
        current.store(mono_ms(), Ordering::Relaxed);
        assert!(view.refusal(&[seat("E8")]).is_some());
    }

    /// Seats freed and holds over are dropped once they are many, so that
    /// clients holding and releasing ever new seat ids cannot grow the
    /// view without bound; what Redis answered before the pruning is not
    /// learned afterwards (it may predate a release the view dropped).
    #[test]
    fn free_seats_and_holds_over_are_pruned() {
        let (current, view) = current_view();
        let later = now_ms() as i64 + 60_000;
        view.apply(&event("held", &["KEEP"], "keep", Some(later)));
        let stale = view.position();
        for i in 0..3 * PRUNE_AT {
            let (s, r) = (format!("S{i}"), format!("r{i}"));
            view.apply(&event("held", &[&s], &r, Some(later)));
            view.apply(&event("released", &[&s], &r, None));
        }
        let (seats, holds) = view.sizes();
        assert!(
            seats <= PRUNE_AT + 1 && holds <= PRUNE_AT + 1,
            "{seats} seats, {holds} holds"
        );
        // Current again: the loop may take longer than the lag bound.
        current.store(mono_ms(), Ordering::Relaxed);
        assert!(view.refusal(&[seat("KEEP")]).is_some(), "a live hold stays");
        view.learn_sold(stale, &[seat("S0")]);
        assert_eq!(view.known(&[seat("S0")]), Some(vec![None]));
    }
}
