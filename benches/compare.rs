//! Interleaved A/B timing of tollgate against governor, for a ratio that survives a noisy
//! machine: both run in alternating slices of the same process, and the median
//! nanoseconds per decision of each, and their ratio, are printed.
//!
//! `cargo bench --bench compare`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::{Quota, RateLimiter};
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

fn main() {
    // `cargo bench` passes `--bench`; any other argument filters nothing here.
    println!("| keys | algorithm | tollgate ns | governor ns | tollgate / governor |");
    println!("|---|---|---|---|---|");
    for key_count in [10_000usize, 1_000_000] {
        let keys: Vec<String> = (0..key_count).map(|i| format!("user:{i:08}")).collect();
        for policy in [
            Policy::token_bucket("token_bucket", 1000, Rate::per_second(1000)).unwrap(),
            Policy::gcra("gcra", Rate::per_second(1000), 1000).unwrap(),
        ] {
            let name = policy.name().to_owned();
            let set = PolicySet::from(policy);
            let store = MemoryStore::builder().max_keys(2 * key_count).build();
            let quota = Quota::per_second(NonZeroU32::new(1000).unwrap())
                .allow_burst(NonZeroU32::new(1000).unwrap());
            let governor = RateLimiter::<String, _, _>::keyed(quota);
            let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            let (mut i, mut j) = (0, 0);
            for round in 0..ROUNDS {
                // Alternate which goes first, so neither always runs on a warmer cache.
                let mut run_ours = || {
                    slice(|| {
                        i = (i + 1) % key_count;
                        black_box(store.check(&keys[i], &set, 1).is_allowed());
                    })
                };
                let (a, b);
                if round % 2 == 0 {
                    a = run_ours();
                    b = slice(|| {
                        j = (j + 1) % key_count;
                        black_box(governor.check_key(&keys[j]).is_ok());
                    });
                } else {
                    b = slice(|| {
                        j = (j + 1) % key_count;
                        black_box(governor.check_key(&keys[j]).is_ok());
                    });
                    a = run_ours();
                }
                // The first round of each fills the tables; it is not counted.
                if round > 0 {
                    ours.push(a);
                    theirs.push(b);
                    ratios.push(a / b);
                }
            }
            println!(
                "| {key_count} | {name} | {:.1} | {:.1} | {:.2} |",
                median(&mut ours),
                median(&mut theirs),
                median(&mut ratios)
            );
        }
    }
}
