//! An admitted request's debit, kept until its response: settled at the response head
//! (as the layer's [`Settle`](crate::settle::Settle) says), its in-flight slots freed when
//! the response body ends or is dropped.

use std::sync::Arc;

use crate::decision::{Decision, Receipt};
use crate::failure::FailureMode;
use crate::key::Key;
use crate::policy::PolicySet;
use crate::respond::Responder;
use crate::respond::headers::{HeaderBlock, jitter_secs, rate_limit_headers};
use crate::settle::{Booking, Debit, ResponseHead};
use crate::store::{Adjustment, BoxedDecision, DecideFuture, StoreError, StoreErrorKind, within};
use crate::telemetry;

/// What adjusts the store's state after a response: the layer's store, behind its
/// configuration.
pub(crate) trait Adjuster: Send + Sync + 'static {
    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture;
    fn responder(&self) -> &Arc<Responder>;
}

/// An admitted request's debit, kept until its response: settles it, and frees its
/// in-flight slots when dropped (the response body ended or was dropped, or the request
/// never got a response).
pub(crate) struct Reservation {
    adjuster: Arc<dyn Adjuster>,
    key: Key,
    /// The policies the debit was made under (the fallback's when it decided).
    policies: PolicySet,
    fallback: bool,
    cost: u64,
    receipt: Receipt,
    /// What the debit left of each policy.
    left: smallvec::SmallVec<[u64; 2]>,
    /// When each policy's queue ended after the debit (a request held back by shaping).
    ends: smallvec::SmallVec<[u64; 2]>,
    holds_slots: bool,
}

/// The outcome of settling at the response head.
pub(crate) enum Settled {
    /// Nothing to settle, or the store could not: the headers stay.
    Unchanged,
    /// The headers of the settled state.
    Headers(HeaderBlock),
    /// A store doing I/O: the decision comes later.
    Pending(BoxedDecision),
}

impl Reservation {
    pub(crate) fn new(
        adjuster: Arc<dyn Adjuster>,
        key: Key,
        policies: PolicySet,
        cost: u64,
        debit: Debit,
    ) -> Self {
        let (policies, fallback) = match debit.fallback {
            Some(applied) => (applied, true),
            None => (policies, false),
        };
        let holds_slots = cost > 0 && policies.has_in_flight();
        Self {
            adjuster,
            key,
            policies,
            fallback,
            cost,
            receipt: debit.receipt,
            left: debit.left,
            ends: debit.ends,
            holds_slots,
        }
    }

    /// True when the response body must carry this reservation (its slots are freed when
    /// the body ends).
    pub(crate) fn holds_slots(&self) -> bool {
        self.holds_slots
    }

    fn adjust(&self, adjustment: &Adjustment) -> DecideFuture {
        adjust_in(
            &*self.adjuster,
            &self.key,
            &self.policies,
            self.fallback,
            adjustment,
        )
    }

    /// The request was dropped during its shaping delay, before it was sent: its
    /// in-flight slots are freed, and its place in the schedule is given back if no
    /// request queued behind it since, then those dropped before it, newest first. A
    /// place a standing request queued behind is kept until that one is given back
    /// (given back, the next request would go on the standing one's instant), or until it
    /// has leaked out.
    pub(crate) fn unbook(self) {
        if self.ends.is_empty() {
            return;
        }
        let adjuster = Arc::clone(&self.adjuster);
        let key = self.key.clone();
        // Nothing of it is left once its shaping queues have leaked out.
        let end = (self.policies.iter().zip(&self.ends))
            .filter(|(policy, _)| policy.params().is_shaping())
            .map(|(_, end)| *end)
            .max()
            .unwrap_or(0);
        let booking = Booking {
            policies: self.policies.clone(),
            fallback: self.fallback,
            cost: self.cost,
            receipt: self.receipt,
            left: self.left.clone(),
            ends: self.ends.clone(),
            gone: tokio::time::Instant::now()
                + std::time::Duration::from_nanos(end.saturating_sub(self.receipt.at())),
        };
        // Frees the in-flight slots.
        drop(self);
        let first = adjuster.responder().dropped.keep(&key, booking).err();
        let mut give_back = Box::pin(give_back_dropped(adjuster, key, first));
        // An in-process store (or the fallback) answers at once: given back before the
        // drop returns. A store doing I/O finishes in a task (without a runtime, the
        // places stay booked and leak out with time).
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if give_back.as_mut().poll(&mut cx).is_pending()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(give_back);
        }
    }

    /// Settles against the response head, as the layer's [`Settle`] says.
    pub(crate) fn settle(&self, head: &ResponseHead<'_>) -> Settled {
        let Some(settle) = &self.adjuster.responder().settle else {
            return Settled::Unchanged;
        };
        let Some(actual) = settle.actual(head) else {
            return Settled::Unchanged;
        };
        if actual == self.cost {
            return Settled::Unchanged;
        }
        // A shaping policy's units are the request's place in its schedule, taken when it
        // was sent: a refund does not give them back (the next request would go on the
        // same instant as this one). A charge above the reservation does reach it: the
        // requests decided after wait for what this one used.
        let refund = actual < self.cost;
        let shaping = self
            .policies
            .iter()
            .enumerate()
            .filter(|_| refund)
            .filter(|(index, policy)| {
                *index < 64 && matches!(policy.algorithm(), crate::Algorithm::LeakyShaping { .. })
            })
            .fold(0u64, |mask, (index, _)| mask | (1 << index));
        let receipt = self
            .receipt
            .with_undebited(self.receipt.undebited() | shaping);
        let adjustment =
            Adjustment::settle(self.cost, actual, receipt).with_left(self.left.iter().copied());
        match self.adjust(&adjustment).into_ready() {
            Ok(result) => self
                .headers(result)
                .map_or(Settled::Unchanged, Settled::Headers),
            Err(pending) => {
                let timeout = self.adjuster.responder().timeout;
                Settled::Pending(Box::pin(within(timeout, "settlement", pending)))
            }
        }
    }

    /// The headers of a settled state; `None` (keep the headers) when the store failed,
    /// which is logged and counted.
    pub(crate) fn headers(&self, result: Result<Decision, StoreError>) -> Option<HeaderBlock> {
        match result {
            Ok(decision) => {
                let responder = self.adjuster.responder();
                if responder.shadow && !responder.headers.shadow {
                    // A shadow layer sends no headers, settled or not.
                    return Some(HeaderBlock::default());
                }
                let extra = jitter_secs(responder.headers.jitter);
                Some(rate_limit_headers(
                    &responder.headers,
                    &self.policies,
                    &decision,
                    &self.key,
                    extra,
                ))
            }
            Err(error) => {
                telemetry::store_error(&error);
                None
            }
        }
    }

    /// Frees the in-flight slots now (from a store doing I/O: on the runtime, bounded by
    /// the store timeout; without a runtime the slots expire with their lease).
    fn release(&mut self) {
        if !std::mem::take(&mut self.holds_slots) {
            return;
        }
        let adjustment = Adjustment::release(self.cost, self.receipt);
        match self.adjust(&adjustment).into_ready() {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => telemetry::store_error(&error),
            Err(pending) => {
                let timeout = self.adjuster.responder().timeout;
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => {
                        runtime.spawn(async move {
                            // Not freed: the slots expire with their lease.
                            let what = "release of in-flight slots";
                            if let Err(error) = within(timeout, what, pending).await {
                                telemetry::store_error(&error);
                            }
                        });
                    }
                    Err(_) => telemetry::store_error(&StoreError::new(
                        StoreErrorKind::Other,
                        "no async runtime to free in-flight slots; they expire with their lease",
                    )),
                }
            }
        }
    }
}

/// Adjusts `key` where its debit was made: the store, or the local fallback.
fn adjust_in(
    adjuster: &dyn Adjuster,
    key: &Key,
    policies: &PolicySet,
    fallback: bool,
    adjustment: &Adjustment,
) -> DecideFuture {
    if fallback && let FailureMode::Fallback(local) = &adjuster.responder().failure_mode {
        return DecideFuture::ready(Ok(local.adjust(key, policies, adjustment)));
    }
    adjuster.adjust(key, policies, adjustment)
}

/// Gives back the places of `key`'s dropped requests, newest first (`first`, one the
/// layer could not keep, before them), for as long as each is the newest booking: one
/// that is not is kept for later (a request queued behind it stands). A store failure
/// ends the round, counted and logged; the place stays booked.
async fn give_back_dropped(adjuster: Arc<dyn Adjuster>, key: Key, first: Option<Booking>) {
    let responder = Arc::clone(adjuster.responder());
    let mut next = first;
    while let Some(booking) = next.take().or_else(|| responder.dropped.take_newest(&key)) {
        let adjustment = Adjustment::unbooking(
            booking.cost,
            booking.receipt,
            booking.left.iter().copied(),
            booking.ends.iter().copied(),
        );
        let future = adjust_in(
            &*adjuster,
            &key,
            &booking.policies,
            booking.fallback,
            &adjustment,
        );
        let result = match future.into_ready() {
            Ok(result) => result,
            Err(pending) => {
                let what = "give-back of a dropped request's place";
                within(responder.timeout, what, pending).await
            }
        };
        match result {
            Ok(decision) if decision.is_allowed() => {}
            // A request queued behind it stands: kept until that one is given back.
            Ok(_) => {
                // Not kept when the layer holds as many as it keeps: it leaks out.
                let _ = responder.dropped.keep(&key, booking);
                return;
            }
            Err(error) => {
                telemetry::store_error(&error);
                return;
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}
