//! Reserve, settle and in-flight limits through the layer on a real Redis (standalone and
//! Cluster): the settlement is one more script call on the response's path, the release
//! one after the body ends.

#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::get;
use http::StatusCode;
use http_body_util::BodyExt;
use support::{RedisCluster, RedisServer};
use tollgate::cost::{FromExtension, RequestCost};
use tollgate::key::HeaderKey;
use tollgate::settle::Settle;
use tollgate::store::{RedisStore, StoreErrorKind};
use tollgate::{FailureMode, Policy, Rate, RateLimitLayer, Store};
use tower::ServiceExt;

/// The tokens app: `policy`, settled to `x-tokens-used`, 5xx refunded, on `store`.
fn tokens_app(store: RedisStore, policy: Policy) -> Router {
    Router::new()
        .route(
            "/",
            get(|request: Request| async move {
                let used = request.headers()["x-used"].clone();
                let status: u16 = request.headers()["x-status"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                let mut response = http::Response::new(Body::from("done"));
                *response.status_mut() = StatusCode::from_u16(status).unwrap();
                response.headers_mut().insert("x-tokens-used", used);
                response
            }),
        )
        .layer(
            RateLimitLayer::new(store)
                .policy(policy)
                .key(HeaderKey::new("x-api-key"))
                .cost(FromExtension::or(1))
                .settle(Settle::from_header("x-tokens-used").refund_if(|s| s.is_server_error()))
                // A Redis store error must fail the test, not hide behind a fallback.
                .on_store_error(FailureMode::FailClosed)
                .store_timeout(Duration::from_secs(10)),
        )
}

fn request(key: &str, reserve: u64, used: u64, status: u16) -> Request {
    let mut request = Request::get("/")
        .header("x-api-key", key)
        .header("x-used", used.to_string())
        .header("x-status", status.to_string())
        .body(Body::empty())
        .unwrap();
    request.extensions_mut().insert(RequestCost(reserve));
    request
}

fn remaining(response: &http::Response<Body>) -> u64 {
    let field = response.headers()["ratelimit"].to_str().unwrap();
    field
        .split(";r=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

async fn stores() -> (RedisServer, RedisCluster, Vec<(&'static str, RedisStore)>) {
    let standalone = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let stores = vec![
        (
            "redis",
            RedisStore::connect(&standalone.url()).await.unwrap(),
        ),
        (
            "cluster",
            RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
        ),
    ];
    (standalone, cluster, stores)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_settles_before_the_response_leaves() {
    let (_standalone, _cluster, stores) = stores().await;
    for (name, store) in stores {
        let app = tokens_app(
            store,
            Policy::token_bucket("tokens", 1_000, Rate::per_hour(1)).unwrap(),
        );
        let response = app
            .clone()
            .oneshot(request("a", 100, 4, 200))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{name}");
        assert_eq!(remaining(&response), 996, "{name}");
        let response = app
            .clone()
            .oneshot(request("a", 100, 40, 500))
            .await
            .unwrap();
        assert_eq!(
            remaining(&response),
            996,
            "{name}: a 5xx is refunded in full"
        );
        let response = app
            .clone()
            .oneshot(request("a", 10, 25, 200))
            .await
            .unwrap();
        assert_eq!(
            remaining(&response),
            971,
            "{name}: charged above the reservation"
        );
        let response = app
            .clone()
            .oneshot(request("a", 1_001, 1, 200))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frees_in_flight_slots_when_bodies_end() {
    let (_standalone, _cluster, stores) = stores().await;
    for (name, store) in stores {
        let app = Router::new()
            .route("/", get(|| async { "streamed" }))
            .layer(
                RateLimitLayer::new(store)
                    .policy(Policy::concurrency("inflight", 2).unwrap())
                    .key(HeaderKey::new("x-api-key"))
                    .on_store_error(FailureMode::FailClosed)
                    .store_timeout(Duration::from_secs(5)),
            );
        let call = || {
            app.clone().oneshot(
                Request::get("/")
                    .header("x-api-key", "team")
                    .body(Body::empty())
                    .unwrap(),
            )
        };
        let first = call().await.unwrap();
        let second = call().await.unwrap();
        assert_eq!(
            (first.status(), second.status()),
            (StatusCode::OK, StatusCode::OK)
        );
        let third = call().await.unwrap();
        assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS, "{name}");
        // The bodies end (one read, one dropped): the slots are freed by a script call
        // on the runtime, which the next requests wait for.
        first.into_body().collect().await.unwrap();
        drop(second);
        let mut admitted = 0;
        for _ in 0..500 {
            let response = call().await.unwrap();
            if response.status() == StatusCode::OK {
                admitted += 1;
                std::mem::forget(response.into_body());
                if admitted == 2 {
                    break;
                }
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert_eq!(admitted, 2, "{name}: both slots came back");
        assert_eq!(
            call().await.unwrap().status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_settles_on_redis_charge_exactly_the_actual_costs() {
    // 64 tasks reserve and settle at once against one key, through the layer, on a
    // standalone Redis and a Cluster. Nothing refills during the test: what the bucket
    // lost is exactly the sum of the actual costs of the admitted, successful requests
    // (one unit an hour refills nothing a test can see).
    let (_standalone, _cluster, stores) = stores().await;
    for (name, store) in stores {
        let policy = Policy::token_bucket("tokens", 10_000, Rate::per_hour(1)).unwrap();
        let app = tokens_app(store.clone(), policy.clone());
        let charged = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks = Vec::new();
        for task in 0..64u64 {
            let (app, charged) = (app.clone(), std::sync::Arc::clone(&charged));
            tasks.push(tokio::spawn(async move {
                let mut seed = task.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for _ in 0..10 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let reserve = 1 + seed % 60;
                    let used = seed / 61 % (reserve + 1);
                    let status = if seed % 7 == 0 { 500 } else { 200 };
                    let response = app
                        .clone()
                        .oneshot(request("shared", reserve, used, status))
                        .await
                        .unwrap();
                    match response.status() {
                        StatusCode::TOO_MANY_REQUESTS => {}
                        StatusCode::OK => {
                            charged.fetch_add(used, std::sync::atomic::Ordering::SeqCst);
                        }
                        StatusCode::INTERNAL_SERVER_ERROR => {}
                        other => panic!("{name}: unexpected {other}"),
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let key = tollgate::key::KeyExtractor::extract(
            &HeaderKey::new("x-api-key"),
            &Request::get("/")
                .header("x-api-key", "shared")
                .body(())
                .unwrap()
                .into_parts()
                .0,
        )
        .unwrap();
        let left = tollgate::Store::peek(&store, &key, &tollgate::PolicySet::from(policy))
            .await
            .unwrap()
            .statuses()[0]
            .remaining;
        assert_eq!(
            10_000 - left,
            charged.load(std::sync::atomic::Ordering::SeqCst),
            "{name}"
        );
    }
}

/// The client address of a `MONITOR` line (`<time> [<db> <address>] "COMMAND" ...`) and
/// its command, for commands a client sent (not those a script ran).
fn monitored(line: &str) -> Option<(&str, &str)> {
    let (_, rest) = line.split_once(" [")?;
    let (client, command) = rest.split_once("] ")?;
    let address = client.split_whitespace().nth(1)?;
    (address != "lua").then_some((address, command))
}

/// The first of `lines` (`MONITOR` output) where a client sent one of `verbs` naming
/// `tag`: its position, the client's address and the line.
fn find_command(lines: &[String], verbs: &[&str], tag: &str) -> Option<(usize, String, String)> {
    lines.iter().enumerate().find_map(|(at, line)| {
        let (address, command) = monitored(line)?;
        let verb = command.split('"').nth(1)?;
        (verbs.contains(&verb) && command.contains(tag))
            .then(|| (at, address.to_owned(), line.clone()))
    })
}

/// A decision on a pooled connection, dropped while its script is on its way, gives its
/// in-flight slot back on the connection that carried the script, behind it: Redis runs
/// one connection's commands in order, so the release cannot run first and leave the
/// slot held until its lease ends (60 s by default). Before, the release took any
/// connection of the pool, and a release that overtook its script freed nothing. The
/// script is held at the server by `CLIENT PAUSE WRITE` (so the decision is surely in
/// flight when it is dropped); `MONITOR` shows which connection each command came on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_pooled_decision_gives_its_slot_back_behind_its_own_script() {
    let standalone = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let (pool, cluster_pool) = support::pools(&standalone, &cluster);
    // Two idle connections in each pool (handed out first in, first out): a release that
    // took any connection would take the other one.
    {
        let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
        let (c, d) = (
            cluster_pool.get().await.unwrap(),
            cluster_pool.get().await.unwrap(),
        );
        drop((a, b, c, d));
    }
    let cases = [
        (
            "pool",
            vec![&standalone],
            RedisStore::from_pool(pool.clone()),
        ),
        (
            "cluster pool",
            cluster.nodes.iter().collect(),
            RedisStore::from_cluster_pool(cluster_pool.clone()),
        ),
    ];
    // Two in-flight limits: two slots to give back, one release each.
    let limits = [
        Policy::concurrency("inflight", 1).unwrap(),
        Policy::concurrency("streams", 1).unwrap(),
    ];
    let policies = tollgate::PolicySet::new(limits.clone()).unwrap();
    for (name, servers, store) in cases {
        store.verify().await.unwrap();
        let key = tollgate::Key::new("team");
        let monitors: Vec<support::Monitor> =
            servers.iter().map(|s| support::Monitor::start(s)).collect();
        for server in &servers {
            server.cli(&["CLIENT", "PAUSE", "30000", "WRITE"]);
        }
        let mut decision = Box::pin(store.decide(&key, &policies, 1));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            tokio::select! {
                answer = &mut decision => {
                    // The connection's own response timeout (500 ms by default) may end
                    // the wait first: the decision failed with its script sent, which is
                    // the case under test too. An answer would mean nothing was held.
                    let error = answer.expect_err("a paused server answered");
                    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{name}: {error}");
                    break;
                }
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            let held: u64 = servers.iter().map(|s| support::blocked_clients(s)).sum();
            if held > 0 {
                break; // the script is at the server, held
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the script did not reach the server"
            );
        }
        drop(decision);
        // Held a while: the first release waits behind the script past the connection's
        // response timeout (500 ms for a standalone pool), which must not stop the
        // second one. (A machine too slow to get there in time only makes this part
        // weaker, never wrong.)
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        for server in &servers {
            server.cli(&["CLIENT", "UNPAUSE"]);
        }
        // The script ran, then a release per slot: find them (on the node that holds the
        // identity), in the order the server ran them, and who sent them.
        let tag = store.keys().tag(key.as_str());
        let slots: Vec<String> = limits
            .iter()
            .map(|limit| store.keys().policy_keys(key.as_str(), limit).0)
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let (script, releases) = loop {
            let seen: Vec<Vec<String>> = monitors.iter().map(support::Monitor::lines).collect();
            let found = seen.iter().find_map(|lines| {
                let script = find_command(lines, &["FCALL", "EVALSHA", "EVAL"], &tag)?;
                let releases: Option<Vec<_>> = slots
                    .iter()
                    .map(|slot| find_command(lines, &["ZREM"], &format!("\"{slot}\"")))
                    .collect();
                Some((script, releases?))
            });
            if let Some(found) = found {
                break found;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: no script and a release per slot seen: {seen:#?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        for release in releases {
            assert_eq!(
                script.1, release.1,
                "{name}: a release came on another connection than its script:\n{}\n{}",
                script.2, release.2
            );
            assert!(
                script.0 < release.0,
                "{name}: a release ran before its script:\n{}\n{}",
                script.2,
                release.2
            );
        }
        // And the slots are free.
        let again = store.decide(&key, &policies, 1).await.unwrap();
        assert!(again.is_allowed(), "{name}: the slot was held: {again:?}");
        drop(monitors);
    }
}

/// A settle leaves a shaping policy's units as they were sent (the request's place in the
/// schedule), on Redis as in process: a refunded 500 let the next request go at once, on
/// the instant of the one refunded. (A lower bound from before the refunded request was
/// sent: its decision, and so the next one's place, come after that instant, however
/// slow the machine; the layer answers the refunded one only once its settle landed,
/// which a bound from its answer would wrongly count against the next one's delay.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_on_redis_keeps_shaped_requests_apart() {
    let (_standalone, _cluster, stores) = stores().await;
    let spacing = Duration::from_millis(400);
    for (name, store) in stores {
        let paced =
            Policy::leaky_bucket_shaping("paced", Rate::new(1, spacing), Duration::from_secs(60))
                .unwrap();
        let app = tokens_app(store, paced);
        let started = std::time::Instant::now();
        let refunded = app.clone().oneshot(request("a", 1, 1, 500)).await.unwrap();
        assert_eq!(
            refunded.status(),
            StatusCode::INTERNAL_SERVER_ERROR,
            "{name}"
        );
        let next = app.clone().oneshot(request("a", 1, 1, 200)).await.unwrap();
        assert_eq!(next.status(), StatusCode::OK, "{name}");
        // Microseconds of rounding between Redis time and the timer, no more.
        assert!(
            started.elapsed() >= spacing - Duration::from_millis(2),
            "{name}: sent {:?} after the refunded one was",
            started.elapsed()
        );
    }
}

/// Requests whose clients give up during their shaping delay give their places back on
/// Redis too, newest first, when nobody queued behind them (in process: tests/http.rs).
/// The give-backs run in tasks of their own: the test waits for them, at most 5 s (half
/// the 10 s a unit takes to leak: the three units queued would still show as two taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_dropped_during_their_delay_give_their_places_back_on_redis() {
    let (_standalone, _cluster, stores) = stores().await;
    for (name, store) in stores {
        let paced = Policy::leaky_bucket_shaping(
            "paced",
            Rate::new(1, Duration::from_secs(10)),
            Duration::from_secs(60),
        )
        .unwrap();
        let app = tokens_app(store, paced);
        let first = app.clone().oneshot(request("a", 1, 1, 200)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK, "{name}");
        // Held back 10 s and 20 s; their clients give up after 300 ms and 600 ms.
        let second = tokio::spawn(tokio::time::timeout(
            Duration::from_millis(300),
            app.clone().oneshot(request("a", 1, 1, 200)),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let third = tokio::spawn(tokio::time::timeout(
            Duration::from_millis(600),
            app.clone().oneshot(request("a", 1, 1, 200)),
        ));
        assert!(
            second.await.unwrap().is_err(),
            "{name}: the second was sent"
        );
        assert!(third.await.unwrap().is_err(), "{name}: the third was sent");
        // A request of cost 0 goes at once and reports the queue: with the first
        // request's unit alone queued, 6 more fit in the 60 s (7 once it has leaked out,
        // on a machine slow enough to take 10 s); with all three, 4.
        let waited = std::time::Instant::now();
        let mut room = 0;
        while waited.elapsed() < Duration::from_secs(5) {
            let probe = app.clone().oneshot(request("a", 0, 0, 200)).await.unwrap();
            room = remaining(&probe);
            if room >= 6 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            room >= 6,
            "{name}: the places were not given back: {room} fit"
        );
    }
}

/// Starts moving the slot of `identity`'s in-flight slots (its sorted set) from the node
/// that holds it to another (`MIGRATING` there, `IMPORTING` on the other), as a reshard
/// does: the owner, the other node, the slot and the key.
fn start_moving<'c>(
    cluster: &'c RedisCluster,
    identity: &str,
) -> (&'c RedisServer, &'c RedisServer, String, String) {
    let pattern = format!("tollgate:{{{identity}}}*");
    let (owner, state) = cluster
        .nodes
        .iter()
        .find_map(|node| {
            let found = node.cli(&["--scan", "--pattern", &pattern]);
            let slots = found
                .lines()
                .map(str::trim)
                .find(|key| node.cli(&["TYPE", key]).trim() == "zset")?;
            Some((node, slots.to_owned()))
        })
        .expect("a node holds the identity's slots");
    let slot = owner.cli(&["CLUSTER", "KEYSLOT", &state]).trim().to_owned();
    let target = cluster
        .nodes
        .iter()
        .find(|node| node.port != owner.port)
        .expect("another node");
    let id = |node: &RedisServer| node.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let importing = target.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &id(owner)]);
    let migrating = owner.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &id(target)]);
    assert_eq!((importing.trim(), migrating.trim()), ("OK", "OK"));
    (owner, target, slot, state)
}

/// A slot being moved between Cluster nodes (a reshard: `MIGRATING` on its owner,
/// `IMPORTING` on the next) is answered `TRYAGAIN` for a call naming several keys while
/// some of them are missing. A policy's second key holds a penalty's state and nothing
/// else, yet every release and settle named it: each was refused for the whole move, so
/// an identity's in-flight slots stayed held until their lease ended (a store failure
/// that became denials), and refunds were lost. A policy without a penalty names its
/// state key alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_slot_being_moved_is_answered() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    let policies = tollgate::PolicySet::from(Policy::concurrency("inflight", 1).unwrap());
    let key = tollgate::Key::new("team");
    let admitted = store.decide(&key, &policies, 1).await.unwrap();
    assert!(admitted.is_allowed());
    start_moving(&cluster, "team");
    let released = tokio::time::timeout(
        Duration::from_secs(10),
        store.adjust(
            &key,
            &policies,
            &tollgate::Adjustment::release(1, admitted.receipt()),
        ),
    )
    .await
    .expect("the release is answered in time");
    assert!(released.is_ok(), "{released:?}");
    let again = store.decide(&key, &policies, 1).await.unwrap();
    assert!(again.is_allowed(), "the slot was not given back");
}

/// The reshard above, with sets whose release names another key that is missing: a rate
/// policy's beside the in-flight one (a bucket's key is gone once it is full again, a
/// millisecond here), or the in-flight policy's penalty key (written at its first
/// strike). The script's call is answered `TRYAGAIN` for the whole move, and redis-rs
/// tries it again only after more than a second: the release was given up on at the
/// store timeout and lost, and the identity's slot stayed held for its lease (denials
/// from a store failure). Given up on, a release frees its slots with a call of one key
/// each, as a dropped decision's are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_several_keys_on_a_slot_being_moved_frees_the_slot() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    let inflight = || Policy::concurrency("inflight", 1).unwrap();
    let penalty =
        tollgate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(60));
    let sets = [
        (
            "beside-a-bucket",
            tollgate::PolicySet::new([
                inflight(),
                Policy::token_bucket("rate", 1000, Rate::per_second(1000)).unwrap(),
            ])
            .unwrap(),
        ),
        (
            "with-a-penalty",
            tollgate::PolicySet::from(inflight().with_penalty(penalty).unwrap()),
        ),
    ];
    for (identity, policies) in sets {
        let key = tollgate::Key::new(identity);
        let admitted = store.decide(&key, &policies, 1).await.unwrap();
        assert!(admitted.is_allowed(), "{identity}");
        // The bucket is full again, and its key gone.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (owner, target, slot, state) = start_moving(&cluster, identity);
        assert_eq!(owner.cli(&["ZCARD", &state]).trim(), "1", "{identity}");
        // Given up on at a store timeout (the layer's is 50 ms by default).
        let release = tollgate::Adjustment::release(1, admitted.receipt());
        let released = tokio::time::timeout(
            Duration::from_millis(150),
            store.adjust(&key, &policies, &release),
        )
        .await;
        // The move is called off; the slot must be free by then.
        let mut free = false;
        let waited = std::time::Instant::now();
        while waited.elapsed() < Duration::from_secs(5) {
            // Emptied, the key is gone, and a slot being moved sends a client asking for
            // a key it no longer holds to the next node.
            let zcard = owner.cli(&["ZCARD", &state]);
            if zcard.trim() == "0" || zcard.trim().starts_with("ASK") {
                free = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for node in [owner, target] {
            assert_eq!(
                node.cli(&["CLUSTER", "SETSLOT", &slot, "STABLE"]).trim(),
                "OK"
            );
        }
        assert!(free, "{identity}: the slot is still held ({released:?})");
        let again = store.decide(&key, &policies, 1).await.unwrap();
        assert!(
            again.is_allowed(),
            "{identity}: the slot was not given back"
        );
    }
}
