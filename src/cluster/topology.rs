//! The slot map: which master (and which replicas) serve each hash slot, as
//! `CLUSTER SLOTS` reports it. The daemon routes by it; `seathold dev` and the
//! tests check a local cluster's shape with the same parser.

use redis::Value;

/// One slot range of the map: `start..=end`, its master and its replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRange {
    pub start: u16,
    pub end: u16,
    /// Index into [`Topology::masters`].
    master: usize,
    /// Replica addresses `host:port`, sorted.
    pub replicas: Vec<String>,
}

/// The masters and who serves each slot, from `CLUSTER SLOTS`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// Master addresses `host:port`, sorted.
    pub masters: Vec<String>,
    /// Covered slot ranges, sorted by first slot.
    ranges: Vec<SlotRange>,
}

/// `host:port` of one node entry (`[host, port, id, …]`) of a `CLUSTER SLOTS`
/// reply. Redis sends a NULL or `?` host when the node's preferred endpoint
/// is unknown and an empty one for "the node you asked"; both mean the node
/// that answered, `answered_by`'s host (as the redis crate does).
fn endpoint(node: &Value, answered_by: &str) -> Option<String> {
    let Value::Array(fields) = node else {
        return None;
    };
    let host = match fields.first()? {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Nil => String::new(),
        _ => return None,
    };
    let Value::Int(port) = fields.get(1)? else {
        return None;
    };
    let port = u16::try_from(*port).ok()?;
    let host = if host.is_empty() || host == "?" {
        let (answering_host, _) = answered_by.rsplit_once(':')?;
        answering_host.to_owned()
    } else {
        host
    };
    Some(format!("{host}:{port}"))
}

impl Topology {
    /// Parses a `CLUSTER SLOTS` reply sent by the node at `answered_by`
    /// (`host:port`).
    pub fn from_cluster_slots(reply: &Value, answered_by: &str) -> Option<Self> {
        let Value::Array(entries) = reply else {
            return None;
        };
        let mut raw = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(fields) = entry else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(master)) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let master = endpoint(master, answered_by)?;
            let mut replicas = fields[3..]
                .iter()
                .map(|node| endpoint(node, answered_by))
                .collect::<Option<Vec<String>>>()?;
            replicas.sort();
            raw.push((
                u16::try_from(*start).ok()?,
                u16::try_from(*end).ok()?,
                master,
                replicas,
            ));
        }
        let mut masters: Vec<String> = raw.iter().map(|(_, _, m, _)| m.clone()).collect();
        masters.sort();
        masters.dedup();
        let mut ranges: Vec<SlotRange> = raw
            .into_iter()
            .filter_map(|(start, end, m, replicas)| {
                let master = masters.binary_search(&m).ok()?;
                Some(SlotRange {
                    start,
                    end,
                    master,
                    replicas,
                })
            })
            .collect();
        ranges.sort_unstable_by_key(|r| r.start);
        Some(Self { masters, ranges })
    }

    /// The master serving `slot`.
    pub fn master_of(&self, slot: u16) -> Option<&str> {
        let i = self.ranges.partition_point(|r| r.start <= slot);
        let range = self.ranges.get(i.checked_sub(1)?)?;
        (range.start <= slot && slot <= range.end).then(|| self.masters[range.master].as_str())
    }

    /// Number of slots some master serves.
    pub fn covered_slots(&self) -> u32 {
        self.ranges
            .iter()
            .map(|r| u32::from(r.end) - u32::from(r.start) + 1)
            .sum()
    }

    /// The covered ranges, sorted by first slot.
    pub fn ranges(&self) -> &[SlotRange] {
        &self.ranges
    }

    /// The master address of `range`.
    pub fn master_of_range(&self, range: &SlotRange) -> &str {
        &self.masters[range.master]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: Value, port: i64) -> Value {
        Value::Array(vec![
            host,
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn parses_masters_replicas_and_lookups() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node(bulk("10.0.0.2"), 7001),
                node(bulk("10.0.0.5"), 7004),
            ]),
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node(bulk("10.0.0.1"), 7000),
                node(bulk("10.0.0.4"), 7003),
                node(bulk("10.0.0.3"), 7002),
            ]),
        ]);
        let t = Topology::from_cluster_slots(&reply, "10.0.0.1:7000").expect("parses");
        assert_eq!(t.masters, ["10.0.0.1:7000", "10.0.0.2:7001"]);
        assert_eq!(t.master_of(0), Some("10.0.0.1:7000"));
        assert_eq!(t.master_of(5460), Some("10.0.0.1:7000"));
        assert_eq!(t.master_of(5461), Some("10.0.0.2:7001"));
        assert_eq!(t.covered_slots(), 16384);
        assert_eq!(t.ranges()[0].replicas, ["10.0.0.3:7002", "10.0.0.4:7003"]);
        assert_eq!(t.master_of_range(&t.ranges()[1]), "10.0.0.2:7001");
    }

    #[test]
    fn unknown_endpoints_mean_the_answering_node() {
        // cluster-preferred-endpoint-type hostname without a hostname set
        // gives "?", NULL for unknown-endpoint, "" for the node itself.
        for host in [Value::Nil, bulk("?"), bulk("")] {
            let reply = Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(16383),
                node(host, 7000),
            ])]);
            let t = Topology::from_cluster_slots(&reply, "127.0.0.9:7005").expect("parses");
            assert_eq!(t.masters, ["127.0.0.9:7000"]);
        }
    }

    #[test]
    fn gaps_are_not_covered() {
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(10),
            Value::Int(20),
            node(bulk("h"), 1),
        ])]);
        let t = Topology::from_cluster_slots(&reply, "h:1").expect("parses");
        assert_eq!(t.master_of(9), None);
        assert_eq!(t.master_of(21), None);
        assert_eq!(t.covered_slots(), 11);
    }
}
