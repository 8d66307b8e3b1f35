//! Hostile input: arbitrary header bytes and identities through the key extractors and the
//! whole layer (property tests with many cases: `PROPTEST_CASES` raises or lowers them),
//! and arithmetic at the edges of every parameter. Nothing may panic, bypass the limit or
//! grow without bound.
//!
//! Every test here also checks that the limit holds: each key the hostile input yields is
//! spent twice against a limit of one (the second must be denied), the layer test shares
//! one app across its cases and requires the request after the limit to be a 429, and the
//! arithmetic test bounds what one instant admits. A limiter that never denied would fail
//! each of them.

use std::cell::Cell;
use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{HeaderValue, Request, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use tollgate::clock::ManualClock;
use tollgate::cost;
use tollgate::key::{
    ClientIp, ForwardedHeader, HeaderKey, KeyErrorKind, KeyExtractor, KeyExtractorExt,
};
use tollgate::{Key, MemoryStore, Policy, PolicySet, Rate, RateLimitLayer};
use tower::ServiceExt;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(cases)
}

/// Spends `key` twice against one shared store with a limit of one per key and a clock
/// that never moves: true when the second spend is denied, as it must be whatever the
/// key (and whether or not an earlier case already spent it).
fn second_spend_is_denied(key: &Key) -> bool {
    static STORE: OnceLock<(MemoryStore<ManualClock>, PolicySet)> = OnceLock::new();
    let (store, policies) = STORE.get_or_init(|| {
        let store = MemoryStore::builder().clock(ManualClock::new()).build();
        let once = Policy::fixed_window("once", 1, Duration::from_secs(3600)).unwrap();
        (store, PolicySet::from(once))
    });
    store.check(key, policies, 1);
    !store.check(key, policies, 1).is_allowed()
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

/// What `HeaderKey` accepts: one line, not blank, visible ASCII (spaces and tabs inside).
fn usable_api_key(lines: &[&HeaderValue]) -> bool {
    match lines {
        [value] => {
            let value = value.as_bytes().trim_ascii();
            !value.is_empty()
                && value
                    .iter()
                    .all(|&byte| byte == b'\t' || (b' '..=b'~').contains(&byte))
        }
        _ => false,
    }
}

proptest! {
    #![proptest_config(cases(5_000))]

    /// Whatever the headers say, the client address is the peer or an address written in
    /// them; an untrusted peer is never overruled; and the key limits.
    #[test]
    fn forwarded_headers_never_panic_or_overrule_an_untrusted_peer(
        peer in peer(),
        lines in prop::collection::vec(header_bytes(), 0..5),
        forwarded in any::<bool>(),
    ) {
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
        // The key is short, whatever came in, and the same every time: it limits.
        let key = extractor.extract(&parts).unwrap();
        prop_assert!(key.len() <= 64);
        prop_assert_eq!(&extractor.extract(&parts).unwrap(), &key);
        prop_assert!(second_spend_is_denied(&key), "{key} was not limited");
    }

    /// RFC 7239, section 4, and RFC 9110, section 5.6.4: a trusted proxy's element is read
    /// whole, whatever the client made it quote (its `Host`, copied into `host=`, with any
    /// commas, semicolons, `for=`, quotes and backslashes, escaped as the proxy must) and
    /// whatever the client sent before it, on a line of its own or on the line the proxy
    /// appended to: the client is the address the proxy wrote, never one the client wrote.
    #[test]
    fn a_proxys_element_is_read_whole_whatever_it_quotes(
        client in prop_oneof![
            any::<u32>().prop_map(|bits| IpAddr::from(bits.to_be_bytes())),
            any::<u128>().prop_map(|bits| IpAddr::from(bits.to_be_bytes())),
        ],
        host in "[ -~]{0,60}",
        host_first in any::<bool>(),
        placement in 0..3u8,
        sent in "[0-9a-z.,;=\\\\\" ]{0,40}",
    ) {
        // Outside the trusted proxies' 10.0.0.0/8.
        let client = match client.to_canonical() {
            IpAddr::V4(v4) if v4.octets()[0] == 10 => IpAddr::from([11, 0, 0, v4.octets()[3]]),
            _ => client,
        };
        let extractor = ClientIp::behind_proxies(["10.0.0.0/8"])
            .unwrap()
            .forwarded_header(ForwardedHeader::Forwarded);
        let quoted: String = host
            .chars()
            .flat_map(|c| match c {
                '"' | '\\' => vec!['\\', c],
                c => vec![c],
            })
            .collect();
        let host = format!("host=\"{quoted}\"");
        // RFC 7239, section 6: an IPv6 node is quoted, in brackets.
        let at = match client {
            IpAddr::V4(v4) => format!("for={v4}"),
            IpAddr::V6(v6) => format!("for=\"[{v6}]:4711\""),
        };
        let element = if host_first {
            format!("{host};{at};proto=https")
        } else {
            format!("{at};{host};proto=https")
        };
        let lines = match placement {
            // The proxy's element alone.
            0 => vec![element.clone()],
            // What the client sent, then the proxy's own line.
            1 => vec![sent.clone(), element.clone()],
            // The proxy appends its element to the client's line: a quote the client
            // left open must not swallow it.
            _ => vec![format!("{sent}, {element}")],
        };
        let mut request = Request::get("/").body(()).unwrap();
        for line in &lines {
            request.headers_mut().append("forwarded", HeaderValue::from_str(line).unwrap());
        }
        request.extensions_mut().insert(SocketAddr::from(([10, 0, 0, 1], 1)));
        let (parts, _) = request.into_parts();
        prop_assert_eq!(extractor.client_addr(&parts).unwrap(), client.to_canonical(), "{:?}", lines);
    }

    /// API keys of any bytes: never stored in clear, never a panic, always short, and
    /// limited.
    #[test]
    fn api_keys_of_any_bytes_are_hashed(
        value in prop_oneof![
            // Every byte a header value may hold (tab, visible ASCII, space, and bytes
            // past ASCII): bytes no header can carry never reach a service, and a case of
            // them tested nothing.
            1 => prop::collection::vec(
                prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff],
                0..12_000,
            ),
            // Visible ASCII and spaces: mostly usable keys, so most cases reach the store.
            2 => prop::collection::vec(0x20u8..0x7f, 0..12_000),
        ],
    ) {
        let header = HeaderValue::from_bytes(&value);
        prop_assert!(header.is_ok(), "{:?} is no header value", value);
        let header = header.unwrap();
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
                prop_assert!(second_spend_is_denied(&key), "{key} was not limited");
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

    /// `.or()` falls back to the IP only when there is no API key at all: a repeated,
    /// blank or non-ASCII key is the client's error, never a second budget.
    #[test]
    fn or_falls_back_only_without_an_api_key(
        lines in prop::collection::vec(
            prop_oneof![
                2 => "[ -~]{0,24}".prop_map(String::into_bytes),
                1 => prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..24),
            ],
            0..4,
        ),
    ) {
        let extractor = HeaderKey::new("x-api-key").or(ClientIp::peer());
        let mut request = Request::get("/").body(()).unwrap();
        for line in &lines {
            if let Ok(value) = HeaderValue::from_bytes(line) {
                request.headers_mut().append("x-api-key", value);
            }
        }
        request.extensions_mut().insert(SocketAddr::from(([203, 0, 113, 7], 1)));
        let (parts, _) = request.into_parts();
        let sent: Vec<&HeaderValue> = parts.headers.get_all("x-api-key").iter().collect();
        match extractor.extract(&parts) {
            Ok(key) if sent.is_empty() => {
                prop_assert_eq!(key.as_str(), "ip:203.0.113.7");
                prop_assert!(second_spend_is_denied(&key));
            }
            Ok(key) => {
                prop_assert!(usable_api_key(&sent), "{sent:?} gave {key}");
                prop_assert!(key.starts_with("x-api-key:"), "{sent:?} gave {key}");
                prop_assert!(second_spend_is_denied(&key));
            }
            Err(error) => {
                prop_assert!(!sent.is_empty() && !usable_api_key(&sent), "{sent:?}: {error}");
                prop_assert_eq!(error.kind(), KeyErrorKind::Client);
                prop_assert!(!error.is_missing());
            }
        }
    }
}

/// The most a key may spend in the layer test: small, so every case can exhaust it.
const LAYER_LIMIT: u64 = 5;

/// One app for every case of the layer test: a clock that never moves, so a bucket that
/// one case emptied stays empty for the next.
fn hostile_app() -> Router {
    let store = MemoryStore::builder().clock(ManualClock::new()).build();
    let limiter = RateLimitLayer::new(store)
        .policy(Policy::token_bucket("api", LAYER_LIMIT, Rate::per_hour(1)).unwrap())
        .key(HeaderKey::new("x-api-key").or(ClientIp::behind_proxies(["127.0.0.0/8"]).unwrap()))
        .cost(cost::from_fn(cost_of));
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter)
        .with_state(())
}

/// A client-chosen cost, parsed defensively: any number, even u64::MAX.
fn cost_of(parts: &http::request::Parts) -> u64 {
    parts
        .headers
        .get("x-cost")
        .and_then(|value| value.to_str().ok()?.trim().parse().ok())
        .unwrap_or(1)
}

/// The whole layer under arbitrary headers, one app and store for every case. Each case
/// sends the same hostile request `LAYER_LIMIT + 1` times: only answers a rate limiter may
/// give, a 400 exactly when the key or the cost is unusable (and no `Retry-After` then),
/// and otherwise the request after the limit is a 429, whatever the headers said.
#[test]
fn the_layer_answers_every_hostile_request() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let app = hostile_app();
    let strategy = (
        prop::collection::vec((0usize..4, header_bytes()), 0..6),
        prop_oneof![
            2 => Just(None),
            1 => any::<u64>().prop_map(Some),
            2 => (0u64..10).prop_map(Some)
        ],
    );
    let (admitted, denied, refused) = (Cell::new(0u64), Cell::new(0u64), Cell::new(0u64));
    let mut runner = TestRunner::new(cases(2_000));
    runner
        .run(&strategy, |(headers, cost)| {
            let request = || {
                let mut request = Request::get("/").body(Body::empty()).unwrap();
                for (name, value) in &headers {
                    let name = ["x-forwarded-for", "forwarded", "x-api-key", "x-cost"][*name];
                    if let Ok(value) = HeaderValue::from_bytes(value) {
                        request.headers_mut().append(name, value);
                    }
                }
                if let Some(cost) = cost {
                    request
                        .headers_mut()
                        .insert("x-cost", HeaderValue::from(cost));
                }
                request
                    .extensions_mut()
                    .insert(SocketAddr::from(([127, 0, 0, 1], 9)));
                request
            };
            let (parts, _) = request().into_parts();
            let cost = cost_of(&parts);
            let api_keys: Vec<&HeaderValue> = parts.headers.get_all("x-api-key").iter().collect();
            let unusable =
                (!api_keys.is_empty() && !usable_api_key(&api_keys)) || cost > LAYER_LIMIT;
            let mut last = StatusCode::OK;
            for attempt in 0..=LAYER_LIMIT {
                let response = runtime.block_on(app.clone().oneshot(request())).unwrap();
                let status = response.status();
                match status {
                    StatusCode::OK => admitted.set(admitted.get() + 1),
                    StatusCode::TOO_MANY_REQUESTS => denied.set(denied.get() + 1),
                    StatusCode::BAD_REQUEST => refused.set(refused.get() + 1),
                    _ => prop_assert!(false, "attempt {attempt}: {status}"),
                }
                prop_assert_eq!(
                    status == StatusCode::BAD_REQUEST,
                    unusable,
                    "attempt {}: {} for cost {} and keys {:?}",
                    attempt,
                    status,
                    cost,
                    api_keys
                );
                if status == StatusCode::BAD_REQUEST {
                    // A cost that can never fit, or an unusable key: never a Retry-After.
                    prop_assert!(response.headers().get("retry-after").is_none());
                }
                if status == StatusCode::TOO_MANY_REQUESTS {
                    prop_assert!(response.headers().get("retry-after").is_some());
                }
                last = status;
            }
            if !unusable && cost > 0 {
                // LAYER_LIMIT + 1 requests of at least one unit each cannot all fit.
                prop_assert_eq!(last, StatusCode::TOO_MANY_REQUESTS, "cost {}", cost);
            }
            Ok(())
        })
        .unwrap();
    let (admitted, denied, refused) = (admitted.get(), denied.get(), refused.get());
    println!(
        "hostile requests: {admitted} admitted, {denied} denied (429), {refused} refused (400)"
    );
    assert!(denied > 0 && admitted > 0 && refused > 0);
}

/// Every algorithm at the edges of its parameters and of time: no panic, no admission
/// beyond the limit (not for one request, nor summed over one instant), no retry-after
/// of zero.
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
        Policy::sliding_window_split("sw64-huge", max, long, tollgate::policy::MAX_SUB_WINDOWS)
            .unwrap(),
        Policy::sliding_window_split("sw8-tiny", 1, tiny, 8).unwrap(),
        Policy::token_bucket("tb-huge", max, Rate::new(max, tiny)).unwrap(),
        Policy::token_bucket("tb-slow", max, Rate::new(1, long)).unwrap(),
        Policy::token_bucket("tb-tiny", 1, Rate::new(1, tiny)).unwrap(),
        Policy::leaky_bucket("lb-huge", max, Rate::new(max, long)).unwrap(),
        // The largest burst a shaping bucket may have (its burst is bounded like a limit).
        Policy::leaky_bucket_shaping(
            "ls-huge",
            Rate::new(max / 3_600_001, tiny),
            tollgate::policy::MAX_SHAPING_DELAY,
        )
        .unwrap(),
        Policy::leaky_bucket_shaping("ls-zero", Rate::new(1, long), Duration::ZERO).unwrap(),
        Policy::gcra("gc-huge", Rate::new(max, tiny), max).unwrap(),
        Policy::gcra("gc-slow", Rate::new(1, long), 1).unwrap(),
    ];
    assert!(
        Policy::leaky_bucket_shaping(
            "ls-over",
            Rate::new(max, tiny),
            tollgate::policy::MAX_SHAPING_DELAY
        )
        .is_err(),
        "a shaping burst past MAX_LIMIT is refused"
    );
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
            // What this instant admitted: a full bucket or window holds `limit`, no more.
            let mut admitted = 0u64;
            for cost in [0, 1, 2, limit, limit.saturating_add(1), u64::MAX] {
                for _ in 0..3 {
                    let decision = store.check("edge", &set, cost);
                    if decision.is_allowed() {
                        admitted = admitted.saturating_add(cost);
                    }
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
            // A shaping bucket admits a request when what is queued ahead of it fits the
            // delay bound; its own units then wait their turn, so one instant may queue up
            // to the burst plus one request's units less one.
            let bound = if name.starts_with("ls") {
                limit.saturating_mul(2)
            } else {
                limit
            };
            assert!(
                admitted <= bound,
                "{name} at {at}: {admitted} units admitted at one instant, limit {limit}"
            );
        }
    }
}
