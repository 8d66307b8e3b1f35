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
use crate::settle::{Booking, Debit, QueueId, ResponseHead};
use crate::store::{Adjustment, BoxedDecision, DecideFuture, StoreError, StoreErrorKind, within};
use crate::telemetry;

/// What adjusts the store's state after a response: the layer's store, behind its
/// configuration.
pub(crate) trait Adjuster: Send + Sync + 'static {
    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture;
    /// Whether the store adjusts at all (`Store::can_adjust`).
    fn can_adjust(&self) -> bool;
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
    /// The request's fate is known: its response head came (and was settled), or it was
    /// never sent. A reservation dropped before either is a request that got no head
    /// (`Settle::if_dropped`).
    answered: bool,
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
            answered: false,
        }
    }

    /// The request's fate is known without a response head (the inner service failed, or
    /// never became ready): it keeps its reservation, and is not charged as a request
    /// dropped while it ran.
    pub(crate) fn keep_reservation(&mut self) {
        self.answered = true;
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

    /// The request was dropped during its shaping delay (decided at `decided`), before it
    /// was sent: its in-flight slots are freed, and its place in the schedule is given
    /// back if no request queued behind it since, then those dropped before it, newest
    /// first. A place a standing request queued behind is kept until that one is given
    /// back (given back, the next request would go on the standing one's instant), or
    /// until it has leaked out. Nothing is asked of a store that cannot adjust, or while
    /// the breaker holds requests off it: the places leak out.
    pub(crate) fn unbook(mut self, decided: tokio::time::Instant) {
        // Never sent: no work to charge as a dropped request's.
        self.answered = true;
        let responder = Arc::clone(self.adjuster.responder());
        if self.ends.is_empty()
            || (!self.fallback && (!self.adjuster.can_adjust() || responder.breaker.is_open()))
        {
            return;
        }
        let adjuster = Arc::clone(&self.adjuster);
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
            gone: decided + std::time::Duration::from_nanos(end.saturating_sub(self.receipt.at())),
        };
        let queue = booking.queue(&self.key);
        // Frees the in-flight slots.
        drop(self);
        if !responder.dropped.drop_off(&queue, booking) {
            return;
        }
        let mut give_back = Box::pin(give_back_dropped(adjuster, queue));
        // An in-process store (or the fallback) answers at once: given back before the
        // drop returns. A store doing I/O finishes in a task (without a runtime, the
        // round stops at its first store call: the places leak out).
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if give_back.as_mut().poll(&mut cx).is_pending()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(give_back);
        }
    }

    /// Settles against the response head, as the layer's [`Settle`] says.
    pub(crate) fn settle(&mut self, head: &ResponseHead<'_>) -> Settled {
        self.answered = true;
        let Some(settle) = &self.adjuster.responder().settle else {
            return Settled::Unchanged;
        };
        let actual = match settle.actual(head) {
            Ok(Some(actual)) => actual,
            Ok(None) => return Settled::Unchanged,
            Err(header) => {
                crate::telemetry::settle_unreadable(header);
                return Settled::Unchanged;
            }
        };
        let Some(adjustment) = self.settlement(actual) else {
            return Settled::Unchanged;
        };
        match self.adjust(&adjustment).into_ready() {
            Ok(result) => self
                .headers(result)
                .map_or(Settled::Unchanged, Settled::Headers),
            // The breaker holds requests off a failing store, or the store left the last
            // adjustment unanswered (behind a lease, whose decisions say nothing of the
            // store, only adjustments tell): the response does not wait on it either.
            // The settle goes on in the background (it may land after a blip, and then
            // responses wait for their settles again), and the response keeps its
            // decision's headers.
            Err(pending)
                if self.adjuster.responder().breaker.is_degraded()
                    || self.adjuster.responder().breaker.adjustments_unanswered() =>
            {
                self.finish(
                    DecideFuture::new(pending),
                    "settle",
                    "settle while the store fails",
                    "no async runtime to settle a request while the store fails: it keeps \
                     its reservation",
                );
                Settled::Unchanged
            }
            Err(pending) => {
                let timeout = self.adjuster.responder().timeout;
                Settled::Pending(Box::pin(within(timeout, "settlement", pending)))
            }
        }
    }

    /// The adjustment that settles the debit to `actual` units; `None` when nothing
    /// changes.
    fn settlement(&self, actual: u64) -> Option<Adjustment> {
        if actual == self.cost {
            return None;
        }
        // A shaping policy's units are the request's place in its schedule, taken when it
        // was sent: a refund does not give them back (the next request would go on the
        // same instant as this one). A charge above the reservation does reach it: the
        // requests decided after wait for what this one used.
        // Past the receipt's 64 marks: no refund at all, rather than a place given back.
        let shaping = if actual < self.cost {
            self.policies.shaping_marks()?
        } else {
            0
        };
        let receipt = self
            .receipt
            .with_undebited(self.receipt.undebited() | shaping);
        Some(Adjustment::settle(self.cost, actual, receipt).with_left(self.left.iter().copied()))
    }

    /// The request was dropped while the inner service ran, before its response head:
    /// settled to what `Settle::if_dropped` says, when that is more than it reserved.
    #[cold]
    #[inline(never)]
    fn settle_dropped(&mut self) {
        self.answered = true;
        let responder = self.adjuster.responder();
        let Some(units) = responder.settle.as_ref().and_then(|s| s.dropped_cost()) else {
            return;
        };
        let Some(adjustment) = self.settlement(units.max(self.cost)) else {
            return;
        };
        let future = self.adjust(&adjustment);
        self.finish(
            future,
            "settle",
            "settle of a request dropped before its response head",
            "no async runtime to settle a request dropped before its response head: it \
             keeps its reservation",
        );
    }

    /// Ends an adjustment no request waits for: at once from an in-process store, else on
    /// the runtime, bounded by the store timeout. A failure (or no runtime) is counted and
    /// logged as `lost`.
    fn finish(
        &self,
        future: DecideFuture,
        lost: &'static str,
        what: &'static str,
        no_runtime: &'static str,
    ) {
        match future.into_ready() {
            Ok(result) => {
                self.heard(&result);
                if let Err(error) = result {
                    telemetry::adjustment_lost(lost, &error);
                }
            }
            Err(pending) => {
                let timeout = self.adjuster.responder().timeout;
                self.finish_in_task(within(timeout, what, pending), lost, no_runtime);
            }
        }
    }

    /// Ends `bounded` (an adjustment already bounded by the store timeout) in a task on
    /// the runtime: its answer is told to the listener, and a failure is counted and
    /// logged as `lost`; without a runtime, `no_runtime` is.
    pub(crate) fn finish_in_task(
        &self,
        bounded: impl Future<Output = Result<Decision, StoreError>> + Send + 'static,
        lost: &'static str,
        no_runtime: &'static str,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            telemetry::adjustment_lost(lost, &StoreError::new(StoreErrorKind::Other, no_runtime));
            return;
        };
        let listener = self.listener().cloned();
        runtime.spawn(async move {
            let result = bounded.await;
            if let Some(breaker) = listener {
                breaker.heard_adjustment(&result);
            }
            if let Err(error) = result {
                telemetry::adjustment_lost(lost, &error);
            }
        });
    }

    /// Whoever hears how the store answers this debit's adjustments (see
    /// `Breaker::heard_adjustment`): nobody for a debit of the local fallback's, whose
    /// answers say nothing of the store.
    fn listener(&self) -> Option<&Arc<crate::failure::Breaker>> {
        (!self.fallback).then(|| &self.adjuster.responder().breaker)
    }

    /// Tells the listener (see [`listener`](Self::listener)) how the store answered.
    fn heard(&self, result: &Result<Decision, StoreError>) {
        if let Some(breaker) = self.listener() {
            breaker.heard_adjustment(result);
        }
    }

    /// The headers of a settled state; `None` (keep the headers) when the store failed,
    /// which is logged and counted.
    pub(crate) fn headers(&self, result: Result<Decision, StoreError>) -> Option<HeaderBlock> {
        self.heard(&result);
        match result {
            Ok(decision) => {
                let responder = self.adjuster.responder();
                if responder.shadow && !responder.headers.shadow {
                    // A shadow layer sends no headers, settled or not.
                    return Some(HeaderBlock::default());
                }
                let extra = jitter_secs(responder.headers.jitter);
                let headers = rate_limit_headers(
                    &responder.headers,
                    &self.policies,
                    &decision,
                    &self.key,
                    extra,
                );
                Some(if responder.shadow {
                    headers.enforcing_nothing()
                } else {
                    headers
                })
            }
            Err(error) => {
                telemetry::adjustment_lost("settle", &error);
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
        let future = self.adjust(&adjustment);
        // Not freed: the slots expire with their lease.
        self.finish(
            future,
            "release",
            "release of in-flight slots",
            "no async runtime to free in-flight slots; they expire with their lease",
        );
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

/// A round over `queue`'s dropped requests: gives back its newest booking for as long as
/// each is the newest of the queue. One that is not is kept for later (a request queued
/// behind it stands), and the round ends, unless a request was dropped meanwhile. A store
/// failure ends the round, counted and logged; the places stay booked.
async fn give_back_dropped(adjuster: Arc<dyn Adjuster>, queue: QueueId) {
    let responder = Arc::clone(adjuster.responder());
    let dropped = &responder.dropped;
    // A round dropped on its way (its runtime shutting down) ends: another can start.
    let mut round = Round {
        dropped,
        queue: &queue,
        over: false,
    };
    round.run(&*adjuster, responder.timeout).await;
    round.over = true;
}

/// A round over one queue's dropped requests, ended however it ends.
struct Round<'a> {
    dropped: &'a crate::settle::DroppedBookings,
    queue: &'a QueueId,
    /// The round ended by itself (its queue no longer marked as having one).
    over: bool,
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        if !self.over {
            self.dropped.stop(self.queue);
        }
    }
}

impl Round<'_> {
    async fn run(&mut self, adjuster: &dyn Adjuster, timeout: std::time::Duration) {
        let (dropped, queue) = (self.dropped, self.queue);
        while let Some(booking) = dropped.next(queue) {
            let adjustment = Adjustment::unbooking(
                booking.cost,
                booking.receipt,
                booking.left.iter().copied(),
                booking.ends.iter().copied(),
            );
            let future = adjust_in(
                adjuster,
                queue.key(),
                &booking.policies,
                booking.fallback,
                &adjustment,
            );
            let result = match future.into_ready() {
                Ok(result) => result,
                // A store call is bounded by the store timeout, which needs a runtime.
                Err(_) if tokio::runtime::Handle::try_current().is_err() => {
                    let _ = dropped.refused(queue, booking);
                    dropped.stop(queue);
                    return;
                }
                Err(pending) => {
                    let what = "give-back of a dropped request's place";
                    within(timeout, what, pending).await
                }
            };
            match result {
                Ok(decision) if decision.is_allowed() => {}
                Ok(_) => {
                    // A store failure ends the round, as below: the bookings not tried
                    // keep what they owe for the next.
                    let (booking, answered) =
                        others_given_back(adjuster, queue, booking, timeout).await;
                    if !(answered && self.others_of_older(adjuster, timeout).await) {
                        dropped.put_back(queue, booking);
                        dropped.stop(queue);
                        return;
                    }
                    if !dropped.refused(queue, booking) {
                        return;
                    }
                }
                Err(error) => {
                    telemetry::adjustment_lost("unbooking", &error);
                    dropped.stop(queue);
                    return;
                }
            }
        }
    }

    /// The request standing behind a refused booking stands behind every older booking
    /// of the queue too (dropped out of order, or while this round's call was out): their
    /// other units go back as well ([`others_given_back`]). Each once: a booking still
    /// owing after its turn (no runtime to send it) ends the sweep. False when the store
    /// failed (the bookings not tried keep what they owe).
    async fn others_of_older(&self, adjuster: &dyn Adjuster, timeout: std::time::Duration) -> bool {
        let (dropped, queue) = (self.dropped, self.queue);
        while let Some(older) = dropped.take_owing(queue) {
            let (older, answered) = others_given_back(adjuster, queue, older, timeout).await;
            let owing = older.owes_others();
            dropped.put_back(queue, older);
            if !answered {
                return false;
            }
            if owing {
                break;
            }
        }
        true
    }
}

/// A dropped request's booking whose place stays taken (a request queued behind it
/// stands): it was never sent, so its units under the set's other rate policies go back
/// now, as a settle to nothing (as the `Limiter` gives back a sleeper's), and the booking
/// keeps its place alone. It is marked so whether the settle lands or is lost on the way
/// (counted and logged): its units never go back twice. With whether the store answered
/// (a failure ends the round).
async fn others_given_back(
    adjuster: &dyn Adjuster,
    queue: &QueueId,
    mut booking: Booking,
    timeout: std::time::Duration,
) -> (Booking, bool) {
    let (Some(place_only), Some(settle)) = (
        booking.place_only(),
        Adjustment::places_kept(
            booking.cost,
            booking.receipt,
            booking.left.iter().copied(),
            &booking.policies,
        ),
    ) else {
        return (booking, true);
    };
    let future = adjust_in(
        adjuster,
        queue.key(),
        &booking.policies,
        booking.fallback,
        &settle,
    );
    let result = match future.into_ready() {
        Ok(result) => result,
        // Bounded by the store timeout, which needs a runtime: nothing is sent.
        Err(_) if tokio::runtime::Handle::try_current().is_err() => return (booking, true),
        Err(pending) => {
            let what = "give-back of a dropped request's units";
            within(timeout, what, pending).await
        }
    };
    let answered = match result {
        Ok(_) => true,
        Err(error) => {
            telemetry::adjustment_lost("settle", &error);
            false
        }
    };
    booking.receipt = place_only;
    (booking, answered)
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.answered {
            self.settle_dropped();
        }
        self.release();
    }
}
