//! The Redis store: one atomic Lua script per decision, on standalone Redis or a Cluster.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisError, Script};
use smallvec::SmallVec;

use super::{Adjustment, Change, DecideFuture, ResetFuture, Store, StoreError, StoreErrorKind};
use crate::algorithm::{Params, PenaltyBox};
use crate::decision::{Decision, Outcome, PolicyStatus, Receipt};
use crate::key::Key;
use crate::policy::{Policy, PolicySet};

mod cluster;
mod coalesce;
mod connect;
mod sentinel;

pub use connect::RedisConfig;
use sentinel::SentinelBackend;

/// A decision script: the prelude, the algorithms it knows, and the decision loop.
macro_rules! script {
    ($(($kind:literal, $file:literal)),+) => {
        script!(main: "main.lua", $(($kind, $file)),+)
    };
    (main: $main:literal, $(($kind:literal, $file:literal)),+) => {
        concat!(
            script!(algorithms: $(($kind, $file)),+),
            include_str!(concat!("../../lua/store/", $main))
        )
    };
    // The decision loop as the function `decide`, run once per coalesced decision.
    (batch: $(($kind:literal, $file:literal)),+) => {
        concat!(
            script!(algorithms: $(($kind, $file)),+),
            "local function decide()\n",
            include_str!("../../lua/store/main.lua"),
            "\nend\n",
            include_str!("../../lua/store/batch.lua")
        )
    };
    (algorithms: $(($kind:literal, $file:literal)),+) => {
        concat!(
            "local now, cost, count, max, min, fmod, call, format, match\n",
            include_str!("../../lua/store/bind.lua"),
            include_str!("../../lua/store/begin.lua"),
            include_str!("../../lua/store/prelude.lua"),
            include_str!("../../lua/penalty.lua"),
            script!(wrappers: $(($kind, $file)),+)
        )
    };
    (wrappers: $(($kind:literal, $file:literal)),+) => {
        concat!(
            "local algorithms = {}\n",
            $(
                // `one` is nil unless the file defines a path of its own for one policy,
                // `queue_end` unless the algorithm queues (shaping).
                "algorithms.", $kind, " = (function()\nlocal one, queue_end\n",
                include_str!(concat!("../../lua/", $file)),
                "\nreturn { load = load, check = check, commit = commit, snapshot = snapshot, refund = refund, one = one, queue_end = queue_end }\nend)()\n",
            )+
        )
    };
}

/// `script!(ARGS... every algorithm)`: the one list of every algorithm's kind and file.
macro_rules! every_algorithm {
    ($($args:tt)*) => {
        script!(
            $($args)*
            ("fw", "fixed_window.lua"),
            ("sw", "sliding_window.lua"),
            ("sl", "sliding_log.lua"),
            ("tb", "token_bucket.lua"),
            ("ls", "leaky_shape.lua"),
            ("gc", "gcra.lua"),
            ("cc", "in_flight.lua")
        )
    };
}

/// Every algorithm, registered by kind: the heart of the Functions library.
const ALL_ALGORITHMS: &str = every_algorithm!(wrappers:);

/// The Redis Functions library of this build: the prelude and every algorithm defined
/// once when the library loads, and the functions each call runs without defining
/// anything: decide, a coalesced batch, adjust, and per algorithm the decision of a lone
/// plain policy. Its name carries a hash of its text,
/// so replicas of two versions never replace each other's functions.
struct Library {
    /// The library's name (`tollgate_` and a hash of its text).
    name: String,
    source: String,
    decide: String,
    batch: String,
    adjust: String,
    /// Per algorithm (in [`KINDS`]' order): a lone plain policy's decision (lua/store/one.lua).
    one: [String; 7],
}

impl Library {
    fn new() -> Self {
        const VERSION: &str = "@VERSION@";
        let name = |function: &str| format!("tollgate_{function}_{VERSION}");
        let (decide, batch, adjust) = (name("decide"), name("batch"), name("adjust"));
        let one = KINDS.map(|kind| name(&format!("one_{kind}")));
        let template = [
            &format!("#!lua name=tollgate_{VERSION}\n"),
            "local KEYS, ARGV, now, cost, count, max, min, fmod, call, format, match\n",
            include_str!("../../lua/store/bind.lua"),
            include_str!("../../lua/store/check.lua"),
            "local function begin()\n",
            include_str!("../../lua/store/begin.lua"),
            "end\n",
            include_str!("../../lua/store/prelude.lua"),
            include_str!("../../lua/penalty.lua"),
            ALL_ALGORITHMS,
            "local function decide()\n",
            include_str!("../../lua/store/main.lua"),
            "\nend\n",
            "local function adjust()\n",
            include_str!("../../lua/store/adjust.lua"),
            "\nend\n",
            "local function batch()\n",
            include_str!("../../lua/store/batch.lua"),
            "\nend\n",
            include_str!("../../lua/store/one.lua"),
            "local function entry(body)\n",
            "  return function(keys, args)\n",
            "    KEYS, ARGV = keys, args\n",
            "    if call == nil then check_integers() end\n",
            "    begin()\n",
            "    return body()\n",
            "  end\n",
            "end\n",
            &format!("redis.register_function('{decide}', entry(decide))\n"),
            &format!("redis.register_function('{batch}', entry(batch))\n"),
            &format!("redis.register_function('{adjust}', entry(adjust))\n"),
            &KINDS
                .iter()
                .zip(&one)
                .map(|(kind, name)| {
                    format!("redis.register_function('{name}', one_entry('{kind}'))\n")
                })
                .collect::<String>(),
        ]
        .concat();
        // The name carries a hash of the whole text: two builds share a name only when
        // they run the same code.
        let version = Script::new(&template).get_hash()[..16].to_owned();
        let source = template.replace(VERSION, &version);
        let (decide, batch, adjust) = (
            decide.replace(VERSION, &version),
            batch.replace(VERSION, &version),
            adjust.replace(VERSION, &version),
        );
        Self {
            name: format!("tollgate_{version}"),
            source,
            decide,
            batch,
            adjust,
            one: one.map(|name| name.replace(VERSION, &version)),
        }
    }
}

/// Which of a call's scripts (or library functions) to run.
#[derive(Clone, Copy)]
enum Call {
    Decide,
    Batch,
    Adjust,
}

// The decision scripts take the keys and arguments `lua/store/prelude.lua` describes. For one
// plain policy (no shadow, no penalty) of every algorithm (the sliding window counter with
// one sub-window) they read KEYS[1] only and answer
// `{outcome, wait or delay, raw state, time}` rather than the policy's status.

/// The script of requests under one fixed-window policy. Under one plain policy it reads
/// `KEYS[1]` only and answers `{outcome, wait, count, end of the window, time}` (see
/// `lua/store/prelude.lua`).
pub const FIXED_WINDOW_SCRIPT: &str = script!(("fw", "fixed_window.lua"));
/// The script of requests under one sliding-window-counter policy. Under one plain policy
/// of one sub-window it reads `KEYS[1]` only and answers `{outcome, wait, window index,
/// previous count, current count, time}`.
pub const SLIDING_WINDOW_SCRIPT: &str = script!(("sw", "sliding_window.lua"));
/// The script of requests under one sliding-log policy. Under one plain policy it reads
/// `KEYS[1]` only and answers `{outcome, wait, units in the log, oldest entry, newest
/// entry, time}` (a missing entry as -1).
pub const SLIDING_LOG_SCRIPT: &str = script!(("sl", "sliding_log.lua"));
/// The script of requests under one token-bucket or policing leaky-bucket policy. Under
/// one plain policy it reads `KEYS[1]` only and answers `{outcome, wait, level, time}`.
pub const TOKEN_BUCKET_SCRIPT: &str = script!(("tb", "token_bucket.lua"));
/// The script of requests under one shaping leaky-bucket policy. Under one plain policy it
/// reads `KEYS[1]` only and answers `{outcome, delay or wait, level, time}`.
pub const LEAKY_SHAPE_SCRIPT: &str = script!(("ls", "leaky_shape.lua"));
/// The script of requests under one GCRA policy. Under one plain policy it reads `KEYS[1]`
/// only and answers `{outcome, wait, how far the TAT is ahead, time}`.
pub const GCRA_SCRIPT: &str = script!(("gc", "gcra.lua"));
/// The script of requests under one in-flight (concurrency) policy. Under one plain policy
/// it reads `KEYS[1]` only and answers `{outcome, wait, slots taken, time}`; the lease id
/// (the third number) must be spelled in plain decimal digits, as the store sends it, or
/// releasing the slot will not find it.
pub const IN_FLIGHT_SCRIPT: &str = script!(("cc", "in_flight.lua"));
/// The script that adjusts an admitted request's debit once its response is known
/// (settles a reserved cost, frees in-flight slots): every algorithm.
pub const ADJUST_SCRIPT: &str = every_algorithm!(main: "adjust.lua",);
/// The script of requests under several policies: every algorithm, all-or-nothing. (Given
/// one plain policy, it answers as that algorithm's own script does.)
pub const MULTI_POLICY_SCRIPT: &str = every_algorithm!();

/// The script of coalesced decisions under one policy of each algorithm, in [`KINDS`]'
/// order, and under several policies (the last).
const BATCH_SCRIPTS: [&str; 8] = [
    script!(batch: ("fw", "fixed_window.lua")),
    script!(batch: ("sw", "sliding_window.lua")),
    script!(batch: ("sl", "sliding_log.lua")),
    script!(batch: ("tb", "token_bucket.lua")),
    script!(batch: ("ls", "leaky_shape.lua")),
    script!(batch: ("gc", "gcra.lua")),
    script!(batch: ("cc", "in_flight.lua")),
    every_algorithm!(batch:),
];

/// How long calls stay scripts after Functions were missing or refused, before they are
/// tried again.
const RETRY_FUNCTIONS: Duration = Duration::from_secs(60);

/// How long loads are held for a user who may run no scripts, after one was refused or
/// left a node without the library (see [`Scripts::loads_held_at`]): at most one load in
/// this long, and a library that can load again (an administrator loaded it, a slot
/// finished moving, memory was freed) is loaded that soon.
const HOLD_LOADS: Duration = Duration::from_secs(5);

/// One script: its text, and the SHA1 that `EVALSHA` names it by.
struct Lua {
    hash: String,
    source: &'static str,
}

impl Lua {
    fn new(source: &'static str) -> Self {
        Self {
            hash: Script::new(source).get_hash().to_owned(),
            source,
        }
    }
}

/// The scripts: one per algorithm (smaller, so faster to run) and one for several
/// policies; their coalesced twins; the adjustment.
struct Scripts {
    single: [Lua; 7],
    multi: Lua,
    batch: [Lua; 8],
    adjust: Lua,
    library: Library,
    /// Calls are `FCALL`s of the library (loaded when a server answers that it does not
    /// have it); off while a server has no Functions or refuses them: then calls run as
    /// `EVALSHA` scripts.
    functions: std::sync::atomic::AtomicBool,
    /// One library load at a time; `loads` counts them: requests that all found the
    /// library missing (a server restarted) load it once, not once each.
    reload: tokio::sync::Mutex<()>,
    loads: std::sync::atomic::AtomicU64,
    /// Loads that failed on I/O or were dropped unended (see `Loading`): requests that
    /// waited for a load that failed run as scripts, rather than each sending its own.
    failed_loads: std::sync::atomic::AtomicU64,
    /// When calls last fell back to scripts (milliseconds after `born`, plus one; 0:
    /// never): a minute later Functions are tried again (an ACL fixed, a node upgraded).
    fell_back: std::sync::atomic::AtomicU64,
    born: std::time::Instant,
    /// The fallback has been said (an info event), once.
    said: std::sync::atomic::AtomicBool,
    /// `FCALL` itself was refused (no Functions, or an ACL without it), not only the
    /// library's load: scripts are then all this store may run (until Functions are
    /// tried again).
    fcall_refused: std::sync::atomic::AtomicBool,
    /// When a script was last refused (`NOPERM` on `EVALSHA` or `EVAL`: an ACL for
    /// Functions only; milliseconds after `born`, plus one; 0: never). For a minute from
    /// then, a load that fails or is refused does not send calls to scripts, which every
    /// node would refuse, but fails the calls that needed it alone.
    scripts_refused_at: std::sync::atomic::AtomicU64,
    /// When, with scripts refused, a load was last refused or still left a node without
    /// the library (same clock): for [`HOLD_LOADS`] from then, a call that meets no
    /// function fails without sending the load again (it would most likely be refused, or
    /// miss that node, again).
    loads_held_at: std::sync::atomic::AtomicU64,
}

/// The algorithm kinds the scripts know, and each one's own script, in the same order.
const KINDS: [&str; 7] = ["fw", "sw", "sl", "tb", "ls", "gc", "cc"];
const SINGLE_SCRIPTS: [&str; 7] = [
    FIXED_WINDOW_SCRIPT,
    SLIDING_WINDOW_SCRIPT,
    SLIDING_LOG_SCRIPT,
    TOKEN_BUCKET_SCRIPT,
    LEAKY_SHAPE_SCRIPT,
    GCRA_SCRIPT,
    IN_FLIGHT_SCRIPT,
];

fn kind_index(kind: &str) -> Option<usize> {
    KINDS.iter().position(|k| *k == kind)
}

impl Scripts {
    fn new() -> Self {
        Self {
            single: SINGLE_SCRIPTS.map(Lua::new),
            multi: Lua::new(MULTI_POLICY_SCRIPT),
            batch: BATCH_SCRIPTS.map(Lua::new),
            adjust: Lua::new(ADJUST_SCRIPT),
            library: Library::new(),
            functions: std::sync::atomic::AtomicBool::new(true),
            reload: tokio::sync::Mutex::new(()),
            loads: std::sync::atomic::AtomicU64::new(0),
            failed_loads: std::sync::atomic::AtomicU64::new(0),
            fell_back: std::sync::atomic::AtomicU64::new(0),
            born: std::time::Instant::now(),
            said: std::sync::atomic::AtomicBool::new(false),
            fcall_refused: std::sync::atomic::AtomicBool::new(false),
            scripts_refused_at: std::sync::atomic::AtomicU64::new(0),
            loads_held_at: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Functions again, a minute after the last fallback (one call finds out whether they
    /// work now; if not, it runs as a script and the minute starts over).
    fn try_functions_again(&self) {
        use std::sync::atomic::Ordering;
        let fell_back = self.fell_back.load(Ordering::Relaxed);
        if fell_back != 0
            && !self.within_retry(fell_back)
            && self
                .fell_back
                .compare_exchange(fell_back, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.fcall_refused.store(false, Ordering::Relaxed);
            self.functions.store(true, Ordering::Relaxed);
        }
    }

    /// Milliseconds since the store was made, plus one (0 stands for never).
    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// Whether `at` (of [`Scripts::now_ms`]; 0: never) was less than [`RETRY_FUNCTIONS`] ago.
    fn within_retry(&self, at: u64) -> bool {
        self.within(at, RETRY_FUNCTIONS)
    }

    /// Whether `at` (of [`Scripts::now_ms`]; 0: never) was less than `span` ago.
    fn within(&self, at: u64, span: Duration) -> bool {
        let span = u64::try_from(span.as_millis()).unwrap_or(u64::MAX);
        at != 0 && self.now_ms().saturating_sub(at) < span
    }

    /// Whether this user may not run scripts, as a call found out within the last minute
    /// (an ACL may change: a minute later, scripts are tried again where needed).
    fn scripts_refused(&self) -> bool {
        self.within_retry(
            self.scripts_refused_at
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Whether loads are held (see [`Scripts::loads_held_at`]).
    fn loads_held(&self) -> bool {
        self.within(
            self.loads_held_at
                .load(std::sync::atomic::Ordering::Relaxed),
            HOLD_LOADS,
        )
    }

    /// Holds loads from now, unless they are held already (callers that met the same
    /// refusal together do not carry the hold on).
    fn hold_loads(&self) {
        if !self.loads_held() {
            self.loads_held_at
                .store(self.now_ms(), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The error of a call that met no function while loads are held: why no load was
    /// sent.
    fn held(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Refused,
            format!(
                "the Redis Functions library is missing on this node, and this user may run \
                 no scripts; a load was refused, or left a node without it, less than {} s \
                 ago",
                HOLD_LOADS.as_secs()
            ),
        )
    }

    /// The script of `call` for `invocation`.
    fn script(&self, call: Call, invocation: &Invocation) -> &Lua {
        match call {
            Call::Decide => self.for_invocation(invocation),
            Call::Batch => self.batch_for(invocation),
            Call::Adjust => &self.adjust,
        }
    }

    /// The `FCALL` of `call` for `invocation`: a lone plain policy's decision calls its
    /// algorithm's own function (lua/store/one.lua), with the cost and the policy's numbers
    /// only; any other call, the function of its kind with the whole invocation.
    fn function_command(&self, call: Call, invocation: &Invocation) -> redis::Cmd {
        if let (Call::Decide, Shape::Raw(_)) = (call, invocation.shape)
            && let Some(index) = invocation.single_kind.and_then(kind_index)
        {
            return invocation.one_command(&self.library.one[index]);
        }
        let function = match call {
            Call::Decide => &self.library.decide,
            Call::Batch => &self.library.batch,
            Call::Adjust => &self.library.adjust,
        };
        invocation.command("FCALL", function)
    }

    /// The script that decides `invocation`: one policy, that algorithm's own, smaller
    /// script; several, the full one.
    fn for_invocation(&self, invocation: &Invocation) -> &Lua {
        match invocation.single_kind.and_then(kind_index) {
            Some(index) if invocation.count == 1 => &self.single[index],
            _ => &self.multi,
        }
    }

    /// [`for_invocation`](Self::for_invocation)'s coalesced twin.
    fn batch_for(&self, invocation: &Invocation) -> &Lua {
        match invocation.single_kind.and_then(kind_index) {
            Some(index) if invocation.count == 1 => &self.batch[index],
            _ => &self.batch[7],
        }
    }
}

/// The source of the script that decides requests under `policies`. Its keys, arguments
/// and answer are described at the top of `lua/store/prelude.lua`: a set of one plain policy
/// (no shadow, no penalty; the sliding window counter with one sub-window) is sent its
/// state key only and answers its raw state, not its status.
///
/// A set of one policy is decided by its algorithm's own script, any other set by
/// [`MULTI_POLICY_SCRIPT`]; a lone policy the script cannot decide exactly is an error
/// of kind [`Unsupported`](StoreErrorKind::Unsupported). A set of several is given the
/// multi-policy script whatever its policies: whether each can be decided exactly is
/// [`RedisStore::check_policies`]'s to say (the layer calls it when it is built).
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::{GCRA_SCRIPT, MULTI_POLICY_SCRIPT, TOKEN_BUCKET_SCRIPT, decision_script};
/// use tollgate::{Policy, PolicySet, Rate, StoreErrorKind};
///
/// let bucket = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(5))?);
/// assert_eq!(decision_script(&bucket)?, TOKEN_BUCKET_SCRIPT);
/// let gcra = PolicySet::from(Policy::gcra("api", Rate::per_second(5), 10)?);
/// assert_eq!(decision_script(&gcra)?, GCRA_SCRIPT);
/// let both = PolicySet::new([
///     Policy::token_bucket("burst", 10, Rate::per_second(5))?,
///     Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?,
/// ])?;
/// assert_eq!(decision_script(&both)?, MULTI_POLICY_SCRIPT);
///
/// // A trillion units refilled one a day: too large for Lua's doubles.
/// let huge = PolicySet::from(Policy::token_bucket("huge", 1_000_000_000_000, Rate::per_day(1))?);
/// assert_eq!(decision_script(&huge).unwrap_err().kind(), StoreErrorKind::Unsupported);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decision_script(policies: &PolicySet) -> Result<&'static str, StoreError> {
    if let [policy] = &**policies {
        let (kind, ..) = script_args(policy)?;
        if let Some(index) = kind_index(kind) {
            return Ok(SINGLE_SCRIPTS[index]);
        }
    }
    Ok(MULTI_POLICY_SCRIPT)
}

/// The default prefix of every key the store writes.
pub const DEFAULT_PREFIX: &str = "tollgate";

/// Lua keeps numbers as doubles: integers are exact below this.
const EXACT: u128 = 1 << 53;

/// A store shared by every replica: state lives in Redis (standalone or Cluster) and each
/// decision is one call that reads, decides and writes atomically: an `FCALL` of the
/// store's Functions library, or an `EVALSHA` of the same Lua where Functions are missing
/// or refused.
///
/// - **Time** is Redis `TIME`, read inside the script: application servers' clocks are
///   never trusted for shared state.
/// - **Several policies** of one identity are decided in the same script, all-or-nothing.
/// - **Keys** come from one builder, [`RedisKeys`]: `tollgate:{identity}:policy:params`,
///   with the identity inside a Cluster hash tag so every key of one identity lands in one
///   slot, escaped so no identity can leave its tag or collide with another. Every key
///   expires when its state is back to fresh.
///
/// Connections: [`RedisStore::connect`] (a URL; one multiplexed, self-reconnecting
/// connection that pipelines concurrent decisions), [`RedisStore::from_pool`] (your
/// `deadpool_redis::Pool`), [`RedisStore::connect_cluster`] and
/// [`RedisStore::from_cluster_pool`] for Redis Cluster.
///
/// ```no_run
/// use tollgate::{Policy, Rate, RateLimitLayer};
/// use tollgate::store::RedisStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let limiter = RateLimitLayer::new(store)
///     .policy(Policy::token_bucket("api", 100, Rate::per_second(50))?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    backend: Backend,
    keys: RedisKeys,
    scripts: Arc<Scripts>,
    /// Decisions for an identity with a call in flight wait for it and go as one batch.
    coalescer: Option<Arc<coalesce::Coalescer>>,
    #[cfg(feature = "__test-clock")]
    clock: Option<Arc<dyn crate::clock::Clock>>,
}

#[derive(Clone)]
enum Backend {
    Manager(Arc<Managed>),
    /// The connection of the moment, held for one decision and the release behind it
    /// ([`Backend::pinned`]): a connection made anew meanwhile (one that stopped
    /// answering) carries nothing of this one's queue, and a release sent there could
    /// overtake its decision.
    ManagerPinned(Arc<Managed>, u64, ConnectionManager),
    Pool(deadpool_redis::Pool),
    /// One connection checked out of a pool for one decision and the release behind it
    /// ([`Backend::pinned`]): back in the pool when the last clone is dropped, so the
    /// pool counts it in use until the decision is answered, or, when it is dropped,
    /// until its release is done.
    Pooled(Arc<Checkout>),
    Cluster(Arc<cluster::ManagedCluster>),
    /// The Cluster connection of the moment, held for one decision and the release behind
    /// it ([`Backend::pinned`]): a connection made anew meanwhile (a node that stopped
    /// answering) carries nothing of this one's queue, and a release sent there could
    /// overtake its decision.
    ClusterPinned(
        Arc<cluster::ManagedCluster>,
        redis::cluster_async::ClusterConnection,
    ),
    ClusterPool(deadpool_redis::cluster::Pool),
    /// One connection of a cluster pool, held as [`Backend::Pooled`] is.
    PooledCluster(Arc<deadpool_redis::cluster::Connection>),
    Sentinel(Arc<SentinelBackend>),
}

/// The multiplexed connection to one server's URL, replaced when the server turns out
/// to be a demoted primary (`READONLY`), or stops answering on it. A failover behind one
/// name (a managed primary endpoint, a virtual IP, a Kubernetes service) leaves the
/// connection on the old primary, which `ConnectionManager` keeps for as long as it
/// answers, or, when the old primary stalls or its host is gone without a reset, for as
/// long as TCP does not give up (a quarter of an hour; for ever for a stall that still
/// acknowledges): the layer's timeout drops each decision first, so the connection never
/// sees an error. After [`UNANSWERED`] commands in a row got no answer, a `PING` with a
/// deadline checks the connection, and one that does not answer it is replaced. The
/// replacement connects anew, resolving the name again.
pub(super) struct Managed {
    client: redis::Client,
    config: redis::aio::ConnectionManagerConfig,
    /// The connection, and how many times it was replaced (see [`Managed::pinned`]).
    current: std::sync::RwLock<(u64, ConnectionManager)>,
    /// A replacement is being made: one at a time.
    replacing: std::sync::atomic::AtomicBool,
    /// Commands in a row that got no answer: dropped before it came (the layer's
    /// timeout), or timed out.
    unanswered: std::sync::atomic::AtomicU32,
    /// A check of the connection is under way: one at a time.
    checking: std::sync::atomic::AtomicBool,
    /// A stall was said (at warn level), and a failed replacement: each is said once,
    /// then at debug level, until the server answers again.
    said_stall: std::sync::atomic::AtomicBool,
    said_unreplaced: std::sync::atomic::AtomicBool,
}

/// Commands in a row without an answer after which the connection is checked.
const UNANSWERED: u32 = 3;
/// How long the check's `PING` may take before a new connection is tried. The `PING`
/// queues behind what was sent before it, so a server that is merely slow or blocked (a
/// long script) may miss it too: then the new connection is made only if the server
/// answers its handshake, and the old one, whose answers were dropped anyway, is left.
const PING_DEADLINE: Duration = Duration::from_secs(1);

/// One command on a [`Managed`] connection: counted as unanswered unless
/// [`Asked::answered`] says otherwise (a command dropped while it waits is one).
struct Asked<'a> {
    managed: &'a Arc<Managed>,
    answered: bool,
    /// The answer was no error: a connection that works (a refused password, a demoted
    /// server's `READONLY`, are answers, but no sign a replacement would do).
    ok: bool,
}

impl Asked<'_> {
    /// The server answered (an error it sent is an answer) or the command timed out.
    fn answered<T>(mut self, answer: &Result<T, RedisError>) {
        self.answered = !answer.as_ref().is_err_and(RedisError::is_timeout);
        self.ok = answer.is_ok();
    }
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if self.answered {
            if self.managed.unanswered.load(Ordering::Relaxed) != 0 {
                self.managed.unanswered.store(0, Ordering::Relaxed);
            }
            if self.managed.said_stall.load(Ordering::Relaxed)
                || (self.ok && self.managed.said_unreplaced.load(Ordering::Relaxed))
            {
                self.managed.answers_again(self.ok);
            }
        } else if self.managed.unanswered.fetch_add(1, Ordering::Relaxed) + 1 >= UNANSWERED {
            self.managed.check();
        }
    }
}

impl Managed {
    /// Connects to `client`'s server.
    pub(super) async fn connect(
        client: redis::Client,
        config: redis::aio::ConnectionManagerConfig,
    ) -> Result<Self, RedisError> {
        let connection = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        Ok(Self {
            client,
            config,
            current: std::sync::RwLock::new((0, connection)),
            replacing: std::sync::atomic::AtomicBool::new(false),
            unanswered: std::sync::atomic::AtomicU32::new(0),
            checking: std::sync::atomic::AtomicBool::new(false),
            said_stall: std::sync::atomic::AtomicBool::new(false),
            said_unreplaced: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The server answered after a stall was said: said once, and the next stall will
    /// be said again; a failed replacement too, once a command worked (`ok`).
    #[cold]
    fn answers_again(&self, ok: bool) {
        use std::sync::atomic::Ordering;
        if ok {
            self.said_unreplaced.store(false, Ordering::Relaxed);
        }
        if self.said_stall.swap(false, Ordering::Relaxed) {
            #[cfg(feature = "tracing")]
            tracing::info!(target: "tollgate", "the Redis connection answers again");
        }
    }

    /// A command about to be sent on the current connection.
    fn ask(self: &Arc<Self>) -> Asked<'_> {
        Asked {
            managed: self,
            answered: false,
            ok: false,
        }
    }

    /// Checks in the background that the current connection answers a `PING` within
    /// [`PING_DEADLINE`], and replaces it when it does not. One check at a time; none
    /// outside a Tokio runtime.
    #[cold]
    fn check(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        self.spawn_one(|managed| &managed.checking, |this| async move {
            let mut connection = this.connection();
            let ping = redis::cmd("PING");
            let answer = tokio::time::timeout(
                PING_DEADLINE,
                ping.query_async::<redis::Value>(&mut connection),
            )
            .await;
            match answer {
                // An answer, even an error: the server is there.
                Ok(Ok(_)) => {
                    this.unanswered.store(0, Ordering::Relaxed);
                    this.answers_again(true);
                }
                Ok(Err(error)) if !error.is_timeout() && !error.is_io_error() => {
                    this.unanswered.store(0, Ordering::Relaxed);
                    this.answers_again(false);
                }
                _ => {
                    // Said once a stall; each check after it (about one a second while
                    // requests keep coming) at debug level.
                    #[cfg(feature = "tracing")]
                    if this.said_stall.swap(true, Ordering::Relaxed) {
                        tracing::debug!(target: "tollgate", "the Redis connection answers nothing, not even a PING within {PING_DEADLINE:?}: connecting anew");
                    } else {
                        tracing::warn!(target: "tollgate", "the Redis connection answers nothing, not even a PING within {PING_DEADLINE:?}: connecting anew (said once until it answers again)");
                    }
                    #[cfg(not(feature = "tracing"))]
                    this.said_stall.store(true, Ordering::Relaxed);
                    this.unanswered.store(0, Ordering::Relaxed);
                    this.replace();
                }
            }
        });
    }

    /// Runs `task` in the background unless the one `flag` guards is running; the flag
    /// lets the next one go when the task ends, however it ends (a runtime shutting down
    /// drops it). None outside a Tokio runtime.
    fn spawn_one<F>(
        self: &Arc<Self>,
        flag: fn(&Managed) -> &std::sync::atomic::AtomicBool,
        task: impl FnOnce(Arc<Managed>) -> F,
    ) where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        use std::sync::atomic::Ordering;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if flag(self).swap(true, Ordering::AcqRel) {
            return;
        }
        struct Done(Arc<Managed>, fn(&Managed) -> &std::sync::atomic::AtomicBool);
        impl Drop for Done {
            fn drop(&mut self) {
                (self.1)(&self.0).store(false, Ordering::Release);
            }
        }
        let done = Done(Arc::clone(self), flag);
        let task = task(Arc::clone(self));
        runtime.spawn(async move {
            task.await;
            drop(done);
        });
    }

    /// Sends `command` on `connection` (this server's, now or when its decision went).
    async fn query<T: redis::FromRedisValue>(
        self: &Arc<Self>,
        command: &redis::Cmd,
        mut connection: ConnectionManager,
    ) -> Result<T, RedisError> {
        let asked = self.ask();
        let answer = command.query_async(&mut connection).await;
        asked.answered(&answer);
        // A refused password is kept by the connection manager for good (it connects
        // again only after an I/O error): connecting anew is the way back.
        if answer
            .as_ref()
            .is_err_and(|error| off_the_primary(error) || password_refused(error))
        {
            self.replace();
        }
        answer
    }

    fn connection(&self) -> ConnectionManager {
        self.pinned().1
    }

    /// How many times a connection was put in the old one's place.
    fn generation(&self) -> u64 {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
    }

    /// The connection in use, with its generation (how many times one was put in the
    /// old one's place): a command sent on it later goes there even when it was left.
    fn pinned(&self) -> (u64, ConnectionManager) {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Connects anew in the background and puts the new connection in the old one's
    /// place; decisions meanwhile go on the old one (and fail as unavailable). One
    /// replacement at a time, at most one a second (the name may still point at the
    /// demoted server for a while); none outside a Tokio runtime.
    #[cold]
    fn replace(self: &Arc<Self>) {
        self.spawn_one(|managed| &managed.replacing, |this| async move {
            let made =
                ConnectionManager::new_with_config(this.client.clone(), this.config.clone()).await;
            match made {
                Ok(connection) => {
                    let mut current = this
                        .current
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    *current = (current.0.wrapping_add(1), connection);
                    drop(current);
                    // The server answered the handshake: a next failure is said again.
                    this.said_unreplaced
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                }
                Err(error) => {
                    // The next `READONLY`, or the next check, tries again: said once until
                    // the server answers, then at debug level.
                    #[cfg(feature = "tracing")]
                    if this
                        .said_unreplaced
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        tracing::debug!(target: "tollgate", %error, "no new connection to the Redis server (after a demotion, or a connection that stopped answering)");
                    } else {
                        tracing::warn!(target: "tollgate", %error, "no new connection to the Redis server (after a demotion, or a connection that stopped answering); said once until it answers again");
                    }
                    let _ = error;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
    }
}

/// A pool's connection checked out for one decision ([`Backend::pinned`]): back in the
/// pool when the last holder drops it, unless it met a demoted primary, which answers
/// the pool's recycling `PING` as well as any: then it is taken out of the pool.
pub(super) struct Checkout {
    connection: Option<deadpool_redis::Connection>,
    left: std::sync::atomic::AtomicBool,
}

impl Checkout {
    fn new(connection: deadpool_redis::Connection) -> Self {
        Self {
            connection: Some(connection),
            left: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn connection(&self) -> redis::aio::MultiplexedConnection {
        match &self.connection {
            Some(connection) => (**connection).clone(),
            None => unreachable!("a checkout holds its connection until it is dropped"),
        }
    }

    /// Takes the connection out of the pool when the last holder is done with it.
    fn leave(&self) {
        self.left.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if *self.left.get_mut()
            && let Some(connection) = self.connection.take()
        {
            drop(deadpool_redis::Connection::take(connection));
        }
    }
}

/// Whether `error` is a Cluster's redirection: on a connection to one server, a node of
/// a one-shard Cluster that a failover made a replica. Connecting anew (the name
/// resolved again: a managed endpoint follows the new primary) is the way back.
fn moved(error: &RedisError) -> bool {
    matches!(error.code(), Some("MOVED" | "ASK"))
}

/// Whether a connection to one server that met `error` is to be left: its server was
/// demoted, or is a one-shard Cluster's node a failover made a replica.
fn off_the_primary(error: &RedisError) -> bool {
    demoted(error) || moved(error)
}

/// Whether `error` says the server is a primary no more (or has none): a failover.
fn demoted(error: &RedisError) -> bool {
    demoted_code(server_code(error))
}

/// The error code the server answered: the code of the error a script met, where Redis
/// before 7 wraps it in a script error of its own (`ERR Error running script (call to
/// f_...): @user_script:21: @user_script: 21: -READONLY You can't write against a read
/// only replica.`); Redis 7 answers that code itself.
fn server_code(error: &RedisError) -> Option<&str> {
    let wrapped = || {
        let detail = error.detail()?;
        if !detail.starts_with("Error running script") {
            return None;
        }
        let met = &detail[detail.find(": -")? + 3..];
        let code = &met[..met
            .find(|c: char| !c.is_ascii_uppercase())
            .unwrap_or(met.len())];
        (!code.is_empty()).then_some(code)
    };
    match error.code() {
        Some("ERR") => wrapped().or(Some("ERR")),
        code => code,
    }
}

/// Whether `error` is a TLS handshake refused (a certificate expired, from a CA the store
/// does not trust, for another name; no protocol version in common): a setting to fix,
/// met by every connection, not an outage to wait out behind the failure mode. redis-rs
/// passes rustls's error up inside an I/O error.
#[cfg(feature = "tls")]
fn tls_refused(error: &RedisError) -> bool {
    use std::error::Error as _;
    error
        .source()
        .and_then(|source| source.downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>())
        .and_then(|inner| inner.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::get_ref)
        .is_some_and(|inner| inner.is::<rustls::Error>())
}

#[cfg(not(feature = "tls"))]
fn tls_refused(_: &RedisError) -> bool {
    false
}

/// Whether a Redis error code says the server is a primary no more (`READONLY`) or has
/// none (`MASTERDOWN`).
fn demoted_code(code: Option<&str>) -> bool {
    matches!(code, Some("READONLY" | "MASTERDOWN"))
}

/// Whether `error` is the server refusing the connection's credentials (a password
/// rotated under it, a user removed): every command of that connection meets it.
fn password_refused(error: &RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("WRONGPASS" | "NOAUTH"))
}

/// A pool that gave no connection. The server's own answer when the pool opened one
/// (`WRONGPASS`, `NOPERM` on `SELECT`, a TLS set-up refused) is sorted as that error is
/// ([`store_error`]): a refusal is no outage to wait out behind the failure mode. A pool
/// that waited too long for a connection timed out; a failing post-create hook is sorted
/// by what failed; anything else (closed, no runtime) leaves the store unavailable.
fn no_connection(error: deadpool_redis::PoolError) -> StoreError {
    use deadpool_redis::PoolError;
    match error {
        // The server's answer, to the pool opening a connection or to its `post_create`
        // hook's commands.
        PoolError::Backend(error)
        | PoolError::PostCreateHook(deadpool_redis::HookError::Backend(error)) => {
            let mut error = store_error(error);
            // No connection for anyone: the breaker holds requests off until a probe.
            error.every_request = !error.kind().is_io();
            error
        }
        PoolError::Timeout(_) => StoreError::new(
            StoreErrorKind::Timeout,
            "no connection from the pool within its timeout",
        ),
        // The hook's own error: the pool's set-up, which no wait mends.
        PoolError::PostCreateHook(deadpool_redis::HookError::Message(message)) => {
            let mut error = StoreError::new(
                StoreErrorKind::Other,
                format!("the pool's post_create hook failed: {message}"),
            );
            error.every_request = true;
            error
        }
        // Closed by the application (it is shutting down), or no runtime for a timeout
        // (which a pool's builder refuses).
        other => StoreError::new(StoreErrorKind::Unavailable, other.to_string()),
    }
}

impl Backend {
    /// One connection for a decision that takes in-flight slots and for the release its
    /// [`LeaseGuard`] sends if it is dropped: Redis runs one connection's commands in the
    /// order they came, so the release cannot overtake the script and find nothing to
    /// free. A pool's connection is checked out (and held, with the guard, until the
    /// release is done). A multiplexed connection's or a Cluster's is the one of the
    /// moment, kept: one made anew meanwhile (after a stall) carries nothing of its queue.
    /// A Sentinel primary's connection is the one of the moment too, while it lasts.
    async fn pinned(&self) -> Result<Backend, StoreError> {
        Ok(match self {
            Backend::Pool(pool) => Backend::Pooled(Arc::new(Checkout::new(
                pool.get().await.map_err(no_connection)?,
            ))),
            Backend::ClusterPool(pool) => {
                Backend::PooledCluster(Arc::new(pool.get().await.map_err(no_connection)?))
            }
            Backend::Cluster(managed) => {
                Backend::ClusterPinned(Arc::clone(managed), managed.connection())
            }
            Backend::Manager(managed) => {
                let (generation, connection) = managed.pinned();
                Backend::ManagerPinned(Arc::clone(managed), generation, connection)
            }
            other => other.clone(),
        })
    }

    /// Whether this reaches a Redis Cluster (its calls routed by slot).
    fn is_cluster(&self) -> bool {
        matches!(
            self,
            Backend::Cluster(_)
                | Backend::ClusterPinned(..)
                | Backend::PooledCluster(_)
                | Backend::ClusterPool(_)
        )
    }

    /// Whether this is a pool's connection checked out by [`Backend::pinned`].
    fn checked_out(&self) -> bool {
        matches!(self, Backend::Pooled(_) | Backend::PooledCluster(_))
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backend = match self.backend {
            Backend::Manager(_) | Backend::ManagerPinned(..) => "multiplexed connection",
            Backend::Pool(_) => "pool",
            Backend::Pooled(_) => "pooled connection",
            Backend::Cluster(_) | Backend::ClusterPinned(..) => "cluster connection",
            Backend::ClusterPool(_) => "cluster pool",
            Backend::PooledCluster(_) => "pooled cluster connection",
            Backend::Sentinel(_) => "sentinel primary",
        };
        f.debug_struct("RedisStore")
            .field("backend", &backend)
            .field("prefix", &self.keys.prefix)
            .finish()
    }
}

/// Sorts a Redis error: connection trouble passes by itself (`Unavailable`, `Timeout`),
/// and so does a failover (`READONLY` from a demoted primary, `MASTERDOWN`, a primary
/// whose replicas are away under `min-replicas-to-write`: `NOREPLICAS`) or a server
/// still busy (`BUSY`, `LOADING`); an error the server answered (`NOPERM`, `WRONGTYPE`,
/// `OOM`, a script error) is `Refused`, which the layer logs loudly instead of hiding it
/// behind the failure mode.
fn store_error(error: RedisError) -> StoreError {
    use redis::{ErrorKind, ServerErrorKind};
    let transient_code = matches!(server_code(&error), Some("BUSY" | "LOADING" | "NOREPLICAS"))
        || demoted(&error)
        || error
            .detail()
            .is_some_and(|detail| detail.contains("max number of clients"));
    let kind = if tls_refused(&error) {
        // Before the I/O sorts: redis-rs passes the handshake's error up as I/O.
        StoreErrorKind::Refused
    } else if error.is_timeout() {
        StoreErrorKind::Timeout
    } else if transient_code
        || error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || matches!(
            error.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        // A redirection left after the client's own retries: slots moving
                        // (a resharding, a failover), not a refusal of ours.
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                )
        )
    {
        StoreErrorKind::Unavailable
    } else if matches!(
        error.kind(),
        ErrorKind::Server(_) | ErrorKind::Extension | ErrorKind::AuthenticationFailed
    ) {
        StoreErrorKind::Refused
    } else if matches!(
        error.kind(),
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType
    ) {
        StoreErrorKind::Protocol
    } else {
        StoreErrorKind::Other
    };
    let code = server_code(&error).map(str::to_owned);
    let mut store_error = StoreError::new(kind, error.to_string());
    if let Some(code) = code {
        store_error = store_error.with_code(code);
    }
    store_error.with_source(error)
}

impl RedisStore {
    fn with_backend(backend: Backend) -> Self {
        Self {
            backend,
            keys: RedisKeys::default(),
            scripts: Arc::new(Scripts::new()),
            coalescer: Some(Arc::new(coalesce::Coalescer::new())),
            #[cfg(feature = "__test-clock")]
            clock: None,
        }
    }

    /// Connects to one Redis server (`redis://host:port/db`) with one multiplexed
    /// connection that pipelines concurrent decisions and reconnects by itself.
    ///
    /// It then [verifies](Self::verify) that the server runs every script under the
    /// default key prefix; with another prefix (and an ACL limited to it) use
    /// [`connect_with_prefix`](Self::connect_with_prefix).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_prefix(url, DEFAULT_PREFIX).await
    }

    /// [`connect`](Self::connect), with keys under `prefix`; the start-up check writes
    /// under that prefix too.
    ///
    /// ```no_run
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Key, Policy, PolicySet, Rate, Store};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// // An ACL user limited to `shop:*` can run every check and decision.
    /// let store = RedisStore::connect_with_prefix("redis://shop:s3cret@127.0.0.1:6379", "shop").await?;
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(5))?;
    /// let (state, _) = store.keys().policy_keys("ip:203.0.113.7", &api);
    /// assert!(state.starts_with("shop:{ip:203.0.113.7}:"));
    /// let decision = store.decide(&Key::new("ip:203.0.113.7"), &PolicySet::from(api), 1).await?;
    /// assert!(decision.is_allowed());
    /// # Ok(()) }
    /// ```
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        RedisConfig::server(url).prefix(prefix).connect().await
    }

    /// Uses a `deadpool_redis` pool you already run. Call [`verify`](Self::verify) once
    /// at start-up to check the server runs the scripts. Nothing connects here: the pool
    /// opens its connections when decisions need them.
    ///
    /// ```
    /// use deadpool_redis::{Config, Runtime};
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Policy, Rate};
    ///
    /// let pool = Config::from_url("redis://127.0.0.1:6379").create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::from_pool(pool);
    /// // Keys under the default prefix, `tollgate`.
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(5))?;
    /// assert!(store.keys().policy_keys("user:42", &api).0.starts_with("tollgate:{user:42}:api:"));
    ///
    /// // At start-up, once the server can be reached:
    /// async fn start_up(store: &RedisStore) -> Result<(), tollgate::StoreError> {
    ///     store.verify().await
    /// }
    /// # let _ = start_up;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_pool(pool: deadpool_redis::Pool) -> Self {
        Self::with_backend(Backend::Pool(pool))
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port`), then
    /// [verifies](Self::verify) the scripts run there (on every primary).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Key, Policy, PolicySet, Rate, Store};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisStore::connect_cluster(&["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
    /// // Both policies of one identity are decided in one script, in the identity's slot.
    /// let policies = PolicySet::new([
    ///     Policy::token_bucket("burst", 10, Rate::per_second(5))?,
    ///     Policy::fixed_window("daily", 10_000, Duration::from_secs(86_400))?,
    /// ])?;
    /// let decision = store.decide(&Key::new("user:42"), &policies, 1).await?;
    /// assert!(decision.is_allowed());
    /// assert_eq!(decision.statuses().len(), 2);
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster<S: AsRef<str>>(nodes: &[S]) -> Result<Self, StoreError> {
        Self::connect_cluster_with_prefix(nodes, DEFAULT_PREFIX).await
    }

    /// [`connect_cluster`](Self::connect_cluster), with keys under `prefix`.
    ///
    /// ```no_run
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Policy, Rate};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let nodes = ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"];
    /// let store = RedisStore::connect_cluster_with_prefix(&nodes, "shop").await?;
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(5))?;
    /// assert!(store.keys().policy_keys("user:42", &api).0.starts_with("shop:{user:42}:"));
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster_with_prefix<S: AsRef<str>>(
        nodes: &[S],
        prefix: &str,
    ) -> Result<Self, StoreError> {
        RedisConfig::cluster(nodes.iter().map(|node| node.as_ref().to_owned()))
            .prefix(prefix)
            .connect()
            .await
    }

    /// Uses a `deadpool_redis` cluster pool you already run. Call
    /// [`verify`](Self::verify) once at start-up. Nothing connects here.
    ///
    /// ```
    /// use deadpool_redis::Runtime;
    /// use deadpool_redis::cluster::Config;
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Policy, Rate};
    ///
    /// let nodes = vec!["redis://10.0.0.1:7000".to_owned(), "redis://10.0.0.2:7000".to_owned()];
    /// let pool = Config::from_urls(nodes).create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::from_cluster_pool(pool).prefix("shop");
    /// // Every key of one identity carries its hash tag: one slot, one script.
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(5))?;
    /// let (state, aux) = store.keys().policy_keys("user:42", &api);
    /// assert!(state.starts_with("shop:{user:42}:") && aux.starts_with("shop:{user:42}:"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_cluster_pool(pool: deadpool_redis::cluster::Pool) -> Self {
        Self::with_backend(Backend::ClusterPool(pool))
    }

    /// Writes keys under another prefix than `tollgate` (several apps, one Redis). The
    /// start-up check of [`connect`](Self::connect) wrote under the default prefix; with
    /// an ACL limited to your prefix use [`connect_with_prefix`](Self::connect_with_prefix).
    /// The prefix is escaped as identities are.
    ///
    /// ```
    /// use deadpool_redis::{Config, Runtime};
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Policy, Rate};
    ///
    /// let pool = Config::from_url("redis://127.0.0.1:6379").create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::from_pool(pool.clone()).prefix("billing");
    /// let api = Policy::token_bucket("api", 10, Rate::per_second(5))?;
    /// assert!(store.keys().policy_keys("user:42", &api).0.starts_with("billing:{user:42}:"));
    /// let spaced = RedisStore::from_pool(pool).prefix("my app");
    /// assert!(spaced.keys().policy_keys("user:42", &api).0.starts_with("my%20app:{user:42}:"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.keys = RedisKeys::new(prefix);
        self
    }

    /// Coalesces concurrent decisions for one identity (on by default): while one is on
    /// its way to Redis, the others for the same identity and policy set wait for it and
    /// then go together, as one script call that decides them one after another in
    /// arrival order. Decisions stay exact; a hot key costs Redis one call per round trip
    /// instead of one per request. A decision that waits takes longer: the call in flight
    /// and the batches queued before it (batches of up to 128; at most 256 decisions
    /// wait, later ones go on their own, so they may overtake those waiting). In-flight
    /// limits are never coalesced. `false` sends every decision on its own.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tollgate::StoreError> {
    /// let store = tollgate::store::RedisStore::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .coalescing(false);
    /// # Ok(()) }
    /// ```
    pub fn coalescing(mut self, on: bool) -> Self {
        self.coalescer = on.then(|| Arc::new(coalesce::Coalescer::new()));
        self
    }

    /// The key builder this store uses.
    pub fn keys(&self) -> &RedisKeys {
        &self.keys
    }

    /// Makes the script use `clock` instead of Redis `TIME`, so tests can move time by
    /// hand. Only with the private `__test-clock` feature, for tests: without it the method does not
    /// exist. Cargo unifies features, so any crate in a build that enables it makes it
    /// available there: never enable it outside tests.
    #[cfg(feature = "__test-clock")]
    pub fn with_clock(mut self, clock: impl crate::clock::Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        // A batch reads its leader's clock: stores on other clocks never share one.
        if self.coalescer.is_some() {
            self.coalescer = Some(Arc::new(coalesce::Coalescer::new()));
        }
        self
    }

    fn now_argument(&self) -> String {
        #[cfg(feature = "__test-clock")]
        if let Some(clock) = &self.clock {
            return (clock.now() / 1_000).to_string();
        }
        String::new()
    }

    /// Checks that every policy of `policies` can be decided exactly by the script (its
    /// numbers stay below 2^53). [`RateLimitLayer`](crate::RateLimitLayer) does this when
    /// it is built (through [`Store::validate`]); `decide` reports the same problem as a
    /// store error of kind [`Unsupported`](StoreErrorKind::Unsupported).
    ///
    /// No server is needed. A bucket keeps its level as units times the period of one
    /// unit, so a large capacity refilled slowly is what fails:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::store::RedisStore;
    /// use tollgate::{Policy, PolicySet, Rate, StoreErrorKind};
    ///
    /// let fine = PolicySet::new([
    ///     Policy::token_bucket("burst", 100, Rate::per_second(10))?,
    ///     Policy::fixed_window("daily", 999_999_999_999_999, Duration::from_secs(86_400))?,
    /// ])?;
    /// assert!(RedisStore::check_policies(&fine).is_ok());
    ///
    /// // A trillion units, one a day: 10^12 x 86,400,000,000 µs is past 2^53.
    /// let slow = PolicySet::from(Policy::token_bucket("slow", 1_000_000_000_000, Rate::per_day(1))?);
    /// let error = RedisStore::check_policies(&slow).unwrap_err();
    /// assert_eq!(error.kind(), StoreErrorKind::Unsupported);
    /// assert!(error.to_string().contains("\"slow\""), "{error}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_policies(policies: &PolicySet) -> Result<(), StoreError> {
        policies
            .iter()
            .try_for_each(|policy| script_args(policy).map(drop))
    }

    /// Loads every script and runs each algorithm once on a throw-away key, decision and
    /// adjustment (its windows and leases are 1 ms, so nothing lingers): a server that
    /// refuses a command the scripts need
    /// (an ACL without `EVALSHA`, `TIME` or a key pattern for the prefix; a replica that
    /// is read-only; a Redis too old for `TIME` in scripts) fails here, at start-up, with
    /// the server's own words, instead of on every request. It first checks that the
    /// server's Lua writes integers in 64 bits (the scripts write times with
    /// `string.format('%d')`; a 32-bit or a Windows build of Redis gets them wrong).
    ///
    /// ```no_run
    /// use deadpool_redis::{Config, Runtime};
    /// use tollgate::store::RedisStore;
    /// use tollgate::StoreErrorKind;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = Config::from_url("redis://127.0.0.1:6379").create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::from_pool(pool);
    /// match store.verify().await {
    ///     Ok(()) => {}
    ///     // The server answered, and refused (an ACL, a read-only replica): fix the set-up.
    ///     Err(error) if error.kind() == StoreErrorKind::Refused => return Err(error.into()),
    ///     // Not reachable yet: start, and let the failure mode answer until it is.
    ///     Err(error) => assert!(error.kind().is_io(), "{error}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn verify(&self) -> Result<(), StoreError> {
        let probe = PolicySet::new(
            [
                Policy::fixed_window("probe-fw", 1, Duration::from_millis(1)),
                Policy::sliding_window("probe-sw", 1, Duration::from_millis(1)),
                Policy::sliding_log("probe-sl", 1, Duration::from_millis(1)),
                Policy::token_bucket("probe-tb", 1, crate::Rate::per_second(1000)),
                Policy::leaky_bucket_shaping(
                    "probe-ls",
                    crate::Rate::per_second(1000),
                    Duration::ZERO,
                ),
                Policy::gcra("probe-gc", crate::Rate::per_second(1000), 1),
                Policy::concurrency_with_lease("probe-cc", 1, Duration::from_millis(1)),
            ]
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| StoreError::new(StoreErrorKind::Other, error.to_string()))?,
        )
        .map_err(|error| StoreError::new(StoreErrorKind::Other, error.to_string()))?;
        // Every algorithm in the multi-policy script, then each one's own script; on a
        // Cluster on every primary (each loads its own scripts, and may have its own ACL).
        let mut sets = vec![probe.clone()];
        sets.extend(probe.iter().map(|policy| PolicySet::from(policy.clone())));
        // Several policies without an in-flight limit: coalesced, so the multi-policy
        // batch script is checked too.
        sets.push(
            PolicySet::new(
                probe
                    .iter()
                    .filter(|policy| !policy.params().is_in_flight())
                    .cloned(),
            )
            .map_err(|error| StoreError::new(StoreErrorKind::Other, error.to_string()))?,
        );
        self.check_not_a_cluster_node().await?;
        let keys = self.start_up_identities().await;
        // On every primary (a key of the probe's routes each check to its node).
        if let Some(policy) = probe.iter().next() {
            for key in &keys {
                let (state, _) = self.keys.policy_keys(key.as_str(), policy);
                self.check_integer_format(&state).await?;
            }
        }
        'primaries: for key in &keys {
            for set in &sets {
                // The decision, then the adjustment script (a settle and a release), as a
                // request under settling and in-flight limits runs them.
                // Two decisions at once: the second, queued behind the first, goes as a
                // coalesced batch, so the batch script is loaded and checked too.
                let (first, second) =
                    tokio::join!(self.decide(key, set, 1), self.decide(key, set, 1));
                // The settle and release of the one admitted (an in-flight probe of one
                // slot admits one of two): a refusal's adjustment changes nothing, and
                // would leave the scripts' refunds unchecked.
                let admitted = first.and_then(|first| {
                    second.map(|second| if first.is_allowed() { first } else { second })
                });
                let checked = match admitted {
                    Ok(decision) => {
                        let receipt = decision.receipt();
                        match self
                            .adjust(key, set, &Adjustment::settle(1, 0, receipt))
                            .await
                        {
                            Ok(_) => {
                                self.adjust(key, set, &Adjustment::release(1, receipt))
                                    .await
                            }
                            Err(error) => Err(error),
                        }
                    }
                    Err(error) => Err(error),
                };
                match checked {
                    Ok(_) => {}
                    // A server that is away, loading or busy may answer in a moment: the
                    // failure mode covers that, as it does later. A refusal is fatal, and
                    // so is a replica at start behind a URL (`READONLY`: a reader's URL
                    // given). The sentinels named a primary: its `READONLY` is a failover
                    // caught in its middle, which they will resolve.
                    Err(error)
                        if error.kind().is_io()
                            && (matches!(self.backend, Backend::Sentinel(_))
                                || !demoted_code(error.code())) =>
                    {
                        #[cfg(feature = "tracing")]
                        tracing::warn!(
                            target: "tollgate",
                            %error,
                            "the Redis store's start-up check could not reach the server; \
                             continuing: the failure mode answers until it does"
                        );
                        #[cfg(not(feature = "tracing"))]
                        let _ = error;
                        // The other primaries are still checked.
                        continue 'primaries;
                    }
                    Err(error) => return Err(refused_at_start(&error)),
                }
            }
        }
        Ok(())
    }
}

impl RedisStore {
    /// A single server's URL (or a pool of one) that reaches a node of a Redis Cluster
    /// decides only the identities whose slots that node owns: the others are answered
    /// `MOVED`, and only the node's own slots could pass the decisions below. Refused at
    /// start, whichever slot the check's identity hashes to. A server that refuses `INFO`
    /// (an ACL) or cannot be reached is not judged here: a redirection met later is a
    /// refusal too ([`query_error`]).
    async fn check_not_a_cluster_node(&self) -> Result<(), StoreError> {
        if self.backend.is_cluster() {
            return Ok(());
        }
        let mut command = redis::cmd("INFO");
        command.arg("cluster");
        match query::<String>(&self.backend, &command).await {
            Ok(info) if info.lines().any(|line| line.trim() == "cluster_enabled:1") => {}
            _ => return Ok(()),
        }
        // A Cluster of one primary that owns every slot (a one-shard managed Cluster, an
        // emulated Cluster mode) decides every identity: a single server to us. Where
        // `CLUSTER NODES` is refused (an ACL), it cannot be told from a node of several,
        // and is refused as one.
        let nodes = query::<String>(&self.backend, redis::cmd("CLUSTER").arg("NODES")).await;
        if nodes.as_deref().is_ok_and(owns_every_slot) {
            return Ok(());
        }
        Err(StoreError::new(
            StoreErrorKind::Refused,
            format!(
                "the server is a node of a Redis Cluster that does not own every slot, or \
                 refuses CLUSTER NODES to say so (INFO: cluster_enabled:1), reached as a \
                 single server: {CLUSTER_NODE_ALONE}"
            ),
        ))
    }

    /// The scripts write times with Lua's `string.format('%d')`, which goes through a C
    /// `long`: on a build where it has 32 bits (a 32-bit or a Windows build) every time
    /// would be written wrong, and the limits would not hold. The Functions library checks
    /// at its first call (lua/store/check.lua); the scripts do not (a check on every run would
    /// cost the fallback about 5%), so it is checked here, once, on the node of `key`
    /// (a key of the start-up check, which the script does not touch: it routes the call,
    /// and the ACL allows it). Where the server cannot be reached, or refuses `EVAL` (an
    /// ACL for Functions only, whose library checks itself), nothing is checked here;
    /// any other error is logged as a warning.
    async fn check_integer_format(&self, key: &str) -> Result<(), StoreError> {
        // The library's own predicate (lua/store/check.lua), answered as 1 or 0.
        const CHECK: &str = concat!(
            include_str!("../../lua/store/check.lua"),
            "return integers_ok() and 1 or 0\n"
        );
        let mut command = redis::cmd("EVAL");
        command.arg(CHECK).arg(1).arg(key);
        match query::<i64>(&self.backend, &command).await {
            Ok(1) => Ok(()),
            Ok(_) => Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "this Redis's Lua formats 2^53 wrong: its C long has 32 bits (a 32-bit or a \
                 Windows build), and tollgate's scripts need a 64-bit one",
            )),
            Err(error) if error.kind().is_io() || error.code() == Some("NOPERM") => {
                #[cfg(feature = "tracing")]
                tracing::debug!(
                    target: "tollgate",
                    %error,
                    "the Redis store could not run its integer-format check with EVAL; \
                     the Functions library checks by itself"
                );
                #[cfg(not(feature = "tracing"))]
                let _ = error;
                Ok(())
            }
            Err(error) => {
                #[cfg(feature = "tracing")]
                tracing::warn!(
                    target: "tollgate",
                    %error,
                    "the Redis store's integer-format check failed; the scripts need a \
                     64-bit Redis, and only the Functions library checks it by itself"
                );
                #[cfg(not(feature = "tracing"))]
                let _ = error;
                Ok(())
            }
        }
    }

    /// One throw-away identity per Cluster primary (so every primary runs the check), or a
    /// single one on a standalone server or when the topology cannot be read.
    async fn start_up_identities(&self) -> Vec<Key> {
        const NAME: &str = "tollgate-start-up-check";
        let ranges = match &self.backend {
            Backend::Manager(_)
            | Backend::ManagerPinned(..)
            | Backend::Pool(_)
            | Backend::Pooled(_)
            | Backend::Sentinel(_) => Vec::new(),
            Backend::Cluster(managed) | Backend::ClusterPinned(managed, _) => {
                cluster_slot_ranges(&mut managed.connection()).await
            }
            Backend::PooledCluster(connection) => {
                let mut connection = (**connection).clone();
                cluster_slot_ranges(&mut connection).await
            }
            Backend::ClusterPool(pool) => match pool.get().await {
                Ok(mut connection) => cluster_slot_ranges(&mut connection).await,
                Err(_) => Vec::new(),
            },
        };
        let primaries = ranges
            .iter()
            .map(|(_, _, node)| node)
            .collect::<std::collections::HashSet<_>>()
            .len();
        if primaries == 0 {
            return vec![Key::new(NAME)];
        }
        // One pass over candidate identities until each primary owns one of them: about
        // 16384 / (the smallest primary's share of the slots) tries, bounded.
        let mut found: Vec<(&[u8], Key)> = Vec::with_capacity(primaries);
        for n in 0..1_000_000u32 {
            let identity = format!("{NAME}-{n}");
            let tag = self.keys.tag(&identity);
            let slot = crc16::State::<crc16::XMODEM>::calculate(&tag.as_bytes()[1..tag.len() - 1])
                % 16_384;
            let Some((_, _, node)) = ranges
                .iter()
                .find(|(first, last, _)| (*first..=*last).contains(&slot))
            else {
                continue;
            };
            if !found.iter().any(|(owner, _)| owner == &node.as_slice()) {
                found.push((node.as_slice(), Key::new(&identity)));
                if found.len() == primaries {
                    break;
                }
            }
        }
        found.into_iter().map(|(_, key)| key).collect()
    }
}

/// The slot ranges of a Cluster's primaries (`CLUSTER SLOTS`), each with the primary's
/// node id (or address); empty when it cannot be read (the check then runs on one slot,
/// and says so).
async fn cluster_slot_ranges<C: redis::aio::ConnectionLike>(
    connection: &mut C,
) -> Vec<(u16, u16, Vec<u8>)> {
    use redis::Value;
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => Some(bytes.clone()),
        Value::SimpleString(text) => Some(text.clone().into_bytes()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    };
    let reply: Result<Vec<Value>, _> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(connection)
        .await;
    let ranges: Vec<(u16, u16, Vec<u8>)> = match reply {
        Ok(entries) => entries
            .iter()
            .filter_map(|entry| {
                let Value::Array(fields) = entry else {
                    return None;
                };
                let (Some(Value::Int(first)), Some(Value::Int(last))) =
                    (fields.first(), fields.get(1))
                else {
                    return None;
                };
                // The primary: [ip, port, node id, ...]; older servers send no id.
                let Some(Value::Array(primary)) = fields.get(2) else {
                    return None;
                };
                let node = primary.get(2).and_then(text).or_else(|| {
                    let mut address = primary.first().and_then(text)?;
                    address.push(b':');
                    address.extend(primary.get(1).and_then(text)?);
                    Some(address)
                })?;
                Some((
                    u16::try_from(*first).ok()?,
                    u16::try_from(*last).ok()?,
                    node,
                ))
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    #[cfg(feature = "tracing")]
    if ranges.is_empty() {
        tracing::warn!(
            target: "tollgate",
            "could not read the Cluster's slots (CLUSTER SLOTS); the start-up check of the \
             scripts ran on one primary only"
        );
    }
    ranges
}

fn refused_at_start(error: &StoreError) -> StoreError {
    // A replica at start is the URL's fault: refused, whatever it is once running.
    let kind = if demoted_code(error.code()) {
        StoreErrorKind::Refused
    } else {
        error.kind()
    };
    let mut checked = StoreError::new(
        kind,
        format!(
            "the start-up check of the Redis store's scripts failed: {}",
            error.message
        ),
    );
    if let Some(code) = error.code() {
        checked = checked.with_code(code);
    }
    checked
}

impl Store for RedisStore {
    fn validate(&self, policies: &PolicySet) -> Result<(), StoreError> {
        Self::check_policies(policies)
    }

    fn decide(&self, key: &Key, policies: &PolicySet, cost: u64) -> DecideFuture {
        let lease = if policies.has_in_flight() {
            lease_id()
        } else {
            0
        };
        // Shared with a batch that may follow this call (not copied for each decision).
        let invocation = match self.invocation(Call::Decide, key, policies, cost, lease) {
            Ok(invocation) => Arc::new(invocation),
            Err(error) => return DecideFuture::ready(Err(error)),
        };
        let (backend, scripts) = (self.backend.clone(), Arc::clone(&self.scripts));
        // A decision dropped before its answer (a timeout, a client gone) may still have
        // taken slots: they are given back rather than held for a whole lease.
        let slots = if lease == 0 {
            Vec::new()
        } else {
            invocation.slot_keys(policies)
        };
        // In-flight limits name each request's slot: never coalesced.
        let coalescer = self.coalescer.clone().filter(|_| lease == 0);
        #[cfg(feature = "__test-clock")]
        let clock = self.clock.clone();
        DecideFuture::new(async move {
            // Behind a call in flight with the same keys and policies: wait, and go with
            // the next batch. Joined when first polled, not when made: a decision made and
            // not yet polled would lead a batch, and those made after it would wait for it
            // to run (a caller that makes its futures first, or drives them out of order).
            let mut lead = None;
            if let Some(coalescer) = &coalescer {
                match coalescer.join(invocation.call_id(), cost) {
                    coalesce::Joined::Leader(leader) => lead = Some(leader),
                    coalesce::Joined::Alone => {}
                    coalesce::Joined::Follower(answer) => {
                        return answer.await.unwrap_or_else(|_| {
                            Err(StoreError::new(
                                StoreErrorKind::Other,
                                "the batch that carried this decision was dropped",
                            ))
                        });
                    }
                }
            }
            if let Some(lead) = &mut lead {
                lead.prepare(coalesce::Batch {
                    backend: backend.clone(),
                    scripts: Arc::clone(&scripts),
                    invocation: Arc::clone(&invocation),
                    #[cfg(feature = "__test-clock")]
                    clock,
                });
            }
            let mut guard = None;
            let backend = if slots.is_empty() {
                backend
            } else {
                // Slots are taken and given back on one connection (`Backend::pinned`).
                // The guard is armed once that connection is ours: a decision dropped
                // while waiting for it sent nothing, and has nothing to give back.
                let pinned = backend.pinned().await?;
                guard = Some(LeaseGuard {
                    pinned: Some(pinned.clone()),
                    fallback: backend,
                    keys: slots,
                    lease,
                });
                pinned
            };
            let reply = invoke(&backend, &scripts, Call::Decide, &invocation).await;
            // Back (or failed): what queued behind this call goes now, as one batch.
            drop(lead);
            let reply = reply?;
            let decision = parse_reply(&reply, invocation.shape, invocation.count, cost, lease)?;
            // Answered and read: from here the layer frees the slots it was given (and the
            // pooled connection goes back). An answer that could not be read gives them
            // back here (the guard, still armed): the request never got them.
            if let Some(mut guard) = guard {
                guard.keys.clear();
            }
            Ok(decision)
        })
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(&self, key: &Key, policies: &PolicySet, adjustment: &Adjustment) -> DecideFuture {
        let receipt = adjustment.receipt();
        // ARGV[2] (the script's cost), then the amount, the time of the debit ("-1": any
        // time, newest first) and the mode.
        let (cost, amount, at, mode) = match adjustment.change() {
            Change::Settle { reserved, actual } => {
                (reserved, actual, (receipt.at() / 1_000).to_string(), "0")
            }
            Change::Release { cost } => (cost, 0, (receipt.at() / 1_000).to_string(), "1"),
            Change::Grant { units } => (0, units, "-1".to_owned(), "2"),
            Change::SetRemaining { remaining } => (0, remaining, "-1".to_owned(), "3"),
            Change::Unbook { cost } => (cost, 0, (receipt.at() / 1_000).to_string(), "4"),
        };
        let mut invocation =
            match self.invocation(Call::Adjust, key, policies, cost, receipt.lease()) {
                Ok(invocation) => invocation,
                Err(error) => return DecideFuture::ready(Err(error)),
            };
        // A cost no policy admits is as good as any larger. A grant is set against what
        // is owed too, up to `MAX_LIMIT` past a limit of up to `MAX_LIMIT`: past twice
        // that it forgives any debt (and stays exact as a Lua number).
        let most = match adjustment.change() {
            Change::Grant { .. } => 2 * crate::policy::MAX_LIMIT + 1,
            _ => crate::policy::MAX_LIMIT + 1,
        };
        invocation.args.push(amount.min(most).to_string());
        invocation.args.push(at);
        invocation.args.push(mode.to_owned());
        // The policies not debited, by index: every one of a refusal's, past the 64th too.
        let undebited = receipt.undebited();
        let indices: Vec<String> = if receipt.is_refusal() {
            (0..policies.len()).map(|index| index.to_string()).collect()
        } else {
            (0..64)
                .filter(|index| undebited & (1 << index) != 0)
                .map(|index| index.to_string())
                .collect()
        };
        invocation.args.push(indices.join(","));
        let left: Vec<String> = adjustment
            .left_after_debit()
            .iter()
            .map(u64::to_string)
            .collect();
        invocation.args.push(left.join(","));
        // An unbooking's queue ends, in microseconds (the script's time line).
        let ends: Vec<String> = adjustment
            .queue_ends()
            .iter()
            .map(|end| (end / 1_000).to_string())
            .collect();
        invocation.args.push(ends.join(","));
        let (backend, scripts) = (self.backend.clone(), Arc::clone(&self.scripts));
        // A release given up on (the store timeout) or failed frees its slots all the
        // same, with a call of one key each, as a dropped decision's are: the script's
        // call names every policy's key, and on a Cluster slot being moved it is answered
        // `TRYAGAIN` for the whole move while one of them is missing (a full bucket's,
        // a penalty's before its first strike), which redis-rs tries again only after
        // more than a second. Lost, the slot was held for its lease.
        let lease = receipt.lease();
        let slots = match adjustment.change() {
            Change::Release { cost } if cost > 0 && lease != 0 => invocation.slot_keys(policies),
            _ => Vec::new(),
        };
        DecideFuture::new(async move {
            let mut guard = (!slots.is_empty()).then(|| LeaseGuard {
                pinned: None,
                fallback: backend.clone(),
                keys: slots,
                lease,
            });
            let reply = invoke(&backend, &scripts, Call::Adjust, &invocation).await?;
            let answer = parse_reply(&reply, invocation.shape, invocation.count, 0, lease);
            // Answered: the script freed the slots (an answer that could not be read
            // leaves the guard to free them).
            if answer.is_ok()
                && let Some(guard) = &mut guard
            {
                guard.keys.clear();
            }
            answer
        })
    }

    fn reset(&self, key: &Key, policies: &PolicySet) -> ResetFuture {
        let mut keys = Vec::with_capacity(2 * policies.len());
        for policy in policies.iter() {
            let (state, aux) = self.keys.policy_keys(key.as_str(), policy);
            // In-flight slots are freed by their requests only (as in process); a
            // reset forgives, so a penalty's blocks and strikes go, an in-flight
            // policy's too (its auxiliary key is its penalty's alone).
            if !policy.params().is_in_flight() {
                keys.push(state);
            }
            // Without a penalty the auxiliary key is never written: named, it would make
            // a reset of one policy a call of two keys, refused (`TRYAGAIN`) on a Cluster
            // slot being moved while one is missing.
            if policy.penalty_box().is_some() {
                keys.push(aux);
            }
        }
        let backend = self.backend.clone();
        Box::pin(async move {
            if keys.is_empty() {
                return Ok(());
            }
            // One command: every key of one identity shares a hash tag, so a Cluster
            // takes them in one slot.
            let mut command = redis::cmd("DEL");
            for key in &keys {
                command.arg(key);
            }
            query::<i64>(&backend, &command).await.map(drop)
        })
    }
}

/// One script call's keys and arguments.
struct Invocation {
    keys: Vec<String>,
    args: Vec<String>,
    count: usize,
    /// The algorithm of the last policy (the script of a one-policy set).
    single_kind: Option<&'static str>,
    /// How its decisions answer: one plain policy of an algorithm with a path of its own
    /// answers its raw state.
    shape: Shape,
}

impl Invocation {
    /// The keys holding `policies`' in-flight slots (each policy's state key: the first of
    /// its two, or its only one on a lone policy's own path).
    fn slot_keys(&self, policies: &PolicySet) -> Vec<String> {
        policies
            .iter()
            .zip(self.keys.chunks(2))
            .filter(|(policy, _)| policy.params().is_in_flight())
            .map(|(_, keys)| keys[0].clone())
            .collect()
    }

    /// `COMMAND first numkeys keys... args...`: an `FCALL` (first: the function), an
    /// `EVALSHA` (the SHA1) or an `EVAL` (the text).
    fn command(&self, command: &str, first: &str) -> redis::Cmd {
        let mut built = redis::cmd(command);
        built
            .arg(first)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        built
    }

    /// `FCALL function 1 key cost p1 p2 p3 [now]`: a lone plain policy's decision by its
    /// algorithm's own function (lua/store/one.lua). The arguments are the invocation's (now,
    /// cost, count, kind, p1, p2, p3) without the count and the kind, which the function
    /// names; the time comes last, and only from a test clock.
    fn one_command(&self, function: &str) -> redis::Cmd {
        debug_assert!(self.count == 1 && self.keys.len() == 1 && self.args.len() == 7);
        let mut built = redis::cmd("FCALL");
        built
            .arg(function)
            .arg(1)
            .arg(&self.keys)
            .arg(&self.args[1])
            .arg(&self.args[4..7]);
        if !self.args[0].is_empty() {
            built.arg(&self.args[0]);
        }
        built
    }

    /// What makes two decisions the same call but for their cost: the keys and the
    /// policies' arguments (not the time, not the cost). Two stores with other prefixes,
    /// or two sets that spell other policies, never share a batch.
    fn call_id(&self) -> String {
        let mut id = String::with_capacity(64 * self.keys.len());
        for part in self.keys.iter().chain(self.args.iter().skip(3)) {
            id.push_str(part);
            id.push('\n');
        }
        id
    }
}

impl RedisStore {
    /// The keys and arguments of `call` (a decision, or an adjustment) of `cost` for `key`
    /// under `policies`; in-flight policies name their slot `lease`.
    fn invocation(
        &self,
        call: Call,
        key: &Key,
        policies: &PolicySet,
        cost: u64,
        lease: u64,
    ) -> Result<Invocation, StoreError> {
        let mut keys = Vec::with_capacity(2 * policies.len());
        let mut args: Vec<String> = Vec::with_capacity(6 + 4 * policies.len());
        args.push(self.now_argument());
        // A cost above every limit is "never fits" whatever its size: send one the script's
        // doubles hold exactly.
        args.push(cost.min(crate::policy::MAX_LIMIT + 1).to_string());
        args.push(policies.len().to_string());
        let mut single_kind = None;
        let mut shape = Shape::Full;
        for policy in policies.iter() {
            let (kind, p1, p2, p3) = script_args(policy)?;
            let p3 = if kind == "cc" { lease } else { p3 };
            single_kind = Some(kind);
            // A lone plain policy's decision takes its algorithm's own path, which answers
            // the raw state and reads the state key only; an adjustment answers in full.
            if matches!(call, Call::Decide)
                && policies.len() == 1
                && !policy.is_shadow()
                && policy.penalty_box().is_none()
            {
                shape = Shape::raw(kind, [p1, p2, p3]);
            }
            if matches!(shape, Shape::Raw(_)) {
                keys.push(self.keys.state_key(key.as_str(), policy));
            } else if policy.penalty_box().is_some() {
                let (state, aux) = self.keys.policy_keys(key.as_str(), policy);
                keys.extend([state, aux]);
            } else {
                // The second key holds a penalty's state only. Named, it would make a
                // call of one policy a call of two keys, which a Cluster slot being
                // moved refuses (`TRYAGAIN`) while one is missing, as that one always
                // is: the state key stands in its place (the same key twice is one).
                let state = self.keys.state_key(key.as_str(), policy);
                keys.extend([state.clone(), state]);
            }
            args.push(spelled_kind(kind, policy));
            args.push(p1.to_string());
            args.push(p2.to_string());
            args.push(p3.to_string());
        }
        Ok(Invocation {
            keys,
            args,
            count: policies.len(),
            single_kind,
            shape,
        })
    }
}

/// The in-flight slots a decision may have taken, given back if the decision is dropped
/// (or fails) before its answer arrives; or a release's, freed so if the release is.
/// Removing a slot that was never taken is harmless.
struct LeaseGuard {
    /// The connection the decision's script went on: the release goes behind it. A
    /// pool's is nobody else's until the release is done (a transaction or a `SELECT` of
    /// theirs would catch it). `None` for a release's guard: it follows no script, and
    /// its failure was counted and said where the release was given up on
    /// (`Reservation`), so this second try's is said at debug level only.
    pinned: Option<Backend>,
    /// The store's backend: where the release goes when the pinned connection broke.
    fallback: Backend,
    keys: Vec<String>,
    lease: u64,
}

/// How long the release of a dropped decision's slots may take before it is reported
/// (the slots then expire with their lease, unless the release still runs).
const RELEASE_WITHIN: Duration = Duration::from_secs(5);

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the slots expire with their lease
        };
        // The pinned connection moves into the task (a pool's goes back when it ends).
        let of_release = self.pinned.is_none();
        let (mut pinned, fallback, keys, member) = (
            self.pinned.take(),
            self.fallback.clone(),
            std::mem::take(&mut self.keys),
            self.lease.to_string(),
        );
        runtime.spawn(async move {
            let mut first_error = None;
            let release = async {
                // Every key gets its release, whatever happened to the one before (a
                // timeout says nothing of the next: the command may still run).
                for key in &keys {
                    let mut command = redis::cmd("ZREM");
                    command.arg(key).arg(&member);
                    let answered = match &pinned {
                        Some(connection) => query::<i64>(connection, &command).await,
                        None => query::<i64>(&fallback, &command).await,
                    };
                    let result = match answered {
                        // Unavailable: the connection broke, or the server answered that it
                        // cannot serve now (BUSY, LOADING...). Either way nothing of the
                        // script is queued behind this command any more: the releases may
                        // go another way. The pooled connection goes back first (a retry
                        // through the pool must not wait for it, nor hold it).
                        Err(error)
                            if error.kind() == StoreErrorKind::Unavailable && pinned.is_some() =>
                        {
                            pinned = None;
                            query::<i64>(&fallback, &command).await
                        }
                        other => other,
                    };
                    if let Err(error) = result {
                        first_error.get_or_insert(error);
                    }
                }
            };
            if tokio::time::timeout(RELEASE_WITHIN, release).await.is_err() {
                first_error.get_or_insert(StoreError::new(
                    StoreErrorKind::Timeout,
                    format!("no answer within {RELEASE_WITHIN:?} (it may still run)"),
                ));
            }
            // The pooled connection goes back only now.
            drop(pinned);
            // Counted; an outage at debug level (the requests meet it), anything else
            // (a refusal) at error level. A release's: counted and said already.
            match first_error {
                Some(error) if of_release => {
                    #[cfg(feature = "tracing")]
                    tracing::debug!(target: "tollgate", %error, "could not free the in-flight slots of a release given up on either; they expire with their lease");
                    let _ = error;
                }
                Some(error) => super::unmet(
                    &error,
                    "could not give back the in-flight slots of a dropped decision; they \
                     expire with their lease",
                ),
                None => {}
            }
        });
    }
}

/// A fresh name for one request's in-flight slots: random, below 2^52 so the scripts'
/// doubles hold it exactly.
fn lease_id() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    // A per-process random seed, and a sequence that never repeats within the process.
    let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    let random = foldhash::fast::RandomState::default().hash_one(sequence);
    (random & ((1 << 52) - 1)).max(1)
}

/// Runs one command on `backend`.
async fn query<T: redis::FromRedisValue>(
    backend: &Backend,
    command: &redis::Cmd,
) -> Result<T, StoreError> {
    let cluster = backend.is_cluster();
    match backend.clone() {
        Backend::Manager(managed) => {
            let connection = managed.connection();
            managed.query(command, connection).await
        }
        // A connection left for a new one since (a release behind its old script): what
        // it answers says nothing of the one in use.
        Backend::ManagerPinned(managed, generation, mut connection)
            if managed.generation() != generation =>
        {
            command.query_async(&mut connection).await
        }
        Backend::ManagerPinned(managed, _, connection) => managed.query(command, connection).await,
        Backend::Pooled(checkout) => {
            let answer = command.query_async(&mut checkout.connection()).await;
            if answer.as_ref().is_err_and(off_the_primary) {
                checkout.leave();
            }
            answer
        }
        Backend::Cluster(managed) => {
            let connection = managed.connection();
            managed.query(command, connection).await
        }
        Backend::ClusterPinned(managed, connection) => managed.query(command, connection).await,
        Backend::PooledCluster(connection) => {
            command.query_async(&mut (**connection).clone()).await
        }
        Backend::Pool(pool) => {
            let mut connection = pool.get().await.map_err(no_connection)?;
            let answer = command.query_async(&mut connection).await;
            if answer.as_ref().is_err_and(off_the_primary) {
                drop(deadpool_redis::Connection::take(connection));
            }
            answer
        }
        Backend::ClusterPool(pool) => {
            let mut connection = pool.get().await.map_err(no_connection)?;
            command.query_async(&mut connection).await
        }
        Backend::Sentinel(sentinel) => {
            let (generation, mut connection) = sentinel.connection().await?;
            return command
                .query_async(&mut connection)
                .await
                .map_err(|error| sentinel.outcome(generation, query_error(error, false)));
        }
    }
    .map_err(|error| query_error(error, cluster))
}

/// A command's error as the store's. Refused credentials on one connection are every
/// request's refusal (the breaker holds requests off while a new connection is made; as
/// a plain refusal each closed it again, mid-outage), and so is a server that refuses
/// writes (`OOM` out of memory, `MISCONF` unable to persist: every decision writes); on
/// a Cluster, one node's are not.
fn query_error(error: RedisError, cluster: bool) -> StoreError {
    // A redirection on a connection to one server: the server is a Cluster's node. A
    // node of several, reached as a single server, refuses the identities of every other
    // node's slots for good: not an outage to wait out behind the failure mode (each
    // replica's fallback limiting on its own), nor one that holds every identity off
    // (this node's own are decided). Or a one-shard Cluster's primary that a failover
    // made a replica: the connection is made anew (see `moved`), and the message says
    // both.
    if !cluster && (moved(&error) || error.code() == Some("CLUSTERDOWN")) {
        let code = error.code().map(str::to_owned);
        // Only a `MOVED` can be a one-shard Cluster's failover (an `ASK` is a slot moving
        // between shards; `CLUSTERDOWN` is said by a node of any Cluster).
        let failover = if error.code() == Some("MOVED") {
            " (or, on a one-shard Cluster, the primary a failover made a replica: the \
             connection is made anew)"
        } else {
            ""
        };
        let mut refused = StoreError::new(
            StoreErrorKind::Refused,
            format!(
                "{error}: the server is a node of a Redis Cluster{failover}: \
                 {CLUSTER_NODE_ALONE}"
            ),
        );
        if let Some(code) = code {
            refused = refused.with_code(code);
        }
        return refused.with_source(error);
    }
    let every_request = !cluster
        && (password_refused(&error)
            || tls_refused(&error)
            || matches!(server_code(&error), Some("OOM" | "MISCONF")));
    let mut error = store_error(error);
    error.every_request |= every_request;
    error
}

/// Whether the node answering `CLUSTER NODES` (its `myself` line) is a primary that owns
/// all 16384 slots: fields from the ninth on are its slots (`0-16383`, `5`), or slots
/// moving (`[5->-id]`), which are not counted.
fn owns_every_slot(nodes: &str) -> bool {
    let flagged = |flags: &str, wanted: &str| flags.split(',').any(|flag| flag == wanted);
    let Some(myself) = nodes.lines().find(|line| {
        line.split_whitespace()
            .nth(2)
            .is_some_and(|flags| flagged(flags, "myself"))
    }) else {
        return false;
    };
    let mut fields = myself.split_whitespace();
    let primary = fields.nth(2).is_some_and(|flags| flagged(flags, "master"));
    // The fields after the flags: primary, ping, pong, epoch, link state, then slots.
    let owned: u32 = fields
        .skip(5)
        .filter(|range| !range.starts_with('['))
        .map(|range| {
            let mut ends = range.split('-');
            let first = ends.next().and_then(|end| end.parse::<u32>().ok());
            let last = ends
                .next()
                .and_then(|end| end.parse::<u32>().ok())
                .or(first);
            match (first, last) {
                (Some(first), Some(last)) if first <= last => last - first + 1,
                _ => 0,
            }
        })
        .sum();
    primary && owned == 16384
}

/// What to do about a Cluster's node reached as a single server.
const CLUSTER_NODE_ALONE: &str = "it decides only the identities whose slots it owns; \
     connect to the Cluster as one (RedisConfig::cluster, RedisStore::connect_cluster, \
     REDIS_CLUSTER in the examples)";

/// Runs `call` with the invocation's keys and arguments on `backend`: the library's
/// function (loaded, once, when the server does not have it: a restart, a flush, a node
/// that joined), or the script where Functions are missing or refused.
///
/// A user who may run the functions but no scripts (an ACL for Functions only) is found
/// out by the first script refused: the store goes back to Functions at once, and this
/// call runs again as a function, once. Scripts are then not tried for a minute (see
/// [`Scripts::scripts_refused`]).
async fn invoke(
    backend: &Backend,
    scripts: &Scripts,
    call: Call,
    invocation: &Invocation,
) -> Result<Vec<i64>, StoreError> {
    use std::sync::atomic::Ordering;
    match invoke_once(backend, scripts, call, invocation).await {
        Err(error) if scripts_refused(&error) => {
            scripts
                .scripts_refused_at
                .store(scripts.now_ms(), Ordering::Relaxed);
            // `FCALL` itself refused too: nothing this user may run.
            if scripts.fcall_refused.load(Ordering::Relaxed) {
                return Err(error);
            }
            // Back to Functions: the store went to scripts because a load failed or
            // was refused, or a node missed the library, and every node would refuse
            // every call for a minute, those whose function is there too.
            scripts.fell_back.store(0, Ordering::Relaxed);
            scripts.functions.store(true, Ordering::Relaxed);
            Box::pin(invoke_once(backend, scripts, call, invocation)).await
        }
        answered => answered,
    }
}

/// [`invoke`], once.
async fn invoke_once(
    backend: &Backend,
    scripts: &Scripts,
    call: Call,
    invocation: &Invocation,
) -> Result<Vec<i64>, StoreError> {
    use std::sync::atomic::Ordering;
    // The loads so far, read before whether Functions are on: a load that fails after
    // this (and switches the store to scripts) is seen by this call's own (see
    // `load_library`).
    let loads = (
        scripts.loads.load(Ordering::Acquire),
        scripts.failed_loads.load(Ordering::Acquire),
    );
    if !scripts.functions.load(Ordering::Relaxed) {
        scripts.try_functions_again();
    }
    if scripts.functions.load(Ordering::Relaxed) {
        let command = scripts.function_command(call, invocation);
        let refused = match query::<Vec<i64>>(backend, &command).await {
            Ok(reply) => return Ok(reply),
            // No scripts to run, and a load refused (or one that left this node without
            // the library) a moment ago: this call fails, with no load sent.
            Err(error) if function_not_found(&error) && scripts.loads_held() => {
                return Err(scripts.held());
            }
            Err(error) if function_not_found(&error) => {
                match load_and_call(backend, scripts, &command, loads).await {
                    // The load met a server that did not answer (on a Cluster, a load
                    // must reach every primary; one stopped), or the store went to
                    // scripts while this call waited for it: this call runs as a script
                    // on its own node, which may well answer, and so do the calls of
                    // the next minute (see `load_library`). Not for a user who may not
                    // run scripts: this call fails, on I/O.
                    Err(error) if error.kind().is_io() => {
                        if scripts.scripts_refused() {
                            return Err(error);
                        }
                        return run_script(backend, scripts.script(call, invocation), invocation)
                            .await;
                    }
                    // Loaded (here or by another request since), and still missing where
                    // the call went: a node outside the primaries a load reaches (one that
                    // joined a Cluster with no slot yet, a call `ASK`ed to it while a slot
                    // moves there), a server that lost the library again just after, or
                    // a bug of ours (a function the library does not register). Said and
                    // counted; scripts for a while (no load per call meanwhile), this
                    // call first. A user who may not run scripts: this call fails (the
                    // layer counts its error), and loads are held a moment.
                    Ok(Err(error)) if function_not_found(&error) => {
                        if scripts.scripts_refused() {
                            scripts.hold_loads();
                            return Err(error);
                        }
                        // Said by the call that switched the store (calls that met it
                        // together are each counted).
                        missing_after_load(&error, switch_to_scripts(scripts));
                        return run_script(backend, scripts.script(call, invocation), invocation)
                            .await;
                    }
                    Ok(answered) => return answered,
                    Err(error) => error,
                }
            }
            Err(error) if functions_refused(&error) => error,
            Err(error) => return Err(error),
        };
        if !fall_back_to_scripts(scripts, &refused) {
            return Err(refused);
        }
    }
    run_script(backend, scripts.script(call, invocation), invocation).await
}

/// Whether `error` says this user may not run scripts (an ACL for Functions only).
fn scripts_refused(error: &StoreError) -> bool {
    let message = error.message.to_ascii_lowercase();
    error.code() == Some("NOPERM") && (message.contains("'evalsha'") || message.contains("'eval'"))
}

/// Whether `error` says the server has no such function: its library is missing.
fn function_not_found(error: &StoreError) -> bool {
    error.message.contains("Function not found")
}

/// Loads the library the server was missing and calls the function again: `Ok` with
/// the answer to give, or `Err` when the store is to run scripts instead (an I/O error,
/// or a switch to scripts met while waiting for the load: this call runs as one, and
/// the store was switched for a minute where the load failed, see `Loading`). Loading refused
/// for Functions themselves (an ACL without `FUNCTION LOAD`, a server without them) falls
/// back quietly, as designed; refused for anything else (`OOM`, the library's own error:
/// a bug of ours) falls back too, so decisions stay exact, but is logged at error level
/// and counted, never hidden behind the fallback; for a user who may run no scripts, the
/// call fails with the refusal and loads are held [`HOLD_LOADS`]. One load per call at most: a call
/// that still meets no function is the caller's to run as a script.
async fn load_and_call(
    backend: &Backend,
    scripts: &Scripts,
    command: &redis::Cmd,
    seen: (u64, u64),
) -> Result<Result<Vec<i64>, StoreError>, StoreError> {
    match load_library(backend, scripts, seen).await {
        Ok(true) => {}
        // Another request's load was refused a moment ago, for a user who may run no
        // scripts (said there): this call fails with no load sent.
        Ok(false) if scripts.loads_held() => return Err(scripts.held()),
        // Another request's load was refused while this one waited its turn, or failed
        // on I/O: said, counted and switched there; this call runs as a script, quietly.
        Ok(false) => {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the store went to scripts while this request waited to load the Redis \
                 Functions library",
            ));
        }
        // The caller runs the call as a script.
        Err(error) if error.kind().is_io() => return Err(error),
        Err(error) if functions_refused(&error) => return Err(error),
        Err(error) => {
            library_refused(&error, scripts.scripts_refused());
            return Err(error);
        }
    }
    match query::<Vec<i64>>(backend, command).await {
        Err(error) if functions_refused(&error) => Err(error),
        answered => Ok(answered),
    }
}

/// Loading the library was refused for something else than Functions being unavailable
/// (`OOM`, an error in the library): counted as a store error, and logged at error level
/// (a load is tried again at most once a minute, or once in [`HOLD_LOADS`] for a user who
/// may run no scripts, so this is said at most that often). The
/// store knows no telemetry module (it sits below it): counted and logged here.
///
/// For a user who may run no scripts (`no_scripts`) the calls that needed the load fail
/// with its error, which the layer counts: said here, not counted twice.
fn library_refused(error: &StoreError, no_scripts: bool) {
    #[cfg(feature = "metrics")]
    if !no_scripts {
        metrics::counter!("tollgate_store_errors_total", "kind" => error.kind().as_str())
            .increment(1);
    }
    #[cfg(feature = "tracing")]
    tracing::error!(
        target: "tollgate",
        %error,
        kind = error.kind().as_str(),
        code = error.code().unwrap_or(""),
        meanwhile = if no_scripts {
            "this user may run no scripts: the decisions on a node without the library fail"
        } else {
            "decisions run as EVALSHA scripts"
        },
        "loading the Redis Functions library was refused: this is a bug or a \
         misconfiguration (counted in tollgate_store_errors_total)"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = (error, no_scripts);
}

/// Scripts from now on, for a minute (then Functions are tried again): whether the store
/// ran Functions until now. Not for a user who may not run scripts (see
/// [`Scripts::scripts_refused`]): Functions stay on, and the call that failed fails.
fn switch_to_scripts(scripts: &Scripts) -> bool {
    !scripts.scripts_refused() && go_to_scripts(scripts)
}

/// Scripts from now on, for a minute, whatever the user may run: whether the store ran
/// Functions until now.
fn go_to_scripts(scripts: &Scripts) -> bool {
    use std::sync::atomic::Ordering;
    let was = scripts.functions.swap(false, Ordering::Relaxed);
    scripts.fell_back.store(scripts.now_ms(), Ordering::Relaxed);
    was
}

/// A call still met no function after the library loaded: counted as a store error, and
/// logged at error level when this call switched the store to scripts (`switched`: it
/// runs scripts for a minute then, so this is said at most that often).
fn missing_after_load(error: &StoreError, switched: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tollgate_store_errors_total", "kind" => error.kind().as_str()).increment(1);
    #[cfg(feature = "tracing")]
    if switched {
        tracing::error!(
            target: "tollgate",
            %error,
            kind = error.kind().as_str(),
            "a call met no function after the Redis Functions library loaded: a Cluster \
             node the load does not reach (one that joined with no slot yet, during a slot \
             move), or a bug; decisions run as EVALSHA scripts for a minute (counted in \
             tollgate_store_errors_total)"
        );
    }
    #[cfg(not(feature = "tracing"))]
    let _ = (error, switched);
}

/// The server cannot or may not run the library's functions: no Functions (before Redis
/// 7), or an ACL without `FCALL`. (A refusal of a key is not this: scripts would meet it
/// too.)
fn functions_refused(error: &StoreError) -> bool {
    fcall_refused(error)
        || (error.code() == Some("NOPERM")
            && error.message.to_ascii_lowercase().contains("'function"))
}

/// From now on this store's calls are `EVALSHA` scripts (as exact), for a minute, after
/// `error` refused Functions or the library's load. Said once. Not when only the load was
/// refused and this user may not run scripts (see [`Scripts::scripts_refused`]): Functions
/// stay on for the nodes that have the library, loads are held for [`HOLD_LOADS`], and `false`
/// says the call that met the refusal fails with it.
fn fall_back_to_scripts(scripts: &Scripts, error: &StoreError) -> bool {
    use std::sync::atomic::Ordering;
    if fcall_refused(error) {
        scripts.fcall_refused.store(true, Ordering::Relaxed);
    } else if scripts.scripts_refused() {
        scripts.hold_loads();
        return false;
    }
    go_to_scripts(scripts);
    if !scripts.said.swap(true, Ordering::Relaxed) {
        #[cfg(feature = "tracing")]
        tracing::info!(
            target: "tollgate",
            %error,
            "Redis Functions are not available to this store; decisions run as EVALSHA \
             scripts (as exact; a little more Redis CPU each)"
        );
    }
    #[cfg(not(feature = "tracing"))]
    let _ = error;
    true
}

/// Whether `error` refused `FCALL` itself: a server without Functions (before Redis 7),
/// or an ACL without `FCALL` (not one without `FUNCTION LOAD` alone).
fn fcall_refused(error: &StoreError) -> bool {
    let message = error.message.to_ascii_lowercase();
    message.contains("unknown command")
        || (error.code() == Some("NOPERM") && message.contains("'fcall'"))
}

/// Loads the Functions library (`FUNCTION LOAD`, on a Cluster on every primary; a server
/// that has it already refuses the load at once, and that means loaded: the library's
/// name carries a hash of its text, so the same name is the same text, which `REPLACE`
/// would compile again on each of them, once per replica of the app that met the loss),
/// unless another
/// request of this store has loaded it since this one saw it missing (`seen`: the count
/// of loads before its call): `Ok(true)`. `Ok(false)` when the load was refused to a
/// request ahead of this one, which switched the store to scripts meanwhile or, for a
/// user who may run no scripts, held loads: requests that met the missing library
/// together send the load (to a server maybe out of memory) and say its refusal once,
/// not once each.
async fn load_library(
    backend: &Backend,
    scripts: &Scripts,
    (seen, failed): (u64, u64),
) -> Result<bool, StoreError> {
    use std::sync::atomic::Ordering;
    // One load at a time; but a caller holding a pooled connection does not wait for
    // the loader, which may itself be waiting for a pooled connection (callers like this
    // one may hold them all): it loads alongside (the second load is refused as loaded).
    let _one_at_a_time = if backend.checked_out() {
        scripts.reload.try_lock().ok()
    } else {
        Some(scripts.reload.lock().await)
    };
    if scripts.loads.load(Ordering::Acquire) != seen {
        return Ok(true);
    }
    // A load sent since this request met the missing library failed on I/O: this one
    // would too, after as long a wait.
    if scripts.failed_loads.load(Ordering::Acquire) != failed {
        return Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "loading the Redis Functions library failed (a server did not answer) for \
             another request",
        ));
    }
    if !scripts.functions.load(Ordering::Relaxed) {
        return Ok(false);
    }
    // A load refused to a request ahead of this one, for a user who may run no scripts:
    // not sent again so soon (requests that met the loss together load once).
    if scripts.loads_held() {
        return Ok(false);
    }
    let mut command = redis::cmd("FUNCTION");
    command.arg("LOAD").arg(&scripts.library.source);
    // Dropped before it ends, the load failed on I/O: see `Loading`. (Declared after the
    // turn: dropped while the turn is held, so that those waiting for it see the switch.)
    let mut loading = Loading {
        scripts,
        ended: false,
    };
    match query::<redis::Value>(backend, &command).await {
        // Loaded, here or by another replica of the app first.
        Err(error) if !already_loaded(&error, &scripts.library.name) => {
            // Refused: scripts from now on (for a minute). On I/O, `Loading` switches.
            if !error.kind().is_io() {
                loading.ended = true;
                fall_back_to_scripts(scripts, &error);
            }
            Err(error)
        }
        _ => {
            loading.ended = true;
            scripts.loads.fetch_add(1, Ordering::Release);
            Ok(true)
        }
    }
}

/// Whether a load's refusal says the server has the library `name` already (`Library
/// 'NAME' already exists`): another replica of the app loaded it first. (Not another
/// "already exists": a function registered twice, or by another library, is an error.)
fn already_loaded(error: &StoreError, name: &str) -> bool {
    error.message.to_ascii_lowercase().contains(&format!(
        "library '{}' already exists",
        name.to_ascii_lowercase()
    ))
}

/// A library load in flight. Dropped before it ended, it failed on I/O: a server did
/// not answer it (on a Cluster, a load must reach every primary, and one stopped), or its
/// request gave up first (a store timeout shorter than the server's silence). Calls then
/// run as scripts for a minute, each on its own node, with no load each meanwhile (each
/// waiting on the server that did not answer): as exact. Said at debug level (a server
/// that does not answer is an I/O failure, which decisions on it meet and count; a
/// request given up is the client's).
struct Loading<'a> {
    scripts: &'a Scripts,
    ended: bool,
}

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if !self.ended {
            // Counted first: a call that read the count before it read whether Functions
            // are on sees one or the other.
            self.scripts.failed_loads.fetch_add(1, Ordering::Release);
            switch_to_scripts(self.scripts);
            #[cfg(feature = "tracing")]
            tracing::debug!(
                target: "tollgate",
                "a Redis Functions library load did not end (a server did not answer, or \
                 its request gave up first); decisions run as EVALSHA scripts for a minute"
            );
        }
    }
}

/// Runs `script` with the invocation's keys and arguments on `backend`: by its SHA1, or
/// by its text when the server lost its script cache (a restart, a failover, `SCRIPT
/// FLUSH`); `EVAL` caches it again.
async fn run_script(
    backend: &Backend,
    script: &Lua,
    invocation: &Invocation,
) -> Result<Vec<i64>, StoreError> {
    match query(backend, &invocation.command("EVALSHA", &script.hash)).await {
        Err(error) if error.code() == Some("NOSCRIPT") => {
            query(backend, &invocation.command("EVAL", script.source)).await
        }
        answered => answered,
    }
}

fn micros(value: i64) -> Duration {
    Duration::from_micros(u64::try_from(value).unwrap_or(0))
}

/// How a decision script lays out its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `{outcome, policy, wait, delay, then per policy: limit, remaining, reset, effective
    /// window, then the time, then the shadow policies that would have denied}`.
    Full,
    /// One plain policy of an algorithm with a path of its own (`one` in its Lua file):
    /// `{outcome, wait or delay, its raw state, the time}`. The status is computed here
    /// from the state, exactly as the algorithm's `snapshot` computes it in Lua: the
    /// arithmetic costs Redis nothing.
    Raw(Raw),
}

/// The algorithms that answer their raw state for one plain policy, with the policy's
/// three script arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Raw {
    /// Token bucket, policing leaky bucket: `{level}`.
    Bucket([u64; 3]),
    /// Shaping leaky bucket: `{level}`.
    Shape([u64; 3]),
    /// GCRA: `{how far the TAT is ahead, scaled by the amount}`.
    Gcra([u64; 3]),
    /// Fixed window: `{count, end of the window}`.
    Window([u64; 3]),
    /// Sliding window counter of one sub-window: `{the window's index, the previous count,
    /// the current count}`.
    Counter([u64; 3]),
    /// Sliding log: `{the units in the log, its oldest entry's time, its newest entry's
    /// time}`, a missing entry as -1.
    Log([u64; 3]),
    /// In flight: `{slots taken}`.
    InFlight([u64; 3]),
}

impl Shape {
    fn raw(kind: &str, p: [u64; 3]) -> Self {
        match kind {
            "tb" => Shape::Raw(Raw::Bucket(p)),
            "ls" => Shape::Raw(Raw::Shape(p)),
            "gc" => Shape::Raw(Raw::Gcra(p)),
            "fw" => Shape::Raw(Raw::Window(p)),
            "sl" => Shape::Raw(Raw::Log(p)),
            // One sub-window only (sent as 0): several take the tables' path.
            "sw" if p[2] == 0 => Shape::Raw(Raw::Counter(p)),
            "cc" => Shape::Raw(Raw::InFlight(p)),
            _ => Shape::Full,
        }
    }
}

impl Raw {
    /// How many numbers of state the answer carries.
    fn state_len(self) -> usize {
        match self {
            Raw::Counter(_) | Raw::Log(_) => 3,
            Raw::Window(_) => 2,
            _ => 1,
        }
    }

    /// The status of the policy whose state is `state` at `now` (microseconds): the twin
    /// of `snapshot` in the algorithm's Lua file.
    fn status(self, raw: &[i64; 3], now: u64) -> PolicyStatus {
        let state = raw.map(|value| u64::try_from(value).unwrap_or(0));
        let ceil = |a: u128, b: u128| a.div_ceil(b.max(1));
        let (limit, remaining, reset, effective) = match self {
            // lua/token_bucket.lua, lua/gcra.lua: `level` is what is missing from full (or
            // how far ahead the TAT is), times the period.
            Raw::Bucket([capacity, amount, period]) | Raw::Gcra([capacity, amount, period]) => {
                let (level, period) = (u128::from(state[0]), u128::from(period.max(1)));
                let full = u128::from(capacity) * period;
                let spare = full.saturating_sub(level);
                // Past full (what a settle left owing), until that is paid and one more
                // unit is back.
                let effective = match level.checked_sub(full) {
                    Some(owed) if owed > 0 => owed + period,
                    _ => period - spare % period,
                };
                (
                    u128::from(capacity),
                    spare / period,
                    ceil(level, u128::from(amount)),
                    ceil(effective, u128::from(amount)),
                )
            }
            // lua/leaky_shape.lua: `level` is what is queued ahead, times the period.
            Raw::Shape([max_delay, amount, period]) => {
                let (level, period) = (u128::from(state[0]), u128::from(period.max(1)));
                let threshold = u128::from(max_delay) * u128::from(amount);
                let remaining = if level <= threshold {
                    (threshold - level) / period + 1
                } else {
                    0
                };
                (
                    threshold / period + 1,
                    remaining,
                    ceil(level, u128::from(amount)),
                    ceil(
                        (level + remaining * period).saturating_sub(threshold),
                        u128::from(amount),
                    ),
                )
            }
            // lua/fixed_window.lua.
            Raw::Window([limit, ..]) => {
                let reset = u128::from(state[1].saturating_sub(now));
                let remaining = u128::from(limit.saturating_sub(state[0]));
                (u128::from(limit), remaining, reset, reset)
            }
            Raw::Counter([limit, window, _]) => counter_status(limit, window, &state, now),
            // lua/sliding_log.lua (a missing entry arrives as -1).
            Raw::Log([limit, window, _]) => {
                let entry = |value: i64| u64::try_from(value).ok();
                let (limit, window, now) = (u128::from(limit), u128::from(window), u128::from(now));
                let reset = entry(raw[2]).map_or(0, |newest| {
                    (u128::from(newest) + window).saturating_sub(now)
                });
                // Until the oldest counted entry leaves (a whole window when empty).
                let effective = entry(raw[1]).map_or(window, |oldest| {
                    (u128::from(oldest) + window).saturating_sub(now).max(1)
                });
                (
                    limit,
                    limit.saturating_sub(u128::from(state[0])),
                    reset,
                    effective,
                )
            }
            // lua/in_flight.lua.
            Raw::InFlight([limit, ..]) => (
                u128::from(limit),
                u128::from(limit.saturating_sub(state[0])),
                0,
                0,
            ),
        };
        let whole = |value: u128| u64::try_from(value).unwrap_or(u64::MAX);
        PolicyStatus {
            limit: whole(limit),
            remaining: whole(remaining),
            reset: Duration::from_micros(whole(reset)),
            effective_window: Duration::from_micros(whole(effective)),
        }
    }
}

fn parse_reply(
    reply: &[i64],
    shape: Shape,
    count: usize,
    cost: u64,
    lease: u64,
) -> Result<Decision, StoreError> {
    if let Shape::Raw(raw) = shape {
        return parse_raw(reply, raw, cost, lease);
    }
    // The statuses, the time, then the indices of shadow policies that would have denied.
    if reply.len() < 5 + 4 * count || reply.len() > 5 + 5 * count {
        return Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "the decision script answered {} numbers, expected {} to {}",
                reply.len(),
                5 + 4 * count,
                5 + 5 * count
            ),
        ));
    }
    // Every number the script answers is a count or a duration: a negative one, or a
    // denying policy it does not have, is a script answering out of its shape (a bug of
    // ours, or another script under the name), said as such rather than read as a
    // denial of some policy.
    no_negative(reply, |_| false)?;
    // The script's time, last: the receipt of the debit, on the nanosecond time line.
    // (Every number is non-negative, checked above.)
    let at = reply[4 + 4 * count].unsigned_abs().saturating_mul(1_000);
    let policy = || match usize::try_from(reply[1]) {
        Ok(index @ 1..) if index <= count => Ok(index - 1),
        _ => Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "the decision script named policy {} of {count} as the one that denied",
                reply[1]
            ),
        )),
    };
    let statuses: SmallVec<[PolicyStatus; 2]> = reply[4..4 + 4 * count]
        .chunks_exact(4)
        .map(|status| PolicyStatus {
            limit: status[0].unsigned_abs(),
            remaining: status[1].unsigned_abs(),
            reset: micros(status[2]),
            effective_window: micros(status[3]),
        })
        .collect();
    let outcome = match reply[0] {
        0 => Outcome::Allowed {
            delay: micros(reply[3]),
        },
        1 | 3 => Outcome::Denied {
            policy: policy()?,
            retry_after: micros(reply[2]),
        },
        2 => {
            let policy = policy()?;
            Outcome::CostExceedsLimit {
                policy,
                cost,
                limit: statuses[policy].limit,
            }
        }
        other => {
            return Err(StoreError::new(
                StoreErrorKind::Protocol,
                format!("the decision script answered outcome {other}"),
            ));
        }
    };
    // Policies of the set, each once, in order, as the script writes them: anything else
    // is out of shape (read as shadow denials, its numbers marked policies undebited).
    let shadow_denied = &reply[5 + 4 * count..];
    let of_the_set = shadow_denied
        .iter()
        .all(|&index| usize::try_from(index).is_ok_and(|index| index < count));
    let in_order = shadow_denied.windows(2).all(|pair| pair[0] < pair[1]);
    if !(of_the_set && in_order) {
        return Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "the decision script named shadow policies {shadow_denied:?} of {count} as \
                 those that would have denied"
            ),
        ));
    }
    let shadow_denied = shadow_denied
        .iter()
        .map(|&index| index.unsigned_abs() as usize);
    let decision = Decision::with_statuses(outcome, statuses)
        .with_shadow_denied(shadow_denied)
        .with_receipt(Receipt::new(at, lease));
    // Outcome 3: a penalty's block denied it, which goes on for the fourth number.
    Ok(if reply[0] == 3 {
        decision.with_block(micros(reply[3]))
    } else {
        decision
    })
}

/// lua/sliding_window.lua's `snapshot` of one sub-window of `span` µs (`k = 1`), from the
/// state its `one` answers: limit, remaining, reset and effective window, in µs.
fn counter_status(limit: u64, span: u64, state: &[u64], now: u64) -> (u128, u128, u128, u128) {
    let wide = |value: u64| i128::from(value);
    let (limit, span, now) = (wide(limit), wide(span.max(1)), wide(now));
    let (at, previous, current) = (wide(state[0]), wide(state[1]), wide(state[2]));
    // Into the stored window (0 when time stepped back before it), and how far back.
    let elapsed = if now / span == at { now % span } else { 0 };
    let behind = (at * span - now).max(0);
    // The previous window counts by the share still inside the sliding window (rounded
    // up), never forgiving more than the limit of it.
    let share = (previous * (span - elapsed) + span - 1) / span;
    let estimate = share.max(previous - limit) + current;
    let reset = if current > 0 {
        2 * span - elapsed + behind
    } else if previous > 0 {
        span - elapsed + behind
    } else {
        0
    };
    let remaining = (limit - estimate).max(0);
    // `wait_for(p, s, 1, remaining)`: until one more unit fits after `remaining` more
    // were spent now.
    let effective = {
        let (room, extra, counts) = (limit - 1, remaining, [previous, current]);
        let mut found = None;
        for step in 0..2 {
            let (oldest, newer) = if step == 0 {
                (counts[0], counts[1] + extra)
            } else {
                (counts[1] + extra, 0)
            };
            if newer <= room && oldest - limit <= room - newer {
                let first = if oldest > 0 {
                    span - ((room - newer) * span / oldest).min(span)
                } else {
                    0
                };
                let at = if step == 0 { first.max(elapsed) } else { first };
                if at < span {
                    found = Some((step * span + at - elapsed + behind).max(1));
                    break;
                }
            }
        }
        found.unwrap_or_else(|| (2 * span - elapsed + behind).max(1))
    };
    let whole = |value: i128| u128::try_from(value).unwrap_or(0);
    (
        whole(limit),
        whole(remaining),
        whole(reset),
        whole(effective),
    )
}

/// The answer of one plain policy's own path: `{outcome, wait or delay, state..., time}`.
/// A protocol error when `reply` holds a negative number, but -1 where `missing` says an
/// entry may be missing: a decision script answers counts, durations and times only.
fn no_negative(reply: &[i64], missing: impl Fn(usize) -> bool) -> Result<(), StoreError> {
    match reply
        .iter()
        .enumerate()
        .find(|&(index, &number)| number < -1 || (number == -1 && !missing(index)))
    {
        Some((_, negative)) => Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!("the decision script answered a negative number ({negative})"),
        )),
        None => Ok(()),
    }
}

fn parse_raw(reply: &[i64], raw: Raw, cost: u64, lease: u64) -> Result<Decision, StoreError> {
    let expected = 3 + raw.state_len();
    if reply.len() != expected {
        return Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!(
                "the decision script answered {} numbers, expected {expected}",
                reply.len()
            ),
        ));
    }
    // Every number is a count, a duration or a time, but a log's missing entry (-1): a
    // negative one otherwise is a script answering out of its shape, said as such rather
    // than read as 0 (a denial, a receipt at time 0), as `parse_reply` does.
    no_negative(reply, |index| {
        matches!(raw, Raw::Log(_)) && (index == 3 || index == 4)
    })?;
    let number = |value: i64| u64::try_from(value).unwrap_or(0);
    let now = number(reply[expected - 1]);
    let mut state = [0i64; 3];
    state[..raw.state_len()].copy_from_slice(&reply[2..expected - 1]);
    let status = raw.status(&state, now);
    let outcome = match reply[0] {
        0 => Outcome::Allowed {
            delay: micros(reply[1]),
        },
        1 => Outcome::Denied {
            policy: 0,
            retry_after: micros(reply[1]),
        },
        2 => Outcome::CostExceedsLimit {
            policy: 0,
            cost,
            limit: status.limit,
        },
        other => {
            return Err(StoreError::new(
                StoreErrorKind::Protocol,
                format!("the decision script answered outcome {other}"),
            ));
        }
    };
    let mut statuses = SmallVec::new();
    statuses.push(status);
    // The script's time: the receipt of the debit, on the nanosecond time line.
    Ok(Decision::with_statuses(outcome, statuses)
        .with_receipt(Receipt::new(now.saturating_mul(1_000), lease)))
}

/// Nanoseconds to whole microseconds (policies are validated to at least 1 ms).
fn to_micros(nanos: u64) -> u64 {
    nanos.div_ceil(1_000)
}

/// A policy's kind as the script reads it: its algorithm's, marked `~` for a shadow
/// policy (the same algorithm, marked for the decision loop), then a penalty's numbers
/// after `!`.
fn spelled_kind(kind: &str, policy: &Policy) -> String {
    let mut spelled = kind.to_owned();
    if policy.is_shadow() {
        spelled.push('~');
    }
    if let Some((penalty, _)) = policy.penalty_box() {
        spelled.push('!');
        write_penalty(&mut spelled, &penalty, ':');
    }
    spelled
}

/// Writes a penalty's numbers, parted by `separator`: denials, then the window, the first
/// block and the longest block in microseconds. One spelling for the script's argument
/// (`!d:w:b:m`) and for the name of the penalty's state key (`n-d-w-b-m`), so the two
/// never differ.
fn write_penalty(out: &mut String, penalty: &PenaltyBox, separator: char) {
    use std::fmt::Write;
    let numbers = [
        penalty.denials,
        to_micros(penalty.within),
        to_micros(penalty.block),
        to_micros(penalty.max_block),
    ];
    for (index, number) in numbers.into_iter().enumerate() {
        if index > 0 {
            out.push(separator);
        }
        // Writing to a String cannot fail.
        let _ = write!(out, "{number}");
    }
}

/// The script's arguments for one policy: kind and three numbers. A policy keeps its rate
/// in lowest terms of whole microseconds (see `Policy::build`), so the scaled numbers stay
/// small and two spellings of one rate name one key.
fn script_args(policy: &Policy) -> Result<(&'static str, u64, u64, u64), StoreError> {
    let rate = |amount: u64, period: u64| (amount, to_micros(period));
    let args = match *policy.params() {
        Params::FixedWindow { limit, window } => ("fw", limit, to_micros(window), 0),
        Params::SlidingWindow {
            limit,
            window,
            sub_windows,
        } => {
            // One sub-window is sent as 0, so its keys are the ones it always had.
            let k = if sub_windows > 1 { sub_windows } else { 0 };
            ("sw", limit, to_micros(window), k)
        }
        // p3: the layout of the log's state (3: one member per entry, the units beyond
        // one per entry in a counter member), part of the key's name, so a log kept in
        // another layout is never read as this one.
        Params::SlidingLog { limit, window } => ("sl", limit, to_micros(window), 3),
        Params::TokenBucket {
            capacity,
            amount,
            period,
        }
        | Params::LeakyPolice {
            capacity,
            amount,
            period,
        } => {
            let (amount, period) = rate(amount, period);
            ("tb", capacity, amount, period)
        }
        Params::LeakyShape {
            amount,
            period,
            max_delay,
        } => {
            let (amount, period) = rate(amount, period);
            ("ls", to_micros(max_delay), amount, period)
        }
        Params::Gcra {
            burst,
            amount,
            period,
        } => {
            let (amount, period) = rate(amount, period);
            ("gc", burst, amount, period)
        }
        // p3 is each request's lease id, set where the request's arguments are built.
        Params::InFlight { limit, lease } => ("cc", limit, to_micros(lease), 0),
    };
    // The largest number each script forms must stay below 2^53, where Lua's doubles are
    // exact. Windows never multiply the limit by the window (the counter's weighting goes
    // through the script's exact `muldiv`); buckets and GCRA keep a level of units times
    // the period, bounded by twice the capacity (a cost that fits is at most the capacity).
    // An identity that owes (settles past empty, at most a thousand quotas) has a level of
    // up to 1,001 capacities: for the largest policies allowed here that passes 2^53, and
    // a wait told while owing may be a rounding step off; the denial itself cannot change
    // (the level is past full).
    let (kind, p1, p2, p3) = args;
    let largest = match kind {
        "fw" | "sl" | "sw" | "cc" => 0,
        "ls" => 2 * u128::from(p1) * u128::from(p2) + 2 * u128::from(p3),
        _ => 2 * u128::from(p1) * u128::from(p3) + u128::from(p2),
    };
    if largest >= EXACT {
        // What the script multiplies, in the policy's own terms, and what lowers it.
        let (product, remedy) = match kind {
            // The level is at most the longest delay's worth of leaked units.
            "ls" => (
                format!(
                    "its longest delay times its leak amount ({p1} microseconds of \
                     max_delay x {p2} units, the rate in lowest terms {p2} per {p3} \
                     microseconds)"
                ),
                "use a shorter max_delay, or a rate of fewer units a period in lowest \
                 terms"
                    .to_owned(),
            ),
            // A bucket's level is at most its capacity's worth of periods; GCRA's, its
            // burst's.
            _ => {
                let size = if kind == "gc" { "burst" } else { "capacity" };
                (
                    format!(
                        "its {size} times the period of its rate in lowest terms ({p1} x \
                         {p3} microseconds: {p2} per {p3} microseconds)"
                    ),
                    format!("use a smaller {size} or a faster rate, or a window algorithm"),
                )
            }
        };
        return Err(StoreError::new(
            StoreErrorKind::Unsupported,
            format!(
                "policy \"{}\" cannot be decided exactly in Redis: {product} passes 2^52; \
                 {remedy}",
                policy.name(),
            ),
        ));
    }
    Ok(args)
}

/// Builds every Redis key name tollgate writes: one place, so the layout is one decision.
///
/// A policy's state lives at `prefix:{identity}:name:params`, and a penalty's beside it
/// at `prefix:{identity}:name:n-denials-within-block-max_block` (times in microseconds):
/// named by the policy's name and its own numbers, not the rate's, so a changed limit
/// keeps the blocks and strikes. The identity sits
/// inside a Cluster hash tag, so all keys of one identity share a slot and one script
/// can touch them all. Identity bytes other than `A-Z a-z 0-9 . _ - : / @ + =` are
/// percent-encoded: `{` and `}` cannot end or open the tag early, and no two identities
/// encode alike. Secret identities (API keys) reach the builder already hashed by their
/// key extractor. `params` spells the policy's parameters, so a changed limit starts on
/// fresh keys and the old ones expire. Not an in-flight policy's: its count of requests
/// in progress is named by the policy's name alone (`cc-0-0-0`), so a reload that changes
/// its limit or lease keeps counting the requests already in progress.
///
/// ```
/// use std::time::Duration;
/// use tollgate::policy::Penalty;
/// use tollgate::store::RedisKeys;
/// use tollgate::{Policy, Rate};
///
/// let keys = RedisKeys::new("app");
/// let policy = Policy::token_bucket("api", 10, Rate::per_second(5))?;
/// let (state, _) = keys.policy_keys("ip:203.0.113.7", &policy);
/// assert_eq!(state, "app:{ip:203.0.113.7}:api:tb-10-1-200000");
/// let (hostile, _) = keys.policy_keys("x}{y", &policy);
/// assert_eq!(hostile, "app:{x%7D%7By}:api:tb-10-1-200000");
///
/// // A penalty's state is named by its numbers, not the rate's: a changed penalty starts
/// // afresh, a changed rate keeps it.
/// let minute = Duration::from_secs(60);
/// let penalized = policy.with_penalty(Penalty::new(3, minute, 10 * minute))?;
/// let (state, penalty) = keys.policy_keys("k", &penalized);
/// assert_eq!(state, "app:{k}:api:tb-10-1-200000");
/// assert_eq!(penalty, "app:{k}:api:n-3-60000000-600000000-600000000");
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
#[derive(Debug, Clone)]
pub struct RedisKeys {
    prefix: String,
}

impl Default for RedisKeys {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

impl RedisKeys {
    /// Keys under `prefix` (escaped like identities).
    pub fn new(prefix: &str) -> Self {
        let mut escaped = String::with_capacity(prefix.len());
        escape_into(&mut escaped, prefix);
        Self { prefix: escaped }
    }

    /// The hash tag of `identity`, braces included: `{ip:203.0.113.7}`. Bytes other than
    /// `A-Z a-z 0-9 . _ - : / @ + =` are percent-encoded, so no identity closes its tag
    /// early; the empty identity is `{%}`, since Redis reads `{}` as no tag at all.
    ///
    /// ```
    /// use tollgate::store::RedisKeys;
    ///
    /// let keys = RedisKeys::new("app");
    /// assert_eq!(keys.tag("ip:203.0.113.7"), "{ip:203.0.113.7}");
    /// assert_eq!(keys.tag("x}{y"), "{x%7D%7By}");
    /// assert_eq!(keys.tag("user 7"), "{user%207}");
    /// assert_eq!(keys.tag(""), "{%}");
    /// ```
    pub fn tag(&self, identity: &str) -> String {
        let mut tag = String::with_capacity(identity.len() + 2);
        tag.push('{');
        if identity.is_empty() {
            // `{}` is no hash tag: Redis would hash whole keys, and one identity's keys
            // would land in different slots. A lone `%` is what no escaped identity is.
            tag.push('%');
        } else {
            escape_into(&mut tag, identity);
        }
        tag.push('}');
        tag
    }

    /// The state key and the auxiliary key of `policy` for `identity`: a key's text as
    /// the store keys it ([`Key::as_str`](crate::Key::as_str)). A string over
    /// [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) bytes is kept as its digest: name it by
    /// `Key::new(string).as_str()`.
    pub fn policy_keys(&self, identity: &str, policy: &Policy) -> (String, String) {
        let base = self.policy_base(identity, policy);
        let state = Self::state_key_at(&base, policy);
        // A penalty's state is named by the policy's name and the penalty's numbers, not
        // the rate's: a changed penalty (a block shortened to pardon) starts afresh while
        // the rate state it guards carries over, and a changed rate (a limit tightened
        // during an attack) keeps the blocks and strikes.
        let mut aux = base;
        aux.push_str(":n");
        if let Some((penalty, _)) = policy.penalty_box() {
            aux.push('-');
            write_penalty(&mut aux, &penalty, '-');
        }
        (state, aux)
    }

    /// The state key of `policy` for `identity` (the auxiliary key starts with it).
    fn state_key(&self, identity: &str, policy: &Policy) -> String {
        Self::state_key_at(&self.policy_base(identity, policy), policy)
    }

    /// `prefix:{identity}:name`: what every key of `policy` for `identity` starts with.
    fn policy_base(&self, identity: &str, policy: &Policy) -> String {
        format!(
            "{}:{}:{}",
            self.prefix,
            self.tag(identity),
            policy.state_name()
        )
    }

    /// The state key of `policy` under its `base` (see [`policy_base`](Self::policy_base)).
    fn state_key_at(base: &str, policy: &Policy) -> String {
        let (kind, p1, p2, p3) = match script_args(policy) {
            Ok(args) => args,
            // Too large for the script: the keys are never written; name them anyway.
            Err(_) => ("xx", policy.limit(), 0, 0),
        };
        // An in-flight policy's slots are named by the policy's name alone: requests in
        // progress hold them whatever the limit or lease becomes (see `policy_id`).
        let (p1, p2, p3) = if kind == "cc" {
            (0, 0, 0)
        } else {
            (p1, p2, p3)
        };
        format!("{base}:{kind}-{p1}-{p2}-{p3}")
    }
}

fn escape_into(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"._-:/@+=".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rate;
    use crate::policy::{MAX_LIMIT, MAX_PERIOD};

    /// A reply out of the decision script's shape is a protocol error, never read as a
    /// denial of some policy: a denying policy the set does not have (it was clamped to
    /// the last), a negative count (read as 0).
    #[test]
    fn a_reply_out_of_shape_is_a_protocol_error() {
        // outcome, policy, wait, delay; one status (limit, remaining, reset, window); time.
        let reply = |outcome: i64, policy: i64, remaining: i64| {
            vec![outcome, policy, 1_000, 0, 10, remaining, 5_000, 5_000, 42]
        };
        let parse = |answer: Vec<i64>| parse_reply(&answer, Shape::Full, 1, 1, 0);
        assert!(!parse(reply(1, 1, 0)).unwrap().is_allowed());
        assert!(parse(reply(0, 0, 9)).unwrap().is_allowed());
        // The shadow policies that would have denied, after the time: indices of the
        // set's, in order. An extra number read as one marked a policy of the set
        // undebited (its settles and releases then changed nothing).
        let with_shadow = |indices: &[i64]| [reply(0, 0, 9), indices.to_vec()].concat();
        let two = |answer: Vec<i64>| {
            let mut answer = answer;
            answer.splice(8..8, [10, 9, 5_000, 5_000]);
            parse_reply(&answer, Shape::Full, 2, 1, 0)
        };
        assert_eq!(
            two(with_shadow(&[0, 1]))
                .unwrap()
                .shadow_denied()
                .collect::<Vec<_>>(),
            [0, 1]
        );
        for broken in [
            reply(1, 0, 0),
            reply(1, 2, 0),
            reply(2, 5, 0),
            reply(0, 0, -1),
            with_shadow(&[1]),
            with_shadow(&[7]),
        ] {
            let error = parse(broken.clone()).expect_err("out of shape");
            assert_eq!(
                error.kind(),
                StoreErrorKind::Protocol,
                "{broken:?}: {error}"
            );
        }
        for broken in [
            with_shadow(&[1, 0]),
            with_shadow(&[0, 0]),
            with_shadow(&[2]),
        ] {
            let error = two(broken.clone()).expect_err("out of shape");
            assert_eq!(error.kind(), StoreErrorKind::Protocol, "{broken:?}");
        }
    }

    /// A node's `CLUSTER NODES` line says whether it alone owns every slot.
    #[test]
    fn a_node_owning_every_slot_is_told_from_one_of_several() {
        let line = |flags: &str, slots: &str| {
            format!("07c3 127.0.0.1:30001@40001 {flags} - 0 0 1 connected {slots}\n")
        };
        let other = "9a1f 127.0.0.1:30002@40002 master - 0 0 2 connected 8192-16383\n";
        assert!(owns_every_slot(&line("myself,master", "0-16383")));
        assert!(owns_every_slot(&line(
            "myself,master",
            "0-100 101-16382 16383"
        )));
        assert!(owns_every_slot(&line(
            "myself,master",
            "0-16383 [77->-9a1f]"
        )));
        assert!(!owns_every_slot(&(line("myself,master", "0-8191") + other)));
        assert!(!owns_every_slot(&line("myself,slave", "")));
        assert!(!owns_every_slot(&line("myself,master", "")));
        assert!(!owns_every_slot(other));
        assert!(!owns_every_slot(""));
    }

    /// A `MOVED` or `ASK` that reaches the store (the Cluster client ran out of retries
    /// while slots were moving) is an outage in passing, as `TRYAGAIN` is, for the breaker
    /// and the failure mode: it was `Refused`, logged as a bug at error level. A refusal
    /// of ours stays one.
    #[test]
    fn a_redirection_left_after_retries_is_an_outage_not_a_refusal() {
        use redis::{ErrorKind, ServerErrorKind};
        for kind in [
            ServerErrorKind::Moved,
            ServerErrorKind::Ask,
            ServerErrorKind::TryAgain,
        ] {
            let error = RedisError::from((ErrorKind::Server(kind), "redirected"));
            assert_eq!(
                store_error(error).kind(),
                StoreErrorKind::Unavailable,
                "{kind:?}"
            );
        }
        let refused = RedisError::from((ErrorKind::Server(ServerErrorKind::NoPerm), "no"));
        assert_eq!(store_error(refused).kind(), StoreErrorKind::Refused);
        // On a connection to one server, a redirection says the server is a Cluster's
        // node reached as a single server: a refusal of this identity, said loudly. The
        // message names a one-shard Cluster's failover too (the connection is made anew):
        // it only told users to connect as a Cluster.
        for kind in [
            ServerErrorKind::Moved,
            ServerErrorKind::Ask,
            ServerErrorKind::ClusterDown,
        ] {
            let error = || RedisError::from((ErrorKind::Server(kind), "redirected"));
            assert_eq!(
                query_error(error(), true).kind(),
                StoreErrorKind::Unavailable
            );
            let alone = query_error(error(), false);
            assert_eq!(alone.kind(), StoreErrorKind::Refused, "{kind:?}");
            assert!(!alone.every_request, "{kind:?}");
            assert_eq!(
                alone.to_string().contains("failover"),
                kind == ServerErrorKind::Moved,
                "{alone}"
            );
        }
    }

    /// Redis before 7 wraps the error a script's write met in a script error of its
    /// own (`ERR Error running script ...: -READONLY ...`), where Redis 7 answers the
    /// code itself. A primary demoted behind one URL (a managed endpoint on 6.2 failing
    /// over) is a failover there too: unavailable, and the connection is left. Read as a
    /// refusal, every admission was refused while the breaker stayed closed. A script's
    /// own error, or a refusal it met (`OOM`), stays a refusal.
    #[test]
    fn a_failover_a_script_met_on_redis_6_is_an_outage() {
        let reply = |text: &str| {
            redis::parse_redis_value(format!("-ERR Error running script (call to f_3c1e): @user_script:21: @user_script: 21: {text}\r\n").as_bytes())
                .unwrap()
                .extract_error()
                .unwrap_err()
        };
        for (text, code) in [
            (
                "-READONLY You can't write against a read only replica.",
                "READONLY",
            ),
            (
                "-NOREPLICAS Not enough good replicas to write.",
                "NOREPLICAS",
            ),
            (
                "-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
                "MASTERDOWN",
            ),
        ] {
            let error = reply(text);
            assert_eq!(error.code(), Some("ERR"), "wrapped: {error}");
            assert_eq!(
                store_error(reply(text)).kind(),
                StoreErrorKind::Unavailable,
                "{text}"
            );
            assert_eq!(store_error(reply(text)).code(), Some(code), "{text}");
            assert_eq!(demoted(&error), code != "NOREPLICAS", "{text}");
        }
        for text in [
            "-OOM command not allowed when used memory > 'maxmemory'.",
            "Script attempted to access nonexistent global variable 'x'",
        ] {
            let error = store_error(reply(text));
            assert_eq!(error.kind(), StoreErrorKind::Refused, "{text}");
            assert!(!demoted(&reply(text)), "{text}");
        }
    }

    /// A refused password on one connection (standalone, Sentinel, a pool) is every
    /// request's refusal: it holds the breaker open while a new connection is made. As a
    /// plain refusal it closed the breaker and said "answers again" mid-outage. On a
    /// Cluster one node refusing is not every key's refusal.
    #[test]
    fn a_refused_password_is_every_requests_refusal_but_on_a_cluster() {
        use redis::ErrorKind;
        let refused = || RedisError::from((ErrorKind::AuthenticationFailed, "refused"));
        let error = query_error(refused(), false);
        assert_eq!(error.kind(), StoreErrorKind::Refused);
        assert!(error.every_request);
        assert!(!query_error(refused(), true).every_request);
        let other = RedisError::from((ErrorKind::Server(redis::ServerErrorKind::NoPerm), "no"));
        assert!(!query_error(other, false).every_request);
    }

    /// A TLS handshake refused on a reconnect (the server's certificate expired, or was
    /// re-issued by a CA the store does not trust) is a setting to fix, met by every
    /// connection: a refusal, logged at error level. Sorted as I/O (redis-rs passes
    /// rustls's error up inside one), it was an outage at debug level, and each replica
    /// enforced its own share of the limit for as long as nobody looked.
    #[cfg(feature = "tls")]
    #[test]
    fn a_tls_handshake_refused_is_a_refusal_not_an_outage() {
        let refused = || {
            RedisError::from(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(rustls::CertificateError::Expired),
            ))
        };
        assert_eq!(store_error(refused()).kind(), StoreErrorKind::Refused);
        assert!(query_error(refused(), false).every_request);
        assert!(!query_error(refused(), true).every_request);
        // A connection reset mid-handshake is still I/O.
        let reset = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(store_error(reset).kind(), StoreErrorKind::Unavailable);
    }

    /// The error a server's reply `line` (without its `-` and line end) is read as.
    fn server_error(line: &str) -> RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err()
    }

    /// A server out of memory (`OOM` under `maxmemory` with no eviction) refuses every
    /// decision, since every one writes: an outage the breaker holds requests off for,
    /// not one request's refusal, which sent every request to be refused. On a Cluster it
    /// is one node's, not every key's.
    #[test]
    fn a_server_out_of_memory_is_every_requests_refusal_but_on_a_cluster() {
        let oom = || server_error("OOM command not allowed when used memory > 'maxmemory'.");
        let error = query_error(oom(), false);
        assert_eq!(error.kind(), StoreErrorKind::Refused);
        assert!(error.every_request);
        assert!(!query_error(oom(), true).every_request);
        // Met inside a script, as a decision meets it.
        let wrapped = server_error(
            "ERR Error running script (call to f_1): @user_script:3: -OOM command not allowed when used memory > 'maxmemory'.",
        );
        assert!(query_error(wrapped, false).every_request);
    }

    /// A server that cannot persist (`MISCONF`: `stop-writes-on-bgsave-error` after a
    /// failed snapshot) refuses every write until a snapshot succeeds, so every decision:
    /// as `OOM`, every request's refusal on one server, one node's on a Cluster. As one
    /// request's refusal, every request met it while the breaker stayed closed.
    #[test]
    fn a_server_that_cannot_persist_is_every_requests_refusal_but_on_a_cluster() {
        let misconf = || {
            server_error(
                "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. Commands that may modify the data set are disabled.",
            )
        };
        let error = query_error(misconf(), false);
        assert_eq!(error.kind(), StoreErrorKind::Refused);
        assert!(error.every_request);
        assert!(!query_error(misconf(), true).every_request);
    }

    /// A lone policy's answer (the `one` function) is held to the shape the several
    /// policies' answer is: a negative wait or time is a script answering out of its
    /// shape, said as such, where it was read as 0 (a denial with `Retry-After: 1`, a
    /// receipt at time 0). Only a log's missing entry is -1.
    #[test]
    fn a_lone_policys_answer_with_a_negative_number_is_a_protocol_error() {
        let window = Raw::Window([10, 60_000_000, 0]);
        let now = 5_000_000_000;
        assert!(parse_raw(&[0, 0, 3, now + 1_000, now], window, 1, 0).is_ok());
        for reply in [
            [1, -5, 3, now + 1_000, now],
            [0, 0, -3, now + 1_000, now],
            [0, 0, 3, now + 1_000, -1],
        ] {
            let error = parse_raw(&reply, window, 1, 0).unwrap_err();
            assert_eq!(error.kind(), StoreErrorKind::Protocol, "{reply:?}");
        }
        let log = Raw::Log([10, 60_000_000, 0]);
        assert!(
            parse_raw(&[0, 0, 0, -1, -1, now], log, 1, 0).is_ok(),
            "an empty log"
        );
        let error = parse_raw(&[0, 0, 0, -2, -1, now], log, 1, 0).unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Protocol);
    }

    #[test]
    fn an_empty_identity_still_has_a_hash_tag() {
        let keys = RedisKeys::new("app");
        assert_eq!(keys.tag(""), "{%}");
        // No escaped identity is a lone `%`: a literal one is `%25`.
        assert_eq!(keys.tag("%"), "{%25}");
    }

    #[test]
    fn rates_are_reduced_and_oversized_policies_refused() {
        let policy = Policy::token_bucket("t", 1_000_000, Rate::per_day(1_000_000)).unwrap();
        assert_eq!(script_args(&policy).unwrap(), ("tb", 1_000_000, 1, 86_400));
        // Windows never multiply the limit by the window: everyday quotas fit.
        let day = Duration::from_secs(86_400);
        for window in [
            Policy::fixed_window("daily", 200_000, day).unwrap(),
            Policy::fixed_window("monthly", 5_000, 30 * day).unwrap(),
            Policy::sliding_window("daily", 150_000, day).unwrap(),
            Policy::sliding_log("daily", 150_000, day).unwrap(),
            Policy::fixed_window("max", MAX_LIMIT, MAX_PERIOD).unwrap(),
            Policy::sliding_window("max", MAX_LIMIT, MAX_PERIOD).unwrap(),
            Policy::sliding_window_split("max", MAX_LIMIT, MAX_PERIOD, 64).unwrap(),
        ] {
            assert!(script_args(&window).is_ok(), "{window:?}");
        }
        // A bucket whose level (capacity times its rate's period in lowest terms) passes
        // 2^52 is refused.
        let huge = Policy::token_bucket("huge", 1_000_000_000, Rate::per_day(1)).unwrap();
        let error = script_args(&huge).unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Unsupported);
        assert!(
            error
                .to_string()
                .contains("policy \"huge\" cannot be decided exactly"),
            "{error}"
        );
        assert!(error.to_string().contains("a smaller capacity"), "{error}");
        // A shaping policy has no capacity, and a faster leak raises what is refused: its
        // message names what it multiplies (the longest delay by the leak amount) and
        // the knobs that lower it.
        let shaping = Policy::leaky_bucket_shaping(
            "smooth",
            Rate::per_minute(1_300_001),
            Duration::from_secs(3600),
        )
        .unwrap();
        let error = script_args(&shaping).unwrap_err().to_string();
        assert!(
            error.contains("policy \"smooth\" cannot be decided exactly"),
            "{error}"
        );
        assert!(
            error.contains("3600000000 microseconds of max_delay x 1300001 units"),
            "{error}"
        );
        assert!(error.contains("a shorter max_delay"), "{error}");
        assert!(
            !error.contains("capacity") && !error.contains("faster"),
            "{error}"
        );
        // GCRA's is its burst.
        let gcra = Policy::gcra("g", Rate::per_day(1), 1_000_000_000).unwrap();
        let error = script_args(&gcra).unwrap_err().to_string();
        assert!(error.contains("its burst times"), "{error}");
        assert!(error.contains("a smaller burst"), "{error}");
    }

    #[test]
    fn a_penalty_is_spelled_alike_in_its_key_and_in_the_scripts_argument() {
        // Four different numbers, so that no two can trade places unseen: the key names
        // state kept in Redis (a changed spelling would strand it), and the script reads
        // the argument as `!denials:within:block:max_block` (lua/store/prelude.lua).
        let policy = Policy::token_bucket("api", 10, Rate::per_second(5))
            .unwrap()
            .with_penalty(
                crate::policy::Penalty::new(3, Duration::from_secs(60), Duration::from_secs(10))
                    .doubling_up_to(Duration::from_secs(40)),
            )
            .unwrap();
        let (state, aux) = RedisKeys::new("app").policy_keys("k", &policy);
        assert_eq!(state, "app:{k}:api:tb-10-1-200000");
        assert_eq!(aux, "app:{k}:api:n-3-60000000-10000000-40000000");
        assert_eq!(
            spelled_kind("tb", &policy),
            "tb!3:60000000:10000000:40000000"
        );
        assert_eq!(spelled_kind("tb", &policy.shadow()), "tb~");
    }

    #[test]
    fn hostile_identities_stay_inside_their_tag() {
        let keys = RedisKeys::default();
        let plain = Policy::gcra("g", Rate::per_second(1), 1).unwrap();
        let penalized = plain
            .clone()
            .with_penalty(crate::policy::Penalty::new(
                3,
                Duration::from_secs(10),
                Duration::from_secs(60),
            ))
            .unwrap();
        let identities = [
            "a}b",
            "a{b",
            "a:b",
            "a\0b",
            "a%7Db",
            "{}",
            "ü",
            &"x".repeat(300),
        ];
        let mut seen = std::collections::HashSet::new();
        for identity in identities {
            let tag = keys.tag(identity);
            for policy in [&plain, &penalized] {
                // Exactly one tag, at the identity, in both keys.
                let (state, aux) = keys.policy_keys(identity, policy);
                for key in [&state, &aux] {
                    assert_eq!(key.matches('{').count(), 1, "{key}");
                    assert_eq!(key.matches('}').count(), 1, "{key}");
                    assert!(key.contains(&tag), "{key}");
                }
            }
            assert!(seen.insert(tag), "{identity:?} collides");
        }
    }
}
