//! Token bucket: a burst of `capacity`, refilled at `amount` per `period`.
//!
//! The state is the bucket's deficit (tokens missing from full) scaled by the period, so
//! that refilling `elapsed` nanoseconds adds exactly `elapsed * amount` with no fractions
//! and no drift. A default state is a full bucket.

use super::{Snapshot, Verdict, Wide, div, div_ceil};

/// Parameters: `capacity` tokens, `amount` tokens added every `period` nanoseconds.
///
/// ```
/// use tollgate::algorithm::{BucketState, MAX_UNITS, TokenBucket, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: a bucket that never refills (a zero amount or period), a count past the
/// // bounds.
/// assert_eq!(TokenBucket::new(4, 0, SECOND), None);
/// assert_eq!(TokenBucket::new(4, 2, 0), None);
/// assert_eq!(TokenBucket::new(MAX_UNITS + 1, 2, SECOND), None);
///
/// // 4 tokens, 2 more a second (one every half second).
/// let bucket = TokenBucket::new(4, 2, SECOND).unwrap();
/// assert_eq!(bucket.capacity(), 4);
/// let mut state = BucketState::default(); // full
///
/// bucket.refresh(&mut state, 0);
/// assert_eq!(bucket.check(&state, 0, 4), Verdict::Admit { delay: 0 });
/// bucket.commit(&mut state, 0, 4);
/// // Empty: the next token comes in half a second; 5 never fit.
/// assert_eq!(bucket.check(&state, 0, 1), Verdict::Deny { retry_after: SECOND / 2 });
/// assert_eq!(bucket.check(&state, 0, 2), Verdict::Deny { retry_after: SECOND });
/// assert_eq!(bucket.check(&state, 0, 5), Verdict::Never);
/// // Nothing left; full again in 2 s.
/// let snapshot = bucket.snapshot(&state, 0);
/// assert_eq!(snapshot.remaining, 0);
/// assert_eq!((snapshot.reset, snapshot.fresh_at), (2 * SECOND, 2 * SECOND));
///
/// // At 1 s, 2 tokens have come back.
/// bucket.refresh(&mut state, SECOND);
/// let snapshot = bucket.snapshot(&state, SECOND);
/// assert_eq!((snapshot.remaining, snapshot.reset), (2, SECOND));
/// // `effective_window`: with the 2 spent now, the next token comes half a second later.
/// assert_eq!(bucket.effective_window(&state, SECOND, 2), SECOND / 2);
/// // `refund`: `u64::MAX` puts tokens back whenever they were taken.
/// bucket.refund(&mut state, SECOND, 1, u64::MAX, None);
/// assert_eq!(bucket.snapshot(&state, SECOND).remaining, 3);
///
/// // `owed`: a settle may take more than the bucket holds; what is missing is owed,
/// // and refills before the bucket holds a token again.
/// bucket.commit(&mut state, SECOND, 5);
/// assert_eq!(bucket.owed(&state, SECOND), 2);
/// assert_eq!(bucket.check(&state, SECOND, 1), Verdict::Deny { retry_after: 3 * SECOND / 2 });
/// // `floor`: any time reads a bucket.
/// assert_eq!(bucket.floor(&state), 0);
/// ```
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
///
/// A bucket of 3 that leaks one unit a second: 3 at once fit, the fourth when one unit
/// has leaked out.
///
/// ```
/// use tollgate::algorithm::{BucketState, LeakyPolice, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// let leaky = LeakyPolice::new(3, 1, SECOND).unwrap();
/// let mut level = BucketState::default(); // empty
/// leaky.commit(&mut level, 0, 3);
/// assert_eq!(leaky.check(&level, 0, 1), Verdict::Deny { retry_after: SECOND });
/// leaky.refresh(&mut level, SECOND);
/// assert_eq!(leaky.check(&level, SECOND, 1), Verdict::Admit { delay: 0 });
/// ```
pub type LeakyPolice = TokenBucket;

/// How far the bucket is from full, as `tokens * period`, at `last`.
///
/// The default is a full token bucket (an empty leaky one, and an empty queue for
/// [`LeakyShape`](super::LeakyShape)) at the time line's zero.
///
/// ```
/// use tollgate::algorithm::{BucketState, TokenBucket};
///
/// const SECOND: u64 = 1_000_000_000;
/// let bucket = TokenBucket::new(4, 2, SECOND).unwrap();
/// let mut state = BucketState::default();
/// let full = bucket.snapshot(&state, 0);
/// assert_eq!((full.remaining, full.reset, full.fresh_at), (4, 0, 0));
///
/// // Once it has refilled, the state is as good as new again, though not equal to it.
/// bucket.commit(&mut state, 0, 1);
/// bucket.refresh(&mut state, SECOND);
/// assert_ne!(state, BucketState::default());
/// let later = bucket.snapshot(&state, SECOND);
/// assert_eq!((later.remaining, later.fresh_at), (4, 0));
/// ```
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
    ///
    /// ```
    /// use tollgate::algorithm::{BucketState, TokenBucket};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let bucket = TokenBucket::new(4, 2, SECOND).unwrap();
    /// let mut state = BucketState::default();
    /// // 1 token at 0 s (it left 3), then all 4 at 1 s, the bucket full again by then.
    /// bucket.commit(&mut state, 0, 1);
    /// bucket.refresh(&mut state, SECOND);
    /// bucket.commit(&mut state, SECOND, 4);
    /// // Without the token of 0 s the bucket would be just as empty now: none comes back.
    /// bucket.refund(&mut state, SECOND, 1, 0, Some(3));
    /// assert_eq!(bucket.snapshot(&state, SECOND).remaining, 0);
    /// // The 4 of 1 s, given back at once, all come back.
    /// bucket.refund(&mut state, SECOND, 4, SECOND, Some(0));
    /// assert_eq!(bucket.snapshot(&state, SECOND).remaining, 4);
    /// ```
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
