//! Leases against a real redis-server: three replicas, each taking blocks of units from
//! one shared quota and spending them locally.

#![cfg(all(feature = "redis", feature = "__test-clock"))]

mod support;

use std::time::{Duration, Instant};

use support::RedisServer;
use tollgate::store::{Leased, RedisStore};
use tollgate::{Key, Policy, PolicySet, Store};

const LIMIT: u64 = 300;
const LEASE: u64 = 10;
const REPLICAS: u64 = 3;

async fn replicas(server: &RedisServer, ttl: Duration) -> Vec<Leased<RedisStore>> {
    let mut stores = Vec::new();
    for _ in 0..REPLICAS {
        // Time stands still: no window these tests use ends during them (on Redis's
        // clock, an hour ending mid-test would lose the units given back to the old one).
        let redis = support::frozen_store(server).await;
        stores.push(Leased::new(redis, LEASE, ttl).unwrap());
    }
    stores
}

/// Requests over three replicas for one quota of 300 in a window that does not end during
/// the test: below the quota, about one Redis decision per lease; past it, never more
/// than the limit (a lease is debited before it is spent), and at least the limit less
/// what the replicas can hold. When the leases end, what they held goes back: every unit
/// is then either admitted or in Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_stay_within_the_bound_and_give_back() {
    let server = RedisServer::start();
    let ttl = Duration::from_millis(500);
    let stores = replicas(&server, ttl).await;
    let policies =
        PolicySet::from(Policy::fixed_window("leased", LIMIT, Duration::from_secs(3600)).unwrap());
    let key = Key::new("tenant:1");
    // 30 concurrent callers, 10 on each replica, `each` requests per caller.
    let run = |each: u64| {
        let tasks: Vec<_> = (0..30u64)
            .map(|task| {
                let store = stores[(task % REPLICAS) as usize].clone();
                let (policies, key) = (policies.clone(), key.clone());
                tokio::spawn(async move {
                    let mut admitted = 0u64;
                    for _ in 0..each {
                        let decision = store.decide(&key, &policies, 1).await.unwrap();
                        admitted += u64::from(decision.is_allowed());
                    }
                    admitted
                })
            })
            .collect();
        async move {
            let mut admitted = 0;
            for task in tasks {
                admitted += task.await.unwrap();
            }
            admitted
        }
    };
    let calls = || stores.iter().map(Leased::shared_calls).sum::<u64>();
    // Below the limit less what the replicas can hold: everything is admitted, in about
    // one Redis decision per lease.
    let first = run(8).await;
    let first_calls = calls();
    println!(
        "leases of {LEASE} on {REPLICAS} replicas: 240 requests under a quota of {LIMIT}: \
         {first} admitted, {first_calls} Redis decisions ({:.3} per request)",
        first_calls as f64 / 240.0
    );
    assert_eq!(first, 240);
    assert!(
        first_calls <= 240 / 2,
        "{first_calls} Redis decisions for 240 requests"
    );
    // Far past the limit: never more than it, and at least the limit less one lease per
    // replica.
    let admitted = first + run(22).await;
    println!(
        "then 660 more: {admitted} of 900 admitted in all ({} Redis decisions)",
        calls()
    );
    assert!(admitted <= LIMIT, "admitted {admitted} > {LIMIT}");
    // Each replica holds one lease, and for a moment the one that just ended.
    assert!(
        admitted >= LIMIT - 2 * REPLICAS * LEASE,
        "admitted {admitted} < {LIMIT} - 2 x {REPLICAS} x {LEASE}"
    );

    // The leases end; what they held goes back to the shared quota.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let remaining = stores[0]
            .inner()
            .peek(&key, &policies)
            .await
            .unwrap()
            .statuses()[0]
            .remaining;
        if remaining == LIMIT - admitted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis has {remaining} left, {} were not spent",
            LIMIT - admitted
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One replica on `server`, leasing `LEASE` units for a minute.
async fn one_replica(server: &RedisServer) -> Leased<RedisStore> {
    Leased::new(
        support::frozen_store(server).await,
        LEASE,
        Duration::from_secs(60),
    )
    .unwrap()
}

/// A lease is taken in one call and spent locally; the headers count what this replica
/// holds; a lease that no longer fits leaves the last units to exact decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_per_lease_and_the_last_units_are_not_lost() {
    let server = RedisServer::start();
    let store = one_replica(&server).await;
    let policies =
        PolicySet::from(Policy::fixed_window("leased", 25, Duration::from_secs(3600)).unwrap());
    let key = Key::new("k");
    let mut remaining = Vec::new();
    for _ in 0..30 {
        let decision = store.decide(&key, &policies, 1).await.unwrap();
        remaining.push(
            decision
                .is_allowed()
                .then(|| decision.statuses()[0].remaining),
        );
    }
    // 25 admitted, counting down as one client would see them; then denials.
    let expected: Vec<Option<u64>> = (0..25).rev().map(Some).chain([None; 5]).collect();
    assert_eq!(remaining, expected);
    // Two leases of 10; a third refused (5 left), so the 21st request is decided on its
    // own, and so are the 9 after it while the refusal lasts.
    assert_eq!(store.shared_calls(), 2 + 1 + 1 + 4 + 5);
}

/// A lease belongs to the policies it was taken for, not to one `PolicySet` value: a set
/// built again from the same policies (what every configuration reload does, `LiveLayer`
/// included) spends the lease already held, instead of leaving its units unspent until
/// the lease ends while taking another: 25 of 25 are admitted across the two sets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_built_again_from_the_same_policies_spends_the_lease_held() {
    let server = RedisServer::start();
    let store = one_replica(&server).await;
    let policy = Policy::fixed_window("leased", 25, Duration::from_secs(3600)).unwrap();
    let before = PolicySet::from(policy.clone());
    let reloaded = PolicySet::new([policy]).unwrap();
    let key = Key::new("k");
    assert!(store.decide(&key, &before, 1).await.unwrap().is_allowed());
    let mut admitted = 1;
    for _ in 0..29 {
        admitted += u64::from(store.decide(&key, &reloaded, 1).await.unwrap().is_allowed());
    }
    assert_eq!(admitted, 25, "the quota, whichever set asked");
}

/// Two spellings of one policy (a rate in other terms, the policing leaky bucket beside
/// the token bucket) decide alike on one state, so a lease taken under one serves the
/// other: one call for the lease, where each spelling took a lease of its own, holding
/// units the other could not spend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_serves_every_spelling_of_its_policy() {
    let server = RedisServer::start();
    let store = one_replica(&server).await;
    let day = Duration::from_secs(86_400);
    let spellings = [
        Policy::token_bucket("leased", 25, tollgate::Rate::new(1, day)).unwrap(),
        Policy::token_bucket("leased", 25, tollgate::Rate::new(2, 2 * day)).unwrap(),
        Policy::leaky_bucket("leased", 25, tollgate::Rate::new(3, 3 * day)).unwrap(),
    ];
    let key = Key::new("k");
    for round in 0..LEASE {
        let set = PolicySet::from(spellings[round as usize % 3].clone());
        assert!(store.decide(&key, &set, 1).await.unwrap().is_allowed());
    }
    assert_eq!(
        store.shared_calls(),
        1,
        "one lease for the {LEASE} requests"
    );
}

#[test]
fn bad_lease_parameters_are_refused() {
    let error = Leased::new(tollgate::MemoryStore::new(), 0, Duration::from_secs(1)).unwrap_err();
    assert!(error.to_string().contains("at least 1 unit"), "{error}");
    let error = Leased::new(tollgate::MemoryStore::new(), 5, Duration::ZERO).unwrap_err();
    assert!(error.to_string().contains("at least 1 ms"), "{error}");
}

/// Shaping spaces requests out by delaying them: a lease would hand out its units with no
/// delay, so a set with a shaping policy is never leased.
#[tokio::test]
async fn shaping_is_never_leased() {
    let store = Leased::new(tollgate::MemoryStore::new(), 20, Duration::from_secs(60)).unwrap();
    let policies = PolicySet::from(
        Policy::leaky_bucket_shaping(
            "ls",
            tollgate::Rate::per_second(10),
            Duration::from_secs(10),
        )
        .unwrap(),
    );
    let key = Key::new("k");
    let mut delays = Vec::new();
    for _ in 0..5 {
        match store.decide(&key, &policies, 1).await.unwrap().outcome() {
            tollgate::Outcome::Allowed { delay } => delays.push(delay),
            other => panic!("{other:?}"),
        }
    }
    // Spaced 100 ms apart, each decided by the store itself.
    assert!(
        delays.windows(2).all(|pair| pair[1] > pair[0]),
        "{delays:?}"
    );
    assert_eq!(store.shared_calls(), 5);
}

/// A request whose future is dropped before it is polled (tower allows it) does not leave
/// its identity waiting for a lease nobody takes.
#[tokio::test]
async fn a_request_dropped_before_it_runs_does_not_wedge_its_identity() {
    let store = Leased::new(tollgate::MemoryStore::new(), 10, Duration::from_secs(60)).unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 100, Duration::from_secs(3600)).unwrap());
    let key = Key::new("k");
    drop(store.decide(&key, &policies, 1));
    let next = tokio::time::timeout(Duration::from_secs(10), store.decide(&key, &policies, 1))
        .await
        .expect("the next request is answered")
        .unwrap();
    assert!(next.is_allowed());
}

/// A lease is never larger than the smallest quota of its set: a burst of 4 with leases of
/// 20 takes leases of 4, instead of being refused every time.
#[tokio::test]
async fn a_lease_never_exceeds_the_quota() {
    let store = Leased::new(tollgate::MemoryStore::new(), 20, Duration::from_secs(60)).unwrap();
    let policies = PolicySet::from(
        Policy::gcra("gc", tollgate::Rate::new(4, Duration::from_secs(3600)), 4).unwrap(),
    );
    let key = Key::new("k");
    let mut admitted = 0;
    for _ in 0..6 {
        admitted += u64::from(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    }
    assert_eq!(admitted, 4);
    // One lease of 4, then a refused lease and two requests decided on their own.
    assert_eq!(store.shared_calls(), 1 + 1 + 2);
}

/// Leases left with a rest (units 20, requests of 11: 9 each) were kept open while a new
/// lease was taken for each costlier request: just before a window ended, 40 such
/// requests left 40 leases holding 360 units debited in it, and the next window admitted
/// those 360 on top of its own 1,000, far past the `replicas × units` the docs promise.
/// A new lease gives back what the open ones have left: one replica holds at most one
/// rest at a time.
#[tokio::test]
async fn leftovers_of_many_leases_never_spill_into_the_next_window() {
    let clock = tollgate::clock::ManualClock::new();
    let memory = tollgate::MemoryStore::builder()
        .clock(clock.clone())
        .build();
    let store = Leased::new(memory, 20, Duration::from_secs(600)).unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 1_000, Duration::from_secs(1)).unwrap());
    let key = Key::new("k");
    clock.advance(Duration::from_millis(900));
    for _ in 0..40 {
        assert!(
            store
                .decide(&key, &policies, 11)
                .await
                .unwrap()
                .is_allowed()
        );
    }
    // The next window: one unit a request until the first denial.
    clock.advance(Duration::from_millis(200));
    let mut admitted = 0;
    while admitted < 5_000 && store.decide(&key, &policies, 1).await.unwrap().is_allowed() {
        admitted += 1;
    }
    assert!(
        admitted <= 1_000 + 20,
        "{admitted} units admitted in a window of 1,000 (leases of 20)"
    );
}

/// A store whose settles answer only after a yield (a pool's give-back waits for its
/// connection's check, while the take runs on another connection).
struct SlowSettles(std::sync::Arc<tollgate::MemoryStore>);

impl Store for SlowSettles {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> tollgate::DecideFuture {
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
    ) -> tollgate::DecideFuture {
        let (store, key, policies) = (self.0.clone(), key.clone(), policies.clone());
        let adjustment = adjustment.clone();
        tollgate::DecideFuture::new(async move {
            tokio::task::yield_now().await;
            store.adjust(&key, &policies, &adjustment).await
        })
    }
}

/// A rest given back beside the new take may land after it: the take, refused only for
/// want of those units, left the identity deciding one request at a time for a whole
/// ttl. A take refused while a rest was going back is tried once more when it is back.
#[tokio::test]
async fn a_take_refused_before_the_rest_is_back_is_tried_again() {
    let store = Leased::new(
        SlowSettles(std::sync::Arc::new(tollgate::MemoryStore::new())),
        20,
        Duration::from_secs(600),
    )
    .unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 35, Duration::from_secs(3600)).unwrap());
    let key = Key::new("k");
    // A lease of 20 (15 left in the shared window), 9 of it left here.
    assert!(
        store
            .decide(&key, &policies, 11)
            .await
            .unwrap()
            .is_allowed()
    );
    // 11 more: the rest of 9 goes back, and a lease of 20 fits only once it is back.
    assert!(
        store
            .decide(&key, &policies, 11)
            .await
            .unwrap()
            .is_allowed()
    );
    let calls = store.shared_calls();
    // Served by the new lease, without a call.
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    assert_eq!(
        store.shared_calls(),
        calls,
        "decided one by one: the take was refused"
    );
}

/// A burst larger than a lease, for one identity: each request that found the lease spent
/// by those before it waited for the next take, one after another, so the last of 100
/// waited 20 round trips (leases of 5), past a 50 ms store timeout: half the burst timed
/// out on a healthy store (and timeouts open the breaker). A request waits for one take
/// at most; not served by it, it is decided on its own.
#[tokio::test(start_paused = true)]
async fn a_burst_larger_than_a_lease_waits_for_one_take_at_most() {
    let store = std::sync::Arc::new(
        Leased::new(
            Delayed(
                std::sync::Arc::new(tollgate::MemoryStore::new()),
                Duration::from_millis(10),
            ),
            5,
            Duration::from_secs(60),
        )
        .unwrap(),
    );
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 1_000, Duration::from_secs(3600)).unwrap());
    let key = Key::new("burst");
    let requests: Vec<_> = (0..100)
        .map(|_| {
            let (store, policies, key) = (store.clone(), policies.clone(), key.clone());
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_millis(50), store.decide(&key, &policies, 1))
                    .await
            })
        })
        .collect();
    let mut timed_out = 0;
    for request in requests {
        match request.await.unwrap() {
            Ok(decision) => assert!(decision.unwrap().is_allowed()),
            Err(_) => timed_out += 1,
        }
    }
    assert_eq!(timed_out, 0, "requests of the burst timed out");
    // Exact all the same: 100 spent, and the lease's rest.
    let left = store.inner().0.check("burst", &policies, 0).statuses()[0].remaining;
    assert!((895..=900).contains(&left), "{left} left of 1,000");
}

/// A store that takes a fixed time to decide.
struct Delayed(std::sync::Arc<tollgate::MemoryStore>, Duration);

impl Store for Delayed {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> tollgate::DecideFuture {
        let (store, key, policies, delay) = (self.0.clone(), key.clone(), policies.clone(), self.1);
        tollgate::DecideFuture::new(async move {
            tokio::time::sleep(delay).await;
            store.decide(&key, &policies, cost).await
        })
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &Key,
        policies: &PolicySet,
        adjustment: &tollgate::store::Adjustment,
    ) -> tollgate::DecideFuture {
        self.0.adjust(key, policies, adjustment)
    }
}

/// Leases of 10 over a store slower than its requests' timeout, and a first request
/// that gave up on the take it started at 50 ms (the take goes on).
async fn a_take_given_up() -> (Leased<Delayed>, PolicySet, Key) {
    let store = Leased::new(
        // 200 ms to decide: slower than a 50 ms store timeout.
        Delayed(
            std::sync::Arc::new(tollgate::MemoryStore::new()),
            Duration::from_millis(200),
        ),
        10,
        Duration::from_secs(60),
    )
    .unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 1_000, Duration::from_secs(3600)).unwrap());
    let key = Key::new("u");
    let gave_up =
        tokio::time::timeout(Duration::from_millis(50), store.decide(&key, &policies, 1)).await;
    assert!(gave_up.is_err());
    (store, policies, key)
}

/// A lease that lands after every request waiting for it gave up (the store too slow for
/// their timeout) is no sign the store answers in time: its first answer, to a request
/// that came later, is a cached one, or it would close a breaker mid-outage.
#[tokio::test(start_paused = true)]
async fn a_lease_that_lands_late_answers_from_the_cache() {
    let (store, policies, key) = a_take_given_up().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let later = store.decide(&key, &policies, 1).await.unwrap();
    assert!(later.is_allowed());
    assert!(
        later.is_cached(),
        "a late lease's answer counted as the store's"
    );
}

/// The same with steady traffic: a request that joins the slow take late, just before
/// the lease lands, did not start it. Its answer is a cached one too, or every lease
/// would close a breaker while the store stays too slow.
#[tokio::test(start_paused = true)]
async fn a_request_that_joins_a_slow_take_late_answers_from_the_cache() {
    let (store, policies, key) = a_take_given_up().await;
    tokio::time::sleep(Duration::from_millis(130)).await;
    let joined = tokio::time::timeout(Duration::from_millis(50), store.decide(&key, &policies, 1))
        .await
        .expect("the lease lands within its wait")
        .unwrap();
    assert!(joined.is_allowed());
    assert!(
        joined.is_cached(),
        "a late joiner's answer counted as the store's"
    );
}

/// What a bucket's lease did not spend goes back as an exact replay with the units spent
/// would hold: the take left the bucket empty, so the unspent units were all still
/// missing from it when the lease ended, whatever refilled meanwhile. Given back without
/// what the take left, every unit refilled since was counted as lost: after 5 s of refill
/// (50 units), 0 of 19 came back.
#[tokio::test(start_paused = true)]
async fn a_bucket_lease_gives_back_what_it_did_not_spend() {
    let clock = tollgate::clock::ManualClock::new();
    let memory = std::sync::Arc::new(
        tollgate::MemoryStore::builder()
            .clock(clock.clone())
            .build(),
    );
    let store = Leased::new(std::sync::Arc::clone(&memory), 20, Duration::from_secs(5)).unwrap();
    let policies =
        PolicySet::from(Policy::token_bucket("tb", 100, tollgate::Rate::per_second(10)).unwrap());
    let key = Key::new("k");
    // Other traffic leaves 20; this replica leases them all and spends one.
    assert!(memory.check("k", &policies, 80).is_allowed());
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    assert_eq!(memory.check("k", &policies, 0).statuses()[0].remaining, 0);
    // The lease ends 5 s later, 19 unspent.
    clock.advance(Duration::from_secs(5));
    tokio::time::sleep(Duration::from_secs(6)).await;
    // A replay spending 1 where 20 were taken: 81 missing, 50 refilled, 69 left.
    assert_eq!(memory.check("k", &policies, 0).statuses()[0].remaining, 69);
}

/// A cost larger than a policy's quota can never fit: it is answered as the store answers
/// it, and leasing goes on for the identity's other requests. It retired the open lease,
/// took a lease of that cost (refused), tried again, and then decided every request of
/// the identity one by one against the shared store for a whole ttl.
#[tokio::test]
async fn a_cost_that_never_fits_leaves_the_leases_alone() {
    let store = Leased::new(tollgate::MemoryStore::new(), 10, Duration::from_secs(60)).unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("fw", 100, Duration::from_secs(3600)).unwrap());
    let key = Key::new("k");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    assert_eq!(store.shared_calls(), 1);
    let never = store.decide(&key, &policies, 101).await.unwrap();
    assert!(
        matches!(never.outcome(), tollgate::Outcome::CostExceedsLimit { .. }),
        "{never:?}"
    );
    for _ in 0..20 {
        assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    }
    // The oversized request asked once; the lease held 9 more, then two more leases.
    assert!(
        store.shared_calls() <= 1 + 1 + 2,
        "{} shared calls",
        store.shared_calls()
    );
}

/// A decision a lease serves states the shared window's end where it stands: `reset` and
/// the effective window count down from the lease's take (draft-ietf-httpapi-ratelimit-
/// headers-11, section 4.1: `t` is seconds from the response). They were copied from the
/// take unchanged, so a lease taken a minute before still said the minute was whole.
#[tokio::test]
async fn a_lease_tells_the_time_left_as_it_passes() {
    let store = Leased::new(tollgate::MemoryStore::new(), 20, Duration::from_secs(60)).unwrap();
    let policies =
        PolicySet::from(Policy::fixed_window("w", 100, Duration::from_secs(3_600)).unwrap());
    let key = Key::new("k");
    let asked = Instant::now();
    let first = store.decide(&key, &policies, 1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served = store.decide(&key, &policies, 1).await.unwrap();
    assert_eq!(store.shared_calls(), 1, "served by the lease");
    let passed = asked.elapsed();
    let (was, is) = (first.statuses()[0], served.statuses()[0]);
    assert!(
        is.reset + Duration::from_millis(300) <= was.reset,
        "reset {:?} then {:?} after {passed:?}",
        was.reset,
        is.reset
    );
    assert!(
        is.effective_window + Duration::from_millis(300) <= was.effective_window,
        "window {:?} then {:?}",
        was.effective_window,
        is.effective_window
    );
    // Never more time gone than has passed.
    assert!(is.reset + passed >= was.reset);
    assert_eq!(is.remaining, 100 - 2);
}
