//! Confirm's Redis path: the script and `WAIT` over one dedicated connection
//! to the slot's master.
//!
//! `WAIT` blocks the connection it is sent on and counts only that
//! connection's writes, so the sale and its `WAIT` must share a connection
//! that no other request uses meanwhile: never the shared multiplexed ones.
//! At most [`PER_MASTER`] dedicated connections are open to one master (a
//! burst of confirms waits for one instead of opening hundreds); idle ones
//! are kept for the next confirm.
//!
//! A slot that moves is followed within the request's deadline: `MOVED` to
//! the new owner it names (the background probe refreshes the slot map,
//! never the request), `ASK` to the importing node with `ASKING`, and
//! `TRYAGAIN`, `CLUSTERDOWN`, `LOADING` after a short pause.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::deadline::Deadline;
use super::fault::{classify, RedisFault, Retry};
use super::{later_pause, Cluster};
use crate::error::Error;
use crate::scripts::Script;

/// Most dedicated connections open to one master, idle and in use.
pub const PER_MASTER: usize = 32;

/// Idle connections kept to one master.
const IDLE_PER_MASTER: usize = 16;

/// Redirects (`MOVED`, `ASK`, `READONLY`) followed by one confirm before
/// it gives up; `TRYAGAIN` and the like are retried until the deadline.
const MAX_REDIRECTS: u32 = 5;

/// Time a `WAIT` leaves of the request's deadline for its answer to come
/// back: a `WAIT` cut off by the deadline answered a sale that happened
/// with 503 `redis_unavailable` instead of `not_replicated`. Redis ends a
/// blocked command's timeout on its cron, every 1000/`hz` ms (100 ms at
/// cluster/redis.conf's `hz 10`), so a `WAIT` may outlast its timeout by
/// that much.
const WAIT_MARGIN: Duration = Duration::from_millis(150);

/// A dedicated connection, counted against its master's limit while alive.
struct Dedicated {
    conn: MultiplexedConnection,
    _permit: OwnedSemaphorePermit,
    /// Taken idle from the pool: the server may have closed it meanwhile
    /// (its `timeout`, a restart, `CLIENT KILL`).
    reused: bool,
}

/// What the pool hands out: an idle connection, or leave to open one.
enum Idle {
    Conn(Dedicated),
    Permit(OwnedSemaphorePermit),
}

/// One master's share of the pool.
struct Master {
    limit: Arc<Semaphore>,
    idle: Vec<Dedicated>,
    /// Told when a connection goes back to `idle`: an idle connection keeps
    /// its permit, so a request waiting for one learns of it only here.
    returned: Arc<tokio::sync::Notify>,
}

/// Dedicated connections, per master `host:port`.
#[derive(Default)]
pub(super) struct Pool(Mutex<HashMap<String, Master>>);

impl Pool {
    /// An idle connection to `addr`, or the permit to open one (waiting
    /// while `PER_MASTER` are open).
    async fn take(&self, addr: &str) -> Result<Idle, Error> {
        loop {
            let (limit, returned) = {
                let mut pool = self.lock();
                let master = pool.entry(addr.to_owned()).or_insert_with(|| Master {
                    limit: Arc::new(Semaphore::new(PER_MASTER)),
                    idle: Vec::new(),
                    returned: Arc::new(tokio::sync::Notify::new()),
                });
                if let Some(mut idle) = master.idle.pop() {
                    idle.reused = true;
                    return Ok(Idle::Conn(idle));
                }
                (Arc::clone(&master.limit), Arc::clone(&master.returned))
            };
            // A permit frees only when a connection closes; one given back
            // idle keeps its own. Waiting for the permit alone, a request
            // waited while connections lay idle, taken by later requests,
            // until its deadline (503) under steady confirms whose WAITs
            // held every connection (a replica down).
            tokio::select! {
                permit = limit.acquire_owned() => {
                    return permit
                        .map(Idle::Permit)
                        .map_err(|_| Error::Internal("the confirm pool's semaphore closed".into()));
                }
                () = returned.notified() => {}
            }
        }
    }

    fn give_back(&self, addr: &str, conn: Dedicated) {
        if let Some(master) = self.lock().get_mut(addr) {
            if master.idle.len() < IDLE_PER_MASTER {
                master.idle.push(conn);
                master.returned.notify_one();
            }
        }
    }

    /// Drops the idle connections to `addr`, after one failed: its idle
    /// siblings are likely as dead as it is.
    fn forget(&self, addr: &str) {
        if let Some(master) = self.lock().get_mut(addr) {
            master.idle.clear();
        }
    }

    /// Closes the idle connections to every node that is not among
    /// `masters` (a failover demoted it, a resharding emptied it), and
    /// drops its share once none is in use (dropped earlier, its limit
    /// would start afresh while connections counted by the old one live).
    pub(super) fn keep_only(&self, masters: &[String]) {
        self.lock().retain(|addr, master| {
            if masters.contains(addr) {
                return true;
            }
            master.idle.clear();
            master.limit.available_permits() < PER_MASTER
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Master>> {
        // Every change under the lock is one map or vector operation: a
        // panic elsewhere cannot leave it half-changed, so a poisoned lock
        // is usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How many replicas to wait for, and how long.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub replicas: u32,
    pub timeout_ms: u64,
}

/// Where the next attempt goes.
enum Target {
    /// The slot's master, as the slot map says.
    Master,
    /// A node a `MOVED` named.
    Moved(String),
    /// The importing node an `ASK` named: `ASKING` first.
    Ask(String),
}

impl Cluster {
    /// Runs `script` on a dedicated connection to the master of `keys`'
    /// slot, then, when `wait_for(&reply)` says so, `WAIT`s for replicas on
    /// the same connection. Answers the reply and the replicas that
    /// acknowledged (0 without a `WAIT`, and when the `WAIT` fails: the
    /// script's reply is never dropped once it came). Everything,
    /// connection set-up and redirects included, is bounded by `deadline`.
    pub async fn eval_and_wait<T: FromRedisValue>(
        &self,
        deadline: &Deadline,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
        wait_for: impl Fn(&T) -> Option<Wait>,
    ) -> Result<(T, i64), Error> {
        deadline
            .run(
                script.name(),
                self.run_dedicated(deadline, script, keys, args, wait_for, Target::Master),
            )
            .await
    }

    /// Runs `script` on the node an `ASK` redirect named (`addr`), as
    /// [`Cluster::eval_and_wait`] does, without a `WAIT`: `ASKING` and the
    /// script in one pipeline on a dedicated connection, so that no other
    /// request can use the flag up. The cluster client sends them apart on
    /// its shared connection, where a storm of requests to a moving slot
    /// used each other's flags, met `MOVED` back and forth, and wedged it.
    /// For [`Cluster::eval`], within its deadline (not timed again).
    pub(super) async fn eval_asked<T: FromRedisValue>(
        &self,
        deadline: &Deadline,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
        addr: String,
    ) -> Result<T, Error> {
        self.run_dedicated(
            deadline,
            script,
            keys,
            args,
            |_: &T| None,
            Target::Ask(addr),
        )
        .await
        .map(|(reply, _)| reply)
    }

    /// The body of [`Cluster::eval_and_wait`], from `target`.
    async fn run_dedicated<T: FromRedisValue>(
        &self,
        deadline: &Deadline,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
        wait_for: impl Fn(&T) -> Option<Wait>,
        mut target: Target,
    ) -> Result<(T, i64), Error> {
        let slot = crate::keys::slot(keys.first().map(String::as_bytes).unwrap_or_default());
        let (mut redirects, mut waits) = (0, 0);
        let mut fresh_retry = true;
        loop {
            let (addr, asking) = match &target {
                Target::Master => (self.master_of_slot(slot)?, false),
                Target::Moved(addr) => (addr.clone(), false),
                Target::Ask(addr) => (addr.clone(), true),
            };
            let mut conn = self.dedicated(&addr).await?;
            let run = if asking {
                script.run_asking(&mut conn.conn, keys, &args).await
            } else {
                script.run(&mut conn.conn, keys, &args).await
            };
            let err = match run {
                Ok(reply) => {
                    // The script ran, whatever becomes of its WAIT:
                    // a WAIT that fails (the connection broke) has
                    // seen no replica acknowledge, which the caller
                    // answers as a WAIT that fell short, with the
                    // reply (a sale made is counted once, here).
                    return match self.wait(&mut conn.conn, wait_for(&reply), deadline).await {
                        Ok(replicas) => {
                            self.confirm_pool.give_back(&addr, conn);
                            Ok((reply, replicas))
                        }
                        Err(err) => {
                            tracing::warn!(node = %addr, error = %err, "WAIT failed after the script ran");
                            self.confirm_pool.forget(&addr);
                            Ok((reply, 0))
                        }
                    };
                }
                Err(err) => err,
            };
            target = match (classify(&err).1, err.redirect_node()) {
                (Retry::Elsewhere, _) if redirects >= MAX_REDIRECTS => return Err(err.into()),
                (Retry::Elsewhere, Some((to, _))) => {
                    redirects += 1;
                    self.mark_stale();
                    let to = to.to_owned();
                    if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask) {
                        Target::Ask(to)
                    } else {
                        Target::Moved(to)
                    }
                }
                (Retry::Elsewhere, None) => {
                    // A replica's READONLY: this node was demoted.
                    redirects += 1;
                    self.mark_stale();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Target::Master
                }
                (Retry::Later, _) => {
                    // TRYAGAIN (an importing node that lacks some of
                    // the keys until the move ends), CLUSTERDOWN,
                    // LOADING: the same node again, after a pause,
                    // for as long as the deadline allows. Not a
                    // redirect: a slot move can last longer than a
                    // few attempts.
                    self.confirm_pool.give_back(&addr, conn);
                    waits += 1;
                    tokio::time::sleep(later_pause(waits)).await;
                    target
                }
                (Retry::Reconnect, _) if conn.reused && fresh_retry => {
                    // An idle connection the server had closed: once
                    // more on a new one. Safe even if the script ran:
                    // confirm.lua answers a repeat as its first run,
                    // and rewrites the sale so the WAIT counts it.
                    fresh_retry = false;
                    self.confirm_pool.forget(&addr);
                    target
                }
                (Retry::Reconnect | Retry::No, _) => {
                    self.confirm_pool.forget(&addr);
                    self.mark_stale();
                    return Err(err.into());
                }
            };
        }
    }

    /// `WAIT` for `wait`'s replicas on `conn`; 0 without a wait. It waits
    /// at most what the request's deadline leaves (less [`WAIT_MARGIN`]),
    /// so that a sale whose replicas are slow is answered as such.
    async fn wait(
        &self,
        conn: &mut MultiplexedConnection,
        wait: Option<Wait>,
        deadline: &Deadline,
    ) -> Result<i64, Error> {
        match wait {
            Some(wait) if wait.replicas > 0 => {
                let left = deadline.remaining().saturating_sub(WAIT_MARGIN);
                // WAIT 0 would block until the replicas answer: 1 ms at least.
                let timeout_ms = wait
                    .timeout_ms
                    .min(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
                    .max(1);
                Ok(redis::cmd("WAIT")
                    .arg(wait.replicas)
                    .arg(timeout_ms)
                    .query_async(conn)
                    .await?)
            }
            _ => Ok(0),
        }
    }

    /// The master of `slot` in the current slot map.
    fn master_of_slot(&self, slot: u16) -> Result<String, Error> {
        self.routing()
            .topology
            .master_of(slot)
            .map(str::to_owned)
            .ok_or_else(|| {
                self.mark_stale();
                Error::RedisUnavailable(
                    RedisFault::Cluster,
                    format!("no master serves slot {slot}"),
                )
            })
    }

    /// An idle dedicated connection to the node at `addr`, or a new one
    /// (bounded by the caller's deadline, and by [`PER_MASTER`]).
    async fn dedicated(&self, addr: &str) -> Result<Dedicated, Error> {
        let permit = match self.confirm_pool.take(addr).await? {
            Idle::Conn(idle) => return Ok(idle),
            Idle::Permit(permit) => permit,
        };
        let client = self.node_client(addr)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        Ok(Dedicated {
            conn,
            _permit: permit,
            reused: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that is no longer a master keeps no share of the pool (its
    /// idle connections stayed open for the daemon's life before).
    #[tokio::test]
    async fn departed_masters_leave_the_pool() {
        let pool = Pool::default();
        let (a, b, c) = (
            "10.0.0.1:7000".to_owned(),
            "10.0.0.2:7000".to_owned(),
            "10.0.0.3:7000".to_owned(),
        );
        let Idle::Permit(_in_use) = pool.take(&a).await.expect("a") else {
            panic!("an empty pool has no idle connection");
        };
        // b's permit is given back at once; c's is still in use.
        let _ = pool.take(&b).await.expect("b");
        let in_use_c = pool.take(&c).await.expect("c");
        pool.keep_only(std::slice::from_ref(&a));
        let mut kept: Vec<String> = pool.lock().keys().cloned().collect();
        kept.sort();
        assert_eq!(
            kept,
            vec![a.clone(), c.clone()],
            "c's share stays while in use"
        );
        drop(in_use_c);
        pool.keep_only(std::slice::from_ref(&a));
        let kept: Vec<String> = pool.lock().keys().cloned().collect();
        assert_eq!(kept, vec![a]);
    }
}
