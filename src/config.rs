//! Policies from configuration, changed while running (feature `config`).
//!
//! [`LimiterConfig`] is a serde structure: read it from TOML, YAML or JSON, whichever
//! your app uses. It describes the policies, the plans (named policy sets chosen per
//! request), the costs per route, the key extractor chain, the failure mode and shadow
//! flags. [`LimiterConfig::check`] (and every load) refuses an invalid configuration with
//! an error that names the entry and the reason.
//!
//! [`LiveLayer`] serves a configuration and swaps to a new one atomically
//! ([`LiveLayer::reload`]): a request reads the configuration once, when it arrives, and
//! finishes under it, so no request mixes two configurations, and requests in flight
//! during a reload finish under the one they started with. State lives in the store,
//! keyed by each policy's name and parameters: a policy that a reload leaves unchanged
//! keeps its state; a policy whose parameters change starts on fresh state, except an
//! in-flight policy: its requests in progress keep their slots under a new limit or
//! lease. The old state is left behind: in Redis it expires with its TTL; in the
//! in-process store it goes once it is fresh (its window over, its bucket full again),
//! at the identity's next decision after that, so an identity that keeps coming back
//! keeps no state per reload.
//!
//! Below, a configuration of two plans chosen by the `x-plan` header and two routes that
//! cost more than 1 serves three requests; then a reload.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{Layer, ServiceExt, service_fn};
//! use tollgate::clock::ManualClock;
//! use tollgate::config::{LimiterConfig, LiveLayer};
//! use tollgate::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Behind the authentication layer, which refuses unknown API keys: a client that
//! // invents a key per request would otherwise get a fresh budget each time.
//! let toml = r#"
//!     key = ["header:x-api-key", "ip"]
//!     plan_header = "x-plan"
//!
//!     [[policies]]
//!     name = "api"
//!     algorithm = "token-bucket"
//!     capacity = 100
//!     rate = "10/s"
//!
//!     [[policies]]
//!     name = "api-pro"
//!     algorithm = "token-bucket"
//!     capacity = 1000
//!     rate = "100/s"
//!
//!     [plans]
//!     default = ["api"]
//!     pro = ["api-pro"]
//!
//!     [costs]
//!     default = 1
//!     routes = { "/search" = 5, "POST /upload" = 20 }
//! "#;
//! let config: LimiterConfig = toml::from_str(toml)?;
//! let layer = LiveLayer::new(MemoryStore::builder().clock(ManualClock::new()).build(), &config)?;
//! let service = layer.layer(service_fn(|_: Request<()>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
//! }));
//! // The `RateLimit` field of the response to a request.
//! let remaining = |method: &str, path: &str, api_key: &str, plan: Option<&str>| {
//!     let mut request = Request::builder().method(method).uri(path).header("x-api-key", api_key);
//!     if let Some(plan) = plan {
//!         request = request.header("x-plan", plan);
//!     }
//!     let call = service.clone().oneshot(request.body(()).unwrap());
//!     async move { call.await.unwrap().headers()["ratelimit"].to_str().unwrap().to_owned() }
//! };
//! // The default plan; a search costs 5 of its 100.
//! assert_eq!(remaining("GET", "/search", "k1", None).await, "\"api\";r=95;t=1");
//! // An upload costs 20.
//! assert_eq!(remaining("POST", "/upload", "k1", None).await, "\"api\";r=75;t=1");
//! // The plan the header names, with a budget of its own.
//! assert_eq!(remaining("GET", "/", "k2", Some("pro")).await, "\"api-pro\";r=999;t=1");
//!
//! // Later, from a file watcher or a SIGHUP handler:
//! layer.reload(&config)?;
//! # Ok(()) }
//! ```
//!
//! A reload that fails keeps the running configuration and returns the error.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderName, Method, Request, Response};
use serde::Deserialize;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::cost::{Cost, PerRoute};
use crate::failure::{Breaker, CircuitBreaker, FailureMode, LocalFallback};
use crate::future::ResponseFuture;
use crate::key::{
    ClientIp, ForwardedHeader, Global, HeaderKey, Key, KeyExtractor, KeyExtractorExt,
};
use crate::layer::RateLimitLayer;
use crate::policy::{Penalty, Policy, PolicySet, Rate};
use crate::resolve::PolicyResolver;
use crate::respond::headers::HeaderStyle;
use crate::service::{Config, RateLimit};
use crate::store::Store;

/// A whole limiter's configuration. Every field but `policies` has a default.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimiterConfig {
    /// The key extractor chain: the first that finds a key names the client. Entries:
    /// `"ip"` (the client address, behind `trusted_proxies`), `"header:NAME"` (a header,
    /// hashed: API keys and tokens; salted with `key_salt_env`), `"global"` (one budget
    /// for everyone). `"ip"` and `"global"` always find a key, so they come last, and a
    /// header is read once (a second key of it is never reached). At most 16 keys.
    /// Default: `["ip"]`.
    ///
    /// A header the client writes names a new budget for every value it sends: put such a
    /// layer behind the authentication that refuses unknown keys, or a client that
    /// invents a key per request is never limited.
    #[serde(default)]
    pub key: Vec<String>,
    /// The environment variable that holds a salt mixed into the hash of every
    /// `"header:NAME"` key ([`HeaderKey::salt`]): set it when a header carries secrets a
    /// list of candidates could find in a store dump (`Authorization: Basic` holds a
    /// password). The variable must be set, to 16 bytes at least (a random secret);
    /// every replica must see the same value. The salt itself is never in the
    /// configuration, nor in its errors.
    #[serde(default)]
    pub key_salt_env: Option<String>,
    /// Proxies whose forwarding header is believed by `"ip"` (addresses or networks).
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// The header the `trusted_proxies` name their clients in: `"x-forwarded-for"`
    /// (the default) or `"forwarded"` (RFC 7239's `Forwarded: for=...`): the one your
    /// proxies write and replace (see [`ClientIp::forwarded_header`]).
    #[serde(default)]
    pub forwarded_header: Option<String>,
    /// The policies.
    pub policies: Vec<PolicySpec>,
    /// Named policy sets; a request gets the plan its `plan_header` names, else
    /// `default`. Without plans, every request must pass every policy. With plans, each
    /// policy must be in at least one (a policy no plan lists is an error).
    #[serde(default, deserialize_with = "unique_keys")]
    pub plans: BTreeMap<String, Vec<String>>,
    /// The request header naming a request's plan (set by your authentication in front:
    /// never one a client can choose for itself: have it replace the header, not append
    /// to it). A request that carries it twice, or names no plan there is, gets
    /// `default`, which should be the least generous plan; either is counted
    /// (`tollgate_plans_unknown_total`) and said at warn level once per value (again
    /// every ten minutes while it goes on). The value is shown only when it is no longer
    /// than the longest plan name and 16 bytes (a misspelt plan); a longer one may be a
    /// credential, and is named by its length and a hash keyed at random per process.
    #[serde(default)]
    pub plan_header: Option<String>,
    /// What requests cost.
    #[serde(default)]
    pub costs: CostSpec,
    /// `"fallback"` (default: a local limiter decides while the store is away),
    /// `"fail-open"` or `"fail-closed"`.
    #[serde(default)]
    pub failure_mode: Option<String>,
    /// The share of every limit the fallback enforces while the store is away
    /// ([`LocalFallback::share`]): one over the number of replicas, so the fleet as a
    /// whole stays near the limit. At least one millionth, at most 1; default 1 (each
    /// replica the whole limit). Only with the fallback failure mode.
    #[serde(default)]
    pub fallback_share: Option<f64>,
    /// How long the store may take to decide before the request counts as a store failure
    /// ([`RateLimitLayer::store_timeout`]): a duration above zero (`"150ms"`); default
    /// 50 ms. With Redis, keep it above three round trips (a Cluster's redirects, a
    /// coalesced batch); the Redis store's connection gives up on an answer after 500 ms
    /// (1 s on a Cluster or behind Sentinel), whatever is set here.
    #[serde(default)]
    pub store_timeout: Option<String>,
    /// When to stop calling a failing store, and when to probe it again
    /// ([`RateLimitLayer::circuit_breaker`]). Default: open after 5 failures in a row,
    /// probe every second. A reload sets it on the breaker as it is: an open breaker
    /// stays open until its probe (a shorter cool-down ends the running one within its
    /// length from the reload), and opens next for the new cool-down.
    #[serde(default)]
    pub circuit_breaker: Option<BreakerSpec>,
    /// Runs the whole layer in shadow mode ([`RateLimitLayer::shadow`]).
    #[serde(default)]
    pub shadow: bool,
    /// Lists shadow policies in the headers ([`RateLimitLayer::shadow_headers`]). Refused
    /// when nothing is in shadow (no shadow policy, and `shadow` is false).
    #[serde(default)]
    pub shadow_headers: bool,
    /// `"draft-11"` (default), `"draft-6"`, `"legacy"` or `"none"`.
    #[serde(default)]
    pub headers: Option<String>,
}

/// The circuit breaker's settings ([`CircuitBreaker`]).
///
/// ```
/// use tollgate::config::LimiterConfig;
///
/// let config: LimiterConfig = toml::from_str(r#"
///     store_timeout = "150ms"
///     circuit_breaker = { failures = 3, cool_down = "5s" }
///
///     [[policies]]
///     name = "api"
///     algorithm = "gcra"
///     rate = "10/s"
///     burst = 20
/// "#)?;
/// config.check()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BreakerSpec {
    /// Failures in a row that open the breaker: at least 1; default 5.
    #[serde(default)]
    pub failures: Option<u32>,
    /// How long the breaker stays open before a probe (`"1s"`): at most
    /// [`MAX_PERIOD`](crate::policy::MAX_PERIOD); default 1 s.
    #[serde(default)]
    pub cool_down: Option<String>,
}

/// One policy. `algorithm` picks which of the other fields it needs:
///
/// | algorithm | fields |
/// |---|---|
/// | `fixed-window`, `sliding-log` | `limit`, `window` |
/// | `sliding-window` | `limit`, `window`, optional `sub_windows` |
/// | `token-bucket`, `leaky-bucket` | `capacity`, `rate` |
/// | `leaky-shaping` | `rate`, `max_delay` |
/// | `gcra` | `rate`, `burst` |
/// | `concurrency` | `limit`, optional `lease` |
///
/// Durations are written `250ms`, `10s`, `5m`, `2h` or `1d`; rates `10/s`, `3/10s` or
/// `1000/1h`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// The name (letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// The algorithm.
    pub algorithm: String,
    /// Units per window, or requests in flight.
    pub limit: Option<u64>,
    /// The window.
    pub window: Option<String>,
    /// Sub-windows of a sliding window counter.
    pub sub_windows: Option<u32>,
    /// A bucket's capacity.
    pub capacity: Option<u64>,
    /// Refill, leak or emission rate.
    pub rate: Option<String>,
    /// GCRA burst.
    pub burst: Option<u64>,
    /// The longest a shaping bucket holds a request.
    pub max_delay: Option<String>,
    /// An in-flight slot's lease.
    pub lease: Option<String>,
    /// A shadow policy ([`Policy::shadow`]).
    #[serde(default)]
    pub shadow: bool,
    /// A penalty ([`Policy::with_penalty`]).
    pub penalty: Option<PenaltySpec>,
}

/// A policy's penalty ([`Penalty`]): after `denials` denials within `within`, the key is
/// blocked for `block`; with `max_block`, each repeat doubles the block up to it.
/// Durations as the policy's are written. A shadow policy cannot have one (it never
/// denies).
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::config::{LimiterConfig, LiveLayer};
/// use tollgate::MemoryStore;
///
/// let config: LimiterConfig = toml::from_str(r#"
///     [[policies]]
///     name = "login"
///     algorithm = "fixed-window"
///     limit = 5
///     window = "1m"
///     penalty = { denials = 3, within = "1m", block = "5m", max_block = "1h" }
/// "#)?;
/// config.check()?;
/// let store = MemoryStore::builder().clock(ManualClock::new()).build();
/// let live = LiveLayer::new(store.clone(), &config)?;
/// let login = live.policies(None).unwrap();
/// let penalty = login[0].penalty().unwrap();
/// assert_eq!(penalty.denials(), 3);
/// assert_eq!(penalty.block(), Duration::from_secs(300));
/// assert_eq!(penalty.max_block(), Duration::from_secs(3600));
///
/// // Five attempts, two denials, and the third denial blocks for 5 minutes.
/// assert!(store.check("ip:203.0.113.7", &login, 5).is_allowed());
/// store.check("ip:203.0.113.7", &login, 1);
/// store.check("ip:203.0.113.7", &login, 1);
/// let blocked = store.check("ip:203.0.113.7", &login, 1);
/// assert!(blocked.is_blocked());
/// assert_eq!(blocked.retry_after(), Some(Duration::from_secs(300)));
///
/// // A longest block shorter than the first is refused, naming the entry.
/// let config: LimiterConfig = toml::from_str(r#"
///     [[policies]]
///     name = "login"
///     algorithm = "fixed-window"
///     limit = 5
///     window = "1m"
///     penalty = { denials = 3, within = "1m", block = "5m", max_block = "1m" }
/// "#)?;
/// assert_eq!(config.check().unwrap_err().entry(), "policies[0] \"login\"");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PenaltySpec {
    /// Denials that start a block.
    pub denials: u64,
    /// The window they are counted in.
    pub within: String,
    /// The first block.
    pub block: String,
    /// The longest block; each repeat doubles the block up to it.
    pub max_block: Option<String>,
}

/// What requests cost.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostSpec {
    /// The cost of a request no route names (default 1). Every plan must be able to
    /// admit it (a route's cost need fit one plan only).
    #[serde(default = "one")]
    pub default: u64,
    /// Per route: `"/search" = 5` or `"POST /upload" = 20` (the route as the router
    /// matched it, or the path).
    #[serde(default, deserialize_with = "unique_keys")]
    pub routes: BTreeMap<String, u64>,
}

/// A map whose keys are each named once: JSON lets an object name a key twice, and a
/// map would keep the last silently (a route or a plan written twice is a mistake).
fn unique_keys<'de, D, V>(deserializer: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(std::marker::PhantomData<V>);

    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            use std::collections::btree_map::Entry;
            let mut out = BTreeMap::new();
            while let Some((key, value)) = map.next_entry::<String, V>()? {
                match out.entry(key) {
                    Entry::Vacant(vacant) => vacant.insert(value),
                    Entry::Occupied(named) => {
                        let message = format!("{:?} is named twice", named.key());
                        return Err(serde::de::Error::custom(message));
                    }
                };
            }
            Ok(out)
        }
    }

    deserializer.deserialize_map(Unique(std::marker::PhantomData))
}

fn one() -> u64 {
    1
}

impl Default for CostSpec {
    fn default() -> Self {
        Self {
            default: 1,
            routes: BTreeMap::new(),
        }
    }
}

/// An invalid configuration: the entry and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    entry: String,
    reason: String,
}

impl ConfigError {
    fn new(entry: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            entry: entry.into(),
            reason: reason.into(),
        }
    }

    /// The entry: `policies[2] "api"`, `plans.pro`, `costs.routes."/search"`, `key[1]`.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.entry, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// `250ms`, `10s`, `5m`, `2h`, `1d`.
fn duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| {
        // Digits only, and still no u64: a number too large, not a misspelling.
        if number.is_empty() {
            format!("{text:?} is not a duration (write 250ms, 10s, 5m, 2h or 1d)")
        } else {
            format!("{text:?} is too long")
        }
    })?;
    let unit = match unit.trim() {
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        _ => {
            return Err(format!(
                "{text:?} is not a duration (write 250ms, 10s, 5m, 2h or 1d)"
            ));
        }
    };
    let nanos = u128::from(number) * unit.as_nanos();
    u64::try_from(nanos)
        .map(Duration::from_nanos)
        .map_err(|_| format!("{text:?} is too long"))
}

/// `result`, its error naming `field` (`window: "1x" is not a duration ...`).
fn in_field<T>(field: &str, result: Result<T, String>) -> Result<T, String> {
    result.map_err(|reason| format!("{field}: {reason}"))
}

/// `10/s`, `3/10s`, `1000/1h`.
fn rate(text: &str) -> Result<Rate, String> {
    let (amount, per) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?} is not a rate (write 10/s, 3/10s or 1000/1h)"))?;
    let amount = amount.trim();
    let amount: u64 = amount.parse().map_err(|_| {
        if !amount.is_empty() && amount.bytes().all(|b| b.is_ascii_digit()) {
            format!("{text:?}: the amount is too large")
        } else {
            format!("{text:?} is not a rate (write 10/s, 3/10s or 1000/1h)")
        }
    })?;
    let per = per.trim();
    let period = if per.starts_with(|c: char| c.is_ascii_digit()) {
        duration(per)?
    } else {
        // A bare unit: the error names what was written, not the "1" put before it.
        duration(&format!("1{per}")).map_err(|_| {
            format!(
                "{text:?} is not a rate: {per:?} is not a period (write s, m, h, d or a \
                 duration: 10s)"
            )
        })?
    };
    Ok(Rate::new(amount, period))
}

impl PolicySpec {
    /// Refuses a field the algorithm does not read: a policing bucket given a shaping
    /// bucket's `max_delay` is a mistake to report, not a detail to drop.
    fn reads_every_field(&self) -> Result<(), String> {
        let read: &[&str] = match self.algorithm.as_str() {
            "fixed-window" | "sliding-log" => &["limit", "window"],
            "sliding-window" => &["limit", "window", "sub_windows"],
            "token-bucket" | "leaky-bucket" => &["capacity", "rate"],
            "leaky-shaping" => &["rate", "max_delay"],
            "gcra" => &["rate", "burst"],
            "concurrency" => &["limit", "lease"],
            // An unknown algorithm is reported as such.
            _ => return Ok(()),
        };
        let given = [
            ("limit", self.limit.is_some()),
            ("window", self.window.is_some()),
            ("sub_windows", self.sub_windows.is_some()),
            ("capacity", self.capacity.is_some()),
            ("rate", self.rate.is_some()),
            ("burst", self.burst.is_some()),
            ("max_delay", self.max_delay.is_some()),
            ("lease", self.lease.is_some()),
        ];
        match given
            .iter()
            .find(|(field, set)| *set && !read.contains(field))
        {
            Some((field, _)) => Err(format!(
                "{} does not read `{field}` (it reads {})",
                self.algorithm,
                read.iter()
                    .map(|field| format!("`{field}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            None => Ok(()),
        }
    }

    fn build(&self) -> Result<Policy, String> {
        let need = |field: &str, value: Option<u64>| {
            value.ok_or_else(|| format!("{} needs `{field}`", self.algorithm))
        };
        let need_text = |field: &str, value: &Option<String>| {
            value
                .clone()
                .ok_or_else(|| format!("{} needs `{field}`", self.algorithm))
        };
        // A required duration or rate, its error naming the field.
        let need_duration = |field: &str, value: &Option<String>| {
            in_field(field, duration(&need_text(field, value)?))
        };
        let need_rate =
            |field: &str, value: &Option<String>| in_field(field, rate(&need_text(field, value)?));
        let name = self.name.as_str();
        let error = |e: crate::PolicyError| e.to_string();
        self.reads_every_field()?;
        let policy = match self.algorithm.as_str() {
            "fixed-window" => Policy::fixed_window(
                name,
                need("limit", self.limit)?,
                need_duration("window", &self.window)?,
            )
            .map_err(error)?,
            "sliding-log" => Policy::sliding_log(
                name,
                need("limit", self.limit)?,
                need_duration("window", &self.window)?,
            )
            .map_err(error)?,
            "sliding-window" => Policy::sliding_window_split(
                name,
                need("limit", self.limit)?,
                need_duration("window", &self.window)?,
                self.sub_windows.unwrap_or(1),
            )
            .map_err(error)?,
            "token-bucket" => Policy::token_bucket(
                name,
                need("capacity", self.capacity)?,
                need_rate("rate", &self.rate)?,
            )
            .map_err(error)?,
            "leaky-bucket" => Policy::leaky_bucket(
                name,
                need("capacity", self.capacity)?,
                need_rate("rate", &self.rate)?,
            )
            .map_err(error)?,
            "leaky-shaping" => Policy::leaky_bucket_shaping(
                name,
                need_rate("rate", &self.rate)?,
                need_duration("max_delay", &self.max_delay)?,
            )
            .map_err(error)?,
            "gcra" => Policy::gcra(
                name,
                need_rate("rate", &self.rate)?,
                need("burst", self.burst)?,
            )
            .map_err(error)?,
            "concurrency" => match &self.lease {
                Some(lease) => Policy::concurrency_with_lease(
                    name,
                    need("limit", self.limit)?,
                    in_field("lease", duration(lease))?,
                ),
                None => Policy::concurrency(name, need("limit", self.limit)?),
            }
            .map_err(error)?,
            other => {
                return Err(format!(
                    "unknown algorithm {other:?} (fixed-window, sliding-log, sliding-window, \
                     token-bucket, leaky-bucket, leaky-shaping, gcra, concurrency)"
                ));
            }
        };
        let policy = match &self.penalty {
            Some(spec) => {
                let mut penalty = Penalty::new(
                    spec.denials,
                    in_field("penalty.within", duration(&spec.within))?,
                    in_field("penalty.block", duration(&spec.block))?,
                );
                if let Some(max) = &spec.max_block {
                    penalty = penalty.doubling_up_to(in_field("penalty.max_block", duration(max))?);
                }
                policy.with_penalty(penalty).map_err(error)?
            }
            None => policy,
        };
        if self.shadow && self.penalty.is_some() {
            return Err(
                "a shadow policy's penalty is never applied (it never denies): remove \
                        the penalty or the shadow flag"
                    .to_owned(),
            );
        }
        Ok(if self.shadow { policy.shadow() } else { policy })
    }
}

/// A configuration turned into the layer's parts.
struct Compiled {
    fallback_share: Option<f64>,
    key: Arc<dyn KeyExtractor>,
    cost: Arc<dyn Cost>,
    resolver: Arc<dyn PolicyResolver>,
    sets: Sets,
    failure_mode: Option<&'static str>,
    store_timeout: Option<Duration>,
    breaker: CircuitBreaker,
    shadow: bool,
    shadow_headers: bool,
    headers: HeaderStyle,
}

impl LimiterConfig {
    /// Checks the configuration: every entry valid, every name known. The error names the
    /// first entry at fault and why. It knows no store: what a store cannot decide exactly
    /// (the Redis store refuses some very large quotas) is refused when a layer is built
    /// over it ([`LiveLayer::new`], a reload), so a check in CI passes such a file. It
    /// reads the environment variable `key_salt_env` names, as loading does: a check in CI
    /// of a file that names one needs it set (any value of the salt's least length will
    /// do there).
    ///
    /// ```
    /// use tollgate::config::LimiterConfig;
    ///
    /// let config: LimiterConfig = toml::from_str(r#"
    ///     [[policies]]
    ///     name = "api"
    ///     algorithm = "fixed-window"
    ///     limit = 10
    ///     window = "10 parsecs"
    /// "#)?;
    /// let error = config.check().unwrap_err();
    /// assert_eq!(error.entry(), "policies[0] \"api\"");
    /// assert!(error.reason().contains("not a duration"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check(&self) -> Result<(), ConfigError> {
        self.compile().map(drop)
    }

    fn compile(&self) -> Result<Compiled, ConfigError> {
        if self.policies.is_empty() {
            return Err(ConfigError::new("policies", "no policy: add at least one"));
        }
        let mut policies: HashMap<&str, Policy> = HashMap::new();
        for (index, spec) in self.policies.iter().enumerate() {
            let entry = format!("policies[{index}] {:?}", spec.name);
            let policy = spec
                .build()
                .map_err(|reason| ConfigError::new(&entry, reason))?;
            if policies.insert(spec.name.as_str(), policy).is_some() {
                return Err(ConfigError::new(
                    entry,
                    "a policy of this name comes earlier",
                ));
            }
        }
        let plan_header = match &self.plan_header {
            Some(name) => Some(HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                ConfigError::new("plan_header", format!("{name:?} is not a header name"))
            })?),
            None => None,
        };
        // A value that names no plan is logged: never a secret. Not a header the keys
        // hash (an API key, kept out of logs as the key), nor one holding credentials.
        if let Some(header) = &plan_header {
            let keyed = self.key.iter().any(|spec| {
                spec.strip_prefix("header:")
                    .is_some_and(|keyed| keyed.eq_ignore_ascii_case(header.as_str()))
            });
            let credentials = [
                http::header::AUTHORIZATION,
                http::header::PROXY_AUTHORIZATION,
                http::header::COOKIE,
            ];
            let secret = if keyed {
                Some("is a header the key reads (and hashes, as a secret)")
            } else if credentials.contains(header) {
                Some("holds credentials")
            } else {
                None
            };
            if let Some(secret) = secret {
                return Err(ConfigError::new(
                    "plan_header",
                    format!(
                        "{:?} {secret}: a value naming no plan would be logged in clear; name \
                         plans in a header of their own, set by the auth layer",
                        header.as_str()
                    ),
                ));
            }
        }
        // Each plan's set (one unnamed set without plans), for the costs' check below.
        let mut plan_sets: Vec<(Option<&str>, PolicySet)> = Vec::new();
        let (resolver, sets): (Arc<dyn PolicyResolver>, Sets) = if self.plans.is_empty() {
            if plan_header.is_some() {
                return Err(ConfigError::new(
                    "plan_header",
                    "there are no plans to choose from",
                ));
            }
            let all = self
                .policies
                .iter()
                .map(|spec| policies[spec.name.as_str()].clone());
            let all =
                PolicySet::new(all).map_err(|e| ConfigError::new("policies", e.to_string()))?;
            plan_sets.push((None, all.clone()));
            let sets = Sets {
                default: all.clone(),
                plans: HashMap::new(),
            };
            (Arc::new(all), sets)
        } else {
            let mut sets = HashMap::new();
            for (plan, names) in &self.plans {
                // Escaped: a file's control characters reach no operator's terminal.
                let entry = format!("plans.{}", plan.escape_debug());
                if plan.trim() != plan {
                    return Err(ConfigError::new(
                        &entry,
                        "spaces around a plan name: the plan header's value is read without \
                         them, so this plan would never be chosen",
                    ));
                }
                // An empty header value reads as naming no plan, not this one.
                if plan.is_empty() {
                    return Err(ConfigError::new(
                        &entry,
                        "an empty plan name: only an empty plan header would choose it, \
                         which reads as naming no plan (give it a name)",
                    ));
                }
                // The plan header's value is read as visible ASCII (and spaces inside).
                if !plan.bytes().all(|byte| (b' '..=b'~').contains(&byte)) {
                    return Err(ConfigError::new(
                        &entry,
                        "no header value names this plan (a plan name is visible ASCII, \
                         spaces inside allowed), so it would never be chosen",
                    ));
                }
                if names.is_empty() {
                    return Err(ConfigError::new(
                        &entry,
                        "an empty plan limits nothing: its requests would pass unlimited \
                         (list at least one policy; a generous one for an unlimited tier)",
                    ));
                }
                let mut set = Vec::new();
                for name in names {
                    let policy = policies.get(name.as_str()).ok_or_else(|| {
                        ConfigError::new(&entry, format!("no policy is named {name:?}"))
                    })?;
                    set.push(policy.clone());
                }
                let set =
                    PolicySet::new(set).map_err(|e| ConfigError::new(&entry, e.to_string()))?;
                plan_sets.push((Some(plan.as_str()), set.clone()));
                sets.insert(plan.clone(), set);
            }
            // A policy no plan lists would limit nothing: a typo or a forgotten entry
            // that looks enforced and is not.
            if let Some((index, spec)) = self
                .policies
                .iter()
                .enumerate()
                .find(|(_, spec)| !self.plans.values().flatten().any(|name| *name == spec.name))
            {
                return Err(ConfigError::new(
                    format!("policies[{index}] {:?}", spec.name),
                    "no plan lists it, so it would limit nothing: add it to a plan or remove it",
                ));
            }
            let default = sets.get("default").cloned().ok_or_else(|| {
                ConfigError::new(
                    "plans",
                    "no plan is named \"default\" (the plan of requests that name none)",
                )
            })?;
            if sets.len() == 1 && plan_header.is_some() {
                return Err(ConfigError::new(
                    "plan_header",
                    "there is only the default plan: the header would choose nothing",
                ));
            }
            if sets.len() > 1 && plan_header.is_none() {
                return Err(ConfigError::new(
                    "plans",
                    "there are several plans and no plan_header to choose between them: \
                     every request would get \"default\"",
                ));
            }
            let sets = Sets {
                default,
                plans: sets,
            };
            let plans = Plans {
                longest: sets.plans.keys().map(String::len).max().unwrap_or(0),
                sets: sets.clone(),
                header: plan_header,
            };
            (Arc::new(plans), sets)
        };
        // A cost that no plan's policies can ever admit gets every such request refused
        // (400), whatever the client does: a mistake to report here. A route's cost some
        // plans admit is a route for those plans (the others' clients are told it never
        // fits); the default cost (`every`), which prices every route not listed, must
        // fit every plan, or one is shut out of the API. In-flight policies count
        // requests, not costs, and shadow policies (or a layer in shadow) never refuse.
        let fits = |entry: &str, units: u64, every: bool| -> Result<(), ConfigError> {
            if self.shadow {
                return Ok(());
            }
            let refuses = |policy: &&Policy| {
                !policy.is_shadow()
                    && !matches!(policy.algorithm(), crate::Algorithm::Concurrency { .. })
                    && units > policy.limit()
            };
            // A route's cost is refused only when every plan refuses it (named by the first
            // plan's policy); the default cost when any plan does.
            let mut refusals = plan_sets
                .iter()
                .map(|(plan, set)| set.iter().find(refuses).map(|policy| (*plan, policy)));
            let refused = if every {
                refusals.find_map(|refusal| refusal)
            } else {
                refusals
                    .collect::<Option<Vec<_>>>()
                    .and_then(|all| all.first().copied())
            };
            let Some((plan, policy)) = refused else {
                return Ok(());
            };
            let of_plan = plan.map_or_else(String::new, |plan| format!(" of plan {plan:?}"));
            let no_plan = match (plan_sets.len() > 1, every) {
                (false, _) => "",
                (true, true) => " (it prices every route not listed)",
                (true, false) => " (no plan admits it)",
            };
            Err(ConfigError::new(
                entry,
                format!(
                    "costs {units}, but policy {:?}{of_plan} admits at most {} units a \
                     request{no_plan}: every such request would be refused",
                    policy.name(),
                    policy.limit()
                ),
            ))
        };
        fits("costs.default", self.costs.default, true)?;
        // A request that costs nothing spends nothing (and takes no in-flight slot): with
        // no route costing more, nothing is limited.
        if self.costs.default == 0 && self.costs.routes.values().all(|units| *units == 0) {
            return Err(ConfigError::new(
                "costs.default",
                "a cost of 0 is never limited, and no route costs more: the policies limit \
                 nothing",
            ));
        }
        let mut cost = PerRoute::new(self.costs.default);
        // Each route as it is matched (spaces around its parts are not), and its entry.
        let mut seen: HashMap<String, &str> = HashMap::new();
        for (route, units) in &self.costs.routes {
            let entry = format!("costs.routes.{route:?}");
            let parts = route.trim().split_once(' ');
            // The path is matched as the request's path: a query, a fragment or a space in
            // it would never match.
            let path = parts.map_or(route.trim(), |(_, path)| path.trim());
            if path.starts_with('/') && path.contains(['?', '#', ' ', '\t']) {
                return Err(ConfigError::new(
                    entry,
                    "a route is matched against the path alone: no query (?), fragment (#) \
                     or space in it",
                ));
            }

            // axum 0.7's captures (`:id`, `*path`): a file carried over from it would list
            // a literal path axum 0.8's router never writes (`{id}`), and cost the default
            // (a literal segment so written is for the API, after
            // `PerRoute::without_v07_checks`).
            if crate::cost::holds_v07_capture(path) {
                return Err(ConfigError::new(
                    entry,
                    "a capture is written as axum 0.8 writes it (/users/{id}, /files/{*path}), \
                     not :id or *path, which axum 0.8's router refuses (it reads them as \
                     literal text only under Router::without_v07_checks)",
                ));
            }
            cost = match parts {
                Some((method, path)) if path.trim().starts_with('/') => {
                    // Methods are case-sensitive, and the registered ones upper case: a
                    // `post` would never match a POST. Any token is a method to HTTP, so a
                    // misspelt one (`PSOT`) would be a route no request ever takes.
                    let method = Method::from_bytes(method.as_bytes())
                        .ok()
                        .filter(|_| registered_method(method))
                        .ok_or_else(|| {
                            let reason = if registered_method(&method.to_ascii_uppercase()) {
                                format!(
                                    "{method:?} is not a method: methods are case-sensitive \
                                     (write it upper case: {})",
                                    method.to_ascii_uppercase()
                                )
                            } else {
                                format!(
                                    "{method:?} is not a registered method (those of RFC 9110, \
                                     of the IANA HTTP Method Registry, or PURGE); a route of \
                                     another method is set through PerRoute::route_method"
                                )
                            };
                            ConfigError::new(&entry, reason)
                        })?;
                    cost.route_method(method, path.trim(), *units)
                }
                None if route.trim().starts_with('/') => cost.route(route.trim(), *units),
                _ => {
                    return Err(ConfigError::new(
                        entry,
                        "a route is \"/path\" or \"METHOD /path\"",
                    ));
                }
            };
            let matched = match parts {
                Some((method, path)) => format!("{method} {}", path.trim()),
                None => route.trim().to_owned(),
            };
            if let Some(earlier) = seen.insert(matched, route) {
                return Err(ConfigError::new(
                    entry,
                    format!("the same route as costs.routes.{earlier:?}"),
                ));
            }
            fits(&entry, *units, false)?;
        }
        let mut client_ip = ClientIp::behind_proxies(&self.trusted_proxies)
            .map_err(|e| ConfigError::new("trusted_proxies", e.to_string()))?;
        if let Some(header) = &self.forwarded_header {
            if self.trusted_proxies.is_empty() {
                return Err(ConfigError::new(
                    "forwarded_header",
                    "no trusted_proxies: a forwarding header is read only from them",
                ));
            }
            client_ip = client_ip.forwarded_header(match header.to_ascii_lowercase().as_str() {
                "x-forwarded-for" => ForwardedHeader::XForwardedFor,
                "forwarded" => ForwardedHeader::Forwarded,
                _ => {
                    return Err(ConfigError::new(
                        "forwarded_header",
                        format!("{header:?}: \"x-forwarded-for\" or \"forwarded\""),
                    ));
                }
            });
        }
        let specs: Vec<&str> = if self.key.is_empty() {
            vec!["ip"]
        } else {
            self.key.iter().map(String::as_str).collect()
        };
        // Each key of the chain is a step of every request (and of the stack).
        if specs.len() > MAX_KEYS {
            return Err(ConfigError::new(
                "key",
                format!(
                    "{} keys: at most {MAX_KEYS} (each one not found is a step of every request)",
                    specs.len()
                ),
            ));
        }
        // Settings that no key reads would look in force and not be.
        if !self.trusted_proxies.is_empty() && !specs.contains(&"ip") {
            return Err(ConfigError::new(
                "trusted_proxies",
                "no key reads the client's address (add \"ip\" to key): the proxies would \
                 be trusted for nothing",
            ));
        }
        if self.key_salt_env.is_some() && !specs.iter().any(|spec| spec.starts_with("header:")) {
            return Err(ConfigError::new(
                "key_salt_env",
                "no header key to salt (key lists no \"header:NAME\")",
            ));
        }
        let salt = match &self.key_salt_env {
            Some(variable) => Some(salt_from(variable, std::env::var_os(variable))?),
            None => None,
        };
        let mut chain: Option<Arc<dyn KeyExtractor>> = None;
        for (index, spec) in specs.iter().enumerate() {
            let entry = format!("key[{index}]");
            // "global" always finds a key, and so does "ip": a request without an
            // address is the server's error, not an absent key.
            if let Some(before) = specs[..index]
                .iter()
                .find(|earlier| matches!(**earlier, "global" | "ip"))
            {
                return Err(ConfigError::new(
                    entry,
                    format!("never reached: {before:?} before it always finds a key"),
                ));
            }
            // A header an earlier key found missing is missing for this one too.
            let header_of = |spec: &str| spec.strip_prefix("header:").map(str::to_ascii_lowercase);
            if let Some(name) = header_of(spec)
                && let Some(before) = specs[..index]
                    .iter()
                    .find(|earlier| header_of(earlier).as_ref() == Some(&name))
            {
                return Err(ConfigError::new(
                    entry,
                    format!("never reached: {before:?} before it reads the same header"),
                ));
            }
            let extractor: Arc<dyn KeyExtractor> = match *spec {
                "ip" => Arc::new(client_ip.clone()),
                "global" => Arc::new(Global),
                other => match other.strip_prefix("header:") {
                    Some(name) => {
                        let key = HeaderKey::try_new(name).map_err(|_| {
                            ConfigError::new(&entry, format!("{name:?} is not a header name"))
                        })?;
                        if key.header_name() == http::header::COOKIE {
                            return Err(ConfigError::new(
                                &entry,
                                "the whole Cookie field is no identity: a client that adds a \
                                 cookie has a new key, and HTTP/2 clients split the field into \
                                 several lines, each such request refused; key by one cookie \
                                 in code (tollgate::key::from_fn)",
                            ));
                        }
                        Arc::new(match &salt {
                            Some(salt) => key.salt(salt.clone()),
                            None => key,
                        })
                    }
                    None => {
                        return Err(ConfigError::new(
                            entry,
                            format!("unknown key {other:?} (\"ip\", \"header:NAME\", \"global\")"),
                        ));
                    }
                },
            };
            chain = Some(match chain {
                None => extractor,
                Some(first) => Arc::new(first.or(extractor)),
            });
        }
        let failure_mode = match self.failure_mode.as_deref() {
            None | Some("fallback") => None,
            Some("fail-open") => Some("fail-open"),
            Some("fail-closed") => Some("fail-closed"),
            Some(other) => {
                return Err(ConfigError::new(
                    "failure_mode",
                    format!("{other:?} is not a failure mode (fallback, fail-open, fail-closed)"),
                ));
            }
        };
        let fallback_share = match (self.fallback_share, failure_mode) {
            (None, _) => None,
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "fallback_share",
                    "only the fallback has a share (failure_mode is not \"fallback\")",
                ));
            }
            (Some(share), None) if share.is_nan() || share <= 0.0 => {
                return Err(ConfigError::new(
                    "fallback_share",
                    format!("{share} is no share: it must be above 0 (one over the replicas)"),
                ));
            }
            (Some(share), None) if share < crate::failure::MIN_SHARE => {
                return Err(ConfigError::new(
                    "fallback_share",
                    format!(
                        "{share} is less than one millionth (one over a million replicas): \
                         every rate would be stretched to days or years"
                    ),
                ));
            }
            (Some(share), None) if share > 1.0 => {
                return Err(ConfigError::new(
                    "fallback_share",
                    format!("{share} is more than the whole limit: it must be at most 1"),
                ));
            }
            (Some(share), None) => Some(share),
        };
        let store_timeout = match &self.store_timeout {
            None => None,
            Some(text) => match duration(text) {
                Ok(timeout) if timeout.is_zero() => {
                    return Err(ConfigError::new(
                        "store_timeout",
                        format!("{text:?} is no time: the store must be given some"),
                    ));
                }
                Ok(timeout) => Some(timeout),
                Err(reason) => return Err(ConfigError::new("store_timeout", reason)),
            },
        };
        let breaker = self.circuit_breaker.clone().unwrap_or_default();
        let default = CircuitBreaker::default();
        let failures = match breaker.failures {
            None => default.failures(),
            Some(0) => {
                return Err(ConfigError::new(
                    "circuit_breaker.failures",
                    "0: a breaker opens after at least 1 failure",
                ));
            }
            Some(failures) => failures,
        };
        let cool_down = match &breaker.cool_down {
            None => default.cool_down(),
            Some(text) => match duration(text) {
                Ok(cool_down) if cool_down > crate::policy::MAX_PERIOD => {
                    return Err(ConfigError::new(
                        "circuit_breaker.cool_down",
                        format!("{text:?} is longer than the longest period (10 years)"),
                    ));
                }
                Ok(cool_down) => cool_down,
                Err(reason) => return Err(ConfigError::new("circuit_breaker.cool_down", reason)),
            },
        };
        // Settings that look in force must be: shadow headers show shadow policies (or a
        // shadow layer's numbers), and there are none.
        if self.shadow_headers && !self.shadow && !self.policies.iter().any(|p| p.shadow) {
            return Err(ConfigError::new(
                "shadow_headers",
                "nothing is in shadow (no policy has shadow = true, and shadow is false): \
                 there are no shadow numbers to show",
            ));
        }
        if self.shadow_headers && self.headers.as_deref() == Some("none") {
            return Err(ConfigError::new(
                "shadow_headers",
                "headers = \"none\": no rate-limit header is sent to show shadow numbers in",
            ));
        }
        let headers = match self.headers.as_deref() {
            None | Some("draft-11") => HeaderStyle::Draft11,
            Some("draft-6") => HeaderStyle::Draft6,
            Some("legacy") => HeaderStyle::Legacy,
            Some("none") => HeaderStyle::None,
            Some(other) => {
                return Err(ConfigError::new(
                    "headers",
                    format!("{other:?} is not a header style (draft-11, draft-6, legacy, none)"),
                ));
            }
        };
        Ok(Compiled {
            fallback_share,
            key: chain.unwrap_or_else(|| Arc::new(client_ip)),
            cost: Arc::new(cost),
            resolver,
            sets,
            failure_mode,
            store_timeout,
            breaker: CircuitBreaker::new(failures, cool_down),
            shadow: self.shadow,
            shadow_headers: self.shadow_headers,
            headers,
        })
    }
}

/// A configuration's policy sets: the default one (the only one without plans) and each
/// plan's. The plans resolve requests by them; `LiveLayer::policies` gives them out.
#[derive(Clone)]
struct Sets {
    default: PolicySet,
    plans: HashMap<String, PolicySet>,
}

/// Plans: the set a request's plan header names, else the default one.
struct Plans {
    sets: Sets,
    header: Option<HeaderName>,
    /// The longest plan name, in bytes: a value longer names no plan by a slip of the
    /// pen, and is not logged (it may be a credential).
    longest: usize,
}

impl PolicyResolver for Plans {
    fn resolve<'a>(
        &'a self,
        parts: &http::request::Parts,
        _key: &Key,
    ) -> std::borrow::Cow<'a, PolicySet> {
        // Exactly one line names the plan: a request carrying two (a client's line
        // before the auth layer's) names no one plan, and gets the default.
        let named = self.header.as_ref().and_then(|header| {
            let mut lines = parts.headers.get_all(header).iter();
            match (lines.next(), lines.next()) {
                (Some(value), None) => {
                    let plan = value
                        .to_str()
                        .ok()
                        .and_then(|plan| self.sets.plans.get(plan.trim()));
                    // An empty value names no plan; any other that names none is said.
                    if plan.is_none() && !value.as_bytes().trim_ascii().is_empty() {
                        crate::telemetry::plan_unknown(Some(value.as_bytes()), self.longest);
                    }
                    plan
                }
                (Some(_), Some(_)) => {
                    crate::telemetry::plan_unknown(None, self.longest);
                    None
                }
                (None, _) => None,
            }
        });
        std::borrow::Cow::Borrowed(named.unwrap_or(&self.sets.default))
    }

    fn known_sets(&self) -> Vec<PolicySet> {
        self.sets.plans.values().cloned().collect()
    }
}

type LiveConfig =
    Config<Arc<dyn Store>, Arc<dyn KeyExtractor>, Arc<dyn Cost>, Arc<dyn PolicyResolver>>;

/// A rate-limit layer served from a [`LimiterConfig`] and reloaded while running. See the
/// [module docs](self). Clones share the configuration: keep one to call
/// [`reload`](Self::reload) from a signal handler or a file watcher.
///
/// Below, the service is built from one clone and the reload made through another: the
/// service's next request is decided under the new limit.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::clock::ManualClock;
/// use tollgate::config::{LimiterConfig, LiveLayer};
/// use tollgate::MemoryStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let daily = |limit: u64| -> LimiterConfig {
///     let toml = format!(r#"
///         key = ["header:x-api-key"]
///         [[policies]]
///         name = "daily"
///         algorithm = "fixed-window"
///         limit = {limit}
///         window = "1d"
///     "#);
///     toml::from_str(&toml).unwrap()
/// };
/// let layer = LiveLayer::new(MemoryStore::builder().clock(ManualClock::new()).build(), &daily(100))?;
/// let watcher = layer.clone(); // say, moved to a file watcher's task
/// let service = layer.layer(service_fn(|_: Request<()>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
/// }));
/// let policy = || {
///     let request = Request::get("/").header("x-api-key", "k1").body(()).unwrap();
///     let call = service.clone().oneshot(request);
///     async move { call.await.unwrap().headers()["ratelimit-policy"].to_str().unwrap().to_owned() }
/// };
/// assert_eq!(policy().await, "\"daily\";q=100;w=86400");
/// watcher.reload(&daily(500))?;
/// assert_eq!(policy().await, "\"daily\";q=500;w=86400");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LiveLayer {
    shared: Arc<LiveShared>,
}

struct LiveShared {
    store: Arc<dyn Store>,
    current: ArcSwap<LiveConfig>,
    /// The current configuration's sets, swapped right after it.
    sets: ArcSwap<Sets>,
    /// One breaker for every configuration: a reload sets its settings in place.
    breaker: Arc<Breaker>,
    /// The places of requests dropped during their shaping delay, kept across reloads.
    dropped: Arc<crate::settle::DroppedBookings>,
    fallback: LocalFallback,
    /// Reloads one at a time.
    reloading: std::sync::Mutex<()>,
}

impl fmt::Debug for LiveLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveLayer").finish_non_exhaustive()
    }
}

impl LiveLayer {
    /// A layer over `store` serving `config`, checked first: an invalid configuration is
    /// refused with the [`ConfigError`] that names its entry.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::config::{LimiterConfig, LiveLayer};
    /// use tollgate::MemoryStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let config: LimiterConfig = toml::from_str(r#"
    ///     key = ["header:x-api-key"]
    ///     [[policies]]
    ///     name = "api"
    ///     algorithm = "fixed-window"
    ///     limit = 2
    ///     window = "1h"
    /// "#)?;
    /// let store = MemoryStore::builder().clock(ManualClock::new()).build();
    /// let service = LiveLayer::new(store, &config)?.layer(service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// }));
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    /// assert_eq!(service.clone().oneshot(request()).await?.status(), 200);
    /// assert_eq!(service.clone().oneshot(request()).await?.status(), 200);
    /// assert_eq!(service.clone().oneshot(request()).await?.status(), 429);
    ///
    /// let typo: LimiterConfig = toml::from_str(r#"
    ///     [[policies]]
    ///     name = "api"
    ///     algorithm = "fixed-window"
    ///     limit = 2
    ///     window = "1 hour"
    /// "#)?;
    /// let error = LiveLayer::new(MemoryStore::new(), &typo).unwrap_err();
    /// assert_eq!(error.entry(), "policies[0] \"api\"");
    /// assert!(error.reason().contains("window"), "{error}");
    /// # Ok(()) }
    /// ```
    pub fn new(store: impl Store, config: &LimiterConfig) -> Result<Self, ConfigError> {
        let store: Arc<dyn Store> = Arc::new(store);
        let dropped = Arc::default();
        let fallback = LocalFallback::new();
        let breaker = Arc::new(Breaker::new(CircuitBreaker::default()));
        let (current, sets, settings) = build(&store, (&breaker, &dropped), &fallback, config)?;
        breaker.set(&settings);
        Ok(Self {
            shared: Arc::new(LiveShared {
                store,
                current: ArcSwap::from(current),
                sets: ArcSwap::from_pointee(sets),
                breaker,
                dropped,
                fallback,
                reloading: std::sync::Mutex::new(()),
            }),
        })
    }

    /// Swaps to `config`, atomically: requests that arrive after this returns are served
    /// under it; requests in flight finish under the configuration they started with. An
    /// invalid `config` is refused and the running one stays; the refusal is returned,
    /// and logged at error level (a watcher that drops it leaves a trace).
    ///
    /// Below, a key has spent its one request a minute; a reload to three a minute (new
    /// parameters, so fresh state) admits it again, and a reload that is refused leaves
    /// the three in force.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::config::{LimiterConfig, LiveLayer};
    /// use tollgate::MemoryStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let per_minute = |limit: i64| -> LimiterConfig {
    ///     let toml = format!(r#"
    ///         key = ["header:x-api-key"]
    ///         [[policies]]
    ///         name = "api"
    ///         algorithm = "fixed-window"
    ///         limit = {limit}
    ///         window = "1m"
    ///     "#);
    ///     toml::from_str(&toml).unwrap()
    /// };
    /// let layer = LiveLayer::new(MemoryStore::builder().clock(ManualClock::new()).build(), &per_minute(1))?;
    /// let service = layer.clone().layer(service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// }));
    /// let status = || {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///     let call = service.clone().oneshot(request);
    ///     async move { call.await.unwrap().status().as_u16() }
    /// };
    /// assert_eq!(status().await, 200);
    /// assert_eq!(status().await, 429);
    ///
    /// layer.reload(&per_minute(3))?;
    /// assert_eq!(status().await, 200); // refused before, admitted now
    /// assert_eq!(status().await, 200);
    ///
    /// assert!(layer.reload(&per_minute(0)).is_err()); // a limit of 0: refused
    /// assert_eq!(status().await, 200); // the third of three still stands
    /// assert_eq!(status().await, 429);
    /// # Ok(()) }
    /// ```
    pub fn reload(&self, config: &LimiterConfig) -> Result<(), ConfigError> {
        let _one_at_a_time = self
            .shared
            .reloading
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (next, sets, settings) = build(
            &self.shared.store,
            (&self.shared.breaker, &self.shared.dropped),
            &self.shared.fallback,
            config,
        )
        .inspect_err(|error| {
            #[cfg(feature = "tracing")]
            tracing::error!(
                target: "tollgate",
                %error,
                "rate-limit configuration reload refused: the running configuration stays"
            );
            #[cfg(not(feature = "tracing"))]
            let _ = error;
        })?;
        self.shared.breaker.set(&settings);
        self.shared.current.store(next);
        self.shared.sets.store(Arc::new(sets));
        #[cfg(feature = "tracing")]
        tracing::info!(target: "tollgate", policies = config.policies.len(), "rate-limit configuration reloaded");
        Ok(())
    }

    /// The policy set the running configuration decides a plan's requests under (`None`:
    /// the default plan, or the one set of a configuration without plans), or `None` for
    /// a plan it does not have. With the client's key (for a header key,
    /// [`HeaderKey::key_for`](crate::key::HeaderKey::key_for), salted as the
    /// configuration salts) it is what `peek`, `reset` and `adjust` on the store need: a
    /// set built by hand that differs (a penalty left out) acts on other state. A call
    /// that races a [`reload`](Self::reload) may get either configuration's set; once
    /// `reload` has returned, the new one's.
    ///
    /// ```
    /// use tollgate::config::{LimiterConfig, LiveLayer};
    /// use tollgate::MemoryStore;
    ///
    /// let config: LimiterConfig = toml::from_str(r#"
    ///     [[policies]]
    ///     name = "api"
    ///     algorithm = "gcra"
    ///     rate = "10/s"
    ///     burst = 20
    /// "#)?;
    /// let live = LiveLayer::new(MemoryStore::new(), &config)?;
    /// assert_eq!(live.policies(None).unwrap()[0].name(), "api");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn policies(&self, plan: Option<&str>) -> Option<PolicySet> {
        let sets = self.shared.sets.load();
        match plan {
            None => Some(sets.default.clone()),
            Some(plan) => sets.plans.get(plan).cloned(),
        }
    }
}

/// The layer of `config`, sharing with the configurations before it the breaker and the
/// places of requests dropped during their shaping delay; with the breaker's settings
/// `config` asks for, for the caller to set once the layer is in force.
fn build(
    store: &Arc<dyn Store>,
    (breaker, dropped): (&Arc<Breaker>, &Arc<crate::settle::DroppedBookings>),
    fallback: &LocalFallback,
    config: &LimiterConfig,
) -> Result<(Arc<LiveConfig>, Sets, CircuitBreaker), ConfigError> {
    let compiled = config.compile()?;
    // A policy the store cannot decide (the Redis store refuses some very large quotas)
    // is named by its entry, as the file's other errors are.
    for (index, spec) in config.policies.iter().enumerate() {
        let policy = std::iter::once(&compiled.sets.default)
            .chain(compiled.sets.plans.values())
            .flat_map(|set| set.iter())
            .find(|policy| policy.name() == spec.name);
        if let Some(policy) = policy {
            let entry = || format!("policies[{index}] {:?}", spec.name);
            store
                .validate(&PolicySet::from(policy.clone()))
                .map_err(|error| {
                    ConfigError::new(entry(), format!("the store cannot decide it: {error}"))
                })?;
            if policy.params().is_in_flight() && !store.can_adjust() {
                return Err(ConfigError::new(
                    entry(),
                    "an in-flight limit frees its slots through the store's adjust, and this \
                     store cannot adjust (Store::can_adjust is false): a store that wraps \
                     another must forward adjust and can_adjust",
                ));
            }
        }
    }
    let failure_mode = match compiled.failure_mode {
        Some("fail-open") => FailureMode::FailOpen,
        Some("fail-closed") => FailureMode::FailClosed,
        // The share scales the limits, in the one fallback store every configuration
        // shares (its state carries over reloads).
        _ => FailureMode::Fallback(match compiled.fallback_share {
            Some(share) => fallback.clone().share(share),
            None => fallback.clone(),
        }),
    };
    let layer = RateLimitLayer::new(Arc::clone(store));
    let layer = match compiled.store_timeout {
        Some(timeout) => layer.store_timeout(timeout),
        None => layer,
    };
    layer
        .resolver(compiled.resolver)
        .key(compiled.key)
        .cost(compiled.cost)
        .on_store_error(failure_mode)
        .shadow(compiled.shadow)
        .shadow_headers(compiled.shadow_headers)
        .headers(compiled.headers)
        .with_breaker(Arc::clone(breaker))
        .with_dropped(Arc::clone(dropped))
        .service_config()
        .map(|config| (config, compiled.sets, compiled.breaker))
        .map_err(|reason| {
            // The builder's name means nothing to a reader of the file.
            let reason = reason.strip_prefix("RateLimitLayer: ").unwrap_or(&reason);
            ConfigError::new("policies", reason)
        })
}

impl<S> Layer<S> for LiveLayer {
    type Service = LiveRateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LiveRateLimit {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service of a [`LiveLayer`].
pub struct LiveRateLimit<S> {
    inner: S,
    shared: Arc<LiveShared>,
}

impl<S: Clone> Clone for LiveRateLimit<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for LiveRateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveRateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for LiveRateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: ResponseBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The configuration is read once, here: the whole request runs under it.
        let config = self.shared.current.load_full();
        let ready = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, ready);
        RateLimit::new(ready, config).call(request)
    }
}

/// The shortest key salt a configuration accepts, in bytes: a salt is put before each
/// secret it hashes, and a short one (`x`, a space) adds nothing against a list of
/// candidate secrets.
const MIN_KEY_SALT: usize = 16;

/// The most keys a `key` chain lists: each one not found is a step of every request.
const MAX_KEYS: usize = 16;

/// The key salt `value` of the environment variable `variable`: refused when it is not
/// set, or shorter than [`MIN_KEY_SALT`] bytes (never said: a salt is a secret).
fn salt_from(variable: &str, value: Option<std::ffi::OsString>) -> Result<Vec<u8>, ConfigError> {
    match value {
        Some(salt) if salt.len() >= MIN_KEY_SALT => Ok(salt.into_encoded_bytes()),
        Some(salt) if !salt.is_empty() => Err(ConfigError::new(
            "key_salt_env",
            format!(
                "the environment variable {variable:?} holds {} bytes: a salt needs \
                 {MIN_KEY_SALT} at least (a random secret, such as 32 bytes in hex)",
                salt.len()
            ),
        )),
        _ => Err(ConfigError::new(
            "key_salt_env",
            format!("the environment variable {variable:?} is not set, or empty"),
        )),
    }
}

/// A method a configured route may name: RFC 9110's (section 9), those of the IANA HTTP
/// Method Registry (RFC 7237's initial ones, and QUERY), and PURGE, which caches take
/// though no registry lists it. Case-sensitive.
fn registered_method(method: &str) -> bool {
    matches!(
        method,
        "GET"
            | "HEAD"
            | "POST"
            | "PUT"
            | "DELETE"
            | "CONNECT"
            | "OPTIONS"
            | "TRACE"
            | "PATCH"
            | "QUERY"
            | "PURGE"
            | "ACL"
            | "BASELINE-CONTROL"
            | "BIND"
            | "CHECKIN"
            | "CHECKOUT"
            | "COPY"
            | "LABEL"
            | "LINK"
            | "LOCK"
            | "MERGE"
            | "MKACTIVITY"
            | "MKCALENDAR"
            | "MKCOL"
            | "MKREDIRECTREF"
            | "MKWORKSPACE"
            | "MOVE"
            | "ORDERPATCH"
            | "PRI"
            | "PROPFIND"
            | "PROPPATCH"
            | "REBIND"
            | "REPORT"
            | "SEARCH"
            | "UNBIND"
            | "UNCHECKOUT"
            | "UNLINK"
            | "UNLOCK"
            | "UPDATE"
            | "UPDATEREDIRECTREF"
            | "VERSION-CONTROL"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_or_missing_key_salt_is_refused_without_being_said() {
        for short in [" ", "s3cr3t!", "f1fteen-bytes-1"] {
            let error = salt_from("SALT", Some(short.into())).unwrap_err();
            assert_eq!(error.entry(), "key_salt_env");
            assert!(error.reason().contains("16 at least"), "{error}");
            if short != " " {
                assert!(!error.reason().contains(short), "{error}");
            }
        }
        for missing in [None, Some("".into())] {
            let error = salt_from("SALT", missing).unwrap_err();
            assert!(error.reason().contains("is not set"), "{error}");
        }
        let salt = "0123456789abcdef";
        assert_eq!(
            salt_from("SALT", Some(salt.into())).unwrap(),
            salt.as_bytes()
        );
    }
}
