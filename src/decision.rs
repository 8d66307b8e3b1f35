//! What a store answers: admitted or not, and what every policy looks like afterwards.

use std::time::Duration;

use smallvec::SmallVec;

/// What happened to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every policy admitted it and it was debited. `delay` is non-zero only under a
    /// shaping leaky bucket: the request must be held back that long before it is served.
    Allowed {
        /// How long to hold the request back.
        delay: Duration,
    },
    /// At least one policy denied it; nothing was debited.
    Denied {
        /// Index, in the policy set, of the policy that keeps the client waiting longest.
        policy: usize,
        /// How long until the same request would be admitted, if nothing else is spent.
        retry_after: Duration,
    },
    /// The request costs more than a policy can ever admit: waiting will not help.
    /// Nothing was debited.
    ///
    /// ```
    /// use tollgate::{MemoryStore, Outcome, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let policies = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(1))?);
    /// let decision = store.check("user-7", &policies, 11);
    /// let never = Outcome::CostExceedsLimit { policy: 0, cost: 11, limit: 10 };
    /// assert_eq!(decision.outcome(), never);
    /// assert_eq!(decision.retry_after(), None);
    /// // The bucket is still full: a request that fits is admitted.
    /// assert!(store.check("user-7", &policies, 10).is_allowed());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    CostExceedsLimit {
        /// Index of the policy.
        policy: usize,
        /// The request's cost.
        cost: u64,
        /// The most that policy admits at once.
        limit: u64,
    },
}

/// One policy as the client sees it after the decision. Build one with
/// [`PolicyStatus::new`] (a custom store does, for [`Decision::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PolicyStatus {
    /// The quota: the most units admitted at once.
    pub limit: u64,
    /// Units left now.
    pub remaining: u64,
    /// Time until the quota is whole again (or the window resets): the draft-6
    /// `RateLimit-Reset`.
    pub reset: Duration,
    /// The draft-11 *effective window* (`t`): the time within which the client can use no
    /// more than `remaining` units. For a bucket or GCRA the time until the next unit
    /// arrives, for a fixed window its end, for a sliding log the moment the oldest
    /// counted entry leaves, for the sliding counter the moment its estimate admits one
    /// more unit.
    pub effective_window: Duration,
}

impl PolicyStatus {
    /// A policy's status: its quota, the units left, the time until the quota is whole
    /// again, and the draft-11 effective window.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Decision, Outcome, PolicyStatus};
    ///
    /// let status = PolicyStatus::new(10, 9, Duration::from_millis(200), Duration::ZERO);
    /// let decision = Decision::new(Outcome::Allowed { delay: Duration::ZERO }, [status]);
    /// assert_eq!(decision.statuses()[0].remaining, 9);
    /// ```
    pub const fn new(
        limit: u64,
        remaining: u64,
        reset: Duration,
        effective_window: Duration,
    ) -> Self {
        Self {
            limit,
            remaining,
            reset,
            effective_window,
        }
    }
}

/// A store's answer to one request under a set of policies.
///
/// ```
/// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
///
/// let store = MemoryStore::new();
/// let policies = PolicySet::from(Policy::gcra("api", Rate::per_second(1), 2)?);
/// assert!(store.check("user-7", &policies, 1).is_allowed());
/// let second = store.check("user-7", &policies, 1);
/// assert!(second.is_allowed());
/// assert_eq!(second.statuses()[0].remaining, 0);
/// let third = store.check("user-7", &policies, 1);
/// assert!(!third.is_allowed());
/// assert!(third.retry_after().is_some());
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    outcome: Outcome,
    statuses: SmallVec<[PolicyStatus; 2]>,
    cached: bool,
    /// A penalty's block denied the request: how long the block goes on, in
    /// nanoseconds (0: no block).
    block: u64,
    receipt: Receipt,
    /// Bit `i`: the shadow policy at index `i` would have denied (and was not debited).
    shadow_denied: u64,
    /// What the debit left of each policy in the state it was made from, where that is
    /// not what the client is told: a lease's decision tells the shared state as its take
    /// left it and what leases still hold here, its debit left the first alone. Empty:
    /// the statuses' `remaining`.
    debit_left: SmallVec<[u64; 2]>,
}

/// What a store notes about an admitted request's debit, so that it can be adjusted once
/// the response is known ([`Store::adjust`](crate::Store::adjust)): when it was
/// made, on the store's own time line, and the lease of the in-flight slots it took.
///
/// ```
/// use tollgate::Receipt;
///
/// let receipt = Receipt::new(1_700_000_000_000_000_000, 42);
/// assert_eq!(receipt.at(), 1_700_000_000_000_000_000);
/// assert_eq!(receipt.lease(), 42);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Receipt {
    at: u64,
    lease: u64,
    undebited: u64,
}

impl Receipt {
    /// A debit made at `at` (nanoseconds on the store's time line) that took the
    /// in-flight slots named `lease` (0: none, or a store that needs no name).
    ///
    /// `at` is the time the store recorded the debit, as its decision's own receipt says:
    /// a refund is bounded by it, and `MemoryStore` frees no in-flight slot for a debit
    /// older than the state it reaches (one taken on a state since forgotten). A wrapper
    /// store passes its inner store's receipt on. An `at` of 0 dates the debit at the
    /// epoch: a rate policy's refund finds nothing of it left to give back (only an
    /// in-flight slot is freed whatever the time), so a wrapper that makes its own
    /// decisions (a [`Decision::new`](crate::Decision::new) has this default receipt)
    /// gets no refund from its settles.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Receipt};
    ///
    /// let clock = ManualClock::new();
    /// clock.advance(Duration::from_secs(3600)); // an hour past the epoch
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// let policies = PolicySet::from(Policy::fixed_window("api", 100, Duration::from_secs(60))?);
    /// let receipt = store.check("k", &policies, 40).receipt();
    /// // Dated at the epoch: nothing given back.
    /// let settled = store.adjust_now("k", &policies, &Adjustment::settle(40, 10, Receipt::new(0, 0)));
    /// assert_eq!(settled.statuses()[0].remaining, 60);
    /// // The store's own receipt: 30 given back.
    /// let settled = store.adjust_now("k", &policies, &Adjustment::settle(40, 10, receipt));
    /// assert_eq!(settled.statuses()[0].remaining, 90);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub const fn new(at: u64, lease: u64) -> Self {
        Self {
            at,
            lease,
            undebited: 0,
        }
    }

    /// This receipt, noting that the policies whose bits are set in `mask` (bit `i`:
    /// the policy at index `i`) were not debited: shadow policies that would have denied,
    /// or every policy of a refusal.
    ///
    /// A store's adjustment leaves those policies alone. Here a settle of a request of 5
    /// to nothing, with a receipt that says the second policy was not debited, gives the
    /// 5 back to the first policy only:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet};
    ///
    /// let store = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let hour = Duration::from_secs(3600);
    /// let policies = PolicySet::new([
    ///     Policy::fixed_window("hourly", 10, hour)?,
    ///     Policy::fixed_window("daily", 100, 24 * hour)?,
    /// ])?;
    /// let decision = store.check("team-a", &policies, 5);
    /// let receipt = decision.receipt().with_undebited(0b10); // bit 1: "daily"
    /// let settled = store.adjust_now("team-a", &policies, &Adjustment::settle(5, 0, receipt));
    /// assert_eq!(settled.statuses()[0].remaining, 10); // given back
    /// assert_eq!(settled.statuses()[1].remaining, 95); // left alone
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub const fn with_undebited(mut self, mask: u64) -> Self {
        self.undebited = mask;
        self
    }

    /// The policies not debited, as a bit mask by index. Every bit set (`u64::MAX`): a
    /// refusal, which debited no policy, past the 64th too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let store = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let hour = Duration::from_secs(3600);
    /// let policies = PolicySet::new([
    ///     Policy::fixed_window("api", 2, hour)?,
    ///     Policy::fixed_window("api-next", 1, hour)?.shadow(), // a limit to come
    /// ])?;
    /// // Both debited.
    /// assert_eq!(store.check("k", &policies, 1).receipt().undebited(), 0);
    /// // The shadow policy would have denied: it was not debited.
    /// assert_eq!(store.check("k", &policies, 1).receipt().undebited(), 0b10);
    /// // A refusal debited nothing.
    /// assert_eq!(store.check("k", &policies, 1).receipt().undebited(), u64::MAX);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub const fn undebited(&self) -> u64 {
        self.undebited
    }

    /// True for a refusal's receipt: no policy was debited.
    pub(crate) const fn is_refusal(&self) -> bool {
        self.undebited == u64::MAX
    }

    /// Whether the policy at `index` was debited (past the mask's 64 bits, always, but
    /// for a refusal).
    pub(crate) const fn debited(&self, index: usize) -> bool {
        !self.is_refusal() && (index >= 64 || self.undebited & (1 << index) == 0)
    }

    /// When the debit was made, in nanoseconds on the store's time line.
    pub const fn at(&self) -> u64 {
        self.at
    }

    /// The name of the in-flight slots the request took.
    pub const fn lease(&self) -> u64 {
        self.lease
    }
}

/// The undebited mask a decision's receipt carries for its outcome: every policy of a
/// refusal (it debited nothing, past the 64th too), none of an admission.
const fn refused(outcome: Outcome) -> u64 {
    match outcome {
        Outcome::Allowed { .. } => 0,
        _ => u64::MAX,
    }
}

impl Decision {
    /// A decision with one status per policy, in the policy set's order.
    #[inline]
    pub fn new(outcome: Outcome, statuses: impl IntoIterator<Item = PolicyStatus>) -> Self {
        Self::with_statuses(outcome, statuses.into_iter().collect())
    }

    /// The stores' own path: the statuses already gathered inline. A refusal debited
    /// nothing, and its receipt says so of every policy: an adjustment of it (a release
    /// by a caller that releases whatever it got) changes nothing, in any store.
    #[inline]
    pub(crate) fn with_statuses(outcome: Outcome, statuses: SmallVec<[PolicyStatus; 2]>) -> Self {
        Self {
            outcome,
            statuses,
            cached: false,
            block: 0,
            receipt: Receipt::default().with_undebited(refused(outcome)),
            shadow_denied: 0,
            debit_left: SmallVec::new(),
        }
    }

    /// This decision, noting that the shadow policies at `indices` would have denied
    /// (a custom store that supports [`Policy::shadow`](crate::Policy::shadow)). Indices
    /// past 63 are ignored. They are marked as not debited in the decision's receipt,
    /// before or after [`with_receipt`](Self::with_receipt) sets it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Decision, Outcome, PolicyStatus};
    ///
    /// let status = PolicyStatus::new(10, 4, Duration::from_secs(6), Duration::ZERO);
    /// let allowed = Outcome::Allowed { delay: Duration::ZERO };
    /// let decision = Decision::new(allowed, [status, status]).with_shadow_denied([1, 64]);
    /// assert!(decision.is_allowed()); // a shadow policy denies nothing
    /// assert_eq!(decision.shadow_denied().collect::<Vec<_>>(), [1]);
    /// ```
    pub fn with_shadow_denied(mut self, indices: impl IntoIterator<Item = usize>) -> Self {
        for index in indices {
            if index < 64 {
                self.shadow_denied |= 1 << index;
            }
        }
        // Not debited, whatever the receipt already set says.
        self.receipt = self
            .receipt
            .with_undebited(self.receipt.undebited() | self.shadow_denied);
        self
    }

    /// The indices, in the policy set, of the shadow policies that would have denied this
    /// request (they did not deny it, and were not debited).
    pub fn shadow_denied(&self) -> impl Iterator<Item = usize> + '_ {
        (0..64).filter(|index| self.shadow_denied & (1 << index) != 0)
    }

    /// True when the shadow policy at `index` would have denied.
    #[inline]
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn is_shadow_denied(&self, index: usize) -> bool {
        index < 64 && self.shadow_denied & (1 << index) != 0
    }

    /// This decision, noting what its debit left of each policy in the state it was made
    /// from, where the statuses tell the client more (see `debit_left`).
    pub(crate) fn with_debit_left(mut self, left: SmallVec<[u64; 2]>) -> Self {
        self.debit_left = left;
        self
    }

    /// What the debit left of each policy, as a settle's refund is bounded by it: the
    /// statuses' `remaining` unless a store said otherwise (`with_debit_left`).
    pub(crate) fn debit_left(&self) -> SmallVec<[u64; 2]> {
        if self.debit_left.is_empty() {
            self.statuses
                .iter()
                .map(|status| status.remaining)
                .collect()
        } else {
            self.debit_left.clone()
        }
    }

    #[inline]
    #[cfg_attr(not(feature = "tracing"), allow(dead_code))]
    pub(crate) fn shadow_mask(&self) -> u64 {
        self.shadow_denied
    }

    /// An in-process store's decision: its statuses, the receipt of a debit at `at`, and
    /// the shadow policies (by bit) that would have denied. A refusal debited nothing: its
    /// receipt says so of every policy, so that an adjustment of it (a release by a
    /// caller that releases whatever it got) changes nothing, as on Redis.
    #[inline]
    pub(crate) fn decided(
        outcome: Outcome,
        statuses: SmallVec<[PolicyStatus; 2]>,
        at: u64,
        shadow_denied: u64,
    ) -> Self {
        Self {
            outcome,
            statuses,
            cached: false,
            block: 0,
            receipt: Receipt::new(at, 0).with_undebited(shadow_denied | refused(outcome)),
            shadow_denied,
            debit_left: SmallVec::new(),
        }
    }

    /// This decision with the store's note of its debit, for a later
    /// [`Store::adjust`](crate::Store::adjust). The receipt's undebited mask
    /// ([`Receipt::undebited`]) gains the shadow policies that would have denied, and
    /// every policy of a refusal.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Decision, Outcome, PolicyStatus, Receipt};
    ///
    /// let status = PolicyStatus::new(10, 4, Duration::from_secs(6), Duration::ZERO);
    /// let allowed = Outcome::Allowed { delay: Duration::ZERO };
    /// let decision = Decision::new(allowed, [status, status])
    ///     .with_shadow_denied([1])
    ///     .with_receipt(Receipt::new(1_700_000_000_000_000_000, 7));
    /// assert_eq!(decision.receipt().at(), 1_700_000_000_000_000_000);
    /// assert_eq!(decision.receipt().lease(), 7);
    /// assert_eq!(decision.receipt().undebited(), 0b10);
    ///
    /// let denied = Outcome::Denied { policy: 0, retry_after: Duration::from_secs(6) };
    /// let refusal = Decision::new(denied, [status]).with_receipt(Receipt::new(1, 0));
    /// assert_eq!(refusal.receipt().undebited(), u64::MAX);
    /// ```
    pub fn with_receipt(mut self, receipt: Receipt) -> Self {
        // A refusal debited nothing, whatever the receipt says.
        let undebited = receipt.undebited() | self.shadow_denied | refused(self.outcome);
        self.receipt = receipt.with_undebited(undebited);
        self
    }

    /// The store's note of the debit (all zero when the store keeps none).
    #[inline]
    pub fn receipt(&self) -> Receipt {
        self.receipt
    }

    /// This decision, marked as answered from a local cache rather than by the store
    /// itself (the store's `DenyCache`, or a lease of `Leased`). A cached answer never
    /// counts as the store being healthy: it does not close a circuit breaker.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Decision, Outcome};
    ///
    /// let denied = Outcome::Denied { policy: 0, retry_after: Duration::from_secs(3) };
    /// let decision = Decision::new(denied, []);
    /// assert!(!decision.is_cached());
    /// let cached = decision.from_cache();
    /// assert!(cached.is_cached());
    /// assert_eq!(cached.retry_after(), Some(Duration::from_secs(3))); // the same answer
    /// ```
    pub fn from_cache(mut self) -> Self {
        self.cached = true;
        self
    }

    /// True when a cache answered instead of the store. Here a
    /// `store::DenyCache` answers a denial the store gave once:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::store::DenyCache;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new();
    /// let memory = MemoryStore::builder().clock(clock.clone()).build();
    /// let store = DenyCache::with_clock(memory, 1_000, clock);
    /// let policies = PolicySet::from(Policy::fixed_window("api", 1, Duration::from_secs(60))?);
    /// let key = Key::new("user-7");
    /// let admitted = store.decide(&key, &policies, 1).await?;
    /// let denied = store.decide(&key, &policies, 1).await?;
    /// let again = store.decide(&key, &policies, 1).await?;
    /// assert!(!admitted.is_cached() && !denied.is_cached()); // the store's answers
    /// assert!(!again.is_allowed() && again.is_cached());
    /// # Ok(()) }
    /// ```
    #[inline]
    pub fn is_cached(&self) -> bool {
        self.cached
    }

    /// This denial, marked as a penalty's block (a custom store that supports
    /// [`Policy::with_penalty`](crate::Policy::with_penalty)) lasting its `retry_after`:
    /// the client is blocked, and the request was not spent, nor counted towards a block
    /// unless it is the denial that started this one. A cache (the store's `DenyCache`)
    /// may answer the same until the block ends, as it does not answer a denial that
    /// counts.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Decision, Outcome};
    ///
    /// let denied = Outcome::Denied { policy: 0, retry_after: Duration::from_secs(60) };
    /// let decision = Decision::new(denied, []).from_block();
    /// assert!(decision.is_blocked());
    /// ```
    pub fn from_block(self) -> Self {
        let wait = self.retry_after().unwrap_or_default();
        self.with_block(wait)
    }

    /// This denial, marked as a penalty's block that goes on for `left` (a block may end
    /// before the policies' own wait does).
    pub(crate) fn with_block(mut self, left: Duration) -> Self {
        if matches!(self.outcome, Outcome::Denied { .. }) {
            self.block = u64::try_from(left.as_nanos()).unwrap_or(u64::MAX).max(1);
        }
        self
    }

    /// True when a penalty's block denied the request ([`from_block`](Self::from_block)).
    #[inline]
    pub fn is_blocked(&self) -> bool {
        self.block > 0
    }

    /// How long the block that denied the request goes on (zero: no block).
    pub(crate) fn block_left(&self) -> Duration {
        Duration::from_nanos(self.block)
    }

    /// What happened.
    #[inline]
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// True when the request was admitted (possibly with a shaping delay).
    #[inline]
    pub fn is_allowed(&self) -> bool {
        matches!(self.outcome, Outcome::Allowed { .. })
    }

    /// How long a denied request should wait; `None` when admitted or when waiting
    /// cannot help.
    #[inline]
    pub fn retry_after(&self) -> Option<Duration> {
        match self.outcome {
            Outcome::Denied { retry_after, .. } => Some(retry_after),
            _ => None,
        }
    }

    /// One status per policy, in the policy set's order; empty when the answer came from
    /// a cache that cannot know the statuses now (the layer then sends `RateLimit-Policy`
    /// and `Retry-After` but no `RateLimit` field rather than stale numbers).
    #[inline]
    pub fn statuses(&self) -> &[PolicyStatus] {
        &self.statuses
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A shadow policy that would have denied was not debited, so no adjustment may
    /// give back to it: its bit is in the receipt's undebited mask whichever of
    /// `with_shadow_denied` and `with_receipt` a store calls first. Called second,
    /// `with_shadow_denied` left the receipt saying the shadow policy was debited.
    #[test]
    fn a_shadow_denial_is_undebited_in_either_order() {
        let allowed = || {
            Decision::new(
                Outcome::Allowed {
                    delay: Duration::ZERO,
                },
                [],
            )
        };
        let receipt = Receipt::new(5, 0);
        let first = allowed().with_shadow_denied([1]).with_receipt(receipt);
        let second = allowed().with_receipt(receipt).with_shadow_denied([1]);
        assert_eq!(first.receipt().undebited(), 0b10);
        assert_eq!(second.receipt().undebited(), 0b10);
        assert_eq!(second.receipt().at(), 5);
    }
}
