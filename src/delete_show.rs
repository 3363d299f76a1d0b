//! `seathold delete-show`: removes every Redis key of shows that are over.
//!
//! Sold seats and sale records have no TTL (a sale must outlive restarts),
//! and neither have a show's event stream, pools, settings and holder
//! counters: without this, every show ever sold stays in Redis memory. All
//! of one show's keys carry its hash tag `{show:<show>}`, so they live in
//! one slot on one master: the command asks that master for the slot's key
//! names (`CLUSTER COUNTKEYSINSLOT`, `CLUSTER GETKEYSINSLOT`), keeps those
//! under `<prefix>{show:<show>}`, reads its seats and hold records, and
//! `UNLINK`s them. It refuses a show with a seat still held (a live hold,
//! or a raw `SET … NX PX` of another writer) unless `--force` says so.
//!
//! Run it as a user that may run those three commands (the `admin` user of
//! `cluster/acl.conf`; the `seathold` user there may not), after the show's
//! sale has stopped. A daemon that answered the show's requests in the last
//! 30 s may still know its sold seats from its seat view until the view is
//! dropped; requests for a deleted show are not expected.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::cluster::{Cluster, Readiness, RedisOptions, Topology};
use crate::doctor::{connect, query, slot_map};
use crate::ids::ShowId;
use crate::keys::{KeySpace, SOLD_PREFIX};
use crate::scripts::Scripts;

/// Keys per `MGET` and `UNLINK`.
const BATCH: usize = 1000;

/// What was found of one show, and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub show: ShowId,
    /// The master that serves the show's slot, and the slot.
    pub node: String,
    pub slot: u16,
    /// Every key of the show.
    pub keys: usize,
    pub sold_seats: usize,
    /// Seats held (by a live hold, or by a writer outside seathold).
    pub held_seats: usize,
    pub verdict: Verdict,
}

/// What became of a show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Deleted,
    /// `--dry-run`: nothing deleted.
    WouldDelete,
    /// Seats still held, and no `--force`: nothing deleted.
    Refused,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match self.verdict {
            Verdict::Deleted => "deleted",
            Verdict::WouldDelete => "would delete",
            Verdict::Refused => "refused",
        };
        write!(
            f,
            "{verdict}  show {}: keys {}, seats sold {}, seats held {} ({}, slot {})",
            self.show, self.keys, self.sold_seats, self.held_seats, self.node, self.slot
        )?;
        if self.verdict == Verdict::Refused {
            write!(
                f,
                "; seats are still held: stop selling the show and wait until its holds end (at most --max-ttl-ms), or pass --force"
            )?;
        }
        Ok(())
    }
}

/// The cluster's slot map and the means to reach its masters.
pub struct Deleter {
    cluster: Arc<Cluster>,
    topology: Topology,
    keys: KeySpace,
    timeout: Duration,
}

impl Deleter {
    /// Reads the slot map from the first seed that answers.
    pub async fn connect(redis: &RedisOptions, keys: KeySpace) -> Result<Self, String> {
        let cluster = Cluster::new(redis, Scripts::embedded(), Arc::new(Readiness::default()))
            .map_err(|e| e.to_string())?;
        let (topology, _, _) = slot_map(&cluster, &redis.nodes, redis.timeout).await?;
        Ok(Self {
            cluster,
            topology,
            keys,
            timeout: redis.timeout,
        })
    }

    /// Finds the keys of `show` and, unless `dry_run` or refused, deletes
    /// them. A Redis that does not answer is an error.
    pub async fn delete(
        &self,
        show: &ShowId,
        force: bool,
        dry_run: bool,
    ) -> Result<Outcome, String> {
        let (keys, t) = (&self.keys, self.timeout);
        let slot = keys.show_slot(show);
        let node = self
            .topology
            .master_of(slot)
            .ok_or_else(|| format!("no master serves slot {slot} of show {show}"))?
            .to_owned();
        let mut conn = connect(&self.cluster, &node, t).await?;
        let fail = |what: &str, e: redis::RedisError| format!("{what} on {node}: {e}");
        let count: usize = query(
            &mut conn,
            redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot),
            t,
        )
        .await
        .map_err(|e| fail("CLUSTER COUNTKEYSINSLOT", e))?;
        let in_slot: Vec<String> = query(
            &mut conn,
            redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(count.max(1)),
            t,
        )
        .await
        .map_err(|e| fail("CLUSTER GETKEYSINSLOT", e))?;
        let tag = keys.show_tag(show);
        let own: Vec<String> = in_slot
            .into_iter()
            .filter(|k| k.starts_with(&tag))
            .collect();
        let seats: Vec<&String> = own
            .iter()
            .filter(|k| k[tag.len()..].starts_with(':'))
            .collect();
        let (mut sold_seats, mut held_seats) = (0, 0);
        for batch in seats.chunks(BATCH) {
            let values: Vec<Option<Vec<u8>>> = query(&mut conn, redis::cmd("MGET").arg(batch), t)
                .await
                .map_err(|e| fail("MGET", e))?;
            for value in values.into_iter().flatten() {
                if value.starts_with(SOLD_PREFIX.as_bytes()) {
                    sold_seats += 1;
                } else {
                    held_seats += 1;
                }
            }
        }
        let verdict = if held_seats > 0 && !force {
            Verdict::Refused
        } else if dry_run {
            Verdict::WouldDelete
        } else {
            unlink(&mut conn, &own, t)
                .await
                .map_err(|e| fail("UNLINK", e))?;
            Verdict::Deleted
        };
        Ok(Outcome {
            show: show.clone(),
            node,
            slot,
            keys: own.len(),
            sold_seats,
            held_seats,
            verdict,
        })
    }
}

/// `UNLINK`s `keys`, all of one slot, in batches.
async fn unlink(
    conn: &mut MultiplexedConnection,
    keys: &[String],
    timeout: Duration,
) -> redis::RedisResult<()> {
    for batch in keys.chunks(BATCH) {
        let _: usize = query(conn, redis::cmd("UNLINK").arg(batch), timeout).await?;
    }
    Ok(())
}
