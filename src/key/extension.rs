//! A value that earlier middleware put in the request's extensions (a user id).

use std::fmt;
use std::marker::PhantomData;

use http::request::Parts;

use super::{Key, KeyError, KeyErrorKind, KeyExtractor};

/// Keys requests by a value that earlier middleware (authentication) stored in the
/// request's extensions: `user:42`.
///
/// If the extension is missing the key is absent: without a fallback that is a server
/// error (500: the auth layer must run before the limiter). When anonymous requests are
/// expected, chain a fallback with [`or`](super::KeyExtractorExt::or), which is tried
/// exactly when the auth layer set no identity: `ExtensionKey::new(..).or(ClientIp::peer())`.
///
/// ```
/// use http::Request;
/// use tollgate::key::{ExtensionKey, KeyExtractor};
///
/// #[derive(Clone)]
/// struct User { id: u64 }
///
/// let user = ExtensionKey::new("user", |user: &User| user.id.to_string());
/// let mut request = Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(User { id: 42 });
/// let (parts, _) = request.into_parts();
/// assert_eq!(user.extract(&parts).unwrap().as_str(), "user:42");
/// ```
pub struct ExtensionKey<T, F> {
    namespace: &'static str,
    to_id: F,
    _marker: PhantomData<fn(&T)>,
}

impl<T, F: Clone> Clone for ExtensionKey<T, F> {
    fn clone(&self) -> Self {
        Self {
            namespace: self.namespace,
            to_id: self.to_id.clone(),
            _marker: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ExtensionKey<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey")
            .field("namespace", &self.namespace)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T, F> ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    /// Reads the `T` extension and names the identity `namespace:to_id(value)`. An empty
    /// id is the server's error (500), which no [`or`](super::KeyExtractorExt::or)
    /// fallback or `MissingKey::Allow` passes over: such requests would otherwise all
    /// share one budget (an auth layer that knows no user should insert no extension).
    ///
    /// # Panics
    ///
    /// If `namespace` is empty, holds anything but ASCII letters, digits, `-`, `_` and
    /// `.`, or is one of the crate's own key kinds (`ip`, `route`, `long`): a user named
    /// `203.0.113.7` under `ip` would share the budget of that address's anonymous
    /// requests. A programming error, caught at start-up.
    pub fn new(namespace: &'static str, to_id: F) -> Self {
        let fits = !namespace.is_empty()
            && namespace
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        assert!(
            fits && !matches!(namespace, "ip" | "route" | "long"),
            "ExtensionKey::new: the namespace {namespace:?} is not one of its own: it must be \
             ASCII letters, digits, '-', '_' or '.', and not one of the crate's key kinds \
             (ip, route, long), whose keys its identities would share"
        );
        Self {
            namespace,
            to_id,
            _marker: PhantomData,
        }
    }
}

impl<T, F> KeyExtractor for ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        let Some(value) = parts.extensions.get::<T>() else {
            let reason = format!(
                "no {} in the request extensions: the middleware that sets it must run before \
                 the rate limiter",
                std::any::type_name::<T>()
            );
            return Err(KeyError::missing(KeyErrorKind::Server, reason));
        };
        let id = (self.to_id)(value);
        if id.is_empty() {
            return Err(empty_id(self.namespace));
        }
        Ok(Key::new(format!("{}:{id}", self.namespace)))
    }
}

/// An empty id names no one: all such requests would share one budget.
#[cold]
#[inline(never)]
fn empty_id(namespace: &str) -> KeyError {
    KeyError::server(format!(
        "the {namespace} id is empty: every such request would share one budget"
    ))
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    #[derive(Clone)]
    struct User(&'static str);

    /// An empty id is no identity: every such request would share one budget
    /// (`user:`), silently. It is the server's mistake (500): not an absent key, which an
    /// `or` fallback or `MissingKey::Allow` would let spend another budget, or none.
    #[test]
    fn an_empty_id_is_the_servers_error_not_a_shared_budget() {
        let key = ExtensionKey::new("user", |user: &User| user.0.to_owned());
        let parts = |id| {
            let mut request = Request::get("/").body(()).unwrap();
            request.extensions_mut().insert(User(id));
            request.into_parts().0
        };
        assert_eq!(key.extract(&parts("42")).unwrap().as_str(), "user:42");
        let error = key.extract(&parts("")).unwrap_err();
        assert!(!error.is_missing(), "{error}");
        assert_eq!(error.kind(), KeyErrorKind::Server, "{error}");
        assert!(error.to_string().contains("empty"), "{error}");
    }

    /// A namespace of the crate's own key kinds (`ip`) had a user named `203.0.113.7`
    /// share the budget of that address's anonymous requests (`ip:203.0.113.7` both); an
    /// empty one (`:42`), or one holding `:`, spells other keys too.
    #[test]
    fn a_namespace_that_spells_other_keys_is_refused() {
        for namespace in ["ip", "route", "long", "", "user:admin", "a b"] {
            let built = std::panic::catch_unwind(|| {
                ExtensionKey::new(namespace, |user: &User| user.0.to_owned())
            });
            let message = *built
                .expect_err(namespace)
                .downcast::<String>()
                .expect("a message");
            assert!(message.contains("namespace"), "{message}");
        }
        for namespace in ["user", "tenant", "org.v2", "api-client_1"] {
            let _ = ExtensionKey::new(namespace, |user: &User| user.0.to_owned());
        }
    }
}
