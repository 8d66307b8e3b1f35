//! Test support: an in-process store whose answers are held, as a store doing I/O holds
//! them on the way back (a pool, a Cluster, a task scheduled late).

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::{Adjustment, DecideFuture, MemoryStore, ResetFuture, Store};
use crate::clock::ManualClock;
use crate::key::Key;
use crate::policy::PolicySet;

/// Decides at once in `inner` and answers when `answers` lets it (one permit per answer);
/// resets land when `resets` lets them, adjustments when `adjusts` does (at once, unless
/// made to wait with [`Held::holding_adjustments`]).
#[derive(Clone)]
pub(crate) struct Held {
    pub(crate) inner: MemoryStore<ManualClock>,
    pub(crate) answers: Arc<Semaphore>,
    pub(crate) resets: Arc<Semaphore>,
    pub(crate) adjusts: Arc<Semaphore>,
}

impl Held {
    /// A store on `clock` letting `answers` answers and `resets` resets pass at first.
    pub(crate) fn new(clock: &ManualClock, answers: usize, resets: usize) -> Self {
        Self {
            inner: MemoryStore::builder().clock(clock.clone()).build(),
            answers: Arc::new(Semaphore::new(answers)),
            resets: Arc::new(Semaphore::new(resets)),
            adjusts: Arc::new(Semaphore::new(Semaphore::MAX_PERMITS)),
        }
    }

    /// This store, its adjustments landing only when `adjusts` lets them.
    pub(crate) fn holding_adjustments(mut self) -> Self {
        self.adjusts = Arc::new(Semaphore::new(0));
        self
    }
}

impl Store for Held {
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let decision = self.inner.check(key.as_str(), policies, cost);
        let answers = Arc::clone(&self.answers);
        DecideFuture::new(async move {
            answers.acquire().await.expect("open").forget();
            Ok(decision)
        })
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        let (inner, adjusts) = (self.inner.clone(), Arc::clone(&self.adjusts));
        let (key, policies, adjustment) = (key.clone(), policies.clone(), adjustment.clone());
        DecideFuture::new(async move {
            adjusts.acquire().await.expect("open").forget();
            inner.adjust(&key, &policies, &adjustment).await
        })
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        let (inner, resets) = (self.inner.clone(), Arc::clone(&self.resets));
        let (key, policies) = (key.clone(), policies.clone());
        Box::pin(async move {
            resets.acquire().await.expect("open").forget();
            inner.reset(&key, &policies).await
        })
    }
}
