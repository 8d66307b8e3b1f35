//! The layer over real HTTP: an axum server on a loopback port and a hyper client.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tollgate::cost::PerRoute;
use tollgate::key::{ClientIp, ExtensionKey, HeaderKey, KeyExtractorExt};
use tollgate::resolve_with;
use tollgate::{
    DecideFuture, FailureMode, HeaderStyle, Key, MemoryStore, MissingKey, Policy, PolicySet, Rate,
    RateLimitLayer, Rejection, Store, StoreError, StoreErrorKind,
};
use tower::ServiceExt;

struct Server {
    addr: SocketAddr,
    client: Client<HttpConnector, Body>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    /// The `RateLimit` field as text.
    fn rate(&self) -> &str {
        self.headers["ratelimit"].to_str().unwrap()
    }
}

impl Server {
    async fn start(app: Router) -> Self {
        Self::start_with(app, true).await
    }

    async fn start_with(app: Router, connect_info: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            if connect_info {
                axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<SocketAddr>(),
                )
                .await
                .unwrap();
            } else {
                axum::serve(listener, app).await.unwrap();
            }
        });
        let client = Client::builder(TokioExecutor::new()).build_http();
        Self { addr, client, task }
    }

    async fn send(&self, request: http::request::Builder) -> Reply {
        let request = request.body(Body::empty()).unwrap();
        let (mut parts, body) = request.into_parts();
        parts.uri = format!("http://{}{}", self.addr, parts.uri)
            .parse()
            .unwrap();
        let response = self
            .client
            .request(Request::from_parts(parts, body))
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }

    async fn get(&self, path: &str) -> Reply {
        self.send(Request::get(path)).await
    }
}

fn api_bucket() -> Policy {
    Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap()
}

fn hello_app() -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/search", get(|| async { "results" }))
}

#[tokio::test]
async fn headers_on_every_response_and_a_problem_on_429() {
    let limiter = RateLimitLayer::new(MemoryStore::new()).policy(api_bucket());
    let server = Server::start(hello_app().layer(limiter)).await;

    let first = server.get("/").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, "hello");
    assert_eq!(first.headers["ratelimit-policy"], "\"api\";q=10;w=2");
    assert_eq!(first.headers["ratelimit"], "\"api\";r=9;t=1");
    assert!(first.headers.get("retry-after").is_none());

    // Within the same second nothing refills more than a couple of tokens; keep asking
    // until denied (at most capacity + what refills meanwhile).
    let mut denied = None;
    for _ in 0..100 {
        let reply = server.get("/").await;
        if reply.status == StatusCode::TOO_MANY_REQUESTS {
            denied = Some(reply);
            break;
        }
        assert!(reply.headers.contains_key("ratelimit"));
    }
    let denied = denied.expect("the bucket never ran out");
    let retry_after: u64 = denied.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(retry_after, 1, "one token takes 200 ms, rounded up to 1 s");
    assert_eq!(denied.headers["content-type"], "application/problem+json");
    assert_eq!(denied.headers["ratelimit-policy"], "\"api\";q=10;w=2");
    // draft-11: t is the effective window, the next token 0.2 s away, rounded up.
    assert_eq!(denied.rate(), "\"api\";r=0;t=1");
    assert_eq!(
        denied.body,
        "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
         \"title\":\"Request cannot be satisfied as assigned quota has been exceeded\",\
         \"status\":429,\"detail\":\"rate limit \\\"api\\\" exceeded; retry in 1 s\",\
         \"violated-policies\":[\"api\"],\"policy\":\"api\",\"retry_after\":1}"
    );
}

#[tokio::test]
async fn a_spoofed_leftmost_forwarded_for_is_ignored() {
    let key = ClientIp::behind_proxies(["127.0.0.1"]).unwrap();
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 3, Duration::from_secs(3600)).unwrap())
        .key(key);
    let server = Server::start(hello_app().layer(limiter)).await;

    // The proxy (us, on 127.0.0.1) vouches for 198.51.100.7; the client made up the rest.
    let mut statuses = Vec::new();
    for i in 0..5 {
        let reply = server
            .send(Request::get("/").header("x-forwarded-for", format!("10.{i}.0.1, 198.51.100.7")))
            .await;
        statuses.push(reply.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // Another client behind the same proxy has its own budget.
    let other = server
        .send(Request::get("/").header("x-forwarded-for", "198.51.100.8"))
        .await;
    assert_eq!(other.status, StatusCode::OK);
    // Without the header the walk ends on the trusted peer itself, a bucket of its own.
    let direct = server.get("/").await;
    assert_eq!(direct.status, StatusCode::OK);
}

#[tokio::test]
async fn several_policies_are_all_or_nothing_over_http() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("burst", 3, Rate::per_hour(1)).unwrap())
        .policy(Policy::fixed_window("daily", 5, Duration::from_secs(86_400)).unwrap());
    let server = Server::start(hello_app().layer(limiter)).await;
    for expected_burst in [2, 1, 0] {
        let reply = server.get("/").await;
        assert_eq!(reply.status, StatusCode::OK);
        let expected = format!("\"burst\";r={expected_burst};");
        assert!(reply.rate().starts_with(&expected));
    }
    for _ in 0..3 {
        let reply = server.get("/").await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            reply.headers["ratelimit-policy"],
            "\"burst\";q=3;w=10800, \"daily\";q=5;w=86400"
        );
        // The daily budget was not touched by the denials.
        assert!(reply.rate().contains("\"daily\";r=2;"));
    }
}

#[tokio::test]
async fn per_route_costs_debit_one_bucket() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 10, Rate::per_hour(1)).unwrap())
        .cost(PerRoute::new(1).route("/search", 5));
    let server = Server::start(hello_app().layer(limiter)).await;
    let search = server.get("/search").await;
    assert_eq!(search.status, StatusCode::OK);
    assert_eq!(search.body, "results");
    assert!(search.rate().starts_with("\"api\";r=5;"));
    let root = server.get("/").await;
    assert!(root.rate().starts_with("\"api\";r=4;"));
    // 4 left: a search (5) is denied, four plain requests still fit.
    assert_eq!(
        server.get("/search").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..4 {
        assert_eq!(server.get("/").await.status, StatusCode::OK);
    }
    assert_eq!(server.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
}

/// A route axum matched by a wildcard (a tonic service merged into a router is one
/// `/{Service}/{*rest}` route) names no method: an entry for the request's own path is
/// its cost. It cost the default, whatever the table said.
#[tokio::test]
async fn a_route_matched_by_a_wildcard_costs_what_its_path_costs() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 10, Rate::per_hour(1)).unwrap())
        .cost(
            PerRoute::new(1)
                .route("/greeter.Greeter/SayHello", 5)
                .route("/greeter.Greeter/{*rest}", 2),
        );
    let app = Router::new()
        .route("/greeter.Greeter/{*rest}", get(|| async { "hi" }))
        .layer(limiter);
    let server = Server::start(app).await;
    let costly = server.get("/greeter.Greeter/SayHello").await;
    assert!(
        costly.rate().starts_with("\"api\";r=5;"),
        "{}",
        costly.rate()
    );
    // Other paths under the wildcard cost what its template costs.
    let other = server.get("/greeter.Greeter/Wave").await;
    assert!(other.rate().starts_with("\"api\";r=3;"), "{}", other.rate());
    // The listed path in escapes is the same path to a handler (axum decodes what a
    // wildcard captured): it costs what the listed path costs (5, more than the 3 left),
    // not the template's 2.
    let escaped = server.get("/greeter.Greeter/Say%48ello").await;
    assert_eq!(
        escaped.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        escaped.rate()
    );
    assert!(
        escaped.rate().starts_with("\"api\";r=3;"),
        "{}",
        escaped.rate()
    );

    // Nested, the layer sees the whole template (`/api/{*rest}`) and a URI with the
    // prefix taken off (`/health`): the path looked up is the whole one, or `/api/health`
    // would cost what a top-level `/health` costs, and `/api/special` would never match.
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 10, Rate::per_hour(1)).unwrap())
        .cost(
            PerRoute::new(1)
                .route("/health", 0)
                .route("/api/special", 2)
                .route("/api/{*rest}", 3),
        );
    let inner = Router::new()
        .route("/{*rest}", get(|| async { "nested" }))
        .layer(limiter);
    let server = Server::start(Router::new().nest("/api", inner)).await;
    let nested = server.get("/api/health").await;
    assert_eq!(nested.body, "nested");
    assert!(
        nested.rate().starts_with("\"api\";r=7;"),
        "{}",
        nested.rate()
    );
    let special = server.get("/api/special").await;
    assert!(
        special.rate().starts_with("\"api\";r=5;"),
        "{}",
        special.rate()
    );
    // Stripped to `/api/special`, a path listed whole: still the template's cost.
    let doubled = server.get("/api/api/special").await;
    assert!(
        doubled.rate().starts_with("\"api\";r=2;"),
        "{}",
        doubled.rate()
    );
}

/// A layer of one 100-unit bucket for every request, costed by `cost`.
fn priced(cost: PerRoute) -> RateLimitLayer<MemoryStore, tollgate::key::Global, PerRoute> {
    RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 100, Rate::per_hour(1)).unwrap())
        .key(tollgate::key::Global)
        .cost(cost)
}

/// The `RateLimit` field of `app`'s response to `method path`.
async fn field_after(app: &Router, method: http::Method, path: &str) -> String {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    response.headers()["ratelimit"].to_str().unwrap().to_owned()
}

/// On a wildcard route, an entry of the request's path for every method and the
/// template's entry for the request's method both apply: the larger counts. A `PUT` to a
/// path listed cheap for reads cost what the read costs (here nothing: an upload for
/// free); the other way round, a cheap method entry of the template would undercut a path
/// listed dear.
#[tokio::test]
async fn of_a_paths_and_a_methods_entry_on_a_wildcard_the_larger_counts() {
    use http::Method;
    let limiter = priced(
        PerRoute::new(1)
            .route_method(Method::PUT, "/static/{*path}", 50)
            .route("/static/index.html", 0),
    );
    let app = Router::new()
        .route(
            "/static/{*path}",
            get(|| async { "read" }).put(|| async { "written" }),
        )
        .layer(limiter);
    let written = field_after(&app, Method::PUT, "/static/index.html").await;
    assert!(written.starts_with("\"api\";r=50;"), "{written}");
    // A read of the listed path costs what it is listed at.
    let read = field_after(&app, Method::GET, "/static/index.html").await;
    assert!(read.starts_with("\"api\";r=50;"), "{read}");

    let limiter = priced(PerRoute::new(1).route("/files/big.iso", 50).route_method(
        Method::GET,
        "/files/{*path}",
        2,
    ));
    let app = Router::new()
        .route("/files/{*path}", get(|| async { "file" }))
        .layer(limiter);
    let big = field_after(&app, Method::GET, "/files/big.iso").await;
    assert!(big.starts_with("\"api\";r=50;"), "{big}");
    let small = field_after(&app, Method::GET, "/files/small.txt").await;
    assert!(small.starts_with("\"api\";r=48;"), "{small}");
}

/// A service nested with `nest_service` gets no route template from axum, and a URI with
/// the prefix taken off: the path looked up is the whole one, as the docs say to list it
/// (`/api/search`). Looked up as `/search`, every request cost the default.
#[tokio::test]
async fn a_service_nested_with_nest_service_costs_its_whole_path() {
    let limiter = priced(PerRoute::new(1).route("/api/search", 50));
    let api = tower::ServiceBuilder::new()
        .layer(limiter)
        .service(Router::new().route("/search", get(|| async { "found" })));
    let app = Router::new().nest_service("/api", api);
    let field = field_after(&app, http::Method::GET, "/api/search").await;
    assert!(field.starts_with("\"api\";r=50;"), "{field}");
    // A nested service reads its path decoded (a `ServeDir`, a router): the listed path
    // in escapes costs what the listed path does.
    let escaped = field_after(&app, http::Method::GET, "/api/se%61rch").await;
    assert!(escaped.starts_with("\"api\";r=0;"), "{escaped}");
}

/// axum routes a request by its path as written: `/api/%68ealth` is not the static
/// `/api/health` route but the wildcard's (or the fallback's). Its escapes decoded, the
/// path named the cheap route's entry, and the wildcard's handler ran at that cost (0:
/// never limited). A spelling the handler may read otherwise (escapes decoded, `//` and
/// `.` segments gone: a `ServeDir`) only raises a cost, never lowers it.
#[tokio::test]
async fn a_respelled_path_never_costs_less_than_the_route_that_serves_it() {
    let app = Router::new()
        .route("/api/health", get(|| async { "ok" }))
        .route("/api/{*rest}", get(|| async { "proxied" }))
        .layer(priced(
            PerRoute::new(1)
                .route("/api/health", 0)
                .route("/api/{*rest}", 50),
        ));
    let field = field_after(&app, http::Method::GET, "/api/%68ealth").await;
    assert!(field.starts_with("\"api\";r=50;"), "{field}");
    let fallback = Router::new()
        .route("/health", get(|| async { "ok" }))
        .fallback(|| async { "rendered" })
        .layer(priced(PerRoute::new(10).route("/health", 0)));
    let field = field_after(&fallback, http::Method::GET, "/%68ealth").await;
    assert!(field.starts_with("\"api\";r=90;"), "{field}");
    // A file served whatever its spelling: `//` and `.` segments cost as the listed path.
    for spelling in [
        "/assets/big.iso",
        "/assets//big.iso",
        "/assets/./big.iso",
        "/assets/%2E/big.iso",
        "/assets/b%69g.iso",
    ] {
        let files = Router::new()
            .route("/assets/{*file}", get(|| async { "file" }))
            .layer(priced(PerRoute::new(1).route("/assets/big.iso", 40)));
        let field = field_after(&files, http::Method::GET, spelling).await;
        assert!(field.starts_with("\"api\";r=60;"), "{spelling}: {field}");
    }
    // A listing written in escapes (a space cannot be written otherwise) is matched by
    // its respellings too, and `..` segments are resolved as a handler joining the
    // captured path to a directory resolves them.
    for spelling in [
        "/files/my%20report.pdf",
        "/files//my%20report.pdf",
        "/files/./my%20report%2Epdf",
        "/files/tmp/../my%20report.pdf",
    ] {
        let files = Router::new()
            .route("/files/{*file}", get(|| async { "file" }))
            .layer(priced(PerRoute::new(1).route("/files/my%20report.pdf", 40)));
        let field = field_after(&files, http::Method::GET, spelling).await;
        assert!(field.starts_with("\"api\";r=60;"), "{spelling}: {field}");
    }
    // A respelling keeps the listing's precedence: the method's own entry first.
    let methods = Router::new()
        .route("/files/{*file}", get(|| async { "file" }))
        .layer(priced(
            PerRoute::new(1).route("/files/big.iso", 40).route_method(
                http::Method::GET,
                "/files/big.iso",
                2,
            ),
        ));
    let field = field_after(&methods, http::Method::GET, "/files//big.iso").await;
    assert!(field.starts_with("\"api\";r=98;"), "{field}");
    // Of two listings read the same way, the dearest; a listing written in needless
    // escapes is matched by the plain path too.
    for (listings, path) in [
        ([("/api/", 40), ("/api", 1)], "/api%2F"),
        ([("/api", 1), ("/api/", 40)], "/api%2F"),
        ([("/files/%62ig.iso", 40), ("/x", 1)], "/files/big.iso"),
    ] {
        let cost = listings
            .iter()
            .fold(PerRoute::new(1), |cost, (path, units)| {
                cost.route(path, *units)
            });
        let app = Router::new()
            .route("/{*rest}", get(|| async { "any" }))
            .layer(priced(cost));
        let field = field_after(&app, http::Method::GET, path).await;
        assert!(field.starts_with("\"api\";r=60;"), "{path}: {field}");
    }
}

/// One layer keyed by `Route`, in front of two services nested with `nest_service`:
/// axum sets no `MatchedPath` there, so the key is the request's path, the whole of it
/// (`OriginalUri`). It was the path the nested service sees, its prefix taken off:
/// `/v1/search` and `/v2/search` shared one limit (a client of one spent the other's).
#[tokio::test]
async fn route_keys_of_nested_services_are_their_whole_paths() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("per-route", 1, Duration::from_secs(60)).unwrap())
        .key(tollgate::key::Route);
    let nested = || {
        tower::ServiceBuilder::new()
            .layer(limiter.clone())
            .service(Router::new().route("/search", get(|| async { "found" })))
    };
    let app = Router::new()
        .nest_service("/v1", nested())
        .nest_service("/v2", nested());
    let status = |path: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::get(path).body(Body::empty()).unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(status("/v1/search").await, StatusCode::OK);
    assert_eq!(
        status("/v2/search").await,
        StatusCode::OK,
        "a limit of its own"
    );
    assert_eq!(status("/v1/search").await, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn route_layers_share_one_bucket_without_double_charging() {
    // Each route carries its own cost; the store and the policy are shared.
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 10, Rate::per_hour(1)).unwrap());
    let app = Router::new()
        .route(
            "/search",
            get(|| async { "results" }).route_layer(limiter.clone().cost(5)),
        )
        .route("/", get(|| async { "hello" }).route_layer(limiter.clone()));
    let server = Server::start(app).await;
    let search = server.get("/search").await;
    assert!(search.rate().starts_with("\"api\";r=5;"));
    let root = server.get("/").await;
    assert!(root.rate().starts_with("\"api\";r=4;"));
    // Unknown routes are not limited (and not charged) by a route layer.
    let missing = server.get("/nope").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(!missing.headers.contains_key("ratelimit"));
}

#[tokio::test]
async fn a_cost_that_never_fits_is_a_400_without_retry_after() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(api_bucket())
        .cost(PerRoute::new(1).route("/search", 50));
    let server = Server::start(hello_app().layer(limiter)).await;
    let reply = server.get("/search").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.headers.get("retry-after").is_none());
    assert!(reply.body.contains("\"cost\":50"), "{}", reply.body);
    assert!(reply.body.contains("\"limit\":10"));
    assert!(reply.body.contains(tollgate::COST_EXCEEDS_LIMIT));
    // Nothing was spent.
    assert!(
        server.get("/").await.headers["ratelimit"]
            .to_str()
            .unwrap()
            .starts_with("\"api\";r=9;")
    );
}

#[tokio::test]
async fn a_missing_peer_address_is_a_loud_500() {
    let limiter = RateLimitLayer::new(MemoryStore::new()).policy(api_bucket());
    let server = Server::start_with(hello_app().layer(limiter), false).await;
    let reply = server.get("/").await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The client learns the server is at fault, not how it is built (RFC 9457, section
    // 5); the reason goes to the log (tests/tracing_events.rs).
    assert!(reply.body.contains("set up wrong"), "{}", reply.body);
    assert!(!reply.body.contains("connect_info"), "{}", reply.body);
}

#[tokio::test]
async fn api_keys_with_fallback_and_missing_key_modes() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap());
    let server = Server::start(
        hello_app()
            .route_layer(limiter.clone().key(HeaderKey::new("x-api-key")))
            .route(
                "/open",
                get(|| async { "open" }).route_layer(
                    limiter
                        .clone()
                        .key(HeaderKey::new("x-api-key"))
                        .on_missing_key(MissingKey::Allow),
                ),
            )
            .route(
                "/either",
                get(|| async { "either" }).route_layer(
                    limiter
                        .clone()
                        .key(HeaderKey::new("x-api-key").or(ClientIp::peer())),
                ),
            ),
    )
    .await;
    // No key: a client error, not a bypass.
    let reply = server.get("/").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.body.contains("missing header x-api-key"));
    // Each key has its own budget.
    for key in ["alpha", "alpha", "beta"] {
        assert_eq!(
            server
                .send(Request::get("/").header("x-api-key", key))
                .await
                .status,
            StatusCode::OK
        );
    }
    assert_eq!(
        server
            .send(Request::get("/").header("x-api-key", "alpha"))
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Allowed without a key: no limit, no headers.
    let open = server.get("/open").await;
    assert_eq!(open.status, StatusCode::OK);
    assert!(!open.headers.contains_key("ratelimit"));
    // Falls back to the IP.
    let either = server.get("/either").await;
    assert_eq!(either.status, StatusCode::OK);
    assert!(either.headers.contains_key("ratelimit"));
}

#[tokio::test]
async fn a_bad_api_key_is_a_400_not_a_fall_back_to_the_ip_bucket() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
        .key(HeaderKey::new("x-api-key").or(ClientIp::peer()));
    let server = Server::start(hello_app().layer(limiter)).await;
    let bad: [&[&[u8]]; 4] = [
        &[b"sk_live_alpha", b"sk_live_beta"],
        &[b""],
        &[b"   "],
        &[b"sk_live_\xff\xfe"],
    ];
    for _ in 0..3 {
        for values in bad {
            let mut request = Request::get("/");
            for value in values {
                request =
                    request.header("x-api-key", http::HeaderValue::from_bytes(value).unwrap());
            }
            let reply = server.send(request).await;
            assert_eq!(
                reply.status,
                StatusCode::BAD_REQUEST,
                "{values:?}: {}",
                reply.body
            );
            assert!(!reply.headers.contains_key("ratelimit"), "{values:?}");
            assert!(reply.body.contains("x-api-key"), "{}", reply.body);
        }
    }
    // The 400s spent nothing: the IP bucket, reached without a key, is whole.
    let first = server.get("/").await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(first.rate().starts_with("\"api\";r=1;"), "{}", first.rate());
}

#[tokio::test]
async fn missing_key_allow_lets_an_absent_key_through_but_not_an_invalid_one() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
        .key(HeaderKey::new("x-api-key"))
        .on_missing_key(MissingKey::Allow);
    let server = Server::start(hello_app().layer(limiter)).await;
    let open = server.get("/").await;
    assert_eq!(open.status, StatusCode::OK);
    assert!(!open.headers.contains_key("ratelimit"));
    let reply = server
        .send(
            Request::get("/")
                .header("x-api-key", "sk_live_alpha")
                .header("x-api-key", "sk_live_beta"),
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.body);
    // Nor does it hide a server set up wrong.
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(api_bucket())
        .on_missing_key(MissingKey::Allow);
    let server = Server::start_with(hello_app().layer(limiter), false).await;
    assert_eq!(
        server.get("/").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Plan {
    Free,
    Pro,
}

#[derive(Clone)]
struct User {
    id: u32,
    plan: Plan,
}

#[tokio::test]
async fn plans_pick_policies_from_what_auth_middleware_set() {
    let free = PolicySet::from(Policy::token_bucket("api", 2, Rate::per_hour(1)).unwrap());
    let pro = PolicySet::from(Policy::token_bucket("api", 5, Rate::per_hour(1)).unwrap());
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .key(ExtensionKey::new("user", |user: &User| user.id.to_string()))
        .resolver(resolve_with(move |parts, _key| {
            match parts.extensions.get::<User>().map(|user| user.plan) {
                Some(Plan::Pro) => pro.clone(),
                _ => free.clone(),
            }
        }));
    // A stand-in for authentication: the user id and plan come from a header.
    let auth = axum::middleware::from_fn(
        |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
            let id: u32 = request.headers()["x-user"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let plan = if id >= 100 { Plan::Pro } else { Plan::Free };
            request.extensions_mut().insert(User { id, plan });
            next.run(request).await
        },
    );
    let app = hello_app().layer(limiter).layer(auth);
    let server = Server::start(app).await;
    let count = |user: &'static str| {
        let server = &server;
        async move {
            let mut admitted = 0;
            for _ in 0..10 {
                if server
                    .send(Request::get("/").header("x-user", user))
                    .await
                    .status
                    == StatusCode::OK
                {
                    admitted += 1;
                }
            }
            admitted
        }
    };
    assert_eq!(count("7").await, 2);
    assert_eq!(count("8").await, 2);
    assert_eq!(count("100").await, 5);
}

#[tokio::test]
async fn draft_6_and_legacy_styles_and_a_custom_deny_response() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
        .headers(HeaderStyle::Draft6)
        .on_deny(|rejection: &Rejection<'_>| {
            Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .body(Bytes::from(format!(
                    "wait {}s",
                    rejection.retry_after_secs()
                )))
                .unwrap()
        });
    let legacy = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
        .headers(HeaderStyle::Legacy);
    let app = Router::new()
        .route("/", get(|| async { "hello" }).route_layer(limiter))
        .route("/legacy", get(|| async { "old" }).route_layer(legacy));
    let server = Server::start(app).await;
    let ok = server.get("/").await;
    assert_eq!(ok.headers["ratelimit-limit"], "1");
    assert_eq!(ok.headers["ratelimit-remaining"], "0");
    assert!(!ok.headers.contains_key("ratelimit"));
    let denied = server.get("/").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.body.starts_with("wait "));
    assert!(denied.headers.contains_key("retry-after"));
    assert_eq!(denied.headers["ratelimit-remaining"], "0");
    let old = server.get("/legacy").await;
    assert_eq!(old.headers["x-ratelimit-limit"], "1");
    assert!(old.headers.contains_key("x-ratelimit-reset"));
}

/// A deny hook that answers `503` (a service that says "busy" rather than "too many")
/// still tells the client when to come back: RFC 9110, section 10.2.3, Retry-After on a
/// 503 says how long the service is expected to be unavailable; the layer sets it from
/// the denial, as on a 429.
#[tokio::test]
async fn a_deny_hooks_503_carries_retry_after() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::Global)
            .on_deny(|_: &Rejection<'_>| {
                Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .body(Bytes::from("busy"))
                    .unwrap()
            }),
    );
    let send = || {
        app.clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
    };
    assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    let denied = send().await.unwrap();
    assert_eq!(denied.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3600).contains(&retry_after), "{retry_after}");
}

/// A store that answers later (as a networked store does), or fails.
#[derive(Clone)]
struct SlowStore {
    inner: MemoryStore,
    fail: bool,
}

impl Store for SlowStore {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let (inner, key, policies, fail) =
            (self.inner.clone(), key.clone(), policies.clone(), self.fail);
        DecideFuture::new(async move {
            tokio::task::yield_now().await;
            if fail {
                Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "connection refused",
                ))
            } else {
                Ok(inner.check(key.as_str(), &policies, cost))
            }
        })
    }
}

#[tokio::test]
async fn asynchronous_stores_and_failure_modes() {
    let store = |fail| SlowStore {
        inner: MemoryStore::new(),
        fail,
    };
    let policy = Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap();
    let limited = |fail, mode: Option<FailureMode>| {
        let layer = RateLimitLayer::new(store(fail)).policy(policy.clone());
        match mode {
            Some(mode) => layer.on_store_error(mode),
            None => layer,
        }
    };
    let app = Router::new()
        .route(
            "/",
            get(|| async { "hello" }).route_layer(limited(false, None)),
        )
        .route(
            "/fallback",
            get(|| async { "fallback" }).route_layer(limited(true, None)),
        )
        .route(
            "/closed",
            get(|| async { "closed" }).route_layer(limited(true, Some(FailureMode::FailClosed))),
        )
        .route(
            "/open",
            get(|| async { "open" }).route_layer(limited(true, Some(FailureMode::FailOpen))),
        );
    let server = Server::start(app).await;
    let ok = server.get("/").await;
    assert_eq!(ok.status, StatusCode::OK);
    assert!(ok.headers.contains_key("ratelimit"));
    assert_eq!(server.get("/").await.status, StatusCode::TOO_MANY_REQUESTS);
    // The default: a local limiter with the same policies decides, headers and all.
    let local = server.get("/fallback").await;
    assert_eq!(local.status, StatusCode::OK);
    assert!(local.rate().starts_with("\"api\";r=0;"));
    assert_eq!(
        server.get("/fallback").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Fail closed: a store failure is a 503, never a 429.
    let closed = server.get("/closed").await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!closed.headers.contains_key("ratelimit"));
    let open = server.get("/open").await;
    assert_eq!(open.status, StatusCode::OK);
    assert_eq!(open.body, "open");
}

/// A store that never answers.
#[derive(Clone)]
struct StuckStore;

impl Store for StuckStore {
    fn decide(&self, _key: &Key, _policies: &PolicySet, _cost: u64) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }
}

#[tokio::test(start_paused = true)]
async fn a_stuck_store_times_out_and_the_breaker_stops_calling_it() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        RateLimitLayer::new(StuckStore)
            .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::Global)
            .store_timeout(Duration::from_millis(20))
            .circuit_breaker(tollgate::CircuitBreaker::new(2, Duration::from_secs(60))),
    );
    let start = tokio::time::Instant::now();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
    }
    // Fallback limit of 2, then 429: every request answered.
    assert_eq!(statuses, [200, 200, 429, 429]);
    // Two timeouts opened the breaker; the next requests did not wait at all.
    assert_eq!(
        tokio::time::Instant::now() - start,
        Duration::from_millis(40)
    );
}

/// A store that decides its first request at once, and then answers nothing: no
/// decision, no adjustment.
#[derive(Clone, Default)]
struct StuckSettles(MemoryStore, std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Store for StuckSettles {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if self.1.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return DecideFuture::new(std::future::pending());
        }
        DecideFuture::ready(Ok(self.0.check(key.as_str(), policies, cost)))
    }

    fn adjust(
        &self,
        _key: &Key,
        _policies: &PolicySet,
        _adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }

    fn can_adjust(&self) -> bool {
        true
    }
}

/// A response whose request the store debited before the breaker opened is not held for
/// its settle (the breaker keeps requests from waiting on a failing store): the settle
/// goes on in the background, and the response keeps its decision's headers. It waited
/// the store timeout.
#[tokio::test(start_paused = true)]
async fn a_settle_never_holds_a_response_while_the_breaker_is_open() {
    use std::sync::Arc;
    use tollgate::settle::Settle;
    let (entered, mut inside) = tokio::sync::mpsc::unbounded_channel::<()>();
    let go = Arc::new(tokio::sync::Notify::new());
    let handler_go = Arc::clone(&go);
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let (entered, go) = (entered.clone(), Arc::clone(&handler_go));
                async move {
                    entered.send(()).unwrap();
                    go.notified().await;
                    ([("x-tokens-used", "3")], "done")
                }
            }),
        )
        .layer(
            RateLimitLayer::new(StuckSettles::default())
                .policy(Policy::token_bucket("api", 100, Rate::per_second(100)).unwrap())
                .key(HeaderKey::new("x-user"))
                .settle(Settle::from_header("x-tokens-used"))
                .store_timeout(Duration::from_millis(200))
                .circuit_breaker(tollgate::CircuitBreaker::new(1, Duration::from_secs(60))),
        );
    let request = |user: &str| {
        Request::get("/")
            .header("x-user", user)
            .body(Body::empty())
            .unwrap()
    };
    // Reserves 1, waits in the handler, and will have used 3.
    let held = tokio::spawn(app.clone().oneshot(request("a")));
    inside.recv().await.unwrap();
    // The store fails the next request: the breaker opens.
    let down = tokio::spawn(app.clone().oneshot(request("down")));
    inside.recv().await.unwrap();
    go.notify_waiters();
    let released = tokio::time::Instant::now();
    let held = held.await.unwrap().unwrap();
    let held_after = released.elapsed();
    let down = down.await.unwrap().unwrap();
    assert_eq!(held_after, Duration::ZERO, "held");
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(down.status(), StatusCode::OK, "the fallback admits it");
    assert_eq!(
        released.elapsed(),
        Duration::ZERO,
        "the response waited on a settle to a store the breaker holds off"
    );
    // The decision's headers stay.
    assert_eq!(held.headers()["ratelimit"], "\"api\";r=99;t=1");
}

/// A `HangingAdjustments` store, hanging, and leases of 1,000 units taken from it.
fn hanging_leases() -> (
    HangingAdjustments,
    tollgate::store::Leased<HangingAdjustments>,
) {
    let store = HangingAdjustments::default();
    store.hang.store(true, std::sync::atomic::Ordering::SeqCst);
    let leased =
        tollgate::store::Leased::new(store.clone(), 1_000, Duration::from_secs(60)).unwrap();
    (store, leased)
}

/// A store whose decisions answer at once and whose adjustments never do while `hang`
/// is set (a settle to a store that hangs), else a moment later; `adjusted` counts those
/// answered.
#[derive(Clone, Default)]
struct HangingAdjustments {
    inner: MemoryStore,
    hang: std::sync::Arc<std::sync::atomic::AtomicBool>,
    adjusted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Adjustments asked for, answered or not.
    asked: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Store for HangingAdjustments {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.inner.decide(key, policies, cost)
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        use std::sync::atomic::Ordering;
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self.hang.load(Ordering::SeqCst) {
            return DecideFuture::new(std::future::pending());
        }
        let (inner, adjusted) = (self.inner.clone(), std::sync::Arc::clone(&self.adjusted));
        let (key, policies, adjustment) = (key.clone(), policies.clone(), adjustment.clone());
        DecideFuture::new(async move {
            tokio::task::yield_now().await;
            let answer = inner.adjust(&key, &policies, &adjustment).await;
            adjusted.fetch_add(1, Ordering::SeqCst);
            answer
        })
    }

    fn can_adjust(&self) -> bool {
        true
    }
}

/// Decisions served from a lease say nothing of the store behind it, so while the store
/// hung every response waited the whole store timeout for its settle, for as long as the
/// lease lasted. Now a settle the store leaves unanswered stops the next responses from
/// waiting on theirs (they settle in the background) until the store answers one again;
/// the breaker, which only the store's own decisions close, is not opened by them.
#[tokio::test(start_paused = true)]
async fn settles_left_unanswered_are_not_waited_for_until_the_store_answers_again() {
    use std::sync::atomic::Ordering;
    use tollgate::settle::Settle;
    let timeout = Duration::from_millis(50);
    let (store, leased) = hanging_leases();
    // Each request reports 1,500 units used: more than a lease of 1,000 holds, so each
    // settle reaches the store (a charge the leases hold is spent from them, here).
    let app = Router::new()
        .route("/", get(|| async { ([("x-used", "1500")], "done") }))
        .layer(
            RateLimitLayer::new(leased)
                .policy(Policy::token_bucket("api", 10_000, Rate::per_second(10_000)).unwrap())
                .key(tollgate::key::Global)
                .settle(Settle::from_header("x-used"))
                .store_timeout(timeout)
                .on_store_error(FailureMode::FailClosed)
                .circuit_breaker(tollgate::CircuitBreaker::new(1, Duration::from_secs(60))),
        );
    let send = || async {
        let start = tokio::time::Instant::now();
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap());
        let status = response.await.unwrap().status();
        (status, start.elapsed())
    };
    let mut waits = Vec::new();
    for _ in 0..10 {
        let (status, waited) = send().await;
        assert_eq!(status, StatusCode::OK, "the breaker stays closed");
        waits.push(waited);
    }
    // The first settle is given up on; none after it is waited for.
    assert_eq!(waits[0], timeout);
    assert_eq!(waits[1..], [Duration::ZERO; 9], "{waits:?}");
    tokio::time::sleep(2 * timeout).await;
    // The store answers again: the first settle after is not waited for, but its answer
    // is heard, and the next response waits for its settle again.
    store.hang.store(false, Ordering::SeqCst);
    assert_eq!(send().await.0, StatusCode::OK);
    assert_eq!(store.adjusted.load(Ordering::SeqCst), 0, "not waited for");
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        store.adjusted.load(Ordering::SeqCst),
        1,
        "settled in the background"
    );
    assert_eq!(send().await.0, StatusCode::OK);
    assert_eq!(store.adjusted.load(Ordering::SeqCst), 2, "waited for");
}

/// A settle a lease answers itself (a refund into the lease it was served from) is no
/// answer of the store's: it does not clear the mark that the store leaves settles
/// unanswered, or every charge sent to the hanging store after a refund would wait the
/// whole store timeout again.
#[tokio::test(start_paused = true)]
async fn a_settle_a_lease_answers_says_nothing_of_the_store() {
    use tollgate::settle::Settle;
    let timeout = Duration::from_millis(50);
    let (store, leased) = hanging_leases();
    // Each response reports what its request's `x-report` says: 0 (a refund the lease
    // takes back) or 1,500 (a charge no lease of 1,000 holds: the store's).
    let app = Router::new()
        .route(
            "/",
            get(|request: Request<Body>| async move {
                let used = request.headers()["x-report"].clone();
                ([("x-used", used)], "done")
            }),
        )
        .layer(
            RateLimitLayer::new(leased)
                .policy(Policy::token_bucket("api", 10_000, Rate::per_second(10_000)).unwrap())
                .key(tollgate::key::Global)
                .settle(Settle::from_header("x-used"))
                .store_timeout(timeout),
        );
    let mut waits = Vec::new();
    for used in ["1500", "0", "1500", "0", "1500"] {
        let start = tokio::time::Instant::now();
        let request = Request::get("/")
            .header("x-report", used)
            .body(Body::empty())
            .unwrap();
        assert_eq!(app.clone().oneshot(request).await.unwrap().status(), 200);
        waits.push(start.elapsed());
    }
    assert_eq!(waits[0], timeout);
    assert_eq!(waits[1..], [Duration::ZERO; 4], "{waits:?}");
    // The refunds were the lease's: only the three charges reached the store.
    assert_eq!(store.asked.load(std::sync::atomic::Ordering::SeqCst), 3);
}

/// A request held back by shaping waits without the inner service's capacity: a
/// `ConcurrencyLimit` (or a `Buffer`) inside the limiter keeps its permit in the service
/// made ready, and that service was moved into the delayed request, so one client's
/// queue held the permit through its delay and every other client waited behind it.
/// Now the delayed request makes the inner service ready when its delay ends.
#[tokio::test(start_paused = true)]
async fn a_shaping_delay_holds_no_capacity_of_the_inner_service() {
    use tower::ServiceBuilder;
    use tower::limit::ConcurrencyLimitLayer;
    let policy =
        Policy::leaky_bucket_shaping("partner", Rate::per_second(1), Duration::from_secs(5))
            .unwrap();
    let service = ServiceBuilder::new()
        .layer(
            RateLimitLayer::new(paused_store())
                .policy(policy)
                .key(HeaderKey::new("x-client")),
        )
        .layer(ConcurrencyLimitLayer::new(1))
        .service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("sent")))
        });
    let request = |client: &str| {
        Request::get("/")
            .header("x-client", client)
            .body(Body::empty())
            .unwrap()
    };
    let start = tokio::time::Instant::now();
    // Client a: one request goes at once, the next is held back a second.
    let first = service.clone().oneshot(request("a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let held = tokio::spawn(service.clone().oneshot(request("a")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Client b has nothing queued: it is served at once.
    let other = service.clone().oneshot(request("b")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    assert!(
        start.elapsed() < Duration::from_millis(100),
        "client b waited {:?} behind client a's delay",
        start.elapsed()
    );
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn shaping_holds_requests_back_for_their_delay() {
    let policy =
        Policy::leaky_bucket_shaping("partner", Rate::per_second(2), Duration::from_secs(1))
            .unwrap();
    let app = Router::new().route("/", post(|| async { "sent" })).layer(
        RateLimitLayer::new(paused_store())
            .policy(policy)
            .key(tollgate::key::Global),
    );
    let start = tokio::time::Instant::now();
    let mut handles = Vec::new();
    for _ in 0..4 {
        let app = app.clone();
        handles.push(tokio::spawn(async move {
            let response = app
                .oneshot(Request::post("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            (response.status(), tokio::time::Instant::now() - start)
        }));
    }
    let mut results = Vec::new();
    for handle in handles {
        results.push(handle.await.unwrap());
    }
    let ok: Vec<Duration> = results
        .iter()
        .filter(|(status, _)| *status == StatusCode::OK)
        .map(|(_, elapsed)| *elapsed)
        .collect();
    // One every 500 ms, at most 1 s of waiting: three go through (0, 0.5, 1 s), one is denied.
    assert_eq!(ok.len(), 3, "{results:?}");
    let mut ok = ok;
    ok.sort();
    // The store reads tokio's clock, as the sleeps do: paused, the delays are exact,
    // however long the machine stalls between decisions.
    for (elapsed, expected) in ok.iter().zip([0u64, 500, 1000]) {
        let expected = Duration::from_millis(expected);
        assert!(
            *elapsed <= expected && expected - *elapsed < Duration::from_millis(50),
            "{elapsed:?} vs {expected:?}"
        );
    }
    assert_eq!(
        results
            .iter()
            .filter(|(status, _)| *status == StatusCode::TOO_MANY_REQUESTS)
            .count(),
        1
    );
}

/// A paced app over `store`: one request every 10 s for the whole app, held back at most
/// 60 s; a request's `x-cost` header is its cost (0: it queues nothing and reports the
/// queue).
fn paced_app(store: MemoryStore<tollgate::clock::RuntimeClock>) -> Router {
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    Router::new().route("/", get(|| async { "sent" })).layer(
        RateLimitLayer::new(store)
            .policy(paced)
            .key(tollgate::key::Global)
            .cost(tollgate::cost::from_fn(|parts| {
                parts
                    .headers
                    .get("x-cost")
                    .and_then(|value| value.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            })),
    )
}

/// The paced app over an in-process store on tokio's clock, its first request sent, and a
/// second held back 10 s whose client gives up after `patience`.
async fn paced_with_one_held(
    patience: Duration,
) -> (
    Router,
    tokio::task::JoinHandle<
        Result<Result<Response<Body>, std::convert::Infallible>, tokio::time::error::Elapsed>,
    >,
) {
    let store = MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build();
    let app = paced_app(store);
    let first = app.clone().oneshot(costing(1)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let held = tokio::spawn(tokio::time::timeout(
        patience,
        app.clone().oneshot(costing(1)),
    ));
    tokio::time::sleep(Duration::from_millis(10)).await;
    (app, held)
}

fn costing(cost: u64) -> Request<Body> {
    Request::get("/")
        .header("x-cost", cost.to_string())
        .body(Body::empty())
        .unwrap()
}

/// Unit requests that may still queue, from a request of cost 0 (it goes at once).
async fn queue_room(app: &Router) -> u64 {
    let response = app.clone().oneshot(costing(0)).await.unwrap();
    let field = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    field
        .split(";r=")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|remaining| remaining.parse().ok())
        .unwrap_or_else(|| panic!("no remaining in {field}"))
}

/// A request whose client gives up during its shaping delay (a disconnect, a timeout
/// shorter than the delay) gives its place in the schedule back when no request queued
/// behind it, and so do those before it, newest first: clients whose timeouts end in
/// the order they came left their places booked for nobody, and the next request waited
/// behind all of them.
#[tokio::test(start_paused = true)]
async fn requests_dropped_during_their_delay_give_their_places_back() {
    let start = tokio::time::Instant::now();
    // Held back 10 s and 20 s; their clients give up after 1 s and 2 s.
    let (app, second) = paced_with_one_held(Duration::from_secs(1)).await;
    let third = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(2),
        app.clone().oneshot(costing(1)),
    ));
    assert!(second.await.unwrap().is_err(), "the second was sent");
    assert!(third.await.unwrap().is_err(), "the third was sent");
    // The first request's unit is all that is queued: 6 more fit in the 60 s (with all
    // three queued, 4).
    assert_eq!(queue_room(&app).await, 6);
    // The next request goes when the first one's unit has leaked out, at 10 s, not 30 s.
    let next = app.clone().oneshot(costing(1)).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    let sent = start.elapsed();
    assert!(
        sent <= Duration::from_secs(10) && sent > Duration::from_secs(9),
        "sent at {sent:?}"
    );
}

/// A request dropped during its delay while a later one stands keeps its place: given
/// back, the next request would be sent on the instant of the later one. It gives it back
/// once the later one does.
#[tokio::test(start_paused = true)]
async fn a_place_dropped_before_a_standing_one_is_kept() {
    let start = tokio::time::Instant::now();
    let (app, second) = paced_with_one_held(Duration::from_secs(1)).await;
    // The third stands (sent at 20 s), until it gives up at 5 s below.
    let third = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(5),
        app.clone().oneshot(costing(1)),
    ));
    assert!(second.await.unwrap().is_err(), "the second was sent");
    assert_eq!(
        queue_room(&app).await,
        4,
        "the second's place was given back"
    );
    // The fourth, decided now (at 1 s), goes after the third: at 30 s.
    let fourth = tokio::spawn(app.clone().oneshot(costing(1)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(third.await.unwrap().is_err(), "the third was sent");
    // The third is not the newest: the fourth stands behind it, so nothing is given back.
    assert_eq!(queue_room(&app).await, 3);
    let fourth = fourth.await.unwrap().unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    let sent = start.elapsed();
    assert!(
        sent <= Duration::from_secs(30) && sent > Duration::from_secs(29),
        "sent at {sent:?}"
    );
}

/// A shaped request dropped during its delay was never sent: it is not charged (the
/// README, `Settle::if_dropped`). When a request queued behind it stands, its place stays
/// taken, but its units under the set's other policies go back at once, as the `Limiter`
/// gives them back: they stayed spent for good, and under a steady overload (every new
/// request queued behind others) clients' hourly quotas drained for requests never run.
/// Given back once: when the place goes back later, the other policies get nothing more.
/// A paced route (one request in 10 s, queued up to 60 s) under a token bucket of 100
/// (one back an hour), over one key.
fn paced_with_tokens() -> Router {
    paced_with_tokens_over(
        MemoryStore::builder()
            .clock(tollgate::clock::RuntimeClock::new())
            .build(),
    )
}

/// [`paced_with_tokens`] over `store`.
fn paced_with_tokens_over(store: impl Store + Clone) -> Router {
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    let tokens = Policy::token_bucket("tokens", 100, Rate::per_hour(1)).unwrap();
    Router::new().route("/", get(|| async { "sent" })).layer(
        RateLimitLayer::new(store)
            .policies(tollgate::PolicySet::new([paced, tokens]).unwrap())
            .key(tollgate::key::Global)
            .cost(tollgate::cost::from_fn(|parts| {
                parts
                    .headers
                    .get("x-cost")
                    .and_then(|value| value.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            })),
    )
}

/// The tokens left, read from a request of cost 0 (sent at once).
async fn tokens_left(app: &Router) -> u64 {
    let response = app.clone().oneshot(costing(0)).await.unwrap();
    let field = response.headers()["ratelimit"].to_str().unwrap().to_owned();
    field
        .split("\"tokens\";r=")
        .nth(1)
        .and_then(|rest| rest.split([';', ',']).next())
        .and_then(|remaining| remaining.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no tokens member in {field}"))
}

#[tokio::test(start_paused = true)]
async fn a_dropped_place_that_stays_taken_gives_the_other_policies_back() {
    let app = paced_with_tokens();
    let tokens_left = || tokens_left(&app);
    assert_eq!(
        app.clone().oneshot(costing(1)).await.unwrap().status(),
        StatusCode::OK
    );
    // Held back 10 s, given up after 1 s; held back 20 s, given up after 5 s.
    let second = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(1),
        app.clone().oneshot(costing(1)),
    ));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(5),
        app.clone().oneshot(costing(1)),
    ));
    assert!(second.await.unwrap().is_err(), "the second was sent");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        tokens_left().await,
        98,
        "the second, never sent, is not charged while its place stays taken"
    );
    assert!(third.await.unwrap().is_err(), "the third was sent");
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The third's place and tokens go back, then the second's place: its tokens are back
    // already.
    assert_eq!(tokens_left().await, 99);
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert_eq!(tokens_left().await, 99, "once leaked out, nothing more");
}

/// The give-back above when requests give up out of order: the third (held 20 s) first,
/// then the second (held 10 s), with the fourth standing behind both. A round gives back
/// the newest booking of the queue; refused (the fourth stands), it ended, and the
/// second, older, was never tried: its tokens stayed spent for a request never sent.
/// Every booking older than a refused one has a request standing behind it too.
#[tokio::test(start_paused = true)]
async fn places_dropped_out_of_order_give_their_other_units_back() {
    let app = paced_with_tokens();
    assert_eq!(
        app.clone().oneshot(costing(1)).await.unwrap().status(),
        StatusCode::OK
    );
    let held = |patience: Option<Duration>| {
        let request = app.clone().oneshot(costing(1));
        tokio::spawn(async move {
            match patience {
                Some(patience) => tokio::time::timeout(patience, request).await.is_ok(),
                None => request.await.is_ok(),
            }
        })
    };
    let second = held(Some(Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = held(Some(Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let fourth = held(None);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(tokens_left(&app).await, 96);
    assert!(!third.await.unwrap(), "the third was sent");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(tokens_left(&app).await, 97);
    assert!(!second.await.unwrap(), "the second was sent");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        tokens_left(&app).await,
        98,
        "the second, dropped after the third, never sent"
    );
    assert!(fourth.await.unwrap());
    assert_eq!(tokens_left(&app).await, 98);
}

/// An in-process store on tokio's clock that answers adjustments as a store doing I/O
/// does (once polled), whose settles fail (the store unreachable) while `failing` is set;
/// it counts them.
#[derive(Clone)]
struct FailingSettles {
    inner: MemoryStore<tollgate::clock::RuntimeClock>,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    settles: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Store for FailingSettles {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.inner.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        use std::sync::atomic::Ordering;
        let settle = matches!(adjustment.change(), tollgate::store::Change::Settle { .. });
        if settle && self.failing.load(Ordering::SeqCst) {
            self.settles.fetch_add(1, Ordering::SeqCst);
            return DecideFuture::new(async {
                tokio::task::yield_now().await;
                Err(tollgate::StoreError::new(
                    tollgate::StoreErrorKind::Unavailable,
                    "unreachable",
                ))
            });
        }
        // Answered on the way back (after a turn of the runtime), as a store doing I/O.
        let answer = self.inner.adjust(key, policies, adjustment);
        DecideFuture::new(async {
            tokio::task::yield_now().await;
            answer.await
        })
    }
}

/// A failure while the units of dropped places go back ends the round, as any store
/// failure of a round does: the bookings not yet tried keep what they owe for the next
/// round. The round went on to each of them, one store timeout each on a store that
/// hangs, and marked each as given back: a transient failure lost every refund of the
/// queue, not one.
#[tokio::test(start_paused = true)]
async fn a_store_failure_ends_the_give_back_of_dropped_units() {
    use std::sync::atomic::Ordering;
    let store = FailingSettles {
        inner: MemoryStore::builder()
            .clock(tollgate::clock::RuntimeClock::new())
            .build(),
        failing: Default::default(),
        settles: Default::default(),
    };
    let app = paced_with_tokens_over(store.clone());
    assert_eq!(
        app.clone().oneshot(costing(1)).await.unwrap().status(),
        StatusCode::OK
    );
    // Three held back whose clients give up together, and a fifth standing behind them.
    let given_up: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(tokio::time::timeout(
                Duration::from_secs(1),
                app.clone().oneshot(costing(1)),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let last = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(3),
        app.clone().oneshot(costing(1)),
    ));
    tokio::time::sleep(Duration::from_millis(10)).await;
    store.failing.store(true, Ordering::SeqCst);
    for request in given_up {
        assert!(request.await.unwrap().is_err(), "given up");
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        store.settles.load(Ordering::SeqCst),
        1,
        "one failure ends the round"
    );
    // The store answers again; the last gives up too, and every place goes back, with
    // the units of the two never tried. The one whose give-back failed stays spent.
    store.failing.store(false, Ordering::SeqCst);
    assert!(last.await.unwrap().is_err(), "given up");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(tokens_left(&app).await, 100 - 1 - 1);
}

/// A store whose first unbooking answers only when the test opens its gate (a give-back on
/// its way to Redis), the rest at once.
#[derive(Clone)]
struct GatedUnbook {
    inner: std::sync::Arc<MemoryStore<tollgate::clock::RuntimeClock>>,
    first: std::sync::Arc<std::sync::atomic::AtomicBool>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl Store for GatedUnbook {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.inner.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        let answer = self.inner.adjust_now(key.as_str(), policies, adjustment);
        let unbook = matches!(adjustment.change(), tollgate::store::Change::Unbook { .. });
        if unbook && self.first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let gate = std::sync::Arc::clone(&self.gate);
            return DecideFuture::new(async move {
                let _open = gate.acquire().await;
                Ok(answer)
            });
        }
        DecideFuture::ready(Ok(answer))
    }
}

/// Two requests dropped one after the other, the older's give-back still on its way (the
/// store refuses it: the newer stands) when the newer is given back: the newer's round
/// found nothing more to give back, the older's put its booking back after, and nobody
/// tried it again. Its slot stayed booked for nobody.
#[tokio::test(start_paused = true)]
async fn a_give_back_on_its_way_does_not_strand_an_older_place() {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let store = GatedUnbook {
        inner: std::sync::Arc::new(
            MemoryStore::builder()
                .clock(tollgate::clock::RuntimeClock::new())
                .build(),
        ),
        first: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
        gate: std::sync::Arc::clone(&gate),
    };
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    let app = Router::new().route("/", get(|| async { "sent" })).layer(
        RateLimitLayer::new(store)
            .policy(paced)
            .key(tollgate::key::Global)
            .cost(tollgate::cost::from_fn(|parts| {
                parts
                    .headers
                    .get("x-cost")
                    .and_then(|value| value.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }))
            .store_timeout(Duration::from_secs(30)),
    );
    assert_eq!(app.clone().oneshot(costing(1)).await.unwrap().status(), 200);
    let second = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(1),
        app.clone().oneshot(costing(1)),
    ));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(2),
        app.clone().oneshot(costing(1)),
    ));
    assert!(second.await.unwrap().is_err());
    assert!(third.await.unwrap().is_err());
    // The second's give-back (refused: the third stood) answers now.
    gate.add_permits(1);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(queue_room(&app).await, 6, "a place stayed booked");
}

/// A layer whose routes are paced by policies of their own, one key: the places dropped
/// on one route are given back in that route's queue, whatever was dropped on the other.
/// A booking kept for the other queue (a request standing behind it there) was taken as
/// the newest of all, refused, and the round stopped before this route's place.
#[tokio::test(start_paused = true)]
async fn places_are_given_back_per_queue() {
    let store = MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build();
    let paced = |name| {
        PolicySet::from(
            Policy::leaky_bucket_shaping(
                name,
                Rate::new(1, Duration::from_secs(10)),
                Duration::from_secs(60),
            )
            .unwrap(),
        )
    };
    let (a, b) = (paced("a"), paced("b"));
    let app = Router::new()
        .route("/a", get(|| async { "sent" }))
        .route("/b", get(|| async { "sent" }))
        .layer(
            RateLimitLayer::new(store)
                .resolver(resolve_with(move |parts, _key| {
                    if parts.uri.path() == "/a" {
                        a.clone()
                    } else {
                        b.clone()
                    }
                }))
                .key(tollgate::key::Global)
                .cost(tollgate::cost::from_fn(|parts| {
                    parts
                        .headers
                        .get("x-cost")
                        .and_then(|value| value.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                })),
        );
    let on = |path: &str, cost: u64| {
        Request::get(path)
            .header("x-cost", cost.to_string())
            .body(Body::empty())
            .unwrap()
    };
    let sent = |path: &'static str, patience: u64| {
        tokio::spawn(tokio::time::timeout(
            Duration::from_secs(patience),
            app.clone().oneshot(on(path, 1)),
        ))
    };
    // Queue a: one sent, one held back 10 s (its client gives up at 3 s).
    assert!(sent("/a", 1).await.unwrap().is_ok());
    let a_held = sent("/a", 3);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Queue b: one sent, one held back 10 s (gives up at 1 s), one 20 s that stands.
    assert!(sent("/b", 1).await.unwrap().is_ok());
    let b_dropped = sent("/b", 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _b_standing = sent("/b", 100);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(b_dropped.await.unwrap().is_err());
    assert!(a_held.await.unwrap().is_err());
    // Queue a holds its first request's unit alone: 6 more fit.
    let probe = app.clone().oneshot(on("/a", 0)).await.unwrap();
    let field = probe.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(field.contains("\"a\";r=6;"), "{field}");
}

/// A request dropped before its future was first polled gives its place back too (the
/// layer decides in `call`, before any poll).
#[tokio::test(start_paused = true)]
async fn a_delayed_request_dropped_before_its_first_poll_gives_its_place_back() {
    use tower::{Service, ServiceBuilder};
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    let mut service = ServiceBuilder::new()
        .layer(
            RateLimitLayer::new(
                MemoryStore::builder()
                    .clock(tollgate::clock::RuntimeClock::new())
                    .build(),
            )
            .policy(paced)
            .key(tollgate::key::Global),
        )
        .service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("sent")))
        });
    let get = || Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        service
            .ready()
            .await
            .unwrap()
            .call(get())
            .await
            .unwrap()
            .status(),
        200
    );
    // Held back 10 s; dropped unpolled.
    drop(service.ready().await.unwrap().call(get()));
    // Queued: the first's unit alone (a third goes at 10 s, not 20 s).
    let start = tokio::time::Instant::now();
    service.ready().await.unwrap().call(get()).await.unwrap();
    assert!(
        start.elapsed() <= Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// An in-process store that fails its next decision when told to, and counts the
/// bookings given back to it.
#[derive(Clone)]
struct FailsOnce {
    inner: MemoryStore<tollgate::clock::RuntimeClock>,
    fail_next: std::sync::Arc<std::sync::atomic::AtomicBool>,
    unbooked: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Store for FailsOnce {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if self
            .fail_next
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return DecideFuture::ready(Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "connection reset",
            )));
        }
        self.inner.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        if matches!(adjustment.change(), tollgate::store::Change::Unbook { .. }) {
            self.unbooked
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.adjust(key, policies, adjustment)
    }
}

/// A layer pacing one request every 10 s (a minute's queue at most, one global key) over
/// a `FailsOnce` store, failing open, with a breaker that opens after `failures`; the
/// service and the store.
fn paced_over_fails_once(
    failures: u32,
) -> (
    impl tower::Service<
        Request<Body>,
        Response = Response<Body>,
        Error = std::convert::Infallible,
        Future: Send,
    > + Clone,
    FailsOnce,
) {
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    let store = FailsOnce {
        inner: MemoryStore::builder()
            .clock(tollgate::clock::RuntimeClock::new())
            .build(),
        fail_next: Default::default(),
        unbooked: Default::default(),
    };
    let service = tower::ServiceBuilder::new()
        .layer(
            RateLimitLayer::new(store.clone())
                .policy(paced)
                .key(tollgate::key::Global)
                .on_store_error(FailureMode::FailOpen)
                .circuit_breaker(tollgate::CircuitBreaker::new(
                    failures,
                    Duration::from_secs(60),
                )),
        )
        .service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("sent")))
        });
    (service, store)
}

/// One store failure below the breaker's threshold (the breaker stays closed, requests
/// still go to the store) kept a request dropped during its delay from giving its place
/// back until the store's next success: only an open breaker holds the give-back off
/// the store (README), as it holds requests off.
#[tokio::test(start_paused = true)]
async fn a_failure_that_opens_no_breaker_does_not_hold_places_back() {
    use std::sync::atomic::Ordering;
    use tower::Service;
    let (mut service, store) = paced_over_fails_once(5);
    let get = || Request::get("/").body(Body::empty()).unwrap();
    service.ready().await.unwrap().call(get()).await.unwrap();
    // Held back 10 s.
    let held = service.ready().await.unwrap().call(get());
    // One failure: the breaker stays closed.
    store.fail_next.store(true, Ordering::SeqCst);
    let failed = service.ready().await.unwrap().call(get()).await.unwrap();
    assert!(!failed.headers().contains_key("ratelimit"), "failed open");
    drop(held);
    assert_eq!(
        store.unbooked.load(Ordering::SeqCst),
        1,
        "the place went back"
    );
    let start = tokio::time::Instant::now();
    service.ready().await.unwrap().call(get()).await.unwrap();
    assert!(
        start.elapsed() <= Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// While the breaker is open (the store is held off), a request dropped during its delay
/// sends nothing to the store: its place leaks out (README).
#[tokio::test(start_paused = true)]
async fn an_open_breaker_holds_places_back() {
    use std::sync::atomic::Ordering;
    use tower::Service;
    let (mut service, store) = paced_over_fails_once(1);
    let get = || Request::get("/").body(Body::empty()).unwrap();
    service.ready().await.unwrap().call(get()).await.unwrap();
    let held = service.ready().await.unwrap().call(get());
    // One failure opens this breaker.
    store.fail_next.store(true, Ordering::SeqCst);
    service.ready().await.unwrap().call(get()).await.unwrap();
    drop(held);
    assert_eq!(
        store.unbooked.load(Ordering::SeqCst),
        0,
        "sent to a store held off"
    );
}

/// Counts the decisions that reach it.
#[derive(Clone)]
struct Counted {
    inner: MemoryStore,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Store for Counted {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.decide(key, policies, cost)
    }
}

#[tokio::test]
async fn a_local_pre_limit_in_front_of_a_shared_store() {
    // The shared limit (as it would be on Redis), and in front of it a local limit on
    // micro-bursts: a second layer over the in-process store. Both write their policy
    // into the same RateLimit fields.
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let shared = RateLimitLayer::new(Counted {
        inner: MemoryStore::new(),
        calls: std::sync::Arc::clone(&calls),
    })
    .policy(Policy::token_bucket("api", 100, Rate::per_minute(100)).unwrap());
    let burst = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::gcra("burst", Rate::per_hour(5), 5).unwrap());
    let server = Server::start(hello_app().layer(shared).layer(burst)).await;
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let reply = server.get("/").await;
        if reply.status == StatusCode::OK {
            let policies: Vec<&str> = reply
                .headers
                .get_all("ratelimit-policy")
                .iter()
                .map(|value| value.to_str().unwrap())
                .collect();
            assert_eq!(policies, ["\"api\";q=100;w=60", "\"burst\";q=5;w=3600"]);
        }
        statuses.push(reply.status);
    }
    let admitted = statuses
        .iter()
        .filter(|status| **status == StatusCode::OK)
        .count();
    // Five pass the burst limit; only those reach the shared store.
    assert_eq!(admitted, 5, "{statuses:?}");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        admitted as u64
    );
}

// A store, a cost and a resolver picked at run time: one concrete layer type, no generic
// router (Arc<dyn Store>, Arc<dyn Cost>, Arc<dyn PolicyResolver>).
#[tokio::test]
async fn a_store_cost_and_resolver_picked_at_run_time_fit_one_type() {
    use std::sync::Arc;
    use tollgate::PolicyResolver;
    use tollgate::cost::Cost;
    fn app(
        store: Arc<dyn Store>,
        cost: Arc<dyn Cost>,
        resolver: Arc<dyn PolicyResolver>,
    ) -> Router {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(store)
                .resolver(resolver)
                .cost(cost)
                .key(tollgate::key::Global),
        )
    }
    for boxed in [false, true] {
        let store: Arc<dyn Store> = if boxed {
            Arc::new(Box::new(MemoryStore::new()) as Box<dyn Store>)
        } else {
            Arc::new(MemoryStore::new())
        };
        let set = PolicySet::from(Policy::token_bucket("api", 4, Rate::per_minute(1)).unwrap());
        let app = app(store, Arc::new(2u64), Arc::new(set));
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let response = app
                .clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            statuses.push(response.status());
        }
        // Cost 2 from 4: two admitted, the third denied.
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS
            ],
            "boxed: {boxed}"
        );
    }
}

/// A store that forwards only `decide` (a wrapper for metrics, as `Counted` above)
/// cannot settle costs or free in-flight slots: the default `adjust` refuses. Accepted,
/// each request's slot was never freed (a key refused for good once its limit was taken)
/// and each settle was refused (a reservation of 0 settled at its actual cost was free).
/// The layer refuses such a set-up when it is built; a wrapper that forwards `adjust`
/// says so with `can_adjust`.
#[test]
fn settling_or_in_flight_limits_need_a_store_that_can_adjust() {
    use tollgate::settle::Settle;
    let counted = || Counted {
        inner: MemoryStore::new(),
        calls: std::sync::Arc::default(),
    };
    let slots = Policy::concurrency("slots", 2).unwrap();
    let tokens = Policy::token_bucket("tokens", 1000, Rate::per_minute(1000)).unwrap();
    let refused = RateLimitLayer::new(counted())
        .policy(slots.clone())
        .validate();
    let error = refused.expect_err("in-flight slots that are never freed");
    assert!(
        error.contains("slots") && error.contains("adjust"),
        "{error}"
    );
    let refused = RateLimitLayer::new(counted())
        .policy(tokens.clone())
        .settle(Settle::from_header("x-tokens-used"))
        .validate();
    let error = refused.expect_err("costs that are never settled");
    assert!(
        error.contains("settle") && error.contains("adjust"),
        "{error}"
    );
    // Without either, the wrapper is fine; and a wrapper that adjusts is fine with both.
    assert!(
        RateLimitLayer::new(counted())
            .policy(tokens.clone())
            .validate()
            .is_ok()
    );
    let adjusting = std::sync::Arc::new(MemoryStore::new()) as std::sync::Arc<dyn Store>;
    assert!(
        RateLimitLayer::new(adjusting)
            .policy(slots)
            .policy(tokens)
            .settle(Settle::from_header("x-tokens-used"))
            .validate()
            .is_ok()
    );
}

/// A store doing I/O: the in-process store's answer, after 100 ms.
#[derive(Clone)]
struct SlowToAnswer(MemoryStore);

impl Store for SlowToAnswer {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let decision = self.0.check(key.as_str(), policies, cost);
        DecideFuture::new(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(decision)
        })
    }
}

/// While a store doing I/O decides, the request keeps the inner service's capacity that
/// `poll_ready` reserved (the wait is bounded by the store timeout): back-pressure
/// reaches the layers outside, and `LoadShed` sheds what the inner service cannot take.
/// (Dropping it at the call let every request through `poll_ready`, to queue without
/// bound inside the futures after being charged.)
#[tokio::test(start_paused = true)]
async fn a_request_waiting_for_the_store_keeps_the_inner_services_capacity() {
    use tower::ServiceBuilder;
    let service = ServiceBuilder::new()
        .load_shed()
        .layer(
            RateLimitLayer::new(SlowToAnswer(MemoryStore::new()))
                .policy(Policy::token_bucket("api", 1000, Rate::per_second(1000)).unwrap())
                .key(tollgate::key::Global)
                .store_timeout(Duration::from_secs(1)),
        )
        .concurrency_limit(1)
        .service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("sent")))
        });
    let requests = (0..10).map(|_| {
        let service = service.clone();
        tokio::spawn(service.oneshot(Request::get("/").body(Body::empty()).unwrap()))
    });
    let mut served = 0;
    let mut shed = 0;
    for request in requests.collect::<Vec<_>>() {
        match request.await.unwrap() {
            Ok(response) => {
                assert_eq!(response.status(), StatusCode::OK);
                served += 1;
            }
            Err(error) => {
                assert!(error.is::<tower::load_shed::error::Overloaded>(), "{error}");
                shed += 1;
            }
        }
    }
    assert_eq!((served, shed), (1, 9));
}

/// A resolver that is a closure names its sets only per request, so the check at build
/// cannot see an in-flight limit in them. Over a store that cannot adjust, such a set's
/// slots would never be freed: the store is not asked, and the failure mode decides
/// (its local limiter frees what it takes), as for a set the store cannot decide.
#[tokio::test]
async fn an_in_flight_set_a_closure_names_over_a_store_that_cannot_adjust_is_the_failure_modes() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let store = Counted {
        inner: MemoryStore::new(),
        calls: std::sync::Arc::clone(&calls),
    };
    let slots = PolicySet::from(Policy::concurrency("slots", 2).unwrap());
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(store)
            .resolver(resolve_with(move |_, _| slots.clone()))
            .key(tollgate::key::Global),
    );
    for _ in 0..5 {
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the store took slots it cannot free"
    );
}

/// An in-process store on tokio's clock: under `start_paused` its time moves only with
/// the runtime's, so a delay the store sets and the sleep that serves it agree exactly
/// (a store on the machine's clock moves on while a loaded machine stalls).
fn paused_store() -> MemoryStore<tollgate::clock::RuntimeClock> {
    MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build()
}
