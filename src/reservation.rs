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
use crate::settle::{Debit, ResponseHead};
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
            holds_slots,
        }
    }

    /// True when the response body must carry this reservation (its slots are freed when
    /// the body ends).
    pub(crate) fn holds_slots(&self) -> bool {
        self.holds_slots
    }

    fn adjust(&self, adjustment: &Adjustment) -> DecideFuture {
        if self.fallback
            && let FailureMode::Fallback(fallback) = &self.adjuster.responder().failure_mode
        {
            return DecideFuture::ready(Ok(fallback.adjust(&self.key, &self.policies, adjustment)));
        }
        self.adjuster.adjust(&self.key, &self.policies, adjustment)
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

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}
