//! When the store fails: failure modes, the local fallback and the circuit breaker.
//!
//! A store failure (unreachable, timed out, answering garbage) is never a rate decision.
//! The layer answers it with its [`FailureMode`]: a local in-process limiter with the same
//! policies (the default: still limited, still answering), `503` (fail closed: money
//! paths), or letting requests through (fail open). A [`CircuitBreaker`] stops calling a
//! store that keeps failing, probes it after a cool-down and returns to it by itself.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::clock::{Clock, MonotonicClock};
use crate::decision::{Decision, Outcome};
use crate::key::Key;

use crate::policy::{Algorithm, MAX_PERIOD, Policy, PolicySet, Rate};
use crate::store::{MemoryStore, StoreError};

/// What the layer does with a request whose store failed.
///
/// The three modes over a store that cannot be reached:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::{DecideFuture, FailureMode, Key, LocalFallback, Policy, PolicySet, Rate};
/// use tollgate::{RateLimitLayer, Store, StoreError, StoreErrorKind};
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
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let api = Policy::token_bucket("api", 30, Rate::per_hour(30))?;
/// let service = |mode: FailureMode| {
///     RateLimitLayer::new(Away)
///         .policy(api.clone())
///         .key(HeaderKey::new("x-api-key"))
///         .on_store_error(mode)
///         .layer(service_fn(|_: Request<()>| async {
///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///         }))
/// };
/// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
///
/// // Three replicas: when Redis is down, each enforces a third of the limit locally.
/// let fallback = service(FailureMode::Fallback(LocalFallback::new().share(1.0 / 3.0)));
/// for _ in 0..10 {
///     assert_eq!(fallback.clone().oneshot(request()).await?.status(), StatusCode::OK);
/// }
/// let denied = fallback.clone().oneshot(request()).await?;
/// assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
///
/// // Fail closed: 503, with when to ask again.
/// let closed = service(FailureMode::FailClosed).oneshot(request()).await?;
/// assert_eq!(closed.status(), StatusCode::SERVICE_UNAVAILABLE);
/// assert_eq!(closed.headers()["retry-after"], "1");
///
/// // Fail open: the request goes through, with no rate-limit fields.
/// let open = service(FailureMode::FailOpen).oneshot(request()).await?;
/// assert_eq!(open.status(), StatusCode::OK);
/// assert!(!open.headers().contains_key("ratelimit"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum FailureMode {
    /// Decide with a local in-process limiter under the same policies (the default). It
    /// keeps every replica protected while the shared store is away; N replicas then
    /// admit up to N times the limit, unless [`LocalFallback::share`] scales it down.
    Fallback(LocalFallback),
    /// Answer `503 Service Unavailable` with a `Retry-After` of the breaker's cool-down
    /// left (a second while it is closed): for paths where admitting unmetered traffic
    /// costs more than refusing it. A store that cannot decide the policies at all
    /// ([`StoreErrorKind::Unsupported`](crate::store::StoreErrorKind::Unsupported): a
    /// set-up error, no outage) is answered `500 Internal Server Error`, with no wait.
    FailClosed,
    /// Let the request through, without rate-limit headers.
    FailOpen,
}

impl Default for FailureMode {
    fn default() -> Self {
        FailureMode::Fallback(LocalFallback::new())
    }
}

/// The local limiter a layer falls back to while its store fails.
///
/// It decides in an in-process store of its own ([`store`](Self::store)), under the
/// layer's policies or their [`share`](Self::share), and the response's rate-limit
/// fields describe the policies it applied:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::{DecideFuture, FailureMode, Key, LocalFallback, Policy, PolicySet, Rate};
/// use tollgate::{RateLimitLayer, Store, StoreError, StoreErrorKind};
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
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let fallback = LocalFallback::new().share(0.5); // two replicas
/// let service = RateLimitLayer::new(Away)
///     .policy(Policy::token_bucket("api", 100, Rate::per_hour(100))?)
///     .key(HeaderKey::new("x-api-key"))
///     .on_store_error(FailureMode::Fallback(fallback.clone()))
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///     }));
/// let request = Request::get("/").header("x-api-key", "k1").body(())?;
/// let response = service.oneshot(request).await?;
/// assert_eq!(response.status(), StatusCode::OK);
/// assert!(response.headers()["ratelimit-policy"].to_str()?.starts_with("\"api\";q=50;"));
/// assert!(response.headers()["ratelimit"].to_str()?.starts_with("\"api\";r=49;"));
/// assert_eq!(fallback.store().len(), 1); // the client's state, held locally
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct LocalFallback {
    store: MemoryStore,
    share: f64,
    /// A share that is no share (0 or below, NaN, below one millionth): refused when the
    /// layer is built.
    refused_share: Option<f64>,
    scaled: Arc<Mutex<Vec<(PolicySet, PolicySet)>>>,
}

/// Scaled policy sets kept per fallback; resolvers build few distinct sets.
const SCALED_CACHE: usize = 64;

impl Default for LocalFallback {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalFallback {
    /// A fallback with its own in-process store and the full limits. A layer's clones
    /// share it; layers built apart that spend one budget on the store (a helper that
    /// builds a layer per route) do not, and each admits the whole limit during an
    /// outage: clone one layer, or give them one store with [`LocalFallback::with_store`]
    /// (a `Limiter` spending the same budget too).
    ///
    /// Two layers built by one helper, a search that costs 5 and a home page that costs
    /// 1, given one fallback store: while the shared store is away, what the searches
    /// spend, the home page no longer has.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{DecideFuture, FailureMode, Key, LocalFallback, MemoryStore, Policy};
    /// use tollgate::{PolicySet, Rate, RateLimitLayer, Store, StoreError, StoreErrorKind};
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
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = Away; // the shared store (Redis in a fleet), away for now
    /// let fallback = MemoryStore::new();
    /// let api = Policy::token_bucket("api", 100, Rate::per_hour(100))?;
    /// let layer = |cost: u64| {
    ///     RateLimitLayer::new(store.clone())
    ///         .policy(api.clone())
    ///         .key(HeaderKey::new("x-api-key"))
    ///         .cost(cost)
    ///         .on_store_error(FailureMode::Fallback(LocalFallback::with_store(fallback.clone())))
    ///         .layer(service_fn(|_: Request<()>| async {
    ///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///         }))
    /// };
    /// let (search, home) = (layer(5), layer(1));
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    /// for _ in 0..20 {
    ///     assert_eq!(search.clone().oneshot(request()).await?.status(), StatusCode::OK);
    /// }
    /// // The 100 are spent, on the home page too.
    /// assert_eq!(home.oneshot(request()).await?.status(), StatusCode::TOO_MANY_REQUESTS);
    /// # Ok(()) }
    /// ```
    pub fn new() -> Self {
        Self::with_store(MemoryStore::new())
    }

    /// A fallback deciding in `store`.
    ///
    /// A `Limiter` and a layer that spend one budget share its fallback store through
    /// this: here a user's WebSocket messages (the limiter) spend what the user's HTTP
    /// requests (the layer) would have, while the shared store is away.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::limiter::Limiter;
    /// use tollgate::{DecideFuture, FailureMode, Key, LocalFallback, MemoryStore, Policy};
    /// use tollgate::{PolicySet, Rate, RateLimitLayer, Store, StoreError, StoreErrorKind};
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
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let fallback = MemoryStore::new();
    /// let mode = || FailureMode::Fallback(LocalFallback::with_store(fallback.clone()));
    /// let user = Policy::token_bucket("user", 100, Rate::per_hour(100))?;
    /// let by_user = HeaderKey::new("x-user");
    ///
    /// let messages = Limiter::new(Away, user.clone()).on_store_error(mode());
    /// let http = RateLimitLayer::new(Away)
    ///     .policy(user)
    ///     .key(by_user.clone())
    ///     .on_store_error(mode())
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    ///
    /// // The user's messages spend the whole budget...
    /// assert!(messages.check(&by_user.key_for("alice")?, 100).await?.is_allowed());
    /// // ...and the user's next HTTP request finds none left.
    /// let request = Request::get("/").header("x-user", "alice").body(())?;
    /// assert_eq!(http.oneshot(request).await?.status(), StatusCode::TOO_MANY_REQUESTS);
    /// # Ok(()) }
    /// ```
    pub fn with_store(store: MemoryStore) -> Self {
        Self {
            store,
            share: 1.0,
            refused_share: None,
            scaled: Arc::default(),
        }
    }

    /// Enforces `share` of every limit and rate (for example `1.0 / replicas`), so the
    /// fleet as a whole stays near the limit while it decides locally. Quotas are rounded
    /// up when the product is not whole (0.07 of 100 is 7, of 101 is 8), so each replica
    /// admits at least one; a share above 1 is 1.
    ///
    /// A share of 0 or below, or NaN (an integer `1 / replicas`, say), is no share, and
    /// one below one millionth would stretch every rate to days or years: a layer with
    /// either is refused when it is built ([`RateLimitLayer::validate`], and
    /// `layer` panics with the message), and a warning says so. (Meanwhile the fallback
    /// keeps the whole limits, as without a share.)
    ///
    /// ```
    /// use tollgate::{FailureMode, LocalFallback, MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// let replicas = 3;
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::token_bucket("api", 30, Rate::per_second(30))?)
    ///     .on_store_error(FailureMode::Fallback(LocalFallback::new().share((1 / replicas) as f64)));
    /// assert!(layer.validate().unwrap_err().contains("share must be above 0"));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// [`RateLimitLayer::validate`]: crate::RateLimitLayer::validate
    pub fn share(mut self, share: f64) -> Self {
        if share >= MIN_SHARE {
            self.share = share.min(1.0);
            self.refused_share = None;
        } else {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                share,
                "LocalFallback::share must be at least one millionth: a layer with it is \
                 refused when built"
            );
            self.share = 1.0;
            self.refused_share = Some(share);
        }
        // Sets scaled for another share (a clone's cache) must not be reused.
        self.scaled = Arc::default();
        self
    }

    /// The set-up mistake of this fallback, if any (a share that is no share); the caller
    /// (the layer, a `Limiter`) puts its name before it.
    pub(crate) fn check(&self) -> Result<(), String> {
        match self.refused_share {
            Some(share) if share > 0.0 => Err(format!(
                "LocalFallback::share must be at least one millionth (one over a million \
                 replicas), got {share}: a share that small stretches every rate to days \
                 or years"
            )),
            Some(share) => Err(format!(
                "LocalFallback::share must be above 0 (a replica's part of each limit, such \
                 as 1.0 / replicas), got {share}"
            )),
            None => Ok(()),
        }
    }

    /// The policies this fallback decides `set` with: `set` itself, or every policy
    /// scaled to the [`share`](Self::share) (quotas rounded up, at least 1; rates slowed
    /// by stretching their period; windows and delay bounds unchanged); without their
    /// penalties either way (a stand-in's denials count towards no block).
    ///
    /// ```
    /// use tollgate::{LocalFallback, Policy, PolicySet, Rate};
    ///
    /// let set = PolicySet::from(Policy::token_bucket("api", 30, Rate::per_second(30))?);
    /// let third = LocalFallback::new().share(1.0 / 3.0).policies_for(&set);
    /// assert_eq!(third[0].limit(), 10);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn policies_for(&self, set: &PolicySet) -> PolicySet {
        let set = set.without_penalties();
        if self.share >= 1.0 {
            set
        } else {
            scale_set(&set, self.share)
        }
    }

    /// The in-process store the fallback decides in.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    /// Adjusts a debit this fallback made, under the policies it applied (see
    /// `Store::adjust`).
    pub(crate) fn adjust(
        &self,
        key: &Key,
        applied: &PolicySet,
        adjustment: &crate::store::Adjustment,
    ) -> Decision {
        self.store.adjust_now(key.as_str(), applied, adjustment)
    }

    /// Decides locally; returns the decision and the policies it applied, or `None` when
    /// only the [`share`](Self::share) stands in the way: a cost the policies admit but
    /// their share of the quota never can, which the outage refuses, not the client's
    /// mistake. A cost the policies themselves never admit is told with their quota, not
    /// the share's.
    ///
    /// Decided without the policies' penalties: a stand-in's denials come from the outage
    /// (a share, one replica's count), not from a client past its real limit, and count
    /// towards no block (as a shadow layer's and a waiter's do not).
    pub(crate) fn decide(
        &self,
        key: &Key,
        policies: &PolicySet,
        cost: u64,
    ) -> Option<(Decision, PolicySet)> {
        let unpenalised;
        let policies = if policies.has_penalties() {
            unpenalised = policies.without_penalties();
            &unpenalised
        } else {
            policies
        };
        if self.share >= 1.0 {
            return Some((
                self.store.check(key.as_str(), policies, cost),
                policies.clone(),
            ));
        }
        let scaled = {
            let mut cache = self.scaled.lock().unwrap_or_else(PoisonError::into_inner);
            match cache
                .iter()
                .find(|(original, _)| original.same_as(policies))
            {
                Some((_, scaled)) => scaled.clone(),
                None => {
                    let scaled = scale_set(policies, self.share);
                    if cache.len() >= SCALED_CACHE {
                        cache.remove(0);
                    }
                    cache.push((policies.clone(), scaled.clone()));
                    scaled
                }
            }
        };
        let decision = self.store.check(key.as_str(), &scaled, cost);
        if let Outcome::CostExceedsLimit { .. } = decision.outcome() {
            let index = policies.never_admits(cost)?;
            let outcome = Outcome::CostExceedsLimit {
                policy: index,
                cost,
                limit: policies[index].limit(),
            };
            let statuses = decision.statuses().iter().copied();
            return Some((Decision::new(outcome, statuses), scaled));
        }
        Some((decision, scaled))
    }
}

/// The smallest share a fallback takes (one over a million replicas): below it, every
/// rate would be stretched to days or years.
pub(crate) const MIN_SHARE: f64 = 1e-6;

/// `n` times `share`, rounded up only when it is not whole: the double nearest a decimal
/// share is a hair off it (0.07 is above by 7e-18, and 100 times it is 7.000000000000001),
/// so a product within a few units of a double's precision of a whole number is that
/// number.
fn share_of(n: u64, share: f64) -> u64 {
    let product = n as f64 * share;
    let nearest = product.round();
    let whole = (product - nearest).abs() <= product * 8.0 * f64::EPSILON;
    (if whole { nearest } else { product.ceil() }) as u64
}

/// `policy` with `share` (in (0, 1)) of its quota and rate: quotas rounded up (at least
/// 1), rates slowed by stretching their period; windows and delay bounds stay. What one
/// replica among several enforces on its own while the shared store is away.
fn scale_policy(policy: &Policy, share: f64) -> Policy {
    if !(share > 0.0 && share < 1.0) {
        return policy.clone();
    }
    let count = |n: u64| share_of(n, share).clamp(1, n);
    let rate = |rate: Rate| {
        // A rate faster than a unit a millisecond is decided in lowest terms with a
        // period under the shortest a policy takes (10,000 a second is one per 100 µs):
        // amount and period grow together first, to a period of at least that, by a
        // whole multiple of the period's microseconds (as the rate is decided), so the
        // amount grows to no more than the rate's as written.
        let shortest = crate::policy::MIN_PERIOD.as_micros();
        let micros = rate.period().as_micros().max(1);
        let times = if micros < shortest {
            shortest.div_ceil(micros)
        } else {
            1
        };
        let period = rate.period().as_secs_f64() * times as f64 / share;
        Rate::new(
            rate.amount()
                .saturating_mul(u64::try_from(times).unwrap_or(u64::MAX)),
            Duration::from_secs_f64(period.min(MAX_PERIOD.as_secs_f64())),
        )
    };
    // From the rate as decided: two spellings of one policy scale alike.
    let algorithm = match policy.decided() {
        Algorithm::FixedWindow { limit, window } => Algorithm::FixedWindow {
            limit: count(limit),
            window,
        },
        Algorithm::SlidingLog { limit, window } => Algorithm::SlidingLog {
            limit: count(limit),
            window,
        },
        Algorithm::SlidingWindow {
            limit,
            window,
            sub_windows,
        } => Algorithm::SlidingWindow {
            limit: count(limit),
            window,
            sub_windows,
        },
        Algorithm::TokenBucket { capacity, refill } => Algorithm::TokenBucket {
            capacity: count(capacity),
            refill: rate(refill),
        },
        Algorithm::LeakyBucket { capacity, leak } => Algorithm::LeakyBucket {
            capacity: count(capacity),
            leak: rate(leak),
        },
        Algorithm::LeakyShaping { leak, max_delay } => Algorithm::LeakyShaping {
            leak: rate(leak),
            max_delay,
        },
        Algorithm::Gcra { rate: r, burst } => Algorithm::Gcra {
            rate: rate(r),
            burst: count(burst),
        },
        Algorithm::Concurrency { limit, lease } => Algorithm::Concurrency {
            limit: count(limit),
            lease,
        },
    };
    Policy::build(policy.name(), algorithm)
        .map(|scaled| scaled.with_unit(policy.unit()))
        .map(|scaled| {
            if policy.is_shadow() {
                scaled.shadow()
            } else {
                scaled
            }
        })
        .and_then(|scaled| match policy.penalty() {
            Some(penalty) => scaled.with_penalty(penalty),
            None => Ok(scaled),
        })
        .unwrap_or_else(|error| {
            // Not known to happen (a share of a valid policy is valid): said loudly, as
            // it leaves this replica the whole policy while the store is away.
            #[cfg(feature = "tracing")]
            tracing::error!(target: "tollgate", policy = policy.name(), share, %error, "the fallback could not scale this policy to its share; it applies the whole policy");
            let _ = error;
            debug_assert!(false, "a policy scaled to a share was refused");
            policy.clone()
        })
}

/// Every policy of `set` scaled to `share`.
fn scale_set(set: &PolicySet, share: f64) -> PolicySet {
    PolicySet::from_vec(
        set.iter()
            .map(|policy| scale_policy(policy, share))
            .collect(),
    )
}

/// When to stop calling a failing store, and when to try it again.
///
/// After `failures` failures in a row the breaker opens: requests skip the store and get
/// the failure mode at once, without waiting for a timeout. After `cool_down` one request
/// probes the store: a decision from the store closes the breaker; a timeout or an
/// unavailable store (or a refusal every request meets) starts a new cool-down; an error
/// that says nothing of an outage (one request's refusal, a policy the store cannot
/// decide) lets the next request probe. A request dropped after waiting on the store for
/// 100 ms, with no answer from the store to any request meanwhile, counts as a timeout.
/// A cool-down longer than [`MAX_PERIOD`](crate::policy::MAX_PERIOD) is refused when the
/// layer is built.
///
///
/// Here the store is down: after three failures in a row the layer stops calling it
/// (the local fallback answers every request), and the cool-down of a minute is not
/// over before the example ends. [`with_clock`](Self::with_clock) shows the probe.
///
/// ```
/// use std::convert::Infallible;
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::{CircuitBreaker, DecideFuture, Key, Policy, PolicySet, Rate};
/// use tollgate::{RateLimitLayer, Store, StoreError, StoreErrorKind};
///
/// /// A store that is down, and counts the calls it gets.
/// #[derive(Clone, Default)]
/// struct Down(Arc<AtomicU32>);
///
/// impl Store for Down {
///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
///         self.0.fetch_add(1, Ordering::Relaxed);
///         let refused = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
///         DecideFuture::ready(Err(refused))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let down = Down::default();
/// let service = RateLimitLayer::new(down.clone())
///     .policy(Policy::token_bucket("api", 100, Rate::per_hour(100))?)
///     .key(HeaderKey::new("x-api-key"))
///     .circuit_breaker(CircuitBreaker::new(3, Duration::from_secs(60)))
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///     }));
/// for _ in 0..10 {
///     let request = Request::get("/").header("x-api-key", "k1").body(())?;
///     assert_eq!(service.clone().oneshot(request).await?.status(), StatusCode::OK);
/// }
/// assert_eq!(down.0.load(Ordering::Relaxed), 3); // the store was called three times
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CircuitBreaker {
    failures: u32,
    cool_down: Duration,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("failures", &self.failures)
            .field("cool_down", &self.cool_down)
            .finish_non_exhaustive()
    }
}

impl Default for CircuitBreaker {
    /// Opens after 5 failures in a row, probes every second.
    fn default() -> Self {
        Self::new(5, Duration::from_secs(1))
    }
}

impl CircuitBreaker {
    /// Opens after `failures` failures in a row (at least 1), probes after `cool_down`.
    ///
    /// A breaker of 0 failures opens after the first:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{CircuitBreaker, DecideFuture, Key, Policy, PolicySet, Rate};
    /// use tollgate::{RateLimitLayer, Store, StoreError, StoreErrorKind};
    ///
    /// /// A store that is down, and counts the calls it gets.
    /// #[derive(Clone, Default)]
    /// struct Down(Arc<AtomicU32>);
    ///
    /// impl Store for Down {
    ///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
    ///         self.0.fetch_add(1, Ordering::Relaxed);
    ///         let refused = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
    ///         DecideFuture::ready(Err(refused))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let down = Down::default();
    /// let service = RateLimitLayer::new(down.clone())
    ///     .policy(Policy::token_bucket("api", 100, Rate::per_hour(100))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .circuit_breaker(CircuitBreaker::new(0, Duration::from_secs(60)))
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// for _ in 0..5 {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(())?;
    ///     assert_eq!(service.clone().oneshot(request).await?.status(), StatusCode::OK);
    /// }
    /// assert_eq!(down.0.load(Ordering::Relaxed), 1);
    /// # Ok(()) }
    /// ```
    pub fn new(failures: u32, cool_down: Duration) -> Self {
        Self {
            failures: failures.max(1),
            cool_down,
            clock: None,
        }
    }

    /// Failures in a row that open the breaker.
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    /// How long the breaker stays open before a probe.
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn cool_down(&self) -> Duration {
        self.cool_down
    }

    /// Measures the cool-down on `clock` instead of the monotonic clock (for tests, a
    /// [`ManualClock`](crate::clock::ManualClock)).
    ///
    /// Below, a store fails twice and the breaker opens: requests get the failure mode
    /// (here fail-closed, whose `503` says when the store is asked again) without a call
    /// to the store. The store comes back, but is left alone until the cool-down is
    /// over on the manual clock; then one request probes it, and its answer closes the
    /// breaker.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{CircuitBreaker, DecideFuture, FailureMode, Key, MemoryStore, Policy};
    /// use tollgate::{PolicySet, Rate, RateLimitLayer, Store, StoreError, StoreErrorKind};
    ///
    /// /// A store that is down until `up` is set, and counts the calls it gets.
    /// #[derive(Clone, Default)]
    /// struct Flaky {
    ///     memory: MemoryStore,
    ///     up: Arc<AtomicBool>,
    ///     calls: Arc<AtomicU32>,
    /// }
    ///
    /// impl Store for Flaky {
    ///     fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
    ///         self.calls.fetch_add(1, Ordering::Relaxed);
    ///         if self.up.load(Ordering::Relaxed) {
    ///             return self.memory.decide(key, policies, cost);
    ///         }
    ///         let refused = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
    ///         DecideFuture::ready(Err(refused))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new();
    /// let flaky = Flaky::default();
    /// let breaker = CircuitBreaker::new(2, Duration::from_secs(10)).with_clock(clock.clone());
    /// let service = RateLimitLayer::new(flaky.clone())
    ///     .policy(Policy::token_bucket("api", 100, Rate::per_hour(100))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .on_store_error(FailureMode::FailClosed)
    ///     .circuit_breaker(breaker)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let call = || {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///     service.clone().oneshot(request)
    /// };
    /// let calls = || flaky.calls.load(Ordering::Relaxed);
    ///
    /// // Two failures in a row open the breaker.
    /// for _ in 0..2 {
    ///     assert_eq!(call().await?.status(), StatusCode::SERVICE_UNAVAILABLE);
    /// }
    /// assert_eq!(calls(), 2);
    /// // Open: the store is not called.
    /// let skipped = call().await?;
    /// assert_eq!(skipped.status(), StatusCode::SERVICE_UNAVAILABLE);
    /// assert_eq!(skipped.headers()["retry-after"], "10");
    /// assert_eq!(calls(), 2);
    ///
    /// // The store is back, but the cool-down is not over.
    /// flaky.up.store(true, Ordering::Relaxed);
    /// clock.advance(Duration::from_secs(4));
    /// let waiting = call().await?;
    /// assert_eq!(waiting.headers()["retry-after"], "6");
    /// assert_eq!(calls(), 2);
    ///
    /// // Over: one request probes the store, and its answer closes the breaker.
    /// clock.advance(Duration::from_secs(6));
    /// assert_eq!(call().await?.status(), StatusCode::OK);
    /// assert_eq!(call().await?.status(), StatusCode::OK);
    /// assert_eq!(calls(), 4);
    /// # Ok(()) }
    /// ```
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }
}

/// What the breaker says about one request.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Closed: call the store.
    Call,
    /// Open, cool-down over: this request probes the store. The guard releases the probe
    /// however the request ends, so a probe whose request is dropped (client gone, an
    /// outer timeout) never leaves the breaker open for good.
    Probe(ProbeGuard),
    /// Open: do not call the store.
    Skip,
}

/// Holds the breaker's single probe; releases it when dropped.
///
/// A probe whose request ends before the store answered (a client gone, an outer timeout)
/// says nothing of the store. Dropped after waiting on it for [`PROBE_PATIENCE`], the
/// store may well be hanging: its drop starts a new cool-down before it lets the next
/// request probe, so a store that never answers is not probed by one request after
/// another. Dropped sooner (a client that resets its request at once, on purpose or
/// not), its [`StandIn`] asks the store in its place, on the runtime, and holds the probe
/// until the answer (bounded by the store timeout), which is the probe's: clients that
/// cancel every probe cannot keep a healthy store's breaker open, nor send a sick store
/// more than one probe at a time. With no stand-in or no runtime, the next request
/// probes once [`PROBE_PATIENCE`] from this one's start is over.
#[derive(Debug)]
pub(crate) struct ProbeGuard {
    breaker: Arc<Breaker>,
    ticket: u64,
    /// The breaker's clock when the probe was let through.
    started: u64,
    /// Set once the probe's outcome was reported (an answer, a failure, or an answer
    /// that did not come from the store and so tested nothing).
    reported: AtomicBool,
    stand_in: Option<StandIn>,
}

/// What asks the store in place of a probe whose request was dropped before the answer:
/// a peek at its key under its policies (no debit), and the store timeout it is held to.
pub(crate) struct StandIn {
    pub(crate) peek: Box<dyn FnOnce() -> crate::store::DecideFuture + Send>,
    pub(crate) timeout: Duration,
}

impl fmt::Debug for StandIn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StandIn")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ProbeGuard {
    /// The probe's request got an outcome; its drop only releases the flag.
    pub(crate) fn report(&self) {
        self.reported.store(true, Ordering::Relaxed);
    }

    /// Asks the store in this probe's place, should its request be dropped before the
    /// answer (see [`ProbeGuard`]).
    pub(crate) fn with_stand_in(mut self, stand_in: StandIn) -> Self {
        self.stand_in = Some(stand_in);
        self
    }

    /// The stand-in's answer, reported as the probe's: the store's answer closes the
    /// breaker, an outage starts a new cool-down (see [`Breaker::heard_failure`]). An
    /// answer that tested nothing (a cache's) or a refusal releases the probe once
    /// [`PROBE_PATIENCE`] from its start is over, as a dropped probe without a stand-in
    /// does: clients that cancel every probe send the store no more than that.
    fn stand_in_answered(self, result: &Result<Decision, StoreError>) {
        let patient_until = self.patient_until();
        match result {
            Ok(decision) if !decision.is_cached() => self.breaker.on_success(),
            Ok(_) => self.breaker.hold_until(patient_until),
            Err(error) => {
                crate::telemetry::store_error(error);
                // An outage's new cool-down, if it is one, comes after and stands.
                self.breaker.hold_until(patient_until);
                self.breaker.heard_failure(error, Some(&self));
            }
        }
        self.report();
    }

    /// When [`PROBE_PATIENCE`] from the probe's start is over (on the breaker's clock).
    fn patient_until(&self) -> u64 {
        self.started
            .saturating_add(crate::clock::nanos(PROBE_PATIENCE))
    }
}

impl Drop for ProbeGuard {
    fn drop(&mut self) {
        let patient_until = self.patient_until();
        if !self.reported.load(Ordering::Relaxed)
            && self.breaker.probing.load(Ordering::Acquire) == self.ticket
        {
            // Only while the breaker is open: another request's success may have closed
            // it since the load above, and a dropped probe is no reason to open it.
            let now = self.breaker.clock.now();
            if now.saturating_add(1) < patient_until
                && let Some(stand_in) = self.stand_in.take()
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
            {
                // The probe passes to the stand-in, ticket and all: not released here.
                let probe = ProbeGuard {
                    breaker: Arc::clone(&self.breaker),
                    ticket: self.ticket,
                    started: self.started,
                    reported: AtomicBool::new(false),
                    stand_in: None,
                };
                runtime.spawn(async move {
                    let what = "the circuit breaker's probe (in place of a dropped request)";
                    let result =
                        crate::store::within(stand_in.timeout, what, (stand_in.peek)()).await;
                    probe.stand_in_answered(&result);
                });
                return;
            }
            if now.saturating_add(1) >= patient_until {
                // Counted as the store timing out, as any request so dropped is.
                crate::telemetry::store_error(&StoreError::new(
                    crate::store::StoreErrorKind::Timeout,
                    format!(
                        "the circuit breaker's probe was dropped after waiting {:?} on the \
                         store",
                        Duration::from_nanos(now.saturating_sub(self.started))
                    ),
                ));
                self.breaker.renew_cool_down();
            } else {
                self.breaker.hold_until(patient_until);
            }
        }
        // Only this probe's own ticket is cleared: a newer probe keeps its flag.
        self.breaker.release_probe(self.ticket);
    }
}

/// A request waiting on the store's answer (the probe's own guard does this for the
/// probe). Dropped unanswered after [`PROBE_PATIENCE`] (an outer timeout or the client gave
/// up on a store that may well be hanging), with no answer from the store to any request
/// meanwhile, it counts as the store timing out: counted, logged as store errors are, and
/// towards the breaker, as the store timeout would have. Without it, a store timeout
/// longer than an outer one let a hung store go unseen: no error counted, the breaker
/// never opened, and every request waited on the store until the outer timeout. Dropped
/// sooner, or while the store answers others (slow, not hanging: clients that give up at
/// once cannot open the breaker of a store that answers), it says nothing of the store.
#[derive(Debug)]
#[must_use = "a request's wait is ended with `answered`"]
pub(crate) struct Waiting {
    breaker: Arc<Breaker>,
    /// The breaker's clock when the request began to wait.
    started: u64,
    /// The breaker's count of the store's answers then: one since, and the drop says
    /// nothing.
    answers: u64,
    answered: bool,
}

impl Waiting {
    /// The store answered, failed or timed out (`result`): its outcome is reported where
    /// it is read. An answer a lease or the deny cache gave says nothing of the store.
    #[inline]
    pub(crate) fn answered(mut self, result: &Result<Decision, StoreError>) {
        self.answered = true;
        if result.as_ref().is_ok_and(|answer| !answer.is_cached()) {
            let now = self.breaker.clock.now().saturating_add(1);
            self.breaker.answered_at.fetch_max(now, Ordering::Relaxed);
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let waited = self.breaker.clock.now().saturating_sub(self.started);
        if u128::from(waited) < PROBE_PATIENCE.as_nanos()
            || self.breaker.answered_at.load(Ordering::Relaxed) > self.started
            || self.breaker.answers.load(Ordering::Acquire) != self.answers
        {
            return;
        }
        let error = StoreError::new(
            crate::store::StoreErrorKind::Timeout,
            format!(
                "a request was dropped after waiting {:?} on the store for its decision",
                Duration::from_nanos(waited)
            ),
        );
        crate::telemetry::store_error(&error);
        // A failure since the wait began: an answer that lands meanwhile ends its run.
        self.breaker.failed_since(&error, None, self.answers);
    }
}

/// How long a probe (or any request) waits on the store before its drop counts as the
/// store hanging: a store that answers at all answers well within it.
pub(crate) const PROBE_PATIENCE: Duration = Duration::from_millis(100);

/// The breaker's shared state, and the once-per-transition warnings.
#[derive(Debug)]
pub(crate) struct Breaker {
    /// Failures in a row that open the breaker, and its cool-down in nanoseconds: set
    /// again in place by a configuration reload ([`Breaker::set`]).
    threshold: AtomicU32,
    cool_down: AtomicU64,
    clock: Arc<dyn Clock>,
    failures: AtomicU32,
    /// When (clock nanoseconds + 1) the store last answered a request that waited on it:
    /// a request dropped while it waited says nothing of a store that answered since.
    answered_at: AtomicU64,
    /// How many times the store's answer closed the breaker (or cleared a run of
    /// failures): a failure counted before one of them opens nothing.
    answers: AtomicU64,
    /// Held while the store's answer closes the breaker and while a failure opens it:
    /// a failure opens only if no answer came since it began (read under this lock), so
    /// an older failure never opens over an answer, nor undoes a newer failure's open.
    transitions: Mutex<()>,
    /// 0: closed. Otherwise the instant (clock nanoseconds + 1) from which to probe.
    open_until: AtomicU64,
    /// The ticket of the probe in flight; 0 when there is none.
    probing: AtomicU64,
    tickets: AtomicU64,
    degraded: AtomicBool,
    /// The two warnings, said at most once a [`SAY_EVERY`]: the instant (clock nanoseconds
    /// + 1) the last "failed" was said (0: never)...
    said_at: AtomicU64,
    /// ...whether this outage's "failed" was said (its "answers again" is said then)...
    said: AtomicBool,
    /// ...and how many outages went unsaid since.
    unsaid: AtomicU64,
    /// The store left the last adjustment sent to it (a settle, a release) unanswered:
    /// given up on, or sent on no connection. Until it answers one again, responses do
    /// not wait on their settles. Apart from the breaker's states: an adjustment says
    /// nothing of decisions, which a lease or a deny cache may answer without the store
    /// (counted as failures, settles cut off for a blip would open a breaker that only
    /// the store's own decisions close).
    adjustments_unanswered: AtomicBool,
}

/// The store failing and answering again is said at most once in this long: a store that
/// fails now and then (a timeout in a hundred, one shard of a Cluster away) is one thing
/// to tell, not two lines per failure.
const SAY_EVERY: Duration = Duration::from_secs(30);

impl std::fmt::Debug for dyn Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

impl Drop for Breaker {
    /// A layer (or `Limiter`) dropped while its store fails takes its count out of the
    /// process's gauge: nothing else ever would.
    fn drop(&mut self) {
        if *self.degraded.get_mut() {
            crate::telemetry::fallback_active(false);
        }
    }
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        let clock = config
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(MonotonicClock::new()));
        Self {
            threshold: AtomicU32::new(config.failures),
            cool_down: AtomicU64::new(crate::clock::nanos(config.cool_down)),
            clock,
            failures: AtomicU32::new(0),
            answered_at: AtomicU64::new(0),
            answers: AtomicU64::new(0),
            transitions: Mutex::new(()),
            open_until: AtomicU64::new(0),
            probing: AtomicU64::new(0),
            tickets: AtomicU64::new(1),
            degraded: AtomicBool::new(false),
            said_at: AtomicU64::new(0),
            said: AtomicBool::new(false),
            unsaid: AtomicU64::new(0),
            adjustments_unanswered: AtomicBool::new(false),
        }
    }

    /// Should this request call the store? Closed: yes. Open: no, but one request per
    /// cool-down probes it.
    #[inline]
    pub(crate) fn admit(self: &Arc<Self>) -> Admission {
        let until = self.open_until.load(Ordering::Relaxed);
        if until == 0 {
            return Admission::Call;
        }
        let now = self.clock.now().saturating_add(1);
        if now < until {
            return Admission::Skip;
        }
        if self.probing.load(Ordering::Relaxed) != 0 {
            // A probe is in flight: no need to contend for a ticket.
            return Admission::Skip;
        }
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        match self
            .probing
            .compare_exchange(0, ticket, Ordering::AcqRel, Ordering::Relaxed)
        {
            // The cool-down read above may have been renewed since (the probe before
            // failed and freed the flag): read again, now the flag is this request's.
            Ok(_) => match self.open_until.load(Ordering::Acquire) {
                // A late success of another request closed the breaker since: a call as
                // any other (a probe's one failure would open it again at once).
                0 => {
                    self.release_probe(ticket);
                    Admission::Call
                }
                until if now < until => {
                    self.release_probe(ticket);
                    Admission::Skip
                }
                _ => Admission::Probe(ProbeGuard {
                    breaker: Arc::clone(self),
                    ticket,
                    started: now,
                    reported: AtomicBool::new(false),
                    stand_in: None,
                }),
            },
            Err(_) => Admission::Skip,
        }
    }

    /// Frees the probe flag when `ticket` holds it (a newer probe keeps its own).
    fn release_probe(&self, ticket: u64) {
        let _ = self
            .probing
            .compare_exchange(ticket, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The configured cool-down.
    pub(crate) fn cool_down(&self) -> Duration {
        Duration::from_nanos(self.cool_down.load(Ordering::Relaxed))
    }

    /// Takes `config`'s settings (a configuration reload), keeping the state: an open
    /// breaker stays open until its probe, a run of failures goes on, and the next
    /// cool-down is the new one. A running cool-down longer than what is left of a new,
    /// shorter one ends within the new length from now: a reload that fixes a slip
    /// (`"1d"` for `"1s"`) does not leave the store shunned for the rest of the slip.
    /// (Its clock stays the one it was made with.)
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn set(&self, config: &CircuitBreaker) {
        self.threshold.store(config.failures, Ordering::Relaxed);
        self.cool_down
            .store(crate::clock::nanos(config.cool_down), Ordering::Relaxed);
        let latest = self.cool_down_end();
        let _ = self
            .open_until
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |current| {
                (current > latest).then_some(latest)
            });
    }

    /// A request begins to wait on the store (see [`Waiting`]).
    #[inline]
    pub(crate) fn waiting(self: &Arc<Self>) -> Waiting {
        Waiting {
            breaker: Arc::clone(self),
            started: self.clock.now(),
            answers: self.answers.load(Ordering::Acquire),
            answered: false,
        }
    }

    /// True when this request may call the store (tests of the breaker alone).
    #[cfg(test)]
    pub(crate) fn should_call(self: &Arc<Self>) -> bool {
        match self.admit() {
            Admission::Call => true,
            // The probe stays taken until an answer, as it would while its store call runs.
            Admission::Probe(guard) => {
                std::mem::forget(guard);
                true
            }
            Admission::Skip => false,
        }
    }

    /// The store answered.
    #[inline]
    pub(crate) fn on_success(&self) {
        // It answers adjustments too, as far as anyone can tell.
        if self.adjustments_unanswered.load(Ordering::Relaxed) {
            self.adjustments_unanswered.store(false, Ordering::Relaxed);
        }
        if self.failures.load(Ordering::Relaxed) == 0
            && self.open_until.load(Ordering::Relaxed) == 0
            && !self.degraded.load(Ordering::Relaxed)
        {
            return;
        }
        // The store answered: a request that began to wait before now and is dropped
        // later says nothing of it (see `Waiting`), the probe's answer included.
        let now = self.clock.now().saturating_add(1);
        self.answered_at.fetch_max(now, Ordering::Relaxed);
        let was_degraded = {
            let _transition = self
                .transitions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            // A failure counted before this opens nothing (see `on_failure`).
            self.answers.fetch_add(1, Ordering::Relaxed);
            self.failures.store(0, Ordering::Relaxed);
            self.open_until.store(0, Ordering::Release);
            self.probing.store(0, Ordering::Release);
            // With the close: a failure that opens the breaker after it says the store
            // fails again (never an open breaker on a store said to answer).
            self.degraded.swap(false, Ordering::AcqRel)
        };
        if was_degraded {
            crate::telemetry::fallback_active(false);
            self.say_answers_again();
        }
    }

    /// Ends a said outage: "answers again", once for its "failed".
    fn say_answers_again(&self) {
        if self.said.swap(false, Ordering::AcqRel) {
            #[cfg(feature = "tracing")]
            tracing::warn!(target: "tollgate", "rate-limit store answers again; back to it");
        }
    }

    /// The store failed (or timed out). `probe` is the guard when this request carried the
    /// breaker's probe: only the probe's own failure releases it, so a late failure of a
    /// request sent before the breaker opened never lets a second probe overlap.
    pub(crate) fn on_failure(&self, error: &StoreError, probe: Option<&ProbeGuard>) {
        // A success landing from here on ends this failure's run: it opens nothing.
        self.failed_since(error, probe, self.answers.load(Ordering::Acquire));
    }

    /// [`on_failure`](Self::on_failure) of a failure that began when the breaker had
    /// counted `answers` of the store's answers: one since ends its run.
    fn failed_since(&self, error: &StoreError, probe: Option<&ProbeGuard>, answers: u64) {
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        let started = !self.degraded.swap(true, Ordering::AcqRel);
        if started {
            crate::telemetry::fallback_active(true);
        }
        // Said when the outage starts, or, when it started too soon after the last one
        // was said, at its first failure once that is long enough ago: an outage that goes
        // on is always said.
        if !self.said.load(Ordering::Acquire) {
            let now = self.clock.now().saturating_add(1);
            let last = self.said_at.load(Ordering::Acquire);
            let every = crate::clock::nanos(SAY_EVERY);
            let due = last == 0 || now.saturating_sub(last) >= every;
            if due
                && self
                    .said_at
                    .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                self.said.store(true, Ordering::Release);
                // An outage said late was counted unsaid when it started: not any more.
                let unsaid = self
                    .unsaid
                    .swap(0, Ordering::AcqRel)
                    .saturating_sub(u64::from(!started));
                #[cfg(feature = "tracing")]
                tracing::warn!(target: "tollgate", %error, outages_unsaid_since_last_warning = unsaid, "rate-limit store failed; applying the failure mode until it answers again");
                #[cfg(not(feature = "tracing"))]
                let _ = unsaid;
                // A success may have come between this failure and the warning: it found
                // nothing said, so the pair is ended here, and `said` is never left set
                // while the store answers (the next outage would go unsaid).
                if !self.degraded.load(Ordering::Acquire) {
                    self.say_answers_again();
                }
            } else if started && !due {
                // Not when another failure of this outage won the warning.
                self.unsaid.fetch_add(1, Ordering::Relaxed);
            }
        }
        #[cfg(not(feature = "tracing"))]
        let _ = error;
        let is_probe =
            probe.is_some_and(|guard| self.probing.load(Ordering::Acquire) == guard.ticket);
        if failures >= self.threshold.load(Ordering::Relaxed) || is_probe {
            let until = self.cool_down_end();
            let raised = {
                let _transition = self
                    .transitions
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                // The store answered since this failure began: its run is over (a
                // failure that began since opens the breaker itself). Opened, the store
                // is said to fail, whatever an answer's close since this failure's start
                // set.
                self.answers.load(Ordering::Relaxed) == answers && {
                    self.open_until.store(until, Ordering::Release);
                    !self.degraded.swap(true, Ordering::AcqRel)
                }
            };
            if raised {
                crate::telemetry::fallback_active(true);
            }
        }
        // Released only after the new cool-down is in place, so no request can read the
        // old one and probe at once.
        if let Some(guard) = probe {
            guard.report();
            self.release_probe(guard.ticket);
        }
    }

    /// The store failed a request (`probe` when it was the breaker's probe), or refused
    /// it. An outage (the store unreachable, a timeout) or a failure every request meets
    /// (a pool that cannot authenticate, a primary no sentinel knows), whatever its kind,
    /// counts towards opening the breaker (so that requests do not each open a connection,
    /// or look a primary up, to be refused); a probe's starts a new cool-down. A refusal
    /// that only this request's policies or data may cause (the store answered, but
    /// decided nothing), an error raised before the store was asked or by the layer's own
    /// plumbing: none says whether the store is out. The breaker stays as it is (a refusal
    /// between failures neither ends their run nor an outage), and a probe is released
    /// without a new cool-down, so the next request probes in its place.
    pub(crate) fn heard_failure(&self, error: &StoreError, probe: Option<&ProbeGuard>) {
        use crate::store::StoreErrorKind;
        match error.kind() {
            StoreErrorKind::Unavailable | StoreErrorKind::Timeout => self.on_failure(error, probe),
            _ if error.meets_every_request_as_an_outage() => self.on_failure(error, probe),
            StoreErrorKind::Refused
            | StoreErrorKind::Protocol
            | StoreErrorKind::Unsupported
            | StoreErrorKind::Other => {
                if let Some(probe) = probe {
                    probe.report();
                }
            }
        }
    }

    /// What is left of the cool-down before a request probes the store: zero while the
    /// breaker is closed or its cool-down is over.
    pub(crate) fn cool_down_left(&self) -> Duration {
        let until = self.open_until.load(Ordering::Relaxed);
        if until == 0 {
            return Duration::ZERO;
        }
        let now = self.clock.now().saturating_add(1);
        Duration::from_nanos(until.saturating_sub(now))
    }

    /// The `open_until` of a cool-down that starts now.
    fn cool_down_end(&self) -> u64 {
        let cool_down = self.cool_down.load(Ordering::Relaxed);
        self.clock.now().saturating_add(cool_down).saturating_add(1)
    }

    /// Starts a new cool-down if the breaker is still open; a closed breaker stays closed.
    fn renew_cool_down(&self) {
        let until = self.cool_down_end();
        let _ = self
            .open_until
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |current| {
                (current != 0).then_some(until)
            });
    }

    /// Keeps an open breaker from letting a probe through before `until` (its clock's
    /// instant + 1); a closed breaker stays closed.
    fn hold_until(&self, until: u64) {
        let _ = self
            .open_until
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |current| {
                (current != 0).then_some(current.max(until))
            });
    }

    /// True while the store is failing or skipped.
    pub(crate) fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// True while the breaker holds requests off the store (open, or probing); a failure
    /// below its threshold leaves it closed (degraded, not open).
    pub(crate) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Relaxed) != 0
    }

    /// True while the store leaves adjustments unanswered (see `adjustments_unanswered`).
    pub(crate) fn adjustments_unanswered(&self) -> bool {
        self.adjustments_unanswered.load(Ordering::Relaxed)
    }

    /// The store's answer to an adjustment sent to it (not to the local fallback): an
    /// I/O failure (a timeout, no connection) marks adjustments unanswered, an answer
    /// clears the mark; other errors (a script error, a refusal) say nothing of whether
    /// the store answers. Nor does an answer a wrapper store gave without asking it (a
    /// lease that took a refund back: `Decision::is_cached`): it would clear the mark,
    /// and the next settle sent to a store that leaves them unanswered would wait the
    /// whole timeout.
    pub(crate) fn heard_adjustment(&self, result: &Result<Decision, StoreError>) {
        let unanswered = match result {
            Ok(decision) if decision.is_cached() => return,
            Ok(_) => false,
            Err(error) if error.kind().is_io() => true,
            Err(_) => return,
        };
        if self.adjustments_unanswered.load(Ordering::Relaxed) != unanswered {
            self.adjustments_unanswered
                .store(unanswered, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    /// Two spellings of one policy are one policy under the fallback too: scaled from the
    /// rate as decided (in lowest terms), not as given, whose period the scaling would
    /// stretch past the longest a policy may have (3,650 a 3,650 days, halved, became
    /// 3,650 in 3,660 days, where one a day halved is one in two days).
    #[test]
    fn spellings_of_one_policy_scale_alike() {
        let day = Duration::from_secs(86_400);
        let one = Policy::token_bucket("api", 10, Rate::new(1, day)).unwrap();
        let many = Policy::token_bucket("api", 10, Rate::new(3_650, 3_650 * day)).unwrap();
        let (one, many) = (scale_policy(&one, 0.5), scale_policy(&many, 0.5));
        assert!(
            one.decides_as(&many),
            "{:?} and {:?}",
            one.algorithm(),
            many.algorithm()
        );
        assert_eq!(
            one.algorithm(),
            Algorithm::TokenBucket {
                capacity: 5,
                refill: Rate::new(1, 2 * day)
            }
        );
    }

    #[test]
    fn opens_after_failures_probes_once_and_closes_on_success() {
        let clock = crate::clock::ManualClock::new();
        let breaker = Arc::new(Breaker::new(
            CircuitBreaker::new(2, Duration::from_millis(30)).with_clock(clock.clone()),
        ));
        let error = StoreError::new(StoreErrorKind::Unavailable, "down");
        assert!(breaker.should_call());
        breaker.on_failure(&error, None);
        assert!(breaker.should_call(), "one failure does not open it");
        breaker.on_failure(&error, None);
        assert!(!breaker.should_call(), "two do");
        assert!(breaker.is_degraded());
        clock.advance(Duration::from_millis(29));
        assert!(!breaker.should_call(), "still cooling down");
        clock.advance(Duration::from_millis(1));
        let Admission::Probe(probe) = breaker.admit() else {
            panic!("the probe")
        };
        assert!(!breaker.should_call(), "only one probe at a time");
        breaker.on_failure(&error, Some(&probe));
        drop(probe);
        assert!(!breaker.should_call(), "a failed probe opens it again");
        clock.advance(Duration::from_millis(30));
        assert!(breaker.should_call());
        breaker.on_success();
        assert!(breaker.should_call() && breaker.should_call());
        assert!(!breaker.is_degraded());
    }

    /// An adjustment the store leaves unanswered (a timeout, no connection) marks the
    /// store so until it answers one, or a decision: then responses wait for their
    /// settles again. An answer that is an error of another kind (a script error, a
    /// refusal) says nothing of whether it answers.
    #[test]
    fn adjustments_left_unanswered_are_marked_until_the_store_answers() {
        let breaker = Breaker::new(CircuitBreaker::default());
        let timeout = Err(StoreError::new(StoreErrorKind::Timeout, "no answer"));
        let refused = Err(StoreError::new(StoreErrorKind::Refused, "NOPERM"));
        let gone = Err(StoreError::new(StoreErrorKind::Unavailable, "reset"));
        let answer = Decision::new(
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
            [],
        );
        assert!(!breaker.adjustments_unanswered());
        breaker.heard_adjustment(&refused);
        assert!(!breaker.adjustments_unanswered(), "a refusal is an answer");
        breaker.heard_adjustment(&timeout);
        assert!(breaker.adjustments_unanswered());
        breaker.heard_adjustment(&refused);
        assert!(
            breaker.adjustments_unanswered(),
            "a refusal says nothing of it"
        );
        // A lease's answer is no answer of the store's.
        breaker.heard_adjustment(&Ok(answer.clone().from_cache()));
        assert!(
            breaker.adjustments_unanswered(),
            "a cached answer says nothing of it"
        );
        breaker.heard_adjustment(&Ok(answer));
        assert!(!breaker.adjustments_unanswered());
        breaker.heard_adjustment(&gone);
        assert!(breaker.adjustments_unanswered());
        breaker.on_success();
        assert!(!breaker.adjustments_unanswered(), "a decision answered");
        assert!(!breaker.is_degraded(), "and the breaker was never told");
    }

    #[test]
    fn a_dropped_probe_is_released() {
        let clock = crate::clock::ManualClock::new();
        let breaker = Arc::new(Breaker::new(
            CircuitBreaker::new(1, Duration::from_secs(1)).with_clock(clock.clone()),
        ));
        breaker.on_failure(&StoreError::new(StoreErrorKind::Unavailable, "down"), None);
        clock.advance(Duration::from_secs(1));
        let Admission::Probe(probe) = breaker.admit() else {
            panic!("the cool-down is over: a probe")
        };
        assert!(
            matches!(breaker.admit(), Admission::Skip),
            "one probe at a time"
        );
        // Dropped at once (a client that resets its request, on purpose or not): it says
        // nothing of the store. A cool-down for each would let a client that cancels
        // keep a healthy store's breaker open; no wait at all would let clients that
        // cancel send a sick store a probe per request. The next request probes once
        // PROBE_PATIENCE from the dropped one's start is over.
        drop(probe);
        for _ in 0..20 {
            let Admission::Probe(probe) = breaker.admit() else {
                continue;
            };
            panic!("a probe dropped at once lets no other through at once: {probe:?}");
        }
        clock.advance(PROBE_PATIENCE);
        let Admission::Probe(probe) = breaker.admit() else {
            panic!("a probe dropped at once starts no cool-down: the next request probes")
        };
        // Dropped after the store had long enough to answer: it may well be hanging, so a
        // new cool-down, then another request probes.
        clock.advance(PROBE_PATIENCE);
        drop(probe);
        assert!(
            matches!(breaker.admit(), Admission::Skip),
            "a probe dropped after waiting on the store starts a new cool-down"
        );
        clock.advance(Duration::from_secs(1));
        assert!(
            matches!(breaker.admit(), Admission::Probe(_)),
            "after it, another request probes"
        );
        // A probe whose request had its outcome (here a cached answer) releases the
        // flag without a cool-down.
        clock.advance(Duration::from_secs(1));
        let Admission::Probe(probe) = breaker.admit() else {
            panic!("a probe")
        };
        probe.report();
        drop(probe);
        assert!(matches!(breaker.admit(), Admission::Probe(_)));
    }

    /// A manual clock that, once armed, runs an action during its next reading: another
    /// request's step landing at that moment of this request's (the breaker reads the
    /// clock between the steps a race would fall between).
    struct Interleaving {
        clock: crate::clock::ManualClock,
        action: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }

    impl Clock for Interleaving {
        fn now(&self) -> u64 {
            let action = self.action.lock().unwrap().take();
            if let Some(action) = action {
                action();
            }
            self.clock.now()
        }
    }

    impl Interleaving {
        /// A breaker on this clock, open after one failure for a cool-down of a second.
        fn breaker() -> (Arc<Self>, Arc<Breaker>) {
            let clock = Arc::new(Interleaving {
                clock: crate::clock::ManualClock::new(),
                action: Mutex::new(None),
            });
            let breaker = Arc::new(Breaker::new(
                CircuitBreaker::new(1, Duration::from_secs(1)).with_clock(Arc::clone(&clock)),
            ));
            (clock, breaker)
        }

        /// Opens `breaker` by one failure, lets its cool-down pass and takes its probe.
        fn probe(&self, breaker: &Arc<Breaker>) -> ProbeGuard {
            breaker.on_failure(&StoreError::new(StoreErrorKind::Unavailable, "down"), None);
            self.clock.advance(Duration::from_secs(1));
            match breaker.admit() {
                Admission::Probe(probe) => probe,
                other => panic!("the cool-down is over: a probe, not {other:?}"),
            }
        }

        fn at_next_reading(&self, action: impl FnOnce() + Send + 'static) {
            *self.action.lock().unwrap() = Some(Box::new(action));
        }

        fn landed(&self) -> bool {
            self.action.lock().unwrap().is_none()
        }
    }

    // A dropped probe reads that it still holds the probe, then starts a cool-down. If
    // another request's success closes the breaker in between (a request sent before the
    // breaker opened, answered late), the dropped probe must not open it again.
    #[test]
    fn a_dropped_probe_never_reopens_a_breaker_closed_meanwhile() {
        let (clock, breaker) = Interleaving::breaker();
        let probe = clock.probe(&breaker);
        let other = Arc::clone(&breaker);
        clock.at_next_reading(move || other.on_success());
        drop(probe);
        assert!(clock.landed(), "the success landed");
        assert!(
            matches!(breaker.admit(), Admission::Call),
            "the store answered: the breaker is closed, and a dropped probe reopened it"
        );
    }

    // A failure is counted; before it opens the breaker, another request's success
    // lands (the store answers again). The breaker must stay closed: it opened for a
    // whole cool-down on a store that had just answered, every request skipped (a 503
    // each under `FailClosed`) and the fallback gauge reading 0 meanwhile.
    #[test]
    fn a_success_landing_inside_a_failure_leaves_the_breaker_closed() {
        let (clock, breaker) = Interleaving::breaker();
        let other = Arc::clone(&breaker);
        clock.at_next_reading(move || other.on_success());
        breaker.on_failure(&StoreError::new(StoreErrorKind::Timeout, "late"), None);
        assert!(clock.landed(), "the success landed");
        assert!(
            matches!(breaker.admit(), Admission::Call),
            "the store answered: the breaker is closed"
        );
        // A probe's failure too.
        let probe = clock.probe(&breaker);
        let other = Arc::clone(&breaker);
        clock.at_next_reading(move || other.on_success());
        breaker.on_failure(
            &StoreError::new(StoreErrorKind::Timeout, "late"),
            Some(&probe),
        );
        assert!(clock.landed(), "the success landed");
        assert!(
            matches!(breaker.admit(), Admission::Call),
            "the store answered: the breaker is closed after the probe's failure"
        );
        // A failure after the success opens it, as ever.
        breaker.on_failure(&StoreError::new(StoreErrorKind::Timeout, "down"), None);
        assert!(matches!(breaker.admit(), Admission::Skip));
    }

    // A failure is counted; before it opens the breaker, a success lands and then a
    // newer failure opens it. The older failure must leave that open alone.
    #[test]
    fn a_stale_failure_leaves_a_newer_failures_open_alone() {
        let (clock, breaker) = Interleaving::breaker();
        let (success, failure) = (Arc::clone(&breaker), Arc::clone(&breaker));
        clock.at_next_reading(move || {
            success.on_success();
            failure.on_failure(
                &StoreError::new(StoreErrorKind::Timeout, "down again"),
                None,
            );
        });
        breaker.on_failure(&StoreError::new(StoreErrorKind::Timeout, "late"), None);
        assert!(clock.landed(), "the success and the newer failure landed");
        assert!(
            matches!(breaker.admit(), Admission::Skip),
            "the newer failure opened the breaker"
        );
    }

    // A request reads that the cool-down is over; before it takes the probe, a late
    // success of another request closes the breaker. The request must call the store as
    // any other, not probe a closed breaker: a probe's one failure opens it again, where a
    // closed breaker waits for its run of failures.
    #[test]
    fn no_probe_is_taken_on_a_breaker_closed_meanwhile() {
        let (clock, breaker) = Interleaving::breaker();
        breaker.on_failure(&StoreError::new(StoreErrorKind::Unavailable, "down"), None);
        clock.clock.advance(Duration::from_secs(1));
        let other = Arc::clone(&breaker);
        clock.at_next_reading(move || other.on_success());
        let admitted = breaker.admit();
        assert!(
            clock.landed(),
            "the success landed while this one was admitted"
        );
        assert!(
            matches!(admitted, Admission::Call),
            "the breaker is closed: a call, not {admitted:?}"
        );
        assert_eq!(
            breaker.probing.load(Ordering::Acquire),
            0,
            "no probe flag left"
        );
    }

    // A request reads that the cool-down is over; before it takes the probe, the probe in
    // flight fails, starts a new cool-down and frees the flag. The request must not probe
    // during the new cool-down.
    #[test]
    fn no_probe_starts_within_the_cool_down_a_failed_probe_began() {
        let (clock, breaker) = Interleaving::breaker();
        let probe = clock.probe(&breaker);
        let other = Arc::clone(&breaker);
        clock.at_next_reading(move || {
            other.on_failure(
                &StoreError::new(StoreErrorKind::Timeout, "still down"),
                Some(&probe),
            );
            drop(probe);
        });
        let admitted = breaker.admit();
        assert!(
            clock.landed(),
            "the probe failed while this request was admitted"
        );
        assert!(
            matches!(admitted, Admission::Skip),
            "a second probe started at once, inside the new cool-down: {admitted:?}"
        );
        clock.clock.advance(Duration::from_secs(1));
        assert!(matches!(breaker.admit(), Admission::Probe(_)));
    }

    // A request that called the store before the breaker opened can fail after a probe
    // started (its store timeout is longer than the cool-down). Its failure is not the
    // probe's: it must not release the probe's flag and let a second probe overlap.
    #[test]
    fn a_late_failure_of_another_request_does_not_release_the_probe() {
        let clock = crate::clock::ManualClock::new();
        let breaker = Arc::new(Breaker::new(
            CircuitBreaker::new(1, Duration::from_secs(1)).with_clock(clock.clone()),
        ));
        let error = StoreError::new(StoreErrorKind::Timeout, "slow");
        breaker.on_failure(&error, None);
        clock.advance(Duration::from_secs(1));
        let Admission::Probe(probe) = breaker.admit() else {
            panic!("the cool-down is over: a probe")
        };
        // The slow request of before answers now, with a timeout.
        breaker.on_failure(&error, None);
        clock.advance(Duration::from_secs(1));
        assert!(
            matches!(breaker.admit(), Admission::Skip),
            "the probe is still in flight: no second one"
        );
        // The probe's own failure releases it and opens the breaker again.
        breaker.on_failure(&error, Some(&probe));
        drop(probe);
        assert!(matches!(breaker.admit(), Admission::Skip), "open again");
        clock.advance(Duration::from_secs(1));
        assert!(matches!(breaker.admit(), Admission::Probe(_)));
    }
}
