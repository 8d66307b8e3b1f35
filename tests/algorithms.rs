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

/// A counter state at sub-window `index` holding `counts` (oldest first), built the only
/// way a state can be: by admitting units at times in each of its sub-windows.
fn counter_with(algo: &SlidingWindow, index: u64, counts: &[u64]) -> CounterState<Box<[u64]>> {
    let k = algo.sub_windows();
    assert_eq!(counts.len() as u64, k + 1);
    let span = algo.window() / k;
    let mut state = CounterState::<Box<[u64]>>::for_algorithm(algo);
    for (m, &count) in counts.iter().enumerate() {
        let at = (index - k + m as u64) * span;
        algo.refresh(&mut state, at);
        algo.commit(&mut state, at, count);
    }
    assert_eq!((state.index(), state.counts()), (index, counts));
    state
}

#[test]
fn sliding_counter_estimate_matches_the_formula() {
    let w = 1_000_000_000u64;
    let algo = SlidingWindow::new(100, w, 1).unwrap();
    // previous = 40, current = 10, 25% into the window: 40 * 0.75 + 10 = 40.
    let state = counter_with(&algo, 5, &[40, 10]);
    assert_eq!(algo.estimate(&state, 5 * w + w / 4), 40);
    // 30 * 0.5 + 7 = 22; 33 * (1 - 0.3) = 23.1, rounded up to 24, + 0.
    let state = counter_with(&algo, 2, &[30, 7]);
    assert_eq!(algo.estimate(&state, 2 * w + w / 2), 22);
    let state = counter_with(&algo, 2, &[33, 0]);
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
fn split_counter_counts_the_oldest_sub_window_by_its_share_and_forgives_at_most_limit_over_k() {
    // 100 per second in 4 sub-windows of 250 ms.
    let ms = 1_000_000u64;
    let algo = SlidingWindow::new(100, 1_000 * ms, 4).unwrap();
    // Sub-window 4 (1000..1250 ms); counts of sub-windows 0..=4, oldest first.
    let state = counter_with(&algo, 4, &[8, 10, 20, 30, 5]);
    // 40% into sub-window 4: the oldest counts 8 * 0.6 = 4.8 -> 5; it may forgive at most
    // 100 / 4 = 25 of 8, so 5 stands: 5 + 10 + 20 + 30 + 5 = 70.
    assert_eq!(algo.estimate(&state, 1_100 * ms), 70);
    // An oldest sub-window of 60 at 40%: 60 * 0.6 = 36 (forgives 24, within 25).
    let mut state = counter_with(&algo, 4, &[60, 0, 0, 10, 5]);
    assert_eq!(algo.estimate(&state, 1_100 * ms), 36 + 15);
    // At 90%: 60 * 0.1 = 6 would forgive 54, but at most 25 may be: 35.
    assert_eq!(algo.estimate(&state, 1_225 * ms), 35 + 15);
    // Rolling two sub-windows on shifts the counts, oldest first, and zeroes the new ones.
    algo.refresh(&mut state, 1_500 * ms);
    assert_eq!((state.index(), state.counts()), (6, &[0, 10, 5, 0, 0][..]));
    // With one sub-window it is the classic two counters: the store (which keeps them
    // inline) decides as the boxed state does.
    let classic = SlidingWindow::new(100, 1_000 * ms, 1).unwrap();
    let h = Harness::new(Policy::sliding_window("classic", 100, SECOND).unwrap());
    let mut ring = CounterState::<Box<[u64]>>::for_algorithm(&classic);
    for (at, cost) in [(100, 30), (900, 50), (1_300, 10), (1_700, 40), (2_050, 5)] {
        let now = at * ms;
        classic.refresh(&mut ring, now);
        let admitted = matches!(
            classic.check(&ring, now, cost),
            tollgate::algorithm::Verdict::Admit { .. }
        );
        let decision = h.at(Duration::from_nanos(now)).check(cost);
        assert_eq!(admitted, decision.is_allowed(), "at {at} ms");
        if admitted {
            classic.commit(&mut ring, now, cost);
        }
        assert_eq!(
            classic.snapshot(&ring, now).remaining,
            decision.statuses()[0].remaining
        );
    }
}

#[test]
fn split_counter_effective_window_is_when_one_more_unit_fits_after_spending_the_rest() {
    let ms = 1_000_000u64;
    for sub_windows in [1, 2, 4, 10] {
        let algo = SlidingWindow::new(20, 1_000 * ms, sub_windows).unwrap();
        let mut state = CounterState::<Box<[u64]>>::for_algorithm(&algo);
        let mut now = 0;
        for step in 0..200u64 {
            now += (step * 7_919 % 97) * ms;
            algo.refresh(&mut state, now);
            if matches!(
                algo.check(&state, now, 1),
                tollgate::algorithm::Verdict::Admit { .. }
            ) {
                algo.commit(&mut state, now, 1 + step % 3 % 2);
            }
            let remaining = algo.snapshot(&state, now).remaining;
            let effective = algo.effective_window(&state, now, remaining);
            // Spend the rest on a copy, then ask when one unit fits.
            let mut spent = state.clone();
            algo.commit(&mut spent, now, remaining);
            let expected = match algo.check(&spent, now, 1) {
                tollgate::algorithm::Verdict::Deny { retry_after } => retry_after,
                _ => 0,
            };
            assert_eq!(effective, expected, "k = {sub_windows}, step {step}");
            assert!(
                effective > 0,
                "k = {sub_windows}: the rest is spent, so one more waits"
            );
        }
    }
}

#[test]
fn bucket_and_gcra_effective_windows_match_spending_the_rest_then_asking_for_one() {
    use tollgate::algorithm::{BucketState, Gcra, GcraState, TokenBucket, Verdict};
    let ms = 1_000_000u64;
    let wait = |verdict| match verdict {
        Verdict::Deny { retry_after } => retry_after,
        _ => 0,
    };
    for (capacity, amount, period) in [(10, 5, 1_000 * ms), (4, 3, 10_000 * ms), (1, 1, ms)] {
        let bucket = TokenBucket::new(capacity, amount, period).unwrap();
        let gcra = Gcra::new(capacity, amount, period).unwrap();
        let (mut b, mut g) = (BucketState::default(), GcraState::default());
        let mut now = 0;
        for step in 0..300u64 {
            now += (step * 7_919 % 211) * ms;
            bucket.refresh(&mut b, now);
            if matches!(bucket.check(&b, now, 1), Verdict::Admit { .. }) {
                bucket.commit(&mut b, now, 1);
            }
            if matches!(gcra.check(&g, now, 1), Verdict::Admit { .. }) {
                gcra.commit(&mut g, now, 1);
            }
            let remaining = bucket.snapshot(&b, now).remaining;
            let mut spent = b;
            bucket.commit(&mut spent, now, remaining);
            assert_eq!(
                bucket.effective_window(&b, now, remaining),
                wait(bucket.check(&spent, now, 1)),
                "bucket {capacity}/{amount}, step {step}"
            );
            let remaining = gcra.snapshot(&g, now).remaining;
            let mut spent = g;
            gcra.commit(&mut spent, now, remaining);
            assert_eq!(
                gcra.effective_window(&g, now, remaining),
                wait(gcra.check(&spent, now, 1)),
                "gcra {capacity}/{amount}, step {step}"
            );
        }
    }
}

#[test]
fn split_counter_waits_stay_exact_when_time_steps_back() {
    use tollgate::algorithm::Verdict;
    let ms = 1_000_000u64;
    // Sub-windows of 10 ms; the state is at sub-window 5 (50..60 ms) with 10 in it.
    let algo = SlidingWindow::new(10, 20 * ms, 2).unwrap();
    let state = counter_with(&algo, 5, &[0, 0, 10]);
    // At 30 ms (behind the state): the 10 are the oldest in 70..80 ms, where at most
    // 10 / 2 = 5 may be forgiven and the share drops below 10 after 71 ms.
    let Verdict::Deny { retry_after } = algo.check(&state, 30 * ms, 1) else {
        panic!("the state is full");
    };
    assert_eq!(retry_after, 41 * ms);
    for (at, admitted) in [(71 * ms - 1, false), (71 * ms, true)] {
        let mut later = state.clone();
        algo.refresh(&mut later, at);
        assert_eq!(
            matches!(algo.check(&later, at, 1), Verdict::Admit { .. }),
            admitted,
            "at {at} ns"
        );
    }
    // The state stays fresh-until its last count stops counting: 80 ms.
    assert_eq!(algo.snapshot(&state, 30 * ms).fresh_at, 80 * ms);
}

#[test]
fn split_counter_parameters_are_checked_when_built() {
    let minute = Duration::from_secs(60);
    assert!(Policy::sliding_window_split("a", 100, minute, 1).is_ok());
    assert!(Policy::sliding_window_split("a", 100, minute, 64).is_ok());
    for (k, window) in [
        (0, minute),
        (65, minute),
        // 1 s in 7 sub-windows is not whole microseconds.
        (7, SECOND),
        // 1 ms in 3: 333.3 microseconds.
        (3, Duration::from_millis(1)),
    ] {
        let error = Policy::sliding_window_split("a", 100, window, k).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("sub-windows") && message.contains(&k.to_string()),
            "{message}"
        );
    }
    // The sub-windows survive scaling for a replica's share.
    let split = Policy::sliding_window_split("a", 90, minute, 6).unwrap();
    assert!(matches!(
        tollgate::LocalFallback::new()
            .share(1.0 / 3.0)
            .policies_for(&PolicySet::from(split))[0]
            .algorithm(),
        tollgate::Algorithm::SlidingWindow {
            limit: 30,
            sub_windows: 6,
            ..
        }
    ));
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

/// A costly request to a full sliding log reads at most 256 of its entries: within them
/// its wait is exact, past them an upper bound (each entry beyond holds a unit at least),
/// and coming back after that wait it fits. Entries of 1 to 3 units, 1 ms apart.
#[test]
fn a_costly_request_to_a_long_log_waits_no_less_than_it_must_and_then_fits() {
    const LIMIT: u64 = 3_000;
    let window = Duration::from_secs(3_600);
    let policy = Policy::sliding_log("l", LIMIT, window).unwrap();
    for cost in [2, 500, 1_200, LIMIT] {
        let h = Harness::new(policy.clone());
        // (time, units) of each entry, oldest first, until the log is full.
        let mut entries = Vec::new();
        let mut total = 0;
        let mut t = Duration::ZERO;
        while total < LIMIT {
            t += Duration::from_millis(1);
            let units = (1 + entries.len() as u64 % 3).min(LIMIT - total);
            assert!(h.at(t).check(units).is_allowed());
            entries.push((t, units));
            total += units;
        }
        let now = t + Duration::from_secs(1);
        let decision = h.at(now).check(cost);
        let wait = decision.retry_after().expect("a full log denies");
        // The exact wait: until the entries that free `cost` units have all left.
        let mut freed = 0;
        let (last, _) = *entries
            .iter()
            .find(|(_, units)| {
                freed += units;
                freed >= cost
            })
            .unwrap();
        let exact = last + window - now;
        assert!(wait >= exact, "cost {cost}: {wait:?} < {exact:?}");
        let within = entries
            .iter()
            .take(256)
            .map(|(_, units)| units)
            .sum::<u64>()
            >= cost;
        if within {
            assert_eq!(wait, exact, "cost {cost}: within the entries read");
        } else if cost < LIMIT {
            // (At the limit the bound is the newest entry: exact again.)
            assert!(wait > exact, "cost {cost}: past them, an upper bound");
        }
        if within {
            let early = h.at(now + wait - Duration::from_nanos(1)).check(cost);
            assert!(!early.is_allowed(), "cost {cost}: not a moment before");
        }
        assert!(
            h.at(now + wait).check(cost).is_allowed(),
            "cost {cost} fits after {wait:?}"
        );
    }
}

/// A policy keeps its durations in whole microseconds (the unit Redis counts in): it
/// reports them so, and two policies built from durations that round alike decide alike,
/// so they are one policy, with one state in a store.
#[test]
fn a_policy_reports_the_durations_it_decides_with() {
    let third = Duration::from_secs(1) / 3;
    let a = Policy::fixed_window("f", 2, third).unwrap();
    let b = Policy::fixed_window("f", 2, Duration::from_nanos(333_333_900)).unwrap();
    assert_eq!(
        a.algorithm(),
        tollgate::Algorithm::FixedWindow {
            limit: 2,
            window: Duration::from_micros(333_334)
        }
    );
    assert_eq!(a, b);
    let shaping = Policy::leaky_bucket_shaping("s", Rate::new(1, third), third).unwrap();
    assert_eq!(
        shaping.algorithm(),
        tollgate::Algorithm::LeakyShaping {
            leak: Rate::new(1, Duration::from_micros(333_334)),
            // A bound: rounded down.
            max_delay: Duration::from_micros(333_333),
        }
    );
    let store = MemoryStore::builder().clock(ManualClock::new()).build();
    assert!(store.check("k", &PolicySet::from(a), 2).is_allowed());
    assert!(
        !store.check("k", &PolicySet::from(b), 1).is_allowed(),
        "one policy, one state"
    );
}

/// `LocalFallback::share(0.0)` (an integer `1 / replicas`, say), a negative share or NaN
/// gave every replica the whole limit during an outage, silently. No share is right for
/// it (a vanishing one would stretch every rate to years): a layer with it is refused
/// when it is built, naming the value, without a panic where the share is given. Above 1
/// is 1.
#[test]
fn a_fallback_share_of_zero_is_refused_not_the_whole_limit() {
    let set = PolicySet::from(Policy::token_bucket("api", 30, Rate::per_second(30)).unwrap());
    for share in [0.0, -1.0, f64::NAN, f64::NEG_INFINITY] {
        let layer = tollgate::RateLimitLayer::new(MemoryStore::new())
            .policies(set.clone())
            .on_store_error(tollgate::FailureMode::Fallback(
                tollgate::LocalFallback::new().share(share),
            ));
        let error = layer.validate().unwrap_err();
        assert!(error.contains("share must be above 0"), "{share}: {error}");
    }
    let fine = tollgate::RateLimitLayer::new(MemoryStore::new())
        .policies(set.clone())
        .on_store_error(tollgate::FailureMode::Fallback(
            tollgate::LocalFallback::new().share(0.5),
        ));
    assert!(fine.validate().is_ok());
    let whole = tollgate::LocalFallback::new()
        .share(f64::INFINITY)
        .policies_for(&set);
    assert_eq!(whole.policies()[0].limit(), 30);
}

/// A replica's share of a quota is the quota times the share, rounded up only when it is
/// not whole: the double nearest 0.07 is a hair above it, and 100 times it was rounded up
/// to 8 where 7 is the share. A share below one millionth (which stretches a rate of 100
/// a second to one request in days) is refused when the layer is built, as 0 is.
#[test]
fn a_fallback_share_of_a_quota_is_rounded_up_only_when_it_is_not_whole() {
    for (share, limit, expected) in [
        (0.07, 100, 7),
        (0.07, 101, 8),
        (1.0 / 75.0, 525, 7),
        (1.0 / 3.0, 30, 10),
        (1.0 / 3.0, 31, 11),
        (0.25, 10, 3),
    ] {
        let set =
            PolicySet::from(Policy::fixed_window("api", limit, Duration::from_secs(60)).unwrap());
        let scaled = tollgate::LocalFallback::new()
            .share(share)
            .policies_for(&set);
        assert_eq!(scaled[0].limit(), expected, "{share} of {limit}");
    }
    let set = PolicySet::from(Policy::token_bucket("api", 100, Rate::per_second(100)).unwrap());
    for share in [1e-7, 1e-300, 5e-324] {
        let layer = tollgate::RateLimitLayer::new(MemoryStore::new())
            .policies(set.clone())
            .on_store_error(tollgate::FailureMode::Fallback(
                tollgate::LocalFallback::new().share(share),
            ));
        let error = layer.validate().unwrap_err();
        assert!(error.contains("one millionth"), "{share}: {error}");
    }
    let million = tollgate::RateLimitLayer::new(MemoryStore::new())
        .policies(set)
        .on_store_error(tollgate::FailureMode::Fallback(
            tollgate::LocalFallback::new().share(1e-6),
        ));
    assert!(million.validate().is_ok());
}

/// A rate faster than one unit a millisecond is kept in lowest terms with a period
/// under the shortest a policy takes (10,000 a second is one per 100 µs): stretched by
/// the share alone it was refused when built, and the fallback enforced the whole,
/// unscaled policy on every replica, silently (four replicas admitted four times the
/// limit while the store was away). Its quota and its rate are the share's now.
#[test]
fn a_fast_rate_is_scaled_to_the_fallbacks_share() {
    for (per_second, share, capacity) in [
        (10_000, 0.25, 20_000),
        (5_000, 0.2, 5_000),
        (2_000, 0.9, 4_000),
        (1_000_000, 0.5, 1_000_000),
        (999_999, 0.25, 1_000_000),
        (500_000, 0.5, 1_000_000),
        (125_000, 0.5, 1_000_000),
    ] {
        let set = PolicySet::from(
            Policy::token_bucket("api", capacity, Rate::per_second(per_second)).unwrap(),
        );
        let scaled = tollgate::LocalFallback::new()
            .share(share)
            .policies_for(&set);
        let quota = (capacity as f64 * share).ceil() as u64;
        assert_eq!(scaled[0].limit(), quota, "{per_second}/s at {share}");
        // Spent, then half a second's refill.
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        assert!(store.check("k", &scaled, quota).is_allowed());
        clock.advance(Duration::from_millis(500));
        let refilled = store.check("k", &scaled, 0).statuses()[0].remaining;
        let expected = per_second as f64 * share / 2.0;
        assert!(
            (refilled as f64 - expected).abs() <= 1.0,
            "{per_second}/s at {share}: {refilled} refilled in 0.5 s, {expected} expected"
        );
    }
    // The fastest rates a policy takes, decided at 1, 2 or 8 µs a unit: the amount grows
    // to the rate's as written, and no further (a float's ceiling went one past it, over
    // `MAX_LIMIT`, and the policy was refused when scaled).
    for amount in [
        999_999_999_999_000,
        999_999_999_999_500,
        999_999_999_999_875,
    ] {
        let set = PolicySet::from(
            Policy::token_bucket("api", 10, Rate::new(amount, Duration::from_millis(1))).unwrap(),
        );
        let scaled = tollgate::LocalFallback::new().share(0.5).policies_for(&set);
        assert_eq!(scaled[0].limit(), 5, "{amount}");
        assert_ne!(
            scaled[0].algorithm(),
            set[0].algorithm(),
            "{amount}: scaled"
        );
    }
}

/// The fixed window read at a clock behind the window its state counts in (another
/// thread's reading, a step back): a denial waits for the end of the window that holds
/// the count, and the state says it is fresh then. It stated the end of the earlier
/// window (1 s where 61 s), and a store that forgets fresh states would have forgotten
/// the count a minute early.
#[test]
fn a_fixed_window_read_behind_its_state_waits_for_the_window_it_counts() {
    use tollgate::algorithm::{FixedWindow, Verdict, WindowState};
    let second = 1_000_000_000u64;
    let window = FixedWindow::new(1, 60 * second).unwrap();
    let mut state = WindowState::default();
    window.refresh(&mut state, 300 * second);
    window.commit(&mut state, 300 * second, 1);
    let early = 299 * second;
    window.refresh(&mut state, early);
    assert_eq!(
        window.check(&state, early, 1),
        Verdict::Deny {
            retry_after: 61 * second
        }
    );
    let snapshot = window.snapshot(&state, early);
    assert_eq!(snapshot.reset, 61 * second);
    assert_eq!(snapshot.fresh_at, 360 * second);
    assert_eq!(window.effective_window(&state, early, 0), 61 * second);
}

/// A token bucket read at a clock behind its state's time (another thread's reading):
/// the state is fresh once the bucket is full, counted from the state's own time. It was
/// counted from the earlier reading, and a store that forgets fresh states one by one
/// could forget the missing tokens that much early.
#[test]
fn a_token_bucket_read_behind_its_state_is_fresh_when_it_is_full() {
    use tollgate::algorithm::{BucketState, TokenBucket};
    let second = 1_000_000_000u64;
    let bucket = TokenBucket::new(10, 1, second).unwrap();
    let mut state = BucketState::default();
    bucket.refresh(&mut state, 10 * second);
    bucket.commit(&mut state, 10 * second, 5);
    let early = 9 * second;
    bucket.refresh(&mut state, early);
    let snapshot = bucket.snapshot(&state, early);
    assert_eq!(snapshot.remaining, 5);
    assert_eq!(
        snapshot.fresh_at,
        15 * second,
        "full 5 s after the state's time"
    );
}

/// The algorithms are public, and their constructors took any count and time: a sliding
/// log of `u64::MAX` units overflowed its total (a panic in a debug build; in a release
/// build the total wrapped to 0 and the log admitted without bound), as did a bucket's
/// or GCRA's 128-bit level. They take the policies' bounds now, and at those bounds
/// nothing overflows, however much is committed.
#[test]
fn the_algorithms_refuse_parameters_past_the_policies_bounds() {
    use tollgate::algorithm::{
        FixedWindow, Gcra, InFlight, LeakyShape, LogState, MAX_NANOS, MAX_UNITS, PenaltyBox,
        SlidingLog, TokenBucket, Verdict,
    };
    let second = 1_000_000_000;
    assert!(SlidingLog::new(u64::MAX, second).is_none());
    assert!(SlidingLog::new(1, MAX_NANOS + 1).is_none());
    assert!(FixedWindow::new(MAX_UNITS + 1, second).is_none());
    assert!(TokenBucket::new(u64::MAX, 1, u64::MAX).is_none());
    assert!(TokenBucket::new(10, MAX_UNITS + 1, second).is_none());
    assert!(Gcra::new(u64::MAX, u64::MAX, u64::MAX).is_none());
    assert!(LeakyShape::new(1, second, MAX_NANOS + 1).is_none());
    assert!(InFlight::new(MAX_UNITS + 1, second).is_none());
    assert!(PenaltyBox::new(3, second, second, MAX_NANOS + 1).is_none());
    assert!(SlidingWindow::new(MAX_UNITS + 1, second, 1).is_none());

    // At the bounds, commits past the limit (a settle's charge) saturate.
    let log = SlidingLog::new(MAX_UNITS, MAX_NANOS).unwrap();
    let mut state = LogState::default();
    log.commit(&mut state, 1, MAX_UNITS);
    log.commit(&mut state, 2, u64::MAX);
    log.commit(&mut state, 3, u64::MAX);
    assert!(matches!(log.check(&state, 4, 1), Verdict::Deny { .. }));
    let _ = log.effective_window(&state, 4, 0);
    let mut refunded = state.clone();
    log.refund(&mut refunded, 4, u64::MAX, u64::MAX, None);
    log.refund(&mut refunded, 4, u64::MAX, u64::MAX, None);
    log.refresh(&mut state, 3 + MAX_NANOS);
    assert!(matches!(
        log.check(&state, 3 + MAX_NANOS, 1),
        Verdict::Admit { .. }
    ));
    let bucket = TokenBucket::new(MAX_UNITS, MAX_UNITS, MAX_NANOS).unwrap();
    let mut state = Default::default();
    for _ in 0..100 {
        bucket.commit(&mut state, 1, u64::MAX);
    }
    assert!(matches!(bucket.check(&state, 1, 1), Verdict::Deny { .. }));
    assert!(bucket.effective_window(&state, 1, 0) > 0);
    bucket.refund(&mut state, 1, u64::MAX, u64::MAX, None);
    bucket.refresh(&mut state, u64::MAX);
    let gcra = Gcra::new(MAX_UNITS, MAX_UNITS, MAX_NANOS).unwrap();
    let mut state = Default::default();
    for _ in 0..100 {
        gcra.commit(&mut state, 1, u64::MAX);
    }
    assert!(matches!(gcra.check(&state, 1, 1), Verdict::Deny { .. }));
    assert!(gcra.effective_window(&state, 1, 0) > 0);
    gcra.refund(&mut state, 1, u64::MAX, u64::MAX, None);
}
