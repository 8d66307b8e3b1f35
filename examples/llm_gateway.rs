//! An LLM gateway behind tollgate: tokens reserved up front and settled to what the answer
//! used, failed requests refunded, and a limit on streams in flight.
//!
//! ```text
//! cargo run --example llm_gateway          # serves on 127.0.0.1:3000 ($PORT to change)
//!
//! # Reserves max_tokens (100), then settles to the 4 words of the prompt: RateLimit shows r=996.
//! curl -i -H 'x-api-key: team-a' -H 'content-type: application/json' \
//!      -d '{"prompt": "tell me a joke", "max_tokens": 100}' http://127.0.0.1:3000/v1/completions
//! # The prompt "fail" stands for the model being down: a 503, refunded in full.
//! curl -i -H 'x-api-key: team-a' -H 'content-type: application/json' \
//!      -d '{"prompt": "fail", "max_tokens": 100}' http://127.0.0.1:3000/v1/completions
//! # max_tokens above the bucket's 1,000 can never fit: 400.
//! curl -i -H 'x-api-key: team-a' -H 'content-type: application/json' \
//!      -d '{"prompt": "hi", "max_tokens": 5000}' http://127.0.0.1:3000/v1/completions
//! # A stream holds its response for 1 second; a third one at once is a 429.
//! curl -i -H 'x-api-key: team-a' http://127.0.0.1:3000/v1/stream
//! ```
//!
//! - `POST /v1/completions`, JSON `{"prompt": string, "max_tokens": int}`, keyed by
//!   `x-api-key`: policy `tokens`, a token bucket of 1,000 refilled 1,000 per minute.
//!   `max_tokens` is reserved when the request is admitted; the handler answers
//!   `x-tokens-used: N` (the words of the prompt, at most `max_tokens`) and the charge is
//!   settled to N before the response leaves, so its own `RateLimit` field shows it. A
//!   prompt of exactly `fail` stands for the model being down (in a real gateway, an
//!   outage no client chooses): a 503, and 502 and 503 answers are refunded in full.
//!   Other failures are not: a client that can make a request fail (an input that crashes
//!   the handler, a 500) must not get it for free.
//! - `GET /v1/stream`: policy `inflight`, at most 2 requests in flight per `x-api-key`;
//!   each response streams for 1 second.
//! - Both: an `x-api-key` the gateway does not know (here `team-a` and `team-b`) is a
//!   `401` before the limiter: keyed by whatever a client sends, a key made up per
//!   request would be a fresh budget per request. A completion bills at least one token.

#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tollgate::cost::{FromExtension, RequestCost};
use tollgate::key::HeaderKey;
use tollgate::settle::Settle;
use tollgate::{MemoryStore, Policy, PolicyError, Rate, RateLimitLayer};

/// The largest request body the gateway reads.
const MAX_BODY: usize = 64 * 1024;

/// Failures no client can cause: the upstream model unreachable or down. A 500 is not
/// among them (an input that crashes a handler would be free).
fn upstream_failed(status: StatusCode) -> bool {
    status == StatusCode::BAD_GATEWAY || status == StatusCode::SERVICE_UNAVAILABLE
}

/// The gateway over one in-process store (on any clock: the tests stop time).
fn app<C: tollgate::clock::Clock>(store: MemoryStore<C>) -> Result<Router, PolicyError> {
    let tokens = RateLimitLayer::new(store.clone())
        .policy(Policy::token_bucket(
            "tokens",
            1_000,
            Rate::per_minute(1_000),
        )?)
        .key(HeaderKey::new("x-api-key"))
        .cost(FromExtension::or(1))
        .settle(Settle::from_header("x-tokens-used").refund_if(upstream_failed));
    let inflight = RateLimitLayer::new(store)
        .policy(Policy::concurrency("inflight", 2)?)
        .key(HeaderKey::new("x-api-key"));
    // Layers on the method routers: they run for the handler only (another method is a
    // plain 405, read and charged by nobody).
    let completions = Router::new().route(
        "/v1/completions",
        post(completions)
            .route_layer(tokens)
            // Reads max_tokens before the limiter reserves it.
            .route_layer(middleware::from_fn(reserve_max_tokens))
            // Outermost: only a key the gateway knows reaches the limiter.
            .route_layer(middleware::from_fn(authenticate)),
    );
    let stream = Router::new().route(
        "/v1/stream",
        get(stream)
            .route_layer(inflight)
            .route_layer(middleware::from_fn(authenticate)),
    );
    Ok(completions.merge(stream))
}

/// The API keys the gateway knows (your authentication's place; here a fixed list).
const KEYS: [&str; 2] = ["team-a", "team-b"];

/// Refuses a request whose `x-api-key` the gateway does not know (`401`): the limits
/// are keyed by it, and a key made up per request would be a fresh budget per request.
async fn authenticate(request: Request, next: Next) -> Response {
    let known = request
        .headers()
        .get("x-api-key")
        .is_some_and(|key| KEYS.iter().any(|known| known.as_bytes() == key.as_bytes()));
    if !known {
        return problem(StatusCode::UNAUTHORIZED, "unknown or missing x-api-key");
    }
    next.run(request).await
}

#[derive(serde::Deserialize)]
struct Completion {
    prompt: String,
    max_tokens: u64,
}

/// Reads the request's `max_tokens` and hands it to the limiter as the request's cost.
async fn reserve_max_tokens(request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the request body is too large",
            );
        }
    };
    let completion: Completion = match serde_json::from_slice(&bytes) {
        Ok(completion) => completion,
        Err(error) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &format!(
                    "expected JSON {{\"prompt\": string, \"max_tokens\": non-negative integer}}: {error}"
                ),
            );
        }
    };
    // At least one unit: a request that reserves nothing would be served even from an
    // empty bucket. It is settled to what it used (possibly 0) all the same.
    parts
        .extensions
        .insert(RequestCost(completion.max_tokens.max(1)));
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// The "model": answers with as many tokens as the prompt has words, at most max_tokens.
/// It reads the body the middleware already checked (whatever its content type).
async fn completions(body: Bytes) -> Response {
    let completion: Completion = match serde_json::from_slice(&body) {
        Ok(completion) => completion,
        Err(error) => return problem(StatusCode::BAD_REQUEST, &error.to_string()),
    };
    if completion.prompt == "fail" {
        return problem(StatusCode::SERVICE_UNAVAILABLE, "the model is unavailable");
    }
    let used = (completion.prompt.split_whitespace().count() as u64).min(completion.max_tokens);
    // A completion the model answered bills at least one token: settled to 0, requests
    // of an empty prompt (or of max_tokens 0) were free, and without number.
    let billed = used.max(1);
    let text: Vec<&str> = completion
        .prompt
        .split_whitespace()
        .take(used as usize)
        .collect();
    let mut response = Json(json!({
        "text": text.join(" "),
        "tokens_used": billed,
    }))
    .into_response();
    response
        .headers_mut()
        .insert("x-tokens-used", HeaderValue::from(billed));
    response
}

/// A stream of five chunks, one every 200 ms: the response lasts one second.
async fn stream() -> Response {
    Body::new(Ticks {
        sent: 0,
        sleep: Box::pin(tokio::time::sleep(TICK)),
    })
    .into_response()
}

const TICK: Duration = Duration::from_millis(200);

struct Ticks {
    sent: u8,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl http_body::Body for Ticks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.sent == 5 {
            return Poll::Ready(None);
        }
        std::task::ready!(self.sleep.as_mut().poll(cx));
        self.sent += 1;
        let next = tokio::time::Instant::now() + TICK;
        self.sleep.as_mut().reset(next);
        let chunk = format!("chunk {}\n", self.sent);
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(chunk)))))
    }
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body: Value = json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    let port = port::from_env()?;
    let app = app(MemoryStore::new())?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!("tollgate LLM gateway listening on http://{addr}");
    println!(
        "POST /v1/completions: policy \"tokens\", 1000 tokens refilled 1000/min per x-api-key; \
         max_tokens reserved, settled to x-tokens-used, 502 and 503 refunded"
    );
    println!("GET  /v1/stream:      policy \"inflight\", 2 in flight per x-api-key");
    axum::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    fn completion(key: &str, body: &str) -> Request {
        Request::post("/v1/completions")
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    /// A store on which time stands still: the bucket refills a token every 60 ms, so
    /// on a real clock a slow machine would see more left than the exact numbers below.
    fn still() -> MemoryStore<tollgate::clock::ManualClock> {
        MemoryStore::builder()
            .clock(tollgate::clock::ManualClock::new())
            .build()
    }

    fn rate(response: &Response) -> &str {
        response.headers()["ratelimit"].to_str().unwrap()
    }

    #[tokio::test]
    async fn tokens_are_reserved_then_settled_and_failures_refunded() {
        let app = app(still()).unwrap();
        let send = |body: &str| app.clone().oneshot(completion("team-a", body));
        // 100 reserved, 4 used: the response's own RateLimit shows the settled 996.
        let response = send(r#"{"prompt": "tell me a joke", "max_tokens": 100}"#)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["x-tokens-used"], "4");
        assert_eq!(rate(&response), "\"tokens\";r=996;t=1");
        // Words beyond max_tokens are not used.
        let response = send(r#"{"prompt": "a b c d e", "max_tokens": 2}"#)
            .await
            .unwrap();
        assert_eq!(response.headers()["x-tokens-used"], "2");
        assert_eq!(rate(&response), "\"tokens\";r=994;t=1");
        // "fail" is a 503 (the model down), refunded in full.
        let response = send(r#"{"prompt": "fail", "max_tokens": 300}"#)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(rate(&response), "\"tokens\";r=994;t=1");
        // More than the bucket ever holds: 400, nothing spent.
        let response = send(r#"{"prompt": "hi", "max_tokens": 1001}"#)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("cost-exceeds-limit"));
        // A reservation that does not fit now is a 429: 994 left, 995 asked.
        let response = send(r#"{"prompt": "hi", "max_tokens": 995}"#)
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(response.headers().contains_key("retry-after"));
        // Another key has its own bucket.
        let response = app
            .clone()
            .oneshot(completion(
                "team-b",
                r#"{"prompt": "hi", "max_tokens": 1000}"#,
            ))
            .await
            .unwrap();
        assert_eq!(rate(&response), "\"tokens\";r=999;t=1");
    }

    #[tokio::test]
    async fn no_content_type_zero_tokens_and_other_methods() {
        let app = app(still()).unwrap();
        // Without a content type the JSON is read all the same, and settled.
        let request = Request::post("/v1/completions")
            .header("x-api-key", "team-a")
            .body(Body::from(r#"{"prompt": "one two", "max_tokens": 50}"#))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(rate(&response), "\"tokens\";r=998;t=1");
        // max_tokens 0 reserves one unit (an empty bucket refuses it) and is billed one:
        // settled to 0, such requests were free and without number.
        let response = app
            .clone()
            .oneshot(completion("team-a", r#"{"prompt": "hi", "max_tokens": 0}"#))
            .await
            .unwrap();
        assert_eq!(response.headers()["x-tokens-used"], "1");
        assert_eq!(rate(&response), "\"tokens\";r=997;t=1");
        // Another method is a 405, before any body is read.
        let request = Request::get("/v1/completions")
            .header("x-api-key", "team-a")
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    }

    #[tokio::test]
    async fn bad_requests_are_refused_before_anything_is_spent() {
        let app = app(still()).unwrap();
        for body in [
            "not json",
            r#"{"prompt": "hi"}"#,
            r#"{"prompt": "hi", "max_tokens": -1}"#,
        ] {
            let response = app
                .clone()
                .oneshot(completion("team-a", body))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        }
        let mut request = completion("team-a", r#"{"prompt": "hi", "max_tokens": 1}"#);
        request.headers_mut().remove("x-api-key");
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        // A key made up per request is no budget per request: refused before the limiter.
        for made_up in ["k0", "k1", "k2"] {
            let request = completion(made_up, r#"{"prompt": "hi", "max_tokens": 1000}"#);
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{made_up}");
        }
        let response = app
            .clone()
            .oneshot(completion("team-a", r#"{"prompt": "hi", "max_tokens": 1}"#))
            .await
            .unwrap();
        assert_eq!(rate(&response), "\"tokens\";r=999;t=1");
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_two_streams_in_flight_per_key() {
        let app = app(still()).unwrap();
        let stream = |key: &str| {
            app.clone().oneshot(
                Request::get("/v1/stream")
                    .header("x-api-key", key)
                    .body(Body::empty())
                    .unwrap(),
            )
        };
        let first = stream("team-a").await.unwrap();
        let second = stream("team-a").await.unwrap();
        assert_eq!(
            (first.status(), second.status()),
            (StatusCode::OK, StatusCode::OK)
        );
        assert_eq!(
            first.headers()["ratelimit-policy"],
            "\"inflight\";q=2;qu=\"concurrent-requests\""
        );
        let third = stream("team-a").await.unwrap();
        assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(stream("team-b").await.unwrap().status(), StatusCode::OK);
        // The first stream runs its second to the end; then its slot is free.
        let started = tokio::time::Instant::now();
        let body = first.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        assert_eq!(body, "chunk 1\nchunk 2\nchunk 3\nchunk 4\nchunk 5\n");
        assert_eq!(stream("team-a").await.unwrap().status(), StatusCode::OK);
    }
}
