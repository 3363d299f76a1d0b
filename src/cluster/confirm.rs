//! Confirm's Redis path: the script and `WAIT` over one dedicated connection
//! to the slot's master.
//!
//! `WAIT` blocks the connection it is sent on and counts only that
//! connection's writes, so the sale and its `WAIT` must share a connection
//! that no other request uses meanwhile: never the shared multiplexed ones.
//! Idle dedicated connections are kept per master, a few at most.

use std::collections::HashMap;
use std::sync::Mutex;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue};

use super::deadline::Deadline;
use super::fault::{classify, RedisFault, Retry};
use super::Cluster;
use crate::error::Error;
use crate::scripts::Script;

/// Idle dedicated connections kept per master: a burst of confirms must not
/// leave many idle sockets behind.
const IDLE_PER_MASTER: usize = 16;

/// Idle dedicated connections, per master `host:port`.
#[derive(Default)]
pub(super) struct Pool(Mutex<HashMap<String, Vec<MultiplexedConnection>>>);

impl Pool {
    fn take(&self, addr: &str) -> Option<MultiplexedConnection> {
        self.lock().get_mut(addr).and_then(Vec::pop)
    }

    fn give_back(&self, addr: &str, conn: MultiplexedConnection) {
        let mut pool = self.lock();
        let idle = pool.entry(addr.to_owned()).or_default();
        if idle.len() < IDLE_PER_MASTER {
            idle.push(conn);
        }
    }

    /// Drops the idle connections to `addr`, after one failed: its idle
    /// siblings are likely as dead as it is.
    fn forget(&self, addr: &str) {
        self.lock().remove(addr);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<MultiplexedConnection>>> {
        // Every change under the lock is one map operation: a panic elsewhere
        // cannot leave the map half-changed, so a poisoned lock is usable.
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

impl Cluster {
    /// Runs `script` on a dedicated connection to the master of `keys`'
    /// slot, then, when `wait_for(&reply)` says so, `WAIT`s for replicas on
    /// the same connection. Answers the reply and the replicas that
    /// acknowledged (0 without a `WAIT`). A slot that moved is followed
    /// (twice at most); everything is bounded by `deadline`.
    pub async fn eval_and_wait<T: FromRedisValue>(
        &self,
        deadline: &Deadline,
        script: &Script,
        keys: &[String],
        args: impl Fn(&mut Cmd),
        wait_for: impl Fn(&T) -> Option<Wait>,
    ) -> Result<(T, i64), Error> {
        let slot = crate::keys::slot(keys.first().map(String::as_bytes).unwrap_or_default());
        deadline
            .run(script.name(), async {
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    let addr = self.master_of_slot(slot).await?;
                    let mut conn = self.dedicated(&addr).await?;
                    let reply: T = match script.run(&mut conn, keys, &args).await {
                        Ok(reply) => reply,
                        Err(err) => {
                            self.confirm_pool.forget(&addr);
                            self.refresh_topology().await;
                            if classify(&err).1 == Retry::Elsewhere && attempt < 3 {
                                // The slot moved (failover, resharding), or
                                // this node was demoted: try the new owner.
                                continue;
                            }
                            return Err(err.into());
                        }
                    };
                    let replicas: i64 = match wait_for(&reply) {
                        Some(wait) if wait.replicas > 0 => {
                            redis::cmd("WAIT")
                                .arg(wait.replicas)
                                .arg(wait.timeout_ms)
                                .query_async(&mut conn)
                                .await?
                        }
                        _ => 0,
                    };
                    self.confirm_pool.give_back(&addr, conn);
                    return Ok((reply, replicas));
                }
            })
            .await
    }

    /// The master of `slot`, refreshing the slot map once when it has none.
    async fn master_of_slot(&self, slot: u16) -> Result<String, Error> {
        if let Some(addr) = self.routing().topology.master_of(slot) {
            return Ok(addr.to_owned());
        }
        self.refresh_topology().await;
        self.routing()
            .topology
            .master_of(slot)
            .map(str::to_owned)
            .ok_or_else(|| {
                Error::RedisUnavailable(
                    RedisFault::Cluster,
                    format!("no master serves slot {slot}"),
                )
            })
    }

    /// Takes an idle dedicated connection to the master at `addr`, or opens
    /// one (bounded by the caller's deadline).
    async fn dedicated(&self, addr: &str) -> Result<MultiplexedConnection, Error> {
        if let Some(conn) = self.confirm_pool.take(addr) {
            return Ok(conn);
        }
        let client = self.node_client(addr)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        Ok(client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }
}
