//! The algorithm of a policy and its parameters, as the user gave them (durations in
//! whole microseconds once a policy keeps them).

use std::time::Duration;

use super::Rate;

/// The algorithm of a policy and its parameters, as the user gave them.
///
/// Build policies with the [`Policy`](super::Policy) constructors; this type is what
/// [`Policy::algorithm`](super::Policy::algorithm) reports back, with its durations as
/// the policy keeps them: whole microseconds (see [`Policy`](super::Policy)).
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Algorithm, Policy, Rate};
///
/// let api = Policy::gcra("api", Rate::per_second(5), 10)?;
/// match api.algorithm() {
///     Algorithm::Gcra { rate, burst } => assert_eq!((rate, burst), (Rate::per_second(5), 10)),
///     other => panic!("not GCRA: {other:?}"),
/// }
/// // 1.5005 ms is kept as 1,501 µs (a window is rounded up).
/// let short = Policy::fixed_window("short", 1, Duration::from_nanos(1_500_500))?;
/// let window = Duration::from_micros(1_501);
/// assert_eq!(short.algorithm(), Algorithm::FixedWindow { limit: 1, window });
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// `limit` units per window aligned to the store's clock. Cheap; admits up to twice
    /// the limit across a window seam.
    FixedWindow {
        /// Units admitted per window.
        limit: u64,
        /// The window length.
        window: Duration,
    },
    /// Exact: remembers every admitted request for one window.
    SlidingLog {
        /// Units admitted in any window.
        limit: u64,
        /// The window length.
        window: Duration,
    },
    /// Counts per sub-window and a weighted estimate: the oldest sub-window counted by the
    /// share of it still inside the window (see [`Policy::sliding_window_split`](super::Policy::sliding_window_split)). With
    /// one sub-window, `previous * (1 - elapsed / window) + current`.
    SlidingWindow {
        /// Units admitted per (estimated) window.
        limit: u64,
        /// The window length.
        window: Duration,
        /// How many equal sub-windows the window is counted in (1: the classic two
        /// counters; more: finer, at one counter each).
        sub_windows: u32,
    },
    /// Bursts up to `capacity`, refilled at `refill`.
    TokenBucket {
        /// The burst size.
        capacity: u64,
        /// The sustained rate.
        refill: Rate,
    },
    /// A leaky bucket as a meter (police): it holds up to `capacity` units and leaks at
    /// `leak`; what does not fit is denied. The token bucket seen from the other side.
    LeakyBucket {
        /// How much the bucket holds.
        capacity: u64,
        /// The leak (output) rate.
        leak: Rate,
    },
    /// A leaky bucket as a queue (shape): requests leave at `leak`, each held back until
    /// those ahead of it have left; one that would wait longer than `max_delay` is denied.
    /// Its burst, `max_delay * leak + 1` unit requests, is what
    /// [`Policy::limit`](super::Policy::limit) reports.
    LeakyShaping {
        /// The leak (output) rate.
        leak: Rate,
        /// The longest a request may be held back.
        max_delay: Duration,
    },
    /// Generic cell rate algorithm: one timestamp per key, the token bucket in one number.
    Gcra {
        /// The sustained rate.
        rate: Rate,
        /// How many units may arrive back to back.
        burst: u64,
    },
    /// In-flight (concurrency) limit: at most `limit` requests of a key in progress at
    /// once. A slot is taken when a request is admitted and given back when its response
    /// body ends or is dropped, however the request ends.
    Concurrency {
        /// Requests in progress at once.
        limit: u64,
        /// How long a shared store (Redis) keeps a slot whose holder never gave it back
        /// (a replica that died): the slot expires by itself after this. A request that
        /// runs longer than its lease loses the slot then. The in-process store has no
        /// such holders and ignores it.
        lease: Duration,
    },
}
