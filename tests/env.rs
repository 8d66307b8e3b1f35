//! `RedisConfig::from_env` against the process's own environment: one test alone in its
//! binary, as it sets variables (no other thread reads the environment meanwhile).

#![cfg(all(feature = "redis", unix))]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use tollgate::store::RedisConfig;

/// A `REDIS_URL` that is not UTF-8 (a deployment's template gone wrong) read as unset:
/// `from_env` said "no Redis", and the README's own start-up (`None =>
/// MemoryStore::new()`) left each replica its own in-process store, N times the limit,
/// as a variable set to nothing would have, which is refused. It is refused too.
#[test]
fn a_redis_variable_that_is_not_utf8_is_refused_not_unset() {
    // SAFETY: the only test of this binary; nothing else reads the environment.
    unsafe {
        std::env::remove_var("REDIS_CLUSTER");
        std::env::remove_var("REDIS_SENTINEL_URLS");
        std::env::remove_var("REDIS_SENTINEL_MASTER");
        std::env::set_var("REDIS_URL", OsStr::from_bytes(b"redis://h\xff:6379"));
    }
    let error = RedisConfig::from_env().expect_err("an unreadable REDIS_URL is an error");
    assert!(error.to_string().contains("REDIS_URL"), "{error}");
    // SAFETY: as above.
    unsafe { std::env::set_var("REDIS_URL", "redis://127.0.0.1:6379") };
    assert!(RedisConfig::from_env().unwrap().is_some());
    // SAFETY: as above.
    unsafe { std::env::remove_var("REDIS_URL") };
    assert!(RedisConfig::from_env().unwrap().is_none());
}
