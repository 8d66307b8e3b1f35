//! The rate-limit header fields: IETF draft-11 by default, draft-6 and `X-RateLimit-*`
//! on request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::cell::RefCell;

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

use crate::decision::{Decision, Outcome, PolicyStatus};
use crate::policy::{Policy, PolicySet, QuotaUnit};

/// Which rate-limit header fields responses carry. Every response to a request the layer
/// decided gets them, admitted or denied; denied ones also get `Retry-After`. (Requests it
/// did not decide get none: a bypass, a request without a key let through or refused, a
/// store failure answered without a decision, a shadow layer's unless `shadow_headers`.)
///
/// | style | fields |
/// |---|---|
/// | `Draft11` (default) | `RateLimit-Policy: "api";q=10;w=2` and `RateLimit: "api";r=7;t=1`, one list member per policy |
/// | `Draft6` | `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds) for the most restrictive policy (see below) |
/// | `Legacy` | `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (Unix time in seconds, as GitHub) |
/// | `None` | no rate-limit fields (`Retry-After` is still sent on 429, and an inner 429's or 503's is still raised to a quota this layer's request spent until later) |
///
/// `q` and `Limit` are the quota (the most units admitted at once); `w` is the window in
/// seconds (for buckets: the time to refill from empty); `r` and `Remaining` are the units
/// left. `t` is draft-11's *effective window*: the seconds within which the client can use
/// no more than `r` (for a bucket or GCRA, until the next unit arrives; for a fixed window,
/// until it ends; for a sliding log, until its oldest entry leaves; for the sliding
/// counter, until its estimate admits one more unit). `Reset` (draft-6, legacy) is the
/// time until the quota is whole again; on a denial, draft-6's is the `Retry-After` (the
/// same point in time, as draft-6 section 5 asks) and the legacy one is never earlier.
/// `r` and `Remaining` are never above the quota.
/// Seconds are rounded up; every integer is an RFC 9651 integer (at most 15 digits).
///
/// The single-valued styles report the policy that denied, else the enforced one with the
/// fewest units left (a shadow policy shown by `shadow_headers` only when no policy of
/// the set is enforced); an in-flight policy only when it denied or no other enforced
/// one is shown, since a count of requests in progress has no reset: shown alone, it
/// sends no `Reset` field but on a denial (its `Retry-After`).
///
/// Choose one with [`RateLimitLayer::headers`](crate::RateLimitLayer::headers):
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tollgate::key::Global;
/// use tollgate::{HeaderStyle, MemoryStore, Policy, RateLimitLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let service = ServiceBuilder::new()
///     .layer(
///         RateLimitLayer::new(MemoryStore::new())
///             .key(Global)
///             .policy(Policy::fixed_window("api", 10, Duration::from_secs(60))?)
///             .headers(HeaderStyle::Draft6),
///     )
///     .service(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
///     }));
/// let response = service.oneshot(Request::get("/").body(())?).await?;
/// assert_eq!(response.headers()["ratelimit-limit"], "10");
/// assert_eq!(response.headers()["ratelimit-remaining"], "9");
/// assert!(response.headers().get("ratelimit-policy").is_none()); // no draft-11 field
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `draft-ietf-httpapi-ratelimit-headers-11`: `RateLimit-Policy` and `RateLimit`.
    #[default]
    Draft11,
    /// `draft-ietf-httpapi-ratelimit-headers-06`: `RateLimit-Limit/-Remaining/-Reset`.
    Draft6,
    /// `X-RateLimit-Limit/-Remaining/-Reset`, the reset as a Unix timestamp.
    Legacy,
    /// No rate-limit header fields. `Retry-After` is still sent on the layer's own `429`,
    /// and an inner `429`'s or `503`'s is still raised to a quota this layer's request
    /// spent to nothing until later.
    None,
}

impl HeaderStyle {
    /// The response fields this style writes, `Retry-After` included (sent on denials
    /// whatever the style). A browser-facing API names them in CORS's
    /// `Access-Control-Expose-Headers`: none of them is CORS-safelisted, so without it a
    /// page's script sees a 429 but not when to come back.
    ///
    /// ```
    /// use tollgate::HeaderStyle;
    ///
    /// let names: Vec<&str> = HeaderStyle::Draft11.field_names().iter().map(|n| n.as_str()).collect();
    /// assert_eq!(names, ["ratelimit-policy", "ratelimit", "retry-after"]);
    /// assert_eq!(HeaderStyle::None.field_names().len(), 1);
    /// // With tower-http: CorsLayer::new().expose_headers(style.field_names().to_vec())
    /// ```
    pub fn field_names(self) -> &'static [HeaderName] {
        static NONE: [HeaderName; 1] = [header::RETRY_AFTER];
        match self {
            HeaderStyle::Draft11 => &DRAFT11_FIELDS,
            HeaderStyle::Draft6 => &DRAFT6_FIELDS,
            HeaderStyle::Legacy => &LEGACY_FIELDS,
            HeaderStyle::None => &NONE,
        }
    }
}

/// Whole seconds, rounded up: a client told `t=0` would come back too early. (Seconds and
/// the sub-second part, not a 128-bit division of the nanoseconds: this runs for every
/// response.)
pub(crate) fn seconds_ceil(duration: Duration) -> u64 {
    duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0))
}

/// The largest RFC 9651 integer (section 3.3.1: at most 15 digits). Policies cannot
/// exceed it; durations are capped at it.
pub(crate) const MAX_SF_INTEGER: u64 = 999_999_999_999_999;

fn push_number(out: &mut BytesMut, value: u64) {
    out.extend_from_slice(
        itoa::Buffer::new()
            .format(value.min(MAX_SF_INTEGER))
            .as_bytes(),
    );
}

/// The keyed hash behind `pk`: HMAC-SHA-256 of the identity under a secret, so that a
/// `pk` cannot be turned back into an identity from a small space (an IP address, a user
/// number) by hashing guesses. The secret is never printed.
#[derive(Clone)]
pub(crate) struct PartitionKeyer {
    mac: hmac::Hmac<sha2::Sha256>,
    secret_len: usize,
}

/// The shortest partition-key secret the layer accepts.
pub(crate) const MIN_PARTITION_SECRET: usize = 16;

impl PartitionKeyer {
    /// Keyed by `secret` (a fleet shares one for a stable `pk`).
    pub(crate) fn new(secret: &[u8]) -> Self {
        use hmac::Mac;
        Self {
            // HMAC takes keys of any length; this cannot fail.
            mac: hmac::Hmac::new_from_slice(secret).expect("HMAC accepts any key length"),
            secret_len: secret.len(),
        }
    }

    /// The secret's length in bytes (the secret itself is never shown).
    pub(crate) fn secret_len(&self) -> usize {
        self.secret_len
    }

    /// Keyed by 32 random bytes (drawn once per layer).
    pub(crate) fn random() -> Self {
        let mut secret = [0u8; 32];
        if getrandom::fill(&mut secret).is_err() {
            // No OS randomness: fall back on std's randomly keyed hasher, still unknown to
            // clients.
            use std::hash::BuildHasher;
            for (i, chunk) in secret.chunks_mut(8).enumerate() {
                let word = std::collections::hash_map::RandomState::new().hash_one(i);
                chunk.copy_from_slice(&word.to_le_bytes());
            }
        }
        Self::new(&secret)
    }

    /// The first 12 bytes of the MAC of `identity`.
    fn digest(&self, identity: &str) -> [u8; 12] {
        use hmac::Mac;
        let mut mac = self.mac.clone();
        mac.update(identity.as_bytes());
        let tag = mac.finalize().into_bytes();
        let mut out = [0u8; 12];
        out.copy_from_slice(&tag[..12]);
        out
    }
}

impl std::fmt::Debug for PartitionKeyer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PartitionKeyer(secret redacted)")
    }
}

/// Options of the header fields beyond their style.
#[derive(Debug, Clone, Default)]
pub(crate) struct HeaderOptions {
    pub(crate) style: HeaderStyle,
    /// Send `pk` (a keyed hash of the identity) in `RateLimit`.
    pub(crate) partition_key: Option<std::sync::Arc<PartitionKeyer>>,
    /// Add up to this much, at random, to `t`, `Reset` and `Retry-After` (see
    /// [`jittered`]).
    pub(crate) jitter: Duration,
    /// List shadow policies in the fields too (off by default: they are not enforced).
    pub(crate) shadow: bool,
}

impl HeaderOptions {
    /// Whether `policy` is listed in the fields: an enforced one always, a shadow one
    /// when the layer lists them.
    #[inline]
    fn shows(&self, policy: &Policy) -> bool {
        self.shadow || !policy.is_shadow()
    }
}

/// Times shorter than this get no jitter, but those of a long window aligned to the
/// clock: a herd that comes back after a second is no herd.
const JITTER_FROM: Duration = Duration::from_secs(60);

/// `after`, a time `policy` states, with the response's `extra` jitter seconds when it
/// is long, or when it is the end of a long window aligned to the clock (a fixed window
/// of a minute or more): that window's clients come back together when it ends, however
/// soon that is (a daily quota's last minute). A bucket's or a sliding window's short
/// times follow each identity's own use, and a time of zero (room now) is no time to
/// come back.
#[inline]
pub(crate) fn jittered(policy: &Policy, after: Duration, extra: u64) -> Duration {
    let herd = || {
        !after.is_zero() && policy.params().ends_on_the_clock() && policy.window() >= JITTER_FROM
    };
    if extra > 0 && (after >= JITTER_FROM || herd()) {
        after.saturating_add(Duration::from_secs(extra))
    } else {
        after
    }
}

/// A random extra delay in `[0, jitter]`, whole seconds.
pub(crate) fn jitter_secs(jitter: Duration) -> u64 {
    use std::cell::Cell;
    use std::hash::BuildHasher;
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            foldhash::fast::RandomState::default().hash_one(std::thread::current().id()) | 1,
        );
    }
    let max = jitter.as_secs();
    if max == 0 {
        return 0;
    }
    let random = STATE.with(|state| {
        // xorshift64*: plenty for spreading clients, not for secrets.
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    });
    random % (max + 1)
}

/// `pk`: an RFC 9651 byte sequence (section 3.3.5) of the first 12 bytes of the keyed
/// hash of the identity. It lets a client tell its partitions apart without ever seeing
/// an identity.
fn push_partition_key(out: &mut BytesMut, keyer: &PartitionKeyer, key: &str) {
    use base64::Engine;
    out.extend_from_slice(b";pk=:");
    out.extend_from_slice(
        base64::engine::general_purpose::STANDARD
            .encode(keyer.digest(key))
            .as_bytes(),
    );
    out.extend_from_slice(b":");
}

thread_local! {
    /// Header values are cut from a per-thread buffer instead of one allocation each:
    /// every response carries one or three of them. A chunk is freed when the last value
    /// cut from it is dropped.
    static ARENA: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

const ARENA_CHUNK: usize = 8 * 1024;

/// A header value written by `write` into the thread's buffer.
fn value(write: impl FnOnce(&mut BytesMut)) -> Option<HeaderValue> {
    ARENA.with(|arena| {
        let mut arena = arena.borrow_mut();
        if arena.capacity() < 512 {
            arena.reserve(ARENA_CHUNK);
        }
        write(&mut arena);
        HeaderValue::from_maybe_shared(arena.split().freeze()).ok()
    })
}

fn number_value(number: u64) -> HeaderValue {
    value(|out| push_number(out, number)).unwrap_or_else(|| HeaderValue::from(number))
}

thread_local! {
    /// Each thread's own copies of the `RateLimit-Policy` fields it sent last, by set
    /// serial, for fields past [`STATIC_FIELD_BYTES`]. A header value shares its bytes by
    /// reference count: cloning the one copy kept with the set on every response would
    /// make all cores write one cache line.
    static POLICY_FIELDS: RefCell<[(u64, Option<HeaderValue>); POLICY_FIELD_SLOTS]> =
        const { RefCell::new([const { (0, None) }; POLICY_FIELD_SLOTS]) };
}

const POLICY_FIELD_SLOTS: usize = 4;

/// How many bytes of `RateLimit-Policy` fields the process keeps for its whole life, so
/// that a response's copy is a static value: no reference count written, no per-thread
/// look-up. A process has a few fields (one or two per policy set it serves), of tens
/// to hundreds of bytes; past this many bytes (sets made per request with ever new
/// numbers), fields are shared per thread instead. Never freed: this much at most, each
/// text counted with what keeping it costs ([`KEPT_ENTRY_BYTES`]).
const STATIC_FIELD_BYTES: usize = 256 * 1024;

/// How many bytes of `RateLimit` fields the process keeps for its whole life: those sent
/// twice in a row by a thread (see [`LAST_RATE`]), about a hundred bytes each with what
/// keeping one costs ([`KEPT_ENTRY_BYTES`]), so about thirteen hundred. Past this many
/// bytes, a field sent again is shared (its reference count written twice a response).
/// Never freed: this much at most.
const STATIC_RATE_BYTES: usize = 128 * 1024;

/// What a kept text costs beyond its own bytes, counted against a keeper's budget: its
/// allocation, and its place in the process's table and in the table of each thread
/// that sends it (a thread's table is freed when the thread ends).
const KEPT_ENTRY_BYTES: usize = 64;

/// Field texts kept for the life of the process, up to `budget` bytes.
struct Keeper {
    kept: std::sync::Mutex<Kept>,
    /// Once full, no lock: fields past the budget are shared.
    full: std::sync::atomic::AtomicBool,
    budget: usize,
}

struct Kept {
    texts: Option<std::collections::HashSet<&'static str>>,
    bytes: usize,
}

impl Keeper {
    const fn new(budget: usize) -> Self {
        Self {
            kept: std::sync::Mutex::new(Kept {
                texts: None,
                bytes: 0,
            }),
            full: std::sync::atomic::AtomicBool::new(false),
            budget,
        }
    }

    /// `field` as a static value, the same text kept once; `None` once the budget is
    /// spent (or for a field that is not text, which no field of ours is).
    fn keep(&self, field: &HeaderValue) -> Option<HeaderValue> {
        use std::sync::atomic::Ordering;
        let text = field.to_str().ok()?;
        if let Some(same) = KEPT_HERE.with(|here| here.borrow().get(text).copied()) {
            return Some(HeaderValue::from_static(same));
        }
        if self.full.load(Ordering::Relaxed) {
            return None;
        }
        let mut kept = self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let bytes = kept.bytes;
        let texts = kept.texts.get_or_insert_with(Default::default);
        let same = match texts.get(text) {
            Some(same) => *same,
            None if bytes + text.len() + KEPT_ENTRY_BYTES > self.budget => {
                self.full.store(true, Ordering::Relaxed);
                return None;
            }
            None => {
                let leaked: &'static str = Box::leak(text.to_owned().into_boxed_str());
                texts.insert(leaked);
                kept.bytes += leaked.len() + KEPT_ENTRY_BYTES;
                leaked
            }
        };
        KEPT_HERE.with(|here| here.borrow_mut().insert(same));
        Some(HeaderValue::from_static(same))
    }
}

/// The `RateLimit-Policy` fields kept for good (see [`STATIC_FIELD_BYTES`]).
static POLICY_KEEPER: Keeper = Keeper::new(STATIC_FIELD_BYTES);
/// The `RateLimit` fields kept for good (see [`STATIC_RATE_BYTES`]).
static RATE_KEEPER: Keeper = Keeper::new(STATIC_RATE_BYTES);

thread_local! {
    /// The fields kept for good that this thread has met: found again without the
    /// process-wide lock (a resolver that builds its sets per request builds the same
    /// texts again and again).
    static KEPT_HERE: RefCell<std::collections::HashSet<&'static str>> =
        RefCell::new(std::collections::HashSet::new());
}

/// A set's `RateLimit-Policy` field, as kept with the set.
enum PolicyField {
    /// Kept for the life of the process: copied freely.
    Static(HeaderValue),
    /// Past [`STATIC_FIELD_BYTES`]: copied once into each thread that sends it.
    Shared(HeaderValue),
}

/// `field` as a static value, the same text kept once (see [`STATIC_FIELD_BYTES`]);
/// shared once that many bytes are kept.
fn kept_for_good(field: HeaderValue) -> PolicyField {
    match POLICY_KEEPER.keep(&field) {
        Some(kept) => PolicyField::Static(kept),
        None => PolicyField::Shared(field),
    }
}

/// The set's `RateLimit-Policy` field (with its shadow policies or without): built on its
/// first response and kept with the set; a static value, or, past
/// [`STATIC_FIELD_BYTES`], copied once into each thread that sends it.
fn policy_field(set: &PolicySet, shadow: bool) -> Option<HeaderValue> {
    let kept = set.derived(|set| {
        let visible: Vec<Policy> = set.iter().filter(|p| !p.is_shadow()).cloned().collect();
        [policy_header(&visible), policy_header(set)].map(|field| field.map(kept_for_good))
    })?;
    match kept[usize::from(shadow)].as_ref()? {
        PolicyField::Static(field) => Some(field.clone()),
        PolicyField::Shared(field) => per_thread(set, shadow, field),
    }
}

/// This thread's copy of `shared`, the set's field (with its shadow policies or
/// without), made on the thread's first response of the set among its last few.
fn per_thread(set: &PolicySet, shadow: bool, shared: &HeaderValue) -> Option<HeaderValue> {
    // Serials are below 2^63: the low bit tells the two fields of a set apart.
    let serial = (set.serial() << 1) | u64::from(shadow);
    POLICY_FIELDS.with(|fields| {
        let mut fields = fields.borrow_mut();
        if let Some((_, field)) = fields.iter().find(|(s, _)| *s == serial) {
            return field.clone();
        }
        // A copy of the bytes, not a clone: this thread's copy counts its own references.
        let local = HeaderValue::from_bytes(shared.as_bytes()).ok();
        // Most recent first; the oldest goes.
        fields.rotate_right(1);
        fields[0] = (serial, local.clone());
        local
    })
}

/// `"api";q=10;w=2, "daily";q=10000;w=86400`. Names are validated to be plain tokens, so
/// they need no escaping inside the quoted strings.
pub(crate) fn policy_header(policies: &[Policy]) -> Option<HeaderValue> {
    if policies.is_empty() {
        return None;
    }
    let mut out = BytesMut::with_capacity(32 * policies.len());
    for (index, policy) in policies.iter().enumerate() {
        if index > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(b"\"");
        out.extend_from_slice(policy.name().as_bytes());
        out.extend_from_slice(b"\";q=");
        push_number(&mut out, policy.limit());
        // An in-flight quota has no time window: `w` is optional (draft-11, section 3.1).
        if !policy.params().is_in_flight() {
            out.extend_from_slice(b";w=");
            push_number(&mut out, seconds_ceil(policy.window()).max(1));
        }
        match policy.unit() {
            QuotaUnit::Requests => {}
            QuotaUnit::ConcurrentRequests => {
                out.extend_from_slice(b";qu=\"concurrent-requests\"");
            }
            QuotaUnit::ContentBytes => out.extend_from_slice(b";qu=\"content-bytes\""),
            QuotaUnit::GraphqlPoints => {
                out.extend_from_slice(b";tollgate-qu=\"graphql-points\"");
            }
        }
    }
    HeaderValue::from_maybe_shared(out.freeze()).ok()
}

/// Header fields computed for one response, applied when the response exists. Kept
/// small (it lives in every response future): numbers are turned into header values only
/// when applied.
#[derive(Debug, Default)]
pub(crate) enum HeaderBlock {
    /// No rate-limit fields.
    #[default]
    Empty,
    /// No rate-limit fields (`HeaderStyle::None`), and a quota this request spent to
    /// nothing: an inner answer's `Retry-After` is still raised to it.
    Wait(Box<Spent>),
    /// `RateLimit-Policy` and `RateLimit`: list-valued, appended so that a limiter further
    /// in keeps its members.
    Draft11 {
        policy: Option<HeaderValue>,
        /// `None` when the statuses are unknown (a cached denial).
        rate: Option<HeaderValue>,
        /// See [`spent_wait`] (boxed: rare, and the block lives in every response future).
        wait: Option<Box<Spent>>,
    },
    /// `RateLimit-Limit/-Remaining/-Reset` or `X-RateLimit-*`.
    Single {
        legacy: bool,
        limit: u64,
        remaining: u64,
        /// `None` for a count of requests in progress, which never resets on a clock
        /// (a denial's is its `Retry-After`, see `reset_beside`).
        reset: Option<u64>,
        /// See [`spent_wait`] (boxed: rare, and the block lives in every response future).
        wait: Option<Box<Spent>>,
    },
}

impl HeaderBlock {
    /// These fields, less single-valued ones, for a denial answered without the state
    /// of a request of more than one unit: some may be left (3, where 5 were asked), and
    /// those styles must state a count.
    pub(crate) fn without_single(self) -> Self {
        match self {
            HeaderBlock::Single { .. } => HeaderBlock::Empty,
            other => other,
        }
    }

    /// A denial's single-valued reset beside its `Retry-After`: draft-6's the same point
    /// in time (draft-ietf-httpapi-ratelimit-headers-06, section 5: the reset SHOULD
    /// reference it), the legacy style's the time the quota is whole again, moved no
    /// earlier (a client that waits for the reset must not come back before it is let in).
    pub(crate) fn reset_beside(&mut self, retry_after_secs: u64) {
        if let HeaderBlock::Single { legacy, reset, .. } = self {
            let retry = reset_field(*legacy, Duration::from_secs(retry_after_secs));
            *reset = Some(match *reset {
                Some(ours) if *legacy => ours.max(retry),
                _ => retry,
            });
        }
    }

    /// These fields from a layer that enforces nothing (a shadow layer): the quotas it
    /// spent keep no client waiting.
    pub(crate) fn enforcing_nothing(mut self) -> Self {
        if let HeaderBlock::Draft11 { wait, .. } | HeaderBlock::Single { wait, .. } = &mut self {
            *wait = None;
        }
        if let HeaderBlock::Wait(_) = self {
            return HeaderBlock::Empty;
        }
        self
    }

    /// Writes the fields onto a response of the layer's own (a `429`, a `400`).
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        self.write(headers, None);
    }

    /// Writes the fields onto the inner service's response (of `status`), which may carry
    /// fields of a limiter further in.
    #[inline]
    pub(crate) fn apply_to_inner(self, status: StatusCode, headers: &mut HeaderMap) {
        self.write(headers, Some(status));
    }

    /// `inner` is the status of the inner service's response, `None` for the layer's own.
    #[inline]
    fn write(mut self, headers: &mut HeaderMap, inner: Option<StatusCode>) {
        // A limiter further in (or the service) answered with a wait of its own (its
        // `429`, whose cached denial carries no numbers, or a `503`; over gRPC,
        // RESOURCE_EXHAUSTED or UNAVAILABLE). A `Retry-After` on another answer (a
        // redirect's) is no such wait.
        // Read only by a block that has a wait of ours to raise theirs to, or whose
        // single-valued fields give way to theirs: the common draft-11 block (no quota
        // of ours left with none by this request), an empty one, and a shadow layer's
        // or a cached denial's (no wait of ours) look up no `Retry-After`; the list
        // fields join any answer.
        let reads_their_wait = !matches!(
            self,
            HeaderBlock::Empty | HeaderBlock::Draft11 { wait: None, .. }
        );
        let their_wait = inner
            .filter(|_| reads_their_wait)
            .and_then(|status| inner_wait(headers, status));
        // A quota of ours spent until later than that wait ends refuses the client who
        // comes back when told: the wait is raised to ours (draft-11, section 7.2: an
        // intermediary may make the fields more restrictive). Not over gRPC, whose
        // answer states its wait three times (`retry-after`, the pushback and the
        // status details): it stands as the service gave it.
        let raised = match (&self, their_wait) {
            (
                HeaderBlock::Draft11 {
                    wait: Some(spent), ..
                }
                | HeaderBlock::Single {
                    wait: Some(spent), ..
                }
                | HeaderBlock::Wait(spent),
                Some(theirs),
            ) if !super::grpc::asks_to_wait(headers) => {
                // As long as is left of it now (the inner service took its time).
                let now = tokio::time::Instant::now();
                let left = spent.until.saturating_duration_since(now);
                let whole = spent.whole.saturating_duration_since(now);
                Some((seconds_ceil(left), whole, spent.limit)).filter(|(ours, ..)| *ours > theirs)
            }
            _ => None,
        };
        if let Some((wait, whole, limit)) = raised {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(wait));
            // The single-valued fields state the quota that keeps the client waiting:
            // its limit, none left, and its reset (draft-6's the wait itself, the legacy
            // one when it is whole again, no earlier than the wait).
            if let HeaderBlock::Single {
                legacy,
                limit: shown,
                remaining,
                reset,
                ..
            } = &mut self
            {
                (*shown, *remaining) = (limit, 0);
                *reset = Some(reset_field(*legacy, whole));
            }
            self.reset_beside(wait);
        }
        match self {
            HeaderBlock::Empty | HeaderBlock::Wait(_) => {}
            HeaderBlock::Draft11 { policy, rate, .. } => {
                if let Some(policy) = policy {
                    add_to_list(headers, ListField::Policy, policy);
                }
                if let Some(rate) = rate {
                    add_to_list(headers, ListField::Rate, rate);
                }
            }
            HeaderBlock::Single {
                legacy,
                limit,
                remaining,
                reset,
                ..
            } => {
                let [limit_name, remaining_name, reset_name, _] = if legacy {
                    &LEGACY_FIELDS
                } else {
                    &DRAFT6_FIELDS
                };
                // An inner wait: this layer's roomier numbers would contradict it, unless
                // this layer's keeps the client waiting longer (its numbers state it).
                if their_wait.is_some() && raised.is_none() {
                    return;
                }
                // A limiter further in wrote its set already (all three, or no reset for
                // an in-flight limit, which has none; a service's own limit and remaining
                // without a reset read the same): each holds one value, so the more
                // restrictive limit's stay, as within one layer (fewest left, then the
                // latest reset). A set without limit or remaining, or with a field that
                // is no number, is overwritten.
                if inner.is_some()
                    && raised.is_none()
                    && let (Some(_), Some(theirs), Some(their_reset)) = (
                        number_field(headers, limit_name),
                        number_field(headers, remaining_name),
                        headers.get(reset_name).map_or(Some(0), number),
                    )
                    && (theirs, std::cmp::Reverse(their_reset))
                        <= (remaining, std::cmp::Reverse(reset.unwrap_or(0)))
                {
                    return;
                }
                headers.insert(limit_name.clone(), number_value(limit));
                headers.insert(remaining_name.clone(), number_value(remaining));
                match reset {
                    Some(reset) => headers.insert(reset_name.clone(), number_value(reset)),
                    // A further limiter's reset would stand beside numbers not its own.
                    None => headers.remove(reset_name),
                };
            }
        }
    }
}

/// The wait of an inner answer (of `status`, with `headers`) that is one: a `429` or a
/// `503` (over gRPC, RESOURCE_EXHAUSTED or UNAVAILABLE) with a `Retry-After`, in whole
/// seconds (0 for a value that states none).
fn inner_wait(headers: &HeaderMap, status: StatusCode) -> Option<u64> {
    let retry_after = headers.get(header::RETRY_AFTER)?;
    let waiting = status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
        || super::grpc::asks_to_wait(headers);
    waiting.then(|| retry_after_secs(retry_after).unwrap_or(0))
}

/// The wait a `Retry-After` value states, in whole seconds from now (rounded up): its
/// delay-seconds or its HTTP-date (RFC 9110, section 10.2.3; a date past is no wait).
/// `None` for a value that is neither: delay-seconds is `1*DIGIT`, with no sign, point
/// or unit (more digits than a `u64` holds are its largest).
pub(crate) fn retry_after_secs(value: &HeaderValue) -> Option<u64> {
    let value = value.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|byte| byte.is_ascii_digit()) {
        return Some(value.parse().unwrap_or(u64::MAX));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(seconds_ceil(
        at.duration_since(SystemTime::now()).unwrap_or_default(),
    ))
}

/// The number a single-valued field of `headers` holds, if it holds one.
fn number_field(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    number(headers.get(name)?)
}

/// The number a field's `value` holds, if it holds one.
fn number(value: &HeaderValue) -> Option<u64> {
    value.to_str().ok()?.trim().parse().ok()
}

/// Adds `value`'s members to the list field `name`, after those a limiter further in
/// wrote. A field there that is no draft-11 field would make the joined field malformed,
/// and clients ignore a malformed field whole (draft-11, section 7), ours with it: it is
/// replaced by ours. That is a field whose lines, joined, are no Structured Fields List
/// (RFC 9651, section 4.2: an older draft's dictionary, `limit=100, remaining=50`, or
/// garbage), or a List whose members do not name a policy (a String; in `RateLimit`,
/// whose section 4 sets no type, a Token too) with the field's required Integer
/// (sections 3, 3.1, 4 and 4.1: `q` in `RateLimit-Policy`, `r` in `RateLimit`), or one
/// with an empty line (the joined value would start or end with a comma).
#[inline]
fn add_to_list(headers: &mut HeaderMap, field: ListField, value: HeaderValue) {
    // One look-up for the common response, which has no such field: ours is appended,
    // and what was there before is checked only when there was something.
    if headers.append(field.name(), value) {
        keep_well_formed(headers, field);
    }
}

/// draft-11's two list fields.
#[derive(Clone, Copy)]
enum ListField {
    Policy,
    Rate,
}

impl ListField {
    /// The field's name, handed to the map by value (see [`RATELIMIT_POLICY`]).
    #[inline]
    fn name(self) -> HeaderName {
        match self {
            ListField::Policy => RATELIMIT_POLICY,
            ListField::Rate => RATELIMIT,
        }
    }

    /// The Integer parameter each member of the field requires (draft-11, sections 3.1
    /// and 4.1).
    fn required(self) -> &'static str {
        match self {
            ListField::Policy => "q",
            ListField::Rate => "r",
        }
    }
}

/// The list field `field`, whose last line is ours, just appended to a field a limiter
/// further in wrote: kept whole when those lines are a draft-11 field, else ours alone.
#[cold]
#[inline(never)]
fn keep_well_formed(headers: &mut HeaderMap, field: ListField) {
    let required = field.required();
    let http::header::Entry::Occupied(mut occupied) = headers.entry(field.name()) else {
        return;
    };
    let theirs = occupied.iter().count().saturating_sub(1);
    let lines: Option<Vec<&str>> = occupied
        .iter()
        .take(theirs)
        .map(|line| line.to_str().ok().filter(|line| !line.trim().is_empty()))
        .collect();
    let is_field = lines.is_some_and(|lines| {
        sfv::Parser::new(&lines.join(", "))
            .parse::<sfv::List>()
            .is_ok_and(|list| list.iter().all(|member| is_quota_member(member, required)))
    });
    if !is_field && let Some(ours) = occupied.iter().next_back().cloned() {
        occupied.insert(ours);
    }
}

/// True when `member` is a draft-11 field's member: the policy's name (a String in
/// `RateLimit-Policy`, section 3; in `RateLimit`, whose section 4 sets no type, a Token
/// too, as earlier drafts wrote it) with `required` (`q` or `r`) a non-negative Integer,
/// and the optional parameters the draft defines for the field, where present, of their
/// types: `w` (policy) a positive Integer, `t` (rate) a non-negative one, `qu` (policy) a
/// String, `pk` a Byte Sequence (sections 3.1 and 4.1). Other parameters are comments.
fn is_quota_member(member: &sfv::ListEntry, required: &str) -> bool {
    let sfv::ListEntry::Item(item) = member else {
        return false;
    };
    let count = |value: &sfv::BareItem| {
        value
            .as_integer()
            .is_some_and(|number| i64::from(number) >= 0)
    };
    (item.bare_item.as_string().is_some()
        || (required == "r" && item.bare_item.as_token().is_some()))
        && item
            .params
            .iter()
            .any(|(key, value)| key.as_str() == required && count(value))
        && item
            .params
            .iter()
            .all(|(key, value)| match (required, key.as_str()) {
                ("q", "q") | ("r", "r" | "t") => count(value),
                // A window is non-zero (section 3.1.3).
                ("q", "w") => value
                    .as_integer()
                    .is_some_and(|number| i64::from(number) > 0),
                ("q", "qu") => value.as_string().is_some(),
                (_, "pk") => value.as_byte_sequence().is_some(),
                _ => true,
            })
}

/// Each style's fields, in the order `apply` writes them, then `Retry-After` (a denial's):
/// what [`HeaderStyle::field_names`] lists.
/// draft-11's two fields. Constants, not statics: a map given an owned name keeps it,
/// where given a borrowed one it clones it (one indirect call, on every response).
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static DRAFT11_FIELDS: [HeaderName; 3] = [RATELIMIT_POLICY, RATELIMIT, header::RETRY_AFTER];
static DRAFT6_FIELDS: [HeaderName; 4] = [
    HeaderName::from_static("ratelimit-limit"),
    HeaderName::from_static("ratelimit-remaining"),
    HeaderName::from_static("ratelimit-reset"),
    header::RETRY_AFTER,
];
static LEGACY_FIELDS: [HeaderName; 4] = [
    HeaderName::from_static("x-ratelimit-limit"),
    HeaderName::from_static("x-ratelimit-remaining"),
    HeaderName::from_static("x-ratelimit-reset"),
    header::RETRY_AFTER,
];

/// The policy a single-valued style reports: the one that denied, else the one with the
/// fewest units left (the longest reset on a tie).
///
/// An in-flight policy is reported only when it denied or nothing else is shown: these
/// styles tell when a quota resets, and a count of requests in progress never resets on a
/// clock (its slots come back as requests end).
fn most_restrictive(
    decision: &Decision,
    policies: &PolicySet,
    shown: impl Fn(&Policy) -> bool,
) -> Option<usize> {
    match decision.outcome() {
        Outcome::Denied { policy, .. } | Outcome::CostExceedsLimit { policy, .. } => Some(policy),
        _ => {
            let fewest_left = |rated: bool| {
                decision
                    .statuses()
                    .iter()
                    .enumerate()
                    .filter(|(index, _)| {
                        policies.get(*index).is_some_and(|policy| {
                            shown(policy) && (!rated || !policy.params().is_in_flight())
                        })
                    })
                    .min_by(|(_, a), (_, b)| {
                        a.remaining.cmp(&b.remaining).then(b.reset.cmp(&a.reset))
                    })
                    .map(|(index, _)| index)
            };
            fewest_left(true).or_else(|| fewest_left(false))
        }
    }
}

/// A reset `after` from now, in the style's unit: seconds from now, or (legacy) the Unix
/// time in seconds, rounded up.
fn reset_field(legacy: bool, after: Duration) -> u64 {
    if legacy {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        seconds_ceil(now.saturating_add(after))
    } else {
        seconds_ceil(after)
    }
}

/// The `t` of one status of `policy`, in whole seconds (rounded up), with `extra`
/// jitter seconds when they apply (see [`jittered`]).
pub(crate) fn effective_secs(policy: &Policy, effective_window: Duration, extra: u64) -> u64 {
    seconds_ceil(jittered(policy, effective_window, extra))
}

/// True when the policy at `index` is the one blocked whenever its set's answer is a
/// block: the only policy of the set with a penalty. (A block's answer names the policy
/// that keeps the client waiting longest, which may be another, with units left.)
pub(crate) fn blocks_alone(policies: &PolicySet, index: usize) -> bool {
    policies
        .get(index)
        .is_some_and(|policy| policy.penalty_box().is_some())
        && policies
            .iter()
            .filter(|policy| policy.penalty_box().is_some())
            .count()
            == 1
}

/// The `RateLimit` field of a block answered without the state (a deny cache's): the
/// blocked policy has none left until its wait is over, as the store's own answer says.
/// `None` for any other answer without statuses: the numbers now are not known.
fn blocked_rate(
    options: &HeaderOptions,
    policies: &PolicySet,
    decision: &Decision,
    key: &str,
    extra: u64,
) -> Option<HeaderValue> {
    let Outcome::Denied {
        policy,
        retry_after,
    } = decision.outcome()
    else {
        return None;
    };
    let shown = policies.get(policy)?;
    if !decision.is_blocked() || !blocks_alone(policies, policy) || !options.shows(shown) {
        return None;
    }
    value(|out| {
        out.extend_from_slice(b"\"");
        out.extend_from_slice(shown.name().as_bytes());
        out.extend_from_slice(b"\";r=0;t=");
        push_number(out, effective_secs(shown, retry_after, extra));
        if let Some(keyer) = &options.partition_key {
            push_partition_key(out, keyer, key);
        }
    })
}

/// The most policies whose numbers the thread's last `RateLimit` field is kept for.
const REMEMBERED_POLICIES: usize = 4;

/// The `RateLimit` field a thread wrote last, and what it was written from: a set's
/// serial (with the shadow flag in its low bit) and each listed policy's numbers.
struct LastRate {
    set: u64,
    listed: usize,
    numbers: [(u64, Option<u64>); REMEMBERED_POLICIES],
    field: HeaderValue,
    /// `field` is kept for good, or could not be (see [`STATIC_RATE_BYTES`]).
    kept: bool,
}

thread_local! {
    /// A client well within its quota is told the same numbers response after response
    /// (a bucket refilled by the next request: its limit less the cost, `t=1`), and so
    /// are the many such clients of one set: the field written last is copied again when
    /// its numbers are the same, instead of written (two numbers formatted, the text
    /// checked, a reference count written). A field sent twice in a row is kept for
    /// good (see [`STATIC_RATE_BYTES`]), so that its copies are static values. Never
    /// with a partition key, which differs per client.
    static LAST_RATE: RefCell<Option<LastRate>> = const { RefCell::new(None) };
}

/// The `RateLimit` field: each shown policy's remaining units and, but for an in-flight
/// quota (its `t` is optional, draft-11, section 4.1, and it has none), its effective
/// window in seconds. `None` when no policy is shown.
fn rate_field(
    options: &HeaderOptions,
    policies: &PolicySet,
    statuses: &[PolicyStatus],
    key: &str,
    extra: u64,
) -> Option<HeaderValue> {
    let number = |policy: &Policy, status: &PolicyStatus| {
        let remaining = status.remaining.min(policy.limit());
        let window = (!policy.params().is_in_flight())
            .then(|| effective_secs(policy, status.effective_window, extra));
        (remaining, window)
    };
    let mut numbers = [(0, None); REMEMBERED_POLICIES];
    let mut listed = 0;
    let mut remembered = options.partition_key.is_none();
    for (policy, status) in policies.iter().zip(statuses) {
        if !options.shows(policy) {
            continue;
        }
        match numbers.get_mut(listed) {
            Some(slot) => *slot = number(policy, status),
            None => remembered = false,
        }
        listed += 1;
    }
    if listed == 0 {
        return None;
    }
    let set = (policies.serial() << 1) | u64::from(options.shadow);
    let same =
        |last: &LastRate| last.set == set && last.listed == listed && last.numbers == numbers;
    if remembered
        && let Some(field) = LAST_RATE.with_borrow_mut(|last| {
            let last = last.as_mut().filter(|last| same(last))?;
            // Sent again: kept for good, so that each copy is a static value.
            if !last.kept {
                last.kept = true;
                if let Some(kept) = RATE_KEEPER.keep(&last.field) {
                    last.field = kept;
                }
            }
            Some(last.field.clone())
        })
    {
        return Some(field);
    }
    let field = value(|out| {
        let mut written = 0;
        for (policy, status) in policies.iter().zip(statuses) {
            if !options.shows(policy) {
                continue;
            }
            if written > 0 {
                out.extend_from_slice(b", ");
            }
            let (remaining, window) = numbers
                .get(written)
                .copied()
                .unwrap_or_else(|| number(policy, status));
            written += 1;
            out.extend_from_slice(b"\"");
            out.extend_from_slice(policy.name().as_bytes());
            out.extend_from_slice(b"\";r=");
            push_number(out, remaining);
            if let Some(window) = window {
                out.extend_from_slice(b";t=");
                push_number(out, window);
            }
            if let Some(keyer) = &options.partition_key {
                push_partition_key(out, keyer, key);
            }
        }
    })?;
    if remembered {
        LAST_RATE.set(Some(LastRate {
            set,
            listed,
            numbers,
            field: field.clone(),
            kept: false,
        }));
    }
    Some(field)
}

/// The header fields for `decision` under `policies` for `key`. `extra` is the jitter
/// (whole seconds) drawn for this response, added to long effective windows.
pub(crate) fn rate_limit_headers(
    options: &HeaderOptions,
    policies: &PolicySet,
    decision: &Decision,
    key: &str,
    extra: u64,
) -> HeaderBlock {
    // Draft-11 with the statuses, the common response, is laid out here; the other
    // styles and a denial answered without the state, out of line, so that a response
    // runs through fewer lines of code.
    match options.style {
        HeaderStyle::Draft11 if !decision.statuses().is_empty() => {
            match rate_field(options, policies, decision.statuses(), key, extra) {
                Some(rate) => HeaderBlock::Draft11 {
                    policy: policy_field(policies, options.shadow),
                    rate: Some(rate),
                    wait: spent_wait(policies, decision, extra),
                },
                None => HeaderBlock::Empty,
            }
        }
        _ => other_headers(options, policies, decision, key, extra),
    }
}

/// [`rate_limit_headers`] of any style but draft-11 with the decision's statuses (the
/// draft-11 fields of a decision without them are here).
#[inline(never)]
fn other_headers(
    options: &HeaderOptions,
    policies: &PolicySet,
    decision: &Decision,
    key: &str,
    extra: u64,
) -> HeaderBlock {
    let statuses = decision.statuses();
    let shown = |policy: &Policy| options.shows(policy);
    match options.style {
        // No fields, but a wait to raise an inner one's to (see `write`).
        HeaderStyle::None => {
            spent_wait(policies, decision, extra).map_or(HeaderBlock::Empty, HeaderBlock::Wait)
        }
        // A denial answered without the statuses (a deny cache's): the decision with
        // them is `rate_limit_headers`'s own.
        HeaderStyle::Draft11 => HeaderBlock::Draft11 {
            policy: policy_field(policies, options.shadow),
            rate: blocked_rate(options, policies, decision, key, extra),
            wait: None,
        },
        HeaderStyle::Draft6 | HeaderStyle::Legacy => {
            let legacy = options.style == HeaderStyle::Legacy;
            // One policy's numbers: an enforced one's while the set has one. A shadow
            // policy shown beside it (past its limit, the one with the fewest left) would
            // hold back the clients that pace themselves by the field, under a limit that
            // is never enforced.
            let Some(index) = most_restrictive(decision, policies, |policy| !policy.is_shadow())
                .or_else(|| most_restrictive(decision, policies, shown))
            else {
                return HeaderBlock::Empty;
            };
            let Some(policy) = policies.get(index) else {
                return HeaderBlock::Empty;
            };
            let Some(status) = statuses.get(index) else {
                // A denial answered without the store (the deny cache keeps no
                // statuses): the policy's limit, none left, and the reset is its wait;
                // the legacy one is when the quota is whole again, at most, from the wait
                // (see `Params::whole_after`; what is owed is in the wait).
                return match decision.outcome() {
                    Outcome::Denied { retry_after, .. } if shown(policy) => {
                        let params = policy.params();
                        let after = if legacy && !params.ends_on_the_clock() {
                            let wait = u64::try_from(retry_after.as_nanos()).unwrap_or(u64::MAX);
                            let whole = Duration::from_nanos(params.whole_after(wait));
                            retry_after.max(jittered(policy, whole, extra))
                        } else {
                            retry_after
                        };
                        HeaderBlock::Single {
                            legacy,
                            limit: policy.limit(),
                            remaining: 0,
                            reset: (!params.is_in_flight()).then(|| reset_field(legacy, after)),
                            wait: None,
                        }
                    }
                    _ => HeaderBlock::Empty,
                };
            };
            // Long resets carry the response's jitter, as `t` and `Retry-After` do. Kept
            // to the nanosecond: the field rounds up once.
            let after = jittered(policy, status.reset, extra);
            HeaderBlock::Single {
                legacy,
                limit: status.limit,
                remaining: status.remaining.min(status.limit),
                reset: (!policy.params().is_in_flight()).then(|| reset_field(legacy, after)),
                wait: spent_wait(policies, decision, extra),
            }
        }
    }
}

/// Until when a request this layer admitted leaves the next one refused: the end of the
/// longest `t` of an enforced quota it left with none (and that quota's limit), `None`
/// when none. A limiter further in, or the service, that answers with a shorter wait
/// would send its client back too early (see [`HeaderBlock::write`]).
fn spent_wait(policies: &PolicySet, decision: &Decision, extra: u64) -> Option<Box<Spent>> {
    if !decision.is_allowed() {
        return None;
    }
    let (policy, status) = policies
        .iter()
        .zip(decision.statuses())
        .filter(|(policy, status)| {
            status.remaining == 0 && !policy.is_shadow() && !policy.params().is_in_flight()
        })
        .max_by_key(|(policy, status)| jittered(policy, status.effective_window, extra))?;
    // No field states more than the largest integer, and no clock reaches past it.
    let now = tokio::time::Instant::now();
    let at = |after: Duration| now.checked_add(after.min(Duration::from_secs(MAX_SF_INTEGER)));
    Some(Box::new(Spent {
        until: at(jittered(policy, status.effective_window, extra))?,
        whole: at(jittered(policy, status.reset, extra))?,
        limit: status.limit,
    }))
}

/// A quota a request spent to nothing: when it takes the next request (on the runtime's
/// clock), and its limit. See [`spent_wait`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spent {
    until: tokio::time::Instant,
    /// When it is whole again (the legacy style's reset).
    whole: tokio::time::Instant,
    limit: u64,
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::{Policy, Rate};

    /// Jitter goes on long times, and on any time but zero (room now) of a fixed window
    /// of a minute or longer; never on a bucket's, a sliding window's or a lease's short
    /// times, nor on a short window's.
    #[test]
    fn jitter_goes_where_a_herd_comes_back() {
        let secs = Duration::from_secs;
        let hourly = Policy::fixed_window("h", 10, secs(3600)).unwrap();
        let sliding = Policy::sliding_window("s", 10, secs(60)).unwrap();
        let minute = Policy::fixed_window("m", 10, secs(60)).unwrap();
        let second = Policy::fixed_window("s", 10, secs(1)).unwrap();
        let bucket = Policy::token_bucket("b", 100, Rate::per_hour(100)).unwrap();
        let lease = Policy::concurrency_with_lease("c", 1, secs(600)).unwrap();
        for (policy, after, jittered_to) in [
            (&hourly, secs(5), secs(12)),
            (&hourly, secs(3600), secs(3607)),
            (&minute, secs(1), secs(8)),
            (&hourly, Duration::ZERO, Duration::ZERO),
            (&sliding, secs(1), secs(1)),
            (&sliding, secs(60), secs(67)),
            (&second, secs(1), secs(1)),
            (&bucket, secs(36), secs(36)),
            (&bucket, secs(60), secs(67)),
            (&lease, secs(1), secs(1)),
        ] {
            assert_eq!(
                jittered(policy, after, 7),
                jittered_to,
                "{policy:?} {after:?}"
            );
            assert_eq!(jittered(policy, after, 0), after, "no jitter drawn");
        }
    }

    /// `w` (draft-11, section 3.1) says whether a quota has a time window, which is the
    /// algorithm's to say, not the advertised unit's: a rate limit advertised in
    /// `concurrent-requests` still has one, an in-flight limit advertised in requests
    /// still has none.
    #[test]
    fn the_window_is_sent_by_the_algorithm_not_by_the_unit() {
        let bucket = Policy::token_bucket("b", 10, Rate::per_second(5))
            .unwrap()
            .with_unit(QuotaUnit::ConcurrentRequests);
        let field = policy_header(&[bucket]).unwrap();
        assert_eq!(
            field.to_str().unwrap(),
            "\"b\";q=10;w=2;qu=\"concurrent-requests\""
        );
        let in_flight = Policy::concurrency("c", 2)
            .unwrap()
            .with_unit(QuotaUnit::Requests);
        let field = policy_header(&[in_flight]).unwrap();
        assert_eq!(field.to_str().unwrap(), "\"c\";q=2");
    }

    #[test]
    fn seconds_round_up_without_overflow() {
        assert_eq!(seconds_ceil(Duration::ZERO), 0);
        assert_eq!(seconds_ceil(Duration::from_nanos(1)), 1);
        assert_eq!(seconds_ceil(Duration::from_secs(1)), 1);
        assert_eq!(seconds_ceil(Duration::new(1, 1)), 2);
        assert_eq!(seconds_ceil(Duration::new(59, 999_999_999)), 60);
        assert_eq!(seconds_ceil(Duration::MAX), u64::MAX);
    }

    fn set() -> PolicySet {
        PolicySet::new([
            Policy::token_bucket("api", 20, Rate::per_second(10)).unwrap(),
            Policy::fixed_window("daily", 1000, Duration::from_secs(86_400)).unwrap(),
        ])
        .unwrap()
    }

    fn decision(outcome: Outcome) -> Decision {
        Decision::new(
            outcome,
            vec![
                PolicyStatus {
                    limit: 20,
                    remaining: 17,
                    reset: Duration::from_millis(300),
                    effective_window: Duration::from_millis(100),
                },
                PolicyStatus {
                    limit: 1000,
                    remaining: 990,
                    reset: Duration::from_secs(3600),
                    effective_window: Duration::from_secs(3600),
                },
            ],
        )
    }

    fn render(style: HeaderStyle, outcome: Outcome) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let options = HeaderOptions {
            style,
            ..HeaderOptions::default()
        };
        rate_limit_headers(&options, &set(), &decision(outcome), "ip:1", 0).apply(&mut headers);
        headers
    }

    #[test]
    fn each_set_gets_its_own_policy_field_past_the_per_thread_cache() {
        // Fields shared per thread (past what the process keeps for good), for more sets
        // than the per-thread cache holds, in rotation and back: a field copied for one
        // set is never sent for another, including an equal-looking set built later (its
        // own serial).
        let sent = |set: &PolicySet| per_thread(set, false, &policy_header(set).unwrap());
        let sets: Vec<PolicySet> = (1..=POLICY_FIELD_SLOTS as u64 + 2)
            .map(|limit| {
                PolicySet::from(Policy::token_bucket("api", limit, Rate::per_second(1)).unwrap())
            })
            .collect();
        for _ in 0..3 {
            for (index, set) in sets.iter().enumerate() {
                assert_eq!(
                    sent(set).unwrap(),
                    format!("\"api\";q={};w={}", index + 1, index + 1).as_str()
                );
            }
        }
        let rebuilt = PolicySet::from(Policy::token_bucket("api", 1, Rate::per_second(1)).unwrap());
        let copy = sent(&rebuilt).unwrap();
        assert_eq!(copy, "\"api\";q=1;w=1");
        // This thread's own copy, kept: sent again as it is.
        assert_eq!(
            sent(&rebuilt).unwrap().as_bytes().as_ptr(),
            copy.as_bytes().as_ptr()
        );
    }

    /// Sets built per request from the same policies (a resolver) give the same text
    /// each time: kept once, and sent as the one static value.
    #[test]
    fn a_field_built_again_is_the_same_static_value() {
        let policy = Policy::token_bucket("rebuilt", 7, Rate::per_second(7)).unwrap();
        let fields: Vec<HeaderValue> = (0..3)
            .map(|_| policy_field(&PolicySet::from(policy.clone()), false).unwrap())
            .collect();
        assert_eq!(fields[0], "\"rebuilt\";q=7;w=1");
        assert!(
            fields
                .iter()
                .all(|field| field.as_bytes().as_ptr() == fields[0].as_bytes().as_ptr())
        );
    }

    /// The `RateLimit` field of one allowed decision whose statuses are `numbers`
    /// (remaining, effective window) under `policies`.
    fn rate_of(
        options: &HeaderOptions,
        policies: &PolicySet,
        numbers: &[(u64, Duration)],
        key: &str,
        extra: u64,
    ) -> HeaderValue {
        let statuses: Vec<PolicyStatus> = policies
            .iter()
            .zip(numbers)
            .map(|(policy, &(remaining, window))| PolicyStatus {
                limit: policy.limit(),
                remaining,
                reset: window,
                effective_window: window,
            })
            .collect();
        let allowed = Outcome::Allowed {
            delay: Duration::ZERO,
        };
        let decision = Decision::new(allowed, statuses);
        match rate_limit_headers(options, policies, &decision, key, extra) {
            HeaderBlock::Draft11 {
                rate: Some(rate), ..
            } => rate,
            _ => panic!("no RateLimit field"),
        }
    }

    /// The field written last is sent again only for the very numbers it was written
    /// from: the same set (not an equal-looking one), the same shown policies, remaining
    /// units and windows (jitter included), and never with a partition key.
    #[test]
    fn the_last_rate_field_is_sent_again_only_for_the_same_numbers() {
        let second = Duration::from_secs(1);
        let options = HeaderOptions::default();
        let api = PolicySet::from(Policy::token_bucket("api", 20, Rate::per_second(10)).unwrap());
        let first = rate_of(&options, &api, &[(19, second)], "ip:1", 0);
        assert_eq!(first, "\"api\";r=19;t=1");
        // Sent twice in a row: kept for good, and the same static value from then on.
        let again = rate_of(&options, &api, &[(19, second)], "ip:2", 0);
        let third = rate_of(&options, &api, &[(19, second)], "ip:3", 0);
        assert_eq!(again, "\"api\";r=19;t=1");
        assert_eq!(again.as_bytes().as_ptr(), third.as_bytes().as_ptr());
        // Kept for good: the text the process keeps, not a copy of its own.
        let kept = RATE_KEEPER.keep(&first).unwrap();
        assert_eq!(kept.as_bytes().as_ptr(), again.as_bytes().as_ptr());
        assert_eq!(
            rate_of(&options, &api, &[(18, second)], "ip:1", 0),
            "\"api\";r=18;t=1"
        );
        assert_eq!(
            rate_of(&options, &api, &[(18, 2 * second)], "ip:1", 0),
            "\"api\";r=18;t=2"
        );
        // Another set with the same numbers: its own name.
        let other =
            PolicySet::from(Policy::token_bucket("other", 20, Rate::per_second(10)).unwrap());
        assert_eq!(
            rate_of(&options, &other, &[(18, 2 * second)], "ip:1", 0),
            "\"other\";r=18;t=2"
        );
        // A window that takes jitter: the extra seconds are part of the numbers.
        let daily = PolicySet::from(
            Policy::fixed_window("daily", 1000, Duration::from_secs(86_400)).unwrap(),
        );
        let hour = Duration::from_secs(3600);
        assert_eq!(
            rate_of(&options, &daily, &[(990, hour)], "ip:1", 0),
            "\"daily\";r=990;t=3600"
        );
        assert_eq!(
            rate_of(&options, &daily, &[(990, hour)], "ip:1", 5),
            "\"daily\";r=990;t=3605"
        );
        // A shadow policy: listed or not as the layer says, with the same numbers.
        let shadowed = PolicySet::new([
            Policy::token_bucket("api", 20, Rate::per_second(10)).unwrap(),
            Policy::token_bucket("trial", 5, Rate::per_second(1))
                .unwrap()
                .shadow(),
        ])
        .unwrap();
        let numbers = [(19, second), (4, second)];
        let listing = HeaderOptions {
            shadow: true,
            ..HeaderOptions::default()
        };
        for _ in 0..2 {
            assert_eq!(
                rate_of(&options, &shadowed, &numbers, "ip:1", 0),
                "\"api\";r=19;t=1"
            );
            assert_eq!(
                rate_of(&listing, &shadowed, &numbers, "ip:1", 0),
                "\"api\";r=19;t=1, \"trial\";r=4;t=1"
            );
        }
        // A partition key differs per client: never sent again for another.
        let keyed = HeaderOptions {
            partition_key: Some(std::sync::Arc::new(PartitionKeyer::new(&[7; 32]))),
            ..HeaderOptions::default()
        };
        // Sent last without a key: not taken for a keyed field, nor left for later.
        let unkeyed = rate_of(&options, &api, &[(19, second)], "ip:1", 0);
        assert_eq!(unkeyed, "\"api\";r=19;t=1");
        let one = rate_of(&keyed, &api, &[(19, second)], "ip:1", 0);
        let two = rate_of(&keyed, &api, &[(19, second)], "ip:2", 0);
        assert_ne!(one, two);
        assert!(one.to_str().unwrap().starts_with("\"api\";r=19;t=1;pk=:"));
        assert!(two.to_str().unwrap().starts_with("\"api\";r=19;t=1;pk=:"));
        assert_eq!(rate_of(&keyed, &api, &[(19, second)], "ip:1", 0), one);
        assert_eq!(
            rate_of(&options, &api, &[(19, second)], "ip:9", 0),
            "\"api\";r=19;t=1"
        );
    }

    /// More policies than the field remembered is written in full every time.
    #[test]
    fn a_set_of_many_policies_is_listed_in_full() {
        let policies = PolicySet::new((0..REMEMBERED_POLICIES as u64 + 2).map(|index| {
            Policy::token_bucket(&format!("p{index}"), 100, Rate::per_second(100)).unwrap()
        }))
        .unwrap();
        let options = HeaderOptions::default();
        // Only a policy past those remembered changes: its own numbers are sent.
        let second = Duration::from_secs(1);
        let mut numbers = vec![(9, second); policies.len()];
        let all_nine = rate_of(&options, &policies, &numbers, "ip:1", 0);
        assert!(all_nine.to_str().unwrap().contains("\"p4\";r=9;t=1"));
        numbers[REMEMBERED_POLICIES] = (8, second);
        let one_less = rate_of(&options, &policies, &numbers, "ip:1", 0);
        assert!(one_less.to_str().unwrap().contains("\"p4\";r=8;t=1"));
        numbers[REMEMBERED_POLICIES] = (9, second);
        numbers[REMEMBERED_POLICIES + 1] = (7, 2 * second);
        let last = rate_of(&options, &policies, &numbers, "ip:1", 0);
        assert!(last.to_str().unwrap().ends_with("\"p5\";r=7;t=2"));
        for remaining in [50, 50, 49] {
            let numbers: Vec<(u64, Duration)> = (0..policies.len() as u64)
                .map(|index| (remaining - index, Duration::from_secs(1)))
                .collect();
            let expected: Vec<String> = (0..policies.len() as u64)
                .map(|index| format!("\"p{index}\";r={};t=1", remaining - index))
                .collect();
            assert_eq!(
                rate_of(&options, &policies, &numbers, "ip:1", 0),
                expected.join(", ").as_str()
            );
        }
    }

    /// What a keeper keeps is bounded: past its budget (each text counted with what
    /// keeping it costs), nothing more is kept (the field is then shared), while texts
    /// kept before are still found.
    #[test]
    fn a_keeper_keeps_no_more_than_its_budget() {
        let text = |text: &'static str| HeaderValue::from_static(text);
        assert!(
            Keeper::new(KEPT_ENTRY_BYTES + 10)
                .keep(&text("\"z\";r=1;t=1"))
                .is_none()
        );
        let keeper = Keeper::new(30 + 2 * KEPT_ENTRY_BYTES);
        let kept = keeper.keep(&text("\"a\";r=1;t=1")).unwrap();
        assert_eq!(kept, "\"a\";r=1;t=1");
        assert!(keeper.keep(&text("\"b\";r=22;t=1")).is_some());
        // 11 + 12 bytes kept: 13 more would pass 30.
        assert!(keeper.keep(&text("\"c\";r=333;t=1")).is_none());
        assert!(keeper.keep(&text("\"d\";r=1;t=1")).is_none());
        // A text already kept is still the static value.
        let same = keeper.keep(&HeaderValue::from_bytes(b"\"a\";r=1;t=1").unwrap());
        assert_eq!(same.unwrap().as_bytes().as_ptr(), kept.as_bytes().as_ptr());
    }

    #[test]
    fn draft_11_lists_every_policy() {
        let headers = render(
            HeaderStyle::Draft11,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        assert_eq!(
            headers["ratelimit-policy"],
            "\"api\";q=20;w=2, \"daily\";q=1000;w=86400"
        );
        assert_eq!(
            headers["ratelimit"],
            "\"api\";r=17;t=1, \"daily\";r=990;t=3600"
        );
    }

    #[test]
    fn draft_6_reports_the_most_restrictive_policy() {
        let headers = render(
            HeaderStyle::Draft6,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        assert_eq!(headers["ratelimit-limit"], "20");
        assert_eq!(headers["ratelimit-remaining"], "17");
        assert_eq!(headers["ratelimit-reset"], "1");
        let denied = render(
            HeaderStyle::Draft6,
            Outcome::Denied {
                policy: 1,
                retry_after: Duration::from_secs(3600),
            },
        );
        assert_eq!(denied["ratelimit-limit"], "1000");
    }

    #[test]
    fn legacy_reset_is_a_unix_time() {
        let headers = render(
            HeaderStyle::Legacy,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        let reset: u64 = headers["x-ratelimit-reset"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(reset >= now && reset <= now + 2, "{reset} vs {now}");
        assert!(
            render(
                HeaderStyle::None,
                Outcome::Allowed {
                    delay: Duration::ZERO
                }
            )
            .is_empty()
        );
    }

    /// A store's status with more units left than the quota (a custom store, a limit
    /// lowered under a count kept by name) never says so: `r` is at most `q`
    /// (draft-ietf-httpapi-ratelimit-headers-11, section 4.1.1: the remaining quota units;
    /// section 3.1.1: `q` is the quota), `Remaining` at most `Limit`.
    #[test]
    fn remaining_is_never_above_the_quota() {
        let decision = Decision::new(
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
            vec![
                PolicyStatus {
                    limit: 20,
                    remaining: 25,
                    reset: Duration::from_millis(300),
                    effective_window: Duration::from_millis(100),
                },
                PolicyStatus {
                    limit: 1000,
                    remaining: 1500,
                    reset: Duration::from_secs(3600),
                    effective_window: Duration::from_secs(3600),
                },
            ],
        );
        let render = |style| {
            let mut headers = HeaderMap::new();
            let options = HeaderOptions {
                style,
                ..HeaderOptions::default()
            };
            rate_limit_headers(&options, &set(), &decision, "ip:1", 0).apply(&mut headers);
            headers
        };
        assert_eq!(
            render(HeaderStyle::Draft11)["ratelimit"],
            "\"api\";r=20;t=1, \"daily\";r=1000;t=3600"
        );
        let single = render(HeaderStyle::Draft6);
        assert_eq!(single["ratelimit-limit"], "20");
        assert_eq!(single["ratelimit-remaining"], "20");
    }

    #[test]
    fn rounding_is_up() {
        assert_eq!(seconds_ceil(Duration::from_nanos(1)), 1);
        assert_eq!(seconds_ceil(Duration::from_secs(2)), 2);
        assert_eq!(seconds_ceil(Duration::from_millis(2001)), 3);
        assert_eq!(seconds_ceil(Duration::ZERO), 0);
    }
}
