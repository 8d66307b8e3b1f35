//! The quickstart: an axum app behind tollgate, in-process, no server to run.
//!
//! ```text
//! cargo run --example quickstart          # serves on 127.0.0.1:3000 ($PORT to change)
//! curl -i http://127.0.0.1:3000/          # costs 1 token
//! curl -i http://127.0.0.1:3000/search    # costs 5 tokens from the same bucket
//! ```
//!
//! Every client IP gets a token bucket named `api`: 10 tokens, refilled at 5 per second.

use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use tollgate::cost::PerRoute;
use tollgate::key::ClientIp;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port
            .parse()
            .map_err(|_| format!("PORT must be a port number, got {port:?}"))?,
        Err(_) => 3000,
    };

    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?)
        .key(ClientIp::peer())
        .cost(PerRoute::new(1).route("/search", 5));

    let app = Router::new()
        .route("/", get(|| async { "hello from behind tollgate\n" }))
        .route(
            "/search",
            get(|| async { "search results (this cost 5 tokens)\n" }),
        )
        .layer(limiter);

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("tollgate quickstart listening on http://{addr}");
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
