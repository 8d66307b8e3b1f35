//! # tollgate
//!
//! Rate limiting for [Tower](https://docs.rs/tower) and [Axum](https://docs.rs/axum)
//! services: six algorithms, exact under concurrency, standard `RateLimit` headers on
//! every response it decides, `429` with `Retry-After` and an RFC 9457 problem body on
//! denial.
//!
//! ```
//! use std::net::SocketAddr;
//! use axum::{Router, routing::get, body::Body};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate};
//! use tollgate::cost::PerRoute;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limiter = RateLimitLayer::new(MemoryStore::new())
//!     .policy(Policy::token_bucket("api", 10, Rate::per_second(5))?)
//!     .cost(PerRoute::new(1).route("/search", 5));
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .route("/search", get(|| async { "results" }))
//!     .layer(limiter);
//!
//! // One client spends its 10 tokens on two searches...
//! let client = SocketAddr::from(([203, 0, 113, 7], 40000));
//! let request = |path: &str| {
//!     let mut request = Request::get(path).body(Body::empty()).unwrap();
//!     request.extensions_mut().insert(client);
//!     request
//! };
//! for _ in 0..2 {
//!     let response = app.clone().oneshot(request("/search")).await?;
//!     assert_eq!(response.status(), StatusCode::OK);
//! }
//! // ...and is told how long to wait.
//! let denied = app.clone().oneshot(request("/")).await?;
//! assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(denied.headers()["retry-after"], "1");
//! assert_eq!(denied.headers()["ratelimit-policy"], "\"api\";q=10;w=2");
//! // t: within 1 s (the next token, 0.2 s away, rounded up) no more than r=0 units.
//! assert_eq!(denied.headers()["ratelimit"], "\"api\";r=0;t=1");
//! # Ok(()) }
//! ```
//!
//! The parts, one per stage of a request:
//!
//! - [`key`]: who is this ([`key::ClientIp`], [`key::HeaderKey`], [`key::ExtensionKey`], compound, first-of, closures);
//! - [`cost`]: what does it spend (constant, [`cost::PerRoute`], closures, set by earlier middleware);
//! - [`policy`]: which limits apply ([`Policy`], [`PolicySet`], [`resolve::resolve_with`] per plan);
//! - [`store`]: who decides ([`MemoryStore`] in process; `RedisStore` for a fleet, feature
//!   `redis`; `DenyCache` in front of either);
//! - [`FailureMode`]: what a store failure gets (by default a local limiter, which denies
//!   with `429` like any limiter once its local budget is spent; `FailClosed` answers `503`,
//!   `FailOpen` lets requests through);
//! - [`RateLimitLayer`]: the Tower layer that ties them together, with [`HeaderStyle`].
//!
//! Features on by default: `axum` (axum's peer address and matched path in the key and
//! cost extractors), `tracing` (debug events for denials and for store errors that are
//! I/O; an error event for any other store error, once per kind, code and wording
//! (numbers aside) and again every ten minutes while it goes on; a warning when the
//! failure mode starts and when the store answers again; and an error or warning, once
//! (some again every ten minutes), for a set-up that cannot work as meant: a key or bypass that cannot read what the
//! server should record, an `or()` whose first key is never found, an actual cost that is
//! no number, a plan nobody defined), `client` (the [`client::PacingLayer`] for outgoing requests) and `config`
//! (policies from a serde configuration, reloaded while running). Off by default: `redis` (`RedisStore`:
//! standalone, Sentinel, Cluster), `tls` (`rediss://`), `graphql` (the GraphQL complexity
//! coster in `cost::graphql`), `metrics`, `tonic` (tonic's peer address and body type),
//! and `__test-clock` (private, for tests only: lets a test set the time a `RedisStore`
//! decides at; never enable it in a build that serves traffic, since Cargo unifies
//! features).

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![warn(rust_2018_idioms, unreachable_pub)]

pub mod algorithm;
pub mod body;
pub mod bypass;
#[cfg(feature = "client")]
pub mod client;
pub mod clock;
#[cfg(feature = "config")]
pub mod config;
pub mod cost;
mod decision;
mod failure;
mod future;
pub mod key;
mod layer;
pub mod limiter;
pub mod policy;
mod reservation;
pub mod resolve;
mod respond;
mod service;
pub mod settle;
pub mod store;
mod telemetry;

pub use body::{RateLimitBody, ResponseBody};
pub use decision::{Decision, Outcome, PolicyStatus, Receipt};
pub use failure::{CircuitBreaker, FailureMode, LocalFallback};
pub use future::ResponseFuture;
pub use key::Key;
pub use layer::{NoPolicy, RateLimitLayer};
pub use policy::{Algorithm, Policy, PolicyError, PolicySet, Rate};
pub use resolve::{PolicyResolver, resolve_with};
pub use respond::MissingKey;
pub use respond::headers::HeaderStyle;
pub use respond::problem::{
    COST_EXCEEDS_LIMIT, QUOTA_EXCEEDED, Rejection, TEMPORARY_REDUCED_CAPACITY,
};
pub use service::RateLimit;
pub use store::{
    Adjustment, Change, DEFAULT_STORE_TIMEOUT, DecideFuture, MemoryStore, Store, StoreError,
    StoreErrorKind,
};
