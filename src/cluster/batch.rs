//! Automatic pipelining on the direct path: the scripts that requests send
//! to one master at about the same time go to it in one write.
//!
//! A multiplexed connection writes each command as soon as its driver task
//! runs, and tokio runs that task right after the request that woke it:
//! under load the daemon made 1.74 `writev` calls per single-seat hold (one
//! for the HTTP answer, 0.74 for Redis; `perf stat` at 18,000 holds/s).
//! Here a request queues its command and a flusher task, woken by the first
//! command of a batch, yields once, so that the other requests that were
//! ready in the same turn of the scheduler queue theirs, and then sends
//! everything queued as one pipeline: 1.12 `writev` per hold. Replies come
//! back in order on the same connection and go to their requests. Nothing
//! waits for a timer: with one request in flight a batch is that one
//! command, sent after one scheduler turn.
//!
//! On loopback this saves system calls and little else: the masters
//! already read about 17 queued commands per `read` under that load, and
//! holds/s and the daemon's CPU per hold did not change beyond the
//! machine's noise (docs/benchmark.md). Across a network, where each write
//! is a packet, fewer and fuller writes are the point.
//!
//! Each command keeps its own answer: a server error (`NOSCRIPT`,
//! `MOVED`, a script error) reaches only the request that sent it, exactly
//! as over the connection itself; a broken connection fails every command
//! of the batch, as it would have failed each of them.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, RedisFuture, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;

use crate::metrics as m;

/// The most commands sent in one write; more wait for the next batch.
const MAX_BATCH: usize = 64;

/// A command waiting for its batch, and where its answer goes.
struct Queued {
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// A handle on one master's connection that batches commands (cheap to
/// clone). The flusher task ends when the last handle is dropped.
#[derive(Clone)]
pub(super) struct Batched {
    queue: mpsc::UnboundedSender<Queued>,
    db: i64,
}

impl Batched {
    /// Whether `other` is a handle on this very connection.
    pub(super) fn same(&self, other: &Batched) -> bool {
        self.queue.same_channel(&other.queue)
    }

    /// `limit`: the longest any request waits for its answer (the Redis
    /// timeout); a batch waits no longer, so a master that stopped
    /// answering does not keep its batches (and their commands) alive.
    pub(super) fn new(conn: MultiplexedConnection, limit: Duration) -> Self {
        let (queue, rx) = mpsc::unbounded_channel();
        let db = conn.get_db();
        tokio::spawn(flush(rx, conn, limit));
        Self { queue, db }
    }

    async fn send(&self, cmd: &Cmd) -> RedisResult<Value> {
        let (reply, answer) = oneshot::channel();
        let gone = || redis::RedisError::from((redis::ErrorKind::Io, "direct connection closed"));
        self.queue
            .send(Queued {
                cmd: cmd.clone(),
                reply,
            })
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// Sends what is queued, a batch at a time, until every handle is gone.
async fn flush(
    mut rx: mpsc::UnboundedReceiver<Queued>,
    conn: MultiplexedConnection,
    limit: Duration,
) {
    while let Some(first) = rx.recv().await {
        // Let the requests that are ready in this turn queue theirs.
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(queued) => batch.push(queued),
                Err(_) => break,
            }
        }
        m::hot::count(m::DIRECT_WRITES, &[], 1);
        m::hot::count(m::DIRECT_SCRIPTS, &[], batch.len() as u64);
        let mut conn = conn.clone();
        // The answers come on their own task, so the next batch need not
        // wait for this one's.
        tokio::spawn(async move {
            if batch.len() == 1 {
                let Queued { cmd, reply } = batch.pop().expect("one command");
                let answer = timeout(limit, conn.send_packed_command(&cmd)).await;
                let _ = reply.send(answer.unwrap_or_else(|_| Err(timed_out())));
                return;
            }
            let mut pipe = redis::Pipeline::with_capacity(batch.len());
            let mut replies = Vec::with_capacity(batch.len());
            for Queued { cmd, reply } in batch {
                pipe.add_command(cmd);
                replies.push(reply);
            }
            let answer = timeout(limit, conn.send_packed_commands(&pipe, 0, replies.len())).await;
            match answer.unwrap_or_else(|_| Err(timed_out())) {
                Ok(values) if values.len() == replies.len() => {
                    for (reply, value) in replies.into_iter().zip(values) {
                        let _ = reply.send(Ok(value));
                    }
                }
                Ok(values) => {
                    let err = redis::RedisError::from((
                        redis::ErrorKind::Parse,
                        "pipeline answered a different number of replies",
                        format!("{} for {} commands", values.len(), replies.len()),
                    ));
                    for reply in replies {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
                Err(err) => {
                    for reply in replies {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
            }
        });
    }
}

/// What the requests still waiting get when their batch had no answer in
/// time (each has its own deadline, so normally none is left).
fn timed_out() -> redis::RedisError {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no answer from the master in time",
    )
    .into()
}

impl ConnectionLike for Batched {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.send(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _pipeline: &'a redis::Pipeline,
        _offset: usize,
        _count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async {
            Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "pipelines are not sent over the batched direct path",
            )))
        })
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}
