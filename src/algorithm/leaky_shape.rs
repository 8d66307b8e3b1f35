//! Shaping leaky bucket: a queue that leaks at `amount` per `period`.
//!
//! It keeps the bucket's level (what is queued ahead) and reuses the token bucket's math
//! for it; the policing leaky bucket is the token bucket itself (`token_bucket.rs`).
//! Shaping admits a request whose wait for the units ahead of it to leak out is at most
//! `max_delay`, and tells the caller to hold it back for that wait.

use super::token_bucket::{BucketState, TokenBucket, nanos};
use super::{Snapshot, Verdict, div, div_ceil};

/// Parameters of a shaping leaky bucket.
///
/// Its state is a [`BucketState`] whose level is the queue: the units admitted and not
/// yet leaked out. A request is admitted with the delay its place in the queue gives.
///
/// ```
/// use tollgate::algorithm::{BucketState, LeakyShape, MAX_NANOS, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: no rate (a zero amount or period), a delay bound past the bounds.
/// assert_eq!(LeakyShape::new(0, SECOND, SECOND), None);
/// assert_eq!(LeakyShape::new(1, 0, SECOND), None);
/// assert_eq!(LeakyShape::new(1, SECOND, MAX_NANOS + 1), None);
///
/// // One unit leaks out a second; a request is held back at most 2 s.
/// let shape = LeakyShape::new(1, SECOND, 2 * SECOND).unwrap();
/// // `capacity`: an empty queue admits 3 unit requests back to back.
/// assert_eq!(shape.capacity(), 3);
///
/// // At 0 s they are admitted to be served at 0, 1 and 2 s.
/// let mut state = BucketState::default();
/// for delay in [0, SECOND, 2 * SECOND] {
///     shape.refresh(&mut state, 0);
///     assert_eq!(shape.check(&state, 0, 1), Verdict::Admit { delay });
///     shape.commit(&mut state, 0, 1);
/// }
/// // A fourth would wait 3 s: denied until a unit has leaked out, at 1 s.
/// assert_eq!(shape.check(&state, 0, 1), Verdict::Deny { retry_after: SECOND });
/// // More than the capacity never fits; a request that costs nothing goes at once.
/// assert_eq!(shape.check(&state, 0, 4), Verdict::Never);
/// assert_eq!(shape.check(&state, 0, 0), Verdict::Admit { delay: 0 });
/// // No unit request may queue now; the queue is empty at 3 s.
/// let snapshot = shape.snapshot(&state, 0);
/// assert_eq!(snapshot.remaining, 0);
/// assert_eq!((snapshot.reset, snapshot.fresh_at), (3 * SECOND, 3 * SECOND));
/// // `effective_window`: once an empty queue has admitted its 3, the next may queue
/// // 1 s later.
/// assert_eq!(shape.effective_window(&BucketState::default(), 0, 3), SECOND);
///
/// // At 1 s a unit has leaked out: the next request is admitted, to be served at 3 s.
/// shape.refresh(&mut state, SECOND);
/// assert_eq!(shape.check(&state, SECOND, 1), Verdict::Admit { delay: 2 * SECOND });
/// // `refund`: a queued request given up leaves the queue, and the next waits less.
/// shape.refund(&mut state, SECOND, 1, u64::MAX, None);
/// assert_eq!(shape.check(&state, SECOND, 1), Verdict::Admit { delay: SECOND });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeakyShape {
    /// Units leaked per period.
    pub(super) amount: u64,
    /// The period in nanoseconds.
    pub(super) period: u64,
    /// The longest wait, in nanoseconds.
    pub(super) max_delay: u64,
}

impl LeakyShape {
    /// Leaks `amount` units every `period` nanoseconds and holds a request back at most
    /// `max_delay` nanoseconds; `None` when `amount` or `period` is zero, or a count or
    /// a time is past [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(amount: u64, period: u64, max_delay: u64) -> Option<Self> {
        (amount > 0 && super::within_bounds(&[amount], &[period]) && max_delay <= super::MAX_NANOS)
            .then_some(Self {
                amount,
                period,
                max_delay,
            })
    }
}

impl LeakyShape {
    /// The most a request may find in the bucket and still be admitted (scaled).
    #[inline]
    fn threshold(&self) -> u128 {
        u128::from(self.max_delay) * u128::from(self.amount)
    }

    /// The number of unit requests an empty bucket admits back to back.
    #[inline]
    pub fn capacity(&self) -> u64 {
        nanos(div(self.threshold(), u128::from(self.period))).saturating_add(1)
    }

    #[inline]
    fn as_bucket(&self) -> TokenBucket {
        TokenBucket {
            capacity: self.capacity(),
            amount: self.amount,
            period: self.period,
        }
    }

    /// Leaks the bucket for the time since the last update.
    #[inline]
    pub fn refresh(&self, state: &mut BucketState, now: u64) {
        self.as_bucket().refresh(state, now);
    }

    /// The earliest time the state can be read at: its own. A request decided as of an
    /// earlier time (another was served first, having read the clock later) is booked as
    /// of the state's, so its booking's end is where the queue ends
    /// ([`queue_end`](Self::queue_end)), which giving it back checks.
    #[inline]
    pub fn floor(&self, state: &BucketState) -> u64 {
        state.last
    }

    /// When the queue ends (the units queued last have leaked out), in nanoseconds: the
    /// end of the newest booking, while it is ahead.
    ///
    /// ```
    /// use tollgate::algorithm::{BucketState, LeakyShape};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let shape = LeakyShape::new(1, SECOND, 2 * SECOND).unwrap();
    /// let mut state = BucketState::default();
    /// shape.commit(&mut state, 0, 3);
    /// assert_eq!(shape.queue_end(&state), 3 * SECOND);
    /// // Leaking moves the state's time on (`floor`), not the queue's end.
    /// shape.refresh(&mut state, SECOND);
    /// assert_eq!(shape.floor(&state), SECOND);
    /// assert_eq!(shape.queue_end(&state), 3 * SECOND);
    /// ```
    #[inline]
    pub fn queue_end(&self, state: &BucketState) -> u64 {
        state
            .last
            .saturating_add(nanos(div_ceil(state.level.get(), u128::from(self.amount))))
    }

    /// Admit with the wait for what is ahead, or deny when that wait is too long. A cost
    /// larger than the unit requests an empty bucket admits back to back never fits: it
    /// would hold the key for longer than the delay bound allows. A request that costs
    /// nothing queues nothing: it goes at once, however long the queue.
    #[inline]
    pub fn check(&self, state: &BucketState, _now: u64, cost: u64) -> Verdict {
        if cost > self.capacity() {
            return Verdict::Never;
        }
        if cost == 0 {
            return Verdict::Admit { delay: 0 };
        }
        let amount = u128::from(self.amount);
        if state.level.get() <= self.threshold() {
            Verdict::Admit {
                delay: nanos(div_ceil(state.level.get(), amount)),
            }
        } else {
            Verdict::Deny {
                retry_after: nanos(div_ceil(state.level.get() - self.threshold(), amount)),
            }
        }
    }

    /// Queues `cost` units.
    #[inline]
    pub fn commit(&self, state: &mut BucketState, now: u64, cost: u64) {
        self.as_bucket().commit(state, now, cost);
    }

    /// Takes `units` out of the queue, never below empty.
    #[inline]
    pub fn refund(
        &self,
        state: &mut BucketState,
        now: u64,
        units: u64,
        at: u64,
        left: Option<u64>,
    ) {
        self.as_bucket().refund(state, now, units, at, left);
    }

    /// The draft-11 effective window: nanoseconds until one more unit could queue after
    /// `remaining` were queued now.
    #[inline]
    pub fn effective_window(&self, state: &BucketState, now: u64, remaining: u64) -> u64 {
        let mut spent = *state;
        self.commit(&mut spent, now, remaining);
        match self.check(&spent, now, 1) {
            Verdict::Deny { retry_after } => retry_after,
            Verdict::Admit { .. } | Verdict::Never => 0,
        }
    }

    /// Units queued past what admissions can queue (a settle charged past it), rounded
    /// up. A level up to the capacity past the threshold owes nothing: a request of up to
    /// the capacity is admitted at the threshold, and puts it there.
    ///
    /// ```
    /// use tollgate::algorithm::{BucketState, LeakyShape};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// // Admissions queue 5 units at most: a request of the capacity, 3, admitted
    /// // behind 2 s of queue (2 units).
    /// let shape = LeakyShape::new(1, SECOND, 2 * SECOND).unwrap();
    /// let mut state = BucketState::default();
    /// shape.commit(&mut state, 0, 5);
    /// assert_eq!(shape.owed(&state, 0), 0);
    /// // A settle that queues one more leaves one owed.
    /// shape.commit(&mut state, 0, 1);
    /// assert_eq!(shape.owed(&state, 0), 1);
    /// ```
    #[inline]
    pub fn owed(&self, state: &BucketState, _now: u64) -> u64 {
        let period = u128::from(self.period);
        let queued = self.threshold() + u128::from(self.capacity()) * period;
        state
            .level
            .get()
            .checked_sub(queued)
            .map_or(0, |over| nanos(div_ceil(over, period)))
    }

    /// Units that must leak out before a unit request fits again, beyond the one that
    /// puts the level back at the threshold: what setting a number of unit requests left
    /// gives back besides that number (a level up to one unit past the threshold has
    /// none). Unlike [`owed`](Self::owed), this counts what admissions queued too.
    ///
    /// ```
    /// use tollgate::algorithm::{BucketState, LeakyShape, Verdict};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let shape = LeakyShape::new(1, SECOND, 2 * SECOND).unwrap();
    /// let mut state = BucketState::default();
    /// // 3 queued: one unit must leak out before a unit request fits, and that is all.
    /// shape.commit(&mut state, 0, 3);
    /// assert_eq!(shape.check(&state, 0, 1), Verdict::Deny { retry_after: SECOND });
    /// assert_eq!(shape.excess(&state, 0), 0);
    /// // 4 queued: two must leak out; one is excess, though nothing is owed.
    /// shape.commit(&mut state, 0, 1);
    /// assert_eq!(shape.check(&state, 0, 1), Verdict::Deny { retry_after: 2 * SECOND });
    /// assert_eq!((shape.excess(&state, 0), shape.owed(&state, 0)), (1, 0));
    /// ```
    #[inline]
    pub fn excess(&self, state: &BucketState, _now: u64) -> u64 {
        let period = u128::from(self.period);
        state
            .level
            .get()
            .checked_sub(self.threshold() + period)
            .map_or(0, |over| nanos(div_ceil(over, period)))
    }

    /// What a client sees now: unit requests that may still queue, time until empty.
    #[inline]
    pub fn snapshot(&self, state: &BucketState, now: u64) -> Snapshot {
        let mut snapshot = self.as_bucket().snapshot(state, now);
        snapshot.remaining = if state.level.get() <= self.threshold() {
            nanos(div(
                self.threshold() - state.level.get(),
                u128::from(self.period),
            ))
            .saturating_add(1)
        } else {
            0
        };
        snapshot
    }
}
