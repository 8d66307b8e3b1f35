//! The limiter's own answers to gRPC calls: a gRPC status, not an HTTP error page.
//!
//! A call is gRPC when its `content-type` is `application/grpc`, `application/grpc-web`
//! or `application/grpc-web-text` (each alone or with `+` a message format, in any case,
//! parameters allowed); its answer carries the same content type, without the
//! parameters (the type in lowercase unless sent so; a plain `+` format as sent).
//! Its refusal is a trailers-only response (HTTP 200, the status in the headers, no
//! body): `grpc-status` 8 (RESOURCE_EXHAUSTED) for a denial, with `retry-after`, the
//! `ratelimit` and `ratelimit-policy` entries as metadata, and a `google.rpc.Status` in
//! `grpc-status-details-bin` whose detail is a `google.rpc.RetryInfo` (the richer error
//! model gRPC clients read); 3 (INVALID_ARGUMENT) for a request the limiter cannot take
//! (a missing key, a cost above any limit); 14 (UNAVAILABLE) when the store failed under
//! fail-closed; 13 (INTERNAL) for a server misconfiguration. A refusal with a
//! `retry-after` also says it in `grpc-retry-pushback-ms` (milliseconds), which gRPC's
//! own retries read (gRFC A6); other refusals send no pushback (one saying "do not
//! retry" would count against the client's retry throttling).

use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};

/// The content type of a gRPC call, for its answer: the call's own when it is a
/// lowercase type with a plain `+` format or none, else the bare type in lowercase (with
/// the format when plain). A media type's type and subtype are case-insensitive, and
/// parameters may follow (RFC 9110, section 8.3.1).
fn grpc_content_type(headers: &HeaderMap) -> Option<HeaderValue> {
    let value = headers.get(header::CONTENT_TYPE)?;
    let text = value.to_str().ok()?;
    let (media, parameters) = match text.split_once(';') {
        Some((media, _)) => (media.trim_end(), true),
        None => (text, false),
    };
    [
        "application/grpc-web-text",
        "application/grpc-web",
        "application/grpc",
    ]
    .into_iter()
    .find_map(|base| {
        let rest = media
            .get(..base.len())
            .filter(|start| start.eq_ignore_ascii_case(base))
            .and_then(|_| media.get(base.len()..))?;
        let as_sent = !parameters && media.starts_with(base);
        if rest.is_empty() {
            return Some(if as_sent {
                value.clone()
            } else {
                HeaderValue::from_static(base)
            });
        }
        let format = rest.strip_prefix('+')?;
        let plain = !format.is_empty()
            && format
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        Some(match (plain, as_sent) {
            (true, true) => value.clone(),
            (true, false) => HeaderValue::from_str(&format!("{base}+{format}"))
                .unwrap_or_else(|_| HeaderValue::from_static(base)),
            (false, _) => HeaderValue::from_static(base),
        })
    })
}

/// The limiter's own answer to a request of `method` with `headers`: as it is, without
/// its content for a `HEAD` (RFC 9110, section 9.3.2: hyper leaves it out over HTTP/1
/// only, axum in a top-level route only), or as a gRPC status for a gRPC call (always a
/// `POST`: a `GET` claiming the type gets the HTTP answer, which no cache keeps as a
/// success).
pub(crate) fn fit(
    method: &Method,
    headers: &HeaderMap,
    mut response: Box<Response<Bytes>>,
) -> Box<Response<Bytes>> {
    let notice = response.extensions_mut().remove::<NoticeWait>();
    match grpc_content_type(headers) {
        Some(content_type) if method == Method::POST => {
            if let Some(NoticeWait(seconds)) = notice
                && response.status().is_success()
                && !response.headers().contains_key(header::RETRY_AFTER)
            {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            Box::new(answer_as(*response, content_type))
        }
        // A hook's `1xx`, `204` or `304` has no content, whatever it was given (RFC
        // 9110, sections 15.3.5 and 15.4.5), and no `Content-Length` (section 8.6: never
        // in a `1xx` or `204`; in a `304` only a `200`'s, which the hook's is not).
        _ if has_no_content(response.status()) => {
            response.headers_mut().remove(header::CONTENT_LENGTH);
            *response.body_mut() = Bytes::new();
            response
        }
        _ if method == Method::HEAD => {
            // Its fields stay, and `Content-Length` says what a `GET` would be sent
            // (RFC 9110, sections 8.6 and 9.3.2): axum, which fills it in from the body
            // left, would say 0.
            let length = HeaderValue::from(response.body().len());
            response
                .headers_mut()
                .insert(header::CONTENT_LENGTH, length);
            *response.body_mut() = Bytes::new();
            response
        }
        _ => response,
    }
}

/// A status whose response has no content: `1xx`, `204` and `304`.
fn has_no_content(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
}

/// The limiter's HTTP answer `response` as a trailers-only response of a call of
/// `content_type` (gRPC, or gRPC-Web: its trailers-only responses are gRPC's, in the
/// headers).
fn answer_as(response: Response<Bytes>, content_type: HeaderValue) -> Response<Bytes> {
    let (mut parts, body) = response.into_parts();
    // A second at least, as the layer's own `Retry-After` (a hook's date in the current
    // second reads as 0: a retry at once into a spent quota).
    let retry_after = parts
        .headers
        .get(header::RETRY_AFTER)
        .and_then(super::headers::retry_after_secs)
        .map(|seconds| seconds.max(1));
    if let Some(code) = parts.headers.get(GRPC_STATUS) {
        // An `on_deny` hook that answered as gRPC (tonic's `Status` into HTTP): its
        // status, message and details stand; the wait is pushed back as ours is. Sent
        // trailers-only, as ours: HTTP 200 and no content (a gRPC client reads another
        // HTTP status by its number: a 429 would be UNAVAILABLE, which clients retry).
        let code = code.to_str().ok().and_then(|code| code.trim().parse().ok());
        parts.status = StatusCode::OK;
        parts.headers.remove(header::CONTENT_LENGTH);
        // The call's own type: a reply of another (a hook's JSON, tonic's
        // `application/grpc` on a gRPC-Web call) is no gRPC answer to its client.
        parts.headers.insert(header::CONTENT_TYPE, content_type);
        if let (Some(pushback), false) = (
            code.and_then(|code| pushback(code, retry_after)),
            parts.headers.contains_key(PUSHBACK),
        ) {
            parts.headers.insert(PUSHBACK, pushback);
        }
        return Response::from_parts(parts, Bytes::new());
    }
    // The limiter's own answers, and an `on_deny` hook's statuses, as the codes a client
    // acts on: a quota is RESOURCE_EXHAUSTED (retried after the pushback), a request
    // refused as it stands INVALID_ARGUMENT (not retried), a store down UNAVAILABLE.
    // Not gRPC's mapping of a bare HTTP status (doc/http-grpc-status-mapping.md, for a
    // response with no grpc-status: 429 is UNAVAILABLE there, 400 INTERNAL), which would
    // have clients retry a quota at once and a bad request as a server fault.
    let code: u32 = match parts.status {
        StatusCode::TOO_MANY_REQUESTS => 8,
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => 3,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => 14,
        StatusCode::UNAUTHORIZED => 16,
        StatusCode::FORBIDDEN => 7,
        // Only an `on_deny` hook answers so (a denial with a notice): the call was
        // denied for its quota all the same, not failed by the server.
        status if status.is_success() => 8,
        StatusCode::INTERNAL_SERVER_ERROR => 13,
        // A hook's other statuses as gRPC maps a bare HTTP status
        // (doc/http-grpc-status-mapping.md): a 404 hiding an endpoint is UNIMPLEMENTED,
        // a bad gateway UNAVAILABLE, anything else UNKNOWN (it was INTERNAL, a server
        // fault).
        StatusCode::NOT_FOUND => 12,
        StatusCode::BAD_GATEWAY => 14,
        _ => 2,
    };
    let message = detail(&body)
        .map(|detail| super::problem::cut(&detail, MESSAGE_MAX).to_owned())
        .or_else(|| plain_text(&parts.headers, &body))
        .unwrap_or_else(|| {
            // A hook's success says nothing of the denial ("OK").
            let reason = parts.status.canonical_reason();
            reason
                .filter(|_| !parts.status.is_success())
                .unwrap_or("rate limited")
                .to_owned()
        });
    parts.status = StatusCode::OK;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, content_type);
    parts.headers.insert(GRPC_STATUS, HeaderValue::from(code));
    if let Some(pushback) = pushback(code, retry_after) {
        parts.headers.insert(PUSHBACK, pushback);
    }
    if let Ok(value) = HeaderValue::from_str(&percent_encode(&message)) {
        parts.headers.insert("grpc-message", value);
    }
    let details = status_details(code, &message, retry_after.filter(|_| code == 8));
    let details = base64::engine::general_purpose::STANDARD_NO_PAD.encode(details);
    if let Ok(value) = HeaderValue::from_str(&details) {
        parts.headers.insert("grpc-status-details-bin", value);
    }
    Response::from_parts(parts, Bytes::new())
}

/// The wait of a denial an `on_deny` hook answered with a success (a notice): over HTTP
/// it states none (a `Retry-After` on a 200 means nothing), but a gRPC call's answer is
/// then RESOURCE_EXHAUSTED, which says when (`retry-after`, the pushback, `RetryInfo`).
#[derive(Debug, Clone, Copy)]
struct NoticeWait(u64);

/// Marks `response`, a hook's success answering a denial of `seconds`' wait, for
/// [`fit`]: a gRPC call is told the wait (unless the hook set its own gRPC status: that
/// stands as it wrote it); the mark never leaves the layer.
pub(super) fn notice_waits(response: &mut Response<Bytes>, seconds: u64) {
    if !response.headers().contains_key(GRPC_STATUS) {
        response.extensions_mut().insert(NoticeWait(seconds));
    }
}

/// True when `headers` hold a gRPC status that tells the client to come back later:
/// RESOURCE_EXHAUSTED (8) or UNAVAILABLE (14), the codes a pushback goes with.
pub(super) fn asks_to_wait(headers: &http::HeaderMap) -> bool {
    headers
        .get(GRPC_STATUS)
        .and_then(|code| code.to_str().ok())
        .is_some_and(|code| matches!(code.trim(), "8" | "14"))
}

const GRPC_STATUS: &str = "grpc-status";
/// The longest message (in bytes, before its encoding) of a hook's answer sent on: it
/// goes out twice, percent-encoded in `grpc-message` and in `grpc-status-details-bin`,
/// and a trailers-only answer past a client's header limit (8 KiB in PROTOCOL-HTTP2.md's
/// advice and grpc-java's default) fails the call, its status lost.
const MESSAGE_MAX: usize = 1024;
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// What a call answered with gRPC status `code` is told to wait before a retry: clients
/// with a retry policy wait what the server pushes back (gRFC A6, "Pushback"), in
/// milliseconds; none for the other codes.
fn pushback(code: u32, retry_after: Option<u64>) -> Option<HeaderValue> {
    match (code, retry_after) {
        // At most the largest 32-bit integer, which is what clients read (about 24.8
        // days): a longer value is unreadable to them, and so "do not retry".
        (8 | 14, Some(seconds)) => Some(HeaderValue::from(
            seconds.saturating_mul(1000).min(i32::MAX as u64),
        )),
        // Not "do not retry" (-1) for INVALID_ARGUMENT: a pushback that says so counts as
        // a failure in the client's retry throttling (gRFC A6, "Throttling Retry
        // Attempts and Hedged RPCs"), which would then hold back the retries of every
        // method of the server; and no retry policy lists the code.
        _ => None,
    }
}

/// The `detail` member of a problem body (RFC 9457; the limiter's own, or a hook's, with
/// whitespace around its colon, RFC 8259, section 2), its JSON escapes undone (section 7).
fn detail(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let after_name = text.find("\"detail\"")? + "\"detail\"".len();
    let rest = text[after_name..].trim_start_matches([' ', '\t', '\n', '\r']);
    let rest = rest
        .strip_prefix(':')?
        .trim_start_matches([' ', '\t', '\n', '\r']);
    let mut out = String::new();
    let mut chars = rest.strip_prefix('"')?.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'u' => {
                    let unit = |chars: &mut std::str::Chars<'_>| {
                        let hex: String = chars.by_ref().take(4).collect();
                        u32::from_str_radix(&hex, 16).ok()
                    };
                    let first = unit(&mut chars)?;
                    // A character past the Basic Multilingual Plane is escaped as a pair
                    // of surrogates (section 7: an encoder that writes ASCII only sends
                    // an emoji so); a lone surrogate stands for no character, and a
                    // replacement marks it.
                    let paired = (0xd800..0xdc00).contains(&first).then(|| {
                        let mut ahead = chars.clone();
                        let low = (ahead.next() == Some('\\') && ahead.next() == Some('u'))
                            .then(|| unit(&mut ahead))
                            .flatten()
                            .filter(|low| (0xdc00..0xe000).contains(low))?;
                        chars = ahead;
                        char::from_u32(0x10000 + ((first - 0xd800) << 10) + (low - 0xdc00))
                    });
                    out.push(
                        paired
                            .flatten()
                            .or_else(|| char::from_u32(first))
                            .unwrap_or(char::REPLACEMENT_CHARACTER),
                    );
                }
                escaped => out.push(escaped),
            },
            c => out.push(c),
        }
    }
    None
}

/// A hook's plain-text body (`text/plain`), as its message: trimmed, at most 1 KiB (cut on
/// a character boundary).
fn plain_text(headers: &http::HeaderMap, body: &[u8]) -> Option<String> {
    let plain = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value
                .split(';')
                .next()
                .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("text/plain"))
        });
    let text = std::str::from_utf8(body).ok().filter(|_| plain)?.trim();
    Some(super::problem::cut(text, MESSAGE_MAX).to_owned()).filter(|text| !text.is_empty())
}

/// gRPC's percent-encoding of `grpc-message`: printable ASCII but `%` as is.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (b' '..=b'~').contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A protobuf varint.
fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A length-delimited protobuf field.
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The largest `google.protobuf.Duration.seconds` (an int64): 10,000 years, its
/// documented range.
const LONGEST_DURATION_SECS: u64 = 315_576_000_000;

/// `google.rpc.Status { code, message, details: [Any(google.rpc.RetryInfo)] }`.
pub(crate) fn status_details(code: u32, message: &str, retry_after: Option<u64>) -> Vec<u8> {
    let mut status = Vec::new();
    varint(&mut status, 1 << 3);
    varint(&mut status, u64::from(code));
    bytes_field(&mut status, 2, message.as_bytes());
    if let Some(seconds) = retry_after {
        // google.protobuf.Duration { seconds }: a longer wait than its range is its
        // largest, not a varint read as negative.
        let mut duration = Vec::new();
        varint(&mut duration, 1 << 3);
        varint(&mut duration, seconds.min(LONGEST_DURATION_SECS));
        // google.rpc.RetryInfo { retry_delay }
        let mut retry_info = Vec::new();
        bytes_field(&mut retry_info, 1, &duration);
        // google.protobuf.Any { type_url, value }
        let mut any = Vec::new();
        bytes_field(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
        bytes_field(&mut any, 2, &retry_info);
        bytes_field(&mut status, 3, &any);
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    /// True for a gRPC call: `application/grpc`, and gRPC-Web's `application/grpc-web` and
    /// `application/grpc-web-text`, each alone or with `+` a message format.
    fn is_grpc(headers: &HeaderMap) -> bool {
        grpc_content_type(headers).is_some()
    }

    /// Request headers with `content_type`.
    fn typed(content_type: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers
    }

    /// The limiter's HTTP denial.
    fn denial() -> Box<Response<Bytes>> {
        let mut response = Response::new(Bytes::from_static(br#"{"detail":"slow down"}"#));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        Box::new(response)
    }

    /// The limiter's HTTP answer `response` as a gRPC trailers-only response.
    fn answer(response: Response<Bytes>) -> Response<Bytes> {
        answer_as(response, HeaderValue::from_static("application/grpc"))
    }

    /// A hook's own words reach the client: a problem body written with spaces around
    /// its colon, or a plain-text one (the `Rejection` docs' example). Both gave the
    /// status's reason ("Too Many Requests").
    #[test]
    fn a_hooks_message_is_the_grpc_message() {
        for (body, content_type, message) in [
            (
                &br#"{"detail": "slow down"}"#[..],
                "application/problem+json",
                "slow down",
            ),
            (
                b"{\n  \"detail\" :\n  \"wait\"\n}",
                "application/json",
                "wait",
            ),
            (
                b"  try again in 3s\n",
                "text/plain; charset=utf-8",
                "try again in 3s",
            ),
            (b"<p>no</p>", "text/html", "Too Many Requests"),
        ] {
            let mut response = Response::new(Bytes::from_static(body));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            let answer = answer(response);
            assert_eq!(answer.headers()["grpc-message"], message, "{content_type}");
        }
    }

    #[test]
    fn a_denial_becomes_resource_exhausted_with_retry_info() {
        let mut response = Response::new(Bytes::from_static(
            br#"{"status":429,"detail":"rate limit \"api\" exceeded; retry in 3 s"}"#,
        ));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("3"));
        let answer = answer(response);
        assert_eq!(answer.status(), StatusCode::OK);
        assert_eq!(answer.headers()["grpc-status"], "8");
        assert_eq!(
            answer.headers()["grpc-message"],
            "rate limit \"api\" exceeded; retry in 3 s"
        );
        assert_eq!(answer.headers()["retry-after"], "3");
        assert!(answer.body().is_empty());
        // Status{code 8, message, details[Any{RetryInfo{Duration{3 s}}}]}
        let details = status_details(8, "m", Some(3));
        assert_eq!(&details[..5], &[0x08, 8, 0x12, 1, b'm']);
        assert!(details.ends_with(&[0x0a, 2, 0x08, 3]));
    }

    /// `google.protobuf.Duration.seconds` is an int64 of at most 315,576,000,000 (10,000
    /// years, its documented range): a longer wait (a hook's `Retry-After` of 20 digits,
    /// read as the largest u64) is sent as that, never as a varint an int64 reads as
    /// negative.
    #[test]
    fn a_retry_delay_past_a_durations_range_is_its_largest() {
        const LARGEST: u64 = 315_576_000_000;
        let mut expected = Vec::new();
        varint(&mut expected, LARGEST);
        for seconds in [LARGEST, LARGEST + 1, 1 << 63, u64::MAX] {
            let details = status_details(8, "m", Some(seconds));
            let mut tail = vec![0x08];
            tail.extend_from_slice(&expected);
            assert!(details.ends_with(&tail), "{seconds}: {details:?}");
        }
    }

    #[test]
    fn grpc_calls_are_told_apart() {
        assert!(!is_grpc(&HeaderMap::new()));
        assert!(is_grpc(&typed("application/grpc+proto")));
        assert!(!is_grpc(&typed("application/grpcx")));
    }

    /// A media type's type and subtype are case-insensitive, and parameters may follow
    /// (RFC 9110, section 8.3.1); gRPC's own spec reads a call by the type's start
    /// ("If Content-Type does not begin with \"application/grpc\"", PROTOCOL-HTTP2.md).
    /// The answer then carries the bare type (with the call's `+` format when plain).
    #[test]
    fn grpc_is_told_apart_in_any_case_and_with_parameters() {
        for (sent, answered) in [
            ("Application/GRPC", "application/grpc"),
            ("application/grpc; charset=utf-8", "application/grpc"),
            ("application/grpc+proto;x=1", "application/grpc+proto"),
            (
                "APPLICATION/GRPC-WEB-TEXT+Proto",
                "application/grpc-web-text+Proto",
            ),
            ("application/grpc-web ; a=b", "application/grpc-web"),
        ] {
            assert_eq!(
                grpc_content_type(&typed(sent))
                    .as_ref()
                    .map(HeaderValue::as_bytes),
                Some(answered.as_bytes()),
                "{sent}"
            );
        }
        for not_grpc in [
            "application/grpcx",
            "application/grpc-webx",
            "text/grpc",
            "",
        ] {
            assert!(grpc_content_type(&typed(not_grpc)).is_none(), "{not_grpc}");
        }
    }

    /// gRPC-Web calls (a browser's, or through a proxy that translates them further in)
    /// are gRPC calls too; their trailers-only answer is in the headers, as gRPC's is
    /// ("Trailers-only responses: no change to the gRPC protocol spec", gRPC-Web
    /// protocol, PROTOCOL-WEB.md), with the call's own content type.
    #[test]
    fn grpc_web_calls_get_a_grpc_web_status() {
        for content_type in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            let answer = fit(&Method::POST, &typed(content_type), denial());
            assert_eq!(answer.status(), StatusCode::OK, "{content_type}");
            assert_eq!(answer.headers()["grpc-status"], "8", "{content_type}");
            assert_eq!(answer.headers()[header::CONTENT_TYPE], content_type);
        }
    }

    /// Only a `POST` is a gRPC call (gRPC and gRPC-Web calls always are): a `GET` that
    /// claims the type gets the HTTP answer, which no cache keeps as a success. The
    /// content type is echoed only when its `+` format is a plain token.
    #[test]
    fn only_a_post_is_a_grpc_call_and_odd_formats_are_not_echoed() {
        assert_eq!(
            fit(&Method::GET, &typed("application/grpc+proto"), denial()).status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        // A format that is no plain token is not echoed; parameters never are.
        for (sent, answered) in [
            ("application/grpc-web+x/evil", "application/grpc-web"),
            ("application/grpc-web+x;evil=1", "application/grpc-web+x"),
        ] {
            let answer = fit(&Method::POST, &typed(sent), denial());
            assert_eq!(answer.headers()["grpc-status"], "8");
            assert_eq!(answer.headers()[header::CONTENT_TYPE], answered, "{sent}");
        }
    }

    /// The message is the problem body's `detail`, its JSON escapes undone (RFC 8259,
    /// section 7), then percent-encoded as gRPC's `grpc-message` is.
    #[test]
    fn the_message_undoes_every_json_escape() {
        let body = br#"{"detail":"a\"b\\c\u000ad\u00e9"}"#;
        assert_eq!(detail(body).as_deref(), Some("a\"b\\c\nd\u{e9}"));
        let mut response = Response::new(Bytes::from_static(body));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        let answer = answer(response);
        assert_eq!(answer.headers()["grpc-message"], "a\"b\\c%0Ad%C3%A9");
    }

    /// A character past the Basic Multilingual Plane, escaped as JSON encoders that write
    /// ASCII only escape it (a pair of surrogates, RFC 8259, section 7), is that one
    /// character: each half was read alone, as two replacement characters. A lone
    /// surrogate is still a replacement.
    #[test]
    fn an_escaped_surrogate_pair_is_one_character() {
        let body = br#"{"detail":"\ud83d\ude00 and \ud83d alone, \ude00 too"}"#;
        assert_eq!(
            detail(body).as_deref(),
            Some("\u{1f600} and \u{fffd} alone, \u{fffd} too")
        );
        let mut response = Response::new(Bytes::from_static(br#"{"detail":"\ud83d\ude00"}"#));
        *response.status_mut() = StatusCode::BAD_REQUEST;
        assert_eq!(answer(response).headers()["grpc-message"], "%F0%9F%98%80");
    }

    /// gRPC's retry design (gRFC A6, "Pushback") has clients with a retry policy read
    /// the server's wish from `grpc-retry-pushback-ms`, not from `retry-after`: without it
    /// they retry on their own backoff (often 100 ms) into an exhausted budget or a
    /// failing store. A denial and a fail-closed outage say when, in milliseconds. A
    /// request refused as it stands (`INVALID_ARGUMENT`) says nothing there: a pushback
    /// that says not to retry counts as a failure in the client's retry throttling
    /// (gRFC A6, "Throttling Retry Attempts and Hedged RPCs": "or that receive a pushback
    /// response indicating not to retry"), so a few calls without a key would spend the
    /// retries every other method of the server needs in an outage, and a status no
    /// retry policy lists is never retried anyway.
    #[test]
    fn a_refusal_tells_retrying_clients_when_in_pushback() {
        for (status, retry_after, code, pushback) in [
            (StatusCode::TOO_MANY_REQUESTS, Some("3"), "8", Some("3000")),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Some("1"),
                "14",
                Some("1000"),
            ),
            (StatusCode::TOO_MANY_REQUESTS, None, "8", None),
            // A hook's date in the current second reads as no wait: a client told 0
            // retries at once into a spent quota. The layer's own waits are a second at
            // least; so is a pushback.
            (StatusCode::TOO_MANY_REQUESTS, Some("0"), "8", Some("1000")),
            (StatusCode::BAD_REQUEST, None, "3", None),
            (StatusCode::PAYLOAD_TOO_LARGE, Some("5"), "3", None),
            // A month's wait: clients read the pushback as a 32-bit integer and take one
            // they cannot read for "do not retry" (grpc-java's `Integer.valueOf`): the
            // longest they read, about 24.8 days, stands for anything longer.
            (
                StatusCode::TOO_MANY_REQUESTS,
                Some("2592000"),
                "8",
                Some("2147483647"),
            ),
        ] {
            let mut response = Response::new(Bytes::from_static(br#"{"detail":"no"}"#));
            *response.status_mut() = status;
            if let Some(seconds) = retry_after {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static(seconds));
            }
            let answer = answer(response);
            assert_eq!(answer.headers()["grpc-status"], code, "{status}");
            assert_eq!(
                answer
                    .headers()
                    .get("grpc-retry-pushback-ms")
                    .map(|value| value.to_str().unwrap()),
                pushback,
                "{status}"
            );
        }
    }

    /// An `on_deny` hook that answers as gRPC (`grpc-status` set) goes out with the
    /// call's own content type: a client reads a reply of another type as no gRPC
    /// response at all (grpc-go: a 200 of another type is UNKNOWN, its status unread),
    /// so a hook's `application/json`, or the `application/grpc` tonic's
    /// `Status::into_http` writes on a gRPC-Web call, would lose the status and its
    /// pushback.
    #[test]
    fn a_hooks_grpc_answer_carries_the_calls_content_type() {
        for (call, hook) in [
            ("application/grpc", "application/json"),
            ("application/grpc-web-text", "application/grpc"),
            ("application/grpc-web+proto", "application/grpc"),
            ("application/grpc+proto", "application/grpc+proto"),
        ] {
            let mut response = Response::new(Bytes::from_static(b"{}"));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            let headers = response.headers_mut();
            headers.insert(GRPC_STATUS, HeaderValue::from_static("8"));
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(hook));
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
            let answer = fit(&Method::POST, &typed(call), Box::new(response));
            assert_eq!(answer.headers()[header::CONTENT_TYPE], call, "{hook}");
            assert_eq!(answer.headers()["grpc-status"], "8");
            assert_eq!(answer.headers()["grpc-retry-pushback-ms"], "2000");
        }
    }

    /// An `on_deny` hook's own status keeps its meaning as a gRPC code (gRPC's HTTP to
    /// gRPC status mapping, doc/http-grpc-status-mapping.md): 401 is UNAUTHENTICATED, 403
    /// PERMISSION_DENIED, not INTERNAL.
    #[test]
    fn a_hooks_status_keeps_its_meaning() {
        for (status, code) in [
            (StatusCode::UNAUTHORIZED, "16"),
            (StatusCode::FORBIDDEN, "7"),
            (StatusCode::GATEWAY_TIMEOUT, "14"),
            (StatusCode::INTERNAL_SERVER_ERROR, "13"),
            // doc/http-grpc-status-mapping.md, for the statuses the limiter never
            // answers itself.
            (StatusCode::NOT_FOUND, "12"),
            (StatusCode::BAD_GATEWAY, "14"),
            (StatusCode::CONFLICT, "2"),
            (StatusCode::IM_A_TEAPOT, "2"),
        ] {
            let mut response = Response::new(Bytes::new());
            *response.status_mut() = status;
            assert_eq!(answer(response).headers()["grpc-status"], code, "{status}");
        }
    }

    /// A hook's own `INVALID_ARGUMENT` gets no pushback from the layer either (gRFC A6:
    /// one saying not to retry counts against the client's retry throttling).
    #[test]
    fn a_hooks_invalid_argument_gets_no_pushback() {
        let mut response = Response::new(Bytes::new());
        *response.status_mut() = StatusCode::BAD_REQUEST;
        response
            .headers_mut()
            .insert(GRPC_STATUS, HeaderValue::from_static("3"));
        let answer = fit(
            &Method::POST,
            &typed("application/grpc"),
            Box::new(response),
        );
        assert_eq!(answer.headers()["grpc-status"], "3");
        assert_eq!(answer.headers().get("grpc-retry-pushback-ms"), None);
    }

    /// A hook's `detail` is cut to 1 KiB, as a plain-text body and the limiter's own
    /// details are: it goes out twice (percent-encoded in `grpc-message`, and in
    /// `grpc-status-details-bin`), and a trailers-only answer past a client's header
    /// limit (PROTOCOL-HTTP2.md suggests clients allow 8 KiB; grpc-java's default is
    /// 8,192 bytes) fails the call as a transport error, its status and pushback lost.
    #[test]
    fn a_long_detail_is_cut_to_a_kibibyte() {
        let body = format!(r#"{{"detail":"{}"}}"#, "x".repeat(10_000));
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let answered = answer(response);
        assert_eq!(answered.headers()["grpc-message"].len(), 1024);
        let all: usize = answered
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        assert!(all < 4096, "{all} bytes of headers");
        // A cut falls on a character boundary; encoded, a character is up to 12 bytes.
        let body = format!(r#"{{"detail":"{}"}}"#, "\\u00e9".repeat(1000));
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let message = answer(response).headers()["grpc-message"].clone();
        assert_eq!(message.len(), 512 * 6, "{message:?}");
    }
}
