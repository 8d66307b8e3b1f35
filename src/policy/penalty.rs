//! Penalties: block a key that keeps being denied.

use std::time::Duration;

/// After `denials` denials within `within`, a key is blocked for `block`: its requests
/// are answered from the block (429, `Retry-After` the time left) without touching its
/// other state. With [`doubling_up_to`](Self::doubling_up_to) each repeat doubles the
/// block up to a cap; the count of repeats is forgotten once the key has stayed out of
/// trouble for one longest block. rate-limiter-flexible's `blockDuration`, rack-attack's
/// Allow2Ban.
///
/// The denials are counted in a fixed window of `within` that starts at the first denial
/// after the last window ended (as rate-limiter-flexible and Allow2Ban count them), not
/// a sliding one: across a window's end, up to `2 × denials − 2` denials can come within
/// `within` without a block. Where that matters, count over a shorter `within` with
/// fewer denials.
///
/// Below, a login allows one attempt a minute; the third denial within a minute blocks
/// the key for 5 minutes, the next block is 10 minutes, then 20, 40, and an hour at most:
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::policy::Penalty;
/// use tollgate::{MemoryStore, Policy, PolicySet};
///
/// let minute = Duration::from_secs(60);
/// let clock = ManualClock::new();
/// let store = MemoryStore::builder().clock(clock.clone()).build();
/// let login = Policy::fixed_window("login", 1, minute)?
///     .with_penalty(Penalty::new(3, minute, 5 * minute).doubling_up_to(60 * minute))?;
/// let login = PolicySet::from(login);
///
/// for block in [5, 10, 20, 40, 60, 60] {
///     assert!(store.check("alice", &login, 1).is_allowed());
///     // Two denials by the window, the third starts the block.
///     for _ in 0..2 {
///         let denied = store.check("alice", &login, 1);
///         assert!(!denied.is_blocked());
///         assert_eq!(denied.retry_after(), Some(minute));
///     }
///     let blocked = store.check("alice", &login, 1);
///     assert!(blocked.is_blocked());
///     assert_eq!(blocked.retry_after(), Some(block * minute));
///     // Still blocked a second before it ends.
///     clock.advance(block * minute - Duration::from_secs(1));
///     let still = store.check("alice", &login, 1);
///     assert_eq!(still.retry_after(), Some(Duration::from_secs(1)));
///     clock.advance(Duration::from_secs(1));
/// }
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Penalty {
    pub(super) denials: u64,
    pub(super) within: Duration,
    pub(super) block: Duration,
    pub(super) max_block: Option<Duration>,
}

impl Penalty {
    /// Blocks for `block` after `denials` denials within `within`. Checked when given to
    /// [`Policy::with_penalty`](super::Policy::with_penalty). Without
    /// [`doubling_up_to`](Self::doubling_up_to), every block is `block` long.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::policy::Penalty;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let penalty = Penalty::new(2, Duration::from_secs(10), Duration::from_secs(60));
    /// assert_eq!(penalty.denials(), 2);
    /// assert_eq!(penalty.within(), Duration::from_secs(10));
    /// assert_eq!(penalty.block(), Duration::from_secs(60));
    /// assert_eq!(penalty.max_block(), Duration::from_secs(60));
    ///
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// let api = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_second(1))?.with_penalty(penalty)?);
    /// for _ in 0..3 {
    ///     assert!(store.check("k", &api, 1).is_allowed());
    ///     assert!(!store.check("k", &api, 1).is_blocked()); // the first denial
    ///     let blocked = store.check("k", &api, 1); // the second: a block
    ///     assert_eq!(blocked.retry_after(), Some(Duration::from_secs(60))); // each time
    ///     clock.advance(Duration::from_secs(60));
    /// }
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn new(denials: u64, within: Duration, block: Duration) -> Self {
        Self {
            denials,
            within,
            block,
            max_block: None,
        }
    }

    /// Doubles the block on each repeat, up to `max_block`. A key that stays out of
    /// trouble for `max_block` after a block ends starts again from the first block.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::policy::Penalty;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let minute = Duration::from_secs(60);
    /// let penalty = Penalty::new(2, minute, 5 * minute).doubling_up_to(15 * minute);
    /// assert_eq!(penalty.block(), 5 * minute);
    /// assert_eq!(penalty.max_block(), 15 * minute);
    ///
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// let api = PolicySet::from(Policy::fixed_window("api", 1, minute)?.with_penalty(penalty)?);
    /// // Spends the minute's request, is denied, then blocked: for how long?
    /// let block = || {
    ///     store.check("k", &api, 1);
    ///     store.check("k", &api, 1);
    ///     let blocked = store.check("k", &api, 1);
    ///     assert!(blocked.is_blocked());
    ///     let wait = blocked.retry_after().unwrap();
    ///     clock.advance(wait);
    ///     wait
    /// };
    /// assert_eq!(block(), 5 * minute);
    /// assert_eq!(block(), 10 * minute);
    /// assert_eq!(block(), 15 * minute); // capped
    /// assert_eq!(block(), 15 * minute);
    /// // Out of trouble for 15 minutes: forgiven.
    /// clock.advance(15 * minute);
    /// assert_eq!(block(), 5 * minute);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn doubling_up_to(mut self, max_block: Duration) -> Self {
        self.max_block = Some(max_block);
        self
    }

    /// Denials that start a block.
    pub fn denials(&self) -> u64 {
        self.denials
    }

    /// The window the denials are counted in.
    pub fn within(&self) -> Duration {
        self.within
    }

    /// The first block.
    pub fn block(&self) -> Duration {
        self.block
    }

    /// The longest block (the first one, without doubling).
    pub fn max_block(&self) -> Duration {
        self.max_block.unwrap_or(self.block)
    }
}
