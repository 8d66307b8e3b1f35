//! The GraphQL coster: hand-computed costs, and an attack corpus that must end in a
//! bounded cost or a clear error, never a panic or a stack overflow.

#![cfg(feature = "graphql")]
// The expected costs are written out as the model computes them (1 + 10 * 1), on purpose.
#![allow(clippy::identity_op, clippy::erasing_op)]

use serde_json::json;
use tollgate::cost::graphql::{CostError, GraphqlCost, OutOfRange};

fn cost(query: &str) -> Result<u64, CostError> {
    GraphqlCost::new().query_cost(query, None, None)
}

#[test]
fn cost_table() {
    let table: &[(&str, u64)] = &[
        // Scalars are free; an object field costs 1.
        ("{ hello }", 0),
        ("{ viewer { login } }", 1),
        // Nested connections multiply: 1 + 10 * (1 + 5 * 0 ... ) etc.
        ("{ repos(first: 10) { nodes { name } } }", 1 + 10 * 1),
        (
            "{ repos(first: 10) { nodes { issues(last: 5) { nodes { title } } } } }",
            1 + 10 * (1 + (1 + 5 * 1)),
        ),
        // Every alias counts.
        (
            "{ a: viewer { login } b: viewer { login } c: viewer { login } }",
            3,
        ),
        // Fragments and inline fragments are expanded.
        (
            "query { viewer { ...F } } fragment F on User { friends(first: 3) { name } }",
            1 + (1 + 3 * 0),
        ),
        (
            "{ node { ... on User { friends(limit: 4) { profile { url } } } } }",
            1 + (1 + 4 * 1),
        ),
        // Mutations pay a base of 10.
        (
            "mutation { addStar(id: 1) { starrable { id } } }",
            10 + 1 + 1,
        ),
    ];
    for (query, expected) in table {
        assert_eq!(cost(query).unwrap(), *expected, "{query}");
    }
}

#[test]
fn operation_name_variables_and_batches() {
    let coster = GraphqlCost::new();
    let document = "query Small { viewer { id } } query Big($n: Int = 20) { repos(first: $n) { nodes { id } } }";
    assert_eq!(coster.query_cost(document, Some("Small"), None).unwrap(), 1);
    // The default value of the variable, then the variable the request sends.
    assert_eq!(
        coster.query_cost(document, Some("Big"), None).unwrap(),
        1 + 20
    );
    let variables = json!({ "n": 50 });
    assert_eq!(
        coster
            .query_cost(document, Some("Big"), variables.as_object())
            .unwrap(),
        1 + 50
    );
    assert!(matches!(
        coster.query_cost(document, None, None),
        Err(CostError::Operation(_))
    ));
    assert!(matches!(
        coster.query_cost(document, Some("Nope"), None),
        Err(CostError::Operation(_))
    ));

    let batch = json!([
        { "query": "{ viewer { id } }" },
        { "query": document, "operationName": "Big", "variables": { "n": 2 } },
    ]);
    assert_eq!(
        coster.json_cost(batch.to_string().as_bytes()).unwrap(),
        1 + (1 + 2)
    );
    let single = json!({ "query": "{ a { b { c } } }", "operationName": null, "variables": null });
    assert_eq!(coster.json_cost(single.to_string().as_bytes()).unwrap(), 2);
}

#[test]
fn slicing_limits_reject_or_cap() {
    let reject = GraphqlCost::new();
    let error = reject
        .query_cost("{ repos(first: 2147483647) { id } }", None, None)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "repos(first: 2147483647) is out of range: first must be between 1 and 100"
    );
    let huge = json!({ "n": 1e300 });
    assert!(
        reject
            .query_cost(
                "query($n: Int) { repos(first: $n) { id } }",
                None,
                huge.as_object()
            )
            .is_err()
    );
    assert!(
        reject
            .query_cost("query($n: Int) { repos(first: $n) { id } }", None, None)
            .is_err()
    );
    let cap = GraphqlCost::new().slice_range(1, 100, OutOfRange::Cap);
    let query =
        |first: &str| format!("query($n: Int) {{ repos(first: {first}) {{ nodes {{ id }} }} }}");
    assert_eq!(
        cap.query_cost(&query("2147483647"), None, None).unwrap(),
        1 + 100
    );
    assert_eq!(cap.query_cost(&query("-5"), None, None).unwrap(), 1 + 1);
    assert_eq!(
        cap.query_cost(&query("$n"), None, huge.as_object())
            .unwrap(),
        1 + 100
    );
    assert_eq!(
        cap.query_cost(&query("$n"), None, None).unwrap(),
        1 + 100,
        "missing: the maximum"
    );
}

#[test]
fn attack_corpus() {
    let coster = GraphqlCost::new();
    // 10,000 levels of nesting: refused by the parser's recursion limit, no overflow.
    let deep = "{ a ".repeat(10_000) + &"}".repeat(10_000);
    assert!(matches!(
        coster.query_cost(&deep, None, None),
        Err(CostError::Parse(_) | CostError::TooDeep { .. })
    ));
    // Fragment cycles.
    let cycle = "{ ...A } fragment A on Q { b { ...B } } fragment B on Q { a { ...A } }";
    assert!(matches!(
        coster.query_cost(cycle, None, None),
        Err(CostError::FragmentCycle(_))
    ));
    assert!(matches!(
        coster.query_cost("{ ...Missing }", None, None),
        Err(CostError::UnknownFragment(_))
    ));
    // Fragment fan-out: each level spreads the next ten times (10^30 expansions if
    // expanded naively). Each fragment is costed once; the total saturates.
    let mut fanout = String::from("{ ...F0 }");
    for level in 0..30 {
        let spreads: String = (0..10)
            .map(|i| format!(" a{i}: x {{ ...F{} }}", level + 1))
            .collect();
        fanout.push_str(&format!(" fragment F{level} on Q {{{spreads} }}"));
    }
    fanout.push_str(" fragment F30 on Q { leaf { id } }");
    assert_eq!(coster.query_cost(&fanout, None, None).unwrap(), u64::MAX);
    // Aliases: every one counts; 10,000 of them exceed the token limit (a clear error).
    let aliases = |n| {
        (0..n)
            .map(|i| format!(" a{i}: viewer {{ id }}"))
            .collect::<String>()
    };
    assert_eq!(
        coster
            .query_cost(&format!("{{{} }}", aliases(1_000)), None, None)
            .unwrap(),
        1_000
    );
    let error = coster
        .query_cost(&format!("{{{} }}", aliases(10_000)), None, None)
        .unwrap_err();
    assert!(error.to_string().contains("token limit"), "{error}");
    // Token limit: a 10 MB document is refused without being walked.
    let big = format!("{{ {} }}", "f ".repeat(5_000_000));
    assert!(matches!(
        coster.query_cost(&big, None, None),
        Err(CostError::Parse(_))
    ));
    // A batch of 10,000 operations.
    let batch = format!("[{}]", vec![r#"{"query":"{ a }"}"#; 10_000].join(","));
    assert_eq!(
        coster.json_cost(batch.as_bytes()).unwrap_err(),
        CostError::Batch {
            count: 10_000,
            max: 10
        }
    );
    // Invalid UTF-8 and not-JSON bodies.
    assert!(matches!(
        coster.json_cost(b"\xff\xfe{"),
        Err(CostError::Request(_))
    ));
    assert!(matches!(
        coster.json_cost(b"{\"query\": 5}"),
        Err(CostError::Request(_))
    ));
    assert!(matches!(
        coster.query_cost("{ unclosed", None, None),
        Err(CostError::Parse(_))
    ));
}

/// A document full of syntax errors is refused for the price of one parse: rendering every
/// error with its source took seconds (quadratic) for a few tens of kilobytes, before the
/// rate limiter had a say.
#[test]
fn a_document_full_of_syntax_errors_is_refused_at_parse_speed() {
    let document = format!("{{ {} }}", "a(b: ) ".repeat(1_500));
    let started = std::time::Instant::now();
    let error = cost(&document).unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(error, CostError::Parse(_)), "{error}");
    assert!(error.to_string().contains("syntax error"), "{error}");
    assert!(
        elapsed < std::time::Duration::from_secs(1),
        "{} bytes took {elapsed:?}",
        document.len()
    );
}

mod http {
    use axum::Router;
    use axum::body::Body;
    use axum::routing::post;
    use http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tollgate::cost::FromExtension;
    use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer, Invalid};
    use tollgate::key::HeaderKey;
    use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
    use tower::ServiceExt;

    fn app(coster: GraphqlCostLayer) -> Router {
        let limiter = RateLimitLayer::new(MemoryStore::new())
            .policy(Policy::token_bucket("points", 100, Rate::per_hour(1)).unwrap())
            .key(HeaderKey::new("x-api-key"))
            .cost(FromExtension::or(1));
        Router::new()
            .route(
                "/graphql",
                post(|body: String| async move { body }).get(|| async { "{\"data\":{}}" }),
            )
            .layer(limiter)
            .layer(coster)
            .with_state(())
    }

    async fn send(app: &Router, key: &str, body: &str) -> (StatusCode, Option<String>, String) {
        let request = Request::post("/graphql")
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let cost = response
            .headers()
            .get("graphql-cost")
            .map(|value| value.to_str().unwrap().to_owned());
        let body = String::from_utf8(
            response
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap();
        (status, cost, body)
    }

    #[tokio::test]
    async fn one_expensive_query_spends_what_many_cheap_ones_do() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        // 1 + 99 * 1 = 100 points at once.
        let expensive = r#"{"query":"{ repos(first: 99) { nodes { id } } }"}"#;
        let (status, cost, echoed) = send(&app, "alpha", expensive).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("100")));
        assert_eq!(echoed, expensive, "the server got the same bytes");
        assert_eq!(
            send(&app, "alpha", r#"{"query":"{ viewer { id } }"}"#)
                .await
                .0,
            StatusCode::TOO_MANY_REQUESTS
        );
        // The same budget in a hundred cheap queries.
        for _ in 0..100 {
            assert_eq!(
                send(&app, "beta", r#"{"query":"{ viewer { id } }"}"#)
                    .await
                    .0,
                StatusCode::OK
            );
        }
        assert_eq!(
            send(&app, "beta", r#"{"query":"{ viewer { id } }"}"#)
                .await
                .0,
            StatusCode::TOO_MANY_REQUESTS
        );
        // A query that can never fit the budget: told so, not told to retry.
        let (status, _, body) = send(
            &app,
            "gamma",
            r#"{"query":"{ a(first: 100) { b { id } } b: a(first: 100) { c { id } } }"}"#,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            body.contains("cost-exceeds-limit") && body.contains("\"cost\":202"),
            "{body}"
        );
    }

    #[tokio::test]
    async fn malformed_large_and_get_requests() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()).max_body(1024));
        let (status, _, body) = send(&app, "k", r#"{"query":"{ unclosed "}"#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.contains("does not parse"), "{body}");
        let (status, _, _) =
            send(&app, "k", &format!(r#"{{"query":"{}"}}"#, "x".repeat(2048))).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        // A 10 MB body is cut off at the cap, without being read whole.
        let (status, _, body) = send(&app, "k", &"x".repeat(10 * 1024 * 1024)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(body.contains("\"limit\":1024"), "{body}");
        // Invalid UTF-8 as application/graphql.
        let request = Request::post("/graphql")
            .header("x-api-key", "k")
            .header("content-type", "application/graphql")
            .body(Body::from(vec![0xff, 0xfe, b'{']))
            .unwrap();
        assert_eq!(
            app.clone().oneshot(request).await.unwrap().status(),
            StatusCode::BAD_REQUEST
        );
        // GET ?query= is costed too.
        let request = Request::get("/graphql?query=%7B%20viewer%20%7B%20id%20%7D%20%7D")
            .header("x-api-key", "k")
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["graphql-cost"], "1");
        // Charging a minimum instead: the GraphQL server gets to answer.
        let lenient = app_with_minimum();
        let (status, cost, _) = send(&lenient, "k", r#"{"query":"{ unclosed "}"#).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("5")));
    }

    fn app_with_minimum() -> Router {
        app(GraphqlCostLayer::new(GraphqlCost::new()).on_invalid(Invalid::Charge(5)))
    }
}

const SDL: &str = r#"
    directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION | SCALAR | ENUM | ARGUMENT_DEFINITION
    directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION

    type Query {
      viewer: User
      search(first: Int, last: Int): SearchConnection @listSize(slicingArguments: ["first", "last"], sizedFields: ["nodes"])
      feed: [Post] @listSize(assumedSize: 25, requireOneSlicingArgument: false)
      node(id: ID!): Node
      tags(limit: Int = 30): [String]
    }
    interface Node { id: ID! }
    type User implements Node { id: ID! login: String avatar: Image @cost(weight: 3) }
    type Post implements Node { id: ID! title: String author: User }
    type Image @cost(weight: 2) { url: String }
    union SearchResult = User | Post
    type SearchConnection { totalCount: Int nodes: [SearchResult] }
    type Mutation { like(id: ID!): Post @cost(weight: 7) }
"#;

#[test]
fn schema_cost_table() {
    let coster = GraphqlCost::new().with_schema(SDL).unwrap();
    let table: &[(&str, u64)] = &[
        // An object field 1, leaves 0, @cost on a field replaces its weight (3, not 2).
        ("{ viewer { login avatar { url } } }", 1 + 3),
        // @cost on a type: every Image costs 2 where nothing overrides it.
        ("{ feed { author { avatar { url } } } }", 1 + 25 * (1 + 3)),
        // sizedFields: the size multiplies nodes, not totalCount; a union costs its most
        // expensive member (User: 1 + avatar 3 = 4; Post: 1 + author 1 = 2).
        (
            "{ search(first: 10) { totalCount nodes { ... on User { avatar { url } } ... on Post { author { id } } } } }",
            1 + 10 * (1 + 3),
        ),
        // An interface: the most expensive implementation of the fragments spread.
        (
            "{ node(id: 1) { id ... on User { avatar { url } } } }",
            1 + 3,
        ),
        (
            "query { node(id: 1) { ...P } } fragment P on Post { author { login } }",
            1 + 1,
        ),
        // A mutation: the base, plus the field's own weight.
        ("mutation { like(id: 1) { title } }", 10 + 7),
        // Leaves with a slicing default of 30 stay free.
        ("{ tags }", 0),
    ];
    for (query, expected) in table {
        assert_eq!(
            coster.query_cost(query, None, None).unwrap(),
            *expected,
            "{query}"
        );
    }
    // requireOneSlicingArgument: a connection queried without first or last is refused.
    let error = coster
        .query_cost("{ search { totalCount } }", None, None)
        .unwrap_err();
    assert!(
        matches!(error, CostError::Slicing { value: None, .. }),
        "{error}"
    );
    // The slicing value from the request's variables.
    let variables = json!({ "n": 4 });
    assert_eq!(
        coster
            .query_cost(
                "query($n: Int) { search(last: $n) { nodes { ... on Post { title } } } }",
                None,
                variables.as_object()
            )
            .unwrap(),
        1 + 4 * 1
    );
}
