//! `seathold dev`, the quick start's first command, as a user runs it: it
//! starts a local cluster, serves the API, prints the URL and example curl
//! calls, and on Ctrl-C stops every redis-server it started and removes its
//! folder. Without `redis-server` on PATH it says how to install it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Whether a process with this pid is alive (zombies count as gone).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.split_whitespace()
                .nth(2)
                .is_some_and(|state| state != "Z")
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn dev_serves_against_its_own_cluster_and_cleans_up_on_ctrl_c() {
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["dev", "--listen", &format!("127.0.0.1:{port}")])
        .env("SEATHOLD_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn seathold dev");
    let stdout = child.stdout.take().expect("stdout");
    // Read the banner on a thread: its lines name the nodes and the folder.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut banner = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !banner.iter().any(|l: &String| l.contains("curl -s http")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => banner.push(line),
            Err(_) => panic!("no banner from seathold dev; so far: {banner:#?}"),
        }
    }
    let text = banner.join("\n");
    let url = format!("http://127.0.0.1:{port}");
    assert!(text.contains(&format!("serving on {url}")), "{text}");
    assert!(
        text.contains("curl -s -XPOST") && text.contains("/v1/shows/42/holds"),
        "{text}"
    );
    let folder = text
        .lines()
        .find_map(|l| l.strip_prefix("Redis data folder:"))
        .map(|f| std::path::PathBuf::from(f.trim()))
        .expect("the data folder in the banner");
    let ports: Vec<u16> = text
        .lines()
        .find_map(|l| l.strip_prefix("Redis Cluster nodes:"))
        .expect("the nodes in the banner")
        .split(',')
        .filter_map(|u| u.trim().rsplit(':').next()?.parse().ok())
        .collect();
    assert_eq!(ports.len(), 6, "three masters and three replicas: {text}");

    // The API works against it.
    let http = reqwest::Client::new();
    let mut ready = false;
    for _ in 0..200 {
        if http
            .get(format!("{url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "seathold dev never became ready");
    let r = http
        .post(format!("{url}/v1/shows/42/holds"))
        .json(&serde_json::json!({"seats": ["E7", "E8"]}))
        .send()
        .await
        .expect("hold");
    assert_eq!(r.status(), 201);
    let state: serde_json::Value = http
        .get(format!("{url}/v1/shows/42/seats/E7"))
        .send()
        .await
        .expect("seat")
        .json()
        .await
        .expect("json");
    assert_eq!(state["state"], "held");

    // The redis-servers are this run's, and they go away with it.
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.contains("redis-server") && ports.iter().any(|p| c.contains(&format!(":{p}")))
            })
        })
        .collect();
    assert_eq!(pids.len(), 6, "six redis-servers on the banner's ports");
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "send Ctrl-C");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "seathold dev did not exit after Ctrl-C"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit status {status:?}");
    for pid in pids {
        assert!(!alive(pid), "redis-server {pid} outlived seathold dev");
    }
    assert!(!folder.exists(), "{} was not removed", folder.display());
}

#[test]
fn dev_without_redis_server_says_how_to_install_it() {
    let empty = tempfile::tempdir().expect("temp dir");
    let out = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["dev", "--listen", &format!("127.0.0.1:{}", free_port())])
        .env("PATH", empty.path())
        .stdin(Stdio::null())
        .output()
        .expect("run seathold dev");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("redis-server") && text.contains("apt-get install redis-server"),
        "{text}"
    );
}
