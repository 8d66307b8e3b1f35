//! The soak's generators and targets, shared by `examples/soak/main.rs` (millions of
//! inputs, by hand) and `tests/soak.rs` (a short slice, in CI).
//!
//! Each input is built from a small seeded PRNG (SplitMix64) keyed by the seed, the target
//! and the input's index, and checked inside `catch_unwind`: a panic, or a failed check
//! (an `assert!`, which panics), is counted and its first messages are kept.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::clock::ManualClock;
use tollgate::cost::FromExtension;
use tollgate::cost::graphql::{GraphqlCost, GraphqlCostLayer, Invalid, OutOfRange};
use tollgate::key::{
    self, ClientIp, ExtensionKey, ForwardedHeader, Global, HeaderKey, KeyError, KeyErrorKind,
    KeyExtractor, KeyExtractorExt, Route,
};
use tollgate::policy::{MAX_LIMIT, MAX_PERIOD, MAX_SHAPING_DELAY, MIN_PERIOD};
use tollgate::{
    Algorithm, HeaderStyle, MemoryStore, MissingKey, Policy, PolicyError, PolicySet, Rate,
    RateLimitLayer,
};
use tower::ServiceExt;
use tower::util::BoxCloneService;

// ---------------------------------------------------------------------------------------
// Running

/// What a soak run does.
pub struct Options {
    /// Inputs in all, shared among the targets by weight.
    pub count: u64,
    /// The seed every input is derived from.
    pub seed: u64,
    /// One target only (it then gets every input).
    pub only: Option<Target>,
    /// The index of the first input (to replay one).
    pub from: u64,
}

/// What one target went through.
pub struct Tally {
    pub target: Target,
    pub inputs: u64,
    pub panics: u64,
    pub elapsed: Duration,
}

/// What the whole run went through.
pub struct Report {
    pub tallies: Vec<Tally>,
    pub elapsed: Duration,
    /// The first few panics: target, input index and message.
    pub first_failures: Vec<String>,
}

impl Report {
    pub fn inputs(&self) -> u64 {
        self.tallies.iter().map(|t| t.inputs).sum()
    }

    pub fn panics(&self) -> u64 {
        self.tallies.iter().map(|t| t.panics).sum()
    }
}

/// What is soaked, with its share of the inputs (out of 100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `ClientIp` behind trusted proxies: arbitrary `X-Forwarded-For` and `Forwarded`.
    ClientIp,
    /// `HeaderKey`: arbitrary values, repeated lines, arbitrary header names.
    HeaderKey,
    /// Tuples, `.or()` chains, `ExtensionKey`, `Route`, `from_fn`, against a model.
    Combinators,
    /// Every policy constructor with arbitrary numbers and durations, then decisions.
    Policy,
    /// `GraphqlCost`: generated and mutated documents, variables, JSON bodies, schemas.
    Graphql,
    /// The GraphQL cost layer in front of the rate-limit layer: whole requests.
    Layer,
}

pub const TARGETS: [Target; 6] = [
    Target::ClientIp,
    Target::HeaderKey,
    Target::Combinators,
    Target::Policy,
    Target::Graphql,
    Target::Layer,
];

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::ClientIp => "client_ip",
            Target::HeaderKey => "header_key",
            Target::Combinators => "combinators",
            Target::Policy => "policy",
            Target::Graphql => "graphql",
            Target::Layer => "layer",
        }
    }

    fn weight(self) -> u64 {
        match self {
            Target::ClientIp => 26,
            Target::HeaderKey => 20,
            Target::Combinators => 16,
            Target::Policy => 20,
            Target::Graphql => 14,
            Target::Layer => 4,
        }
    }
}

static PANICS: AtomicU64 = AtomicU64::new(0);
static MESSAGES: Mutex<Vec<String>> = Mutex::new(Vec::new());
const KEPT_MESSAGES: usize = 8;

/// Runs the soak, calling `each` with every target's tally as it finishes.
pub fn soak(options: &Options, mut each: impl FnMut(&Tally)) -> Report {
    // Panics are counted and their first messages kept, not printed as they happen.
    let previous_hook = panic::take_hook();
    panic::set_hook(Box::new(|info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        let mut messages = MESSAGES.lock().unwrap_or_else(|e| e.into_inner());
        if messages.len() < KEPT_MESSAGES {
            messages.push(info.to_string());
        }
    }));
    let started = Instant::now();
    let mut tallies = Vec::new();
    let mut first_failures = Vec::new();
    let targets: Vec<Target> = match options.only {
        Some(target) => vec![target],
        None => TARGETS.to_vec(),
    };
    let total_weight: u64 = targets.iter().map(|t| t.weight()).sum();
    let mut assigned = 0;
    for (position, &target) in targets.iter().enumerate() {
        let share = if position + 1 == targets.len() {
            options.count - assigned
        } else {
            options.count * target.weight() / total_weight
        };
        assigned += share;
        let tally = run_target(target, options, share, &mut first_failures);
        each(&tally);
        tallies.push(tally);
    }
    panic::set_hook(previous_hook);
    Report {
        tallies,
        elapsed: started.elapsed(),
        first_failures,
    }
}

fn run_target(target: Target, options: &Options, count: u64, failures: &mut Vec<String>) -> Tally {
    let mut bench = Bench::new();
    let started = Instant::now();
    let mut panics = 0;
    for index in options.from..options.from + count {
        let mut rng = Rng::for_input(options.seed, target, index);
        let before = PANICS.load(Ordering::Relaxed);
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| match target {
            Target::ClientIp => client_ip(&mut rng, &bench),
            Target::HeaderKey => header_key(&mut rng),
            Target::Combinators => combinators(&mut rng, &bench),
            Target::Policy => policy(&mut rng, &mut bench),
            Target::Graphql => graphql(&mut rng, &bench),
            Target::Layer => layer(&mut rng, &mut bench),
        }));
        if outcome.is_err() || PANICS.load(Ordering::Relaxed) != before {
            panics += 1;
            let mut messages = MESSAGES.lock().unwrap_or_else(|e| e.into_inner());
            for message in messages.drain(..) {
                if failures.len() < KEPT_MESSAGES {
                    failures.push(format!("{} input {index}: {message}", target.name()));
                }
            }
            // A store or a runtime that panicked is not reused.
            bench = Bench::new();
        }
    }
    Tally {
        target,
        inputs: count,
        panics,
        elapsed: started.elapsed(),
    }
}

/// What inputs share: extractors built once, a store and a clock, a runtime, a stack.
struct Bench {
    proxies: Vec<ClientIp>,
    clock: ManualClock,
    store: MemoryStore<ManualClock>,
    store_inputs: u64,
    costers: Vec<GraphqlCost>,
    runtime: tokio::runtime::Runtime,
    stack: Option<(Stack, u64)>,
}

type Stack = BoxCloneService<Request<Body>, Response<Body>, Infallible>;

impl Bench {
    fn new() -> Self {
        let trusted = [
            "10.0.0.0/8",
            "2001:db8::/32",
            "127.0.0.1",
            "::ffff:192.0.2.0/120",
        ];
        let mut proxies = Vec::new();
        for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
            proxies.push(
                ClientIp::behind_proxies(trusted)
                    .unwrap()
                    .forwarded_header(header),
            );
            // Every address trusted, in halves (a block of every address is refused):
            // the walk goes as deep as the headers do.
            proxies.push(
                ClientIp::behind_proxies(["0.0.0.0/1", "128.0.0.0/1", "::/1", "8000::/1"])
                    .unwrap()
                    .forwarded_header(header),
            );
        }
        proxies.push(ClientIp::peer());
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(4096)
            .build();
        let costers = vec![
            GraphqlCost::new(),
            GraphqlCost::new().with_schema(SDL).unwrap(),
            GraphqlCost::new()
                .with_schema(SDL)
                .unwrap()
                .slice_range(0, u64::MAX, OutOfRange::Cap)
                .max_depth(8)
                .max_batch(3),
            GraphqlCost::new()
                .slicing_arguments(["first", "count", "n"])
                .mutation_base(u64::MAX)
                .slice_range(5, 2, OutOfRange::Cap)
                .max_depth(1)
                .max_batch(0),
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        Self {
            proxies,
            clock,
            store,
            store_inputs: 0,
            costers,
            runtime,
            stack: None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The generator

/// SplitMix64: small, fast, and good enough to pick inputs.
pub struct Rng(u64);

impl Rng {
    fn for_input(seed: u64, target: Target, index: u64) -> Self {
        let mut rng = Rng(seed ^ (target as u64).wrapping_mul(0xA076_1D64_78BD_642F));
        rng.0 ^= rng
            .next()
            .wrapping_add(index.wrapping_mul(0xE703_7ED1_A0B4_28DB));
        rng.next();
        rng
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True one time in `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }

    fn pick_bytes(&mut self, items: &[&'static [u8]]) -> &'static [u8] {
        items[self.index(items.len())]
    }

    fn pick_str(&mut self, items: &[&'static str]) -> &'static str {
        items[self.index(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    /// A number from the edges or anywhere: what limits and costs are made of.
    fn number(&mut self) -> u64 {
        const EDGES: [u64; 16] = [
            0,
            1,
            2,
            3,
            10,
            100,
            1_000,
            MAX_LIMIT - 1,
            MAX_LIMIT,
            MAX_LIMIT + 1,
            u32::MAX as u64,
            u32::MAX as u64 + 1,
            i64::MAX as u64,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ];
        match self.below(4) {
            0 => *self.pick(&EDGES),
            1 => self.below(20),
            2 => self.below(100_000),
            _ => self.next() >> self.below(64),
        }
    }

    fn duration(&mut self) -> Duration {
        let edges = [
            Duration::ZERO,
            Duration::from_nanos(1),
            MIN_PERIOD - Duration::from_nanos(1),
            MIN_PERIOD,
            Duration::from_secs(1),
            Duration::from_secs(60),
            Duration::from_secs(3600),
            Duration::from_secs(86_400),
            MAX_PERIOD - Duration::from_nanos(1),
            MAX_PERIOD,
            MAX_PERIOD + Duration::from_nanos(1),
            MAX_SHAPING_DELAY,
            MAX_SHAPING_DELAY + Duration::from_nanos(1),
            Duration::from_secs(u64::MAX),
            Duration::MAX,
        ];
        match self.below(4) {
            0 => *self.pick(&edges),
            1 => Duration::from_millis(self.below(10_000)),
            2 => Duration::from_nanos(self.next() >> self.below(64)),
            _ => Duration::new(
                self.next() >> self.below(64),
                self.below(1_000_000_000) as u32,
            ),
        }
    }

    /// Bytes a header might carry: text, separators, high bytes, controls.
    fn bytes(&mut self, max: u64, out: &mut Vec<u8>) {
        const SPECIAL: &[u8] = b" \t,;=\"[]:._-/\\\x00\r\n\x7f\x80\xc3\xa9\xff";
        for _ in 0..self.below(max + 1) {
            let byte = match self.below(8) {
                0 => *self.pick(SPECIAL),
                1 => self.byte(),
                2 => b'0' + self.below(10) as u8,
                _ => b' ' + self.below(95) as u8,
            };
            out.push(byte);
        }
    }

    /// A few byte-level edits: flips, inserts, deletions, duplications, truncation.
    fn mutate(&mut self, data: &mut Vec<u8>) {
        const INSERTS: &[u8] = b"\x00\t\r\n ,;=\"[]:{}()$@#.!\x7f\x80\xff";
        for _ in 0..=self.below(3) {
            let len = data.len();
            match self.below(6) {
                0 if len > 0 => {
                    let at = self.index(len);
                    data[at] ^= 1 << self.below(8);
                }
                1 => {
                    let at = self.index(len + 1);
                    let byte = *self.pick(INSERTS);
                    data.insert(at, byte);
                }
                2 if len > 0 => {
                    let start = self.index(len);
                    let end = (start + 1 + self.index(8)).min(len);
                    data.drain(start..end);
                }
                3 if len > 0 && len < 4096 => {
                    let start = self.index(len);
                    let end = (start + 1 + self.index(32)).min(len);
                    let copy = data[start..end].to_vec();
                    let at = self.index(len + 1);
                    data.splice(at..at, copy);
                }
                4 if len > 0 => {
                    let at = self.index(len);
                    data.truncate(at);
                }
                _ => {
                    let at = self.index(len + 1);
                    let byte = self.byte();
                    data.insert(at, byte);
                }
            }
        }
    }

    fn ipv4(&mut self) -> Ipv4Addr {
        match self.below(6) {
            0 | 1 => Ipv4Addr::new(10, self.byte(), self.byte(), self.byte()),
            2 => *self.pick(&[
                Ipv4Addr::UNSPECIFIED,
                Ipv4Addr::BROADCAST,
                Ipv4Addr::LOCALHOST,
                Ipv4Addr::new(192, 0, 2, 7),
            ]),
            _ => Ipv4Addr::from(self.next() as u32),
        }
    }

    fn ipv6(&mut self) -> Ipv6Addr {
        match self.below(5) {
            0 | 1 => Ipv6Addr::from((0x2001_0db8_u128 << 96) | u128::from(self.next())),
            2 => self.ipv4().to_ipv6_mapped(),
            3 => *self.pick(&[Ipv6Addr::UNSPECIFIED, Ipv6Addr::LOCALHOST]),
            _ => Ipv6Addr::from((u128::from(self.next()) << 64) | u128::from(self.next())),
        }
    }

    fn ip(&mut self) -> IpAddr {
        if self.one_in(3) {
            IpAddr::V6(self.ipv6())
        } else {
            IpAddr::V4(self.ipv4())
        }
    }

    /// One forwarding node: an address, with a port, in brackets, obfuscated or garbage.
    fn node(&mut self, out: &mut Vec<u8>) {
        let _ = match self.below(12) {
            0..=3 => write!(out, "{}", self.ipv4()),
            4 | 5 => write!(out, "{}", self.ipv6()),
            6 => write!(out, "{}:{}", self.ipv4(), self.number() % 100_000),
            7 => write!(out, "[{}]:{}", self.ipv6(), self.below(70_000)),
            8 => write!(out, "[{}]", self.ipv6()),
            9 => out.write_all(self.pick_bytes(&[b"unknown", b"_hidden", b"_", b"UNKNOWN"])),
            10 => {
                for _ in 0..self.below(40) {
                    out.push(*self.pick(b"0123456789abcdefABCDEF:.[]"));
                }
                Ok(())
            }
            _ => {
                self.bytes(16, out);
                Ok(())
            }
        };
    }

    fn x_forwarded_for(&mut self) -> Vec<u8> {
        let mut line = Vec::new();
        for index in 0..self.below(7) {
            if index > 0 {
                line.extend_from_slice(self.pick_bytes(&[b",", b", ", b" ,", b",,", b"\t, "]));
            }
            self.node(&mut line);
        }
        line
    }

    fn forwarded(&mut self) -> Vec<u8> {
        let mut line = Vec::new();
        for index in 0..self.below(5) {
            if index > 0 {
                line.extend_from_slice(self.pick_bytes(&[b",", b", ", b" , "]));
            }
            for pair in 0..=self.below(3) {
                if pair > 0 {
                    line.push(b';');
                }
                match self.below(6) {
                    0..=2 => {
                        line.extend_from_slice(
                            self.pick_bytes(&[b"for=", b"For=", b"FOR=", b" for = "]),
                        );
                        let quoted = self.below(3);
                        if quoted > 0 {
                            line.push(b'"');
                        }
                        self.node(&mut line);
                        if quoted == 1 {
                            line.push(b'"');
                        }
                    }
                    3 => line.extend_from_slice(self.pick_bytes(&[
                        b"proto=https",
                        b"host=\"a,b;c\"",
                        b"by=10.0.0.1",
                    ])),
                    4 => line.extend_from_slice(self.pick_bytes(&[
                        b"for",
                        b"=",
                        b"for==1.2.3.4",
                        b"\"",
                        b"",
                    ])),
                    _ => self.bytes(12, &mut line),
                }
            }
        }
        line
    }
}

// ---------------------------------------------------------------------------------------
// Key extractors

fn peer_request(rng: &mut Rng, peer: Option<IpAddr>) -> Request<()> {
    let mut request = Request::get("/").body(()).unwrap();
    if let Some(peer) = peer {
        let addr = SocketAddr::new(peer, rng.below(65_536) as u16);
        match rng.below(3) {
            0 => {
                request.extensions_mut().insert(addr);
            }
            1 => {
                // A bare `IpAddr` beside it is no peer (middleware may have read it from
                // a client's header): it must not change the key.
                request.extensions_mut().insert(addr);
                request
                    .extensions_mut()
                    .insert(IpAddr::from([192, 0, 2, 99]));
            }
            _ => {
                request
                    .extensions_mut()
                    .insert(axum::extract::ConnectInfo(addr));
            }
        }
    }
    request
}

/// Appends each line the `http` crate accepts as a header value.
fn append_lines(request: &mut Request<impl Sized>, name: &'static str, lines: &[Vec<u8>]) {
    for line in lines {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            request.headers_mut().append(name, value);
        }
    }
}

fn client_ip(rng: &mut Rng, bench: &Bench) {
    let which = rng.index(bench.proxies.len());
    // The last one trusts no proxy: the peer is the client.
    let untrusted = which == bench.proxies.len() - 1;
    let mut extractor = bench.proxies[which].clone();
    let regrouped = rng.one_in(4);
    if regrouped {
        extractor = extractor
            .ipv4_prefix(1 + rng.below(40) as u8)
            .ipv6_prefix(1 + rng.below(140) as u8);
    }
    let peer = match rng.below(16) {
        0 => None,
        1..=9 => Some(*rng.pick(&[
            IpAddr::from([10, 0, 0, 1]),
            IpAddr::from([127, 0, 0, 1]),
            "2001:db8::5".parse().unwrap(),
            "::ffff:10.1.2.3".parse().unwrap(),
            "::ffff:192.0.2.9".parse().unwrap(),
        ])),
        _ => Some(rng.ip()),
    };
    let mut request = peer_request(rng, peer);
    for name in ["x-forwarded-for", "forwarded"] {
        let mut lines = Vec::new();
        for _ in 0..rng.below(4) {
            let mut line = if name == "forwarded" {
                rng.forwarded()
            } else {
                rng.x_forwarded_for()
            };
            if rng.one_in(4) {
                rng.mutate(&mut line);
            }
            lines.push(line);
        }
        append_lines(&mut request, name, &lines);
    }
    let (parts, _) = request.into_parts();
    match extractor.extract(&parts) {
        Ok(key) => {
            assert!(peer.is_some(), "a key without a peer: {key}");
            assert!(key.starts_with("ip:") && key.len() <= 64, "{key}");
            let client = extractor.client_addr(&parts).unwrap();
            if untrusted {
                assert_eq!(client, peer.unwrap().to_canonical());
            }
            if let (IpAddr::V4(v4), false) = (client, regrouped) {
                assert_eq!(key.as_str(), format!("ip:{v4}"));
            }
            assert_eq!(extractor.extract(&parts).unwrap(), key, "not deterministic");
        }
        Err(error) => {
            assert!(peer.is_none(), "{error}");
            assert_eq!(error.kind(), KeyErrorKind::Server);
            assert!(!error.is_missing());
        }
    }
}

/// What `HeaderKey` must make of these lines: a key, absent, or invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Key,
    Absent(KeyErrorKind),
    Invalid(KeyErrorKind),
}

fn expect_header(lines: &[&HeaderValue]) -> Expect {
    match lines {
        [] => Expect::Absent(KeyErrorKind::Client),
        [value] => {
            let value = value.as_bytes().trim_ascii();
            let visible = value
                .iter()
                .all(|&byte| byte == b'\t' || (b' '..=b'~').contains(&byte));
            if value.is_empty() || !visible {
                Expect::Invalid(KeyErrorKind::Client)
            } else {
                Expect::Key
            }
        }
        _ => Expect::Invalid(KeyErrorKind::Client),
    }
}

fn check(result: &Result<tollgate::Key, KeyError>, expect: Expect) {
    match (result, expect) {
        (Ok(_), Expect::Key) => {}
        (Err(error), Expect::Absent(kind)) => {
            assert!(error.is_missing(), "{error} should be absent");
            assert_eq!(error.kind(), kind, "{error}");
        }
        (Err(error), Expect::Invalid(kind)) => {
            assert!(!error.is_missing(), "{error} should be invalid");
            assert_eq!(error.kind(), kind, "{error}");
        }
        (got, expect) => panic!("expected {expect:?}, got {got:?}"),
    }
}

fn header_value_lines(rng: &mut Rng) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    for _ in 0..rng.pick(&[0, 1, 1, 1, 1, 2, 3]).to_owned() {
        let mut line = Vec::new();
        match rng.below(4) {
            0 => {
                for _ in 0..rng.below(64) {
                    line.push(b'!' + rng.below(94) as u8);
                }
            }
            1 => {
                let max = if rng.one_in(32) { 1_000 } else { 40 };
                rng.bytes(max, &mut line)
            }
            2 => line.extend_from_slice(rng.pick_bytes(&[
                b"",
                b"  ",
                b"\t",
                b" sk_live_1 ",
                b"Bearer abc",
            ])),
            _ => {
                line.extend_from_slice(b"sk_live_");
                rng.bytes(24, &mut line);
            }
        }
        lines.push(line);
    }
    lines
}

fn header_key(rng: &mut Rng) {
    // The header name: any case of a good one, or arbitrary bytes.
    let extractor = if rng.one_in(8) {
        let mut name = Vec::new();
        rng.bytes(24, &mut name);
        let Ok(text) = std::str::from_utf8(&name) else {
            return;
        };
        // A name in any case is taken and lowercased; anything else is an error (and a
        // panic in `HeaderKey::new`, tested in the unit tests).
        if let Ok(extractor) = HeaderKey::try_new(text) {
            assert_eq!(extractor.header_name().as_str(), text.to_ascii_lowercase());
            HeaderKey::new(text);
        }
        return;
    } else {
        let mut name = *b"x-api-key";
        for byte in &mut name {
            if rng.one_in(2) {
                byte.make_ascii_uppercase();
            }
        }
        HeaderKey::new(std::str::from_utf8(&name).unwrap())
    };
    let extractor = if rng.one_in(4) {
        let mut salt = Vec::new();
        rng.bytes(16, &mut salt);
        extractor.salt(salt)
    } else {
        extractor
    };
    let mut request = Request::get("/").body(()).unwrap();
    append_lines(&mut request, "x-api-key", &header_value_lines(rng));
    let (parts, _) = request.into_parts();
    let lines: Vec<&HeaderValue> = parts.headers.get_all("x-api-key").iter().collect();
    let result = extractor.extract(&parts);
    check(&result, expect_header(&lines));
    if let Ok(key) = result {
        assert_eq!(key.len(), "x-api-key:".len() + 32, "{key}");
        assert!(key.starts_with("x-api-key:"));
    }
}

#[derive(Clone)]
struct User(u64);

fn combinators(rng: &mut Rng, bench: &Bench) {
    let peer = if rng.one_in(6) { None } else { Some(rng.ip()) };
    let mut request = peer_request(rng, peer);
    append_lines(&mut request, "x-api-key", &header_value_lines(rng));
    append_lines(&mut request, "x-tenant", &header_value_lines(rng));
    let mut xff = vec![rng.x_forwarded_for()];
    if rng.one_in(4) {
        rng.mutate(&mut xff[0]);
    }
    append_lines(&mut request, "x-forwarded-for", &xff);
    let user = rng.one_in(2);
    if user {
        request.extensions_mut().insert(User(rng.number()));
    }
    let mut path = String::from("/");
    for _ in 0..rng.below(12) {
        path.push(*rng.pick(&['a', 'b', '/', '%', '2', 'F', '.', '~', '-']));
    }
    if let Ok(uri) = path.parse() {
        *request.uri_mut() = uri;
    }
    let (parts, _) = request.into_parts();

    let api = HeaderKey::new("x-api-key");
    let tenant = HeaderKey::new("X-Tenant");
    let account = ExtensionKey::new("user", |user: &User| user.0.to_string());
    let ip = rng.pick(&bench.proxies).clone();
    let api_lines: Vec<&HeaderValue> = parts.headers.get_all("x-api-key").iter().collect();
    let tenant_lines: Vec<&HeaderValue> = parts.headers.get_all("x-tenant").iter().collect();
    let e_api = expect_header(&api_lines);
    let e_tenant = expect_header(&tenant_lines);
    let e_account = if user {
        Expect::Key
    } else {
        Expect::Absent(KeyErrorKind::Server)
    };
    let e_ip = if peer.is_some() {
        Expect::Key
    } else {
        Expect::Invalid(KeyErrorKind::Server)
    };
    // The model: `.or()` tries the fallback on an absent key only; a tuple is invalid if a
    // part is (the first in order), else absent if a part is, else a key.
    let or = |first: Expect, fallback: Expect| match first {
        Expect::Absent(_) => fallback,
        other => other,
    };
    let all = |parts: &[Expect]| {
        parts
            .iter()
            .copied()
            .find(|e| matches!(e, Expect::Invalid(_)))
            .or_else(|| {
                parts
                    .iter()
                    .copied()
                    .find(|e| matches!(e, Expect::Absent(_)))
            })
            .unwrap_or(Expect::Key)
    };
    // A closure extractor that answers per the user id: found, absent or invalid.
    let custom = key::from_fn(
        |parts| match parts.extensions.get::<User>().map(|u| u.0 % 3) {
            Some(0) => Ok(tollgate::Key::new("custom")),
            Some(1) => Err(KeyError::client("custom invalid")),
            _ => Err(KeyError::missing(KeyErrorKind::Client, "custom absent")),
        },
    );
    let e_custom = match parts.extensions.get::<User>().map(|u| u.0 % 3) {
        Some(0) => Expect::Key,
        Some(1) => Expect::Invalid(KeyErrorKind::Client),
        _ => Expect::Absent(KeyErrorKind::Client),
    };
    match rng.below(7) {
        0 => check(&api.clone().or(ip.clone()).extract(&parts), or(e_api, e_ip)),
        1 => check(
            &account
                .clone()
                .or(api.clone())
                .or(ip.clone())
                .extract(&parts),
            or(or(e_account, e_api), e_ip),
        ),
        2 => check(
            &(tenant.clone(), api.clone()).extract(&parts),
            all(&[e_tenant, e_api]),
        ),
        3 => check(
            &(Route, tenant.clone(), account.clone(), Global).extract(&parts),
            all(&[Expect::Key, e_tenant, e_account, Expect::Key]),
        ),
        4 => check(
            &(tenant.clone(), api.clone())
                .or(account.clone())
                .or(Global)
                .extract(&parts),
            or(or(all(&[e_tenant, e_api]), e_account), Expect::Key),
        ),
        5 => check(&custom.or(ip.clone()).extract(&parts), or(e_custom, e_ip)),
        _ => check(
            &(ip.clone(), api.clone().or(tenant.clone())).extract(&parts),
            all(&[e_ip, or(e_api, e_tenant)]),
        ),
    }
}

// ---------------------------------------------------------------------------------------
// Policies

fn policy_name(rng: &mut Rng) -> String {
    match rng.below(10) {
        0 => String::new(),
        1 => "x".repeat(rng.index(80)),
        2 => {
            let mut bytes = Vec::new();
            rng.bytes(12, &mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        }
        _ => (*rng.pick(&["api", "burst", "day", "a.b-c_d", "p0", "p1", "p2"])).to_owned(),
    }
}

fn arbitrary_policy(rng: &mut Rng) -> Result<Policy, PolicyError> {
    let name = policy_name(rng);
    let rate = |rng: &mut Rng| Rate::new(rng.number(), rng.duration());
    match rng.below(7) {
        0 => Policy::fixed_window(&name, rng.number(), rng.duration()),
        1 => Policy::sliding_log(&name, rng.number().min(1_000_000), rng.duration()),
        2 => Policy::sliding_window(&name, rng.number(), rng.duration()),
        3 => Policy::token_bucket(&name, rng.number(), rate(rng)),
        4 => Policy::leaky_bucket(&name, rng.number(), rate(rng)),
        5 => Policy::leaky_bucket_shaping(&name, rate(rng), rng.duration()),
        _ => Policy::gcra(&name, rate(rng), rng.number()),
    }
}

/// Note: resident memory grows by about 300 bytes per input here, across store resets:
/// every distinct policy (name and parameters) is interned for good in a process-wide id
/// table (`policy_id` in `src/policy.rs`), and these inputs build millions of them.
fn policy(rng: &mut Rng, bench: &mut Bench) {
    // A fresh store and clock now and then, so times near zero come back.
    bench.store_inputs += 1;
    if bench.store_inputs.is_multiple_of(50_000) {
        bench.clock = ManualClock::new();
        bench.store = MemoryStore::builder()
            .clock(bench.clock.clone())
            .max_keys(4096)
            .build();
    }
    let mut policies = Vec::new();
    for _ in 0..=rng.below(3) {
        match arbitrary_policy(rng) {
            Ok(policy) => {
                assert!(
                    policy.limit() >= 1 && policy.limit() <= MAX_LIMIT,
                    "{policy:?}"
                );
                assert!(!policy.name().is_empty());
                let _ = policy.window();
                let share = *rng.pick(&[
                    0.0,
                    -1.0,
                    0.5,
                    1.0 / 3.0,
                    1e-300,
                    0.999_999,
                    1.0,
                    2.0,
                    f64::NAN,
                    f64::INFINITY,
                    f64::MIN_POSITIVE,
                ]);
                let scaled = tollgate::LocalFallback::new()
                    .share(share)
                    .policies_for(&PolicySet::from(policy.clone()))[0]
                    .clone();
                assert!(
                    scaled.limit() >= 1 && scaled.limit() <= policy.limit(),
                    "{scaled:?} from {policy:?}"
                );
                policies.push(if rng.one_in(4) { scaled } else { policy });
            }
            Err(error) => {
                let _ = error.to_string();
            }
        }
    }
    if policies.is_empty() {
        return;
    }
    let set = match PolicySet::new(policies.clone()) {
        Ok(set) => set,
        // Two policies of one name: take the first alone, and add the rest with `with`.
        Err(_) => policies[1..]
            .iter()
            .fold(PolicySet::from(policies[0].clone()), |set, p| {
                set.with(p.clone())
            }),
    };
    let _ = tollgate::LocalFallback::new()
        .share(0.25)
        .policies_for(&set);
    let key = format!("k{}", rng.below(64));
    for _ in 0..=rng.below(4) {
        match rng.below(4) {
            0 => bench
                .clock
                .advance(Duration::from_nanos(rng.below(2_000_000))),
            1 => bench
                .clock
                .advance(Duration::from_millis(rng.below(100_000))),
            2 if rng.one_in(64) => bench
                .clock
                .advance(Duration::from_secs(rng.below(400 * 86_400))),
            _ => {}
        }
        let cost = match rng.below(3) {
            0 => 1,
            1 => rng.below(5),
            _ => rng.number(),
        };
        let decision = bench.store.check(&key, &set, cost);
        assert_eq!(decision.statuses().len(), set.len());
        for (status, policy) in decision.statuses().iter().zip(set.iter()) {
            assert!(status.remaining <= status.limit, "{policy:?}: {status:?}");
            assert_eq!(status.limit, policy.limit(), "{policy:?}");
        }
        if let Some(wait) = decision.retry_after() {
            assert!(wait > Duration::ZERO, "{set:?} cost {cost}: retry-after 0");
        }
        let shaping = |p: &Policy| matches!(p.algorithm(), Algorithm::LeakyShaping { .. });
        if set.iter().any(|p| !shaping(p) && cost > p.limit()) {
            assert!(!decision.is_allowed(), "{set:?}: cost {cost} admitted");
        }
    }
}

// ---------------------------------------------------------------------------------------
// GraphQL

const SDL: &str = r#"
    directive @cost(weight: Int!) on OBJECT | FIELD_DEFINITION | SCALAR | ENUM | ARGUMENT_DEFINITION
    directive @listSize(assumedSize: Int, slicingArguments: [String!], sizedFields: [String!], requireOneSlicingArgument: Boolean = true) on FIELD_DEFINITION
    type Query {
      viewer: User
      search(first: Int, last: Int): SearchConnection @listSize(slicingArguments: ["first", "last"], sizedFields: ["nodes"])
      feed: [Post] @listSize(assumedSize: 25, requireOneSlicingArgument: false)
      node(id: ID!): Node
      tags(limit: Int = 30): [String]
    }
    interface Node { id: ID! }
    type User implements Node { id: ID! login: String avatar: Image @cost(weight: 3) friends(first: Int): [User] }
    type Post implements Node { id: ID! title: String author: User comments(last: Int): [Post] }
    type Image @cost(weight: 2) { url: String }
    union SearchResult = User | Post
    type SearchConnection { totalCount: Int nodes: [SearchResult] }
    type Mutation { like(id: ID!): Post @cost(weight: 7) }
    type Subscription { posts(first: Int): [Post] }
"#;

const FIELDS: &[&str] = &[
    "viewer",
    "search",
    "feed",
    "node",
    "tags",
    "id",
    "login",
    "avatar",
    "url",
    "friends",
    "title",
    "author",
    "comments",
    "totalCount",
    "nodes",
    "like",
    "posts",
    "__typename",
    "x",
];
const TYPES: &[&str] = &[
    "User",
    "Post",
    "Node",
    "SearchResult",
    "Image",
    "Query",
    "Nope",
];
const FRAGMENTS: &[&str] = &["F", "G", "H"];

/// A GraphQL-shaped document: mostly valid, with cycles, unknown names, huge and
/// negative slices, variables, directives, deep nesting.
fn document(rng: &mut Rng, out: &mut String) {
    if rng.one_in(40) {
        // Deep nesting, past the recursion limits.
        let depth = rng.below(300) as usize;
        out.push_str(&"{ a ".repeat(depth));
        out.push_str(&"}".repeat(depth));
        return;
    }
    for definition in 0..=rng.below(3) {
        if definition > 0 && rng.one_in(2) {
            let name = *rng.pick(FRAGMENTS);
            let _ = write!(out, " fragment {name} on {} ", rng.pick(TYPES));
            selection_set(rng, out, 0);
            continue;
        }
        match rng.below(6) {
            0 => {}
            1 => out.push_str("query Q($n: Int = 5, $s: String) "),
            2 => out.push_str("mutation M "),
            3 => out.push_str("subscription S($n: Int) "),
            4 => {
                let _ = write!(out, "query {} ", rng.pick(&["A", "B", "Q"]));
            }
            _ => out.push_str("query "),
        }
        selection_set(rng, out, 0);
    }
}

/// Documents stay around a kilobyte: past this, selections stop growing.
const DOCUMENT_BUDGET: usize = 1_200;

fn selection_set(rng: &mut Rng, out: &mut String, depth: u32) {
    out.push('{');
    let width = if out.len() > DOCUMENT_BUDGET {
        0
    } else {
        rng.below(if depth > 3 { 2 } else { 4 })
    };
    for _ in 0..=width {
        out.push(' ');
        match rng.below(10) {
            0 => {
                let _ = write!(out, "...{}", rng.pick(FRAGMENTS));
            }
            1 if depth < 8 && out.len() < DOCUMENT_BUDGET => {
                let _ = write!(out, "... on {} ", rng.pick(TYPES));
                selection_set(rng, out, depth + 1);
            }
            _ => {
                if rng.one_in(6) {
                    let _ = write!(out, "a{}: ", rng.below(5));
                }
                out.push_str(rng.pick_str(FIELDS));
                if rng.one_in(2) {
                    arguments(rng, out);
                }
                if rng.one_in(12) {
                    out.push_str(rng.pick_str(&[
                        " @skip(if: true)",
                        " @include(if: $b)",
                        " @cost(weight: 9)",
                    ]));
                }
                if depth < 10 && out.len() < DOCUMENT_BUDGET && rng.one_in(2) {
                    out.push(' ');
                    selection_set(rng, out, depth + 1);
                }
            }
        }
    }
    out.push_str(" }");
}

fn arguments(rng: &mut Rng, out: &mut String) {
    out.push('(');
    for index in 0..=rng.below(2) {
        if index > 0 {
            out.push_str(", ");
        }
        out.push_str(rng.pick_str(&["first", "last", "limit", "id", "n", "count"]));
        out.push_str(": ");
        match rng.below(8) {
            0 => out.push_str("$n"),
            1 => out.push_str("$s"),
            2 => {
                let _ = write!(out, "-{}", rng.number());
            }
            3 => out.push_str(rng.pick_str(&[
                "1e400",
                "3.5",
                "null",
                "\"10\"",
                "[1, 2]",
                "{a: 1}",
                "true",
                "99999999999999999999999",
            ])),
            _ => {
                let _ = write!(out, "{}", rng.number());
            }
        }
    }
    out.push(')');
}

fn variables(rng: &mut Rng) -> Option<serde_json::Map<String, serde_json::Value>> {
    use serde_json::{Value, json};
    if rng.one_in(2) {
        return None;
    }
    let value = match rng.below(7) {
        0 => json!(rng.number()),
        1 => json!(-(rng.below(1_000) as i64)),
        2 => json!(1.5e300),
        3 => json!("12"),
        4 => Value::Null,
        5 => json!([1, 2]),
        _ => json!(rng.below(200)),
    };
    let mut map = serde_json::Map::new();
    map.insert("n".into(), value);
    if rng.one_in(3) {
        map.insert("b".into(), json!(rng.one_in(2)));
    }
    Some(map)
}

/// A document, sometimes mutated byte by byte (kept text: invalid UTF-8 is replaced).
fn hostile_document(rng: &mut Rng) -> String {
    let mut text = String::new();
    document(rng, &mut text);
    if rng.one_in(3) {
        let mut bytes = text.into_bytes();
        rng.mutate(&mut bytes);
        if rng.one_in(4) {
            rng.mutate(&mut bytes);
        }
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    text
}

/// A JSON request body: one request, a batch, or broken.
fn json_body(rng: &mut Rng) -> Vec<u8> {
    use serde_json::{Value, json};
    let request = |rng: &mut Rng| {
        let mut object = serde_json::Map::new();
        if !rng.one_in(16) {
            object.insert("query".into(), json!(hostile_document(rng)));
        }
        match rng.below(6) {
            0 => {
                object.insert(
                    "operationName".into(),
                    json!(rng.pick(&["A", "B", "Q", "M", "S"])),
                );
            }
            1 => {
                object.insert("operationName".into(), json!(7));
            }
            _ => {}
        }
        if let Some(variables) = variables(rng) {
            object.insert("variables".into(), Value::Object(variables));
        } else if rng.one_in(8) {
            object.insert("variables".into(), json!("n=1"));
        }
        Value::Object(object)
    };
    let body = match rng.below(8) {
        0 => Value::Array((0..rng.below(14)).map(|_| request(rng)).collect()),
        1 => json!(rng.number()),
        _ => request(rng),
    };
    let mut bytes = serde_json::to_vec(&body).unwrap();
    if rng.one_in(6) {
        rng.mutate(&mut bytes);
    }
    bytes
}

fn graphql(rng: &mut Rng, bench: &Bench) {
    if rng.one_in(500) {
        // Hostile schemas too (server configuration, but a parser all the same).
        let mut sdl = SDL.as_bytes().to_vec();
        rng.mutate(&mut sdl);
        if let Ok(coster) = GraphqlCost::new().with_schema(&String::from_utf8_lossy(&sdl)) {
            let _ = coster.query_cost(&hostile_document(rng), None, None);
        }
        return;
    }
    let coster = rng.pick(&bench.costers);
    if rng.one_in(3) {
        let body = json_body(rng);
        let _ = coster.json_cost(&body);
    } else {
        let document = hostile_document(rng);
        let name = if rng.one_in(4) {
            Some(*rng.pick(&["A", "B", "Q", "M", "S", "zz"]))
        } else {
            None
        };
        let variables = variables(rng);
        let first = coster.query_cost(&document, name, variables.as_ref());
        if rng.one_in(16) {
            assert_eq!(
                first,
                coster.query_cost(&document, name, variables.as_ref()),
                "not deterministic"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Whole requests through both layers

fn build_stack(rng: &mut Rng, bench: &Bench) -> Stack {
    let mut set = PolicySet::from(Policy::token_bucket("api", 50, Rate::per_second(10)).unwrap());
    for _ in 0..rng.below(3) {
        if let Ok(policy) = arbitrary_policy(rng) {
            set = set.with(policy);
        }
    }
    let store = MemoryStore::builder().max_keys(1024).build();
    let mut limiter = RateLimitLayer::new(store)
        .policies(set)
        .key(HeaderKey::new("x-api-key").or(rng.pick(&bench.proxies).clone()))
        .cost(FromExtension::or(1))
        .headers(*rng.pick(&[
            HeaderStyle::Draft11,
            HeaderStyle::Draft6,
            HeaderStyle::Legacy,
            HeaderStyle::None,
        ]));
    if rng.one_in(2) {
        limiter = limiter.on_missing_key(MissingKey::Allow);
    }
    let mut graphql = GraphqlCostLayer::new(rng.pick(&bench.costers).clone())
        .max_body(*rng.pick(&[0, 64, 4096, 1 << 20]));
    if rng.one_in(3) {
        graphql = graphql.on_invalid(Invalid::Charge(rng.number()));
    }
    let inner = tower::service_fn(|_request: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::from("ok")))
    });
    let service = tower::ServiceBuilder::new()
        .layer(graphql)
        .layer(limiter)
        .service(inner);
    BoxCloneService::new(service)
}

fn percent_encode(text: &[u8], out: &mut String) {
    for &byte in text {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

fn layer(rng: &mut Rng, bench: &mut Bench) {
    let used = bench.stack.as_ref().map_or(0, |(_, used)| *used);
    if bench.stack.is_none() || used >= 200 {
        bench.stack = Some((build_stack(rng, bench), 0));
    }
    let (stack, used) = bench.stack.as_mut().unwrap();
    *used += 1;
    let stack = stack.clone();

    let get = rng.one_in(3);
    let mut uri = String::from("/graphql");
    if get {
        uri.push('?');
        for (position, name) in ["query", "operationName", "variables", "query", "x"]
            .iter()
            .enumerate()
        {
            // The query usually, a second one or the others now and then.
            let include = if position == 0 {
                !rng.one_in(8)
            } else {
                rng.one_in(3)
            };
            if !include {
                continue;
            }
            if !uri.ends_with('?') {
                uri.push('&');
            }
            uri.push_str(name);
            uri.push('=');
            let value = match *name {
                "query" => hostile_document(rng).into_bytes(),
                "variables" => {
                    let mut json = serde_json::to_vec(&variables(rng)).unwrap();
                    if rng.one_in(4) {
                        rng.mutate(&mut json);
                    }
                    json
                }
                _ => {
                    let mut bytes = Vec::new();
                    rng.bytes(8, &mut bytes);
                    bytes
                }
            };
            if rng.one_in(10) {
                // Raw, unencoded: whatever the URI parser keeps.
                uri.push_str(
                    &String::from_utf8_lossy(&value).replace(|c: char| !c.is_ascii_graphic(), ""),
                );
            } else {
                percent_encode(&value, &mut uri);
            }
        }
    }
    let Ok(uri) = uri.parse::<http::Uri>() else {
        return;
    };
    let body = if get {
        Vec::new()
    } else {
        match rng.below(4) {
            0 => hostile_document(rng).into_bytes(),
            1 => {
                let mut bytes = Vec::new();
                rng.bytes(64, &mut bytes);
                bytes
            }
            _ => json_body(rng),
        }
    };
    let method = if get {
        Method::GET
    } else {
        rng.pick(&[Method::POST, Method::PUT]).clone()
    };
    let peer = if rng.one_in(20) { None } else { Some(rng.ip()) };
    let mut request = peer_request(rng, peer).map(|()| Body::from(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    let content_type: &[u8] = rng.pick_bytes(&[
        b"application/json",
        b"application/graphql",
        b"Application/GraphQL ; charset=utf-8",
        b"application/json;charset=utf-8",
        b"text/plain",
        b"",
        b";",
        b"\xff\xfe",
    ]);
    if !rng.one_in(6) {
        append_lines(&mut request, "content-type", &[content_type.to_vec()]);
    }
    append_lines(&mut request, "x-api-key", &header_value_lines(rng));
    let mut xff = rng.x_forwarded_for();
    if rng.one_in(4) {
        rng.mutate(&mut xff);
    }
    append_lines(&mut request, "x-forwarded-for", &[xff]);

    let (status, retry_after) = bench.runtime.block_on(async {
        let response = stack.oneshot(request).await.unwrap();
        let status = response.status();
        let retry_after = response.headers().contains_key("retry-after");
        let _ = response.into_body().collect().await;
        (status, retry_after)
    });
    assert!(
        [
            StatusCode::OK,
            StatusCode::BAD_REQUEST,
            StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::INTERNAL_SERVER_ERROR,
        ]
        .contains(&status),
        "{status}"
    );
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        assert!(peer.is_none(), "a 500 with a peer address");
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        assert!(retry_after, "a 429 without Retry-After");
    }
}
