//! The responses the limiter writes itself: `429` for a rate decision, `400` for a cost
//! that can never fit or a missing client key, `500` for a server-side set-up mistake,
//! `503` for a store failure under fail-closed. Bodies are RFC 9457 `application/problem+json`.

use std::fmt::Write;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::decision::{Decision, PolicyStatus};
use crate::key::{KeyError, KeyErrorKind};
use crate::policy::{Algorithm, Policy, PolicySet};
use crate::respond::headers::seconds_ceil;

/// What a deny hook is told about a denied request.
///
/// The hook ([`RateLimitLayer::on_deny`](crate::RateLimitLayer::on_deny)) writes the
/// answer; the layer still adds the rate-limit fields to it, and `Retry-After` to its
/// `429`:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::{BodyExt, Full};
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::clock::ManualClock;
/// use tollgate::key::HeaderKey;
/// use tollgate::{MemoryStore, Policy, RateLimitLayer, Rate, Rejection};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = RateLimitLayer::new(MemoryStore::builder().clock(ManualClock::new()).build())
///     .policy(Policy::gcra("api", Rate::per_second(5), 5)?)
///     .key(HeaderKey::new("x-api-key"))
///     .on_deny(|rejection: &Rejection<'_>| {
///         Response::builder()
///             .status(StatusCode::TOO_MANY_REQUESTS)
///             .header("content-type", "text/plain")
///             .body(Bytes::from(format!("slow down, try again in {}s", rejection.retry_after_secs())))
///             .unwrap()
///     })
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
///     }));
/// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
/// for _ in 0..5 {
///     assert_eq!(service.clone().oneshot(request()).await?.status(), StatusCode::OK);
/// }
/// let denied = service.clone().oneshot(request()).await?;
/// assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(denied.headers()["content-type"], "text/plain"); // the hook's
/// assert_eq!(denied.headers()["retry-after"], "1"); // the layer's, as the rest below
/// assert_eq!(denied.headers()["ratelimit-policy"], "\"api\";q=5;w=1");
/// assert_eq!(denied.headers()["ratelimit"], "\"api\";r=0;t=1");
/// assert_eq!(denied.into_body().collect().await?.to_bytes(), "slow down, try again in 1s");
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Rejection<'a> {
    /// The policy that keeps the client waiting longest.
    pub policy: &'a Policy,
    /// How long until the request would be admitted: that policy's wait, no earlier
    /// than the `t` stated for any policy that denies the request.
    pub retry_after: Duration,
    /// The whole decision, with every policy's status.
    pub decision: &'a Decision,
    /// Every policy the request was decided under, in the decision's order.
    pub policies: &'a PolicySet,
    /// The request's cost.
    pub cost: u64,
}

impl Rejection<'_> {
    /// `retry_after` in whole seconds, rounded up, at least 1 and at most
    /// 999,999,999,999,999 (the bound of the rate-limit fields' integers, so that a reset
    /// sent beside it is never earlier): the `Retry-After` value.
    pub fn retry_after_secs(&self) -> u64 {
        seconds_ceil(self.retry_after).clamp(1, crate::respond::headers::MAX_SF_INTEGER)
    }

    /// The names of the policies this request exceeded (the draft's `violated-policies`):
    /// every policy with fewer units left than the request costs (for a shaping bucket:
    /// with no room left; for an in-flight policy, which counts requests: with no slot
    /// free for a request that takes one), the one that keeps the client waiting longest
    /// first.
    ///
    /// Here each request costs 3, under a bucket of 5 and a day of 8. The second request
    /// exceeds the bucket alone; a second later the bucket is full again, and the fourth
    /// exceeds both, the day (which keeps the client waiting longest) first:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::time::Duration;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower::{Layer, ServiceExt, service_fn};
    /// use tollgate::clock::ManualClock;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rejection};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new();
    /// let service = RateLimitLayer::new(MemoryStore::builder().clock(clock.clone()).build())
    ///     .policy(Policy::token_bucket("burst", 5, Rate::per_second(5))?)
    ///     .policy(Policy::fixed_window("daily", 8, Duration::from_secs(86_400))?)
    ///     .key(HeaderKey::new("x-api-key"))
    ///     .cost(3)
    ///     .on_deny(|rejection: &Rejection<'_>| {
    ///         let violated = rejection.violated_policies().join(", ");
    ///         let mut response = Response::new(Bytes::new());
    ///         *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    ///         response.headers_mut().insert("x-violated", violated.parse().unwrap());
    ///         response
    ///     })
    ///     .layer(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    ///     }));
    /// let call = || {
    ///     let request = Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///     service.clone().oneshot(request)
    /// };
    /// assert_eq!(call().await?.status(), StatusCode::OK); // 2 left of 5, 5 of 8
    /// assert_eq!(call().await?.headers()["x-violated"], "burst");
    /// clock.advance(Duration::from_secs(1));
    /// assert_eq!(call().await?.status(), StatusCode::OK); // 2 left of 5, 2 of 8
    /// assert_eq!(call().await?.headers()["x-violated"], "daily, burst");
    /// # Ok(()) }
    /// ```
    pub fn violated_policies(&self) -> Vec<&str> {
        let mut names = vec![self.policy.name()];
        for (policy, status) in self.policies.iter().zip(self.decision.statuses()) {
            if exceeds(policy, status, self.cost) && policy.name() != self.policy.name() {
                names.push(policy.name());
            }
        }
        names
    }
}

/// True when `policy`, in `status`, denies a request of `cost` too: fewer units left
/// than it costs (a shaping bucket: no room left for a request that costs something, as
/// it admits any cost that fits its burst and delays it; an in-flight policy, which
/// counts requests: no slot free for a request that takes one). A shadow policy never
/// denies.
pub(crate) fn exceeds(policy: &Policy, status: &PolicyStatus, cost: u64) -> bool {
    let exceeded = match policy.algorithm() {
        // A request that costs nothing queues nothing: it goes however full the bucket.
        Algorithm::LeakyShaping { .. } => status.remaining == 0 && cost > 0,
        Algorithm::Concurrency { .. } => status.remaining < cost.min(1),
        _ => status.remaining < cost,
    };
    exceeded && !policy.is_shadow()
}

/// The problem type of a denial: the "Quota Exceeded" problem type of
/// draft-ietf-httpapi-ratelimit-headers-11 (section "Problem Types").
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The problem type of a `503` under fail-closed: the "Temporary Reduced Capacity"
/// problem type of draft-ietf-httpapi-ratelimit-headers-11 (section "Problem Types").
pub const TEMPORARY_REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// A JSON string literal.
fn json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

enum Member<'a> {
    Text(&'a str),
    /// Written as at most [`MAX_JSON_INTEGER`].
    Number(u64),
    Texts(Vec<&'a str>),
}

/// The largest integer every JSON reader takes exactly (RFC 8259, section 6; I-JSON, RFC
/// 7493, section 2.2): 2^53 − 1. Past it, a number is written as this (a cost past it is
/// still more than any limit, which is what the member tells).
const MAX_JSON_INTEGER: u64 = (1 << 53) - 1;

/// The most of a detail an answer shows: a detail that echoes what the client sent (an
/// operation's name, a key's reason) echoes no client's megabyte.
const DETAIL_SHOWN: usize = 1_024;

/// `detail`, cut at [`DETAIL_SHOWN`] bytes (on a character's boundary) with `…` after.
fn shown(detail: &str) -> std::borrow::Cow<'_, str> {
    if detail.len() <= DETAIL_SHOWN {
        return detail.into();
    }
    format!("{}…", cut(detail, DETAIL_SHOWN)).into()
}

/// `text`'s first `max` bytes at most, cut on a character's boundary.
pub(super) fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
    members: &[(&str, Member<'_>)],
) -> Response<Bytes> {
    let mut body = String::with_capacity(160);
    body.push_str("{\"type\":");
    json_string(&mut body, kind);
    body.push_str(",\"title\":");
    json_string(&mut body, title);
    let _ = write!(body, ",\"status\":{}", status.as_u16());
    body.push_str(",\"detail\":");
    json_string(&mut body, &shown(detail));
    for (name, value) in members {
        body.push(',');
        json_string(&mut body, name);
        body.push(':');
        match value {
            Member::Text(text) => json_string(&mut body, text),
            Member::Number(number) => {
                let _ = write!(body, "{}", (*number).min(MAX_JSON_INTEGER));
            }
            Member::Texts(texts) => {
                body.push('[');
                for (index, text) in texts.iter().enumerate() {
                    if index > 0 {
                        body.push(',');
                    }
                    json_string(&mut body, text);
                }
                body.push(']');
            }
        }
    }
    body.push('}');
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// `429 Too Many Requests` with `Retry-After` and a problem body.
pub(crate) fn too_many_requests(rejection: &Rejection<'_>) -> Response<Bytes> {
    let seconds = rejection.retry_after_secs();
    let detail = format!(
        "rate limit \"{}\" exceeded; retry in {seconds} s",
        rejection.policy.name()
    );
    let mut response = problem(
        StatusCode::TOO_MANY_REQUESTS,
        QUOTA_EXCEEDED,
        "Request cannot be satisfied as assigned quota has been exceeded",
        &detail,
        &[
            (
                "violated-policies",
                Member::Texts(rejection.violated_policies()),
            ),
            ("policy", Member::Text(rejection.policy.name())),
            ("retry_after", Member::Number(seconds)),
        ],
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// The type URI of the "cost exceeds limit" problem.
pub const COST_EXCEEDS_LIMIT: &str = "urn:tollgate:problem:cost-exceeds-limit";

/// `400`: the request costs more than the policy ever admits; retrying cannot help, so
/// there is no `Retry-After`.
pub(crate) fn cost_exceeds_limit(policy: &Policy, cost: u64, limit: u64) -> Response<Bytes> {
    let detail = format!(
        "this request costs {cost} but policy \"{}\" admits at most {limit} at once",
        policy.name()
    );
    problem(
        StatusCode::BAD_REQUEST,
        COST_EXCEEDS_LIMIT,
        "Request cost exceeds the rate limit",
        &detail,
        &[
            ("policy", Member::Text(policy.name())),
            ("cost", Member::Number(cost)),
            ("limit", Member::Number(limit)),
        ],
    )
}

/// `400` when the client left out what identifies it, `500` when the server is set up
/// wrong.
pub(crate) fn key_error(error: &KeyError) -> Response<Bytes> {
    let (status, title) = match error.kind() {
        KeyErrorKind::Client => (StatusCode::BAD_REQUEST, "Bad Request"),
        KeyErrorKind::Server => (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error"),
    };
    // How the server is built is not the client's business (RFC 9457, section 5): a
    // server-side reason goes to the log (`telemetry::key_rejected`), not into the body.
    let detail = match error.kind() {
        KeyErrorKind::Client => format!("the rate limiter could not identify the client: {error}"),
        // Its log says why only where there is one (the `tracing` feature).
        KeyErrorKind::Server if cfg!(feature = "tracing") => {
            "the rate limiter could not identify the client: the server is set up wrong \
             (its log says why)"
                .to_owned()
        }
        KeyErrorKind::Server => {
            "the rate limiter could not identify the client: the server is set up wrong".to_owned()
        }
    };
    problem(status, "about:blank", title, &detail, &[])
}

/// `413`: a body larger than the cap a body-reading coster accepts.
#[cfg(feature = "graphql")]
pub(crate) fn payload_too_large(limit: usize) -> Response<Bytes> {
    let detail = format!("the request body is larger than {limit} bytes");
    problem(
        StatusCode::PAYLOAD_TOO_LARGE,
        "about:blank",
        "Content Too Large",
        &detail,
        &[("limit", Member::Number(limit as u64))],
    )
}

/// `400`: a request whose cost cannot be computed (a malformed GraphQL document).
#[cfg(feature = "graphql")]
pub(crate) fn invalid_request(detail: &str) -> Response<Bytes> {
    problem(
        StatusCode::BAD_REQUEST,
        "about:blank",
        "Bad Request",
        detail,
        &[],
    )
}

/// `500` under fail-closed for a store that cannot decide the request's policies (a
/// set-up error, `StoreErrorKind::Unsupported`): no outage, so no `Retry-After` (the
/// same request meets the same refusal) and no rate headers.
pub(crate) fn policies_undecidable() -> Response<Bytes> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "about:blank",
        "Internal Server Error",
        "the rate limiter's store cannot decide this request's policies",
        &[],
    )
}

/// `503` for a store failure under fail-closed: not a rate decision, so no rate headers.
/// `retry_after` (whole seconds, at least 1) is when the store is asked again.
pub(crate) fn store_unavailable(retry_after: u64) -> Response<Bytes> {
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        TEMPORARY_REDUCED_CAPACITY,
        "Temporary reduced capacity",
        "the rate-limit store is unavailable",
        &[("retry_after", Member::Number(retry_after))],
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_are_escaped() {
        let mut out = String::new();
        json_string(&mut out, "a\"b\\c\n\u{1}é");
        assert_eq!(out, "\"a\\\"b\\\\c\\u000a\\u0001é\"");
    }

    /// `Retry-After` is bounded as the rate-limit fields' integers are (RFC 9651, section
    /// 3.3.1: at most 15 digits), so a store's wait of `Duration::MAX` never states a
    /// `Retry-After` later than the `Reset` sent beside it.
    #[test]
    fn retry_after_is_bounded_as_the_reset_fields_are() {
        let policies =
            PolicySet::from(Policy::token_bucket("api", 1, crate::Rate::per_second(1)).unwrap());
        let decision = Decision::new(
            crate::Outcome::Denied {
                policy: 0,
                retry_after: Duration::MAX,
            },
            Vec::new(),
        );
        let rejection = Rejection {
            policy: &policies[0],
            retry_after: Duration::MAX,
            decision: &decision,
            policies: &policies,
            cost: 1,
        };
        assert_eq!(rejection.retry_after_secs(), 999_999_999_999_999);
    }

    /// A request that costs nothing (a probe a route prices at 0) is admitted by a
    /// shaping bucket however full: it queues nothing. Blocked by another policy's
    /// penalty, its problem body listed the full shaping bucket among the
    /// `violated-policies` all the same (draft-ietf-httpapi-ratelimit-headers-11,
    /// "Problem Types": the policies the request exceeded).
    #[test]
    fn a_full_shaping_bucket_is_no_violated_policy_of_a_request_that_costs_nothing() {
        let second = Duration::from_secs(1);
        let penalty = crate::policy::Penalty::new(1, second, 60 * second);
        let policies = PolicySet::new([
            Policy::leaky_bucket_shaping("shape", crate::Rate::per_second(1), second).unwrap(),
            Policy::token_bucket("api", 2, crate::Rate::per_second(2))
                .unwrap()
                .with_penalty(penalty)
                .unwrap(),
        ])
        .unwrap();
        let full = PolicyStatus::new(2, 0, second, second);
        let blocked = PolicyStatus::new(2, 0, 60 * second, 60 * second);
        let decision = Decision::new(
            crate::Outcome::Denied {
                policy: 1,
                retry_after: 60 * second,
            },
            [full, blocked],
        );
        for (cost, violated) in [(0, vec!["api"]), (1, vec!["api", "shape"])] {
            let rejection = Rejection {
                policy: &policies[1],
                retry_after: 60 * second,
                decision: &decision,
                policies: &policies,
                cost,
            };
            assert_eq!(rejection.violated_policies(), violated, "cost {cost}");
        }
    }

    /// The body's numbers are ones every JSON reader takes exactly: RFC 8259, section 6,
    /// promises no more than the range of IEEE 754 doubles' integers (up to 2^53 − 1),
    /// and I-JSON (RFC 7493, section 2.2) allows no others. A cost of `u64::MAX` (a
    /// coster that saturated, a `Content-Length` past 2^53) was written whole, and read in
    /// JavaScript as 18446744073709552000.
    #[test]
    fn a_huge_cost_is_a_number_json_readers_take_exactly() {
        let policy = Policy::token_bucket("api", 10, crate::Rate::per_second(10)).unwrap();
        for cost in [u64::MAX, (1 << 53) + 1] {
            let response = cost_exceeds_limit(&policy, cost, 10);
            let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
            let written = body["cost"].as_u64().unwrap();
            assert!(written < 1 << 53, "{cost}: {written}");
            // Still more than the limit, which is what the member tells.
            assert!(written > body["limit"].as_u64().unwrap());
        }
    }

    #[test]
    fn key_errors_map_to_client_and_server_statuses() {
        assert_eq!(
            key_error(&KeyError::client("x")).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            key_error(&KeyError::server("x")).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
