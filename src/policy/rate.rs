//! A number of units per period.

use std::time::Duration;

/// A number of units per period: the refill rate of a bucket or the emission rate of GCRA.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Rate;
///
/// assert_eq!(Rate::per_second(5), Rate::new(5, Duration::from_secs(1)));
/// assert_eq!(Rate::per_minute(60).period(), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    amount: u64,
    period: Duration,
}

impl Rate {
    /// `amount` units every `period`. Checked when a policy is built from it.
    pub const fn new(amount: u64, period: Duration) -> Self {
        Self { amount, period }
    }

    /// `amount` units per second.
    pub const fn per_second(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(1))
    }

    /// `amount` units per minute.
    pub const fn per_minute(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(60))
    }

    /// `amount` units per hour.
    pub const fn per_hour(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(3600))
    }

    /// `amount` units per day.
    pub const fn per_day(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(86_400))
    }

    /// The number of units per period.
    pub const fn amount(&self) -> u64 {
        self.amount
    }

    /// The period.
    pub const fn period(&self) -> Duration {
        self.period
    }
}
