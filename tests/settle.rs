//! Reserve, then settle: costs known only after the response, refunds by outcome, and
//! in-flight limits released however a request ends. In-process store, manual clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::get;
use http::{HeaderValue, StatusCode};
use http_body_util::BodyExt;
use tollgate::clock::ManualClock;
use tollgate::cost::{FromExtension, RequestCost};
use tollgate::key::HeaderKey;
use tollgate::settle::{ActualCost, Settle};
use tollgate::{
    Adjustment, FailureMode, Key, LocalFallback, MemoryStore, Policy, PolicySet, Rate,
    RateLimitLayer, Store,
};
use tower::ServiceExt;

fn store() -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    (MemoryStore::builder().clock(clock.clone()).build(), clock)
}

/// A request for `key` whose reservation is `reserve` and whose handler reports `used`.
fn request(key: &str, reserve: u64, used: Option<u64>, status: u16) -> Request {
    let mut request = Request::get("/")
        .header("x-api-key", key)
        .header("x-used", used.map_or("none".to_owned(), |u| u.to_string()))
        .header("x-status", status.to_string())
        .body(Body::empty())
        .unwrap();
    request.extensions_mut().insert(RequestCost(reserve));
    request
}

/// Answers with the status in `x-status` and the cost in `x-used` echoed as
/// `x-tokens-used` (absent when it is "none").
async fn echo(request: Request) -> http::Response<Body> {
    let status: u16 = request.headers()["x-status"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut response = http::Response::new(Body::from("done"));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    let used = request.headers()["x-used"].clone();
    if used != "none" {
        response.headers_mut().insert("x-tokens-used", used);
    }
    response
}

fn tokens() -> Policy {
    // Refills one token a minute: a test's few manual seconds refill nothing.
    Policy::token_bucket("tokens", 1_000, Rate::per_minute(1)).unwrap()
}

fn app<St: Store + Clone>(store: St, policy: Policy, settle: Settle) -> Router {
    Router::new().route("/", get(echo)).layer(
        RateLimitLayer::new(store)
            .policy(policy)
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .settle(settle),
    )
}

fn remaining(response: &http::Response<Body>) -> u64 {
    let field = response.headers()["ratelimit"].to_str().unwrap();
    let r = field.split(";r=").nth(1).unwrap();
    r.split(';').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn the_response_headers_show_the_settled_charge() {
    let (store, _clock) = store();
    let app = app(
        store.clone(),
        tokens(),
        Settle::from_header("X-Tokens-Used"),
    );
    // Reserve 100, use 4: the response already says 996 (draft-11 section 4.1, `r`).
    let response = app
        .clone()
        .oneshot(request("a", 100, Some(4), 200))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-tokens-used"], "4");
    assert_eq!(remaining(&response), 996);
    let policies = PolicySet::from(tokens());
    assert_eq!(
        store.check("x-api-key:missing", &policies, 0).statuses()[0].remaining,
        1000
    );
    // No actual cost named: the reservation stands.
    let response = app
        .clone()
        .oneshot(request("a", 50, None, 200))
        .await
        .unwrap();
    assert_eq!(remaining(&response), 946);
    // An actual cost above the reservation is charged.
    let response = app
        .clone()
        .oneshot(request("a", 10, Some(30), 200))
        .await
        .unwrap();
    assert_eq!(remaining(&response), 916);
    let response = app
        .clone()
        .oneshot(request("a", 900, Some(5_000), 200))
        .await
        .unwrap();
    assert_eq!(
        remaining(&response),
        0,
        "the excess is owed; r is never below 0"
    );
}

/// Post-paid: a reservation of 0 (nothing is stored for it) settled to what the handler
/// reports. The in-process store once dropped a charge for an identity it did not hold,
/// so every such request was free.
#[tokio::test]
async fn a_post_paid_request_reserving_nothing_is_charged_what_it_used() {
    let (store, _clock) = store();
    let app = app(store, tokens(), Settle::from_header("x-tokens-used"));
    let first = app
        .clone()
        .oneshot(request("post", 0, Some(400), 200))
        .await
        .unwrap();
    assert_eq!(
        remaining(&first),
        600,
        "the settled state (draft-11 section 4.1, `r`)"
    );
    for left in [200, 0] {
        let response = app
            .clone()
            .oneshot(request("post", 0, Some(400), 200))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(remaining(&response), left);
    }
    let refused = app
        .clone()
        .oneshot(request("post", 1, Some(1), 200))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// Post-paid past empty: what a request used beyond what was left is owed, and the
/// identity waits until it is paid, however little its next request reserves. Charging
/// only as far as there was room let every request after the first exhaustion through,
/// charged nothing: a token limit with no limit.
#[tokio::test]
async fn a_post_paid_excess_past_empty_is_owed() {
    let (store, clock) = store();
    clock.set(Duration::from_secs(10));
    let policy = Policy::token_bucket("tokens", 1_000, Rate::per_second(100)).unwrap();
    let app = app(store, policy, Settle::from_header("x-tokens-used"));
    for left in [600, 200, 0] {
        let response = app
            .clone()
            .oneshot(request("owes", 0, Some(400), 200))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(remaining(&response), left);
    }
    // 200 tokens are owed, and the next one refills 2.01 s from now at 100 a second:
    // Retry-After is never earlier than the end of the effective window (draft-11,
    // section 6), in whole seconds rounded up (RFC 9110, section 10.2.3).
    let refused = app
        .clone()
        .oneshot(request("owes", 0, Some(400), 200))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "3");
    clock.advance(Duration::from_secs(3));
    let paid = app
        .clone()
        .oneshot(request("owes", 0, Some(0), 200))
        .await
        .unwrap();
    assert_eq!(paid.status(), StatusCode::OK);
    assert_eq!(remaining(&paid), 100);
    // A reported cost far beyond the quota is owed up to one whole quota past what was
    // left: one absurd number does not lock a client out for longer than one quota's wait.
    clock.advance(Duration::from_secs(10));
    let absurd = app
        .clone()
        .oneshot(request("owes", 0, Some(u64::MAX / 2), 200))
        .await
        .unwrap();
    assert_eq!(absurd.status(), StatusCode::OK);
    let refused = app
        .clone()
        .oneshot(request("owes", 0, Some(0), 200))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "11");
}

#[tokio::test]
async fn server_errors_are_refunded_in_full() {
    let (store, _clock) = store();
    let settle = Settle::from_header("x-tokens-used").refund_if(|status| status.is_server_error());
    let app = app(store, tokens(), settle);
    let response = app
        .clone()
        .oneshot(request("a", 100, Some(40), 500))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(remaining(&response), 1000);
    // A 4xx is not refunded: it is settled like any answer.
    let response = app
        .clone()
        .oneshot(request("a", 100, Some(40), 404))
        .await
        .unwrap();
    assert_eq!(remaining(&response), 960);
    // Only refunds, no settling: reservations stand unless refunded.
    let (store, _clock) = self::store();
    let app = self::app(
        store,
        tokens(),
        Settle::reserved().refund_if(|status| status == StatusCode::SERVICE_UNAVAILABLE),
    );
    let response = app
        .clone()
        .oneshot(request("b", 70, Some(1), 200))
        .await
        .unwrap();
    assert_eq!(remaining(&response), 930);
    let response = app
        .clone()
        .oneshot(request("b", 70, Some(1), 503))
        .await
        .unwrap();
    assert_eq!(remaining(&response), 930);
}

#[tokio::test]
async fn actual_costs_from_an_extension_or_a_closure() {
    let (store, _clock) = store();
    let app = Router::new()
        .route(
            "/",
            get(|| async { (axum::Extension(ActualCost(7)), "rows").into_response_parts_ok() }),
        )
        .layer(
            RateLimitLayer::new(store.clone())
                .policy(tokens())
                .key(HeaderKey::new("x-api-key"))
                .cost(FromExtension::or(1))
                .settle(Settle::from_extension()),
        );
    let response = app.oneshot(request("a", 20, None, 200)).await.unwrap();
    assert_eq!(remaining(&response), 993);

    let calls = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&calls);
    let settle = Settle::from_fn(move |head| {
        seen.fetch_add(1, Ordering::SeqCst);
        let used: u64 = head
            .headers()
            .get("x-tokens-used")?
            .to_str()
            .ok()?
            .parse()
            .ok()?;
        Some(used * 2)
    });
    let app = self::app(store, tokens(), settle);
    let response = app.oneshot(request("b", 20, Some(3), 200)).await.unwrap();
    assert_eq!(remaining(&response), 994);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// `(extension, body)` as a response, without the handler signature gymnastics.
trait OkResponse {
    fn into_response_parts_ok(self) -> axum::response::Response;
}

impl<T: axum::response::IntoResponse> OkResponse for T {
    fn into_response_parts_ok(self) -> axum::response::Response {
        self.into_response()
    }
}

/// Units left after a request reserving 30 whose response says `x-tokens-used` with
/// `values`, one field line each.
async fn left_after_reporting(values: &'static [&'static str]) -> u64 {
    let (store, _clock) = store();
    let app = Router::new()
        .route(
            "/",
            get(move || async move {
                let mut response = http::Response::new(Body::from("x"));
                for value in values {
                    response
                        .headers_mut()
                        .append("x-tokens-used", HeaderValue::from_static(value));
                }
                response
            }),
        )
        .layer(
            RateLimitLayer::new(store)
                .policy(tokens())
                .key(HeaderKey::new("x-api-key"))
                .cost(FromExtension::or(1))
                .settle(Settle::from_header("x-tokens-used")),
        );
    let response = app.oneshot(request("a", 30, None, 200)).await.unwrap();
    remaining(&response)
}

#[tokio::test]
async fn a_malformed_actual_cost_keeps_the_reservation() {
    assert_eq!(left_after_reporting(&["-5"]).await, 970);
}

/// An actual cost too large for a 64-bit count is as large as one can be (a charge, to at
/// most one whole quota owed), as a `Content-Length` that large is; read as malformed, it
/// kept the reservation, under-charging whatever the upstream reported. Of several
/// values, the largest counts (an upstream that said two things is not taken at the
/// smaller).
#[tokio::test]
async fn a_huge_or_repeated_actual_cost_is_charged_not_dropped() {
    assert_eq!(left_after_reporting(&["99999999999999999999"]).await, 0);
    assert_eq!(left_after_reporting(&["3", "700"]).await, 300);
    // Folded into one line by an intermediary (RFC 9110 section 5.3).
    assert_eq!(left_after_reporting(&["3, 700"]).await, 300);
}

#[test]
fn settles_give_back_only_what_the_state_still_holds() {
    let (store, clock) = store();
    let second = Duration::from_secs(1);
    let cases = [
        Policy::fixed_window("fw", 10, Duration::from_secs(10)).unwrap(),
        Policy::sliding_log("sl", 10, Duration::from_secs(10)).unwrap(),
        Policy::sliding_window("sw", 10, Duration::from_secs(10)).unwrap(),
        Policy::sliding_window_split("sw5", 10, Duration::from_secs(10), 5).unwrap(),
        Policy::token_bucket("tb", 10, Rate::new(1, Duration::from_secs(3600))).unwrap(),
        Policy::leaky_bucket("lb", 10, Rate::new(1, Duration::from_secs(3600))).unwrap(),
        Policy::gcra("gc", Rate::new(1, Duration::from_secs(3600)), 10).unwrap(),
    ];
    for policy in cases {
        let name = policy.name().to_owned();
        let set = PolicySet::from(policy);
        let key = format!("key-{name}");
        // Reserve 8, settle to 3 a second later: 5 come back.
        let reserved = store.check(&key, &set, 8);
        assert_eq!(reserved.statuses()[0].remaining, 2, "{name}");
        clock.advance(second);
        let settled = store.adjust_now(&key, &set, &Adjustment::settle(8, 3, reserved.receipt()));
        assert_eq!(settled.statuses()[0].remaining, 7, "{name}");
        // A second settle of the same receipt cannot give back more than is held.
        let again = store.adjust_now(&key, &set, &Adjustment::settle(7, 0, reserved.receipt()));
        assert!(again.statuses()[0].remaining <= 10, "{name}");
    }
    // A fixed window that has ended is not reopened: the refund is void.
    let set = PolicySet::from(Policy::fixed_window("fw2", 10, Duration::from_secs(10)).unwrap());
    clock.set(Duration::from_secs(100));
    let reserved = store.check("late", &set, 6);
    clock.set(Duration::from_secs(111));
    store.check("late", &set, 9);
    let settled = store.adjust_now("late", &set, &Adjustment::settle(6, 0, reserved.receipt()));
    assert_eq!(
        settled.statuses()[0].remaining,
        1,
        "the new window keeps its 9"
    );
    // A sliding log entry that has left the window gives nothing back.
    let set = PolicySet::from(Policy::sliding_log("sl2", 10, Duration::from_secs(10)).unwrap());
    clock.set(Duration::from_secs(200));
    let reserved = store.check("gone", &set, 6);
    clock.set(Duration::from_secs(211));
    store.check("gone", &set, 4);
    let settled = store.adjust_now("gone", &set, &Adjustment::settle(6, 0, reserved.receipt()));
    assert_eq!(settled.statuses()[0].remaining, 6);
    // A bucket is never filled above full.
    let set = PolicySet::from(Policy::token_bucket("tb2", 10, Rate::per_second(1)).unwrap());
    let reserved = store.check("full", &set, 5);
    clock.advance(Duration::from_secs(60));
    let settled = store.adjust_now("full", &set, &Adjustment::settle(5, 0, reserved.receipt()));
    assert_eq!(settled.statuses()[0].remaining, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_settles_charge_exactly_the_actual_costs() {
    // 64 tasks reserve and settle at once against one key. With no refill during the
    // test, what the bucket lost must be exactly the sum of the settled (actual) costs
    // of the admitted requests: never more, never less, never below empty.
    let store = MemoryStore::new();
    let policy =
        Policy::token_bucket("tokens", 50_000, Rate::new(1, tollgate::policy::MAX_PERIOD)).unwrap();
    let app = app(
        store.clone(),
        policy.clone(),
        Settle::from_header("x-tokens-used").refund_if(|status| status.is_server_error()),
    );
    let charged = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64u64 {
        let (app, charged, admitted) = (app.clone(), Arc::clone(&charged), Arc::clone(&admitted));
        tasks.push(tokio::spawn(async move {
            let mut seed = task.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for _ in 0..40 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let reserve = 1 + seed % 60;
                let used = seed / 61 % (reserve + 1);
                let status = if seed % 7 == 0 { 500 } else { 200 };
                let response = app
                    .clone()
                    .oneshot(request("shared", reserve, Some(used), status))
                    .await
                    .unwrap();
                if response.status() == StatusCode::TOO_MANY_REQUESTS {
                    continue;
                }
                admitted.fetch_add(1, Ordering::SeqCst);
                if status == 200 {
                    charged.fetch_add(used, Ordering::SeqCst);
                }
                response.into_body().collect().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let left = store
        .check("x-api-key:unused", &PolicySet::from(policy.clone()), 0)
        .statuses()[0]
        .remaining;
    assert_eq!(left, 50_000, "an untouched key is full");
    let key = HeaderKey::new("x-api-key");
    let mut probe = http::Request::get("/")
        .header("x-api-key", "shared")
        .body(())
        .unwrap();
    let shared = tollgate::key::KeyExtractor::extract(&key, &probe.clone().into_parts().0).unwrap();
    let _ = &mut probe;
    let state = store.check(shared.as_str(), &PolicySet::from(policy), 0);
    assert!(admitted.load(Ordering::SeqCst) > 2_000);
    assert_eq!(
        50_000 - state.statuses()[0].remaining,
        charged.load(Ordering::SeqCst)
    );
}

fn inflight_app(store: MemoryStore<ManualClock>, gate: Arc<tokio::sync::Semaphore>) -> Router {
    Router::new()
        .route(
            "/",
            get(move |request: Request| {
                let gate = Arc::clone(&gate);
                async move {
                    match request.headers().get("x-mode").map(|v| v.to_str().unwrap()) {
                        Some("panic") => panic!("the handler failed"),
                        Some("wait") => {
                            let _permit = gate.acquire().await.unwrap();
                            "waited".into_response_parts_ok()
                        }
                        _ => "quick".into_response_parts_ok(),
                    }
                }
            }),
        )
        .layer(
            RateLimitLayer::new(store)
                .policy(Policy::concurrency("inflight", 2).unwrap())
                .key(HeaderKey::new("x-api-key")),
        )
}

fn inflight_request(mode: &str) -> Request {
    Request::get("/")
        .header("x-api-key", "team")
        .header("x-mode", mode)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn in_flight_slots_are_released_however_a_request_ends() {
    let (store, clock) = store();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let app = inflight_app(store.clone(), Arc::clone(&gate));

    // Two responses whose bodies are not read yet hold both slots.
    let first = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    let second = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // draft-11: the quota unit is sent as qu="concurrent-requests", with no window.
    assert_eq!(
        first.headers()["ratelimit-policy"],
        "\"inflight\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(first.headers()["ratelimit"], "\"inflight\";r=1");
    assert_eq!(second.headers()["ratelimit"], "\"inflight\";r=0");
    let third = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()["retry-after"], "1");

    // A body read to its end frees its slot.
    first.into_body().collect().await.unwrap();
    let fourth = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    // A body dropped unread (the client went away mid-stream) frees its slot.
    drop(second);
    drop(fourth);

    // A handler that panics frees its slot.
    let panicking = tokio::spawn(app.clone().oneshot(inflight_request("panic")));
    assert!(panicking.await.unwrap_err().is_panic());
    // A request dropped before its response (a timeout, a client gone) frees its slot.
    let slow = app.clone().oneshot(inflight_request("wait"));
    let timed_out = tokio::time::timeout(Duration::from_millis(20), slow).await;
    assert!(timed_out.is_err());

    // All slots are free again: two at once, then a third is refused.
    let a = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    let b = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    let c = app
        .clone()
        .oneshot(inflight_request("quick"))
        .await
        .unwrap();
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(c.status(), StatusCode::TOO_MANY_REQUESTS);
    drop((a, b));
    // Nothing leaked: once everything ended and a lease has passed, the key's state is
    // fresh again and purged.
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.purge_fresh(), 1);
    assert!(store.is_empty());
}

#[test]
fn in_flight_policies_count_requests_not_costs() {
    let (store, _clock) = store();
    let set = PolicySet::new([
        Policy::concurrency("inflight", 2).unwrap(),
        Policy::token_bucket("tokens", 100, Rate::per_minute(1)).unwrap(),
    ])
    .unwrap();
    let a = store.check("k", &set, 40);
    let b = store.check("k", &set, 40);
    assert!(a.is_allowed() && b.is_allowed());
    assert_eq!(a.statuses()[0].remaining, 1);
    assert_eq!(b.statuses()[1].remaining, 20);
    // The third is refused by the in-flight limit, and debits nothing (all-or-nothing).
    let c = store.check("k", &set, 10);
    assert!(!c.is_allowed());
    assert_eq!(c.statuses()[1].remaining, 20);
    // Releasing frees the slot and leaves the tokens alone.
    let released = store.adjust_now("k", &set, &Adjustment::release(40, a.receipt()));
    assert_eq!(released.statuses()[0].remaining, 1);
    assert_eq!(released.statuses()[1].remaining, 20);
    // A request of cost 0 takes no slot.
    assert_eq!(store.check("k", &set, 0).statuses()[0].remaining, 1);
}

#[tokio::test]
async fn a_fallback_decision_is_settled_and_released_in_the_fallback() {
    // The store refuses everything; the local fallback decides, and the settle and the
    // release go to the fallback's own state.
    let fallback = LocalFallback::new();
    let app = Router::new().route("/", get(echo)).layer(
        RateLimitLayer::new(Refusing)
            .policies(
                PolicySet::new([tokens(), Policy::concurrency("inflight", 1).unwrap()]).unwrap(),
            )
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .on_store_error(FailureMode::Fallback(fallback.clone()))
            .settle(Settle::from_header("x-tokens-used")),
    );
    let response = app
        .clone()
        .oneshot(request("a", 100, Some(10), 200))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains("r=990")
    );
    response.into_body().collect().await.unwrap();
    // The slot came back, in the fallback.
    let response = app
        .clone()
        .oneshot(request("a", 100, Some(10), 200))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains("r=980")
    );
}

/// A store that is always away.
#[derive(Clone)]
struct Refusing;

impl Store for Refusing {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }

    // A store that is down: it adjusts when it is up (its `adjust` fails as its
    // decisions do, and the fallback settles what it decided).
    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(&self, _: &Key, _: &PolicySet, _: &tollgate::Adjustment) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }
}

#[tokio::test]
async fn slots_taken_in_the_fallback_while_the_breaker_is_open_are_freed() {
    // The store refuses everything; the breaker opens after the first failure, so later
    // requests skip the store and the fallback decides (and holds the slots).
    let fallback = LocalFallback::new();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(Refusing)
            .policy(Policy::concurrency("inflight", 1).unwrap())
            .key(HeaderKey::new("x-api-key"))
            .on_store_error(FailureMode::Fallback(fallback.clone()))
            .circuit_breaker(tollgate::CircuitBreaker::new(1, Duration::from_secs(3600))),
    );
    let call = || {
        app.clone().oneshot(
            Request::get("/")
                .header("x-api-key", "a")
                .body(Body::empty())
                .unwrap(),
        )
    };
    for round in 0..5 {
        let response = call().await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "round {round}: the slot came back"
        );
        // While it is held, a second request is refused...
        assert_eq!(
            call().await.unwrap().status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        // ...and once its body is done, the slot is free.
        response.into_body().collect().await.unwrap();
    }
}

#[test]
fn a_bucket_gives_back_no_more_than_it_could_have_held() {
    // Reserve the whole bucket, let half of it refill, spend that, then settle the first
    // request to nothing: what refilled meanwhile was not kept by a full bucket, so only
    // the rest comes back (an exact replay with the actual cost would hold no more).
    let (store, clock) = store();
    for policy in [
        Policy::token_bucket("tb", 10, Rate::per_second(1)).unwrap(),
        Policy::gcra("gc", Rate::per_second(1), 10).unwrap(),
    ] {
        let set = PolicySet::from(policy);
        let key = set[0].name().to_owned();
        let reserved = store.check(&key, &set, 10);
        assert!(reserved.is_allowed());
        clock.advance(Duration::from_secs(5));
        assert!(store.check(&key, &set, 5).is_allowed());
        let settled = store.adjust_now(&key, &set, &Adjustment::settle(10, 0, reserved.receipt()));
        assert_eq!(settled.statuses()[0].remaining, 5, "{key}");
    }
    // Knowing what the debit left, a settle is exact: spend 4, reserve 3, two seconds
    // refill 2, settle the 3 to nothing: 8 left, as if only the 4 had been spent.
    for (index, policy) in [
        Policy::token_bucket("tb-exact", 10, Rate::per_second(1)).unwrap(),
        Policy::gcra("gc-exact", Rate::per_second(1), 10).unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let set = PolicySet::from(policy);
        let key = format!("exact-{index}");
        assert!(store.check(&key, &set, 4).is_allowed());
        let reserved = store.check(&key, &set, 3);
        clock.advance(Duration::from_secs(2));
        let left = reserved.statuses().iter().map(|status| status.remaining);
        let exact = Adjustment::settle(3, 0, reserved.receipt()).with_left(left);
        assert_eq!(
            store.adjust_now(&key, &set, &exact).statuses()[0].remaining,
            8,
            "{key}"
        );
    }
}

#[tokio::test]
async fn a_shadow_layer_that_settles_still_sends_no_headers() {
    let (store, _clock) = store();
    let app = Router::new().route("/", get(echo)).layer(
        RateLimitLayer::new(store)
            .policy(tokens())
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .settle(Settle::from_header("x-tokens-used"))
            .shadow(true),
    );
    let response = app.oneshot(request("a", 100, Some(4), 200)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(!response.headers().contains_key("ratelimit"));
    assert!(!response.headers().contains_key("ratelimit-policy"));
}

#[test]
fn in_flight_and_rate_state_of_one_key_keep_each_other() {
    // One key under two sets (the gateway's tokens and its streams): freeing a slot must
    // not let the drained bucket be forgotten, nor a settle the slots.
    let (store, clock) = store();
    let tokens_set = PolicySet::from(tokens());
    let streams = PolicySet::from(Policy::concurrency("inflight", 1).unwrap());
    let stream = store.check("k", &streams, 1);
    let spent = store.check("k", &tokens_set, 1_000);
    assert!(stream.is_allowed() && spent.is_allowed());
    store.adjust_now(
        "k",
        &tokens_set,
        &Adjustment::settle(1_000, 999, spent.receipt()),
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        store.purge_fresh(),
        0,
        "the slot and the bucket are both live"
    );
    assert!(
        !store.check("k", &streams, 1).is_allowed(),
        "the slot is still held"
    );
    store.adjust_now("k", &streams, &Adjustment::release(1, stream.receipt()));
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.purge_fresh(), 0, "the bucket is still drained");
    assert!(!store.check("k", &tokens_set, 100).is_allowed());
}

#[test]
fn a_reset_keeps_the_slots_of_requests_still_running() {
    let (store, _clock) = store();
    let set = PolicySet::from(Policy::concurrency("inflight", 2).unwrap());
    let a = store.check("k", &set, 1);
    let b = store.check("k", &set, 1);
    store.reset_now("k", &set);
    assert!(
        !store.check("k", &set, 1).is_allowed(),
        "both slots still held"
    );
    store.adjust_now("k", &set, &Adjustment::release(1, a.receipt()));
    store.adjust_now("k", &set, &Adjustment::release(1, b.receipt()));
    assert!(store.check("k", &set, 1).is_allowed());
    assert!(store.check("k", &set, 1).is_allowed());
    assert!(
        !store.check("k", &set, 1).is_allowed(),
        "never more than 2 in flight"
    );
}

#[test]
fn the_memory_store_keeps_a_slot_while_its_request_runs_past_the_lease() {
    // In process a slot is given back when its request ends, however it ends: the lease
    // is for shared stores, whose holders may die. A stream longer than the lease keeps
    // its slot, whether memory is purged or the store must make room.
    let (store, clock) = store();
    let streams = PolicySet::from(
        Policy::concurrency_with_lease("streams", 1, Duration::from_secs(60)).unwrap(),
    );
    let long = store.check("k", &streams, 1);
    assert!(long.is_allowed());
    clock.advance(Duration::from_secs(600));
    assert_eq!(store.purge_fresh(), 0, "the slot is held");
    assert!(
        !store.check("k", &streams, 1).is_allowed(),
        "one stream at a time, however long it runs"
    );
    store.adjust_now("k", &streams, &Adjustment::release(1, long.receipt()));
    let next = store.check("k", &streams, 1);
    assert!(next.is_allowed(), "the slot is free once the stream ends");
    assert!(!store.check("k", &streams, 1).is_allowed());
}

/// A store of one shard that holds 64 identities, on `clock`.
fn small_store(clock: &ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(64)
        .shards(1)
        .build()
}

#[test]
fn a_full_memory_store_never_forgets_a_held_slot() {
    let clock = ManualClock::new();
    let store = small_store(&clock);
    let streams = PolicySet::from(Policy::concurrency("streams", 1).unwrap());
    let long = store.check("held", &streams, 1);
    assert!(long.is_allowed());
    clock.advance(Duration::from_secs(120));
    // Other identities fill the store many times over while the stream runs.
    let spare =
        PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap());
    for i in 0..500 {
        assert!(store.check(&format!("other:{i}"), &spare, 1).is_allowed());
    }
    assert!(
        !store.check("held", &streams, 1).is_allowed(),
        "the running stream still holds the only slot"
    );
    store.adjust_now("held", &streams, &Adjustment::release(1, long.receipt()));
    assert!(store.check("held", &streams, 1).is_allowed());
}

/// The layer keeps a shaping policy out of a settle's refund with the receipt's mask of
/// the policies it did not debit, which holds the first 64: a shaping policy past them was
/// refunded, and the next request went on the same instant as the one settled. Such a set
/// is refused, as a shadow policy past the 52nd is, whether built whole or one policy at a
/// time.
#[test]
fn a_shaping_policy_past_the_64th_is_refused() {
    let windows = || {
        (0..64).map(|index| {
            Policy::fixed_window(&format!("w{index}"), 10, Duration::from_secs(60)).unwrap()
        })
    };
    let shaping = || {
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1), Duration::from_secs(10)).unwrap()
    };
    let error = PolicySet::new(windows().chain([shaping()])).unwrap_err();
    assert!(error.to_string().contains("first 64"), "{error}");
    let mut policies = windows().chain([shaping()]);
    let mut layer = RateLimitLayer::new(MemoryStore::new()).policy(policies.next().unwrap());
    for policy in policies {
        layer = layer.policy(policy);
    }
    assert!(layer.validate().unwrap_err().contains("first 64"));
    // At the 64th place it is one the mask holds.
    assert!(PolicySet::new(windows().take(63).chain([shaping()])).is_ok());
}

/// A set a resolver builds per request is not checked when the layer is built: with a
/// shaping policy past the 64th, a settle below the reservation gave its place back (the
/// receipt's mask holds the first 64). Such a settle refunds nothing: the request is
/// charged its reservation, and the schedule keeps its place.
#[tokio::test]
async fn a_per_request_set_with_a_shaping_policy_past_the_64th_refunds_nothing() {
    use tollgate::resolve::resolve_with;
    let (store, _clock) = store();
    let mut set = PolicySet::from(tokens());
    for index in 0..63 {
        set = set.with(
            Policy::fixed_window(&format!("w{index}"), 1_000, Duration::from_secs(60)).unwrap(),
        );
    }
    let set = set.with(
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1_000), Duration::from_secs(1))
            .unwrap(),
    );
    assert_eq!(set.len(), 65);
    let app = Router::new().route("/", get(echo)).layer(
        RateLimitLayer::new(store.clone())
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .resolver(resolve_with(move |_, _| set.clone()))
            .settle(Settle::from_header("X-Tokens-Used")),
    );
    let response = app
        .clone()
        .oneshot(request("wide", 10, Some(0), 200))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(remaining(&response), 990, "the reservation stays spent");
}

/// A store full of identities that hold slots forgets one of them (its bound holds), and
/// the identity's next request starts on a fresh state. The forgotten request's release
/// then took a slot off that fresh state, one a newer request held: 2 running under a
/// limit of 1. A release of a debit older than the state it reaches frees nothing.
#[test]
fn a_release_of_a_forgotten_slot_frees_no_newer_requests_slot() {
    let clock = ManualClock::new();
    let store = small_store(&clock);
    let streams = PolicySet::from(Policy::concurrency("streams", 1).unwrap());
    clock.advance(Duration::from_secs(1));
    let first = store.check("held", &streams, 1);
    assert!(first.is_allowed());
    clock.advance(Duration::from_secs(1));
    for i in 0..200 {
        assert!(store.check(&format!("other:{i}"), &streams, 1).is_allowed());
    }
    let newer = store.check("held", &streams, 1);
    assert!(
        newer.is_allowed(),
        "the first request's identity was forgotten, as documented when only holders remain"
    );
    store.adjust_now("held", &streams, &Adjustment::release(1, first.receipt()));
    assert!(
        !store.check("held", &streams, 1).is_allowed(),
        "the newer request still holds the only slot"
    );
    store.adjust_now("held", &streams, &Adjustment::release(1, newer.receipt()));
    assert!(store.check("held", &streams, 1).is_allowed());
}

/// A store that decides in memory and settles after a network's delay, counting the
/// settles that reach it, and any poll of a settle after it finished.
#[derive(Clone)]
struct SlowSettle {
    inner: MemoryStore,
    settled: Arc<AtomicU64>,
    polled_after_done: Arc<AtomicU64>,
}

/// A future that counts the polls it gets after it finished (instead of panicking).
struct Once<F> {
    future: Option<std::pin::Pin<Box<F>>>,
    late: Arc<AtomicU64>,
}

impl<F: std::future::Future> std::future::Future for Once<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            self.late.fetch_add(1, Ordering::SeqCst);
            return std::task::Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        std::task::Poll::Ready(output)
    }
}

impl Store for SlowSettle {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> tollgate::DecideFuture {
        let decision = self.inner.check(key.as_str(), policies, cost);
        tollgate::DecideFuture::new(async move { Ok(decision) })
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &Adjustment,
    ) -> tollgate::DecideFuture {
        let (inner, settled) = (self.inner.clone(), Arc::clone(&self.settled));
        let (key, policies, adjustment) = (key.clone(), policies.clone(), adjustment.clone());
        tollgate::DecideFuture::new(Once {
            future: Some(Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let decision = inner.adjust_now(key.as_str(), &policies, &adjustment);
                settled.fetch_add(1, Ordering::SeqCst);
                Ok(decision)
            })),
            late: Arc::clone(&self.polled_after_done),
        })
    }
}

#[tokio::test]
async fn a_settle_under_way_is_finished_when_its_response_is_dropped() {
    // A refund for a 503 is on its way to the store when the client goes away: it still
    // arrives, or the client is charged for a request the server failed.
    use tower::{Layer, Service};
    let store = SlowSettle {
        inner: MemoryStore::new(),
        settled: Arc::new(AtomicU64::new(0)),
        polled_after_done: Arc::new(AtomicU64::new(0)),
    };
    let policies =
        PolicySet::from(Policy::fixed_window("api", 5, Duration::from_secs(3600)).unwrap());
    let mut service = RateLimitLayer::new(store.clone())
        .policies(policies.clone())
        .key(tollgate::key::Global)
        .settle(Settle::reserved().refund_if(|status| status.is_server_error()))
        .layer(tower::service_fn(|_: Request| async {
            let mut response = axum::response::Response::new(Body::empty());
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            Ok::<_, std::convert::Infallible>(response)
        }));
    let request = Request::get("/").body(Body::empty()).unwrap();
    let future = service.ready().await.unwrap().call(request);
    // The client gives up while the refund is under way.
    assert!(
        tokio::time::timeout(Duration::from_millis(5), future)
            .await
            .is_err(),
        "still settling"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        store.settled.load(Ordering::SeqCst),
        1,
        "the refund arrived"
    );
    assert_eq!(
        store.inner.check("global", &policies, 0).statuses()[0].remaining,
        5,
        "nothing is charged for the failed request"
    );
    // A response whose settle finished before it was sent leaves nothing behind: the
    // finished settle is not run again when the future is dropped (polling a finished
    // async block panics, in a task nobody watches: counted here by a panic hook).
    static RESUMED: AtomicU64 = AtomicU64::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.to_string().contains("after completion") {
            RESUMED.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    let request = Request::get("/").body(Body::empty()).unwrap();
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(store.settled.load(Ordering::SeqCst), 2);
    assert_eq!(store.polled_after_done.load(Ordering::SeqCst), 0);
    assert_eq!(
        RESUMED.load(Ordering::SeqCst),
        0,
        "a finished settle was run again"
    );
}

/// A shaping policy spaces requests as they are sent: a request's units there are its
/// place in the schedule, which it has taken by the time its response is settled. A
/// refund of them (a 503 refunded) let the next request go at once, on the same instant
/// as the one refunded: a refund leaves a shaping policy as the request was sent, and
/// changes the other policies. A charge above the reservation is the shaping policy's
/// too: the requests decided after wait for what the request used.
#[tokio::test(start_paused = true)]
async fn a_settle_never_puts_two_shaped_requests_on_one_instant() {
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&sent);
    let started = tokio::time::Instant::now();
    let handler = move |request: Request| {
        let log = Arc::clone(&log);
        async move {
            log.lock().unwrap().push(started.elapsed());
            echo(request).await
        }
    };
    let store = MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build();
    let paced = Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap();
    let app = Router::new().route("/", get(handler)).layer(
        RateLimitLayer::new(store)
            .policies(PolicySet::new([paced, tokens()]).unwrap())
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .settle(Settle::from_header("x-tokens-used").refund_if(|status| status == 503)),
    );
    // Refunded (a 503): the tokens are given back, the schedule stands. Then charged 3
    // where 1 was reserved: the next request waits for 3 units after it (10 s + 30 s).
    let refunded = app
        .clone()
        .oneshot(request("a", 1, Some(1), 503))
        .await
        .unwrap();
    assert_eq!(refunded.status(), StatusCode::SERVICE_UNAVAILABLE);
    let charged = app
        .clone()
        .oneshot(request("a", 1, Some(3), 200))
        .await
        .unwrap();
    assert_eq!(charged.status(), StatusCode::OK);
    let third = app
        .clone()
        .oneshot(request("a", 1, Some(1), 200))
        .await
        .unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    let sent = sent.lock().unwrap().clone();
    assert_eq!(
        sent,
        [0, 10, 40].map(Duration::from_secs),
        "one unit every 10 s"
    );
    // The other policy was settled: 1,000 less 0 (refunded), 3 and 1.
    let field = third.headers()["ratelimit"].to_str().unwrap();
    assert!(field.contains("\"tokens\";r=996;"), "{field}");
}

/// A request that gets no response head (its client gone or an outer timeout dropped it
/// while the handler ran, or the inner service failed) is never settled: it pays what it
/// reserved. Post-paid with nothing reserved, a client that cancels every request just
/// before its head paid nothing for the work it caused. `Settle::if_dropped` charges such
/// a request a number of units instead; a request dropped during its shaping delay was
/// never sent, and is not charged.
#[tokio::test]
async fn a_request_dropped_before_its_head_pays_what_if_dropped_says() {
    let hangs = |settle: Settle, store: MemoryStore<ManualClock>| {
        Router::new()
            .route(
                "/",
                get(|| async {
                    std::future::pending::<()>().await;
                    "never"
                }),
            )
            .layer(
                RateLimitLayer::new(store)
                    .policy(tokens())
                    .key(HeaderKey::new("x-api-key"))
                    .cost(FromExtension::or(1))
                    .settle(settle),
            )
    };
    let left = |store: &MemoryStore<ManualClock>, key: &str| {
        let parts = http::Request::get("/")
            .header("x-api-key", key)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let key =
            tollgate::key::KeyExtractor::extract(&HeaderKey::new("x-api-key"), &parts).unwrap();
        store
            .check(key.as_str(), &PolicySet::from(tokens()), 0)
            .statuses()[0]
            .remaining
    };
    // Dropped by an outer timeout while the handler runs: 500 units, or what it reserved
    // when that is more.
    for (reserve, settle, expected) in [
        (0, Settle::from_header("x-tokens-used"), 1_000),
        (0, Settle::from_header("x-tokens-used").if_dropped(500), 500),
        (50, Settle::from_header("x-tokens-used"), 950),
        (
            50,
            Settle::from_header("x-tokens-used").if_dropped(500),
            500,
        ),
        // Never less than it reserved: a bound reserved is not cut by cancelling.
        (
            800,
            Settle::from_header("x-tokens-used").if_dropped(500),
            200,
        ),
    ] {
        let (store, _clock) = store();
        let app = hangs(settle, store.clone());
        let sent = app.oneshot(request("gone", reserve, None, 200));
        let timed_out = tokio::time::timeout(Duration::from_millis(20), sent).await;
        assert!(timed_out.is_err(), "the handler never answers");
        assert_eq!(left(&store, "gone"), expected, "reserved {reserve}");
    }
    // Answered: settled as the head says, not charged as dropped.
    let (store, _clock) = self::store();
    let answered = app(
        store.clone(),
        tokens(),
        Settle::from_header("x-tokens-used").if_dropped(500),
    )
    .oneshot(request("answered", 0, Some(30), 200))
    .await
    .unwrap();
    assert_eq!(remaining(&answered), 970);
    drop(answered);
    assert_eq!(
        left(&store, "answered"),
        970,
        "its body dropped after the head"
    );
    // The inner service failed (a load shedder inside the limiter, say, that never ran
    // the handler): the reservation stands, as `refund_if` says of inner errors.
    let (store, _clock) = self::store();
    let failing = tower::service_fn(|_: Request| async {
        Err::<http::Response<Body>, _>(std::io::Error::other("upstream broke"))
    });
    let limited = tower::Layer::layer(
        &RateLimitLayer::new(store.clone())
            .policy(tokens())
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1))
            .settle(Settle::from_header("x-tokens-used").if_dropped(500)),
        failing,
    );
    let failed = limited.oneshot(request("failed", 0, None, 200)).await;
    assert!(failed.is_err());
    assert_eq!(left(&store, "failed"), 1_000);
}

/// A request whose shaping delay ended but whose inner service is not ready yet (a
/// concurrency limit inside the limiter, its one permit held) was never sent: dropped
/// then, it is not charged `if_dropped`, as one dropped during its delay is not.
#[tokio::test]
async fn a_request_dropped_waiting_for_its_inner_service_is_not_charged_as_dropped() {
    let (store, _clock) = store();
    let holding = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let holding = Arc::clone(&holding);
        tower::service_fn(move |request: Request| {
            let holding = Arc::clone(&holding);
            async move {
                if request.headers().contains_key("x-hold") {
                    holding.notify_one();
                    std::future::pending::<()>().await;
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("done")))
            }
        })
    };
    let shaping =
        Policy::leaky_bucket_shaping("shape", Rate::per_second(20), Duration::from_secs(1))
            .unwrap();
    let service = tower::ServiceBuilder::new()
        .layer(
            RateLimitLayer::new(store.clone())
                .policies(PolicySet::new([shaping, tokens()]).unwrap())
                .key(HeaderKey::new("x-api-key"))
                .cost(FromExtension::or(1))
                .settle(Settle::from_header("x-tokens-used").if_dropped(500)),
        )
        .concurrency_limit(1)
        .service(handler);
    // The first request goes at once; the second waits 50 ms behind it.
    let first = service.clone().oneshot(request("k", 1, None, 200)).await;
    assert_eq!(first.unwrap().status(), StatusCode::OK);
    let second = tokio::spawn(service.clone().oneshot(request("k", 1, None, 200)));
    tokio::task::yield_now().await;
    // A request that costs nothing is not held back: it takes the one permit and keeps it.
    let mut hold = request("k", 0, None, 200);
    hold.headers_mut()
        .insert("x-hold", HeaderValue::from_static("1"));
    let held = tokio::spawn(service.clone().oneshot(hold));
    holding.notified().await;
    // The second's delay ends while the permit is held; its client gives up then.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "it waits for the permit");
    second.abort();
    let _ = second.await;
    held.abort();
    let parts = http::Request::get("/")
        .header("x-api-key", "k")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let key = tollgate::key::KeyExtractor::extract(&HeaderKey::new("x-api-key"), &parts).unwrap();
    let left = store
        .check(key.as_str(), &PolicySet::from(tokens()), 0)
        .statuses()[0]
        .remaining;
    // The first's unit, and the second's if its place could not be given back; not 500.
    assert!(left >= 998, "{left} left");
}

/// A reset (`MemoryStore::reset_now`: "the customer upgraded") or a level set
/// (`Adjustment::set_remaining`: "block this client") forgives what was debited before
/// it, and a request still running then settles later: its refund must not give back
/// units others spent since (a settle gives back only what the state still holds of its
/// debit). Before, every rate algorithm but the sliding log took the refund from the new
/// state: a limit of 10 an hour admitted 20 after a reset. (On Redis the same refund
/// still gives back: see the README, "Costs known after the response".)
#[test]
fn a_refund_of_a_debit_made_before_a_reset_or_a_set_level_gives_nothing_back() {
    let hour = Duration::from_secs(3_600);
    let sets = [
        Policy::fixed_window("fw", 10, hour).unwrap(),
        Policy::sliding_window("sw", 10, hour).unwrap(),
        Policy::sliding_window_split("split", 10, hour, 4).unwrap(),
        Policy::token_bucket("tb", 10, Rate::new(10, hour)).unwrap(),
        Policy::gcra("gc", Rate::new(10, hour), 10).unwrap(),
        Policy::sliding_log("sl", 10, hour).unwrap(),
    ]
    .map(PolicySet::from);
    for set in &sets {
        for clear in ["reset", "set"] {
            let label = format!("{} {clear}", set[0].name());
            let clock = ManualClock::new();
            clock.advance(Duration::from_secs(1_000));
            let store = MemoryStore::builder().clock(clock.clone()).build();
            // A running request reserves the whole quota.
            let running = store.check("client", set, 10);
            assert!(running.is_allowed(), "{label}");
            clock.advance(Duration::from_millis(100));
            match clear {
                "reset" => store.reset_now("client", set),
                _ => {
                    store.adjust_now("client", set, &Adjustment::set_remaining(10));
                }
            }
            // The fresh quota is spent by others.
            clock.advance(Duration::from_millis(100));
            for _ in 0..10 {
                assert!(store.check("client", set, 1).is_allowed(), "{label}");
            }
            // The running request ends having used nothing.
            clock.advance(Duration::from_millis(100));
            let left = running.statuses().iter().map(|status| status.remaining);
            let settle = Adjustment::settle(10, 0, running.receipt()).with_left(left);
            let settled = store.adjust_now("client", set, &settle);
            assert_eq!(settled.statuses()[0].remaining, 0, "{label}: {settled:?}");
            assert!(
                !store.check("client", set, 1).is_allowed(),
                "{label}: admitted past the quota"
            );
            // A request debited after a clear settles as ever, and another identity's
            // refunds are untouched by this one's clear.
            store.reset_now("client", set);
            clock.advance(Duration::from_millis(1));
            let after = store.check("client", set, 4);
            assert!(after.is_allowed(), "{label}");
            let left = after.statuses().iter().map(|status| status.remaining);
            let settle = Adjustment::settle(4, 1, after.receipt()).with_left(left);
            let settled = store.adjust_now("client", set, &settle);
            assert_eq!(settled.statuses()[0].remaining, 9, "{label}: {settled:?}");
            let other = store.check("other", set, 4);
            store.reset_now("client", set);
            let left = other.statuses().iter().map(|status| status.remaining);
            let settle = Adjustment::settle(4, 0, other.receipt()).with_left(left);
            let settled = store.adjust_now("other", set, &settle);
            assert_eq!(settled.statuses()[0].remaining, 10, "{label}: {settled:?}");
            // What a request used past its reservation was never debited, so never
            // forgiven: charged to the new state as ever (one reserved, six used).
            let store = MemoryStore::builder().clock(clock.clone()).build();
            let small = store.check("client", set, 1);
            match clear {
                "reset" => store.reset_now("client", set),
                _ => {
                    store.adjust_now("client", set, &Adjustment::set_remaining(10));
                }
            }
            let left = small.statuses().iter().map(|status| status.remaining);
            let settle = Adjustment::settle(1, 6, small.receipt()).with_left(left);
            let settled = store.adjust_now("client", set, &settle);
            assert_eq!(settled.statuses()[0].remaining, 5, "{label}: {settled:?}");
        }
    }
}

/// An unbooking (a request dropped during its shaping delay) of a booking made before its
/// token policy was set to a level gives nothing back to it: the level set forgave the
/// booking's tokens, and the tokens spent since are others'. (The shaping queue, not
/// cleared, still ends at the booking, so the unbooking goes ahead for it.)
#[test]
fn an_unbooking_of_a_booking_made_before_a_level_set_gives_nothing_back() {
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(1_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let tokens = Policy::token_bucket("tokens", 10, Rate::per_hour(1)).unwrap();
    let set = PolicySet::new([
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1), Duration::from_secs(10))
            .unwrap(),
        tokens.clone(),
    ])
    .unwrap();
    let _first = store.check("k", &set, 1);
    let queued = store.check("k", &set, 4);
    assert!(queued.is_allowed());
    clock.advance(Duration::from_millis(100));
    let tokens = PolicySet::from(tokens);
    store.adjust_now("k", &tokens, &Adjustment::set_remaining(10));
    // Others spend the tokens (outside the shaped route).
    let spent = store.check("k", &tokens, 6);
    assert!(spent.is_allowed());
    assert_eq!(spent.statuses()[0].remaining, 4);
    let after = store.adjust_now("k", &set, &Adjustment::unbook(4, &queued));
    assert_eq!(after.statuses()[1].remaining, 4, "{after:?}");
}

/// A request served from a lease (`store::Leased`) and refunded gives its units back into
/// that lease, which gives its rest back to the shared state when it ends, bounded with
/// all it held. Before, the refund went to the shared state bounded by what the client
/// was told (99 of 100: no room once 2 tokens had refilled, nothing given back); and
/// bounded by what the take left instead, each of a lease's refunds was bounded on its
/// own, together giving back more than a replay of the lease would.
#[tokio::test]
async fn a_request_served_from_a_lease_is_refunded_into_it() {
    let (store, clock) = store();
    let leased = tollgate::store::Leased::new(store.clone(), 20, Duration::from_secs(60)).unwrap();
    let policy = Policy::token_bucket("b", 100, Rate::per_minute(100)).unwrap();
    let set = PolicySet::from(policy.clone());
    let slow = clock.clone();
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let clock = slow.clone();
                async move {
                    // A slow handler: 2 tokens refill while it runs.
                    clock.advance(Duration::from_millis(1_200));
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .route("/ok", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(leased.clone())
                .policy(policy)
                .key(tollgate::key::Global)
                .settle(Settle::reserved().refund_if(|status| status == 503)),
        );
    let get = |path: &'static str| Request::get(path).body(Body::empty()).unwrap();
    let refunded = app.clone().oneshot(get("/")).await.unwrap();
    assert_eq!(refunded.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The lease holds all 20 again: 20 more requests, and no call to the shared store
    // but the first request's take.
    for _ in 0..20 {
        let response = app.clone().oneshot(get("/ok")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(leased.shared_calls(), 1);
    // The take left 80; 2 refilled; the lease is spent.
    assert_eq!(store.check("global", &set, 0).statuses()[0].remaining, 82);
}
