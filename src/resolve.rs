//! Policy resolution: which policies one request must pass (a fixed set, or per plan,
//! tenant or route). It sits beside `key` and `cost`: the three per-request stages the
//! layer runs before it asks the store.

use std::fmt;

use crate::policy::PolicySet;

/// Picks the policies for a request: a fixed set, or per plan, tenant or route.
///
/// A [`PolicySet`] is itself a resolver that always answers itself. An empty set means
/// "not limited" (no headers either), which lets a resolver exempt some requests on
/// purpose.
///
/// A resolver of your own implements [`resolve`](Self::resolve), and lists its sets in
/// [`known_sets`](Self::known_sets) so that the store checks them at start-up:
///
/// ```
/// use std::borrow::Cow;
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response, request::Parts};
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
/// use tollgate::key::HeaderKey;
/// use tollgate::{Key, MemoryStore, Policy, PolicyResolver, PolicySet, RateLimitLayer};
///
/// /// Two plans, by the `x-plan` header a gateway in front sets (cheap to clone, as the
/// /// layer needs).
/// #[derive(Clone)]
/// struct Plans {
///     free: PolicySet,
///     pro: PolicySet,
/// }
///
/// impl PolicyResolver for Plans {
///     fn resolve<'a>(&'a self, parts: &Parts, _key: &Key) -> Cow<'a, PolicySet> {
///         match parts.headers.get("x-plan") {
///             Some(plan) if plan == "pro" => Cow::Borrowed(&self.pro),
///             _ => Cow::Borrowed(&self.free),
///         }
///     }
///
///     fn known_sets(&self) -> Vec<PolicySet> {
///         vec![self.free.clone(), self.pro.clone()]
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let minute = Duration::from_secs(60);
/// let plans = Plans {
///     free: PolicySet::from(Policy::fixed_window("api", 1, minute)?),
///     pro: PolicySet::from(Policy::fixed_window("api", 100, minute)?),
/// };
/// let service = ServiceBuilder::new()
///     .layer(
///         RateLimitLayer::new(MemoryStore::new())
///             .key(HeaderKey::new("x-api-key"))
///             .resolver(plans),
///     )
///     .service(service_fn(|_: Request<()>| async {
///         Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
///     }));
/// let request = |plan: &str| {
///     let request = Request::get("/").header("x-api-key", "k1").header("x-plan", plan);
///     request.body(()).unwrap()
/// };
/// assert_eq!(service.clone().oneshot(request("free")).await?.status(), 200);
/// assert_eq!(service.clone().oneshot(request("free")).await?.status(), 429);
/// assert_eq!(service.clone().oneshot(request("pro")).await?.status(), 200);
/// # Ok(()) }
/// ```
pub trait PolicyResolver: Send + Sync + 'static {
    /// The policies `parts` (identified as `key`) must pass.
    fn resolve<'a>(
        &'a self,
        parts: &http::request::Parts,
        key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet>;

    /// Checked when the layer is built: a static resolver with no policy is a mistake.
    /// An error here is [`validate`](crate::RateLimitLayer::validate)'s, word for word,
    /// and building the layer panics with it. `Ok` by default; a [`PolicySet`] answers
    /// an error when it is empty.
    ///
    /// ```
    /// use std::borrow::Cow;
    /// use std::time::Duration;
    /// use tollgate::{Key, MemoryStore, Policy, PolicyResolver, PolicySet, RateLimitLayer};
    ///
    /// /// The plans loaded at start-up, the first for every request: none is a mistake.
    /// #[derive(Clone)]
    /// struct Loaded(Vec<PolicySet>);
    ///
    /// impl PolicyResolver for Loaded {
    ///     fn resolve<'a>(&'a self, _: &http::request::Parts, _: &Key) -> Cow<'a, PolicySet> {
    ///         self.0.first().map_or_else(|| Cow::Owned(PolicySet::unlimited()), Cow::Borrowed)
    ///     }
    ///
    ///     fn check_configured(&self) -> Result<(), &'static str> {
    ///         if self.0.is_empty() { Err("no plan was loaded") } else { Ok(()) }
    ///     }
    /// }
    ///
    /// let none = RateLimitLayer::new(MemoryStore::new()).resolver(Loaded(Vec::new()));
    /// assert_eq!(none.validate(), Err("no plan was loaded".to_owned()));
    /// let free = PolicySet::from(Policy::fixed_window("api", 10, Duration::from_secs(60))?);
    /// let one = RateLimitLayer::new(MemoryStore::new()).resolver(Loaded(vec![free.clone()]));
    /// assert!(one.validate().is_ok());
    ///
    /// assert!(free.check_configured().is_ok());
    /// assert!(PolicySet::unlimited().check_configured().is_err());
    /// # Ok::<(), tollgate::PolicyError>(())
    /// ```
    fn check_configured(&self) -> Result<(), &'static str> {
        Ok(())
    }

    /// The policy sets this resolver can answer, when they are known ahead: the layer asks
    /// its store to [validate](crate::Store::validate) each one when it is built. The
    /// default (for closures) knows none: a set the store cannot decide (a limit above
    /// what Redis counts exactly) is then met per request, as a store error of kind
    /// `Unsupported`, logged at error level, counted, and answered by the failure mode.
    /// A resolver of your own that lists its sets here has them refused at start-up.
    fn known_sets(&self) -> Vec<PolicySet> {
        Vec::new()
    }
}

macro_rules! forward_resolver {
    ($($pointer:ident),*) => {$(
        impl<T: PolicyResolver + ?Sized> PolicyResolver for $pointer<T> {
            fn resolve<'a>(
                &'a self,
                parts: &http::request::Parts,
                key: &crate::Key,
            ) -> std::borrow::Cow<'a, PolicySet> {
                (**self).resolve(parts, key)
            }

            fn check_configured(&self) -> Result<(), &'static str> {
                (**self).check_configured()
            }

            fn known_sets(&self) -> Vec<PolicySet> {
                (**self).known_sets()
            }
        }
    )*};
}

use std::sync::Arc;
forward_resolver!(Arc, Box);

impl PolicyResolver for PolicySet {
    fn resolve<'a>(
        &'a self,
        _parts: &http::request::Parts,
        _key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet> {
        std::borrow::Cow::Borrowed(self)
    }

    fn known_sets(&self) -> Vec<PolicySet> {
        vec![self.clone()]
    }

    fn check_configured(&self) -> Result<(), &'static str> {
        if self.is_empty() {
            Err("RateLimitLayer has no policy: add one with .policy(...) or .policies(...)")
        } else {
            Ok(())
        }
    }
}

/// A resolver from a closure; see [`resolve_with`].
#[derive(Clone)]
pub struct ResolveFn<F> {
    f: F,
}

impl<F> fmt::Debug for ResolveFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResolveFn")
    }
}

/// A resolver from a closure that returns a set (a clone of one it owns is cheap: sets
/// are reference-counted), for example by the plan that authentication middleware stored
/// in the request.
///
/// ```
/// use http::Request;
/// use tollgate::resolve::{resolve_with, PolicyResolver};
/// use tollgate::{Key, Policy, PolicySet, Rate};
///
/// #[derive(Clone, Copy)]
/// enum Plan { Free, Pro }
///
/// let free = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_second(10))?);
/// let pro = PolicySet::from(Policy::token_bucket("api", 100, Rate::per_second(100))?);
/// let by_plan = resolve_with(move |parts, _key| {
///     match parts.extensions.get::<Plan>() {
///         Some(Plan::Pro) => pro.clone(),
///         _ => free.clone(),
///     }
/// });
/// let mut request = Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(Plan::Pro);
/// let (parts, _) = request.into_parts();
/// assert_eq!(by_plan.resolve(&parts, &Key::new("user:1"))[0].limit(), 100);
/// # Ok::<(), tollgate::PolicyError>(())
/// ```
pub fn resolve_with<F>(f: F) -> ResolveFn<F>
where
    F: Fn(&http::request::Parts, &crate::Key) -> PolicySet + Send + Sync + 'static,
{
    ResolveFn { f }
}

impl<F> PolicyResolver for ResolveFn<F>
where
    F: Fn(&http::request::Parts, &crate::Key) -> PolicySet + Send + Sync + 'static,
{
    fn resolve<'a>(
        &'a self,
        parts: &http::request::Parts,
        key: &crate::Key,
    ) -> std::borrow::Cow<'a, PolicySet> {
        std::borrow::Cow::Owned((self.f)(parts, key))
    }
}
