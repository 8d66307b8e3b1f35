//! A header that names the client, such as an API key: hashed, never kept in clear.

use std::fmt;

use http::HeaderName;
use http::header::InvalidHeaderName;
use http::request::Parts;

use super::{Key, KeyError, KeyErrorKind, KeyExtractor};

/// Keys requests by a header's value, hashed (`x-api-key:3f2a…`): API keys and tokens
/// never reach a store, a log line or a metric label in clear.
///
/// A missing header is an absent key: a client error (400) unless a fallback follows with
/// [`or`](super::KeyExtractorExt::or) or the layer lets such requests through. A header
/// that is present but unusable is an invalid key, a 400 that no fallback hides: several
/// lines of it (an auth layer might read another line than the limiter), an empty or
/// blank value, or bytes that are not visible ASCII (spaces and tabs inside are kept).
/// `Authorization` and `Proxy-Authorization` are read as one credential however the
/// scheme is spelt: `Bearer abc`, `bearer abc` and `BEARER  abc` are one key (the
/// credentials after the scheme keep their case). A token (`Bearer`'s, or any scheme's
/// `token68`) is one word (RFC 9110, section 11.4; RFC 6750, section 2.1): one followed
/// by more (`Bearer abc 1`, which a server reading the first word takes for `abc`) is a
/// 400, not a bucket of its own, and so is a token beside parameters (`JWT abc x=1`);
/// auth-params (`Digest username="a", ...`) are kept whole.
/// `Basic` credentials are keyed whole, password included, by what they decode to (a
/// spelling without its padding, with other unused trailing bits or in base64url's
/// alphabet is the same key; one that is not base64 is a 400): set a [`salt`](HeaderKey::salt) so a store dump cannot be checked
/// against lists of common passwords (a key without one says so once, at warn level,
/// when it first hashes such credentials), and see
/// [`basic_user_id`](HeaderKey::basic_user_id) to key them by account. `Digest`
/// credentials differ on every request (a fresh nonce count and response), and so do
/// signatures (OAuth 1.0's, Hawk's, AWS's), so each is a key of its own: key such
/// clients by their `username`, key id or access key in a [`from_fn`](super::from_fn)
/// key instead. A header HTTP/2 lets a client split over several lines (`Cookie`, RFC
/// 9113, section 8.2.3) is then several lines, a 400: key by a cookie in a `from_fn` key.
/// gRPC binary metadata (a name ending in `-bin`) is keyed by what its base64 decodes
/// to, padded or not (a value that is not base64 is a 400), as a gRPC server reads it.
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
///
/// # Before authentication, a key is whatever the client says
///
/// A limiter that runs before the API key is checked gives every distinct value its own
/// bucket, so a client that invents a new key for each request is never limited: the
/// keys need not be valid to be counted. `HeaderKey` fits where the header is checked
/// before the limiter or where every value is trusted (an internal caller's name).
///
/// For API keys, limit by the identity the auth layer verified instead, with
/// [`ExtensionKey`](super::ExtensionKey) on the value it stores in the request, falling
/// back to the client's IP for requests it verified nothing for: invented keys then all
/// spend the one IP bucket. The limiter must run after the auth layer (with axum, the
/// auth layer is added last). If the auth layer answers unknown keys `401` itself, the
/// limiter behind it never sees them: put a [`ClientIp`](super::ClientIp) limiter in front
/// of it as well, so guessing keys is limited too.
///
/// ```
/// use std::net::SocketAddr;
/// use std::time::Duration;
/// use axum::{Router, body::Body, extract::Request, middleware::{self, Next}, routing::get};
/// use http::StatusCode;
/// use tower::ServiceExt;
/// use tollgate::key::{ClientIp, ExtensionKey, HeaderKey, KeyExtractorExt};
/// use tollgate::{MemoryStore, Policy, RateLimitLayer};
///
/// /// What the auth layer stores once it has checked an API key.
/// #[derive(Clone)]
/// struct Account { id: u64 }
///
/// // A stand-in for authentication: one known key. Unknown keys go on without an account
/// // (a real handler would then refuse what needs one).
/// async fn auth(mut request: Request, next: Next) -> axum::response::Response {
///     if request.headers().get("x-api-key").is_some_and(|key| key == "sk_live_alpha") {
///         request.extensions_mut().insert(Account { id: 42 });
///     }
///     next.run(request).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let policy = Policy::fixed_window("api", 3, Duration::from_secs(60))?;
/// let routes = || Router::new().route("/", get(|| async { "hello" }));
/// let by_verified_account = routes()
///     .layer(
///         RateLimitLayer::new(MemoryStore::new())
///             .policy(policy.clone())
///             .key(ExtensionKey::new("account", |account: &Account| account.id.to_string())
///                 .or(ClientIp::peer())),
///     )
///     .layer(middleware::from_fn(auth)); // runs first
/// let by_header = routes()
///     .layer(RateLimitLayer::new(MemoryStore::new()).policy(policy).key(HeaderKey::new("x-api-key")))
///     .layer(middleware::from_fn(auth));
///
/// let request = |key: &str| {
///     let mut request = Request::get("/").header("x-api-key", key).body(Body::empty()).unwrap();
///     request.extensions_mut().insert(SocketAddr::from(([203, 0, 113, 7], 40000)));
///     request
/// };
/// let mut statuses = (Vec::new(), Vec::new());
/// for guess in 0..5 {
///     let key = format!("sk_made_up_{guess}");
///     statuses.0.push(by_verified_account.clone().oneshot(request(&key)).await?.status());
///     statuses.1.push(by_header.clone().oneshot(request(&key)).await?.status());
/// }
/// // Invented keys share the client's IP bucket...
/// assert_eq!(statuses.0.iter().filter(|s| **s == StatusCode::OK).count(), 3);
/// // ...but each gets a fresh bucket when keyed by the header before authentication.
/// assert!(statuses.1.iter().all(|s| *s == StatusCode::OK));
/// // The verified account has its own bucket, whatever the IP has spent.
/// let verified = by_verified_account.oneshot(request("sk_live_alpha")).await?;
/// assert_eq!(verified.status(), StatusCode::OK);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct HeaderKey {
    name: HeaderName,
    salt: Vec<u8>,
    basic_user_id: bool,
}

impl fmt::Debug for HeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The salt is a secret: whether there is one, never what it is.
        f.debug_struct("HeaderKey")
            .field("name", &self.name)
            .field("salted", &!self.salt.is_empty())
            .field("basic_user_id", &self.basic_user_id)
            .finish()
    }
}

impl HeaderKey {
    /// The header `name`, in any case: header names are case-insensitive, so
    /// `"X-Api-Key"` and `"x-api-key"` are the same header and give the same keys.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name at all (empty, or with a space, a colon or
    /// another character outside the HTTP token set), which is a programming error caught
    /// at start-up. [`try_new`](Self::try_new) returns the error instead, for names read
    /// from configuration.
    ///
    /// ```
    /// use tollgate::key::HeaderKey;
    ///
    /// let key = HeaderKey::new("X-Api-Key");
    /// assert_eq!(key.header_name(), "x-api-key");
    /// ```
    pub fn new(name: &str) -> Self {
        match Self::try_new(name) {
            Ok(key) => key,
            Err(_) => panic!(
                "HeaderKey::new: {name:?} is not a valid header name (letters, digits and \
                 !#$%&'*+-.^_`|~ only)"
            ),
        }
    }

    /// The header `name`, in any case, or an error if it is not a valid header name.
    ///
    /// ```
    /// use tollgate::key::HeaderKey;
    ///
    /// assert_eq!(HeaderKey::try_new("X-Tenant")?.header_name(), "x-tenant");
    /// assert!(HeaderKey::try_new("x tenant").is_err());
    /// # Ok::<(), http::header::InvalidHeaderName>(())
    /// ```
    pub fn try_new(name: &str) -> Result<Self, InvalidHeaderName> {
        HeaderName::from_bytes(name.as_bytes()).map(Self::from_name)
    }

    /// The header `name`.
    ///
    /// ```
    /// use http::Request;
    /// use http::header::AUTHORIZATION;
    /// use tollgate::key::{HeaderKey, KeyExtractor};
    ///
    /// let by_token = HeaderKey::from_name(AUTHORIZATION);
    /// assert_eq!(by_token.header_name(), "authorization");
    /// let key = |credentials: &str| {
    ///     let request = Request::get("/").header(AUTHORIZATION, credentials).body(()).unwrap();
    ///     by_token.extract(&request.into_parts().0)
    /// };
    /// // One token, however the scheme is spelt.
    /// assert_eq!(key("Bearer abc")?, key("bearer abc")?);
    /// assert_ne!(key("Bearer abc")?, key("Bearer xyz")?);
    /// # Ok::<(), tollgate::key::KeyError>(())
    /// ```
    pub fn from_name(name: HeaderName) -> Self {
        Self {
            name,
            salt: Vec::new(),
            basic_user_id: false,
        }
    }

    /// The header read, lowercase: also the namespace of the keys (`x-api-key:3f2a…`).
    pub fn header_name(&self) -> &HeaderName {
        &self.name
    }

    /// Mixes a server-side secret into the hash, so a leaked store dump cannot be checked
    /// against a list of candidate keys. Every replica must use the same salt. Use 16
    /// random bytes or more (the configuration's `key_salt_env` refuses fewer): a short
    /// one can be guessed along with the keys.
    pub fn salt(mut self, salt: impl Into<Vec<u8>>) -> Self {
        self.salt = salt.into();
        self
    }

    /// Keys `Basic` credentials (RFC 7617) of `Authorization` or `Proxy-Authorization`
    /// by their user-id alone, not the whole credential: every password tried for one
    /// account then spends that account's bucket, where by default each guess is a new
    /// key (and its hash holds the password). A `Basic` value that is not base64 of
    /// `user-id:password` is an invalid key (400), not a bucket of its own. Base64
    /// padding is not checked; user-ids keep their case, so where your server matches
    /// them case-insensitively, fold them first in a [`from_fn`](super::from_fn) key.
    ///
    /// For limits on guessing, not for a client's whole budget: anyone who knows a
    /// user-id can spend its bucket, without the password, and lock that account out.
    /// Pair it with a per-IP limit, and charge only failures (with
    /// `Settle::reserved()` and `refund_if` on every
    /// status but `401`). Never where the user-id is fixed and the password is a token
    /// (`api:<key>`, `x-access-token:<token>`): every client would share one bucket. Never
    /// for a bypass key (`Bypass::key`) either: the key is the user-id, so
    /// any password would skip limiting, guesses at that account's password included.
    ///
    /// ```
    /// use http::Request;
    /// use tollgate::key::{HeaderKey, KeyExtractor};
    ///
    /// let by_account = HeaderKey::new("authorization").basic_user_id();
    /// let key = |credentials: &str| {
    ///     let request = Request::get("/").header("authorization", credentials).body(()).unwrap();
    ///     by_account.extract(&request.into_parts().0)
    /// };
    /// // alice:hunter2 and alice:letmein: one account, one bucket.
    /// assert_eq!(key("Basic YWxpY2U6aHVudGVyMg==")?, key("Basic YWxpY2U6bGV0bWVpbg==")?);
    /// assert!(key("Basic not-base64!").is_err());
    /// # Ok::<(), tollgate::key::KeyError>(())
    /// ```
    pub fn basic_user_id(mut self) -> Self {
        self.basic_user_id = true;
        self
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Err(KeyError::missing(
                KeyErrorKind::Client,
                format!("missing header {}", self.name),
            ));
        };
        if values.next().is_some() {
            return Err(KeyError::client(format!("several {} headers", self.name)));
        }
        self.key_of(value.as_bytes())
    }
}

impl HeaderKey {
    /// The key this extractor gives a request whose header holds `value`, or the error
    /// it answers such a request with: for a `Bypass` list, a
    /// `reset` or a `peek` of one client. The key is hashed (and salted) as requests'
    /// keys are, and an `Authorization` credential read as one spelling; a `Key::hashed`
    /// of the value matches neither a salted key nor a credential spelt otherwise.
    ///
    /// ```
    /// use tollgate::Key;
    /// use tollgate::bypass::Bypass;
    /// use tollgate::key::HeaderKey;
    ///
    /// let key = HeaderKey::new("x-api-key").salt(b"fleet secret".to_vec());
    /// let monitoring = key.key_for("monitoring-token")?;
    /// assert_ne!(monitoring, Key::hashed("x-api-key", b"monitoring-token"));
    /// let bypass = Bypass::new().key(monitoring);
    /// # let _ = bypass;
    /// # Ok::<(), tollgate::key::KeyError>(())
    /// ```
    pub fn key_for(&self, value: impl AsRef<[u8]>) -> Result<Key, KeyError> {
        self.key_of(value.as_ref())
    }

    fn key_of(&self, value: &[u8]) -> Result<Key, KeyError> {
        let value = value.trim_ascii();
        if value.is_empty() {
            return Err(KeyError::client(format!("empty header {}", self.name)));
        }
        if !value
            .iter()
            .all(|&byte| byte == b'\t' || (b' '..=b'~').contains(&byte))
        {
            return Err(KeyError::client(format!(
                "header {} is not visible ASCII",
                self.name
            )));
        }
        if self.name == http::header::AUTHORIZATION
            || self.name == http::header::PROXY_AUTHORIZATION
        {
            let credentials = credentials(value);
            if let Some(encoded) = credentials.strip_prefix(b"Basic ") {
                let decoded = lenient_base64(encoded);
                if self.basic_user_id {
                    let Some(user) = decoded.and_then(basic_user) else {
                        return Err(KeyError::client(format!(
                            "{} holds Basic credentials that are not base64 of \
                             user-id:password",
                            self.name
                        )));
                    };
                    let account = [&b"Basic "[..], &user, b":"].concat();
                    return Ok(Key::hashed_with_salt(
                        self.name.as_str(),
                        &self.salt,
                        &account,
                    ));
                }
                let Some(decoded) = decoded else {
                    return Err(KeyError::client(format!(
                        "{} holds Basic credentials that are not base64",
                        self.name
                    )));
                };
                if self.salt.is_empty() {
                    unsalted_passwords(&self.name);
                }
                // One spelling for every spelling a lenient server decodes alike: the
                // padded one without trailing bits, which a well-formed client sends.
                use base64::Engine;
                let mut credential = String::from("Basic ");
                base64::engine::general_purpose::STANDARD.encode_string(decoded, &mut credential);
                return Ok(Key::hashed_with_salt(
                    self.name.as_str(),
                    &self.salt,
                    credential.as_bytes(),
                ));
            }
            if token_followed_by_more(&credentials) {
                return Err(KeyError::client(format!(
                    "{} holds a token followed by more (credentials are one token68 or \
                     auth-params, RFC 9110 section 11.4)",
                    self.name
                )));
            }
            return Ok(Key::hashed_with_salt(
                self.name.as_str(),
                &self.salt,
                &credentials,
            ));
        }
        if self.name.as_str().ends_with("-bin") {
            // gRPC binary metadata: base64, padded or not, whose unused trailing bits a
            // server ignores. Keyed by the spelling clients emit (un-padded), so one
            // value is one key however it is spelt. Values joined with commas are
            // several (a server splits them before decoding), as several lines are.
            if value.contains(&b',') {
                return Err(KeyError::client(format!(
                    "several {} values (binary metadata joined with commas)",
                    self.name
                )));
            }
            let Some(decoded) = lenient_base64(value) else {
                return Err(KeyError::client(format!(
                    "header {} is gRPC binary metadata (a name ending in -bin) and its \
                     value is not base64",
                    self.name
                )));
            };
            use base64::Engine;
            let canonical = base64::engine::general_purpose::STANDARD_NO_PAD.encode(decoded);
            return Ok(Key::hashed_with_salt(
                self.name.as_str(),
                &self.salt,
                canonical.as_bytes(),
            ));
        }
        Ok(Key::hashed_with_salt(self.name.as_str(), &self.salt, value))
    }
}

/// Whether `credentials` (a scheme, one space, what follows: see [`credentials`]) are a
/// token followed by more: `Bearer abc 1`, `JWT abc, x`, `JWT abc x=1`. After the scheme,
/// RFC 9110 (section 11.4) allows one `token68`, or auth-params, each `name=value`; a
/// server reading one word of it (`Bearer abc 1` as `abc`, or `Token n=1 abc` as its
/// last word) would take every such value for one token, which kept whole would be a
/// bucket each.
/// - `Bearer` and `DPoP` take one `b64token` (RFC 6750 section 2.1; RFC 9449 section
///   7.1), never auth-params: a space, a tab or a comma anywhere after the scheme is
///   more than a token.
/// - Another scheme may take auth-params (Digest's, OAuth 1.0's, AWS's signature
///   fields): one word is kept whole, and more than one word must be an auth-param list
///   (see [`auth_params`]); a token beside parameters is no such list.
fn token_followed_by_more(credentials: &[u8]) -> bool {
    let Some(space) = credentials.iter().position(|&byte| byte == b' ') else {
        return false;
    };
    let (scheme, after) = (&credentials[..space], &credentials[space + 1..]);
    let separator = |byte: &u8| matches!(byte, b' ' | b'\t' | b',');
    if scheme == b"Bearer" || scheme == b"DPoP" {
        return after.iter().any(separator);
    }
    after.iter().any(separator) && !auth_params(after)
}

/// Whether `list` is a list of auth-params (RFC 9110: section 11.4's `auth-param`, `token
/// BWS "=" BWS ( token / quoted-string )`, in section 5.6.1's list, whose empty elements
/// are allowed), without the space around `=` that the RFC calls bad (`abc =1` is a
/// token and more). A value that is no quoted-string is read more leniently than a
/// token, up to a space, a tab or a comma (AWS's signature fields hold `/` and `;`), but
/// it cannot be empty or begin with `=`: `abc==, x=1` is a token68 and a parameter, not
/// a parameter `abc` of value `=`.
fn auth_params(list: &[u8]) -> bool {
    let skip = |at: &mut usize, set: &[u8]| {
        while list.get(*at).is_some_and(|byte| set.contains(byte)) {
            *at += 1;
        }
    };
    let mut at = 0;
    loop {
        skip(&mut at, b" \t,");
        if at == list.len() {
            return true;
        }
        let name = at;
        while list.get(at).copied().is_some_and(super::is_tchar) {
            at += 1;
        }
        // No space around the `=`: RFC 9110 lets a recipient read it (BWS), but no
        // client sends it, and `abc =1` is a token and more to a server reading words.
        if at == name || list.get(at) != Some(&b'=') {
            return false;
        }
        at += 1;
        if list.get(at) == Some(&b'"') {
            at += 1;
            loop {
                match list.get(at) {
                    None => return false,
                    Some(b'"') => break,
                    // A quoted-pair: the escaped byte is taken as it is.
                    Some(b'\\') => at += 2,
                    Some(_) => at += 1,
                }
            }
            at += 1;
        } else {
            let value = at;
            while list
                .get(at)
                .is_some_and(|byte| !matches!(byte, b' ' | b'\t' | b',' | b'"'))
            {
                at += 1;
            }
            if at == value || list[value] == b'=' {
                return false;
            }
        }
        skip(&mut at, b" \t");
        if at < list.len() && list[at] != b',' {
            return false;
        }
    }
}

/// A key hashes `Basic` credentials, passwords included, with no salt: said once per
/// process, at warn level (without the credentials). The hash a store dump or a log line
/// shows can then be checked against lists of common passwords, one fast SHA-256 each.
#[cold]
fn unsalted_passwords(header: &HeaderName) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.load(std::sync::atomic::Ordering::Relaxed)
        || SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        return;
    }
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        header = header.as_str(),
        "a key hashes Basic credentials, passwords included, with no salt: a store dump or \
         a log line can be checked against lists of common passwords (set a server secret: \
         HeaderKey::salt, or key_salt_env in a LimiterConfig; or key by account with \
         HeaderKey::basic_user_id)"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = header;
}

/// `Authorization` credentials as one spelling: the scheme in its registered spelling
/// (`Bearer`, `Basic`, ...; lowercase for others: it is case-insensitive, RFC 9110
/// section 11.1) and one space before the credentials (`1*SP`, section 11.4), which keep
/// their case. A value without credentials after a scheme is kept as it is: it may be a
/// bare key, whose case matters.
fn credentials(value: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let Some(end) = value.iter().position(|&byte| byte == b' ' || byte == b'\t') else {
        return std::borrow::Cow::Borrowed(value);
    };
    let (scheme, rest) = value.split_at(end);
    let rest = rest.trim_ascii_start();
    // The IANA registry of HTTP authentication schemes, as it spells them.
    const REGISTERED: [&str; 14] = [
        "Basic",
        "Bearer",
        "Concealed",
        "Digest",
        "DPoP",
        "GNAP",
        "HOBA",
        "Mutual",
        "Negotiate",
        "OAuth",
        "PrivateToken",
        "SCRAM-SHA-1",
        "SCRAM-SHA-256",
        "vapid",
    ];
    let mut out = match REGISTERED
        .iter()
        .find(|name| name.as_bytes().eq_ignore_ascii_case(scheme))
    {
        Some(name) => name.as_bytes().to_vec(),
        None => scheme.to_ascii_lowercase(),
    };
    out.push(b' ');
    out.extend_from_slice(rest);
    std::borrow::Cow::Owned(out)
}

/// Base64 decoded as leniently as servers read it: `Basic` credentials (RFC 7617, section
/// 2) and gRPC binary metadata. Padding and trailing bits are not checked, and
/// base64url's `-` and `_` are read as `+` and `/` (servers differ: Node's decoder takes
/// either alphabet), so every spelling of one value decodes alike. `None` for a value
/// that is not base64.
fn lenient_base64(credentials: &[u8]) -> Option<Vec<u8>> {
    use base64::Engine;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::Indifferent)
            .with_decode_allow_trailing_bits(true),
    );
    if !credentials.iter().any(|&byte| byte == b'-' || byte == b'_') {
        return LENIENT.decode(credentials).ok();
    }
    let standard: Vec<u8> = credentials
        .iter()
        .map(|&byte| match byte {
            b'-' => b'+',
            b'_' => b'/',
            other => other,
        })
        .collect();
    LENIENT.decode(standard).ok()
}

/// The user-id of decoded `Basic` credentials (`user-id ":" password`, the user-id
/// without a colon). `None` for credentials that hold no colon.
fn basic_user(mut decoded: Vec<u8>) -> Option<Vec<u8>> {
    let colon = decoded.iter().position(|&byte| byte == b':')?;
    decoded.truncate(colon);
    Some(decoded)
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

    /// gRPC binary metadata (a name ending in `-bin`) is base64, and a gRPC server "MUST
    /// accept padded and un-padded values" (PROTOCOL-HTTP2.md, "Custom-Metadata");
    /// grpc-go also ignores the unused trailing bits. Every spelling the server reads as
    /// one value is one key (else one token was up to 32 buckets), and the spelling
    /// clients emit (un-padded, no trailing bits) keeps the key it had. A value that is
    /// no base64 is a 400, as the server would refuse it.
    #[test]
    fn binary_metadata_is_keyed_by_what_it_decodes_to() {
        let key = HeaderKey::new("x-token-bin");
        let canonical = key.key_for("AAE").unwrap();
        for spelling in ["AAE=", "AAF", "AAH=", " AAE "] {
            assert_eq!(key.key_for(spelling).unwrap(), canonical, "{spelling}");
        }
        assert_ne!(key.key_for("AAI").unwrap(), canonical);
        assert_eq!(canonical, Key::hashed_with_salt("x-token-bin", b"", b"AAE"));
        for not_base64 in ["A", "AA*E", "AAE=="] {
            let error = key.key_for(not_base64).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{not_base64}");
            assert!(!error.is_missing());
            assert!(error.to_string().contains("base64"), "{error}");
        }
        // Values joined with commas (PROTOCOL-HTTP2.md: duplicate metadata may be joined
        // so, and binary values are split on ',' before decoding) are several values, a
        // 400 as several lines are, and said so.
        let joined = key.key_for("AAE,AAI").unwrap_err();
        assert!(joined.to_string().contains("several"), "{joined}");
        // Another name's value is kept whole.
        let plain = HeaderKey::new("x-token");
        assert_ne!(
            plain.key_for("AAE=").unwrap(),
            plain.key_for("AAE").unwrap()
        );
    }

    #[test]
    fn header_names_are_case_insensitive() {
        let lower = extract(&HeaderKey::new("x-api-key"), &[b"alpha"]).unwrap();
        for name in ["X-Api-Key", "X-API-KEY", "x-Api-key"] {
            assert_eq!(extract(&HeaderKey::new(name), &[b"alpha"]).unwrap(), lower);
        }
        assert!(lower.as_str().starts_with("x-api-key:"));
    }

    #[test]
    #[should_panic(expected = "is not a valid header name")]
    fn a_name_that_is_no_header_name_panics_clearly() {
        let _ = HeaderKey::new("x api key");
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
        // Only an absent header is a missing key; the rest are invalid.
        let absent = extract(&key, &[]).unwrap_err();
        assert_eq!(absent.kind(), KeyErrorKind::Client);
        assert!(absent.is_missing());
        let invalid: [&[&[u8]]; 6] = [
            &[b""],
            &[b" \t "],
            &[b"a", b"b"],
            &[b"a", b"a"],
            &[b"\xff\xfe"],
            &[b"sk_\x80live"],
        ];
        for bad in invalid {
            let error = extract(&key, bad).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{bad:?}");
            assert!(!error.is_missing(), "{bad:?}");
        }
        // Spaces and tabs inside a value are part of it ("Bearer abc").
        assert!(extract(&key, &[b"Bearer \tabc"]).is_ok());
    }

    /// A salt is a secret: a layer's settings printed with `{:?}` never show it.
    #[test]
    fn the_salt_is_never_printed() {
        let key = HeaderKey::new("x-api-key").salt("pepper-8f2c");
        let printed = format!("{key:?} {key:#?}");
        assert!(printed.contains("x-api-key"), "{printed}");
        assert!(!printed.contains("pepper"), "{printed}");
        // Nor as the numbers of its bytes, as a derived `Debug` of a `Vec<u8>` shows them.
        assert!(!printed.contains("112, 101, 112"), "{printed}");
        assert!(printed.contains("salted: true"), "{printed}");
    }

    /// With `basic_user_id`, `Basic` credentials are keyed by their user-id, never by the
    /// password: each wrong password guessed for one account spends that account's
    /// bucket (keyed by the whole credential, every guess has a fresh one), and no
    /// password is hashed into a key a store dump shows. RFC 7617, section 2:
    /// `user-pass = user-id ":" password`, the user-id without a colon. Every spelling of
    /// one credential names one user-id, and a value that names none is refused, so no
    /// variation of a guess gets a bucket of its own.
    #[test]
    fn basic_credentials_can_be_keyed_by_their_user_not_their_password() {
        use base64::Engine;
        let key = HeaderKey::new("authorization").basic_user_id();
        let raw = |key: &HeaderKey, value: &str| {
            let request = Request::get("/")
                .header("authorization", value)
                .body(())
                .unwrap();
            key.extract(&request.into_parts().0)
        };
        let basic = |scheme: &str, user_pass: &str| {
            let encoded = base64::engine::general_purpose::STANDARD.encode(user_pass);
            raw(&key, &format!("{scheme} {encoded}")).unwrap()
        };
        let alice = basic("Basic", "alice:correct horse");
        for guess in [
            "alice:123456",
            "alice:",
            "alice:pass:word",
            "alice:correct horse ",
        ] {
            assert_eq!(basic("Basic", guess), alice, "{guess}");
        }
        assert_eq!(
            basic("basic", "alice:letmein"),
            alice,
            "the scheme in any case"
        );
        assert_ne!(basic("Basic", "bob:correct horse"), alice);
        assert_ne!(
            basic("Basic", "Alice:correct horse"),
            alice,
            "user-ids keep their case"
        );
        // Unpadded, or with other trailing bits, as some clients send it: the same user.
        assert_eq!(raw(&key, "Basic YWxpY2U6eA").unwrap(), alice);
        assert_eq!(raw(&key, "Basic YWxpY2U6eB==").unwrap(), alice);
        // What the key is made of holds no password: the user-id alone, salted as asked.
        assert_eq!(
            alice,
            Key::hashed_with_salt("authorization", &[], b"Basic alice:")
        );
        assert_eq!(
            raw(&key.clone().salt("pepper"), "Basic YWxpY2U6eA==").unwrap(),
            Key::hashed_with_salt("authorization", b"pepper", b"Basic alice:")
        );
        // No user-id to read: refused, never a bucket of its own (a lenient server may
        // read `YWxpY2U6eA==` and ignore what follows, or drop what is not base64).
        for bad in [
            "Basic not*base64",
            "Basic YWxpY2U=",
            "Basic YWxpY2U6eA==junk",
            "Basic YWxp!Y2U6eA==",
            "Basic alice:hunter2",
        ] {
            let error = raw(&key, bad).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{bad}");
            assert!(!error.is_missing(), "{bad}");
        }
        // Other schemes are keyed whole, as without the option.
        let plain = HeaderKey::new("authorization");
        assert_eq!(
            raw(&key, "Bearer abc").unwrap(),
            raw(&plain, "Bearer abc").unwrap()
        );
        // Without the option, `Basic` credentials are keyed whole, as before.
        assert_ne!(
            raw(&plain, "Basic YWxpY2U6eA==").unwrap(),
            raw(&plain, "Basic YWxpY2U6eQ==").unwrap()
        );
    }

    /// Without `basic_user_id`, `Basic` credentials are keyed by what they decode to, in
    /// base64's one padded spelling with no stray trailing bits (RFC 4648, sections 3.2
    /// and 3.5; what a well-formed client sends, so its key does not change): servers
    /// decode leniently (Node's and Java's decoders take a missing padding, theirs and
    /// Go's other unused trailing bits, Node's base64url's alphabet), and each other
    /// spelling of one credential had a bucket of its own.
    /// Credentials that are not base64 at all are refused, as with `basic_user_id`.
    #[test]
    fn basic_credentials_are_keyed_by_what_they_decode_to() {
        let plain = HeaderKey::new("authorization");
        let raw = |value: &str| {
            let request = Request::get("/")
                .header("authorization", value)
                .body(())
                .unwrap();
            plain.extract(&request.into_parts().0)
        };
        let alice = raw("Basic YWxpY2U6eA==").unwrap();
        assert_eq!(
            alice,
            Key::hashed_with_salt("authorization", &[], b"Basic YWxpY2U6eA==")
        );
        for spelling in [
            "Basic YWxpY2U6eA",
            "Basic YWxpY2U6eB==",
            "Basic YWxpY2U6eP",
            "basic  YWxpY2U6eA=",
        ] {
            assert_eq!(raw(spelling).unwrap(), alice, "{spelling}");
        }
        assert_ne!(raw("Basic YWxpY2U6eQ==").unwrap(), alice);
        // base64url's `-` and `_` for `+` and `/` (Node's decoder takes either alphabet).
        assert_eq!(
            raw("Basic YWxpY2U6Pz8-").unwrap(),
            raw("Basic YWxpY2U6Pz8+").unwrap()
        );
        assert_eq!(
            raw("Basic YWxpY2U6Pz8_").unwrap(),
            raw("Basic YWxpY2U6Pz8/").unwrap()
        );
        assert_ne!(
            raw("Basic YWxpY2U6Pz8+").unwrap(),
            raw("Basic YWxpY2U6Pz8/").unwrap()
        );
        for bad in [
            "Basic not*base64",
            "Basic YWxpY2U6eA==junk",
            "Basic YWxp!Y2U6eA==",
            "Basic YWxpY2U6eA== x",
        ] {
            let error = raw(bad).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{bad}");
            assert!(!error.is_missing(), "{bad}");
        }
    }

    /// `Authorization` names one credential however its scheme is spelt: the scheme is
    /// case-insensitive (RFC 9110, section 11.1) and the space after it is `1*SP`
    /// (section 11.4), so an auth layer that accepts `bearer`, `BEARER` or two spaces
    /// would otherwise let one token spread over many buckets. The credentials themselves
    /// keep their case.
    #[test]
    fn an_authorization_scheme_is_read_case_insensitively() {
        let key = HeaderKey::new("authorization");
        let extract = |value: &[u8]| {
            let request = Request::get("/")
                .header(
                    "authorization",
                    http::HeaderValue::from_bytes(value).unwrap(),
                )
                .body(())
                .unwrap();
            key.extract(&request.into_parts().0).unwrap()
        };
        let bearer = extract(b"Bearer abcDEF");
        for same in [
            &b"bearer abcDEF"[..],
            b"BEARER abcDEF",
            b"BeArEr abcDEF",
            b"Bearer   abcDEF",
            b"Bearer \tabcDEF",
        ] {
            assert_eq!(extract(same), bearer, "{}", String::from_utf8_lossy(same));
        }
        assert_ne!(
            extract(b"Bearer abcdef"),
            bearer,
            "the token keeps its case"
        );
        assert_ne!(extract(b"Basic abcDEF"), bearer, "another scheme");
        assert_eq!(
            extract(b"basic dXNlcjpwYXNz"),
            Key::hashed_with_salt("authorization", &[], b"Basic dXNlcjpwYXNz")
        );
        // The registered spelling keeps the key it had before the scheme was read
        // case-insensitively (no bucket starts over on upgrade, no rolling deploy counts
        // one client in two buckets).
        assert_eq!(
            bearer,
            Key::hashed_with_salt("authorization", &[], b"Bearer abcDEF")
        );
        // A value with no scheme (a bare API key) is not a scheme: it keeps its case.
        assert_ne!(extract(b"AbC123"), extract(b"abc123"));
        // Another header keeps its value as it is.
        let api_key = HeaderKey::new("x-api-key");
        let value = |v: &[u8]| {
            let request = Request::get("/")
                .header("x-api-key", http::HeaderValue::from_bytes(v).unwrap())
                .body(())
                .unwrap();
            api_key.extract(&request.into_parts().0).unwrap()
        };
        assert_ne!(value(b"Bearer abc"), value(b"bearer abc"));
    }

    /// A bearer token is one `b64token` (RFC 6750, section 2.1: `"Bearer" 1*SP
    /// b64token`; DPoP's the same, RFC 9449 section 7.1), with no space or comma in it;
    /// any scheme's credentials are one `token68` or auth-params (RFC 9110, section
    /// 11.4). An auth layer that reads the token leniently (the first word after the
    /// scheme, as passport-jwt's `JWT` scheme does) takes `Bearer abc 1`, `Bearer abc
    /// 2`, ... as one token: kept whole, each would be a bucket of its own. Such a value
    /// is refused, as Basic credentials with trailing data are.
    #[test]
    fn a_bearer_token_with_trailing_data_is_refused() {
        let key = HeaderKey::new("authorization");
        let extract = |value: &str| {
            let request = Request::get("/")
                .header("authorization", value)
                .body(())
                .unwrap();
            key.extract(&request.into_parts().0)
        };
        for bad in [
            "Bearer abc 1",
            "Bearer abc\t2",
            "Bearer abc, x",
            "Bearer abc,x",
            "bearer abc  junk",
            "DPoP abc 1",
            "JWT abc 1",
            "token abc, 2",
            "Bearer abc== 1",
            // An `=` makes no auth-param of a bearer token (a server taking the last word
            // would read `T`).
            "Bearer x=1 T",
            "Bearer =1 T",
            "DPoP a=b 1",
            "JWT abc== 1",
            // A token beside auth-params is neither one token68 nor auth-params: a
            // server reading the first word takes `abc`, one reading the last takes it
            // from `Token n=1 abc` (a new parameter each time would be a bucket each).
            "JWT abc x=1",
            "JWT abc, x=1",
            "JWT abc==, x=1",
            "token n=1 abc",
            "token n=1, abc",
            "Digest username=\"a\" abc",
            "Digest username=\"a\", realm",
            "Digest username=\"a, b",
            // Space around an `=` is no parameter's: `abc` is still the first word.
            "JWT abc =1",
            "JWT abc = 1",
            "JWT abc\t=1",
            "token abc= 1",
            "Digest username = \"a\", realm=\"b\"",
        ] {
            let error = extract(bad).unwrap_err();
            assert_eq!(error.kind(), KeyErrorKind::Client, "{bad}");
            assert!(!error.is_missing(), "{bad}");
        }
        // A token of b64token's characters, padding and trailing space included.
        for good in [
            "Bearer abc",
            "Bearer a-b.c_d~e+f/g==",
            "Bearer abc  ",
            "DPoP abc",
        ] {
            assert!(extract(good).is_ok(), "{good}");
        }
        // Another scheme's credentials may be several auth-params (RFC 9110 section
        // 11.4): kept whole, even where a value is no token (AWS's signature fields).
        for params in [
            "Digest username=\"a b\", realm=\"b\"",
            "OAuth realm=\"Example\", oauth_consumer_key=\"0685bd9184jfhq22\"",
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, \
             SignedHeaders=content-type;host;x-amz-date, Signature=5d672d79c15b13162d9279b0",
            "vapid t=eyJ0eXAi, k=BA1Hxzyi",
            "JWT abc",
            // Empty list elements (section 5.6.1).
            "OAuth , oauth_token=\"x\"",
            "Digest username=\"a\",realm=\"b\",",
            "Hawk id=\"dh37fgj492je\", ts=\"1353832234\", mac=\"6R4rV5iE+NPoym+WwjeHzjAGXUtLNIxmo1vpMofpLAE=\"",
        ] {
            assert!(extract(params).is_ok(), "{params}");
        }
    }
}
