//! Resident memory per identity: governor's keyed limiter against tollgate's `MemoryStore`.
//!
//! ```text
//! cargo run --release --example memory_per_identity [-- COUNT ...]
//! ```
//!
//! Each subject is measured in a fresh child process of this same binary (this program
//! runs itself again with the subject's name), so neither inherits the other's heap. The
//! child reads its resident memory (`VmRSS` in /proc/self/status), builds the limiter,
//! makes one decision for each of COUNT identities `user:0`, `user:1`, ... (so each is
//! stored), reads `VmRSS` again and prints the growth divided by COUNT. governor is
//! `RateLimiter::keyed(Quota::per_second(5).allow_burst(10))` with `check_key`; tollgate
//! is a `MemoryStore` (default shards) with `Policy::token_bucket("api", 10,
//! Rate::per_second(5))` and `max_keys` twice COUNT, so none is evicted.
//!
//! Hash tables double, so the figure depends on where COUNT falls between two doublings:
//! the default counts are 1,000,000 and 2,000,000 (just past a doubling for both, on two
//! cores) and 1,500,000 (in between).
//!
//! Linux only (it reads /proc).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::process::Command;

use governor::{Quota, RateLimiter};
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

const SUBJECTS: [&str; 2] = ["governor", "tollgate"];
const DEFAULT_COUNTS: [usize; 3] = [1_000_000, 1_500_000, 2_000_000];

/// This process's resident memory in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status (this example runs on Linux only)");
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .expect("a VmRSS line in /proc/self/status");
    line.trim()
        .strip_suffix("kB")
        .and_then(|kib| kib.trim().parse().ok())
        .unwrap_or_else(|| panic!("VmRSS is not in kB: {line:?}"))
}

/// The child: fills one subject with `count` identities, prints the bytes per identity.
fn measure(subject: &str, count: usize) {
    let mut key = String::with_capacity(32);
    let mut name = |i: usize| {
        use std::fmt::Write;
        key.clear();
        write!(key, "user:{i}").expect("writing to a String");
        key.clone()
    };
    let grown_kib = match subject {
        "governor" => {
            let quota = Quota::per_second(NonZeroU32::new(5).unwrap())
                .allow_burst(NonZeroU32::new(10).unwrap());
            let limiter = RateLimiter::<String, _, _>::keyed(quota);
            let before = resident_kib();
            for i in 0..count {
                assert!(limiter.check_key(&name(i)).is_ok());
            }
            let grown = resident_kib().saturating_sub(before);
            assert_eq!(limiter.len(), count);
            black_box(&limiter);
            grown
        }
        "tollgate" => {
            let policies = PolicySet::from(
                Policy::token_bucket("api", 10, Rate::per_second(5)).expect("a valid policy"),
            );
            let store = MemoryStore::builder().max_keys(2 * count).build();
            let before = resident_kib();
            for i in 0..count {
                assert!(store.check(&name(i), &policies, 1).is_allowed());
            }
            let grown = resident_kib().saturating_sub(before);
            assert_eq!(store.len(), count);
            assert_eq!(store.evicted_live(), 0);
            black_box(&store);
            grown
        }
        other => panic!("unknown subject {other:?} (governor or tollgate)"),
    };
    println!("{}", grown_kib as f64 * 1024.0 / count as f64);
}

/// Runs this binary again to measure one subject in a fresh process.
fn child(subject: &str, count: usize) -> f64 {
    let output = Command::new(std::env::current_exe().expect("this program's path"))
        .args(["--measure", subject, &count.to_string()])
        .output()
        .expect("running this program again");
    assert!(
        output.status.success(),
        "measuring {subject}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("the child prints bytes per identity")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, subject, count] = args.as_slice()
        && flag == "--measure"
    {
        measure(subject, count.parse().expect("a count of identities"));
        return;
    }
    let counts: Vec<usize> = if args.is_empty() {
        DEFAULT_COUNTS.to_vec()
    } else {
        args.iter()
            .map(|count| count.parse().expect("counts of identities"))
            .collect()
    };
    println!("| identities | governor bytes | tollgate bytes | tollgate / governor |");
    println!("|---|---|---|---|");
    for count in counts {
        let [governor, tollgate] = SUBJECTS.map(|subject| child(subject, count));
        println!(
            "| {count} | {governor:.1} | {tollgate:.1} | {:.2} |",
            tollgate / governor
        );
    }
}
