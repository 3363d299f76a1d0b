//! The direct path: one multiplexed connection per master, so a script goes
//! straight to its slot's master instead of through the cluster client's
//! routing task (a channel hop and a task wake-up per request).
//!
//! Connections open in the background, one attempt per master at a time, so
//! a master that cannot be reached never holds up the readiness probe.

use std::collections::HashMap;
use std::sync::Arc;

use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

use super::batch::Batched;
use super::deadline::Deadline;
use super::Cluster;
use crate::error::Error;
use crate::metrics as m;

/// Publishes how many masters have a direct connection.
pub(super) fn publish(direct: &HashMap<Arc<str>, Batched>) {
    metrics::gauge!(m::DIRECT_CONNECTIONS).set(direct.len() as f64);
}

/// A script in flight on the direct path to one master. Dropped while still
/// armed once the request's deadline has passed (the deadline cancelled the
/// script), it drops that very connection and has the slot map refreshed: a
/// connection that does not answer must not slow every later request for
/// its master. Dropped before the deadline, the request went away (its
/// client hung up): the connection stays, as nothing says it is slow; under
/// overload, clients that give up once dropped healthy connections one
/// after another.
pub(super) struct InFlight<'a> {
    cluster: &'a Cluster,
    addr: &'a str,
    conn: Batched,
    deadline: &'a Deadline,
    armed: bool,
}

impl<'a> InFlight<'a> {
    pub(super) fn new(
        cluster: &'a Cluster,
        addr: &'a str,
        conn: &Batched,
        deadline: &'a Deadline,
    ) -> Self {
        Self {
            cluster,
            addr,
            conn: conn.clone(),
            deadline,
            armed: true,
        }
    }

    /// The script answered (or failed) in time.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.armed && self.deadline.remaining().is_zero() {
            tracing::warn!(addr = self.addr, "direct connection timed out; dropping it");
            self.cluster.drop_direct(self.addr, &self.conn);
        }
    }
}

impl Cluster {
    /// Drops `conn`, the direct connection to `addr` (the next `maintain`
    /// round opens a new one), unless a new one has replaced it already,
    /// and has the slot map refreshed soon.
    fn drop_direct(&self, addr: &str, conn: &Batched) {
        let mut routing = self.routing_mut();
        if routing.direct.get(addr).is_some_and(|c| c.same(conn)) {
            routing.direct.remove(addr);
            publish(&routing.direct);
        }
        drop(routing);
        self.mark_stale();
    }

    /// The master serving `key`'s slot and the direct connection to it, if
    /// there is one.
    pub(super) fn direct_for(&self, key: &str) -> Option<(Arc<str>, Batched)> {
        let routing = self.routing();
        let addr = routing
            .topology
            .master_of(crate::keys::slot(key.as_bytes()))?;
        let (addr, conn) = routing.direct.get_key_value(addr)?;
        Some((Arc::clone(addr), conn.clone()))
    }

    /// After the direct path to `addr` failed on `conn` with `err`: a
    /// broken connection is dropped (the next `maintain` round opens a new
    /// one), and either way the slot map is refreshed soon.
    pub(super) fn direct_failed(&self, addr: &str, conn: &Batched, err: &redis::RedisError) {
        if matches!(err.kind(), redis::ErrorKind::Server(_)) {
            self.mark_stale();
        } else {
            self.drop_direct(addr, conn);
        }
    }

    /// Opens, in the background, a direct connection to every master that
    /// has none and is not being connected to already.
    pub(super) fn connect_direct(self: &Arc<Self>) {
        let missing: Vec<String> = {
            let routing = self.routing();
            routing
                .topology
                .masters
                .iter()
                .filter(|addr| !routing.direct.contains_key(addr.as_str()))
                .cloned()
                .collect()
        };
        for addr in missing {
            let started = self
                .connecting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(addr.clone());
            if !started {
                continue;
            }
            let me = Arc::clone(self);
            tokio::spawn(async move {
                match me.open_direct(&addr).await {
                    Ok(conn) => {
                        tracing::debug!(%addr, "direct connection to master open");
                        let mut routing = me.routing_mut();
                        // Only while it is still a master.
                        if routing.topology.masters.binary_search(&addr).is_ok() {
                            routing
                                .direct
                                .insert(Arc::from(addr.as_str()), Batched::new(conn, me.timeout));
                            publish(&routing.direct);
                        }
                    }
                    Err(err) => {
                        tracing::warn!(%addr, error = %err, "cannot open a direct connection to master");
                    }
                }
                me.connecting
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&addr);
            });
        }
    }

    async fn open_direct(&self, addr: &str) -> Result<MultiplexedConnection, Error> {
        let client = self.node_client(addr)?;
        // No response timeout of its own: every use is bounded by the
        // request's deadline, which also counts the timeout.
        let config = AsyncConnectionConfig::new().set_response_timeout(None);
        Deadline::after(self.timeout)
            .within(async {
                Ok(client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?)
            })
            .await
    }
}
