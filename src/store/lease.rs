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
///   spent after it count in the old window. The lease's `ttl`, counted from when the
///   take's answer arrives (a slow take adds its wait, up to a few seconds), bounds how
///   long that can last. Leases are taken per identity and set: an identity decided under `k` sets
///   that share a policy (`[daily, search]`, `[daily, upload]`) holds up to `k` leases
///   of it per replica, so the bound is `replicas × k × units`; and a set with a penalty
///   that shares the policy (never leased itself) sees those units as spent, and may
///   count a strike early.
/// - A reset or a `set_remaining` through any set forgets the open leases of every set
///   that shares a policy with it (their units were debited from the state it clears or
///   sets), and gives back what they did not spend under their other policies only (the
///   `hourly` of `[daily, hourly]`, reset through `[daily]`). When rests of the identity's leases are on their
///   way back, it is sent once they have landed (2 s at most), so that none lands after
///   it into the state it cleared or set; otherwise at once. (A lease taken and retired
///   while the reset itself is on its way can still send its rest behind it.) A lease
///   being taken when the reset goes through is dropped unspent: if its debit landed
///   after the reset, up to `units` stay spent until the window ends (strict: given back,
///   on Redis, which keeps no record of resets, it could refund into what others spent
///   after the reset). These are
///   this replica's leases: the other replicas spend theirs until they end (`ttl`) and
///   give their rests back into the state reset or set, so after a `set_remaining(0)` up
///   to `(replicas − 1) × units` may still be admitted within `ttl`.
/// - `peek` shows the shared store's state alone: the units this replica's leases hold
///   (open, or on their way back) count as spent there, while the fields of a request
///   served from a lease add them back, so `peek` may read below what a client was told
///   by those, plus what other replicas spent since.
/// - A grant gives back this replica's open leases' rests first, whole (the shared state
///   counts them as spent: held here on top of a grant that filled it, they passed the
///   quota). The other replicas' leases are theirs, as above.
/// - **Under-admission**: units one replica holds are not there for the others until they
///   are spent or go back when their lease ends (through [`Store::adjust`], as far as the
///   shared state still holds them). One lease is taken per identity at a time; a request
///   costlier than what the open lease has left gives that rest back as it takes a new
///   one (with `units` 20 and requests of 11, each lease's 9 go back at the next request;
///   a take refused before the rest is back is tried once more when it is):
///   one replica never holds more than one rest per identity, so no pile of rests
///   debited in one window is spent in the next. Lease a multiple of the usual cost.
///   When a lease no longer fits, requests are decided one by one, exactly, for a `ttl`,
///   so the last units of a quota are not lost to leases.
/// - A lease is taken by a task of its own: once the shared store has debited it, it is
///   recorded and given back in time even if the request that asked for it went away.
///   Requests for the identity wait for it (one round trip), then spend from it.
/// - A lease is never larger than the smallest quota of the set.
/// - Headers show the shared state when the lease was taken plus what this replica still
///   holds: other replicas' spending since then is not in them.
/// - Every identity seen costs one lease decision (and a give-back if it is not spent):
///   leases pay off for identities that come back, not for one-off ones. At most
///   [`max_identities`](Leased::max_identities) identities (100,000 by default) hold
///   leases at once; past it, new ones are decided one by one.
///
/// Sets with an in-flight limit, a shaping leaky bucket (a lease would drop its delays), a
/// shadow policy or a penalty are never leased: they go to `S` request by request. So do
/// requests that cost 0 (a peek) and adjustments.
///
/// Over an in-process store standing in for the shared one: a hundred decisions take
/// five leases of 20 units, five calls to the shared store, which has debited the 100
/// units:
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::store::Leased;
/// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let shared = MemoryStore::builder().clock(ManualClock::new()).build(); // Redis, say
/// let store = Leased::new(shared.clone(), 20, Duration::from_secs(60))?;
/// let minute = Duration::from_secs(60);
/// let policies = PolicySet::from(Policy::fixed_window("api", 10_000, minute)?);
/// let key = Key::new("tenant-1");
/// for _ in 0..100 {
///     assert!(store.decide(&key, &policies, 1).await?.is_allowed());
/// }
/// assert_eq!(store.shared_calls(), 5);
/// assert_eq!(store.inner().peek(&key, &policies).await?.statuses()[0].remaining, 9_900);
/// # Ok(()) }
/// ```
///
/// Over Redis (not run here: it needs a server):
///
/// ```no_run
/// # #[cfg(feature = "redis")]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tollgate::store::{Leased, RedisStore};
/// use tollgate::{Policy, RateLimitLayer};
///
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

/// How many identities a [`Leased`] store holds leases for at most, unless told otherwise
/// ([`Leased::max_identities`]).
pub const DEFAULT_MAX_LEASED_IDENTITIES: usize = 100_000;

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

/// An identity and the policies its leases were taken for: by the policies' fingerprint,
/// not the set's serial, so that a set built again from the same policies (a
/// configuration reload) spends the leases already held. (A leasable set has only plain
/// policies: no shadow, penalty or in-flight limit, whose state the ids would not name.)
type Id = (Key, u64);

/// Every identity's open leases, in shards (an identity's sets all in one, so that a reset
/// or `set_remaining` through one set finds the leases of the others it clears).
struct Leases {
    shards: Box<[Mutex<Shard>]>,
    /// The identities one shard holds at most: a new one past it is decided on its own.
    per_shard: std::sync::atomic::AtomicUsize,
    /// The bound was met (said once, at warn level).
    said_full: std::sync::atomic::AtomicBool,
    next_id: AtomicU64,
    /// Decisions sent to the shared store (leases, and requests decided on their own).
    calls: AtomicU64,
}

/// The identities of one shard, each with its sets' leases.
#[derive(Default)]
struct Shard(HashMap<Key, Identity>);

/// One identity's leases, by set (by the set's fingerprint; an identity is most often
/// decided under one set), and the give-backs of its leases on their way.
#[derive(Default)]
struct Identity {
    sets: SmallVec<[(u64, Open); 1]>,
    /// Rests of leases no longer open, sent (or about to be) to the shared store and not
    /// yet landed: a reset waits for them, else one landing after it gives its units back
    /// into the fresh state.
    giving_back: usize,
    /// Resets waiting for `giving_back` to come to 0.
    drained: Vec<oneshot::Sender<()>>,
}

/// One rest of a lease counted as on its way back (by [`Shard::giving_back`]) until this
/// is dropped: when its give-back has landed or failed, or was dropped unsent (a task cut
/// short, a runtime shut down), so the count always comes back to 0. Never dropped while
/// the shard is locked (dropping it locks it).
struct OnItsWay {
    leases: Arc<Leases>,
    key: Key,
}

impl OnItsWay {
    /// The guard of one rest of `key`'s leases already counted.
    fn one(leases: &Arc<Leases>, key: &Key) -> Self {
        Self {
            leases: Arc::clone(leases),
            key: key.clone(),
        }
    }

    /// `count` guards for rests of `key`'s leases already counted.
    fn each(leases: &Arc<Leases>, key: &Key, count: usize) -> Vec<Self> {
        (0..count).map(|_| Self::one(leases, key)).collect()
    }
}

impl Drop for OnItsWay {
    fn drop(&mut self) {
        self.leases.given_back(&self.key);
    }
}

impl Shard {
    fn get_mut(&mut self, id: &Id) -> Option<&mut Open> {
        let identity = self.0.get_mut(&id.0)?;
        identity
            .sets
            .iter_mut()
            .find(|(fingerprint, _)| *fingerprint == id.1)
            .map(|(_, open)| open)
    }

    /// `id`'s leases, made empty (for `policies`) when there are none.
    fn open(&mut self, id: &Id, policies: &PolicySet) -> &mut Open {
        let sets = &mut self.0.entry(id.0.clone()).or_default().sets;
        let index = match sets
            .iter()
            .position(|(fingerprint, _)| *fingerprint == id.1)
        {
            Some(index) => index,
            None => {
                sets.push((id.1, Open::new(policies.clone())));
                sets.len() - 1
            }
        };
        &mut sets[index].1
    }

    /// Every set's leases of `key`.
    fn sets_of(&mut self, key: &Key) -> impl Iterator<Item = &mut Open> {
        self.0
            .get_mut(key)
            .into_iter()
            .flat_map(|identity| identity.sets.iter_mut().map(|(_, open)| open))
    }

    /// `count` more rests of `key`'s leases are on their way back.
    fn add_giving_back(&mut self, key: &Key, count: usize) {
        if count > 0 {
            self.0.entry(key.clone()).or_default().giving_back += count;
        }
    }

    /// Removes the leases of `key`'s sets that hold nothing: no lease, no request taking
    /// one, no refusal still in force; and `key` when none is left and nothing of it is
    /// on its way back.
    fn forget_idle(&mut self, key: &Key) {
        let now = Instant::now();
        if let Some(identity) = self.0.get_mut(key) {
            identity.sets.retain(|(_, open)| !open.idle(now));
            if identity.sets.is_empty() && identity.giving_back == 0 {
                self.0.remove(key);
            }
        }
    }
}

/// One identity's leases under one set, and whether one is being taken (then the others
/// decide on their own rather than take more: a replica takes one lease per identity at
/// a time).
struct Open {
    /// The set they are taken for (its state is what a reset or `set_remaining` through
    /// any set sharing a policy with it clears).
    policies: PolicySet,
    leases: Vec<Lease>,
    taking: bool,
    /// Requests waiting for the lease being taken.
    waiting: Vec<oneshot::Sender<()>>,
    /// A lease was refused: until then, requests are decided one by one.
    refused_until: Option<Instant>,
    /// The identity was reset while the lease was being taken: that lease's debit was
    /// cleared (or lands in the fresh state), so it is not recorded.
    reset_while_taking: bool,
    /// A grant was made while the lease was being taken: its debit landed before or after
    /// the grant, so the lease is given back whole as it comes, not recorded (right in
    /// either order: both only add units, each capped at full).
    granted_while_taking: bool,
    /// Such leases, come, for their takes to give back (counted as on their way back
    /// from when they come).
    came_after_a_grant: Vec<Lease>,
}

impl Open {
    /// What the leases that `counted` picks (live ones, of a set) still hold here.
    fn held(&self, counted: impl Fn(&Lease) -> bool) -> u64 {
        self.leases
            .iter()
            .filter(|lease| counted(lease))
            .map(|lease| lease.left)
            .sum()
    }

    fn new(policies: PolicySet) -> Self {
        Self {
            policies,
            leases: Vec::new(),
            taking: false,
            waiting: Vec::new(),
            refused_until: None,
            reset_while_taking: false,
            granted_while_taking: false,
            came_after_a_grant: Vec::new(),
        }
    }

    /// True when it holds nothing: no lease, no request taking one, no refusal still in
    /// force.
    fn idle(&self, now: Instant) -> bool {
        self.leases.is_empty()
            && !self.taking
            && self.came_after_a_grant.is_empty()
            && self.refused_until.is_none_or(|until| until <= now)
    }
}

/// One block of units taken from the shared store.
struct Lease {
    id: u64,
    left: u64,
    taken: u64,
    receipt: Receipt,
    ends: Instant,
    /// When the lease was taken: its statuses' times count down from there.
    taken_at: Instant,
    /// The shared state right after the lease was taken.
    statuses: SmallVec<[PolicyStatus; 2]>,
    policies: PolicySet,
    /// The request that started its take was answered from it: that answer is the
    /// store's own (it just granted the lease); the others come from this replica's
    /// cache.
    told: bool,
    /// Dropped with the lease (spent, retired, given back, dropped by a reset): its
    /// timer, waiting to give back what is left at `ends`, then ends at once rather than
    /// holding its task (the store, the set) to the end of `ttl`.
    _timer: oneshot::Sender<()>,
}

impl Lease {
    /// The lease serves `policies`, however they are spelt (a fingerprint only says so
    /// but for a collision of ids, which past the id registry's bound are hashes).
    fn serves(&self, policies: &PolicySet) -> bool {
        self.policies.same_as(policies)
            || (self.policies.len() == policies.len()
                && self
                    .policies
                    .iter()
                    .zip(policies.iter())
                    .all(|(held, asked)| held.decides_as(asked)))
    }
}

impl Leases {
    fn shard(&self, key: &Key) -> std::sync::MutexGuard<'_, Shard> {
        use std::hash::BuildHasher;
        let hash = foldhash::fast::FixedState::default().hash_one(key);
        self.shards[(hash as usize) % SHARDS]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<S: Store> Leased<S> {
    /// Leases of `units` units, each given back (what is left of it) after `ttl` at most.
    /// `units` must be at least 1, and `ttl` at least 1 ms and at most
    /// [`MAX_PERIOD`](crate::policy::MAX_PERIOD) (a lease never ends only where its
    /// units are never given back); `inner` must take units back
    /// ([`Store::can_adjust`]), or nothing a lease leaves unspent could go back.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::MemoryStore;
    /// use tollgate::store::Leased;
    ///
    /// let second = Duration::from_secs(1);
    /// assert!(Leased::new(MemoryStore::new(), 20, second).is_ok());
    /// assert!(Leased::new(MemoryStore::new(), 0, second).is_err()); // no unit
    /// assert!(Leased::new(MemoryStore::new(), 20, Duration::from_micros(500)).is_err());
    /// assert!(Leased::new(MemoryStore::new(), 20, Duration::MAX).is_err()); // never ends
    /// ```
    pub fn new(inner: S, units: u64, ttl: Duration) -> Result<Self, StoreError> {
        if !inner.can_adjust() {
            return Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "leases need a store that takes units back (`Store::can_adjust`): what a \
                 lease does not spend goes back to it, and this store would refuse it",
            ));
        }
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
        if ttl > crate::policy::MAX_PERIOD {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "a lease must last at most {:?} (10 years), not {ttl:?}: what it does \
                     not spend goes back when it ends",
                    crate::policy::MAX_PERIOD
                ),
            ));
        }
        Ok(Self {
            inner: Arc::new(inner),
            units,
            ttl,
            leases: Arc::new(Leases {
                shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
                per_shard: DEFAULT_MAX_LEASED_IDENTITIES.div_ceil(SHARDS).into(),
                said_full: false.into(),
                next_id: AtomicU64::new(1),
                calls: AtomicU64::new(0),
            }),
        })
    }

    /// At most `identities` identities hold leases (or a refusal) at a time (100,000 by
    /// default; at least 16): past it, a new identity's requests are decided one by one
    /// by the shared store, exactly, until identities held leave (their leases end).
    /// Each identity held keeps its leases and a task until its `ttl` ends, so a flood
    /// of one-off identities (rotating addresses, made-up keys) cannot hold memory
    /// without end. The bound is kept in each of 16 shards (a sixteenth each, rounded
    /// up), so one may fill a little before the total does. Meeting it is said once, at
    /// warn level. Clones share the bound.
    ///
    /// Bounded to 16 identities (one a shard), the first identity of 200 one-off ones
    /// takes a lease of 20 units, and the last is decided alone, spending its 1:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::store::Leased;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let shared = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let store = Leased::new(shared.clone(), 20, Duration::from_secs(60))?.max_identities(16);
    /// let minute = Duration::from_secs(60);
    /// let policies = PolicySet::from(Policy::fixed_window("api", 100, minute)?);
    /// for n in 0..200 {
    ///     let key = Key::new(format!("visitor-{n}"));
    ///     assert!(store.decide(&key, &policies, 1).await?.is_allowed());
    /// }
    /// let left = |key: &str| shared.check(key, &policies, 0).statuses()[0].remaining;
    /// assert_eq!(left("visitor-0"), 80); // leased
    /// assert_eq!(left("visitor-199"), 99); // decided alone
    /// # Ok(()) }
    /// ```
    pub fn max_identities(self, identities: usize) -> Self {
        // The clones share it, as they share the leases.
        self.leases
            .per_shard
            .store(identities.div_ceil(SHARDS).max(1), Ordering::Relaxed);
        self
    }

    /// The store the leases come from.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Decisions this store (and its clones) sent to the shared store so far: leases
    /// taken, and requests decided on their own.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::store::Leased;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = Leased::new(MemoryStore::new(), 10, Duration::from_secs(60))?;
    /// let clone = store.clone();
    /// let hour = Duration::from_secs(3600);
    /// let policies = PolicySet::from(Policy::fixed_window("api", 1_000, hour)?);
    /// let key = Key::new("tenant-1");
    /// store.decide(&key, &policies, 1).await?; // takes a lease of 10
    /// clone.decide(&key, &policies, 1).await?; // spends from it
    /// assert_eq!(clone.shared_calls(), 1);
    /// store.decide(&key, &policies, 0).await?; // costs nothing: decided on its own
    /// assert_eq!(store.shared_calls(), 2);
    /// # Ok(()) }
    /// ```
    pub fn shared_calls(&self) -> u64 {
        self.leases.calls.load(Ordering::Relaxed)
    }

    /// Gives back what every open lease has left, now (at shutdown: the other replicas
    /// get the units at once instead of when the leases end).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::store::Leased;
    /// use tollgate::{Key, MemoryStore, Policy, PolicySet, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let shared = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let store = Leased::new(shared.clone(), 20, Duration::from_secs(60))?;
    /// let minute = Duration::from_secs(60);
    /// let policies = PolicySet::from(Policy::fixed_window("api", 1_000, minute)?);
    /// let key = Key::new("tenant-1");
    /// for _ in 0..5 {
    ///     store.decide(&key, &policies, 1).await?;
    /// }
    /// let left = || shared.check("tenant-1", &policies, 0).statuses()[0].remaining;
    /// assert_eq!(left(), 980); // a lease of 20 taken, 5 of it spent
    /// store.release_all().await;
    /// assert_eq!(left(), 995); // the other 15 are back
    /// # Ok(()) }
    /// ```
    pub async fn release_all(&self) {
        let mut open = Vec::new();
        for shard in self.leases.shards.iter() {
            let mut shard = shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for (key, identity) in shard.0.iter_mut() {
                for (_, leases) in identity.sets.iter_mut() {
                    // Counted as on their way back until each has landed, or this is cut
                    // short (the guards are dropped once the shard is unlocked).
                    for lease in leases.leases.drain(..).filter(|lease| lease.left > 0) {
                        identity.giving_back += 1;
                        open.push((key.clone(), lease, OnItsWay::one(&self.leases, key)));
                    }
                }
            }
        }
        // Their timers find them gone: nothing is given back twice.
        for (key, lease, on_its_way) in open {
            if let Some(future) = give_back(&*self.inner, &key, &lease) {
                given_back(future).await;
            }
            drop(on_its_way);
        }
    }

    /// Starts taking a lease for `id` (this request's turn, marked by [`Leases::step`]):
    /// a task of its own takes it, so once Redis has debited it, it is recorded (and
    /// given back in time) whatever happens to this request, which waits for it like any
    /// other.
    fn begin_take(&self, id: &Id, policies: &PolicySet, cost: u64, retired: Vec<Lease>) -> Step {
        // `step` counted the retired rests as on their way back: so they are until these
        // are dropped, however the take ends.
        let on_their_way = OnItsWay::each(&self.leases, &id.0, retired.len());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let woken = self.leases.wait(id);
                // The turn ends (and wakes the waiting) however the task ends, even if it
                // never runs.
                let turn = Turn {
                    leases: Arc::clone(&self.leases),
                    id: id.clone(),
                    lease: None,
                    alone_until: None,
                };
                runtime.spawn(take(
                    Arc::clone(&self.inner),
                    turn,
                    retired.into_iter().zip(on_their_way).collect(),
                    policies.clone(),
                    self.lease_units(policies, cost),
                    self.ttl,
                ));
                Step::Wait(woken)
            }
            Err(_) => {
                // Nothing can give their rests back: the retired leases stay open (and are
                // not on their way back: the guards go once the shard is unlocked).
                if let Some(open) = self.leases.shard(&id.0).get_mut(id) {
                    open.leases.extend(retired);
                }
                drop(on_their_way);
                self.leases.abandon(id);
                Step::Alone
            }
        }
    }

    /// Sends what `rests` (from [`Leases::forget_cleared`], counted as on their way back)
    /// did not spend, at once, under the policies the change did not clear: beside the
    /// change (the give-back skips every policy it clears), in a task of its own where the
    /// store does I/O, so that a concurrent change of the other policies waits for it.
    fn send_rests(leases: &Arc<Leases>, inner: &Arc<S>, key: &Key, rests: Vec<Lease>) {
        let on_their_way = OnItsWay::each(leases, key, rests.len());
        for (lease, on_its_way) in rests.into_iter().zip(on_their_way) {
            send_back(&**inner, key, &lease, on_its_way);
        }
    }

    /// A change through `policies` that clears (a reset) or sets (`set_remaining`) the
    /// state of `key`, sent by `send`. The open leases of every set sharing a policy with
    /// it are forgotten: their units are in that state. A lease being taken keeps its
    /// turn (one at a time still holds), but is not spent when it comes. Done when the
    /// change is made and again when it has landed: a lease taken meanwhile may have been
    /// debited before it. The forgotten leases' rests under their other policies go back
    /// at once, beside it (they skip what it clears). The change is sent now, unless rests
    /// are on their way back: then once they have landed (one landing after it would give
    /// its units back into the state it cleared or set), forgetting again the leases
    /// taken meanwhile.
    ///
    /// A grant (`giving`) gives units back to that state instead: the open leases' rests
    /// go back whole, as when a lease ends, before it and again once it has landed (the
    /// state counts them as spent; held here on top of a grant that filled it, they
    /// passed the quota).
    fn clearing<T, F>(
        &self,
        key: &Key,
        policies: &PolicySet,
        giving: bool,
        send: impl Fn(&S, &Key, &PolicySet) -> F + Send + 'static,
    ) -> impl Future<Output = T> + Send + 'static
    where
        F: Future<Output = T> + Send + 'static,
    {
        let waits = self.leases.giving_back(key);
        let rests = self.leases.forget_cleared(key, policies, giving);
        let (leases, inner) = (Arc::clone(&self.leases), Arc::clone(&self.inner));
        Self::send_rests(&leases, &inner, key, rests);
        let (key, set) = (key.clone(), policies.clone());
        let now = (!waits).then(|| send(&inner, &key, &set));
        async move {
            let landed = match now {
                Some(sent) => sent.await,
                None => {
                    leases.until_given_back(&key).await;
                    let rests = leases.forget_cleared(&key, &set, giving);
                    Self::send_rests(&leases, &inner, &key, rests);
                    send(&inner, &key, &set).await
                }
            };
            let rests = leases.forget_cleared(&key, &set, giving);
            Self::send_rests(&leases, &inner, &key, rests);
            landed
        }
    }

    /// A settle that charges more than was reserved: once it has landed, a state it left
    /// with nothing (owing, or spent to the last unit) is not spent on here either. The
    /// open leases of every set sharing a policy with it go back whole, as when a lease
    /// ends, towards what is owed (a lease being taken goes back whole when it comes),
    /// and the identity's next requests meet the state, which makes them wait.
    fn charging(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        let charged = self.inner.adjust(key, policies, adjustment);
        let (leases, inner) = (Arc::clone(&self.leases), Arc::clone(&self.inner));
        let (key, set) = (key.clone(), policies.clone());
        DecideFuture::new(async move {
            let answer = charged.await;
            if let Ok(decision) = &answer
                && decision
                    .statuses()
                    .iter()
                    .any(|status| status.remaining == 0)
            {
                let rests = leases.forget_cleared(&key, &set, true);
                Self::send_rests(&leases, &inner, &key, rests);
            }
            answer
        })
    }

    fn leasable(policies: &PolicySet) -> bool {
        // A set made from one with penalties (a waiter's, a shadow layer's) is not leased
        // either: a lease would take units the penalised set's requests then miss.
        !policies.has_in_flight()
            && !policies.has_penalties()
            && !policies.penalties_left_out()
            && !policies.iter().any(|policy| {
                policy.is_shadow()
                    || matches!(policy.params(), crate::algorithm::Params::LeakyShape { .. })
            })
    }

    /// The lease for a request of `cost` under `policies`: `units`, but never more than
    /// the smallest quota of the set (a lease above it could never be granted).
    fn lease_units(&self, policies: &PolicySet, cost: u64) -> u64 {
        let smallest = policies
            .iter()
            .map(|policy| policy.limit())
            .min()
            .unwrap_or(u64::MAX);
        self.units.min(smallest).max(cost)
    }
}

/// What a request does next.
enum Step {
    /// A lease held its cost.
    Served(Decision),
    /// It takes a lease, first giving back what the open ones it retires have left.
    Take(Vec<Lease>),
    /// It waits for the lease another request is taking.
    Wait(oneshot::Receiver<()>),
    /// It is decided on its own, exactly (a lease was refused a moment ago).
    Alone,
}

impl Leases {
    /// Spends `cost` from an open lease, or says what to do instead.
    /// `waited`: this request started the take of a lease and waited for it (the
    /// store's answer to it is this request's, and only then). `again`: it waited for a
    /// take already (its own or another's).
    fn step(&self, id: &Id, policies: &PolicySet, cost: u64, waited: bool, again: bool) -> Step {
        let now = Instant::now();
        let mut shard = self.shard(&id.0);
        // A new identity past the bound holds nothing here: decided on its own, exactly.
        if shard.0.len() >= self.per_shard.load(Ordering::Relaxed) && !shard.0.contains_key(&id.0) {
            drop(shard);
            self.full();
            return Step::Alone;
        }
        let open = shard.open(id, policies);
        // Ended leases are left to their timers, which give their units back. A lease
        // serves the policies it was taken for (`Lease::serves`).
        let of_these = |lease: &Lease| lease.serves(policies);
        if let Some(index) = open
            .leases
            .iter()
            .position(|lease| lease.ends > now && lease.left >= cost && of_these(lease))
        {
            open.leases[index].left -= cost;
            // The store's own answer only to the request that started the take and
            // waited for it (a lease that landed after that request gave up, the store
            // slow, is no sign the store answers in time).
            let cached = !waited || std::mem::replace(&mut open.leases[index].told, true);
            let held = open.held(|lease| lease.ends > now);
            let lease = &open.leases[index];
            let since = now.saturating_duration_since(lease.taken_at);
            return Step::Served(local_decision(lease, held, since, cached));
        }
        // Waited for a take, and those before it spent it (a burst larger than a lease):
        // decided on its own, one round trip, rather than wait for take after take (the
        // last of a burst of N waited N / units round trips, past any store timeout).
        if again || open.refused_until.is_some_and(|until| now < until) {
            // The take this request waited for may have forgotten the identity (its lease
            // dropped across a reset): what `open` made anew holds nothing, and goes.
            if again && open.idle(now) {
                shard.forget_idle(&id.0);
            }
            return Step::Alone;
        }
        if open.taking {
            let (wake, woken) = oneshot::channel();
            open.waiting.push(wake);
            return Step::Wait(woken);
        }
        open.taking = true;
        // The open leases' rests go back as a new lease is taken: kept, a rest per
        // costlier request piled up (leases of 20, requests of 11: 9 each), debited in
        // one window and spent in the next. One rest at a time keeps the bound.
        // A lease spent to its last unit goes now (its timer finds it gone, and has
        // nothing to give back): kept until then, a busy identity's would pile up.
        let (retired, kept): (Vec<Lease>, Vec<Lease>) = std::mem::take(&mut open.leases)
            .into_iter()
            .filter(|lease| lease.left > 0)
            .partition(|lease| lease.ends > now && of_these(lease));
        open.leases = kept;
        shard.add_giving_back(&id.0, retired.len());
        Step::Take(retired)
    }
}

impl Leases {
    /// Settles here what the open leases of `id` can: a refund of a request served from
    /// one of them (its `receipt`) goes back into that lease, which gives its rest back
    /// to the shared state when it ends, bounded with everything else it held (a refund
    /// sent there on its own was bounded on its own: the refunds of a lease's requests
    /// together gave back more than a replay of the lease would have); a charge past the
    /// reservation is spent from the open leases when they hold it all, as a request of
    /// that cost would be. `None`: the shared store settles it (the lease has ended, the
    /// request was decided there, or the leases hold too little of a charge).
    fn settle_here(
        &self,
        id: &Id,
        policies: &PolicySet,
        receipt: Receipt,
        reserved: u64,
        actual: u64,
    ) -> Option<Decision> {
        let now = Instant::now();
        let mut shard = self.shard(&id.0);
        let open = shard.get_mut(id)?;
        // Live, and of these policies: two sets share a fingerprint only by a collision
        // of ids (past the id registry's bound, hashes), as `step` checks too.
        let live = |lease: &Lease| lease.ends > now && lease.serves(policies);
        let index = if actual < reserved {
            let index = open
                .leases
                .iter()
                .position(|lease| live(lease) && lease.receipt == receipt)?;
            let lease = &mut open.leases[index];
            lease.left = lease
                .left
                .saturating_add(reserved - actual)
                .min(lease.taken);
            index
        } else {
            let mut extra = actual - reserved;
            if open.held(live) < extra {
                return None;
            }
            let mut last = 0;
            for (index, lease) in open.leases.iter_mut().enumerate() {
                if extra == 0 {
                    break;
                }
                if live(lease) && lease.left > 0 {
                    let spent = lease.left.min(extra);
                    lease.left -= spent;
                    extra -= spent;
                    last = index;
                }
            }
            last
        };
        let held = open.held(live);
        let lease = &open.leases[index];
        let since = now.saturating_duration_since(lease.taken_at);
        Some(local_decision(lease, held, since, true))
    }

    /// A new identity met the bound: said once, as its requests (and those of every new
    /// identity until leases end) now cost a round trip each.
    #[cold]
    fn full(&self) {
        let first = !self.said_full.load(Ordering::Relaxed)
            && !self.said_full.swap(true, Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        if first {
            tracing::warn!(
                target: "tollgate",
                "Leased holds leases for as many identities as max_identities allows: new \
                 identities are decided one by one by the shared store until leases end \
                 (raise Leased::max_identities if these are not a flood; said once)"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = first;
    }
}

/// How long requests are decided one by one after taking a lease failed (the store did
/// not answer): the failure mode answers them, each on its own, rather than all waiting.
const AFTER_AN_ERROR: Duration = Duration::from_millis(100);

/// The longest taking a lease may wait for the shared store.
const TAKE_DEADLINE: Duration = Duration::from_secs(2);

impl Leases {
    /// A wake-up for when the lease being taken for `id` is there (or was refused).
    fn wait(&self, id: &Id) -> oneshot::Receiver<()> {
        let (wake, woken) = oneshot::channel();
        if let Some(open) = self.shard(&id.0).get_mut(id) {
            open.waiting.push(wake);
        }
        woken
    }

    /// Ends a turn at taking a lease for `id`: records the lease (or that none is to be
    /// taken until `alone_until`), and wakes the requests waiting for it.
    fn finish(&self, id: &Id, lease: Option<Lease>, alone_until: Option<Instant>) {
        let mut shard = self.shard(&id.0);
        let Some(open) = shard.get_mut(id) else {
            return;
        };
        open.taking = false;
        // Taken across a reset: not spent here (its timer finds it gone and gives nothing
        // back; if its debit landed after the reset, those units wait out their window).
        // A refusal then spoke of the state before the reset: it is not kept either.
        let across_a_reset = std::mem::take(&mut open.reset_while_taking);
        let across_a_grant = std::mem::take(&mut open.granted_while_taking);
        let mut parked = false;
        if let Some(lease) = lease
            && !across_a_reset
        {
            if across_a_grant {
                // Counted as on its way back now, under the lock: a reset waits for it.
                open.came_after_a_grant.push(lease);
                parked = true;
            } else {
                open.leases.push(lease);
            }
        }
        // A refusal spoke of the state before a reset or a grant.
        if alone_until.is_some() && !across_a_reset && !across_a_grant {
            open.refused_until = alone_until;
        }
        for wake in open.waiting.drain(..) {
            let _ = wake.send(());
        }
        shard.add_giving_back(&id.0, usize::from(parked));
        shard.forget_idle(&id.0);
    }

    /// No lease will be taken after all (no runtime to take it on).
    fn abandon(&self, id: &Id) {
        self.finish(id, None, None);
    }

    /// One rest of `key`'s leases on its way back has landed (or failed): a reset waiting
    /// for the last of them goes on.
    fn given_back(&self, key: &Key) {
        let mut shard = self.shard(key);
        if let Some(identity) = shard.0.get_mut(key) {
            debug_assert!(identity.giving_back > 0, "a rest counted back twice");
            identity.giving_back = identity.giving_back.saturating_sub(1);
            if identity.giving_back == 0 {
                for drained in identity.drained.drain(..) {
                    let _ = drained.send(());
                }
            }
        }
        shard.forget_idle(key);
    }

    /// A wake-up for when every rest of `key`'s leases on its way back has landed; `None`
    /// when none is.
    fn drained(&self, key: &Key) -> Option<oneshot::Receiver<()>> {
        let mut shard = self.shard(key);
        let identity = shard.0.get_mut(key)?;
        (identity.giving_back > 0).then(|| {
            let (drained, woken) = oneshot::channel();
            identity.drained.push(drained);
            woken
        })
    }

    /// Waits (at most [`TAKE_DEADLINE`]) for the rests of `key`'s leases on their way
    /// back, before a reset or a `set_remaining` is sent: one landing after it would give
    /// its units back into the state it clears or sets.
    async fn until_given_back(&self, key: &Key) {
        if tokio::runtime::Handle::try_current().is_ok()
            && let Some(woken) = self.drained(key)
        {
            let _ = tokio::time::timeout(TAKE_DEADLINE, woken).await;
        }
    }

    /// True when rests of `key`'s leases are on their way back.
    fn giving_back(&self, key: &Key) -> bool {
        self.shard(key)
            .0
            .get(key)
            .is_some_and(|identity| identity.giving_back > 0)
    }
}

/// Ends a turn at taking a lease however the task ends (an answer, an error, a panic, the
/// runtime shutting down): the waiting requests are always woken.
struct Turn {
    leases: Arc<Leases>,
    id: Id,
    lease: Option<Lease>,
    alone_until: Option<Instant>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        // Ended without a word (a panic, a shutdown): decide one by one for a moment.
        let alone_until = match (&self.lease, self.alone_until) {
            (None, None) => Some(Instant::now() + AFTER_AN_ERROR),
            (_, until) => until,
        };
        self.leases.finish(&self.id, self.lease.take(), alone_until);
    }
}

/// Takes a lease of `units` for `id` (a task of its own), records it, and gives back what
/// is left of it when it ends.
async fn take<S: Store>(
    inner: Arc<S>,
    mut turn: Turn,
    retired: Vec<(Lease, OnItsWay)>,
    policies: PolicySet,
    units: u64,
    ttl: Duration,
) {
    let (leases, id) = (Arc::clone(&turn.leases), turn.id.clone());
    // The retired leases' rests go back beside the take, not before it: the requests
    // waiting for the lease wait one round trip, not two. (Their timers find them gone:
    // nothing is given back twice.)
    // Each was counted as on its way back when it was retired; landed (or failed), it
    // is not, so a reset waiting for it goes on.
    let mut going_back: Vec<_> = retired
        .into_iter()
        .filter_map(|(lease, on_its_way)| send_back(&*inner, &id.0, &lease, on_its_way))
        .collect();
    // Detached from any request, so bounded here: a store that never answers must not
    // keep the identity waiting.
    let take_once = || {
        leases.calls.fetch_add(1, Ordering::Relaxed);
        super::within(
            TAKE_DEADLINE,
            "lease",
            inner.decide(&id.0, &policies, units),
        )
    };
    let mut decided = take_once().await;
    if decided.as_ref().is_ok_and(|taken| !taken.is_allowed()) && !going_back.is_empty() {
        // Refused, perhaps only because a rest going back beside it was not back yet
        // (another connection of a pool may run first): once it is, once more.
        for back in going_back.drain(..) {
            let _ = tokio::time::timeout(TAKE_DEADLINE, back).await;
        }
        decided = take_once().await;
    }
    let alone_for = match decided {
        Ok(taken) if taken.is_allowed() => Ok(taken),
        // Refused: for a while, requests are decided one by one, so the last units of a
        // quota are not lost to leases that no longer fit.
        Ok(_) => Err(ttl),
        // The store failed: each request meets the failure on its own for a moment.
        // Counted and logged here: a take that timed out may have been debited, and no
        // request meets this error.
        Err(error) => {
            super::unmet(
                &error,
                "taking a lease failed (one that timed out may have been debited); \
                 requests are decided one by one for a moment",
            );
            Err(AFTER_AN_ERROR)
        }
    };
    let taken = match alone_for {
        Ok(taken) => taken,
        Err(pause) => {
            turn.alone_until = Some(Instant::now() + pause);
            drop(turn);
            // Forgotten when the pause ends, with the entry if nothing else is in it.
            tokio::time::sleep(pause).await;
            leases.shard(&id.0).forget_idle(&id.0);
            return;
        }
    };
    let lease_id = leases.next_id.fetch_add(1, Ordering::Relaxed);
    let taken_at = Instant::now();
    let (timer, lease_gone) = oneshot::channel();
    turn.lease = Some(Lease {
        id: lease_id,
        left: units,
        taken: units,
        receipt: taken.receipt(),
        ends: taken_at + ttl,
        taken_at,
        statuses: taken.statuses().iter().copied().collect(),
        policies,
        told: false,
        _timer: timer,
    });
    drop(turn);
    // Come across a grant: given back whole now (see `Open::granted_while_taking`),
    // with any other take's come so (each counted as on its way back when it came).
    let came = {
        let mut shard = leases.shard(&id.0);
        let came = shard
            .get_mut(&id)
            .map(|open| std::mem::take(&mut open.came_after_a_grant))
            .unwrap_or_default();
        shard.forget_idle(&id.0);
        came
    };
    if !came.is_empty() {
        // Ours among them (this take came across the grant): given back whole, it needs
        // no timer. Only another take's: that one goes back, and ours is timed as any.
        let ours = came.iter().any(|lease| lease.id == lease_id);
        Leased::send_rests(&leases, &inner, &id.0, came);
        if ours {
            return;
        }
    }
    // The rests sent beside the take went their own way: their handles are not kept.
    drop(going_back);
    // When the lease ends, what is left of it goes back; gone from the list before that
    // (its `_timer` dropped with it), there is nothing left here to give back.
    if tokio::time::timeout(ttl, lease_gone).await.is_ok() {
        return;
    }
    let ended = {
        let mut shard = leases.shard(&id.0);
        let ended = shard.get_mut(&id).and_then(|open| {
            let index = open.leases.iter().position(|lease| lease.id == lease_id)?;
            Some(open.leases.swap_remove(index))
        });
        let ended = ended.filter(|lease| lease.left > 0);
        shard.add_giving_back(&id.0, usize::from(ended.is_some()));
        shard.forget_idle(&id.0);
        ended
    };
    if let Some(lease) = ended {
        let on_its_way = OnItsWay::one(&leases, &id.0);
        if let Some(future) = give_back(&*inner, &id.0, &lease) {
            given_back(future).await;
        }
        drop(on_its_way);
    }
}

/// Sends what `lease` did not spend back to the shared store, counted as on its way back
/// until it has landed (`on_its_way`): at once for a store that answers at once (in
/// process), else in a task of its own, whose handle is returned (none without a runtime:
/// the rest is then dropped, and no longer counted).
fn send_back<S: Store>(
    inner: &S,
    key: &Key,
    lease: &Lease,
    on_its_way: OnItsWay,
) -> Option<tokio::task::JoinHandle<()>> {
    let future = give_back(inner, key, lease)?;
    let mut future = Box::pin(async move {
        given_back(future).await;
        drop(on_its_way);
    });
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if future.as_mut().poll(&mut cx).is_ready() {
        return None;
    }
    tokio::runtime::Handle::try_current()
        .ok()
        .map(|runtime| runtime.spawn(future))
}

/// The decision of spending from `lease`, `since` after it was taken, with `held` units
/// still held here afterwards: its shared state as taken, its times counted down since
/// (the instants they name stay put). Marked as answered from a local cache
/// (`cached`) but for the answer to the request that started the lease's take: the
/// shared store said nothing since, so it closes no circuit breaker and counts as no
/// probe's success. That first answer is the store's own, which just granted the lease:
/// it ends an outage (were it cached, only a refused lease would).
fn local_decision(lease: &Lease, held: u64, since: Duration, cached: bool) -> Decision {
    let statuses = lease
        .statuses
        .iter()
        .map(|status| PolicyStatus {
            remaining: status.remaining.saturating_add(held).min(status.limit),
            reset: status.reset.saturating_sub(since),
            effective_window: status.effective_window.saturating_sub(since),
            ..*status
        })
        .collect();
    let decision = Decision::with_statuses(
        Outcome::Allowed {
            delay: Duration::ZERO,
        },
        statuses,
    )
    .with_receipt(lease.receipt)
    // A refund that reaches the shared state (the lease has ended: a refund while it is
    // open goes back into it) is bounded as if the whole lease came back with it: by
    // the state before the take. Never more than a replay of the lease gives back (its
    // rest went back bounded by what the take left, and the rest of its units were
    // spent), at the cost of less where what the take left had room for more.
    .with_debit_left(
        lease
            .statuses
            .iter()
            .map(|status| {
                status
                    .remaining
                    .saturating_add(lease.taken)
                    .min(status.limit)
            })
            .collect(),
    );
    if cached {
        decision.from_cache()
    } else {
        decision
    }
}

/// Gives back what `lease` did not spend, as far as the shared state still holds it: with
/// what its take left of each policy, so a bucket or GCRA gets back what a replay
/// spending only the units used would hold.
fn give_back<S: Store>(inner: &S, key: &Key, lease: &Lease) -> Option<DecideFuture> {
    (lease.left > 0).then(|| {
        let settle = Adjustment::settle(lease.taken, lease.taken - lease.left, lease.receipt)
            .with_left(lease.statuses.iter().map(|status| status.remaining));
        inner.adjust(key, &lease.policies, &settle)
    })
}

/// Waits for a give-back: one that fails leaves its units out of the shared quota until
/// its window forgets them, and no request meets the error, so it is counted and logged
/// here.
async fn given_back(future: DecideFuture) {
    if let Err(error) = future.await {
        super::unmet(
            &error,
            "could not give back what a lease left; those units are out of the shared \
             quota until its window forgets them",
        );
    }
}

impl<S: Store> Store for Leased<S> {
    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        self.inner.validate(policies)
    }

    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        // A cost above a quota never fits: the store says so, and the identity's leases
        // are left as they are (retired for it, leasing stopped for a ttl).
        let never_fits = || policies.iter().any(|policy| cost > policy.limit());
        if cost == 0 || !Self::leasable(policies) || never_fits() {
            self.leases.calls.fetch_add(1, Ordering::Relaxed);
            return self.inner.decide(key, policies, cost);
        }
        let id = (key.clone(), policies.fingerprint());
        let mut step = self.leases.step(&id, policies, cost, false, false);
        // This request started the take it waits for: the store's answer to it is this
        // request's own (a request that joined another's take, perhaps long after it
        // started, says nothing of how fast the store answers now).
        let mut took = false;
        if let Step::Take(retired) = step {
            took = true;
            step = self.begin_take(&id, policies, cost, retired);
        }
        match step {
            Step::Served(decision) => return DecideFuture::ready(Ok(decision)),
            Step::Alone => {
                self.leases.calls.fetch_add(1, Ordering::Relaxed);
                return self.inner.decide(key, policies, cost);
            }
            Step::Wait(_) | Step::Take(_) => {}
        }
        let (store, policies) = (self.clone(), policies.clone());
        DecideFuture::new(async move {
            loop {
                match step {
                    Step::Served(decision) => return Ok(decision),
                    Step::Alone => {
                        store.leases.calls.fetch_add(1, Ordering::Relaxed);
                        return store.inner.decide(&id.0, &policies, cost).await;
                    }
                    Step::Wait(woken) => {
                        // Woken when the lease being taken is there (or was refused).
                        let _ = woken.await;
                        step = store.leases.step(&id, &policies, cost, took, true);
                    }
                    Step::Take(retired) => {
                        took = true;
                        step = store.begin_take(&id, &policies, cost, retired);
                    }
                }
            }
        })
    }

    fn can_adjust(&self) -> bool {
        self.inner.can_adjust()
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        // Setting what is left sets the shared state: what open leases still hold was
        // debited before it, and is not spent after it. A grant fills it: what they hold
        // goes back first, so that it is not spent on top (see `clearing`).
        let giving = match adjustment.change() {
            super::Change::SetRemaining { .. } => false,
            super::Change::Grant { .. } => true,
            super::Change::Settle { reserved, actual } if actual != reserved => {
                // Only a set that is leased has its settles made here (a set with
                // penalties shares its fingerprint with the set without them, whose
                // leases are not its own), and only of a debit of every policy.
                let id = (key.clone(), policies.fingerprint());
                if Self::leasable(policies)
                    && adjustment.receipt().undebited() == 0
                    && let Some(settled) = self.leases.settle_here(
                        &id,
                        policies,
                        adjustment.receipt(),
                        reserved,
                        actual,
                    )
                {
                    return DecideFuture::ready(Ok(settled));
                }
                if actual > reserved {
                    return self.charging(key, policies, adjustment);
                }
                return self.inner.adjust(key, policies, adjustment);
            }
            _ => return self.inner.adjust(key, policies, adjustment),
        };
        let adjustment = adjustment.clone();
        DecideFuture::new(
            self.clearing(key, policies, giving, move |inner, key, set| {
                inner.adjust(key, set, &adjustment)
            }),
        )
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        self.inner.peek(key, policies)
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        Box::pin(self.clearing(key, policies, false, |inner, key, set| {
            inner.reset(key, set)
        }))
    }
}

impl Leases {
    /// Forgets the leases of `key` whose state a reset (or `set_remaining`) through
    /// `policies` clears: those of every set sharing a policy with it. A refusal of such a
    /// set spoke of the state before; a lease such a set is taking is not recorded when
    /// it comes (whole). What the open ones did not spend is not given back under the
    /// cleared policies (the state they were debited from is gone, or set), but it is
    /// under their others (`hourly` of `[daily, hourly]`, reset through `[daily]`): those
    /// leases are returned, each marked as not debited under the cleared policies, and
    /// counted as on their way back, for the caller to send at once. Before a grant
    /// (`giving`), every open lease's rest is returned whole, to go back as when a lease
    /// ends.
    #[must_use]
    fn forget_cleared(&self, key: &Key, policies: &PolicySet, giving: bool) -> Vec<Lease> {
        let clears = |held: &crate::policy::Policy| {
            policies
                .iter()
                .any(|cleared| held.id() == cleared.id() || held.decides_as(cleared))
        };
        let mut rests = Vec::new();
        let mut shard = self.shard(key);
        for open in shard.sets_of(key) {
            if !open.policies.iter().any(clears) {
                continue;
            }
            for mut lease in open.leases.drain(..) {
                if giving {
                    if lease.left > 0 {
                        rests.push(lease);
                    }
                    continue;
                }
                // The lease's policies the change clears, by bit; past the 64 a receipt
                // names one by one, or every one of them: nothing to give back.
                let mut cleared = 0u64;
                let mut named = true;
                for (index, held) in lease.policies.iter().enumerate() {
                    match (clears(held), index < 64) {
                        (true, true) => cleared |= 1 << index,
                        (true, false) => named = false,
                        (false, _) => {}
                    }
                }
                let kept = lease.policies.iter().any(|held| !clears(held));
                if lease.left > 0 && named && kept {
                    lease.receipt = lease
                        .receipt
                        .with_undebited(lease.receipt.undebited() | cleared);
                    rests.push(lease);
                }
            }
            open.refused_until = None;
            if giving {
                open.granted_while_taking |= open.taking;
            } else {
                open.reset_while_taking = open.taking;
            }
        }
        shard.add_giving_back(key, rests.len());
        shard.forget_idle(key);
        rests
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;
    use crate::clock::ManualClock;
    use crate::store::MemoryStore;
    use crate::store::held::Held;

    /// A store of 5-unit leases over a `Held` store letting `answers` answers and `resets`
    /// resets pass at first, and that store.
    fn leased(answers: usize, resets: usize) -> (Leased<Held>, Held) {
        let held = Held::new(&ManualClock::new(), answers, resets);
        (
            Leased::new(held.clone(), 5, Duration::from_secs(60)).unwrap(),
            held,
        )
    }

    /// Requests admitted of 30.
    async fn admitted(store: &Leased<Held>, key: &Key, policies: &PolicySet) -> u64 {
        let mut admitted = 0;
        for _ in 0..30 {
            admitted += u64::from(store.decide(key, policies, 1).await.unwrap().is_allowed());
        }
        admitted
    }

    /// A request of 1 started on `store` (10 an hour), once its take of 5 is debited on
    /// `inner`, whose answer the `Held` store holds until it has permits.
    async fn take_debited(
        store: &Leased<Held>,
        inner: &MemoryStore<ManualClock>,
        policies: &PolicySet,
        key: &Key,
    ) -> tokio::task::JoinHandle<Result<Decision, StoreError>> {
        let first = tokio::spawn(store.decide(key, policies, 1));
        for _ in 0..100 {
            if inner.check(key.as_str(), policies, 0).statuses()[0].remaining == 5 {
                break;
            }
            tokio::task::yield_now().await;
        }
        first
    }

    /// A store of 5-unit leases, the `Held` store under it, a limit of 10 an hour, key
    /// `k`, and a request of 1 whose take of 5 is debited and not yet answered.
    async fn a_take_debited() -> (
        Leased<Held>,
        Held,
        PolicySet,
        Key,
        tokio::task::JoinHandle<Result<Decision, StoreError>>,
    ) {
        let (store, held) = leased(0, 1_000);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        let key = Key::new("k");
        let first = take_debited(&store, &held.inner, &policies, &key).await;
        (store, held, policies, key, first)
    }

    /// A reset that comes while a lease is being taken clears the state that lease was
    /// debited from (or comes before the debit lands): recorded all the same, its units
    /// were spent here on top of a whole fresh quota. A limit of 10 admitted 15.
    #[tokio::test]
    async fn a_lease_taken_across_a_reset_is_not_spent() {
        // A request starts a take of 5: the store debits it now and answers later.
        let (store, held, policies, key, first) = a_take_debited().await;
        assert_eq!(
            held.inner.check("k", &policies, 0).statuses()[0].remaining,
            5
        );
        // Support resets the identity meanwhile: the store forgets the 5.
        store.reset(&key, &policies).await.unwrap();
        held.answers.add_permits(1_000);
        let first = u64::from(first.await.unwrap().unwrap().is_allowed());
        // The request that started the take, decided on its own once it was dropped,
        // leaves no empty entry behind (one that counted towards `max_identities` until
        // the identity came back, if ever).
        assert_eq!(identities_held(&store), 0);
        let admitted = first + admitted(&store, &key, &policies).await;
        assert_eq!(admitted, 10, "admitted under a limit of 10 after the reset");
    }

    /// A settle that charges past what was left leaves the identity owing: its next
    /// requests wait, here too. This replica's open leases go back whole (their units
    /// pay towards what is owed) rather than serve requests meanwhile: 18 more were
    /// served from the lease of the request that was charged.
    #[tokio::test]
    async fn a_charge_past_empty_stops_this_replicas_leases() {
        let clock = ManualClock::new();
        let inner = MemoryStore::builder().clock(clock.clone()).build();
        let store = Leased::new(inner.clone(), 20, Duration::from_secs(60)).unwrap();
        let policies =
            PolicySet::from(Policy::token_bucket("b", 100, crate::Rate::per_hour(100)).unwrap());
        let key = Key::new("k");
        let first = store.decide(&key, &policies, 1).await.unwrap();
        assert!(first.is_allowed());
        // The lease took 20 of 100; the request used 200.
        let charge = Adjustment::settle(1, 200, first.receipt()).with_left([80]);
        let charged = store.adjust(&key, &policies, &charge).await.unwrap();
        assert_eq!(charged.statuses()[0].remaining, 0);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let next = store.decide(&key, &policies, 1).await.unwrap();
        assert!(!next.is_allowed(), "{next:?}");
        // The charge owes at most a quota past what was left (80 - 180 = -100); the
        // lease's 19 went back towards it (-81): the next unit, one every 36 s, is the
        // 82nd to refill.
        let wait = next.retry_after().unwrap();
        assert_eq!(wait, Duration::from_secs(82 * 36), "{wait:?}");
    }

    /// A charge past the reservation that this replica's leases hold is spent from them,
    /// as a request of that cost would be: no call to the shared store, and leasing goes
    /// on (a post-paid cost sent each charge there, and a state it left at 0 gave the
    /// leases back, so the next take found too little and requests went there one by
    /// one).
    #[tokio::test]
    async fn a_charge_the_leases_hold_is_spent_from_them() {
        let inner = MemoryStore::builder().clock(ManualClock::new()).build();
        let store = Leased::new(inner.clone(), 10, Duration::from_secs(60)).unwrap();
        let policies = PolicySet::new([
            Policy::token_bucket("burst", 10, crate::Rate::per_hour(10)).unwrap(),
            Policy::token_bucket("daily", 10_000, crate::Rate::per_day(10_000)).unwrap(),
        ])
        .unwrap();
        let key = Key::new("k");
        let first = store.decide(&key, &policies, 1).await.unwrap();
        let charge = Adjustment::settle(1, 3, first.receipt());
        let charged = store.adjust(&key, &policies, &charge).await.unwrap();
        // The lease of 10 spent 3 of them.
        assert_eq!(charged.statuses()[0].remaining, 7);
        let mut admitted = 0;
        for _ in 0..7 {
            admitted += u64::from(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        }
        assert_eq!(admitted, 7);
        assert_eq!(store.shared_calls(), 1);
        assert_eq!(inner.check("k", &policies, 0).statuses()[0].remaining, 0);
    }

    /// A set with a penalty is never leased, though it shares its fingerprint (and rate
    /// state) with the set without it: a charge settled under it is the shared store's,
    /// not spent from the leases of the set without the penalty.
    #[tokio::test]
    async fn a_charge_under_a_set_that_is_not_leased_leaves_the_leases_alone() {
        let inner = MemoryStore::builder().clock(ManualClock::new()).build();
        let store = Leased::new(inner.clone(), 10, Duration::from_secs(60)).unwrap();
        let api = Policy::token_bucket("api", 100, crate::Rate::per_hour(100)).unwrap();
        let plain = PolicySet::from(api.clone());
        let penalty =
            crate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(600));
        let blocking = PolicySet::from(api.with_penalty(penalty).unwrap());
        let key = Key::new("k");
        assert!(store.decide(&key, &plain, 1).await.unwrap().is_allowed()); // a lease of 10
        let decided = store.decide(&key, &blocking, 1).await.unwrap(); // the store's
        let charge = Adjustment::settle(1, 3, decided.receipt());
        store.adjust(&key, &blocking, &charge).await.unwrap();
        // The lease still holds its 9: nine more requests, no second take.
        let calls = store.shared_calls();
        for _ in 0..9 {
            assert!(store.decide(&key, &plain, 1).await.unwrap().is_allowed());
        }
        assert_eq!(store.shared_calls(), calls);
        // The store charged it: 100 - 10 (lease) - 1 - 2.
        assert_eq!(inner.check("k", &plain, 0).statuses()[0].remaining, 87);
    }

    /// A take that finds another take's lease parked across a grant gives that one back
    /// and still arms its own lease's timer: returning at once (as if the parked lease
    /// were its own) left its lease without one, never retired, its rest never given
    /// back and the identity held for good.
    #[tokio::test(start_paused = true)]
    async fn a_take_that_finds_another_lease_parked_still_gives_its_own_back() {
        let (store, held, policies, key, first) = a_take_debited().await;
        // Another take's lease, parked across a grant and not yet sent back by it.
        {
            let id = (key.clone(), policies.fingerprint());
            let mut shard = store.leases.shard(&key);
            let now = Instant::now();
            shard.get_mut(&id).unwrap().came_after_a_grant.push(Lease {
                id: u64::MAX,
                left: 0,
                taken: 0,
                receipt: Receipt::default(),
                ends: now,
                taken_at: now,
                statuses: SmallVec::new(),
                policies: policies.clone(),
                told: false,
                _timer: oneshot::channel().0,
            });
            shard.add_giving_back(&key, 1);
        }
        held.answers.add_permits(1_000);
        assert!(first.await.unwrap().unwrap().is_allowed());
        // The lease of 5 served 1; when it ends, its 4 go back and nothing is held.
        tokio::time::sleep(Duration::from_secs(61)).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            held.inner.check("k", &policies, 0).statuses()[0].remaining,
            9
        );
        assert_eq!(identities_held(&store), 0);
    }

    /// A reset (or a level set) that comes before a take's debit lands: the take debits
    /// the fresh state, and its lease is dropped unspent (given back, on Redis, which
    /// keeps no record of resets, it would refund into what others spent after the
    /// reset). The documented cost: up to a lease's units stay spent until the window
    /// ends, never more admitted than the limit.
    #[tokio::test]
    async fn a_lease_whose_debit_lands_after_a_reset_costs_at_most_its_units() {
        for level_set in [false, true] {
            let clock = ManualClock::new();
            let held = Held::new(&clock, 0, 1_000);
            let store = Leased::new(held.clone(), 5, Duration::from_secs(60)).unwrap();
            let policies =
                PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
            let key = Key::new("k");
            // The request starts its take (the task is spawned, not yet run)...
            let first = store.decide(&key, &policies, 1);
            // ...and support resets the identity (or sets it to 10) before it runs.
            if level_set {
                store
                    .adjust(&key, &policies, &Adjustment::set_remaining(10))
                    .await
                    .unwrap();
            } else {
                store.reset(&key, &policies).await.unwrap();
            }
            clock.advance(Duration::from_millis(1));
            held.answers.add_permits(1_000);
            let first = u64::from(first.await.unwrap().is_allowed());
            let admitted = first + admitted(&store, &key, &policies).await;
            assert!(
                (5..=10).contains(&admitted),
                "level set: {level_set}: {admitted}"
            );
        }
    }

    /// Identities the store holds leases (or refusals) for, over every shard.
    fn identities_held<S>(store: &Leased<S>) -> usize {
        store
            .leases
            .shards
            .iter()
            .map(|shard| shard.lock().unwrap().0.len())
            .sum()
    }

    /// Every new identity took a lease and kept an entry (and a task) for `ttl`, with no
    /// bound: a flood of one-off identities (rotating addresses, made-up keys) held a
    /// lease each for a minute, memory without end. Past `max_identities`, a new identity
    /// is decided on its own, exactly, holding nothing here.
    #[tokio::test]
    async fn the_identities_holding_leases_are_bounded() {
        let store = Leased::new(MemoryStore::new(), 5, Duration::from_secs(60))
            .unwrap()
            .max_identities(64);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        for n in 0..2_000 {
            let key = Key::new(format!("user:{n}"));
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        }
        // 2,000 identities over 16 shards fill every shard's 4.
        assert_eq!(identities_held(&store), 64);
        // Those past the bound were decided one by one by the shared store, spending
        // exactly their cost: a lease of 5 each would have left 5 of 10, not 9.
        let last = Key::new("user:1999");
        let status = store
            .inner()
            .peek(&last, &policies)
            .await
            .unwrap()
            .statuses()[0];
        assert_eq!(status.remaining, 9, "{status:?}");
        assert!(store.shared_calls() >= 2_000 - 64);
    }

    /// A store that cannot adjust (one implementing `decide` alone, as a wrapper that
    /// counts calls does) was taken: every rest it was given back failed, logged once
    /// a minute, so each lease's unspent units stayed out of the shared quota until its
    /// window forgot them, and an identity calling once per `ttl` paid a whole lease each
    /// time. Refused when built, saying why.
    #[test]
    fn a_store_that_cannot_take_rests_back_is_refused() {
        struct DecideOnly(MemoryStore);
        impl Store for DecideOnly {
            fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
                self.0.decide(key, policies, cost)
            }
        }
        let refused = Leased::new(DecideOnly(MemoryStore::new()), 20, Duration::from_secs(1));
        let Err(error) = refused else {
            panic!("a store that cannot adjust is refused");
        };
        assert_eq!(error.kind(), StoreErrorKind::Unsupported);
        assert!(error.to_string().contains("can_adjust"), "{error}");
    }

    /// A lease's timer outlived the lease: spent (or retired, or dropped by a reset), it
    /// was out of the list, but its task slept on to the end of `ttl`, holding the store,
    /// the policy set and the handles of its take. One identity busy at 100,000 requests
    /// a second on leases of 20 and a `ttl` of a minute kept 300,000 tasks alive: memory
    /// grew with the request rate times `ttl`, not with `max_identities`. A lease gone
    /// from the list ends its timer.
    #[tokio::test]
    async fn a_spent_leases_timer_ends_with_it() {
        let store = Leased::new(MemoryStore::new(), 1, Duration::from_secs(3600)).unwrap();
        let policies = PolicySet::from(
            Policy::token_bucket("b", 1_000_000, crate::Rate::per_second(1)).unwrap(),
        );
        let key = Key::new("busy");
        for _ in 0..1_000 {
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        }
        // Each timer's task holds the leases; let those whose lease is gone see it.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let held = Arc::strong_count(&store.leases);
        assert!(
            held < 10,
            "{held} holders of the leases (timers still asleep)"
        );
    }

    /// A lease spent to its last unit stayed in its identity's list until its `ttl`
    /// ended: with small leases and a long `ttl`, a busy identity piled up thousands,
    /// each request scanning them all under the shard's lock.
    #[tokio::test]
    async fn spent_leases_do_not_pile_up() {
        let store = Leased::new(MemoryStore::new(), 1, Duration::from_secs(60)).unwrap();
        let policies = PolicySet::from(
            Policy::token_bucket("b", 1_000_000, crate::Rate::per_second(1)).unwrap(),
        );
        let key = Key::new("busy");
        for _ in 0..1_000 {
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        }
        let id = (key.clone(), policies.fingerprint());
        let leases = store
            .leases
            .shard(&key)
            .get_mut(&id)
            .map(|open| open.leases.len());
        assert!(
            leases.is_some_and(|leases| leases <= 2),
            "{leases:?} leases kept"
        );
    }

    /// A `ttl` beyond any window (`Duration::MAX`, meant as "never ends") was taken, and
    /// every take then panicked once the shared store had debited it: the units were lost
    /// with no lease to spend them. It is refused when the store is built.
    #[test]
    fn a_lease_that_would_never_end_is_refused() {
        let error = Leased::new(MemoryStore::new(), 20, Duration::MAX).unwrap_err();
        assert!(error.to_string().contains("at most"), "{error}");
        assert!(Leased::new(MemoryStore::new(), 20, crate::policy::MAX_PERIOD).is_ok());
    }

    /// `[daily, hourly]` and `[daily]`: two sets sharing a daily quota of 10.
    fn daily_with_and_without_hourly() -> (PolicySet, PolicySet) {
        let daily = Policy::fixed_window("daily", 10, Duration::from_secs(86_400)).unwrap();
        let hourly = Policy::fixed_window("hourly", 100, Duration::from_secs(3600)).unwrap();
        (
            PolicySet::new([daily.clone(), hourly]).unwrap(),
            PolicySet::from(daily),
        )
    }

    /// A daily quota shared by two sets of one identity (`[daily, hourly]` and `[daily]`),
    /// and a lease open under the first: a reset through the second clears the daily
    /// state the lease was debited from. The lease stayed open under the first set's
    /// fingerprint, and its rest was spent on top of the fresh quota: a limit of 10
    /// admitted 14.
    #[tokio::test]
    async fn a_reset_through_another_set_forgets_the_leases_it_clears() {
        let (store, _held) = leased(1_000, 1_000);
        let (both, alone) = daily_with_and_without_hourly();
        let key = Key::new("k");
        assert!(store.decide(&key, &both, 1).await.unwrap().is_allowed());
        store.reset(&key, &alone).await.unwrap();
        let admitted = admitted(&store, &key, &alone).await + admitted(&store, &key, &both).await;
        assert_eq!(
            admitted, 10,
            "admitted under a daily limit of 10 after the reset"
        );
    }

    /// A reset through `[daily]` clears the daily state a lease of `[daily, hourly]` was
    /// debited from, but not the hourly one: what the lease did not spend goes back under
    /// the hourly policy alone. Forgotten whole, the hourly quota under-admitted by the
    /// lease's rest until its window ended (95 left where 99).
    #[tokio::test]
    async fn a_reset_gives_back_a_forgotten_lease_under_the_policies_it_did_not_clear() {
        let (store, held) = leased(1_000, 1_000);
        let (both, alone) = daily_with_and_without_hourly();
        let key = Key::new("k");
        assert!(store.decide(&key, &both, 1).await.unwrap().is_allowed());
        store.reset(&key, &alone).await.unwrap();
        let statuses = held.inner.check("k", &both, 0);
        assert_eq!(statuses.statuses()[0].remaining, 10, "the day was reset");
        assert_eq!(statuses.statuses()[1].remaining, 99, "the hour spent 1");
    }

    /// The rest a reset gives back under its other policies goes at once, beside the
    /// reset: given back once the reset had landed, it could land after a concurrent
    /// `set_remaining(0)` of those policies (4 left where 0).
    #[tokio::test]
    async fn a_rest_given_back_beside_a_reset_does_not_undo_a_later_level_set() {
        let memory = MemoryStore::builder().clock(ManualClock::new()).build();
        let store = Leased::new(memory.clone(), 5, Duration::from_secs(60)).unwrap();
        let (both, alone) = daily_with_and_without_hourly();
        let hourly = PolicySet::from(both.policies()[1].clone());
        let key = Key::new("k");
        assert!(store.decide(&key, &both, 1).await.unwrap().is_allowed());
        let reset = store.reset(&key, &alone);
        let set = store.adjust(&key, &hourly, &Adjustment::set_remaining(0));
        let (reset, set) = tokio::join!(reset, set);
        reset.unwrap();
        set.unwrap();
        assert_eq!(memory.check("k", &hourly, 0).statuses()[0].remaining, 0);
    }

    /// `set_remaining` sets the shared state: what an open lease still holds was debited
    /// before, and spent after the change it passed the level set (4 requests after a
    /// `set_remaining(0)`), or, given back when the lease ended, raised it.
    #[tokio::test]
    async fn setting_what_is_left_forgets_the_open_leases() {
        let (store, held) = leased(1_000, 1_000);
        let (both, alone) = daily_with_and_without_hourly();
        let key = Key::new("k");
        for (through, name) in [(&both, "the lease's own set"), (&alone, "another set")] {
            held.inner.reset_now("k", &both);
            assert!(store.decide(&key, &both, 1).await.unwrap().is_allowed());
            store
                .adjust(&key, through, &Adjustment::set_remaining(0))
                .await
                .unwrap();
            let admitted =
                admitted(&store, &key, &alone).await + admitted(&store, &key, &both).await;
            assert_eq!(
                admitted, 0,
                "admitted after set_remaining(0) through {name}"
            );
        }
    }

    /// A grant gives units back to the shared state, which counts what open leases still
    /// hold as spent: those stayed spendable here on top, and a grant that filled the
    /// state passed the quota by them (one request spent and a grant: 11 of 10, and with
    /// leases of the whole quota twice the limit in one window). The leases' rests go
    /// back first, as when a lease ends: a grant then never passes the quota, and a
    /// small one loses nothing held.
    #[tokio::test]
    async fn a_grant_through_leases_never_passes_the_quota() {
        for grant in [2, 4, u64::MAX] {
            let (store, held) = leased(1_000, 1_000);
            let policies =
                PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
            let key = Key::new("k");
            // A lease of 5 taken, 1 spent, 4 held here; the shared state says 5 left.
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
            assert_eq!(
                held.inner.check("k", &policies, 0).statuses()[0].remaining,
                5
            );
            store
                .adjust(&key, &policies, &Adjustment::grant(grant))
                .await
                .unwrap();
            // 9 left before the grant: at most the quota after it.
            let expected = (9 + grant.min(10)).min(10);
            assert_eq!(
                admitted(&store, &key, &policies).await,
                expected,
                "grant {grant}"
            );
        }
    }

    /// A grant while a lease is being taken: the lease's debit lands before or after it,
    /// which the replica cannot tell. Dropped when it came (as across a reset), its units
    /// stayed debited and were never spent (after a grant of 3, 8 admitted of 10, one
    /// spent); recorded, they would
    /// be spent on top of a state the grant filled. Given back whole as it comes, it is
    /// right in either order (the two only add units, each capped at full).
    #[tokio::test]
    async fn a_grant_while_a_lease_is_taken_loses_nothing() {
        let (store, held) = leased(0, 1_000);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        let key = Key::new("k");
        // A request starts a take of 5: the store debits it now and answers later.
        let first = take_debited(&store, &held.inner, &policies, &key).await;
        store
            .adjust(&key, &policies, &Adjustment::grant(3))
            .await
            .unwrap();
        held.answers.add_permits(1_000);
        let first = u64::from(first.await.unwrap().unwrap().is_allowed());
        assert_eq!(first + admitted(&store, &key, &policies).await, 10);
    }

    /// A take refused (too little left) whose answer comes after a grant spoke of the
    /// state before it: kept, the identity was decided one request at a time for the
    /// lease's whole `ttl` after it was refilled. Not kept, as across a reset.
    #[tokio::test]
    async fn a_refusal_across_a_grant_is_not_kept() {
        let (store, held) = leased(0, 1_000);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        let key = Key::new("k");
        assert!(held.inner.check("k", &policies, 7).is_allowed());
        // A take of 5 with 3 left: refused, its answer held.
        let first = tokio::spawn(store.decide(&key, &policies, 1));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        store
            .adjust(&key, &policies, &Adjustment::grant(10))
            .await
            .unwrap();
        held.answers.add_permits(1_000);
        assert!(first.await.unwrap().unwrap().is_allowed());
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        // The refused take, the first request decided on its own (it waited for a take
        // already), then a lease taken after the grant, which serves the third.
        assert_eq!(
            store.leases.calls.load(Ordering::Relaxed),
            3,
            "a lease is taken again after the grant"
        );
    }

    /// A store of 5-unit leases over a `Held` store whose adjustments (the give-backs)
    /// wait for permits, that store, 10 an hour, and the key `k`.
    fn holding_adjustments() -> (Leased<Held>, Held, PolicySet, Key) {
        let held =
            Held::new(&ManualClock::new(), usize::MAX >> 4, usize::MAX >> 4).holding_adjustments();
        (
            Leased::new(held.clone(), 5, Duration::from_secs(60)).unwrap(),
            held,
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap()),
            Key::new("k"),
        )
    }

    /// A lease's rest on its way back (retired for a costlier request) when a reset is
    /// sent: landing after the reset, on another connection, it gave its units back into
    /// the fresh state, and a limit of 10 admitted 14 after the reset. The reset now waits
    /// for the key's give-backs on their way to land first.
    #[tokio::test]
    async fn a_reset_waits_for_the_give_backs_on_their_way() {
        let (store, held, policies, key) = holding_adjustments();
        // A lease of 5, one spent; a request of 5 retires its rest of 4 (held on its way
        // back) and takes a lease of 5 more: the window is spent.
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        assert!(store.decide(&key, &policies, 5).await.unwrap().is_allowed());
        assert_eq!(
            held.inner.check("k", &policies, 0).statuses()[0].remaining,
            0
        );
        let reset = tokio::spawn(store.reset(&key, &policies));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let before = admitted(&store, &key, &policies).await;
        held.adjusts.add_permits(1_000);
        reset.await.unwrap().unwrap();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let after = admitted(&store, &key, &policies).await;
        assert_eq!(
            before + after,
            10,
            "admitted under a limit of 10 after the reset ({before} while the rest was on its way)"
        );
        assert!(
            !store.leases.giving_back(&key),
            "nothing is on its way back"
        );
    }

    /// A rest counted as on its way back is no more when its give-back is dropped unsent
    /// (`release_all` cut short by a timeout, a runtime shutting down): counted for ever,
    /// every later reset of the identity would wait for it.
    #[tokio::test]
    async fn a_give_back_dropped_on_its_way_is_no_longer_waited_for() {
        let (store, _held, policies, key) = holding_adjustments();
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        // Polled once (its give-back held), then dropped: cut short.
        let mut release = Box::pin(store.release_all());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(release.as_mut().poll(&mut cx).is_pending());
        assert!(store.leases.giving_back(&key));
        drop(release);
        assert!(
            !store.leases.giving_back(&key),
            "still counted after it was dropped"
        );
    }

    /// A reset is sent, then lands a round trip later (Redis's `DEL`): a lease taken in
    /// between was debited from the state the reset then clears. Kept, its rest was spent
    /// on top of the fresh quota.
    #[tokio::test]
    async fn a_lease_taken_while_a_reset_is_on_its_way_is_not_spent() {
        let (store, held) = leased(1_000, 0);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        let key = Key::new("k");
        let reset = tokio::spawn(store.reset(&key, &policies));
        // A lease of 5 is taken (and one unit of it spent) before the reset lands.
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        held.resets.add_permits(1);
        reset.await.unwrap().unwrap();
        assert_eq!(
            admitted(&store, &key, &policies).await,
            10,
            "admitted under a limit of 10 after the reset landed"
        );
    }
}
