//! [`RateLimitLayer`]: the builder and the `tower::Layer`.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use std::time::Duration;

use crate::bypass::Bypass;
use crate::cost::Cost;
use crate::failure::{Breaker, CircuitBreaker, FailureMode};
use crate::key::{ClientIp, KeyExtractor};
use crate::policy::{MAX_PERIOD, Policy, PolicySet};
use crate::resolve::PolicyResolver;
use crate::respond::headers::{HeaderOptions, HeaderStyle};
use crate::respond::problem::Rejection;
use crate::respond::{DenyHook, MissingKey, Responder};
use crate::service::{Config, RateLimit};
use crate::settle::Settle;
use crate::store::Store;

/// Rate limiting for any Tower service of `http::Request`s.
///
/// Per request it extracts a [`Key`](crate::Key) (default: the socket peer's IP; behind
/// a proxy, key by [`ClientIp::behind_proxies`](crate::key::ClientIp::behind_proxies)),
/// computes a cost (default: 1), resolves the policies and asks the store, which decides
/// against every policy at once. Admitted requests go to the inner service and their
/// responses get rate-limit headers; denied ones get `429 Too Many Requests`,
/// `Retry-After` and an `application/problem+json` body, with the same headers (a gRPC
/// call gets a gRPC status instead: `RESOURCE_EXHAUSTED`, with the same metadata).
///
/// Clones of the layer and of its services share one store, so one limit holds across
/// every route and connection.
///
/// Its `poll_ready` is the inner service's, as a Tower middleware's is: a service under
/// the limiter that holds back (a full `ConcurrencyLimit` or `Buffer`) holds back every
/// request, the ones the limiter would refuse too, and on a store doing I/O a request
/// keeps the permit it was given while the store answers. To refuse a flood at once in
/// front of a saturated service, put `tower::load_shed::LoadShedLayer` between the
/// limiter and the limit (it is always ready, and fails a request the limit has no room
/// for; map that error to a `503` with `HandleErrorLayer`).
///
/// The inner service must be `Clone + Send` with a `Send` future (an axum `Router` or
/// handler is; wrap a `BoxService` in `tower::buffer::Buffer`, or use a
/// `BoxCloneService`). A store that does I/O and a shaping policy wait on Tokio's
/// timer: run them on a runtime with time enabled (`#[tokio::main]` is). An error from
/// the inner service passes through without rate-limit headers: map errors to
/// responses inside the limiter (`HandleErrorLayer` under it) for them to get headers.
///
/// ```no_run
/// use axum::{Router, routing::get};
/// use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
/// use tollgate::cost::PerRoute;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = RateLimitLayer::new(MemoryStore::new())
///     .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?)
///     .cost(PerRoute::new(1).route("/search", 5));
/// let app = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .route("/search", get(|| async { "results" }))
///     .layer(limiter);
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
/// axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>()).await?;
/// # Ok(()) }
/// ```
pub struct RateLimitLayer<St, K = ClientIp, C = u64, R = PolicySet> {
    store: St,
    key: K,
    cost: C,
    resolver: R,
    headers: HeaderOptions,
    on_deny: Option<DenyHook>,
    missing_key: MissingKey,
    failure_mode: FailureMode,
    store_timeout: Duration,
    /// Shared by every service this layer makes (axum may call `layer` more than once).
    breaker: Arc<Breaker>,
    /// Whether a service of this layer has said that it lets requests through without a
    /// key the server should have set: said once per layer, whatever its routes.
    said_missing: Arc<std::sync::atomic::AtomicBool>,
    /// Whether it has said that its network bypass matches the socket peer: once per
    /// layer.
    said_peer_bypass: Arc<std::sync::atomic::AtomicBool>,
    /// Bookings of requests dropped during their shaping delay, waiting for the ones
    /// queued after them to be given back: shared by every service of this layer.
    dropped: Arc<crate::settle::DroppedBookings>,
    settle: Option<Settle>,
    bypass: Option<Bypass>,
    shadow: bool,
    /// A set-up mistake made while adding policies one by one, reported when the layer is
    /// built (by [`validate`](Self::validate)).
    mistake: Option<Arc<str>>,
}

/// The policies of a layer that has none yet. A layer can only wrap a service once it has
/// a policy ([`policy`](RateLimitLayer::policy), [`policies`](RateLimitLayer::policies) or
/// a [`resolver`](RateLimitLayer::resolver)): this type is no [`PolicyResolver`], so a
/// layer without one is a compile error, not a limiter that limits nothing.
///
/// ```compile_fail
/// use tollgate::{MemoryStore, RateLimitLayer};
/// use tower_layer::Layer;
///
/// // No policy: the layer cannot wrap a service.
/// let service = RateLimitLayer::new(MemoryStore::new()).layer(());
/// ```
///
/// The same with a policy compiles:
///
/// ```
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
/// use tower_layer::Layer;
///
/// let service = RateLimitLayer::new(MemoryStore::new())
///     .policy(Policy::gcra("api", Rate::per_second(5), 5)?)
///     .layer(());
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPolicy;

impl<St: Clone, K: Clone, C: Clone, R: Clone> Clone for RateLimitLayer<St, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            resolver: self.resolver.clone(),
            headers: self.headers.clone(),
            on_deny: self.on_deny.clone(),
            missing_key: self.missing_key,
            failure_mode: self.failure_mode.clone(),
            store_timeout: self.store_timeout,
            breaker: Arc::clone(&self.breaker),
            said_missing: Arc::clone(&self.said_missing),
            said_peer_bypass: Arc::clone(&self.said_peer_bypass),
            dropped: Arc::clone(&self.dropped),
            settle: self.settle.clone(),
            bypass: self.bypass.clone(),
            shadow: self.shadow,
            mistake: self.mistake.clone(),
        }
    }
}

impl<St, K: fmt::Debug, C: fmt::Debug, R: fmt::Debug> fmt::Debug for RateLimitLayer<St, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.key)
            .field("cost", &self.cost)
            .field("policies", &self.resolver)
            .field("headers", &self.headers)
            .field("missing_key", &self.missing_key)
            .field("failure_mode", &self.failure_mode)
            .field("store_timeout", &self.store_timeout)
            .field("shadow", &self.shadow)
            .field("settles", &self.settle.is_some())
            .field("bypass", &self.bypass.is_some())
            .field("mistake", &self.mistake)
            .finish_non_exhaustive()
    }
}

impl<St: Store> RateLimitLayer<St, ClientIp, u64, NoPolicy> {
    /// A layer over `store`, keyed by the socket peer's IP, every request costing 1.
    /// Add at least one policy with [`policy`](Self::policy) before it can wrap a service.
    pub fn new(store: St) -> Self {
        Self {
            store,
            key: ClientIp::peer(),
            cost: 1,
            resolver: NoPolicy,
            headers: HeaderOptions::default(),
            on_deny: None,
            missing_key: MissingKey::default(),
            failure_mode: FailureMode::default(),
            store_timeout: crate::store::DEFAULT_STORE_TIMEOUT,
            breaker: Arc::new(Breaker::new(CircuitBreaker::default())),
            said_missing: Arc::default(),
            said_peer_bypass: Arc::default(),
            dropped: Arc::default(),
            settle: None,
            bypass: None,
            shadow: false,
            mistake: None,
        }
    }
}

impl<St, K, C> RateLimitLayer<St, K, C, NoPolicy> {
    /// The first policy every request must pass.
    pub fn policy(self, policy: Policy) -> RateLimitLayer<St, K, C, PolicySet> {
        self.rebuild(|key, cost, _| (key, cost, PolicySet::from(policy)))
    }
}

impl<St, K, C> RateLimitLayer<St, K, C, PolicySet> {
    /// Adds a policy every request must pass.
    ///
    /// Names are unique in a set, as [`PolicySet::new`] requires: a second policy of a
    /// name already added (`.policy(burst).policy(daily)`, both named "api") would have
    /// only one of the two limits hold, so the layer refuses that set-up when it is built
    /// ([`validate`](Self::validate)); the same policy added again changes nothing. A
    /// shadow policy rolled out beside the enforced one of its name
    /// (`.policy(api).policy(api_next.shadow())`) is refused the same way: give it a name
    /// of its own. ([`PolicySet::with`] replaces a policy of the same name, on purpose.)
    pub fn policy(mut self, policy: Policy) -> Self {
        if let Some(twice) = self
            .resolver
            .iter()
            .find(|p| p.name() == policy.name() && p.is_shadow() == policy.is_shadow())
            && (*twice != policy || twice.unit() != policy.unit())
        {
            self.mistake.get_or_insert_with(|| {
                format!(
                    "RateLimitLayer: two policies are named \"{name}\" (added twice with \
                     .policy()): names are unique in a set, and only one of the two limits \
                     would hold; give each policy a name of its own",
                    name = policy.name()
                )
                .into()
            });
        }
        if let Some(replaced) = self
            .resolver
            .iter()
            .find(|p| p.name() == policy.name() && p.is_shadow() != policy.is_shadow())
        {
            let (was, now) = if replaced.is_shadow() {
                ("in shadow", "enforced")
            } else {
                ("enforced", "in shadow")
            };
            self.mistake.get_or_insert_with(|| {
                format!(
                    "RateLimitLayer: policy \"{name}\" is added {was}, then again {now}: a \
                     later .policy() replaces one of the same name, so it would not be \
                     {was} any more; give the shadow policy a name of its own",
                    name = policy.name()
                )
                .into()
            });
        }
        self.resolver = self.resolver.with(policy);
        self
    }
}

impl<St, K, C, R> RateLimitLayer<St, K, C, R> {
    /// The same layer with another key, cost or resolver.
    fn rebuild<K2, C2, R2>(
        self,
        change: impl FnOnce(K, C, R) -> (K2, C2, R2),
    ) -> RateLimitLayer<St, K2, C2, R2> {
        let (key, cost, resolver) = change(self.key, self.cost, self.resolver);
        RateLimitLayer {
            store: self.store,
            key,
            cost,
            resolver,
            headers: self.headers.clone(),
            on_deny: self.on_deny,
            missing_key: self.missing_key,
            failure_mode: self.failure_mode,
            store_timeout: self.store_timeout,
            breaker: self.breaker,
            said_missing: self.said_missing,
            said_peer_bypass: self.said_peer_bypass,
            dropped: self.dropped,
            settle: self.settle,
            bypass: self.bypass,
            shadow: self.shadow,
            mistake: self.mistake,
        }
    }

    /// Every request must pass all of `policies` (replacing the policies set so far).
    pub fn policies(self, policies: PolicySet) -> RateLimitLayer<St, K, C, PolicySet> {
        let mut layer = self.rebuild(|key, cost, _| (key, cost, policies));
        layer.mistake = None;
        layer
    }

    /// Picks the policies per request (per plan, per tenant); see
    /// [`resolve_with`](crate::resolve::resolve_with) (a closure) and
    /// [`PolicyResolver`] (a resolver of your own), each with an example.
    pub fn resolver<R2: PolicyResolver>(self, resolver: R2) -> RateLimitLayer<St, K, C, R2> {
        let mut layer = self.rebuild(|key, cost, _| (key, cost, resolver));
        layer.mistake = None;
        layer
    }

    /// Identifies requests with `key` (default: [`ClientIp::peer`]).
    pub fn key<K2: KeyExtractor>(self, key: K2) -> RateLimitLayer<St, K2, C, R> {
        self.rebuild(|_, cost, resolver| (key, cost, resolver))
    }

    /// Charges requests `cost` (default: 1 each).
    pub fn cost<C2: Cost>(self, cost: C2) -> RateLimitLayer<St, K, C2, R> {
        self.rebuild(|key, _, resolver| (key, cost, resolver))
    }

    /// Which rate-limit header fields to send (default: draft-11).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.headers.style = style;
        self
    }

    /// Adds `pk`, the partition key, to every `RateLimit` member (draft-11): an RFC 9651
    /// byte sequence of a keyed hash (HMAC-SHA-256) of the identity, never the identity,
    /// so a client with several identities can tell which budget a response speaks of.
    /// Off by default.
    ///
    /// The key is 32 random bytes drawn when this is called: no one can recover an identity from a
    /// small space (an IP address, a user number) by hashing guesses, but each process
    /// gives the same identity a different `pk`. Behind a load balancer, give every
    /// replica one secret with [`partition_key_secret`](Self::partition_key_secret).
    ///
    /// Below, two API keys get two `pk`s, each the same on every response, and neither
    /// spells the key it stands for:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::gcra("api", Rate::per_second(5), 5)?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .partition_key(true);
    /// let service = layer.layer(service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// }));
    /// // The `pk` parameter of the response's `RateLimit` member.
    /// let pk = |api_key: &str| {
    ///     let request = Request::get("/").header("x-api-key", api_key).body(()).unwrap();
    ///     let call = service.clone().oneshot(request);
    ///     async move {
    ///         let response = call.await.unwrap();
    ///         let field = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    ///         field.split_once(";pk=").map(|(_, pk)| pk.to_owned())
    ///     }
    /// };
    /// let alpha = pk("sk_live_alpha").await.expect("a pk");
    /// assert!(alpha.starts_with(':') && alpha.ends_with(':')); // a byte sequence
    /// assert!(!alpha.contains("alpha"));
    /// assert_eq!(pk("sk_live_alpha").await.unwrap(), alpha);
    /// assert_ne!(pk("sk_live_beta").await.unwrap(), alpha);
    ///
    /// // Off (the default): no `pk`.
    /// let plain = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::gcra("api", Rate::per_second(5), 5)?)
    ///     .partition_key(false)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let mut request = Request::get("/").body(())?;
    /// request.extensions_mut().insert(std::net::SocketAddr::from(([203, 0, 113, 7], 1)));
    /// let response = plain.oneshot(request).await?;
    /// assert!(!response.headers()["ratelimit"].to_str()?.contains("pk="));
    /// # Ok(()) }
    /// ```
    pub fn partition_key(mut self, enabled: bool) -> Self {
        if !enabled {
            self.headers.partition_key = None;
        } else if self.headers.partition_key.is_none() {
            // A secret given with `partition_key_secret` stays.
            self.headers.partition_key = Some(std::sync::Arc::new(
                crate::respond::headers::PartitionKeyer::random(),
            ));
        }
        self
    }

    /// Adds `pk` (see [`partition_key`](Self::partition_key)) keyed by `secret`, so every
    /// replica that shares the secret sends the same `pk` for an identity. Keep the secret
    /// like any other: at least 16 random bytes ([`validate`](Self::validate) refuses a
    /// shorter one, and building the layer panics on it); it is never logged or printed.
    ///
    /// Below, two replicas (two layers, each with a store of its own) that share a secret
    /// send one `pk` for one identity; a replica keyed at random sends another. A secret
    /// shorter than 16 bytes is refused.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let secret = vec![7u8; 32];
    /// // `secret`: 32 random bytes from your secret store, the same on every replica.
    /// let replica = || {
    ///     RateLimitLayer::new(MemoryStore::new())
    ///         .policy(Policy::gcra("api", Rate::per_second(5), 5).unwrap())
    ///         .key(HeaderKey::new("x-api-key"))
    /// };
    /// // The `pk` a replica sends for the API key `sk_live_alpha`.
    /// async fn pk(replica: RateLimitLayer<MemoryStore, HeaderKey, u64, PolicySet>) -> String {
    ///     let service = replica.layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    ///     let request = Request::get("/").header("x-api-key", "sk_live_alpha").body(()).unwrap();
    ///     let response = service.oneshot(request).await.unwrap();
    ///     let field = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    ///     field.split_once(";pk=").unwrap().1.to_owned()
    /// }
    /// let one = pk(replica().partition_key_secret(&secret)).await;
    /// let two = pk(replica().partition_key_secret(&secret)).await;
    /// assert_eq!(one, two);
    /// assert_ne!(pk(replica().partition_key(true)).await, one);
    ///
    /// assert!(replica().partition_key_secret(&secret).validate().is_ok());
    /// assert!(replica().partition_key_secret(b"too short").validate().is_err());
    /// # Ok(()) }
    /// ```
    pub fn partition_key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.headers.partition_key = Some(std::sync::Arc::new(
            crate::respond::headers::PartitionKeyer::new(secret.as_ref()),
        ));
        self
    }

    /// Adds a random delay of up to `jitter` (whole seconds) to `t` (or the draft-6 and
    /// legacy `Reset`) and `Retry-After` when they are a minute or longer, or end a
    /// fixed window that long, so clients told to come back when a long window ends do
    /// not all come back at once (draft-11, section 8.5), even those told in its last
    /// seconds. (A bucket's or sliding window's shorter times follow each client's own
    /// use: no herd.) `Retry-After` stays no earlier than the `t` of any policy that
    /// denies. Capped at a day. Off by default.
    ///
    /// Below, a daily window that ends in 86,400 seconds is stated to end up to 30
    /// seconds later, and the `429`'s `Retry-After` is no earlier than that `t`:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::fixed_window("daily", 2, Duration::from_secs(86_400))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .header_jitter(Duration::from_secs(30))
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    /// // The `t` of the `RateLimit` field, in seconds.
    /// let t = |response: &Response<Full<Bytes>>| -> u64 {
    ///     let field = response.headers()["ratelimit"].to_str().unwrap();
    ///     field.rsplit_once(";t=").unwrap().1.parse().unwrap()
    /// };
    /// for _ in 0..2 {
    ///     let admitted = service.clone().oneshot(request()).await?;
    ///     assert!((86_400..=86_430).contains(&t(&admitted)));
    /// }
    /// let denied = service.clone().oneshot(request()).await?;
    /// assert_eq!(denied.status(), 429);
    /// let retry_after: u64 = denied.headers()["retry-after"].to_str()?.parse()?;
    /// assert!((86_400..=86_430).contains(&t(&denied)));
    /// assert!(retry_after >= t(&denied));
    /// # Ok(()) }
    /// ```
    pub fn header_jitter(mut self, jitter: Duration) -> Self {
        // More than a day of jitter spreads nothing further; it only delays clients.
        self.headers.jitter = jitter.min(Duration::from_secs(86_400));
        self
    }

    /// Builds the deny response with `hook` instead of the default problem+json. The
    /// layer still adds the rate-limit headers, and, on a `429` or a `503`, `Retry-After`
    /// unless the hook set one that states a wait (delay-seconds or an HTTP-date, RFC 9110
    /// section 10.2.3): a value that is neither (`soon`, `1.5`, `+5`) is replaced by the
    /// layer's. So does a gRPC answer of `grpc-status` 8 or 14 whatever its HTTP status
    /// (tonic's `Status::resource_exhausted(..).into_http()` is a `200`): on a gRPC call
    /// the wait is sent on as the gRPC pushback too. A hook's answer of another status (a
    /// `403` for banned clients) gets no `Retry-After` of the layer's: it would tell the
    /// client to come back.
    ///
    /// Below, the hook answers a request of more than 5 units `403` (under a bucket of
    /// 10, one that could be admitted later) and others a plain
    /// `429` whose `Retry-After` states no wait (`soon`); the layer adds its fields to
    /// both, and its own `Retry-After` to the `429` only:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::cost;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rejection};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::token_bucket("api", 10, Rate::per_second(1))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(cost::from_fn(|parts| {
    ///         parts.headers.get("x-units").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1)
    ///     }))
    ///     .on_deny(|rejection: &Rejection<'_>| {
    ///         let status = if rejection.cost > 5 { StatusCode::FORBIDDEN } else { StatusCode::TOO_MANY_REQUESTS };
    ///         Response::builder()
    ///             .status(status)
    ///             .header("retry-after", "soon")
    ///             .body(Bytes::from_static(b"not now"))
    ///             .unwrap()
    ///     })
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let request = |units: u64| {
    ///     let request = Request::get("/").header("x-api-key", "k1").header("x-units", units);
    ///     request.body(()).unwrap()
    /// };
    /// assert_eq!(service.clone().oneshot(request(10)).await?.status(), StatusCode::OK);
    ///
    /// let throttled = service.clone().oneshot(request(1)).await?;
    /// assert_eq!(throttled.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(throttled.headers()["retry-after"], "1"); // the layer's, for "soon"
    /// assert_eq!(throttled.headers()["ratelimit"], "\"api\";r=0;t=1");
    ///
    /// let forbidden = service.clone().oneshot(request(8)).await?;
    /// assert_eq!(forbidden.status(), StatusCode::FORBIDDEN);
    /// assert_eq!(forbidden.headers()["retry-after"], "soon"); // the hook's, left alone
    /// assert!(forbidden.headers().contains_key("ratelimit"));
    /// # Ok(()) }
    /// ```
    pub fn on_deny<F>(mut self, hook: F) -> Self
    where
        F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.on_deny = Some(Arc::new(hook));
        self
    }

    /// What to do with a request that yields no key (default: [`MissingKey::Reject`]).
    ///
    /// ```
    /// use tollgate::key::ExtensionKey;
    /// use tollgate::{MemoryStore, MissingKey, Policy, Rate, RateLimitLayer};
    ///
    /// #[derive(Clone)]
    /// struct User { id: u64 }
    ///
    /// // Signed-in users are limited; anonymous requests (no `User`) go through unlimited.
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::gcra("user", Rate::per_second(10), 20)?)
    ///     .key(ExtensionKey::new("user", |user: &User| user.id.to_string()))
    ///     .on_missing_key(MissingKey::Allow);
    /// assert!(layer.validate().is_ok());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// Sent through such a layer (a limit of 1 an hour), anonymous requests all pass,
    /// without rate-limit fields, while a user's second request is refused; under the
    /// default, an anonymous request is a `500` (the extension is the server's to set):
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::ExtensionKey;
    /// use tollgate::{MemoryStore, MissingKey, Policy, Rate, RateLimitLayer};
    ///
    /// #[derive(Clone)]
    /// struct User { id: u64 }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = |missing_key: MissingKey| {
    ///     RateLimitLayer::new(MemoryStore::new())
    ///         .policy(Policy::token_bucket("user", 1, Rate::per_hour(1)).unwrap())
    ///         .key(ExtensionKey::new("user", |user: &User| user.id.to_string()))
    ///         .on_missing_key(missing_key)
    ///         .layer(service_fn(|_: Request<()>| async {
    ///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///         }))
    /// };
    /// let anonymous = || Request::get("/").body(()).unwrap();
    /// let signed_in = || {
    ///     let mut request = Request::get("/").body(()).unwrap();
    ///     request.extensions_mut().insert(User { id: 42 });
    ///     request
    /// };
    /// let allow = service(MissingKey::Allow);
    /// for _ in 0..3 {
    ///     let response = allow.clone().oneshot(anonymous()).await?;
    ///     assert_eq!(response.status(), StatusCode::OK);
    ///     assert!(!response.headers().contains_key("ratelimit"));
    /// }
    /// assert_eq!(allow.clone().oneshot(signed_in()).await?.status(), StatusCode::OK);
    /// assert_eq!(allow.oneshot(signed_in()).await?.status(), StatusCode::TOO_MANY_REQUESTS);
    ///
    /// let reject = service(MissingKey::Reject);
    /// assert_eq!(reject.oneshot(anonymous()).await?.status(), StatusCode::INTERNAL_SERVER_ERROR);
    /// # Ok(()) }
    /// ```
    pub fn on_missing_key(mut self, missing_key: MissingKey) -> Self {
        self.missing_key = missing_key;
        self
    }

    /// What to do when the store fails (default: [`FailureMode::Fallback`] to a local
    /// in-process limiter with the same policies).
    ///
    /// Below, the store is down. By default the local limiter holds the limit (a bucket of
    /// 2, then `429`); failing open lets every request through without rate-limit fields;
    /// failing closed answers `503`:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{DecideFuture, FailureMode, Key, Policy, PolicySet, Rate, RateLimitLayer};
    /// use tollgate::{Store, StoreError, StoreErrorKind};
    ///
    /// /// A store that is down.
    /// #[derive(Clone)]
    /// struct Down;
    ///
    /// impl Store for Down {
    ///     fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
    ///         DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unavailable, "connection refused")))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = RateLimitLayer::new(Down)
    ///     .policy(Policy::token_bucket("api", 2, Rate::per_hour(2))?)
    ///     .key(HeaderKey::new("x-api-key"));
    /// let inner = service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// });
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///
    /// let fallback = layer.clone().layer(inner.clone());
    /// let statuses = [
    ///     fallback.clone().oneshot(request()).await?.status(),
    ///     fallback.clone().oneshot(request()).await?.status(),
    ///     fallback.clone().oneshot(request()).await?.status(),
    /// ];
    /// assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    ///
    /// let open = layer.clone().on_store_error(FailureMode::FailOpen).layer(inner.clone());
    /// for _ in 0..3 {
    ///     let response = open.clone().oneshot(request()).await?;
    ///     assert_eq!(response.status(), StatusCode::OK);
    ///     assert!(!response.headers().contains_key("ratelimit"));
    /// }
    ///
    /// let closed = layer.on_store_error(FailureMode::FailClosed).layer(inner);
    /// assert_eq!(closed.oneshot(request()).await?.status(), StatusCode::SERVICE_UNAVAILABLE);
    /// # Ok(()) }
    /// ```
    pub fn on_store_error(mut self, failure_mode: FailureMode) -> Self {
        self.failure_mode = failure_mode;
        self
    }

    /// How long a store may take to decide before it counts as failed (default 50 ms).
    /// Only stores that do I/O are timed. Zero is refused when the layer is built. A store
    /// doing I/O has timeouts of its own: the Redis store's connection gives up on an
    /// answer after 500 ms (1 s on a Cluster or behind Sentinel), so a longer timeout
    /// here waits no longer than that.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// // With Redis, above three round trips (a Cluster's redirect, a coalesced batch).
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
    ///     .store_timeout(Duration::from_millis(150));
    /// assert!(layer.validate().is_ok());
    /// assert!(layer.store_timeout(Duration::ZERO).validate().is_err());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// When to stop calling a failing store and when to probe it again (default: open
    /// after 5 failures in a row, probe every second). A cool-down longer than
    /// [`MAX_PERIOD`](crate::policy::MAX_PERIOD) is refused when the layer is built.
    ///
    /// Below, a store that is down is called for the first 3 requests only: then the
    /// breaker is open, and the next requests go to the failure mode (here the local
    /// fallback, which admits them) without a call. A cool-down past `MAX_PERIOD` is
    /// refused.
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
    /// use tollgate::policy::MAX_PERIOD;
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
    ///         DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unavailable, "refused")))
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let down = Down::default();
    /// let layer = RateLimitLayer::new(down.clone())
    ///     .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .circuit_breaker(CircuitBreaker::new(3, Duration::from_millis(500)));
    /// assert!(layer.validate().is_ok());
    /// let service = layer.layer(service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// }));
    /// for _ in 0..8 {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(())?;
    ///     assert_eq!(service.clone().oneshot(request).await?.status(), StatusCode::OK);
    /// }
    /// assert_eq!(down.0.load(Ordering::Relaxed), 3);
    ///
    /// let never = RateLimitLayer::new(Down::default())
    ///     .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
    ///     .circuit_breaker(CircuitBreaker::new(3, MAX_PERIOD + Duration::from_secs(1)));
    /// assert!(never.validate().is_err());
    /// # Ok(()) }
    /// ```
    pub fn circuit_breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.breaker = Arc::new(Breaker::new(breaker));
        self
    }

    /// Settles each admitted request's cost once its response head is known: the cost
    /// debited on admission is a reservation, and the store gives back or charges the
    /// difference to the actual cost `settle` reads from the response, atomically (past
    /// empty if need be: the excess is owed). The response's rate-limit headers show the
    /// settled state. See [`crate::settle`].
    ///
    /// Here each request reserves 10 rows of a bucket of 100 (one row back every 36 s),
    /// and the handler reports 150: the first response shows the bucket empty, the 50
    /// past it owed, and the next request waits until the owed 50 and its own 10 have
    /// refilled (60 rows, 2,160 s):
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::settle::Settle;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::token_bucket("rows", 100, Rate::per_hour(100))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(10)
    ///     .settle(Settle::from_header("x-rows"))
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         let mut response = Response::new(Full::new(Bytes::new()));
    ///         response.headers_mut().insert("x-rows", 150.into());
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let call = || {
    ///     let request = Request::get("/export").header("x-api-key", "team-a").body(()).unwrap();
    ///     service.clone().oneshot(request)
    /// };
    /// let first = call().await?;
    /// assert_eq!(first.status(), StatusCode::OK);
    /// assert_eq!(first.headers()["ratelimit"], "\"rows\";r=0;t=1836");
    /// let next = call().await?;
    /// assert_eq!(next.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(next.headers()["retry-after"], "2160");
    /// # Ok(()) }
    /// ```
    pub fn settle(mut self, settle: Settle) -> Self {
        self.settle = Some(settle);
        self
    }

    /// Lets the requests `bypass` allows skip limiting: not decided, nothing spent, no
    /// rate-limit headers; counted in `tollgate_bypassed_total`. See [`crate::bypass`].
    ///
    /// Below, under a limit of one request a minute, health checks skip: any number of
    /// them spends nothing, and the one request the minute allows is still there after
    /// them.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::fixed_window("api", 1, Duration::from_secs(60))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .bypass(Bypass::new().when(|parts| parts.uri.path() == "/healthz"))
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let request = |path: &str| Request::get(path).header("x-api-key", "k1").body(()).unwrap();
    /// for _ in 0..3 {
    ///     let health = service.clone().oneshot(request("/healthz")).await?;
    ///     assert_eq!(health.status(), StatusCode::OK);
    ///     assert!(!health.headers().contains_key("ratelimit"));
    /// }
    /// let first = service.clone().oneshot(request("/orders")).await?;
    /// assert_eq!(first.headers()["ratelimit"], "\"api\";r=0;t=60");
    /// let second = service.clone().oneshot(request("/orders")).await?;
    /// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    /// # Ok(()) }
    /// ```
    pub fn bypass(mut self, bypass: Bypass) -> Self {
        self.bypass = Some(bypass);
        self
    }

    /// Runs the whole layer in shadow (dry-run) mode: every request is decided and
    /// debited as usual, none is denied, and what would have been denied is reported (the
    /// metric outcome `shadow_denied`, a `tracing` event). No rate-limit headers are sent
    /// unless [`shadow_headers`](Self::shadow_headers) asks for them. The layer's policies
    /// keep their usual rate state (use [`Policy::shadow`] for a policy with state of its
    /// own beside real ones); their penalties are not applied: the layer's clients were
    /// never slowed down, so its denials would not all have come under enforcement, and a
    /// block they started would greet them when the layer starts enforcing.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // What would a limit of 100 per minute do to today's traffic?
    /// let trial = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::sliding_window("trial", 100, std::time::Duration::from_secs(60))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .shadow(true)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// // Three times the limit: none is denied, and none is told of the limit.
    /// for _ in 0..300 {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(())?;
    ///     let response = trial.clone().oneshot(request).await?;
    ///     assert_eq!(response.status(), StatusCode::OK);
    ///     assert!(!response.headers().contains_key("ratelimit"));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// Lists shadow policies ([`Policy::shadow`]) in the rate-limit headers too, and lets a
    /// shadow layer send headers (default: off; a limit not enforced is not advertised).
    /// In draft-11 each is a member of its own, which a client that paces itself by the
    /// fields obeys as it obeys the others (its `r=0` holds such a client back): turn it
    /// on to announce a limit to come. The single-valued styles (draft-6, legacy) state
    /// an enforced policy's numbers whenever the set has one.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// // Tell clients about next month's limit before it is enforced.
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
    ///     .policy(Policy::fixed_window("api-v2", 500, Duration::from_secs(60))?.shadow())
    ///     .shadow_headers(true);
    /// assert!(layer.validate().is_ok());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    ///
    /// Sent through such a layer, a response lists the shadow policy beside the enforced
    /// one; at its `r=0` the request is still admitted. Without `shadow_headers`, only
    /// the enforced policy is listed:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = |shown: bool| {
    ///     RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///         .policy(Policy::gcra("api", Rate::per_second(10), 20).unwrap())
    ///         .policy(Policy::fixed_window("api-v2", 1, Duration::from_secs(60)).unwrap().shadow())
    ///         .key(HeaderKey::new("x-api-key"))
    ///         .shadow_headers(shown)
    ///         .layer(service_fn(|_: Request<()>| async {
    ///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///         }))
    /// };
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///
    /// let shown = service(true);
    /// let first = shown.clone().oneshot(request()).await?;
    /// assert_eq!(first.headers()["ratelimit-policy"], "\"api\";q=20;w=2, \"api-v2\";q=1;w=60");
    /// assert_eq!(first.headers()["ratelimit"], "\"api\";r=19;t=1, \"api-v2\";r=0;t=60");
    /// let second = shown.oneshot(request()).await?;
    /// assert_eq!(second.status(), StatusCode::OK); // api-v2 is not enforced yet
    ///
    /// let hidden = service(false).oneshot(request()).await?;
    /// assert_eq!(hidden.headers()["ratelimit-policy"], "\"api\";q=20;w=2");
    /// # Ok(()) }
    /// ```
    pub fn shadow_headers(mut self, shown: bool) -> Self {
        self.headers.shadow = shown;
        self
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }
}

/// The set-up mistake of a debit adjusted through a store that cannot adjust.
const CANNOT_ADJUST: &str = "RateLimitLayer: {what} through the store's adjust \
    (Store::adjust), and this store cannot adjust (Store::can_adjust is false): a store \
    that wraps another must forward adjust and can_adjust";

impl<St: Store, K, C, R: PolicyResolver> RateLimitLayer<St, K, C, R> {
    /// Checks the set-up without building a service: at least one policy, no policy
    /// replaced by one of its name in the other mode (see [`policy`](Self::policy)),
    /// every policy set known ahead a valid set (shadow policies among the first 52,
    /// shaping ones among the first 64) that
    /// the store can decide exactly ([`Store::validate`]), and a store that can adjust a
    /// debit ([`Store::can_adjust`]) when the layer settles costs or a set has an
    /// in-flight limit. [`layer`](Layer::layer) runs the same check and panics on a
    /// failure; call this first to handle it yourself.
    ///
    /// ```
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?);
    /// assert!(layer.validate().is_ok());
    /// // An empty set passes the types, but not the check.
    /// let empty = RateLimitLayer::new(MemoryStore::new()).policies(PolicySet::unlimited());
    /// assert!(empty.validate().is_err());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn validate(&self) -> Result<(), String> {
        if let Some(mistake) = &self.mistake {
            return Err(mistake.to_string());
        }
        if let FailureMode::Fallback(fallback) = &self.failure_mode {
            fallback
                .check()
                .map_err(|mistake| format!("RateLimitLayer: {mistake}"))?;
        }
        self.resolver.check_configured().map_err(str::to_owned)?;
        if self.breaker.cool_down() > MAX_PERIOD {
            return Err(format!(
                "RateLimitLayer: the circuit breaker's cool-down of {:?} is longer than \
                 MAX_PERIOD (about ten years): once open, the breaker would never probe the \
                 store again; use a cool-down of seconds (default 1 s)",
                self.breaker.cool_down()
            ));
        }
        if self.store_timeout.is_zero() {
            return Err(
                "RateLimitLayer: the store timeout is zero, so every decision of a \
                 store that does I/O would fail: give it the time the store needs (default \
                 50 ms)"
                    .to_owned(),
            );
        }
        if let Some(keyer) = &self.headers.partition_key
            && keyer.secret_len() < crate::respond::headers::MIN_PARTITION_SECRET
        {
            return Err(format!(
                "RateLimitLayer: the partition key secret is {} bytes; use at least {} \
                     random bytes, or a guessable pk is as good as the identity",
                keyer.secret_len(),
                crate::respond::headers::MIN_PARTITION_SECRET
            ));
        }
        // Settling and in-flight slots are adjustments of the debit: a store that cannot
        // make them (a wrapper forwarding only `decide`) would never settle a cost nor
        // free a slot.
        let can_adjust = self.store.can_adjust();
        if self.settle.is_some() && !can_adjust {
            return Err(CANNOT_ADJUST.replace("{what}", "settle(...) settles costs"));
        }
        for set in self.resolver.known_sets() {
            // A set grown one `.policy()` at a time passes the checks a whole set does
            // (shadow policies among the first 52, shaping ones among the first 64).
            set.check()
                .map_err(|error| format!("RateLimitLayer: {error}"))?;
            self.store.validate(&set).map_err(|error| {
                format!("RateLimitLayer: the store cannot decide these policies: {error}")
            })?;
            if !can_adjust
                && let Some(policy) = set.iter().find(|policy| policy.params().is_in_flight())
            {
                let what = format!("the in-flight limit \"{}\" frees slots", policy.name());
                return Err(CANNOT_ADJUST.replace("{what}", &what));
            }
        }
        Ok(())
    }
}

impl<S, St, K, C, R> Layer<S> for RateLimitLayer<St, K, C, R>
where
    St: Store + Clone,
    K: KeyExtractor + Clone,
    C: Cost + Clone,
    R: PolicyResolver + Clone,
{
    type Service = RateLimit<S, St, K, C, R>;

    /// Wraps `inner`.
    ///
    /// # Panics
    ///
    /// When [`validate`](RateLimitLayer::validate) fails (its error is the message): the
    /// layer has a fixed policy set and it is empty (a limiter that limits nothing is a
    /// set-up mistake); two `.policy()` calls named two policies alike, or an enforced
    /// policy and a shadow one; a set is not a valid one; the store cannot decide one of
    /// its policies exactly, or cannot adjust a debit the layer settles or an in-flight
    /// limit frees; the store timeout is zero; the breaker's cool-down is longer than
    /// [`MAX_PERIOD`](crate::policy::MAX_PERIOD); the fallback's share is out of range; or
    /// a partition-key secret is shorter than 16 bytes. Reported when the app is built,
    /// never on the first request.
    fn layer(&self, inner: S) -> Self::Service {
        match self.service_config() {
            Ok(config) => RateLimit::new(inner, config),
            Err(message) => panic!("{message}"),
        }
    }
}

impl<St, K, C, R> RateLimitLayer<St, K, C, R>
where
    St: Store + Clone,
    K: KeyExtractor + Clone,
    C: Cost + Clone,
    R: PolicyResolver + Clone,
{
    /// The checked configuration every service of this layer shares.
    pub(crate) fn service_config(&self) -> Result<Arc<Config<St, K, C, R>>, String> {
        self.validate()?;
        if self
            .bypass
            .as_ref()
            .is_some_and(|bypass| bypass.reads_the_peer_by_default())
            && self
                .key
                .client_ip()
                .is_none_or(crate::key::ClientIp::reads_the_peer)
            && !self
                .said_peer_bypass
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                "the bypass's networks are matched against the socket peer (the key trusts \
                 no proxy to name the client, and the bypass was not told how to find it): \
                 behind a proxy or load balancer in an allowed network, every request skips \
                 limiting; give the bypass .client_ip(ClientIp::behind_proxies(..))"
            );
        }
        Ok(Arc::new(Config {
            store: self.store.clone(),
            key: self.key.clone(),
            cost: self.cost.clone(),
            resolver: self.resolver.clone(),
            missing_key: self.missing_key,
            said_missing: Arc::clone(&self.said_missing),
            bypass: self
                .bypass
                .clone()
                .map(|bypass| bypass.or_client_ip(self.key.client_ip())),
            marks_cost: self.cost.reads_request_cost(),
            responder: Arc::new(Responder {
                headers: self.headers.clone(),
                settle: self.settle.clone(),
                shadow: self.shadow,
                on_deny: self.on_deny.clone(),
                failure_mode: self.failure_mode.clone(),
                breaker: Arc::clone(&self.breaker),
                timeout: self.store_timeout,
                dropped: Arc::clone(&self.dropped),
            }),
        }))
    }

    /// This layer sharing `breaker` (a reloaded configuration keeps the breaker's state).
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn with_breaker(mut self, breaker: Arc<Breaker>) -> Self {
        self.breaker = breaker;
        self
    }

    /// This layer sharing `dropped` (a reloaded configuration keeps the places of the
    /// requests dropped during their shaping delay under the one before).
    #[cfg_attr(not(feature = "config"), allow(dead_code))]
    pub(crate) fn with_dropped(mut self, dropped: Arc<crate::settle::DroppedBookings>) -> Self {
        self.dropped = dropped;
        self
    }
}
