//! One decision in an in-process store: every policy's algorithm checked, then all
//! debited or none. The algorithms themselves (`crate::algorithm`) are pure math on one
//! state; this is where a policy set meets them.

use std::time::Duration;

use smallvec::SmallVec;

use crate::algorithm::{Slot, Verdict};
use crate::decision::{Decision, Outcome, PolicyStatus};
use crate::policy::Policy;

/// Decides `cost` units against every policy, all-or-nothing.
///
/// `slots[i]` holds the state of `policies[i]`. Every policy is checked before any is
/// debited; the request is debited from all of them only when all admit it. Returns the
/// decision and the instant from which every slot is fresh again.
#[inline]
pub(crate) fn decide(
    policies: &[Policy],
    slots: &mut [Slot],
    now: u64,
    cost: u64,
) -> (Decision, u64) {
    debug_assert_eq!(policies.len(), slots.len());
    let mut delay = 0;
    let mut denied: Option<(usize, u64)> = None;
    let mut never: Option<usize> = None;
    for (index, (policy, slot)) in policies.iter().zip(slots.iter_mut()).enumerate() {
        let params = policy.params();
        params.refresh(slot, now);
        match params.check(slot, now, cost) {
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
    let mut fresh_at = 0;
    let mut statuses = SmallVec::new();
    for (policy, slot) in policies.iter().zip(slots.iter_mut()) {
        let params = policy.params();
        if admitted {
            params.commit(slot, now, cost);
        }
        let snapshot = params.snapshot(slot, now);
        fresh_at = fresh_at.max(snapshot.fresh_at);
        statuses.push(PolicyStatus {
            limit: params.limit(),
            remaining: snapshot.remaining,
            reset: Duration::from_nanos(snapshot.reset),
            effective_window: Duration::from_nanos(params.effective_window(
                slot,
                now,
                snapshot.remaining,
            )),
        });
    }
    (Decision::with_statuses(outcome, statuses), fresh_at)
}
