//! One identity floods, far over its limit, against a real Redis: the deny cache keeps
//! the flood in-process. Reports the share of requests that reached Redis (asserted at
//! most 1%) and the flood's throughput next to the in-process store's.

#![cfg(feature = "redis")]

mod support;

use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use support::RedisServer;
use tollgate::key::Global;
use tollgate::store::{DenyCache, RedisStore};
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Store};
use tower::ServiceExt;

const REQUESTS: u64 = 20_000;

fn app<S: Store + Clone>(store: S) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(store)
                // Refilled one unit each 6 minutes: no flood on a loaded machine lasts
                // long enough for a unit to come back, so exactly the burst is admitted.
                .policy(Policy::token_bucket("api", 10, Rate::per_hour(10)).unwrap())
                .key(Global),
        )
        .with_state(())
}

/// Sends the flood; returns (admitted, requests per second).
async fn flood(app: &Router) -> (u64, f64) {
    let start = Instant::now();
    let mut admitted = 0;
    for _ in 0..REQUESTS {
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert!(response.headers().contains_key("retry-after"))
            }
            other => panic!("unexpected {other}"),
        }
    }
    (admitted, REQUESTS as f64 / start.elapsed().as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_identity_flood_stays_local() {
    let server = RedisServer::start();
    let redis = RedisStore::connect(&server.url()).await.unwrap();
    // Script calls of every kind (FCALL where Redis has Functions, else EVALSHA), less
    // the start-up checks the store made when it connected.
    let before = support::script_stats(&server).0;
    let cached = app(DenyCache::new(redis, 10_000));
    let (admitted, cached_rate) = flood(&cached).await;
    assert_eq!(admitted, 10, "exactly the burst, from Redis");
    let calls = support::script_stats(&server).0 - before;
    let share = calls as f64 / REQUESTS as f64;
    let (local_admitted, local_rate) = flood(&app(MemoryStore::new())).await;
    assert_eq!(local_admitted, 10);
    println!(
        "flood of {REQUESTS}: {calls} reached Redis ({:.3}%); {cached_rate:.0} req/s with Redis + deny cache vs {local_rate:.0} req/s in-process ({:.2}x)",
        share * 100.0,
        cached_rate / local_rate
    );
    // The burst was admitted by Redis, one decision each, and the first denial came from
    // it too: a count below that counts the wrong command, and would pass any flood.
    assert!(calls > 10, "only {calls} script calls seen on Redis");
    assert!(
        share <= 0.01,
        "{calls} of {REQUESTS} requests reached Redis"
    );
}
