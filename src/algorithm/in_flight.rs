//! In-flight concurrency limit: at most `limit` requests of a key in progress at once.
//! A request takes one slot when it is admitted and gives it back when it ends
//! ([`InFlight::refund`]); time plays no part in the in-process state.

use super::{Snapshot, Verdict};

/// At most `limit` requests in flight.
///
/// Every request that costs anything takes one slot, whatever its cost, so a request
/// is denied while the slots are taken, and never answered [`Verdict::Never`].
///
/// ```
/// use tollgate::algorithm::{IN_FLIGHT_RETRY, InFlight, InFlightState, MAX_UNITS, Verdict};
///
/// const SECOND: u64 = 1_000_000_000;
/// // Refused: a zero lease, a limit past the bounds.
/// assert_eq!(InFlight::new(2, 0), None);
/// assert_eq!(InFlight::new(MAX_UNITS + 1, 60 * SECOND), None);
///
/// // 2 at once; a shared store keeps a slot 60 s without news of its request.
/// let in_flight = InFlight::new(2, 60 * SECOND).unwrap();
/// let mut state = InFlightState::default();
///
/// // Two requests start at 1 s and 2 s, the second costing 5: one slot each.
/// for now in [SECOND, 2 * SECOND] {
///     in_flight.refresh(&mut state, now); // nothing ages
///     assert_eq!(in_flight.check(&state, now, 5), Verdict::Admit { delay: 0 });
///     in_flight.commit(&mut state, now, 5);
/// }
/// // A third waits for one of them to end, which nothing here foresees.
/// let now = 3 * SECOND;
/// assert_eq!(in_flight.check(&state, now, 1), Verdict::Deny { retry_after: IN_FLIGHT_RETRY });
/// // A request that costs nothing takes no slot.
/// assert_eq!(in_flight.check(&state, now, 0), Verdict::Admit { delay: 0 });
/// // No slot free, no reset time; fresh one lease from now, as a shared store keeps it.
/// let snapshot = in_flight.snapshot(&state, now);
/// assert_eq!((snapshot.remaining, snapshot.reset, snapshot.fresh_at), (0, 0, 63 * SECOND));
///
/// // `refund`: the request that started at 2 s ends and gives its slot back.
/// in_flight.refund(&mut state, now, 1, 2 * SECOND, None);
/// assert_eq!(in_flight.snapshot(&state, now).remaining, 1);
///
/// // No time window (`effective_window`), nothing ever owed (`owed`), any time reads
/// // the state (`floor`).
/// assert_eq!(in_flight.effective_window(&state, now, 1), 0);
/// assert_eq!(in_flight.owed(&state, now), 0);
/// assert_eq!(in_flight.floor(&state), 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    pub(super) limit: u64,
    /// How long a slot is kept without news of its request, in nanoseconds.
    pub(super) lease: u64,
}

/// The slots taken now.
///
/// The default holds none.
///
/// ```
/// use tollgate::algorithm::{InFlight, InFlightState};
///
/// let in_flight = InFlight::new(3, 60_000_000_000).unwrap();
/// let state = InFlightState::default();
/// let snapshot = in_flight.snapshot(&state, 0);
/// assert_eq!((snapshot.remaining, snapshot.fresh_at), (3, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightState {
    pub(super) count: u64,
    /// When the oldest debit this state counts was made (the first since it held none):
    /// a release of a debit made before it was made on a state since forgotten (a full
    /// store's eviction), and frees none of this one's slots.
    pub(super) since: u64,
}

/// What a denied request is told to wait: a slot frees when some request ends, which no
/// state here can foresee.
///
/// ```
/// use tollgate::algorithm::{IN_FLIGHT_RETRY, InFlight, InFlightState, Verdict};
///
/// assert_eq!(IN_FLIGHT_RETRY, 1_000_000_000); // one second
/// let one = InFlight::new(1, 60_000_000_000).unwrap();
/// let mut state = InFlightState::default();
/// one.commit(&mut state, 0, 1);
/// assert_eq!(one.check(&state, 0, 1), Verdict::Deny { retry_after: IN_FLIGHT_RETRY });
/// ```
pub const IN_FLIGHT_RETRY: u64 = 1_000_000_000;

impl InFlight {
    /// At most `limit` requests in flight; a slot is kept at least `lease` nanoseconds
    /// after the key was last decided or adjusted. `None` for a zero lease, or a limit or
    /// lease past [`MAX_UNITS`](super::MAX_UNITS) or [`MAX_NANOS`](super::MAX_NANOS).
    pub fn new(limit: u64, lease: u64) -> Option<Self> {
        super::within_bounds(&[limit], &[lease]).then_some(Self { limit, lease })
    }

    /// The slots a request of `cost` takes: one, or none for a request that spends nothing.
    #[inline]
    fn slots(cost: u64) -> u64 {
        cost.min(1)
    }

    /// Nothing ages: slots come back only when requests end.
    #[inline]
    pub fn refresh(&self, _state: &mut InFlightState, _now: u64) {}

    /// Any time: slots do not age.
    #[inline]
    pub fn floor(&self, _state: &InFlightState) -> u64 {
        0
    }

    /// Is a slot free?
    #[inline]
    pub fn check(&self, state: &InFlightState, _now: u64, cost: u64) -> Verdict {
        if state.count.saturating_add(Self::slots(cost)) <= self.limit {
            Verdict::Admit { delay: 0 }
        } else {
            Verdict::Deny {
                retry_after: IN_FLIGHT_RETRY,
            }
        }
    }

    /// Takes a slot.
    #[inline]
    pub fn commit(&self, state: &mut InFlightState, now: u64, cost: u64) {
        // Another thread's reading may be behind the state's: the earliest counts.
        state.since = if state.count == 0 {
            now
        } else {
            state.since.min(now)
        };
        state.count = state.count.saturating_add(Self::slots(cost));
    }

    /// Gives back `units` slots debited at `at`: none when `at` is before the oldest debit
    /// the state counts (the debit was made on a state since forgotten, and the slots
    /// counted now are other requests'). `at` = 0 or `u64::MAX`: any debit.
    ///
    /// ```
    /// use tollgate::algorithm::{InFlight, InFlightState};
    ///
    /// const SECOND: u64 = 1_000_000_000;
    /// let in_flight = InFlight::new(2, 60 * SECOND).unwrap();
    /// let mut state = InFlightState::default();
    /// // A request admitted at 10 s: the oldest debit the state counts.
    /// in_flight.commit(&mut state, 10 * SECOND, 1);
    /// // The end of a request admitted at 5 s, on a state since forgotten, frees nothing.
    /// in_flight.refund(&mut state, 11 * SECOND, 1, 5 * SECOND, None);
    /// assert_eq!(in_flight.snapshot(&state, 11 * SECOND).remaining, 1);
    /// // The end of the request of 10 s frees its slot (`u64::MAX` or 0: any debit's).
    /// in_flight.refund(&mut state, 11 * SECOND, 1, 10 * SECOND, None);
    /// assert_eq!(in_flight.snapshot(&state, 11 * SECOND).remaining, 2);
    /// ```
    #[inline]
    pub fn refund(
        &self,
        state: &mut InFlightState,
        _now: u64,
        units: u64,
        at: u64,
        _left: Option<u64>,
    ) {
        if at != 0 && at != super::ANY_TIME && at < state.since {
            return;
        }
        state.count = state.count.saturating_sub(units);
    }

    /// No time window: the draft-11 `t` is not sent for this quota.
    #[inline]
    pub fn effective_window(&self, _state: &InFlightState, _now: u64, _remaining: u64) -> u64 {
        0
    }

    /// Nothing: slots are never charged past the limit.
    #[inline]
    pub fn owed(&self, _state: &InFlightState, _now: u64) -> u64 {
        0
    }

    /// The free slots. A key holding slots is fresh one lease past now, as Redis keeps a
    /// slot; the in-process store also keeps a key while any of its slots is held
    /// (`Slot::holds_in_flight`), since its requests always give their slots back.
    #[inline]
    pub fn snapshot(&self, state: &InFlightState, now: u64) -> Snapshot {
        Snapshot {
            remaining: self.limit.saturating_sub(state.count),
            reset: 0,
            fresh_at: if state.count > 0 {
                now.saturating_add(self.lease)
            } else {
                0
            },
        }
    }
}
