//! Coalescing: while one decision for an identity (under one policy set) is on its way to
//! Redis, the decisions that arrive for the same identity wait, and go together as one
//! script call when it is back. The script decides them one after another in arrival
//! order, exactly as separate calls would have, and answers each. A hot key then costs
//! Redis one call per round trip instead of one per request (Bucket4j calls this
//! batching).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::{Backend, Call, Invocation, Scripts, invoke, parse_reply};
use crate::decision::Decision;
use crate::store::{StoreError, StoreErrorKind};

/// The most decisions one batch carries; more wait for the next.
const MAX_BATCH: usize = 128;

/// The most decisions that wait behind one identity's call; beyond it (a Redis that hangs
/// under a flood) a decision goes on its own.
const MAX_QUEUE: usize = 2 * MAX_BATCH;

/// Shards of the table of identities with a call in flight.
const SHARDS: usize = 16;

/// A call's keys and policy arguments ([`Invocation::call_id`]).
type Id = String;
type Answer = Result<Decision, StoreError>;
/// One shard: the identities with a call in flight, each with what queues behind it.
type Shard = Mutex<HashMap<Id, Queue>>;

/// What queues behind one leader's call, and which leader that is: a leader's drain
/// (or its failure) takes only from its own queue, never from the next leader's of the
/// same identity, which may have joined the moment the identity was free again.
struct Queue {
    leader: u64,
    waiters: Vec<Waiter>,
}

struct Waiter {
    cost: u64,
    answer: oneshot::Sender<Answer>,
}

/// The identities with a call in flight, each with the decisions queued behind it.
pub(super) struct Coalescer {
    shards: Box<[Shard]>,
    /// The next leader's number.
    leaders: AtomicU64,
}

/// What [`Coalescer::join`] made of a decision.
pub(super) enum Joined {
    /// No call in flight for the identity: this decision goes now, and hands what queues
    /// behind it to a batch when it is back (or dropped).
    Leader(Lead),
    /// Queued behind the call in flight: the answer comes through here.
    Follower(oneshot::Receiver<Answer>),
    /// The queue is full: this decision goes on its own.
    Alone,
}

impl Coalescer {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            leaders: AtomicU64::new(0),
        }
    }

    fn shard(&self, id: &Id) -> std::sync::MutexGuard<'_, HashMap<Id, Queue>> {
        use std::hash::BuildHasher;
        let hash = foldhash::fast::FixedState::default().hash_one(id);
        let shard = &self.shards[(hash as usize) % SHARDS];
        shard
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Leads the call `id`, or queues behind the one in flight.
    pub(super) fn join(self: &Arc<Self>, id: String, cost: u64) -> Joined {
        let mut shard = self.shard(&id);
        if let Some(queue) = shard.get_mut(&id) {
            let waiters = &mut queue.waiters;
            if waiters.len() >= MAX_QUEUE {
                // Requests that timed out while they waited leave room.
                waiters.retain(|waiter| !waiter.answer.is_closed());
                if waiters.len() >= MAX_QUEUE {
                    return Joined::Alone;
                }
            }
            let (answer, receiver) = oneshot::channel();
            waiters.push(Waiter { cost, answer });
            return Joined::Follower(receiver);
        }
        let leader = self.leaders.fetch_add(1, Ordering::Relaxed);
        shard.insert(
            id.clone(),
            Queue {
                leader,
                waiters: Vec::new(),
            },
        );
        drop(shard);
        Joined::Leader(Lead {
            coalescer: Arc::clone(self),
            id: Some(id),
            leader,
            batch: None,
        })
    }

    /// The next batch queued behind `leader`'s call for `id`, or `None` (and `id` has no
    /// call in flight any more) when nothing queued. `None` too, touching nothing, when
    /// `id` is another leader's now.
    fn next_batch(&self, id: &Id, leader: u64) -> Option<Vec<Waiter>> {
        let mut shard = self.shard(id);
        let queue = shard.get_mut(id).filter(|queue| queue.leader == leader)?;
        // Waiters whose request is gone are not decided (nor debited).
        queue.waiters.retain(|waiter| !waiter.answer.is_closed());
        if queue.waiters.is_empty() {
            shard.remove(id);
            return None;
        }
        let take = queue.waiters.len().min(MAX_BATCH);
        Some(queue.waiters.drain(..take).collect())
    }
}

/// What a batch call needs: where to send it, and the leader's keys and policy arguments.
pub(super) struct Batch {
    pub(super) backend: Backend,
    pub(super) scripts: Arc<Scripts>,
    pub(super) invocation: Arc<Invocation>,
    /// The test clock the store was given: a batch reads it when it leaves, as a
    /// decision of its own would (Redis `TIME` otherwise).
    #[cfg(feature = "__test-clock")]
    pub(super) clock: Option<Arc<dyn crate::clock::Clock>>,
}

/// The leader's duty: when its call is back (or it is dropped), what queued behind it goes
/// to Redis as batches, in a task of its own, until nothing is queued.
pub(super) struct Lead {
    coalescer: Arc<Coalescer>,
    id: Option<Id>,
    /// This leader's number: what queues behind it is its own.
    leader: u64,
    batch: Option<Batch>,
}

impl Lead {
    /// Sets what the batches need (the leader's own invocation, less its cost).
    pub(super) fn prepare(&mut self, batch: Batch) {
        self.batch = Some(batch);
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let coalescer = Arc::clone(&self.coalescer);
        let Some(batch) = self.batch.take() else {
            // Nothing to send with: the queued decisions fail (a store error, which the
            // failure mode answers), and the identity is free again.
            fail_all(
                &coalescer,
                &id,
                self.leader,
                "the decision leading a batch could not be sent",
            );
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // Nothing queued: done here, no task.
                let Some(first) = coalescer.next_batch(&id, self.leader) else {
                    return;
                };
                let draining = Draining {
                    coalescer: Arc::clone(&coalescer),
                    id: id.clone(),
                    leader: self.leader,
                };
                runtime.spawn(drain(draining, batch, first));
            }
            Err(_) => fail_all(
                &coalescer,
                &id,
                self.leader,
                "no Tokio runtime to send a batch on",
            ),
        }
    }
}

/// Fails what queues behind `leader`'s call for `id` (nothing once the identity is free,
/// or another leader's).
fn fail_all(coalescer: &Coalescer, id: &Id, leader: u64, message: &str) {
    while let Some(waiters) = coalescer.next_batch(id, leader) {
        for waiter in waiters {
            let _ = waiter
                .answer
                .send(Err(StoreError::new(StoreErrorKind::Other, message)));
        }
    }
}

/// The longest a batch may wait for Redis: the requests that queued for it are gone by
/// then (the layer's timeout), but the identity's queue must not wait on a call that never
/// answers (a frozen node) for later requests.
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// A drain's hold on its identity: however the task ends (done, dropped before it ran,
/// a panic, the runtime shutting down), what is still queued fails and the identity is
/// free again.
struct Draining {
    coalescer: Arc<Coalescer>,
    id: Id,
    leader: u64,
}

impl Drop for Draining {
    fn drop(&mut self) {
        fail_all(
            &self.coalescer,
            &self.id,
            self.leader,
            "the batch for this decision was not sent",
        );
    }
}

/// Sends batches for an identity until nothing is queued behind them.
async fn drain(draining: Draining, batch: Batch, first: Vec<Waiter>) {
    let mut waiters = Some(first);
    while let Some(current) = waiters
        .take()
        .or_else(|| draining.coalescer.next_batch(&draining.id, draining.leader))
    {
        send(&batch, current).await;
    }
}

/// One script call for `waiters`, in their order; each gets its own answer.
async fn send(batch: &Batch, waiters: Vec<Waiter>) {
    let invocation = &batch.invocation;
    let mut args = invocation.args.clone();
    #[cfg(feature = "__test-clock")]
    if let Some(clock) = &batch.clock {
        args[0] = (clock.now() / 1_000).to_string();
    }
    args.push(waiters.len().to_string());
    args.extend(
        waiters
            .iter()
            .map(|waiter| waiter.cost.min(crate::policy::MAX_LIMIT + 1).to_string()),
    );
    let call = Invocation {
        keys: invocation.keys.clone(),
        args,
        count: invocation.count,
        single_kind: invocation.single_kind,
        shape: invocation.shape,
    };
    let answered = tokio::time::timeout(
        DEADLINE,
        invoke(&batch.backend, &batch.scripts, Call::Batch, &call),
    )
    .await
    .unwrap_or_else(|_| {
        Err(StoreError::new(
            StoreErrorKind::Timeout,
            format!("the batch got no answer within {DEADLINE:?}"),
        ))
    });
    match answered {
        Ok(reply) => {
            let costs: Vec<u64> = waiters.iter().map(|waiter| waiter.cost).collect();
            let answers = answers(&reply, &costs, call.shape, call.count);
            for (waiter, answer) in waiters.into_iter().zip(answers) {
                let _ = waiter.answer.send(answer);
            }
        }
        Err(error) => {
            for waiter in waiters {
                let _ = waiter.answer.send(Err(error.for_another()));
            }
        }
    }
}

/// Each decision's answer in a batch's `reply` (each one's length, then its own reply),
/// for decisions of `costs`, in order. A reply that holds fewer answers, or more, than it
/// was sent decisions is no answer to this batch (a script of another layout): every
/// decision fails with a protocol error, none is read from it.
fn answers(reply: &[i64], costs: &[u64], shape: super::Shape, count: usize) -> Vec<Answer> {
    let mut rest = reply;
    let mut own = Vec::with_capacity(costs.len());
    for _ in costs {
        match rest.split_first() {
            Some((&len, tail)) if usize::try_from(len).is_ok_and(|len| len <= tail.len()) => {
                let (answer, tail) = tail.split_at(len as usize);
                own.push(answer);
                rest = tail;
            }
            _ => break,
        }
    }
    if own.len() < costs.len() || !rest.is_empty() {
        let error = StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "the batch script answered other than the {} decisions it was sent",
                costs.len()
            ),
        );
        return costs.iter().map(|_| Err(error.for_another())).collect();
    }
    own.into_iter()
        .zip(costs)
        .map(|(answer, &cost)| parse_reply(answer, shape, count, cost, 0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch's reply holding answers past its last decision (or short of it) is no
    /// answer to it: the decisions read from it were read as another layout's (a script
    /// of another version), and one past the last went unseen.
    #[test]
    fn a_batch_reply_of_more_or_fewer_answers_is_refused() {
        // One plain policy's full answer: outcome, policy, wait, delay; limit, remaining,
        // reset, effective window; the time.
        let one = [0, 0, 0, 0, 10, 9, 60_000_000, 60_000_000, 1];
        let entry = |answer: &[i64]| {
            let mut entry = vec![answer.len() as i64];
            entry.extend_from_slice(answer);
            entry
        };
        let two: Vec<i64> = [entry(&one), entry(&one)].concat();
        let read = answers(&two, &[1, 1], super::super::Shape::Full, 1);
        assert!(read.iter().all(Result::is_ok), "{read:?}");
        for reply in [[two.clone(), entry(&one)].concat(), entry(&one)] {
            let read = answers(&reply, &[1, 1], super::super::Shape::Full, 1);
            assert_eq!(read.len(), 2);
            assert!(
                read.iter().all(|answer| answer
                    .as_ref()
                    .is_err_and(|error| error.kind() == StoreErrorKind::Protocol)),
                "{read:?}"
            );
        }
    }

    /// A drain that ends (nothing queued: the identity is free) must not fail what queues
    /// behind the next leader of that identity, which may have joined before the drain's
    /// task let go of its hold.
    #[test]
    fn a_finished_drain_leaves_the_next_leaders_queue_alone() {
        let coalescer = Arc::new(Coalescer::new());
        let id = "burst".to_owned();
        let Joined::Leader(first) = coalescer.join(id.clone(), 1) else {
            panic!("the first decision leads");
        };
        let draining = Draining {
            coalescer: Arc::clone(&coalescer),
            id: id.clone(),
            leader: first.leader,
        };
        // The drain's last look: nothing queued, the identity is free again.
        assert!(coalescer.next_batch(&id, first.leader).is_none());
        // Before the drain's task lets go, a new leader and a follower behind it.
        let Joined::Leader(second) = coalescer.join(id.clone(), 1) else {
            panic!("the identity was free: the next decision leads");
        };
        let Joined::Follower(mut answer) = coalescer.join(id.clone(), 1) else {
            panic!("queued behind the new leader");
        };
        drop(draining);
        assert!(
            matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the new leader's follower was answered by the old drain"
        );
        // Nor does a leader number that is not the queue's (a guard against a later change
        // that would let one leader's hold reach another's queue).
        drop(first);
        assert!(
            matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the new leader's follower was answered by the first leader"
        );
        drop(second);
        assert!(
            matches!(answer.try_recv(), Ok(Err(_))),
            "the new leader, dropped without a batch, fails its own follower"
        );
        // And the identity is free again: nothing is left registered.
        assert!(matches!(coalescer.join(id, 1), Joined::Leader(_)));
    }
}
