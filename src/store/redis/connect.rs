//! Where a [`RedisStore`] connects: one server, a Cluster, or the primary that Redis
//! Sentinel names (followed across failovers); plain or TLS; from code or from the
//! environment.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, IntoConnectionInfo, RedisError};

use super::{Backend, DEFAULT_PREFIX, RedisStore, store_error};
use crate::store::{StoreError, StoreErrorKind};

/// How long one attempt to open a connection (to a server, a primary or a sentinel) may
/// take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// After a failed look-up of the primary, the Sentinel store answers "unavailable" at once
/// for this long instead of asking the sentinels again for every request.
const RESOLVE_BACKOFF: Duration = Duration::from_millis(100);

/// Where and how a [`RedisStore`] connects: one server, a Cluster, or the primary that
/// Redis Sentinel names.
///
/// [`RedisStore::connect`] and [`RedisStore::connect_cluster`] are shorthands for the
/// common cases; this builder adds Sentinel, your own TLS root certificate and the
/// environment. Passwords in URLs are never printed: [`describe`](Self::describe) hides
/// them.
///
/// ```no_run
/// use tollgate::store::RedisConfig;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// // The primary named "mymaster" by any of three sentinels; failovers are followed.
/// let store = RedisConfig::sentinel(
///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
///     "mymaster",
/// )
/// .master_auth(Some("tollgate"), "s3cret")
/// .prefix("shop")
/// .connect()
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    target: Target,
    prefix: String,
    master_auth: Option<(Option<String>, String)>,
    #[cfg(feature = "tls")]
    root_certificate: Option<Vec<u8>>,
}

#[derive(Clone)]
enum Target {
    Server(String),
    Cluster(Vec<String>),
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("target", &self.describe())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisConfig {
    fn with_target(target: Target) -> Self {
        Self {
            target,
            prefix: DEFAULT_PREFIX.to_owned(),
            master_auth: None,
            #[cfg(feature = "tls")]
            root_certificate: None,
        }
    }

    /// One server: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS
    /// (feature `tls`).
    pub fn server(url: impl Into<String>) -> Self {
        Self::with_target(Target::Server(url.into()))
    }

    /// A Redis Cluster, reached through any of its nodes (`redis://` or `rediss://`).
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::with_target(Target::Cluster(nodes.into_iter().map(Into::into).collect()))
    }

    /// The primary that the sentinels at `sentinels` (`redis://host:port` each, or
    /// `rediss://`; a user and password in a URL are the sentinel's own) name `master`.
    ///
    /// The store asks the sentinels for the primary, checks that it says it is one (`ROLE`),
    /// and asks again whenever the connection breaks or the server answers `READONLY`
    /// (it was demoted): it follows failovers and never writes to a replica. Until the
    /// new primary answers, decisions fail as unavailable and the layer's failure mode
    /// answers.
    pub fn sentinel<I, S>(sentinels: I, master: impl Into<String>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::with_target(Target::Sentinel {
            sentinels: sentinels.into_iter().map(Into::into).collect(),
            master: master.into(),
        })
    }

    /// The target named by the environment:
    /// - `REDIS_SENTINEL_URLS` (comma-separated sentinel URLs) with `REDIS_SENTINEL_MASTER`
    ///   (the primary's name); the primary's user and password, when it needs them, from
    ///   `REDIS_SENTINEL_MASTER_USERNAME` and `REDIS_SENTINEL_MASTER_PASSWORD`;
    /// - else `REDIS_CLUSTER` (comma-separated node URLs);
    /// - else `REDIS_URL` (`redis://` or `rediss://`).
    ///
    /// `Ok(None)` when none is set; an error when the Sentinel variables come without each
    /// other or a list is empty.
    ///
    /// ```
    /// use tollgate::store::RedisConfig;
    ///
    /// let from = |vars: &[(&str, &str)]| {
    ///     RedisConfig::from_lookup(|name| {
    ///         vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    ///     })
    /// };
    /// assert!(from(&[]).unwrap().is_none());
    /// let config = from(&[("REDIS_URL", "redis://:hunter2@127.0.0.1:6379")]).unwrap().unwrap();
    /// assert_eq!(config.describe(), "redis://:***@127.0.0.1:6379");
    /// let config = from(&[
    ///     ("REDIS_SENTINEL_URLS", "redis://127.0.0.1:26379, redis://127.0.0.1:26380"),
    ///     ("REDIS_SENTINEL_MASTER", "mymaster"),
    /// ])
    /// .unwrap()
    /// .unwrap();
    /// assert_eq!(
    ///     config.describe(),
    ///     "primary \"mymaster\" through sentinels redis://127.0.0.1:26379, redis://127.0.0.1:26380"
    /// );
    /// assert!(from(&[("REDIS_SENTINEL_URLS", "redis://127.0.0.1:26379")]).is_err());
    /// ```
    pub fn from_env() -> Result<Option<Self>, StoreError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) with the variables read through `lookup` (for tests,
    /// or settings that come from somewhere else).
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, StoreError> {
        let set = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let list = |name: &str, value: String| -> Result<Vec<String>, StoreError> {
            let items: Vec<String> = value
                .split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(str::to_owned)
                .collect();
            if items.is_empty() {
                return Err(config_error(format!("{name} lists no URL")));
            }
            Ok(items)
        };
        match (set("REDIS_SENTINEL_URLS"), set("REDIS_SENTINEL_MASTER")) {
            (Some(urls), Some(master)) => {
                let mut config = Self::sentinel(list("REDIS_SENTINEL_URLS", urls)?, master.trim());
                if let Some(password) = set("REDIS_SENTINEL_MASTER_PASSWORD") {
                    config = config.master_auth(set("REDIS_SENTINEL_MASTER_USERNAME"), password);
                }
                return Ok(Some(config));
            }
            (Some(_), None) => {
                return Err(config_error(
                    "REDIS_SENTINEL_URLS is set but REDIS_SENTINEL_MASTER (the primary's name) is not",
                ));
            }
            (None, Some(_)) => {
                return Err(config_error(
                    "REDIS_SENTINEL_MASTER is set but REDIS_SENTINEL_URLS (the sentinels) is not",
                ));
            }
            (None, None) => {}
        }
        if let Some(nodes) = set("REDIS_CLUSTER") {
            return Ok(Some(Self::cluster(list("REDIS_CLUSTER", nodes)?)));
        }
        Ok(set("REDIS_URL").map(|url| Self::server(url.trim())))
    }

    /// Keys under `prefix` instead of `tollgate` (several apps, one Redis; an ACL user
    /// limited to `prefix:*`). The start-up check writes under it too.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The user (or `None` for the default user) and password of the primary that the
    /// sentinels name. Only for [`sentinel`](Self::sentinel): a server's or a Cluster
    /// node's credentials go in its URL.
    pub fn master_auth(
        mut self,
        username: Option<impl Into<String>>,
        password: impl Into<String>,
    ) -> Self {
        self.master_auth = Some((username.map(Into::into), password.into()));
        self
    }

    /// Trusts this root certificate (PEM) for `rediss://` connections instead of the
    /// system's: a private CA. Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn root_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_certificate = Some(pem.into());
        self
    }

    /// Where this connects, for logs: passwords are replaced by `***`.
    pub fn describe(&self) -> String {
        match &self.target {
            Target::Server(url) => redact(url),
            Target::Cluster(nodes) => format!(
                "Cluster through {}",
                nodes
                    .iter()
                    .map(|n| redact(n))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Target::Sentinel { sentinels, master } => format!(
                "primary \"{master}\" through sentinels {}",
                sentinels
                    .iter()
                    .map(|n| redact(n))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Connects, then [verifies](RedisStore::verify) that the server runs every script
    /// under the prefix.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let backend = match &self.target {
            Target::Server(url) => {
                let client = self.client(url)?;
                let config =
                    ConnectionManagerConfig::new().set_connection_timeout(Some(CONNECT_TIMEOUT));
                let manager = ConnectionManager::new_with_config(client, config)
                    .await
                    .map_err(|error| connect_error(&self, error))?;
                Backend::Manager(manager)
            }
            Target::Cluster(nodes) => {
                for node in nodes {
                    check_scheme(node)?;
                }
                #[allow(unused_mut)]
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(CONNECT_TIMEOUT);
                #[cfg(feature = "tls")]
                if let Some(pem) = &self.root_certificate {
                    builder = builder.certs(certificates(pem));
                }
                let client = builder.build().map_err(store_error)?;
                let connection = client
                    .get_async_connection()
                    .await
                    .map_err(|error| connect_error(&self, error))?;
                Backend::Cluster(connection)
            }
            Target::Sentinel { sentinels, master } => {
                let client = self.sentinel_client(sentinels, master)?;
                let sentinel = SentinelBackend::new(client);
                // The first look-up: a wrong name or no reachable sentinel fails here.
                sentinel.connection().await.map_err(|error| {
                    StoreError::new(
                        error.kind(),
                        format!("{}: {}", self.describe(), error.message),
                    )
                })?;
                Backend::Sentinel(std::sync::Arc::new(sentinel))
            }
        };
        let store = RedisStore::with_backend(backend).prefix(&self.prefix);
        store.verify().await?;
        Ok(store)
    }

    fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        check_scheme(url)?;
        #[cfg(feature = "tls")]
        if let Some(pem) = &self.root_certificate {
            return redis::Client::build_with_tls(url, certificates(pem)).map_err(store_error);
        }
        redis::Client::open(url).map_err(store_error)
    }

    fn sentinel_client(
        &self,
        sentinels: &[String],
        master: &str,
    ) -> Result<SentinelClient, StoreError> {
        if sentinels.is_empty() {
            return Err(config_error("no sentinel URL given"));
        }
        let mut addresses = Vec::with_capacity(sentinels.len());
        let mut sentinel_auth = None;
        let mut tls = false;
        for url in sentinels {
            check_scheme(url)?;
            let info = url.as_str().into_connection_info().map_err(store_error)?;
            tls |= matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
            if sentinel_auth.is_none() {
                if let Some(password) = info.redis_settings().password() {
                    sentinel_auth = Some((
                        info.redis_settings().username().map(str::to_owned),
                        password.to_owned(),
                    ));
                }
            }
            addresses.push(info.addr().clone());
        }
        let mut builder = SentinelClientBuilder::new(addresses, master, SentinelServerType::Master)
            .map_err(store_error)?
            .set_client_to_redis_tcp_settings(tcp_settings())
            .set_client_to_sentinel_tcp_settings(tcp_settings());
        if let Some((username, password)) = sentinel_auth {
            if let Some(username) = username {
                builder = builder.set_client_to_sentinel_username(username);
            }
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some((username, password)) = &self.master_auth {
            if let Some(username) = username {
                builder = builder.set_client_to_redis_username(username);
            }
            builder = builder.set_client_to_redis_password(password);
        }
        if tls {
            // The primary is reached the way the sentinels are.
            builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
            #[cfg(feature = "tls")]
            if let Some(pem) = &self.root_certificate {
                builder = builder
                    .set_client_to_redis_certificates(certificates(pem))
                    .set_client_to_sentinel_certificates(certificates(pem));
            }
        }
        builder.build().map_err(store_error)
    }
}

fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

#[cfg(feature = "tls")]
fn certificates(pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    }
}

fn config_error(message: impl Into<String>) -> StoreError {
    StoreError::new(StoreErrorKind::Other, message)
}

/// `rediss://` without the `tls` feature is a clear error, not redis-rs's.
fn check_scheme(url: &str) -> Result<(), StoreError> {
    if cfg!(not(feature = "tls")) && url.trim_start().to_ascii_lowercase().starts_with("rediss:") {
        return Err(config_error(format!(
            "{} is a TLS URL: build tollgate with its `tls` feature",
            redact(url)
        )));
    }
    Ok(())
}

fn connect_error(config: &RedisConfig, error: RedisError) -> StoreError {
    let error = store_error(error);
    StoreError::new(
        error.kind(),
        format!("{}: {}", config.describe(), error.message),
    )
}

/// Query parameters that carry a password (redis-rs reads `pass` in `redis+unix:` URLs).
const SECRET_PARAMETERS: [&str; 2] = ["pass", "password"];

/// `url` with the password of its user info, and any `pass`/`password` query parameter,
/// replaced by `***`. A string that does not parse as a URL is not shown at all: where its
/// password is cannot be known.
pub(super) fn redact(url: &str) -> String {
    const UNPARSABLE: &str = "<a URL that does not parse; not shown>";
    let Ok(mut parsed) = url::Url::parse(url.trim()) else {
        return UNPARSABLE.to_owned();
    };
    if parsed.password().is_some() && parsed.set_password(Some("***")).is_err() {
        return UNPARSABLE.to_owned();
    }
    let secret = |name: &str| SECRET_PARAMETERS.contains(&name.to_ascii_lowercase().as_str());
    if parsed.query_pairs().any(|(name, _)| secret(&name)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(name, value)| {
                let value = if secret(&name) { "***".into() } else { value };
                (name.into_owned(), value.into_owned())
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

/// The primary that the sentinels name, behind one multiplexed connection: looked up
/// again after the connection breaks or the server says it is a replica.
pub(super) struct SentinelBackend {
    resolver: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Current>,
    generation: AtomicU64,
}

struct Current {
    connection: Option<(u64, MultiplexedConnection)>,
    /// A failed look-up: no new one before this instant.
    retry_at: Option<Instant>,
    last_error: Option<(StoreErrorKind, String)>,
}

impl SentinelBackend {
    fn new(client: SentinelClient) -> Self {
        Self {
            resolver: tokio::sync::Mutex::new(client),
            current: Mutex::new(Current {
                connection: None,
                retry_at: None,
                last_error: None,
            }),
            generation: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The connection to the current primary, looked up when there is none.
    pub(super) async fn connection(&self) -> Result<(u64, MultiplexedConnection), StoreError> {
        if let Some(found) = self.cached()? {
            return Ok(found);
        }
        // One look-up at a time; the others wait for it and take its answer.
        let mut resolver = self.resolver.lock().await;
        if let Some(found) = self.cached()? {
            return Ok(found);
        }
        let config = AsyncConnectionConfig::new().set_connection_timeout(Some(CONNECT_TIMEOUT));
        let looked_up = tokio::time::timeout(
            4 * CONNECT_TIMEOUT,
            resolver.get_async_connection_with_config(&config),
        )
        .await;
        let mut current = self.lock();
        match looked_up {
            Ok(Ok(connection)) => {
                let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                current.connection = Some((generation, connection.clone()));
                current.retry_at = None;
                current.last_error = None;
                Ok((generation, connection))
            }
            Ok(Err(error)) => {
                let error = store_error(error);
                // No reachable primary yet is the gap a failover leaves: unavailable.
                let kind = if error.kind().is_io()
                    || matches!(error.code(), Some("READONLY" | "MASTERDOWN"))
                    || error.message.contains("No valid masters")
                    || error.message.contains("sentinel")
                {
                    StoreErrorKind::Unavailable
                } else {
                    error.kind()
                };
                let message = format!("no primary from the sentinels: {}", error.message);
                current.retry_at = Some(Instant::now() + RESOLVE_BACKOFF);
                current.last_error = Some((kind, message.clone()));
                Err(StoreError::new(kind, message))
            }
            Err(_) => {
                let message = "the sentinels did not name a reachable primary in time".to_owned();
                current.retry_at = Some(Instant::now() + RESOLVE_BACKOFF);
                current.last_error = Some((StoreErrorKind::Timeout, message.clone()));
                Err(StoreError::new(StoreErrorKind::Timeout, message))
            }
        }
    }

    /// The cached connection; the last look-up's error while its back-off lasts.
    fn cached(&self) -> Result<Option<(u64, MultiplexedConnection)>, StoreError> {
        let current = self.lock();
        if let Some(found) = &current.connection {
            return Ok(Some(found.clone()));
        }
        if let (Some(retry_at), Some((kind, message))) = (current.retry_at, &current.last_error) {
            if Instant::now() < retry_at {
                return Err(StoreError::new(*kind, message.clone()));
            }
        }
        Ok(None)
    }

    /// Reads what a command on connection `generation` ended with: a broken connection
    /// or a demoted primary (`READONLY`) drops it, so the next decision looks the primary
    /// up again; `READONLY` then counts as unavailable (a failover, not a refusal).
    pub(super) fn outcome(&self, generation: u64, error: StoreError) -> StoreError {
        let demoted = matches!(error.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if error.kind().is_io() || demoted {
            let mut current = self.lock();
            if current
                .connection
                .as_ref()
                .is_some_and(|(current, _)| *current == generation)
            {
                current.connection = None;
            }
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

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn user_and_password() {
        assert_eq!(redact("redis://user:pass@h:1/0"), "redis://user:***@h:1/0");
        assert_eq!(redact("redis://:pass@h"), "redis://:***@h");
    }

    #[test]
    fn no_password_is_unchanged() {
        assert_eq!(redact("rediss://h:1"), "rediss://h:1");
        assert_eq!(redact("redis://user@h:1"), "redis://user@h:1");
    }

    #[test]
    fn password_with_an_at_sign_and_percent_encoding() {
        assert_eq!(
            redact("redis://u:p%40ss@word@h:6379"),
            "redis://u:***@h:6379"
        );
    }

    #[test]
    fn password_in_the_query() {
        assert_eq!(
            redact("redis+unix:///run/redis.sock?db=1&pass=hunter2"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
    }

    #[test]
    fn malformed_urls_are_not_shown() {
        for malformed in [
            "redis://:secret@h:99999",
            "redis://:secret@[::1",
            "secret",
            ":secret@h:1",
            "",
        ] {
            let shown = redact(malformed);
            assert!(
                !shown.contains("secret"),
                "{malformed:?} shown as {shown:?}"
            );
            assert_eq!(
                shown, "<a URL that does not parse; not shown>",
                "{malformed:?}"
            );
        }
    }
}
