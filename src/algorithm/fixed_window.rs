//! Fixed window: one counter per window, windows aligned to the clock's origin.
//!
//! A client can spend the whole limit at the end of one window and again at the start of
//! the next: up to twice the limit inside one window's length. That is the price of one
//! counter; the tests show it.

use super::{Snapshot, Verdict};

/// Parameters: `limit` units per `window` nanoseconds.
///
/// Windows are aligned to the time line's zero: `[0, window)`, `[window, 2 * window)`,
/// and so on. A denial waits for the current window's end.
///
/// ```
/// use tollgate::algorithm::{FixedWindow, MAX_NANOS, MAX_UNITS, Verdict, WindowState};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: a zero window, a limit or a window past the bounds.
/// assert_eq!(FixedWindow::new(3, 0), None);
/// assert_eq!(FixedWindow::new(MAX_UNITS + 1, 60 * SECOND), None);
/// assert_eq!(FixedWindow::new(3, MAX_NANOS + 1), None);
///
/// // 3 units a minute.
/// let minute = FixedWindow::new(3, 60 * SECOND).unwrap();
/// assert_eq!((minute.limit(), minute.window()), (3, 60 * SECOND));
/// let mut state = WindowState::default();
///
/// let now = 10 * SECOND;
/// minute.refresh(&mut state, now);
/// assert_eq!(minute.check(&state, now, 2), Verdict::Admit { delay: 0 });
/// minute.commit(&mut state, now, 2);
/// // 2 more wait for the window's end at 60 s; 4 never fit.
/// assert_eq!(minute.check(&state, now, 2), Verdict::Deny { retry_after: 50 * SECOND });
/// assert_eq!(minute.check(&state, now, 4), Verdict::Never);
/// let snapshot = minute.snapshot(&state, now);
/// assert_eq!(snapshot.remaining, 1);
/// assert_eq!((snapshot.reset, snapshot.fresh_at), (50 * SECOND, 60 * SECOND));
/// // `effective_window`: the draft-11 `t` is the rest of the window, whatever is left.
/// assert_eq!(minute.effective_window(&state, now, snapshot.remaining), 50 * SECOND);
///
/// // `refund`: units debited at 10 s come back while their window is counted.
/// minute.refund(&mut state, now, 1, now, None);
/// assert_eq!(minute.snapshot(&state, now).remaining, 2);
///
/// // `owed`: a settle may charge past the limit; what is past it is owed.
/// minute.commit(&mut state, now, 3);
/// assert_eq!(minute.owed(&state, now), 1);
/// assert_eq!(minute.snapshot(&state, now).remaining, 0);
///
/// // At 60 s a new window starts with the whole limit, debt and all forgotten.
/// let now = 60 * SECOND;
/// minute.refresh(&mut state, now);
/// assert_eq!(minute.owed(&state, now), 0);
/// assert_eq!(minute.check(&state, now, 3), Verdict::Admit { delay: 0 });
/// minute.commit(&mut state, now, 3);
/// // A refund of a debit from the ended window gives nothing back.
/// minute.refund(&mut state, now, 1, 10 * SECOND, None);
/// assert_eq!(minute.snapshot(&state, now).remaining, 0);
///
/// // `floor`: the state counts in the window from 60 s. A request whose clock read 59 s
/// // but is decided after it is decided as of 60 s: it waits for that window's end.
/// assert_eq!(minute.floor(&state), 60 * SECOND);
/// let late = 59 * SECOND;
/// assert_eq!(minute.check(&state, late, 1), Verdict::Deny { retry_after: 61 * SECOND });
/// ```
///
/// One counter per window lets a client spend the limit at the end of one window and
/// again at the start of the next:
///
/// ```
/// use tollgate::algorithm::{FixedWindow, Verdict, WindowState};
///
/// const SECOND: u64 = 1_000_000_000;
/// let minute = FixedWindow::new(3, 60 * SECOND).unwrap();
/// let mut state = WindowState::default();
/// for now in [59 * SECOND, 60 * SECOND] {
///     minute.refresh(&mut state, now);
///     assert_eq!(minute.check(&state, now, 3), Verdict::Admit { delay: 0 });
///     minute.commit(&mut state, now, 3);
/// }
/// // 6 units within one second, twice the limit.
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    /// Units per window.
    pub(super) limit: u64,
    /// Window length in nanoseconds (at least 1).
    pub(super) window: u64,
}

/// The counter of the current window.
///
/// The default is an empty window at the time line's zero, which any later window
/// replaces on [`FixedWindow::refresh`].
///
/// ```
/// use tollgate::algorithm::{FixedWindow, WindowState};
///
/// const SECOND: u64 = 1_000_000_000;
/// let window = FixedWindow::new(5, SECOND).unwrap();
/// let mut state = WindowState::default();
/// // Empty: the whole limit, and nothing a store needs to keep.
/// let fresh = window.snapshot(&state, 0);
/// assert_eq!((fresh.remaining, fresh.fresh_at), (5, 0));
///
/// window.commit(&mut state, 0, 5);
/// assert_ne!(state, WindowState::default());
/// // Kept until its window ends at 1 s.
/// assert_eq!(window.snapshot(&state, 0).fresh_at, SECOND);
/// ```
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
