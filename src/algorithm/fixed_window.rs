//! Fixed window: one counter per window, windows aligned to the clock's origin.
//!
//! A client can spend the whole limit at the end of one window and again at the start of
//! the next: up to twice the limit inside one window's length. That is the price of one
//! counter; the tests show it.

use super::{Snapshot, Verdict};

/// Parameters: `limit` units per `window` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    /// Units per window.
    pub(super) limit: u64,
    /// Window length in nanoseconds (at least 1).
    pub(super) window: u64,
}

/// The counter of the current window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowState {
    /// `now / window` of the window counted in.
    pub(super) index: u64,
    /// Units admitted in that window.
    pub(super) count: u64,
}

impl FixedWindow {
    /// `limit` units per `window` nanoseconds; `None` for a zero window, or a limit or
    /// window past [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(limit: u64, window: u64) -> Option<Self> {
        super::within_bounds(&[limit], &[window]).then_some(Self { limit, window })
    }

    /// Units per window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window in nanoseconds.
    pub fn window(&self) -> u64 {
        self.window
    }
}

impl FixedWindow {
    /// The end of the window the state counts in, or of `now`'s if that is later: a
    /// clock read before the state's window (another thread's, a step back) waits for
    /// the window that holds the count, not for an earlier one.
    #[inline]
    fn window_end(&self, state: &WindowState, now: u64) -> u64 {
        let now = now.max(self.floor(state));
        (now - now % self.window).saturating_add(self.window)
    }

    /// The earliest time the state can be read at: the start of the window it counts in.
    /// A request that read the clock earlier is decided as of then (see `Params::floor`).
    #[inline]
    pub fn floor(&self, state: &WindowState) -> u64 {
        state.index.saturating_mul(self.window)
    }

    /// Moves the state to the window `now` falls in (never back to an earlier one).
    #[inline]
    pub fn refresh(&self, state: &mut WindowState, now: u64) {
        let index = now / self.window;
        if index > state.index {
            *state = WindowState { index, count: 0 };
        }
    }

    /// Would `cost` units fit now? The state must be refreshed to `now`.
    #[inline]
    pub fn check(&self, state: &WindowState, now: u64, cost: u64) -> Verdict {
        if cost > self.limit {
            return Verdict::Never;
        }
        if state.count.saturating_add(cost) <= self.limit {
            Verdict::Admit { delay: 0 }
        } else {
            Verdict::Deny {
                retry_after: self.window_end(state, now) - now,
            }
        }
    }

    /// Debits `cost` units.
    #[inline]
    pub fn commit(&self, state: &mut WindowState, _now: u64, cost: u64) {
        state.count = state.count.saturating_add(cost);
    }

    /// Gives back `units` debited at `at`, if `at` falls in the window counted now (a
    /// window that has ended is not reopened: its units cannot be spent any more); with
    /// `at` = `u64::MAX`, from the window counted now.
    #[inline]
    pub fn refund(
        &self,
        state: &mut WindowState,
        _now: u64,
        units: u64,
        at: u64,
        _left: Option<u64>,
    ) {
        if at == super::ANY_TIME || at / self.window == state.index {
            state.count = state.count.saturating_sub(units);
        }
    }

    /// The draft-11 effective window: nanoseconds until this window ends.
    #[inline]
    pub fn effective_window(&self, state: &WindowState, now: u64, _remaining: u64) -> u64 {
        self.window_end(state, now) - now
    }

    /// Units counted past the limit (a settle charged past empty).
    #[inline]
    pub fn owed(&self, state: &WindowState, _now: u64) -> u64 {
        state.count.saturating_sub(self.limit)
    }

    /// What a client sees now.
    #[inline]
    pub fn snapshot(&self, state: &WindowState, now: u64) -> Snapshot {
        let end = self.window_end(state, now);
        Snapshot {
            remaining: self.limit.saturating_sub(state.count),
            reset: end - now,
            fresh_at: if state.count == 0 { 0 } else { end },
        }
    }
}
