//! Fault tests against a real redis-server: killed under load, restarted, paused. Every
//! request must get an answer, the failure mode must apply, tollgate must be back on Redis
//! within seconds of recovery, and no key may be left without a TTL or with a negative
//! count.

#![cfg(feature = "redis")]

mod support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use support::{RedisServer, keys_with_ttl};
use tollgate::key::Global;
use tollgate::store::RedisStore;
use tollgate::{CircuitBreaker, FailureMode, LocalFallback, Policy, Rate, RateLimitLayer};
use tower::ServiceExt;

/// Who decided a response: Redis (the full quota) or the local fallback (half of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecidedBy {
    Redis,
    Fallback,
    Nobody,
}

async fn request(app: &Router) -> (StatusCode, DecidedBy) {
    let response = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .expect("the service never fails");
    let by = match response
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().unwrap())
    {
        Some("\"api\";q=1000000;w=1") => DecidedBy::Redis,
        Some("\"api\";q=500000;w=1") => DecidedBy::Fallback,
        _ => DecidedBy::Nobody,
    };
    (response.status(), by)
}

fn app(store: RedisStore) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(store)
                .policy(
                    Policy::token_bucket("api", 1_000_000, Rate::per_second(1_000_000)).unwrap(),
                )
                .key(Global)
                .on_store_error(FailureMode::Fallback(LocalFallback::new().share(0.5)))
                .store_timeout(Duration::from_millis(100))
                .circuit_breaker(CircuitBreaker::new(3, Duration::from_millis(200))),
        )
        .with_state(())
}

/// Sends requests until `until` says stop (bounded by `limit`), 2 ms apart.
async fn load(
    app: &Router,
    limit: Duration,
    mut until: impl FnMut(DecidedBy) -> bool,
) -> Vec<(Duration, StatusCode, DecidedBy)> {
    let start = Instant::now();
    let mut seen = Vec::new();
    while start.elapsed() < limit {
        let (status, by) = request(app).await;
        seen.push((start.elapsed(), status, by));
        if until(by) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    seen
}

fn assert_clean(server: &RedisServer) {
    for (key, ttl) in keys_with_ttl(server) {
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
        let level = server.cli(&["HGET", &key, "l"]);
        let level: f64 = level.trim().parse().unwrap_or(0.0);
        assert!(level >= 0.0, "{key} has level {level}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_restarted_and_paused_redis() {
    let mut server = RedisServer::start();
    let port = server.port;
    let app = app(RedisStore::connect(&server.url()).await.unwrap());

    // Healthy: Redis decides.
    let mut sent = 0;
    let healthy = load(&app, Duration::from_secs(5), |_| {
        sent += 1;
        sent >= 50
    })
    .await;
    assert!(
        healthy
            .iter()
            .all(|(_, status, by)| *status == StatusCode::OK && *by == DecidedBy::Redis)
    );

    // Killed: every request is still answered, by the local fallback.
    server.kill();
    let mut fallback_answers = 0;
    let down = load(&app, Duration::from_secs(10), |by| {
        fallback_answers += u32::from(by == DecidedBy::Fallback);
        fallback_answers >= 100
    })
    .await;
    assert!(
        down.iter()
            .all(|(_, status, by)| *status == StatusCode::OK && *by != DecidedBy::Nobody),
        "{down:?}"
    );
    assert!(
        fallback_answers >= 100,
        "the fallback answered {fallback_answers} times: {:?}",
        &down[..down.len().min(20)]
    );
    // The breaker spares the requests the wait: most answers come at once.
    let slow = down
        .windows(2)
        .filter(|pair| pair[1].0 - pair[0].0 > Duration::from_millis(50))
        .count();
    assert!(
        slow * 10 < down.len(),
        "{slow} of {} requests waited",
        down.len()
    );

    // Restarted: back on Redis within a few seconds.
    let restarted = Instant::now();
    let server = RedisServer::start_on(port, &[]);
    let back = load(&app, Duration::from_secs(15), |by| by == DecidedBy::Redis).await;
    let recovery = restarted.elapsed();
    assert_eq!(
        back.last().map(|(_, _, by)| *by),
        Some(DecidedBy::Redis),
        "never back on Redis"
    );
    assert!(back.iter().all(|(_, status, _)| *status == StatusCode::OK));
    println!("back on Redis {recovery:?} after the restart");
    assert!(recovery < Duration::from_secs(5), "took {recovery:?}");

    // Paused (every client blocked for 1.5 s): answered by the fallback within the
    // timeout, and back on Redis after the pause.
    assert_eq!(server.cli(&["CLIENT", "PAUSE", "1500", "ALL"]).trim(), "OK");
    let paused_at = Instant::now();
    let mut fallback_answers = 0;
    let paused = load(&app, Duration::from_secs(10), |by| {
        fallback_answers += u32::from(by == DecidedBy::Fallback);
        fallback_answers >= 20
    })
    .await;
    assert!(
        paused
            .iter()
            .all(|(_, status, by)| *status == StatusCode::OK && *by != DecidedBy::Nobody)
    );
    assert!(
        paused_at.elapsed() < Duration::from_millis(1_500),
        "the fallback came too late"
    );
    let back = load(&app, Duration::from_secs(15), |by| by == DecidedBy::Redis).await;
    assert_eq!(back.last().map(|(_, _, by)| *by), Some(DecidedBy::Redis));

    assert_clean(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_503_while_redis_is_down() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(store)
                .policy(Policy::gcra("api", Rate::per_second(1_000), 1_000).unwrap())
                .key(Global)
                .on_store_error(FailureMode::FailClosed),
        )
        .with_state(());
    let first = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    server.kill();
    for _ in 0..20 {
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        // Never a 429: a store failure is not a rate decision.
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
    }
}
