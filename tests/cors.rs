//! A browser-facing API: the limiter inside tower-http's `CorsLayer`.
//!
//! A script in a browser reads only the response fields CORS lets it: the Fetch
//! standard's CORS-safelisted response-header names (`Cache-Control`, `Content-Language`,
//! `Content-Length`, `Content-Type`, `Expires`, `Last-Modified`, `Pragma`) and those the
//! server names in `Access-Control-Expose-Headers`. `RateLimit`, `RateLimit-Policy` and
//! `Retry-After` are not safelisted: unless exposed, a script sees a 429 and cannot tell
//! when to come back (draft-ietf-httpapi-ratelimit-headers-11, section 5, asks clients to
//! read them). `HeaderStyle::field_names` lists what to expose.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{HeaderName, Method, Request, StatusCode, header};
use tower::ServiceExt;
use tower_http::cors::{Any, CorsLayer};

use tollgate::{HeaderStyle, MemoryStore, Policy, RateLimitLayer};

const PEER: ([u8; 4], u16) = ([203, 0, 113, 7], 40000);

fn app(style: HeaderStyle) -> Router {
    Router::new()
        .route("/data", get(|| async { "data" }))
        // Innermost: the limiter. Outermost: CORS, which answers preflights itself and
        // adds its fields to every response, the limiter's 429 included.
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::fixed_window("hourly", 1, Duration::from_secs(3600)).unwrap())
                .headers(style),
        )
        .layer(
            CorsLayer::new()
                .allow_origin(Any)
                .allow_methods([Method::GET])
                .expose_headers(style.field_names().to_vec()),
        )
}

fn from_browser(method: Method) -> Request<Body> {
    let mut request = Request::builder()
        .method(method.clone())
        .uri("/data")
        .header(header::ORIGIN, "https://app.example");
    if method == Method::OPTIONS {
        request = request.header(header::ACCESS_CONTROL_REQUEST_METHOD, "GET");
    }
    let mut request = request.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(std::net::SocketAddr::from(PEER));
    request
}

async fn send(app: &Router, method: Method) -> http::Response<Body> {
    app.clone().oneshot(from_browser(method)).await.unwrap()
}

fn exposed(response: &http::Response<Body>) -> Vec<String> {
    response
        .headers()
        .get_all(header::ACCESS_CONTROL_EXPOSE_HEADERS)
        .iter()
        .flat_map(|value| value.to_str().unwrap().split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect()
}

#[tokio::test]
async fn preflights_are_not_charged_and_a_denial_is_readable_by_the_page() {
    let app = app(HeaderStyle::Draft11);
    // Preflights, however many, are answered by CORS and spend nothing.
    for _ in 0..3 {
        let preflight = send(&app, Method::OPTIONS).await;
        assert_eq!(preflight.status(), StatusCode::OK);
        assert!(!preflight.headers().contains_key("ratelimit"));
    }
    let allowed = send(&app, Method::GET).await;
    assert_eq!(allowed.status(), StatusCode::OK, "the hour's one request");
    let rate = allowed.headers()["ratelimit"].to_str().unwrap();
    assert!(rate.starts_with("\"hourly\";r=0;t="), "{rate}");
    let denied = send(&app, Method::GET).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
    let exposed = exposed(&denied);
    for field in ["ratelimit", "ratelimit-policy", "retry-after"] {
        assert!(denied.headers().contains_key(field), "{field} is sent");
        assert!(
            exposed.contains(&field.to_owned()),
            "{field} is exposed: {exposed:?}"
        );
    }
}

// Each style's `field_names` are exactly the rate-limit fields it writes, `Retry-After`
// included: on an admitted response all but `Retry-After`, on a denial all of them.
#[tokio::test]
async fn each_style_names_the_fields_it_writes() {
    let rate_limit_field = |name: &HeaderName| {
        let name = name.as_str();
        name.starts_with("ratelimit") || name.starts_with("x-ratelimit") || name == "retry-after"
    };
    for style in [
        HeaderStyle::Draft11,
        HeaderStyle::Draft6,
        HeaderStyle::Legacy,
        HeaderStyle::None,
    ] {
        let app = app(style);
        let mut named: Vec<&str> = style.field_names().iter().map(HeaderName::as_str).collect();
        named.sort_unstable();
        let written = |response: &http::Response<Body>| {
            let mut names: Vec<String> = response
                .headers()
                .keys()
                .filter(|name| rate_limit_field(name))
                .map(|name| name.as_str().to_owned())
                .collect();
            names.sort_unstable();
            names
        };
        let allowed = send(&app, Method::GET).await;
        assert_eq!(allowed.status(), StatusCode::OK);
        let expected: Vec<&str> = named
            .iter()
            .copied()
            .filter(|n| *n != "retry-after")
            .collect();
        assert_eq!(written(&allowed), expected, "{style:?}, admitted");
        let denied = send(&app, Method::GET).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(written(&denied), named, "{style:?}, denied");
    }
}
