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
//! [`CarriedClock`], the [`MemoryStore`](crate::MemoryStore)'s default, is that same
//! clock read less often: a thread reads the OS clock at least once in every 65 readings
//! and whenever a millisecond has passed on the CPU's time-stamp counter (through
//! `quanta`), and the counter carries the time from one OS reading to the next. Where the
//! CPU has an invariant counter a reading costs about a third of an OS reading; elsewhere
//! `quanta` counts with the OS clock itself and there is nothing to gain. Whatever the
//! counter does, the time never runs more than one millisecond ahead of the OS clock; and
//! the counter's rate is checked against the OS clock over every second or more between
//! two OS readings: a counter that runs at twice or half the OS clock's pace is no longer
//! trusted, and from then on every reading is the OS clock's.
//!
//! [`TscClock`] reads the time-stamp counter alone: it trusts a frequency calibrated at
//! start, and under some hypervisors that calibration is wrong (timers have been seen
//! running almost three times fast) or the cores' counters disagree. A limiter whose clock
//! runs fast admits that many times its limit. Opt in only on hardware you have measured.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Nanoseconds on this clock's time line; never decreases on one thread. (Readings on
    /// two threads may disagree slightly: see [`CarriedClock`].)
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
/// ([`MonotonicClock`]'s line), carried between two of its readings by the CPU's
/// time-stamp counter (through `quanta`). See the [module docs](self).
///
/// Each thread reads the OS clock on its first reading, then whenever 64 readings in a
/// row have been carried, a millisecond has passed on the counter, or the counter has not
/// moved forward (stopped, or another core's counter behind this one's). Between two OS
/// readings the time is the last OS reading plus the counter's calibrated nanoseconds
/// since. So, whatever the counter does:
///
/// - the time never runs more than one millisecond ahead of the OS clock;
/// - it never decreases on a thread (a time given early stands until the OS clock reaches
///   it);
/// - it is behind the OS clock by at most the time since the thread's last OS reading,
///   and the counter's pace is checked against the OS clock over every second or more
///   between two OS readings: off by a factor of two either way, the counter is trusted no
///   more (a warning is logged, with the `tracing` feature) and every reading from then on,
///   on every thread, is the OS clock's.
///
/// Readings on two threads can differ by up to that much; a store's decisions allow for
/// time that seems to go back a little, which happens with any clock (a request that read
/// the time first can reach the lock second).
///
/// The first reading of a process calibrates the counter (`quanta`: usually about a
/// millisecond, at most 200 ms); [`MemoryStore`](crate::MemoryStore)'s `build` takes it.
///
/// ```
/// use tollgate::clock::{CarriedClock, Clock, MonotonicClock};
///
/// let clock = CarriedClock::new();
/// let (a, b) = (clock.now(), clock.now());
/// assert!(b >= a);
/// // The OS clock's line: never more than a millisecond ahead of it.
/// assert!(clock.now() <= MonotonicClock::new().now() + 1_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct CarriedClock {
    /// A counter of the test's own instead of the CPU's.
    #[cfg(test)]
    counter: Option<quanta::Clock>,
    _private: (),
}

impl CarriedClock {
    /// The clock (every instance in a process shows the same time).
    pub fn new() -> Self {
        anchor();
        Self::default()
    }

    #[inline]
    fn counter(&self) -> &quanta::Clock {
        #[cfg(test)]
        if let Some(counter) = &self.counter {
            return counter;
        }
        static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
        COUNTER.get_or_init(quanta::Clock::new)
    }
}

/// How far past a thread's last OS reading the counter may carry the time.
const CARRY_NANOS: u64 = 1_000_000;
/// How many readings in a row the counter may carry on a thread.
const CARRY_READINGS: u32 = 64;
/// The shortest stretch between two OS readings over which the counter's pace is judged.
const JUDGE_NANOS: u64 = 1_000_000_000;

/// Set when the counter's pace has been found wrong: every reading is the OS clock's.
static DISTRUSTED: AtomicBool = AtomicBool::new(false);

/// One thread's last OS reading and what the counter showed then.
#[derive(Debug, Clone, Copy)]
struct Carry {
    /// The counter just after the last OS reading.
    ticks: u64,
    /// The OS clock then, in nanoseconds on the epoch-aligned line.
    nanos: u64,
    /// Readings the counter may still carry.
    readings_left: u32,
    /// The last time given on this thread: none later is earlier.
    last: u64,
}

/// An OS reading: the time, the counter just after it, and whether the counter may carry
/// the time from it.
struct OsReading {
    nanos: u64,
    ticks: u64,
    trusted: bool,
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
    /// bounds, else a new OS reading (`os`).
    #[inline]
    fn now(
        &mut self,
        ticks: u64,
        elapsed: impl FnOnce(u64, u64) -> u64,
        os: impl FnOnce() -> OsReading,
    ) -> u64 {
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
                let reading = os();
                *self = Carry {
                    ticks: reading.ticks,
                    nanos: reading.nanos,
                    readings_left: if reading.trusted { CARRY_READINGS } else { 0 },
                    last: self.last,
                };
                reading.nanos
            }
        };
        // A counter that ran fast gave times the OS clock has not reached yet: they stand
        // until it does.
        let now = now.max(self.last);
        self.last = now;
        now
    }
}

/// A thread's reference OS reading for judging the counter's pace.
#[derive(Debug, Clone, Copy)]
struct Judge {
    nanos: u64,
    ticks: u64,
}

impl Judge {
    const NONE: Judge = Judge { nanos: 0, ticks: 0 };

    /// Whether the counter kept the OS clock's pace, within a factor of two, since the
    /// reference reading, judged once at least [`JUDGE_NANOS`] have passed on the OS
    /// clock; `None` until then (or when the counter went back, which starts over).
    fn agrees(
        &mut self,
        nanos: u64,
        ticks: u64,
        elapsed: impl FnOnce(u64, u64) -> u64,
    ) -> Option<bool> {
        if self.nanos == 0 || ticks <= self.ticks || nanos < self.nanos {
            *self = Judge { nanos, ticks };
            return None;
        }
        let os = nanos - self.nanos;
        if os < JUDGE_NANOS {
            return None;
        }
        let counter = elapsed(self.ticks, ticks);
        *self = Judge { nanos, ticks };
        Some(counter <= os.saturating_mul(2) && counter.saturating_mul(2) >= os)
    }
}

thread_local! {
    static CARRY: Cell<Carry> = const { Cell::new(Carry::NONE) };
    static JUDGE: Cell<Judge> = const { Cell::new(Judge::NONE) };
}

impl Clock for CarriedClock {
    #[inline]
    fn now(&self) -> u64 {
        let counter = self.counter();
        let ticks = counter.raw();
        CARRY.with(|cell| {
            let mut carry = cell.get();
            let now = carry.now(
                ticks,
                |from, to| counter.delta_as_nanos(from, to),
                || os_reading(counter),
            );
            cell.set(carry);
            now
        })
    }
}

/// Reads the OS clock, then the counter, and judges the counter's pace.
#[inline(never)]
fn os_reading(counter: &quanta::Clock) -> OsReading {
    let nanos = MonotonicClock { _private: () }.now();
    let ticks = counter.raw();
    if DISTRUSTED.load(Ordering::Relaxed) {
        return OsReading {
            nanos,
            ticks,
            trusted: false,
        };
    }
    let mut judge = JUDGE.with(Cell::get);
    let verdict = judge.agrees(nanos, ticks, |from, to| counter.delta_as_nanos(from, to));
    JUDGE.with(|cell| cell.set(judge));
    if verdict == Some(false) && !DISTRUSTED.swap(true, Ordering::Relaxed) {
        #[cfg(feature = "tracing")]
        tracing::warn!(
            target: "tollgate",
            "the CPU's time-stamp counter does not keep the OS clock's pace: the in-process \
             store's clock reads the OS clock from now on"
        );
    }
    OsReading {
        nanos,
        ticks,
        trusted: verdict != Some(false),
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

    /// A thread's readings from a counter that runs at `rate` times its calibration (0: it
    /// stopped), with jumps back and forth, against an OS clock that moves by `steps`:
    /// (the time given, the OS clock, the last OS reading) for each.
    fn simulate(rate: f64, steps: &[(u64, i64)]) -> Vec<(u64, u64, u64)> {
        let mut carry = Carry::NONE;
        let mut judge = Judge::NONE;
        let mut distrusted = false;
        let (mut os, mut ticks, mut read_at) = (1_000_000_000_u64, 5_000_u64, 0_u64);
        let mut seen = Vec::new();
        for &(step, jump) in steps {
            os += step;
            ticks = ticks
                .saturating_add((step as f64 * rate) as u64)
                .saturating_add_signed(jump);
            let elapsed = |from: u64, to: u64| to.saturating_sub(from);
            let now = carry.now(ticks, elapsed, || {
                read_at = os;
                distrusted |= judge.agrees(os, ticks, elapsed) == Some(false);
                OsReading {
                    nanos: os,
                    ticks,
                    trusted: !distrusted,
                }
            });
            seen.push((now, os, read_at));
        }
        seen
    }

    /// OS readings among `seen` (a reading's OS time changed, or it read at a standstill).
    fn os_readings(seen: &[(u64, u64, u64)]) -> usize {
        let mut last = None;
        seen.iter()
            .filter(|&&(_, _, read_at)| {
                let new = last != Some(read_at);
                last = Some(read_at);
                new
            })
            .count()
    }

    proptest::proptest! {
        #[test]
        fn the_carried_time_follows_the_os_clock_whatever_the_counter_does(
            rate in proptest::prop_oneof![Just(0.0), Just(1.0), Just(0.33), Just(3.0), 0.0f64..10.0],
            steps in proptest::collection::vec(
                (
                    proptest::prop_oneof![1u64..2_000, 1u64..3_000_000],
                    proptest::prop_oneof![Just(0i64), Just(0i64), -5_000_000i64..5_000_000],
                ),
                1..400,
            ),
        ) {
            let seen = simulate(rate, &steps);
            let (mut last, mut carried_in_a_row, mut read_at) = (0, 0, 0);
            for (index, &(now, os, reading)) in seen.iter().enumerate() {
                proptest::prop_assert!(now >= last, "reading {index} went back: {now} < {last}");
                proptest::prop_assert!(now <= os + 1_000_000, "reading {index} ran ahead: {now} vs {os}");
                proptest::prop_assert!(now >= reading, "reading {index} is behind its OS reading");
                carried_in_a_row = if reading != read_at { 0 } else { carried_in_a_row + 1 };
                read_at = reading;
                proptest::prop_assert!(carried_in_a_row <= 64, "reading {index}: {carried_in_a_row} carried in a row");
                last = now;
            }
        }
    }

    use proptest::prelude::Just;

    #[test]
    fn a_right_counter_gives_the_os_time_and_reads_it_once_in_65() {
        // Readings 100 ns apart: the millisecond bound is far, the count bound reads the
        // OS clock on the first reading and then once every 65.
        let seen = simulate(1.0, &vec![(100, 0); 1_000]);
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        assert_eq!(os_readings(&seen), 1_000_usize.div_ceil(65));
        // Readings 300 µs apart: the millisecond bound reads it every fourth reading.
        let seen = simulate(1.0, &vec![(300_000, 0); 1_000]);
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        assert_eq!(os_readings(&seen), 1_000_usize.div_ceil(4));
    }

    #[test]
    fn a_counter_three_times_fast_is_caught_and_stays_within_a_millisecond_till_then() {
        // Timers under some hypervisors have run almost three times fast (see the module
        // docs): a 1 ms carry reaches 1 ms ahead in a third of a millisecond, and the time
        // stands until the OS clock catches up. After a second of OS time the counter's
        // pace is judged and it carries no more: every reading is the OS clock's.
        let seen = simulate(3.0, &vec![(10_000, 0); 200_000]);
        let ahead = seen
            .iter()
            .map(|&(now, os, _)| now.saturating_sub(os))
            .max()
            .unwrap();
        assert!(ahead > 0 && ahead <= 1_000_000, "{ahead}");
        let caught = seen
            .iter()
            .position(|&(now, os, read_at)| now == os && read_at == os);
        let exact_from = seen
            .iter()
            .rposition(|&(now, os, read_at)| now != os || read_at != os)
            .map_or(0, |index| index + 1);
        assert!(caught.is_some());
        // Judged within the first ~1.3 s (130,000 steps of 10 µs), exact ever after.
        assert!(exact_from < 130_000, "exact only from reading {exact_from}");
    }

    #[test]
    fn a_counter_that_crawls_is_caught() {
        // A thousand times slow: each carry lags by up to the time of 64 readings, until the
        // pace is judged; then every reading is the OS clock's.
        let seen = simulate(0.001, &vec![(100_000, 0); 30_000]);
        let exact_from = seen
            .iter()
            .rposition(|&(now, os, _)| now != os)
            .map_or(0, |index| index + 1);
        assert!(exact_from < 20_000, "exact only from reading {exact_from}");
        assert!(
            seen[exact_from..]
                .iter()
                .all(|&(_, os, read_at)| read_at == os)
        );
    }

    #[test]
    fn a_stopped_counter_reads_the_os_clock_every_time() {
        let seen = simulate(0.0, &vec![(5_000, 0); 100]);
        assert!(
            seen.iter()
                .all(|&(now, os, read_at)| now == os && read_at == os)
        );
    }

    #[test]
    fn the_clock_carries_by_its_counter_and_reads_the_os_clock_once_in_65() {
        // The clock itself on a counter of the test's: its readings are the last OS
        // reading plus what the counter counted since, in that direction.
        std::thread::spawn(|| {
            let (counter, mock) = quanta::Clock::mock();
            let clock = CarriedClock {
                counter: Some(counter),
                _private: (),
            };
            mock.increment(1_000);
            let first = clock.now();
            assert_eq!(CARRY.with(Cell::get).readings_left, 64);
            for reading in 1..=64_u64 {
                mock.increment(500);
                assert_eq!(clock.now(), first + 500 * reading, "reading {reading}");
            }
            assert_eq!(CARRY.with(Cell::get).readings_left, 0);
            mock.increment(500);
            let read = clock.now();
            assert_eq!(
                CARRY.with(Cell::get).readings_left,
                64,
                "the 65th reads the OS clock"
            );
            assert!(read >= first + 500 * 64);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_carried_clock_is_on_the_process_line() {
        let carried = CarriedClock::new();
        let os = MonotonicClock::new();
        for _ in 0..10_000 {
            let before = os.now();
            let now = carried.now();
            let after = os.now();
            assert!(now <= after + 1_000_000, "{now} > {after} + 1 ms");
            assert!(now + 50_000_000 >= before, "{now} far behind {before}");
        }
    }
}
