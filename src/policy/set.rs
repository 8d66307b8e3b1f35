//! The policies one request must all pass.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::{Policy, PolicyError};

/// The policies a request must all pass, in order. Cheap to clone.
///
/// A request is admitted only when every policy admits it; a denied request debits none.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Policy, PolicySet, Rate};
///
/// let set = PolicySet::new([
///     Policy::token_bucket("burst", 10, Rate::per_second(10))?,
///     Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?,
/// ])?;
/// assert_eq!(set.len(), 2);
/// assert!(PolicySet::new([set[0].clone(), set[0].clone()]).is_err());
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Clone)]
pub struct PolicySet {
    inner: Arc<PolicySetInner>,
}

struct PolicySetInner {
    policies: Box<[Policy]>,
    /// Tells sets of different policies apart (the ids, in order).
    fingerprint: u64,
    /// The fingerprint and the penalties' ids (the same without penalties): tells apart
    /// sets that share rate state but not blocks.
    with_penalties: u64,
    /// This set's own number, never reused in the process (per-thread caches key by it).
    serial: u64,
    /// True when a policy is an in-flight limit.
    in_flight: bool,
    /// True when a policy has a penalty that applies.
    penalties: bool,
    /// One value derived from the set, computed once by whoever needs it (the layer keeps
    /// the set's `RateLimit-Policy` field here): the set itself knows no HTTP.
    derived: OnceLock<Box<dyn Any + Send + Sync>>,
    /// This set without its penalties, made the first time a shadow layer asks.
    unpenalized: OnceLock<PolicySet>,
    /// True for a set made so (`without_penalties`): it decides for requests of a set
    /// with penalties (a waiter, a shadow layer), and is no set of its own.
    penalties_left_out: bool,
}

/// What a set of policies must be: distinct names, shadow policies among the first
/// [`MAX_SHADOW_INDEX`](super::error::MAX_SHADOW_INDEX), shaping ones among the first
/// [`MAX_SHAPING_INDEX`](super::error::MAX_SHAPING_INDEX).
fn check_policies(policies: &[Policy]) -> Result<(), PolicyError> {
    for (i, policy) in policies.iter().enumerate() {
        if policies[..i].iter().any(|p| p.name() == policy.name()) {
            return Err(PolicyError::DuplicateName {
                name: policy.name().to_owned(),
            });
        }
        if policy.is_shadow() && i >= super::error::MAX_SHADOW_INDEX {
            return Err(PolicyError::ShadowTooFar {
                name: policy.name().to_owned(),
            });
        }
        if policy.params().is_shaping() && i >= super::error::MAX_SHAPING_INDEX {
            return Err(PolicyError::ShapingTooFar {
                name: policy.name().to_owned(),
            });
        }
    }
    Ok(())
}

impl fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.inner.policies.iter()).finish()
    }
}

impl PolicySet {
    /// A set of policies with distinct names, shadow policies among the first 52 and
    /// shaping ones among the first 64.
    #[inline]
    pub fn new(policies: impl IntoIterator<Item = Policy>) -> Result<Self, PolicyError> {
        let policies: Vec<Policy> = policies.into_iter().collect();
        check_policies(&policies)?;
        Ok(Self::from_vec(policies))
    }

    /// Whether this set holds what [`new`](Self::new) accepts (a set grown with
    /// [`with`](Self::with) may not: a shadow policy past the first 52, a shaping one past
    /// the first 64).
    pub(crate) fn check(&self) -> Result<(), PolicyError> {
        check_policies(&self.inner.policies)
    }

    /// The empty set: requests it is resolved for are not limited and get no headers.
    pub fn unlimited() -> Self {
        Self::from_vec(Vec::new())
    }

    pub(crate) fn from_vec(policies: Vec<Policy>) -> Self {
        // FNV-1a over the ids, then (marked off) over the penalties' ids.
        let step = |hash: u64, word: u64| (hash ^ word).wrapping_mul(0x0100_0000_01b3);
        let fingerprint = policies
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, policy| {
                step(hash, u64::from(policy.id()))
            });
        let with_penalties = policies
            .iter()
            .enumerate()
            .filter_map(|(index, policy)| Some((index, policy.penalty_box()?.1)))
            .fold(fingerprint, |hash, (index, id)| {
                step(step(hash, u64::MAX - index as u64), u64::from(id))
            });
        static SERIALS: AtomicU64 = AtomicU64::new(1);
        let in_flight = policies.iter().any(|policy| policy.params().is_in_flight());
        let penalties = policies.iter().any(|policy| policy.penalty_box().is_some());
        PolicySet {
            inner: Arc::new(PolicySetInner {
                policies: policies.into_boxed_slice(),
                fingerprint,
                with_penalties,
                serial: SERIALS.fetch_add(1, Ordering::Relaxed),
                in_flight,
                penalties,
                derived: OnceLock::new(),
                unpenalized: OnceLock::new(),
                penalties_left_out: false,
            }),
        }
    }

    /// This set with `policy` added, replacing a policy of the same name, whatever its
    /// mode: `set.with(api.shadow())` drops an enforced `api`. Give a shadow policy a name
    /// of its own (`RateLimitLayer::policy` refuses the mix-up when the layer is built).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, PolicySet, Rate};
    ///
    /// let free = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(10))?);
    /// let pro = free
    ///     .with(Policy::token_bucket("api", 100, Rate::per_second(100))?) // replaces "api"
    ///     .with(Policy::fixed_window("daily", 100_000, Duration::from_secs(86_400))?);
    /// let names: Vec<&str> = pro.iter().map(|policy| policy.name()).collect();
    /// assert_eq!(names, ["api", "daily"]);
    /// assert_eq!(pro[0].limit(), 100);
    /// assert_eq!(free[0].limit(), 10); // the set it was made from is unchanged
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    pub fn with(&self, policy: Policy) -> Self {
        let mut policies: Vec<Policy> = self
            .inner
            .policies
            .iter()
            .filter(|p| p.name() != policy.name())
            .cloned()
            .collect();
        policies.push(policy);
        Self::from_vec(policies)
    }

    /// Equal for sets of the same policies in the same order (by their ids: in-flight
    /// policies of one name are one, whatever their limits).
    pub(crate) fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    /// [`fingerprint`](Self::fingerprint) with the penalties' ids too: the same policies
    /// without a penalty (or with another) share rate state, but not blocks.
    pub(crate) fn fingerprint_with_penalties(&self) -> u64 {
        self.inner.with_penalties
    }

    /// A number no other set in this process has (never 0): clones share it.
    pub(crate) fn serial(&self) -> u64 {
        self.inner.serial
    }

    /// The receipt marks of the set's shaping policies (bit `i` for the policy at `i`),
    /// which a settle or a give-back leaves alone (their units are places in a schedule);
    /// `None` when one sits past the 64 a receipt marks (a set a resolver built per
    /// request, unchecked).
    pub(crate) fn shaping_marks(&self) -> Option<u64> {
        let mut marks = 0u64;
        for (index, policy) in self.iter().enumerate() {
            if policy.params().is_shaping() {
                if index >= 64 {
                    return None;
                }
                marks |= 1 << index;
            }
        }
        Some(marks)
    }

    /// True when a policy of the set is an in-flight limit (its requests hold a slot until
    /// they end).
    #[inline]
    pub(crate) fn has_in_flight(&self) -> bool {
        self.inner.in_flight
    }

    /// The first policy that can never admit `cost` units in one request (a cost above
    /// its quota), leaving out shadow policies (they never refuse) and in-flight limits
    /// (they count requests, not units).
    pub(crate) fn never_admits(&self, cost: u64) -> Option<usize> {
        self.iter().position(|policy| {
            !policy.is_shadow() && !policy.params().is_in_flight() && cost > policy.limit()
        })
    }

    /// True when a policy of the set has a penalty (its state keeps a slot more).
    #[inline]
    pub(crate) fn has_penalties(&self) -> bool {
        self.inner.penalties
    }

    /// This set with no penalty: the same policies on the same rate state, denials that
    /// count towards no block (what a shadow layer decides with: its clients are never
    /// slowed down, so its denials would not all have come under enforcement). Made once
    /// and kept with the set.
    pub(crate) fn without_penalties(&self) -> PolicySet {
        if !self.has_penalties() {
            return self.clone();
        }
        self.inner
            .unpenalized
            .get_or_init(|| {
                let mut set = Self::from_vec(self.iter().map(Policy::without_penalty).collect());
                if let Some(inner) = Arc::get_mut(&mut set.inner) {
                    inner.penalties_left_out = true;
                }
                set
            })
            .clone()
    }

    /// True for a set [`without_penalties`](Self::without_penalties) made from one with
    /// penalties: it decides on the same state for requests of that set.
    pub(crate) fn penalties_left_out(&self) -> bool {
        self.inner.penalties_left_out
    }

    /// True when both are clones of one set.
    pub(crate) fn same_as(&self, other: &PolicySet) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The policies, in order.
    pub fn policies(&self) -> &[Policy] {
        &self.inner.policies
    }

    /// The value derived from this set by `derive`, computed on the first call and kept
    /// with the set. One type per set: a call for another type gets `None`.
    pub(crate) fn derived<T: Any + Send + Sync>(
        &self,
        derive: impl FnOnce(&PolicySet) -> T,
    ) -> Option<&T> {
        self.inner
            .derived
            .get_or_init(|| Box::new(derive(self)))
            .downcast_ref()
    }
}

impl std::ops::Deref for PolicySet {
    type Target = [Policy];

    fn deref(&self) -> &[Policy] {
        &self.inner.policies
    }
}

impl From<Policy> for PolicySet {
    fn from(policy: Policy) -> Self {
        Self::from_vec(vec![policy])
    }
}
