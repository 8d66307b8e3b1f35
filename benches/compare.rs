//! Interleaved A/B timing of tollgate against governor, for a ratio that survives a noisy
//! machine: both run in alternating slices of the same process, and the median
//! nanoseconds per decision of each, and their ratio, are printed.
//!
//! `cargo bench --bench compare`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::{Quota, RateLimiter};
use tollgate::clock::{Clock, TscClock};
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

const ROUNDS: usize = 15;
const SLICE: Duration = Duration::from_millis(150);

/// Runs `step` for one slice and returns nanoseconds per call.
fn slice(mut step: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < SLICE {
        for _ in 0..1000 {
            step();
        }
        calls += 1000;
    }
    start.elapsed().as_nanos() as f64 / calls as f64
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Times tollgate on `store` against a fresh governor keyed GCRA over `keys`, in
/// alternating slices, and prints one row.
fn compare<C: Clock>(label: &str, store: MemoryStore<C>, set: &PolicySet, keys: &[String]) {
    let key_count = keys.len();
    let quota = Quota::per_second(NonZeroU32::new(1000).unwrap())
        .allow_burst(NonZeroU32::new(1000).unwrap());
    let governor = RateLimiter::<String, _, _>::keyed(quota);
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    for round in 0..ROUNDS {
        let mut run_ours = || {
            slice(|| {
                i = (i + 1) % key_count;
                black_box(store.check(&keys[i], set, 1).is_allowed());
            })
        };
        let mut run_theirs = || {
            slice(|| {
                j = (j + 1) % key_count;
                black_box(governor.check_key(&keys[j]).is_ok());
            })
        };
        // Alternate which goes first, so neither always runs on a warmer cache.
        let (a, b) = if round % 2 == 0 {
            let a = run_ours();
            (a, run_theirs())
        } else {
            let b = run_theirs();
            (run_ours(), b)
        };
        // The first round of each fills the tables; it is not counted.
        if round > 0 {
            ours.push(a);
            theirs.push(b);
            ratios.push(a / b);
        }
    }
    println!(
        "| {key_count} | {label} | {:.1} | {:.1} | {:.2} |",
        median(&mut ours),
        median(&mut theirs),
        median(&mut ratios)
    );
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument filters nothing here.
    println!(
        "| keys | tollgate algorithm, clock | tollgate ns | governor ns | tollgate / governor |"
    );
    println!("|---|---|---|---|---|");
    for key_count in [10_000usize, 1_000_000] {
        let keys: Vec<String> = (0..key_count).map(|i| format!("user:{i:08}")).collect();
        for policy in [
            Policy::token_bucket("token_bucket", 1000, Rate::per_second(1000)).unwrap(),
            Policy::gcra("gcra", Rate::per_second(1000), 1000).unwrap(),
        ] {
            let name = policy.name().to_owned();
            let set = PolicySet::from(policy);
            let builder = || MemoryStore::builder().max_keys(2 * key_count);
            // The default clock (the OS monotonic clock), then the opt-in TSC clock, which
            // is what governor reads (quanta).
            compare(
                &format!("{name}, monotonic (default)"),
                builder().build(),
                &set,
                &keys,
            );
            compare(
                &format!("{name}, TSC (opt-in)"),
                builder().clock(TscClock::new()).build(),
                &set,
                &keys,
            );
        }
    }
}
