//! Response bodies: the limiter hands the inner service's body back unchanged, and writes
//! its own answers (`429`, `400`, `500`, `503`; the GraphQL layer's `413`) in the same
//! body type.
//!
//! A response that went through [`RateLimit`](crate::RateLimit) has the inner service's
//! body type, so a router needs no re-boxing and a stack of layers no new type per layer.
//! That needs a body type the limiter can build from bytes: [`ResponseBody`], implemented
//! for axum's `Body`, `http_body_util::Full<Bytes>`, its boxed bodies and
//! [`RateLimitBody`]. Any other body type works through [`WrapBodyLayer`], which wraps
//! the inner service's body in a [`RateLimitBody`]:
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Empty;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//! use tollgate::body::WrapBodyLayer;
//! use tollgate::key::HeaderKey;
//! use tollgate::{MemoryStore, Policy, RateLimitLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // `Empty` cannot hold a 429's problem body: wrap it.
//! let service = ServiceBuilder::new()
//!     .layer(
//!         RateLimitLayer::new(MemoryStore::new())
//!             .key(HeaderKey::new("x-api-key"))
//!             .policy(Policy::fixed_window("api", 1, std::time::Duration::from_secs(60))?),
//!     )
//!     .layer(WrapBodyLayer::new())
//!     .service(service_fn(|_: Request<()>| async {
//!         Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
//!     }));
//! let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
//! assert_eq!(service.clone().oneshot(request()).await?.status(), 200);
//! assert_eq!(service.clone().oneshot(request()).await?.status(), 429);
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

/// A response body type the limiter can write its own answers in (a `429`'s problem
/// body, a `400`, a `500`, a `503`): the inner service's responses pass through with their body
/// untouched, and the limiter's own are built with [`from_bytes`](Self::from_bytes).
///
/// Implemented for axum's `Body`, `http_body_util::Full<Bytes>`, `BoxBody<Bytes, E>` and
/// `UnsyncBoxBody<Bytes, E>`, tonic's `Body` (feature `tonic`), and [`RateLimitBody`]. Any
/// other body type (`String`,
/// `Empty`, a body of your own) works through [`WrapBodyLayer`].
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tollgate::body::ResponseBody;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let body = <Full<Bytes> as ResponseBody>::from_bytes(Bytes::from_static(b"{}"));
/// assert_eq!(body.collect().await.unwrap().to_bytes(), "{}");
/// # }
/// ```
///
/// A body type that is not one is a compile error that names [`WrapBodyLayer`]:
///
/// ```compile_fail,E0277
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Empty;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let service = RateLimitLayer::new(MemoryStore::new())
///     .policy(Policy::gcra("api", Rate::per_second(5), 5)?)
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
///     }));
/// service.oneshot(Request::new(())).await?;
/// # Ok(()) }
/// ```
#[diagnostic::on_unimplemented(
    message = "tollgate cannot write its own responses (429, 400, 500, 503) in a `{Self}` body",
    note = "add `tollgate::body::WrapBodyLayer` between the rate limiter and the service: it takes any body whose data can be built from `Bytes` (`Empty`, `String`, your own)"
)]
pub trait ResponseBody: Body + Sized {
    /// A body whose content is `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;

    /// This body, keeping `guard` until it has sent its last frame or is dropped: the
    /// limiter frees a request's in-flight slots
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) when its guard drops. The
    /// default drops the guard at once, when the response head leaves the limiter: right
    /// for a body that is whole from the start, such as `Full`. axum's `Body`, the boxed
    /// bodies, tonic's `Body` and [`RateLimitBody`] keep it to the end.
    ///
    /// Under an in-flight limit of one, a `Full` body frees the slot as soon as its
    /// response is out of the limiter; a [`RateLimitBody`] keeps it until its last frame
    /// is read:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};
    /// use tollgate::body::WrapBodyLayer;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limit = || {
    ///     RateLimitLayer::new(MemoryStore::new())
    ///         .key(HeaderKey::new("x-api-key"))
    ///         .policy(Policy::concurrency("downloads", 1).unwrap())
    /// };
    /// let handler = service_fn(|_: Request<()>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"data"))))
    /// });
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///
    /// // `Full` keeps nothing: the first response, still unread, holds no slot.
    /// let whole = limit().layer(handler.clone());
    /// let first = whole.clone().oneshot(request()).await?;
    /// assert_eq!(whole.clone().oneshot(request()).await?.status(), StatusCode::OK);
    /// # drop(first);
    ///
    /// // A `RateLimitBody` holds the slot until its body has been read to the end.
    /// let streamed = ServiceBuilder::new()
    ///     .layer(limit())
    ///     .layer(WrapBodyLayer::new())
    ///     .service(handler);
    /// let first = streamed.clone().oneshot(request()).await?;
    /// let second = streamed.clone().oneshot(request()).await?;
    /// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(first.into_body().collect().await?.to_bytes(), "data");
    /// assert_eq!(streamed.clone().oneshot(request()).await?.status(), StatusCode::OK);
    /// # Ok(()) }
    /// ```
    fn keep_until_end(self, guard: BodyGuard) -> Self {
        drop(guard);
        self
    }
}

/// What a response body keeps until it ends (see [`ResponseBody::keep_until_end`]).
/// Dropping it frees what the request holds (its in-flight slots).
///
/// A body type of your own keeps it by implementing `keep_until_end`. This one keeps it
/// until the body is dropped, so a download holds its slot until then:
///
/// ```
/// use std::convert::Infallible;
/// use std::pin::Pin;
/// use std::task::{Context, Poll};
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body::{Body, Frame};
/// use http_body_util::Full;
/// use tower::{Layer, ServiceExt, service_fn};
/// use tollgate::body::{BodyGuard, ResponseBody};
/// use tollgate::key::HeaderKey;
/// use tollgate::{MemoryStore, Policy, RateLimitLayer};
///
/// /// Bytes, and the limiter's guard while they are not dropped.
/// struct Download {
///     data: Full<Bytes>,
///     guard: Option<BodyGuard>,
/// }
///
/// impl Body for Download {
///     type Data = Bytes;
///     type Error = Infallible;
///
///     fn poll_frame(
///         mut self: Pin<&mut Self>,
///         cx: &mut Context<'_>,
///     ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
///         Pin::new(&mut self.data).poll_frame(cx)
///     }
/// }
///
/// impl ResponseBody for Download {
///     fn from_bytes(bytes: Bytes) -> Self {
///         Download { data: Full::new(bytes), guard: None }
///     }
///
///     fn keep_until_end(mut self, guard: BodyGuard) -> Self {
///         self.guard = Some(guard);
///         self
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = RateLimitLayer::new(MemoryStore::new())
///     .key(HeaderKey::new("x-api-key"))
///     .policy(Policy::concurrency("downloads", 1)?)
///     .layer(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Download::from_bytes(Bytes::from_static(b"data"))))
///     }));
/// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
/// let first = service.clone().oneshot(request()).await?;
/// let second = service.clone().oneshot(request()).await?;
/// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
/// drop(first); // its body goes, and the guard with it: the slot is free
/// assert_eq!(service.clone().oneshot(request()).await?.status(), StatusCode::OK);
/// # Ok(()) }
/// ```
pub struct BodyGuard {
    _held: Box<dyn Send + Sync>,
}

impl BodyGuard {
    pub(crate) fn new(held: impl Send + Sync + 'static) -> Self {
        Self {
            _held: Box::new(held),
        }
    }
}

impl std::fmt::Debug for BodyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyGuard").finish_non_exhaustive()
    }
}

pin_project! {
    /// A body that keeps a guard until its last frame or until it is dropped.
    struct Guarded<B> {
        #[pin]
        body: B,
        guard: Option<BodyGuard>,
    }
}

impl<B> Guarded<B> {
    fn new(body: B, guard: BodyGuard) -> Self {
        Self {
            body,
            guard: Some(guard),
        }
    }
}

impl<B: Body> Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.body.poll_frame(cx));
        if frame.is_none() {
            this.guard.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// axum's `Body` (`axum::body::Body` is this type), with or without the `axum` feature.
impl ResponseBody for axum_core::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        axum_core::body::Body::from(bytes)
    }

    fn keep_until_end(self, guard: BodyGuard) -> Self {
        axum_core::body::Body::new(Guarded::new(self, guard))
    }
}

/// tonic's body (feature `tonic`): a tonic server's services answer in it.
#[cfg(feature = "tonic")]
impl ResponseBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        tonic::body::Body::new(http_body_util::Full::new(bytes))
    }

    fn keep_until_end(self, guard: BodyGuard) -> Self {
        tonic::body::Body::new(Guarded::new(self, guard))
    }
}

impl ResponseBody for http_body_util::Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        http_body_util::Full::new(bytes)
    }
}

impl<E: 'static> ResponseBody for http_body_util::combinators::BoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        http_body_util::Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed()
    }

    fn keep_until_end(self, guard: BodyGuard) -> Self {
        Guarded::new(self, guard).boxed()
    }
}

impl<E: 'static> ResponseBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_bytes(bytes: Bytes) -> Self {
        http_body_util::Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed_unsync()
    }

    fn keep_until_end(self, guard: BodyGuard) -> Self {
        Guarded::new(self, guard).boxed_unsync()
    }
}

impl<B> ResponseBody for RateLimitBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    fn from_bytes(bytes: Bytes) -> Self {
        Self::full(bytes)
    }

    fn keep_until_end(mut self, guard: BodyGuard) -> Self {
        // Stacked limiters each hand over a guard: keep them all, not the last.
        self.guard = Some(match self.guard.take() {
            Some(held) => BodyGuard::new((held, guard)),
            None => guard,
        });
        self
    }
}

pin_project! {
    /// Any body, or a short body of bytes: what [`WrapBodyLayer`] turns an inner service's
    /// body into, so that the limiter can answer in the same type.
    ///
    /// Behind a [`WrapBodyLayer`], a service that answers with an `Empty` body answers in
    /// `RateLimitBody<Empty<Bytes>>`: its own responses pass through empty, and the
    /// limiter's `429` carries its problem body in the same type:
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response, StatusCode};
    /// use http_body_util::{BodyExt, Empty};
    /// use tower::{ServiceBuilder, ServiceExt, service_fn};
    /// use tollgate::body::WrapBodyLayer;
    /// use tollgate::key::HeaderKey;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitBody, RateLimitLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let service = ServiceBuilder::new()
    ///     .layer(
    ///         RateLimitLayer::new(MemoryStore::new())
    ///             .key(HeaderKey::new("x-api-key"))
    ///             .policy(Policy::token_bucket("api", 1, Rate::per_hour(1))?),
    ///     )
    ///     .layer(WrapBodyLayer::new())
    ///     .service(service_fn(|_: Request<()>| async {
    ///         Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    ///     }));
    /// let request = || Request::get("/").header("x-api-key", "k1").body(()).unwrap();
    ///
    /// let admitted: Response<RateLimitBody<Empty<Bytes>>> =
    ///     service.clone().oneshot(request()).await?;
    /// assert!(admitted.into_body().collect().await?.to_bytes().is_empty());
    /// let denied = service.clone().oneshot(request()).await?;
    /// assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(denied.headers()["content-type"], "application/problem+json");
    /// let problem = denied.into_body().collect().await?.to_bytes();
    /// assert!(problem.starts_with(b"{") && problem.ends_with(b"}"));
    /// # Ok(()) }
    /// ```
    pub struct RateLimitBody<B> {
        #[pin]
        kind: Kind<B>,
        guard: Option<BodyGuard>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

impl<B> RateLimitBody<B> {
    /// `body`, unchanged: its frames, its size hint and its end are the inner body's.
    ///
    /// ```
    /// use http_body::Body;
    /// use http_body_util::BodyExt;
    /// use tollgate::RateLimitBody;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let body = RateLimitBody::new(String::from("hello"));
    /// assert_eq!(body.size_hint().exact(), Some(5));
    /// assert!(!body.is_end_stream());
    /// assert_eq!(body.collect().await?.to_bytes(), "hello");
    /// # Ok(()) }
    /// ```
    pub fn new(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            guard: None,
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            guard: None,
        }
    }
}

impl<B> std::fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Full { .. } => "full",
        };
        f.debug_tuple("RateLimitBody").field(&kind).finish()
    }
}

impl<B> Body for RateLimitBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = match this.kind.project() {
            KindProj::Inner { body } => ready!(body.poll_frame(cx)),
            KindProj::Full { data } => data.take().map(|data| Ok(Frame::data(data.into()))),
        };
        if frame.is_none() {
            this.guard.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

/// Wraps the response body of the service it wraps in a [`RateLimitBody`], so that a
/// rate limiter in front of it can answer in that type: for body types that are no
/// [`ResponseBody`]. See the [module docs](self) for an example.
#[derive(Debug, Clone, Copy, Default)]
pub struct WrapBodyLayer {
    _private: (),
}

impl WrapBodyLayer {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl<S> Layer<S> for WrapBodyLayer {
    type Service = WrapBody<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WrapBody { inner }
    }
}

/// The service of [`WrapBodyLayer`].
#[derive(Debug, Clone)]
pub struct WrapBody<S> {
    inner: S,
}

impl<S, Request, B> Service<Request> for WrapBody<S>
where
    S: Service<Request, Response = Response<B>>,
{
    type Response = Response<RateLimitBody<B>>;
    type Error = S::Error;
    type Future = WrapBodyFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        WrapBodyFuture {
            future: self.inner.call(request),
        }
    }
}

pin_project! {
    /// The response future of [`WrapBody`].
    #[derive(Debug)]
    pub struct WrapBodyFuture<F> {
        #[pin]
        future: F,
    }
}

impl<F, B, E> Future for WrapBodyFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let response = ready!(self.project().future.poll(cx))?;
        Poll::Ready(Ok(response.map(RateLimitBody::new)))
    }
}
