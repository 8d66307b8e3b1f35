//! With the `metrics` feature, counting a decision allocates nothing once each policy has
//! been counted with an outcome: the `tollgate_decisions_total` key of each policy and
//! outcome (its labels included) is built the first time and kept with the policy, not
//! built again on every request. Allocations are counted per thread by this test binary's
//! global allocator.

#![cfg(feature = "metrics")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use http::{Request, Response};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tollgate::key::Global;
use tollgate::resolve::resolve_with;
use tollgate::{HeaderStyle, MemoryStore, Policy, PolicySet, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a
// const-initialised thread local, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|count| count.set(count.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// A recorder that allocates only the first time it sees a key, so that what remains per
/// request is the caller's own allocations.
#[derive(Default)]
struct Counters {
    counters: Mutex<HashMap<Key, Arc<AtomicU64>>>,
}

impl Counters {
    fn total(&self, name: &str) -> u64 {
        let counters = self.counters.lock().unwrap();
        counters
            .iter()
            .filter(|(key, _)| key.name() == name)
            .map(|(_, value)| value.load(Ordering::Relaxed))
            .sum()
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut counters = self.counters.lock().unwrap();
        let counter = match counters.get(key) {
            Some(counter) => Arc::clone(counter),
            None => Arc::clone(counters.entry(key.clone()).or_default()),
        };
        Counter::from_arc(counter)
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// Allocations per request through a layer that resolves `policies` for every request
/// (no rate-limit headers, so that only the decision and its telemetry differ), after a
/// warm-up; and the decisions counted. `fresh_sets`: the resolver builds a new set of the
/// same policies for every request, as a closure over policies may.
fn per_request(policies: Vec<Policy>, fresh_sets: bool) -> (f64, u64) {
    let recorder = Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let set = PolicySet::new(policies.clone()).unwrap();
    let resolver = resolve_with(move |_, _| {
        if fresh_sets {
            PolicySet::new(policies.clone()).unwrap()
        } else {
            set.clone()
        }
    });
    let mut service = RateLimitLayer::new(MemoryStore::new())
        .resolver(resolver)
        .key(Global)
        .headers(HeaderStyle::None)
        .layer(tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }));
    let mut send = || {
        runtime.block_on(async {
            let request = Request::new(Body::empty());
            let response = service.ready().await.unwrap().call(request).await.unwrap();
            assert_eq!(response.status(), 200);
        })
    };
    metrics::with_local_recorder(&recorder, || {
        for _ in 0..100 {
            send();
        }
        let requests = 1_000;
        let before = allocations();
        for _ in 0..requests {
            send();
        }
        let per_request = (allocations() - before) as f64 / requests as f64;
        (per_request, recorder.total("tollgate_decisions_total"))
    })
}

fn bucket(name: &str) -> Policy {
    Policy::token_bucket(name, 1_000_000, tollgate::Rate::per_second(1_000)).unwrap()
}

#[test]
fn counting_a_decision_allocates_nothing() {
    let (one, counted_one) = per_request(vec![bucket("api")], false);
    let (two, counted_two) = per_request(vec![bucket("api"), bucket("burst")], false);
    // Every decision is counted, once per policy: 1,100 requests.
    assert_eq!(counted_one, 1_100);
    assert_eq!(counted_two, 2_200);
    // Without headers, an admitted request through the in-process store allocates
    // nothing at all; a second policy adds a second count, and no allocation.
    assert_eq!(one, 0.0, "allocations per request with one policy");
    assert_eq!(two, 0.0, "allocations per request with two policies");
}

#[test]
fn sets_built_per_request_count_without_allocating_per_policy() {
    let (one, counted_one) = per_request(vec![bucket("api")], true);
    let (two, counted_two) = per_request(vec![bucket("api"), bucket("burst")], true);
    assert_eq!(counted_one, 1_100);
    assert_eq!(counted_two, 2_200);
    // Building the set allocates (its list and its shared part), as many times for one
    // policy as for two; the policies keep their metric keys from set to set.
    assert_eq!(
        one, two,
        "allocations per request: {one} with one policy, {two} with two"
    );
}

/// The policies keep their keys, not the recorder's handles: a local recorder set after a
/// policy's first decisions sees every later decision (the global recorder:
/// `tests/metrics_global_recorder.rs`).
#[test]
fn a_recorder_installed_later_sees_the_next_decisions() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let policy = Policy::token_bucket("api", 1_000, tollgate::Rate::per_second(1)).unwrap();
    let mut service = RateLimitLayer::new(MemoryStore::new())
        .policy(policy)
        .key(Global)
        .layer(tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }));
    let mut send = |count: usize| {
        for _ in 0..count {
            runtime.block_on(async {
                let request = Request::new(Body::empty());
                service.ready().await.unwrap().call(request).await.unwrap();
            });
        }
    };
    send(10);
    let first = Counters::default();
    metrics::with_local_recorder(&first, || send(5));
    let second = Counters::default();
    metrics::with_local_recorder(&second, || send(3));
    assert_eq!(first.total("tollgate_decisions_total"), 5);
    assert_eq!(second.total("tollgate_decisions_total"), 3);
}
