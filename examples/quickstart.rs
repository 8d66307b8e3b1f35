//! The quickstart: an axum app behind tollgate, in-process, no server to run.
//!
//! ```text
//! cargo run --example quickstart          # serves on 127.0.0.1:3000 ($PORT to change)
//! curl -i http://127.0.0.1:3000/          # costs 1 token
//! curl -i http://127.0.0.1:3000/search    # costs 5 tokens from the same bucket
//!
//! # The same app sharing its limits through Redis (every replica sees one budget):
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example quickstart --features redis
//! ```
//!
//! Every client IP gets a token bucket named `api`: 10 tokens, refilled at 5 per second.
//! tollgate's warnings (the store went away, the store answers again) go to stderr;
//! `RUST_LOG=tollgate=debug` shows every denial too.

#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;
#[path = "support/redact.rs"]
mod redact;

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

    let (store, described): (Arc<dyn Store>, String) = match std::env::var("REDIS_URL") {
        Ok(url) => {
            // Never print the password a REDIS_URL may carry.
            let shown = redact::redact_url(&url);
            let store = redis_store(&url)
                .await
                .map_err(|error| format!("Redis at {shown}: {error}"))?;
            let described =
                format!("Redis store at {shown}; if Redis goes away, a local limiter takes over");
            (store, described)
        }
        Err(_) => (Arc::new(MemoryStore::new()), "in-process store".to_owned()),
    };
    let app = app(store)?;

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("tollgate quickstart listening on http://{addr} ({described})");
    println!(
        "policy: token bucket \"api\", 10 tokens, refilled at 5/s, per client IP; /search costs 5"
    );
    println!("try:    curl -i http://{addr}/search");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

#[cfg(feature = "redis")]
async fn redis_store(url: &str) -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    Ok(Arc::new(tollgate::store::RedisStore::connect(url).await?))
}

#[cfg(not(feature = "redis"))]
async fn redis_store(_url: &str) -> Result<Arc<dyn Store>, Box<dyn std::error::Error>> {
    Err("this build has no Redis support: run with --features redis".into())
}
