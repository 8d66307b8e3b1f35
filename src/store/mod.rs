//! Stores decide: they keep the state of every identity and apply the algorithms to it.
//!
//! A store knows nothing of HTTP. It gets an identity ([`Key`]), the policies to apply
//! and the request's cost, and answers with a [`Decision`] or a [`StoreError`]. A store
//! error is never a denial: the layer applies its failure mode to it.

mod decide;
mod deny_cache;
#[cfg(test)]
mod held;
mod lease;
mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

pub use deny_cache::DenyCache;
pub use lease::{DEFAULT_MAX_LEASED_IDENTITIES, Leased};
pub use memory::{DEFAULT_MAX_KEYS, MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{
    ADJUST_SCRIPT, DEFAULT_PREFIX, FIXED_WINDOW_SCRIPT, GCRA_SCRIPT, IN_FLIGHT_SCRIPT,
    LEAKY_SHAPE_SCRIPT, MULTI_POLICY_SCRIPT, RedisConfig, RedisKeys, RedisStore,
    SLIDING_LOG_SCRIPT, SLIDING_WINDOW_SCRIPT, TOKEN_BUCKET_SCRIPT, decision_script,
};

use smallvec::SmallVec;

use crate::decision::{Decision, Outcome, Receipt};
use crate::key::Key;
use crate::policy::PolicySet;

/// Keeps rate-limit state and decides requests against it.
///
/// The layer clones its store into every service it builds, so a store used as-is must be
/// `Clone` (the stores here are handles: clones share the same state). A store chosen at
/// run time fits one type as `Arc<dyn Store>`:
///
/// ```
/// use std::sync::Arc;
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Store};
///
/// let store: Arc<dyn Store> = Arc::new(MemoryStore::new()); // or a RedisStore
/// let layer = RateLimitLayer::new(store).policy(Policy::gcra("api", Rate::per_second(5), 5)?);
/// # let _ = layer;
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
/// Implementations must decide each request atomically:
/// two concurrent requests must never both see the same remaining quota.
///
/// ```
/// use tollgate::{Key, MemoryStore, Policy, PolicySet, Rate, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let policies = PolicySet::from(Policy::token_bucket("api", 2, Rate::per_second(1))?);
/// let decision = store.decide(&Key::new("user:7"), &policies, 1).await?;
/// assert!(decision.is_allowed());
/// assert_eq!(decision.statuses()[0].remaining, 1);
/// # Ok(()) }
/// ```
pub trait Store: Send + Sync + 'static {
    /// Decides `cost` units for `key` under every policy of `policies`, all-or-nothing.
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture;

    /// Can this store decide every policy of `policies` exactly? [`RateLimitLayer`]
    /// calls it when it wraps a service, for every set it knows then (a fixed set, a
    /// resolver's `known_sets`), so a policy the store cannot hold fails at start-up with
    /// a message naming it, not as a store error on every request; a set a resolver
    /// builds per request is met then, as an error of kind `Unsupported`. The default
    /// accepts everything (the in-process store decides every valid policy).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Algorithm, DecideFuture, Key, MemoryStore, Policy, PolicySet, Rate};
    /// use tollgate::{Store, StoreError, StoreErrorKind};
    ///
    /// /// A store that keeps no logs: it refuses sliding-log policies.
    /// struct NoLogs(MemoryStore);
    ///
    /// impl Store for NoLogs {
    ///     fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
    ///         self.0.decide(key, policies, cost)
    ///     }
    ///
    ///     fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
    ///         let is_log = |policy: &&Policy| {
    ///             matches!(policy.algorithm(), Algorithm::SlidingLog { .. })
    ///         };
    ///         match policies.iter().find(is_log) {
    ///             Some(log) => Err(StoreError::new(
    ///                 StoreErrorKind::Unsupported,
    ///                 format!("policy {:?}: no sliding logs here", log.name()),
    ///             )),
    ///             None => Ok(()),
    ///         }
    ///     }
    /// }
    ///
    /// let store = NoLogs(MemoryStore::new());
    /// let exact = PolicySet::from(Policy::sliding_log("exact", 10, Duration::from_secs(60))?);
    /// let error = store.validate(&exact).unwrap_err();
    /// assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    /// let api = PolicySet::from(Policy::gcra("api", Rate::per_second(5), 5)?);
    /// assert!(store.validate(&api).is_ok());
    /// assert!(MemoryStore::new().validate(&exact).is_ok()); // the default accepts all
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// [`RateLimitLayer`]: crate::RateLimitLayer
    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        let _ = policies;
        Ok(())
    }

    /// Adjusts an admitted request's debit once its response is known, atomically, and
    /// answers every policy's status afterwards (the outcome is `Allowed`):
    ///
    /// - settles the rate policies from `reserved` to `actual` units: the difference is
    ///   given back (as far as the state still holds it: a window that has ended is not
    ///   reopened, a bucket is never filled above full) or charged, past empty if need
    ///   be (the excess is owed until a bucket refills it or a window forgets it; one
    ///   settle owes at most one whole quota past what is left, and an identity at most
    ///   a thousand quotas);
    /// - with [`Adjustment::release`], frees the request's in-flight slots instead.
    ///
    /// A settle, a release or an unbooking leaves alone every policy the receipt says was
    /// not debited ([`Receipt::undebited`](crate::Receipt::undebited): a shadow policy that
    /// would have denied, every policy of a refusal, the policies a reset cleared under a
    /// [`Leased`] rest), whatever the reason.
    ///
    /// The default refuses with [`StoreErrorKind::Unsupported`]; a store that implements
    /// it says so with [`can_adjust`](Self::can_adjust).
    ///
    /// ```
    /// use tollgate::{Adjustment, Key, MemoryStore, Policy, PolicySet, Rate, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let tokens = PolicySet::from(Policy::token_bucket("tokens", 1000, Rate::per_hour(1000))?);
    /// let key = Key::new("team-a");
    /// // Reserve 500, then settle to the 120 the response actually used.
    /// let reserved = store.decide(&key, &tokens, 500).await?;
    /// assert_eq!(reserved.statuses()[0].remaining, 500);
    /// let settled = store
    ///     .adjust(&key, &tokens, &Adjustment::settle(500, 120, reserved.receipt()))
    ///     .await?;
    /// assert_eq!(settled.statuses()[0].remaining, 880);
    /// # Ok(()) }
    /// ```
    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        let _ = (key, policies, adjustment);
        DecideFuture::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot settle costs or free in-flight slots",
        )))
    }

    /// Whether this store implements [`adjust`](Self::adjust). A layer that settles
    /// costs ([`RateLimitLayer::settle`](crate::RateLimitLayer::settle)) or has an
    /// in-flight limit needs it, and is refused when it is built over a store that says
    /// no: its slots would never be freed and its costs never settled. The default is
    /// `false`; a store that implements `adjust` returns `true`, and a wrapper forwards
    /// its inner store's answer (as `Arc`, `Box` and the crate's wrappers do).
    ///
    /// ```
    /// use tollgate::{DecideFuture, Key, MemoryStore, PolicySet, Store};
    ///
    /// /// Counts decisions; forwards only `decide`.
    /// struct Counted(MemoryStore);
    ///
    /// impl Store for Counted {
    ///     fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
    ///         self.0.decide(key, policies, cost)
    ///     }
    /// }
    ///
    /// assert!(MemoryStore::new().can_adjust());
    /// assert!(!Counted(MemoryStore::new()).can_adjust());
    /// ```
    fn can_adjust(&self) -> bool {
        false
    }

    /// Every policy's state for `key` now, without spending anything: the decision of a
    /// request that costs nothing (its statuses are the point; all read at once, so
    /// several policies are consistent with one another).
    ///
    /// ```
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Rate, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let api = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_hour(10))?);
    /// let key = Key::new("user-7");
    /// store.decide(&key, &api, 3).await?;
    /// assert_eq!(store.peek(&key, &api).await?.statuses()[0].remaining, 7);
    /// assert_eq!(store.peek(&key, &api).await?.statuses()[0].remaining, 7);
    /// # Ok(()) }
    /// ```
    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        self.decide(key, policies, 0)
    }

    /// Forgets `key`'s state under `policies` (a customer upgraded their plan): its next
    /// request starts on fresh state, and a penalty's block is lifted. In-flight slots are
    /// kept: they are freed by the requests that hold them. The default refuses with
    /// [`StoreErrorKind::Unsupported`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let hour = Duration::from_secs(3600);
    /// let hourly = PolicySet::from(Policy::fixed_window("hourly", 2, hour)?);
    /// let key = Key::new("customer-9");
    /// assert!(store.decide(&key, &hourly, 2).await?.is_allowed());
    /// assert!(!store.decide(&key, &hourly, 1).await?.is_allowed());
    /// store.reset(&key, &hourly).await?; // the customer upgraded their plan
    /// assert!(store.decide(&key, &hourly, 1).await?.is_allowed());
    /// # Ok(()) }
    /// ```
    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        let _ = (key, policies);
        Box::pin(std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot reset a key",
        ))))
    }
}

/// A change to a key's state, made atomically by [`Store::adjust`]: settling or freeing an
/// admitted request's debit once its response is known, or an administrator's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adjustment {
    change: Change,
    receipt: Receipt,
    /// Units each policy had left right after the debit (empty: unknown).
    left: SmallVec<[u64; 2]>,
    /// When each policy's queue ended right after the debit (an unbooking's; else empty).
    ends: SmallVec<[u64; 2]>,
}

/// What an [`Adjustment`] changes. Every change leaves a quota at most full; only a
/// settle's charge may take it past empty.
///
/// A shaping policy's units are places in its schedule: units given back to one
/// (a settle below the reservation, a grant, a level set higher) let the next requests
/// be scheduled on the instants of those already waiting, two leaving at once. The layer
/// and the `Limiter` (module `limiter`) never give a shaping policy back its units but
/// through [`Unbook`](Change::Unbook); an adjustment sent to the store directly does
/// what it says, on shaping policies too.
///
/// A sliding window counter cut in several sub-windows gives back from its oldest
/// sub-window (which counts in part) no more than would let more through later in that
/// sub-window than the change says: a grant or a level set there may give back less at
/// once than asked, never more later.
///
/// Each change on a bucket of 100 (refilled an hour, on a clock that stands still), and
/// a release on an in-flight limit of 1:
///
/// ```
/// use tollgate::clock::ManualClock;
/// use tollgate::{Adjustment, Change, MemoryStore, Policy, PolicySet, Rate};
///
/// let store = MemoryStore::builder().clock(ManualClock::new()).build();
/// let tokens = PolicySet::from(Policy::token_bucket("tokens", 100, Rate::per_hour(100))?);
/// let left = |adjustment: Adjustment| store.adjust_now("k", &tokens, &adjustment).statuses()[0].remaining;
///
/// // Reserved 40, used 10: 30 come back.
/// let reserved = store.check("k", &tokens, 40);
/// let settle = Adjustment::settle(40, 10, reserved.receipt());
/// assert_eq!(settle.change(), Change::Settle { reserved: 40, actual: 10 });
/// assert_eq!(left(settle), 90);
///
/// // 80 left; reserved 10, used 150: charged 140, past empty; 60 are owed.
/// let reserved = store.check("k", &tokens, 10);
/// assert_eq!(left(Adjustment::settle(10, 150, reserved.receipt())), 0);
/// // A grant pays what is owed first.
/// assert_eq!(Adjustment::grant(70).change(), Change::Grant { units: 70 });
/// assert_eq!(left(Adjustment::grant(70)), 10);
///
/// // A level set outright, at most the quota.
/// assert_eq!(Adjustment::set_remaining(25).change(), Change::SetRemaining { remaining: 25 });
/// assert_eq!(left(Adjustment::set_remaining(25)), 25);
/// assert_eq!(left(Adjustment::set_remaining(1_000)), 100);
///
/// // A release frees an in-flight slot, and leaves rate policies alone.
/// let inflight = PolicySet::from(Policy::concurrency("inflight", 1)?);
/// let running = store.check("k", &inflight, 1);
/// assert!(!store.check("k", &inflight, 1).is_allowed());
/// let release = Adjustment::release(1, running.receipt());
/// assert_eq!(release.change(), Change::Release { cost: 1 });
/// store.adjust_now("k", &inflight, &release);
/// assert!(store.check("k", &inflight, 1).is_allowed());
///
/// // An unbooking names its cost (see `Adjustment::unbook`).
/// assert_eq!(Adjustment::unbook(3, &running).change(), Change::Unbook { cost: 3 });
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change {
    /// A request that reserved `reserved` units used `actual`: the rate policies give back
    /// the difference, or charge it, past empty if need be (at most one whole quota past
    /// what is left; settles add up, to a thousand quotas owed).
    Settle {
        /// Units debited on admission.
        reserved: u64,
        /// Units used.
        actual: u64,
    },
    /// A request of `cost` ended: its in-flight slots are freed (it took one per in-flight
    /// policy when `cost` was not 0). Rate policies are left as they are.
    Release {
        /// The request's cost.
        cost: u64,
    },
    /// Gives the key `units` back under every rate policy, newest debits first, up to a
    /// full quota (what a settle left owing is paid first).
    Grant {
        /// Units to give back.
        units: u64,
    },
    /// Sets every rate policy of the key to `remaining` units left now (at most its
    /// quota), giving back or charging the difference; what a settle left owing is
    /// forgiven.
    SetRemaining {
        /// Units left after the change.
        remaining: u64,
    },
    /// A request a shaping policy held back, dropped before it was sent (its client gave
    /// up): when every shaping policy's queue still ends where the request's debit left
    /// it ([`Adjustment::queue_ends`]: nothing queued behind it since), its `cost` units
    /// are given back under every rate policy, as a settle to nothing would; otherwise
    /// nothing changes, since giving them back would put the next request on the instant
    /// of the one queued behind it. A queue that has drained (a faster policy's, beside a
    /// slower one's still waiting) is passed over; when all have drained, the booking's
    /// time has passed and nothing changes. The decision is allowed when they were given
    /// back, and denied (by the first shaping policy whose queue moved on, or the first
    /// drained one, with no wait) when not.
    Unbook {
        /// The request's cost.
        cost: u64,
    },
}

impl Adjustment {
    /// Gives back all `cost` units `decision` spent: a settle to nothing, with what its
    /// debit left (so a bucket gets back all it still holds of them). The pacer's, whose
    /// turns' lock makes the decision its key's newest booking.
    #[cfg(feature = "client")]
    pub(crate) fn give_back(cost: u64, decision: &Decision) -> Self {
        Self::settle(cost, 0, decision.receipt())
            .with_left(decision.statuses().iter().map(|status| status.remaining))
    }

    /// Gives back the `cost` units of a request that `decision` held back (shaping) and
    /// whose client gave up before it was sent, if nothing queued behind it since (see
    /// [`Change::Unbook`]). Each policy's queue ended `reset` after the debit.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let paced = PolicySet::from(Policy::leaky_bucket_shaping(
    ///     "paced", Rate::per_minute(1), Duration::from_secs(300))?);
    /// store.check("partner", &paced, 1);
    /// let second = store.check("partner", &paced, 1);
    /// let third = store.check("partner", &paced, 1);
    /// // The second is not the newest: the third stands behind it.
    /// assert!(!store.adjust_now("partner", &paced, &Adjustment::unbook(1, &second)).is_allowed());
    /// // The third is, then the second is.
    /// assert!(store.adjust_now("partner", &paced, &Adjustment::unbook(1, &third)).is_allowed());
    /// assert!(store.adjust_now("partner", &paced, &Adjustment::unbook(1, &second)).is_allowed());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn unbook(cost: u64, decision: &Decision) -> Self {
        Self::unbooking(
            cost,
            decision.receipt(),
            decision.statuses().iter().map(|status| status.remaining),
            Self::queue_ends_after(decision),
        )
    }

    /// An unbooking of `cost` units from what its debit left: its receipt, the units left
    /// and the queue ends of each policy.
    pub(crate) fn unbooking(
        cost: u64,
        receipt: Receipt,
        left: impl IntoIterator<Item = u64>,
        ends: impl IntoIterator<Item = u64>,
    ) -> Self {
        Self {
            change: Change::Unbook { cost },
            receipt,
            left: left.into_iter().collect(),
            ends: ends.into_iter().collect(),
        }
    }

    /// When each policy's queue ends after `decision`'s debit: the debit's time plus the
    /// policy's reset (a shaping bucket's reset is when what is queued has leaked out).
    pub(crate) fn queue_ends_after(decision: &Decision) -> impl Iterator<Item = u64> + '_ {
        let at = decision.receipt().at();
        decision.statuses().iter().map(move |status| {
            let reset = u64::try_from(status.reset.as_nanos()).unwrap_or(u64::MAX);
            at.saturating_add(reset)
        })
    }

    /// Settles a request that reserved `reserved` units to the `actual` units it used;
    /// `receipt` is the one its decision carried.
    pub fn settle(reserved: u64, actual: u64, receipt: Receipt) -> Self {
        Self {
            change: Change::Settle { reserved, actual },
            receipt,
            left: SmallVec::new(),
            ends: SmallVec::new(),
        }
    }

    /// A settle to nothing of `cost` units debited under `receipt` (`left`: what the
    /// debit left of each policy) that leaves the shaping policies alone (their places
    /// stay taken): the units of a request never sent, given back under the other rate
    /// policies. `None` when there are none to give back (none but shaping and in-flight
    /// policies, or none debited), when a shaping policy sits past the 64 a receipt marks,
    /// or when the marks would all be set (read as a refusal): nothing then, rather than a
    /// place given back.
    pub(crate) fn places_kept(
        cost: u64,
        receipt: Receipt,
        left: impl IntoIterator<Item = u64>,
        policies: &PolicySet,
    ) -> Option<Self> {
        let kept = policies.shaping_marks()?;
        let undebited = receipt.undebited() | kept;
        // Every mark set reads as a refusal (nothing debited): nothing to give back then.
        if undebited == u64::MAX {
            return None;
        }
        let receipt = receipt.with_undebited(undebited);
        let any = policies.iter().enumerate().any(|(index, policy)| {
            let params = policy.params();
            !params.is_shaping() && !params.is_in_flight() && receipt.debited(index)
        });
        any.then(|| Self::settle(cost, 0, receipt).with_left(left))
    }

    /// Frees the in-flight slots of a request of `cost`; `receipt` is the one its decision
    /// carried (on Redis it names the slots).
    pub fn release(cost: u64, receipt: Receipt) -> Self {
        Self {
            change: Change::Release { cost },
            receipt,
            left: SmallVec::new(),
            ends: SmallVec::new(),
        }
    }

    /// Gives a key `units` more under each rate policy, newest debits first and never
    /// above a full quota (a customer upgraded their plan; an operator forgives).
    ///
    /// ```
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let api = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_hour(10))?);
    /// store.check("user-7", &api, 10);
    /// let after = store.adjust_now("user-7", &api, &Adjustment::grant(4));
    /// assert_eq!(after.statuses()[0].remaining, 4);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn grant(units: u64) -> Self {
        Self {
            change: Change::Grant { units },
            receipt: Receipt::new(0, 0),
            left: SmallVec::new(),
            ends: SmallVec::new(),
        }
    }

    /// Sets each rate policy of a key to `remaining` units left now (at most its quota),
    /// whatever it had: a level above it is charged down, one below given back, and what
    /// a settle left owing is forgiven.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let api = PolicySet::new([
    ///     Policy::token_bucket("burst", 10, Rate::per_minute(10))?,
    ///     Policy::fixed_window("daily", 1_000, Duration::from_secs(86_400))?,
    /// ])?;
    /// store.check("user-7", &api, 4); // 6 and 996 left
    /// let set = store.adjust_now("user-7", &api, &Adjustment::set_remaining(8));
    /// let left: Vec<u64> = set.statuses().iter().map(|status| status.remaining).collect();
    /// assert_eq!(left, [8, 8]); // given back under one, charged under the other
    /// let full = store.adjust_now("user-7", &api, &Adjustment::set_remaining(u64::MAX));
    /// let left: Vec<u64> = full.statuses().iter().map(|status| status.remaining).collect();
    /// assert_eq!(left, [10, 1_000]); // each at most its quota
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn set_remaining(remaining: u64) -> Self {
        Self {
            change: Change::SetRemaining { remaining },
            receipt: Receipt::new(0, 0),
            left: SmallVec::new(),
            ends: SmallVec::new(),
        }
    }

    /// This settlement, knowing what the debit left of each policy (the decision's
    /// `statuses()[i].remaining`, in the set's order). A bucket or GCRA then gives back
    /// what a replay with the actual cost would hold, where without it every unit
    /// refilled since the debit is counted as lost (safe, but short of the actual cost).
    /// `remaining` is whole units: a bucket part-way through refilling a token when it
    /// was debited counts that token as missing, so the settle may give back up to that
    /// fraction of a unit more than an exact replay would.
    ///
    /// ```
    /// use tollgate::{Adjustment, Key, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let set = PolicySet::from(Policy::token_bucket("tokens", 100, Rate::per_minute(100))?);
    /// let reserved = store.check("k", &set, 40);
    /// let left = reserved.statuses().iter().map(|status| status.remaining);
    /// let adjustment = Adjustment::settle(40, 10, reserved.receipt()).with_left(left);
    /// assert_eq!(store.adjust_now("k", &set, &adjustment).statuses()[0].remaining, 90);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn with_left(mut self, left: impl IntoIterator<Item = u64>) -> Self {
        self.left = left.into_iter().collect();
        self
    }

    /// What the debit left of each policy, in the set's order (empty: unknown), as
    /// [`with_left`](Self::with_left) gave it or [`unbook`](Self::unbook) read it off
    /// the decision.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let set = PolicySet::new([
    ///     Policy::token_bucket("tokens", 100, Rate::per_minute(100))?,
    ///     Policy::fixed_window("daily", 5_000, Duration::from_secs(86_400))?,
    /// ])?;
    /// let reserved = store.check("k", &set, 40);
    /// let settle = Adjustment::settle(40, 10, reserved.receipt());
    /// assert!(settle.left_after_debit().is_empty());
    /// let left = reserved.statuses().iter().map(|status| status.remaining);
    /// assert_eq!(settle.with_left(left).left_after_debit(), [60, 4_960]);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn left_after_debit(&self) -> &[u64] {
        &self.left
    }

    /// When each policy's queue ended right after the debit, in nanoseconds on the
    /// store's time line, in the set's order (an unbooking's; empty for other changes).
    /// Only a shaping policy's is read.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let paced = PolicySet::from(Policy::leaky_bucket_shaping(
    ///     "paced", Rate::per_second(1), Duration::from_secs(10))?);
    /// let booked = store.check("partner", &paced, 1);
    /// // One unit queued: the queue ends a second after the debit.
    /// let unbook = Adjustment::unbook(1, &booked);
    /// assert_eq!(unbook.queue_ends(), [booked.receipt().at() + 1_000_000_000]);
    /// assert!(Adjustment::grant(1).queue_ends().is_empty());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn queue_ends(&self) -> &[u64] {
        &self.ends
    }

    /// Whether this change may give units back (and so admit what was denied): a settle
    /// below its reservation, a grant, a set, an unbooking; not a release or a charge.
    pub(crate) fn gives_back(&self) -> bool {
        match self.change {
            Change::Settle { reserved, actual } => actual < reserved,
            Change::Release { .. } => false,
            Change::Grant { .. } | Change::SetRemaining { .. } | Change::Unbook { .. } => true,
        }
    }

    /// What changes.
    pub const fn change(&self) -> Change {
        self.change
    }

    /// The receipt of the decision this adjusts (all zero for a grant or a set).
    pub const fn receipt(&self) -> Receipt {
        self.receipt
    }
}

/// The future of [`Store::reset`].
pub type ResetFuture = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

/// A shared store: `Arc<dyn Store>` picks Redis or memory at run time behind one type,
/// and an `Arc` (or a `Box`) of any store is a store.
macro_rules! forward_store {
    ($($pointer:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $pointer {
            #[inline]
            fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
                (**self).decide(key, policies, cost)
            }

            fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
                (**self).peek(key, policies)
            }

            fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
                (**self).reset(key, policies)
            }

            fn adjust(
                &self,
                key: &Key,
                policies: &PolicySet,
                adjustment: &Adjustment,
            ) -> DecideFuture {
                (**self).adjust(key, policies, adjustment)
            }

            fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
                (**self).validate(policies)
            }

            fn can_adjust(&self) -> bool {
                (**self).can_adjust()
            }
        }
    )*};
}

forward_store!(std::sync::Arc<S>, Box<S>);

/// How long a decision may take before the store counts as failed: the default of
/// [`RateLimitLayer::store_timeout`](crate::RateLimitLayer::store_timeout) and of a
/// `Limiter`'s.
pub const DEFAULT_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(50);

/// `future`, a store call, bounded by `timeout`: past it, a `Timeout` error that says
/// what did not come (`no {what} within ...`).
pub(crate) async fn within<T>(
    timeout: std::time::Duration,
    what: &str,
    future: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, future)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!("no {what} within {timeout:?}"),
            ))
        })
}

/// A store call no request waits for failed (a lease's take or give-back, a dropped
/// decision's release): counted in `tollgate_store_errors_total`, as the layer counts
/// its requests' errors, and logged: at debug level when it is I/O (an outage, which
/// the requests meet and the failure mode's warning says), at error level otherwise (at
/// most once a minute for each `what`: one kind of failure said often hides no other).
/// The stores know no telemetry module (they sit below it): counted and logged here.
pub(crate) fn unmet(error: &StoreError, what: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_store_errors_total", "kind" => error.kind().as_str()).increment(1);
    #[cfg(feature = "tracing")]
    if error.kind().is_io() {
        tracing::debug!(target: "tollgate", %error, "{what}");
    } else if unmet_say_now(what) {
        tracing::error!(
            target: "tollgate",
            %error,
            code = error.code().unwrap_or(""),
            "{what} (this is a bug or a misconfiguration, not an outage; said at most once \
             a minute, counted in tollgate_store_errors_total)"
        );
    } else {
        tracing::debug!(target: "tollgate", %error, "{what}");
    }
    #[cfg(not(feature = "tracing"))]
    let _ = (error, what);
}

/// True at most once a minute for each `what`: a refusal every identity's lease meets
/// (`OOM`, `NOPERM`) is said, not said once per identity and take. (One entry per call
/// site: a handful.)
#[cfg(feature = "tracing")]
fn unmet_say_now(what: &'static str) -> bool {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    static NEXT: std::sync::Mutex<Vec<(&'static str, u64)>> = std::sync::Mutex::new(Vec::new());
    let now = START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs();
    let mut next = NEXT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match next.iter_mut().find(|(said, _)| *said == what) {
        Some((_, due)) if now < *due => false,
        Some((_, due)) => {
            *due = now + 60;
            true
        }
        None => {
            next.push((what, now + 60));
            true
        }
    }
}

/// A store's answer checked against the set of `len` policies it was asked about. An
/// outcome that names a policy the set does not have, or a delay longer than any shaping
/// policy may hold a request ([`MAX_SHAPING_DELAY`](crate::policy::MAX_SHAPING_DELAY)),
/// is a bug in that store (a user's own `Store`): a protocol error, counted and answered
/// by the failure mode, never an index or a deadline that panics the service.
#[inline]
pub(crate) fn check_answer(decision: &Decision, len: usize) -> Result<(), StoreError> {
    match decision.outcome() {
        Outcome::Denied { policy, .. } | Outcome::CostExceedsLimit { policy, .. }
            if policy >= len =>
        {
            Err(misnamed_policy(policy, len))
        }
        Outcome::Allowed { delay } if delay > crate::policy::MAX_SHAPING_DELAY => {
            Err(overlong_delay(delay))
        }
        _ => Ok(()),
    }
}

#[cold]
#[inline(never)]
fn overlong_delay(delay: std::time::Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        format!(
            "the store's answer delays the request {delay:?}, longer than any shaping policy \
             may ({:?})",
            crate::policy::MAX_SHAPING_DELAY
        ),
    )
}

#[cold]
#[inline(never)]
fn misnamed_policy(policy: usize, len: usize) -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        format!("the store's answer names policy {policy} of a set of {len}"),
    )
}

pub(crate) type BoxedDecision = Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>;

/// The future of one decision: already complete for the in-process store (no allocation),
/// boxed for stores that do I/O.
#[must_use = "futures do nothing unless polled"]
pub struct DecideFuture {
    inner: DecideInner,
}

enum DecideInner {
    Ready(Option<Result<Decision, StoreError>>),
    Pending(BoxedDecision),
}

impl DecideFuture {
    /// A decision that is already known.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{DecideFuture, Decision, Key, Outcome, Policy, PolicySet, PolicyStatus};
    /// use tollgate::{Rate, Store};
    ///
    /// /// A test double that admits everything, every policy left whole.
    /// struct Open;
    ///
    /// impl Store for Open {
    ///     fn decide(&self, _key: &Key, policies: &PolicySet, _cost: u64) -> DecideFuture {
    ///         let zero = Duration::ZERO;
    ///         let whole = policies.iter().map(|policy| {
    ///             PolicyStatus::new(policy.limit(), policy.limit(), zero, zero)
    ///         });
    ///         let allowed = Outcome::Allowed { delay: Duration::ZERO };
    ///         DecideFuture::ready(Ok(Decision::new(allowed, whole)))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let api = PolicySet::from(Policy::gcra("api", Rate::per_second(5), 5)?);
    /// let decision = Open.decide(&Key::new("user-7"), &api, 1).await?;
    /// assert!(decision.is_allowed());
    /// assert_eq!(decision.statuses()[0].remaining, 5);
    /// # Ok(()) }
    /// ```
    pub fn ready(result: Result<Decision, StoreError>) -> Self {
        Self {
            inner: DecideInner::Ready(Some(result)),
        }
    }

    /// A decision still to be made by `future`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::time::Duration;
    /// use tollgate::{DecideFuture, Key, MemoryStore, Policy, PolicySet, Rate, Store};
    ///
    /// /// Decides in memory after a round trip to somewhere (here, a short sleep),
    /// /// counting its decisions.
    /// struct Remote {
    ///     inner: MemoryStore,
    ///     decided: Arc<AtomicU64>,
    /// }
    ///
    /// impl Store for Remote {
    ///     fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
    ///         // The future is `'static`: it owns what it uses (all cheap clones).
    ///         let (inner, key, policies) = (self.inner.clone(), key.clone(), policies.clone());
    ///         let decided = Arc::clone(&self.decided);
    ///         DecideFuture::new(async move {
    ///             tokio::time::sleep(Duration::from_millis(1)).await;
    ///             decided.fetch_add(1, Ordering::Relaxed);
    ///             inner.decide(&key, &policies, cost).await
    ///         })
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let decided = Arc::new(AtomicU64::new(0));
    /// let store = Remote { inner: MemoryStore::new(), decided: Arc::clone(&decided) };
    /// let api = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_hour(1))?);
    /// assert!(store.decide(&Key::new("user-7"), &api, 1).await?.is_allowed());
    /// assert!(!store.decide(&Key::new("user-7"), &api, 1).await?.is_allowed());
    /// assert_eq!(decided.load(Ordering::Relaxed), 2);
    /// # Ok(()) }
    /// ```
    pub fn new(
        future: impl Future<Output = Result<Decision, StoreError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: DecideInner::Pending(Box::pin(future)),
        }
    }

    /// The result if it is already known, else the future that will produce it.
    pub(crate) fn into_ready(self) -> Result<Result<Decision, StoreError>, BoxedDecision> {
        match self.inner {
            DecideInner::Ready(Some(result)) => Ok(result),
            _ => Err(self.into_pending()),
        }
    }

    /// The decision, read in place (not moved out); `None` while it is still to be made
    /// (a store doing I/O, or a future already polled out).
    pub(crate) fn result(&self) -> Option<&Result<Decision, StoreError>> {
        match &self.inner {
            DecideInner::Ready(Some(result)) => Some(result),
            DecideInner::Ready(None) | DecideInner::Pending(_) => None,
        }
    }

    /// The future that will produce the decision. A future already polled out answers,
    /// when polled again, with a store error.
    pub(crate) fn into_pending(self) -> BoxedDecision {
        match self.inner {
            DecideInner::Pending(future) => future,
            DecideInner::Ready(result) => {
                Box::pin(std::future::ready(result.unwrap_or_else(|| {
                    Err(StoreError::new(
                        StoreErrorKind::Other,
                        "decision future used after completion",
                    ))
                })))
            }
        }
    }
}

impl fmt::Debug for DecideFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.inner {
            DecideInner::Ready(_) => "ready",
            DecideInner::Pending(_) => "pending",
        };
        f.debug_tuple("DecideFuture").field(&state).finish()
    }
}

impl Future for DecideFuture {
    type Output = Result<Decision, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().inner {
            DecideInner::Ready(result) => Poll::Ready(
                result
                    .take()
                    .expect("DecideFuture polled after it completed"),
            ),
            DecideInner::Pending(future) => future.as_mut().poll(cx),
        }
    }
}

/// What kind of failure a store had.
///
/// Only [`Unavailable`](Self::Unavailable) and [`Timeout`](Self::Timeout) are I/O: the
/// store may answer again by itself. The others mean a bug or a misconfiguration; the
/// layer still applies its failure mode to the request, but logs them at error level
/// (the first time each kind, code and wording is seen, digits aside, and again every ten
/// minutes while it goes on) and counts them, so they are never hidden behind it.
///
/// Of the kinds, `Unavailable` and `Timeout` count toward opening the layer's circuit
/// breaker, and only a decision closes it. Any other kind says nothing of the store and
/// leaves the breaker as it is, unless the error is marked as met by every request
/// ([`StoreError::for_every_request`]: a refused password), which counts as an outage
/// does. A store of your own should therefore report a connection that failed as
/// `Unavailable` or `Timeout`, not as `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The backend could not be reached, or is between primaries: a failover in
    /// progress (Redis `READONLY` from a demoted primary, `MASTERDOWN`, `NOREPLICAS` from a
    /// primary whose replicas are away) or a server still loading or busy (`LOADING`,
    /// `BUSY`).
    Unavailable,
    /// The backend did not answer in time.
    Timeout,
    /// The backend answered something that could not be understood.
    Protocol,
    /// The backend refused the command: no permission (`NOPERM`), a key of the wrong
    /// type (`WRONGTYPE`), a script error, out of memory (`OOM`, a `maxmemory` that
    /// refuses writes).
    Refused,
    /// The store cannot decide this policy exactly (caught by [`Store::validate`] when
    /// the layer is built; seen at request time only with per-request policies).
    Unsupported,
    /// Anything else.
    Other,
}

impl StoreErrorKind {
    /// True for failures of the connection (unreachable, timed out), which pass by
    /// themselves; false for those that mean a bug or a misconfiguration.
    pub fn is_io(self) -> bool {
        matches!(self, StoreErrorKind::Unavailable | StoreErrorKind::Timeout)
    }

    /// A short label: `unavailable`, `timeout`, `protocol`, `refused`, `unsupported`,
    /// `other` (the `kind` label of `tollgate_store_errors_total`).
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::Protocol => "protocol",
            StoreErrorKind::Refused => "refused",
            StoreErrorKind::Unsupported => "unsupported",
            StoreErrorKind::Other => "other",
        }
    }
}

/// A store could not decide. This is not a denial: the layer's failure mode decides what
/// the request gets.
///
/// ```
/// use tollgate::{StoreError, StoreErrorKind};
///
/// let err = StoreError::new(StoreErrorKind::Timeout, "no answer within 50ms");
/// assert_eq!(err.to_string(), "rate-limit store timeout: no answer within 50ms");
/// ```
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    code: Option<Box<str>>,
    pub(crate) message: String,
    source: Option<Box<dyn Error + Send + Sync>>,
    /// A refusal that every request meets, not this one's policies or data (a pool that
    /// cannot authenticate): it opens the breaker as an outage does, so that every
    /// request does not open (and authenticate) a connection of its own.
    pub(crate) every_request: bool,
}

impl StoreError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            code: None,
            message: message.into(),
            source: None,
            every_request: false,
        }
    }

    /// Attaches the backend's own error code (`NOPERM`, `READONLY`, `WRONGTYPE`, `OOM`).
    ///
    /// ```
    /// use tollgate::{StoreError, StoreErrorKind};
    ///
    /// let err = StoreError::new(StoreErrorKind::Refused, "no permission to run the script")
    ///     .with_code("NOPERM");
    /// assert_eq!(err.code(), Some("NOPERM"));
    /// ```
    pub fn with_code(mut self, code: impl Into<Box<str>>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Marks a failure that every request meets, not only this one's policies or data:
    /// credentials refused when a connection opens, a server out of memory that refuses
    /// every write, a primary nobody knows. The layer's circuit breaker counts it as it
    /// counts an outage (whatever its kind), so that requests do not each meet it while
    /// the failure mode answers them; without the mark, an error that is not I/O leaves
    /// the breaker as it is.
    ///
    /// ```
    /// use tollgate::{StoreError, StoreErrorKind};
    ///
    /// let err = StoreError::new(StoreErrorKind::Refused, "password refused").for_every_request();
    /// assert!(err.is_for_every_request());
    /// assert!(!StoreError::new(StoreErrorKind::Refused, "WRONGTYPE").is_for_every_request());
    /// ```
    pub fn for_every_request(mut self) -> Self {
        self.every_request = true;
        self
    }

    /// True when every request meets this failure ([`for_every_request`](Self::for_every_request)).
    pub fn is_for_every_request(&self) -> bool {
        self.every_request
    }

    /// True when the circuit breaker counts this failure as an outage although it is no
    /// I/O failure: every request meets it, and it is not a store that cannot decide the
    /// policies (a set-up error, never an outage). The layer and the `Limiter` alike.
    pub(crate) fn meets_every_request_as_an_outage(&self) -> bool {
        self.every_request && self.kind != StoreErrorKind::Unsupported
    }

    /// The backend's error code, when it gave one.
    ///
    /// ```
    /// use tollgate::{StoreError, StoreErrorKind};
    ///
    /// let loading =
    ///     StoreError::new(StoreErrorKind::Unavailable, "still loading").with_code("LOADING");
    /// assert_eq!(loading.code(), Some("LOADING"));
    /// assert_eq!(StoreError::new(StoreErrorKind::Timeout, "no answer").code(), None);
    /// ```
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// Attaches the underlying error.
    ///
    /// ```
    /// use std::error::Error;
    /// use std::io;
    /// use tollgate::{StoreError, StoreErrorKind};
    ///
    /// let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused");
    /// let err = StoreError::new(StoreErrorKind::Unavailable, "cannot reach the store")
    ///     .with_source(refused);
    /// assert_eq!(err.source().unwrap().to_string(), "connection refused");
    /// ```
    pub fn with_source(mut self, source: impl Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The same error for another request met by it (a coalesced batch's waiters): its
    /// kind, code, message and whether every request meets it. The source, which cannot
    /// be cloned, is its text.
    #[cfg(feature = "redis")]
    pub(crate) fn for_another(&self) -> Self {
        Self {
            kind: self.kind,
            code: self.code.clone(),
            message: self.message.clone(),
            source: self
                .source
                .as_ref()
                .map(|source| Box::<dyn Error + Send + Sync>::from(source.to_string())),
            every_request: self.every_request,
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            StoreErrorKind::Protocol => "protocol error",
            StoreErrorKind::Other => "error",
            other => other.as_str(),
        };
        write!(f, "rate-limit store {kind}: {}", self.message)
    }
}

impl Error for StoreError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn Error + 'static))
    }
}
