//! A real GraphQL server (async-graphql) behind tollgate: every known API key has a budget
//! of 1,000 points a minute (an unknown one is dropped, and the call counts as its
//! address's: a client that made up a key per call would get a fresh budget each time),
//! and each query is charged its static cost, so one query asking for 100 repositories
//! with 5 issues each (701 points) spends what 701 one-point queries do.
//!
//! ```text
//! cargo run --example graphql --features graphql      # 127.0.0.1:3000 ($PORT to change)
//! curl -i http://127.0.0.1:3000/graphql -H 'x-api-key: demo' -H 'content-type: application/json' \
//!   -d '{"query":"{ repositories(first: 10) { totalCount nodes { name issues(first: 5) { nodes { title } } } } }"}'
//! ```
//!
//! That query costs 71 points: `repositories` 1 + 10 x (`nodes` 1 + `issues` (1 + 5 x `nodes`
//! 1)). The response says `GraphQL-Cost: 71`, and `RateLimit: "points";r=929;t=1` shows what
//! is left. A query that could never fit (say `first: 100`
//! twice over) is refused with `400` and its cost, not told to retry.

#[path = "support/api_keys.rs"]
mod api_keys;
#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;

use std::net::SocketAddr;

use async_graphql::{EmptyMutation, EmptySubscription, Object, Schema, SimpleObject};
use async_graphql_axum::GraphQL;
use axum::Router;
use axum::routing::post_service;
use tollgate::cost::FromExtension;
use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer};
use tollgate::key::{ClientIp, HeaderKey, KeyExtractorExt};
use tollgate::policy::QuotaUnit;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};

#[derive(SimpleObject)]
struct Issue {
    title: String,
}

#[derive(SimpleObject)]
struct IssueConnection {
    total_count: i32,
    nodes: Vec<Issue>,
}

struct Repository {
    name: String,
}

#[Object]
impl Repository {
    async fn name(&self) -> &str {
        &self.name
    }

    /// A connection nested in another: its size multiplies with its parent's.
    async fn issues(&self, first: i32) -> IssueConnection {
        let count = first.clamp(0, 100);
        IssueConnection {
            total_count: 1_000,
            nodes: (0..count)
                .map(|i| Issue {
                    title: format!("{} issue {i}", self.name),
                })
                .collect(),
        }
    }
}

#[derive(SimpleObject)]
struct RepositoryConnection {
    total_count: i32,
    nodes: Vec<Repository>,
}

struct Query;

#[Object]
impl Query {
    async fn repositories(&self, first: i32) -> RepositoryConnection {
        RepositoryConnection {
            total_count: 10_000,
            nodes: (0..first.clamp(0, 100))
                .map(|i| Repository {
                    name: format!("repo-{i}"),
                })
                .collect(),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    let port = port::from_env()?;
    let schema = Schema::build(Query, EmptyMutation, EmptySubscription).finish();

    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(
            Policy::token_bucket("points", 1_000, Rate::per_minute(1_000))?
                // Clients read `tollgate-qu="graphql-points"`, not a count of requests.
                .with_unit(QuotaUnit::GraphqlPoints),
        )
        // A key your authentication checked, else the client's address.
        .key(HeaderKey::new("x-api-key").or(ClientIp::peer()))
        .cost(FromExtension::or(1));
    let app = Router::new()
        .route("/graphql", post_service(GraphQL::new(schema)))
        .layer(limiter)
        // Runs before the limiter: reads the query, computes its cost, hands on the same
        // bytes.
        .layer(GraphqlCostLayer::new(GraphqlCost::new()))
        // Runs first: a key the service does not know is dropped (your authentication's
        // place; here a fixed list).
        .layer(axum::middleware::map_request(api_keys::drop_unknown_key));

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("GraphQL behind tollgate on http://{addr}/graphql");
    println!(
        "budget: 1,000 points a minute per known x-api-key (demo), else per address; each query costs its static complexity"
    );
    println!(
        "try:    curl -i http://{addr}/graphql -H 'x-api-key: demo' -H 'content-type: application/json' \
         -d '{{\"query\":\"{{ repositories(first: 10) {{ totalCount nodes {{ name issues(first: 5) {{ nodes {{ title }} }} }} }} }}\"}}'"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
