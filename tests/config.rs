//! Policies from configuration: checked with errors that name the entry, served, and
//! reloaded while running without losing a request or mixing two configurations.

#![cfg(feature = "config")]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use http::{Request, StatusCode};
use tollgate::MemoryStore;
use tollgate::config::{LimiterConfig, LiveLayer};
use tower::ServiceExt;

fn parse(text: &str) -> LimiterConfig {
    toml::from_str(text).unwrap()
}

const FULL: &str = r#"
    key = ["header:x-api-key", "ip"]
    plan_header = "x-plan"
    headers = "draft-11"

    [[policies]]
    name = "free"
    algorithm = "fixed-window"
    limit = 3
    window = "1h"

    [[policies]]
    name = "pro"
    algorithm = "token-bucket"
    capacity = 100
    rate = "10/s"

    [[policies]]
    name = "trial"
    algorithm = "sliding-window"
    limit = 1
    window = "1h"
    shadow = true

    [plans]
    default = ["free", "trial"]
    pro = ["pro"]

    [costs]
    default = 1
    routes = { "/search" = 2, "POST /upload" = 3 }
"#;

fn request(method: &str, path: &str, key: Option<&str>, plan: Option<&str>) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(path);
    if let Some(key) = key {
        builder = builder.header("x-api-key", key);
    }
    if let Some(plan) = plan {
        builder = builder.header("x-plan", plan);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    let peer: SocketAddr = "192.0.2.9:1000".parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

fn app(layer: &LiveLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/search", get(|| async { "found" }))
        .route("/upload", post(|| async { "stored" }))
        .layer(layer.clone())
}

fn rate(response: &http::Response<Body>) -> String {
    response.headers()["ratelimit"].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_configuration_gives_plans_costs_keys_and_shadows() {
    let layer = LiveLayer::new(MemoryStore::new(), &parse(FULL)).unwrap();
    let app = app(&layer);
    // The default plan: "free" (3 an hour), "trial" in shadow and out of the headers.
    let response = app
        .clone()
        .oneshot(request("GET", "/", Some("a"), None))
        .await
        .unwrap();
    assert!(
        rate(&response).starts_with("\"free\";r=2;"),
        "{}",
        rate(&response)
    );
    assert!(!rate(&response).contains("trial"));
    // /search costs 2: the free plan is spent.
    let response = app
        .clone()
        .oneshot(request("GET", "/search", Some("a"), None))
        .await
        .unwrap();
    assert!(rate(&response).starts_with("\"free\";r=0;"));
    let response = app
        .clone()
        .oneshot(request("GET", "/", Some("a"), None))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    // The pro plan, named by the header: its own bucket; POST /upload costs 3.
    let response = app
        .clone()
        .oneshot(request("POST", "/upload", Some("a"), Some("pro")))
        .await
        .unwrap();
    assert_eq!(rate(&response), "\"pro\";r=97;t=1");
    // An unknown plan is the default one.
    let response = app
        .clone()
        .oneshot(request("GET", "/", Some("b"), Some("platinum")))
        .await
        .unwrap();
    assert!(rate(&response).starts_with("\"free\";r=2;"));
    // No API key: the chain falls back to the client address.
    let response = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert!(rate(&response).starts_with("\"free\";r=2;"));
    let response = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert!(rate(&response).starts_with("\"free\";r=1;"));
}

#[test]
fn invalid_configurations_name_the_entry_and_the_reason() {
    let policy = |body: &str| format!("[[policies]]\nname = \"api\"\n{body}\n");
    let cases: Vec<(String, &str, &str)> = vec![
        (String::new(), "policies", "no policy"),
        (
            policy("algorithm = \"fixed-widow\"\nlimit = 1\nwindow = \"1s\""),
            "policies[0] \"api\"",
            "unknown algorithm \"fixed-widow\"",
        ),
        (
            policy("algorithm = \"token-bucket\"\ncapacity = 10"),
            "policies[0] \"api\"",
            "token-bucket needs `rate`",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 0\nwindow = \"1s\""),
            "policies[0] \"api\"",
            "limit must be at least 1",
        ),
        (
            policy("algorithm = \"gcra\"\nrate = \"ten per second\"\nburst = 1"),
            "policies[0] \"api\"",
            "is not a rate",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[plans]\npro = [\"api\"]\n",
            "plans",
            "no plan is named \"default\"",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"apj\"]\n",
            "plans.default",
            "no policy is named \"apj\"",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"search\" = 2 }\n",
            "costs.routes.\"search\"",
            "a route is",
        ),
        (
            "key = [\"cookie:session\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key[0]",
            "unknown key \"cookie:session\"",
        ),
        (
            "failure_mode = \"panic\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "failure_mode",
            "not a failure mode",
        ),
        (
            policy(
                "algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"\n\
                 penalty = { denials = 3, within = \"1m\", block = \"1h\", max_block = \"1m\" }",
            ),
            "policies[0] \"api\"",
            "max_block",
        ), // A field the algorithm does not read is a mistake (a policing bucket with a
        // shaping bucket's max_delay), not a detail to drop.
        (
            policy(
                "algorithm = \"leaky-bucket\"\ncapacity = 5\nrate = \"1/s\"\nmax_delay = \"2s\"",
            ),
            "policies[0] \"api\"",
            "leaky-bucket does not read `max_delay`",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"\nburst = 3"),
            "policies[0] \"api\"",
            "fixed-window does not read `burst`",
        ),
        // A policy no plan lists limits nothing: a typo or a forgotten entry would look
        // enforced and not be.
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[[policies]]\nname = \"burst\"\nalgorithm = \"gcra\"\nrate = \"5/s\"\nburst = 2\n"
                + "[plans]\ndefault = [\"api\"]\npro = [\"api\"]\n",
            "policies[1] \"burst\"",
            "no plan lists it",
        ),
        // An empty plan limits nothing: its requests would pass unlimited.
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = []\npro = [\"api\"]\n",
            "plans.default",
            "an empty plan limits nothing",
        ),
        // Plans with nothing to choose between them: every request would get "default".
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\npro = [\"api\"]\n",
            "plans",
            "no plan_header",
        ),
        // A method is upper case, a path starts with a slash.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"post /upload\" = 2 }\n",
            "costs.routes.\"post /upload\"",
            "is not a method",
        ),
        // A misspelt method is a token as any extension method is, and a route of it
        // would never be matched: POST /upload charged the default. Only the methods of
        // RFC 9110 (section 9) and the IANA HTTP Method Registry (RFC 7237) are routes.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"PSOT /upload\" = 1 }\n",
            "costs.routes.\"PSOT /upload\"",
            "\"PSOT\" is not a registered method",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"* /upload\" = 1 }\n",
            "costs.routes.\"* /upload\"",
            "\"*\" is not a registered method",
        ),
        // axum 0.7's captures, from a file carried over: refused with the way to write it.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"/users/:id\" = 1 }\n",
            "costs.routes.\"/users/:id\"",
            "a capture is written as axum 0.8 writes it",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"POST upload\" = 2 }\n",
            "costs.routes.\"POST upload\"",
            "a route is",
        ),
        // A cost no policy of a plan could ever admit: every such request would be
        // refused (400), whatever the client did.
        (
            policy("algorithm = \"token-bucket\"\ncapacity = 10\nrate = \"5/s\"")
                + "[costs]\nroutes = { \"/search\" = 5, \"POST /upload\" = 20 }\n",
            "costs.routes.\"POST /upload\"",
            "costs 20, but policy \"api\" admits at most 10 units a request",
        ),
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[[policies]]\nname = \"big\"\nalgorithm = \"fixed-window\"\nlimit = 50\nwindow = \"1s\"\n"
                + "[plans]\ndefault = [\"api\"]\npro = [\"big\"]\n"
                + "[costs]\ndefault = 60\n",
            "costs.default",
            "costs 60, but policy \"api\" of plan \"default\" admits at most 3 units a request \
             (it prices every route not listed)",
        ),
        // Two spellings of one route: which cost applies would depend on map order.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 9\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"/search\" = 2, \" /search\" = 5 }\n",
            "costs.routes.\"/search\"",
            "the same route as costs.routes.\" /search\"",
        ),
        // A configuration that loads but limits nothing, or a setting nothing reads: each
        // would look in force and not be.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"")
                + "[costs]\ndefault = 0\n",
            "costs.default",
            "a cost of 0 is never limited, and no route costs more: the policies limit nothing",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 9\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"/search?full=1\" = 2 }\n",
            "costs.routes.\"/search?full=1\"",
            "a route is matched against the path alone",
        ),
        (
            policy("algorithm = \"fixed-window\"\nlimit = 9\nwindow = \"1s\"")
                + "[costs]\nroutes = { \"GET /a b\" = 2 }\n",
            "costs.routes.\"GET /a b\"",
            "a route is matched against the path alone",
        ),
        (
            "key = [\"header:x-api-key\"]\ntrusted_proxies = [\"10.0.0.0/8\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "trusted_proxies",
            "no key reads the client's address (add \"ip\" to key)",
        ),
        (
            "key = [\"global\", \"ip\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key[1]",
            "never reached: \"global\" before it always finds a key",
        ),
        // A number of too many digits is a duration too long, not a duration misspelt.
        (
            policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"99999999999999999999s\""),
            "policies[0] \"api\"",
            "\"99999999999999999999s\" is too long",
        ),
        (
            policy("algorithm = \"gcra\"\nrate = \"99999999999999999999/s\"\nburst = 1"),
            "policies[0] \"api\"",
            "\"99999999999999999999/s\": the amount is too large",
        ),
        // Nothing is in shadow: a setting that looks in force would do nothing.
        (
            "shadow_headers = true\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "shadow_headers",
            "nothing is in shadow",
        ),
        // A client address is always found (a request without one is the server's
        // error, not an absent key): what follows "ip" was never read.
        (
            "key = [\"ip\", \"header:x-api-key\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key[1]",
            "never reached: \"ip\" before it always finds a key",
        ),
        // The whole Cookie field is no identity: a client adds a cookie and has a new
        // key, and HTTP/2 clients split the field into several lines (RFC 9113 section
        // 8.2.3), each request then refused (400).
        (
            "key = [\"header:Cookie\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key[0]",
            "a client that adds a cookie has a new key",
        ),
        // A plan header is logged when it names no plan: never one the keys hash (an
        // API key), nor one that holds credentials.
        (
            "key = [\"header:x-api-key\"]\nplan_header = \"X-Api-Key\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n\"sk_live_gold\" = [\"api\"]\n",
            "plan_header",
            "\"x-api-key\" is a header the key reads",
        ),
        (
            "key = [\"ip\"]\nplan_header = \"authorization\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\npro = [\"api\"]\n",
            "plan_header",
            "\"authorization\" holds credentials",
        ),
        (
            "key = [\"ip\"]\nkey_salt_env = \"PATH\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key_salt_env",
            "no header key to salt",
        ),
        (
            policy(
                "algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\"\nshadow = true\n\
                 penalty = { denials = 3, within = \"1m\", block = \"1h\" }",
            ),
            "policies[0] \"api\"",
            "a shadow policy's penalty is never applied",
        ),
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n\" pro\" = [\"api\"]\n",
            "plans. pro",
            "spaces around a plan name",
        ),
        // Settings that look in force and are not: a plan name no header value carries
        // (`HeaderValue::to_str` reads visible ASCII), an empty one, a plan header with
        // only the default plan to choose, shadow numbers in headers that are not sent.
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n\"prö\" = [\"api\"]\n",
            "plans.prö",
            "no header value",
        ),
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n\"\" = [\"api\"]\n",
            "plans.",
            "an empty plan name",
        ),
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n",
            "plan_header",
            "only the default plan",
        ),
        (
            "shadow_headers = true\nheaders = \"none\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"\nshadow = true"),
            "shadow_headers",
            "no rate-limit header is sent",
        ),
        (
            policy("algorithm = \"gcra\"\nrate = \"10/min\"\nburst = 1"),
            "policies[0] \"api\"",
            "rate: \"10/min\" is not a rate: \"min\" is not a period (write s, m, h, d or a \
             duration: 10s)",
        ),
        // `costs.default` prices every route not listed: a plan none of whose requests
        // could pass on them (the plan of requests naming none, here) is shut out of
        // the API, whatever another plan admits.
        (
            "plan_header = \"x-plan\"\n\
             [[policies]]\nname = \"api\"\nalgorithm = \"token-bucket\"\ncapacity = 10\nrate = \"5/s\"\n\
             [[policies]]\nname = \"api-pro\"\nalgorithm = \"token-bucket\"\ncapacity = 100\nrate = \"50/s\"\n\
             [plans]\ndefault = [\"api\"]\npro = [\"api-pro\"]\n\
             [costs]\ndefault = 20\n"
                .to_owned(),
            "costs.default",
            "policy \"api\" of plan \"default\" admits at most 10 units",
        ),
        // A plan header beside one plan that is not the default: the default is what is
        // missing (removing the header, as the other reason said, only led there).
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\npro = [\"api\"]\n",
            "plans",
            "no plan is named \"default\"",
        ),
        // A plan name is written escaped into the entry (and so into logs): no terminal
        // control sequence of a file's reaches an operator's screen.
        (
            "plan_header = \"x-plan\"\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 3\nwindow = \"1s\"")
                + "[plans]\ndefault = [\"api\"]\n\"pro\\u001B[2J\" = [\"api\"]\n",
            "plans.pro\\u{1b}[2J",
            "no header value",
        ),
        // A key that reads the header an earlier one read and found missing is never
        // reached (header names are case-insensitive).
        (
            "key = [\"header:x-api-key\", \"header:X-API-Key\", \"ip\"]\n".to_owned()
                + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key[1]",
            "never reached: \"header:x-api-key\" before it reads the same header",
        ),
        // Each key of the chain is a step of every request: a bounded few.
        (
            format!(
                "key = [{}]\n",
                (0..17)
                    .map(|i| format!("\"header:x-k{i}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ) + &policy("algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1s\""),
            "key",
            "17 keys: at most 16",
        ),
        // The field is named (the README's example of an error).
        (
            "[[policies]]\nname = \"daily\"\nalgorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1x\"\n"
                .to_owned(),
            "policies[0] \"daily\"",
            "window: \"1x\" is not a duration",
        ),
    ];
    for (text, entry, reason) in cases {
        let config: LimiterConfig = match toml::from_str(&text) {
            Ok(config) => config,
            Err(error) if entry == "policies" => {
                // No [[policies]] at all: serde says the field is missing.
                assert!(error.to_string().contains("policies"), "{error}");
                continue;
            }
            Err(error) => panic!("{text}: {error}"),
        };
        let error = config.check().unwrap_err();
        assert_eq!(error.entry(), entry, "{text}");
        assert!(error.reason().contains(reason), "{text}: {error}");
        // Loading refuses it the same way.
        assert_eq!(
            LiveLayer::new(MemoryStore::new(), &config).unwrap_err(),
            error
        );
    }
    // A cost that some plans admit is a route for those plans: the configuration stands
    // (the other plans' clients are told the cost never fits).
    let pro_only = parse(
        "plan_header = \"x-plan\"\n\
         [[policies]]\nname = \"api\"\nalgorithm = \"token-bucket\"\ncapacity = 10\nrate = \"5/s\"\n\
         [[policies]]\nname = \"api-pro\"\nalgorithm = \"token-bucket\"\ncapacity = 100\nrate = \"50/s\"\n\
         [plans]\ndefault = [\"api\"]\npro = [\"api-pro\"]\n\
         [costs]\nroutes = { \"/export\" = 50 }\n",
    );
    assert_eq!(pro_only.check(), Ok(()));
    // Registered methods beyond RFC 9110's are routes (WebDAV's, PATCH, QUERY), and so is
    // PURGE, which caches take though no registry lists it.
    let registered = parse(
        "[[policies]]\nname = \"api\"\nalgorithm = \"fixed-window\"\nlimit = 9\nwindow = \"1s\"\n\
         [costs]\nroutes = { \"PROPFIND /dav\" = 2, \"VERSION-CONTROL /dav\" = 2, \
         \"PATCH /x\" = 2, \"QUERY /x\" = 2, \"PURGE /x\" = 2, \"GET /x\" = 2 }\n",
    );
    assert_eq!(registered.check(), Ok(()));
    // A layer in shadow refuses no cost.
    let watched = parse(
        "shadow = true\n\
         [[policies]]\nname = \"api\"\nalgorithm = \"token-bucket\"\ncapacity = 10\nrate = \"5/s\"\n\
         [costs]\nroutes = { \"/export\" = 50 }\n",
    );
    assert_eq!(watched.check(), Ok(()));
    // Within the limits a policy takes, a duration in any unit is read: 2^32 ms (about
    // 49.7 days) as well as 50d.
    for window in ["4294967296ms", "50d"] {
        let text = format!(
            "[[policies]]\nname = \"w\"\nalgorithm = \"fixed-window\"\nlimit = 1\nwindow = \"{window}\"\n"
        );
        assert_eq!(parse(&text).check(), Ok(()), "{window}");
    }
    // A misspelt field is refused by the parser, naming it.
    let error = toml::from_str::<LimiterConfig>(
        "[[policies]]\nname = \"a\"\nalgorithm = \"gcra\"\nrate = \"1/s\"\nburts = 3\n",
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("burts"), "{error}");
}

#[tokio::test]
async fn a_reload_keeps_unchanged_policies_and_starts_changed_ones_afresh() {
    let before = parse(
        r#"
        key = ["global"]
        [[policies]]
        name = "steady"
        algorithm = "fixed-window"
        limit = 5
        window = "1h"
        [[policies]]
        name = "tuned"
        algorithm = "fixed-window"
        limit = 5
        window = "1h"
    "#,
    );
    let layer = LiveLayer::new(MemoryStore::new(), &before).unwrap();
    let app = app(&layer);
    for _ in 0..2 {
        app.clone()
            .oneshot(request("GET", "/", None, None))
            .await
            .unwrap();
    }
    let mut after = before.clone();
    after.policies[1].limit = Some(8);
    layer.reload(&after).unwrap();
    let response = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    let field = rate(&response);
    assert!(
        field.starts_with("\"steady\";r=2;"),
        "unchanged: state kept: {field}"
    );
    assert!(
        field.contains("\"tuned\";r=7;"),
        "changed: fresh state: {field}"
    );
    // A bad reload is refused and the running configuration stays.
    let mut broken = after.clone();
    broken.policies[0].window = Some("soon".into());
    let error = layer.reload(&broken).unwrap_err();
    assert_eq!(error.entry(), "policies[0] \"steady\"");
    let response = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert!(rate(&response).starts_with("\"steady\";r=1;"));
}

/// Two configurations that cannot be mixed up: each names its own pair of policies.
fn generation(name: &str) -> LimiterConfig {
    parse(&format!(
        r#"
        key = ["global"]
        [[policies]]
        name = "{name}-a"
        algorithm = "token-bucket"
        capacity = 1000000
        rate = "1000000/s"
        [[policies]]
        name = "{name}-b"
        algorithm = "fixed-window"
        limit = 1000000
        window = "1h"
    "#
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reloading_under_load_loses_no_request_and_mixes_no_configurations() {
    let layer = LiveLayer::new(MemoryStore::new(), &generation("blue")).unwrap();
    // The handler waits a little, so many requests are in flight across each reload.
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_micros(200)).await;
                "ok"
            }),
        )
        .layer(layer.clone());
    let done = Arc::new(AtomicBool::new(false));
    let reloads = Arc::new(AtomicU64::new(0));
    let reloader = {
        let (layer, done, reloads) = (layer.clone(), Arc::clone(&done), Arc::clone(&reloads));
        tokio::spawn(async move {
            let colours = [generation("blue"), generation("green")];
            let mut turn = 0;
            while !done.load(Ordering::SeqCst) {
                turn += 1;
                layer.reload(&colours[turn % 2]).unwrap();
                reloads.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        })
    };
    let mut clients = Vec::new();
    let seen = Arc::new(AtomicU64::new(0));
    for _ in 0..16 {
        let (app, seen) = (app.clone(), Arc::clone(&seen));
        clients.push(tokio::spawn(async move {
            for _ in 0..150 {
                let response = app
                    .clone()
                    .oneshot(request("GET", "/", None, None))
                    .await
                    .unwrap();
                assert_eq!(response.status(), StatusCode::OK);
                let policy = response.headers()["ratelimit-policy"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                let rate = response.headers()["ratelimit"].to_str().unwrap().to_owned();
                // One configuration per request: both fields name one generation only.
                let blue = policy.starts_with("\"blue-a\"") && policy.contains("\"blue-b\"");
                let green = policy.starts_with("\"green-a\"") && policy.contains("\"green-b\"");
                assert!(blue ^ green, "{policy}");
                let colour = if blue { "blue" } else { "green" };
                let other = if blue { "green" } else { "blue" };
                assert!(
                    rate.contains(colour) && !rate.contains(other),
                    "{policy} / {rate}"
                );
                seen.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    reloader.await.unwrap();
    assert_eq!(
        seen.load(Ordering::SeqCst),
        16 * 150,
        "every request answered"
    );
    assert!(
        reloads.load(Ordering::SeqCst) > 10,
        "the configuration changed under load"
    );
}

#[tokio::test]
async fn a_request_in_flight_finishes_under_the_configuration_it_started_with() {
    let layer = LiveLayer::new(MemoryStore::new(), &generation("blue")).unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let waiting = Arc::clone(&gate);
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let waiting = Arc::clone(&waiting);
                async move {
                    waiting.notified().await;
                    "ok"
                }
            }),
        )
        .layer(layer.clone());
    let in_flight = tokio::spawn(app.clone().oneshot(request("GET", "/", None, None)));
    tokio::task::yield_now().await;
    layer.reload(&generation("green")).unwrap();
    gate.notify_one();
    let response = in_flight.await.unwrap().unwrap();
    assert!(
        response.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with("\"blue-a\"")
    );
    gate.notify_one();
    let response = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert!(
        response.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with("\"green-a\"")
    );
}

#[tokio::test]
async fn header_keys_can_be_salted_from_the_environment() {
    let config = |salt: &str| {
        parse(&format!(
            "key = [\"header:x-api-key\"]\n{salt}\n[[policies]]\nname = \"api\"\n\
             algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1h\"\n"
        ))
    };
    // A salt variable that is not set is an error, not a silent unsalted hash.
    let unset = config("key_salt_env = \"TOLLGATE_TEST_SALT_NEVER_SET\"");
    let error = unset.check().unwrap_err();
    assert_eq!(error.entry(), "key_salt_env");
    assert!(error.reason().contains("is not set"), "{error}");

    // One store, one API key: salted and unsalted hashes are different keys, so the
    // salted layer's client has a bucket of its own. The salt: a variable of this
    // process's environment long enough to be one (16 bytes at least).
    let long = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value)))
        .find(|(name, value)| {
            value.len() >= 16 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
        .map(|(name, _)| name)
        .expect("an environment variable of 16 bytes or more to salt with");
    let store = MemoryStore::new();
    let plain = LiveLayer::new(store.clone(), &config("")).unwrap();
    let salted = LiveLayer::new(store, &config(&format!("key_salt_env = \"{long}\""))).unwrap();
    let send = |layer: &LiveLayer| app(layer).oneshot(request("GET", "/", Some("k-1"), None));
    assert_eq!(send(&plain).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        send(&plain).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&salted).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        send(&salted).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Behind proxies that write RFC 7239's `Forwarded` alone, the configuration could not
/// say so: `"ip"` read `X-Forwarded-For` only, so every client behind them was keyed by
/// the proxy's address and shared one budget. `forwarded_header = "forwarded"` reads
/// `Forwarded` (RFC 7239, section 5.2, `for=`); a value it does not know, or one set with
/// no trusted proxy to believe it of, is an error naming the entry.
#[tokio::test]
async fn the_forwarded_header_is_configured() {
    let config = |settings: &str| {
        parse(&format!(
            "{settings}\n[[policies]]\nname = \"api\"\n\
             algorithm = \"fixed-window\"\nlimit = 1\nwindow = \"1h\"\n"
        ))
    };
    let layer = LiveLayer::new(
        MemoryStore::new(),
        &config("trusted_proxies = [\"10.0.0.0/8\"]\nforwarded_header = \"forwarded\""),
    )
    .unwrap();
    let send = |client: &str| {
        let mut request = Request::get("/")
            .header("forwarded", format!("for={client};proto=https"))
            .header("x-forwarded-for", "198.51.100.1")
            .body(Body::empty())
            .unwrap();
        let peer: SocketAddr = "10.0.0.1:1000".parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        app(&layer).oneshot(request)
    };
    assert_eq!(send("203.0.113.7").await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        send("203.0.113.8").await.unwrap().status(),
        StatusCode::OK,
        "another client behind the same proxy has a budget of its own"
    );
    assert_eq!(
        send("203.0.113.7").await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    for (settings, reason) in [
        (
            "trusted_proxies = [\"10.0.0.0/8\"]\nforwarded_header = \"forwarded-for\"",
            "\"x-forwarded-for\" or \"forwarded\"",
        ),
        ("forwarded_header = \"forwarded\"", "no trusted_proxies"),
    ] {
        let error = config(settings).check().unwrap_err();
        assert_eq!(error.entry(), "forwarded_header", "{settings}");
        assert!(error.reason().contains(reason), "{settings}: {error}");
    }
}

/// The plan header is the auth layer's to set. A request that carries it twice (a client
/// that wrote `x-plan: pro` before an auth layer that appends its own) names no one plan:
/// it gets the default plan, not whichever line comes first.
#[tokio::test]
async fn a_plan_named_twice_is_the_default_plan() {
    let layer = LiveLayer::new(MemoryStore::new(), &parse(FULL)).unwrap();
    let app = app(&layer);
    let mut twice = request("GET", "/", Some("c"), Some("pro"));
    twice
        .headers_mut()
        .append("x-plan", http::HeaderValue::from_static("free"));
    let response = app.clone().oneshot(twice).await.unwrap();
    assert!(
        rate(&response).starts_with("\"free\";r=2;"),
        "{}",
        rate(&response)
    );
    // Named once, it is that plan.
    let response = app
        .clone()
        .oneshot(request("GET", "/", Some("d"), Some("pro")))
        .await
        .unwrap();
    assert!(
        rate(&response).starts_with("\"pro\";"),
        "{}",
        rate(&response)
    );
}

/// JSON lets an object name a key twice and serde keeps the last: a route or a plan
/// written twice would be read as one, silently. Refused, naming the key (TOML refuses
/// it by itself).
#[test]
fn a_route_or_a_plan_named_twice_is_refused() {
    let route_twice = r#"{
        "policies": [{"name": "api", "algorithm": "fixed-window", "limit": 9, "window": "1s"}],
        "costs": {"routes": {"/search": 5, "/search": 50}}
    }"#;
    let error = serde_json::from_str::<LimiterConfig>(route_twice).unwrap_err();
    assert!(
        error.to_string().contains("\"/search\" is named twice"),
        "{error}"
    );
    let plan_twice = r#"{
        "policies": [{"name": "api", "algorithm": "fixed-window", "limit": 9, "window": "1s"}],
        "plans": {"default": ["api"], "default": []}
    }"#;
    let error = serde_json::from_str::<LimiterConfig>(plan_twice).unwrap_err();
    assert!(
        error.to_string().contains("\"default\" is named twice"),
        "{error}"
    );
    // Named once, both read.
    let once = r#"{
        "policies": [{"name": "api", "algorithm": "fixed-window", "limit": 9, "window": "1s"}],
        "plans": {"default": ["api"]},
        "costs": {"routes": {"/search": 5}}
    }"#;
    let config = serde_json::from_str::<LimiterConfig>(once).unwrap();
    config.check().unwrap();
}

/// Administering a configured layer: the live configuration's policy set for a plan and
/// the key its extractor gives a client (`HeaderKey::key_for`, salted as the layer salts)
/// reset that client on the store, where a hand-built set or a plain hash would miss it.
#[tokio::test]
async fn a_configured_layer_gives_its_sets_for_resets_and_peeks() {
    use tollgate::Store;
    let store = MemoryStore::new();
    let live = LiveLayer::new(store.clone(), &parse(FULL)).unwrap();
    let free = live.policies(None).unwrap();
    assert_eq!(free.len(), 2, "free and the shadow trial");
    assert_eq!(live.policies(Some("default")).unwrap().len(), 2);
    assert_eq!(live.policies(Some("pro")).unwrap()[0].name(), "pro");
    assert!(live.policies(Some("gold")).is_none());
    let send = || app(&live).oneshot(request("GET", "/", Some("k-9"), None));
    for _ in 0..3 {
        assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(
        send().await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let key = tollgate::key::HeaderKey::new("x-api-key")
        .key_for("k-9")
        .unwrap();
    store.reset(&key, &free).await.unwrap();
    assert_eq!(send().await.unwrap().status(), StatusCode::OK);
    // After a reload, the reloaded configuration's sets.
    live.reload(&parse(&FULL.replace("limit = 3", "limit = 5")))
        .unwrap();
    assert_eq!(live.policies(None).unwrap()[0].limit(), 5);
}

/// A fleet's replicas each decide alone while the store is away: `fallback_share` (one
/// over the replicas) keeps the fleet as a whole near the limit, as
/// `LocalFallback::share` does in code. Anything but a share in (0, 1], or a share beside
/// another failure mode, is refused.
#[tokio::test]
async fn the_fallback_share_is_configured() {
    let down = support::Flaky {
        inner: MemoryStore::new(),
        down: Arc::new(AtomicBool::new(true)),
    };
    let config = |extra: &str| {
        parse(&format!(
            "{extra}\n[[policies]]\nname = \"api\"\nalgorithm = \"fixed-window\"\n\
             limit = 8\nwindow = \"1h\"\n"
        ))
    };
    let live = LiveLayer::new(down, &config("fallback_share = 0.25")).unwrap();
    let mut admitted = 0;
    for _ in 0..8 {
        let response = app(&live)
            .oneshot(request("GET", "/", None, None))
            .await
            .unwrap();
        if response.status() == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 2, "a quarter of 8 while the store is away");
    for (extra, reason) in [
        ("fallback_share = 0.0", "above 0"),
        ("fallback_share = 1.5", "at most 1"),
        ("fallback_share = nan", "above 0"),
        ("fallback_share = 1e-9", "one millionth"),
        (
            "failure_mode = \"fail-open\"\nfallback_share = 0.5",
            "only the fallback has a share",
        ),
    ] {
        let error = config(extra).check().unwrap_err();
        assert_eq!(error.entry(), "fallback_share", "{extra}");
        assert!(error.reason().contains(reason), "{extra}: {error}");
    }
}

/// The file `cargo run --example config` serves (shipped in the package: the example
/// reads it from there) is one the crate takes as it stands.
#[test]
fn the_example_configuration_is_valid() {
    let config = parse(include_str!("../examples/tollgate.toml"));
    config.check().unwrap();
    assert!(config.store_timeout.is_some() && config.circuit_breaker.is_some());
}

/// The README's configuration example is one the crate takes as it stands.
#[test]
fn the_readmes_example_configuration_is_valid() {
    let readme = include_str!("../README.md");
    let start = readme
        .find("```toml\nkey = [\"header:x-api-key\"")
        .expect("the README's configuration example");
    let text = &readme[start + "```toml\n".len()..];
    let text = &text[..text.find("```").unwrap()];
    assert!(text.contains("plan_header"));
    assert_eq!(parse(text).check(), Ok(()));
}

/// A reload keeps the places of requests dropped during their shaping delay under the
/// configuration before: a request queued before the reload and dropped behind one
/// queued after it was kept in the old configuration's list, which the new one's round
/// never saw, so its place stayed booked for nobody.
#[tokio::test(start_paused = true)]
async fn a_reload_keeps_the_places_of_requests_dropped_during_their_delay() {
    let config = parse(
        r#"
        key = ["global"]
        [[policies]]
        name = "paced"
        algorithm = "leaky-shaping"
        rate = "6/m"
        max_delay = "60s"
    "#,
    );
    let store = MemoryStore::builder()
        .clock(tollgate::clock::RuntimeClock::new())
        .build();
    let layer = LiveLayer::new(store, &config).unwrap();
    let app = app(&layer);
    let start = tokio::time::Instant::now();
    let held = |patience: u64| {
        tokio::spawn(tokio::time::timeout(
            Duration::from_secs(patience),
            app.clone().oneshot(request("GET", "/", None, None)),
        ))
    };
    assert!(held(1).await.unwrap().is_ok(), "the first goes at once");
    // Queued 10 s ahead under the first configuration, 20 s under the reloaded one; their
    // clients give up at 1 s and 2 s.
    let before = held(1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    layer.reload(&config).unwrap();
    let after = held(2);
    assert!(before.await.unwrap().is_err());
    assert!(after.await.unwrap().is_err());
    // The next goes once the first one's unit has leaked out: at 10 s, not 20 s.
    let next = app
        .clone()
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    assert!(
        start.elapsed() <= Duration::from_secs(10),
        "sent at {:?}",
        start.elapsed()
    );
}

/// A store that cannot decide a policy (the Redis store refuses some very large quotas)
/// refuses the configuration when it is loaded or reloaded: the error names the policy's
/// entry as every other error of the file does (`policies[1] "huge"`), not "policies"
/// with a message about a builder the file never named.
#[test]
fn a_policy_the_store_cannot_decide_is_named_by_its_entry() {
    #[derive(Clone)]
    struct NoHugeQuotas(MemoryStore);
    impl tollgate::Store for NoHugeQuotas {
        fn decide(
            &self,
            key: &tollgate::Key,
            policies: &tollgate::PolicySet,
            cost: u64,
        ) -> tollgate::DecideFuture {
            self.0.decide(key, policies, cost)
        }
        fn validate(&self, policies: &tollgate::PolicySet) -> Result<(), tollgate::StoreError> {
            match policies.iter().find(|policy| policy.limit() > 1_000_000) {
                Some(policy) => Err(tollgate::StoreError::new(
                    tollgate::StoreErrorKind::Unsupported,
                    format!("policy {:?}: its quota is too large", policy.name()),
                )),
                None => Ok(()),
            }
        }
    }
    let config = parse(
        "plan_header = \"x-plan\"\n\
         [[policies]]\nname = \"api\"\nalgorithm = \"fixed-window\"\nlimit = 10\nwindow = \"1s\"\n\
         [[policies]]\nname = \"huge\"\nalgorithm = \"fixed-window\"\nlimit = 5000000\nwindow = \"1s\"\n\
         [plans]\ndefault = [\"api\"]\npro = [\"huge\"]\n",
    );
    assert_eq!(config.check(), Ok(()), "no store: the file is valid");
    let error = LiveLayer::new(NoHugeQuotas(MemoryStore::new()), &config).unwrap_err();
    assert_eq!(error.entry(), "policies[1] \"huge\"", "{error}");
    assert!(error.reason().contains("too large"), "{error}");
    assert!(!error.reason().contains("RateLimitLayer"), "{error}");
}

/// A refusal of the layer's own check (a concurrency limit over a store that cannot free
/// its slots) names the policy's entry, not a builder the file never names.
#[test]
fn a_layers_refusal_names_the_entry() {
    // A store that forwards decisions only: it cannot adjust.
    let (decide_only, _) = support::Flaky::new();
    let config = parse(
        "[[policies]]\nname = \"api\"\nalgorithm = \"fixed-window\"\nlimit = 10\nwindow = \"1s\"\n\
         [[policies]]\nname = \"inflight\"\nalgorithm = \"concurrency\"\nlimit = 2\n",
    );
    let error = LiveLayer::new(decide_only, &config).unwrap_err();
    assert_eq!(error.entry(), "policies[1] \"inflight\"", "{error}");
    assert!(!error.reason().contains("RateLimitLayer"), "{error}");
}

/// A store that decides in memory after `delay` (on tokio's clock), or fails while
/// `down` is set, counting the calls that reach it.
#[derive(Clone)]
struct Timed {
    inner: MemoryStore,
    delay: Duration,
    down: Arc<AtomicBool>,
    calls: Arc<AtomicU64>,
}

impl Timed {
    fn new(delay: Duration) -> Self {
        Timed {
            inner: MemoryStore::new(),
            delay,
            down: Arc::default(),
            calls: Arc::default(),
        }
    }
}

impl tollgate::Store for Timed {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let down = self.down.load(Ordering::SeqCst);
        let (inner, delay) = (self.inner.clone(), self.delay);
        let (key, policies) = (key.clone(), policies.clone());
        tollgate::DecideFuture::new(async move {
            tokio::time::sleep(delay).await;
            if down {
                return Err(tollgate::StoreError::new(
                    tollgate::StoreErrorKind::Unavailable,
                    "down",
                ));
            }
            inner.decide(&key, &policies, cost).await
        })
    }
}

/// One fail-closed policy under `settings`.
fn fail_closed(settings: &str) -> LimiterConfig {
    parse(&format!(
        "failure_mode = \"fail-closed\"\n{settings}\n[[policies]]\nname = \"api\"\n\
         algorithm = \"fixed-window\"\nlimit = 5\nwindow = \"1h\"\n"
    ))
}

/// The store timeout is a setting of the file (the README's advice for Redis, "keep it
/// above three round trips", could not be followed by a configured layer: it was 50 ms
/// whatever the file said).
#[tokio::test(start_paused = true)]
async fn the_store_timeout_is_configured() {
    let store = Timed::new(Duration::from_millis(100));
    let default = LiveLayer::new(store.clone(), &fail_closed("")).unwrap();
    let response = app(&default)
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "100 ms is past the default 50 ms"
    );
    let patient = LiveLayer::new(store, &fail_closed("store_timeout = \"500ms\"")).unwrap();
    let response = app(&patient)
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        rate(&response).starts_with("\"api\";r=4;t="),
        "{}",
        rate(&response)
    );
    // A reload sets it too.
    patient
        .reload(&fail_closed("store_timeout = \"20ms\""))
        .unwrap();
    let response = app(&patient)
        .oneshot(request("GET", "/", None, None))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
}

/// A cool-down written a day long by a slip (`"1d"` for `"1s"`), met by a blip: the
/// breaker opened for the day, and the reload that fixed the file changed nothing, every
/// request answered 503 (or by one replica's fallback) until a restart. A reload to a
/// shorter cool-down ends the one running within the new length from the reload.
#[tokio::test(start_paused = true)]
async fn a_reload_to_a_shorter_cool_down_shortens_an_open_breaker() {
    let store = Timed::new(Duration::ZERO);
    store.down.store(true, Ordering::SeqCst);
    let calls = Arc::clone(&store.calls);
    let get = |live: &LiveLayer| {
        let app = app(live);
        async move { app.oneshot(request("GET", "/", None, None)).await.unwrap() }
    };
    let day = "circuit_breaker = { failures = 1, cool_down = \"1d\" }";
    let live = LiveLayer::new(store.clone(), &fail_closed(day)).unwrap();
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let held = get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "open for the day");
    assert_eq!(held.headers()["retry-after"], "86400");
    store.down.store(false, Ordering::SeqCst);
    let second = "circuit_breaker = { failures = 1, cool_down = \"50ms\" }";
    live.reload(&fail_closed(second)).unwrap();
    // Within the new cool-down: still held, and told so.
    let held = get(&live).await;
    assert_eq!(held.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(held.headers()["retry-after"], "1");
    // The breaker's clock is the OS's (the runtime's is paused): 50 ms pass.
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(
        get(&live).await.status(),
        StatusCode::OK,
        "the store asked again"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // A longer one leaves the running cool-down as it is (the next is the new one).
    store.down.store(true, Ordering::SeqCst);
    get(&live).await;
    live.reload(&fail_closed(day)).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    store.down.store(false, Ordering::SeqCst);
    assert_eq!(get(&live).await.status(), StatusCode::OK);
}

/// The circuit breaker is a setting of the file. One breaker serves every configuration
/// of a layer: a reload sets the new settings on it as it is (a run of failures goes on,
/// an open breaker stays open until its probe), so requests admitted under the
/// configuration before never hold a breaker nothing reports to any more.
#[tokio::test(start_paused = true)]
async fn the_circuit_breaker_is_configured_and_kept_across_reloads() {
    let store = Timed::new(Duration::ZERO);
    store.down.store(true, Ordering::SeqCst);
    let calls = Arc::clone(&store.calls);
    let get = |live: &LiveLayer| {
        let app = app(live);
        async move {
            let response = app.oneshot(request("GET", "/", None, None)).await.unwrap();
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    // The default opens after 5 failures: the second request still asks the store.
    let default = LiveLayer::new(store.clone(), &fail_closed("")).unwrap();
    get(&default).await;
    get(&default).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let one = "circuit_breaker = { failures = 1, cool_down = \"1h\" }";
    let live = LiveLayer::new(store.clone(), &fail_closed(one)).unwrap();
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3, "open after one failure");
    // A run of failures goes on under new settings.
    let three = "circuit_breaker = { failures = 3, cool_down = \"1h\" }";
    let live = LiveLayer::new(store.clone(), &fail_closed(three)).unwrap();
    get(&live).await;
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 5, "two failures of three");
    let two = "circuit_breaker = { failures = 2, cool_down = \"1h\" }";
    live.reload(&fail_closed(two)).unwrap();
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    get(&live).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        6,
        "the third failure of the run opened it under the new setting"
    );
    // An open breaker stays open across reloads, the same settings or others.
    live.reload(&fail_closed(two)).unwrap();
    get(&live).await;
    let other = "circuit_breaker = { failures = 2, cool_down = \"2h\" }";
    live.reload(&fail_closed(other)).unwrap();
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    // A reload refused changes nothing.
    assert!(
        live.reload(&fail_closed("circuit_breaker = { failures = 0 }"))
            .is_err()
    );
    get(&live).await;
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    for (settings, entry, reason) in [
        ("store_timeout = \"0ms\"", "store_timeout", "no time"),
        (
            "store_timeout = \"soon\"",
            "store_timeout",
            "is not a duration",
        ),
        (
            "circuit_breaker = { failures = 0 }",
            "circuit_breaker.failures",
            "at least 1",
        ),
        (
            "circuit_breaker = { cool_down = \"4000d\" }",
            "circuit_breaker.cool_down",
            "longer than",
        ),
        (
            "circuit_breaker = { cool_down = \"1 hour\" }",
            "circuit_breaker.cool_down",
            "is not a duration",
        ),
    ] {
        let error = fail_closed(settings).check().unwrap_err();
        assert_eq!(error.entry(), entry, "{settings}");
        assert!(error.reason().contains(reason), "{settings}: {error}");
    }
    let misspelt = toml::from_str::<LimiterConfig>(
        "circuit_breaker = { failurs = 3 }\n[[policies]]\nname = \"api\"\n\
         algorithm = \"gcra\"\nrate = \"1/s\"\nburst = 1\n",
    );
    assert!(misspelt.unwrap_err().to_string().contains("failurs"));
}
