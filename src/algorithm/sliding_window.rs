//! Sliding window counter: two counters and a weighted estimate.
//!
//! The estimate is `previous * (window - elapsed) / window + current`, with the weighted
//! part rounded up so the estimate never falls below the formula. O(1) state; it assumes
//! the previous window's requests were spread evenly, so it can be off either way against
//! an exact log.

use super::{Snapshot, Verdict, div_ceil};

/// Parameters: `limit` units per (estimated) `window` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Units per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: u64,
}

/// The counts of the current and the previous window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterState {
    /// `now / window` of the current window.
    pub index: u64,
    /// Units admitted in the previous window.
    pub previous: u64,
    /// Units admitted in the current window.
    pub current: u64,
}

impl SlidingWindow {
    /// Rolls the counters to the window `now` falls in (never back to an earlier one).
    #[inline]
    pub fn refresh(&self, state: &mut CounterState, now: u64) {
        let index = now / self.window;
        if index <= state.index {
            return;
        }
        state.previous = if index == state.index + 1 {
            state.current
        } else {
            0
        };
        state.current = 0;
        state.index = index;
    }

    /// Time into the state's current window; 0 if `now` stepped back before it.
    #[inline]
    fn elapsed(&self, state: &CounterState, now: u64) -> u64 {
        if now / self.window == state.index {
            now % self.window
        } else {
            0
        }
    }

    /// `ceil(previous * (window - elapsed) / window) + current`.
    #[inline]
    pub fn estimate(&self, state: &CounterState, now: u64) -> u64 {
        let elapsed = self.elapsed(state, now);
        let weighted = div_ceil(
            u128::from(state.previous) * u128::from(self.window - elapsed),
            u128::from(self.window),
        ) as u64;
        weighted.saturating_add(state.current)
    }

    /// Would `cost` units fit now? The state must be refreshed to `now`.
    #[inline]
    pub fn check(&self, state: &CounterState, now: u64, cost: u64) -> Verdict {
        if cost > self.limit {
            return Verdict::Never;
        }
        if self.estimate(state, now).saturating_add(cost) <= self.limit {
            return Verdict::Admit { delay: 0 };
        }
        let window = u128::from(self.window);
        let elapsed = u128::from(self.elapsed(state, now));
        let room = u128::from(self.limit - cost);
        let current = u128::from(state.current);
        // The smallest elapsed time e' in a window with `weighted` requests behind and
        // `fixed` in it at which ceil(weighted * (w - e') / w) + fixed <= limit - cost.
        let first_fit = |weighted: u128, fixed: u128| -> u128 {
            let spare = room - fixed;
            (spare * window)
                .checked_div(weighted)
                .map_or(0, |left| window - left.min(window))
        };
        let retry_after = if current <= room {
            first_fit(u128::from(state.previous), current).saturating_sub(elapsed)
        } else {
            // Not before the next window, where this window's count becomes the previous.
            (window - elapsed) + first_fit(current, 0)
        };
        Verdict::Deny {
            retry_after: (retry_after.max(1)).min(u128::from(u64::MAX)) as u64,
        }
    }

    /// Debits `cost` units.
    #[inline]
    pub fn commit(&self, state: &mut CounterState, _now: u64, cost: u64) {
        state.current = state.current.saturating_add(cost);
    }

    /// What a client sees now.
    #[inline]
    pub fn snapshot(&self, state: &CounterState, now: u64) -> Snapshot {
        let to_next = self.window - self.elapsed(state, now);
        let reset = if state.current > 0 {
            to_next.saturating_add(self.window)
        } else if state.previous > 0 {
            to_next
        } else {
            0
        };
        Snapshot::resetting_in(
            now,
            self.limit.saturating_sub(self.estimate(state, now)),
            reset,
        )
    }
}
