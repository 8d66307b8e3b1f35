//! Fault tests against a real redis-server: killed under load, restarted, paused. Every
//! request must get an answer, the failure mode must apply, the circuit breaker must keep
//! requests from the dead store, tollgate must go back to Redis once it answers, and no key
//! may be left without a TTL or with a negative level.
//!
//! Nothing here depends on how fast the machine is: the assertions are on counts and on who
//! decided, and every wait is a loop bounded by a request count and a generous deadline
//! that only ends it when something is truly stuck.

#![cfg(feature = "redis")]

mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use support::{RedisServer, keys_with_ttl};
use tollgate::key::Global;
use tollgate::store::RedisStore;
use tollgate::{
    CircuitBreaker, DecideFuture, FailureMode, Key, LocalFallback, Policy, PolicySet, Rate,
    RateLimitLayer, Store,
};
use tower::ServiceExt;

/// The breaker of the app under test: opens after this many failures in a row...
const BREAKER_FAILURES: u64 = 3;
/// ...and lets one request probe the store after this long.
const BREAKER_COOL_DOWN: Duration = Duration::from_millis(200);
/// The most requests one phase sends before it gives up.
const MAX_REQUESTS: usize = 20_000;
/// The longest one phase runs before it gives up: only a stuck test gets near it.
const DEADLINE: Duration = Duration::from_secs(120);

/// Who decided a response: Redis (the full quota) or the local fallback (half of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecidedBy {
    Redis,
    Fallback,
    Nobody,
}

/// A store that counts the decisions asked of the Redis store it wraps: the requests the
/// circuit breaker lets through to it.
#[derive(Clone)]
struct Counted {
    inner: RedisStore,
    calls: Arc<AtomicU64>,
}

impl Counted {
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Store for Counted {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.decide(key, policies, cost)
    }
}

async fn request(app: &Router) -> (StatusCode, DecidedBy) {
    let response = tokio::time::timeout(
        DEADLINE,
        app.clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap()),
    )
    .await
    .unwrap_or_else(|_| panic!("a request got no answer in {DEADLINE:?}"))
    .expect("the service never fails");
    let policy = response
        .headers()
        .get("ratelimit-policy")
        .map(|v| v.to_str().unwrap().to_owned());
    let by = match policy.as_deref() {
        Some(p) if p.starts_with("\"api\";q=1000000;") => DecidedBy::Redis,
        Some(p) if p.starts_with("\"api\";q=500000;") => DecidedBy::Fallback,
        _ => DecidedBy::Nobody,
    };
    (response.status(), by)
}

/// The app: a million-unit bucket (never empty in this test) that refills 100,000 a day,
/// so each request leaves state that lives for 864 ms more in Redis: the keys are still
/// there when the test reads them back, however slow the machine.
fn app(store: Counted) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(store)
                .policy(Policy::token_bucket("api", 1_000_000, Rate::per_day(100_000)).unwrap())
                .key(Global)
                .on_store_error(FailureMode::Fallback(LocalFallback::new().share(0.5)))
                .store_timeout(Duration::from_millis(100))
                .circuit_breaker(CircuitBreaker::new(
                    BREAKER_FAILURES as u32,
                    BREAKER_COOL_DOWN,
                )),
        )
        .with_state(())
}

/// What one phase saw.
struct Phase {
    answers: Vec<(StatusCode, DecidedBy)>,
    /// `until` said stop (rather than the request count or the deadline running out).
    done: bool,
    elapsed: Duration,
}

impl Phase {
    fn count(&self, by: DecidedBy) -> usize {
        self.answers.iter().filter(|(_, b)| *b == by).count()
    }

    /// Every request got a 200 with rate headers from Redis or the fallback.
    fn all_answered(&self) -> bool {
        self.answers
            .iter()
            .all(|(status, by)| *status == StatusCode::OK && *by != DecidedBy::Nobody)
    }
}

/// Sends requests 2 ms apart until `until` says stop, at most [`MAX_REQUESTS`] of them and
/// for at most [`DEADLINE`].
async fn load(app: &Router, mut until: impl FnMut(DecidedBy) -> bool) -> Phase {
    let start = Instant::now();
    let mut answers = Vec::new();
    let mut done = false;
    while answers.len() < MAX_REQUESTS && start.elapsed() < DEADLINE {
        let (status, by) = request(app).await;
        answers.push((status, by));
        if until(by) {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Phase {
        answers,
        done,
        elapsed: start.elapsed(),
    }
}

/// Sends requests until `wanted` of them were decided by `by`.
async fn until_decided_by(app: &Router, by: DecidedBy, wanted: usize) -> Phase {
    let mut seen = 0;
    load(app, |decided| {
        seen += usize::from(decided == by);
        seen >= wanted
    })
    .await
}

/// A number in a reply of redis-cli: a missing or unparsable reply fails the test.
fn number<T: FromStr>(reply: &str, what: &str) -> T {
    reply
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{what}: expected a number from Redis, got {reply:?}"))
}

/// Every key on `server` has a TTL and a level that is not negative. There must be keys:
/// the test has just been deciding on Redis.
fn assert_clean(server: &RedisServer) {
    let keys = keys_with_ttl(server);
    assert!(!keys.is_empty(), "no keys in Redis after deciding there");
    for (key, ttl) in keys {
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
        let level: f64 = number(&server.cli(&["HGET", &key, "l"]), &format!("{key} level"));
        assert!(level >= 0.0, "{key} has level {level}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_restarted_and_paused_redis() {
    let mut server = RedisServer::start();
    let port = server.port;
    let store = Counted {
        inner: RedisStore::connect(&server.url()).await.unwrap(),
        calls: Arc::default(),
    };
    let app = app(store.clone());

    // Healthy: Redis decides.
    let healthy = until_decided_by(&app, DecidedBy::Redis, 50).await;
    assert!(
        healthy.done,
        "Redis decided {} of {} requests",
        healthy.count(DecidedBy::Redis),
        healthy.answers.len()
    );
    assert!(healthy.all_answered(), "{:?}", healthy.answers);

    // Killed: every request is still answered, by the local fallback.
    server.kill();
    let calls_before = store.calls();
    let down = until_decided_by(&app, DecidedBy::Fallback, 100).await;
    let calls = store.calls() - calls_before;
    let requests = down.answers.len() as u64;
    assert!(
        down.done,
        "the fallback answered {} of {requests} requests",
        down.count(DecidedBy::Fallback)
    );
    assert!(down.all_answered(), "{:?}", down.answers);
    // The breaker opened: the dead store saw fewer calls than there were requests, namely
    // the failures that opened the breaker and at most one probe per cool-down.
    let probes = u64::try_from(down.elapsed.as_nanos() / BREAKER_COOL_DOWN.as_nanos()).unwrap();
    println!(
        "Redis down: {requests} requests, {calls} reached the store, in {:?}",
        down.elapsed
    );
    assert!(
        calls < requests,
        "{calls} of {requests} requests reached the store"
    );
    assert!(
        calls <= BREAKER_FAILURES + probes + 1,
        "{calls} of {requests} requests reached the store in {:?}: more than {BREAKER_FAILURES} \
         failures and one probe per {BREAKER_COOL_DOWN:?}",
        down.elapsed
    );

    // Restarted on its port: back on Redis, every request answered on the way.
    let server = RedisServer::start_on(port, &[]);
    let back = until_decided_by(&app, DecidedBy::Redis, 1).await;
    assert!(
        back.done,
        "not back on Redis after {} requests in {:?}",
        back.answers.len(),
        back.elapsed
    );
    assert!(back.all_answered(), "{:?}", back.answers);
    println!(
        "back on Redis after {} requests, {:?} after the restart",
        back.answers.len(),
        back.elapsed
    );

    // Paused (scripts block until the pause is lifted: a Redis that hangs): requests are
    // answered by the fallback when the store times out.
    assert_eq!(
        server.cli(&["CLIENT", "PAUSE", "600000", "WRITE"]).trim(),
        "OK"
    );
    let paused = until_decided_by(&app, DecidedBy::Fallback, 20).await;
    assert_eq!(server.cli(&["CLIENT", "UNPAUSE"]).trim(), "OK");
    assert!(
        paused.done,
        "the fallback answered {} of {} requests while Redis was paused",
        paused.count(DecidedBy::Fallback),
        paused.answers.len()
    );
    assert!(paused.all_answered(), "{:?}", paused.answers);

    // Unpaused: back on Redis.
    let back = until_decided_by(&app, DecidedBy::Redis, 50).await;
    assert!(
        back.done,
        "Redis decided {} of {} requests after the pause",
        back.count(DecidedBy::Redis),
        back.answers.len()
    );
    assert!(back.all_answered(), "{:?}", back.answers);

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
