//! What the limiter reports: `tracing` events (feature `tracing`) and `metrics` counters,
//! gauges and histograms (feature `metrics`). Without the features these are no-ops.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `tollgate_decisions_total` | counter | `policy`, `outcome`: `allowed`, `denied` (this policy denied), `passed` (another policy denied), `cost_exceeds_limit`, `shadow_denied` (a shadow policy, or a policy of a shadow layer, would have denied) |
//! | `tollgate_key_errors_total` | counter | `kind`: `client` (answered `400`), `server` (answered `500`: the server is set up wrong; also a network bypass that can read no address for a request whose key was found, which is then decided); a shadow layer's too, which it lets through |
//! | `tollgate_key_missing_allowed_total` | counter | `kind`: requests without a key let through by `MissingKey::Allow` (`server`: what is missing is the server's to set) |
//! | `tollgate_store_errors_total` | counter | `kind`: `unavailable`, `timeout`, `protocol`, `refused`, `unsupported`, `other` |
//! | `tollgate_store_skipped_total` | counter | (the circuit breaker was open) |
//! | `tollgate_plans_unknown_total` | counter | (a plan header named no plan of the configuration: the default plan applied) |
//! | `tollgate_graphql_cost_unread_total` | counter | (a `GraphqlCostLayer` inside the limiter that reads its cost, and no limiter further in to read it: the default charged) |
//! | `tollgate_settles_unreadable_total` | counter | (a response stated its actual cost, for `Settle::from_header`, as no whole number: the reservation stood) |
//! | `tollgate_bypassed_total` | counter | `reason`: `network`, `key`, `predicate` (the request skipped limiting: [`Bypass`](crate::bypass::Bypass)) |
//! | `tollgate_fallback_decisions_total` | counter | `outcome`: `allowed`, `denied`, `cost_exceeds_limit`, `shadow_denied` (a shadow layer's would-be denial, let through) (decisions a failure mode's local limiter made, counted in `tollgate_decisions_total` too) |
//! | `tollgate_fallback_active` | gauge | how many layers (and `Limiter`s) have a failing store, their failure mode applying: 0 when every store answers |
//! | `tollgate_store_latency_seconds` | histogram | time the store took to decide (or to fail); not the answers a deny cache or a lease gave without asking it |
//!
//! Identities never appear in metrics (unbounded label values); denials are `tracing`
//! events at debug level with the key, which is hashed when it is a secret.

use crate::decision::Decision;
use crate::decision::Outcome;
use crate::key::Key;
use crate::policy::PolicySet;
use crate::store::{StoreError, StoreErrorKind};

/// One decision under `policies`. An admitted request with no shadow denial, the common
/// one, logs nothing: it pays one test here, not a call (and, with the `metrics` feature,
/// its count).
#[inline(always)]
pub(crate) fn decision(policies: &PolicySet, decision: &Decision, key: &Key) {
    #[cfg(feature = "metrics")]
    count_decision(policies, decision);
    #[cfg(feature = "tracing")]
    if matches!(decision.outcome(), Outcome::Denied { .. }) || decision.shadow_mask() != 0 {
        log_decision(policies, decision, key);
    }
    #[cfg(not(any(feature = "metrics", feature = "tracing")))]
    let _ = (policies, decision);
    let _ = key;
}

#[cfg(feature = "metrics")]
fn count_decision(policies: &PolicySet, decision: &Decision) {
    for (index, policy) in policies.iter().enumerate() {
        let outcome = match decision.outcome() {
            _ if decision.is_shadow_denied(index) => Counted::ShadowDenied,
            Outcome::Allowed { .. } => Counted::Allowed,
            Outcome::Denied { policy, .. } if policy == index => Counted::Denied,
            Outcome::CostExceedsLimit { policy, .. } if policy == index => {
                Counted::CostExceedsLimit
            }
            _ => Counted::Passed,
        };
        count(policy, outcome);
    }
}

/// The `outcome` label of `tollgate_decisions_total`, for one policy of a decision.
#[cfg(feature = "metrics")]
#[derive(Clone, Copy)]
enum Counted {
    Allowed,
    Denied,
    Passed,
    ShadowDenied,
    CostExceedsLimit,
}

#[cfg(feature = "metrics")]
impl Counted {
    const COUNT: usize = Counted::CostExceedsLimit as usize + 1;

    fn label(self) -> &'static str {
        match self {
            Counted::Allowed => "allowed",
            Counted::Denied => "denied",
            Counted::Passed => "passed",
            Counted::ShadowDenied => "shadow_denied",
            Counted::CostExceedsLimit => "cost_exceeds_limit",
        }
    }
}

/// Counts one decision of `policy` with `outcome` in `tollgate_decisions_total`.
///
/// The policy keeps its keys, one per outcome, each built (labels and hash) the first
/// time it is counted: after that, counting allocates nothing, in any set the policy is
/// in (a resolver that builds sets of the same policies per request included). The
/// recorder is asked at every count, as the `metrics` macros do, so a recorder installed
/// later, or a local one, sees the counts.
#[cfg(feature = "metrics")]
fn count(policy: &crate::policy::Policy, outcome: Counted) {
    type Keys = [std::sync::OnceLock<metrics::Key>; Counted::COUNT];
    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
    let keys = policy.derived(|_| -> Keys { std::array::from_fn(|_| std::sync::OnceLock::new()) });
    // Only this function fills the policy's slot, always with `Keys`.
    let Some(keys) = keys else {
        debug_assert!(false, "a policy's derived value is not its metric keys");
        return;
    };
    let key = keys[outcome as usize].get_or_init(|| {
        metrics::Key::from_parts(
            "tollgate_decisions_total",
            vec![
                metrics::Label::new("policy", policy.name().to_owned()),
                metrics::Label::from_static_parts("outcome", outcome.label()),
            ],
        )
    });
    metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA).increment(1));
}

/// The failure mode's local limiter decided (the store failed, or the breaker kept the
/// request from it): counted in `tollgate_fallback_decisions_total` by outcome, beside
/// the decision's own count, so a denial an outage caused is told from the store's; and
/// a debug event for a denial. A shadow layer's (`shadow`) would-be denial let its
/// request through: `shadow_denied`, as `tollgate_decisions_total` counts it.
#[cold]
pub(crate) fn fallback_decision(decision: &Decision, shadow: bool) {
    let outcome = match decision.outcome() {
        Outcome::Allowed { .. } => "allowed",
        _ if shadow => "shadow_denied",
        Outcome::Denied { .. } => "denied",
        Outcome::CostExceedsLimit { .. } => "cost_exceeds_limit",
    };
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_fallback_decisions_total", "outcome" => outcome).increment(1);
    #[cfg(feature = "tracing")]
    if outcome != "allowed" {
        tracing::debug!(
            target: "tollgate",
            outcome,
            "decided by the failure mode's local limiter, not the store"
        );
    }
    #[cfg(not(any(feature = "metrics", feature = "tracing")))]
    let _ = outcome;
}

/// A denial (debug) and each shadow policy that would have denied (info).
#[cfg(feature = "tracing")]
#[inline(never)]
fn log_decision(policies: &PolicySet, decision: &Decision, key: &Key) {
    if let Outcome::Denied {
        policy,
        retry_after,
    } = decision.outcome()
    {
        tracing::debug!(
            target: "tollgate",
            key = ?key.as_str(),
            policy = policies.get(policy).map_or("", |policy| policy.name()),
            retry_after_ms = retry_after.as_millis() as u64,
            "rate limited"
        );
    }
    if decision.shadow_mask() == 0 {
        return;
    }
    for index in decision.shadow_denied() {
        if let Some(policy) = policies.get(index) {
            tracing::info!(
                target: "tollgate",
                key = ?key.as_str(),
                policy = policy.name(),
                "shadow policy would have denied"
            );
        }
    }
}

/// A shadow layer would have denied: the policy that would have, and the key.
pub(crate) fn shadow_layer_denied(policies: &PolicySet, decision: &Decision, key: &Key) {
    let denying = match decision.outcome() {
        Outcome::Denied { policy, .. } | Outcome::CostExceedsLimit { policy, .. } => policy,
        _ => return,
    };
    #[cfg(feature = "metrics")]
    for (index, policy) in policies.iter().enumerate() {
        let outcome = if index == denying || decision.is_shadow_denied(index) {
            Counted::ShadowDenied
        } else {
            Counted::Passed
        };
        count(policy, outcome);
    }
    #[cfg(feature = "tracing")]
    tracing::info!(
        target: "tollgate",
        key = ?key.as_str(),
        policy = policies.get(denying).map_or("", |policy| policy.name()),
        "shadow layer would have denied"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = key;
    #[cfg(not(any(feature = "metrics", feature = "tracing")))]
    let _ = (policies, denying);
}

/// The store failed. I/O failures are debug events (the failure-mode warning already
/// says the store is away); any other failure is a bug or a misconfiguration, logged at
/// error level the first time each kind, code and wording is seen and again every ten
/// minutes while it goes on (past 64 of them, a new one at most once a minute), and
/// counted every time.
#[inline]
pub(crate) fn store_error(error: &StoreError) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_store_errors_total", "kind" => error.kind().as_str()).increment(1);
    if error.kind().is_io() {
        #[cfg(feature = "tracing")]
        tracing::debug!(target: "tollgate", %error, "rate-limit store error");
    } else if first_of_its_kind(error.kind(), error.code(), &error.message) {
        #[cfg(feature = "tracing")]
        tracing::error!(
            target: "tollgate",
            %error,
            kind = error.kind().as_str(),
            code = error.code().unwrap_or(""),
            "rate-limit store refused to decide: this is a bug or a misconfiguration, not an \
             outage; the failure mode answers meanwhile (logged once per kind of error, \
             again every 10 minutes while it goes on; counted in \
             tollgate_store_errors_total)"
        );
    }
}

/// A settle, a release of in-flight slots, a give-back or an unbooking that did not reach
/// the store (`what` says which): counted as the store error it is and, when that is I/O
/// (a refusal is logged at error level already), said at warn level once per `what` and
/// kind of error, and again every ten minutes while it goes on. A decision's I/O error is
/// a debug line, its outage said by the breaker; a lost settle is a cost never counted (a
/// post-paid request served free, or a refund never given), and a lost release a slot
/// held until its lease ends.
#[cold]
pub(crate) fn adjustment_lost(what: &'static str, error: &StoreError) {
    store_error(error);
    if error.kind().is_io() {
        static SEEN: Seen<(&'static str, StoreErrorKind)> = Seen::new();
        if SEEN.first((what, error.kind())) {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                %error,
                what,
                "rate-limit store failed to settle or free a request's debit: what it used \
                 past (or short of) its reservation is not counted, or its in-flight slot \
                 may be held until its lease ends (the Redis store tries once more to free \
                 it; said once, again every 10 minutes while it goes on; counted in \
                 tollgate_store_errors_total)"
            );
        }
    }
}

/// True the first time this process sees `kind` with `code` and words like `message`'s,
/// and again when it was last told ten minutes ago or more.
/// Redis answers most errors with `ERR` (every script error among them), so the code
/// alone would hide a second fault behind the first. The words are the message's first
/// 160 characters with each word that holds a digit made one `#` (a line number, a key's
/// number, a script's hash): one fault worded with other numbers is the same fault. At
/// most 64 are told apart in a process ([`Seen`]); past them, a new one is logged at
/// most once a minute.
fn first_of_its_kind(kind: StoreErrorKind, code: Option<&str>, message: &str) -> bool {
    static SEEN: Seen<(StoreErrorKind, Box<str>, Box<str>)> = Seen::new();
    /// Adds `word` to `words`, as `#` when it holds a digit.
    fn flush(word: &mut String, words: &mut String) {
        if word.bytes().any(|byte| byte.is_ascii_digit()) {
            words.push('#');
        } else {
            words.push_str(word);
        }
        word.clear();
    }
    let (mut words, mut word) = (String::new(), String::new());
    for c in message.chars().take(160) {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut words);
            words.push(c);
        }
    }
    flush(&mut word, &mut words);
    // Bounded: a store answering ever new words cannot grow this without limit.
    SEEN.first((kind, code.unwrap_or("").into(), words.into()))
}

/// What a process has told, to log a kind of error once, not per request, and again
/// every ten minutes while it goes on (an operator who missed the first line, or fixed a
/// fault that came back, is told again; every occurrence is counted by the caller's
/// metric). At most 64 things are told apart, so errors worded ever anew cannot grow it
/// without limit. Past them, a thing not held is still told, at most once a minute: a
/// new fault after many is never silent.
struct Seen<T> {
    /// Each thing, and the second (since the process's first telling) it was last told.
    told: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<T, u64>>>,
    /// Seconds since the process's first telling past the bound, from which the next
    /// may be told.
    next_overflow: std::sync::atomic::AtomicU64,
}

/// Seconds after which a thing told is told again, when it is met again.
const TELL_AGAIN_AFTER: u64 = 600;

impl<T: Eq + std::hash::Hash> Seen<T> {
    const fn new() -> Self {
        Self {
            told: std::sync::OnceLock::new(),
            next_overflow: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// True when `item` is to be told now: the first time it is met, and again when it
    /// was last told ten minutes ago or more; for an item not held when the set is full,
    /// true at most once a minute.
    fn first(&self, item: T) -> bool
    where
        T: Clone,
    {
        self.first_of(&item, T::clone)
    }

    /// [`first`](Self::first) for a borrowed `item`, made owned (`own`) only when it is
    /// kept: an item seen before costs a lookup, no allocation.
    fn first_of<Q>(&self, item: &Q, own: impl FnOnce(&Q) -> T) -> bool
    where
        T: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_secs();
        self.first_at(item, own, now)
    }

    /// [`first_of`](Self::first_of) at `now` (seconds since the process's first telling).
    fn first_at<Q>(&self, item: &Q, own: impl FnOnce(&Q) -> T, now: u64) -> bool
    where
        T: std::borrow::Borrow<Q>,
        Q: Eq + std::hash::Hash + ?Sized,
    {
        use std::sync::atomic::Ordering;
        {
            let mut told = self
                .told
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(last) = told.get_mut(item) {
                if now.saturating_sub(*last) < TELL_AGAIN_AFTER {
                    return false;
                }
                *last = now;
                return true;
            } else if told.len() < 64 {
                told.insert(own(item), now);
                return true;
            }
        }
        let due = self.next_overflow.load(Ordering::Relaxed);
        now >= due
            && self
                .next_overflow
                .compare_exchange(due, now + 60, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// No key could be extracted, and the request is refused for it (or let through by a
/// shadow layer): counted by kind. A server set up wrong (`KeyErrorKind::Server`: no peer
/// address, no extension from the auth middleware) is logged at error level the first
/// time each reason is seen, since its client is told only that the server is at fault;
/// a client's error is a debug event.
#[cold]
pub(crate) fn key_rejected(error: &crate::key::KeyError) {
    use crate::key::KeyErrorKind;
    let server = error.kind() == KeyErrorKind::Server;
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_key_errors_total",
        "kind" => if server { "server" } else { "client" }
    )
    .increment(1);
    if server && first_reason(&error.to_string()) {
        #[cfg(feature = "tracing")]
        tracing::error!(
            target: "tollgate",
            %error,
            "the rate limiter cannot identify clients: the server is set up wrong, and its \
             requests are answered 500, or let through unlimited by a shadow layer (logged \
             once per reason, again every 10 minutes while it goes on; counted in \
             tollgate_key_errors_total)"
        );
    } else {
        #[cfg(feature = "tracing")]
        tracing::debug!(target: "tollgate", %error, "no rate-limit key");
    }
}

/// A response stating its actual cost unreadably in `header` (not a whole number): the
/// reservation stands. Counted each time, said at warn level once per header name (again
/// every ten minutes while it goes on): a buggy upstream answers so on every response.
#[cold]
pub(crate) fn settle_unreadable(header: &http::HeaderName) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_settles_unreadable_total").increment(1);
    #[cfg(feature = "tracing")]
    {
        static SEEN: Seen<Box<str>> = Seen::new();
        if SEEN.first_of(header.as_str(), |name: &str| Box::from(name)) {
            tracing::warn!(
                target: "tollgate",
                header = %header,
                "the response's actual cost is not a whole number; the reservation stands \
                 (logged once per header, again every 10 minutes while it goes on; counted \
                 in tollgate_settles_unreadable_total)"
            );
        }
    }
    #[cfg(not(feature = "tracing"))]
    let _ = header;
}

/// A network bypass that cannot read the client's address because the server records
/// none (no peer address), for a request whose key was found all the same (a key that
/// reads no address, an API key) or was missing for another want (a client's header):
/// the bypass never matches, so every request it should let through is decided. The
/// server's set-up, as a key's missing peer is: counted with the key errors
/// (`kind="server"`) and logged at error level when `say` (once per allowlist, which one
/// layer's routes share: a lock-free check, as such a server meets it on every request).
#[cold]
pub(crate) fn bypass_without_address(error: &crate::key::KeyError, say: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_key_errors_total", "kind" => "server").increment(1);
    if !say {
        return;
    }
    #[cfg(feature = "tracing")]
    tracing::error!(
        target: "tollgate",
        %error,
        "a network bypass cannot read the client's address: no request skips limiting by \
         network until the server records it (said once; counted in \
         tollgate_key_errors_total)"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = error;
}

/// A request without a key let through unlimited (`MissingKey::Allow`): counted by kind.
/// When what is missing is the server's to set (the auth middleware's extension, which
/// may run after the limiter), every such request passes unlimited: `say` is true for
/// the layer's first one, logged at warn level. Otherwise a debug event.
#[cold]
pub(crate) fn key_missing_allowed(error: &crate::key::KeyError, say: bool) {
    #[cfg(not(any(feature = "metrics", feature = "tracing")))]
    let _ = error;
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_key_missing_allowed_total",
        "kind" => match error.kind() {
            crate::key::KeyErrorKind::Server => "server",
            _ => "client",
        }
    )
    .increment(1);
    if say {
        #[cfg(feature = "tracing")]
        tracing::warn!(
            target: "tollgate",
            "requests without a rate-limit key pass unlimited (MissingKey::Allow): {error}. \
             Expected where only some requests carry it (signed-in clients); a mistake if \
             the middleware that sets it runs after the limiter (logged once per layer, \
             counted in tollgate_key_missing_allowed_total)"
        );
    } else {
        #[cfg(feature = "tracing")]
        tracing::debug!(target: "tollgate", %error, "no rate-limit key; let through");
    }
}

/// A request's plan header names a plan the configuration does not have (a plan renamed
/// by a reload while the auth layer still sends the old name, a value in other case), or
/// comes in several lines (`None`: an auth layer that appends its line to the client's):
/// the request gets the default plan. Counted, and logged at warn level the first time
/// a process sees the value (again every ten minutes while it goes on; at most 64 told
/// apart). The value is the client's: shown escaped when it is no longer than the longest
/// plan name (`longest`) and `SHOWN_PLAN` bytes, as a misspelt plan is; a longer one is
/// never shown, for it may be a credential (an API key sent in the plan header), but
/// named by its length and 32 bits of a hash keyed at random for the process. A value
/// seen before costs a lookup, no allocation.
/// The longest plan header value shown in a log line: a credential is longer (API keys
/// run to 32 characters and more), a plan's name rarely is.
#[cfg(all(feature = "config", feature = "tracing"))]
const SHOWN_PLAN: usize = 16;

#[cfg(feature = "config")]
pub(crate) fn plan_unknown(value: Option<&[u8]>, longest: usize) {
    #[cfg(not(feature = "tracing"))]
    let _ = (value, longest);
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_plans_unknown_total").increment(1);
    #[cfg(feature = "tracing")]
    {
        static SEEN: Seen<Box<[u8]>> = Seen::new();
        // A value longer than any plan's name is no misspelt plan: it may be a
        // credential (an API key sent in the plan header), so it is remembered and
        // shown by a digest, never in clear.
        let withheld = value.filter(|value| value.len() > longest.min(SHOWN_PLAN));
        // Remembered as a line break (which no header value holds) and 32 bits of a hash
        // keyed at random for this process, in hex, on the stack: a value seen before
        // allocates nothing, a log line lets no one check guesses of a secret offline,
        // and a long value costs no more than its first 256 bytes and its length.
        let mut digest = [b'\n'; 9];
        if let Some(value) = withheld {
            use std::hash::BuildHasher;
            static KEYED: std::sync::LazyLock<std::collections::hash_map::RandomState> =
                std::sync::LazyLock::new(std::collections::hash_map::RandomState::new);
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let hash = KEYED.hash_one((&value[..value.len().min(256)], value.len()));
            for (index, byte) in hash.to_be_bytes()[..4].iter().enumerate() {
                digest[1 + 2 * index] = HEX[usize::from(byte >> 4)];
                digest[2 + 2 * index] = HEX[usize::from(byte & 15)];
            }
        }
        let remembered = match (withheld, value) {
            (Some(_), _) => &digest[..],
            (None, Some(value)) => value,
            // Several lines are remembered as a line break alone.
            (None, None) => &digest[..1],
        };
        if !SEEN.first_of(remembered, |value| Box::from(value)) {
            return;
        }
        match (withheld, value) {
            (Some(withheld), _) => tracing::warn!(
                target: "tollgate",
                "a request names a plan the configuration does not have, in a value of \
                 {} bytes, no misspelt plan's (not shown: it may be a credential; told \
                 apart from others by the hash {}, keyed for this process): it gets the \
                 default plan (logged \
                 once per value, again every 10 minutes while it goes on; counted in \
                 tollgate_plans_unknown_total)",
                withheld.len(),
                String::from_utf8_lossy(&digest[1..])
            ),
            (None, Some(value)) => tracing::warn!(
                target: "tollgate",
                "a request names plan {:?}, which the configuration does not have: it gets \
                 the default plan (logged once per value, again every 10 minutes while it \
                 goes on; counted in tollgate_plans_unknown_total)",
                String::from_utf8_lossy(value)
            ),
            (None, None) => tracing::warn!(
                target: "tollgate",
                "a request carries the plan header more than once: it gets the default \
                 plan (the layer that sets it should replace the client's line, not add to \
                 it; logged once, again every 10 minutes while it goes on; counted in \
                 tollgate_plans_unknown_total)"
            ),
        }
    }
}

/// True the first time this process sees a server-side key error with `reason` (and
/// again every ten minutes while it goes on). The set
/// is bounded (an extractor that words its reasons ever anew cannot grow it without
/// limit); past its bound, true at most once a minute, so a new misconfiguration is still
/// logged.
fn first_reason(reason: &str) -> bool {
    static SEEN: Seen<Box<str>> = Seen::new();
    SEEN.first(reason.into())
}

/// A GraphQL coster's cost that no limiter read: the coster sits inside the limiter that
/// reads costs (`FromExtension`), which decided the request before the cost was set, and
/// no limiter further in read it. Counted, and said at error level (once, again every
/// ten minutes while it goes on): every query is charged the limiter's default.
#[cfg(feature = "graphql")]
#[cold]
pub(crate) fn graphql_cost_unread(cost: u64) {
    #[cfg(not(feature = "tracing"))]
    let _ = cost;
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_graphql_cost_unread_total").increment(1);
    #[cfg(feature = "tracing")]
    if first_reason("graphql cost unread") {
        tracing::error!(
            target: "tollgate",
            cost,
            "a GraphqlCostLayer runs inside the rate limiter that reads its cost \
             (FromExtension): the limiter decided each request before the cost was set, so \
             GraphQL costs are never charged (each query pays the limiter's default). Put \
             the GraphqlCostLayer outside the limiter (a .layer() added after it), or a \
             limiter that reads the cost inside it (logged once, again every 10 minutes \
             while it goes on; counted in tollgate_graphql_cost_unread_total)"
        );
    }
}

/// A request skipped limiting ([`Bypass`](crate::bypass::Bypass)): counted by reason.
#[inline]
pub(crate) fn bypassed(reason: crate::bypass::BypassReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_bypassed_total", "reason" => reason.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}

/// The circuit breaker kept a request from the store.
pub(crate) fn store_skipped() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_store_skipped_total").increment(1);
}

/// One layer's (or `Limiter`'s) failure mode started (`true`) or stopped applying. The
/// gauge is the process's and the stores are each layer's: it counts the layers in their
/// failure mode, each transition told by the one caller that made it (a set to 0 by a
/// layer whose store answered again hid another's outage).
#[inline]
pub(crate) fn fallback_active(active: bool) {
    #[cfg(feature = "metrics")]
    if active {
        metrics::gauge!("tollgate_fallback_active").increment(1.0);
    } else {
        metrics::gauge!("tollgate_fallback_active").decrement(1.0);
    }
    let _ = active;
}

/// The store took `elapsed` to decide (or fail).
#[cfg(feature = "metrics")]
#[inline]
fn store_latency(elapsed: std::time::Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("tollgate_store_latency_seconds").record(elapsed.as_secs_f64());
}

/// Times a store call when metrics are on; nothing otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Stopwatch {
    #[inline]
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }

    /// Records the time taken, unless a cache in front of the store answered (the deny
    /// cache, a lease): the store was not asked, and a flood of such answers would hide
    /// its own times.
    #[inline]
    pub(crate) fn stop(self, cached: bool) {
        #[cfg(feature = "metrics")]
        if !cached {
            store_latency(self.started.elapsed());
        }
        #[cfg(not(feature = "metrics"))]
        let _ = cached;
    }
}

#[cfg(test)]
mod tests {
    /// Each reason is logged the first time; past the set's bound, a new reason is still
    /// logged, but at most once a minute.
    #[test]
    fn key_error_reasons_are_logged_once_and_the_set_is_bounded() {
        let logged: Vec<bool> = (0..100)
            .map(|i| super::first_reason(&format!("test reason {i}")))
            .collect();
        assert!(logged[0], "a new reason is logged");
        assert!(
            !super::first_reason("test reason 0"),
            "a reason seen is not"
        );
        let late = logged[70..].iter().filter(|&&l| l).count();
        assert!(late <= 1, "{late} of the last 30 new reasons were logged");
        assert!(logged.iter().filter(|&&l| l).count() <= 65);
    }

    /// A kind of error told once is told again when it goes on ten minutes later: told
    /// once per process, a fault met again after the first line scrolled away (or after
    /// a fix, a week later) was only counted.
    #[test]
    fn a_thing_told_is_told_again_ten_minutes_later() {
        let seen = super::Seen::<Box<str>>::new();
        let at = |now| seen.first_at("NOPERM", |item: &str| Box::from(item), now);
        assert!(at(5), "the first time");
        assert!(!at(6), "a second later");
        assert!(!at(604), "nine minutes and 59 s after");
        assert!(at(605), "ten minutes after");
        assert!(!at(900), "five minutes after the second telling");
        assert!(at(1205), "ten minutes after the second telling");
    }

    /// Store errors alike: past the set's bound (64 kinds: a store that cannot decide
    /// each of many tenants' policies names each), a new kind of error (a `NOPERM` after
    /// an ACL change) is still logged, at most once a minute; it was only counted.
    #[test]
    fn store_errors_past_the_bound_are_still_logged() {
        use crate::store::StoreErrorKind;
        // Words without digits: a digit makes a word one `#`, the same error.
        let name = |i: usize| {
            let letter = |n: usize| char::from(b'a' + (n % 26) as u8);
            format!("tenant-{}{}", letter(i / 26), letter(i))
        };
        let logged: Vec<bool> = (0..100)
            .map(|i| {
                super::first_of_its_kind(
                    StoreErrorKind::Unsupported,
                    None,
                    &format!("policy {:?} cannot be decided exactly", name(i)),
                )
            })
            .collect();
        assert!(logged[0]);
        let late = logged[64..].iter().filter(|&&l| l).count();
        assert_eq!(
            late, 1,
            "{late} of the 36 new errors past the bound were logged"
        );
    }
}
