//! The metrics the layer reports, read back from a recording `metrics` recorder.

#![cfg(feature = "metrics")]

use std::sync::Arc;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use support::Flaky;
use tollgate::key::Global;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::ServiceExt;

type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// Everything recorded since the last snapshot (counters restart from zero after each).
fn snapshot(snapshotter: &Snapshotter) -> Snapshot {
    snapshotter.snapshot().into_vec()
}

fn value<'a>(
    snapshot: &'a Snapshot,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    snapshot.iter().find_map(|(key, _, _, value)| {
        let key = key.key();
        let matches = key.name() == name
            && labels.iter().all(|(k, v)| {
                key.labels()
                    .any(|label| label.key() == *k && label.value() == *v)
            });
        matches.then_some(value)
    })
}

fn counter(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(snapshot, name, labels) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name} {labels:?}: {other:?}"),
    }
}

/// An app limited to 2 an hour by one global key, over an in-process store that fails
/// while the flag is set.
fn over_a_flaky_store() -> (Router, Arc<AtomicBool>) {
    let (store, down) = Flaky::new();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(store)
                .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
                .key(Global),
        )
        .with_state(());
    (app, down)
}

/// `GET /` through `app`: the answer's status.
async fn status_of_get(app: &Router) -> StatusCode {
    app.clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap()
        .status()
}

#[test]
fn decisions_errors_fallback_and_latency_are_reported() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (app, down) = over_a_flaky_store();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let send = || status_of_get(&app);
            assert_eq!(send().await, StatusCode::OK);
            assert_eq!(send().await, StatusCode::OK);
            assert_eq!(send().await, StatusCode::TOO_MANY_REQUESTS);
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", "api"), ("outcome", "allowed")]
                ),
                2
            );
            assert_eq!(
                counter(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", "api"), ("outcome", "denied")]
                ),
                1
            );
            match value(&seen, "tollgate_store_latency_seconds", &[]) {
                Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 3),
                other => panic!("latency: {other:?}"),
            }

            // The store fails: errors are counted, the fallback is active.
            down.store(true, Ordering::SeqCst);
            assert_eq!(send().await, StatusCode::OK, "the local fallback decides");
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(
                    &seen,
                    "tollgate_store_errors_total",
                    &[("kind", "unavailable")]
                ),
                1
            );
            // The debugging recorder hands a gauge's change since the last snapshot.
            let Some(DebugValue::Gauge(active)) = value(&seen, "tollgate_fallback_active", &[])
            else {
                panic!("the fallback gauge")
            };
            assert_eq!(active.into_inner(), 1.0);
            // It answers again: the fallback is over.
            down.store(false, Ordering::SeqCst);
            send().await;
            let seen = snapshot(&snapshotter);
            let Some(DebugValue::Gauge(change)) = value(&seen, "tollgate_fallback_active", &[])
            else {
                panic!("the fallback gauge")
            };
            assert_eq!(active.into_inner() + change.into_inner(), 0.0);
        })
    });
}

/// Decisions the failure mode's local limiter made are counted apart: its 429s looked
/// exactly like the store's in `tollgate_decisions_total`, so a denial an outage caused
/// (at a replica's share of the quota) could not be told from a real one. Counted under
/// `tollgate_fallback_decisions_total` too, by outcome.
#[test]
fn decisions_of_the_fallback_are_counted_apart() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (app, down) = over_a_flaky_store();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let send = || status_of_get(&app);
            assert_eq!(send().await, StatusCode::OK);
            let seen = snapshot(&snapshotter);
            assert_eq!(
                value(&seen, "tollgate_fallback_decisions_total", &[]),
                None,
                "the store decided"
            );
            down.store(true, Ordering::SeqCst);
            let statuses = [send().await, send().await, send().await];
            assert_eq!(
                statuses,
                [
                    StatusCode::OK,
                    StatusCode::OK,
                    StatusCode::TOO_MANY_REQUESTS
                ],
                "the local fallback decides, on a quota of its own"
            );
            let seen = snapshot(&snapshotter);
            let fallback = |outcome| {
                counter(
                    &seen,
                    "tollgate_fallback_decisions_total",
                    &[("outcome", outcome)],
                )
            };
            assert_eq!(fallback("allowed"), 2);
            assert_eq!(fallback("denied"), 1);
        })
    });
}

/// A shadow layer denies nothing, its failure mode's local limiter included: its would-be
/// denials were counted `denied` in `tollgate_fallback_decisions_total` (an outage that
/// refused requests, to a dashboard) while `tollgate_decisions_total` counted the same
/// decision `shadow_denied`. Both now say `shadow_denied`.
#[test]
fn a_shadow_layers_fallback_denials_are_counted_as_shadow_denied() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (store, down) = Flaky::new();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(store)
            .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
            .key(Global)
            .shadow(true),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            down.store(true, Ordering::SeqCst);
            for _ in 0..3 {
                assert_eq!(status_of_get(&app).await, StatusCode::OK, "a shadow layer");
            }
            let seen = snapshot(&snapshotter);
            let fallback = |outcome| {
                value(
                    &seen,
                    "tollgate_fallback_decisions_total",
                    &[("outcome", outcome)],
                )
            };
            assert_eq!(fallback("allowed"), Some(&DebugValue::Counter(2)));
            assert_eq!(fallback("shadow_denied"), Some(&DebugValue::Counter(1)));
            assert_eq!(fallback("denied"), None, "nothing was denied");
            assert_eq!(
                counter(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", "api"), ("outcome", "shadow_denied")]
                ),
                1
            );
        })
    });
}

/// The gauge is the process's: one per process, though each layer (and each `Limiter`)
/// has its own store and breaker. It was set to 0 by any layer whose store answered
/// again, while another's was still down; it counts the layers in their failure mode.
#[test]
fn the_fallback_gauge_counts_each_layer_in_its_failure_mode() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let app = |down: &Arc<AtomicBool>| {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(Flaky {
                inner: MemoryStore::new(),
                down: Arc::clone(down),
            })
            .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
            .key(Global),
        )
    };
    let (down_a, down_b) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (a, b) = (app(&down_a), app(&down_b));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let send = |app: &Router| {
                app.clone()
                    .oneshot(Request::get("/").body(Body::empty()).unwrap())
            };
            // The debugging recorder hands each gauge's change since the last snapshot
            // (it resets them as it reads): its level is their sum.
            let level = std::cell::Cell::new(0.0);
            let gauge = || {
                let seen = snapshot(&snapshotter);
                if let Some(DebugValue::Gauge(v)) = value(&seen, "tollgate_fallback_active", &[]) {
                    level.set(level.get() + v.into_inner());
                }
                level.get()
            };
            down_a.store(true, Ordering::SeqCst);
            send(&a).await.unwrap();
            assert_eq!(gauge(), 1.0);
            down_b.store(true, Ordering::SeqCst);
            send(&b).await.unwrap();
            send(&b).await.unwrap();
            assert_eq!(gauge(), 2.0);
            down_b.store(false, Ordering::SeqCst);
            send(&b).await.unwrap();
            assert_eq!(gauge(), 1.0, "a's store is still down");
            down_a.store(false, Ordering::SeqCst);
            send(&a).await.unwrap();
            send(&a).await.unwrap();
            assert_eq!(gauge(), 0.0);
        })
    });
}

#[test]
fn bypassed_requests_are_counted_by_reason() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/healthz", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
                .key(Global)
                .bypass(
                    tollgate::bypass::Bypass::new().when(|parts| parts.uri.path() == "/healthz"),
                ),
        );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for _ in 0..3 {
                let response = app
                    .clone()
                    .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
                    .await
                    .unwrap();
                assert_eq!(response.status(), StatusCode::OK);
            }
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(&seen, "tollgate_bypassed_total", &[("reason", "predicate")]),
                3
            );
            // Never counted as a decision.
            assert!(value(&seen, "tollgate_decisions_total", &[]).is_none());
        })
    });
}

#[test]
fn shadow_denials_are_counted_as_such() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let set = tollgate::PolicySet::new([
        Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap(),
        Policy::fixed_window("trial", 1, Duration::from_secs(3600))
            .unwrap()
            .shadow(),
    ])
    .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(set)
            .key(Global),
    );
    let shadow_layer = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("whole", 1, Duration::from_secs(3600)).unwrap())
            .key(Global)
            .shadow(true),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for _ in 0..3 {
                for app in [&app, &shadow_layer] {
                    let response = app
                        .clone()
                        .oneshot(Request::get("/").body(Body::empty()).unwrap())
                        .await
                        .unwrap();
                    assert_eq!(response.status(), StatusCode::OK);
                }
            }
            let seen = snapshot(&snapshotter);
            let count = |policy, outcome| {
                counter(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", policy), ("outcome", outcome)],
                )
            };
            assert_eq!(count("trial", "allowed"), 1);
            assert_eq!(count("trial", "shadow_denied"), 2);
            assert_eq!(count("api", "allowed"), 3);
            assert_eq!(count("whole", "allowed"), 1);
            assert_eq!(count("whole", "shadow_denied"), 2);
        })
    });
}

/// A shadow policy in a shadow layer that would have denied is counted `shadow_denied`
/// when the layer's real policy would have denied too, as it is when the real policy
/// admits: `passed` is for a policy that admitted while another denied.
#[test]
fn a_shadow_policy_in_a_shadow_layer_is_counted_as_shadow_denied() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let set = tollgate::PolicySet::new([
        Policy::fixed_window("whole", 1, Duration::from_secs(3600)).unwrap(),
        Policy::fixed_window("trial", 1, Duration::from_secs(3600))
            .unwrap()
            .shadow(),
        Policy::fixed_window("roomy", 100, Duration::from_secs(3600)).unwrap(),
    ])
    .unwrap();
    let shadow_layer = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(set)
            .key(Global)
            .shadow(true),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for _ in 0..3 {
                let response = shadow_layer
                    .clone()
                    .oneshot(Request::get("/").body(Body::empty()).unwrap())
                    .await
                    .unwrap();
                assert_eq!(response.status(), StatusCode::OK);
            }
            let seen = snapshot(&snapshotter);
            let count = |policy, outcome| {
                value(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", policy), ("outcome", outcome)],
                )
                .map_or(0, |value| match value {
                    DebugValue::Counter(n) => *n,
                    other => panic!("{policy} {outcome}: {other:?}"),
                })
            };
            assert_eq!(count("whole", "allowed"), 1);
            assert_eq!(count("whole", "shadow_denied"), 2);
            assert_eq!(count("trial", "allowed"), 1);
            assert_eq!(count("trial", "shadow_denied"), 2);
            assert_eq!(count("trial", "passed"), 0);
            assert_eq!(count("roomy", "allowed"), 1);
            assert_eq!(count("roomy", "passed"), 2);
        })
    });
}

/// Requests refused for want of a key are counted by kind: the client's (400) and the
/// server's (500, set up wrong).
#[test]
fn key_errors_are_counted_by_kind() {
    #[derive(Clone)]
    struct Account;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let by_header = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::HeaderKey::new("x-api-key")),
    );
    let by_account = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap())
            .key(tollgate::key::ExtensionKey::new(
                "account",
                |_: &Account| "a".to_owned(),
            )),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for (app, status, times) in [(&by_header, 400, 2), (&by_account, 500, 3)] {
                for _ in 0..times {
                    let response = app
                        .clone()
                        .oneshot(Request::get("/").body(Body::empty()).unwrap())
                        .await
                        .unwrap();
                    assert_eq!(response.status(), status);
                }
            }
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(&seen, "tollgate_key_errors_total", &[("kind", "client")]),
                2
            );
            assert_eq!(
                counter(&seen, "tollgate_key_errors_total", &[("kind", "server")]),
                3
            );
        })
    });
}

/// A request with no peer address meets a network bypass and a key that both read it
/// (the layer's default key): one cause, one 500, counted once. (The bypass's own count
/// was added beside the key's.)
#[test]
fn a_missing_peer_met_by_the_bypass_and_the_key_is_counted_once() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap())
            .bypass(tollgate::bypass::Bypass::new().network("10.0.0.0/8")),
    );
    let seen = metrics_of(async move {
        for _ in 0..3 {
            let request = Request::get("/").body(Body::empty()).unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        }
    });
    assert_eq!(
        counter(&seen, "tollgate_key_errors_total", &[("kind", "server")]),
        3
    );
}

/// An actual cost a response states unreadably (`x-used: abc`) keeps the reservation:
/// each one is counted, so that a settle that never happens is seen.
#[test]
fn unreadable_actual_costs_are_counted() {
    let app = Router::new()
        .route("/", get(|| async { ([("x-used", "1.5")], "hello") }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::token_bucket("api", 100, tollgate::Rate::per_hour(100)).unwrap())
                .settle(tollgate::settle::Settle::from_header("x-used")),
        );
    let seen = metrics_of(async move {
        for _ in 0..3 {
            let mut request = Request::get("/").body(Body::empty()).unwrap();
            request
                .extensions_mut()
                .insert(std::net::SocketAddr::from(([203, 0, 113, 7], 1)));
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        }
    });
    assert_eq!(counter(&seen, "tollgate_settles_unreadable_total", &[]), 3);
}

/// A store that cannot decide the limiter's policy: it refuses before any I/O, as the
/// Redis store refuses a policy it cannot decide exactly.
#[derive(Clone)]
struct Unsupported;

impl tollgate::Store for Unsupported {
    fn decide(&self, _: &tollgate::Key, _: &tollgate::PolicySet, _: u64) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unsupported,
            "this store cannot decide that policy exactly",
        )))
    }
}

/// A store that never answers.
#[derive(Clone)]
struct Hung;

impl tollgate::Store for Hung {
    fn decide(&self, _: &tollgate::Key, _: &tollgate::PolicySet, _: u64) -> tollgate::DecideFuture {
        tollgate::DecideFuture::new(std::future::pending())
    }
}

// A `Limiter` check given up (an outer timeout shorter than the store timeout) after
// waiting on a hung store for longer than the breaker's patience (100 ms) counts as the
// store timing out; before, nothing was counted or said of a store that never answered.
#[test]
fn a_limiter_check_given_up_on_a_hung_store_is_counted_as_a_timeout() {
    let limiter =
        tollgate::limiter::Limiter::new(Hung, jobs()).store_timeout(Duration::from_secs(30));
    let seen = metrics_of(async move {
        let key = tollgate::Key::new("k");
        let given_up =
            tokio::time::timeout(Duration::from_millis(150), limiter.check(&key, 1)).await;
        assert!(given_up.is_err(), "the store never answers");
    });
    assert_eq!(
        counter(&seen, "tollgate_store_errors_total", &[("kind", "timeout")]),
        1
    );
}

// A waiter that ran out of its wait in the queue peeks at the key's state; given up on a
// store that hangs, that peek counts as the store timing out, as a check does. It was
// counted nowhere.
#[test]
fn a_waiters_peek_given_up_on_a_hung_store_is_counted_as_a_timeout() {
    let limiter = tollgate::limiter::Limiter::new(
        support::PeekHangs(tollgate::MemoryStore::new()),
        Policy::token_bucket("jobs", 1, tollgate::Rate::per_minute(1)).unwrap(),
    )
    .store_timeout(Duration::from_secs(30));
    let seen = metrics_of(async move {
        let key = tollgate::Key::new("k");
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        // Ahead: a waiter that sleeps for the next token, holding the turn.
        let ahead = {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(
                async move { limiter.until_ready(&key, 1, Duration::from_secs(120)).await },
            )
        };
        tokio::task::yield_now().await;
        let behind = limiter.until_ready(&key, 1, Duration::from_millis(10));
        let given_up = tokio::time::timeout(Duration::from_millis(150), behind).await;
        assert!(given_up.is_err(), "the peek never answers");
        ahead.abort();
    });
    assert_eq!(
        counter(&seen, "tollgate_store_errors_total", &[("kind", "timeout")]),
        1
    );
}

/// A store that fails at once, or never answers while `hangs` is set.
#[derive(Clone)]
struct FailsThenHangs(Arc<AtomicBool>);

impl tollgate::Store for FailsThenHangs {
    fn decide(&self, _: &tollgate::Key, _: &tollgate::PolicySet, _: u64) -> tollgate::DecideFuture {
        if self.0.load(Ordering::SeqCst) {
            return tollgate::DecideFuture::new(std::future::pending());
        }
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }
}

// The README: a request dropped after waiting 100 ms on the store, with no answer from it
// meanwhile, "counts as the store timing out (a probe so dropped starts a new
// cool-down), in tollgate_store_errors_total{kind="timeout"}". A probe so dropped started
// the cool-down and was counted nowhere: a store that hangs, seen only by probes (the
// whole time the breaker is open), left the counter still.
#[test]
fn a_probe_dropped_on_a_hung_store_is_counted_as_a_timeout() {
    let hangs = Arc::new(AtomicBool::new(false));
    let clock = tollgate::clock::ManualClock::new();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(FailsThenHangs(Arc::clone(&hangs)))
                .policy(jobs())
                .key(Global)
                .on_store_error(tollgate::FailureMode::FailOpen)
                .store_timeout(Duration::from_secs(30))
                .circuit_breaker(
                    tollgate::CircuitBreaker::new(1, Duration::from_secs(1))
                        .with_clock(clock.clone()),
                ),
        )
        .with_state(());
    let seen = metrics_of(async move {
        // One failure opens the breaker; once its cool-down has passed, the next request
        // is the probe, and the store hangs.
        assert_eq!(status_of_get(&app).await, StatusCode::OK);
        clock.advance(Duration::from_secs(2));
        hangs.store(true, Ordering::SeqCst);
        let mut probe = Box::pin(status_of_get(&app));
        let polled = tokio::time::timeout(Duration::from_millis(5), &mut probe).await;
        assert!(polled.is_err(), "the probe waits on the hung store");
        clock.advance(Duration::from_millis(150));
        drop(probe);
    });
    assert_eq!(
        counter(
            &seen,
            "tollgate_store_errors_total",
            &[("kind", "unavailable")]
        ),
        1
    );
    assert_eq!(
        counter(&seen, "tollgate_store_errors_total", &[("kind", "timeout")]),
        1
    );
}

/// Two units an hour: the `Limiter` tests' policy.
fn jobs() -> Policy {
    Policy::fixed_window("jobs", 2, Duration::from_secs(3600)).unwrap()
}

/// Runs `work` on a current-thread runtime (timers on) with a recorder of its own: the
/// metrics it left.
fn metrics_of(work: impl std::future::Future<Output = ()>) -> Snapshot {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(work));
    snapshot(&snapshotter)
}

// A `Limiter` whose store fails is answered by its failure mode, like the layer; like the
// layer's, the failure is counted (and a refusal logged at error level), never hidden
// behind the fallback: replicas deciding alone each admit the whole limit.
#[test]
fn a_limiters_store_errors_are_counted_not_hidden_by_the_fallback() {
    let limiter = tollgate::limiter::Limiter::new(Unsupported, jobs());
    let seen = metrics_of(async move {
        let key = tollgate::Key::new("k");
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        assert!(
            limiter
                .until_ready(&key, 1, Duration::from_secs(1))
                .await
                .unwrap()
                .is_allowed()
        );
    });
    assert_eq!(
        counter(
            &seen,
            "tollgate_store_errors_total",
            &[("kind", "unsupported")]
        ),
        2
    );
    // Both decided by the failure mode's local limiter, and counted as such.
    assert_eq!(
        counter(
            &seen,
            "tollgate_fallback_decisions_total",
            &[("outcome", "allowed")]
        ),
        2
    );
}

// A waiter's turns inside `until_ready` are not answers: its store failing, each turn the
// fallback denied (its share spent, the waiter waiting for it) was counted as a fallback
// decision, and an admitted waiter showed up as an outage's denial. The fallback's
// decisions are counted as answers are, once per call, with what the caller got.
#[test]
fn a_waiters_turns_under_the_fallback_are_counted_once() {
    let limiter = tollgate::limiter::Limiter::new(
        Unsupported,
        Policy::fixed_window("jobs", 1, Duration::from_millis(50)).unwrap(),
    );
    let seen = metrics_of(async move {
        let key = tollgate::Key::new("k");
        for _ in 0..2 {
            let decision = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
            assert!(decision.unwrap().is_allowed());
        }
    });
    assert_eq!(
        counter(
            &seen,
            "tollgate_fallback_decisions_total",
            &[("outcome", "allowed")]
        ),
        2
    );
    let denied = value(
        &seen,
        "tollgate_fallback_decisions_total",
        &[("outcome", "denied")],
    );
    assert!(
        denied.is_none() || matches!(denied, Some(DebugValue::Counter(0))),
        "a waiter admitted is no outage's denial: {denied:?}"
    );
    assert_eq!(
        counter(
            &seen,
            "tollgate_decisions_total",
            &[("policy", "jobs"), ("outcome", "allowed")]
        ),
        2
    );
}

// A `Limiter`'s answers are counted in `tollgate_decisions_total` as the layer's are (the
// README's metrics table): what each `check` and each `until_ready` was told, per policy.
// A waiter's own retries inside `until_ready` are not answers, and are not counted.
#[test]
fn a_limiters_decisions_are_counted() {
    let limiter = tollgate::limiter::Limiter::new(MemoryStore::new(), jobs());
    let seen = metrics_of(async move {
        let key = tollgate::Key::new("k");
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
        assert!(
            limiter
                .until_ready(&key, 1, Duration::from_millis(5))
                .await
                .is_err()
        );
        assert!(
            limiter
                .until_ready(&key, 3, Duration::from_secs(1))
                .await
                .is_err()
        );
    });
    let decisions = |outcome| {
        counter(
            &seen,
            "tollgate_decisions_total",
            &[("policy", "jobs"), ("outcome", outcome)],
        )
    };
    assert_eq!(decisions("allowed"), 2);
    assert_eq!(decisions("denied"), 2);
    assert_eq!(decisions("cost_exceeds_limit"), 1);
}

/// A lease's give-back (what is left of it when it ends) that fails strands those units
/// out of the shared quota until its window forgets them: counted as any store error. It
/// was dropped unseen, as was a failed take.
#[test]
fn a_lease_that_cannot_be_given_back_is_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Its give-backs fail (`Unsupported`), as a script the server refuses would.
    let down = Arc::new(AtomicBool::new(false));
    let store = tollgate::store::Leased::new(
        RefusesAdjustments(Flaky {
            inner: MemoryStore::new(),
            down: Arc::clone(&down),
        }),
        10,
        Duration::from_millis(20),
    )
    .unwrap();
    let policies = tollgate::PolicySet::from(
        Policy::fixed_window("api", 1_000, Duration::from_secs(3600)).unwrap(),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            use tollgate::Store;
            let key = tollgate::Key::new("user:1");
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
            let mut counted = 0;
            for _ in 0..500 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                let seen = snapshot(&snapshotter);
                if let Some(DebugValue::Counter(n)) = value(
                    &seen,
                    "tollgate_store_errors_total",
                    &[("kind", "unsupported")],
                ) {
                    counted += n;
                    break;
                }
            }
            assert_eq!(counted, 1, "the failed give-back");
            // A take that fails is counted too (each request then meets the store alone).
            down.store(true, Ordering::SeqCst);
            let _ = store
                .decide(&tollgate::Key::new("user:2"), &policies, 1)
                .await;
            let seen = snapshot(&snapshotter);
            assert!(
                matches!(
                    value(&seen, "tollgate_store_errors_total", &[("kind", "unavailable")]),
                    Some(DebugValue::Counter(n)) if *n >= 1
                ),
                "{seen:?}"
            );
        })
    });
}

/// A store that says it adjusts, and refuses every adjustment (a script the server
/// refuses to run, say): what leases give back over it fails.
struct RefusesAdjustments(Flaky);

impl tollgate::Store for RefusesAdjustments {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        _: &tollgate::Key,
        _: &tollgate::PolicySet,
        _: &tollgate::store::Adjustment,
    ) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unsupported,
            "this store refuses adjustments",
        )))
    }
}

/// A layer or `Limiter` dropped while its store is failing (a router rebuilt, a job's
/// limiter gone) takes its count out of the gauge: nothing would ever take it back.
#[test]
fn a_failing_limiter_dropped_leaves_the_gauge() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let limiter = tollgate::limiter::Limiter::new(
        Flaky {
            inner: MemoryStore::new(),
            down: Arc::new(AtomicBool::new(true)),
        },
        Policy::fixed_window("mail", 100, Duration::from_secs(3600)).unwrap(),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            limiter
                .check(&tollgate::Key::new("user:1"), 1)
                .await
                .expect("the fallback decides");
        });
        drop(limiter);
    });
    let seen = snapshot(&snapshotter);
    let Some(DebugValue::Gauge(level)) = value(&seen, "tollgate_fallback_active", &[]) else {
        panic!("the fallback gauge")
    };
    assert_eq!(level.into_inner(), 0.0);
}

/// A store that never answers.
#[derive(Clone)]
struct Hangs;

impl tollgate::Store for Hangs {
    fn decide(&self, _: &tollgate::Key, _: &tollgate::PolicySet, _: u64) -> tollgate::DecideFuture {
        tollgate::DecideFuture::new(std::future::pending())
    }
}

/// A token bucket of one an hour whose first denial blocks the key for an hour.
fn penalized() -> Policy {
    Policy::token_bucket("login", 1, tollgate::Rate::per_hour(1))
        .unwrap()
        .with_penalty(tollgate::policy::Penalty::new(
            1,
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        ))
        .unwrap()
}

/// A waiter's turn under a penalty is a peek, then a decision, within one store timeout.
/// When the peek hangs, the failure mode answers after it, and the hang is one store
/// error, not a second made up for the decision the timeout left no time for.
#[test]
fn a_hung_peek_is_one_store_error() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let limiter = tollgate::limiter::Limiter::new(Hangs, penalized())
        .store_timeout(Duration::from_millis(50));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let key = tollgate::Key::new("k");
            let waited = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
            assert!(waited.is_ok(), "the fallback decides: {waited:?}");
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(&seen, "tollgate_store_errors_total", &[("kind", "timeout")]),
                1
            );
        })
    });
}

/// A `Limiter`'s store that answers a waiter's peek is back, as an answered decision
/// says: the fallback is over. A key under a block is answered by the peek alone, and
/// the fallback stayed active for as long as the block.
#[test]
fn a_limiter_recovers_on_a_peek_answer() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (store, down) = Flaky::new();
    let limiter = tollgate::limiter::Limiter::new(store, penalized());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let key = tollgate::Key::new("k");
            assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
            let denied = limiter.check(&key, 1).await.unwrap();
            assert!(denied.is_blocked(), "{denied:?}");
            down.store(true, Ordering::SeqCst);
            let other = tollgate::Key::new("other");
            assert!(limiter.check(&other, 1).await.unwrap().is_allowed());
            let seen = snapshot(&snapshotter);
            let Some(DebugValue::Gauge(active)) = value(&seen, "tollgate_fallback_active", &[])
            else {
                panic!("the fallback gauge")
            };
            assert_eq!(active.into_inner(), 1.0);
            down.store(false, Ordering::SeqCst);
            let waited = limiter.until_ready(&key, 1, Duration::ZERO).await;
            assert!(waited.is_err(), "blocked: {waited:?}");
            let seen = snapshot(&snapshotter);
            let change = match value(&seen, "tollgate_fallback_active", &[]) {
                Some(DebugValue::Gauge(change)) => change.into_inner(),
                _ => 0.0,
            };
            assert_eq!(active.into_inner() + change, 0.0, "the fallback is over");
        })
    });
}

/// `tollgate_store_latency_seconds` is the time the store took: a denial the deny cache
/// answers in process never asked it. Recorded with the store's own round trips, a flood
/// of cached denials (most of the samples) hid a slow Redis behind near-zero times.
#[test]
fn a_deny_caches_answers_are_no_store_latency() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(tollgate::store::DenyCache::new(MemoryStore::new(), 64))
                .policy(Policy::fixed_window("api", 2, Duration::from_secs(3600)).unwrap())
                .key(Global),
        )
        .with_state(());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            // Two admitted, one denied by the store (which the cache keeps), then ten
            // denials the cache answers.
            for expected in [StatusCode::OK, StatusCode::OK]
                .into_iter()
                .chain(std::iter::repeat_n(StatusCode::TOO_MANY_REQUESTS, 11))
            {
                assert_eq!(status_of_get(&app).await, expected);
            }
            let seen = snapshot(&snapshotter);
            assert_eq!(
                counter(
                    &seen,
                    "tollgate_decisions_total",
                    &[("policy", "api"), ("outcome", "denied")]
                ),
                11
            );
            match value(&seen, "tollgate_store_latency_seconds", &[]) {
                Some(DebugValue::Histogram(samples)) => {
                    assert_eq!(samples.len(), 3, "the store was asked three times")
                }
                other => panic!("latency: {other:?}"),
            }
        })
    });
}

/// Every metric the crate emits is in the README's table and in the `telemetry` module's
/// own: a metric an operator cannot find documented is one they do not alert on.
#[test]
fn every_metric_emitted_is_documented() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap();
    let readme = read("README.md");
    let telemetry = read("src/telemetry.rs");
    let module_table: String = telemetry
        .lines()
        .take_while(|line| line.starts_with("//!"))
        .collect();
    let mut emitted = std::collections::BTreeSet::new();
    for path in ["src/telemetry.rs", "src/store/mod.rs", "src/store/redis.rs"] {
        let text = read(path);
        for (at, _) in text.match_indices("\"tollgate_") {
            let name: String = text[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if name.len() > "tollgate_".len() {
                emitted.insert(name);
            }
        }
    }
    assert!(emitted.len() >= 9, "{emitted:?}");
    for name in &emitted {
        let row = format!("| `{name}` |");
        assert!(readme.contains(&row), "README's metrics table lacks {name}");
        assert!(
            module_table.contains(&row),
            "the telemetry module's table lacks {name}"
        );
    }
}
