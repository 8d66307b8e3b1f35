//! The client side (feature `client`): a Tower layer for **outgoing** requests that reads
//! what a rate-limited server says and waits instead of sending a request the server
//! would refuse.
//!
//! [`PacingLayer`] wraps any client service of `http` requests (hyper-util's `Client`,
//! or anything built on Tower) whose request body is `Clone`, as a retry sends it again
//! (`Full<Bytes>`, `Empty<Bytes>`, `String`, `Vec<u8>`: not a stream such as tonic's
//! `Body` or hyper's `Incoming`; such a request can be paced with a `limiter::Limiter`
//! and [`server_wait`] around the call). Per upstream host (and per partition, when you
//! say how to tell your partitions apart), it reads:
//!
//! - the draft-11 `RateLimit` field (an RFC 9651 list: a member with `r=0` means wait `t`
//!   seconds; with no `t` it names no window and asks for no wait);
//! - draft-6 `RateLimit-Remaining` / `RateLimit-Reset` and `X-RateLimit-Remaining` /
//!   `X-RateLimit-Reset` (seconds, or a Unix time in seconds or milliseconds, with or
//!   without a fraction);
//! - `Retry-After` (seconds or an HTTP date) on an error (`429`, `503`, GitHub's `403`
//!   for its secondary limits) or a gRPC answer, where it takes precedence over the
//!   fields above (draft-11, section 7); on a `202` it says when to poll, on a redirect
//!   when to follow it: neither holds the host alone, but where the fields above say
//!   none is left beside it, it says how long.
//!
//! A `RateLimit` field with a malformed member (`r` missing, or `r` or `t` not a
//! non-negative Integer) is ignored whole (draft-11, sections 4.1 and 7), and so are the
//! rate-limit fields of a response from a cache (a positive `Age`, section 7.3). The
//! layer counts nothing against `r` above 0: concurrent requests may overshoot what is
//! left until a response says `r=0` (or pace them with [`pace`](PacingLayer::pace)).
//!
//! A request to a host that said "nothing left" waits until it said so; a 429 is waited
//! out and retried when the method is idempotent (RFC 9110, section 9.2.2: 2 retries by
//! default; never for `POST`, `PATCH`, `CONNECT` or a method RFC 9110 does not define
//! unless [`retry_non_idempotent`](PacingLayer::retry_non_idempotent)); a 429 that asks
//! for longer than [`max_wait`](PacingLayer::max_wait) is returned at once, since a retry
//! sooner would be refused again.
//! Absurd values (negative, malformed, years away) are ignored or capped at
//! [`max_wait`](PacingLayer::max_wait) (60 s by default), as the draft asks of clients
//! (section 8.5). Optionally the layer also paces proactively with any tollgate policy
//! ([`pace`](PacingLayer::pace)), shared across clones. The words of 16,384 hosts (and
//! partitions) are kept at most: past it, those that end soonest are forgotten, so a
//! client sent to ever new hosts that all ask it to wait (a crawler, links a hostile
//! server hands out) can forget a host's word before it ends; keep such traffic on a
//! layer of its own.
//!
//! Below, the layer paces requests to a documented limit of 2 at once and 1 a second
//! before the server has said anything; then the server says its budget is spent for 5
//! seconds (`r=0;t=5`), and the next request waits that out. Tokio's paused clock skips
//! the waits. In an app, the inner service is the HTTP client (hyper-util's `Client`
//! with a `Full<Bytes>` body); here a `service_fn` stands in for the server.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use http::{Request, Response};
//! use tokio::time::Instant;
//! use tollgate::client::PacingLayer;
//! use tollgate::{Policy, Rate};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let start = Instant::now();
//! // When each request reached the server, in whole seconds from the start.
//! let arrivals = Arc::new(Mutex::new(Vec::new()));
//! let log = Arc::clone(&arrivals);
//! let server = service_fn(move |request: Request<String>| {
//!     log.lock().unwrap().push(start.elapsed().as_secs());
//!     // The fifth request hears that nothing is left for 5 seconds.
//!     let spent = request.uri().path() == "/5";
//!     async move {
//!         let mut response = Response::builder();
//!         if spent {
//!             response = response.header("ratelimit", "\"api\";r=0;t=5");
//!         }
//!         Ok::<_, Infallible>(response.body(String::new()).unwrap())
//!     }
//! });
//! let client = ServiceBuilder::new()
//!     .layer(
//!         PacingLayer::new()
//!             .max_wait(Duration::from_secs(30))
//!             .pace(Policy::token_bucket("api", 2, Rate::per_second(1))?),
//!     )
//!     .service(server);
//! for n in 1..=6 {
//!     let request = Request::get(format!("http://api.test/{n}")).body(String::new())?;
//!     client.clone().oneshot(request).await?;
//! }
//! // Two at once, then one a second; the sixth waits the server's 5 seconds.
//! assert_eq!(*arrivals.lock().unwrap(), [0, 0, 1, 2, 3, 8]);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, Request, Response, StatusCode};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::clock::RuntimeClock;
use crate::policy::{Policy, PolicySet};
use crate::store::MemoryStore;

/// The longest the layer waits on a server's word, unless told otherwise.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(60);

type Partition = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;

/// Paces outgoing requests by what the servers say. See the [module docs](self).
///
/// A `GET` refused with `Retry-After: 2` is sent again two seconds later:
///
/// ```
/// use std::convert::Infallible;
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::time::Duration;
/// use http::{Request, Response, StatusCode};
/// use tollgate::client::PacingLayer;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Infallible> {
/// # tokio::time::pause(); // the test's clock skips the waits
/// // A server that refuses the first request and admits the next.
/// let calls = Arc::new(AtomicUsize::new(0));
/// let seen = Arc::clone(&calls);
/// let server = service_fn(move |_: Request<String>| {
///     let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
///     async move {
///         let response = if first {
///             Response::builder().status(429).header("retry-after", "2")
///         } else {
///             Response::builder()
///         };
///         Ok::<_, Infallible>(response.body(String::new()).unwrap())
///     }
/// });
/// let client = ServiceBuilder::new().layer(PacingLayer::new()).service(server);
/// let start = tokio::time::Instant::now();
/// let request = Request::get("http://api.test/items").body(String::new()).unwrap();
/// let response = client.oneshot(request).await?;
/// assert_eq!(response.status(), StatusCode::OK);
/// assert_eq!(calls.load(Ordering::SeqCst), 2);
/// assert!(start.elapsed() >= Duration::from_secs(2));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PacingLayer {
    shared: Arc<Shared>,
}

struct Shared {
    /// When each host (and partition) may be sent to again; shared by every layer built
    /// from one, as the pacing budget is.
    hosts: Arc<Mutex<Hosts>>,
    max_wait: Duration,
    retries: u32,
    retry_all: bool,
    partition: Option<Arc<Partition>>,
    pacer: Option<Arc<Pacer>>,
}

/// The proactive pacing policy, its budget, and the turns it has given.
struct Pacer {
    store: MemoryStore<RuntimeClock>,
    policies: PolicySet,
    /// Per key: the turns given so far, how many are still waiting to be sent, and those
    /// dropped unused while a later turn stood. A turn is given back only when no turn
    /// was given after it for its key: units taken out from under a later turn would put
    /// two requests on one slot.
    turns: Mutex<HashMap<String, Turns>>,
}

/// The turns of one key (host and partition).
#[derive(Default)]
struct Turns {
    /// The count of turns given (less those given back).
    given: u64,
    /// Turns given and neither sent nor dropped yet.
    waiting: usize,
    /// The newest turn sent: no turn before it can come back (its slot stands after
    /// theirs).
    sent: u64,
    /// Turns dropped unused while a later turn stood, by number, with their slot's time
    /// and what each spent. The next request takes the first of them still ahead (its
    /// caller gave up, the slot stands free: under overload, callers giving up oldest
    /// first as their timeouts end would otherwise leave every slot booked for nobody
    /// and send nothing); the others are given back once every turn after them has
    /// been. Only slots still ahead and after the newest turn sent: one whose time
    /// passed stays spent.
    unused: std::collections::BTreeMap<u64, (Instant, crate::Decision)>,
}

impl Turns {
    /// Forgets the unused turns whose slot's time has passed (`now`): they stay spent.
    fn forget_past(&mut self, now: Instant) {
        while let Some(first) = self.unused.first_entry() {
            if first.get().0 >= now {
                break;
            }
            first.remove();
        }
    }
}

impl fmt::Debug for PacingLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacingLayer")
            .field("max_wait", &self.shared.max_wait)
            .field("retries", &self.shared.retries)
            .finish_non_exhaustive()
    }
}

impl Default for PacingLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl PacingLayer {
    /// Waits at most [`DEFAULT_MAX_WAIT`] on a server's word; retries an idempotent
    /// request twice after a 429.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::client::{DEFAULT_MAX_WAIT, PacingLayer};
    ///
    /// assert_eq!(DEFAULT_MAX_WAIT, Duration::from_secs(60));
    /// // No host has said anything yet.
    /// assert_eq!(PacingLayer::new().wait_for("api.test", None), Duration::ZERO);
    /// ```
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                hosts: Arc::new(Mutex::new(Hosts::default())),
                max_wait: DEFAULT_MAX_WAIT,
                retries: 2,
                retry_all: false,
                partition: None,
                pacer: None,
            }),
        }
    }

    fn with(self, change: impl FnOnce(&mut Shared)) -> Self {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|shared| Shared {
            hosts: Arc::clone(&shared.hosts),
            max_wait: shared.max_wait,
            retries: shared.retries,
            retry_all: shared.retry_all,
            partition: shared.partition.clone(),
            pacer: shared.pacer.clone(),
        });
        change(&mut shared);
        Self {
            shared: Arc::new(shared),
        }
    }

    /// The longest one wait may last, whatever a server says (a value above it is read
    /// as this; malformed and negative values are ignored).
    ///
    /// Before each attempt a request waits for the server's word at most `max_wait` in
    /// all (the time it waits on the word: a word heard while it waited for the inner
    /// service is still waited out); then, with [`pace`](Self::pace), for the policy: its denials and delay at
    /// most `max_wait` together, counted once the inner service is ready (so the policy
    /// keeps its spacing after a long `Retry-After`). A denial or a delay longer than
    /// what is left sends the request at once, without a turn, and the server decides. A
    /// request the server asks to wait while it is paced (once per attempt) gives its
    /// turn back (if no later turn is held), waits the rest of the word and is paced once
    /// more; so an attempt waits at most three times `max_wait` in all, besides the
    /// inner service's readiness, which is not bounded here (bound it with a timeout of
    /// your own). Each retry after a 429 waits anew.
    ///
    /// Layers built from one base (clones) share what hosts said, each word as the layer
    /// that heard it read it: a layer with a shorter `max_wait` shortens the others'
    /// waits. Build layers that need different `max_wait`s from separate
    /// [`PacingLayer::new`]s.
    ///
    /// Below, a server refuses a request and asks for an hour. A retry within 10 seconds
    /// would be refused again, so the `429` is returned at once; the next request to the
    /// host waits 10 seconds, not an hour:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::time::Duration;
    /// use http::{Request, Response, StatusCode};
    /// use tollgate::client::PacingLayer;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Infallible> {
    /// // A server that refuses the first request for an hour, and admits the next.
    /// let calls = Arc::new(AtomicUsize::new(0));
    /// let seen = Arc::clone(&calls);
    /// let server = service_fn(move |_: Request<String>| {
    ///     let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
    ///     async move {
    ///         let response = if first {
    ///             Response::builder().status(429).header("retry-after", "3600")
    ///         } else {
    ///             Response::builder()
    ///         };
    ///         Ok::<_, Infallible>(response.body(String::new()).unwrap())
    ///     }
    /// });
    /// let layer = PacingLayer::new().max_wait(Duration::from_secs(10));
    /// let client = ServiceBuilder::new().layer(layer.clone()).service(server);
    /// let request = || Request::get("http://api.test/").body(String::new()).unwrap();
    /// let start = tokio::time::Instant::now();
    /// let refused = client.clone().oneshot(request()).await?;
    /// assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(calls.load(Ordering::SeqCst), 1); // not retried
    /// assert_eq!(layer.wait_for("api.test", None), Duration::from_secs(10));
    ///
    /// assert_eq!(client.oneshot(request()).await?.status(), StatusCode::OK);
    /// assert_eq!(start.elapsed().as_secs(), 10); // not an hour
    /// # Ok(()) }
    /// ```
    pub fn max_wait(self, max_wait: Duration) -> Self {
        self.with(|shared| shared.max_wait = max_wait)
    }

    /// How many times an idempotent request is retried after a 429 (default 2).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use http::{Request, Response, StatusCode};
    /// use tollgate::client::PacingLayer;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Infallible> {
    /// # tokio::time::pause(); // the test's clock skips the waits
    /// // A server that refuses every request, asking for a second each time.
    /// let calls = Arc::new(AtomicUsize::new(0));
    /// let seen = Arc::clone(&calls);
    /// let server = service_fn(move |_: Request<String>| {
    ///     seen.fetch_add(1, Ordering::SeqCst);
    ///     let response = Response::builder().status(429).header("retry-after", "1");
    ///     async move { Ok::<_, Infallible>(response.body(String::new()).unwrap()) }
    /// });
    /// let client = ServiceBuilder::new().layer(PacingLayer::new().retries(3)).service(server);
    /// let request = Request::get("http://api.test/").body(String::new()).unwrap();
    /// let response = client.oneshot(request).await?;
    /// assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS); // the last 429
    /// assert_eq!(calls.load(Ordering::SeqCst), 4); // sent once, retried three times
    /// # Ok(()) }
    /// ```
    pub fn retries(self, retries: u32) -> Self {
        self.with(|shared| shared.retries = retries)
    }

    /// Retries requests of a method that is not idempotent after a 429 too: `POST`,
    /// `PATCH`, `CONNECT` and methods RFC 9110 does not define (off by default: the server
    /// may have acted on the first one).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use http::{Request, Response};
    /// use tollgate::client::PacingLayer;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Infallible> {
    /// # tokio::time::pause(); // the test's clock skips the waits
    /// // Sends a POST through `layer` to a server that always refuses: how often it went.
    /// async fn sends(layer: PacingLayer) -> usize {
    ///     let calls = Arc::new(AtomicUsize::new(0));
    ///     let seen = Arc::clone(&calls);
    ///     let server = service_fn(move |_: Request<String>| {
    ///         seen.fetch_add(1, Ordering::SeqCst);
    ///         let response = Response::builder().status(429).header("retry-after", "1");
    ///         async move { Ok::<_, Infallible>(response.body(String::new()).unwrap()) }
    ///     });
    ///     let client = ServiceBuilder::new().layer(layer).service(server);
    ///     let post = Request::post("http://api.test/jobs").body("{}".to_owned()).unwrap();
    ///     client.oneshot(post).await.unwrap();
    ///     calls.load(Ordering::SeqCst)
    /// }
    /// assert_eq!(sends(PacingLayer::new()).await, 1); // a POST is not retried
    /// assert_eq!(sends(PacingLayer::new().retry_non_idempotent(true)).await, 3);
    /// # Ok(()) }
    /// ```
    pub fn retry_non_idempotent(self, retry: bool) -> Self {
        self.with(|shared| shared.retry_all = retry)
    }

    /// Tells apart requests to one host that the server limits separately (each API
    /// key its own budget): `partition` names a request's partition. Layers built from
    /// one (a setting changed on a clone) share what servers said per host and
    /// partition: give each credential its partition, or start each from
    /// [`PacingLayer::new`], for one's 429 not to hold the others.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use http::{Request, Response, StatusCode};
    /// use tollgate::client::PacingLayer;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Infallible> {
    /// # tokio::time::pause(); // the test's clock stands still
    /// // Each API key is a budget of its own.
    /// let layer = PacingLayer::new().partition(|parts| {
    ///     Some(parts.headers.get("x-api-key")?.to_str().ok()?.to_owned())
    /// });
    /// // A server that refuses, asking for half a minute.
    /// let server = service_fn(|_: Request<String>| async {
    ///     let response = Response::builder().status(429).header("retry-after", "30");
    ///     Ok::<_, Infallible>(response.body(String::new()).unwrap())
    /// });
    /// let client = ServiceBuilder::new().layer(layer.clone()).service(server);
    /// let post = Request::post("http://api.test/").header("x-api-key", "alpha");
    /// let response = client.oneshot(post.body(String::new()).unwrap()).await?;
    /// assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    /// // Key "alpha" waits half a minute; key "beta" is not held.
    /// assert_eq!(layer.wait_for("api.test", Some("alpha")), Duration::from_secs(30));
    /// assert_eq!(layer.wait_for("api.test", Some("beta")), Duration::ZERO);
    /// # Ok(()) }
    /// ```
    pub fn partition<F>(self, partition: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|shared| shared.partition = Some(Arc::new(partition)))
    }

    /// Paces proactively with `policy` per host (and partition), before any answer says
    /// anything: a request waits until the policy admits it, up to `max_wait` of the
    /// policy's own waits (a request it would hold back longer goes at once, and the
    /// server decides; see [`max_wait`](Self::max_wait)). Clones share the budget.
    ///
    /// Called again, it adds `policy` (a policy of the same name is replaced): a request
    /// waits until every pacing policy admits it, a burst limit and an hourly quota
    /// alike. The budget starts afresh, so set every policy before cloning the layer.
    ///
    /// Below, a burst of 2 refilled one a second and a quota of 4 a minute: four
    /// requests to one host go at 0, 0, 1 and 2 seconds, and a fifth waits for the
    /// minute's quota (15 seconds a unit); another host has a budget of its own. Tokio's
    /// paused clock skips the waits.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::sync::{Arc, Mutex};
    /// use http::{Request, Response};
    /// use tokio::time::Instant;
    /// use tollgate::client::PacingLayer;
    /// use tollgate::{Policy, Rate};
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = PacingLayer::new()
    ///     .pace(Policy::token_bucket("burst", 2, Rate::per_second(1))?)
    ///     .pace(Policy::token_bucket("minute", 4, Rate::per_minute(4))?);
    /// let start = Instant::now();
    /// // Each request's host and when it reached the server, in whole seconds.
    /// let arrivals = Arc::new(Mutex::new(Vec::new()));
    /// let log = Arc::clone(&arrivals);
    /// let server = service_fn(move |request: Request<String>| {
    ///     let host = request.uri().host().unwrap_or_default().to_owned();
    ///     log.lock().unwrap().push((host, start.elapsed().as_secs()));
    ///     async { Ok::<_, Infallible>(Response::new(String::new())) }
    /// });
    /// let client = ServiceBuilder::new().layer(layer).service(server);
    /// for host in ["a.test", "a.test", "a.test", "a.test", "b.test", "a.test"] {
    ///     let request = Request::get(format!("http://{host}/")).body(String::new())?;
    ///     client.clone().oneshot(request).await?;
    /// }
    /// let arrivals = arrivals.lock().unwrap();
    /// let at: Vec<u64> = arrivals.iter().map(|(_, secs)| *secs).collect();
    /// assert_eq!(at, [0, 0, 1, 2, 2, 15]);
    /// assert_eq!(arrivals[4].0, "b.test"); // went at once
    /// # Ok(()) }
    /// ```
    ///
    /// # Panics
    ///
    /// With an in-flight policy ([`Policy::concurrency`]): the layer cannot know when a
    /// response's body ends, so its slots would never come back. With a shadow policy,
    /// which never refuses, or one with a penalty, whose block (started by the pacer's
    /// own refusals under load) is longer than any wait: every request would go at once,
    /// unpaced. A start-up mistake.
    pub fn pace(self, policy: Policy) -> Self {
        assert!(
            !matches!(policy.algorithm(), crate::Algorithm::Concurrency { .. }),
            "PacingLayer::pace: in-flight policy \"{}\" cannot pace requests (its slots \
             would never be freed); use a rate policy",
            policy.name()
        );
        assert!(
            !policy.is_shadow() && policy.penalty().is_none(),
            "PacingLayer::pace: policy \"{}\" is a shadow policy or has a penalty, which \
             would send requests unpaced (a shadow policy never refuses; a penalty's block \
             outlasts any wait); use a plain rate policy",
            policy.name()
        );
        // As many identities as the hosts' words: hosts an attacker names (a crawler's,
        // a webhook sender's) cannot grow the pacer's state past the bound either.
        // One shard: the bound holds for the hosts together, not per shard, so no
        // shard that hashing filled first forgets a host that is still paced (the
        // turns' lock is taken with every decision anyway).
        let store = MemoryStore::builder()
            .clock(RuntimeClock::new())
            .max_keys(Hosts::MAX_HOSTS)
            .shards(1)
            .build();
        let policies = match &self.shared.pacer {
            Some(pacer) => pacer.policies.with(policy),
            None => PolicySet::from(policy),
        };
        if let Err(error) = policies.check() {
            panic!("PacingLayer::pace: {error}");
        }
        let pacer = Pacer {
            store,
            policies,
            turns: Mutex::new(HashMap::new()),
        };
        self.with(|shared| shared.pacer = Some(Arc::new(pacer)))
    }

    /// How long a request to `host` (`name` or `name:port`, any case; without a port,
    /// the longer of ports 80 and 443) and `partition` would wait now for what the
    /// server said, capped at `max_wait`. The [`pace`](Self::pace) policy's wait is not
    /// counted (reading it would take a turn).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use http::{Request, Response};
    /// use tollgate::client::PacingLayer;
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Infallible> {
    /// # tokio::time::pause(); // the test's clock stands still
    /// let layer = PacingLayer::new().max_wait(Duration::from_secs(60));
    /// // An answer that says the day's quota is spent for another hour.
    /// let server = service_fn(|_: Request<String>| async {
    ///     let response = Response::builder().header("ratelimit", "\"day\";r=0;t=3600");
    ///     Ok::<_, Infallible>(response.body(String::new()).unwrap())
    /// });
    /// let client = ServiceBuilder::new().layer(layer.clone()).service(server);
    /// let request = Request::get("https://api.test/").body(String::new()).unwrap();
    /// client.oneshot(request).await?;
    /// // Capped at `max_wait`; other hosts are not held.
    /// assert_eq!(layer.wait_for("api.test", None), Duration::from_secs(60));
    /// assert_eq!(layer.wait_for("API.test:443", None), Duration::from_secs(60));
    /// assert_eq!(layer.wait_for("other.test", None), Duration::ZERO);
    /// # Ok(()) }
    /// ```
    pub fn wait_for(&self, host: &str, partition: Option<&str>) -> Duration {
        let (name, port) = split_host(host);
        if let Some(port) = port {
            return self
                .shared
                .wait(&state_key(&format!("{name}:{port}"), partition));
        }
        let http = self
            .shared
            .wait(&state_key(&format!("{name}:80"), partition));
        let https = self
            .shared
            .wait(&state_key(&format!("{name}:443"), partition));
        http.max(https)
    }
}

impl<S> Layer<S> for PacingLayer {
    type Service = Paced<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Paced {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service of a [`PacingLayer`]. It is always ready: each request awaits the inner
/// service's readiness once it has waited out the server's word, so that a request
/// waiting on a host holds none of the inner service's capacity. Ready, it takes its
/// pacing turn (a denial is waited out without that readiness; a shaping delay with it)
/// and is sent.
#[derive(Clone)]
pub struct Paced<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for Paced<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Paced")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// `now + wait`, or a time far enough when that overflows.
fn later(now: Instant, wait: Duration) -> Instant {
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// The host a request goes to, as one budget: lower case, no user info, no trailing dot
/// on a name, the port as a number, the scheme's default port made explicit (`A.test`,
/// `a.test.`, `a.test:080`, `a.test:80` and `user@a.test` are one host).
fn host_of<B>(request: &Request<B>) -> String {
    let authority = request
        .uri()
        .authority()
        .map(|authority| authority.as_str().to_owned())
        .or_else(|| {
            let host = request.headers().get(http::header::HOST)?;
            host.to_str().ok().map(str::to_owned)
        })
        .unwrap_or_default();
    let host = authority
        .rsplit_once('@')
        .map_or(authority.as_str(), |(_, host)| host);
    let (name, port) = split_host(host);
    if name.is_empty() {
        return name;
    }
    let port = port.unwrap_or_else(|| {
        let secure = request.uri().scheme_str().is_some_and(|scheme| {
            scheme.eq_ignore_ascii_case("https") || scheme.eq_ignore_ascii_case("wss")
        });
        if secure { "443" } else { "80" }.to_owned()
    });
    format!("{name}:{port}")
}

/// A host (`name` or `name:port`, an IPv6 literal in brackets) in one spelling: the name
/// in lower case without a trailing dot, the port (when it names one) without leading
/// zeros.
fn split_host(host: &str) -> (String, Option<String>) {
    let host = host.to_ascii_lowercase();
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port))
            if !host.ends_with(']') && port.bytes().all(|byte| byte.is_ascii_digit()) =>
        {
            // An empty port (`a.test:`) is the default one, as in a URI.
            let port = port.trim_start_matches('0');
            let port = match (port.is_empty(), host.ends_with(':')) {
                (_, true) => None,
                (true, false) => Some("0".to_owned()),
                (false, false) => Some(port.to_owned()),
            };
            (name, port)
        }
        _ => (host.as_str(), None),
    };
    // An IPv6 literal in its one spelling (RFC 5952: `[0:0::01]` is `[::1]`, an
    // IPv4-mapped address in either notation is one).
    if let Some(address) = name
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .and_then(|inner| inner.parse::<std::net::Ipv6Addr>().ok())
    {
        return (format!("[{address}]"), port);
    }
    let name = match name.strip_suffix('.') {
        Some(stripped) if !stripped.is_empty() && !stripped.ends_with('.') => stripped,
        _ => name,
    };
    (name.to_owned(), port)
}

fn state_key(host: &str, partition: Option<&str>) -> String {
    match partition {
        Some(partition) => format!("{host}#{partition}"),
        None => host.to_owned(),
    }
}

impl Shared {
    /// Waits as long as the host asks (a response that arrives meanwhile may ask for
    /// longer), but no longer than what is `left` of the attempt's wait on the server's
    /// word, less what it waits here.
    async fn wait_out(&self, key: &str, left: &mut Duration) {
        loop {
            let wait = self.wait(key);
            if wait.is_zero() || left.is_zero() {
                return;
            }
            let nap = wait.min(*left);
            tokio::time::sleep(nap).await;
            *left = left.saturating_sub(nap);
        }
    }

    fn wait(&self, key: &str) -> Duration {
        let hosts = self.hosts.lock().unwrap_or_else(PoisonError::into_inner);
        hosts
            .until
            .get(key)
            .map_or(Duration::ZERO, |until| {
                until.saturating_duration_since(Instant::now())
            })
            .min(self.max_wait)
    }

    /// Notes what `headers` (of a response with `status`) say about when to send again;
    /// true when the server asked for more than `max_wait` (a retry would be refused).
    fn learn(&self, key: &str, status: StatusCode, headers: &HeaderMap) -> bool {
        // A refusal waits a second, or `max_wait` when that is shorter, so that a 429 is
        // still retried under a `max_wait` below a second.
        let Some(wait) = asked_wait(status, headers, Duration::from_secs(1).min(self.max_wait))
        else {
            return false;
        };
        let refused = status == StatusCode::TOO_MANY_REQUESTS;
        // With no wait allowed at all (`max_wait` zero), a refusal is not retried: a
        // retry would go straight back.
        let capped = wait > self.max_wait || (refused && wait.is_zero());
        // Kept as this layer reads it (cut to its `max_wait`): layers of one base share
        // the table, so one with a shorter `max_wait` shortens the others' wait too.
        let until = later(Instant::now(), wait.min(self.max_wait));
        self.hosts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .note(key, until, Instant::now());
        capped
    }
}

/// When each host (and partition) may be sent to again.
#[derive(Clone, Debug, Default)]
struct Hosts {
    until: HashMap<String, Instant>,
    /// The size at which the map is next swept: twice what the last sweep left, and at
    /// least [`Hosts::FIRST_SWEEP`].
    sweep_at: usize,
}

impl Hosts {
    const FIRST_SWEEP: usize = 1024;
    /// The most hosts (and partitions) whose word is kept at once.
    const MAX_HOSTS: usize = 16 * 1024;

    /// Notes that `key` may not be sent to before `until`; true when the map was swept.
    fn note(&mut self, key: &str, until: Instant, now: Instant) -> bool {
        // Hosts whose word has expired are forgotten, so the map stays small. A sweep
        // walks every host, so the next one waits until the map has doubled past what
        // this one left: a sweep's cost is spread over the inserts since the last, and
        // the map holds at most about twice its live hosts.
        let swept = self.until.len() >= self.sweep_at.clamp(Self::FIRST_SWEEP, Self::MAX_HOSTS)
            && !self.until.contains_key(key);
        if swept {
            self.until.retain(|_, until| *until > now);
            self.sweep_at = self.until.len().saturating_mul(2);
        }
        let entry = self.until.entry(key.to_owned()).or_insert(until);
        *entry = (*entry).max(until);
        // Past the bound with every host's word still running (a crawler's many hosts, or
        // a server that names a new partition on every answer), or near it after a sweep
        // (which would come again at the next new host): the words that end first are
        // forgotten, down to seven eighths of the bound, so that one pass over the map
        // pays for an eighth of the bound of new hosts. Never the word just noted (its
        // 429's retry waits on it).
        let kept = Self::MAX_HOSTS - Self::MAX_HOSTS / 8;
        if self.until.len() > Self::MAX_HOSTS || (swept && self.until.len() > kept) {
            let mut ends: Vec<(Instant, &String)> = self
                .until
                .iter()
                .filter(|(host, _)| host.as_str() != key)
                .map(|(host, until)| (*until, host))
                .collect();
            let excess = self.until.len() - kept;
            ends.select_nth_unstable(excess - 1);
            let forgotten: Vec<String> = ends[..excess]
                .iter()
                .map(|(_, host)| (*host).clone())
                .collect();
            for host in &forgotten {
                self.until.remove(host);
            }
            self.sweep_at = Self::MAX_HOSTS;
        }
        swept
    }
}

/// How long the server asks the client to wait before its next request, from the
/// response's rate-limit fields; `None` when it asks for nothing.
///
/// `Retry-After` on an error takes precedence over the rate-limit fields (draft-11,
/// section 7), and on any other response where the fields say none is left; a response
/// from a cache (a positive `Age`) says nothing in its rate-limit fields (section 7.3); a refused response (429) asks for a second at least (one that
/// says nothing, a zero or a date gone by: never straight back, as the layer waits).
/// The wait counts from now: read a response as it arrives. A date (an HTTP-date
/// `Retry-After`, a Unix-time reset) is a point on the server's clock, measured from
/// the response's `Date` when that clock is five seconds or more ahead of this
/// machine's, or one or more behind it (this machine's the one off: `Date` never leads
/// the server's now).
///
/// ```
/// use http::{HeaderMap, HeaderValue, StatusCode};
/// use std::time::Duration;
/// use tollgate::client::server_wait;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("ratelimit", HeaderValue::from_static("\"day\";r=0;t=3600"));
/// assert_eq!(server_wait(StatusCode::OK, &headers), Some(Duration::from_secs(3600)));
/// headers.insert("retry-after", HeaderValue::from_static("2"));
/// assert_eq!(server_wait(StatusCode::TOO_MANY_REQUESTS, &headers), Some(Duration::from_secs(2)));
/// ```
pub fn server_wait(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    asked_wait(status, headers, Duration::from_secs(1))
}

/// What the server's fields ask for ([`server_word`]), a refusal (429) never straight back
/// (no word, a zero, a date in the past, a clock skewed): `floor` at least.
fn asked_wait(status: StatusCode, headers: &HeaderMap, floor: Duration) -> Option<Duration> {
    let refused = status == StatusCode::TOO_MANY_REQUESTS;
    match server_word(status, headers) {
        Some(wait) if refused => Some(wait.max(floor)),
        Some(wait) => Some(wait),
        None if refused => Some(floor),
        None => None,
    }
}

/// What the server's fields say about when to send again, and nothing when they say
/// nothing (see [`server_wait`]).
fn server_word(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    // Retry-After (RFC 9110, section 10.2.3): seconds or an HTTP date. A wait for the
    // host on an error (a 429, a 503, GitHub's 403 for its secondary limits) or a gRPC
    // answer (whose refusals are HTTP 200): on a 202 it says when to poll, on a 3xx when
    // to send the redirected request, and neither holds the host. Where it holds, it
    // takes precedence over the rate-limit fields (draft-11, section 7: "the Retry-After
    // field MUST take precedence").
    let grpc = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/grpc"));
    let refused = status.is_client_error() || status.is_server_error() || grpc;
    if refused && let Some(after) = retry_after_field(headers) {
        return Some(after);
    }
    // A response from a cache (a positive current age): its fields may be long out of
    // date, and are ignored (draft-11, section 7.3).
    if age(headers).is_some_and(|age| age > 0) {
        return None;
    }
    // The longest of what the fields say (`None` is below any wait), and whether any
    // says none is left (with a time or not).
    let (mut wait, mut none_left) = ratelimit_wait(headers);
    // draft-6 and the X- fields: remaining 0 until reset.
    for (remaining, reset) in [
        ("ratelimit-remaining", "ratelimit-reset"),
        ("x-ratelimit-remaining", "x-ratelimit-reset"),
    ] {
        // A whole number, or one written as a decimal (Reddit's `0.0`): below one
        // request left is none left.
        let remaining = headers
            .get(remaining)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<f64>().ok())
            .filter(|left| left.is_finite() && *left >= 0.0);
        if remaining.is_some_and(|left| left < 1.0) {
            none_left = true;
            let reset = headers.get(reset).and_then(|value| value.to_str().ok());
            wait = wait.max(reset.and_then(|reset| reset_delay(reset, headers)));
        }
    }
    // Fields that say none is left beside a Retry-After, on a success or a redirect: the
    // Retry-After says how long (draft-11, section 7: it "MUST take precedence and the
    // reset keyword MAY be ignored"), also where the fields name no time. Alone there,
    // it holds no host (above).
    if none_left && let Some(after) = retry_after_field(headers) {
        return Some(after);
    }
    wait
}

/// The wait a response's `Retry-After` states, when it has one that reads.
fn retry_after_field(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    retry_after(value, headers)
}

/// The draft-11 `RateLimit` field's wait: the longest `t` of a member with `r=0`. The
/// field's lines are one list, and a field that does not parse is ignored whole (RFC
/// 9651, section 4.2); so is one with a malformed member (draft-11, section 7:
/// "Malformed RateLimit header fields MUST be ignored"): `r` missing (it is REQUIRED,
/// section 4.1) or either of `r` and `t` not a non-negative Integer. A member with
/// `r=0` and no `t` (OPTIONAL) names no window, and asks for no wait: an in-flight
/// limit's slot frees when a response ends, not after a time. Beside the wait, whether a
/// member has `r=0` (with a `t` or not).
fn ratelimit_wait(headers: &HeaderMap) -> (Option<Duration>, bool) {
    ratelimit_word(headers).unwrap_or((None, false))
}

fn ratelimit_word(headers: &HeaderMap) -> Option<(Option<Duration>, bool)> {
    let lines: Option<Vec<&str>> = headers
        .get_all("ratelimit")
        .iter()
        .map(|value| value.to_str().ok())
        // An empty line adds no member.
        .filter(|line| line.is_none_or(|line| !line.trim().is_empty()))
        .collect();
    let lines = lines.filter(|lines| !lines.is_empty())?;
    let list = sfv::Parser::new(&lines.join(", "))
        .parse::<sfv::List>()
        .ok()?;
    let mut wait: Option<Duration> = None;
    let mut none_left = false;
    for member in list {
        let sfv::ListEntry::Item(item) = member else {
            return None;
        };
        // Absent: `None`; present as anything but a non-negative Integer: malformed.
        let number = |name: &str| -> Result<Option<u64>, ()> {
            match item.params.iter().find(|(key, _)| key.as_str() == name) {
                None => Ok(None),
                Some((_, value)) => value
                    .as_integer()
                    .and_then(|n| u64::try_from(i64::from(n)).ok())
                    .map(Some)
                    .ok_or(()),
            }
        };
        let (Ok(Some(r)), Ok(t)) = (number("r"), number("t")) else {
            return None;
        };
        if r == 0 {
            none_left = true;
            wait = wait.max(t.map(Duration::from_secs));
        }
    }
    Some((wait, none_left))
}

/// A response's `Age`: delta-seconds, `1*DIGIT` (RFC 9111, section 1.2.2), one past
/// what a number holds being the largest (2^31 seconds, as that section has a cache
/// treat it); `None` when absent or not a number.
fn age(headers: &HeaderMap) -> Option<u64> {
    const LARGEST: u64 = 1 << 31;
    let text = headers.get(http::header::AGE)?.to_str().ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<u64>().map_or(LARGEST, |age| age.min(LARGEST)))
}

/// Below this, a server's clock ahead of this machine's is in step with it (measured
/// on the local clock, a wait comes out longer than asked, never shorter).
const IN_STEP: Duration = Duration::from_secs(5);

/// Below this, this machine's clock ahead of a server's `Date` is in step with it: `Date`
/// is stamped in whole seconds before the response crosses the network, so it trails
/// the server's now by its rounding (under a second) and the transit, never leads it.
/// Further ahead, the local clock is the one off, and measured on it a wait would come
/// out short (a retry refused again); measured from `Date`, it comes out long by the
/// rounding and the transit at most.
const AHEAD: Duration = Duration::from_secs(1);

/// The now against which a dated wait (an HTTP-date Retry-After, a Unix-time reset) is
/// measured. The dates are points on the clock of whoever wrote them, which may be off
/// from this machine's by any amount: when the response's `Date` (RFC 9110, section
/// 6.6.1), plus its `Age` when a cache held it (RFC 9111, section 5.1), is ahead of this
/// machine's clock by [`IN_STEP`] or more, or behind it by [`AHEAD`] or more, the wait is
/// measured from it, on the server's clock. That trusts the `Date` writer's clock to be the dates' writer's (a
/// proxy that writes its own `Date` with a clock that is off misleads it), and a cache
/// that serves a stored response without `Age` looks like a server whose clock is
/// behind; either way the wait stays capped by the caller (`PacingLayer`'s
/// `max_wait`). In step, or without a `Date` that parses, this machine's clock is used:
/// exact to the millisecond, where `Date` is to the second.
fn server_now(headers: &HeaderMap) -> SystemTime {
    let local = SystemTime::now();
    let Some(date) = headers
        .get(http::header::DATE)
        .and_then(|value| value.to_str().ok())
        .and_then(|date| httpdate::parse_http_date(date.trim()).ok())
    else {
        return local;
    };
    let aged = Duration::from_secs(age(headers).unwrap_or(0));
    let server = date.checked_add(aged).unwrap_or(date);
    let in_step = match local.duration_since(server) {
        Ok(local_ahead) => local_ahead < AHEAD,
        Err(server_ahead) => server_ahead.duration() < IN_STEP,
    };
    if in_step { local } else { server }
}

/// How long from the server's now (see [`server_now`]) until `at` (since the Unix
/// epoch); nothing when it is past. Every dated wait is measured here.
fn until(at: Duration, headers: &HeaderMap) -> Duration {
    let now = server_now(headers)
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    at.saturating_sub(now)
}

/// A reset value of the draft-6 or X- fields: seconds from now, or (past a billion) a
/// Unix time, or (past a trillion) a Unix time in milliseconds, measured on the
/// server's clock (see [`server_now`]); a fraction of a second (Discord writes
/// `1470173023.123`) is rounded up. `None` when it is not a number.
fn reset_delay(text: &str, headers: &HeaderMap) -> Option<Duration> {
    let text = text.trim();
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) {
        return None;
    }
    // Past u64: as long a wait as there is (capped by the caller's `max_wait`).
    let whole: u64 = whole.parse().unwrap_or(u64::MAX);
    // The first nine digits, rounded up when any digit after them is not zero.
    let past_nanos = fraction
        .get(9..)
        .is_some_and(|rest| rest.bytes().any(|b| b != b'0'));
    let nanos = format!("{fraction:0<9}")[..9].parse::<u32>().unwrap_or(0) + u32::from(past_nanos);
    Some(if whole > 1_000_000_000_000 {
        // Milliseconds: a fraction of one rounds up too.
        until(
            Duration::from_millis(whole.saturating_add(u64::from(nanos > 0))),
            headers,
        )
    } else if whole > 1_000_000_000 {
        until(
            Duration::from_secs(whole) + Duration::from_nanos(u64::from(nanos)),
            headers,
        )
    } else if nanos > 0 {
        Duration::from_secs(whole.saturating_add(1))
    } else {
        Duration::from_secs(whole)
    })
}

/// A Retry-After value: delay-seconds, or an HTTP date measured on the server's clock
/// (see [`server_now`]).
fn retry_after(value: &str, headers: &HeaderMap) -> Option<Duration> {
    let value = value.trim();
    // delay-seconds = 1*DIGIT (RFC 9110, section 10.2.3), unbounded: past u64, as long a
    // wait as there is.
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let at = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    Some(until(at, headers))
}

fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::PUT | Method::DELETE | Method::OPTIONS | Method::TRACE
    )
}

/// A copy of a request for a retry, extensions included.
fn copy<B: Clone>(request: &Request<B>) -> Request<B> {
    let mut copy = Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    *copy.extensions_mut() = request.extensions().clone();
    copy
}

impl<S, B, RB> Service<Request<B>> for Paced<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Clone + Send + 'static,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RB>, S::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The inner service's readiness is awaited in the response future, once the
        // server's word is waited out: a request waiting on a host holds none of its
        // capacity (a concurrency limit's permit, a buffer's slot) meanwhile.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let host = host_of(&request);
            // Read from the request's own parts: no copy of its body.
            let (parts, body) = request.into_parts();
            let partition = shared
                .partition
                .as_ref()
                .and_then(|partition| partition(&parts));
            let request = Request::from_parts(parts, body);
            let key = state_key(&host, partition.as_deref());
            let retries = if shared.retry_all || idempotent(request.method()) {
                shared.retries
            } else {
                0
            };
            let mut attempt = 0;
            let mut first = Some(request);
            loop {
                let (mut ready, turn) = ready_and_paced(&shared, &mut inner, &key).await?;
                let request = match (&first, attempt < retries) {
                    (Some(request), true) => copy(request),
                    _ => first
                        .take()
                        .expect("the request is sent at most once without copy"),
                };
                let sent = ready.call(request);
                // Sent: the pacing policy's turn is used.
                if let Some(turn) = turn {
                    turn.used();
                }
                let response = sent.await?;
                let capped = shared.learn(&key, response.status(), response.headers());
                // A retry within `max_wait` of a server that asked for longer would only be
                // refused again: the 429 is returned as it is.
                if response.status() == StatusCode::TOO_MANY_REQUESTS
                    && attempt < retries
                    && !capped
                {
                    attempt += 1;
                    continue;
                }
                return Ok(response);
            }
        })
    }
}

/// The waits before one attempt: the server's word (at most `max_wait` in all, holding
/// nothing of the inner service), then the inner service's readiness, then the pacing
/// policy's turn (its own denials and delay at most `max_wait`; a denial waited out
/// without the inner service, a shaping delay with it). When the server asks for a wait
/// while the request is paced, its turn is given back (if no later turn is held) and it
/// is paced afresh once the wait is over (once per attempt: after that it waits holding
/// its turn). The inner service, ready, and the turn.
async fn ready_and_paced<'a, S, R>(
    shared: &'a Shared,
    inner: &mut S,
    key: &'a str,
) -> Result<(S, Option<Turn<'a>>), S::Error>
where
    S: Service<R> + Clone,
{
    // What is left of the wait on the server's word: only the waits on it count (a
    // word heard while the inner service was busy is still waited out).
    let mut word_left = shared.max_wait;
    let mut paced_again = false;
    loop {
        let mut ready = ready_after_word(shared, inner, key, &mut word_left).await?;
        let Some(pacer) = &shared.pacer else {
            return Ok((ready, None));
        };
        // The pacing's own waits count against its `max_wait`; waiting for the inner
        // service again after a denial does not.
        let mut left = shared.max_wait;
        let turn = loop {
            match pacer.take_turn(key, left) {
                Pacing::Go(turn, delay) => {
                    tokio::time::sleep(delay).await;
                    break Some(turn);
                }
                Pacing::WaitFor(retry_after) if retry_after <= left => {
                    left -= retry_after;
                    drop(ready);
                    tokio::time::sleep(retry_after).await;
                    ready = ready_after_word(shared, inner, key, &mut word_left).await?;
                }
                // Past the pacing's `max_wait`, or never: the request goes, and the
                // server decides.
                Pacing::WaitFor(_) | Pacing::Never => break None,
            }
        };
        let word = !shared.wait(key).is_zero() && !word_left.is_zero();
        if word && turn.is_some() && !paced_again {
            paced_again = true;
            drop((turn, ready));
            continue;
        }
        if word {
            drop(ready);
            ready = ready_after_word(shared, inner, key, &mut word_left).await?;
        }
        return Ok((ready, turn));
    }
}

/// Waits out the server's word (what is `left` of the attempt's wait on it at most), then
/// the inner service's readiness; again if the server asked for a wait meanwhile. The
/// inner service, ready.
async fn ready_after_word<S, R>(
    shared: &Shared,
    inner: &mut S,
    key: &str,
    left: &mut Duration,
) -> Result<S, S::Error>
where
    S: Service<R> + Clone,
{
    loop {
        shared.wait_out(key, left).await;
        let mut ready = inner.clone();
        std::future::poll_fn(|cx| ready.poll_ready(cx)).await?;
        if shared.wait(key).is_zero() || left.is_zero() {
            return Ok(ready);
        }
    }
}

/// What the pacing policy says of a request now. (Read at once where it is made: the
/// size of its turn costs nothing worth a box.)
#[allow(clippy::large_enum_variant)]
enum Pacing<'a> {
    /// It may go after the delay, with this turn.
    Go(Turn<'a>, Duration),
    /// Not before this long.
    WaitFor(Duration),
    /// Never (a cost the policy never admits): the request goes, and the server decides.
    Never,
}

impl Pacer {
    /// Decides a request to `key` now; an admitted one takes a turn. A turn whose delay
    /// is longer than `left` is given back at once (it is the newest) and the request
    /// told it would wait too long.
    fn take_turn<'a>(&'a self, key: &'a str, left: Duration) -> Pacing<'a> {
        // The turn is counted with the decision, so that a give-back sees every turn
        // given after it.
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        // A slot still ahead whose request was dropped: this request's, before any the
        // policy would book after every other.
        if let Some(key_turns) = turns.get_mut(key) {
            key_turns.forget_past(now);
            if let Some(first) = key_turns.unused.first_entry() {
                let delay = first.get().0.saturating_duration_since(now);
                if delay > left {
                    return Pacing::WaitFor(delay);
                }
                let (number, (at, decision)) = first.remove_entry();
                key_turns.waiting += 1;
                let turn = Turn {
                    pacer: self,
                    key,
                    number,
                    at,
                    decision: Some(decision),
                };
                return Pacing::Go(turn, delay);
            }
        }
        let decision = self.store.check(key, &self.policies, 1);
        match decision.outcome() {
            crate::Outcome::Allowed { delay } if delay > left => {
                self.give_back(key, &decision);
                Pacing::WaitFor(delay)
            }
            crate::Outcome::Allowed { delay } => {
                let turns = turns.entry(key.to_owned()).or_default();
                turns.given += 1;
                turns.waiting += 1;
                let turn = Turn {
                    pacer: self,
                    key,
                    number: turns.given,
                    at: later(now, delay),
                    decision: Some(decision),
                };
                Pacing::Go(turn, delay)
            }
            crate::Outcome::Denied { retry_after, .. } => Pacing::WaitFor(retry_after),
            _ => Pacing::Never,
        }
    }

    /// Takes back the unit `decision` spent (the caller holds the turns' lock, and the
    /// decision is the key's newest).
    fn give_back(&self, key: &str, decision: &crate::Decision) {
        let give_back = crate::store::Adjustment::give_back(1, decision);
        self.store.adjust_now(key, &self.policies, &give_back);
    }
}

/// A turn the pacing policy gave a request: given back unless the request is sent (it
/// was dropped while it waited, or the inner service failed to become ready again), and
/// only while no turn was given after it for its key (host and partition).
struct Turn<'a> {
    pacer: &'a Pacer,
    key: &'a str,
    /// The count of the key's turns when this one was given.
    number: u64,
    /// When its slot comes.
    at: Instant,
    decision: Option<crate::Decision>,
}

impl Turn<'_> {
    /// The request was sent: the turn is used.
    fn used(mut self) {
        self.decision = None;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut turns = self
            .pacer
            .turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(key_turns) = turns.get_mut(self.key) else {
            debug_assert!(false, "a turn outlived its key's count");
            return;
        };
        if let Some(decision) = self.decision.take() {
            if key_turns.given == self.number {
                self.pacer.give_back(self.key, &decision);
                // As if it had never been given: the turn before it is the newest again,
                // and given back too if it was dropped unused, and so on down.
                key_turns.given -= 1;
                while let Some(newest) = key_turns.unused.last_entry() {
                    if *newest.key() != key_turns.given {
                        break;
                    }
                    let (_, decision) = newest.remove();
                    self.pacer.give_back(self.key, &decision);
                    key_turns.given -= 1;
                }
            } else if self.number > key_turns.sent {
                key_turns.unused.insert(self.number, (self.at, decision));
            }
        } else if self.number > key_turns.sent {
            // Sent: the turns before it can no longer come back (their slots passed).
            key_turns.sent = self.number;
            key_turns.unused = key_turns.unused.split_off(&(self.number + 1));
        }
        key_turns.waiting -= 1;
        // With none waiting, no later turn can be given back: the unused ones stay spent.
        if key_turns.waiting == 0 {
            turns.remove(self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_dropped_behind_a_sent_one_are_not_kept() {
        // One host that always has a turn waiting (a crawler's workers): turns given up
        // behind a later turn that was sent can never come back, and are not kept.
        let layer = PacingLayer::new().pace(
            Policy::token_bucket("upstream", 1_000_000, crate::Rate::per_second(1_000_000))
                .unwrap(),
        );
        let pacer = layer.shared.pacer.as_ref().expect("a pacing policy");
        let key = "busy.test:443";
        let take = || match pacer.take_turn(key, Duration::from_secs(60)) {
            Pacing::Go(turn, _) => turn,
            _ => panic!("a turn is given"),
        };
        let _waiting = take();
        for _ in 0..1_000 {
            let (given_up, sent) = (take(), take());
            drop(given_up);
            sent.used();
        }
        let turns = pacer.turns.lock().unwrap();
        let kept = turns[key].unused.len();
        assert!(kept <= 1, "{kept} turns kept that can never come back");
    }

    #[test]
    fn turns_given_up_oldest_first_while_later_ones_wait_are_not_piled_up() {
        // A shaping pacer under callers' timeouts: five turns always waiting, the oldest
        // given up as each new one is taken. Every turn dropped was kept for a give-back
        // that never came (no turn was ever the newest when dropped): 9,995 of them.
        let layer = PacingLayer::new().pace(
            Policy::leaky_bucket_shaping(
                "upstream",
                crate::Rate::per_second(1_000_000),
                Duration::from_secs(60),
            )
            .unwrap(),
        );
        let pacer = layer.shared.pacer.as_ref().expect("a pacing policy");
        let key = "busy.test:443";
        let mut waiting = std::collections::VecDeque::new();
        for _ in 0..10_000 {
            match pacer.take_turn(key, Duration::from_secs(60)) {
                Pacing::Go(turn, _) => waiting.push_back(turn),
                _ => panic!("a turn is given"),
            }
            if waiting.len() > 5 {
                drop(waiting.pop_front());
            }
        }
        let kept = pacer.turns.lock().unwrap()[key].unused.len();
        assert!(kept <= 5, "{kept} turns given up kept");
    }

    #[test]
    fn the_pacers_state_is_bounded_like_the_hosts_words() {
        // A crawler's hosts, named by whoever wrote its links: each new host takes one
        // turn, and the pacer keeps no more of them than the hosts' words.
        let layer = PacingLayer::new()
            .pace(Policy::token_bucket("upstream", 1, crate::Rate::per_second(1)).unwrap());
        let pacer = layer.shared.pacer.as_ref().expect("a pacing policy");
        for n in 0..Hosts::MAX_HOSTS + 4_000 {
            let key = format!("h{n}.test:443");
            match pacer.take_turn(&key, Duration::from_secs(60)) {
                Pacing::Go(turn, _) => turn.used(),
                _ => panic!("a new host's first request is paced at once"),
            }
        }
        assert!(
            pacer.store.len() <= Hosts::MAX_HOSTS,
            "the pacer keeps {} hosts",
            pacer.store.len()
        );
    }

    #[test]
    fn hosts_are_swept_a_few_times_not_on_every_new_host() {
        // 1,023 hosts that asked for a long wait, then a stream of new hosts whose word
        // expires before the next one comes: the map stays near 1,024 entries, and a
        // sweep on every new host would walk all of them each time.
        let start = Instant::now();
        let mut hosts = Hosts::default();
        for n in 0..1023 {
            hosts.note(
                &format!("long-{n}"),
                start + Duration::from_secs(3600),
                start,
            );
        }
        let mut sweeps = 0;
        for n in 0..10_000u64 {
            let now = start + Duration::from_millis(2 * n);
            let until = now + Duration::from_millis(1);
            sweeps += u32::from(hosts.note(&format!("short-{n}"), until, now));
        }
        assert!(sweeps <= 20, "{sweeps} sweeps for 10,000 new hosts");
        // Expired hosts are still forgotten: the map stays within twice its live hosts.
        assert!(
            hosts.until.len() <= 2 * 1024 + 1,
            "{} hosts kept",
            hosts.until.len()
        );
        // The long waits survive every sweep.
        assert_eq!(
            hosts
                .until
                .keys()
                .filter(|k| k.starts_with("long-"))
                .count(),
            1023
        );
    }

    /// A full map whose words end about as fast as new hosts come (a crawler meeting
    /// 429s all day): a sweep that freed a few left the map at the bound, and the next
    /// new host swept the whole map again, each under the lock every request takes. The
    /// sweeps stay spread out: one per eighth of the bound of new hosts, or fewer.
    #[test]
    fn a_full_map_is_not_swept_on_every_new_host() {
        let start = Instant::now();
        let mut hosts = Hosts::default();
        let at = |n: usize| start + Duration::from_millis(n as u64);
        // Full, each word ending a millisecond after the one before.
        for n in 0..Hosts::MAX_HOSTS {
            hosts.note(
                &format!("host-{n}"),
                at(n) + Duration::from_secs(3600),
                at(0),
            );
        }
        // Then a new host each millisecond, as one word ends.
        let mut sweeps = 0;
        let news = Hosts::MAX_HOSTS;
        for n in 0..news {
            let now = at(n) + Duration::from_secs(3600);
            sweeps +=
                usize::from(hosts.note(&format!("new-{n}"), now + Duration::from_secs(3600), now));
        }
        assert!(sweeps <= 8 + 1, "{sweeps} sweeps for {news} new hosts");
        assert!(hosts.until.len() <= Hosts::MAX_HOSTS);
    }

    #[test]
    fn the_hosts_kept_are_bounded_and_the_soonest_word_goes_first() {
        // More hosts than the bound, all still waiting (each asked for longer than the
        // one before): the map stays at the bound, and what it forgot are the waits that
        // end first.
        let start = Instant::now();
        let mut hosts = Hosts::default();
        let count = Hosts::MAX_HOSTS + 500;
        for n in 0..count {
            let until = start + Duration::from_secs(3600) + Duration::from_millis(n as u64);
            hosts.note(&format!("host-{n}"), until, start);
        }
        assert!(
            hosts.until.len() <= Hosts::MAX_HOSTS,
            "{}",
            hosts.until.len()
        );
        assert!(hosts.until.len() >= Hosts::MAX_HOSTS * 7 / 8);
        let kept = |n: usize| hosts.until.contains_key(&format!("host-{n}"));
        // Forgotten: the soonest (one eighth of the bound and a host); kept: the rest.
        let forgotten = Hosts::MAX_HOSTS / 8 + 1;
        assert!((0..forgotten).all(|n| !kept(n)));
        assert!((forgotten..count).all(kept));
        // A host noted now whose word ends before every other's is kept all the same:
        // a 429's retries wait on it.
        let mut full: Hosts = hosts.clone();
        while full.until.len() < Hosts::MAX_HOSTS {
            let n = full.until.len();
            full.note(
                &format!("filler-{n}"),
                start + Duration::from_secs(7200),
                start,
            );
        }
        full.note("just-refused", start + Duration::from_secs(1), start);
        assert!(full.until.contains_key("just-refused"));
        assert!(full.until.len() <= Hosts::MAX_HOSTS);
    }
}
