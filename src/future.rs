//! [`ResponseFuture`]: decides (when the store is remote), waits (when shaping), calls the
//! inner service and writes the headers on its response.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::RateLimitBody;
use crate::failure::ProbeGuard;
use crate::key::Key;
use crate::policy::PolicySet;
use crate::respond::headers::HeaderBlock;
use crate::respond::{Plan, Responder, StoreAnswer};
use crate::store::BoxedDecision;

/// A request waiting for a decision from a store that does I/O.
pub(crate) struct Pending<S, B> {
    pub(crate) inner: S,
    pub(crate) request: Request<B>,
    pub(crate) policies: PolicySet,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    pub(crate) responder: Arc<Responder>,
    /// The breaker's probe, when this request carries it: released when the request ends,
    /// however it ends (dropped mid-decision included).
    pub(crate) probe: Option<ProbeGuard>,
}

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<F, S, B> {
        #[pin]
        state: State<F, S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, S, B> {
        // The hot state: the inner service's future and the headers for its response.
        Calling { #[pin] future: F, headers: HeaderBlock },
        // Rare or slow states are boxed, so the future every request carries stays small.
        Deciding { decide: BoxedDecision, pending: Option<Box<Pending<S, B>>> },
        Delaying { sleep: Pin<Box<Sleep>>, call: Option<Box<(S, Request<B>)>>, headers: HeaderBlock },
        Respond { response: Option<Box<Response<Bytes>>> },
    }
}

impl<F, S, B> ResponseFuture<F, S, B> {
    pub(crate) fn calling(future: F, headers: HeaderBlock) -> Self {
        Self {
            state: State::Calling { future, headers },
        }
    }

    pub(crate) fn deciding(decide: BoxedDecision, pending: Pending<S, B>) -> Self {
        Self {
            state: State::Deciding {
                decide,
                pending: Some(Box::new(pending)),
            },
        }
    }

    pub(crate) fn delaying(
        delay: Duration,
        inner: S,
        request: Request<B>,
        headers: HeaderBlock,
    ) -> Self {
        Self {
            state: State::Delaying {
                sleep: Box::pin(tokio::time::sleep(delay)),
                call: Some(Box::new((inner, request))),
                headers,
            },
        }
    }

    pub(crate) fn respond(response: Response<Bytes>) -> Self {
        Self::respond_boxed(Box::new(response))
    }

    pub(crate) fn respond_boxed(response: Box<Response<Bytes>>) -> Self {
        Self {
            state: State::Respond {
                response: Some(response),
            },
        }
    }
}

impl<F, S, B> std::fmt::Debug for ResponseFuture<F, S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

const POLLED_AFTER_READY: &str = "ResponseFuture polled after it completed";

impl<F, S, B, ResBody, E> Future for ResponseFuture<F, S, B>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    S: Service<Request<B>, Response = Response<ResBody>, Error = E, Future = F>,
    ResBody: Body,
    ResBody::Data: From<Bytes>,
{
    type Output = Result<Response<RateLimitBody<ResBody>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().state.project() {
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    std::mem::take(headers).apply(response.headers_mut());
                    return Poll::Ready(Ok(response.map(RateLimitBody::inner)));
                }
                StateProj::Respond { response } => {
                    let response = *response.take().expect(POLLED_AFTER_READY);
                    return Poll::Ready(Ok(response.map(RateLimitBody::full)));
                }
                StateProj::Deciding { decide, pending } => {
                    let result = ready!(decide.as_mut().poll(cx));
                    let Pending {
                        mut inner,
                        request,
                        policies,
                        key,
                        cost,
                        responder,
                        probe,
                    } = *pending.take().expect(POLLED_AFTER_READY);
                    let answer = match result {
                        Ok(decision) => StoreAnswer::Decided(decision),
                        Err(error) => StoreAnswer::Failed(error),
                    };
                    let plan = responder.plan(&policies, &key, cost, answer, probe.as_ref());
                    drop(probe);
                    match plan {
                        Plan::Call(headers) => State::Calling {
                            future: inner.call(request),
                            headers,
                        },
                        Plan::Delay(delay, headers) => State::Delaying {
                            sleep: Box::pin(tokio::time::sleep(delay)),
                            call: Some(Box::new((inner, request))),
                            headers,
                        },
                        Plan::Respond(response) => State::Respond {
                            response: Some(response),
                        },
                    }
                }
                StateProj::Delaying {
                    sleep,
                    call,
                    headers,
                } => {
                    ready!(sleep.as_mut().poll(cx));
                    let (mut inner, request) = *call.take().expect(POLLED_AFTER_READY);
                    State::Calling {
                        future: inner.call(request),
                        headers: std::mem::take(headers),
                    }
                }
            };
            self.as_mut().project().state.set(next);
        }
    }
}
