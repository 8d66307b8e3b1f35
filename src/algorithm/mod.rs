//! The algorithms as pure math: `(state, now, cost) -> (state, verdict)`.
//!
//! Nothing here does I/O or reads a clock: callers pass `now` in nanoseconds on their own
//! monotonic time line. Every algorithm has the same steps:
//!
//! - `refresh(state, now)` brings the state up to `now` without changing its meaning
//!   (expire log entries, roll windows, refill buckets);
//! - `check(state, now, cost)` answers whether `cost` fits, without changing anything;
//! - `commit(state, now, cost)` debits it;
//! - `snapshot(state, now)` reports what a client sees (remaining, reset), and
//!   `effective_window(state, now, remaining)` the draft-11 `t`.
//!
//! A store reaches them through `Params`, which dispatches on the algorithm; a policy
//! deciding alone (the common request) runs all of them in one function of its own
//! algorithm (`Params::decide_alone`, written once over the crate-private `Steps`).
//!
//! Splitting check from commit is what makes several policies all-or-nothing: every
//! policy is checked first and only then, if all admit, debited.
//!
//! # Example
//!
//! A token bucket of 2 tokens that gains one a second, deciding as a store does: bring
//! the state up to `now`, check, and debit only what is admitted. Times are nanoseconds.
//!
//! ```
//! use tollgate::algorithm::{BucketState, TokenBucket, Verdict};
//!
//! const SECOND: u64 = 1_000_000_000;
//!
//! fn decide(bucket: &TokenBucket, state: &mut BucketState, now: u64, cost: u64) -> Verdict {
//!     bucket.refresh(state, now);
//!     let verdict = bucket.check(state, now, cost);
//!     if let Verdict::Admit { .. } = verdict {
//!         bucket.commit(state, now, cost);
//!     }
//!     verdict
//! }
//!
//! let bucket = TokenBucket::new(2, 1, SECOND).unwrap();
//! let mut state = BucketState::default(); // a full bucket
//!
//! // At 0 s the burst of 2 is admitted; a third unit has to wait one second.
//! assert_eq!(decide(&bucket, &mut state, 0, 1), Verdict::Admit { delay: 0 });
//! assert_eq!(decide(&bucket, &mut state, 0, 1), Verdict::Admit { delay: 0 });
//! assert_eq!(decide(&bucket, &mut state, 0, 1), Verdict::Deny { retry_after: SECOND });
//! // More than the bucket holds never fits, however long the client waits.
//! assert_eq!(decide(&bucket, &mut state, 0, 3), Verdict::Never);
//!
//! // What the client is told at 0 s: nothing left, the bucket full again in 2 s, and
//! // (the draft-11 `t`) the next unit in 1 s.
//! let snapshot = bucket.snapshot(&state, 0);
//! assert_eq!((snapshot.remaining, snapshot.reset), (0, 2 * SECOND));
//! assert_eq!(bucket.effective_window(&state, 0, snapshot.remaining), SECOND);
//!
//! // Half a second later the wait is half as long; at 1 s the next unit is admitted.
//! let half = SECOND / 2;
//! assert_eq!(decide(&bucket, &mut state, half, 1), Verdict::Deny { retry_after: half });
//! assert_eq!(decide(&bucket, &mut state, SECOND, 1), Verdict::Admit { delay: 0 });
//! ```
//!
//! Two policies on one request: both are checked before either is debited, so the
//! bucket keeps the token of a request the window refuses.
//!
//! ```
//! use tollgate::algorithm::{BucketState, FixedWindow, TokenBucket, Verdict, WindowState};
//!
//! const SECOND: u64 = 1_000_000_000;
//! let bucket = TokenBucket::new(10, 1, SECOND).unwrap();
//! let window = FixedWindow::new(1, 60 * SECOND).unwrap();
//! let (mut tokens, mut count) = (BucketState::default(), WindowState::default());
//!
//! for (now, admitted) in [(0, true), (SECOND / 2, false)] {
//!     bucket.refresh(&mut tokens, now);
//!     window.refresh(&mut count, now);
//!     let verdicts = [bucket.check(&tokens, now, 1), window.check(&count, now, 1)];
//!     let all = verdicts.iter().all(|verdict| matches!(verdict, Verdict::Admit { .. }));
//!     if all {
//!         bucket.commit(&mut tokens, now, 1);
//!         window.commit(&mut count, now, 1);
//!     }
//!     assert_eq!(all, admitted);
//! }
//! // The bucket would have admitted the second request, but the window did not: only
//! // the first one's token is missing, half refilled by now. 9 whole tokens are left
//! // (not 8), and the bucket is full again in half a second.
//! let snapshot = bucket.snapshot(&tokens, SECOND / 2);
//! assert_eq!((snapshot.remaining, snapshot.reset), (9, SECOND / 2));
//! ```

mod fixed_window;
mod gcra;
mod in_flight;
mod leaky_shape;
mod penalty;
mod sliding_log;
mod sliding_window;
mod token_bucket;

use std::time::Duration;

pub use fixed_window::{FixedWindow, WindowState};
pub use gcra::{Gcra, GcraState};
pub use in_flight::{IN_FLIGHT_RETRY, InFlight, InFlightState};
pub use leaky_shape::LeakyShape;
pub use penalty::{PenaltyBox, PenaltyState};
pub use sliding_log::{LogState, SlidingLog};
pub use sliding_window::{CounterState, MAX_SUB_WINDOWS, SlidingWindow};
pub use token_bucket::{BucketState, LeakyPolice, TokenBucket};

/// `ceil(a / b)` for `b > 0`. Values almost always fit in 64 bits, where division is
/// several times cheaper than the 128-bit library call.
#[inline]
pub(crate) fn div_ceil(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a.div_ceil(b)),
        _ => a.div_ceil(b),
    }
}

/// `floor(a / b)` for `b > 0`, with the same 64-bit fast path.
#[inline]
pub(crate) fn div(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a / b),
        _ => a / b,
    }
}

/// The most units (a limit, a capacity, a burst, an amount per period) an algorithm is
/// built with: the policies' own bound (`policy::MAX_LIMIT`), within which no product
/// of units and nanoseconds leaves 128 bits and Redis's scripts count exactly.
///
/// Every constructor refuses a count past it:
///
/// ```
/// use tollgate::algorithm::{FixedWindow, MAX_UNITS, TokenBucket};
///
/// let minute = 60_000_000_000;
/// assert!(FixedWindow::new(MAX_UNITS, minute).is_some());
/// assert_eq!(FixedWindow::new(MAX_UNITS + 1, minute), None);
/// assert_eq!(TokenBucket::new(10, MAX_UNITS + 1, minute), None);
/// assert_eq!(MAX_UNITS, tollgate::policy::MAX_LIMIT);
/// ```
pub const MAX_UNITS: u64 = 999_999_999_999_999;

/// The longest time (a window, a period, a lease, a delay, a block) an algorithm is
/// built with, in nanoseconds: the policies' own bound (`policy::MAX_PERIOD`, ten years
/// of 366 days).
///
/// Every constructor refuses a time past it (and a zero window or period):
///
/// ```
/// use std::time::Duration;
/// use tollgate::algorithm::{MAX_NANOS, SlidingLog};
///
/// assert_eq!(Duration::from_nanos(MAX_NANOS), tollgate::policy::MAX_PERIOD);
/// assert!(SlidingLog::new(10, MAX_NANOS).is_some());
/// assert_eq!(SlidingLog::new(10, MAX_NANOS + 1), None);
/// assert_eq!(SlidingLog::new(10, 0), None);
/// ```
pub const MAX_NANOS: u64 = 10 * 366 * 24 * 60 * 60 * 1_000_000_000;

/// Whether every one of `units` is at most [`MAX_UNITS`] and every one of `times` is
/// positive and at most [`MAX_NANOS`].
fn within_bounds(units: &[u64], times: &[u64]) -> bool {
    units.iter().all(|&units| units <= MAX_UNITS)
        && times.iter().all(|&time| (1..=MAX_NANOS).contains(&time))
}

/// The `at` of a refund that may take back any counted units, newest first (a grant),
/// rather than those debited at one time.
pub(crate) const ANY_TIME: u64 = u64::MAX;

/// A 128-bit number stored as two 64-bit halves, so that states holding one stay 8-byte
/// aligned: with `u128`'s 16-byte alignment every store entry grew by a third.
///
/// ```
/// use tollgate::algorithm::Wide;
///
/// // `From<u128>` and `get`: a value past 64 bits survives the split into halves.
/// let big = (1u128 << 64) + 7;
/// let mut wide = Wide::from(big);
/// assert_eq!(wide.get(), big);
/// // `set` replaces both halves.
/// wide.set(3);
/// assert_eq!(wide, Wide::from(3));
/// assert_eq!(Wide::default().get(), 0);
/// // Sixteen bytes, aligned as a `u64` is.
/// assert_eq!(std::mem::size_of::<Wide>(), 16);
/// assert_eq!(std::mem::align_of::<Wide>(), std::mem::align_of::<u64>());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wide {
    high: u64,
    low: u64,
}

impl Wide {
    /// The value.
    #[inline]
    pub fn get(self) -> u128 {
        (u128::from(self.high) << 64) | u128::from(self.low)
    }

    /// Replaces the value.
    #[inline]
    pub fn set(&mut self, value: u128) {
        self.high = (value >> 64) as u64;
        self.low = value as u64;
    }
}

impl From<u128> for Wide {
    fn from(value: u128) -> Self {
        let mut wide = Wide::default();
        wide.set(value);
        wide
    }
}

/// The answer of one policy to one request, before anything is debited.
///
/// A policing algorithm admits with no delay or denies; a shaping one
/// ([`LeakyShape`]) admits with the delay to hold the request back. The enum is
/// `#[non_exhaustive]`: a `match` outside this crate needs a wildcard arm.
///
/// ```
/// use tollgate::algorithm::{FixedWindow, LeakyShape, BucketState, Verdict, WindowState};
///
/// const SECOND: u64 = 1_000_000_000;
/// // 2 units per 10 s window, 3 s into the first window, with 2 spent.
/// let window = FixedWindow::new(2, 10 * SECOND).unwrap();
/// let mut state = WindowState::default();
/// window.commit(&mut state, 3 * SECOND, 2);
/// // Denied until the window ends at 10 s; more than the limit is never admitted.
/// assert_eq!(window.check(&state, 3 * SECOND, 1), Verdict::Deny { retry_after: 7 * SECOND });
/// assert_eq!(window.check(&state, 3 * SECOND, 3), Verdict::Never);
///
/// // A shaping bucket leaking one unit a second, with one unit queued: the next one is
/// // admitted, to be served once the queued one has leaked out.
/// let shape = LeakyShape::new(1, SECOND, 2 * SECOND).unwrap();
/// let mut queue = BucketState::default();
/// shape.commit(&mut queue, 0, 1);
/// let verdict = shape.check(&queue, 0, 1);
/// assert_eq!(verdict, Verdict::Admit { delay: SECOND });
///
/// let wait = match verdict {
///     Verdict::Admit { delay } => delay,
///     Verdict::Deny { retry_after } => retry_after,
///     Verdict::Never => u64::MAX,
///     _ => u64::MAX, // a future variant
/// };
/// assert_eq!(wait, SECOND);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Fits; the request should be held back `delay` nanoseconds (shaping only).
    Admit {
        /// Nanoseconds to wait before serving.
        delay: u64,
    },
    /// Does not fit now; it would after `retry_after` nanoseconds.
    Deny {
        /// Nanoseconds until the same request would fit (if nothing else is debited).
        retry_after: u64,
    },
    /// Never fits: the cost is larger than the policy admits at once.
    Never,
}

/// What one policy's state looks like to a client.
///
/// Each algorithm's `snapshot` builds one; the struct is `#[non_exhaustive]`, so code
/// outside this crate reads its fields but does not build it.
///
/// ```
/// use tollgate::algorithm::{LogState, SlidingLog};
///
/// const SECOND: u64 = 1_000_000_000;
/// // At most 3 units in any 10 s.
/// let log = SlidingLog::new(3, 10 * SECOND).unwrap();
/// let mut state = LogState::default();
///
/// // A fresh state: the whole limit, nothing to wait for, nothing to keep.
/// let fresh = log.snapshot(&state, 0);
/// assert_eq!((fresh.remaining, fresh.reset, fresh.fresh_at), (3, 0, 0));
///
/// // 2 units at 1 s, read at 4 s: 1 left; whole again, and forgettable, once the 2
/// // leave the window at 11 s, 7 s from now.
/// log.commit(&mut state, SECOND, 2);
/// let snapshot = log.snapshot(&state, 4 * SECOND);
/// assert_eq!(snapshot.remaining, 1);
/// assert_eq!(snapshot.reset, 7 * SECOND);
/// assert_eq!(snapshot.fresh_at, 11 * SECOND);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Units that could be spent now.
    pub remaining: u64,
    /// Nanoseconds until the quota is whole again (or the window resets).
    pub reset: u64,
    /// The instant the state is indistinguishable from a new one (0: it is now). Stores
    /// may forget the state from then on.
    pub fresh_at: u64,
}

impl Snapshot {
    /// A snapshot whose state is whole again `reset` nanoseconds after `now`.
    #[inline]
    pub(crate) fn resetting_in(now: u64, remaining: u64, reset: u64) -> Self {
        Snapshot {
            remaining,
            reset,
            fresh_at: if reset == 0 {
                0
            } else {
                now.saturating_add(reset)
            },
        }
    }
}

/// Validated parameters in nanoseconds, one variant per algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Params {
    FixedWindow {
        limit: u64,
        window: u64,
    },
    SlidingLog {
        limit: u64,
        window: u64,
    },
    SlidingWindow {
        limit: u64,
        window: u64,
        sub_windows: u64,
    },
    TokenBucket {
        capacity: u64,
        amount: u64,
        period: u64,
    },
    LeakyPolice {
        capacity: u64,
        amount: u64,
        period: u64,
    },
    LeakyShape {
        amount: u64,
        period: u64,
        max_delay: u64,
    },
    Gcra {
        burst: u64,
        amount: u64,
        period: u64,
    },
    /// Requests in flight; `lease` (nanoseconds) bounds how long a store that can lose
    /// its holders (Redis) keeps a slot.
    InFlight {
        limit: u64,
        lease: u64,
    },
}

/// One policy's state as a store keeps it, tagged with the policy's id.
///
/// The id sits beside the variant tag, so a slot is 32 bytes and a store entry with one
/// policy fits one cache line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Fixed window.
    Window { id: u32, state: WindowState },
    /// Sliding log (boxed: the other states are a few words, the log is a queue).
    Log { id: u32, state: Box<LogState> },
    /// Sliding window counter of one sub-window (the previous and the current window).
    Counter { id: u32, state: CounterState },
    /// Sliding window counter of several sub-windows (`k + 1` counts on the heap).
    Ring {
        id: u32,
        state: CounterState<Box<[u64]>>,
    },
    /// Token bucket and both leaky buckets.
    Bucket { id: u32, state: BucketState },
    /// GCRA.
    Gcra { id: u32, state: GcraState },
    /// In-flight limit.
    InFlight { id: u32, state: InFlightState },
    /// A policy's penalty, beside its own slot under an id of its own (boxed: it is rare,
    /// and larger than the others).
    Penalty { id: u32, state: Box<PenaltyState> },
}

impl Slot {
    /// True for an in-flight limit's slot that requests still hold: in process such a slot
    /// is given back when its request ends, however late, so its state is never fresh.
    #[inline]
    pub(crate) fn holds_in_flight(&self) -> bool {
        matches!(self, Slot::InFlight { state, .. } if state.count > 0)
    }

    /// What a window's slot holds spent (units admitted in it): read against its limit,
    /// what an identity has to lose when forgotten; 0 for the other algorithms, whose
    /// state is a time or a level its freshness tells.
    pub(crate) fn spent(&self) -> u128 {
        match self {
            Slot::Window { state, .. } => u128::from(state.count),
            Slot::Log { state, .. } => u128::from(state.total),
            // At most 65 counts of at most 2^64: no overflow.
            Slot::Counter { state, .. } => state.counts.iter().map(|&c| u128::from(c)).sum(),
            Slot::Ring { state, .. } => state.counts.iter().map(|&c| u128::from(c)).sum(),
            Slot::Bucket { .. }
            | Slot::Gcra { .. }
            | Slot::InFlight { .. }
            | Slot::Penalty { .. } => 0,
        }
    }

    /// The id of the policy this slot belongs to.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        match self {
            Slot::Window { id, .. }
            | Slot::Log { id, .. }
            | Slot::Counter { id, .. }
            | Slot::Ring { id, .. }
            | Slot::Bucket { id, .. }
            | Slot::Gcra { id, .. }
            | Slot::InFlight { id, .. }
            | Slot::Penalty { id, .. } => *id,
        }
    }
}

/// An algorithm's steps over its own state, for code written once for every algorithm
/// (the stores' one-policy path). Each algorithm's inherent methods are the steps.
pub(crate) trait Steps<S: ?Sized> {
    fn refresh(&self, state: &mut S, now: u64);
    fn check(&self, state: &S, now: u64, cost: u64) -> Verdict;
    fn commit(&self, state: &mut S, now: u64, cost: u64);
    fn snapshot(&self, state: &S, now: u64) -> Snapshot;
    fn effective_window(&self, state: &S, now: u64, remaining: u64) -> u64;
    fn floor(&self, state: &S) -> u64;

    /// Every step of one policy deciding alone (see [`alone`]).
    #[inline]
    fn alone(self, state: &mut S, now: u64, cost: u64) -> Alone
    where
        Self: Sized,
    {
        alone(self, state, now, cost)
    }
}

macro_rules! steps {
    ($algorithm:ty, $state:ty $(, $generic:ident : $($bound:path),+)?) => {
        impl$(<$generic: $($bound +)+>)? Steps<$state> for $algorithm {
            #[inline]
            fn refresh(&self, state: &mut $state, now: u64) {
                <$algorithm>::refresh(self, state, now)
            }
            #[inline]
            fn check(&self, state: &$state, now: u64, cost: u64) -> Verdict {
                <$algorithm>::check(self, state, now, cost)
            }
            #[inline]
            fn commit(&self, state: &mut $state, now: u64, cost: u64) {
                <$algorithm>::commit(self, state, now, cost)
            }
            #[inline]
            fn snapshot(&self, state: &$state, now: u64) -> Snapshot {
                <$algorithm>::snapshot(self, state, now)
            }
            #[inline]
            fn effective_window(&self, state: &$state, now: u64, remaining: u64) -> u64 {
                <$algorithm>::effective_window(self, state, now, remaining)
            }
            #[inline]
            fn floor(&self, state: &$state) -> u64 {
                <$algorithm>::floor(self, state)
            }
        }
    };
}

steps!(FixedWindow, WindowState);
// The log's slot holds it boxed.
steps!(SlidingLog, Box<LogState>);
steps!(SlidingWindow, CounterState<C>, C: AsRef<[u64]>, AsMut<[u64]>);
steps!(TokenBucket, BucketState);
steps!(LeakyShape, BucketState);
steps!(Gcra, GcraState);
steps!(InFlight, InFlightState);

macro_rules! dispatch {
    ($params:expr, $state:expr, $method:ident ( $($arg:expr),* ), $mismatch:expr) => {
        match ($params, $state) {
            (Params::FixedWindow { limit, window }, Slot::Window { state: s, .. }) =>
                FixedWindow { limit: *limit, window: *window }.$method(s, $($arg),*),
            (Params::SlidingLog { limit, window }, Slot::Log { state: s, .. }) =>
                SlidingLog { limit: *limit, window: *window }.$method(s, $($arg),*),
            (Params::SlidingWindow { limit, window, sub_windows }, Slot::Counter { state: s, .. }) =>
                SlidingWindow { limit: *limit, window: *window, sub_windows: *sub_windows }
                    .$method(s, $($arg),*),
            (Params::SlidingWindow { limit, window, sub_windows }, Slot::Ring { state: s, .. }) =>
                SlidingWindow { limit: *limit, window: *window, sub_windows: *sub_windows }
                    .$method(s, $($arg),*),
            (Params::TokenBucket { capacity, amount, period }, Slot::Bucket { state: s, .. })
            | (Params::LeakyPolice { capacity, amount, period }, Slot::Bucket { state: s, .. }) =>
                TokenBucket { capacity: *capacity, amount: *amount, period: *period }
                    .$method(s, $($arg),*),
            (Params::LeakyShape { amount, period, max_delay }, Slot::Bucket { state: s, .. }) =>
                LeakyShape { amount: *amount, period: *period, max_delay: *max_delay }
                    .$method(s, $($arg),*),
            (Params::Gcra { burst, amount, period }, Slot::Gcra { state: s, .. }) =>
                Gcra { burst: *burst, amount: *amount, period: *period }.$method(s, $($arg),*),
            (Params::InFlight { limit, lease }, Slot::InFlight { state: s, .. }) =>
                InFlight { limit: *limit, lease: *lease }.$method(s, $($arg),*),
            _ => $mismatch,
        }
    };
}

/// What one policy decided on its own: its verdict (already debited when it admits) and
/// its state afterwards, as a client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Alone {
    pub(crate) verdict: Verdict,
    pub(crate) snapshot: Snapshot,
    /// The effective window for `snapshot.remaining`, in nanoseconds.
    pub(crate) effective_window: u64,
    /// The time it was decided as of: `now`, or the state's own when `now` was earlier.
    pub(crate) at: u64,
}

/// Every step of one policy deciding alone, in one function per algorithm: the common
/// request's path is a few hundred bytes of code, not a walk through every algorithm's
/// arm of five dispatches (which an HTTP server, its instruction cache full of its own
/// code, pays for in misses).
#[inline(never)]
fn alone<S: ?Sized, A: Steps<S>>(algorithm: A, state: &mut S, now: u64, cost: u64) -> Alone {
    // A time before the state's own is read as the state's (see `Params::floor`).
    let now = now.max(algorithm.floor(state));
    algorithm.refresh(state, now);
    let verdict = algorithm.check(state, now, cost);
    if let Verdict::Admit { .. } = verdict {
        algorithm.commit(state, now, cost);
    }
    let snapshot = algorithm.snapshot(state, now);
    Alone {
        verdict,
        snapshot,
        effective_window: algorithm.effective_window(state, now, snapshot.remaining),
        at: now,
    }
}

impl Params {
    pub(crate) fn shaping_capacity(amount: u64, period: Duration, max_delay: Duration) -> u64 {
        let period = period.as_nanos();
        if period == 0 {
            return 1;
        }
        let units = max_delay.as_nanos().saturating_mul(u128::from(amount)) / period;
        u64::try_from(units).unwrap_or(u64::MAX).saturating_add(1)
    }

    /// A fresh slot for these parameters, for the policy `id`.
    #[inline]
    pub(crate) fn new_slot(&self, id: u32) -> Slot {
        match self {
            Params::FixedWindow { .. } => Slot::Window {
                id,
                state: WindowState::default(),
            },
            Params::SlidingLog { .. } => Slot::Log {
                id,
                state: Box::default(),
            },
            Params::SlidingWindow {
                limit,
                window,
                sub_windows,
            } if *sub_windows > 1 => Slot::Ring {
                id,
                state: CounterState::for_algorithm(&SlidingWindow {
                    limit: *limit,
                    window: *window,
                    sub_windows: *sub_windows,
                }),
            },
            Params::SlidingWindow { .. } => Slot::Counter {
                id,
                state: CounterState::pair(),
            },
            Params::TokenBucket { .. } | Params::LeakyPolice { .. } | Params::LeakyShape { .. } => {
                Slot::Bucket {
                    id,
                    state: BucketState::default(),
                }
            }
            Params::Gcra { .. } => Slot::Gcra {
                id,
                state: GcraState::default(),
            },
            Params::InFlight { .. } => Slot::InFlight {
                id,
                state: InFlightState::default(),
            },
        }
    }

    /// The most units admitted at once (the quota `q` of the headers).
    #[inline]
    pub(crate) fn limit(&self) -> u64 {
        match *self {
            Params::FixedWindow { limit, .. }
            | Params::SlidingLog { limit, .. }
            | Params::SlidingWindow { limit, .. } => limit,
            Params::TokenBucket { capacity, .. } | Params::LeakyPolice { capacity, .. } => capacity,
            Params::Gcra { burst, .. } => burst,
            Params::InFlight { limit, .. } => limit,
            Params::LeakyShape {
                amount,
                period,
                max_delay,
            } => LeakyShape {
                amount,
                period,
                max_delay,
            }
            .capacity(),
        }
    }

    /// The window of the quota (the `w` of the headers), in nanoseconds: the window, or
    /// the time an empty bucket takes to fill.
    #[inline]
    pub(crate) fn window_nanos(&self) -> u64 {
        match *self {
            Params::FixedWindow { window, .. }
            | Params::SlidingLog { window, .. }
            | Params::SlidingWindow { window, .. } => window,
            Params::InFlight { lease, .. } => lease,
            Params::TokenBucket { amount, period, .. }
            | Params::LeakyPolice { amount, period, .. }
            | Params::LeakyShape { amount, period, .. }
            | Params::Gcra { amount, period, .. } => token_bucket::nanos(div_ceil(
                u128::from(self.limit()) * u128::from(period),
                u128::from(amount),
            )),
        }
    }

    /// At most how long a state that denies a one-unit request for `wait` nanoseconds
    /// takes to be whole again: a bucket or GCRA, the wait for that unit and then for the
    /// rest of its burst (what is owed past empty is in the wait); a log, a window (its
    /// newest entry leaves by then, owed ones too); a counter, a window after its newest
    /// sub-window ends; a fixed window, the wait (its end).
    #[inline]
    pub(crate) fn whole_after(&self, wait: u64) -> u64 {
        match *self {
            Params::FixedWindow { .. } | Params::InFlight { .. } => wait,
            Params::SlidingLog { window, .. } => wait.max(window),
            Params::SlidingWindow {
                window,
                sub_windows,
                ..
            } => wait.max(window.saturating_add(window.div_ceil(sub_windows.max(1)))),
            Params::TokenBucket { amount, period, .. }
            | Params::LeakyPolice { amount, period, .. }
            | Params::LeakyShape { amount, period, .. }
            | Params::Gcra { amount, period, .. } => {
                let unit = token_bucket::nanos(div_ceil(u128::from(period), u128::from(amount)));
                wait.saturating_add(self.window_nanos().saturating_sub(unit))
            }
        }
    }

    /// True when `state` is of this algorithm's kind (for a counter of several
    /// sub-windows: with their number of counts). Any other state is replaced by a fresh
    /// one before it is read.
    #[inline]
    pub(crate) fn fits(&self, state: &Slot) -> bool {
        match (self, state) {
            (Params::FixedWindow { .. }, Slot::Window { .. })
            | (Params::SlidingLog { .. }, Slot::Log { .. })
            | (
                Params::SlidingWindow {
                    sub_windows: 0 | 1, ..
                },
                Slot::Counter { .. },
            )
            | (
                Params::TokenBucket { .. } | Params::LeakyPolice { .. } | Params::LeakyShape { .. },
                Slot::Bucket { .. },
            )
            | (Params::Gcra { .. }, Slot::Gcra { .. })
            | (Params::InFlight { .. }, Slot::InFlight { .. }) => true,
            (Params::SlidingWindow { sub_windows, .. }, Slot::Ring { state: ring, .. }) => {
                *sub_windows > 1 && ring.counts.len() as u64 == *sub_windows + 1
            }
            _ => false,
        }
    }

    /// Brings `state` up to `now`; a state of the wrong kind is replaced by a fresh one.
    #[inline]
    pub(crate) fn refresh(&self, state: &mut Slot, now: u64) {
        if !self.fits(state) {
            *state = self.new_slot(state.id());
        }
        dispatch!(self, state, refresh(now), ())
    }

    /// Refreshes, checks and (when it admits) commits `cost` units as the only policy of
    /// a request, then snapshots: what `refresh`, `check`, `commit`, `snapshot` and
    /// `effective_window` give one after another. `None`, touching nothing, when `state`
    /// is not of this algorithm's kind (`refresh` replaces such a state first).
    #[inline]
    pub(crate) fn decide_alone(&self, state: &mut Slot, now: u64, cost: u64) -> Option<Alone> {
        if !self.fits(state) {
            return None;
        }
        // `fits` said yes: the mismatch arm is not reached.
        Some(dispatch!(self, state, alone(now, cost), return None))
    }

    /// `now`, or the earliest time `state` can be read at when `now` is earlier.
    ///
    /// Two requests for one key read the clock, then take the key's state in turn; the one
    /// that read first may be served second and see time step back (threads' clocks may
    /// also differ a little). Decided as of the state's own time, it is served as if it
    /// had come just after the other: its debit is recorded at the time its settle will
    /// name, and a denial waits for the end of the window the state counts in. (A Redis
    /// script reads one clock, the server's, under the key's lock.)
    #[inline]
    pub(crate) fn floor(&self, state: &Slot, now: u64) -> u64 {
        now.max(dispatch!(self, state, floor(), 0))
    }

    #[inline]
    pub(crate) fn check(&self, state: &Slot, now: u64, cost: u64) -> Verdict {
        dispatch!(self, state, check(now, cost), Verdict::Admit { delay: 0 })
    }

    #[inline]
    pub(crate) fn commit(&self, state: &mut Slot, now: u64, cost: u64) {
        dispatch!(self, state, commit(now, cost), ())
    }

    /// Gives back `units` debited at `at` (the store's time of the debit), as far as the
    /// state still holds them: a window that has ended is not reopened, a bucket is never
    /// filled above full. For an in-flight limit, frees `units` slots.
    #[inline]
    pub(crate) fn refund(
        &self,
        state: &mut Slot,
        now: u64,
        units: u64,
        at: u64,
        left: Option<u64>,
    ) {
        dispatch!(self, state, refund(now, units, at, left), ())
    }

    /// When a shaping policy's queue ends (see `LeakyShape::queue_end`); `None` for
    /// another algorithm, or a state of the wrong kind.
    #[inline]
    pub(crate) fn queue_end(&self, state: &Slot) -> Option<u64> {
        let (shape, state) = self.as_shape(state)?;
        Some(shape.queue_end(state))
    }

    /// A shaping policy's parameters and its bucket's state; `None` for another
    /// algorithm, or a state of the wrong kind.
    #[inline]
    fn as_shape<'s>(&self, state: &'s Slot) -> Option<(LeakyShape, &'s BucketState)> {
        match (self, state) {
            (
                Params::LeakyShape {
                    amount,
                    period,
                    max_delay,
                },
                Slot::Bucket { state: s, .. },
            ) => Some((
                LeakyShape {
                    amount: *amount,
                    period: *period,
                    max_delay: *max_delay,
                },
                s,
            )),
            _ => None,
        }
    }

    /// True for a shaping policy: it holds requests back instead of denying them.
    #[inline]
    pub(crate) fn is_shaping(&self) -> bool {
        matches!(self, Params::LeakyShape { .. })
    }

    /// True for an in-flight limit: its slots are given back when the request ends.
    #[inline]
    pub(crate) fn is_in_flight(&self) -> bool {
        matches!(self, Params::InFlight { .. })
    }

    /// True when this algorithm's quota is whole again at window boundaries aligned to
    /// the clock: one instant for every identity (a fixed window). A bucket's, GCRA's, a
    /// log's or a sliding counter's times follow each identity's own use.
    #[inline]
    pub(crate) fn ends_on_the_clock(&self) -> bool {
        matches!(self, Params::FixedWindow { .. })
    }

    /// The draft-11 *effective window* in nanoseconds: how long, from `now`, the client can
    /// use no more than `remaining` units. It is the time until one more unit would fit
    /// after `remaining` were spent now: for a bucket or GCRA the next unit's arrival (not
    /// the time until full), for a fixed window its end, for a sliding log the moment its
    /// oldest entry leaves, for the counter the moment its estimate lets one more in.
    #[inline]
    pub(crate) fn effective_window(&self, state: &Slot, now: u64, remaining: u64) -> u64 {
        dispatch!(self, state, effective_window(now, remaining), 0)
    }

    /// Units owed now: how far past empty a settle charged `state` (0 when it is not).
    #[inline]
    pub(crate) fn owed(&self, state: &Slot, now: u64) -> u64 {
        dispatch!(self, state, owed(now), 0)
    }

    /// Units to give back, besides the number of units to have left, for that number to
    /// be left ([`owed`](Self::owed), but for the shaping bucket, whose admissions queue
    /// past what leaves room too).
    #[inline]
    pub(crate) fn excess(&self, state: &Slot, now: u64) -> u64 {
        match self.as_shape(state) {
            Some((shape, state)) => shape.excess(state, now),
            None => self.owed(state, now),
        }
    }

    /// What a client sees of `state` now.
    #[inline]
    pub(crate) fn snapshot(&self, state: &Slot, now: u64) -> Snapshot {
        dispatch!(
            self,
            state,
            snapshot(now),
            Snapshot {
                remaining: self.limit(),
                reset: 0,
                fresh_at: 0,
            }
        )
    }
}
