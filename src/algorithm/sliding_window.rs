//! Sliding window counter: per-sub-window counts and a weighted estimate.
//!
//! The window of `w` is cut into `k` sub-windows of `w / k` (aligned to the time line's
//! zero). The state keeps the counts of the `k + 1` most recent sub-windows, oldest
//! first. The sliding window `(now - w, now]` covers the `k` newest sub-windows (the
//! current one in part) and the tail of the oldest, so the estimate is
//!
//! ```text
//! counted(oldest) + sum(the k newer counts)
//! counted(oldest) = max(ceil(oldest * (span - elapsed) / span), oldest - floor(limit / k))
//! ```
//!
//! where `span = w / k` and `elapsed` is the time into the current sub-window. The first
//! term assumes the oldest sub-window's requests were spread evenly over it; the second
//! never lets that assumption forgive more than `limit / k` units, so whatever the
//! traffic, no window of length `w` holds more than `limit + limit / k` admitted units.
//! With `k = 1` it is the classic two-counter estimate
//! `previous * (window - elapsed) / window + current` (the bound is then twice the limit).
//!
//! Memory is `k + 1` counters; `k = 1` keeps them inline.

use super::{Snapshot, Verdict, div, div_ceil};

/// Parameters: `limit` units per (estimated) `window` nanoseconds, counted in
/// `sub_windows` equal sub-windows (1 for the classic two-counter estimate).
///
/// `window` must be a multiple of `sub_windows`, and a state must hold `sub_windows + 1`
/// counts ([`CounterState::for_algorithm`]); policies and the stores make sure of both.
/// Other combinations give meaningless answers, never a panic.
///
/// ```
/// use tollgate::algorithm::{CounterState, MAX_SUB_WINDOWS, SlidingWindow, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: no sub-windows, too many, or a window they do not divide (10^10 ns is
/// // not a multiple of 3).
/// assert_eq!(SlidingWindow::new(10, 60 * SECOND, 0), None);
/// assert_eq!(SlidingWindow::new(10, 65 * SECOND, MAX_SUB_WINDOWS + 1), None);
/// assert_eq!(SlidingWindow::new(10, 10 * SECOND, 3), None);
///
/// // 10 units a minute, estimated from the previous and the current minute.
/// let minute = SlidingWindow::new(10, 60 * SECOND, 1).unwrap();
/// assert_eq!((minute.limit(), minute.window(), minute.sub_windows()), (10, 60 * SECOND, 1));
/// let mut state = CounterState::for_algorithm(&minute);
///
/// let now = 30 * SECOND;
/// minute.refresh(&mut state, now);
/// assert_eq!(minute.check(&state, now, 8), Verdict::Admit { delay: 0 });
/// minute.commit(&mut state, now, 8);
/// // 2 more fit. 3 wait until the 8, counted by the share of their minute still inside
/// // the window, count for 7: at 67.5 s. More than the limit never fits.
/// assert_eq!(minute.check(&state, now, 2), Verdict::Admit { delay: 0 });
/// assert_eq!(minute.check(&state, now, 3), Verdict::Deny { retry_after: 37_500_000_000 });
/// assert_eq!(minute.check(&state, now, 11), Verdict::Never);
/// // 2 left; whole again once the minute of the 8 (it ends at 60 s) is a window old.
/// let snapshot = minute.snapshot(&state, now);
/// assert_eq!(snapshot.remaining, 2);
/// assert_eq!((snapshot.reset, snapshot.fresh_at), (90 * SECOND, 120 * SECOND));
/// // `effective_window`: with the 2 left spent now, one more unit fits at 66 s.
/// assert_eq!(minute.effective_window(&state, now, 2), 36 * SECOND);
///
/// // At 90 s half of the previous minute is inside the window: its 8 count for 4.
/// let now = 90 * SECOND;
/// minute.refresh(&mut state, now);
/// assert_eq!(minute.estimate(&state, now), 4);
/// assert_eq!(minute.snapshot(&state, now).remaining, 6);
/// // `floor`: the state counts from the current minute's start.
/// assert_eq!(minute.floor(&state), 60 * SECOND);
/// // `owed`: a settle may charge past the limit; what the estimate holds past it is owed.
/// minute.commit(&mut state, now, 8);
/// assert_eq!(minute.owed(&state, now), 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Units per window.
    pub(super) limit: u64,
    /// Window length in nanoseconds.
    pub(super) window: u64,
    /// How many sub-windows the window is cut into (`k`); 0 is read as 1.
    pub(super) sub_windows: u64,
}

/// The counts of the `k + 1` most recent sub-windows, oldest first; the last is the
/// current one. `C` is `[u64; 2]` for one sub-window (the previous and the current
/// window) and a boxed slice of `k + 1` counts otherwise.
///
/// Outside this crate a state is built with [`CounterState::for_algorithm`], which
/// gives the boxed form for any `k`.
///
/// ```
/// use tollgate::algorithm::{CounterState, SlidingWindow};
///
/// const SECOND: u64 = 1_000_000_000;
/// // A minute in 3 sub-windows of 20 s: 4 counts.
/// let minute = SlidingWindow::new(30, 60 * SECOND, 3).unwrap();
/// let mut state = CounterState::for_algorithm(&minute);
/// assert_eq!((state.index(), state.counts()), (0, &[0, 0, 0, 0][..]));
///
/// // `counts` and `index`: 2 at 5 s, in sub-window 0, then 1 at 25 s, in sub-window 1.
/// minute.commit(&mut state, 5 * SECOND, 2);
/// minute.refresh(&mut state, 25 * SECOND);
/// minute.commit(&mut state, 25 * SECOND, 1);
/// assert_eq!((state.index(), state.counts()), (1, &[0, 0, 2, 1][..]));
/// // At 65 s (sub-window 3) they have moved two places towards the oldest.
/// minute.refresh(&mut state, 65 * SECOND);
/// assert_eq!((state.index(), state.counts()), (3, &[2, 1, 0, 0][..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterState<C = [u64; 2]> {
    /// `now / (window / k)` of the current sub-window.
    pub(super) index: u64,
    /// Units admitted per sub-window, oldest first.
    pub(super) counts: C,
}

impl<C: AsRef<Counts>> CounterState<C> {
    /// The current sub-window's index (`now / (window / k)`).
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Units admitted per sub-window, oldest first (the last is the current one).
    pub fn counts(&self) -> &[u64] {
        self.counts.as_ref()
    }
}

impl CounterState {
    /// An empty state of one sub-window (the previous and the current count, inline).
    pub(super) fn pair() -> Self {
        CounterState {
            index: 0,
            counts: [0; 2],
        }
    }
}

impl CounterState<Box<[u64]>> {
    /// An empty state for `algorithm`'s `k + 1` counts (the only way to build one from
    /// outside the crate, so a state always has the counts its algorithm reads).
    ///
    /// ```
    /// use tollgate::algorithm::{CounterState, SlidingWindow};
    ///
    /// let second = 1_000_000_000;
    /// let classic = SlidingWindow::new(10, 60 * second, 1).unwrap();
    /// assert_eq!(CounterState::for_algorithm(&classic).counts(), [0, 0]);
    /// let split = SlidingWindow::new(10, 60 * second, 6).unwrap();
    /// assert_eq!(CounterState::for_algorithm(&split).counts(), [0; 7]);
    /// ```
    pub fn for_algorithm(algorithm: &SlidingWindow) -> Self {
        CounterState {
            index: 0,
            counts: vec![0; algorithm.k() as usize + 1].into_boxed_slice(),
        }
    }
}

type Counts = [u64];

/// The most sub-windows a counter may have (its state is one counter more).
///
/// ```
/// use tollgate::algorithm::{MAX_SUB_WINDOWS, SlidingWindow};
///
/// let second = 1_000_000_000;
/// assert!(SlidingWindow::new(10, 64 * second, MAX_SUB_WINDOWS).is_some());
/// assert_eq!(SlidingWindow::new(10, 65 * second, MAX_SUB_WINDOWS + 1), None);
/// // The policies' bound (a `u32` there).
/// assert_eq!(MAX_SUB_WINDOWS, u64::from(tollgate::policy::MAX_SUB_WINDOWS));
/// ```
pub const MAX_SUB_WINDOWS: u64 = 64;

impl SlidingWindow {
    /// `limit` units per `window` nanoseconds, counted in `sub_windows` equal sub-windows;
    /// `None` unless `sub_windows` is 1 to [`MAX_SUB_WINDOWS`] and divides `window`, and
    /// the limit and window are within [`MAX_UNITS`](super::MAX_UNITS) and
    /// [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(limit: u64, window: u64, sub_windows: u64) -> Option<Self> {
        (sub_windows > 0
            && sub_windows <= MAX_SUB_WINDOWS
            && super::within_bounds(&[limit], &[window])
            && window.is_multiple_of(sub_windows))
        .then_some(Self {
            limit,
            window,
            sub_windows,
        })
    }

    /// The number of sub-windows.
    pub fn sub_windows(&self) -> u64 {
        self.sub_windows
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

impl SlidingWindow {
    /// The number of sub-windows, `k`.
    #[inline]
    fn k(&self) -> u64 {
        self.sub_windows.max(1)
    }

    /// The length of one sub-window.
    #[inline]
    fn span(&self) -> u64 {
        (self.window / self.k()).max(1)
    }

    /// The most units of the oldest sub-window the estimate may leave out.
    #[inline]
    fn forgiven(&self) -> u64 {
        self.limit / self.k()
    }

    /// The earliest time the state can be read at: the start of its current sub-window.
    /// A request that read the clock earlier is decided as of then (see `Params::floor`).
    #[inline]
    pub fn floor<C>(&self, state: &CounterState<C>) -> u64 {
        state.index.saturating_mul(self.span())
    }

    /// Rolls the counts to the sub-window `now` falls in (never back to an earlier one).
    #[inline]
    pub fn refresh<C: AsMut<Counts>>(&self, state: &mut CounterState<C>, now: u64) {
        let index = now / self.span();
        if index <= state.index {
            return;
        }
        let counts = state.counts.as_mut();
        let shift = index - state.index;
        match usize::try_from(shift) {
            Ok(shift) if shift < counts.len() => {
                counts.copy_within(shift.., 0);
                let len = counts.len();
                counts[len - shift..].fill(0);
            }
            _ => counts.fill(0),
        }
        state.index = index;
    }

    /// Time into the state's current sub-window; 0 if `now` stepped back before it.
    #[inline]
    fn elapsed<C>(&self, state: &CounterState<C>, now: u64) -> u64 {
        let span = self.span();
        if now / span == state.index {
            now % span
        } else {
            0
        }
    }

    /// How far `now` stepped back before the state's current sub-window (0 normally): the
    /// state's times are counted from that sub-window's start, so waits grow by it.
    #[inline]
    fn behind<C>(&self, state: &CounterState<C>, now: u64) -> u64 {
        state.index.saturating_mul(self.span()).saturating_sub(now)
    }

    /// The units of the oldest sub-window still counted, `left` nanoseconds before it
    /// leaves the window entirely.
    #[inline]
    fn counted(&self, oldest: u64, left: u64) -> u64 {
        let weighted = div_ceil(
            u128::from(oldest) * u128::from(left),
            u128::from(self.span()),
        ) as u64;
        weighted.max(oldest.saturating_sub(self.forgiven()))
    }

    /// The estimated units in the window ending at `now`.
    ///
    /// The state must be refreshed to `now`.
    ///
    /// ```
    /// use tollgate::algorithm::{CounterState, SlidingWindow};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// // 9 units per 30 s, in 3 sub-windows of 10 s: at most 9 / 3 = 3 units of the
    /// // oldest sub-window are ever left out.
    /// let window = SlidingWindow::new(9, 30 * SECOND, 3).unwrap();
    /// let mut state = CounterState::for_algorithm(&window);
    /// window.commit(&mut state, 5 * SECOND, 6);
    /// assert_eq!(window.estimate(&state, 5 * SECOND), 6);
    ///
    /// // At 35 s half of the sub-window of the 6 is inside the window: they count for 3.
    /// window.refresh(&mut state, 35 * SECOND);
    /// assert_eq!(window.estimate(&state, 35 * SECOND), 3);
    /// // At 39 s a tenth of it is, but 3 of its 6 still count.
    /// assert_eq!(window.estimate(&state, 39 * SECOND), 3);
    /// // At 40 s it has left the window.
    /// window.refresh(&mut state, 40 * SECOND);
    /// assert_eq!(window.estimate(&state, 40 * SECOND), 0);
    /// ```
    #[inline]
    pub fn estimate<C: AsRef<Counts>>(&self, state: &CounterState<C>, now: u64) -> u64 {
        let Some((&oldest, newer)) = state.counts.as_ref().split_first() else {
            return 0;
        };
        let left = self.span() - self.elapsed(state, now);
        newer
            .iter()
            .fold(self.counted(oldest, left), |sum, &n| sum.saturating_add(n))
    }

    /// Nanoseconds from now until `units` more fit, with `extra` units spent in the
    /// current sub-window first and nothing else debited meanwhile. `units <= limit`.
    fn wait(&self, counts: &Counts, elapsed: u64, units: u64, extra: u64) -> u64 {
        let room = self.limit.saturating_sub(units);
        let span = self.span();
        let Some(last) = counts.len().checked_sub(1) else {
            return span.saturating_sub(elapsed);
        };
        // The counts newer than position `step` (no allocation: this runs on every decision).
        let mut newer_sum = counts
            .iter()
            .skip(1)
            .fold(0u64, |sum, &n| sum.saturating_add(n));
        // In the sub-window `step` from now, position `step` is the oldest; everything
        // older has left the window.
        for (step, &count) in counts.iter().enumerate() {
            if step > 0 {
                newer_sum = newer_sum.saturating_sub(count);
            }
            let (oldest, newer) = if step == last {
                (count.saturating_add(extra), 0)
            } else {
                (count, newer_sum.saturating_add(extra))
            };
            let start = if step == 0 { elapsed } else { 0 };
            if newer > room || oldest.saturating_sub(self.forgiven()) > room - newer {
                continue;
            }
            // The first elapsed time e with ceil(oldest * (span - e) / span) <= room - newer.
            let first = if oldest == 0 {
                0
            } else {
                let left = div(
                    u128::from(room - newer) * u128::from(span),
                    u128::from(oldest),
                );
                span - left.min(u128::from(span)) as u64
            };
            let at = first.max(start);
            if at < span {
                return (step as u64 * span + at) - elapsed;
            }
        }
        // Once every counted sub-window has left, the whole limit fits.
        (counts.len() as u64 * span).saturating_sub(elapsed)
    }

    /// Would `cost` units fit now? The state must be refreshed to `now`.
    #[inline]
    pub fn check<C: AsRef<Counts>>(&self, state: &CounterState<C>, now: u64, cost: u64) -> Verdict {
        if cost > self.limit {
            return Verdict::Never;
        }
        if self.estimate(state, now).saturating_add(cost) <= self.limit {
            return Verdict::Admit { delay: 0 };
        }
        let elapsed = self.elapsed(state, now);
        let wait = self.wait(state.counts.as_ref(), elapsed, cost, 0);
        Verdict::Deny {
            retry_after: wait.saturating_add(self.behind(state, now)).max(1),
        }
    }

    /// Debits `cost` units from the current sub-window.
    #[inline]
    pub fn commit<C: AsMut<Counts>>(&self, state: &mut CounterState<C>, _now: u64, cost: u64) {
        if let Some(current) = state.counts.as_mut().last_mut() {
            *current = current.saturating_add(cost);
        }
    }

    /// Gives back `units` debited at `at` from the sub-window they were counted in, while
    /// it is still counted; with `at` = `u64::MAX`, `units` off the estimate: from the
    /// newest sub-windows first, then as much of the oldest as lowers its counted share
    /// by what is left to give (it counts only in part: taken off whole, its units gave
    /// back less than asked).
    ///
    /// ```
    /// use tollgate::algorithm::{CounterState, SlidingWindow};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let minute = SlidingWindow::new(10, 60 * SECOND, 1).unwrap();
    /// let mut state = CounterState::for_algorithm(&minute);
    /// minute.commit(&mut state, 30 * SECOND, 8);
    /// let now = 90 * SECOND;
    /// minute.refresh(&mut state, now);
    /// minute.commit(&mut state, now, 2);
    /// // The previous minute's 8 count for half, the current minute's 2 in full.
    /// assert_eq!(minute.estimate(&state, now), 6);
    ///
    /// // 2 debited at 30 s come off the previous minute, where they counted for 1.
    /// minute.refund(&mut state, now, 2, 30 * SECOND, None);
    /// assert_eq!(state.counts(), [6, 2]);
    /// assert_eq!(minute.estimate(&state, now), 5);
    ///
    /// // `u64::MAX`: 3 off the estimate, the current minute's 2 first.
    /// minute.refund(&mut state, now, 3, u64::MAX, None);
    /// assert_eq!(minute.estimate(&state, now), 2);
    /// ```
    #[inline]
    pub fn refund<C: AsMut<Counts>>(
        &self,
        state: &mut CounterState<C>,
        now: u64,
        units: u64,
        at: u64,
        _left: Option<u64>,
    ) {
        if at == super::ANY_TIME {
            let to_go = self.span() - self.elapsed(state, now);
            let Some((oldest, newer)) = state.counts.as_mut().split_first_mut() else {
                return;
            };
            let mut left = units;
            for count in newer.iter_mut().rev() {
                let taken = left.min(*count);
                *count -= taken;
                left -= taken;
            }
            if left > 0 && *oldest > 0 {
                // The most of it that counts `target` or less: its share still inside
                // the window, and what is never forgiven, each at most `target`.
                let target = self.counted(*oldest, to_go).saturating_sub(left);
                let by_share =
                    u128::from(target) * u128::from(self.span()) / u128::from(to_go.max(1));
                let by_share = u64::try_from(by_share).unwrap_or(u64::MAX);
                // But no less than gives back `left` once what is never forgiven is all
                // that counts of it (its share shrinks as the sub-window runs on): lower,
                // it would give back more than asked later in the sub-window. There the
                // grant gives back less now, never more later.
                let floor = if oldest.saturating_sub(self.forgiven()) > left {
                    *oldest - left
                } else {
                    0
                };
                *oldest = (*oldest)
                    .min(target.saturating_add(self.forgiven()))
                    .min(by_share)
                    .max(floor);
            }
            return;
        }
        let counts = state.counts.as_mut();
        let at_index = at / self.span();
        let Some(age) = state.index.checked_sub(at_index) else {
            return;
        };
        if let Some(position) = (counts.len() as u64 - 1).checked_sub(age) {
            let count = &mut counts[position as usize];
            *count = count.saturating_sub(units);
        }
    }

    /// The draft-11 effective window: nanoseconds until one more unit fits after the
    /// `remaining` units were spent now (0 if one more fits even then).
    #[inline]
    pub fn effective_window<C: AsRef<Counts>>(
        &self,
        state: &CounterState<C>,
        now: u64,
        remaining: u64,
    ) -> u64 {
        let estimate = self.estimate(state, now).saturating_add(remaining);
        if estimate.saturating_add(1) <= self.limit {
            return 0;
        }
        let elapsed = self.elapsed(state, now);
        self.wait(state.counts.as_ref(), elapsed, 1, remaining)
            .saturating_add(self.behind(state, now))
            .max(1)
    }

    /// Units counted past the limit (a settle charged past empty).
    #[inline]
    pub fn owed<C: AsRef<Counts>>(&self, state: &CounterState<C>, now: u64) -> u64 {
        self.estimate(state, now).saturating_sub(self.limit)
    }

    /// What a client sees now.
    #[inline]
    pub fn snapshot<C: AsRef<Counts>>(&self, state: &CounterState<C>, now: u64) -> Snapshot {
        let counts = state.counts.as_ref();
        let elapsed = self.elapsed(state, now);
        // A sub-window stops counting once it is a whole window old.
        let reset = counts
            .iter()
            .rposition(|&count| count > 0)
            .map_or(0, |newest| {
                ((newest as u64 + 1).saturating_mul(self.span()) - elapsed)
                    .saturating_add(self.behind(state, now))
            });
        Snapshot::resetting_in(
            now,
            self.limit.saturating_sub(self.estimate(state, now)),
            reset,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant takes what it cannot take from the newer sub-windows off the oldest, which
    /// counts its share still inside the window, but never less than `count - limit / k`.
    /// Lowered so the estimate fell by the grant at once, the oldest later fell by more,
    /// once only that floor counted: a grant of 24 let 48 through. At every later instant
    /// of the sub-window the grant gives back at most what it said; at once, all of it
    /// where that holds (always with one sub-window and nothing owed).
    #[test]
    fn a_grant_never_gives_back_more_later_in_the_sub_window() {
        let span = 6;
        for limit in 1..=12 {
            for k in 1..=4 {
                let algorithm = SlidingWindow::new(limit, span * k, k).unwrap();
                for spent in 0..=limit + 2 {
                    for into in 0..span {
                        let mut state = CounterState::for_algorithm(&algorithm);
                        algorithm.commit(&mut state, 0, spent);
                        // The spent sub-window is the oldest, `into` into the current one.
                        let now = k * span + into;
                        algorithm.refresh(&mut state, now);
                        let before = algorithm.estimate(&state, now);
                        for units in 1..=before {
                            let mut granted = state.clone();
                            algorithm.refund(
                                &mut granted,
                                now,
                                units,
                                crate::algorithm::ANY_TIME,
                                None,
                            );
                            let given = before - algorithm.estimate(&granted, now);
                            assert!(given <= units);
                            if k == 1 && spent <= limit {
                                assert_eq!(given, units, "limit {limit} spent {spent} at {now}");
                            }
                            for later in now..(k + 1) * span {
                                let without = algorithm.estimate(&state, later);
                                let with = algorithm.estimate(&granted, later);
                                assert!(
                                    without - with <= units,
                                    "limit {limit} k {k} spent {spent}: a grant of {units} at \
                                     {now} gave back {} at {later}",
                                    without - with
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
