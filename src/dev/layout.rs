//! Slot layouts in one shape: the layout [`LocalCluster::start`] plans, and
//! a node's view of the live one as the daemon's own `CLUSTER SLOTS` parser
//! ([`Topology`]) reads it, so that the two can be compared.
//!
//! [`LocalCluster::start`]: super::LocalCluster::start

use crate::cluster::Topology;

use super::probe::node_addr;
use super::SLOT_COUNT;

/// One slot range, `start..=end`, and the nodes serving it as `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shard {
    pub(super) start: u16,
    pub(super) end: u16,
    pub(super) master: String,
    /// Sorted.
    pub(super) replicas: Vec<String>,
}

/// The layout a new cluster is built to: master `i` (on `ports[i]`) serves
/// an even, contiguous share of the slots, with the replicas created under
/// it; shard `i` is master `i`'s.
pub(super) fn planned(
    masters: usize,
    ports: &[u16],
    initial_masters: &[Option<usize>],
) -> Vec<Shard> {
    let slots = usize::from(SLOT_COUNT);
    (0..masters)
        .map(|i| {
            let start = i * slots / masters;
            let end = (i + 1) * slots / masters - 1;
            let mut replicas: Vec<String> = (0..ports.len())
                .filter(|&r| initial_masters[r] == Some(i))
                .map(|r| node_addr(ports[r]))
                .collect();
            replicas.sort_unstable();
            Shard {
                start: slot_u16(start),
                end: slot_u16(end),
                master: node_addr(ports[i]),
                replicas,
            }
        })
        .collect()
}

/// The shards of `topology`, sorted by first slot.
pub(super) fn shards(topology: &Topology) -> Vec<Shard> {
    topology
        .ranges()
        .iter()
        .map(|range| Shard {
            start: range.start,
            end: range.end,
            master: topology.master_of_range(range).to_owned(),
            replicas: range.replicas.clone(),
        })
        .collect()
}

/// The port of a `host:port` address.
pub(super) fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit_once(':')?.1.parse().ok()
}

fn slot_u16(slot: usize) -> u16 {
    u16::try_from(slot).unwrap_or(SLOT_COUNT - 1)
}

#[cfg(test)]
mod tests {
    use redis::Value;

    use super::*;

    fn shard(start: u16, end: u16, master: u16, replicas: &[u16]) -> Shard {
        Shard {
            start,
            end,
            master: node_addr(master),
            replicas: replicas.iter().map(|&p| node_addr(p)).collect(),
        }
    }

    #[test]
    fn shards_of_a_cluster_slots_reply() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
                Value::Array(vec![]),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(8192),
                Value::Int(16383),
                node(2),
                node(9),
                node(4),
            ]),
            Value::Array(vec![Value::Int(0), Value::Int(8191), node(1)]),
        ]);
        let topology = Topology::from_cluster_slots(&reply, "127.0.0.1:1").unwrap_or_default();
        assert_eq!(
            shards(&topology),
            vec![shard(0, 8191, 1, &[]), shard(8192, 16383, 2, &[4, 9])]
        );
    }

    #[test]
    fn plan_splits_the_slots_evenly_among_the_masters() {
        let ports = [7, 8, 9, 4, 3, 2];
        let initial_masters = [None, None, None, Some(0), Some(1), Some(0)];
        assert_eq!(
            planned(3, &ports, &initial_masters),
            vec![
                shard(0, 5460, 7, &[2, 4]),
                shard(5461, 10921, 8, &[3]),
                shard(10922, 16383, 9, &[]),
            ]
        );
        assert_eq!(planned(1, &[5], &[None]), vec![shard(0, 16383, 5, &[])]);
    }

    #[test]
    fn port_of_an_address() {
        assert_eq!(port_of("127.0.0.1:20001"), Some(20001));
        assert_eq!(port_of("::1:7000"), Some(7000));
        assert_eq!(port_of("no-port"), None);
    }
}
