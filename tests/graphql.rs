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

/// Queries and their cost without a schema.
const COST_TABLE: &[(&str, u64)] = &[
    // Scalars are free, but an operation costs at least 1; an object field costs 1.
    ("{ hello }", 1),
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

#[test]
fn cost_table() {
    for (query, expected) in COST_TABLE {
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
    // Below the range is charged the most too: many servers read a negative or zero
    // limit as no limit (SQLite's `LIMIT -1` returns every row), so the nearest value
    // (1) undercharged the worst case.
    assert_eq!(cap.query_cost(&query("-5"), None, None).unwrap(), 1 + 100);
    assert_eq!(cap.query_cost(&query("0"), None, None).unwrap(), 1 + 100);
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

/// A fragment cycle: A spreads B, which spreads A.
const CYCLE: &str = "{ ...A } fragment A on Q { b { ...B } } fragment B on Q { a { ...A } }";

/// `levels` fields, each nested in the previous one.
fn deep(levels: usize) -> String {
    "{ a ".repeat(levels) + &"}".repeat(levels)
}

/// Fragment fan-out: each of 30 levels spreads the next ten times (10^30 expansions if
/// expanded naively).
fn fanout() -> String {
    let mut fanout = String::from("{ ...F0 }");
    for level in 0..30 {
        let spreads: String = (0..10)
            .map(|i| format!(" a{i}: x {{ ...F{} }}", level + 1))
            .collect();
        fanout.push_str(&format!(" fragment F{level} on Q {{{spreads} }}"));
    }
    fanout.push_str(" fragment F30 on Q { leaf { id } }");
    fanout
}

/// `n` aliases of one object field.
fn aliases(n: usize) -> String {
    let aliases: String = (0..n).map(|i| format!(" a{i}: viewer {{ id }}")).collect();
    format!("{{{aliases} }}")
}

/// `fields` scalar fields in one selection set, the shape of a 10 MB document.
fn huge(fields: usize) -> String {
    format!("{{ {} }}", "f ".repeat(fields))
}

// A leaf costs nothing, but each alias of it is one more value resolved and sent: written
// 5,000 times under two lists of 100, it asked for 50 million values at the price of one
// (`{ users(first: 100) { friends(first: 100) { a0: name a1: name ... } } }` cost 101
// with one alias or 5,000). An aliased leaf costs 1, so the price grows with the aliases
// and the list sizes multiply them; a leaf under its own name still costs nothing.
#[test]
fn aliases_of_a_leaf_are_each_charged() {
    let leaves = |n: usize| -> String { (0..n).map(|i| format!(" a{i}: name")).collect() };
    let nested = |n: usize| {
        format!(
            "{{ users(first: 100) {{ friends(first: 100) {{{} }} }} }}",
            leaves(n)
        )
    };
    // users 1 + 100 x (friends 1 + 100 x n)
    assert_eq!(cost(&nested(1)).unwrap(), 1 + 100 * (1 + 100));
    assert_eq!(cost(&nested(50)).unwrap(), 1 + 100 * (1 + 100 * 50));
    assert_eq!(
        cost(&format!("{{ users(first: 10) {{{} }} }}", leaves(3))).unwrap(),
        1 + 10 * 3
    );
    // `__typename` too.
    assert_eq!(
        cost("{ users(first: 10) { a: __typename b: __typename } }").unwrap(),
        1 + 10 * 2
    );
    // Under its own name (or an alias that is its name), a leaf is still free.
    assert_eq!(cost("{ users(first: 10) { name id } }").unwrap(), 1);
    assert_eq!(cost("{ users(first: 10) { name: name } }").unwrap(), 1);
    // With a schema: an aliased scalar costs its weight, and 1 at least.
    let sdl = "type Query { users(first: Int): [User] } type User { name: String }";
    let coster = GraphqlCost::new().with_schema(sdl).unwrap();
    let query = format!("{{ users(first: 10) {{{} }} }}", leaves(4));
    assert_eq!(coster.query_cost(&query, None, None).unwrap(), 1 + 10 * 4);
}

#[test]
fn attack_corpus() {
    let coster = GraphqlCost::new();
    // 10,000 levels of nesting: refused by the parser's recursion limit, no overflow.
    let deep = deep(10_000);
    assert!(matches!(
        coster.query_cost(&deep, None, None),
        Err(CostError::Parse(_) | CostError::TooDeep { .. })
    ));
    // Fragment cycles.
    assert!(matches!(
        coster.query_cost(CYCLE, None, None),
        Err(CostError::FragmentCycle(_))
    ));
    assert!(matches!(
        coster.query_cost("{ ...Missing }", None, None),
        Err(CostError::UnknownFragment(_))
    ));
    // Fragment fan-out: each fragment is costed once; the total saturates.
    assert_eq!(coster.query_cost(&fanout(), None, None).unwrap(), u64::MAX);
    // Aliases: every one counts; 10,000 of them exceed the token limit (a clear error).
    assert_eq!(
        coster.query_cost(&aliases(1_000), None, None).unwrap(),
        1_000
    );
    let error = coster.query_cost(&aliases(10_000), None, None).unwrap_err();
    assert!(error.to_string().contains("token limit"), "{error}");
    // Token limit: a 10 MB document is refused without being walked.
    let big = huge(5_000_000);
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
/// rate limiter had a say. Only the first error is rendered, so the answer is one error
/// of a bounded size however many the document holds (asserted on the answer, not on the
/// machine's speed).
#[test]
fn a_document_full_of_syntax_errors_is_refused_at_parse_speed() {
    let document = format!("{{ {} }}", "a(b: ) ".repeat(1_500));
    let error = cost(&document).unwrap_err();
    assert!(matches!(error, CostError::Parse(_)), "{error}");
    let said = error.to_string();
    assert_eq!(said.matches("syntax error").count(), 1, "{said}");
    assert!(said.len() < 500, "{} bytes: {said}", said.len());
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

    /// Requests that run no GraphQL operation pass through untouched: a CORS preflight,
    /// `HEAD`, and a `GET` without `query` (the IDE page many servers show). The
    /// limiter charges them its default cost; nothing is answered `400`.
    #[tokio::test]
    async fn requests_that_run_no_operation_pass_through() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        for method in [http::Method::OPTIONS, http::Method::HEAD, http::Method::GET] {
            let request = Request::builder()
                .method(method.clone())
                .uri("/graphql")
                .header("x-api-key", "k")
                .header("origin", "https://app.example")
                .header("access-control-request-method", "POST")
                .body(Body::empty())
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_ne!(
                response.status(),
                StatusCode::BAD_REQUEST,
                "{method} without a query"
            );
            assert!(
                response.headers().get("graphql-cost").is_none(),
                "{method}: no operation, no GraphQL cost"
            );
            assert!(
                response.headers().contains_key("ratelimit"),
                "{method}: still limited, at the default cost"
            );
        }
    }

    /// A WebSocket upgrade (`graphql-transport-ws`) opens a connection whose operations
    /// travel in messages the coster never sees: passed through at the default cost, one
    /// unit would buy any number of subscriptions, queries and mutations. It is a request
    /// the coster cannot cost, so `on_invalid` answers it: refused by default, charged
    /// what `Invalid::Charge` says when the server is to get it.
    #[tokio::test]
    async fn a_connection_upgrade_is_a_request_that_cannot_be_costed() {
        let upgrade = |method: http::Method| {
            Request::builder()
                .method(method)
                .uri("/graphql")
                .header("x-api-key", "k")
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-protocol", "graphql-transport-ws")
                .body(Body::empty())
                .unwrap()
        };
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        for method in [http::Method::GET, http::Method::POST] {
            let response = app.clone().oneshot(upgrade(method.clone())).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{method}");
        }
        // HTTP/2's extended CONNECT (RFC 8441) opens a WebSocket too.
        let response = app
            .clone()
            .oneshot(
                Request::builder()
                    .method(http::Method::CONNECT)
                    .uri("/graphql")
                    .header("x-api-key", "k")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "CONNECT");
        let lenient = app_with_minimum();
        let response = lenient.oneshot(upgrade(http::Method::GET)).await.unwrap();
        assert_eq!(response.headers()["graphql-cost"], "5");

        // `Upgrade: h2c` (the JDK's client and curl send it on plain `http://`) is no
        // switch: hyper serves the request as it is, so it is costed as any other.
        let request = Request::post("/graphql")
            .header("x-api-key", "k")
            .header("content-type", "application/json")
            .header("connection", "Upgrade, HTTP2-Settings")
            .header("upgrade", "h2c")
            .header("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA")
            .body(Body::from(r#"{"query":"{ a { b } }"}"#))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["graphql-cost"], "1");
    }

    /// Two `Content-Type` fields: the coster would read the body as the first says, a
    /// server (or a proxy further on) might read it as the last (a form whose `query`
    /// hides behind an `&` in a JSON string). A request with more than one is refused.
    #[tokio::test]
    async fn a_body_with_two_content_types_is_refused() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let request = Request::post("/graphql")
            .header("x-api-key", "k")
            .header("content-type", "application/json")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(
                r#"{"query":"{ a }","x":"&query={ b { c { d } } }#"}"#,
            ))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(response.headers().get("graphql-cost").is_none());
        // The same two types folded into one field, as a proxy may fold them.
        let request = Request::post("/graphql")
            .header("x-api-key", "k")
            .header(
                "content-type",
                "application/x-www-form-urlencoded, application/graphql+json",
            )
            .body(Body::from(
                r#"{"query":"{ a }","x":"&query={ b { c { d } } }#"}"#,
            ))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        // ...or folded after a parameter; a comma in a quoted parameter is no fold.
        for (content_type, status) in [
            (
                "application/json;v=1, application/graphql",
                StatusCode::BAD_REQUEST,
            ),
            ("application/json; profile=\"a,b\"", StatusCode::OK),
        ] {
            let request = Request::post("/graphql")
                .header("x-api-key", "k")
                .header("content-type", content_type)
                .body(Body::from(r#"{"query":"{ a { b } }"}"#))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), status, "{content_type}");
        }
    }

    /// What could run an operation is costed, whatever its method: a `HEAD` or `OPTIONS`
    /// with a body (a server may read the operation from any body), a persisted query's
    /// `GET` (no `query`, but `extensions`), and a `GET` whose `query` is given twice (a
    /// server may run either).
    #[tokio::test]
    async fn what_could_run_an_operation_is_costed_whatever_its_method() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let body = r#"{"query":"{ a { b { c } } }"}"#;
        for method in [http::Method::HEAD, http::Method::OPTIONS] {
            let request = Request::builder()
                .method(method.clone())
                .uri("/graphql")
                .header("x-api-key", "k")
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(
                response
                    .headers()
                    .get("graphql-cost")
                    .map(|v| v.to_str().unwrap()),
                Some("2"),
                "{method} with a body"
            );
        }
        for uri in [
            "/graphql?extensions=%7B%22persistedQuery%22%3A%7B%7D%7D",
            "/graphql?query=%7B%20a%20%7D&query=%7B%20a%20%7B%20b%20%7D%20%7D",
            // A server may take the first of two, the coster the last.
            "/graphql?query=query%20A%7Ba%7D%20query%20B%7Ba%7Bb%7D%7D&operationName=B&operationName=A",
            "/graphql?query=%7Ba%7D&variables=%7B%7D&variables=%7B%7D",
        ] {
            let request = Request::get(uri)
                .header("x-api-key", "k")
                .body(Body::empty())
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        }
    }

    /// A name twice in one JSON object is refused: RFC 8259 (section 4) says the names of
    /// an object SHOULD be unique, and that implementations differ on which of two they
    /// keep: serde_json keeps the last, a first-match lookup (a gateway's) the first. The
    /// coster cannot know which query, operation or variable value the server reads, as
    /// with a URL parameter given twice. Each body below was costed as its cheap half.
    #[tokio::test]
    async fn a_name_twice_in_a_json_object_is_refused() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let counted =
            r#"{"query":"query($n: Int) { a(first: $n) { b { c } } }","variables":{"n":5}}"#;
        let (status, cost, _) = send(&app, "k", counted).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("6")));
        for body in [
            r#"{"query":"{ a(first: 50) { b(first: 50) { c } } }","query":"{ a }"}"#,
            r#"{"query":"query A { a } query B { a(first: 50) { b } }","operationName":"B","operationName":"A"}"#,
            r#"{"query":"query($n: Int) { a(first: $n) { b { c } } }","variables":{"n":100000,"n":5}}"#,
            r#"{"query":"query($n: Int) { a(first: $n) { b { c } } }","variables":{"n":100000},"variables":{"n":5}}"#,
            r#"{"query":"query($i: In) { a(input: $i) { b } }","variables":{"i":{"first":100000,"first":5}}}"#,
            r#"[{"query":"{ a }"},{"query":"{ a(first: 50) { b } }","query":"{ a }"}]"#,
        ] {
            let (status, cost, text) = send(&app, "k", body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
            assert_eq!(cost, None, "{body}");
            assert!(text.contains("twice"), "{body}: {text}");
        }
        // The variables of a URL alike.
        let uri = "/graphql?query=query(%24n%3A%20Int)%20%7B%20a(first%3A%20%24n)%20%7B%20b%20\
                   %7B%20c%20%7D%20%7D%20%7D&variables=%7B%22n%22%3A100000%2C%22n%22%3A5%7D";
        let (status, cost) = sent(&app, "k", &http::Method::GET, uri, "", "").await;
        assert_eq!((status, cost), (StatusCode::BAD_REQUEST, None));
    }

    /// The coster's own refusals of a `HEAD` carry no body: a `HEAD` response has none,
    /// and its `Content-Length` says what the `GET` would be sent (RFC 9110, sections
    /// 8.6 and 9.3.2). axum's routes strip a `HEAD`'s body, but the layer also wraps
    /// plain tower services, and hyper drops such a body over HTTP/1 only: over HTTP/2
    /// it would be sent.
    #[tokio::test]
    async fn a_refused_head_gets_no_body() {
        let app = tower::ServiceBuilder::new()
            .layer(GraphqlCostLayer::new(GraphqlCost::new()).max_body(16))
            .service_fn(|_: Request<Body>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
            });
        let refused = [
            // Two queries in the URL: refused before any body is read.
            (
                Request::head("/graphql?query=%7Ba%7D&query=%7Bb%7D")
                    .header("x-api-key", "k")
                    .body(Body::empty())
                    .unwrap(),
                StatusCode::BAD_REQUEST,
            ),
            // A body past the bound: refused while it is read.
            (
                Request::head("/graphql")
                    .header("x-api-key", "k")
                    .header("content-type", "application/json")
                    .body(Body::from(r#"{"query":"{ a { b { c } } }"}"#))
                    .unwrap(),
                StatusCode::PAYLOAD_TOO_LARGE,
            ),
            // A body that is no operation: refused once read.
            (
                Request::head("/graphql")
                    .header("x-api-key", "k")
                    .header("content-type", "application/json")
                    .body(Body::from("{]"))
                    .unwrap(),
                StatusCode::BAD_REQUEST,
            ),
        ];
        for (request, status) in refused {
            let uri = request.uri().clone();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), status, "{uri}");
            let length = response.headers().get("content-length").cloned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert!(body.is_empty(), "{uri}: a HEAD answered with {body:?}");
            assert!(
                length.is_some_and(|length| length != "0"),
                "{uri}: Content-Length should be the GET's"
            );
        }
    }

    /// An operation in the URL is costed whatever the method: a `HEAD` runs the `GET`
    /// handler (axum routes it so), and a server may read a `POST`'s `query`,
    /// `variables` or `operationName` from its URL before its body (express-graphql and
    /// graphql-go do), so a `POST` whose URL carries a query or variables, or names
    /// another operation than its body, is refused, not costed by its body. A preflight
    /// to a `GET`'s URL passes: it runs nothing.
    #[tokio::test]
    async fn an_operation_in_the_url_is_costed_whatever_the_method() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let expensive = "/graphql?query=%7B%20a%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D";
        let two = r#"{"query":"query A { a } query B { a { b } }","operationName":"A"}"#;
        let json = "application/json";
        // Method, URL, content type, body; the status and GraphQL-Cost expected.
        type Case<'a> = (
            Method,
            &'a str,
            &'a str,
            &'a str,
            StatusCode,
            Option<&'a str>,
        );
        let cases: &[Case<'_>] = &[
            // A HEAD, as the GET it runs.
            (Method::HEAD, expensive, "", "", StatusCode::OK, Some("2")),
            // A query, variables or another operation in a POST's URL: refused.
            (
                Method::POST,
                expensive,
                json,
                r#"{"query":"{ __typename }"}"#,
                StatusCode::BAD_REQUEST,
                None,
            ),
            (
                Method::POST,
                "/graphql?variables=%7B%22n%22%3A100%7D",
                "application/graphql",
                "query($n: Int = 1) { repos(first: $n) { nodes { id } } }",
                StatusCode::BAD_REQUEST,
                None,
            ),
            (
                Method::POST,
                "/graphql?operationName=B",
                json,
                two,
                StatusCode::BAD_REQUEST,
                None,
            ),
            // A HEAD or an OPTIONS with a body is read as a POST (some servers run
            // operations on them): variables in its URL are refused alike.
            (
                Method::HEAD,
                "/graphql?variables=%7B%22n%22%3A100%7D",
                json,
                r#"{"query":"query($n: Int = 1) { repos(first: $n) { nodes { id } } }"}"#,
                StatusCode::BAD_REQUEST,
                None,
            ),
            (
                Method::OPTIONS,
                "/graphql?variables=%7B%22n%22%3A100%7D",
                json,
                r#"{"query":"query($n: Int = 1) { repos(first: $n) { nodes { id } } }"}"#,
                StatusCode::BAD_REQUEST,
                None,
            ),
            // The same name in another case, which some servers read as it.
            (
                Method::POST,
                "/graphql?OperationName=B",
                json,
                two,
                StatusCode::BAD_REQUEST,
                None,
            ),
            // A URL that repeats the body's operation name, or carries a parameter of the
            // application's own, is costed by the body; an `application/graphql` body
            // runs the operation the URL names.
            (
                Method::POST,
                "/graphql?operationName=A",
                json,
                two,
                StatusCode::OK,
                Some("1"),
            ),
            (
                Method::POST,
                "/graphql?id=tenant-7",
                json,
                r#"{"query":"{ a { b } }"}"#,
                StatusCode::OK,
                Some("1"),
            ),
            (
                Method::POST,
                "/graphql?operationName=B",
                "application/graphql",
                "query A { a } query B { a { b { c } } }",
                StatusCode::OK,
                Some("2"),
            ),
            // A preflight to a GET's URL runs nothing (the router has no OPTIONS route).
            (
                Method::OPTIONS,
                expensive,
                "",
                "",
                StatusCode::METHOD_NOT_ALLOWED,
                None,
            ),
        ];
        for (method, uri, content_type, body, status, cost) in cases {
            let answer = sent(&app, "url", method, uri, content_type, body).await;
            assert_eq!(answer, (*status, cost.map(str::to_owned)), "{method} {uri}");
        }
        // A preflight whose empty body is not known to be empty until read (HTTP/2
        // without END_STREAM on its headers, a chunked body of no chunk) is a preflight
        // still: read, found empty, and passed on.
        let empty = || {
            Body::from_stream(futures_util::stream::empty::<
                Result<bytes::Bytes, std::io::Error>,
            >())
        };
        for uri in [expensive, "/graphql?variables=%7B%22n%22%3A100%7D"] {
            let (status, _) = request(&app, "url", Method::OPTIONS, uri, &[], empty()).await;
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "OPTIONS {uri}");
        }
    }

    /// The status and `GraphQL-Cost` of one request (`content_type` empty: none).
    async fn sent(
        app: &Router,
        key: &str,
        method: &http::Method,
        uri: &str,
        content_type: &str,
        body: &str,
    ) -> (StatusCode, Option<String>) {
        let typed = [("content-type", content_type)];
        let headers = if content_type.is_empty() {
            &[][..]
        } else {
            &typed[..]
        };
        request(app, key, method.clone(), uri, headers, body.to_owned()).await
    }

    /// A `%` not followed by two hex digits: Go's `url.ParseQuery` drops the whole pair
    /// (graphql-go's handler reads a GET's parameters so, and ignores the error), where a
    /// reader that passes the `%` through (this one, and most) keeps it. `variables` with
    /// one inside a string were read here (`$n: 1`, 2 points) and dropped there: the
    /// document's own default ran (`$n = 1000`). Refused in the parameters of an
    /// operation, as a raw `;` is.
    #[tokio::test]
    async fn malformed_escapes_are_not_a_way_around_the_cost() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let query = "query(%24n%3AInt%3D1000)%7Ba(first%3A%24n)%7Bb%7Bc%7D%7D%7D";
        for variables in [
            "%7B%22n%22%3A1%2C%22x%22%3A%22%ZZ%22%7D",
            "%7B%22n%22%3A1%2C%22x%22%3A%22%2%22%7D",
            "%7B%22n%22%3A1%2C%22x%22%3A%22%%22%7D",
        ] {
            let uri = format!("/graphql?query={query}&variables={variables}");
            let answer = sent(&app, "escapes", &Method::GET, &uri, "", "").await;
            assert_eq!(answer, (StatusCode::BAD_REQUEST, None), "{uri}");
            let form = format!("query={query}&variables={variables}");
            let answer = sent(
                &app,
                "escapes",
                &Method::POST,
                "/graphql",
                "application/x-www-form-urlencoded",
                &form,
            )
            .await;
            assert_eq!(answer, (StatusCode::BAD_REQUEST, None), "{form}");
        }
        // Well escaped, the same operation is costed as usual.
        let uri = format!("/graphql?query={query}&variables=%7B%22n%22%3A1%7D");
        let answer = sent(&app, "escapes", &Method::GET, &uri, "", "").await;
        assert_eq!(answer, (StatusCode::OK, Some("2".to_owned())), "{uri}");
    }

    /// Some servers split a URL's parameters on `;` as well as `&` (Rack before 3, Go
    /// before 1.17, the HTML 4 recommendation): `?query={ a }#;query={ expensive }` reads
    /// there as two `query` parameters, the last one run, and here as one query whose
    /// `#` comments the rest out. A `;` left raw in a URL that names an operation (clients
    /// escape it: `%3B`) is refused, and a parameter hidden behind one counts as given.
    #[tokio::test]
    async fn parameters_split_on_semicolons_are_not_a_way_around_the_cost() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let cases: &[(Method, &str, &str, StatusCode, Option<&str>)] = &[
            // `{ a }#;query={ a { b { c } } }`
            (
                Method::GET,
                "/graphql?query=%7B%20a%20%7D%23;query=%7B%20a%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D",
                "",
                StatusCode::BAD_REQUEST,
                None,
            ),
            // The operation only behind a `;`: not the IDE page, so costed (refused).
            (
                Method::GET,
                "/graphql?x=1;query=%7B%20a%20%7B%20b%20%7D%20%7D",
                "",
                StatusCode::BAD_REQUEST,
                None,
            ),
            // A POST whose URL hides a query behind a `;`.
            (
                Method::POST,
                "/graphql?x=1;query=%7B%20a%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D",
                r#"{"query":"{ a }"}"#,
                StatusCode::BAD_REQUEST,
                None,
            ),
            // Another operation named behind a `;`.
            (
                Method::POST,
                "/graphql?x=1;operationName=B",
                r#"{"query":"query A { a } query B { a { b } }","operationName":"A"}"#,
                StatusCode::BAD_REQUEST,
                None,
            ),
            // Escaped, a `;` is part of a value: costed as usual.
            (
                Method::GET,
                "/graphql?query=%7B%20a%20%7B%20b%20%7D%20%7D%23%3B",
                "",
                StatusCode::OK,
                Some("1"),
            ),
            // An application's own parameters with a `;` and no operation: not GraphQL's.
            (
                Method::POST,
                "/graphql?tenant=7;region=eu",
                r#"{"query":"{ a { b } }"}"#,
                StatusCode::OK,
                Some("1"),
            ),
        ];
        for (method, uri, body, status, cost) in cases {
            let json = if body.is_empty() {
                ""
            } else {
                "application/json"
            };
            let answer = sent(&app, "semicolons", method, uri, json, body).await;
            assert_eq!(answer, (*status, cost.map(str::to_owned)), "{method} {uri}");
        }
    }

    /// The same over `GET`: `?query={ a }&documentId=X` may run the stored document there,
    /// and a parameter name in another case (`QUERY`, read case-insensitively by ASP.NET
    /// Core's query collection, which Hot Chocolate reads) is a parameter the server sees.
    #[tokio::test]
    async fn a_get_is_costed_only_as_what_the_server_may_run() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let expensive = "%7B%20a%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D";
        let cases: &[(String, StatusCode)] = &[
            (
                "/graphql?query=%7B%20a%20%7D&documentId=p%2Fbig".to_owned(),
                StatusCode::BAD_REQUEST,
            ),
            (
                "/graphql?query=%7B%20a%20%7D&doc_id=3be4abb8".to_owned(),
                StatusCode::BAD_REQUEST,
            ),
            (
                format!("/graphql?QUERY={expensive}"),
                StatusCode::BAD_REQUEST,
            ),
            (
                format!("/graphql?query=%7B%20a%20%7D&Query={expensive}"),
                StatusCode::BAD_REQUEST,
            ),
            (format!("/graphql?query={expensive}"), StatusCode::OK),
            // An automatic persisted query's registering round, over GET: the hash beside
            // its document, costed by the document.
            (
                format!(
                    "/graphql?query={expensive}&extensions=%7B%22persistedQuery%22%3A%7B%22version%22%3A1%2C%22sha256Hash%22%3A%220f3c%22%7D%7D"
                ),
                StatusCode::OK,
            ),
        ];
        for (uri, status) in cases {
            let (answer, _) = sent(&app, "get", &Method::GET, uri, "", "").await;
            assert_eq!(answer, *status, "{uri}");
        }
        // A JSON key `DocumentId` is `documentId` to a server that reads keys in any case.
        let body = serde_json::json!({ "query": "{ a }", "DocumentId": "p/big" });
        assert!(
            GraphqlCost::new()
                .json_cost(body.to_string().as_bytes())
                .is_err()
        );
    }

    /// A refusal's detail echoes what the client sent (an operation's name, a field's),
    /// cut to a kilobyte: an `operationName` of 200 KB came back whole in the 400 (and in
    /// any log of the answers).
    #[tokio::test]
    async fn a_refusal_echoes_no_clients_megabyte() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let name = "N".repeat(200_000);
        let body = serde_json::json!({ "query": "query A { a }", "operationName": name });
        let (status, _, answer) = send(&app, "echo", &body.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(answer.contains("NNNN"), "{answer}");
        assert!(answer.len() < 2_048, "{} bytes", answer.len());
        let problem: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert!(problem["detail"].as_str().unwrap().ends_with('…'));
    }

    /// PHP skips leading spaces in a parameter's name and Rack (before 3) strips brackets
    /// around it, and both read `query[x]` as a list or map under `query`: `?[query]=`,
    /// `?+query=` and `?query]=` are `query` to graphql-php, Lighthouse and graphql-ruby's
    /// Rails controller. Such a GET passed as one that "runs no operation" (the default
    /// cost), and beside a cheap `query` the costly one ran there. Refused, in the URL and
    /// in a form.
    #[tokio::test]
    async fn a_parameter_name_php_or_rack_files_under_a_graphql_key_is_refused() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let expensive = "%7B%20a%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D";
        for name in [
            "%5Bquery%5D",
            "%5Dquery",
            "query%5D",
            "+query",
            "%20query",
            "query%5Bx%5D",
            "%5Bvariables%5D",
            "+operationName",
            // PHP reads a name to its first NUL.
            "query%00",
            "query%00x",
        ] {
            // Alone, only a `query` runs anything there.
            let alone = name
                .contains("query")
                .then(|| format!("/graphql?{name}={expensive}"));
            let beside = format!("/graphql?query=%7B%20a%20%7D&{name}={expensive}");
            for uri in alone.into_iter().chain([beside]) {
                let (answer, _) = sent(&app, "brackets", &Method::GET, &uri, "", "").await;
                assert_eq!(answer, StatusCode::BAD_REQUEST, "{uri}");
            }
            let form = format!("query=%7B%20a%20%7D&{name}={expensive}");
            let request = Request::post("/graphql")
                .header("x-api-key", "brackets")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(Body::from(form.clone()))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{form}");
        }
        let cheap_or_costly = r#"{"query":"query Cheap { a } query Costly { a { b { c } } }","operationName":"Cheap"}"#;
        let doc_id = format!("/graphql?query={expensive}&doc.id=3be4abb8");
        let own = format!("/graphql?query={expensive}&filter%5Bq%5D=1&+page=2");
        let url_over_body = format!("/graphql?%5Dquery={expensive}");
        for (method, uri, content_type, body, status) in [
            // Rails merges the URL's parameters over a JSON body's.
            (
                Method::POST,
                &url_over_body[..],
                "application/json",
                r#"{"query":"{ a }"}"#,
                StatusCode::BAD_REQUEST,
            ),
            // PHP turns `.` and ` ` in a name into `_`: `doc.id` is `doc_id` there.
            (Method::GET, &doc_id[..], "", "", StatusCode::BAD_REQUEST),
            // Rails takes the URL's `operationName` over the body's.
            (
                Method::POST,
                "/graphql?%5BoperationName%5D=Costly",
                "application/json",
                cheap_or_costly,
                StatusCode::BAD_REQUEST,
            ),
            // Names of the application's own, with brackets, are not GraphQL's.
            (Method::GET, &own[..], "", "", StatusCode::OK),
        ] {
            let (answer, _) = sent(&app, "brackets", &method, uri, content_type, body).await;
            assert_eq!(answer, status, "{method} {uri}");
        }
    }

    /// A body is costed only as what the server reads it as: JSON (`application/json`,
    /// any `+json` type, or no type) or a GraphQL document (`application/graphql`), in
    /// UTF-8. A form body that is also valid JSON is read as a form by servers that take
    /// forms (express-graphql, graphql-go); a JSON body in UTF-7 decodes to other keys.
    #[tokio::test]
    async fn a_body_is_costed_only_as_what_the_server_reads() {
        use http::Method;
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        let trick = r#"{"query":"{ a } #&query={ a { b { c } } }&"}"#;
        let cases: &[(Option<&str>, &str, StatusCode)] = &[
            (
                Some("application/x-www-form-urlencoded"),
                trick,
                StatusCode::BAD_REQUEST,
            ),
            (Some("text/plain"), trick, StatusCode::BAD_REQUEST),
            (
                Some("application/json; charset=utf-7"),
                r#"{"query":"{ a }"}"#,
                StatusCode::BAD_REQUEST,
            ),
            (
                Some("application/json; charset=UTF-8"),
                r#"{"query":"{ a { b } }"}"#,
                StatusCode::OK,
            ),
            (
                Some("application/json; charset=\"utf-8\""),
                r#"{"query":"{ a { b } }"}"#,
                StatusCode::OK,
            ),
            (
                Some("application/graphql-response+json"),
                r#"{"query":"{ a { b } }"}"#,
                StatusCode::OK,
            ),
            (None, r#"{"query":"{ a { b } }"}"#, StatusCode::OK),
        ];
        for (content_type, body, status) in cases {
            let mut request = Request::builder()
                .method(Method::POST)
                .uri("/graphql")
                .header("x-api-key", "types");
            if let Some(content_type) = content_type {
                request = request.header("content-type", *content_type);
            }
            let request = request.body(Body::from(body.to_string())).unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), *status, "{content_type:?}");
        }
    }

    /// A form body (`application/x-www-form-urlencoded`) is an operation to the servers
    /// that read forms (express-graphql, graphql-go): it is costed as its parameters say,
    /// read as a `GET`'s URL is, never let through at `Invalid::Charge`'s fixed charge.
    #[tokio::test]
    async fn a_form_body_is_costed_as_its_parameters_say() {
        let post = |app: &Router, form: &str| {
            let request = Request::post("/graphql")
                .header("x-api-key", "forms")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(Body::from(form.to_owned()))
                .unwrap();
            app.clone().oneshot(request)
        };
        let costly = "query=%7B%20a(first%3A50)%20%7B%20b(first%3A50)%20%7B%20c%20%7D%20%7D%20%7D";
        for app in [
            app(GraphqlCostLayer::new(GraphqlCost::new())),
            app_with_minimum(),
        ] {
            let response = post(&app, costly).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(response.headers()["graphql-cost"], "51");
            let response = post(&app, "query=%7B+a+%7B+b+%7D+%7D&variables=%7B%7D")
                .await
                .unwrap();
            assert_eq!(response.headers()["graphql-cost"], "1");
            // A form with nothing to decode reads the same to gqlgen, which takes a form
            // that does not start `query=%7B` as the raw text after `query=`; where that
            // raw text is no document (`%` and `+` are no GraphQL tokens), gqlgen runs
            // nothing, and the form is costed as the others read it.
            for (costed, cost) in [
                ("query={ a { b } }", "1"),
                ("query=query%20Q%20%7B%20a%20%7B%20b%20%7D%20%7D", "1"),
                // A mutation's base (10) and its field.
                ("query=mutation%20%7B%20a%20%7B%20b%20%7D%20%7D", "11"),
                ("query=%0A%7B%20a%20%7B%20b%20%7D%20%7D", "1"),
                ("query=%7b%20a%20%7B%20b%20%7D%20%7d", "1"),
                ("variables=%7B%7D&query=%7B%20a%20%7B%20b%20%7D%20%7D", "1"),
            ] {
                let response = post(&app, costed).await.unwrap();
                assert_eq!(response.status(), StatusCode::OK, "{costed}");
                assert_eq!(response.headers()["graphql-cost"], cost, "{costed}");
            }
            // What a server may read otherwise is refused, whatever `on_invalid` says:
            // a parameter twice, a name in another case, a documentId beside a query.
            let padded = format!(
                "query=%7B%20a(first%3A1)%20%7B%20b%20%7D%20%7D{}&variables=%7B%7D",
                "&p=1".repeat(1_000)
            );
            for refused in [
                "query=%7Ba%7D&query=%7Ba%7Bb%7D%7D",
                "query=%7Ba%7D&QUERY=%7Ba%7Bb%7D%7D",
                "query=%7Ba%7D&documentId=p%2Fbig",
                "query=%7Ba%7D&id=8d4bc3a0",
                "query=%7Ba%7D;query=%7Ba%7Bb%7D%7D",
                // gqlgen reads a body holding `"query":` as JSON (its first value), and
                // one that does not start `query=%7B` as raw text, undecoded.
                r#"{"query":"{ a(first: 50) { b(first: 50) { c } } }"}&query=%7Ba%7D"#,
                "query={ __type(name: \"%22) { __typename } } #\") { name } big(first: 50) { a } }",
                // express-graphql reads the first 1,000 parameters only (empty ones count).
                &padded,
                &format!(
                    "query=%7B%20a(first%3A1)%20%7B%20b%20%7D%20%7D{}&operationName=nope",
                    "&".repeat(1_000)
                ),
                // gqlgen decodes a body that starts `query=%7B` whole, `&` and all: the
                // query ends at `&` for the others, a string goes on past it for gqlgen.
                "query=%7Ba(s%3A%22&x=%22)%20big(first%3A50)%20%7Bb(first%3A50)%20%7Bc%7D%7D%7D",
            ] {
                let response = post(&app, refused).await.unwrap();
                assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{refused}");
            }
        }
        // A persisted query's form (no query to cost) goes to `on_invalid`, as its JSON does.
        let response = post(&app_with_minimum(), "documentId=abc").await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["graphql-cost"], "5");
    }

    /// A preflight or a `GET` without a query whose body is empty only once read (sent
    /// chunked) passes through as a bodiless one does; a `GET`'s body, never handed on,
    /// takes its framing headers with it.
    #[tokio::test]
    async fn an_empty_body_sent_chunked_is_still_empty() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        for method in [http::Method::OPTIONS, http::Method::GET] {
            let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = vec![Ok(bytes::Bytes::new())];
            let body = Body::from_stream(futures_util::stream::iter(chunks));
            let request = Request::builder()
                .method(method.clone())
                .uri("/graphql")
                .header("x-api-key", "k")
                .header("transfer-encoding", "chunked")
                .body(body)
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_ne!(response.status(), StatusCode::BAD_REQUEST, "{method}");
            assert!(response.headers().get("graphql-cost").is_none(), "{method}");
        }
    }

    fn app_with_minimum() -> Router {
        app(GraphqlCostLayer::new(GraphqlCost::new()).on_invalid(Invalid::Charge(5)))
    }

    /// A request with two content types (two fields, or two types folded into one) is
    /// read by the server as one of them, and servers differ on which: Go's `Header.Get`
    /// reads the first line, others the last. Under `Invalid::Charge` a document or a
    /// form that is no JSON was let through at the fixed charge, and the server that read
    /// it as `application/graphql` or as a form ran its costly query. It is refused
    /// whatever `on_invalid` says, whichever line comes first.
    #[tokio::test]
    async fn two_content_types_are_refused_not_charged() {
        let document = "query { a(first: 50) { b(first: 50) { c } } }";
        let form = "query=query%20%7B%20a(first%3A%2050)%20%7B%20b(first%3A%2050)%20%7B%20c%20%7D%20%7D%20%7D";
        let app = app_with_minimum();
        for (types, body) in [
            (&["application/graphql", "text/plain"][..], document),
            (&["text/plain", "application/graphql"][..], document),
            (
                &["application/x-www-form-urlencoded", "text/plain"][..],
                form,
            ),
            (
                &["text/plain", "application/x-www-form-urlencoded"][..],
                form,
            ),
            (&["application/graphql, text/plain"][..], document),
            (
                &["application/graphql", "application/graphql; x=1"][..],
                document,
            ),
        ] {
            let mut request = Request::post("/graphql").header("x-api-key", "two-types");
            for content_type in types {
                request = request.header("content-type", *content_type);
            }
            let response = app
                .clone()
                .oneshot(request.body(Body::from(body)).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{types:?}");
            assert!(
                response.headers().get("graphql-cost").is_none(),
                "{types:?}: charged {:?}",
                response.headers().get("graphql-cost")
            );
        }
        // One type of those the coster does not read still goes to the fixed charge.
        let request = Request::post("/graphql")
            .header("x-api-key", "two-types")
            .header("content-type", "text/plain")
            .body(Body::from(document))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.headers()["graphql-cost"], "5");
        // The same line twice says one type: the document is costed.
        let request = Request::post("/graphql")
            .header("x-api-key", "two-types")
            .header("content-type", "application/graphql")
            .header("content-type", "application/graphql")
            .body(Body::from(document))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["graphql-cost"], "51");
    }

    /// JSON in UTF-16 or UTF-32 (by its charset, or by its byte-order mark) is read by
    /// servers that decode by the declared charset (Spring's Jackson converter: Spring
    /// GraphQL, DGS): under `Invalid::Charge` it was let through at the fixed charge, as a
    /// body that is no JSON, and its costly query ran there. A body that declares another
    /// charset than UTF-8 is refused whatever it holds (no test of its bytes holds for
    /// every charset a server may decode by: EBCDIC's `{` is 0xC0), and one of another
    /// type that starts `{` or `[` in any Unicode encoding, as JSON in UTF-8 under another
    /// type is.
    #[tokio::test]
    async fn json_in_another_unicode_encoding_is_refused_not_charged() {
        let query = r#"{"query":"{ a(first: 50) { b(first: 50) { c } } }"}"#;
        let utf16 = |big: bool, bom: bool| {
            let mut bytes = Vec::new();
            for unit in bom
                .then_some(0xfeff)
                .into_iter()
                .chain(query.encode_utf16())
            {
                bytes.extend(if big {
                    unit.to_be_bytes()
                } else {
                    unit.to_le_bytes()
                });
            }
            bytes
        };
        let utf32 = |big: bool| {
            let mut bytes = Vec::new();
            for c in query.chars() {
                let unit = c as u32;
                bytes.extend(if big {
                    unit.to_be_bytes()
                } else {
                    unit.to_le_bytes()
                });
            }
            bytes
        };
        let app = app_with_minimum();
        for (charset, body) in [
            ("utf-16", utf16(false, true)),
            ("utf-16", utf16(true, true)),
            ("utf-16le", utf16(false, false)),
            ("UTF-16BE", utf16(true, false)),
            ("utf-32", utf32(false)),
            ("utf-32be", utf32(true)),
            ("iso-8859-1", query.as_bytes().to_vec()),
            // Jackson reads the first value and leaves what follows it.
            ("utf-16", [utf16(false, true), b"x".to_vec()].concat()),
            (
                "utf-16le",
                [utf16(false, false), vec![0x20, 0x00, 0x78]].concat(),
            ),
            // Java decodes a lone surrogate as U+FFFD, and a byte no charset maps alike.
            ("utf-16le", [utf16(false, false), vec![0x00, 0xd8]].concat()),
            ("windows-1252", [query.as_bytes(), b" \xe9"].concat()),
            // A charset where `{` is another byte (EBCDIC's is 0xC0): Jackson decodes by it.
            (
                "IBM037",
                vec![0xc0, 0x7f, 0x98, 0xa4, 0x85, 0x99, 0xa8, 0x7f, 0xd0],
            ),
        ] {
            let request = Request::post("/graphql")
                .header("x-api-key", "encodings")
                .header(
                    "content-type",
                    format!("application/json; charset={charset}"),
                )
                .body(Body::from(body))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{charset}");
            // Refused by the coster, not charged and refused by the handler.
            assert!(
                response.headers().get("graphql-cost").is_none(),
                "{charset}: charged {:?}",
                response.headers().get("graphql-cost")
            );
        }
        // Another charset is refused whatever else is wrong: a second type field, or a
        // coding a server ignores.
        let ebcdic = vec![0xc0, 0x7f, 0x98, 0xa4, 0x85, 0x99, 0xa8, 0x7f, 0xd0];
        for (name, value) in [
            ("content-type", "application/json; charset=IBM037"),
            ("content-encoding", "x-unknown"),
        ] {
            let request = Request::post("/graphql")
                .header("x-api-key", "encodings")
                .header("content-type", "application/json; charset=IBM037")
                .header(name, value)
                .body(Body::from(ebcdic.clone()))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name}");
            assert!(response.headers().get("graphql-cost").is_none(), "{name}");
        }
        // UTF-8 under Java's name for it is read.
        let request = Request::post("/graphql")
            .header("x-api-key", "encodings")
            .header("content-type", "application/json; charset=UTF8")
            .body(Body::from(r#"{"query":"{ a { b } }"}"#))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.headers()["graphql-cost"], "1");
        // A body of a type the coster does not read, that no charset makes JSON, still
        // goes to the fixed charge.
        let request = Request::post("/graphql")
            .header("x-api-key", "encodings")
            .header("content-type", "application/octet-stream")
            .body(Body::from(vec![0xff, 0xfe, 0x00, 0xd8]))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        // Charged, and handed on (the handler refuses what is no UTF-8 text).
        assert_eq!(response.headers()["graphql-cost"], "5");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("UTF-8"), "{body:?}");
    }

    /// `Invalid::Charge` stands in for a cost the coster cannot compute (a document that
    /// does not parse, a persisted query's hash): the server gets the request and answers
    /// in its own format. A request the coster read and refused for its limits (a list
    /// size out of range, a batch too large, nesting too deep, a document past the token
    /// limit) is one the server would run: charged 5, `first: 100000` would fetch a
    /// hundred thousand rows. So is a request a server may read otherwise than the
    /// coster did (a key in two spellings). Those are refused whatever `on_invalid` says.
    #[tokio::test]
    async fn a_fixed_charge_never_lets_through_what_the_limits_refuse() {
        let lenient = app_with_minimum();
        let deep = "{ a ".repeat(100) + &"}".repeat(100);
        let batch = format!("[{}]", [r#"{"query":"{ a { b } }"}"#; 11].join(","));
        let long = format!("{{ {} }}", "f ".repeat(30_000));
        for body in [
            r#"{"query":"{ repos(first: 100000) { nodes { id } } }"}"#.to_owned(),
            batch,
            serde_json::json!({ "query": deep }).to_string(),
            serde_json::json!({ "query": long }).to_string(),
            serde_json::json!({ "query": "{ a }", "QUERY": "{ a { b { c } } }" }).to_string(),
            // JSON the coster cannot read but a server may (Go's decoder stops after the
            // first value; express-graphql takes variables sent as a string).
            r#"{"query":"{ a(first: 100) { b(first: 100) { c } } }"} x"#.to_owned(),
            r#"{"query":"query($n: Int) { a(first: $n) { b } }","variables":"{\"n\":100000}"}"#
                .to_owned(),
            r#"{"query":"{ a }","x":"\ud800"}"#.to_owned(),
            // Several operations and no name: graphql-java (Spring GraphQL, DGS) runs the
            // first for an empty name, and a costly first one went for the charge.
            serde_json::json!({
                "query": "query Big { a(first: 100) { b(first: 100) { c } } } query Small { x }",
                "operationName": "",
            })
            .to_string(),
            serde_json::json!({ "query": "query Big { a(first: 100) { b(first: 100) { c } } } query Small { x }" })
                .to_string(),
            // A variable or a fragment defined twice: a server that does not validate
            // may read either definition (graphql-js's coercion keeps the last default
            // it meets), and the coster read the first.
            serde_json::json!({
                "query": "query($n: Int = 1, $n: Int = 100000) { a(first: $n) { b } }",
            })
            .to_string(),
            serde_json::json!({
                "query": "{ ...F } fragment F on Query { x } \
                          fragment F on Query { a(first: 100) { b(first: 100) { c } } }",
            })
            .to_string(),
        ] {
            let (status, cost, answer) = send(&lenient, "k", &body).await;
            assert_eq!(
                (status, cost),
                (StatusCode::BAD_REQUEST, None),
                "{}: {answer}",
                &body[..body.len().min(80)]
            );
        }
        // What cannot be read is still charged, for the server to answer: a document that
        // does not parse, a persisted query's hash without its document.
        let (status, cost, _) = send(&lenient, "k", r#"{"query":"{ unclosed "}"#).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("5")));
        let hash = r#"{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"0f3c"}}}"#;
        let (status, cost, _) = send(&lenient, "k", hash).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("5")));
        // A field that takes exactly one slicing argument given two: a server that does
        // not read the directive runs the rest of the document.
        let schema = r#"
            directive @listSize(slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
            type Query { repos(first: Int, last: Int): Conn @listSize(slicingArguments: ["first", "last"], sizedFields: ["nodes"]) }
            type Conn { nodes: [Repo] }
            type Repo { id: ID }
        "#;
        let strict = app(
            GraphqlCostLayer::new(GraphqlCost::new().with_schema(schema).unwrap())
                .on_invalid(Invalid::Charge(5)),
        );
        let body = r#"{"query":"{ x: repos(first: 1, last: 1) { nodes { id } } y: repos(first: 100) { nodes { id } } }"}"#;
        let (status, cost, answer) = send(&strict, "k", body).await;
        assert_eq!((status, cost), (StatusCode::BAD_REQUEST, None), "{answer}");
        let request =
            Request::get("/graphql?query=%7B%20repos(first%3A%20100000)%20%7B%20id%20%7D%20%7D")
                .header("x-api-key", "k")
                .body(Body::empty())
                .unwrap();
        let response = lenient.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "a GET out of range"
        );
        let request = Request::get(
            "/graphql?query=query%20Big%20%7B%20a(first%3A%20100)%20%7B%20b(first%3A%20100)%20%7B%20c%20%7D%20%7D%20%7D%20query%20S%20%7B%20x%20%7D&operationName=",
        )
        .header("x-api-key", "k")
        .body(Body::empty())
        .unwrap();
        let response = lenient.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "a GET of several operations, named by an empty name"
        );
        // An operation the document does not have runs nothing anywhere: the server says
        // so, for the charge.
        let body =
            serde_json::json!({ "query": "query A { a } query B { b }", "operationName": "C" });
        let (status, cost, _) = send(&lenient, "k", &body.to_string()).await;
        assert_eq!((status, cost.as_deref()), (StatusCode::OK, Some("5")));
    }

    /// A request of `key` as `method` to `uri` with `headers` and `body`: its status and
    /// cost.
    async fn request(
        app: &Router,
        key: &str,
        method: http::Method,
        uri: &str,
        headers: &[(&str, &str)],
        body: impl Into<Body>,
    ) -> (StatusCode, Option<String>) {
        let mut request = Request::builder()
            .method(method)
            .uri(uri)
            .header("x-api-key", key);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = app
            .clone()
            .oneshot(request.body(body.into()).unwrap())
            .await
            .unwrap();
        let cost = response
            .headers()
            .get("graphql-cost")
            .map(|value| value.to_str().unwrap().to_owned());
        (response.status(), cost)
    }

    /// Under `Invalid::Charge` a fixed charge stands in only where there is nothing the
    /// coster could read: every other way a document might reach the server uncosted is
    /// refused or costed. A batch is charged for each of its entries (the costed ones
    /// their cost, the others the charge), and refused when any entry is; a `documentId`
    /// beside a `query` is one a server without persisted documents runs; an
    /// `application/graphql` body is what gqlgen runs whatever the URL names; a document
    /// the coster's parser refuses for what other parsers take (a lone surrogate escape,
    /// a description on an operation) is not charged.
    #[tokio::test]
    async fn a_fixed_charge_stands_in_only_where_nothing_can_be_read() {
        let lenient = app_with_minimum();
        let json = [("content-type", "application/json")];
        let post = |body: &'static [u8]| {
            request(&lenient, "k", http::Method::POST, "/graphql", &json, body)
        };
        // 51 for the first entry, 5 for the one that does not parse.
        assert_eq!(
            post(br#"[{"query":"{ a(first: 50) { b { c } } }"},{"query":"{ unclosed "}]"#).await,
            (StatusCode::OK, Some("56".to_owned()))
        );
        for body in [
            &br#"[{"query":"{ unclosed "},{"query":"{ r(first: 100000) { id } }"}]"#[..],
            br#"{"query":"{ a(first: 50) { b { c } } }","documentId":"p/cheap"}"#,
            br#"{"query":"{ a(first: 50) { b(s: \"\\ud800\") { c } } }"}"#,
            br#"{"query":"\"cheap\" query { a(first: 50) { b { c } } }"}"#,
            br#"{"query":"query Q(\"cheap\" $n: Int = 50) { a(first: $n) { b { c } } }"}"#,
            br#"{"query":"\"cheap\" # a comment\nquery { a(first: 50) { b { c } } }"}"#,
            // A carriage return ends a comment too, and a byte order mark is ignored
            // anywhere in a document (graphql-spec, "Ignored Tokens").
            br#"{"query":"\"cheap\" # a comment\rquery { a(first: 50) { b { c } } }"}"#,
            br#"{"query":"\"cheap\"\ufeffquery { a(first: 50) { b { c } } }"}"#,
        ] {
            assert_eq!(
                post(body).await,
                (StatusCode::BAD_REQUEST, None),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let document = [("content-type", "application/graphql")];
        for (uri, body) in [
            (
                "/graphql?operationName=B",
                &b"query A { a(first: 50) { b { c } } }"[..],
            ),
            (
                "/graphql",
                b"query=%7B%20a(first%3A%2050)%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D",
            ),
        ] {
            assert_eq!(
                request(&lenient, "k", http::Method::POST, uri, &document, body).await,
                (StatusCode::BAD_REQUEST, None),
                "{uri}"
            );
        }
        let get = "/graphql?query=%7B%20a(first%3A%2050)%20%7B%20b%20%7B%20c%20%7D%20%7D%20%7D";
        assert_eq!(
            request(
                &lenient,
                "k",
                http::Method::GET,
                &format!("{get}&documentId=p"),
                &[],
                &b""[..]
            )
            .await,
            (StatusCode::BAD_REQUEST, None)
        );
        // A compressed body cannot be read, and servers that inflate bodies themselves
        // (Express's body-parser, under Apollo Server and express-graphql) would run any
        // query in it: refused, not charged (put a decompression layer first).
        let gzip = [
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ];
        assert_eq!(
            request(
                &lenient,
                "k",
                http::Method::POST,
                "/graphql",
                &gzip,
                &b"\x1f\x8b\x08\x00"[..]
            )
            .await,
            (StatusCode::BAD_REQUEST, None),
            "a compressed body at the fixed charge"
        );
        // JSON sent as another type, or marked compressed though it is not: a server may
        // read it as JSON whatever it says (async-graphql does), or as what it says
        // (graphql-go reads a form): refused, not charged.
        for headers in [
            &[("content-type", "text/plain")][..],
            &[("content-type", "application/json; charset=latin1")],
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
        ] {
            let body = &br#"{"query":"{ a(first: 50) { b { c } } }"}"#[..];
            let sent = request(&lenient, "k", http::Method::POST, "/graphql", headers, body);
            assert_eq!(sent.await, (StatusCode::BAD_REQUEST, None), "{headers:?}");
        }
        // A byte order mark before the JSON, which body parsers skip: costed (the
        // budget is spent by now: the cost is what is asked of it).
        assert_eq!(
            post(b"\xef\xbb\xbf{\"query\":\"{ a(first: 50) { b { c } } }\"}")
                .await
                .1,
            Some("51".to_owned())
        );
        // An empty operationName names no operation (gqlgen runs the only one): costed,
        // not charged.
        assert_eq!(
            post(br#"{"query":"{ a(first: 50) { b { c } } }","operationName":""}"#)
                .await
                .1,
            Some("51".to_owned())
        );
        let bom = &b"\xef\xbb\xbf{\"query\":\"query A { a }\",\"operationName\":\"A\"}"[..];
        let uri = "/graphql?operationName=A";
        let sent = request(&lenient, "k", http::Method::POST, uri, &json, bom);
        assert_eq!(
            sent.await.1,
            Some("1".to_owned()),
            "the URL names the body's operation"
        );
    }

    /// A `GET` whose parameter a server reads as `variables` though the coster does not:
    /// ASP.NET Core and Java compare names with Unicode case rules (`ſ` is an `s`, `ı` an
    /// `i`), so `variableſ` is `variables` to them.
    #[tokio::test]
    async fn a_get_parameter_that_folds_to_a_graphql_one_is_refused() {
        let app = app(GraphqlCostLayer::new(GraphqlCost::new()));
        for uri in [
            "/graphql?query=query(%24n%3AInt%3D1)%7Br(first%3A%24n)%7Bid%7D%7D&variable%C5%BF=%7B%22n%22%3A100000%7D",
            "/graphql?query=%7Ba%7D&operat%C4%B1onName=B",
        ] {
            let (status, _) = request(&app, "k", http::Method::GET, uri, &[], Body::empty()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        }
    }
}

/// A variable the request does not give (and that has no default of its own) leaves its
/// argument unset (graphql-spec, "CoerceArgumentValues"): the schema's default for the
/// argument applies, as it does when the query does not write it. It was read as a value
/// given and out of range, and such a request refused. Given as `null`, it is a value,
/// and out of range; where no default is known, it is still sized as a value missing.
#[test]
fn a_variable_not_given_leaves_its_argument_to_the_schema_default() {
    let sdl = "type Query { users(first: Int = 10): [User] } type User { friends: [User] }";
    let coster = GraphqlCost::new().with_schema(sdl).unwrap();
    let query = "query($n: Int) { users(first: $n) { friends { __typename } } }";
    // users 1 + 10 x friends 1
    assert_eq!(coster.query_cost(query, None, None).unwrap(), 1 + 10);
    assert_eq!(
        coster
            .query_cost("{ users { friends { __typename } } }", None, None)
            .unwrap(),
        1 + 10
    );
    let variables = serde_json::json!({ "n": 3 });
    assert_eq!(
        coster
            .query_cost(query, None, variables.as_object())
            .unwrap(),
        1 + 3
    );
    let null = serde_json::json!({ "n": null });
    assert!(matches!(
        coster.query_cost(query, None, null.as_object()),
        Err(CostError::Slicing { .. })
    ));
    let no_default = GraphqlCost::new()
        .with_schema("type Query { users(first: Int): [User] } type User { friends: [User] }")
        .unwrap();
    assert!(matches!(
        no_default.query_cost(query, None, None),
        Err(CostError::Slicing { .. })
    ));
}

/// IBM's cost directives let a slicing argument be a path into an input object
/// (`slicingArguments: ["filter.max"]` for `users(filter: Filter)`), which the coster does
/// not follow: such a list was sized 1 (or, by default, every query of the field was
/// refused), so `users(filter: {max: 100000})` was priced as one item. A path is refused
/// when the schema is read, with what to do instead.
#[test]
fn a_slicing_argument_path_is_refused_when_the_schema_is_read() {
    let sdl = |list_size: &str| {
        format!(
            "directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
             input Filter {{ max: Int }}
             type Query {{ users(filter: Filter, first: Int): Conn @listSize({list_size}) }}
             type Conn {{ nodes: [User] edges: [User] }}
             type User {{ id: ID }}"
        )
    };
    for list_size in [
        r#"slicingArguments: ["filter.max"]"#,
        r#"slicingArguments: ["first"], sizedFields: ["edges.node"]"#,
    ] {
        let error = GraphqlCost::new().with_schema(&sdl(list_size)).unwrap_err();
        assert!(
            matches!(&error, CostError::Parse(message) if message.contains("path")),
            "{list_size}: {error}"
        );
    }
    assert!(
        GraphqlCost::new()
            .with_schema(&sdl(
                r#"slicingArguments: ["first"], sizedFields: ["nodes"]"#
            ))
            .is_ok()
    );
}

/// `@listSize` without `slicingArguments` (an `assumedSize`, or `sizedFields` alone, as
/// the README suggests for lists the model cannot size) does not switch off the model's
/// `first`, `last` and `limit`: a `first: 100000` the server would honour was charged the
/// assumed size (21), or one item (3), and its range went unchecked; the same field
/// without the directive refuses it.
#[test]
fn a_list_size_without_slicing_arguments_keeps_first_last_and_limit() {
    let sdl = r#"
      directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
      type Query {
        posts(first: Int): [Post] @listSize(assumedSize: 20)
        repos(first: Int): RepoConnection @listSize(sizedFields: ["nodes"])
      }
      type Post { author: User }
      type User { login: String }
      type RepoConnection { nodes: [Repo] }
      type Repo { owner: User }
    "#;
    let coster = GraphqlCost::new().with_schema(sdl).unwrap();
    let cost = |query: &str| coster.query_cost(query, None, None);
    for query in [
        "{ posts(first: 100000) { author { login } } }",
        "{ repos(first: 100000) { nodes { owner { login } } } }",
    ] {
        assert!(
            matches!(cost(query), Err(CostError::Slicing { .. })),
            "{query}: {:?}",
            cost(query)
        );
    }
    // In range, `first` sizes the list; without it, the assumed size does.
    assert_eq!(
        cost("{ posts(first: 100) { author { login } } }").unwrap(),
        1 + 100
    );
    assert_eq!(
        cost("{ repos(first: 100) { nodes { owner { login } } } }").unwrap(),
        1 + 100 * 2
    );
    assert_eq!(cost("{ posts { author { login } } }").unwrap(), 1 + 20);
    // Nothing sizes the connection's list: the assumed list size (default 10) does.
    assert_eq!(
        cost("{ repos { nodes { owner { login } } } }").unwrap(),
        1 + 10 * 2
    );
    // The schema's own default for such an argument is not the query's: the assumed
    // size stands in for it, as before (a default past the range refuses nothing). An
    // empty `slicingArguments` says no argument sizes the list (`last` in days).
    let sdl = r#"
      directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
      type Query {
        events(limit: Int = 500): [Event] @listSize(assumedSize: 50)
        history(last: Int): [Event] @listSize(assumedSize: 30, slicingArguments: [])
      }
      type Event { id: ID source: Source }
      type Source { name: String }
    "#;
    let coster = GraphqlCost::new().with_schema(sdl).unwrap();
    let cost = |query: &str| coster.query_cost(query, None, None);
    assert_eq!(cost("{ events { source { name } } }").unwrap(), 1 + 50);
    assert_eq!(
        cost("{ history(last: 365) { source { name } } }").unwrap(),
        1 + 30
    );
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

/// Queries and their cost with [`SDL`].
const SCHEMA_COST_TABLE: &[(&str, u64)] = &[
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
    // Leaves with a slicing default of 30 stay free: the operation's minimum, 1.
    ("{ tags }", 1),
];

/// Type extensions (`extend type`, `extend interface`, `extend union`, `extend schema`)
/// add to the types they extend, before or after the definition, as a schema split over
/// files writes them: their fields, weights, interfaces and members are costed.
#[test]
fn schema_extensions_are_costed_like_definitions() {
    let split = r#"
        directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION
        directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
        extend type Query { report: Report @cost(weight: 500) }
        type Query { viewer: User }
        type Report { id: ID! }
        interface Node { id: ID! }
        type User { id: ID! }
        extend type User implements Node { posts: [Post] @listSize(assumedSize: 7, requireOneSlicingArgument: false) }
        extend interface Node { owner: User @cost(weight: 9) }
        type Post { id: ID! }
        type Event { id: ID! }
        union Item = Post
        extend union Item = Event
        extend type Query { node(id: ID!): Node  item: Item  items: [Item] @listSize(assumedSize: 2, requireOneSlicingArgument: false) }
        type Admin { audit: Report @cost(weight: 40) }
        extend schema { mutation: Admin }
    "#;
    // The same schema written as definitions only.
    let whole = r#"
        directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION
        directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
        type Query {
          report: Report @cost(weight: 500)
          viewer: User
          node(id: ID!): Node
          item: Item
          items: [Item] @listSize(assumedSize: 2, requireOneSlicingArgument: false)
        }
        type Report { id: ID! }
        interface Node { id: ID! owner: User @cost(weight: 9) }
        type User implements Node { id: ID! posts: [Post] @listSize(assumedSize: 7, requireOneSlicingArgument: false) }
        type Post { id: ID! }
        type Event { id: ID! }
        union Item = Post | Event
        type Admin { audit: Report @cost(weight: 40) }
        schema { query: Query mutation: Admin }
    "#;
    let split = GraphqlCost::new().with_schema(split).unwrap();
    let whole = GraphqlCost::new().with_schema(whole).unwrap();
    let without = GraphqlCost::new();
    for query in [
        // A root field from an extension, with its weight.
        "{ report { id } }",
        // A field from an extension, with its list size.
        "{ viewer { posts { id } } }",
        // The interface an extension added, and the interface's extension field.
        "{ node(id: 1) { ... on User { posts { id } } } }",
        "{ node(id: 1) { owner { id } } }",
        // A member an extension added to a union.
        "{ items { ... on Event { id } } }",
        // The mutation root an extension named.
        "mutation { audit { id } }",
    ] {
        let expected = whole.query_cost(query, None, None).unwrap();
        assert_eq!(
            split.query_cost(query, None, None).unwrap(),
            expected,
            "{query}"
        );
    }
    // The weights the extensions carry are the schema's, not the model without one.
    let cost = |coster: &GraphqlCost, query| coster.query_cost(query, None, None).unwrap();
    assert_eq!(cost(&split, "{ report { id } }"), 500);
    assert_eq!(cost(&without, "{ report { id } }"), 1);
    assert!(cost(&split, "{ node(id: 1) { owner { id } } }") >= 9);
    assert!(cost(&split, "mutation { audit { id } }") >= 40);
}

#[test]
fn schema_cost_table() {
    let coster = GraphqlCost::new().with_schema(SDL).unwrap();
    for (query, expected) in SCHEMA_COST_TABLE {
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

/// Connections sized by `@listSize(sizedFields:)`, the schema of the named-fragment defect.
const REPO_SDL: &str = r#"
    directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION
    directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION

    type Query {
      repos(first: Int): RepoConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"])
      pinned: RepoConnection
      orgs(first: Int): OrgConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes", "edges"])
      paged(first: Int): Paged @listSize(slicingArguments: ["first"], sizedFields: ["nodes"])
      search(first: Int): SearchConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"])
    }
    interface Paged { nodes: [Repo] totalCount: Int }
    type RepoConnection implements Paged { nodes: [Repo] totalCount: Int }
    type ForkConnection implements Paged { nodes: [Repo] totalCount: Int }
    type Repo { name: String owner: User @cost(weight: 5) }
    type User { login: String }
    type OrgConnection { nodes: [Org] edges: [OrgEdge] }
    type OrgEdge { node: Org }
    type Org { name: String repos(first: Int): RepoConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"]) }
    union SearchResult = Repo | User | Org
    type SearchConnection { nodes: [SearchResult] totalCount: Int }
"#;

/// A `Repo` with its owner: 1 + 5.
const REPO: u64 = 1 + 5;

/// Queries and their cost with [`REPO_SDL`]: list sizes reaching through named fragments.
const REPO_COST_TABLE: &[(&str, u64)] = &[
    // The defect: the same selection written inline and through a named fragment.
    (
        "{ repos(first: 100) { nodes { owner { login } } } }",
        1 + 100 * REPO,
    ),
    (
        "{ repos(first: 100) { ...C } } fragment C on RepoConnection { nodes { owner { login } } }",
        1 + 100 * REPO,
    ),
    // One fragment under two list sizes and under none, in both orders: the cost kept for
    // its first use must not be reused for the others. Under `pinned`, which nothing
    // sizes, `nodes` is a list of the default size (10): its call, and ten owners.
    (
        "{ a: repos(first: 2) { ...C } b: repos(first: 100) { ...C } c: pinned { ...C } } fragment C on RepoConnection { nodes { owner { login } } }",
        (1 + 2 * REPO) + (1 + 100 * REPO) + (1 + (1 + 10 * 5)),
    ),
    (
        "{ c: pinned { ...C } b: repos(first: 100) { ...C } a: repos(first: 2) { ...C } } fragment C on RepoConnection { nodes { owner { login } } }",
        (1 + 2 * REPO) + (1 + 100 * REPO) + (1 + (1 + 10 * 5)),
    ),
    // A fragment spread inside a sliced connection inside another: orgs 1 + 5 x (org 1 +
    // repos (1 + 10 x repo)), once through nodes and once through edges.
    (
        "{ orgs(first: 5) { ...O } } fragment O on OrgConnection { nodes { repos(first: 10) { ...R } } } fragment R on RepoConnection { nodes { owner { login } } }",
        1 + 5 * (1 + (1 + 10 * REPO)),
    ),
    (
        "{ orgs(first: 5) { ...E } } fragment E on OrgConnection { edges { node { ...O } } } fragment O on Org { repos(first: 10) { ...R } } fragment R on RepoConnection { nodes { owner { login } } }",
        1 + 5 * (1 + (1 + (1 + 10 * REPO))),
    ),
    // The inner fragment under another size at the outer level as well.
    (
        "{ repos(first: 100) { ...R } orgs(first: 5) { nodes { repos(first: 10) { ...R } } } } fragment R on RepoConnection { nodes { owner { login } } }",
        (1 + 100 * REPO) + (1 + 5 * (1 + (1 + 10 * REPO))),
    ),
    // Fragments spreading fragments, through an inline fragment too.
    (
        "{ repos(first: 100) { ...A } } fragment A on RepoConnection { totalCount ... on RepoConnection { ...B } } fragment B on RepoConnection { nodes { ...N } } fragment N on Repo { owner { login } }",
        1 + 100 * REPO,
    ),
    // A fragment on an interface, spread under a field of that interface and under one of
    // an implementation.
    (
        "{ paged(first: 10) { ...P } repos(first: 3) { ...P } } fragment P on Paged { nodes { owner { login } } }",
        (1 + 10 * REPO) + (1 + 3 * REPO),
    ),
    // A fragment on a union inside a sized connection: its most expensive member (an org
    // with three repos: 1 + (1 + 3 x repo)).
    (
        "{ search(first: 10) { ...S } } fragment S on SearchConnection { totalCount nodes { ...U } } fragment U on SearchResult { ... on Repo { owner { login } } ... on Org { repos(first: 3) { ...R } } ... on User { login } } fragment R on RepoConnection { nodes { owner { login } } }",
        1 + 10 * (1 + (1 + 3 * REPO)),
    ),
];

#[test]
fn repo_cost_table() {
    let coster = GraphqlCost::new().with_schema(REPO_SDL).unwrap();
    for (query, expected) in REPO_COST_TABLE {
        assert_eq!(
            coster.query_cost(query, None, None).unwrap(),
            *expected,
            "{query}"
        );
    }
}

#[test]
fn named_fragment_costs_what_the_inline_selection_costs() {
    let coster = GraphqlCost::new().with_schema(REPO_SDL).unwrap();
    let cost = |query| coster.query_cost(query, None, None).unwrap();
    let plain = cost("{ repos(first: 100) { nodes { owner { login } } } }");
    let inline =
        cost("{ repos(first: 100) { ... on RepoConnection { nodes { owner { login } } } } }");
    let named = cost(
        "{ repos(first: 100) { ...C } } fragment C on RepoConnection { nodes { owner { login } } }",
    );
    assert_eq!((plain, inline, named), (601, 601, 601));
}

/// Mechanical rewrites of a document into forms that must cost what it costs as written.
mod forms {
    use std::collections::HashMap;

    use apollo_compiler::ast::{
        Definition, DirectiveList, Document, FragmentDefinition, FragmentSpread, InlineFragment,
        OperationType, Selection,
    };
    use apollo_compiler::{Name, Node, Schema};

    /// One way of writing the same selections.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Form {
        /// Every named fragment spread replaced by an inline fragment holding its body.
        Expanded,
        /// Every selection set wrapped in `... on Type { }`.
        Inline,
        /// Every selection set moved into a named fragment of its own.
        Named,
        /// Like `Named`, but equal selections on one type share one fragment, spread under
        /// whatever list sizes they appear under.
        Shared,
        /// Every selection set in a fragment that spreads, through an inline fragment, a
        /// second fragment holding it.
        Chained,
    }

    /// Every form.
    pub const ALL: [Form; 5] = [
        Form::Expanded,
        Form::Inline,
        Form::Named,
        Form::Shared,
        Form::Chained,
    ];

    /// The type condition written where the rewrite does not know the type (no schema, or
    /// a field the schema does not have): the coster then knows no type either.
    const UNKNOWN: &str = "Unknown";

    /// `query` rewritten in `form`, the types taken from `schema`: `None` when it does not
    /// parse, or when expanding its fragments would take more than 100,000 selections.
    pub fn rewrite(query: &str, schema: Option<&Schema>, form: Form) -> Option<String> {
        let mut document = Document::parse(query, "query.graphql").ok()?;
        let fragments = document
            .definitions
            .iter()
            .filter_map(|definition| match definition {
                Definition::FragmentDefinition(fragment) => {
                    Some((fragment.name.clone(), fragment.clone()))
                }
                _ => None,
            })
            .collect();
        let mut rewriter = Rewriter {
            form,
            schema,
            fragments,
            expanding: Vec::new(),
            budget: 100_000,
            added: Vec::new(),
            shared: HashMap::new(),
        };
        for definition in &mut document.definitions {
            match definition {
                Definition::OperationDefinition(operation) => {
                    // The schema's root type, else the conventional name (as the coster).
                    let root = schema
                        .and_then(|schema| schema.root_operation(operation.operation_type))
                        .map(|name| name.to_string())
                        .unwrap_or_else(|| match operation.operation_type {
                            OperationType::Query => "Query".to_owned(),
                            OperationType::Mutation => "Mutation".to_owned(),
                            OperationType::Subscription => "Subscription".to_owned(),
                        });
                    let mut rewritten = (**operation).clone();
                    rewritten.selection_set =
                        rewriter.selections(&operation.selection_set, Some(&root))?;
                    *operation = Node::new(rewritten);
                }
                Definition::FragmentDefinition(fragment) => {
                    let mut rewritten = (**fragment).clone();
                    rewritten.selection_set = rewriter.selections(
                        &fragment.selection_set,
                        Some(fragment.type_condition.as_str()),
                    )?;
                    *fragment = Node::new(rewritten);
                }
                _ => {}
            }
        }
        document.definitions.append(&mut rewriter.added);
        Some(document.to_string())
    }

    struct Rewriter<'s> {
        form: Form,
        schema: Option<&'s Schema>,
        fragments: HashMap<Name, Node<FragmentDefinition>>,
        expanding: Vec<Name>,
        budget: usize,
        added: Vec<Definition>,
        shared: HashMap<String, Name>,
    }

    fn name(text: &str) -> Name {
        Name::new(text).expect("a GraphQL name")
    }

    fn spread(fragment: &Name) -> Selection {
        Selection::FragmentSpread(Node::new(FragmentSpread {
            fragment_name: fragment.clone(),
            directives: DirectiveList::new(),
        }))
    }

    impl Rewriter<'_> {
        /// The named type of `parent.field`, if the schema knows it.
        fn field_type(&self, parent: Option<&str>, field: &str) -> Option<String> {
            let field = self.schema?.type_field(parent?, field).ok()?;
            Some(field.ty.inner_named_type().to_string())
        }

        /// `selections` on a value of type `ty`, rewritten at every level.
        fn selections(
            &mut self,
            selections: &[Selection],
            ty: Option<&str>,
        ) -> Option<Vec<Selection>> {
            let mut rewritten = Vec::with_capacity(selections.len());
            for selection in selections {
                self.budget = self.budget.checked_sub(1)?;
                rewritten.push(match selection {
                    Selection::Field(field) if field.selection_set.is_empty() => selection.clone(),
                    Selection::Field(field) => {
                        let child = self.field_type(ty, &field.name);
                        let mut field = (**field).clone();
                        field.selection_set =
                            self.selections(&field.selection_set, child.as_deref())?;
                        Selection::Field(Node::new(field))
                    }
                    Selection::InlineFragment(inline) => {
                        let condition = inline
                            .type_condition
                            .as_ref()
                            .map(|condition| condition.to_string())
                            .or(ty.map(str::to_owned));
                        let mut inline = (**inline).clone();
                        inline.selection_set =
                            self.selections(&inline.selection_set, condition.as_deref())?;
                        Selection::InlineFragment(Node::new(inline))
                    }
                    Selection::FragmentSpread(spread) if self.form == Form::Expanded => {
                        let fragment = self.fragments.get(&spread.fragment_name).cloned();
                        match fragment {
                            // Cycles and unknown fragments stay spreads: the coster refuses them.
                            Some(fragment) if !self.expanding.contains(&fragment.name) => {
                                self.expanding.push(fragment.name.clone());
                                let body = self.selections(
                                    &fragment.selection_set,
                                    Some(fragment.type_condition.as_str()),
                                );
                                self.expanding.pop();
                                Selection::InlineFragment(Node::new(InlineFragment {
                                    type_condition: Some(fragment.type_condition.clone()),
                                    directives: spread.directives.clone(),
                                    selection_set: body?,
                                }))
                            }
                            _ => selection.clone(),
                        }
                    }
                    Selection::FragmentSpread(_) => selection.clone(),
                });
            }
            Some(self.wrap(rewritten, ty))
        }

        fn fragment(&mut self, ty: &str, selection_set: Vec<Selection>) -> Name {
            let fragment = name(&format!("Form{}", self.added.len()));
            self.added.push(Definition::FragmentDefinition(Node::new(
                FragmentDefinition {
                    name: fragment.clone(),
                    type_condition: name(ty),
                    directives: DirectiveList::new(),
                    selection_set,
                },
            )));
            fragment
        }

        /// A rewritten selection set, written in the form.
        fn wrap(&mut self, selections: Vec<Selection>, ty: Option<&str>) -> Vec<Selection> {
            let condition = ty.unwrap_or(UNKNOWN);
            match self.form {
                Form::Expanded => selections,
                Form::Inline => vec![Selection::InlineFragment(Node::new(InlineFragment {
                    type_condition: ty.map(name),
                    directives: DirectiveList::new(),
                    selection_set: selections,
                }))],
                Form::Named => vec![spread(&self.fragment(condition, selections))],
                Form::Shared => {
                    let printed: Vec<String> = selections.iter().map(ToString::to_string).collect();
                    let key = format!("{condition} {}", printed.join(" "));
                    let fragment = match self.shared.get(&key) {
                        Some(fragment) => fragment.clone(),
                        None => {
                            let fragment = self.fragment(condition, selections);
                            self.shared.insert(key, fragment.clone());
                            fragment
                        }
                    };
                    vec![spread(&fragment)]
                }
                Form::Chained => {
                    let inner = self.fragment(condition, selections);
                    let through = Selection::InlineFragment(Node::new(InlineFragment {
                        type_condition: ty.map(name),
                        directives: DirectiveList::new(),
                        selection_set: vec![spread(&inner)],
                    }));
                    vec![spread(&self.fragment(condition, vec![through]))]
                }
            }
        }
    }
}

/// Two outcomes agree: the same cost, or refusals for the same reason (a document too
/// deep or too long is refused by the parser or by the walker, depending on its form).
fn same_outcome(a: &Result<u64, CostError>, b: &Result<u64, CostError>) -> bool {
    fn reason(error: &CostError) -> u8 {
        match error {
            CostError::Parse(_) | CostError::TooDeep { .. } => 0,
            CostError::Request(_) => 1,
            CostError::Operation(_) => 2,
            CostError::FragmentCycle(_) => 3,
            CostError::UnknownFragment(_) => 4,
            CostError::Slicing { .. } => 5,
            CostError::Batch { .. } => 6,
            _ => 7,
        }
    }
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => reason(a) == reason(b),
        _ => false,
    }
}

#[test]
fn every_form_costs_the_same() {
    use forms::{ALL, Form, rewrite};

    // Every query of the cost tables and the attack corpus, and the documents of the other
    // tests: (query, operationName, variables).
    let mut corpus: Vec<(String, Option<&str>, Option<serde_json::Value>)> = Vec::new();
    for (query, _) in COST_TABLE
        .iter()
        .chain(SCHEMA_COST_TABLE)
        .chain(REPO_COST_TABLE)
    {
        corpus.push((query.to_string(), None, None));
    }
    let document = "query Small { viewer { id } } query Big($n: Int = 20) { repos(first: $n) { nodes { id } } }";
    corpus.push((document.into(), Some("Small"), None));
    corpus.push((document.into(), Some("Big"), None));
    corpus.push((document.into(), Some("Big"), Some(json!({ "n": 50 }))));
    corpus.push((document.into(), None, None));
    corpus.push(("{ search { totalCount } }".into(), None, None));
    corpus.push((
        "query($n: Int) { search(last: $n) { nodes { ... on Post { title } } } }".into(),
        None,
        Some(json!({ "n": 4 })),
    ));
    corpus.push((
        "query($n: Int) { repos(first: $n) { nodes { owner { login } } } }".into(),
        None,
        Some(json!({ "n": 1e300 })),
    ));
    for query in [
        deep(100),
        CYCLE.to_owned(),
        "{ ...Missing }".to_owned(),
        fanout(),
        aliases(1_000),
        aliases(10_000),
        "{ a }".to_owned(),
    ] {
        corpus.push((query, None, None));
    }

    // Wrapping adds nesting, which the depth limit counts (an inline fragment or a spread
    // is a level, so that fragment chains are bounded too): the fan-out, 62 levels as
    // written, would be refused as too deep in a wrapped form. The limit is raised here so
    // that the costs are compared; the default is the attack corpus's business.
    let roomy = || GraphqlCost::new().max_depth(tollgate::cost::graphql::MAX_DEPTH);
    // Rewriting also lengthens a document: one that outgrows the token limit (20,000, the
    // coster's) is refused for its size, and its cost is not compared.
    let fits = |document: &str| {
        apollo_compiler::parser::Parser::new()
            .token_limit(20_000)
            .parse_ast(document, "form.graphql")
            .is_ok()
    };
    let schemas = [None, Some(SDL), Some(REPO_SDL)];
    let (mut compared, mut too_long, mut too_deep) = (0, Vec::new(), 0);
    let mut failures = Vec::new();
    for sdl in schemas {
        let coster = match sdl {
            Some(sdl) => roomy().with_schema(sdl).unwrap(),
            None => roomy(),
        };
        let schema = sdl.map(|sdl| apollo_compiler::Schema::parse(sdl, "schema.graphql").unwrap());
        for (query, operation, variables) in &corpus {
            let variables = variables
                .as_ref()
                .and_then(|variables| variables.as_object());
            let written = coster.query_cost(query, *operation, variables);
            for form in ALL {
                let Some(rewritten) = rewrite(query, schema.as_ref(), form) else {
                    // Only the fan-out is too big to expand.
                    assert!(form == Form::Expanded && query.contains("F30"), "{query}");
                    continue;
                };
                let cost = coster.query_cost(&rewritten, *operation, variables);
                if fits(query) && !fits(&rewritten) {
                    assert!(matches!(cost, Err(CostError::Parse(_))), "{cost:?}");
                    too_long.push(query.len());
                    continue;
                }
                // A chain of fragments a level each outgrows `MAX_DEPTH` where the
                // written form is within it: refused for its depth, not compared.
                if matches!(cost, Err(CostError::TooDeep { .. }))
                    && !matches!(written, Err(CostError::TooDeep { .. }))
                {
                    assert_eq!(form, Form::Chained, "{query}");
                    too_deep += 1;
                    continue;
                }
                compared += 1;
                if !same_outcome(&written, &cost) {
                    let schema = if sdl == Some(SDL) {
                        "SDL"
                    } else if sdl.is_some() {
                        "REPO_SDL"
                    } else {
                        "no schema"
                    };
                    let shown = |text: &str| text.chars().take(300).collect::<String>();
                    failures.push(format!(
                        "{schema}, {form:?}: {written:?} as written, {cost:?} as\n  {}\nfor\n  {}",
                        shown(&rewritten),
                        shown(query)
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} forms cost differently:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Only the thousand aliases outgrow the token limit, and not in every form.
    assert!(
        too_long
            .iter()
            .all(|&length| length == aliases(1_000).len())
            && too_long.len() < 10,
        "{too_long:?}"
    );
    // Two documents of the corpus (the deepest), chained, under each schema at most.
    assert!(too_deep <= 6, "{too_deep} chained forms too deep");
    assert!(compared > 500, "{compared} forms compared");
}

/// The attack documents too large to rewrite through a parser, written by hand in each
/// form: refused in every one.
/// A fragment already costed is not walked again, but its depth still counts: a chain
/// of fragments spread from the top in reverse order, each walk short before it meets a
/// fragment costed already, is as deep as the chain spread once.
#[test]
fn a_fragment_costed_before_still_counts_its_depth() {
    let coster = GraphqlCost::new().max_depth(64);
    let levels = 200;
    let mut fragments = String::new();
    for level in 0..levels {
        fragments.push_str(&format!(
            " fragment D{level} on Q {{ a {{ ...D{} }} }}",
            level + 1
        ));
    }
    fragments.push_str(&format!(" fragment D{levels} on Q {{ id }}"));
    let chain = format!("{{ ...D0 }}{fragments}");
    let stepped: String = (0..levels)
        .rev()
        .step_by(10)
        .map(|level| format!("...D{level} "))
        .collect();
    let stepped = format!("{{ {stepped}}}{fragments}");
    for (form, document) in [("chain", &chain), ("stepped", &stepped)] {
        let result = coster.query_cost(document, None, None);
        assert!(
            matches!(result, Err(CostError::TooDeep { .. })),
            "{form}: {result:?}"
        );
    }
}

#[test]
fn deep_and_huge_documents_are_refused_in_every_form() {
    let coster = GraphqlCost::new();
    let levels = 10_000;
    let inline = "{ a { ... on Q ".repeat(levels) + &"} }".repeat(levels);
    let mut named = String::from("{ ...D0 }");
    for level in 0..levels {
        named.push_str(&format!(
            " fragment D{level} on Q {{ a {{ ...D{} }} }}",
            level + 1
        ));
    }
    named.push_str(&format!(" fragment D{levels} on Q {{ a }}"));
    for document in [deep(levels), inline, named] {
        assert!(
            matches!(
                coster.query_cost(&document, None, None),
                Err(CostError::Parse(_) | CostError::TooDeep { .. })
            ),
            "{}",
            &document[..60]
        );
    }
    // The 10 MB document is in the attack corpus; past the token limit, the size does not
    // matter, only the time it takes to refuse (in proportion to its length).
    let fields = "f ".repeat(100_000);
    for document in [
        huge(100_000),
        format!("{{ ... on Query {{ {fields} }} }}"),
        format!("{{ ...B }} fragment B on Query {{ {fields} }}"),
    ] {
        assert!(matches!(
            coster.query_cost(&document, None, None),
            Err(CostError::Parse(_))
        ));
    }
}

/// A schema whose interface leads back to itself (a repository's owner, a user or an
/// organization, has repositories): each level of a query can be any of the interface's
/// types, so a walk that costs every level once per possible type of every level above
/// does 2^levels work. Each selection set is costed once per type (and list size) it is
/// costed on, so a query as deep as the limit allows is costed at once, and its cost is
/// what the levels add up to.
#[test]
fn a_recursive_interface_is_costed_once_per_type_not_once_per_path() {
    let coster = GraphqlCost::new()
        .with_schema(
            r#"
            type Query { repository(name: String): Repository }
            type Repository { name: String owner: RepositoryOwner }
            interface RepositoryOwner { repository(name: String): Repository }
            type User implements RepositoryOwner { repository(name: String): Repository }
            type Organization implements RepositoryOwner { repository(name: String): Repository }
            "#,
        )
        .unwrap();
    let levels = 30;
    let mut query = r#"repository(name: "x") { name }"#.to_owned();
    for _ in 0..levels {
        query = format!(r#"repository(name: "x") {{ owner {{ {query} }} }}"#);
    }
    // Each level: the repository (1) and its owner (1); the innermost repository 1.
    assert_eq!(
        coster
            .query_cost(&format!("{{ {query} }}"), None, None)
            .unwrap(),
        1 + 2 * levels
    );
}

/// Leaves cost nothing, but a request is never free: a cost of 0 is always admitted, so
/// a query of scalar fields only (thousands of aliases of one resolver) would run
/// unlimited. Each operation costs at least 1 (GitHub charges at least a point a
/// request), or what `min_cost` says.
#[test]
fn an_operation_costs_at_least_the_minimum() {
    let aliases: String = (0..500).map(|n| format!(" a{n}: hello")).collect();
    let leaves = format!("{{{aliases} }}");
    // Each root field is a resolver call: 500 aliases are 500 calls.
    assert_eq!(
        GraphqlCost::new().query_cost(&leaves, None, None).unwrap(),
        500
    );
    assert_eq!(cost("{ __typename }").unwrap(), 1);
    let batch = json!([{ "query": "{ a }" }, { "query": "{ b }" }, { "query": "{ c { d } }" }]);
    assert_eq!(
        GraphqlCost::new()
            .json_cost(batch.to_string().as_bytes())
            .unwrap(),
        1 + 1 + 1
    );
    let free = GraphqlCost::new().min_cost(0);
    assert_eq!(free.query_cost(&leaves, None, None).unwrap(), 0);
    // Above the minimum, nothing changes.
    assert_eq!(
        cost("{ repos(first: 10) { nodes { name } } }").unwrap(),
        1 + 10
    );
}

/// With a schema, the slicing range holds on a list of leaves too: `tags(limit:
/// 1000000000)` asks the server for a billion values, costed or not, and is refused (or
/// capped) as it would be on a list of objects. A field that returns one leaf value is
/// not sized by its arguments (an `excerpt(limit: 280)` is no page). Without a schema
/// nothing tells the two apart, and `first`, `last` and `limit` size every field.
#[test]
fn slicing_limits_hold_on_lists_of_leaves() {
    let huge = "{ tags(limit: 1000000000) }";
    let schema = GraphqlCost::new()
        .with_schema(
            "type Query { tags(limit: Int = 30): [String] excerpt(limit: Int = 280): String }",
        )
        .unwrap();
    assert!(schema.query_cost(huge, None, None).is_err());
    assert!(
        schema
            .query_cost("{ tags(limit: 100) }", None, None)
            .is_ok()
    );
    let capped = GraphqlCost::new()
        .with_schema("type Query { tags(limit: Int = 30): [String] }")
        .unwrap()
        .slice_range(1, 100, OutOfRange::Cap);
    assert!(capped.query_cost(huge, None, None).is_ok());
    for one_value in ["{ excerpt }", "{ excerpt(limit: 5000) }"] {
        assert_eq!(
            schema.query_cost(one_value, None, None).unwrap(),
            1,
            "{one_value}"
        );
    }
    assert!(cost(huge).is_err());
    assert!(cost("{ post { body(limit: 500) } }").is_err());
}

/// Go's JSON decoding matches keys in any case (graphql-go, gqlgen), so a body with
/// `query` and `QUERY` runs the one the coster did not read: keys that differ from
/// `query`, `variables`, `operationName` or `extensions` only in case are refused.
#[test]
fn keys_that_differ_only_in_case_are_refused() {
    for body in [
        json!({ "query": "{ a }", "QUERY": "{ a { b { c } } }" }),
        json!({ "query": "query($n: Int) { r(first: $n) { id } }", "variables": { "n": 1 }, "Variables": { "n": 100 } }),
        json!({ "query": "query A { a } query B { a { b } }", "operationName": "A", "operationname": "B" }),
    ] {
        assert!(
            GraphqlCost::new()
                .json_cost(body.to_string().as_bytes())
                .is_err(),
            "{body}"
        );
    }
    // Keys of the application's own are no concern.
    let own = json!({ "query": "{ a { b } }", "clientVersion": "1.2" });
    assert_eq!(
        GraphqlCost::new()
            .json_cost(own.to_string().as_bytes())
            .unwrap(),
        1
    );
}

/// A persisted document's `documentId` (GraphQL over HTTP, persisted documents) beside a
/// `query`: a server that supports it may run the stored document and ignore the query,
/// so the query's cost says nothing of what runs. Refused, as a `documentId` alone is
/// (it cannot be costed). An automatic persisted query's hash beside its document (the
/// registering round of APQ) is costed by the document, which the server checks against
/// the hash. A persisted query's `id` (Hot Chocolate's and Relay's name for it) is the
/// same: beside a query, a server may run either.
#[test]
fn a_document_id_beside_a_query_is_refused() {
    for body in [
        json!({ "query": "{ a }", "documentId": "sha256:8d4bc3a0" }),
        json!([{ "query": "{ a }" }, { "query": "{ a }", "documentId": "p/expensive" }]),
        json!({ "query": "{ a }", "id": "8d4bc3a0" }),
        json!({ "query": "{ a }", "Id": "8d4bc3a0" }),
        // Relay's persisted-query guide sends the stored document's id as `doc_id`.
        json!({ "query": "{ a }", "doc_id": "3be4abb8" }),
        json!({ "query": "{ a }", "DOC_ID": "3be4abb8" }),
    ] {
        assert!(
            GraphqlCost::new()
                .json_cost(body.to_string().as_bytes())
                .is_err(),
            "{body}"
        );
    }
    let apq = json!({
        "query": "{ a { b } }",
        "extensions": { "persistedQuery": { "version": 1, "sha256Hash": "0f3c" } }
    });
    assert_eq!(
        GraphqlCost::new()
            .json_cost(apq.to_string().as_bytes())
            .unwrap(),
        1
    );
    for null_id in [
        json!({ "query": "{ a { b } }", "documentId": null }),
        json!({ "query": "{ a { b } }", "id": null }),
    ] {
        assert_eq!(
            GraphqlCost::new()
                .json_cost(null_id.to_string().as_bytes())
                .unwrap(),
            1
        );
    }
}

/// A field given several slicing arguments is sized by the largest: a server may honour
/// any of them, and `items(limit: 1, first: 100)` charged as 1 would fetch 100. A field
/// whose `@listSize` requires one slicing argument takes exactly one.
#[test]
fn the_largest_slicing_argument_sizes_the_list() {
    assert_eq!(
        cost("{ items(limit: 1, first: 100) { id { v } } }").unwrap(),
        1 + 100 * 1
    );
    assert_eq!(
        cost("{ items(first: 100, limit: 1) { id { v } } }").unwrap(),
        1 + 100 * 1
    );
    let schema = GraphqlCost::new()
        .with_schema(
            r#"
            directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
            type Query { items(first: Int, last: Int): [Item] @listSize(slicingArguments: ["first", "last"]) }
            type Item { owner: User }
            type User { name: String }
            "#,
        )
        .unwrap();
    assert!(
        schema
            .query_cost(
                "{ items(first: 1, last: 100) { owner { name } } }",
                None,
                None
            )
            .is_err()
    );
    assert_eq!(
        schema
            .query_cost("{ items(last: 100) { owner { name } } }", None, None)
            .unwrap(),
        1 + 100 * 1
    );
}

/// Go's `encoding/json` matches keys by Unicode case folding (gqlgen, graphql-go), where
/// `ſ` (U+017F) is an `s` and `K` (U+212A) a `k`; Java's and .NET's case-insensitive
/// comparisons also take `ı` (U+0131) and `İ` (U+0130) for an `i`. A key that is a
/// request key to such a server is one the coster did not read, and is refused.
#[test]
fn keys_that_a_server_folds_to_a_request_key_are_refused() {
    for body in [
        json!({ "query": "query($n: Int = 1) { r(first: $n) { id } }", "variableſ": { "n": 100000 } }),
        json!({ "query": "query A { a } query B { a { b } }", "operationName": "A", "operatıonName": "B" }),
        json!({ "query": "query A { a } query B { a { b } }", "operationName": "A", "operatİonName": "B" }),
        json!({ "query": "{ a }", "extenſions": { "persistedQuery": { "sha256Hash": "0f3c" } } }),
        json!({ "qUery": "{ a { b { c } } }", "query": "{ a }" }),
    ] {
        assert!(
            GraphqlCost::new()
                .json_cost(body.to_string().as_bytes())
                .is_err(),
            "{body}"
        );
    }
    // Other non-ASCII keys are the application's own.
    let own = json!({ "query": "{ a { b } }", "clé": 1, "ſomething": 2 });
    assert_eq!(
        GraphqlCost::new()
            .json_cost(own.to_string().as_bytes())
            .unwrap(),
        1
    );
}

/// An empty batch runs nothing, and a request is never free (a cost of 0 is always
/// admitted): it is not a GraphQL request.
#[test]
fn an_empty_batch_is_refused() {
    assert!(matches!(
        GraphqlCost::new().json_cost(b"[]"),
        Err(CostError::Request(_))
    ));
    assert!(matches!(
        GraphqlCost::new().json_cost(b" [ ] "),
        Err(CostError::Request(_))
    ));
}

/// A slicing range up to `u64::MAX` (no cap) takes every size a document can write; it
/// refused them all when the bound was read as a signed number (-1).
#[test]
fn a_slicing_range_up_to_the_largest_number_caps_nothing() {
    for out_of_range in [OutOfRange::Reject, OutOfRange::Cap] {
        let coster = GraphqlCost::new().slice_range(1, u64::MAX, out_of_range);
        assert_eq!(
            coster
                .query_cost("{ repos(first: 5) { nodes { id } } }", None, None)
                .unwrap(),
            1 + 5 * 1,
            "{out_of_range:?}"
        );
        assert_eq!(
            coster
                .query_cost("{ repos(first: 1000000) { nodes { id } } }", None, None)
                .unwrap(),
            1 + 1_000_000 * 1,
            "{out_of_range:?}"
        );
    }
}

/// `@cost(weight:)` where the IBM cost directive puts it: on an object type reached
/// through an interface or a union (the field costs its most expensive member: the
/// server resolves each object, whatever the query selects of it), on a scalar or an
/// enum type, and on an argument (added when the argument is given).
#[test]
fn cost_weights_on_members_scalars_enums_and_arguments_count() {
    let coster = GraphqlCost::new()
        .with_schema(
            r#"
            directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION | SCALAR | ENUM | ARGUMENT_DEFINITION
            type Query {
              u: U
              i: I
              blob: Blob
              mood: Mood
              search(text: String, fuzzy: Boolean @cost(weight: 7)): [Light]
            }
            type Heavy @cost(weight: 50) { x: Int }
            type Light { y: Int }
            union U = Heavy | Light
            interface I { id: ID }
            type HeavyI implements I @cost(weight: 40) { id: ID }
            type LightI implements I { id: ID }
            scalar Blob @cost(weight: 20)
            enum Mood @cost(weight: 3) { HAPPY SAD }
            "#,
        )
        .unwrap();
    let cost = |query: &str| coster.query_cost(query, None, None).unwrap();
    assert_eq!(cost("{ u { ... on Heavy { x } } }"), 50);
    assert_eq!(cost("{ u { ... on Light { y } } }"), 50);
    assert_eq!(cost("{ u { __typename } }"), 50);
    assert_eq!(cost("{ i { id } }"), 40);
    assert_eq!(cost("{ blob }"), 20);
    assert_eq!(cost("{ mood }"), 3);
    assert_eq!(cost(r#"{ search(text: "a") { y } }"#), 1);
    assert_eq!(cost(r#"{ search(text: "a", fuzzy: true) { y } }"#), 1 + 7);
}

/// A field's arguments are read at each visit of it (for its slicing arguments, and the
/// variables they name). Inside `__type`, where a fragment is walked again at each spread,
/// fragments doubling ten levels deep reach one leaf 1,024 times: a leaf of thousands
/// of arguments (each naming one of thousands of variables) asked for minutes of CPU
/// within the visit bound, for a charge of 1. Each argument read is a visit.
#[test]
fn arguments_count_towards_the_field_visits() {
    let doubling = |leaf: &str| {
        let mut document = String::from("query Q(VARIABLES) { __type(name: \"T\") { ...F0 } }\n");
        for level in 0..10 {
            let next = level + 1;
            document += &format!("fragment F{level} on __Type {{ ...F{next} ...F{next} }}\n");
        }
        document += &format!("fragment F10 on __Type {{ name({leaf}) }}\n");
        document
    };
    let variables: String = (0..200).map(|n| format!("$v{n}: Int ")).collect();
    let named: String = (0..200).map(|n| format!("a{n}: $v{n} ")).collect();
    let literal: String = (0..200).map(|n| format!("a{n}: 1 ")).collect();
    let coster = GraphqlCost::new();
    for leaf in [&named, &literal] {
        let document = doubling(leaf).replace("VARIABLES", &variables);
        let error = coster.query_cost(&document, None, None).unwrap_err();
        assert!(
            matches!(error, CostError::TooComplex { max: 100_000 }),
            "{error}"
        );
    }
    // The same leaf reached once is well within the bound.
    let once = format!("query Q({variables}) {{ __type(name: \"T\") {{ name({named}) }} }}");
    assert_eq!(coster.query_cost(&once, None, None).unwrap(), 1);
}

/// Costing walks a selection set once for each type it may be on: under an interface
/// with hundreds of implementations (GitHub's `Node`), a document within the token limit asks
/// for millions of steps, before the limiter has a say. The walk stops at a bound of
/// field visits for the whole body, and the request is refused, whatever `on_invalid`
/// says (the server would run it).
#[test]
fn costing_work_is_bounded_by_field_visits() {
    let types: String = (0..300)
        .map(|n| format!("type T{n} implements Node {{ id: ID }}\n"))
        .collect();
    let sdl = format!("type Query {{ node: Node }}\ninterface Node {{ id: ID }}\n{types}");
    let coster = GraphqlCost::new().with_schema(&sdl).unwrap();
    let ids = "id ".repeat(9_000);
    let error = coster
        .query_cost(&format!("{{ node {{ {ids} }} }}"), None, None)
        .unwrap_err();
    assert!(matches!(error, CostError::TooComplex { .. }), "{error}");
    assert!(error.to_string().contains("field visits"), "{error}");
    // A batch shares one bound: ten operations each under it, together over it.
    let some = "id ".repeat(100);
    let one = json!({ "query": format!("{{ node {{ {some} }} }}") });
    assert!(coster.json_cost(one.to_string().as_bytes()).is_ok());
    let ten = serde_json::Value::Array(vec![one; 10]);
    assert!(matches!(
        coster
            .max_field_visits(100_000)
            .json_cost(ten.to_string().as_bytes()),
        Err(CostError::TooComplex { max: 100_000 })
    ));
    // Inline fragments that do not apply count too: each is looked at once per type.
    let unions: String = (0..300).map(|n| format!(" | U{n}")).collect();
    let members: String = (0..300)
        .map(|n| format!("type U{n} {{ id: ID }}\n"))
        .collect();
    let sdl_with_union = format!("{sdl}union U = {}\n{members}", &unions[3..]);
    let fragments = "... on U { __typename } ".repeat(1_500);
    let error = GraphqlCost::new()
        .with_schema(&sdl_with_union)
        .unwrap()
        .query_cost(&format!("{{ node {{ {fragments} }} }}"), None, None)
        .unwrap_err();
    assert!(matches!(error, CostError::TooComplex { .. }), "{error}");
    // An everyday query through the interface is nowhere near it.
    assert_eq!(
        GraphqlCost::new()
            .with_schema(&sdl)
            .unwrap()
            .query_cost("{ node { id ... on T7 { id } } }", None, None)
            .unwrap(),
        1
    );
}

/// A root field is a resolver call, whatever it returns: each alias of a root field runs
/// it once more, so each costs at least the operation's minimum, and each root field of a
/// mutation (an alias is one more mutation run) pays the mutation base. Fields of one
/// response name are merged into one call (graphql-spec, "Field Collection"), written
/// twice or spread twice through a fragment.
/// A nesting limit raised past what the parser's and the walk's recursion fit on a
/// worker's stack let a hostile document abort the process, not fail the request: with
/// `max_depth(1_000)`, 800 nested levels overflowed a 2 MiB stack in a debug build (3,000
/// in a release one). The limit is held to `MAX_DEPTH`, where the deepest document is
/// refused on such a stack in a debug build.
#[test]
fn the_nesting_limit_fits_a_workers_stack() {
    use tollgate::cost::graphql::MAX_DEPTH;
    let deepest = std::thread::Builder::new()
        .stack_size(2 * 1024 * 1024)
        .spawn(|| {
            let coster = GraphqlCost::new().max_depth(MAX_DEPTH);
            let within = format!("{}{}", "{a".repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
            let past = format!("{}{}", "{a".repeat(5_000), "}".repeat(5_000));
            (
                coster.query_cost(&within, None, None),
                coster.query_cost(&past, None, None),
            )
        })
        .unwrap()
        .join()
        .expect("no overflow");
    assert_eq!(deepest.0.unwrap(), MAX_DEPTH as u64 - 1);
    assert!(deepest.1.is_err());
    let raised = std::panic::catch_unwind(|| GraphqlCost::new().max_depth(MAX_DEPTH + 1));
    let message = raised.expect_err("refused").downcast::<String>().unwrap();
    assert!(message.contains("MAX_DEPTH"), "{message}");
}

#[test]
fn each_root_field_is_charged_as_a_resolver_call() {
    let sends: String = (0..3).map(|n| format!(" a{n}: send(to: \"v\")")).collect();
    assert_eq!(cost(&format!("mutation {{{sends} }}")).unwrap(), 3 * 10);
    assert_eq!(cost("mutation { send(to: \"v\") }").unwrap(), 10);
    assert_eq!(
        cost("mutation { send(to: \"v\") send(to: \"v\") }").unwrap(),
        10,
        "one response name: one call"
    );
    assert_eq!(
        cost("mutation { ...M ...M } fragment M on Mutation { a: send b: send }").unwrap(),
        2 * 10
    );
    assert_eq!(
        cost("mutation { a: send ... on Mutation { b: send c: addStar { id } } }").unwrap(),
        3 * 10 + 1
    );
    let searches: String = (0..2500).map(|n| format!(" s{n}: search")).collect();
    assert_eq!(cost(&format!("{{{searches} }}")).unwrap(), 2500);
    assert_eq!(cost("{ viewer { login } a: hello }").unwrap(), 2);
    assert_eq!(cost("{ viewer { login } hello }").unwrap(), 2);
    // `__typename` runs no resolver.
    assert_eq!(cost("{ __typename hello }").unwrap(), 1);
    // Each root field is charged at least the minimum, whatever the others cost: a
    // floor on the whole operation let a client that pays for one costly field add as
    // many root resolver calls as that field's points, free (100 searches beside a
    // field of 101 points were charged 101).
    assert_eq!(
        cost("{ repos(first: 10) { nodes { name } } hello }").unwrap(),
        1 + 10 + 1
    );
    let searches: String = (0..100).map(|n| format!(" s{n}: search")).collect();
    assert_eq!(
        cost(&format!(
            "{{ repos(first: 100) {{ nodes {{ name }} }}{searches} }}"
        ))
        .unwrap(),
        1 + 100 + 100
    );
    assert_eq!(
        cost("{ repos(first: 10) { nodes { name } } ...S } fragment S on Query { a: search b: search }")
            .unwrap(),
        1 + 10 + 2,
        "root fields spread from a fragment too"
    );
    assert_eq!(
        cost("{ search search }").unwrap(),
        1,
        "one response name: one call"
    );
    // A mutation's root fields pay its base each, and the minimum at least.
    let mutation = "mutation { repos(first: 100) { nodes { name } } a: ping b: ping }";
    let without_base = GraphqlCost::new().mutation_base(0);
    assert_eq!(
        without_base.query_cost(mutation, None, None).unwrap(),
        101 + 2
    );
    let low_base = GraphqlCost::new().mutation_base(2).min_cost(5);
    assert_eq!(
        low_base.query_cost(mutation, None, None).unwrap(),
        101 + 3 * 2 + 2 * (5 - 2)
    );
    // A batch: each operation on its own.
    let batch = serde_json::json!([{ "query": "{ a b }" }, { "query": "mutation { x y }" }]);
    assert_eq!(
        GraphqlCost::new()
            .json_cost(batch.to_string().as_bytes())
            .unwrap(),
        2 + 2 * 10
    );
}

/// An empty `operationName` names no operation: gqlgen (gqlparser's `ForName`) runs the
/// document's only operation for it, so the coster costs that one.
#[test]
fn an_empty_operation_name_names_no_operation() {
    let coster = GraphqlCost::new();
    let query = "query Big { repos(first: 50) { nodes { id } } }";
    assert_eq!(coster.query_cost(query, Some(""), None).unwrap(), 1 + 50);
    let body = json!({ "query": query, "operationName": "" });
    assert_eq!(
        coster.json_cost(body.to_string().as_bytes()).unwrap(),
        1 + 50
    );
    let two = "query A { a } query B { b }";
    assert!(matches!(
        coster.query_cost(two, Some(""), None),
        Err(CostError::Operation(_))
    ));
}

/// A list the schema declares that nothing sizes (no slicing argument given or
/// defaulted, no `assumedSize`) was charged as one item: nesting such lists
/// (`users { friends { friends { name } } }`) multiplied the server's work and not the
/// cost (3: each list's call). It is charged `GraphqlCost::list_size` items (default 10, as a default page
/// size); a list a connection's `sizedFields` names is sized by the connection alone,
/// and without a schema no field is known to be a list.
#[test]
fn a_list_nothing_sizes_costs_the_assumed_list_size() {
    let sdl = r#"
        type Query { users: [User!]! user(id: ID): User page(first: Int): Page @listSize(slicingArguments: ["first"], sizedFields: ["nodes"]) }
        type Page { nodes: [User] }
        type User { name: String friends: [User!]! tags: [String] }
    "#;
    let coster = GraphqlCost::new().with_schema(sdl).unwrap();
    let cost = |coster: &GraphqlCost, query: &str| coster.query_cost(query, None, None).unwrap();
    let deep = "{ users { friends { friends { name } } } }";
    // Each list's call, times the items of the lists around it.
    assert_eq!(cost(&coster, deep), 1 + 10 * (1 + 10));
    assert_eq!(cost(&coster.clone().list_size(3), deep), 1 + 3 * (1 + 3));
    // An object is one item; a list of leaves costs its type's weight (none) once.
    assert_eq!(cost(&coster, "{ user(id: 1) { name tags } }"), 1);
    // A connection's size stands for its sized list, which is not sized again: named in
    // `sizedFields`, or any list below a connection sized without one.
    assert_eq!(
        cost(&coster, "{ page(first: 5) { nodes { name } } }"),
        1 + 5
    );
    let relay = GraphqlCost::new()
        .with_schema(
            "type Query { repos(first: Int): RepoConnection pinned: RepoConnection } \
             type RepoConnection { nodes: [Repo] edges: [RepoEdge] } type RepoEdge { node: Repo } \
             type Repo { owner: User issues(first: Int): IssueConnection } \
             type IssueConnection { nodes: [Issue] } type Issue { title: String } \
             type User { login: String }",
        )
        .unwrap();
    assert_eq!(
        cost(&relay, "{ repos(first: 20) { nodes { owner { login } } } }"),
        1 + 20 * 2
    );
    assert_eq!(
        cost(
            &relay,
            "{ repos(first: 20) { ...E } } fragment E on RepoConnection { edges { node { owner { login } } } }"
        ),
        1 + 20 * 3
    );
    assert_eq!(
        cost(
            &relay,
            "{ repos(first: 5) { nodes { issues(first: 10) { nodes { title } } } } }"
        ),
        1 + 5 * (1 + (1 + 10))
    );
    // A connection's `first` sizes the lists directly below it, not those of a connection
    // below it: `b`'s `items`, which nothing sizes, are of the assumed size however few
    // `a` holds (a small `first` made the query cheaper).
    let nested = GraphqlCost::new()
        .with_schema(
            "directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION \
             type Query { a(first: Int): A } type A { b: B @listSize(sizedFields: [\"items\"]) } \
             type B { items: [X] } type X { n: String }",
        )
        .unwrap();
    assert_eq!(cost(&nested, "{ a { b { items { n } } } }"), 1 + (1 + 10));
    assert_eq!(
        cost(&nested, "{ a(first: 2) { b { items { n } } } }"),
        1 + 2 * (1 + 10)
    );
    // Nothing sizes `pinned`: its list is of the assumed size.
    assert_eq!(
        cost(&relay, "{ pinned { nodes { owner { login } } } }"),
        1 + (1 + 10)
    );
    // Without a schema: as before, one item unless a slicing argument sizes it.
    assert_eq!(cost(&GraphqlCost::new(), deep), 3);
}

/// A type's `@cost(weight:)` is the cost of each value of the type: a list of 100 of them
/// costs 100 weights, as it does through a connection's sized field; a field's own weight
/// is the cost of calling it, once.
#[test]
fn a_list_of_a_weighted_type_costs_each_item() {
    let coster = GraphqlCost::new()
        .with_schema(
            r#"
            type Query {
              users(first: Int): [User]
              blobs(first: Int): [Blob]
              page(first: Int): UserPage @listSize(slicingArguments: ["first"], sizedFields: ["nodes"])
              named(first: Int): [User] @cost(weight: 2)
            }
            type UserPage { nodes: [User] }
            type User @cost(weight: 10) { name: String }
            scalar Blob @cost(weight: 3)
            "#,
        )
        .unwrap();
    let cost = |query: &str| coster.query_cost(query, None, None).unwrap();
    assert_eq!(cost("{ users(first: 100) { name } }"), 100 * 10);
    assert_eq!(
        cost("{ page(first: 100) { nodes { name } } }"),
        1 + 100 * 10
    );
    assert_eq!(cost("{ blobs(first: 5) }"), 5 * 3);
    // The field's own weight stands for the call; its items still cost their type's.
    assert_eq!(cost("{ named(first: 4) { name } }"), 2 + 4 * 10);
}

/// `@cost(weight:)` is a String in IBM's directive (`"2.5"`) and a Float in others': a
/// weight that is not a whole number is rounded up, never dropped (a dropped weight
/// falls back to the default: 0 for a leaf).
#[test]
fn a_fractional_weight_is_rounded_up() {
    let coster = GraphqlCost::new()
        .with_schema(
            r#"
            type Query {
              a: Int @cost(weight: "2.5")
              b: Int @cost(weight: 1.2)
              c: Int @cost(weight: "0.1")
            }
            "#,
        )
        .unwrap();
    let cost = |query: &str| coster.query_cost(query, None, None).unwrap();
    assert_eq!(cost("{ a }"), 3);
    assert_eq!(cost("{ b }"), 2);
    assert_eq!(cost("{ c }"), 1);
    assert_eq!(cost("{ a b }"), 5);
}

/// The introspection query tools send (GraphiQL's shape): every list of the
/// introspection types at most once on any path.
const INTROSPECTION: &str = r#"
    query IntrospectionQuery {
      __schema {
        queryType { name } mutationType { name } subscriptionType { name }
        types { ...FullType }
        directives { name description locations args { ...InputValue } }
      }
    }
    fragment FullType on __Type {
      kind name description
      fields(includeDeprecated: true) {
        name description args { ...InputValue } type { ...TypeRef }
        isDeprecated deprecationReason
      }
      inputFields { ...InputValue }
      interfaces { ...TypeRef }
      enumValues(includeDeprecated: true) { name description isDeprecated deprecationReason }
      possibleTypes { ...TypeRef }
    }
    fragment InputValue on __InputValue { name description type { ...TypeRef } defaultValue }
    fragment TypeRef on __Type {
      kind name
      ofType { kind name ofType { kind name ofType { kind name ofType { kind name
        ofType { kind name ofType { kind name ofType { kind name } } } } } } }
    }
"#;

/// Introspection fields are in no schema the coster reads, so no list of theirs is sized:
/// a type's fields, then their types' fields, and so on, is work that multiplies at each
/// level for a charge that adds one. The introspection query tools send goes through each
/// list of a type (fields, input fields, interfaces, possible types, enum values) at most
/// once on a path, and is costed; a document that goes through two on one path, or asks
/// for the whole schema twice, is refused (graphql-java's "good faith introspection"
/// draws the line at the same place).
#[test]
fn introspection_that_multiplies_is_refused() {
    let with_schema = GraphqlCost::new().with_schema(SDL).unwrap();
    for coster in [GraphqlCost::new(), with_schema] {
        let standard = coster.query_cost(INTROSPECTION, None, None);
        assert!(standard.is_ok(), "{standard:?}");
        assert!(
            coster
                .query_cost(
                    "{ __type(name: \"User\") { fields { name type { name } } } }",
                    None,
                    None
                )
                .is_ok()
        );
        for nested in [
            "{ __schema { types { fields { type { fields { name } } } } } }",
            "{ __type(name: \"User\") { fields { type { fields { name } } } } }",
            "{ __schema { types { interfaces { possibleTypes { name } } } } }",
            "{ __schema { types { fields { args { type { inputFields { name } } } } } } }",
            // Through fragments, and a fragment costed once at a shallow place and spread
            // again under a list of its own kind.
            "{ __schema { types { ...T } } } fragment T on __Type { fields { type { ...U } } } fragment U on __Type { enumValues { name } }",
            "{ __schema { types { ...F fields { type { ...F } } } } } fragment F on __Type { interfaces { name } }",
            "{ __schema { types { ... on __Type { possibleTypes { ... on __Type { fields { name } } } } } } }",
            // The whole schema twice, under two names, or its types under two names, or
            // the schema asked for twice through a field that returns the query type.
            "{ a: __schema { types { name } } b: __schema { types { name } } }",
            "{ __schema { a: types { fields { name } } b: types { fields { name } } } }",
            "{ a: viewer { __schema { types { name } } } b: viewer { __schema { types { name } } } }",
        ] {
            let Err(error) = coster.query_cost(nested, None, None) else {
                panic!("{nested}: costed");
            };
            assert!(
                matches!(error, CostError::Introspection(_)),
                "{nested}: {error:?}"
            );
            assert!(error.to_string().contains("introspection"), "{error}");
        }
    }
}

/// The layer reads a request's body before it calls the service inside: at the client's
/// pace. The service made ready by `poll_ready` is not held through that read (a
/// `ConcurrencyLimit`'s permit, a rate limiter's readiness): held, one slow upload kept
/// every other request out.
#[tokio::test(start_paused = true)]
async fn a_slow_upload_holds_no_capacity_of_the_inner_service() {
    use ::http::{Request, Response, StatusCode};
    use axum::body::Body;
    use bytes::Bytes;
    use std::time::Duration;
    use tollgate::cost::graphql::GraphqlCostLayer;
    use tower::{ServiceBuilder, ServiceExt};
    let service = ServiceBuilder::new()
        .layer(GraphqlCostLayer::new(GraphqlCost::new()))
        .concurrency_limit(1)
        .service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::from("ok")))
        });
    let post = |body: Body| {
        Request::post("/graphql")
            .header("content-type", "application/json")
            .body(body)
            .unwrap()
    };
    let (send, sent) = tokio::sync::oneshot::channel::<()>();
    let slow_body = Body::from_stream(futures_util::stream::once(async move {
        sent.await.ok();
        Ok::<_, std::io::Error>(Bytes::from_static(br#"{"query":"{ a }"}"#))
    }));
    let slow = tokio::spawn(service.clone().oneshot(post(slow_body)));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let quick = tokio::time::timeout(
        Duration::from_secs(5),
        service
            .clone()
            .oneshot(post(Body::from(r#"{"query":"{ b }"}"#))),
    )
    .await
    .expect("the quick request waited behind the slow upload")
    .unwrap();
    assert_eq!(quick.status(), StatusCode::OK);
    send.send(()).unwrap();
    assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
}

/// A cost directive whose arguments are not of the shape the coster reads (an enum value
/// `[first]` where strings `["first"]` are meant, a string where a Boolean is, a misspelt
/// argument) was dropped without a word: `@listSize(slicingArguments: [first])` read as
/// an empty list switched off the range check of `first`, so `repos(first: 1000000)` cost
/// 1 and passed `Reject`. `with_schema` refuses such a schema, naming the field.
#[test]
fn a_cost_directive_of_the_wrong_shape_is_refused() {
    let field = |directive: &str| {
        format!(
            "type Query {{ repos(first: Int): [Repo] {directive} }}\ntype Repo {{ name: String }}"
        )
    };
    for (directive, says) in [
        ("@listSize(slicingArguments: [first])", "slicingArguments"),
        (
            "@listSize(slicingArguments: [\"first\", 2])",
            "slicingArguments",
        ),
        ("@listSize(sizedFields: nodes)", "sizedFields"),
        (
            "@listSize(requireOneSlicingArgument: \"true\")",
            "requireOneSlicingArgument",
        ),
        ("@listSize(assumedSize: 50.0)", "assumedSize"),
        ("@listSize(assumedSize: [50])", "assumedSize"),
        ("@listSize(slicingArgument: [\"first\"])", "slicingArgument"),
        ("@cost(weigth: 5)", "weigth"),
        ("@cost(weight: \"heavy\")", "weight"),
        ("@cost(weight: [5])", "weight"),
    ] {
        let error = GraphqlCost::new()
            .with_schema(&field(directive))
            .map(|_| ())
            .unwrap_err();
        assert!(
            error.to_string().contains(says) && error.to_string().contains("Query.repos"),
            "{directive}: {error}"
        );
    }
    // On an argument and on a type too.
    for sdl in [
        "type Query { repos(first: Int @cost(weight: true)): [Repo] }\ntype Repo { name: String }",
        "type Query { repos(first: Int): [Repo] }\ntype Repo @cost(weigth: 3) { name: String }",
    ] {
        assert!(GraphqlCost::new().with_schema(sdl).is_err(), "{sdl}");
    }
    // The shapes the directives take are read as before.
    for directive in [
        "@listSize(slicingArguments: [\"first\"], requireOneSlicingArgument: false)",
        "@listSize(slicingArguments: \"first\", assumedSize: 10)",
        "@listSize(assumedSize: \"10\", sizedFields: [\"nodes\"])",
        "@cost(weight: 2)",
        "@cost(weight: \"2.5\")",
        "@cost(weight: 2.5)",
    ] {
        assert!(
            GraphqlCost::new().with_schema(&field(directive)).is_ok(),
            "{directive}"
        );
    }
    let coster = GraphqlCost::new()
        .with_schema(&field("@listSize(slicingArguments: [\"first\"])"))
        .unwrap();
    assert!(
        coster
            .query_cost("{ repos(first: 1000000) { name } }", None, None)
            .is_err()
    );
}
