//! The algorithm of a policy and its parameters, as the user gave them.

use std::time::Duration;

use super::Rate;

/// How a leaky bucket treats a request that arrives while the bucket is busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeakMode {
    /// Drop (deny) what does not fit in the bucket: a meter, the twin of a token bucket.
    Police,
    /// Delay each request until the requests ahead of it have leaked out, so the service
    /// behind sees a steady rate; a request that would wait longer than `max_delay` is denied.
    Shape {
        /// The longest a request may be held back.
        max_delay: Duration,
    },
}

/// The algorithm of a policy and its parameters, as the user gave them.
///
/// Build policies with the [`Policy`](super::Policy) constructors; this type is what
/// [`Policy::algorithm`](super::Policy::algorithm) reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// A bucket that leaks at `leak`; see [`LeakMode`].
    LeakyBucket {
        /// How much the bucket holds (police mode); derived from the delay bound when shaping.
        capacity: u64,
        /// The leak (output) rate.
        leak: Rate,
        /// Drop or delay.
        mode: LeakMode,
    },
    /// Generic cell rate algorithm: one timestamp per key, the token bucket in one number.
    Gcra {
        /// The sustained rate.
        rate: Rate,
        /// How many units may arrive back to back.
        burst: u64,
    },
}
