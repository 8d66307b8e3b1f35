//! GCRA, the generic cell rate algorithm: one number per key, the theoretical arrival
//! time (TAT) of the next request.
//!
//! Time is scaled by `amount` so the emission interval `period / amount` is the whole
//! number `period`: no rounding, no drift. A request of `cost` units is admitted when
//! `max(tat, now) + cost * T - tau <= now`, where `tau = burst * T`.

use super::token_bucket::nanos;
use super::{Snapshot, Verdict, Wide, div, div_ceil};

/// Parameters: `amount` units per `period` nanoseconds, bursts of `burst`.
///
/// ```
/// use tollgate::algorithm::{Gcra, GcraState, MAX_UNITS, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: no rate (a zero amount or period), a count past the bounds.
/// assert_eq!(Gcra::new(2, 0, SECOND), None);
/// assert_eq!(Gcra::new(2, 2, 0), None);
/// assert_eq!(Gcra::new(MAX_UNITS + 1, 2, SECOND), None);
///
/// // 2 units a second (one every half second), bursts of 2.
/// let gcra = Gcra::new(2, 2, SECOND).unwrap();
/// let mut state = GcraState::default();
/// let half = SECOND / 2;
///
/// // `refresh` changes nothing (a TAT reads the same at any time); shown for the steps.
/// gcra.refresh(&mut state, 0);
/// assert_eq!(gcra.check(&state, 0, 2), Verdict::Admit { delay: 0 });
/// gcra.commit(&mut state, 0, 2);
/// // The burst is spent: one more unit conforms half a second later; 3 never do.
/// assert_eq!(gcra.check(&state, 0, 1), Verdict::Deny { retry_after: half });
/// assert_eq!(gcra.check(&state, 0, 3), Verdict::Never);
/// // Nothing left; the burst is whole again in 1 s.
/// let snapshot = gcra.snapshot(&state, 0);
/// assert_eq!((snapshot.remaining, snapshot.reset, snapshot.fresh_at), (0, SECOND, SECOND));
///
/// // `refund`: one of the 2, given back at once, can be spent again.
/// gcra.refund(&mut state, 0, 1, 0, Some(0));
/// assert_eq!(gcra.snapshot(&state, 0).remaining, 1);
/// gcra.commit(&mut state, 0, 1);
///
/// // At 0.5 s the next unit conforms.
/// assert_eq!(gcra.check(&state, half, 1), Verdict::Admit { delay: 0 });
///
/// // `effective_window`: on a fresh state, the 2 left spent now, the next unit comes in
/// // half a second (the draft-11 `t`). `floor`: any time can read a TAT.
/// let fresh = GcraState::default();
/// assert_eq!(gcra.effective_window(&fresh, 0, 2), half);
/// assert_eq!(gcra.floor(&state), 0);
///
/// // `owed`: a settle that charges past the burst leaves units owed, rounded up.
/// let mut settled = GcraState::default();
/// gcra.commit(&mut settled, 0, 3);
/// assert_eq!(gcra.owed(&settled, 0), 1);
/// assert_eq!(gcra.check(&settled, 0, 1), Verdict::Deny { retry_after: SECOND });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// How many units may arrive back to back.
    pub(super) burst: u64,
    /// Units per period.
    pub(super) amount: u64,
    /// The period in nanoseconds.
    pub(super) period: u64,
}

/// The theoretical arrival time, in nanoseconds times `amount`. Zero is fresh.
///
/// A state is as good as fresh again once its TAT has passed, which its snapshot tells:
///
/// ```
/// use tollgate::algorithm::{Gcra, GcraState};
///
/// const SECOND: u64 = 1_000_000_000;
/// let gcra = Gcra::new(2, 2, SECOND).unwrap();
/// let mut state = GcraState::default();
/// let fresh = gcra.snapshot(&state, 0);
/// assert_eq!((fresh.remaining, fresh.reset, fresh.fresh_at), (2, 0, 0));
///
/// // One unit at 0 s moves the TAT half a second on; from then on the state reads as new.
/// gcra.commit(&mut state, 0, 1);
/// assert_ne!(state, GcraState::default());
/// assert_eq!(gcra.snapshot(&state, 0).fresh_at, SECOND / 2);
/// let later = gcra.snapshot(&state, SECOND / 2);
/// assert_eq!((later.remaining, later.reset, later.fresh_at), (2, 0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcraState {
    /// Scaled TAT.
    pub(super) tat: Wide,
}

impl Gcra {
    /// `burst` units back to back, `amount` every `period` nanoseconds; `None` when
    /// `amount` or `period` is zero, or a count or the period is past
    /// [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(burst: u64, amount: u64, period: u64) -> Option<Self> {
        (amount > 0 && super::within_bounds(&[burst, amount], &[period])).then_some(Self {
            burst,
            amount,
            period,
        })
    }
}

impl Gcra {
    #[inline]
    fn scaled(&self, now: u64) -> u128 {
        u128::from(now) * u128::from(self.amount)
    }

    #[inline]
    fn tolerance(&self) -> u128 {
        u128::from(self.burst) * u128::from(self.period)
    }

    /// GCRA needs no refresh: the TAT means the same thing at every `now`.
    #[inline]
    pub fn refresh(&self, _state: &mut GcraState, _now: u64) {}

    /// Any time: a theoretical arrival time reads the same from an earlier one.
    #[inline]
    pub fn floor(&self, _state: &GcraState) -> u64 {
        0
    }

    /// Would `cost` units conform now?
    #[inline]
    pub fn check(&self, state: &GcraState, now: u64, cost: u64) -> Verdict {
        if cost > self.burst {
            return Verdict::Never;
        }
        let now = self.scaled(now);
        let tat =
            (state.tat.get().max(now)).saturating_add(u128::from(cost) * u128::from(self.period));
        let allow_at = tat.saturating_sub(self.tolerance());
        if allow_at <= now {
            Verdict::Admit { delay: 0 }
        } else {
            Verdict::Deny {
                retry_after: nanos(div_ceil(allow_at - now, u128::from(self.amount))),
            }
        }
    }

    /// Moves the TAT by `cost` emission intervals.
    #[inline]
    pub fn commit(&self, state: &mut GcraState, now: u64, cost: u64) {
        let base = state.tat.get().max(self.scaled(now));
        state
            .tat
            .set(base.saturating_add(u128::from(cost) * u128::from(self.period)));
    }

    /// Gives back `units` debited at `at`, never before `now` (a fresh state), and never
    /// more than a replay with the smaller debit would hold (as the token bucket does;
    /// `left` is what the debit left). `at` = `u64::MAX`: all of them.
    ///
    /// ```
    /// use tollgate::algorithm::{Gcra, GcraState};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let gcra = Gcra::new(2, 2, SECOND).unwrap();
    /// let mut state = GcraState::default();
    /// // 1 unit at 0 s (it left 1), then 2 at 0.5 s, the burst whole again by then.
    /// gcra.commit(&mut state, 0, 1);
    /// gcra.commit(&mut state, SECOND / 2, 2);
    /// // Without the unit of 0 s the state would be the same now: nothing comes back.
    /// gcra.refund(&mut state, SECOND / 2, 1, 0, Some(1));
    /// assert_eq!(gcra.snapshot(&state, SECOND / 2).remaining, 0);
    /// // The 2 of 0.5 s, given back at once, all come back.
    /// gcra.refund(&mut state, SECOND / 2, 2, SECOND / 2, Some(0));
    /// assert_eq!(gcra.snapshot(&state, SECOND / 2).remaining, 2);
    ///
    /// // `at` = `u64::MAX` gives back the units whenever they were debited.
    /// gcra.commit(&mut state, SECOND / 2, 1);
    /// gcra.refund(&mut state, SECOND / 2, 1, u64::MAX, None);
    /// assert_eq!(gcra.snapshot(&state, SECOND / 2).remaining, 2);
    /// ```
    #[inline]
    pub fn refund(&self, state: &mut GcraState, now: u64, units: u64, at: u64, left: Option<u64>) {
        let back = u128::from(units) * u128::from(self.period);
        let given = if at == super::ANY_TIME {
            back
        } else {
            let room = left.map_or(back, |left| {
                (u128::from(self.burst.saturating_sub(left)) * u128::from(self.period)).max(back)
            });
            let passed = u128::from(now.saturating_sub(at)) * u128::from(self.amount);
            back.min(room.saturating_sub(passed))
        };
        let tat = state.tat.get().saturating_sub(given);
        state.tat.set(tat.max(self.scaled(now)));
    }

    /// The draft-11 effective window: nanoseconds until one more unit conforms after the
    /// `remaining` were spent now (what `commit(remaining)` then `check(1)` would say,
    /// without a copy of the state).
    #[inline]
    pub fn effective_window(&self, state: &GcraState, now: u64, remaining: u64) -> u64 {
        let scaled_now = self.scaled(now);
        let tat = (state.tat.get().max(scaled_now))
            .saturating_add(u128::from(remaining.saturating_add(1)) * u128::from(self.period));
        let allow_at = tat.saturating_sub(self.tolerance());
        if allow_at <= scaled_now {
            0
        } else {
            nanos(div_ceil(allow_at - scaled_now, u128::from(self.amount)))
        }
    }

    /// Units owed (a settle charged past the burst), rounded up.
    #[inline]
    pub fn owed(&self, state: &GcraState, now: u64) -> u64 {
        let scaled_now = self.scaled(now);
        (state.tat.get().max(scaled_now) - scaled_now)
            .checked_sub(self.tolerance())
            .map_or(0, |over| nanos(div_ceil(over, u128::from(self.period))))
    }

    /// What a client sees now.
    #[inline]
    pub fn snapshot(&self, state: &GcraState, now: u64) -> Snapshot {
        let scaled_now = self.scaled(now);
        let tat = state.tat.get().max(scaled_now);
        let reset = nanos(div_ceil(tat - scaled_now, u128::from(self.amount)));
        let remaining = div(
            (scaled_now + self.tolerance()).saturating_sub(tat),
            u128::from(self.period),
        ) as u64;
        Snapshot::resetting_in(now, remaining, reset)
    }
}
