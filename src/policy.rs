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

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use http::HeaderValue;

use crate::algorithm::Params;

/// The largest limit, capacity, burst or rate amount a policy accepts: 10^15 - 1.
///
/// It is the largest integer an RFC 9651 structured field can carry (15 digits, section
/// 3.3.1), so every `q` and `r` a client parses is the true number; and every store counts
/// exactly up to it, including stores that keep numbers as IEEE doubles (Redis Lua).
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
}

/// The shortest window or period a policy accepts.
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

/// The longest window or period a policy accepts (about ten years).
pub const MAX_PERIOD: Duration = Duration::from_secs(10 * 366 * 24 * 60 * 60);

/// The most sub-windows a sliding window counter may be cut into
/// ([`Policy::sliding_window_split`]); its state holds one counter more than that.
pub const MAX_SUB_WINDOWS: u32 = 64;

/// The longest a shaping leaky bucket may hold a request back.
pub const MAX_SHAPING_DELAY: Duration = Duration::from_secs(60 * 60);

/// A number of units per period: the refill rate of a bucket or the emission rate of GCRA.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Rate;
///
/// assert_eq!(Rate::per_second(5), Rate::new(5, Duration::from_secs(1)));
/// assert_eq!(Rate::per_minute(60).period(), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    amount: u64,
    period: Duration,
}

impl Rate {
    /// `amount` units every `period`. Checked when a policy is built from it.
    pub const fn new(amount: u64, period: Duration) -> Self {
        Self { amount, period }
    }

    /// `amount` units per second.
    pub const fn per_second(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(1))
    }

    /// `amount` units per minute.
    pub const fn per_minute(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(60))
    }

    /// `amount` units per hour.
    pub const fn per_hour(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(3600))
    }

    /// `amount` units per day.
    pub const fn per_day(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(86_400))
    }

    /// The number of units per period.
    pub const fn amount(&self) -> u64 {
        self.amount
    }

    /// The period.
    pub const fn period(&self) -> Duration {
        self.period
    }
}

/// How a leaky bucket treats a request that arrives while the bucket is busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeakMode {
    /// Drop (deny) what does not fit in the bucket: a meter, the twin of a token bucket.
    Police,
    /// Delay each request until the requests ahead of it have leaked out, so the service
    /// behind sees a steady rate; a request that would wait longer than `max_delay` is denied.
    Shape {
        /// The longest a request may be held back.
        max_delay: Duration,
    },
}

/// The algorithm of a policy and its parameters, as the user gave them.
///
/// Build policies with the [`Policy`] constructors; this type is what
/// [`Policy::algorithm`] reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// `limit` units per window aligned to the store's clock. Cheap; admits up to twice
    /// the limit across a window seam.
    FixedWindow {
        /// Units admitted per window.
        limit: u64,
        /// The window length.
        window: Duration,
    },
    /// Exact: remembers every admitted request for one window.
    SlidingLog {
        /// Units admitted in any window.
        limit: u64,
        /// The window length.
        window: Duration,
    },
    /// Counts per sub-window and a weighted estimate: the oldest sub-window counted by the
    /// share of it still inside the window (see [`Policy::sliding_window_split`]). With
    /// one sub-window, `previous * (1 - elapsed / window) + current`.
    SlidingWindow {
        /// Units admitted per (estimated) window.
        limit: u64,
        /// The window length.
        window: Duration,
        /// How many equal sub-windows the window is counted in (1: the classic two
        /// counters; more: finer, at one counter each).
        sub_windows: u32,
    },
    /// Bursts up to `capacity`, refilled at `refill`.
    TokenBucket {
        /// The burst size.
        capacity: u64,
        /// The sustained rate.
        refill: Rate,
    },
    /// A bucket that leaks at `leak`; see [`LeakMode`].
    LeakyBucket {
        /// How much the bucket holds (police mode); derived from the delay bound when shaping.
        capacity: u64,
        /// The leak (output) rate.
        leak: Rate,
        /// Drop or delay.
        mode: LeakMode,
    },
    /// Generic cell rate algorithm: one timestamp per key, the token bucket in one number.
    Gcra {
        /// The sustained rate.
        rate: Rate,
        /// How many units may arrive back to back.
        burst: u64,
    },
}

/// Why a policy or a policy set could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyError {
    /// The name is empty, too long, or has a character outside `A-Z a-z 0-9 - _ .`.
    InvalidName {
        /// The name as given.
        name: String,
    },
    /// A count (limit, capacity, burst, rate amount) is zero.
    Zero {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
    },
    /// A count is larger than [`MAX_LIMIT`].
    TooLarge {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// A window, period or delay is outside the accepted range.
    Duration {
        /// The policy.
        policy: String,
        /// Which parameter.
        what: &'static str,
        /// The value given.
        value: Duration,
        /// The smallest accepted value.
        min: Duration,
        /// The largest accepted value.
        max: Duration,
    },
    /// A sliding window counter's sub-windows are out of range, or do not cut its window
    /// into equal whole microseconds (the unit the Redis store counts in).
    SubWindows {
        /// The policy.
        policy: String,
        /// The sub-windows asked for.
        sub_windows: u32,
        /// The window.
        window: Duration,
    },
    /// Two policies in one set share a name, so their headers could not be told apart.
    DuplicateName {
        /// The name.
        name: String,
    },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::InvalidName { name } => write!(
                f,
                "policy name {name:?} is invalid: use 1 to 64 characters from A-Z a-z 0-9 - _ ."
            ),
            PolicyError::Zero { policy, what } => {
                write!(f, "policy \"{policy}\": {what} must be at least 1")
            }
            PolicyError::TooLarge {
                policy,
                what,
                value,
            } => write!(
                f,
                "policy \"{policy}\": {what} is {value}, more than the maximum {MAX_LIMIT}"
            ),
            PolicyError::Duration {
                policy,
                what,
                value,
                min,
                max,
            } => write!(
                f,
                "policy \"{policy}\": {what} is {value:?}, it must be between {min:?} and {max:?}"
            ),
            PolicyError::SubWindows {
                policy,
                sub_windows,
                window,
            } => write!(
                f,
                "policy \"{policy}\": {sub_windows} sub-windows cannot split the window \
                 {window:?}: use 1 to {MAX_SUB_WINDOWS} sub-windows that divide it into \
                 equal whole microseconds"
            ),
            PolicyError::DuplicateName { name } => {
                write!(f, "two policies in one set are named \"{name}\"")
            }
        }
    }
}

impl std::error::Error for PolicyError {}

/// One named limit and the algorithm that enforces it. Cheap to clone.
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
}

/// The id that tells one policy's state from another's in the in-process store: the
/// same for equal name and parameters, different otherwise, so a changed limit starts
/// from fresh state instead of reading state written under other units. Handed out in
/// order from one process-wide table (policies are few and built at start-up), so two
/// policies never share an id by accident, as hashes could.
fn policy_id(name: &str, algorithm: Algorithm) -> u32 {
    type Ids = HashMap<(Box<str>, Algorithm), u32>;
    static IDS: OnceLock<Mutex<Ids>> = OnceLock::new();
    let mut ids = IDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    *ids.entry((name.into(), algorithm)).or_insert(next)
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
        self.name() == other.name() && self.algorithm() == other.algorithm()
    }
}

impl Eq for Policy {}

struct Check<'a> {
    policy: &'a str,
}

impl Check<'_> {
    fn count(&self, what: &'static str, value: u64) -> Result<u64, PolicyError> {
        if value == 0 {
            return Err(PolicyError::Zero {
                policy: self.policy.to_owned(),
                what,
            });
        }
        if value > MAX_LIMIT {
            return Err(PolicyError::TooLarge {
                policy: self.policy.to_owned(),
                what,
                value,
            });
        }
        Ok(value)
    }

    fn duration(
        &self,
        what: &'static str,
        value: Duration,
        min: Duration,
        max: Duration,
    ) -> Result<u64, PolicyError> {
        if value < min || value > max {
            return Err(PolicyError::Duration {
                policy: self.policy.to_owned(),
                what,
                value,
                min,
                max,
            });
        }
        // In range, so it fits: MAX_PERIOD is about 3.2e17 ns.
        Ok(value.as_nanos() as u64)
    }

    fn rate(&self, what: &'static str, rate: Rate) -> Result<(u64, u64), PolicyError> {
        let amount = self.count(what, rate.amount)?;
        let period = self.duration("the rate's period", rate.period, MIN_PERIOD, MAX_PERIOD)?;
        Ok((amount, period))
    }
}

fn check_name(name: &str) -> Result<(), PolicyError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(PolicyError::InvalidName {
            name: name.to_owned(),
        })
    }
}

impl Policy {
    fn build(name: &str, algorithm: Algorithm) -> Result<Self, PolicyError> {
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
                // (nanoseconds) and Redis (microseconds) cut the time line alike. (One
                // sub-window keeps the rule of the other windows: any length.)
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
            Algorithm::LeakyBucket {
                capacity,
                leak,
                mode,
            } => {
                let (amount, period) = check.rate("leak amount", leak)?;
                match mode {
                    LeakMode::Police => Params::LeakyPolice {
                        capacity: check.count("capacity", capacity)?,
                        amount,
                        period,
                    },
                    LeakMode::Shape { max_delay } => {
                        let max_delay = check.duration(
                            "max_delay",
                            max_delay,
                            Duration::ZERO,
                            MAX_SHAPING_DELAY,
                        )?;
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
                }
            }
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
        Ok(Policy {
            inner: Arc::new(PolicyInner {
                name: name.into(),
                algorithm,
                params,
                id: policy_id(name, algorithm),
                unit: QuotaUnit::Requests,
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
            }),
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
    pub fn fixed_window(name: &str, limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::FixedWindow { limit, window })
    }

    /// A sliding log: at most `limit` units in any `window`. Exact; keeps one entry per
    /// admitted request for one window, so memory grows with the limit.
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
    /// replica's scaled-down share ([`Policy::scaled`]) can land there.
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
    pub fn token_bucket(name: &str, capacity: u64, refill: Rate) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::TokenBucket { capacity, refill })
    }

    /// A policing leaky bucket: holds up to `capacity` units and leaks at `leak`; what
    /// does not fit is denied.
    pub fn leaky_bucket(name: &str, capacity: u64, leak: Rate) -> Result<Self, PolicyError> {
        Self::build(
            name,
            Algorithm::LeakyBucket {
                capacity,
                leak,
                mode: LeakMode::Police,
            },
        )
    }

    /// A shaping leaky bucket: requests leave at `leak`, each one held back until those
    /// ahead of it have left; one that would wait longer than `max_delay` is denied.
    ///
    /// The layer sleeps for the delay before it calls the inner service. The bucket admits
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
        // The capacity a shaping bucket reports is derived; the field only matters to police.
        let capacity = Params::shaping_capacity(leak.amount, leak.period, max_delay);
        Self::build(
            name,
            Algorithm::LeakyBucket {
                capacity,
                leak,
                mode: LeakMode::Shape { max_delay },
            },
        )
    }

    /// GCRA: a sustained `rate` with bursts of up to `burst` units back to back.
    pub fn gcra(name: &str, rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::build(name, Algorithm::Gcra { rate, burst })
    }

    /// This policy with `share` (in (0, 1]) of its quota and rate: quotas rounded up
    /// (at least 1), rates slowed by stretching their period. Windows and delay bounds
    /// stay. Used for the local fallback of one replica among several.
    ///
    /// ```
    /// use tollgate::{Policy, Rate};
    ///
    /// let third = Policy::token_bucket("api", 30, Rate::per_second(30))?.scaled(1.0 / 3.0);
    /// assert_eq!(third.limit(), 10);
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn scaled(&self, share: f64) -> Policy {
        if !(share > 0.0 && share < 1.0) {
            return self.clone();
        }
        let count = |n: u64| ((n as f64 * share).ceil() as u64).clamp(1, n);
        let rate = |rate: Rate| {
            let period = rate.period.as_secs_f64() / share;
            Rate::new(
                rate.amount,
                Duration::from_secs_f64(period.min(MAX_PERIOD.as_secs_f64())),
            )
        };
        let algorithm = match self.algorithm() {
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
            Algorithm::LeakyBucket {
                capacity,
                leak,
                mode: LeakMode::Police,
            } => Algorithm::LeakyBucket {
                capacity: count(capacity),
                leak: rate(leak),
                mode: LeakMode::Police,
            },
            Algorithm::LeakyBucket {
                leak,
                mode: LeakMode::Shape { max_delay },
                ..
            } => {
                let leak = rate(leak);
                Algorithm::LeakyBucket {
                    capacity: Params::shaping_capacity(leak.amount, leak.period, max_delay),
                    leak,
                    mode: LeakMode::Shape { max_delay },
                }
            }
            Algorithm::Gcra { rate: r, burst } => Algorithm::Gcra {
                rate: rate(r),
                burst: count(burst),
            },
        };
        Self::build(self.name(), algorithm)
            .map(|scaled| scaled.with_unit(self.unit()))
            .unwrap_or_else(|_| self.clone())
    }

    /// The policy's name, as sent in the `RateLimit` headers.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The algorithm and its parameters.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// The quota a client sees: the most units this policy admits at once.
    #[inline]
    pub fn limit(&self) -> u64 {
        self.inner.params.limit()
    }

    /// The window the quota is measured over, as advertised in `RateLimit-Policy` (`w`):
    /// the window of a window algorithm, or the time a bucket takes to refill from empty.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.inner.params.window_nanos())
    }

    #[inline]
    pub(crate) fn params(&self) -> &Params {
        &self.inner.params
    }

    /// A fingerprint of the name and parameters; stores keep state per id.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        self.inner.id
    }
}

/// The policies a request must all pass, in order. Cheap to clone.
///
/// A request is admitted only when every policy admits it; a denied request debits none.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Policy, PolicySet, Rate};
///
/// let set = PolicySet::new([
///     Policy::token_bucket("burst", 10, Rate::per_second(10))?,
///     Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?,
/// ])?;
/// assert_eq!(set.len(), 2);
/// assert!(PolicySet::new([set[0].clone(), set[0].clone()]).is_err());
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Clone)]
pub struct PolicySet {
    inner: Arc<PolicySetInner>,
}

struct PolicySetInner {
    policies: Box<[Policy]>,
    /// `RateLimit-Policy` (draft-11) for this set, built once.
    policy_header: Option<HeaderValue>,
    /// Tells sets of different policies apart (the ids, in order).
    fingerprint: u64,
}

impl fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.inner.policies.iter()).finish()
    }
}

impl PolicySet {
    /// A set of policies with distinct names.
    #[inline]
    pub fn new(policies: impl IntoIterator<Item = Policy>) -> Result<Self, PolicyError> {
        let policies: Vec<Policy> = policies.into_iter().collect();
        for (i, policy) in policies.iter().enumerate() {
            if policies[..i].iter().any(|p| p.name() == policy.name()) {
                return Err(PolicyError::DuplicateName {
                    name: policy.name().to_owned(),
                });
            }
        }
        Ok(Self::from_vec(policies))
    }

    /// The empty set: requests it is resolved for are not limited and get no headers.
    pub fn unlimited() -> Self {
        Self::from_vec(Vec::new())
    }

    fn from_vec(policies: Vec<Policy>) -> Self {
        let policy_header = crate::headers::policy_header(&policies);
        let fingerprint = policies
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, policy| {
                (hash ^ u64::from(policy.id())).wrapping_mul(0x0100_0000_01b3)
            });
        PolicySet {
            inner: Arc::new(PolicySetInner {
                policies: policies.into_boxed_slice(),
                policy_header,
                fingerprint,
            }),
        }
    }

    /// This set with `policy` added, replacing a policy of the same name.
    pub fn with(&self, policy: Policy) -> Self {
        let mut policies: Vec<Policy> = self
            .inner
            .policies
            .iter()
            .filter(|p| p.name() != policy.name())
            .cloned()
            .collect();
        policies.push(policy);
        Self::from_vec(policies)
    }

    /// Every policy [`scaled`](Policy::scaled) to `share`.
    pub fn scaled(&self, share: f64) -> PolicySet {
        Self::from_vec(self.iter().map(|policy| policy.scaled(share)).collect())
    }

    /// Equal for sets of the same policies in the same order.
    pub(crate) fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    /// True when both are clones of one set.
    pub(crate) fn same_as(&self, other: &PolicySet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The policies, in order.
    pub fn policies(&self) -> &[Policy] {
        &self.inner.policies
    }

    pub(crate) fn policy_header(&self) -> Option<&HeaderValue> {
        self.inner.policy_header.as_ref()
    }
}

impl std::ops::Deref for PolicySet {
    type Target = [Policy];

    fn deref(&self) -> &[Policy] {
        &self.inner.policies
    }
}

impl From<Policy> for PolicySet {
    fn from(policy: Policy) -> Self {
        Self::from_vec(vec![policy])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn with_replaces_a_policy_of_the_same_name() {
        let set = PolicySet::from(Policy::gcra("api", Rate::per_second(1), 1).unwrap());
        let set = set.with(Policy::gcra("api", Rate::per_second(2), 4).unwrap());
        assert_eq!(set.len(), 1);
        assert_eq!(set[0].limit(), 4);
    }
}

/// Picks the policies for a request: a fixed set, or per plan, tenant or route.
///
/// A [`PolicySet`] is itself a resolver that always answers itself. An empty set means
/// "not limited" (no headers either), which lets a resolver exempt some requests on
/// purpose.
pub trait PolicyResolver: Send + Sync + 'static {
    /// The policies `parts` (identified as `key`) must pass.
    fn resolve<'a>(
        &'a self,
        parts: &http::request::Parts,
        key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet>;

    /// Checked when the layer is built: a static resolver with no policy is a mistake.
    fn check_configured(&self) -> Result<(), &'static str> {
        Ok(())
    }

    /// The policy sets this resolver can answer, when they are known ahead: the layer asks
    /// its store to [validate](crate::Store::validate) each one when it is built. The
    /// default (for closures) knows none; their sets are checked per request instead.
    fn known_sets(&self) -> Vec<PolicySet> {
        Vec::new()
    }
}

impl PolicyResolver for PolicySet {
    fn resolve<'a>(
        &'a self,
        _parts: &http::request::Parts,
        _key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet> {
        std::borrow::Cow::Borrowed(self)
    }

    fn known_sets(&self) -> Vec<PolicySet> {
        vec![self.clone()]
    }

    fn check_configured(&self) -> Result<(), &'static str> {
        if self.is_empty() {
            Err("RateLimitLayer has no policy: add one with .policy(...) or .policies(...)")
        } else {
            Ok(())
        }
    }
}

/// A resolver from a closure; see [`resolve_with`].
#[derive(Clone)]
pub struct ResolveFn<F> {
    f: F,
}

impl<F> fmt::Debug for ResolveFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResolveFn")
    }
}

/// A resolver from a closure that returns a reference to one of the sets it owns, for
/// example by the plan that authentication middleware stored in the request.
///
/// ```
/// use http::Request;
/// use tollgate::policy::{resolve_with, PolicyResolver};
/// use tollgate::{Key, Policy, PolicySet, Rate};
///
/// #[derive(Clone, Copy)]
/// enum Plan { Free, Pro }
///
/// let free = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(10))?);
/// let pro = PolicySet::from(Policy::token_bucket("api", 100, Rate::per_second(100))?);
/// let by_plan = resolve_with(move |parts, _key| {
///     match parts.extensions.get::<Plan>() {
///         Some(Plan::Pro) => pro.clone(),
///         _ => free.clone(),
///     }
/// });
/// let mut request = Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(Plan::Pro);
/// let (parts, _) = request.into_parts();
/// assert_eq!(by_plan.resolve(&parts, &Key::new("user:1"))[0].limit(), 100);
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
pub fn resolve_with<F>(f: F) -> ResolveFn<F>
where
    F: Fn(&http::request::Parts, &crate::Key) -> PolicySet + Send + Sync + 'static,
{
    ResolveFn { f }
}

impl<F> PolicyResolver for ResolveFn<F>
where
    F: Fn(&http::request::Parts, &crate::Key) -> PolicySet + Send + Sync + 'static,
{
    fn resolve<'a>(
        &'a self,
        parts: &http::request::Parts,
        key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet> {
        std::borrow::Cow::Owned((self.f)(parts, key))
    }
}
