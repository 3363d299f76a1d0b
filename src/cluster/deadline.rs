//! The request's deadline: made once when a request arrives, passed down,
//! and every Redis await of that request goes through [`Deadline::run`], so
//! `--redis-timeout-ms` bounds all of one request's Redis work together
//! (lookup, script, connection set-up, `WAIT`), not each step on its own.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::fault::RedisFault;
use crate::error::Error;
use crate::metrics as m;

/// When a request's Redis work must be done.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    /// A deadline `budget` from now.
    pub fn after(budget: Duration) -> Self {
        Self {
            at: Instant::now() + budget,
            budget,
        }
    }

    /// Time left until the deadline (zero once passed).
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Runs `fut` until the deadline; past it the answer is 503
    /// `redis_unavailable` (timeout). The one timeout of Redis work.
    pub async fn within<T>(&self, fut: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match tokio::time::timeout_at(self.at, fut).await {
            Ok(result) => result,
            Err(_) => Err(Error::RedisUnavailable(
                RedisFault::Timeout,
                format!("no answer from Redis within {} ms", self.budget.as_millis()),
            )),
        }
    }

    /// Runs `fut`, Redis operation `op` of a request, until the deadline: records its
    /// latency under `op` and, on failure, counts and logs the fault. Past
    /// the deadline the answer is 503 `redis_unavailable` (timeout).
    pub async fn run<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let start = Instant::now();
        let result = self.within(fut).await;
        match &result {
            Err(Error::RedisUnavailable(fault, detail)) => {
                metrics::counter!(m::REDIS_ERRORS, "kind" => fault.label()).increment(1);
                tracing::warn!(op, kind = fault.label(), %detail, "Redis request failed");
            }
            Err(Error::RedisRefused(fault, detail)) => {
                metrics::counter!(m::REDIS_ERRORS, "kind" => fault.label()).increment(1);
                tracing::error!(op, kind = fault.label(), %detail, "Redis refused the operation");
            }
            Err(Error::Internal(detail)) => tracing::error!(op, %detail, "unexpected Redis reply"),
            _ => {}
        }
        m::hot::observe(
            m::REDIS_DURATION,
            &[("op", op)],
            start.elapsed().as_secs_f64(),
        );
        result
    }
}
