//! [`GraphqlCostLayer`]: reads a GraphQL request, charges its cost to the rate limiter
//! behind it, and hands the inner service the same bytes.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower_layer::Layer;
use tower_service::Service;

use super::{CostError, GraphqlCost, Uncosted};
use crate::body::ResponseBody;
use crate::cost::RequestCost;
use crate::respond::problem as response;

/// The response header that reports a request's computed cost.
///
/// It is set on every response of the inner service to a costed request (a limiter's
/// `429` further in included), at the charge a fixed [`Invalid::Charge`] made too; a
/// request passed on uncosted (a `GET` that names no operation) and a refusal of this
/// layer's own carry none.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::cost::graphql::{GRAPHQL_COST, GraphqlCost, GraphqlCostLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = GraphqlCostLayer::new(GraphqlCost::new()).layer(service_fn(
///     |_: Request<Full<Bytes>>| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) },
/// ));
/// let query = r#"{"query":"{ repos(first: 20) { nodes { name } } }"}"#;
/// let costed = service.clone().oneshot(Request::post("/graphql").body(Full::from(query))?).await?;
/// assert_eq!(GRAPHQL_COST.as_str(), "graphql-cost");
/// assert_eq!(costed.headers()[&GRAPHQL_COST], "21"); // repos 1 + 20 x nodes 1
///
/// // The IDE page at the endpoint: no operation, no cost.
/// let page = service.clone().oneshot(Request::get("/graphql").body(Full::default())?).await?;
/// assert!(!page.headers().contains_key(&GRAPHQL_COST));
///
/// let broken = service.oneshot(Request::post("/graphql").body(Full::from(r#"{"query":"{"}"#))?).await?;
/// assert_eq!(broken.status(), 400);
/// assert!(!broken.headers().contains_key(&GRAPHQL_COST));
/// # Ok(()) }
/// ```
pub static GRAPHQL_COST: HeaderName = HeaderName::from_static("graphql-cost");

/// What to do with a request whose cost cannot be computed: a persisted query's hash, a
/// document that does not parse, a body the layer does not read (multipart, another
/// type). In a batch, it stands in for each entry that could not be costed. A request
/// still compressed, or one the coster read and refused (a list size out of range, a batch too large,
/// nesting too deep, a document past the token limit or
/// [`GraphqlCost::max_field_visits`], JSON it cannot parse, a key a server may read as
/// another, a `documentId` beside a `query`, several operations with no
/// `operationName` or an empty one) is refused whatever this says: the server would run
/// it.
///
/// The example sends an automatic persisted query's hash without its document, which no
/// coster can read: [`Reject`](Invalid::Reject) answers it `400`, [`Charge`](Invalid::Charge)
/// passes it on at the fixed charge. A slicing value out of range is refused under both.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{BodyExt, Full};
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::cost::RequestCost;
/// use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer, Invalid};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The inner service answers with the cost it was handed.
/// let inner = service_fn(|request: Request<Full<Bytes>>| async move {
///     let cost = request.extensions().get::<RequestCost>().map_or(0, |cost| cost.0);
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(cost.to_string()))))
/// });
/// let hash_only = || {
///     let body = r#"{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"ecf4edb4"}}}"#;
///     Request::post("/graphql").body(Full::from(body)).unwrap()
/// };
/// let out_of_range = || {
///     let body = r#"{"query":"{ repos(first: 5000) { nodes { name } } }"}"#;
///     Request::post("/graphql").body(Full::from(body)).unwrap()
/// };
///
/// let reject = GraphqlCostLayer::new(GraphqlCost::new()).layer(inner.clone());
/// assert_eq!(Invalid::default(), Invalid::Reject);
/// assert_eq!(reject.clone().oneshot(hash_only()).await?.status(), 400);
///
/// let charge = GraphqlCostLayer::new(GraphqlCost::new())
///     .on_invalid(Invalid::Charge(50))
///     .layer(inner);
/// let passed = charge.clone().oneshot(hash_only()).await?;
/// assert_eq!(passed.status(), 200);
/// assert_eq!(passed.headers()["graphql-cost"], "50");
/// assert_eq!(passed.into_body().collect().await?.to_bytes(), "50");
///
/// // Read and refused: the server would run it, so no fixed charge stands in.
/// assert_eq!(reject.oneshot(out_of_range()).await?.status(), 400);
/// assert_eq!(charge.oneshot(out_of_range()).await?.status(), 400);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Invalid {
    /// Answer `400` with the reason at once; nothing is charged (the default).
    #[default]
    Reject,
    /// Charge this much and pass the request on, for the GraphQL server to report the
    /// error in its own format (or to run the persisted query the charge is sized for).
    Charge(u64),
}

/// Computes each GraphQL request's cost and stores it as a [`RequestCost`] extension for
/// a [`RateLimitLayer`](crate::RateLimitLayer) with [`FromExtension`](crate::cost::FromExtension)
/// further in, so one expensive query spends as much of a budget as many cheap ones.
///
/// It reads `POST` bodies of type `application/json` (one request or a batch; any
/// `+json` type, or no type, alike), `application/graphql` and
/// `application/x-www-form-urlencoded` (parameters, read as a `GET`'s URL is), in UTF-8,
/// and `GET ?query=`. A body that declares another charset is refused whatever
/// `on_invalid` says (a server may decode it by that charset into other keys, or into a
/// costly query). A body of any other type or encoding goes to `on_invalid`, unless it
/// may be JSON all the same (its first character, in any Unicode encoding, is `{` or
/// `[`): a server may read it as JSON whatever its type (async-graphql does), so it is
/// refused whatever `on_invalid` says. Without a schema,
/// `first`, `last` and `limit` size every field, scalars included. Bodies are buffered up to a cap (default
/// 1 MiB; larger: `413`) and handed on byte for byte. The response carries the cost in
/// `GraphQL-Cost`. Requests that run no operation (a CORS preflight or a `HEAD` whose
/// body is empty, a `GET` without `query` or a persisted query's parameters) pass
/// through: the limiter charges them its default cost. Any other request is costed
/// whatever its method; a `HEAD` that names an operation in its URL, as the `GET` it
/// runs. A `GET`'s body is never handed on (nor the headers that frame it), and a `GET`
/// parameter given twice is refused, since a server may take either. Some servers read
/// an operation's parameters from the URL before the body, whatever the method: a
/// request with a body whose URL carries `query` or `variables` (or a persisted query's
/// `extensions` or `documentId`), or an `operationName` other than its body's, is
/// refused; an `application/graphql` body is costed for the operation its URL names. Parameters behind a `;` count too (some servers split on it), and a raw `;` in
/// a `GET` operation's URL is refused.
///
/// What it cannot read, it cannot cost, and [`on_invalid`](Self::on_invalid) decides
/// (`400` by default, or a fixed charge): automatic persisted queries sent as a hash
/// without the document, multipart uploads, and a request to switch protocols (`Upgrade` to anything but
/// `h2c`, or an HTTP/2 extended `CONNECT`): a WebSocket's operations travel in messages
/// this layer never sees (under [`Invalid::Charge`] the socket is let through at that one
/// charge), so serve subscriptions on a route of their own, limited per connection or per
/// message (a `tollgate::limiter::Limiter` in the socket's loop). Put it inside
/// (after) a request-decompression layer (a body still compressed is refused whatever
/// `on_invalid` says: servers that inflate bodies themselves would run any query in
/// it), and charge persisted queries with [`Invalid::Charge`] at what your costliest
/// registered operation costs.
///
/// A request the coster read and refused (a slicing value out of range, a batch too
/// large, nesting too deep, a document past the token limit or
/// [`GraphqlCost::max_field_visits`], a key or parameter a server may read otherwise,
/// several operations with no `operationName` or an empty one, two different
/// `Content-Type` lines or one that is not text, which servers may read otherwise) is refused
/// whatever `on_invalid` says: the server would run it.
///
/// A refusal (`400`, `413`) is answered here, before the limiter further in sees the
/// request, so it spends nothing of the client's budget: a client refused again and
/// again costs the server the reading of each body (at most `max_body`). Where that
/// matters, put a second [`RateLimitLayer`](crate::RateLimitLayer) that counts requests
/// outside (before) this layer.
///
/// The example puts the layer in front of a limiter of 100 points a minute: a query of
/// 60 points is let through and reported in `GraphQL-Cost`, the limiter charges the
/// [`RequestCost`] it was handed (40 points are left), and the same query again finds
/// too few. A query with a list size out of range is refused with `400` before the
/// limiter sees it.
///
/// ```
/// use axum::{Extension, Router, body::Body, routing::post};
/// use http::Request;
/// use tower::ServiceExt;
/// use tollgate::clock::ManualClock;
/// use tollgate::cost::{FromExtension, RequestCost};
/// use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer};
/// use tollgate::key::HeaderKey;
/// use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limiter = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
///     .policy(Policy::token_bucket("points", 100, Rate::per_minute(100))?)
///     .key(HeaderKey::new("x-api-key"))
///     .cost(FromExtension::or(1));
/// let app: Router = Router::new()
///     .route(
///         "/graphql",
///         post(|Extension(RequestCost(cost)): Extension<RequestCost>| async move {
///             format!("costed at {cost}")
///         }),
///     )
///     .layer(limiter)
///     .layer(GraphqlCostLayer::new(GraphqlCost::new())); // runs first
/// let request = |query: &str| {
///     let body = format!(r#"{{"query":"{query}"}}"#);
///     Request::post("/graphql")
///         .header("content-type", "application/json")
///         .header("x-api-key", "k1")
///         .body(Body::from(body))
///         .unwrap()
/// };
/// // repos 1 + 59 x nodes 1
/// let query = "{ repos(first: 59) { nodes { name } } }";
///
/// let first = app.clone().oneshot(request(query)).await?;
/// assert_eq!(first.status(), 200);
/// assert_eq!(first.headers()["graphql-cost"], "60");
/// assert!(first.headers()["ratelimit"].to_str()?.starts_with("\"points\";r=40;"));
///
/// let second = app.clone().oneshot(request(query)).await?;
/// assert_eq!(second.status(), 429);
///
/// let refused = app.oneshot(request("{ repos(first: 500) { nodes { name } } }")).await?;
/// assert_eq!(refused.status(), 400);
/// assert!(!refused.headers().contains_key("ratelimit")); // the limiter never saw it
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GraphqlCostLayer {
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
struct Config {
    coster: GraphqlCost,
    max_body: usize,
    invalid: Invalid,
}

impl GraphqlCostLayer {
    /// Costs requests with `coster`.
    pub fn new(coster: GraphqlCost) -> Self {
        Self {
            config: Arc::new(Config {
                coster,
                max_body: 1024 * 1024,
                invalid: Invalid::default(),
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The largest body read (default 1 MiB); larger bodies get `413`, whatever
    /// [`on_invalid`](Self::on_invalid) says, and are not handed on.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer, Invalid};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = GraphqlCostLayer::new(GraphqlCost::new())
    ///     .max_body(64)
    ///     .on_invalid(Invalid::Charge(10))
    ///     .layer(service_fn(|_: Request<Full<Bytes>>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let post = |body: String| Request::post("/graphql").body(Full::from(body)).unwrap();
    ///
    /// let small = format!(r#"{{"query":"{{ a }}"}}"#); // 17 bytes
    /// assert_eq!(service.clone().oneshot(post(small)).await?.status(), 200);
    /// let large = format!(r#"{{"query":"{{ a }}{}"}}"#, " ".repeat(60)); // 77 bytes
    /// assert_eq!(service.oneshot(post(large)).await?.status(), 413);
    /// # Ok(()) }
    /// ```
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.config_mut().max_body = bytes;
        self
    }

    /// What to do with a request that cannot be costed (default: `400`); see [`Invalid`].
    ///
    /// A multipart upload (GraphQL's file uploads) is one: the layer does not read it.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer, Invalid};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let inner = service_fn(|_: Request<Full<Bytes>>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    /// });
    /// let upload = || {
    ///     Request::post("/graphql")
    ///         .header("content-type", "multipart/form-data; boundary=b")
    ///         .body(Full::from("--b\r\nContent-Disposition: form-data; name=\"operations\"\r\n\r\n..."))
    ///         .unwrap()
    /// };
    /// let strict = GraphqlCostLayer::new(GraphqlCost::new()).layer(inner.clone());
    /// assert_eq!(strict.oneshot(upload()).await?.status(), 400);
    ///
    /// let lenient = GraphqlCostLayer::new(GraphqlCost::new())
    ///     .on_invalid(Invalid::Charge(25))
    ///     .layer(inner);
    /// let response = lenient.oneshot(upload()).await?;
    /// assert_eq!(response.status(), 200);
    /// assert_eq!(response.headers()["graphql-cost"], "25");
    /// # Ok(()) }
    /// ```
    pub fn on_invalid(mut self, invalid: Invalid) -> Self {
        self.config_mut().invalid = invalid;
        self
    }
}

impl<S> Layer<S> for GraphqlCostLayer {
    type Service = GraphqlCostService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GraphqlCostService {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service of [`GraphqlCostLayer`].
#[derive(Debug, Clone)]
pub struct GraphqlCostService<S> {
    inner: S,
    config: Arc<Config>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

enum Read {
    Cost(Result<u64, Uncosted>, Bytes),
    TooLarge,
    Unreadable(String),
}

/// How a GraphQL server reads a request's body.
enum BodyType {
    /// A JSON request (or batch).
    Json,
    /// A GraphQL document (`application/graphql`).
    Document,
    /// A form (`application/x-www-form-urlencoded`): parameters, as a `GET`'s URL has.
    Form,
}

/// What the body of `request` is read as: JSON (`application/json`, any `+json` type, or
/// no type at all), a GraphQL document (`application/graphql`) or a form's parameters
/// (`application/x-www-form-urlencoded`), in UTF-8. Another charset is refused (a server
/// decodes it into other keys); any other type or encoding is an error.
fn body_type(request: &http::request::Parts) -> Result<BodyType, Uncosted> {
    // Another charset is refused first, whatever else is wrong with the type or the
    // encoding (a second type field, a coding a server ignores), read in every field.
    for value in request.headers.get_all(header::CONTENT_TYPE) {
        if let Some(charset) = other_charset(&String::from_utf8_lossy(value.as_bytes())) {
            return Err(Uncosted::refused(CostError::Request(format!(
                "the body's charset is {charset:?}: only UTF-8 is read"
            ))));
        }
    }
    // Still compressed: this layer runs outside the decompression it needs. Refused
    // whatever `on_invalid` says: servers that inflate bodies themselves (Express's
    // body-parser, under Apollo Server and express-graphql) would run any query in it at
    // the fixed charge.
    let compressed = request
        .headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|coding| !coding.as_bytes().eq_ignore_ascii_case(b"identity"));
    if compressed {
        return Err(Uncosted::refused(CostError::Request(
            "a compressed body cannot be read: put this layer inside a decompression layer".into(),
        )));
    }
    let mut types = request.headers.get_all(header::CONTENT_TYPE).iter();
    let Some(value) = types.next() else {
        return Ok(BodyType::Json);
    };
    // The same line again (a client or a proxy that sets the field twice) says nothing
    // else: whichever line a server reads, it reads this one.
    let mut types = types.filter(|other| other.as_bytes() != value.as_bytes());
    // Refused whatever `on_invalid` says, as a compressed body is: a server may still
    // read its type as a GraphQL document or a form and run the query in it.
    let value = value
        .to_str()
        .map_err(|_| Uncosted::refused_request("the content type is not text"))?;
    // Two fields of different types, or two types folded into one (by a proxy, or on
    // purpose): the coster would read the body as one, a server or a proxy further on
    // might read it as the other (Go's `Header.Get` reads the first line, others the
    // last), and run a document or a form that is no JSON at the fixed charge.
    if types.next().is_some() || folds_several(value) {
        return Err(Uncosted::refused_request(
            "the request has more than one content type",
        ));
    }
    let media = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/graphql" => Ok(BodyType::Document),
        "application/x-www-form-urlencoded" => Ok(BodyType::Form),
        "application/json" | "" => Ok(BodyType::Json),
        media if media.ends_with("+json") => Ok(BodyType::Json),
        media => Err(CostError::Request(format!(
            "a GraphQL request's body must be application/json or application/graphql, \
             not {media}"
        ))
        .into()),
    }
}

impl Config {
    /// The cost, or what the layer does with a request whose cost cannot be computed:
    /// the charge it passes it on at, or the error it refuses it for. A request read and
    /// refused is refused whatever `on_invalid` says.
    fn or_invalid(&self, cost: Result<u64, Uncosted>) -> Result<u64, CostError> {
        cost.or_else(|uncosted| match self.invalid {
            Invalid::Charge(charge) if !uncosted.refused => Ok(uncosted.charged(charge)),
            Invalid::Reject | Invalid::Charge(_) => Err(uncosted.error),
        })
    }

    /// The cost of a form body, read as its parameters (express-graphql, graphql-go), where
    /// gqlgen reads it no otherwise. gqlgen decodes a form that starts `query=%7B` whole,
    /// `&` and all, and takes any other as the raw text after `query=`, undecoded.
    fn form_cost(&self, form: &str) -> Result<u64, Uncosted> {
        if form.starts_with("query=%7B") {
            let cost = self.parameters_cost(form, "form");
            // With more parameters, gqlgen's text goes on past the query: where the query
            // alone does not cost (a string left open at the `&`), gqlgen's may run.
            return if form.contains('&') {
                cost.map_err(|uncosted| Uncosted {
                    refused: true,
                    ..uncosted
                })
            } else {
                cost
            };
        }
        // Raw text that is the decoded query (nothing to decode) reads alike. Other raw
        // text that is no document (`%` and `+` are no GraphQL tokens) runs nothing there;
        // one that is must be the query the others decode, and is not.
        let raw = form.strip_prefix("query=").unwrap_or(form);
        let alike = form.starts_with("query=") && !raw.contains(['%', '+', '&', ';']);
        if !alike
            && !matches!(
                self.coster.costing(raw, None, None),
                Err(Uncosted {
                    refused: false,
                    error: CostError::Parse(_),
                    ..
                })
            )
        {
            return Err(Uncosted::refused_request(
                "a form gqlgen reads as raw text, a document other than its decoded query",
            ));
        }
        self.parameters_cost(form, "form")
    }

    fn get_cost(&self, parts: &http::request::Parts) -> Result<u64, Uncosted> {
        self.parameters_cost(parts.uri.query().unwrap_or(""), "URL")
    }

    /// The cost of an operation given as parameters (`query`, `operationName`,
    /// `variables`): a `GET`'s URL, or a form body. `given` says which, for messages.
    fn parameters_cost(&self, query_string: &str, given: &str) -> Result<u64, Uncosted> {
        // Some servers split parameters on `;` too, and would read other parameters
        // than these (clients escape a `;` in a value as `%3B`).
        if query_string.contains(';') {
            return Err(Uncosted::refused_request(format!(
                "a raw ';' in the {given} of an operation: some servers split parameters on it"
            )));
        }
        // A `%` not followed by two hex digits is passed through here, and the whole
        // parameter dropped by others (Go's `url.ParseQuery`): `variables` read here
        // and not there leave the document's defaults to run.
        let bytes = query_string.as_bytes();
        let malformed = bytes.iter().enumerate().any(|(at, &byte)| {
            byte == b'%'
                && !bytes
                    .get(at + 1..at + 3)
                    .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
        });
        if malformed {
            return Err(Uncosted::refused_request(format!(
                "a '%' that escapes nothing in the {given} of an operation: some servers drop \
                 the parameter it is in"
            )));
        }
        let mut query = None;
        let mut operation_name = None;
        let mut variables = None;
        let mut document_id = false;
        // express-graphql reads the first 1,000 parameters (Node's `querystring`, empty
        // ones counted): one past them, `variables` say, is not read there.
        if query_string.split('&').nth(MAX_PARAMETERS).is_some() {
            return Err(Uncosted::refused_request(format!(
                "more than {MAX_PARAMETERS} parameters in the {given}: some servers read only \
                 the first {MAX_PARAMETERS}"
            )));
        }
        for (name, value) in form_urlencoded::parse(query_string.as_bytes()) {
            let slot = match &*name {
                "query" => &mut query,
                "operationName" => &mut operation_name,
                "variables" => &mut variables,
                // A server that supports persisted documents may run the stored one
                // (`id` and `doc_id` name one too: Hot Chocolate, Relay).
                "documentId" | "id" | "doc_id" => {
                    document_id = true;
                    continue;
                }
                // `QUERY` would be a query to a server that reads names in any case, and
                // `[query]` or ` query` to PHP and Rack.
                other if super::another_spelling_of_a_request_key(other) => {
                    return Err(Uncosted::refused_request(format!(
                        "{other:?} is a GraphQL parameter to some servers (that read names in \
                         any case, or file it under its name as PHP and Rack do)"
                    )));
                }
                _ => continue,
            };
            // A server may take the first of two, the coster the last: neither is costed.
            if slot.is_some() {
                return Err(Uncosted::refused_request(format!(
                    "several {name} parameters"
                )));
            }
            *slot = Some(value.into_owned());
        }
        if document_id {
            let error = CostError::Request(
                "a documentId, id or doc_id: a persisted document cannot be costed, and a \
                 server may run it rather than the query (or the query rather than it)"
                    .into(),
            );
            // Beside a query: a server without persisted documents runs the query.
            return Err(match query {
                Some(_) => Uncosted::refused(error),
                None => error.into(),
            });
        }
        let query = query.ok_or_else(|| CostError::Request("no query parameter".into()))?;
        let variables = match variables {
            Some(text) => match super::json::parse(text.as_bytes()) {
                Ok(serde_json::Value::Object(map)) => Some(map),
                Ok(serde_json::Value::Null) => None,
                Ok(_) => {
                    return Err(Uncosted::refused_request("variables must be a JSON object"));
                }
                Err(error) => {
                    return Err(Uncosted::refused_request(format!("variables: {error}")));
                }
            },
            None => None,
        };
        self.coster
            .costing(&query, operation_name.as_deref(), variables.as_ref())
    }
}

/// The coster's refusal `response` as `method` can carry it: a `HEAD`'s without its body,
/// as the limiter's own answers are (see `respond::grpc::fit`).
fn refusal(
    method: &Method,
    headers: &http::HeaderMap,
    response: Response<Bytes>,
) -> Response<Bytes> {
    *crate::respond::grpc::fit(method, headers, Box::new(response))
}

impl<S: Clone> GraphqlCostService<S> {
    /// The inner service, for a call that goes on after `call` returns; a clone stays.
    fn take_inner(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }

    /// Answers `request` as `cost` says, through `on_invalid` when it could not be
    /// computed: the inner service's response with the cost, or a refusal.
    fn answer<B, ResBody>(
        &mut self,
        request: Request<B>,
        cost: Result<u64, Uncosted>,
    ) -> BoxFuture<Result<Response<ResBody>, S::Error>>
    where
        S: Service<Request<B>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        B: Send + 'static,
        ResBody: ResponseBody,
    {
        match self.config.or_invalid(cost) {
            Ok(cost) => {
                let mut inner = self.take_inner();
                Box::pin(async move { call_costed(&mut inner, request, cost).await })
            }
            Err(error) => {
                let response = response::invalid_request(&error.to_string());
                let response = refusal(request.method(), request.headers(), response);
                Box::pin(async move { Ok(response.map(ResBody::from_bytes)) })
            }
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for GraphqlCostService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: ResponseBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        if crate::cost::switches_protocols(&parts) {
            // A WebSocket (`graphql-transport-ws`) runs its operations in messages this
            // layer never sees: at a default cost, one unit would buy any number of them.
            let why = "a request to switch protocols (a WebSocket) carries operations \
                       that cannot be costed";
            let cost = Err(CostError::Request(why.into()).into());
            return self.answer(Request::from_parts(parts, body), cost);
        }
        let get = parts.method == Method::GET;
        // A HEAD runs the GET handler (axum routes it so): one that names an operation in
        // its URL is costed as that GET.
        let named = (get || parts.method == Method::HEAD) && names_an_operation(&parts);
        if get || named {
            // A GET's operation is in its query string. A body, which a server might read
            // instead, is not handed on, nor the headers that frame it.
            drop(body);
            parts.headers.remove(header::CONTENT_LENGTH);
            parts.headers.remove(header::TRANSFER_ENCODING);
            if !named {
                // Nothing to cost: the limiter further in charges its default.
                let request = Request::from_parts(parts, B::from(Bytes::new()));
                return Box::pin(self.inner.call(request));
            }
            let cost = self.config.get_cost(&parts);
            return self.answer(Request::from_parts(parts, B::from(Bytes::new())), cost);
        }
        let quiet = matches!(parts.method, Method::OPTIONS | Method::HEAD);
        if quiet && (body.is_end_stream() || body.size_hint().upper() == Some(0)) {
            // A preflight (even to a GET's URL, which names an operation) or a HEAD
            // without a body runs nothing.
            return Box::pin(self.inner.call(Request::from_parts(parts, body)));
        }
        if !quiet && carries_an_operation_in_its_url(&parts) {
            // Some servers read `query` or `variables` from the URL before the body,
            // whatever the method: which one they would run is theirs to say, so the
            // request is not costed by its body. (A HEAD's or an OPTIONS's, once its body
            // is read and found not empty.)
            let cost = Err(Uncosted::refused_request(URL_AND_BODY));
            return self.answer(Request::from_parts(parts, body), cost);
        }
        // The body is read first, at the client's pace: the instance made ready is
        // dropped now, with what its readiness holds (a `ConcurrencyLimit`'s permit, a
        // limiter's), and a clone is made ready once the body is read. Held through a
        // slow upload, it kept every other request out.
        let mut inner = self.inner.clone();
        self.inner = inner.clone();
        let config = Arc::clone(&self.config);
        Box::pin(async move {
            let read = match Limited::new(body, config.max_body).collect().await {
                Ok(collected) => {
                    let bytes = collected.to_bytes();
                    if quiet && bytes.is_empty() {
                        // A preflight or a HEAD whose body is empty once read runs nothing
                        // either.
                        let request = Request::from_parts(parts, B::from(bytes));
                        std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                        return inner.call(request).await;
                    }
                    if quiet && carries_an_operation_in_its_url(&parts) {
                        // A HEAD or an OPTIONS with a body is read as a POST: the server
                        // might run its URL's operation instead.
                        let response = response::invalid_request(URL_AND_BODY);
                        return Ok(refusal(&parts.method, &parts.headers, response)
                            .map(ResBody::from_bytes));
                    }
                    // An `operationName` in the URL, which some servers take over the
                    // body's: the operation costed must be the one it names.
                    let named = url_operation_name(&parts);
                    let mismatch = || {
                        Err(Uncosted::refused_request(
                            "the operationName in the URL is not the body's",
                        ))
                    };
                    // A body of a type or an encoding this layer does not read may still be
                    // read as JSON by a server (async-graphql reads every body that is not
                    // multipart as JSON, whatever its type, charset or encoding), or as
                    // the form its type says (graphql-go): one that is JSON is refused
                    // whatever `on_invalid` says, and only a body that is not goes there.
                    // "Is JSON": starts `{` or `[`, in UTF-16 or UTF-32 too, which a server
                    // may detect by itself. (Another charset is refused already.)
                    let body_type = body_type(&parts).map_err(|uncosted| {
                        if !uncosted.refused && super::looks_like_json(&bytes) {
                            Uncosted {
                                refused: true,
                                ..uncosted
                            }
                        } else {
                            uncosted
                        }
                    });
                    let cost = match (body_type, named) {
                        (Err(uncosted), _) => Err(uncosted),
                        (_, Some(None)) => mismatch(),
                        // A server may run a document's only operation whatever the URL
                        // names, and read a body it takes for a form (gqlgen): what this
                        // body does not cost as it stands is refused, not charged.
                        (Ok(BodyType::Document), named) => match std::str::from_utf8(&bytes) {
                            Ok(query) => config
                                .coster
                                .costing(query, named.flatten().as_deref(), None)
                                .map_err(|uncosted| Uncosted {
                                    refused: true,
                                    ..uncosted
                                }),
                            // A server may decode it leniently, and run what it makes of it.
                            Err(_) => Err(Uncosted::refused_request("the body is not UTF-8")),
                        },
                        // A form is an operation's parameters, as a `GET`'s URL has them
                        // (express-graphql and graphql-go run it). One that is JSON as
                        // well was refused above by its type; here it is by its bytes.
                        (Ok(BodyType::Form), named) => match std::str::from_utf8(&bytes) {
                            Err(_) => Err(Uncosted::refused_request("the form is not UTF-8")),
                            Ok(form) if read_as_json(form) => Err(Uncosted::refused_request(
                                "a form body that is JSON or holds \"query\": a server may \
                                 read it as JSON",
                            )),
                            // Its operationName is the form's; one in the URL as well may
                            // be taken over it.
                            Ok(_) if named.is_some() => mismatch(),
                            Ok(form) => config.form_cost(form),
                        },
                        (_, Some(Some(named))) if !names_in_body(&bytes, &named) => mismatch(),
                        _ => config.coster.json_costing(&bytes),
                    };
                    Read::Cost(cost, bytes)
                }
                Err(error) if error.is::<http_body_util::LengthLimitError>() => Read::TooLarge,
                Err(error) => Read::Unreadable(error.to_string()),
            };
            let (cost, bytes) = match read {
                Read::TooLarge => {
                    let response = response::payload_too_large(config.max_body);
                    return Ok(
                        refusal(&parts.method, &parts.headers, response).map(ResBody::from_bytes)
                    );
                }
                Read::Unreadable(why) => {
                    let response =
                        response::invalid_request(&format!("the body could not be read: {why}"));
                    return Ok(
                        refusal(&parts.method, &parts.headers, response).map(ResBody::from_bytes)
                    );
                }
                Read::Cost(cost, bytes) => match config.or_invalid(cost) {
                    Ok(cost) => (cost, bytes),
                    Err(error) => {
                        let response = response::invalid_request(&error.to_string());
                        return Ok(refusal(&parts.method, &parts.headers, response)
                            .map(ResBody::from_bytes));
                    }
                },
            };
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
            call_costed(&mut inner, Request::from_parts(parts, B::from(bytes)), cost).await
        })
    }
}

/// Why a request with a body whose URL carries `query` or `variables` is refused.
const URL_AND_BODY: &str = "a GraphQL request with a body must not carry the operation's \
                            query or variables in its URL: the server might run those instead";

/// True when a server may read a form body as JSON: one that is JSON (async-graphql reads
/// every body so), or holds `"query"` (gqlgen reads such a form as JSON, its first value
/// whatever follows).
fn read_as_json(form: &str) -> bool {
    form.contains("\"query\"")
        || serde_json::from_slice::<serde_json::Value>(super::without_bom(form.as_bytes())).is_ok()
}

/// True when a `Content-Type` value holds a comma outside a quoted string: two types
/// folded into one field (`a/b;x=1, c/d`).
fn folds_several(value: &str) -> bool {
    let mut quoted = false;
    let mut escaped = false;
    for byte in value.bytes() {
        match byte {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b',' if !quoted => return true,
            _ => {}
        }
    }
    false
}

/// True when a `GET` names an operation to run: by `query`, or a persisted query by its
/// `extensions`, `documentId`, `id` or `doc_id`. Without any (the IDE page many servers
/// show at the endpoint), it runs nothing.
fn names_an_operation(parts: &http::request::Parts) -> bool {
    url_names_any(
        parts,
        &["query", "extensions", "documentId", "id", "doc_id"],
    )
}

/// A URL's parameters, split on `&` and on `;` alike: some servers (Rack before 3, Go
/// before 1.17) split on both, so a parameter behind a `;` counts as given.
fn url_parameters(
    parts: &http::request::Parts,
) -> impl Iterator<Item = (Cow<'_, str>, Cow<'_, str>)> {
    parts
        .uri
        .query()
        .into_iter()
        .flat_map(|query| query.split(';'))
        .flat_map(|piece| form_urlencoded::parse(piece.as_bytes()))
}

/// The charset a content type names, when it is not UTF-8 (`utf8` is Java's and MySQL's
/// name for it). A body in another one is refused whatever it holds: a server may decode
/// it by that charset (Spring's converter does), and no test of its bytes holds for every
/// charset (EBCDIC's `{` is 0xC0).
fn other_charset(content_type: &str) -> Option<&str> {
    content_type.split(';').skip(1).find_map(|parameter| {
        let (name, charset) = parameter.split_once('=')?;
        // A folded field's next type is not this charset's (said as two types below).
        let charset = charset.split(',').next().unwrap_or(charset);
        let charset = charset.trim().trim_matches('"');
        (name.trim().eq_ignore_ascii_case("charset")
            && !charset.eq_ignore_ascii_case("utf-8")
            && !charset.eq_ignore_ascii_case("utf8"))
        .then_some(charset)
    })
}

/// True when a request's URL names one of `names`, in any case or with the spaces and
/// brackets PHP and Rack read past (as some servers read them).
fn url_names_any(parts: &http::request::Parts, names: &[&str]) -> bool {
    url_parameters(parts).any(|(name, _)| {
        let filed = super::filed_under(&name);
        names
            .iter()
            .any(|known| super::same_to_a_server(&filed, known))
    })
}

/// True when a request's URL carries a GraphQL operation's document or variables (`query`,
/// `variables`, or a persisted query's `extensions` or `documentId`).
fn carries_an_operation_in_its_url(parts: &http::request::Parts) -> bool {
    // Not `id`: in the URL of a request with a body it is the application's own
    // (`?id=tenant-7`) more often than a persisted query's, which travels in the body.
    url_names_any(
        parts,
        &["query", "variables", "extensions", "documentId", "doc_id"],
    )
}

/// The most parameters a URL or a form is read with: Node's `querystring` (express-graphql)
/// reads this many and drops the rest.
const MAX_PARAMETERS: usize = 1_000;

/// The `operationName` in a request's URL: `None` without one, `Some(None)` when it is
/// given twice with different values (no single operation is named).
fn url_operation_name(parts: &http::request::Parts) -> Option<Option<String>> {
    let mut names = url_parameters(parts)
        .filter(|(name, _)| super::same_to_a_server(&super::filed_under(name), "operationName"))
        .map(|(_, value)| value.into_owned());
    let first = names.next()?;
    Some(names.all(|other| other == first).then_some(first))
}

/// True when `body` is one JSON request whose `operationName` is `name`.
fn names_in_body(body: &[u8], name: &str) -> bool {
    serde_json::from_slice::<serde_json::Value>(super::without_bom(body)).is_ok_and(|request| {
        request
            .get("operationName")
            .and_then(serde_json::Value::as_str)
            == Some(name)
    })
}

/// Calls `inner` with `cost` recorded for the limiter, and reports it in `GraphQL-Cost`.
async fn call_costed<S, B, ResBody>(
    inner: &mut S,
    mut request: Request<B>,
    cost: u64,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    request.extensions_mut().insert(RequestCost(cost));
    // Behind a limiter that read the cost already: is there one further in to charge it?
    // (The mark goes no further: a coster nested further in is not behind that limiter.)
    let handed = request
        .extensions_mut()
        .remove::<crate::cost::CostRead>()
        .is_some()
        .then(crate::cost::Handed::default);
    if let Some(handed) = &handed {
        request.extensions_mut().insert(handed.clone());
    }
    let mut response = inner.call(request).await?;
    if handed.is_some_and(|handed| !handed.read()) {
        crate::telemetry::graphql_cost_unread(cost);
    }
    response
        .headers_mut()
        .insert(GRAPHQL_COST.clone(), HeaderValue::from(cost));
    Ok(response)
}
