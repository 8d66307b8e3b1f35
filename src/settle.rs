//! After the response: settling a reserved cost to the actual one, refunds by outcome,
//! and giving back in-flight slots.
//!
//! A request's cost is debited when it is admitted: an estimate (a reservation), so that
//! concurrent requests cannot overspend. With [`Settle`] the layer settles it once the
//! response head is known: the difference is given back or charged, atomically, in the
//! same store, and the response's own rate-limit headers show the settled state. Requests
//! under an in-flight limit ([`Policy::concurrency`](crate::Policy::concurrency)) give their
//! slot back when the response body has been sent or dropped.
//!
//! ```
//! use http::StatusCode;
//! use tollgate::cost::FromExtension;
//! use tollgate::settle::Settle;
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
//!
//! // Reserve the request's estimate (set by earlier middleware as a `RequestCost`),
//! // settle to the handler's `x-tokens-used`, and refund an upstream outage in full (not
//! // any 5xx: a client that can crash the handler must not get that for free).
//! let layer = RateLimitLayer::new(MemoryStore::new())
//!     .policy(Policy::token_bucket("tokens", 1_000, Rate::per_minute(1_000))?)
//!     .cost(FromExtension::or(1))
//!     .settle(Settle::from_header("x-tokens-used").refund_if(|status: StatusCode| {
//!         status == StatusCode::BAD_GATEWAY || status == StatusCode::SERVICE_UNAVAILABLE
//!     }));
//! # let _ = layer;
//! # Ok::<(), tollgate::PolicyError>(())
//! ```
//!
//! **When it happens.** Settling happens when the inner service has produced the response
//! head, before the response leaves the layer (with Redis, one more script call on that
//! path). A streamed body is not waited for: its cost must be known from the head (a
//! header, or an extension the handler set). In-flight slots are freed when the body ends
//! or is dropped, so a long stream holds its slot to the end.
//!
//! **What is exact.** A settle gives back only what the state still holds: a fixed or
//! sliding window that has moved on is not reopened, a bucket is never filled above full.
//! An actual cost above the reservation is charged in full, past empty if need be: the
//! excess is owed, and the identity's next requests (those reserving nothing included)
//! wait until a bucket has refilled it or a window has forgotten it. An identity never
//! owes more than one whole quota, however many settles land at once: where one request
//! can cost more than that, reserve a bound (or cap what the handler may spend), or the
//! policy limits requests rather than units. With `store::Leased`
//! blocks, units already leased on other replicas are spent while the identity owes.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::{Extensions, HeaderMap, StatusCode};

use crate::decision::Receipt;
use crate::policy::PolicySet;

/// How the layer settles an admitted request's cost once its response head is known:
/// where the actual cost comes from, and which responses are refunded in full.
///
/// A response that names no actual cost (the header is missing or not a number) keeps
/// the reservation as it is; a malformed value is logged.
#[derive(Clone)]
pub struct Settle {
    source: Source,
    refund_if: Option<Arc<dyn Fn(StatusCode) -> bool + Send + Sync>>,
}

/// A closure that reads the actual cost from a response head.
type ActualFn = dyn Fn(&ResponseHead<'_>) -> Option<u64> + Send + Sync;

#[derive(Clone)]
enum Source {
    Reserved,
    Header(HeaderName),
    Extension,
    Fn(Arc<ActualFn>),
}

impl fmt::Debug for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Reserved => "reserved".to_owned(),
            Source::Header(name) => format!("header {name}"),
            Source::Extension => "extension".to_owned(),
            Source::Fn(_) => "closure".to_owned(),
        };
        f.debug_struct("Settle")
            .field("source", &source)
            .field("refunds", &self.refund_if.is_some())
            .finish()
    }
}

/// The actual cost of a request, set by the handler as a response extension and read by
/// [`Settle::from_extension`].
///
/// ```
/// use axum::response::IntoResponse;
/// use tollgate::settle::ActualCost;
///
/// async fn search() -> impl IntoResponse {
///     let rows = 42;
///     (axum::Extension(ActualCost(rows)), "42 rows")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ActualCost(pub u64);

/// The response head a [`Settle::from_fn`] closure reads the actual cost from.
#[derive(Debug, Clone, Copy)]
pub struct ResponseHead<'a> {
    status: StatusCode,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> ResponseHead<'a> {
    pub(crate) fn new(
        status: StatusCode,
        headers: &'a HeaderMap,
        extensions: &'a Extensions,
    ) -> Self {
        Self {
            status,
            headers,
            extensions,
        }
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The response extensions.
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }
}

impl Settle {
    /// Keeps every reservation as charged: only refunds ([`refund_if`](Self::refund_if))
    /// change it.
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// // Requests the upstream failed do not count.
    /// let settle = Settle::reserved().refund_if(|status| matches!(status.as_u16(), 502 | 503));
    /// # let _ = settle;
    /// ```
    pub fn reserved() -> Self {
        Self {
            source: Source::Reserved,
            refund_if: None,
        }
    }

    /// The actual cost is the decimal number in the response header `name` (any case).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name: a programming error caught at start-up.
    /// [`try_from_header`](Self::try_from_header) returns the error instead.
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// let settle = Settle::from_header("X-Tokens-Used");
    /// # let _ = settle;
    /// ```
    pub fn from_header(name: &str) -> Self {
        Self::try_from_header(name).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Like [`from_header`](Self::from_header), for names read from configuration.
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// assert!(Settle::try_from_header("x-rows").is_ok());
    /// assert!(Settle::try_from_header("no spaces").is_err());
    /// ```
    pub fn try_from_header(name: &str) -> Result<Self, String> {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("Settle::from_header: {name:?} is not a valid header name"))?;
        Ok(Self {
            source: Source::Header(name),
            refund_if: None,
        })
    }

    /// The actual cost is the [`ActualCost`] extension the handler set on the response.
    pub fn from_extension() -> Self {
        Self {
            source: Source::Extension,
            refund_if: None,
        }
    }

    /// The actual cost is what `f` reads from the response head (`None` keeps the
    /// reservation).
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// // Rows returned, counted by the handler in a header; at least 1.
    /// let settle = Settle::from_fn(|head| {
    ///     let rows = head.headers().get("x-rows")?.to_str().ok()?.parse::<u64>().ok()?;
    ///     Some(rows.max(1))
    /// });
    /// # let _ = settle;
    /// ```
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&ResponseHead<'_>) -> Option<u64> + Send + Sync + 'static,
    {
        Self {
            source: Source::Fn(Arc::new(f)),
            refund_if: None,
        }
    }

    /// Refunds in full the requests whose response status satisfies `refund` (for
    /// example server errors): they do not count against any policy.
    ///
    /// Only a response has a status: when the inner service fails instead (its future
    /// returns `Err`, as a `tower::timeout::Timeout` inside the limiter does), the
    /// reservation stands. To have such failures refunded, turn them into responses
    /// inside the limiter (axum's `HandleErrorLayer` between the two), so that `refund`
    /// sees their status.
    ///
    /// A refunded request is free however much work it caused: a client that can make
    /// requests fail on purpose (a query built to run into the timeout, an input that
    /// crashes a handler) is then not limited at all. Refund only failures the client
    /// cannot cause (an upstream that is down: `502`, `503`), or keep a second policy
    /// (or layer) without refunds that counts every request.
    ///
    /// ```
    /// use tollgate::settle::Settle;
    ///
    /// // An upstream that is down or busy costs the client nothing.
    /// let settle = Settle::reserved().refund_if(|status| matches!(status.as_u16(), 502 | 503 | 429));
    /// # let _ = settle;
    /// ```
    pub fn refund_if<F>(mut self, refund: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    /// The actual cost for a response, or `None` to keep the reservation.
    pub(crate) fn actual(&self, head: &ResponseHead<'_>) -> Option<u64> {
        if let Some(refund) = &self.refund_if
            && refund(head.status)
        {
            return Some(0);
        }
        match &self.source {
            Source::Reserved => None,
            Source::Header(name) => {
                let value = head.headers.get(name)?;
                let parsed = value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok());
                if parsed.is_none() {
                    #[cfg(feature = "tracing")]
                    tracing::warn!(
                        target: "tollgate",
                        header = %name,
                        "the response's actual cost is not a whole number; the reservation stands"
                    );
                }
                parsed
            }
            Source::Extension => head
                .extensions
                .get::<ActualCost>()
                .map(|ActualCost(cost)| *cost),
            Source::Fn(f) => f(head),
        }
    }
}

/// Where an admitted request was debited: the store, or the local fallback (under the
/// policies it applied) while the store was away.
pub(crate) struct Debit {
    pub(crate) receipt: Receipt,
    pub(crate) fallback: Option<PolicySet>,
    /// What the debit left of each policy (for an exact settle of buckets and GCRA).
    pub(crate) left: smallvec::SmallVec<[u64; 2]>,
}
