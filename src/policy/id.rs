//! The ids that stores key a policy's state by.
//!
//! The in-process store keeps a key's states tagged with their policy's id: the same for
//! equal name and parameters as decided (rates in lowest terms, the policing leaky bucket
//! as the token bucket, as Redis names its keys), different otherwise, so a changed limit
//! starts from fresh
//! state instead of reading state written under other units (an in-flight policy's
//! state, a count of requests in progress, is kept by name alone), and two sets that share a
//! policy share its state. Ids come in order from one process-wide table, so the first
//! [`MAX_REGISTERED`] distinct policies never share an id by accident, as hashes could.
//! The table is bounded: past it (a resolver that invents policies per request) ids are
//! 31-bit hashes with the top bit set, which never meet a table id but may meet each
//! other (about one pair in 2^31); two such policies then share state only where one
//! identity meets both, and a cached denial of one could answer the other.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard};

use super::Algorithm;

/// Distinct policies given ids from the table; later ones get hashed ids.
pub(crate) const MAX_REGISTERED: usize = 1 << 16;

/// Of each id: the quota of its policy and the time that quota is measured over (a window,
/// or the time a bucket takes to refill from empty), in nanoseconds. What an identity has
/// to lose under the policy is read against them.
pub(crate) struct Measures {
    /// The table's ids, in order.
    table: Vec<(u64, u64)>,
    /// Hashed ids (past the table's bound), the first [`MAX_REGISTERED`] of them seen.
    hashed: Option<HashMap<u32, (u64, u64)>>,
}

impl Measures {
    /// The quota and time of the policy `id`; `None` for a hashed id past the bound.
    #[inline]
    pub(crate) fn of(&self, id: u32) -> Option<(u64, u64)> {
        if id & HASHED == 0 {
            self.table.get(id as usize).copied()
        } else {
            self.hashed.as_ref()?.get(&id).copied()
        }
    }
}

static MEASURES: RwLock<Measures> = RwLock::new(Measures {
    table: Vec::new(),
    hashed: None,
});

/// The quota and time of every id ([`Measures`]).
pub(crate) fn measures() -> RwLockReadGuard<'static, Measures> {
    MEASURES.read().unwrap_or_else(PoisonError::into_inner)
}

/// The top bit: set on hashed ids, never on the table's.
const HASHED: u32 = 0x8000_0000;

/// The id of the policy `name` with `algorithm`, whose quota is `limit` over `window`
/// nanoseconds (recorded, see [`measures`]).
///
/// An in-flight policy's id is its name's alone: its state counts requests in progress,
/// which hold their slots whatever the limit or lease becomes (a reload that raises the
/// limit must not admit a whole new quota beside the requests still running).
pub(super) fn policy_id(name: &str, algorithm: Algorithm, limit: u64, window: u64) -> u32 {
    let algorithm = match algorithm {
        Algorithm::Concurrency { .. } => Algorithm::Concurrency {
            limit: 0,
            lease: std::time::Duration::ZERO,
        },
        other => other,
    };
    type Ids = HashMap<(Box<str>, Algorithm), u32>;
    static IDS: OnceLock<Mutex<Ids>> = OnceLock::new();
    let mut ids = IDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(&id) = ids.get(&(name.into(), algorithm)) {
        return id;
    }
    if ids.len() < MAX_REGISTERED {
        let next = ids.len() as u32;
        ids.insert((name.into(), algorithm), next);
        // Under the table's lock: the measures stay in the ids' order.
        MEASURES
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .table
            .push((limit, window));
        return next;
    }
    drop(ids);
    // A fixed-key hash: the same policy gets the same id in every call.
    let hash =
        foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).hash_one((name, algorithm));
    let id = HASHED | (hash as u32 & !HASHED);
    // Its measures too, while there is room (a resolver that invents policies per request
    // meets them mostly known after the first): looked up before any write.
    let known = measures()
        .hashed
        .as_ref()
        .is_some_and(|hashed| hashed.contains_key(&id) || hashed.len() >= MAX_REGISTERED);
    if !known {
        let mut measures = MEASURES.write().unwrap_or_else(PoisonError::into_inner);
        let hashed = measures.hashed.get_or_insert_with(HashMap::new);
        if hashed.len() < MAX_REGISTERED {
            hashed.entry(id).or_insert((limit, window));
        }
    }
    id
}
