//! The six algorithms under a manual clock: what each one promises, and the seam the
//! fixed window does not guard.

use std::time::Duration;

use tollgate::algorithm::{CounterState, SlidingWindow};
use tollgate::clock::ManualClock;
use tollgate::{Decision, MemoryStore, Outcome, Policy, PolicySet, Rate};

const SECOND: Duration = Duration::from_secs(1);

struct Harness {
    clock: ManualClock,
    store: MemoryStore<ManualClock>,
    policies: PolicySet,
}

impl Harness {
    fn new(policy: Policy) -> Self {
        Self::with_set(PolicySet::from(policy))
    }

    fn with_set(policies: PolicySet) -> Self {
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        Self {
            clock,
            store,
            policies,
        }
    }

    fn check(&self, cost: u64) -> Decision {
        self.store.check("client", &self.policies, cost)
    }

    /// How many unit requests are admitted right now, trying `tries` times.
    fn burst(&self, tries: u64) -> u64 {
        (0..tries).filter(|_| self.check(1).is_allowed()).count() as u64
    }

    fn at(&self, t: Duration) -> &Self {
        self.clock.set(t);
        self
    }
}

fn all_exact(limit: u64) -> Vec<Policy> {
    vec![
        Policy::sliding_log("log", limit, SECOND).unwrap(),
        Policy::token_bucket("bucket", limit, Rate::per_second(limit)).unwrap(),
        Policy::gcra("gcra", Rate::per_second(limit), limit).unwrap(),
        Policy::leaky_bucket("leaky", limit, Rate::per_second(limit)).unwrap(),
    ]
}

#[test]
fn fixed_window_admits_twice_the_limit_across_a_seam() {
    let h = Harness::new(Policy::fixed_window("fixed", 10, SECOND).unwrap());
    // All ten at the very end of one window, ten more at the start of the next:
    // twenty inside 2 ms.
    let before = h.at(Duration::from_millis(999)).burst(20);
    let after = h.at(Duration::from_millis(1001)).burst(20);
    assert_eq!((before, after), (10, 10));
}

#[test]
fn exact_algorithms_do_not_admit_twice_the_limit_across_a_seam() {
    for policy in all_exact(10) {
        let name = policy.name().to_owned();
        let h = Harness::new(policy);
        let before = h.at(Duration::from_millis(999)).burst(20);
        let after = h.at(Duration::from_millis(1001)).burst(20);
        assert_eq!(before, 10, "{name}");
        // 2 ms of refill at 10/s is less than one unit.
        assert_eq!(after, 0, "{name}");
    }
}

#[test]
fn sliding_counter_estimate_matches_the_formula() {
    let w = 1_000_000_000u64;
    let algo = SlidingWindow {
        limit: 100,
        window: w,
    };
    // previous = 40, current = 10, 25% into the window: 40 * 0.75 + 10 = 40.
    let state = CounterState {
        index: 5,
        previous: 40,
        current: 10,
    };
    assert_eq!(algo.estimate(&state, 5 * w + w / 4), 40);
    // 30 * 0.5 + 7 = 22; 33 * (1 - 0.3) = 23.1, rounded up to 24, + 0.
    let state = CounterState {
        index: 2,
        previous: 30,
        current: 7,
    };
    assert_eq!(algo.estimate(&state, 2 * w + w / 2), 22);
    let state = CounterState {
        index: 2,
        previous: 33,
        current: 0,
    };
    assert_eq!(algo.estimate(&state, 2 * w + 3 * w / 10), 24);

    // Through the store: 8 in window 0, then 2 in window 1 at 50%: 8 * 0.5 + 2 = 6.
    let h = Harness::new(Policy::sliding_window("counter", 10, SECOND).unwrap());
    assert_eq!(h.at(Duration::from_millis(100)).burst(8), 8);
    assert_eq!(h.at(Duration::from_millis(1500)).burst(2), 2);
    let decision = h.check(0);
    assert_eq!(decision.statuses()[0].remaining, 4);
    // The estimate decays: at 75% it is 8 * 0.25 + 2 = 4, so 6 more fit.
    assert_eq!(h.at(Duration::from_millis(1750)).burst(10), 6);
}

#[test]
fn sliding_counter_retry_after_is_when_the_estimate_makes_room() {
    let h = Harness::new(Policy::sliding_window("counter", 10, SECOND).unwrap());
    assert_eq!(h.at(Duration::ZERO).burst(10), 10);
    // Window 1 at 0%: estimate = 10. Room for 1 unit once 10 * (1 - e) <= 9: e >= 10%.
    let denied = h.at(SECOND).check(1);
    assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
    h.at(Duration::from_millis(1099));
    assert!(!h.check(1).is_allowed());
    h.at(Duration::from_millis(1100));
    assert!(h.check(1).is_allowed());
}

#[test]
fn token_bucket_bursts_to_capacity_and_sustains_the_rate() {
    let h = Harness::new(Policy::token_bucket("bucket", 10, Rate::per_second(5)).unwrap());
    assert_eq!(h.burst(100), 10);
    // Sustained: 5 per second, one every 200 ms, nothing in between.
    let mut admitted = 0;
    for step in 1..=100 {
        h.at(Duration::from_millis(step * 100));
        admitted += h.burst(3);
    }
    assert_eq!(admitted, 50);
    let denied = h.check(1);
    assert_eq!(denied.retry_after(), Some(Duration::from_millis(200)));
}

#[test]
fn gcra_matches_the_token_bucket_it_is_a_twin_of() {
    let gcra = Harness::new(Policy::gcra("g", Rate::per_second(5), 10).unwrap());
    let bucket = Harness::new(Policy::token_bucket("b", 10, Rate::per_second(5)).unwrap());
    let trace = [
        0u64, 0, 3, 50, 199, 200, 201, 600, 601, 1400, 5000, 5001, 5002,
    ];
    for (i, ms) in trace.iter().enumerate() {
        let t = Duration::from_millis(*ms);
        for cost in [1u64, 3, 2] {
            let a = gcra.at(t).check(cost);
            let b = bucket.at(t).check(cost);
            assert_eq!(a.outcome(), b.outcome(), "step {i} at {ms} ms cost {cost}");
            assert_eq!(a.statuses()[0].remaining, b.statuses()[0].remaining);
            assert_eq!(a.statuses()[0].reset, b.statuses()[0].reset);
        }
    }
}

#[test]
fn leaky_bucket_polices_like_a_meter() {
    let h = Harness::new(Policy::leaky_bucket("leaky", 4, Rate::per_second(2)).unwrap());
    assert_eq!(h.burst(10), 4);
    assert_eq!(h.at(Duration::from_millis(499)).burst(2), 0);
    assert_eq!(h.at(Duration::from_millis(500)).burst(2), 1);
}

#[test]
fn leaky_shaping_spaces_requests_and_bounds_the_delay() {
    // 2 per second (one every 500 ms), at most 2 s of waiting.
    let policy =
        Policy::leaky_bucket_shaping("shape", Rate::per_second(2), Duration::from_secs(2)).unwrap();
    let h = Harness::new(policy);
    let delays: Vec<Option<Duration>> = (0..7)
        .map(|_| match h.check(1).outcome() {
            Outcome::Allowed { delay } => Some(delay),
            _ => None,
        })
        .collect();
    let ms = Duration::from_millis;
    assert_eq!(
        delays,
        vec![
            Some(ms(0)),
            Some(ms(500)),
            Some(ms(1000)),
            Some(ms(1500)),
            Some(ms(2000)),
            None,
            None
        ]
    );
    // A denied request is told when the queue has room again.
    assert_eq!(h.check(1).retry_after(), Some(ms(500)));
    // After 1 s two have left; a new request waits for the three ahead of it.
    match h.at(ms(1000)).check(1).outcome() {
        Outcome::Allowed { delay } => assert_eq!(delay, ms(1500)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn costs_debit_their_weight() {
    for policy in [
        Policy::fixed_window("f", 10, SECOND).unwrap(),
        Policy::sliding_window("s", 10, SECOND).unwrap(),
        Policy::sliding_log("l", 10, SECOND).unwrap(),
        Policy::token_bucket("t", 10, Rate::per_second(10)).unwrap(),
        Policy::leaky_bucket("p", 10, Rate::per_second(10)).unwrap(),
        Policy::gcra("g", Rate::per_second(10), 10).unwrap(),
    ] {
        let name = policy.name().to_owned();
        let h = Harness::new(policy);
        let first = h.check(4);
        assert!(first.is_allowed(), "{name}");
        assert_eq!(first.statuses()[0].remaining, 6, "{name}");
        assert_eq!(h.check(5).statuses()[0].remaining, 1, "{name}");
        let denied = h.check(2);
        assert!(!denied.is_allowed(), "{name}");
        // A denied request debits nothing.
        assert_eq!(denied.statuses()[0].remaining, 1, "{name}");
        assert!(h.check(1).is_allowed(), "{name}");
        // Cost 0 is always admitted and spends nothing.
        let free = h.check(0);
        assert!(free.is_allowed(), "{name}");
        assert_eq!(free.statuses()[0].remaining, 0, "{name}");
    }
}

#[test]
fn a_cost_that_can_never_fit_is_not_told_to_retry() {
    for policy in all_exact(10)
        .into_iter()
        .chain([Policy::fixed_window("f", 10, SECOND).unwrap()])
    {
        let name = policy.name().to_owned();
        let h = Harness::new(policy);
        let decision = h.check(11);
        assert_eq!(
            decision.outcome(),
            Outcome::CostExceedsLimit {
                policy: 0,
                cost: 11,
                limit: 10
            },
            "{name}"
        );
        assert_eq!(decision.retry_after(), None);
        // Nothing was spent.
        assert_eq!(h.burst(10), 10, "{name}");
        let huge = h.check(u64::MAX);
        assert!(matches!(huge.outcome(), Outcome::CostExceedsLimit { .. }));
    }
}

#[test]
fn several_policies_are_all_or_nothing() {
    let set = PolicySet::new([
        Policy::token_bucket("burst", 5, Rate::per_second(5)).unwrap(),
        Policy::fixed_window("daily", 8, Duration::from_secs(86_400)).unwrap(),
    ])
    .unwrap();
    let h = Harness::with_set(set);
    assert_eq!(h.burst(10), 5);
    // The burst policy denies; the daily one must not have been debited by the denials.
    let denied = h.check(1);
    assert_eq!(
        denied.outcome(),
        Outcome::Denied {
            policy: 0,
            retry_after: Duration::from_millis(200)
        }
    );
    assert_eq!(denied.statuses()[1].remaining, 3);
    h.at(Duration::from_secs(2));
    // Burst is full again (5), but the day has only 3 left.
    assert_eq!(h.burst(10), 3);
    let denied = h.check(1);
    assert!(matches!(
        denied.outcome(),
        Outcome::Denied { policy: 1, .. }
    ));
    assert_eq!(denied.statuses()[0].remaining, 2);
}

#[test]
fn the_clock_standing_still_changes_nothing() {
    for policy in all_exact(3) {
        let h = Harness::new(policy);
        assert_eq!(h.burst(3), 3);
        for _ in 0..1000 {
            assert!(!h.check(1).is_allowed());
        }
    }
}

#[test]
fn reset_reports_the_time_until_whole() {
    let h = Harness::new(Policy::token_bucket("b", 10, Rate::per_second(5)).unwrap());
    let decision = h.check(4);
    assert_eq!(decision.statuses()[0].reset, Duration::from_millis(800));
    let h = Harness::new(Policy::sliding_log("l", 10, SECOND).unwrap());
    h.at(Duration::from_millis(300)).check(1);
    let decision = h.at(Duration::from_millis(500)).check(1);
    assert_eq!(decision.statuses()[0].reset, SECOND);
    let h = Harness::new(Policy::fixed_window("f", 10, SECOND).unwrap());
    let decision = h.at(Duration::from_millis(300)).check(1);
    assert_eq!(decision.statuses()[0].reset, Duration::from_millis(700));
}
