//! Hostile HTTP: slow clients, floods of connections and requests, garbage on
//! the wire, and the optional API token. The server must answer cleanly and
//! keep serving.

mod common;

use std::time::{Duration, Instant};

use common::{options, server_with, show};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the peer closes or `limit` passes; answers what was read and
/// whether the peer closed.
async fn read_until_close(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), false),
        }
    }
}

#[tokio::test]
async fn slow_clients_are_cut_off() {
    let _shared = common::shared().await;
    let mut opts = options();
    opts.header_read_timeout_ms = 500;
    let s = server_with(opts).await;

    // Slowloris: a head that never ends.
    let mut slow = TcpStream::connect(s.addr).await.expect("connect");
    slow.write_all(b"POST /v1/shows/42/holds HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let started = Instant::now();
    let (_, closed) = read_until_close(&mut slow, Duration::from_secs(5)).await;
    assert!(closed, "a connection with an unfinished head stays open");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed only after {:?}",
        started.elapsed()
    );

    // A body that trickles in: 408, and the request slot is freed.
    let mut trickle = TcpStream::connect(s.addr).await.expect("connect");
    trickle
        .write_all(b"POST /v1/shows/42/holds HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"seats\":")
        .await
        .expect("write");
    let (answer, _) = read_until_close(&mut trickle, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");

    assert_eq!(s.get("/healthz").await.0, 200);
}

#[tokio::test]
async fn past_the_in_flight_limit_requests_get_a_clean_503() {
    // Alone in this binary: it pauses a master of the shared cluster, and it
    // reads the process-wide seathold_http_overloaded_total, which the
    // connection-limit test below also increments.
    let _alone = common::exclusive().await;
    let mut opts = options();
    opts.max_in_flight = 2;
    opts.header_read_timeout_ms = 3_000;
    opts.body_read_timeout_ms = 3_000;
    // The holds waiting out the 1.5 s pause (which Redis may lift a tick
    // late) answer 201 well within their Redis deadline.
    opts.redis_timeout_ms = 4_000;
    let s = server_with(opts).await;
    // Bodies that are still coming hold no request slot: they are read
    // before a request is admitted.
    let mut tricklers = Vec::new();
    for _ in 0..3 {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        c.write_all(b"POST /v1/shows/42/holds HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
            .await
            .expect("write");
        tricklers.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = s
        .call(
            "POST",
            &format!("/v1/shows/{}/seats/A1/hold", show("slow-bodies")),
            None,
        )
        .await;
    assert_eq!(status, 201, "{body}");

    // Two holds waiting on a paused master hold both slots.
    let busy = show("busy");
    let slot = seathold::keys::KeySpace::new("seat-hold:").show_slot(&busy);
    let port = common::cluster()
        .master_port_for_slot(slot)
        .await
        .expect("master of the slot");
    let overloaded_before = s.metric("seathold_http_overloaded_total").await;
    common::pause_clients(port, 1500, "WRITE").await;
    let waiting: Vec<_> = (0..2)
        .map(|i| {
            let (http, url) = (
                s.http.clone(),
                format!("{}/v1/shows/{busy}/seats/W{i}/hold", s.base),
            );
            tokio::spawn(async move { http.post(url).send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = s
        .http
        .post(format!(
            "{}/v1/shows/{}/seats/A1/hold",
            s.base,
            show("busy")
        ))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let body: serde_json::Value = r.json().await.expect("json");
    assert_eq!(body["error"], "overloaded");
    // Probes are never refused.
    assert_eq!(s.get("/healthz").await.0, 200);
    assert_eq!(s.get("/readyz").await.0, 200);
    let overloaded_after = s.metric("seathold_http_overloaded_total").await;
    assert!(
        overloaded_after - overloaded_before >= 1.0,
        "seathold_http_overloaded_total went from {overloaded_before} to {overloaded_after}"
    );
    // The paused holds finish when the pause ends, and free their slots.
    for w in waiting {
        assert_eq!(w.await.expect("task").expect("answer"), 201);
    }
    drop(tricklers);
    assert_eq!(
        s.call(
            "POST",
            &format!("/v1/shows/{}/seats/A1/hold", show("free")),
            None
        )
        .await
        .0,
        201
    );
}

/// A client that sends requests but reads none of the answers (here 60
/// pipelined `GET /openapi.json`, more than the socket buffers take) is
/// disconnected once the server could write nothing to it for
/// `--header-read-timeout-ms`, rather than holding its connection, and
/// the answers buffered for it, for as long as it likes. Before, nothing
/// bounded a write: the connection stayed open until the client went away.
#[tokio::test]
async fn a_client_that_reads_no_answer_is_disconnected() {
    let _shared = common::shared().await;
    let mut opts = options();
    opts.header_read_timeout_ms = 500;
    let s = server_with(opts).await;
    let one = s
        .http
        .get(format!("{}/openapi.json", s.base))
        .send()
        .await
        .expect("openapi")
        .bytes()
        .await
        .expect("body")
        .len();
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut c = socket.connect(s.addr).await.expect("connect");
    let n = 60;
    let request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n".repeat(n);
    c.write_all(&request).await.expect("requests");
    // Reads nothing for 2 s, four times the bound.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(k)) => got += k,
            Err(_) => break false,
        }
    };
    assert!(closed, "the connection was closed");
    assert!(
        got < n * one,
        "the server gave up on it: {got} of {} bytes written",
        n * one
    );
}

/// A request head larger than 64 KiB (here one header of 100 KB) is
/// refused with 431 and the connection closed, and the server goes on
/// serving: each connection's read buffer is bounded at 64 KiB, not
/// hyper's 400 KB default, so that 8,192 connections sending huge heads
/// slowly hold at most 512 MiB, not 3.4 GB.
#[tokio::test]
async fn a_huge_request_head_is_refused() {
    let _shared = common::shared().await;
    let s = server_with(options()).await;
    let mut c = TcpStream::connect(s.addr).await.expect("connect");
    let big = "x".repeat(100_000);
    let head = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
    // The server may close before it has read it all.
    let _ = c.write_all(head.as_bytes()).await;
    let (answer, closed) = read_until_close(&mut c, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(closed);
    let mut c = TcpStream::connect(s.addr).await.expect("connect");
    let big = "x".repeat(50_000);
    let head =
        format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nConnection: close\r\n\r\n");
    c.write_all(head.as_bytes()).await.expect("write");
    let (answer, _) = read_until_close(&mut c, Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "a 50 KB head is fine: {answer}"
    );
}

#[tokio::test]
async fn past_the_connection_limit_a_new_connection_gets_503_and_is_closed() {
    let _shared = common::shared().await;
    let mut opts = options();
    opts.max_connections = 3;
    let s = server_with(opts).await;
    // server_with's readiness probe keeps no connection; give the server a
    // moment (on a busy machine, more than one) to see the last one closed.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let mut held = Vec::new();
    for _ in 0..6 {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        c.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        held.push(c);
    }
    // The liveness probe is answered past the limit too: an overloaded
    // instance is alive, and an orchestrator that restarted it would only
    // move its load. Before, it got the 503 of every refused connection.
    for probe in [
        &b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        c.write_all(probe).await.expect("write");
        let (answer, closed) = read_until_close(&mut c, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(closed, "closed after the answer");
    }
    let mut refused = 0;
    for c in &mut held {
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf))
            .await
            .expect("answer")
            .expect("read");
        let head = String::from_utf8_lossy(&buf[..n]);
        if head.starts_with("HTTP/1.1 503") {
            assert!(head.contains("overloaded"), "{head}");
            refused += 1;
        } else {
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        }
    }
    assert_eq!(
        refused, 3,
        "exactly 3 of 6 connections over a limit of 3 are refused"
    );
    drop(held);
    common::eventually(
        Duration::from_secs(5),
        "connections to be accepted again",
        || async {
            s.http
                .get(format!("{}/healthz", s.base))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
}

/// Reads until the first line of an answer has come (its status line), the
/// peer closes, or `limit` passes; answers what was read.
async fn read_status_line(stream: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    while !out.windows(2).any(|w| w == b"\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn garbage_on_the_wire_never_crashes_the_server() {
    let _shared = common::shared().await;
    let s = server_with(options()).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // Each fixed input, sent whole (the connection left open both ways:
    // the answer must come without the client's end of input), and the
    // status line it is answered with.
    let heads: [(&[u8], &str); 8] = [
        (b"GARBAGE\r\n\r\n", "HTTP/1.1 400 "),
        (b"GET / HTTP/9.9\r\n\r\n", "HTTP/1.1 400 "),
        (
            b"POST /v1/holds HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "HTTP/1.1 400 ",
        ),
        (
            b"POST /v1/holds HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\nzzzzz",
            "HTTP/1.1 400 ",
        ),
        (
            b"POST /v1/holds HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nZZ\r\n",
            "HTTP/1.1 400 ",
        ),
        (
            b"GET /v1/shows/%ff%fe/seats/%00 HTTP/1.1\r\nHost: x\r\n\r\n",
            "HTTP/1.1 400 ",
        ),
        (b"\x00\x01\x02\x03\r\n\r\n", "HTTP/1.1 400 "),
        (
            // Bytes 0x80-0xff (obs-text) may be in a field value (RFC
            // 9110, 5.5): the request is whole and answered.
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: \xff\xfe\r\n\r\n",
            "HTTP/1.1 200 ",
        ),
    ];
    let mut wrong = Vec::new();
    for (bytes, want) in heads {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        c.write_all(bytes).await.expect("write");
        let answer = read_status_line(&mut c, Duration::from_secs(5)).await;
        if !answer.starts_with(want) {
            wrong.push(format!(
                "{:?}: expected {want:?}, got {answer:?}",
                String::from_utf8_lossy(bytes)
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    for _ in 0..300 - heads.len() {
        let mut c = TcpStream::connect(s.addr).await.expect("connect");
        let len = rng.random_range(1..300);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random::<u8>()).collect();
        let _ = c.write_all(&bytes).await;
        let _ = c.shutdown().await;
        let (answer, _) = read_until_close(&mut c, Duration::from_secs(2)).await;
        assert!(
            answer.is_empty()
                || answer.starts_with("HTTP/1.1 4")
                || answer.starts_with("HTTP/1.1 2"),
            "{answer}"
        );
        assert!(!answer.starts_with("HTTP/1.1 5"), "{answer}");
    }
    assert_eq!(s.get("/healthz").await.0, 200);
    let sh = show("after-garbage");
    s.hold(&sh, &["A1"]).await;
}

/// By default (`--api-token-scope config`) the token guards the PUT routes,
/// which configure a sale, as the contract says; holds and their changes
/// need none, whatever `Authorization` they carry.
#[tokio::test]
async fn api_token_guards_the_put_routes() {
    let _shared = common::shared().await;
    let mut opts = options();
    opts.api_token = Some("s3cret-token-for-tests".into());
    let s = server_with(opts).await;
    let sh = show("auth-put");
    let hold = s.hold(&sh, &["A1"]).await;
    let token = hold["holdToken"].as_str().expect("token").to_owned();
    let (status, answer) = s
        .call(
            "PATCH",
            &format!("/v1/shows/{sh}/holds/{token}"),
            Some(json!({"add": ["A2"]})),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = s
        .call(
            "POST",
            &format!("/v1/shows/{sh}/holds/{token}/extend"),
            Some(json!({"ttlMs": 60000})),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = s
        .call("DELETE", &format!("/v1/shows/{sh}/holds/{token}"), None)
        .await;
    assert_eq!(status, 204, "{answer}");
    // A wrong token on a route that needs none changes nothing.
    let r = s
        .http
        .post(format!("{}/v1/shows/{sh}/holds", s.base))
        .header("authorization", "Bearer wrong-token-of-some-length")
        .json(&json!({"seats": ["A3"]}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);

    let puts = [
        (
            format!("/v1/shows/{sh}/pools/floor"),
            json!({"capacity": 5}),
        ),
        (
            format!("/v1/shows/{sh}/settings"),
            json!({"maxPerHolder": 2}),
        ),
    ];
    for (path, body) in &puts {
        let (status, answer) = s.call("PUT", path, Some(body.clone())).await;
        assert_eq!(status, 401, "PUT {path}: {answer}");
        assert_eq!(answer["error"], "unauthorized", "{answer}");
        let r = s
            .http
            .put(format!("{}{path}", s.base))
            .header("authorization", "Bearer s3cret-token-for-tests")
            .json(body)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 200, "PUT {path}");
    }
}

/// With `--api-token-scope writes` every write needs the token.
#[tokio::test]
async fn api_token_scope_writes_guards_every_write() {
    let _shared = common::shared().await;
    let mut opts = options();
    opts.api_token = Some("s3cret-token-for-tests".into());
    opts.api_token_scope = seathold::config::TokenScope::Writes;
    let s = server_with(opts).await;
    let sh = show("auth");
    let url = format!("{}/v1/shows/{sh}/holds", s.base);
    for auth in [
        None,
        Some("Bearer wrong-token-of-some-length"),
        Some("s3cret-token-for-tests"),
        Some("Bearer "),
    ] {
        let mut req = s.http.post(&url).json(&json!({"seats": ["A1"]}));
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        let r = req.send().await.expect("send");
        assert_eq!(r.status().as_u16(), 401, "{auth:?}");
        assert_eq!(
            r.headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok()),
            Some("Bearer")
        );
        assert_eq!(
            r.json::<serde_json::Value>().await.expect("json")["error"],
            "unauthorized"
        );
    }
    // The scheme is case-insensitive (RFC 9110): a client library that
    // writes "bearer" is let in. Before, only "Bearer" was.
    for (i, scheme) in ["bearer", "BEARER"].iter().enumerate() {
        let r = s
            .http
            .post(&url)
            .header("authorization", format!("{scheme} s3cret-token-for-tests"))
            .json(&json!({"seats": [format!("C{i}")]}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 201, "{scheme}");
    }
    let r = s
        .http
        .post(&url)
        .header("authorization", "Bearer s3cret-token-for-tests")
        .json(&json!({"seats": ["A1"]}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    let token = r.json::<serde_json::Value>().await.expect("json")["holdToken"]
        .as_str()
        .expect("t")
        .to_owned();
    // Reads, health and metrics stay open.
    assert_eq!(s.get(&format!("/v1/shows/{sh}/seats/A1")).await.0, 200);
    assert_eq!(s.get(&format!("/v1/shows/{sh}/holds/{token}")).await.0, 200);
    assert_eq!(s.get("/healthz").await.0, 200);
    assert_eq!(s.get("/readyz").await.0, 200);
    assert_eq!(s.get("/metrics").await.0, 200);
    // DELETE, PATCH and PUT are write routes.
    let writes = [
        ("DELETE", format!("/v1/shows/{sh}/holds/{token}"), None),
        (
            "PATCH",
            format!("/v1/shows/{sh}/holds/{token}"),
            Some(json!({"add": ["A2"]})),
        ),
        (
            "PUT",
            format!("/v1/shows/{sh}/pools/floor"),
            Some(json!({"capacity": 5})),
        ),
        (
            "PUT",
            format!("/v1/shows/{sh}/settings"),
            Some(json!({"maxPerHolder": 2})),
        ),
    ];
    for (method, path, body) in &writes {
        let (status, answer) = s.call(method, path, body.clone()).await;
        assert_eq!(status, 401, "{method} {path}: {answer}");
    }
    // With the token, they go through.
    for (method, path, body) in &writes[1..] {
        let mut req = s
            .http
            .request(method.parse().expect("method"), format!("{}{path}", s.base))
            .header("authorization", "Bearer s3cret-token-for-tests");
        if let Some(body) = body {
            req = req.json(body);
        }
        let r = req.send().await.expect("send");
        assert_eq!(r.status().as_u16(), 200, "{method} {path}");
    }
}
