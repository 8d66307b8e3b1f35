//! What the layer answers, once a request's decision is known (or its store failed):
//! the failure mode, then the response — the inner service's with rate-limit headers, or
//! one of ours (`429`, `400`, `500`, `503` as problem+json). The last stage of a
//! request's path: key, cost, policies, store, failure mode, response.
//!
//! Rooms: `headers.rs` writes the rate-limit fields, `problem.rs` the problem+json bodies.

pub(crate) mod grpc;
pub(crate) mod headers;
pub(crate) mod problem;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::Entry;
use http::{HeaderValue, Response, header};

use crate::decision::{Decision, Outcome};
use crate::failure::{Breaker, FailureMode, ProbeGuard};
use crate::key::Key;
use crate::policy::PolicySet;
use crate::settle::{Debit, Settle};
use crate::store::{Adjustment, StoreError, StoreErrorKind, check_answer};
use crate::telemetry;
use headers::{
    HeaderBlock, HeaderOptions, effective_secs, jitter_secs, jittered, rate_limit_headers,
};
use problem::{self as response, Rejection};

/// What to do with a request no key can be extracted from.
///
/// Keyed by an API key, a request without one is answered `400` by default; with
/// `Allow` it goes through, unlimited and without rate-limit fields, while requests
/// with a key are limited as before:
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::{MemoryStore, MissingKey, Policy, Rate, RateLimitLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let policy = Policy::token_bucket("api", 1, Rate::per_hour(1))?;
/// let service = |missing: MissingKey| {
///     RateLimitLayer::new(MemoryStore::new())
///         .policy(policy.clone())
///         .key(HeaderKey::new("x-api-key"))
///         .on_missing_key(missing)
///         .layer(service_fn(|_: Request<()>| async {
///             Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
///         }))
/// };
/// let anonymous = || Request::get("/").body(()).unwrap();
/// let with_key = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
///
/// let rejected = service(MissingKey::Reject).oneshot(anonymous()).await?;
/// assert_eq!(rejected.status(), StatusCode::BAD_REQUEST);
///
/// let allowed = service(MissingKey::Allow);
/// for _ in 0..3 {
///     let response = allowed.clone().oneshot(anonymous()).await?;
///     assert_eq!(response.status(), StatusCode::OK);
///     assert!(!response.headers().contains_key("ratelimit"));
/// }
/// assert_eq!(allowed.clone().oneshot(with_key()).await?.status(), StatusCode::OK);
/// let limited = allowed.clone().oneshot(with_key()).await?;
/// assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer it: `400` when the client left something out, `500` when the server is set
    /// up wrong (the default: a missing key is never a silent bypass).
    #[default]
    Reject,
    /// Let a request whose key is absent ([`KeyError::is_missing`](crate::key::KeyError::is_missing))
    /// through unlimited and without rate-limit headers. Only for extractors whose miss is
    /// expected and harmless. A key that is present but invalid is still answered `400`,
    /// and a server set up wrong `500`. Each request let through is counted
    /// (`tollgate_key_missing_allowed_total`); when what is absent is the server's to set
    /// (an [`ExtensionKey`](crate::key::ExtensionKey)'s extension, whose middleware may run
    /// after the limiter), a warning says so, once per layer.
    Allow,
}

/// A custom answer to a denied request (see `RateLimitLayer::on_deny`).
pub(crate) type DenyHook = Arc<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// What turns a decision into a response; shared with futures that decide later.
pub(crate) struct Responder {
    pub(crate) headers: HeaderOptions,
    /// How admitted requests' costs are settled once their response is known.
    pub(crate) settle: Option<Settle>,
    /// A shadow layer: decides and debits, never denies, writes no headers unless
    /// `headers.shadow` asks for them.
    pub(crate) shadow: bool,
    pub(crate) on_deny: Option<DenyHook>,
    pub(crate) failure_mode: FailureMode,
    pub(crate) breaker: Arc<Breaker>,
    pub(crate) timeout: Duration,
    /// Bookings of requests dropped during their shaping delay (the layer's).
    pub(crate) dropped: Arc<crate::settle::DroppedBookings>,
}

/// What the store said, or that it was not asked (the circuit breaker is open). Borrowed:
/// the decision stays where the store wrote it.
pub(crate) enum StoreAnswer<'a> {
    Decided(&'a Decision),
    Failed(&'a StoreError),
    Skipped,
}

/// What to do with a request once its decision is known. The request itself stays where
/// it is: moving it through here cost a measurable share of the layer's overhead.
pub(crate) enum Plan {
    /// Call the inner service, then add the headers. The debit comes along when it must
    /// be kept until the response (to settle it, or to free in-flight slots).
    Call(HeaderBlock, Option<Box<Debit>>),
    /// Hold the request back (shaping), then call.
    Delay(Duration, HeaderBlock, Option<Box<Debit>>),
    /// Answer without calling the inner service.
    Respond(Box<Response<Bytes>>),
}

impl Responder {
    pub(crate) fn plan(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
        answer: StoreAnswer<'_>,
        probe: Option<&ProbeGuard>,
    ) -> Plan {
        let StoreAnswer::Decided(decision) = answer else {
            return self.plan_without_store(policies, key, cost, answer, probe);
        };
        if let Err(error) = check_answer(decision, policies.len()) {
            return self.plan_without_store(
                policies,
                key,
                cost,
                StoreAnswer::Failed(&error),
                probe,
            );
        }
        // An answer a store gave from a local cache says nothing of the store behind it:
        // it neither closes the breaker nor counts as a probe's success (the probe is
        // released when its guard drops).
        if !decision.is_cached() {
            self.breaker.on_success();
        }
        // Either way the probe's request has its outcome: releasing it starts no new
        // cool-down.
        if let Some(probe) = probe {
            probe.report();
        }
        self.plan_decided(policies, key, cost, decision, false)
    }

    /// The store failed, or was not asked (the breaker is open): the failure mode
    /// decides, or answers without a decision.
    #[cold]
    #[inline(never)]
    fn plan_without_store(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
        answer: StoreAnswer<'_>,
        probe: Option<&ProbeGuard>,
    ) -> Plan {
        if let StoreAnswer::Failed(error) = answer {
            telemetry::store_error(error);
            // Towards the breaker as an outage, or (a refusal) not: see `heard_failure`.
            self.breaker.heard_failure(error, probe);
        } else {
            telemetry::store_skipped();
        }
        // A store that cannot decide these policies is a set-up error, not an outage.
        let undecidable = matches!(
            answer,
            StoreAnswer::Failed(error) if error.kind() == StoreErrorKind::Unsupported
        );
        match self.on_failure(policies, key, cost, undecidable) {
            // The headers describe the policies that decided (scaled or not).
            Ok((decision, applied)) => {
                telemetry::fallback_decision(&decision, self.shadow);
                self.plan_decided(&applied, key, cost, &decision, true)
            }
            Err(plan) => plan,
        }
    }

    /// The plan for `decision` (the store's, or the fallback's when `from_fallback`).
    #[inline]
    fn plan_decided(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
        decision: &Decision,
        from_fallback: bool,
    ) -> Plan {
        let extra = jitter_secs(self.headers.jitter);
        // The debit, kept until the response when it must be settled or holds slots.
        let debit = || {
            (self.settle.is_some() || policies.has_in_flight())
                .then(|| debit_of(decision, policies, from_fallback))
        };
        if self.shadow {
            return self.plan_shadow(policies, key, decision, extra, debit);
        }
        telemetry::decision(policies, decision, key);
        let headers = rate_limit_headers(&self.headers, policies, decision, key, extra);
        match decision.outcome() {
            Outcome::Allowed { delay } if delay.is_zero() => Plan::Call(headers, debit()),
            // Kept through the delay whatever the layer settles: a request dropped
            // before it is sent gives its place back (see `Reservation::unbook`).
            Outcome::Allowed { delay } => {
                let mut held = debit_of(decision, policies, from_fallback);
                held.ends = Adjustment::queue_ends_after(decision).collect();
                Plan::Delay(delay, headers, Some(held))
            }
            Outcome::Denied {
                policy,
                retry_after,
            } => self.deny(
                policies,
                policy,
                retry_after,
                cost,
                decision,
                headers,
                extra,
            ),
            Outcome::CostExceedsLimit {
                policy,
                cost,
                limit,
            } => {
                let mut response = response::cost_exceeds_limit(&policies[policy], cost, limit);
                headers.apply(response.headers_mut());
                Plan::Respond(Box::new(response))
            }
        }
    }

    /// A shadow layer's plan: never denies; what it would have done is reported, nothing
    /// else. Cold: a shadow layer is a roll-out, not the path a layer is laid out for.
    #[cold]
    #[inline(never)]
    fn plan_shadow(
        &self,
        policies: &PolicySet,
        key: &Key,
        decision: &Decision,
        extra: u64,
        debit: impl FnOnce() -> Option<Box<Debit>>,
    ) -> Plan {
        if decision.is_allowed() {
            telemetry::decision(policies, decision, key);
        } else {
            telemetry::shadow_layer_denied(policies, decision, key);
        }
        let headers = if self.headers.shadow {
            rate_limit_headers(&self.headers, policies, decision, key, extra).enforcing_nothing()
        } else {
            HeaderBlock::default()
        };
        // A shadow layer's denial debited nothing: there is nothing to keep.
        Plan::Call(headers, decision.is_allowed().then(debit).flatten())
    }

    /// The answer to a denied request: `429` (or the `on_deny` hook's) with the
    /// rate-limit fields and `Retry-After`. Cold: laid out away from the admitted path.
    /// Under a flood most requests come here, and it still costs far less than the
    /// inner service the denial spares.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn deny(
        &self,
        policies: &PolicySet,
        policy: usize,
        retry_after: Duration,
        cost: u64,
        decision: &Decision,
        mut headers: HeaderBlock,
        extra: u64,
    ) -> Plan {
        // Answered without the state (a deny cache's): a denial of one unit leaves none,
        // and so does a block of the denying policy; otherwise some may be left.
        if decision.statuses().is_empty()
            && cost > 1
            && !(decision.is_blocked() && headers::blocks_alone(policies, policy))
        {
            headers = headers.without_single();
        }
        // Never earlier than the end of the effective window the `RateLimit` field states
        // (same rounding, same jitter) for the policy named, or for any other that would
        // deny this request too (one with a later `t` than the named one's wait).
        let denying = &policies[policy];
        let stated = policies
            .iter()
            .zip(decision.statuses())
            .enumerate()
            .filter(|&(index, (other, status))| {
                index == policy || response::exceeds(other, status, cost)
            })
            .map(|(_, (other, status))| effective_secs(other, status.effective_window, extra))
            .max()
            .unwrap_or(0);
        let rejection = Rejection {
            policy: denying,
            retry_after: jittered(denying, retry_after, extra).max(Duration::from_secs(stated)),
            decision,
            policies,
            cost,
        };
        let mut response = match &self.on_deny {
            Some(hook) => hook(&rejection),
            None => response::too_many_requests(&rejection),
        };
        // A hook's answer that is no 429 or 503 (a 403 for banned clients, a 200 with a
        // notice) gets no `Retry-After` of ours: it means "come back after" on those
        // (RFC 6585 section 4, RFC 9110 section 10.2.3). The fields go as they are.
        // A `Retry-After` the hook wrote on such an answer is its own, as it wrote it.
        // A gRPC answer of RESOURCE_EXHAUSTED or UNAVAILABLE (tonic's `Status` into
        // HTTP: a 200 with `grpc-status`) says "come back after" as a 429 does, and gets
        // the wait (sent on as the gRPC pushback).
        let status = response.status();
        if status != http::StatusCode::TOO_MANY_REQUESTS
            && status != http::StatusCode::SERVICE_UNAVAILABLE
            && !grpc::asks_to_wait(response.headers())
        {
            if status.is_success() {
                // A notice to a gRPC call goes out as RESOURCE_EXHAUSTED, which the
                // layer chose: it says when, as for its own denials.
                grpc::notice_waits(&mut response, rejection.retry_after_secs());
            }
            headers.apply(response.headers_mut());
            return Plan::Respond(Box::new(response));
        }
        // The reset goes with the `Retry-After` sent (see `reset_beside`): ours, or the
        // hook's own when it wrote a wait (seconds or a date). One that states no wait
        // (`soon`, `1.5`, `+5`) is replaced by ours: clients would find none in it.
        let ours = rejection.retry_after_secs();
        let retry_after_sent = match response.headers_mut().entry(header::RETRY_AFTER) {
            Entry::Occupied(mut hooks) => {
                // One line stays, as a singleton field's must (lines past the first
                // would join into `5, soon`): the hook's first, or ours in its place.
                let (line, seconds) = match headers::retry_after_secs(hooks.get()) {
                    Some(seconds) => (hooks.get().clone(), seconds),
                    None => (HeaderValue::from(ours), ours),
                };
                hooks.insert(line);
                seconds
            }
            Entry::Vacant(vacant) => {
                vacant.insert(HeaderValue::from(ours));
                ours
            }
        };
        headers.reset_beside(retry_after_sent);
        headers.apply(response.headers_mut());
        Plan::Respond(Box::new(response))
    }
}

/// The debit of an admitted request, kept until its response.
#[inline(never)]
fn debit_of(decision: &Decision, policies: &PolicySet, from_fallback: bool) -> Box<Debit> {
    Box::new(Debit {
        receipt: decision.receipt(),
        fallback: from_fallback.then(|| policies.clone()),
        left: decision.debit_left(),
        ends: smallvec::SmallVec::new(),
    })
}

impl Responder {
    /// The failure mode: a local decision, or a plan without one. `undecidable`: the
    /// store cannot decide these policies (a set-up error, no outage).
    fn on_failure(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
        undecidable: bool,
    ) -> Result<(Decision, PolicySet), Plan> {
        match &self.failure_mode {
            FailureMode::Fallback(fallback) => match fallback.decide(key, policies, cost) {
                Some(decided) => Ok(decided),
                // Only the fallback's share of the quota refuses the cost: the outage
                // stands in its way (a `400` would say "never send it again").
                None if self.shadow => Err(Plan::Call(HeaderBlock::default(), None)),
                None => Err(Plan::Respond(Box::new(self.store_unavailable(undecidable)))),
            },
            FailureMode::FailOpen => Err(Plan::Call(HeaderBlock::default(), None)),
            // A shadow layer never refuses a request.
            FailureMode::FailClosed if self.shadow => Err(Plan::Call(HeaderBlock::default(), None)),
            FailureMode::FailClosed => {
                Err(Plan::Respond(Box::new(self.store_unavailable(undecidable))))
            }
        }
    }

    /// The 503 of a store that cannot decide, saying when it is asked again: what is
    /// left of the breaker's cool-down (rounded up), or a second when the breaker is
    /// closed (the next request asks the store). For a store that cannot decide the
    /// policies at all (`undecidable`), a 500 with no wait: asked again, it refuses again.
    fn store_unavailable(&self, undecidable: bool) -> http::Response<bytes::Bytes> {
        if undecidable {
            return response::policies_undecidable();
        }
        let seconds = headers::seconds_ceil(self.breaker.cool_down_left());
        response::store_unavailable(seconds.clamp(1, headers::MAX_SF_INTEGER))
    }
}
