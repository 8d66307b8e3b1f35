//! Why a policy could not be built, and the checks that say so.

use std::fmt;
use std::time::Duration;

use super::{MAX_LIMIT, MAX_PERIOD, MAX_SUB_WINDOWS, MIN_PERIOD, Rate};

/// Why a policy or a policy set could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyError {
    /// The name is empty, too long, or has a character outside `A-Z a-z 0-9 - _ .`.
    InvalidName {
        /// The name as given.
        name: String,
    },
    /// A count (limit, capacity, burst, rate amount) is zero.
    Zero {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
    },
    /// A count is larger than [`MAX_LIMIT`].
    TooLarge {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// A window, period or delay is outside the accepted range.
    Duration {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
        /// The value given.
        value: Duration,
        /// The smallest accepted value.
        min: Duration,
        /// The largest accepted value.
        max: Duration,
    },
    /// A sliding window counter's sub-windows are out of range, or do not cut its window
    /// into equal whole microseconds (the unit the Redis store counts in).
    SubWindows {
        /// The policy.
        policy: String,
        /// The sub-windows asked for.
        sub_windows: u32,
        /// The window.
        window: Duration,
    },
    /// Two policies in one set share a name, so their headers could not be told apart.
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A shadow policy sits past the 52nd place of its set, beyond what a decision
    /// reports of shadow policies.
    ShadowTooFar {
        /// The name.
        name: String,
    },
    /// A shaping policy sits past the 64th place of its set, beyond what a receipt marks:
    /// a settle below the reservation would give its place in the schedule back.
    ShapingTooFar {
        /// The name.
        name: String,
    },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::InvalidName { name } => write!(
                f,
                "policy name {name:?} is invalid: use 1 to 64 characters from A-Z a-z 0-9 - _ ."
            ),
            PolicyError::Zero { policy, what } => {
                write!(f, "policy \"{policy}\": {what} must be at least 1")
            }
            PolicyError::TooLarge {
                policy,
                what,
                value,
            } => write!(
                f,
                "policy \"{policy}\": {what} is {value}, more than the maximum {MAX_LIMIT}"
            ),
            PolicyError::Duration {
                policy,
                what,
                value,
                min,
                max,
            } => write!(
                f,
                "policy \"{policy}\": {what} is {value:?}, it must be between {min:?} and {max:?}"
            ),
            PolicyError::SubWindows {
                policy,
                sub_windows,
                window,
            } => write!(
                f,
                "policy \"{policy}\": {sub_windows} sub-windows cannot split the window \
                 {window:?}: use 1 to {MAX_SUB_WINDOWS} sub-windows that divide it into \
                 equal whole microseconds"
            ),
            PolicyError::DuplicateName { name } => {
                write!(f, "two policies in one set are named \"{name}\"")
            }
            PolicyError::ShadowTooFar { name } => write!(
                f,
                "shadow policy \"{name}\" is past the 52nd policy of its set: put shadow \
                 policies among the first {MAX_SHADOW_INDEX}"
            ),
            PolicyError::ShapingTooFar { name } => write!(
                f,
                "shaping policy \"{name}\" is past the 64th policy of its set: put shaping \
                 policies among the first {MAX_SHAPING_INDEX}"
            ),
        }
    }
}

impl std::error::Error for PolicyError {}

pub(super) struct Check<'a> {
    pub(super) policy: &'a str,
}

impl Check<'_> {
    pub(super) fn count(&self, what: &'static str, value: u64) -> Result<u64, PolicyError> {
        if value == 0 {
            return Err(PolicyError::Zero {
                policy: self.policy.to_owned(),
                what,
            });
        }
        if value > MAX_LIMIT {
            return Err(PolicyError::TooLarge {
                policy: self.policy.to_owned(),
                what,
                value,
            });
        }
        Ok(value)
    }

    pub(super) fn duration(
        &self,
        what: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    ) -> Result<u64, PolicyError> {
        if value < min || value > max {
            return Err(PolicyError::Duration {
                policy: self.policy.to_owned(),
                what,
                value,
                min,
                max,
            });
        }
        // Whole microseconds, rounded up: the unit Redis counts in, so that a duration
        // finer than that (a third of a second) is the same policy on every store; up is
        // the stricter way for a window, a period, a lease or a block. In range, so it
        // fits: MAX_PERIOD is about 3.2e17 ns.
        Ok((value.as_nanos() as u64).div_ceil(1_000) * 1_000)
    }

    /// A bound on a wait (a shaping bucket's longest delay): as [`Check::duration`], but
    /// rounded down to whole microseconds, the stricter way for a bound.
    pub(super) fn bound(
        &self,
        what: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    ) -> Result<u64, PolicyError> {
        self.duration(what, value, min, max)?;
        // In range (checked above), so it fits.
        Ok(value.as_nanos() as u64 / 1_000 * 1_000)
    }

    pub(super) fn rate(&self, what: &'static str, rate: Rate) -> Result<(u64, u64), PolicyError> {
        let amount = self.count(what, rate.amount())?;
        let period = self.duration("the rate's period", rate.period(), MIN_PERIOD, MAX_PERIOD)?;
        Ok((amount, period))
    }
}

/// Shadow policies sit among the first this many policies of a set (the reports of what
/// they would have denied are bit masks, exact in Redis scripts' doubles).
pub const MAX_SHADOW_INDEX: usize = 52;

/// How many policies of a set may be shaping ones, counted from its first: a request's
/// receipt marks the first 64, and a settle keeps a shaping policy's place by that mark.
pub const MAX_SHAPING_INDEX: usize = 64;

pub(super) fn check_name(name: &str) -> Result<(), PolicyError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(PolicyError::InvalidName {
            name: name.to_owned(),
        })
    }
}
