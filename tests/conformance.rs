//! One conformance suite, every store: the in-process store, a standalone Redis and a
//! three-master Redis Cluster get the same arrival traces and must give the same
//! decisions. Counts (limit, remaining) must be equal; durations (retry-after, reset,
//! shaping delay) may differ by at most 1 ms, because Redis works in microseconds and
//! rounds a GCRA emission interval up to a whole microsecond.
//!
//! Time: the in-process store reads a `ManualClock`; the Redis stores are built with
//! `RedisStore::with_clock` (feature `__test-clock`), which passes the clock's time to the
//! script instead of letting it read Redis `TIME`. That argument exists only in test
//! builds, so production decisions always use Redis time.

#![cfg(all(feature = "redis", feature = "__test-clock"))]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::{RedisCluster, RedisServer, keys_with_ttl};
use tollgate::clock::{Clock, ManualClock};
use tollgate::store::RedisStore;
use tollgate::{Adjustment, Decision, Key, MemoryStore, Outcome, Policy, PolicySet, Rate, Store};

const MINUTE: Duration = Duration::from_secs(60);

#[derive(Clone)]
enum AnyStore {
    Memory(MemoryStore<ManualClock>),
    Redis(RedisStore),
}

struct Subject {
    name: &'static str,
    clock: ManualClock,
    store: AnyStore,
}

impl Subject {
    async fn check(&self, key: &str, policies: &PolicySet, cost: u64) -> Decision {
        match &self.store {
            AnyStore::Memory(store) => store.check(key, policies, cost),
            AnyStore::Redis(store) => store
                .decide(&Key::new(key), policies, cost)
                .await
                .unwrap_or_else(|error| panic!("{}: {error}", self.name)),
        }
    }
}

struct Backends {
    standalone: RedisServer,
    cluster: RedisCluster,
    standalone_store: RedisStore,
    cluster_store: RedisStore,
}

impl Backends {
    async fn start() -> Self {
        let standalone = RedisServer::start();
        let cluster = RedisCluster::start(3);
        let standalone_store = RedisStore::connect(&standalone.url()).await.unwrap();
        let cluster_store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
        Self {
            standalone,
            cluster,
            standalone_store,
            cluster_store,
        }
    }

    /// Every key on the standalone server and the Cluster, with its TTL in ms.
    fn keys_with_ttl(&self) -> Vec<(String, i64)> {
        keys_with_ttl(&self.standalone)
            .into_iter()
            .chain(self.cluster.keys_with_ttl())
            .collect()
    }

    /// Fresh subjects, each with its own clock at zero and its own key prefix.
    fn subjects(&self, prefix: &str) -> Vec<Subject> {
        let redis = |name, store: &RedisStore| {
            let clock = ManualClock::new();
            Subject {
                name,
                store: AnyStore::Redis(store.clone().prefix(prefix).with_clock(clock.clone())),
                clock,
            }
        };
        let clock = ManualClock::new();
        vec![
            Subject {
                name: "memory",
                store: AnyStore::Memory(MemoryStore::builder().clock(clock.clone()).build()),
                clock,
            },
            redis("redis", &self.standalone_store),
            redis("cluster", &self.cluster_store),
        ]
    }
}

/// A deterministic arrival trace: (milliseconds since the last arrival, cost).
fn trace(seed: u64, steps: usize, max_gap_ms: u64) -> Vec<(u64, u64)> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    (0..steps)
        .map(|_| (next() % max_gap_ms, 1 + next() % 3))
        .collect()
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= Duration::from_millis(1)
}

fn same(a: &Decision, b: &Decision) -> bool {
    let outcome = match (a.outcome(), b.outcome()) {
        (Outcome::Allowed { delay: x }, Outcome::Allowed { delay: y }) => close(x, y),
        (
            Outcome::Denied {
                policy: p,
                retry_after: x,
            },
            Outcome::Denied {
                policy: q,
                retry_after: y,
            },
        ) => p == q && close(x, y),
        (x @ Outcome::CostExceedsLimit { .. }, y) => x == y,
        _ => false,
    };
    outcome
        && a.shadow_denied().eq(b.shadow_denied())
        && a.is_blocked() == b.is_blocked()
        && a.statuses().len() == b.statuses().len()
        && a.statuses().iter().zip(b.statuses()).all(|(x, y)| {
            x.limit == y.limit
                && x.remaining == y.remaining
                && close(x.reset, y.reset)
                && close(x.effective_window, y.effective_window)
        })
}

/// Replays `arrivals` on every subject and checks that all decide alike.
async fn replay(
    backends: &Backends,
    prefix: &str,
    key: &str,
    policies: &PolicySet,
    arrivals: &[(u64, u64)],
) {
    replay_from(backends, prefix, key, policies, arrivals, Duration::ZERO, 1).await;
}

/// [`replay`] with the clocks starting at `start` and every cost multiplied by `scale`.
async fn replay_from(
    backends: &Backends,
    prefix: &str,
    key: &str,
    policies: &PolicySet,
    arrivals: &[(u64, u64)],
    start: Duration,
    scale: u64,
) {
    let subjects = backends.subjects(prefix);
    let mut now = start;
    let mut admitted = 0;
    for (step, &(gap, cost)) in arrivals.iter().enumerate() {
        let cost = cost * scale;
        now += Duration::from_millis(gap);
        let mut decisions = Vec::new();
        for subject in &subjects {
            subject.clock.set(now);
            decisions.push(subject.check(key, policies, cost).await);
        }
        for (subject, decision) in subjects.iter().zip(&decisions).skip(1) {
            assert!(
                same(&decisions[0], decision),
                "{prefix} step {step} at {now:?} cost {cost}: memory {:?} vs {} {:?}",
                decisions[0],
                subject.name,
                decision
            );
        }
        admitted += u64::from(decisions[0].is_allowed());
    }
    // The trace must exercise both answers, or it proves little.
    assert!(
        admitted > 0 && admitted < arrivals.len() as u64,
        "{prefix}: {admitted} of {} admitted",
        arrivals.len()
    );
}

/// [`replay`] for each policy alone, under the prefix `{prefix}-{name}`.
async fn replay_each(
    backends: &Backends,
    prefix: &str,
    key: &str,
    policies: impl IntoIterator<Item = Policy>,
    arrivals: &[(u64, u64)],
) {
    for policy in policies {
        let name = policy.name().to_owned();
        let set = PolicySet::from(policy);
        replay(backends, &format!("{prefix}-{name}"), key, &set, arrivals).await;
    }
}

fn every_algorithm() -> Vec<Policy> {
    vec![
        Policy::fixed_window("fw", 10, MINUTE).unwrap(),
        Policy::sliding_log("sl", 10, MINUTE).unwrap(),
        Policy::sliding_window("sw", 10, MINUTE).unwrap(),
        // Sub-windows of 15 s and 6 s; 10 / 4 forgives 2 units of the oldest.
        Policy::sliding_window_split("sw4", 10, MINUTE, 4).unwrap(),
        Policy::sliding_window_split("sw10", 10, MINUTE, 10).unwrap(),
        Policy::token_bucket("tb", 10, Rate::new(10, MINUTE)).unwrap(),
        Policy::leaky_bucket("lb", 10, Rate::new(10, MINUTE)).unwrap(),
        Policy::leaky_bucket_shaping("ls", Rate::new(10, MINUTE), Duration::from_secs(30)).unwrap(),
        Policy::gcra("gc", Rate::new(10, MINUTE), 10).unwrap(),
        // A rate that does not divide evenly: 3 per 10 s.
        Policy::gcra("gc3", Rate::new(3, Duration::from_secs(10)), 4).unwrap(),
        Policy::token_bucket("tb3", 4, Rate::new(3, Duration::from_secs(10))).unwrap(),
    ]
}

/// A sliding log keeps one sorted-set member per entry, named by its time
/// (lua/sliding_log.lua): entries of one microsecond (a time seen again after the clock
/// stepped back, or decisions of one script run) each count, in the library's calls and in
/// a bare script's, whatever the cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_counts_every_entry_of_one_microsecond() {
    let backends = Backends::start().await;
    let window = Duration::from_secs(60);
    let log = PolicySet::from(Policy::sliding_log("log", 20, window).unwrap());
    let epoch = Duration::from_micros(1_700_000_000_000_000);
    let second = Duration::from_secs(1);
    for subject in backends.subjects("one-microsecond").iter().skip(1) {
        let AnyStore::Redis(store) = &subject.store else {
            unreachable!("only Redis subjects here")
        };
        let (ahead, behind) = (ManualClock::new(), ManualClock::new());
        let (store, late) = (
            store.clone().with_clock(ahead.clone()),
            store.clone().with_clock(behind.clone()),
        );
        behind.set(epoch);
        // (late clock, time, cost, remaining after it)
        let steps = [
            (false, epoch, 1, 19),
            (false, epoch, 1, 18),
            (false, epoch + second, 2, 16),
            // Back to the very microsecond of the first two, after a later one.
            (true, epoch, 1, 15),
            (true, epoch, 3, 12),
            (true, epoch, 1, 11),
            (false, epoch + second, 1, 10),
        ];
        for (step, &(back, at, cost, remaining)) in steps.iter().enumerate() {
            let decision = if back {
                late.decide(&Key::new("client"), &log, cost).await
            } else {
                ahead.set(at);
                store.decide(&Key::new("client"), &log, cost).await
            }
            .unwrap_or_else(|error| panic!("{}: {error}", subject.name));
            assert!(decision.is_allowed(), "{} step {step}", subject.name);
            assert_eq!(
                decision.statuses()[0].remaining,
                remaining,
                "{} step {step}",
                subject.name
            );
        }
        // Once the first microsecond has left the window, its 7 units have too.
        ahead.set(epoch + window + Duration::from_millis(1));
        let look = store.decide(&Key::new("client"), &log, 0).await.unwrap();
        assert_eq!(look.statuses()[0].remaining, 20 - 3, "{}", subject.name);
    }

    // A bare script run (the fallback where Functions are missing) starts with no memory of
    // earlier runs: two runs at one microsecond still keep two entries.
    let script = tollgate::store::decision_script(&log).unwrap();
    let client = redis::Client::open(backends.standalone.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let mut replies = Vec::new();
    for cost in [1, 1, 2, 1] {
        let reply: Vec<i64> = redis::cmd("EVAL")
            .arg(script)
            .arg(1)
            .arg("bare-log")
            .arg(epoch.as_micros().to_string())
            .arg(cost)
            .arg(1)
            .arg("sl")
            .arg(20)
            .arg(window.as_micros().to_string())
            .arg(3)
            .query_async(&mut connection)
            .await
            .unwrap();
        // {outcome, wait, units in the log, oldest, newest, now}
        replies.push((reply[0], reply[2]));
    }
    assert_eq!(replies, [(0, 1), (0, 2), (0, 4), (0, 5)]);
    let entries: u64 = redis::cmd("ZCARD")
        .arg("bare-log")
        .query_async(&mut connection)
        .await
        .unwrap();
    // Four entries and the counter of the units beyond one per entry.
    assert_eq!(entries, 5);

    // Members tollgate did not write (another client's, in its keys): a name of another
    // form, a counter at 0 or above, a member scored below the counter. The log cannot be
    // counted, so the decision fails, loudly (a refusal, not I/O: logged and counted, the
    // breaker stays closed), and never admits as if the log were empty.
    let foreign: [(&str, &str); 4] = [
        ("1700000000000000", "not-an-entry"),
        ("1700000000000000", "x"),
        ("0", "x"),
        ("-100", "7"),
    ];
    for (index, (score, member)) in foreign.iter().enumerate() {
        let identity = format!("foreign-{index}");
        let store = backends.standalone_store.clone();
        let key = store.keys().policy_keys(&identity, &log[0]).0;
        let _: () = redis::cmd("ZADD")
            .arg(&key)
            .arg(*score)
            .arg(*member)
            .query_async(&mut connection)
            .await
            .unwrap();
        for cost in [1, 3] {
            let what = format!("{member} at {score}, cost {cost}");
            refused_as_foreign(&store, &identity, &log, cost, &what).await;
        }
    }
}

/// The sliding log's layout keeps its invariants through a random history of decisions
/// (costs 1 to 4, some over the limit), settles (to less and to more), grants and sets,
/// with time that steps back now and then: every member is an entry whose name starts
/// with its time (its score) and says its units, or the one counter `x`, scored minus the
/// units beyond one per entry and present only while there are some; the log holds the
/// remaining the store reports; and the key always has a TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_keeps_its_layout_through_any_history() {
    let backends = Backends::start().await;
    let limit = 12;
    let window = Duration::from_secs(20);
    let log = PolicySet::from(Policy::sliding_log("log", limit, window).unwrap());
    let epoch = Duration::from_micros(1_700_000_000_000_000);
    let subjects = backends.subjects("layout");
    let AnyStore::Redis(redis) = &subjects[1].store else {
        unreachable!("the second subject is the standalone server")
    };
    let (ahead, behind) = (ManualClock::new(), ManualClock::new());
    let (store, late) = (
        redis.clone().with_clock(ahead.clone()),
        redis.clone().with_clock(behind.clone()),
    );
    let key = redis.keys().policy_keys("layout-client", &log[0]).0;
    let mut now = epoch;
    let (mut settled, mut granted, mut back, mut weighted) = (0, 0, 0, 0);
    for (step, &(gap, cost)) in trace(23, 400, 2_500).iter().enumerate() {
        now += Duration::from_millis(gap);
        ahead.set(now);
        behind.set(now - Duration::from_millis(700));
        let stepped_back = step % 11 == 10;
        let target = if stepped_back { &late } else { &store };
        let id = Key::new("layout-client");
        let cost = if step % 37 == 36 {
            limit + 1
        } else {
            cost + u64::from(step % 5 == 0)
        };
        let decision = match step % 13 {
            7 => {
                granted += 1;
                target
                    .adjust(&id, &log, &Adjustment::grant(2))
                    .await
                    .unwrap()
            }
            12 => {
                granted += 1;
                let level = Adjustment::set_remaining(step as u64 % (limit + 1));
                target.adjust(&id, &log, &level).await.unwrap()
            }
            _ => {
                let decision = target.decide(&id, &log, cost).await.unwrap();
                if decision.is_allowed() && step % 3 == 0 {
                    settled += 1;
                    let actual = (cost + step as u64) % 5;
                    let settle = Adjustment::settle(cost, actual, decision.receipt());
                    target.adjust(&id, &log, &settle).await.unwrap()
                } else {
                    decision
                }
            }
        };
        back += u64::from(stepped_back);
        let context = format!("step {step} cost {cost}: {decision:?}");
        let members = backends
            .standalone
            .cli(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]);
        let lines: Vec<&str> = members.lines().filter(|line| !line.is_empty()).collect();
        let (mut entries, mut extra, mut counter) = (0u64, 0u64, None);
        for pair in lines.chunks(2) {
            let (member, score) = (pair[0], pair[1].parse::<f64>().unwrap());
            if member == "x" {
                assert!(counter.is_none(), "{context}: two counters in {members}");
                counter = Some(-score as u64);
                continue;
            }
            let mut parts = member.split(':');
            let time: u64 = parts.next().unwrap().parse().unwrap();
            let units: u64 = parts.next().map_or(1, |units| units.parse().unwrap());
            assert_eq!(time as f64, score, "{context}: {member} scored {score}");
            assert!(units >= 1, "{context}: {member}");
            entries += 1;
            extra += units - 1;
        }
        assert_eq!(counter.unwrap_or(0), extra, "{context}: {members}");
        assert!(
            counter != Some(0),
            "{context}: an empty counter in {members}"
        );
        let held = entries + extra;
        let status = &decision.statuses()[0];
        // The store reports the log as it is now (a request in the past counts what the
        // key holds, later entries included).
        assert_eq!(
            status.remaining,
            limit.saturating_sub(held),
            "{context}: {members}"
        );
        if entries > 0 {
            let ttl: i64 = backends
                .standalone
                .cli(&["PTTL", &key])
                .trim()
                .parse()
                .unwrap();
            assert!(ttl > 0, "{context}: the log has no expiry ({ttl})");
        }
        weighted += u64::from(extra > 0);
    }
    assert!(
        settled > 20 && granted > 20 && back > 20 && weighted > 20,
        "{settled} settled, {granted} granted or set, {back} in the past, {weighted} weighted"
    );
}

/// A lone plain policy of most algorithms answers its raw state, and the store computes the
/// status from it (`Raw` in src/store/redis.rs); beside another policy, the script's own
/// `snapshot` reports it. On the same state at the same instant both must agree exactly,
/// to the microsecond (the memory comparison allows a millisecond: it counts nanoseconds):
/// statuses, and the outcome of every request that changes nothing (a denial, a cost that
/// never fits, a look at cost 0). Time starts at a real epoch's magnitude, and some
/// requests reach Redis with an earlier time (a `ManualClock` never goes back, so they go
/// through a second store on the same keys whose clock is behind: another node's time
/// after a failover); every key keeps a TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_policy_reports_exactly_what_its_script_reports() {
    async fn decide(store: &RedisStore, key: &str, policies: &PolicySet, cost: u64) -> Decision {
        store
            .decide(&Key::new(key), policies, cost)
            .await
            .unwrap_or_else(|error| panic!("{key}: {error}"))
    }
    /// The subject's store, on a clock of its own.
    fn at(subject: &Subject, clock: &ManualClock) -> RedisStore {
        match &subject.store {
            AnyStore::Redis(store) => store.clone().with_clock(clock.clone()),
            AnyStore::Memory(_) => unreachable!("only Redis subjects are compared here"),
        }
    }
    let backends = Backends::start().await;
    // Never binds, so the other policy decides alone; its presence takes the full path.
    let bystander =
        Policy::fixed_window("bystander", 1_000_000, Duration::from_secs(3600)).unwrap();
    let mut policies = every_algorithm();
    policies.push(Policy::concurrency("cc", 4).unwrap());
    // About November 2023, in microseconds since the epoch.
    let epoch = Duration::from_micros(1_700_000_000_000_000);
    let second = Duration::from_secs(1);
    for policy in policies {
        let name = policy.name().to_owned();
        let too_much = policy.limit() + 1;
        let alone = PolicySet::from(policy.clone());
        let beside = PolicySet::new([policy, bystander.clone()]).unwrap();
        // The memory subject is not compared here: both paths are Redis's.
        for subject in backends.subjects(&format!("raw-{name}")).iter().skip(1) {
            let (ahead, behind) = (ManualClock::new(), ManualClock::new());
            let (store, late) = (at(subject, &ahead), at(subject, &behind));
            let (mut now, mut admitted, mut denied, mut back) = (epoch, 0, 0, 0);
            for (step, &(gap, cost)) in trace(17, 80, 3_000).iter().enumerate() {
                // Every ninth request reaches Redis 1.5 s before the one before it: nothing
                // may be refilled, rolled back or reported differently because of it.
                let store_is_ahead = step % 9 != 8;
                let (store, when) = if store_is_ahead {
                    now += Duration::from_millis(gap);
                    ahead.set(now);
                    (&store, now)
                } else {
                    let past = now - 1_500 * Duration::from_millis(1);
                    behind.set(past);
                    back += 1;
                    (&late, past)
                };
                let cost = if step == 40 { too_much } else { cost };
                let decided = decide(store, "client", &alone, cost).await;
                let context = format!(
                    "{name} on {} step {step} at {when:?} cost {cost}",
                    subject.name
                );
                if decided.is_allowed() {
                    admitted += 1;
                } else {
                    denied += 1;
                    // A refusal writes nothing: the full path, asked the same, refuses
                    // alike, with the same wait.
                    let scripted = decide(store, "client", &beside, cost).await;
                    assert_eq!(decided.outcome(), scripted.outcome(), "{context}");
                    assert_eq!(decided.statuses()[0], scripted.statuses()[0], "{context}");
                }
                // Cost 0: a look at the state the decision left, through both paths.
                let raw = decide(store, "client", &alone, 0).await;
                let scripted = decide(store, "client", &beside, 0).await;
                assert_eq!(raw.statuses()[0], scripted.statuses()[0], "{context}");
                assert_eq!(raw.outcome(), scripted.outcome(), "{context}");
                // (In the past, a log's decision reports its new entry as the newest,
                // though a later one is stored: both paths do, and the look after sees
                // the later one.)
                if store_is_ahead || name != "sl" {
                    assert_eq!(decided.statuses()[0], raw.statuses()[0], "{context}");
                }
            }
            assert!(
                admitted > 0 && denied > 0 && back > 5,
                "{name}: {admitted} admitted, {denied} denied, {back} in the past"
            );
            // Two identities with one history, one decided alone and one beside the
            // bystander: every decision alike, debits included, the third one 10 s before
            // everything the state holds.
            let (ahead, behind) = (ManualClock::new(), ManualClock::new());
            let (store, early) = (at(subject, &ahead), at(subject, &behind));
            behind.set(epoch - 10 * second);
            for (step, (late, at, cost)) in [
                (true, epoch, 1),
                (true, epoch + second, 1),
                (false, epoch - 10 * second, 1),
                (false, epoch - 10 * second, 0),
                (true, epoch + 2 * second, 2),
            ]
            .into_iter()
            .enumerate()
            {
                let store = if late {
                    ahead.set(at);
                    &store
                } else {
                    &early
                };
                let raw = decide(store, "history-a", &alone, cost).await;
                let scripted = decide(store, "history-b", &beside, cost).await;
                let context = format!("{name} on {} history step {step}", subject.name);
                assert_eq!(raw.outcome(), scripted.outcome(), "{context}");
                assert_eq!(raw.statuses()[0], scripted.statuses()[0], "{context}");
            }
        }
    }
    let keys = backends.keys_with_ttl();
    assert!(keys.len() > 20, "the test wrote {} keys", keys.len());
    for (key, ttl) in &keys {
        assert!(*ttl > 0, "{key} has TTL {ttl} ms");
    }
}

/// A standalone server, and a Redis store on it and an in-process store sharing one
/// manual clock, set at 1,000 s.
async fn twins_at_1000_s() -> (
    RedisServer,
    ManualClock,
    RedisStore,
    MemoryStore<ManualClock>,
) {
    let server = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_clock(clock.clone());
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    (server, clock, store, memory)
}

/// A settle can charge a log past its limit (the request used more than it reserved).
/// The effective window `t` is then the time until one more unit fits, as for every other
/// algorithm (draft-ietf-httpapi-ratelimit-headers-11 section 4.2, the "t" parameter: the
/// time until the quota is restored), not until the oldest entry leaves, which frees too
/// little: clients that read `t` came back early and were denied. On every store, alone
/// (Redis's path for one policy) and beside another policy (its general path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_charged_past_its_limit_says_when_a_unit_fits() {
    let (_server, clock, store, memory) = twins_at_1000_s().await;
    let log = Policy::sliding_log("sl", 10, Duration::from_secs(60)).unwrap();
    let bystander =
        Policy::fixed_window("bystander", 1_000_000, Duration::from_secs(3600)).unwrap();
    let sets = [
        PolicySet::from(log.clone()),
        PolicySet::new([log, bystander]).unwrap(),
    ];
    let second = Duration::from_secs(1);
    for (n, set) in sets.iter().enumerate() {
        let key = Key::new(format!("charged-{n}"));
        for redis in [false, true] {
            // Each run later than the one before: the Redis store's time never steps
            // back.
            let start = Duration::from_secs(1_000 + 200 * n as u64 + 100 * u64::from(redis));
            let decide = async |cost: u64| -> Decision {
                if redis {
                    store.decide(&key, set, cost).await.unwrap()
                } else {
                    memory.check(key.as_str(), set, cost)
                }
            };
            clock.set(start);
            assert!(decide(1).await.is_allowed());
            clock.set(start + second);
            let reserved = decide(9).await;
            assert!(reserved.is_allowed());
            // It used 14: the log holds 15, 5 past its limit.
            let charge = Adjustment::settle(9, 14, reserved.receipt());
            if redis {
                store.adjust(&key, set, &charge).await.unwrap();
            } else {
                memory.adjust_now(key.as_str(), set, &charge);
            }
            clock.set(start + 2 * second);
            let denied = decide(1).await;
            let context = format!("set {n}, on {}", if redis { "Redis" } else { "memory" });
            assert!(!denied.is_allowed(), "{context}");
            // The entry of 1 leaves at 60 s, the entry of 14 at 61 s: a unit fits then.
            assert_eq!(denied.statuses()[0].remaining, 0, "{context}");
            assert_eq!(
                denied.statuses()[0].effective_window,
                59 * second,
                "{context}"
            );
            let Outcome::Denied { retry_after, .. } = denied.outcome() else {
                unreachable!()
            };
            assert_eq!(retry_after, 59 * second, "{context}");
            clock.set(start + 60 * second);
            assert!(
                !decide(1).await.is_allowed(),
                "{context}: 14 still in the log"
            );
            clock.set(start + 61 * second);
            assert!(decide(1).await.is_allowed(), "{context}");
        }
    }
}

/// Redis `TIME` may step back (a failover to a replica whose clock is behind, an NTP
/// step): a state then holds debits made later than the script's now. Its key must live
/// until they are gone, as the in-process store keeps it (its time never goes back on a
/// state): a bucket's level is as of its later update, a log's newest entry is later
/// than now. Expired from now instead, the key went Δ early, and with it every debit of
/// the last Δ before the step: a whole quota admitted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_written_after_time_stepped_back_outlives_its_later_debits() {
    let (server, clock, store, _) = twins_at_1000_s().await;
    // A manual clock never goes back: the later calls go through a store on another.
    let behind = ManualClock::new();
    behind.set(Duration::from_secs(995));
    let late = store.clone().with_clock(behind);
    let minute = Duration::from_secs(60);
    let sets = [
        (
            "bucket",
            Policy::token_bucket("bucket", 100, Rate::per_minute(100)).unwrap(),
            50,
        ),
        ("log", Policy::sliding_log("log", 100, minute).unwrap(), 1),
        (
            "shaped",
            Policy::leaky_bucket_shaping("shaped", Rate::per_minute(100), minute).unwrap(),
            1,
        ),
    ];
    for (name, policy, cost) in sets {
        let set = PolicySet::from(policy);
        let key = Key::new(name);
        assert_eq!(clock.now(), 1_000_000_000_000);
        assert!(store.decide(&key, &set, cost).await.unwrap().is_allowed());
        // The clock steps back 5 s; a debit there still counts until its state is whole.
        assert!(late.decide(&key, &set, cost).await.unwrap().is_allowed());
        // Bucket: 100 missing as of 1,000 s, whole at 1,060 s, 65 s from now. Log: its
        // newest entry (1,000 s) leaves at 1,060 s. Shaped: 2 queued as of 1,000 s, empty
        // at 1,001.2 s.
        let needed = match name {
            "shaped" => Duration::from_millis(6_200),
            _ => Duration::from_secs(65),
        };
        let ttls: Vec<(String, i64)> = support::keys_with_ttl(&server)
            .into_iter()
            .filter(|(key_name, _)| key_name.contains(name))
            .collect();
        assert!(!ttls.is_empty(), "{name}: no key");
        for (key_name, ttl) in ttls {
            assert!(
                ttl >= needed.as_millis() as i64 - 1_000 && ttl > 0,
                "{name}: {key_name} expires in {ttl} ms, its debits count for {needed:?}"
            );
        }
    }
}

/// A costly request to a full log of one-unit entries waits for the `cost`-th oldest
/// entry: the script reads that entry by its rank, never the log up to it. Walking it
/// cost the shared server work in proportion to the limit on every such request, which
/// a client that chooses its cost (a body's size, a GraphQL query's points) could repeat
/// to stall every tenant of the server. Same answer as the in-process store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_costly_request_to_a_full_log_reads_one_entry_not_the_log() {
    const LIMIT: u64 = 2_000;
    let (server, clock, store, memory) = twins_at_1000_s().await;
    let set =
        PolicySet::from(Policy::sliding_log("daily", LIMIT, Duration::from_secs(86_400)).unwrap());
    let key = Key::new("filler");
    for _ in 0..LIMIT {
        clock.advance(Duration::from_millis(1));
        assert!(store.decide(&key, &set, 1).await.unwrap().is_allowed());
        assert!(memory.check("filler", &set, 1).is_allowed());
    }
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
    for cost in [LIMIT, LIMIT / 2, 2] {
        let decision = store.decide(&key, &set, cost).await.unwrap();
        let twin = memory.check("filler", &set, cost);
        assert!(!decision.is_allowed());
        assert!(
            close(decision.retry_after().unwrap(), twin.retry_after().unwrap()),
            "cost {cost}: {decision:?} against {twin:?}"
        );
    }
    assert_eq!(
        support::command_calls(&server, "zrangebyscore"),
        0,
        "the log was walked"
    );
}

/// A costly request to a full log of multi-unit entries (a client that filled it with
/// cost-2 requests) reads at most 256 of them, whatever the limit: past them, its wait is
/// an upper bound (each entry beyond frees one unit at least); for this log, one request
/// an instant, the in-process store answers alike. (Past the 256, the two stores' bounds
/// may differ where requests share an instant: the in-process store keeps them as one
/// entry, Redis as one member each; both are no earlier than the exact wait.) It used
/// to read the log up to the entry that frees enough, in proportion to the limit, on the
/// server every replica uses, for a request the client could repeat at will.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_costly_request_to_a_log_of_multi_unit_entries_reads_a_bounded_part_of_it() {
    const LIMIT: u64 = 4_000;
    const STEP: Duration = Duration::from_millis(1);
    let (server, clock, store, memory) = twins_at_1000_s().await;
    let window = Duration::from_secs(86_400);
    let set = PolicySet::from(Policy::sliding_log("daily", LIMIT, window).unwrap());
    let key = Key::new("filler");
    // 2,000 entries of 2 units, a millisecond apart: the log is full.
    for _ in 0..LIMIT / 2 {
        clock.advance(STEP);
        assert!(store.decide(&key, &set, 2).await.unwrap().is_allowed());
        assert!(memory.check("filler", &set, 2).is_allowed());
    }
    let first = Duration::from_secs(1_000) + STEP;
    clock.advance(Duration::from_secs(60));
    let now = Duration::from_nanos(tollgate::clock::Clock::now(&clock));
    let monitor = support::Monitor::start(&server);
    // (cost, the exact wait: until the entry that frees enough has left)
    let exact = |cost: u64| first + STEP * (cost.div_ceil(2) as u32 - 1) + window - now;
    for cost in [300, 1_000, LIMIT] {
        let decision = store.decide(&key, &set, cost).await.unwrap();
        let twin = memory.check("filler", &set, cost);
        let (wait, twin_wait) = (decision.retry_after().unwrap(), twin.retry_after().unwrap());
        assert!(
            close(wait, twin_wait),
            "cost {cost}: {decision:?} against {twin:?}"
        );
        // Never earlier than the exact wait; exact while it lies within the entries read.
        assert!(
            wait + STEP > exact(cost),
            "cost {cost}: {wait:?} < {:?}",
            exact(cost)
        );
        if cost <= 2 * 256 {
            assert!(
                close(wait, exact(cost)),
                "cost {cost}: {wait:?} against {:?}",
                exact(cost)
            );
        }
    }
    // No command of the scripts read more than 256 members of the log.
    let read = |line: &str| -> Option<u64> {
        let args: Vec<&str> = line.split('"').skip(1).step_by(2).collect();
        let command = args.first()?.to_ascii_uppercase();
        match command.as_str() {
            "ZRANGEBYSCORE" | "ZREVRANGEBYSCORE" => {
                let limit = args.iter().position(|a| a.eq_ignore_ascii_case("LIMIT"));
                // Without LIMIT: every member in the score range (the whole log here).
                Some(limit.map_or(LIMIT, |at| args[at + 2].parse().unwrap_or(LIMIT)))
            }
            "ZRANGE" => {
                let (from, to): (i64, i64) = (args[2].parse().ok()?, args[3].parse().ok()?);
                Some(if from < 0 || to < 0 {
                    1
                } else {
                    (to - from + 1) as u64
                })
            }
            _ => None,
        }
    };
    let lines = monitor.lines_through(&server);
    assert!(
        lines.iter().any(|l| l.contains("ZRANGE")),
        "the monitor saw the scripts"
    );
    for line in &lines {
        if let Some(members) = read(line) {
            assert!(members <= 256, "read {members} members: {line}");
        }
    }
}

/// A request that costs nothing spends nothing, so no policy can deny it (`Cost`'s docs),
/// however far over its limit the key is: a zero-cost health check behind a shaping
/// policy whose queue is over its delay bound, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_costs_nothing_is_admitted_by_every_algorithm_on_every_store() {
    let backends = Backends::start().await;
    for policy in every_algorithm() {
        let name = policy.name().to_owned();
        let set = PolicySet::from(policy);
        for subject in backends.subjects(&format!("free-{name}")) {
            subject.clock.set(Duration::from_secs(1_000));
            let mut denied = 0;
            for _ in 0..30 {
                if !subject.check("k", &set, 2).await.is_allowed() {
                    denied += 1;
                }
            }
            assert!(
                denied > 0,
                "{name} on {}: the key is over its limit",
                subject.name
            );
            let free = subject.check("k", &set, 0).await;
            assert!(
                free.is_allowed(),
                "{name} on {}: a free request was denied: {free:?}",
                subject.name
            );
            assert_eq!(
                free.outcome(),
                Outcome::Allowed {
                    delay: Duration::ZERO
                },
                "{name} on {}: a free request waits for nothing",
                subject.name
            );
        }
    }
}

/// Redis counts time in whole microseconds. A duration finer than that (a third of a
/// second, `Duration::from_secs(1) / 3`) must mean the same policy on every store: a
/// shaping bucket holding requests back at most 333,333,333 ns with 3 a second admits
/// as many requests at once on each (it was one in memory, two in Redis, which rounded
/// the delay up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_finer_than_a_microsecond_mean_the_same_policy_on_every_store() {
    let backends = Backends::start().await;
    let third = Duration::from_secs(1) / 3;
    let policies = [
        Policy::leaky_bucket_shaping("ls", Rate::per_second(3), third).unwrap(),
        Policy::fixed_window("fw", 2, third).unwrap(),
        Policy::gcra("gc", Rate::new(1, third), 2).unwrap(),
    ];
    replay_each(
        &backends,
        "fine",
        "client-6",
        policies,
        &trace(19, 150, 300),
    )
    .await;
    // The shaping bucket's burst, as the policy states it and as each store admits it.
    let shaping =
        PolicySet::from(Policy::leaky_bucket_shaping("burst", Rate::per_second(3), third).unwrap());
    let stated = shaping.iter().next().unwrap().limit();
    for subject in backends.subjects("fine-burst") {
        subject.clock.set(Duration::from_secs(1_000));
        let decision = subject.check("k", &shaping, 1).await;
        assert_eq!(
            decision.statuses()[0].limit,
            stated,
            "{}: the quota it reports",
            subject.name
        );
        let mut admitted = u64::from(decision.is_allowed());
        while subject.check("k", &shaping, 1).await.is_allowed() {
            admitted += 1;
        }
        assert_eq!(admitted, stated, "{}: the burst it admits", subject.name);
    }
}

/// Two spellings of one policy (a rate in other terms, the policing leaky bucket for the
/// token bucket whose math it is) decide alike, and share one state on every store: on
/// Redis the key names the rate in lowest terms and one kind for both, and in process
/// they had a state each, so a client spent the quota once under each spelling. Each
/// still reports the algorithm as it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_of_one_policy_share_one_state_on_every_store() {
    let backends = Backends::start().await;
    let given = Rate::per_minute(120);
    let spellings = [
        Policy::token_bucket("api", 4, Rate::per_second(2)).unwrap(),
        Policy::token_bucket("api", 4, given).unwrap(),
        Policy::leaky_bucket("api", 4, Rate::new(4, Duration::from_secs(2))).unwrap(),
        Policy::gcra("g", Rate::per_second(2), 4).unwrap(),
        Policy::gcra("g", Rate::new(2_000, Duration::from_secs(1_000)), 4).unwrap(),
    ];
    assert_eq!(
        spellings[1].algorithm(),
        tollgate::Algorithm::TokenBucket {
            capacity: 4,
            refill: given
        }
    );
    assert_ne!(
        spellings[0], spellings[1],
        "as given, they are other policies"
    );
    for subject in backends.subjects("spellings") {
        subject.clock.set(Duration::from_secs(1_000));
        for (spent, others) in [
            (&spellings[0], &spellings[1..3]),
            (&spellings[3], &spellings[4..]),
        ] {
            let first = PolicySet::from(spent.clone());
            assert!(subject.check("k", &first, 4).await.is_allowed());
            for other in others {
                let decision = subject.check("k", &PolicySet::from(other.clone()), 1).await;
                assert!(
                    !decision.is_allowed(),
                    "{}: {:?} after {:?} spent the quota",
                    subject.name,
                    other.algorithm(),
                    spent.algorithm()
                );
            }
        }
    }
}

/// The suite's clocks start at zero, where Lua's doubles (exact below 2^53 µs, about
/// 9.0e15) have all their room; a production clock reads about 1.8e15 µs since the epoch
/// (2027), and the Redis store accepts a bucket or GCRA whose level reaches up to 2^53.
/// The same arrivals from today's time on every algorithm, and policies at the edges the
/// Redis store accepts (the largest limit and window, a bucket and a GCRA a hair under the
/// bound, a shaping bucket that queues for the longest delay), costs scaled to them, decide alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_decides_alike_at_todays_time_and_at_the_edges() {
    use tollgate::policy::{MAX_LIMIT, MAX_PERIOD};
    let backends = Backends::start().await;
    let today = Duration::from_secs(1_800_000_000);
    for policy in every_algorithm() {
        let prefix = format!("today-{}", policy.name());
        let set = PolicySet::from(policy);
        replay_from(
            &backends,
            &prefix,
            "t",
            &set,
            &trace(7, 120, 4_000),
            today,
            1,
        )
        .await;
    }
    let hour = Duration::from_secs(3600);
    // 2 x 1,250,000 x 3.6e9 µs = 9.0e15: just under 2^53, so accepted.
    let near = 1_250_000;
    let edges = [
        (
            Policy::fixed_window("fwmax", MAX_LIMIT, MAX_PERIOD).unwrap(),
            MAX_LIMIT / 20,
        ),
        (
            Policy::sliding_window("swmax", MAX_LIMIT, MAX_PERIOD).unwrap(),
            MAX_LIMIT / 20,
        ),
        (Policy::sliding_log("slmax", 1_000, MAX_PERIOD).unwrap(), 50),
        (
            Policy::token_bucket("tbnear", near, Rate::per_hour(1)).unwrap(),
            near / 20,
        ),
        (
            Policy::leaky_bucket("lbnear", near, Rate::per_hour(1)).unwrap(),
            near / 20,
        ),
        (
            Policy::gcra("gcnear", Rate::per_hour(1), near).unwrap(),
            near / 20,
        ),
        (
            Policy::leaky_bucket_shaping("lshour", Rate::per_hour(1_000_000), hour).unwrap(),
            50_000,
        ),
    ];
    for (policy, scale) in edges {
        let set = PolicySet::from(policy);
        backends
            .standalone_store
            .validate(&set)
            .unwrap_or_else(|error| panic!("{error}"));
        for (start, at) in [(Duration::ZERO, "zero"), (today, "today")] {
            let prefix = format!("edge-{at}-{}", set.policies()[0].name());
            replay_from(
                &backends,
                &prefix,
                "e",
                &set,
                &trace(5, 80, 4_000),
                start,
                scale,
            )
            .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_decides_alike() {
    let backends = Backends::start().await;

    replay_each(
        &backends,
        "single",
        "client-1",
        every_algorithm(),
        &trace(7, 120, 4_000),
    )
    .await;
    // Bursts: many arrivals at the same instant.
    replay_each(
        &backends,
        "burst",
        "client-2",
        every_algorithm(),
        &trace(11, 60, 2),
    )
    .await;

    let multi = PolicySet::new([
        Policy::token_bucket("burst", 5, Rate::new(5, Duration::from_secs(10))).unwrap(),
        Policy::fixed_window("hourly", 20, Duration::from_secs(3600)).unwrap(),
        Policy::sliding_log("log", 12, MINUTE).unwrap(),
        Policy::sliding_window_split("split", 15, MINUTE, 3).unwrap(),
    ])
    .unwrap();
    replay(
        &backends,
        "multi",
        "client-3",
        &multi,
        &trace(3, 150, 3_000),
    )
    .await;

    // Shadow policies: decided in state of their own, never denying, reported alike.
    let shadowed = PolicySet::new([
        Policy::token_bucket("burst", 5, Rate::new(5, Duration::from_secs(10))).unwrap(),
        Policy::fixed_window("strict", 3, MINUTE).unwrap().shadow(),
        Policy::sliding_log("log", 4, MINUTE).unwrap().shadow(),
        Policy::gcra("gc", Rate::new(2, Duration::from_secs(10)), 2)
            .unwrap()
            .shadow(),
    ])
    .unwrap();
    replay(
        &backends,
        "shadow",
        "client-4",
        &shadowed,
        &trace(13, 150, 3_000),
    )
    .await;

    // Penalties: blocks, doubling, and a blocked key answered from the block.
    let penalty =
        tollgate::policy::Penalty::new(3, Duration::from_secs(20), Duration::from_secs(15))
            .doubling_up_to(Duration::from_secs(60));
    let penalized = PolicySet::new([
        Policy::token_bucket("burst", 3, Rate::new(3, Duration::from_secs(10)))
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
        Policy::sliding_log("log", 20, MINUTE)
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
        Policy::fixed_window("hourly", 60, Duration::from_secs(3600)).unwrap(),
    ])
    .unwrap();
    replay(
        &backends,
        "penalty",
        "client-5",
        &penalized,
        &trace(17, 300, 2_500),
    )
    .await;

    // A cost that can never fit is answered at once, and spends nothing.
    for subject in backends.subjects("never") {
        let set = PolicySet::from(Policy::token_bucket("tb", 10, Rate::per_second(1)).unwrap());
        let decision = subject.check("k", &set, 11).await;
        assert_eq!(
            decision.outcome(),
            Outcome::CostExceedsLimit {
                policy: 0,
                cost: 11,
                limit: 10
            },
            "{}",
            subject.name
        );
        assert_eq!(
            subject.check("k", &set, 10).await.statuses()[0].remaining,
            0,
            "{}",
            subject.name
        );
    }

    // A block's denial says it is one (what a deny cache may answer until it ends); the
    // denials that count towards it do not.
    for subject in backends.subjects("blocked") {
        let set = PolicySet::from(
            Policy::fixed_window("fw", 1, MINUTE)
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        );
        assert!(subject.check("k", &set, 1).await.is_allowed());
        for _ in 0..2 {
            let counted = subject.check("k", &set, 1).await;
            assert!(
                !counted.is_allowed() && !counted.is_blocked(),
                "{}",
                subject.name
            );
        }
        for _ in 0..2 {
            let blocked = subject.check("k", &set, 1).await;
            assert!(blocked.is_blocked(), "{}: {blocked:?}", subject.name);
        }
    }

    // Every key the scenarios wrote expires when its state is fresh again: none lives
    // forever, none outlives its longest window (an hour here) by more than a second.
    let keys = backends.keys_with_ttl();
    assert!(keys.len() > 20, "the scenarios wrote {} keys", keys.len());
    for (key, ttl) in &keys {
        assert!(*ttl > 0 && *ttl <= 3_601_000, "{key} has TTL {ttl} ms");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_identities_stay_in_one_slot_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    // Several policies per identity: the script touches all their keys at once, which a
    // Cluster refuses (CROSSSLOT) unless they share a slot.
    let set = PolicySet::new([
        Policy::sliding_log("a", 2, MINUTE).unwrap(),
        Policy::token_bucket("b", 2, Rate::per_minute(1)).unwrap(),
    ])
    .unwrap();
    let long = "z".repeat(10_000);
    let identities = [
        "}{",
        "{x}",
        "a:b:c",
        "nul\0byte",
        "100%",
        "ü-ñ",
        long.as_str(),
        "plain",
    ];
    for identity in identities {
        let key = Key::new(identity);
        for expected in [true, true, false] {
            let decision = store
                .decide(&key, &set, 1)
                .await
                .unwrap_or_else(|e| panic!("{identity:?}: {e}"));
            assert_eq!(decision.is_allowed(), expected, "{identity:?}");
        }
    }
    // Each identity kept its own budget, in one slot: 2 keys (the log, one sorted set, and
    // the bucket), nothing shared.
    let keys = cluster.keys_with_ttl();
    assert_eq!(keys.len(), 2 * identities.len(), "{keys:?}");
    for (key, _) in &keys {
        let tag_start = key.find('{').unwrap();
        let tag_end = key[tag_start..].find('}').unwrap() + tag_start;
        let slot_of = |k: &str| cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", k]);
        assert_eq!(slot_of(key), slot_of(&key[tag_start..=tag_end]), "{key}");
    }
}

async fn hammer(stores: &[RedisStore], policies: &PolicySet) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64 {
        let store = stores[task % stores.len()].clone();
        let (policies, admitted) = (policies.clone(), Arc::clone(&admitted));
        tasks.push(tokio::spawn(async move {
            let key = Key::new("hot");
            for _ in 0..5 {
                if store.decide(&key, &policies, 1).await.unwrap().is_allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_admit_exactly_the_limit() {
    const LIMIT: u64 = 100;
    let standalone = RedisServer::start();
    let cluster = RedisCluster::start(3);
    for (name, url) in [("redis", Some(standalone.url())), ("cluster", None)] {
        // Three stores with their own connections: three replicas of one service. The
        // clock stands still, so nothing refills while 64 tasks send 320 requests.
        let clock = ManualClock::new();
        clock.set(Duration::from_secs(1_000));
        let mut stores = Vec::new();
        for _ in 0..3 {
            let store = match &url {
                Some(url) => RedisStore::connect(url).await.unwrap(),
                None => RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
            };
            stores.push(store.with_clock(clock.clone()));
        }
        for policy in [
            Policy::fixed_window("fw", LIMIT, MINUTE).unwrap(),
            Policy::sliding_log("sl", LIMIT, MINUTE).unwrap(),
            Policy::sliding_window("sw", LIMIT, MINUTE).unwrap(),
            Policy::sliding_window_split("sw6", LIMIT, MINUTE, 6).unwrap(),
            Policy::token_bucket("tb", LIMIT, Rate::per_hour(1)).unwrap(),
            Policy::leaky_bucket("lb", LIMIT, Rate::per_hour(1)).unwrap(),
            Policy::gcra("gc", Rate::per_hour(1), LIMIT).unwrap(),
        ] {
            let label = policy.name().to_owned();
            let admitted = hammer(&stores, &PolicySet::from(policy)).await;
            assert_eq!(admitted, LIMIT, "{name} {label}");
        }
    }
}

#[tokio::test]
async fn sliding_counter_error_against_the_exact_log() {
    // The same bursty trace through the exact sliding log and the O(1) counter; the
    // counter's worst window and its total are reported next to the log's.
    let limit = 20;
    let window = Duration::from_secs(10);
    let arrivals = trace(42, 2_000, 1_500);
    let mut results = Vec::new();
    for policy in [
        Policy::sliding_log("log", limit, window).unwrap(),
        Policy::sliding_window("counter", limit, window).unwrap(),
    ] {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let set = PolicySet::from(policy);
        let (mut now, mut admitted) = (0u64, Vec::new());
        for &(gap, cost) in &arrivals {
            now += gap;
            clock.set(Duration::from_millis(now));
            if store.check("k", &set, cost).is_allowed() {
                admitted.push((now, cost));
            }
        }
        let total: u64 = admitted.iter().map(|(_, c)| c).sum();
        let worst = admitted
            .iter()
            .map(|&(start, _)| {
                admitted
                    .iter()
                    .filter(|(t, _)| *t >= start && *t < start + window.as_millis() as u64)
                    .map(|(_, c)| c)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        results.push((total, worst));
    }
    let ((log_total, log_worst), (counter_total, counter_worst)) = (results[0], results[1]);
    println!(
        "sliding counter vs log on {} arrivals, limit {limit} per {window:?}: admitted {counter_total} vs {log_total} units ({:+.1}%), worst window {counter_worst} vs {log_worst}",
        arrivals.len(),
        (counter_total as f64 - log_total as f64) * 100.0 / log_total as f64
    );
    assert!(log_worst <= limit);
    // The counter assumes the previous window was spread evenly: it can overshoot, but
    // never beyond twice the limit, and it stays within 10% of the exact total here.
    assert!(counter_worst <= 2 * limit, "worst window {counter_worst}");
    assert!(
        counter_total.abs_diff(log_total) * 10 <= log_total,
        "{counter_total} vs {log_total}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_constructor_shares_one_budget_and_survives_a_script_flush() {
    let standalone = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let policies =
        PolicySet::from(Policy::fixed_window("api", 4, Duration::from_secs(3600)).unwrap());

    let (pool, cluster_pool) = support::pools(&standalone, &cluster);
    let pairs = [
        (
            "standalone",
            RedisStore::connect(&standalone.url()).await.unwrap(),
            RedisStore::from_pool(pool),
        ),
        (
            "cluster",
            RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
            RedisStore::from_cluster_pool(cluster_pool),
        ),
    ];
    for (name, connected, pooled) in pairs {
        let key = Key::new("shared");
        let mut admitted = 0;
        for round in 0..3 {
            for store in [&connected, &pooled] {
                if store.decide(&key, &policies, 1).await.unwrap().is_allowed() {
                    admitted += 1;
                }
            }
            if round == 0 {
                // Scripts and functions vanish (a restart, a failover, SCRIPT FLUSH,
                // FUNCTION FLUSH): EVALSHA answers NOSCRIPT, FCALL "Function not found",
                // and the store loads them again by itself.
                let nodes: Vec<&RedisServer> = match name {
                    "standalone" => vec![&standalone],
                    _ => cluster.nodes.iter().collect(),
                };
                for node in nodes {
                    assert_eq!(node.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
                    assert_eq!(node.cli(&["FUNCTION", "FLUSH"]).trim(), "OK");
                }
            }
        }
        // Two ways in, one budget.
        assert_eq!(admitted, 4, "{name}");
    }
}

impl Subject {
    async fn adjust(&self, key: &str, policies: &PolicySet, adjustment: &Adjustment) -> Decision {
        match &self.store {
            AnyStore::Memory(store) => store.adjust_now(key, policies, adjustment),
            AnyStore::Redis(store) => store
                .adjust(&Key::new(key), policies, adjustment)
                .await
                .unwrap_or_else(|error| panic!("{}: {error}", self.name)),
        }
    }
}

/// A trace of reservations settled later: (ms since the last arrival, units reserved,
/// units used, ms from the decision to its settlement).
fn settle_trace(seed: u64, steps: usize, max_gap_ms: u64) -> Vec<(u64, u64, u64, u64)> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    (0..steps)
        .map(|_| {
            let reserved = 1 + next() % 4;
            // Mostly below the reservation, sometimes above it.
            let used = next() % (reserved + 2);
            (next() % max_gap_ms, reserved, used, next() % 8_000)
        })
        .collect()
}

/// Replays reservations and their settlements on every subject: decisions and
/// settlements must agree. A settlement comes `settle_after` after its decision, in time
/// order with the arrivals (so other requests may come between, in a new window).
async fn replay_settled(
    backends: &Backends,
    prefix: &str,
    policies: &PolicySet,
    arrivals: &[(u64, u64, u64, u64)],
) {
    let subjects = backends.subjects(prefix);
    // (due, reserved, used, each subject's decision), in the order they were admitted.
    let mut pending: Vec<(Duration, u64, u64, Vec<Decision>)> = Vec::new();
    let mut now = Duration::ZERO;
    let (mut admitted, mut refunded) = (0, 0);
    for (step, &(gap, reserved, used, settle_after)) in arrivals.iter().enumerate() {
        now += Duration::from_millis(gap);
        pending.sort_by_key(|entry| entry.0);
        while pending.first().is_some_and(|entry| entry.0 <= now) {
            let (due, reserved, used, decisions) = pending.remove(0);
            let mut settled = Vec::new();
            for (subject, decision) in subjects.iter().zip(decisions) {
                subject.clock.set(due);
                // Every other settlement knows what its debit left (exact for buckets
                // and GCRA); the others count all refill since as lost.
                let left = decision.statuses().iter().map(|status| status.remaining);
                let adjustment = Adjustment::settle(reserved, used, decision.receipt());
                let adjustment = if due.as_millis() % 2 == 0 {
                    adjustment.with_left(left)
                } else {
                    adjustment
                };
                settled.push(subject.adjust("client", policies, &adjustment).await);
            }
            for (subject, decision) in subjects.iter().zip(&settled).skip(1) {
                assert!(
                    same(&settled[0], decision),
                    "{prefix} settle before step {step} at {due:?} ({reserved} -> {used}): memory {:?} vs {} {:?}",
                    settled[0],
                    subject.name,
                    decision
                );
            }
        }
        let mut decisions = Vec::new();
        for subject in &subjects {
            subject.clock.set(now);
            decisions.push(subject.check("client", policies, reserved).await);
        }
        for (subject, decision) in subjects.iter().zip(&decisions).skip(1) {
            assert!(
                same(&decisions[0], decision),
                "{prefix} step {step} at {now:?}: memory {:?} vs {} {:?}",
                decisions[0],
                subject.name,
                decision
            );
        }
        if decisions[0].is_allowed() {
            admitted += 1;
            refunded += u64::from(used < reserved);
            pending.push((
                now + Duration::from_millis(settle_after),
                reserved,
                used,
                decisions,
            ));
        }
    }
    assert!(
        admitted > 5 && refunded > 2,
        "{prefix}: {admitted} admitted, {refunded} refunded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_settles_alike() {
    let backends = Backends::start().await;
    // Short windows too, so that settlements often arrive after their window moved on
    // (and must not reopen it).
    let short = Duration::from_secs(5);
    let mut policies = every_algorithm();
    policies.extend([
        Policy::fixed_window("fw5", 6, short).unwrap(),
        Policy::sliding_log("sl5", 6, short).unwrap(),
        Policy::sliding_window_split("sw5", 6, short, 5).unwrap(),
    ]);
    for policy in policies {
        let name = policy.name().to_owned();
        replay_settled(
            &backends,
            &format!("settle-{name}"),
            &PolicySet::from(policy),
            // Long enough that every policy settles some refunds, owing as it goes.
            &settle_trace(5, 160, 5_000),
        )
        .await;
    }
    let multi = PolicySet::new([
        Policy::token_bucket("burst", 6, Rate::new(6, Duration::from_secs(10))).unwrap(),
        Policy::fixed_window("hourly", 40, Duration::from_secs(3600)).unwrap(),
        Policy::sliding_log("log", 15, MINUTE).unwrap(),
        Policy::sliding_window_split("split", 15, MINUTE, 3).unwrap(),
        Policy::gcra("gc", Rate::new(10, MINUTE), 8).unwrap(),
    ])
    .unwrap();
    replay_settled(
        &backends,
        "settle-multi",
        &multi,
        &settle_trace(9, 120, 3_000),
    )
    .await;
    // A shadow policy that would have denied was not debited: settling gives it nothing.
    let shadowed = PolicySet::new([
        Policy::token_bucket("burst", 8, Rate::new(8, Duration::from_secs(10))).unwrap(),
        Policy::fixed_window("strict", 4, MINUTE).unwrap().shadow(),
    ])
    .unwrap();
    replay_settled(
        &backends,
        "settle-shadow",
        &shadowed,
        &settle_trace(21, 120, 2_000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_counts_requests_in_flight_alike() {
    let backends = Backends::start().await;
    let lease = Duration::from_secs(3600);
    let sets = [
        PolicySet::from(Policy::concurrency_with_lease("cc", 3, lease).unwrap()),
        PolicySet::new([
            Policy::concurrency_with_lease("cc", 2, lease).unwrap(),
            Policy::token_bucket("tb", 6, Rate::new(1, Duration::from_secs(2))).unwrap(),
        ])
        .unwrap(),
    ];
    for (index, set) in sets.iter().enumerate() {
        let subjects = backends.subjects(&format!("inflight-{index}"));
        // Per subject, the receipts of the requests it holds, oldest first.
        let mut held: Vec<Vec<tollgate::Receipt>> = vec![Vec::new(); subjects.len()];
        let mut state = 17u64 + index as u64;
        let (mut now, mut denied, mut released) = (Duration::ZERO, 0, 0);
        for step in 0..150 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            now += Duration::from_millis((state >> 33) % 700);
            let release = (state >> 40) % 5 < 2 && !held[0].is_empty();
            let mut decisions = Vec::new();
            for (i, subject) in subjects.iter().enumerate() {
                subject.clock.set(now);
                let decision = if release {
                    let receipt = held[i].remove(0);
                    subject
                        .adjust("client", set, &Adjustment::release(1, receipt))
                        .await
                } else {
                    let decision = subject.check("client", set, 1).await;
                    if decision.is_allowed() {
                        held[i].push(decision.receipt());
                    }
                    decision
                };
                decisions.push(decision);
            }
            for (subject, decision) in subjects.iter().zip(&decisions).skip(1) {
                assert!(
                    same(&decisions[0], decision),
                    "set {index} step {step} ({}): memory {:?} vs {} {:?}",
                    if release { "release" } else { "acquire" },
                    decisions[0],
                    subject.name,
                    decision
                );
            }
            released += u64::from(release);
            denied += u64::from(!release && !decisions[0].is_allowed());
        }
        assert!(
            denied > 5 && released > 5,
            "set {index}: {denied} denied, {released} released"
        );
    }
}

/// A release of a decision that took no slot (a denial, a block) frees nothing, on every
/// store: Redis removes a slot by the request's lease, and in process a release took one
/// off the count whatever it was for, so a caller that releases every decision it got
/// (a `finally`) freed a slot another request still held: 2 in flight under a limit of 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_of_a_decision_that_took_no_slot_frees_nothing_on_every_store() {
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let set = PolicySet::new([
        Policy::concurrency("streams", 1).unwrap(),
        Policy::fixed_window("minute", 2, MINUTE)
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(1, 60 * second, 60 * second))
            .unwrap(),
    ])
    .unwrap();
    let mut checked = 0;
    for subject in backends.subjects("release-denied") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        let release = |receipt| Adjustment::release(1, receipt);
        let running = subject.check("client", &set, 1).await;
        assert!(running.is_allowed(), "{name}");
        // Denied by the in-flight limit (no strike: the minute has room), and released.
        let denied = subject.check("client", &set, 1).await;
        assert!(!denied.is_allowed() && !denied.is_blocked(), "{name}");
        let after = subject
            .adjust("client", &set, &release(denied.receipt()))
            .await;
        assert_eq!(
            after.statuses()[0].remaining,
            0,
            "{name}: a denial freed a slot"
        );
        assert!(
            !subject.check("client", &set, 1).await.is_allowed(),
            "{name}"
        );
        // The running request ends; another takes the slot and the minute's last unit;
        // the next is denied by both, a strike, and blocked: released too.
        subject
            .adjust("client", &set, &release(running.receipt()))
            .await;
        assert!(
            subject.check("client", &set, 1).await.is_allowed(),
            "{name}"
        );
        let blocked = subject.check("client", &set, 1).await;
        assert!(blocked.is_blocked(), "{name}: {:?}", blocked.outcome());
        let after = subject
            .adjust("client", &set, &release(blocked.receipt()))
            .await;
        assert_eq!(
            after.statuses()[0].remaining,
            0,
            "{name}: a block freed a slot"
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
    // Past the 64 policies a receipt's mask names one by one: a settle of a refusal
    // gives nothing back under the 65th either.
    let mut policies: Vec<Policy> = (0..64)
        .map(|index| Policy::fixed_window(&format!("w{index}"), 5, MINUTE).unwrap())
        .collect();
    policies.push(Policy::fixed_window("last", 1, MINUTE).unwrap());
    let wide = PolicySet::new(policies).unwrap();
    for subject in backends.subjects("release-denied-wide") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        assert!(
            subject.check("client", &wide, 1).await.is_allowed(),
            "{name}"
        );
        let denied = subject.check("client", &wide, 1).await;
        assert!(!denied.is_allowed(), "{name}");
        subject
            .adjust("client", &wide, &Adjustment::settle(1, 0, denied.receipt()))
            .await;
        assert!(
            !subject.check("client", &wide, 1).await.is_allowed(),
            "{name}: a settle of a refusal gave back a unit under the 65th policy"
        );
    }
}

// An in-flight limit changed while requests run (a configuration reload: 2 → 3, a longer
// lease) keeps counting the requests already in flight: they hold slots of the same
// quota. Started afresh, the new limit would admit 3 more beside the 2 still running.
// Their slots are freed under the new policy as under the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_in_flight_limit_counts_the_requests_already_in_flight() {
    let backends = Backends::start().await;
    let old = PolicySet::from(Policy::concurrency("streams", 2).unwrap());
    let new = PolicySet::from(
        Policy::concurrency_with_lease("streams", 3, Duration::from_secs(90)).unwrap(),
    );
    for subject in backends.subjects("inflight-change") {
        let held: Vec<_> = [
            subject.check("client", &old, 1).await,
            subject.check("client", &old, 1).await,
        ]
        .into_iter()
        .map(|decision| {
            assert!(decision.is_allowed(), "{}", subject.name);
            decision.receipt()
        })
        .collect();
        let third = subject.check("client", &new, 1).await;
        assert!(
            third.is_allowed(),
            "{}: one slot of 3 is free",
            subject.name
        );
        assert_eq!(third.statuses()[0].remaining, 0, "{}", subject.name);
        assert!(
            !subject.check("client", &new, 1).await.is_allowed(),
            "{}: the 2 requests in flight still count under the new limit",
            subject.name
        );
        // A request of before ends: its slot is free under the new limit.
        let freed = subject
            .adjust("client", &new, &Adjustment::release(1, held[0]))
            .await;
        assert_eq!(freed.statuses()[0].remaining, 1, "{}", subject.name);
    }
}

// On Redis one key holds an in-flight policy's slots whatever their lease (see above), so
// a slot taken under a shorter lease (a reload that shortens it, or another route's
// policy of the same name) must not shorten the key's life: the key would expire, with
// the longer-leased slots still held by running requests, and a whole limit be admitted
// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_lease_never_shortens_the_life_of_slots_held_longer() {
    let backends = Backends::start().await;
    let long = PolicySet::from(
        Policy::concurrency_with_lease("streams", 3, Duration::from_secs(3600)).unwrap(),
    );
    let short = PolicySet::from(
        Policy::concurrency_with_lease("streams", 3, Duration::from_secs(30)).unwrap(),
    );
    for subject in backends.subjects("inflight-lease") {
        if matches!(subject.store, AnyStore::Memory(_)) {
            continue;
        }
        assert!(subject.check("client", &long, 1).await.is_allowed());
        assert!(subject.check("client", &short, 1).await.is_allowed());
    }
    let keys: Vec<_> = backends
        .keys_with_ttl()
        .into_iter()
        .filter(|(key, _)| key.starts_with("inflight-lease"))
        .collect();
    assert_eq!(keys.len(), 2, "one key per Redis: {keys:?}");
    for (key, ttl) in keys {
        assert!(
            ttl > 3_000_000,
            "{key} expires in {ttl} ms, before the slot leased for an hour"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_of_a_replica_that_died_expire_with_their_lease() {
    let standalone = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let lease = Duration::from_secs(30);
    let set = PolicySet::from(Policy::concurrency_with_lease("inflight", 2, lease).unwrap());
    for (name, url) in [("redis", Some(standalone.url())), ("cluster", None)] {
        let connect = || async {
            match &url {
                Some(url) => RedisStore::connect(url).await.unwrap(),
                None => RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
            }
        };
        let clock = ManualClock::new();
        clock.set(Duration::from_secs(10_000));
        let key = Key::new("team");
        // A replica takes both slots and dies without giving them back.
        let doomed = connect().await.with_clock(clock.clone());
        for _ in 0..2 {
            assert!(
                doomed.decide(&key, &set, 1).await.unwrap().is_allowed(),
                "{name}"
            );
        }
        drop(doomed);
        let survivor = connect().await.with_clock(clock.clone());
        assert!(
            !survivor.decide(&key, &set, 1).await.unwrap().is_allowed(),
            "{name}"
        );
        clock.advance(lease - Duration::from_millis(1));
        assert!(
            !survivor.decide(&key, &set, 1).await.unwrap().is_allowed(),
            "{name}"
        );
        // One lease after they were taken, the slots are back.
        clock.advance(Duration::from_millis(2));
        let decision = survivor.decide(&key, &set, 1).await.unwrap();
        assert!(decision.is_allowed(), "{name}");
        assert_eq!(decision.statuses()[0].remaining, 1, "{name}");
    }
    // The slots' key expires by itself too.
    for (key, ttl) in keys_with_ttl(&standalone) {
        assert!(ttl > 0 && ttl <= 30_001, "{key} has TTL {ttl} ms");
    }
}

impl Subject {
    async fn peek(&self, key: &str, policies: &PolicySet) -> Decision {
        let store: &dyn Store = match &self.store {
            AnyStore::Memory(store) => store,
            AnyStore::Redis(store) => store,
        };
        store
            .peek(&Key::new(key), policies)
            .await
            .unwrap_or_else(|error| panic!("{}: {error}", self.name))
    }

    async fn reset(&self, key: &str, policies: &PolicySet) {
        let store: &dyn Store = match &self.store {
            AnyStore::Memory(store) => store,
            AnyStore::Redis(store) => store,
        };
        store
            .reset(&Key::new(key), policies)
            .await
            .unwrap_or_else(|error| panic!("{}: {error}", self.name));
    }
}

/// A reset forgives: blocks and strikes go too, an in-flight policy's included (its
/// slots stay, freed by their requests). On Redis the reset skipped an in-flight
/// policy's keys whole, its penalty's with them: the block held for its 10 minutes there,
/// where memory admitted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_forgives_an_in_flight_policys_block_on_every_store() {
    let backends = Backends::start().await;
    let set = PolicySet::from(
        Policy::concurrency("streams", 1)
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(2, MINUTE, 10 * MINUTE))
            .unwrap(),
    );
    let mut checked = 0;
    for subject in backends.subjects("reset-in-flight-block") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        let running = subject.check("client", &set, 1).await;
        assert!(running.is_allowed(), "{name}");
        // Two denials while the slot is held: a block.
        for _ in 0..2 {
            assert!(
                !subject.check("client", &set, 1).await.is_allowed(),
                "{name}"
            );
        }
        let blocked = subject.check("client", &set, 1).await;
        assert!(blocked.is_blocked(), "{name}: {:?}", blocked.outcome());
        subject.reset("client", &set).await;
        // The slot is still the running request's: freed when it ends.
        assert!(
            !subject.check("client", &set, 1).await.is_blocked(),
            "{name}"
        );
        subject
            .adjust("client", &set, &Adjustment::release(1, running.receipt()))
            .await;
        let after = subject.check("client", &set, 1).await;
        assert!(after.is_allowed(), "{name}: {:?}", after.outcome());
        checked += 1;
    }
    assert!(checked >= 3, "memory, Redis and a Cluster");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_inspects_grants_sets_and_resets_alike() {
    let backends = Backends::start().await;
    let policies = every_algorithm();
    let sets: Vec<PolicySet> = policies
        .into_iter()
        .map(PolicySet::from)
        .chain([PolicySet::new([
            Policy::token_bucket("burst", 10, Rate::new(10, MINUTE)).unwrap(),
            Policy::sliding_log("log", 10, MINUTE).unwrap(),
            Policy::sliding_window_split("split", 10, MINUTE, 3).unwrap(),
        ])
        .unwrap()])
        .collect();
    for (index, set) in sets.iter().enumerate() {
        let subjects = backends.subjects(&format!("inspect-{index}"));
        let label = set[0].name().to_owned();
        // Every step: (time in ms, what to do), the same on every subject.
        let steps: [(u64, &str); 9] = [
            (1_000, "spend 3"),
            (2_000, "spend 4"),
            (2_500, "peek"),
            (2_600, "peek"),
            (3_000, "grant 2"),
            (3_500, "set 8"),
            (4_000, "set 1"),
            (4_500, "reset"),
            (4_600, "peek"),
        ];
        let mut seen = Vec::new();
        for &(at, step) in &steps {
            let mut decisions = Vec::new();
            for subject in &subjects {
                subject.clock.set(Duration::from_millis(at));
                let decision = match step.split_once(' ') {
                    Some(("spend", n)) => subject.check("client", set, n.parse().unwrap()).await,
                    Some(("grant", n)) => {
                        let grant = Adjustment::grant(n.parse().unwrap());
                        subject.adjust("client", set, &grant).await
                    }
                    Some(("set", n)) => {
                        let level = Adjustment::set_remaining(n.parse().unwrap());
                        subject.adjust("client", set, &level).await
                    }
                    _ if step == "reset" => {
                        subject.reset("client", set).await;
                        subject.peek("client", set).await
                    }
                    _ => subject.peek("client", set).await,
                };
                decisions.push(decision);
            }
            for (subject, decision) in subjects.iter().zip(&decisions).skip(1) {
                assert!(
                    same(&decisions[0], decision),
                    "{label} {step} at {at} ms: memory {:?} vs {} {:?}",
                    decisions[0],
                    subject.name,
                    decision
                );
            }
            seen.push(decisions.swap_remove(0));
        }
        let left = |i: usize| seen[i].statuses()[0].remaining;
        if set[0].name() == "ls" {
            // The shaping bucket's remaining is its queue room: checked alike above.
            continue;
        }
        assert_eq!(left(2), left(1), "{label}: a peek spends nothing");
        assert_eq!(left(3), left(2), "{label}: nor does a second one");
        assert!(left(4) > left(3), "{label}: a grant gives units back");
        assert_eq!(
            left(5),
            8.min(set[0].limit()),
            "{label}: set to 8 (at most the quota)"
        );
        assert_eq!(left(6), 1, "{label}: set to 1");
        assert_eq!(left(8), set[0].limit(), "{label}: reset to a full quota");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_that_expired_under_a_penalty_starts_empty() {
    // The log's sorted set expires after its window, while its hash lives on to keep a
    // penalty: the count the hash holds must not outlive the log.
    let standalone = RedisServer::start();
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1_000));
    let store = RedisStore::connect(&standalone.url())
        .await
        .unwrap()
        .with_clock(clock.clone());
    let set = PolicySet::from(
        Policy::sliding_log("log", 2, Duration::from_secs(10))
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(
                5,
                Duration::from_secs(60),
                Duration::from_secs(60),
            ))
            .unwrap(),
    );
    let key = Key::new("k");
    for _ in 0..3 {
        store.decide(&key, &set, 1).await.unwrap();
    }
    // As Redis does when the log's TTL runs out (the test clock does not move Redis's).
    let (log_key, _) = store.keys().policy_keys("k", &set[0]);
    assert_eq!(standalone.cli(&["DEL", &log_key]).trim(), "1");
    clock.advance(Duration::from_secs(11));
    let decision = store.decide(&key, &set, 1).await.unwrap();
    assert!(decision.is_allowed());
    assert_eq!(decision.statuses()[0].remaining, 1);
}

/// Replays `arrivals` in bursts: every `burst` arrivals share one instant and reach the
/// Redis stores at once (so they coalesce into batches), and the in-process store one by
/// one in the same order. Each decision must match its twin.
async fn replay_bursts(
    backends: &Backends,
    prefix: &str,
    policies: &PolicySet,
    arrivals: &[(u64, u64)],
    burst: usize,
) -> u64 {
    let subjects = backends.subjects(prefix);
    let mut now = Duration::ZERO;
    let mut admitted = 0;
    for (index, chunk) in arrivals.chunks(burst).enumerate() {
        now += Duration::from_millis(chunk[0].0 * 10);
        for subject in &subjects {
            subject.clock.set(now);
        }
        let expected: Vec<Decision> = {
            let mut one_by_one = Vec::new();
            for &(_, cost) in chunk {
                one_by_one.push(subjects[0].check("burst", policies, cost).await);
            }
            one_by_one
        };
        for subject in &subjects[1..] {
            let AnyStore::Redis(store) = &subject.store else {
                unreachable!()
            };
            let key = Key::new("burst");
            let at_once = futures_util::future::join_all(
                chunk
                    .iter()
                    .map(|&(_, cost)| store.decide(&key, policies, cost)),
            )
            .await;
            for (step, (want, got)) in expected.iter().zip(at_once).enumerate() {
                let got = got.unwrap_or_else(|error| panic!("{}: {error}", subject.name));
                assert!(
                    same(want, &got),
                    "{prefix} burst {index} step {step}: memory {want:?} vs {} {got:?}",
                    subject.name
                );
            }
        }
        admitted += expected.iter().filter(|d| d.is_allowed()).count() as u64;
    }
    admitted
}

/// Concurrent decisions for one identity go to Redis as batches; each batch must decide
/// exactly as the same requests one by one: every algorithm, several policies, shadows
/// and penalties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_decisions_match_one_by_one() {
    let backends = Backends::start().await;
    let penalty =
        tollgate::policy::Penalty::new(3, Duration::from_secs(20), Duration::from_secs(15));
    let mut sets: Vec<(String, PolicySet)> = every_algorithm()
        .into_iter()
        .map(|policy| (policy.name().to_owned(), PolicySet::from(policy)))
        .collect();
    sets.push((
        "multi".to_owned(),
        PolicySet::new([
            Policy::token_bucket("burst", 8, Rate::new(4, Duration::from_secs(10))).unwrap(),
            Policy::fixed_window("strict", 20, MINUTE).unwrap().shadow(),
            Policy::sliding_log("log", 12, MINUTE)
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        ])
        .unwrap(),
    ));
    for (name, policies) in sets {
        let arrivals = trace(29, 120, 400);
        let admitted = replay_bursts(
            &backends,
            &format!("coalesce-{name}"),
            &policies,
            &arrivals,
            24,
        )
        .await;
        assert!(
            admitted > 0 && admitted < arrivals.len() as u64,
            "{name}: {admitted} of {} admitted",
            arrivals.len()
        );
    }
}

/// Decisions made together cost few script calls: 256 at once for one identity are one
/// call and two batches of 128 when all are polled before the first answer is back
/// (3 calls, each time on an idle machine), admitted in arrival order; without
/// coalescing, 256 calls. A decision joins a batch as it is first polled: on a loaded
/// machine a pass over the 256 can end before all have joined (the runtime's cooperative
/// scheduling), and an answer back meanwhile sends the batch of those joined so far (14
/// calls were seen), which the bound allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_a_few_calls_and_stays_in_order() {
    let server = RedisServer::start();
    let calls = || support::script_stats(&server).0;
    let policies = PolicySet::from(Policy::fixed_window("hot", 100, MINUTE).unwrap());
    for coalescing in [true, false] {
        let store = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .prefix(if coalescing { "on" } else { "off" })
            .coalescing(coalescing)
            // Time stands still: no minute ends inside the burst (on Redis's clock one
            // could, and the new window would admit more).
            .with_clock(ManualClock::new());
        assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
        let key = Key::new("hot");
        let decisions =
            futures_util::future::join_all((0..256).map(|_| store.decide(&key, &policies, 1)))
                .await;
        let allowed: Vec<bool> = decisions
            .into_iter()
            .map(|decision| decision.unwrap().is_allowed())
            .collect();
        // Exactly the limit; coalesced, the first 100 to arrive (separate calls reach
        // Redis in whatever order the connection sends them).
        assert_eq!(allowed.iter().filter(|&&a| a).count(), 100);
        if coalescing {
            assert!(allowed[..100].iter().all(|&a| a));
        }
        let made = calls();
        println!("coalescing {coalescing}: 256 decisions in {made} script calls");
        if coalescing {
            assert!((3..=32).contains(&made), "{made} calls");
        } else {
            assert_eq!(made, 256);
        }
    }
}

/// Asserts that a decision of `cost` for `identity`, whose state holds `what` written by
/// another client, is refused as a state tollgate did not write.
async fn refused_as_foreign(
    store: &RedisStore,
    identity: &str,
    policies: &PolicySet,
    cost: u64,
    what: &str,
) {
    let error = store
        .decide(&Key::new(identity), policies, cost)
        .await
        .expect_err(&format!("{what} was read as a state tollgate wrote"));
    assert_eq!(
        error.kind(),
        tollgate::store::StoreErrorKind::Refused,
        "{error}"
    );
    assert!(error.to_string().contains("did not write"), "{error}");
}

/// A GCRA key holding a value tollgate did not write (another client's `SET` in its keys,
/// an operator's, another layout), or a fixed window whose index or count is no number:
/// the state cannot be read, so the decision fails loudly (a refusal, not I/O: logged and
/// counted, the breaker stays closed), never admits a full burst as if the key were
/// empty. The sliding log refuses its foreign members the same way
/// (`a_log_counts_every_entry_of_one_microsecond`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_tollgate_did_not_write_is_refused() {
    let server = RedisServer::start();
    // Time stands still: no window ends between a debit and its settle.
    let store = support::frozen_store(&server).await;
    let gcra = PolicySet::from(Policy::gcra("g", Rate::per_second(10), 5).unwrap());
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    for (index, value) in ["123", "abc", "1:2:3", "-5:1", "", "12:x"]
        .iter()
        .enumerate()
    {
        let identity = format!("foreign-{index}");
        let key = store.keys().policy_keys(&identity, &gcra[0]).0;
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(*value)
            .query_async(&mut connection)
            .await
            .unwrap();
        refused_as_foreign(&store, &identity, &gcra, 1, &format!("{value:?}")).await;
    }
    // A fixed window's fields (an index no time reaches yet, so its count is read).
    let window = PolicySet::from(Policy::fixed_window("w", 10, Duration::from_secs(60)).unwrap());
    for (index, (i, c)) in [("99999999999", "many"), ("zero", "1")].iter().enumerate() {
        let identity = format!("foreign-window-{index}");
        let key = store.keys().policy_keys(&identity, &window[0]).0;
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("i")
            .arg(*i)
            .arg("c")
            .arg(*c)
            .query_async(&mut connection)
            .await
            .unwrap();
        refused_as_foreign(&store, &identity, &window, 1, &format!("i={i} c={c}")).await;
    }

    // A value tollgate wrote is read as it was written.
    let identity = Key::new("own");
    assert!(
        store
            .decide(&identity, &gcra, 5)
            .await
            .unwrap()
            .is_allowed()
    );
    assert!(
        !store
            .decide(&identity, &gcra, 1)
            .await
            .unwrap()
            .is_allowed()
    );

    // A settle of a set whose GCRA state went foreign after the debit fails with nothing
    // changed: the window beside it keeps its debit (every state is read before any is
    // written; Redis undoes nothing a failed script wrote).
    let window = Policy::fixed_window("w", 10, Duration::from_secs(60)).unwrap();
    let both = PolicySet::new([window.clone(), gcra[0].clone()]).unwrap();
    let identity = Key::new("settled");
    let debit = store.decide(&identity, &both, 3).await.unwrap();
    assert!(debit.is_allowed());
    let key = store.keys().policy_keys(identity.as_str(), &gcra[0]).0;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("not a time")
        .query_async(&mut connection)
        .await
        .unwrap();
    let error = store
        .adjust(&identity, &both, &Adjustment::settle(3, 0, debit.receipt()))
        .await
        .expect_err("a foreign GCRA value was settled");
    assert_eq!(
        error.kind(),
        tollgate::store::StoreErrorKind::Refused,
        "{error}"
    );
    let alone = PolicySet::from(window);
    let peek = store.peek(&identity, &alone).await.unwrap();
    assert_eq!(peek.statuses()[0].remaining, 7, "the window was refunded");
}

/// A coalesced decision whose request went away before its batch left is not decided
/// (nor debited); the others are, even when the leading request went away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_requests_in_a_batch() {
    let server = RedisServer::start();
    // Time stands still: no minute ends between the debits and the peek.
    let store = support::frozen_store(&server).await;
    let policies = PolicySet::from(Policy::fixed_window("drop", 10, MINUTE).unwrap());
    let key = Key::new("drop");
    // The leader's call goes out, and it is dropped while it is away: the five queued
    // behind it still get their answers. (Redis holds writes for 150 ms: the leader's
    // call is still away after its first poll, however fast the machine.)
    use futures_util::FutureExt;
    assert_eq!(
        server.cli(&["CLIENT", "PAUSE", "150", "WRITE"]).trim(),
        "OK"
    );
    let mut leader = store.decide(&key, &policies, 1);
    let first = (&mut leader).now_or_never();
    assert!(first.is_none(), "its call is away: {first:?}");
    let mut followers: Vec<_> = (0..5).map(|_| store.decide(&key, &policies, 1)).collect();
    for follower in &mut followers {
        assert!(
            follower.now_or_never().is_none(),
            "queued behind the leader"
        );
    }
    let (dropped, kept): (Vec<_>, Vec<_>) = followers
        .into_iter()
        .enumerate()
        .partition(|(index, _)| index % 2 == 0);
    drop(dropped);
    drop(leader);
    let answers = futures_util::future::join_all(kept.into_iter().map(|(_, f)| f)).await;
    let remaining: Vec<u64> = answers
        .into_iter()
        .map(|answer| answer.unwrap().statuses()[0].remaining)
        .collect();
    // The two kept followers were debited one after the other, after the leader (whose
    // call may or may not have reached Redis before it was dropped), and nothing after
    // them: the three dropped while queued were not.
    assert!(matches!(remaining[..], [9, 8] | [8, 7]), "{remaining:?}");
    let peek = store.decide(&key, &policies, 0).await.unwrap();
    assert_eq!(peek.statuses()[0].remaining, remaining[1]);
}

/// A decision's future waits for nothing another future must do: one made and held
/// without being polled (a caller that builds its futures first, or drives them out of
/// order) led the batch from the moment it was made, and the decisions made after it
/// waited for it to be polled, past any timeout. A decision joins a batch when it is
/// first polled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_waits_for_no_other_future_to_be_polled() {
    let server = RedisServer::start();
    let store = support::frozen_store(&server).await;
    let policies = PolicySet::from(Policy::fixed_window("lazy", 10, MINUTE).unwrap());
    let key = Key::new("lazy");
    let first = store.decide(&key, &policies, 1);
    let second = store.decide(&key, &policies, 1);
    let answered = tokio::time::timeout(Duration::from_secs(5), second).await;
    let second = answered.expect("answered while the first is not polled");
    assert_eq!(second.unwrap().statuses()[0].remaining, 9);
    // The first is decided when it runs.
    assert_eq!(first.await.unwrap().statuses()[0].remaining, 8);
}

/// Two stores over one server with other prefixes, deciding at once for the same identity
/// under one policy set: each debits its own keys (their calls never share a batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_with_other_prefixes_never_share_a_batch() {
    let server = RedisServer::start();
    // Time stands still: no minute ends between the debits and the peeks.
    let base = support::frozen_store(&server).await;
    let (api, admin) = (base.clone().prefix("api"), base.clone().prefix("admin"));
    let policies = PolicySet::from(Policy::fixed_window("shared", 10, MINUTE).unwrap());
    let key = Key::new("203.0.113.9");
    let decisions = futures_util::future::join_all(
        (0..6).map(|i| if i % 2 == 0 { &api } else { &admin }.decide(&key, &policies, 1)),
    )
    .await;
    for decision in decisions {
        assert!(decision.unwrap().is_allowed());
    }
    for store in [&api, &admin] {
        let peek = store.peek(&key, &policies).await.unwrap();
        assert_eq!(peek.statuses()[0].remaining, 7);
    }
}

/// A settle that comes after the sliding log it refers to has expired (a long response)
/// gives nothing back and writes nothing: no key is brought back without a TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_after_the_log_expired_leaves_no_key_behind() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .prefix("late");
    // Reserves 3 on a log of 5 over `window`, waits `wait`, settles to 1.
    let reserve_then_settle = async |identity: &str, window: Duration, wait: Duration| {
        let policies = PolicySet::from(Policy::sliding_log("log", 5, window).unwrap());
        let key = Key::new(identity);
        let decision = store.decide(&key, &policies, 3).await.unwrap();
        tokio::time::sleep(wait).await;
        store
            .adjust(
                &key,
                &policies,
                &Adjustment::settle(3, 1, decision.receipt()),
            )
            .await
            .unwrap()
    };
    // Well past the log's 5 ms (its keys expire with it).
    reserve_then_settle("late", Duration::from_millis(5), Duration::from_millis(100)).await;
    let left: Vec<_> = keys_with_ttl(&server)
        .into_iter()
        .filter(|(name, _)| name.starts_with("late:"))
        .collect();
    assert!(left.is_empty(), "keys left behind: {left:?}");

    // A settle that gives back part of a log's only entry keeps the log's TTL.
    let settled = reserve_then_settle("partial", Duration::from_secs(60), Duration::ZERO).await;
    assert_eq!(settled.statuses()[0].remaining, 4);
    for (name, ttl) in keys_with_ttl(&server) {
        assert!(ttl > 0, "{name} has TTL {ttl}");
    }
}

/// A penalty's block and strikes outlive a change of the rate they guard, in every store:
/// an operator who tightens a limit during an attack (a reload) does not free the
/// clients it has blocked. Only a change of the penalty itself, or a reset, forgives
/// (README). Its state was named by the rate's parameters too, so a tightened limit
/// started every key's penalty afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_rate_keeps_its_penaltys_blocks() {
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let penalty = tollgate::policy::Penalty::new(1, 10 * second, 3_600 * second);
    let loose = PolicySet::from(
        Policy::fixed_window("login", 2, MINUTE)
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
    );
    let tight = PolicySet::from(
        Policy::fixed_window("login", 1, MINUTE)
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
    );
    for subject in backends.subjects("tightened") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        for _ in 0..2 {
            assert!(subject.check("k", &loose, 1).await.is_allowed(), "{name}");
        }
        assert!(subject.check("k", &loose, 1).await.is_blocked(), "{name}");
        // The window is over; the hour's block is not.
        subject.clock.advance(61 * second);
        let after = subject.check("k", &tight, 1).await;
        assert!(
            after.is_blocked(),
            "{name}: the block went with the rate: {after:?}"
        );
    }
}

/// A policy turned shadow by a reload (to stop enforcing it) never denies, on every
/// store: a shadow policy keeps a state of its own, its penalty's too. Keyed by name, the
/// in-process store's shadow penalty was the enforced one's, and answered from its block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_turned_shadow_denies_nothing_from_its_blocks() {
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let penalty = tollgate::policy::Penalty::new(1, 10 * second, 3_600 * second);
    let enforced = Policy::fixed_window("login", 2, MINUTE)
        .unwrap()
        .with_penalty(penalty)
        .unwrap();
    // Its limit raised too, as a roll-back of a tightened limit would.
    let shadow = PolicySet::from(
        Policy::fixed_window("login", 5, MINUTE)
            .unwrap()
            .with_penalty(penalty)
            .unwrap()
            .shadow(),
    );
    let enforced = PolicySet::from(enforced);
    for subject in backends.subjects("turned-shadow") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        for _ in 0..2 {
            assert!(
                subject.check("k", &enforced, 1).await.is_allowed(),
                "{name}"
            );
        }
        assert!(
            subject.check("k", &enforced, 1).await.is_blocked(),
            "{name}"
        );
        let after = subject.check("k", &shadow, 1).await;
        assert!(
            after.is_allowed() && !after.is_blocked(),
            "{name}: {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_pardons_a_changed_penalty_and_keeps_the_rate_state() {
    // A penalty changed on reload (a day's block shortened to a minute, to pardon) starts
    // on fresh penalty state in every store; the bucket it guards carries over. Changing
    // back finds the earlier penalty's block again while it lasts; `reset` forgives it.
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let base = Policy::token_bucket("api", 2, Rate::per_hour(2)).unwrap();
    let penalty = |denials, block| tollgate::policy::Penalty::new(denials, 10 * second, block);
    let strict = PolicySet::from(
        base.clone()
            .with_penalty(penalty(1, 86_400 * second))
            .unwrap(),
    );
    // Two denials to a block: the first denial under it is the bucket's alone.
    let lenient = PolicySet::from(base.with_penalty(penalty(2, 60 * second)).unwrap());
    let retry = |decision: &Decision| match decision.outcome() {
        Outcome::Denied { retry_after, .. } => Some(retry_after),
        _ => None,
    };
    let mut answers = Vec::new();
    for subject in backends.subjects("pardon") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        for _ in 0..2 {
            assert!(subject.check("k", &strict, 1).await.is_allowed(), "{name}");
        }
        // One denial blocks for a day.
        let blocked = retry(&subject.check("k", &strict, 1).await).expect(name);
        assert!(blocked > 86_000 * second, "{name}: {blocked:?}");
        subject.clock.advance(120 * second);
        // Under the changed penalty the day's block is gone, but the bucket is still
        // empty: denied by the bucket, whose next unit comes 30 minutes after the two
        // were taken, 28 minutes from now; a bucket started afresh would admit.
        let decision = subject.check("k", &lenient, 1).await;
        let pardoned =
            retry(&decision).unwrap_or_else(|| panic!("{name}: the bucket was started afresh"));
        assert!(
            close(pardoned, 1_680 * second),
            "{name}: {pardoned:?} (a block of a day says about 86,280 s)"
        );
        assert_eq!(decision.statuses()[0].remaining, 0, "{name}");
        // Back under the day's penalty its block still holds: its hash lives on.
        let held = retry(&subject.check("k", &strict, 1).await).expect(name);
        assert!(held > 86_000 * second, "{name}: {held:?}");
        // A reset forgives the penalty of the policies it is given: under the lenient set
        // the day's block stands; under the strict set it goes, with the bucket.
        subject.reset("k", &lenient).await;
        let still = retry(&subject.check("k", &strict, 1).await).expect(name);
        assert!(close(still, held), "{name}: {still:?}");
        subject.reset("k", &strict).await;
        let forgiven = subject.check("k", &strict, 1).await;
        assert!(forgiven.is_allowed(), "{name}: {:?}", forgiven.outcome());
        answers.push((name, pardoned, held));
    }
    let (first, pardoned, held) = answers[0];
    for &(name, other_pardoned, other_held) in &answers[1..] {
        assert!(close(pardoned, other_pardoned), "{first} vs {name}");
        assert!(close(held, other_held), "{first} vs {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_never_answers_sooner_than_the_denials_it_stands_for() {
    // A block answers for its key, but the wait it states is never shorter than what the
    // policies would deny for without it: a client that waits out a minute's block on a
    // spent day's quota would only be denied again for hours (RFC 9110, section 10.2.3:
    // Retry-After is how long to wait; draft-ietf-httpapi-ratelimit-headers-11, section
    // 6: no earlier than the end of the effective window).
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let penalty = tollgate::policy::Penalty::new(1, 10 * second, 60 * second);
    // The blocked policy's own window outlasts the block.
    let alone = PolicySet::from(
        Policy::fixed_window("daily", 2, Duration::from_secs(86_400))
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
    );
    // Another policy's denial outlasts the block.
    let beside = PolicySet::new([
        Policy::fixed_window("login", 2, MINUTE)
            .unwrap()
            .with_penalty(penalty)
            .unwrap(),
        Policy::fixed_window("daily", 2, Duration::from_secs(86_400)).unwrap(),
    ])
    .unwrap();
    let denied = |decision: &Decision| match decision.outcome() {
        Outcome::Denied {
            policy,
            retry_after,
        } => (policy, retry_after),
        other => panic!("denied expected, got {other:?}"),
    };
    let mut checked = 0;
    for subject in backends.subjects("block-floor") {
        let name = subject.name;
        // Each key starts where the one before ended (the clock does not go back).
        subject.clock.set(Duration::from_secs(1_000));
        for (key, set, day) in [("a", &alone, 0), ("b", &beside, 1)] {
            for _ in 0..2 {
                assert!(subject.check(key, set, 1).await.is_allowed(), "{name}");
            }
            // The denial that starts the block, then one under it 30 s later.
            for wait in [Duration::ZERO, 30 * second] {
                subject.clock.advance(wait);
                let decision = subject.check(key, set, 1).await;
                let (policy, retry_after) = denied(&decision);
                // Windows are aligned to the clock's origin: the day's ends at 86,400 s.
                let left = Duration::from_secs(86_400) - Duration::from_nanos(subject.clock.now());
                assert!(
                    close(retry_after, left),
                    "{name}, {key}: {retry_after:?} stated, the day denies for {left:?}"
                );
                assert_eq!(policy, day, "{name}, {key}: the longest wait is the day's");
                let status = decision.statuses()[day];
                assert_eq!(status.remaining, 0, "{name}, {key}");
                assert!(
                    close(status.effective_window, left),
                    "{name}, {key}: t {:?}",
                    status.effective_window
                );
                // The blocked policy reads as blocked, however long its own window.
                assert_eq!(decision.statuses()[0].remaining, 0, "{name}, {key}");
                // A look that spends nothing is told the same wait: when a request would
                // pass.
                let peeked = subject.check(key, set, 0).await;
                assert!(close(denied(&peeked).1, left), "{name}, {key}: peek");
                checked += 1;
            }
        }
        // Two blocks of one length, started by one request: the first policy reports
        // them, on every store.
        let twins = PolicySet::new([
            Policy::fixed_window("a", 1, Duration::from_secs(1))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
            Policy::fixed_window("b", 1, Duration::from_secs(2))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        ])
        .unwrap();
        assert!(subject.check("c", &twins, 1).await.is_allowed(), "{name}");
        let (policy, retry_after) = denied(&subject.check("c", &twins, 1).await);
        assert_eq!(policy, 0, "{name}: the first of equal blocks");
        assert!(close(retry_after, 60 * second), "{name}: {retry_after:?}");
    }
    assert_eq!(checked, 12);
}

/// What an adjustment answers of a blocked key says the block: no units left, and a
/// window no shorter than the block (draft-ietf-httpapi-ratelimit-headers-11, section
/// 4.1: `r` is the quota available, `t` when it is restored). The layer rewrites a settled
/// response's headers from that answer: a request admitted before its key was blocked
/// told its client "3 left" while every request of the next five minutes got a 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adjustment_of_a_blocked_key_reports_the_block_on_every_store() {
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let block = 300 * second;
    let login = PolicySet::new([
        Policy::token_bucket("login", 5, Rate::per_minute(5))
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(1, 10 * second, block))
            .unwrap(),
        Policy::fixed_window("daily", 100, Duration::from_secs(86_400)).unwrap(),
    ])
    .unwrap();
    let mut checked = 0;
    for subject in backends.subjects("blocked-adjust") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        let reserved = subject.check("k", &login, 5).await;
        assert!(reserved.is_allowed(), "{name}");
        // The denial that starts the block.
        assert!(!subject.check("k", &login, 1).await.is_allowed(), "{name}");
        subject.clock.advance(second);
        let left = block - second;
        for adjustment in [
            Adjustment::settle(5, 2, reserved.receipt()),
            Adjustment::grant(2),
            Adjustment::set_remaining(5),
        ] {
            let adjusted = subject.adjust("k", &login, &adjustment).await;
            let status = adjusted.statuses()[0];
            assert_eq!(status.remaining, 0, "{name}: {adjustment:?} under a block");
            assert!(
                close(status.reset, left) && close(status.effective_window, left),
                "{name}: {adjustment:?}: reset {:?}, window {:?}, the block has {left:?}",
                status.reset,
                status.effective_window
            );
            // The other policy, which no block holds, is told as it stands.
            assert!(
                adjusted.statuses()[1].remaining >= 5,
                "{name}: {adjustment:?}"
            );
            checked += 1;
        }
        // Once the block is over, the bucket is told as it stands.
        subject.clock.advance(block);
        let after = subject.check("k", &login, 0).await;
        assert_eq!(
            after.statuses()[0].remaining,
            5,
            "{name}: the bucket refilled"
        );
    }
    assert_eq!(checked, 9);
}

/// A request that can never fit (its cost above a policy's quota) is refused for what it
/// is, and is no offence: on every store it counted as a strike against a penalized
/// policy that denied beside it, started a block, and was answered 429 with a
/// `Retry-After` after which the same request could only be refused again (README:
/// "never with a Retry-After that cannot come true"). Under a block too, it is told it
/// can never fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_no_strike_on_every_store() {
    let backends = Backends::start().await;
    let second = Duration::from_secs(1);
    let set = PolicySet::new([
        Policy::token_bucket("per-request", 5, Rate::per_second(1_000)).unwrap(),
        Policy::fixed_window("hourly", 20, Duration::from_secs(3600))
            .unwrap()
            .with_penalty(tollgate::policy::Penalty::new(2, 60 * second, 300 * second))
            .unwrap(),
    ])
    .unwrap();
    let never = |decision: &Decision| {
        matches!(
            decision.outcome(),
            Outcome::CostExceedsLimit {
                policy: 0,
                cost: 6,
                limit: 5
            }
        )
    };
    let mut checked = 0;
    for subject in backends.subjects("never-strikes") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        for _ in 0..4 {
            assert!(subject.check("a", &set, 5).await.is_allowed(), "{name}");
            subject.clock.advance(Duration::from_millis(10));
        }
        // The hour is spent: each request of 6 can never fit, and the hour denies it.
        for attempt in 0..3 {
            let decision = subject.check("a", &set, 6).await;
            assert!(
                never(&decision),
                "{name}, attempt {attempt}: {:?}",
                decision.outcome()
            );
        }
        // No strike was counted: one denial of a request that fits is not a block yet.
        let denied = subject.check("a", &set, 1).await;
        assert!(
            matches!(denied.outcome(), Outcome::Denied { policy: 1, .. }),
            "{name}: {:?}",
            denied.outcome()
        );
        assert!(!denied.is_blocked(), "{name}: blocked after one strike");
        // The second strike blocks; under the block, a request that can never fit is
        // still told so.
        let blocked = subject.check("a", &set, 1).await;
        assert!(blocked.is_blocked(), "{name}: {:?}", blocked.outcome());
        assert!(
            never(&subject.check("a", &set, 6).await),
            "{name}: under the block"
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}

/// An adjustment for an identity the store does not hold (never stored: its requests
/// cost 0; forgotten: evicted, purged, or its state expired) applies to fresh state, on
/// every store: a settle that charges more than was reserved charges it, and
/// `set_remaining` sets the level. The in-process store once swapped either for a no-op,
/// so a "reserve 0, settle the actual cost" set-up went unlimited in process, and a
/// "block now" of an identity just purged did nothing; Redis loads fresh state and
/// applies them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adjustment_for_an_identity_the_store_does_not_hold_applies_to_fresh_state() {
    let backends = Backends::start().await;
    for (index, policy) in every_algorithm().into_iter().enumerate() {
        let label = policy.name().to_owned();
        let set = PolicySet::from(policy);
        let subjects = backends.subjects(&format!("unheld-{index}"));
        let mut charged = Vec::new();
        let mut blocked = Vec::new();
        for subject in &subjects {
            subject.clock.set(Duration::from_secs(1));
            // Reserved 0 (nothing stored), used 4.
            let free = subject.check("post-paid", &set, 0).await;
            assert!(free.is_allowed(), "{label} {}", subject.name);
            let settle = Adjustment::settle(0, 4, free.receipt());
            subject.adjust("post-paid", &set, &settle).await;
            charged.push(subject.peek("post-paid", &set).await);
            // Never seen: blocked now.
            subject
                .adjust("blocked", &set, &Adjustment::set_remaining(0))
                .await;
            blocked.push(subject.peek("blocked", &set).await);
        }
        for (index, subject) in subjects.iter().enumerate().skip(1) {
            assert!(
                same(&charged[0], &charged[index]),
                "{label}: memory {:?} vs {} {:?}",
                charged[0],
                subject.name,
                charged[index]
            );
            assert!(
                same(&blocked[0], &blocked[index]),
                "{label}: memory {:?} vs {} {:?}",
                blocked[0],
                subject.name,
                blocked[index]
            );
        }
        if label == "ls" {
            // The shaping bucket's remaining is its queue room.
            continue;
        }
        let limit = set[0].limit();
        assert_eq!(
            charged[0].statuses()[0].remaining,
            limit - 4,
            "{label}: the settle charged 4"
        );
        assert_eq!(
            blocked[0].statuses()[0].remaining,
            0,
            "{label}: set to nothing left"
        );
    }
}

/// A settle charges what a request used beyond its reservation even past empty: the
/// excess is owed, and the identity waits until it is paid (a bucket refills it, a window
/// forgets it), on every store, for every algorithm. Charging only as far as there was
/// room made a post-paid cost free once the quota was spent: every "reserve 0, settle
/// the actual cost" request was admitted and charged nothing. The shaping bucket is the
/// exception the algorithm states: a request that costs nothing queues nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_past_empty_is_owed_on_every_store() {
    let backends = Backends::start().await;
    for (index, policy) in every_algorithm().into_iter().enumerate() {
        let label = policy.name().to_owned();
        let limit = policy.limit();
        let set = PolicySet::from(policy);
        let subjects = backends.subjects(&format!("owed-{index}"));
        let mut owing = Vec::new();
        for subject in &subjects {
            subject.clock.set(Duration::from_secs(1));
            // Reserved the whole quota, used three units more.
            let debit = subject.check("owes", &set, limit).await;
            assert!(debit.is_allowed(), "{label} {}", subject.name);
            let settle = Adjustment::settle(limit, limit + 3, debit.receipt());
            subject.adjust("owes", &set, &settle).await;
            let free = subject.check("owes", &set, 0).await;
            owing.push(free);
        }
        for (index, subject) in subjects.iter().enumerate().skip(1) {
            assert!(
                same(&owing[0], &owing[index]),
                "{label}: memory {:?} vs {} {:?}",
                owing[0],
                subject.name,
                owing[index]
            );
        }
        if label == "ls" {
            assert!(
                owing[0].is_allowed(),
                "{label}: a free request goes at once"
            );
            continue;
        }
        assert!(
            !owing[0].is_allowed(),
            "{label}: a request that costs nothing waits while three units are owed: {:?}",
            owing[0]
        );
        assert_eq!(owing[0].statuses()[0].remaining, 0, "{label}");
    }
}

/// Settles that land together each owe what their request used past its reservation, up
/// to one whole quota each: requests in flight at once add up (a cap of one quota owed in
/// all let 200 requests that reserved nothing and used half a quota each be charged two
/// quotas, not 100); and `set_remaining` while owing sets the level, forgiving what is
/// owed. On every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_in_flight_together_each_owe_their_excess_and_a_set_level_forgives_it() {
    let backends = Backends::start().await;
    for (index, policy) in every_algorithm().into_iter().enumerate() {
        let label = policy.name().to_owned();
        let limit = policy.limit();
        let set = PolicySet::from(policy);
        let subjects = backends.subjects(&format!("owes-once-{index}"));
        let mut after_two = Vec::new();
        let mut after_three = Vec::new();
        let mut paid_but_one = Vec::new();
        let mut paid = Vec::new();
        let mut set_to_two = Vec::new();
        let mut set_to_zero = Vec::new();
        for subject in &subjects {
            subject.clock.set(Duration::from_secs(1));
            // Three requests in flight at once, each of which used three quotas.
            let first = subject.check("many", &set, limit).await;
            let second = subject.check("many", &set, 0).await;
            let third = subject.check("many", &set, 0).await;
            assert!(first.is_allowed() && second.is_allowed() && third.is_allowed());
            for (reserved, debit) in [(limit, &first), (0, &second)] {
                let settle = Adjustment::settle(reserved, 3 * limit, debit.receipt());
                subject.adjust("many", &set, &settle).await;
            }
            after_two.push(subject.check("many", &set, 0).await);
            let settle = Adjustment::settle(0, 3 * limit, third.receipt());
            subject.adjust("many", &set, &settle).await;
            after_three.push(subject.check("many", &set, 0).await);
            // Three quotas owed (one for each settle, the first one's reservation
            // spent): a grant of two leaves one owed, a third pays it all.
            subject
                .adjust("many", &set, &Adjustment::grant(2 * limit))
                .await;
            paid_but_one.push(subject.check("many", &set, 0).await);
            subject
                .adjust("many", &set, &Adjustment::grant(limit))
                .await;
            paid.push(subject.check("many", &set, 0).await);
            let level = subject
                .adjust("many", &set, &Adjustment::set_remaining(2))
                .await;
            set_to_two.push(level);
            // Set to nothing left: what was owed is forgiven too.
            let debit = subject.check("zero", &set, limit).await;
            let settle = Adjustment::settle(limit, 3 * limit, debit.receipt());
            subject.adjust("zero", &set, &settle).await;
            subject
                .adjust("zero", &set, &Adjustment::set_remaining(0))
                .await;
            set_to_zero.push(subject.check("zero", &set, 0).await);
        }
        for (index, subject) in subjects.iter().enumerate() {
            for (what, decisions) in [
                ("after two settles", &after_two),
                ("after three", &after_three),
                ("two quotas paid", &paid_but_one),
                ("three quotas paid", &paid),
                ("set to 2", &set_to_two),
                ("set to 0", &set_to_zero),
            ] {
                assert!(
                    same(&decisions[0], &decisions[index]),
                    "{label} {what}: memory {:?} vs {} {:?}",
                    decisions[0],
                    subject.name,
                    decisions[index]
                );
            }
        }
        assert_eq!(
            set_to_two[0].statuses()[0].remaining,
            2,
            "{label}: set_remaining sets the level, what was owed included"
        );
        assert!(
            set_to_zero[0].is_allowed(),
            "{label}: set to 0, nothing is owed: a request that costs nothing goes"
        );
        assert_eq!(set_to_zero[0].statuses()[0].remaining, 0, "{label}");
        if label == "ls" {
            // A request that costs nothing queues nothing, owed or not.
            continue;
        }
        assert!(!after_three[0].is_allowed(), "{label}: owing");
        assert!(
            !paid_but_one[0].is_allowed(),
            "{label}: each settle owes its own quota, a grant of two leaves one owed: {:?}",
            paid_but_one[0]
        );
        assert!(
            paid[0].is_allowed(),
            "{label}: three quotas paid, nothing is owed: {:?}",
            paid[0]
        );
    }
}

/// What an identity owes is bounded all the same, at a thousand quotas (and never past
/// `MAX_LIMIT` units): a flood of absurd reports cannot lock a client out for ever, and a
/// Redis count stays below 2^53. 1,002 requests that reserved nothing each used a whole
/// quota: the first spent it, the next 1,001 owe one each, and the last is not counted.
/// On every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_identity_owes_is_bounded_at_a_thousand_quotas() {
    let backends = Backends::start().await;
    for policy in [
        Policy::token_bucket("tb", 4, Rate::new(4, MINUTE)).unwrap(),
        Policy::fixed_window("fw", 4, MINUTE).unwrap(),
    ] {
        let label = policy.name().to_owned();
        let set = PolicySet::from(policy);
        for subject in backends.subjects(&format!("owes-bounded-{label}")) {
            subject.clock.set(Duration::from_secs(1));
            let mut receipts = Vec::new();
            for _ in 0..1_002 {
                receipts.push(subject.check("k", &set, 0).await.receipt());
            }
            for receipt in receipts {
                let settle = Adjustment::settle(0, 4, receipt);
                subject.adjust("k", &set, &settle).await;
            }
            subject.adjust("k", &set, &Adjustment::grant(999 * 4)).await;
            let one_owed = subject.check("k", &set, 0).await;
            assert!(
                !one_owed.is_allowed(),
                "{label} {}: 999 of 1,000 quotas paid, one is still owed: {one_owed:?}",
                subject.name
            );
            subject.adjust("k", &set, &Adjustment::grant(4)).await;
            let paid = subject.check("k", &set, 0).await;
            assert!(
                paid.is_allowed(),
                "{label} {}: 1,000 quotas paid, nothing is owed: {paid:?}",
                subject.name
            );
        }
    }
}

/// A grant of more than anything can owe forgives it all, on every store. A huge quota (a
/// byte quota of terabytes) can owe past `MAX_LIMIT` (up to `MAX_LIMIT` more than its
/// limit): a grant was sent to Redis cut to `MAX_LIMIT + 1`, which left such a debt one
/// unit short of paid there while the in-process store forgave it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_of_everything_forgives_any_debt() {
    let backends = Backends::start().await;
    let limit = 10_000_000_000_000;
    let set = PolicySet::from(Policy::fixed_window("fw", limit, MINUTE).unwrap());
    for subject in backends.subjects("grant-everything") {
        subject.clock.set(Duration::from_secs(1));
        let mut receipts = Vec::new();
        for _ in 0..101 {
            receipts.push(subject.check("k", &set, 0).await.receipt());
        }
        // Each reported far past any quota: the debt grows to its bound.
        for receipt in receipts {
            subject
                .adjust("k", &set, &Adjustment::settle(0, u64::MAX, receipt))
                .await;
        }
        assert!(!subject.check("k", &set, 0).await.is_allowed());
        subject
            .adjust("k", &set, &Adjustment::grant(u64::MAX))
            .await;
        let after = subject.check("k", &set, 0).await;
        assert_eq!(
            after.statuses()[0].remaining,
            limit,
            "{}: {after:?}",
            subject.name
        );
    }
}

/// The shaping bucket admits any cost up to its capacity while what is queued is within
/// its delay bound, so a costly admission leaves the level past the bound: that is
/// queued, not owed. `set_remaining(0)` read it as owed and forgave it, letting the client
/// in sooner than before (2.5 s of queue cut to 0.5 s), and a settle past the reservation
/// charged about one unit whatever the actual cost. On every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_costly_shaping_admission_is_queued_not_owed() {
    let backends = Backends::start().await;
    let set = PolicySet::from(
        Policy::leaky_bucket_shaping("s", Rate::per_second(2), Duration::from_secs(2)).unwrap(),
    );
    assert_eq!(set[0].limit(), 5);
    let subjects = backends.subjects("shaping-queued");
    let mut after_set = Vec::new();
    let mut after_settle = Vec::new();
    for subject in &subjects {
        subject.clock.set(Duration::from_secs(1));
        for _ in 0..4 {
            assert!(subject.check("k", &set, 1).await.is_allowed());
        }
        // At the bound (4 units queued): a cost of 5 still goes, after 2 s.
        assert!(subject.check("k", &set, 5).await.is_allowed());
        let before = subject.check("k", &set, 1).await;
        assert_eq!(before.retry_after(), Some(Duration::from_millis(2_500)));
        subject
            .adjust("k", &set, &Adjustment::set_remaining(0))
            .await;
        after_set.push(subject.check("k", &set, 1).await);

        // Another identity's costly admission settled at twice its reservation: the
        // five units more are queued too.
        for _ in 0..4 {
            assert!(subject.check("settled", &set, 1).await.is_allowed());
        }
        let costly = subject.check("settled", &set, 5).await;
        assert!(costly.is_allowed());
        let settle = Adjustment::settle(5, 10, costly.receipt());
        subject.adjust("settled", &set, &settle).await;
        after_settle.push(subject.check("settled", &set, 1).await);
    }
    for (index, subject) in subjects.iter().enumerate() {
        assert_eq!(
            after_set[index].retry_after(),
            Some(Duration::from_millis(2_500)),
            "{}: set to 0 left, the queue stands",
            subject.name
        );
        assert_eq!(
            after_settle[index].retry_after(),
            Some(Duration::from_millis(5_000)),
            "{}: 4 + 10 units queued, 4 within the bound",
            subject.name
        );
    }
}

/// An unbooking (a request dropped during its shaping delay) gives back only the newest
/// booking of the shaping queue, and with it the request's units under the other
/// policies; a booking a later one stands behind, or one that has leaked out, is left as
/// it is. Alike on every store (lua/store/adjust.lua's mode 4 is the twin of
/// src/store/decide.rs's `Change::Unbook`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbooking_gives_back_only_the_newest_booking_on_every_store() {
    let backends = Backends::start().await;
    let set = PolicySet::new([
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1), Duration::from_secs(10))
            .unwrap(),
        Policy::token_bucket("tokens", 100, Rate::per_hour(1)).unwrap(),
    ])
    .unwrap();
    for subject in backends.subjects("unbook") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        let first = subject.check("k", &set, 1).await;
        let second = subject.check("k", &set, 1).await;
        let third = subject.check("k", &set, 1).await;
        assert_eq!(delay(&third), Duration::from_secs(2), "{name}");
        subject.clock.advance(Duration::from_millis(300));
        // The second has the third behind it: refused, nothing changes.
        let refused = subject
            .adjust("k", &set, &Adjustment::unbook(1, &second))
            .await;
        assert!(
            matches!(refused.outcome(), Outcome::Denied { policy: 0, .. }),
            "{name}: {refused:?}"
        );
        assert_eq!(refused.statuses()[1].remaining, 97, "{name}");
        // The third, then the second: each the newest in turn; the tokens come back.
        for booking in [&third, &second] {
            let given = subject
                .adjust("k", &set, &Adjustment::unbook(1, booking))
                .await;
            assert!(given.is_allowed(), "{name}: {given:?}");
        }
        let next = subject.check("k", &set, 1).await;
        assert_eq!(
            delay(&next),
            Duration::from_millis(700),
            "{name}: the next goes after the first alone"
        );
        assert_eq!(next.statuses()[1].remaining, 98, "{name}");
        // The first has been sent and has leaked out: there is nothing to give back.
        subject.clock.advance(Duration::from_secs(5));
        let gone = subject
            .adjust("k", &set, &Adjustment::unbook(1, &first))
            .await;
        assert!(!gone.is_allowed(), "{name}: {gone:?}");
        assert_eq!(gone.statuses()[1].remaining, 98, "{name}");
    }
}

/// Under two shaping policies, a request dropped while it waits out the slower one's
/// delay finds the faster one's queue drained long ago (its own place there passed): that
/// queue holds nothing to give back and no one behind it. The unbooking was refused for
/// it, so the slower queue's place and the other policies' units stayed spent for a
/// request never sent. A drained queue is passed over; one with a booking behind still
/// refuses, and so do queues that have all drained. On every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbooking_passes_over_a_drained_shaping_queue_on_every_store() {
    let backends = Backends::start().await;
    let set = PolicySet::new([
        Policy::leaky_bucket_shaping("fast", Rate::per_second(10), Duration::from_secs(60))
            .unwrap(),
        Policy::leaky_bucket_shaping("slow", Rate::per_minute(1), Duration::from_secs(600))
            .unwrap(),
        Policy::token_bucket("tokens", 100, Rate::per_hour(1)).unwrap(),
    ])
    .unwrap();
    for subject in backends.subjects("unbook-drained") {
        let name = subject.name;
        subject.clock.set(Duration::from_secs(1_000));
        subject.check("k", &set, 1).await;
        let second = subject.check("k", &set, 1).await;
        assert_eq!(delay(&second), Duration::from_secs(60), "{name}");
        subject.clock.advance(Duration::from_secs(5));
        let given = subject
            .adjust("k", &set, &Adjustment::unbook(1, &second))
            .await;
        assert!(given.is_allowed(), "{name}: {given:?}");
        assert_eq!(
            given.statuses()[2].remaining,
            99,
            "{name}: the tokens came back"
        );
        let next = subject.check("k", &set, 1).await;
        assert_eq!(
            delay(&next),
            Duration::from_secs(55),
            "{name}: the slow queue's place came back"
        );
        // Both queues drained: the booking's time has passed, nothing to give back.
        subject.clock.advance(Duration::from_secs(600));
        let gone = subject
            .adjust("k", &set, &Adjustment::unbook(1, &next))
            .await;
        assert!(!gone.is_allowed(), "{name}: {gone:?}");
    }
}

/// The shaping delay a decision admits with.
fn delay(decision: &Decision) -> Duration {
    match decision.outcome() {
        Outcome::Allowed { delay } => delay,
        outcome => panic!("not admitted: {outcome:?}"),
    }
}

/// A sliding window counter counts its oldest sub-window only in part (the share of it
/// still inside the window), and `grant` and `set_remaining` took their units off the
/// counts newest first, whole: units taken off the oldest lowered the estimate by less.
/// With 10 spent at 0 in a 10 s window, at 15 s half of them still count (5 left): set
/// to 10 left gave 7, and set to 7 gave 6. Where what is never forgiven of the oldest
/// (`count - limit / k`) will be all that counts of it before the sub-window ends, the
/// grant gives back less now rather than more then. On every store, alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_on_a_sliding_window_gives_what_it_says_from_the_oldest_sub_window() {
    let backends = Backends::start().await;
    // (k, when the spent sub-window is the oldest (ms), what is left then, and what each
    // change leaves): with k = 5, at 11 s the oldest (0 to 2 s) has 1 s to go, and
    // 10 - 10 / 5 = 8 of it count; with k = 2, at 12.5 s, 5 of it (2.5 s of 5 to go, and
    // 10 - 5), and a grant of 2 (or a level of 7) gives back 1: lower, the oldest would
    // give back more than asked once only what is never forgiven of it counts (by 15 s).
    let cases = [
        (
            1,
            15_000,
            5,
            [("set", 10, 10), ("grant", 4, 9), ("partial", 7, 7)],
        ),
        (
            5,
            11_000,
            2,
            [("set", 10, 10), ("grant", 4, 6), ("partial", 7, 7)],
        ),
        (
            2,
            12_500,
            5,
            [("set", 10, 10), ("grant", 2, 6), ("partial", 7, 6)],
        ),
    ];
    for (k, at, left, changes) in cases {
        let set = PolicySet::from(
            Policy::sliding_window_split("sw", 10, Duration::from_secs(10), k).unwrap(),
        );
        for subject in &backends.subjects(&format!("sw-give-back-{k}")) {
            let label = format!("{} (k = {k})", subject.name);
            for (case, (key, amount, expected)) in changes.into_iter().enumerate() {
                let change = if key == "grant" {
                    Adjustment::grant(amount)
                } else {
                    Adjustment::set_remaining(amount)
                };
                // Each case on its own key, 100 s after the last (a store's clock never
                // steps back).
                let start = Duration::from_secs(100 * case as u64);
                subject.clock.set(start);
                assert!(subject.check(key, &set, 10).await.is_allowed(), "{label}");
                subject.clock.set(start + Duration::from_millis(at));
                let before = subject.check(key, &set, 0).await;
                assert_eq!(before.statuses()[0].remaining, left, "{label} {key}");
                let after = subject.adjust(key, &set, &change).await;
                assert_eq!(
                    after.statuses()[0].remaining,
                    expected,
                    "{label} {key}: {change:?}"
                );
                // And it admits what it says, and no more.
                assert!(
                    subject.check(key, &set, expected).await.is_allowed(),
                    "{label} {key}"
                );
                assert!(
                    !subject.check(key, &set, 1).await.is_allowed(),
                    "{label} {key}"
                );
            }
        }
    }
}
