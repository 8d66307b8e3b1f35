//! Where a [`RedisStore`] connects: one server, a Cluster, or the primary that Redis
//! Sentinel names (followed across failovers); plain or TLS; from code or from the
//! environment.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;

use super::cluster::ManagedCluster;
use super::sentinel::{Certificates, PrimaryAccess, SentinelBackend, open_client};
use super::{Backend, DEFAULT_PREFIX, Managed, RedisStore, store_error};
use crate::store::{StoreError, StoreErrorKind};

/// How long one attempt to open a connection (to a server, a primary or a sentinel) may
/// take before it counts as a failure.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a Cluster node may take to answer one call.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

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
    certificates: Certificates,
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
            certificates: Certificates::default(),
        }
    }

    /// One server: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS
    /// (feature `tls`). Nothing connects until [`connect`](Self::connect).
    ///
    /// ```
    /// use tollgate::store::RedisConfig;
    ///
    /// let config = RedisConfig::server("redis://app:s3cret@127.0.0.1:6379/2").prefix("shop");
    /// assert_eq!(config.describe(), "redis://app:***@127.0.0.1:6379/2");
    ///
    /// // Then, at start-up:
    /// async fn start_up(config: RedisConfig) -> Result<(), tollgate::StoreError> {
    ///     let store = config.connect().await?; // connects and verifies
    ///     assert_eq!(store.keys().tag("k"), "{k}");
    ///     Ok(())
    /// }
    /// # let _ = start_up;
    /// ```
    pub fn server(url: impl Into<String>) -> Self {
        Self::with_target(Target::Server(url.into()))
    }

    /// A Redis Cluster, reached through any of its nodes (`redis://` or `rediss://`).
    ///
    /// ```
    /// use tollgate::store::RedisConfig;
    ///
    /// let config = RedisConfig::cluster(["redis://10.0.0.1:7000", "redis://:pw@10.0.0.2:7000"]);
    /// assert_eq!(
    ///     config.describe(),
    ///     "Cluster through redis://10.0.0.1:7000, redis://:***@10.0.0.2:7000"
    /// );
    /// ```
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
    /// - else `REDIS_URL` (`redis://` or `rediss://`);
    ///
    /// and, over TLS (feature `tls`), the files `REDIS_TLS_CA_FILE` (a private CA, see
    /// [`root_certificate_pem`](Self::root_certificate_pem)) and `REDIS_TLS_CERT_FILE` with
    /// `REDIS_TLS_KEY_FILE` (a client certificate and its key, for a server that asks for
    /// one, see [`client_certificate_pem`](Self::client_certificate_pem)), read at once.
    ///
    /// `Ok(None)` when none is set; an error when one is set but empty, when the Sentinel
    /// variables (or the client certificate and key files) come without each other, when
    /// a list is empty, when a file cannot be read (its variable and path are named, never
    /// its content), or when a TLS file is named with no Redis or without the `tls`
    /// feature.
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
    /// // Set to nothing is an error, not "no Redis".
    /// assert!(from(&[("REDIS_URL", "")]).is_err());
    /// ```
    pub fn from_env() -> Result<Option<Self>, StoreError> {
        // A value that is not UTF-8 is an error, not "unset" (which would read as no
        // Redis, as a value set to nothing would): the first such variable is named.
        let unreadable = std::cell::RefCell::new(None);
        let found = Self::from_lookup(|name| match std::env::var(name) {
            Ok(value) => Some(value),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                unreadable
                    .borrow_mut()
                    .get_or_insert_with(|| name.to_owned());
                None
            }
        });
        match unreadable.into_inner() {
            Some(name) => Err(config_error(format!(
                "{name} is not valid UTF-8: give it a URL (or unset it)"
            ))),
            None => found,
        }
    }

    /// [`from_env`](Self::from_env) with the variables read through `lookup` (for tests,
    /// or settings that come from somewhere else).
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, StoreError> {
        // A variable set to nothing is a mistake (`REDIS_URL=${UNSET}` in a deployment),
        // never "no Redis": replicas that each fell back to their own in-process store
        // would admit N times the limit.
        let set = |name: &str| -> Result<Option<String>, StoreError> {
            match lookup(name) {
                Some(value) if value.trim().is_empty() => Err(config_error(format!(
                    "{name} is set but empty: unset it, or give it a value"
                ))),
                other => Ok(other),
            }
        };
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
        let found = match (set("REDIS_SENTINEL_URLS")?, set("REDIS_SENTINEL_MASTER")?) {
            (Some(urls), Some(master)) => {
                let mut config = Self::sentinel(list("REDIS_SENTINEL_URLS", urls)?, master.trim());
                match (
                    set("REDIS_SENTINEL_MASTER_USERNAME")?,
                    set("REDIS_SENTINEL_MASTER_PASSWORD")?,
                ) {
                    (username, Some(password)) => {
                        config = config.master_auth(username, password);
                    }
                    (Some(_), None) => {
                        return Err(config_error(
                            "REDIS_SENTINEL_MASTER_USERNAME is set but REDIS_SENTINEL_MASTER_PASSWORD is not",
                        ));
                    }
                    (None, None) => {}
                }
                Some(config)
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
            (None, None) => match set("REDIS_CLUSTER")? {
                Some(nodes) => Some(Self::cluster(list("REDIS_CLUSTER", nodes)?)),
                None => set("REDIS_URL")?.map(|url| Self::server(url.trim())),
            },
        };
        // The TLS files: a private CA, and a client certificate for a server that asks
        // for one (Redis's default).
        let files = (
            set("REDIS_TLS_CA_FILE")?,
            set("REDIS_TLS_CERT_FILE")?,
            set("REDIS_TLS_KEY_FILE")?,
        );
        let Some(config) = found else {
            return match files {
                (None, None, None) => Ok(None),
                _ => Err(config_error(
                    "a REDIS_TLS_* file is set but no Redis is (REDIS_URL, REDIS_CLUSTER or \
                     REDIS_SENTINEL_URLS)",
                )),
            };
        };
        config.with_tls_files(files).map(Some)
    }

    /// `config` with the TLS files the environment names (`REDIS_TLS_CA_FILE`,
    /// `REDIS_TLS_CERT_FILE` and `REDIS_TLS_KEY_FILE`), read now: an unreadable file is
    /// an error that names its variable and path, never its content.
    #[cfg_attr(not(feature = "tls"), allow(clippy::unused_self))]
    fn with_tls_files(
        self,
        (ca, certificate, key): (Option<String>, Option<String>, Option<String>),
    ) -> Result<Self, StoreError> {
        if certificate.is_some() != key.is_some() {
            return Err(config_error(
                "REDIS_TLS_CERT_FILE and REDIS_TLS_KEY_FILE go together (a client certificate \
                 and its key): set both or neither",
            ));
        }
        #[cfg(feature = "tls")]
        {
            let read = |name: &str, path: &str| {
                std::fs::read(path.trim()).map_err(|error| {
                    config_error(format!("{name}: {:?} cannot be read: {error}", path.trim()))
                })
            };
            let mut config = self;
            if let Some(path) = ca {
                config = config.root_certificate_pem(read("REDIS_TLS_CA_FILE", &path)?);
            }
            if let (Some(certificate), Some(key)) = (certificate, key) {
                config = config.client_certificate_pem(
                    read("REDIS_TLS_CERT_FILE", &certificate)?,
                    read("REDIS_TLS_KEY_FILE", &key)?,
                );
            }
            Ok(config)
        }
        #[cfg(not(feature = "tls"))]
        match (ca, certificate) {
            (None, None) => Ok(self),
            _ => Err(config_error(
                "a REDIS_TLS_* file is set, and TLS needs tollgate's `tls` feature",
            )),
        }
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
    /// system's: a private CA. Feature `tls`. It serves a Cluster's nodes, and the
    /// sentinels and the primary they name, alike.
    ///
    /// ```no_run
    /// use tollgate::store::RedisConfig;
    /// use tollgate::{Key, Policy, PolicySet, Rate, Store};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let ca = std::fs::read("/etc/redis/tls/ca.pem")?;
    /// let store = RedisConfig::server("rediss://redis.internal:6380")
    ///     .root_certificate_pem(ca)
    ///     .connect()
    ///     .await?;
    /// let api = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(5))?);
    /// assert!(store.decide(&Key::new("k"), &api, 1).await?.is_allowed());
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub fn root_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.certificates.root = Some(pem.into());
        self
    }

    /// Presents this client certificate and its private key (both PEM) on `rediss://`
    /// connections: for a server that asks for one (Redis's own default,
    /// `tls-auth-clients yes`: a TLS Redis set up with its stock configuration refuses a
    /// client without one). Feature `tls`. It serves a Cluster's nodes, and the sentinels
    /// and the primary they name, alike. The key is never printed (nor in `Debug`).
    ///
    /// ```no_run
    /// use tollgate::store::RedisConfig;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisConfig::server("rediss://redis.internal:6380")
    ///     .root_certificate_pem(std::fs::read("/etc/redis/tls/ca.pem")?)
    ///     .client_certificate_pem(
    ///         std::fs::read("/etc/redis/tls/client.pem")?,
    ///         std::fs::read("/etc/redis/tls/client.key")?,
    ///     )
    ///     .connect()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub fn client_certificate_pem(
        mut self,
        certificate: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.certificates.client = Some((certificate.into(), key.into()));
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
        // rustls needs one process-wide crypto provider; with both ring and aws-lc-rs in a
        // build it cannot pick, so tollgate names ring (another one installed first wins).
        #[cfg(feature = "tls")]
        let _ = rustls::crypto::ring::default_provider().install_default();
        let backend = match &self.target {
            Target::Server(url) => {
                let client = self.client(url)?;
                let config =
                    ConnectionManagerConfig::new().set_connection_timeout(Some(CONNECT_TIMEOUT));
                let managed = Managed::connect(client, config)
                    .await
                    .map_err(|error| self.in_context(store_error(error)))?;
                Backend::Manager(Arc::new(managed))
            }
            Target::Cluster(nodes) => {
                for node in nodes {
                    check_scheme(node)?;
                }
                #[allow(unused_mut)]
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(CONNECT_TIMEOUT)
                    // A node that stops answering fails its calls instead of holding them.
                    .response_timeout(RESPONSE_TIMEOUT);
                #[cfg(feature = "tls")]
                if let Some(certificates) = self.certificates.for_redis()? {
                    builder = builder.certs(certificates);
                }
                let client = builder.build().map_err(store_error)?;
                let connection = client
                    .get_async_connection()
                    .await
                    .map_err(|error| self.in_context(store_error(error)))?;
                Backend::Cluster(Arc::new(ManagedCluster::new(client, connection)))
            }
            Target::Sentinel { sentinels, master } => {
                let sentinel = self.sentinel_backend(sentinels, master)?;
                // The first look-up: a wrong name or no reachable sentinel fails here.
                sentinel
                    .connection()
                    .await
                    .map_err(|error| self.in_context(error))?;
                Backend::Sentinel(sentinel)
            }
        };
        let store = RedisStore::with_backend(backend).prefix(&self.prefix);
        store.verify().await?;
        Ok(store)
    }

    /// `error`, saying where it happened (passwords hidden).
    fn in_context(&self, error: StoreError) -> StoreError {
        StoreError::new(
            error.kind(),
            format!("{}: {}", self.describe(), error.message),
        )
    }

    fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        check_scheme(url)?;
        open_client(url, &self.certificates)
    }

    fn sentinel_backend(
        &self,
        sentinels: &[String],
        master: &str,
    ) -> Result<Arc<SentinelBackend>, StoreError> {
        if sentinels.is_empty() {
            return Err(config_error("no sentinel URL given"));
        }
        if master.trim().is_empty() {
            return Err(config_error("the primary's name is empty"));
        }
        let clients = sentinels
            .iter()
            .map(|url| self.client(url))
            .collect::<Result<Vec<_>, _>>()?;
        // The primary is reached the way the sentinels are: TLS when they use it.
        let tls = sentinels.iter().any(|url| tls_url(url));
        let (username, password) = match &self.master_auth {
            Some((username, password)) => (username.clone(), Some(password.clone())),
            None => (None, None),
        };
        Ok(SentinelBackend::new(
            clients,
            master.trim().to_owned(),
            PrimaryAccess {
                tls,
                username,
                password,
                certificates: self.certificates.clone(),
            },
        ))
    }
}

fn config_error(message: impl Into<String>) -> StoreError {
    StoreError::new(StoreErrorKind::Other, message)
}

/// Whether `url` asks for TLS: `rediss:`, or `valkeys:` (which redis-rs reads as TLS
/// too), in any case.
fn tls_url(url: &str) -> bool {
    let url = url.trim_start().to_ascii_lowercase();
    url.starts_with("rediss:") || url.starts_with("valkeys:")
}

/// A TLS URL without the `tls` feature is a clear error, not redis-rs's.
fn check_scheme(url: &str) -> Result<(), StoreError> {
    if cfg!(not(feature = "tls")) && tls_url(url) {
        return Err(config_error(format!(
            "{} is a TLS URL: build tollgate with its `tls` feature",
            redact(url)
        )));
    }
    Ok(())
}

/// Query parameters that carry a password (redis-rs reads `pass` in `redis+unix:` URLs).
const SECRET_PARAMETERS: [&str; 2] = ["pass", "password"];

/// `url` with the password of its user info, and any `pass`/`password` query parameter,
/// replaced by `***`. A string that does not parse as a URL, or holds an `@` outside its
/// user info, is not shown at all: where its password is cannot be known.
pub(super) fn redact(url: &str) -> String {
    const UNPARSABLE: &str = "<a URL that does not parse; not shown>";
    let Ok(mut parsed) = url::Url::parse(url.trim()) else {
        return UNPARSABLE.to_owned();
    };
    // An `@` outside the user info: a password holding `/`, `?` or `#` unescaped, which
    // ends the authority early and leaves its pieces in the host, port, path, query or
    // fragment (a part of it may even parse as the user info).
    let outside = [
        Some(parsed.path()),
        parsed.query(),
        parsed.fragment(),
        parsed.host_str(),
    ];
    if outside.into_iter().flatten().any(|part| part.contains('@'))
        || (parsed.username().is_empty() && parsed.password().is_none() && url.contains('@'))
    {
        return "<a URL with an @ outside its user info (a password holding /, ? or # \
                must be percent-encoded); not shown>"
            .to_owned();
    }
    if parsed.password().is_some() && parsed.set_password(Some("***")).is_err() {
        return UNPARSABLE.to_owned();
    }
    // A user and no password: most often a password written where the user goes
    // (`redis://s3cret@host`, for `redis://:s3cret@host`). Not shown either.
    if parsed.password().is_none()
        && !parsed.username().is_empty()
        && parsed.set_username("***").is_err()
    {
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

#[cfg(test)]
mod tests {
    use super::{redact, tls_url};

    #[test]
    fn tls_urls_are_told_in_every_spelling() {
        // A primary the sentinels name is reached with TLS when they are: `valkeys://`
        // sentinels had it reached in plain text (redis-rs reads `valkeys` as TLS).
        for url in [
            "rediss://h:1",
            " REDISS://h:1",
            "valkeys://h:1",
            "ValKeyS://h:1",
        ] {
            assert!(tls_url(url), "{}", redact(url));
        }
        for url in ["redis://h:1", "valkey://h:1", "redis+unix:///tmp/r.sock"] {
            assert!(!tls_url(url), "{}", redact(url));
        }
    }

    #[test]
    fn user_and_password() {
        assert_eq!(redact("redis://user:pass@h:1/0"), "redis://user:***@h:1/0");
        assert_eq!(redact("redis://:pass@h"), "redis://:***@h");
        // A password written where the user goes is not shown either.
        assert_eq!(redact("redis://s3cret@h:1"), "redis://***@h:1");
    }

    #[test]
    fn no_user_and_no_password_is_unchanged() {
        assert_eq!(redact("rediss://h:1"), "rediss://h:1");
        // A user alone may be a password in the wrong place: not shown.
        assert_eq!(redact("redis://user@h:1"), "redis://***@h:1");
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

    /// A password holding `/`, `?` or `#` unescaped ends the URL's authority early: what
    /// parses is a host and a port made of the password's pieces, and a path or query
    /// holding the rest and the `@` (the URL standard, "authority state"). Nothing of it
    /// is a user info to hide, so none of it is shown.
    #[test]
    fn a_password_holding_a_delimiter_is_not_shown() {
        // A failure names the case, never the URL or what was shown: both hold a password.
        for (case, url) in [
            "redis://limiter:2024/Spring@h:6379",
            "redis://s3cr?et@h",
            "redis://:s3cr#et@h:6379",
            "rediss://limiter:ab/cd?ef@h:6380/0",
        ]
        .into_iter()
        .enumerate()
        {
            let shown = redact(url);
            for piece in ["2024", "Spring", "s3cr", "et@", "ab", "cd", "ef"] {
                assert!(!shown.contains(piece), "case {case}: a password was shown");
            }
        }
        // A user info that parses, with the rest of the password past it: the host, the
        // path or the query holds an `@` too.
        for (case, url) in [
            "redis://u:p@zq/xk@h:6379",
            "redis://:p@zq?xk@h",
            "redis://u:p@zq#xk@h",
        ]
        .into_iter()
        .enumerate()
        {
            let shown = redact(url);
            for piece in ["zq", "xk"] {
                assert!(!shown.contains(piece), "case {case}: a password was shown");
            }
        }
        // An `@` the user info holds is fine, and so is a URL with none.
        assert_eq!(redact("redis://u:p%40ss@h:1"), "redis://u:***@h:1");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
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
