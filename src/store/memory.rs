//! The in-process store: sharded hash tables behind short mutexes, bounded in size.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use compact_str::CompactString;
use hashbrown::HashTable;

use super::{DecideFuture, Store};
use crate::algorithm::Slot;
use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::key::Key;
use crate::policy::PolicySet;

/// The default bound on the number of identities a [`MemoryStore`] keeps.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The in-process store, the embedded default: no server, exact, bounded memory.
///
/// State lives in hash tables split into shards, each behind its own mutex, so requests
/// for different identities rarely wait for each other and one request for one identity
/// is decided under one short lock (that is what makes it exact under concurrency). Every
/// identity's policies live in one entry, so several policies are decided together.
///
/// Memory is bounded: at most `max_keys` identities (default 1,000,000). An identity under
/// one policy is one 64-byte table entry, its key inline up to 24 bytes; the table's
/// spare capacity comes on top (the README's benchmark gives the resident memory measured
/// per identity). When a shard is full it
/// first forgets every identity whose state is back to fresh (forgetting those changes no
/// decision); if that frees too little it forgets the identities closest to fresh, and
/// counts them in [`MemoryStore::evicted_live`]. An attacker rotating identities therefore
/// cannot grow the store, and at worst resets the state of the identities that were about
/// to be fresh anyway.
///
/// Local only: N replicas each with a `MemoryStore` admit N times the limit. Use a shared
/// store for a fleet.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::{MemoryStore, Policy, PolicySet};
///
/// let clock = ManualClock::new();
/// let store = MemoryStore::builder().clock(clock.clone()).max_keys(10_000).build();
/// let policies = PolicySet::from(Policy::fixed_window("api", 2, Duration::from_secs(1))?);
/// assert!(store.check("k", &policies, 1).is_allowed());
/// assert!(store.check("k", &policies, 1).is_allowed());
/// assert!(!store.check("k", &policies, 1).is_allowed());
/// clock.advance(Duration::from_secs(1));
/// assert!(store.check("k", &policies, 1).is_allowed());
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
pub struct MemoryStore<C: Clock = MonotonicClock> {
    shared: Arc<Shared<C>>,
}

impl<C: Clock> Clone for MemoryStore<C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<C: Clock> std::fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shared.shards.len())
            .field("max_keys", &self.capacity())
            .finish()
    }
}

struct Shared<C> {
    shards: Box<[Shard]>,
    shard_mask: usize,
    shard_capacity: usize,
    hasher: foldhash::fast::RandomState,
    clock: C,
    evicted_live: AtomicU64,
}

/// One shard, on its own cache lines so that two cores locking neighbours do not
/// fight over one line.
#[repr(align(128))]
struct Shard {
    table: Mutex<HashTable<Entry>>,
}

/// One identity: 64 bytes, aligned so every lookup touches one cache line.
#[repr(align(64))]
struct Entry {
    /// Short keys (up to 24 bytes) are stored inline: one pointer chase less per lookup.
    key: CompactString,
    /// When every slot is fresh again; from then on the entry can be forgotten.
    fresh_at: u64,
    slots: Slots,
}

/// An identity's policy states: one inline (the common case; the whole entry is then one
/// cache line), several on the heap.
enum Slots {
    One(Slot),
    Many(Vec<Slot>),
}

impl Slots {
    fn new(policies: &PolicySet) -> Self {
        match &**policies {
            [policy] => Slots::One(policy.params().new_slot(policy.id())),
            _ => Slots::Many(Vec::with_capacity(policies.len())),
        }
    }

    /// The slots of `policies`, in their order, adding fresh ones where missing.
    #[inline]
    fn arrange(&mut self, policies: &PolicySet) -> &mut [Slot] {
        let single = matches!(
            (&*self, &**policies),
            (Slots::One(slot), [policy]) if slot.id() == policy.id()
        );
        if single {
            let Slots::One(slot) = self else {
                unreachable!("checked above")
            };
            return std::slice::from_mut(slot);
        }
        if let Slots::One(_) = self {
            let Slots::One(slot) = std::mem::replace(self, Slots::Many(Vec::with_capacity(2)))
            else {
                unreachable!("checked above")
            };
            if let Slots::Many(slots) = self {
                slots.push(slot);
            }
        }
        let Slots::Many(slots) = self else {
            unreachable!("converted above")
        };
        for (index, policy) in policies.iter().enumerate() {
            match slots[index..]
                .iter()
                .position(|slot| slot.id() == policy.id())
            {
                Some(0) => {}
                Some(offset) => slots.swap(index, index + offset),
                None => slots.insert(index, policy.params().new_slot(policy.id())),
            }
        }
        &mut slots[..policies.len()]
    }
}

/// Builds a [`MemoryStore`] with a clock, a size bound and a shard count.
#[derive(Debug)]
pub struct MemoryStoreBuilder<C = MonotonicClock> {
    clock: C,
    max_keys: usize,
    shards: usize,
}

impl MemoryStore {
    /// A store with the monotonic clock and the default bound.
    #[inline]
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder, to set the clock, `max_keys` or the shard count.
    pub fn builder() -> MemoryStoreBuilder {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        MemoryStoreBuilder {
            clock: MonotonicClock::new(),
            max_keys: DEFAULT_MAX_KEYS,
            shards: (cores * 8).next_power_of_two(),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStoreBuilder<C> {
    /// Uses another clock (for tests, [`ManualClock`](crate::clock::ManualClock)).
    pub fn clock<C2: Clock>(self, clock: C2) -> MemoryStoreBuilder<C2> {
        MemoryStoreBuilder {
            clock,
            max_keys: self.max_keys,
            shards: self.shards,
        }
    }

    /// The most identities kept at once (at least 1).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// The number of shards, rounded up to a power of two (default: 8 per core).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1).next_power_of_two();
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore<C> {
        // Never more shards than keys, so that the per-shard bounds add up to max_keys.
        let mut shards = self.shards;
        while shards > 1 && shards > self.max_keys {
            shards /= 2;
        }
        MemoryStore {
            shared: Arc::new(Shared {
                shards: (0..shards)
                    .map(|_| Shard {
                        table: Mutex::new(HashTable::new()),
                    })
                    .collect(),
                shard_mask: shards - 1,
                shard_capacity: self.max_keys / shards,
                hasher: foldhash::fast::RandomState::default(),
                clock: self.clock,
                evicted_live: AtomicU64::new(0),
            }),
        }
    }
}

#[inline]
fn lock(shard: &Shard) -> MutexGuard<'_, HashTable<Entry>> {
    // The table is consistent after any panic inside the lock (no step leaves it half
    // changed), so a poisoned lock is still usable.
    shard.table.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<C: Clock> MemoryStore<C> {
    #[inline]
    fn shard(&self, hash: u64) -> &Shard {
        // Bits 32.. pick the shard; hashbrown uses the low bits and the top seven.
        &self.shared.shards[(hash >> 32) as usize & self.shared.shard_mask]
    }

    /// Decides `cost` units for `key` now, synchronously.
    #[inline]
    pub fn check(&self, key: &str, policies: &PolicySet, cost: u64) -> Decision {
        let now = self.shared.clock.now();
        let hash = self.shared.hasher.hash_one(key);
        let mut table = lock(self.shard(hash));
        if let Some(entry) = table.find_mut(hash, |entry| &*entry.key == key) {
            return decide_entry(entry, policies, now, cost);
        }
        let mut entry = Entry {
            key: CompactString::from(key),
            fresh_at: 0,
            slots: Slots::new(policies),
        };
        let decision = decide_entry(&mut entry, policies, now, cost);
        // An identity whose state is still fresh (denied at once, cost 0) is not stored.
        if entry.fresh_at > now {
            if table.len() >= self.shared.shard_capacity {
                self.make_room(&mut table, now);
            }
            let hasher = &self.shared.hasher;
            table.insert_unique(hash, entry, |entry| hasher.hash_one(entry.key.as_str()));
        }
        decision
    }

    fn make_room(&self, table: &mut HashTable<Entry>, now: u64) {
        table.retain(|entry| entry.fresh_at > now);
        // Free a sixteenth of the shard at once, so a flood of new identities pays for one
        // scan per capacity/16 inserts, not one per insert.
        let capacity = self.shared.shard_capacity;
        let target = capacity.saturating_sub((capacity / 16).max(1));
        if table.len() <= target {
            return;
        }
        let excess = table.len() - target;
        let mut fresh_times: Vec<u64> = table.iter().map(|entry| entry.fresh_at).collect();
        let (_, threshold, _) = fresh_times.select_nth_unstable(excess - 1);
        let threshold = *threshold;
        let mut left = excess;
        table.retain(|entry| {
            if left > 0 && entry.fresh_at <= threshold {
                left -= 1;
                false
            } else {
                true
            }
        });
        self.shared
            .evicted_live
            .fetch_add((excess - left) as u64, Ordering::Relaxed);
    }

    /// The number of identities held now.
    pub fn len(&self) -> usize {
        self.shared
            .shards
            .iter()
            .map(|shard| lock(shard).len())
            .sum()
    }

    /// True when no identity is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most identities held at once.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.shared.shard_capacity * self.shared.shards.len()
    }

    /// How many identities were forgotten before their state was fresh, because the
    /// store was full. Non-zero means `max_keys` is too small for the traffic.
    pub fn evicted_live(&self) -> u64 {
        self.shared.evicted_live.load(Ordering::Relaxed)
    }

    /// Forgets every identity whose state is back to fresh; returns how many.
    ///
    /// Never needed for correctness or for the bound; call it on a timer to give memory
    /// back after a burst of identities.
    pub fn purge_fresh(&self) -> usize {
        let now = self.shared.clock.now();
        self.shared
            .shards
            .iter()
            .map(|shard| {
                let mut table = lock(shard);
                let before = table.len();
                table.retain(|entry| entry.fresh_at > now);
                before - table.len()
            })
            .sum()
    }
}

/// Decides against the entry's slots for `policies` (adding fresh ones).
#[inline]
fn decide_entry(entry: &mut Entry, policies: &PolicySet, now: u64, cost: u64) -> Decision {
    let slots = entry.slots.arrange(policies);
    let (decision, fresh_at) = super::decide::decide(policies, slots, now, cost);
    entry.fresh_at = entry.fresh_at.max(fresh_at);
    decision
}

impl<C: Clock> Store for MemoryStore<C> {
    #[inline]
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        DecideFuture::ready(Ok(self.check(key.as_str(), policies, cost)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;
    use crate::{Policy, Rate};

    fn store(max_keys: usize) -> (MemoryStore<ManualClock>, ManualClock) {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(max_keys)
            .shards(4)
            .build();
        (store, clock)
    }

    #[test]
    fn fresh_identities_are_not_stored() {
        let (store, _clock) = store(100);
        let policies = PolicySet::from(Policy::gcra("g", Rate::per_second(1), 1).unwrap());
        // Cost 0 and impossible costs leave nothing behind.
        store.check("a", &policies, 0);
        store.check("b", &policies, 5);
        assert_eq!(store.len(), 0);
        store.check("c", &policies, 1);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn stays_within_max_keys_and_prefers_fresh_entries() {
        let (store, clock) = store(64);
        let policies = PolicySet::from(Policy::gcra("g", Rate::per_second(1), 1).unwrap());
        for i in 0..1000 {
            store.check(&format!("id-{i}"), &policies, 1);
            clock.advance(Duration::from_millis(10));
            assert!(store.len() <= 64, "len {} after {i}", store.len());
        }
        // Every entry lives 1 s; with 10 ms per insert about 100 would be live, so the
        // bound forced some live evictions, and the fresh ones went first.
        assert!(store.evicted_live() > 0);
        let held = store.len();
        assert!(held > 0);
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.purge_fresh(), held);
        assert!(store.is_empty());
    }

    #[test]
    fn a_changed_policy_set_keeps_each_policys_state() {
        let (store, _clock) = store(100);
        let burst = Policy::token_bucket("burst", 2, Rate::per_second(1)).unwrap();
        let daily = Policy::fixed_window("daily", 3, Duration::from_secs(86_400)).unwrap();
        let both = PolicySet::new([burst.clone(), daily.clone()]).unwrap();
        let only_daily = PolicySet::from(daily);
        assert!(store.check("k", &both, 1).is_allowed());
        assert!(store.check("k", &only_daily, 1).is_allowed());
        // daily has 1 left, burst has 1 left.
        let decision = store.check("k", &both, 1);
        assert!(decision.is_allowed());
        assert_eq!(decision.statuses()[0].remaining, 0);
        assert_eq!(decision.statuses()[1].remaining, 0);
    }
}

#[cfg(test)]
mod size {
    /// Entry size is most of the store's memory and of its cache misses; keep it in check.
    #[test]
    fn an_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<crate::algorithm::Slot>(), 32);
        assert_eq!(std::mem::size_of::<super::Slots>(), 32);
        assert_eq!(std::mem::size_of::<super::Entry>(), 64);
    }
}
