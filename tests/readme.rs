//! Every Rust block of the README, compiled: a user copies them, so an API change that
//! leaves one behind fails here. Each block stands below as it stands in the README
//! (`readme_blocks_stand_here_as_written` holds the two texts together), with what the
//! README leaves to the reader (a handler, a store, a policy) declared around it; the
//! blocks that need nothing outside the process also run, and their results are checked.
//!
//! The functions are kept from rustfmt (`#[rustfmt::skip]`) so that their lines stay the
//! README's.

#![allow(clippy::needless_return, unused_variables)]

use std::error::Error;
use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use tower::ServiceExt;

type Result<T = (), E = Box<dyn Error + Send + Sync>> = std::result::Result<T, E>;

/// A request from `peer` for `path`, as `into_make_service_with_connect_info` records it
/// (and as a bare `SocketAddr`, which the limiter reads without its `axum` feature).
fn request(path: &str, peer: [u8; 4]) -> Request<Body> {
    let mut request = Request::get(path).body(Body::empty()).unwrap();
    with_peer(&mut request, peer);
    request
}

fn with_peer(request: &mut Request<Body>, peer: [u8; 4]) {
    let address = SocketAddr::from((peer, 40_000));
    request.extensions_mut().insert(ConnectInfo(address));
    request.extensions_mut().insert(address);
}

async fn handler() -> &'static str {
    "ok"
}

#[rustfmt::skip]
#[tokio::test]
async fn block_1_the_quick_start() -> Result {
use axum::{Router, routing::get};
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tollgate::cost::PerRoute;

let limiter = RateLimitLayer::new(MemoryStore::new())
    .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?)   // burst 10, 5/s sustained
    .cost(PerRoute::new(1).route("/search", 5));                     // one bucket, different debit

let app = Router::new()
    .route("/", get(|| async { "hello" }))
    .route("/search", get(|| async { "results" }))
    .layer(limiter);
// serve with app.into_make_service_with_connect_info::<SocketAddr>() so the peer IP is known

    // Two searches spend the burst of 10; requests after them soon wait (a token comes
    // back every 200 ms on the machine's clock).
    for _ in 0..2 {
        let response = app.clone().oneshot(request("/search", [203, 0, 113, 7])).await?;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let mut refused = false;
    for _ in 0..20 {
        let response = app.clone().oneshot(request("/", [203, 0, 113, 7])).await?;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            refused = true;
            break;
        }
    }
    assert!(refused, "20 requests at once after the burst were all let through");
    // Another address has a bucket of its own.
    let other = app.oneshot(request("/", [203, 0, 113, 8])).await?;
    assert_eq!(other.status(), StatusCode::OK);
    Ok(())
}

#[cfg(feature = "graphql")]
#[rustfmt::skip]
#[tokio::test]
async fn block_2_graphql() -> Result {
    async fn graphql_handler() -> &'static str {
        "{\"data\":{}}"
    }
    // What the README's comment asks of the app: a key nobody issued is dropped.
    async fn drop_unknown_key(mut request: Request<Body>) -> Request<Body> {
        if request.headers().get("x-api-key").is_some_and(|key| key != "k-1") {
            request.headers_mut().remove("x-api-key");
        }
        request
    }

use axum::{Router, routing::post};
use tollgate::cost::{self, graphql::{GraphqlCost, GraphqlCostLayer}};
use tollgate::key::{ClientIp, HeaderKey, KeyExtractorExt}; // `or` is KeyExtractorExt's
use tollgate::policy::QuotaUnit;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};

let limiter = RateLimitLayer::new(MemoryStore::new())
    .policy(Policy::token_bucket("points", 1_000, Rate::per_minute(1_000))?
        .with_unit(QuotaUnit::GraphqlPoints))
    // A key your authentication checked (it drops one it does not know), else the address.
    .key(HeaderKey::new("x-api-key").or(ClientIp::peer()))
    .cost(cost::FromExtension::or(1));
let app = Router::new().route("/graphql", post(graphql_handler))
    .layer(limiter)
    .layer(GraphqlCostLayer::new(GraphqlCost::new())) // runs before the limiter
    .layer(axum::middleware::map_request(drop_unknown_key)); // runs first

    let query = |key: &str| {
        let mut request = Request::post("/graphql")
            .header("content-type", "application/json")
            .header("x-api-key", key)
            .body(Body::from(r#"{"query":"{ viewer { login } }"}"#))
            .unwrap();
        with_peer(&mut request, [203, 0, 113, 7]);
        request
    };
    let response = app.clone().oneshot(query("k-1")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    let policy = response.headers()["ratelimit-policy"].to_str()?;
    assert!(policy.starts_with("\"points\";q=1000"), "{policy}");
    // A made-up key is no budget of its own: it is keyed by the address.
    let made_up = app.oneshot(query("made-up")).await?;
    let rate = made_up.headers()["ratelimit"].to_str()?.to_owned();
    assert!(rate.starts_with("\"points\";r="), "{rate}");
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_3_settle() -> Result {
    use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tollgate::cost::FromExtension;
use tollgate::settle::Settle;

let layer = RateLimitLayer::new(MemoryStore::new())
    .policy(Policy::token_bucket("tokens", 1_000, Rate::per_minute(1_000))?)
    .cost(FromExtension::or(1))                    // a RequestCost set by earlier middleware
    .settle(Settle::from_header("x-tokens-used")   // the handler says what it used
        .refund_if(|status| matches!(status.as_u16(), 502 | 503)));  // upstream down

    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { ([("x-tokens-used", "250")], "done") }))
        .layer(layer);
    let response = app.oneshot(request("/", [203, 0, 113, 7])).await?;
    assert_eq!(response.status(), StatusCode::OK);
    // Settled at the response head: 250 used of 1,000 (a token comes back every 60 ms
    // on the machine's clock: one or two may have by then, on a busy machine).
    let rate = response.headers()["ratelimit"].to_str()?;
    let left: u64 = rate
        .strip_prefix("\"tokens\";r=")
        .and_then(|rest| rest.split(';').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("{rate}"));
    assert!((750..=760).contains(&left), "{rate}");
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_4_shadow() -> Result {
    use std::time::Duration;
    use tollgate::{MemoryStore, Policy, PolicySet, Rate, RateLimitLayer};
    let store = MemoryStore::new();

let set = PolicySet::new([
    Policy::token_bucket("api", 100, Rate::per_second(10))?,               // enforced
    Policy::sliding_window("api-v2", 50, Duration::from_secs(10))?.shadow(), // watched
])?;
let layer = RateLimitLayer::new(store).policies(set);

    let app = axum::Router::new()
        .route("/", axum::routing::get(handler))
        .layer(layer);
    // The 51st request passes the enforced policy though the watched one would refuse it.
    for _ in 0..51 {
        let response = app.clone().oneshot(request("/", [203, 0, 113, 7])).await?;
        assert_eq!(response.status(), StatusCode::OK);
    }
    Ok(())
}

#[rustfmt::skip]
#[test]
fn block_5_penalty() -> Result {
    use std::time::Duration;
    use tollgate::Policy;
use tollgate::policy::Penalty;

let login = Policy::fixed_window("login", 5, Duration::from_secs(60))?
    .with_penalty(Penalty::new(10, Duration::from_secs(60), Duration::from_secs(300))
        .doubling_up_to(Duration::from_secs(3600)))?;

    assert_eq!(login.name(), "login");
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_6_bypass() -> Result {
    use tollgate::key::HeaderKey;
    use tollgate::{MemoryStore, Policy, RateLimitLayer};
    let store = MemoryStore::new();
    // One request an hour: no window boundary falls between the two below.
    let policy = Policy::token_bucket("api", 1, tollgate::Rate::per_hour(1))?;
use tollgate::bypass::Bypass;

// Behind your authentication, which refuses (or drops) a key it does not know.
let api_key = HeaderKey::new("x-api-key");
let layer = RateLimitLayer::new(store)
    .policy(policy)
    .bypass(Bypass::new()
        .network("10.0.0.0/8")                        // behind a proxy: .client_ip(..)
        .key(api_key.key_for("monitoring-token")?)    // hashed and salted as requests' keys
        .when(|parts| parts.uri.path() == "/healthz"))
    .key(api_key);

    let app = axum::Router::new()
        .route("/", axum::routing::get(handler))
        .route("/healthz", axum::routing::get(handler))
        .layer(layer);
    let keyed = |path: &str, key: &str, peer: [u8; 4]| {
        let mut request = request(path, peer);
        request.headers_mut().insert("x-api-key", key.parse().unwrap());
        request
    };
    // One request an hour for a key...
    let first = app.clone().oneshot(keyed("/", "k-1", [203, 0, 113, 7])).await?;
    assert_eq!(first.status(), StatusCode::OK);
    let second = app.clone().oneshot(keyed("/", "k-1", [203, 0, 113, 7])).await?;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    // ...but the office network, the monitoring key and health checks pass, unlimited.
    for (path, key, peer) in [
        ("/", "k-1", [10, 1, 2, 3]),
        ("/", "monitoring-token", [203, 0, 113, 7]),
        ("/healthz", "k-1", [203, 0, 113, 7]),
    ] {
        for _ in 0..3 {
            let response = app.clone().oneshot(keyed(path, key, peer)).await?;
            assert_eq!(response.status(), StatusCode::OK, "{path} {key} {peer:?}");
        }
    }
    Ok(())
}

/// Compiled, not run: it reads `tollgate.toml` from the working directory.
#[cfg(feature = "config")]
#[rustfmt::skip]
#[allow(dead_code)]
fn block_7_configuration() -> Result<(), Box<dyn Error>> {
    use axum::{Router, routing::get};
    use tollgate::MemoryStore;
    use tollgate::config::{LimiterConfig, LiveLayer};
    async fn auth(request: Request<Body>) -> Request<Body> {
        request
    }
let config: LimiterConfig = toml::from_str(&std::fs::read_to_string("tollgate.toml")?)?;
let layer = LiveLayer::new(MemoryStore::new(), &config)?;   // or a RedisStore
let app = Router::new().route("/", get(handler))
    .layer(layer.clone())
    .layer(axum::middleware::map_request(auth)); // runs first: checks the key, sets x-plan
// on SIGHUP: layer.reload(&new_config)?
    let new_config = config;
    layer.reload(&new_config)?;
    let _: Router = app;
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_8_limits_outside_http() -> Result<(), Box<dyn Error>> {
    use std::time::Duration;
    use tollgate::limiter::Limiter;
    use tollgate::{Key, MemoryStore, Policy, Rate};
    let store = MemoryStore::new();
let mail = Limiter::try_new(store, Policy::token_bucket("mail", 20, Rate::per_second(10))?)?;
mail.until_ready(&Key::new("smtp.example.com"), 1, Duration::from_secs(5)).await?;
    Ok(())
}

/// Compiled, not run: it needs a server to call.
#[cfg(feature = "client")]
#[rustfmt::skip]
#[allow(dead_code)]
async fn block_9_the_client_side(url: &str) -> Result<(), Box<dyn Error>> {
    use bytes::Bytes;
    use http_body_util::Empty;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tollgate::client::PacingLayer;
    use tower::{Layer, Service};
let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
let mut paced = PacingLayer::new().layer(client);
let response = paced.ready().await?.call(Request::get(url).body(Empty::new())?).await?;
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_10_cors() -> Result {
use axum::{Router, routing::get};
use tollgate::{HeaderStyle, MemoryStore, Policy, Rate, RateLimitLayer};
use tower_http::cors::{Any, CorsLayer};

let style = HeaderStyle::Draft11;
let app: Router = Router::new()
    .route("/data", get(|| async { "data" }))
    .layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
            .headers(style),
    )
    // Added last, so outermost.
    .layer(
        CorsLayer::new()
            .allow_origin(Any)
            .expose_headers(style.field_names().to_vec()),
    );

    let mut cross_origin = request("/data", [203, 0, 113, 7]);
    cross_origin
        .headers_mut()
        .insert("origin", "https://app.example".parse().unwrap());
    let response = app.oneshot(cross_origin).await?;
    let exposed = response.headers()["access-control-expose-headers"].to_str()?;
    assert!(exposed.contains("ratelimit-policy") && exposed.contains("ratelimit"), "{exposed}");
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_11_when_the_store_fails() -> Result {
    use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    // The README's `redis` is a RedisStore; the builder is the same for any store.
    let redis = MemoryStore::new();
    let api = Policy::gcra("api", Rate::per_second(50), 100)?;
use std::time::Duration;
use tollgate::{CircuitBreaker, FailureMode, LocalFallback};

let layer = RateLimitLayer::new(redis)
    .policy(api)
    .on_store_error(FailureMode::Fallback(LocalFallback::new().share(0.25)))
    .store_timeout(Duration::from_millis(150))
    .circuit_breaker(CircuitBreaker::new(5, Duration::from_secs(1)));

    let app = axum::Router::new()
        .route("/", axum::routing::get(handler))
        .layer(layer);
    let response = app.oneshot(request("/", [203, 0, 113, 7])).await?;
    assert_eq!(response.status(), StatusCode::OK);
    Ok(())
}

#[rustfmt::skip]
#[tokio::test]
async fn block_12_two_layers() -> Result {
    use axum::{Router, routing::get};
    use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    // The README's shared limit is a RedisStore; any store builds the same.
    let redis_store = MemoryStore::new();
let shared = RateLimitLayer::new(redis_store).policy(Policy::token_bucket("api", 100, Rate::per_minute(100))?);
let burst = RateLimitLayer::new(MemoryStore::new()).policy(Policy::gcra("burst", Rate::per_second(20), 5)?);
let app = Router::new().route("/", get(handler)).layer(shared).layer(burst); // burst runs first

    // The burst policy (5 at once, then 20 a second on the machine's clock) refuses
    // before the shared one (100) is reached, and answers for itself.
    let mut denied = None;
    for _ in 0..60 {
        let response = app.clone().oneshot(request("/", [203, 0, 113, 7])).await?;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            denied = Some(response);
            break;
        }
    }
    let denied = denied.expect("the burst policy refused none of 60 requests sent at once");
    assert!(denied.headers()["ratelimit"].to_str()?.starts_with("\"burst\""));
    Ok(())
}

/// Compiled, not run: what it picks depends on the environment.
#[cfg(feature = "redis")]
#[rustfmt::skip]
#[allow(dead_code)]
async fn block_13_a_store_picked_at_start() -> Result<(), Box<dyn Error>> {
    use tollgate::{Policy, Rate, RateLimitLayer};
use std::sync::Arc;
use tollgate::{MemoryStore, Store};

let store: Arc<dyn Store> = match tollgate::store::RedisConfig::from_env()? {
    Some(redis) => Arc::new(redis.connect().await?), // REDIS_URL, Sentinel or Cluster
    None => Arc::new(MemoryStore::new()),
};
let limiter = RateLimitLayer::new(store).policy(Policy::gcra("api", Rate::per_second(50), 100)?);
    Ok(())
}

/// Compiled, not run: it connects to servers at the README's addresses.
#[cfg(feature = "tls")]
#[rustfmt::skip]
#[allow(dead_code)]
async fn block_14_connecting(
    my_deadpool_redis_pool: deadpool_redis::Pool,
    password: String,
) -> Result<(), Box<dyn Error>> {
    use tollgate::{Policy, Rate, RateLimitLayer};
use tollgate::store::{RedisConfig, RedisStore};

let store = RedisStore::connect("redis://10.0.0.5:6379").await?;            // one server
let store = RedisStore::connect_cluster(&["redis://10.0.0.5:7000"]).await?; // a Cluster
let store = RedisStore::from_pool(my_deadpool_redis_pool);                   // your pool
let store = RedisConfig::sentinel(["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"], "mymaster")
    .master_auth(Some("limiter"), password)                                 // Sentinel
    .connect()
    .await?;
let store = RedisConfig::server("rediss://limiter:PASSWORD@redis.internal:6380") // TLS
    .root_certificate_pem(std::fs::read("ca.pem")?)                         // a private CA
    .prefix("shop")
    .connect()
    .await?;
let limiter = RateLimitLayer::new(store).policy(Policy::gcra("api", Rate::per_second(50), 100)?);
    Ok(())
}

/// The README's Rust blocks (a fence whose info string starts with `rust`: `rust`,
/// `rust,no_run`; indented in a list or not), each as its lines with the indentation and
/// the trailing spaces taken off, blank lines left out.
fn readme_blocks(readme: &str) -> Vec<Vec<&str>> {
    let mut blocks = Vec::new();
    // Inside a fence: `Some(lines)` for a Rust one, `None` for another.
    let mut fence: Option<Option<Vec<&str>>> = None;
    for line in readme.lines() {
        let trimmed = line.trim();
        match fence.as_mut() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let rust = info.trim().split([',', ' ']).next() == Some("rust");
                    fence = Some(rust.then(Vec::new));
                }
            }
            Some(_) if trimmed == "```" => {
                if let Some(Some(block)) = fence.take() {
                    blocks.push(block);
                }
            }
            Some(Some(block)) if !trimmed.is_empty() => block.push(trimmed),
            Some(_) => {}
        }
    }
    assert!(
        fence.is_none(),
        "a fenced block of the README is not closed"
    );
    blocks
}

#[test]
fn the_reader_finds_every_rust_fence() {
    let text = "a\n```rust\nlet a = 1;\n\n```\n- item\n  ```rust,no_run\n  let b = 2;\n  ```\n```text\n```rust\n```\n```toml\nx = 1\n```\n";
    assert_eq!(
        readme_blocks(text),
        [vec!["let a = 1;"], vec!["let b = 2;"]]
    );
}

#[test]
fn readme_blocks_stand_here_as_written() {
    let readme = include_str!("../README.md");
    let here: Vec<&str> = include_str!("readme.rs")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect();
    let blocks = readme_blocks(readme);
    assert_eq!(
        blocks.len(),
        14,
        "a Rust block was added to the README or taken out: compile it here"
    );
    for (at, block) in blocks.iter().enumerate() {
        assert!(
            here.windows(block.len())
                .any(|window| window == block.as_slice()),
            "the README's Rust block {} is not in tests/readme.rs as written:\n{}",
            at + 1,
            block.join("\n")
        );
    }
}
