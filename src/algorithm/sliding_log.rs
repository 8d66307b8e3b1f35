//! Sliding log: remember every admitted request for one window. Exact, O(limit) memory.

use std::collections::VecDeque;

use super::{Snapshot, Verdict};

/// The most entries a costly request's wait reads. Within them the wait is exact; past
/// them it is an upper bound: the time by which the request certainly fits, each entry
/// beyond holding one unit at least (`lua/sliding_log.lua` reads as many of its members).
pub(crate) const WALK: usize = 256;

/// Parameters: at most `limit` units in any `window` nanoseconds.
///
/// A denied request waits until enough of the oldest entries have left the window.
///
/// ```
/// use tollgate::algorithm::{LogState, MAX_UNITS, SlidingLog, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: a zero window, a limit past the bounds.
/// assert_eq!(SlidingLog::new(3, 0), None);
/// assert_eq!(SlidingLog::new(MAX_UNITS + 1, 10 * SECOND), None);
///
/// // At most 3 units in any 10 s.
/// let log = SlidingLog::new(3, 10 * SECOND).unwrap();
/// assert_eq!((log.limit(), log.window()), (3, 10 * SECOND));
/// let mut state = LogState::default();
/// for (now, cost) in [(SECOND, 2), (4 * SECOND, 1)] {
///     log.refresh(&mut state, now);
///     assert_eq!(log.check(&state, now, cost), Verdict::Admit { delay: 0 });
///     log.commit(&mut state, now, cost);
/// }
///
/// // Full at 5 s: 1 or 2 units fit once the 2 of 1 s leave at 11 s, 3 once the unit
/// // of 4 s leaves too; 4 never fit.
/// let now = 5 * SECOND;
/// log.refresh(&mut state, now);
/// assert_eq!(log.check(&state, now, 1), Verdict::Deny { retry_after: 6 * SECOND });
/// assert_eq!(log.check(&state, now, 2), Verdict::Deny { retry_after: 6 * SECOND });
/// assert_eq!(log.check(&state, now, 3), Verdict::Deny { retry_after: 9 * SECOND });
/// assert_eq!(log.check(&state, now, 4), Verdict::Never);
/// // Nothing left; whole again when the newest entry leaves at 14 s.
/// let snapshot = log.snapshot(&state, now);
/// assert_eq!(snapshot.remaining, 0);
/// assert_eq!((snapshot.reset, snapshot.fresh_at), (9 * SECOND, 14 * SECOND));
/// // `effective_window`: the next unit fits when the oldest entry leaves.
/// assert_eq!(log.effective_window(&state, now, 0), 6 * SECOND);
/// // `floor`: the newest entry's time.
/// assert_eq!(log.floor(&state), 4 * SECOND);
///
/// // At 11 s the 2 of 1 s have left the window (it is `(1 s, 11 s]`).
/// let now = 11 * SECOND;
/// log.refresh(&mut state, now);
/// assert_eq!(log.check(&state, now, 2), Verdict::Admit { delay: 0 });
///
/// // `refund`: the unit recorded at 4 s comes back while its entry is in the log.
/// log.refund(&mut state, now, 1, 4 * SECOND, None);
/// assert_eq!(log.snapshot(&state, now).remaining, 3);
///
/// // `owed`: a settle may log past the limit; what is past it is owed.
/// log.commit(&mut state, now, 5);
/// assert_eq!(log.owed(&state, now), 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLog {
    /// Units admitted in any window.
    pub(super) limit: u64,
    /// Window length in nanoseconds.
    pub(super) window: u64,
}

/// Admitted requests of the last window, oldest first, as `(time, units)`.
///
/// Requests admitted at the same instant share one entry, so the log never holds more
/// entries than units, nor more than one entry per distinct instant.
///
/// ```
/// use tollgate::algorithm::{LogState, SlidingLog};
///
/// const SECOND: u64 = 1_000_000_000;
/// let log = SlidingLog::new(10, 10 * SECOND).unwrap();
/// let mut state = LogState::default();
/// assert_eq!((state.total(), state.entries().len()), (0, 0));
///
/// // Two debits at 1 s share an entry; one at 2 s has its own.
/// log.commit(&mut state, SECOND, 1);
/// log.commit(&mut state, SECOND, 2);
/// log.commit(&mut state, 2 * SECOND, 1);
/// // `entries` and `total`:
/// assert_eq!(state.entries().collect::<Vec<_>>(), [(SECOND, 3), (2 * SECOND, 1)]);
/// assert_eq!(state.total(), 4);
///
/// // A time that stepped back joins the newest entry, keeping the log in order.
/// log.commit(&mut state, SECOND, 1);
/// assert_eq!(state.entries().last(), Some((2 * SECOND, 2)));
///
/// // `refresh` forgets what has left the window.
/// log.refresh(&mut state, 11 * SECOND);
/// assert_eq!(state.entries().collect::<Vec<_>>(), [(2 * SECOND, 2)]);
/// assert_eq!(state.total(), 2);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogState {
    /// `(admitted at, units)`, oldest first.
    pub(super) entries: VecDeque<(u64, u64)>,
    /// The sum of the units in `entries`.
    pub(super) total: u64,
}

impl SlidingLog {
    /// At most `limit` units in any `window` nanoseconds; `None` for a zero window, or a
    /// limit or window past [`MAX_UNITS`](super::MAX_UNITS) or
    /// [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(limit: u64, window: u64) -> Option<Self> {
        super::within_bounds(&[limit], &[window]).then_some(Self { limit, window })
    }

    /// Units admitted in any window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window in nanoseconds.
    pub fn window(&self) -> u64 {
        self.window
    }
}

impl LogState {
    /// The units the log holds (admitted within the last window, as of its last refresh).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// `(admitted at, units)` entries, oldest first.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + '_ {
        self.entries.iter().copied()
    }
}

impl SlidingLog {
    /// Forgets entries that have left the window `(now - window, now]`.
    #[inline]
    pub fn refresh(&self, state: &mut LogState, now: u64) {
        while let Some(&(at, units)) = state.entries.front() {
            if at.saturating_add(self.window) > now {
                break;
            }
            state.total = state.total.saturating_sub(units);
            state.entries.pop_front();
        }
        // A burst's room is given back once the log is mostly empty: kept, an identity
        // that was once admitted at ten thousand instants held them all (256 KiB) for as
        // long as it kept coming, one instant live.
        if state.entries.capacity() > 16 && state.entries.len() < state.entries.capacity() / 4 {
            let len = state.entries.len();
            state.entries.shrink_to(len * 2);
        }
    }

    /// The earliest time the state can be read at: its newest entry's. A request that
    /// read the clock earlier is decided as of then (see `Params::floor`).
    #[inline]
    pub fn floor(&self, state: &LogState) -> u64 {
        state.entries.back().map_or(0, |&(at, _)| at)
    }

    /// Would `cost` units fit now? The state must be refreshed to `now`.
    #[inline]
    pub fn check(&self, state: &LogState, now: u64, cost: u64) -> Verdict {
        if cost > self.limit {
            return Verdict::Never;
        }
        if state.total.saturating_add(cost) <= self.limit {
            return Verdict::Admit { delay: 0 };
        }
        // Wait until enough of the oldest entries have expired: read at most `WALK` of
        // them, so that a costly request's work is bounded whatever the limit.
        let needed = state.total.saturating_add(cost) - self.limit;
        let mut freed: u64 = 0;
        let wait_for = |at: u64| Verdict::Deny {
            retry_after: at.saturating_add(self.window).saturating_sub(now),
        };
        for &(at, units) in state.entries.iter().take(WALK) {
            freed = freed.saturating_add(units);
            if freed >= needed {
                return wait_for(at);
            }
        }
        if state.entries.len() <= WALK {
            // cost <= limit means the whole log frees enough; kept total for safety.
            return Verdict::Deny {
                retry_after: self.window,
            };
        }
        // Past them every entry frees a unit at least: the (needed - freed)-th next one
        // frees enough, whatever the ones between hold (an upper bound of the wait), else
        // the newest does.
        let beyond = usize::try_from(needed - freed).unwrap_or(usize::MAX);
        let index = WALK.saturating_add(beyond - 1);
        let (at, _) = state
            .entries
            .get(index)
            .or(state.entries.back())
            .copied()
            .unwrap_or_default();
        wait_for(at)
    }

    /// Records `cost` units at `now`.
    #[inline]
    pub fn commit(&self, state: &mut LogState, now: u64, cost: u64) {
        if cost == 0 {
            return;
        }
        match state.entries.back_mut() {
            // Time that stepped back joins the newest entry, keeping the log in order.
            Some((at, units)) if *at >= now => *units = units.saturating_add(cost),
            _ => state.entries.push_back((now, cost)),
        }
        state.total = state.total.saturating_add(cost);
    }

    /// Gives back up to `units` recorded at `at` (entries that have left the window are
    /// gone, and so is what they held); with `at` = `u64::MAX`, the newest entries first.
    ///
    /// ```
    /// use tollgate::algorithm::{LogState, SlidingLog};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let log = SlidingLog::new(10, 10 * SECOND).unwrap();
    /// let mut state = LogState::default();
    /// log.commit(&mut state, SECOND, 2);
    /// log.commit(&mut state, 2 * SECOND, 2);
    /// // Up to what the entry of 1 s holds: 5 asked, 2 given back.
    /// log.refund(&mut state, 3 * SECOND, 5, SECOND, None);
    /// assert_eq!(state.entries().collect::<Vec<_>>(), [(2 * SECOND, 2)]);
    /// // Nothing for a time with no entry.
    /// log.refund(&mut state, 3 * SECOND, 1, 3 * SECOND, None);
    /// assert_eq!(state.total(), 2);
    /// // `u64::MAX`: from the newest entries.
    /// log.refund(&mut state, 3 * SECOND, 1, u64::MAX, None);
    /// assert_eq!(state.entries().collect::<Vec<_>>(), [(2 * SECOND, 1)]);
    /// ```
    #[inline]
    pub fn refund(&self, state: &mut LogState, _now: u64, units: u64, at: u64, _left: Option<u64>) {
        // The entries it may take from: the newest ones (as many as hold the units), or
        // the one of `at` (one entry an instant), found by its time. What is read is in
        // proportion to the units given back, never to the log.
        let mut left = units;
        if at == super::ANY_TIME {
            while left > 0
                && let Some((_, held)) = state.entries.back_mut()
            {
                let taken = left.min(*held);
                *held -= taken;
                left -= taken;
                state.total = state.total.saturating_sub(taken);
                if *held == 0 {
                    state.entries.pop_back();
                }
            }
            return;
        }
        let index = state.entries.partition_point(|&(time, _)| time < at);
        if let Some((time, held)) = state.entries.get_mut(index)
            && *time == at
        {
            let taken = left.min(*held);
            *held -= taken;
            state.total = state.total.saturating_sub(taken);
            if *held == 0 {
                state.entries.remove(index);
            }
        }
    }

    /// The draft-11 effective window: nanoseconds until one more unit fits after the
    /// `remaining` were taken now. That is when the oldest counted entry leaves (a whole
    /// window when the log is empty), unless a settle charged the log past its limit:
    /// then when enough of the oldest have left (the wait of a one-unit request).
    #[inline]
    pub fn effective_window(&self, state: &LogState, now: u64, _remaining: u64) -> u64 {
        if state.total > self.limit
            && let Verdict::Deny { retry_after } = self.check(state, now, 1)
        {
            return retry_after.max(1);
        }
        state.entries.front().map_or(self.window, |&(at, _)| {
            at.saturating_add(self.window).saturating_sub(now).max(1)
        })
    }

    /// Units logged past the limit (a settle charged past empty).
    #[inline]
    pub fn owed(&self, state: &LogState, _now: u64) -> u64 {
        state.total.saturating_sub(self.limit)
    }

    /// What a client sees now.
    #[inline]
    pub fn snapshot(&self, state: &LogState, now: u64) -> Snapshot {
        let fresh_at = state
            .entries
            .back()
            .map_or(0, |&(at, _)| at.saturating_add(self.window));
        Snapshot {
            remaining: self.limit.saturating_sub(state.total),
            reset: fresh_at.saturating_sub(now),
            fresh_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log's buffer grew to its peak and never gave it back: an identity admitted at
    /// ten thousand instants, then once every half hour under an hour's window, kept
    /// room for 16,384 entries (256 KiB) with one live, for as long as it kept coming.
    #[test]
    fn a_burst_s_room_is_given_back_once_the_log_empties() {
        const SECOND: u64 = 1_000_000_000;
        let log = SlidingLog::new(10_000, 3_600 * SECOND).unwrap();
        let mut state = LogState::default();
        for n in 0..10_000 {
            log.commit(&mut state, n, 1);
        }
        assert!(state.entries.capacity() >= 10_000);
        for half_hour in 2..6 {
            let now = half_hour * 1_800 * SECOND;
            log.refresh(&mut state, now);
            log.commit(&mut state, now, 1);
        }
        assert_eq!(state.total(), 2);
        assert!(
            state.entries.capacity() <= 16,
            "room for {} entries kept",
            state.entries.capacity()
        );
    }
}
