//! A local cache of denials in front of a shared store: one hot identity must not make
//! one hot Redis key.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use super::{DecideFuture, Store};
use crate::clock::{Clock, MonotonicClock};
use crate::decision::{Decision, Outcome, PolicyStatus};
use crate::key::Key;
use crate::policy::PolicySet;

/// Remembers denials: once the store says an identity is denied for `retry_after`,
/// requests of that identity costing at least as much are denied in-process until then,
/// without a round trip.
///
/// This is exact for every algorithm: a denial's `retry_after` is the earliest time the
/// same request could be admitted if nothing else were spent, and spending by others only
/// pushes it later. Two limits: the local deadline starts when the answer arrives, so it
/// can run up to one round trip longer than the store's; and a *cheaper* request may fit
/// sooner, so it is always sent to the store.
///
/// Under a flood from one identity the store sees about one request per `retry_after`
/// instead of every request. Memory is bounded by `capacity` identities.
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
}

struct Shared {
    denials: quick_cache::sync::Cache<(Key, u64), Denial>,
    clock: MonotonicClock,
}

#[derive(Clone)]
struct Denial {
    /// Local clock nanoseconds until which the identity is denied.
    until: u64,
    cost: u64,
    decision: Decision,
}

impl<S> std::fmt::Debug for DenyCache<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenyCache")
            .field("denials", &self.shared.denials.len())
            .finish_non_exhaustive()
    }
}

impl<S: Store> DenyCache<S> {
    /// Caches the denials of `inner` for up to `capacity` identities.
    pub fn new(inner: S, capacity: usize) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                denials: quick_cache::sync::Cache::new(capacity.max(1)),
                clock: MonotonicClock::new(),
            }),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl Shared {
    fn record(&self, cache_key: (Key, u64), cost: u64, decision: &Decision) {
        match decision.outcome() {
            Outcome::Denied { retry_after, .. } => {
                let wait = u64::try_from(retry_after.as_nanos()).unwrap_or(u64::MAX);
                let denial = Denial {
                    until: self.clock.now().saturating_add(wait),
                    cost,
                    decision: decision.clone(),
                };
                self.denials.insert(cache_key, denial);
            }
            Outcome::Allowed { .. } => {
                self.denials.remove(&cache_key);
            }
            Outcome::CostExceedsLimit { .. } => {}
        }
    }
}

/// The cached denial as it looks `elapsed` after it was made.
fn aged(decision: &Decision, elapsed: Duration, retry_after: Duration) -> Decision {
    let statuses: SmallVec<[PolicyStatus; 2]> = decision
        .statuses()
        .iter()
        .map(|status| PolicyStatus {
            reset: status.reset.saturating_sub(elapsed),
            ..*status
        })
        .collect();
    let outcome = match decision.outcome() {
        Outcome::Denied { policy, .. } => Outcome::Denied {
            policy,
            retry_after,
        },
        other => other,
    };
    Decision::new(outcome, statuses)
}

impl<S: Store> Store for DenyCache<S> {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let cache_key = (key.clone(), policies.fingerprint());
        if let Some(denial) = self.shared.denials.get(&cache_key) {
            let now = self.shared.clock.now();
            if now < denial.until && cost >= denial.cost {
                let retry_after = Duration::from_nanos(denial.until - now);
                let made = denial
                    .decision
                    .retry_after()
                    .unwrap_or_default()
                    .saturating_sub(retry_after);
                return DecideFuture::ready(Ok(aged(&denial.decision, made, retry_after)));
            }
        }
        match self.inner.decide(key, policies, cost).into_ready() {
            Ok(result) => {
                if let Ok(decision) = &result {
                    self.shared.record(cache_key, cost, decision);
                }
                DecideFuture::ready(result)
            }
            Err(pending) => {
                let shared = Arc::clone(&self.shared);
                DecideFuture::new(async move {
                    let result = pending.await;
                    if let Ok(decision) = &result {
                        shared.record(cache_key, cost, decision);
                    }
                    result
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::MemoryStore;
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
        let decide = |cost| {
            let mut future = cache.decide(&key, &policies, cost);
            let waker = std::task::Waker::noop();
            match std::pin::Pin::new(&mut future).poll(&mut std::task::Context::from_waker(waker)) {
                std::task::Poll::Ready(result) => result.unwrap(),
                std::task::Poll::Pending => unreachable!("the memory store answers at once"),
            }
        };
        use std::future::Future;
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
}
