//! The client side: reading what servers say (draft-11, draft-6, X-RateLimit-*,
//! Retry-After), waiting instead of being refused, retries, and caps on absurd values.

#![cfg(feature = "client")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use tollgate::client::{PacingLayer, server_wait};
use tollgate::key::ClientIp;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer};
use tower::{Layer, Service, ServiceExt, service_fn};

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(*name, HeaderValue::from_str(value).unwrap());
    }
    map
}

// A 429 is never retried straight back, whatever it says (`Retry-After: 0`, a date in
// the past): the layer waits at least a second, and so does the wait `server_wait` tells
// a retry loop of one's own. It said `0` there, and such a loop hammered the server.
#[test]
fn server_wait_never_sends_a_refused_request_straight_back() {
    let too_many = StatusCode::TOO_MANY_REQUESTS;
    for said in ["0", "Thu, 01 Jan 1970 00:00:00 GMT"] {
        assert_eq!(
            server_wait(too_many, &headers(&[("retry-after", said)])),
            Some(Duration::from_secs(1)),
            "{said}"
        );
    }
    assert_eq!(
        server_wait(too_many, &headers(&[("retry-after", "7")])),
        Some(Duration::from_secs(7))
    );
    // Not refused: a zero is no wait.
    assert_eq!(
        server_wait(
            StatusCode::SERVICE_UNAVAILABLE,
            &headers(&[("retry-after", "0")])
        ),
        Some(Duration::ZERO)
    );
}

#[test]
fn what_a_server_says_is_read() {
    let ok = StatusCode::OK;
    let secs = Duration::from_secs;
    // draft-11 (section 4): a member with r=0 asks for t seconds.
    assert_eq!(
        server_wait(ok, &headers(&[("ratelimit", "\"api\";r=0;t=5")])),
        Some(secs(5))
    );
    assert_eq!(
        server_wait(ok, &headers(&[("ratelimit", "\"api\";r=3;t=5")])),
        None
    );
    assert_eq!(
        server_wait(
            ok,
            &headers(&[("ratelimit", "\"a\";r=2;t=1, \"b\";r=0;t=30")])
        ),
        Some(secs(30))
    );
    // Malformed and negative values are ignored.
    assert_eq!(
        server_wait(ok, &headers(&[("ratelimit", "\"api\";r=0;t=-5")])),
        None
    );
    // A remaining written as a decimal (Reddit's `x-ratelimit-remaining: 0.0`).
    assert_eq!(
        server_wait(
            ok,
            &headers(&[
                ("x-ratelimit-remaining", "0.0"),
                ("x-ratelimit-reset", "30")
            ])
        ),
        Some(secs(30))
    );
    assert_eq!(
        server_wait(
            ok,
            &headers(&[
                ("x-ratelimit-remaining", "2.0"),
                ("x-ratelimit-reset", "30")
            ])
        ),
        None
    );
    assert_eq!(server_wait(ok, &headers(&[("ratelimit", "r=0;;t=")])), None);
    // draft-6 and X-RateLimit-*: remaining 0 until reset (seconds, or a Unix time).
    assert_eq!(
        server_wait(
            ok,
            &headers(&[("ratelimit-remaining", "0"), ("ratelimit-reset", "7")])
        ),
        Some(secs(7))
    );
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 100;
    let wait = server_wait(
        ok,
        &headers(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &unix.to_string()),
        ]),
    )
    .unwrap();
    assert!(wait > secs(95) && wait <= secs(100), "{wait:?}");
    assert_eq!(
        server_wait(
            ok,
            &headers(&[("x-ratelimit-remaining", "-1"), ("x-ratelimit-reset", "9")])
        ),
        None
    );
    // Retry-After (RFC 9110, section 10.2.3): seconds or an HTTP date.
    let refused = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(
        server_wait(refused, &headers(&[("retry-after", "3")])),
        Some(secs(3))
    );
    let date = httpdate::fmt_http_date(std::time::SystemTime::now() + secs(60));
    let wait = server_wait(refused, &headers(&[("retry-after", &date)])).unwrap();
    assert!(wait > secs(55) && wait <= secs(60), "{wait:?}");
    // delay-seconds is 1*DIGIT with no bound: a value past u64 is a very long wait, not
    // no word at all; a sign is not a digit.
    assert!(
        server_wait(
            refused,
            &headers(&[("retry-after", "18446744073709551616")])
        )
        .unwrap()
            >= secs(u64::MAX)
    );
    assert_eq!(
        server_wait(refused, &headers(&[("retry-after", "+5")])),
        Some(secs(1))
    );
    // RFC 9651, section 4.2: the field's lines are one list; when it does not parse, the
    // whole field is ignored, not only the line that is wrong.
    assert_eq!(
        server_wait(
            ok,
            &headers(&[("ratelimit", "\"api\";r=0;t=30"), ("ratelimit", "\"b\";r=")])
        ),
        None
    );
    assert_eq!(
        server_wait(
            ok,
            &headers(&[
                ("ratelimit", "\"api\";r=1;t=30"),
                ("ratelimit", "\"b\";r=0;t=9")
            ])
        ),
        Some(secs(9))
    );
    // An empty line adds no member (RFC 9651, section 3.1: a list may be empty).
    assert_eq!(
        server_wait(
            ok,
            &headers(&[("ratelimit", "\"api\";r=0;t=30"), ("ratelimit", "")])
        ),
        Some(secs(30))
    );
    // A 429 that says nothing: a second.
    assert_eq!(server_wait(refused, &HeaderMap::new()), Some(secs(1)));
    assert_eq!(
        server_wait(refused, &headers(&[("retry-after", "soon")])),
        Some(secs(1))
    );
}

/// The client's side of draft-11 (section 7 and section 4.1), read from the draft's text:
/// `t` is OPTIONAL (section 4.1: a member with `r=0` and no `t` names no window, so it
/// asks for no wait: tollgate's own in-flight policies send just that); Retry-After takes
/// precedence over RateLimit (section 7: "the Retry-After field MUST take precedence");
/// a malformed RateLimit field is ignored whole (section 7: "Malformed RateLimit header
/// fields MUST be ignored"; `r` is REQUIRED, section 4.1); fields of a response from a
/// cache (a positive `Age`) are ignored (section 7.3).
#[test]
fn what_a_server_says_is_read_as_draft_11_section_7_asks() {
    let ok = StatusCode::OK;
    let refused = StatusCode::TOO_MANY_REQUESTS;
    let secs = Duration::from_secs;
    assert_eq!(
        server_wait(ok, &headers(&[("ratelimit", "\"inflight\";r=0")])),
        None
    );
    assert_eq!(
        server_wait(
            refused,
            &headers(&[("retry-after", "2"), ("ratelimit", "\"day\";r=0;t=3600")])
        ),
        Some(secs(2))
    );
    assert_eq!(
        server_wait(
            StatusCode::SERVICE_UNAVAILABLE,
            &headers(&[
                ("retry-after", "2"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "600")
            ])
        ),
        Some(secs(2))
    );
    // Without Retry-After, a 429's RateLimit stands.
    assert_eq!(
        server_wait(refused, &headers(&[("ratelimit", "\"day\";r=0;t=30")])),
        Some(secs(30))
    );
    // One malformed member (a negative `r`, a missing `r`, a `t` that is not an
    // Integer) and the field says nothing.
    for field in [
        "\"a\";r=0;t=30, \"b\";r=-1",
        "\"a\";r=0;t=30, \"b\";t=5",
        "\"a\";r=0;t=30, \"b\";r=0;t=1.5",
    ] {
        assert_eq!(
            server_wait(ok, &headers(&[("ratelimit", field)])),
            None,
            "{field}"
        );
    }
    // From a cache: ignored; a fresh response (Age 0) is read.
    let cached = |age: &str| {
        server_wait(
            ok,
            &headers(&[("age", age), ("ratelimit", "\"a\";r=0;t=30")]),
        )
    };
    assert_eq!(cached("5"), None);
    assert_eq!(cached("0"), Some(secs(30)));
    assert_eq!(
        server_wait(
            ok,
            &headers(&[
                ("age", "5"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "30")
            ])
        ),
        None
    );
}

/// A dated wait (an HTTP-date Retry-After, a Unix-time reset) is a point on the server's
/// clock: it is measured from the response's `Date` (RFC 9110, section 6.6.1: "the date
/// and time at which the message was originated"), aged by `Age` (RFC 9111, section 5.1),
/// not from this machine's clock, which may be off by any amount. A server an hour ahead
/// asks for 30 seconds, not an hour and a half minute; one an hour behind is not read as
/// asking for nothing. Without a `Date` (or with one that does not parse), the local
/// clock is all there is.
#[test]
fn a_dated_wait_is_measured_on_the_servers_clock() {
    let secs = Duration::from_secs;
    let now = std::time::SystemTime::now();
    let refused = StatusCode::TOO_MANY_REQUESTS;
    // An hour ahead, an hour behind, in step.
    for server_now in [now + secs(3600), now - secs(3600), now] {
        let date = httpdate::fmt_http_date(server_now);
        let retry_at = httpdate::fmt_http_date(server_now + secs(30));
        let wait = server_wait(
            refused,
            &headers(&[("date", &date), ("retry-after", &retry_at)]),
        )
        .unwrap();
        assert!(wait > secs(28) && wait <= secs(31), "{date}: {wait:?}");
        let unix = server_now
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        for reset in [(unix + 30).to_string(), ((unix + 30) * 1000).to_string()] {
            let wait = server_wait(
                StatusCode::OK,
                &headers(&[
                    ("date", &date),
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", &reset),
                ]),
            )
            .unwrap();
            assert!(
                wait > secs(28) && wait <= secs(31),
                "{date} {reset}: {wait:?}"
            );
        }
    }
    // A response that waited 10 s in a cache before it came: 10 s of its 30 are gone.
    let server_now = now + secs(3600);
    let wait = server_wait(
        refused,
        &headers(&[
            ("date", &httpdate::fmt_http_date(server_now - secs(10))),
            ("age", "10"),
            (
                "retry-after",
                &httpdate::fmt_http_date(server_now + secs(20)),
            ),
        ]),
    )
    .unwrap();
    assert!(wait > secs(18) && wait <= secs(21), "{wait:?}");
    // A server in step with this machine: its Date, whole seconds stamped before the
    // response crossed the network, is no correction; a reset 300 ms away in
    // milliseconds is a wait under a second, not one stretched by Date's rounding.
    let in_step = httpdate::fmt_http_date(now);
    let soon = now.duration_since(std::time::UNIX_EPOCH).unwrap() + Duration::from_millis(300);
    let wait = server_wait(
        StatusCode::OK,
        &headers(&[
            ("date", &in_step),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &soon.as_millis().to_string()),
        ]),
    )
    .unwrap();
    assert!(wait <= Duration::from_millis(300), "{wait:?}");
    // Age is delta-seconds, 1*DIGIT (RFC 9111, section 1.2.2): `+10` is no age (the
    // rate-limit fields are read), and one past what a number holds is the largest age
    // (2^31 s), a response long out of date whose fields are ignored (draft-11, section
    // 7.3), not one read as fresh.
    let reset = |age: &str| {
        server_wait(
            StatusCode::OK,
            &headers(&[
                ("age", age),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "7"),
            ]),
        )
    };
    assert_eq!(reset("+10"), Some(secs(7)));
    assert_eq!(reset("0"), Some(secs(7)));
    assert_eq!(reset("99999999999999999999999"), None);
    assert_eq!(reset("3"), None);
    // A Date that does not parse: the local clock.
    let wait = server_wait(
        refused,
        &headers(&[
            ("date", "yesterday"),
            ("retry-after", &httpdate::fmt_http_date(now + secs(60))),
        ]),
    )
    .unwrap();
    assert!(wait > secs(58) && wait <= secs(60), "{wait:?}");
}
/// This machine's clock a few seconds ahead of the server's (less than the five seconds
/// past which `Date` was read as the server's now): a 429 asking for 3 s by an HTTP date
/// was measured on the local clock, already past it, and read as the floor of a second;
/// each retry came early and was refused again. `Date` is stamped before the response
/// crosses the network, in whole seconds, so it is never ahead of the server's now: a
/// local clock ahead of it by more than that rounding and the transit is the one off.
#[test]
fn a_local_clock_ahead_of_the_servers_does_not_cut_a_dated_wait_short() {
    let secs = Duration::from_secs;
    // A 429 from a server whose clock reads `server_now`, asking for `wait` by date.
    let dated = |server_now: std::time::SystemTime, wait: Duration| {
        server_wait(
            StatusCode::TOO_MANY_REQUESTS,
            &headers(&[
                ("date", &httpdate::fmt_http_date(server_now)),
                ("retry-after", &httpdate::fmt_http_date(server_now + wait)),
            ]),
        )
        .unwrap()
    };
    let now = std::time::SystemTime::now;
    let wait = dated(now() - secs(4), secs(3));
    assert!(wait > secs(2) && wait <= secs(4), "{wait:?}");
    // A second and a half ahead, a 2 s wait: never measured short of it.
    assert_eq!(
        dated(now() - Duration::from_millis(1_500), secs(2)),
        secs(2)
    );
    // A server's clock a few seconds ahead of this machine's: the local clock still
    // measures (the wait comes out longer, never shorter, than asked).
    let wait = dated(now() + secs(4), secs(3));
    assert!(wait > secs(5) && wait <= secs(8), "{wait:?}");
}

/// The X- fields' resets as services write them: a Unix time with a fraction
/// (Discord's `1470173023.123`), or in milliseconds; neither is ignored or read as a
/// wait of millennia.
#[test]
fn legacy_resets_with_a_fraction_or_in_milliseconds_are_read() {
    let ok = StatusCode::OK;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let reset = |value: String| {
        server_wait(
            ok,
            &headers(&[
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", &value),
            ]),
        )
    };
    let fraction = reset(format!("{}.250", now.as_secs() + 100)).unwrap();
    assert!(
        fraction > Duration::from_secs(95) && fraction <= Duration::from_secs(101),
        "{fraction:?}"
    );
    let millis = reset((now.as_millis() + 100_000).to_string()).unwrap();
    // A fraction of a millisecond rounds up: never read as sooner than it says (on the
    // server's clock, its `Date` an hour behind, for the readings to be exact).
    let server = now.as_secs() - 3_600;
    let date = httpdate::fmt_http_date(std::time::UNIX_EPOCH + Duration::from_secs(server));
    let at = (server + 100) * 1000;
    let dated = |value: String| {
        server_wait(
            ok,
            &headers(&[
                ("date", &date),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", &value),
            ]),
        )
    };
    assert_eq!(dated(at.to_string()), Some(Duration::from_secs(100)));
    assert_eq!(
        dated(format!("{at}.5")),
        Some(Duration::from_millis(100_001))
    );
    assert!(
        millis > Duration::from_secs(95) && millis <= Duration::from_secs(101),
        "{millis:?}"
    );
    // Seconds from now, with a fraction: rounded up, however far past the ninth digit
    // it starts (it read as 2 s, one second early).
    assert_eq!(reset("2.5".to_owned()), Some(Duration::from_secs(3)));
    assert_eq!(
        reset("2.0000000001".to_owned()),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        reset("2.0000000000".to_owned()),
        Some(Duration::from_secs(2))
    );
}

/// A fake upstream: answers each request with the next of `script` (status, headers).
fn upstream(
    script: Vec<(u16, Vec<(&'static str, String)>)>,
    seen: Arc<AtomicU64>,
) -> impl Service<
    Request<Empty<Bytes>>,
    Response = Response<Empty<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    let script = Arc::new(script);
    service_fn(move |_request: Request<Empty<Bytes>>| {
        let (script, seen) = (Arc::clone(&script), Arc::clone(&seen));
        async move {
            let n = seen.fetch_add(1, Ordering::SeqCst) as usize;
            let (status, pairs) = &script[n.min(script.len() - 1)];
            let mut response = Response::new(Empty::new());
            *response.status_mut() = StatusCode::from_u16(*status).unwrap();
            for (name, value) in pairs {
                response
                    .headers_mut()
                    .insert(*name, HeaderValue::from_str(value).unwrap());
            }
            Ok::<_, Infallible>(response)
        }
    })
}

/// One request through `client`, which must answer.
async fn send<S, B>(client: &mut S, request: Request<B>) -> S::Response
where
    S: Service<Request<B>>,
    S::Error: std::fmt::Debug,
{
    client.ready().await.unwrap().call(request).await.unwrap()
}

fn get(uri: &str) -> Request<Empty<Bytes>> {
    Request::get(uri).body(Empty::new()).unwrap()
}

/// `send` on a clone of `client`, in a task of its own.
fn spawn_send<S>(client: &S, uri: &'static str) -> tokio::task::JoinHandle<S::Response>
where
    S: Service<Request<Empty<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: std::fmt::Debug,
{
    let mut client = client.clone();
    tokio::spawn(async move { send(&mut client, get(uri)).await })
}

/// [`spawn_send`], given up after `after` seconds: the task's result says whether the
/// request was answered before.
fn spawn_given_up<S>(
    client: &S,
    uri: &'static str,
    after: u64,
) -> tokio::task::JoinHandle<Result<S::Response, tokio::time::error::Elapsed>>
where
    S: Service<Request<Empty<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: std::fmt::Debug,
{
    let mut client = client.clone();
    tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(after), send(&mut client, get(uri))).await
    })
}

/// A shaping policy: one request every `period`, held back up to a minute.
fn one_every(period: Duration) -> Policy {
    Policy::leaky_bucket_shaping("upstream", Rate::new(1, period), Duration::from_secs(60)).unwrap()
}

/// Times from the start, in whole seconds.
fn at(seconds: &[u64]) -> Vec<Duration> {
    seconds.iter().copied().map(Duration::from_secs).collect()
}

#[tokio::test(start_paused = true)]
async fn a_refused_get_is_waited_out_and_retried_a_post_is_not() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(429, vec![("retry-after", "2".to_owned())]), (200, vec![])];
    let mut client = PacingLayer::new().layer(upstream(script.clone(), Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    let response = send(&mut client, get("http://api.test/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert_eq!(started.elapsed(), Duration::from_secs(2));

    let seen = Arc::new(AtomicU64::new(0));
    let mut client = PacingLayer::new().layer(upstream(script, Arc::clone(&seen)));
    let mut post = get("http://api.test/");
    *post.method_mut() = Method::POST;
    let response = send(&mut client, post).await;
    assert_eq!(
        response.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "never retried unless told"
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn absurd_values_are_capped_and_hosts_kept_apart() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(
        200,
        vec![("ratelimit", "\"api\";r=0;t=999999999".to_owned())],
    )];
    let layer = PacingLayer::new().max_wait(Duration::from_secs(5));
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    send(&mut client, get("http://a.test/")).await;
    assert_eq!(layer.wait_for("a.test", None), Duration::from_secs(5));
    assert_eq!(
        layer.wait_for("b.test", None),
        Duration::ZERO,
        "another host: no wait"
    );
    let started = tokio::time::Instant::now();
    send(&mut client, get("http://a.test/")).await;
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(5),
        "capped, not 31 years"
    );
}

/// One host, however the URL spells it: the port as a number (`0443` is 443), a name
/// with its trailing dot (`a.test.` is `a.test`), the scheme in any case. Each spelling
/// was a budget of its own, so what a 429 taught on one did not hold the others.
#[tokio::test(start_paused = true)]
async fn one_host_in_any_spelling_is_one_budget() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(200, vec![("ratelimit", "\"api\";r=0;t=5".to_owned())])];
    let layer = PacingLayer::new().max_wait(Duration::from_secs(60));
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    send(&mut client, get("https://a.test:0443/")).await;
    for spelling in [
        "a.test:443",
        "A.TEST:443",
        "a.test.:443",
        "a.test:00443",
        "a.test.",
    ] {
        assert_eq!(
            layer.wait_for(spelling, None),
            Duration::from_secs(5),
            "{spelling}"
        );
    }
    assert_eq!(layer.wait_for("a.test:80", None), Duration::ZERO);
    // A request to another spelling waits the same word out.
    let started = tokio::time::Instant::now();
    let uri = http::Uri::builder()
        .scheme("HTTPS")
        .authority("a.test.")
        .path_and_query("/")
        .build()
        .unwrap();
    send(&mut client, Request::get(uri).body(Empty::new()).unwrap()).await;
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

/// One IPv6 address, however the URL writes it (`[::1]` and `[0:0:0:0:0:0:0:1]`, an
/// IPv4-mapped address in either notation): each spelling was a budget of its own.
#[tokio::test(start_paused = true)]
async fn an_ipv6_host_in_any_spelling_is_one_budget() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(200, vec![("ratelimit", "\"api\";r=0;t=5".to_owned())])];
    let layer = PacingLayer::new();
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    send(&mut client, get("http://[::1]/")).await;
    for spelling in [
        "[::1]:80",
        "[0:0:0:0:0:0:0:1]:80",
        "[0000::0001]:080",
        "[::1]",
    ] {
        assert_eq!(
            layer.wait_for(spelling, None),
            Duration::from_secs(5),
            "{spelling}"
        );
    }
    assert_eq!(layer.wait_for("[::2]:80", None), Duration::ZERO);
    // A request to another spelling waits the same word out.
    let started = tokio::time::Instant::now();
    send(&mut client, get("http://[0:0:0:0:0:0:0:1]/")).await;
    assert_eq!(started.elapsed(), Duration::from_secs(5));

    let script = vec![(200, vec![("ratelimit", "\"api\";r=0;t=7".to_owned())])];
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    send(&mut client, get("http://[::ffff:127.0.0.1]/")).await;
    assert_eq!(
        layer.wait_for("[::FFFF:7F00:1]:80", None),
        Duration::from_secs(7)
    );
}

/// `pace` called twice paces by both policies (a burst limit and an hourly quota), as
/// `RateLimitLayer::policy` adds one. The second call replaced the first.
#[tokio::test(start_paused = true)]
async fn every_pacing_policy_paces() {
    let seen = Arc::new(AtomicU64::new(0));
    let layer = PacingLayer::new()
        .pace(Policy::token_bucket("burst", 1, Rate::per_second(1)).unwrap())
        .pace(Policy::token_bucket("hourly", 3, Rate::per_hour(3)).unwrap());
    let mut client = layer.layer(upstream(vec![(200, vec![])], Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    let mut sent = Vec::new();
    for _ in 0..4 {
        send(&mut client, get("http://a.test/")).await;
        sent.push(started.elapsed());
    }
    // One a second by the burst limit; then the hourly quota is spent, and the fourth
    // would wait past `max_wait` (20 minutes): it goes at once, and the server decides.
    assert_eq!(sent, at(&[0, 1, 2, 2]));
    assert_eq!(seen.load(Ordering::Relaxed), 4);
}

/// Called again with a policy's name, `pace` replaces that policy.
#[tokio::test(start_paused = true)]
async fn a_pacing_policy_of_the_same_name_is_replaced() {
    let seen = Arc::new(AtomicU64::new(0));
    let layer = PacingLayer::new()
        .pace(Policy::token_bucket("upstream", 1, Rate::per_second(1)).unwrap())
        .pace(Policy::token_bucket("upstream", 3, Rate::per_second(1)).unwrap());
    let mut client = layer.layer(upstream(vec![(200, vec![])], Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        send(&mut client, get("http://a.test/")).await;
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "a burst of 3");
}

#[tokio::test(start_paused = true)]
async fn a_policy_paces_before_any_answer() {
    let seen = Arc::new(AtomicU64::new(0));
    let layer =
        PacingLayer::new().pace(Policy::token_bucket("upstream", 2, Rate::per_second(1)).unwrap());
    let mut client = layer.layer(upstream(vec![(200, vec![])], Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    for _ in 0..4 {
        send(&mut client, get("http://a.test/")).await;
    }
    // Two at once, then one a second.
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_the_quickstart_policy_a_paced_client_is_never_refused() {
    // The quickstart's limiter on a loopback port: 10 tokens, 5 per second, per client IP.
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "hello" }))
        .layer(
            RateLimitLayer::new(MemoryStore::new())
                .policy(Policy::token_bucket("api", 10, Rate::per_second(5)).unwrap())
                .key(ClientIp::peer()),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    // No retries: a refusal the headers should have prevented would show.
    let mut paced = PacingLayer::new().retries(0).layer(client);
    let started = std::time::Instant::now();
    let mut refused = 0;
    for _ in 0..40 {
        let response = send(&mut paced, get(&format!("http://{addr}/"))).await;
        refused += u32::from(response.status() == StatusCode::TOO_MANY_REQUESTS);
        response.into_body().collect().await.unwrap();
    }
    server.abort();
    assert_eq!(refused, 0);
    // The server admits 10 at once and 5 a second: 40 cannot take less than 6 s.
    assert!(
        started.elapsed() >= Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

#[derive(Clone, Debug, PartialEq)]
struct Trace(&'static str);

#[tokio::test(start_paused = true)]
async fn retries_keep_extensions_and_stop_when_the_server_asks_for_too_long() {
    // The upstream checks that every attempt carries the caller's extension.
    let seen = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&seen);
    let checking = service_fn(move |request: Request<Empty<Bytes>>| {
        let counter = Arc::clone(&counter);
        async move {
            assert_eq!(request.extensions().get::<Trace>(), Some(&Trace("abc")));
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let mut response = Response::new(Empty::<Bytes>::new());
            if n == 0 {
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                response
                    .headers_mut()
                    .insert("retry-after", HeaderValue::from_static("0"));
            }
            Ok::<_, Infallible>(response)
        }
    });
    let mut client = PacingLayer::new().layer(checking);
    let mut request = get("http://A.test/");
    request.extensions_mut().insert(Trace("abc"));
    let started = tokio::time::Instant::now();
    let response = send(&mut client, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    // Retry-After: 0 on a 429 is still a second, never straight back.
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(seen.load(Ordering::SeqCst), 2);

    // A server asking for more than max_wait: the 429 is returned, not retried in vain.
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(429, vec![("retry-after", "3600".to_owned())])];
    let layer = PacingLayer::new().max_wait(Duration::from_secs(10));
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    let response = send(&mut client, get("http://a.test/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // One host, however it is spelt.
    assert_eq!(layer.wait_for("a.test:80", None), Duration::from_secs(10));
}

/// A layer keeps a word only up to its own `max_wait`: a later, shorter word is not
/// stretched by an earlier long one (a `Retry-After: 600` read as 60 s,
/// then "0 left, reset in 1 s", is a wait of 1 s, not another 60).
#[tokio::test(start_paused = true)]
async fn a_layer_alone_reads_a_later_shorter_word() {
    let layer = PacingLayer::new().max_wait(Duration::from_secs(60));
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![
        (429, vec![("retry-after", "600".to_owned())]),
        (
            200,
            vec![
                ("x-ratelimit-remaining", "0".to_owned()),
                ("x-ratelimit-reset", "1".to_owned()),
            ],
        ),
    ];
    let mut client = layer.clone().layer(upstream(script, Arc::clone(&seen)));
    let refused = send(&mut client, get("http://a.test/")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_secs(60)).await;
    let answered = send(&mut client, get("http://a.test/")).await;
    assert_eq!(answered.status(), StatusCode::OK);
    assert!(layer.wait_for("a.test", None) <= Duration::from_secs(1));
}

/// Policies that would switch pacing off: a shadow policy never refuses, and a penalty's
/// block (started by the pacer's own refusals under load) is longer than any wait, so
/// every request went at once, unpaced, for the whole block.
#[test]
fn a_policy_that_would_not_pace_is_refused() {
    let shadow = Policy::token_bucket("gh", 1, Rate::per_second(1))
        .unwrap()
        .shadow();
    let penalised = Policy::token_bucket("gh", 1, Rate::per_second(1))
        .unwrap()
        .with_penalty(tollgate::policy::Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(600),
        ))
        .unwrap();
    for policy in [shadow, penalised] {
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PacingLayer::new().pace(policy)
        }));
        assert!(refused.is_err());
    }
}

#[test]
#[should_panic(expected = "in-flight policy")]
fn an_in_flight_policy_cannot_pace() {
    let _ = PacingLayer::new().pace(Policy::concurrency("slots", 2).unwrap());
}

/// When each request reached an upstream, from when the log was made.
#[derive(Clone)]
struct Arrivals {
    started: tokio::time::Instant,
    times: Arc<std::sync::Mutex<Vec<Duration>>>,
}

impl Arrivals {
    fn new() -> Self {
        Self {
            started: tokio::time::Instant::now(),
            times: Arc::default(),
        }
    }

    /// Notes an arrival now; its number, from 1.
    fn note(&self) -> usize {
        let mut times = self.times.lock().unwrap();
        times.push(self.started.elapsed());
        times.len()
    }

    fn times(&self) -> Vec<Duration> {
        self.times.lock().unwrap().clone()
    }
}

/// An upstream that notes each request's arrival; its first answer takes `first_takes`
/// and carries the field `first_says`.
fn timed(
    arrivals: Arrivals,
    first_says: Option<(&'static str, &'static str)>,
    first_takes: Duration,
) -> impl Service<
    Request<Empty<Bytes>>,
    Response = Response<Empty<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    service_fn(move |_request: Request<Empty<Bytes>>| {
        let n = arrivals.note();
        async move {
            let mut response = Response::new(Empty::<Bytes>::new());
            if n == 1 {
                tokio::time::sleep(first_takes).await;
                if let Some((name, value)) = first_says {
                    // `Retry-After` holds the host on an outage (or a refusal, which a
                    // GET would retry): a 503.
                    if name == "retry-after" {
                        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    }
                    response
                        .headers_mut()
                        .insert(name, HeaderValue::from_static(value));
                }
            }
            Ok::<_, Infallible>(response)
        }
    })
}

/// [`timed`] behind a limit of one request at a time.
fn one_at_a_time(
    arrivals: Arrivals,
    first_takes: Duration,
) -> tower::limit::ConcurrencyLimit<
    impl Service<
        Request<Empty<Bytes>>,
        Response = Response<Empty<Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
> {
    tower::limit::ConcurrencyLimitLayer::new(1).layer(timed(arrivals, None, first_takes))
}

#[tokio::test(start_paused = true)]
async fn pacing_keeps_its_spacing_after_a_servers_wait() {
    // One request every 2 s. The first answer asks for 10 s, as long as `max_wait`:
    // three requests held back by it go at 10, 12 and 14 s, not all three at 10.
    let arrivals = Arrivals::new();
    let shaping = one_every(Duration::from_secs(2));
    let client = PacingLayer::new()
        .max_wait(Duration::from_secs(10))
        .pace(shaping)
        .layer(timed(
            arrivals.clone(),
            Some(("retry-after", "10")),
            Duration::ZERO,
        ));
    send(&mut client.clone(), get("http://a.test/")).await;
    let held: Vec<_> = (0..3)
        .map(|_| spawn_send(&client, "http://a.test/"))
        .collect();
    for request in held {
        request.await.unwrap();
    }
    assert_eq!(arrivals.times(), at(&[0, 10, 12, 14]));
}

#[tokio::test(start_paused = true)]
async fn pacing_turns_are_taken_when_the_request_can_go() {
    // One request at a time inside the pacer, and the first holds it for 20 s. Requests
    // started meanwhile are paced when they can go (one a second from 20 s), not given
    // their turns at once and then all sent together when the first is done.
    let arrivals = paced_behind_a_stall(PacingLayer::new()).await;
    assert_eq!(arrivals, at(&[0, 20, 21, 22, 23]));
}

/// One request at a time inside `layer`, which paces one request a second per host: a
/// request to b.test holds the inner service for 20 s while four to a.test wait for it.
/// When each request arrived.
async fn paced_behind_a_stall(layer: PacingLayer) -> Vec<Duration> {
    let arrivals = Arrivals::new();
    let inner = one_at_a_time(arrivals.clone(), Duration::from_secs(20));
    let client = layer
        .pace(Policy::token_bucket("upstream", 1, Rate::per_second(1)).unwrap())
        .layer(inner);
    let slow = spawn_send(&client, "http://b.test/");
    tokio::task::yield_now().await;
    let waiting: Vec<_> = (0..4)
        .map(|_| spawn_send(&client, "http://a.test/"))
        .collect();
    slow.await.unwrap();
    for request in waiting {
        request.await.unwrap();
    }
    arrivals.times()
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_paced_gives_its_turn_back() {
    // One request every 10 s per host: the second to a.test, given up on 1 s into its
    // 10 s wait, is never sent, so a third waits only for the first's 10 s (a turn given
    // to another host meanwhile changes nothing).
    let seen = Arc::new(AtomicU64::new(0));
    let shaping = one_every(Duration::from_secs(10));
    let mut client = PacingLayer::new()
        .pace(shaping)
        .layer(upstream(vec![(200, vec![])], Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    send(&mut client, get("http://a.test/")).await;
    let dropped = spawn_given_up(&client, "http://a.test/", 1);
    tokio::task::yield_now().await;
    send(&mut client, get("http://b.test/")).await;
    assert!(dropped.await.unwrap().is_err());
    send(&mut client, get("http://a.test/")).await;
    assert_eq!(seen.load(Ordering::SeqCst), 3);
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn layers_built_from_one_share_the_pacing_turns() {
    // Two layers from one (`.max_wait` on a clone makes a copy of the settings): they
    // share the pacing budget, and so its turns. A request of the first, dropped while a
    // request of the second holds a later turn, does not give its own back (the next
    // request would then be booked at the second's instant): the next request takes its
    // slot, at 10 s, and the second's stays at 20 s.
    let arrivals = Arrivals::new();
    let upstream = timed(arrivals.clone(), None, Duration::ZERO);
    let shaping = one_every(Duration::from_secs(10));
    let layer = PacingLayer::new().pace(shaping);
    let first = layer
        .clone()
        .max_wait(Duration::from_secs(50))
        .layer(upstream.clone());
    let second = layer.clone().retries(0).layer(upstream);
    send(&mut first.clone(), get("http://a.test/")).await;
    let dropped = spawn_given_up(&first, "http://a.test/", 1);
    tokio::task::yield_now().await;
    let later = spawn_send(&second, "http://a.test/");
    tokio::task::yield_now().await;
    assert!(dropped.await.unwrap().is_err());
    send(&mut first.clone(), get("http://a.test/")).await;
    later.await.unwrap();
    assert_eq!(arrivals.times(), at(&[0, 10, 20]));
}

#[tokio::test(start_paused = true)]
async fn requests_paced_when_the_server_says_wait_are_paced_again_after_it() {
    // One request every 5 s. The first's answer comes at 1 s and asks for 30 s; two
    // requests were already paced for 5 and 10 s. They wait the server out and are paced
    // afresh: sent at 31 and 36 s, not both at 31.
    let arrivals = Arrivals::new();
    let shaping = one_every(Duration::from_secs(5));
    let client = PacingLayer::new().pace(shaping).layer(timed(
        arrivals.clone(),
        Some(("retry-after", "30")),
        Duration::from_secs(1),
    ));
    let first = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    let paced: Vec<_> = (0..2)
        .map(|_| spawn_send(&client, "http://a.test/"))
        .collect();
    first.await.unwrap();
    for request in paced {
        request.await.unwrap();
    }
    assert_eq!(arrivals.times(), at(&[0, 31, 36]));
}

#[tokio::test(start_paused = true)]
async fn a_wait_the_server_asks_for_during_pacing_is_waited_too() {
    // The first request's answer comes after 1 s and asks for 30 s. The second was
    // already waiting its 5 s pacing delay: it is not sent at 5 s into a refusal, but
    // at 31 s, when the server said it may.
    let arrivals = Arrivals::new();
    let slow_to_say_wait = timed(
        arrivals.clone(),
        Some(("retry-after", "30")),
        Duration::from_secs(1),
    );
    let shaping = one_every(Duration::from_secs(5));
    let client = PacingLayer::new().pace(shaping).layer(slow_to_say_wait);
    let started = tokio::time::Instant::now();
    let first = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    let mut second = client.clone();
    send(&mut second, get("http://a.test/")).await;
    first.await.unwrap();
    assert_eq!(arrivals.times().len(), 2);
    assert_eq!(started.elapsed(), Duration::from_secs(31));
}

#[tokio::test(start_paused = true)]
async fn a_waiting_request_does_not_hold_the_inner_services_capacity() {
    // One request at a time inside the pacer. A request to a host that asked for 10 s
    // waits without holding that one place: a request to another host goes at once.
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(503, vec![("retry-after", "10".to_owned())]), (200, vec![])];
    let inner =
        tower::limit::ConcurrencyLimitLayer::new(1).layer(upstream(script, Arc::clone(&seen)));
    let client = PacingLayer::new().layer(inner);
    send(&mut client.clone(), get("http://a.test/")).await;
    let waiting = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    send(&mut client.clone(), get("http://b.test/")).await;
    assert_eq!(started.elapsed(), Duration::ZERO);
    waiting.await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn a_request_the_pacer_holds_back_does_not_hold_the_inner_services_capacity() {
    // One request at a time inside the pacer, one per 10 s per host. The second request
    // to a.test waits 10 s for its turn without holding that one place: a request to
    // b.test goes at once.
    let arrivals = Arrivals::new();
    let inner = one_at_a_time(arrivals.clone(), Duration::ZERO);
    let client = PacingLayer::new()
        .pace(Policy::token_bucket("upstream", 1, Rate::new(1, Duration::from_secs(10))).unwrap())
        .layer(inner);
    send(&mut client.clone(), get("http://a.test/")).await;
    let held = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    send(&mut client.clone(), get("http://b.test/")).await;
    held.await.unwrap();
    assert_eq!(arrivals.times(), at(&[0, 0, 10]));
}

#[tokio::test(start_paused = true)]
async fn pacing_starts_when_the_inner_service_is_ready_however_long_that_took() {
    // As `pacing_turns_are_taken_when_the_request_can_go`, with the stall (20 s) longer
    // than `max_wait` (10 s): the pacing wait starts at readiness, so the requests are
    // still one a second when it frees.
    let layer = PacingLayer::new().max_wait(Duration::from_secs(10));
    let arrivals = paced_behind_a_stall(layer).await;
    assert_eq!(arrivals, at(&[0, 20, 21, 22, 23]));
}

#[tokio::test(start_paused = true)]
async fn the_servers_word_is_waited_at_most_max_wait_though_it_grows_meanwhile() {
    // `max_wait` 10 s, no pacing. The first answer asks for 10 s; another, arriving at
    // 5 s, for 10 s more. A request held back from the start goes at 10 s.
    let arrivals = Arrivals::new();
    let log = arrivals.clone();
    let upstream = service_fn(move |_request: Request<Empty<Bytes>>| {
        let n = log.note();
        async move {
            let mut response = Response::new(Empty::<Bytes>::new());
            if n <= 2 {
                if n == 1 {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                response
                    .headers_mut()
                    .insert("retry-after", HeaderValue::from_static("10"));
            }
            Ok::<_, Infallible>(response)
        }
    });
    let client = PacingLayer::new()
        .max_wait(Duration::from_secs(10))
        .layer(upstream);
    let late_word = spawn_send(&client, "http://a.test/");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    send(&mut client.clone(), get("http://a.test/")).await;
    let held = spawn_send(&client, "http://a.test/");
    late_word.await.unwrap();
    held.await.unwrap();
    assert_eq!(arrivals.times(), at(&[0, 0, 10]));
}

#[tokio::test(start_paused = true)]
async fn a_pacing_delay_past_max_wait_gives_its_turn_back_at_once() {
    // One every 10 s, `max_wait` 15 s. The third request would wait 20 s: it goes at once
    // without a turn (the server decides), and the 20 s slot stays free for a request
    // that comes at 11 s.
    let arrivals = Arrivals::new();
    let client = PacingLayer::new()
        .max_wait(Duration::from_secs(15))
        .pace(one_every(Duration::from_secs(10)))
        .layer(timed(arrivals.clone(), None, Duration::ZERO));
    send(&mut client.clone(), get("http://a.test/")).await;
    let second = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    send(&mut client.clone(), get("http://a.test/")).await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    send(&mut client.clone(), get("http://a.test/")).await;
    second.await.unwrap();
    assert_eq!(arrivals.times(), at(&[0, 0, 10, 20]));
}

/// One request every 10 s to one host: a first request, then a second and a third
/// (waiting for 10 and 20 s) given up after `second` and `third` seconds, then a fourth:
/// when the requests arrived.
async fn two_turns_given_up(second: u64, third: u64) -> Vec<Duration> {
    let arrivals = Arrivals::new();
    let client = PacingLayer::new()
        .pace(one_every(Duration::from_secs(10)))
        .layer(timed(arrivals.clone(), None, Duration::ZERO));
    send(&mut client.clone(), get("http://a.test/")).await;
    let second = spawn_given_up(&client, "http://a.test/", second);
    tokio::task::yield_now().await;
    let third = spawn_given_up(&client, "http://a.test/", third);
    tokio::task::yield_now().await;
    assert!(second.await.unwrap().is_err());
    assert!(third.await.unwrap().is_err());
    send(&mut client.clone(), get("http://a.test/")).await;
    arrivals.times()
}

#[tokio::test(start_paused = true)]
async fn turns_dropped_newest_first_are_all_given_back() {
    // Given up at 2 and 1 s, newest first: both turns come back, so the fourth request,
    // at 2 s, goes at 10 s.
    assert_eq!(two_turns_given_up(2, 1).await, at(&[0, 10]));
}

#[tokio::test(start_paused = true)]
async fn turns_dropped_oldest_first_are_all_given_back() {
    // Given up at 1 and 2 s, oldest first (callers' timeouts end in the order they
    // began). The second's turn cannot come back at 1 s (the third's is after it), but
    // once the third's comes back at 2 s, the second's is the newest and unused: it
    // comes back too, so the fourth request goes at 10 s, not 20 s.
    assert_eq!(two_turns_given_up(1, 2).await, at(&[0, 10]));
}

/// Overload with callers that give up (README: bound calls with a timeout): ten a second
/// allowed, queued up to 30 s, twenty a second offered, each caller giving up after 5 s.
/// Callers gave up oldest first, each turn dropped while a later one stood stayed booked
/// for nobody, so the queue stayed full: every new request was given a slot 30 s out,
/// gave up before it, and nothing reached the upstream after the first seconds, while
/// the dropped turns piled up in memory. A slot a caller gave up, still ahead, is the
/// next request's (one request a slot still).
#[tokio::test(start_paused = true)]
async fn callers_giving_up_under_overload_leave_their_slots_to_the_next() {
    let arrivals = Arrivals::new();
    let client = PacingLayer::new()
        .pace(
            Policy::leaky_bucket_shaping("upstream", Rate::per_second(10), Duration::from_secs(30))
                .unwrap(),
        )
        .layer(timed(arrivals.clone(), None, Duration::ZERO));
    let mut callers = Vec::new();
    // 40 s at 20 a second.
    for _ in 0..800 {
        callers.push(spawn_given_up(&client, "http://a.test/", 5));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for caller in callers {
        let _ = caller.await.unwrap();
    }
    let times = arrivals.times();
    let sent_between = |from: u64, to: u64| {
        times
            .iter()
            .filter(|time| (Duration::from_secs(from)..Duration::from_secs(to)).contains(time))
            .count()
    };
    // Ten a second could go: most of them do, and never more.
    let late = sent_between(20, 40);
    assert!(
        (150..=201).contains(&late),
        "{late} requests reached the upstream from 20 s to 40 s of overload"
    );
    // Still one a tenth of a second at most: no two requests on one slot.
    for pair in times.windows(2) {
        assert!(pair[1] - pair[0] >= Duration::from_millis(100), "{times:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_unused_turn_behind_a_used_one_stays_spent() {
    // One every 10 s: the second request waits 10 s and is given up at 1 s; the third
    // waits 20 s and is sent. The second's turn stays spent (the third's slot was
    // booked after it), and a fourth request goes at 30 s.
    let arrivals = Arrivals::new();
    let client = PacingLayer::new()
        .pace(one_every(Duration::from_secs(10)))
        .layer(timed(arrivals.clone(), None, Duration::ZERO));
    send(&mut client.clone(), get("http://a.test/")).await;
    let second = spawn_given_up(&client, "http://a.test/", 1);
    tokio::task::yield_now().await;
    let third = spawn_send(&client, "http://a.test/");
    tokio::task::yield_now().await;
    assert!(second.await.unwrap().is_err());
    third.await.unwrap();
    send(&mut client.clone(), get("http://a.test/")).await;
    assert_eq!(arrivals.times(), at(&[0, 20, 30]));
}

/// `max_wait` bounds the wait on the server's word, not the wait for the inner service:
/// a request that waited 70 s for a connection held by a slow one (not on any word), and
/// meanwhile heard a.test say "none left for 60 s" (at 30 s, through a clone), went out at
/// once when the connection freed, into the minute the server said was empty. It waits
/// the word out: sent at 90 s.
#[tokio::test(start_paused = true)]
async fn a_word_heard_while_the_inner_service_is_busy_is_waited_out() {
    let arrivals = Arrivals::new();
    let layer = PacingLayer::new();
    // One at a time; the first request (to b.test) takes 70 s.
    let client = layer
        .clone()
        .layer(one_at_a_time(arrivals.clone(), Duration::from_secs(70)));
    // Another client of the same layer, to whom a.test says it has none left for 60 s.
    let other = layer.layer(timed(
        Arrivals::new(),
        Some(("ratelimit", "\"api\";r=0;t=60")),
        Duration::ZERO,
    ));
    let slow = spawn_send(&client, "http://b.test/");
    tokio::task::yield_now().await;
    let waiting = spawn_send(&client, "http://a.test/");
    tokio::time::sleep(Duration::from_secs(30)).await;
    send(&mut other.clone(), get("http://a.test/")).await;
    slow.await.unwrap();
    waiting.await.unwrap();
    assert_eq!(arrivals.times(), at(&[0, 90]));
}

#[tokio::test(start_paused = true)]
async fn a_stall_after_a_denial_does_not_use_up_the_pacing_wait() {
    // One at a time inside the pacer; one request a second per host; `max_wait` 10 s.
    // Two requests to a.test are denied for 1 s; meanwhile one to b.test holds the inner
    // service for 20 s. When it frees, the two still go a second apart.
    let arrivals = Arrivals::new();
    let log = arrivals.clone();
    let upstream = service_fn(move |request: Request<Empty<Bytes>>| {
        log.note();
        let slow = request.uri().host() == Some("b.test");
        async move {
            if slow {
                tokio::time::sleep(Duration::from_secs(20)).await;
            }
            Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
        }
    });
    let client = PacingLayer::new()
        .max_wait(Duration::from_secs(10))
        .pace(Policy::token_bucket("upstream", 1, Rate::per_second(1)).unwrap())
        .layer(tower::limit::ConcurrencyLimitLayer::new(1).layer(upstream));
    send(&mut client.clone(), get("http://a.test/")).await;
    let denied: Vec<_> = (0..2)
        .map(|_| spawn_send(&client, "http://a.test/"))
        .collect();
    tokio::task::yield_now().await;
    let slow = spawn_send(&client, "http://b.test/");
    slow.await.unwrap();
    for request in denied {
        request.await.unwrap();
    }
    assert_eq!(arrivals.times(), at(&[0, 0, 20, 21]));
}

/// `Retry-After` asks for a wait on a refusal (429, draft-11 and RFC 6585), an outage
/// (503, RFC 9110 section 10.2.3) or another error (GitHub's 403). On a success or a
/// redirect it means something else (a 202's "poll again in 30 s", a 3xx's wait before
/// the redirected request): not a reason to hold every request to the host.
#[test]
fn retry_after_holds_the_host_on_an_error_not_on_a_success_or_a_redirect() {
    let secs = Duration::from_secs;
    let after = headers(&[("retry-after", "30")]);
    assert_eq!(
        server_wait(StatusCode::TOO_MANY_REQUESTS, &after),
        Some(secs(30))
    );
    assert_eq!(
        server_wait(StatusCode::SERVICE_UNAVAILABLE, &after),
        Some(secs(30))
    );
    for status in [
        StatusCode::OK,
        StatusCode::ACCEPTED,
        StatusCode::MOVED_PERMANENTLY,
        StatusCode::SEE_OTHER,
    ] {
        assert_eq!(server_wait(status, &after), None, "{status}");
    }
    // Any error's: GitHub answers its secondary limits with a 403 and Retry-After.
    assert_eq!(server_wait(StatusCode::FORBIDDEN, &after), Some(secs(30)));
    // A gRPC answer is an HTTP 200 whatever its status: its Retry-After counts.
    let grpc = headers(&[("content-type", "application/grpc"), ("retry-after", "30")]);
    assert_eq!(server_wait(StatusCode::OK, &grpc), Some(secs(30)));
    // The rate-limit fields still speak on any status; when they ask for a wait, a
    // Retry-After beside them says how long (draft-11, section 7: "the Retry-After
    // field MUST take precedence and the reset keyword MAY be ignored").
    let exhausted = headers(&[("ratelimit", "\"api\";r=0;t=4")]);
    assert_eq!(server_wait(StatusCode::ACCEPTED, &exhausted), Some(secs(4)));
    for status in [
        StatusCode::OK,
        StatusCode::ACCEPTED,
        StatusCode::MOVED_PERMANENTLY,
    ] {
        for (name, value) in [
            ("ratelimit", "\"api\";r=0;t=4"),
            ("ratelimit-remaining", "0"),
            ("x-ratelimit-remaining", "0"),
        ] {
            // Longer than the fields' 4 s, and shorter.
            for (after, wait) in [("30", 30), ("2", 2)] {
                let both = headers(&[
                    ("retry-after", after),
                    (name, value),
                    ("ratelimit-reset", "4"),
                    ("x-ratelimit-reset", "4"),
                ]);
                assert_eq!(
                    server_wait(status, &both),
                    Some(secs(wait)),
                    "{status} {name}"
                );
            }
        }
        // Fields that say none is left but not for how long: the Retry-After says it.
        for (name, value) in [
            ("ratelimit", "\"api\";r=0"),
            ("ratelimit-remaining", "0"),
            ("x-ratelimit-remaining", "0"),
        ] {
            let untimed = headers(&[("retry-after", "30"), (name, value)]);
            assert_eq!(
                server_wait(status, &untimed),
                Some(secs(30)),
                "{status} {name}"
            );
            // Without it, nothing to wait for (a count of requests in progress).
            assert_eq!(
                server_wait(status, &headers(&[(name, value)])),
                None,
                "{status} {name}"
            );
        }
        // Fields that ask for no wait leave a success's or redirect's Retry-After alone.
        let roomy = headers(&[("retry-after", "30"), ("ratelimit", "\"api\";r=5;t=4")]);
        assert_eq!(server_wait(status, &roomy), None, "{status}");
    }
}

/// draft-11, sections 4.1 and 4.2: `r` and `t` are non-negative Integers. A member whose
/// `r` or `t` is anything else is malformed and says nothing (it is not read as "none
/// left", nor as a guessed wait).
#[test]
fn a_member_with_a_malformed_remaining_or_window_says_nothing() {
    let ok = StatusCode::OK;
    for member in [
        "\"api\";r=-1;t=5",
        "\"api\";r=0;t=5.0",
        "\"api\";r=0;t=\"5\"",
        "\"api\";r=0;t=?1",
        "\"api\";r=0.0;t=5",
    ] {
        assert_eq!(
            server_wait(ok, &headers(&[("ratelimit", member)])),
            None,
            "{member}"
        );
    }
    // No `t` at all (OPTIONAL, section 4.1): no window, no wait (it was a guessed
    // second, which held a client to one request a second against an in-flight limit).
    assert_eq!(
        server_wait(ok, &headers(&[("ratelimit", "\"api\";r=0")])),
        None
    );
}

/// A `max_wait` under a second: a 429's floor of a second is `max_wait` then, and the
/// refused request is still retried (it once counted as asking for more than `max_wait`,
/// and no 429 was ever retried).
#[tokio::test(start_paused = true)]
async fn a_max_wait_under_a_second_still_retries_a_429() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(429, vec![("retry-after", "0".to_owned())]), (200, vec![])];
    let layer = PacingLayer::new().max_wait(Duration::from_millis(500));
    let mut client = layer.layer(upstream(script, Arc::clone(&seen)));
    let started = tokio::time::Instant::now();
    let response = send(&mut client, get("http://a.test/")).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    // No wait allowed at all: the 429 is returned, never sent straight back.
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(429, vec![("retry-after", "0".to_owned())]), (200, vec![])];
    let layer = PacingLayer::new().max_wait(Duration::ZERO);
    let mut client = layer.layer(upstream(script, Arc::clone(&seen)));
    let response = send(&mut client, get("http://a.test/")).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

/// Layers built from one share what servers said, as they share the pacing turns: a
/// layer made with `.retries(0)` on a clone learns that a host is out, and the others
/// (and the original's `wait_for`) know it.
#[tokio::test(start_paused = true)]
async fn layers_built_from_one_share_what_the_servers_said() {
    let seen = Arc::new(AtomicU64::new(0));
    let script = vec![(200, vec![("ratelimit", "\"api\";r=0;t=30".to_owned())])];
    let layer = PacingLayer::new();
    let first = layer
        .clone()
        .max_wait(Duration::from_secs(50))
        .layer(upstream(script.clone(), Arc::clone(&seen)));
    let mut second = layer
        .clone()
        .retries(0)
        .layer(upstream(script, Arc::clone(&seen)));
    send(&mut second, get("http://a.test/")).await;
    assert_eq!(layer.wait_for("a.test", None), Duration::from_secs(30));
    let started = tokio::time::Instant::now();
    send(&mut first.clone(), get("http://a.test/")).await;
    assert_eq!(started.elapsed(), Duration::from_secs(30));
}
