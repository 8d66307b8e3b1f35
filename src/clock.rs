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
//! the process. A day-long window resets at midnight UTC everywhere, as far as the wall
//! clock was right at that reading: a process started before NTP synced, or a machine
//! suspended since (Linux's `CLOCK_MONOTONIC` does not count a suspend), keeps its line
//! off UTC by as much, and its windows (the local fallback's too) start at other
//! instants than Redis's. Decisions stay monotonic either way.
//!
//! [`CarriedClock`], the [`MemoryStore`](crate::MemoryStore)'s default, is that same
//! clock read less often: a thread reads the OS clock at least once in every 65 readings
//! and whenever a millisecond has passed on the CPU's time-stamp counter (through
//! `quanta`), and the counter carries the time from one OS reading to the next. The
//! counter carries only once it has kept the OS clock's pace (within a factor of two)
//! over a second, and found off twice in a row it carries no more. Where `quanta` reads a
//! counter (on x86-64 a CPU with an invariant TSC and `rdtscp`; on AArch64 the system
//! counter, which on some chips ticks only every 20 to 40 ns, so that readings that close
//! go to the OS clock) a reading costs about 0.4 of an OS reading here; elsewhere `quanta`
//! counts with the OS clock itself and there is nothing to gain. Whatever the counter
//! does, the time never runs more than one millisecond ahead of the OS clock.
//!
//! [`TscClock`] reads the time-stamp counter alone: it trusts a frequency calibrated at
//! start, and under some hypervisors that calibration is wrong (timers have been seen
//! running almost three times fast) or the cores' counters disagree. A limiter whose clock
//! runs fast admits that many times its limit. It is never re-anchored, so calibration
//! error accumulates (every `TscClock` of the process shares the anchor of the first). A
//! thread's time never steps back (a core whose counter is behind gives the thread's last
//! time until it catches up: denials last as much longer), and once a counter is seen
//! behind its origin (reset by a resume, or another socket's), or its time more than a
//! second (and a ten-thousandth of its uptime: calibration error) behind the OS clock's
//! (it compares the two once a second, and whenever a reading is far behind the last
//! comparison's: a counter reset and grown past its origin again), the clock reads the
//! OS clock from then on, said once at warn level. Ahead of the OS clock it is kept (a
//! counter that ran through a suspend). Opt in only on hardware you have measured.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
    /// two threads may disagree slightly: see [`CarriedClock`]; subtract two readings
    /// with `saturating_sub`.)
    fn now(&self) -> u64;

    /// Readies the clock before its first reading: a [`MemoryStore`](crate::MemoryStore)
    /// calls it once, when it is built, so that the first request does not pay for it.
    /// The default does nothing; [`CarriedClock`] calibrates the CPU's counter here (once
    /// per process) and takes a first reading.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use std::time::Duration;
    /// use tollgate::clock::{Clock, ManualClock};
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// /// A manual clock that counts how often it is readied.
    /// #[derive(Clone, Default)]
    /// struct Counted {
    ///     clock: ManualClock,
    ///     prepared: Arc<AtomicU32>,
    /// }
    ///
    /// impl Clock for Counted {
    ///     fn now(&self) -> u64 {
    ///         self.clock.now()
    ///     }
    ///
    ///     fn prepare(&self) {
    ///         self.prepared.fetch_add(1, Ordering::Relaxed);
    ///     }
    /// }
    ///
    /// let clock = Counted::default();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// assert_eq!(clock.prepared.load(Ordering::Relaxed), 1); // when the store was built
    /// let policies = PolicySet::from(Policy::fixed_window("api", 5, Duration::from_secs(1))?);
    /// for _ in 0..3 {
    ///     assert!(store.check("k", &policies, 1).is_allowed());
    /// }
    /// assert_eq!(clock.prepared.load(Ordering::Relaxed), 1); // not on each decision
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    fn prepare(&self) {}
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    #[inline]
    fn now(&self) -> u64 {
        (**self).now()
    }

    fn prepare(&self) {
        (**self).prepare();
    }
}

/// The process's anchor: one monotonic instant and the Unix time it was read at.
struct Anchor {
    instant: Instant,
    epoch_nanos: u64,
}

/// A duration in nanoseconds, the largest when it does not fit (about 584 years).
pub(crate) fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds since the Unix epoch of a wall-clock reading. A clock set before 1970, or
/// past what 64 bits of nanoseconds hold (the year 2554: a garbage RTC), counts from 0,
/// which keeps every decision correct (windows are then aligned to the process start
/// instead). Clamped to the largest value, the line would stand still for good: no
/// bucket would refill and no window would end.
fn epoch_nanos(since: Option<Duration>) -> u64 {
    since
        .and_then(|since| u64::try_from(since.as_nanos()).ok())
        // Room for centuries of uptime past it.
        .filter(|&nanos| nanos <= u64::MAX / 2)
        .unwrap_or(0)
}

fn anchor() -> &'static Anchor {
    static ANCHOR: OnceLock<Anchor> = OnceLock::new();
    ANCHOR.get_or_init(|| {
        let instant = Instant::now();
        // The only wall-clock reading: it places the monotonic line on the epoch.
        let epoch_nanos = epoch_nanos(SystemTime::now().duration_since(UNIX_EPOCH).ok());
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
/// A thread reads the OS clock on its first reading, then whenever 64 readings in a row
/// have been carried, a millisecond has passed on the counter, or the counter has not
/// moved forward (stopped, or another core's counter behind this one's). Between two OS
/// readings the time is the last OS reading plus the counter's calibrated nanoseconds
/// since. The counter carries only once it has kept the OS clock's pace: over every second
/// or more between two OS readings (by any threads of the process), the counter's time is
/// compared with the OS clock's. The first such check that finds the two within a factor
/// of two lets the counter carry, in the whole process; two checks in a row that find them
/// further apart stop it for good (a warning is logged, with the `tracing` feature), and
/// from then on every reading is the OS clock's. Until the first check, about a second
/// into a busy process, every reading is the OS clock's too. So, whatever the counter
/// does:
///
/// - the time never runs more than one millisecond ahead of the OS clock;
/// - it never decreases on a thread (a time given early stands until the OS clock reaches
///   it);
/// - it is never behind the thread's last OS reading.
///
/// Readings on two threads can differ by up to that much (and a tokio task can move
/// between threads), so code that subtracts two readings should saturate; a store's
/// decisions allow for time that seems to go back a little, which happens with any clock
/// (a request that read the time first can reach the lock second).
///
/// The counter is calibrated once per process (by `quanta`: it stops within 200 ms,
/// usually within a millisecond or a few), when a store on this clock is built
/// ([`Clock::prepare`]).
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
#[derive(Clone, Default)]
pub struct CarriedClock {
    /// A counter, an OS clock and a trust of the test's own.
    #[cfg(test)]
    fake: Option<tests::Fake>,
    _private: (),
}

impl std::fmt::Debug for CarriedClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CarriedClock")
            .field("carries", &self.trust().carries())
            .finish_non_exhaustive()
    }
}

impl CarriedClock {
    /// The clock (every instance in a process shows the same time).
    pub fn new() -> Self {
        anchor();
        Self::default()
    }

    /// Whether the counter may carry readings now: it has kept the OS clock's pace over a
    /// second, and it has not been found off nor stopped since. (A counter that stops or
    /// goes back still carries nothing: such readings go to the OS clock.)
    ///
    /// ```
    /// use tollgate::clock::CarriedClock;
    ///
    /// // In a process that just started, the counter has not been checked yet.
    /// # let _ =
    /// CarriedClock::carries();
    /// ```
    pub fn carries() -> bool {
        PROCESS_TRUST.carries()
    }

    /// Stops the counter carrying, for good and in the whole process: every reading of
    /// every `CarriedClock` from the next one on (in every `MemoryStore` on the default
    /// clock, the local fallback's included) is the OS clock's, as with [`MonotonicClock`],
    /// and the counter is not read. For a host whose counter you know not to trust.
    ///
    /// ```standalone_crate
    /// use tollgate::clock::CarriedClock;
    ///
    /// CarriedClock::stop_carrying();
    /// assert!(!CarriedClock::carries());
    /// ```
    pub fn stop_carrying() {
        PROCESS_TRUST.stop();
    }

    #[inline]
    fn counter(&self) -> &quanta::Clock {
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            return &fake.counter;
        }
        static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
        COUNTER.get_or_init(quanta::Clock::new)
    }

    #[inline]
    fn trust(&self) -> &Trust {
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            return &fake.trust;
        }
        &PROCESS_TRUST
    }

    fn os_now(&self) -> u64 {
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            return (fake.os)();
        }
        MonotonicClock { _private: () }.now()
    }

    /// Reads the OS clock between two readings of the counter, and judges the counter's
    /// pace by it. The second part is whether this reading stopped the counter carrying.
    /// (Out of the common path with its one caller, [`CarriedClock::read_os`].)
    fn os_reading(&self, counter: &quanta::Clock) -> (OsReading, bool) {
        let before = counter.raw();
        let nanos = self.os_now();
        let after = counter.raw();
        let trust = self.trust();
        let stopped = trust.judge((before, nanos, after), |from, to| {
            counter.delta_as_nanos(from, to)
        });
        let reading = OsReading {
            nanos,
            ticks: after,
            trusted: trust.carries(),
        };
        (reading, stopped)
    }

    /// A reading once the counter is stopped: the OS clock's, never earlier than one
    /// given before on this thread.
    #[cold]
    #[inline(never)]
    fn os_only(&self) -> u64 {
        let nanos = self.os_now();
        CARRY.with(|carry| carry.give(nanos))
    }

    /// A reading that the counter may not carry: an OS reading, judged, from which the
    /// thread carries afresh.
    #[cold]
    #[inline(never)]
    fn read_os(&self, counter: &quanta::Clock) -> u64 {
        let (reading, stopped) = self.os_reading(counter);
        let now = CARRY.with(|carry| carry.restart(reading));
        if stopped {
            warn_stopped();
        }
        now
    }
}

/// How far past a thread's last OS reading the counter may carry the time.
const CARRY_NANOS: u64 = 1_000_000;
/// How many readings in a row the counter may carry on a thread.
const CARRY_READINGS: u32 = 64;
/// The shortest stretch between two OS readings over which the counter's pace is judged.
const JUDGE_NANOS: u64 = 1_000_000_000;
/// The longest the counter may run while the OS clock is read for a judged pair: longer,
/// the thread was held up in between and the pair judges nothing.
const PAIR_NANOS: u64 = 50_000;

/// Whether the counter may carry the time: unknown until it has kept the OS clock's pace
/// over a second, then trusted until found off (or stopped by hand), for good. One for
/// the process: any thread's OS readings judge it, so short-lived threads count too.
struct Trust {
    state: AtomicU8,
    /// The OS time from which the next judgement is due: before it, an OS reading does not
    /// even try the judge's lock.
    due: AtomicU64,
    judge: Mutex<Judge>,
}

const UNKNOWN: u8 = 0;
const TRUSTED: u8 = 1;
const STOPPED: u8 = 2;

impl Trust {
    const fn new(state: u8) -> Self {
        Self {
            state: AtomicU8::new(state),
            due: AtomicU64::new(0),
            judge: Mutex::new(Judge::NONE),
        }
    }

    #[inline]
    fn state(&self) -> u8 {
        self.state.load(Ordering::Relaxed)
    }

    #[inline]
    fn carries(&self) -> bool {
        self.state() == TRUSTED
    }

    #[inline]
    fn stopped(&self) -> bool {
        self.state() == STOPPED
    }

    fn kept_pace(&self) {
        let _ = self
            .state
            .compare_exchange(UNKNOWN, TRUSTED, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Stops it; true when it was not stopped before.
    fn stop(&self) -> bool {
        self.state.swap(STOPPED, Ordering::Relaxed) != STOPPED
    }

    /// Judges the counter by an OS reading between two of the counter's (see
    /// [`Judge::judge`]), unless another thread is judging it now. True when this call
    /// stopped it.
    fn judge(&self, pair: (u64, u64, u64), elapsed: impl Fn(u64, u64) -> u64) -> bool {
        if self.stopped() || pair.1 < self.due.load(Ordering::Relaxed) {
            return false;
        }
        // Busy: another thread is judging, this reading judges nothing. (Nothing panics
        // while it is held; a poisoned judge would still be whole.)
        let mut judge = match self.judge.try_lock() {
            Ok(judge) => judge,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        judge.judge(pair, elapsed, self)
    }
}

static PROCESS_TRUST: Trust = Trust::new(UNKNOWN);

/// One thread's last OS reading and what the counter showed then. Each field is a cell
/// of its own: a common reading reads the four and writes two (the readings left and
/// the last time given), with no copy of the whole in and out.
#[derive(Debug)]
struct Carry {
    /// The counter just after the last OS reading.
    ticks: Cell<u64>,
    /// The OS clock then, in nanoseconds on the epoch-aligned line.
    nanos: Cell<u64>,
    /// Readings the counter may still carry.
    readings_left: Cell<u32>,
    /// The last time given on this thread: none later is earlier.
    last: Cell<u64>,
}

/// An OS reading: the time, the counter just after it, and whether the counter may carry
/// the time from it.
struct OsReading {
    nanos: u64,
    ticks: u64,
    trusted: bool,
}

impl Carry {
    const fn new() -> Self {
        Carry {
            ticks: Cell::new(0),
            nanos: Cell::new(0),
            readings_left: Cell::new(0),
            last: Cell::new(0),
        }
    }

    /// The time when the counter shows `ticks`: carried from the last OS reading by
    /// `elapsed(from, to)` (the counter's calibrated nanoseconds) while that is within
    /// bounds, else a new OS reading (`os`). (What [`CarriedClock`] does, in one call:
    /// the simulations of the tests read it so.)
    #[cfg(test)]
    fn now(
        &self,
        ticks: u64,
        elapsed: impl FnOnce(u64, u64) -> u64,
        os: impl FnOnce() -> OsReading,
    ) -> u64 {
        match self.carry(ticks, elapsed) {
            Some(now) => now,
            None => self.restart(os()),
        }
    }

    /// The time carried from the last OS reading to `ticks`, if that is within bounds
    /// (it spends one of the readings the counter may carry); none if an OS reading is
    /// due. The whole of a reading's common path: small enough to inline.
    #[inline]
    fn carry(&self, ticks: u64, elapsed: impl FnOnce(u64, u64) -> u64) -> Option<u64> {
        let (left, from) = (self.readings_left.get(), self.ticks.get());
        if left == 0 || ticks <= from {
            return None;
        }
        let nanos = elapsed(from, ticks);
        if nanos > CARRY_NANOS {
            return None;
        }
        self.readings_left.set(left - 1);
        Some(self.give(self.nanos.get().saturating_add(nanos)))
    }

    /// Starts carrying afresh from an OS reading; gives its time.
    fn restart(&self, reading: OsReading) -> u64 {
        self.ticks.set(reading.ticks);
        self.nanos.set(reading.nanos);
        self.readings_left
            .set(if reading.trusted { CARRY_READINGS } else { 0 });
        self.give(reading.nanos)
    }

    /// Gives `now`, or the last time given on this thread if that is later: a counter
    /// that ran fast gave times the OS clock has not reached yet, and they stand until it
    /// does.
    #[inline]
    fn give(&self, now: u64) -> u64 {
        let now = now.max(self.last.get());
        self.last.set(now);
        now
    }
}

/// The judge of the counter's pace: the reference OS reading, and how many judgements in a
/// row found the counter off.
#[derive(Debug, Clone, Copy)]
struct Judge {
    nanos: u64,
    ticks: u64,
    off_in_a_row: u8,
}

impl Judge {
    const NONE: Judge = Judge {
        nanos: 0,
        ticks: 0,
        off_in_a_row: 0,
    };

    /// Judges the counter by an OS reading `nanos` taken between the counter's `before`
    /// and `after`, against the reference reading, once at least [`JUDGE_NANOS`] have
    /// passed since on the OS clock: within a factor of two, the counter has kept pace
    /// (and may carry, if it was not known yet); off twice in a row, it is stopped. True
    /// when this call stopped it.
    fn judge(
        &mut self,
        (before, nanos, after): (u64, u64, u64),
        elapsed: impl Fn(u64, u64) -> u64,
        trust: &Trust,
    ) -> bool {
        if after < before || elapsed(before, after) > PAIR_NANOS {
            return false;
        }
        if self.nanos == 0 || after <= self.ticks || nanos < self.nanos {
            // The first reading, or a counter that went back (another core's): start over.
            self.refer_to(nanos, after, trust);
            return false;
        }
        let os = nanos - self.nanos;
        if os < JUDGE_NANOS {
            return false;
        }
        let counter = elapsed(self.ticks, after);
        if counter <= os.saturating_mul(2) && counter.saturating_mul(2) >= os {
            self.refer_to(nanos, after, trust);
            self.off_in_a_row = 0;
            trust.kept_pace();
            false
        } else {
            // The next judgement starts from a fresh reference: one odd reading (a core
            // whose counter is far off) must not spoil two judgements.
            self.nanos = 0;
            trust.due.store(0, Ordering::Relaxed);
            self.off_in_a_row = self.off_in_a_row.saturating_add(1);
            self.off_in_a_row >= 2 && trust.stop()
        }
    }

    /// Makes the reading at `nanos` (the counter at `ticks`) the reference; the next
    /// judgement is due [`JUDGE_NANOS`] later.
    fn refer_to(&mut self, nanos: u64, ticks: u64, trust: &Trust) {
        self.nanos = nanos;
        self.ticks = ticks;
        trust
            .due
            .store(nanos.saturating_add(JUDGE_NANOS), Ordering::Relaxed);
    }
}

thread_local! {
    static CARRY: Carry = const { Carry::new() };
}

impl Clock for CarriedClock {
    #[inline]
    fn now(&self) -> u64 {
        // Read on every reading: a stop (by the judge, or by hand) holds from the next one.
        // (Only an OS reading lets the counter carry, and only once it is trusted.)
        if self.trust().stopped() {
            return self.os_only();
        }
        let counter = self.counter();
        let ticks = counter.raw();
        let carried =
            CARRY.with(|carry| carry.carry(ticks, |from, to| counter.delta_as_nanos(from, to)));
        match carried {
            Some(now) => now,
            None => self.read_os(counter),
        }
    }

    fn prepare(&self) {
        // Calibrates the counter, and gives the judge its first reading.
        self.now();
    }
}

#[cold]
fn warn_stopped() {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        "the CPU's time-stamp counter does not keep the OS clock's pace: the in-process \
         store's clock reads the OS clock from now on"
    );
}

#[cold]
fn warn_behind_origin() {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        "the CPU's time-stamp counter read behind where the TSC clock started, or its time \
         far behind the OS clock's (reset by a resume from suspend, or another socket's \
         counter): the TSC clock reads the OS clock from now on"
    );
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
    anchor: Arc<TscAnchor>,
}

/// Where a counter reading sits on the epoch-aligned line: one for the process, so every
/// `TscClock` gives one time (a thread's last time is one for all of them), and once the
/// counter was seen behind its origin, the OS clock for good.
#[derive(Debug)]
struct TscAnchor {
    origin: u64,
    epoch_nanos: u64,
    /// The counter was behind its origin (reset by a resume, or another socket's), or its
    /// time far behind the OS clock's: its readings say nothing of the time since.
    fallen_back: std::sync::atomic::AtomicBool,
    /// When (on the counter's line) the counter's time is next compared with the OS
    /// clock's; 0: at the first reading.
    next_check: AtomicU64,
}

impl TscAnchor {
    fn new(clock: &quanta::Clock) -> Self {
        Self {
            origin: clock.raw(),
            epoch_nanos: MonotonicClock::new().now(),
            fallen_back: std::sync::atomic::AtomicBool::new(false),
            next_check: AtomicU64::new(0),
        }
    }
}

impl TscClock {
    /// A TSC clock on the process's epoch-aligned line, anchored when the first one was
    /// made.
    pub fn new() -> Self {
        static ANCHOR: OnceLock<Arc<TscAnchor>> = OnceLock::new();
        let clock = quanta::Clock::new();
        let anchor = ANCHOR.get_or_init(|| Arc::new(TscAnchor::new(&clock)));
        Self {
            clock,
            anchor: Arc::clone(anchor),
        }
    }
}

impl Default for TscClock {
    fn default() -> Self {
        Self::new()
    }
}

thread_local! {
    /// The latest time a `TscClock` gave on this thread.
    static TSC_LAST: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The time of counter reading `raw` on the line `epoch` placed at `origin`; `None` when
/// the counter is behind its origin (reset by a resume from suspend, or another socket's
/// counter behind this one's), where the difference would read as no time at all.
fn counter_time(epoch: u64, origin: u64, raw: u64, nanos: impl Fn(u64, u64) -> u64) -> Option<u64> {
    (raw >= origin).then(|| epoch.saturating_add(nanos(origin, raw)))
}

/// `now`, or the last time given on this thread if that is later: a thread's time never
/// steps back, whatever the counter of the core it runs on says.
#[inline]
fn tsc_give(now: u64) -> u64 {
    TSC_LAST.with(|last| {
        let now = now.max(last.get());
        last.set(now);
        now
    })
}

impl Clock for TscClock {
    #[inline]
    fn now(&self) -> u64 {
        let anchor = &*self.anchor;
        if anchor.fallen_back.load(Ordering::Relaxed) {
            return tsc_give(MonotonicClock::new().now());
        }
        let raw = self.clock.raw();
        let now = match counter_time(anchor.epoch_nanos, anchor.origin, raw, |from, to| {
            self.clock.delta_as_nanos(from, to)
        }) {
            Some(now) => {
                // Once a second, and whenever a reading is far behind the last
                // comparison's (a counter reset, then grown past its origin before this
                // process read it: an idle process), the OS clock has its say.
                let next = anchor.next_check.load(Ordering::Relaxed);
                if now >= next || now.saturating_add(2 * TSC_CHECK_EVERY) < next {
                    tsc_check(anchor, now)
                } else {
                    now
                }
            }
            // A counter behind its origin says nothing, then or later (grown past its
            // origin again, it would read as the time before the reset): the OS clock
            // answers from now on.
            None => fall_back(anchor, MonotonicClock::new().now()),
        };
        tsc_give(now)
    }
}

/// How often (on the counter's line) a [`TscClock`] compares its time with the OS clock's.
const TSC_CHECK_EVERY: u64 = 1_000_000_000;
/// How far behind the OS clock a [`TscClock`]'s time may be before its counter is taken
/// to have been reset: a second, and a ten-thousandth of the time since the anchor (a
/// calibration some parts per million off adds up over days of uptime, and the OS clock
/// is disciplined by NTP while the counter is not). A reset puts the time behind by as
/// much as the counter had counted: the process's uptime and more.
const TSC_BEHIND_LIMIT: u64 = 1_000_000_000;
/// The drift allowed beside [`TSC_BEHIND_LIMIT`]: one part in this of the uptime.
const TSC_DRIFT_PER: u64 = 10_000;

/// The counter says nothing from now on: the OS clock's reading `os` answers, now and
/// for good (said once).
#[cold]
fn fall_back(anchor: &TscAnchor, os: u64) -> u64 {
    if !anchor.fallen_back.swap(true, Ordering::Relaxed) {
        warn_behind_origin();
    }
    os
}

/// Compares the counter's time `now` with the OS clock's: far behind it, the counter was
/// reset (a resume from suspend) and the OS clock answers from now on. Ahead of it is
/// kept: a counter that ran through a suspend the OS clock does not count (Linux's
/// `CLOCK_MONOTONIC`) is nearer the time that passed, and stepping back to the OS clock
/// would stand a thread's time still that long.
#[cold]
#[inline(never)]
fn tsc_check(anchor: &TscAnchor, now: u64) -> u64 {
    let os = MonotonicClock::new().now();
    let drift = os.saturating_sub(anchor.epoch_nanos) / TSC_DRIFT_PER;
    if now.saturating_add(TSC_BEHIND_LIMIT + drift) < os {
        return fall_back(anchor, os);
    }
    anchor
        .next_check
        .store(now.saturating_add(TSC_CHECK_EVERY), Ordering::Relaxed);
    now
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let store_side = clock.clone(); // say, the one given to a store
/// assert_eq!(store_side.now(), 0);
/// assert_eq!(store_side.now(), 0); // it stands still between readings
/// clock.advance(Duration::from_millis(1_500));
/// assert_eq!(store_side.now(), 1_500_000_000); // the clone moved too
/// ```
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
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::{Clock, ManualClock};
    ///
    /// let clock = ManualClock::new();
    /// clock.set(Duration::from_secs(10));
    /// assert_eq!(clock.now(), 10_000_000_000);
    /// clock.set(Duration::from_secs(4)); // earlier: ignored
    /// assert_eq!(clock.now(), 10_000_000_000);
    /// ```
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
/// client-side pacer uses it; so can a `limiter::Limiter` tested with
/// paused time.
///
/// With tokio's time paused, the clock stands still until the runtime's time moves
/// (`tokio::time::advance`, or a `sleep` the runtime skips ahead through):
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, RuntimeClock};
/// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = RuntimeClock::new();
/// let start = clock.now();
/// tokio::time::advance(Duration::from_millis(250)).await;
/// assert_eq!(clock.now() - start, 250_000_000);
///
/// let store = MemoryStore::builder().clock(clock).build();
/// let policies = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_second(1))?);
/// assert!(store.check("k", &policies, 1).is_allowed());
/// let denied = store.check("k", &policies, 1);
/// assert_eq!(denied.retry_after(), Some(Duration::from_secs(1)));
/// // Sleeping the wait the store named is enough, on paused time as on real time.
/// tokio::time::sleep(Duration::from_secs(1)).await;
/// assert!(store.check("k", &policies, 1).is_allowed());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RuntimeClock {
    base: tokio::time::Instant,
    epoch: u64,
}

impl RuntimeClock {
    /// The runtime's clock, anchored now on the process's line (its one wall-clock
    /// reading, as every other clock of the process).
    pub fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            epoch: MonotonicClock::new().now(),
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

    /// A wall clock past the year 2554 (a garbage RTC) once placed the line at
    /// `u64::MAX`, where every reading after it saturated: time stood still, no bucket
    /// refilled and no window ended. It counts from 0 now, as a clock before 1970 does.
    #[test]
    fn a_wall_clock_out_of_range_counts_from_zero() {
        assert_eq!(epoch_nanos(None), 0);
        assert_eq!(epoch_nanos(Some(Duration::from_secs(u64::MAX))), 0);
        assert_eq!(
            epoch_nanos(Some(Duration::from_secs(600 * 365 * 86_400))),
            0
        );
        assert_eq!(
            epoch_nanos(Some(Duration::from_secs(1_800_000_000))),
            1_800_000_000_000_000_000
        );
    }

    /// A counter behind its origin (reset on resume, or another socket's) read as no time
    /// at all: the clock snapped back to the moment it was built. It says nothing now, the
    /// OS clock answers, and a thread's time never steps back.
    #[test]
    fn a_counter_behind_its_origin_says_nothing_and_time_never_steps_back() {
        let nanos = |from: u64, to: u64| to - from;
        assert_eq!(counter_time(1_000, 50, 80, nanos), Some(1_030));
        assert_eq!(counter_time(1_000, 50, 10, nanos), None);
        let clock = TscClock::new();
        let mut last = clock.now();
        for _ in 0..10_000 {
            let now = clock.now();
            assert!(now >= last);
            last = now;
        }
        let later = tsc_give(u64::MAX / 4);
        assert_eq!(
            tsc_give(5),
            later,
            "an earlier reading gives the later time"
        );
    }

    /// A counter reset by a resume from suspend reads the OS clock, and keeps reading it
    /// once the counter has grown past its origin again: read then as time since the
    /// origin, it stood where it was before the reset (days behind after a day's uptime),
    /// and a thread's time, which never steps back, stood still until that caught up.
    #[test]
    fn a_counter_reset_reads_the_os_clock_for_good() {
        let (clock, mock) = quanta::Clock::mock();
        mock.increment(Duration::from_secs(100));
        let start = MonotonicClock::new().now();
        let tsc = TscClock {
            anchor: Arc::new(TscAnchor::new(&clock)),
            clock,
        };
        mock.increment(Duration::from_secs(1));
        assert!(tsc.now() >= start + 1_000_000_000);
        // Reset on resume: behind its origin.
        mock.decrement(Duration::from_secs(50));
        let os = tsc.now();
        // Grown past its origin again: 20 s since it, which says nothing of the time.
        mock.increment(Duration::from_secs(70));
        let later = tsc.now();
        assert!(
            later < start + 10_000_000_000,
            "read as 20 s after the origin: {} s after the start",
            (later - start) / 1_000_000_000
        );
        assert!(later >= os);
    }

    /// A counter reset by a resume that has grown past its origin again before any
    /// reading (an idle process: a counter started at a day's uptime takes a day to get
    /// there) reads as if no time had passed since the origin but what it counted since
    /// the resume: far behind the OS clock, and a thread's time stood still until it
    /// caught up. The clock compares itself with the OS clock once a second and whenever
    /// a reading is far behind the last comparison's, and reads the OS clock from then on.
    #[test]
    fn a_counter_reset_and_grown_past_its_origin_reads_the_os_clock() {
        let (clock, mock) = quanta::Clock::mock();
        // Anchored 100 s ago, at a counter that has counted those 100 s since.
        mock.increment(Duration::from_secs(1_000));
        let anchor = TscAnchor::new(&clock);
        let anchor = TscAnchor {
            epoch_nanos: anchor.epoch_nanos - 100_000_000_000,
            ..anchor
        };
        mock.increment(Duration::from_secs(100));
        let tsc = TscClock {
            anchor: Arc::new(anchor),
            clock,
        };
        let os = MonotonicClock::new();
        let before = os.now();
        let now = tsc.now();
        assert!(
            now.abs_diff(before) < 1_000_000_000,
            "on the OS clock's line"
        );
        // Reset on resume, idle until the counter is 10 s past its origin: 90 s behind.
        mock.decrement(Duration::from_secs(90));
        std::thread::sleep(Duration::from_millis(10));
        let before = os.now();
        let now = tsc.now();
        assert!(
            now >= before,
            "{} ms behind the OS clock",
            (before - now) / 1_000_000
        );
        // On another thread, whose last time is none.
        let tsc = tsc.clone();
        let (now, after) = std::thread::spawn(move || {
            let now = tsc.now();
            (now, os.now())
        })
        .join()
        .unwrap();
        assert!(now.abs_diff(after) < 1_000_000_000);
    }

    /// A calibration a few parts per million off (as `quanta`'s may be, and the OS
    /// clock is disciplined by NTP while the counter is not) puts the counter's time a
    /// second or more behind the OS clock after days of uptime. That is no reset: the
    /// clock keeps reading the counter, and time does not jump.
    #[test]
    fn a_counter_a_few_parts_per_million_slow_is_no_reset() {
        let (clock, mock) = quanta::Clock::mock();
        mock.increment(Duration::from_secs(1_000));
        let day = 86_400_000_000_000;
        let anchor = TscAnchor::new(&clock);
        let anchor = TscAnchor {
            epoch_nanos: anchor.epoch_nanos - 10 * day,
            ..anchor
        };
        // Ten days counted 1.5 s short: 1.7 parts per million.
        mock.increment(Duration::from_nanos(10 * day - 1_500_000_000));
        let tsc = TscClock {
            anchor: Arc::new(anchor),
            clock,
        };
        let now = tsc.now();
        assert!(!tsc.anchor.fallen_back.load(Ordering::Relaxed));
        let os = MonotonicClock::new().now();
        assert!(os - now < 2_000_000_000, "the counter's time, 1.5 s behind");
    }

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

    /// A counter, an OS clock and a trust for a [`CarriedClock`] under test.
    #[derive(Clone)]
    pub(super) struct Fake {
        pub(super) counter: quanta::Clock,
        pub(super) os: Arc<dyn Fn() -> u64 + Send + Sync>,
        pub(super) trust: Arc<Trust>,
    }

    /// A carried clock on a mock counter and an OS clock of the test's; the trust starts
    /// as `trust`.
    fn fake_clock(trust: u8) -> (CarriedClock, Arc<quanta::Mock>, Arc<AtomicU64>, Arc<Trust>) {
        let (counter, mock) = quanta::Clock::mock();
        let os = Arc::new(AtomicU64::new(1_000_000_000));
        let trust = Arc::new(Trust::new(trust));
        let (reader, ticking) = (Arc::clone(&os), Arc::clone(&mock));
        let clock = CarriedClock {
            fake: Some(Fake {
                counter,
                // The counter moves 10 µs while the OS clock is read.
                os: Arc::new(move || {
                    let now = reader.load(Ordering::SeqCst);
                    ticking.increment(10_000);
                    now
                }),
                trust: Arc::clone(&trust),
            }),
            _private: (),
        };
        (clock, mock, os, trust)
    }

    /// A thread's readings from a counter that runs at `rate` times its calibration (0: it
    /// stopped), with jumps back and forth, against an OS clock that moves by `steps`,
    /// with the trust starting as `trust`: (the time given, the OS clock, the last OS
    /// reading) for each, and the trust at the end.
    fn simulate(rate: f64, steps: &[(u64, i64)], trust: u8) -> (Vec<(u64, u64, u64)>, u8) {
        let trust = Trust::new(trust);
        let carry = Carry::new();
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
                trust.judge((ticks, os, ticks), elapsed);
                OsReading {
                    nanos: os,
                    ticks,
                    trusted: trust.carries(),
                }
            });
            seen.push((now, os, read_at));
        }
        (seen, trust.state())
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

    /// A counter's pace against its calibration: stopped, right, slow, fast, any.
    fn counter_rates() -> impl proptest::strategy::Strategy<Value = f64> {
        proptest::prop_oneof![Just(0.0), Just(1.0), Just(0.33), Just(3.0), 0.0f64..10.0]
    }

    /// Up to `most` steps of the OS clock (from a nanosecond to two seconds), each with
    /// the counter's jump back or forth (mostly none).
    fn clock_steps(most: usize) -> impl proptest::strategy::Strategy<Value = Vec<(u64, i64)>> {
        proptest::collection::vec(
            (
                proptest::prop_oneof![1u64..2_000, 1u64..3_000_000, 1u64..2_000_000_000],
                proptest::prop_oneof![Just(0i64), Just(0i64), -5_000_000i64..5_000_000],
            ),
            1..most,
        )
    }

    /// The clock's bounds over its readings, each (the time given, the OS clock then, the
    /// time of the last OS reading): never back, never more than 1 ms ahead of the OS
    /// clock, never behind its own OS reading, at most 64 carried in a row. (The OS clock
    /// moves on every step, so a new OS reading has a new time.)
    fn within_bounds(seen: &[(u64, u64, u64)]) -> Result<(), String> {
        let (mut last, mut carried_in_a_row, mut read_at) = (0, 0, 0);
        for (index, &(now, os, reading)) in seen.iter().enumerate() {
            if now < last {
                return Err(format!("reading {index} went back: {now} < {last}"));
            }
            if now > os + 1_000_000 {
                return Err(format!("reading {index} ran ahead: {now} vs {os}"));
            }
            if now < reading {
                return Err(format!("reading {index} is behind its OS reading"));
            }
            carried_in_a_row = if reading != read_at {
                0
            } else {
                carried_in_a_row + 1
            };
            read_at = reading;
            if carried_in_a_row > 64 {
                return Err(format!(
                    "reading {index}: {carried_in_a_row} carried in a row"
                ));
            }
            last = now;
        }
        Ok(())
    }

    /// `CarriedClock::now` itself (the thread's own carry, the out-of-line OS reading,
    /// the judge) on a mock counter and an OS clock of the test's, driven as `simulate`
    /// drives the steps alone; call it on a fresh thread.
    fn drive(rate: f64, steps: &[(u64, i64)], trust: u8) -> Vec<(u64, u64, u64)> {
        let (mut clock, mock, os, _) = fake_clock(trust);
        // Far from zero: the jumps back must not wrap the counter.
        mock.increment(1_000_000_000_000_u64);
        // The time of the last OS reading, noted as the clock reads it.
        let read = Arc::new(AtomicU64::new(0));
        let fake = clock.fake.as_mut().expect("a fake clock");
        let (reading, noted) = (Arc::clone(&fake.os), Arc::clone(&read));
        fake.os = Arc::new(move || {
            let now = reading();
            noted.store(now, Ordering::SeqCst);
            now
        });
        let mut seen = Vec::with_capacity(steps.len());
        for &(step, jump) in steps {
            os.fetch_add(step, Ordering::SeqCst);
            mock.increment((step as f64 * rate) as u64);
            if jump >= 0 {
                mock.increment(jump.unsigned_abs());
            } else {
                mock.decrement(jump.unsigned_abs());
            }
            let now = clock.now();
            seen.push((now, os.load(Ordering::SeqCst), read.load(Ordering::SeqCst)));
        }
        seen
    }

    proptest::proptest! {
        #[test]
        fn the_carried_time_follows_the_os_clock_whatever_the_counter_does(
            rate in counter_rates(),
            steps in clock_steps(400),
            trust in 0u8..3,
        ) {
            let (seen, _) = simulate(rate, &steps, trust);
            proptest::prop_assert_eq!(within_bounds(&seen), Ok(()));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The same bounds, read through `CarriedClock::now` itself, on a fresh thread
        /// per case (the carry is the thread's).
        #[test]
        fn the_clock_itself_follows_the_os_clock_whatever_the_counter_does(
            rate in counter_rates(),
            steps in clock_steps(300),
            trust in 0u8..3,
        ) {
            let seen = std::thread::spawn(move || drive(rate, &steps, trust))
                .join()
                .expect("the case's thread panicked");
            proptest::prop_assert_eq!(within_bounds(&seen), Ok(()));
        }
    }

    use proptest::prelude::Just;

    /// Readings of a counter at `rate` every `step` for `seconds`, from an unknown trust:
    /// whether it ever carried (a reading without an OS reading), and the trust at the end.
    fn judged(rate: f64, step: u64, seconds: u64) -> (bool, u8) {
        let count = (seconds * 1_000_000_000 / step) as usize;
        let (seen, trust) = simulate(rate, &vec![(step, 0); count], UNKNOWN);
        (seen.iter().any(|&(_, os, read_at)| read_at != os), trust)
    }

    #[test]
    fn a_right_counter_gives_the_os_time_and_reads_it_once_in_65() {
        // Readings 100 ns apart: the millisecond bound is far, the count bound reads the
        // OS clock on the first reading and then once every 65.
        let (seen, _) = simulate(1.0, &vec![(100, 0); 1_000], TRUSTED);
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        assert_eq!(os_readings(&seen), 1_000_usize.div_ceil(65));
        // Readings 300 µs apart: the millisecond bound reads it every fourth reading.
        let (seen, _) = simulate(1.0, &vec![(300_000, 0); 1_000], TRUSTED);
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        assert_eq!(os_readings(&seen), 1_000_usize.div_ceil(4));
    }

    #[test]
    fn the_counter_carries_once_it_kept_the_os_clocks_pace_for_a_second() {
        let (seen, trust) = simulate(1.0, &vec![(10_000, 0); 300_000], UNKNOWN);
        assert_eq!(trust, TRUSTED);
        let first_carried = seen
            .iter()
            .position(|&(_, os, read_at)| read_at != os)
            .unwrap();
        // Steps of 10 µs: the first second (100,000 readings) all read the OS clock.
        assert!(
            (100_000..101_000).contains(&first_carried),
            "{first_carried}"
        );
        assert!(seen.iter().all(|&(now, os, _)| now == os));
        // A right counter over ten seconds is never found off.
        assert_eq!(judged(1.0, 100_000, 10), (true, TRUSTED));
    }

    #[test]
    fn a_counter_off_by_more_than_twice_never_carries() {
        assert_eq!(judged(1.9, 100_000, 5), (true, TRUSTED));
        assert_eq!(judged(0.6, 100_000, 5), (true, TRUSTED));
        assert_eq!(judged(2.1, 100_000, 5), (false, STOPPED));
        assert_eq!(judged(0.4, 100_000, 5), (false, STOPPED));
        // Three times fast (timers under some hypervisors, see the module docs), or a
        // thousand times slow: every reading is the OS clock's, from the start.
        for rate in [3.0, 0.001] {
            let (seen, trust) = simulate(rate, &vec![(100_000, 0); 50_000], UNKNOWN);
            assert_eq!(trust, STOPPED, "rate {rate}");
            assert!(
                seen.iter()
                    .all(|&(now, os, read_at)| now == os && read_at == os)
            );
        }
    }

    #[test]
    fn a_counter_that_goes_wrong_later_stays_within_a_millisecond_and_is_stopped() {
        // Trusted, then three times fast: a 1 ms carry reaches 1 ms ahead in a third of a
        // millisecond, and the time stands until the OS clock catches up; two judgements
        // later (two seconds) every reading is the OS clock's.
        let (seen, trust) = simulate(3.0, &vec![(10_000, 0); 400_000], TRUSTED);
        assert_eq!(trust, STOPPED);
        let ahead = seen
            .iter()
            .map(|&(now, os, _)| now.saturating_sub(os))
            .max()
            .unwrap();
        assert!(ahead > 0 && ahead <= 1_000_000, "{ahead}");
        let exact_from = seen
            .iter()
            .rposition(|&(now, os, read_at)| now != os || read_at != os)
            .map_or(0, |index| index + 1);
        assert!(
            exact_from <= 301_000,
            "exact only from reading {exact_from}"
        );
    }

    #[test]
    fn one_judgement_off_does_not_stop_the_counter() {
        // A pause that the counter counted and the OS clock did not (or the reverse), once;
        // then again after a good judgement: off, good, good, off is not twice in a row.
        let mut steps = vec![(100_000, 0); 55_000];
        steps[15_000].1 = 3_000_000_000;
        steps[45_000].1 = 3_000_000_000;
        let (seen, trust) = simulate(1.0, &steps, UNKNOWN);
        assert_eq!(trust, TRUSTED);
        assert!(seen[52_000..].iter().any(|&(_, os, read_at)| read_at != os));
    }

    #[test]
    fn readings_out_of_order_or_a_counter_gone_back_judge_nothing() {
        let trust = Trust::new(UNKNOWN);
        let elapsed = |from: u64, to: u64| to.saturating_sub(from);
        let mut judge = Judge::NONE;
        assert!(!judge.judge((2_000, 2_000_000_000, 2_000), elapsed, &trust));
        // Another thread's OS reading, taken before the reference: no judgement.
        assert!(!judge.judge(
            (3_000_000_000, 1_500_000_000, 3_000_000_000),
            elapsed,
            &trust
        ));
        // A counter behind the reference's (another core's): no judgement either.
        let mut judge = Judge::NONE;
        assert!(!judge.judge(
            (5_000_000_000, 1_000_000_000, 5_000_000_000),
            elapsed,
            &trust
        ));
        assert!(!judge.judge((1_000, 9_000_000_000, 1_000), elapsed, &trust));
        assert_eq!((trust.state(), judge.off_in_a_row), (UNKNOWN, 0));
    }

    #[test]
    fn a_stop_by_hand_holds_from_the_next_reading() {
        std::thread::spawn(|| {
            let (clock, mock, os, trust) = fake_clock(TRUSTED);
            let first = clock.now();
            mock.increment(500);
            assert_eq!(clock.now(), first + 500, "carried");
            trust.stop();
            os.fetch_add(300, Ordering::SeqCst);
            mock.increment(500);
            assert_eq!(
                clock.now(),
                first + 500,
                "the OS clock's time, not earlier than given"
            );
            os.fetch_add(900, Ordering::SeqCst);
            assert_eq!(clock.now(), first + 1_200);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_pair_read_across_a_hold_up_judges_nothing() {
        let trust = Trust::new(UNKNOWN);
        let mut judge = Judge::NONE;
        let elapsed = |from: u64, to: u64| to.saturating_sub(from);
        assert!(!judge.judge((0, 1_000, 10), elapsed, &trust));
        // Five seconds on the OS clock, ten on the counter, but 60 µs between the
        // counter's two readings around the OS one: not judged, the reference stays.
        assert!(!judge.judge(
            (10_000_000_000, 5_000_001_000, 10_000_060_000),
            elapsed,
            &trust
        ));
        assert!(!judge.judge(
            (20_000_000_000, 10_000_001_000, 20_000_060_000),
            elapsed,
            &trust
        ));
        assert_eq!((judge.nanos, judge.off_in_a_row), (1_000, 0));
        assert!(!trust.carries() && !trust.stopped());
    }

    #[test]
    fn a_stopped_counter_reads_the_os_clock_every_time() {
        let (seen, _) = simulate(0.0, &vec![(5_000, 0); 100], TRUSTED);
        assert!(
            seen.iter()
                .all(|&(now, os, read_at)| now == os && read_at == os)
        );
    }

    #[test]
    fn the_clock_reads_the_counter_after_the_os_clock_and_carries_from_there() {
        // On a fresh thread: the per-thread state starts empty.
        std::thread::spawn(|| {
            let (clock, mock, os, _) = fake_clock(TRUSTED);
            let first = clock.now();
            assert_eq!(first, 1_000_000_000);
            assert_eq!(CARRY.with(|carry| carry.readings_left.get()), 64);
            for reading in 1..=64_u64 {
                mock.increment(500);
                assert_eq!(clock.now(), first + 500 * reading, "reading {reading}");
            }
            assert_eq!(CARRY.with(|carry| carry.readings_left.get()), 0);
            // The 65th reads the OS clock; the counter moves while it does, and what it
            // counted before the OS reading is not carried again.
            os.store(2_000_000_000, Ordering::SeqCst);
            mock.increment(500);
            assert_eq!(clock.now(), 2_000_000_000);
            assert_eq!(CARRY.with(|carry| carry.readings_left.get()), 64);
            mock.increment(700);
            assert_eq!(clock.now(), 2_000_000_700);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_clock_judges_its_counter_and_stops_it_after_two_bad_judgements() {
        std::thread::spawn(|| {
            let (clock, mock, os, trust) = fake_clock(UNKNOWN);
            // 1.1 s on the OS clock, 3.3 s on the counter, between readings.
            let step = || {
                os.fetch_add(1_100_000_000, Ordering::SeqCst);
                mock.increment(3_300_000_000);
                clock.now()
            };
            // The first reading is the reference, the second judges once (off); the third
            // is a fresh reference, the fourth judges again.
            let readings = [step(), step(), step()];
            assert_eq!(trust.state(), UNKNOWN, "one bad judgement");
            let last = step();
            assert_eq!(trust.state(), STOPPED);
            assert_eq!(readings[2] + 1_100_000_000, last, "the OS clock's time");
        })
        .join()
        .unwrap();
        std::thread::spawn(|| {
            let (clock, mock, os, trust) = fake_clock(UNKNOWN);
            for _ in 0..3 {
                os.fetch_add(1_100_000_000, Ordering::SeqCst);
                mock.increment(1_100_000_000);
                clock.now();
            }
            assert_eq!(trust.state(), TRUSTED);
            assert!(trust.carries());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn threads_that_live_less_than_a_second_judge_the_counter_together() {
        let (clock, mock, os, trust) = fake_clock(UNKNOWN);
        for _ in 0..3 {
            let clock = clock.clone();
            std::thread::spawn(move || clock.now()).join().unwrap();
            os.fetch_add(600_000_000, Ordering::SeqCst);
            mock.increment(600_000_000);
        }
        assert_eq!(trust.state(), TRUSTED);
    }

    #[test]
    fn the_carried_clock_is_on_the_process_line() {
        let carried = CarriedClock::new();
        carried.prepare();
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
