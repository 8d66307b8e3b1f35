//! Limits outside HTTP: jobs, outgoing calls, WebSocket messages, per-message costs on a
//! stream, with the same policies, stores and failure modes as the layer.
//!
//! [`Limiter::check`] decides and spends at once; [`Limiter::until_ready`] waits until
//! the cost fits, at most a given time (governor's `until_ready`). A limiter's waiters for
//! one key are served in the order they came, one at a time: the first waits for the
//! store's retry time while the others queue behind it, so a crowd never wakes at once to
//! race for the same units (no thundering herd). The queue is the limiter's (its clones
//! share it); `check` and other processes do not queue in it, but every decision is the
//! store's, atomic, so nothing is over-admitted, in process or across replicas on Redis
//! (during an outage, the failure mode decides: with the default local fallback, each
//! replica alone, at its `share`). A waiter
//! queued behind others gives up when its own maximum wait has passed. Store calls are
//! bounded by a timeout (50 ms by default) and answered by the failure mode past it; there
//! is no circuit breaker.
//!
//! In-flight (concurrency) policies belong to requests, which the layer frees when they
//! end; a limiter's caller would have to free them itself (`Store::adjust` with
//! `Adjustment::release`), and a slot the local fallback took during an outage cannot
//! be freed that way (it stays taken in that process): for jobs, a semaphore says it
//! better. Likewise a decision the local fallback made gives nothing back on the store:
//! its receipt is dated before anything the store holds (the store never debited it),
//! so a post-paid cost settled with it (`Store::adjust` with `Adjustment::settle`)
//! refunds nothing there, while what it used past its reservation is charged there.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::limiter::Limiter;
//! use tollgate::{Key, MemoryStore, Policy, Rate};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // At most 10 e-mails a second to the mail provider, bursts of 20.
//! let mail = Limiter::new(MemoryStore::new(), Policy::token_bucket("mail", 20, Rate::per_second(10))?);
//! let provider = Key::new("smtp.example.com");
//! for _ in 0..25 {
//!     mail.until_ready(&provider, 1, Duration::from_secs(5)).await?;
//!     // send one e-mail
//! }
//! assert!(!mail.check(&provider, 5).await?.is_allowed());
//! # Ok(()) }
//! ```
//!
//! A WebSocket whose messages cost their length, per connection (axum's `ws` feature).
//! One limiter serves every connection, each keyed apart: a limiter (its store, and the
//! failure mode's own) per connection would cost every socket a whole store's shards.
//! (A client that opens N connections has N budgets: key by user or address to bound
//! the client.)
//!
//! ```no_run
//! use std::sync::LazyLock;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::time::Duration;
//! use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
//! use axum::response::Response;
//! use tollgate::limiter::Limiter;
//! use tollgate::{Key, MemoryStore, Policy, Rate};
//!
//! // 64 KiB a second per connection, bursts of 256 KiB.
//! static BYTES: LazyLock<Limiter<MemoryStore>> = LazyLock::new(|| {
//!     let policy = Policy::token_bucket("ws-bytes", 256 * 1024, Rate::per_second(64 * 1024))
//!         .expect("a valid policy");
//!     Limiter::new(MemoryStore::new(), policy)
//! });
//! static CONNECTIONS: AtomicU64 = AtomicU64::new(0);
//!
//! async fn socket(upgrade: WebSocketUpgrade) -> Response {
//!     upgrade.on_upgrade(|mut socket: WebSocket| async move {
//!         let me = Key::new(format!("ws:{}", CONNECTIONS.fetch_add(1, Ordering::Relaxed)));
//!         while let Some(Ok(message)) = socket.recv().await {
//!             // Every message costs its payload, and at least one unit: pings (which
//!             // axum answers with pongs), pongs and empty messages are not free.
//!             let payload = match &message {
//!                 Message::Text(text) => text.len(),
//!                 Message::Binary(bytes) | Message::Ping(bytes) | Message::Pong(bytes) => {
//!                     bytes.len()
//!                 }
//!                 Message::Close(_) => 0,
//!             };
//!             let cost = (payload as u64).max(1);
//!             // Slow the sender down; close on one that cannot fit at all.
//!             if BYTES.until_ready(&me, cost, Duration::from_secs(10)).await.is_err() {
//!                 let _ = socket.send(Message::Close(None)).await;
//!                 break;
//!             }
//!             // handle the message
//!         }
//!     })
//! }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::decision::{Decision, Outcome};
use crate::failure::{Breaker, CircuitBreaker, FailureMode};
use crate::key::Key;
use crate::policy::PolicySet;
use crate::store::{Store, StoreError, StoreErrorKind, within};

/// One key's queue of waiters: a fair (first come, first served) async lock, and whether
/// the store failed the waiter that holds it, in its latest call (the decision was the
/// failure mode's; cleared as a waiter takes the turn).
#[derive(Default)]
struct KeyQueue {
    turn: Arc<tokio::sync::Mutex<()>>,
    failing: std::sync::atomic::AtomicBool,
    /// The waiter holding the turn is waiting on a store call now.
    calling: std::sync::atomic::AtomicBool,
    /// The latest read of the key's state for waiters that gave up in the queue, and when
    /// it ended (`None`: the store failed it): see [`Limiter::state_once`].
    read: tokio::sync::Mutex<Option<(Instant, Option<Decision>)>>,
}

type Queue = Arc<KeyQueue>;

/// A waiter's place in its key's queue: when the last one goes, so does the queue.
struct Place<'a, St: Store> {
    limiter: &'a Limiter<St>,
    key: &'a Key,
    queue: Option<Queue>,
}

impl<St: Store> Drop for Place<'_, St> {
    fn drop(&mut self) {
        drop(self.queue.take());
        self.limiter.forget(self.key);
    }
}

/// Marks a queue's holder as waiting on a store call until dropped (the call answered,
/// or the waiter went away mid-call).
struct Calling<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> Calling<'a> {
    fn new(flag: &'a std::sync::atomic::AtomicBool) -> Self {
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        Self(flag)
    }
}

impl Drop for Calling<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Limits anything, by key. Cheap to clone: clones share the store and the queues.
///
/// A limiter and a layer that spend one budget on the store (a WebSocket's messages and
/// the HTTP routes of one user, under one policy) each have a fallback store of their own
/// by default, so during an outage each admits the whole limit: give them one with
/// [`LocalFallback::with_store`](crate::LocalFallback::with_store) in both
/// [`on_store_error`](Self::on_store_error)s.
pub struct Limiter<St> {
    shared: Arc<Shared<St>>,
}

struct Shared<St> {
    store: St,
    policies: PolicySet,
    failure_mode: FailureMode,
    timeout: Duration,
    /// One queue per key with waiters: a fair (first come, first served) async lock.
    queues: Mutex<HashMap<Key, Queue>>,
    /// Says an outage once and its end once, and counts it in the fallback gauge, as the
    /// layer's breaker does; it never keeps a call from the store.
    outage: Arc<Breaker>,
}

impl<St> Clone for Limiter<St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St> fmt::Debug for Limiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("policies", &self.shared.policies)
            .finish_non_exhaustive()
    }
}

/// Why [`Limiter::until_ready`] gave up.
///
/// A wait that would be too long and a cost that can never fit are told apart: the first
/// says when to come back, the second that coming back will not help. A store that fails
/// under [`FailureMode::FailClosed`] gives its error:
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::limiter::{Limiter, WaitError};
/// use tollgate::{DecideFuture, FailureMode, Key, MemoryStore, Outcome, Policy, PolicySet};
/// use tollgate::{Rate, Store, StoreError, StoreErrorKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::builder().clock(ManualClock::new()).build();
/// let policy = Policy::token_bucket("uploads", 10, Rate::per_second(1))?;
/// let uploads = Limiter::new(store, policy.clone());
/// let key = Key::new("tenant-4");
/// uploads.until_ready(&key, 10, Duration::ZERO).await?; // the bucket is empty now
///
/// // Five units refill in 5 s: not within a wait of 1 s.
/// match uploads.until_ready(&key, 5, Duration::from_secs(1)).await {
///     Err(WaitError::TooLong(denied)) => {
///         assert_eq!(denied.retry_after(), Some(Duration::from_secs(5)));
///     }
///     other => panic!("{other:?}"),
/// }
/// // Eleven units never fit in a bucket of ten, however long the wait.
/// match uploads.until_ready(&key, 11, Duration::from_secs(3600)).await {
///     Err(WaitError::Never(refused)) => {
///         let outcome = Outcome::CostExceedsLimit { policy: 0, cost: 11, limit: 10 };
///         assert_eq!(refused.outcome(), outcome);
///         assert_eq!(refused.retry_after(), None);
///     }
///     other => panic!("{other:?}"),
/// }
///
/// /// A shared store that cannot be reached.
/// #[derive(Clone)]
/// struct Away;
///
/// impl Store for Away {
///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
///         let refused = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
///         DecideFuture::ready(Err(refused))
///     }
/// }
///
/// let closed = Limiter::new(Away, policy).on_store_error(FailureMode::FailClosed);
/// match closed.until_ready(&key, 1, Duration::from_secs(1)).await {
///     Err(WaitError::Store(error)) => assert_eq!(error.kind(), StoreErrorKind::Unavailable),
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum WaitError {
    /// The cost would not fit within the maximum wait: a denial that says when to retry
    /// (when the cost would fit; for a waiter whose turn did not come within its wait, no
    /// sooner than that wait again).
    TooLong(Decision),
    /// The cost is more than a policy ever admits: waiting cannot help.
    Never(Decision),
    /// The store failed and the failure mode refuses: fail-closed, or the local fallback
    /// for a cost above what its share of a policy ever admits.
    Store(StoreError),
}

impl fmt::Display for WaitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::TooLong(decision) => write!(
                f,
                "the cost would not fit within the maximum wait (retry in {:?})",
                decision.retry_after().unwrap_or_default()
            ),
            WaitError::Never(decision) => match decision.outcome() {
                crate::Outcome::CostExceedsLimit {
                    policy,
                    cost,
                    limit,
                } => write!(
                    f,
                    "a cost of {cost} is more than policy {policy} of the set ever admits \
                     (its limit is {limit}): waiting cannot help"
                ),
                _ => f.write_str("the cost is more than a policy ever admits: waiting cannot help"),
            },
            // The store's error says it is the store's.
            WaitError::Store(error) => write!(f, "gave up waiting: {error}"),
        }
    }
}

/// The store's error is in the message (not a `source`, which reporters would print
/// again).
impl std::error::Error for WaitError {}

/// The enforced shaping policy that held an admitted request of `cost` units back
/// longest: the one whose queue, without this request's own units, takes the longest to
/// leak out (a shaping policy's reset is the time until its queue is empty). The first
/// enforced policy when none is known.
fn longest_queue(policies: &PolicySet, decision: &Decision, cost: u64) -> usize {
    policies
        .iter()
        .zip(decision.statuses())
        .enumerate()
        .filter(|(_, (policy, _))| !policy.is_shadow())
        .filter_map(|(index, (policy, status))| match policy.algorithm() {
            crate::Algorithm::LeakyShaping { leak, .. } => {
                let own =
                    u128::from(cost) * leak.period().as_nanos() / u128::from(leak.amount().max(1));
                Some((status.reset.as_nanos().saturating_sub(own), index))
            }
            _ => None,
        })
        .max_by_key(|(wait, index)| (*wait, std::cmp::Reverse(*index)))
        .map_or_else(|| first_enforced(policies), |(_, index)| index)
}

/// The first policy that is not a shadow (0 when all are).
fn first_enforced(policies: &PolicySet) -> usize {
    policies
        .iter()
        .position(|policy| !policy.is_shadow())
        .unwrap_or(0)
}

/// A decision as the caller gets it: one the local fallback made (the store away) carries
/// a receipt the store cannot give anything back by, as it never debited it (what it
/// spent is the fallback's, in this process): its debit dated at the epoch, before any
/// state the store holds, so that a refund finds nothing of it left (every refund is
/// bounded by what was debited at that time and not refilled since), and no lease (no
/// slot of the store's to free). Settled on the store, it gave back units the store never
/// debited, on a quota the store may have spent. What a caller settles past the
/// reservation is still charged there: refunds alone read the time.
fn handed(decision: Decision, decider: &Decider) -> Decision {
    match decider {
        Decider::Fallback(_) => {
            let undebited = decision.receipt().undebited();
            decision.with_receipt(crate::decision::Receipt::new(0, 0).with_undebited(undebited))
        }
        Decider::Store | Decider::Open => decision,
    }
}

/// Units a waiter has spent and sleeps its shaping delay for, with its turn in the key's
/// queue: given back if the waiter is dropped before the delay ends (it will never use
/// them). The turn is held until they are back, so no waiter queues behind units that
/// are then taken out from under it (two requests would go at one instant).
struct Booked<St: Store> {
    limiter: Limiter<St>,
    key: Key,
    cost: u64,
    spent: Option<(Decision, Decider)>,
    turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The queue whose turn it holds: its give-back is a store call there.
    queue: Option<Queue>,
}

impl<St: Store> Drop for Booked<St> {
    fn drop(&mut self) {
        let Some((decision, decider)) = self.spent.take() else {
            return;
        };
        // Without a runtime no store call can be bounded by its timeout: the units stay
        // spent (they leak out with time).
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (limiter, key, cost) = (self.limiter.clone(), self.key.clone(), self.cost);
        let (turn, queue) = (self.turn.take(), self.queue.take());
        let mut give_back = Box::pin(async move {
            {
                // The turn is held on store calls: a waiter behind it whose peek the
                // store fails meets the store's failure, not a limit.
                let _calling = queue.as_deref().map(|queue| Calling::new(&queue.calling));
                limiter.give_back(&key, cost, &decision, &decider).await;
            }
            drop(turn);
            drop(queue);
            limiter.forget(&key);
        });
        // An in-process store (or the fallback) answers at once: given back before the
        // drop returns. A store doing I/O finishes in a task, which holds the turn.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if give_back.as_mut().poll(&mut cx).is_pending() {
            runtime.spawn(give_back);
        }
    }
}

/// Who decided a limiter's request: the store, the failure mode's local limiter (under
/// the policies it applied), or nobody (fail open).
enum Decider {
    Store,
    Fallback(PolicySet),
    Open,
}

impl<St: Store> Limiter<St> {
    /// A limiter of `policies` (one policy, or a [`PolicySet`]) in `store`. When the
    /// store fails, a local in-process limiter with the same policies decides
    /// ([`FailureMode::Fallback`], as the layer does by default); every failure is
    /// counted in `tollgate_store_errors_total`, and one that is not I/O is logged at
    /// error level, as the layer's are.
    ///
    /// It does not ask the store whether it can decide the policies exactly (a Redis
    /// store refuses some very large ones): [`try_new`](Self::try_new) does, as the layer
    /// does when it is built. Without that check, such a policy is decided by the
    /// failure mode on every call, and an empty set admits every call.
    pub fn new(store: St, policies: impl Into<PolicySet>) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                policies: policies.into(),
                failure_mode: FailureMode::default(),
                timeout: crate::store::DEFAULT_STORE_TIMEOUT,
                queues: Mutex::new(HashMap::new()),
                outage: Arc::new(Breaker::new(CircuitBreaker::default())),
            }),
        }
    }

    /// [`new`](Self::new), refused when the store cannot decide the policies exactly
    /// ([`Store::validate`]): a limit that every call would leave to the failure mode,
    /// each replica deciding alone, is a set-up mistake to report at start-up.
    ///
    /// An empty set (a limiter that admits everything) is refused too, and so are an
    /// in-flight limit and a shaping policy over a store that cannot adjust
    /// ([`Store::can_adjust`]: slots and places go back through it).
    ///
    /// ```
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let mail = Limiter::try_new(MemoryStore::new(), Policy::token_bucket("mail", 20, Rate::per_second(10))?)?;
    /// # let _ = mail;
    /// assert!(Limiter::try_new(MemoryStore::new(), PolicySet::unlimited()).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_new(store: St, policies: impl Into<PolicySet>) -> Result<Self, StoreError> {
        let policies = policies.into();
        // As the layer refuses one: a limiter of no policy admits everything.
        if policies.is_empty() {
            return Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "no policy to decide (a limiter of no policy limits nothing: give it at \
                 least one)",
            ));
        }
        store.validate(&policies)?;
        // What a waiter takes and gives back goes through the store's adjust: an in-flight
        // slot when its call ends, a shaping place when it gives up (without it, each one
        // left a place booked for nobody).
        let gives_back = |policy: &crate::Policy| {
            if policy.params().is_in_flight() {
                Some(("in-flight limit", "frees slots"))
            } else if !policy.is_shadow() && policy.params().is_shaping() {
                Some((
                    "shaping policy",
                    "gives a waiter's place back, when it gives up,",
                ))
            } else {
                None
            }
        };
        if !store.can_adjust()
            && let Some((policy, (kind, what))) = policies
                .iter()
                .find_map(|policy| gives_back(policy).map(|given| (policy, given)))
        {
            return Err(StoreError::new(
                StoreErrorKind::Unsupported,
                format!(
                    "the {kind} \"{}\" {what} through the store's adjust, and this store \
                     cannot adjust (Store::can_adjust is false)",
                    policy.name()
                ),
            ));
        }
        Ok(Self::new(store, policies))
    }

    /// What to do when the store fails (as [`RateLimitLayer::on_store_error`]). Set it
    /// before the limiter is shared: a clone made earlier keeps the old mode.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{DecideFuture, FailureMode, Key, LocalFallback, Policy, PolicySet, Rate};
    /// use tollgate::{Store, StoreError, StoreErrorKind};
    ///
    /// /// The shared store, away for now.
    /// #[derive(Clone)]
    /// struct Away;
    ///
    /// impl Store for Away {
    ///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
    ///         let refused = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
    ///         DecideFuture::ready(Err(refused))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Four workers share the store's 40 jobs an hour; while it is away, each enforces a
    /// // quarter of them on its own.
    /// let jobs = Limiter::new(Away, Policy::token_bucket("jobs", 40, Rate::per_hour(40))?)
    ///     .on_store_error(FailureMode::Fallback(LocalFallback::new().share(0.25)))
    ///     .store_timeout(Duration::from_millis(100));
    /// let worker = Key::new("worker-1");
    /// let first = jobs.check(&worker, 1).await?;
    /// assert!(first.is_allowed());
    /// assert_eq!(first.statuses()[0].limit, 10);
    /// for _ in 1..10 {
    ///     assert!(jobs.check(&worker, 1).await?.is_allowed());
    /// }
    /// assert!(!jobs.check(&worker, 1).await?.is_allowed());
    /// # Ok(()) }
    /// ```
    ///
    /// # Panics
    ///
    /// With a [`LocalFallback`](crate::LocalFallback) whose `share` is no share (0, below
    /// 0, NaN, below one millionth), which the layer refuses at build: each replica would enforce
    /// the whole limit during an outage, the fleet N times it. A start-up mistake.
    ///
    /// ```should_panic
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{FailureMode, LocalFallback, MemoryStore, Policy, Rate};
    ///
    /// let replicas = 4;
    /// let share = (1 / replicas) as f64; // integer division: 0
    /// let _ = Limiter::new(MemoryStore::new(), Policy::gcra("jobs", Rate::per_second(40), 40)?)
    ///     .on_store_error(FailureMode::Fallback(LocalFallback::new().share(share)));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// [`RateLimitLayer::on_store_error`]: crate::RateLimitLayer::on_store_error
    pub fn on_store_error(self, failure_mode: FailureMode) -> Self
    where
        St: Clone,
    {
        if let FailureMode::Fallback(fallback) = &failure_mode
            && let Err(mistake) = fallback.check()
        {
            panic!("Limiter: {mistake}");
        }
        self.rebuilt(|shared| shared.failure_mode = failure_mode)
    }

    /// How long the store may take to decide before it counts as failed (default 50 ms,
    /// as the layer's): a store that hangs is answered by the failure mode. Here the
    /// store never answers, and under fail-closed the caller gets a timeout once the 200
    /// ms set are up (tokio's paused time, which the timeout counts in):
    ///
    /// ```
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{DecideFuture, FailureMode, Key, Policy, PolicySet, Rate, Store};
    /// use tollgate::StoreErrorKind;
    ///
    /// /// A store whose answers never come.
    /// #[derive(Clone)]
    /// struct Hangs;
    ///
    /// impl Store for Hangs {
    ///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
    ///         DecideFuture::new(std::future::pending())
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = Limiter::new(Hangs, Policy::gcra("api", Rate::per_second(10), 10)?)
    ///     .on_store_error(FailureMode::FailClosed)
    ///     .store_timeout(Duration::from_millis(200));
    /// let asked = Instant::now();
    /// let error = limiter.check(&Key::new("job-7"), 1).await.unwrap_err();
    /// assert_eq!(error.kind(), StoreErrorKind::Timeout);
    /// assert_eq!(asked.elapsed(), Duration::from_millis(200));
    /// # Ok(()) }
    /// ```
    ///
    /// See [`on_store_error`](Self::on_store_error) for a failure mode that decides
    /// instead.
    ///
    /// # Panics
    ///
    /// With a timeout of zero, which the layer refuses at build: every decision of a
    /// store that does I/O would fail, and each replica decide alone. A start-up mistake.
    ///
    /// ```should_panic
    /// use std::time::Duration;
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{MemoryStore, Policy, Rate};
    ///
    /// let _ = Limiter::new(MemoryStore::new(), Policy::gcra("api", Rate::per_second(10), 10)?)
    ///     .store_timeout(Duration::ZERO);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn store_timeout(self, timeout: Duration) -> Self
    where
        St: Clone,
    {
        assert!(
            !timeout.is_zero(),
            "Limiter: the store timeout is zero, so every decision of a store that does I/O \
             would fail: give it the time the store needs (default 50 ms)"
        );
        self.rebuilt(|shared| shared.timeout = timeout)
    }

    /// This limiter with `change` made to its settings: in place when it is not shared
    /// yet, else on a copy (the clones made before keep theirs, and their queues).
    fn rebuilt(self, change: impl FnOnce(&mut Shared<St>)) -> Self
    where
        St: Clone,
    {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|shared| Shared {
            store: shared.store.clone(),
            policies: shared.policies.clone(),
            failure_mode: shared.failure_mode.clone(),
            timeout: shared.timeout,
            queues: Mutex::new(HashMap::new()),
            outage: Arc::clone(&shared.outage),
        });
        change(&mut shared);
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Decides `cost` units for `key` now, and spends them if admitted. It does not wait
    /// its turn behind [`until_ready`](Self::until_ready)'s waiters.
    pub async fn check(&self, key: &Key, cost: u64) -> Result<Decision, StoreError> {
        let (decision, decider) = self.decide(key, cost).await?;
        if !matches!(decider, Decider::Open) {
            self.told(key, &decision, matches!(decider, Decider::Fallback(_)));
        }
        Ok(handed(decision, &decider))
    }

    /// An answer given to a caller, counted in `tollgate_decisions_total` (and a denial
    /// logged at debug level) as the layer's are, and in
    /// `tollgate_fallback_decisions_total` when the fallback made it (`fell_back`): once
    /// per call, as what the caller got (a waiter's turns are not answers). One let
    /// through open by the failure mode is not a decision, as in the layer.
    fn told(&self, key: &Key, decision: &Decision, fell_back: bool) {
        if fell_back {
            crate::telemetry::fallback_decision(decision, false);
        }
        crate::telemetry::decision(&self.shared.policies, decision, key);
    }

    /// [`check`](Self::check), and who decided: the store, or the failure mode.
    async fn decide(&self, key: &Key, cost: u64) -> Result<(Decision, Decider), StoreError> {
        self.decide_under(key, &self.shared.policies, cost).await
    }

    /// A waiter's decision. It waits the time the store names, so its denials are no
    /// offence: under a penalty, a block is read first (a peek spends nothing and counts
    /// towards nothing), and the units are decided without the penalties, on the same
    /// state. (A block another request starts between the two is met on the next turn.)
    async fn waiting(&self, key: &Key, cost: u64) -> Result<(Decision, Decider), StoreError> {
        let policies = &self.shared.policies;
        if !policies.has_penalties() {
            return self.decide_under(key, policies, cost).await;
        }
        let shared = &self.shared;
        let started = tokio::time::Instant::now();
        let waiting = shared.outage.waiting();
        let peeked = within(
            shared.timeout,
            "answer to a peek",
            shared.store.peek(key, policies),
        )
        .await;
        waiting.answered(&peeked);
        // The decision has what the peek left of the store timeout: a turn waits one
        // timeout for the store, however its calls spend it.
        let left = shared.timeout.saturating_sub(started.elapsed());
        match peeked {
            Ok(now) => {
                // An answer: the store is there (a lease's or the deny cache's answer
                // says nothing of the store behind).
                if !now.is_cached() {
                    shared.outage.on_success();
                }
                if now.is_blocked() {
                    return Ok((now, Decider::Store));
                }
                self.decide_within(key, &policies.without_penalties(), cost, left, false)
                    .await
            }
            // Whether a block stands is not known: decided with the penalties, as a
            // check is (a block is met; a denial counts). A store that hung on the peek
            // has no time left: the failure mode answers after one timeout, the hang
            // counted once.
            Err(error) => {
                self.met(&error);
                self.decide_within(key, policies, cost, left, true).await
            }
        }
    }

    /// A decision under `policies` (the limiter's, or the same without penalties).
    async fn decide_under(
        &self,
        key: &Key,
        policies: &PolicySet,
        cost: u64,
    ) -> Result<(Decision, Decider), StoreError> {
        self.decide_within(key, policies, cost, self.shared.timeout, false)
            .await
    }

    /// [`decide_under`](Self::decide_under), the store given `timeout` to answer. With
    /// none left, the store is not asked (a call sent and given up at once could still
    /// be counted): the failure mode answers, and the turn's timeout is counted as a
    /// store error unless `counted` (the failure that used up the time was).
    async fn decide_within(
        &self,
        key: &Key,
        policies: &PolicySet,
        cost: u64,
        timeout: Duration,
        counted: bool,
    ) -> Result<(Decision, Decider), StoreError> {
        let shared = &self.shared;
        let decided = if timeout.is_zero() {
            Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "no time left of the store timeout ({:?}) for a decision",
                    shared.timeout
                ),
            ))
        } else {
            let waiting = shared.outage.waiting();
            let decided = within(
                timeout,
                "decision",
                shared.store.decide(key, policies, cost),
            )
            .await;
            waiting.answered(&decided);
            decided
        };
        let decided = decided.and_then(|decision| {
            crate::store::check_answer(&decision, policies.len())?;
            Ok(decision)
        });
        match decided {
            Ok(decision) => {
                // A lease's or the deny cache's answer says nothing of the store behind.
                if !decision.is_cached() {
                    shared.outage.on_success();
                }
                Ok((decision, Decider::Store))
            }
            Err(error) => {
                // Counted (and, if not I/O, logged) whatever the failure mode does.
                if !(counted && timeout.is_zero()) {
                    self.met(&error);
                }
                self.failure_modes_answer(key, policies, cost, error)
            }
        }
    }

    /// A store call failed with `error`: counted (and, if not I/O, logged), and an outage
    /// (or a refusal every call meets) said as the layer says it; an error of this call's
    /// alone is only logged.
    fn met(&self, error: &StoreError) {
        crate::telemetry::store_error(error);
        if error.kind().is_io() || error.meets_every_request_as_an_outage() {
            self.shared.outage.on_failure(error, None);
        }
    }

    /// What the failure mode answers for a decision the store failed to make (`error`).
    fn failure_modes_answer(
        &self,
        key: &Key,
        policies: &PolicySet,
        cost: u64,
        error: StoreError,
    ) -> Result<(Decision, Decider), StoreError> {
        match &self.shared.failure_mode {
            // Only the fallback's share of the quota refuses the cost: the outage stands
            // in its way, not "never" (as the layer answers).
            FailureMode::Fallback(fallback) => fallback
                .decide(key, policies, cost)
                .map(|(decision, applied)| (decision, Decider::Fallback(applied)))
                .ok_or(error),
            FailureMode::FailOpen => Ok((
                Decision::new(
                    Outcome::Allowed {
                        delay: Duration::ZERO,
                    },
                    [],
                ),
                Decider::Open,
            )),
            _ => Err(error),
        }
    }

    /// Waits until `cost` units for `key` fit, then spends them; gives up at once when
    /// they would not fit within `max_wait`, or never. Waiters for one key are served in
    /// the order they came. A shaping policy's delay is waited too, the waiter keeping its
    /// turn: a waiter dropped before its delay ends (a timeout around it) gives its units
    /// back (no waiter of this limiter has queued behind them; a `check`, another limiter
    /// or another replica may have booked a later slot meanwhile, and keeps it, so two
    /// requests may then land close together). So a waiter behind one that sleeps its
    /// delay decides only when that delay ends (past its own `max_wait`, it gets
    /// `TooLong`, told to retry after `max_wait`). A waiter held in the queue past its
    /// `max_wait` by a failing store (each waiter ahead waited one store timeout for it)
    /// gets the failure mode's answer instead, as a store error is no denial. A store call
    /// begun within the wait is given its whole timeout, so an answer can come up to one
    /// store timeout after `max_wait`. An admission after a shaping delay still says that
    /// delay ([`Outcome::Allowed`]): it has been waited, not to be waited again. A waiter
    /// dropped while a store doing I/O decides (a timeout around it) leaves what that
    /// decision spends spent, as a request that went away would.
    pub async fn until_ready(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, WaitError> {
        // Whether the fallback made the answer a refusal comes from.
        let fell_back = AtomicBool::new(false);
        match self.wait_until_ready(key, cost, max_wait, &fell_back).await {
            Ok((decision, decider)) => {
                if !matches!(decider, Decider::Open) {
                    self.told(key, &decision, matches!(decider, Decider::Fallback(_)));
                }
                Ok(handed(decision, &decider))
            }
            Err(error) => {
                if let WaitError::TooLong(decision) | WaitError::Never(decision) = &error {
                    self.told(key, decision, fell_back.into_inner());
                }
                Err(error)
            }
        }
    }

    async fn wait_until_ready(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
        fell_back: &AtomicBool,
    ) -> Result<(Decision, Decider), WaitError> {
        // A cost above a policy's limit is never admitted: no use queueing for it (the
        // store answers at once, spending nothing).
        if self.shared.policies.never_admits(cost).is_some() {
            // Without the penalties: another policy's denial beside it is no offence.
            let policies = self.shared.policies.without_penalties();
            let (decision, decider) = self
                .decide_under(key, &policies, cost)
                .await
                .map_err(WaitError::Store)?;
            if let Outcome::CostExceedsLimit { .. } = decision.outcome() {
                fell_back.store(
                    matches!(decider, Decider::Fallback(_)),
                    std::sync::atomic::Ordering::Relaxed,
                );
                return Err(WaitError::Never(decision));
            }
            // The store failed and the failure mode let the request through: that is
            // this turn's answer (asked again, the store would hold the waiter for a
            // second timeout).
            if let Decider::Open = decider {
                return Ok((decision, decider));
            }
        }
        let now = Instant::now();
        let deadline = now
            .checked_add(max_wait)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        // This waiter's place in the key's queue; the queue goes when its last waiter
        // does, however that waiter ends (dropped mid-wait included).
        let place = Place {
            limiter: self,
            key,
            queue: Some(self.queue(key)),
        };
        let queue = place.queue.as_ref().expect("set above");
        let locked = tokio::time::timeout_at(deadline, Arc::clone(&queue.turn).lock_owned()).await;
        let Ok(turn) = locked else {
            // The store failed the waiter ahead (it holds the turn one store timeout
            // each): no denial, as no limit was reached; the failure mode answers, as it
            // would have had this waiter's own call failed (the failures are counted). A
            // queue held by ordinary waits is told so, whatever other keys' calls meet.
            use std::sync::atomic::Ordering::Relaxed;
            let failing = queue.failing.load(Relaxed);
            let calling = queue.calling.load(Relaxed);
            if failing {
                drop(place);
                return self
                    .served(key, cost, deadline, None, None, fell_back)
                    .await;
            }
            // Those ahead still wait after this one's whole wait: it is refused, and told
            // not to come back before as long again (when its own cost fits, behind them,
            // is not known). The statuses are the key's state now. A peek the store fails
            // while the waiter ahead waits on a store call is the failure that held the
            // queue (a holder's first call, on a store that hangs, is not known to fail
            // until it does): the failure mode answers. (The place's drop removes the
            // queue when nobody else holds it.)
            let peeked = self.state_once(key, queue, deadline).await;
            let calling = calling || queue.calling.load(Relaxed);
            drop(place);
            let now = match peeked {
                Some(now) => now,
                None if calling => {
                    return self
                        .served(key, cost, deadline, None, None, fell_back)
                        .await;
                }
                None => Decision::new(
                    Outcome::Allowed {
                        delay: Duration::ZERO,
                    },
                    [],
                ),
            };
            // Named: the enforced policy with the fewest units left.
            let policy = now
                .statuses()
                .iter()
                .zip(self.shared.policies.iter())
                .enumerate()
                .filter(|(_, (_, policy))| !policy.is_shadow())
                .min_by_key(|(_, (status, _))| status.remaining)
                .map_or_else(|| first_enforced(&self.shared.policies), |(index, _)| index);
            return Err(WaitError::TooLong(Decision::new(
                Outcome::Denied {
                    policy,
                    retry_after: max_wait.max(Duration::from_millis(1)),
                },
                now.statuses().iter().copied(),
            )));
        };
        // Whether the store fails this turn is its own call's to say: a turn before it
        // that failed and gave up left the mark, and a waiter behind a turn asked of a
        // store that answers again was given the failure mode's answer.
        queue
            .failing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.served(key, cost, deadline, Some(turn), Some(queue), fell_back)
            .await
    }

    /// A waiter's turn: decided until admitted, or until the wait would pass `deadline`.
    /// With its `turn` in the key's `queue`, the store decides (and the queue learns
    /// whether the store failed it); without (the queue was held past the deadline by a
    /// failing store), the failure mode answers at once. `fell_back` is set when a
    /// refusal it ends in is the fallback's.
    async fn served(
        &self,
        key: &Key,
        cost: u64,
        deadline: Instant,
        turn: Option<tokio::sync::OwnedMutexGuard<()>>,
        queue: Option<&Queue>,
        fell_back: &AtomicBool,
    ) -> Result<(Decision, Decider), WaitError> {
        loop {
            let decided = if turn.is_some() {
                let calling = queue.map(|queue| Calling::new(&queue.calling));
                let decided = self.waiting(key, cost).await;
                drop(calling);
                decided
            } else {
                let error = StoreError::new(
                    StoreErrorKind::Timeout,
                    "the store is failing, and the waiters ahead held this one's turn \
                     past its wait",
                );
                self.failure_modes_answer(key, &self.shared.policies, cost, error)
            };
            // Whether the turn is held by a failing store: the store's own answer says
            // it is not; a failure mode's says it is, but for a wait the holder then
            // sleeps (below), which is an ordinary one: a waiter behind it is told so.
            let failed = !matches!(decided, Ok((_, Decider::Store)));
            let failing = |failing: bool| {
                if let Some(queue) = queue {
                    queue
                        .failing
                        .store(failing, std::sync::atomic::Ordering::Relaxed);
                }
            };
            failing(failed);
            let (decision, decider) = decided.map_err(WaitError::Store)?;
            // Whose answer a refusal of this turn is.
            fell_back.store(
                matches!(decider, Decider::Fallback(_)),
                std::sync::atomic::Ordering::Relaxed,
            );
            // The policies that decided: the fallback's (scaled) when it did.
            let decided_by = match &decider {
                Decider::Fallback(applied) => applied,
                _ => &self.shared.policies,
            };
            match decision.outcome() {
                Outcome::Allowed { delay } => {
                    if delay.is_zero() {
                        return Ok((decision, decider));
                    }
                    // A shaping delay is part of the wait. Past the deadline, the units
                    // just spent are given back and the waiter gives up at once.
                    if Instant::now()
                        .checked_add(delay)
                        .is_none_or(|ready| ready > deadline)
                    {
                        // Said as a denial: it would be admitted after `delay`, by
                        // the shaping policy that holds it back (of the policies the
                        // fallback applied, when it decided).
                        let denied = Decision::new(
                            Outcome::Denied {
                                policy: longest_queue(decided_by, &decision, cost),
                                retry_after: delay,
                            },
                            decision.statuses().iter().copied(),
                        );
                        // The units just spent go back through the guard, which holds
                        // the turn until they are back: at once for a store in process,
                        // else in a task of its own, which a caller that gives up
                        // meanwhile cannot cancel.
                        drop(Booked {
                            limiter: self.clone(),
                            key: key.clone(),
                            cost,
                            spent: Some((decision, decider)),
                            turn,
                            queue: queue.cloned(),
                        });
                        return Err(WaitError::TooLong(denied));
                    }
                    // The turn is kept through the delay: a waiter dropped while it
                    // sleeps gives its units back, which is sound only while nobody has
                    // queued behind them.
                    let mut booked = Booked {
                        limiter: self.clone(),
                        key: key.clone(),
                        cost,
                        spent: Some((decision, decider)),
                        turn,
                        queue: queue.cloned(),
                    };
                    failing(false);
                    tokio::time::sleep(delay).await;
                    return Ok(booked.spent.take().expect("set above"));
                }
                Outcome::Denied {
                    retry_after,
                    policy,
                } => {
                    // A denial that says no wait (a custom store's, a reply read as 0)
                    // is asked again after a millisecond, not at once: the store would
                    // be hammered until the deadline.
                    let retry_after = retry_after.max(Duration::from_millis(1));
                    // Admitted after the denial's wait, the request still waits its
                    // place in each shaping queue: what is left of the queue then (its
                    // `reset`, less the wait), up to the policy's `max_delay`. A full
                    // queue that denies holds it back a whole `max_delay`; one a block
                    // names has drained by the block's end.
                    // A request of nothing joins no queue (held back only by a block).
                    let queued = if cost == 0 {
                        Duration::ZERO
                    } else {
                        queued_after(decided_by, &decision, policy, retry_after)
                    };
                    if Instant::now()
                        .checked_add(retry_after)
                        .and_then(|ready| ready.checked_add(queued))
                        .is_none_or(|ready| ready > deadline)
                    {
                        return Err(WaitError::TooLong(decision));
                    }
                    failing(false);
                    tokio::time::sleep(retry_after).await;
                    // Asked again: a store failing this holder again holds the turn one
                    // store timeout more, and those behind are told the failure mode's
                    // answer at once, not after a peek of their own on it.
                    failing(failed);
                }
                _ => return Err(WaitError::Never(decision)),
            }
        }
    }

    /// Gives back `cost` units `decision` spent (and the in-flight slots it took) where it
    /// was decided: in the store, as far as it answers within its timeout, or in the
    /// failure mode's local limiter. An unbooking: a shaping policy's place goes back only
    /// while no booking stands behind it (the waiters' turn orders waiters only; a `check`,
    /// another replica or a layer on the same store may have booked since). When a place
    /// stays taken, the units under the other policies go back all the same, as a settle
    /// to nothing that leaves the shaping policies alone.
    async fn give_back(&self, key: &Key, cost: u64, decision: &Decision, decider: &Decider) {
        let shared = &self.shared;
        let unbooking = crate::store::Adjustment::unbook(cost, decision);
        let answer = self.adjust_where_decided(key, decider, &unbooking).await;
        if answer.is_some_and(|answer| !answer.is_allowed())
            && let Some(settle) = crate::store::Adjustment::places_kept(
                cost,
                decision.receipt(),
                decision.statuses().iter().map(|status| status.remaining),
                &shared.policies,
            )
        {
            self.adjust_where_decided(key, decider, &settle).await;
        }
        if shared.policies.has_in_flight() {
            let release = crate::store::Adjustment::release(cost.min(1), decision.receipt());
            self.adjust_where_decided(key, decider, &release).await;
        }
    }

    /// Makes `adjustment` where `decider` decided: the answer, or `None` when the store
    /// failed (counted and logged: the units stay spent) or nothing decided there.
    async fn adjust_where_decided(
        &self,
        key: &Key,
        decider: &Decider,
        adjustment: &crate::store::Adjustment,
    ) -> Option<Decision> {
        let shared = &self.shared;
        match (decider, &shared.failure_mode) {
            (Decider::Store, _) => within(
                shared.timeout,
                "answer to a give-back",
                shared.store.adjust(key, &shared.policies, adjustment),
            )
            .await
            .inspect_err(|error| crate::telemetry::adjustment_lost("give-back", error))
            .ok(),
            (Decider::Fallback(applied), FailureMode::Fallback(fallback)) => {
                Some(fallback.adjust(key, applied, adjustment))
            }
            _ => None,
        }
    }

    /// The key's state now, for a waiter that gives up: `None` when the store fails to
    /// answer within `limit` (at most the store timeout; counted, and said as an outage
    /// is).
    async fn peek(&self, key: &Key, limit: Duration) -> Option<Decision> {
        let shared = &self.shared;
        // Reported as every store call is: a peek given up on a hung store is counted,
        // and one answered ends an outage.
        let waiting = shared.outage.waiting();
        let peeked = within(
            limit,
            "answer to a peek",
            shared.store.peek(key, &shared.policies),
        )
        .await;
        waiting.answered(&peeked);
        match peeked {
            Ok(now) => {
                if !now.is_cached() {
                    shared.outage.on_success();
                }
                Some(now)
            }
            Err(error) => {
                self.met(&error);
                None
            }
        }
    }

    /// The key's state now, for a waiter of `queue` that gave up at `gave_up`: one read
    /// for every waiter that gave up before it ended (a batch of jobs with one `max_wait`
    /// gives up together), not a store call each, which a busy pool could time out and
    /// count as an outage of a store that answers. `None`: the store failed the read.
    ///
    /// A waiter that gave up during a read uses it, whatever it found: a read that hung
    /// answers the waiters behind it as a failed store (the failure mode's answer while
    /// the turn's holder is in a store call too), rather than each asking again, one
    /// store timeout after another. Whatever happens to the read (its waiter dropped
    /// mid-read, the next one reading again), no waiter waits more than one store
    /// timeout past giving up: a read begun later is given what is left of that, as its
    /// own deadline (so that a read the store leaves unanswered is counted and said, as
    /// every store failure is, not dropped midway), and one with nothing left is not
    /// made.
    async fn state_once(&self, key: &Key, queue: &KeyQueue, gave_up: Instant) -> Option<Decision> {
        let timeout = self.shared.timeout;
        let bound = gave_up.checked_add(timeout);
        let mut latest = match bound {
            Some(bound) => tokio::time::timeout_at(bound, queue.read.lock())
                .await
                .ok()?,
            None => queue.read.lock().await,
        };
        if let Some((ended, read)) = &*latest
            && *ended >= gave_up
        {
            return read.clone();
        }
        let limit = bound.map_or(timeout, |bound| {
            bound.saturating_duration_since(Instant::now()).min(timeout)
        });
        if limit.is_zero() {
            return None;
        }
        let read = self.peek(key, limit).await;
        *latest = Some((Instant::now(), read.clone()));
        read
    }

    fn queue(&self, key: &Key) -> Queue {
        let mut queues = self
            .shared
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(queues.entry(key.clone()).or_default())
    }

    /// Drops the key's queue when nobody waits in it any more.
    fn forget(&self, key: &Key) {
        let mut queues = self
            .shared
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if queues
            .get(key)
            // Nobody waits in it, and nobody holds its turn (a give-back holds it
            // until the units are back).
            .is_some_and(|queue| {
                Arc::strong_count(queue) == 1 && Arc::strong_count(&queue.turn) == 1
            })
        {
            queues.remove(key);
            // A burst of keys leaves its table behind: given back once mostly empty.
            if queues.capacity() > 64 && queues.len() < queues.capacity() / 4 {
                let len = queues.len();
                queues.shrink_to(len * 2);
            }
        }
    }
}

/// How long a request admitted `retry_after` from now would still wait in the shaping
/// queues of `policies` (decided as `decision`, which named `named`): the longest of what
/// is left of each enforced queue then, each at most its `max_delay`. A decision without
/// statuses (a deny cache's) says nothing of the queues: a shaping policy it names waits
/// its whole `max_delay`, the others are not counted (counting each a whole `max_delay`
/// would refuse waits that fit).
fn queued_after(
    policies: &PolicySet,
    decision: &Decision,
    named: usize,
    retry_after: Duration,
) -> Duration {
    let statuses = decision.statuses();
    policies
        .iter()
        .enumerate()
        .filter(|(_, policy)| !policy.is_shadow())
        .filter_map(|(index, policy)| match policy.algorithm() {
            crate::Algorithm::LeakyShaping { max_delay, .. } => {
                let left = match statuses.get(index) {
                    Some(status) => status.reset.saturating_sub(retry_after),
                    None if index == named => max_delay,
                    None => Duration::ZERO,
                };
                Some(left.min(max_delay))
            }
            _ => None,
        })
        .max()
        .unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Limiter;
    use crate::clock::RuntimeClock;
    use crate::store::{DecideFuture, MemoryStore, Store};
    use crate::{Key, Policy, PolicySet, Rate};

    /// A store whose peeks take ten seconds (a slow Redis).
    struct SlowPeek(MemoryStore<RuntimeClock>);

    impl Store for SlowPeek {
        fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
            self.0.decide(key, policies, cost)
        }

        fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
            let answer = self.0.peek(key, policies).into_ready();
            DecideFuture::new(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                match answer {
                    Ok(answer) => answer,
                    Err(pending) => pending.await,
                }
            })
        }
    }

    /// A waiter that gave up in the queue and reads the key's state while the waiter
    /// ahead of it finishes: the key's queue goes once both are gone (it was kept for
    /// good, one entry for every key this happened to).
    /// A burst of waiters on many keys (a backlog of jobs, each its own customer) grew
    /// the table of queues, and emptied it kept its size for the process's life: about
    /// 70 MB after a million keys. It is given back once mostly empty.
    #[test]
    fn the_table_of_queues_shrinks_once_emptied() {
        let limiter = Limiter::new(
            MemoryStore::new(),
            Policy::token_bucket("jobs", 10, Rate::per_second(10)).unwrap(),
        );
        let keys: Vec<Key> = (0..10_000).map(|n| Key::new(format!("k{n}"))).collect();
        let held: Vec<_> = keys.iter().map(|key| limiter.queue(key)).collect();
        drop(held);
        for key in &keys {
            limiter.forget(key);
        }
        let queues = limiter.shared.queues.lock().unwrap();
        assert_eq!(queues.len(), 0);
        assert!(
            queues.capacity() <= 128,
            "{} places kept",
            queues.capacity()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_is_dropped_when_a_waiter_gives_up_while_the_one_ahead_finishes() {
        let store = SlowPeek(MemoryStore::builder().clock(RuntimeClock::new()).build());
        let policy = Policy::leaky_bucket_shaping(
            "paced",
            Rate::new(1, Duration::from_secs(10)),
            Duration::from_secs(60),
        )
        .unwrap();
        let limiter = Limiter::new(store, policy);
        let key = Key::new("k");
        limiter
            .until_ready(&key, 1, Duration::from_secs(60))
            .await
            .unwrap();
        // Sleeps its shaping delay (10 s) holding the key's turn.
        let ahead = {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::from_secs(60)).await })
        };
        tokio::task::yield_now().await;
        // Gives up at 5 s, then reads the state until 15 s; the one ahead ends at 10 s.
        let gave_up = limiter.until_ready(&key, 1, Duration::from_secs(5)).await;
        assert!(gave_up.is_err());
        assert!(ahead.await.unwrap().is_ok());
        let queues = limiter.shared.queues.lock().unwrap().len();
        assert_eq!(queues, 0, "no waiter is left, and no queue");
    }
}
