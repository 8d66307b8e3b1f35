//! The `tracing` events: a denial, a store error, and one warning when the failure mode
//! starts and one when the store answers again (not one per request).

#![cfg(feature = "tracing")]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::Request;
use support::Flaky;
use tollgate::key::{Global, KeyExtractorExt};
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::ServiceExt;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Records every event as "LEVEL message".
#[derive(Clone, Default)]
struct Recorder {
    events: Arc<Mutex<Vec<String>>>,
}

/// An event's message, then its other fields (` name=value`).
struct Message(String, String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        } else {
            self.1.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = Message(String::new(), String::new());
        event.record(&mut message);
        let level = *event.metadata().level();
        self.events
            .lock()
            .unwrap()
            .push(format!("{level} {}{}", message.0, message.1));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Sends `requests` requests to `app`, one after another, with a recorder as the
/// subscriber: their statuses and bodies, and every event.
fn recorded(app: &Router, requests: usize) -> (Vec<(u16, String)>, Vec<String>) {
    with_recorder(async {
        let mut statuses = Vec::new();
        for _ in 0..requests {
            let response = app
                .clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            statuses.push((status, String::from_utf8_lossy(&body).into_owned()));
        }
        statuses
    })
}

/// Runs `work` on a runtime of its own with a recorder as the subscriber: what it
/// returns, and every event.
fn with_recorder<T>(work: impl std::future::Future<Output = T>) -> (T, Vec<String>) {
    let recorder = Recorder::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let done = tracing::subscriber::with_default(recorder.clone(), || runtime.block_on(work));
    let events = recorder.events.lock().unwrap().clone();
    (done, events)
}

#[test]
fn denials_errors_and_one_warning_per_transition() {
    let recorder = Recorder::default();
    let down = Arc::new(AtomicBool::new(false));
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(Flaky {
                inner: MemoryStore::new(),
                down: Arc::clone(&down),
            })
            .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
            .key(Global),
        )
        .with_state(());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            let send = || async {
                app.clone()
                    .oneshot(Request::get("/").body(Body::empty()).unwrap())
                    .await
                    .unwrap()
            };
            send().await;
            send().await; // denied
            down.store(true, Ordering::SeqCst);
            for _ in 0..3 {
                send().await;
            }
            down.store(false, Ordering::SeqCst);
            send().await;
        })
    });
    let events = recorder.events.lock().unwrap().clone();
    let count = |prefix: &str| {
        events
            .iter()
            .filter(|event| event.starts_with(prefix))
            .count()
    };
    assert!(
        count(&format!("{} rate limited", Level::DEBUG)) >= 1,
        "{events:?}"
    );
    assert_eq!(
        count(&format!("{} rate-limit store error", Level::DEBUG)),
        3,
        "{events:?}"
    );
    assert_eq!(
        count(&format!("{} rate-limit store failed", Level::WARN)),
        1,
        "{events:?}"
    );
    assert_eq!(
        count(&format!("{} rate-limit store answers again", Level::WARN)),
        1,
        "{events:?}"
    );
}

/// A store that refuses every decision the way a misconfigured Redis does.
#[derive(Clone)]
struct Refusing;

impl tollgate::Store for Refusing {
    fn decide(
        &self,
        _key: &tollgate::Key,
        _policies: &tollgate::PolicySet,
        _cost: u64,
    ) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Refused,
            "NOPERM this user has no permissions to run the 'evalsha' command",
        )
        .with_code("NOPERM")))
    }

    // Says it adjusts (a Redis store does), and refuses that too.
    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        _adjustment: &tollgate::store::Adjustment,
    ) -> tollgate::DecideFuture {
        self.decide(key, policies, 0)
    }
}

// A store error that is not I/O is a bug or a misconfiguration: logged at error level,
// once per kind and code, never only at debug level behind the fallback.
#[test]
fn a_refusing_store_is_logged_at_error_level_once() {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(Refusing)
                .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
                .key(Global),
        )
        .with_state(());
    let (answers, events) = recorded(&app, 4);
    // The default failure mode still answers: a local limiter, whose budget (a share of
    // 100 an hour) four requests do not spend.
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "{answers:?}"
    );
    let errors: Vec<&String> = events
        .iter()
        .filter(|event| event.starts_with(&format!("{}", Level::ERROR)))
        .collect();
    assert_eq!(errors.len(), 1, "{events:?}");
    assert!(errors[0].contains("refused to decide"), "{errors:?}");
}

/// `api` (10 an hour) enforced, and a shadow `trial` (1 an hour) that would deny from the
/// second request on.
fn api_with_a_shadow_trial() -> tollgate::PolicySet {
    tollgate::PolicySet::new([
        Policy::fixed_window("api", 10, Duration::from_secs(3600)).unwrap(),
        Policy::fixed_window("trial", 1, Duration::from_secs(3600))
            .unwrap()
            .shadow(),
    ])
    .unwrap()
}

#[test]
fn a_shadow_policy_that_would_deny_is_an_info_event() {
    let set = api_with_a_shadow_trial();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(set)
            .key(Global),
    );
    let (_, events) = recorded(&app, 3);
    let shadow = format!("{} shadow policy would have denied", Level::INFO);
    assert_eq!(
        events.iter().filter(|e| e.starts_with(&shadow)).count(),
        2,
        "{events:?}"
    );
}

/// A key is the client's to word (a user name an auth layer checked, a JWT claim, a raw
/// path): logged as it was, a line break in it forged a log line of its own (the
/// subscriber escapes control characters but not line breaks). Keys are logged escaped,
/// as plan names are.
#[test]
fn a_key_is_logged_escaped() {
    let forged = "bob\n2026-01-01T00:00:00Z ERROR tollgate: forged\u{2028}";
    let set = api_with_a_shadow_trial();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policies(set)
            .key(tollgate::key::from_fn(move |_| {
                Ok(tollgate::Key::new(forged))
            })),
    );
    let (_, events) = recorded(&app, 3);
    let logged: Vec<&String> = events.iter().filter(|e| e.contains("bob")).collect();
    assert_eq!(logged.len(), 2, "{events:?}");
    for event in logged {
        assert!(
            !event.contains('\n') && !event.contains('\u{2028}'),
            "{event:?}"
        );
    }
}

/// The account type of the test below: its name must not reach the client.
#[derive(Clone)]
struct SecretAccountType(u64);

/// Three plain `GET /` through an app behind `limiter`, under a recorder: each answer's
/// status and body, and the events recorded at `level`.
fn three_requests_through<K>(
    limiter: RateLimitLayer<MemoryStore, K>,
    level: Level,
) -> (Vec<(u16, String)>, Vec<String>)
where
    K: tollgate::key::KeyExtractor + Clone,
{
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter)
        .with_state(());
    let (answers, events) = recorded(&app, 3);
    let at_level = events
        .into_iter()
        .filter(|event| event.starts_with(&format!("{level} ")))
        .collect();
    (answers, at_level)
}

/// A key extractor set up wrong (the layer that inserts its extension is missing) answers
/// 500 without telling the client how the server is built (RFC 9457, section 5), and is
/// logged at error level, once, with the reason the client is not told.
#[test]
fn a_server_side_key_error_is_logged_once_and_not_shown_to_the_client() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
        .key(tollgate::key::ExtensionKey::new(
            "account",
            |account: &SecretAccountType| account.0.to_string(),
        ));
    let (answers, errors) = three_requests_through(limiter, Level::ERROR);
    for (status, body) in &answers {
        assert_eq!(*status, 500);
        assert!(!body.contains("SecretAccountType"), "{body}");
    }
    assert_eq!(errors.len(), 1, "{errors:?}");
}

/// `Basic` credentials hold a password, and a key hashes them whole: without a salt, the
/// hash a store dump or a log line shows can be checked against lists of common
/// passwords in one fast SHA-256 each. A key that hashes them so says it, once, at warn
/// level, without the credentials; a salted key, or one keyed by the user-id, does not.
#[test]
fn an_unsalted_key_of_basic_credentials_is_warned_of_once() {
    use tollgate::key::{HeaderKey, KeyExtractor};
    let parts = |value: &str| {
        Request::get("/")
            .header("authorization", value)
            .body(())
            .unwrap()
            .into_parts()
            .0
    };
    // "alice:hunter2".
    let basic = "Basic YWxpY2U6aHVudGVyMg==";
    let recorder = Recorder::default();
    tracing::subscriber::with_default(recorder.clone(), || {
        let salted = HeaderKey::new("authorization").salt("server secret");
        let by_user = HeaderKey::new("authorization").basic_user_id();
        let bearer = HeaderKey::new("authorization");
        for _ in 0..3 {
            salted.extract(&parts(basic)).unwrap();
            by_user.extract(&parts(basic)).unwrap();
            bearer.extract(&parts("Bearer abc")).unwrap();
        }
        assert_eq!(*recorder.events.lock().unwrap(), Vec::<String>::new());
        let unsalted = HeaderKey::new("Authorization");
        for _ in 0..3 {
            unsalted.extract(&parts(basic)).unwrap();
        }
    });
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(events[0].starts_with("WARN "), "{events:?}");
    assert!(events[0].contains("salt"), "{events:?}");
    assert!(
        !events[0].contains("YWxpY2U6aHVudGVyMg") && !events[0].contains("hunter2"),
        "{events:?}"
    );
}

struct AccountFromAuth(u64);

/// `MissingKey::Allow` lets an absent key through on purpose; but when what is absent is
/// something the server should have set (the auth middleware's extension: it may run
/// after the limiter), every request then passes unlimited. That is said once, at warn
/// level, naming what is missing, not passed over in silence.
#[test]
fn requests_let_through_for_a_key_the_server_should_have_set_are_reported_once() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap())
        .key(tollgate::key::ExtensionKey::new(
            "account",
            |account: &AccountFromAuth| account.0.to_string(),
        ))
        .on_missing_key(tollgate::MissingKey::Allow);
    let (answers, warnings) = three_requests_through(limiter, Level::WARN);
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "let through, as configured: {answers:?}"
    );
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("AccountFromAuth"), "{warnings:?}");
}

/// The same warning, from a layer over several routes (axum wraps each route's service
/// in a service of its own): said once for the layer, not once a route.
#[test]
fn the_missing_key_warning_is_said_once_per_layer_over_many_routes() {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
        .key(tollgate::key::ExtensionKey::new(
            "account",
            |account: &AccountFromAuth| account.0.to_string(),
        ))
        .on_missing_key(tollgate::MissingKey::Allow);
    let app = Router::new()
        .route("/a", get(|| async { "a" }))
        .route("/b", get(|| async { "b" }))
        .route("/c", get(|| async { "c" }))
        .layer(limiter)
        .with_state(());
    let recorder = Recorder::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            for path in ["/a", "/b", "/c", "/a"] {
                let request = Request::get(path).body(Body::empty()).unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                assert_eq!(response.status(), 200, "{path}");
            }
        })
    });
    let warnings: Vec<String> = recorder
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|event| event.starts_with("WARN "))
        .cloned()
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
}

/// A store that fails every other decision (a timeout now and then, a Cluster with one
/// shard away): the breaker stays closed, and the failure mode answers the failed ones.
/// The two warnings are said once for a while, not once per failure: four hundred
/// decisions flapping on one clock instant say "failed" and "answers again" once each.
#[test]
fn a_store_that_fails_now_and_then_is_warned_of_once_in_a_while() {
    #[derive(Clone)]
    struct EveryOther(
        Arc<std::sync::atomic::AtomicU64>,
        MemoryStore,
        Arc<AtomicBool>,
    );
    impl tollgate::Store for EveryOther {
        fn decide(
            &self,
            key: &tollgate::Key,
            policies: &tollgate::PolicySet,
            cost: u64,
        ) -> tollgate::DecideFuture {
            if self.0.fetch_add(1, Ordering::SeqCst) % 2 == 1 || self.2.load(Ordering::SeqCst) {
                return tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
                    tollgate::StoreErrorKind::Timeout,
                    "timed out",
                )));
            }
            self.1.decide(key, policies, cost)
        }
    }
    let recorder = Recorder::default();
    let down = Arc::new(AtomicBool::new(false));
    let clock = tollgate::clock::ManualClock::new();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(EveryOther(
                Arc::default(),
                MemoryStore::new(),
                Arc::clone(&down),
            ))
            .policy(Policy::fixed_window("api", 1_000, Duration::from_secs(3600)).unwrap())
            .key(Global)
            .circuit_breaker(
                tollgate::CircuitBreaker::new(5, Duration::from_secs(1)).with_clock(clock.clone()),
            ),
        )
        .with_state(());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let send = |app: Router| async move {
        app.oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap()
    };
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            for _ in 0..400 {
                assert_eq!(send(app.clone()).await.status(), 200);
            }
        })
    });
    let warnings = |events: &[String]| -> (usize, usize) {
        let count = |text: &str| {
            events
                .iter()
                .filter(|event| event.starts_with(&format!("{} {text}", Level::WARN)))
                .count()
        };
        (
            count("rate-limit store failed"),
            count("rate-limit store answers again"),
        )
    };
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(warnings(&events), (1, 1), "{} events", events.len());
    // A while later, the next failure is said again (with how often it flapped since).
    clock.advance(Duration::from_secs(60));
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            for _ in 0..4 {
                send(app.clone()).await;
            }
        })
    });
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(warnings(&events), (2, 2), "{events:?}");
    // An outage that starts soon after the last warning, and goes on: said once it is
    // long enough after (here, at the probe 31 s on), not left unsaid for its length.
    down.store(true, Ordering::SeqCst);
    clock.advance(Duration::from_secs(1));
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            for _ in 0..40 {
                send(app.clone()).await;
                clock.advance(Duration::from_secs(1));
            }
        })
    });
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(warnings(&events).0, 3, "{events:?}");
}

/// Redis answers most errors with the code `ERR` (a script's error among them): a second
/// refusal of another kind under the same code is a new fault to tell, not one already
/// logged.
#[test]
fn refusals_under_one_code_with_other_words_are_each_logged() {
    #[derive(Clone)]
    struct Refuses(Arc<std::sync::atomic::AtomicU64>);
    impl tollgate::Store for Refuses {
        fn decide(
            &self,
            _key: &tollgate::Key,
            _policies: &tollgate::PolicySet,
            _cost: u64,
        ) -> tollgate::DecideFuture {
            // Redis 6's words for a script's error put the script's hash first.
            let message = match self.0.fetch_add(1, Ordering::SeqCst) {
                0 => {
                    "Error running script (call to f_3a9c0e11d2b4f6a8c0e2d4f6a8b0c2e4d6f8a0b2): @user_script:12: Script attempted to access a non local key 4711"
                }
                1 => {
                    "Error running script (call to f_9f8e7d6c5b4a39281706f5e4d3c2b1a098f7e6d5): @user_script:12: Script attempted to access a non local key 815"
                }
                _ => {
                    "Error running script (call to f_3a9c0e11d2b4f6a8c0e2d4f6a8b0c2e4d6f8a0b2): @user_script:80: the sliding log member 99 was not written by tollgate"
                }
            };
            tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
                tollgate::StoreErrorKind::Refused,
                message,
            )
            .with_code("ERR")))
        }
    }
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(Refuses(Arc::default()))
                .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
                .key(Global),
        )
        .with_state(());
    let (_, events) = recorded(&app, 4);
    let errors: Vec<&String> = events
        .iter()
        .filter(|event| event.starts_with(&format!("{}", Level::ERROR)))
        .collect();
    assert_eq!(errors.len(), 2, "{events:?}");
}

/// Loading the Functions library refused for something else than Functions being
/// unavailable (here `OOM`: a server at its `maxmemory` under `noeviction`) is a
/// misconfiguration to say at error level, not a quiet switch to scripts: it was told at
/// info level ("Functions are not available"), as an ACL without `FUNCTION LOAD` is.
#[cfg(feature = "redis")]
#[test]
fn a_library_load_refused_for_memory_is_logged_at_error_level() {
    let server = support::RedisServer::start();
    let recorder = Recorder::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let statuses: Vec<u16> = tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            let store = tollgate::store::RedisStore::connect(&server.url())
                .await
                .expect("a store");
            // The server loses its library (a restart) and is full.
            assert_eq!(server.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
            for setting in [["maxmemory-policy", "noeviction"], ["maxmemory", "1"]] {
                let args = ["CONFIG", "SET", setting[0], setting[1]];
                assert_eq!(server.cli(&args).trim(), "OK");
            }
            let app = Router::new().route("/", get(|| async { "ok" })).layer(
                RateLimitLayer::new(store)
                    .policy(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap())
                    .key(Global),
            );
            let mut statuses = Vec::new();
            for _ in 0..2 {
                let response = app
                    .clone()
                    .oneshot(Request::get("/").body(Body::empty()).unwrap())
                    .await
                    .unwrap();
                statuses.push(response.status().as_u16());
            }
            statuses
        })
    });
    // The fallback answers (the scripts are refused for memory too).
    assert_eq!(statuses, [200, 200]);
    let events = recorder.events.lock().unwrap().clone();
    assert!(logged_at_error(&events, "Functions library"), "{events:?}");
}

/// Requests that meet the lost library together wait their turn to load it; when the
/// load is refused, those behind the one that tried fall back to scripts without sending
/// the load again (to a server out of memory) and without saying it again: one error
/// line for the lot. Each loaded and said it in turn, a line per request.
#[cfg(feature = "redis")]
#[test]
fn a_refused_library_load_is_tried_and_said_once_for_requests_together() {
    use tollgate::{Key, PolicySet, Store};
    let server = support::RedisServer::start();
    let events = events_of(async {
        // A pool: each decision on a connection of its own, none coalesced.
        let pool = deadpool_redis::Config::from_url(server.url())
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .unwrap();
        let store = tollgate::store::RedisStore::from_pool(pool);
        store.verify().await.expect("the server runs the library");
        assert_eq!(server.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
        for setting in [["maxmemory-policy", "noeviction"], ["maxmemory", "1"]] {
            let args = ["CONFIG", "SET", setting[0], setting[1]];
            assert_eq!(server.cli(&args).trim(), "OK");
        }
        let policies =
            PolicySet::from(Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap());
        let keys: Vec<Key> = (0..8).map(|n| Key::new(format!("user:{n}"))).collect();
        let decisions = keys.iter().map(|key| store.decide(key, &policies, 1));
        let answers = futures_util::future::join_all(decisions).await;
        // The scripts are refused for memory too: every decision fails, as a refusal.
        assert!(answers.iter().all(Result::is_err), "{answers:?}");
    });
    let said = events
        .iter()
        .filter(|event| {
            event.starts_with(&format!("{} ", Level::ERROR)) && event.contains("Functions library")
        })
        .count();
    assert_eq!(said, 1, "{events:#?}");
}

/// A server that stalls (frozen: its kernel still accepts connections, nothing answers)
/// has its connection checked after a few decisions go unanswered, and replaced when a
/// `PING` gets no answer either. Each check and each replacement that failed said a
/// warning again, for as long as the stall lasted (a line or two a second or so: the
/// README says an outage is told once, and again at most every 30 s). The stall is said
/// once at warn level, then at debug level until the server answers again.
#[cfg(feature = "redis")]
#[test]
fn a_stalled_server_is_said_once_not_at_every_check() {
    use std::time::Instant;
    use tollgate::{Key, PolicySet, Store};
    let server = support::RedisServer::start();
    let recorder = Recorder::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let checks = |recorder: &Recorder| {
        recorder
            .events
            .lock()
            .unwrap()
            .iter()
            .filter(|event| event.contains("answers nothing, not even a PING"))
            .count()
    };
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            let store = tollgate::store::RedisStore::connect(&server.url())
                .await
                .expect("a store");
            let policies = PolicySet::from(
                Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap(),
            );
            let key = Key::new("stalled");
            server.signal("STOP");
            // Decisions dropped unanswered (a layer's timeout) until the connection was
            // checked three times; bounded by a deadline only a stuck test meets.
            let deadline = Instant::now() + Duration::from_secs(60);
            while checks(&recorder) < 3 && Instant::now() < deadline {
                let decided = store.decide(&key, &policies, 1);
                let _ = tokio::time::timeout(Duration::from_millis(20), decided).await;
            }
            server.signal("CONT");
        })
    });
    let events = recorder.events.lock().unwrap().clone();
    assert!(checks(&recorder) >= 3, "{events:#?}");
    let warned = |words: &str| {
        events
            .iter()
            .filter(|event| {
                event.starts_with(&format!("{} ", Level::WARN)) && event.contains(words)
            })
            .count()
    };
    assert_eq!(warned("answers nothing, not even a PING"), 1, "{events:#?}");
    assert!(warned("no new connection") <= 1, "{events:#?}");
}

/// A dropped decision's in-flight slots are given back by a task of their own. A release
/// the server refuses (an ACL without `ZREM`) is a misconfiguration, said at error level
/// as every store call no request waits for is; it was a warning, one per dropped
/// decision, whatever the error.
#[cfg(feature = "redis")]
#[test]
fn a_refused_release_of_a_dropped_decision_is_logged_at_error_level() {
    use std::future::Future;
    use tollgate::{Key, PolicySet, Store};
    let server = support::RedisServer::start();
    let events = events_of(async {
        let store = tollgate::store::RedisStore::connect(&server.url())
            .await
            .expect("a store");
        let busy = PolicySet::from(Policy::concurrency("busy", 10).unwrap());
        let key = Key::new("dropped");
        assert!(store.decide(&key, &busy, 1).await.unwrap().is_allowed());
        // The connection's user may no longer remove members.
        assert_eq!(
            server.cli(&["ACL", "SETUSER", "default", "-zrem"]).trim(),
            "OK"
        );
        // A decision sent, then dropped before its answer (a client gone).
        let mut decision = Box::pin(store.decide(&key, &busy, 1));
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(decision.as_mut().poll(&mut context).is_pending());
        drop(decision);
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    assert!(
        logged_at_error(&events, "could not give back the in-flight slots"),
        "{events:?}"
    );
}

/// Runs `work` on a current-thread runtime (timers and I/O on) with a recorder as the
/// subscriber: every event it gave.
fn events_of(work: impl std::future::Future<Output = ()>) -> Vec<String> {
    let recorder = Recorder::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(recorder.clone(), || runtime.block_on(work));
    recorder.events.lock().unwrap().clone()
}

/// True when one of `events` is at error level and holds `words`.
#[cfg(feature = "redis")]
fn logged_at_error(events: &[String], words: &str) -> bool {
    let error = format!("{} ", Level::ERROR);
    events
        .iter()
        .any(|event| event.starts_with(&error) && event.contains(words))
}

/// How many of `events` are at `level` and start with `message`.
fn count(events: &[String], level: Level, message: &str) -> usize {
    let prefix = format!("{level} {message}");
    events
        .iter()
        .filter(|event| event.starts_with(&prefix))
        .count()
}

/// An in-process store that fails (`Unavailable`) while `down` is set.
fn flaky(down: &Arc<AtomicBool>) -> Flaky {
    Flaky {
        inner: MemoryStore::new(),
        down: Arc::clone(down),
    }
}

/// A `Limiter` has no breaker, and an I/O failure alone is a debug event (the layer's
/// breaker says the outage): its store down for hours was said nowhere above debug while
/// each replica decided alone. It says an outage once, and its end once, as the layer.
#[test]
fn a_limiters_outage_is_said_once_and_its_end_once() {
    let down = Arc::new(AtomicBool::new(true));
    let limiter = tollgate::limiter::Limiter::new(
        flaky(&down),
        Policy::fixed_window("mail", 1_000, Duration::from_secs(3600)).unwrap(),
    );
    let events = events_of(async {
        let key = tollgate::Key::new("user:1");
        for _ in 0..100 {
            let decision = limiter.check(&key, 1).await.expect("the fallback decides");
            assert!(decision.is_allowed());
        }
        down.store(false, Ordering::SeqCst);
        for _ in 0..3 {
            limiter.check(&key, 1).await.unwrap();
        }
    });
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store failed"),
        1,
        "{events:?}"
    );
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store answers again"),
        1,
        "{events:?}"
    );
}

/// A `Limiter` over a deny cache: its cached answers say nothing of the store behind, so
/// they do not end an outage ("answers again" said while the store was still down, and
/// the gauge flipping at request rate).
#[test]
fn a_limiters_cached_answers_do_not_end_its_outage() {
    let down = Arc::new(AtomicBool::new(false));
    let limiter = tollgate::limiter::Limiter::new(
        tollgate::store::DenyCache::new(flaky(&down), 100),
        Policy::fixed_window("mail", 1, Duration::from_secs(3600)).unwrap(),
    );
    let events = events_of(async {
        let (spent, other) = (tollgate::Key::new("spent"), tollgate::Key::new("other"));
        assert!(limiter.check(&spent, 1).await.unwrap().is_allowed());
        // Denied by the store, and the denial cached.
        assert!(!limiter.check(&spent, 1).await.unwrap().is_allowed());
        down.store(true, Ordering::SeqCst);
        limiter.check(&other, 1).await.unwrap();
        for _ in 0..3 {
            let cached = limiter.check(&spent, 1).await.unwrap();
            assert!(cached.is_cached() && !cached.is_allowed());
        }
    });
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store failed"),
        1,
        "{events:?}"
    );
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store answers again"),
        0,
        "{events:?}"
    );
}

/// Every answer from a lease was marked cached, the one a request got from the lease the
/// store had just granted among them: once the store answered again, only a refused take
/// would have ended the outage, so "answers again" was never said (and behind the layer,
/// the breaker's probe never closed it). A fresh lease's first answer is the store's.
#[test]
fn a_fresh_lease_ends_an_outage() {
    let down = Arc::new(AtomicBool::new(true));
    let limiter = tollgate::limiter::Limiter::new(
        tollgate::store::Leased::new(
            support::FlakyAdjusting(flaky(&down)),
            10,
            Duration::from_secs(60),
        )
        .unwrap(),
        Policy::fixed_window("mail", 1_000, Duration::from_secs(3600)).unwrap(),
    );
    let events = events_of(async {
        let key = tollgate::Key::new("user:1");
        limiter.check(&key, 1).await.expect("the fallback decides");
        down.store(false, Ordering::SeqCst);
        // After a failed take, requests go alone for a moment; then a lease.
        tokio::time::sleep(Duration::from_millis(150)).await;
        for _ in 0..10 {
            assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        }
    });
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store answers again"),
        1,
        "{events:?}"
    );
}

/// A refusal every identity's lease meets (`NOPERM`, `OOM`) is said at error level, but
/// not once per identity and take: a hundred identities say it once.
#[test]
fn a_refusal_every_lease_meets_is_said_once_not_per_identity() {
    let store = tollgate::store::Leased::new(Refusing, 10, Duration::from_secs(60)).unwrap();
    let policies = tollgate::PolicySet::from(
        Policy::fixed_window("api", 100, Duration::from_secs(3600)).unwrap(),
    );
    let events = events_of(async {
        use tollgate::Store;
        for user in 0..100 {
            let key = tollgate::Key::new(format!("user:{user}"));
            let error = store.decide(&key, &policies, 1).await.unwrap_err();
            assert_eq!(error.kind(), tollgate::StoreErrorKind::Refused);
        }
    });
    assert_eq!(count(&events, Level::ERROR, ""), 1, "{events:?}");
}

/// An app whose configuration has the plans "default" (100 an hour) and "premium"
/// (1,000), named in `plan_header`, keyed globally.
#[cfg(feature = "config")]
fn free_and_premium(plan_header: &str) -> Router {
    let config: tollgate::config::LimiterConfig = toml::from_str(&format!(
        r#"
        key = ["global"]
        plan_header = "{plan_header}"

        [[policies]]
        name = "free"
        algorithm = "fixed-window"
        limit = 100
        window = "1h"

        [[policies]]
        name = "premium"
        algorithm = "fixed-window"
        limit = 1000
        window = "1h"

        [plans]
        default = ["free"]
        premium = ["premium"]
        "#
    ))
    .unwrap();
    let live = tollgate::config::LiveLayer::new(MemoryStore::new(), &config).unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(live)
        .with_state(())
}

/// A plan header that names no plan of the configuration (a reload renamed `pro`, the auth
/// layer still sends it) gets the default plan: never in silence. Said at warn level once
/// per value, whatever the number of requests; a known plan and the default one say
/// nothing, nor does an empty value (it names no plan).
#[cfg(feature = "config")]
#[test]
fn a_plan_the_configuration_does_not_have_is_said_once_per_value() {
    let app = free_and_premium("x-plan");
    let events = events_of(async move {
        for plan in [
            "premium", "default", "pro", "pro", "Premium", "", " ", "pro",
        ] {
            let request = Request::get("/")
                .header("x-plan", plan)
                .body(Body::empty())
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), 200);
        }
        // Twice (an auth layer that appends its line to the client's): said too.
        for _ in 0..2 {
            let request = Request::get("/")
                .header("x-plan", "premium")
                .header("x-plan", "premium")
                .body(Body::empty())
                .unwrap();
            assert_eq!(app.clone().oneshot(request).await.unwrap().status(), 200);
        }
    });
    let warnings: Vec<&String> = events.iter().filter(|e| e.starts_with("WARN ")).collect();
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(warnings[0].contains("\"pro\""), "{warnings:?}");
    assert!(warnings[1].contains("\"Premium\""), "{warnings:?}");
    assert!(warnings[2].contains("more than once"), "{warnings:?}");
}

/// A plan header's value longer than any plan's name is no misspelt plan: it may be a
/// credential (an API key sent where the plan goes), and nothing prints a secret. It is
/// named by its length and a hash keyed for the process, once per value; a value that could
/// be a misspelt plan is still shown.
#[cfg(feature = "config")]
#[test]
fn a_plan_value_longer_than_any_plan_is_not_logged_in_clear() {
    let app = free_and_premium("x-api-key");
    let secret = "sk_live_4f9a1c2e8b7d";
    let events = events_of(async move {
        for value in [secret, "premiun", secret, "sk_live_00000000000a"] {
            let request = Request::get("/")
                .header("x-api-key", value)
                .body(Body::empty())
                .unwrap();
            assert_eq!(app.clone().oneshot(request).await.unwrap().status(), 200);
        }
    });
    let warnings: Vec<&String> = events.iter().filter(|e| e.starts_with("WARN ")).collect();
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(
        events.iter().all(|event| !event.contains("sk_live")),
        "{events:?}"
    );
    assert!(warnings[0].contains("20 bytes"), "{warnings:?}");
    assert!(
        warnings[0].contains("keyed for this process"),
        "{warnings:?}"
    );
    assert!(warnings[1].contains("\"premiun\""), "{warnings:?}");
    // Two withheld values are told apart by their digests.
    assert_ne!(warnings[0], warnings[2], "{warnings:?}");
}

/// A network bypass under a key that reads no client address (an API key), or reads the
/// socket peer (the default `ClientIp::peer()`), matches the socket peer, which behind a
/// load balancer is the balancer for every request: every request skips limiting. The
/// layer says so once, at warn level, when it is built; not when the key reads the client
/// behind trusted proxies or the bypass was told how (`Bypass::client_ip`).
#[test]
fn a_network_bypass_that_matches_the_socket_peer_is_warned_of_once() {
    use tollgate::bypass::Bypass;
    use tollgate::key::{ClientIp, HeaderKey};
    let policy = || Policy::gcra("api", tollgate::Rate::per_second(10), 20).unwrap();
    let recorder = Recorder::default();
    tracing::subscriber::with_default(recorder.clone(), || {
        let hello = || Router::<()>::new().route("/", get(|| async { "hi" }));
        let told = RateLimitLayer::new(MemoryStore::new())
            .policy(policy())
            .key(HeaderKey::new("x-api-key"))
            .bypass(
                Bypass::new()
                    .network("10.0.0.0/8")
                    .client_ip(ClientIp::behind_proxies(["10.0.0.1"]).unwrap()),
            );
        let _ = hello().layer(told);
        let behind = RateLimitLayer::new(MemoryStore::new())
            .policy(policy())
            .key(ClientIp::behind_proxies(["10.0.0.1"]).unwrap())
            .bypass(Bypass::new().network("10.0.0.0/8"));
        let _ = hello().layer(behind);
        assert_eq!(*recorder.events.lock().unwrap(), Vec::<String>::new());
        // The default key reads the peer too: the same.
        let by_peer = RateLimitLayer::new(MemoryStore::new())
            .policy(policy())
            .bypass(Bypass::new().network("10.0.0.0/8"));
        let _ = hello().layer(by_peer);
        let peer = RateLimitLayer::new(MemoryStore::new())
            .policy(policy())
            .key(HeaderKey::new("x-api-key"))
            .bypass(Bypass::new().network("10.0.0.0/8"));
        let _ = hello()
            .route("/a", get(|| async { "a" }))
            .route("/b", get(|| async { "b" }))
            .layer(peer);
    });
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(events.len(), 2, "{events:?}");
    for event in &events {
        assert!(event.starts_with("WARN "), "{events:?}");
        assert!(event.contains("peer"), "{events:?}");
    }
}

/// A network bypass reads the client's address; served without the peer address
/// recorded (`axum::serve` without `into_make_service_with_connect_info`), it can read
/// none, and never matched, with nothing said: office traffic was limited as any
/// client's while the key (an API key) never noticed. Said at error level once, as the
/// key's own missing peer is, and counted with the server's key errors.
/// An app keyed by API key whose office network (`10.0.0.0/8`, behind the trusted proxy
/// `10.0.0.1`) skips limiting; served here with no peer address recorded.
fn office_bypass_by_api_key() -> Router {
    use tollgate::bypass::Bypass;
    use tollgate::key::{ClientIp, HeaderKey};
    Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::gcra("api", tollgate::Rate::per_second(10), 20).unwrap())
            .key(HeaderKey::new("x-api-key"))
            .bypass(
                Bypass::new()
                    .network("10.0.0.0/8")
                    .client_ip(ClientIp::behind_proxies(["10.0.0.1"]).unwrap()),
            ),
    )
}

#[test]
fn a_network_bypass_that_cannot_read_an_address_is_logged_at_error_level_once() {
    let app = office_bypass_by_api_key();
    let (limited, events) = with_recorder(async {
        let mut limited = 0;
        for _ in 0..3 {
            let request = Request::get("/")
                .header("x-api-key", "k")
                .header("x-forwarded-for", "10.2.3.4")
                .body(Body::empty())
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            limited += usize::from(response.headers().contains_key("ratelimit"));
        }
        limited
    });
    // Decided (no address, no bypass), as before; but not in silence.
    assert_eq!(limited, 3);
    let errors: Vec<_> = events
        .iter()
        .filter(|event| event.starts_with("ERROR "))
        .collect();
    assert_eq!(errors.len(), 1, "{events:?}");
    assert!(errors[0].contains("bypass"), "{errors:?}");
}

/// The same set-up, where the requests carry no API key either: each is refused for its
/// missing key (400), and the bypass's own fault, the server's, is said all the same, not
/// hidden behind the client's; once per layer, so that a second layer's is said too.
#[test]
fn a_network_bypass_without_an_address_is_said_when_the_key_is_missing_too() {
    let (first, second) = (office_bypass_by_api_key(), office_bypass_by_api_key());
    let (statuses, events) = with_recorder(async {
        let mut statuses = Vec::new();
        for app in [&first, &first, &second] {
            let request = Request::get("/")
                .header("x-forwarded-for", "10.2.3.4")
                .body(Body::empty())
                .unwrap();
            statuses.push(
                app.clone()
                    .oneshot(request)
                    .await
                    .unwrap()
                    .status()
                    .as_u16(),
            );
        }
        statuses
    });
    assert_eq!(statuses, [400, 400, 400]);
    let errors: Vec<_> = events
        .iter()
        .filter(|event| event.starts_with("ERROR ") && event.contains("bypass"))
        .collect();
    assert_eq!(errors.len(), 2, "{events:?}");
}

/// `ExtensionKey::new(..).or(ClientIp::peer())` keys signed-in requests by account and
/// the others by address. An auth middleware added before the limiter runs after it, so
/// no request ever has its extension: every account silently became an address (users
/// behind one NAT sharing a quota, a user with many addresses multiplying it), hidden
/// behind the fallback. Said once at warn level when a hundred requests in a row from the
/// start fell back for want of what the server sets; not once one has had it.
#[test]
fn a_fallback_that_stands_in_for_every_request_is_warned_of_once() {
    #[derive(Clone)]
    struct AccountFromAuth(u64);
    let key = || {
        tollgate::key::ExtensionKey::new("account", |account: &AccountFromAuth| {
            account.0.to_string()
        })
        .or(Global)
    };
    let layer = |key| {
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("api", 1_000, Duration::from_secs(3600)).unwrap())
            .key(key)
    };
    let misordered = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer(key()));
    let (answers, events) = recorded(&misordered, 250);
    assert!(answers.iter().all(|(status, _)| *status == 200));
    let warnings: Vec<_> = events
        .iter()
        .filter(|event| event.starts_with("WARN "))
        .collect();
    assert_eq!(warnings.len(), 1, "{events:?}");
    assert!(warnings[0].contains("AccountFromAuth"), "{warnings:?}");

    // One request had it: the middleware runs first, and the others are anonymous.
    let ordered = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer(key()))
        .layer(axum::middleware::map_request(
            |mut request: Request<Body>| async move {
                static FIRST: AtomicBool = AtomicBool::new(true);
                if FIRST.swap(false, Ordering::Relaxed) {
                    request.extensions_mut().insert(AccountFromAuth(7));
                }
                request
            },
        ));
    let (_, events) = recorded(&ordered, 250);
    let warnings = events
        .iter()
        .filter(|event| event.starts_with("WARN "))
        .count();
    assert_eq!(warnings, 0, "{events:?}");
}

/// The layer's default key is the socket peer. Behind a proxy (a load balancer, an
/// ingress, a sidecar) that is the proxy for every request, and every client shares one
/// budget, silently. Requests carrying a forwarding header under a key that trusts no
/// proxy are said once per layer, at warn level; not under a key that reads the proxies'
/// header, nor when no request carries one.
#[test]
fn a_peer_key_meeting_forwarded_requests_is_warned_of_once() {
    use std::net::SocketAddr;
    use tollgate::key::ClientIp;
    let policy = || Policy::gcra("api", tollgate::Rate::per_second(1_000), 1_000).unwrap();
    macro_rules! app {
        ($layer:expr) => {
            Router::<()>::new()
                .route("/", get(|| async { "hi" }))
                .layer($layer)
        };
    }
    let request = |header: Option<(&str, &str)>| {
        let mut request = Request::get("/");
        if let Some((name, value)) = header {
            request = request.header(name, value);
        }
        let mut request = request.body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [10, 0, 0, 5],
                443,
            ))));
        request
    };
    // One request in 256 on a thread is looked at: 300 in a row to each app.
    let send = |app: Router, header: Option<(&'static str, &'static str)>| async move {
        for _ in 0..300 {
            app.clone().oneshot(request(header)).await.unwrap();
        }
    };
    let quiet = events_of(async {
        let plain = app!(RateLimitLayer::new(MemoryStore::new()).policy(policy()));
        send(plain, None).await;
        let trusting = app!(
            RateLimitLayer::new(MemoryStore::new())
                .policy(policy())
                .key(ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap())
        );
        send(trusting, Some(("x-forwarded-for", "203.0.113.7"))).await;
    });
    assert_eq!(quiet, Vec::<String>::new());
    let warned = events_of(async {
        let by_default = app!(RateLimitLayer::new(MemoryStore::new()).policy(policy()));
        send(by_default, Some(("x-forwarded-for", "203.0.113.7"))).await;
        let by_peer = app!(
            RateLimitLayer::new(MemoryStore::new())
                .policy(policy())
                .key(ClientIp::peer())
        );
        send(by_peer, Some(("forwarded", "for=203.0.113.7"))).await;
    });
    assert_eq!(warned.len(), 2, "{warned:?}");
    for event in &warned {
        assert!(event.starts_with("WARN "), "{warned:?}");
        assert!(event.contains("ClientIp::behind_proxies"), "{warned:?}");
    }
}

/// A store that decides, and fails every adjustment as unreachable.
#[derive(Clone)]
struct SettlesFail(MemoryStore);

impl tollgate::Store for SettlesFail {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn adjust(
        &self,
        _: &tollgate::Key,
        _: &tollgate::PolicySet,
        _: &tollgate::Adjustment,
    ) -> tollgate::DecideFuture {
        tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
            tollgate::StoreErrorKind::Unavailable,
            "connection refused",
        )))
    }

    fn can_adjust(&self) -> bool {
        true
    }
}

/// A settle that does not reach the store leaves a cost uncounted (a post-paid request
/// served free): it was only a debug line, like a decision's I/O error, whose outage the
/// breaker says. It is said at warn level, once while it goes on, and each is counted.
#[test]
fn a_settle_that_fails_is_warned_of() {
    let events = three_settled(SettlesFail(MemoryStore::new()), "7");
    assert_eq!(
        count(&events, Level::WARN, "rate-limit store failed to settle"),
        1,
        "{events:?}"
    );
}

/// Three requests through a layer over `store` that settles by the response's `x-used`,
/// which says `used`: every event.
fn three_settled<S: tollgate::Store + Clone>(store: S, used: &'static str) -> Vec<String> {
    let app = Router::new()
        .route(
            "/",
            get(move || async move { ([("x-used", used)], "hello") }),
        )
        .layer(
            RateLimitLayer::new(store)
                .policy(Policy::token_bucket("api", 100, tollgate::Rate::per_hour(100)).unwrap())
                .key(Global)
                .settle(tollgate::settle::Settle::from_header("x-used")),
        );
    events_of(async move {
        for _ in 0..3 {
            let response = app
                .clone()
                .oneshot(Request::builder().uri("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
        }
    })
}

/// An actual cost that is no whole number (`x-used: abc`, from a buggy upstream) keeps
/// the reservation, and is said: once in a while, not on every response (it was a warning
/// per response, at request rate), and counted (`tollgate_settles_unreadable_total`).
#[test]
fn an_unreadable_actual_cost_is_warned_of_once_in_a_while() {
    let events = three_settled(MemoryStore::new(), "abc");
    assert_eq!(
        count(
            &events,
            Level::WARN,
            "the response's actual cost is not a whole number"
        ),
        1,
        "{events:?}"
    );
}

/// A sentinel refuses its password while another names the primary: the store works, so
/// nothing failed a request, and the refusal was met and dropped at each look-up, said
/// nowhere (a sentinel fewer to follow a failover with, until the day the others are
/// down). It is said at error level.
#[cfg(feature = "redis")]
#[test]
fn a_sentinel_refusing_its_password_beside_one_that_answers_is_logged_at_error_level() {
    let server = support::RedisServer::start();
    let refusing = support::FakeSentinel::start(server.port, true);
    let answering = support::FakeSentinel::start(server.port, false);
    let events = events_of(async {
        tollgate::store::RedisConfig::sentinel(
            [
                refusing.url_with_password("rotated-secret"),
                answering.url(),
            ],
            "mymaster",
        )
        .connect()
        .await
        .expect("the second sentinel names the primary");
    });
    assert!(answering.asked() > 0);
    assert!(
        logged_at_error(&events, "a Redis sentinel, or the server it named, refused"),
        "{events:?}"
    );
}

/// Two servers: a primary with the ACL user `limiter` (password `s3cret`), and one
/// without it (ACLs are not replicated), which refuses the store's credentials.
#[cfg(feature = "redis")]
fn primary_and_one_refusing_it() -> (support::RedisServer, support::RedisServer) {
    let (primary, refusing) = (support::RedisServer::start(), support::RedisServer::start());
    let added = primary.cli(&[
        "ACL", "SETUSER", "limiter", "on", ">s3cret", "~*", "&*", "+@all",
    ]);
    assert_eq!(added.trim(), "OK");
    (primary, refusing)
}

/// The sentinels name a new primary that refuses the store (it lacks the ACL user: ACLs
/// are not replicated). The watch does not follow them there, and stays on the primary
/// it has; it said nothing of it, at any level, while each replica counted on a primary
/// the sentinels had deposed. It says so at error level, and not as "another sentinel led
/// to the primary": none did.
#[cfg(feature = "redis")]
#[test]
fn a_new_primary_refusing_the_store_is_logged_at_error_level() {
    let (primary, refusing) = primary_and_one_refusing_it();
    let sentinels = [
        support::FakeSentinel::start(primary.port, false),
        support::FakeSentinel::start(primary.port, false),
    ];
    let events = events_of(async {
        let _store = tollgate::store::RedisConfig::sentinel(
            sentinels.iter().map(support::FakeSentinel::url),
            "mymaster",
        )
        .master_auth(Some("limiter"), "s3cret")
        .connect()
        .await
        .expect("the primary takes the credentials");
        for sentinel in &sentinels {
            sentinel.name(refusing.port);
        }
        // The watch asks the sentinels every 2 s.
        let asked = sentinels[1].asked();
        while sentinels[1].asked() < asked + 2 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let port = refusing.port.to_string();
    assert!(logged_at_error(&events, &port), "{events:?}");
    assert!(
        !events
            .iter()
            .any(|event| event.contains("another sentinel led")),
        "{events:?}"
    );
}

/// Every sentinel forgets the primary's name (`SENTINEL REMOVE`, or sentinels
/// redeployed monitoring it by another): the store works on the primary it has, and would
/// follow no failover. The watch said nothing of it, at any level (a sentinel that
/// answers nil was heard, so not "no sentinel answers"). It warns, once, naming the
/// primary's name; and says so when a sentinel names the primary again.
#[cfg(feature = "redis")]
#[test]
fn sentinels_that_forget_the_primarys_name_are_said() {
    let primary = support::RedisServer::start();
    let sentinels = [
        support::FakeSentinel::start(primary.port, false),
        support::FakeSentinel::start(primary.port, false),
    ];
    // The watch asks the sentinels every 2 s.
    let rounds = async |count: u64| {
        let asked = sentinels[1].asked();
        while sentinels[1].asked() < asked + count {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let events = events_of(async {
        let watched = tokio::time::timeout(Duration::from_secs(60), async {
            let _store = tollgate::store::RedisConfig::sentinel(
                sentinels.iter().map(support::FakeSentinel::url),
                "mymaster",
            )
            .connect()
            .await
            .expect("the sentinels name the primary");
            for sentinel in &sentinels {
                sentinel.forget();
            }
            rounds(2).await;
            for sentinel in &sentinels {
                sentinel.name(primary.port);
            }
            // A round is counted as it asks: three more, so that one asked after the
            // sentinels named it again has ended.
            rounds(3).await;
        })
        .await;
        assert!(watched.is_ok(), "the watch kept asking");
    });
    let forgotten: Vec<&String> = events
        .iter()
        .filter(|event| event.starts_with("WARN ") && event.contains("mymaster"))
        .collect();
    assert_eq!(forgotten.len(), 1, "said once: {events:?}");
    assert!(forgotten[0].contains("no failover"), "{forgotten:?}");
    assert!(
        events
            .iter()
            .any(|event| event.starts_with("INFO ") && event.contains("mymaster")),
        "and that a sentinel names it again: {events:?}"
    );
}

/// As above, with other sentinels naming servers that take connections and answer
/// nothing: the round runs into its deadline (5 s) asking them whether they are the
/// primary, after the refusal was met. Cut off, it said nothing of the refusal; what a
/// round met is said however it ends.
#[cfg(feature = "redis")]
#[test]
fn a_refusal_met_in_a_watch_round_cut_off_by_its_deadline_is_logged() {
    let (primary, refusing) = primary_and_one_refusing_it();
    let first = support::FakeSentinel::start(primary.port, false);
    let silent: Vec<_> = (0..7).map(|_| support::SilentServer::start()).collect();
    let others: Vec<_> = (0..7)
        .map(|_| support::FakeSentinel::start(primary.port, false))
        .collect();
    let urls = std::iter::once(first.url()).chain(others.iter().map(support::FakeSentinel::url));
    let events = events_of(async {
        let _store = tollgate::store::RedisConfig::sentinel(urls, "mymaster")
            .master_auth(Some("limiter"), "s3cret")
            .connect()
            .await
            .expect("the sentinels name the primary");
        // A failover, as each sentinel saw it: the first names the refusing server (asked
        // first, of equals), the others each a silent one (a second each to give up on).
        first.name(refusing.port);
        for (sentinel, server) in others.iter().zip(&silent) {
            sentinel.name(server.port);
        }
        // Two rounds begun: the first has ended, cut off.
        let asked = first.asked();
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while first.asked() < asked + 2 {
            assert!(std::time::Instant::now() < until, "no second round");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert!(
        silent.iter().any(|server| server.accepted() > 0),
        "the round went past the refusal"
    );
    let port = refusing.port.to_string();
    assert!(logged_at_error(&events, &port), "{events:?}");
    assert!(
        events
            .iter()
            .any(|event| event.contains("within the watch's time")),
        "the round was not cut off: {events:?}"
    );
}

/// A reload refused (a mistake in the new file) keeps the running configuration, and the
/// caller gets the error; a file watcher or a SIGHUP handler that drops it left nothing
/// anywhere, and the operator believed the new limits live. It is said at error level,
/// with the entry and the reason.
#[cfg(feature = "config")]
#[test]
fn a_refused_reload_is_logged_at_error_level() {
    let config: tollgate::config::LimiterConfig = toml::from_str(
        r#"
        [[policies]]
        name = "api"
        algorithm = "fixed-window"
        limit = 10
        window = "1m"
        "#,
    )
    .unwrap();
    let live = tollgate::config::LiveLayer::new(MemoryStore::new(), &config).unwrap();
    let mut broken = config.clone();
    broken.policies[0].window = Some("soon".into());
    let recorder = Recorder::default();
    let refused = tracing::subscriber::with_default(recorder.clone(), || live.reload(&broken));
    assert!(refused.is_err());
    let events = recorder.events.lock().unwrap().clone();
    assert!(
        events
            .iter()
            .any(|event| event.starts_with(&format!("{} ", Level::ERROR))
                && event.contains("reload")
                && event.contains("policies[0]")),
        "{events:?}"
    );
}

// A `Leased` store that holds leases for as many identities as it may decides new ones
// one by one: a round trip each, which an operator should hear of (a flood, or a bound
// set too low), once.
#[test]
fn a_leased_store_at_its_bound_of_identities_says_so_once() {
    use tollgate::store::Leased;
    use tollgate::{Key, PolicySet, Store};
    let events = events_of(async {
        let store = Leased::new(tollgate::MemoryStore::new(), 5, Duration::from_secs(60))
            .unwrap()
            .max_identities(16);
        let policies =
            PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(3600)).unwrap());
        for n in 0..500 {
            let key = Key::new(format!("user:{n}"));
            assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
        }
    });
    assert_eq!(
        count(
            &events,
            Level::WARN,
            "Leased holds leases for as many identities"
        ),
        1,
        "{events:#?}"
    );
}

/// Every sentinel goes away (their addresses changed in a redeploy, a partition) while
/// the primary answers: the store works, and would follow no failover. Nothing was said;
/// it is said once at warn level, however many rounds find none.
#[cfg(feature = "redis")]
#[test]
fn sentinels_all_gone_are_said_once() {
    let primary = support::RedisServer::start();
    let sentinel = support::FakeSentinel::start(primary.port, false);
    let url = sentinel.url();
    let events = events_of(async move {
        let _store = tollgate::store::RedisConfig::sentinel([url], "mymaster")
            .connect()
            .await
            .expect("the sentinel names the primary");
        drop(sentinel);
        // The watch asks the sentinels every 2 s: three rounds.
        tokio::time::sleep(Duration::from_millis(6_500)).await;
    });
    let said = count(&events, Level::WARN, "no Redis sentinel answers");
    assert_eq!(said, 1, "{events:#?}");
}

/// A Cluster primary frozen (no replica to promote): the store checks it, connects anew,
/// and checks again, less and less often. The stall was said at warn level again at
/// every new connection when calls to the other shards were answered meanwhile, or when
/// a check asked another shard (for a call its client dropped) and found it answering;
/// it is said once while it goes on.
#[cfg(feature = "redis")]
#[test]
fn a_frozen_cluster_node_is_said_once_while_other_shards_answer() {
    use tollgate::{Key, PolicySet, Store};
    const STALL: &str = "a Redis Cluster node answers nothing";
    let cluster = support::RedisCluster::start(3);
    let holder = |key: &str| {
        cluster
            .nodes
            .iter()
            .position(|node| {
                node.cli(&["--scan", "--pattern", &format!("tollgate:{{{key}}}*")])
                    .contains("tollgate")
            })
            .expect("a node holds the key")
    };
    let recorder = Recorder::default();
    let stalls = |level| count(&recorder.events.lock().unwrap(), level, STALL);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut over_before_thaw = Vec::new();
    tracing::subscriber::with_default(recorder.clone(), || {
        runtime.block_on(async {
            let store = tollgate::store::RedisStore::connect_cluster(&cluster.urls())
                .await
                .unwrap();
            // A window that outlasts the test: the keys stay where they were decided.
            let policies = PolicySet::from(
                Policy::fixed_window("api", 1_000_000, Duration::from_secs(600)).unwrap(),
            );
            let names: Vec<String> = (0..12).map(|n| format!("k{n}")).collect();
            for name in &names {
                store.decide(&Key::new(name), &policies, 1).await.unwrap();
            }
            let frozen = holder(&names[0]);
            let healthy: Vec<&String> = names.iter().filter(|n| holder(n) != frozen).collect();
            assert!(!healthy.is_empty());
            cluster.nodes[frozen].signal("STOP");
            // Until two checks found the node answering nothing (two new connections,
            // the second after a longer wait), bounded.
            let until = std::time::Instant::now() + Duration::from_secs(60);
            let (mut answered, mut round) = (0, 0);
            while stalls(Level::WARN) + stalls(Level::DEBUG) < 3 {
                assert!(std::time::Instant::now() < until, "{:?}", recorder.events);
                // A call to a sound shard dropped by its client (gone, an HTTP/2 reset)
                // is unanswered too: a check may ask that shard, and find it answering.
                // Which of the two goes first alternates.
                round += 1;
                for first in [round % 2 == 0, round % 2 == 1] {
                    if first {
                        let stuck = store.decide(&Key::new(&names[0]), &policies, 1);
                        let _ = tokio::time::timeout(Duration::from_millis(50), stuck).await;
                    } else {
                        let key = Key::new(healthy[0].as_str());
                        let dropped = store.decide(&key, &policies, 1);
                        let _ = tokio::time::timeout(Duration::ZERO, dropped).await;
                    }
                }
                for name in &healthy {
                    let decided = store.decide(&Key::new(name.as_str()), &policies, 1);
                    let waited = tokio::time::timeout(Duration::from_millis(500), decided);
                    if let Ok(Ok(_)) = waited.await {
                        answered += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            over_before_thaw = recorder
                .events
                .lock()
                .unwrap()
                .iter()
                .filter(|event| event.contains("stalled answers again"))
                .cloned()
                .collect();
            cluster.nodes[frozen].signal("CONT");
            assert!(answered > 0, "the other shards answered");
        });
    });
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(count(&events, Level::WARN, STALL), 1, "{events:?}");
    assert_eq!(over_before_thaw, Vec::<String>::new(), "{events:?}");
}

/// A GraphQL coster placed inside the limiter that reads its cost (on the GraphQL route,
/// with the limiter on the whole router: the layout an app of REST and GraphQL routes
/// reaches for, as the coster answers 400 to JSON bodies that are not GraphQL) sets its
/// cost after the limiter decided: every query was charged the default, 1 where it costs
/// 101, and nothing said so. It is said at error level (once, again every ten minutes
/// while it goes on), and a coster with a limiter inside it that reads the cost is not
/// a mistake.
#[cfg(feature = "graphql")]
#[test]
fn a_graphql_coster_inside_the_limiter_that_reads_its_cost_is_said() {
    use axum::routing::post;
    use tollgate::cost::FromExtension;
    use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer};
    let limiter = || {
        RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::fixed_window("points", 100_000, Duration::from_secs(60)).unwrap())
            .cost(FromExtension::or(1))
            .key(Global)
    };
    let send = |app: Router| {
        let (remaining, events) = with_recorder(async {
            let mut remaining = Vec::new();
            for _ in 0..2 {
                let body = r#"{"query":"{ a(first: 100) { b(first: 100) { c } } }"}"#;
                let request = Request::post("/graphql")
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                assert_eq!(response.status(), 200);
                let rate = response.headers().get("ratelimit");
                remaining.push(
                    rate.map_or("none", |rate| rate.to_str().unwrap())
                        .to_owned(),
                );
            }
            remaining
        });
        let errors: Vec<String> = events
            .into_iter()
            .filter(|event| event.starts_with("ERROR"))
            .collect();
        (remaining, errors)
    };
    let coster = || GraphqlCostLayer::new(GraphqlCost::new());
    // The coster on its route, the limiter over the router: charged 1 each.
    let inside = Router::new()
        .route(
            "/graphql",
            post(|| async { "ok" }).layer::<_, std::convert::Infallible>(coster()),
        )
        .layer(limiter());
    let (remaining, errors) = send(inside);
    assert!(remaining[1].contains("r=99998"), "{remaining:?}");
    assert_eq!(errors.len(), 1, "said once: {errors:?}");
    assert!(
        errors[0].contains("GraphqlCostLayer") && errors[0].contains("never charged"),
        "{errors:?}"
    );
    // In the right order: charged the query's cost, nothing said.
    let outside = Router::new()
        .route("/graphql", post(|| async { "ok" }))
        .layer(limiter())
        .layer(coster());
    let (remaining, errors) = send(outside);
    assert!(remaining[1].contains("r=99798"), "{remaining:?}");
    assert!(errors.is_empty(), "{errors:?}");
    // A limiter outside that reads the cost and one inside the coster: the inner one
    // charges it, no mistake.
    let both = Router::new()
        .route(
            "/graphql",
            post(|| async { "ok" })
                .layer::<_, std::convert::Infallible>(limiter())
                .layer::<_, std::convert::Infallible>(coster()),
        )
        .layer(limiter());
    let (_, errors) = send(both);
    assert!(errors.is_empty(), "{errors:?}");
    // The limiter inside had the cost even when it let the request through without a
    // key (nor does a bypass, nor a key refused, make the layout a mistake).
    let keyed = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::fixed_window("points", 100_000, Duration::from_secs(60)).unwrap())
        .cost(FromExtension::or(1))
        .key(tollgate::key::HeaderKey::new("x-api-key"))
        .on_missing_key(tollgate::MissingKey::Allow);
    let anonymous = Router::new()
        .route(
            "/graphql",
            post(|| async { "ok" })
                .layer::<_, std::convert::Infallible>(keyed)
                .layer::<_, std::convert::Infallible>(coster()),
        )
        .layer(limiter());
    let (_, errors) = send(anonymous);
    assert!(errors.is_empty(), "{errors:?}");
    // An outer limiter that leaves the GraphQL route out (no policy for it) decided
    // nothing: the coster there (for its header, its refusals) is no mistake.
    let others_only = RateLimitLayer::new(MemoryStore::new())
        .resolver(tollgate::resolve::resolve_with(|parts, _key| {
            if parts.uri.path() == "/graphql" {
                tollgate::PolicySet::unlimited()
            } else {
                Policy::fixed_window("rest", 100, Duration::from_secs(60))
                    .unwrap()
                    .into()
            }
        }))
        .cost(FromExtension::or(1))
        .key(Global);
    let exempt = Router::new()
        .route(
            "/graphql",
            post(|| async { "ok" }).layer::<_, std::convert::Infallible>(coster()),
        )
        .layer(others_only);
    let (remaining, errors) = send(exempt);
    assert_eq!(remaining, ["none", "none"]);
    assert!(errors.is_empty(), "{errors:?}");
}

/// A limiter's waiter that gives up in the queue reads the key's state; a read the store
/// leaves unanswered is a store failure, counted and said as every one is. The waiter's
/// own bound (its wait and one store timeout) dropped the read just before the read's
/// timeout would have said so: nothing was counted, nothing said.
#[test]
fn a_waiters_read_the_store_leaves_unanswered_is_said() {
    use tollgate::limiter::{Limiter, WaitError};
    let events = events_of(async {
        let limiter = Limiter::new(
            support::PeekHangs(MemoryStore::new()),
            Policy::token_bucket("jobs", 1, tollgate::Rate::per_minute(1)).unwrap(),
        )
        .store_timeout(Duration::from_millis(50));
        let key = tollgate::Key::new("k");
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
        // Ahead: a waiter that sleeps for the next token, holding the turn.
        let ahead = {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(
                async move { limiter.until_ready(&key, 1, Duration::from_secs(120)).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        let behind = limiter
            .until_ready(&key, 1, Duration::from_millis(10))
            .await;
        assert!(matches!(behind, Err(WaitError::TooLong(_))), "{behind:?}");
        ahead.abort();
    });
    assert!(
        events
            .iter()
            .any(|event| event.contains("rate-limit store error") && event.contains("peek")),
        "{events:?}"
    );
}
