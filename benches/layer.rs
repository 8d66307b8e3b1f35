//! What the middleware costs per request, in process: an axum hello-world router with no
//! limiter, with tower_governor and with tollgate (in-process store, peer-IP key, headers
//! on), called directly (no sockets, no HTTP parsing), each response's body read to its
//! end. The variants run in alternating slices of the same process; the medians of their
//! nanoseconds per request, and each limiter's overhead over the bare router, are printed.
//! This isolates the middleware from the load generator that shares the machine in
//! `benches/http_load.sh`.
//!
//! `cargo bench --bench layer`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::Request;
use http_body_util::BodyExt;
use tollgate::{HeaderStyle, MemoryStore, Policy, Rate, RateLimitLayer};
use tower::{Service, ServiceExt};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

const ROUNDS: usize = 15;
const SLICE: Duration = Duration::from_millis(200);
const BATCH: usize = 200;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn request(peer: SocketAddr) -> Request<Body> {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

/// Serves requests for one slice on each of `threads` threads (each with its own
/// single-threaded runtime and its own clone of the router, sharing one limiter) and
/// returns nanoseconds per request per thread.
fn slice(threads: usize, router: &Router, peers: &[SocketAddr]) -> f64 {
    let per_thread: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let router = router.clone();
                scope.spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    runtime.block_on(serve(router, peers))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    per_thread.iter().sum::<f64>() / per_thread.len() as f64
}

async fn serve(mut service: Router, peers: &[SocketAddr]) -> f64 {
    let start = Instant::now();
    let mut served = 0usize;
    while start.elapsed() < SLICE {
        for i in 0..BATCH {
            let peer = peers[(served + i) % peers.len()];
            let ready = ServiceExt::<Request<Body>>::ready(&mut service)
                .await
                .unwrap();
            let response = ready.call(request(peer)).await.unwrap();
            assert!(response.status().is_success(), "{}", response.status());
            let body = response.into_body().collect().await.unwrap();
            std::hint::black_box(body);
        }
        served += BATCH;
    }
    start.elapsed().as_nanos() as f64 / served as f64
}

async fn serve_count(mut service: Router, peers: &[SocketAddr], count: usize) {
    for i in 0..count {
        let ready = ServiceExt::<Request<Body>>::ready(&mut service)
            .await
            .unwrap();
        let response = ready.call(request(peers[i % peers.len()])).await.unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        std::hint::black_box(response.into_body().collect().await.unwrap());
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `LAYER_THREADS=2`: two threads serve at once through one limiter, as a server's
    // workers do (shared counters and reference counts bounce between the cores).
    let threads: usize = match std::env::var("LAYER_THREADS") {
        Ok(threads) => threads.parse()?,
        Err(_) => 1,
    };
    let hello = || Router::new().route("/", get(|| async { "hello" }));
    let policy = || Policy::token_bucket("api", 1_000_000_000, Rate::per_second(1_000_000_000));
    let governor = GovernorConfigBuilder::default()
        .period(Duration::from_nanos(1))
        .burst_size(1_000_000_000)
        .use_headers()
        .finish()
        .ok_or("invalid tower_governor config")?;
    // Two fixed rate-limit fields of tollgate's sizes, built once.
    let fixed_fields = |mut response: axum::response::Response| {
        use axum::http::{HeaderName, HeaderValue};
        let headers = response.headers_mut();
        headers.append(
            HeaderName::from_static("ratelimit-policy"),
            HeaderValue::from_static("\"api\";q=1000000000;w=1"),
        );
        headers.append(
            HeaderName::from_static("ratelimit"),
            HeaderValue::from_static("\"api\";r=999999999;t=1"),
        );
        response
    };
    // `with_state` turns the handlers into routes once, as `axum::serve` does; a bare
    // `Router` would rebuild them (and re-apply the layers) on every request.
    let variants: Vec<(&str, Router)> = vec![
        ("none", hello()),
        // The floors under any limiter layered onto a router: a layer that does nothing
        // (axum boxes the wrapped route's future and clones its service per request), and
        // one that only writes two fixed header fields.
        (
            "identity layer",
            hello().layer(tower::util::MapResponseLayer::new(
                |response: axum::response::Response| response,
            )),
        ),
        (
            "fixed header fields",
            hello().layer(tower::util::MapResponseLayer::new(fixed_fields)),
        ),
        (
            "governor",
            hello().layer(GovernorLayer::new(Arc::new(governor))),
        ),
        (
            "tollgate",
            hello().layer(RateLimitLayer::new(MemoryStore::new()).policy(policy()?)),
        ),
        (
            "tollgate, no headers",
            hello().layer(
                RateLimitLayer::new(MemoryStore::new())
                    .policy(policy()?)
                    .headers(HeaderStyle::None),
            ),
        ),
    ];
    // `LAYER_ONLY=tollgate` runs one variant (for a profiler).
    let variants: Vec<(&str, Router)> = match std::env::var("LAYER_ONLY") {
        Ok(only) => variants
            .into_iter()
            .filter(|(name, _)| *name == only)
            .collect(),
        Err(_) => variants,
    };
    // A few clients, as the load generator's connections share one address.
    // `LAYER_ADDRESSES=1`: every request from one address, as in `benches/http_load.sh`
    // (with `LAYER_THREADS=2`, both threads contend for one identity's state).
    let addresses: usize = match std::env::var("LAYER_ADDRESSES") {
        Ok(addresses) => addresses.parse::<usize>()?.clamp(1, 32),
        Err(_) => 4,
    };
    let peers: Vec<SocketAddr> = (0..32)
        .map(|i| {
            let host = 1 + (i % addresses) as u8;
            SocketAddr::from(([127, 0, 0, host], 40_000 + i as u16))
        })
        .collect();
    let variants: Vec<(&str, Router)> = variants
        .into_iter()
        .map(|(name, router)| (name, router.with_state(())))
        .collect();
    // `LAYER_COUNT=N` (with `LAYER_ONLY`): serve exactly N requests once and stop, for
    // `perf stat` (instructions per request do not drift with the machine's noise).
    if let Ok(count) = std::env::var("LAYER_COUNT") {
        let count: usize = count.parse()?;
        for (name, router) in &variants {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let start = Instant::now();
            runtime.block_on(serve_count(router.clone(), &peers, count));
            let ns = start.elapsed().as_nanos() as f64 / count as f64;
            println!("{name}: {count} requests, {ns:.0} ns each");
        }
        return Ok(());
    }
    let mut samples = vec![Vec::new(); variants.len()];
    for round in 0..ROUNDS {
        // Rotate the order each round, so no variant always runs first.
        for offset in 0..variants.len() {
            let index = (round + offset) % variants.len();
            samples[index].push(slice(threads, &variants[index].1, &peers));
        }
    }
    let medians: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
    println!(
        "| router | ns per request, {threads} thread(s) (median of {ROUNDS}) | overhead over none, ns | vs none |"
    );
    println!("|---|---|---|---|");
    for ((name, _), ns) in variants.iter().zip(&medians) {
        println!(
            "| {name} | {ns:.0} | {:.0} | {:.3} |",
            ns - medians[0],
            medians[0] / ns,
        );
    }
    Ok(())
}
