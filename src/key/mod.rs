//! Key extractors: who is this request? The answer is a [`Key`], the identity whose
//! budget the request spends.
//!
//! Ready extractors: [`ClientIp`] (socket peer, or behind trusted proxies), [`HeaderKey`]
//! (an API key or token, hashed), [`ExtensionKey`] (a user id set by auth middleware),
//! [`Route`], [`Global`], tuples of extractors (compound keys), [`KeyExtractorExt::or`]
//! (first that succeeds) and [`from_fn`] (a closure).
//!
//! Extractors see the request's head only ([`http::request::Parts`]), never its body, and
//! know nothing of stores.
//!
//! When no key can be extracted the extractor says why with a [`KeyError`], and the layer
//! answers it (400 when the client left something out, 500 when the server is set up
//! wrong) unless told to let such requests through: a missing key is never a silent bypass.

mod extension;
mod header;
mod ip;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use compact_str::CompactString;
use http::request::Parts;
use sha2::{Digest, Sha256};

pub use extension::ExtensionKey;
pub use header::HeaderKey;
pub use ip::{ClientIp, ForwardedHeader, InvalidProxy};

/// Identities longer than this are hashed, so a hostile 10 KB header costs a store no
/// more than a short one.
pub const MAX_KEY_LEN: usize = 256;

/// An identity: the name of one budget in a store.
///
/// ```
/// use tollgate::Key;
///
/// assert_eq!(Key::new("user:42").as_str(), "user:42");
/// let secret = Key::hashed("apikey", b"sk_live_abc");
/// assert!(secret.as_str().starts_with("apikey:"));
/// assert!(!secret.as_str().contains("sk_live"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(CompactString);

impl Key {
    /// A key from a string; strings longer than [`MAX_KEY_LEN`] bytes are hashed.
    pub fn new(value: impl Into<CompactString>) -> Self {
        let value = value.into();
        if value.len() > MAX_KEY_LEN {
            return Self::hashed("long", value.as_bytes());
        }
        Key(value)
    }

    /// `namespace:` followed by a SHA-256 digest of `secret` (128 bits, hex): for API keys
    /// and tokens, which must not reach a store, a log line or a metric label in clear.
    pub fn hashed(namespace: &str, secret: &[u8]) -> Self {
        Self::hashed_with_salt(namespace, b"", secret)
    }

    pub(crate) fn hashed_with_salt(namespace: &str, salt: &[u8], secret: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(salt);
        hasher.update(secret);
        let digest = hasher.finalize();
        let mut out = CompactString::with_capacity(namespace.len() + 33);
        out.push_str(namespace);
        out.push(':');
        for byte in &digest[..16] {
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
pub enum KeyErrorKind {
    /// The request lacks what the extractor needs (a header): answered 400.
    Client,
    /// The server is set up wrong (no peer address, no extension from the auth
    /// middleware): answered 500.
    Server,
}

/// Why no key could be extracted from a request.
///
/// ```
/// use tollgate::key::{KeyError, KeyErrorKind};
///
/// let err = KeyError::client("missing header x-api-key");
/// assert_eq!(err.kind(), KeyErrorKind::Client);
/// assert_eq!(err.to_string(), "missing header x-api-key");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    kind: KeyErrorKind,
    reason: Cow<'static, str>,
}

impl KeyError {
    /// The client left something out.
    pub fn client(reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind: KeyErrorKind::Client,
            reason: reason.into(),
        }
    }

    /// The server is misconfigured.
    pub fn server(reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind: KeyErrorKind::Server,
            reason: reason.into(),
        }
    }

    /// Whose fault it is.
    pub fn kind(&self) -> KeyErrorKind {
        self.kind
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
}

impl<T: KeyExtractor + ?Sized> KeyExtractor for Arc<T> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        (**self).extract(parts)
    }
}

impl<T: KeyExtractor + ?Sized> KeyExtractor for Box<T> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        (**self).extract(parts)
    }
}

/// Combinators for every [`KeyExtractor`].
pub trait KeyExtractorExt: KeyExtractor + Sized {
    /// This extractor, or `fallback` when this one finds no key: `user.or(api_key).or(ip)`.
    ///
    /// ```
    /// use http::Request;
    /// use tollgate::key::{HeaderKey, KeyExtractor, KeyExtractorExt, Global};
    ///
    /// let key = HeaderKey::new("x-api-key").or(Global);
    /// let (parts, _) = Request::get("/").body(()).unwrap().into_parts();
    /// assert_eq!(key.extract(&parts).unwrap().as_str(), "global");
    /// ```
    fn or<B: KeyExtractor>(self, fallback: B) -> FirstOf<Self, B> {
        FirstOf {
            first: self,
            fallback,
        }
    }
}

impl<T: KeyExtractor> KeyExtractorExt for T {}

/// The first of two extractors that finds a key; see [`KeyExtractorExt::or`].
#[derive(Debug, Clone)]
pub struct FirstOf<A, B> {
    first: A,
    fallback: B,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for FirstOf<A, B> {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        self.first
            .extract(parts)
            .or_else(|_| self.fallback.extract(parts))
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

/// The route: method and matched path (`route:GET /users/{id}`).
///
/// With the `axum` feature and the layer added by `Router::layer` or `route_layer`, the
/// path is axum's `MatchedPath` (the route template), so `/users/1` and `/users/2` share
/// one key. Elsewhere it is the request path: combine it with another extractor, since
/// clients choose paths.
#[derive(Debug, Clone, Copy, Default)]
pub struct Route;

impl KeyExtractor for Route {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        let path = route_path(parts);
        let mut key = CompactString::with_capacity(7 + parts.method.as_str().len() + path.len());
        key.push_str("route:");
        key.push_str(parts.method.as_str());
        key.push(' ');
        key.push_str(path);
        Ok(Key::new(key))
    }
}

/// The route template when axum matched one, else the request path.
pub(crate) fn route_path(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str();
    }
    parts.uri.path()
}

/// A key extractor from a closure; see [`from_fn`].
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
/// use tollgate::key::{self, KeyError, KeyExtractor};
/// use tollgate::Key;
///
/// let tenant = key::from_fn(|parts| {
///     parts.uri.host().map(|host| Key::new(format!("tenant:{host}")))
///         .ok_or_else(|| KeyError::client("no host in the request URI"))
/// });
/// let (parts, _) = Request::get("http://acme.example/").body(()).unwrap().into_parts();
/// assert_eq!(tenant.extract(&parts).unwrap().as_str(), "tenant:acme.example");
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
fn compound(parts: &[Key]) -> Key {
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
        /// A compound key: every extractor must find its part.
        impl<$($name: KeyExtractor),+> KeyExtractor for ($($name,)+) {
            #[allow(non_snake_case)]
            fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
                let ($($name,)+) = self;
                Ok(compound(&[$($name.extract(parts)?),+]))
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

    #[test]
    fn compound_keys_cannot_collide_by_shifting_separators() {
        let a = compound(&[Key::new("a#1"), Key::new("b")]);
        let b = compound(&[Key::new("a"), Key::new("1#b")]);
        assert_ne!(a, b);
    }

    #[test]
    fn long_identities_are_hashed() {
        let key = Key::new("x".repeat(10_000));
        assert!(key.len() < 64);
        assert!(key.starts_with("long:"));
        assert_eq!(Key::new("x".repeat(10_000)), key);
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
