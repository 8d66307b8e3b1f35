//! Decisions per second through `RedisStore` with 1, 16 and 256 concurrent callers, next
//! to `redis-benchmark` sending the same EVALSHA (same script, same arguments, keys over
//! the same 10,000 identities) to the same server in the same run: that is the ceiling.
//! Both connection strategies are measured: one multiplexed connection that pipelines
//! concurrent calls (`RedisStore::connect`) and a deadpool pool of 32 connections
//! (`RedisStore::from_pool`).
//!
//! Then a hot key: 256 callers deciding for one identity, with coalescing (the default:
//! concurrent decisions for one identity go to Redis as one batch) and without, in
//! alternating rounds: decisions per second, script calls per decision and Redis CPU per
//! decision (`INFO commandstats`).
//!
//! `cargo bench --bench redis --features redis` (starts its own redis-server on a free
//! loopback port; the server is pinned to CPU 0 and redis-benchmark to CPU 1 when
//! `taskset` exists).

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate::store::RedisStore;
use tollgate::{Key, Policy, PolicySet, Rate, Store};

const KEYS: u64 = 10_000;
const RUN: Duration = Duration::from_secs(3);

async fn measure(store: RedisStore, policies: PolicySet, callers: usize) -> f64 {
    measure_keys(store, policies, callers, KEYS).await
}

/// Decisions per second of `callers` callers over `keys` identities.
async fn measure_keys(store: RedisStore, policies: PolicySet, callers: usize, keys: u64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let (store, policies) = (store.clone(), policies.clone());
        let (stop, done, errors) = (Arc::clone(&stop), Arc::clone(&done), Arc::clone(&errors));
        tasks.push(tokio::spawn(async move {
            let mut i = caller as u64 * 7919;
            while !stop.load(Ordering::Relaxed) {
                i = (i + 1) % keys;
                match store
                    .decide(&Key::new(format!("user:{i}")), &policies, 1)
                    .await
                {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        errors.load(Ordering::Relaxed),
        0,
        "store errors during the run"
    );
    done.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64()
}

fn redis_benchmark(
    port: u16,
    callers: usize,
    pipeline: usize,
    sha: &str,
    key: &str,
    args: &[String],
) -> f64 {
    let mut command = if Command::new("taskset").arg("-V").output().is_ok() {
        let mut command = Command::new("taskset");
        command.args(["-c", "1", "redis-benchmark"]);
        command
    } else {
        Command::new("redis-benchmark")
    };
    let requests = (40_000 * callers.min(16)).to_string();
    let out = command
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-c",
            &callers.to_string(),
        ])
        .args(["-P", &pipeline.to_string()])
        .args([
            "-n",
            &requests,
            "-r",
            &KEYS.to_string(),
            "-q",
            // One key, as the store sends a lone plain policy's decision.
            "EVALSHA",
            sha,
            "1",
            key,
        ])
        .args(args)
        .output()
        .expect("redis-benchmark runs (apt-get install redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    // "EVALSHA ...: 61349.69 requests per second, p50=..."
    text.split("requests per second")
        .next()
        .and_then(|head| head.rsplit(' ').nth(1))
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("cannot read redis-benchmark output: {text}"))
}

/// One identity, 256 callers: coalesced and not, alternating rounds; medians.
fn hot_key(runtime: &tokio::runtime::Runtime, server: &support::RedisServer, policies: &PolicySet) {
    const ROUNDS: usize = 5;
    let mut results: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        for step in 0..2 {
            // Rotate which goes first.
            let coalescing = (round + step) % 2 == 0;
            let store = runtime.block_on(async {
                RedisStore::connect(&server.url())
                    .await
                    .unwrap()
                    .coalescing(coalescing)
            });
            assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
            let start = Instant::now();
            let rate = runtime.block_on(measure_keys(store, policies.clone(), 256, 1));
            let decisions = rate * start.elapsed().as_secs_f64();
            let (calls, usec) = support::script_stats(server);
            results[usize::from(coalescing)].push((
                rate,
                calls as f64 / decisions,
                usec as f64 / decisions,
            ));
        }
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    println!();
    println!(
        "hot key: 1 identity, 256 callers, one multiplexed connection ({ROUNDS} rounds, medians)"
    );
    println!("| coalescing | decisions/s | script calls per decision | Redis CPU per decision |");
    println!("|---|---|---|---|");
    let mut rates = [0.0; 2];
    for (index, label) in [(0, "off"), (1, "on (default)")] {
        let runs = &results[index];
        let mut rate: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let mut calls: Vec<f64> = runs.iter().map(|r| r.1).collect();
        let mut usec: Vec<f64> = runs.iter().map(|r| r.2).collect();
        rates[index] = median(&mut rate);
        println!(
            "| {label} | {:.0}/s | {:.3} | {:.2} µs |",
            rates[index],
            median(&mut calls),
            median(&mut usec)
        );
    }
    println!(
        "coalesced / not: {:.2}x decisions per second",
        rates[1] / rates[0]
    );
}

fn main() {
    let server = support::RedisServer::start();
    if Command::new("taskset").arg("-V").output().is_ok() {
        let pid = server.cli(&["INFO", "server"]);
        if let Some(pid) = pid
            .lines()
            .find_map(|line| line.strip_prefix("process_id:"))
        {
            let _ = Command::new("taskset")
                .args(["-p", "-c", "0", pid.trim()])
                .output();
        }
    }
    let policy = Policy::token_bucket("api", 1_000_000, Rate::per_second(1_000_000)).unwrap();
    let policies = PolicySet::from(policy.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    // The same call redis-benchmark makes: keys of identity `user:__rand_int__`.
    let keys = tollgate::store::RedisKeys::default();
    let (key, _) = keys.policy_keys("user:__rand_int__", &policy);
    // The script the store runs for this policy set.
    let source = tollgate::store::decision_script(&policies).unwrap();
    let script = redis::Script::new(source);
    let sha = server.cli(&["SCRIPT", "LOAD", source]).trim().to_owned();
    assert_eq!(sha, script.get_hash(), "SCRIPT LOAD returned {sha}");
    let (kind, p1, p2, p3) = ("tb", 1_000_000u64, 1u64, 1u64);
    let args: Vec<String> = ["", "1", "1", kind]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([p1, p2, p3].iter().map(u64::to_string))
        .collect();

    println!(
        "| callers | multiplexed connection | pool of 32 | redis-benchmark EVALSHA, N connections | multiplexed / that | redis-benchmark, N connections pipelining 16 | multiplexed / that |"
    );
    println!("|---|---|---|---|---|---|---|");
    for callers in [1usize, 16, 256] {
        let multiplexed = runtime.block_on(async {
            let store = RedisStore::connect(&server.url()).await.unwrap();
            measure(store, policies.clone(), callers).await
        });
        let pooled = runtime.block_on(async {
            let mut config = deadpool_redis::Config::from_url(server.url());
            config.pool = Some(deadpool_redis::PoolConfig::new(32));
            let pool = config
                .create_pool(Some(deadpool_redis::Runtime::Tokio1))
                .unwrap();
            measure(RedisStore::from_pool(pool), policies.clone(), callers).await
        });
        let plain = redis_benchmark(server.port, callers, 1, &sha, &key, &args);
        let pipelined = redis_benchmark(server.port, callers, 16, &sha, &key, &args);
        println!(
            "| {callers} | {multiplexed:.0}/s | {pooled:.0}/s | {plain:.0}/s | {:.2} | {pipelined:.0}/s | {:.2} |",
            multiplexed / plain,
            multiplexed / pipelined
        );
    }
    hot_key(&runtime, &server, &policies);

    // redis-benchmark counts error replies as requests too: make sure no EVALSHA failed.
    // (Clients' CLIENT SETINFO fails on Redis before 7.2; that is not ours to count.)
    let stats = server.cli(&["INFO", "commandstats"]);
    let evalsha = stats
        .lines()
        .find(|line| line.starts_with("cmdstat_evalsha:"))
        .unwrap_or_else(|| panic!("no EVALSHA stats in {stats}"));
    let fields: Vec<&str> = evalsha.trim().split([':', ',']).collect();
    assert!(fields.contains(&"failed_calls=0"), "{evalsha}");
    assert!(fields.contains(&"rejected_calls=0"), "{evalsha}");
}
