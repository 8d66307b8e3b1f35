//! Time for the in-process store: monotonic, in nanoseconds on a line aligned to the Unix
//! epoch.
//!
//! Wall clocks jump (NTP, leap smearing, an operator) and differ between machines, so no
//! decision ever reads one. Tests use [`ManualClock`] and move time by hand.
//!
//! [`MonotonicClock`] is the operating system's monotonic clock (`std::time::Instant`:
//! `CLOCK_MONOTONIC` on Linux). It is placed on the Unix epoch by **one** wall-clock
//! reading, taken once per process: from then on only the monotonic clock moves it, so a
//! wall clock that jumps later changes nothing, while fixed windows start at the same
//! instants as on Redis (whose scripts count from the epoch) and in every other store of
//! the process. A day-long window resets at midnight UTC everywhere.
//!
//! [`InterpolatedClock`], the [`MemoryStore`](crate::MemoryStore)'s default, is that same
//! clock read less often: each thread reads the OS clock at least every 64 readings and
//! every millisecond, and the CPU's time-stamp counter (through `quanta`) carries the time
//! between two of its readings. It reads in about a third of the OS clock's time, and it
//! follows the OS clock whatever the counter does: never more than one millisecond ahead
//! of it, never behind it by more than the time since the thread's last OS reading.
//!
//! [`TscClock`] reads the time-stamp counter alone: it trusts a frequency calibrated at
//! start, and under some hypervisors that calibration is wrong (timers have been seen
//! running almost three times fast) or the cores' counters disagree. A limiter whose clock
//! runs fast admits that many times its limit. Opt in only on hardware you have measured.

use std::cell::Cell;
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

/// The OS monotonic clock, read every time, on a line aligned to the Unix epoch.
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

/// The default clock of the [`MemoryStore`](crate::MemoryStore): the OS monotonic clock
/// ([`MonotonicClock`]'s line), read on each thread at most 64 readings and at most one
/// millisecond apart, with the CPU's time-stamp counter (through `quanta`) carrying the
/// time between two readings. See the [module docs](self).
///
/// Whatever the counter does (a calibration that is wrong, cores whose counters disagree,
/// a counter that stops or goes back), the time it gives is never more than one
/// millisecond ahead of the OS clock, never behind it by more than the time since the
/// thread's last reading of it, and never decreases on a thread. Readings on two threads
/// can differ by that much; a store's decisions allow for time that seems to go back a
/// little (a request that read the time first can reach the lock second anyway).
///
/// ```
/// use tollgate::clock::{Clock, InterpolatedClock, MonotonicClock};
///
/// let fast = InterpolatedClock::new();
/// let (a, b) = (fast.now(), fast.now());
/// assert!(b >= a);
/// // The same line as the OS clock's: at most a millisecond ahead of it.
/// assert!(fast.now() <= MonotonicClock::new().now() + 1_000_000);
/// ```
#[derive(Debug, Clone)]
pub struct InterpolatedClock {
    counter: quanta::Clock,
}

impl InterpolatedClock {
    /// The clock (every instance in a process shows the same time). The first one of a
    /// process calibrates the counter, which takes about a millisecond.
    pub fn new() -> Self {
        anchor();
        Self {
            counter: quanta::Clock::new(),
        }
    }
}

impl Default for InterpolatedClock {
    fn default() -> Self {
        Self::new()
    }
}

/// How far past a thread's last reading of the OS clock the counter may carry the time.
const CARRY_NANOS: u64 = 1_000_000;
/// How many readings the counter may answer between two of the OS clock on a thread.
const CARRY_READINGS: u32 = 64;

/// One thread's last reading of the OS clock and what the counter showed then.
#[derive(Debug, Clone, Copy)]
struct Carry {
    /// The counter at the last OS reading.
    ticks: u64,
    /// The OS clock then, in nanoseconds on the epoch-aligned line.
    nanos: u64,
    /// Readings the counter may still answer.
    readings_left: u32,
    /// The last time given on this thread: none later is earlier.
    last: u64,
}

impl Carry {
    const NONE: Carry = Carry {
        ticks: 0,
        nanos: 0,
        readings_left: 0,
        last: 0,
    };

    /// The time when the counter shows `ticks`: carried from the last OS reading by
    /// `elapsed(from, to)` (the counter's calibrated nanoseconds) while that is within
    /// bounds, else a new reading of the OS clock (`os`).
    #[inline]
    fn now(
        &mut self,
        ticks: u64,
        elapsed: impl FnOnce(u64, u64) -> u64,
        os: impl FnOnce() -> u64,
    ) -> u64 {
        // A counter that has not moved (stopped) or went back (another core's) is not
        // trusted; neither is one carried too far.
        let carried = if self.readings_left > 0 && ticks > self.ticks {
            let nanos = elapsed(self.ticks, ticks);
            (nanos <= CARRY_NANOS).then(|| self.nanos.saturating_add(nanos))
        } else {
            None
        };
        let now = match carried {
            Some(now) => {
                self.readings_left -= 1;
                now
            }
            None => {
                let now = os();
                *self = Carry {
                    ticks,
                    nanos: now,
                    readings_left: CARRY_READINGS,
                    last: self.last,
                };
                now
            }
        };
        // A counter that ran fast gave times the OS clock has not reached yet: they stand
        // until it does.
        let now = now.max(self.last);
        self.last = now;
        now
    }
}

thread_local! {
    static CARRY: Cell<Carry> = const { Cell::new(Carry::NONE) };
}

impl Clock for InterpolatedClock {
    #[inline]
    fn now(&self) -> u64 {
        let ticks = self.counter.raw();
        CARRY.with(|cell| {
            let mut carry = cell.get();
            let now = carry.now(
                ticks,
                |from, to| self.counter.delta_as_nanos(from, to),
                read_os_clock,
            );
            cell.set(carry);
            now
        })
    }
}

#[inline(never)]
fn read_os_clock() -> u64 {
    MonotonicClock { _private: () }.now()
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

    /// A thread's time from a counter that runs at `rate` times its calibration (0: it
    /// stopped), with jumps back and forth, against an OS clock that moves by `steps`.
    fn simulate(rate: f64, steps: &[(u64, i64)]) -> Vec<(u64, u64, u64)> {
        let mut carry = Carry::NONE;
        let (mut os, mut ticks, mut read_at) = (1_000_000_000_u64, 5_000_u64, 0_u64);
        let mut seen = Vec::new();
        for &(step, jump) in steps {
            os += step;
            ticks = ticks
                .saturating_add((step as f64 * rate) as u64)
                .saturating_add_signed(jump);
            let now = carry.now(
                ticks,
                |from, to| to - from,
                || {
                    read_at = os;
                    os
                },
            );
            seen.push((now, os, read_at));
        }
        seen
    }

    proptest::proptest! {
        #[test]
        fn the_carried_time_follows_the_os_clock_whatever_the_counter_does(
            rate in proptest::prop_oneof![Just(0.0), Just(1.0), Just(0.33), Just(3.0), 0.0f64..10.0],
            steps in proptest::collection::vec(
                (0u64..3_000_000, proptest::prop_oneof![Just(0i64), Just(0i64), -5_000_000i64..5_000_000]),
                1..300,
            ),
        ) {
            let seen = simulate(rate, &steps);
            let mut last = 0;
            let mut since_reading = 0;
            for (index, &(now, os, read_at)) in seen.iter().enumerate() {
                proptest::prop_assert!(now >= last, "reading {index} went back: {now} < {last}");
                proptest::prop_assert!(now <= os + CARRY_NANOS, "reading {index} ran ahead: {now} vs {os}");
                proptest::prop_assert!(now >= read_at, "reading {index} is behind the OS reading it carries");
                since_reading = if read_at == os { 0 } else { since_reading + 1 };
                proptest::prop_assert!(since_reading <= CARRY_READINGS as usize);
                last = now;
            }
        }
    }

    use proptest::prelude::Just;

    #[test]
    fn a_right_counter_gives_the_os_time_between_readings() {
        // A counter calibrated right: every reading is the OS clock's, though it read the
        // OS clock only every 64 readings or every millisecond.
        let steps: Vec<(u64, i64)> = (0..1_000).map(|i| (1 + (i * 7919) % 40_000, 0)).collect();
        let seen = simulate(1.0, &steps);
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        let readings = seen.windows(2).filter(|w| w[1].2 != w[0].2).count();
        assert!(
            (1_000 / 65..1_000 / 10).contains(&readings),
            "{readings} OS readings"
        );
    }

    #[test]
    fn a_counter_three_times_fast_runs_at_most_a_millisecond_ahead() {
        // Timers under some hypervisors have run almost three times fast (see the module
        // docs): a 1 ms carry then reaches 1 ms ahead in a third of a millisecond, and the
        // time stands until the OS clock catches up.
        let steps = vec![(10_000, 0); 2_000];
        let seen = simulate(3.0, &steps);
        let ahead = seen
            .iter()
            .map(|&(now, os, _)| now.saturating_sub(os))
            .max()
            .unwrap();
        assert!(ahead > 0 && ahead <= CARRY_NANOS, "{ahead}");
        let (end, os, _) = *seen.last().unwrap();
        assert!(
            end - os <= CARRY_NANOS,
            "it does not drift: {} ahead at the end",
            end - os
        );
    }

    #[test]
    fn a_stopped_counter_reads_the_os_clock_every_time() {
        let steps = vec![(5_000_000, 0); 100];
        let seen = simulate(0.0, &steps);
        assert!(
            seen.iter()
                .all(|&(now, os, read_at)| now == os && read_at == os)
        );
    }

    #[test]
    fn the_interpolated_clock_is_on_the_process_line() {
        let fast = InterpolatedClock::new();
        let os = MonotonicClock::new();
        for _ in 0..10_000 {
            let before = os.now();
            let now = fast.now();
            let after = os.now();
            // Behind only by the time since this thread's last OS reading (at most 1 ms of
            // counter time, which a working counter measures right), ahead by at most 1 ms.
            assert!(now <= after + CARRY_NANOS, "{now} > {after} + 1 ms");
            assert!(now + 50_000_000 >= before, "{now} far behind {before}");
        }
    }
}
