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
use crate::key::Key;
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
    /// When each policy's queue ended after the debit: a request held back by shaping
    /// (to give its place back if it is dropped before it is sent); else empty.
    pub(crate) ends: smallvec::SmallVec<[u64; 2]>,
}

/// The most bookings of dropped requests a layer keeps, over every key: beyond it, a
/// request dropped during its delay is given back only if it is the newest at once.
const MAX_DROPPED: usize = 4096;

/// The debit of a request dropped during its shaping delay, not yet given back because a
/// request queued behind it still stood (see `Change::Unbook`): kept until those are
/// given back, or until it has leaked out.
pub(crate) struct Booking {
    pub(crate) policies: PolicySet,
    /// Debited by the local fallback (under `policies`, the ones it applied).
    pub(crate) fallback: bool,
    pub(crate) cost: u64,
    pub(crate) receipt: Receipt,
    pub(crate) left: smallvec::SmallVec<[u64; 2]>,
    pub(crate) ends: smallvec::SmallVec<[u64; 2]>,
    /// When nothing of it is left to give back (its queue has leaked out).
    pub(crate) gone: tokio::time::Instant,
}

impl Booking {
    /// Its place among the key's bookings: when it was debited, then where its queue ends.
    fn order(&self) -> (u64, u64) {
        (
            self.receipt.at(),
            self.ends.iter().copied().max().unwrap_or(0),
        )
    }
}

/// A layer's bookings of dropped requests, by key, oldest first: when a request dropped
/// during its delay is given back, the ones dropped before it are tried in turn, newest
/// first (clients' timeouts end in the order their requests came).
#[derive(Default)]
pub(crate) struct DroppedBookings {
    inner: std::sync::Mutex<Dropped>,
}

#[derive(Default)]
struct Dropped {
    by_key: std::collections::HashMap<Key, Vec<Booking>>,
    count: usize,
}

impl Dropped {
    /// Forgets the bookings of `key` that have leaked out.
    fn forget_gone(&mut self, key: &Key, now: tokio::time::Instant) {
        let Some(bookings) = self.by_key.get_mut(key) else {
            return;
        };
        let before = bookings.len();
        bookings.retain(|booking| booking.gone > now);
        self.count -= before - bookings.len();
        if bookings.is_empty() {
            self.by_key.remove(key);
        }
    }

    /// Forgets every booking that has leaked out.
    fn forget_all_gone(&mut self, now: tokio::time::Instant) {
        let mut forgotten = 0;
        self.by_key.retain(|_, bookings| {
            let before = bookings.len();
            bookings.retain(|booking| booking.gone > now);
            forgotten += before - bookings.len();
            !bookings.is_empty()
        });
        self.count -= forgotten;
    }
}

impl DroppedBookings {
    fn lock(&self) -> std::sync::MutexGuard<'_, Dropped> {
        // A panic elsewhere while the lock was held leaves whole bookings behind.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `booking` of `key` until the requests queued after it are given back; gives
    /// it back (not kept) when the layer holds as many as it keeps.
    pub(crate) fn keep(&self, key: &Key, booking: Booking) -> Result<(), Booking> {
        let now = tokio::time::Instant::now();
        if booking.gone <= now {
            return Ok(());
        }
        let mut dropped = self.lock();
        dropped.forget_gone(key, now);
        if dropped.count >= MAX_DROPPED {
            dropped.forget_all_gone(now);
            if dropped.count >= MAX_DROPPED {
                return Err(booking);
            }
        }
        dropped.count += 1;
        let bookings = dropped.by_key.entry(key.clone()).or_default();
        let at = bookings.partition_point(|kept| kept.order() <= booking.order());
        bookings.insert(at, booking);
        Ok(())
    }

    /// Takes the newest booking of `key` that has not leaked out.
    pub(crate) fn take_newest(&self, key: &Key) -> Option<Booking> {
        let mut dropped = self.lock();
        dropped.forget_gone(key, tokio::time::Instant::now());
        let bookings = dropped.by_key.get_mut(key)?;
        let newest = bookings.pop();
        if bookings.is_empty() {
            dropped.by_key.remove(key);
        }
        if newest.is_some() {
            dropped.count -= 1;
        }
        newest
    }

    /// How many bookings are kept (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().count
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Policy, Rate};

    fn booking(at: u64, lasts: Duration) -> Booking {
        let paced = Policy::leaky_bucket_shaping("paced", Rate::per_second(1), lasts).unwrap();
        Booking {
            policies: PolicySet::from(paced),
            fallback: false,
            cost: 1,
            receipt: Receipt::new(at, 0),
            left: smallvec::smallvec![1],
            ends: smallvec::smallvec![at + 1],
            gone: tokio::time::Instant::now() + lasts,
        }
    }

    /// A layer keeps a bounded number of dropped bookings, whatever the keys: one past the
    /// bound is handed back (tried once, not kept), and bookings that have leaked out make
    /// room.
    #[tokio::test(start_paused = true)]
    async fn the_dropped_bookings_are_bounded_and_forgotten_once_gone() {
        let dropped = DroppedBookings::default();
        for n in 0..MAX_DROPPED {
            let key = Key::new(format!("k{n}"));
            let lasts = if n % 2 == 0 { 1 } else { 60 };
            assert!(
                dropped
                    .keep(&key, booking(1, Duration::from_secs(lasts)))
                    .is_ok()
            );
        }
        assert_eq!(dropped.len(), MAX_DROPPED);
        let late = Key::new("late");
        assert!(
            dropped
                .keep(&late, booking(1, Duration::from_secs(60)))
                .is_err()
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(
            dropped
                .keep(&late, booking(1, Duration::from_secs(60)))
                .is_ok()
        );
        assert_eq!(dropped.len(), MAX_DROPPED / 2 + 1);
    }

    /// A key's bookings come back newest first, by the time of their debit.
    #[tokio::test(start_paused = true)]
    async fn the_newest_dropped_booking_comes_back_first() {
        let dropped = DroppedBookings::default();
        let key = Key::new("k");
        for at in [20, 10, 30] {
            assert!(
                dropped
                    .keep(&key, booking(at, Duration::from_secs(60)))
                    .is_ok()
            );
        }
        let order: Vec<u64> = std::iter::from_fn(|| dropped.take_newest(&key))
            .map(|booking| booking.receipt.at())
            .collect();
        assert_eq!(order, [30, 20, 10]);
        assert_eq!(dropped.len(), 0);
    }
}
