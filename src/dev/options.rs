//! What a [`LocalCluster`](super::LocalCluster) is built from, and its checks.

use std::path::PathBuf;
use std::time::Duration;

use super::{DevError, SLOT_COUNT};

/// How to build a [`LocalCluster`](super::LocalCluster).
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of masters; the slots are split evenly between them. One is
    /// allowed (benchmarks compare one master with three).
    pub masters: usize,
    /// Replicas attached to each master.
    pub replicas_per_master: usize,
    /// `cluster-node-timeout` in milliseconds: how long a node may be
    /// unreachable before it is failed over. Small values make failover tests
    /// fast.
    pub node_timeout_ms: u64,
    /// Extra `redis.conf` directives, written after the defaults so they
    /// override them, e.g. `("notify-keyspace-events", "Ex")`. The value is
    /// written verbatim, so multi-argument directives work; quote values that
    /// contain spaces yourself.
    pub extra_config: Vec<(String, String)>,
    /// The `redis-server` binary: a bare name is looked up on `PATH`, a path
    /// with a `/` is used as is.
    pub redis_server: PathBuf,
    /// Deadline for the whole of
    /// [`LocalCluster::start`](super::LocalCluster::start), and for each
    /// [`LocalCluster::restart`](super::LocalCluster::restart).
    pub start_timeout: Duration,
    /// When set, every node also serves TLS on a port of its own, and the
    /// cluster bus and replication use TLS (see the module docs of
    /// [`crate::dev`]). Needs a
    /// `redis-server` built with TLS (`BUILD_TLS=yes`; Debian's and
    /// Homebrew's are).
    pub tls: Option<TlsFiles>,
}

/// PEM files for a TLS-enabled [`LocalCluster`](super::LocalCluster);
/// [`LocalCluster::start`](super::LocalCluster::start) copies them into the
/// node folders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate every node presents: to clients, and to its peers on the
    /// cluster bus and replication links, so it should be valid for both
    /// server and client authentication and name the address clients use
    /// (e.g. `IP:127.0.0.1`).
    pub cert: PathBuf,
    /// Private key of `cert`.
    pub key: PathBuf,
    /// CA that signed `cert`: nodes verify each other, and client
    /// certificates when a client offers one, against it.
    pub ca: PathBuf,
}

impl Default for ClusterOptions {
    /// Three masters with one replica each, a 2 s node timeout, `redis-server`
    /// from `PATH`, a 30 s start deadline and no TLS.
    fn default() -> Self {
        ClusterOptions {
            masters: 3,
            replicas_per_master: 1,
            node_timeout_ms: 2000,
            extra_config: Vec::new(),
            redis_server: PathBuf::from("redis-server"),
            start_timeout: Duration::from_secs(30),
            tls: None,
        }
    }
}

impl ClusterOptions {
    pub(super) fn validate(&self) -> Result<(), DevError> {
        let invalid = |msg: String| Err(DevError::InvalidOptions(msg));
        if self.masters == 0 || self.masters > usize::from(SLOT_COUNT) {
            return invalid(format!(
                "masters must be in 1..={SLOT_COUNT}, not {}",
                self.masters
            ));
        }
        let total = self
            .masters
            .saturating_mul(self.replicas_per_master.saturating_add(1));
        if total > 500 {
            return invalid(format!(
                "{total} nodes is more than the 500 a local cluster allows"
            ));
        }
        if self.node_timeout_ms == 0 {
            return invalid("node_timeout_ms must be positive".into());
        }
        for (key, value) in &self.extra_config {
            let bad = |s: &str| s.contains(['\n', '\r']);
            if key.trim().is_empty() || key.contains(char::is_whitespace) || bad(value) {
                return invalid(format!("bad extra_config directive {key:?} {value:?}"));
            }
        }
        if let Some(tls) = &self.tls {
            for (what, path) in [("cert", &tls.cert), ("key", &tls.key), ("ca", &tls.ca)] {
                if !path.is_file() {
                    return invalid(format!(
                        "tls.{what} {} is not a readable file",
                        path.display()
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        let zero = ClusterOptions {
            masters: 0,
            ..ClusterOptions::default()
        };
        assert!(matches!(zero.validate(), Err(DevError::InvalidOptions(_))));
        let newline = ClusterOptions {
            extra_config: vec![("save".into(), "\"\"\nport 1".into())],
            ..ClusterOptions::default()
        };
        assert!(matches!(
            newline.validate(),
            Err(DevError::InvalidOptions(_))
        ));
        assert!(ClusterOptions::default().validate().is_ok());
    }
}
