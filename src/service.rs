//! [`RateLimit`]: the service that decides each request.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body::Body;
use tower_service::Service;

use crate::body::RateLimitBody;
use crate::cost::Cost;
use crate::decision::{Decision, Outcome};
use crate::failure::{Admission, Breaker, FailureMode, ProbeGuard};
use crate::future::{Pending, ResponseFuture};
use crate::headers::{HeaderBlock, HeaderOptions, effective_secs, jitter_secs, rate_limit_headers};
use crate::key::Key;
use crate::key::KeyExtractor;
use crate::layer::{DenyHook, MissingKey};
use crate::policy::PolicySet;
use crate::resolve::PolicyResolver;
use crate::response::{self, Rejection};
use crate::store::{Store, StoreError, StoreErrorKind};
use crate::telemetry::{self, Stopwatch};

pub(crate) struct Config<K, C, R> {
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) resolver: R,
    pub(crate) missing_key: MissingKey,
    pub(crate) responder: Arc<Responder>,
}

/// What turns a decision into a response; shared with futures that decide later.
pub(crate) struct Responder {
    pub(crate) headers: HeaderOptions,
    pub(crate) on_deny: Option<DenyHook>,
    pub(crate) failure_mode: FailureMode,
    pub(crate) breaker: Arc<Breaker>,
    pub(crate) timeout: Duration,
}

/// What the store said, or that it was not asked (the circuit breaker is open).
pub(crate) enum StoreAnswer {
    Decided(Decision),
    Failed(StoreError),
    Skipped,
}

/// What to do with a request once its decision is known. The request itself stays where
/// it is: moving it through here cost a measurable share of the layer's overhead.
pub(crate) enum Plan {
    /// Call the inner service, then add the headers.
    Call(HeaderBlock),
    /// Hold the request back (shaping), then call.
    Delay(Duration, HeaderBlock),
    /// Answer without calling the inner service.
    Respond(Box<Response<Bytes>>),
}

impl Responder {
    pub(crate) fn plan(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
        answer: StoreAnswer,
        probe: Option<&ProbeGuard>,
    ) -> Plan {
        let fallback;
        let (decision, policies) = match answer {
            StoreAnswer::Decided(decision) => {
                // An answer a store gave from a local cache says nothing of the store
                // behind it: it neither closes the breaker nor counts as a probe's success
                // (the probe is released when its guard drops).
                if !decision.is_cached() {
                    self.breaker.on_success();
                }
                // Either way the probe's request has its outcome: releasing it starts no
                // new cool-down.
                if let Some(probe) = probe {
                    probe.report();
                }
                (decision, policies)
            }
            StoreAnswer::Failed(_) | StoreAnswer::Skipped => {
                if let StoreAnswer::Failed(error) = &answer {
                    telemetry::store_error(error);
                    if error.kind().is_io() {
                        self.breaker.on_failure(error, probe);
                    } else {
                        // The store answered, with a refusal that only this request's
                        // policies or data may cause: the failure mode answers this
                        // request, but it does not open the breaker for everyone.
                        self.breaker.on_success();
                        if let Some(probe) = probe {
                            probe.report();
                        }
                    }
                } else {
                    telemetry::store_skipped();
                }
                match self.on_failure(policies, key, cost) {
                    // The headers describe the policies that decided (scaled or not).
                    Ok((decision, applied)) => {
                        fallback = applied;
                        (decision, &fallback)
                    }
                    Err(plan) => return plan,
                }
            }
        };
        telemetry::decision(policies, &decision, key);
        let extra = jitter_secs(self.headers.jitter);
        let headers = rate_limit_headers(&self.headers, policies, &decision, key, extra);
        match decision.outcome() {
            Outcome::Allowed { delay } if delay.is_zero() => Plan::Call(headers),
            Outcome::Allowed { delay } => Plan::Delay(delay, headers),
            Outcome::Denied {
                policy,
                retry_after,
            } => {
                // Never earlier than the end of the denying policy's effective window as
                // the `RateLimit` field states it (same rounding, same jitter).
                let stated = decision
                    .statuses()
                    .get(policy)
                    .map_or(0, |status| effective_secs(status.effective_window, extra));
                let jittered = if retry_after >= crate::headers::JITTER_FROM {
                    retry_after.saturating_add(Duration::from_secs(extra))
                } else {
                    retry_after
                };
                let rejection = Rejection {
                    policy: &policies[policy],
                    retry_after: jittered.max(Duration::from_secs(stated)),
                    decision: &decision,
                    policies,
                    cost,
                };
                let mut response = match &self.on_deny {
                    Some(hook) => hook(&rejection),
                    None => response::too_many_requests(&rejection),
                };
                response
                    .headers_mut()
                    .entry(header::RETRY_AFTER)
                    .or_insert_with(|| HeaderValue::from(rejection.retry_after_secs()));
                headers.apply(response.headers_mut());
                Plan::Respond(Box::new(response))
            }
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
}

impl Responder {
    /// The failure mode: a local decision, or a plan without one.
    fn on_failure(
        &self,
        policies: &PolicySet,
        key: &Key,
        cost: u64,
    ) -> Result<(Decision, PolicySet), Plan> {
        match &self.failure_mode {
            FailureMode::Fallback(fallback) => Ok(fallback.decide(key, policies, cost)),
            FailureMode::FailOpen => Err(Plan::Call(HeaderBlock::default())),
            FailureMode::FailClosed => Err(Plan::Respond(Box::new(response::store_unavailable()))),
        }
    }
}

/// The rate-limiting service; built by [`RateLimitLayer`](crate::RateLimitLayer).
pub struct RateLimit<S, St, K, C, R> {
    inner: S,
    store: St,
    config: Arc<Config<K, C, R>>,
}

impl<S, St, K, C, R> RateLimit<S, St, K, C, R> {
    pub(crate) fn new(inner: S, store: St, config: Arc<Config<K, C, R>>) -> Self {
        Self {
            inner,
            store,
            config,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, St: Clone, K, C, R> Clone for RateLimit<S, St, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug, St, K, C, R> fmt::Debug for RateLimit<S, St, K, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The ready inner service, leaving a clone in its place (the service is called later,
/// from the response future).
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

impl<S, St, K, C, R, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St, K, C, R>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    St: Store,
    K: KeyExtractor,
    C: Cost,
    R: PolicyResolver,
    ResBody: Body,
    ResBody::Data: From<Bytes>,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &*self.config;
        let (parts, body) = request.into_parts();
        let key = match config.key.extract(&parts) {
            Ok(key) => key,
            Err(error) => {
                return match config.missing_key {
                    MissingKey::Allow if error.is_missing() => ResponseFuture::calling(
                        self.inner.call(Request::from_parts(parts, body)),
                        HeaderBlock::default(),
                    ),
                    MissingKey::Allow | MissingKey::Reject => {
                        ResponseFuture::respond(response::key_error(&error))
                    }
                };
            }
        };
        let policies = config.resolver.resolve(&parts, &key);
        if policies.is_empty() {
            return ResponseFuture::calling(
                self.inner.call(Request::from_parts(parts, body)),
                HeaderBlock::default(),
            );
        }
        let cost = config.cost.cost(&parts);
        let request = Request::from_parts(parts, body);
        let responder = &config.responder;
        let (probe, skipped) = match responder.breaker.admit() {
            Admission::Call => (None, false),
            Admission::Probe(guard) => (Some(guard), false),
            Admission::Skip => (None, true),
        };
        let answer = if skipped {
            StoreAnswer::Skipped
        } else {
            let stopwatch = Stopwatch::start();
            match self.store.decide(&key, &policies, cost).into_ready() {
                Ok(result) => {
                    stopwatch.stop();
                    match result {
                        Ok(decision) => StoreAnswer::Decided(decision),
                        Err(error) => StoreAnswer::Failed(error),
                    }
                }
                Err(pending) => {
                    // A store doing I/O: bounded by the timeout, decided in the future.
                    let timeout = responder.timeout;
                    let timed = Box::pin(async move {
                        let result = match tokio::time::timeout(timeout, pending).await {
                            Ok(result) => result,
                            Err(_) => Err(StoreError::new(
                                StoreErrorKind::Timeout,
                                format!("no decision within {timeout:?}"),
                            )),
                        };
                        stopwatch.stop();
                        result
                    });
                    return ResponseFuture::deciding(
                        timed,
                        Pending {
                            inner: take_ready(&mut self.inner),
                            request,
                            policies: policies.into_owned(),
                            key,
                            cost,
                            responder: Arc::clone(responder),
                            probe,
                        },
                    );
                }
            }
        };
        let plan = responder.plan(&policies, &key, cost, answer, probe.as_ref());
        drop(probe);
        finish(&mut self.inner, request, plan)
    }
}

/// Answers a request whose decision is known now. The in-process store answers at once:
/// no allocation, no clone of the inner service, which was made ready by poll_ready and is
/// called right here.
fn finish<S, ReqBody, ResBody>(
    inner: &mut S,
    request: Request<ReqBody>,
    plan: Plan,
) -> ResponseFuture<S::Future, S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    match plan {
        Plan::Call(headers) => ResponseFuture::calling(inner.call(request), headers),
        Plan::Delay(delay, headers) => {
            ResponseFuture::delaying(delay, take_ready(inner), request, headers)
        }
        Plan::Respond(response) => ResponseFuture::respond_boxed(response),
    }
}
