//! A local cache of denials in front of a shared store: one hot identity must not make
//! one hot Redis key.

use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use smallvec::SmallVec;

use super::{Adjustment, DecideFuture, ResetFuture, Store, StoreError, check_answer};
use crate::clock::{Clock, MonotonicClock, nanos};
use crate::decision::{Decision, Outcome};
use crate::key::Key;
use crate::policy::{Policy, PolicySet};

/// Remembers denials: once the store says an identity is denied for `retry_after`,
/// requests of that identity with the same cost are denied in-process until then,
/// without a round trip.
///
/// This is exact for every algorithm: a denial's `retry_after` is the earliest time the
/// same request could be admitted if nothing else were spent, and spending by others only
/// pushes it later, so "after waiting `Retry-After` the same request is admitted" holds
/// for every cached answer. (One exception: a sliding log holding more than 256 entries
/// for an identity answers an upper bound of the wait, which it reads no further; a
/// denial cached from it may then outlast the store's, by `max_age` at most.) A cached answer's wait counts from when the store's answer
/// came (never shorter than the store's), but the denial is answered here only until its
/// wait counted from when the request was sent: a slow answer never keeps an identity
/// denied here after the store would admit it. A request of another cost goes to
/// the store: a cheaper one may fit sooner, a costlier one needs longer than the cached
/// wait. Each identity keeps one entry with up to four costs, so a client that varies
/// its cost cannot push other identities out (but each new cost of it reaches the store).
///
/// A denial is cached for at most [`max_age`](Self::max_age) (1 s by default), whatever
/// its `Retry-After`: a reset, a grant or a refund made through another replica (each
/// has its own cache) clears only that replica's cache, so the others see it within
/// `max_age`; so is one made below the cache (a [`Leased`](super::Leased) store inside it
/// gives its leases' rests back itself), and so is state the store loses by itself (an
/// identity it evicts, a Redis key evicted under `maxmemory` or lost in a failover).
/// Within it, a cached answer carries its full remaining wait. A change made through this
/// cache forgets the identity's denials when it is sent, and again when it lands or when
/// its wait is given up (a settle's timeout drops it): a denial the store gives between a
/// wait given up and the change's landing is kept up to `max_age`, as another replica's
/// change is.
///
/// A cost above a policy's limit is refused whatever the state, so it is answered here
/// every time ([`Outcome::CostExceedsLimit`](crate::Outcome::CostExceedsLimit)), never
/// asked of the store: a client looping on a request it can never afford costs no round
/// trips.
///
/// A cached answer cannot know the policies' state now (others spend, buckets refill),
/// so it carries no statuses: the layer sends `Retry-After` and `RateLimit-Policy`, and
/// no `RateLimit` field rather than stale numbers. Where none is left (a block, or in
/// the single-valued styles a denial of one unit) it says so, as the store's answer
/// does. It is marked [`from_cache`](crate::Decision::from_cache), so it never closes a
/// circuit breaker.
///
/// A policy set with an in-flight limit is not cached: every request of it goes to the
/// store (an in-flight denial ends when some request ends, not at a time). Of a set with
/// a penalty, only a block's denials are cached ([`Decision::is_blocked`]: a blocked
/// request counts towards nothing); the denials that count towards a block all reach the
/// store.
///
/// Under a flood from one identity the store sees about one request per `retry_after`
/// (or per `max_age`, whichever is shorter) from each replica instead of every request.
/// Memory is bounded by `capacity` identities (at least one is cached).
///
/// In front of an in-process store that counts the decisions asked of it: once the store
/// has denied an identity, its next request is denied here, without a store call, with
/// the wait left and no statuses:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::store::DenyCache;
/// use tollgate::{DecideFuture, Key, MemoryStore, Policy, PolicySet, Rate, Store};
///
/// /// The in-process store, counting the decisions asked of it.
/// #[derive(Clone)]
/// struct Counted {
///     memory: MemoryStore<ManualClock>,
///     calls: Arc<AtomicU32>,
/// }
///
/// impl Store for Counted {
///     fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
///         self.calls.fetch_add(1, Ordering::Relaxed);
///         self.memory.decide(key, policies, cost)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new();
/// let memory = MemoryStore::builder().clock(clock.clone()).build();
/// let counted = Counted { memory, calls: Arc::default() };
/// let store = DenyCache::with_clock(counted.clone(), 10_000, clock.clone());
/// // One request every 10 s.
/// let policies = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_minute(6))?);
/// let key = Key::new("user-7");
///
/// assert!(store.decide(&key, &policies, 1).await?.is_allowed());
/// let denied = store.decide(&key, &policies, 1).await?; // the store's denial
/// assert_eq!(denied.retry_after(), Some(Duration::from_secs(10)));
/// assert!(!denied.is_cached());
///
/// clock.advance(Duration::from_millis(400));
/// let cached = store.decide(&key, &policies, 1).await?;
/// assert!(cached.is_cached());
/// assert_eq!(cached.retry_after(), Some(Duration::from_millis(9_600)));
/// assert!(cached.statuses().is_empty()); // no stale numbers
/// assert_eq!(counted.calls.load(Ordering::Relaxed), 2); // the third never reached it
/// # Ok(()) }
/// ```
///
/// In front of Redis, the shared store it is made for (not run here: it needs a server):
///
/// ```no_run
/// # #[cfg(feature = "redis")] // the example needs RedisStore; it compiles to nothing without
/// # mod example {
/// use tollgate::store::{DenyCache, RedisStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = DenyCache::new(RedisStore::connect("redis://127.0.0.1:6379").await?, 100_000);
/// # Ok(()) }
/// # }
/// ```
#[derive(Clone)]
pub struct DenyCache<S> {
    inner: S,
    shared: Arc<Shared>,
    /// The longest a denial is kept, in nanoseconds.
    max_age: u64,
}

/// How long a denial is kept by default: a change made through another replica is seen
/// within it.
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(1);

/// Key and policy set fingerprint: one entry per identity, however many costs it sends,
/// so one client cannot push other identities out of the cache by varying its cost.
type CacheKey = (Key, u64);

/// Costs remembered per identity.
const COSTS_PER_IDENTITY: usize = 4;

struct Shared {
    denials: quick_cache::sync::Cache<CacheKey, Denials>,
    clock: Arc<dyn Clock>,
    /// Generations of forgets, by a hash of the key alone: a forget bumps its key's, and a
    /// denial stands only while the generation it was asked under does. So a denial the
    /// store gave before a forget (its grant on the way) and recorded after it is never
    /// answered, however the answers are ordered; and a key's denials under every policy
    /// set go (sets that share a policy share its state). Another key's forget bumps
    /// another generation, but for a hash collision, which only sends a request to the
    /// store.
    generations: Box<[AtomicU64]>,
    hasher: foldhash::fast::RandomState,
}

/// Forget generations kept: at least this many, else the capacity's next power of two (at
/// most [`MOST_GENERATIONS`]), so that the settles of many identities seldom bump a
/// cached one's.
const FEWEST_GENERATIONS: usize = 4096;
const MOST_GENERATIONS: usize = 1 << 20;

/// An identity's denials, one per cost (at most [`COSTS_PER_IDENTITY`]).
#[derive(Clone, Default)]
struct Denials {
    /// The key's forget generation they were asked under: past it, they are stale.
    generation: u64,
    /// `(cost, local clock nanoseconds until which it is denied, until which that is
    /// answered here, denying policy)`.
    entries: SmallVec<[(u64, u64, u64, usize); COSTS_PER_IDENTITY]>,
}

impl<S> std::fmt::Debug for DenyCache<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenyCache")
            .field("denials", &self.shared.denials.len())
            .field("max_age", &Duration::from_nanos(self.max_age))
            .finish_non_exhaustive()
    }
}

impl<S: Store> DenyCache<S> {
    /// Caches the denials of `inner` for up to `capacity` identities, measuring their
    /// waits on the monotonic clock.
    ///
    /// ```
    /// use tollgate::store::DenyCache;
    /// use tollgate::{Key, MemoryStore, Outcome, Policy, PolicySet, Rate, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = DenyCache::new(MemoryStore::new(), 10_000);
    /// let policies = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(10))?);
    /// let key = Key::new("user-7");
    /// // A cost that can never fit is refused here, without asking the store.
    /// let never = store.decide(&key, &policies, 11).await?;
    /// assert!(matches!(never.outcome(), Outcome::CostExceedsLimit { .. }));
    /// assert!(never.is_cached());
    /// // One that fits is the store's to decide.
    /// let admitted = store.decide(&key, &policies, 1).await?;
    /// assert!(admitted.is_allowed() && !admitted.is_cached());
    /// # Ok(()) }
    /// ```
    pub fn new(inner: S, capacity: usize) -> Self {
        Self::with_clock(inner, capacity, MonotonicClock::new())
    }

    /// [`new`](Self::new), measuring the cached waits on `clock` (for tests, a
    /// [`ManualClock`](crate::clock::ManualClock)). Here a denial is answered from the
    /// cache until [`max_age`](Self::max_age) (1 s by default) has passed on the manual
    /// clock; then the store is asked again:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::store::DenyCache;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Rate, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new();
    /// let memory = MemoryStore::builder().clock(clock.clone()).build();
    /// let store = DenyCache::with_clock(memory, 10_000, clock.clone());
    /// let policies = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_minute(6))?);
    /// let key = Key::new("user-7");
    /// store.decide(&key, &policies, 1).await?;
    /// store.decide(&key, &policies, 1).await?; // denied for 10 s, and cached
    ///
    /// clock.advance(Duration::from_millis(999));
    /// assert!(store.decide(&key, &policies, 1).await?.is_cached());
    /// clock.advance(Duration::from_millis(1));
    /// let asked = store.decide(&key, &policies, 1).await?;
    /// assert!(!asked.is_cached());
    /// assert_eq!(asked.retry_after(), Some(Duration::from_secs(9)));
    /// # Ok(()) }
    /// ```
    pub fn with_clock(inner: S, capacity: usize, clock: impl Clock) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                denials: quick_cache::sync::Cache::new(capacity.max(1)),
                clock: Arc::new(clock),
                generations: (0..generations(capacity))
                    .map(|_| AtomicU64::new(0))
                    .collect(),
                hasher: foldhash::fast::RandomState::default(),
            }),
            max_age: nanos(DEFAULT_MAX_AGE),
        }
    }

    /// Keeps a denial at most `max_age` (default 1 s), however long its `Retry-After`:
    /// how long a reset, grant or refund made through another replica can go unseen
    /// here. Longer spares the store more of a flood; zero records no denial. Clones
    /// share their entries: each entry is kept as long as the handle that recorded it
    /// said.
    ///
    /// Kept 5 s, a denial of a minute is answered here for 5 s; kept for no time, each
    /// denial is the store's:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::store::DenyCache;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Rate, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new();
    /// let memory = MemoryStore::builder().clock(clock.clone()).build();
    /// let policies = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_minute(1))?);
    ///
    /// let kept = DenyCache::with_clock(memory.clone(), 10_000, clock.clone())
    ///     .max_age(Duration::from_secs(5));
    /// let key = Key::new("user-7");
    /// kept.decide(&key, &policies, 1).await?;
    /// kept.decide(&key, &policies, 1).await?; // denied for a minute
    /// clock.advance(Duration::from_millis(4_999));
    /// assert!(kept.decide(&key, &policies, 1).await?.is_cached());
    /// clock.advance(Duration::from_millis(1));
    /// assert!(!kept.decide(&key, &policies, 1).await?.is_cached());
    ///
    /// let never = DenyCache::with_clock(memory, 10_000, clock).max_age(Duration::ZERO);
    /// let key = Key::new("user-8");
    /// never.decide(&key, &policies, 1).await?;
    /// for _ in 0..3 {
    ///     let denied = never.decide(&key, &policies, 1).await?;
    ///     assert!(!denied.is_allowed() && !denied.is_cached());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = nanos(max_age);
        self
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// How many forget generations a cache of `capacity` identities keeps (a power of two).
fn generations(capacity: usize) -> usize {
    capacity
        .checked_next_power_of_two()
        .unwrap_or(MOST_GENERATIONS)
        .clamp(FEWEST_GENERATIONS, MOST_GENERATIONS)
}

impl Shared {
    /// Drops `key`'s cached denials, under every policy set (sets sharing a policy share
    /// its state): units given back or a reset may admit what was denied. Its generation
    /// moves on, so its entries are stale (and replaced when next recorded).
    fn forget(&self, key: &Key) {
        self.generation(key).fetch_add(1, Ordering::SeqCst);
    }

    /// The forget generation of `key`.
    fn generation(&self, key: &Key) -> &AtomicU64 {
        let hash = self.hasher.hash_one(key.as_str());
        // A power of two of them: the low bits pick one.
        &self.generations[(hash as usize) & (self.generations.len() - 1)]
    }

    /// Remembers `decision` when it is a denial.
    /// `penalties`: the set has a penalty, whose denials count towards a block: only a
    /// block's denial (which counts towards nothing) is kept.
    /// `sent`: when the decision was asked for, on this cache's clock, and the key's
    /// forget generation then.
    fn record(
        &self,
        cache_key: CacheKey,
        cost: u64,
        decision: &Decision,
        max_age: u64,
        penalties: bool,
        (sent_at, generation): (u64, u64),
    ) {
        if penalties && decision.retry_after().is_some() && !decision.is_blocked() {
            return;
        }
        // A forget since the decision was asked for (a grant landed, a reset): the
        // denial may be older than the units given back. (One that runs after this read
        // bumps the generation the entry carries: the entry is never answered.)
        if self.generation(&cache_key.0).load(Ordering::SeqCst) != generation {
            return;
        }
        // Read on another thread than `sent_at` may be: a clock that is monotonic only
        // within a thread (the TSC's) may read a little earlier here.
        let now = self.clock.now().max(sent_at);
        let mut denials = self
            .denials
            .get(&cache_key)
            .filter(|denials| denials.generation == generation)
            .unwrap_or_default();
        denials.generation = generation;
        denials
            .entries
            .retain(|entry| entry.0 != cost && entry.2 > now);
        match decision.outcome() {
            Outcome::Denied {
                retry_after,
                policy,
            } => {
                let wait = nanos(retry_after);
                if denials.entries.len() == COSTS_PER_IDENTITY {
                    // Full: the entry kept the shortest makes room.
                    if let Some(soonest) =
                        (0..denials.entries.len()).min_by_key(|&index| denials.entries[index].2)
                    {
                        denials.entries.remove(soonest);
                    }
                }
                // The store's wait runs from when it decided: after the request was sent,
                // before its answer came. The wait told counts from the answer (never
                // short of the store's); the denial is answered here only until the wait
                // counted from the sending (never past the store's), however long the
                // answer took to come back.
                let until = now.saturating_add(wait);
                // A block's answer stands only while the block does: past it, the
                // policies' own (longer) wait denies, and those denials count.
                let kept_for = if decision.is_blocked() {
                    wait.min(nanos(decision.block_left()))
                } else {
                    wait
                };
                let kept = sent_at.saturating_add(kept_for.min(max_age));
                if kept > now {
                    denials.entries.push((cost, until, kept, policy));
                }
            }
            Outcome::Allowed { .. } | Outcome::CostExceedsLimit { .. } => {}
        }
        if denials.entries.is_empty() {
            self.denials.remove(&cache_key);
        } else {
            self.denials.insert(cache_key, denials);
        }
    }
}

/// Where a key's denials under `policies` are kept: by the set's policies and their
/// penalties (the same policies without them, or with others, share the rate state but
/// not the blocks: a block is no answer for them).
fn cache_key(key: &Key, policies: &PolicySet) -> CacheKey {
    (key.clone(), policies.fingerprint_with_penalties())
}

impl<S> DenyCache<S> {
    /// Drops a key's cached denials now and again when `change` lands (a store doing I/O
    /// lands it a round trip later: a denial it gave meanwhile, and this cache kept, was
    /// given before the units were back), or when its wait is given up: a store doing I/O
    /// applies what it was sent whether or not the reply is awaited (a settle's timeout
    /// drops the future), and a denial kept from before then would outlive the change.
    fn forget_around<T: Send + 'static>(
        &self,
        key: &Key,
        change: Pin<Box<dyn Future<Output = T> + Send>>,
    ) -> Pin<Box<dyn Future<Output = T> + Send>> {
        self.shared.forget(key);
        let landing = Landing {
            shared: Arc::clone(&self.shared),
            key: key.clone(),
        };
        Box::pin(async move {
            // Forgets when the change lands, or when this future is dropped first.
            let _landing = landing;
            change.await
        })
    }
}

/// Forgets a key's cached denials when dropped: when its change lands, or when the wait
/// for it is given up.
struct Landing {
    shared: Arc<Shared>,
    key: Key,
}

impl Drop for Landing {
    fn drop(&mut self) {
        self.shared.forget(&self.key);
    }
}

impl<S: Store> Store for DenyCache<S> {
    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        self.inner.validate(policies)
    }

    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        // An in-flight limit's denial ends when some request ends, not at its retry time:
        // such sets are never cached.
        if policies.has_in_flight() {
            return self.inner.decide(key, policies, cost);
        }
        // A penalty must see every denial that counts: of such a set, only a block's
        // denials are cached (and a blocked client's costly request is the block's).
        let penalties = policies.has_penalties();
        // A cost above a policy's limit is refused whatever the state (a block's too: it
        // is no strike), as the store would refuse it: answered here, every time.
        if let Some(policy) = policies.never_admits(cost) {
            let limit = policies.get(policy).map_or(0, Policy::limit);
            let outcome = Outcome::CostExceedsLimit {
                policy,
                cost,
                limit,
            };
            return DecideFuture::ready(Ok(
                Decision::with_statuses(outcome, SmallVec::new()).from_cache()
            ));
        }
        let cache_key = cache_key(key, policies);
        let now = self.shared.clock.now();
        let generation = self.shared.generation(key).load(Ordering::SeqCst);
        let cached = self.shared.denials.get(&cache_key).and_then(|denials| {
            if denials.generation != generation {
                // Asked before a forget: stale.
                return None;
            }
            denials
                .entries
                .iter()
                .find(|&&(denied, _, kept, _)| denied == cost && now < kept)
                .copied()
        });
        if let Some((_, until, kept, policy)) = cached {
            let outcome = Outcome::Denied {
                policy,
                retry_after: Duration::from_nanos(until.saturating_sub(now)),
            };
            let decision = Decision::with_statuses(outcome, SmallVec::new()).from_cache();
            return DecideFuture::ready(Ok(if penalties {
                // Kept no longer than the block.
                decision.with_block(Duration::from_nanos(kept - now))
            } else {
                decision
            }));
        }
        let sent = (now, generation);
        match self.inner.decide(key, policies, cost).into_ready() {
            Ok(result) => {
                // A denial naming a policy the set lacks (a store's bug) is answered once,
                // as a protocol error, never replayed as if the store had been asked.
                if let Ok(decision) = &result
                    && check_answer(decision, policies.len()).is_ok()
                {
                    self.shared
                        .record(cache_key, cost, decision, self.max_age, penalties, sent);
                }
                DecideFuture::ready(result)
            }
            Err(pending) => {
                let shared = Arc::clone(&self.shared);
                let (max_age, len) = (self.max_age, policies.len());
                DecideFuture::new(async move {
                    let result = pending.await;
                    if let Ok(decision) = &result
                        && check_answer(decision, len).is_ok()
                    {
                        shared.record(cache_key, cost, decision, max_age, penalties, sent);
                    }
                    result
                })
            }
        }
    }

    fn can_adjust(&self) -> bool {
        self.inner.can_adjust()
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        // A release frees in-flight slots alone (an in-flight set's denials are never
        // cached), and a settle that charges gives nothing back: nothing to forget.
        if !adjustment.gives_back() {
            return self.inner.adjust(key, policies, adjustment);
        }
        // Units given back may admit what was denied, through any set sharing a policy
        // (an in-flight set's rate policies too): cached denials of the key go, when the
        // adjustment is sent and when it lands.
        match self.inner.adjust(key, policies, adjustment).into_ready() {
            Ok(result) => {
                self.shared.forget(key);
                DecideFuture::ready(result)
            }
            Err(pending) => DecideFuture::new(self.forget_around(key, pending)),
        }
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        self.inner.peek(key, policies)
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        let reset = self.inner.reset(key, policies);
        self.forget_around(key, reset)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::MemoryStore;
    use crate::store::held::Held;
    use crate::{Policy, Rate};

    /// Counts the calls that reach the inner store.
    #[derive(Clone)]
    struct Counting {
        inner: MemoryStore<ManualClock>,
        calls: Arc<AtomicU64>,
    }

    impl Store for Counting {
        fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.inner.decide(key, policies, cost)
        }
    }

    /// A deny cache over a counting in-process store, both on `clock`, and the count of
    /// the calls that reach the store.
    fn counted(clock: &ManualClock) -> (DenyCache<Counting>, Arc<AtomicU64>) {
        let calls = Arc::new(AtomicU64::new(0));
        let inner = Counting {
            inner: MemoryStore::builder().clock(clock.clone()).build(),
            calls: Arc::clone(&calls),
        };
        (DenyCache::with_clock(inner, 100, clock.clone()), calls)
    }

    #[test]
    fn denials_are_answered_locally_and_cheaper_requests_still_go_through() {
        let calls = Arc::new(AtomicU64::new(0));
        let inner = Counting {
            inner: MemoryStore::builder().clock(ManualClock::new()).build(),
            calls: Arc::clone(&calls),
        };
        let cache = DenyCache::new(inner, 100);
        let policies = PolicySet::from(Policy::token_bucket("api", 5, Rate::per_hour(1)).unwrap());
        let key = Key::new("hot");
        let decide = |cost| now_or_never(cache.decide(&key, &policies, cost));
        assert!(decide(4).is_allowed());
        // 1 left: a request of 3 is denied by the store, then cached.
        let denied = decide(3);
        assert!(!denied.is_allowed());
        assert_eq!(calls.load(Ordering::Relaxed), 2);
        for _ in 0..1000 {
            let again = decide(3);
            assert!(!again.is_allowed());
            assert!(again.retry_after().unwrap() <= denied.retry_after().unwrap());
        }
        assert_eq!(calls.load(Ordering::Relaxed), 2, "the flood stayed local");
        // A cheaper request may fit: it goes to the store, and is admitted.
        assert!(decide(1).is_allowed());
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }

    /// A cost above a policy's limit is refused whatever the state: the answer is the
    /// same every time, so a client looping on such a request (a route only some plans
    /// admit, a cost the client chooses) never reaches the store, as a flood of denials
    /// does not.
    #[test]
    fn a_cost_no_state_admits_never_reaches_the_store() {
        let (cache, calls) = counted(&ManualClock::new());
        let policies = PolicySet::new([
            Policy::token_bucket("burst", 50, Rate::per_second(50)).unwrap(),
            Policy::token_bucket("api", 5, Rate::per_hour(5)).unwrap(),
        ])
        .unwrap();
        let key = Key::new("hot");
        for _ in 0..1000 {
            let refused = now_or_never(cache.decide(&key, &policies, 6));
            assert_eq!(
                refused.outcome(),
                Outcome::CostExceedsLimit {
                    policy: 1,
                    cost: 6,
                    limit: 5
                }
            );
            assert!(refused.is_cached(), "not the store's own answer");
        }
        assert_eq!(calls.load(Ordering::Relaxed), 0, "the loop stayed local");
        assert!(now_or_never(cache.decide(&key, &policies, 5)).is_allowed());
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    /// A penalty's block is answered here until it ends: a blocked request counts
    /// towards nothing, so the store loses no denial it must see. The denials that lead
    /// to the block (each one counts) all go to the store.
    #[test]
    fn a_block_is_answered_locally_and_the_denials_before_it_are_not() {
        let clock = ManualClock::new();
        let (cache, calls) = counted(&clock);
        let penalty =
            crate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(600));
        let policies = PolicySet::from(
            Policy::fixed_window("api", 1, Duration::from_secs(60))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        );
        let key = Key::new("abusive");
        let decide = |cost| now_or_never(cache.decide(&key, &policies, cost));
        assert!(decide(1).is_allowed());
        // Two denials that count: each reaches the store.
        for _ in 0..2 {
            let denied = decide(1);
            assert!(!denied.is_allowed() && !denied.is_blocked() && !denied.is_cached());
        }
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        // The third starts the block.
        let blocked = decide(1);
        assert!(blocked.is_blocked() && !blocked.is_cached());
        assert!(blocked.retry_after().unwrap() >= Duration::from_secs(600));
        for _ in 0..1000 {
            let again = decide(1);
            assert!(again.is_blocked() && again.is_cached());
        }
        assert_eq!(
            calls.load(Ordering::Relaxed),
            4,
            "the blocked flood stayed local"
        );
        // Past the max age the store is asked again, and says the block goes on.
        clock.advance(Duration::from_secs(1));
        assert!(decide(1).is_blocked());
        assert_eq!(calls.load(Ordering::Relaxed), 5);
    }

    /// A request that can never fit is told so under a block too, as the store tells it:
    /// the block's `429` would send it back when the block ends, only to be refused.
    #[test]
    fn a_cost_no_state_admits_is_refused_as_such_under_a_cached_block() {
        let (cache, calls) = counted(&ManualClock::new());
        let penalty =
            crate::policy::Penalty::new(1, Duration::from_secs(60), Duration::from_secs(600));
        let policies = PolicySet::from(
            Policy::fixed_window("api", 2, Duration::from_secs(60))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        );
        let key = Key::new("abusive");
        let decide = |cost| now_or_never(cache.decide(&key, &policies, cost));
        assert!(decide(2).is_allowed());
        assert!(decide(1).is_blocked());
        assert!(decide(1).is_cached(), "the block is cached");
        let calls_before = calls.load(Ordering::Relaxed);
        for _ in 0..100 {
            assert_eq!(
                decide(3).outcome(),
                Outcome::CostExceedsLimit {
                    policy: 0,
                    cost: 3,
                    limit: 2
                }
            );
        }
        assert_eq!(calls.load(Ordering::Relaxed), calls_before, "answered here");
    }

    /// A set and the same policies with a penalty share rate state but not penalty
    /// state: a block cached for one is no answer for the other, and a plain denial
    /// cached for the plain set must not stand as the penalized set's block (its strike
    /// would never reach the store).
    #[test]
    fn a_block_is_no_answer_for_the_same_policies_without_the_penalty() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let cache = DenyCache::with_clock(store, 100, clock.clone());
        let plain = Policy::fixed_window("api", 1, Duration::from_secs(60)).unwrap();
        let penalty =
            crate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(600));
        let penalized = PolicySet::from(plain.with_penalty(penalty).unwrap());
        let plain = PolicySet::from(plain);
        let key = Key::new("k");
        let decide = |set: &PolicySet| now_or_never(cache.decide(&key, set, 1));
        assert!(decide(&penalized).is_allowed());
        for _ in 0..2 {
            assert!(!decide(&penalized).is_blocked());
        }
        assert!(decide(&penalized).is_blocked());
        // The window is over; the block is not, and is cached.
        clock.advance(Duration::from_secs(61));
        assert!(decide(&penalized).is_blocked());
        // The plain set has no block: the store admits it.
        assert!(
            decide(&plain).is_allowed(),
            "the block's answer stood for the plain set"
        );
        // Its denial, cached for it, is no block of the penalized set.
        assert!(!decide(&plain).is_allowed());
        let other = Key::new("other");
        assert!(now_or_never(cache.decide(&other, &plain, 1)).is_allowed());
        let denied = now_or_never(cache.decide(&other, &plain, 1));
        assert!(!denied.is_allowed() && !denied.is_blocked());
        let counted = now_or_never(cache.decide(&other, &penalized, 1));
        assert!(!counted.is_cached() && !counted.is_blocked(), "{counted:?}");
    }

    /// A block's answer waits for the policies too when their wait is longer, but it is
    /// a block only until the block ends: past that, denials count again, and must reach
    /// the store.
    #[test]
    fn a_cached_block_ends_with_the_block() {
        let clock = ManualClock::new();
        let (cache, calls) = counted(&clock);
        let cache = cache.max_age(Duration::from_secs(60));
        let penalty =
            crate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(10));
        let set = PolicySet::from(
            Policy::fixed_window("api", 1, Duration::from_secs(600))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        );
        let key = Key::new("k");
        let decide = || now_or_never(cache.decide(&key, &set, 1));
        assert!(decide().is_allowed());
        decide();
        decide();
        let blocked = decide();
        assert!(blocked.is_blocked());
        assert!(blocked.retry_after().unwrap() > Duration::from_secs(500));
        assert_eq!(calls.load(Ordering::Relaxed), 4);
        clock.advance(Duration::from_secs(9));
        assert!(decide().is_cached());
        assert_eq!(calls.load(Ordering::Relaxed), 4);
        // The block is over: this denial counts, and the store sees it.
        clock.advance(Duration::from_secs(2));
        let counted = decide();
        assert!(!counted.is_cached() && !counted.is_blocked(), "{counted:?}");
        assert_eq!(calls.load(Ordering::Relaxed), 5);
    }

    /// What a memory store's future answers at once.
    fn now_or_never<T>(
        mut future: impl std::future::Future<Output = Result<T, StoreError>> + Unpin,
    ) -> T {
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        match std::pin::Pin::new(&mut future).poll(&mut context) {
            std::task::Poll::Ready(result) => result.unwrap(),
            std::task::Poll::Pending => unreachable!("the memory store answers at once"),
        }
    }

    /// A deny cache keeping denials a minute over a [`Sent`] store, a policy of one unit
    /// a day and a key that spent it (the next request of it is denied until a change
    /// gives back), and the gate the store's changes land through.
    async fn one_spent() -> (DenyCache<Sent>, PolicySet, Key, Arc<tokio::sync::Semaphore>) {
        let clock = ManualClock::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let store = Sent {
            inner: MemoryStore::builder().clock(clock.clone()).build(),
            gate: Arc::clone(&gate),
        };
        let cache = DenyCache::with_clock(store, 100, clock).max_age(Duration::from_secs(60));
        let policies =
            PolicySet::from(Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap());
        let key = Key::new("customer");
        assert!(cache.decide(&key, &policies, 1).await.unwrap().is_allowed());
        (cache, policies, key, gate)
    }

    /// A grant (or refund, or reset) sent to a store doing I/O lands a round trip later.
    /// A denial the store gives meanwhile (the units are not back yet) must not be kept
    /// past the grant's landing: this replica would deny what the store admits until
    /// the denial's age ran out, though the docs promise that only other replicas lag.
    #[tokio::test]
    async fn a_denial_given_while_a_grant_is_on_its_way_is_forgotten_when_it_lands() {
        for reset in [false, true] {
            let (cache, policies, key, gate) = one_spent().await;
            let landing = if reset {
                let future = cache.reset(&key, &policies);
                tokio::spawn(future)
            } else {
                let future = cache.adjust(&key, &policies, &Adjustment::grant(1));
                tokio::spawn(async move { future.await.map(|_| ()) })
            };
            tokio::task::yield_now().await;
            // Sent, not landed: the store still denies, and the denial is cached.
            let denied = cache.decide(&key, &policies, 1).await.unwrap();
            assert!(!denied.is_allowed() && !denied.is_cached());
            gate.add_permits(1);
            landing.await.unwrap().unwrap();
            let after = cache.decide(&key, &policies, 1).await.unwrap();
            assert!(
                after.is_allowed(),
                "reset {reset}: the store admits once the change landed, but the cache said {after:?}"
            );
        }
    }

    /// An in-process store whose adjustments and resets are sent at once and land when
    /// the test says, whatever becomes of their futures: as Redis applies a command it
    /// was sent when the caller gives up waiting for its reply.
    #[derive(Clone)]
    struct Sent {
        inner: MemoryStore<ManualClock>,
        gate: Arc<tokio::sync::Semaphore>,
    }

    impl Sent {
        fn send<T: Send + 'static>(
            &self,
            change: impl std::future::Future<Output = T> + Send + 'static,
        ) -> impl std::future::Future<Output = T> + Send + 'static {
            let gate = Arc::clone(&self.gate);
            let landing = tokio::spawn(async move {
                let _pass = gate.acquire().await.expect("open");
                change.await
            });
            async move { landing.await.expect("the change lands") }
        }
    }

    impl Store for Sent {
        fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
            self.inner.decide(key, policies, cost)
        }

        fn can_adjust(&self) -> bool {
            true
        }

        fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
            let inner = self.inner.clone();
            let (key, policies, adjustment) = (key.clone(), policies.clone(), adjustment.clone());
            DecideFuture::new(
                self.send(async move { inner.adjust(&key, &policies, &adjustment).await }),
            )
        }

        fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
            let inner = self.inner.clone();
            let (key, policies) = (key.clone(), policies.clone());
            Box::pin(self.send(async move { inner.reset(&key, &policies).await }))
        }
    }

    /// A grant or reset whose wait is given up (the layer's settle timeout drops its
    /// future) still lands: the command was sent. The cache forgot the key's denials when
    /// the change was sent, and was to forget them again when it landed, but a dropped
    /// future never lands: a denial the store gave in between was kept, and this replica
    /// denied what the store admits for the whole max age.
    #[tokio::test]
    async fn a_denial_given_while_a_change_is_on_its_way_is_forgotten_when_its_wait_is_dropped() {
        for reset in [false, true] {
            let (cache, policies, key, gate) = one_spent().await;
            let waiting: Pin<Box<dyn std::future::Future<Output = ()> + Send>> = if reset {
                let future = cache.reset(&key, &policies);
                Box::pin(async move { future.await.unwrap() })
            } else {
                let future = cache.adjust(&key, &policies, &Adjustment::grant(1));
                Box::pin(async move {
                    future.await.unwrap();
                })
            };
            tokio::task::yield_now().await;
            // Sent, not landed: the store still denies, and the denial is cached.
            let denied = cache.decide(&key, &policies, 1).await.unwrap();
            assert!(!denied.is_allowed() && !denied.is_cached());
            // The wait is given up; the change lands all the same.
            drop(waiting);
            gate.add_permits(1);
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            let after = cache.decide(&key, &policies, 1).await.unwrap();
            assert!(
                after.is_allowed(),
                "reset {reset}: the store admits once the change landed, but the cache said {after:?}"
            );
        }
    }

    /// A deny cache keeping denials a minute, over a store on `clock` whose replies wait
    /// for the returned gate (one reply may pass at first).
    fn late_replies(clock: &ManualClock) -> (DenyCache<Held>, Arc<tokio::sync::Semaphore>) {
        let store = Held::new(clock, 1, usize::MAX >> 4);
        let gate = Arc::clone(&store.answers);
        let cache =
            DenyCache::with_clock(store, 100, clock.clone()).max_age(Duration::from_secs(60));
        (cache, gate)
    }

    /// A denial the store gave before a grant landed, whose reply comes after the grant's
    /// (and after the cache forgot the key): recorded then, it denied what the store
    /// admits for up to `max_age`.
    #[tokio::test]
    async fn a_denial_answered_after_a_grant_landed_is_not_kept() {
        let clock = ManualClock::new();
        let (cache, gate) = late_replies(&clock);
        let policies =
            PolicySet::from(Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap());
        let key = Key::new("customer");
        assert!(cache.decide(&key, &policies, 1).await.unwrap().is_allowed());
        // Denied by the store now, answered later.
        let late = tokio::spawn(cache.decide(&key, &policies, 1));
        tokio::task::yield_now().await;
        cache
            .adjust(&key, &policies, &Adjustment::grant(1))
            .await
            .unwrap();
        gate.add_permits(1);
        assert!(!late.await.unwrap().unwrap().is_allowed());
        gate.add_permits(1);
        let after = cache.decide(&key, &policies, 1).await.unwrap();
        assert!(after.is_allowed() && !after.is_cached(), "{after:?}");
    }

    /// A change to one identity's state (a settle, a grant, a reset) says nothing about
    /// another's: a denial of `flooded` whose reply crosses another customer's settle on
    /// its way must still be kept, or under a store doing I/O with settles every few
    /// milliseconds the flooded key would reach the store on almost every request.
    #[tokio::test]
    async fn a_change_to_another_identity_does_not_stop_a_denial_being_kept() {
        let clock = ManualClock::new();
        let (cache, gate) = late_replies(&clock);
        let policies =
            PolicySet::from(Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap());
        let (flooded, other) = (Key::new("flooded"), Key::new("other"));
        assert!(
            cache
                .decide(&flooded, &policies, 1)
                .await
                .unwrap()
                .is_allowed()
        );
        // Denied by the store now, answered after another customer's grant and reset.
        let late = tokio::spawn(cache.decide(&flooded, &policies, 1));
        tokio::task::yield_now().await;
        cache
            .adjust(&other, &policies, &Adjustment::grant(1))
            .await
            .unwrap();
        cache.reset(&other, &policies).await.unwrap();
        gate.add_permits(1);
        assert!(!late.await.unwrap().unwrap().is_allowed());
        // (A request that reaches the store is answered.)
        gate.add_permits(1);
        let again = cache.decide(&flooded, &policies, 1).await.unwrap();
        assert!(
            again.is_cached(),
            "another identity's change dropped this denial: {again:?}"
        );
    }

    /// Policy sets that share a policy share its state in the store (`[daily]` and
    /// `[daily, burst]` count the same units for a key): a grant or a reset through one
    /// set may admit what the other's cached denial refuses, and that denial goes too.
    #[test]
    fn a_change_through_one_set_forgets_the_denials_of_every_set_of_the_key() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let cache =
            DenyCache::with_clock(store, 100, clock.clone()).max_age(Duration::from_secs(60));
        let daily = Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap();
        let burst = Policy::token_bucket("burst", 10, Rate::per_second(10)).unwrap();
        let alone = PolicySet::from(daily.clone());
        let both = PolicySet::new([daily, burst]).unwrap();
        let key = Key::new("customer");
        for (index, reset) in [false, true].into_iter().enumerate() {
            let key = Key::new(format!("{}-{index}", key.as_str()));
            assert!(now_or_never(cache.decide(&key, &both, 1)).is_allowed());
            assert!(!now_or_never(cache.decide(&key, &both, 1)).is_allowed());
            assert!(now_or_never(cache.decide(&key, &both, 1)).is_cached());
            if reset {
                now_or_never(cache.reset(&key, &alone));
            } else {
                now_or_never(cache.adjust(&key, &alone, &Adjustment::grant(1)));
            }
            let after = now_or_never(cache.decide(&key, &both, 1));
            assert!(
                after.is_allowed(),
                "reset {reset}: the store admits, the cache said {after:?}"
            );
        }
    }

    /// A change through a set with an in-flight limit gives back units of its rate
    /// policies too, which other sets of the key share: their cached denials go. (Only a
    /// release, which frees slots alone, leaves them.) Such a set was passed straight to
    /// the store, and a route without the in-flight limit kept denying from the cache.
    #[test]
    fn a_change_through_an_in_flight_set_forgets_the_other_sets_denials() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let cache =
            DenyCache::with_clock(store, 100, clock.clone()).max_age(Duration::from_secs(60));
        let daily = Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap();
        let uploads = Policy::concurrency("uploads", 5).unwrap();
        let alone = PolicySet::from(daily.clone());
        let with_slots = PolicySet::new([daily, uploads]).unwrap();
        let key = Key::new("customer");
        assert!(now_or_never(cache.decide(&key, &alone, 1)).is_allowed());
        assert!(!now_or_never(cache.decide(&key, &alone, 1)).is_allowed());
        assert!(now_or_never(cache.decide(&key, &alone, 1)).is_cached());
        now_or_never(cache.adjust(&key, &with_slots, &Adjustment::grant(1)));
        let after = now_or_never(cache.decide(&key, &alone, 1));
        assert!(
            after.is_allowed(),
            "the store admits, the cache said {after:?}"
        );
    }

    /// A settle that charges (the request used more than it reserved) gives nothing back:
    /// the key's cached denials stand. Cleared by every settle, a client's responses on
    /// one route kept the cache from absorbing its flood on another.
    #[test]
    fn a_charging_settle_keeps_the_cached_denials() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let cache =
            DenyCache::with_clock(store, 100, clock.clone()).max_age(Duration::from_secs(60));
        let daily = Policy::fixed_window("daily", 1, Duration::from_secs(3600)).unwrap();
        let alone = PolicySet::from(daily);
        let key = Key::new("customer");
        let admitted = now_or_never(cache.decide(&key, &alone, 1));
        assert!(admitted.is_allowed());
        assert!(!now_or_never(cache.decide(&key, &alone, 1)).is_allowed());
        assert!(now_or_never(cache.decide(&key, &alone, 1)).is_cached());
        let charge = Adjustment::settle(1, 5, admitted.receipt());
        now_or_never(cache.adjust(&key, &alone, &charge));
        assert!(now_or_never(cache.decide(&key, &alone, 1)).is_cached());
    }

    /// The store's wait starts when it decides, which is no earlier than when the request
    /// was sent: a cached denial counted from the reply's arrival would deny, here, for as
    /// long as the reply took after the store already admits.
    #[tokio::test]
    async fn a_cached_denial_ends_no_later_than_the_store_s() {
        let clock = ManualClock::new();
        let (cache, gate) = late_replies(&clock);
        let policies =
            PolicySet::from(Policy::fixed_window("second", 1, Duration::from_secs(1)).unwrap());
        let key = Key::new("customer");
        assert!(cache.decide(&key, &policies, 1).await.unwrap().is_allowed());
        let late = tokio::spawn(cache.decide(&key, &policies, 1));
        tokio::task::yield_now().await;
        // The reply takes half a second to come back.
        clock.advance(Duration::from_millis(500));
        gate.add_permits(1);
        let denied = late.await.unwrap().unwrap();
        assert_eq!(denied.retry_after(), Some(Duration::from_secs(1)));
        // Within the store's wait the denial is answered here, stating a wait no shorter
        // than the store's (counted from the answer), but only until the store admits.
        clock.advance(Duration::from_millis(400));
        let cached = cache.decide(&key, &policies, 1).await.unwrap();
        assert!(cached.is_cached());
        assert_eq!(cached.retry_after(), Some(Duration::from_millis(600)));
        clock.advance(Duration::from_millis(100));
        gate.add_permits(1);
        let after = cache.decide(&key, &policies, 1).await.unwrap();
        assert!(after.is_allowed() && !after.is_cached(), "{after:?}");
    }

    /// Readings on two threads may disagree a little (`Clock`'s contract: a TSC clock
    /// carried per thread): the answer recorded on a thread whose clock reads a little
    /// before the sending must not state a wait that underflows when looked up later.
    #[test]
    fn a_record_read_before_the_sending_states_no_underflowing_wait() {
        /// Gives the readings it was told, in order.
        struct Scripted(std::sync::Mutex<Vec<u64>>);
        impl Clock for Scripted {
            fn now(&self) -> u64 {
                self.0.lock().unwrap().remove(0)
            }
        }
        let second = 1_000_000_000;
        let sent = 10 * second;
        // The lookup and sending, the record (5 ns earlier, another thread), a lookup just
        // before the wait counted from the sending ends.
        let clock = Scripted(std::sync::Mutex::new(vec![
            sent,
            sent - 5,
            sent + second - 2,
        ]));
        let store = MemoryStore::builder().clock(ManualClock::new()).build();
        let cache = DenyCache::with_clock(store.clone(), 100, clock);
        let policies =
            PolicySet::from(Policy::fixed_window("second", 1, Duration::from_secs(1)).unwrap());
        let key = Key::new("k");
        assert!(store.check("k", &policies, 1).is_allowed());
        let denied = now_or_never(cache.decide(&key, &policies, 1));
        assert_eq!(denied.retry_after(), Some(Duration::from_secs(1)));
        let cached = now_or_never(cache.decide(&key, &policies, 1));
        assert!(cached.is_cached());
        assert!(
            cached.retry_after().unwrap() <= Duration::from_secs(1),
            "{cached:?}"
        );
    }

    /// Forget generations grow with the capacity: a big cache's flooded identities share
    /// theirs with few others, so other identities' settles seldom drop their denials.
    #[test]
    fn forget_generations_grow_with_the_capacity() {
        assert_eq!(generations(0), 4096);
        assert_eq!(generations(100), 4096);
        assert_eq!(generations(100_000), 131_072);
        assert_eq!(generations(usize::MAX), 1 << 20);
        let cache = DenyCache::new(MemoryStore::new(), 100_000);
        assert_eq!(cache.shared.generations.len(), 131_072);
    }

    /// Two replicas, each with its own cache, over one shared store. A reset (or a grant,
    /// or a settle's refund) through one replica clears only that replica's cache: the
    /// other's cached denial would stand until its `Retry-After` (here an hour), though
    /// the store admits again. A cached denial is kept at most `max_age` (1 s by
    /// default), so a change made elsewhere is seen within it.
    #[test]
    fn a_reset_through_another_replica_is_seen_within_the_max_age() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let here = DenyCache::with_clock(store.clone(), 100, clock.clone());
        let there = DenyCache::with_clock(store, 100, clock.clone());
        let policies =
            PolicySet::from(Policy::fixed_window("daily", 2, Duration::from_secs(3600)).unwrap());
        let key = Key::new("customer");
        assert!(now_or_never(there.decide(&key, &policies, 2)).is_allowed());
        let denied = now_or_never(there.decide(&key, &policies, 1));
        assert!(denied.retry_after().unwrap() > Duration::from_secs(3000));
        assert!(now_or_never(there.decide(&key, &policies, 1)).is_cached());

        // Support resets the customer through the other replica.
        now_or_never(here.reset(&key, &policies));
        clock.advance(Duration::from_millis(999));
        // Within the max age the cached denial stands, with its full wait...
        let cached = now_or_never(there.decide(&key, &policies, 1));
        assert!(cached.is_cached());
        assert!(cached.retry_after().unwrap() > Duration::from_secs(3000));
        // ...and past it the store is asked again.
        clock.advance(Duration::from_millis(1));
        assert!(now_or_never(there.decide(&key, &policies, 1)).is_allowed());

        // A cache told to keep denials longer keeps them longer.
        let patient = DenyCache::with_clock(here.inner().clone(), 100, clock.clone())
            .max_age(Duration::from_secs(60));
        assert!(now_or_never(patient.decide(&key, &policies, 1)).is_allowed());
        assert!(!now_or_never(patient.decide(&key, &policies, 1)).is_allowed());
        clock.advance(Duration::from_secs(59));
        assert!(now_or_never(patient.decide(&key, &policies, 1)).is_cached());
    }
}
