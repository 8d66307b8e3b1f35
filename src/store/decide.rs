//! One decision in an in-process store: every policy's algorithm checked, then all
//! debited or none. The algorithms themselves (`crate::algorithm`) are pure math on one
//! state; this is where a policy set meets them.

use std::time::Duration;

use smallvec::SmallVec;

use crate::algorithm::{ANY_TIME, Params, Slot, Verdict};
use crate::decision::{Decision, Outcome, PolicyStatus};
use crate::policy::{MAX_LIMIT, Policy};
use crate::store::{Adjustment, Change};

/// Decides `cost` units against every policy, all-or-nothing.
///
/// `slots[i]` holds the state of `policies[i]`, then come the penalty slots of the
/// policies that have one, in order. A key a penalty blocks is answered from the block,
/// nothing spent. Otherwise every policy is checked before any is debited;
/// the request is debited from all of them only when all admit it. Returns the decision
/// and the instant from which every slot is fresh again.
#[inline]
pub(crate) fn decide(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
    cost: u64,
) -> (Decision, u64) {
    if let ([policy], [slot]) = (policies, &mut *slots) {
        // A penalty has a slot of its own, so one slot means none; checked anyway.
        if !policy.is_shadow()
            && policy.penalty_box().is_none()
            && let Some(decided) = decide_alone(policy, slot, now, cost)
        {
            return decided;
        }
    }
    decide_all(policies, slots, now, cost)
}

/// One enforced policy without a penalty, its state of its kind: the common request,
/// answered as [`decide_all`] answers it, by code that visits only its own algorithm.
#[inline]
fn decide_alone(policy: &Policy, slot: &mut Slot, now: u64, cost: u64) -> Option<(Decision, u64)> {
    let params = policy.params();
    let alone = params.decide_alone(slot, now, cost)?;
    let limit = params.limit();
    let outcome = match alone.verdict {
        Verdict::Admit { delay } => Outcome::Allowed {
            delay: Duration::from_nanos(delay),
        },
        Verdict::Deny { retry_after } => Outcome::Denied {
            policy: 0,
            retry_after: Duration::from_nanos(retry_after),
        },
        Verdict::Never => Outcome::CostExceedsLimit {
            policy: 0,
            cost,
            limit,
        },
    };
    let status = PolicyStatus {
        limit,
        remaining: alone.snapshot.remaining,
        reset: Duration::from_nanos(alone.snapshot.reset),
        effective_window: Duration::from_nanos(alone.effective_window),
    };
    // Built in place: a push would bring its growth path along.
    let statuses = SmallVec::from_buf_and_len([status; 2], 1);
    Some((
        Decision::decided(outcome, statuses, alone.at, 0),
        alone.snapshot.fresh_at,
    ))
}

/// [`decide`] for any set: several policies, shadow policies, penalties.
#[inline(never)]
fn decide_all(policies: &[Policy], slots: &mut [Slot], now: u64, cost: u64) -> (Decision, u64) {
    debug_assert!(slots.len() >= policies.len());
    let (slots, penalties) = slots.split_at_mut(policies.len());
    let now = floor(policies, slots, now);
    if !penalties.is_empty()
        && let Some(blocked) = blocked(policies, slots, penalties, now, cost)
    {
        return blocked;
    }
    let mut delay = 0;
    let mut denied: Option<(usize, u64)> = None;
    let mut never: Option<usize> = None;
    let mut shadow_denied = 0u64;
    for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = policy.params();
        params.refresh(slot, now);
        let verdict = params.check(slot, now, cost);
        if policy.is_shadow() {
            // Decided like any policy, but it never denies: what it would have done is
            // reported, and it is not debited when it would have denied.
            if !matches!(verdict, Verdict::Admit { .. }) && index < 64 {
                shadow_denied |= 1 << index;
            }
            continue;
        }
        match verdict {
            Verdict::Admit { delay: wait } => delay = delay.max(wait),
            Verdict::Deny { retry_after } => {
                // Report the policy that keeps the client waiting longest.
                if denied.is_none_or(|(_, longest)| retry_after > longest) {
                    denied = Some((index, retry_after));
                }
            }
            Verdict::Never => {
                never.get_or_insert(index);
            }
        }
    }
    let outcome = if let Some(policy) = never {
        Outcome::CostExceedsLimit {
            policy,
            cost,
            limit: policies[policy].limit(),
        }
    } else if let Some((policy, retry_after)) = denied {
        Outcome::Denied {
            policy,
            retry_after: Duration::from_nanos(retry_after),
        }
    } else {
        Outcome::Allowed {
            delay: Duration::from_nanos(delay),
        }
    };
    let admitted = matches!(outcome, Outcome::Allowed { .. });
    if admitted {
        for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
            if index >= 64 || shadow_denied & (1 << index) == 0 {
                policy.params().commit(slot, now, cost);
            }
        }
    }
    // A request that costs nothing (a peek) is no offence, and neither is one that can
    // never fit: it is refused for what it is, not counted toward a block it could never
    // wait out.
    if !penalties.is_empty() && denied.is_some() && never.is_none() && cost > 0 {
        // Each denial counts towards its policy's penalty; one may start a block, which
        // this answer already shows. A penalized policy's verdict is read again (nothing
        // was debited, so the check says what it said): denials are rare, penalties rarer,
        // and the common path keeps no record of which policy denied.
        let penalized = policies.iter().enumerate().filter_map(|(index, policy)| {
            policy.penalty_box().map(|(penalty, _)| (index, penalty))
        });
        for ((index, penalty), slot) in penalized.zip(penalties.iter_mut()) {
            let policy = &policies[index];
            let denied_here = !policy.is_shadow()
                && matches!(
                    policy.params().check(&slots[index], now, cost),
                    Verdict::Deny { .. }
                );
            if let (true, Slot::Penalty { state, .. }) = (denied_here, slot) {
                penalty.strike(state, now);
            }
        }
        if let Some(blocked) = blocked(policies, slots, penalties, now, cost) {
            return blocked;
        }
    }
    let (statuses, fresh_at) = statuses(policies, slots, now);
    let fresh_at = fresh_at.max(penalties_fresh_at(policies, penalties));
    // The receipt of the debit: its time on the store's line (the shadow policies not
    // debited are noted in it too).
    let decision = Decision::decided(outcome, statuses, now, shadow_denied);
    (decision, fresh_at)
}

/// Adjusts an admitted request's debit (see `Store::adjust`): settles the rate policies
/// from the reserved to the actual units, or frees the in-flight slots. Every policy's
/// status afterwards, and the time the key's state is fresh again.
///
/// `cleared` holds, in the set's order, when each policy's state was last reset or set
/// to a level (empty: never, as far as the store knows): a settle or an unbooking of a
/// debit made then or before changes nothing of that rate policy (the clear forgave it;
/// a refund would give back units spent since); a charge past the reservation still
/// applies (those units were never debited). The in-process store's alone: Redis has no
/// twin of it yet.
pub(crate) fn adjust(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
    adjustment: &Adjustment,
    cleared: &[Option<u64>],
) -> (Decision, u64) {
    debug_assert!(slots.len() >= policies.len());
    let (slots, penalties) = slots.split_at_mut(policies.len());
    let now = floor(policies, slots, now);
    let receipt = adjustment.receipt();
    let at = receipt.at();
    let forgiven = |index: usize| {
        cleared
            .get(index)
            .copied()
            .flatten()
            .is_some_and(|cleared| at <= cleared)
    };
    if let Change::Unbook { .. } = adjustment.change()
        && let Some(moved_on) = queue_moved_on(policies, slots, now, adjustment)
    {
        let (statuses, fresh_at) = adjusted_statuses(policies, slots, penalties, now);
        let outcome = Outcome::Denied {
            policy: moved_on,
            retry_after: Duration::ZERO,
        };
        return (Decision::with_statuses(outcome, statuses), fresh_at);
    }
    for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = policy.params();
        params.refresh(slot, now);
        if !receipt.debited(index) {
            // A shadow policy that would have denied was not debited: nothing to settle.
            continue;
        }
        let debit_left = adjustment.left_after_debit().get(index).copied();
        match adjustment.change() {
            Change::Release { cost } => {
                if params.is_in_flight() && cost > 0 {
                    params.refund(slot, now, 1, at, None);
                }
            }
            // The other changes are about rates: slots are taken and freed by requests.
            _ if params.is_in_flight() => {}
            Change::Settle { reserved, actual } => {
                // As Redis is sent them: a cost no policy admits is as good as any larger.
                let (reserved, actual) = (reserved.min(MAX_LIMIT + 1), actual.min(MAX_LIMIT + 1));
                if actual < reserved {
                    // Debited before a reset or a level set of this policy, which forgave
                    // it: nothing of it is left to give back. (What was used past the
                    // reservation was never debited, so never forgiven: charged below.)
                    if !forgiven(index) {
                        params.refund(slot, now, reserved - actual, at, debit_left);
                    }
                } else {
                    charge(params, slot, now, actual - reserved);
                }
            }
            Change::Grant { units } => params.refund(slot, now, units, ANY_TIME, None),
            // Its queue ends where the request's booking does (checked above): the
            // booking goes whole. The other policies give back what a settle to nothing
            // would.
            // A booking made before a reset or a level set was forgiven with it.
            Change::Unbook { .. } if forgiven(index) => {}
            Change::Unbook { cost } if params.is_shaping() => {
                params.refund(slot, now, cost.min(MAX_LIMIT + 1), ANY_TIME, None);
            }
            Change::Unbook { cost } => {
                params.refund(slot, now, cost.min(MAX_LIMIT + 1), at, debit_left);
            }
            Change::SetRemaining { remaining } => {
                let target = remaining.min(params.limit());
                let left = params.snapshot(slot, now).remaining;
                let owed = params.owed(slot, now);
                if target > left {
                    // What is owed is forgiven too: the level is set, not credited.
                    let back = (target + params.excess(slot, now)).saturating_sub(left);
                    params.refund(slot, now, back, ANY_TIME, None);
                } else if owed > 0 {
                    // Nothing left (owing), and nothing wanted: what is owed goes.
                    params.refund(slot, now, owed, ANY_TIME, None);
                } else {
                    charge(params, slot, now, left - target);
                }
            }
        }
    }
    let (statuses, fresh_at) = adjusted_statuses(policies, slots, penalties, now);
    let decision = Decision::with_statuses(
        Outcome::Allowed {
            delay: Duration::ZERO,
        },
        statuses,
    );
    (decision, fresh_at)
}

/// For an unbooking: the first shaping policy (debited by the request) whose queue no
/// longer ends where the request's booking did, a request queued behind it since; or,
/// when every such queue has drained (the booking's time has passed), the first of them.
/// A drained queue beside one still waiting is passed over: it holds nothing to give
/// back and no one behind (a slower policy's delay outlasts a faster one's queue). The
/// states are brought up to `now`; `None` when the booking can go.
fn queue_moved_on(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
    adjustment: &Adjustment,
) -> Option<usize> {
    let receipt = adjustment.receipt();
    let mut drained = None;
    let mut waiting = false;
    for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = policy.params();
        params.refresh(slot, now);
        if !receipt.debited(index) {
            continue;
        }
        let Some(end) = params.queue_end(slot) else {
            continue;
        };
        if end <= now {
            drained.get_or_insert(index);
        } else if adjustment.queue_ends().get(index) != Some(&end) {
            return Some(index);
        } else {
            waiting = true;
        }
    }
    drained.filter(|_| !waiting)
}

/// The answer to a key a penalty blocks: denied until its block ends, or until the
/// policies would admit `cost` (at least one unit: a peek is told when a request would
/// pass) if that is later, so a block never states a shorter wait than the denials it
/// stands for; by the policy keeping the client waiting longest (the first of equals,
/// as the script reports: the longest block, then each policy's longer wait in order).
/// The states are brought up to `now` (as a decision's are), nothing is spent. `None`
/// when no block stands, or when a policy can never admit `cost`: that request is told
/// so (no wait would let it through), as it would be without the block.
fn blocked(
    policies: &[Policy],
    slots: &mut [Slot],
    penalties: &[Slot],
    now: u64,
    cost: u64,
) -> Option<(Decision, u64)> {
    let blocks = blocks(policies, penalties, now);
    let (mut policy, mut retry_after) = blocks
        .iter()
        .copied()
        .reduce(|longest, block| if block.1 > longest.1 { block } else { longest })?;
    let block_left = retry_after;
    let mut fresh_at = penalties_fresh_at(policies, penalties);
    let mut statuses = SmallVec::new();
    for (index, (each, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = each.params();
        params.refresh(slot, now);
        let (mut status, fresh) = status_of(params, slot, now);
        fresh_at = fresh_at.max(fresh);
        if let Some(&(_, left)) = blocks.iter().find(|(blocked, _)| *blocked == index) {
            block_status(&mut status, left);
        }
        if !each.is_shadow() {
            match params.check(slot, now, cost.max(1)) {
                Verdict::Deny { retry_after: wait } if wait > retry_after => {
                    (policy, retry_after) = (index, wait);
                }
                Verdict::Never => return None,
                _ => {}
            }
        }
        statuses.push(status);
    }
    let outcome = Outcome::Denied {
        policy,
        retry_after: Duration::from_nanos(retry_after),
    };
    Some((
        Decision::with_statuses(outcome, statuses).with_block(Duration::from_nanos(block_left)),
        fresh_at,
    ))
}

/// The blocks standing now: each blocked policy's index and the nanoseconds its block
/// has left.
fn blocks(policies: &[Policy], penalties: &[Slot], now: u64) -> SmallVec<[(usize, u64); 2]> {
    let mut blocks = SmallVec::new();
    if penalties.is_empty() {
        return blocks;
    }
    let penalized = policies
        .iter()
        .enumerate()
        .filter_map(|(index, policy)| policy.penalty_box().map(|(penalty, _)| (index, penalty)));
    for ((index, penalty), slot) in penalized.zip(penalties) {
        if let Slot::Penalty { state, .. } = slot
            && let Some(left) = penalty.blocked(state, now)
        {
            blocks.push((index, left));
        }
    }
    blocks
}

/// A blocked policy's status: nothing left, and restored no sooner than the block ends
/// (`left` nanoseconds from now).
fn block_status(status: &mut PolicyStatus, left: u64) {
    let left = Duration::from_nanos(left);
    status.remaining = 0;
    status.reset = status.reset.max(left);
    status.effective_window = status.effective_window.max(left);
}

/// Every policy's status now, blocked policies told their block, and the time the key's
/// state is fresh again, the penalties' included: what an adjustment answers.
fn adjusted_statuses(
    policies: &[Policy],
    slots: &mut [Slot],
    penalties: &[Slot],
    now: u64,
) -> (SmallVec<[PolicyStatus; 2]>, u64) {
    let (mut statuses, fresh_at) = statuses(policies, slots, now);
    for (index, left) in blocks(policies, penalties, now) {
        block_status(&mut statuses[index], left);
    }
    (
        statuses,
        fresh_at.max(penalties_fresh_at(policies, penalties)),
    )
}

/// When every penalty state is fresh again.
#[inline]
fn penalties_fresh_at(policies: &[Policy], penalties: &[Slot]) -> u64 {
    if penalties.is_empty() {
        return 0;
    }
    let penalized = policies
        .iter()
        .filter_map(|policy| policy.penalty_box().map(|(penalty, _)| penalty));
    penalized
        .zip(penalties)
        .map(|(penalty, slot)| match slot {
            Slot::Penalty { state, .. } => penalty.fresh_at(state),
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

/// When each slot of `policies` is fresh again (then each penalty slot's, in the order
/// `MemoryStore` keeps them), into `fresh`: a store that keeps several policies' states
/// for an identity forgets each once it is, not when the last of the set is.
#[inline(never)]
pub(crate) fn fresh_each(policies: &[Policy], slots: &[Slot], now: u64, fresh: &mut [u64]) {
    let (slots, penalties) = slots.split_at(policies.len());
    let now = floor(policies, slots, now);
    for ((policy, slot), fresh) in policies.iter().zip(slots).zip(fresh.iter_mut()) {
        *fresh = policy.params().snapshot(slot, now).fresh_at;
    }
    let penalized = policies
        .iter()
        .filter_map(|policy| policy.penalty_box().map(|(penalty, _)| penalty));
    for ((penalty, slot), fresh) in penalized
        .zip(penalties)
        .zip(fresh[policies.len()..].iter_mut())
    {
        if let Slot::Penalty { state, .. } = slot {
            *fresh = penalty.fresh_at(state);
        }
    }
}

/// `now`, or the latest of the times the slots can be read at when `now` is earlier
/// (see [`Params::floor`]): a key's time never steps back.
fn floor(policies: &[Policy], slots: &[Slot], now: u64) -> u64 {
    policies
        .iter()
        .zip(slots)
        .fold(now, |now, (policy, slot)| policy.params().floor(slot, now))
}

/// Debits `units` more, past empty if need be: what a request used beyond what was left
/// is owed, and the identity waits until a bucket has refilled it or a window has
/// forgotten it (charging only as far as there was room made a post-paid cost free once
/// the quota was spent). One call owes at most one whole quota more, so one absurd
/// reported cost costs one quota's wait; calls add up (settles of requests that were in
/// flight together each owe their own), to at most [`MAX_OWED_QUOTAS`] quotas owed and
/// never past `MAX_LIMIT` units, where a Redis count is still exact.
fn charge(params: &Params, slot: &mut Slot, now: u64, units: u64) {
    let limit = params.limit();
    let left = params.snapshot(slot, now).remaining;
    let bound = limit.saturating_mul(MAX_OWED_QUOTAS).min(MAX_LIMIT);
    let room = limit.min(bound.saturating_sub(params.owed(slot, now)));
    let extra = units.min(left.saturating_add(room));
    if extra > 0 {
        params.commit(slot, now, extra);
    }
}

/// The most quotas an identity owes, however many settles past empty land (see `charge`):
/// a thousand windows' (or refills') wait at most.
pub(crate) const MAX_OWED_QUOTAS: u64 = 1_000;

/// One policy's status now, and when its state is fresh again.
#[inline]
fn status_of(params: &Params, slot: &Slot, now: u64) -> (PolicyStatus, u64) {
    let snapshot = params.snapshot(slot, now);
    let status = PolicyStatus {
        limit: params.limit(),
        remaining: snapshot.remaining,
        reset: Duration::from_nanos(snapshot.reset),
        effective_window: Duration::from_nanos(params.effective_window(
            slot,
            now,
            snapshot.remaining,
        )),
    };
    (status, snapshot.fresh_at)
}

/// Every policy's status now, and the time the key's state is fresh again.
#[inline]
fn statuses(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
) -> (SmallVec<[PolicyStatus; 2]>, u64) {
    let mut fresh_at = 0;
    let mut statuses = SmallVec::new();
    for (policy, slot) in policies.iter().zip(slots.iter_mut()) {
        let (status, fresh) = status_of(policy.params(), slot, now);
        fresh_at = fresh_at.max(fresh);
        statuses.push(status);
    }
    (statuses, fresh_at)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::Rate;

    /// One policy of every algorithm (both sliding-window state kinds, both leaky buckets),
    /// of `limit` units over `seconds`.
    fn every_algorithm(limit: u64, seconds: u64) -> Vec<Policy> {
        let window = Duration::from_secs(seconds);
        let rate = Rate::new(limit, window);
        vec![
            Policy::fixed_window("fw", limit, window).unwrap(),
            Policy::sliding_log("sl", limit, window).unwrap(),
            Policy::sliding_window("sw", limit, window).unwrap(),
            Policy::sliding_window_split("ring", limit, window, 4).unwrap(),
            Policy::token_bucket("tb", limit, rate).unwrap(),
            Policy::leaky_bucket("lp", limit, rate).unwrap(),
            Policy::leaky_bucket_shaping("ls", rate, window).unwrap(),
            Policy::gcra("gc", rate, limit).unwrap(),
            Policy::concurrency("if", limit).unwrap(),
        ]
    }

    /// What a step of the run does to both copies.
    #[derive(Debug, Clone)]
    enum Step {
        /// Decides `cost` units `gap` nanoseconds after the last step (time may go back).
        Decide { gap: i64, cost: u64 },
        /// Settles the last admitted request's units to `actual`.
        Settle { actual: u64 },
        /// Frees the last admitted request's units (in-flight slots).
        Release,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (-50_000_000i64..400_000_000, 0u64..8)
                .prop_map(|(gap, cost)| Step::Decide { gap, cost }),
            1 => (any::<i64>(), prop_oneof![Just(u64::MAX), Just(u64::MAX / 2), 1_000u64..1_000_000])
                .prop_map(|(gap, cost)| Step::Decide { gap: gap >> 4, cost }),
            1 => (0u64..8).prop_map(|actual| Step::Settle { actual }),
            1 => Just(Step::Release),
        ]
    }

    proptest! {
        /// The one-policy path answers as the general one does and leaves the same state:
        /// every algorithm, any limit and window, through any run of requests (time going
        /// back and leaping ahead, costs that never fit, settles and releases between
        /// them), each step the same decision, statuses, receipt and freshness.
        #[test]
        fn one_policy_path_is_the_general_path(
            limit in 1u64..50,
            seconds in 1u64..120,
            steps in proptest::collection::vec(step(), 1..60),
        ) {
            for policy in every_algorithm(limit, seconds) {
                let mut fast = [policy.params().new_slot(policy.id())];
                let mut general = fast.clone();
                let set = [policy.clone()];
                let mut now: u64 = 1 << 40;
                let mut last: Option<(u64, Decision)> = None;
                for step in &steps {
                    match *step {
                        Step::Decide { gap, cost } => {
                            now = now.saturating_add_signed(gap);
                            let quick = decide(&set, &mut fast, now, cost);
                            let slow = decide_all(&set, &mut general, now, cost);
                            prop_assert_eq!(&quick, &slow, "{} at {} cost {}", policy.name(), now, cost);
                            if quick.0.is_allowed() {
                                last = Some((cost, quick.0));
                            }
                        }
                        Step::Settle { .. } | Step::Release if last.is_some() => {
                            let (cost, decision) = last.take().unwrap();
                            let adjustment = match *step {
                                Step::Settle { actual } => {
                                    Adjustment::settle(cost, actual, decision.receipt())
                                }
                                _ => Adjustment::release(cost, decision.receipt()),
                            };
                            let quick = adjust(&set, &mut fast, now, &adjustment, &[]);
                            let slow = adjust(&set, &mut general, now, &adjustment, &[]);
                            prop_assert_eq!(quick, slow);
                        }
                        _ => {}
                    }
                    prop_assert_eq!(&fast, &general, "{}", policy.name());
                }
            }
        }
    }

    /// A request that read the clock before another but reached the key's state after
    /// it sees time step back. Its debit is still given back by its settle, and a denial
    /// still waits for the end of the window the state counts in, on both paths.
    #[test]
    fn time_stepping_back_keeps_refunds_and_waits() {
        let second = 1_000_000_000u64;
        let log = Policy::sliding_log("sl", 10, Duration::from_secs(60)).unwrap();
        let window = Policy::fixed_window("fw", 1, Duration::from_secs(60)).unwrap();
        for alone in [true, false] {
            let run = |policy: &Policy, slots: &mut [Slot], now: u64, cost: u64| {
                let set = [policy.clone()];
                if alone {
                    decide(&set, slots, now, cost).0
                } else {
                    decide_all(&set, slots, now, cost).0
                }
            };
            // The sliding log: 1 unit at 1,000 s, then 5 reserved by a request that read
            // 999.999 s; it uses none of them.
            let mut slots = [log.params().new_slot(log.id())];
            assert!(run(&log, &mut slots, 1_000 * second, 1).is_allowed());
            let late = run(&log, &mut slots, 1_000 * second - 1_000_000, 5);
            assert!(late.is_allowed());
            let settle = Adjustment::settle(5, 0, late.receipt());
            let after = adjust(
                std::slice::from_ref(&log),
                &mut slots,
                1_001 * second,
                &settle,
                &[],
            );
            assert_eq!(
                after.0.statuses()[0].remaining,
                9,
                "the 5 units given back (alone: {alone})"
            );
            // The fixed window: full in the window from 60 s; a request that read
            // 59.9995 s is denied until that window ends, not for half a millisecond.
            let mut slots = [window.params().new_slot(window.id())];
            assert!(run(&window, &mut slots, 60 * second, 1).is_allowed());
            let denied = run(&window, &mut slots, 60 * second - 500_000, 1);
            match denied.outcome() {
                Outcome::Denied { retry_after, .. } => assert!(
                    retry_after >= Duration::from_secs(59),
                    "told to retry after {retry_after:?} (alone: {alone})"
                ),
                other => panic!("{other:?}"),
            }
        }
    }

    /// Every slot of the wrong kind (another algorithm's, a counter of another number of
    /// sub-windows, a penalty's) is left untouched by the one-policy path and replaced by
    /// the general one, so `decide` still answers as `decide_all`; a slot of the right
    /// kind is always decided by the one-policy path (it is the common request's).
    #[test]
    fn the_one_policy_path_takes_exactly_the_slots_that_fit() {
        let policies = every_algorithm(5, 1);
        let mut slots: Vec<Slot> = policies
            .iter()
            .map(|policy| policy.params().new_slot(7))
            .collect();
        slots.push(
            Policy::sliding_window_split("ring", 5, Duration::from_secs(1), 2)
                .unwrap()
                .params()
                .new_slot(7),
        );
        slots.push(Slot::Penalty {
            id: 7,
            state: Box::default(),
        });
        // Which slot fits which policy: its own kind only (the three buckets share one),
        // and a counter only with its own number of counts.
        let kinds = [
            "fw", "sl", "sw", "ring", "tb", "lp", "ls", "gc", "if", "ring2", "penalty",
        ];
        for policy in &policies {
            let fitting: Vec<&str> = slots
                .iter()
                .zip(kinds)
                .filter(|(slot, _)| policy.params().fits(slot))
                .map(|(_, kind)| kind)
                .collect();
            let expected: &[&str] = match policy.name() {
                "tb" | "lp" | "ls" => &["tb", "lp", "ls"],
                own => &[own][..],
            };
            assert_eq!(fitting, expected, "{}", policy.name());
        }
        for policy in &policies {
            let params = policy.params();
            let mut taken = 0;
            for slot in &slots {
                let mut alone = slot.clone();
                let answer = params.decide_alone(&mut alone, 1_000, 1);
                assert_eq!(
                    answer.is_some(),
                    params.fits(slot),
                    "{} on {slot:?}",
                    policy.name()
                );
                if answer.is_none() {
                    assert_eq!(
                        &alone,
                        slot,
                        "{}: a slot that does not fit is untouched",
                        policy.name()
                    );
                } else {
                    taken += 1;
                }
                let set = std::slice::from_ref(policy);
                let (mut quick, mut slow) = ([slot.clone()], [slot.clone()]);
                assert_eq!(
                    decide(set, &mut quick, 1_000, 1),
                    decide_all(set, &mut slow, 1_000, 1),
                    "{} on {slot:?}",
                    policy.name()
                );
                assert_eq!(quick, slow);
                assert!(
                    params.fits(&quick[0]),
                    "{}: replaced by a slot that fits",
                    policy.name()
                );
            }
            // Its own fresh slot, and (for both leaky buckets and the token bucket) the
            // other bucket kinds' slots, which are the same state.
            assert!(
                taken >= 1,
                "{}: the one-policy path is taken",
                policy.name()
            );
        }
    }

    /// A shadow policy alone goes the general way: it never denies, and is not debited
    /// when it would have denied.
    #[test]
    fn a_shadow_policy_alone_is_decided_by_the_general_path() {
        let shadow = Policy::token_bucket("x", 5, Rate::per_second(1))
            .unwrap()
            .shadow();
        let set = std::slice::from_ref(&shadow);
        let mut quick = [shadow.params().new_slot(shadow.id())];
        let mut slow = quick.clone();
        for cost in [3, 3, 6, 1] {
            let decision = decide(set, &mut quick, 1, cost);
            assert!(decision.0.is_allowed(), "a shadow policy never denies");
            assert_eq!(decision, decide_all(set, &mut slow, 1, cost));
            assert_eq!(quick, slow);
        }
    }
}
