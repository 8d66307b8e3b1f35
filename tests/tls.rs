//! The Redis store over TLS (`rediss://`) against a real `redis-server` started with a
//! TLS port and a certificate signed by a CA this test makes, logged in as a
//! least-privilege ACL user limited to its own key prefix (the README's ACL line).

#![cfg(all(feature = "redis", feature = "tls"))]

#[path = "../examples/support/certificates.rs"]
mod certificates;
mod support;

use std::time::Duration;

use support::{RedisServer, free_port, keys_with_ttl};
use tollgate::store::{RedisConfig, StoreErrorKind};
use tollgate::{Key, Policy, PolicySet, Store};

/// A redis-server with a plain port (for redis-cli) and a TLS port; an ACL user `limiter`
/// that may touch only `shop:*` with the commands the scripts call.
struct TlsRedis {
    server: RedisServer,
    tls_port: u16,
    ca: String,
    /// A client certificate and key the CA signed.
    client: (String, String),
    _dir: std::path::PathBuf,
}

fn start() -> TlsRedis {
    start_asking_clients(false)
}

/// As [`start`]; with `ask`, the server asks each client for a certificate its CA signed
/// (`tls-auth-clients yes`, Redis's own default).
fn start_asking_clients(ask: bool) -> TlsRedis {
    let (ca, cert, key, client) = certificates::signed_for_loopback_and_a_client();
    let tls_port = free_port();
    let dir = std::env::temp_dir().join(format!("tollgate-tls-{tls_port}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (ca_file, cert_file, key_file) = (
        path("ca.pem", &ca),
        path("cert.pem", &cert),
        path("key.pem", &key),
    );
    let server = RedisServer::start_with(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &cert_file,
        "--tls-key-file",
        &key_file,
        "--tls-ca-cert-file",
        &ca_file,
        "--tls-auth-clients",
        if ask { "yes" } else { "no" },
    ]);
    // The README's least-privilege line, with this app's prefix, less the Functions
    // commands: the store falls back to EVALSHA scripts (checked below).
    let acl = "ACL SETUSER limiter on >s3cret resetkeys ~shop:* resetchannels -@all +evalsha \
               +eval +script|load +time +get +set +hmget +hset +pexpire +pttl +zadd +zrange \
               +zrangebyscore +zremrangebyscore +zcard +zrem +del";
    let args: Vec<&str> = acl.split_whitespace().collect();
    assert_eq!(server.cli(&args).trim(), "OK");
    TlsRedis {
        server,
        tls_port,
        ca,
        client,
        _dir: dir,
    }
}

/// The quickstart reads Redis from the environment (`RedisConfig::from_env`): a Redis
/// over TLS with a private CA that asks for a client certificate (Redis's default) is
/// reached with the three files named there. A certificate without its key, or a file
/// that cannot be read, is refused naming the variable and the path, never the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_names_the_tls_files() {
    let redis = start_asking_clients(true);
    let file = |name: &str, pem: &str| {
        let path = redis._dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (certificate, key) = &redis.client;
    let (ca_file, cert_file, key_file) = (
        file("env-ca.pem", &redis.ca),
        file("env-client.pem", certificate),
        file("env-client.key", key),
    );
    let url = format!("rediss://limiter:s3cret@127.0.0.1:{}", redis.tls_port);
    let from = |vars: &[(&str, &str)]| {
        RedisConfig::from_lookup(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    };
    let config = from(&[
        ("REDIS_URL", &url),
        ("REDIS_TLS_CA_FILE", &ca_file),
        ("REDIS_TLS_CERT_FILE", &cert_file),
        ("REDIS_TLS_KEY_FILE", &key_file),
    ])
    .unwrap()
    .unwrap();
    let store = config
        .prefix("shop")
        .connect()
        .await
        .expect("connects with the files");
    let policies =
        PolicySet::from(Policy::fixed_window("env", 1, Duration::from_secs(60)).unwrap());
    assert!(
        store
            .decide(&Key::new("user:1"), &policies, 1)
            .await
            .unwrap()
            .is_allowed()
    );

    let alone = from(&[("REDIS_URL", &url), ("REDIS_TLS_CERT_FILE", &cert_file)]).unwrap_err();
    assert!(alone.to_string().contains("REDIS_TLS_KEY_FILE"), "{alone}");
    let missing = format!("{}/nowhere.pem", redis._dir.display());
    let unreadable = from(&[("REDIS_URL", &url), ("REDIS_TLS_CA_FILE", &missing)]).unwrap_err();
    assert!(
        unreadable.to_string().contains("REDIS_TLS_CA_FILE")
            && unreadable.to_string().contains("nowhere.pem"),
        "{unreadable}"
    );
    let nothing = from(&[("REDIS_TLS_CA_FILE", &ca_file)]).unwrap_err();
    assert!(nothing.to_string().contains("no Redis"), "{nothing}");
}

/// A client key whose lines were joined (newlines turned to spaces by a shell, or to a
/// literal `\n` in an `.env` file) cannot be read: the PEM parser's error held the key's
/// bytes (`MissingSectionEnd { end_marker: [..] }`), and `connect` returned it. The error
/// says what is wrong and holds none of the key, in `Display`, `Debug` or its sources.
#[tokio::test]
async fn a_client_key_that_cannot_be_read_is_never_printed() {
    let (ca, _, _, (certificate, key)) = certificates::signed_for_loopback_and_a_client();
    let body = key.lines().nth(1).unwrap();
    let bytes = format!("{:?}", &body.as_bytes()[..8]);
    let bytes = bytes.trim_end_matches(']');
    for mangled in [key.replace('\n', " "), key.replace('\n', "\\n")] {
        let error = RedisConfig::server("rediss://127.0.0.1:1")
            .root_certificate_pem(ca.as_bytes())
            .client_certificate_pem(certificate.as_bytes(), mangled)
            .connect()
            .await
            .expect_err("a key that cannot be read");
        let mut said = format!("{error} {error:?}");
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            said.push_str(&format!(" {cause} {cause:?}"));
            source = cause.source();
        }
        assert!(!said.contains(bytes), "{said}");
        assert!(!said.contains(&body[..16]), "{said}");
        assert!(said.contains("client key"), "{said}");
        assert!(!error.kind().is_io(), "{error}");
    }
}

/// Redis asks TLS clients for a certificate by default (`tls-auth-clients yes`): a store
/// that could present none was refused by such a server at start, whatever else was
/// right. With one the server's CA signed, it connects and decides; without, it is
/// refused at start, as a setting to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_presented_to_a_server_that_asks() {
    let redis = start_asking_clients(true);
    let url = format!("rediss://limiter:s3cret@127.0.0.1:{}", redis.tls_port);
    let without = RedisConfig::server(url.as_str())
        .root_certificate_pem(redis.ca.as_bytes())
        .prefix("shop")
        .connect()
        .await
        .expect_err("a server that asks for a client certificate refuses a client without");
    assert!(!without.to_string().contains("s3cret"), "{without}");
    let (certificate, key) = &redis.client;
    let config = RedisConfig::server(url.as_str())
        .root_certificate_pem(redis.ca.as_bytes())
        .client_certificate_pem(certificate.as_bytes(), key.as_bytes())
        .prefix("shop");
    // The key is never printed.
    let key_line = key.lines().nth(1).unwrap();
    assert!(!format!("{config:?}").contains(key_line));
    let store = config
        .connect()
        .await
        .expect("presented, the certificate is taken");
    let policies =
        PolicySet::from(Policy::fixed_window("mtls", 1, Duration::from_secs(60)).unwrap());
    let key = Key::new("user:9");
    assert!(store.decide(&key, &policies, 1).await.unwrap().is_allowed());
    assert!(!store.decide(&key, &policies, 1).await.unwrap().is_allowed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_and_a_least_privilege_user() {
    let redis = start();
    let url = format!("rediss://limiter:s3cret@127.0.0.1:{}", redis.tls_port);
    let config = RedisConfig::server(url.as_str())
        .root_certificate_pem(redis.ca.as_bytes())
        .prefix("shop");
    // The password never shows where the store describes itself.
    assert!(
        !config.describe().contains("s3cret"),
        "{}",
        config.describe()
    );
    assert!(!format!("{config:?}").contains("s3cret"));
    let store = config
        .connect()
        .await
        .expect("rediss:// connects and the scripts run");

    // Exact over TLS: 5 of 8 concurrent requests under a quota of 5 (a bucket that
    // never refills: a window could end among the 8, wherever the wall clock is).
    let policies = PolicySet::from(
        Policy::token_bucket(
            "tls",
            5,
            tollgate::Rate::new(1, tollgate::policy::MAX_PERIOD),
        )
        .unwrap(),
    );
    let key = Key::new("user:7");
    let decisions =
        futures_util::future::join_all((0..8).map(|_| store.decide(&key, &policies, 1))).await;
    let allowed = decisions
        .into_iter()
        .map(|decision| decision.expect("a decision over TLS"))
        .filter(|decision| decision.is_allowed())
        .count();
    assert_eq!(allowed, 5);

    // Without FUNCTION LOAD and FCALL in the ACL, the decisions ran as scripts.
    assert!(support::command_calls(&redis.server, "evalsha") > 0);
    assert_eq!(support::command_calls(&redis.server, "fcall"), 0);

    // Every key is under the user's prefix, with a TTL.
    let keys = keys_with_ttl(&redis.server);
    assert!(
        keys.iter().any(|(key, _)| key.contains("{user:7}")),
        "{keys:?}"
    );
    for (key, ttl) in &keys {
        assert!(key.starts_with("shop:"), "{key} is outside the prefix");
        assert!(*ttl > 0, "{key} has no TTL");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_refuses_an_unknown_ca_and_plain_text() {
    let redis = start();
    // The system's roots do not know the test's CA: the handshake fails, at start-up.
    let unknown = RedisConfig::server(format!(
        "rediss://limiter:s3cret@127.0.0.1:{}",
        redis.tls_port
    ))
    .prefix("shop")
    .connect()
    .await
    .expect_err("a certificate from an unknown CA is refused");
    assert!(!unknown.to_string().contains("s3cret"), "{unknown}");
    // A setting to fix, not an outage to wait out (as it is at every reconnect later).
    assert_eq!(unknown.kind(), StoreErrorKind::Refused, "{unknown}");

    // Plain text to the TLS port gets no Redis answer.
    let plain = tokio::time::timeout(
        Duration::from_secs(30),
        RedisConfig::server(format!(
            "redis://limiter:s3cret@127.0.0.1:{}",
            redis.tls_port
        ))
        .prefix("shop")
        .connect(),
    )
    .await
    .expect("a plain connection to a TLS port fails in time");
    assert!(plain.is_err(), "plain text reached a TLS port");

    // A wrong password is refused, and says so without the password.
    let wrong = RedisConfig::server(format!(
        "rediss://limiter:nope@127.0.0.1:{}",
        redis.tls_port
    ))
    .root_certificate_pem(redis.ca.as_bytes())
    .prefix("shop")
    .connect()
    .await
    .expect_err("a wrong password is refused");
    assert!(!wrong.to_string().contains("nope"), "{wrong}");
}
