//! Property tests: for any arrival sequence, the exact algorithms never admit more than
//! their limit in any window, and every Retry-After is honest.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::ManualClock;
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

const WINDOW_MS: u64 = 1000;

/// Replays `arrivals` (gap before it in ms, cost) and returns the admitted ones as
/// (time in ms, cost).
fn replay(policy: Policy, arrivals: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let clock = ManualClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policies = PolicySet::from(policy);
    let mut now = 0;
    let mut admitted = Vec::new();
    for &(gap, cost) in arrivals {
        now += gap;
        clock.set(Duration::from_millis(now));
        if store.check("k", &policies, cost).is_allowed() {
            admitted.push((now, cost));
        }
    }
    admitted
}

fn arrivals() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..400, 1u64..4), 1..200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn sliding_log_never_exceeds_the_limit_in_any_window(arrivals in arrivals(), limit in 1u64..20) {
        let admitted = replay(Policy::sliding_log("l", limit, Duration::from_millis(WINDOW_MS)).unwrap(), &arrivals);
        for &(start, _) in &admitted {
            let in_window: u64 = admitted.iter()
                .filter(|(t, _)| *t >= start && *t < start + WINDOW_MS)
                .map(|(_, c)| c)
                .sum();
            prop_assert!(in_window <= limit, "{in_window} > {limit} from {start}");
        }
    }

    /// `Policy::sliding_window_split` promises that no window of its length ever holds more
    /// than `limit + limit / k` admitted units, whatever the traffic.
    #[test]
    fn split_sliding_window_never_exceeds_its_bound(
        arrivals in arrivals(),
        limit in 1u64..40,
        k in prop::sample::select(vec![1u32, 2, 3, 4, 5, 8, 10, 64]),
    ) {
        // 960 ms: whole microseconds in 3 and in 64 sub-windows alike.
        let window_ms = 960;
        let policy = Policy::sliding_window_split("s", limit, Duration::from_millis(window_ms), k).unwrap();
        let admitted = replay(policy, &arrivals);
        let bound = limit + limit / u64::from(k);
        for &(start, _) in &admitted {
            let in_window: u64 = admitted.iter()
                .filter(|(t, _)| *t >= start && *t < start + window_ms)
                .map(|(_, c)| c)
                .sum();
            prop_assert!(in_window <= bound, "k = {k}: {in_window} > {bound} from {start}");
        }
    }

    #[test]
    fn fixed_window_never_exceeds_the_limit_in_one_window(arrivals in arrivals(), limit in 1u64..20) {
        let admitted = replay(Policy::fixed_window("f", limit, Duration::from_millis(WINDOW_MS)).unwrap(), &arrivals);
        let mut per_window = std::collections::HashMap::<u64, u64>::new();
        for (t, c) in admitted {
            *per_window.entry(t / WINDOW_MS).or_default() += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
    }

    #[test]
    fn buckets_never_exceed_capacity_plus_refill(arrivals in arrivals(), capacity in 1u64..20, per_second in 1u64..20) {
        for policy in [
            Policy::token_bucket("t", capacity, Rate::per_second(per_second)).unwrap(),
            Policy::gcra("g", Rate::per_second(per_second), capacity).unwrap(),
            Policy::leaky_bucket("p", capacity, Rate::per_second(per_second)).unwrap(),
        ] {
            let admitted = replay(policy, &arrivals);
            for (i, &(start, _)) in admitted.iter().enumerate() {
                let mut spent = 0;
                for &(t, c) in &admitted[i..] {
                    spent += c;
                    let allowance = capacity + per_second * (t - start) / 1000;
                    prop_assert!(spent <= allowance, "{spent} > {allowance} over [{start}, {t}]");
                }
            }
        }
    }

    #[test]
    fn retry_after_is_exact(arrivals in arrivals(), limit in 1u64..10) {
        let window = Duration::from_millis(WINDOW_MS);
        for policy in [
            Policy::fixed_window("f", limit, window).unwrap(),
            Policy::sliding_log("l", limit, window).unwrap(),
            Policy::sliding_window("s", limit, window).unwrap(),
            Policy::sliding_window_split("s4", limit, window, 4).unwrap(),
            Policy::sliding_window_split("s10", limit, window, 10).unwrap(),
            Policy::token_bucket("t", limit, Rate::per_second(limit)).unwrap(),
            Policy::gcra("g", Rate::per_second(limit), limit).unwrap(),
        ] {
            let name = policy.name().to_owned();
            let clock = ManualClock::new();
            let store = MemoryStore::builder().clock(clock.clone()).build();
            let policies = PolicySet::from(policy);
            let mut now = Duration::ZERO;
            for &(gap, cost) in &arrivals {
                now += Duration::from_millis(gap);
                clock.set(now);
                let cost = cost.min(limit);
                let decision = store.check("k", &policies, cost);
                if let Some(wait) = decision.retry_after() {
                    prop_assert!(wait > Duration::ZERO, "{name}");
                    // One nanosecond early is still too early...
                    clock.set(now + wait - Duration::from_nanos(1));
                    prop_assert!(!store.check("k", &policies, cost).is_allowed(), "{name}: early by 1ns was admitted");
                    // ...and on time is admitted.
                    now += wait;
                    clock.set(now);
                    prop_assert!(store.check("k", &policies, cost).is_allowed(), "{name}: denied after {wait:?}");
                }
                let status = decision.statuses()[0];
                prop_assert!(status.remaining <= status.limit);
            }
        }
    }
}
