//! Policies: what a limit is, validated when it is built.
//!
//! A [`Policy`] names one limit ("api", "daily") and the [`Algorithm`] that enforces it.
//! Every constructor checks its parameters and returns a [`PolicyError`] that says what is
//! wrong, so a bad limit fails at start-up instead of misbehaving under load.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Policy, Rate};
//!
//! let burst = Policy::token_bucket("api", 10, Rate::per_second(5))?;
//! let daily = Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?;
//! assert_eq!(burst.name(), "api");
//! assert_eq!(daily.limit(), 10_000);
//!
//! let err = Policy::token_bucket("api", 0, Rate::per_second(5)).unwrap_err();
//! assert_eq!(err.to_string(), "policy \"api\": capacity must be at least 1");
//! # Ok::<(), tollgate::PolicyError>(())
//! ```
//!
//! The module's rooms: [`Rate`] (`rate.rs`), [`Algorithm`] as the user
//! gave them (`spec.rs`), [`PolicyError`] and the checks (`error.rs`), the policy ids
//! that stores key state by (`id.rs`), and [`PolicySet`] (`set.rs`). Policies know no
//! HTTP: the headers that describe them are built in the layer, and the per-request
//! choice of policies is the `resolve` module, which builds on this one.

mod error;
mod id;
mod penalty;
mod rate;
mod set;
mod spec;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use error::{MAX_SHADOW_INDEX, MAX_SHAPING_INDEX, PolicyError};
pub(crate) use id::{Measures, measures};
pub use penalty::Penalty;
pub use rate::Rate;
pub use set::PolicySet;
pub use spec::Algorithm;

use crate::algorithm::{Params, PenaltyBox};
use error::{Check, check_name};
use id::policy_id;

/// The largest limit, capacity, burst or rate amount a policy accepts: 10^15 - 1.
///
/// It is the largest integer an RFC 9651 structured field can carry (15 digits, section
/// 3.3.1), so every `q` and `r` a client parses is the true number; and every store counts
/// exactly up to it, including stores that keep numbers as IEEE doubles (Redis Lua).
///
/// A policy past it, or past [`MAX_PERIOD`], is refused when it is built:
///
/// ```
/// use std::time::Duration;
/// use tollgate::policy::{MAX_LIMIT, MAX_PERIOD};
/// use tollgate::{Policy, PolicyError};
///
/// let minute = Duration::from_secs(60);
/// assert!(Policy::fixed_window("api", MAX_LIMIT, minute).is_ok());
/// let too_many = Policy::fixed_window("api", MAX_LIMIT + 1, minute).unwrap_err();
/// assert!(matches!(too_many, PolicyError::TooLarge { value, .. } if value == MAX_LIMIT + 1));
/// let too_long = Policy::fixed_window("api", 10, MAX_PERIOD + Duration::from_secs(1));
/// assert!(matches!(too_long, Err(PolicyError::Duration { .. })));
/// ```
pub const MAX_LIMIT: u64 = 999_999_999_999_999;

/// What a policy's quota counts, sent as `qu` (or a vendor parameter) in
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-11, the "Quota Unit
/// Parameter" of the `RateLimit-Policy` field).
///
/// ```
/// use tollgate::policy::QuotaUnit;
/// use tollgate::{Policy, Rate};
///
/// let upload = Policy::token_bucket("upload", 10_000_000, Rate::per_second(1_000_000))?
///     .with_unit(QuotaUnit::ContentBytes);
/// assert_eq!(upload.unit(), QuotaUnit::ContentBytes);
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
///
/// Each unit as a response's `RateLimit-Policy` field states it:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::policy::QuotaUnit;
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = RateLimitLayer::new(MemoryStore::new())
///     .policy(Policy::token_bucket("calls", 100, Rate::per_second(10))?)
///     .policy(Policy::token_bucket("upload", 10_000_000, Rate::per_second(1_000_000))?
///         .with_unit(QuotaUnit::ContentBytes))
///     .policy(Policy::token_bucket("points", 1_000, Rate::per_minute(1_000))?
///         .with_unit(QuotaUnit::GraphqlPoints))
///     .policy(Policy::concurrency("inflight", 2)?)
///     .key(HeaderKey::new("x-api-key"))
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///     }));
/// let request = Request::get("/").header("x-api-key", "k1").body(())?;
/// let response = service.oneshot(request).await?;
/// assert_eq!(
///     response.headers()["ratelimit-policy"],
///     concat!(
///         "\"calls\";q=100;w=10, ",
///         "\"upload\";q=10000000;w=10;qu=\"content-bytes\", ",
///         "\"points\";q=1000;w=60;tollgate-qu=\"graphql-points\", ",
///         "\"inflight\";q=2;qu=\"concurrent-requests\"",
///     )
/// );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum QuotaUnit {
    /// Requests (the draft's default unit; no parameter is sent).
    #[default]
    Requests,
    /// Bytes of content: `qu="content-bytes"`, for a body-size coster such as
    /// `cost::ContentLength`.
    ContentBytes,
    /// GraphQL complexity points. Not a unit the draft registers, so it is sent as the
    /// vendor-prefixed parameter `tollgate-qu="graphql-points"`, as the draft asks of
    /// implementation-specific parameters.
    GraphqlPoints,
    /// Requests in progress at once: `qu="concurrent-requests"`. Every
    /// [`Policy::concurrency`] policy counts this unit.
    ConcurrentRequests,
}

/// The shortest window or period a policy accepts.
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

/// The longest window or period a policy accepts (about ten years).
pub const MAX_PERIOD: Duration = Duration::from_secs(10 * 366 * 24 * 60 * 60);

/// The most sub-windows a sliding window counter may be cut into
/// ([`Policy::sliding_window_split`]); its state holds one counter more than that.
pub const MAX_SUB_WINDOWS: u32 = 64;

/// How long a shared store keeps an in-flight slot whose holder never gave it back, unless
/// [`Policy::concurrency_with_lease`] says otherwise.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// The longest a shaping leaky bucket may hold a request back.
pub const MAX_SHAPING_DELAY: Duration = Duration::from_secs(60 * 60);

/// One named limit and the algorithm that enforces it. Cheap to clone.
///
/// Its durations are kept in whole microseconds, the unit the Redis store counts in, so
/// that one policy decides alike in every store, even built from a duration finer than
/// that: windows, rate periods, a lease and a penalty's durations rounded up, a shaping
/// bucket's longest delay rounded down (each the stricter way).
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Policy, Rate};
///
/// // A third of a second is 333,333,333 ns: the bucket holds a request back at most
/// // 333,333 µs, and at 3 a second that admits 1 at once, in memory as in Redis.
/// let third = Duration::from_secs(1) / 3;
/// let shaping = Policy::leaky_bucket_shaping("smooth", Rate::per_second(3), third)?;
/// assert_eq!(shaping.limit(), 1);
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Clone)]
pub struct Policy {
    inner: Arc<PolicyInner>,
}

struct PolicyInner {
    name: Box<str>,
    algorithm: Algorithm,
    params: Params,
    id: u32,
    unit: QuotaUnit,
    shadow: bool,
    /// The penalty, validated, and the id its state is kept under.
    penalty: Option<(Penalty, PenaltyBox, u32)>,
    /// One value derived from the policy, computed once by whoever needs it (telemetry
    /// keeps the keys the policy's decisions are counted under here): the policy itself
    /// knows no metrics.
    #[cfg(feature = "metrics")]
    derived: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.name())
            .field("algorithm", &self.inner.algorithm)
            .finish()
    }
}

impl PartialEq for Policy {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
            && self.algorithm() == other.algorithm()
            && self.is_shadow() == other.is_shadow()
            && self.penalty() == other.penalty()
    }
}

impl Eq for Policy {}

/// The algorithm `params` decide: what [`Policy::algorithm`] reports, its durations as
/// the policy keeps them (whole microseconds, see [`Policy`]), and what names the
/// policy's state, so that two policies that decide alike are one.
fn algorithm_of(params: &Params) -> Algorithm {
    let ns = Duration::from_nanos;
    let rate = |amount, period| Rate::new(amount, ns(period));
    match *params {
        Params::FixedWindow { limit, window } => Algorithm::FixedWindow {
            limit,
            window: ns(window),
        },
        Params::SlidingLog { limit, window } => Algorithm::SlidingLog {
            limit,
            window: ns(window),
        },
        Params::SlidingWindow {
            limit,
            window,
            sub_windows,
        } => Algorithm::SlidingWindow {
            limit,
            window: ns(window),
            // At most MAX_SUB_WINDOWS: checked when built.
            sub_windows: u32::try_from(sub_windows).unwrap_or(u32::MAX),
        },
        Params::TokenBucket {
            capacity,
            amount,
            period,
        } => Algorithm::TokenBucket {
            capacity,
            refill: rate(amount, period),
        },
        Params::LeakyPolice {
            capacity,
            amount,
            period,
        } => Algorithm::LeakyBucket {
            capacity,
            leak: rate(amount, period),
        },
        Params::LeakyShape {
            amount,
            period,
            max_delay,
        } => Algorithm::LeakyShaping {
            leak: rate(amount, period),
            max_delay: ns(max_delay),
        },
        Params::Gcra {
            burst,
            amount,
            period,
        } => Algorithm::Gcra {
            rate: rate(amount, period),
            burst,
        },
        Params::InFlight { limit, lease } => Algorithm::Concurrency {
            limit,
            lease: ns(lease),
        },
    }
}

/// `params` with each rate in lowest terms, counted in whole microseconds as the policy
/// keeps its durations (`Rate::per_minute(60)` is one a second): the same numbers Redis
/// names its state by, and smaller ones to scale a bucket's level by. Decisions do not
/// change: a rate's ratio is kept exactly.
fn in_lowest_terms(mut params: Params) -> Params {
    if let Params::TokenBucket { amount, period, .. }
    | Params::LeakyPolice { amount, period, .. }
    | Params::LeakyShape { amount, period, .. }
    | Params::Gcra { amount, period, .. } = &mut params
    {
        let micros = *period / 1_000;
        let divisor = gcd(*amount, micros).max(1);
        *amount /= divisor;
        *period = micros / divisor * 1_000;
    }
    params
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// What names the state of a policy deciding by `params`: its algorithm in lowest terms,
/// the policing leaky bucket as the token bucket whose math and state it is (as Redis
/// names it), so that two spellings of one policy share one state.
fn state_of(params: &Params) -> Algorithm {
    match algorithm_of(params) {
        Algorithm::LeakyBucket { capacity, leak } => Algorithm::TokenBucket {
            capacity,
            refill: leak,
        },
        other => other,
    }
}

impl Policy {
    /// A policy from its algorithm as a user would give it (the constructors' common path).
    pub(crate) fn build(name: &str, algorithm: Algorithm) -> Result<Self, PolicyError> {
        check_name(name)?;
        let check = Check { policy: name };
        let params = match algorithm {
            Algorithm::FixedWindow { limit, window } | Algorithm::SlidingLog { limit, window } => {
                let limit = check.count("limit", limit)?;
                let window = check.duration("window", window, MIN_PERIOD, MAX_PERIOD)?;
                match algorithm {
                    Algorithm::FixedWindow { .. } => Params::FixedWindow { limit, window },
                    _ => Params::SlidingLog { limit, window },
                }
            }
            Algorithm::SlidingWindow {
                limit,
                window: duration,
                sub_windows,
            } => {
                let limit = check.count("limit", limit)?;
                let window = check.duration("window", duration, MIN_PERIOD, MAX_PERIOD)?;
                // Each sub-window a whole number of microseconds, so the in-process store
                // (nanoseconds) and Redis (microseconds) cut the time line alike. (The
                // window itself is whole microseconds already, rounded up.)
                let k = u64::from(sub_windows);
                if !(1..=MAX_SUB_WINDOWS).contains(&sub_windows)
                    || (k > 1 && window % (k * 1_000) != 0)
                {
                    return Err(PolicyError::SubWindows {
                        policy: name.to_owned(),
                        sub_windows,
                        window: duration,
                    });
                }
                Params::SlidingWindow {
                    limit,
                    window,
                    sub_windows: k,
                }
            }
            Algorithm::TokenBucket { capacity, refill } => {
                let capacity = check.count("capacity", capacity)?;
                let (amount, period) = check.rate("refill amount", refill)?;
                Params::TokenBucket {
                    capacity,
                    amount,
                    period,
                }
            }
            Algorithm::LeakyBucket { capacity, leak } => {
                let (amount, period) = check.rate("leak amount", leak)?;
                Params::LeakyPolice {
                    capacity: check.count("capacity", capacity)?,
                    amount,
                    period,
                }
            }
            Algorithm::LeakyShaping { leak, max_delay } => {
                let (amount, period) = check.rate("leak amount", leak)?;
                let max_delay =
                    check.bound("max_delay", max_delay, Duration::ZERO, MAX_SHAPING_DELAY)?;
                // The burst it admits is a quota like any other: bounded alike.
                check.count(
                    "burst (max_delay times the leak rate)",
                    Params::shaping_capacity(
                        amount,
                        Duration::from_nanos(period),
                        Duration::from_nanos(max_delay),
                    ),
                )?;
                Params::LeakyShape {
                    amount,
                    period,
                    max_delay,
                }
            }
            Algorithm::Concurrency { limit, lease } => Params::InFlight {
                limit: check.count("limit", limit)?,
                lease: check.duration("lease", lease, MIN_PERIOD, MAX_PERIOD)?,
            },
            Algorithm::Gcra { rate, burst } => {
                let burst = check.count("burst", burst)?;
                let (amount, period) = check.rate("rate amount", rate)?;
                Params::Gcra {
                    burst,
                    amount,
                    period,
                }
            }
        };
        // Reported as given; decided (and its state named) in lowest terms.
        let algorithm = algorithm_of(&params);
        let params = in_lowest_terms(params);
        Ok(Policy {
            inner: Arc::new(PolicyInner {
                name: name.into(),
                algorithm,
                params,
                id: policy_id(
                    name,
                    state_of(&params),
                    params.limit(),
                    params.window_nanos(),
                ),
                unit: match algorithm {
                    Algorithm::Concurrency { .. } => QuotaUnit::ConcurrentRequests,
                    _ => QuotaUnit::Requests,
                },
                shadow: false,
                penalty: None,
                #[cfg(feature = "metrics")]
                derived: std::sync::OnceLock::new(),
            }),
        })
    }

    /// This policy, advertised as counting `unit` (it changes no decision).
    pub fn with_unit(&self, unit: QuotaUnit) -> Policy {
        Policy {
            inner: Arc::new(PolicyInner {
                name: self.inner.name.clone(),
                algorithm: self.inner.algorithm,
                params: self.inner.params,
                id: self.inner.id,
                unit,
                shadow: self.inner.shadow,
                penalty: self.inner.penalty,
                #[cfg(feature = "metrics")]
                derived: std::sync::OnceLock::new(),
            }),
        }
    }

    /// This policy in shadow (dry-run) mode: decided and debited like a real one, in
    /// state of its own (a real policy of the same name and parameters, in another layer
    /// or a configuration before a reload, is not touched; one set cannot hold both),
    /// but it never denies. What it would have denied is reported: the metric outcome
    /// `shadow_denied` and a `tracing` event. It is left out of the rate-limit headers
    /// unless the layer asks for it ([`RateLimitLayer::shadow_headers`]). Roll a new limit
    /// out in shadow, watch what it would do, then drop the `.shadow()`.
    ///
    /// A shadow policy that would deny is not debited (as a real one would not be); one
    /// that admits is, when the request is admitted by the real policies.
    ///
    /// ```
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let strict = Policy::fixed_window("strict", 1, std::time::Duration::from_secs(60))?.shadow();
    /// let set = PolicySet::from(strict);
    /// let store = MemoryStore::new();
    /// assert!(store.check("k", &set, 1).is_allowed());
    /// let second = store.check("k", &set, 1);
    /// assert!(second.is_allowed(), "a shadow policy never denies");
    /// assert_eq!(second.shadow_denied().collect::<Vec<_>>(), [0]);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// [`RateLimitLayer::shadow_headers`]: crate::RateLimitLayer::shadow_headers
    pub fn shadow(&self) -> Policy {
        let name = &self.inner.name;
        Policy {
            inner: Arc::new(PolicyInner {
                name: name.clone(),
                algorithm: self.inner.algorithm,
                params: self.inner.params,
                // Its own state: `~` never appears in a policy name.
                id: policy_id(
                    &format!("{name}~shadow"),
                    state_of(&self.inner.params),
                    self.inner.params.limit(),
                    self.inner.params.window_nanos(),
                ),
                unit: self.inner.unit,
                shadow: true,
                penalty: self.inner.penalty,
                #[cfg(feature = "metrics")]
                derived: std::sync::OnceLock::new(),
            }),
        }
    }

    /// This policy with a penalty: a key it denies `penalty.denials()` times within
    /// `penalty.within()` is blocked (see [`Penalty`]). A blocked key's requests are
    /// answered from the block, 429 with `Retry-After` and `RateLimit` showing the time
    /// left, without touching its other state. A shadow policy's penalty is not applied.
    ///
    /// The penalty is checked here: a block or a window outside
    /// [`MIN_PERIOD`]..=[`MAX_PERIOD`], no denials, or a longest block shorter than the
    /// first, is an error. Durations are kept in whole microseconds, as the policy's are.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::policy::Penalty;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let minute = Duration::from_secs(60);
    /// let api = Policy::token_bucket("api", 2, Rate::per_minute(2))?;
    /// let strict = api.with_penalty(Penalty::new(2, minute, 5 * minute))?;
    /// assert_eq!(strict.penalty().map(|penalty| penalty.block()), Some(5 * minute));
    ///
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// for (key, policy) in [("plain", &api), ("strict", &strict), ("shadow", &strict.shadow())] {
    ///     let set = PolicySet::from(policy.clone());
    ///     assert!(store.check(key, &set, 2).is_allowed());
    ///     store.check(key, &set, 1);
    ///     let third = store.check(key, &set, 1);
    ///     match key {
    ///         // A bucket denies for the 30 seconds a unit takes to come back.
    ///         "plain" => assert_eq!(third.retry_after(), Some(Duration::from_secs(30))),
    ///         // The second denial blocks the key for 5 minutes.
    ///         "strict" => assert_eq!(third.retry_after(), Some(5 * minute)),
    ///         // A shadow policy denies nothing, and blocks nothing.
    ///         _ => assert!(third.is_allowed() && !third.is_blocked()),
    ///     }
    /// }
    ///
    /// let shorter_cap = Penalty::new(2, minute, 5 * minute).doubling_up_to(minute);
    /// assert!(api.with_penalty(shorter_cap).is_err());
    /// assert!(api.with_penalty(Penalty::new(0, minute, minute)).is_err());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn with_penalty(&self, penalty: Penalty) -> Result<Policy, PolicyError> {
        let check = Check {
            policy: self.name(),
        };
        let denials = check.count("penalty denials", penalty.denials)?;
        let within = check.duration("penalty window", penalty.within, MIN_PERIOD, MAX_PERIOD)?;
        let block = check.duration("penalty block", penalty.block, MIN_PERIOD, MAX_PERIOD)?;
        let max_block = check.duration(
            "penalty max_block (at least the block)",
            penalty.max_block(),
            penalty.block,
            MAX_PERIOD,
        )?;
        let boxed = PenaltyBox::new(denials, within, block, max_block)
            .expect("checked above: all positive, max_block >= block");
        // As kept: whole microseconds, what `penalty()` reports.
        let penalty = Penalty {
            denials,
            within: Duration::from_nanos(within),
            block: Duration::from_nanos(block),
            max_block: penalty.max_block.map(|_| Duration::from_nanos(max_block)),
        };
        // The penalty's own state, under an id of the policy's name and the penalty's
        // parameters: a changed penalty (a reload that shortens the block) starts afresh,
        // as a changed policy does, but a changed rate keeps the blocks and strikes (a
        // limit tightened during an attack must not free the clients it blocked). `~`
        // never appears in a policy name; the algorithm is the one no rate policy has
        // (an in-flight one's, whose numbers the id ignores).
        let id = policy_id(
            &format!(
                "{}~penalty~{denials}~{within}~{block}~{max_block}",
                self.inner.name
            ),
            Algorithm::Concurrency {
                limit: 0,
                lease: Duration::ZERO,
            },
            0,
            0,
        );
        Ok(self.penalized(Some((penalty, boxed, id))))
    }

    /// This policy without its penalty, on the same rate state.
    pub(crate) fn without_penalty(&self) -> Policy {
        if self.inner.penalty.is_none() {
            return self.clone();
        }
        self.penalized(None)
    }

    /// This policy, on the same rate state, with `penalty` instead of its own.
    fn penalized(&self, penalty: Option<(Penalty, PenaltyBox, u32)>) -> Policy {
        Policy {
            inner: Arc::new(PolicyInner {
                name: self.inner.name.clone(),
                algorithm: self.inner.algorithm,
                params: self.inner.params,
                id: self.inner.id,
                unit: self.inner.unit,
                shadow: self.inner.shadow,
                penalty,
                #[cfg(feature = "metrics")]
                derived: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The value derived from this policy by `derive`, computed on the first call and kept
    /// with the policy (and its clones). One type per policy: a call for another type gets
    /// `None`.
    #[cfg(feature = "metrics")]
    pub(crate) fn derived<T: std::any::Any + Send + Sync>(
        &self,
        derive: impl FnOnce(&Policy) -> T,
    ) -> Option<&T> {
        self.inner
            .derived
            .get_or_init(|| Box::new(derive(self)))
            .downcast_ref()
    }

    /// The policy's penalty, if it has one.
    pub fn penalty(&self) -> Option<Penalty> {
        self.inner.penalty.map(|(penalty, ..)| penalty)
    }

    /// The penalty's parameters and the id its state is kept under; none for a shadow
    /// policy (its penalty is not applied).
    #[inline]
    pub(crate) fn penalty_box(&self) -> Option<(PenaltyBox, u32)> {
        match self.inner.penalty {
            Some((_, boxed, id)) if !self.inner.shadow => Some((boxed, id)),
            _ => None,
        }
    }

    /// True for a shadow policy ([`shadow`](Self::shadow)).
    #[inline]
    pub fn is_shadow(&self) -> bool {
        self.inner.shadow
    }

    /// The name a store keys this policy's state by: the name, or `name~shadow` for a
    /// shadow policy.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn state_name(&self) -> std::borrow::Cow<'_, str> {
        if self.inner.shadow {
            std::borrow::Cow::Owned(format!("{}~shadow", self.inner.name))
        } else {
            std::borrow::Cow::Borrowed(&self.inner.name)
        }
    }

    /// What the quota counts (default: requests).
    pub fn unit(&self) -> QuotaUnit {
        self.inner.unit
    }

    /// A fixed window: `limit` units per `window`, counted from the window's start.
    ///
    /// Cheap (one counter) but it admits up to `2 * limit` around a window seam; use it for
    /// coarse quotas (per day) under a finer limiter.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let daily = Policy::fixed_window("daily", 3, Duration::from_secs(86_400))?;
    /// assert_eq!(daily.window(), Duration::from_secs(86_400));
    /// let store = MemoryStore::new();
    /// let set = PolicySet::from(daily);
    /// assert!(store.check("user-7", &set, 3).is_allowed());
    /// let fourth = store.check("user-7", &set, 1);
    /// assert!(!fourth.is_allowed());
    /// assert!(fourth.retry_after().unwrap() <= Duration::from_secs(86_400));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn fixed_window(name: &str, limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::FixedWindow { limit, window })
    }

    /// A sliding log: at most `limit` units in any `window`. Exact; keeps one entry per
    /// admitted request for one window, so memory grows with the limit.
    ///
    /// A denied request's wait is until enough of the oldest entries have left. To find
    /// it, a store reads at most 256 entries (of several units; a log of one-unit entries
    /// is read by rank): a request costly enough to need more is told an upper bound, the
    /// time by which it certainly fits, so that a client choosing its cost cannot make
    /// every such request walk a log as long as the limit. (Past those 256, the in-process
    /// store, which keeps requests of one instant as one entry, and Redis, one member
    /// each, may state different bounds.)
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let exact = PolicySet::from(Policy::sliding_log("exact", 2, Duration::from_secs(60))?);
    /// let store = MemoryStore::new();
    /// assert!(store.check("user-7", &exact, 1).is_allowed());
    /// assert!(store.check("user-7", &exact, 1).is_allowed());
    /// let third = store.check("user-7", &exact, 1);
    /// assert!(!third.is_allowed());
    /// // Admitted again once the oldest entry is a minute old.
    /// assert!(third.retry_after().unwrap() <= Duration::from_secs(60));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn sliding_log(name: &str, limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::SlidingLog { limit, window })
    }

    /// A sliding window counter: O(1) state, approximates a sliding window with the
    /// estimate `previous * (1 - elapsed / window) + current` (rounded up).
    ///
    /// It assumes the previous window's requests were spread evenly. Measured against the
    /// exact [`sliding_log`](Self::sliding_log) on Poisson traffic, a few percent of
    /// decisions differ near the limit; when the previous window's requests all came at
    /// its very end, up to twice the limit can be admitted within one window. For a
    /// tighter bound at a few more counters, see
    /// [`sliding_window_split`](Self::sliding_window_split).
    ///
    /// Below, 10 a minute: the first window's 10 are all spent. Halfway through the next
    /// window the estimate counts half of them, `10 * (1 - 30/60) + 0 = 5`, so 5 more
    /// fit and a sixth does not; 6 seconds later the estimate is `10 * 0.4 + 5 = 9`,
    /// and one more fits.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// let api = PolicySet::from(Policy::sliding_window("api", 10, Duration::from_secs(60))?);
    /// assert!(store.check("k", &api, 10).is_allowed()); // in the window [0 s, 60 s)
    /// clock.advance(Duration::from_secs(90)); // halfway through [60 s, 120 s)
    /// let five = store.check("k", &api, 5);
    /// assert!(five.is_allowed());
    /// assert_eq!(five.statuses()[0].remaining, 0);
    /// let sixth = store.check("k", &api, 1);
    /// assert!(!sixth.is_allowed());
    /// assert_eq!(sixth.retry_after(), Some(Duration::from_secs(6)));
    /// clock.advance(Duration::from_secs(6));
    /// assert!(store.check("k", &api, 1).is_allowed());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn sliding_window(name: &str, limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::sliding_window_split(name, limit, window, 1)
    }

    /// A sliding window counter over `sub_windows` equal sub-windows (`k`): the counts of
    /// the `k` newest sub-windows, plus the share of the oldest one still inside the
    /// window, never forgiving more than `limit / k` of it. No window of length `window`
    /// ever holds more than `limit + limit / k` admitted units, whatever the traffic
    /// (twice the limit for `k = 1`), and decisions come closer to the exact sliding log
    /// as `k` grows. State: `k + 1` counters per key (Redis: one hash of `k + 2` fields).
    ///
    /// `sub_windows` must be between 1 and [`MAX_SUB_WINDOWS`] and divide the window into
    /// equal whole microseconds. With a limit below `k` nothing of the oldest sub-window
    /// is ever forgiven: a unit then counts until its sub-window is a whole window old
    /// (up to `window + window / k`), stricter than the sliding log, never looser. A
    /// replica's scaled-down share ([`LocalFallback::policies_for`](crate::LocalFallback::policies_for)) can land there.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::Policy;
    ///
    /// // 100 per minute, counted in 10 sub-windows of 6 s: at most 110 in any minute.
    /// let api = Policy::sliding_window_split("api", 100, Duration::from_secs(60), 10)?;
    /// assert_eq!(api.limit(), 100);
    /// assert!(Policy::sliding_window_split("api", 100, Duration::from_secs(1), 7).is_err());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn sliding_window_split(
        name: &str,
        limit: u64,
        window: Duration,
        sub_windows: u32,
    ) -> Result<Self, PolicyError> {
        Self::build(
            name,
            Algorithm::SlidingWindow {
                limit,
                window,
                sub_windows,
            },
        )
    }

    /// A token bucket: bursts of up to `capacity` units, refilled at `refill`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(1))?;
    /// assert_eq!(api.limit(), 10);
    /// // Its window: the time an empty bucket takes to fill.
    /// assert_eq!(api.window(), Duration::from_secs(10));
    /// let store = MemoryStore::new();
    /// let set = PolicySet::from(api);
    /// assert!(store.check("user-7", &set, 10).is_allowed()); // the whole burst at once
    /// let next = store.check("user-7", &set, 1);
    /// assert!(!next.is_allowed());
    /// assert!(next.retry_after().unwrap() <= Duration::from_secs(1));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn token_bucket(name: &str, capacity: u64, refill: Rate) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::TokenBucket { capacity, refill })
    }

    /// A policing leaky bucket: holds up to `capacity` units and leaks at `leak`; what
    /// does not fit is denied.
    ///
    /// ```
    /// use tollgate::{Algorithm, MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let meter = Policy::leaky_bucket("meter", 5, Rate::per_second(1))?;
    /// assert_eq!(meter.algorithm(), Algorithm::LeakyBucket {
    ///     capacity: 5,
    ///     leak: Rate::per_second(1),
    /// });
    /// let store = MemoryStore::new();
    /// let set = PolicySet::from(meter);
    /// assert!(store.check("sensor-3", &set, 5).is_allowed()); // the bucket is full
    /// assert!(!store.check("sensor-3", &set, 1).is_allowed()); // overflow is denied
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn leaky_bucket(name: &str, capacity: u64, leak: Rate) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::LeakyBucket { capacity, leak })
    }

    /// A shaping leaky bucket: requests leave at `leak`, each one held back until those
    /// ahead of it have left; one that would wait longer than `max_delay` is denied.
    ///
    /// The layer sleeps for the delay before it calls the inner service, which it makes
    /// ready only then (a request held back holds none of its capacity). The bucket admits
    /// a burst of `max_delay * leak + 1` unit requests, each one later than the last.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, Rate};
    ///
    /// let partner = Policy::leaky_bucket_shaping("partner", Rate::per_second(2), Duration::from_secs(2))?;
    /// assert_eq!(partner.limit(), 5);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn leaky_bucket_shaping(
        name: &str,
        leak: Rate,
        max_delay: Duration,
    ) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::LeakyShaping { leak, max_delay })
    }

    /// An in-flight (concurrency) limit: at most `limit` requests of a key in progress at
    /// once, as GitHub's 100 concurrent requests per user. A request takes a slot when it
    /// is admitted and gives it back when its response body has been sent or dropped
    /// (client gone, handler panicked, timed out). On Redis a slot whose holder died
    /// expires after [`DEFAULT_LEASE`]; see [`Policy::concurrency_with_lease`]. A request
    /// whose cost is 0 takes no slot: a cost function that prices some requests at 0
    /// exempts them from the limit. Where the client chooses its cost (an empty body under
    /// `cost::ContentLength`), give this policy a layer of its own with the constant cost 1.
    /// An upgraded connection (a WebSocket's `101`, a `CONNECT` tunnel) gives its slot
    /// back with its response's empty body, as the connection begins: to bound open
    /// sockets, hold a semaphore permit in the socket's task.
    ///
    /// Advertised as `qu="concurrent-requests"`, with no window. A denied request is told
    /// to retry after one second: when a slot frees depends on other requests.
    ///
    /// ```
    /// use tollgate::policy::QuotaUnit;
    /// use tollgate::Policy;
    ///
    /// let inflight = Policy::concurrency("inflight", 2)?;
    /// assert_eq!(inflight.limit(), 2);
    /// assert_eq!(inflight.unit(), QuotaUnit::ConcurrentRequests);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn concurrency(name: &str, limit: u64) -> Result<Self, PolicyError> {
        Self::concurrency_with_lease(name, limit, DEFAULT_LEASE)
    }

    /// An in-flight limit whose slots a shared store keeps at most `lease` when their
    /// holder never gives them back. Choose it longer than your longest request: a
    /// request still running when its lease ends no longer holds its slot.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Algorithm, Policy};
    ///
    /// // Exports run for up to ten minutes: a lease of fifteen.
    /// let lease = Duration::from_secs(15 * 60);
    /// let exports = Policy::concurrency_with_lease("exports", 4, lease)?;
    /// assert_eq!(exports.algorithm(), Algorithm::Concurrency { limit: 4, lease });
    /// assert_eq!(exports.limit(), 4);
    /// assert_eq!(exports.window(), lease); // an in-flight limit's window is its lease
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn concurrency_with_lease(
        name: &str,
        limit: u64,
        lease: Duration,
    ) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::Concurrency { limit, lease })
    }

    /// GCRA: a sustained `rate` with bursts of up to `burst` units back to back.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let api = Policy::gcra("api", Rate::per_second(10), 5)?;
    /// assert_eq!(api.limit(), 5);
    /// let store = MemoryStore::new();
    /// let set = PolicySet::from(api);
    /// for _ in 0..5 {
    ///     assert!(store.check("user-7", &set, 1).is_allowed());
    /// }
    /// let sixth = store.check("user-7", &set, 1);
    /// assert!(!sixth.is_allowed());
    /// // At 10 a second, the next unit is at most 100 ms away.
    /// assert!(sixth.retry_after().unwrap() <= Duration::from_millis(100));
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn gcra(name: &str, rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::Gcra { rate, burst })
    }

    /// The policy's name, as sent in the `RateLimit` headers.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The algorithm and its parameters, durations as kept (whole microseconds).
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The quota a client sees: the most units this policy admits at once.
    #[inline]
    pub fn limit(&self) -> u64 {
        self.inner.params.limit()
    }

    /// The window the quota is measured over: the window of a window algorithm, or the
    /// time a bucket takes to refill from empty; for an in-flight limit, which has none,
    /// the lease of its slots. `RateLimit-Policy` advertises it as `w` in whole seconds,
    /// rounded up (at least 1: a 1 ms window is `w=1`, a bucket refilling in 3.3 s `w=4`;
    /// draft-11 has no smaller unit), and sends no `w` for an in-flight limit.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.inner.params.window_nanos())
    }

    #[inline]
    pub(crate) fn params(&self) -> &Params {
        &self.inner.params
    }

    /// The algorithm as this policy decides it: [`Policy::algorithm`] with its rate in
    /// lowest terms (`Rate::per_minute(60)` is one a second).
    pub(crate) fn decided(&self) -> Algorithm {
        algorithm_of(&self.inner.params)
    }

    /// True when `other` decides as this policy does, on the same state: its name, its
    /// algorithm as decided (rates in lowest terms, the policing leaky bucket as the token
    /// bucket), shadow and penalty. `==` compares algorithms as they were given.
    pub(crate) fn decides_as(&self, other: &Policy) -> bool {
        self.name() == other.name()
            && state_of(&self.inner.params) == state_of(&other.inner.params)
            && self.is_shadow() == other.is_shadow()
            && self.penalty() == other.penalty()
    }

    /// A fingerprint of the name and parameters (of an in-flight policy, the name alone:
    /// see `id::policy_id`); stores keep state per id.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        self.inner.id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The algorithms' own bounds (they know nothing of policies) are the policies'.
    #[test]
    fn the_algorithms_bounds_are_the_policies() {
        assert_eq!(crate::algorithm::MAX_UNITS, MAX_LIMIT);
        assert_eq!(
            u128::from(crate::algorithm::MAX_NANOS),
            MAX_PERIOD.as_nanos()
        );
    }

    #[test]
    fn rejects_bad_parameters_with_clear_messages() {
        let cases: Vec<(Result<Policy, PolicyError>, &str)> = vec![
            (
                Policy::fixed_window("", 1, Duration::from_secs(1)),
                "policy name \"\" is invalid",
            ),
            (
                Policy::fixed_window("a b", 1, Duration::from_secs(1)),
                "policy name \"a b\" is invalid",
            ),
            (
                Policy::fixed_window("w", 0, Duration::from_secs(1)),
                "policy \"w\": limit must be at least 1",
            ),
            (
                Policy::sliding_log("w", 5, Duration::ZERO),
                "policy \"w\": window is 0ns, it must be between 1ms and",
            ),
            (
                Policy::sliding_window("w", 5, Duration::from_secs(400 * 86_400 * 365)),
                "policy \"w\": window is",
            ),
            (
                Policy::token_bucket("t", 10, Rate::per_second(0)),
                "policy \"t\": refill amount must be at least 1",
            ),
            (
                Policy::token_bucket("t", u64::MAX, Rate::per_second(1)),
                "policy \"t\": capacity is 18446744073709551615, more than the maximum",
            ),
            (
                Policy::gcra("g", Rate::new(1, Duration::ZERO), 1),
                "policy \"g\": the rate's period is 0ns",
            ),
            (
                Policy::gcra("g", Rate::per_second(1), 0),
                "policy \"g\": burst must be at least 1",
            ),
            (
                Policy::leaky_bucket_shaping("l", Rate::per_second(1), Duration::from_secs(7200)),
                "policy \"l\": max_delay is 7200s",
            ),
        ];
        for (result, expected) in cases {
            let message = result.unwrap_err().to_string();
            assert!(
                message.starts_with(expected),
                "{message:?} should start with {expected:?}"
            );
        }
    }

    #[test]
    fn ids_differ_by_name_and_parameters() {
        let a = Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap();
        let b = Policy::token_bucket("api", 20, Rate::per_second(5)).unwrap();
        let c = Policy::token_bucket("web", 10, Rate::per_second(5)).unwrap();
        let a2 = Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap();
        assert_ne!(a.id(), b.id());
        assert_ne!(a.id(), c.id());
        assert_eq!(a.id(), a2.id());
        assert_eq!(a, a2);
    }

    #[test]
    fn the_id_table_is_bounded_and_ids_stay_stable_past_it() {
        // More distinct policies than the table keeps (a resolver inventing them).
        let make = |i: usize| Policy::gcra(&format!("tenant-{i}"), Rate::per_second(1), 1).unwrap();
        let ids: Vec<u32> = (0..id::MAX_REGISTERED + 100)
            .map(|i| make(i).id())
            .collect();
        let hashed = ids.iter().filter(|&&id| id & 0x8000_0000 != 0).count();
        assert!(hashed >= 100, "past the bound ids are hashed: {hashed}");
        // The same policy keeps its id, in the table or not.
        let last = id::MAX_REGISTERED + 99;
        assert_eq!(make(last).id(), ids[last]);
        assert_eq!(make(0).id(), ids[0]);
        // Table ids never meet hashed ones.
        assert!(
            ids.iter()
                .filter(|&&id| id & 0x8000_0000 == 0)
                .all(|&id| (id as usize) < id::MAX_REGISTERED)
        );
        // Every id has its quota and time, in the table or hashed (the in-process store
        // ranks what an identity has to lose by them: past the table, every policy read as
        // a whole quota, and a flood forgot identities that had spent their own).
        let big =
            Policy::fixed_window("big-past-the-table", 1_000, Duration::from_secs(60)).unwrap();
        assert_ne!(big.id() & 0x8000_0000, 0, "past the table");
        // The ids first: building a policy while the measures are read could wait on a
        // writer queued behind this reader.
        let (big, first) = (big.id(), make(0).id());
        let measures = id::measures();
        assert_eq!(measures.of(big), Some((1_000, 60_000_000_000)));
        assert_eq!(measures.of(first), Some((1, 1_000_000_000)));
    }

    #[test]
    fn with_replaces_a_policy_of_the_same_name() {
        let set = PolicySet::from(Policy::gcra("api", Rate::per_second(1), 1).unwrap());
        let set = set.with(Policy::gcra("api", Rate::per_second(2), 4).unwrap());
        assert_eq!(set.len(), 1);
        assert_eq!(set[0].limit(), 4);
    }
}
