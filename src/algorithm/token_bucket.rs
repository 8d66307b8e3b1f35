//! Token bucket: a burst of `capacity`, refilled at `amount` per `period`.
//!
//! The state is the bucket's deficit (tokens missing from full) scaled by the period, so
//! that refilling `elapsed` nanoseconds adds exactly `elapsed * amount` with no fractions
//! and no drift. A default state is a full bucket.

use super::{Snapshot, Verdict, Wide, div, div_ceil};

/// Parameters: `capacity` tokens, `amount` tokens added every `period` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// The burst size in tokens.
    pub(super) capacity: u64,
    /// Tokens added per period.
    pub(super) amount: u64,
    /// The period in nanoseconds.
    pub(super) period: u64,
}

/// A policing leaky bucket: the token bucket's math, its level read as the tokens missing
/// from full. (The shaping bucket is `LeakyShape`.)
pub type LeakyPolice = TokenBucket;

/// How far the bucket is from full, as `tokens * period`, at `last`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketState {
    /// Missing tokens times the period (the leaky bucket's level).
    pub(super) level: Wide,
    /// When `level` was last brought up to date, in nanoseconds.
    pub(super) last: u64,
}

impl TokenBucket {
    /// `capacity` tokens, `amount` added every `period` nanoseconds; `None` when `amount`
    /// or `period` is zero (a bucket that never refills), or a count or the period is
    /// past [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(capacity: u64, amount: u64, period: u64) -> Option<Self> {
        (amount > 0 && super::within_bounds(&[capacity, amount], &[period])).then_some(Self {
            capacity,
            amount,
            period,
        })
    }

    /// The burst size in tokens.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl TokenBucket {
    #[inline]
    fn full(&self) -> u128 {
        u128::from(self.capacity) * u128::from(self.period)
    }

    /// Refills the bucket for the time since the last update.
    #[inline]
    pub fn refresh(&self, state: &mut BucketState, now: u64) {
        let elapsed = now.saturating_sub(state.last);
        state.level.set(
            state
                .level
                .get()
                .saturating_sub(u128::from(elapsed) * u128::from(self.amount)),
        );
        state.last = state.last.max(now);
    }

    /// Any time: `refresh` never takes a bucket back, and a refund does not depend on
    /// when its debit was made (see `Params::floor`). An earlier time only understates the
    /// wait by as much.
    #[inline]
    pub fn floor(&self, _state: &BucketState) -> u64 {
        0
    }

    /// Would `cost` tokens be there now? The state must be refreshed to `now`.
    #[inline]
    pub fn check(&self, state: &BucketState, _now: u64, cost: u64) -> Verdict {
        if cost > self.capacity {
            return Verdict::Never;
        }
        let needed = (state.level.get()).saturating_add(u128::from(cost) * u128::from(self.period));
        if needed <= self.full() {
            Verdict::Admit { delay: 0 }
        } else {
            Verdict::Deny {
                retry_after: nanos(div_ceil(needed - self.full(), u128::from(self.amount))),
            }
        }
    }

    /// Takes `cost` tokens.
    #[inline]
    pub fn commit(&self, state: &mut BucketState, _now: u64, cost: u64) {
        state.level.set(
            state
                .level
                .get()
                .saturating_add(u128::from(cost) * u128::from(self.period)),
        );
    }

    /// Puts back `units` debited at `at`, never above full, and never more than a replay
    /// with the smaller debit would hold now: had the bucket held those units all along,
    /// it might have been full for a while, and what it could not take then is gone.
    /// `left` is what the debit left (units); without it, all the refill since `at` is
    /// counted as lost. `at` = `u64::MAX`: all of `units`.
    #[inline]
    pub fn refund(
        &self,
        state: &mut BucketState,
        now: u64,
        units: u64,
        at: u64,
        left: Option<u64>,
    ) {
        let back = u128::from(units) * u128::from(self.period);
        let given = if at == super::ANY_TIME {
            back
        } else {
            // The replay (debited `back` less) was full once the deficit the debit left,
            // less `back`, had refilled: what refilled beyond that is lost.
            let room = left.map_or(back, |left| {
                (u128::from(self.capacity.saturating_sub(left)) * u128::from(self.period)).max(back)
            });
            let refilled = u128::from(now.saturating_sub(at)) * u128::from(self.amount);
            back.min(room.saturating_sub(refilled))
        };
        state.level.set(state.level.get().saturating_sub(given));
    }

    /// The draft-11 effective window: nanoseconds until one more token is there after the
    /// `remaining` were taken now (what `commit(remaining)` then `check(1)` would say,
    /// without a copy of the state).
    #[inline]
    pub fn effective_window(&self, state: &BucketState, _now: u64, remaining: u64) -> u64 {
        let needed = (state.level.get())
            .saturating_add(u128::from(remaining.saturating_add(1)) * u128::from(self.period));
        match needed.checked_sub(self.full()) {
            Some(over) if over > 0 => nanos(div_ceil(over, u128::from(self.amount))),
            _ => 0,
        }
    }

    /// Tokens owed (a settle charged past empty), rounded up: what must refill before
    /// the bucket holds nothing again.
    #[inline]
    pub fn owed(&self, state: &BucketState, _now: u64) -> u64 {
        state
            .level
            .get()
            .checked_sub(self.full())
            .map_or(0, |over| nanos(div_ceil(over, u128::from(self.period))))
    }

    /// What a client sees now: whole tokens left, and the time until the bucket is full.
    /// The state is fresh once it is full, counted from its own time when `now` is behind
    /// it (another thread's reading), so that it is never forgotten early.
    #[inline]
    pub fn snapshot(&self, state: &BucketState, now: u64) -> Snapshot {
        let reset = nanos(div_ceil(state.level.get(), u128::from(self.amount)));
        let remaining = div(
            self.full().saturating_sub(state.level.get()),
            u128::from(self.period),
        ) as u64;
        Snapshot::resetting_in(now.max(state.last), remaining, reset)
    }
}

/// Clamps a scaled duration to u64 nanoseconds.
#[inline]
pub(crate) fn nanos(value: u128) -> u64 {
    value.min(u128::from(u64::MAX)) as u64
}
