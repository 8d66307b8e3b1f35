//! Real Redis servers for the tests: started on free loopback ports, stopped on drop.
//! A test that needs Redis fails loudly when `redis-server` is missing.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn binary(name: &str) -> String {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{name} is not installed: the Redis tests need it (bash scripts/test.sh installs it with apt-get)"
    );
    name.to_owned()
}

/// A port that is free, and whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    String::from_utf8_lossy(&cli_output(port, args).stdout).into_owned()
}

fn cli_output(port: u16, args: &[&str]) -> std::process::Output {
    Command::new(binary("redis-cli"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs")
}

/// `cli` for a reply a test reads as "none" when empty: a redis-cli that failed (no
/// server there) fails the test instead of reading as nothing found.
fn cli_checked(port: u16, args: &[&str]) -> String {
    let out = cli_output(port, args);
    assert!(
        out.status.success(),
        "redis-cli {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `INFO commandstats` of `server`; a reply without its heading (redis-cli failed, or
/// the server did not answer) fails the test, so that a count read from it cannot pass
/// as zero.
fn commandstats(server: &RedisServer) -> String {
    let reply = cli_checked(server.port, &["INFO", "commandstats"]);
    assert!(
        reply.contains("# Commandstats"),
        "INFO commandstats: {reply:?}"
    );
    reply
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_on(free_port(), extra)
    }

    /// A server on `port`: to bring one back where its clients expect it.
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(binary("redis-server"))
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--dir", dir.to_str().unwrap()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        Self { port, child, dir }.answering("redis-server")
    }

    /// A Redis Sentinel (`redis-sentinel`) watching the primary on `primary_port` under
    /// the name `master`: it calls the primary down after 2 s without an answer, and
    /// `quorum` sentinels must agree.
    pub fn sentinel(primary_port: u16, master: &str, quorum: u8) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-sentinel-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Sentinel rewrites its configuration file as it learns: it must be its own.
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {master} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {master} 2000\n\
                 sentinel failover-timeout {master} 4000\n\
                 sentinel parallel-syncs {master} 1\n",
                dir = dir.display()
            ),
        )
        .unwrap();
        let child = Command::new(binary("redis-sentinel"))
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-sentinel starts");
        Self { port, child, dir }.answering("redis-sentinel")
    }

    /// This process, once it answers PING (within 10 s, or the test fails).
    fn answering(self, what: &str) -> Self {
        let deadline = Instant::now() + Duration::from_secs(10);
        while cli(self.port, &["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "{what} on port {} did not answer PING",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self
    }

    /// Sends the process `signal` (`STOP` freezes it: its connections stay open and its
    /// kernel still accepts new ones, but nothing answers; `CONT` wakes it).
    /// (The shell's own `kill`: a minimal image may have no `/bin/kill`, which is
    /// `procps`'s, and nothing the suite installs brings it.)
    pub fn signal(&self, signal: &str) {
        let status = Command::new("sh")
            .args([
                "-c",
                "kill -s \"$0\" \"$1\"",
                signal,
                &self.child.id().to_string(),
            ])
            .status()
            .expect("sh runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of `masters` nodes, slots spread by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize) -> Self {
        Self::start_with_replicas(masters, 0, 5000)
    }

    /// `masters` primaries with `replicas` replicas each; a node is called failed after
    /// `node_timeout_ms` without an answer.
    pub fn start_with_replicas(masters: usize, replicas: usize, node_timeout_ms: u32) -> Self {
        let timeout = node_timeout_ms.to_string();
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    &timeout,
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let out = Command::new(binary("redis-cli"))
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create runs");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        // Each wait has a deadline of its own, generous: a loaded machine (the suite runs
        // many clusters at once beside a build) is slow, never stuck for a minute.
        let deadline = Instant::now() + Duration::from_secs(60);
        for node in &nodes {
            loop {
                let info = node.cli(&["CLUSTER", "INFO"]);
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster did not reach state ok: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Every replica has its copy: a failover has something to promote.
        let deadline = Instant::now() + Duration::from_secs(60);
        for node in &nodes {
            loop {
                let replication = node.cli(&["INFO", "replication"]);
                if replication.contains("role:master")
                    || replication.contains("master_link_status:up")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "a replica did not sync: {replication}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Every key on every node, with its TTL in milliseconds.
    pub fn keys_with_ttl(&self) -> Vec<(String, i64)> {
        self.nodes.iter().flat_map(keys_with_ttl).collect()
    }
}

/// The number after `name` (`calls=`, `usec=`...) in one line of `INFO commandstats`.
fn stat(line: &str, name: &str) -> u64 {
    line.split([':', ','])
        .find_map(|field| field.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

/// How many times `server` ran `command` (lower case) and it succeeded, from `INFO
/// commandstats` (0 when it never ran).
pub fn command_calls(server: &RedisServer, command: &str) -> u64 {
    command_stat(server, command, |line| {
        stat(line, "calls=").saturating_sub(stat(line, "failed_calls="))
    })
}

/// How many times `server` was sent `command` (lower case), refused or not, from `INFO
/// commandstats` (0 when it never was).
pub fn command_sent(server: &RedisServer, command: &str) -> u64 {
    command_stat(server, command, |line| {
        stat(line, "calls=") + stat(line, "rejected_calls=")
    })
}

/// `read` of `command`'s line of `INFO commandstats` (0 when there is none).
fn command_stat(server: &RedisServer, command: &str, read: impl Fn(&str) -> u64) -> u64 {
    let stats = commandstats(server);
    stats
        .lines()
        .find(|line| line.starts_with(&format!("cmdstat_{command}:")))
        .map_or(0, read)
}

/// `calls` and `usec` of every script command (`EVALSHA`, `EVAL`, `FCALL`) in `INFO
/// commandstats`.
pub fn script_stats(server: &RedisServer) -> (u64, u64) {
    let stats = commandstats(server);
    stats
        .lines()
        .filter(|line| {
            ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_fcall:"]
                .iter()
                .any(|name| line.starts_with(name))
        })
        .fold((0, 0), |(calls, usec), line| {
            (calls + stat(line, "calls="), usec + stat(line, "usec="))
        })
}

/// Every key on `server`, with its TTL in milliseconds (-1: none; -2: gone since the scan).
/// A reply that is not a number fails the test.
pub fn keys_with_ttl(server: &RedisServer) -> Vec<(String, i64)> {
    cli_checked(server.port, &["--scan"])
        .lines()
        .filter(|key| !key.is_empty())
        .map(|key| {
            let reply = server.cli(&["PTTL", key]);
            let ttl = reply
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("PTTL {key}: expected a number, got {reply:?}"));
            (key.to_owned(), ttl)
        })
        .collect()
}

/// A store that fails while `down` is set, and otherwise decides in memory: for the
/// failure-mode, metrics and tracing tests.
#[derive(Clone)]
pub struct Flaky {
    pub inner: tollgate::MemoryStore,
    pub down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Flaky {
    /// An in-process store that answers, and the switch that takes it down.
    pub fn new() -> (Self, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let store = Flaky {
            inner: tollgate::MemoryStore::new(),
            down: std::sync::Arc::clone(&down),
        };
        (store, down)
    }
}

impl tollgate::Store for Flaky {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
                tollgate::StoreErrorKind::Unavailable,
                "down",
            )));
        }
        self.inner.decide(key, policies, cost)
    }
}

/// A store that decides through `S`, and whose `peek` never answers.
#[derive(Clone)]
pub struct PeekHangs<S>(pub S);

impl<S: tollgate::Store> tollgate::Store for PeekHangs<S> {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn peek(&self, _: &tollgate::Key, _: &tollgate::PolicySet) -> tollgate::DecideFuture {
        tollgate::DecideFuture::new(std::future::pending())
    }
}

/// A [`Flaky`] store that also adjusts (settles, gives lease rests back), failing as its
/// decisions do while it is down: what `Leased` needs of the store under it.
pub struct FlakyAdjusting(pub Flaky);

impl tollgate::Store for FlakyAdjusting {
    fn decide(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        cost: u64,
    ) -> tollgate::DecideFuture {
        self.0.decide(key, policies, cost)
    }

    fn can_adjust(&self) -> bool {
        true
    }

    fn adjust(
        &self,
        key: &tollgate::Key,
        policies: &tollgate::PolicySet,
        adjustment: &tollgate::store::Adjustment,
    ) -> tollgate::DecideFuture {
        if self.0.down.load(std::sync::atomic::Ordering::SeqCst) {
            return tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
                tollgate::StoreErrorKind::Unavailable,
                "down",
            )));
        }
        self.0.inner.adjust(key, policies, adjustment)
    }
}

/// `MONITOR` on one server, by a `redis-cli` process: every command the server runs from
/// now on, as `redis-cli` prints it (`<time> [<db> <client address>] "COMMAND" "arg"...`),
/// in the order the server ran them. Stopped on drop.
pub struct Monitor {
    child: Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Monitor {
    /// Attached once `redis-cli` has printed the server's `OK` (within 10 s).
    pub fn start(server: &RedisServer) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(binary("redis-cli"))
            .args(["-h", "127.0.0.1", "-p", &server.port.to_string(), "MONITOR"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-cli MONITOR runs");
        let stdout = child.stdout.take().unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (attached, attached_rx) = std::sync::mpsc::channel();
        let sink = std::sync::Arc::clone(&lines);
        std::thread::spawn(move || {
            let mut reader = std::io::BufReader::new(stdout).lines();
            if let Some(Ok(first)) = reader.next() {
                let _ = attached.send(first);
            }
            for line in reader.map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        // Owned from here: a failed start stops its `redis-cli` too.
        let monitor = Self { child, lines };
        let first = attached_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("MONITOR attached within 10 s");
        assert_eq!(first.trim(), "OK", "MONITOR answered {first:?}");
        monitor
    }

    /// The lines seen so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Every line of the commands `server` ran before this call: a marker (`ECHO`) is
    /// sent, and the lines are read once the monitor printed it (MONITOR prints in the
    /// order the server ran), within 10 s. `lines` alone may miss the last ones on a
    /// busy machine, where the reading thread runs late.
    pub fn lines_through(&self, server: &RedisServer) -> Vec<String> {
        static MARKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mark = format!(
            "monitor-mark-{}",
            MARKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        server.cli(&["ECHO", &mark]);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let lines = self.lines();
            if lines.iter().any(|line| line.contains(&mark)) {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "MONITOR did not print {mark} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `total_connections_received` of `INFO stats`: every connection the server accepted,
/// through `password` when it asks for one.
pub fn connections_received(server: &RedisServer, password: Option<&str>) -> u64 {
    let mut args = vec!["--no-auth-warning"];
    if let Some(password) = password {
        args.extend(["-a", password]);
    }
    args.extend(["INFO", "stats"]);
    server
        .cli(&args)
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("a count of connections")
}

/// `blocked_clients` of `INFO clients`: clients waiting, a command held by `CLIENT PAUSE`
/// among them.
pub fn blocked_clients(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "clients"])
        .lines()
        .find_map(|line| line.strip_prefix("blocked_clients:")?.trim().parse().ok())
        .expect("INFO clients has blocked_clients")
}

/// A `deadpool_redis` pool on `server` and a cluster pool on `cluster`, as an app that
/// runs its own pools builds them (for `RedisStore::from_pool`, `from_cluster_pool`).
/// Idle connections are handed out first in, first out (deadpool's default, said here
/// because a test counts on it).
#[cfg(feature = "redis")]
pub fn pools(
    server: &RedisServer,
    cluster: &RedisCluster,
) -> (deadpool_redis::Pool, deadpool_redis::cluster::Pool) {
    let fifo = deadpool_redis::PoolConfig {
        queue_mode: deadpool_redis::QueueMode::Fifo,
        ..deadpool_redis::PoolConfig::default()
    };
    let mut config = deadpool_redis::Config::from_url(server.url());
    config.pool = Some(fifo);
    let pool = config
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool on the server");
    let mut config = deadpool_redis::cluster::Config::from_urls(cluster.urls());
    config.pool = Some(fifo);
    let cluster_pool = config
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .expect("a pool on the cluster");
    (pool, cluster_pool)
}

/// A store on `server` whose scripts see time stand still (a manual clock at 0): no
/// window a test uses ends during it, wherever the wall clock is.
#[cfg(all(feature = "redis", feature = "__test-clock"))]
pub async fn frozen_store(server: &RedisServer) -> tollgate::store::RedisStore {
    tollgate::store::RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_clock(tollgate::clock::ManualClock::new())
}

/// A stand-in for a sentinel, on a free loopback port, for what real sentinels will not
/// do on cue: it answers `SENTINEL get-master-addr-by-name` with `127.0.0.1:names` (a
/// sentinel cut off from the servers, still naming the primary it knew), `AUTH` with a
/// refusal when `refuse_auth` (a sentinel whose password was rotated), `HELLO` with an
/// unknown command, and anything else with `+OK`. It counts the questions about the
/// primary. Stopped on drop.
pub struct FakeSentinel {
    pub port: u16,
    names: std::sync::Arc<std::sync::atomic::AtomicU16>,
    asked: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _listening: Listening,
}

impl FakeSentinel {
    pub fn start(names: u16, refuse_auth: bool) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU16, AtomicU64};
        let asked = Arc::new(AtomicU64::new(0));
        let names = Arc::new(AtomicU16::new(names));
        let (counted, named) = (Arc::clone(&asked), Arc::clone(&names));
        let listening = Listening::start(move |client| {
            let (counted, named) = (Arc::clone(&counted), Arc::clone(&named));
            std::thread::spawn(move || serve_fake_sentinel(client, &named, refuse_auth, &counted));
        });
        Self {
            port: listening.port,
            names,
            asked,
            _listening: listening,
        }
    }

    /// From now on it names `127.0.0.1:port` (a failover it saw).
    pub fn name(&self, port: u16) {
        self.names.store(port, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on it knows no primary by the name asked (`SENTINEL REMOVE`, or a
    /// sentinel redeployed monitoring it by another name): it answers nil.
    #[allow(dead_code)] // Not every test binary that builds the support module uses it.
    pub fn forget(&self) {
        self.names.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its URL with a password.
    pub fn url_with_password(&self, password: &str) -> String {
        format!("redis://:{password}@127.0.0.1:{}", self.port)
    }

    /// How many times it was asked for the primary.
    pub fn asked(&self) -> u64 {
        self.asked.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A listener on a free loopback port whose thread hands each connection to `take`,
/// until it is dropped.
struct Listening {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Listening {
    fn start(mut take: impl FnMut(std::net::TcpStream) + Send + 'static) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(client) = client {
                    take(client);
                }
            }
        });
        Self { port, stop }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accepting thread, which then stops.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Answers one client of a [`FakeSentinel`] until it goes (or sends what is no command).
fn serve_fake_sentinel(
    client: std::net::TcpStream,
    names: &std::sync::atomic::AtomicU16,
    refuse_auth: bool,
    asked: &std::sync::atomic::AtomicU64,
) {
    use std::io::{BufRead, BufReader, Read, Write};
    let _ = client.set_read_timeout(Some(Duration::from_secs(60)));
    let mut writer = match client.try_clone() {
        Ok(writer) => writer,
        Err(_) => return,
    };
    let mut reader = BufReader::new(client);
    // The number after `mark` on the next line (`*2`, `$8`); `None` at the end or on
    // what is no command.
    let number = |reader: &mut BufReader<std::net::TcpStream>, mark: char| {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        line.trim_end().strip_prefix(mark)?.parse::<usize>().ok()
    };
    loop {
        let Some(count) = number(&mut reader, '*') else {
            return;
        };
        let mut words = Vec::with_capacity(count);
        for _ in 0..count {
            let Some(length) = number(&mut reader, '$') else {
                return;
            };
            let mut word = vec![0; length + 2];
            if reader.read_exact(&mut word).is_err() {
                return;
            }
            word.truncate(length);
            words.push(String::from_utf8_lossy(&word).to_uppercase());
        }
        let reply = match words.first().map(String::as_str) {
            Some("AUTH") if refuse_auth => {
                "-WRONGPASS invalid username-password pair or user is disabled.\r\n".to_owned()
            }
            Some("HELLO") => "-ERR unknown command 'HELLO'\r\n".to_owned(),
            Some("SENTINEL") => {
                asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                match names.load(std::sync::atomic::Ordering::SeqCst) {
                    0 => "*-1\r\n".to_owned(),
                    port => {
                        let port = port.to_string();
                        format!("*2\r\n$9\r\n127.0.0.1\r\n${}\r\n{port}\r\n", port.len())
                    }
                }
            }
            _ => "+OK\r\n".to_owned(),
        };
        if writer.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// A server on a free loopback port that takes connections and answers nothing (a host
/// black-holed past its listener, a process frozen): it counts the connections. Stopped
/// on drop.
pub struct SilentServer {
    pub port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _listening: Listening,
}

impl SilentServer {
    pub fn start() -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&accepted);
        let mut held = Vec::new();
        let listening = Listening::start(move |client| {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(client);
        });
        Self {
            port: listening.port,
            accepted,
            _listening: listening,
        }
    }

    /// How many connections it took.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}
