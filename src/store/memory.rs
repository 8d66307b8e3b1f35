//! The in-process store: sharded hash tables behind short mutexes, bounded in size.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use compact_str::CompactString;

use super::{Adjustment, Change, DecideFuture, ResetFuture, Store};
use crate::algorithm::Slot;
use crate::clock::{CarriedClock, Clock};
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
/// one policy is one 64-byte entry, its key inline up to 24 bytes, kept densely in a slab;
/// the hash table that finds it holds only its position, so the table's spare capacity
/// costs 4 bytes a bucket, not 65 (the README's benchmark gives the resident memory
/// measured per identity). When a shard is full it first forgets every identity
/// whose state is back to fresh (forgetting those changes no decision); if that frees too
/// little it forgets the identities with least to lose: the smallest share of their own
/// quota spent (units of a window's limit, the time a bucket needs to be full again over
/// the time it takes from empty, a penalty's strikes or block whole), then those closest
/// to fresh, then the most recently added, and counts them in
/// [`MemoryStore::evicted_live`]. An attacker rotating identities therefore cannot grow
/// the store, and a flood that spends a sliver of a generous policy's quota goes before an
/// identity that spent (or was denied) under a strict one. A flood that spends as large a
/// share as an identity (new user names each trying a login once, beside a user who
/// tried once) can still have it forgotten, and one whose state is made after such a flood
/// is the newest of its equals, forgotten at the next make-room (a sixteenth of a shard's
/// worth of new identities later; key a limit by client address in front of a login
/// limit by user name): size `max_keys` above the identities one window
/// sees, and watch `evicted_live`. An identity whose in-flight slots running requests
/// hold is never fresh: its requests give the slots back when they end, however long they
/// run (the lease of
/// [`Policy::concurrency_with_lease`](crate::Policy::concurrency_with_lease) is for shared
/// stores); a full shard forgets such identities only when the others cannot make the
/// room (a forgotten request's release frees nothing of the state begun after it).
/// [`MemoryStore::purge_fresh`] gives memory back.
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
pub struct MemoryStore<C: Clock = CarriedClock> {
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
    table: Mutex<Table>,
}

/// A shard's identities: the entries packed densely in a slab, and a hash table that holds
/// only each entry's position in it.
///
/// Hash tables double, so just after a doubling half their buckets are empty. Keeping the
/// 64-byte entries out of the buckets leaves that slack at 4 bytes a bucket instead of 65
/// (in a hashbrown table of entries: the entry and a control byte); the slab grows by
/// whole chunks, not by doubling. Entries leave only in bulk: [`Table::retain`] keeps the slab
/// dense and in order (the entries kept move up), then [`Table::reindex`] or
/// [`Table::shrink`] rebuilds the index.
///
/// Laid out in this order (`repr(C)`): `latest`, written by every decision, sits beside
/// the lock's word on the shard's first cache line, and what every decision reads (the
/// index's and the slab's pointers) follows it. Left to the compiler, `latest` went last,
/// onto the second line: two cores taking turns on one hot identity passed both lines
/// back and forth on every request, not one.
#[repr(C)]
struct Table {
    /// The latest time the shard decided at. Clocks are read before the shard's lock is
    /// taken, and two threads' readings may disagree a little (see
    /// [`CarriedClock`]): a request read just before a window's end may reach the shard
    /// just after its identity was forgotten there, fresh at that end, and would be
    /// counted in an empty window that had ended. The shard's time never steps back.
    latest: u64,
    index: Index,
    slab: Slab,
    /// The latest resets and level sets of identities' rate policies (at most
    /// [`MAX_CLEARED`], each kept while a debit made before it could still be given
    /// back): a settle of such a debit gives nothing back (see `decide::adjust`).
    cleared: Vec<Cleared>,
    /// The clears [`cleared`](Self::cleared) had to drop while they still mattered, by
    /// policy: a debit made at or before one, under its policy, gives nothing back,
    /// whoever's (the shard no longer knows whose). Too little given back, never too
    /// much.
    forgotten: Vec<Forgotten>,
}

/// The latest clear of a policy that a shard had to drop while it still mattered (see
/// [`Table::forgotten`]).
#[derive(Debug, Clone, Copy)]
struct Forgotten {
    /// The policy's id; [`ANY_POLICY`] past [`MAX_FORGOTTEN`] policies.
    policy: u32,
    at: u64,
    until: u64,
}

/// The most policies a shard keeps forgotten clears of, one each; past them, one record
/// stands for every policy.
const MAX_FORGOTTEN: usize = 64;

/// The policy id of a forgotten clear that stands for every policy.
const ANY_POLICY: u32 = u32::MAX;

/// A reset or a level set of one identity's rate policy (see [`Table::cleared`]).
#[derive(Debug, Clone, Copy)]
struct Cleared {
    hash: u64,
    policy: u32,
    /// When, on the shard's time line: debits at or before it are forgiven.
    at: u64,
    /// Until when it matters: twice the policy's window after it, when no refund of a
    /// debit made before it gives anything back any more (its window has ended, its
    /// bucket refilled).
    until: u64,
}

/// The most clears a shard remembers: resets and level sets are an operator's (or an
/// app's admin) calls, not a request's. Past it the oldest is forgotten first, and a
/// settle of any identity's debit made before it under its policy gives nothing back
/// (`Table::forgotten`).
const MAX_CLEARED: usize = 256;

/// The hash table of a shard: open addressing over 4-byte buckets. A bucket holds an
/// entry's slab position plus one in its low bits (0: empty), and a tag in the bits the
/// positions leave free: the top bits of the identity's hash (16 of them when a shard
/// holds at most 65,535 entries, as with the default bound on 16 shards).
///
/// A lookup usually reads one line of buckets and then the one entry whose tag matches:
/// two cache misses, as with a table of whole entries. (A hashbrown table of positions
/// would add a third, dependent one: its control bytes and its buckets are on different
/// lines.) Probes step 1, 2, 3, ... buckets on from the hash's bucket, which visits every
/// bucket of a power-of-two table and keeps the first steps within a line or two; the
/// table is at most seven eighths full, as hashbrown's are, so a probe always ends.
/// Nothing is deleted: after removals the index is rebuilt.
struct Index {
    /// A power of two long, at least [`MIN_BUCKETS`].
    buckets: Vec<u32>,
    /// The bits of a bucket that hold a position plus one: the rest is the tag.
    position_mask: u32,
}

const MIN_BUCKETS: usize = 16;

impl Index {
    /// An empty index with room for `len` identities, for a shard of at most `capacity`.
    fn new(len: usize, capacity: usize) -> Self {
        // Positions plus one go up to `capacity`, which is below u32::MAX (see `build`).
        let bits = usize::BITS - capacity.leading_zeros();
        Self {
            buckets: vec![0; Self::buckets_for(len)],
            position_mask: u32::try_from((1u64 << bits) - 1).unwrap_or(u32::MAX),
        }
    }

    /// An empty index with room for `len` identities, for the same shard.
    fn resized(&self, len: usize) -> Self {
        Self {
            buckets: vec![0; Self::buckets_for(len)],
            position_mask: self.position_mask,
        }
    }

    /// The fewest buckets that hold `len` identities at most seven eighths full.
    fn buckets_for(len: usize) -> usize {
        len.saturating_mul(8)
            .div_ceil(7)
            .max(MIN_BUCKETS)
            .next_power_of_two()
    }

    #[inline]
    fn has_room_for(&self, len: usize) -> bool {
        len.saturating_mul(8) <= self.buckets.len() * 7
    }

    /// The tag of `hash`: its top bits, where a bucket has no position bits.
    #[inline]
    fn tag(&self, hash: u64) -> u32 {
        (hash >> 32) as u32 & !self.position_mask
    }

    /// The position of the identity of `hash` for which `eq` is true; if there is none,
    /// the empty bucket where the probe ended, where it would be inserted.
    #[inline]
    fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Result<u32, usize> {
        let mask = self.buckets.len() - 1;
        let tag = self.tag(hash);
        let mut bucket = hash as usize & mask;
        let mut step = 0;
        loop {
            let slot = self.buckets[bucket];
            if slot == 0 {
                return Err(bucket);
            }
            if slot & !self.position_mask == tag {
                // The position bits are never 0 in a full bucket.
                let index = (slot & self.position_mask) - 1;
                if eq(index) {
                    return Ok(index);
                }
            }
            step += 1;
            bucket = (bucket + step) & mask;
        }
    }

    /// The empty bucket where the identity of `hash` goes.
    #[inline]
    fn vacant(&self, hash: u64) -> usize {
        let mask = self.buckets.len() - 1;
        let mut bucket = hash as usize & mask;
        let mut step = 0;
        while self.buckets[bucket] != 0 {
            step += 1;
            bucket = (bucket + step) & mask;
        }
        bucket
    }

    /// Puts the identity of `hash` at slab position `index` into `bucket`, which
    /// [`Index::find`] or [`Index::vacant`] found for `hash` (the caller checked for room,
    /// and nothing was inserted since).
    #[inline]
    fn fill(&mut self, bucket: usize, hash: u64, index: u32) {
        debug_assert_eq!(self.buckets[bucket], 0);
        debug_assert!(index < self.position_mask);
        self.buckets[bucket] = self.tag(hash) | (index + 1);
    }

    fn clear(&mut self) {
        self.buckets.fill(0);
    }
}

/// Entries per slab chunk (64 KiB of 64-byte entries): the most a shard allocates ahead.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// Entries `0..len` in chunks of [`CHUNK`]: every chunk before the one holding entry
/// `len - 1` is full, and the chunks after it are empty (kept for reuse until
/// [`Slab::release_spare`]). Chunks are allocated whole and never reallocate, so the slab
/// has no doubling slack and leaves no freed copies behind; the pages of a chunk are
/// touched only as entries arrive.
struct Slab {
    chunks: Vec<Vec<Entry>>,
    len: usize,
    /// Entries per chunk: [`CHUNK`], or fewer for a shard that holds fewer.
    chunk_capacity: usize,
}

impl Slab {
    #[inline]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn get(&self, index: u32) -> &Entry {
        let index = index as usize;
        &self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }

    #[inline]
    fn get_mut(&mut self, index: u32) -> &mut Entry {
        let index = index as usize;
        &mut self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }

    /// An empty slab for a shard of at most `capacity` entries.
    fn new(capacity: usize) -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
            chunk_capacity: capacity.min(CHUNK),
        }
    }

    /// Appends `entry`; returns its index.
    fn push(&mut self, entry: Entry) -> u32 {
        let chunk = self.len >> CHUNK_BITS;
        if chunk == self.chunks.len() {
            self.chunks.push(Vec::with_capacity(self.chunk_capacity));
        }
        self.chunks[chunk].push(entry);
        // Below the shard's capacity, which is below u32::MAX (see `build`).
        let index = self.len as u32;
        self.len += 1;
        index
    }

    /// Keeps the entries for which `keep` is true, in their order (about the order they
    /// came in, which eviction reads among equals).
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        let mut kept = 0;
        for index in 0..self.len {
            if keep(&self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]) {
                self.swap(index, kept);
                kept += 1;
            }
        }
        // What goes is now at the end.
        while self.len > kept {
            let last = self.len - 1;
            self.chunks[last >> CHUNK_BITS].pop();
            self.len = last;
        }
    }

    /// Swaps entries `a` and `b` (`b` <= `a`).
    fn swap(&mut self, a: usize, b: usize) {
        let (chunk_a, slot_a) = (a >> CHUNK_BITS, a & (CHUNK - 1));
        let (chunk_b, slot_b) = (b >> CHUNK_BITS, b & (CHUNK - 1));
        if chunk_a == chunk_b {
            self.chunks[chunk_a].swap(slot_a, slot_b);
        } else {
            let (low, high) = self.chunks.split_at_mut(chunk_a);
            std::mem::swap(&mut low[chunk_b][slot_b], &mut high[0][slot_a]);
        }
    }

    /// Gives the empty chunks back to the allocator.
    fn release_spare(&mut self) {
        self.chunks.truncate(self.len.div_ceil(CHUNK));
        self.chunks.shrink_to_fit();
    }

    fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.chunks.iter().flatten()
    }
}

impl Table {
    /// An empty table for a shard of at most `capacity` entries.
    fn new(capacity: usize) -> Self {
        Self {
            index: Index::new(0, capacity),
            slab: Slab::new(capacity),
            latest: 0,
            cleared: Vec::new(),
            forgotten: Vec::new(),
        }
    }

    /// Notes that `policies`' rate states of the identity of `hash` were cleared (reset,
    /// or set to a level) at `now`, the shard's latest time: a settle of a debit made
    /// then or before gives nothing back. A debit of the very same nanosecond, after the
    /// clear, counts as before it (its refund is lost, never one too many: the shard's
    /// time is not moved, so answers keep their exact times).
    fn clear(&mut self, hash: u64, policies: &PolicySet, now: u64) {
        // Those gone by, and this identity's earlier clears of these policies, go.
        self.cleared.retain(|cleared| {
            cleared.until > now
                && (cleared.hash != hash || !policies.iter().any(|p| p.id() == cleared.policy))
        });
        for policy in policies.iter() {
            if policy.params().is_in_flight() {
                continue;
            }
            if self.cleared.len() >= MAX_CLEARED {
                // Still mattering (those gone by went above): what it forgave, every
                // identity's debits as old under its policy are forgiven.
                let dropped = self.cleared.remove(0);
                self.forget(dropped);
            }
            let window = policy.params().window_nanos();
            self.cleared.push(Cleared {
                hash,
                policy: policy.id(),
                at: now,
                until: now.saturating_add(window.saturating_mul(2)),
            });
        }
    }

    /// Notes a clear dropped from [`cleared`](Self::cleared) while it still mattered.
    fn forget(&mut self, dropped: Cleared) {
        let policy = if self.forgotten.len() < MAX_FORGOTTEN
            || self.forgotten.iter().any(|f| f.policy == dropped.policy)
        {
            dropped.policy
        } else {
            ANY_POLICY
        };
        match self.forgotten.iter_mut().find(|f| f.policy == policy) {
            Some(forgotten) => {
                forgotten.at = forgotten.at.max(dropped.at);
                forgotten.until = forgotten.until.max(dropped.until);
            }
            None => self.forgotten.push(Forgotten {
                policy,
                at: dropped.at,
                until: dropped.until,
            }),
        }
    }

    /// When each of `policies` was last cleared for the identity of `hash`, in the set's
    /// order, for an adjustment that gives back (a settle, an unbooking): its own clears,
    /// or a forgotten clear of the policy (see [`forgotten`](Self::forgotten)) the debit
    /// was made at or before. Empty when neither applies, or for another adjustment.
    fn cleared_at(
        &mut self,
        hash: u64,
        policies: &PolicySet,
        now: u64,
        adjustment: &Adjustment,
    ) -> Vec<Option<u64>> {
        if (self.cleared.is_empty() && self.forgotten.is_empty())
            || !matches!(
                adjustment.change(),
                Change::Settle { .. } | Change::Unbook { .. }
            )
        {
            return Vec::new();
        }
        self.cleared.retain(|cleared| cleared.until > now);
        self.forgotten.retain(|forgotten| forgotten.until > now);
        let at = adjustment.receipt().at();
        let forgotten = |policy: u32| {
            self.forgotten
                .iter()
                .filter(|f| (f.policy == policy || f.policy == ANY_POLICY) && at <= f.at)
                .map(|f| f.at)
                .max()
        };
        // Nothing of this identity, and no forgotten clear as late as the debit: no clear
        // applies (no allocation on a settle's common path).
        if !self.cleared.iter().any(|cleared| cleared.hash == hash)
            && self.forgotten.iter().all(|f| at > f.at)
        {
            return Vec::new();
        }
        policies
            .iter()
            .map(|policy| {
                let own = self
                    .cleared
                    .iter()
                    .find(|c| c.hash == hash && c.policy == policy.id())
                    .map(|c| c.at);
                own.max(forgotten(policy.id()))
            })
            .collect()
    }

    /// `now`, or the shard's latest time if `now` is behind it: the time to decide at.
    #[inline]
    fn time(&mut self, now: u64) -> u64 {
        self.latest = self.latest.max(now);
        self.latest
    }

    #[inline]
    fn len(&self) -> usize {
        self.slab.len()
    }

    /// The position of `key`'s entry, or the bucket where it would be inserted.
    #[inline]
    fn find(&self, hash: u64, key: &str) -> Result<u32, usize> {
        let slab = &self.slab;
        self.index.find(hash, |index| &*slab.get(index).key == key)
    }

    /// Adds an entry whose key is not held yet. `vacant`: the bucket [`Table::find`]
    /// returned for it, if the table has not changed since.
    fn insert(
        &mut self,
        hash: u64,
        entry: Entry,
        mut vacant: Option<usize>,
        hasher: &foldhash::fast::RandomState,
    ) {
        let len = self.len() + 1;
        if !self.index.has_room_for(len) {
            // Grow: twice the buckets, filled in slab order (sequential reads).
            self.index = self.index.resized(len);
            self.index_all(hasher);
            vacant = None;
        }
        let index = self.slab.push(entry);
        let bucket = vacant.unwrap_or_else(|| self.index.vacant(hash));
        self.index.fill(bucket, hash, index);
    }

    /// Keeps the entries for which `keep` is true; returns how many were removed. The
    /// index is stale after a removal until [`Table::reindex`].
    fn retain(&mut self, keep: impl FnMut(&Entry) -> bool) -> usize {
        let before = self.len();
        self.slab.retain(keep);
        before - self.len()
    }

    /// Rebuilds the index after removals, in the memory it has.
    fn reindex(&mut self, hasher: &foldhash::fast::RandomState) {
        self.index.clear();
        self.index_all(hasher);
    }

    /// Gives back the memory that the entries held do not need (the slab's empty chunks,
    /// the index's spare buckets), and rebuilds the index if it is `stale`.
    fn shrink(&mut self, stale: bool, hasher: &foldhash::fast::RandomState) {
        self.slab.release_spare();
        if Index::buckets_for(self.len()) < self.index.buckets.len() {
            self.index = self.index.resized(self.len());
            self.index_all(hasher);
        } else if stale {
            self.reindex(hasher);
        }
    }

    /// Indexes every slab entry into `self.index`, which is empty and large enough.
    fn index_all(&mut self, hasher: &foldhash::fast::RandomState) {
        for (index, entry) in self.slab.iter().enumerate() {
            let hash = hasher.hash_one(entry.key.as_str());
            // `index` < len <= the shard's capacity < u32::MAX.
            self.index.fill(self.index.vacant(hash), hash, index as u32);
        }
    }
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

impl Entry {
    /// True when forgetting the entry changes no decision: its state is back to fresh
    /// and no request holds a slot of it.
    fn is_fresh(&self, now: u64) -> bool {
        self.fresh_at <= now && !self.holds_slots()
    }

    /// What the identity has to lose if forgotten at `now`, in millionths of a quota, and
    /// until when: of its policies' states still live, the largest share it holds spent
    /// of its own quota (`measures`, by policy id), at most a whole one, and when that
    /// state is fresh again (of equal shares, the latest). Of a window or a log, the
    /// units it counts; of a bucket or a GCRA, the time until it is full again over the
    /// time it takes from empty; a penalty's strikes or block, whole. Read against each
    /// policy's own quota, not in units: one login attempt of a limit of 1 is more to
    /// lose than two calls of 1,000.
    fn at_stake(&self, now: u64, measures: &crate::policy::Measures) -> (u64, u64) {
        const WHOLE: u128 = 1_000_000;
        let of = |slot: &Slot, fresh_at: u64| -> (u64, u64) {
            // A state fresh again (a window that has ended) has nothing at stake,
            // whatever it still counts.
            if fresh_at <= now {
                return (0, 0);
            }
            // A policy without measures (past every bound of them): whole while live.
            let share = match (slot, measures.of(slot.id())) {
                (Slot::Penalty { .. }, _) | (_, None) => WHOLE,
                (Slot::Bucket { .. } | Slot::Gcra { .. }, Some((_, refill))) => {
                    u128::from(fresh_at - now) * WHOLE / u128::from(refill.max(1))
                }
                (_, Some((limit, _))) => {
                    slot.spent().saturating_mul(WHOLE) / u128::from(limit.max(1))
                }
            };
            // At most a whole quota: debt owed past it (a post-paid settle) or a sliding
            // window's two counts rank with a spent quota, and with a penalty's block.
            (share.min(WHOLE) as u64, fresh_at)
        };
        match &self.slots {
            Slots::One(slot) => of(slot, self.fresh_at),
            Slots::Many(many) => many
                .slots
                .iter()
                .zip(&many.fresh)
                .map(|(slot, &fresh_at)| of(slot, fresh_at))
                .max()
                .unwrap_or((0, 0)),
        }
    }

    /// True when requests still running hold in-flight slots of this identity: they give
    /// them back when they end, so the entry is kept until then.
    fn holds_slots(&self) -> bool {
        self.slots.holds_in_flight()
    }
}

/// An identity's policy states: one inline (the common case; the whole entry is then one
/// cache line), several on the heap.
enum Slots {
    One(Slot),
    Many(Box<ManySlots>),
}

/// Several policies' states (of the sets an identity is decided under), each with when it
/// is fresh again at the latest: a state no set asked for lately (a policy a reload
/// changed, one a resolver built for a request) goes once it is fresh, so an active
/// identity does not keep one more state per change.
struct ManySlots {
    slots: Vec<Slot>,
    /// `fresh[i]`: when `slots[i]` is fresh again, at the latest (when the last set
    /// decided with it is).
    fresh: Vec<u64>,
}

impl ManySlots {
    fn with_capacity(capacity: usize) -> Box<Self> {
        Box::new(Self {
            slots: Vec::with_capacity(capacity),
            fresh: Vec::with_capacity(capacity),
        })
    }

    /// Puts the slot `id` at `index` (moving it from further on, or making it), keeping
    /// the slots before `index` where they are.
    #[inline]
    fn place(&mut self, index: usize, id: u32, make: impl FnOnce() -> Slot) {
        match self.slots[index..].iter().position(|slot| slot.id() == id) {
            Some(0) => {}
            Some(offset) => {
                self.slots.swap(index, index + offset);
                self.fresh.swap(index, index + offset);
            }
            None => {
                self.slots.insert(index, make());
                self.fresh.insert(index, 0);
            }
        }
    }

    /// Drops the slots from `from` on that are fresh at `now` and that no request holds:
    /// forgetting them changes no decision.
    #[inline]
    fn drop_fresh(&mut self, from: usize, now: u64) {
        let mut index = self.slots.len();
        while index > from {
            index -= 1;
            if self.fresh[index] <= now && !self.slots[index].holds_in_flight() {
                self.slots.swap_remove(index);
                self.fresh.swap_remove(index);
            }
        }
    }
}

impl Slots {
    fn new(policies: &PolicySet) -> Self {
        match &**policies {
            [policy] if !policies.has_penalties() => {
                Slots::One(policy.params().new_slot(policy.id()))
            }
            _ => Slots::Many(ManySlots::with_capacity(policies.len())),
        }
    }

    /// The slots of `policies`, in their order, adding fresh ones where missing; then the
    /// penalty slots of the policies that have one, in the same order. The slots of other
    /// policies that are fresh at `now` go (`entry_fresh`: when the whole entry is).
    #[inline]
    fn arrange(&mut self, policies: &PolicySet, now: u64, entry_fresh: u64) -> &mut [Slot] {
        let single = !policies.has_penalties()
            && matches!(
                (&*self, &**policies),
                (Slots::One(slot), [policy]) if slot.id() == policy.id()
            );
        if single {
            let Slots::One(slot) = self else {
                unreachable!("checked above")
            };
            return std::slice::from_mut(slot);
        }
        self.rearrange(policies, now, entry_fresh)
    }

    /// [`arrange`](Self::arrange) for anything but one policy's own inline slot: out of
    /// line, so that the common request's code stays small.
    #[inline(never)]
    fn rearrange(&mut self, policies: &PolicySet, now: u64, entry_fresh: u64) -> &mut [Slot] {
        // Every state is fresh (and no request holds a slot): forgetting them changes no
        // decision, so this set's start anew, inline for one policy.
        if entry_fresh <= now && !self.holds_in_flight() {
            let lone = policies.len() == 1 && !policies.has_penalties();
            match self {
                // Several again: the heap's room is kept.
                Slots::Many(many) if !lone => {
                    many.slots.clear();
                    many.fresh.clear();
                }
                _ => *self = Slots::new(policies),
            }
            if let Slots::One(slot) = self {
                return std::slice::from_mut(slot);
            }
        }
        // Another policy's state, not fresh: kept beside this set's, on the heap, until it
        // is. (An identity whose sets alternate stays there: no allocation per turn.)
        if let Slots::One(_) = self {
            let many = ManySlots::with_capacity(2);
            if let Slots::One(slot) = std::mem::replace(self, Slots::Many(many))
                && let Slots::Many(many) = self
            {
                many.slots.push(slot);
                many.fresh.push(entry_fresh);
            }
        }
        let Slots::Many(many) = self else {
            unreachable!("moved to the heap above")
        };
        let mut index = 0;
        for policy in policies.iter() {
            many.place(index, policy.id(), || policy.params().new_slot(policy.id()));
            index += 1;
        }
        if policies.has_penalties() {
            for (_, id) in policies.iter().filter_map(|policy| policy.penalty_box()) {
                many.place(index, id, || Slot::Penalty {
                    id,
                    state: Box::default(),
                });
                index += 1;
            }
        }
        many.drop_fresh(index, now);
        &mut many.slots[..index]
    }

    /// True when a request still running holds an in-flight slot of one of these states.
    fn holds_in_flight(&self) -> bool {
        match self {
            Slots::One(slot) => slot.holds_in_flight(),
            Slots::Many(many) => many.slots.iter().any(Slot::holds_in_flight),
        }
    }

    /// Notes when each of the slots of `policies` (those `arrange` returned, just decided
    /// or adjusted) is fresh again, and returns when the whole entry is: `fresh_at` (the
    /// decision's, for `policies`) when they are its only states, else the latest of its
    /// states'. Lowered as well as raised: a debt forgiven leaves the entry fresh again at
    /// once.
    #[inline]
    fn mark(&mut self, policies: &PolicySet, now: u64, fresh_at: u64) -> u64 {
        match self {
            Slots::One(_) => fresh_at,
            Slots::Many(many) => {
                super::decide::fresh_each(policies, &many.slots, now, &mut many.fresh);
                many.fresh.iter().copied().max().unwrap_or(0).max(fresh_at)
            }
        }
    }
}

/// Builds a [`MemoryStore`] with a clock, a size bound and a shard count.
#[derive(Debug)]
pub struct MemoryStoreBuilder<C = CarriedClock> {
    clock: C,
    max_keys: usize,
    shards: usize,
}

impl MemoryStore {
    /// A store with the default clock ([`CarriedClock`]) and the default bound.
    #[inline]
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder, to set the clock, `max_keys` or the shard count.
    pub fn builder() -> MemoryStoreBuilder {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        MemoryStoreBuilder {
            clock: CarriedClock::new(),
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

    /// The number of shards, rounded up to a power of two (default: 8 per core), but
    /// never fewer than 64 identities a shard (a store of `max_keys(100)` is one shard),
    /// nor more than 2^20.
    ///
    /// Each shard holds an equal part of `max_keys`, so the shard count shows in
    /// [`capacity`](MemoryStore::capacity):
    ///
    /// ```
    /// use tollgate::MemoryStore;
    ///
    /// // 3 shards are rounded up to 4, each holding a quarter of 1,001 (250).
    /// let store = MemoryStore::builder().max_keys(1_001).shards(3).build();
    /// assert_eq!(store.capacity(), 1_000);
    /// // 100 identities are one shard, not 16 shards of 6.
    /// let small = MemoryStore::builder().max_keys(100).shards(16).build();
    /// assert_eq!(small.capacity(), 100);
    /// ```
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 20).next_power_of_two();
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore<C> {
        // At least 64 identities a shard: a shard is full when it is, however empty the
        // others, and a shard of one would have two live identities evict each other on
        // every request. A small bound is one shard (or a few) rather than many tiny ones.
        let mut shards = self.shards;
        while shards > 1 && shards > self.max_keys / MIN_SHARD_KEYS {
            shards /= 2;
        }
        // A shard's index holds positions plus one in 32 bits.
        let shard_capacity = (self.max_keys / shards).min(u32::MAX as usize - 1);
        // Now, not on the first request: the default clock calibrates the CPU's counter.
        self.clock.prepare();
        MemoryStore {
            shared: Arc::new(Shared {
                shards: (0..shards)
                    .map(|_| Shard {
                        table: Mutex::new(Table::new(shard_capacity)),
                    })
                    .collect(),
                shard_mask: shards - 1,
                shard_capacity,
                hasher: foldhash::fast::RandomState::default(),
                clock: self.clock,
                evicted_live: AtomicU64::new(0),
            }),
        }
    }
}

/// The fewest identities a shard is built for (see [`MemoryStoreBuilder::build`]).
const MIN_SHARD_KEYS: usize = 64;

#[inline]
fn lock(shard: &Shard) -> MutexGuard<'_, Table> {
    // The table is consistent after any panic inside the lock (no step leaves it half
    // changed), so a poisoned lock is still usable.
    shard.table.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<C: Clock> MemoryStore<C> {
    #[inline]
    fn shard(&self, hash: u64) -> &Shard {
        // Bits 32.. pick the shard; its index uses the low bits (the bucket) and the top
        // ones (the tag).
        &self.shared.shards[(hash >> 32) as usize & self.shared.shard_mask]
    }

    /// Decides `cost` units for `key` now, synchronously. `key` is a key's text as the
    /// store keys it ([`Key::as_str`], what `Store::decide` is given), taken as it is: a
    /// string over [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) bytes reaches the bucket a
    /// layer's requests use as `Key::new(string).as_str()`, its digest. (So do
    /// [`reset_now`](Self::reset_now) and [`adjust_now`](Self::adjust_now).)
    #[inline]
    pub fn check(&self, key: &str, policies: &PolicySet, cost: u64) -> Decision {
        let now = self.shared.clock.now();
        let hash = self.shared.hasher.hash_one(key);
        let mut table = lock(self.shard(hash));
        let now = table.time(now);
        match table.find(hash, key) {
            Ok(index) => decide_entry(table.slab.get_mut(index), policies, now, cost),
            Err(vacant) => self.keep_new(&mut table, vacant, hash, key, policies, now, |entry| {
                decide_entry(entry, policies, now, cost)
            }),
        }
    }

    /// Applies `apply` (a decision, an adjustment) to fresh state for an identity the
    /// shard does not hold, and keeps the state when it is not fresh. Out of line and
    /// cold: a known identity's path is the one laid out for. A scan of new addresses
    /// comes here on every request, and pays a jump for it beside the insertion's own
    /// cost.
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn keep_new(
        &self,
        table: &mut Table,
        vacant: usize,
        hash: u64,
        key: &str,
        policies: &PolicySet,
        now: u64,
        apply: impl FnOnce(&mut Entry) -> Decision,
    ) -> Decision {
        let mut entry = Entry {
            key: CompactString::from(key),
            fresh_at: 0,
            slots: Slots::new(policies),
        };
        let decision = apply(&mut entry);
        // An identity whose state is still fresh (denied at once, cost 0, a refund of
        // what is not held) is not stored.
        if entry.fresh_at > now {
            let mut vacant = Some(vacant);
            if table.len() >= self.shared.shard_capacity {
                self.make_room(table, now);
                vacant = None;
            }
            table.insert(hash, entry, vacant, &self.shared.hasher);
        }
        decision
    }

    /// Forgets `key`'s state under `policies` now (see [`Store::reset`]): its next request
    /// starts fresh. Its state under other policies stays. A request debited before the
    /// reset and settled after it gives nothing back (its debit was forgiven): a refund
    /// would give back units spent since.
    ///
    /// ```
    /// use tollgate::{MemoryStore, Policy, PolicySet, Rate};
    ///
    /// let store = MemoryStore::new();
    /// let api = PolicySet::from(Policy::fixed_window("api", 2, std::time::Duration::from_secs(60))?);
    /// store.check("user-7", &api, 2);
    /// assert!(!store.check("user-7", &api, 1).is_allowed());
    /// store.reset_now("user-7", &api);
    /// assert!(store.check("user-7", &api, 1).is_allowed());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn reset_now(&self, key: &str, policies: &PolicySet) {
        let hash = self.shared.hasher.hash_one(key);
        let mut table = lock(self.shard(hash));
        let now = table.time(self.shared.clock.now());
        // A request debited before and settled after gives nothing back: the reset
        // forgave its debit (also of an identity no longer held: it may come back).
        table.clear(hash, policies, now);
        if let Ok(index) = table.find(hash, key) {
            let entry = table.slab.get_mut(index);
            let slots = entry.slots.arrange(policies, now, entry.fresh_at);
            let (slots, penalties) = slots.split_at_mut(policies.len());
            for (policy, slot) in policies.iter().zip(slots) {
                // In-flight slots are freed by their requests only: forgetting them
                // would let those requests' releases free slots others took since.
                if !policy.params().is_in_flight() {
                    *slot = policy.params().new_slot(policy.id());
                }
            }
            // A reset forgives: blocks and strikes go too.
            for slot in penalties {
                if let Slot::Penalty { state, .. } = slot {
                    **state = Default::default();
                }
            }
            // Fresh again as soon as what is left is (in-flight slots still held, other
            // policies' states): the old debt's time kept the entry, and ranked it as
            // having a quota to lose, long after it had none.
            let fresh_at = match (&entry.slots, policies.first()) {
                (Slots::One(slot), Some(policy)) => policy.params().snapshot(slot, now).fresh_at,
                _ => 0,
            };
            entry.fresh_at = entry.slots.mark(policies, now, fresh_at);
        }
    }

    /// Adjusts an admitted request's debit now, synchronously (see [`Store::adjust`]).
    /// A key the store does not hold (never stored, or forgotten) is adjusted from fresh
    /// state, as on Redis: a refund or a release finds nothing to give back (nothing is
    /// stored), a charge or a level set is kept.
    ///
    /// ```
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet};
    ///
    /// let store = MemoryStore::new();
    /// let inflight = PolicySet::from(Policy::concurrency("inflight", 2)?);
    /// let first = store.check("team-a", &inflight, 1);
    /// assert!(store.check("team-a", &inflight, 1).is_allowed());
    /// assert!(!store.check("team-a", &inflight, 1).is_allowed());
    /// // The first request ends: its slot is free again.
    /// store.adjust_now("team-a", &inflight, &Adjustment::release(1, first.receipt()));
    /// assert!(store.check("team-a", &inflight, 1).is_allowed());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn adjust_now(&self, key: &str, policies: &PolicySet, adjustment: &Adjustment) -> Decision {
        let now = self.shared.clock.now();
        let hash = self.shared.hasher.hash_one(key);
        let mut table = lock(self.shard(hash));
        let now = table.time(now);
        let cleared = table.cleared_at(hash, policies, now, adjustment);
        let decision = match table.find(hash, key) {
            Ok(index) => adjust_entry(
                table.slab.get_mut(index),
                policies,
                now,
                adjustment,
                &cleared,
            ),
            Err(vacant) => self.keep_new(&mut table, vacant, hash, key, policies, now, |entry| {
                adjust_entry(entry, policies, now, adjustment, &cleared)
            }),
        };
        // A level set forgives what was debited before it, as a reset does.
        if let Change::SetRemaining { .. } = adjustment.change() {
            table.clear(hash, policies, now);
        }
        decision
    }

    fn make_room(&self, table: &mut Table, now: u64) {
        let mut removed = table.retain(|entry| !entry.is_fresh(now));
        // Free a sixteenth of the shard at once, so a flood of new identities pays for one
        // scan per capacity/16 inserts, not one per insert.
        let capacity = self.shared.shard_capacity;
        let target = capacity.saturating_sub((capacity / 16).max(1));
        if table.len() > target {
            let excess = table.len() - target;
            // Identities whose slots running requests hold are spared while the others
            // can make the room; otherwise they are candidates too, so the shard keeps
            // its bound and its one scan per sixteenth.
            let others = table.slab.iter().filter(|e| !e.holds_slots()).count();
            let spare = others >= excess;
            let candidate = |entry: &Entry| !spare || !entry.holds_slots();
            let measures = crate::policy::measures();
            let order = |entry: &Entry| entry.at_stake(now, &measures);
            // The `excess` candidates first in `at_stake` order go: those with least to
            // lose, a share of their own quotas (so a flood spending a sliver of a
            // generous policy's quota goes before an identity denied under a strict one,
            // and no identity has its own spent quota forgotten by adding a few others
            // after it), and of equals those whose stake ends first.
            let mut orders: Vec<(u64, u64)> = table
                .slab
                .iter()
                .filter(|entry| candidate(entry))
                .map(order)
                .collect();
            let (_, threshold, _) = orders.select_nth_unstable(excess - 1);
            let threshold = *threshold;
            let below = orders.iter().filter(|&&o| o < threshold).count();
            // Of those at the threshold, the first `keep` in slab order stay: `retain`
            // visits the entries in their order (about the order they came in), so the
            // most recently added go.
            let mut keep = orders.iter().filter(|&&o| o == threshold).count() - (excess - below);
            removed += table.retain(|entry| {
                if !candidate(entry) {
                    return true;
                }
                match order(entry).cmp(&threshold) {
                    std::cmp::Ordering::Greater => true,
                    std::cmp::Ordering::Less => false,
                    std::cmp::Ordering::Equal if keep > 0 => {
                        keep -= 1;
                        true
                    }
                    std::cmp::Ordering::Equal => false,
                }
            });
            self.shared
                .evicted_live
                .fetch_add(excess as u64, Ordering::Relaxed);
        }
        if removed > 0 {
            // Keep the index's and the slab's memory: the shard is about to fill again.
            table.reindex(&self.shared.hasher);
        }
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
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{MemoryStore, Policy, PolicySet};
    ///
    /// let store = MemoryStore::builder().clock(ManualClock::new()).max_keys(64).build();
    /// let hourly = PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(3600))?);
    /// for n in 0..64 {
    ///     store.check(&format!("user-{n}"), &hourly, 1);
    /// }
    /// assert_eq!(store.evicted_live(), 0); // full, but nothing forgotten yet
    /// store.check("user-64", &hourly, 1);
    /// assert!(store.evicted_live() > 0); // live identities made room for it
    /// assert!(store.len() <= store.capacity());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn evicted_live(&self) -> u64 {
        self.shared.evicted_live.load(Ordering::Relaxed)
    }

    /// Forgets every identity whose state is back to fresh; returns how many. An identity
    /// whose in-flight slots are held is not fresh until they are given back (a slot
    /// taken by hand, through `check`, must be freed with `adjust_now`).
    ///
    /// Never needed for correctness or for the bound; call it on a timer to give memory
    /// back after a burst of identities.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::ManualClock;
    /// use tollgate::{Adjustment, MemoryStore, Policy, PolicySet};
    ///
    /// let clock = ManualClock::new();
    /// let store = MemoryStore::builder().clock(clock.clone()).build();
    /// let second = PolicySet::from(Policy::fixed_window("burst", 5, Duration::from_secs(1))?);
    /// let hour = PolicySet::from(Policy::fixed_window("hourly", 5, Duration::from_secs(3600))?);
    /// let inflight = PolicySet::from(Policy::concurrency("inflight", 2)?);
    /// store.check("a", &second, 1);
    /// store.check("b", &second, 1);
    /// store.check("c", &hour, 1);
    /// let slot = store.check("d", &inflight, 1); // a slot taken by hand
    ///
    /// clock.advance(Duration::from_secs(1)); // the second is over; the hour is not
    /// assert_eq!(store.purge_fresh(), 2); // "a" and "b"
    /// assert_eq!(store.len(), 2); // "c" and "d"
    /// store.adjust_now("d", &inflight, &Adjustment::release(1, slot.receipt()));
    /// assert_eq!(store.purge_fresh(), 1); // "d", its slot given back
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn purge_fresh(&self) -> usize {
        let now = self.shared.clock.now();
        let hasher = &self.shared.hasher;
        self.shared
            .shards
            .iter()
            .map(|shard| {
                let mut table = lock(shard);
                let now = table.time(now);
                let removed = table.retain(|entry| !entry.is_fresh(now));
                table.shrink(removed > 0, hasher);
                removed
            })
            .sum()
    }
}

/// Adjusts the entry's slots for `policies` (adding fresh ones).
fn adjust_entry(
    entry: &mut Entry,
    policies: &PolicySet,
    now: u64,
    adjustment: &Adjustment,
    cleared: &[Option<u64>],
) -> Decision {
    let slots = entry.slots.arrange(policies, now, entry.fresh_at);
    let (decision, fresh_at) = super::decide::adjust(policies, slots, now, adjustment, cleared);
    entry.fresh_at = entry.slots.mark(policies, now, fresh_at);
    decision
}

/// Decides against the entry's slots for `policies` (adding fresh ones).
#[inline]
fn decide_entry(entry: &mut Entry, policies: &PolicySet, now: u64, cost: u64) -> Decision {
    let slots = entry.slots.arrange(policies, now, entry.fresh_at);
    let (decision, fresh_at) = super::decide::decide(policies, slots, now, cost);
    entry.fresh_at = entry.slots.mark(policies, now, fresh_at);
    decision
}

impl<C: Clock> Store for MemoryStore<C> {
    #[inline]
    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        DecideFuture::ready(Ok(self.check(key.as_str(), policies, cost)))
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        DecideFuture::ready(Ok(self.adjust_now(key.as_str(), policies, adjustment)))
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        self.reset_now(key.as_str(), policies);
        Box::pin(std::future::ready(Ok(())))
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

    /// A store of one shard of `max_keys`, so that every identity competes for its room.
    fn one_shard(max_keys: usize) -> (MemoryStore<ManualClock>, ManualClock) {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(max_keys)
            .shards(1)
            .build();
        (store, clock)
    }

    /// A reset leaves the identity's state fresh: `purge_fresh` forgets it at once, as it
    /// forgets one never used, and it no longer ranks as having a quota to lose. The
    /// entry kept the time its old debt was paid off, so it was kept (and protected from
    /// eviction) until then: for an hour's bucket, an hour.
    #[test]
    fn a_reset_identity_is_fresh_at_once() {
        let hour = Duration::from_secs(3600);
        let sets = [
            vec![Policy::token_bucket("tb", 10, Rate::per_hour(10)).unwrap()],
            vec![Policy::fixed_window("fw", 10, hour).unwrap()],
            // Several states for the identity (kept on the heap), and a penalty.
            vec![
                Policy::gcra("g", Rate::per_hour(10), 10).unwrap(),
                Policy::sliding_log("sl", 10, hour).unwrap(),
            ],
            vec![
                Policy::fixed_window("blocked", 1, hour)
                    .unwrap()
                    .with_penalty(crate::policy::Penalty::new(1, hour, hour))
                    .unwrap(),
            ],
        ];
        for set in sets {
            let (store, _clock) = store(100);
            let policies = PolicySet::new(set).unwrap();
            for _ in 0..3 {
                store.check("user", &policies, 1);
            }
            assert_eq!(
                store.purge_fresh(),
                0,
                "{policies:?}: still live before the reset"
            );
            store.reset_now("user", &policies);
            assert_eq!(
                store.purge_fresh(),
                1,
                "{policies:?}: fresh after the reset"
            );
            assert_eq!(store.len(), 0);
        }
    }

    /// What every decision writes under a shard's lock (the lock's word, `latest`) is on
    /// the shard's first cache line (see [`Table`]).
    #[test]
    fn a_decisions_writes_share_the_locks_cache_line() {
        let shard = Shard {
            table: Mutex::new(Table::new(16)),
        };
        let start = &raw const shard as usize;
        let table = &raw const *lock(&shard) as usize - start;
        let latest = table + std::mem::offset_of!(Table, latest);
        assert!(latest + 8 <= 64, "latest at byte {latest} of the shard");
        assert_eq!(std::mem::align_of::<Shard>(), 128);
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
    fn a_flood_of_new_identities_does_not_reset_the_oldest_among_equals() {
        // Under a fixed window every identity used this window is fresh again at the same
        // time. When the store must forget some of them, it forgets the most recently
        // added first: an attacker rotating identities loses its own, and a client that
        // spent its quota before the flood keeps its count.
        let (store, _clock) = one_shard(64);
        let daily =
            PolicySet::from(Policy::fixed_window("daily", 1, Duration::from_secs(86_400)).unwrap());
        assert!(store.check("victim", &daily, 1).is_allowed());
        for i in 0..70 {
            assert!(store.check(&format!("flood:{i}"), &daily, 1).is_allowed());
        }
        assert!(
            store.evicted_live() > 0,
            "the store had to forget live identities"
        );
        assert!(
            !store.check("victim", &daily, 1).is_allowed(),
            "the victim's spent quota was forgotten"
        );
    }

    #[test]
    fn among_equals_the_store_forgets_those_that_spent_least() {
        // A client cannot have its own spent quota forgotten cheaply by adding a few new
        // identities after it: among identities fresh at the same time, those that spent
        // least go first, whenever they came.
        let (store, _clock) = one_shard(64);
        let daily =
            PolicySet::from(Policy::fixed_window("daily", 3, Duration::from_secs(86_400)).unwrap());
        for i in 0..70 {
            assert!(store.check(&format!("junk:{i}"), &daily, 1).is_allowed());
        }
        for _ in 0..3 {
            assert!(store.check("spender", &daily, 1).is_allowed());
        }
        for i in 70..80 {
            assert!(store.check(&format!("junk:{i}"), &daily, 1).is_allowed());
        }
        assert!(
            store.evicted_live() > 0,
            "the store had to forget live identities"
        );
        assert!(
            !store.check("spender", &daily, 1).is_allowed(),
            "the spender's quota was forgotten"
        );
    }

    /// What an identity has to lose is its share of its own quota, not a count of units
    /// across policies: a flood on a generous policy (`api`, 1,000 an hour; 2 units each)
    /// forgot a denied identity of a strict one (`login`, 1 an hour) fresh at the same
    /// time (1 unit spent, fewer than 2), or at an earlier time (a shorter window): a new
    /// login attempt for every flood. The flood, a sliver of its quota each, goes first.
    #[test]
    fn a_flood_on_a_generous_policy_does_not_forget_a_strict_ones_denial() {
        let hour = Duration::from_secs(3600);
        let api = PolicySet::from(Policy::fixed_window("api", 1_000, hour).unwrap());
        let strict = [
            Policy::fixed_window("login", 1, hour).unwrap(),
            Policy::fixed_window("pin", 1, Duration::from_secs(900)).unwrap(),
            Policy::token_bucket("otp", 1, Rate::per_hour(1)).unwrap(),
            Policy::gcra("code", Rate::per_hour(1), 1).unwrap(),
        ];
        for strict in strict {
            let (store, _clock) = one_shard(64);
            let strict = PolicySet::from(strict);
            assert!(store.check("alice", &strict, 1).is_allowed());
            assert!(!store.check("alice", &strict, 1).is_allowed());
            for i in 0..80 {
                assert!(store.check(&format!("flood:{i}"), &api, 2).is_allowed());
            }
            assert!(
                store.evicted_live() > 0,
                "the store had to forget live identities"
            );
            assert!(
                !store.check("alice", &strict, 1).is_allowed(),
                "{}: alice's denial was forgotten",
                strict[0].name()
            );
        }
    }

    /// What a slot held in a window that has ended is no longer at stake: a flood that
    /// spent a set's per-second quota once (`[10 a second, 1,000 a day]`, 10 requests
    /// each) read as a whole quota spent for the rest of the day, and had an identity
    /// that spent 900 of its day (9 a second) forgotten first.
    #[test]
    fn a_window_that_ended_is_not_at_stake() {
        let (store, clock) = one_shard(64);
        let set = PolicySet::new([
            Policy::fixed_window("second", 10, Duration::from_secs(1)).unwrap(),
            Policy::fixed_window("day", 1_000, Duration::from_secs(86_400)).unwrap(),
        ])
        .unwrap();
        for _ in 0..100 {
            assert!(store.check("alice", &set, 9).is_allowed());
            clock.advance(Duration::from_secs(1));
        }
        for i in 0..80 {
            for _ in 0..10 {
                assert!(store.check(&format!("flood:{i}"), &set, 1).is_allowed());
            }
            clock.advance(Duration::from_secs(2));
        }
        assert!(
            store.evicted_live() > 0,
            "the store had to forget live identities"
        );
        let day = store.check("alice", &set, 0).statuses()[1].remaining;
        assert_eq!(day, 100, "alice's day was forgotten");
    }

    /// Of identities with as much at stake, the one whose stake ends first goes: a flood
    /// that spent a per-second quota (`[10 a second, 1,000 a day]`, its day 1% spent)
    /// ranked by the end of its day, so an identity blocked for ten minutes, its login
    /// spent for the hour, was forgotten first, and its block lifted.
    #[test]
    fn of_equal_stakes_the_one_that_ends_first_goes() {
        let (store, _clock) = one_shard(64);
        let login = PolicySet::from(
            Policy::fixed_window("login", 1, Duration::from_secs(3600))
                .unwrap()
                .with_penalty(crate::policy::Penalty::new(
                    1,
                    Duration::from_secs(3600),
                    Duration::from_secs(600),
                ))
                .unwrap(),
        );
        assert!(store.check("alice", &login, 1).is_allowed());
        assert!(store.check("alice", &login, 1).is_blocked());
        let set = PolicySet::new([
            Policy::fixed_window("second", 10, Duration::from_secs(1)).unwrap(),
            Policy::fixed_window("day", 1_000, Duration::from_secs(86_400)).unwrap(),
        ])
        .unwrap();
        for i in 0..80 {
            for _ in 0..10 {
                assert!(store.check(&format!("flood:{i}"), &set, 1).is_allowed());
            }
        }
        assert!(
            store.evicted_live() > 0,
            "the store had to forget live identities"
        );
        assert!(
            store.check("alice", &login, 1).is_blocked(),
            "alice's block was forgotten"
        );
    }

    #[test]
    fn among_equals_spent_counts_only_what_windows_hold() {
        // A set of a window and a GCRA: every identity used today is fresh again at the
        // day's end, and the GCRA's state (a time, not an amount) must not decide which
        // of them is forgotten: the one that spent its day stays.
        let (store, clock) = one_shard(64);
        let set = PolicySet::new([
            Policy::fixed_window("daily", 3, Duration::from_secs(86_400)).unwrap(),
            Policy::gcra("g", Rate::per_second(1_000), 1_000).unwrap(),
        ])
        .unwrap();
        for _ in 0..3 {
            assert!(store.check("spender", &set, 1).is_allowed());
        }
        clock.advance(Duration::from_secs(1));
        for i in 0..80 {
            assert!(store.check(&format!("junk:{i}"), &set, 1).is_allowed());
        }
        assert!(store.evicted_live() > 0);
        assert!(!store.check("spender", &set, 1).is_allowed());
    }

    #[test]
    fn removing_entries_keeps_the_others_in_their_order() {
        let policies = PolicySet::from(Policy::gcra("g", Rate::per_second(1), 1).unwrap());
        let mut table = Table::new(4_096);
        let hasher = foldhash::fast::RandomState::default();
        for i in 0..2_500 {
            let key = format!("k{i}");
            let entry = Entry {
                key: CompactString::from(key.as_str()),
                fresh_at: i,
                slots: Slots::new(&policies),
            };
            table.insert(hasher.hash_one(key.as_str()), entry, None, &hasher);
        }
        // Across chunks (1,024 entries each): every third goes.
        assert_eq!(table.retain(|entry| entry.fresh_at % 3 != 0), 834);
        let order: Vec<u64> = table.slab.iter().map(|entry| entry.fresh_at).collect();
        let expected: Vec<u64> = (0..2_500).filter(|i| i % 3 != 0).collect();
        assert_eq!(order, expected);
    }

    #[test]
    fn a_shard_full_of_held_slots_still_keeps_others_state() {
        // When identities holding slots fill a shard, it makes room from them too (the
        // longest held first), not by forgetting every other identity as the next arrives.
        let (store, clock) = one_shard(32);
        let streams = PolicySet::from(Policy::concurrency("streams", 1).unwrap());
        let hourly =
            PolicySet::from(Policy::fixed_window("hourly", 1, Duration::from_secs(3_600)).unwrap());
        for i in 0..31 {
            assert!(
                store
                    .check(&format!("stream:{i}"), &streams, 1)
                    .is_allowed()
            );
        }
        clock.advance(Duration::from_secs(1));
        assert!(store.check("spender", &hourly, 1).is_allowed());
        for i in 0..3 {
            store.check(&format!("new:{i}"), &hourly, 1);
        }
        assert!(
            !store.check("spender", &hourly, 1).is_allowed(),
            "the spender's hour was forgotten to keep held slots"
        );
        assert!(store.len() <= 32);
    }

    #[test]
    fn identities_holding_slots_are_spared_but_the_bound_holds() {
        let (store, _clock) = one_shard(32);
        let streams = PolicySet::from(Policy::concurrency("streams", 1).unwrap());
        let window =
            PolicySet::from(Policy::fixed_window("api", 5, Duration::from_secs(60)).unwrap());
        assert!(store.check("stream:held", &streams, 1).is_allowed());
        // Identities of another policy flood the shard: the held slot survives them.
        for i in 0..100 {
            store.check(&format!("api:{i}"), &window, 1);
        }
        assert!(!store.check("stream:held", &streams, 1).is_allowed());
        // A shard full of held slots still keeps its bound, forgetting some of them.
        for i in 0..100 {
            store.check(&format!("stream:{i}"), &streams, 1);
        }
        assert!(store.len() <= 32, "{} identities held", store.len());
        assert!(store.evicted_live() > 0);
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
    fn purging_and_evicting_keep_the_others_state() {
        // One shard, so several slab chunks fill and the index is rebuilt after removals.
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(4 * CHUNK)
            .shards(1)
            .build();
        let policies =
            PolicySet::from(Policy::token_bucket("tb", 10, Rate::per_second(1)).unwrap());
        let count = 3 * CHUNK + 5;
        // Even identities take 1 token (full again after 1 s), odd ones 5 (after 5 s).
        let cost = |i: usize| if i.is_multiple_of(2) { 1 } else { 5 };
        for i in 0..count {
            assert!(
                store
                    .check(&format!("id-{i}"), &policies, cost(i))
                    .is_allowed()
            );
        }
        assert_eq!(store.len(), count);
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.purge_fresh(), count.div_ceil(2));
        assert_eq!(store.len(), count / 2);
        // Purging gave the emptied chunks back.
        let chunks = lock(&store.shared.shards[0]).slab.chunks.len();
        assert_eq!(chunks, (count / 2).div_ceil(CHUNK));
        for i in 0..count {
            let decision = store.check(&format!("id-{i}"), &policies, 1);
            // Odd ones kept their state: 10 - 5 + 2 refilled - 1.
            let expected = if i % 2 == 0 { 9 } else { 6 };
            assert_eq!(decision.statuses()[0].remaining, expected, "id-{i}");
        }
        assert_eq!(store.len(), count);
        // A flood of new identities evicts, and every identity held is still found.
        for i in count..count + 2 * CHUNK {
            store.check(&format!("id-{i}"), &policies, 1);
        }
        assert!(store.len() <= store.capacity());
        let held = (0..count + 2 * CHUNK)
            .filter(|i| {
                let key = format!("id-{i}");
                let hash = store.shared.hasher.hash_one(key.as_str());
                lock(&store.shared.shards[0]).find(hash, &key).is_ok()
            })
            .count();
        assert_eq!(held, store.len());
    }

    /// The slots an identity holds for policies that no set it is decided under has any
    /// more (a policy changed by a reload; a resolver that builds policies per request)
    /// go once they are fresh: they were kept for as long as the identity stayed active,
    /// one more per change (a daily log of 10,000 entries each), or without bound when a
    /// client's request chose the policy.
    #[test]
    fn slots_of_policies_no_longer_asked_for_go_once_fresh() {
        let (store, clock) = store(100);
        let held = |store: &MemoryStore<ManualClock>| {
            let hash = store.shared.hasher.hash_one("user");
            let table = lock(store.shard(hash));
            let Ok(index) = table.find(hash, "user") else {
                panic!("the identity is held")
            };
            match &table.slab.get(index).slots {
                Slots::One(_) => 1,
                Slots::Many(many) => many.slots.len(),
            }
        };
        // A reload a second: each version a policy of its own, each spent a little.
        for version in 0..50u64 {
            let set = PolicySet::from(
                Policy::token_bucket("api", 100 + version, Rate::per_second(100)).unwrap(),
            );
            assert!(store.check("user", &set, 10).is_allowed());
            clock.advance(Duration::from_secs(1));
        }
        // Each earlier version refilled within 0.1 s: only the newest is kept.
        assert_eq!(held(&store), 1);
        // Beside a policy that stays spent all day, each version's own state goes once it
        // is fresh (not when the day is).
        let day = Policy::fixed_window("day", 1_000, Duration::from_secs(86_400)).unwrap();
        for burst in 0..50u64 {
            let set = PolicySet::new([
                day.clone(),
                Policy::token_bucket("burst", 100 + burst, Rate::per_second(100)).unwrap(),
            ])
            .unwrap();
            assert!(store.check("user", &set, 10).is_allowed());
            clock.advance(Duration::from_secs(1));
        }
        assert_eq!(held(&store), 2, "the day's and the newest burst's");
        // With two sets in use, neither's state goes while it is not fresh.
        let daily =
            PolicySet::from(Policy::fixed_window("daily", 5, Duration::from_secs(86_400)).unwrap());
        let hourly =
            PolicySet::from(Policy::fixed_window("hourly", 5, Duration::from_secs(3_600)).unwrap());
        for _ in 0..5 {
            assert!(store.check("user", &daily, 1).is_allowed());
            assert!(store.check("user", &hourly, 1).is_allowed());
            clock.advance(Duration::from_secs(1));
        }
        assert!(!store.check("user", &daily, 1).is_allowed());
        assert!(!store.check("user", &hourly, 1).is_allowed());
    }

    /// A shard remembers at most `MAX_CLEARED` clears: one it had to forget while it still
    /// mattered let a settle of a debit made before that reset give its units back into
    /// the state after it. Past the bound, a settle of a debit made before the forgotten
    /// clear, under its policy, gives nothing back, whoever's; other policies' settles
    /// give back as ever.
    #[test]
    fn a_clear_the_shard_cannot_remember_still_forgives() {
        let (store, clock) = one_shard(1_000);
        let hour = Duration::from_secs(3600);
        let policies = PolicySet::from(Policy::fixed_window("h", 10, hour).unwrap());
        let other = PolicySet::from(Policy::fixed_window("other", 10, hour).unwrap());
        clock.advance(Duration::from_secs(1));
        let reserved = store.check("u", &policies, 10);
        assert!(reserved.is_allowed());
        let elsewhere = store.check("v", &other, 4);
        store.reset_now("u", &policies);
        clock.advance(Duration::from_millis(1));
        assert!(store.check("u", &policies, 10).is_allowed());
        for n in 0..MAX_CLEARED {
            store.reset_now(&format!("other-{n}"), &policies);
        }
        let settle = |key: &str, set: &PolicySet, actual: u64, decision: &Decision| {
            let reserved = decision.statuses()[0].limit - decision.statuses()[0].remaining;
            let settle = Adjustment::settle(reserved, actual, decision.receipt());
            store.adjust_now(key, set, &settle).statuses()[0].remaining
        };
        assert_eq!(
            settle("u", &policies, 0, &reserved),
            0,
            "nothing given back"
        );
        assert!(!store.check("u", &policies, 1).is_allowed());
        // Another policy's settle of a debit as old gives back as ever.
        assert_eq!(settle("v", &other, 1, &elsewhere), 9);
        // So does one of a debit made after every clear.
        clock.advance(Duration::from_millis(1));
        let later = store.check("w", &policies, 4);
        assert_eq!(settle("w", &policies, 1, &later), 9);
    }

    /// Past `MAX_FORGOTTEN` policies with a forgotten clear, one record stands for every
    /// policy: a debit under any policy made before it gives nothing back; one made after
    /// gives back as ever.
    #[test]
    fn past_the_forgotten_policies_one_record_forgives_them_all() {
        let (store, clock) = one_shard(1_000);
        let hour = Duration::from_secs(3600);
        let set =
            |n: usize| PolicySet::from(Policy::fixed_window(&format!("p{n}"), 10, hour).unwrap());
        clock.advance(Duration::from_secs(1));
        let lone = set(MAX_FORGOTTEN + 1);
        let before = store.check("u", &lone, 10);
        // One clear of each of `MAX_FORGOTTEN + 1` policies, then enough of one policy to
        // push them all out.
        for n in 0..=MAX_FORGOTTEN {
            store.reset_now("x", &set(n));
        }
        for n in 0..MAX_CLEARED {
            store.reset_now(&format!("y{n}"), &set(0));
        }
        clock.advance(Duration::from_millis(1));
        let after = store.check("w", &lone, 4);
        let settle = |key: &str, reserved: u64, decision: &Decision| {
            let settle = Adjustment::settle(reserved, 0, decision.receipt());
            store.adjust_now(key, &lone, &settle).statuses()[0].remaining
        };
        assert_eq!(settle("u", 10, &before), 0, "nothing given back");
        assert_eq!(settle("w", 4, &after), 10);
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
