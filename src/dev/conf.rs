//! A node's folder and `redis.conf`: port allocation, config rendering and
//! quoting, the copies of the TLS files.

use std::collections::hash_map::RandomState;
use std::fmt::Write as _;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use super::error::io_error;
use super::process::REDIS_LOG;
use super::{ClusterOptions, DevError, LocalCluster, TlsFiles, BUS_PORT_OFFSET};

/// Client ports are chosen from this range. With the bus offset the bus ports
/// land in 30000..=32767, so neither stays inside Linux's default ephemeral
/// range (32768..=60999), where outgoing connections would keep taking them.
pub(super) const PORT_RANGE: std::ops::RangeInclusive<u16> = 20000..=22767;

/// Names of the copies of [`TlsFiles`] in each node folder.
const TLS_CERT: &str = "tls-node.crt";
const TLS_KEY: &str = "tls-node.key";
const TLS_CA: &str = "tls-ca.crt";

/// Where a node folder keeps its copies of the TLS files.
pub(super) fn node_tls_files(node_dir: &Path) -> TlsFiles {
    TlsFiles {
        cert: node_dir.join(TLS_CERT),
        key: node_dir.join(TLS_KEY),
        ca: node_dir.join(TLS_CA),
    }
}

impl LocalCluster {
    /// Copies the TLS files into every node folder (see the module docs of
    /// [`crate::dev`]).
    pub(super) fn copy_tls_files(&self, opts: &ClusterOptions) -> Result<(), DevError> {
        let Some(tls) = &opts.tls else {
            return Ok(());
        };
        for node in self.lock().iter() {
            let copies = node_tls_files(&node.dir);
            for (from, to) in [
                (&tls.cert, &copies.cert),
                (&tls.key, &copies.key),
                (&tls.ca, &copies.ca),
            ] {
                fs::copy(from, to).map_err(io_error(format!(
                    "copying {} to {}",
                    from.display(),
                    to.display()
                )))?;
            }
            // The key is a secret; the folder is ours alone anyway.
            fs::set_permissions(&copies.key, fs::Permissions::from_mode(0o600))
                .map_err(io_error(format!("restricting {}", copies.key.display())))?;
        }
        Ok(())
    }

    /// Picks fresh ports for a node and writes its `redis.conf`.
    pub(super) fn configure_node(
        &self,
        index: usize,
        opts: &ClusterOptions,
    ) -> Result<(), DevError> {
        let port = allocate_port()?;
        // Taken from the same sequence, so it differs from every other port
        // of this process's clusters (its unused port+10000 is only checked).
        let tls_port = match opts.tls {
            Some(_) => Some(allocate_port()?),
            None => None,
        };
        let mut nodes = self.lock();
        let node = &mut nodes[index];
        node.port = port;
        node.tls_port = tls_port;
        let config = render_config(port, tls_port, &node.dir, opts)?;
        fs::write(&node.conf, config).map_err(io_error(format!("writing {}", node.conf.display())))
    }
}

/// Next candidate port: a per-process random start, then sequential, so
/// clusters within one process never pick the same port and concurrent
/// processes rarely do (collisions are still detected and retried).
fn allocate_port() -> Result<u16, DevError> {
    static BASE: OnceLock<u32> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(*PORT_RANGE.end() - *PORT_RANGE.start()) + 1;
    let base = *BASE.get_or_init(|| {
        // RandomState is seeded from the OS; mix in pid and time anyway.
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        hasher.write_u128(nanos);
        (hasher.finish() % u64::from(span)) as u32
    });
    for _ in 0..span {
        let offset = (base + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = *PORT_RANGE.start() + offset as u16;
        if port_is_free(port) && port_is_free(port + BUS_PORT_OFFSET) {
            return Ok(port);
        }
    }
    Err(DevError::NoFreePorts)
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// `redis.conf` for one node. Later directives override earlier ones, so
/// `extra_config` comes last. With `tls_port`, the node serves TLS there with
/// the copies of the TLS files in its folder.
fn render_config(
    port: u16,
    tls_port: Option<u16>,
    node_dir: &Path,
    opts: &ClusterOptions,
) -> Result<String, DevError> {
    let dir = node_dir.to_str().ok_or_else(|| {
        DevError::InvalidOptions(format!(
            "temporary directory {} is not valid UTF-8",
            node_dir.display()
        ))
    })?;
    let log = node_dir.join(REDIS_LOG);
    let log = log.to_str().unwrap_or(REDIS_LOG);
    let mut conf = String::new();
    // Why some of these: diskless sync with no delay makes replicas sync at
    // once; `repl-ping-replica-period 1` moves replication offsets every
    // second instead of every ten, and Redis leaves a replica whose offset is
    // still 0 out of CLUSTER SLOTS, so without it a fresh cluster needs ~10 s
    // before its replicas are visible. `stream-node-max-bytes` as in
    // cluster/redis.conf (see there). Writing to a String cannot fail.
    let _ = write!(
        conf,
        "# Generated by seathold dev; removed when the cluster stops.\n\
         port {port}\n\
         bind 127.0.0.1\n\
         protected-mode no\n\
         daemonize no\n\
         dir {dir}\n\
         logfile {log}\n\
         cluster-enabled yes\n\
         cluster-config-file nodes.conf\n\
         cluster-node-timeout {timeout}\n\
         cluster-require-full-coverage yes\n\
         save \"\"\n\
         appendonly no\n\
         repl-diskless-sync yes\n\
         repl-diskless-sync-delay 0\n\
         repl-ping-replica-period 1\n\
         stream-node-max-bytes 1024\n",
        dir = conf_quote(dir),
        log = conf_quote(log),
        timeout = opts.node_timeout_ms,
    );
    if let Some(tls_port) = tls_port {
        render_tls(&mut conf, port, tls_port, node_dir);
    }
    for (key, value) in &opts.extra_config {
        let _ = writeln!(conf, "{key} {value}");
    }
    Ok(conf)
}

/// The TLS directives of [`render_config`]: the node serves TLS on
/// `tls_port` with the copies of the TLS files in `node_dir`.
fn render_tls(conf: &mut String, port: u16, tls_port: u16, node_dir: &Path) {
    let files = node_tls_files(node_dir);
    let path = |p: &Path| conf_quote(&p.to_string_lossy());
    // `cluster-port`: with tls-cluster the bus would otherwise move to
    // tls-port + 10000 (see the module docs of `crate::dev`).
    let _ = write!(
        conf,
        "tls-port {tls_port}\n\
         tls-cert-file {cert}\n\
         tls-key-file {key}\n\
         tls-ca-cert-file {ca}\n\
         tls-cluster yes\n\
         tls-replication yes\n\
         tls-auth-clients optional\n\
         cluster-port {bus}\n",
        cert = path(&files.cert),
        key = path(&files.key),
        ca = path(&files.ca),
        bus = port.saturating_add(BUS_PORT_OFFSET),
    );
}

/// Double-quotes a value for redis.conf (which splits on spaces and
/// understands backslash escapes inside quotes).
fn conf_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_has_defaults_then_overrides() {
        let opts = ClusterOptions {
            extra_config: vec![("appendonly".into(), "yes".into())],
            ..ClusterOptions::default()
        };
        let conf = render_config(21000, None, Path::new("/tmp/a b"), &opts).unwrap_or_default();
        assert!(conf.contains("port 21000\n"));
        assert!(conf.contains("dir \"/tmp/a b\"\n"));
        assert!(conf.contains("cluster-node-timeout 2000\n"));
        assert!(!conf.contains("tls"), "{conf}");
        let default_at = conf.find("appendonly no").unwrap_or(usize::MAX);
        let override_at = conf.find("appendonly yes").unwrap_or(0);
        assert!(default_at < override_at);
    }

    #[test]
    fn tls_config_keeps_the_bus_on_the_plain_port() {
        let opts = ClusterOptions {
            tls: Some(TlsFiles {
                cert: "/x/c".into(),
                key: "/x/k".into(),
                ca: "/x/a".into(),
            }),
            ..ClusterOptions::default()
        };
        let conf =
            render_config(21000, Some(21001), Path::new("/tmp/n"), &opts).unwrap_or_default();
        for line in [
            "port 21000\n",
            "tls-port 21001\n",
            "tls-cert-file \"/tmp/n/tls-node.crt\"\n",
            "tls-key-file \"/tmp/n/tls-node.key\"\n",
            "tls-ca-cert-file \"/tmp/n/tls-ca.crt\"\n",
            "tls-cluster yes\n",
            "tls-replication yes\n",
            "tls-auth-clients optional\n",
            "cluster-port 31000\n",
        ] {
            assert!(conf.contains(line), "{line:?} missing from {conf}");
        }
        // Missing files are refused before anything starts.
        assert!(matches!(opts.validate(), Err(DevError::InvalidOptions(_))));
    }

    #[test]
    fn allocated_ports_are_distinct_and_bindable() {
        let a = allocate_port().unwrap_or(0);
        let b = allocate_port().unwrap_or(0);
        assert!(PORT_RANGE.contains(&a) && PORT_RANGE.contains(&b));
        assert_ne!(a, b);
    }
}
