//! Requests that skip limiting: an allowlist of client networks, of keys, or a predicate
//! over the request.
//!
//! A bypassed request is not decided, spends nothing, gets no rate-limit headers (it was
//! not limited, so no numbers would be true), and is counted in the metric
//! `tollgate_bypassed_total` (feature `metrics`) by reason: `network`, `key` or
//! `predicate`.
//!
//! ```
//! use tollgate::bypass::Bypass;
//! use tollgate::key::{ClientIp, HeaderKey, KeyExtractorExt};
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
//!
//! let api_key = HeaderKey::new("x-api-key");
//! let bypass = Bypass::new()
//!     .network("10.0.0.0/8")                                  // the office and the fleet
//!     .network("::1")
//!     // The key reads no address: say how to find the client behind the load balancer,
//!     // or every request through it (an address in 10.0.0.0/8) would skip.
//!     .client_ip(ClientIp::behind_proxies(["10.0.0.1"])?)
//!     .key(api_key.key_for("monitoring-token")?)              // as the extractor spells it
//!     .when(|parts| parts.uri.path() == "/healthz");
//! let layer = RateLimitLayer::new(MemoryStore::new())
//!     .policy(Policy::gcra("api", Rate::per_second(10), 20)?)
//!     .key(api_key)
//!     .bypass(bypass);
//! # let _ = layer;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use ipnet::IpNet;

use crate::key::{ClientIp, Key};

/// Why a request skipped limiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BypassReason {
    /// The client address is in an allowed network.
    Network,
    /// The request's key is allowed.
    Key,
    /// The predicate said so.
    Predicate,
}

impl BypassReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            BypassReason::Network => "network",
            BypassReason::Key => "key",
            BypassReason::Predicate => "predicate",
        }
    }
}

/// An allowlist: client networks, keys and a predicate, any of which lets a request skip
/// limiting. See the [module docs](self).
#[derive(Clone, Default)]
pub struct Bypass {
    networks: Vec<IpNet>,
    client_ip: Option<ClientIp>,
    keys: HashSet<Key>,
    when: Option<Arc<Predicate>>,
}

type Predicate = dyn Fn(&Parts) -> bool + Send + Sync;

impl fmt::Debug for Bypass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bypass")
            .field("networks", &self.networks)
            .field("keys", &self.keys.len())
            .field("predicate", &self.when.is_some())
            .finish()
    }
}

impl Bypass {
    /// An empty allowlist: nothing skips.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests from `network` (`10.0.0.0/8`, `2001:db8::/32`, or one address) skip.
    /// Clients are compared in canonical form (an IPv4-mapped IPv6 address is IPv4), so
    /// an IPv4-mapped block stands for the IPv4 block inside it (`::ffff:10.0.0.0/104` is
    /// `10.0.0.0/8`), as in [`ClientIp::behind_proxies`].
    ///
    /// # Panics
    ///
    /// If `network` is neither a network nor an address, or holds every address (`0.0.0.0/0`,
    /// `::/0`: nothing would be limited): a programming error caught at
    /// start-up. [`try_network`](Self::try_network) returns the error instead.
    pub fn network(self, network: &str) -> Self {
        self.try_network(network)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// Like [`network`](Self::network), for networks read from configuration.
    ///
    /// ```
    /// use tollgate::bypass::Bypass;
    ///
    /// assert!(Bypass::new().try_network("192.0.2.0/24").is_ok());
    /// assert!(Bypass::new().try_network("192.0.2.0/33").is_err());
    /// ```
    pub fn try_network(mut self, network: &str) -> Result<Self, String> {
        let trimmed = network.trim();
        let net = trimmed
            .parse::<IpNet>()
            .or_else(|_| trimmed.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| {
                format!("Bypass: {network:?} is not a network (such as 10.0.0.0/8) or an address")
            })?;
        // Compared with clients in canonical form: an IPv4-mapped block is its IPv4 one.
        let net = crate::key::canonical_net(net.trunc());
        if net.prefix_len() == 0 {
            return Err(format!(
                "Bypass: {network:?} holds every address: every client would skip limiting"
            ));
        }
        self.networks.push(net);
        Ok(self)
    }

    /// How the client address is found for [`network`](Self::network). By default, as the
    /// layer's key finds it when the key reads one (a `ClientIp`, or an `or` chain with
    /// one), else the socket peer ([`ClientIp::peer`]).
    pub fn client_ip(mut self, client_ip: ClientIp) -> Self {
        self.client_ip = Some(client_ip);
        self
    }

    /// True when it has networks and was not told how to find the client's address: the
    /// layer's key's way then, or the socket peer.
    pub(crate) fn reads_the_peer_by_default(&self) -> bool {
        !self.networks.is_empty() && self.client_ip.is_none()
    }

    /// This bypass, reading the client's address as `client_ip` does unless it was told
    /// how ([`client_ip`](Self::client_ip)): the layer gives it its key's.
    pub(crate) fn or_client_ip(mut self, client_ip: Option<&ClientIp>) -> Self {
        if self.client_ip.is_none() {
            self.client_ip = client_ip.cloned();
        }
        self
    }

    /// Requests whose key (as the layer's key extractor gives it) is `key` skip. API keys
    /// are hashed (and salted) by their extractor: spell them as it does, with
    /// [`HeaderKey::key_for`](crate::key::HeaderKey::key_for).
    ///
    /// A request skips by presenting the key, before any authentication behind the
    /// limiter: allowlist only keys that are secrets (a whole API key or credential),
    /// never an identity anyone can name (a user id, a
    /// [`basic_user_id`](crate::key::HeaderKey::basic_user_id) key: any password would
    /// then skip).
    pub fn key(mut self, key: Key) -> Self {
        self.keys.insert(key);
        self
    }

    /// Requests for which `predicate` is true skip (health checks, internal routes). Each
    /// call adds one: a request skips when any of them is true.
    pub fn when<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.when = Some(match self.when.take() {
            Some(earlier) => Arc::new(move |parts: &Parts| earlier(parts) || predicate(parts)),
            None => Arc::new(predicate),
        });
        self
    }

    /// Does the request skip, before its key is known? (A network or the predicate: a
    /// request allowed by network needs no key at all.)
    pub(crate) fn before_key(&self, parts: &Parts) -> Option<BypassReason> {
        if let Some(predicate) = &self.when
            && predicate(parts)
        {
            return Some(BypassReason::Predicate);
        }
        if !self.networks.is_empty() {
            // A client a trusted proxy hid is no address on the allowlist, though the
            // key falls back to the proxy's.
            let address = match &self.client_ip {
                Some(client) => client.named_client_addr(parts),
                None => {
                    static PEER: std::sync::LazyLock<ClientIp> =
                        std::sync::LazyLock::new(ClientIp::peer);
                    PEER.named_client_addr(parts)
                }
            };
            if let Ok(Some(address)) = address {
                let address = canonical(address);
                if self.networks.iter().any(|net| net.contains(&address)) {
                    return Some(BypassReason::Network);
                }
            }
        }
        None
    }

    /// Does the request skip, by its key?
    pub(crate) fn by_key(&self, key: &Key) -> Option<BypassReason> {
        self.keys.contains(key).then_some(BypassReason::Key)
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack socket reports
/// IPv4 clients so).
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}
