//! Time for the in-process store: monotonic, in nanoseconds since the clock's origin.
//!
//! Wall clocks jump (NTP, leap smearing, an operator) and differ between machines, so the
//! in-process store never reads one. Tests use [`ManualClock`] and move time by hand.
//!
//! [`MonotonicClock`] reads the CPU's invariant time-stamp counter through `quanta` where
//! there is one (a few nanoseconds, against about 25 for `Instant::now`, which was a third
//! of a decision's cost), calibrated against the OS monotonic clock, and the OS monotonic
//! clock elsewhere. The algorithms tolerate the few nanoseconds two cores' counters may
//! disagree by: time that steps back never rolls a window or refills a bucket.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of monotonic time in nanoseconds.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// assert_eq!(clock.now(), 0);
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(clock.now(), 5_000_000);
/// ```
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since this clock's origin; never decreases.
    fn now(&self) -> u64;
}

/// The real monotonic clock (TSC through `quanta`, or the OS monotonic clock).
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    origin: u64,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> u64 {
        // u64 nanoseconds last 584 years from the origin.
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

/// A clock that moves only when told to. Clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.nanos.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Sets the clock; it may not go backwards, so an earlier time is ignored.
    pub fn set(&self, at: Duration) {
        self.nanos.fetch_max(at.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }
}
