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
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

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
    /// new connection's driver down with it).
    runtime: Option<tokio::runtime::Handle>,
    /// Calls left unanswered since the last check.
    unanswered: AtomicU32,
    /// A check runs (or waits out the time until the next may).
    checking: AtomicBool,
    /// The wait after this check, in milliseconds.
    every_ms: AtomicU64,
    /// A node that answers nothing was said (at warn level): said again only once a
    /// check found its node answering.
    said_stall: AtomicBool,
}

impl ManagedCluster {
    pub(super) fn new(client: ClusterClient, connection: ClusterConnection) -> Self {
        Self {
            client,
            current: std::sync::RwLock::new(connection),
            runtime: tokio::runtime::Handle::try_current().ok(),
            unanswered: AtomicU32::new(0),
            checking: AtomicBool::new(false),
            every_ms: AtomicU64::new(CHECK_EVERY.as_millis() as u64),
            said_stall: AtomicBool::new(false),
        }
    }

    /// The current connection.
    pub(super) fn connection(&self) -> ClusterConnection {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// `command`, about to be sent: unless [`Asked::answered`] says it was answered, the
    /// node that owns its slot is checked.
    pub(super) fn ask<'a>(self: &'a Arc<Self>, command: &redis::Cmd) -> Asked<'a> {
        Asked {
            managed: self,
            route: first_key(command).map(|key| Route::with_key(key, SlotAddr::Master)),
            answered: false,
        }
    }

    /// A call to `route`'s slot went unanswered: after [`UNANSWERED`] of them since the
    /// last check, the primary of its slot is asked for a `PING` in the background, and
    /// the connection is made anew when it answers nothing in time. One check at a time,
    /// at most one per [`CHECK_EVERY`] (longer while new connections do not help); none
    /// without a Tokio runtime.
    #[cold]
    fn unanswered(self: &Arc<Self>, route: Route) {
        if self.unanswered.fetch_add(1, Ordering::Relaxed) + 1 < UNANSWERED {
            return;
        }
        let runtime = match &self.runtime {
            Some(runtime) => runtime.clone(),
            None => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => runtime,
                Err(_) => return,
            },
        };
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        self.unanswered.store(0, Ordering::Relaxed);
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
            let mut connection = this.connection();
            let ping = connection.route_command(
                redis::cmd("PING"),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
            );
            let every = match tokio::time::timeout(PING_DEADLINE, ping).await {
                // An answer, even an error (`BUSY` in a long script): the node is there.
                Ok(Ok(_)) => this.answers(),
                Ok(Err(error)) if !silent(&error) => this.answers(),
                _ => {
                    this.said_stalled();
                    this.replace().await;
                    // Checked again after twice as long, unless a check finds it answering.
                    let every = this.every_ms.load(Ordering::Relaxed);
                    let longer = (every * 2).min(CHECK_AT_MOST_EVERY.as_millis() as u64);
                    this.every_ms.store(longer, Ordering::Relaxed);
                    every
                }
            };
            tokio::time::sleep_until(started + Duration::from_millis(every)).await;
            drop(done);
        });
    }

    /// Said once at warn level, then at debug level until a check finds its node
    /// answering.
    #[cold]
    fn said_stalled(&self) {
        let said = self.said_stall.swap(true, Ordering::Relaxed);
        #[cfg(feature = "tracing")]
        if said {
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
                 from the nodes that answer (said once until calls are answered again)"
            );
        }
        #[cfg(not(feature = "tracing"))]
        let _ = said;
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

    /// A check found its node answering: the next checks come at the shortest interval,
    /// and a stall said is said to be over. The interval to wait after this check.
    #[cold]
    fn answers(&self) -> u64 {
        let every = CHECK_EVERY.as_millis() as u64;
        self.every_ms.store(every, Ordering::Relaxed);
        if self.said_stall.swap(false, Ordering::Relaxed) {
            #[cfg(feature = "tracing")]
            tracing::info!(target: "tollgate", "the Redis Cluster node checked answers again");
        }
        every
    }
}

/// A call timed out, or its connection fails silently: no sign the node is there.
fn silent(error: &RedisError) -> bool {
    error.is_timeout() || error.is_io_error()
}

/// One call on a [`ManagedCluster`]: its slot's node is checked unless it was answered
/// (a call dropped while it waits, by the layer's timeout, was not).
pub(super) struct Asked<'a> {
    managed: &'a Arc<ManagedCluster>,
    route: Option<Route>,
    answered: bool,
}

impl Asked<'_> {
    /// The call's answer (an error the node sent is one; a timeout is none).
    pub(super) fn answered<T>(mut self, answer: &Result<T, RedisError>) {
        self.answered = !answer.as_ref().is_err_and(RedisError::is_timeout);
    }
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        if !self.answered
            && let Some(route) = self.route
        {
            self.managed.unanswered(route);
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
        load.arg("LOAD").arg("REPLACE").arg("#!lua name=x");
        assert_eq!(first_key(&load), None);
    }
}
