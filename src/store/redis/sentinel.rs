//! The primary that Redis Sentinel names, behind one multiplexed connection.
//!
//! - **Look-ups** run in a task of their own, one at a time: a request that times out
//!   while it waits does not cancel one, and whoever asks next takes its answer. A failed
//!   look-up is remembered for [`RESOLVE_BACKOFF`], so a dead topology is not asked again
//!   for every request.
//! - **A watch** asks the server every [`WATCH_EVERY`] what it is (`ROLE`, with a
//!   deadline), and every fourth time the sentinels whom they name: a primary that stops
//!   answering without closing its connections, that was demoted, or that the sentinels no
//!   longer name (a failover it did not see: a partition) is left, and looked up again.
//!   One they no longer name is left only once the one named answers `ROLE` as a primary.
//!   The sentinels are asked together, and the server most of them name is followed (of
//!   equals, the first-listed sentinel's), by the look-up and the watch alike: a stale
//!   sentinel (cut off with the old primary, still naming it) is outvoted wherever it is
//!   listed, and a named server that is no primary is gone past; a server named twice is
//!   asked once, and a round has a deadline ([`RESOLVE_TIMEOUT`]).
//! - **A refusal** (a sentinel's: a wrong password, a server that is no sentinel; or a
//!   named server's: its password, its TLS certificate) is gone past to the next
//!   sentinel, and said at error level and counted all the same; when no sentinel leads
//!   to a primary, the look-up fails with that refusal, not an outage.
//! - **A command** that meets a broken connection or `READONLY` drops the connection at
//!   once; an error of the moment the primary answered (`NOREPLICAS`, `BUSY`) or a slow
//!   answer keeps it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;

use super::store_error;
use crate::store::{StoreError, StoreErrorKind};

/// How long one attempt to open a connection (to a sentinel or the primary) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a look-up may take in all (asking the sentinels, then the primary).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// After a failed look-up, decisions fail at once as unavailable for this long instead of
/// asking the sentinels again for every request.
const RESOLVE_BACKOFF: Duration = Duration::from_millis(100);

/// How often the watch checks the primary and asks the sentinels.
const WATCH_EVERY: Duration = Duration::from_millis(500);

/// How long the primary may take to answer the watch's `ROLE`.
const WATCH_DEADLINE: Duration = Duration::from_millis(1000);

/// How to reach the primary once the sentinels name it.
#[derive(Clone)]
pub(super) struct PrimaryAccess {
    pub(super) tls: bool,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) certificates: Certificates,
}

/// What a client presents or trusts over TLS beyond the system's roots (feature `tls`).
#[derive(Clone, Default)]
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
pub(super) struct Certificates {
    /// A root certificate (PEM) trusted instead of the system's: a private CA.
    pub(super) root: Option<Vec<u8>>,
    /// A client certificate and its private key (PEM), for servers that ask for one
    /// (Redis's `tls-auth-clients`). Never printed.
    pub(super) client: Option<(Vec<u8>, Vec<u8>)>,
}

#[cfg(feature = "tls")]
impl Certificates {
    fn is_empty(&self) -> bool {
        self.root.is_none() && self.client.is_none()
    }

    /// Reads them as redis-rs will, saying what is wrong with its own words: redis-rs's
    /// error of a key it cannot read holds the key's bytes (the PEM parser's label of a
    /// key whose lines were joined), and reads as an outage.
    fn check(&self) -> Result<(), StoreError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain = |pem: &[u8]| {
            CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .is_ok_and(|chain| !chain.is_empty())
        };
        let refused = |what: &str| {
            StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "{what} (in PEM; check that its lines were not joined: a newline \
                     turned into a space, or into a literal \\n)"
                ),
            )
        };
        if let Some(root) = &self.root
            && !chain(root)
        {
            return Err(refused("the root certificate cannot be read"));
        }
        if let Some((certificate, key)) = &self.client {
            if !chain(certificate) {
                return Err(refused("the client certificate cannot be read"));
            }
            if key
                .windows(b"ENCRYPTED".len())
                .any(|window| window == b"ENCRYPTED")
            {
                return Err(StoreError::new(
                    StoreErrorKind::Other,
                    "the client key is encrypted: give it decrypted (`openssl pkey -in KEY \
                     -out PLAIN`), kept as secret as the password",
                ));
            }
            if PrivateKeyDer::from_pem_slice(key).is_err() {
                return Err(refused(
                    "the client key cannot be read as a private key (PKCS #8, PKCS #1 or \
                     SEC 1)",
                ));
            }
        }
        Ok(())
    }

    /// As redis-rs takes them, once [read](Self::check) (so redis-rs's own errors then
    /// say nothing of a key, only of the URL); `None` when there are none (the system's
    /// roots, no client certificate).
    pub(super) fn for_redis(&self) -> Result<Option<redis::TlsCertificates>, StoreError> {
        if self.is_empty() {
            return Ok(None);
        }
        self.check()?;
        Ok(Some(redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(certificate, key)| redis::ClientTlsConfig {
                    client_cert: certificate.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root.clone(),
        }))
    }
}

impl PrimaryAccess {
    fn client(&self, host: &str, port: u16) -> Result<redis::Client, StoreError> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let mut url = url::Url::parse(&format!("{scheme}://{host}:{port}"))
            .or_else(|_| url::Url::parse(&format!("{scheme}://[{host}]:{port}")))
            .map_err(|error| {
                StoreError::new(
                    StoreErrorKind::Protocol,
                    format!("the sentinels named an address that does not parse ({host}:{port}): {error}"),
                )
            })?;
        // Escaped whole: the client decodes the URL's user info, and the URL crate
        // leaves a `%` as it is (`Zx%41q` would be sent as `ZxAq`).
        if let Some(password) = &self.password {
            let escape = |text: &str| {
                percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC)
                    .to_string()
            };
            let _ = url.set_username(&escape(self.username.as_deref().unwrap_or("")));
            let _ = url.set_password(Some(&escape(password)));
        }
        open_client(url.as_str(), &self.certificates)
    }
}

/// A client for `url`, with `certificates` when given (a root to trust, a client
/// certificate to present).
pub(super) fn open_client(
    url: &str,
    certificates: &Certificates,
) -> Result<redis::Client, StoreError> {
    #[cfg(feature = "tls")]
    if let Some(certificates) = certificates.for_redis()? {
        return redis::Client::build_with_tls(url, certificates).map_err(store_error);
    }
    let _ = certificates;
    redis::Client::open(url).map_err(store_error)
}

fn connection_config() -> AsyncConnectionConfig {
    // An answer's deadline of our own (redis-rs's default is 500 ms): the watch's.
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(WATCH_DEADLINE))
}

/// The primary the sentinels name, followed across failovers.
pub(super) struct SentinelBackend {
    sentinels: Vec<redis::Client>,
    master: String,
    access: PrimaryAccess,
    state: Mutex<State>,
    /// Bumped after every look-up, so requests waiting for one wake up.
    looked_up: tokio::sync::watch::Sender<u64>,
    generation: AtomicU64,
    /// A watch runs (on some runtime). It ends with its runtime (a start-up runtime the
    /// store connected on, dropped once it is built): a request on another starts one
    /// there, or the store would follow no failover of a primary that still answers.
    watching: AtomicBool,
}

struct State {
    /// The connection, its generation and the primary's address.
    current: Option<(u64, (String, u16), MultiplexedConnection)>,
    resolving: bool,
    /// The last look-up's failure, and until when it is the answer.
    failed: Option<(Instant, StoreError)>,
}

impl SentinelBackend {
    pub(super) fn new(
        sentinels: Vec<redis::Client>,
        master: String,
        access: PrimaryAccess,
    ) -> Arc<Self> {
        let backend = Arc::new(Self {
            sentinels,
            master,
            access,
            state: Mutex::new(State {
                current: None,
                resolving: false,
                failed: None,
            }),
            looked_up: tokio::sync::watch::Sender::new(0),
            generation: AtomicU64::new(0),
            watching: AtomicBool::new(false),
        });
        backend.watch_here();
        backend
    }

    /// Starts the watch on the current runtime, unless one runs. The watch holds the
    /// backend weakly: it ends with the last store (or with its runtime, and the next
    /// request starts another).
    fn watch_here(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(watch(Watching(Arc::downgrade(self))));
            }
            Err(_) => self.watching.store(false, Ordering::Release),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The connection to the current primary; a look-up (started here, or already under
    /// way) when there is none.
    pub(super) async fn connection(
        self: &Arc<Self>,
    ) -> Result<(u64, MultiplexedConnection), StoreError> {
        if !self.watching.load(Ordering::Relaxed) {
            self.watch_here();
        }
        // The common case, without subscribing to look-ups.
        if let Some((generation, _, connection)) = &self.lock().current {
            return Ok((*generation, connection.clone()));
        }
        loop {
            // Subscribed before the state is read: a look-up that ends in between still
            // wakes this request.
            let mut looked_up = self.looked_up.subscribe();
            {
                let mut state = self.lock();
                if let Some((generation, _, connection)) = &state.current {
                    return Ok((*generation, connection.clone()));
                }
                if let Some((until, error)) = &state.failed
                    && Instant::now() < *until
                {
                    return Err(error.for_another());
                }
                if !state.resolving {
                    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                        return Err(StoreError::new(
                            StoreErrorKind::Other,
                            "no Tokio runtime to look the primary up on",
                        ));
                    };
                    state.resolving = true;
                    // Spawned with the lock let go: on a runtime shutting down, the task is
                    // dropped as it is spawned, here, and its guard takes the lock.
                    drop(state);
                    // The look-up ends (and wakes the waiting) however the task ends, even
                    // if it never runs.
                    runtime.spawn(resolve(Resolving(Some(Arc::clone(self)))));
                }
            }
            if looked_up.changed().await.is_err() {
                return Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "the Sentinel store was dropped",
                ));
            }
        }
    }

    /// Asks every sentinel together for the primary: the servers named, those named by
    /// the most sentinels first (of equals, the one the first-listed sentinel named). A
    /// sentinel cut off with an old primary keeps naming it while the others fail over:
    /// the first answer, or the first sentinel's, could be the stale one. What they met
    /// goes to `errors` (and that one did not know the name).
    ///
    /// Once most of the listed sentinels name one server, the others are not waited for:
    /// a sentinel down with its host (beside the primary it watched) costs no look-up its
    /// timeout.
    async fn named_by_most(&self, errors: &mut Errors) -> Vec<Named> {
        use futures_util::StreamExt;
        let mut answers: futures_util::stream::FuturesUnordered<_> = self
            .sentinels
            .iter()
            .enumerate()
            .map(|(index, sentinel)| async move { (index, ask(sentinel, &self.master).await) })
            .collect();
        let most = self.sentinels.len() / 2 + 1;
        let mut named: Vec<Named> = Vec::new();
        while let Some((index, answer)) = answers.next().await {
            match answer {
                Ok(Some(address)) => {
                    let votes = match named.iter_mut().find(|n| n.address == address) {
                        Some(seen) => {
                            seen.votes += 1;
                            seen.first = seen.first.min(index);
                            seen.votes
                        }
                        None => {
                            named.push(Named {
                                address,
                                votes: 1,
                                first: index,
                            });
                            1
                        }
                    };
                    if votes >= most {
                        break;
                    }
                }
                Ok(None) => errors.unknown = true,
                Err(error) => errors.push(error),
            }
        }
        errors.heard |= !named.is_empty() || errors.unknown;
        errors.named |= !named.is_empty();
        // Of equals, the one the first-listed sentinel named.
        named.sort_by_key(|n| (std::cmp::Reverse(n.votes), n.first));
        named
    }

    /// Asks the sentinels whether the primary moved from `current`: it did when more
    /// sentinels name another server than name `current`, and that server answers `ROLE`
    /// as a primary (of several, those named by the most first). A sentinel that names a
    /// server that is no primary (stale, cut off from the servers), that does not know
    /// the name or that fails is outvoted, or gone past, so a failover most sentinels saw
    /// is heard of, and one stale sentinel (listed first or not) neither holds the store
    /// on a deposed primary nor pulls it back to one. A sentinel that refused (not I/O)
    /// is said and counted even when others answer.
    ///
    /// `Some` once the sentinels led somewhere (`Some(None)`: to `current`, named by as
    /// many as any other server that is a primary; `Some(Some(..))`: the server they
    /// moved to, with a connection to it, which the watch takes as it is, so no second
    /// vote, by sentinels answering otherwise a moment later, takes the store back);
    /// `None` when none did (each failed, or named a server that is no primary or refused
    /// the store). What it met goes to `errors`, to be said however the round ends.
    async fn moved_from(
        &self,
        current: &(String, u16),
        errors: &mut Errors,
    ) -> Option<Option<Moved>> {
        let named = self.named_by_most(errors).await;
        let staying = named
            .iter()
            .find(|n| n.address == *current)
            .map_or(0, |n| n.votes);
        for candidate in named.into_iter().filter(|n| n.votes > staying) {
            match self.confirmed_primary(&candidate.address).await {
                Ok(Some(connection)) => return Some(Some((candidate.address, connection))),
                Ok(None) => {}
                Err(error) => errors.push(about(
                    error,
                    format_args!("{}:{}", candidate.address.0, candidate.address.1),
                )),
            }
        }
        (staying > 0).then_some(None)
    }

    /// A connection to the server at `address` when it answers, within the watch's
    /// deadline, that it is a primary; `None` when it is not one; its error when it
    /// refuses the store or cannot be asked.
    async fn confirmed_primary(
        &self,
        (host, port): &(String, u16),
    ) -> Result<Option<MultiplexedConnection>, StoreError> {
        tokio::time::timeout(WATCH_DEADLINE + CONNECT_TIMEOUT, async {
            let client = self.access.client(host, *port)?;
            let mut connection = client
                .get_multiplexed_async_connection_with_config(&connection_config())
                .await
                .map_err(store_error)?;
            Ok(is_primary(&mut connection).await?.then_some(connection))
        })
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::new(
                StoreErrorKind::Timeout,
                "no answer to ROLE in time",
            ))
        })
    }

    /// Looks the primary up: its address from the sentinels (the server named by the
    /// most of them first), a connection, and its own word (`ROLE`) that it is a primary.
    /// A server that is not a primary (a failover under way), or one that refuses the
    /// store (its password, its TLS certificate: one server's, not every server's), does
    /// not stop the next named by as many sentinels from being tried; a server fewer
    /// sentinels name is never tried (a stale sentinel's, cut off with a deposed primary
    /// that still answers as one: its writes go when it rejoins), so while the most-named
    /// answers nothing, the failure mode decides.
    async fn look_up(&self) -> Result<((String, u16), MultiplexedConnection), StoreError> {
        let mut errors = Errors::default();
        let named = self.named_by_most(&mut errors).await;
        let most = named.first().map_or(0, |n| n.votes);
        for Named {
            address: (host, port),
            ..
        } in named.into_iter().take_while(|n| n.votes == most)
        {
            let tried = async {
                let client = self.access.client(&host, port)?;
                let mut connection = client
                    .get_multiplexed_async_connection_with_config(&connection_config())
                    .await
                    .map_err(store_error)?;
                if is_primary(&mut connection).await? {
                    Ok(connection)
                } else {
                    Err(StoreError::new(
                        StoreErrorKind::Unavailable,
                        "a sentinel names it, but it is not a primary (a failover in progress)",
                    ))
                }
            };
            match tried.await {
                Ok(connection) => {
                    errors.report(SKIPPED);
                    return Ok(((host, port), connection));
                }
                Err(error) => errors.push(about(error, format_args!("{host}:{port}"))),
            }
        }
        let unknown = errors.unknown;
        Err(match errors.worst() {
            Some(error) => error,
            None if unknown => StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "no sentinel knows a primary named \"{}\" (check the name)",
                    self.master
                ),
            ),
            None => StoreError::new(StoreErrorKind::Unavailable, "no sentinel answered"),
        })
    }

    /// Puts `moved` in the place of the connection of `generation` (if it is still the
    /// current one): the primary the sentinels moved to, confirmed by the watch.
    fn move_to(&self, generation: u64, (address, connection): Moved) {
        {
            let mut state = self.lock();
            if state
                .current
                .as_ref()
                .is_none_or(|(current, _, _)| *current != generation)
            {
                return;
            }
            let next = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
            state.current = Some((next, address, connection));
            state.failed = None;
        }
        self.looked_up.send_modify(|count| *count += 1);
    }

    /// Drops the connection of `generation` (if it is still the current one), so the
    /// next decision looks the primary up again.
    fn leave(&self, generation: u64) {
        let mut state = self.lock();
        if state
            .current
            .as_ref()
            .is_some_and(|(current, _, _)| *current == generation)
        {
            state.current = None;
        }
    }

    /// Reads what a command on connection `generation` ended with: a broken connection
    /// or a demoted primary (`READONLY`) drops it, so the next decision looks the primary
    /// up again; `READONLY` then counts as unavailable (a failover, not a refusal). An
    /// error the primary answered (`NOREPLICAS`, `BUSY`, `LOADING`) or a slow answer keeps it: the
    /// connection is sound (a primary that stops answering is the watch's to find), and
    /// dropping it at each such error opened a connection per failed decision.
    pub(super) fn outcome(&self, generation: u64, error: StoreError) -> StoreError {
        let demoted = demoted(error.code());
        let broken = error.kind() == StoreErrorKind::Unavailable && error.code().is_none();
        if broken || demoted {
            self.leave(generation);
        }
        if demoted {
            let mut unavailable = StoreError::new(
                StoreErrorKind::Unavailable,
                format!("the primary was demoted (a failover): {}", error.message),
            );
            if let Some(code) = error.code() {
                unavailable = unavailable.with_code(code.to_owned());
            }
            return unavailable;
        }
        error
    }
}

/// Whether an error's code says the server is no primary any more (a failover). A
/// primary still loading its data (`LOADING`) is still one: the watch's `ROLE` finds a
/// replica loading from a new primary.
fn demoted(code: Option<&str>) -> bool {
    matches!(code, Some("READONLY" | "MASTERDOWN"))
}

/// The primary the sentinels moved to, and a connection to it.
type Moved = ((String, u16), MultiplexedConnection);

/// A server the sentinels named as the primary, and how many of them did.
struct Named {
    address: (String, u16),
    votes: usize,
    /// The place of the first-listed sentinel that named it.
    first: usize,
}

/// The errors of the sentinels (and servers) a look-up went past.
#[derive(Default)]
struct Errors {
    /// The first that is no I/O failure (a refused password, a server that is no
    /// sentinel, a reply of the wrong shape): a setting to fix.
    refused: Option<StoreError>,
    /// The last I/O failure.
    io: Option<StoreError>,
    /// A sentinel answered.
    heard: bool,
    /// A sentinel did not know the primary's name.
    unknown: bool,
    /// A sentinel named a server.
    named: bool,
}

impl Errors {
    fn push(&mut self, error: StoreError) {
        if error.kind().is_io() {
            self.io = Some(error);
        } else if self.refused.is_none() {
            self.refused = Some(error);
        }
    }

    /// The look-up failed: the error to answer with. A refusal before an I/O failure:
    /// a sentinel down beside one refusing its password is a password to fix, which the
    /// breaker and the logs must hear of, not an outage to wait out.
    fn worst(self) -> Option<StoreError> {
        self.refused.or(self.io)
    }

    /// A refusal met on the way is a setting to fix, said at error level (`what` says
    /// what it cost) and counted, whether or not another sentinel led to a primary.
    fn report(&self, what: &'static str) {
        if let Some(error) = &self.refused {
            crate::store::unmet(error, what);
        }
    }
}

/// What a refusal met costs, as [`Errors::report`] says it: another sentinel led to the
/// primary (a sentinel fewer to follow a failover with); none did; none did within a
/// watch round's time.
const SKIPPED: &str = "a Redis sentinel, or the server it named, refused the store: another \
     sentinel led to the primary, so the store works, with one sentinel fewer to follow a \
     failover with";
const UNFOLLOWED: &str = "no Redis sentinel could be followed (a sentinel, or the server it \
     names, refused the store): the store stays on the primary it has, and follows no \
     failover until this is fixed";
const CUT_OFF: &str = "no Redis sentinel could be followed within the watch's time (a \
     sentinel, or the server it names, refused the store, and others did not answer): the \
     store stays on the primary it has, and follows no failover until this is fixed";

/// Asks one sentinel for the primary named `master`: `Ok(None)` when it does not know
/// the name. Its error keeps its kind and code (a refusal, a reply of the wrong shape:
/// not an outage), and says which sentinel met it.
async fn ask(sentinel: &redis::Client, master: &str) -> Result<Option<(String, u16)>, StoreError> {
    let asked = tokio::time::timeout(CONNECT_TIMEOUT * 2, async {
        let mut connection = sentinel
            .get_multiplexed_async_connection_with_config(&connection_config())
            .await?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master)
            .query_async::<Option<(String, u16)>>(&mut connection)
            .await
    })
    .await;
    match asked {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(about(
            store_error(error),
            format_args!("the sentinel at {}", sentinel.get_connection_info().addr()),
        )),
        Err(_) => Err(StoreError::new(
            StoreErrorKind::Timeout,
            format!(
                "the sentinel at {} did not answer in time",
                sentinel.get_connection_info().addr()
            ),
        )),
    }
}

/// `error`, saying where it was met (`place`: an address, never credentials); its kind
/// and code kept.
fn about(error: StoreError, place: std::fmt::Arguments<'_>) -> StoreError {
    let mut placed = StoreError::new(error.kind(), format!("{place}: {}", error.message));
    if let Some(code) = error.code() {
        placed = placed.with_code(code.to_owned());
    }
    placed
}

/// `ROLE` says `master`.
async fn is_primary(connection: &mut MultiplexedConnection) -> Result<bool, StoreError> {
    let role: redis::Value = redis::cmd("ROLE")
        .query_async(connection)
        .await
        .map_err(store_error)?;
    Ok(match role {
        redis::Value::Array(items) => {
            matches!(
                items.first(),
                Some(redis::Value::BulkString(word)) if word.as_slice() == b"master"
            ) || matches!(
                items.first(),
                Some(redis::Value::SimpleString(word)) if word == "master"
            )
        }
        _ => false,
    })
}

/// A look-up's turn: if its task ends without recording an answer (dropped before it
/// ran, a panic, the runtime shutting down), the next request may start another.
struct Resolving(Option<Arc<SentinelBackend>>);

impl Drop for Resolving {
    fn drop(&mut self) {
        if let Some(backend) = self.0.take() {
            {
                let mut state = backend.lock();
                state.resolving = false;
                // Those waiting get an answer, not a new look-up each (on a runtime
                // shutting down, each would be dropped as it is spawned, at once).
                state.failed = Some((
                    Instant::now() + RESOLVE_BACKOFF,
                    StoreError::new(
                        StoreErrorKind::Unavailable,
                        "the look-up of the primary ended before it answered (its runtime \
                         shutting down, or a panic)",
                    ),
                ));
            }
            backend.looked_up.send_modify(|count| *count += 1);
        }
    }
}

/// One look-up, recorded whoever is waiting for it.
async fn resolve(mut turn: Resolving) {
    let Some(backend) = turn.0.take() else {
        return;
    };
    // Until the answer is recorded, the turn is handed back to the guard on a panic.
    turn.0 = Some(Arc::clone(&backend));
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, backend.look_up()).await;
    turn.0 = None;
    {
        let mut state = backend.lock();
        state.resolving = false;
        match found {
            Ok(Ok((address, connection))) => {
                let generation = backend.generation.fetch_add(1, Ordering::Relaxed) + 1;
                state.current = Some((generation, address, connection));
                state.failed = None;
            }
            Ok(Err(error)) => {
                let mut failed = StoreError::new(
                    error.kind(),
                    format!("no primary from the sentinels: {}", error.message),
                );
                if let Some(code) = error.code() {
                    failed = failed.with_code(code.to_owned());
                }
                // No primary for anyone (a refused password, a name no sentinel knows):
                // every request meets it, and the breaker holds requests off (else every
                // request after the back-off looks the primary up again).
                failed.every_request = !failed.kind().is_io();
                state.failed = Some((Instant::now() + RESOLVE_BACKOFF, failed));
            }
            Err(_) => {
                state.failed = Some((
                    Instant::now() + RESOLVE_BACKOFF,
                    StoreError::new(
                        StoreErrorKind::Timeout,
                        format!(
                            "the sentinels did not name a reachable primary within {RESOLVE_TIMEOUT:?}"
                        ),
                    ),
                ));
            }
        }
    }
    backend.looked_up.send_modify(|count| *count += 1);
}

/// Every [`WATCH_EVERY`]: is the server still a primary that answers, and still the one
/// the sentinels name? If not, it is left.
/// The watch's hold on the backend: says the watch ended however it ends (its runtime
/// shut down included), so that a request starts another.
struct Watching(Weak<SentinelBackend>);

impl Drop for Watching {
    fn drop(&mut self) {
        if let Some(backend) = self.0.upgrade() {
            backend.watching.store(false, Ordering::Release);
        }
    }
}

async fn watch(watching: Watching) {
    let backend = &watching.0;
    let mut tick: u64 = 0;
    // No sentinel answered the last round: said once, until one does.
    let mut unheard = false;
    // The sentinels that answered the last round all knew no primary by the name: said
    // once, until one names a server again.
    let mut forgotten = false;
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        tick += 1;
        let Some(backend) = backend.upgrade() else {
            return;
        };
        let current = backend
            .lock()
            .current
            .as_ref()
            .map(|(generation, address, connection)| {
                (*generation, address.clone(), connection.clone())
            });
        let Some((generation, address, mut connection)) = current else {
            continue;
        };
        let answered = tokio::time::timeout(WATCH_DEADLINE, is_primary(&mut connection)).await;
        let reason = match answered {
            // A primary; or one answering an error of the moment (a long script's `BUSY`,
            // `LOADING`): there, its connection sound, as a decision's own such error
            // keeps it (left, each request would look it up again: a connection per
            // look-up to a server already in trouble). Asked of the sentinels all the
            // same: a primary stuck in a script they failed over from is left.
            Ok(Ok(true)) => None,
            Ok(Err(error)) if matches!(error.code(), Some("BUSY" | "LOADING")) => None,
            Ok(Ok(false)) => Some("it is no longer a primary".to_owned()),
            Ok(Err(error)) => Some(format!("it failed to answer: {error}")),
            Err(_) => Some(format!("it did not answer within {WATCH_DEADLINE:?}")),
        };
        if let Some(reason) = reason {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                primary = %format!("{}:{}", address.0, address.1),
                reason = %reason,
                "leaving the Redis primary; asking the sentinels again"
            );
            #[cfg(not(feature = "tracing"))]
            let _ = reason;
            backend.leave(generation);
            continue;
        }
        // The sentinels every fourth tick (each question opens a connection). Moved to
        // the one they name only once that one says it is a primary: a stale sentinel
        // (cut off from the servers, still naming the old primary) would have the store
        // leave a sound primary at each look. A round has a deadline of its own
        // (meanwhile the primary goes unchecked); what it met is said however it ends.
        if !tick.is_multiple_of(4) {
            continue;
        }
        let mut errors = Errors::default();
        let round =
            tokio::time::timeout(RESOLVE_TIMEOUT, backend.moved_from(&address, &mut errors)).await;
        errors.report(match &round {
            Ok(Some(_)) => SKIPPED,
            Ok(None) => UNFOLLOWED,
            Err(_) => CUT_OFF,
        });
        // Every sentinel away (their addresses changed, a partition): the store works on
        // the primary it has, but would follow no failover. Said once, and when one
        // answers again (a refusal is said above, as the misconfiguration it is).
        match (round.is_ok() && !errors.heard, unheard) {
            (true, false) if errors.refused.is_none() => {
                unheard = true;
                #[cfg(feature = "tracing")]
                tracing::warn!(
                    target: "tollgate",
                    error = %errors.io.as_ref().map_or_else(String::new, ToString::to_string),
                    "no Redis sentinel answers: the store stays on the primary it has, and \
                     follows no failover until one does"
                );
            }
            (false, true) => {
                unheard = false;
                #[cfg(feature = "tracing")]
                tracing::info!(target: "tollgate", "a Redis sentinel answers again");
            }
            _ => {}
        }
        // Every sentinel that answered knows no primary by the name (`SENTINEL REMOVE`,
        // sentinels redeployed monitoring it by another name): heard, so not "no sentinel
        // answers" above, but the store as cut off from failovers.
        match (round.is_ok() && errors.unknown && !errors.named, forgotten) {
            (true, false) => {
                forgotten = true;
                #[cfg(feature = "tracing")]
                tracing::warn!(
                    target: "tollgate",
                    master = %backend.master,
                    "no Redis sentinel that answers knows a primary by the store's name: the \
                     store stays on the primary it has, and follows no failover until one \
                     names it again (check the sentinels' configuration, and the name)"
                );
            }
            (false, true) if errors.named => {
                forgotten = false;
                #[cfg(feature = "tracing")]
                tracing::info!(
                    target: "tollgate",
                    master = %backend.master,
                    "a Redis sentinel knows a primary by the store's name again"
                );
            }
            _ => {}
        }
        if let Ok(Some(Some(moved))) = round {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                primary = %format!("{}:{}", address.0, address.1),
                named = %format!("{}:{}", moved.0.0, moved.0.1),
                "leaving the Redis primary: the sentinels now name another, which answers \
                 as the primary"
            );
            backend.move_to(generation, moved);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Certificates, PrimaryAccess, demoted};

    /// A primary restarting with a large data set answers `LOADING` until it is loaded,
    /// and is a primary all along (sentinels do not fail over for it, and its `ROLE` says
    /// `master`): its connection is kept, as for `BUSY`. Read as a demotion, each
    /// decision dropped it and looked the primary up again, a new connection per decision
    /// to a server busy loading. A replica loading from a new primary is the watch's to
    /// find (`ROLE`).
    #[test]
    fn a_loading_primary_is_not_demoted() {
        assert!(!demoted(Some("LOADING")));
        assert!(!demoted(Some("BUSY")));
        assert!(demoted(Some("READONLY")));
        assert!(demoted(Some("MASTERDOWN")));
    }

    /// The primary's credentials reach `AUTH` as given. Written into a URL as they
    /// were, a `%` was read back as an escape: `Zx%41q` was sent as `ZxAq` and refused.
    #[test]
    fn the_primarys_credentials_are_sent_as_given() {
        for (username, password) in [
            ("limiter", "Zx%41q"),
            ("li%6diter", "p@ss:w/rd?#%C3%"),
            ("", "plain"),
        ] {
            let access = PrimaryAccess {
                tls: false,
                username: (!username.is_empty()).then(|| username.to_owned()),
                password: Some(password.to_owned()),
                certificates: Certificates::default(),
            };
            for host in ["10.0.0.7", "redis-1.internal", "::1"] {
                let client = access.client(host, 6379).unwrap();
                let settings = client.get_connection_info().redis_settings();
                assert_eq!(settings.password(), Some(password), "{host}");
                let expected = (!username.is_empty()).then_some(username);
                assert_eq!(settings.username(), expected, "{host}");
            }
        }
    }
}
