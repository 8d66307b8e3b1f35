//! Shadow (dry-run) mode: per policy and per layer, decided and debited, never denying,
//! reported, and left out of the headers unless asked for.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::key::{Global, HeaderKey};
use tollgate::{FailureMode, MemoryStore, Policy, PolicySet, RateLimitLayer};
use tower::ServiceExt;

const HOUR: Duration = Duration::from_secs(3600);

fn get_root() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap()
}

#[test]
fn a_shadow_policy_never_denies_and_keeps_its_own_state() {
    let store = MemoryStore::new();
    let real = Policy::fixed_window("api", 3, HOUR).unwrap();
    let trial = Policy::fixed_window("trial", 1, HOUR).unwrap().shadow();
    assert!(trial.is_shadow() && !real.is_shadow());
    let set = PolicySet::new([real.clone(), trial.clone()]).unwrap();
    let first = store.check("k", &set, 1);
    assert!(first.is_allowed());
    assert_eq!(first.shadow_denied().count(), 0);
    assert_eq!(
        first.statuses()[1].remaining,
        0,
        "the shadow policy was debited"
    );
    let second = store.check("k", &set, 1);
    assert!(
        second.is_allowed(),
        "the shadow policy would deny, but never does"
    );
    assert_eq!(second.shadow_denied().collect::<Vec<_>>(), [1]);
    assert_eq!(second.statuses()[0].remaining, 1);
    // The real policy still denies.
    store.check("k", &set, 1);
    let fourth = store.check("k", &set, 1);
    assert!(!fourth.is_allowed());
    // A real policy equal to the shadow one in name and parameters has its own state.
    let real_trial = PolicySet::from(Policy::fixed_window("trial", 1, HOUR).unwrap());
    assert!(store.check("k", &real_trial, 1).is_allowed());
    assert!(!store.check("k", &real_trial, 1).is_allowed());
    // A shadow policy that would deny is not debited: a cost it cannot fit, then one
    // it can.
    let shadow_only = PolicySet::from(Policy::fixed_window("roomy", 5, HOUR).unwrap().shadow());
    let denied = store.check("s", &shadow_only, 9);
    assert!(denied.is_allowed());
    assert_eq!(denied.shadow_denied().collect::<Vec<_>>(), [0]);
    assert_eq!(denied.statuses()[0].remaining, 5);
}

#[tokio::test]
async fn shadow_policies_are_left_out_of_the_headers_unless_asked() {
    let set = PolicySet::new([
        Policy::fixed_window("api", 5, HOUR).unwrap(),
        Policy::fixed_window("trial", 1, HOUR).unwrap().shadow(),
    ])
    .unwrap();
    let app = |shown: bool| {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(MemoryStore::new())
                .policies(set.clone())
                .key(Global)
                .shadow_headers(shown),
        )
    };
    let hidden = app(false);
    let response = hidden.clone().oneshot(get_root()).await.unwrap();
    let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(policy.starts_with("\"api\";q=5;w=3600"), "{policy}");
    assert!(!policy.contains("trial"), "{policy}");
    assert!(
        !response.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains("trial")
    );
    let shown = app(true);
    let response = shown.clone().oneshot(get_root()).await.unwrap();
    let policy = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(policy.contains("\"trial\";q=1;w=3600"), "{policy}");
    // Past the shadow limit: still admitted.
    let response = shown.clone().oneshot(get_root()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .contains("\"trial\";r=0")
    );
}

/// The single-valued styles (draft-6, legacy) state one policy's numbers. Shown beside an
/// enforced policy, a shadow policy past its limit was the one with the fewest left: a
/// 200 said `RateLimit-Remaining: 0` and a reset a minute away, and every client that paces
/// itself by the fields (tollgate's own `PacingLayer` among them) held back under a limit
/// that is never enforced. The enforced policy's numbers are given while the set has one.
#[tokio::test]
async fn a_single_valued_style_states_the_enforced_policy_beside_a_shadow_one() {
    use tollgate::HeaderStyle;
    let set = PolicySet::new([
        Policy::fixed_window("api", 5, HOUR).unwrap(),
        Policy::fixed_window("trial", 1, HOUR).unwrap().shadow(),
    ])
    .unwrap();
    for (style, remaining) in [
        (HeaderStyle::Draft6, "ratelimit-remaining"),
        (HeaderStyle::Legacy, "x-ratelimit-remaining"),
    ] {
        let app = Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(MemoryStore::new())
                .policies(set.clone())
                .key(Global)
                .headers(style)
                .shadow_headers(true),
        );
        let mut left = Vec::new();
        for _ in 0..3 {
            let response = app.clone().oneshot(get_root()).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            left.push(response.headers()[remaining].to_str().unwrap().to_owned());
        }
        assert_eq!(left, ["4", "3", "2"], "{style:?}");
    }
    // A set of only shadow policies still shows them, as asked.
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("trial", 1, HOUR).unwrap().shadow())
            .key(Global)
            .headers(HeaderStyle::Draft6)
            .shadow_headers(true),
    );
    let _ = app.clone().oneshot(get_root()).await.unwrap();
    let response = app.oneshot(get_root()).await.unwrap();
    assert_eq!(response.headers()["ratelimit-remaining"], "0");
}

#[tokio::test]
async fn a_shadow_layer_never_refuses_and_sends_no_headers() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("trial", 1, HOUR).unwrap())
            .key(HeaderKey::new("x-api-key"))
            .on_store_error(FailureMode::FailClosed)
            .shadow(true),
    );
    let with_key = || {
        Request::get("/")
            .header("x-api-key", "a")
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..3 {
        let response = app.clone().oneshot(with_key()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("ratelimit"));
        assert!(!response.headers().contains_key("retry-after"));
    }
    // No key: a real layer says 400; a shadow one lets the request through.
    let response = app.clone().oneshot(get_root()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[test]
fn shadow_policies_sit_among_the_first_52() {
    let mut policies: Vec<Policy> = (0..52)
        .map(|i| Policy::fixed_window(&format!("p{i}"), 1, HOUR).unwrap())
        .collect();
    policies.push(Policy::fixed_window("late", 1, HOUR).unwrap().shadow());
    let error = PolicySet::new(policies).unwrap_err().to_string();
    assert!(
        error.contains("\"late\"") && error.contains("52"),
        "{error}"
    );
}

#[tokio::test]
async fn a_shadow_policy_is_never_listed_as_violated() {
    let set = PolicySet::new([
        Policy::fixed_window("api", 1, HOUR).unwrap(),
        Policy::fixed_window("trial", 1, HOUR).unwrap().shadow(),
    ])
    .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(set)
            .key(Global),
    );
    app.clone().oneshot(get_root()).await.unwrap();
    let denied = app.clone().oneshot(get_root()).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = http_body_util::BodyExt::collect(denied.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("\"violated-policies\":[\"api\"]"), "{body}");
}

/// Rolling a new version of a limit out in shadow beside the one enforced, under the same
/// name: `.policy()` replaces a policy of the same name, so the enforced one was dropped
/// and nothing was enforced, silently. The layer refuses that set-up when it is built
/// (`validate`, and `layer` panics with the same message), naming the policy, and so it
/// does two policies of one name in the same mode.
#[test]
fn a_shadow_policy_cannot_silently_replace_the_enforced_one_of_its_name() {
    let layer = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, HOUR).unwrap())
        .policy(Policy::fixed_window("api", 5, HOUR).unwrap().shadow());
    let error = layer.validate().unwrap_err();
    assert!(
        error.contains("\"api\"") && error.contains("shadow"),
        "{error}"
    );
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tower::Layer::layer(
            &layer,
            tower::service_fn(|_: Request<Body>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
            }),
        )
    }));
    assert!(panicked.is_err());
    // Same mode: refused too. Two limits written under one name (a burst limit and a
    // daily one, both "api") were one: the later replaced the earlier, and the burst
    // limit was gone, silently. `PolicySet::new` refuses the pair; so does the layer.
    let twice = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, HOUR).unwrap())
        .policy(Policy::fixed_window("api", 5, HOUR).unwrap());
    let error = twice.validate().unwrap_err();
    assert!(
        error.contains("\"api\"") && error.contains("twice"),
        "{error}"
    );
    // The same policy again changes nothing, and is no mistake.
    let again = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, HOUR).unwrap())
        .policy(Policy::fixed_window("api", 1, HOUR).unwrap());
    assert!(again.validate().is_ok());
    // More than 52 policies added one by one, a shadow one last: refused as a set of them
    // would be.
    let mut many = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("p0", 1, HOUR).unwrap());
    for i in 1..52 {
        many = many.policy(Policy::fixed_window(&format!("p{i}"), 1, HOUR).unwrap());
    }
    let many = many.policy(Policy::fixed_window("late", 1, HOUR).unwrap().shadow());
    let error = many.validate().unwrap_err();
    assert!(error.contains("\"late\""), "{error}");
}
