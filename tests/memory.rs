//! Bounded memory: ten million distinct identities (rotating IPv4 addresses, then IPv6
//! /128s) pass through the in-process store, which never holds more than its bound; and
//! IPv6 prefix grouping collapses a whole /64 into one key.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use http::Request;
use tollgate::clock::ManualClock;
use tollgate::key::{ClientIp, KeyExtractor};
use tollgate::{MemoryStore, Policy, PolicySet, Rate};

const IDENTITIES: u32 = 10_000_000;
const MAX_KEYS: usize = 100_000;
/// How much resident memory the flood may add. 100,000 identities of 64 bytes are about
/// 6 MB; about 7.5 MB is measured (the index's slack, a partly filled slab chunk per
/// shard, the allocator). Growth with the number of identities sent (10 million) would be
/// hundreds of MB.
const MAX_GROWTH_KIB: u64 = 64 * 1024;

/// This process's resident memory (`VmRSS` in /proc/self/status), where there is a /proc.
fn resident_kib() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .expect("a VmRSS line in /proc/self/status");
    let kib = line.trim().strip_suffix("kB").map(str::trim);
    Some(
        kib.and_then(|kib| kib.parse().ok())
            .unwrap_or_else(|| panic!("VmRSS is not in kB: {line:?}")),
    )
}

/// The key `extractor` gives a request from `ip`, reusing one request head.
fn key_of(parts: &mut http::request::Parts, extractor: &ClientIp, ip: IpAddr) -> tollgate::Key {
    parts.extensions.insert(SocketAddr::new(ip, 443));
    extractor.extract(parts).unwrap()
}

fn head() -> http::request::Parts {
    Request::get("/").body(()).unwrap().into_parts().0
}

#[test]
fn ten_million_identities_stay_within_the_bound() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(MAX_KEYS)
        .build();
    // A long-lived state per identity (a day), so nothing is fresh on its own: the
    // bound alone must hold the line.
    let policies = PolicySet::from(Policy::token_bucket("api", 10, Rate::per_day(10)).unwrap());
    let before = resident_kib();
    let ipv4 = ClientIp::peer();
    let ipv6 = ClientIp::peer().ipv6_prefix(128);
    let mut parts = head();
    for i in 0..IDENTITIES {
        // Half the flood rotates IPv4 addresses, half IPv6 /128s.
        let key = if i % 2 == 0 {
            key_of(
                &mut parts,
                &ipv4,
                IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)),
            )
        } else {
            key_of(
                &mut parts,
                &ipv6,
                IpAddr::V6(Ipv6Addr::from((0x2001_0db8_u128 << 96) | u128::from(i))),
            )
        };
        assert!(store.check(key.as_str(), &policies, 1).is_allowed());
        if i % 1_000_000 == 0 {
            assert!(store.len() <= MAX_KEYS, "{} identities held", store.len());
            clock.advance(Duration::from_millis(1));
        }
    }
    let held = store.len();
    assert!(
        held <= MAX_KEYS && held > MAX_KEYS / 2,
        "{held} identities held"
    );
    let grown = resident_kib()
        .zip(before)
        .map(|(after, before)| after.saturating_sub(before));
    println!(
        "{IDENTITIES} identities through a store bounded at {MAX_KEYS}: {held} held, {} evicted before fresh, resident memory grew by {grown:?} KiB",
        store.evicted_live()
    );
    if let Some(grown) = grown {
        assert!(
            grown < MAX_GROWTH_KIB,
            "resident memory grew by {grown} KiB (bound {MAX_GROWTH_KIB} KiB) for a store bounded at {MAX_KEYS} identities"
        );
    }
}

#[test]
fn an_ipv6_64_is_one_identity() {
    let store = MemoryStore::builder().clock(ManualClock::new()).build();
    let policies =
        PolicySet::from(Policy::fixed_window("api", 5, Duration::from_secs(60)).unwrap());
    let extractor = ClientIp::peer();
    let mut parts = head();
    let mut admitted = 0;
    for host in 0..10_000u128 {
        // Every address an attacker holds in 2001:db8:1:2::/64.
        let ip = IpAddr::V6(Ipv6Addr::from(
            (0x2001_0db8_0001_0002_u128 << 64) | (host * 7_919),
        ));
        if store
            .check(key_of(&mut parts, &extractor, ip).as_str(), &policies, 1)
            .is_allowed()
        {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5);
    assert_eq!(store.len(), 1);
}

/// A small bound is one store, not many stores of one identity: with `max_keys(100)` and
/// 64 shards (eight a core on an eight-core host), each shard once held one identity, so
/// two live identities that hashed to one shard evicted each other on every request, and
/// neither was ever limited. A shard holds at least 64 identities now (fewer shards when
/// the bound is small), and 65 identities within a bound of 100 keep their state.
#[test]
fn a_small_bound_keeps_every_identity_it_has_room_for() {
    let clock = ManualClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(100)
        .shards(64)
        .build();
    assert_eq!(store.capacity(), 100);
    let once = PolicySet::from(Policy::fixed_window("once", 1, Duration::from_secs(3600)).unwrap());
    let mut admitted = 0;
    for _round in 0..10 {
        for identity in 0..65 {
            if store
                .check(&format!("user:{identity}"), &once, 1)
                .is_allowed()
            {
                admitted += 1;
            }
        }
        clock.advance(Duration::from_secs(1));
    }
    assert_eq!(admitted, 65, "one request an identity in the hour");
    assert_eq!(store.evicted_live(), 0);
    // A large bound keeps its shards (and each its share).
    let large = MemoryStore::builder().max_keys(1 << 20).shards(64).build();
    assert_eq!(large.capacity(), 1 << 20);
    // An absurd shard count is bounded by the keys, without overflow.
    let absurd = MemoryStore::builder()
        .max_keys(1 << 12)
        .shards(1 << 58)
        .build();
    assert_eq!(absurd.capacity(), 1 << 12);
}

/// Any shard count is taken, rounded to what the bound allows: `shards(usize::MAX)`
/// overflowed rounding up to a power of two (a panic in a debug build, then a division
/// by zero).
#[test]
fn any_number_of_shards_builds_a_store() {
    for shards in [0, 3, 1 << 40, usize::MAX] {
        let store = tollgate::MemoryStore::builder()
            .shards(shards)
            .max_keys(1_000)
            .build();
        let set = tollgate::PolicySet::from(
            tollgate::Policy::fixed_window("api", 1, std::time::Duration::from_secs(60)).unwrap(),
        );
        assert!(store.check("k", &set, 1).is_allowed(), "{shards}");
        assert!(!store.check("k", &set, 1).is_allowed(), "{shards}");
    }
}

/// A refusal built outside the store (`Decision::new`: the `Limiter`'s "waited too long")
/// debited nothing: a release of it frees no slot, as on Redis. Its receipt said every
/// policy was debited, and a caller that releases whatever it got freed a slot another
/// request held.
#[test]
fn a_release_of_a_refusal_built_outside_the_store_frees_nothing() {
    use tollgate::{Adjustment, Decision, Outcome, Policy, PolicySet};
    let store = tollgate::MemoryStore::new();
    let set = PolicySet::from(Policy::concurrency("jobs", 1).unwrap());
    assert!(store.check("worker", &set, 1).is_allowed());
    let refused = Decision::new(
        Outcome::Denied {
            policy: 0,
            retry_after: std::time::Duration::from_secs(1),
        },
        [],
    );
    let after = store.adjust_now("worker", &set, &Adjustment::release(1, refused.receipt()));
    assert_eq!(
        after.statuses()[0].remaining,
        0,
        "the running job's slot was freed"
    );
    assert!(!store.check("worker", &set, 1).is_allowed());
}

/// An identity's freshness follows its state down as well as up: a debt forgiven (a
/// `set_remaining`, a grant, a reset) leaves a state fresh again at once, and the store
/// may forget it. It kept the freshness of the debt (a daily bucket owing 100 quotas: kept
/// for 100 days after it was forgiven), ranked among the last to go when the store is
/// full, and never purged.
#[test]
fn a_forgiven_debt_leaves_the_identity_fresh_again() {
    use tollgate::Adjustment;
    let clock = ManualClock::new();
    clock.set(Duration::from_secs(1));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let daily = PolicySet::from(Policy::token_bucket("daily", 10, Rate::per_day(10)).unwrap());
    let debits: Vec<_> = (0..100).map(|_| store.check("owes", &daily, 0)).collect();
    for debit in debits {
        let settle = Adjustment::settle(0, 10, debit.receipt());
        store.adjust_now("owes", &daily, &settle);
    }
    assert!(!store.check("owes", &daily, 0).is_allowed(), "owing");
    store.adjust_now("owes", &daily, &Adjustment::set_remaining(10));
    assert_eq!(store.purge_fresh(), 1, "full again: nothing to keep");
    // A reset, through a set of two policies, likewise.
    let both = PolicySet::new([
        Policy::token_bucket("daily", 10, Rate::per_day(10)).unwrap(),
        Policy::fixed_window("hourly", 5, Duration::from_secs(3600)).unwrap(),
    ])
    .unwrap();
    let debit = store.check("both", &both, 5);
    store.adjust_now("both", &both, &Adjustment::settle(5, 15, debit.receipt()));
    store.reset_now("both", &both);
    store.check("both", &both, 0);
    assert_eq!(store.purge_fresh(), 1, "reset: nothing to keep");
}

/// A clock two threads read a little apart, as the default `CarriedClock` may (each
/// thread's time never steps back, but one may be up to a millisecond behind another),
/// or as any clock read before a request waits for its shard's lock: the next reading
/// is `lag` behind the shared time, once.
#[derive(Clone, Default)]
struct Lagging {
    now: std::sync::Arc<std::sync::atomic::AtomicU64>,
    lag: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl tollgate::clock::Clock for Lagging {
    fn now(&self) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        self.now.load(SeqCst) - self.lag.swap(0, SeqCst)
    }
}

/// A request whose time was read just before a window's end, but which reached the store
/// just after its identity was forgotten there (fresh at the window's end), is not
/// counted in a window it finds empty: the shard's time never steps back, so it counts in
/// the new window, and no window admits more than its limit.
#[test]
fn a_request_read_behind_a_forgetting_gets_no_extra_quota() {
    use std::sync::atomic::Ordering::SeqCst;
    let clock = Lagging::default();
    let at = |millis: u64| clock.now.store(millis * 1_000_000, SeqCst);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policies = PolicySet::from(Policy::fixed_window("api", 2, Duration::from_secs(1)).unwrap());
    let mut admitted = 0;
    at(500);
    for _ in 0..3 {
        admitted += usize::from(store.check("user-7", &policies, 1).is_allowed());
    }
    assert_eq!(admitted, 2, "the first window's limit");
    // The window ends; the identity is fresh, and forgotten.
    at(1_000);
    assert_eq!(store.purge_fresh(), 1);
    // A request read a millisecond behind, then two on time.
    clock.lag.store(1_000_000, SeqCst);
    for _ in 0..3 {
        admitted += usize::from(store.check("user-7", &policies, 1).is_allowed());
    }
    assert_eq!(
        admitted, 4,
        "two windows admit two each, however the clock was read"
    );
    // Likewise when the store forgets an identity to make room for another.
    let small = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(1)
        .build();
    at(3_500);
    let mut admitted = 0;
    for _ in 0..3 {
        admitted += usize::from(small.check("a", &policies, 1).is_allowed());
    }
    at(4_000);
    // "b" fills the only place: "a", fresh now, is forgotten to make room.
    small.check("b", &policies, 1);
    clock.lag.store(1_000_000, SeqCst);
    for _ in 0..3 {
        admitted += usize::from(small.check("a", &policies, 1).is_allowed());
    }
    assert!(admitted <= 4, "{admitted} admitted in two windows of two");
}
