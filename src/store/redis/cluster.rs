//! The connection to a Redis Cluster, made anew when a node stops answering without a
//! reset.
//!
//! The Cluster client learns the topology again only from a `MOVED` or a broken
//! connection. A primary frozen (its process stopped) or cut off (its host gone without a
//! reset) gives neither: its calls time out, the client sends them to it again, and the
//! replica the Cluster promoted in its place is never asked. Calls left unanswered have
//! the node that owns their slot asked for a `PING`; a node that answers nothing has the
//! connection made anew, which reads the slot map from the nodes that answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use redis::RedisError;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};

/// How long the node that owns an unanswered call's slot has to answer a `PING`.
const PING_DEADLINE: Duration = Duration::from_secs(1);

/// How long a new connection (every node's handshake, then the slot map) may take.
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

/// At most one check (and so one new connection) this often, while checks find every
/// node answering; after a new connection that did not help (the node still answers
/// nothing: the Cluster has not promoted its replica yet, or it has none), twice as long
/// each time, up to [`CHECK_AT_MOST_EVERY`].
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The longest wait between checks of a node that keeps answering nothing.
const CHECK_AT_MOST_EVERY: Duration = Duration::from_secs(8);

/// A node found answering nothing this long after the last one is a new stall: said at
/// warn level again, and checked from the shortest interval again.
const NEW_STALL_AFTER: Duration = Duration::from_secs(60);

/// Calls left unanswered since the last check before the next is made: one call dropped
/// by a tight timeout on a loaded node is no sign the node is gone.
const UNANSWERED: u32 = 3;

/// A Cluster connection, replaced when the node that owns an unanswered call's slot
/// answers no `PING` within [`PING_DEADLINE`].
pub(super) struct ManagedCluster {
    client: ClusterClient,
    current: std::sync::RwLock<ClusterConnection>,
    /// The runtime the store connected on: checks and new connections run there, not
    /// on whatever runtime a dropped call was polled on (a short-lived one would take a
    /// new connection's driver down with it); the store's own instead, once started
    /// (see [`driver_gone`](Self::driver_gone)).
    runtime: Option<tokio::runtime::Handle>,
    /// When a call that found the driver gone last had a new connection made, in
    /// milliseconds since `born` plus one (0: never). See [`driver_gone`](Self::driver_gone).
    renewed_at: AtomicU64,
    /// The driver was found gone before: said at warn level once, then at debug level.
    said_gone: AtomicBool,
    /// Calls left unanswered since the last check.
    unanswered: AtomicU32,
    /// A check runs (or waits out the time until the next may).
    checking: AtomicBool,
    /// The store's own runtime (see [`own_runtime`](Self::own_runtime)), and what stops
    /// it when the store is dropped.
    own: std::sync::Mutex<Option<(tokio::runtime::Handle, tokio::sync::oneshot::Sender<()>)>>,
    /// The wait after the last check that found a node answering nothing, in
    /// milliseconds. A check that finds its node answering does not shorten it: the node
    /// checked may be another shard's (a call dropped by its client), while the stalled
    /// one still stalls.
    every_ms: AtomicU64,
    /// When a check last found a node answering nothing, in milliseconds since `born`
    /// plus one (0: never, or the stall ended).
    stalled_at: AtomicU64,
    born: std::time::Instant,
    /// The slot whose check last found its node answering nothing, until a check of that
    /// slot finds it answering, which ends the stall (one of another slot, another
    /// shard's, may not).
    stalled_slot: std::sync::Mutex<Option<Slot>>,
    /// The slots of the calls left unanswered since the last check began (the latest
    /// [`CHECKED_AT_MOST`], each once): the next check asks each one's node. Asking only
    /// the last one's let calls dropped by their clients on a sound shard hide a frozen
    /// one, for as long as a check happened to follow one of those.
    slots: std::sync::Mutex<Vec<Slot>>,
}

/// The most slots one check asks about.
const CHECKED_AT_MOST: usize = 4;

impl ManagedCluster {
    pub(super) fn new(client: ClusterClient, connection: ClusterConnection) -> Self {
        Self {
            client,
            current: std::sync::RwLock::new(connection),
            runtime: tokio::runtime::Handle::try_current().ok(),
            renewed_at: AtomicU64::new(0),
            said_gone: AtomicBool::new(false),
            own: std::sync::Mutex::new(None),
            unanswered: AtomicU32::new(0),
            checking: AtomicBool::new(false),
            every_ms: AtomicU64::new(CHECK_EVERY.as_millis() as u64),
            stalled_at: AtomicU64::new(0),
            born: std::time::Instant::now(),
            stalled_slot: std::sync::Mutex::new(None),
            slots: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The current connection.
    pub(super) fn connection(&self) -> ClusterConnection {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sends `command` on `connection` (the current one, or one a decision pinned): a
    /// call not answered (timed out, or dropped while it waits) counts toward a check
    /// (see [`unanswered`](Self::unanswered)).
    pub(super) async fn query<T: redis::FromRedisValue>(
        self: &Arc<Self>,
        command: &redis::Cmd,
        mut connection: ClusterConnection,
    ) -> Result<T, RedisError> {
        let mut asked = Asked {
            managed: self,
            command,
            answered: false,
        };
        let answer = command.query_async(&mut connection).await;
        // An error the node sent is an answer; a timeout is none.
        asked.answered = !answer.as_ref().is_err_and(RedisError::is_timeout);
        if answer.as_ref().is_err_and(driver_gone) {
            self.driver_gone();
        }
        answer
    }

    /// A call found the connection's driver gone: its task ended with the runtime it ran
    /// on (a start-up runtime the store connected on, say), and every call on it fails
    /// at once, for good. A new connection is made on a runtime of the store's own (a
    /// thread started the first time this happens, which lives as long as the store):
    /// made on the caller's, its driver would run only while that runtime does, and a
    /// job's current-thread runtime idles between its `block_on`s. Checks run there from
    /// then on. At most one per [`CHECK_EVERY`], each bounded by [`CONNECT_DEADLINE`].
    #[cold]
    fn driver_gone(self: &Arc<Self>) {
        let now = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1;
        let last = self.renewed_at.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < CHECK_EVERY.as_millis() as u64 {
            return;
        }
        if self
            .renewed_at
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let Some(runtime) = self.own_runtime() else {
            return;
        };
        let said = self.said_gone.swap(true, Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        if said {
            tracing::debug!(
                target: "tollgate",
                "the Redis Cluster connection's driver is gone: connecting anew"
            );
        } else {
            tracing::warn!(
                target: "tollgate",
                "the Redis Cluster connection's driver is gone (the runtime it ran on \
                 ended): connecting to the Cluster anew on a runtime of the store's own \
                 (said once; again at debug level)"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = said;
        let this = Arc::clone(self);
        runtime.spawn(async move { this.replace().await });
    }

    /// The store's own runtime if it was started (see [`own_runtime`](Self::own_runtime)).
    fn started_runtime(&self) -> Option<tokio::runtime::Handle> {
        let own = self
            .own
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        own.as_ref().map(|(handle, _)| handle.clone())
    }

    /// The store's own runtime: a thread that drives the connections made for a driver
    /// that was gone, started once, and stopped when the store is dropped. `None` when
    /// the thread or its runtime could not be made (tried again next time).
    fn own_runtime(&self) -> Option<tokio::runtime::Handle> {
        let mut own = self
            .own
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((handle, _)) = &*own {
            return Some(handle.clone());
        }
        let (handed, handle) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let started = std::thread::Builder::new()
            .name("tollgate-redis-cluster".to_owned())
            .spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                if handed.send(runtime.handle().clone()).is_err() {
                    return;
                }
                // Drives the connections' tasks until the store is dropped.
                runtime.block_on(async move {
                    let _ = stopped.await;
                });
            });
        if started.is_err() {
            return None;
        }
        let handle = handle.recv().ok()?;
        *own = Some((handle.clone(), stop));
        Some(handle)
    }

    /// A call to `slot` went unanswered: after [`UNANSWERED`] of them since the last
    /// check, the primaries of their slots (the latest few) are each asked for a `PING`
    /// in the background, and the connection is made anew when one answers nothing in
    /// time. One check at a time, at most one per [`CHECK_EVERY`] (longer while new
    /// connections do not help); none without a Tokio runtime.
    #[cold]
    fn unanswered(self: &Arc<Self>, slot: Slot) {
        {
            let mut slots = self
                .slots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slots.retain(|seen| *seen != slot);
            if slots.len() == CHECKED_AT_MOST {
                slots.remove(0);
            }
            slots.push(slot);
        }
        if self.unanswered.fetch_add(1, Ordering::Relaxed) + 1 < UNANSWERED {
            return;
        }
        let runtime = self.started_runtime().or_else(|| self.runtime.clone());
        let runtime = match runtime {
            Some(runtime) => runtime,
            None => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => runtime,
                Err(_) => return,
            },
        };
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        self.unanswered.store(0, Ordering::Relaxed);
        let slots = std::mem::take(
            &mut *self
                .slots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        /// Lets the next check go however this one ends (a runtime shutting down drops it).
        struct Done(Arc<ManagedCluster>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.checking.store(false, Ordering::Release);
            }
        }
        let done = Done(Arc::clone(self));
        runtime.spawn(async move {
            let this = &done.0;
            let started = tokio::time::Instant::now();
            let connection = this.connection();
            let pings = slots.iter().map(|&slot| {
                let mut connection = connection.clone();
                async move {
                    let route = Route::with_slot(slot, SlotAddr::Master);
                    let ping = connection.route_command(
                        redis::cmd("PING"),
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    );
                    let answered = match tokio::time::timeout(PING_DEADLINE, ping).await {
                        // An answer, even an error (`BUSY` in a long script): the node is
                        // there.
                        Ok(Ok(_)) => true,
                        Ok(Err(error)) => !silent(&error),
                        Err(_) => false,
                    };
                    (slot, answered)
                }
            });
            let answers = futures_util::future::join_all(pings).await;
            // The slots whose nodes answer first: one that ends a stall says so before a
            // stall found on another is said.
            let mut every = CHECK_EVERY;
            for &(slot, _) in answers.iter().filter(|(_, answered)| *answered) {
                this.answers(slot);
            }
            // The stall's own slot when it is still silent (the one whose answer ends
            // the stall stays put), else the first silent one.
            let stalled_slot = *this
                .stalled_slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let silent = answers.iter().filter(|(_, answered)| !answered);
            let stalled = silent
                .clone()
                .find(|(slot, _)| Some(*slot) == stalled_slot)
                .or_else(|| silent.clone().next());
            if let Some(&(slot, _)) = stalled {
                every = this.stalled(slot);
                this.replace().await;
            }
            tokio::time::sleep_until(started + every).await;
            drop(done);
        });
    }

    /// A check found its node answering nothing: said at warn level when it is a new
    /// stall (none for [`NEW_STALL_AFTER`]), at debug level while it goes on. The wait
    /// until the next check: the shortest for a new stall, else twice the last (a new
    /// connection did not help: the Cluster has not promoted a replica yet, or has none).
    #[cold]
    fn stalled(&self, slot: Slot) -> Duration {
        *self
            .stalled_slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(slot);
        let now = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1;
        let last = self.stalled_at.swap(now, Ordering::Relaxed);
        let new = last == 0 || now - last > NEW_STALL_AFTER.as_millis() as u64;
        let every = if new {
            CHECK_EVERY.as_millis() as u64
        } else {
            (self.every_ms.load(Ordering::Relaxed) * 2).min(CHECK_AT_MOST_EVERY.as_millis() as u64)
        };
        self.every_ms.store(every, Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        if !new {
            tracing::debug!(
                target: "tollgate",
                "a Redis Cluster node answers nothing, not even a PING within \
                 {PING_DEADLINE:?}: connecting to the Cluster anew"
            );
        } else {
            tracing::warn!(
                target: "tollgate",
                "a Redis Cluster node answers nothing, not even a PING within \
                 {PING_DEADLINE:?}: connecting to the Cluster anew, to read its slot map \
                 from the nodes that answer (while it goes on, said at debug level)"
            );
        }
        Duration::from_millis(every)
    }

    /// A new connection in the current one's place. Calls meanwhile go on the old one,
    /// and those sent there finish there (each holds its connection).
    async fn replace(&self) {
        match tokio::time::timeout(CONNECT_DEADLINE, self.client.get_async_connection()).await {
            Ok(Ok(connection)) => {
                *self
                    .current
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = connection;
            }
            // The next unanswered call tries again.
            Ok(Err(error)) => {
                #[cfg(feature = "tracing")]
                tracing::debug!(target: "tollgate", %error, "no new connection to the Redis Cluster");
                let _ = error;
            }
            Err(_) => {
                #[cfg(feature = "tracing")]
                tracing::debug!(
                    target: "tollgate",
                    "no new connection to the Redis Cluster within {CONNECT_DEADLINE:?}"
                );
            }
        }
    }

    /// A check found the node of `slot` answering. When that is the slot of the stall, the
    /// stall is over: said at info level, and the next is a new one (said at warn level,
    /// checked from the shortest interval). A check of another slot, which
    /// may be another shard's (for a call its client dropped), ends nothing.
    #[cold]
    fn answers(&self, slot: Slot) {
        let mut stalled = self
            .stalled_slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *stalled == Some(slot) {
            *stalled = None;
            self.stalled_at.store(0, Ordering::Relaxed);
            self.every_ms
                .store(CHECK_EVERY.as_millis() as u64, Ordering::Relaxed);
            #[cfg(feature = "tracing")]
            tracing::info!(target: "tollgate", "the Redis Cluster node that stalled answers again");
        }
    }
}

/// The error of a call on a connection whose driver task is gone: the Cluster client
/// could not hand it the call, or the driver dropped it unanswered (redis-rs says so in
/// a broken-pipe I/O error of its own).
fn driver_gone(error: &RedisError) -> bool {
    error.is_connection_dropped() && {
        let said = error.to_string();
        said.starts_with("redis_cluster: Unable to send command")
            || said.starts_with("redis_cluster: Unable to receive command")
    }
}

/// A call timed out, or its connection fails silently: no sign the node is there.
fn silent(error: &RedisError) -> bool {
    error.is_timeout() || error.is_io_error()
}

/// One call on a [`ManagedCluster`]: unless it was answered (a call dropped while it
/// waits, by the layer's timeout, was not), it counts toward a check of its slot's node.
struct Asked<'a> {
    managed: &'a Arc<ManagedCluster>,
    command: &'a redis::Cmd,
    answered: bool,
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        // The route is worked out for unanswered calls alone (a CRC of the key).
        if !self.answered
            && let Some(key) = first_key(self.command)
        {
            self.managed.unanswered(Slot::for_key(key));
        }
    }
}

/// The first key of `command`, which routes it: the fourth argument of a script or
/// function call (after its name or digest and the number of keys), the second of `DEL`
/// and `ZREM`; none for the store's other commands (`FUNCTION LOAD` goes to every
/// primary).
fn first_key(command: &redis::Cmd) -> Option<&[u8]> {
    let mut args = command.args_iter().map(|arg| match arg {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next()??;
    let scripted = [
        &b"FCALL"[..],
        b"FCALL_RO",
        b"EVALSHA",
        b"EVALSHA_RO",
        b"EVAL",
        b"EVAL_RO",
    ]
    .iter()
    .any(|known| name.eq_ignore_ascii_case(known));
    if scripted {
        let _script = args.next()?;
        let keys = args.next()??;
        if keys == b"0" {
            return None;
        }
        args.next()?
    } else if name.eq_ignore_ascii_case(b"DEL") || name.eq_ignore_ascii_case(b"ZREM") {
        args.next()?
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_routed_by_its_first_key() {
        let mut fcall = redis::cmd("FCALL");
        fcall.arg("tollgate_decide").arg(2).arg("k{a}").arg("x{a}");
        assert_eq!(first_key(&fcall), Some(&b"k{a}"[..]));
        let mut evalsha = redis::cmd("evalsha");
        evalsha.arg("abc").arg(1).arg("k{b}").arg("1");
        assert_eq!(first_key(&evalsha), Some(&b"k{b}"[..]));
        let mut none = redis::cmd("EVAL");
        none.arg("return 1").arg(0);
        assert_eq!(first_key(&none), None);
        let mut del = redis::cmd("DEL");
        del.arg("k{c}");
        assert_eq!(first_key(&del), Some(&b"k{c}"[..]));
        assert_eq!(first_key(&redis::cmd("PING")), None);
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg("#!lua name=x");
        assert_eq!(first_key(&load), None);
    }
}
