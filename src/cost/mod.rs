//! Costs: how many units a request spends ("one bucket, different debit").
//!
//! A cost is computed from the request head. Ready costs: a constant (`u64`), a table per
//! route ([`PerRoute`]), a closure ([`from_fn`]), and a cost set by earlier middleware
//! ([`FromExtension`], which is how body-based costers such as GraphQL hand over theirs).
//! Every cost debits the same policies, so `/search` at 5 and `/` at 1 share one budget.

#[cfg(feature = "graphql")]
pub mod graphql;

use std::fmt;

use http::Method;
use http::request::Parts;

/// Computes what a request spends.
///
/// ```
/// use http::Request;
/// use tollgate::cost::Cost;
///
/// let (parts, _) = Request::get("/").body(()).unwrap().into_parts();
/// assert_eq!(3u64.cost(&parts), 3);
/// ```
pub trait Cost: Send + Sync + 'static {
    /// Units this request spends (0 spends nothing, and is admitted unless the identity
    /// owes what a settle charged past empty, or a penalty blocks it).
    fn cost(&self, parts: &Parts) -> u64;

    /// Whether this cost reads a [`RequestCost`] that middleware further out sets (as
    /// [`FromExtension`] does; default `false`: a cost of your own that reads one should
    /// say so). A layer whose cost does marks the requests it decides, so that a coster
    /// that sets one further in (the GraphQL coster's layer, placed inside the limiter),
    /// whose cost is then never charged, says so at error level instead of going
    /// unnoticed; and a coster's cost reaching such a layer further in is known read.
    ///
    /// ```
    /// use tollgate::cost::{Cost, FromExtension};
    ///
    /// assert!(FromExtension::or(1).reads_request_cost());
    /// assert!(!5u64.reads_request_cost());
    /// ```
    fn reads_request_cost(&self) -> bool {
        false
    }
}

impl<T: Cost + ?Sized> Cost for std::sync::Arc<T> {
    fn cost(&self, parts: &Parts) -> u64 {
        (**self).cost(parts)
    }

    fn reads_request_cost(&self) -> bool {
        (**self).reads_request_cost()
    }
}

impl<T: Cost + ?Sized> Cost for Box<T> {
    fn cost(&self, parts: &Parts) -> u64 {
        (**self).cost(parts)
    }

    fn reads_request_cost(&self) -> bool {
        (**self).reads_request_cost()
    }
}

/// Set on a request by a rate-limit layer whose cost reads [`RequestCost`]
/// ([`Cost::reads_request_cost`]), once it has read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CostRead;

/// Set beside a [`RequestCost`] by a coster behind a limiter that read the cost already
/// ([`CostRead`]): a layer whose cost reads it marks it read when the request reaches
/// it (whether it then bypasses it, has no key for it, or charges it), so the coster
/// can tell whether any limiter further in had it.
#[derive(Debug, Clone, Default)]
#[cfg_attr(not(feature = "graphql"), allow(dead_code))]
pub(crate) struct Handed(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// Marks the cost handed with `parts` (if any) read: a layer whose cost reads it has it.
#[inline]
pub(crate) fn handed(parts: &Parts) {
    if let Some(handed) = parts.extensions.get::<Handed>() {
        handed.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg_attr(not(feature = "graphql"), allow(dead_code))]
impl Handed {
    /// Whether a limiter read the cost handed with this.
    pub(crate) fn read(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A constant cost.
impl Cost for u64 {
    fn cost(&self, _parts: &Parts) -> u64 {
        *self
    }
}

/// A cost per route, with a default for routes not listed.
///
/// Routes are matched on axum's `MatchedPath` (the route template, `/users/{id}`) when
/// there is one, else on the request path. Under a wildcard template (`/files/{*path}`,
/// or a tonic service merged into an axum router, one `/{Service}/{*rest}` route), or
/// where no template names the path, an entry for the request's own path comes first
/// (`/greeter.Greeter/SayHello`), then the template's. When an entry of the path for
/// every method and one of the template for the request's method both apply, the larger
/// counts. A spelling a handler may read as a listed path (its escapes decoded, `//` and
/// `.` segments gone, `..` resolved, as axum's `Path` and a `ServeDir` read it:
/// `/files/big%2Eiso`, `/files//big.iso`; a listing read the same way) costs at least
/// what the listed path does, and never less than what the route that serves it costs
/// (list a cheap path as clients spell it): axum routes by the path as written, so
/// `/api/%68ealth` is served by a wildcard or the fallback, not by a static
/// `/api/health` listed cheap. A path the handler normalises otherwise (a trailing slash,
/// case) is the template's: list those spellings too, or cost the route in the handler.
/// A route served for every method (`any(..)`) costs a method of its own (`FOO /export`)
/// what the route costs for every method, or the default: list the route for every
/// method when only some are listed. A `HEAD` costs what a `GET` of the route costs,
/// unless it has a cost of its own: it runs the GET handler. So does an extended CONNECT
/// (RFC 8441: HTTP/2's and HTTP/3's WebSocket opening, a `GET` with `Upgrade` in HTTP/1.1,
/// served by one `any` route), unless CONNECT has a cost of its own.
///
/// The template is the one the router that runs the layer matched: inside a router
/// nested at `/api`, list `/api/search` (the path is the whole one too: axum's
/// `OriginalUri`). Where axum matched no template (a service nested with
/// `nest_service`, a fallback), the whole path is looked up: list `/api/search` there
/// too. Without a router in front (a plain tower
/// stack, or the `axum` feature off), the path is the client's, as written: list the
/// spelling your service answers, since a path the service normalises (`/search/`,
/// `//search`) does not match `/search` here.
///
/// ```
/// use http::{Method, Request};
/// use tollgate::cost::{Cost, PerRoute};
///
/// let cost = PerRoute::new(1).route("/search", 5).route_method(Method::POST, "/upload", 20);
/// let parts = |method: Method, path: &str| {
///     Request::builder().method(method).uri(path).body(()).unwrap().into_parts().0
/// };
/// assert_eq!(cost.cost(&parts(Method::GET, "/search")), 5);
/// assert_eq!(cost.cost(&parts(Method::POST, "/upload")), 20);
/// assert_eq!(cost.cost(&parts(Method::GET, "/upload")), 1);
/// ```
#[derive(Debug, Clone)]
pub struct PerRoute {
    default: u64,
    /// Each listing: its method (`None`: every method), its path as written, the path as
    /// a handler may read it (`respelled`), and its cost.
    routes: Vec<Listing>,
    /// Segments that begin with `:` or `*` are listed as literal text
    /// ([`without_v07_checks`](Self::without_v07_checks)).
    literal_v07: bool,
}

#[derive(Debug, Clone)]
struct Listing {
    method: Option<Method>,
    path: Box<str>,
    read_as: Box<str>,
    cost: u64,
}

impl PerRoute {
    /// Routes not listed cost `default`.
    pub fn new(default: u64) -> Self {
        Self {
            default,
            routes: Vec::new(),
            literal_v07: false,
        }
    }

    /// Paths listed after this may hold segments that begin with `:` or `*`, as literal
    /// text: for a router built with axum's `Router::without_v07_checks`, which serves
    /// such paths. Otherwise they panic, as axum 0.8's router does: they are axum 0.7's
    /// captures, which axum 0.8 writes `{id}` and `{*path}`.
    ///
    /// ```
    /// use http::Request;
    /// use tollgate::cost::{Cost, PerRoute};
    ///
    /// let cost = PerRoute::new(1).without_v07_checks().route("/:literal", 5);
    /// let (parts, ()) = Request::get("/:literal").body(()).unwrap().into_parts();
    /// assert_eq!(cost.cost(&parts), 5);
    /// ```
    pub fn without_v07_checks(mut self) -> Self {
        self.literal_v07 = true;
        self
    }

    /// `path` costs `cost` for every method (listed again, the last entry stands).
    ///
    /// # Panics
    ///
    /// If `path` could never match a request's path (it does not start with `/`, or holds
    /// a query, a fragment or a space): a programming error caught at start-up, as axum's
    /// `Router::route` panics on such a path. So does a segment that begins with `:` or
    /// `*` (axum 0.7's capture; axum 0.8 writes `/users/{id}`), unless
    /// [`without_v07_checks`](Self::without_v07_checks) came first.
    pub fn route(mut self, path: &str, cost: u64) -> Self {
        check_route(path, self.literal_v07);
        self.list(Listing::new(None, path, cost));
        self
    }

    /// `method path` costs `cost`; takes precedence over a [`route`](Self::route) entry
    /// of the same path. On a wildcard route, where the request's own path is listed for
    /// every method and the template for this method, the larger of the two counts (a
    /// cheap method entry never undercuts a path listed as costly). Listed again, the
    /// last entry stands.
    ///
    /// # Panics
    ///
    /// As [`route`](Self::route), for a path that could never match.
    pub fn route_method(mut self, method: Method, path: &str, cost: u64) -> Self {
        check_route(path, self.literal_v07);
        self.list(Listing::new(Some(method), path, cost));
        self
    }

    /// Lists `listing` in place of an earlier one of its method and path, which is gone
    /// for every spelling read as its path too (it would still count as the dearer).
    fn list(&mut self, listing: Listing) {
        self.routes
            .retain(|earlier| earlier.method != listing.method || earlier.path != listing.path);
        self.routes.push(listing);
    }
}

/// Panics on a route no request's path can match: it would cost the default, silently.
/// So does axum 0.7's capture, unless `literal_v07` (see [`PerRoute::without_v07_checks`]).
fn check_route(path: &str, literal_v07: bool) {
    assert!(
        path.starts_with('/') && !path.contains(['?', '#', ' ', '\t']),
        "PerRoute: {path:?} never matches a request's path: a route starts with / and \
         holds no query (?), fragment (#) or space"
    );
    assert!(
        literal_v07 || !holds_v07_capture(path),
        "PerRoute: {path:?} holds axum 0.7's capture (:id, *path), which axum 0.8's router \
         neither matches nor writes: write /users/{{id}} or /files/{{*path}} (for literal \
         text, as under Router::without_v07_checks, call PerRoute::without_v07_checks first)"
    );
}

/// Whether `path` has a segment that begins with `:` or `*`: axum 0.7's capture, which
/// axum 0.8's router refuses (literal text only under `Router::without_v07_checks`).
pub(crate) fn holds_v07_capture(path: &str) -> bool {
    path.split('/')
        .any(|segment| segment.starts_with(':') || segment.starts_with('*'))
}

impl Listing {
    fn new(method: Option<Method>, path: &str, cost: u64) -> Self {
        Self {
            method,
            path: path.into(),
            read_as: respelled(path).map_or_else(|| path.into(), String::into_boxed_str),
            cost,
        }
    }
}

impl PerRoute {
    /// The cost listed for `path` under `method` (`None`: for every method).
    fn entry(&self, path: &str, method: Option<&Method>) -> Option<u64> {
        self.routes
            .iter()
            .find(|listing| &*listing.path == path && listing.method.as_ref() == method)
            .map(|listing| listing.cost)
    }

    /// The cost listed for `path` under the method of `request` (`Some`), or for every
    /// method.
    fn listed(&self, path: &str, request: Option<&Parts>) -> Option<u64> {
        match request {
            Some(parts) => for_method(parts, |method| self.entry(path, method)),
            None => self.entry(path, None),
        }
    }
}

impl Cost for PerRoute {
    fn cost(&self, parts: &Parts) -> u64 {
        // Whole, as the template is (a nested router's URI has its prefix taken off).
        let path = crate::key::original_path(parts);
        let matched = crate::key::matched_path(parts);
        // No template (a service nested with `nest_service`, whose URI has the prefix
        // taken off too; a fallback; no router): the whole path.
        let template = matched.unwrap_or(path);
        // A wildcard template (a tonic service merged into a router is one
        // `/{Service}/{*rest}` route) names no method: the request's own path first, when
        // the template's literal start leads it. So does a path no template names.
        let own_path = matched.is_none()
            || (template != path
                && template.contains("{*")
                && template
                    .split_once('{')
                    .is_some_and(|(start, _)| path.starts_with(start)));
        let own = |request: Option<&Parts>| own_path.then(|| self.listed(path, request)).flatten();
        let method = Some(parts);
        // The template's entries, when axum matched one (else the path's own, above).
        let of_template =
            |request: Option<&Parts>| matched.and_then(|template| self.listed(template, request));
        // The path's entry for the method is the most specific. Else an entry of the path
        // for every method and one of the template for the method both apply: the larger
        // counts, so that neither the method nor the path makes a listed route cheaper.
        let (own_for_method, own_for_any) = (own(method), own(None));
        let cost = own_for_method
            .or_else(|| match (own_for_any, of_template(method)) {
                (Some(by_path), Some(by_method)) => Some(by_path.max(by_method)),
                (by_path, by_method) => by_path.or(by_method),
            })
            .or_else(|| of_template(None))
            .unwrap_or(self.default);
        if !own_path || own_for_method.is_some() || own_for_any.is_some() {
            return cost;
        }
        // What serves the path may read it otherwise (axum's `Path`, a `ServeDir`): its
        // escapes decoded, `//` and `.` segments gone, `..` resolved; and the listings are
        // read so too. Such a spelling of a listed path
        // (`/files/big%2Eiso`, `/files//big.iso`) costs at least what the listed path
        // does; it never costs less than the route that serves it, which axum chose by
        // the path as written (`/api/%68ealth` is the wildcard's or the fallback's, not
        // the static `/api/health`'s, whatever that one costs).
        let read_as = respelled(path);
        let read_as = read_as.as_deref().unwrap_or(path);
        // The listing's own precedence: the method's entries, else those for every
        // method; of several listings read the same way (`/api/` and `/api`), the dearest.
        for_method(parts, |method| self.dearest(read_as, method))
            .or_else(|| self.dearest(read_as, None))
            .map_or(cost, |listed| listed.max(cost))
    }
}

/// What `find` gives for the request's method itself: a HEAD and an extended CONNECT
/// are answered by the GET handler (`key::runs_as_get`), and cost what a GET does unless
/// their method has a cost of its own.
fn for_method(parts: &Parts, find: impl Fn(Option<&Method>) -> Option<u64>) -> Option<u64> {
    find(Some(&parts.method))
        .or_else(|| crate::key::runs_as_get(parts).then(|| find(Some(&Method::GET)))?)
}

impl PerRoute {
    /// The largest cost of the listings read as `read_as` under `method` (`None`: for
    /// every method).
    fn dearest(&self, read_as: &str, method: Option<&Method>) -> Option<u64> {
        self.routes
            .iter()
            .filter(|listing| &*listing.read_as == read_as && listing.method.as_ref() == method)
            .map(|listing| listing.cost)
            .max()
    }
}

/// `path` as a handler may read it, when that differs from how it is written: its escapes
/// decoded, empty and `.` segments gone and `..` segments resolved (as a `ServeDir` or a
/// handler joining a captured path to a directory reads it). `None` for a path none of
/// that changes (the common case, at the cost of one scan: no allocation).
fn respelled(path: &str) -> Option<String> {
    let respelt = path.contains('%')
        || path.contains("//")
        || path.contains("/.")
        || (path.len() > 1 && path.ends_with('/'));
    if !respelt {
        return None;
    }
    // An escape that decodes to no UTF-8 (`%FF`) stands as one odd character: what
    // reads the path by bytes still resolves the segments around it.
    let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let read_as = format!("/{}", segments.join("/"));
    (read_as != path).then_some(read_as)
}

/// A cost that earlier middleware computed and stored in the request's extensions.
///
/// ```
/// use http::Request;
/// use tollgate::cost::{Cost, FromExtension, RequestCost};
///
/// let cost = FromExtension::or(1);
/// let mut request = Request::post("/graphql").body(()).unwrap();
/// request.extensions_mut().insert(RequestCost(42));
/// assert_eq!(cost.cost(&request.into_parts().0), 42);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct FromExtension {
    default: u64,
}

impl FromExtension {
    /// Reads [`RequestCost`]; requests without one cost `default`.
    pub fn or(default: u64) -> Self {
        Self { default }
    }
}

/// A request's cost, set as an extension by middleware that runs before the limiter.
///
/// The limiter reads it with [`FromExtension`]:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tollgate::cost::{FromExtension, RequestCost};
/// use tollgate::key::Global;
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = ServiceBuilder::new()
///     // Earlier middleware prices a batch by its size.
///     .map_request(|mut request: Request<()>| {
///         let size = request.headers().get("x-batch-size")
///             .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
///         request.extensions_mut().insert(RequestCost(size.unwrap_or(1)));
///         request
///     })
///     .layer(
///         RateLimitLayer::new(MemoryStore::new())
///             .key(Global)
///             .cost(FromExtension::or(1))
///             .policy(Policy::token_bucket("items", 10, Rate::per_hour(10))?),
///     )
///     .service(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
///     }));
/// let batch = || Request::post("/batch").header("x-batch-size", "8").body(()).unwrap();
/// assert_eq!(service.clone().oneshot(batch()).await?.status(), 200);
/// assert_eq!(service.clone().oneshot(batch()).await?.status(), 429); // 2 items left
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCost(pub u64);

impl Cost for FromExtension {
    fn cost(&self, parts: &Parts) -> u64 {
        parts
            .extensions
            .get::<RequestCost>()
            .map_or(self.default, |cost| cost.0)
    }

    fn reads_request_cost(&self) -> bool {
        true
    }
}

/// A cost from a closure; see [`from_fn`].
///
/// ```
/// use http::{Method, Request};
/// use tollgate::cost::{self, Cost, FromFn};
/// use tollgate::{MemoryStore, RateLimitLayer};
///
/// let writes_cost_more: FromFn<_> = cost::from_fn(|parts| match parts.method {
///     Method::GET | Method::HEAD => 1,
///     _ => 5,
/// });
/// let (get, _) = Request::get("/items").body(()).unwrap().into_parts();
/// let (put, _) = Request::put("/items/7").body(()).unwrap().into_parts();
/// assert_eq!(writes_cost_more.cost(&get), 1);
/// assert_eq!(writes_cost_more.cost(&put), 5);
/// let layer = RateLimitLayer::new(MemoryStore::new()).cost(writes_cost_more);
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct FromFn<F> {
    f: F,
}

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FromFn")
    }
}

/// A cost from a closure over the request head.
///
/// ```
/// use http::Request;
/// use tollgate::cost::{self, Cost};
///
/// // Charge by the declared upload size, one unit per started KiB; an upload that
/// // declares no size (sent chunked, whatever a `Content-Length` beside it says: RFC
/// // 9112, section 6.3) is charged a whole 10 MiB, so that it cannot pass for one unit
/// // (as `ContentLength::or` does).
/// let by_size = cost::from_fn(|parts| {
///     if parts.headers.contains_key("transfer-encoding") {
///         return 10 * 1024;
///     }
///     parts.headers.get("content-length")
///         .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
///         .map_or(10 * 1024, |bytes| bytes.div_ceil(1024).max(1))
/// });
/// let (parts, _) = Request::post("/").header("content-length", "5000").body(()).unwrap().into_parts();
/// assert_eq!(by_size.cost(&parts), 5);
/// let (chunked, _) = Request::post("/")
///     .header("content-length", "1")
///     .header("transfer-encoding", "chunked")
///     .body(()).unwrap().into_parts();
/// assert_eq!(by_size.cost(&chunked), 10 * 1024);
/// ```
pub fn from_fn<F>(f: F) -> FromFn<F>
where
    F: Fn(&Parts) -> u64 + Send + Sync + 'static,
{
    FromFn { f }
}

impl<F> Cost for FromFn<F>
where
    F: Fn(&Parts) -> u64 + Send + Sync + 'static,
{
    fn cost(&self, parts: &Parts) -> u64 {
        (self.f)(parts)
    }
}

/// Charges the request's declared body size, its `Content-Length`, in bytes: for upload
/// and bandwidth quotas. Advertise such a policy with
/// [`QuotaUnit::ContentBytes`](crate::policy::QuotaUnit::ContentBytes) so clients see
/// `qu="content-bytes"`.
///
/// A request whose head does not state its body's size costs `unknown`: a chunked upload
/// (any `Transfer-Encoding`, which overrides a `Content-Length` beside it: RFC 9112,
/// section 6.3), a malformed or repeated `Content-Length`, an upgrade or a tunnel
/// (`Upgrade` other than `h2c`, `CONNECT`: what those carry follows the head, whatever
/// length the head gives), an HTTP/2 or HTTP/3 request without a length (those may send a
/// body of any size without one, RFC 9113, section 8.1.1), and a `POST`, `PUT` or `PATCH`
/// without one (or of any method but those below). Pick it so that an upload that does
/// not declare its size cannot pass for free (for example the policy's whole capacity),
/// and put the coster on upload routes: a bodiless HTTP/2 `GET` costs `unknown` too. An
/// HTTP/1.x `GET`, `HEAD`, `DELETE`, `OPTIONS` or `TRACE` with neither field has no body
/// (section 6.3, rule 7) and costs 0, and so does any request stating
/// `Content-Length: 0` that is no chunked upload, upgrade or tunnel. The coster reads the head as it reaches it: put it outside any
/// layer that takes the length off, as request decompression does (inside one, a
/// compressed `DELETE` with a body reads as having none, and costs 0). Outside, it charges
/// what the wire carried. A size larger than the policy can ever admit is the usual `400`.
///
/// ```
/// use http::{Request, Version};
/// use tollgate::cost::{ContentLength, Cost};
///
/// let cost = ContentLength::or(1_000_000);
/// let upload = Request::post("/upload").header("content-length", "2048").body(()).unwrap();
/// assert_eq!(cost.cost(&upload.into_parts().0), 2048);
/// let chunked = Request::post("/upload")
///     .header("content-length", "0")
///     .header("transfer-encoding", "chunked")
///     .body(())
///     .unwrap();
/// assert_eq!(cost.cost(&chunked.into_parts().0), 1_000_000);
/// // HTTP/1.1 with no length and no chunking: no body.
/// let download = Request::get("/files/1").body(()).unwrap();
/// assert_eq!(cost.cost(&download.into_parts().0), 0);
/// let h2 = Request::get("/files/1").version(Version::HTTP_2).body(()).unwrap();
/// assert_eq!(cost.cost(&h2.into_parts().0), 1_000_000);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ContentLength {
    unknown: u64,
}

impl ContentLength {
    /// Charges `Content-Length`; a request whose head does not state its body's size
    /// costs `unknown` (see [`ContentLength`]).
    pub fn or(unknown: u64) -> Self {
        Self { unknown }
    }
}

impl Cost for ContentLength {
    fn cost(&self, parts: &Parts) -> u64 {
        // A `Transfer-Encoding` frames the body, whatever a `Content-Length` beside it
        // says (RFC 9112, section 6.3, rule 3): `Content-Length: 0` before a chunked
        // gigabyte states nothing (older hyper kept such a line). What an upgrade or a
        // tunnel carries follows its head, of a size nothing states.
        if parts.headers.contains_key(http::header::TRANSFER_ENCODING) || switches_protocols(parts)
        {
            return self.unknown;
        }
        let mut values = parts.headers.get_all(http::header::CONTENT_LENGTH).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => value
                .to_str()
                .ok()
                .filter(|text| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
                // All digits but too large for u64: more than any policy admits.
                .map_or(self.unknown, |text| text.parse().unwrap_or(u64::MAX)),
            // An HTTP/1.x request with neither field has no body (RFC 9112, section 6.3,
            // rule 7), read so only for a method whose content has no defined semantics
            // (RFC 9110, section 9.3): a POST, PUT or PATCH without a length is more
            // likely an upload whose length a layer further out took off (request
            // decompression does; the docs say to put the coster outside such a layer,
            // which the head cannot tell). HTTP/2 and HTTP/3 may send a body without a
            // length (RFC 9113, section 8.1.1).
            (None, _)
                if matches!(
                    parts.version,
                    http::Version::HTTP_09 | http::Version::HTTP_10 | http::Version::HTTP_11
                ) && matches!(
                    parts.method,
                    Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
                ) =>
            {
                0
            }
            _ => self.unknown,
        }
    }
}

/// True when `request` asks to switch protocols: HTTP/1.1's `Upgrade` (a WebSocket's
/// handshake), or a `CONNECT` (a tunnel; HTTP/2's extended CONNECT, RFC 8441, opens
/// WebSockets). `Upgrade: h2c` is no switch here: servers that do not speak h2c (hyper)
/// serve the request as it is, and clients that prefer HTTP/2 (the JDK's, curl's) send it
/// on plain `http://` requests of every kind.
pub(crate) fn switches_protocols(request: &Parts) -> bool {
    let other_than_h2c = |value: &http::HeaderValue| {
        value.to_str().map_or(true, |value| {
            value.split(',').any(|protocol| {
                let name = protocol.trim().split('/').next().unwrap_or_default();
                !name.is_empty() && !name.eq_ignore_ascii_case("h2c")
            })
        })
    };
    request.method == Method::CONNECT
        || request
            .headers
            .get_all(http::header::UPGRADE)
            .iter()
            .any(other_than_h2c)
}

#[cfg(test)]
mod tests {
    use http::{Method, Request};

    use super::*;

    fn parts(method: Method, path: &str) -> Parts {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap();
        request.into_parts().0
    }

    /// An extended CONNECT (RFC 8441, section 4; RFC 9220) is HTTP/2's and HTTP/3's
    /// GET with `Upgrade` (a WebSocket): it costs what the route's GET does unless
    /// CONNECT has a cost of its own. A classic CONNECT (authority only) names no route.
    #[test]
    fn an_extended_connect_costs_what_its_get_costs() {
        let cost = PerRoute::new(1)
            .route_method(Method::GET, "/ws", 50)
            .route_method(Method::GET, "/live", 50)
            .route_method(Method::CONNECT, "/live", 7);
        let connect = |uri: &str| {
            let request = Request::builder()
                .method(Method::CONNECT)
                .uri(uri)
                .version(http::Version::HTTP_2)
                .body(())
                .unwrap();
            request.into_parts().0
        };
        assert_eq!(cost.cost(&parts(Method::GET, "/ws")), 50);
        assert_eq!(cost.cost(&connect("https://example.com/ws")), 50);
        assert_eq!(cost.cost(&connect("/ws")), 50);
        assert_eq!(cost.cost(&connect("https://example.com/live")), 7);
        assert_eq!(cost.cost(&connect("example.com:443")), 1);
        // Not over HTTP/1.1, which has no extended CONNECT: a CONNECT with a path there
        // is a CONNECT (with a body, to an `any` route), not the route's cheap GET.
        let (h1, _) = Request::builder()
            .method(Method::CONNECT)
            .uri("/ws")
            .version(http::Version::HTTP_11)
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(cost.cost(&h1), 1);
    }

    /// RFC 9112, section 6.3: an HTTP/1.x request with neither `Content-Length` nor
    /// `Transfer-Encoding` has no body (rule 7), so it costs nothing; `unknown` is for a
    /// body whose size the head does not state (chunked, or HTTP/2 and HTTP/3 without
    /// `Content-Length`, RFC 9113 section 8.1.1). A GET spent an upload quota's whole
    /// `unknown`.
    #[test]
    fn a_request_framed_without_a_body_costs_nothing() {
        let cost = ContentLength::or(1_000_000);
        let head = |version: http::Version, headers: &[(&str, &str)]| {
            let mut request = Request::builder()
                .method(Method::GET)
                .uri("/files/1")
                .version(version);
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            request.body(()).unwrap().into_parts().0
        };
        assert_eq!(cost.cost(&head(http::Version::HTTP_11, &[])), 0);
        // An upgrade (a WebSocket) carries what follows the head, of no stated size, as
        // its HTTP/2 opening (an extended CONNECT) does.
        let upgrade = [("connection", "upgrade"), ("upgrade", "websocket")];
        assert_eq!(
            cost.cost(&head(http::Version::HTTP_11, &upgrade)),
            1_000_000
        );
        let tunnel = Request::builder()
            .method(Method::CONNECT)
            .uri("example.com:443")
            .body(())
            .unwrap();
        assert_eq!(cost.cost(&tunnel.into_parts().0), 1_000_000);
        // An upgrade states no size for what follows its head, whatever length it gives
        // its own (none): `Content-Length: 0` does not make a socket free.
        let upgrade_empty = [("upgrade", "websocket"), ("content-length", "0")];
        assert_eq!(
            cost.cost(&head(http::Version::HTTP_11, &upgrade_empty)),
            1_000_000
        );
        // `Upgrade: h2c` is no switch (hyper serves the request as it is; curl and the
        // JDK send it on plain requests of every kind).
        let h2c = [
            ("connection", "upgrade, http2-settings"),
            ("upgrade", "h2c"),
        ];
        assert_eq!(cost.cost(&head(http::Version::HTTP_11, &h2c)), 0);
        // Only a method whose content has no defined semantics (RFC 9110, section 9.3)
        // is read as bodiless without a length: a POST, PUT or PATCH whose length a layer
        // further out took off (request decompression does) is of no stated size.
        let method = |method: Method| {
            let request = Request::builder().method(method).uri("/files/1");
            cost.cost(&request.body(()).unwrap().into_parts().0)
        };
        for bodiless in [
            Method::GET,
            Method::HEAD,
            Method::DELETE,
            Method::OPTIONS,
            Method::TRACE,
        ] {
            assert_eq!(method(bodiless.clone()), 0, "{bodiless}");
        }
        for with_content in [Method::POST, Method::PUT, Method::PATCH] {
            assert_eq!(method(with_content.clone()), 1_000_000, "{with_content}");
        }
        assert_eq!(cost.cost(&head(http::Version::HTTP_10, &[])), 0);
        assert_eq!(
            cost.cost(&head(http::Version::HTTP_11, &[("content-length", "0")])),
            0
        );
        let chunked = [("transfer-encoding", "chunked")];
        assert_eq!(
            cost.cost(&head(http::Version::HTTP_11, &chunked)),
            1_000_000
        );
        // Chunked framing overrides a length beside it (rule 3).
        let both = [("content-length", "0"), ("transfer-encoding", "chunked")];
        assert_eq!(cost.cost(&head(http::Version::HTTP_11, &both)), 1_000_000);
        assert_eq!(cost.cost(&head(http::Version::HTTP_2, &[])), 1_000_000);
        assert_eq!(cost.cost(&head(http::Version::HTTP_3, &[])), 1_000_000);
        let twice = [("content-length", "5"), ("content-length", "5")];
        assert_eq!(cost.cost(&head(http::Version::HTTP_11, &twice)), 1_000_000);
        assert_eq!(
            cost.cost(&head(http::Version::HTTP_11, &[("content-length", "x")])),
            1_000_000
        );
    }

    /// A backend that resolves dot segments after decoding escapes (nginx in front of a
    /// fallback that proxies) reads `/files/%FF/../big.iso` as `/files/big.iso`: an
    /// escape that decodes to no UTF-8 does not make the spelling free.
    #[test]
    fn an_escape_that_is_no_utf8_is_still_read_through() {
        let cost = PerRoute::new(1).route("/files/big.iso", 100);
        assert_eq!(cost.cost(&parts(Method::GET, "/files/%FF/../big.iso")), 100);
        assert_eq!(
            cost.cost(&parts(Method::GET, "/files/%C3%28/%2E%2E/big.iso")),
            100
        );
        assert_eq!(cost.cost(&parts(Method::GET, "/files/%FF/big.iso")), 1);
    }

    /// An entry listed twice for one route: the last one stands, for `route` as for
    /// `route_method` (a table of defaults, then overrides). `route` kept the first.
    #[test]
    fn the_last_entry_for_a_route_stands() {
        let get = parts(Method::GET, "/a");
        assert_eq!(PerRoute::new(1).route("/a", 2).route("/a", 5).cost(&get), 5);
        let methods = PerRoute::new(1)
            .route_method(Method::GET, "/a", 2)
            .route_method(Method::GET, "/a", 5);
        assert_eq!(methods.cost(&get), 5);
        // And for the spellings a handler reads as the listed path: the entry replaced
        // is gone, not the dearer of the two.
        let respelt = parts(Method::GET, "/a/");
        assert_eq!(
            PerRoute::new(1)
                .route("/a", 5)
                .route("/a", 2)
                .cost(&respelt),
            2
        );
        let methods = PerRoute::new(1)
            .route_method(Method::GET, "/a", 5)
            .route_method(Method::GET, "/a", 2);
        assert_eq!(methods.cost(&respelt), 2);
    }

    /// `path` panics when listed, for every method and for one.
    fn refused_either_way(path: &str) {
        let refused = std::panic::catch_unwind(|| PerRoute::new(1).route(path, 5));
        assert!(refused.is_err(), "{path:?}");
        let refused =
            std::panic::catch_unwind(|| PerRoute::new(1).route_method(Method::GET, path, 5));
        assert!(refused.is_err(), "{path:?}");
    }

    /// A route no path can match once cost the default, silently: `search` (no leading
    /// slash) or `/search?q=1` (paths carry no query).
    #[test]
    fn a_route_that_never_matches_is_refused_at_start_up() {
        for path in ["search", "/search?q=1", "/a b", "/a#b", ""] {
            refused_either_way(path);
        }
        let _ = PerRoute::new(1)
            .route("/users/{id}", 2)
            .route("/", 1)
            .route("/v1/models/m:generate", 3);
    }

    /// axum 0.7's captures (`/export/:id`, `/files/*path`), carried over into a listing,
    /// matched no template axum 0.8 writes (`/export/{id}`) and cost the default,
    /// silently; the configuration refused them already. They panic, as axum 0.8's router
    /// does, unless the listing asks for literal segments as its router does
    /// (`without_v07_checks`).
    #[test]
    fn an_axum_0_7_capture_is_refused_unless_asked_for_as_literal_text() {
        for path in ["/export/:id", "/files/*path", "/:tenant/export"] {
            refused_either_way(path);
        }
        let literal = PerRoute::new(1)
            .without_v07_checks()
            .route("/export/:id", 5);
        assert_eq!(literal.cost(&parts(Method::GET, "/export/:id")), 5);
        assert_eq!(literal.cost(&parts(Method::GET, "/export/7")), 1);
    }

    /// RFC 9110, section 9.3.2: a server answers HEAD as it answers GET, without the body,
    /// and axum routes a HEAD to the GET handler: a route's GET cost is its HEAD cost
    /// unless HEAD has one of its own.
    #[test]
    fn a_head_costs_what_its_get_costs() {
        let cost = PerRoute::new(1)
            .route("/search", 5)
            .route_method(Method::GET, "/export", 20)
            .route_method(Method::GET, "/report", 20)
            .route_method(Method::HEAD, "/report", 2);
        assert_eq!(cost.cost(&parts(Method::HEAD, "/export")), 20);
        assert_eq!(cost.cost(&parts(Method::GET, "/export")), 20);
        assert_eq!(cost.cost(&parts(Method::HEAD, "/report")), 2);
        assert_eq!(cost.cost(&parts(Method::HEAD, "/search")), 5);
        assert_eq!(cost.cost(&parts(Method::POST, "/export")), 1);
        // A GET entry and an entry for every method: the GET one, for a HEAD too.
        let both = PerRoute::new(1)
            .route("/export", 3)
            .route_method(Method::GET, "/export", 20);
        assert_eq!(both.cost(&parts(Method::HEAD, "/export")), 20);
        assert_eq!(both.cost(&parts(Method::PUT, "/export")), 3);
    }
}
