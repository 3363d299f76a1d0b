//! `seathold delete-show`: removes every Redis key of shows that are over.
//!
//! Sold seats and sale records have no TTL (a sale must outlive restarts),
//! and neither have a show's event stream, pools, settings and holder
//! counters: without this, every show ever sold stays in Redis memory. All
//! of one show's keys carry its hash tag `{show:<show>}`, so they live in
//! one slot on one master: the command asks that master for the slot's key
//! names (`CLUSTER COUNTKEYSINSLOT`, `CLUSTER GETKEYSINSLOT`), keeps those
//! under `<prefix>{show:<show>}`, finds its live holds (seats held, hold
//! records, pool units and holder entries not yet expired on Redis's clock,
//! and holds that ran out but whose `expired` event no daemon has written
//! yet), and deletes the keys with `lua/delete_show.lua`, which checks
//! again in the same step, batch by batch, that none of them belongs to a
//! hold made since (a run that finds one deletes nothing and stops the
//! command). It refuses a show with a live hold (its own, another show's
//! taking its pool units, or a raw `SET … NX PX` of another writer) unless
//! `--force` says so, and a slot its master does not serve alone (a
//! resharding in progress).
//!
//! Run it as a user that may run those commands, `CLUSTER NODES`, `TIME`,
//! `MGET`, `ZRANGEBYSCORE`, `EVALSHA` and `EVAL`, and the script's `TYPE`,
//! `ZCOUNT` and `UNLINK` (the `admin` user of
//! `cluster/acl.conf`; the `seathold` user there may not), after the show's
//! sale has stopped. A daemon's seat view of the show forgets its sold
//! seats within about a second: its stream reader finds the stream gone,
//! or begun again by later holds.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::cluster::{Cluster, Readiness, RedisOptions, Topology};
use crate::doctor::{connect, query, slot_map};
use crate::ids::ShowId;
use crate::keys::{KeySpace, SOLD_PREFIX};
use crate::scripts::{Script, Scripts};

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
    /// Holds not yet over on Redis's clock with a seat, a record or pool
    /// units in the show (counted by token: one hold of three seats is one).
    pub live_holds: usize,
    pub verdict: Verdict,
}

/// What became of a show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Deleted,
    /// `--dry-run`: nothing deleted.
    WouldDelete,
    /// Live holds, and no `--force`: nothing deleted.
    Refused,
    /// The show has no key: a mistyped id, or deleted already.
    NotFound,
    /// A hold was made on the show after the check: `deleted` keys went
    /// before the batch that found it live by `key`, and no more.
    Interrupted {
        deleted: usize,
        key: String,
    },
}

impl Verdict {
    /// Whether the command exits 1 for it.
    pub fn fails(&self) -> bool {
        matches!(
            self,
            Self::Refused | Self::NotFound | Self::Interrupted { .. }
        )
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match &self.verdict {
            Verdict::Deleted => "deleted",
            Verdict::WouldDelete => "would delete",
            Verdict::Refused => "refused",
            Verdict::NotFound => {
                return write!(
                    f,
                    "not found  show {}: no keys ({}, slot {})",
                    self.show, self.node, self.slot
                )
            }
            Verdict::Interrupted { deleted, key } => {
                return write!(
                    f,
                    "interrupted  show {}: keys {}, deleted {deleted} ({}, slot {}); \
                     a hold was made on the show while it was being deleted ({key} is live): \
                     its keys are kept; stop selling the show and run the command again \
                     when its holds have ended",
                    self.show, self.keys, self.node, self.slot
                )
            }
        };
        write!(
            f,
            "{verdict}  show {}: keys {}, seats sold {}, holds live {} ({}, slot {})",
            self.show, self.keys, self.sold_seats, self.live_holds, self.node, self.slot
        )?;
        if self.verdict == Verdict::Refused {
            write!(
                f,
                "; stop selling the show and wait until its holds end (at most --max-ttl-ms), or pass --force"
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

    /// Finds the keys of `show` and, unless `dry_run`, refused or none,
    /// deletes them. A Redis that does not answer, or a slot its master
    /// does not serve alone, is an error.
    pub async fn delete(
        &self,
        show: &ShowId,
        force: bool,
        dry_run: bool,
    ) -> Result<Outcome, String> {
        let t = self.timeout;
        let slot = self.keys.show_slot(show);
        let node = self
            .topology
            .master_of(slot)
            .ok_or_else(|| format!("no master serves slot {slot} of show {show}"))?
            .to_owned();
        let mut conn = connect(&self.cluster, &node, t).await?;
        let fail = |what: &str, e: redis::RedisError| format!("{what} on {node}: {e}");
        let nodes: String = query(&mut conn, redis::cmd("CLUSTER").arg("NODES"), t)
            .await
            .map_err(|e| fail("CLUSTER NODES", e))?;
        serves_alone(&nodes, slot)
            .map_err(|why| format!("{node}, slot {slot} of show {show}: {why}"))?;
        let count: usize = query(
            &mut conn,
            redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot),
            t,
        )
        .await
        .map_err(|e| fail("CLUSTER COUNTKEYSINSLOT", e))?;
        let in_slot: Vec<Vec<u8>> = query(
            &mut conn,
            redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(count.max(1)),
            t,
        )
        .await
        .map_err(|e| fail("CLUSTER GETKEYSINSLOT", e))?;
        let tag = self.keys.show_tag(show).into_bytes();
        let mut own: Vec<Vec<u8>> = in_slot
            .into_iter()
            .filter(|k| k.starts_with(&tag))
            .collect();
        stream_first(&self.keys, show, &mut own);
        let mut outcome = Outcome {
            show: show.clone(),
            node: node.clone(),
            slot,
            keys: own.len(),
            sold_seats: 0,
            live_holds: 0,
            verdict: Verdict::NotFound,
        };
        if own.is_empty() {
            return Ok(outcome);
        }
        let (sold, live) = live_holds(&mut conn, &own, tag.len(), t)
            .await
            .map_err(|e| fail("reading the show's holds", e))?;
        outcome.sold_seats = sold;
        outcome.live_holds = live;
        outcome.verdict = if live > 0 && !force {
            Verdict::Refused
        } else if dry_run {
            Verdict::WouldDelete
        } else {
            let guards = guards(&self.keys, show, &own, tag.len());
            let deleted = unlink(
                &mut conn,
                &self.cluster.scripts().delete_show,
                Batches {
                    keys: &own,
                    guards: &guards,
                    check: !force,
                    tag_len: tag.len(),
                },
                t,
            )
            .await
            .map_err(|e| fail("deleting", e))?;
            match deleted {
                Ok(_) => Verdict::Deleted,
                Err((deleted, key)) => Verdict::Interrupted { deleted, key },
            }
        };
        Ok(outcome)
    }
}

/// The sold seats among `keys` (one show's, whose tag is `tag_len` bytes
/// long), and its live holds, counted by token: seats held (their value is
/// the token), hold records that are not an abandoned hold's tombstone,
/// and members `<n>:<token>` of its pools' and holders' sets whose expiry
/// (the score) is still ahead on Redis's clock; a hold of another show may
/// take units of this show's pools. Holds that ran out but whose expiry no
/// daemon has written yet count too (up to `BATCH` of them).
async fn live_holds(
    conn: &mut MultiplexedConnection,
    keys: &[Vec<u8>],
    tag_len: usize,
    t: Duration,
) -> redis::RedisResult<(usize, usize)> {
    let part = |k: &Vec<u8>| k.get(tag_len..).unwrap_or_default().to_vec();
    let seats: Vec<&Vec<u8>> = keys.iter().filter(|k| part(k).starts_with(b":")).collect();
    let records: Vec<&Vec<u8>> = keys
        .iter()
        .filter(|k| part(k).starts_with(b"#hold:"))
        .collect();
    let sets: Vec<&Vec<u8>> = keys
        .iter()
        .filter(|k| {
            let p = part(k);
            p.starts_with(b"#pool-holds:") || p.starts_with(b"#holder:")
        })
        .collect();
    let index = keys.iter().find(|k| part(k) == b"#deadlines");
    let mut tokens: HashSet<Vec<u8>> = HashSet::new();
    let mut sold = 0;
    for batch in seats.chunks(BATCH) {
        let values: Vec<Option<Vec<u8>>> = query(conn, redis::cmd("MGET").arg(batch), t).await?;
        for value in values.into_iter().flatten() {
            if value.starts_with(SOLD_PREFIX.as_bytes()) {
                sold += 1;
            } else {
                tokens.insert(value);
            }
        }
    }
    for batch in records.chunks(BATCH) {
        let values: Vec<Option<Vec<u8>>> = query(conn, redis::cmd("MGET").arg(batch), t).await?;
        for (key, value) in batch.iter().zip(values) {
            if value.is_some_and(|v| v != b"abandoned") {
                let token = part(key).split_off(b"#hold:".len());
                tokens.insert(token);
            }
        }
    }
    let mut unswept = 0;
    if !sets.is_empty() || index.is_some() {
        let (secs, micros): (u64, u64) = query(conn, &redis::cmd("TIME"), t).await?;
        let now = secs * 1000 + micros / 1000;
        if let Some(index) = index {
            // Holds whose time ran out but whose `expired` event no daemon
            // has written yet (their seats and records read as gone): the
            // deadline index's due entries "<ref> <fence> <seats>", not
            // the links "<ref> > <key>" of holds of several shows.
            let due: Vec<Vec<u8>> = query(
                conn,
                redis::cmd("ZRANGEBYSCORE")
                    .arg(index)
                    .arg("-inf")
                    .arg(format!("({now}"))
                    .arg("LIMIT")
                    .arg(0)
                    .arg(BATCH),
                t,
            )
            .await?;
            unswept = due
                .iter()
                .filter(|m| !m.windows(3).any(|w| w == b" > "))
                .count();
        }
        for set in sets {
            let members: Vec<Vec<u8>> = query(
                conn,
                redis::cmd("ZRANGEBYSCORE").arg(set).arg(now).arg("+inf"),
                t,
            )
            .await?;
            for member in members {
                if let Some(at) = member.iter().position(|&b| b == b':') {
                    tokens.insert(member[at + 1..].to_vec());
                }
            }
        }
    }
    Ok((sold, tokens.len() + unswept))
}

/// Whether the node whose `CLUSTER NODES` is `nodes` serves `slot` and is
/// neither migrating it nor importing it: otherwise some of its keys may be
/// on another node.
fn serves_alone(nodes: &str, slot: u16) -> Result<(), String> {
    let myself = nodes
        .lines()
        .find(|l| {
            l.split(' ')
                .nth(2)
                .is_some_and(|f| f.split(',').any(|f| f == "myself"))
        })
        .ok_or("no `myself` line in CLUSTER NODES")?;
    let mut serves = false;
    for entry in myself.split(' ').skip(8) {
        if let Some(moving) = entry.strip_prefix('[') {
            if moving.split('-').next() == Some(slot.to_string().as_str()) {
                return Err("the slot is being moved (a resharding): try again after it".into());
            }
            continue;
        }
        let (first, last) = entry.split_once('-').unwrap_or((entry, entry));
        if let (Ok(first), Ok(last)) = (first.parse::<u16>(), last.parse::<u16>()) {
            serves |= (first..=last).contains(&slot);
        }
    }
    if serves {
        Ok(())
    } else {
        Err("the node does not serve the slot (the slot map changed): try again".into())
    }
}

/// Puts `show`'s event stream, and its count of deleted entries, first
/// among `own`, the show's keys; the others keep their order. Redis lists a
/// slot's newest keys first (`CLUSTER GETKEYSINSLOT` on 7.0), so the stream,
/// made with the show's first hold, came last: a deletion stopped before
/// the last batch (a hold made since the check, a timeout) left it, and the
/// show's readers went on from it as if nothing had gone, their seat views
/// answering the deleted sold seats as sold. Deleted first, the stream's
/// readers find it gone and start over (a gap), as after a whole deletion.
fn stream_first(keys: &KeySpace, show: &ShowId, own: &mut [Vec<u8>]) {
    let (stream, deleted) = (keys.events(show), keys.events_deleted(show));
    own.sort_by_key(|k| {
        if *k == stream.as_bytes() {
            0
        } else if *k == deleted.as_bytes() {
            1
        } else {
            2
        }
    });
}

/// The sorted sets of holds that `delete_show.lua` checks with every batch
/// whether or not they are in it (a hold made after the check may have
/// made them anew): the show's deadline index, and the holds of each of
/// its pools.
fn guards(keys: &KeySpace, show: &ShowId, own: &[Vec<u8>], tag_len: usize) -> Vec<Vec<u8>> {
    let mut guards = vec![keys.deadlines(show).into_bytes()];
    for key in own {
        // Pool ids are ASCII: another key is not one of seathold's pools.
        if let Some(pool) = key
            .get(tag_len..)
            .and_then(|k| k.strip_prefix(b"#pool:"))
            .and_then(|p| std::str::from_utf8(p).ok())
        {
            guards.push(keys.pool_holds(show, pool).into_bytes());
        }
    }
    guards
}

/// What `unlink` deletes: `keys`, all of one show, in batches, each with
/// the `guards`, and checked unless `--force`.
struct Batches<'a> {
    keys: &'a [Vec<u8>],
    guards: &'a [Vec<u8>],
    check: bool,
    tag_len: usize,
}

/// Deletes the keys in batches, each by `delete_show.lua`, which deletes
/// nothing of its batch when a hold made since the check is live. Answers
/// how many keys went, or, when a batch found a live hold, how many went
/// before it and the key that showed the hold.
async fn unlink(
    conn: &mut MultiplexedConnection,
    script: &Script,
    what: Batches<'_>,
    timeout: Duration,
) -> redis::RedisResult<Result<usize, (usize, String)>> {
    let mut deleted = 0;
    for batch in what.keys.chunks(BATCH) {
        let keys: Vec<&[u8]> = batch.iter().chain(what.guards).map(Vec::as_slice).collect();
        let run = script.run::<_, (i64, redis::Value), _>(conn, &keys, |cmd| {
            cmd.arg(batch.len())
                .arg(if what.check { "1" } else { "0" })
                .arg(what.tag_len)
                .arg(SOLD_PREFIX);
        });
        let reply = tokio::time::timeout(timeout, run).await.map_err(|_| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {} ms", timeout.as_millis()),
            ))
        })??;
        match reply {
            (1, redis::Value::Int(n)) => deleted += usize::try_from(n).unwrap_or(0),
            (0, redis::Value::BulkString(key)) => {
                return Ok(Err((deleted, String::from_utf8_lossy(&key).into_owned())))
            }
            other => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Parse,
                    "unexpected reply of delete_show.lua",
                    format!("{other:?}"),
                )))
            }
        }
    }
    Ok(Ok(deleted))
}

#[cfg(test)]
mod tests {
    use super::{serves_alone, stream_first};
    use crate::ids::ShowId;
    use crate::keys::KeySpace;

    /// The event stream goes in the first batch: a deletion stopped by a
    /// later batch (a hold made since the check, a timeout) leaves no
    /// stream that the show's readers would go on from while the seats it
    /// told them were sold are gone (their seat views answered those seats
    /// sold, 409, for as long as they lived).
    #[test]
    fn the_event_stream_goes_first() {
        let ks = KeySpace::new("seat-hold:");
        let show = ShowId::parse("42").expect("show");
        let mut own: Vec<Vec<u8>> = (0..1500)
            .map(|i| ks.seat("42", &format!("S{i}")).into_bytes())
            .collect();
        own.insert(700, ks.events_deleted(&show).into_bytes());
        own.push(ks.events(&show).into_bytes());
        let seats: Vec<Vec<u8>> = own.iter().filter(|k| k.ends_with(b"0")).cloned().collect();
        stream_first(&ks, &show, &mut own);
        assert_eq!(own[0], ks.events(&show).into_bytes());
        assert_eq!(own[1], ks.events_deleted(&show).into_bytes());
        assert_eq!(own.len(), 1502);
        let after: Vec<Vec<u8>> = own.iter().filter(|k| k.ends_with(b"0")).cloned().collect();
        assert_eq!(after, seats, "the other keys keep their order");
    }

    const NODES: &str = "\
07c3 127.0.0.1:30004@40004 master - 0 1 2 connected 5461-10922
e7d1 127.0.0.1:30002@40002 myself,master - 0 0 1 connected 0-5460 10923 [10924->-07c3]
292f 127.0.0.1:30003@40003 master - 0 1 3 connected 10925-16383 [10924-<-e7d1]
";

    #[test]
    fn a_slot_served_moved_or_not_served() {
        assert_eq!(serves_alone(NODES, 0), Ok(()));
        assert_eq!(serves_alone(NODES, 5460), Ok(()));
        assert_eq!(serves_alone(NODES, 10923), Ok(()));
        assert!(serves_alone(NODES, 10924).is_err_and(|e| e.contains("being moved")));
        assert!(serves_alone(NODES, 5461).is_err_and(|e| e.contains("does not serve")));
        assert!(serves_alone("", 0).is_err());
    }
}
