//! Hostile input: arbitrary header bytes and identities through the key extractors and the
//! whole layer (property tests with many cases: `PROPTEST_CASES` raises or lowers them),
//! and arithmetic at the edges of every parameter. Nothing may panic, bypass the limit or
//! grow without bound.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{HeaderValue, Request, StatusCode};
use proptest::prelude::*;
use tollgate::clock::ManualClock;
use tollgate::cost;
use tollgate::key::{ClientIp, ForwardedHeader, HeaderKey, KeyExtractor, KeyExtractorExt};
use tollgate::{MemoryStore, Policy, PolicySet, Rate, RateLimitLayer};
use tower::ServiceExt;

/// How many inputs the property tests below ran, reported at the end of each.
static INPUTS: AtomicU64 = AtomicU64::new(0);

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(cases)
}

/// Header-ish bytes: mostly address-like text, sometimes anything a header may carry.
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => "[0-9a-fA-F:.,\\[\\] ;=\"_a-z]{0,80}".prop_map(String::into_bytes),
        1 => prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..200),
        1 => Just(b"for=\"[2001:db8::1]:80\", for=unknown, for=_hidden".to_vec()),
    ]
}

fn peer() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<u32>().prop_map(|bits| IpAddr::from(bits.to_be_bytes())),
        Just(IpAddr::from([10, 0, 0, 1])),
        any::<u128>().prop_map(|bits| IpAddr::from(bits.to_be_bytes())),
    ]
}

/// Every address written anywhere in `lines` (bare, with a port, or in brackets).
fn addresses_in(lines: &[Vec<u8>]) -> Vec<IpAddr> {
    let text: String = lines
        .iter()
        .map(|line| String::from_utf8_lossy(line).into_owned() + ",")
        .collect();
    text.split(|c: char| !(c.is_ascii_hexdigit() || c == ':' || c == '.'))
        .flat_map(|token| {
            let bare = token.parse::<IpAddr>().ok();
            let with_port = token.parse::<SocketAddr>().ok().map(|addr| addr.ip());
            let v4_with_port = token
                .rsplit_once(':')
                .and_then(|(ip, _)| ip.parse::<IpAddr>().ok());
            [bare, with_port, v4_with_port]
        })
        .flatten()
        .map(|ip| ip.to_canonical())
        .collect()
}

proptest! {
    #![proptest_config(cases(5_000))]

    /// Whatever the headers say, the client address is the peer or an address written in
    /// them; an untrusted peer is never overruled.
    #[test]
    fn forwarded_headers_never_panic_or_overrule_an_untrusted_peer(
        peer in peer(),
        lines in prop::collection::vec(header_bytes(), 0..5),
        forwarded in any::<bool>(),
    ) {
        INPUTS.fetch_add(1, Ordering::Relaxed);
        let which = if forwarded { ForwardedHeader::Forwarded } else { ForwardedHeader::XForwardedFor };
        let name = if forwarded { "forwarded" } else { "x-forwarded-for" };
        let extractor = ClientIp::behind_proxies(["10.0.0.0/8"]).unwrap().forwarded_header(which);
        let mut request = Request::get("/").body(()).unwrap();
        for line in &lines {
            if let Ok(value) = HeaderValue::from_bytes(line) {
                request.headers_mut().append(name, value);
            }
        }
        request.extensions_mut().insert(SocketAddr::new(peer, 1));
        let (parts, _) = request.into_parts();
        let client = extractor.client_addr(&parts).unwrap();
        let peer = peer.to_canonical();
        let trusted = matches!(peer, IpAddr::V4(v4) if v4.octets()[0] == 10);
        if !trusted {
            prop_assert_eq!(client, peer);
        } else if client != peer {
            // Whatever was chosen was written in the header.
            let written = addresses_in(&lines);
            prop_assert!(written.contains(&client), "{client} not in {written:?}");
        }
        // And the key is short, whatever came in.
        prop_assert!(extractor.extract(&parts).unwrap().len() <= 64);
    }

    /// API keys of any bytes: never stored in clear, never a panic, always short.
    #[test]
    fn api_keys_of_any_bytes_are_hashed(value in prop::collection::vec(any::<u8>(), 0..12_000)) {
        INPUTS.fetch_add(1, Ordering::Relaxed);
        let Ok(header) = HeaderValue::from_bytes(&value) else { return Ok(()) };
        let mut request = Request::get("/").body(()).unwrap();
        request.headers_mut().insert("x-api-key", header);
        let (parts, _) = request.into_parts();
        match HeaderKey::new("x-api-key").extract(&parts) {
            Ok(key) => {
                prop_assert_eq!(key.len(), "x-api-key:".len() + 32);
                let trimmed = value.trim_ascii();
                if trimmed.len() >= 8 {
                    prop_assert!(!key.as_bytes().windows(trimmed.len()).any(|w| w == trimmed));
                }
            }
            Err(error) => {
                // Present, so invalid rather than absent: empty, or not visible ASCII.
                prop_assert!(!error.is_missing());
                let trimmed = value.trim_ascii();
                prop_assert!(
                    trimmed.is_empty() || trimmed.iter().any(|&b| b != b'\t' && !(b' '..=b'~').contains(&b)),
                    "{error}"
                );
            }
        }
    }
}

fn hostile_app() -> Router {
    let limiter = RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 5, Rate::per_hour(1)).unwrap())
        .key(HeaderKey::new("x-api-key").or(ClientIp::behind_proxies(["127.0.0.0/8"]).unwrap()))
        .cost(cost::from_fn(|parts| {
            // A client-chosen cost, parsed defensively: any number, even u64::MAX.
            parts
                .headers
                .get("x-cost")
                .and_then(|value| value.to_str().ok()?.trim().parse().ok())
                .unwrap_or(1)
        }));
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter)
        .with_state(())
}

proptest! {
    #![proptest_config(cases(2_000))]

    /// The whole layer under arbitrary headers: an answer every time, and only answers a
    /// rate limiter may give.
    #[test]
    fn the_layer_answers_every_hostile_request(
        headers in prop::collection::vec((0usize..4, header_bytes()), 0..6),
        cost in prop_oneof![Just(None), any::<u64>().prop_map(Some), (0u64..10).prop_map(Some)],
    ) {
        INPUTS.fetch_add(1, Ordering::Relaxed);
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut request = Request::get("/").body(Body::empty()).unwrap();
        for (name, value) in &headers {
            let name = ["x-forwarded-for", "forwarded", "x-api-key", "x-cost"][*name];
            if let Ok(value) = HeaderValue::from_bytes(value) {
                request.headers_mut().append(name, value);
            }
        }
        if let Some(cost) = cost {
            request.headers_mut().insert("x-cost", HeaderValue::from(cost));
        }
        request.extensions_mut().insert(SocketAddr::from(([127, 0, 0, 1], 9)));
        let response = runtime.block_on(hostile_app().oneshot(request)).unwrap();
        let status = response.status();
        prop_assert!(
            [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS, StatusCode::BAD_REQUEST].contains(&status),
            "{status}"
        );
        if status == StatusCode::BAD_REQUEST {
            // A cost that can never fit, or an ambiguous key: never a Retry-After.
            prop_assert!(response.headers().get("retry-after").is_none());
        }
    }
}

#[test]
fn the_property_tests_ran_many_inputs() {
    // Printed for the record of how much was fuzzed; the count is only complete when the
    // property tests ran first, so it is not asserted.
    println!(
        "hostile inputs so far in this process: {}",
        INPUTS.load(Ordering::Relaxed)
    );
}

/// Every algorithm at the edges of its parameters and of time: no panic, no admission
/// beyond the limit, no retry-after of zero.
#[test]
fn arithmetic_at_the_edges() {
    let max = tollgate::policy::MAX_LIMIT;
    let tiny = Duration::from_millis(1);
    let long = tollgate::policy::MAX_PERIOD;
    let policies = vec![
        Policy::fixed_window("fw-huge", max, long).unwrap(),
        Policy::fixed_window("fw-tiny", 1, tiny).unwrap(),
        Policy::sliding_log("sl-tiny", 1, tiny).unwrap(),
        Policy::sliding_window("sw-huge", max, long).unwrap(),
        Policy::sliding_window("sw-tiny", 1, tiny).unwrap(),
        Policy::token_bucket("tb-huge", max, Rate::new(max, tiny)).unwrap(),
        Policy::token_bucket("tb-slow", max, Rate::new(1, long)).unwrap(),
        Policy::token_bucket("tb-tiny", 1, Rate::new(1, tiny)).unwrap(),
        Policy::leaky_bucket("lb-huge", max, Rate::new(max, long)).unwrap(),
        Policy::leaky_bucket_shaping(
            "ls-huge",
            Rate::new(max, tiny),
            tollgate::policy::MAX_SHAPING_DELAY,
        )
        .unwrap(),
        Policy::leaky_bucket_shaping("ls-zero", Rate::new(1, long), Duration::ZERO).unwrap(),
        Policy::gcra("gc-huge", Rate::new(max, tiny), max).unwrap(),
        Policy::gcra("gc-slow", Rate::new(1, long), 1).unwrap(),
    ];
    // Times from zero to centuries of uptime; the clock also stands still.
    let times = [
        0u64,
        1,
        999_999,
        1_000_000,
        86_400_000_000_000,
        500 * 365 * 86_400_000_000_000,
    ];
    for policy in policies {
        let name = policy.name().to_owned();
        let limit = policy.limit();
        let clock = ManualClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let set = PolicySet::from(policy);
        for &at in &times {
            clock.set(Duration::from_nanos(at));
            for cost in [0, 1, 2, limit, limit.saturating_add(1), u64::MAX] {
                for _ in 0..3 {
                    let decision = store.check("edge", &set, cost);
                    let status = decision.statuses()[0];
                    assert!(
                        status.remaining <= status.limit,
                        "{name} at {at} cost {cost}"
                    );
                    if let Some(wait) = decision.retry_after() {
                        assert!(
                            wait > Duration::ZERO,
                            "{name} at {at} cost {cost}: retry-after 0"
                        );
                    }
                    if cost > limit && !name.starts_with("ls") {
                        assert!(
                            !decision.is_allowed(),
                            "{name}: cost {cost} over {limit} admitted"
                        );
                    }
                }
            }
        }
    }
}
