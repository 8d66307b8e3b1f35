//! Penalties: a key denied `denials` times within `within` is blocked for `block`, each
//! repeat doubling the block up to `max_block`. Pure math on one state, in nanoseconds.
//!
//! Denials are counted in a window that opens at the first denial after the last one
//! closed. A block starts the count afresh. The number of blocks so far (strikes) is
//! remembered until one longest block has passed after the last block ended; then the
//! next block is the first again.

/// A penalty's parameters, in nanoseconds.
///
/// ```
/// use tollgate::algorithm::{PenaltyBox, PenaltyState};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: no denials, a zero window or block, a cap below the block.
/// assert_eq!(PenaltyBox::new(0, 10 * SECOND, 60 * SECOND, 60 * SECOND), None);
/// assert_eq!(PenaltyBox::new(3, 0, 60 * SECOND, 60 * SECOND), None);
/// assert_eq!(PenaltyBox::new(3, 10 * SECOND, 0, 60 * SECOND), None);
/// assert_eq!(PenaltyBox::new(3, 10 * SECOND, 60 * SECOND, 30 * SECOND), None);
///
/// // 3 denials within 10 s block for 60 s, doubling up to 240 s.
/// let penalty = PenaltyBox::new(3, 10 * SECOND, 60 * SECOND, 240 * SECOND).unwrap();
/// let mut state = PenaltyState::default();
///
/// // `strike` counts a denial; the third within 10 s starts a block.
/// penalty.strike(&mut state, SECOND);
/// penalty.strike(&mut state, 2 * SECOND);
/// assert_eq!(penalty.blocked(&state, 2 * SECOND), None);
/// penalty.strike(&mut state, 3 * SECOND);
/// // `blocked`: how long the block still lasts.
/// assert_eq!(penalty.blocked(&state, 3 * SECOND), Some(60 * SECOND));
/// assert_eq!(penalty.blocked(&state, 33 * SECOND), Some(30 * SECOND));
/// assert_eq!(penalty.blocked(&state, 63 * SECOND), None);
///
/// // Blocked again soon after: twice as long.
/// for now in [70, 71, 72] {
///     penalty.strike(&mut state, now * SECOND);
/// }
/// assert_eq!(penalty.blocked(&state, 72 * SECOND), Some(120 * SECOND));
/// // `fresh_at`: the strikes are remembered until one longest block (240 s) after the
/// // block ends at 192 s.
/// assert_eq!(penalty.fresh_at(&state), 432 * SECOND);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PenaltyBox {
    pub(crate) denials: u64,
    pub(crate) within: u64,
    pub(crate) block: u64,
    pub(crate) max_block: u64,
}

/// One key's penalty state under one policy. Zero is fresh.
///
/// ```
/// use tollgate::algorithm::{PenaltyBox, PenaltyState};
///
/// const SECOND: u64 = 1_000_000_000;
/// let penalty = PenaltyBox::new(2, 10 * SECOND, 60 * SECOND, 60 * SECOND).unwrap();
/// let mut state = PenaltyState::default();
/// assert_eq!(penalty.fresh_at(&state), 0);
///
/// // Two denials 11 s apart are in different windows: no block, and the state is kept
/// // until the second one's window closes.
/// penalty.strike(&mut state, 0);
/// penalty.strike(&mut state, 11 * SECOND);
/// assert_eq!(penalty.blocked(&state, 11 * SECOND), None);
/// assert_eq!(penalty.fresh_at(&state), 21 * SECOND);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PenaltyState {
    /// Denials counted in the current window.
    pub(super) count: u64,
    /// When the current window of denials closes.
    pub(super) window_end: u64,
    /// Blocked until then.
    pub(super) blocked_until: u64,
    /// Blocks so far.
    pub(super) strikes: u64,
    /// Strikes are forgotten from then on.
    pub(super) strikes_until: u64,
}

impl PenaltyBox {
    /// `denials` within `within` block for `block`, doubling up to `max_block`; `None`
    /// unless `denials`, `within` and `block` are positive, `max_block >= block`, and
    /// none is past [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(denials: u64, within: u64, block: u64, max_block: u64) -> Option<Self> {
        (denials > 0
            && max_block >= block
            && super::within_bounds(&[denials], &[within, block, max_block]))
        .then_some(Self {
            denials,
            within,
            block,
            max_block,
        })
    }

    /// Nanoseconds the key stays blocked from `now`, or `None` when it is not blocked.
    #[inline]
    pub fn blocked(&self, state: &PenaltyState, now: u64) -> Option<u64> {
        (now < state.blocked_until).then(|| state.blocked_until - now)
    }

    /// Counts one denial at `now`; may start a block.
    pub fn strike(&self, state: &mut PenaltyState, now: u64) {
        if now >= state.window_end {
            state.count = 0;
            state.window_end = now.saturating_add(self.within);
        }
        state.count += 1;
        if state.count < self.denials {
            return;
        }
        if now >= state.strikes_until {
            state.strikes = 0;
        }
        let mut block = self.block;
        for _ in 0..state.strikes {
            block = block.saturating_mul(2).min(self.max_block);
            if block == self.max_block {
                break;
            }
        }
        state.blocked_until = now.saturating_add(block);
        state.strikes = (state.strikes + 1).min(64);
        state.strikes_until = state.blocked_until.saturating_add(self.max_block);
        state.count = 0;
        state.window_end = now;
    }

    /// When the state is fresh again (nothing to remember).
    #[inline]
    pub fn fresh_at(&self, state: &PenaltyState) -> u64 {
        let strikes = if state.strikes > 0 {
            state.strikes_until
        } else {
            0
        };
        let window = if state.count > 0 { state.window_end } else { 0 };
        state.blocked_until.max(strikes).max(window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn blocks_after_the_denials_and_doubles_up_to_the_cap() {
        let penalty = PenaltyBox::new(3, 10 * S, 60 * S, 200 * S).unwrap();
        let mut state = PenaltyState::default();
        penalty.strike(&mut state, S);
        penalty.strike(&mut state, 2 * S);
        assert_eq!(penalty.blocked(&state, 2 * S), None);
        penalty.strike(&mut state, 3 * S);
        assert_eq!(penalty.blocked(&state, 3 * S), Some(60 * S));
        // Again soon after the block: 120 s, then capped at 200 s.
        let t = 70 * S;
        for i in 0..3 {
            penalty.strike(&mut state, t + i);
        }
        assert_eq!(penalty.blocked(&state, t + 2), Some(120 * S));
        let t = t + 130 * S;
        for i in 0..3 {
            penalty.strike(&mut state, t + i);
        }
        assert_eq!(penalty.blocked(&state, t + 2), Some(200 * S));
        // After a quiet longest block past the last block, the first block again.
        let t = t + 2 + 200 * S + 200 * S;
        for i in 0..3 {
            penalty.strike(&mut state, t + i);
        }
        assert_eq!(penalty.blocked(&state, t + 2), Some(60 * S));
        assert_eq!(penalty.fresh_at(&state), t + 2 + 60 * S + 200 * S);
    }

    #[test]
    fn denials_outside_the_window_do_not_add_up() {
        let penalty = PenaltyBox::new(2, 10 * S, 60 * S, 60 * S).unwrap();
        let mut state = PenaltyState::default();
        penalty.strike(&mut state, 0);
        penalty.strike(&mut state, 11 * S);
        assert_eq!(penalty.blocked(&state, 11 * S), None);
        penalty.strike(&mut state, 12 * S);
        assert_eq!(penalty.blocked(&state, 12 * S), Some(60 * S));
    }
}
