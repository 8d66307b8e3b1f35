//! The server of the HTTP overhead benchmark (`benches/http_load.sh`): an axum
//! hello-world with no limiter, with tower_governor, or with tollgate.
//!
//! ```text
//! cargo run --release --example bench_server -- <none|rewrap|identity-layer|static-headers|store-only|governor|tollgate|tollgate-bare> [port]
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release --features redis --example bench_server -- tollgate-redis
//! LIMIT=20000 LEASE=0 REDIS_URL=... cargo run --release --features redis --example bench_server -- tollgate-fleet
//! ```
//!
//! `OUTER=1` puts the limiter around the whole router (before routing) instead of adding
//! it with `Router::layer` (for `none`, `tollgate`, `governor` and `static-headers`).
//!
//! `tollgate-fleet` is one replica of the fleet benchmark (`benches/fleet.sh`): one quota
//! shared by every replica through Redis (`REDIS_URL`, `REDIS_CLUSTER` or Sentinel, as
//! `RedisConfig::from_env` reads them), a bucket of `LIMIT` that does not refill during
//! the run, so exactly `LIMIT` requests are admitted fleet-wide (`LIMIT=0`: a quota that
//! never runs out); `LEASE` > 0 takes leases
//! of that many units (`store::Leased`) instead of one decision per request.
//!
//! Both limiters key by peer IP and are configured so the load generator is never denied:
//! the benchmark measures what admitting a request costs. Both write rate-limit headers on
//! every response (tower_governor with `use_headers`). Tokio's default multi-thread
//! runtime (one worker per core), as an app would run; `WORKERS=1` gives it one worker.

#[path = "support/logging.rs"]
mod logging;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_else(|| "tollgate".to_owned());
    let port: u16 = args.next().map_or(Ok(3100), |p| p.parse())?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = std::env::var("WORKERS").ok().and_then(|w| w.parse().ok()) {
        builder.worker_threads(workers);
    }
    let runtime = builder.enable_all().build()?;
    runtime.block_on(serve(variant, port))
}

async fn serve(variant: String, port: u16) -> Result<(), Box<dyn std::error::Error>> {
    let app = Router::new().route("/", get(|| async { "hello" }));
    if std::env::var("OUTER").is_ok_and(|outer| outer == "1") {
        return serve_around(variant, port, app).await;
    }
    let app = match variant.as_str() {
        "none" => app,
        "tollgate" => app.layer(RateLimitLayer::new(MemoryStore::new()).policy(
            Policy::token_bucket("api", 1_000_000_000, Rate::per_second(1_000_000_000))?,
        )),
        // The same limiter without rate-limit headers: what the decision alone costs.
        "tollgate-bare" => app.layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::token_bucket(
                    "api",
                    1_000_000_000,
                    Rate::per_second(1_000_000_000),
                )?)
                .headers(tollgate::HeaderStyle::None),
        ),
        #[cfg(feature = "redis")]
        "tollgate-redis" => {
            let url = std::env::var("REDIS_URL").map_err(|_| "tollgate-redis needs REDIS_URL")?;
            app.layer(
                RateLimitLayer::new(tollgate::store::RedisStore::connect(&url).await?).policy(
                    Policy::token_bucket("api", 1_000_000_000, Rate::per_second(1_000_000_000))?,
                ),
            )
        }
        #[cfg(feature = "redis")]
        "tollgate-fleet" => {
            let number = |name: &str, default: u64| -> Result<u64, Box<dyn std::error::Error>> {
                std::env::var(name).map_or(Ok(default), |value| Ok(value.parse()?))
            };
            let (limit, lease) = (number("LIMIT", 20_000)?, number("LEASE", 0)?);
            let config = tollgate::store::RedisConfig::from_env()?
                .ok_or("tollgate-fleet needs REDIS_URL, REDIS_CLUSTER or REDIS_SENTINEL_URLS")?;
            let redis = config.connect().await?;
            // LIMIT=0: a quota that never runs out (what admitting costs).
            let policy = if limit == 0 {
                Policy::token_bucket("fleet", 1_000_000_000, Rate::per_second(1_000_000_000))?
            } else {
                Policy::token_bucket("fleet", limit, Rate::per_day(1))?
            };
            let store: Arc<dyn tollgate::Store> = if lease > 0 {
                Arc::new(tollgate::store::Leased::new(
                    redis,
                    lease,
                    Duration::from_secs(1),
                )?)
            } else {
                Arc::new(redis)
            };
            app.layer(
                RateLimitLayer::new(store)
                    .policy(policy)
                    .key(tollgate::key::Global),
            )
        }
        // A layer that only wraps the response body in another type (as any middleware
        // that changes the body type does): what axum's re-boxing of it costs alone.
        "rewrap" => app.layer(tower::util::MapResponseLayer::new(
            |response: axum::response::Response| response.map(Rewrapped),
        )),
        // A layer that does nothing: what axum's layering costs any middleware (the wrapped
        // route's future boxed, its service cloned, per request).
        "identity-layer" => app.layer(tower::util::MapResponseLayer::new(
            |response: axum::response::Response| response,
        )),
        // Two fixed headers of tollgate's sizes, built once, written by a bare map: what
        // the wire bytes of rate-limit headers cost alone, whatever computes them.
        "static-headers" => {
            use axum::http::{HeaderName, HeaderValue};
            let policy = HeaderValue::from_static("\"api\";q=1000000000;w=1");
            let rate = HeaderValue::from_static("\"api\";r=999999999;t=1");
            app.layer(tower::util::MapResponseLayer::new(
                move |mut response: axum::response::Response| {
                    let headers = response.headers_mut();
                    headers.append(HeaderName::from_static("ratelimit-policy"), policy.clone());
                    headers.append(HeaderName::from_static("ratelimit"), rate.clone());
                    response
                },
            ))
        }
        // tollgate's in-process decision with two fixed header fields, in a minimal
        // hand-written layer: what the store's part of tollgate costs alone (the peer
        // address is read, but the key is fixed, not formatted from it).
        "store-only" => app.layer(StoreOnlyLayer {
            store: MemoryStore::new(),
            policies: tollgate::PolicySet::from(Policy::token_bucket(
                "api",
                1_000_000_000,
                Rate::per_second(1_000_000_000),
            )?),
        }),
        "governor" => app.layer(GovernorLayer::new(governor_config()?)),
        other => {
            return Err(format!("unknown variant {other:?}: none, identity-layer, static-headers, store-only, governor, tollgate, tollgate-bare, rewrap (tollgate-redis, tollgate-fleet with the redis feature)").into());
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("{variant} listening on {}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

/// `OUTER=1`: the limiter wraps the whole router (`layer.layer(router)`), so it runs
/// before routing, as a `tower::ServiceBuilder` stack in front of the router does, rather
/// than inside each route (`Router::layer`, which axum boxes and clones per route and
/// request). Keys and costs see no `MatchedPath` then (neither limiter here reads one).
async fn serve_around(
    variant: String,
    port: u16,
    app: Router,
) -> Result<(), Box<dyn std::error::Error>> {
    use axum::http::{HeaderName, HeaderValue};
    use tower::Layer;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "{variant} (around the router) listening on {}",
        listener.local_addr()?
    );
    match variant.as_str() {
        "none" => around(listener, app).await?,
        "tollgate" => {
            let layer = RateLimitLayer::new(MemoryStore::new()).policy(Policy::token_bucket(
                "api",
                1_000_000_000,
                Rate::per_second(1_000_000_000),
            )?);
            around(listener, layer.layer(app)).await?;
        }
        "governor" => {
            around(listener, GovernorLayer::new(governor_config()?).layer(app)).await?;
        }
        "static-headers" => {
            let policy = HeaderValue::from_static("\"api\";q=1000000000;w=1");
            let rate = HeaderValue::from_static("\"api\";r=999999999;t=1");
            let layer = tower::util::MapResponseLayer::new(
                move |mut response: axum::response::Response| {
                    let headers = response.headers_mut();
                    headers.append(HeaderName::from_static("ratelimit-policy"), policy.clone());
                    headers.append(HeaderName::from_static("ratelimit"), rate.clone());
                    response
                },
            );
            around(listener, layer.layer(app)).await?;
        }
        other => {
            return Err(format!(
                "OUTER=1 runs none, tollgate, governor or static-headers, not {other:?}"
            )
            .into());
        }
    }
    Ok(())
}

/// Serves `service` (the router with a layer around it) with the peer address recorded.
async fn around<S>(listener: tokio::net::TcpListener, service: S) -> std::io::Result<()>
where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
{
    use axum::ServiceExt;
    axum::serve(
        listener,
        service.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

/// tower_governor's configuration in both placements: keyed by peer IP, headers on, a
/// quota the load never spends.
fn governor_config() -> Result<
    Arc<
        tower_governor::governor::GovernorConfig<
            tower_governor::key_extractor::PeerIpKeyExtractor,
            governor::middleware::StateInformationMiddleware,
        >,
    >,
    Box<dyn std::error::Error>,
> {
    let config = GovernorConfigBuilder::default()
        .period(Duration::from_nanos(1))
        .burst_size(1_000_000_000)
        .use_headers()
        .finish()
        .ok_or("invalid tower_governor config")?;
    Ok(Arc::new(config))
}

/// A body that is only another type around axum's.
struct Rewrapped(axum::body::Body);

impl http_body::Body for Rewrapped {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.0).poll_frame(cx)
    }
}

/// The layer of the `store-only` variant.
#[derive(Clone)]
struct StoreOnlyLayer {
    store: MemoryStore,
    policies: tollgate::PolicySet,
}

impl<S> tower::Layer<S> for StoreOnlyLayer {
    type Service = StoreOnly<S>;

    fn layer(&self, inner: S) -> StoreOnly<S> {
        StoreOnly {
            inner,
            shared: Arc::new(self.clone()),
        }
    }
}

#[derive(Clone)]
struct StoreOnly<S> {
    inner: S,
    shared: Arc<StoreOnlyLayer>,
}

impl<S, B, ResBody> tower::Service<axum::http::Request<B>> for StoreOnly<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::http::Response<ResBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = StoreOnlyFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        let peer = request
            .extensions()
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
            .map(|info| info.0.ip());
        let decision = self
            .shared
            .store
            .check("ip:127.0.0.1", &self.shared.policies, 1);
        assert!(peer.is_some() && decision.is_allowed());
        StoreOnlyFuture {
            future: self.inner.call(request),
        }
    }
}

pin_project_lite::pin_project! {
    struct StoreOnlyFuture<F> {
        #[pin]
        future: F,
    }
}

impl<F, ResBody, E> std::future::Future for StoreOnlyFuture<F>
where
    F: std::future::Future<Output = Result<axum::http::Response<ResBody>, E>>,
{
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use axum::http::{HeaderName, HeaderValue};
        let mut response = std::task::ready!(self.project().future.poll(cx))?;
        let headers = response.headers_mut();
        headers.append(
            HeaderName::from_static("ratelimit-policy"),
            HeaderValue::from_static("\"api\";q=1000000000;w=1"),
        );
        headers.append(
            HeaderName::from_static("ratelimit"),
            HeaderValue::from_static("\"api\";r=999999999;t=1"),
        );
        std::task::Poll::Ready(Ok(response))
    }
}
