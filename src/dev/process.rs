//! The `redis-server` processes: finding the binary, spawning each server
//! with its watchdog, signals, reaping, stopping them all, and the tails of
//! their logs for error messages (see the module docs of [`crate::dev`] for
//! why the watchdog).

use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::error::io_error;
use super::{DevError, LocalCluster};

/// How long `redis-server`s get to exit after `SIGTERM` before `SIGKILL`.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Lines of a node's log quoted in errors.
const LOG_TAIL_LINES: usize = 20;

/// File in the node folder that receives the server's stdout and stderr
/// (config errors are printed there before `logfile` takes effect).
pub(super) const STDIO_LOG: &str = "stdio.log";
/// The server's own log file, in the node folder.
pub(super) const REDIS_LOG: &str = "redis.log";

/// The watchdog run by `/bin/sh -c`; `$1` is the server pid, `$2` the node
/// folder, `$3` the temporary directory. A line on stdin means "stand down";
/// end-of-file means the owner is gone.
const WATCHDOG_SCRIPT: &str = r#"if read -r line; then exit 0; fi
kill -9 "$1" 2>/dev/null
rm -rf "$2"
rmdir "$3" 2>/dev/null
exit 0"#;

/// Sends the signal `$1` to the pids that follow it.
const KILL_SCRIPT: &str = r#"sig="$1"; shift; kill -s "$sig" "$@""#;

/// The processes of one running node.
pub(super) struct NodeProcess {
    server: Child,
    watchdog: Child,
    /// Write end of the watchdog's stdin; `None` once released.
    lifeline: Option<ChildStdin>,
}

impl NodeProcess {
    pub(super) fn pid(&self) -> u32 {
        self.server.id()
    }

    /// Tells the watchdog to exit without killing, and reaps it. Must happen
    /// before the server is reaped, so that the watchdog can never signal a
    /// pid that has been freed.
    fn release_watchdog(&mut self) {
        if let Some(mut lifeline) = self.lifeline.take() {
            // EPIPE here means the watchdog is already gone: nothing to stop.
            let _ = lifeline.write_all(b"release\n");
        }
        if wait_with_grace(&mut self.watchdog, Duration::from_secs(1)).is_none() {
            // Its pid is still ours (not reaped), so this is safe.
            let _ = self.watchdog.kill();
            let _ = self.watchdog.wait();
        }
    }

    /// `Some(status)` if the server has exited (it is then reaped and the
    /// watchdog released).
    pub(super) fn exited(&mut self) -> Option<ExitStatus> {
        match self.server.try_wait() {
            Ok(Some(status)) => {
                self.release_watchdog();
                Some(status)
            }
            Ok(None) => None,
            // ECHILD and the like: we cannot learn anything more; treat the
            // server as gone rather than signalling a pid we cannot vouch for.
            Err(_) => {
                self.release_watchdog();
                Some(ExitStatus::default())
            }
        }
    }

    /// `SIGKILL` the server and reap both processes.
    pub(super) fn kill_now(&mut self) {
        let _ = self.server.kill();
        self.release_watchdog();
        let _ = self.server.wait();
    }
}

impl Drop for NodeProcess {
    /// A safety net: a process table entry that is dropped while its server
    /// runs takes the server with it. After an orderly stop both children are
    /// already reaped and this does nothing (`std` remembers their status and
    /// sends no signal).
    fn drop(&mut self) {
        self.kill_now();
    }
}

/// Waits up to `grace` for `child` to exit, polling.
fn wait_with_grace(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => return None,
        }
    }
}

impl LocalCluster {
    /// Orderly stop of every process; used by `stop` and `Drop`.
    pub(super) fn shutdown_processes(&mut self) {
        let nodes = self.nodes.get_mut().unwrap_or_else(PoisonError::into_inner);
        let mut running: Vec<&mut NodeProcess> = nodes
            .iter_mut()
            .filter_map(|n| {
                n.paused = false;
                n.process.as_mut()
            })
            .collect();
        // Stand the watchdogs down first (they must not outlive our reaping).
        for process in running.iter_mut() {
            process.release_watchdog();
        }
        let pids: Vec<u32> = running.iter().map(|p| p.pid()).collect();
        // TERM, and CONT so that paused servers can act on it.
        let signalled = !pids.is_empty()
            && send_signal("TERM", &pids).is_ok()
            && send_signal("CONT", &pids).is_ok();
        let deadline = Instant::now()
            + if signalled {
                SHUTDOWN_GRACE
            } else {
                Duration::ZERO
            };
        for process in running.iter_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            if wait_with_grace(&mut process.server, left).is_none() {
                tracing::warn!(
                    pid = process.pid(),
                    "redis-server ignored SIGTERM; killing it"
                );
                let _ = process.server.kill();
                let _ = process.server.wait();
            }
        }
        for node in nodes.iter_mut() {
            node.process = None;
        }
    }
}

/// A bare name is searched on `PATH`; anything with a `/` must exist and be
/// executable.
pub(super) fn resolve_redis_server(program: &Path) -> Result<PathBuf, DevError> {
    if program.components().count() > 1 || program.is_absolute() {
        return if is_executable(program) {
            Ok(program.to_path_buf())
        } else {
            Err(DevError::RedisServerNotExecutable {
                path: program.to_path_buf(),
            })
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
        .ok_or(DevError::RedisServerNotFound)
}

/// The oldest Redis seathold runs on: its scripts call `PEXPIRETIME` and
/// `SET … PXAT` with `NX` (7.0).
const MIN_REDIS: (u32, u32) = (7, 0);

/// Refuses a `redis-server` older than [`MIN_REDIS`]: an older one starts,
/// forms the cluster and answers holds, then fails reads, extends and
/// confirms with script errors. A version it cannot read is let through.
pub(super) fn check_version(redis_server: &Path) -> Result<(), DevError> {
    let out = Command::new(redis_server)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(io_error(format!(
            "running {} --version",
            redis_server.display()
        )))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match parse_version(&text) {
        Some(version) if version < MIN_REDIS => Err(DevError::RedisServerTooOld {
            path: redis_server.to_path_buf(),
            found: format!("{}.{}", version.0, version.1),
        }),
        _ => Ok(()),
    }
}

/// Major and minor version from `redis-server --version` ("Redis server
/// v=7.0.15 sha=…").
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix("v="))?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Spawns a `redis-server` and its watchdog (see the module docs of
/// [`crate::dev`]).
pub(super) fn spawn_server(
    redis_server: &Path,
    conf: &Path,
    node_dir: &Path,
    cluster_dir: &Path,
) -> Result<NodeProcess, DevError> {
    let stdio_path = node_dir.join(STDIO_LOG);
    let stdio = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stdio_path)
        .map_err(io_error(format!("opening {}", stdio_path.display())))?;
    let stdio_err = stdio
        .try_clone()
        .map_err(io_error(format!("duplicating {}", stdio_path.display())))?;
    let server = Command::new(redis_server)
        .arg(conf)
        .current_dir(node_dir)
        .stdin(Stdio::null())
        .stdout(stdio)
        .stderr(stdio_err)
        .process_group(0)
        .spawn()
        .map_err(io_error(format!("starting {}", redis_server.display())))?;
    watch(server, node_dir, cluster_dir)
}

/// Pairs a freshly spawned `server` with its watchdog; a server whose
/// watchdog cannot start is killed again.
fn watch(mut server: Child, node_dir: &Path, cluster_dir: &Path) -> Result<NodeProcess, DevError> {
    let watchdog = Command::new("/bin/sh")
        .arg("-c")
        .arg(WATCHDOG_SCRIPT)
        .arg("seathold-dev-watchdog")
        .arg(server.id().to_string())
        .arg(node_dir)
        .arg(cluster_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match watchdog {
        Ok(mut watchdog) => {
            let lifeline = watchdog.stdin.take();
            let mut process = NodeProcess {
                server,
                watchdog,
                lifeline,
            };
            if process.lifeline.is_none() {
                process.kill_now();
                return Err(DevError::Io {
                    context: "starting the redis-server watchdog".into(),
                    source: io::Error::other("no stdin pipe"),
                });
            }
            Ok(process)
        }
        Err(e) => {
            let _ = server.kill();
            let _ = server.wait();
            Err(DevError::Io {
                context: "starting the redis-server watchdog (/bin/sh)".into(),
                source: e,
            })
        }
    }
}

/// Sends `signal` (a name such as `TERM`) to `pids`, which must be unreaped
/// children of ours.
pub(super) fn send_signal(signal: &'static str, pids: &[u32]) -> Result<(), DevError> {
    let failed = |detail: String| DevError::Signal {
        signal,
        pids: pids.to_vec(),
        detail,
    };
    let output = Command::new("/bin/sh")
        .arg("-c")
        .arg(KILL_SCRIPT)
        .arg("seathold-dev-kill")
        .arg(signal)
        .args(pids.iter().map(u32::to_string))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| failed(format!("could not run /bin/sh: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(
            String::from_utf8_lossy(&output.stderr).trim().to_string(),
        ))
    }
}

/// The end of a node's logs, formatted for an error message (starts with a
/// newline), or empty if there is nothing to show.
pub(super) fn log_tail(node_dir: &Path) -> String {
    let mut out = String::new();
    for name in [REDIS_LOG, STDIO_LOG] {
        let path = node_dir.join(name);
        let Ok(bytes) = fs::read(&path) else { continue };
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.is_empty() {
            continue;
        }
        // The folder is removed with the cluster, so name the file by the
        // node folder's name rather than by a path that will not exist.
        let node = node_dir
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let _ = write!(out, "\n--- last lines of {node}/{name} ---");
        for line in &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..] {
            let _ = write!(out, "\n{line}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn versions_are_read_from_redis_server_version() {
        assert_eq!(
            super::parse_version(
                "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64 build=1"
            ),
            Some((7, 0))
        );
        assert_eq!(
            super::parse_version("Redis server v=6.0.16 sha=0"),
            Some((6, 0))
        );
        assert_eq!(super::parse_version("Redis server v=10.2.1"), Some((10, 2)));
        assert_eq!(super::parse_version("something else"), None);
        assert!((6, 2) < super::MIN_REDIS && (7, 0) >= super::MIN_REDIS);
    }

    use super::*;

    #[test]
    fn missing_binary_error_says_how_to_install() {
        let err = resolve_redis_server(Path::new("seathold-no-such-redis-server"));
        let msg = err.map(|_| String::new()).unwrap_or_else(|e| e.to_string());
        assert!(msg.contains("redis-server was not found on PATH"), "{msg}");
        assert!(msg.contains("sudo apt-get install redis-server"), "{msg}");
        assert!(msg.contains("brew install redis"), "{msg}");
    }
}
