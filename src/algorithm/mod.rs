//! The algorithms as pure math: `(state, now, cost) -> (state, verdict)`.
//!
//! Nothing here does I/O or reads a clock: callers pass `now` in nanoseconds on their own
//! monotonic time line. Every algorithm has the same four steps:
//!
//! - `refresh(state, now)` brings the state up to `now` without changing its meaning
//!   (expire log entries, roll windows, refill buckets);
//! - `check(state, now, cost)` answers whether `cost` fits, without changing anything;
//! - `commit(state, now, cost)` debits it;
//! - `snapshot(state, now)` reports what a client sees (remaining, reset).
//!
//! Splitting check from commit is what makes several policies all-or-nothing: every
//! policy is checked first and only then, if all admit, debited.

mod fixed_window;
mod gcra;
mod leaky_bucket;
mod sliding_log;
mod sliding_window;
mod token_bucket;

use std::time::Duration;

pub use fixed_window::{FixedWindow, WindowState};
pub use gcra::{Gcra, GcraState};
pub use leaky_bucket::{LeakyPolice, LeakyShape};
pub use sliding_log::{LogState, SlidingLog};
pub use sliding_window::{CounterState, SlidingWindow};
pub use token_bucket::{BucketState, TokenBucket};

use crate::decision::{Decision, Outcome, PolicyStatus};
use crate::policy::Policy;

/// `ceil(a / b)` for `b > 0`.
pub(crate) fn div_ceil(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

/// The answer of one policy to one request, before anything is debited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Units that could be spent now.
    pub remaining: u64,
    /// Nanoseconds until the quota is whole again (or the window resets).
    pub reset: u64,
    /// The instant the state is indistinguishable from a new one (0: it is now). Stores
    /// may forget the state from then on.
    pub fresh_at: u64,
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
}

/// One policy's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Fixed window.
    Window(WindowState),
    /// Sliding log.
    Log(LogState),
    /// Sliding window counter.
    Counter(CounterState),
    /// Token bucket and both leaky buckets.
    Bucket(BucketState),
    /// GCRA.
    Gcra(GcraState),
}

/// One policy's state as a store keeps it, tagged with the policy's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// [`Policy`] id (name and parameters).
    pub id: u64,
    /// The state.
    pub state: State,
}

macro_rules! dispatch {
    ($params:expr, $state:expr, $method:ident ( $($arg:expr),* ), $mismatch:expr) => {
        match ($params, $state) {
            (Params::FixedWindow { limit, window }, State::Window(s)) =>
                FixedWindow { limit: *limit, window: *window }.$method(s, $($arg),*),
            (Params::SlidingLog { limit, window }, State::Log(s)) =>
                SlidingLog { limit: *limit, window: *window }.$method(s, $($arg),*),
            (Params::SlidingWindow { limit, window }, State::Counter(s)) =>
                SlidingWindow { limit: *limit, window: *window }.$method(s, $($arg),*),
            (Params::TokenBucket { capacity, amount, period }, State::Bucket(s))
            | (Params::LeakyPolice { capacity, amount, period }, State::Bucket(s)) =>
                TokenBucket { capacity: *capacity, amount: *amount, period: *period }
                    .$method(s, $($arg),*),
            (Params::LeakyShape { amount, period, max_delay }, State::Bucket(s)) =>
                LeakyShape { amount: *amount, period: *period, max_delay: *max_delay }
                    .$method(s, $($arg),*),
            (Params::Gcra { burst, amount, period }, State::Gcra(s)) =>
                Gcra { burst: *burst, amount: *amount, period: *period }.$method(s, $($arg),*),
            _ => $mismatch,
        }
    };
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

    /// A fresh state for these parameters.
    pub(crate) fn new_state(&self) -> State {
        match self {
            Params::FixedWindow { .. } => State::Window(WindowState::default()),
            Params::SlidingLog { .. } => State::Log(LogState::default()),
            Params::SlidingWindow { .. } => State::Counter(CounterState::default()),
            Params::TokenBucket { .. } | Params::LeakyPolice { .. } | Params::LeakyShape { .. } => {
                State::Bucket(BucketState::default())
            }
            Params::Gcra { .. } => State::Gcra(GcraState::default()),
        }
    }

    /// The most units admitted at once (the quota `q` of the headers).
    pub(crate) fn limit(&self) -> u64 {
        match *self {
            Params::FixedWindow { limit, .. }
            | Params::SlidingLog { limit, .. }
            | Params::SlidingWindow { limit, .. } => limit,
            Params::TokenBucket { capacity, .. } | Params::LeakyPolice { capacity, .. } => capacity,
            Params::Gcra { burst, .. } => burst,
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
    pub(crate) fn window_nanos(&self) -> u64 {
        match *self {
            Params::FixedWindow { window, .. }
            | Params::SlidingLog { window, .. }
            | Params::SlidingWindow { window, .. } => window,
            Params::TokenBucket { amount, period, .. }
            | Params::LeakyPolice { amount, period, .. }
            | Params::LeakyShape { amount, period, .. }
            | Params::Gcra { amount, period, .. } => token_bucket::nanos(div_ceil(
                u128::from(self.limit()) * u128::from(period),
                u128::from(amount),
            )),
        }
    }

    /// Brings `state` up to `now`; a state of the wrong kind is replaced by a fresh one.
    pub(crate) fn refresh(&self, state: &mut State, now: u64) {
        let kind_matches = matches!(
            (self, &*state),
            (Params::FixedWindow { .. }, State::Window(_))
                | (Params::SlidingLog { .. }, State::Log(_))
                | (Params::SlidingWindow { .. }, State::Counter(_))
                | (
                    Params::TokenBucket { .. }
                        | Params::LeakyPolice { .. }
                        | Params::LeakyShape { .. },
                    State::Bucket(_)
                )
                | (Params::Gcra { .. }, State::Gcra(_))
        );
        if !kind_matches {
            *state = self.new_state();
        }
        dispatch!(self, state, refresh(now), ())
    }

    pub(crate) fn check(&self, state: &State, now: u64, cost: u64) -> Verdict {
        dispatch!(self, state, check(now, cost), Verdict::Admit { delay: 0 })
    }

    pub(crate) fn commit(&self, state: &mut State, now: u64, cost: u64) {
        dispatch!(self, state, commit(now, cost), ())
    }

    pub(crate) fn snapshot(&self, state: &State, now: u64) -> Snapshot {
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

/// Decides `cost` units against every policy, all-or-nothing.
///
/// `slots[i]` holds the state of `policies[i]`. Every policy is checked before any is
/// debited; the request is debited from all of them only when all admit it. Returns the
/// decision and the instant from which every slot is fresh again.
pub(crate) fn decide(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
    cost: u64,
) -> (Decision, u64) {
    debug_assert_eq!(policies.len(), slots.len());
    let mut delay = 0;
    let mut denied: Option<(usize, u64)> = None;
    let mut never: Option<usize> = None;
    for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = policy.params();
        params.refresh(&mut slot.state, now);
        match params.check(&slot.state, now, cost) {
            Verdict::Admit { delay: wait } => delay = delay.max(wait),
            Verdict::Deny { retry_after } => {
                // Report the policy that keeps the client waiting longest.
                if denied.is_none_or(|(_, longest)| retry_after > longest) {
                    denied = Some((index, retry_after));
                }
            }
            Verdict::Never => {
                never.get_or_insert(index);
            }
        }
    }
    let outcome = if let Some(policy) = never {
        Outcome::CostExceedsLimit {
            policy,
            cost,
            limit: policies[policy].limit(),
        }
    } else if let Some((policy, retry_after)) = denied {
        Outcome::Denied {
            policy,
            retry_after: Duration::from_nanos(retry_after),
        }
    } else {
        for (policy, slot) in policies.iter().zip(slots.iter_mut()) {
            policy.params().commit(&mut slot.state, now, cost);
        }
        Outcome::Allowed {
            delay: Duration::from_nanos(delay),
        }
    };
    let mut fresh_at = 0;
    let statuses = policies
        .iter()
        .zip(slots.iter())
        .map(|(policy, slot)| {
            let snapshot = policy.params().snapshot(&slot.state, now);
            fresh_at = fresh_at.max(snapshot.fresh_at);
            PolicyStatus {
                limit: policy.limit(),
                remaining: snapshot.remaining,
                reset: Duration::from_nanos(snapshot.reset),
            }
        })
        .collect();
    (Decision::new(outcome, statuses), fresh_at)
}
