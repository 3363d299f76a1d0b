//! Accepting and serving connections: the limit on open connections (a
//! connection past it is refused with one answer), hyper's per-connection
//! settings, and the bound on how long an answer waits for a client that
//! reads nothing.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::http::{self, App};

/// Limits of the accept loop.
pub(super) struct Accept<'a> {
    pub(super) listener: &'a TcpListener,
    pub(super) app: &'a Arc<App>,
    pub(super) graceful: &'a GracefulShutdown,
    pub(super) open: Arc<AtomicUsize>,
    pub(super) max_connections: usize,
    pub(super) header_read_timeout: Duration,
}

impl Accept<'_> {
    /// Accepts and serves connections until `until` completes.
    pub(super) async fn until(&self, until: impl Future<Output = ()>) {
        tokio::pin!(until);
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => self.serve(stream, peer),
                    Err(err) => {
                        // Out of file descriptors and the like: back off
                        // briefly instead of spinning.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = &mut until => return,
            }
        }
    }

    /// Serves the connections still waiting in the kernel's listen queue.
    /// The accept loop sees them only after the reactor does, a while
    /// later; closing the listener now would reset them mid-request.
    pub(super) fn take_queued(&self) {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd;
            // A second descriptor of the same (non-blocking) socket: its
            // accept answers WouldBlock once the queue is empty.
            let Ok(fd) = self.listener.as_fd().try_clone_to_owned() else {
                return;
            };
            let queue = std::net::TcpListener::from(fd);
            while let Ok((stream, peer)) = queue.accept() {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                    self.serve(stream, peer);
                }
            }
        }
    }

    fn serve(&self, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let _ = stream.set_nodelay(true);
        if self.open.fetch_add(1, Ordering::Relaxed) >= self.max_connections {
            // A refused connection is not an open one: neither the limit
            // nor seathold_http_connections counts it while it is refused.
            self.open.fetch_sub(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::HTTP_OVERLOADED).increment(1);
            tokio::spawn(refuse(stream));
            return;
        }
        let open = Open::counted(Arc::clone(&self.open));
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout)
            // A head larger than this is refused with 431, and the read
            // buffer stays that small. hyper's default (about 400 KB, and no
            // limit on a head that arrives in one read) would let 8,192
            // connections that send huge heads slowly hold 3.4 GB between
            // them; our heads are small.
            .max_header_size(MAX_HEAD_BYTES)
            .max_buf_size(MAX_HEAD_BYTES);
        let app = Arc::clone(self.app);
        let disconnect = http::Disconnect::default();
        let handle = disconnect.clone();
        let service = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let app = Arc::clone(&app);
            req.extensions_mut().insert(handle.clone());
            // A change of a hold runs in a task of its own, to its end even
            // when its client hangs up: hyper drops a connection's futures
            // when the client goes, and a script already sent still runs in
            // Redis, so what it changed would go uncounted (its counters,
            // events_total, the request histogram) and its clean-up after a
            // failure (a failed confirm's record) undone. It lasts at most
            // the Redis timeout. A new hold is dropped with its client
            // instead, which has the hold abandoned (nobody else will learn
            // its token); reads have nothing to finish.
            async move {
                if !http::runs_to_its_end(req.method(), req.uri().path()) {
                    return Ok::<_, Infallible>(http::handle(app, req, peer).await);
                }
                let response = match tokio::spawn(http::handle(app, req, peer)).await {
                    Ok(response) => response,
                    Err(err) => {
                        tracing::error!(error = %err, "a request's task failed");
                        http::error_response(crate::error::Error::Internal(
                            "the request's task failed".to_owned(),
                        ))
                    }
                };
                Ok(response)
            }
        });
        let stream = WriteStall::new(stream, self.header_read_timeout, disconnect.clone());
        let conn = self
            .graceful
            .watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _open = open;
            tokio::select! {
                ended = conn => if let Err(err) = ended {
                    tracing::debug!(error = %err, "connection ended with an error");
                },
                () = disconnect.requested() => tracing::debug!(%peer, "connection closed by the server"),
            }
        });
    }
}

/// A connection whose writes fail once the client has taken no byte for
/// `limit`: hyper bounds how long a request's head may take, not how long
/// an answer may wait for its client, and a client that sends requests
/// but reads no answer would otherwise keep its connection (one of
/// `--max-connections`) and what is buffered for it for as long as it
/// likes. The same patience as for a request's head: a client that reads
/// slowly but steadily is never cut off, only one that stopped.
struct WriteStall {
    stream: tokio::net::TcpStream,
    limit: Duration,
    /// Running while a write waits for the client.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Told when the limit passed, so that an event stream on the
    /// connection counts its client as one that stopped reading.
    disconnect: http::Disconnect,
}

impl WriteStall {
    fn new(stream: tokio::net::TcpStream, limit: Duration, disconnect: http::Disconnect) -> Self {
        Self {
            stream,
            limit,
            stalled: None,
            disconnect,
        }
    }

    /// What a write's `poll` answered, given how long it has waited.
    fn bound<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.disconnect.stalled();
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client read nothing of the answer in time",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl tokio::io::AsyncRead for WriteStall {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for WriteStall {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.stream).poll_write(cx, buf);
        self.bound(cx, polled)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.stream).poll_flush(cx);
        self.bound(cx, polled)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// One served connection, counted in the limit and the gauge while alive,
/// also when its task ends by a panic or with its runtime.
struct Open(Arc<AtomicUsize>);

impl Open {
    /// Counts a connection already added to `open` in the gauge.
    fn counted(open: Arc<AtomicUsize>) -> Self {
        crate::metrics::hot::gauge_add(crate::metrics::HTTP_CONNECTIONS, 1.0);
        Self(open)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        crate::metrics::hot::gauge_add(crate::metrics::HTTP_CONNECTIONS, -1.0);
    }
}

/// Refuses a connection past `--max-connections`: one 503 `overloaded`,
/// then close. Only the liveness probe (`GET` or `HEAD /healthz`) gets its
/// 200 instead, so that an orchestrator does not restart an instance for
/// being busy, which would only move its load; `/readyz` is refused, which
/// takes the instance out of rotation while it is full. The request's
/// first bytes are awaited briefly for that; the rest of what the client
/// sent is read and dropped for a moment, so that closing does not reset
/// the connection before the client has read the answer.
async fn refuse(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    static OVERLOADED: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    static ALIVE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let answer = |status: &str, body: Vec<u8>, extra: &str| {
        let mut answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}\
             connection: close\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        answer.extend(body);
        answer
    };
    let mut head = [0u8; 16];
    let mut got = 0;
    let _ = tokio::time::timeout(PROBE_WAIT, async {
        while got < head.len() {
            match stream.read(&mut head[got..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
    })
    .await;
    let head = &head[..got];
    const PROBES: [&[u8]; 2] = [b"GET /healthz", b"HEAD /healthz"];
    let probe = PROBES
        .into_iter()
        .find(|p| head.starts_with(p) && matches!(head.get(p.len()), Some(b' ' | b'?')));
    let bytes = match probe {
        Some(_) => ALIVE.get_or_init(|| {
            let body = serde_json::to_vec(&crate::model::Health::up("ok")).unwrap_or_default();
            answer("200 OK", body, "")
        }),
        None => OVERLOADED.get_or_init(|| {
            let body =
                serde_json::to_vec(&crate::error::Error::Overloaded.body()).unwrap_or_default();
            answer("503 Service Unavailable", body, "retry-after: 1\r\n")
        }),
    };
    // HEAD: the head without its body.
    let bytes = match probe {
        Some(p) if p.starts_with(b"HEAD") => {
            let end = bytes
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map_or(bytes.len(), |i| i + 4);
            &bytes[..end]
        }
        _ => &bytes[..],
    };
    if stream.write_all(bytes).await.is_err() || stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    let _ = tokio::time::timeout(Duration::from_millis(250), async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// The largest request head a connection reads (its read buffer).
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// How long a refused connection's first bytes are awaited, to tell a
/// liveness probe.
const PROBE_WAIT: Duration = Duration::from_millis(100);
