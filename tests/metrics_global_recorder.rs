//! A global `metrics` recorder installed after a layer's first decisions sees the later
//! ones: the layer keeps the keys it counts under, not a recorder's handles. Its own test
//! binary, since a global recorder can be set once per process.

#![cfg(feature = "metrics")]

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use http::{Request, Response};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tollgate::key::Global;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

/// Counts every increment of `tollgate_decisions_total`, whatever its labels.
struct Decisions(AtomicU64);

impl CounterFn for Decisions {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, _: u64) {}
}

struct Installed(&'static Decisions);

impl Recorder for Installed {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() == "tollgate_decisions_total" {
            Counter::from_arc(std::sync::Arc::new(Forward(self.0)))
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

struct Forward(&'static Decisions);

impl CounterFn for Forward {
    fn increment(&self, value: u64) {
        self.0.increment(value);
    }

    fn absolute(&self, value: u64) {
        self.0.absolute(value);
    }
}

#[test]
fn a_global_recorder_installed_later_sees_the_next_decisions() {
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
    // No recorder yet: these decisions are counted by nobody.
    send(10);
    let decisions: &'static Decisions = Box::leak(Box::new(Decisions(AtomicU64::new(0))));
    metrics::set_global_recorder(Installed(decisions)).unwrap();
    send(7);
    assert_eq!(decisions.0.load(Ordering::Relaxed), 7);
}
