//! A fleet set-up: every replica of this app shares its limits through Redis (one server,
//! a Sentinel-managed primary, or a Redis Cluster), so N replicas enforce one limit, not N.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 REPLICAS=3 cargo run --example redis --features redis
//! REDIS_URL=rediss://user:password@redis.example:6380 cargo run --example redis --features tls
//! REDIS_SENTINEL_URLS=redis://127.0.0.1:26379,redis://127.0.0.1:26380 REDIS_SENTINEL_MASTER=mymaster \
//!   cargo run --example redis --features redis
//! REDIS_CLUSTER=redis://127.0.0.1:7000,redis://127.0.0.1:7001 cargo run --example redis --features redis
//! curl -i -H 'x-api-key: demo' http://127.0.0.1:3000/
//! ```
//!
//! Clients are keyed by their API key (hashed before it reaches Redis) when the app knows
//! it, or by IP when they send none, or one the app does not know (a client making up a
//! key per request would otherwise get a new bucket with each). Each gets a burst of 20
//! refilled at 10 per second, and 10,000 per day; both are decided in one round trip,
//! all-or-nothing. While Redis is away, each of the `REPLICAS` replicas (default 1)
//! enforces its share of every limit on its own. tollgate's warnings (Redis went away, Redis answers again) go to
//! stderr; `RUST_LOG=tollgate=debug` shows every denial too.

#[path = "support/api_keys.rs"]
mod api_keys;
#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tollgate::key::{ClientIp, HeaderKey, KeyExtractorExt};
use tollgate::store::{RedisConfig, RedisStore};
use tollgate::{FailureMode, LocalFallback, Policy, PolicySet, Rate, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    // Where Redis is, from the environment; shown with passwords hidden.
    let Some(config) = RedisConfig::from_env()? else {
        return Err(
            "set REDIS_URL (redis:// or rediss://), REDIS_SENTINEL_URLS with \
                    REDIS_SENTINEL_MASTER, or REDIS_CLUSTER (comma-separated nodes)"
                .into(),
        );
    };
    let shown = config.describe();
    let store = config
        .connect()
        .await
        .map_err(|error| format!("Redis at {shown}: {error}"))?;
    let policies = PolicySet::new([
        Policy::token_bucket("burst", 20, Rate::per_second(10))?,
        Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?,
    ])?;
    // Fail at start-up, not on the first request, if a policy is too large for Redis.
    RedisStore::check_policies(&policies)?;

    // Per known API key, else per address: unknown keys are dropped before the limiter
    // (the layer added last runs first). In an app, key by what your auth layer
    // verified (`ExtensionKey`), with the limiter behind it.
    // While Redis is away each replica decides alone: with N replicas (`REPLICAS`,
    // default 1) each enforces 1/N of every limit, so the fleet still admits about one
    // limit, not N of them.
    let replicas: u32 = match std::env::var("REPLICAS") {
        Ok(count) => count
            .parse()
            .map_err(|_| format!("REPLICAS={count:?} is not a count"))?,
        Err(_) => 1,
    };
    let limiter = RateLimitLayer::new(store)
        .policies(policies)
        .key(HeaderKey::new("x-api-key").or(ClientIp::peer()))
        .on_store_error(FailureMode::Fallback(
            LocalFallback::new().share(1.0 / f64::from(replicas.max(1))),
        ));
    let app = Router::new()
        .route("/", get(|| async { "hello from the fleet\n" }))
        .layer(limiter)
        .layer(axum::middleware::map_request(api_keys::drop_unknown_key));

    let port = port::from_env()?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "listening on http://{}, limits shared through {shown}",
        listener.local_addr()?
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
