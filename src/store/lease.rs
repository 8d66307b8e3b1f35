//! Leases (approximate, opt-in): a replica takes a block of units from the shared store in
//! one decision and spends it locally, without a round trip, until the block runs out or
//! its lease ends; what it did not spend goes back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::{Adjustment, DecideFuture, ResetFuture, Store, StoreError, StoreErrorKind};
use crate::decision::{Decision, Outcome, PolicyStatus, Receipt};
use crate::key::Key;
use crate::policy::PolicySet;

const SHARDS: usize = 16;

/// A store that takes units from `S` in blocks (leases) and spends them locally: most
/// decisions cost no round trip to the shared store. Opt-in, and approximate:
///
/// - **Over-admission is bounded** by `replicas × units`: a lease is debited from the
///   shared state before any of it is spent, so within one window (or one bucket's worth)
///   nothing is admitted beyond the limit; only units leased just before a window ends and
///   spent after it count in the old window. The lease's `ttl` bounds how long that can
///   last.
/// - **Under-admission**: units one replica holds are not there for the others until they
///   are spent or go back (when the lease ends, through [`Store::adjust`], exactly as far
///   as the shared state still holds them). When a whole lease no longer fits, the request
///   is decided on its own, exactly, so the last units of a quota are not lost to leases.
/// - Headers show the shared state plus what this replica still holds.
///
/// Sets with an in-flight limit, a shadow policy or a penalty are never leased: they go to
/// `S` request by request. So do requests that cost 0 (a peek) and adjustments.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::store::{Leased, RedisStore};
/// use tollgate::{Policy, Rate, RateLimitLayer};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let redis = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// // Blocks of 20 units, given back after 1 s at most: with 3 replicas, at most 60 units
/// // beyond the limit around a window's end.
/// let store = Leased::new(redis, 20, Duration::from_secs(1))?;
/// let limiter = RateLimitLayer::new(store)
///     .policy(Policy::fixed_window("api", 10_000, Duration::from_secs(60))?);
/// # Ok(()) }
/// ```
pub struct Leased<S> {
    inner: Arc<S>,
    units: u64,
    ttl: Duration,
    leases: Arc<Leases>,
}

impl<S> Clone for Leased<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            units: self.units,
            ttl: self.ttl,
            leases: Arc::clone(&self.leases),
        }
    }
}

impl<S> std::fmt::Debug for Leased<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leased")
            .field("units", &self.units)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

type Id = (Key, u64);

/// Every identity's open leases, in shards.
struct Leases {
    shards: Box<[Mutex<HashMap<Id, Open>>]>,
    next_id: AtomicU64,
    /// Decisions sent to the shared store (leases, and requests decided on their own).
    calls: AtomicU64,
}

/// One identity's leases, and whether one is being taken (then the others decide on
/// their own rather than take more: a replica holds one lease per identity at a time).
#[derive(Default)]
struct Open {
    leases: Vec<Lease>,
    taking: bool,
    /// Requests waiting for the lease being taken.
    waiting: Vec<oneshot::Sender<()>>,
    /// A lease was refused: until then, requests are decided one by one.
    refused_until: Option<Instant>,
}

/// One block of units taken from the shared store.
struct Lease {
    id: u64,
    left: u64,
    taken: u64,
    receipt: Receipt,
    ends: Instant,
    /// The shared state right after the lease was taken.
    statuses: SmallVec<[PolicyStatus; 2]>,
    policies: PolicySet,
}

impl Leases {
    fn shard(&self, id: &Id) -> std::sync::MutexGuard<'_, HashMap<Id, Open>> {
        use std::hash::BuildHasher;
        let hash = foldhash::fast::FixedState::default().hash_one(id);
        self.shards[(hash as usize) % SHARDS]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<S: Store> Leased<S> {
    /// Leases of `units` units, each given back (what is left of it) after `ttl` at most.
    /// `units` must be at least 1 and `ttl` at least 1 ms.
    pub fn new(inner: S, units: u64, ttl: Duration) -> Result<Self, StoreError> {
        if units == 0 {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "a lease must hold at least 1 unit",
            ));
        }
        if ttl < Duration::from_millis(1) {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("a lease must last at least 1 ms, not {ttl:?}"),
            ));
        }
        Ok(Self {
            inner: Arc::new(inner),
            units,
            ttl,
            leases: Arc::new(Leases {
                shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
                next_id: AtomicU64::new(1),
                calls: AtomicU64::new(0),
            }),
        })
    }

    /// The store the leases come from.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Decisions this store (and its clones) sent to the shared store so far: leases
    /// taken, and requests decided on their own.
    pub fn shared_calls(&self) -> u64 {
        self.leases.calls.load(Ordering::Relaxed)
    }

    /// Gives back what every open lease has left, now (at shutdown: the other replicas
    /// get the units at once instead of when the leases end).
    pub async fn release_all(&self) {
        let mut open = Vec::new();
        for shard in self.leases.shards.iter() {
            let mut shard = shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for ((key, _), leases) in shard.iter_mut() {
                open.extend(leases.leases.drain(..).map(|lease| (key.clone(), lease)));
            }
        }
        // Their timers find them gone: nothing is given back twice.
        for (key, lease) in open {
            if let Some(future) = give_back(&*self.inner, &key, &lease) {
                let _ = future.await;
            }
        }
    }

    fn leasable(policies: &PolicySet) -> bool {
        !policies.has_in_flight()
            && !policies.has_penalties()
            && !policies.iter().any(|policy| policy.is_shadow())
    }
}

/// What a request does next.
enum Step {
    /// A lease held its cost.
    Served(Decision),
    /// It takes a lease.
    Take,
    /// It waits for the lease another request is taking.
    Wait(oneshot::Receiver<()>),
    /// It is decided on its own, exactly (a lease was refused a moment ago).
    Alone,
}

impl Leases {
    /// Spends `cost` from an open lease, or says what to do instead.
    fn step(&self, id: &Id, cost: u64) -> Step {
        let now = Instant::now();
        let mut shard = self.shard(id);
        let open = shard.entry(id.clone()).or_default();
        // Ended leases are left to their timers, which give their units back.
        if let Some(index) = open
            .leases
            .iter()
            .position(|lease| lease.ends > now && lease.left >= cost)
        {
            open.leases[index].left -= cost;
            let held: u64 = open
                .leases
                .iter()
                .filter(|lease| lease.ends > now)
                .map(|lease| lease.left)
                .sum();
            let lease = &open.leases[index];
            return Step::Served(local_decision(&lease.statuses, held, lease.receipt));
        }
        if open.refused_until.is_some_and(|until| now < until) {
            return Step::Alone;
        }
        if open.taking {
            let (wake, woken) = oneshot::channel();
            open.waiting.push(wake);
            return Step::Wait(woken);
        }
        open.taking = true;
        Step::Take
    }
}

/// Ends a request's turn at taking a lease, however it ends (an answer, an error, the
/// request dropped): records the lease (or the refusal), and wakes the requests waiting
/// for it.
struct Taking<'a> {
    leases: &'a Leases,
    id: &'a Id,
    lease: Option<Lease>,
    refused_until: Option<Instant>,
}

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        let mut shard = self.leases.shard(self.id);
        let Some(open) = shard.get_mut(self.id) else {
            return;
        };
        open.taking = false;
        if let Some(lease) = self.lease.take() {
            open.leases.push(lease);
        }
        if self.refused_until.is_some() {
            open.refused_until = self.refused_until;
        }
        for wake in open.waiting.drain(..) {
            let _ = wake.send(());
        }
        // Nothing held or remembered: no entry left behind.
        if open.leases.is_empty() && open.refused_until.is_none() {
            shard.remove(self.id);
        }
    }
}

/// Removes `id`'s entry when it holds nothing: no lease, no request taking one, no
/// refusal still in force.
fn forget_if_idle(shard: &mut HashMap<Id, Open>, id: &Id) {
    if shard.get(id).is_some_and(|open| {
        open.leases.is_empty()
            && !open.taking
            && open
                .refused_until
                .is_none_or(|until| until <= Instant::now())
    }) {
        shard.remove(id);
    }
}

/// Takes a lease of `units` for `id` and spends `cost` of it; decides `cost` on its own
/// when the lease is refused.
async fn take<S: Store>(
    inner: &Arc<S>,
    leases: &Arc<Leases>,
    id: Id,
    policies: PolicySet,
    cost: u64,
    units: u64,
    ttl: Duration,
) -> Result<Decision, StoreError> {
    let mut taking = Taking {
        leases,
        id: &id,
        lease: None,
        refused_until: None,
    };
    leases.calls.fetch_add(1, Ordering::Relaxed);
    let taken = inner.decide(&id.0, &policies, units).await?;
    if !taken.is_allowed() {
        // For a while, requests are decided one by one: the last units of a quota are
        // not lost to leases that no longer fit.
        taking.refused_until = Some(Instant::now() + ttl);
        drop(taking);
        // The refusal is forgotten when it ends, with the entry if nothing else is in it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (leases, id) = (Arc::clone(leases), id.clone());
            runtime.spawn(async move {
                tokio::time::sleep(ttl).await;
                forget_if_idle(&mut leases.shard(&id), &id);
            });
        }
        if units == cost {
            return Ok(taken);
        }
        leases.calls.fetch_add(1, Ordering::Relaxed);
        return inner.decide(&id.0, &policies, cost).await;
    }
    let lease_id = leases.next_id.fetch_add(1, Ordering::Relaxed);
    let left = units - cost;
    taking.lease = Some(Lease {
        id: lease_id,
        left,
        taken: units,
        receipt: taken.receipt(),
        ends: Instant::now() + ttl,
        statuses: taken.statuses().iter().copied().collect(),
        policies,
    });
    drop(taking);
    // When the lease ends, what is left of it goes back.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let (inner, leases) = (Arc::clone(inner), Arc::clone(leases));
        runtime.spawn(async move {
            tokio::time::sleep(ttl).await;
            let ended = {
                let mut shard = leases.shard(&id);
                let ended = shard.get_mut(&id).and_then(|open| {
                    let index = open.leases.iter().position(|lease| lease.id == lease_id)?;
                    Some(open.leases.swap_remove(index))
                });
                forget_if_idle(&mut shard, &id);
                ended
            };
            if let Some(future) = ended
                .as_ref()
                .and_then(|lease| give_back(&*inner, &id.0, lease))
            {
                let _ = future.await;
            }
        });
    }
    Ok(local_decision(taken.statuses(), left, taken.receipt()))
}

/// The decision of spending `cost` from leases whose shared state was `statuses`, with
/// `held` units still held here afterwards.
fn local_decision(statuses: &[PolicyStatus], held: u64, receipt: Receipt) -> Decision {
    let statuses = statuses
        .iter()
        .map(|status| PolicyStatus {
            remaining: status.remaining.saturating_add(held).min(status.limit),
            ..*status
        })
        .collect();
    Decision::with_statuses(
        Outcome::Allowed {
            delay: Duration::ZERO,
        },
        statuses,
    )
    .with_receipt(receipt)
}

/// Gives back what `lease` did not spend, as far as the shared state still holds it.
fn give_back<S: Store>(inner: &S, key: &Key, lease: &Lease) -> Option<DecideFuture> {
    (lease.left > 0).then(|| {
        inner.adjust(
            key,
            &lease.policies,
            &Adjustment::settle(lease.taken, lease.taken - lease.left, lease.receipt),
        )
    })
}

impl<S: Store> Store for Leased<S> {
    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        self.inner.validate(policies)
    }

    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if cost == 0 || !Self::leasable(policies) {
            self.leases.calls.fetch_add(1, Ordering::Relaxed);
            return self.inner.decide(key, policies, cost);
        }
        let id = (key.clone(), policies.serial());
        let first = self.leases.step(&id, cost);
        match first {
            Step::Served(decision) => return DecideFuture::ready(Ok(decision)),
            Step::Alone => {
                self.leases.calls.fetch_add(1, Ordering::Relaxed);
                return self.inner.decide(key, policies, cost);
            }
            Step::Wait(_) | Step::Take => {}
        }
        let (inner, leases, policies) = (
            Arc::clone(&self.inner),
            Arc::clone(&self.leases),
            policies.clone(),
        );
        let (units, ttl) = (self.units.max(cost), self.ttl);
        DecideFuture::new(async move {
            let mut step = first;
            loop {
                match step {
                    Step::Served(decision) => return Ok(decision),
                    Step::Alone => {
                        leases.calls.fetch_add(1, Ordering::Relaxed);
                        return inner.decide(&id.0, &policies, cost).await;
                    }
                    Step::Wait(woken) => {
                        // Woken when the lease being taken is there (or was refused).
                        let _ = woken.await;
                        step = leases.step(&id, cost);
                    }
                    Step::Take => {
                        return take(&inner, &leases, id, policies, cost, units, ttl).await;
                    }
                }
            }
        })
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        self.inner.adjust(key, policies, adjustment)
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        self.inner.peek(key, policies)
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        // The leases of a reset key are forgotten: their units are in the state the reset
        // clears.
        self.leases
            .shard(&(key.clone(), policies.serial()))
            .remove(&(key.clone(), policies.serial()));
        self.inner.reset(key, policies)
    }
}
