//! The limiter answers in the inner service's own body type (no re-boxing), and any other
//! body type works through `WrapBodyLayer`.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::{BoxBody, UnsyncBoxBody};
use http_body_util::{BodyExt, Empty, Full};
use tollgate::body::{RateLimitBody, WrapBodyLayer};
use tollgate::key::HeaderKey;
use tollgate::{MemoryStore, Policy, RateLimitLayer};
use tower::{Layer, Service, ServiceExt, service_fn};

fn limiter() -> RateLimitLayer<MemoryStore, HeaderKey> {
    RateLimitLayer::new(MemoryStore::new())
        .key(HeaderKey::new("x-api-key"))
        .policy(Policy::fixed_window("api", 1, Duration::from_secs(60)).unwrap())
}

fn request() -> Request<()> {
    Request::get("/")
        .header("x-api-key", "k1")
        .body(())
        .unwrap()
}

fn head() -> Request<()> {
    Request::head("/")
        .header("x-api-key", "k1")
        .body(())
        .unwrap()
}

/// Sends two requests through `service`: the first is admitted, the second denied.
/// Returns the admitted body and the denied response's body, read to the end.
async fn admitted_then_denied<S, B>(mut service: S) -> (Bytes, Bytes)
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible>,
    B: http_body::Body<Error: std::fmt::Debug>,
{
    let ok = service
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(ok.headers().contains_key("ratelimit"));
    let ok = ok.into_body().collect().await.unwrap().to_bytes();
    let denied = service
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    let denied = denied.into_body().collect().await.unwrap().to_bytes();
    (ok, denied)
}

/// `hello` in a body whose error type is `Infallible`, ready to be boxed.
fn hello() -> impl http_body::Body<Data = Bytes, Error = Infallible> + Send + Sync + 'static {
    Full::new(Bytes::from_static(b"hello")).map_err(|never: Infallible| match never {})
}

fn assert_problem(body: &[u8]) {
    let json: serde_json::Value = serde_json::from_slice(body).expect("a JSON problem body");
    assert_eq!(json["status"], 429);
    assert_eq!(json["policy"], "api", "{json}");
}

#[tokio::test]
async fn full_bodies_stay_full() {
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello"))))
    });
    // The response type is the inner one (`admitted_then_denied` names it).
    let service = limiter().layer(inner);
    let (ok, denied) = admitted_then_denied::<_, Full<Bytes>>(service).await;
    assert_eq!(ok, "hello");
    assert_problem(&denied);
}

#[tokio::test]
async fn boxed_bodies_and_wrapped_strings() {
    // `String` cannot hold arbitrary bytes (a custom 429 may not be UTF-8): wrapped.
    let strings = limiter().layer(
        WrapBodyLayer::new().layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::from("hello")))
        })),
    );
    let (ok, denied) = admitted_then_denied::<_, RateLimitBody<String>>(strings).await;
    assert_eq!(ok, "hello");
    assert_problem(&denied);

    let boxed = limiter().layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(hello().boxed()))
    }));
    let (ok, denied) = admitted_then_denied::<_, BoxBody<Bytes, Infallible>>(boxed).await;
    assert_eq!(ok, "hello");
    assert_problem(&denied);

    let unsync = limiter().layer(service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(hello().boxed_unsync()))
    }));
    let (ok, denied) = admitted_then_denied::<_, UnsyncBoxBody<Bytes, Infallible>>(unsync).await;
    assert_eq!(ok, "hello");
    assert_problem(&denied);
}

#[tokio::test]
async fn any_other_body_goes_through_the_wrap_layer() {
    // `Empty` cannot hold a problem body; wrapped, it can.
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    });
    let service = limiter().layer(WrapBodyLayer::new().layer(inner));
    let (ok, denied) = admitted_then_denied::<_, RateLimitBody<Empty<Bytes>>>(service).await;
    assert!(ok.is_empty());
    assert_problem(&denied);
}

#[tokio::test]
async fn axum_bodies_are_not_reboxed() {
    use axum::body::Body;
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Body::from("hello")))
    });
    let service = limiter().layer(inner);
    let (ok, denied) = admitted_then_denied::<_, Body>(service).await;
    assert_eq!(ok, "hello");
    assert_problem(&denied);
}

/// Two limiters stacked over one wrapped body (a route's limit inside a global one): each
/// keeps its in-flight slot until the body ends. The outer limiter's guard once replaced
/// the inner one's, which freed the inner slot when the response head left it.
#[tokio::test]
async fn stacked_limiters_each_keep_their_slot_until_the_body_ends() {
    let limiter = |name: &str, limit: u64| {
        RateLimitLayer::new(MemoryStore::new())
            .key(HeaderKey::new("x-api-key"))
            .policy(Policy::concurrency(name, limit).unwrap())
    };
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello"))))
    });
    let mut service =
        limiter("global", 10).layer(limiter("route", 1).layer(WrapBodyLayer::new().layer(inner)));
    let mut call = async || {
        service
            .ready()
            .await
            .unwrap()
            .call(request())
            .await
            .unwrap()
    };
    let first = call().await;
    assert_eq!(first.status(), StatusCode::OK);
    // The first body is not read yet: the route's one slot is still taken.
    let second = call().await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let problem: serde_json::Value =
        serde_json::from_slice(&second.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(problem["policy"], "route", "{problem}");
    assert_eq!(
        first.into_body().collect().await.unwrap().to_bytes(),
        "hello"
    );
    let third = call().await;
    assert_eq!(
        third.status(),
        StatusCode::OK,
        "the slot is free once the body ended"
    );
}

/// RFC 9110, section 9.3.2: a server MUST NOT send content in a response to HEAD. hyper
/// leaves HEAD bodies out over HTTP/1 only, and axum only in a top-level route: a
/// limiter outside a router, served over HTTP/2, sent its problem body, which an HTTP/2
/// client meets as a protocol error instead of the 429. The denial of a HEAD has none.
#[tokio::test]
async fn a_denied_head_request_has_no_body() {
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let mut service = limiter().layer(inner);
    let ok = service.ready().await.unwrap().call(head()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let denied = service.ready().await.unwrap().call(head()).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.headers().contains_key("retry-after"));
    assert!(http_body::Body::is_end_stream(denied.body()));
    // Section 8.6: the length a `GET` would be sent (axum fills one in from the body
    // left when none is there, which would say 0).
    let length: usize = denied.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = denied.into_body().collect().await.unwrap().to_bytes();
    assert!(body.is_empty(), "a HEAD's 429 sent {body:?}");
    let get = service
        .ready()
        .await
        .unwrap()
        .call(request())
        .await
        .unwrap();
    assert_eq!(get.status(), StatusCode::TOO_MANY_REQUESTS);
    let get = get.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(length, get.len());
}

/// RFC 9110, section 8.6: a server MUST NOT send `Content-Length` in a `1xx` or `204`
/// response, and in a `304` only the length a `200` would have had. A deny hook that
/// answers a `HEAD` with `204` or `304` got `Content-Length: 0` (the length of its empty
/// body, as a `GET` would be sent it): no field is added to those, and one the hook set
/// goes with the body.
#[tokio::test]
async fn a_hooks_no_content_answer_to_a_head_has_no_content_length() {
    for status in [StatusCode::NO_CONTENT, StatusCode::NOT_MODIFIED] {
        let inner = service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let mut service = limiter()
            .on_deny(move |_: &tollgate::Rejection<'_>| {
                Response::builder()
                    .status(status)
                    .header("content-length", "4")
                    .body(Bytes::from("none"))
                    .unwrap()
            })
            .layer(inner);
        let ok = service.ready().await.unwrap().call(head()).await.unwrap();
        assert_eq!(ok.status(), StatusCode::OK);
        let denied = service.ready().await.unwrap().call(head()).await.unwrap();
        assert_eq!(denied.status(), status);
        assert!(
            !denied.headers().contains_key("content-length"),
            "{status}: {:?}",
            denied.headers().get("content-length")
        );
        let body = denied.into_body().collect().await.unwrap().to_bytes();
        assert!(body.is_empty(), "{status}: sent {body:?}");
    }
}
