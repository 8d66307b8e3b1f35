//! GCRA, the generic cell rate algorithm: one number per key, the theoretical arrival
//! time (TAT) of the next request.
//!
//! Time is scaled by `amount` so the emission interval `period / amount` is the whole
//! number `period`: no rounding, no drift. A request of `cost` units is admitted when
//! `max(tat, now) + cost * T - tau <= now`, where `tau = burst * T`.

use super::token_bucket::nanos;
use super::{Snapshot, Verdict, Wide, div, div_ceil};

/// Parameters: `amount` units per `period` nanoseconds, bursts of `burst`.
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
