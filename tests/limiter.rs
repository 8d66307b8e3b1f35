//! Limits outside HTTP: check-and-spend, and waiting until allowed, fair and exact under
//! contention, with every store and failure mode.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tollgate::limiter::{Limiter, WaitError};
use tollgate::{
    DecideFuture, FailureMode, Key, MemoryStore, Outcome, Policy, PolicySet, Rate, Store,
    StoreError, StoreErrorKind,
};

/// A store on the runtime's clock, which paused time moves.
fn runtime_store() -> MemoryStore<tollgate::clock::RuntimeClock> {
    MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build()
}

/// A waiter of `limiter` for `cost` units of `key`, willing to wait `max_wait`, on a
/// task of its own.
fn waiter<St: Store + 'static>(
    limiter: &Limiter<St>,
    key: &Key,
    cost: u64,
    max_wait: Duration,
) -> tokio::task::JoinHandle<Result<tollgate::Decision, WaitError>> {
    let (limiter, key) = (limiter.clone(), key.clone());
    tokio::spawn(async move { limiter.until_ready(&key, cost, max_wait).await })
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_order_and_exactly() {
    // 50 jobs want one unit each from a bucket of 5 refilled 50 a second: 5 go at once,
    // then one every 20 ms, in the order they came, none twice, none lost.
    let limiter = Limiter::new(
        runtime_store(),
        Policy::token_bucket("jobs", 5, Rate::per_second(50)).unwrap(),
    );
    let served = Arc::new(Mutex::new(Vec::new()));
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for job in 0..50 {
        let (limiter, served) = (limiter.clone(), Arc::clone(&served));
        tasks.push(tokio::spawn(async move {
            let decision = limiter
                .until_ready(&Key::new("queue"), 1, Duration::from_secs(10))
                .await
                .unwrap();
            assert!(decision.is_allowed());
            served.lock().unwrap().push(job);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*served.lock().unwrap(), (0..50).collect::<Vec<_>>());
    assert_eq!(started.elapsed(), Duration::from_millis(900));
    // The bucket is empty now: a check-and-spend is refused.
    assert!(
        !limiter
            .check(&Key::new("queue"), 1)
            .await
            .unwrap()
            .is_allowed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_does_not_hold_the_others_back() {
    let limiter = Limiter::new(
        runtime_store(),
        Policy::token_bucket("calls", 1, Rate::per_second(1)).unwrap(),
    );
    let key = Key::new("k");
    limiter.check(&key, 1).await.unwrap();
    // The first waiter is dropped while it waits its turn's second.
    let first = {
        let limiter = limiter.clone();
        let key = key.clone();
        tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::MAX).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.abort();
    let started = tokio::time::Instant::now();
    let decision = limiter
        .until_ready(&key, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(decision.is_allowed());
    // The next waiter is served when the unit is back: 0.9 s later, not after the first.
    assert_eq!(started.elapsed(), Duration::from_millis(900));
}

// A waiter that gives up while those ahead of it still wait is told it was refused, and
// not to come back before its whole wait has passed: not an admission with no retry time
// (a caller that retries after `retry_after().unwrap_or_default()` would spin).
#[tokio::test(start_paused = true)]
async fn a_waiter_that_times_out_in_the_queue_is_told_when_to_retry() {
    let limiter = Limiter::new(
        runtime_store(),
        Policy::token_bucket("calls", 1, Rate::new(1, Duration::from_secs(10))).unwrap(),
    );
    let key = Key::new("k");
    limiter.check(&key, 1).await.unwrap();
    // The first waiter holds the queue for 10 s, until its unit is back.
    let first = {
        let limiter = limiter.clone();
        let key = key.clone();
        tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    match limiter.until_ready(&key, 1, Duration::from_secs(1)).await {
        Err(WaitError::TooLong(decision)) => {
            assert!(!decision.is_allowed(), "{decision:?}");
            assert!(
                decision
                    .retry_after()
                    .is_some_and(|retry| retry >= Duration::from_secs(1)),
                "{decision:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(first.await.unwrap().unwrap().is_allowed());
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_would_be_too_long_or_never_ends_at_once() {
    let limiter = Limiter::new(
        runtime_store(),
        Policy::token_bucket("calls", 2, Rate::per_second(1)).unwrap(),
    );
    let key = Key::new("upstream");
    limiter.check(&key, 2).await.unwrap();
    let started = tokio::time::Instant::now();
    match limiter
        .until_ready(&key, 2, Duration::from_millis(500))
        .await
    {
        Err(WaitError::TooLong(decision)) => {
            assert_eq!(decision.retry_after(), Some(Duration::from_secs(2)));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "it gave up at once");
    let never = limiter
        .until_ready(&key, 3, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(matches!(never, WaitError::Never(_)));
    // The error says which policy, and why waiting cannot help.
    assert_eq!(
        never.to_string(),
        "a cost of 3 is more than policy 0 of the set ever admits (its limit is 2): \
         waiting cannot help"
    );
    // Within the wait: it waits exactly what the store said.
    let decision = limiter
        .until_ready(&key, 2, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(decision.is_allowed());
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

/// A store that is always away.
#[derive(Clone)]
struct Away;

impl Store for Away {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unavailable, "refused")))
    }
}

/// A store that accepts only policies of at most 100 units (as the Redis store refuses
/// policies it cannot decide exactly).
#[derive(Clone)]
struct Small;

impl Store for Small {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unsupported, "too big")))
    }

    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        match policies.iter().find(|policy| policy.limit() > 100) {
            Some(policy) => Err(StoreError::new(
                StoreErrorKind::Unsupported,
                format!("policy {} is too big for this store", policy.name()),
            )),
            None => Ok(()),
        }
    }
}

// A policy the store cannot decide is refused when the limiter is built, as the layer
// refuses it: otherwise every decision would fall back, and each replica decide alone.
#[test]
fn a_policy_the_store_cannot_decide_is_refused_when_the_limiter_is_built() {
    let big = Policy::fixed_window("big", 1_000, Duration::from_secs(60)).unwrap();
    let error = Limiter::try_new(Small, big).unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    assert!(error.to_string().contains("big"), "{error}");
    let small = Policy::fixed_window("small", 10, Duration::from_secs(60)).unwrap();
    assert!(Limiter::try_new(Small, small).is_ok());
}

// A waiter that gives up on a shaping policy's place gives it back through the store's
// adjust. Over a store that cannot adjust (a wrapper forwarding `decide` alone), every
// impatient waiter left a place booked for nobody, and real requests queued behind them.
// Refused when the limiter is built, as an in-flight limit is.
#[test]
fn a_shaping_policy_over_a_store_that_cannot_give_places_back_is_refused() {
    let shaping =
        Policy::leaky_bucket_shaping("paced", Rate::per_second(1), Duration::from_secs(60))
            .unwrap();
    let Err(error) = Limiter::try_new(Small, shaping.clone()) else {
        panic!("a shaping policy over a store that cannot adjust is accepted");
    };
    assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    assert!(error.to_string().contains("\"paced\""), "{error}");
    assert!(Limiter::try_new(MemoryStore::new(), shaping.clone()).is_ok());
    // A shadow shaping policy delays nobody, and books no place to give back.
    assert!(Limiter::try_new(Small, shaping.shadow()).is_ok());
}

/// The in-process store, but failing every decision and peek while `down` is set.
#[derive(Clone)]
struct Toggle(
    MemoryStore<tollgate::clock::RuntimeClock>,
    Arc<std::sync::atomic::AtomicBool>,
);

impl Store for Toggle {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")));
        }
        self.0.decide(key, policies, cost)
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        if self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")));
        }
        self.0.peek(key, policies)
    }
}

// A decision the local fallback made (the store away) was handed to the caller like the
// store's: settled on the store with its receipt (`Store::adjust`, as the README shows for
// post-paid costs), it gave back units the store never debited, on a quota the store had
// spent. Its receipt now gives nothing back on the store (what it spent is the
// fallback's, in this process), and what it used past its reservation is still charged.
#[tokio::test(start_paused = true)]
async fn a_fallback_decision_gives_nothing_back_on_the_store() {
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = runtime_store();
    let hourly = Policy::fixed_window("t", 100, Duration::from_secs(3600)).unwrap();
    let limiter = Limiter::new(Toggle(store.clone(), Arc::clone(&down)), hourly.clone());
    let policies = PolicySet::from(hourly);
    // Spends `spent` on the store, then `reserved` through the fallback (the store
    // away), and settles that decision on the store, back again, to `used`.
    let settled_from_the_fallback = async |key: &Key, spent: u64, reserved: u64, used: u64| {
        assert!(limiter.check(key, spent).await.unwrap().is_allowed());
        down.store(true, std::sync::atomic::Ordering::SeqCst);
        let local = limiter.check(key, reserved).await.unwrap();
        assert!(local.is_allowed(), "the fallback's own quota");
        down.store(false, std::sync::atomic::Ordering::SeqCst);
        let settle = tollgate::Adjustment::settle(reserved, used, local.receipt());
        store.adjust(key, &policies, &settle).await.unwrap();
    };
    let key = Key::new("k");
    settled_from_the_fallback(&key, 100, 50, 5).await;
    assert!(
        !limiter.check(&key, 45).await.unwrap().is_allowed(),
        "the store's quota is spent: nothing of it was given back"
    );
    // Settled upwards (used more than it reserved), the excess is charged to the store
    // all the same: a post-paid cost is counted where the quota is shared.
    let key = Key::new("upwards");
    settled_from_the_fallback(&key, 50, 10, 40).await;
    assert!(
        !limiter.check(&key, 21).await.unwrap().is_allowed(),
        "50, and the 30 used past the reservation"
    );
    assert!(limiter.check(&key, 20).await.unwrap().is_allowed());
}

// A waiter ahead that the fallback denied sleeps an ordinary wait, not a store's
// timeout: a waiter behind it that runs out of its wait meanwhile, the store back and
// empty, is told so. It was let through by the fallback (the queue still read "the
// store is failing" from the decision ahead), past the store's limit.
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_fallback_denial_is_denied_once_the_store_is_back() {
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let limiter = Limiter::new(
        Toggle(runtime_store(), Arc::clone(&down)),
        Policy::token_bucket("t", 5, Rate::per_second(1)).unwrap(),
    );
    let key = Key::new("k");
    // The store's bucket is spent.
    assert!(limiter.check(&key, 5).await.unwrap().is_allowed());
    down.store(true, std::sync::atomic::Ordering::SeqCst);
    // The fallback's: 1 token left.
    assert!(limiter.check(&key, 4).await.unwrap().is_allowed());
    // Ahead: denied by the fallback, it sleeps about 2 s holding the turn.
    let ahead = waiter(&limiter, &key, 3, Duration::from_secs(10));
    tokio::task::yield_now().await;
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    let behind = limiter
        .until_ready(&key, 1, Duration::from_millis(500))
        .await;
    assert!(matches!(behind, Err(WaitError::TooLong(_))), "{behind:?}");
    ahead.abort();
}

/// A store whose every call takes 10 ms, and whose first decision fails.
#[derive(Clone)]
struct FailsOnceSlowly(
    MemoryStore<tollgate::clock::RuntimeClock>,
    Arc<std::sync::atomic::AtomicU64>,
);

impl Store for FailsOnceSlowly {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let first = self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let (store, key, policies) = (self.0.clone(), key.clone(), policies.clone());
        DecideFuture::new(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if first {
                return Err(StoreError::new(StoreErrorKind::Unavailable, "down once"));
            }
            store.decide(&key, &policies, cost).await
        })
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        let (store, key, policies) = (self.0.clone(), key.clone(), policies.clone());
        DecideFuture::new(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            store.peek(&key, &policies).await
        })
    }
}

// Whether the waiter ahead is held by a failing store is its own call's to say, not a
// call of the waiter before it: a turn taken after a failed one, on a store that
// answers again, held a waiter behind it that gave up while it was asked; the queue
// still read "failing" from the turn before, and the failure mode answered that waiter
// (closed: a store error, from a store that answers; the fallback: admitted locally).
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_turn_taken_after_a_failed_one_is_not_failed() {
    let limiter = Limiter::new(
        FailsOnceSlowly(runtime_store(), Arc::default()),
        Policy::token_bucket("jobs", 10, Rate::per_minute(10)).unwrap(),
    )
    .on_store_error(FailureMode::FailClosed);
    let key = Key::new("k");
    // The first turn's call fails after 10 ms; the second, queued behind it, is then
    // asked of a store that answers, for 10 ms more.
    let first = waiter(&limiter, &key, 1, Duration::from_secs(10));
    tokio::task::yield_now().await;
    let second = waiter(&limiter, &key, 1, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(15)).await;
    // During the second's call: a waiter that will not wait.
    let behind = limiter.until_ready(&key, 1, Duration::ZERO).await;
    assert!(
        matches!(first.await.unwrap(), Err(WaitError::Store(_))),
        "the failed call's own answer"
    );
    assert!(
        second
            .await
            .unwrap()
            .is_ok_and(|decision| decision.is_allowed())
    );
    assert!(
        matches!(behind, Err(WaitError::TooLong(_))),
        "held behind a turn the store answers: {behind:?}"
    );
}

/// A store that counts the peeks it is asked.
#[derive(Clone)]
struct CountsPeeks(
    MemoryStore<tollgate::clock::RuntimeClock>,
    Arc<std::sync::atomic::AtomicU64>,
);

impl Store for CountsPeeks {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.0.peek(key, policies)
    }
}

// Waiters that give up together (a batch of jobs with one `max_wait`) read the key's
// state once between them, not once each: each peeked the store on its own, a thousand
// round trips to Redis in one instant, which a busy pool could time out and count as
// an outage of a store that answers.
#[tokio::test(start_paused = true)]
async fn waiters_that_give_up_together_read_the_state_once() {
    let peeks = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let limiter = Limiter::new(
        CountsPeeks(runtime_store(), Arc::clone(&peeks)),
        Policy::token_bucket("jobs", 1, Rate::per_minute(1)).unwrap(),
    );
    let key = Key::new("k");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    // Ahead: a waiter that sleeps about a minute for the next token, holding the turn.
    let ahead = waiter(&limiter, &key, 1, Duration::from_secs(120));
    tokio::task::yield_now().await;
    let batch: Vec<_> = (0..20)
        .map(|_| waiter(&limiter, &key, 1, Duration::from_secs(1)))
        .collect();
    for waiter in batch {
        let answer = waiter.await.unwrap();
        let Err(WaitError::TooLong(decision)) = &answer else {
            panic!("told to come back later: {answer:?}");
        };
        assert_eq!(decision.statuses()[0].remaining, 0, "the state as read");
    }
    assert_eq!(
        peeks.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one read of the state for the twenty"
    );
    ahead.abort();
}

#[tokio::test]
async fn the_failure_modes_apply_as_in_the_layer() {
    let policy = Policy::fixed_window("jobs", 2, Duration::from_secs(3600)).unwrap();
    let key = Key::new("k");
    // Default: a local limiter with the same policy decides.
    let fallback = Limiter::new(Away, policy.clone());
    assert!(fallback.check(&key, 1).await.unwrap().is_allowed());
    assert!(fallback.check(&key, 1).await.unwrap().is_allowed());
    assert!(!fallback.check(&key, 1).await.unwrap().is_allowed());
    let open = Limiter::new(Away, policy.clone()).on_store_error(FailureMode::FailOpen);
    for _ in 0..5 {
        assert!(open.check(&key, 1).await.unwrap().is_allowed());
    }
    let closed = Limiter::new(Away, policy).on_store_error(FailureMode::FailClosed);
    assert!(closed.check(&key, 1).await.is_err());
    assert!(matches!(
        closed.until_ready(&key, 1, Duration::from_secs(1)).await,
        Err(WaitError::Store(_))
    ));
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_redis_spend_exactly_the_limit() {
    let server = support::RedisServer::start();
    let policy = Policy::fixed_window("batch", 25, Duration::from_secs(3600)).unwrap();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let store = tollgate::store::RedisStore::connect(&server.url())
            .await
            .unwrap();
        replicas.push(Limiter::new(store, policy.clone()).on_store_error(FailureMode::FailClosed));
    }
    let mut tasks = Vec::new();
    for task in 0..60 {
        let limiter = replicas[task % 3].clone();
        tasks.push(tokio::spawn(async move {
            limiter
                .check(&Key::new("nightly"), 1)
                .await
                .unwrap()
                .is_allowed()
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += u32::from(task.await.unwrap());
    }
    assert_eq!(admitted, 25);
}

#[tokio::test(start_paused = true)]
async fn a_shaping_delay_past_the_wait_gives_up_and_gives_back() {
    // One request every 10 s, held back up to a minute: a second request willing to wait
    // 1 s is told at once that it would wait too long, and what it was about to spend is
    // given back, so a third waits only for the first's 10 s.
    let (limiter, key, started) = first_one_sent(paced()).await;
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
    let Err(WaitError::TooLong(said)) = impatient else {
        panic!("{impatient:?}");
    };
    // Told when it would fit: after the first's 10 s.
    assert_eq!(said.retry_after(), Some(Duration::from_secs(10)));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let patient = limiter.until_ready(&key, 1, Duration::from_secs(15)).await;
    assert!(patient.is_ok(), "{patient:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

/// A store that never answers a decision or a peek, and counts the peeks.
#[derive(Clone, Default)]
struct AllHang(Arc<std::sync::atomic::AtomicU64>);

impl Store for AllHang {
    fn decide(&self, _key: &Key, _policies: &PolicySet, _cost: u64) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }

    fn peek(&self, _key: &Key, _policies: &PolicySet) -> DecideFuture {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        DecideFuture::new(std::future::pending())
    }
}

// A waiter ahead that the fallback denied sleeps, then asks the hung store again and
// holds the turn one store timeout more: a waiter behind that runs out of its wait then
// gets the failure mode's answer at once, not after a peek of its own on the hung store
// (one store timeout more, each).
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_holder_asking_a_hung_store_again_is_answered_at_once() {
    let store = AllHang::default();
    let limiter = Limiter::new(
        store.clone(),
        Policy::token_bucket("t", 1, Rate::per_second(20)).unwrap(),
    )
    .store_timeout(Duration::from_millis(200));
    let key = Key::new("k");
    // The fallback's one token goes, after one store timeout.
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    // Ahead: the store hangs 200 ms, the fallback denies (a token in about 50 ms), it
    // sleeps, and asks the store again at about 250 ms.
    let ahead = waiter(&limiter, &key, 1, Duration::from_secs(10));
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    let behind = limiter
        .until_ready(&key, 1, Duration::from_millis(300))
        .await;
    assert!(behind.is_err(), "{behind:?}");
    assert_eq!(started.elapsed(), Duration::from_millis(300));
    assert_eq!(
        store.0.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no peek"
    );
    ahead.abort();
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_is_not_held_by_a_store_that_hangs() {
    // A waiter behind another gives up after its 100 ms and asks the store when it would
    // fit: a store that never answers that holds it no longer than the store's timeout.
    let limiter = Limiter::new(
        support::PeekHangs(runtime_store()),
        Policy::token_bucket("jobs", 1, Rate::per_minute(1)).unwrap(),
    );
    let key = Key::new("k");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let ahead = waiter(&limiter, &key, 1, Duration::from_secs(120));
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    let behind = tokio::time::timeout(
        Duration::from_secs(10),
        limiter.until_ready(&key, 1, Duration::from_millis(100)),
    )
    .await;
    assert!(
        matches!(behind, Ok(Err(WaitError::TooLong(_)))),
        "{behind:?} after {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() <= Duration::from_millis(200));
    ahead.abort();
}

/// Three waiters for one key at once, each willing to wait 60 ms, on a store that hangs
/// (the store timeout is 50 ms): what each was told. Each is told within its wait and one
/// store timeout: the second takes the turn as the first's call fails, and its own first
/// call is not known to fail until it does, so the third, out of its wait meanwhile,
/// reads the key's state (which hangs as well) before the failure mode answers it.
async fn three_waiters_on_a_hung_store(
    limiter: &Limiter<Hangs>,
) -> Vec<Result<tollgate::Decision, WaitError>> {
    let key = Key::new("k");
    let started = tokio::time::Instant::now();
    let waiters = (0..3).map(|_| {
        let (limiter, key) = (limiter.clone(), key.clone());
        tokio::spawn(async move {
            limiter
                .until_ready(&key, 1, Duration::from_millis(60))
                .await
        })
    });
    let mut told = Vec::new();
    for waiter in waiters.collect::<Vec<_>>() {
        told.push(waiter.await.unwrap());
        assert!(
            started.elapsed() <= Duration::from_millis(60 + 50),
            "told after {:?}",
            started.elapsed()
        );
    }
    told
}

// A hung store holds a key's queue one store timeout per waiter: those behind run out of
// their wait in the queue. That is the store's failure, not a denial: the failure mode
// answers them (fail open: through; fail closed: the store's error), never a `TooLong`
// that says "rate limited" of a limit nobody reached.
#[tokio::test(start_paused = true)]
async fn waiters_held_in_the_queue_by_a_hung_store_get_the_failure_modes_answer() {
    let policy = Policy::token_bucket("jobs", 100, Rate::per_second(100)).unwrap();
    let open = Limiter::new(Hangs, policy.clone()).on_store_error(FailureMode::FailOpen);
    for told in three_waiters_on_a_hung_store(&open).await {
        assert!(
            told.as_ref().is_ok_and(|decision| decision.is_allowed()),
            "{told:?}"
        );
    }
    let closed = Limiter::new(Hangs, policy.clone()).on_store_error(FailureMode::FailClosed);
    for told in three_waiters_on_a_hung_store(&closed).await {
        assert!(matches!(told, Err(WaitError::Store(_))), "{told:?}");
    }
    // The local fallback decides them, on its own share of the quota.
    let fallback = Limiter::new(Hangs, policy);
    for told in three_waiters_on_a_hung_store(&fallback).await {
        assert!(
            told.as_ref().is_ok_and(|decision| decision.is_allowed()),
            "{told:?}"
        );
    }
}

// The first waiter of a fresh queue on a hung store holds the turn for the store's
// timeout; one behind it with a shorter wait runs out of it before any failure is known,
// and its peek hangs too. A peek that fails is that failure: the failure mode answers
// (fail open: through), not a `TooLong` of a limit nobody reached.
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_peek_fails_gets_the_failure_modes_answer() {
    let limiter = Limiter::new(
        Hangs,
        Policy::token_bucket("jobs", 100, Rate::per_second(100)).unwrap(),
    )
    .store_timeout(Duration::from_millis(200))
    .on_store_error(FailureMode::FailOpen);
    let key = Key::new("k");
    let ahead = waiter(&limiter, &key, 1, Duration::from_secs(10));
    tokio::task::yield_now().await;
    let behind = limiter
        .until_ready(&key, 1, Duration::from_millis(100))
        .await;
    assert!(
        behind.as_ref().is_ok_and(|decision| decision.is_allowed()),
        "{behind:?}"
    );
    assert!(ahead.await.unwrap().is_ok());
}

/// A store that decides in process but never answers a give-back or a peek.
#[derive(Clone)]
struct GiveBacksHang(MemoryStore<tollgate::clock::RuntimeClock>);

impl Store for GiveBacksHang {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(&self, _: &Key, _: &PolicySet, _: &tollgate::Adjustment) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }

    fn peek(&self, _: &Key, _: &PolicySet) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }
}

// A give-back holds the key's turn while it waits on the store: a waiter behind it whose
// peek the store fails too meets the store's failure, as behind a decision, not a limit.
#[tokio::test(start_paused = true)]
async fn a_waiter_behind_a_hung_give_back_gets_the_failure_modes_answer() {
    let limiter =
        Limiter::new(GiveBacksHang(runtime_store()), paced()).on_store_error(FailureMode::FailOpen);
    let key = Key::new("k");
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    // Its delay would pass its wait: it gives its units back (the store hangs on it).
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
    assert!(
        matches!(impatient, Err(WaitError::TooLong(_))),
        "{impatient:?}"
    );
    let behind = limiter
        .until_ready(&key, 1, Duration::from_millis(20))
        .await;
    assert!(
        behind.as_ref().is_ok_and(|decision| decision.is_allowed()),
        "{behind:?}"
    );
}

/// A store that never answers for the key `down`, and answers every other key.
#[derive(Clone)]
struct OneKeyHangs(MemoryStore<tollgate::clock::RuntimeClock>);

impl Store for OneKeyHangs {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if key.as_str() == "down" {
            return DecideFuture::new(std::future::pending());
        }
        self.0.decide(key, policies, cost)
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        if key.as_str() == "down" {
            return DecideFuture::new(std::future::pending());
        }
        self.0.peek(key, policies)
    }
}

// Whether a waiter's queue was held by a failing store is the queue's to say: another
// key's store calls failing meanwhile (one Cluster node down) does not make a waiter
// held behind an ordinary wait on a sound key a failure to let through open.
#[tokio::test(start_paused = true)]
async fn a_waiter_held_by_an_ordinary_wait_is_denied_while_another_keys_store_fails() {
    let limiter = Limiter::new(
        OneKeyHangs(runtime_store()),
        Policy::token_bucket("jobs", 1, Rate::per_minute(1)).unwrap(),
    )
    .on_store_error(FailureMode::FailOpen);
    let up = Key::new("up");
    assert!(limiter.check(&up, 1).await.unwrap().is_allowed());
    // Ahead: a waiter that sleeps for the next token, holding the turn.
    let ahead = waiter(&limiter, &up, 1, Duration::from_secs(120));
    tokio::task::yield_now().await;
    // Meanwhile the store fails for another key.
    let down = limiter.check(&Key::new("down"), 1).await;
    assert!(down.is_ok_and(|decision| decision.is_allowed()));
    let behind = limiter
        .until_ready(&up, 1, Duration::from_millis(100))
        .await;
    assert!(matches!(behind, Err(WaitError::TooLong(_))), "{behind:?}");
    ahead.abort();
}

#[tokio::test(start_paused = true)]
async fn a_shaping_delay_past_the_wait_gives_back_to_the_fallback_too() {
    // The store is away: the failure mode's local limiter decides, and a waiter that
    // gives up gives its units back there, as it would to the store. (The fallback keeps
    // real time, which the paused runtime does not move: its delays are under the round
    // figures by the real time the test has taken, allowed up to 5 s on a slow machine.)
    let limiter = Limiter::new(Away, paced());
    let key = Key::new("k");
    let near = |actual: Duration, expected: Duration| {
        actual <= expected && actual + Duration::from_secs(5) >= expected
    };
    let started = tokio::time::Instant::now();
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
    let Err(WaitError::TooLong(said)) = impatient else {
        panic!("{impatient:?}");
    };
    let told = said.retry_after().expect("a denial says when");
    assert!(near(told, Duration::from_secs(10)), "{told:?}");
    // Given back: the next waits for the first's 10 s, not for the impatient one's 20 s
    // (which its 15 s would refuse).
    let patient = limiter.until_ready(&key, 1, Duration::from_secs(15)).await;
    assert!(patient.is_ok(), "{patient:?}");
    let waited = started.elapsed();
    assert!(near(waited, Duration::from_secs(10)), "{waited:?}");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gives_up_frees_its_in_flight_slot_in_the_fallback() {
    // The store is away; the fallback holds an in-flight limit of two beside the shaping
    // bucket. A waiter that gives up on its shaping delay gives back its slot too, or the
    // next waiter would find both slots taken (the first caller keeps its own) and never
    // be admitted.
    let limiter = Limiter::new(
        Away,
        PolicySet::new([paced(), Policy::concurrency("slots", 2).unwrap()]).unwrap(),
    );
    let key = Key::new("k");
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
    assert!(
        matches!(impatient, Err(WaitError::TooLong(_))),
        "{impatient:?}"
    );
    let patient = limiter.until_ready(&key, 1, Duration::from_secs(15)).await;
    assert!(patient.is_ok(), "{patient:?}");
}

/// A limiter of `policy` on the runtime's clock, its key, and the time its first request
/// (which went at once) was admitted.
async fn first_one_sent(
    policy: Policy,
) -> (
    Limiter<MemoryStore<tollgate::clock::RuntimeClock>>,
    Key,
    tokio::time::Instant,
) {
    let limiter = Limiter::new(runtime_store(), policy);
    let key = Key::new("k");
    let started = tokio::time::Instant::now();
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    (limiter, key, started)
}

/// One request every 10 s, held back up to a minute.
fn paced() -> Policy {
    Policy::leaky_bucket_shaping(
        "paced",
        Rate::new(1, Duration::from_secs(10)),
        Duration::from_secs(60),
    )
    .unwrap()
}

/// A full shaping queue denies until it has drained to where a request may join it, and
/// the request then waits its place in the queue, up to `max_delay`, on top. Only the
/// denial's part was set against `max_wait`: a waiter slept it out, was then admitted
/// 60 s out, gave its place back and said `TooLong` 10 s late (one every 10 s, up to
/// 60 s queued, a wait of 30 s). It is told at once.
#[tokio::test(start_paused = true)]
async fn a_full_queue_is_too_long_at_once() {
    let (limiter, key) = seven_then_one_too_impatient(paced()).await;
    // One whose wait covers the denial and the queue is admitted, in its place.
    let waited = admitted_after(&limiter, &key, 1, Duration::from_secs(75)).await;
    assert_eq!(waited, Duration::from_secs(70));
}

/// The queue counts whichever policy the denial names: a spent bucket out-waiting a full
/// shaping queue named the bucket, and the waiter slept its 20 s to be admitted 50 s out
/// and told `TooLong` late.
#[tokio::test(start_paused = true)]
async fn a_queue_behind_another_policys_denial_counts_too() {
    seven_then_one_too_impatient(
        PolicySet::new([
            Policy::token_bucket("burst", 7, Rate::new(1, Duration::from_secs(20))).unwrap(),
            paced(),
        ])
        .unwrap(),
    )
    .await;
}

/// How long `until_ready` of `cost` units for `key`, within `max_wait`, waited before it
/// admitted (it must admit).
async fn admitted_after<St: tollgate::Store>(
    limiter: &Limiter<St>,
    key: &Key,
    cost: u64,
    max_wait: Duration,
) -> Duration {
    let started = tokio::time::Instant::now();
    let admitted = limiter.until_ready(key, cost, max_wait).await;
    assert!(admitted.is_ok(), "{admitted:?}");
    started.elapsed()
}

/// Seven requests of one unit at once under `policies`, then a waiter of 30 s, told
/// `TooLong` at once; the limiter and the key.
async fn seven_then_one_too_impatient(
    policies: impl Into<PolicySet>,
) -> (Limiter<MemoryStore<tollgate::clock::RuntimeClock>>, Key) {
    let limiter = Limiter::new(runtime_store(), policies);
    let key = Key::new("k");
    for _ in 0..7 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    let started = tokio::time::Instant::now();
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(30)).await;
    assert!(
        matches!(impatient, Err(WaitError::TooLong(_))),
        "{impatient:?}"
    );
    assert_eq!(started.elapsed(), Duration::ZERO, "told only after waiting");
    (limiter, key)
}

/// A request that costs nothing joins no queue: held back only by a block, it waits the
/// block out. The queues behind the block were counted against it, and a wait that fits
/// was refused.
#[tokio::test(start_paused = true)]
async fn a_request_of_nothing_counts_no_queue() {
    let burst = Policy::token_bucket("burst", 7, Rate::new(1, Duration::from_secs(20)))
        .unwrap()
        .with_penalty(tollgate::policy::Penalty::new(
            1,
            Duration::from_secs(60),
            Duration::from_secs(30),
        ))
        .unwrap();
    let limiter = Limiter::new(runtime_store(), PolicySet::new([burst, paced()]).unwrap());
    let key = Key::new("k");
    for _ in 0..7 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let waited = admitted_after(&limiter, &key, 0, Duration::from_secs(40)).await;
    assert_eq!(waited, Duration::from_secs(30));
}

/// A shaping policy's block (a penalty) names it with what is left of the block; its
/// queue has drained by then. Counting a whole `max_delay` on top refused a wait that
/// fits.
#[tokio::test(start_paused = true)]
async fn a_blocked_shaping_policy_counts_no_queue_that_has_drained() {
    let policy = paced()
        .with_penalty(tollgate::policy::Penalty::new(
            1,
            Duration::from_secs(60),
            Duration::from_secs(120),
        ))
        .unwrap();
    let limiter = Limiter::new(runtime_store(), policy);
    let key = Key::new("k");
    for _ in 0..7 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    assert!(limiter.check(&key, 1).await.unwrap().is_blocked());
    let waited = admitted_after(&limiter, &key, 1, Duration::from_secs(150)).await;
    assert_eq!(waited, Duration::from_secs(120));
}

#[tokio::test(start_paused = true)]
async fn a_shaping_delay_past_the_wait_names_the_shaping_policy() {
    // A generous bucket first, two shaping buckets after it: the one that holds the
    // request back longest (one every 10 s, not one a second) is the policy named.
    let policies = PolicySet::new([
        Policy::token_bucket("burst", 100, Rate::per_second(100)).unwrap(),
        Policy::leaky_bucket_shaping("fast", Rate::per_second(1), Duration::from_secs(60)).unwrap(),
        paced(),
    ])
    .unwrap();
    let limiter = Limiter::new(runtime_store(), policies);
    let key = Key::new("k");
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    let impatient = limiter.until_ready(&key, 1, Duration::from_secs(1)).await;
    let Err(WaitError::TooLong(said)) = impatient else {
        panic!("{impatient:?}");
    };
    assert_eq!(said.retry_after(), Some(Duration::from_secs(10)));
    assert!(
        matches!(said.outcome(), tollgate::Outcome::Denied { policy: 2, .. }),
        "{:?}",
        said.outcome()
    );

    // The policy named is the one whose own wait is the delay, not the one with the
    // longer queue once this request joined it: at 1.2 s "slow" still holds 0.8 s of
    // the first request's two units, "quick" (3 every 2 s) 0.13 s; this request adds
    // 1 s to "slow" and 0.67 s to "quick", whose queue then reads as two whole units.
    let policies = PolicySet::new([
        Policy::leaky_bucket_shaping(
            "quick",
            Rate::new(3, Duration::from_secs(2)),
            Duration::from_secs(2),
        )
        .unwrap(),
        Policy::leaky_bucket_shaping("slow", Rate::per_second(1), Duration::from_millis(10_900))
            .unwrap(),
    ])
    .unwrap();
    let limiter = Limiter::new(runtime_store(), policies);
    assert!(limiter.until_ready(&key, 2, Duration::ZERO).await.is_ok());
    tokio::time::advance(Duration::from_millis(1200)).await;
    let impatient = limiter
        .until_ready(&key, 1, Duration::from_millis(500))
        .await;
    let Err(WaitError::TooLong(said)) = impatient else {
        panic!("{impatient:?}");
    };
    assert_eq!(said.retry_after(), Some(Duration::from_millis(800)));
    assert!(
        matches!(said.outcome(), tollgate::Outcome::Denied { policy: 1, .. }),
        "{:?}",
        said.outcome()
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_during_its_shaping_delay_gives_its_units_back() {
    // One every 10 s: the first goes at once; the second, given up on 1 s into its
    // 10 s delay, must not keep its place in the queue, so a third waits only for the
    // first's 10 s.
    let (limiter, key, started) = first_one_sent(paced()).await;
    let dropped = tokio::time::timeout(
        Duration::from_secs(1),
        limiter.until_ready(&key, 1, Duration::from_secs(30)),
    )
    .await;
    assert!(dropped.is_err(), "{dropped:?}");
    let third = limiter.until_ready(&key, 1, Duration::from_secs(30)).await;
    assert!(third.is_ok(), "{third:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_sleeper_never_puts_two_waiters_on_one_slot() {
    // One every 10 s. The second sleeps its 10 s delay while a third waits behind it;
    // the second is dropped at 1 s and its units given back. The third then goes at
    // 10 s, and a fourth at 20 s: never two at one instant.
    let (limiter, key, started) = first_one_sent(paced()).await;
    let timed = |limiter: &Limiter<_>| {
        let (limiter, key) = (limiter.clone(), key.clone());
        tokio::spawn(async move {
            let admitted = limiter.until_ready(&key, 1, Duration::from_secs(30)).await;
            assert!(admitted.is_ok(), "{admitted:?}");
            started.elapsed()
        })
    };
    let sleeper = timed(&limiter);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let third = timed(&limiter);
    tokio::time::sleep(Duration::from_secs(1)).await;
    sleeper.abort();
    assert!(sleeper.await.is_err(), "dropped mid-sleep");
    let fourth = timed(&limiter);
    assert_eq!(third.await.unwrap(), Duration::from_secs(10));
    assert_eq!(fourth.await.unwrap(), Duration::from_secs(20));
}

/// A waiter sleeping its shaping delay, a `check` booked behind it (not a waiter, so not
/// in the waiters' turn), then the waiter dropped 1 s in and its give-back run: the
/// check's decision.
async fn sleeper_dropped_behind_a_check<St: tollgate::Store + Clone>(
    limiter: &Limiter<St>,
    key: &Key,
) -> tollgate::Decision {
    let sleeper = waiter(limiter, key, 1, Duration::from_secs(30));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let behind = limiter.check(key, 1).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    sleeper.abort();
    assert!(sleeper.await.is_err(), "dropped mid-sleep");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    behind
}

#[tokio::test(start_paused = true)]
async fn a_dropped_sleeper_gives_nothing_back_once_a_check_booked_behind_it() {
    // One every 10 s. The second sleeps its 10 s delay; a `check` (not a waiter, so not
    // in the waiters' turn) books the 20 s place behind it. The sleeper dropped at 1 s
    // must not give its place back: a settle to nothing did, and the next booking went on
    // the check's instant (19 s from then, two requests at 20 s). Given back as an
    // unbooking, it is refused while a booking stands behind it.
    let (limiter, key, started) = first_one_sent(paced()).await;
    let behind = sleeper_dropped_behind_a_check(&limiter, &key).await;
    assert_eq!(
        behind.outcome(),
        tollgate::Outcome::Allowed {
            delay: Duration::from_secs(20)
        }
    );
    let next = limiter.check(&key, 1).await.unwrap();
    assert_eq!(
        next.outcome(),
        tollgate::Outcome::Allowed {
            delay: Duration::from_secs(29)
        },
        "after the check's 20 s place, at {:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_sleeper_whose_place_stays_taken_still_gives_its_tokens_back() {
    // Paced one every 10 s beside 100 tokens an hour. The sleeper's place cannot go back
    // (a `check` booked behind it), but its token was spent for a request never sent:
    // it comes back, as a settle to nothing with the pacing left alone.
    let limiter = Limiter::new(
        runtime_store(),
        PolicySet::new([
            paced(),
            Policy::token_bucket("tokens", 100, Rate::per_hour(1)).unwrap(),
        ])
        .unwrap(),
    );
    let key = Key::new("k");
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    let behind = sleeper_dropped_behind_a_check(&limiter, &key).await;
    assert_eq!(behind.statuses()[1].remaining, 97);
    let next = limiter.check(&key, 1).await.unwrap();
    assert_eq!(
        next.statuses()[1].remaining,
        97,
        "the sleeper's token came back (and this one took one)"
    );
    assert_eq!(
        next.outcome(),
        tollgate::Outcome::Allowed {
            delay: Duration::from_secs(29)
        },
        "its place did not"
    );
}

#[test]
fn a_sleeper_dropped_outside_any_runtime_does_not_panic() {
    // A waiter polled into its shaping delay on a runtime, then dropped after the
    // runtime is gone: its units cannot be given back (no store call can be bounded by
    // a timeout there), and the drop must not panic.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let limiter = runtime.block_on(async { Limiter::new(runtime_store(), paced()) });
    let key = Key::new("k");
    // The waiter is handed out of the runtime on purpose, not awaited.
    #[allow(clippy::async_yields_async)]
    let sleeping = runtime.block_on(async {
        assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
        let mut waiter = Box::pin(limiter.until_ready(&key, 1, Duration::from_secs(30)));
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(waiter.as_mut().poll(cx).is_pending())
        })
        .await;
        assert!(polled, "the waiter sleeps its 10 s delay");
        waiter
    });
    drop(runtime);
    drop(sleeping);
}

/// A store whose give-backs (`adjust`) take 20 ms, as a remote store's do.
#[derive(Clone)]
struct SlowAdjust(MemoryStore<tollgate::clock::RuntimeClock>);

impl Store for SlowAdjust {
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
        adjustment: &tollgate::Adjustment,
    ) -> DecideFuture {
        // Applied when the answer comes, as on a server 20 ms away.
        let (store, key, policies, adjustment) = (
            self.0.clone(),
            key.clone(),
            policies.clone(),
            adjustment.clone(),
        );
        DecideFuture::new(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            store.adjust(&key, &policies, &adjustment).await
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_while_it_gives_back_still_gives_back() {
    // One every 10 s. The second waiter would wait 10 s, past its 1 s: it gives its units
    // back, which takes this store 20 ms, and its caller gives up after 5 ms (it used to
    // wait for the give-back, and lose it when dropped). The units go back all the same:
    // a third waits only for the first's 10 s, not 20.
    let limiter = Limiter::new(SlowAdjust(runtime_store()), paced());
    let key = Key::new("k");
    let started = tokio::time::Instant::now();
    assert!(limiter.until_ready(&key, 1, Duration::ZERO).await.is_ok());
    let dropped = tokio::time::timeout(
        Duration::from_millis(5),
        limiter.until_ready(&key, 1, Duration::from_secs(1)),
    )
    .await;
    // Told at once that it would wait too long, or given up on while giving back.
    assert!(
        matches!(dropped, Err(_) | Ok(Err(WaitError::TooLong(_)))),
        "{dropped:?}"
    );
    let third = limiter.until_ready(&key, 1, Duration::from_secs(30)).await;
    assert!(third.is_ok(), "{third:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

/// A fallback share that is no share is refused by the limiter as by the layer: it was
/// taken (with a warning), and each replica enforced the whole limit in an outage.
#[test]
#[should_panic(expected = "Limiter: LocalFallback::share must be above 0")]
fn a_fallback_share_of_nothing_is_refused() {
    let policy = Policy::token_bucket("mail", 20, Rate::per_second(10)).unwrap();
    let _ = Limiter::new(MemoryStore::new(), policy).on_store_error(FailureMode::Fallback(
        tollgate::LocalFallback::new().share(0.0),
    ));
}

/// A store timeout of zero fails every decision of a store that does I/O (each replica
/// then decides alone, by the failure mode): the layer refuses it when it is built, and
/// so does a `Limiter`.
#[test]
#[should_panic(expected = "store timeout is zero")]
fn a_zero_store_timeout_is_refused() {
    let _ = tollgate::limiter::Limiter::new(
        tollgate::MemoryStore::new(),
        tollgate::Policy::fixed_window("api", 10, std::time::Duration::from_secs(1)).unwrap(),
    )
    .store_timeout(std::time::Duration::ZERO);
}

/// A cost above a policy's limit can never be admitted: `until_ready` says so at once,
/// even while another waiter holds the key's turn. (Queued first, it was told `TooLong`
/// once its wait ran out, which a caller retries for ever.)
#[tokio::test(start_paused = true)]
async fn a_cost_no_policy_admits_is_never_at_once_even_behind_a_waiter() {
    let limiter = Limiter::new(
        runtime_store(),
        Policy::token_bucket("calls", 2, Rate::per_second(1)).unwrap(),
    );
    let key = Key::new("k");
    limiter.check(&key, 2).await.unwrap();
    // A waiter holds the key's turn for 2 s, until its units are back.
    let first = waiter(&limiter, &key, 2, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    match limiter.until_ready(&key, 3, Duration::from_secs(60)).await {
        Err(WaitError::Never(decision)) => assert!(!decision.is_allowed(), "{decision:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "it did not queue");
    assert!(first.await.unwrap().unwrap().is_allowed());
}

/// A waiter waits the time the store names: its denials are no offence, and count
/// towards no penalty (three waits in a row were a block of 300 s). A block that other
/// denials started still holds waiters back.
#[tokio::test(start_paused = true)]
async fn waiting_is_no_offence_under_a_penalty() {
    use tollgate::policy::Penalty;
    let mail = Policy::token_bucket("mail", 1, Rate::per_second(1))
        .unwrap()
        .with_penalty(Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(300),
        ))
        .unwrap();
    let limiter = Limiter::new(runtime_store(), mail);
    let key = Key::new("k");
    let started = tokio::time::Instant::now();
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    for second in 1..=3 {
        let decision = limiter
            .until_ready(&key, 1, Duration::from_secs(10))
            .await
            .unwrap_or_else(|error| panic!("wait {second}: {error}"));
        assert!(decision.is_allowed());
        assert_eq!(started.elapsed(), Duration::from_secs(second));
    }
    // Three denials of a check are a block, which a waiter meets.
    for _ in 0..3 {
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    match limiter.until_ready(&key, 1, Duration::from_secs(10)).await {
        Err(WaitError::TooLong(decision)) => {
            assert!(decision.is_blocked(), "{decision:?}");
            assert!(
                decision.retry_after().unwrap() > Duration::from_secs(290),
                "{decision:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Waited out, the block ends and the waiter goes.
    let decision = limiter
        .until_ready(&key, 1, Duration::from_secs(400))
        .await
        .unwrap();
    assert!(decision.is_allowed());
}

/// A cost no policy can admit is told `Never` without an offence: the store is asked
/// without the penalties, so another policy's denial beside it starts no block.
#[tokio::test(start_paused = true)]
async fn a_cost_never_admitted_is_no_offence_under_a_penalty() {
    use tollgate::policy::Penalty;
    let hourly = Policy::token_bucket("hourly", 5, Rate::per_hour(5))
        .unwrap()
        .with_penalty(Penalty::new(
            1,
            Duration::from_secs(60),
            Duration::from_secs(300),
        ))
        .unwrap();
    let burst = Policy::token_bucket("burst", 2, Rate::per_second(2)).unwrap();
    let limiter = Limiter::new(runtime_store(), PolicySet::new([burst, hourly]).unwrap());
    let key = Key::new("k");
    for cost in [2, 2, 1] {
        assert!(limiter.check(&key, cost).await.unwrap().is_allowed());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // 3 is more than the burst ever admits, and the hourly quota is spent.
    assert!(matches!(
        limiter.until_ready(&key, 3, Duration::from_secs(10)).await,
        Err(WaitError::Never(_))
    ));
    let now = limiter.check(&key, 0).await.unwrap();
    assert!(!now.is_blocked(), "{now:?}");
}

/// A store whose peeks fail while its decisions answer (each has its own timeout).
#[derive(Clone)]
struct PeekFails(MemoryStore<tollgate::clock::RuntimeClock>);

impl Store for PeekFails {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        if cost == 0 {
            return self.peek(key, policies);
        }
        self.0.decide(key, policies, cost)
    }

    fn peek(&self, _: &Key, _: &PolicySet) -> DecideFuture {
        DecideFuture::ready(Err(StoreError::new(StoreErrorKind::Timeout, "no peek")))
    }
}

/// A waiter reads whether a block stands before it decides without the penalties. When
/// that read fails, it does not know: it decides with them, as a check does, and meets
/// the block. (Read as "not blocked", a blocked key's waiter was admitted.)
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_peek_fails_still_meets_the_block() {
    use tollgate::policy::Penalty;
    let login = Policy::token_bucket("login", 1, Rate::per_second(1))
        .unwrap()
        .with_penalty(Penalty::new(
            1,
            Duration::from_secs(60),
            Duration::from_secs(300),
        ))
        .unwrap();
    let limiter = Limiter::new(PeekFails(runtime_store()), login);
    let key = Key::new("k");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let denied = limiter.check(&key, 1).await.unwrap();
    assert!(
        denied.is_blocked(),
        "one denial starts the block: {denied:?}"
    );
    match limiter.until_ready(&key, 1, Duration::from_secs(10)).await {
        Err(WaitError::TooLong(decision)) => assert!(decision.is_blocked(), "{decision:?}"),
        other => panic!("admitted during a block: {other:?}"),
    }
}

/// A token bucket of 5 a second that blocks a key for a minute after 3 denials.
fn penalized() -> Policy {
    use tollgate::policy::Penalty;
    Policy::token_bucket("login", 5, Rate::per_second(1))
        .unwrap()
        .with_penalty(Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(300),
        ))
        .unwrap()
}

/// A waiter for `cost` units that may not wait is let through by the failure mode after
/// one store timeout of 50 ms exactly (paused time), not two.
async fn let_through_after_one_timeout<St: Store>(limiter: &Limiter<St>, cost: u64) {
    let started = tokio::time::Instant::now();
    let waited = limiter
        .until_ready(&Key::new("k"), cost, Duration::ZERO)
        .await;
    assert!(
        waited.is_ok(),
        "the failure mode lets it through: {waited:?}"
    );
    assert_eq!(started.elapsed(), Duration::from_millis(50));
}

/// A store that never answers anything.
#[derive(Clone)]
struct Hangs;

impl Store for Hangs {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }

    fn peek(&self, _: &Key, _: &PolicySet) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }
}

// A waiter that gave up reads the key's state once with the others that gave up beside
// it; the one reading may be dropped mid-read (a timeout around it), and the next one
// then reads again. It is still answered within one store timeout of giving up, as every
// waiter is, not one timeout after the dropped read.
#[tokio::test(start_paused = true)]
async fn a_read_dropped_midway_keeps_the_next_waiter_within_one_store_timeout() {
    let limiter = Limiter::new(
        Hangs,
        Policy::token_bucket("jobs", 100, Rate::per_second(100)).unwrap(),
    )
    .store_timeout(Duration::from_millis(50))
    .on_store_error(FailureMode::FailOpen);
    let key = Key::new("k");
    let started = tokio::time::Instant::now();
    // The turn's holder, in a store call that hangs.
    let holder = waiter(&limiter, &key, 1, Duration::from_secs(1));
    tokio::task::yield_now().await;
    // The first gives up at 5 ms and reads; the next gives up at 10 ms and waits for
    // that read, whose waiter is dropped at 30 ms.
    let dropped = {
        let (limiter, key) = (limiter.clone(), key.clone());
        tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_millis(30),
                limiter.until_ready(&key, 1, Duration::from_millis(5)),
            )
            .await
        })
    };
    tokio::task::yield_now().await;
    let next = limiter
        .until_ready(&key, 1, Duration::from_millis(10))
        .await;
    assert!(
        next.as_ref().is_ok_and(|decision| decision.is_allowed()),
        "the failure mode's answer (open): {next:?}"
    );
    assert!(
        started.elapsed() <= Duration::from_millis(10 + 50),
        "answered after {:?}",
        started.elapsed()
    );
    assert!(dropped.await.unwrap().is_err(), "dropped by its timeout");
    holder.abort();
}

/// Under a penalty a waiter's turn is a peek (is a block standing?) then a decision. A
/// store that hangs held it for the store timeout twice, one per call; the two share
/// one timeout, so the failure mode answers after it, as for a check.
#[tokio::test(start_paused = true)]
async fn a_waiter_under_a_penalty_waits_one_store_timeout_for_a_store_that_hangs() {
    let limiter = Limiter::new(Hangs, penalized()).store_timeout(Duration::from_millis(50));
    let started = tokio::time::Instant::now();
    let checked = limiter.check(&Key::new("k"), 1).await;
    assert!(checked.is_ok(), "the fallback decides: {checked:?}");
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    let_through_after_one_timeout(&limiter, 1).await;
}

/// A store whose peeks answer after 45 ms and whose decisions never answer.
#[derive(Clone)]
struct SlowPeekThenHangs(MemoryStore<tollgate::clock::RuntimeClock>);

impl Store for SlowPeekThenHangs {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        DecideFuture::new(std::future::pending())
    }

    fn peek(&self, key: &Key, policies: &PolicySet) -> DecideFuture {
        let answer = self.0.peek(key, policies);
        DecideFuture::new(async move {
            tokio::time::sleep(Duration::from_millis(45)).await;
            answer.await
        })
    }
}

/// A waiter's turn under a penalty (a peek, then a decision) has one store timeout,
/// however it is spent: a peek that answered late leaves the decision what is left.
#[tokio::test(start_paused = true)]
async fn a_waiters_peek_and_decision_share_one_store_timeout() {
    let limiter = Limiter::new(SlowPeekThenHangs(runtime_store()), penalized())
        .store_timeout(Duration::from_millis(50));
    let_through_after_one_timeout(&limiter, 1).await;
}

/// A cost above the limit is asked of the store once before queueing. When the store
/// hangs and the failure mode lets requests through, that answer stands: the waiter is
/// not sent to ask again for a second timeout.
#[tokio::test(start_paused = true)]
async fn a_cost_the_store_was_asked_of_in_vain_is_answered_by_the_failure_mode_at_once() {
    let limiter = Limiter::new(
        Hangs,
        Policy::token_bucket("jobs", 5, Rate::per_second(1)).unwrap(),
    )
    .on_store_error(FailureMode::FailOpen)
    .store_timeout(Duration::from_millis(50));
    let_through_after_one_timeout(&limiter, 6).await;
}

/// A waiter under a penalty decides on the set without the penalties, which `Leased`
/// would lease (a set with penalties it never leases): the waiter took a lease of the
/// whole quota, and the key's next check (with the penalties, straight to the store)
/// found it spent, and counted a denial towards a block.
#[tokio::test(start_paused = true)]
async fn a_waiter_under_a_penalty_takes_no_lease() {
    use tollgate::policy::Penalty;
    use tollgate::store::Leased;
    let api = Policy::token_bucket("api", 10, Rate::per_hour(10))
        .unwrap()
        .with_penalty(Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(300),
        ))
        .unwrap();
    let store = Leased::new(runtime_store(), 100, Duration::from_secs(10)).unwrap();
    let limiter = Limiter::new(store, api);
    let key = Key::new("k");
    let waited = limiter
        .until_ready(&key, 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(waited.is_allowed());
    let checked = limiter.check(&key, 1).await.unwrap();
    assert!(checked.is_allowed(), "{checked:?}");
    assert_eq!(checked.statuses()[0].remaining, 8, "{checked:?}");
}

/// A store that denies every call with no wait at all (a custom store's bug, or a reply
/// read as 0), counting its calls.
#[derive(Clone, Default)]
struct DeniesNow(Arc<std::sync::atomic::AtomicU64>);

impl Store for DeniesNow {
    fn decide(&self, _: &Key, _: &PolicySet, _: u64) -> DecideFuture {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        DecideFuture::ready(Ok(tollgate::Decision::new(
            Outcome::Denied {
                policy: 0,
                retry_after: Duration::ZERO,
            },
            [],
        )))
    }
}

#[tokio::test(start_paused = true)]
async fn a_denial_that_says_no_wait_is_not_asked_again_at_once() {
    // Asked again at once, the store would be hammered until the waiter's deadline (and
    // on a paused clock, forever): each new ask waits at least a millisecond.
    let store = DeniesNow::default();
    let limiter = Limiter::new(
        store.clone(),
        Policy::token_bucket("t", 10, Rate::per_second(10)).unwrap(),
    );
    let waited = limiter
        .until_ready(&Key::new("k"), 1, Duration::from_millis(10))
        .await;
    assert!(matches!(waited, Err(WaitError::TooLong(_))), "{waited:?}");
    let calls = store.0.load(std::sync::atomic::Ordering::Relaxed);
    assert!(calls <= 12, "{calls} calls in 10 ms");
}
