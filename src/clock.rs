//! Time for the in-process store: monotonic, in nanoseconds on a line aligned to the Unix
//! epoch.
//!
//! Wall clocks jump (NTP, leap smearing, an operator) and differ between machines, so no
//! decision ever reads one. Tests use [`ManualClock`] and move time by hand.
//!
//! [`MonotonicClock`], the default, is the operating system's monotonic clock
//! (`std::time::Instant`: `CLOCK_MONOTONIC` on Linux). It is placed on the Unix epoch by
//! **one** wall-clock reading, taken once per process: from then on only the monotonic
//! clock moves it, so a wall clock that jumps later changes nothing, while fixed windows
//! start at the same instants as on Redis (whose scripts count from the epoch) and in
//! every other store of the process. A day-long window resets at midnight UTC everywhere.
//!
//! [`TscClock`] reads the CPU's time-stamp counter through `quanta`: a few nanoseconds
//! cheaper per decision, but it trusts a frequency calibrated at start, and under some
//! hypervisors that calibration is wrong (timers have been seen running almost three
//! times fast) or the cores' counters disagree. A limiter whose clock runs fast admits
//! that many times its limit. Opt in only on hardware you have measured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
    /// Nanoseconds on this clock's time line; never decreases.
    fn now(&self) -> u64;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    #[inline]
    fn now(&self) -> u64 {
        (**self).now()
    }
}

/// The process's anchor: one monotonic instant and the Unix time it was read at.
struct Anchor {
    instant: Instant,
    epoch_nanos: u64,
}

fn anchor() -> &'static Anchor {
    static ANCHOR: OnceLock<Anchor> = OnceLock::new();
    ANCHOR.get_or_init(|| {
        let instant = Instant::now();
        // The only wall-clock reading: it places the monotonic line on the epoch. A clock
        // set before 1970 counts from 0, which keeps every decision correct (windows are
        // then aligned to the process start instead).
        let epoch_nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
            });
        Anchor {
            instant,
            epoch_nanos,
        }
    })
}

/// The default clock: the OS monotonic clock, on a line aligned to the Unix epoch.
///
/// ```
/// use std::time::{SystemTime, UNIX_EPOCH};
/// use tollgate::clock::{Clock, MonotonicClock};
///
/// let clock = MonotonicClock::new();
/// let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
/// // Aligned to the epoch: within a second of the wall clock (unless it was just stepped).
/// assert!(clock.now().abs_diff(wall) < 1_000_000_000);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock {
    _private: (),
}

impl MonotonicClock {
    /// The clock (every instance in a process shows the same time).
    pub fn new() -> Self {
        anchor();
        Self { _private: () }
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> u64 {
        let anchor = anchor();
        let elapsed = u64::try_from(anchor.instant.elapsed().as_nanos()).unwrap_or(u64::MAX);
        anchor.epoch_nanos.saturating_add(elapsed)
    }
}

/// The CPU's time-stamp counter through `quanta`, on the same epoch-aligned line as
/// [`MonotonicClock`]. **Opt-in, with a risk**: read the [module docs](self) first.
///
/// ```
/// use tollgate::MemoryStore;
/// use tollgate::clock::TscClock;
///
/// let store = MemoryStore::builder().clock(TscClock::new()).build();
/// ```
#[derive(Debug, Clone)]
pub struct TscClock {
    clock: quanta::Clock,
    origin: u64,
    epoch_nanos: u64,
}

impl TscClock {
    /// A TSC clock anchored to the process's epoch-aligned line now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self {
            clock,
            origin,
            epoch_nanos: MonotonicClock::new().now(),
        }
    }
}

impl Default for TscClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TscClock {
    #[inline]
    fn now(&self) -> u64 {
        self.epoch_nanos
            .saturating_add(self.clock.delta_as_nanos(self.origin, self.clock.raw()))
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
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // Saturating: time never wraps around to the past.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by))
            });
    }

    /// Sets the clock; it may not go backwards, so an earlier time is ignored.
    pub fn set(&self, at: Duration) {
        self.nanos.fetch_max(
            u64::try_from(at.as_nanos()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Clock for ManualClock {
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_clock_of_the_process_shows_one_epoch_aligned_time() {
        let a = MonotonicClock::new();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let b = MonotonicClock::new();
        let (ta, tb) = (a.now(), b.now());
        assert!(tb >= ta);
        assert!(tb - ta < 1_000_000_000, "one anchor for the process");
        let wall = u64::try_from(wall.as_nanos()).unwrap();
        assert!(ta.abs_diff(wall) < 5_000_000_000, "{ta} vs wall {wall}");
        let tsc = TscClock::new();
        assert!(tsc.now().abs_diff(a.now()) < 1_000_000_000);
    }
}

/// The async runtime's clock (tokio's `Instant`) on a line aligned to the Unix epoch. In
/// production it is the monotonic clock; in a test runtime with paused time it moves as
/// the runtime does, so a store on this clock agrees with `tokio::time::sleep`. The
/// client-side pacer uses it; so can a [`Limiter`](crate::limiter::Limiter) tested with
/// paused time.
///
/// ```
/// use tollgate::MemoryStore;
/// use tollgate::clock::RuntimeClock;
///
/// let store = MemoryStore::builder().clock(RuntimeClock::new()).build();
/// # let _ = store;
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RuntimeClock {
    base: tokio::time::Instant,
    epoch: u64,
}

impl RuntimeClock {
    /// The runtime's clock, anchored now.
    pub fn new() -> Self {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        Self {
            base: tokio::time::Instant::now(),
            epoch: u64::try_from(epoch).unwrap_or(u64::MAX / 2),
        }
    }
}

impl Default for RuntimeClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for RuntimeClock {
    fn now(&self) -> u64 {
        let elapsed = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX / 2);
        self.epoch.saturating_add(elapsed)
    }
}
