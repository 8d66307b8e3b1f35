//! [`ResponseFuture`]: calls the inner service and writes the headers on its response; the
//! rare paths (a store that does I/O, a shaping delay) run boxed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::{BodyGuard, ResponseBody};
use crate::failure::ProbeGuard;
use crate::key::Key;
use crate::policy::PolicySet;
use crate::reservation::{Adjuster, Reservation, Settled};
use crate::respond::headers::HeaderBlock;
use crate::respond::{Plan, Responder, StoreAnswer};
use crate::settle::ResponseHead;
use crate::store::BoxedDecision;

/// A request waiting for a decision from a store that does I/O.
pub(crate) struct Pending<S, B> {
    pub(crate) inner: S,
    pub(crate) request: Request<B>,
    pub(crate) policies: PolicySet,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    pub(crate) responder: Arc<Responder>,
    /// The layer's store, to settle or free the debit after the response.
    pub(crate) adjuster: Arc<dyn Adjuster>,
    /// The breaker's probe, when this request carries it: released when the request ends,
    /// however it ends (dropped mid-decision included).
    pub(crate) probe: Option<ProbeGuard>,
}

/// What a slow path ends in: the inner service's answer and the headers for it, or an
/// answer of ours.
enum Slow<O> {
    Inner(O, HeaderBlock, Option<Box<Reservation>>),
    Respond(Box<Response<Bytes>>),
}

type BoxedSlow<O> = Pin<Box<dyn Future<Output = Slow<O>> + Send>>;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit): `F` is the inner service's
    /// future.
    pub struct ResponseFuture<F: Future> {
        #[pin]
        state: State<F>,
    }
    impl<F: Future> PinnedDrop for ResponseFuture<F> {
        fn drop(this: Pin<&mut Self>) {
            // A settle on its way to the store (a refund, a charge) is finished even when
            // the client goes away first: dropped, it would never reach a store doing I/O.
            if let StateProj::Settling { settle, reservation, .. } =
                this.project().state.project()
            {
                // The reservation is taken when the settle finishes: a finished settle
                // must not be run again.
                if let Some(reservation) = reservation.as_ref() {
                    let settle = std::mem::replace(settle, Box::pin(std::future::pending()));
                    reservation.finish_in_task(
                        settle,
                        "settle",
                        "no async runtime to finish a settle whose request was dropped: its \
                         cost is not settled",
                    );
                }
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F: Future> {
        // The hot state: the inner service's future and the headers for its response.
        Calling { #[pin] future: F, headers: HeaderBlock },
        // The inner call of a request whose debit is kept until its response (to settle
        // it, or to free in-flight slots).
        Reserved { #[pin] future: F, headers: HeaderBlock, reservation: Option<Box<Reservation>> },
        // The response is there; a store doing I/O settles its debit.
        Settling {
            output: Option<F::Output>,
            settle: BoxedDecision,
            headers: HeaderBlock,
            reservation: Option<Box<Reservation>>,
        },
        // Rare or slow paths (a remote store's decision, a shaping delay), boxed so the
        // future every request carries stays small and names only `F`.
        Slow { future: BoxedSlow<F::Output> },
        Respond { response: Option<Box<Response<Bytes>>> },
    }
}

impl<F: Future> ResponseFuture<F> {
    pub(crate) fn calling(future: F, headers: HeaderBlock) -> Self {
        Self {
            state: State::Calling { future, headers },
        }
    }

    pub(crate) fn reserved(future: F, headers: HeaderBlock, reservation: Reservation) -> Self {
        Self {
            state: State::Reserved {
                future,
                headers,
                reservation: Some(Box::new(reservation)),
            },
        }
    }

    /// Decides through `decide`, then answers as the plan says.
    pub(crate) fn deciding<S, B>(decide: BoxedDecision, pending: Pending<S, B>) -> Self
    where
        S: Service<Request<B>, Future = F> + Clone + Send + 'static,
        F: Future<Output = Result<S::Response, S::Error>> + Send + 'static,
        B: Send + 'static,
    {
        let future = async move {
            let result = decide.await;
            let Pending {
                inner,
                request,
                policies,
                key,
                cost,
                responder,
                adjuster,
                probe,
            } = pending;
            let answer = match &result {
                Ok(decision) => StoreAnswer::Decided(decision),
                Err(error) => StoreAnswer::Failed(error),
            };
            let plan = responder.plan(&policies, &key, cost, answer, probe.as_ref());
            drop(probe);
            let (delay, headers, debit) = match plan {
                Plan::Call(headers, debit) => (Duration::ZERO, headers, debit),
                Plan::Delay(delay, headers, debit) => (delay, headers, debit),
                Plan::Respond(response) => {
                    return Slow::Respond(crate::respond::grpc::fit(
                        request.method(),
                        request.headers(),
                        response,
                    ));
                }
            };
            let reservation =
                debit.map(|debit| Reservation::new(adjuster, key, policies, cost, *debit));
            // The inner service was made ready before the decision (its capacity held
            // while the store answers, which the store timeout bounds).
            call(inner, true, request, delay, headers, reservation).await
        };
        Self {
            state: State::Slow {
                future: Box::pin(future),
            },
        }
    }

    /// Holds the request back `delay` (shaping), then calls `inner`.
    pub(crate) fn delaying<S, B>(
        delay: Duration,
        inner: S,
        request: Request<B>,
        headers: HeaderBlock,
        reservation: Option<Reservation>,
    ) -> Self
    where
        S: Service<Request<B>, Future = F> + Clone + Send + 'static,
        F: Future<Output = Result<S::Response, S::Error>> + Send + 'static,
        B: Send + 'static,
    {
        Self {
            state: State::Slow {
                future: Box::pin(call(inner, false, request, delay, headers, reservation)),
            },
        }
    }

    pub(crate) fn respond_boxed(response: Box<Response<Bytes>>) -> Self {
        Self {
            state: State::Respond {
                response: Some(response),
            },
        }
    }
}

/// Waits `delay` from now (the moment of the decision, not the first poll), then calls
/// the inner service: `ready` when `poll_ready` made it so, else made ready first.
/// Nothing of its capacity is held through a delay: a ready instance is dropped for an
/// unready clone while the request waits. (An inner service that fails to become ready
/// fails the request, with its debit kept as an inner error keeps it.)
fn call<S, B, F>(
    mut inner: S,
    mut ready: bool,
    request: Request<B>,
    delay: Duration,
    headers: HeaderBlock,
    reservation: Option<Reservation>,
) -> impl Future<Output = Slow<F::Output>>
where
    S: Service<Request<B>, Future = F> + Clone,
    F: Future<Output = Result<S::Response, S::Error>>,
{
    let decided = tokio::time::Instant::now();
    let deadline = decided + delay;
    // Dropped before the delay ends (its client gave up), even before its first poll,
    // the request gives its place in the schedule back.
    let held = Held {
        reservation,
        decided: (!delay.is_zero()).then_some(decided),
    };
    async move {
        if !delay.is_zero() {
            if ready {
                inner = inner.clone();
                ready = false;
            }
            tokio::time::sleep_until(deadline).await;
        }
        // Still not sent while the inner service gets ready: dropped then (its client
        // gone), it gives its place back as during the delay, and is not charged as a
        // request dropped while it ran.
        // (An inner service that failed to get ready fails the request: an inner error,
        // whose reservation stands.)
        if !ready && let Err(error) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await {
            return Slow::Inner(Err(error), headers, held.sent().map(Box::new));
        }
        let reservation = held.sent().map(Box::new);
        Slow::Inner(inner.call(request).await, headers, reservation)
    }
}

/// A request's debit until it is sent: dropped during its shaping delay (decided at
/// `decided`), the request was never sent, and its place is given back
/// (`Reservation::unbook`).
struct Held {
    reservation: Option<Reservation>,
    decided: Option<tokio::time::Instant>,
}

impl Held {
    /// The delay is over: the request is sent, its debit kept as any other.
    fn sent(mut self) -> Option<Reservation> {
        self.reservation.take()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let (Some(reservation), Some(decided)) = (self.reservation.take(), self.decided) {
            reservation.unbook(decided);
        }
    }
}

impl<F: Future> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

const POLLED_AFTER_READY: &str = "ResponseFuture polled after it completed";

impl<F, ResBody, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: ResponseBody,
{
    type Output = Result<Response<ResBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            // A response whose debit is kept until now: settled here (perhaps in a store doing
            // I/O: the Settling state), then sent with its reservation in the body.
            let (output, headers, reservation) = match state.as_mut().project() {
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    std::mem::take(headers)
                        .apply_to_inner(response.status(), response.headers_mut());
                    return Poll::Ready(Ok(response));
                }
                StateProj::Reserved {
                    future,
                    headers,
                    reservation,
                } => {
                    let output = ready!(future.poll(cx));
                    (output, std::mem::take(headers), reservation.take())
                }
                StateProj::Slow { future } => match ready!(future.as_mut().poll(cx)) {
                    Slow::Inner(output, headers, reservation) => (output, headers, reservation),
                    Slow::Respond(response) => {
                        return Poll::Ready(Ok(response.map(ResBody::from_bytes)));
                    }
                },
                StateProj::Settling {
                    output,
                    settle,
                    headers,
                    reservation,
                } => {
                    let result = ready!(settle.as_mut().poll(cx));
                    let reservation = reservation.take().expect(POLLED_AFTER_READY);
                    let headers = reservation
                        .headers(result)
                        .unwrap_or_else(|| std::mem::take(headers));
                    let response = output.take().expect(POLLED_AFTER_READY)?;
                    return Poll::Ready(Ok(send(response, headers, reservation)));
                }
                StateProj::Respond { response } => {
                    let response = *response.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Ok(response.map(ResBody::from_bytes)));
                }
            };
            // An inner error drops the reservation: its slots are freed, its charge stands
            // (not `Settle::if_dropped`'s: a load shedder inside the limiter fails requests
            // it never ran).
            let response = match output {
                Ok(response) => response,
                Err(error) => {
                    if let Some(mut reservation) = reservation {
                        reservation.keep_reservation();
                    }
                    return Poll::Ready(Err(error));
                }
            };
            let Some(mut reservation) = reservation else {
                let mut response = response;
                headers.apply_to_inner(response.status(), response.headers_mut());
                return Poll::Ready(Ok(response));
            };
            let head =
                ResponseHead::new(response.status(), response.headers(), response.extensions());
            match reservation.settle(&head) {
                Settled::Unchanged => return Poll::Ready(Ok(send(response, headers, reservation))),
                Settled::Headers(settled) => {
                    return Poll::Ready(Ok(send(response, settled, reservation)));
                }
                // A store doing I/O settles: its future is polled at once, in the new state.
                Settled::Pending(settle) => state.set(State::Settling {
                    output: Some(Ok(response)),
                    settle,
                    headers,
                    reservation: Some(reservation),
                }),
            }
        }
    }
}

/// The response with its headers, its body keeping the reservation when it holds
/// in-flight slots (freed when the body ends or is dropped).
fn send<B: ResponseBody>(
    mut response: Response<B>,
    headers: HeaderBlock,
    reservation: Box<Reservation>,
) -> Response<B> {
    headers.apply_to_inner(response.status(), response.headers_mut());
    if reservation.holds_slots() {
        response.map(|body| body.keep_until_end(BodyGuard::new(reservation)))
    } else {
        response
    }
}
