//! Interleaved A/B timing of tollgate against governor, for a ratio that survives a noisy
//! machine: both run in alternating slices of the same process, and the median
//! nanoseconds per decision of each, and their ratio, are printed.
//!
//! Keys are visited round robin, in insertion order and, at 1M keys, also in a shuffled
//! order. Memory laid out in insertion order (tollgate's slab of entries, governor's heap
//! copies of the keys, the benchmark's own key strings) is walked sequentially in the
//! first, which the hardware prefetcher rewards; real traffic does not arrive in
//! insertion order, so at 1M keys the shuffled rows are the ones to read.
//!
//! `cargo bench --bench compare`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::{Quota, RateLimiter};
use tollgate::clock::{Clock, MonotonicClock, TscClock};
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

/// A fixed shuffle of `0..n` (Fisher-Yates with xorshift64*), the same every run.
fn shuffled(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for i in (1..n).rev() {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let j = (state.wrapping_mul(0x2545_f491_4f6c_dd1d) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Limits no visit reaches: every decision admits, on both sides (at 1,000 a second a
/// key of 10,000 visited this fast was denied about half the time).
const LIMIT: u64 = 1_000_000_000;

/// Times tollgate on `store` against a fresh governor keyed GCRA over `keys`, in
/// alternating slices, and prints one row. Both are filled in the order of `keys` first,
/// then visit them in the order of `order` (`None`: the same order).
fn compare<C: Clock>(
    label: &str,
    store: MemoryStore<C>,
    set: &PolicySet,
    keys: &[String],
    order: Option<&[usize]>,
) {
    let key_count = keys.len();
    let quota = Quota::per_second(NonZeroU32::new(LIMIT as u32).unwrap())
        .allow_burst(NonZeroU32::new(LIMIT as u32).unwrap());
    let governor = RateLimiter::<String, _, _>::keyed(quota);
    for key in keys {
        black_box(store.check(key, set, 1).is_allowed());
        black_box(governor.check_key(key).is_ok());
    }
    let visit: Vec<&String> = match order {
        Some(order) => order.iter().map(|&i| &keys[i]).collect(),
        None => keys.iter().collect(),
    };
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    for round in 0..ROUNDS {
        let mut run_ours = || {
            slice(|| {
                i = (i + 1) % key_count;
                black_box(store.check(visit[i], set, 1).is_allowed());
            })
        };
        let mut run_theirs = || {
            slice(|| {
                j = (j + 1) % key_count;
                black_box(governor.check_key(visit[j]).is_ok());
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
        // The first round warms the caches; it is not counted.
        if round > 0 {
            ours.push(a);
            theirs.push(b);
            ratios.push(a / b);
        }
    }
    let order = if order.is_some() {
        "shuffled"
    } else {
        "inserted"
    };
    println!(
        "| {key_count} | {order} | {label} | {:.1} | {:.1} | {:.2} |",
        median(&mut ours),
        median(&mut theirs),
        median(&mut ratios)
    );
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument filters nothing here.
    println!(
        "| keys | order | tollgate algorithm, clock | tollgate ns | governor ns | tollgate / governor |"
    );
    println!("|---|---|---|---|---|---|");
    for key_count in [10_000usize, 1_000_000] {
        let keys: Vec<String> = (0..key_count).map(|i| format!("user:{i:08}")).collect();
        let shuffle = shuffled(key_count);
        let orders = if key_count >= 1_000_000 {
            vec![None, Some(shuffle.as_slice())]
        } else {
            vec![None]
        };
        for order in orders {
            for policy in [
                Policy::token_bucket("token_bucket", LIMIT, Rate::per_second(LIMIT)).unwrap(),
                Policy::gcra("gcra", Rate::per_second(LIMIT), LIMIT).unwrap(),
            ] {
                let name = policy.name().to_owned();
                let set = PolicySet::from(policy);
                let builder = || MemoryStore::builder().max_keys(2 * key_count);
                // The default clock (the OS clock carried by the TSC), the OS clock read
                // every time, then the opt-in TSC clock, which is what governor reads
                // (quanta).
                compare(
                    &format!("{name}, carried (default)"),
                    builder().build(),
                    &set,
                    &keys,
                    order,
                );
                compare(
                    &format!("{name}, monotonic"),
                    builder().clock(MonotonicClock::new()).build(),
                    &set,
                    &keys,
                    order,
                );
                compare(
                    &format!("{name}, TSC (opt-in)"),
                    builder().clock(TscClock::new()).build(),
                    &set,
                    &keys,
                    order,
                );
            }
        }
    }
}
