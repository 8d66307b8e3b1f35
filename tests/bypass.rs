//! Bypass: allowlisted networks, keys and requests skip limiting, spend nothing and get
//! no rate-limit headers.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::bypass::Bypass;
use tollgate::key::{ClientIp, HeaderKey};
use tollgate::{Key, MemoryStore, Policy, RateLimitLayer};
use tower::ServiceExt;

fn request(peer: &str, path: &str, api_key: Option<&str>) -> Request<Body> {
    let mut builder = Request::get(path);
    if let Some(key) = api_key {
        builder = builder.header("x-api-key", key);
    }
    let mut request = builder.body(Body::empty()).unwrap();
    let peer: SocketAddr = peer.parse().unwrap();
    request.extensions_mut().insert(ConnectInfo(peer));
    request
}

fn one_per_hour() -> Policy {
    Policy::fixed_window("api", 1, Duration::from_secs(3600)).unwrap()
}

#[tokio::test]
async fn allowed_networks_skip_and_spend_nothing() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::peer())
            .bypass(Bypass::new().network("10.0.0.0/8").network("2001:db8::1")),
    );
    for peer in [
        "10.1.2.3:5000",
        "[2001:db8::1]:5000",
        "[::ffff:10.9.9.9]:5000",
    ] {
        for _ in 0..3 {
            let response = app.clone().oneshot(request(peer, "/", None)).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{peer}");
            // Not limited, so no numbers: no RateLimit fields at all.
            assert!(!response.headers().contains_key("ratelimit"), "{peer}");
            assert!(
                !response.headers().contains_key("ratelimit-policy"),
                "{peer}"
            );
        }
    }
    // Others are limited as usual.
    let first = app
        .clone()
        .oneshot(request("192.0.2.1:1", "/", None))
        .await
        .unwrap();
    // Windows are aligned to the epoch: `t` is what is left of this hour.
    let rate = first.headers()["ratelimit"].to_str().unwrap();
    assert!(rate.starts_with("\"api\";r=0;t="), "{rate}");
    let second = app
        .clone()
        .oneshot(request("192.0.2.1:1", "/", None))
        .await
        .unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let neighbour = app
        .clone()
        .oneshot(request("11.0.0.1:1", "/", None))
        .await
        .unwrap();
    assert_eq!(neighbour.status(), StatusCode::OK);
    assert!(neighbour.headers().contains_key("ratelimit"));
}

#[tokio::test]
async fn allowed_keys_and_requests_skip() {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/healthz", get(|| async { "healthy" }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(one_per_hour())
                .key(HeaderKey::new("x-api-key"))
                .bypass(
                    Bypass::new()
                        .key(Key::hashed("x-api-key", b"monitoring"))
                        .when(|parts| parts.uri.path() == "/healthz"),
                ),
        );
    for _ in 0..3 {
        let response = app
            .clone()
            .oneshot(request("192.0.2.1:1", "/", Some("monitoring")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("ratelimit"));
        // The predicate comes before the key: a health check needs none.
        let health = app
            .clone()
            .oneshot(request("192.0.2.1:1", "/healthz", None))
            .await
            .unwrap();
        assert_eq!(health.status(), StatusCode::OK);
    }
    let customer = || {
        app.clone()
            .oneshot(request("192.0.2.1:1", "/", Some("customer")))
    };
    assert_eq!(customer().await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        customer().await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Without a key, and not allowed otherwise: refused as before.
    let keyless = app
        .clone()
        .oneshot(request("192.0.2.1:1", "/", None))
        .await
        .unwrap();
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
}

#[test]
fn bad_networks_are_refused_with_a_message() {
    let error = Bypass::new().try_network("10.0.0.0/40").unwrap_err();
    assert!(error.contains("10.0.0.0/40"), "{error}");
    assert!(Bypass::new().try_network("not an address").is_err());
    assert!(Bypass::new().try_network(" 192.0.2.7 ").is_ok());
}

/// Behind a load balancer inside the allowlisted network, the bypass reads the client's
/// address as the key does: requests forwarded for an outside client are limited, not all
/// let through because the balancer's own address is allowlisted.
#[tokio::test]
async fn a_network_bypass_reads_the_client_address_as_the_key_does() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap())
            .bypass(Bypass::new().network("10.0.0.0/8")),
    );
    let forwarded = |client: &str| {
        let mut request = request("10.0.0.5:443", "/", None);
        request
            .headers_mut()
            .insert("x-forwarded-for", client.parse().unwrap());
        request
    };
    let first = app.clone().oneshot(forwarded("203.0.113.9")).await.unwrap();
    assert!(first.headers().contains_key("ratelimit"), "limited");
    let second = app.clone().oneshot(forwarded("203.0.113.9")).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    // A client inside the network is still let through.
    let inside = app.clone().oneshot(forwarded("10.9.9.9")).await.unwrap();
    assert!(!inside.headers().contains_key("ratelimit"));
}

/// A proxy that hides its client (`unknown`, an obfuscated or malformed entry) leaves the
/// client unknown: the key falls back to the proxy's address (the last good one), but
/// the request is not let through as if the proxy, inside the allowlisted network, had
/// sent it. A request the proxy sends itself (no forwarding entry: its health check) is.
#[tokio::test]
async fn a_hidden_client_behind_an_allowlisted_proxy_is_limited() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap())
            .bypass(Bypass::new().network("10.0.0.0/8")),
    );
    for hidden in ["unknown", "_hidden", "not-an-address"] {
        let mut forwarded = request("10.0.0.5:443", "/", None);
        forwarded
            .headers_mut()
            .insert("x-forwarded-for", hidden.parse().unwrap());
        let response = app.clone().oneshot(forwarded).await.unwrap();
        assert!(
            response.headers().contains_key("ratelimit"),
            "{hidden}: limited"
        );
    }
    for _ in 0..3 {
        let own = app
            .clone()
            .oneshot(request("10.0.0.5:443", "/", None))
            .await
            .unwrap();
        assert_eq!(own.status(), StatusCode::OK);
        assert!(!own.headers().contains_key("ratelimit"), "the proxy's own");
    }
}

/// An IPv4-mapped block stands for the IPv4 block inside it, as in `ClientIp`'s trusted
/// proxies: `::ffff:10.0.0.0/104` allows 10.0.0.0/8, whether a client is seen as IPv4
/// or as an IPv4-mapped IPv6 address.
#[tokio::test]
async fn an_ipv4_mapped_network_allows_the_ipv4_clients_in_it() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::peer())
            .bypass(Bypass::new().network("::ffff:10.0.0.0/104")),
    );
    for peer in ["10.1.2.3:5000", "[::ffff:10.9.9.9]:5000"] {
        let response = app.clone().oneshot(request(peer, "/", None)).await.unwrap();
        assert!(!response.headers().contains_key("ratelimit"), "{peer}");
    }
    let outside = app
        .clone()
        .oneshot(request("11.0.0.1:1", "/", None))
        .await
        .unwrap();
    assert!(outside.headers().contains_key("ratelimit"));
}

/// A salted header key (a fleet's `key_salt_env`) or an `Authorization` credential is
/// spelt by its extractor, which no plain `Key::hashed` matches: `HeaderKey::key_for`
/// gives the key the extractor gives a request carrying the value, for an allowlist, a
/// reset or a peek.
#[tokio::test]
async fn an_allowed_key_is_spelt_by_its_extractor_salted_or_not() {
    let salted = HeaderKey::new("x-api-key").salt(b"pepper".to_vec());
    let allowed = salted.key_for("monitoring").unwrap();
    assert_ne!(allowed, Key::hashed("x-api-key", b"monitoring"));
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(salted.clone())
            .bypass(Bypass::new().key(allowed)),
    );
    for _ in 0..3 {
        let response = app
            .clone()
            .oneshot(request("192.0.2.1:1", "/", Some(" monitoring ")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("ratelimit"));
    }
    // What the extractor refuses, key_for refuses alike.
    assert!(salted.key_for("").is_err());
    assert!(salted.key_for("caf\u{e9}").is_err());
    // Authorization: one key however the scheme is spelt, as the extractor reads it.
    let bearer = HeaderKey::new("authorization");
    let (parts, _) = Request::get("/")
        .header("authorization", "bearer  tok3n")
        .body(())
        .unwrap()
        .into_parts();
    use tollgate::key::KeyExtractor;
    assert_eq!(
        bearer.key_for("Bearer tok3n").unwrap(),
        bearer.extract(&parts).unwrap()
    );
}

/// A trusted proxy that names its client only in the forwarding header the key does not
/// read (it writes `X-Forwarded-For`, the key reads `Forwarded`, or the other way round)
/// has hidden the client, as one writing `unknown` has: its requests are not the proxy's
/// own, and an allowlist of the proxy's network must not let them all skip. So too a
/// chain of trusted hops longer than the walk reads.
#[tokio::test]
async fn a_client_named_where_the_key_does_not_read_is_hidden_not_the_proxy() {
    use tollgate::key::ForwardedHeader;
    for (reads, writes, value) in [
        (
            ForwardedHeader::Forwarded,
            "x-forwarded-for",
            "203.0.113.9".to_owned(),
        ),
        (
            ForwardedHeader::XForwardedFor,
            "forwarded",
            "for=203.0.113.9".to_owned(),
        ),
        // A client the proxy names without an address (RFC 7239 section 6: `unknown`, an
        // obfuscated identifier) is named all the same.
        (
            ForwardedHeader::XForwardedFor,
            "forwarded",
            "for=unknown".to_owned(),
        ),
        (
            ForwardedHeader::XForwardedFor,
            "forwarded",
            "for=\"_hidden\"".to_owned(),
        ),
        (
            ForwardedHeader::Forwarded,
            "x-forwarded-for",
            "unknown".to_owned(),
        ),
        (
            ForwardedHeader::XForwardedFor,
            "x-forwarded-for",
            (1..=40)
                .map(|i| format!("10.0.0.{i}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        // A Forwarded line naming no address, where the key reads X-Forwarded-For, is no
        // client named elsewhere: see below.
    ] {
        let app = Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(one_per_hour())
                .key(
                    ClientIp::behind_proxies(["10.0.0.0/8"])
                        .unwrap()
                        .forwarded_header(reads),
                )
                .bypass(Bypass::new().network("10.0.0.0/8")),
        );
        let mut forwarded = request("10.0.0.5:443", "/", None);
        forwarded
            .headers_mut()
            .insert(writes, value.parse().unwrap());
        let response = app.clone().oneshot(forwarded).await.unwrap();
        assert!(
            response.headers().contains_key("ratelimit"),
            "{reads:?} with {writes} ({} bytes): limited",
            value.len()
        );
        // The proxy's own request (no forwarding header at all) still skips, and so does
        // one whose other header names no address (`Forwarded: proto=https`).
        let own = app
            .clone()
            .oneshot(request("10.0.0.5:443", "/", None))
            .await
            .unwrap();
        assert!(!own.headers().contains_key("ratelimit"), "the proxy's own");
        let mut no_address = request("10.0.0.5:443", "/", None);
        let other = match reads {
            ForwardedHeader::Forwarded => "x-forwarded-for",
            _ => "forwarded",
        };
        let nothing = if other == "forwarded" {
            "proto=https"
        } else {
            " , "
        };
        no_address
            .headers_mut()
            .insert(other, nothing.parse().unwrap());
        let response = app.clone().oneshot(no_address).await.unwrap();
        assert!(
            !response.headers().contains_key("ratelimit"),
            "{other}: {nothing} names no client"
        );
    }
}

/// Two tiers of trusted proxies, each writing its own header (a CDN `Forwarded`, the
/// inner proxy `X-Forwarded-For` with the CDN's address): the walk runs out of trusted
/// hops in the header read while the other names the client, which is then hidden, not
/// taken to be the CDN.
#[tokio::test]
async fn a_client_named_by_an_outer_tier_in_the_other_header_is_hidden() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap())
            .bypass(Bypass::new().network("10.0.0.0/8")),
    );
    // However many trusted hops the header read lists, up to and past the walk's reach
    // (32): a chain exactly as long as the walk reads once skipped this check.
    for hops in [1, 31, 32, 33] {
        let chain = (1..=hops)
            .map(|i| format!("10.0.1.{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut tiers = request("10.0.0.5:443", "/", None);
        tiers
            .headers_mut()
            .insert("x-forwarded-for", chain.parse().unwrap());
        tiers
            .headers_mut()
            .insert("forwarded", "for=203.0.113.7".parse().unwrap());
        let response = app.clone().oneshot(tiers).await.unwrap();
        assert!(
            response.headers().contains_key("ratelimit"),
            "{hops} hops: limited"
        );
    }
}

/// A chain of trusted hops as long as the walk reads, and no longer, is read whole: its
/// first hop is the client (here inside the allowed network, so it skips).
#[tokio::test]
async fn a_whole_chain_of_trusted_hops_names_its_first() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::new(MemoryStore::new())
            .policy(one_per_hour())
            .key(ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap())
            .bypass(Bypass::new().network("10.0.0.0/8")),
    );
    for (hops, skips) in [(31, true), (32, true), (33, false)] {
        let chain = (1..=hops)
            .map(|i| format!("10.0.1.{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut forwarded = request("10.0.0.5:443", "/", None);
        forwarded
            .headers_mut()
            .insert("x-forwarded-for", chain.parse().unwrap());
        let response = app.clone().oneshot(forwarded).await.unwrap();
        assert_eq!(
            !response.headers().contains_key("ratelimit"),
            skips,
            "{hops} hops"
        );
    }
}

/// Trusting every address trusts the client's own too: the walk would go on into what
/// the client wrote, and any client could name any address it likes. Refused with a
/// message, as an entry that is no address is.
#[test]
fn trusting_every_address_is_refused() {
    for everything in ["0.0.0.0/0", "::/0", "::ffff:0:0/96"] {
        let error = ClientIp::behind_proxies(["10.0.0.0/8", everything]).unwrap_err();
        assert!(
            error.to_string().contains("trusts every"),
            "{everything}: {error}"
        );
    }
    assert!(ClientIp::behind_proxies(["0.0.0.0/1", "2001:db8::/32"]).is_ok());
}

/// A network of every address allowlists every client: the limiter would limit nothing.
/// Refused with a message, as `ClientIp::behind_proxies` refuses trusting it.
#[test]
fn a_network_of_every_address_is_refused() {
    for everything in ["0.0.0.0/0", "::/0", "::ffff:0:0/96"] {
        let error = Bypass::new().try_network(everything).unwrap_err();
        assert!(error.contains("every client"), "{everything}: {error}");
    }
    assert!(Bypass::new().try_network("0.0.0.0/1").is_ok());
}

/// A network written with host bits set (`10.0.0.5/8`, an interface's address pasted
/// from `ip addr`) is almost always a typo for one address: read as its block it
/// allowlisted, or trusted the forwarding header of, 16 million addresses without a
/// word. Refused, naming both readings (as nginx warns and Python's `ip_network`
/// refuses); the block itself and a lone address are taken.
#[test]
fn a_network_with_host_bits_set_is_refused() {
    for (typo, block, one) in [
        ("10.0.0.5/8", "10.0.0.0/8", "10.0.0.5/32"),
        ("2001:db8::1/32", "2001:db8::/32", "2001:db8::1/128"),
        ("::ffff:10.0.0.5/104", "10.0.0.0/8", "10.0.0.5/32"),
    ] {
        let bypass = Bypass::new().try_network(typo).unwrap_err();
        let proxy = ClientIp::behind_proxies([typo]).unwrap_err().to_string();
        for error in [&bypass, &proxy] {
            assert!(error.contains("host bits"), "{typo}: {error}");
            assert!(
                error.contains(block) && error.contains(one),
                "{typo}: {error}"
            );
        }
    }
    for fine in ["10.0.0.0/8", "10.0.0.5", "10.0.0.5/32", "2001:db8::/32"] {
        assert!(Bypass::new().try_network(fine).is_ok(), "{fine}");
        assert!(ClientIp::behind_proxies([fine]).is_ok(), "{fine}");
    }
}

/// Every predicate given counts: a second `when` once replaced the first, so health
/// checks allowlisted first were limited once metrics were allowlisted too.
#[tokio::test]
async fn every_predicate_lets_its_requests_skip() {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "ok" }))
        .route("/", get(|| async { "ok" }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(one_per_hour())
                .key(ClientIp::peer())
                .bypass(
                    Bypass::new()
                        .when(|parts| parts.uri.path() == "/healthz")
                        .when(|parts| parts.uri.path() == "/metrics"),
                ),
        );
    for path in ["/healthz", "/metrics"] {
        for _ in 0..3 {
            let response = app
                .clone()
                .oneshot(request("192.0.2.1:1", path, None))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert!(!response.headers().contains_key("ratelimit"), "{path}");
        }
    }
    let limited = |app: Router| async move {
        app.oneshot(request("192.0.2.1:1", "/", None))
            .await
            .unwrap()
            .status()
    };
    assert_eq!(limited(app.clone()).await, StatusCode::OK);
    assert_eq!(limited(app).await, StatusCode::TOO_MANY_REQUESTS);
}
