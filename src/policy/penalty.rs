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
/// ```
/// use std::time::Duration;
/// use tollgate::policy::Penalty;
/// use tollgate::{Policy, Rate};
///
/// // 10 denials within a minute: blocked 5 minutes, then 10, 20, at most an hour.
/// let login = Policy::token_bucket("login", 5, Rate::per_minute(5))?.with_penalty(
///     Penalty::new(10, Duration::from_secs(60), Duration::from_secs(300))
///         .doubling_up_to(Duration::from_secs(3600)),
/// )?;
/// assert!(login.penalty().is_some());
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
    /// [`Policy::with_penalty`](super::Policy::with_penalty).
    pub fn new(denials: u64, within: Duration, block: Duration) -> Self {
        Self {
            denials,
            within,
            block,
            max_block: None,
        }
    }

    /// Doubles the block on each repeat, up to `max_block`.
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
