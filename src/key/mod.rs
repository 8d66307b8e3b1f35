//! Key extractors: who is this request? The answer is a [`Key`], the identity whose
//! budget the request spends.
//!
//! Ready extractors: [`ClientIp`] (socket peer, or behind trusted proxies), [`HeaderKey`]
//! (an API key or token, hashed), [`ExtensionKey`] (a user id set by auth middleware),
//! [`Route`], [`Global`], tuples of extractors (compound keys), [`KeyExtractorExt::or`]
//! (the first that finds a key: only an absent key falls through, see below) and
//! [`from_fn`] (a closure).
//!
//! Only [`HeaderKey`] hashes what it reads. Other extractors store their identity as
//! written: in store keys and in events (a denial's at debug level, a shadow policy's
//! would-be denial at info level; an [`ExtensionKey`] of an e-mail address puts the
//! address there: map it to an account id), and [`Route`] on a path without a router's
//! template puts the raw path there (a token in a path included).
//!
//! Extractors see the request's head only ([`http::request::Parts`]), never its body, and
//! know nothing of stores.
//!
//! When no key can be extracted the extractor says why with a [`KeyError`], and the layer
//! answers it (400 when the client left something out or sent something unusable, 500
//! when the server is set up wrong) unless told to let requests without a key through: a
//! missing key is never a silent bypass.
//!
//! A key is either *absent* ([`KeyError::is_missing`]: no such header, no identity set by
//! the auth layer) or *invalid* (present but unusable: a repeated or empty header, bytes
//! that are not visible ASCII, a server set up wrong). Only an absent key lets
//! [`KeyExtractorExt::or`] try its fallback; an invalid one is answered as it is, so a
//! client cannot trade a budget it has for another by sending a malformed key.

mod extension;
mod header;
mod ip;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use compact_str::CompactString;
use http::Method;
use http::request::Parts;
use sha2::{Digest, Sha256};

pub use extension::ExtensionKey;
pub use header::HeaderKey;
pub use ip::{ClientIp, ForwardedHeader, InvalidProxy};
pub(crate) use ip::{NetError, read_network};

/// Identities longer than this are hashed, so a hostile 10 KB header costs a store no
/// more than a short one.
pub const MAX_KEY_LEN: usize = 256;

/// An identity: the name of one budget in a store.
///
/// ```
/// use tollgate::Key;
///
/// assert_eq!(Key::new("user:42").as_str(), "user:42");
/// let secret = Key::hashed("x-api-key", b"sk_live_abc");
/// assert!(secret.as_str().starts_with("x-api-key:"));
/// assert!(!secret.as_str().contains("sk_live"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(CompactString);

impl Key {
    /// A key from a string; strings longer than [`MAX_KEY_LEN`] bytes are hashed, to
    /// `long:` and a digest (and so is a string that begins with `long:`, so that no
    /// string spells out a long one's digest and lands in its bucket). So a hashed key's
    /// string (from a log line) names another key: reach its bucket with the long string
    /// it came from.
    pub fn new(value: impl AsRef<str>) -> Self {
        let value = value.as_ref();
        if hashed_whole(value) {
            return Self::long(value);
        }
        Key(CompactString::new(value))
    }

    /// `long:` and the whole SHA-256 digest of `value` under a salt of the crate's own
    /// (64 hex digits): no [`hashed`](Self::hashed) key (in the namespace `long`, or a
    /// `HeaderKey` of a header named `long`), whose digests are 32 digits, spells one
    /// and lands in its bucket, whatever it hashes.
    #[cold]
    fn long(value: &str) -> Self {
        Self::digest("long", LONG_SALT, value.as_bytes(), 32)
    }

    /// A key from a string already in the crate's inline form (no copy).
    #[inline]
    pub(crate) fn from_compact(value: CompactString) -> Self {
        if hashed_whole(&value) {
            return Self::long(&value);
        }
        Key(value)
    }

    /// `namespace:` followed by a SHA-256 digest of `secret` (128 bits, hex): for API keys
    /// and tokens, which must not reach a store, a log line or a metric label in clear.
    pub fn hashed(namespace: &str, secret: &[u8]) -> Self {
        Self::hashed_with_salt(namespace, b"", secret)
    }

    pub(crate) fn hashed_with_salt(namespace: &str, salt: &[u8], secret: &[u8]) -> Self {
        Self::digest(namespace, salt, secret, 16)
    }

    /// `namespace:` and the first `bytes` bytes of the SHA-256 digest of `salt` then
    /// `secret`, in hex.
    fn digest(namespace: &str, salt: &[u8], secret: &[u8], bytes: usize) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(salt);
        hasher.update(secret);
        let digest = hasher.finalize();
        let mut out = CompactString::with_capacity(namespace.len() + 1 + 2 * bytes);
        out.push_str(namespace);
        out.push(':');
        for byte in &digest[..bytes] {
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        Key(out)
    }

    /// The identity as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The salt of a long key's digest (see [`Key::long`]).
const LONG_SALT: &[u8] = b"tollgate: a key too long to keep\0";

/// Whether a key string is kept as its digest: over [`MAX_KEY_LEN`], or in the form a
/// digest of one takes.
#[inline]
fn hashed_whole(value: &str) -> bool {
    value.len() > MAX_KEY_LEN || value.starts_with("long:")
}

/// A `tchar` of RFC 9110 (section 5.6.2): a byte a `token` may hold.
pub(crate) fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for Key {
    fn from(value: String) -> Self {
        Key::new(value)
    }
}

impl From<&str> for Key {
    fn from(value: &str) -> Self {
        Key::new(value)
    }
}

impl std::ops::Deref for Key {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// Who is at fault when no key could be extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyErrorKind {
    /// The request lacks what the extractor needs (a header), or carries it in a form the
    /// extractor refuses: answered 400.
    Client,
    /// The server is set up wrong (no peer address, no extension from the auth
    /// middleware): answered 500.
    Server,
}

/// Why no key could be extracted from a request: whose fault it is ([`kind`](Self::kind))
/// and whether the key was absent or invalid ([`is_missing`](Self::is_missing)).
///
/// Only an absent key lets [`or`](KeyExtractorExt::or) try its fallback (and
/// [`MissingKey::Allow`](crate::MissingKey::Allow) let the request through); an invalid
/// key, or a server set up wrong, is answered as it is.
///
/// ```
/// use tollgate::key::{KeyError, KeyErrorKind};
///
/// let absent = KeyError::missing(KeyErrorKind::Client, "missing header x-api-key");
/// assert_eq!(absent.kind(), KeyErrorKind::Client);
/// assert!(absent.is_missing());
/// assert_eq!(absent.to_string(), "missing header x-api-key");
///
/// let invalid = KeyError::client("several x-api-key headers");
/// assert_eq!(invalid.kind(), KeyErrorKind::Client);
/// assert!(!invalid.is_missing());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    kind: KeyErrorKind,
    missing: bool,
    reason: Cow<'static, str>,
}

impl KeyError {
    /// The client sent a key the extractor refuses (repeated, empty, malformed): answered
    /// 400, and no fallback is tried.
    pub fn client(reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind: KeyErrorKind::Client,
            missing: false,
            reason: reason.into(),
        }
    }

    /// The server is misconfigured: answered 500, and no fallback is tried.
    pub fn server(reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind: KeyErrorKind::Server,
            missing: false,
            reason: reason.into(),
        }
    }

    /// The request carries no key at all (no such header, no identity from the auth
    /// layer): a fallback chained with [`or`](KeyExtractorExt::or) is tried. Without one
    /// it is answered by `kind`: [`KeyErrorKind::Client`] for something the client should
    /// have sent (400), [`KeyErrorKind::Server`] for something the server should have set
    /// (500).
    pub fn missing(kind: KeyErrorKind, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            missing: true,
            reason: reason.into(),
        }
    }

    /// Whose fault it is.
    pub fn kind(&self) -> KeyErrorKind {
        self.kind
    }

    /// Whether the key was absent (see [`missing`](Self::missing)), rather than present
    /// but invalid or impossible to find because the server is set up wrong.
    pub fn is_missing(&self) -> bool {
        self.missing
    }

    /// The reason, for logs and the problem body.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for KeyError {}

/// Extracts the identity of a request from its head.
///
/// ```
/// use http::Request;
/// use tollgate::key::{KeyExtractor, Route};
///
/// let (parts, _) = Request::get("/health").body(()).unwrap().into_parts();
/// assert_eq!(Route.extract(&parts).unwrap().as_str(), "route:GET /health");
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The request's identity, or why there is none.
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError>;

    /// How this extractor finds the client's address, when it reads one: a
    /// `Bypass` by network that is given none reads the address
    /// the same way (behind a proxy, the forwarded client's, not the proxy's). `None` by
    /// default.
    ///
    /// [`ClientIp`] answers itself; [`or`](KeyExtractorExt::or) and tuples answer with
    /// the first of their parts that reads an address; the others answer `None`.
    ///
    /// ```
    /// use std::net::{IpAddr, SocketAddr};
    /// use http::Request;
    /// use tollgate::key::{ClientIp, HeaderKey, KeyExtractor, KeyExtractorExt, Route};
    ///
    /// assert!(HeaderKey::new("x-api-key").client_ip().is_none());
    /// assert!(Route.client_ip().is_none());
    ///
    /// let key = HeaderKey::new("x-api-key").or(ClientIp::behind_proxies(["10.0.0.0/8"])?);
    /// let found = key.client_ip().expect("the fallback reads the address");
    /// // It reads the address behind the proxy, as the key does.
    /// let mut request = Request::get("/")
    ///     .header("x-forwarded-for", "203.0.113.7")
    ///     .body(())
    ///     .unwrap();
    /// request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 2], 443)));
    /// let (parts, _) = request.into_parts();
    /// assert_eq!(found.client_addr(&parts).unwrap(), IpAddr::from([203, 0, 113, 7]));
    /// assert!((Route, ClientIp::peer()).client_ip().is_some());
    /// # Ok::<(), tollgate::key::InvalidProxy>(())
    /// ```
    fn client_ip(&self) -> Option<&ClientIp> {
        None
    }
}

impl<T: KeyExtractor + ?Sized> KeyExtractor for Arc<T> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        (**self).extract(parts)
    }

    fn client_ip(&self) -> Option<&ClientIp> {
        (**self).client_ip()
    }
}

impl<T: KeyExtractor + ?Sized> KeyExtractor for Box<T> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        (**self).extract(parts)
    }

    fn client_ip(&self) -> Option<&ClientIp> {
        (**self).client_ip()
    }
}

/// Combinators for every [`KeyExtractor`].
pub trait KeyExtractorExt: KeyExtractor + Sized {
    /// This extractor, or `fallback` when this one's key is absent:
    /// `user.or(api_key).or(ip)`.
    ///
    /// Only an absent key ([`KeyError::is_missing`]) falls through. A key that is present
    /// but invalid (two `x-api-key` headers, an empty one, one that is not visible ASCII)
    /// is the client's error and is returned as it is, as is a server misconfiguration:
    /// otherwise a client could leave its own budget for the fallback's by sending a
    /// malformed key.
    ///
    /// ```
    /// use http::Request;
    /// use tollgate::key::{HeaderKey, KeyErrorKind, KeyExtractor, KeyExtractorExt, Global};
    ///
    /// let key = HeaderKey::new("x-api-key").or(Global);
    /// let (parts, _) = Request::get("/").body(()).unwrap().into_parts();
    /// assert_eq!(key.extract(&parts).unwrap().as_str(), "global");
    ///
    /// let (parts, _) = Request::get("/")
    ///     .header("x-api-key", "sk_live_alpha")
    ///     .header("x-api-key", "sk_live_beta")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let error = key.extract(&parts).unwrap_err();
    /// assert_eq!(error.kind(), KeyErrorKind::Client); // a 400, not the global bucket
    /// ```
    fn or<B: KeyExtractor>(self, fallback: B) -> FirstOf<Self, B> {
        FirstOf {
            first: self,
            fallback,
            unseen: Arc::default(),
        }
    }
}

impl<T: KeyExtractor> KeyExtractorExt for T {}

/// The first extractor's key, or the fallback's when the first one's is absent; see
/// [`KeyExtractorExt::or`].
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollgate::key::{ClientIp, FirstOf, HeaderKey, KeyExtractor, KeyExtractorExt};
///
/// let key: FirstOf<HeaderKey, ClientIp> = HeaderKey::new("x-api-key").or(ClientIp::peer());
/// let request = |api_key: Option<&str>| {
///     let mut request = Request::get("/");
///     if let Some(api_key) = api_key {
///         request = request.header("x-api-key", api_key);
///     }
///     let mut request = request.body(()).unwrap();
///     request.extensions_mut().insert(SocketAddr::from(([203, 0, 113, 7], 40000)));
///     request.into_parts().0
/// };
/// assert!(key.extract(&request(Some("sk_live_1")))?.as_str().starts_with("x-api-key:"));
/// assert_eq!(key.extract(&request(None))?.as_str(), "ip:203.0.113.7");
/// # Ok::<(), tollgate::key::KeyError>(())
/// ```
///
/// A first extractor whose key is missing for want of what the server sets (an
/// `ExtensionKey` whose middleware runs after the limiter: in axum, a layer added before
/// the limiter's) would key every request by the fallback, with no error anywhere: when
/// the first hundred requests all fall back so, and none had the first key, it is said
/// once at warn level, as a possibility (an app whose first hundred requests are
/// anonymous hears it too).
#[derive(Debug, Clone)]
pub struct FirstOf<A, B> {
    first: A,
    fallback: B,
    unseen: Arc<Unseen>,
}

/// Whether a [`FirstOf`]'s first key has ever been found, and how many requests fell back
/// for want of what the server sets before it was.
#[derive(Debug, Default)]
struct Unseen {
    found: std::sync::atomic::AtomicBool,
    missed: std::sync::atomic::AtomicU32,
}

/// Requests in a row from the start that fell back for want of what the server sets,
/// none with the first key, after which that is said.
const SAY_UNSEEN_AFTER: u32 = 100;

impl Unseen {
    #[inline]
    fn found(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        // One load once it is known: no write to a shared line per request.
        if !self.found.load(Relaxed) {
            self.found.store(true, Relaxed);
        }
    }

    #[cold]
    fn missed(&self, error: &KeyError) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.found.load(Relaxed) || self.missed.load(Relaxed) >= SAY_UNSEEN_AFTER {
            return;
        }
        if self.missed.fetch_add(1, Relaxed) + 1 == SAY_UNSEEN_AFTER {
            #[cfg(feature = "tracing")]
            tracing::warn!(
                target: "tollgate",
                %error,
                "the first {SAY_UNSEEN_AFTER} requests had no key of the first extractor of an \
                 `or`, for want of what the server sets, and were keyed by the fallback. If \
                 requests that should have it (signed-in ones) were among them, the \
                 middleware that sets it runs after the rate limiter and every request is \
                 keyed by the fallback: make it run first (with axum's Router::layer, add it \
                 after the limiter's layer; in a ServiceBuilder, before it). Anonymous \
                 traffic alone needs nothing (said once)"
            );
            #[cfg(not(feature = "tracing"))]
            let _ = error;
        }
    }
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for FirstOf<A, B> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        match self.first.extract(parts) {
            Ok(key) => {
                self.unseen.found();
                Ok(key)
            }
            Err(error) if error.is_missing() => {
                if error.kind() == KeyErrorKind::Server {
                    self.unseen.missed(&error);
                }
                self.fallback.extract(parts)
            }
            invalid => invalid,
        }
    }

    fn client_ip(&self) -> Option<&ClientIp> {
        self.first.client_ip().or_else(|| self.fallback.client_ip())
    }
}

/// One key for every request: a global limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Result<Key, KeyError> {
        Ok(Key(CompactString::const_new("global")))
    }
}

/// The route: method and matched path (`route:GET /users/{id}`); a `HEAD` shares its
/// `GET`'s key, as it runs the GET handler, and so does an extended CONNECT (RFC 8441:
/// HTTP/2's and HTTP/3's WebSocket opening, a `GET` with `Upgrade` in HTTP/1.1); methods beyond RFC 9110's and `PATCH`
/// (RFC 5789) (any token a client makes up, which a route served by `any(..)` runs all
/// the same) share one, `route:* /users/{id}`.
///
/// With the `axum` feature and the layer added by `Router::layer` or `route_layer`, the
/// path is axum's `MatchedPath` (the route template), so `/users/1` and `/users/2` share
/// one key. Elsewhere it is the request path: combine it with another extractor, since
/// clients choose paths. That includes, under `Router::layer`, the router's fallback and
/// services nested with `nest_service`: axum sets no `MatchedPath` for either (and tells
/// them apart by a type of its own), so each path they serve is a key of its own: the
/// whole path the client sent, prefix included, also for a layer inside a nested service
/// (axum's `OriginalUri`), so `/v1/search` and `/v2/search` never share one. Give a
/// fallback that serves many paths (a proxy) a layer keyed otherwise, or key by the
/// client alone there.
///
/// A tonic service merged into an axum router is one route, `/pkg.Service/{*rest}`:
/// every method of the service shares its key there, where under tonic's own
/// `Server::builder().layer(..)` (no template) each method is keyed by its path.
/// (`PerRoute` prices methods apart either way; it reads the listed paths, while a key
/// by the request's own path under a wildcard would be a fresh budget per made-up path.)
#[derive(Debug, Clone, Copy, Default)]
pub struct Route;

impl KeyExtractor for Route {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        let path = route_path(parts);
        // A HEAD runs the GET handler (RFC 9110, section 9.3.2), and so does an extended
        // CONNECT (see `runs_as_get`): one limit for each route's GET. A method is any
        // token the client writes: beyond the standard ones, one key.
        let method = match parts.method {
            _ if runs_as_get(parts) => Method::GET.as_str(),
            Method::GET
            | Method::POST
            | Method::PUT
            | Method::DELETE
            | Method::PATCH
            | Method::OPTIONS
            | Method::TRACE
            | Method::CONNECT => parts.method.as_str(),
            _ => "*",
        };
        let mut key = CompactString::with_capacity(7 + method.len() + path.len());
        key.push_str("route:");
        key.push_str(method);
        key.push(' ');
        key.push_str(path);
        Ok(Key::new(key))
    }
}

/// A request the route's GET handler answers, though its method is not GET: a `HEAD`
/// (RFC 9110, section 9.3.2), and an extended CONNECT (RFC 8441, section 4; RFC 9220),
/// HTTP/2's and HTTP/3's way to open what HTTP/1.1 opens with a GET and `Upgrade` (a
/// WebSocket; axum serves both through one `any` route). An extended CONNECT is told
/// by its path, and only over HTTP/2 or later: a classic CONNECT names an authority only
/// (RFC 9110, section 9.3.6; h2 refuses one with a `:path` and no `:protocol`), while an
/// HTTP/1.1 CONNECT with a path is a CONNECT all the same, body and all. Keys and costs
/// treat an extended CONNECT as the GET it stands for, so that the protocol a client
/// picks picks neither a second limit nor a cheaper price.
pub(crate) fn runs_as_get(parts: &Parts) -> bool {
    parts.method == Method::HEAD
        || (parts.method == Method::CONNECT
            && parts.version >= http::Version::HTTP_2
            && !parts.uri.path().is_empty())
}

/// The request's path as the client sent it: inside a router nested at a prefix, axum
/// takes the prefix off the URI and keeps the whole one as `OriginalUri`.
pub(crate) fn original_path(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return original.path();
    }
    parts.uri.path()
}

/// The route template when axum matched one, else the request path, whole (a layer
/// inside a service nested at a prefix sees the URI with the prefix taken off: two
/// nested services' paths would be one).
pub(crate) fn route_path(parts: &Parts) -> &str {
    matched_path(parts).unwrap_or_else(|| original_path(parts))
}

/// The route template axum matched, if any (none for a fallback, a service nested with
/// `nest_service`, or without the `axum` feature).
pub(crate) fn matched_path(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(matched.as_str());
    }
    #[cfg(not(feature = "axum"))]
    let _ = parts;
    None
}

/// A key extractor from a closure; see [`from_fn`].
///
/// ```
/// use http::Request;
/// use tollgate::key::{self, FromFn, KeyError, KeyExtractor};
/// use tollgate::{Key, MemoryStore, RateLimitLayer};
///
/// // The first path segment: `/acme/orders` is tenant `acme`. Only a plain name is a
/// // tenant: axum's `Path` decodes `/%61cme/orders` to `acme` too, and a key of the
/// // segment as written would give each spelling of one tenant a limit of its own.
/// let by_tenant: FromFn<_> = key::from_fn(|parts| {
///     let plain = |name: &str| {
///         !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
///     };
///     match parts.uri.path().split('/').nth(1) {
///         Some(tenant) if plain(tenant) => Ok(Key::new(format!("tenant:{tenant}"))),
///         _ => Err(KeyError::client("no tenant in the path")),
///     }
/// });
/// let (parts, _) = Request::get("/acme/orders").body(()).unwrap().into_parts();
/// assert_eq!(by_tenant.extract(&parts)?.as_str(), "tenant:acme");
/// let (root, _) = Request::get("/").body(()).unwrap().into_parts();
/// assert!(by_tenant.extract(&root).is_err());
/// let (escaped, _) = Request::get("/%61cme/orders").body(()).unwrap().into_parts();
/// assert!(by_tenant.extract(&escaped).is_err());
/// let layer = RateLimitLayer::new(MemoryStore::new()).key(by_tenant);
/// # let _ = layer;
/// # Ok::<(), KeyError>(())
/// ```
#[derive(Clone)]
pub struct FromFn<F> {
    f: F,
}

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FromFn")
    }
}

/// A key extractor from a closure over the request head.
///
/// ```
/// use http::Request;
/// use tollgate::key::{self, KeyError, KeyErrorKind, KeyExtractor};
/// use tollgate::Key;
///
/// // The tenant an authentication layer further out checked and put in the request's
/// // extensions: never a header or a host the client writes as it likes (and an
/// // HTTP/1.1 request's URI has no host at all). `ExtensionKey` does this for any type.
/// #[derive(Clone)]
/// struct Tenant(String);
///
/// let tenant = key::from_fn(|parts| {
///     parts.extensions.get::<Tenant>()
///         .map(|Tenant(name)| Key::new(format!("tenant:{name}")))
///         .ok_or_else(|| KeyError::missing(KeyErrorKind::Server, "no tenant: is the auth layer outside?"))
/// });
/// let mut request = Request::get("/orders").body(()).unwrap();
/// request.extensions_mut().insert(Tenant("acme".to_owned()));
/// assert_eq!(tenant.extract(&request.into_parts().0).unwrap().as_str(), "tenant:acme");
/// let (anonymous, _) = Request::get("/orders").body(()).unwrap().into_parts();
/// assert_eq!(tenant.extract(&anonymous).unwrap_err().kind(), KeyErrorKind::Server);
/// ```
pub fn from_fn<F>(f: F) -> FromFn<F>
where
    F: Fn(&Parts) -> Result<Key, KeyError> + Send + Sync + 'static,
{
    FromFn { f }
}

impl<F> KeyExtractor for FromFn<F>
where
    F: Fn(&Parts) -> Result<Key, KeyError> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        (self.f)(parts)
    }
}

/// Joins parts so that no two different tuples give the same key: each part is written
/// as `length#part`.
fn compound<'a>(parts: impl IntoIterator<Item = &'a Key>) -> Key {
    let mut out = CompactString::default();
    for part in parts {
        out.push_str(itoa::Buffer::new().format(part.len()));
        out.push('#');
        out.push_str(part);
    }
    Key::new(out)
}

macro_rules! tuple_extractor {
    ($($name:ident),+) => {
        /// A compound key: every extractor must find its part. The key is absent (and a
        /// fallback may be tried) only when no part is invalid and some part is absent.
        ///
        /// Each part is written as its length in bytes, `#`, and the part, so no two
        /// different tuples give one key, whatever separators their parts hold.
        ///
        /// ```
        /// use http::Request;
        /// use tollgate::key::{self, HeaderKey, KeyExtractor, Route};
        /// use tollgate::Key;
        ///
        /// let (parts, _) = Request::get("/a").body(()).unwrap().into_parts();
        /// assert_eq!((Route, key::Global).extract(&parts)?.as_str(), "12#route:GET /a6#global");
        ///
        /// // Parts that shift a `#` from one to the other still give two keys.
        /// let fixed = |text: &'static str| key::from_fn(move |_| Ok(Key::new(text)));
        /// let left = (fixed("a#1"), fixed("b")).extract(&parts)?;
        /// let right = (fixed("a"), fixed("1#b")).extract(&parts)?;
        /// assert_eq!(left.as_str(), "3#a#11#b");
        /// assert_eq!(right.as_str(), "1#a3#1#b");
        /// assert_ne!(left, right);
        ///
        /// // Every part must be found: no API key, no compound key (a missing one).
        /// let error = (Route, HeaderKey::new("x-api-key")).extract(&parts).unwrap_err();
        /// assert!(error.is_missing());
        /// # Ok::<(), tollgate::key::KeyError>(())
        /// ```
        impl<$($name: KeyExtractor),+> KeyExtractor for ($($name,)+) {
            #[allow(non_snake_case)]
            fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
                let ($($name,)+) = self;
                let mut absent: Option<KeyError> = None;
                let found = [$(
                    match $name.extract(parts) {
                        Ok(key) => Some(key),
                        Err(error) if error.is_missing() => {
                            absent.get_or_insert(error);
                            None
                        }
                        Err(error) => return Err(error),
                    }
                ),+];
                match absent {
                    Some(error) => Err(error),
                    None => Ok(compound(found.iter().flatten())),
                }
            }

            #[allow(non_snake_case)]
            fn client_ip(&self) -> Option<&ClientIp> {
                let ($($name,)+) = self;
                None$(.or_else(|| $name.client_ip()))+
            }
        }
    };
}

tuple_extractor!(A, B);
tuple_extractor!(A, B, C);
tuple_extractor!(A, B, C, D);

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    /// A HEAD is answered by the route's GET handler (RFC 9110, section 9.3.2; axum
    /// routes it so): it shares the GET's key, so a route's limit cannot be had twice.
    #[test]
    fn a_head_shares_its_gets_route_key() {
        let key = |method: http::Method| {
            let request = http::Request::builder()
                .method(method)
                .uri("/export")
                .body(())
                .unwrap();
            Route.extract(&request.into_parts().0).unwrap().to_string()
        };
        assert_eq!(key(http::Method::HEAD), "route:GET /export");
        assert_eq!(key(http::Method::GET), "route:GET /export");
        assert_eq!(key(http::Method::POST), "route:POST /export");
    }

    /// HTTP/2 and HTTP/3 open a WebSocket with an extended CONNECT (RFC 8441, section
    /// 4; RFC 9220): a CONNECT with a `:path`, where HTTP/1.1 sends a GET with `Upgrade`,
    /// to the same handler (axum's `any` route). A client that picks the protocol must
    /// not pick a second limit; a classic CONNECT (authority only) keeps its own key.
    #[test]
    fn an_extended_connect_shares_its_gets_route_key() {
        let key = |method: http::Method, uri: &str, version: http::Version| {
            let request = http::Request::builder()
                .method(method)
                .uri(uri)
                .version(version)
                .body(())
                .unwrap();
            Route.extract(&request.into_parts().0).unwrap().to_string()
        };
        let h1 = key(http::Method::GET, "/ws", http::Version::HTTP_11);
        assert_eq!(h1, "route:GET /ws");
        for uri in ["https://example.com/ws", "/ws"] {
            for version in [http::Version::HTTP_2, http::Version::HTTP_3] {
                assert_eq!(
                    key(http::Method::CONNECT, uri, version),
                    h1,
                    "{uri} {version:?}"
                );
            }
        }
        assert_eq!(
            key(
                http::Method::CONNECT,
                "example.com:443",
                http::Version::HTTP_11
            ),
            "route:CONNECT "
        );
        // Extended CONNECT is HTTP/2's and HTTP/3's: an HTTP/1.1 CONNECT with a path (or
        // an absolute URI, whose path reads `/`) is a CONNECT, which may carry a body.
        assert_eq!(
            key(http::Method::CONNECT, "/ws", http::Version::HTTP_11),
            "route:CONNECT /ws"
        );
        assert_eq!(
            key(
                http::Method::CONNECT,
                "http://example.com:443",
                http::Version::HTTP_11
            ),
            "route:CONNECT /"
        );
    }

    #[test]
    fn compound_keys_cannot_collide_by_shifting_separators() {
        let a = compound(&[Key::new("a#1"), Key::new("b")]);
        let b = compound(&[Key::new("a"), Key::new("1#b")]);
        assert_ne!(a, b);
    }

    #[test]
    fn long_identities_are_hashed() {
        let key = Key::new("x".repeat(10_000));
        assert_eq!(key.len(), "long:".len() + 64);
        assert!(key.starts_with("long:"));
        assert_eq!(Key::new("x".repeat(10_000)), key);
    }

    /// A request from 203.0.113.7 with these header lines.
    fn request(headers: &[(&str, &[u8])]) -> Parts {
        let mut builder = Request::get("/");
        for (name, value) in headers {
            builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        let mut request = builder.body(()).unwrap();
        request
            .extensions_mut()
            .insert(std::net::SocketAddr::from(([203, 0, 113, 7], 1)));
        request.into_parts().0
    }

    #[test]
    fn or_falls_through_on_an_absent_key_only() {
        let key = HeaderKey::new("x-api-key").or(ClientIp::peer());
        assert_eq!(
            key.extract(&request(&[])).unwrap().as_str(),
            "ip:203.0.113.7"
        );
        let bad: [&[(&str, &[u8])]; 5] = [
            &[("x-api-key", b"alpha"), ("x-api-key", b"beta")],
            &[("x-api-key", b"alpha"), ("x-api-key", b"alpha")],
            &[("x-api-key", b"")],
            &[("x-api-key", b" \t ")],
            &[("x-api-key", b"sk_\xffalpha")],
        ];
        for headers in bad {
            let error = key.extract(&request(headers)).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{headers:?}");
        }
    }

    /// A method is any token, case-sensitive (RFC 9110, section 9.1), and a route
    /// served by `any(..)`, `route_service` or a fallback runs its handler for every one:
    /// `FOO1 /export`, `FOO2 /export`, ... were a bucket each. Methods beyond the
    /// standard ones share one key per route; the standard ones keep theirs.
    #[test]
    fn route_keys_do_not_multiply_with_made_up_methods() {
        let key = |method: &str| {
            let (parts, _) = Request::builder()
                .method(method)
                .uri("/export")
                .body(())
                .unwrap()
                .into_parts();
            Route.extract(&parts).unwrap()
        };
        assert_eq!(key("FOO1"), key("FOO2"));
        assert_eq!(key("get"), key("PROPFIND"));
        assert_eq!(key("HEAD"), key("GET"));
        assert_ne!(key("GET"), key("POST"));
        assert_ne!(key("GET"), key("get"));
        assert_eq!(key("DELETE").as_str(), "route:DELETE /export");
    }

    /// A key over the length bound is hashed to `long:` and a digest: a short key a
    /// client writes (a custom extractor's, from a header) that spells that digest out
    /// landed in the long key's bucket, spending it. A key that begins with `long:` is
    /// hashed too, so no spelling reaches a hashed one.
    #[test]
    fn no_short_key_spells_a_long_ones_digest() {
        let long = "a".repeat(MAX_KEY_LEN + 1);
        let hashed = Key::new(&long);
        assert!(hashed.as_str().starts_with("long:"));
        assert_ne!(Key::new(hashed.as_str()), hashed);
        assert_ne!(Key::from(hashed.as_str().to_owned()), hashed);
        assert_ne!(
            Key::from_compact(CompactString::new(hashed.as_str())),
            hashed
        );
        assert_eq!(Key::new(&long), hashed);
        assert_eq!(Key::new("longer:1").as_str(), "longer:1");
    }

    /// A long key's digest was `Key::hashed("long", ..)` of it: a `HeaderKey` of a header
    /// named `long` (unsalted), or a custom key hashed in the namespace `long`, spelt out
    /// the digest of any long key, another extractor's (a long route, a compound key), and
    /// a client sending that header landed in its bucket.
    #[test]
    fn no_hashed_key_spells_a_long_ones_digest() {
        let long = "a".repeat(MAX_KEY_LEN + 1);
        assert_ne!(Key::hashed("long", long.as_bytes()), Key::new(&long));
        let by_header = crate::key::HeaderKey::new("long").key_for(&long).unwrap();
        assert_ne!(by_header, Key::new(&long));
        // Nor by hashing what the long digest hashes.
        let salted = [LONG_SALT, long.as_bytes()].concat();
        assert_ne!(Key::hashed("long", &salted), Key::new(&long));
    }

    #[test]
    fn or_does_not_hide_a_server_misconfiguration() {
        let (parts, _) = Request::get("/").body(()).unwrap().into_parts();
        let error = ClientIp::peer().or(Global).extract(&parts).unwrap_err();
        assert_eq!(error.kind(), KeyErrorKind::Server);
    }

    #[test]
    fn or_passes_on_an_extension_the_auth_layer_did_not_set() {
        #[derive(Clone)]
        struct User(u32);
        let key = ExtensionKey::new("user", |user: &User| user.0.to_string()).or(ClientIp::peer());
        let mut parts = request(&[]);
        assert_eq!(key.extract(&parts).unwrap().as_str(), "ip:203.0.113.7");
        parts.extensions.insert(User(42));
        assert_eq!(key.extract(&parts).unwrap().as_str(), "user:42");
    }

    #[test]
    fn or_returns_a_custom_client_error_as_is() {
        let refuse = from_fn(|_| Err(KeyError::client("a tenant header that names no tenant")));
        let error = refuse.or(Global).extract(&request(&[])).unwrap_err();
        assert_eq!(error.reason(), "a tenant header that names no tenant");
    }

    #[test]
    fn a_tuple_with_an_invalid_part_is_invalid_even_if_another_is_absent() {
        let pair = (HeaderKey::new("x-tenant"), HeaderKey::new("x-api-key"));
        assert!(pair.extract(&request(&[])).unwrap_err().is_missing());
        let key = pair.or(Global);
        assert_eq!(key.extract(&request(&[])).unwrap().as_str(), "global");
        let error = key
            .extract(&request(&[("x-api-key", b"a"), ("x-api-key", b"b")]))
            .unwrap_err();
        assert_eq!(error.kind(), KeyErrorKind::Client);
        assert!(error.reason().contains("several"), "{error}");
    }

    #[test]
    fn tuples_need_every_part() {
        let (parts, _) = Request::get("/a").body(()).unwrap().into_parts();
        let key = (Route, Global).extract(&parts).unwrap();
        assert_eq!(key.as_str(), "12#route:GET /a6#global");
        assert!(
            (Route, HeaderKey::new("x-api-key"))
                .extract(&parts)
                .is_err()
        );
    }
}
