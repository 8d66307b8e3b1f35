//! After the response: settling a reserved cost to the actual one, refunds by outcome,
//! and giving back in-flight slots.
//!
//! A request's cost is debited when it is admitted: an estimate (a reservation), so that
//! concurrent requests cannot overspend. With [`Settle`] the layer settles it once the
//! response head is known: the difference is given back or charged, atomically, in the
//! same store, and the response's own rate-limit headers show the settled state. Requests
//! under an in-flight limit ([`Policy::concurrency`](crate::Policy::concurrency)) give their
//! slot back when the response body has been sent or dropped.
//!
//! Below, a language model's gateway reserves each request's estimate and settles it to
//! the tokens the model reports. A request that used less than it reserved is refunded
//! the rest, one that used more is charged the excess, and one the model's outage failed
//! costs nothing; each response's `RateLimit` field (`r`) shows the settled state:
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Layer, ServiceExt, service_fn};
//! use tollgate::clock::ManualClock;
//! use tollgate::cost::{FromExtension, RequestCost};
//! use tollgate::key::HeaderKey;
//! use tollgate::settle::Settle;
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Reserve the request's estimate (set by earlier middleware as a `RequestCost`),
//! // settle to the handler's `x-tokens-used`, and refund an upstream outage in full (not
//! // any 5xx: a client that can crash the handler must not get that for free).
//! let layer = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
//!     .policy(Policy::token_bucket("tokens", 1_000, Rate::per_minute(1_000))?)
//!     .key(HeaderKey::new("x-api-key"))
//!     .cost(FromExtension::or(1))
//!     .settle(Settle::from_header("x-tokens-used").refund_if(|status: StatusCode| {
//!         status == StatusCode::BAD_GATEWAY || status == StatusCode::SERVICE_UNAVAILABLE
//!     }));
//! // A stand-in for the model: it reports the tokens the request says it used (`x-used`),
//! // or answers 503 as an upstream outage would.
//! let model = service_fn(|request: Request<()>| async move {
//!     let mut response = Response::new(Full::new(Bytes::new()));
//!     match request.headers().get("x-used") {
//!         Some(used) => {
//!             response.headers_mut().insert("x-tokens-used", used.clone());
//!         }
//!         None => *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE,
//!     }
//!     Ok::<_, Infallible>(response)
//! });
//! let service = layer.layer(model);
//! let call = |reserve: u64, used: Option<u64>| {
//!     let mut request = Request::post("/v1/complete").header("x-api-key", "team-a");
//!     if let Some(used) = used {
//!         request = request.header("x-used", used);
//!     }
//!     let mut request = request.body(()).unwrap();
//!     request.extensions_mut().insert(RequestCost(reserve));
//!     service.clone().oneshot(request)
//! };
//!
//! // Reserved 400, used 100: the 300 left over are given back.
//! let refunded = call(400, Some(100)).await?;
//! assert_eq!(refunded.headers()["ratelimit"], "\"tokens\";r=900;t=1");
//! // Reserved 100, used 250: the 150 past the reservation are charged.
//! let charged = call(100, Some(250)).await?;
//! assert_eq!(charged.headers()["ratelimit"], "\"tokens\";r=650;t=1");
//! // Reserved 500, and the model was down: nothing is spent.
//! let outage = call(500, None).await?;
//! assert_eq!(outage.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(outage.headers()["ratelimit"], "\"tokens\";r=650;t=1");
//! # Ok(()) }
//! ```
//!
//! **When it happens.** Settling happens when the inner service has produced the response
//! head, before the response leaves the layer (with Redis, one more script call on that
//! path). A streamed body is not waited for: its cost must be known from the head (a
//! header, or an extension the handler set). A request that gets no head (dropped while
//! the handler ran, or the inner service failed) keeps its reservation; a dropped one is
//! charged more when [`Settle::if_dropped`] says so. In-flight slots are freed when the body ends
//! or is dropped, so a long stream holds its slot to the end.
//!
//! **What is exact.** A settle gives back only what the state still holds: a fixed or
//! sliding window that has moved on is not reopened, a bucket is never filled above full;
//! in process, a debit made before a reset or a level set of its policy is forgiven, and
//! its settle changes nothing there (on Redis the refund still lands on the new state).
//! An actual cost above the reservation is charged in full, past empty if need be: the
//! excess is owed, and the identity's next requests (those reserving nothing included)
//! wait until a bucket has refilled it or a window has forgotten it. Requests in flight
//! together each owe their own excess, so reserving nothing does not make a burst of
//! concurrent requests free (cancelled before their answers, they pay what they
//! reserved, or what [`Settle::if_dropped`] says when that is more). One settle owes at most one whole quota more, so one absurd
//! reported cost costs one quota's wait: where one request can cost more than a quota,
//! reserve a bound (or cap what the handler may spend), or the policy limits requests
//! rather than units. An identity owes at most a thousand quotas (and never more than
//! `MAX_LIMIT` units). A window forgets what is owed one window after it was charged, like
//! all it counted (a fixed window when it ends; a sliding log or counter as the charge
//! slides out), however much it was: under a post-paid cost, prefer a token bucket or
//! GCRA, which make the identity wait until what it owes has refilled. With `store::Leased`
//! blocks, a charge the replica's open leases hold is spent from them, as a request of
//! that cost would be; one they cannot hold goes to the shared state, and when it leaves
//! the state with nothing the replica's leases go back towards the debt. Units already
//! leased on other replicas are spent while the identity owes. A refund of a request
//! served from a lease goes back into that lease.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::{Extensions, HeaderMap, StatusCode};

use crate::decision::Receipt;
use crate::key::Key;
use crate::policy::PolicySet;

/// How the layer settles an admitted request's cost once its response head is known:
/// where the actual cost comes from, and which responses are refunded in full.
///
/// A response that names no actual cost (the header is missing or not a number) keeps
/// the reservation as it is; a malformed value is logged. A request that gets no response
/// head (dropped while the inner service ran, or the inner service failed) keeps its
/// reservation too; [`if_dropped`](Self::if_dropped) charges more for a dropped one.
///
/// Here each request reserves 50 rows, and the handler reports the rows it returned;
/// the [module docs](self) show refunds and charges in a fuller set-up:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
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
///     .policy(Policy::token_bucket("rows", 1_000, Rate::per_minute(1_000))?)
///     .key(HeaderKey::new("x-api-key"))
///     .cost(50)
///     .settle(Settle::from_header("x-rows"))
///     .layer(service_fn(|request: Request<()>| async move {
///         // Reports, as `x-rows`, what the request's `x-report` says, if anything.
///         let mut response = Response::new(Full::new(Bytes::new()));
///         if let Some(rows) = request.headers().get("x-report") {
///             response.headers_mut().insert("x-rows", rows.clone());
///         }
///         Ok::<_, Infallible>(response)
///     }));
/// let call = |report: Option<&'static str>| {
///     let mut request = Request::get("/rows").header("x-api-key", "team-a");
///     if let Some(report) = report {
///         request = request.header("x-report", report);
///     }
///     service.clone().oneshot(request.body(()).unwrap())
/// };
/// // 10 rows: 40 of the 50 reserved go back.
/// assert_eq!(call(Some("10")).await?.headers()["ratelimit"], "\"rows\";r=990;t=1");
/// // No count, or one that is not a number: the 50 reserved stand.
/// assert_eq!(call(None).await?.headers()["ratelimit"], "\"rows\";r=940;t=1");
/// assert_eq!(call(Some("ten")).await?.headers()["ratelimit"], "\"rows\";r=890;t=1");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Settle {
    source: Source,
    refund_if: Option<Arc<dyn Fn(StatusCode) -> bool + Send + Sync>>,
    if_dropped: Option<u64>,
}

/// A closure that reads the actual cost from a response head.
type ActualFn = dyn Fn(&ResponseHead<'_>) -> Option<u64> + Send + Sync;

#[derive(Clone)]
enum Source {
    Reserved,
    Header(HeaderName),
    Extension,
    Fn(Arc<ActualFn>),
}

impl fmt::Debug for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Reserved => "reserved".to_owned(),
            Source::Header(name) => format!("header {name}"),
            Source::Extension => "extension".to_owned(),
            Source::Fn(_) => "closure".to_owned(),
        };
        f.debug_struct("Settle")
            .field("source", &source)
            .field("refunds", &self.refund_if.is_some())
            .field("if_dropped", &self.if_dropped)
            .finish()
    }
}

/// The actual cost of a request, set by the handler as a response extension and read by
/// [`Settle::from_extension`].
///
/// ```
/// use axum::response::IntoResponse;
/// use tollgate::settle::ActualCost;
///
/// async fn search() -> impl IntoResponse {
///     let rows = 42;
///     (axum::Extension(ActualCost(rows)), "42 rows")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ActualCost(pub u64);

/// The response head a [`Settle::from_fn`] closure reads the actual cost from.
#[derive(Debug, Clone, Copy)]
pub struct ResponseHead<'a> {
    status: StatusCode,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> ResponseHead<'a> {
    pub(crate) fn new(
        status: StatusCode,
        headers: &'a HeaderMap,
        extensions: &'a Extensions,
    ) -> Self {
        Self {
            status,
            headers,
            extensions,
        }
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The response extensions.
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }
}

impl Settle {
    /// Keeps every reservation as charged: only refunds ([`refund_if`](Self::refund_if))
    /// change it.
    ///
    /// Here each request reserves 10 units: an answered one keeps them, and one the
    /// upstream failed (`503`) is refunded:
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
    ///     .policy(Policy::token_bucket("api", 100, Rate::per_hour(100))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(10)
    ///     .settle(Settle::reserved().refund_if(|status| matches!(status.as_u16(), 502 | 503)))
    ///     .layer(service_fn(|request: Request<()>| async move {
    ///         // `/down` answers as an upstream that is down would; any other path, 200.
    ///         let mut response = Response::new(Full::new(Bytes::new()));
    ///         if request.uri().path() == "/down" {
    ///             *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    ///         }
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let call = |path: &'static str| {
    ///     let request = Request::get(path).header("x-api-key", "team-a").body(()).unwrap();
    ///     service.clone().oneshot(request)
    /// };
    /// // Answered: the 10 reserved stay spent.
    /// assert_eq!(call("/search").await?.headers()["ratelimit"], "\"api\";r=90;t=36");
    /// // The upstream was down: the 10 go back.
    /// let down = call("/down").await?;
    /// assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    /// assert_eq!(down.headers()["ratelimit"], "\"api\";r=90;t=36");
    /// # Ok(()) }
    /// ```
    pub fn reserved() -> Self {
        Self {
            source: Source::Reserved,
            refund_if: None,
            if_dropped: None,
        }
    }

    /// The actual cost is the decimal number in the response header `name` (any case):
    /// digits only, one too large for a 64-bit count read as the largest; of several
    /// values (on several lines, or folded into one with commas), the largest. Anything
    /// else keeps the reservation (said at warn level).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name: a programming error caught at start-up.
    /// [`try_from_header`](Self::try_from_header) returns the error instead.
    ///
    /// Here each request reserves 100 tokens, and the handler reports in `x-tokens-used`
    /// what the request's `x-used` says it used:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
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
    ///     .policy(Policy::token_bucket("tokens", 1_000, Rate::per_hour(1_000))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(100)
    ///     .settle(Settle::from_header("X-Tokens-Used")) // the response's is lowercase
    ///     .layer(service_fn(|request: Request<()>| async move {
    ///         let mut response = Response::new(Full::new(Bytes::new()));
    ///         let used = request.headers()["x-used"].clone();
    ///         response.headers_mut().insert("x-tokens-used", used);
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let call = |used: &'static str| {
    ///     let request = Request::post("/v1/complete").header("x-api-key", "team-a");
    ///     service.clone().oneshot(request.header("x-used", used).body(()).unwrap())
    /// };
    /// // Used 40 of the 100 reserved: 60 go back.
    /// assert_eq!(call("40").await?.headers()["ratelimit"], "\"tokens\";r=960;t=4");
    /// // Used 150: the 50 past the reservation are charged.
    /// assert_eq!(call("150").await?.headers()["ratelimit"], "\"tokens\";r=810;t=4");
    /// // Two values folded into one: the larger, 70, is the cost.
    /// assert_eq!(call("20, 70").await?.headers()["ratelimit"], "\"tokens\";r=740;t=4");
    /// // Not digits only: the 100 reserved stand.
    /// assert_eq!(call("7.5").await?.headers()["ratelimit"], "\"tokens\";r=640;t=4");
    /// # Ok(()) }
    /// ```
    pub fn from_header(name: &str) -> Self {
        Self::try_from_header(name).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Like [`from_header`](Self::from_header), for names read from configuration.
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// assert!(Settle::try_from_header("x-rows").is_ok());
    /// assert!(Settle::try_from_header("no spaces").is_err());
    /// ```
    pub fn try_from_header(name: &str) -> Result<Self, String> {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("Settle::from_header: {name:?} is not a valid header name"))?;
        Ok(Self {
            source: Source::Header(name),
            refund_if: None,
            if_dropped: None,
        })
    }

    /// The actual cost is the [`ActualCost`] extension the handler set on the response.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::settle::{ActualCost, Settle};
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::token_bucket("rows", 1_000, Rate::per_minute(1_000))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(100) // reserve 100 rows
    ///     .settle(Settle::from_extension())
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         let mut response = Response::new(Full::new(Bytes::from_static(b"42 rows")));
    ///         response.extensions_mut().insert(ActualCost(42));
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let request = Request::get("/search").header("x-api-key", "team-a").body(())?;
    /// let response = service.oneshot(request).await?;
    /// assert_eq!(response.headers()["ratelimit"], "\"rows\";r=958;t=1"); // 42 spent
    /// # Ok(()) }
    /// ```
    pub fn from_extension() -> Self {
        Self {
            source: Source::Extension,
            refund_if: None,
            if_dropped: None,
        }
    }

    /// The actual cost is what `f` reads from the response head (`None` keeps the
    /// reservation).
    ///
    /// Here each request reserves 50 rows; the closure reads the status and the headers:
    /// a `304 Not Modified` costs 1 row, any other response the rows the handler counted
    /// in `x-rows`, and one without a count keeps the 50:
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
    ///     .policy(Policy::token_bucket("rows", 1_000, Rate::per_hour(1_000))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(50)
    ///     .settle(Settle::from_fn(|head| {
    ///         if head.status() == StatusCode::NOT_MODIFIED {
    ///             return Some(1);
    ///         }
    ///         head.headers().get("x-rows")?.to_str().ok()?.parse().ok()
    ///     }))
    ///     .layer(service_fn(|request: Request<()>| async move {
    ///         // 304 to a conditional request; else reports as `x-rows` the request's
    ///         // `x-report`, if any.
    ///         let mut response = Response::new(Full::new(Bytes::new()));
    ///         if request.headers().contains_key("if-none-match") {
    ///             *response.status_mut() = StatusCode::NOT_MODIFIED;
    ///         } else if let Some(rows) = request.headers().get("x-report") {
    ///             response.headers_mut().insert("x-rows", rows.clone());
    ///         }
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let call = |name: &'static str, value: &'static str| {
    ///     let request = Request::get("/rows").header("x-api-key", "team-a").header(name, value);
    ///     service.clone().oneshot(request.body(()).unwrap())
    /// };
    /// // 20 rows counted: 30 of the 50 go back.
    /// assert_eq!(call("x-report", "20").await?.headers()["ratelimit"], "\"rows\";r=980;t=4");
    /// // Not modified: 1 row.
    /// let cached = call("if-none-match", "\"v7\"").await?;
    /// assert_eq!(cached.status(), StatusCode::NOT_MODIFIED);
    /// assert_eq!(cached.headers()["ratelimit"], "\"rows\";r=979;t=4");
    /// // No count: the closure says `None`, and the 50 reserved stand.
    /// assert_eq!(call("accept", "*/*").await?.headers()["ratelimit"], "\"rows\";r=929;t=4");
    /// # Ok(()) }
    /// ```
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&ResponseHead<'_>) -> Option<u64> + Send + Sync + 'static,
    {
        Self {
            source: Source::Fn(Arc::new(f)),
            refund_if: None,
            if_dropped: None,
        }
    }

    /// Refunds in full the requests whose response status satisfies `refund` (for
    /// example server errors): they do not count against any policy.
    ///
    /// Only a response has a status: when the inner service fails instead (its future
    /// returns `Err`, as a `tower::timeout::Timeout` inside the limiter does), the
    /// reservation stands. To have such failures refunded, turn them into responses
    /// inside the limiter (axum's `HandleErrorLayer` between the two), so that `refund`
    /// sees their status.
    ///
    /// A refunded request is free however much work it caused: a client that can make
    /// requests fail on purpose (a query built to run into the timeout, an input that
    /// crashes a handler) is then not limited at all. Refund only failures the client
    /// cannot cause (an upstream that is down: `502`, `503`), or keep a second policy
    /// (or layer) without refunds that counts every request.
    ///
    /// Here each request reserves 100 tokens and settles to the `x-tokens-used` its
    /// response reports (30, always). An upstream that is down (`503`) gives the whole
    /// reservation back, whatever the response reports; a `500`, which a client may cause,
    /// is not refunded:
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
    ///     .policy(Policy::token_bucket("tokens", 1_000, Rate::per_hour(1_000))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(100)
    ///     .settle(
    ///         Settle::from_header("x-tokens-used")
    ///             .refund_if(|status| matches!(status.as_u16(), 502 | 503)),
    ///     )
    ///     .layer(service_fn(|request: Request<()>| async move {
    ///         // `/down` answers 503, `/crash` 500, any other path 200.
    ///         let mut response = Response::new(Full::new(Bytes::new()));
    ///         *response.status_mut() = match request.uri().path() {
    ///             "/down" => StatusCode::SERVICE_UNAVAILABLE,
    ///             "/crash" => StatusCode::INTERNAL_SERVER_ERROR,
    ///             _ => StatusCode::OK,
    ///         };
    ///         response.headers_mut().insert("x-tokens-used", 30.into());
    ///         Ok::<_, Infallible>(response)
    ///     }));
    /// let call = |path: &'static str| {
    ///     let request = Request::post(path).header("x-api-key", "team-a").body(()).unwrap();
    ///     service.clone().oneshot(request)
    /// };
    /// assert_eq!(call("/complete").await?.headers()["ratelimit"], "\"tokens\";r=970;t=4");
    /// // Refunded in full: the 30 reported are not charged either.
    /// assert_eq!(call("/down").await?.headers()["ratelimit"], "\"tokens\";r=970;t=4");
    /// // Not refunded: settled to the 30 reported, as a 200 is.
    /// assert_eq!(call("/crash").await?.headers()["ratelimit"], "\"tokens\";r=940;t=4");
    /// # Ok(()) }
    /// ```
    pub fn refund_if<F>(mut self, refund: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    /// Charges `units` for a request dropped while the inner service ran, before its
    /// response head (its client gone, an outer timeout), when that is more than it
    /// reserved; it never pays less than its reservation. By default such a request keeps
    /// its reservation, so a post-paid cost that reserves little is dodged by cancelling
    /// each request just before its answer: the work it caused is paid nothing. Set what
    /// such work may cost (a request's bound). A request dropped during its shaping delay,
    /// or while the inner service was not ready, was never sent: it is not charged. One
    /// whose inner service failed (an `Err`, no head) keeps its reservation, as
    /// [`refund_if`](Self::refund_if) says: a load shedder inside the limiter fails
    /// requests it never ran.
    ///
    /// Here an outer timeout gives up on a request the handler never answers (on tokio's
    /// paused time), and the next request's `RateLimit` field shows the charge:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::cost::FromExtension;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::settle::Settle;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Post-paid tokens, nothing reserved: a request cancelled before its answer
    /// // costs 2,000 tokens, the most one may use.
    /// let layer = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
    ///     .policy(Policy::token_bucket("tokens", 100_000, Rate::per_hour(100_000))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(FromExtension::or(0))
    ///     .settle(Settle::from_header("x-tokens-used").if_dropped(2_000));
    /// // The model answers a request marked `x-hang` never, any other with 10 tokens.
    /// let service = layer.layer(service_fn(|request: Request<()>| async move {
    ///     if request.headers().contains_key("x-hang") {
    ///         std::future::pending::<()>().await;
    ///     }
    ///     let mut response = Response::new(Full::new(Bytes::new()));
    ///     response.headers_mut().insert("x-tokens-used", 10.into());
    ///     Ok::<_, Infallible>(response)
    /// }));
    /// let call = |hang: bool| {
    ///     let mut request = Request::post("/v1/complete").header("x-api-key", "team-a");
    ///     if hang {
    ///         request = request.header("x-hang", "1");
    ///     }
    ///     service.clone().oneshot(request.body(()).unwrap())
    /// };
    /// let gave_up = tokio::time::timeout(Duration::from_secs(30), call(true)).await;
    /// assert!(gave_up.is_err());
    /// let next = call(false).await?;
    /// assert_eq!(next.headers()["ratelimit"], "\"tokens\";r=97990;t=1"); // 2,000 + 10
    /// # Ok(()) }
    /// ```
    pub fn if_dropped(mut self, units: u64) -> Self {
        self.if_dropped = Some(units);
        self
    }

    /// What a request that got no response head costs, or `None` to keep the reservation.
    pub(crate) fn dropped_cost(&self) -> Option<u64> {
        self.if_dropped
    }

    /// The actual cost for a response, or `None` to keep the reservation; `Err` with the
    /// header's name when the response states it unreadably (the reservation stands,
    /// and the caller says so).
    pub(crate) fn actual(&self, head: &ResponseHead<'_>) -> Result<Option<u64>, &HeaderName> {
        if let Some(refund) = &self.refund_if
            && refund(head.status)
        {
            return Ok(Some(0));
        }
        Ok(match &self.source {
            Source::Reserved => None,
            Source::Header(name) => {
                // No such header: the reservation stands, nothing to say.
                if !head.headers.contains_key(name) {
                    return Ok(None);
                }
                return actual_cost(head.headers.get_all(name))
                    .map(Some)
                    .ok_or(name);
            }
            Source::Extension => head
                .extensions
                .get::<ActualCost>()
                .map(|ActualCost(cost)| *cost),
            Source::Fn(f) => f(head),
        })
    }
}

/// The actual cost in a response header's values: every value a whole number (digits, as
/// a `Content-Length`; one too large for a count is the largest); of several, on several
/// lines or folded into one by an intermediary (RFC 9110 section 5.3), the largest.
/// Empty list elements are none; `None` when there is no value, or one is not a number.
fn actual_cost(values: http::header::GetAll<'_, http::HeaderValue>) -> Option<u64> {
    let mut largest = None::<u64>;
    for line in values {
        for element in line.to_str().ok()?.split(',').map(str::trim) {
            if element.is_empty() {
                continue;
            }
            if !element.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let value = element.parse().unwrap_or(u64::MAX);
            largest = Some(largest.map_or(value, |largest: u64| largest.max(value)));
        }
    }
    largest
}

/// Where an admitted request was debited: the store, or the local fallback (under the
/// policies it applied) while the store was away.
pub(crate) struct Debit {
    pub(crate) receipt: Receipt,
    pub(crate) fallback: Option<PolicySet>,
    /// What the debit left of each policy (for an exact settle of buckets and GCRA).
    pub(crate) left: smallvec::SmallVec<[u64; 2]>,
    /// When each policy's queue ended after the debit: a request held back by shaping
    /// (to give its place back if it is dropped before it is sent); else empty.
    pub(crate) ends: smallvec::SmallVec<[u64; 2]>,
}

/// The most bookings of dropped requests a layer keeps, over every queue: a request
/// dropped while as many are kept in other queues is not kept (its place leaks out).
const MAX_DROPPED: usize = 4096;

/// The most kept in one queue: past it, the oldest goes (the last a round would reach).
const MAX_PER_QUEUE: usize = 64;

/// The debit of a request dropped during its shaping delay, not yet given back because a
/// request queued behind it still stood (see `Change::Unbook`): kept until those are
/// given back, or until it has leaked out.
pub(crate) struct Booking {
    pub(crate) policies: PolicySet,
    /// Debited by the local fallback (under `policies`, the ones it applied).
    pub(crate) fallback: bool,
    pub(crate) cost: u64,
    pub(crate) receipt: Receipt,
    pub(crate) left: smallvec::SmallVec<[u64; 2]>,
    pub(crate) ends: smallvec::SmallVec<[u64; 2]>,
    /// When nothing of it is left to give back (its queue has leaked out).
    pub(crate) gone: tokio::time::Instant,
}

impl Booking {
    /// Its receipt once its units under the other rate policies are given back (a settle
    /// to nothing that leaves its place taken, see `Reservation`'s rounds): they are
    /// marked as not debited, so that its unbooking gives back its place alone. `None`
    /// past 64 policies, whose marks a receipt cannot hold, or when the marks would all
    /// be set (read as a refusal).
    pub(crate) fn place_only(&self) -> Option<Receipt> {
        if self.policies.len() > 64 {
            return None;
        }
        let others = self
            .policies
            .iter()
            .enumerate()
            .filter(|(_, policy)| {
                let params = policy.params();
                !params.is_shaping() && !params.is_in_flight()
            })
            .fold(0u64, |marks, (index, _)| marks | 1 << index);
        let undebited = self.receipt.undebited() | others;
        (undebited != u64::MAX).then(|| self.receipt.with_undebited(undebited))
    }

    /// Whether its units under the other rate policies are still to go back (see
    /// `place_only`).
    pub(crate) fn owes_others(&self) -> bool {
        self.place_only()
            .is_some_and(|place| place.undebited() != self.receipt.undebited())
    }

    /// Its place in its queue: when it was debited, then where its queue ends.
    fn order(&self) -> (u64, u64) {
        (
            self.receipt.at(),
            self.ends.iter().copied().max().unwrap_or(0),
        )
    }

    /// The queue it holds a place in: its key and the shaping policies it debited, on
    /// the store or on the local fallback (two states, their times on two clocks).
    pub(crate) fn queue(&self, key: &Key) -> QueueId {
        let shaping = self
            .policies
            .iter()
            .enumerate()
            .filter(|(index, policy)| policy.params().is_shaping() && self.receipt.debited(*index))
            .map(|(_, policy)| policy.id())
            .collect();
        QueueId(key.clone(), shaping, self.fallback)
    }
}

/// A shaping queue: one key under the shaping policies of one set, on the store or on
/// the local fallback.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct QueueId(Key, smallvec::SmallVec<[u32; 2]>, bool);

impl QueueId {
    pub(crate) fn key(&self) -> &Key {
        &self.0
    }
}

/// A layer's bookings of dropped requests, by queue, oldest first. One round at a time
/// per queue gives them back, newest first, for as long as each is the newest booking
/// (clients' timeouts end in the order their requests came); a request dropped while a
/// round is out at the store is left to that round, which looks again before it stops.
#[derive(Default)]
pub(crate) struct DroppedBookings {
    inner: std::sync::Mutex<Dropped>,
}

#[derive(Default)]
struct Dropped {
    queues: std::collections::HashMap<QueueId, Queue>,
    count: usize,
}

#[derive(Default)]
struct Queue {
    /// Oldest first.
    bookings: Vec<Booking>,
    /// A round is giving this queue's bookings back.
    running: bool,
    /// A booking came while the round's store call was out.
    again: bool,
}

impl Queue {
    /// Keeps `booking` in its place (oldest first).
    fn insert(&mut self, booking: Booking) {
        let at = self
            .bookings
            .partition_point(|other| other.order() <= booking.order());
        self.bookings.insert(at, booking);
    }
}

impl Dropped {
    /// Forgets the bookings of `queue` that have leaked out.
    fn forget_gone(&mut self, queue: &QueueId, now: tokio::time::Instant) {
        if let Some(kept) = self.queues.get_mut(queue) {
            let before = kept.bookings.len();
            kept.bookings.retain(|booking| booking.gone > now);
            self.count -= before - kept.bookings.len();
        }
    }

    /// Forgets every booking that has leaked out, and the queues left with none and no
    /// round.
    fn forget_all_gone(&mut self, now: tokio::time::Instant) {
        let mut forgotten = 0;
        self.queues.retain(|_, kept| {
            let before = kept.bookings.len();
            kept.bookings.retain(|booking| booking.gone > now);
            forgotten += before - kept.bookings.len();
            !kept.bookings.is_empty() || kept.running
        });
        self.count -= forgotten;
    }
}

impl DroppedBookings {
    fn lock(&self) -> std::sync::MutexGuard<'_, Dropped> {
        // A panic elsewhere while the lock was held leaves whole bookings behind.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `booking` in `queue` (not when the layer keeps as many as it may in other
    /// queues). True when the caller is to run a round for the queue; false when one is
    /// running, which will look again before it stops.
    pub(crate) fn drop_off(&self, queue: &QueueId, booking: Booking) -> bool {
        let now = tokio::time::Instant::now();
        let mut dropped = self.lock();
        dropped.forget_gone(queue, now);
        if booking.gone > now {
            let full = dropped.count >= MAX_DROPPED && {
                dropped.forget_all_gone(now);
                dropped.count >= MAX_DROPPED
            };
            let kept_here = dropped
                .queues
                .get(queue)
                .map_or(0, |kept| kept.bookings.len());
            if !full || kept_here > 0 {
                let dropped = &mut *dropped;
                let kept = dropped.queues.entry(queue.clone()).or_default();
                if kept.bookings.len() >= MAX_PER_QUEUE || full {
                    kept.bookings.remove(0);
                    dropped.count -= 1;
                }
                kept.insert(booking);
                dropped.count += 1;
            }
        }
        let Some(kept) = dropped.queues.get_mut(queue) else {
            return false;
        };
        if kept.running {
            kept.again = true;
            false
        } else {
            kept.running = true;
            true
        }
    }

    /// The round's next booking of `queue`: its newest that has not leaked out; `None`
    /// ends the round.
    pub(crate) fn next(&self, queue: &QueueId) -> Option<Booking> {
        let mut dropped = self.lock();
        dropped.forget_gone(queue, tokio::time::Instant::now());
        let kept = dropped.queues.get_mut(queue)?;
        kept.again = false;
        let Some(newest) = kept.bookings.pop() else {
            dropped.queues.remove(queue);
            return None;
        };
        dropped.count -= 1;
        Some(newest)
    }

    /// Takes out of `queue` a booking whose units under the other policies are still to
    /// go back (the round gives them back, and puts it back with [`put_back`]).
    ///
    /// [`put_back`]: Self::put_back
    pub(crate) fn take_owing(&self, queue: &QueueId) -> Option<Booking> {
        let mut dropped = self.lock();
        dropped.forget_gone(queue, tokio::time::Instant::now());
        let kept = dropped.queues.get_mut(queue)?;
        let at = kept.bookings.iter().position(Booking::owes_others)?;
        let booking = kept.bookings.remove(at);
        dropped.count -= 1;
        Some(booking)
    }

    /// Puts back a booking [`take_owing`](Self::take_owing) took, in its place.
    pub(crate) fn put_back(&self, queue: &QueueId, booking: Booking) {
        let mut dropped = self.lock();
        let dropped = &mut *dropped;
        dropped
            .queues
            .entry(queue.clone())
            .or_default()
            .insert(booking);
        dropped.count += 1;
    }

    /// The store refused to give `booking` back (a request stands behind it): it is kept.
    /// True when the round goes on (a booking came meanwhile, perhaps the one standing).
    pub(crate) fn refused(&self, queue: &QueueId, booking: Booking) -> bool {
        let mut dropped = self.lock();
        let dropped = &mut *dropped;
        let kept = dropped.queues.entry(queue.clone()).or_default();
        kept.insert(booking);
        dropped.count += 1;
        if std::mem::take(&mut kept.again) {
            true
        } else {
            kept.running = false;
            false
        }
    }

    /// Ends the round of `queue` (the store failed): its bookings stay for the next.
    pub(crate) fn stop(&self, queue: &QueueId) {
        let mut dropped = self.lock();
        if let Some(kept) = dropped.queues.get_mut(queue) {
            kept.running = false;
            kept.again = false;
            if kept.bookings.is_empty() {
                dropped.queues.remove(queue);
            }
        }
    }

    /// How many bookings are kept (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().count
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Policy, Rate};

    fn booking(at: u64, lasts: Duration) -> Booking {
        let paced = Policy::leaky_bucket_shaping("paced", Rate::per_second(1), lasts).unwrap();
        Booking {
            policies: PolicySet::from(paced),
            fallback: false,
            cost: 1,
            receipt: Receipt::new(at, 0),
            left: smallvec::smallvec![1],
            ends: smallvec::smallvec![at + 1],
            gone: tokio::time::Instant::now() + lasts,
        }
    }

    /// A layer keeps a bounded number of dropped bookings: per queue (past it the oldest
    /// goes) and over every queue (past it a new queue's is not kept), and bookings that
    /// have leaked out make room.
    #[tokio::test(start_paused = true)]
    async fn the_dropped_bookings_are_bounded_and_forgotten_once_gone() {
        let dropped = DroppedBookings::default();
        let one = booking(1, Duration::from_secs(60)).queue(&Key::new("one"));
        for at in 0..MAX_PER_QUEUE as u64 + 10 {
            dropped.drop_off(&one, booking(at, Duration::from_secs(60)));
        }
        assert_eq!(dropped.len(), MAX_PER_QUEUE);
        assert_eq!(
            dropped.next(&one).unwrap().receipt.at(),
            MAX_PER_QUEUE as u64 + 9
        );
        for n in 0..MAX_DROPPED {
            let key = Key::new(format!("k{n}"));
            let lasts = if n % 2 == 0 { 1 } else { 60 };
            let queue = booking(1, Duration::from_secs(lasts)).queue(&key);
            dropped.drop_off(&queue, booking(1, Duration::from_secs(lasts)));
        }
        assert_eq!(dropped.len(), MAX_DROPPED);
        let late = booking(1, Duration::from_secs(60)).queue(&Key::new("late"));
        assert!(!dropped.drop_off(&late, booking(1, Duration::from_secs(60))));
        assert!(dropped.next(&late).is_none(), "not kept while full");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(dropped.drop_off(&late, booking(1, Duration::from_secs(60))));
        assert!(dropped.len() <= MAX_DROPPED / 2 + MAX_PER_QUEUE + 1);
    }

    /// A queue's bookings come back newest first; one round at a time: a booking dropped
    /// off while a round runs is left to it, and a refusal then goes on.
    #[tokio::test(start_paused = true)]
    async fn one_round_per_queue_takes_the_newest_first() {
        let dropped = DroppedBookings::default();
        let queue = booking(1, Duration::from_secs(60)).queue(&Key::new("k"));
        assert!(dropped.drop_off(&queue, booking(20, Duration::from_secs(60))));
        assert!(!dropped.drop_off(&queue, booking(10, Duration::from_secs(60))));
        let newest = dropped.next(&queue).unwrap();
        assert_eq!(newest.receipt.at(), 20);
        // Dropped off while the round is out at the store: the refusal goes on.
        assert!(!dropped.drop_off(&queue, booking(30, Duration::from_secs(60))));
        assert!(dropped.refused(&queue, newest));
        let order: Vec<u64> = std::iter::from_fn(|| dropped.next(&queue))
            .map(|booking| booking.receipt.at())
            .collect();
        assert_eq!(order, [30, 20, 10]);
        assert_eq!(dropped.len(), 0);
        // The round is over: the next drop starts one.
        assert!(dropped.drop_off(&queue, booking(40, Duration::from_secs(60))));
    }

    /// A key's bookings on the store and on the local fallback (an outage between them)
    /// hold places in two queues, their times read on two clocks (the store's, the
    /// process's): one round ordered them together, and gave the newest of one as if it
    /// were the other's (refused, its round ended; the other's place leaked out).
    #[tokio::test(start_paused = true)]
    async fn bookings_on_the_store_and_on_the_fallback_are_two_queues() {
        let dropped = DroppedBookings::default();
        let key = Key::new("k");
        let on_store = booking(1_000, Duration::from_secs(60));
        let on_fallback = Booking {
            fallback: true,
            ..booking(50, Duration::from_secs(60))
        };
        let (store_queue, fallback_queue) = (on_store.queue(&key), on_fallback.queue(&key));
        assert!(dropped.drop_off(&store_queue, on_store));
        assert!(dropped.drop_off(&fallback_queue, on_fallback));
        assert_eq!(dropped.next(&store_queue).unwrap().receipt.at(), 1_000);
        assert!(
            dropped.next(&store_queue).is_none(),
            "the store's round ends"
        );
        let fallback = dropped.next(&fallback_queue).unwrap();
        assert!(fallback.fallback);
        assert_eq!(fallback.receipt.at(), 50);
    }
}
