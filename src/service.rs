//! [`RateLimit`]: the service that decides each request.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::bypass::{Bypass, BypassReason};
use crate::cost::Cost;
use crate::failure::{Admission, ProbeGuard, StandIn};
use crate::future::{Pending, ResponseFuture};
use crate::key::Key;
use crate::key::{KeyError, KeyErrorKind, KeyExtractor};
use crate::policy::PolicySet;
use crate::reservation::{Adjuster, Reservation};
use crate::resolve::PolicyResolver;
use crate::respond::grpc;
use crate::respond::headers::HeaderBlock;
use crate::respond::problem as response;
use crate::respond::{MissingKey, Plan, Responder, StoreAnswer};
use crate::store::{Adjustment, DecideFuture, Store, within};
use crate::telemetry::{self, Stopwatch};

/// Everything a service shares with its clones, behind one `Arc`: axum clones the
/// service for every request, and each reference counted there is a counter every worker
/// thread writes.
pub(crate) struct Config<St, K, C, R> {
    pub(crate) store: St,
    pub(crate) key: K,
    pub(crate) cost: C,
    pub(crate) resolver: R,
    pub(crate) missing_key: MissingKey,
    /// Set once this layer has said that it lets requests through without a key the
    /// server should have set (`MissingKey::Allow`): said once per layer (shared by the
    /// services of all its routes), read with one load per such request (no lock, no
    /// allocation).
    pub(crate) said_missing: Arc<AtomicBool>,
    pub(crate) bypass: Option<Bypass>,
    pub(crate) responder: Arc<Responder>,
    /// The cost reads a [`RequestCost`](crate::cost::RequestCost) set further out
    /// ([`Cost::reads_request_cost`]): each request it decides is marked, for a coster
    /// placed further in (whose cost is never read) to say so.
    pub(crate) marks_cost: bool,
}

impl<St, K, C, R> Adjuster for Config<St, K, C, R>
where
    St: Store,
    K: Send + Sync + 'static,
    C: Send + Sync + 'static,
    R: Send + Sync + 'static,
{
    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        self.store.adjust(key, policies, adjustment)
    }

    fn can_adjust(&self) -> bool {
        self.store.can_adjust()
    }

    fn responder(&self) -> &Arc<Responder> {
        &self.responder
    }
}

/// The rate-limiting service; built by [`RateLimitLayer`](crate::RateLimitLayer).
pub struct RateLimit<S, St, K, C, R> {
    inner: S,
    config: Arc<Config<St, K, C, R>>,
}

impl<S, St, K, C, R> RateLimit<S, St, K, C, R> {
    pub(crate) fn new(inner: S, config: Arc<Config<St, K, C, R>>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, St, K, C, R> Clone for RateLimit<S, St, K, C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
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
/// from the response future, once the store answers).
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// A clone of the inner service for a request held back by a shaping delay, made ready
/// when the delay ends. The instance `poll_ready` made ready is dropped now, with what
/// its readiness holds (a `ConcurrencyLimit`'s or a `Buffer`'s permit): held through
/// the delay, it kept every other request out of the inner service meanwhile, and a
/// connection that calls its service again only after this response would wait for it
/// for ever.
fn called_later<S: Clone>(inner: &mut S) -> S {
    let later = inner.clone();
    *inner = later.clone();
    later
}

impl<S, St, K, C, R, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St, K, C, R>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    St: Store,
    K: KeyExtractor,
    C: Cost,
    R: PolicyResolver,
    ResBody: ResponseBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The common request's path, in the order it flows. Every other turn (a bypass, a
        // missing key, an open breaker, a store doing I/O, a debit kept until the
        // response) is a call out of line, and the rare or transient ones (a shadow layer
        // is a roll-out) are marked `#[cold]` (not the store doing I/O: with Redis that
        // is the path), so that the compiler lays the in-process path out in one run: an
        // HTTP server's instruction cache is full of its own code, and a path that
        // touches fewer lines of ours costs it less.
        let config = &*self.config;
        let (mut parts, body) = request.into_parts();
        if config.marks_cost {
            crate::cost::handed(&parts);
        }
        // A network bypass that could read no address: said once the key is known, so
        // that a key that fails for the same want (the peer address) says it alone.
        let mut unread = None;
        if let Some(bypass) = &config.bypass {
            match bypass.before_key(&parts) {
                Ok(Some(reason)) => {
                    return bypassed(&mut self.inner, Request::from_parts(parts, body), reason);
                }
                Ok(None) => {}
                Err(error) => unread = Some(error),
            }
        }
        let key = match config.key.extract(&parts) {
            Ok(key) => key,
            Err(error) => {
                // The bypass's fault is the server's: said beside a key that failed for
                // another want (a client's missing header), not hidden behind it.
                if let (Some(unread), Some(bypass)) = (&unread, &config.bypass)
                    && *unread != error
                {
                    telemetry::bypass_without_address(unread, bypass.first_unread());
                }
                return self.without_key(Request::from_parts(parts, body), &error);
            }
        };
        if let (Some(error), Some(bypass)) = (unread, &config.bypass) {
            telemetry::bypass_without_address(&error, bypass.first_unread());
        }
        if config.bypass.is_some()
            && let Some(reason) = config.bypass.as_ref().and_then(|b| b.by_key(&key))
        {
            return bypassed(&mut self.inner, Request::from_parts(parts, body), reason);
        }
        let cost = config.cost.cost(&parts);
        let policies = config.resolver.resolve(&parts, &key);
        if policies.is_empty() {
            return ResponseFuture::calling(
                self.inner.call(Request::from_parts(parts, body)),
                HeaderBlock::default(),
            );
        }
        if config.marks_cost {
            parts.extensions.insert(crate::cost::CostRead);
        }
        let responder = &config.responder;
        // A shadow layer's denials count towards no block (see `without_penalties`).
        let policies = if responder.shadow && policies.has_penalties() {
            std::borrow::Cow::Owned(policies.without_penalties())
        } else {
            policies
        };
        // Slots the store could never free (a closure named an in-flight set the check at
        // build could not see): the failure mode decides, as for a set the store cannot.
        if policies.has_in_flight() && !config.store.can_adjust() {
            let request = Request::from_parts(parts, body);
            return self.not_asking_store(request, key, policies.into_owned(), cost, true);
        }
        let probe = match responder.breaker.admit() {
            Admission::Call => None,
            Admission::Probe(guard) => Some(guard),
            Admission::Skip => {
                let request = Request::from_parts(parts, body);
                let policies = policies.into_owned();
                return self.not_asking_store(request, key, policies, cost, false);
            }
        };
        let stopwatch = Stopwatch::start();
        let decided = config.store.decide(&key, &policies, cost);
        // The decision is read where the store left it: it is not moved on its way to
        // the response.
        let answer = match decided.result() {
            Some(Ok(decision)) => StoreAnswer::Decided(decision),
            Some(Err(error)) => StoreAnswer::Failed(error),
            None => {
                let request = Request::from_parts(parts, body);
                let policies = policies.into_owned();
                return self.waiting(decided, stopwatch, request, key, policies, cost, probe);
            }
        };
        stopwatch.stop(matches!(answer, StoreAnswer::Decided(decision) if decision.is_cached()));
        let plan = responder.plan(&policies, &key, cost, answer, probe.as_ref());
        drop(probe);
        match plan {
            // The debit is kept until the response: a reservation to settle, or slots.
            Plan::Call(_, Some(_)) | Plan::Delay(_, _, Some(_)) => {
                let request = Request::from_parts(parts, body);
                self.answer(request, plan, key, policies.into_owned(), cost)
            }
            plan => finish(&mut self.inner, Request::from_parts(parts, body), plan),
        }
    }
}

impl<S, St, K, C, R> RateLimit<S, St, K, C, R>
where
    St: Store,
    K: KeyExtractor,
    C: Cost,
    R: PolicyResolver,
{
    /// A request no key was extracted from: let through (a shadow layer, or
    /// `MissingKey::Allow` for a key that is absent) or answered with the key's error.
    #[cold]
    #[inline(never)]
    fn without_key<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        error: &KeyError,
    ) -> ResponseFuture<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        // `MissingKey::Allow` lets an absent key through on purpose (with an
        // `ExtensionKey`, every anonymous request): counted, and said once per layer when
        // the server should have set what is absent.
        if self.config.missing_key == MissingKey::Allow && error.is_missing() {
            let said = &self.config.said_missing;
            let say = error.kind() == KeyErrorKind::Server
                && !said.load(Ordering::Relaxed)
                && !said.swap(true, Ordering::Relaxed);
            telemetry::key_missing_allowed(error, say);
        } else {
            telemetry::key_rejected(error);
        }
        match self.config.missing_key {
            // A shadow layer never refuses a request.
            _ if self.config.responder.shadow => {
                ResponseFuture::calling(self.inner.call(request), HeaderBlock::default())
            }
            MissingKey::Allow if error.is_missing() => {
                ResponseFuture::calling(self.inner.call(request), HeaderBlock::default())
            }
            MissingKey::Allow | MissingKey::Reject => {
                let answer = Box::new(response::key_error(error));
                ResponseFuture::respond_boxed(grpc::fit(
                    request.method(),
                    request.headers(),
                    answer,
                ))
            }
        }
    }

    /// The store is not asked: the circuit breaker is open, or (`cannot_adjust`) an
    /// in-flight set meets a store that cannot adjust (a store error, `Unsupported`,
    /// logged at error level and counted). The failure mode answers.
    #[cold]
    #[inline(never)]
    fn not_asking_store<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        key: Key,
        policies: PolicySet,
        cost: u64,
        cannot_adjust: bool,
    ) -> ResponseFuture<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        ReqBody: Send + 'static,
    {
        let error;
        let answer = if cannot_adjust {
            error = crate::store::StoreError::new(
                crate::store::StoreErrorKind::Unsupported,
                "an in-flight limit frees its slots through the store's adjust, and this \
                 store cannot adjust (Store::can_adjust is false)",
            );
            StoreAnswer::Failed(&error)
        } else {
            StoreAnswer::Skipped
        };
        let plan = self
            .config
            .responder
            .plan(&policies, &key, cost, answer, None);
        self.answer(request, plan, key, policies, cost)
    }

    /// A store doing I/O: the decision comes in the response future, bounded by the
    /// layer's timeout. Out of line but not cold: with Redis it is every request's path.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn waiting<ReqBody, ResBody>(
        &mut self,
        decided: DecideFuture,
        stopwatch: Stopwatch,
        request: Request<ReqBody>,
        key: Key,
        policies: PolicySet,
        cost: u64,
        probe: Option<ProbeGuard>,
    ) -> ResponseFuture<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        ReqBody: Send + 'static,
    {
        let pending = decided.into_pending();
        let responder = &self.config.responder;
        let timeout = responder.timeout;
        // Should the probe's request be dropped before the answer, its key is peeked at
        // in its place (see `ProbeGuard`).
        let probe = probe.map(|probe| {
            let (config, key, policies) = (Arc::clone(&self.config), key.clone(), policies.clone());
            probe.with_stand_in(StandIn {
                peek: Box::new(move || config.store.peek(&key, &policies)),
                timeout,
            })
        });
        // The probe's guard says what its drop means.
        let waiting = probe.is_none().then(|| responder.breaker.waiting());
        let timed = Box::pin(async move {
            let result = within(timeout, "decision", pending).await;
            if let Some(waiting) = waiting {
                waiting.answered(&result);
            }
            stopwatch.stop(result.as_ref().is_ok_and(crate::Decision::is_cached));
            result
        });
        ResponseFuture::deciding(
            timed,
            Pending {
                inner: take_ready(&mut self.inner),
                request,
                policies,
                key,
                cost,
                responder: Arc::clone(responder),
                adjuster: Arc::clone(&self.config) as Arc<dyn Adjuster>,
                probe,
            },
        )
    }

    /// Answers as `plan` says, keeping the debit until the response when the plan carries
    /// it (to settle it, or to free in-flight slots), whoever decided: the store or the
    /// local fallback (the breaker open or the store failing).
    #[inline(never)]
    fn answer<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        plan: Plan,
        key: Key,
        policies: PolicySet,
        cost: u64,
    ) -> ResponseFuture<S::Future>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        ReqBody: Send + 'static,
    {
        let reservation = |debit: Box<crate::settle::Debit>| {
            let adjuster = Arc::clone(&self.config) as Arc<dyn Adjuster>;
            Reservation::new(adjuster, key, policies, cost, *debit)
        };
        match plan {
            Plan::Call(headers, Some(debit)) => {
                let reservation = reservation(debit);
                ResponseFuture::reserved(self.inner.call(request), headers, reservation)
            }
            Plan::Delay(delay, headers, Some(debit)) => {
                let reservation = reservation(debit);
                let inner = called_later(&mut self.inner);
                ResponseFuture::delaying(delay, inner, request, headers, Some(reservation))
            }
            plan => finish(&mut self.inner, request, plan),
        }
    }
}

/// Calls the inner service for a request that skips limiting: no headers.
#[cold]
#[inline(never)]
fn bypassed<S, ReqBody, ResBody>(
    inner: &mut S,
    request: Request<ReqBody>,
    reason: BypassReason,
) -> ResponseFuture<S::Future>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    telemetry::bypassed(reason);
    ResponseFuture::calling(inner.call(request), HeaderBlock::default())
}

/// Answers a request whose decision is known now. The in-process store answers at once:
/// no allocation, no clone of the inner service, which was made ready by poll_ready and is
/// called right here.
#[inline(always)]
fn finish<S, ReqBody, ResBody>(
    inner: &mut S,
    request: Request<ReqBody>,
    plan: Plan,
) -> ResponseFuture<S::Future>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
{
    match plan {
        Plan::Call(headers, _) => ResponseFuture::calling(inner.call(request), headers),
        Plan::Delay(delay, headers, _) => {
            ResponseFuture::delaying(delay, called_later(inner), request, headers, None)
        }
        Plan::Respond(response) => {
            ResponseFuture::respond_boxed(grpc::fit(request.method(), request.headers(), response))
        }
    }
}
