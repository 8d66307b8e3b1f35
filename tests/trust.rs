//! Issue 8, "Trust": one test per defect a careful review found. Each of these failed on
//! the main branch before the fix (the closing note of the issue lists them).
//!
//! Standards checked here: draft-ietf-httpapi-ratelimit-headers-11 (the `RateLimit` and
//! `RateLimit-Policy` fields, the effective window `t`, the "Quota Exceeded" and
//! "Temporary Reduced Capacity" problem types), RFC 9457 (problem details) and RFC 9651
//! (structured field values: integers of at most 15 digits, section 3.3.1).

mod support;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;

use tollgate::store::DenyCache;
use tollgate::{
    CircuitBreaker, DecideFuture, FailureMode, HeaderStyle, Key, MemoryStore, Outcome, Policy,
    PolicySet, Rate, RateLimitLayer, Store, StoreError, StoreErrorKind,
};

const PEER: ([u8; 4], u16) = ([203, 0, 113, 7], 40000);

fn request(path: &str, cost: u64) -> Request<Body> {
    let mut request = Request::get(path)
        .header("x-cost", cost.to_string())
        .body(Body::empty())
        .unwrap();
    request
        .extensions_mut()
        .insert(std::net::SocketAddr::from(PEER));
    request
}

fn cost_header() -> impl tollgate::cost::Cost + Clone {
    tollgate::cost::from_fn(|parts| {
        parts
            .headers
            .get("x-cost")
            .and_then(|value| value.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    })
}

/// The status of a `GET /` of `cost` through `app`.
async fn status_of(app: &Router, cost: u64) -> StatusCode {
    app.clone()
        .oneshot(request("/", cost))
        .await
        .unwrap()
        .status()
}

fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

async fn body_text(response: Response<impl http_body::Body<Error: std::fmt::Debug>>) -> String {
    use http_body_util::BodyExt;
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn header<B>(response: &Response<B>, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .map(|value| value.to_str().unwrap().to_owned())
}

/// A store whose health the test sets: up (an in-process store decides), down (an error
/// at once) or hung (no answer ever). Counts the calls that reach it.
#[derive(Clone)]
struct Switch {
    inner: MemoryStore,
    mode: Arc<AtomicU8>,
    calls: Arc<AtomicU64>,
}

const UP: u8 = 0;
const DOWN: u8 = 1;
const HUNG: u8 = 2;
const REFUSING: u8 = 3;
const UNSUPPORTED: u8 = 4;
/// No primary for anyone, as the Sentinel client says when no sentinel knows the name.
const NO_PRIMARY: u8 = 5;
/// Up, answering once the task has yielded once (a round trip).
const SLOW: u8 = 6;

impl Switch {
    fn new() -> Self {
        Self {
            inner: MemoryStore::new(),
            mode: Arc::new(AtomicU8::new(UP)),
            calls: Arc::new(AtomicU64::new(0)),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Store for Switch {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.mode.load(Ordering::SeqCst) {
            DOWN => DecideFuture::new(async {
                Err(StoreError::new(StoreErrorKind::Unavailable, "switched off"))
            }),
            HUNG => DecideFuture::new(std::future::pending()),
            REFUSING => DecideFuture::new(async {
                Err(StoreError::new(StoreErrorKind::Refused, "WRONGTYPE").with_code("WRONGTYPE"))
            }),
            // Refused before any I/O, as the Redis store refuses a per-request policy it
            // cannot decide exactly: the backend was never asked.
            UNSUPPORTED => DecideFuture::ready(Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "this store cannot decide that policy",
            ))),
            NO_PRIMARY => DecideFuture::ready(Err(StoreError::new(
                StoreErrorKind::Other,
                "no primary from the sentinels: no sentinel knows a primary named \"x\"",
            )
            .for_every_request())),
            SLOW => {
                let decision = self.inner.check(key.as_str(), policies, cost);
                DecideFuture::new(async move {
                    tokio::task::yield_now().await;
                    Ok(decision)
                })
            }
            _ => {
                let decision = self.inner.check(key.as_str(), policies, cost);
                DecideFuture::new(async move { Ok(decision) })
            }
        }
    }
}

/// A [`Switch`] that takes units back too (what `Leased` needs), failing as its
/// decisions do.
struct Adjusting(Switch);

impl Store for Adjusting {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::store::Adjustment,
    ) -> DecideFuture {
        match self.0.mode.load(Ordering::SeqCst) {
            UP => self.0.inner.adjust(key, policies, adjustment),
            _ => self.0.decide(key, policies, 0),
        }
    }
}

// Item 1: a probe whose request is dropped mid-flight must not keep the breaker open.
// The store still hangs when the probe's stand-in asks it (see below): the stand-in holds
// the probe until the store timeout, as the probe would have, and its timeout starts a
// new cool-down; the probe after it finds the store back.
#[tokio::test]
async fn a_dropped_probe_does_not_keep_the_breaker_open() {
    let store = Switch::new();
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .on_store_error(FailureMode::FailOpen)
            .store_timeout(Duration::from_millis(200))
            .circuit_breaker(CircuitBreaker::new(1, Duration::from_millis(20))),
    );
    store.set(DOWN);
    app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(store.calls(), 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The probe hangs; its client gives up (an outer timeout drops the future).
    store.set(HUNG);
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        app.clone().oneshot(request("/", 1)),
    )
    .await;
    assert!(
        dropped.is_err(),
        "the probe's request was dropped mid-flight"
    );
    assert_eq!(store.calls(), 2, "it was the probe");
    // Its stand-in asks the store, which still hangs.
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    assert_eq!(store.calls(), 3, "the stand-in asked");
    // The store is healthy again: the layer must come back to it by itself.
    store.set(UP);
    let mut back = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let response = app.clone().oneshot(request("/", 1)).await.unwrap();
        if response.headers().contains_key("ratelimit") {
            back = true;
            break;
        }
    }
    assert!(
        back,
        "the breaker stayed open: the layer never returned to the store"
    );
    assert!(store.calls() >= 4);
}

/// A client that resets each request at once (an HTTP/2 stream reset with its headers)
/// wins the breaker's probe time after time, once the store is back: each probe dropped
/// before its answer only held the breaker open another 100 ms, and the next probe went
/// to whoever came first, the same client again. The breaker stayed open as long as it
/// kept on, and every other request met the failure mode (here no limit at all). A probe
/// dropped so is answered all the same: its key is peeked at in its place, and the
/// store's answer closes the breaker.
#[tokio::test]
async fn clients_that_cancel_every_probe_do_not_keep_the_breaker_open() {
    let store = Switch::new();
    let clock = tollgate::clock::ManualClock::new();
    let app = over_a_clocked_breaker(
        &store,
        CircuitBreaker::new(1, Duration::from_secs(1)),
        &clock,
    );
    store.set(DOWN);
    app.clone().oneshot(request("/", 1)).await.unwrap();
    clock.advance(Duration::from_millis(1001));
    store.set(SLOW);
    let mut back = false;
    for _ in 0..20 {
        // The probe goes out, and its client is gone before the answer.
        let mut cancelled = Box::pin(app.clone().oneshot(request("/", 1)));
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(cancelled.as_mut().poll(cx))).await;
        assert!(polled.is_pending(), "the probe waits on the store");
        drop(cancelled);
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        let response = app.clone().oneshot(request("/", 1)).await.unwrap();
        if response.headers().contains_key("ratelimit") {
            back = true;
            break;
        }
        clock.advance(Duration::from_millis(100));
    }
    assert!(back, "cancelled probes kept the breaker open");
}

/// `hello` behind a layer over `store` that fails open, waits up to 30 s on the store,
/// and whose `breaker` reads `clock`.
fn over_a_clocked_breaker(
    store: &Switch,
    breaker: CircuitBreaker,
    clock: &tollgate::clock::ManualClock,
) -> Router {
    hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .on_store_error(FailureMode::FailOpen)
            .store_timeout(Duration::from_secs(30))
            .circuit_breaker(breaker.with_clock(clock.clone())),
    )
}

/// A request to `app` polled until it waits on the (hung) store, still waiting.
async fn waiting_on_the_store(
    app: &Router,
) -> std::pin::Pin<Box<tower::util::Oneshot<Router, Request<Body>>>> {
    let mut waiting = Box::pin(app.clone().oneshot(request("/", 1)));
    let polled = tokio::time::timeout(Duration::from_millis(5), &mut waiting).await;
    assert!(polled.is_err(), "the request waits on the hung store");
    waiting
}

// A request that waited on the store since before an outage, dropped after the breaker's
// probe found the store back, says nothing of the store: the probe's answer came after
// it began to wait. The probe's answer was not marked as one (only other requests'
// were), so the old request's drop counted as a timeout and opened the breaker again,
// on a store that answers.
#[tokio::test]
async fn a_request_dropped_after_the_probe_found_the_store_back_keeps_the_breaker_closed() {
    let store = Switch::new();
    let clock = tollgate::clock::ManualClock::new();
    let app = over_a_clocked_breaker(
        &store,
        CircuitBreaker::new(1, Duration::from_secs(1)),
        &clock,
    );
    // A request waits on a store that hangs; another meets it down: the breaker opens.
    store.set(HUNG);
    let old = waiting_on_the_store(&app).await;
    store.set(DOWN);
    app.clone().oneshot(request("/", 1)).await.unwrap();
    // The cool-down passes; the probe finds the store back.
    clock.advance(Duration::from_secs(2));
    store.set(UP);
    let probe = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert!(
        probe.headers().contains_key("ratelimit"),
        "the probe was answered"
    );
    // The old request is given up, long after it began to wait.
    clock.advance(Duration::from_millis(150));
    drop(old);
    let calls = store.calls();
    let next = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(
        store.calls(),
        calls + 1,
        "the breaker opened again: the store was skipped"
    );
    assert!(next.headers().contains_key("ratelimit"));
}

// A store that hangs while an outer timeout (or the client) gives up before the store
// timeout does: each request was dropped waiting, nothing was counted, and the breaker
// never opened (every request waited on the hung store until the outer timeout). A request
// dropped after waiting on the store for `PROBE_PATIENCE` (100 ms), with no answer from the
// store to any request meanwhile, counts as the store timing out; one dropped sooner, or
// while the store answers others, says nothing of the store.
#[tokio::test]
async fn requests_dropped_while_the_store_hangs_open_the_breaker() {
    let store = Switch::new();
    let clock = tollgate::clock::ManualClock::new();
    let app = over_a_clocked_breaker(
        &store,
        CircuitBreaker::new(2, Duration::from_secs(3600)),
        &clock,
    );
    store.set(HUNG);
    // Polled until it waits on the store, then dropped `waited` later (by the breaker's
    // clock).
    let given_up_after = |waited: Duration| {
        let app = app.clone();
        let clock = clock.clone();
        async move {
            let waiting = waiting_on_the_store(&app).await;
            clock.advance(waited);
            drop(waiting);
        }
    };
    // Dropped at once (a client that resets its request): nothing said of the store.
    for _ in 0..3 {
        given_up_after(Duration::from_millis(10)).await;
    }
    assert_eq!(store.calls(), 3);
    // Dropped late while the store answered another request meanwhile: the store is slow
    // for some, not hanging (clients that give up at once on a slow store cannot open
    // the breaker that way).
    for _ in 0..3 {
        let waiting = waiting_on_the_store(&app).await;
        clock.advance(Duration::from_millis(50));
        store.set(UP);
        let answered = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert!(
            answered.headers().contains_key("ratelimit"),
            "the store answered"
        );
        store.set(HUNG);
        clock.advance(Duration::from_millis(100));
        drop(waiting);
    }
    assert_eq!(store.calls(), 9);
    // Dropped after waiting with no answer from the store meanwhile: two timeouts open
    // the breaker.
    for _ in 0..2 {
        given_up_after(Duration::from_millis(150)).await;
    }
    assert_eq!(store.calls(), 11);
    store.set(UP);
    let response = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        store.calls(),
        11,
        "two requests given up on a hung store opened the breaker: the next skips it"
    );
    assert!(
        !response.headers().contains_key("ratelimit"),
        "failed open, no store answer"
    );
}

// The same for a set that shapes: a request given up on while its decision is on its way
// is dropped with it, and counts as the store timing out (a version that kept such a
// decision alive to give its booked place back swallowed the store's failure).
#[tokio::test]
async fn requests_dropped_while_the_store_hangs_open_the_breaker_under_shaping() {
    let store = Switch::new();
    let clock = tollgate::clock::ManualClock::new();
    let paced =
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1_000), Duration::from_secs(1))
            .unwrap();
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(paced)
            .on_store_error(FailureMode::FailOpen)
            .store_timeout(Duration::from_secs(30))
            .circuit_breaker(
                CircuitBreaker::new(2, Duration::from_secs(3600)).with_clock(clock.clone()),
            ),
    );
    store.set(HUNG);
    for _ in 0..2 {
        let waiting = waiting_on_the_store(&app).await;
        clock.advance(Duration::from_millis(150));
        drop(waiting);
    }
    assert_eq!(store.calls(), 2);
    store.set(UP);
    let response = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        store.calls(),
        2,
        "two requests given up on a hung store opened the breaker: the next skips it"
    );
}

// A cool-down past `MAX_PERIOD` (`Duration::MAX`, meant as "never probe") made an open
// breaker stay open for the life of the process: its end saturated, and no request ever
// probed the store again. It is refused when the layer is built, as a lease's `ttl` is.
#[test]
fn a_cool_down_that_would_never_end_is_refused() {
    let layer = |cool_down| {
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::token_bucket("api", 10, Rate::per_second(10)).unwrap())
            .circuit_breaker(CircuitBreaker::new(5, cool_down))
    };
    let error = layer(Duration::MAX).validate().unwrap_err();
    assert!(error.contains("cool-down"), "{error}");
    assert!(layer(tollgate::policy::MAX_PERIOD).validate().is_ok());
}

// Item 10: an answer from the deny cache is not the store answering.
#[tokio::test]
async fn a_cached_denial_never_closes_the_breaker() {
    let store = Switch::new();
    let cache = DenyCache::new(store.clone(), 1_000);
    // The breaker's cool-down on a manual clock: the probe comes when the test says.
    let clock = tollgate::clock::ManualClock::new();
    let app = hello().layer(
        RateLimitLayer::new(cache)
            .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::from_fn(|parts| {
                Ok(Key::new(parts.headers["x-who"].to_str().unwrap_or("?")))
            }))
            .on_store_error(FailureMode::FailOpen)
            .store_timeout(Duration::from_secs(30))
            .circuit_breaker(
                CircuitBreaker::new(3, Duration::from_millis(20)).with_clock(clock.clone()),
            ),
    );
    let who = |name: &str| {
        Request::get("/")
            .header("x-who", name)
            .body(Body::empty())
            .unwrap()
    };
    // "hot" spends its hour and is denied by the store: the denial is cached.
    assert_eq!(app.clone().oneshot(who("hot")).await.unwrap().status(), 200);
    assert_eq!(app.clone().oneshot(who("hot")).await.unwrap().status(), 429);
    // The store goes down; three failures open the breaker.
    store.set(DOWN);
    for _ in 0..3 {
        app.clone().oneshot(who("cold")).await.unwrap();
    }
    let calls = store.calls();
    clock.advance(Duration::from_millis(30));
    // The probe happens to be a request the cache answers: the store said nothing.
    assert_eq!(app.clone().oneshot(who("hot")).await.unwrap().status(), 429);
    // So the breaker is still open: of the next requests, at most one probes the store.
    for _ in 0..3 {
        app.clone().oneshot(who("cold")).await.unwrap();
    }
    assert!(
        store.calls() - calls <= 1,
        "{} calls reached a store that is down: the cached answer closed the breaker",
        store.calls() - calls
    );
}

// Item 9: a costlier request never gets a cheaper one's Retry-After from the cache.
#[tokio::test]
async fn a_cached_denial_is_only_reused_for_the_same_cost() {
    let clock = tollgate::clock::ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let cache = DenyCache::with_clock(store, 1_000, clock);
    let policies = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(1)).unwrap());
    let key = Key::new("k");
    assert!(
        cache
            .decide(&key, &policies, 10)
            .await
            .unwrap()
            .is_allowed()
    );
    let cheap = cache.decide(&key, &policies, 2).await.unwrap();
    let cheap_wait = cheap.retry_after().unwrap();
    assert_eq!(cheap_wait, Duration::from_secs(2));
    let costly = cache.decide(&key, &policies, 8).await.unwrap();
    assert_eq!(
        costly.retry_after().unwrap(),
        Duration::from_secs(8),
        "a cost of 8 needs 8 s at 1/s"
    );
}

// Item 8: a cached denial never repeats the numbers seen when it was cached.
#[tokio::test]
async fn a_cached_denial_never_sends_stale_numbers() {
    let clock = tollgate::clock::ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let app = hello().layer(
        RateLimitLayer::new(DenyCache::with_clock(store, 1_000, clock.clone()))
            .policy(Policy::token_bucket("api", 10, Rate::per_second(2)).unwrap())
            .cost(cost_header()),
    );
    assert_eq!(status_of(&app, 10).await, 200);
    let first = app.clone().oneshot(request("/", 5)).await.unwrap();
    assert_eq!(first.status(), 429);
    assert_eq!(header(&first, "ratelimit").unwrap(), "\"api\";r=0;t=1");
    // 1.1 s later two tokens are back; the cached denial (5 needs 2.5 s) still stands.
    clock.advance(Duration::from_millis(1_100));
    let second = app.clone().oneshot(request("/", 5)).await.unwrap();
    assert_eq!(second.status(), 429);
    // The numbers of now, not the cached `r=0`: 2 are back.
    assert_eq!(
        header(&second, "ratelimit").as_deref(),
        Some("\"api\";r=2;t=1"),
        "the numbers must be true when sent"
    );
    assert!(header(&second, "ratelimit-policy").is_some());
    let retry: u64 = header(&second, "retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
}

// Item 7: the shaping bucket answers a cost that can never fit like the others do.
#[tokio::test]
async fn shaping_refuses_a_cost_that_can_never_fit() {
    let store = MemoryStore::new();
    let shaping = PolicySet::from(
        Policy::leaky_bucket_shaping("partner", Rate::per_second(2), Duration::from_secs(2))
            .unwrap(),
    );
    let limit = shaping[0].limit();
    let decision = store.check("k", &shaping, 1_000_000);
    assert_eq!(
        decision.outcome(),
        Outcome::CostExceedsLimit {
            policy: 0,
            cost: 1_000_000,
            limit
        }
    );
    // ... and the bucket is untouched: a request that fits is served at once.
    assert_eq!(
        store.check("k", &shaping, 1).outcome(),
        Outcome::Allowed {
            delay: Duration::ZERO
        }
    );
    // Through the layer: 400, never a long hold.
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(shaping)
            .cost(cost_header()),
    );
    let response = app.oneshot(request("/", u64::MAX)).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}

/// Every algorithm, at ordinary sizes.
fn every_algorithm() -> Vec<Policy> {
    vec![
        Policy::fixed_window("fw", 10, Duration::from_secs(60)).unwrap(),
        Policy::sliding_log("sl", 10, Duration::from_secs(60)).unwrap(),
        Policy::sliding_window("sw", 10, Duration::from_secs(60)).unwrap(),
        Policy::sliding_window_split("sw4", 10, Duration::from_secs(60), 4).unwrap(),
        Policy::token_bucket("tb", 10, Rate::per_second(5)).unwrap(),
        Policy::leaky_bucket("lb", 10, Rate::per_second(5)).unwrap(),
        Policy::leaky_bucket_shaping("ls", Rate::per_second(5), Duration::from_secs(1)).unwrap(),
        Policy::gcra("gc", Rate::per_second(5), 10).unwrap(),
    ]
}

// The effective window: the quickstart drained to r=0 says t=1 (the next token, 0.2 s
// away, rounded up), and Retry-After is never earlier than the denying policy's t.
// (Paused tokio time: the shaping bucket's holds pass at once.)
#[tokio::test(start_paused = true)]
async fn t_is_the_effective_window_and_retry_after_is_never_before_it() {
    // A store on a clock that stands still: a loaded machine's stall between the two
    // requests would refill a token (one each 0.2 s) and make `r=0` an `r=1`.
    let still = MemoryStore::builder()
        .clock(tollgate::clock::ManualClock::new())
        .build();
    let app = hello().layer(
        RateLimitLayer::new(still)
            .policy(Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap())
            .cost(cost_header()),
    );
    let drained = app.clone().oneshot(request("/", 10)).await.unwrap();
    assert_eq!(header(&drained, "ratelimit").unwrap(), "\"api\";r=0;t=1");
    let denied = app.clone().oneshot(request("/", 5)).await.unwrap();
    assert_eq!(denied.status(), 429);
    assert_eq!(header(&denied, "ratelimit").unwrap(), "\"api\";r=0;t=1");
    assert_eq!(header(&denied, "retry-after").unwrap(), "1");

    for policy in every_algorithm() {
        let name = policy.name().to_owned();
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(policy)
                .cost(cost_header()),
        );
        let mut denials = 0;
        for cost in [1, 3, 1, 4, 2, 1, 5, 1, 1, 2, 3, 1, 1] {
            let response = app.clone().oneshot(request("/", cost)).await.unwrap();
            if response.status() != StatusCode::TOO_MANY_REQUESTS {
                continue;
            }
            denials += 1;
            let rate = header(&response, "ratelimit").unwrap();
            let t: u64 = rate.rsplit("t=").next().unwrap().parse().unwrap();
            let retry: u64 = header(&response, "retry-after").unwrap().parse().unwrap();
            assert!(
                retry >= t.max(1),
                "{name}: Retry-After {retry} points before the effective window t={t}"
            );
        }
        assert!(denials > 0, "{name} never denied");
    }
}

// The 429 body: the draft's problem type, with violated-policies (RFC 9457 extension
// member); the 503 of fail-closed: temporary-reduced-capacity.
#[tokio::test]
async fn problem_bodies_use_the_drafts_problem_types() {
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::token_bucket("burst", 2, Rate::per_second(1)).unwrap())
            .policy(Policy::fixed_window("daily", 3, Duration::from_secs(86_400)).unwrap())
            .cost(cost_header()),
    );
    assert_eq!(
        app.clone().oneshot(request("/", 2)).await.unwrap().status(),
        200
    );
    let denied = app.clone().oneshot(request("/", 2)).await.unwrap();
    assert_eq!(denied.status(), 429);
    let body: serde_json::Value = serde_json::from_str(&body_text(denied).await).unwrap();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(body["status"], 429);
    // Both are exceeded: 0 of 2 burst tokens, 1 of 3 daily units left for a cost of 2.
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["daily", "burst"])
    );
    assert!(body["retry_after"].as_u64().unwrap() >= 1);

    let store = Switch::new();
    store.set(DOWN);
    let app = hello().layer(
        RateLimitLayer::new(store)
            .policy(Policy::gcra("api", Rate::per_second(1), 1).unwrap())
            .on_store_error(FailureMode::FailClosed),
    );
    let unavailable = app.oneshot(request("/", 1)).await.unwrap();
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = serde_json::from_str(&body_text(unavailable).await).unwrap();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );
}

// An in-flight policy counts requests, not costs (a request takes one slot): with a
// slot free it is not violated by a request that costs more than one unit
// (draft-11's `violated-policies`: the policies the request exceeded).
#[tokio::test]
async fn a_free_in_flight_slot_is_no_violated_policy_whatever_the_cost() {
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::token_bucket("api", 10, Rate::per_hour(1)).unwrap())
            .policy(Policy::concurrency("inflight", 2).unwrap())
            .cost(cost_header()),
    );
    for _ in 0..2 {
        let admitted = app.clone().oneshot(request("/", 5)).await.unwrap();
        assert_eq!(admitted.status(), 200);
        body_text(admitted).await;
    }
    let denied = app.clone().oneshot(request("/", 5)).await.unwrap();
    assert_eq!(denied.status(), 429);
    let body: serde_json::Value = serde_json::from_str(&body_text(denied).await).unwrap();
    assert_eq!(body["violated-policies"], serde_json::json!(["api"]));
}

/// The members of an RFC 9651 list of items: (string value, parameters).
fn parse_list(value: &str) -> Vec<(String, Vec<(String, sfv::BareItem)>)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|error| panic!("{value:?} is not an RFC 9651 list: {error}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => (
                item.bare_item
                    .as_string()
                    .expect("a policy name is a string")
                    .as_str()
                    .to_owned(),
                item.params
                    .into_iter()
                    .map(|(key, value)| (key.as_str().to_owned(), value))
                    .collect(),
            ),
            sfv::ListEntry::InnerList(_) => panic!("{value:?}: an inner list"),
        })
        .collect()
}

fn integer(params: &[(String, sfv::BareItem)], name: &str) -> i64 {
    let (_, value) = params
        .iter()
        .find(|(key, _)| key == name)
        .unwrap_or_else(|| panic!("no {name} in {params:?}"));
    i64::from(value.as_integer().expect("an integer"))
}

// Item 11: every header the layer emits parses with an independent RFC 9651 parser, for
// every algorithm and every style, including the largest limits a policy accepts, an
// in-flight limit (no `w` nor `t`: draft-11, sections 3.1 and 4.1, make both optional)
// and quota units (`qu`, a String: section 3.1.4; the vendor `tollgate-qu` too).
#[tokio::test]
async fn every_emitted_header_is_rfc_9651() {
    let huge = [
        tollgate::policy::MAX_LIMIT,
        (1 << 53) - 1,
        999_999_999_999_999,
    ];
    let mut policies = every_algorithm();
    for limit in huge {
        let candidates = [
            Policy::token_bucket("big-tb", limit, Rate::per_second(1)),
            Policy::fixed_window("big-fw", limit, Duration::from_secs(1)),
            Policy::gcra("big-gc", Rate::per_second(limit), limit),
        ];
        policies.extend(candidates.into_iter().filter_map(Result::ok));
    }
    let rated = Policy::token_bucket("units", 1_000, Rate::per_second(100)).unwrap();
    policies.extend([
        Policy::concurrency("cc", 3).unwrap(),
        rated.with_unit(tollgate::policy::QuotaUnit::ContentBytes),
        rated.with_unit(tollgate::policy::QuotaUnit::GraphqlPoints),
    ]);
    let string = |params: &[(String, sfv::BareItem)], name: &str| {
        params
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_string().expect("a string").as_str().to_owned())
    };
    for policy in policies {
        let in_flight = policy.name() == "cc";
        for style in [
            HeaderStyle::Draft11,
            HeaderStyle::Draft6,
            HeaderStyle::Legacy,
        ] {
            let name = policy.name().to_owned();
            let app = hello().layer(
                RateLimitLayer::new(MemoryStore::new())
                    .policy(policy.clone())
                    .headers(style)
                    .cost(cost_header()),
            );
            for cost in [1, 7, 1, 1_000_000_000_000_000, 3] {
                let response = app.clone().oneshot(request("/", cost)).await.unwrap();
                for (field, value) in response.headers() {
                    let value = value.to_str().unwrap();
                    match field.as_str() {
                        "ratelimit-policy" => {
                            for (member, params) in parse_list(value) {
                                assert_eq!(member, name);
                                assert_eq!(integer(&params, "q") as u64, policy.limit());
                                if in_flight {
                                    assert!(params.iter().all(|(key, _)| key != "w"), "{value}");
                                    assert_eq!(
                                        string(&params, "qu").as_deref(),
                                        Some("concurrent-requests")
                                    );
                                } else {
                                    assert!(integer(&params, "w") >= 1);
                                }
                                match policy.unit() {
                                    tollgate::policy::QuotaUnit::ContentBytes => assert_eq!(
                                        string(&params, "qu").as_deref(),
                                        Some("content-bytes")
                                    ),
                                    tollgate::policy::QuotaUnit::GraphqlPoints => assert_eq!(
                                        string(&params, "tollgate-qu").as_deref(),
                                        Some("graphql-points")
                                    ),
                                    _ => {}
                                }
                            }
                        }
                        "ratelimit" => {
                            for (member, params) in parse_list(value) {
                                assert_eq!(member, name);
                                assert!(integer(&params, "r") as u64 <= policy.limit());
                                if in_flight {
                                    assert!(params.iter().all(|(key, _)| key != "t"), "{value}");
                                } else {
                                    assert!(integer(&params, "t") >= 0);
                                }
                            }
                        }
                        "ratelimit-limit"
                        | "ratelimit-remaining"
                        | "ratelimit-reset"
                        | "x-ratelimit-limit"
                        | "x-ratelimit-remaining"
                        | "x-ratelimit-reset"
                        | "retry-after" => {
                            let item: sfv::Item =
                                sfv::Parser::new(value).parse().unwrap_or_else(|error| {
                                    panic!("{name} {field}: {value:?} is not RFC 9651: {error}")
                                });
                            assert!(item.bare_item.as_integer().is_some(), "{field}: {value}");
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

// Item 2: everyday quotas are decided on Redis, exactly; a policy Redis cannot decide is
// refused when the layer is built, never on every request.
#[cfg(feature = "redis")]
#[tokio::test]
async fn everyday_quotas_are_decided_on_redis() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let day = Duration::from_secs(86_400);
    let policies = PolicySet::new([
        Policy::fixed_window("daily", 200_000, day).unwrap(),
        Policy::fixed_window("monthly", 5_000, 30 * day).unwrap(),
        Policy::sliding_window("rolling", 150_000, day).unwrap(),
        Policy::sliding_log("log", 150_000, day).unwrap(),
        Policy::token_bucket("burst", 10, Rate::per_second(5)).unwrap(),
    ])
    .unwrap();
    let key = Key::new("user:1");
    for spent in 1..=3u64 {
        let decision = store.decide(&key, &policies, 1).await.unwrap();
        assert!(decision.is_allowed());
        let remaining: Vec<u64> = decision.statuses().iter().map(|s| s.remaining).collect();
        assert_eq!(
            remaining,
            [
                200_000 - spent,
                5_000 - spent,
                150_000 - spent,
                150_000 - spent,
                10 - spent
            ]
        );
    }
    // A weighted request in big windows: exact, not a double's guess.
    let windows = PolicySet::new(policies.iter().take(4).cloned()).unwrap();
    let decision = store
        .decide(&Key::new("user:2"), &windows, 4_999)
        .await
        .unwrap();
    let remaining: Vec<u64> = decision.statuses().iter().map(|s| s.remaining).collect();
    assert_eq!(remaining, [195_001, 1, 145_001, 145_001]);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_policy_redis_cannot_decide_is_refused_when_the_layer_is_built() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    // A billion tokens refilled once a day: the level passes what Lua counts exactly.
    let layer = RateLimitLayer::new(store)
        .policy(Policy::token_bucket("huge", 1_000_000_000, Rate::per_day(1)).unwrap())
        .policy(Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap());
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tower::Layer::layer(&layer, hello())
    }));
    let message = *built
        .expect_err("the layer must refuse the policy when it is built")
        .downcast::<String>()
        .unwrap();
    assert!(message.contains("\"huge\""), "{message}");
}

// Item 6: fixed windows start at the same instants in every store (the Unix epoch), on
// real time: a day-long quota resets at the same moment in process and on Redis.
#[cfg(feature = "redis")]
#[tokio::test]
async fn windows_align_to_the_epoch_in_every_store() {
    use std::time::{SystemTime, UNIX_EPOCH};
    let server = support::RedisServer::start();
    let redis = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let memory = MemoryStore::new();
    let fallback = tollgate::LocalFallback::new();
    for window in [Duration::from_secs(3_600), Duration::from_secs(86_400)] {
        let policies = PolicySet::from(Policy::fixed_window("w", 10, window).unwrap());
        let key = Key::new("aligned");
        let on_redis = redis.decide(&key, &policies, 1).await.unwrap().statuses()[0].reset;
        let in_memory = memory.decide(&key, &policies, 1).await.unwrap().statuses()[0].reset;
        let in_fallback = fallback.store().check("aligned", &policies, 1).statuses()[0].reset;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let expected = window - Duration::from_nanos((now.as_nanos() % window.as_nanos()) as u64);
        for (store, reset) in [
            ("redis", on_redis),
            ("memory", in_memory),
            ("fallback", in_fallback),
        ] {
            assert!(
                reset.abs_diff(expected) < Duration::from_secs(2),
                "{store}: the {window:?} window ends in {reset:?}, the epoch-aligned one in {expected:?}"
            );
        }
    }
}

// Item 7: hostile costs on Redis never fail the script and never leave a key without a
// TTL; a cost that can never fit is answered as such by every algorithm.
#[cfg(feature = "redis")]
#[tokio::test]
async fn hostile_costs_on_redis_leave_every_key_with_a_ttl() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let costs = [
        0,
        1,
        2,
        5,
        10,
        11,
        1 << 40,
        (1 << 53) - 1,
        1 << 53,
        u64::MAX - 1,
        u64::MAX,
    ];
    for policy in every_algorithm() {
        let limit = policy.limit();
        let single = PolicySet::from(policy.clone());
        let several = PolicySet::new([
            policy.clone(),
            Policy::token_bucket("other", 1_000, Rate::per_second(1)).unwrap(),
        ])
        .unwrap();
        for set in [single, several] {
            for cost in costs {
                let decision = store
                    .decide(&Key::new("hostile"), &set, cost)
                    .await
                    .unwrap_or_else(|error| panic!("{policy:?} cost {cost}: {error}"));
                if cost > limit {
                    assert!(
                        matches!(decision.outcome(), Outcome::CostExceedsLimit { .. }),
                        "{policy:?} cost {cost}: {:?}",
                        decision.outcome()
                    );
                }
            }
        }
    }
    let keys = support::keys_with_ttl(&server);
    assert!(!keys.is_empty());
    for (key, ttl) in keys {
        // -1 is a key without a TTL; -2 one that expired between the scan and its PTTL
        // (a bucket's key lives a second or two: a slow machine may see it go).
        assert!(ttl > 0 || ttl == -2, "{key} has no TTL ({ttl})");
    }
}

/// Creates the ACL user `name` (password `s3cret`) limited to the default prefix, with
/// `calls` (how it may run the Lua) and the data commands the scripts call: the README's
/// least-privilege line when `calls` holds all five. Returns the server's answer.
#[cfg(feature = "redis")]
fn acl_user(server: &support::RedisServer, name: &str, calls: &[&str]) -> String {
    const DATA: [&str; 14] = [
        "+time",
        "+get",
        "+set",
        "+hmget",
        "+hset",
        "+pexpire",
        "+zadd",
        "+zrange",
        "+zrangebyscore",
        "+zremrangebyscore",
        "+pttl",
        "+zcard",
        "+zrem",
        "+del",
    ];
    let mut args = vec![
        "ACL",
        "SETUSER",
        name,
        "on",
        ">s3cret",
        "resetkeys",
        "~tollgate:*",
        "resetchannels",
        "-@all",
    ];
    args.extend_from_slice(calls);
    args.extend_from_slice(&DATA);
    server.cli(&args)
}

// Item 2, third part: a server that refuses the scripts fails at start, naming what was
// refused; the least-privilege ACL line of the README is enough.
#[cfg(feature = "redis")]
#[tokio::test]
async fn connect_checks_the_scripts_run_and_names_what_was_refused() {
    let server = support::RedisServer::start();
    let port = server.port;
    // The README's least-privilege line, for the default prefix.
    let granted = acl_user(
        &server,
        "limiter",
        &[
            "+fcall",
            "+function|load",
            "+evalsha",
            "+eval",
            "+script|load",
        ],
    );
    assert!(granted.contains("OK"), "{granted}");
    let url = format!("redis://limiter:s3cret@127.0.0.1:{port}");
    let store = tollgate::store::RedisStore::connect(&url)
        .await
        .expect("the least-privilege user runs every script");
    let set = PolicySet::new(every_algorithm()).unwrap();
    assert!(
        store
            .decide(&Key::new("u"), &set, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    // Each algorithm alone (its own function), at one unit and at several (a sliding log
    // of several units keeps a counter), then a settle and a grant: every command any of
    // them runs is in the line.
    for policy in every_algorithm() {
        let alone = PolicySet::from(policy);
        for cost in [1, 3] {
            let decision = store.decide(&Key::new("v"), &alone, cost).await.unwrap();
            let settle = tollgate::Adjustment::settle(cost, 1, decision.receipt());
            store.adjust(&Key::new("v"), &alone, &settle).await.unwrap();
        }
        let grant = tollgate::Adjustment::grant(2);
        store.adjust(&Key::new("v"), &alone, &grant).await.unwrap();
    }
    // With FUNCTION LOAD and FCALL granted, decisions are Functions calls.
    assert!(support::command_calls(&server, "fcall") > 0);
    // The start-up check asked the server how its Lua formats 2^53 (the scripts write
    // times with `%d`, which a 32-bit build gets wrong): the only EVAL of a store whose
    // decisions are Functions calls.
    assert_eq!(support::command_calls(&server, "eval"), 1);

    // A user that may run scripts but not touch the store's keys.
    let denied = server.cli(&[
        "ACL",
        "SETUSER",
        "stranger",
        "on",
        ">s3cret",
        "resetkeys",
        "~other:*",
        "-@all",
        "+evalsha",
        "+eval",
        "+script|load",
        "+time",
        "+hmget",
        "+hset",
        "+pexpire",
    ]);
    assert!(denied.contains("OK"), "{denied}");
    let url = format!("redis://stranger:s3cret@127.0.0.1:{port}");
    let error = tollgate::store::RedisStore::connect(&url)
        .await
        .expect_err("a user that may not touch the keys fails at start");
    assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
    let text = error.to_string().to_lowercase();
    assert!(
        text.contains("noperm") && text.contains("no permissions"),
        "{error}"
    );
    assert!(
        !error.to_string().contains("s3cret"),
        "the password leaked: {error}"
    );
}

// An ACL for Functions only (no EVAL, EVALSHA or SCRIPT LOAD): the start-up check of the
// integer format cannot run its EVAL, and leaves it to the library's own check; the store
// starts and decides.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_functions_only_user_starts_without_the_eval_check() {
    let server = support::RedisServer::start();
    let granted = acl_user(&server, "functions", &["+fcall", "+function|load"]);
    assert!(granted.contains("OK"), "{granted}");
    let url = format!("redis://functions:s3cret@127.0.0.1:{}", server.port);
    let store = tollgate::store::RedisStore::connect(&url)
        .await
        .expect("a user with Functions only starts");
    for policy in every_algorithm() {
        let alone = PolicySet::from(policy);
        assert!(
            store
                .decide(&Key::new("w"), &alone, 1)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    assert_eq!(support::command_calls(&server, "eval"), 0);
    assert!(support::command_calls(&server, "fcall") > 0);
}

// A user who may call the library's functions and nothing else (an administrator loads
// the library): the server lost it (a restart), and the load this user's store tried was
// refused. The store went to scripts for a minute, which this user may not run either:
// once the administrator had loaded the library again, every decision was still refused
// (`NOPERM ... 'evalsha'`) until the minute was out.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_refused_load_leaves_a_user_without_scripts_on_functions() {
    let server = support::RedisServer::start();
    let admin = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(600)).unwrap());
    assert!(
        admin
            .decide(&Key::new("a"), &policies, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    let granted = acl_user(&server, "caller", &["+fcall"]);
    assert!(granted.contains("OK"), "{granted}");
    let url = format!("redis://caller:s3cret@127.0.0.1:{}", server.port);
    let store = tollgate::store::RedisStore::connect(&url)
        .await
        .expect("a user who may call the functions starts");
    let loads_before = support::command_sent(&server, "function|load");
    assert_eq!(server.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
    // Requests that meet the loss together: refused, with the load sent once before the
    // store knows this user may run no scripts and once after, not once each.
    let together =
        futures_util::future::join_all((0..16).map(|_| store.decide(&Key::new("u"), &policies, 1)))
            .await;
    assert!(
        together.iter().all(Result::is_err),
        "the library is gone and this user may not load it"
    );
    let loads = support::command_sent(&server, "function|load");
    assert!(
        (1..=2).contains(&(loads - loads_before)),
        "{} loads sent",
        loads - loads_before
    );
    // Refused again at once, without a load per call, and without a script.
    let scripts = support::command_sent(&server, "evalsha");
    let refused = store.decide(&Key::new("u"), &policies, 1).await;
    assert!(refused.is_err());
    assert_eq!(support::command_sent(&server, "function|load"), loads);
    // The administrator's store loads it again.
    assert!(
        admin
            .decide(&Key::new("a"), &policies, 1)
            .await
            .unwrap()
            .is_allowed()
    );
    let decided = store
        .decide(&Key::new("u"), &policies, 1)
        .await
        .unwrap_or_else(|error| panic!("the library is back: {error}"));
    assert_eq!(decided.statuses()[0].remaining, 9);
    assert_eq!(support::command_sent(&server, "evalsha"), scripts);
}

// On a Cluster every primary loads its own scripts and may have its own ACL: the start-up
// check must reach all of them, not only the one that owns its probe key's slot.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_cluster_checks_every_primary() {
    let cluster = support::RedisCluster::start(3);
    // The primary that the old single probe key hashes to stays open; another refuses
    // scripts to the default user.
    let slot: u16 = cluster.nodes[0]
        .cli(&["CLUSTER", "KEYSLOT", "{tollgate-start-up-check}"])
        .trim()
        .parse()
        .unwrap();
    // CLUSTER NODES: the slot ranges of a node are its fields from the ninth on.
    let owns = |node: &support::RedisServer| {
        node.cli(&["CLUSTER", "NODES"])
            .lines()
            .find(|line| line.contains("myself"))
            .is_some_and(|line| {
                line.split_whitespace().skip(8).any(|range| {
                    let mut ends = range.split('-');
                    let first: u16 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(1);
                    let last: u16 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(first);
                    (first..=last).contains(&slot)
                })
            })
    };
    let strict = cluster
        .nodes
        .iter()
        .find(|node| !owns(node))
        .expect("three primaries: two do not own that slot");
    let refused = strict.cli(&["ACL", "SETUSER", "default", "-evalsha", "-eval", "-fcall"]);
    assert!(refused.contains("OK"), "{refused}");
    let error = tollgate::store::RedisStore::connect_cluster(&cluster.urls())
        .await
        .expect_err("one primary refuses the scripts: the store must not start");
    assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
    assert!(
        error.to_string().to_lowercase().contains("noperm"),
        "{error}"
    );
    // With every primary open again it starts.
    let reopened = strict.cli(&["ACL", "SETUSER", "default", "+@all"]);
    assert!(reopened.contains("OK"), "{reopened}");
    tollgate::store::RedisStore::connect_cluster(&cluster.urls())
        .await
        .expect("every primary runs the scripts");
}

// A single server's URL that names one node of a Cluster (a managed Cluster's endpoint
// given as REDIS_URL) reaches only that node's slots: every other identity is answered
// MOVED. That was sorted as an outage, so the local fallback answered most identities for
// good (each replica its own limit: the limit silently not shared) while the breaker
// flapped. The start-up check refuses it, and a store built without it (a pool of one
// node) is told a refusal, logged loudly, never an outage to wait out.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_behind_a_single_servers_url_is_refused() {
    let cluster = support::RedisCluster::start(3);
    let url = &cluster.urls()[0];
    let error = tollgate::store::RedisStore::connect(url)
        .await
        .expect_err("a Cluster node behind a single server's URL must not start");
    assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
    assert!(error.to_string().contains("Cluster"), "{error}");
    // A pool of the one node, as `from_pool` takes it, without the start-up check.
    let pool = deadpool_redis::Config::from_url(url.clone())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let store = tollgate::store::RedisStore::from_pool(pool);
    let policies =
        PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap());
    let mut redirected = 0;
    for n in 0..30 {
        let key = tollgate::Key::new(format!("user:{n}"));
        match tollgate::Store::decide(&store, &key, &policies, 1).await {
            Ok(_) => {}
            Err(error) => {
                redirected += 1;
                assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
                assert!(error.to_string().contains("Cluster"), "{error}");
            }
        }
    }
    // Three primaries: about two identities in three live on another node.
    assert!(redirected > 0, "no identity of 30 lived on another node");
    // A Cluster of one primary owning every slot (a one-shard managed Cluster, an
    // emulated Cluster mode) answers every identity: it starts as a single server.
    let alone = support::RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let added = alone.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
    assert!(added.contains("OK"), "{added}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !alone.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
        assert!(
            std::time::Instant::now() < deadline,
            "the one-node Cluster is not ok"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let whole = tollgate::store::RedisStore::connect(&alone.url())
        .await
        .expect("one primary owning every slot decides every identity");
    for n in 0..30 {
        let key = tollgate::Key::new(format!("user:{n}"));
        let decided = tollgate::Store::decide(&whole, &key, &policies, 1).await;
        assert!(decided.is_ok_and(|d| d.is_allowed()), "user:{n}");
    }
}

// The effective window of each algorithm, on a manual clock (the table in the README).
#[test]
fn the_effective_window_of_each_algorithm() {
    use tollgate::clock::ManualClock;
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let t = |policy: Policy, spend: &[(u64, u64)], at: u64| {
        let key = format!("{policy:?}");
        let set = PolicySet::from(policy);
        for &(when, cost) in spend {
            clock.set(Duration::from_millis(when));
            assert!(store.check(&key, &set, cost).is_allowed());
        }
        clock.set(Duration::from_millis(at));
        store.check(&key, &set, 0).statuses()[0].effective_window
    };
    let minute = Duration::from_secs(60);
    // Fixed window: until it ends.
    assert_eq!(
        t(
            Policy::fixed_window("fw", 10, minute).unwrap(),
            &[(1_000, 3)],
            15_000
        ),
        Duration::from_secs(45)
    );
    // Sliding log: until the oldest counted entry leaves.
    assert_eq!(
        t(
            Policy::sliding_log("sl", 10, minute).unwrap(),
            &[(61_000, 2), (71_000, 1)],
            81_000
        ),
        Duration::from_secs(40)
    );
    // Token bucket and GCRA: until the next unit, not until full.
    let bucket = t(
        Policy::token_bucket("tb", 10, Rate::per_second(5)).unwrap(),
        &[(200_000, 10)],
        200_000,
    );
    assert_eq!(bucket, Duration::from_millis(200));
    let gcra = t(
        Policy::gcra("gc", Rate::per_second(5), 10).unwrap(),
        &[(300_000, 10)],
        300_050,
    );
    assert_eq!(gcra, Duration::from_millis(150));
    // Shaping: until one more unit could queue after the remaining ones did.
    let shaping = t(
        Policy::leaky_bucket_shaping("ls", Rate::per_second(5), Duration::from_secs(1)).unwrap(),
        &[(400_000, 1)],
        400_000,
    );
    assert_eq!(shaping, Duration::from_millis(200));
    // Sliding counter: 10 spent in the previous minute; 30 s in, the estimate is 5 and
    // one more unit frees up 6 s later (when ceil(10 * (60 - e) / 60) drops to 9... of the
    // 5 remaining spent now).
    let counter = t(
        Policy::sliding_window("sw", 10, minute).unwrap(),
        &[(540_000, 10)],
        630_000,
    );
    assert!(
        counter > Duration::ZERO && counter <= Duration::from_secs(30),
        "{counter:?}"
    );
}

// qu for quotas that are not requests; pk only as a hash; jitter only on long windows.
#[tokio::test]
async fn quota_units_partition_keys_and_jitter() {
    use tollgate::policy::QuotaUnit;
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(
                Policy::token_bucket("upload", 1_000_000, Rate::per_second(100_000))
                    .unwrap()
                    .with_unit(QuotaUnit::ContentBytes),
            )
            .policy(
                Policy::token_bucket("points", 1_000, Rate::per_minute(1_000))
                    .unwrap()
                    .with_unit(QuotaUnit::GraphqlPoints),
            )
            .partition_key(true),
    );
    let response = app.clone().oneshot(request("/", 1)).await.unwrap();
    let policy = parse_list(&header(&response, "ratelimit-policy").unwrap());
    let param = |params: &[(String, sfv::BareItem)], name: &str| {
        params
            .iter()
            .find(|(key, _)| key == name)
            .and_then(|(_, value)| value.as_string().map(|s| s.as_str().to_owned()))
    };
    assert_eq!(param(&policy[0].1, "qu").as_deref(), Some("content-bytes"));
    assert_eq!(
        param(&policy[1].1, "tollgate-qu").as_deref(),
        Some("graphql-points")
    );
    let rate = parse_list(&header(&response, "ratelimit").unwrap());
    let pk = |members: &[(String, Vec<(String, sfv::BareItem)>)]| {
        members[0]
            .1
            .iter()
            .find(|(key, _)| key == "pk")
            .and_then(|(_, value)| value.as_byte_sequence().map(<[u8]>::to_vec))
            .expect("a pk byte sequence")
    };
    let mine = pk(&rate);
    assert_eq!(mine.len(), 12);
    assert!(
        !header(&response, "ratelimit")
            .unwrap()
            .contains("203.0.113.7")
    );
    let mut other = request("/", 1);
    other
        .extensions_mut()
        .insert(std::net::SocketAddr::from(([198, 51, 100, 1], 1)));
    let theirs = pk(&parse_list(
        &header(&app.clone().oneshot(other).await.unwrap(), "ratelimit").unwrap(),
    ));
    assert_ne!(mine, theirs, "two identities, two partition keys");
    // A keyed hash: not the plain SHA-256 of the identity, which anyone could reverse for
    // an IPv4 address by hashing all 2^32 of them.
    {
        use sha2::{Digest, Sha256};
        for plain in ["ip:203.0.113.7", "203.0.113.7"] {
            assert_ne!(
                mine,
                Sha256::digest(plain.as_bytes())[..12].to_vec(),
                "{plain}"
            );
        }
    }
    // Stable for one identity; the same across replicas that share a secret, different
    // under another secret.
    let again = pk(&parse_list(
        &header(
            &app.clone().oneshot(request("/", 1)).await.unwrap(),
            "ratelimit",
        )
        .unwrap(),
    ));
    assert_eq!(mine, again);
    let replica = |secret: &'static str| {
        hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::gcra("api", Rate::per_second(5), 5).unwrap())
                .partition_key_secret(secret)
                // Turning pk on again keeps the fleet's secret.
                .partition_key(true),
        )
    };
    let mut keys = Vec::new();
    for secret in [
        "fleet secret, first",
        "fleet secret, first",
        "fleet secret, other",
    ] {
        let response = replica(secret).oneshot(request("/", 1)).await.unwrap();
        keys.push(pk(&parse_list(&header(&response, "ratelimit").unwrap())));
    }
    assert_eq!(keys[0], keys[1], "one secret, one pk");
    assert_ne!(keys[0], keys[2], "another secret, another pk");
    let short = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::gcra("api", Rate::per_second(5), 5).unwrap())
        .partition_key_secret("dev");
    let refused = short.validate().unwrap_err();
    assert!(refused.contains("at least 16"), "{refused}");
    assert!(
        !refused.contains("dev"),
        "the secret is never shown: {refused}"
    );

    // Jitter: a daily quota's t and Retry-After spread over up to 30 s more, never less,
    // at the window's start and in its last minute (a manual clock says which).
    for left in [86_400, 20] {
        let clock = tollgate::clock::ManualClock::new();
        clock.advance(Duration::from_secs(86_400 - left));
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::builder().clock(clock).build())
                .policy(Policy::fixed_window("daily", 1, Duration::from_secs(86_400)).unwrap())
                .header_jitter(Duration::from_secs(30)),
        );
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..40 {
            let response = app.clone().oneshot(request("/", 1)).await.unwrap();
            let rate = parse_list(&header(&response, "ratelimit").unwrap());
            let t = integer(&rate[0].1, "t") as u64;
            assert!(t >= left && t <= left + 30, "t={t}, window ends in {left}");
            if let Some(retry) = header(&response, "retry-after") {
                assert!(retry.parse::<u64>().unwrap() >= t);
            }
            seen.insert(t);
        }
        assert!(
            seen.len() > 1,
            "{left} s left: jitter never varied: {seen:?}"
        );
    }
}

// A refusal (not I/O) that one request's data causes must not open the breaker for every
// identity: each such request gets the failure mode, the store keeps being asked.
#[tokio::test]
async fn refusals_do_not_open_the_breaker() {
    let store = Switch::new();
    store.set(REFUSING);
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .circuit_breaker(CircuitBreaker::new(2, Duration::from_secs(3600))),
    );
    for _ in 0..10 {
        assert_eq!(
            app.clone().oneshot(request("/", 1)).await.unwrap().status(),
            200
        );
    }
    assert_eq!(store.calls(), 10, "every request still asked the store");
}

// A refusal of one request's own (WRONGTYPE on its key) says nothing of an outage, either
// way: it neither opens the breaker nor ends an outage. Counted as the store answering, it
// reset the failures in a row, so a store failing every other request (timeouts between
// refusals) never had its breaker open, and it said "answers again" mid-outage.
#[tokio::test]
async fn a_refusal_between_failures_does_not_keep_the_breaker_closed() {
    let store = Switch::new();
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .on_store_error(FailureMode::FailOpen)
            .circuit_breaker(CircuitBreaker::new(2, Duration::from_secs(3600))),
    );
    for mode in [DOWN, REFUSING, DOWN, REFUSING, DOWN, REFUSING, DOWN] {
        store.set(mode);
        app.clone().oneshot(request("/", 1)).await.unwrap();
    }
    assert_eq!(
        store.calls(),
        3,
        "two failures in a row, a refusal between them, opened the breaker"
    );
}

// A failure every request meets opens the breaker whatever its kind: the Sentinel client
// says "no sentinel knows that primary" as `Other`, with `every_request` set so that the
// breaker holds requests off. The layer opened it only for a refusal or a protocol error,
// so every request looked the primary up again, and the outage was never said. (The
// `Limiter` already honoured `every_request` of any kind.)
#[tokio::test]
async fn a_failure_every_request_meets_opens_the_breaker_whatever_its_kind() {
    let store = Switch::new();
    store.set(NO_PRIMARY);
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .on_store_error(FailureMode::FailOpen)
            .circuit_breaker(CircuitBreaker::new(2, Duration::from_secs(3600))),
    );
    for _ in 0..6 {
        let response = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(store.calls(), 2, "two failures opened the breaker");
}

// An error raised before the store was asked (a policy the store cannot decide, refused
// without I/O) says nothing of the store: when the breaker's probe gets one, the breaker
// must stay open, not send every request back to a store that is still down.
#[tokio::test]
async fn an_error_raised_without_asking_the_store_never_closes_the_breaker() {
    let store = Switch::new();
    let clock = tollgate::clock::ManualClock::new();
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
            .on_store_error(FailureMode::FailOpen)
            .circuit_breaker(
                CircuitBreaker::new(3, Duration::from_secs(1)).with_clock(clock.clone()),
            ),
    );
    store.set(DOWN);
    for _ in 0..3 {
        app.clone().oneshot(request("/", 1)).await.unwrap();
    }
    assert_eq!(store.calls(), 3);
    app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(store.calls(), 3, "three failures opened the breaker");
    clock.advance(Duration::from_secs(1));
    // The cool-down is over: the probe's request gets an error the store never saw.
    store.set(UNSUPPORTED);
    app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(store.calls(), 4, "that request was the probe");
    // The store is still down: of the next requests, one probes again (the last probe
    // tested nothing) and fails; the rest skip the store.
    store.set(DOWN);
    for _ in 0..5 {
        app.clone().oneshot(request("/", 1)).await.unwrap();
    }
    assert_eq!(
        store.calls() - 4,
        1,
        "the unasked store's error closed the breaker: every request went back to it"
    );
}

/// A store that cannot decide the request's policies (`Unsupported`: a policy the Redis
/// store refuses, an in-flight set over a store that cannot adjust) is a set-up error,
/// not an outage. Fail-closed refuses the request as the server's fault (`500`, RFC 9110
/// section 15.6.1), with no `Retry-After`: a `503` saying "the store is unavailable" and
/// "retry in 1 s" was false, and brought every client (and gRPC's retries, told by the
/// pushback) back each second for ever. A gRPC call gets INTERNAL, with no pushback.
#[tokio::test]
async fn a_store_that_cannot_decide_the_policies_is_no_outage_to_retry() {
    let store = Switch::new();
    store.set(UNSUPPORTED);
    let app = hello().layer(
        RateLimitLayer::new(store.clone())
            .policy(Policy::token_bucket("api", 10, Rate::per_second(10)).unwrap())
            .on_store_error(FailureMode::FailClosed),
    );
    let response = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(header(&response, "retry-after"), None);
    assert_eq!(
        header(&response, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let body = body_text(response).await;
    assert!(!body.contains("unavailable"), "{body}");
    assert!(body.contains("\"status\":500"), "{body}");

    let call = Request::post("/")
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(call).await.unwrap();
    assert_eq!(header(&response, "grpc-status").as_deref(), Some("13"));
    assert_eq!(header(&response, "grpc-retry-pushback-ms"), None);

    // An outage is still one: a 503 saying when to come back.
    store.set(DOWN);
    let response = app.oneshot(request("/", 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(header(&response, "retry-after").is_some());
}

/// The single-valued reset of `response` in seconds from now: draft-6's as it is, the
/// legacy one (a Unix time) less the time now.
fn reset_from_now<B>(response: &Response<B>, style: HeaderStyle) -> u64 {
    let name = match style {
        HeaderStyle::Legacy => "x-ratelimit-reset",
        _ => "ratelimit-reset",
    };
    let reset: u64 = header(response, name).unwrap().parse().unwrap();
    if style == HeaderStyle::Legacy {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        reset.saturating_sub(now)
    } else {
        reset
    }
}

// The single-valued styles (draft-6 `RateLimit-Reset`, GitHub's `X-RateLimit-Reset`)
// report one quota and when it resets. An in-flight count never resets on a clock: while
// a rate policy is shown beside it, the fields report the rate policy; when the in-flight
// policy denies, its reset is no earlier than `Retry-After` (which is 1 s), not "now".
#[tokio::test]
async fn single_valued_headers_report_a_quota_that_resets_and_never_before_retry_after() {
    for style in [HeaderStyle::Draft6, HeaderStyle::Legacy] {
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::token_bucket("api", 100, Rate::per_minute(100)).unwrap())
                .policy(Policy::concurrency("inflight", 1).unwrap())
                .headers(style),
        );
        let (limit, remaining) = match style {
            HeaderStyle::Draft6 => ("ratelimit-limit", "ratelimit-remaining"),
            _ => ("x-ratelimit-limit", "x-ratelimit-remaining"),
        };
        // Its body unread, the first response holds the only in-flight slot.
        let held = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(held.status(), 200);
        assert_eq!(
            (
                header(&held, limit).as_deref(),
                header(&held, remaining).as_deref()
            ),
            (Some("100"), Some("99")),
            "{style:?}: the fields report the rate policy, not the in-flight count"
        );
        let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(denied.status(), 429);
        let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
        assert_eq!(retry, 1);
        assert_eq!(header(&denied, limit).as_deref(), Some("1"));
        assert_eq!(header(&denied, remaining).as_deref(), Some("0"));
        let from_now = reset_from_now(&denied, style);
        assert!(
            from_now >= retry,
            "{style:?}: the quota resets in {from_now} s, but Retry-After says {retry} s"
        );
        drop(held);
    }
}

// An in-flight limit alone: its count has no reset, and "0 left, resets now" sent a client
// that waits for the reset straight into a 429. The reset field is left out of an
// admitted response; a denial's is its `Retry-After`, as above.
#[tokio::test]
async fn an_in_flight_limit_alone_sends_no_reset_it_does_not_have() {
    for style in [HeaderStyle::Draft6, HeaderStyle::Legacy] {
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::concurrency("inflight", 1).unwrap())
                .headers(style),
        );
        let (remaining, reset) = match style {
            HeaderStyle::Draft6 => ("ratelimit-remaining", "ratelimit-reset"),
            _ => ("x-ratelimit-remaining", "x-ratelimit-reset"),
        };
        let held = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(held.status(), 200);
        assert_eq!(header(&held, remaining).as_deref(), Some("0"), "{style:?}");
        assert_eq!(header(&held, reset), None, "{style:?}");
        let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(denied.status(), 429);
        let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
        let from_now = reset_from_now(&denied, style);
        assert!(
            from_now >= retry,
            "{style:?}: {from_now} s before {retry} s"
        );
        drop(held);
    }
}

// The legacy `X-RateLimit-Reset` is when the quota is whole again (GitHub's reading: a
// client sleeps until then and comes back with the whole quota). A denial the deny cache
// answers has no state to read it from: it said the denial's own wait (1 s) where the
// store's denial a moment before said 100 s, so such a client came back 99 s early, into
// 429s. It is now at most the policy's window, never before the wait.
#[tokio::test]
async fn a_cached_denial_never_states_a_legacy_reset_earlier_than_the_store_did() {
    let app = hello().layer(
        RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000))
            .policy(Policy::token_bucket("api", 100, Rate::per_second(1)).unwrap())
            .cost(cost_header())
            .headers(HeaderStyle::Legacy),
    );
    assert_eq!(status_of(&app, 100).await, StatusCode::OK);
    let from_store = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(from_store.status(), 429);
    let stated = reset_from_now(&from_store, HeaderStyle::Legacy);
    assert!(stated >= 99, "the store's denial: {stated} s");
    let cached = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(cached.status(), 429);
    assert_eq!(header(&cached, "retry-after").as_deref(), Some("1"));
    let from_cache = reset_from_now(&cached, HeaderStyle::Legacy);
    assert!(
        from_cache + 1 >= stated,
        "the cached denial: whole again in {from_cache} s, the store said {stated} s"
    );
}

// The same with units owed: a settle charged past empty, the store's denial says the
// bucket is whole once they are paid and it has filled (150 s); a cached denial said the
// fill time alone (100 s).
#[tokio::test]
async fn a_cached_denial_counts_what_is_owed_in_its_legacy_reset() {
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                let mut response = http::Response::new(Body::from("done"));
                response
                    .headers_mut()
                    .insert("x-used", http::HeaderValue::from_static("150"));
                response
            }),
        )
        .layer(
            RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000))
                .policy(Policy::token_bucket("api", 100, Rate::per_second(1)).unwrap())
                .cost(cost_header())
                .settle(tollgate::settle::Settle::from_header("x-used"))
                .headers(HeaderStyle::Legacy),
        );
    assert_eq!(status_of(&app, 1).await, StatusCode::OK);
    let from_store = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(from_store.status(), 429);
    let stated = reset_from_now(&from_store, HeaderStyle::Legacy);
    assert!(stated >= 149, "the store's denial: {stated} s");
    let cached = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(cached.status(), 429);
    let from_cache = reset_from_now(&cached, HeaderStyle::Legacy);
    assert!(
        from_cache + 1 >= stated,
        "the cached denial: whole again in {from_cache} s, the store said {stated} s"
    );
}

// A hook's answer that is no 429 or 503 keeps the `Retry-After` the hook wrote, whatever
// it says: the layer's replaced a value that states no wait (`soon`) on a 403.
#[tokio::test]
async fn a_hooks_retry_after_on_another_status_is_its_own() {
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
            .on_deny(|_: &tollgate::Rejection<'_>| {
                let mut response = http::Response::new(bytes::Bytes::from_static(b"banned"));
                *response.status_mut() = StatusCode::FORBIDDEN;
                response
                    .headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("soon"));
                response
            }),
    );
    assert_eq!(status_of(&app, 1).await, StatusCode::OK);
    let answered = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(answered.status(), StatusCode::FORBIDDEN);
    assert_eq!(header(&answered, "retry-after").as_deref(), Some("soon"));
}

// `Retry-After` means "come back after" on a 429 or a 503 (RFC 6585 section 4, RFC 9110
// section 10.2.3); an `on_deny` hook that answers otherwise (a 403 for banned clients, a
// 200 with a notice) got ours anyway, telling a client to retry a refusal for good.
#[tokio::test]
async fn a_hooks_answer_that_is_no_429_gets_no_retry_after() {
    for status in [403, 200] {
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
                .on_deny(move |_: &tollgate::Rejection<'_>| {
                    let mut response = http::Response::new(bytes::Bytes::from_static(b"no"));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    response
                }),
        );
        assert_eq!(status_of(&app, 1).await, StatusCode::OK);
        let answered = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(answered.status().as_u16(), status);
        assert_eq!(header(&answered, "retry-after"), None, "{status}");
    }
}

// An `on_deny` hook may set its own `Retry-After` (a longer wait for a penalty): the layer
// keeps it, and the single-valued reset must then not be earlier than it either.
#[tokio::test]
async fn a_hooks_retry_after_is_the_floor_of_the_reset() {
    let denied = denied_by_a_hook_writing(&["600"], Rate::per_second(1)).await;
    assert_eq!(header(&denied, "retry-after").as_deref(), Some("600"));
    let reset: u64 = header(&denied, "ratelimit-reset").unwrap().parse().unwrap();
    assert!(
        reset >= 600,
        "RateLimit-Reset {reset} beside Retry-After 600"
    );
}

/// The `429` of a limiter of one request per `rate` (draft-6 fields) whose `on_deny` hook
/// writes `Retry-After` with `lines`, one field line each.
async fn denied_by_a_hook_writing(lines: &'static [&'static str], rate: Rate) -> Response<Body> {
    let app = hello().layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::token_bucket("api", 1, rate).unwrap())
            .headers(HeaderStyle::Draft6)
            .on_deny(move |_: &tollgate::Rejection<'_>| {
                let mut response = http::Response::builder().status(429);
                for line in lines {
                    response = response.header("retry-after", *line);
                }
                response
                    .body(bytes::Bytes::from_static(b"slow down"))
                    .unwrap()
            }),
    );
    assert_eq!(
        app.clone().oneshot(request("/", 1)).await.unwrap().status(),
        200
    );
    let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(denied.status(), 429);
    denied
}

// RFC 9110, section 10.2.3: `Retry-After` is an HTTP-date or delay-seconds (`1*DIGIT`).
// A hook's value that is neither (a word, a fraction, a sign, nothing) tells clients no
// wait, and the reset beside it would contradict it: the layer's own is sent instead.
#[tokio::test]
async fn a_hooks_retry_after_that_is_no_wait_is_replaced() {
    const WRITTEN: [&[&str]; 7] = [
        &["soon"],
        &["1.5"],
        &["-5"],
        &["+5"],
        &[""],
        &["5 s"],
        &["5, soon"],
    ];
    for written in WRITTEN {
        let denied = denied_by_a_hook_writing(written, Rate::per_minute(1)).await;
        let retry_after = header(&denied, "retry-after");
        let seconds: u64 = retry_after
            .as_deref()
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("hook wrote {written:?}, sent {retry_after:?}"));
        assert!(
            (59..=60).contains(&seconds),
            "hook wrote {written:?}: {seconds}"
        );
        let reset = header(&denied, "ratelimit-reset");
        assert_eq!(reset, retry_after, "hook wrote {written:?}");
    }
}

// `Retry-After` is a singleton field (RFC 9110, section 10.2.3): a hook that wrote it
// twice sent a value no client can read (lines join with commas, `5, soon`). Its first
// line is kept alone when it states a wait, and the reset follows it.
#[tokio::test]
async fn a_hooks_retry_after_written_twice_is_sent_once() {
    for (lines, sent) in [(&["7", "soon"], "7"), (&["7", "9"], "7")] {
        let denied = denied_by_a_hook_writing(lines, Rate::per_minute(1)).await;
        let sent_lines: Vec<_> = denied.headers().get_all("retry-after").iter().collect();
        assert_eq!(sent_lines, [sent], "hook wrote {lines:?}");
        let reset: u64 = header(&denied, "ratelimit-reset").unwrap().parse().unwrap();
        assert!(reset >= 7, "RateLimit-Reset {reset} beside Retry-After 7");
    }
}

// RFC 9110, section 10.2.3: `Retry-After` is an HTTP-date or a number of seconds. A
// hook's date is a wait like its seconds: the single-valued reset is no earlier, and a
// gRPC call is pushed back as long (gRFC A6).
#[tokio::test]
async fn a_hooks_retry_after_as_a_date_is_the_floor_of_the_reset() {
    let app = || {
        hello()
            .route("/call", axum::routing::post(|| async { "called" }))
            .layer(
                RateLimitLayer::new(MemoryStore::new())
                    .policy(Policy::token_bucket("api", 1, Rate::per_second(1)).unwrap())
                    .headers(HeaderStyle::Draft6)
                    .on_deny(|_: &tollgate::Rejection<'_>| {
                        let later = std::time::SystemTime::now() + Duration::from_secs(600);
                        http::Response::builder()
                            .status(429)
                            .header("retry-after", httpdate::fmt_http_date(later))
                            .body(bytes::Bytes::from_static(b"slow down"))
                            .unwrap()
                    }),
            )
    };
    let http = app();
    assert_eq!(
        http.clone()
            .oneshot(request("/", 1))
            .await
            .unwrap()
            .status(),
        200
    );
    let denied = http.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(denied.status(), 429);
    let reset: u64 = header(&denied, "ratelimit-reset").unwrap().parse().unwrap();
    assert!(
        (598..=601).contains(&reset),
        "RateLimit-Reset {reset} beside a Retry-After date 600 s away"
    );
    let grpc = app();
    let call = || grpc_call(&grpc, "/call");
    assert_eq!(call().await.unwrap().status(), 200);
    let denied = call().await.unwrap();
    assert_eq!(header(&denied, "grpc-status").as_deref(), Some("8"));
    let pushback: u64 = header(&denied, "grpc-retry-pushback-ms")
        .expect("a pushback of the hook's wait")
        .parse()
        .unwrap();
    assert!(
        (598_000..=601_000).contains(&pushback),
        "pushed back {pushback} ms beside a Retry-After date 600 s away"
    );
}

/// A gRPC call to `app`'s `path`, from the test's peer.
async fn grpc_call(app: &Router, path: &str) -> Result<Response<Body>, std::convert::Infallible> {
    let mut request = Request::post(path)
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap();
    request
        .extensions_mut()
        .insert(std::net::SocketAddr::from(PEER));
    app.clone().oneshot(request).await
}

/// The answer to a gRPC call denied by a quota of one, written by an `on_deny` hook
/// answering with `hook`'s response (the first call, admitted, has no `grpc-status`).
async fn denied_grpc_call_answered_by(
    hook: impl Fn() -> http::Response<bytes::Bytes> + Send + Sync + 'static,
) -> Response<Body> {
    let app = Router::new()
        .route("/call", axum::routing::post(|| async { "called" }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::fixed_window("api", 1, Duration::from_secs(60)).unwrap())
                .on_deny(move |_: &tollgate::Rejection<'_>| hook()),
        );
    let admitted = grpc_call(&app, "/call").await.unwrap();
    assert_eq!(header(&admitted, "grpc-status"), None);
    grpc_call(&app, "/call").await.unwrap()
}

// A hook that answers a gRPC call as gRPC (tonic's `Status::resource_exhausted(..)`
// into HTTP: status 200, `grpc-status` 8, its message) keeps its status and message; it
// was read as an HTTP 200 and turned into INTERNAL "OK".
#[tokio::test]
async fn a_hooks_grpc_answer_keeps_its_status() {
    let denied = denied_grpc_call_answered_by(|| {
        // A 429 with gRPC's fields and a body: sent trailers-only all the same (HTTP
        // 200, no content), or clients read the HTTP status.
        http::Response::builder()
            .status(429)
            .header("content-type", "application/grpc")
            .header("grpc-status", "8")
            .header("grpc-message", "quota%20spent")
            .body(bytes::Bytes::from_static(b"quota spent"))
            .unwrap()
    })
    .await;
    assert_eq!(denied.status(), 200);
    assert_eq!(header(&denied, "grpc-status").as_deref(), Some("8"));
    assert_eq!(
        header(&denied, "grpc-message").as_deref(),
        Some("quota%20spent")
    );
    // No content (axum may say so with a length of 0).
    assert!(matches!(
        header(&denied, "content-length").as_deref(),
        None | Some("0")
    ));
    let pushback: u64 = header(&denied, "grpc-retry-pushback-ms")
        .expect("the layer's wait as a pushback")
        .parse()
        .unwrap();
    assert!(pushback >= 1_000, "{pushback}");
    assert!(body_text(denied).await.is_empty());
}

// A hook may answer a denial with a 200 and a notice (the `on_deny` docs show one): on a
// gRPC call, with no `grpc-status` of its own, that went out as INTERNAL (13) "OK", a
// server fault to the client. A denial answered so is RESOURCE_EXHAUSTED, with the
// denial's wait.
#[tokio::test]
async fn a_hooks_plain_success_on_a_grpc_call_is_resource_exhausted() {
    let denied = denied_grpc_call_answered_by(|| {
        http::Response::builder()
            .status(200)
            .body(bytes::Bytes::from_static(b"slow down, please"))
            .unwrap()
    })
    .await;
    assert_eq!(denied.status(), 200);
    assert_eq!(header(&denied, "grpc-status").as_deref(), Some("8"));
    assert_eq!(
        header(&denied, "grpc-message").as_deref(),
        Some("rate limited")
    );
    // The layer chose RESOURCE_EXHAUSTED, so it says when, as for its own denials (gRFC
    // A6, "Pushback"): without it a client whose retry policy lists the code retries on
    // its own backoff (often 100 ms) into the spent quota. Over HTTP the notice stays a
    // 200 with no `Retry-After` (`a_hooks_answer_that_is_no_429_gets_no_retry_after`).
    assert_told_the_wait(&denied, "8");
}

/// Asserts that `denied`, a gRPC answer of `code` to a call past a fixed window of 60 s,
/// says the wait in `retry-after` (at most the window: fixed windows start on the epoch's
/// minutes) and the same wait in `grpc-retry-pushback-ms`.
fn assert_told_the_wait(denied: &Response<Body>, code: &str) {
    let after: u64 = header(denied, "retry-after")
        .unwrap_or_else(|| panic!("the wait, for code {code}"))
        .parse()
        .unwrap();
    assert!((1..=60).contains(&after), "{after}");
    let pushback: u64 = header(denied, "grpc-retry-pushback-ms")
        .expect("the wait as a pushback")
        .parse()
        .unwrap();
    assert_eq!(pushback, after * 1_000);
}

// tonic's `Status::resource_exhausted(..).into_http()` is an HTTP 200 with `grpc-status`
// 8. A hook that answers so is telling the client to wait, as a 429 does: the wait goes
// with it (`Retry-After`, and the pushback of gRFC A6). Read as "a 200 with a notice",
// it went out with no wait at all, and clients with a retry policy retried at once into
// a spent quota.
#[tokio::test]
async fn a_hooks_grpc_answer_in_tonics_shape_is_told_the_wait() {
    for (code, wait) in [("8", true), ("14", true), ("7", false)] {
        let app = Router::new()
            .route("/call", axum::routing::post(|| async { "called" }))
            .layer(
                RateLimitLayer::new(MemoryStore::new())
                    .policy(Policy::fixed_window("api", 1, Duration::from_secs(60)).unwrap())
                    .on_deny(move |_: &tollgate::Rejection<'_>| {
                        http::Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", code)
                            .header("grpc-message", "quota%20spent")
                            .body(bytes::Bytes::new())
                            .unwrap()
                    }),
            );
        let call = || grpc_call(&app, "/call");
        assert_eq!(header(&call().await.unwrap(), "grpc-status"), None);
        let denied = call().await.unwrap();
        assert_eq!(denied.status(), 200);
        assert_eq!(header(&denied, "grpc-status").as_deref(), Some(code));
        if !wait {
            // PERMISSION_DENIED: no wait (a ban is not "come back after").
            assert_eq!(header(&denied, "retry-after"), None);
            assert_eq!(header(&denied, "grpc-retry-pushback-ms"), None);
            continue;
        }
        assert_told_the_wait(&denied, code);
    }
}

// The legacy reset is the Unix time the quota is whole again, rounded up once: now plus a
// reset of a fraction of a second is the next second, not the one after.
#[tokio::test]
async fn the_legacy_reset_is_rounded_up_once() {
    for _ in 0..50 {
        // A fresh bucket each time: one unit short, whatever the machine's speed (units
        // spent by earlier rounds would still be refilling on a fast one).
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::token_bucket("api", 1_000, Rate::per_second(1_000)).unwrap())
                .headers(HeaderStyle::Legacy),
        );
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let response = app.clone().oneshot(request("/", 1)).await.unwrap();
        let after = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let reset: u64 = header(&response, "x-ratelimit-reset")
            .unwrap()
            .parse()
            .unwrap();
        // One unit spent at 1,000/s: whole again 1 ms after the decision.
        let latest = (after + Duration::from_millis(1)).as_secs_f64().ceil() as u64;
        let earliest = (before + Duration::from_millis(1)).as_secs_f64().ceil() as u64;
        assert!(
            (earliest..=latest).contains(&reset),
            "reset {reset}, expected {earliest}..={latest}"
        );
    }
}

// `header_jitter` spreads clients told to come back when a long window ends: the
// draft-6 and legacy reset must carry the same jitter as `Retry-After`, or a client that
// reads them comes back before it is let in, with all the others. A window's clients
// come back together when it ends however soon that is, so its last minute is spread
// too (CI once ran this 21 s before the hour ended, on the wall clock: nothing was
// spread). The clock is a manual one, so the window ends where the test says. A denial
// the deny cache answers (it keeps no statuses) carries the same jitter.
#[tokio::test]
async fn single_valued_resets_carry_the_jitter_of_retry_after() {
    use tollgate::clock::ManualClock;
    for style in [HeaderStyle::Draft6, HeaderStyle::Legacy] {
        for left in [3600, 21] {
            for cached in [false, true] {
                let clock = ManualClock::new();
                clock.advance(Duration::from_secs(3600 - left));
                let memory = MemoryStore::builder().clock(clock.clone()).build();
                let spread = if cached {
                    jittered_resets(DenyCache::with_clock(memory, 100, clock), style, 3).await
                } else {
                    jittered_resets(memory, style, 2).await
                };
                assert!(
                    spread.len() > 1,
                    "{style:?}, {left} s left, cached {cached}: the reset was not spread: \
                     {spread:?}"
                );
                assert!(
                    spread.iter().all(|&reset| reset <= left + 61),
                    "{style:?}, {left} s left: {spread:?}"
                );
            }
        }
    }
}

// An in-flight slot is free when some request ends, not when a window ends: no herd to
// spread, so `header_jitter` leaves its 1 s `Retry-After` alone, whatever its lease.
#[tokio::test]
async fn an_in_flight_denial_carries_no_jitter() {
    for style in [HeaderStyle::Draft11, HeaderStyle::Draft6] {
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(
                    Policy::concurrency_with_lease("inflight", 1, Duration::from_secs(600))
                        .unwrap(),
                )
                .headers(style)
                .header_jitter(Duration::from_secs(60)),
        );
        let held = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(held.status(), 200);
        for _ in 0..20 {
            let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
            assert_eq!(denied.status(), 429);
            assert_eq!(header(&denied, "retry-after").as_deref(), Some("1"));
            if style == HeaderStyle::Draft6 {
                assert_eq!(header(&denied, "ratelimit-reset").as_deref(), Some("1"));
            }
        }
        drop(held);
    }
}

// Jitter spreads a herd: clients told the same instant, the end of a window aligned to
// the clock. A bucket's and GCRA's times are each identity's own, so no herd shares them:
// under `header_jitter` their short times are what they are without it, however long
// their quota's w (100 a minute is w=60).
#[tokio::test]
async fn jitter_leaves_times_no_herd_shares_alone() {
    use tollgate::clock::ManualClock;
    let sets = [
        Policy::token_bucket("bucket", 100, Rate::per_minute(100)).unwrap(),
        Policy::gcra("gcra", Rate::per_second(10), 600).unwrap(),
        Policy::leaky_bucket("leaky", 100, Rate::per_minute(100)).unwrap(),
    ];
    for policy in sets {
        let mut answers = Vec::new();
        for jitter in [Duration::ZERO, Duration::from_secs(30)] {
            let clock = ManualClock::new();
            let app = hello().layer(
                RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
                    .policy(policy.clone())
                    .header_jitter(jitter),
            );
            let mut seen = Vec::new();
            for step in 0..policy.limit() + 60 {
                clock.advance(Duration::from_millis(if step % 50 == 0 { 90 } else { 1 }));
                let response = app.clone().oneshot(request("/", 1)).await.unwrap();
                seen.push((
                    response.status(),
                    header(&response, "ratelimit"),
                    header(&response, "retry-after"),
                ));
            }
            answers.push(seen);
        }
        assert!(
            answers[1].iter().any(|(status, ..)| *status == 429),
            "{}: never denied",
            policy.name()
        );
        for (step, (plain, jittered)) in answers[0].iter().zip(&answers[1]).enumerate() {
            assert_eq!(plain, jittered, "{} request {step}", policy.name());
        }
    }
}

// Two policies deny: the bucket names the longest wait (4 s), the hourly window ends in
// 2 s, and its jittered t may be later than that. Retry-After is never earlier than the
// t stated for any policy that denies the request, whichever is named (draft-11, section
// 6: Retry-After SHOULD NOT reference a point in time earlier than the end of the
// effective window).
#[tokio::test]
async fn retry_after_is_no_earlier_than_the_t_of_any_denying_policy() {
    use tollgate::clock::ManualClock;
    for who in 0..20 {
        let clock = ManualClock::new();
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
                .policy(Policy::fixed_window("hourly", 5, Duration::from_secs(3600)).unwrap())
                .policy(
                    Policy::token_bucket("burst", 5, Rate::new(1, Duration::from_secs(10)))
                        .unwrap(),
                )
                .header_jitter(Duration::from_secs(30)),
        );
        clock.advance(Duration::from_secs(3592));
        for _ in 0..5 {
            assert_eq!(
                app.clone().oneshot(request("/", 1)).await.unwrap().status(),
                200
            );
        }
        clock.advance(Duration::from_secs(6));
        let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(denied.status(), 429);
        let retry: i64 = header(&denied, "retry-after").unwrap().parse().unwrap();
        for (name, params) in parse_list(&header(&denied, "ratelimit").unwrap()) {
            if integer(&params, "r") == 0 {
                let t = integer(&params, "t");
                assert!(
                    retry >= t,
                    "try {who}: Retry-After {retry} before {name}'s t={t}"
                );
            }
        }
    }
}

// ... and only those: a policy that would admit the request (units left, or a shaping
// bucket with room, which admits any cost that fits its burst and delays it) does not
// stretch `Retry-After`, however long its `t`.
#[tokio::test(start_paused = true)]
async fn retry_after_is_no_later_than_the_policies_that_deny() {
    use tollgate::clock::ManualClock;
    let sets = [
        // A daily window with plenty left beside a spent bucket.
        Policy::fixed_window("daily", 1_000, Duration::from_secs(86_400)).unwrap(),
        // A shaping bucket with room for one more unit (t is a minute).
        Policy::leaky_bucket_shaping("shape", Rate::per_minute(1), Duration::from_secs(600))
            .unwrap(),
    ];
    for other in sets {
        let clock = ManualClock::new();
        let app = hello().layer(
            RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
                .policy(Policy::token_bucket("burst", 10, Rate::per_second(1)).unwrap())
                .policy(other.clone())
                .cost(cost_header()),
        );
        assert_eq!(status_of(&app, 10).await, 200);
        let denied = app.clone().oneshot(request("/", 5)).await.unwrap();
        assert_eq!(denied.status(), 429, "{}", other.name());
        assert_eq!(
            header(&denied, "retry-after").as_deref(),
            Some("5"),
            "{}: {:?}",
            other.name(),
            header(&denied, "ratelimit")
        );
    }
}

/// The resets (seconds from now) of the denials of 20 identities under a one-an-hour
/// fixed window with 60 s of jitter: each identity is admitted once, then sent `tries`
/// requests more, each denied with a reset no earlier than its `Retry-After`.
async fn jittered_resets<S: Store + Clone>(
    store: S,
    style: HeaderStyle,
    tries: usize,
) -> std::collections::BTreeSet<u64> {
    let app = hello().layer(
        RateLimitLayer::new(store)
            .policy(Policy::fixed_window("hourly", 1, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::from_fn(|parts| {
                Ok(Key::new(parts.headers["x-who"].to_str().unwrap_or("?")))
            }))
            .headers(style)
            .header_jitter(Duration::from_secs(60)),
    );
    let mut spread = std::collections::BTreeSet::new();
    for who in 0..20 {
        let request = || {
            Request::get("/")
                .header("x-who", who.to_string())
                .body(Body::empty())
                .unwrap()
        };
        assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), 200);
        for _ in 1..tries {
            let denied = app.clone().oneshot(request()).await.unwrap();
            assert_eq!(denied.status(), 429);
            let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
            let from_now = reset_from_now(&denied, style);
            assert!(
                from_now >= retry,
                "{style:?}: reset in {from_now} s, Retry-After {retry} s"
            );
            if style == HeaderStyle::Draft6 {
                // draft-06, section 5: the same point in time as Retry-After.
                assert_eq!(from_now, retry);
            }
            spread.insert(from_now);
        }
    }
    spread
}

// A shaping bucket whose burst passes MAX_LIMIT is refused like any other quota.
#[test]
fn a_shaping_burst_beyond_the_limit_is_refused() {
    let error = Policy::leaky_bucket_shaping(
        "ls",
        Rate::new(1_000_000_000, Duration::from_millis(1)),
        Duration::from_secs(3600),
    )
    .unwrap_err();
    assert!(error.to_string().contains("burst"), "{error}");
}

// Sliding-log entries of 15-digit costs keep their cost (Lua prints numbers past 14
// digits as 1e+14 unless told otherwise).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_sliding_log_keeps_fifteen_digit_costs() {
    let server = support::RedisServer::start();
    let store = tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let set = PolicySet::from(
        Policy::sliding_log("upload", 500_000_000_000_000, Duration::from_secs(86_400)).unwrap(),
    );
    let key = Key::new("big");
    for _ in 0..5 {
        assert!(
            store
                .decide(&key, &set, 100_000_000_000_000)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    let denied = store.decide(&key, &set, 1).await.unwrap();
    assert!(!denied.is_allowed());
    assert_eq!(denied.statuses()[0].remaining, 0);
}

// A decision served from a lease is not the store answering either: requests served from
// their identity's lease while the store fails must not keep the breaker from opening.
#[tokio::test]
async fn decisions_served_from_a_lease_never_close_the_breaker() {
    let store = Switch::new();
    let leased =
        tollgate::store::Leased::new(Adjusting(store.clone()), 100, Duration::from_secs(3600))
            .unwrap();
    let app = hello().layer(
        RateLimitLayer::new(leased)
            .policy(Policy::token_bucket("api", 10_000, Rate::per_second(10_000)).unwrap())
            .key(tollgate::key::from_fn(|parts| {
                Ok(Key::new(parts.headers["x-who"].to_str().unwrap_or("?")))
            }))
            .on_store_error(FailureMode::FailOpen)
            .store_timeout(Duration::from_secs(30))
            .circuit_breaker(CircuitBreaker::new(2, Duration::from_secs(3600))),
    );
    let who = |name: &str| {
        Request::get("/")
            .header("x-who", name)
            .body(Body::empty())
            .unwrap()
    };
    // "leased" takes a lease of 100 units while the store is up.
    assert_eq!(
        app.clone().oneshot(who("leased")).await.unwrap().status(),
        200
    );
    assert_eq!(store.calls(), 1);
    store.set(DOWN);
    // The store fails for "other", twice, with a request served from the lease between.
    app.clone().oneshot(who("other")).await.unwrap();
    let before = store.calls();
    assert_eq!(
        app.clone().oneshot(who("leased")).await.unwrap().status(),
        200
    );
    assert_eq!(store.calls(), before, "the lease served its identity");
    app.clone().oneshot(who("other")).await.unwrap();
    let calls = store.calls();
    // Two failures in a row from the store's side: the breaker is open, and the next
    // requests are not sent to the store.
    for _ in 0..3 {
        app.clone().oneshot(who("other")).await.unwrap();
    }
    assert_eq!(
        store.calls(),
        calls,
        "the breaker did not open: the lease's answer counted as the store's"
    );
}

// A store timeout of zero would fail every decision of a store that does I/O, for good:
// refused when the layer is built, with what is wrong.
#[test]
fn a_zero_store_timeout_is_refused_when_the_layer_is_built() {
    let layer = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::gcra("api", Rate::per_second(5), 5).unwrap())
        .store_timeout(Duration::ZERO);
    let refused = layer.validate().unwrap_err();
    assert!(refused.contains("store timeout"), "{refused}");
    assert!(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::gcra("api", Rate::per_second(5), 5).unwrap())
            .store_timeout(Duration::from_millis(1))
            .validate()
            .is_ok()
    );
}

/// A store (a user's own) whose answer names a policy the set does not have, or delays
/// a request longer than any shaping policy may (`MAX_SHAPING_DELAY`; `Duration::MAX`
/// overflowed the deadline and panicked): a bug in that store, never a reason to panic
/// the service or hold a request for ever. The answer is a protocol error: counted, and
/// answered by the failure mode (here: closed, 503), not a 429.
#[tokio::test]
async fn a_store_naming_a_policy_the_set_lacks_is_a_protocol_error_not_a_panic() {
    #[derive(Clone)]
    struct OffByFour(Outcome);

    impl Store for OffByFour {
        fn decide(&self, _: &Key, policies: &PolicySet, _: u64) -> DecideFuture {
            let statuses = policies.iter().map(|policy| {
                tollgate::PolicyStatus::new(policy.limit(), 0, Duration::ZERO, Duration::ZERO)
            });
            DecideFuture::ready(Ok(tollgate::Decision::new(self.0, statuses)))
        }
    }

    for outcome in [
        Outcome::Denied {
            policy: 5,
            retry_after: Duration::from_secs(1),
        },
        Outcome::CostExceedsLimit {
            policy: 5,
            cost: 3,
            limit: 2,
        },
        Outcome::Allowed {
            delay: Duration::MAX,
        },
        Outcome::Allowed {
            delay: tollgate::policy::MAX_SHAPING_DELAY + Duration::from_nanos(1),
        },
    ] {
        let app = Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(OffByFour(outcome))
                .policy(Policy::fixed_window("api", 2, Duration::from_secs(60)).unwrap())
                .on_store_error(FailureMode::FailClosed),
        );
        let response = app.oneshot(request("/", 1)).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{outcome:?}"
        );
    }
}

/// A store that is away: every decision fails as unavailable.
#[derive(Clone)]
struct Down;

impl Store for Down {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        DecideFuture::ready(Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }
}

/// The fallback stands in for the store while it is away: its denials come from the
/// outage (a share of the quota, one replica's count), not from a client past its real
/// limit, and count towards no penalty, as a shadow layer's and a waiter's do not. A
/// client that met a third of its quota through one replica in an outage was blocked for
/// an hour, and the block (with its strikes, which double the next one) outlived the
/// outage in the fallback's store.
#[tokio::test]
async fn the_fallbacks_denials_count_towards_no_penalty() {
    for (share, quota) in [(1.0 / 3.0, 10), (1.0, 30)] {
        let penalised = Policy::fixed_window("api", 30, Duration::from_secs(60))
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(
                3,
                Duration::from_secs(60),
                Duration::from_secs(3600),
            ))
            .unwrap();
        let app = hello().layer(
            RateLimitLayer::new(Down)
                .policy(penalised)
                .cost(cost_header())
                .on_store_error(FailureMode::Fallback(
                    tollgate::LocalFallback::new().share(share),
                )),
        );
        for _ in 0..quota {
            let response = app.clone().oneshot(request("/", 1)).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "share {share}");
        }
        for _ in 0..5 {
            let denied = app.clone().oneshot(request("/", 1)).await.unwrap();
            assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
            let wait: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
            assert!(
                wait <= 60,
                "share {share}: the outage started a block of {wait} s"
            );
        }
    }
}

/// A fallback that enforces a share of the limit (`LocalFallback::share`) holds a smaller
/// bucket than the policy. A request the policy admits but the share cannot (cost 40
/// against a quarter of 100) is stopped by the outage, not by the client: `503` with
/// `Retry-After`, never `400` (which a client takes as "never send this again") naming
/// the scaled-down quota as the policy's.
#[tokio::test]
async fn a_cost_only_the_fallbacks_share_cannot_admit_is_an_outage_not_a_bad_request() {
    let app = hello().layer(
        RateLimitLayer::new(Down)
            .policy(Policy::token_bucket("api", 100, Rate::per_minute(100)).unwrap())
            .cost(cost_header())
            .on_store_error(FailureMode::Fallback(
                tollgate::LocalFallback::new().share(0.25),
            )),
    );
    let response = app.clone().oneshot(request("/", 40)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(header(&response, "retry-after").is_some());
    // What the share admits, it admits; what the policy itself never admits is still the
    // client's mistake.
    let response = app.clone().oneshot(request("/", 20)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let response = app.oneshot(request("/", 101)).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // Told with the policy's own quota, not the share's.
    assert!(body_text(response).await.contains("at most 100"));

    // Of two policies, the one that never admits the cost decides, whichever policy the
    // fallback's scaled set named.
    let two = PolicySet::new([
        Policy::token_bucket("api", 100, Rate::per_minute(100)).unwrap(),
        Policy::token_bucket("burst", 30, Rate::per_minute(30)).unwrap(),
    ])
    .unwrap();
    let share = FailureMode::Fallback(tollgate::LocalFallback::new().share(0.25));
    let app = hello().layer(
        RateLimitLayer::new(Down)
            .policies(two.clone())
            .cost(cost_header())
            .on_store_error(share.clone()),
    );
    let response = app.oneshot(request("/", 40)).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert!(body_text(response).await.contains("admits at most 30"));

    // A `Limiter` answers as the layer does: the store's error, not "never".
    let limiter = tollgate::limiter::Limiter::new(
        Down,
        Policy::token_bucket("api", 100, Rate::per_minute(100)).unwrap(),
    )
    .on_store_error(share.clone());
    let key = Key::new("k");
    let error = limiter.check(&key, 40).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable);
    assert!(matches!(
        limiter.until_ready(&key, 40, Duration::from_secs(1)).await,
        Err(tollgate::limiter::WaitError::Store(_))
    ));
    let limiter = tollgate::limiter::Limiter::new(Down, two).on_store_error(share);
    assert!(!limiter.check(&key, 40).await.unwrap().is_allowed());
}

/// Two limiters nested (a per-route limit inside a global one) with a single-valued style:
/// each of `RateLimit-Limit`, `-Remaining` and `-Reset` (or `X-RateLimit-*`) holds one
/// value, so the outer layer must not write over the inner one's numbers with its own
/// roomier ones. The inner layer's `429` said "0 left" and the client read "999 left".
/// The fields of the more restrictive limit stay, as within one layer (draft-6 section
/// 3.1 has one field per response; the most restrictive policy is the one reported).
#[tokio::test]
async fn nested_limiters_report_the_more_restrictive_single_valued_fields() {
    for (style, prefix) in [
        (HeaderStyle::Draft6, "ratelimit"),
        (HeaderStyle::Legacy, "x-ratelimit"),
    ] {
        // Behind a deny cache, whose cached denials carry no statuses.
        let route = RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 100))
            .policy(Policy::fixed_window("search", 1, Duration::from_secs(60)).unwrap())
            .headers(style);
        let global = RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("global", 1000, Duration::from_secs(3600)).unwrap())
            .headers(style);
        let app = Router::new()
            .route("/search", get(|| async { "found" }))
            .route_layer(route)
            .layer(global);
        let remaining = format!("{prefix}-remaining");
        let limit = format!("{prefix}-limit");

        let first = app.clone().oneshot(request("/search", 1)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(header(&first, &remaining).as_deref(), Some("0"), "{prefix}");
        assert_eq!(header(&first, &limit).as_deref(), Some("1"), "{prefix}");
        assert_eq!(first.headers().get_all(&remaining).iter().count(), 1);

        let denied = app.clone().oneshot(request("/search", 1)).await.unwrap();
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            header(&denied, &remaining).as_deref(),
            Some("0"),
            "{prefix}"
        );
        assert_eq!(header(&denied, &limit).as_deref(), Some("1"), "{prefix}");
        let reset: u64 = header(&denied, &format!("{prefix}-reset"))
            .unwrap()
            .parse()
            .unwrap();
        let retry_after: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
        if style == HeaderStyle::Draft6 {
            // draft-06, section 5: the same point in time as Retry-After.
            assert_eq!(reset, retry_after);
        }
        // The inner layer's cached denial: its own numbers (what a denial says without
        // the state), not the outer layer's roomier ones, on its `429`.
        let cached = app.oneshot(request("/search", 1)).await.unwrap();
        assert_eq!(cached.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            header(&cached, &remaining).as_deref(),
            Some("0"),
            "{prefix}"
        );
        assert_eq!(header(&cached, &limit).as_deref(), Some("1"), "{prefix}");
        assert_eq!(cached.headers().get_all(&remaining).iter().count(), 1);
    }
}

/// The same with an in-flight limit alone inside: it sends `Limit` and `Remaining` but no
/// `Reset` (it has none). The outer layer read that as a partial set and wrote its
/// roomier numbers over the inner "0 left".
#[tokio::test]
async fn a_nested_in_flight_limit_keeps_its_numbers() {
    for (style, prefix) in [
        (HeaderStyle::Draft6, "ratelimit"),
        (HeaderStyle::Legacy, "x-ratelimit"),
    ] {
        let route = RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::concurrency("slots", 1).unwrap())
            .headers(style);
        let global = RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("global", 1000, Duration::from_secs(3600)).unwrap())
            .headers(style);
        let app = Router::new()
            .route("/search", get(|| async { "found" }))
            .route_layer(route)
            .layer(global);
        let first = app.clone().oneshot(request("/search", 1)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(
            header(&first, &format!("{prefix}-remaining")).as_deref(),
            Some("0"),
            "{prefix}"
        );
        assert_eq!(
            header(&first, &format!("{prefix}-limit")).as_deref(),
            Some("1"),
            "{prefix}"
        );
        assert_eq!(header(&first, &format!("{prefix}-reset")), None, "{prefix}");
    }
}

/// draft-ietf-httpapi-ratelimit-headers-06, section 5 (Server Behavior): "If a response
/// contains both the Retry-After and the RateLimit-Reset fields, the RateLimit-Reset field
/// value SHOULD reference the same point in time". A bucket refilled by 5 a second and
/// drained admits one unit in 0.2 s and is whole in 2 s: the denial says 1 in both.
#[tokio::test]
async fn draft_6_reset_on_a_denial_is_its_retry_after() {
    let clock = tollgate::clock::ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let layer = |style| {
        RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
            .policy(Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap())
            .cost(cost_header())
            .headers(style)
    };
    let app = hello().layer(layer(HeaderStyle::Draft6));
    assert_eq!(status_of(&app, 10).await, 200);
    let denied = app.oneshot(request("/", 1)).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "retry-after").as_deref(), Some("1"));
    assert_eq!(header(&denied, "ratelimit-reset").as_deref(), Some("1"));
    // The legacy style's reset stays the time the quota is whole again (GitHub's
    // meaning), never before Retry-After.
    let app = hello().layer(layer(HeaderStyle::Legacy));
    app.clone().oneshot(request("/", 10)).await.unwrap();
    let denied = app.oneshot(request("/", 1)).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let reset: u64 = header(&denied, "x-ratelimit-reset")
        .unwrap()
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        reset >= now + 2 && reset <= now + 3,
        "{reset} against {now}"
    );
}

/// An app whose one route answers `status` with `Retry-After: 5` (and a `Location`, as a
/// redirect has).
fn answering_with_a_wait(status: StatusCode) -> Router {
    Router::new().route(
        "/",
        get(move || async move {
            Response::builder()
                .status(status)
                .header("retry-after", "5")
                .header("location", "/elsewhere")
                .body(Body::empty())
                .unwrap()
        }),
    )
}

/// The single-valued styles leave an inner answer's own wait alone (a limiter further in
/// said 429 or the service 503, each with `Retry-After`), but a `Retry-After` on any other
/// answer (RFC 9110, section 10.2.3: on a 3xx, how long to wait before following the
/// redirect) is no rate-limit wait: the request was decided and charged, and its fields
/// are written (draft-06, section 5, names redirects among the responses that carry
/// them).
#[tokio::test]
async fn single_valued_fields_stay_on_an_inner_answer_that_is_no_limiters_wait() {
    for (status, written) in [
        (StatusCode::MOVED_PERMANENTLY, true),
        (StatusCode::CREATED, true),
        (StatusCode::TOO_MANY_REQUESTS, false),
        (StatusCode::SERVICE_UNAVAILABLE, false),
    ] {
        let app = answering_with_a_wait(status).layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap())
                .headers(HeaderStyle::Draft6),
        );
        let response = app.oneshot(request("/", 1)).await.unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(
            header(&response, "ratelimit-remaining").is_some(),
            written,
            "{status}"
        );
        assert_eq!(header(&response, "retry-after").as_deref(), Some("5"));
    }
}

/// An inner answer's wait (a `429` or `503` with `Retry-After`) is raised only to a quota
/// this layer's request left with none (draft-11, section 7.2), and any other answer's
/// `Retry-After` (a redirect's, a `201`'s) is no wait. draft-11's fields, lists with each
/// limiter's members joined (sections 3 and 4), are written on every one of them; with
/// no fields (`HeaderStyle::None`), the wait alone. Both sides of the line: a quota left
/// with room (the wait stays 5) and one spent to nothing (raised to its 30 s).
#[tokio::test]
async fn an_inner_wait_is_raised_only_by_a_quota_spent_to_nothing() {
    for style in [HeaderStyle::Draft11, HeaderStyle::None] {
        for (capacity, spent) in [(10, false), (1, true)] {
            for status in [
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
                StatusCode::MOVED_PERMANENTLY,
                StatusCode::CREATED,
            ] {
                let app = answering_with_a_wait(status).layer(
                    RateLimitLayer::new(MemoryStore::new())
                        .policy(
                            Policy::token_bucket(
                                "api",
                                capacity,
                                Rate::new(1, Duration::from_secs(30)),
                            )
                            .unwrap(),
                        )
                        .headers(style),
                );
                let response = app.oneshot(request("/", 1)).await.unwrap();
                let case = format!("{style:?}, capacity {capacity}, {status}");
                assert_eq!(response.status(), status, "{case}");
                let waiting = matches!(
                    status,
                    StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
                );
                let expected = if spent && waiting { "30" } else { "5" };
                assert_eq!(
                    header(&response, "retry-after").as_deref(),
                    Some(expected),
                    "{case}"
                );
                let rate = header(&response, "ratelimit");
                if style == HeaderStyle::Draft11 {
                    let policy = header(&response, "ratelimit-policy").unwrap_or_default();
                    assert!(
                        policy.starts_with(&format!("\"api\";q={capacity};w=")),
                        "{case}: {policy}"
                    );
                    let rate = rate.unwrap_or_default();
                    let left = capacity - 1;
                    assert!(
                        rate.starts_with(&format!("\"api\";r={left};t=")),
                        "{case}: {rate}"
                    );
                } else {
                    assert_eq!(rate, None, "{case}");
                }
            }
        }
    }
}

/// A limiter further in answers `429` with its `Retry-After` (10 s) to a request this
/// layer admitted with its last unit (`r=0`, the next in 30 s): a client that comes back
/// when told (draft-11, section 7: `Retry-After` takes precedence over the fields) is
/// refused again, by this layer, and the fields beside the wait contradict it (section 6:
/// `Retry-After` should not point earlier than a quota's reset that denies the next
/// request). An intermediary may tell a client to wait longer (section 7.2), and this
/// layer knows it must: the wait is raised to its own. The single-valued styles (one
/// policy's numbers) then state the policy that keeps the client waiting (draft-06,
/// section 5: `RateLimit-Reset` is the same point in time as `Retry-After`). With no
/// fields (`HeaderStyle::None`), `Retry-After` alone is raised: it is the minimum time to
/// wait (RFC 9110, section 10.2.3), and 10 s is not.
#[tokio::test]
async fn an_inner_wait_is_raised_to_an_outer_quota_spent_until_later() {
    for style in [
        HeaderStyle::Draft11,
        HeaderStyle::Draft6,
        HeaderStyle::Legacy,
        HeaderStyle::None,
    ] {
        let clock = tollgate::clock::ManualClock::new();
        let store = || MemoryStore::builder().clock(clock.clone()).build();
        let route = RateLimitLayer::new(store())
            .policy(
                Policy::token_bucket("search", 1, Rate::new(1, Duration::from_secs(10))).unwrap(),
            )
            .headers(style);
        let global = RateLimitLayer::new(store())
            .policy(
                Policy::token_bucket("outer", 2, Rate::new(1, Duration::from_secs(30))).unwrap(),
            )
            .headers(style);
        let app = Router::new()
            .route("/search", get(|| async { "found" }))
            .route_layer(route)
            .layer(global);
        let call = || app.clone().oneshot(request("/search", 1));

        assert_eq!(call().await.unwrap().status(), StatusCode::OK, "{style:?}");
        clock.advance(Duration::from_millis(100));
        let denied = call().await.unwrap();
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS, "{style:?}");
        let retry_after: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
        assert_eq!(retry_after, 30, "{style:?}: the outer quota's next unit");
        match style {
            HeaderStyle::Draft11 => {
                let lines: Vec<&str> = denied
                    .headers()
                    .get_all("ratelimit")
                    .iter()
                    .map(|line| line.to_str().unwrap())
                    .collect();
                // A field's lines are one list (RFC 9651, section 4.2).
                let field = lines.join(", ");
                let list = sfv::Parser::new(&field).parse::<sfv::List>().unwrap();
                assert_eq!(list.len(), 2, "{field}");
                for member in &list {
                    let sfv::ListEntry::Item(item) = member else {
                        panic!("{field}")
                    };
                    let param = |name: &str| {
                        item.params
                            .iter()
                            .find(|(key, _)| key.as_str() == name)
                            .and_then(|(_, value)| value.as_integer())
                            .map(i64::from)
                    };
                    if param("r") == Some(0) {
                        assert!(param("t").unwrap() <= 30, "{field}");
                    }
                }
            }
            HeaderStyle::Draft6 => {
                assert_eq!(header(&denied, "ratelimit-limit").as_deref(), Some("2"));
                assert_eq!(header(&denied, "ratelimit-remaining").as_deref(), Some("0"));
                assert_eq!(header(&denied, "ratelimit-reset").as_deref(), Some("30"));
            }
            HeaderStyle::None => {
                // The inner layer writes none either: no field but the wait.
                for name in ["ratelimit", "ratelimit-policy", "x-ratelimit-remaining"] {
                    assert_eq!(header(&denied, name), None, "{name}");
                }
            }
            _ => {
                assert_eq!(header(&denied, "x-ratelimit-limit").as_deref(), Some("2"));
                assert_eq!(
                    header(&denied, "x-ratelimit-remaining").as_deref(),
                    Some("0")
                );
                let reset: u64 = header(&denied, "x-ratelimit-reset")
                    .unwrap()
                    .parse()
                    .unwrap();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                assert!(reset >= now + 30, "{reset} against {now}");
            }
        }
        // The inner wait alone was too short: the outer layer refuses at its end...
        clock.advance(Duration::from_secs(10));
        assert_eq!(
            call().await.unwrap().status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{style:?}"
        );
        // ...and admits at the raised one's.
        clock.advance(Duration::from_secs(retry_after - 10));
        assert_eq!(call().await.unwrap().status(), StatusCode::OK, "{style:?}");
    }
}

/// The raise above is an enforcing layer's: a shadow layer (a roll-out, refusing
/// nothing) that shows its fields leaves the inner wait as it was, though its quota is
/// spent.
#[tokio::test]
async fn a_shadow_layer_leaves_an_inner_wait_alone() {
    let clock = tollgate::clock::ManualClock::new();
    let store = || MemoryStore::builder().clock(clock.clone()).build();
    let route = RateLimitLayer::new(store())
        .policy(Policy::token_bucket("search", 1, Rate::new(1, Duration::from_secs(10))).unwrap());
    let global = RateLimitLayer::new(store())
        .policy(Policy::token_bucket("outer", 2, Rate::new(1, Duration::from_secs(30))).unwrap())
        .shadow(true)
        .shadow_headers(true);
    let app = Router::new()
        .route("/search", get(|| async { "found" }))
        .route_layer(route)
        .layer(global);
    let call = || app.clone().oneshot(request("/search", 1));
    assert_eq!(call().await.unwrap().status(), StatusCode::OK);
    clock.advance(Duration::from_millis(100));
    let denied = call().await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "retry-after").as_deref(), Some("10"));
    let outer = denied
        .headers()
        .get_all("ratelimit")
        .iter()
        .any(|line| line.to_str().unwrap().contains("\"outer\";r=0"));
    assert!(outer, "the shadow layer's fields are shown");
}

/// The raise is as long as is left of the quota's wait when the inner answer comes: a
/// service that took 25 s to answer `503` with `Retry-After: 10`, behind a quota whose
/// next unit was 30 s away when the request was decided, leaves the client 5 s to wait
/// for it, less than the service asks: the service's wait stands.
#[tokio::test(start_paused = true)]
async fn an_inner_wait_is_raised_by_what_is_left_of_the_outer_one() {
    let store = MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(25)).await;
                Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .header("retry-after", "10")
                    .body(Body::empty())
                    .unwrap()
            }),
        )
        .layer(
            RateLimitLayer::new(store)
                .policy(
                    Policy::token_bucket("api", 2, Rate::new(1, Duration::from_secs(30))).unwrap(),
                )
                .cost(cost_header()),
        );
    let response = app.oneshot(request("/", 2)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&response, "retry-after").as_deref(), Some("10"));
}

/// The single-valued fields beside a raised wait state the quota that keeps the client
/// waiting: of two quotas spent to nothing, the one whose next unit is furthest (`b`,
/// 25 s), not the one that is whole again last (`a`, a bucket refilled in 75 s, whose
/// next unit is 5 s away): its limit, and its reset (draft-6's the wait, the legacy
/// style's when `b` is whole again), not `a`'s beside `b`'s limit.
#[tokio::test]
async fn a_raised_wait_is_stated_by_the_quota_it_is_for() {
    for (style, prefix) in [
        (HeaderStyle::Draft6, "ratelimit"),
        (HeaderStyle::Legacy, "x-ratelimit"),
    ] {
        let clock = tollgate::clock::ManualClock::new();
        let store = || MemoryStore::builder().clock(clock.clone()).build();
        let route = RateLimitLayer::new(store())
            .policy(
                Policy::token_bucket("inner", 1, Rate::new(1, Duration::from_secs(30))).unwrap(),
            )
            .headers(style);
        let a = Policy::token_bucket("a", 15, Rate::new(1, Duration::from_secs(5))).unwrap();
        let b = Policy::fixed_window("b", 20, Duration::from_secs(50)).unwrap();
        let global = RateLimitLayer::new(store())
            .policies(PolicySet::new([a, b]).unwrap())
            .cost(cost_header())
            .headers(style);
        let app = Router::new()
            .route("/", get(|| async { "found" }))
            .route_layer(route)
            .layer(global);
        let call = |cost| app.clone().oneshot(request("/", cost));
        assert_eq!(call(10).await.unwrap().status(), StatusCode::OK);
        clock.advance(Duration::from_secs(25));
        // `a` 10 and `b` 10 left: both spent; the inner limiter's unit is 5 s away.
        let denied = call(10).await.unwrap();
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        let field = |name: &str| header(&denied, &format!("{prefix}-{name}"));
        assert_eq!(header(&denied, "retry-after").as_deref(), Some("25"));
        assert_eq!(field("limit").as_deref(), Some("20"), "{style:?}");
        assert_eq!(field("remaining").as_deref(), Some("0"), "{style:?}");
        let reset: u64 = field("reset").unwrap().parse().unwrap();
        if style == HeaderStyle::Draft6 {
            assert_eq!(reset, 25);
        } else {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            assert!(
                (now + 25..=now + 26).contains(&reset),
                "{reset} against {now}: `b` is whole again in 25 s"
            );
        }
    }
}

/// The nested limiters above over gRPC: the inner layer's cached denial is a gRPC answer
/// (HTTP 200, `grpc-status` 8 and `retry-after`), still a wait of its own that the outer
/// layer's roomier single-valued fields must not replace.
#[tokio::test]
async fn nested_limiters_over_grpc_leave_the_inner_wait_alone() {
    let route = RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 100))
        .policy(Policy::fixed_window("search", 1, Duration::from_secs(60)).unwrap())
        .headers(HeaderStyle::Draft6);
    let global = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("global", 1000, Duration::from_secs(3600)).unwrap())
        .headers(HeaderStyle::Draft6);
    let app = Router::new()
        .route("/search", axum::routing::post(|| async { "found" }))
        .route_layer(route)
        .layer(global);
    let call = || grpc_call(&app, "/search");
    assert_eq!(
        header(&call().await.unwrap(), "ratelimit-remaining").as_deref(),
        Some("0")
    );
    let denied = call().await.unwrap();
    assert_eq!(header(&denied, "grpc-status").as_deref(), Some("8"));
    assert_eq!(header(&denied, "ratelimit-remaining").as_deref(), Some("0"));
    let cached = call().await.unwrap();
    assert_eq!(header(&cached, "grpc-status").as_deref(), Some("8"));
    assert!(header(&cached, "retry-after").is_some());
    assert_eq!(header(&cached, "ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(header(&cached, "ratelimit-limit").as_deref(), Some("1"));
}

/// The README's least-privilege ACL line, as written there, through a connection pool:
/// deadpool checks a pooled connection with `UNWATCH` and `PING` each time it hands it
/// out again. Without them in the line, every check was refused and the connection
/// thrown away: a new connection (and its authentication) for every decision, silently.
#[cfg(feature = "redis")]
#[tokio::test]
async fn the_readmes_acl_line_keeps_a_pools_connections() {
    let server = support::RedisServer::start();
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("the README");
    let line = readme
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("ACL SETUSER limiter on >PASSWORD"))
        .expect("the README's ACL line");
    let line = line.replace(">PASSWORD", ">s3cret");
    let args: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(server.cli(&args).trim(), "OK");
    let url = format!("redis://limiter:s3cret@127.0.0.1:{}", server.port);
    let pool = deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool");
    let store = tollgate::store::RedisStore::from_pool(pool);
    store.verify().await.expect("the line runs every script");
    let connections = || support::connections_received(&server, None);
    let before = connections();
    let set = PolicySet::from(Policy::fixed_window("api", 100, Duration::from_secs(60)).unwrap());
    for _ in 0..20 {
        let decision = store.decide(&Key::new("u"), &set, 1).await.unwrap();
        assert!(decision.is_allowed());
    }
    let opened = connections() - before;
    assert!(opened <= 2, "{opened} connections opened for 20 decisions");
}

/// A limiter further in that wrote its `RateLimit` fields in an older draft's dictionary
/// form (`limit=100, remaining=50, reset=5`), or anything else that is no Structured
/// Fields List: joined with ours, the field would parse as nothing, and clients ignore a
/// malformed RateLimit field whole (draft-11, section 7; RFC 9651, section 4.2: a
/// field's lines are one value), ours with it. So is a List that is no such field: its
/// members must name a policy (a String in `RateLimit-Policy`, section 3; a String or,
/// as earlier drafts wrote it, a Token in `RateLimit`, section 4) with the required Integer, `q`
/// in `RateLimit-Policy` (section 3.1), `r` in `RateLimit` (section 4.1); and an empty
/// line would leave the joined value starting with a comma. Ours replaces it; a list
/// that is such a field is joined.
#[tokio::test]
async fn an_inner_ratelimit_field_that_is_no_list_does_not_spoil_ours() {
    let app = |inner: &'static str| {
        Router::new()
                .route(
                    "/",
                    get(move || async move {
                        ([("ratelimit", inner), ("ratelimit-policy", inner)], "ok")
                    }),
                )
                .layer(
                    RateLimitLayer::new(MemoryStore::new())
                        .policy(Policy::fixed_window("outer", 10, Duration::from_secs(60)).unwrap())
                        .key(tollgate::key::Global),
                )
    };
    let fields = |response: &Response<Body>, name: &str| -> Vec<String> {
        response
            .headers()
            .get_all(name)
            .iter()
            .map(|value| value.to_str().unwrap().to_owned())
            .collect()
    };
    for inner in [
        "limit=100, remaining=50, reset=5",
        "\"x\";r=",
        "(((",
        // Lists, but no draft-11 fields.
        "\"x\";t=5;w=5",
        "\"x\";q=-1;r=-1",
        "\"x\";q=1.5;r=1.5",
        "(\"x\");q=5;r=5",
        "",
        // The optional parameters of the wrong type (sections 3.1 and 4.1).
        "\"x\";q=5;r=5;w=-1;t=-1",
        "\"x\";q=5;r=5;w=1.5;t=1.5",
        "\"x\";q=5;r=5;qu=requests;pk=\"abc\"",
        // A policy's window "MUST be a non-negative, non-zero, Integer" (section 3.1.3).
        "\"x\";q=5;w=0",
    ] {
        let response = app(inner)
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        for name in ["ratelimit", "ratelimit-policy"] {
            let lines = fields(&response, name);
            assert_eq!(lines.len(), 1, "{inner}: {lines:?}");
            let list = sfv::Parser::new(&lines.join(", ")).parse::<sfv::List>();
            assert!(list.is_ok(), "{inner}: {lines:?}");
            assert!(lines[0].starts_with("\"outer\""), "{inner}: {lines:?}");
        }
    }
    // A field further in is kept, ours after it (a parameter the field does not define,
    // `q` in `RateLimit`, `r` in `RateLimit-Policy`, is ignored by clients).
    let response = app("\"inner\";r=5;t=1;q=10;w=1;pk=:YWJj:;acme-burst=x")
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let lines = fields(&response, "ratelimit");
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        lines[0],
        "\"inner\";r=5;t=1;q=10;w=1;pk=:YWJj:;acme-burst=x"
    );
    assert!(lines[1].starts_with("\"outer\";r=9"), "{lines:?}");
    let lines = fields(&response, "ratelimit-policy");
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[1].starts_with("\"outer\";q=10"), "{lines:?}");

    // A policy named by a Token, as earlier drafts wrote it: `RateLimit-Policy`'s items
    // must be Strings (section 3), so ours replaces that field; section 4 sets no type
    // for a `RateLimit` item's name, and an intermediary should not remove the field
    // (section 7.2): "nothing left for an hour" stays, ours after it.
    let response = app("api;q=5;r=0;t=3600")
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let lines = fields(&response, "ratelimit");
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], "api;q=5;r=0;t=3600");
    assert!(lines[1].starts_with("\"outer\";r=9"), "{lines:?}");
    let lines = fields(&response, "ratelimit-policy");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("\"outer\";q=10"), "{lines:?}");
}

/// A fail-closed 503 says when the store will be asked again: while the breaker is open,
/// what is left of its cool-down (RFC 9110, section 10.2.3: when the service is expected
/// to be back), not a fixed second that sends every client back 30 times before the
/// breaker even probes. Before the breaker opens, a second.
#[tokio::test]
async fn a_fail_closed_answer_says_when_the_breaker_probes_again() {
    let store = Switch::new();
    store.set(DOWN);
    let clock = tollgate::clock::ManualClock::new();
    let app = hello().layer(
        RateLimitLayer::new(store)
            .policy(Policy::gcra("api", Rate::per_second(1), 1).unwrap())
            .on_store_error(FailureMode::FailClosed)
            .circuit_breaker(
                CircuitBreaker::new(2, Duration::from_secs(30)).with_clock(clock.clone()),
            ),
    );
    let retry_after = |response: &Response<Body>| {
        response.headers()[http::header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .to_owned()
    };
    // The first failure: the breaker is still closed.
    let first = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry_after(&first), "1");
    // The second opens it for 30 s.
    let second = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(retry_after(&second), "30");
    clock.advance(Duration::from_millis(10_500));
    let skipped = app.clone().oneshot(request("/", 1)).await.unwrap();
    assert_eq!(skipped.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry_after(&skipped), "20", "19.5 s left, rounded up");
    let body: serde_json::Value = serde_json::from_str(&body_text(skipped).await).unwrap();
    assert_eq!(body["retry_after"], 20);
}

/// A denial the deny cache answers carries the single-valued fields as the store's own
/// does: the limit is the policy's, none is left, and the reset is the `Retry-After`
/// (draft-ietf-httpapi-ratelimit-headers-06, section 5: the reset SHOULD reference it).
/// They went missing: the cache keeps no statuses, and the fields were built from them.
#[tokio::test]
async fn a_cached_denial_keeps_its_single_valued_fields() {
    for style in [HeaderStyle::Draft6, HeaderStyle::Legacy] {
        let app = hello().layer(
            RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000))
                .policy(Policy::fixed_window("api", 1, Duration::from_secs(60)).unwrap())
                .headers(style),
        );
        let (limit, remaining, reset) = if style == HeaderStyle::Legacy {
            (
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
            )
        } else {
            ("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset")
        };
        assert_eq!(
            app.clone().oneshot(request("/", 1)).await.unwrap().status(),
            200
        );
        let unix_now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        };
        // The store's denial, then the cache's.
        for answer in ["store", "cache"] {
            let before = unix_now();
            let response = app.clone().oneshot(request("/", 1)).await.unwrap();
            let after = unix_now();
            assert_eq!(response.status(), 429, "{style:?} {answer}");
            let headers = response.headers();
            assert_eq!(headers[limit], "1", "{style:?} {answer}");
            assert_eq!(headers[remaining], "0", "{style:?} {answer}");
            let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
            let reset: u64 = headers[reset].to_str().unwrap().parse().unwrap();
            if style == HeaderStyle::Legacy {
                // The Unix time of the reset: when the response was made plus its
                // Retry-After (each rounded up once).
                assert!(
                    (before + retry - 1..=after + retry + 1).contains(&reset),
                    "{answer}: {reset} against {before}..{after} + {retry}"
                );
            } else {
                assert_eq!(reset, retry, "{answer}");
            }
        }
    }
}

/// What a cached denial can say without the state, and no more. A denial of a cost of
/// one leaves none; a costlier one may leave some (3 left, 5 asked): the single-valued
/// fields, which must state a remaining count, are then left out rather than say 0. A
/// block leaves none whatever the cost, and draft-11 lists it as the store's own answer
/// does: `r=0`, `t` its wait.
#[tokio::test]
async fn a_cached_denial_says_what_it_knows() {
    let app = hello().layer(
        RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000))
            .policy(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap())
            .cost(cost_header())
            .headers(HeaderStyle::Draft6),
    );
    assert_eq!(
        app.clone().oneshot(request("/", 7)).await.unwrap().status(),
        200
    );
    for answer in ["store", "cache"] {
        let response = app.clone().oneshot(request("/", 5)).await.unwrap();
        assert_eq!(response.status(), 429, "{answer}");
        let remaining = header(&response, "ratelimit-remaining");
        if answer == "store" {
            assert_eq!(remaining.as_deref(), Some("3"));
        } else {
            assert_eq!(remaining, None, "3 are left, not 0");
        }
    }

    let penalty =
        tollgate::policy::Penalty::new(2, Duration::from_secs(60), Duration::from_secs(600));
    let app = hello().layer(
        RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000)).policy(
            Policy::fixed_window("login", 1, Duration::from_secs(60))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        ),
    );
    assert_eq!(
        app.clone().oneshot(request("/", 1)).await.unwrap().status(),
        200
    );
    app.clone().oneshot(request("/", 1)).await.unwrap();
    for answer in ["store", "cache"] {
        let response = app.clone().oneshot(request("/", 1)).await.unwrap();
        assert_eq!(response.status(), 429, "{answer}");
        let rate = header(&response, "ratelimit").expect(answer);
        let retry = header(&response, "retry-after").unwrap();
        assert!(rate.starts_with("\"login\";r=0;t="), "{answer}: {rate}");
        assert!(
            rate.ends_with(&format!("t={retry}")),
            "{answer}: {rate} against {retry}"
        );
    }
}

/// A block's answer names the policy that keeps the client waiting longest, which need
/// not be the blocked one: a costlier request during a short block waits for an hourly
/// policy with 1 left. Its cached answer must not say that policy has none left. (The
/// request fits the blocked policy's quota: one that can never fit is told so instead.)
#[tokio::test]
async fn a_cached_block_claims_none_left_only_for_the_blocked_policy() {
    let penalty =
        tollgate::policy::Penalty::new(2, Duration::from_secs(60), Duration::from_secs(10));
    let burst = Policy::fixed_window("burst", 3, Duration::from_secs(60))
        .unwrap()
        .with_penalty(penalty)
        .unwrap();
    let hourly = Policy::fixed_window("hourly", 4, Duration::from_secs(3600)).unwrap();
    let app = hello().layer(
        RateLimitLayer::new(DenyCache::new(MemoryStore::new(), 1_000))
            .policies(PolicySet::new([burst, hourly]).unwrap())
            .cost(cost_header()),
    );
    for _ in 0..3 {
        assert_eq!(
            app.clone().oneshot(request("/", 1)).await.unwrap().status(),
            200
        );
    }
    // Two denials by the burst: the second starts its block.
    app.clone().oneshot(request("/", 1)).await.unwrap();
    app.clone().oneshot(request("/", 1)).await.unwrap();
    for answer in ["store", "cache"] {
        let response = app.clone().oneshot(request("/", 2)).await.unwrap();
        assert_eq!(response.status(), 429, "{answer}");
        let rate = header(&response, "ratelimit").unwrap_or_default();
        assert!(!rate.contains("\"hourly\";r=0"), "{answer}: {rate}");
    }
}

// A node that joined a Cluster and owns no slot yet (a scale-out between `add-node` and
// the reshard) has no Functions library: loads go to the primaries of the slot map, and
// it is in none. A call `ASK`ed to it while a slot moves there was answered "Function not
// found", the library loaded to every other primary twice, and the decision failed as a
// refusal, for every such request until the move ended. The call runs as a script.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_asked_to_a_node_without_the_library_runs_as_a_script() {
    let cluster = support::RedisCluster::start(3);
    let store = tollgate::store::RedisStore::connect_cluster(&cluster.urls())
        .await
        .unwrap();
    let policies = tollgate::PolicySet::from(
        tollgate::Policy::fixed_window("moving", 10, Duration::from_secs(600)).unwrap(),
    );
    let key = tollgate::Key::new("team");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    // A fourth node joins, with no slot.
    let joined = support::RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let meet = joined.cli(&[
        "CLUSTER",
        "MEET",
        "127.0.0.1",
        &cluster.nodes[0].port.to_string(),
    ]);
    assert_eq!(meet.trim(), "OK");
    let id = |node: &support::RedisServer| node.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let joined_id = id(&joined);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !(cluster
        .nodes
        .iter()
        .all(|node| node.cli(&["CLUSTER", "NODES"]).contains(&joined_id))
        && joined
            .cli(&["CLUSTER", "INFO"])
            .contains("cluster_state:ok"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the node did not join"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The identity's slot moves there, its keys with it.
    let (owner, keys) = cluster
        .nodes
        .iter()
        .find_map(|node| {
            let found = node.cli(&["--scan", "--pattern", "tollgate:{team}*"]);
            let keys: Vec<String> = found.lines().map(|line| line.trim().to_owned()).collect();
            (!keys.is_empty() && !keys[0].is_empty()).then_some((node, keys))
        })
        .expect("a node holds the identity's state");
    let slot = owner
        .cli(&["CLUSTER", "KEYSLOT", &keys[0]])
        .trim()
        .to_owned();
    let importing = joined.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &id(owner)]);
    let migrating = owner.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &joined_id]);
    assert_eq!((importing.trim(), migrating.trim()), ("OK", "OK"));
    let port = joined.port.to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(keys.iter().map(String::as_str));
    assert_eq!(owner.cli(&migrate).trim(), "OK");
    // Decided on the node the slot moves to, the count carried over.
    let decided = store.decide(&key, &policies, 1).await;
    let decision = decided.unwrap_or_else(|error| panic!("{error}"));
    assert!(decision.is_allowed());
    assert_eq!(decision.statuses()[0].remaining, 8);
}

/// A store on `cluster` through which thirty identities (`user:0` to `user:29`) were
/// decided once each, under a fixed window of 10 (the library loaded on every
/// primary), and the policies.
#[cfg(feature = "redis")]
async fn thirty_decided(
    cluster: &support::RedisCluster,
) -> (tollgate::store::RedisStore, tollgate::PolicySet) {
    let store = tollgate::store::RedisStore::connect_cluster(&cluster.urls())
        .await
        .expect("the store starts");
    let policies = tollgate::PolicySet::from(
        tollgate::Policy::fixed_window("release", 10, Duration::from_secs(600)).unwrap(),
    );
    for n in 0..30 {
        let key = tollgate::Key::new(format!("user:{n}"));
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    }
    (store, policies)
}

/// Each of `users` decided once (in turn) through `store`, within 10 s: what is left,
/// or the error.
#[cfg(feature = "redis")]
async fn remaining_after(
    store: &tollgate::store::RedisStore,
    policies: &tollgate::PolicySet,
    users: impl Iterator<Item = &String>,
) -> Vec<Result<u64, String>> {
    let mut outcomes = Vec::new();
    for user in users {
        let key = tollgate::Key::new(user.clone());
        let decided =
            tokio::time::timeout(Duration::from_secs(10), store.decide(&key, policies, 1))
                .await
                .expect("answered");
        outcomes.push(
            decided
                .map(|d| d.statuses()[0].remaining)
                .map_err(|e| e.to_string()),
        );
    }
    outcomes
}

/// Which of the thirty identities of [`thirty_decided`] `node` holds.
#[cfg(feature = "redis")]
fn held_by(node: &support::RedisServer) -> Vec<String> {
    (0..30)
        .map(|n| format!("user:{n}"))
        .filter(|user| {
            node.cli(&["--scan", "--pattern", &format!("tollgate:{{{user}}}*")])
                .contains("tollgate")
        })
        .collect()
}

// A new release's library is missing on every node, and one primary cannot answer (its
// process stopped): the load, which must reach every primary, fails on that one. The
// identities of the other primaries were refused with it (a decision on a sound node
// failed as the store failing), and each request queued for the load sent its own, one
// after another. A call whose load failed on I/O runs as a script on its own node.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_load_one_primary_cannot_answer_leaves_the_others_deciding() {
    let cluster = support::RedisCluster::start(3);
    let (store, policies) = thirty_decided(&cluster).await;
    // The identities of a primary that keeps answering.
    let frozen = &cluster.nodes[0];
    let on_frozen = held_by(frozen);
    let elsewhere: Vec<String> = (0..30)
        .map(|n| format!("user:{n}"))
        .filter(|user| !on_frozen.contains(user))
        .collect();
    assert!(
        elsewhere.len() >= 6,
        "identities of the other primaries: {elsewhere:?}"
    );
    // A second replica of the app, whose requests give up on the store well before a
    // server's silence is an error (the layer's store timeout is 50 ms): its first load
    // is dropped unended (counted as failed: calls run as scripts for a minute), and the
    // next attempt is decided, exactly.
    let hasty = tollgate::store::RedisStore::connect_cluster(&cluster.urls())
        .await
        .unwrap();
    for node in &cluster.nodes {
        assert_eq!(node.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
    }
    let scripts_run = || -> u64 {
        cluster.nodes[1..]
            .iter()
            .map(|node| {
                support::command_calls(node, "eval") + support::command_calls(node, "evalsha")
            })
            .sum()
    };
    let scripts_before = scripts_run();
    frozen.signal("STOP");
    let key = tollgate::Key::new(elsewhere[5].clone());
    let mut attempts = 0;
    let decision = loop {
        attempts += 1;
        assert!(attempts <= 10, "no decision in 10 attempts of 200 ms");
        let attempt = hasty.decide(&key, &policies, 1);
        if let Ok(decided) = tokio::time::timeout(Duration::from_millis(200), attempt).await {
            break decided.unwrap_or_else(|error| panic!("{error}"));
        }
    };
    assert!(decision.is_allowed());
    assert_eq!(decision.statuses()[0].remaining, 8, "exact");
    assert!(
        scripts_run() > scripts_before,
        "the attempt after the dropped load ran as a script"
    );
    let mut decided = 0;
    for user in &elsewhere[..5] {
        let key = tollgate::Key::new(user.clone());
        let decision =
            tokio::time::timeout(Duration::from_secs(30), store.decide(&key, &policies, 1))
                .await
                .expect("answered");
        match decision {
            Ok(decision) => {
                assert!(decision.is_allowed(), "{user}");
                assert_eq!(decision.statuses()[0].remaining, 8, "{user}: exact");
                decided += 1;
            }
            Err(error) => panic!("{user}, on a primary that answers: {error}"),
        }
    }
    frozen.signal("CONT");
    assert_eq!(decided, 5);
}

// A user who may run the library's functions but no scripts (no `EVAL`, `EVALSHA`), on
// a Cluster: one primary lost the library (a restart without persistence) while another
// stopped answering, so the load, which must reach every primary, failed on I/O. The
// store then ran scripts for a minute, which this user may not run: every decision on
// every primary was refused (`NOPERM ... 'evalsha'`), on the sound primary too, whose
// function was there all along.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_leaves_a_user_without_scripts_on_functions() {
    let cluster = support::RedisCluster::start(3);
    for node in &cluster.nodes {
        let refused = node.cli(&["ACL", "SETUSER", "default", "-evalsha", "-eval"]);
        assert!(refused.contains("OK"), "{refused}");
    }
    let (store, policies) = thirty_decided(&cluster).await;
    let (emptied, frozen, sound) = (&cluster.nodes[0], &cluster.nodes[1], &cluster.nodes[2]);
    let (lost, kept) = (held_by(emptied), held_by(sound));
    assert!(!lost.is_empty() && kept.len() >= 3, "{lost:?} {kept:?}");
    assert_eq!(emptied.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
    frozen.signal("STOP");
    // The emptied primary's identity: its load waits on the stopped primary, and the
    // request gives up (as a layer's store timeout does).
    let key = tollgate::Key::new(lost[0].clone());
    let given_up =
        tokio::time::timeout(Duration::from_millis(200), store.decide(&key, &policies, 1)).await;
    assert!(
        given_up.is_err(),
        "the load cannot end while a primary is stopped"
    );
    let outcomes = remaining_after(&store, &policies, kept[..3].iter()).await;
    // The emptied primary's identities meanwhile: the load that could not end reached
    // it, so they are decided there, exactly, with no load sent again.
    let loads_before = support::command_sent(sound, "function|load");
    let decided_lost = remaining_after(&store, &policies, lost.iter().cycle().take(3)).await;
    let loads_sent = support::command_sent(sound, "function|load") - loads_before;
    frozen.signal("CONT");
    assert_eq!(
        outcomes,
        vec![Ok(8); 3],
        "the sound primary decides by its function"
    );
    let expected: Vec<Result<u64, String>> = match lost.len() {
        1 => vec![Ok(8), Ok(7), Ok(6)],
        2 => vec![Ok(8), Ok(8), Ok(7)],
        _ => vec![Ok(8); 3],
    };
    assert_eq!(decided_lost, expected);
    assert_eq!(loads_sent, 0, "no load per call");
}

// A Cluster primary lost the library (a restart without persistence): the load reaches
// every primary, and those that kept it compiled the whole library again (`FUNCTION LOAD
// REPLACE`: about a millisecond of each server's time, once per replica of the app that
// met the loss). The same name is the same text: a primary that has it refuses the load
// at once, and that refusal means loaded.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_does_not_replace_the_library_where_a_primary_has_it() {
    let cluster = support::RedisCluster::start(3);
    let (store, policies) = thirty_decided(&cluster).await;
    let emptied = &cluster.nodes[0];
    let lost = held_by(emptied)
        .pop()
        .expect("an identity on the first primary");
    assert_eq!(emptied.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
    for node in &cluster.nodes {
        assert_eq!(node.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
    }
    let decision = store
        .decide(&tollgate::Key::new(lost.clone()), &policies, 1)
        .await
        .unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(
        decision.statuses()[0].remaining,
        8,
        "exact, by the function"
    );
    assert_eq!(
        support::command_calls(emptied, "function|load"),
        1,
        "loaded there"
    );
    for node in &cluster.nodes[1..] {
        assert_eq!(
            support::command_calls(node, "function|load"),
            0,
            "a primary that has the library does not load it again"
        );
    }
}
