//! A header that names the client, such as an API key: hashed, never kept in clear.

use http::HeaderName;
use http::request::Parts;

use super::{Key, KeyError, KeyExtractor};

/// Keys requests by a header's value, hashed (`apikey:3f2a…`): API keys and tokens never
/// reach a store, a log line or a metric label in clear.
///
/// A missing or empty header is a client error (400 unless the layer lets it through, or
/// a fallback follows with [`or`](super::KeyExtractorExt::or)). Several lines of the same
/// header are refused too: an auth layer might read another line than the limiter.
///
/// ```
/// use http::Request;
/// use tollgate::key::{HeaderKey, KeyExtractor};
///
/// let api_key = HeaderKey::new("x-api-key");
/// let (parts, _) = Request::get("/").header("x-api-key", "sk_live_123").body(()).unwrap().into_parts();
/// let key = api_key.extract(&parts).unwrap();
/// assert!(key.as_str().starts_with("x-api-key:"));
/// assert!(!key.as_str().contains("sk_live_123"));
/// ```
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
    salt: Vec<u8>,
}

impl HeaderKey {
    /// The header `name`. Panics if `name` is not a valid header name, which is a
    /// programming error caught at start-up.
    pub fn new(name: &'static str) -> Self {
        Self::from_name(HeaderName::from_static(name))
    }

    /// The header `name`.
    pub fn from_name(name: HeaderName) -> Self {
        Self {
            name,
            salt: Vec::new(),
        }
    }

    /// Mixes a server-side secret into the hash, so a leaked store dump cannot be checked
    /// against a list of candidate keys. Every replica must use the same salt.
    pub fn salt(mut self, salt: impl Into<Vec<u8>>) -> Self {
        self.salt = salt.into();
        self
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let value = values
            .next()
            .filter(|value| !value.as_bytes().trim_ascii().is_empty())
            .ok_or_else(|| KeyError::client(format!("missing header {}", self.name)))?;
        if values.next().is_some() {
            return Err(KeyError::client(format!("several {} headers", self.name)));
        }
        Ok(Key::hashed_with_salt(
            self.name.as_str(),
            &self.salt,
            value.as_bytes().trim_ascii(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;
    use crate::key::KeyErrorKind;

    fn extract(key: &HeaderKey, values: &[&[u8]]) -> Result<Key, KeyError> {
        let mut builder = Request::get("/");
        for value in values {
            builder = builder.header("x-api-key", http::HeaderValue::from_bytes(value).unwrap());
        }
        key.extract(&builder.body(()).unwrap().into_parts().0)
    }

    #[test]
    fn hashes_and_refuses_ambiguity() {
        let key = HeaderKey::new("x-api-key");
        let a = extract(&key, &[b"alpha"]).unwrap();
        assert_eq!(a, extract(&key, &[b" alpha "]).unwrap());
        assert_ne!(a, extract(&key, &[b"beta"]).unwrap());
        assert_ne!(
            a,
            extract(&key.clone().salt("pepper"), &[b"alpha"]).unwrap()
        );
        // Non-UTF-8 bytes are hashed like any others.
        assert!(extract(&key, &[b"\xff\xfe"]).is_ok());
        for bad in [&[][..], &[b"" as &[u8]][..], &[b"a" as &[u8], b"b"][..]] {
            assert_eq!(extract(&key, bad).unwrap_err().kind(), KeyErrorKind::Client);
        }
    }
}
