//! The client's IP address: the socket peer, or the address a trusted proxy vouches for.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use compact_str::format_compact;
use http::HeaderMap;
use http::request::Parts;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{Key, KeyError, KeyExtractor};

/// Which forwarding header the trusted proxies write. Only one is read: trusting both
/// would let a client pick the one it forged.
///
/// The example reads RFC 7239's `Forwarded` (section 5.2, the `for` parameter): behind a
/// trusted proxy, the address in its `for=` is the client; the header of a peer that is
/// not trusted is ignored, and so is `X-Forwarded-For` once `Forwarded` is chosen.
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollgate::key::{ClientIp, ForwardedHeader, KeyExtractor};
///
/// let ip = ClientIp::behind_proxies(["10.0.0.0/8"])?
///     .forwarded_header(ForwardedHeader::Forwarded);
/// let from = |peer: [u8; 4], forwarded: &str| {
///     let mut request = Request::get("/")
///         .header("forwarded", forwarded)
///         .header("x-forwarded-for", "192.0.2.99")
///         .body(())
///         .unwrap();
///     request.extensions_mut().insert(SocketAddr::from((peer, 443)));
///     ip.extract(&request.into_parts().0).unwrap().to_string()
/// };
/// // The trusted proxy 10.0.0.2 vouches for 203.0.113.7 (and X-Forwarded-For is not read).
/// assert_eq!(from([10, 0, 0, 2], "for=203.0.113.7;proto=https"), "ip:203.0.113.7");
/// // An IPv6 client is written quoted, in brackets, maybe with a port; grouped by /64.
/// assert_eq!(from([10, 0, 0, 2], r#"for="[2001:db8:1:2::9]:4711""#), "ip:2001:db8:1:2::/64");
/// // 198.51.100.5 is no trusted proxy: what it wrote is ignored, it is the client.
/// assert_eq!(from([198, 51, 100, 5], "for=203.0.113.7"), "ip:198.51.100.5");
/// # Ok::<(), tollgate::key::InvalidProxy>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for="[2001:db8::1]:4711"`.
    Forwarded,
}

/// A trusted-proxy entry that is neither an IP address nor a CIDR block, a block of every
/// address (which would trust the client too), or a block with host bits set past its
/// prefix (`10.0.0.5/8`, a typo for one address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidProxy {
    entry: String,
    why: NetError,
}

impl fmt::Display for InvalidProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.why {
            NetError::Everything => write!(
                f,
                "trusted proxy {:?} trusts every address, the client's own too: any client \
                 could name any address it likes (list your proxies' addresses or networks)",
                self.entry
            ),
            NetError::NotANetwork => write!(
                f,
                "trusted proxy {:?} is not an IP address or a CIDR block such as 10.0.0.0/8",
                self.entry
            ),
            host_bits => write!(f, "trusted proxy {:?} {host_bits}", self.entry),
        }
    }
}

/// Why a network an operator wrote (a trusted proxy, a bypass) is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NetError {
    /// Neither an address nor a CIDR block.
    NotANetwork,
    /// A block of every address.
    Everything,
    /// A block written with host bits set (`10.0.0.5/8`): the block it names, and the one
    /// address it may have meant.
    HostBits { block: IpNet, one: IpNet },
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetError::NotANetwork => f.write_str("is not an address or a CIDR block"),
            NetError::Everything => f.write_str("holds every address"),
            NetError::HostBits { block, one } => write!(
                f,
                "has host bits set past its prefix: write {block} for the whole block, or \
                 {one} for the one address"
            ),
        }
    }
}

/// A network an operator wrote, read strictly: an address (one host) or a CIDR block
/// without host bits past its prefix (a typo for one address, almost always: nginx warns
/// of it, Python's `ip_network` refuses it), never every address; in canonical form (an
/// IPv4-mapped block is its IPv4 one).
pub(crate) fn read_network(text: &str) -> Result<IpNet, NetError> {
    let text = text.trim();
    let net = text
        .parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| NetError::NotANetwork)?;
    if net.addr() != net.network() {
        return Err(NetError::HostBits {
            block: canonical_net(net.trunc()),
            one: canonical_net(IpNet::from(net.addr())),
        });
    }
    let net = canonical_net(net);
    if net.prefix_len() == 0 {
        return Err(NetError::Everything);
    }
    Ok(net)
}

impl std::error::Error for InvalidProxy {}

/// The most forwarding hops walked from the right before giving up.
const MAX_HOPS: usize = 32;

/// How much of the end of a `Forwarded` line is read: room for a chain of long elements
/// (a proxy's long `host`), while what reading it takes stays bounded (8 bytes a comma).
/// An element that starts before it is malformed: the walk stops there.
const MAX_FORWARDED_LINE: usize = 64 * 1024;

/// Keys requests by the client's IP address (`ip:203.0.113.7`, `ip:2001:db8:1:2::/64`).
///
/// By default the address is the socket peer, from axum's `ConnectInfo<SocketAddr>` or a
/// `SocketAddr` request extension. A forwarding header is read only when the peer is a
/// trusted proxy, and then walked right to left: each address a trusted proxy wrote is
/// believed, the first address that is not itself a trusted proxy is the client. The
/// leftmost entry, which the client writes, is never believed unless every proxy to its
/// right is trusted. A malformed or obfuscated entry stops the walk at the last address
/// known to be good.
///
/// IPv6 clients usually hold a whole /64, so IPv6 addresses are grouped by a prefix
/// (default /64); IPv4 by /32 (the address). IPv4-mapped IPv6 addresses count as IPv4.
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollgate::key::{ClientIp, KeyExtractor};
///
/// let ip = ClientIp::behind_proxies(["10.0.0.0/8"])?;
/// let mut request = Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.3")
///     .body(())
///     .unwrap();
/// request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 2], 443)));
/// let (parts, _) = request.into_parts();
/// // 10.0.0.2 and 10.0.0.3 are trusted; 203.0.113.7 is what they vouch for.
/// assert_eq!(ip.extract(&parts).unwrap().as_str(), "ip:203.0.113.7");
/// # Ok::<(), tollgate::key::InvalidProxy>(())
/// ```
///
/// The keys of the socket peer's address: an IPv4 address whole, an IPv6 address by its
/// /64, an IPv4-mapped IPv6 address as the IPv4 address it maps.
///
/// ```
/// use std::net::SocketAddr;
/// use http::Request;
/// use tollgate::key::{ClientIp, KeyExtractor};
///
/// let key = |ip: &ClientIp, peer: &str| {
///     let mut request = Request::get("/").body(()).unwrap();
///     request.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
///     ip.extract(&request.into_parts().0).unwrap().to_string()
/// };
/// let ip = ClientIp::peer();
/// assert_eq!(key(&ip, "203.0.113.7:40000"), "ip:203.0.113.7");
/// // Two hosts of one /64 share a budget.
/// assert_eq!(key(&ip, "[2001:db8:1:2::7]:40000"), "ip:2001:db8:1:2::/64");
/// assert_eq!(key(&ip, "[2001:db8:1:2:ffff::1]:40000"), "ip:2001:db8:1:2::/64");
/// assert_eq!(key(&ip, "[::ffff:203.0.113.7]:40000"), "ip:203.0.113.7");
/// // Grouped otherwise: by /48 and by IPv4 /24.
/// let wide = ClientIp::peer().ipv6_prefix(48).ipv4_prefix(24);
/// assert_eq!(key(&wide, "[2001:db8:1:2::7]:40000"), "ip:2001:db8:1::/48");
/// assert_eq!(key(&wide, "203.0.113.7:40000"), "ip:203.0.113.0/24");
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ForwardedHeader,
    ipv4_prefix: u8,
    ipv6_prefix: u8,
    /// Network-specific NAT64 prefixes (RFC 6052, section 2.2): each the prefix's
    /// address (its bits past the length zeroed) and length.
    nat64: Vec<(u128, u8)>,
    /// Set once this key (and its clones: a layer's) has said that it reads the socket
    /// peer of requests that carry a forwarding header.
    said_forwarded: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::peer()
    }
}

impl ClientIp {
    /// True when it trusts no proxy: it reads the socket peer alone.
    pub(crate) fn reads_the_peer(&self) -> bool {
        self.trusted.is_empty()
    }

    /// The socket peer's address; forwarding headers are ignored.
    ///
    /// The peer is read from axum's `ConnectInfo<SocketAddr>` first, then tonic's
    /// connection info, then a `SocketAddr` extension: middleware that learns the real
    /// client (the PROXY protocol) must replace `ConnectInfo`, not add a `SocketAddr`
    /// beside it. `ConnectInfo` is read with the `axum` feature (on by default) and
    /// tonic's with the `tonic` feature: an app built with `default-features = false`
    /// names the one it serves with, or every request is answered `500`.
    pub fn peer() -> Self {
        Self {
            trusted: Vec::new(),
            header: ForwardedHeader::XForwardedFor,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            nat64: Vec::new(),
            said_forwarded: std::sync::Arc::default(),
        }
    }

    /// Believes `X-Forwarded-For` as far as it was written by these proxies: IP
    /// addresses or CIDR blocks (`"10.0.0.0/8"`, `"2001:db8::/32"`, `"127.0.0.1"`).
    ///
    /// Peers are compared in canonical form (an IPv4-mapped IPv6 peer is its IPv4
    /// address), so an IPv4-mapped block stands for the IPv4 block inside it:
    /// `"::ffff:10.0.0.0/104"` is `10.0.0.0/8`. A block of every address (`"0.0.0.0/0"`,
    /// `"::/0"`, `"::ffff:0:0/96"`) is refused: it trusts the client's own address too,
    /// so the walk would go on into what the client wrote. So is a block written with
    /// host bits set past its prefix (`"10.0.0.5/8"`): a typo for one address, almost
    /// always, which would trust 16 million.
    ///
    /// Trust is only as good as the proxies: each one listed must write the header read
    /// (`X-Forwarded-For`, or [`Forwarded`](Self::forwarded_header)) on every request,
    /// appending the address it received the request from, and every proxy whose address
    /// may appear in it (a cloud load balancer's own) must be listed. A proxy that passes
    /// the client's header on unchanged (one that sets only `X-Real-IP`) lets the client
    /// name any address. A trusted proxy that names its client only in the other header
    /// hides it: such requests are keyed by the proxy's address (a warning says so once).
    pub fn behind_proxies<I, S>(proxies: I) -> Result<Self, InvalidProxy>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let trusted = proxies
            .into_iter()
            .map(|entry| {
                let entry = entry.as_ref().trim();
                read_network(entry).map_err(|why| InvalidProxy {
                    entry: entry.to_owned(),
                    why,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            trusted,
            ..Self::peer()
        })
    }

    /// Reads this forwarding header instead of `X-Forwarded-For`.
    ///
    /// With [`ForwardedHeader::Forwarded`], a trusted proxy's element (RFC 7239, section
    /// 4) names its client in `for=`; an element that hides it (`for=unknown`, an
    /// obfuscated identifier, RFC 7239 section 6) stops the walk at that proxy, whose
    /// address is then the key.
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollgate::key::{ClientIp, ForwardedHeader, KeyExtractor};
    ///
    /// let ip = ClientIp::behind_proxies(["10.0.0.0/8"])?
    ///     .forwarded_header(ForwardedHeader::Forwarded);
    /// let from = |peer: [u8; 4], forwarded: &str| {
    ///     let mut request = Request::get("/").header("forwarded", forwarded).body(()).unwrap();
    ///     request.extensions_mut().insert(SocketAddr::from((peer, 443)));
    ///     ip.extract(&request.into_parts().0).unwrap().to_string()
    /// };
    /// // Walked right to left: 10.0.0.3 is trusted, so the element it was sent is read too.
    /// assert_eq!(from([10, 0, 0, 2], "for=6.6.6.6, for=203.0.113.7, for=10.0.0.3"), "ip:203.0.113.7");
    /// // A client that talks to the server directly is not believed.
    /// assert_eq!(from([203, 0, 113, 7], "for=192.0.2.1"), "ip:203.0.113.7");
    /// // The proxy hides its client: the key is the proxy's.
    /// assert_eq!(from([10, 0, 0, 2], "for=unknown"), "ip:10.0.0.2");
    /// # Ok::<(), tollgate::key::InvalidProxy>(())
    /// ```
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 addresses by this prefix length (1 to 128, default 64; a longer one
    /// is 128, each address its own key).
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollgate::key::{ClientIp, KeyExtractor};
    ///
    /// let key = |ip: &ClientIp, peer: &str| {
    ///     let mut request = Request::get("/").body(()).unwrap();
    ///     request.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
    ///     ip.extract(&request.into_parts().0).unwrap().to_string()
    /// };
    /// // One budget per site (/48) and per IPv4 /24.
    /// let ip = ClientIp::peer().ipv6_prefix(48).ipv4_prefix(24);
    /// assert_eq!(key(&ip, "[2001:db8:1:2::7]:1"), "ip:2001:db8:1::/48");
    /// assert_eq!(key(&ip, "[2001:db8:1:ffff::7]:1"), "ip:2001:db8:1::/48");
    /// // NAT64 (64:ff9b::/96): the IPv4 host 192.0.2.1, grouped by the IPv4 prefix.
    /// assert_eq!(key(&ip, "[64:ff9b::c000:201]:1"), "ip:192.0.2.0/24");
    /// // 6to4 (2002:c000:201::/48 is 192.0.2.1's site).
    /// assert_eq!(key(&ClientIp::peer(), "[2002:c000:201:1::1]:1"), "ip:192.0.2.1");
    /// // Teredo: RFC 4380's example, a client at 192.0.2.45 behind the server 65.54.227.120.
    /// assert_eq!(key(&ClientIp::peer(), "[2001:0:4136:e378:8000:63bf:3fff:fdd2]:1"), "ip:192.0.2.45");
    /// // Each address its own key: a prefix past 128 is 128.
    /// assert_eq!(key(&ClientIp::peer().ipv6_prefix(200), "[2001:db8::7]:1"), "ip:2001:db8::7");
    /// ```
    ///
    /// A /64 is one site's subnet, so one host cannot spread over 2^64 keys; but a holder
    /// of a /48 still has 65,536 of them (`48` groups by site, at the price of sharing
    /// with neighbours where providers hand out smaller blocks). An address of the
    /// well-known NAT64 prefix (`64:ff9b::/96`, RFC 6052), which a stateless translator
    /// in front of an IPv6-only server shows for each IPv4 client, is keyed as the IPv4
    /// host it carries (`ip:192.0.2.1`), grouped by [`ipv4_prefix`](Self::ipv4_prefix);
    /// so is a 6to4 address (`2002:V4ADDR::/48`, RFC 3056), whose whole /48 belongs to
    /// the IPv4 host it names, and a Teredo address (`2001:0::/32`, RFC 4380), whose /64
    /// is its Teredo server's, shared by all of that server's clients: it is keyed as
    /// the client's public IPv4 address, which it carries.
    ///
    /// # Panics
    ///
    /// If `bits` is 0: every IPv6 client would share one budget (a programming error,
    /// caught at start-up, as [`behind_proxies`](Self::behind_proxies) refuses `::/0`).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        assert!(
            bits > 0,
            "ClientIp::ipv6_prefix(0) keys every IPv6 client as one: the prefix is 1 to 128"
        );
        self.ipv6_prefix = bits.min(128);
        self
    }

    /// Groups IPv4 addresses by this prefix length (1 to 32, default 32; a longer one is
    /// 32). See [`ipv6_prefix`](Self::ipv6_prefix) for the IPv6 side.
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use http::Request;
    /// use tollgate::key::{ClientIp, KeyExtractor};
    ///
    /// let key = |ip: &ClientIp, peer: [u8; 4]| {
    ///     let mut request = Request::get("/").body(()).unwrap();
    ///     request.extensions_mut().insert(SocketAddr::from((peer, 1)));
    ///     ip.extract(&request.into_parts().0).unwrap().to_string()
    /// };
    /// let by_24 = ClientIp::peer().ipv4_prefix(24);
    /// assert_eq!(key(&by_24, [198, 51, 100, 7]), "ip:198.51.100.0/24");
    /// assert_eq!(key(&by_24, [198, 51, 100, 250]), "ip:198.51.100.0/24");
    /// assert_eq!(key(&by_24, [198, 51, 101, 7]), "ip:198.51.101.0/24");
    /// // 32 (the default), or anything longer: the address itself.
    /// assert_eq!(key(&ClientIp::peer().ipv4_prefix(40), [198, 51, 100, 7]), "ip:198.51.100.7");
    /// ```
    ///
    /// # Panics
    ///
    /// If `bits` is 0: every IPv4 client would share one budget.
    pub fn ipv4_prefix(mut self, bits: u8) -> Self {
        assert!(
            bits > 0,
            "ClientIp::ipv4_prefix(0) keys every IPv4 client as one: the prefix is 1 to 32"
        );
        self.ipv4_prefix = bits.min(32);
        self
    }

    /// Reads an address under this NAT64 prefix as the IPv4 host it carries, as the
    /// well-known prefix `64:ff9b::/96` is read: a translator in front of an IPv6-only
    /// server, given a network-specific prefix (RFC 6052, section 2.2; one within the
    /// local-use block `64:ff9b:1::/48` of RFC 8215, or the operator's own), shows every IPv4
    /// client under it, and by /64 they would all share one budget. `bits` is the
    /// prefix's length, one RFC 6052 allows: 32, 40, 48, 56, 64 or 96 (the IPv4 address
    /// follows it, skipping bits 64 to 71), and must be the translator's: an address
    /// whose bits 64 to 71 or suffix are not zero, which a translator never writes and a
    /// wrong length reads, keeps its /64. Called again, each prefix counts, and the
    /// longest that holds an address reads it.
    ///
    /// ```
    /// use tollgate::key::ClientIp;
    ///
    /// let ip = ClientIp::peer().nat64_prefix("64:ff9b:1::".parse().unwrap(), 96);
    /// // Two IPv4 clients through the translator: two budgets, not one /64.
    /// assert_eq!(ip.key_for("64:ff9b:1::c000:221".parse().unwrap()).as_str(), "ip:192.0.2.33");
    /// assert_eq!(ip.key_for("64:ff9b:1::c633:6407".parse().unwrap()).as_str(), "ip:198.51.100.7");
    /// // Without the prefix, both were `ip:64:ff9b:1::/64`.
    /// assert_eq!(
    ///     ClientIp::peer().key_for("64:ff9b:1::c000:221".parse().unwrap()).as_str(),
    ///     "ip:64:ff9b:1::/64"
    /// );
    /// ```
    ///
    /// # Panics
    ///
    /// If `bits` is not one of those lengths, or a /96 prefix sets any of bits 64 to 71
    /// (RFC 6052 has them zero in every such address): a programming error, caught at
    /// start-up.
    pub fn nat64_prefix(mut self, prefix: std::net::Ipv6Addr, bits: u8) -> Self {
        assert!(
            matches!(bits, 32 | 40 | 48 | 56 | 64 | 96),
            "ClientIp::nat64_prefix({prefix}, {bits}): a NAT64 prefix is 32, 40, 48, 56, 64 \
             or 96 bits long (RFC 6052, section 2.2)"
        );
        let prefix = u128::from(prefix) & prefix_mask(bits);
        assert!(
            prefix.to_be_bytes()[8] == 0,
            "ClientIp::nat64_prefix({}, {bits}): bits 64 to 71 of a NAT64 address are zero \
             (RFC 6052, section 2.2), and this prefix sets some",
            std::net::Ipv6Addr::from(prefix)
        );
        self.nat64.push((prefix, bits));
        self
    }

    /// The key this extractor gives a client at `ip` (the address its requests come
    /// from, or the one its trusted proxies vouch for), grouped and read as a request's
    /// is: an IPv4-mapped address as its IPv4 address, an IPv6 address by its prefix, an
    /// IPv4 host behind NAT64, 6to4 or Teredo as that host. For a `Limiter` that shares
    /// a client's HTTP budget (a WebSocket's messages), or a `reset` or `peek` of one
    /// client.
    ///
    /// ```
    /// use tollgate::key::ClientIp;
    ///
    /// let ip = ClientIp::peer();
    /// assert_eq!(ip.key_for("2001:db8:1:2::7".parse().unwrap()).as_str(), "ip:2001:db8:1:2::/64");
    /// assert_eq!(ip.key_for("::ffff:203.0.113.7".parse().unwrap()).as_str(), "ip:203.0.113.7");
    /// ```
    pub fn key_for(&self, ip: IpAddr) -> Key {
        self.group(ip.to_canonical())
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client's address, before prefix grouping: the socket peer's, or the one its
    /// trusted proxies vouch for, with an IPv4-mapped IPv6 address as its IPv4 address.
    /// An error of kind [`Server`](crate::key::KeyErrorKind::Server) when the request
    /// carries no peer address.
    ///
    /// ```
    /// use std::net::{IpAddr, SocketAddr};
    /// use http::Request;
    /// use tollgate::key::{ClientIp, KeyErrorKind, KeyExtractor};
    ///
    /// let ip = ClientIp::behind_proxies(["10.0.0.0/8"])?;
    /// let mut request = Request::get("/")
    ///     .header("x-forwarded-for", "2001:db8:1:2::7")
    ///     .body(())
    ///     .unwrap();
    /// request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 2], 443)));
    /// let (parts, _) = request.into_parts();
    /// // The whole address, where the key is its /64.
    /// assert_eq!(ip.client_addr(&parts).unwrap(), "2001:db8:1:2::7".parse::<IpAddr>().unwrap());
    /// assert_eq!(ip.extract(&parts).unwrap().as_str(), "ip:2001:db8:1:2::/64");
    ///
    /// let (no_peer, _) = Request::get("/").body(()).unwrap().into_parts();
    /// assert_eq!(ip.client_addr(&no_peer).unwrap_err().kind(), KeyErrorKind::Server);
    /// # Ok::<(), tollgate::key::InvalidProxy>(())
    /// ```
    #[inline]
    pub fn client_addr(&self, parts: &Parts) -> Result<IpAddr, KeyError> {
        let Some(peer) = peer_addr(parts) else {
            return Err(no_peer());
        };
        let client = peer.to_canonical();
        if self.trusted.is_empty() {
            return Ok(client);
        }
        Ok(self.vouched_for(parts, client))
    }

    /// The client a trusted `peer` vouches for in the forwarding header (the peer itself
    /// when it is not trusted).
    #[inline(never)]
    fn vouched_for(&self, parts: &Parts, peer: IpAddr) -> IpAddr {
        self.walk(parts, peer).0
    }

    /// [`vouched_for`](Self::vouched_for), and whether the walk stopped at an entry that
    /// hides the client (malformed, obfuscated or `unknown`) behind a trusted proxy: the
    /// address is then that proxy's, standing in for a client nobody named.
    fn walk(&self, parts: &Parts, peer: IpAddr) -> (IpAddr, bool) {
        let mut client = peer;
        if !self.is_trusted(client) {
            return (client, false);
        }
        let mut hops = ForwardedHops::new(&parts.headers, self.header);
        for _ in 0..MAX_HOPS {
            match hops.next() {
                Some(Some(ip)) => {
                    client = ip.to_canonical();
                    if !self.is_trusted(client) {
                        return (client, false);
                    }
                }
                // Malformed, obfuscated or "unknown": the last good address stands.
                Some(None) => return (client, true),
                None => return (client, self.named_elsewhere(parts)),
            }
        }
        // More trusted hops than the walk reads: whoever is further out is unknown. A
        // chain exactly as long as the walk reads ends as a shorter one does.
        match hops.next() {
            Some(_) => (client, true),
            None => (client, self.named_elsewhere(parts)),
        }
    }

    /// The header read is used up and its last address is trusted: the trusted peer's own
    /// request (or the chain's first hop), unless a client is named in the other header
    /// (a proxy configured otherwise than the key, or an outer tier writing the other
    /// header), which is then hidden.
    fn named_elsewhere(&self, parts: &Parts) -> bool {
        let named = names_a_client(&parts.headers, self.header.other());
        if named {
            forwarded_elsewhere(self.header.name(), self.header.other().name());
        }
        named
    }

    /// The client's address when the forwarding headers name it: `None` when a trusted
    /// proxy hid it (the key then falls back to that proxy's address; an allowlist by
    /// network must not take the proxy for the client).
    pub(crate) fn named_client_addr(&self, parts: &Parts) -> Result<Option<IpAddr>, KeyError> {
        let Some(peer) = peer_addr(parts) else {
            return Err(no_peer());
        };
        let client = peer.to_canonical();
        if self.trusted.is_empty() {
            return Ok(Some(client));
        }
        let (client, hidden) = self.walk(parts, client);
        Ok((!hidden).then_some(client))
    }

    #[inline]
    fn group(&self, ip: IpAddr) -> Key {
        match ip {
            // Formatted in place: an IPv4 key fits inline, no allocation per request.
            IpAddr::V4(v4) if self.ipv4_prefix == 32 => Key::from_compact(ipv4_key(v4)),
            ip => self.group_by_prefix(ip),
        }
    }

    /// The IPv4 host `v6` carries under the longest of the network-specific NAT64
    /// prefixes that holds it (RFC 6052, section 2.2: the four bytes after the prefix,
    /// byte 8, bits 64 to 71, skipped). `None` for an address no translator with that
    /// prefix writes: one whose bits 64 to 71 or suffix (the bytes after the IPv4
    /// address) are not zero, as that section has them, which is what a prefix length
    /// other than the translator's reads (every client would get one made-up key).
    fn nat64_host(&self, v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
        let address = u128::from(v6);
        let bits = self
            .nat64
            .iter()
            .filter(|&&(prefix, bits)| address & prefix_mask(bits) == prefix)
            .map(|&(_, bits)| bits)
            .max()?;
        let octets = v6.octets();
        let mut host = [0u8; 4];
        let mut at = usize::from(bits / 8);
        for byte in &mut host {
            if at == 8 {
                at += 1;
            }
            *byte = octets[at];
            at += 1;
        }
        let suffix = &octets[at..];
        (octets[8] == 0 && suffix.iter().all(|&byte| byte == 0))
            .then(|| std::net::Ipv4Addr::from(host))
    }

    /// `group` for the rest: an IPv4 address under a shorter prefix, or an IPv6 address.
    #[inline(never)]
    fn group_by_prefix(&self, ip: IpAddr) -> Key {
        if let IpAddr::V6(v6) = ip
            && let Some(v4) = translated_ipv4(v6).or_else(|| self.nat64_host(v6))
        {
            return self.group(IpAddr::V4(v4));
        }
        Key::from_compact(match ip {
            IpAddr::V6(v6) if self.ipv6_prefix == 128 => format_compact!("ip:{v6}"),
            IpAddr::V4(v4) => match Ipv4Net::new(v4, self.ipv4_prefix) {
                Ok(net) => format_compact!("ip:{}", net.trunc()),
                Err(_) => format_compact!("ip:{v4}"),
            },
            IpAddr::V6(v6) => match Ipv6Net::new(v6, self.ipv6_prefix) {
                Ok(net) => format_compact!("ip:{}", net.trunc()),
                Err(_) => format_compact!("ip:{v6}"),
            },
        })
    }
}

/// The mask of a prefix `bits` long (1 to 128) over an IPv6 address as a number.
fn prefix_mask(bits: u8) -> u128 {
    u128::MAX << (128 - u32::from(bits))
}

/// The IPv4 host behind an address of the well-known NAT64 prefix `64:ff9b::/96`
/// (RFC 6052, section 2.1): a stateless translator in front of an IPv6-only server shows
/// each IPv4 client so, and each is a host of its own, not one /64. Or behind a 6to4
/// address, `2002:V4ADDR::/48` (RFC 3056, section 2): the site of one IPv4 host, which
/// would hold 65,536 /64s. Or behind a Teredo address (RFC 4380): one client, whose /64
/// is its Teredo server's, shared with every other client of that server.
fn translated_ipv4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let octets = v6.octets();
    if octets[..12] == [0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0] {
        return Some(std::net::Ipv4Addr::new(
            octets[12], octets[13], octets[14], octets[15],
        ));
    }
    // Teredo, `2001:0::/32` (RFC 4380, section 4): the server's IPv4 address, then flags
    // and the client's port, then the client's public IPv4 address with every bit
    // inverted. By /64 every client of one Teredo server shared one key.
    if octets[..4] == [0x20, 0x01, 0, 0] {
        return Some(std::net::Ipv4Addr::new(
            !octets[12],
            !octets[13],
            !octets[14],
            !octets[15],
        ));
    }
    (octets[..2] == [0x20, 0x02])
        .then(|| std::net::Ipv4Addr::new(octets[2], octets[3], octets[4], octets[5]))
}

/// The error of a request that carries no peer address: the server is set up wrong.
#[cold]
#[inline(never)]
fn no_peer() -> KeyError {
    #[cfg(feature = "axum")]
    const WHY: &str = "no peer address: serve with \
        into_make_service_with_connect_info::<SocketAddr>() or insert a SocketAddr extension";
    // An axum app's `ConnectInfo` is read only with the feature: without it, the error
    // names that, not the connect-info serving the app may well use.
    #[cfg(all(not(feature = "axum"), not(feature = "tonic")))]
    const WHY: &str = "no peer address: tollgate's `axum` feature is off, so axum's \
        ConnectInfo is not read (enable it, or insert a SocketAddr extension)";
    #[cfg(all(not(feature = "axum"), feature = "tonic"))]
    const WHY: &str = "no peer address: no tonic TcpConnectInfo (serve with tonic's \
        Server) and no SocketAddr extension; axum's ConnectInfo is read only with \
        tollgate's `axum` feature, which is off";
    KeyError::server(WHY)
}

impl KeyExtractor for ClientIp {
    #[inline]
    fn extract(&self, parts: &Parts) -> Result<Key, KeyError> {
        if self.trusted.is_empty() && sampled() {
            self.peer_beside_forwarding(parts);
        }
        self.client_addr(parts).map(|ip| self.group(ip))
    }

    fn client_ip(&self) -> Option<&ClientIp> {
        Some(self)
    }
}

/// Each octet's decimal digits, left-aligned in three bytes, and how many there are.
static OCTETS: [([u8; 3], u8); 256] = {
    let mut table = [([0u8; 3], 0u8); 256];
    let mut index = 0;
    while index < 256 {
        let octet = index as u8;
        table[index] = if octet >= 100 {
            (
                [
                    b'0' + octet / 100,
                    b'0' + octet / 10 % 10,
                    b'0' + octet % 10,
                ],
                3,
            )
        } else if octet >= 10 {
            ([b'0' + octet / 10, b'0' + octet % 10, 0], 2)
        } else {
            ([b'0' + octet, 0, 0], 1)
        };
        index += 1;
    }
    table
};

/// `ip:a.b.c.d`, written into a stack buffer from a table of the octets' digits: no
/// formatting machinery, no branch per digit. This runs on every request.
#[inline]
fn ipv4_key(ip: std::net::Ipv4Addr) -> compact_str::CompactString {
    // "ip:" and four octets of up to three digits, each followed by a dot.
    let mut buffer = [0u8; 3 + 4 * 4];
    buffer[..3].copy_from_slice(b"ip:");
    let mut len = 3;
    for octet in ip.octets() {
        let (digits, count) = &OCTETS[usize::from(octet)];
        buffer[len..len + 3].copy_from_slice(digits);
        len += usize::from(*count);
        buffer[len] = b'.';
        len += 1;
    }
    // Only ASCII digits, dots and "ip:" were written; the last dot is not the key's.
    let text = std::str::from_utf8(&buffer[..len - 1]).unwrap_or("ip:?");
    compact_str::CompactString::new(text)
}

fn peer_addr(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    // tonic's server records each connection's peer so (feature `tonic`).
    #[cfg(feature = "tonic")]
    if let Some(address) = parts
        .extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(tonic::transport::server::TcpConnectInfo::remote_addr)
    {
        return Some(address.ip());
    }
    // Not a bare `IpAddr`: middleware may have put one there from a client's header.
    parts.extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The entries of a forwarding header, right to left, across all its lines: `Some(ip)`
/// for an address, `None` for anything else.
struct ForwardedHops<'a> {
    lines: std::iter::Rev<http::header::ValueIter<'a, http::HeaderValue>>,
    /// The members of the current line, split as bytes: a member that is not text spoils
    /// only itself, not the hops a proxy appended to its right.
    current: Option<Members<'a>>,
    header: ForwardedHeader,
}

/// The members of one header line, right to left.
enum Members<'a> {
    /// `X-Forwarded-For`: plain addresses, split at every comma.
    Plain(std::iter::Rev<CommaSplit<'a>>),
    /// `Forwarded`: elements, peeled off the end of the line.
    Elements(Peeler<'a>),
}

type CommaSplit<'a> = std::slice::Split<'a, u8, fn(&u8) -> bool>;

fn is_comma(byte: &u8) -> bool {
    *byte == b','
}

/// Where a reader of a quoted string (RFC 9110, section 5.6.4) is: outside one, inside
/// one, or just after a backslash inside one (the next byte is taken as it is).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scan {
    Outside,
    Quoted,
    Escaped,
}

impl Scan {
    fn after(self, byte: u8) -> Scan {
        match (self, byte) {
            (Scan::Outside, b'"') | (Scan::Escaped, _) => Scan::Quoted,
            (Scan::Outside, _) => Scan::Outside,
            (Scan::Quoted, b'\\') => Scan::Escaped,
            (Scan::Quoted, b'"') => Scan::Outside,
            (Scan::Quoted, _) => Scan::Quoted,
        }
    }
}

/// `bytes` split at each `separator` outside a quoted string. A quote left open runs to
/// the end: the last piece keeps it, and whoever reads the piece finds it open.
fn split_outside_quotes(bytes: &[u8], separator: u8) -> Vec<&[u8]> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut scan = Scan::Outside;
    for (at, &byte) in bytes.iter().enumerate() {
        if scan == Scan::Outside && byte == separator {
            pieces.push(&bytes[start..at]);
            start = at + 1;
        } else {
            scan = scan.after(byte);
        }
    }
    pieces.push(&bytes[start..]);
    pieces
}

/// Where a reader of one `Forwarded` element is, byte by byte (RFC 7239, section 4:
/// pairs `name=value` separated by `;`, a value a token or a quoted string as in RFC 9110,
/// section 5.6.4; with the whitespace around names, values and pairs that
/// [`forwarded_pairs`] trims). It accepts what `forwarded_pairs` does, but for a
/// parameter given twice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    PairStart,
    Name,
    NameEnd,
    ValueStart,
    Token,
    Quoted,
    Escaped,
    ValueEnd,
}

impl Read {
    const ALL: [Read; 8] = [
        Read::PairStart,
        Read::Name,
        Read::NameEnd,
        Read::ValueStart,
        Read::Token,
        Read::Quoted,
        Read::Escaped,
        Read::ValueEnd,
    ];

    /// The state after `byte`; `None` where the element cannot go on (a comma outside a
    /// quoted string ends it).
    fn after(self, byte: u8) -> Option<Read> {
        let space = byte.is_ascii_whitespace();
        let token = is_token_byte(byte);
        Some(match self {
            Read::PairStart if space || byte == b';' => Read::PairStart,
            Read::PairStart | Read::Name if token => Read::Name,
            Read::Name | Read::NameEnd if space => Read::NameEnd,
            Read::Name | Read::NameEnd if byte == b'=' => Read::ValueStart,
            Read::ValueStart if space => Read::ValueStart,
            Read::ValueStart if byte == b'"' => Read::Quoted,
            Read::ValueStart | Read::Token | Read::ValueEnd if byte == b';' => Read::PairStart,
            Read::ValueStart | Read::Token if token => Read::Token,
            Read::Token | Read::ValueEnd if space => Read::ValueEnd,
            Read::Quoted if byte == b'"' => Read::ValueEnd,
            Read::Quoted if byte == b'\\' => Read::Escaped,
            Read::Quoted | Read::Escaped => Read::Quoted,
            _ => return None,
        })
    }

    fn accepts(self) -> bool {
        matches!(
            self,
            Read::PairStart | Read::ValueStart | Read::Token | Read::ValueEnd
        )
    }
}

/// No well-formed tail ends here.
const NO_TAIL: u32 = u32::MAX;

/// The elements of one `Forwarded` line, peeled off its end: each is the shortest tail
/// (after a comma) of what is left that is well-formed on its own; `Some(None)` when what
/// is left ends in no well-formed element (the walk stops there).
///
/// On a well-formed line that is a split at the commas outside quoted strings. It is also
/// what a proxy wrote when it appended `, element` to a line a client sent (rather than
/// adding a line of its own), whatever the client left open before it: no tail that
/// starts inside a value the proxy quoted is well-formed, as the value's closing quote is
/// then the tail's last quote and every quote before it in the value is escaped, so none
/// opens a value that the closing one would end.
///
/// One pass, linear in the line: all tails are read at once, and tails whose readers are
/// in the same state read alike from there on, so only the latest start per state is
/// kept; before each comma (and at the end) the latest start in an accepting state is
/// the shortest well-formed tail of the line up to there.
struct Peeler<'a> {
    line: &'a [u8],
    /// For each comma's position, and the line's length: where the shortest well-formed
    /// tail of the line up to there starts ([`NO_TAIL`] for none). What is read of a line
    /// is at most [`MAX_FORWARDED_LINE`] long: positions fit in 32 bits.
    tails: Vec<(u32, u32)>,
    /// The end of what is left to peel.
    end: Option<usize>,
}

impl<'a> Peeler<'a> {
    fn new(line: &'a [u8]) -> Self {
        // Past the bound, only its end is read, and a tail may start only after a comma
        // in it (where the cut falls is no element's start).
        let cut = line.len() > MAX_FORWARDED_LINE;
        let line = &line[line.len().saturating_sub(MAX_FORWARDED_LINE)..];
        let mut starts = [None; Read::ALL.len()];
        if !cut {
            starts[Read::PairStart as usize] = Some(0);
        }
        let shortest = |starts: &[Option<usize>; Read::ALL.len()]| {
            Read::ALL
                .iter()
                .filter(|state| state.accepts())
                .filter_map(|&state| starts[state as usize])
                .max()
        };
        let position = |at: usize| u32::try_from(at).unwrap_or(NO_TAIL);
        let tail = |start: Option<usize>| start.map_or(NO_TAIL, position);
        let mut tails = Vec::new();
        for (at, &byte) in line.iter().enumerate() {
            if byte == b',' {
                tails.push((position(at), tail(shortest(&starts))));
            }
            let mut next = [None; Read::ALL.len()];
            for state in Read::ALL {
                if let (Some(start), Some(after)) = (starts[state as usize], state.after(byte)) {
                    let slot = &mut next[after as usize];
                    *slot = (*slot).max(Some(start));
                }
            }
            if byte == b',' {
                next[Read::PairStart as usize] = Some(at + 1);
            }
            starts = next;
        }
        tails.push((position(line.len()), tail(shortest(&starts))));
        Self {
            line,
            tails,
            end: Some(line.len()),
        }
    }
}

impl<'a> Iterator for Peeler<'a> {
    type Item = Option<&'a [u8]>;

    fn next(&mut self) -> Option<Option<&'a [u8]>> {
        let end = self.end?;
        let start = u32::try_from(end)
            .ok()
            .and_then(|end| self.tails.binary_search_by_key(&end, |&(end, _)| end).ok())
            .map(|index| self.tails[index].1)
            .filter(|&start| start != NO_TAIL)
            .map(|start| start as usize);
        // A tail starts at the line's start or just after a comma.
        self.end = start.and_then(|start| start.checked_sub(1));
        Some(start.map(|start| &self.line[start..end]))
    }
}

/// One request in [`SAMPLE`] on each thread (the first among them): a check of the
/// request's headers that is not worth its cost on every one.
#[inline]
fn sampled() -> bool {
    thread_local! {
        static SEEN: std::cell::Cell<u16> = const { std::cell::Cell::new(0) };
    }
    SEEN.with(|seen| {
        let count = seen.get();
        seen.set((count + 1) % SAMPLE);
        count == 0
    })
}

/// How many requests one [`sampled`] stands for: behind a proxy, every request carries
/// its forwarding header, and the first sampled one says so.
const SAMPLE: u16 = 256;

impl ClientIp {
    /// A key that trusts no proxy, reading a request that carries `X-Forwarded-For` or
    /// `Forwarded`: behind a proxy (a load balancer, an ingress, a sidecar), every client
    /// has the proxy's address, and one budget. Said once per key (a layer's), at warn
    /// level; a server facing clients directly may ignore it (they wrote the header).
    #[cold]
    fn peer_beside_forwarding(&self, parts: &Parts) {
        use std::sync::atomic::Ordering;
        let forwarded = || {
            parts
                .headers
                .contains_key(ForwardedHeader::XForwardedFor.name())
                || parts
                    .headers
                    .contains_key(ForwardedHeader::Forwarded.name())
        };
        let say = !self.said_forwarded.load(Ordering::Relaxed)
            && forwarded()
            && !self.said_forwarded.swap(true, Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        if say {
            tracing::warn!(
                target: "tollgate",
                "requests carry X-Forwarded-For or Forwarded, but the key is the socket \
                 peer's address (ClientIp::peer, the layer's default key): behind a proxy or \
                 a load balancer every client has its address, and one budget; key by \
                 ClientIp::behind_proxies([its networks]). (Where clients connect \
                 directly, they wrote the header, and this is nothing.) Said once"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = say;
    }
}

/// A trusted proxy named its client in the forwarding header the key does not read: said
/// once per process (a proxy configured otherwise than the key sends every request so).
#[cold]
fn forwarded_elsewhere(read: &str, written: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    #[cfg(feature = "tracing")]
    tracing::warn!(
        target: "tollgate",
        read,
        written,
        "a trusted proxy forwards its clients in {written}, but the key reads {read}: \
         their requests are keyed by the proxy's address (set ClientIp::forwarded_header)"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = (read, written);
}

/// Whether `header` names a client: an `X-Forwarded-For` member, or a `Forwarded`
/// element with `for` (an address, `unknown` or an obfuscated identifier alike: RFC 7239
/// section 6), or one that is malformed (it cannot be read to name nobody). A `Forwarded`
/// element without `for` (`proto=https`) names no one.
fn names_a_client(headers: &HeaderMap, header: ForwardedHeader) -> bool {
    let mut lines = headers.get_all(header.name()).iter().rev();
    match header {
        ForwardedHeader::XForwardedFor => lines.any(|line| {
            line.as_bytes()
                .split(|&byte| byte == b',')
                .any(|member| !member.trim_ascii().is_empty())
        }),
        ForwardedHeader::Forwarded => lines.any(|line| {
            // An empty element is well-formed, with no `for`.
            Peeler::new(line.as_bytes()).any(|element| {
                element.is_none_or(|element| !matches!(forwarded_pairs(element), Ok(None)))
            })
        }),
    }
}

impl ForwardedHeader {
    /// The header's name.
    fn name(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        }
    }

    /// The other forwarding header.
    fn other(self) -> Self {
        match self {
            ForwardedHeader::XForwardedFor => ForwardedHeader::Forwarded,
            ForwardedHeader::Forwarded => ForwardedHeader::XForwardedFor,
        }
    }
}

impl<'a> ForwardedHops<'a> {
    fn new(headers: &'a HeaderMap, header: ForwardedHeader) -> Self {
        Self {
            lines: headers.get_all(header.name()).iter().rev(),
            current: None,
            header,
        }
    }
}

impl Iterator for ForwardedHops<'_> {
    type Item = Option<IpAddr>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match &mut self.current {
                Some(Members::Plain(entries)) => {
                    if let Some(entry) = entries.next() {
                        let entry = entry.trim_ascii();
                        if entry.is_empty() {
                            // "a,,b" or a trailing comma: skip empty list members.
                            continue;
                        }
                        // Not text: not an address.
                        return Some(std::str::from_utf8(entry).ok().and_then(parse_node));
                    }
                }
                Some(Members::Elements(elements)) => match elements.next() {
                    Some(Some(element)) if element.trim_ascii().is_empty() => continue,
                    Some(Some(element)) => return Some(parse_forwarded_element(element)),
                    // What is left of the line ends in no element: the walk stops here.
                    Some(None) => return Some(None),
                    None => {}
                },
                _ => {}
            }
            let line = self.lines.next()?.as_bytes();
            self.current = Some(match self.header {
                ForwardedHeader::XForwardedFor => {
                    let split: fn(&u8) -> bool = is_comma;
                    Members::Plain(line.split(split).rev())
                }
                // Each line on its own: a quote a client left open on its line does not
                // swallow the line a proxy added after it.
                ForwardedHeader::Forwarded => Members::Elements(Peeler::new(line)),
            });
        }
    }
}

/// An IPv4-mapped IPv6 block (`::ffff:10.0.0.0/104`) as the IPv4 block it stands for:
/// peers are compared in canonical form, where a mapped address is IPv4.
pub(crate) fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        other => other,
    }
}

/// The address in `for=` of one RFC 7239 element (`for=192.0.2.60;proto=http;by=203.0.113.43`);
/// `None` for a malformed element (see [`forwarded_pairs`]), one without `for`, or a
/// `for` that is no address (`unknown`, an obfuscated identifier).
fn parse_forwarded_element(element: &[u8]) -> Option<IpAddr> {
    let found = forwarded_pairs(element).ok()??;
    parse_node(std::str::from_utf8(&found).ok()?)
}

/// One RFC 7239 element read by the grammar of section 4: pairs split at the semicolons
/// outside quoted strings, each value a token or a whole quoted string; `Ok` with the
/// value of `for` (unescaped), if any. An element that breaks the grammar (a quote left
/// open or inside a token, a pair without `=`, `for`, `by`, `host` or `proto` given
/// twice) is `Err`: a proxy writes well-formed elements, so a broken one holds nothing to
/// believe. An empty element is well-formed, with no `for`.
fn forwarded_pairs(element: &[u8]) -> Result<Option<std::borrow::Cow<'_, [u8]>>, ()> {
    let mut found = None;
    // The parameters RFC 7239 defines, each allowed once per element.
    let mut seen = [false; 4];
    for pair in split_outside_quotes(element, b';') {
        let pair = pair.trim_ascii();
        if pair.is_empty() {
            // The grammar allows empty pairs: `for=192.0.2.60;;proto=http`.
            continue;
        }
        let at = pair.iter().position(|&b| b == b'=').ok_or(())?;
        let name = pair[..at].trim_ascii();
        let value = unquote(pair[at + 1..].trim_ascii()).ok_or(())?;
        if !is_token(name) {
            return Err(());
        }
        let known = [&b"for"[..], b"by", b"host", b"proto"]
            .iter()
            .position(|known| name.eq_ignore_ascii_case(known));
        if let Some(known) = known {
            if std::mem::replace(&mut seen[known], true) {
                return Err(());
            }
            if known == 0 {
                found = Some(value);
            }
        }
    }
    Ok(found)
}

/// A token (RFC 9110, section 5.6.2), and for an address written unquoted, `:`, `[`
/// and `]` too (the RFC asks for quotes there; some proxies leave them out).
fn is_token(bytes: &[u8]) -> bool {
    !bytes.is_empty() && bytes.iter().all(|&b| is_token_byte(b))
}

fn is_token_byte(byte: u8) -> bool {
    super::is_tchar(byte) || b":[]".contains(&byte)
}

/// A parameter's value: a token as it is, a quoted string without its quotes and
/// escapes; `None` for a quote inside a token or a quoted string left open or followed
/// by anything.
fn unquote(value: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    let Some(inner) = value.strip_prefix(b"\"") else {
        // RFC 7239 allows an empty value only as a quoted string; an empty token is
        // read as empty all the same.
        return (value.is_empty() || is_token(value)).then_some(std::borrow::Cow::Borrowed(value));
    };
    let mut unescaped: Option<Vec<u8>> = None;
    let mut bytes = inner.iter().enumerate();
    while let Some((at, &byte)) = bytes.next() {
        match byte {
            b'"' => {
                // The closing quote must end the value.
                return (at + 1 == inner.len()).then(|| match unescaped {
                    Some(unescaped) => std::borrow::Cow::Owned(unescaped),
                    None => std::borrow::Cow::Borrowed(&inner[..at]),
                });
            }
            b'\\' => {
                let (_, &next) = bytes.next()?;
                unescaped
                    .get_or_insert_with(|| inner[..at].to_vec())
                    .push(next);
            }
            byte => {
                if let Some(unescaped) = &mut unescaped {
                    unescaped.push(byte);
                }
            }
        }
    }
    // Left open.
    None
}

/// An address with an optional port: `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`,
/// `[2001:db8::1]`, `[2001:db8::1]:80`, and with an obfuscated port (RFC 7239, section
/// 6: `obfport = "_" 1*(ALPHA / DIGIT / "." / "_" / "-")`): `192.0.2.1:_p1`,
/// `[2001:db8::1]:_p1`. `unknown` and `_obfuscated` are not addresses.
fn parse_node(node: &str) -> Option<IpAddr> {
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(addr) = node.parse::<SocketAddr>() {
        return Some(addr.ip());
    }
    let host = match node.rsplit_once(':') {
        Some((host, port)) if is_obfuscated_port(port) => host,
        _ => node,
    };
    if let Some(inner) = host
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
    {
        return inner.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6);
    }
    // Without brackets, only an IPv4 address can carry a port.
    (host.len() < node.len())
        .then(|| host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4))
        .flatten()
}

/// RFC 7239's `obfport`: `_` then one or more of `A-Z a-z 0-9 . _ -`.
fn is_obfuscated_port(port: &str) -> bool {
    port.strip_prefix('_').is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    })
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    /// A prefix of 0 grouped every client of the family as one, where `behind_proxies`
    /// and `Bypass` refuse `/0` for that very reason.
    #[test]
    #[should_panic(expected = "ipv6_prefix(0) keys every IPv6 client as one")]
    fn an_ipv6_prefix_of_nothing_is_refused() {
        let _ = ClientIp::peer().ipv6_prefix(0);
    }

    #[test]
    #[should_panic(expected = "ipv4_prefix(0) keys every IPv4 client as one")]
    fn an_ipv4_prefix_of_nothing_is_refused() {
        let _ = ClientIp::peer().ipv4_prefix(0);
    }

    fn parts(peer: &str, headers: &[(&str, &[u8])]) -> Parts {
        let mut builder = Request::get("/");
        for (name, value) in headers {
            builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        let mut request = builder.body(()).unwrap();
        request
            .extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        request.into_parts().0
    }

    fn client(ip: &ClientIp, peer: &str, headers: &[(&str, &[u8])]) -> String {
        ip.extract(&parts(peer, headers)).unwrap().to_string()
    }

    /// The peer is read only from where a server records it (axum's `ConnectInfo`,
    /// tonic's connection info, a `SocketAddr`). A bare `IpAddr` extension is no peer:
    /// middleware that puts one there may have read it from a client's header
    /// (`X-Real-IP`), and taking it for the socket's would let clients choose their key
    /// (and a network bypass).
    #[test]
    fn a_bare_ip_address_extension_is_no_peer() {
        let mut request = Request::get("/").body(()).unwrap();
        request.extensions_mut().insert(IpAddr::from([10, 0, 0, 1]));
        let parts = request.into_parts().0;
        let error = ClientIp::peer().extract(&parts).unwrap_err();
        assert_eq!(error.kind(), crate::key::KeyErrorKind::Server);
        assert!(error.to_string().contains("no peer address"), "{error}");
    }

    /// An axum app whose build left tollgate's `axum` feature off (`default-features =
    /// false`) has its `ConnectInfo` unread: every request is refused 500, and the error
    /// must name that cause, not ask for the `into_make_service_with_connect_info` the
    /// app already uses.
    #[cfg(not(feature = "axum"))]
    #[test]
    fn without_the_axum_feature_a_missing_peer_names_it() {
        let parts = Request::get("/").body(()).unwrap().into_parts().0;
        let error = ClientIp::peer().extract(&parts).unwrap_err();
        assert!(error.to_string().contains("`axum` feature"), "{error}");
    }

    #[test]
    fn spoofing_matrix() {
        let xff = ClientIp::behind_proxies(["10.0.0.0/8", "2001:db8:ffff::/48"]).unwrap();
        let fwd = xff.clone().forwarded_header(ForwardedHeader::Forwarded);
        let peer = ClientIp::peer();
        type Case<'a> = (&'a ClientIp, &'a str, &'a [(&'a str, &'a [u8])], &'a str);
        let cases: &[Case<'_>] = &[
            // An untrusted peer's headers are ignored.
            (
                &xff,
                "203.0.113.9:1",
                &[("x-forwarded-for", b"1.1.1.1")],
                "ip:203.0.113.9",
            ),
            (
                &peer,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"1.1.1.1")],
                "ip:10.0.0.1",
            ),
            // The spoofed leftmost entry is skipped; the hop the proxy wrote is the client.
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"6.6.6.6, 198.51.100.4")],
                "ip:198.51.100.4",
            ),
            // Several lines are one list, in order.
            (
                &xff,
                "10.0.0.1:1",
                &[
                    ("x-forwarded-for", b"6.6.6.6"),
                    ("x-forwarded-for", b"198.51.100.4, 10.1.1.1"),
                ],
                "ip:198.51.100.4",
            ),
            // Malformed entries stop the walk at the last good address.
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"6.6.6.6, garbage")],
                "ip:10.0.0.1",
            ),
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"6.6.6.6, garbage, 10.0.0.7")],
                "ip:10.0.0.7",
            ),
            // Bytes that are not text spoil only their own entry: the hop the proxy
            // appended to a client's garbage is still read (not the proxy's address,
            // which every such client would share).
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"\xff\xfe, 6.6.6.6")],
                "ip:6.6.6.6",
            ),
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"1.1.1.1, \xff, 10.0.0.9, 6.6.6.6")],
                "ip:6.6.6.6",
            ),
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"6.6.6.6, \xff")],
                "ip:10.0.0.1",
            ),
            // Empty members and ports.
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"198.51.100.4:5555,,")],
                "ip:198.51.100.4",
            ),
            // All hops trusted: the leftmost trusted one.
            (
                &xff,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"10.9.9.9, 10.0.0.2")],
                "ip:10.9.9.9",
            ),
            // RFC 7239 with quoted IPv6 and a port, grouped by /64.
            (
                &fwd,
                "10.0.0.1:1",
                &[(
                    "forwarded",
                    b"for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https",
                )],
                "ip:2001:db8:cafe::/64",
            ),
            // RFC 7239 section 6: a node's port may be obfuscated (`obfport`); the
            // address is still the client's.
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=\"198.51.100.4:_p1\"")],
                "ip:198.51.100.4",
            ),
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=\"[2001:db8:cafe::17]:_p.x-1\"")],
                "ip:2001:db8:cafe::/64",
            ),
            // Not a port, obfuscated or not: not an address either.
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=\"198.51.100.4:_\"")],
                "ip:10.0.0.1",
            ),
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=\"198.51.100.4:_p!\"")],
                "ip:10.0.0.1",
            ),
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=6.6.6.6, for=unknown")],
                "ip:10.0.0.1",
            ),
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=6.6.6.6, For=_hidden")],
                "ip:10.0.0.1",
            ),
            (
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"by=1.2.3.4")],
                "ip:10.0.0.1",
            ),
            // The other header is not read.
            (
                &fwd,
                "10.0.0.1:1",
                &[("x-forwarded-for", b"6.6.6.6")],
                "ip:10.0.0.1",
            ),
            // IPv4-mapped IPv6 peers count as IPv4.
            (&peer, "[::ffff:192.0.2.5]:1", &[], "ip:192.0.2.5"),
            // IPv6 trusted proxy.
            (
                &xff,
                "[2001:db8:ffff::1]:1",
                &[("x-forwarded-for", b"2001:db8:1:2:3:4:5:6")],
                "ip:2001:db8:1:2::/64",
            ),
        ];
        for (extractor, peer, headers, expected) in cases {
            assert_eq!(
                &client(extractor, peer, headers),
                expected,
                "peer {peer} headers {headers:?}"
            );
        }
    }

    /// RFC 7239, section 4: a parameter's value is a token or a quoted string, and a
    /// quoted string (RFC 9110, section 5.6.4) may hold commas, semicolons, equals signs
    /// and backslash-escaped quotes. A proxy that writes the client's `Host` into `host=`
    /// quotes it, so what the client wrote there must not be read as elements or pairs.
    #[test]
    fn forwarded_quoted_strings_are_read_whole() {
        let fwd = ClientIp::behind_proxies(["10.0.0.0/8"])
            .unwrap()
            .forwarded_header(ForwardedHeader::Forwarded);
        let cases: &[(&[u8], &str)] = &[
            // A comma and a `for=` inside the proxy's quoted `host`, after its `for`...
            (
                b"for=203.0.113.5;host=\"x,for=6.6.6.6;y=z\";proto=https",
                "ip:203.0.113.5",
            ),
            // ... and before it.
            (
                b"host=\"x,for=6.6.6.6;y=z\";for=203.0.113.5",
                "ip:203.0.113.5",
            ),
            // A harmless comma does not make the client the proxy.
            (b"for=203.0.113.5;host=\"a,b\"", "ip:203.0.113.5"),
            // A semicolon inside a quoted string does not start a pair.
            (b"for=203.0.113.5;host=\"a;for=6.6.6.6\"", "ip:203.0.113.5"),
            // An escaped quote does not end the string (quoted-pair).
            (
                b"for=203.0.113.5;host=\"a\\\",for=6.6.6.6;x=\\\"\"",
                "ip:203.0.113.5",
            ),
            // An escaped backslash does, and the element goes on.
            (
                b"host=\"a\\\\\";for=203.0.113.5, for=10.0.0.2",
                "ip:203.0.113.5",
            ),
            // A quoted-pair in the address itself is unescaped.
            (
                b"for=\"\\[2001:db8:cafe::17\\]:4711\"",
                "ip:2001:db8:cafe::/64",
            ),
            // A client that leaves a quote open, and a proxy that appends its element
            // to the client's line: the proxy's element is still read...
            (b"for=6.6.6.6;x=\", for=203.0.113.5", "ip:203.0.113.5"),
            (
                b"for=6.6.6.6;x=\"\\, for=\"[2001:db8:cafe::17]:4711\";host=\"a,b\"",
                "ip:2001:db8:cafe::/64",
            ),
            // ... and the client's part, when the proxy's address is trusted, stops the
            // walk (never an address inside the string, nor the line before).
            (b"for=6.6.6.6;x=\", for=10.0.0.3", "ip:10.0.0.3"),
            // A quote left open in the last element itself: malformed, and the walk
            // stops at the proxy.
            (b"for=6.6.6.6, for=1.2.3.4;host=\"abc", "ip:10.0.0.1"),
            // A quote inside a token is malformed too.
            (b"for=6.6.6.6, for=1.2.3.4;host=a\"b", "ip:10.0.0.1"),
            // A parameter given twice in one element (section 4: "MUST NOT occur more
            // than once"): which one the proxy meant is unknown.
            (b"for=6.6.6.6;for=203.0.113.5", "ip:10.0.0.1"),
            // Empty pairs are allowed by the grammar; parameter names are
            // case-insensitive.
            (b"proto=https;;FOR=203.0.113.5;", "ip:203.0.113.5"),
        ];
        for (line, expected) in cases {
            assert_eq!(
                &client(&fwd, "10.0.0.1:1", &[("forwarded", line)]),
                expected,
                "{}",
                String::from_utf8_lossy(line)
            );
        }
        // A malformed start of a line stops the walk: it does not go on to the line
        // before.
        assert_eq!(
            client(
                &fwd,
                "10.0.0.1:1",
                &[
                    ("forwarded", b"for=6.6.6.6"),
                    ("forwarded", b"x=\", for=10.0.0.3"),
                ]
            ),
            "ip:10.0.0.3"
        );
        // Lines are read apart: a quote left open on the client's line does not swallow
        // the line the proxy added.
        assert_eq!(
            client(
                &fwd,
                "10.0.0.1:1",
                &[
                    ("forwarded", b"for=6.6.6.6;host=\"a, for=7.7.7.7"),
                    ("forwarded", b"for=203.0.113.5;host=\"b,c\""),
                ]
            ),
            "ip:203.0.113.5"
        );
        // A line past what is read (64 KiB): its end is read alike, and an element that
        // starts before the cut is malformed, stopping the walk at the last good hop.
        let padded = ",".repeat(70_000) + ", for=203.0.113.9";
        assert_eq!(
            client(&fwd, "10.0.0.1:1", &[("forwarded", padded.as_bytes())]),
            "ip:203.0.113.9"
        );
        let spanning = format!(
            "for=198.51.100.1;host=\"{}\", for=10.0.0.7",
            "a".repeat(70_000)
        );
        assert_eq!(
            client(&fwd, "10.0.0.1:1", &[("forwarded", spanning.as_bytes())]),
            "ip:10.0.0.7"
        );
        // However long the proxy's element (a long `Host`, every quote in it escaped),
        // alone on its line or appended to what the client left open.
        let long = format!(
            "for=203.0.113.5;host=\"{}\";proto=https",
            "\\\",".repeat(3_000)
        );
        for line in [long.clone(), format!("for=6.6.6.6;x=\"\\, {long}")] {
            assert_eq!(
                client(&fwd, "10.0.0.1:1", &[("forwarded", line.as_bytes())]),
                "ip:203.0.113.5"
            );
        }
        // Bytes that are not text inside a quoted `host` (RFC 9110's obs-text) do not
        // spoil the proxy's element.
        assert_eq!(
            client(
                &fwd,
                "10.0.0.1:1",
                &[("forwarded", b"for=203.0.113.5;host=\"caf\xe9,x\"")]
            ),
            "ip:203.0.113.5"
        );
    }

    /// The peeler's one-pass automaton against the definition it stands for: each element
    /// is the shortest tail (after a comma) of what is left that reads as pairs by the
    /// grammar (`split_outside_quotes`, `is_token`, `unquote`), tried one by one. Every
    /// line of up to 12 bytes drawn from the bytes that matter, 400,000 of them.
    #[test]
    fn the_peeler_finds_the_shortest_well_formed_tails() {
        fn pairs_read(tail: &[u8]) -> bool {
            split_outside_quotes(tail, b';').into_iter().all(|pair| {
                let pair = pair.trim_ascii();
                pair.is_empty()
                    || pair.iter().position(|&b| b == b'=').is_some_and(|at| {
                        is_token(pair[..at].trim_ascii())
                            && unquote(pair[at + 1..].trim_ascii()).is_some()
                    })
            })
        }
        fn one_by_one(line: &[u8]) -> Vec<Option<&[u8]>> {
            let mut elements = Vec::new();
            let mut end = Some(line.len());
            while let Some(before) = end {
                let rest = &line[..before];
                let start = (0..=before)
                    .rev()
                    .filter(|&start| start == 0 || rest[start - 1] == b',')
                    .find(|&start| pairs_read(&rest[start..]));
                elements.push(start.map(|start| &rest[start..]));
                end = start.and_then(|start| start.checked_sub(1));
            }
            elements
        }
        let bytes = b"a=\";,\\ f1";
        let mut state: u64 = 0x1234_5678_9abc_def1;
        let mut draw = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..400_000 {
            let len = (draw() % 13) as usize;
            let line: Vec<u8> = (0..len)
                .map(|_| bytes[(draw() % bytes.len() as u64) as usize])
                .collect();
            let peeled: Vec<Option<&[u8]>> = Peeler::new(&line).collect();
            assert_eq!(
                peeled,
                one_by_one(&line),
                "{}",
                String::from_utf8_lossy(&line)
            );
        }
    }

    #[test]
    fn ipv4_keys_are_written_digit_by_digit() {
        for ip in ["0.0.0.0", "255.255.255.255", "10.0.9.100", "1.22.103.4"] {
            assert_eq!(ipv4_key(ip.parse().unwrap()), format!("ip:{ip}"));
        }
        // Every octet value in every position, as the standard formatting writes it.
        for octet in 0..=255u8 {
            for position in 0..4 {
                let mut octets = [7, 80, 199, 3];
                octets[position] = octet;
                let ip = std::net::Ipv4Addr::from(octets);
                assert_eq!(ipv4_key(ip), format!("ip:{ip}"));
            }
        }
    }

    #[test]
    fn ipv6_prefix_groups_a_subnet() {
        let ip = ClientIp::peer();
        let a = client(&ip, "[2001:db8:1:2::1]:1", &[]);
        let b = client(&ip, "[2001:db8:1:2:ffff:ffff:ffff:ffff]:1", &[]);
        let c = client(&ip, "[2001:db8:1:3::1]:1", &[]);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let exact = ClientIp::peer().ipv6_prefix(128);
        assert_ne!(
            client(&exact, "[2001:db8:1:2::1]:1", &[]),
            client(&exact, "[2001:db8:1:2::2]:1", &[])
        );
        let v4 = ClientIp::peer().ipv4_prefix(24);
        assert_eq!(client(&v4, "192.0.2.77:1", &[]), "ip:192.0.2.0/24");
    }

    /// RFC 6052, section 2.1: `64:ff9b::/96` carries an IPv4 address in its last 32
    /// bits. Each is an IPv4 host of its own; grouped by /64 they all shared one key, so
    /// one IPv4 client could spend the limit of every IPv4 client of an IPv6-only server.
    #[test]
    fn a_translated_ipv4_client_is_keyed_as_its_ipv4_host() {
        let ip = ClientIp::peer();
        assert_eq!(client(&ip, "[64:ff9b::c000:201]:1", &[]), "ip:192.0.2.1");
        assert_eq!(
            client(&ip, "[64:ff9b::c633:6401]:1", &[]),
            "ip:198.51.100.1"
        );
        let v4 = ClientIp::peer().ipv4_prefix(24);
        assert_eq!(client(&v4, "[64:ff9b::c000:277]:1", &[]), "ip:192.0.2.0/24");
        // Beside the prefix, an address of its own /64 as before.
        assert_eq!(
            client(&ip, "[64:ff9b:0:1::c000:201]:1", &[]),
            "ip:64:ff9b:0:1::/64"
        );
    }

    /// RFC 6052, section 2.2: a network-specific prefix (RFC 8215's local-use
    /// `64:ff9b:1::/48`, or an operator's own) carries the IPv4 address after the
    /// prefix, skipping bits 64 to 71. Without `nat64_prefix`, every IPv4 client of a
    /// translator with a /64 or /96 prefix shared one key; with it, each is keyed as its
    /// IPv4 host, for every length the RFC allows (its section 2.4's table: 192.0.2.33
    /// under each).
    #[test]
    fn a_client_behind_a_network_specific_nat64_prefix_is_keyed_as_its_ipv4_host() {
        let local = ClientIp::peer();
        assert_eq!(
            client(&local, "[64:ff9b:1::c000:221]:1", &[]),
            client(&local, "[64:ff9b:1::c633:6407]:1", &[]),
            "one key without the prefix"
        );
        let ip = ClientIp::peer().nat64_prefix("64:ff9b:1::".parse().unwrap(), 96);
        assert_eq!(client(&ip, "[64:ff9b:1::c000:221]:1", &[]), "ip:192.0.2.33");
        assert_eq!(
            client(&ip, "[64:ff9b:1::c633:6407]:1", &[]),
            "ip:198.51.100.7"
        );
        for (prefix, bits, address) in [
            ("2001:db8::", 32, "2001:db8:c000:221::"),
            ("2001:db8:100::", 40, "2001:db8:1c0:2:21::"),
            ("2001:db8:122::", 48, "2001:db8:122:c000:2:2100::"),
            ("2001:db8:122:300::", 56, "2001:db8:122:3c0:0:221::"),
            ("2001:db8:122:344::", 64, "2001:db8:122:344:c0:2:2100:0"),
            ("2001:db8:122:344::", 96, "2001:db8:122:344::192.0.2.33"),
        ] {
            let ip = ClientIp::peer().nat64_prefix(prefix.parse().unwrap(), bits);
            assert_eq!(
                ip.key_for(address.parse().unwrap()).as_str(),
                "ip:192.0.2.33",
                "/{bits}"
            );
            // The IPv4 prefix groups it as any IPv4 client.
            let v4 = ip.clone().ipv4_prefix(24);
            assert_eq!(
                v4.key_for(address.parse().unwrap()).as_str(),
                "ip:192.0.2.0/24"
            );
        }
        // Prefixes within one another: the longest that holds the address reads it.
        let nested = ClientIp::peer()
            .nat64_prefix("2001:db8::".parse().unwrap(), 32)
            .nat64_prefix("2001:db8:122:344::".parse().unwrap(), 96);
        assert_eq!(
            nested
                .key_for("2001:db8:122:344::c000:221".parse().unwrap())
                .as_str(),
            "ip:192.0.2.33"
        );
        assert_eq!(
            nested
                .key_for("2001:db8:c000:221::".parse().unwrap())
                .as_str(),
            "ip:192.0.2.33"
        );
        // An address no translator with that prefix writes (RFC 6052, section 2.2: bits
        // 64 to 71 are zero, and so is the suffix): a length that is not the
        // translator's, read as if it were, would give every client the same made-up
        // IPv4 key. Such an address keeps its /64.
        let wrong = ClientIp::peer().nat64_prefix("64:ff9b:1::".parse().unwrap(), 48);
        assert_eq!(
            wrong
                .key_for("64:ff9b:1::c000:221".parse().unwrap())
                .as_str(),
            "ip:64:ff9b:1::/64"
        );
        let u_octet = ClientIp::peer().nat64_prefix("2001:db8:122:344::".parse().unwrap(), 64);
        assert_eq!(
            u_octet
                .key_for("2001:db8:122:344:1c0:2:2100:0".parse().unwrap())
                .as_str(),
            "ip:2001:db8:122:344::/64"
        );
        // Beside the prefix, an address of its own /64 as before.
        let ip = ClientIp::peer().nat64_prefix("2001:db8:122:344::".parse().unwrap(), 96);
        assert_eq!(
            client(&ip, "[2001:db8:122:345::c000:221]:1", &[]),
            "ip:2001:db8:122:345::/64"
        );
        // Several prefixes.
        let two = ClientIp::peer()
            .nat64_prefix("2001:db8:a::".parse().unwrap(), 96)
            .nat64_prefix("2001:db8:b::".parse().unwrap(), 96);
        assert_eq!(
            client(&two, "[2001:db8:a::c000:221]:1", &[]),
            "ip:192.0.2.33"
        );
        assert_eq!(
            client(&two, "[2001:db8:b::c000:222]:1", &[]),
            "ip:192.0.2.34"
        );
    }

    #[test]
    #[should_panic(expected = "a NAT64 prefix is 32, 40, 48, 56, 64 or 96 bits long")]
    fn a_nat64_prefix_of_another_length_is_refused() {
        let _ = ClientIp::peer().nat64_prefix("2001:db8::".parse().unwrap(), 80);
    }

    /// RFC 6052, section 2.2: bits 64 to 71 of every such address are zero, so a /96
    /// prefix (which holds them) with any of them set names no translator: refused where
    /// it is set up, not read as nothing for every client.
    #[test]
    #[should_panic(expected = "bits 64 to 71 of a NAT64 address are zero")]
    fn a_96_bit_nat64_prefix_with_bits_64_to_71_set_is_refused() {
        let _ = ClientIp::peer().nat64_prefix("2001:db8:122:344:100::".parse().unwrap(), 96);
    }

    /// A client's key spelt outside a request (a `Limiter` sharing its HTTP budget, a
    /// `reset`) is the key its requests get: IPv6 by its /64, IPv4-mapped as IPv4,
    /// translated hosts as their IPv4 host, and what trusted proxies vouch for.
    #[test]
    fn a_clients_key_is_spelt_as_its_requests_are() {
        let ip = ClientIp::peer();
        for peer in [
            "203.0.113.7:1",
            "[2001:db8:1:2::7]:1",
            "[::ffff:203.0.113.7]:1",
            "[64:ff9b::c000:201]:1",
            "[2002:c000:0201::1]:1",
        ] {
            let address: SocketAddr = peer.parse().unwrap();
            assert_eq!(
                ip.key_for(address.ip()).as_str(),
                client(&ip, peer, &[]),
                "{peer}"
            );
        }
        let proxied = ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap();
        assert_eq!(
            proxied.key_for("2001:db8:1:2::9".parse().unwrap()).as_str(),
            client(
                &proxied,
                "10.0.0.2:1",
                &[("x-forwarded-for", b"2001:db8:1:2::7")]
            )
        );
    }

    /// RFC 4380, section 4: a Teredo address is `2001:0::/32`, the Teredo server's IPv4
    /// address, flags, the client's port and the client's public IPv4 address, each of
    /// the last two with every bit inverted. By /64, every client of one Teredo server
    /// shared one key; each is keyed as its public IPv4 host now.
    #[test]
    fn a_teredo_client_is_keyed_as_its_public_ipv4_host() {
        let ip = ClientIp::peer();
        // RFC 4380, section 4's example: server 65.54.227.120, client 192.0.2.45 port
        // 40000.
        assert_eq!(
            client(&ip, "[2001:0:4136:e378:8000:63bf:3fff:fdd2]:1", &[]),
            "ip:192.0.2.45"
        );
        assert_eq!(
            client(&ip, "[2001:0:4136:e378:8000:63bf:3fff:fdd3]:1", &[]),
            "ip:192.0.2.44"
        );
        // Beside the prefix (`2001:db8::/32` is not Teredo's), a /64 as before.
        assert_eq!(
            client(&ip, "[2001:db8:4136:e378:8000:63bf:3fff:fdd2]:1", &[]),
            "ip:2001:db8:4136:e378::/64"
        );
    }

    /// RFC 3056, section 2: a 6to4 site's prefix is `2002:V4ADDR::/48`, made of the
    /// site's IPv4 address. By /64 one IPv4 host held 65,536 keys; it is keyed as that
    /// IPv4 host (the key it has over IPv4).
    #[test]
    fn a_6to4_client_is_keyed_as_its_ipv4_host() {
        let ip = ClientIp::peer();
        assert_eq!(client(&ip, "[2002:c000:201:1::1]:1", &[]), "ip:192.0.2.1");
        assert_eq!(
            client(&ip, "[2002:c000:201:ffff::9]:1", &[]),
            "ip:192.0.2.1"
        );
        let v4 = ClientIp::peer().ipv4_prefix(24);
        assert_eq!(client(&v4, "[2002:c000:277::1]:1", &[]), "ip:192.0.2.0/24");
        // Beside the prefix, an address of its own /64 as before.
        assert_eq!(
            client(&ip, "[2003:c000:201:1::1]:1", &[]),
            "ip:2003:c000:201:1::/64"
        );
    }

    #[test]
    fn invalid_proxies_are_rejected() {
        let err = ClientIp::behind_proxies(["10.0.0.0/8", "ten dot zero"]).unwrap_err();
        assert!(err.to_string().contains("\"ten dot zero\""));
    }

    #[test]
    fn a_missing_peer_is_a_server_error() {
        let (parts, _) = Request::get("/").body(()).unwrap().into_parts();
        let err = ClientIp::peer().extract(&parts).unwrap_err();
        assert_eq!(err.kind(), super::super::KeyErrorKind::Server);
    }

    // A trusted proxy written as an IPv4-mapped IPv6 address or block matches the IPv4
    // peer it stands for (peers are compared in canonical form).
    #[test]
    fn ipv4_mapped_trusted_proxies_match() {
        for entry in ["::ffff:10.0.0.0/104", "::ffff:10.0.0.1", "::ffff:a00:1"] {
            let ip = ClientIp::behind_proxies([entry]).unwrap();
            for peer in ["10.0.0.1:1", "[::ffff:10.0.0.1]:1"] {
                assert_eq!(
                    client(&ip, peer, &[("x-forwarded-for", b"198.51.100.4")]),
                    "ip:198.51.100.4",
                    "{entry} trusts {peer}"
                );
            }
        }
    }
}
