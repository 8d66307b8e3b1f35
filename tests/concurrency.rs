//! Exactness under concurrency: many tasks on several threads, one key, limit L: exactly
//! L admitted, for every algorithm.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

const LIMIT: u64 = 100;
const TASKS: u64 = 64;
const TRIES_PER_TASK: u64 = 10;

fn policies() -> Vec<Policy> {
    let window = Duration::from_secs(60);
    vec![
        Policy::fixed_window("fixed", LIMIT, window).unwrap(),
        Policy::sliding_log("log", LIMIT, window).unwrap(),
        Policy::sliding_window("counter", LIMIT, window).unwrap(),
        Policy::token_bucket("bucket", LIMIT, Rate::per_minute(1)).unwrap(),
        Policy::leaky_bucket("leaky", LIMIT, Rate::per_minute(1)).unwrap(),
        Policy::gcra("gcra", Rate::per_minute(1), LIMIT).unwrap(),
    ]
}

#[test]
fn exactly_the_limit_is_admitted_under_contention() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    for policy in policies() {
        let name = policy.name().to_owned();
        // The clock stands still, so nothing refills: the limit is all there is.
        let store = MemoryStore::builder().clock(ManualClock::new()).build();
        let policies = PolicySet::from(policy);
        let admitted = Arc::new(AtomicU64::new(0));
        runtime.block_on(async {
            let tasks: Vec<_> = (0..TASKS)
                .map(|_| {
                    let (store, policies, admitted) =
                        (store.clone(), policies.clone(), Arc::clone(&admitted));
                    tokio::spawn(async move {
                        for _ in 0..TRIES_PER_TASK {
                            if store.check("hot", &policies, 1).is_allowed() {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            tokio::task::yield_now().await;
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), LIMIT, "{name}");
    }
}

#[test]
fn threads_on_many_keys_keep_every_key_exact() {
    let store = MemoryStore::builder().clock(ManualClock::new()).build();
    let policies = PolicySet::from(Policy::gcra("g", Rate::per_minute(1), 7).unwrap());
    let counts: Vec<AtomicU64> = (0..50).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|scope| {
        for thread in 0..4 {
            let (store, policies, counts) = (&store, &policies, &counts);
            scope.spawn(move || {
                for round in 0..20 {
                    for key in 0..50 {
                        let key_index = (key + thread * 13 + round) % 50;
                        if store
                            .check(&format!("k{key_index}"), policies, 1)
                            .is_allowed()
                        {
                            counts[key_index].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    for count in &counts {
        assert_eq!(count.load(Ordering::Relaxed), 7);
    }
}
