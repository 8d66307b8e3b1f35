//! Fault tests against a real redis-server: killed under load, restarted, paused; a
//! Sentinel-managed primary killed and switched over; a Cluster primary killed. Every
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
use tollgate::store::{RedisConfig, RedisStore};
use tollgate::{
    CircuitBreaker, DecideFuture, FailureMode, Key, LocalFallback, Policy, PolicySet, Rate,
    RateLimitLayer, Store, StoreErrorKind,
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

/// Sends requests from `tasks` tasks at once until `stop` is set, each answer checked as
/// [`Phase::all_answered`] does: the load a failover happens under.
fn background_load(
    app: &Router,
    tasks: usize,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(usize, usize)>> {
    (0..tasks)
        .map(|_| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut answered, mut unanswered) = (0, 0);
                while !stop.load(Ordering::SeqCst) && answered + unanswered < MAX_REQUESTS {
                    let (status, by) = request(&app).await;
                    if status == StatusCode::OK && by != DecidedBy::Nobody {
                        answered += 1;
                    } else {
                        unanswered += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                (answered, unanswered)
            })
        })
        .collect()
}

/// Runs `fail` under background load, then sends requests until Redis has decided 50
/// after it; every request, in the foreground and the background, must be answered.
/// Prints what happened, as `what`.
async fn failover_under_load(app: &Router, what: &str, fail: impl FnOnce()) -> Phase {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let background = background_load(app, 6, &stop);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let failed_at = Instant::now();
    fail();
    // The first answers after the failure come from the fallback; then Redis again.
    let mut seen_fallback = false;
    let mut back_at = None;
    let mut from_redis = 0;
    let phase = load(app, |by| {
        seen_fallback |= by == DecidedBy::Fallback;
        if seen_fallback && by == DecidedBy::Redis {
            back_at.get_or_insert_with(Instant::now);
            from_redis += 1;
        }
        from_redis >= 50
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for task in background {
        let (answered, unanswered) = task.await.unwrap();
        assert!(answered > 0, "a background task got no answer");
        assert_eq!(
            unanswered, 0,
            "{unanswered} background requests were not answered"
        );
    }
    assert!(
        phase.done,
        "Redis decided {from_redis} of {} requests in {:?} after the failure",
        phase.answers.len(),
        phase.elapsed
    );
    assert!(phase.all_answered(), "{:?}", phase.answers);
    let gap = back_at.expect("Redis decided again") - failed_at;
    println!(
        "{what}; Redis decided again after {gap:?}; the fallback answered {} of {} foreground \
         requests",
        phase.count(DecidedBy::Fallback),
        phase.answers.len()
    );
    phase
}

/// After a failover the store is exact again: 10 of 40 concurrent decisions under a
/// quota of 10, none failing. (A bucket that never refills: a window could end among
/// the 40, wherever the wall clock is, and admit more.)
async fn assert_exact(store: &impl Store, identity: &str) {
    let policies = PolicySet::from(
        Policy::token_bucket("exact", 10, Rate::new(1, tollgate::policy::MAX_PERIOD)).unwrap(),
    );
    let key = Key::new(identity);
    let decisions =
        futures_util::future::join_all((0..40).map(|_| store.decide(&key, &policies, 1))).await;
    let allowed = decisions
        .into_iter()
        .map(|decision| decision.expect("the store decides after the failover"))
        .filter(|decision| decision.is_allowed())
        .count();
    assert_eq!(allowed, 10, "not exact after the failover");
}

/// Waits (bounded) until `check` holds, polling every 50 ms.
fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A primary, its replica and three sentinels (quorum 2) that know both and each other.
fn sentinel_set() -> (RedisServer, RedisServer, Vec<RedisServer>) {
    let primary = RedisServer::start();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
    wait_for("the replica to sync", || {
        replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    });
    let sentinels: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::sentinel(primary.port, "mymaster", 2))
        .collect();
    for sentinel in &sentinels {
        wait_for("the sentinels to find the replica and each other", || {
            let master = sentinel.cli(&["SENTINEL", "master", "mymaster"]);
            let replicas = sentinel.cli(&["SENTINEL", "replicas", "mymaster"]);
            replicas.contains(&replica.port.to_string())
                && master
                    .lines()
                    .skip_while(|line| *line != "num-other-sentinels")
                    .nth(1)
                    == Some("2")
        });
    }
    (primary, replica, sentinels)
}

/// The app over `redis`, once Redis has decided 50 requests (all answered).
async fn healthy_app(redis: RedisStore) -> (Counted, Router) {
    let store = Counted {
        inner: redis,
        calls: Arc::default(),
    };
    let app = app(store.clone());
    let healthy = until_decided_by(&app, DecidedBy::Redis, 50).await;
    assert!(
        healthy.done && healthy.all_answered(),
        "{:?}",
        healthy.answers
    );
    (store, app)
}

/// Where the store finds the primary: the set's sentinels, which name it `mymaster`.
fn sentinel_config(sentinels: &[RedisServer]) -> RedisConfig {
    RedisConfig::sentinel(sentinels.iter().map(RedisServer::url), "mymaster")
}

/// The port of the primary that `sentinel` names.
fn named_primary(sentinel: &RedisServer) -> u16 {
    let reply = sentinel.cli(&["SENTINEL", "get-master-addr-by-name", "mymaster"]);
    number(reply.lines().nth(1).unwrap_or(""), "the primary's port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_after_the_primary_is_killed() {
    let (mut primary, replica, sentinels) = sentinel_set();
    let (store, app) = healthy_app(sentinel_config(&sentinels).connect().await.unwrap()).await;
    assert!(
        !keys_with_ttl(&primary).is_empty(),
        "nothing was written to the primary"
    );

    let failover =
        failover_under_load(&app, "Sentinel: the primary was killed", || primary.kill()).await;
    assert!(failover.count(DecidedBy::Fallback) > 0);
    // The replica was promoted, and the store writes there.
    assert_eq!(named_primary(&sentinels[0]), replica.port);
    assert!(
        replica
            .cli(&["INFO", "replication"])
            .contains("role:master")
    );
    assert_clean(&replica);
    assert_exact(&store.inner, "after-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_switchover_never_writes_to_the_demoted_primary() {
    let (primary, replica, sentinels) = sentinel_set();
    let store = sentinel_config(&sentinels)
        .prefix("switch")
        .connect()
        .await
        .unwrap();
    let policies =
        PolicySet::from(Policy::token_bucket("api", 1_000_000, Rate::per_day(100_000)).unwrap());
    let key = Key::new("switch");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());

    // A planned failover: the old primary stays up, as a replica.
    assert_eq!(
        sentinels[0]
            .cli(&["SENTINEL", "FAILOVER", "mymaster"])
            .trim(),
        "OK"
    );
    let deadline = Instant::now() + DEADLINE;
    let mut failures = Vec::new();
    let mut decided_after = 0;
    // Deciding all along, until the sentinels have demoted the old primary and 50
    // decisions have been made since.
    let demoted = || primary.cli(&["INFO", "replication"]).contains("role:slave");
    while decided_after < 50 {
        assert!(
            Instant::now() < deadline,
            "not back on a primary: {failures:?}"
        );
        match store.decide(&key, &policies, 1).await {
            Ok(_) if named_primary(&sentinels[0]) == replica.port && demoted() => {
                decided_after += 1;
            }
            Ok(_) => {}
            Err(error) => failures.push((error.kind(), error.code().map(str::to_owned))),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A demoted primary's READONLY is a failover in progress, never a refusal (which the
    // layer would log as a misconfiguration).
    assert!(
        failures.iter().all(|(kind, _)| kind.is_io()),
        "failures during the switchover: {failures:?}"
    );
    println!("Sentinel switchover: {} decisions failed", failures.len());
    // The decisions since the demotion went to the new primary: its copy of the bucket is
    // the newest (the demoted one replicates it).
    assert!(
        replica
            .cli(&["INFO", "replication"])
            .contains("role:master")
    );
    assert_exact(&store, "after-switchover").await;
}

/// The index of the Cluster primary that holds the app's key (`Global`).
fn global_owner(cluster: &support::RedisCluster) -> usize {
    cluster
        .nodes
        .iter()
        .position(|node| {
            node.cli(&["INFO", "replication"]).contains("role:master")
                && node
                    .cli(&["--scan", "--pattern", "tollgate:{global}*"])
                    .contains("tollgate")
        })
        .expect("a primary holds the key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_after_a_primary_is_killed() {
    let mut cluster = support::RedisCluster::start_with_replicas(3, 1, 1000);
    let (store, app) =
        healthy_app(RedisStore::connect_cluster(&cluster.urls()).await.unwrap()).await;
    // The primary that holds the app's key (and its replica, which has a copy).
    let owner = global_owner(&cluster);
    let failover = failover_under_load(&app, "Cluster: a primary was killed", || {
        cluster.nodes[owner].kill()
    })
    .await;
    assert!(failover.count(DecidedBy::Fallback) > 0);
    // The identity whose slot the killed primary held.
    assert_exact(&store.inner, "global").await;
    // Decided by the library's functions on the Cluster (the promoted replica had them).
    let fcalls: u64 = cluster
        .nodes
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != owner)
        .map(|(_, node)| support::command_calls(node, "fcall"))
        .sum();
    assert!(fcalls > 0);
}

/// A Cluster primary frozen, not dead (its host cut off, the process stopped): no
/// connection is reset and no `MOVED` comes, so the Cluster client, which learns the
/// topology again only from those, sent that shard's calls to the frozen node for as long
/// as it stayed frozen, while the Cluster had long promoted its replica: the failure mode
/// decided that shard's identities for good. The store must find the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store_leaves_a_primary_that_stops_answering() {
    let cluster = support::RedisCluster::start_with_replicas(3, 1, 1000);
    let (store, app) =
        healthy_app(RedisStore::connect_cluster(&cluster.urls()).await.unwrap()).await;
    let owner = global_owner(&cluster);
    failover_under_load(&app, "Cluster: a primary froze", || {
        cluster.nodes[owner].signal("STOP")
    })
    .await;
    cluster.nodes[owner].signal("CONT");
    assert_exact(&store.inner, "global").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_store_leaves_a_primary_that_stops_answering() {
    let (primary, replica, sentinels) = sentinel_set();
    let (store, app) = healthy_app(sentinel_config(&sentinels).connect().await.unwrap()).await;

    // Frozen, not dead: no connection is reset, requests just get no answer (the layer's
    // timeout drops them). The store must still leave it for the promoted replica.
    failover_under_load(&app, "Sentinel: the primary froze", || {
        primary.signal("STOP")
    })
    .await;
    assert_eq!(named_primary(&sentinels[0]), replica.port);
    primary.signal("CONT");
    assert_exact(&store.inner, "after-freeze").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_misconfigurations_fail_at_start_and_say_why() {
    let (_primary, _replica, sentinels) = sentinel_set();
    let urls: Vec<String> = sentinels.iter().map(RedisServer::url).collect();
    // A name no sentinel monitors: a configuration error, not "unavailable".
    let unknown = RedisConfig::sentinel(urls.iter().cloned(), "nosuchmaster")
        .connect()
        .await
        .expect_err("an unknown primary name is refused");
    assert!(!unknown.kind().is_io(), "{unknown}");
    assert!(unknown.to_string().contains("nosuchmaster"), "{unknown}");
    // No sentinel reachable: unavailable, and it says so.
    let port = support::free_port();
    let nobody = RedisConfig::sentinel([format!("redis://127.0.0.1:{port}")], "mymaster")
        .connect()
        .await
        .expect_err("no sentinel answers");
    assert!(nobody.kind().is_io(), "{nobody}");
    // A wrong password for the primary: refused, loudly, without the password.
    let refused = RedisConfig::sentinel(urls.iter().cloned(), "mymaster")
        .master_auth(Some("nobody"), "wrong-secret")
        .connect()
        .await
        .expect_err("a wrong password is refused");
    assert!(!refused.kind().is_io(), "{refused}");
    assert!(!refused.to_string().contains("wrong-secret"), "{refused}");
}

/// A sentinel cut off from the servers still names the primary it knew (here the
/// replica). The look-up goes past its answer (that server is no primary) to the next
/// sentinel's; the watch, which asks the first sentinel that answers, left the sound
/// primary every time it asked (every 2 s), for a look-up that connected straight back:
/// a new connection, and with the stale server's host gone a second of the failure mode
/// each time. It now leaves only for a server that says it is the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sentinel_does_not_move_the_store_off_a_sound_primary() {
    let (primary, replica, sentinels) = sentinel_set();
    let stale = support::FakeSentinel::start(replica.port, false);
    let urls = std::iter::once(stale.url()).chain(sentinels.iter().map(RedisServer::url));
    let store = RedisConfig::sentinel(urls, "mymaster")
        .connect()
        .await
        .unwrap();
    let (_store, app) = healthy_app(store).await;
    let before = deciding_clients(&primary);
    assert_eq!(before.len(), 1, "one connection decides: {before:?}");
    // A round stops waiting once most sentinels (the three real ones) agree: the stale
    // one may not have been asked yet, so a round is counted by any of them.
    let heard = |sentinels: &[RedisServer]| -> u64 {
        sentinels
            .iter()
            .map(|sentinel| support::connections_received(sentinel, None))
            .sum()
    };
    let (asked, connected) = (stale.asked(), heard(&sentinels));
    // The watch asks the sentinels every fourth tick of 500 ms: a few times in 5 s.
    let until = Instant::now() + Duration::from_secs(5);
    let mut answers = Vec::new();
    while Instant::now() < until {
        answers.push(request(&app).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each count opens a connection of its own: one per real sentinel.
    assert!(
        stale.asked() > asked || heard(&sentinels) > connected + 3,
        "the watch asked no sentinel"
    );
    assert!(
        answers
            .iter()
            .all(|answer| *answer == (StatusCode::OK, DecidedBy::Redis)),
        "{answers:?}"
    );
    assert_eq!(
        deciding_clients(&primary),
        before,
        "the store left the primary and connected anew"
    );
}

/// Three fake sentinels naming `old` (then `down`, a sentinel URL nothing answers, when
/// given), a store on them serving an app that has decided on `old`; then two of the
/// three name `new`, and the app is served until it decides there (else fails with
/// `stayed`).
async fn two_of_three_fail_over(
    old: &RedisServer,
    new: &RedisServer,
    down: Option<String>,
    stayed: &str,
) -> (Vec<support::FakeSentinel>, Counted, Router) {
    let sentinels: Vec<_> = (0..3)
        .map(|_| support::FakeSentinel::start(old.port, false))
        .collect();
    let urls = sentinels.iter().map(support::FakeSentinel::url).chain(down);
    let store = RedisConfig::sentinel(urls, "mymaster")
        .connect()
        .await
        .unwrap();
    let (store, app) = healthy_app(store).await;
    assert!(
        !keys_with_ttl(old).is_empty(),
        "decided on the first primary"
    );
    sentinels[1].name(new.port);
    sentinels[2].name(new.port);
    until_decided_on(&app, new, stayed).await;
    (sentinels, store, app)
}

/// Requests to `app`, one every 100 ms, for `how_long`.
async fn requests_for(app: &Router, how_long: Duration) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        request(app).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends requests to `app` until one is decided on `server` (a key with a TTL there): the
/// watch asks the sentinels every 2 s, so for up to 10 s, else fails with `stayed`.
async fn until_decided_on(app: &Router, server: &RedisServer, stayed: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while keys_with_ttl(server).is_empty() {
        assert!(Instant::now() < until, "{stayed}");
        request(app).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first sentinel names a server that is gone (stale, or its host replaced), so the
/// look-up goes on to the second. The second then sees a failover: the watch must hear
/// of it. It asked the first sentinel only, whose answer names no primary, and stayed
/// on the deposed one (which, cut off from the sentinels, still answers as a primary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_hears_of_a_failover_past_a_stale_first_sentinel() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let stale = support::FakeSentinel::start(support::free_port(), false);
    let seeing = support::FakeSentinel::start(old.port, false);
    let store = RedisConfig::sentinel([stale.url(), seeing.url()], "mymaster")
        .connect()
        .await
        .unwrap();
    let (_store, app) = healthy_app(store).await;
    assert!(
        !keys_with_ttl(&old).is_empty(),
        "decided on the first primary"
    );
    seeing.name(new.port);
    until_decided_on(&app, &new, "the store stayed on the deposed primary").await;
}

/// The first sentinel listed is cut off with the old primary (which, cut off too, still
/// answers as a primary) and keeps naming it; the two others failed over to a new one.
/// The watch asked the sentinels in order and stopped at the first that named the
/// primary it had: the store stayed on the deposed primary for as long as the partition
/// lasted, beside replicas following the others (two primaries, each its own limits).
/// The sentinels are asked together and the most of them are followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinels_most_of_them_are_followed_past_a_stale_first_one() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let (_sentinels, _store, app) = two_of_three_fail_over(
        &old,
        &new,
        None,
        "the store stayed on the primary one stale sentinel names",
    )
    .await;
    // And it stays there: the stale sentinel, asked first, does not pull it back.
    let on_old = support::script_stats(&old).0;
    requests_for(&app, Duration::from_secs(3)).await;
    assert_eq!(
        support::script_stats(&old).0,
        on_old,
        "back on the old primary"
    );
}

/// Two of four sentinels followed a failover to `new`; one, cut off, still names the
/// deposed `old`, which (cut off too) still answers as a primary; the fourth is down, so
/// every answer is heard. When `new` then stops answering, the look-up went past it to
/// the one stale sentinel's server: the store wrote its counts on a deposed primary,
/// whose writes go when it rejoins, beside replicas on the others. A server fewer
/// sentinels name than another is not followed: the failure mode decides until the
/// most-named answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sentinel_does_not_pull_the_store_back_when_the_primary_stops_answering() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let down = format!("redis://127.0.0.1:{}", support::free_port());
    let (_sentinels, _store, app) = two_of_three_fail_over(
        &old,
        &new,
        Some(down),
        "the store did not follow the failover",
    )
    .await;
    // The new primary stops answering: its connections reset, then frozen.
    new.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
    new.signal("STOP");
    let on_old = support::script_stats(&old).0;
    requests_for(&app, Duration::from_secs(4)).await;
    let on_old_after = support::script_stats(&old).0;
    new.signal("CONT");
    assert_eq!(
        on_old_after, on_old,
        "the store went back to the deposed primary"
    );
}

/// Every sentinel names a server that takes connections and answers nothing (a host
/// black-holed, a process frozen). The watch asks it, once a round, whether it is the
/// primary: it asked once per sentinel naming it, each a connection and a second's
/// wait, and meanwhile the primary it has went unchecked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_asks_a_server_named_twice_once_a_round() {
    let primary = RedisServer::start();
    let silent = support::SilentServer::start();
    let sentinels: Vec<_> = (0..3)
        .map(|_| support::FakeSentinel::start(primary.port, false))
        .collect();
    let store = RedisConfig::sentinel(sentinels.iter().map(support::FakeSentinel::url), "mymaster")
        .connect()
        .await
        .unwrap();
    let (_store, app) = healthy_app(store).await;
    for sentinel in &sentinels {
        sentinel.name(silent.port);
    }
    // A round asks the three together and stops waiting once two agree: the third may
    // not have been asked yet, so no one sentinel counts the rounds. Each round that got
    // as far as the server they name was heard by two of them at least, so there were at
    // most half as many of those as questions heard.
    let heard = || -> Vec<u64> { sentinels.iter().map(support::FakeSentinel::asked).collect() };
    let before = heard();
    let since = || {
        heard()
            .iter()
            .zip(&before)
            .map(|(now, then)| now - then)
            .collect::<Vec<_>>()
    };
    // Each sentinel asked twice: two rounds begun, the first has ended.
    let until = Instant::now() + Duration::from_secs(30);
    while since().iter().any(|asked| *asked < 2) {
        assert!(Instant::now() < until, "the watch asked no sentinel");
        request(&app).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let asked = silent.accepted();
    let rounds = since().iter().sum::<u64>() / 2;
    assert!(
        asked <= rounds,
        "{asked} connections in at most {rounds} rounds"
    );
    assert!(
        asked >= 1,
        "the watch never asked the server the sentinels name"
    );
}

/// A stale sentinel names a server (a primary of its own: a split-off node) that refuses
/// the store's credentials (ACLs are not replicated, and it never had the user); the next
/// sentinel names the primary that has them. One server's refusal (its password, its
/// TLS certificate) is not every server's: the look-up goes on to the next sentinel's
/// answer, where it stopped at the first refusal and failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_servers_refusal_does_not_stop_the_sentinel_look_up() {
    let (refusing, primary) = (RedisServer::start(), RedisServer::start());
    let added = primary.cli(&[
        "ACL", "SETUSER", "limiter", "on", ">s3cret", "~*", "&*", "+@all",
    ]);
    assert_eq!(added.trim(), "OK");
    let stale = support::FakeSentinel::start(refusing.port, false);
    let seeing = support::FakeSentinel::start(primary.port, false);
    let store = RedisConfig::sentinel([stale.url(), seeing.url()], "mymaster")
        .master_auth(Some("limiter"), "s3cret")
        .connect()
        .await
        .expect("the second sentinel's primary takes the credentials");
    assert_exact(&store, "past-a-refusal").await;
    assert!(keys_with_ttl(&refusing).is_empty());
}

/// A sentinel refuses its password, and the only other one is down: the look-up fails
/// with the refusal (a password to fix, which the breaker holds requests off for and the
/// logs say at error level), not with the last sentinel's "connection refused" (an
/// outage to wait out). The password is not shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_refusing_its_password_beside_one_down_is_a_refusal() {
    let refusing = support::FakeSentinel::start(6379, true);
    let down = format!("redis://127.0.0.1:{}", support::free_port());
    let error = RedisConfig::sentinel(
        [refusing.url_with_password("rotated-secret"), down],
        "mymaster",
    )
    .connect()
    .await
    .expect_err("no sentinel named the primary");
    assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
    assert!(!error.to_string().contains("rotated-secret"), "{error}");
    assert!(
        error.to_string().contains(&refusing.port.to_string()),
        "which sentinel: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_works_with_the_least_privilege_user() {
    let (primary, replica, sentinels) = sentinel_set();
    // The README's line and `+role` (the store asks the primary what it is), on both
    // servers: ACLs are not replicated.
    let acl = "ACL SETUSER limiter on >s3cret resetkeys ~tollgate:* resetchannels -@all \
               +fcall +function|load +evalsha +eval +script|load +time +get +set +hmget +hset +pexpire +pttl +zadd \
               +zrange +zrangebyscore +zremrangebyscore +zcard +zrem +del +role";
    let args: Vec<&str> = acl.split_whitespace().collect();
    for server in [&primary, &replica] {
        assert_eq!(server.cli(&args).trim(), "OK");
    }
    let store = sentinel_config(&sentinels)
        .master_auth(Some("limiter"), "s3cret")
        .connect()
        .await
        .expect("the least-privilege user runs every script through Sentinel");
    assert_exact(&store, "least-privilege").await;
    // Through the library's functions, not the scripts.
    assert!(support::command_calls(&primary, "fcall") > 0);
}

/// The primary's password is rotated under a Sentinel store, and its connection breaks:
/// each look-up is refused. That is every request's refusal, which holds the breaker
/// open as a pool's or a single connection's refused password does. The look-up's
/// failure lost it (it kept only the kind and message), so the breaker stayed closed and
/// every request after the 100 ms back-off looked the primary up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_refusing_its_password_behind_sentinel_opens_the_breaker() {
    let (primary, replica, sentinels) = sentinel_set();
    for server in [&primary, &replica] {
        let added = server.cli(&[
            "ACL", "SETUSER", "limiter", "on", ">first", "~*", "&*", "+@all",
        ]);
        assert_eq!(added.trim(), "OK");
    }
    let store = sentinel_config(&sentinels)
        .master_auth(Some("limiter"), "first")
        .connect()
        .await
        .expect("connected with the first password");
    let (store, app) = healthy_app(store).await;
    // Rotated on the primary, and the store's connection broken.
    let rotated = primary.cli(&["ACL", "SETUSER", "limiter", "resetpass", ">second"]);
    assert_eq!(rotated.trim(), "OK");
    primary.cli(&["CLIENT", "KILL", "USER", "limiter"]);
    // Requests 20 ms apart for a second: the first few meet the refusal (and open the
    // breaker), the rest are answered by the fallback without asking the store.
    let mut answers = Vec::new();
    let before = store.calls();
    let started = Instant::now();
    for _ in 0..50 {
        answers.push(request(&app).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    assert!(
        answers.iter().any(|(_, by)| *by == DecidedBy::Fallback),
        "{answers:?}"
    );
    // The failures that open it, and one probe per cool-down since.
    let probes = (started.elapsed().as_millis() / BREAKER_COOL_DOWN.as_millis()) as u64 + 1;
    let asked = store.calls() - before;
    assert!(
        asked <= BREAKER_FAILURES + probes,
        "the store was asked {asked} times in 50 requests: the breaker did not open"
    );
}

/// The ids of `server`'s clients whose last command ran the library (`fcall`, `evalsha`).
fn deciding_clients(server: &RedisServer) -> Vec<String> {
    server
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter(|line| line.contains("cmd=fcall") || line.contains("cmd=evalsha"))
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("id="))
                .map(str::to_owned)
        })
        .collect()
}

/// A failover behind one name (a managed primary endpoint, a virtual IP, a Kubernetes
/// service): the old primary is demoted by `REPLICAOF` and stays up, answering
/// `READONLY`. That is a failover in progress, so it counts as unavailable (the breaker
/// and the failure mode see an outage, not a refusal), and the store leaves that
/// connection: the next decision connects anew, resolving the name again, where a
/// connection kept would be sent to the demoted primary for as long as it answers.
/// A multiplexed connection and a pool alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_behind_one_url_is_an_outage_and_its_connection_is_left() {
    let other = RedisServer::start();
    let bucket =
        PolicySet::from(Policy::token_bucket("api", 1_000_000, Rate::per_day(100_000)).unwrap());
    // An in-flight limit: the decision checks a pool's connection out for its script and
    // the release behind it.
    let in_flight = PolicySet::from(Policy::concurrency("busy", 1_000_000).unwrap());
    let key = Key::new("demoted");
    for (backend, policies) in [
        ("multiplexed", &bucket),
        ("pool", &bucket),
        ("pool, in flight", &in_flight),
    ] {
        let server = RedisServer::start();
        let store = match backend {
            "multiplexed" => RedisStore::connect(&server.url()).await.unwrap(),
            // One connection, so the one that met the demotion is the one to leave.
            _ => {
                let mut config = deadpool_redis::Config::from_url(server.url());
                config.pool = Some(deadpool_redis::PoolConfig::new(1));
                let pool = config
                    .create_pool(Some(deadpool_redis::Runtime::Tokio1))
                    .unwrap();
                let store = RedisStore::from_pool(pool);
                store.verify().await.unwrap();
                store
            }
        };
        assert!(store.decide(&key, policies, 1).await.unwrap().is_allowed());
        let before = deciding_clients(&server);
        assert!(!before.is_empty(), "{backend}: no deciding client");

        let port = other.port.to_string();
        assert_eq!(server.cli(&["REPLICAOF", "127.0.0.1", &port]).trim(), "OK");
        let error = store.decide(&key, policies, 1).await.unwrap_err();
        assert_eq!(
            (error.kind(), error.code()),
            (tollgate::StoreErrorKind::Unavailable, Some("READONLY")),
            "{backend}: {error}"
        );

        // Primary again (as the name would point at a new one): decisions resume, on a
        // connection made since the demotion.
        assert_eq!(server.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
        let deadline = Instant::now() + DEADLINE;
        loop {
            match store.decide(&key, policies, 1).await {
                Ok(decision) => {
                    assert!(decision.is_allowed());
                    break;
                }
                Err(error) => assert!(
                    Instant::now() < deadline,
                    "{backend}: no decision after the demotion: {error}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = deciding_clients(&server);
        assert!(
            after.iter().any(|id| !before.contains(id)),
            "{backend}: still on the demoted primary's connection ({before:?}, then {after:?})"
        );
    }
}

/// A URL that names a read-only replica (a reader endpoint given by mistake) fails at
/// start-up with the server's words, as the docs promise: counted as an outage once
/// running (a failover), `READONLY` at start is a misconfiguration, not a server that
/// will answer in a moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_replica_fails_at_start_up() {
    let primary = RedisServer::start();
    let port = primary.port.to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let error = RedisStore::connect(&replica.url()).await.unwrap_err();
    assert_eq!(error.code(), Some("READONLY"), "{error}");
    assert!(!error.kind().is_io(), "{error}");
}

/// A primary that lost its replicas under `min-replicas-to-write` (which the README
/// recommends for Sentinel) answers writes `NOREPLICAS` until a replica is back: an
/// outage in passing, as `MASTERDOWN` is, for the breaker and the failure mode; not a
/// refusal logged as a bug, which keeps every request going to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_without_its_replicas_is_an_outage_not_a_refusal() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let (policies, key) = deciding(&store, "no-replicas").await;
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "min-replicas-to-write", "1"])
            .trim(),
        "OK"
    );
    let error = store.decide(&key, &policies, 1).await.unwrap_err();
    assert_eq!(
        error.kind(),
        tollgate::StoreErrorKind::Unavailable,
        "{error} ({:?})",
        error.code()
    );
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "min-replicas-to-write", "0"])
            .trim(),
        "OK"
    );
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
}

/// A TCP relay on loopback in front of a server: [`Relay::freeze`] stops every connection
/// made so far from passing bytes either way, resetting none (a server frozen by a long
/// stall, or a host gone without a word, while its name moves on), and connections made
/// after it go through; [`Relay::thaw`] lets them pass again, what they held first.
/// Stops with the test's runtime.
struct Relay {
    port: u16,
    /// Connections numbered below this are frozen.
    frozen_below: Arc<AtomicU64>,
    made: Arc<AtomicU64>,
}

impl Relay {
    async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen_below = Arc::new(AtomicU64::new(0));
        let made = Arc::new(AtomicU64::new(0));
        let (frozen, count) = (Arc::clone(&frozen_below), Arc::clone(&made));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let number = count.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to) in [
                    (
                        Box::new(client_read) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        Box::new(server_write) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(server_read), Box::new(client_write)),
                ] {
                    let frozen = Arc::clone(&frozen);
                    tokio::spawn(pump(from, to, number, frozen));
                }
            }
        });
        Self {
            port,
            frozen_below,
            made,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Every connection made so far passes nothing more.
    fn freeze(&self) {
        self.frozen_below
            .store(self.made.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Every connection passes bytes again (the stall is over).
    fn thaw(&self) {
        self.frozen_below.store(0, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either ends; holds what it read while connection `number`
/// is frozen.
async fn pump(
    mut from: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
    mut to: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    number: u64,
    frozen_below: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        while number < frozen_below.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// One URL (a managed primary endpoint, a virtual IP, a Kubernetes service) whose server
/// stops answering without closing the connection (a long stall, a host gone without a
/// reset) while the name moves on: each decision is dropped by the layer's timeout, so
/// the connection itself never sees an error. The store must notice that it gets no
/// answers, check, and connect anew, as the Sentinel backend leaves a primary that stops
/// answering; not sit on the fallback until TCP gives up (a quarter of an hour) or for
/// ever (a stall that keeps acknowledging).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_is_left_for_a_new_one() {
    let server = RedisServer::start();
    let relay = Relay::start(server.port).await;
    let (store, app) = healthy_app(RedisStore::connect(&relay.url()).await.unwrap()).await;
    assert_eq!(
        relay.made.load(Ordering::SeqCst),
        1,
        "one multiplexed connection"
    );
    failover_under_load(&app, "one URL: the connection froze", || relay.freeze()).await;
    assert!(relay.made.load(Ordering::SeqCst) > 1, "connected anew");
    assert_exact(&store.inner, "after-frozen-connection").await;
}

/// An in-flight decision dropped on a connection that stalled (its script held on the way)
/// gives its slot back with a release sent behind its script, on that connection: Redis
/// runs a connection's commands in order, so the release cannot overtake the script and
/// find nothing to free. The connection was replaced meanwhile (three calls unanswered,
/// and a `PING` too), and the release went on the new one: it ran at once and freed
/// nothing, and when the stall ended the script took the slot, held for its lease (a
/// minute), with nothing in flight: the identity's requests were refused meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_decisions_release_follows_its_script_on_a_connection_replaced_since() {
    let server = RedisServer::start();
    let relay = Relay::start(server.port).await;
    let store = RedisStore::connect(&relay.url())
        .await
        .unwrap()
        .coalescing(false);
    let policies = PolicySet::from(Policy::concurrency("one", 1).unwrap());
    let key = Key::new("stalled");
    relay.freeze();
    let made = relay.made.load(Ordering::SeqCst);
    // On its way, held by the stall.
    let mut stalled = Box::pin(store.decide(&key, &policies, 1));
    let waited = tokio::time::timeout(Duration::from_millis(50), &mut stalled).await;
    assert!(waited.is_err(), "the stall holds the decision");
    // Three calls unanswered have the connection checked, and left for a new one.
    for other in 0..3 {
        let other = Key::new(format!("other-{other}"));
        let _ = tokio::time::timeout(
            Duration::from_millis(50),
            store.decide(&other, &policies, 1),
        )
        .await;
    }
    let started = Instant::now();
    while relay.made.load(Ordering::SeqCst) == made && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(relay.made.load(Ordering::SeqCst) > made, "connected anew");
    // Its client gives up; then the stall ends, and the script runs.
    drop(stalled);
    tokio::time::sleep(Duration::from_millis(50)).await;
    relay.thaw();
    let started = Instant::now();
    let mut admitted = false;
    while started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let decided =
            tokio::time::timeout(Duration::from_secs(1), store.decide(&key, &policies, 1)).await;
        if let Ok(Ok(decision)) = decided
            && decision.is_allowed()
        {
            admitted = true;
            break;
        }
    }
    assert!(admitted, "the dropped decision's slot is still held");
}

/// An in-flight slot taken by a decision whose answer then could not be read (a reply of
/// the wrong shape: a protocol error, which the failure mode answers) is given back at
/// once. The request it was taken for did not get it, so nothing would ever release it:
/// it was held until its lease ran out (a minute by default), and the next request of
/// the identity was refused meanwhile. The library's functions are made to answer 20
/// numbers too many, then put back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_taken_by_a_decision_whose_answer_cannot_be_read_is_given_back() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policies = PolicySet::new(vec![
        Policy::concurrency("busy", 1).unwrap(),
        Policy::token_bucket("api", 1_000, Rate::per_day(1_000)).unwrap(),
    ])
    .unwrap();
    // The library is loaded by a first decision (of another identity).
    store
        .decide(&Key::new("loader"), &policies, 1)
        .await
        .unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let listed: redis::Value = redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("WITHCODE")
        .query_async(&mut connection)
        .await
        .unwrap();
    let code = library_code(&listed).expect("tollgate's library is loaded");
    let body = "    return body()\n";
    assert!(code.contains(body), "the library's entry point changed");
    let tampered = code.replace(
        body,
        "    local reply = body()\n    for _ = 1, 20 do reply[#reply + 1] = 0 end\n    return reply\n",
    );
    let load = |code: String| {
        let mut connection = connection.clone();
        async move {
            redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(code)
                .query_async::<String>(&mut connection)
                .await
                .unwrap()
        }
    };
    load(tampered).await;
    let key = Key::new("unreadable");
    let error = store.decide(&key, &policies, 1).await.unwrap_err();
    assert_eq!(error.kind(), tollgate::StoreErrorKind::Protocol, "{error}");
    load(code).await;
    // Given back in the background: wait for it, far less than the lease's minute.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let decision = store.decide(&key, &policies, 1).await.unwrap();
        if decision.is_allowed() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot is still held 10 s after the unreadable answer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The code of tollgate's library in a `FUNCTION LIST WITHCODE` reply.
fn library_code(listed: &redis::Value) -> Option<String> {
    use redis::Value;
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    };
    let Value::Array(libraries) = listed else {
        return None;
    };
    libraries.iter().find_map(|library| {
        let fields: Vec<&Value> = match library {
            Value::Array(fields) => fields.iter().collect(),
            Value::Map(pairs) => pairs.iter().flat_map(|(k, v)| [k, v]).collect(),
            _ => return None,
        };
        let field = |name: &str| {
            fields
                .chunks(2)
                .find(|pair| text(pair[0]).as_deref() == Some(name))
                .and_then(|pair| text(pair[1]))
        };
        field("library_name")
            .filter(|name| name.starts_with("tollgate_"))
            .and(field("library_code"))
    })
}

/// A pool that cannot authenticate (a password rotated under it) is a refusal, not an
/// outage: deadpool hands back the server's `WRONGPASS` as its own error, which was
/// counted as "unavailable" (debug lines, the breaker, the failure mode for good) and
/// passed the start-up check with a warning. It is `Refused` now, on a decision and at
/// start-up, and never says the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_cannot_authenticate_is_refused_not_an_outage() {
    let server = RedisServer::start();
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "requirepass", "right-secret"])
            .trim(),
        "OK"
    );
    let url = format!("redis://:wrong-secret@127.0.0.1:{}", server.port);
    let pool = deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool");
    let store = RedisStore::from_pool(pool);
    let policies =
        PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap());
    let error = store
        .decide(&Key::new("client"), &policies, 1)
        .await
        .expect_err("a wrong password answers nothing");
    assert_eq!(error.kind(), StoreErrorKind::Refused, "{error}");
    assert!(!error.to_string().contains("wrong-secret"), "{error}");
    let at_start = store.verify().await.expect_err("refused at start-up");
    assert!(!at_start.kind().is_io(), "{at_start}");
    // Behind the layer: every request is answered by the failure mode, and the breaker
    // holds them off the pool as it does in an outage, so that each does not open (and
    // authenticate) a connection of its own to be refused. The breaker opens after 5
    // failures, and probes once a minute.
    let connections = || support::connections_received(&server, Some("right-secret"));
    let before = connections();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(store)
            .policy(Policy::fixed_window("api", 1_000, Duration::from_secs(60)).unwrap())
            .key(Global)
            .circuit_breaker(CircuitBreaker::new(5, Duration::from_secs(60))),
    );
    for _ in 0..50 {
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let opened = connections() - before;
    assert!(opened <= 6, "{opened} connections for 50 requests");
    // The right password: decided.
    let url = format!("redis://:right-secret@127.0.0.1:{}", server.port);
    let pool = deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool");
    let store = RedisStore::from_pool(pool);
    assert!(
        store
            .decide(&Key::new("client"), &policies, 1)
            .await
            .unwrap()
            .is_allowed()
    );
}

/// A pool whose `post_create` hook fails (it selects a database, sets a client name,
/// runs a tenant's set-up) fails every checkout the same way: a set-up error, which was
/// counted as "unavailable" (an outage: debug lines, the breaker, the failure mode for
/// good) and passed the start-up check with a warning. A hook's own error is a non-I/O
/// error every request meets now, one the server sent the hook is sorted as that error
/// is, and `verify` refuses both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_set_up_hook_fails_is_a_set_up_error_not_an_outage() {
    use deadpool_redis::{Hook, HookError};
    let server = RedisServer::start();
    let policies =
        PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap());
    let message = Hook::sync_fn(|_, _| Err(HookError::message("tenant not provisioned")));
    // The server refuses the hook's command: a Redis error, not the network's.
    let refused = Hook::async_fn(|connection, _| {
        Box::pin(async move {
            redis::cmd("NO-SUCH-COMMAND")
                .query_async::<()>(connection)
                .await
                .map_err(HookError::Backend)
        })
    });
    for (hook, says) in [
        (message, "tenant not provisioned"),
        (refused, "NO-SUCH-COMMAND"),
    ] {
        let pool = deadpool_redis::Config::from_url(server.url())
            .builder()
            .expect("a builder")
            .runtime(deadpool_redis::Runtime::Tokio1)
            .post_create(hook)
            .build()
            .expect("a pool");
        let store = RedisStore::from_pool(pool);
        let error = store
            .decide(&Key::new("client"), &policies, 1)
            .await
            .expect_err("no connection past a failing hook");
        assert!(!error.kind().is_io(), "{error}");
        assert!(error.to_string().contains(says), "{error}");
        let at_start = store.verify().await.expect_err("refused at start-up");
        assert!(!at_start.kind().is_io(), "{at_start}");
    }
}

/// The same refusal met by requests of one identity at once: they are coalesced into one
/// batch, and each waiter's copy of the batch's error lost that it is every request's
/// refusal. Each copy then closed the breaker as a one-off refusal does, so under a hot
/// key the breaker never stayed open and every round opened a connection to be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_every_request_meets_keeps_its_kind_through_a_coalesced_batch() {
    let server = RedisServer::start();
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "requirepass", "right-secret"])
            .trim(),
        "OK"
    );
    let url = format!("redis://:wrong-secret@127.0.0.1:{}", server.port);
    let pool = deadpool_redis::Config::from_url(url)
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool");
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(RedisStore::from_pool(pool))
            .policy(Policy::fixed_window("api", 1_000, Duration::from_secs(60)).unwrap())
            .key(Global)
            .circuit_breaker(CircuitBreaker::new(5, Duration::from_secs(60))),
    );
    let round = || {
        futures_util::future::join_all((0..32).map(|_| {
            app.clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
        }))
    };
    // The first rounds open the breaker: five refusals at most.
    for _ in 0..2 {
        for response in round().await {
            assert_eq!(response.unwrap().status(), StatusCode::OK);
        }
    }
    let connections = || support::connections_received(&server, Some("right-secret"));
    let before = connections();
    for _ in 0..10 {
        for response in round().await {
            assert_eq!(response.unwrap().status(), StatusCode::OK);
        }
    }
    // Open for a minute: no request of these rounds reached the pool (the one
    // connection counted is the count's own, `redis-cli INFO`).
    let opened = connections() - before - 1;
    assert_eq!(
        opened, 0,
        "{opened} connections for 10 rounds of 32 requests"
    );
}

/// A connection (`RedisStore::connect`) that breaks while its password is being rotated
/// reconnects with the old one and is refused: redis-rs's connection manager then keeps
/// that refusal for good (it reconnects only after an I/O error), so every decision
/// failed, long after the server took the password again, until the process restarted.
/// A refused password is an outage the store recovers from by connecting anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_refused_its_password_on_reconnect_comes_back() {
    let server = RedisServer::start();
    let auth = |password: &str, args: &[&str]| {
        let mut all = vec!["--no-auth-warning", "-a", password];
        all.extend(args);
        server.cli(&all)
    };
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "requirepass", "first"])
            .trim(),
        "OK"
    );
    let url = format!("redis://:first@127.0.0.1:{}", server.port);
    let store = RedisStore::connect(&url).await.expect("connected");
    let policies =
        PolicySet::from(Policy::fixed_window("api", 1_000, Duration::from_secs(60)).unwrap());
    let key = Key::new("client");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    // The password changes, and the connection breaks: the reconnection is refused.
    assert_eq!(
        auth("first", &["CONFIG", "SET", "requirepass", "second"]).trim(),
        "OK"
    );
    auth("second", &["CLIENT", "KILL", "TYPE", "normal"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "the new password was never refused"
        );
        match store.decide(&key, &policies, 1).await {
            Err(error) if error.kind() == StoreErrorKind::Refused => {
                assert!(!error.to_string().contains("first"), "{error}");
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    // The old password is taken again: decisions come back.
    assert_eq!(
        auth("second", &["CONFIG", "SET", "requirepass", "first"]).trim(),
        "OK"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.decide(&key, &policies, 1).await {
            Ok(decision) => {
                assert!(decision.is_allowed());
                break;
            }
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "30 s after the password was taken again, still: {error}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// A Sentinel primary that answers with an error of the moment (`NOREPLICAS` under
/// `min-replicas-to-write`, `BUSY`) still holds a healthy connection. The store dropped
/// it at each such error, so every failed decision looked the primary up again and
/// opened a new connection to a primary already in trouble. Only a broken connection,
/// or a primary demoted, is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_primary_answering_an_error_keeps_its_connection() {
    let primary = RedisServer::start();
    let sentinel = RedisServer::sentinel(primary.port, "mymaster", 1);
    wait_for("the sentinel to name the primary", || {
        named_primary(&sentinel) == primary.port
    });
    let store = sentinel_config(std::slice::from_ref(&sentinel))
        .connect()
        .await
        .unwrap();
    let (policies, key) = deciding(&store, "no-replicas").await;
    assert_eq!(
        primary
            .cli(&["CONFIG", "SET", "min-replicas-to-write", "1"])
            .trim(),
        "OK"
    );
    let before = support::connections_received(&primary, None);
    for _ in 0..50 {
        let error = store.decide(&key, &policies, 1).await.unwrap_err();
        assert_eq!(
            error.kind(),
            tollgate::StoreErrorKind::Unavailable,
            "{error}"
        );
    }
    // The one connection counted is the count's own (`redis-cli INFO`).
    let opened = support::connections_received(&primary, None) - before - 1;
    assert_eq!(opened, 0, "{opened} new connections for 50 decisions");
    assert_eq!(
        primary
            .cli(&["CONFIG", "SET", "min-replicas-to-write", "0"])
            .trim(),
        "OK"
    );
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
}

/// A primary busy with a long script answers `BUSY` to everything, its watch's `ROLE`
/// included. The watch took that for a primary gone and left it: each request then
/// looked the primary up again, a new connection to the busy server per look-up (one
/// every 100 ms of requests), which a decision's own `BUSY` is kept from doing. An answer
/// of the moment keeps the connection, for the watch as for a decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_primary_keeps_its_connection_through_the_watch() {
    let primary = RedisServer::start();
    let sentinel = support::FakeSentinel::start(primary.port, false);
    let store = RedisConfig::sentinel([sentinel.url()], "mymaster")
        .connect()
        .await
        .unwrap();
    let (policies, key) = deciding(&store, "busy").await;
    let before = support::connections_received(&primary, None);
    let busy = keep_busy(&primary);
    // Busy for 3 s (the watch's ROLE every 500 ms), with requests meeting it.
    let until = Instant::now() + Duration::from_secs(3);
    let mut busy_answers = 0;
    while Instant::now() < until {
        if let Err(error) = store.decide(&key, &policies, 1).await
            && error.to_string().contains("BUSY")
        {
            busy_answers += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        busy_answers > 10,
        "the primary was not busy: {busy_answers}"
    );
    let killed = primary.cli(&["SCRIPT", "KILL"]);
    assert!(killed.contains("OK"), "{killed}");
    busy.join().unwrap().unwrap();
    // Besides the setting's, the script's, the kill's and this count's own connections
    // (`redis-cli` each): none.
    let opened = support::connections_received(&primary, None) - before - 4;
    assert_eq!(opened, 0, "{opened} new connections to the busy primary");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
}

/// A primary stuck in a script (one that wrote: it cannot be killed) answers `BUSY` to
/// everything, and its sentinels fail over from it. The watch keeps a busy primary's
/// connection, but still asks the sentinels: it moves to the new primary they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_primary_the_sentinels_failed_over_from_is_left() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let sentinel = support::FakeSentinel::start(old.port, false);
    let store = RedisConfig::sentinel([sentinel.url()], "mymaster")
        .connect()
        .await
        .unwrap();
    let (policies, key) = deciding(&store, "stuck").await;
    let busy = keep_busy(&old);
    let until = Instant::now() + Duration::from_secs(10);
    while !store
        .decide(&key, &policies, 1)
        .await
        .is_err_and(|error| error.to_string().contains("BUSY"))
    {
        assert!(Instant::now() < until, "the primary never got busy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sentinel.name(new.port);
    // The watch asks the sentinels every 2 s; decisions for up to 10 s.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(decision) = store.decide(&key, &policies, 1).await {
            assert!(decision.is_allowed());
            break;
        }
        assert!(
            Instant::now() < until,
            "the store stayed on the busy primary the sentinels left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !keys_with_ttl(&new).is_empty(),
        "decided on the new primary"
    );
    let killed = old.cli(&["SCRIPT", "KILL"]);
    assert!(killed.contains("OK"), "{killed}");
    busy.join().unwrap().unwrap();
}

/// A Sentinel store used from a runtime that is shutting down: a look-up's task is
/// dropped as it is spawned, in the spawning thread, and its guard's drop took the
/// store's lock, which the spawn held: the thread hung for good. It gets an error.
#[test]
fn a_sentinel_look_up_on_a_runtime_shutting_down_answers() {
    let primary = RedisServer::start();
    let sentinel = support::FakeSentinel::start(primary.port, false);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = runtime
        .block_on(RedisConfig::sentinel([sentinel.url()], "mymaster").connect())
        .unwrap();
    let handle = runtime.handle().clone();
    // The primary goes: the connection breaks, and the next decision looks it up again.
    drop(primary);
    runtime.shutdown_background();
    let (sent, answered) = std::sync::mpsc::channel();
    // Sent however the thread ends: a panic is told apart from a hang by the join below.
    struct Done(std::sync::mpsc::Sender<()>);
    impl Drop for Done {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let thread = std::thread::spawn(move || {
        let _done = Done(sent);
        let policies =
            PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(60)).unwrap());
        let key = Key::new("late");
        // Twice: the first meets the broken connection, the second looks the primary up.
        for _ in 0..2 {
            let _ = handle.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), store.decide(&key, &policies, 1)).await
            });
        }
    });
    assert!(
        answered.recv_timeout(Duration::from_secs(30)).is_ok(),
        "a decision hung on a runtime shutting down"
    );
    thread.join().expect("the deciding thread panicked");
}

/// A set a store decides generously, and `name`'s key: decided once, admitted.
async fn deciding(store: &RedisStore, name: &str) -> (PolicySet, Key) {
    let policies =
        PolicySet::from(Policy::token_bucket("api", 1_000_000, Rate::per_day(100_000)).unwrap());
    let key = Key::new(name);
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    (policies, key)
}

/// `server` kept busy in a script (`BUSY` to every other client after 100 ms) until
/// `SCRIPT KILL`; the thread running it ends then.
fn keep_busy(
    server: &RedisServer,
) -> std::thread::JoinHandle<std::io::Result<std::process::Output>> {
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "busy-reply-threshold", "100"])
            .trim(),
        "OK"
    );
    let port = server.port;
    std::thread::spawn(move || {
        std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string(), "EVAL", "while true do end", "0"])
            .output()
    })
}

/// A Cluster store connected on one runtime and used on another (a start-up runtime, as
/// above): the Cluster client's driver ran on the first and ended with it, and every
/// call after failed at once ("Unable to send command", an I/O error) for good: the
/// breaker probed a connection that could never answer, and the checks that make a new
/// connection were spawned on the runtime that was gone. The store connects anew on a
/// runtime of its own. The first call to find the driver gone may come from a
/// current-thread runtime that then runs on a while and sits idle (a job's, between its
/// `block_on`s): a new connection made there would have its driver left undriven, and
/// the serving runtime's calls would time out.
#[test]
fn a_cluster_connection_outlives_the_runtime_the_store_connected_on() {
    let cluster = support::RedisCluster::start(3);
    let start_up = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = start_up
        .block_on(RedisStore::connect_cluster(&cluster.urls()))
        .unwrap();
    drop(start_up);
    let policies =
        PolicySet::from(Policy::fixed_window("api", 1_000, Duration::from_secs(600)).unwrap());
    let key = Key::new("after-start-up");
    // A job's runtime finds the driver gone first, then idles (kept alive to the end).
    let job = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let first = job.block_on(async {
        let first =
            tokio::time::timeout(Duration::from_secs(2), store.decide(&key, &policies, 1)).await;
        // The job goes on a while after its call failed (a new connection made on its
        // runtime would be made now, and then left undriven).
        tokio::time::sleep(Duration::from_secs(3)).await;
        first
    });
    assert!(
        !matches!(first, Ok(Ok(_))),
        "the first call after the start-up runtime ended was answered: {first:?}"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let until = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let last = match tokio::time::timeout(
                Duration::from_secs(2),
                store.decide(&key, &policies, 1),
            )
            .await
            {
                Ok(Ok(decision)) => {
                    assert!(decision.is_allowed());
                    break;
                }
                Ok(Err(error)) => error.to_string(),
                Err(_) => "no answer within 2 s".to_owned(),
            };
            assert!(
                std::time::Instant::now() < until,
                "the Cluster store never answered again on the runtime that uses it: {last}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    drop(job);
}

/// A store connected on one runtime (a start-up `block_on`) and used on another: the
/// watch that asks the sentinels every 2 s ran on the first, and ended with it for good.
/// A primary the sentinels failed over from, still answering as a primary (cut off from
/// them, not demoted), was then never left: the counters forked. The watch is started
/// again on the runtime that uses the store.
#[test]
fn the_sentinel_watch_outlives_the_runtime_the_store_connected_on() {
    let old = RedisServer::start();
    let new = RedisServer::start();
    let sentinel = support::FakeSentinel::start(old.port, false);
    let start_up = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = start_up
        .block_on(RedisConfig::sentinel([sentinel.url()], "mymaster").connect())
        .unwrap();
    drop(start_up);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let policies =
            PolicySet::from(Policy::fixed_window("api", 1_000, Duration::from_secs(600)).unwrap());
        let key = Key::new("moved");
        // The first meets the connection the first runtime took down; then on the old
        // primary again.
        for _ in 0..3 {
            let _ = tokio::time::timeout(Duration::from_secs(5), store.decide(&key, &policies, 1))
                .await;
        }
        assert!(
            !support::keys_with_ttl(&old).is_empty(),
            "decided on the old primary"
        );
        // The sentinels fail over; the old primary still answers as one.
        sentinel.name(new.port);
        let until = std::time::Instant::now() + Duration::from_secs(15);
        while support::keys_with_ttl(&new).is_empty() {
            assert!(
                std::time::Instant::now() < until,
                "the store never left the old primary for the one the sentinels name"
            );
            let _ = tokio::time::timeout(Duration::from_secs(1), store.decide(&key, &policies, 1))
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
