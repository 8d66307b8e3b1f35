//! The rate-limit header fields: IETF draft-11 by default, draft-6 and `X-RateLimit-*`
//! on request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::cell::RefCell;

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::decision::{Decision, Outcome};
use crate::policy::{Policy, PolicySet};

/// Which rate-limit header fields responses carry. Every response gets them, admitted or
/// denied; denied ones also get `Retry-After`.
///
/// | style | fields |
/// |---|---|
/// | `Draft11` (default) | `RateLimit-Policy: "api";q=10;w=2` and `RateLimit: "api";r=7;t=1`, one list member per policy |
/// | `Draft6` | `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds) for the most restrictive policy |
/// | `Legacy` | `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (Unix time in seconds, as GitHub) |
/// | `None` | no rate-limit fields (`Retry-After` is still sent on 429) |
///
/// `q` and `Limit` are the quota (the most units admitted at once); `w` is the window in
/// seconds (for buckets: the time to refill from empty); `r` and `Remaining` are the units
/// left; `t` and `Reset` are the seconds until the quota is whole again, rounded up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderStyle {
    /// `draft-ietf-httpapi-ratelimit-headers-11`: `RateLimit-Policy` and `RateLimit`.
    #[default]
    Draft11,
    /// `draft-ietf-httpapi-ratelimit-headers-06`: `RateLimit-Limit/-Remaining/-Reset`.
    Draft6,
    /// `X-RateLimit-Limit/-Remaining/-Reset`, the reset as a Unix timestamp.
    Legacy,
    /// No rate-limit header fields.
    None,
}

/// Whole seconds, rounded up: a client told `t=0` would come back too early.
pub(crate) fn seconds_ceil(duration: Duration) -> u64 {
    duration
        .as_nanos()
        .div_ceil(1_000_000_000)
        .min(u128::from(u64::MAX)) as u64
}

fn push_number(out: &mut BytesMut, value: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
}

thread_local! {
    /// Header values are cut from a per-thread buffer instead of one allocation each:
    /// every response carries one or three of them. A chunk is freed when the last value
    /// cut from it is dropped.
    static ARENA: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

const ARENA_CHUNK: usize = 8 * 1024;

/// A header value written by `write` into the thread's buffer.
fn value(write: impl FnOnce(&mut BytesMut)) -> Option<HeaderValue> {
    ARENA.with(|arena| {
        let mut arena = arena.borrow_mut();
        if arena.capacity() < 512 {
            arena.reserve(ARENA_CHUNK);
        }
        write(&mut arena);
        HeaderValue::from_maybe_shared(arena.split().freeze()).ok()
    })
}

fn number_value(number: u64) -> HeaderValue {
    value(|out| push_number(out, number)).unwrap_or_else(|| HeaderValue::from(number))
}

/// `"api";q=10;w=2, "daily";q=10000;w=86400`. Names are validated to be plain tokens, so
/// they need no escaping inside the quoted strings.
pub(crate) fn policy_header(policies: &[Policy]) -> Option<HeaderValue> {
    if policies.is_empty() {
        return None;
    }
    let mut out = BytesMut::with_capacity(32 * policies.len());
    for (index, policy) in policies.iter().enumerate() {
        if index > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(b"\"");
        out.extend_from_slice(policy.name().as_bytes());
        out.extend_from_slice(b"\";q=");
        push_number(&mut out, policy.limit());
        out.extend_from_slice(b";w=");
        push_number(&mut out, seconds_ceil(policy.window()).max(1));
    }
    HeaderValue::from_maybe_shared(out.freeze()).ok()
}

/// Header fields computed for one response, applied when the response exists. Kept
/// small (it lives in every response future): numbers are turned into header values only
/// when applied.
#[derive(Debug, Default)]
pub(crate) enum HeaderBlock {
    /// No rate-limit fields.
    #[default]
    Empty,
    /// `RateLimit-Policy` and `RateLimit`: list-valued, appended so that a limiter further
    /// in keeps its members.
    Draft11 {
        policy: Option<HeaderValue>,
        rate: HeaderValue,
    },
    /// `RateLimit-Limit/-Remaining/-Reset` or `X-RateLimit-*`.
    Single {
        legacy: bool,
        limit: u64,
        remaining: u64,
        reset: u64,
    },
}

impl HeaderBlock {
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        match self {
            HeaderBlock::Empty => {}
            HeaderBlock::Draft11 { policy, rate } => {
                if let Some(policy) = policy {
                    headers.append(RATELIMIT_POLICY.clone(), policy);
                }
                headers.append(RATELIMIT.clone(), rate);
            }
            HeaderBlock::Single {
                legacy,
                limit,
                remaining,
                reset,
            } => {
                let (limit_name, remaining_name, reset_name) = if legacy {
                    (
                        &X_RATELIMIT_LIMIT,
                        &X_RATELIMIT_REMAINING,
                        &X_RATELIMIT_RESET,
                    )
                } else {
                    (&RATELIMIT_LIMIT, &RATELIMIT_REMAINING, &RATELIMIT_RESET)
                };
                headers.insert(limit_name.clone(), number_value(limit));
                headers.insert(remaining_name.clone(), number_value(remaining));
                headers.insert(reset_name.clone(), number_value(reset));
            }
        }
    }
}

static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The policy a single-valued style reports: the one that denied, else the one with the
/// fewest units left (the longest reset on a tie).
fn most_restrictive(decision: &Decision) -> usize {
    match decision.outcome() {
        Outcome::Denied { policy, .. } | Outcome::CostExceedsLimit { policy, .. } => policy,
        Outcome::Allowed { .. } => decision
            .statuses()
            .iter()
            .enumerate()
            .min_by(|(_, a), (_, b)| a.remaining.cmp(&b.remaining).then(b.reset.cmp(&a.reset)))
            .map_or(0, |(index, _)| index),
    }
}

/// The header fields for `decision` under `policies` in `style`.
pub(crate) fn rate_limit_headers(
    style: HeaderStyle,
    policies: &PolicySet,
    decision: &Decision,
) -> HeaderBlock {
    let statuses = decision.statuses();
    match style {
        HeaderStyle::None => HeaderBlock::Empty,
        HeaderStyle::Draft11 => {
            let rate = value(|out| {
                for (index, (policy, status)) in policies.iter().zip(statuses).enumerate() {
                    if index > 0 {
                        out.extend_from_slice(b", ");
                    }
                    out.extend_from_slice(b"\"");
                    out.extend_from_slice(policy.name().as_bytes());
                    out.extend_from_slice(b"\";r=");
                    push_number(out, status.remaining);
                    out.extend_from_slice(b";t=");
                    push_number(out, seconds_ceil(status.reset));
                }
            });
            match rate {
                Some(rate) => HeaderBlock::Draft11 {
                    policy: policies.policy_header().cloned(),
                    rate,
                },
                None => HeaderBlock::Empty,
            }
        }
        HeaderStyle::Draft6 | HeaderStyle::Legacy => {
            let Some(status) = statuses.get(most_restrictive(decision)) else {
                return HeaderBlock::Empty;
            };
            let legacy = style == HeaderStyle::Legacy;
            let reset = if legacy {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                seconds_ceil(now + status.reset)
            } else {
                seconds_ceil(status.reset)
            };
            HeaderBlock::Single {
                legacy,
                limit: status.limit,
                remaining: status.remaining,
                reset,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use smallvec::smallvec;

    use super::*;
    use crate::decision::PolicyStatus;
    use crate::{Policy, Rate};

    fn set() -> PolicySet {
        PolicySet::new([
            Policy::token_bucket("api", 20, Rate::per_second(10)).unwrap(),
            Policy::fixed_window("daily", 1000, Duration::from_secs(86_400)).unwrap(),
        ])
        .unwrap()
    }

    fn decision(outcome: Outcome) -> Decision {
        Decision::new(
            outcome,
            smallvec![
                PolicyStatus {
                    limit: 20,
                    remaining: 17,
                    reset: Duration::from_millis(300)
                },
                PolicyStatus {
                    limit: 1000,
                    remaining: 990,
                    reset: Duration::from_secs(3600)
                },
            ],
        )
    }

    fn render(style: HeaderStyle, outcome: Outcome) -> HeaderMap {
        let mut headers = HeaderMap::new();
        rate_limit_headers(style, &set(), &decision(outcome)).apply(&mut headers);
        headers
    }

    #[test]
    fn draft_11_lists_every_policy() {
        let headers = render(
            HeaderStyle::Draft11,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        assert_eq!(
            headers["ratelimit-policy"],
            "\"api\";q=20;w=2, \"daily\";q=1000;w=86400"
        );
        assert_eq!(
            headers["ratelimit"],
            "\"api\";r=17;t=1, \"daily\";r=990;t=3600"
        );
    }

    #[test]
    fn draft_6_reports_the_most_restrictive_policy() {
        let headers = render(
            HeaderStyle::Draft6,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        assert_eq!(headers["ratelimit-limit"], "20");
        assert_eq!(headers["ratelimit-remaining"], "17");
        assert_eq!(headers["ratelimit-reset"], "1");
        let denied = render(
            HeaderStyle::Draft6,
            Outcome::Denied {
                policy: 1,
                retry_after: Duration::from_secs(3600),
            },
        );
        assert_eq!(denied["ratelimit-limit"], "1000");
    }

    #[test]
    fn legacy_reset_is_a_unix_time() {
        let headers = render(
            HeaderStyle::Legacy,
            Outcome::Allowed {
                delay: Duration::ZERO,
            },
        );
        let reset: u64 = headers["x-ratelimit-reset"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(reset >= now && reset <= now + 2, "{reset} vs {now}");
        assert!(
            render(
                HeaderStyle::None,
                Outcome::Allowed {
                    delay: Duration::ZERO
                }
            )
            .is_empty()
        );
    }

    #[test]
    fn rounding_is_up() {
        assert_eq!(seconds_ceil(Duration::from_nanos(1)), 1);
        assert_eq!(seconds_ceil(Duration::from_secs(2)), 2);
        assert_eq!(seconds_ceil(Duration::from_millis(2001)), 3);
        assert_eq!(seconds_ceil(Duration::ZERO), 0);
    }
}
