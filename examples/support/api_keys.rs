//! The API keys an example knows, and the check that drops any other before the limiter
//! (an app looks them up in its database, in its authentication layer).

/// The API keys the examples know.
pub const KEYS: [&str; 1] = ["demo"];

/// Drops an `x-api-key` the app does not know, so its request is limited by address:
/// keyed by it, a key made up per request would be a fresh budget per request.
pub async fn drop_unknown_key(mut request: axum::extract::Request) -> axum::extract::Request {
    let known = request
        .headers()
        .get("x-api-key")
        .is_some_and(|key| KEYS.iter().any(|known| known.as_bytes() == key.as_bytes()));
    if !known {
        request.headers_mut().remove("x-api-key");
    }
    request
}
