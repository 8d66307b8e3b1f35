//! Penalties: a key denied N times within a period is blocked, answered from the block
//! without touching its other state; repeats double the block up to a cap.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::clock::ManualClock;
use tollgate::key::Global;
use tollgate::policy::Penalty;
use tollgate::{MemoryStore, Outcome, Policy, PolicySet, Rate, RateLimitLayer};
use tower::ServiceExt;

const SECOND: Duration = Duration::from_secs(1);

fn penalized() -> Policy {
    // 2 per second; 3 denials within 10 s block for 60 s, doubling up to 200 s.
    Policy::token_bucket("api", 2, Rate::per_second(2))
        .unwrap()
        .with_penalty(Penalty::new(3, 10 * SECOND, 60 * SECOND).doubling_up_to(200 * SECOND))
        .unwrap()
}

fn retry(decision: &tollgate::Decision) -> Option<Duration> {
    match decision.outcome() {
        Outcome::Denied { retry_after, .. } => Some(retry_after),
        _ => None,
    }
}

#[test]
fn repeated_denials_block_and_repeats_double_up_to_the_cap() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let set = PolicySet::new([
        penalized(),
        Policy::fixed_window("daily", 1_000, Duration::from_secs(86_400)).unwrap(),
    ])
    .unwrap();
    clock.set(Duration::from_secs(1_000));
    assert!(store.check("k", &set, 1).is_allowed());
    assert!(store.check("k", &set, 1).is_allowed());
    // Two denials: plain ones.
    assert_eq!(
        retry(&store.check("k", &set, 1)),
        Some(Duration::from_millis(500))
    );
    assert_eq!(
        retry(&store.check("k", &set, 1)),
        Some(Duration::from_millis(500))
    );
    // The third starts the block, and already says so.
    let blocked = store.check("k", &set, 1);
    assert_eq!(retry(&blocked), Some(60 * SECOND));
    assert_eq!(blocked.statuses()[0].remaining, 0);
    assert_eq!(blocked.statuses()[0].effective_window, 60 * SECOND);
    assert_eq!(
        blocked.statuses()[1].remaining,
        998,
        "the daily quota is shown as is"
    );
    // While blocked, nothing else is touched: the daily count stays at 2 however many
    // requests come, and the bucket refills underneath.
    clock.advance(30 * SECOND);
    for _ in 0..5 {
        let decision = store.check("k", &set, 1);
        assert_eq!(retry(&decision), Some(30 * SECOND));
        assert_eq!(decision.statuses()[1].remaining, 998);
    }
    clock.advance(30 * SECOND);
    let after = store.check("k", &set, 1);
    assert!(after.is_allowed());
    assert_eq!(after.statuses()[1].remaining, 997);
    // The second offence soon after: 120 s, then 200 s (the cap).
    let offend = |expected: Duration| {
        for _ in 0..3 {
            store.check("k", &set, 1);
        }
        let mut last = store.check("k", &set, 1);
        while last.is_allowed() || retry(&last) == Some(Duration::from_millis(500)) {
            last = store.check("k", &set, 1);
        }
        assert_eq!(retry(&last), Some(expected));
    };
    offend(120 * SECOND);
    clock.advance(120 * SECOND);
    offend(200 * SECOND);
    // Out of trouble for the block plus one longest block: the first block again.
    clock.advance(200 * SECOND + 200 * SECOND);
    offend(60 * SECOND);
    // A reset forgives the block.
    store.reset_now("k", &set);
    assert!(store.check("k", &set, 1).is_allowed());
}

#[tokio::test]
async fn a_block_is_visible_in_retry_after_and_the_headers() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(
                Policy::fixed_window("login", 1, Duration::from_secs(3600))
                    .unwrap()
                    .with_penalty(Penalty::new(
                        2,
                        Duration::from_secs(60),
                        Duration::from_secs(7_200),
                    ))
                    .unwrap(),
            )
            .key(Global),
    );
    let send = || {
        app.clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
    };
    assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    let denied = send().await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let blocked = send().await.unwrap();
    assert_eq!(blocked.status(), StatusCode::TOO_MANY_REQUESTS);
    // Two hours of block, longer than what is left of the hour's window.
    assert_eq!(blocked.headers()["retry-after"], "7200");
    assert_eq!(blocked.headers()["ratelimit"], "\"login\";r=0;t=7200");
}

#[test]
fn bad_penalties_are_refused_with_a_message() {
    let policy = Policy::gcra("g", Rate::per_second(1), 1).unwrap();
    let zero = policy
        .with_penalty(Penalty::new(0, SECOND, SECOND))
        .unwrap_err()
        .to_string();
    assert!(zero.contains("penalty denials"), "{zero}");
    let cap = policy
        .with_penalty(Penalty::new(3, SECOND, 60 * SECOND).doubling_up_to(SECOND))
        .unwrap_err()
        .to_string();
    assert!(cap.contains("max_block"), "{cap}");
}

/// A penalty counts its policy's denials wherever the policy sits in its set: past the
/// 64th too (the in-process store counted none there, the Redis script every one).
#[test]
fn a_penalty_past_the_64th_policy_of_a_set_counts_its_denials() {
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let mut many: Vec<Policy> = (0..64)
        .map(|i| Policy::fixed_window(&format!("p{i}"), 10, 60 * SECOND).unwrap())
        .collect();
    many.push(
        Policy::fixed_window("late", 1, SECOND)
            .unwrap()
            .with_penalty(Penalty::new(1, 10 * SECOND, 60 * SECOND))
            .unwrap(),
    );
    let set = PolicySet::new(many).unwrap();
    assert!(store.check("k", &set, 1).is_allowed());
    // Denied by the 65th: the denial starts its block.
    let blocked = store.check("k", &set, 1);
    assert_eq!(retry(&blocked), Some(60 * SECOND));
    clock.advance(2 * SECOND);
    assert_eq!(retry(&store.check("k", &set, 1)), Some(58 * SECOND));
}

#[test]
fn a_deny_cache_in_front_does_not_hide_denials_from_a_penalty() {
    let clock = ManualClock::new();
    let store =
        tollgate::store::DenyCache::new(MemoryStore::builder().clock(clock.clone()).build(), 100);
    let set = PolicySet::from(
        Policy::fixed_window("api", 1, Duration::from_secs(60))
            .unwrap()
            .with_penalty(Penalty::new(
                3,
                Duration::from_secs(60),
                Duration::from_secs(600),
            ))
            .unwrap(),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let key = tollgate::Key::new("k");
    let decide = || {
        runtime
            .block_on(tollgate::Store::decide(&store, &key, &set, 1))
            .unwrap()
    };
    assert!(decide().is_allowed());
    decide();
    decide();
    // The third denial starts the block: ten minutes, not the window's minute.
    assert_eq!(retry(&decide()), Some(Duration::from_secs(600)));
}

#[test]
fn a_peek_is_no_offence() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let set = PolicySet::from(
        Policy::leaky_bucket_shaping("shaped", Rate::per_second(1), Duration::ZERO)
            .unwrap()
            .with_penalty(Penalty::new(
                1,
                Duration::from_secs(60),
                Duration::from_secs(600),
            ))
            .unwrap(),
    );
    assert!(store.check("k", &set, 1).is_allowed());
    for _ in 0..5 {
        store.check("k", &set, 0);
    }
    clock.advance(Duration::from_secs(1));
    assert!(
        store.check("k", &set, 1).is_allowed(),
        "no block from peeks"
    );
}

/// A penalty changed (a reload that shortens the block to pardon) starts on fresh penalty
/// state, as a changed policy does; the rate state it guards is kept.
#[test]
fn a_changed_penalty_starts_afresh_and_keeps_the_rate_state() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let base = Policy::token_bucket("api", 2, Rate::per_hour(2)).unwrap();
    let strict = PolicySet::from(
        base.with_penalty(Penalty::new(1, 10 * SECOND, 86_400 * SECOND))
            .unwrap(),
    );
    let lenient = PolicySet::from(
        base.with_penalty(Penalty::new(1, 10 * SECOND, 60 * SECOND))
            .unwrap(),
    );
    clock.set(Duration::from_secs(1_000));
    assert!(store.check("k", &strict, 1).is_allowed());
    assert!(store.check("k", &strict, 1).is_allowed());
    // One denial blocks for a day.
    assert_eq!(retry(&store.check("k", &strict, 1)), Some(86_400 * SECOND));
    clock.advance(120 * SECOND);
    // Under the changed penalty the day's block is gone, but the bucket is still empty:
    // denied by the bucket, not by a block.
    let pardoned = store.check("k", &lenient, 1);
    let wait = retry(&pardoned).expect("the bucket is still empty");
    assert!(wait < 86_000 * SECOND, "{wait:?}");
    // Under the unchanged one the block holds.
    assert!(retry(&store.check("k", &strict, 1)).unwrap() > 86_000 * SECOND);
}

#[tokio::test]
async fn a_block_shorter_than_the_window_states_the_windows_wait() {
    // A minute's block on an hour's spent quota: the client is told to come back when the
    // hour's window ends, not when the block does (RFC 9110, section 10.2.3; draft-ietf-
    // httpapi-ratelimit-headers-11, section 6: Retry-After no earlier than the end of the
    // effective window the RateLimit field states).
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
            .policy(
                Policy::fixed_window("login", 1, Duration::from_secs(3_600))
                    .unwrap()
                    .with_penalty(Penalty::new(1, 10 * SECOND, 60 * SECOND))
                    .unwrap(),
            )
            .key(Global),
    );
    let send = || {
        app.clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
    };
    assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    for _ in 0..2 {
        let blocked = send().await.unwrap();
        assert_eq!(blocked.status(), StatusCode::TOO_MANY_REQUESTS);
        // The hour's window ends at 3,600 s: 2,600 s from now.
        assert_eq!(blocked.headers()["retry-after"], "2600");
        assert_eq!(blocked.headers()["ratelimit"], "\"login\";r=0;t=2600");
    }
}

#[tokio::test]
async fn a_shadow_layer_leaves_no_block_behind_for_the_enforcing_one() {
    // A dry run never slowed its clients down, so the denials it saw would not have come
    // under enforcement: a block they started would greet the first enforced request
    // with an hour's 429. The shadow layer shares the rate state, not the penalty.
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = Policy::token_bucket("api", 2, Rate::per_second(2))
        .unwrap()
        .with_penalty(Penalty::new(2, 10 * SECOND, 3_600 * SECOND))
        .unwrap();
    let app = |shadow: bool| {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(store.clone())
                .policy(policy.clone())
                .key(Global)
                .shadow(shadow),
        )
    };
    let send = |app: Router| app.oneshot(Request::get("/").body(Body::empty()).unwrap());
    let trial = app(true);
    for _ in 0..10 {
        assert_eq!(send(trial.clone()).await.unwrap().status(), StatusCode::OK);
    }
    // The rate state is shared: the bucket the trial spent is empty, for half a second
    // (a denial of the enforcing layer's own, the first of the two a block needs).
    let enforced = app(false);
    let spent = send(enforced.clone()).await.unwrap();
    assert_eq!(spent.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(spent.headers()["retry-after"], "1");
    clock.advance(SECOND);
    assert_eq!(
        send(enforced.clone()).await.unwrap().status(),
        StatusCode::OK
    );
    // Its own denials still block: two in a row.
    for _ in 0..2 {
        send(enforced.clone()).await.unwrap();
    }
    let blocked = send(enforced.clone()).await.unwrap();
    assert_eq!(blocked.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(blocked.headers()["retry-after"], "3600");
}
