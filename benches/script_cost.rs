//! Redis CPU per decision: each single-policy decision next to a minimal script of the
//! same algorithm family, measured by Redis itself (`INFO commandstats`: `usec / calls`)
//! on the same server in the same run. tollgate's decision is measured both ways it runs:
//! as a call of its Functions library (`FCALL`, what a store runs where the server has
//! Functions) and as its `EVALSHA` script (the fallback); the minimal script both as a
//! script (`EVALSHA`, the floor the ratios in the README are taken against) and as the one
//! function of a library of its own (`FCALL`: the like-for-like floor of tollgate's call);
//! and, as a function too, the minimal script with its times written as digits, as
//! tollgate writes them (a time passed as a Lua number is spelled by Redis, with `%.17g`
//! before Redis 7.2): the strictest floor, a minimal script written with tollgate's care.
//! A minimal script is a template: `$(expr)` is an integer argument, `expr` as written,
//! `format('%d', expr)` with digits (`format` a local, as in tollgate's Lua); `expr`
//! holds no parentheses. A template
//! without times (the fixed window's) has no digits variant.
//!
//! `cargo bench --all-features --bench script_cost` (starts its own redis-server on a free
//! loopback port, pinned to CPU 0 when `taskset` exists, and stops it at the end, also on
//! a panic). Every measurement is `CALLS` calls of one variant, pipelined in batches of `BATCH`,
//! over `IDENTITIES` identities (a fresh database each time: `FLUSHALL`, then `CONFIG
//! RESETSTAT`); `ROUNDS` rounds, each in a rotated order and every other one backwards;
//! the table shows the medians of the µs and of the per-round ratios.
//! Every call is admitted (the limits are far above what one identity receives), so both
//! scripts take their full read, decide and write path.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate::store::{
    FIXED_WINDOW_SCRIPT, GCRA_SCRIPT, IN_FLIGHT_SCRIPT, LEAKY_SHAPE_SCRIPT, SLIDING_LOG_SCRIPT,
    SLIDING_WINDOW_SCRIPT, TOKEN_BUCKET_SCRIPT,
};

const CALLS: usize = 4_000;
const BATCH: usize = 1_000;
const IDENTITIES: usize = 400;
const ROUNDS: usize = 31;

/// Minimal token bucket: `TIME`, `HMGET`, `HSET`, `PEXPIRE`. The level is the tokens
/// missing from full times the period of one token (integers, as tollgate keeps it); it
/// drains by the microseconds elapsed. ARGV: capacity, period of one token (µs), cost.
/// Answers allowed and the tokens left.
const MINIMAL_TOKEN_BUCKET: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local capacity, period, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'l', 't')
local level = tonumber(v[1]) or 0
local last = tonumber(v[2]) or now
level = math.max(level - math.max(now - last, 0), 0)
local allowed = 0
if level + cost * period <= capacity * period then
  level = level + cost * period
  allowed = 1
end
redis.call('HSET', KEYS[1], 'l', $(level), 't', $(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(level / 1000) + 1)
return { allowed, math.floor((capacity * period - level) / period) }
";

/// Minimal fixed window: `TIME`, `GET`, `INCRBY`, `PEXPIRE`. The key holds the count of
/// the current epoch-aligned window and expires when the window ends. ARGV: limit, window
/// (µs), cost. Answers allowed, the units left and the µs until the window ends.
const MINIMAL_FIXED_WINDOW: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local limit, window, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local count = tonumber(redis.call('GET', KEYS[1]) or 0)
local reset = window - math.fmod(now, window)
if count + cost > limit then return { 0, 0, reset } end
count = redis.call('INCRBY', KEYS[1], cost)
redis.call('PEXPIRE', KEYS[1], math.ceil(reset / 1000))
return { 1, limit - count, reset }
";

/// Minimal sliding window counter (two windows): `TIME`, `HMGET`, `HSET`, `PEXPIRE`. The
/// hash holds the current window's index and the previous and current counts; the
/// estimate weighs the previous window by the share of it still inside the sliding
/// window. ARGV: limit, window (µs), cost. Answers allowed and the units left.
const MINIMAL_SLIDING_WINDOW: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local limit, window, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local index = math.floor(now / window)
local v = redis.call('HMGET', KEYS[1], 'i', 'p', 'c')
local i, previous, current = tonumber(v[1]) or index, tonumber(v[2]) or 0, tonumber(v[3]) or 0
if i < index then
  if i == index - 1 then previous = current else previous = 0 end
  current = 0
end
local elapsed = now - index * window
local estimate = math.ceil(previous * (window - elapsed) / window) + current
if estimate + cost > limit then return { 0, 0 } end
current = current + cost
redis.call('HSET', KEYS[1], 'i', $(index), 'p', previous, 'c', current)
redis.call('PEXPIRE', KEYS[1], math.ceil((2 * window - elapsed) / 1000))
return { 1, limit - estimate - cost }
";

/// Minimal sliding log (one unit per request): `TIME`, `ZREMRANGEBYSCORE`, `ZCARD`,
/// `ZADD`, `PEXPIRE`. The sorted set holds one member per admitted request, scored by its
/// time. ARGV: limit, window (µs), a unique member. Answers allowed and the units left.
const MINIMAL_SLIDING_LOG: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', $(now - window))
local count = redis.call('ZCARD', KEYS[1])
if count + 1 > limit then return { 0, 0 } end
redis.call('ZADD', KEYS[1], $(now), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000))
return { 1, limit - count - 1 }
";

/// Minimal in-flight limit: `TIME`, `ZREMRANGEBYSCORE`, `ZCARD`, `ZADD`, `PEXPIRE`. The
/// sorted set holds the slots taken, scored by when their lease ends. ARGV: limit, lease
/// (µs), the lease id. Answers allowed and the slots left.
const MINIMAL_IN_FLIGHT: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local limit, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', $(now))
local count = redis.call('ZCARD', KEYS[1])
if count + 1 > limit then return { 0, 0 } end
redis.call('ZADD', KEYS[1], $(now + lease), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(lease / 1000) + 1)
return { 1, limit - count - 1 }
";

/// Minimal GCRA: `TIME`, `GET`, `SET PX`. The key holds the theoretical arrival time in
/// µs. ARGV: emission interval (µs), burst tolerance (µs), cost. Answers allowed and the
/// µs to wait.
const MINIMAL_GCRA: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local interval, tolerance, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or 0), now)
local new = tat + cost * interval
if new - now > tolerance then return { 0, new - now - tolerance } end
redis.call('SET', KEYS[1], $(new), 'PX', math.ceil((new - now) / 1000) + 1)
return { 1, 0 }
";

/// One algorithm: tollgate's single-policy script and its arguments (kind, p1, p2, p3),
/// and the minimal script and its arguments (the last one, when `unique`, replaced by a
/// number unique to each call).
#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    script: &'static str,
    kind: &'static str,
    params: [u64; 3],
    minimal_name: &'static str,
    minimal: &'static str,
    minimal_args: [u64; 3],
    unique: bool,
    /// The cost tollgate's calls carry (the minimal scripts take none).
    cost: u64,
}

const MINUTE_US: u64 = 60_000_000;

fn cases() -> Vec<Case> {
    // Limits far above the calls one identity receives; rates of 1 unit per ms.
    let sliding_log = Case {
        name: "sliding log",
        script: SLIDING_LOG_SCRIPT,
        kind: "sl",
        params: [1_000, MINUTE_US, 3],
        minimal_name: "sliding log",
        minimal: MINIMAL_SLIDING_LOG,
        minimal_args: [1_000, MINUTE_US, 0],
        unique: true,
        cost: 1,
    };
    vec![
        Case {
            name: "fixed window",
            script: FIXED_WINDOW_SCRIPT,
            kind: "fw",
            params: [1_000, MINUTE_US, 0],
            minimal_name: "fixed window",
            minimal: MINIMAL_FIXED_WINDOW,
            minimal_args: [1_000, MINUTE_US, 1],
            unique: false,
            cost: 1,
        },
        Case {
            name: "sliding window",
            script: SLIDING_WINDOW_SCRIPT,
            kind: "sw",
            params: [1_000, MINUTE_US, 0],
            minimal_name: "sliding window",
            minimal: MINIMAL_SLIDING_WINDOW,
            minimal_args: [1_000, MINUTE_US, 1],
            unique: false,
            cost: 1,
        },
        sliding_log,
        // Requests of several units: the log also keeps its counter of the units beyond
        // one per entry. The minimal log cannot weigh requests (one member each): the
        // ratio is what weights cost over it.
        Case {
            name: "sliding log, 3 units a request",
            minimal_name: "sliding log (one unit each)",
            cost: 3,
            ..sliding_log
        },
        Case {
            name: "token bucket",
            script: TOKEN_BUCKET_SCRIPT,
            kind: "tb",
            params: [1_000, 1, 1_000],
            minimal_name: "token bucket",
            minimal: MINIMAL_TOKEN_BUCKET,
            minimal_args: [1_000, 1_000, 1],
            unique: false,
            cost: 1,
        },
        Case {
            name: "leaky bucket (shaping)",
            script: LEAKY_SHAPE_SCRIPT,
            kind: "ls",
            params: [1_000_000, 1, 1_000],
            minimal_name: "token bucket",
            minimal: MINIMAL_TOKEN_BUCKET,
            minimal_args: [1_000, 1_000, 1],
            unique: false,
            cost: 1,
        },
        Case {
            name: "GCRA",
            script: GCRA_SCRIPT,
            kind: "gc",
            params: [1_000, 1, 1_000],
            minimal_name: "GCRA",
            minimal: MINIMAL_GCRA,
            minimal_args: [1_000, 1_000_000, 1],
            unique: false,
            cost: 1,
        },
        Case {
            name: "in-flight",
            script: IN_FLIGHT_SCRIPT,
            kind: "cc",
            params: [1_000, 30_000_000, 0],
            minimal_name: "in-flight",
            minimal: MINIMAL_IN_FLIGHT,
            minimal_args: [1_000, 30_000_000, 0],
            unique: true,
            cost: 1,
        },
    ]
}

/// A `redis-server` on a free loopback port, killed when dropped (also on a panic).
struct Server {
    port: u16,
    child: Child,
    dir: PathBuf,
}

impl Server {
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let dir = std::env::temp_dir().join(format!(
            "tollgate-script-cost-{port}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("a directory for redis-server");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--dir", dir.to_str().expect("a UTF-8 temporary directory")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts (apt-get install redis-server)");
        Self { port, child, dir }
    }

    /// A connection, once the server answers.
    fn connect(&self) -> redis::Connection {
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).expect("a valid URL");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut connection) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut connection).is_ok()
            {
                return connection;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer PING",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Pins the server to CPU 0 when `taskset` exists, away from this process's work.
    fn pin(&self) {
        let _ = Command::new("taskset")
            .args(["-p", "-c", "0", &self.child.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A minimal script's text from its template: each `$(expr)` as `expr`, or with `digits`
/// as `format('%d', expr)` (`format` a local of the function's library).
fn render(template: &str, digits: bool) -> String {
    let mut text = String::with_capacity(template.len() + 64);
    if digits {
        // `format` is a local of the library (see `load_function`), bound at the first
        // call, as tollgate's Lua binds it: a library cannot read globals while it loads.
        text.push_str("if format == nil then format = string.format end\n");
    }
    let mut rest = template;
    while let Some(start) = rest.find("$(") {
        text.push_str(&rest[..start]);
        let inner = &rest[start + 2..];
        // The templates' expressions hold no parentheses: the first ')' closes one.
        let end = inner
            .find(')')
            .expect("a closed $(...) in a minimal script");
        let expr = &inner[..end];
        assert!(!expr.contains('('), "a $(...) with parentheses: {expr}");
        if digits {
            text.push_str(&format!("format('%d', {expr})"));
        } else {
            text.push_str(expr);
        }
        rest = &inner[end + 1..];
    }
    text.push_str(rest);
    text
}

fn load(connection: &mut redis::Connection, source: &str) -> String {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source)
        .query(connection)
        .expect("SCRIPT LOAD")
}

/// Which script of a case a measurement runs.
#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Tollgate,
    Functions,
    Minimal,
    /// The minimal script as a function of a Functions library of its own (`FCALL`): the
    /// like-for-like floor of tollgate's `FCALL`.
    MinimalFunction,
    /// The minimal script with its times written as digits, as the function of a library
    /// of its own (`FCALL`).
    MinimalDigits,
}

impl Variant {
    /// Called with `FCALL` (a function of a library), not `EVALSHA`.
    fn is_function(self) -> bool {
        matches!(
            self,
            Variant::Functions | Variant::MinimalFunction | Variant::MinimalDigits
        )
    }

    /// One of the minimal scripts (not tollgate's).
    fn is_minimal(self) -> bool {
        matches!(
            self,
            Variant::Minimal | Variant::MinimalFunction | Variant::MinimalDigits
        )
    }
}

/// Loads `source` (a minimal script) as the one function of a library of its own, named
/// `minimal_<index>`, and returns the function's name.
fn load_function(connection: &mut redis::Connection, index: usize, source: &str) -> String {
    let name = format!("minimal_{index}");
    let library = format!(
        "#!lua name={name}\nlocal format\nredis.register_function('{name}', function(KEYS, ARGV)\n{source}\nend)\n"
    );
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library)
        .query(connection)
        .expect("FUNCTION LOAD of a minimal script");
    name
}

/// The name of the library function for a lone plain policy of `kind` (`tollgate_one_
/// <kind>_<version>`), once a store has loaded the library.
fn one_function(connection: &mut redis::Connection, kind: &str) -> String {
    fn find(value: &redis::Value, prefix: &str) -> Option<String> {
        match value {
            redis::Value::BulkString(bytes) => {
                let text = String::from_utf8_lossy(bytes);
                text.starts_with(prefix).then(|| text.into_owned())
            }
            redis::Value::SimpleString(text) => text.starts_with(prefix).then(|| text.clone()),
            redis::Value::Array(items) => items.iter().find_map(|item| find(item, prefix)),
            redis::Value::Map(pairs) => pairs
                .iter()
                .find_map(|(key, value)| find(key, prefix).or_else(|| find(value, prefix))),
            _ => None,
        }
    }
    let list: redis::Value = redis::cmd("FUNCTION")
        .arg("LIST")
        .query(connection)
        .expect("FUNCTION LIST");
    find(&list, &format!("tollgate_one_{kind}_")).expect("the store loaded its Functions library")
}

/// Redis's own µs per call (of `EVALSHA` or `FCALL`, as the variant runs) over `CALLS`
/// calls of one variant.
fn measure(
    connection: &mut redis::Connection,
    case: &Case,
    variant: Variant,
    sha: &str,
    serial: &mut u64,
) -> f64 {
    let _: () = redis::cmd("FLUSHALL").query(connection).expect("FLUSHALL");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(connection)
        .expect("CONFIG RESETSTAT");
    for start in (0..CALLS).step_by(BATCH) {
        let mut pipe = redis::pipe();
        for call in start..(start + BATCH).min(CALLS) {
            *serial += 1;
            // The key names the store would use for this identity and policy.
            let identity = call % IDENTITIES;
            let key = format!("tollgate:{{user:{identity}}}:api:{}", case.kind);
            let p3 = if case.kind == "cc" {
                *serial
            } else {
                case.params[2]
            };
            let command = if variant.is_function() {
                pipe.cmd("FCALL").arg(sha)
            } else {
                pipe.cmd("EVALSHA").arg(sha)
            };
            match variant {
                // As the store sends it: a lone plain policy's decision calls its
                // algorithm's own function with its state key, the cost and p1 to p3.
                Variant::Functions => {
                    command
                        .arg(1)
                        .arg(&key)
                        .arg(case.cost)
                        .arg(case.params[0])
                        .arg(case.params[1])
                        .arg(p3);
                }
                // The script gets the same key, the time ("": Redis TIME), the number of
                // policies and the kind besides.
                Variant::Tollgate => {
                    command
                        .arg(1)
                        .arg(&key)
                        .arg("")
                        .arg(case.cost)
                        .arg(1)
                        .arg(case.kind)
                        .arg(case.params[0])
                        .arg(case.params[1])
                        .arg(p3);
                }
                Variant::Minimal | Variant::MinimalFunction | Variant::MinimalDigits => {
                    let last = if case.unique {
                        *serial
                    } else {
                        case.minimal_args[2]
                    };
                    command
                        .arg(1)
                        .arg(&key)
                        .arg(case.minimal_args[0])
                        .arg(case.minimal_args[1])
                        .arg(last);
                }
            }
        }
        let replies: Vec<Vec<i64>> = pipe.query(connection).unwrap_or_else(|error| {
            panic!(
                "{} ({variant_name}): {error}",
                case.name,
                variant_name = match variant {
                    Variant::Tollgate => "tollgate EVALSHA",
                    Variant::Functions => "tollgate FCALL",
                    Variant::Minimal => "minimal",
                    Variant::MinimalFunction => "minimal as a function",
                    Variant::MinimalDigits => "minimal with digits",
                }
            )
        });
        // Every call admitted: outcome 0 for tollgate, allowed 1 for the minimal scripts.
        let admitted = if variant.is_minimal() { 1 } else { 0 };
        assert!(
            replies.iter().all(|reply| reply.first() == Some(&admitted)),
            "{}: a call was not admitted: {:?}",
            case.name,
            replies
                .iter()
                .find(|reply| reply.first() != Some(&admitted))
        );
    }
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(connection)
        .expect("INFO commandstats");
    // "cmdstat_evalsha:calls=20000,usec=261234,usec_per_call=13.06,..."
    let command = if variant.is_function() {
        "cmdstat_fcall:"
    } else {
        "cmdstat_evalsha:"
    };
    let line = stats
        .lines()
        .find_map(|line| line.strip_prefix(command))
        .unwrap_or_else(|| panic!("no {command} stats in {stats}"));
    let field = |name: &str| -> f64 {
        line.trim()
            .split(',')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line}"))
    };
    assert_eq!(field("calls"), CALLS as f64, "{line}");
    assert_eq!(field("failed_calls"), 0.0, "{line}");
    field("usec") / field("calls")
}

fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

fn main() {
    let started = Instant::now();
    let server = Server::start();
    let mut connection = server.connect();
    server.pin();
    let cases = cases();
    let shas: Vec<(String, String)> = cases
        .iter()
        .map(|case| {
            (
                load(&mut connection, case.script),
                load(&mut connection, &render(case.minimal, false)),
            )
        })
        .collect();

    // A store loads its Functions library, as at any start-up.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        tollgate::store::RedisStore::connect(&format!("redis://127.0.0.1:{}", server.port))
            .await
            .expect("the store starts and loads its library")
    });
    let functions_of: Vec<String> = cases
        .iter()
        .map(|case| one_function(&mut connection, case.kind))
        .collect();
    let minimal_functions: Vec<String> = cases
        .iter()
        .enumerate()
        .map(|(index, case)| load_function(&mut connection, index, &render(case.minimal, false)))
        .collect();
    // A template without times has no digits variant (it would be the same script).
    let has_times = |case: &Case| case.minimal.contains("$(");
    let digits_functions: Vec<String> = cases
        .iter()
        .enumerate()
        .map(|(index, case)| {
            if has_times(case) {
                load_function(
                    &mut connection,
                    cases.len() + index,
                    &render(case.minimal, true),
                )
            } else {
                String::new()
            }
        })
        .collect();

    // Per case: tollgate's (script and function) and the minimal script's µs per call,
    // per round.
    let mut tollgate = vec![Vec::new(); cases.len()];
    let mut functions = vec![Vec::new(); cases.len()];
    let mut minimal = vec![Vec::new(); cases.len()];
    let mut minimal_as_function = vec![Vec::new(); cases.len()];
    let mut minimal_digits = vec![Vec::new(); cases.len()];
    let mut serial = 0;
    let runs: Vec<(usize, Variant)> = cases
        .iter()
        .enumerate()
        .flat_map(|(index, case)| {
            [
                Some((index, Variant::Functions)),
                Some((index, Variant::Minimal)),
                Some((index, Variant::Tollgate)),
                Some((index, Variant::MinimalFunction)),
                has_times(case).then_some((index, Variant::MinimalDigits)),
            ]
        })
        .flatten()
        .collect();
    for round in 0..ROUNDS {
        // Each round starts elsewhere in the list, and every other round runs it backwards,
        // so a variant runs after one neighbour in one round and after the other in the
        // next.
        let shift = round * runs.len() / ROUNDS;
        for step in 0..runs.len() {
            let step = if round % 2 == 1 {
                runs.len() - 1 - step
            } else {
                step
            };
            let (index, variant) = runs[(step + shift) % runs.len()];
            let (case, (tollgate_sha, minimal_sha)) = (&cases[index], &shas[index]);
            match variant {
                Variant::Functions => functions[index].push(measure(
                    &mut connection,
                    case,
                    variant,
                    &functions_of[index],
                    &mut serial,
                )),
                Variant::Tollgate => tollgate[index].push(measure(
                    &mut connection,
                    case,
                    variant,
                    tollgate_sha,
                    &mut serial,
                )),
                Variant::Minimal => minimal[index].push(measure(
                    &mut connection,
                    case,
                    variant,
                    minimal_sha,
                    &mut serial,
                )),
                Variant::MinimalFunction => minimal_as_function[index].push(measure(
                    &mut connection,
                    case,
                    variant,
                    &minimal_functions[index],
                    &mut serial,
                )),
                Variant::MinimalDigits => minimal_digits[index].push(measure(
                    &mut connection,
                    case,
                    variant,
                    &digits_functions[index],
                    &mut serial,
                )),
            }
        }
    }

    println!(
        "Redis CPU per call (INFO commandstats usec/calls), {CALLS} calls x {ROUNDS} rounds, \
         {IDENTITIES} identities, medians"
    );
    println!();
    println!(
        "| algorithm | tollgate FCALL µs | tollgate EVALSHA µs | minimal script | minimal µs | minimal as FCALL µs | minimal as FCALL, times as digits µs | FCALL / minimal | EVALSHA / minimal | FCALL / minimal as FCALL | FCALL / minimal as FCALL, times as digits |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (index, case) in cases.iter().enumerate() {
        let ratios = |ours: &[f64], floor: &[f64]| {
            let mut ratios: Vec<f64> = ours.iter().zip(floor).map(|(a, b)| a / b).collect();
            median(&mut ratios)
        };
        let by_function = ratios(&functions[index], &minimal[index]);
        let by_script = ratios(&tollgate[index], &minimal[index]);
        let like_for_like = ratios(&functions[index], &minimal_as_function[index]);
        // "n/a" where the template has no times (no digits variant ran).
        let (digits_us, by_digits) = if minimal_digits[index].is_empty() {
            ("n/a".to_owned(), "n/a".to_owned())
        } else {
            // The ratio first: the median sorts the samples, which pairs them by round.
            let ratio = ratios(&functions[index], &minimal_digits[index]);
            (
                format!("{:.2}", median(&mut minimal_digits[index])),
                format!("{ratio:.2}x"),
            )
        };
        println!(
            "| {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} | {:.2}x | {:.2}x | {:.2}x | {} |",
            case.name,
            median(&mut functions[index]),
            median(&mut tollgate[index]),
            case.minimal_name,
            median(&mut minimal[index]),
            median(&mut minimal_as_function[index]),
            digits_us,
            by_function,
            by_script,
            like_for_like,
            by_digits
        );
    }
    println!();
    println!("({:.1} s)", started.elapsed().as_secs_f64());
}
