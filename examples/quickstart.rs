//! The quickstart: an axum app behind tollgate, in-process, no server to run.
//!
//! ```text
//! cargo run --example quickstart          # serves on 127.0.0.1:3000 ($PORT to change)
//! curl -i http://127.0.0.1:3000/          # costs 1 token
//! curl -i http://127.0.0.1:3000/search    # costs 5 tokens from the same bucket
//!
//! # The same app sharing its limits through Redis (every replica sees one budget):
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example quickstart --features redis
//! # over TLS, with the system's root certificates:
//! REDIS_URL=rediss://user:password@redis.example:6380 cargo run --example quickstart --features tls
//! # the primary that Redis Sentinel names, followed across failovers:
//! REDIS_SENTINEL_URLS=redis://127.0.0.1:26379,redis://127.0.0.1:26380 \
//!   REDIS_SENTINEL_MASTER=mymaster cargo run --example quickstart --features redis
//! ```
//!
//! Every client IP gets a token bucket named `api`: 10 tokens, refilled at 5 per second.
//! tollgate's warnings (the store went away, the store answers again) go to stderr;
//! `RUST_LOG=tollgate=debug` shows every denial too.

#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use tollgate::cost::PerRoute;
use tollgate::key::ClientIp;
use tollgate::{MemoryStore, Policy, PolicyError, Rate, RateLimitLayer, Store};

/// The app, over whichever store decides (picked at run time: no generic needed).
fn app(store: Arc<dyn Store>) -> Result<Router, PolicyError> {
    let limiter = RateLimitLayer::new(store)
        .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?)
        .key(ClientIp::peer())
        .cost(PerRoute::new(1).route("/search", 5));
    Ok(Router::new()
        .route("/", get(|| async { "hello from behind tollgate\n" }))
        .route(
            "/search",
            get(|| async { "search results (this cost 5 tokens)\n" }),
        )
        .layer(limiter))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    let port = port::from_env()?;

    // REDIS_URL, or REDIS_SENTINEL_URLS with REDIS_SENTINEL_MASTER (or REDIS_CLUSTER):
    // shared limits; none of them: in-process.
    let (store, described) = match redis_store().await? {
        Some(found) => found,
        None => (
            Arc::new(MemoryStore::new()) as Arc<dyn Store>,
            "in-process store".to_owned(),
        ),
    };
    let app = app(store)?;

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("tollgate quickstart listening on http://{addr} ({described})");
    println!(
        "policy: token bucket \"api\", 10 tokens, refilled at 5/s, per client IP; /search costs 5"
    );
    println!(
        "try:    for i in 1 2 3; do curl -si http://{addr}/search; done   # the third is a 429"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

/// The Redis store the environment names, and how to describe it (never with a password).
#[cfg(feature = "redis")]
async fn redis_store() -> Result<Option<(Arc<dyn Store>, String)>, Box<dyn std::error::Error>> {
    let Some(config) = tollgate::store::RedisConfig::from_env()? else {
        return Ok(None);
    };
    let shown = config.describe();
    let store = config
        .connect()
        .await
        .map_err(|error| format!("Redis at {shown}: {error}"))?;
    let described =
        format!("Redis store at {shown}; if Redis goes away, a local limiter takes over");
    Ok(Some((Arc::new(store), described)))
}

#[cfg(not(feature = "redis"))]
async fn redis_store() -> Result<Option<(Arc<dyn Store>, String)>, Box<dyn std::error::Error>> {
    let named = [
        "REDIS_URL",
        "REDIS_SENTINEL_URLS",
        "REDIS_SENTINEL_MASTER",
        "REDIS_CLUSTER",
    ]
    .into_iter()
    .any(|name| std::env::var_os(name).is_some());
    if named {
        return Err("this build has no Redis support: run with --features redis".into());
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use http::{Request, StatusCode};
    use tower::ServiceExt;

    fn from(ip: [u8; 4], path: &str) -> Request<Body> {
        let mut request = Request::get(path).body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from((ip, 4000))));
        request
    }

    /// What the docs promise: 10 tokens per client IP, /search costs 5.
    #[tokio::test]
    async fn two_searches_empty_a_clients_bucket() {
        // Time stands still: on the machine's clock a token comes back each 200 ms, and a
        // loaded machine could see one between the searches and the denial.
        let still = MemoryStore::builder()
            .clock(tollgate::clock::ManualClock::new())
            .build();
        let app = app(Arc::new(still)).unwrap();
        for _ in 0..2 {
            let ok = app
                .clone()
                .oneshot(from([192, 0, 2, 1], "/search"))
                .await
                .unwrap();
            assert_eq!(ok.status(), StatusCode::OK);
        }
        let denied = app
            .clone()
            .oneshot(from([192, 0, 2, 1], "/"))
            .await
            .unwrap();
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(denied.headers().contains_key("retry-after"));
        // Another client has its own bucket.
        let other = app.oneshot(from([192, 0, 2, 2], "/search")).await.unwrap();
        assert_eq!(other.status(), StatusCode::OK);
    }
}
