//! Shared by the examples: a Redis URL fit to print, its password replaced by `***`.

/// Query parameters that carry a password (redis-rs reads `pass` in `redis+unix:` URLs).
const SECRET_PARAMETERS: [&str; 2] = ["pass", "password"];

/// `url` with the password of its user info, and any `pass`/`password` query parameter,
/// replaced by `***`. A string that does not parse as a URL is not shown at all: where its
/// password is cannot be known.
pub fn redact_url(url: &str) -> String {
    const UNPARSABLE: &str = "<a URL that does not parse; not shown>";
    let Ok(mut parsed) = url::Url::parse(url) else {
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

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn user_and_password() {
        assert_eq!(
            redact_url("redis://user:pass@h:1/0"),
            "redis://user:***@h:1/0"
        );
    }

    #[test]
    fn password_only() {
        assert_eq!(redact_url("redis://:pass@h"), "redis://:***@h");
    }

    #[test]
    fn no_user_info_is_unchanged() {
        assert_eq!(redact_url("rediss://h:1"), "rediss://h:1");
        assert_eq!(redact_url("redis://user@h:1"), "redis://user@h:1");
    }

    #[test]
    fn password_with_an_at_sign_and_percent_encoding() {
        assert_eq!(
            redact_url("redis://u:p%40ss@word@h:6379"),
            "redis://u:***@h:6379"
        );
    }

    #[test]
    fn password_in_the_query() {
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=hunter2"),
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
            let shown = redact_url(malformed);
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
