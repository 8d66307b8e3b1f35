//! Requests that skip limiting: an allowlist of client networks, of keys, or a predicate
//! over the request.
//!
//! A bypassed request is not decided, spends nothing, gets no rate-limit headers (it was
//! not limited, so no numbers would be true), and is counted in the metric
//! `tollgate_bypassed_total` (feature `metrics`) by reason: `network`, `key` or
//! `predicate`.
//!
//! The example puts a limit of one request an hour behind a load balancer (10.0.0.1)
//! and lets three kinds of request skip it: the health check, the monitoring token, and
//! the office network (which needs no key at all). None of them is decided: the store
//! holds no state afterwards, and none gets a rate-limit field. A customer's key is
//! limited as usual.
//!
//! ```
//! use std::convert::Infallible;
//! use std::net::SocketAddr;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Layer, ServiceExt, service_fn};
//! use tollgate::bypass::Bypass;
//! use tollgate::key::{ClientIp, HeaderKey};
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let api_key = HeaderKey::new("x-api-key");
//! let bypass = Bypass::new()
//!     .network("10.0.0.0/8")                                  // the office and the fleet
//!     .network("::1")
//!     // The key reads no address: say how to find the client behind the load balancer,
//!     // or every request through it (an address in 10.0.0.0/8) would skip.
//!     .client_ip(ClientIp::behind_proxies(["10.0.0.1"])?)
//!     .key(api_key.key_for("monitoring-token")?)              // as the extractor spells it
//!     .when(|parts| parts.uri.path() == "/healthz");
//! let store = MemoryStore::new();
//! let service = RateLimitLayer::new(store.clone())
//!     .policy(Policy::token_bucket("api", 1, Rate::per_hour(1))?)
//!     .key(api_key)
//!     .bypass(bypass)
//!     .layer(service_fn(|_: Request<()>| async {
//!         Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
//!     }));
//!
//! // Every request comes through the load balancer, which names the client.
//! let call = |path: &str, key: Option<&str>, client: &str| {
//!     let mut request = Request::get(path).header("x-forwarded-for", client);
//!     if let Some(key) = key {
//!         request = request.header("x-api-key", key);
//!     }
//!     let mut request = request.body(()).unwrap();
//!     request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 1], 443)));
//!     service.clone().oneshot(request)
//! };
//! let skipped = [
//!     call("/healthz", None, "203.0.113.7").await?,                // the predicate
//!     call("/orders", Some("monitoring-token"), "203.0.113.7").await?,
//!     call("/orders", Some("monitoring-token"), "203.0.113.7").await?, // again: not spent
//!     call("/orders", None, "10.20.30.40").await?,                  // the office: no key needed
//! ];
//! for response in &skipped {
//!     assert_eq!(response.status(), StatusCode::OK);
//!     assert!(!response.headers().contains_key("ratelimit"));
//!     assert!(!response.headers().contains_key("ratelimit-policy"));
//! }
//! assert!(store.is_empty()); // nothing was decided, so nothing is held
//!
//! // A customer is limited: one request, with its numbers, then a 429.
//! let first = call("/orders", Some("customer-key"), "203.0.113.7").await?;
//! assert_eq!(first.status(), StatusCode::OK);
//! assert!(first.headers()["ratelimit"].to_str()?.starts_with("\"api\";r=0;"));
//! let second = call("/orders", Some("customer-key"), "203.0.113.7").await?;
//! assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(store.len(), 1);
//! # Ok(()) }
//! ```

use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use ipnet::IpNet;

use crate::key::{ClientIp, Key, KeyError};

/// Why a request skipped limiting: the `reason` label of the metric
/// `tollgate_bypassed_total` (feature `metrics`), as [`as_str`](Self::as_str) spells it.
///
/// ```
/// use tollgate::bypass::BypassReason;
///
/// let reasons = [BypassReason::Network, BypassReason::Key, BypassReason::Predicate];
/// assert_eq!(reasons.map(BypassReason::as_str), ["network", "key", "predicate"]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BypassReason {
    /// The client address is in an allowed network.
    Network,
    /// The request's key is allowed.
    Key,
    /// The predicate said so.
    Predicate,
}

impl BypassReason {
    /// The metric label: `network`, `key` or `predicate`.
    ///
    /// ```
    /// use tollgate::bypass::BypassReason;
    ///
    /// assert_eq!(BypassReason::Key.as_str(), "key");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            BypassReason::Network => "network",
            BypassReason::Key => "key",
            BypassReason::Predicate => "predicate",
        }
    }
}

/// An allowlist: client networks, keys and a predicate, any of which lets a request skip
/// limiting. See the [module docs](self).
///
/// A request from an allowed network skips, and so does one the predicate allows; one
/// that matches neither is decided:
///
/// ```
/// use std::convert::Infallible;
/// use std::net::SocketAddr;
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::bypass::Bypass;
/// use tollgate::{MemoryStore, Policy, RateLimitLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let bypass = Bypass::new()
///     .network("192.0.2.0/24")
///     .when(|parts| parts.uri.path() == "/healthz");
/// let service = RateLimitLayer::new(MemoryStore::new()) // keyed by the socket peer
///     .policy(Policy::fixed_window("api", 100, Duration::from_secs(60))?)
///     .bypass(bypass)
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///     }));
/// // Was the request limited? Only a decided request gets rate-limit fields.
/// let limited = |path: &str, peer: [u8; 4]| {
///     let mut request = Request::get(path).body(()).unwrap();
///     request.extensions_mut().insert(SocketAddr::from((peer, 40000)));
///     let call = service.clone().oneshot(request);
///     async move { call.await.unwrap().headers().contains_key("ratelimit") }
/// };
/// assert!(!limited("/orders", [192, 0, 2, 10]).await); // the network
/// assert!(!limited("/healthz", [203, 0, 113, 7]).await); // the predicate
/// assert!(limited("/orders", [203, 0, 113, 7]).await); // neither
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Bypass {
    networks: Vec<IpNet>,
    client_ip: Option<ClientIp>,
    keys: HashSet<Key>,
    when: Option<Arc<Predicate>>,
    /// Set once this allowlist (and its clones: one layer's routes) has said that its
    /// networks can read no client address.
    said_unread: Arc<std::sync::atomic::AtomicBool>,
}

type Predicate = dyn Fn(&Parts) -> bool + Send + Sync;

impl fmt::Debug for Bypass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bypass")
            .field("networks", &self.networks)
            .field("keys", &self.keys.len())
            .field("predicate", &self.when.is_some())
            .finish()
    }
}

impl Bypass {
    /// An empty allowlist: nothing skips.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::net::SocketAddr;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::fixed_window("api", 100, Duration::from_secs(60))?)
    ///     .bypass(Bypass::new())
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let mut request = Request::get("/healthz").body(())?;
    /// request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 1], 40000)));
    /// let response = service.oneshot(request).await?;
    /// assert!(response.headers().contains_key("ratelimit")); // decided as any other
    /// # Ok(()) }
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests from `network` (`10.0.0.0/8`, `2001:db8::/32`, or one address) skip.
    /// Clients are compared in canonical form (an IPv4-mapped IPv6 address is IPv4), so
    /// an IPv4-mapped block stands for the IPv4 block inside it (`::ffff:10.0.0.0/104` is
    /// `10.0.0.0/8`), as in [`ClientIp::behind_proxies`].
    ///
    /// # Panics
    ///
    /// If `network` is neither a network nor an address, or holds every address (`0.0.0.0/0`,
    /// `::/0`: nothing would be limited): a programming error caught at
    /// start-up. [`try_network`](Self::try_network) returns the error instead.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::net::SocketAddr;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let bypass = Bypass::new().network("::ffff:10.0.0.0/104"); // 10.0.0.0/8
    /// let service = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::fixed_window("api", 100, Duration::from_secs(60))?)
    ///     .bypass(bypass)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// // Was the request limited? Only a decided request gets rate-limit fields.
    /// let limited = |path: &str, peer: [u8; 4]| {
    ///     let mut request = Request::get(path).body(()).unwrap();
    ///     request.extensions_mut().insert(SocketAddr::from((peer, 40000)));
    ///     let call = service.clone().oneshot(request);
    ///     async move { call.await.unwrap().headers().contains_key("ratelimit") }
    /// };
    /// assert!(!limited("/", [10, 1, 2, 3]).await);
    /// assert!(limited("/", [11, 1, 2, 3]).await);
    /// # Ok(()) }
    /// ```
    ///
    /// A network that holds every address is refused, and so is one written with host
    /// bits set past its prefix (`10.0.0.5/8`: a typo for one address, almost always):
    ///
    /// ```should_panic
    /// use tollgate::bypass::Bypass;
    ///
    /// let _ = Bypass::new().network("0.0.0.0/0");
    /// ```
    pub fn network(self, network: &str) -> Self {
        self.try_network(network)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// Like [`network`](Self::network), for networks read from configuration.
    ///
    /// ```
    /// use tollgate::bypass::Bypass;
    ///
    /// assert!(Bypass::new().try_network("192.0.2.0/24").is_ok());
    /// assert!(Bypass::new().try_network("192.0.2.0/33").is_err());
    /// assert!(Bypass::new().try_network("192.0.2.7/24").is_err()); // host bits
    /// assert!(Bypass::new().try_network("192.0.2.7").is_ok()); // one address
    /// ```
    pub fn try_network(mut self, network: &str) -> Result<Self, String> {
        // Compared with clients in canonical form: an IPv4-mapped block is its IPv4 one.
        let net = crate::key::read_network(network).map_err(|why| match why {
            crate::key::NetError::NotANetwork => {
                format!("Bypass: {network:?} is not a network (such as 10.0.0.0/8) or an address")
            }
            crate::key::NetError::Everything => {
                format!("Bypass: {network:?} holds every address: every client would skip limiting")
            }
            host_bits => format!("Bypass: {network:?} {host_bits}"),
        })?;
        self.networks.push(net);
        Ok(self)
    }

    /// How the client address is found for [`network`](Self::network). By default, as the
    /// layer's key finds it when the key reads one (a `ClientIp`, or an `or` chain with
    /// one), else the socket peer ([`ClientIp::peer`]).
    ///
    /// Here the key is an API key, which reads no address, and every request comes
    /// through a load balancer at 10.0.0.1, inside the allowed network. Read from the
    /// socket peer, the load balancer's address lets a customer outside skip; read as
    /// the load balancer names the client, the customer is limited:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::net::SocketAddr;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::key::{ClientIp, HeaderKey};
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = Policy::fixed_window("api", 100, Duration::from_secs(60))?;
    /// let layer = |bypass: Bypass| {
    ///     RateLimitLayer::new(MemoryStore::new())
    ///         .policy(policy.clone())
    ///         .key(HeaderKey::new("x-api-key"))
    ///         .bypass(bypass)
    ///         .layer(service_fn(|_: Request<()>| async {
    ///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///         }))
    /// };
    /// let office = Bypass::new().network("10.0.0.0/8");
    /// let by_peer = layer(office.clone());
    /// let by_proxy = layer(office.client_ip(ClientIp::behind_proxies(["10.0.0.1"])?));
    ///
    /// let customer = || {
    ///     let mut request = Request::get("/")
    ///         .header("x-api-key", "customer-key")
    ///         .header("x-forwarded-for", "203.0.113.7")
    ///         .body(())
    ///         .unwrap();
    ///     request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 1], 443)));
    ///     request
    /// };
    /// let skipped = by_peer.oneshot(customer()).await?;
    /// assert!(!skipped.headers().contains_key("ratelimit"));
    /// let limited = by_proxy.oneshot(customer()).await?;
    /// assert!(limited.headers().contains_key("ratelimit"));
    /// # Ok(()) }
    /// ```
    pub fn client_ip(mut self, client_ip: ClientIp) -> Self {
        self.client_ip = Some(client_ip);
        self
    }

    /// True when it has networks and was not told how to find the client's address: the
    /// layer's key's way then, or the socket peer.
    pub(crate) fn reads_the_peer_by_default(&self) -> bool {
        !self.networks.is_empty() && self.client_ip.is_none()
    }

    /// This bypass, reading the client's address as `client_ip` does unless it was told
    /// how ([`client_ip`](Self::client_ip)): the layer gives it its key's.
    pub(crate) fn or_client_ip(mut self, client_ip: Option<&ClientIp>) -> Self {
        if self.client_ip.is_none() {
            self.client_ip = client_ip.cloned();
        }
        self
    }

    /// Requests whose key (as the layer's key extractor gives it) is `key` skip. API keys
    /// are hashed (and salted) by their extractor: spell them as it does, with
    /// [`HeaderKey::key_for`](crate::key::HeaderKey::key_for).
    ///
    /// A request skips by presenting the key, before any authentication behind the
    /// limiter: allowlist only keys that are secrets (a whole API key or credential),
    /// never an identity anyone can name (a user id, a
    /// [`basic_user_id`](crate::key::HeaderKey::basic_user_id) key: any password would
    /// then skip).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let api_key = HeaderKey::new("x-api-key");
    /// let service = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::fixed_window("api", 100, Duration::from_secs(60))?)
    ///     .bypass(Bypass::new().key(api_key.key_for("monitoring-token")?))
    ///     .key(api_key)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let limited = |token: &str| {
    ///     let request = Request::get("/").header("x-api-key", token).body(()).unwrap();
    ///     let call = service.clone().oneshot(request);
    ///     async move { call.await.unwrap().headers().contains_key("ratelimit") }
    /// };
    /// assert!(!limited("monitoring-token").await);
    /// assert!(limited("customer-token").await);
    /// # Ok(()) }
    /// ```
    pub fn key(mut self, key: Key) -> Self {
        self.keys.insert(key);
        self
    }

    /// Requests for which `predicate` is true skip (health checks, internal routes). Each
    /// call adds one: a request skips when any of them is true.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::net::SocketAddr;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::bypass::Bypass;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let bypass = Bypass::new()
    ///     .when(|parts| parts.uri.path() == "/healthz")
    ///     .when(|parts| parts.uri.path().starts_with("/internal/"));
    /// let service = RateLimitLayer::new(MemoryStore::new())
    ///     .policy(Policy::fixed_window("api", 100, Duration::from_secs(60))?)
    ///     .bypass(bypass)
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// // Was the request limited? Only a decided request gets rate-limit fields.
    /// let limited = |path: &str, peer: [u8; 4]| {
    ///     let mut request = Request::get(path).body(()).unwrap();
    ///     request.extensions_mut().insert(SocketAddr::from((peer, 40000)));
    ///     let call = service.clone().oneshot(request);
    ///     async move { call.await.unwrap().headers().contains_key("ratelimit") }
    /// };
    /// assert!(!limited("/healthz", [203, 0, 113, 7]).await);
    /// assert!(!limited("/internal/metrics", [203, 0, 113, 7]).await);
    /// assert!(limited("/orders", [203, 0, 113, 7]).await);
    /// # Ok(()) }
    /// ```
    pub fn when<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.when = Some(match self.when.take() {
            Some(earlier) => Arc::new(move |parts: &Parts| earlier(parts) || predicate(parts)),
            None => Arc::new(predicate),
        });
        self
    }

    /// True the first time this allowlist (or a clone: one layer's routes) reads no
    /// client address for want of one the server should record: said once, counted
    /// every time.
    #[cold]
    pub(crate) fn first_unread(&self) -> bool {
        use std::sync::atomic::Ordering;
        !self.said_unread.load(Ordering::Relaxed) && !self.said_unread.swap(true, Ordering::Relaxed)
    }

    /// Does the request skip, before its key is known? (A network or the predicate: a
    /// request allowed by network needs no key at all.) `Err` when a network bypass can
    /// read no client address because the server records none: the request is decided,
    /// and the caller says why no network let it through.
    pub(crate) fn before_key(&self, parts: &Parts) -> Result<Option<BypassReason>, KeyError> {
        if let Some(predicate) = &self.when
            && predicate(parts)
        {
            return Ok(Some(BypassReason::Predicate));
        }
        if !self.networks.is_empty() {
            // A client a trusted proxy hid is no address on the allowlist, though the
            // key falls back to the proxy's.
            let address = match &self.client_ip {
                Some(client) => client.named_client_addr(parts),
                None => {
                    static PEER: std::sync::LazyLock<ClientIp> =
                        std::sync::LazyLock::new(ClientIp::peer);
                    PEER.named_client_addr(parts)
                }
            };
            match address {
                Ok(Some(address)) => {
                    let address = canonical(address);
                    if self.networks.iter().any(|net| net.contains(&address)) {
                        return Ok(Some(BypassReason::Network));
                    }
                }
                // No address recorded at all (the server's set-up): said, not skipped
                // over in silence. A client's malformed forwarding header is the
                // client's, and the key says it if it reads one.
                Err(error) if error.kind() == crate::key::KeyErrorKind::Server => {
                    return Err(error);
                }
                Ok(None) | Err(_) => {}
            }
        }
        Ok(None)
    }

    /// Does the request skip, by its key?
    pub(crate) fn by_key(&self, key: &Key) -> Option<BypassReason> {
        self.keys.contains(key).then_some(BypassReason::Key)
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack socket reports
/// IPv4 clients so).
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}
