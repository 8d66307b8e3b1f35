//! Nanoseconds per decision: every tollgate algorithm on the in-process store, side by
//! side with governor's keyed GCRA (`check_key`) in the same run, over 10k and 1M string
//! keys visited round-robin.
//!
//! `cargo bench --bench decisions`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

/// Limits no visit reaches, so every decision admits, as on a healthy service (at 1,000
/// a second, a key of 10,000 visited round robin this fast was denied about half the
/// time: the rows compared mixes of admissions and denials).
const LIMIT: u64 = 1_000_000_000;

fn keys(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("user:{i:08}")).collect()
}

fn policies() -> Vec<Policy> {
    let window = Duration::from_secs(1);
    vec![
        Policy::token_bucket("token_bucket", LIMIT, Rate::per_second(LIMIT)).unwrap(),
        Policy::gcra("gcra", Rate::per_second(LIMIT), LIMIT).unwrap(),
        Policy::fixed_window("fixed_window", LIMIT, window).unwrap(),
        Policy::sliding_window("sliding_window", LIMIT, window).unwrap(),
        Policy::sliding_window_split("sliding_window_k10", LIMIT, window, 10).unwrap(),
        // The log keeps one entry per admitted instant: a limit of 100 over 10 ms keeps
        // the logs short (a key of 10,000 is visited about 20 times in 10 ms), and 1M
        // keys in memory on a small machine, while every visit is admitted.
        Policy::sliding_log("sliding_log", 100, Duration::from_millis(10)).unwrap(),
        Policy::leaky_bucket("leaky_bucket", LIMIT, Rate::per_second(LIMIT)).unwrap(),
    ]
}

fn decisions(c: &mut Criterion) {
    for key_count in [10_000usize, 1_000_000] {
        let keys = keys(key_count);
        let mut group = c.benchmark_group(format!("decide/{key_count}_keys"));
        group.throughput(Throughput::Elements(1));

        let quota = Quota::per_second(NonZeroU32::new(LIMIT as u32).unwrap())
            .allow_burst(NonZeroU32::new(LIMIT as u32).unwrap());
        let governor = RateLimiter::<String, _, _>::keyed(quota);
        let mut i = 0;
        group.bench_function(BenchmarkId::new("governor", "gcra"), |b| {
            b.iter(|| {
                i = (i + 1) % key_count;
                black_box(governor.check_key(&keys[i]).is_ok())
            })
        });
        drop(governor);

        for policy in policies() {
            let name = policy.name().to_owned();
            let store = MemoryStore::builder().max_keys(2 * key_count).build();
            let set = PolicySet::from(policy);
            let mut i = 0;
            group.bench_function(BenchmarkId::new("tollgate", &name), |b| {
                b.iter(|| {
                    i = (i + 1) % key_count;
                    black_box(store.check(&keys[i], &set, 1).is_allowed())
                })
            });
        }
        group.finish();
    }
}

/// The clock's share of a decision: the default carried clock, the OS monotonic
/// clock read every time, and the opt-in TSC clock, alone and inside a token-bucket
/// decision over 10k keys.
fn clocks(c: &mut Criterion) {
    use tollgate::clock::{CarriedClock, Clock, MonotonicClock, TscClock};
    let mut group = c.benchmark_group("clock");
    group.throughput(Throughput::Elements(1));
    let carried = CarriedClock::new();
    let monotonic = MonotonicClock::new();
    let tsc = TscClock::new();
    group.bench_function("now/carried (default)", |b| {
        b.iter(|| black_box(carried.now()))
    });
    group.bench_function("now/monotonic", |b| b.iter(|| black_box(monotonic.now())));
    group.bench_function("now/tsc (opt-in)", |b| b.iter(|| black_box(tsc.now())));
    let keys = keys(10_000);
    let set = PolicySet::from(
        Policy::token_bucket("token_bucket", LIMIT, Rate::per_second(LIMIT)).unwrap(),
    );
    let stores = [
        (
            "carried (default)",
            MemoryStore::builder().build().into_dyn(),
        ),
        (
            "monotonic",
            MemoryStore::builder().clock(monotonic).build().into_dyn(),
        ),
        (
            "tsc (opt-in)",
            MemoryStore::builder().clock(tsc).build().into_dyn(),
        ),
    ];
    let mut i = 0;
    for (name, store) in &stores {
        group.bench_function(format!("decide/{name}"), |b| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(store(&keys[i], &set))
            })
        });
    }
    group.finish();
}

/// A store's synchronous check behind one type, whatever its clock.
type Check = Box<dyn Fn(&str, &PolicySet) -> bool>;

trait IntoDyn {
    fn into_dyn(self) -> Check;
}

impl<C: tollgate::clock::Clock> IntoDyn for MemoryStore<C> {
    fn into_dyn(self) -> Check {
        Box::new(move |key, set| self.check(key, set, 1).is_allowed())
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = decisions, clocks
}
criterion_main!(benches);
