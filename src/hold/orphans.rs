//! The background releases of holds left without an answer
//! ([`super::Service`]'s `abandon_later`), kept track of so that shutdown
//! can give them a last chance instead of dropping them with the process:
//! a hold whose 503 went out just before SIGTERM (during a rolling restart,
//! say) would otherwise keep its seats for its whole TTL.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// The releases still running, and whether the daemon is stopping.
#[derive(Debug)]
pub struct Orphans {
    pending: watch::Sender<usize>,
    closing: watch::Sender<bool>,
}

impl Default for Orphans {
    fn default() -> Self {
        Self {
            pending: watch::channel(0).0,
            closing: watch::channel(false).0,
        }
    }
}

/// Least pause between attempts once the daemon is stopping, in ms; each
/// release adds up to as much again of its own (so that thousands of them,
/// after an outage, do not all hit a master that just came back at once).
const CLOSING_PAUSE_MS: u64 = 50;

impl Orphans {
    /// Counts a release as running until the answer is dropped; `seed`
    /// (random, such as the hold's ref) spreads its attempts at shutdown.
    pub fn start(self: &Arc<Self>, seed: u64) -> Running {
        self.pending.send_modify(|n| *n += 1);
        Running {
            orphans: Arc::clone(self),
            closing: self.closing.subscribe(),
            jitter: Duration::from_millis(seed % CLOSING_PAUSE_MS),
        }
    }

    /// At shutdown: every release starts a new attempt at once (one waiting
    /// on Redis gives its attempt up for a new one with a whole Redis
    /// timeout), then tries every 50-100 ms, until all have ended or `bound`
    /// has passed. Answers how many had not.
    pub async fn drain(&self, bound: Duration) -> usize {
        self.closing.send_replace(true);
        let mut pending = self.pending.subscribe();
        // Err: the sender is this struct, alive here.
        let _ = tokio::time::timeout(bound, pending.wait_for(|n| *n == 0)).await;
        let left = *pending.borrow();
        left
    }
}

/// One running release; ends its count when dropped.
pub struct Running {
    orphans: Arc<Orphans>,
    closing: watch::Receiver<bool>,
    jitter: Duration,
}

impl Running {
    /// Runs `attempt` to its end, or until the daemon starts stopping
    /// (`None`: start a new one).
    pub async fn unless_closing<T>(
        &mut self,
        attempt: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        if *self.closing.borrow() {
            return Some(attempt.await);
        }
        tokio::select! {
            done = attempt => Some(done),
            _ = self.closing.wait_for(|c| *c) => None,
        }
    }

    /// Waits `backoff` before the next attempt, or less once the daemon is
    /// stopping.
    pub async fn pause(&mut self, backoff: Duration) {
        if *self.closing.borrow() {
            tokio::time::sleep(Duration::from_millis(CLOSING_PAUSE_MS) + self.jitter).await;
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = self.closing.wait_for(|c| *c) => {}
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.orphans.pending.send_modify(|n| *n -= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drain_waits_for_running_releases_and_wakes_them() {
        let orphans = Arc::new(Orphans::default());
        assert_eq!(orphans.drain(Duration::from_millis(10)).await, 0);

        let orphans = Arc::new(Orphans::default());
        let mut running = orphans.start(7);
        let task = tokio::spawn(async move {
            // A long backoff, cut short by the drain.
            running.pause(Duration::from_secs(60)).await;
            running.pause(Duration::from_secs(60)).await;
        });
        let started = std::time::Instant::now();
        assert_eq!(orphans.drain(Duration::from_secs(5)).await, 0);
        assert!(started.elapsed() < Duration::from_secs(1));
        task.await.expect("task");

        // An attempt waiting on Redis gives way to a new one.
        let orphans = Arc::new(Orphans::default());
        let mut running = orphans.start(7);
        let task = tokio::spawn(async move {
            let first = running
                .unless_closing(tokio::time::sleep(Duration::from_secs(60)))
                .await;
            let second = running.unless_closing(async { 2 }).await;
            (first, second)
        });
        tokio::task::yield_now().await;
        assert_eq!(orphans.drain(Duration::from_secs(5)).await, 0);
        assert_eq!(task.await.expect("task"), (None, Some(2)));

        let orphans = Arc::new(Orphans::default());
        let _stuck = orphans.start(7);
        assert_eq!(orphans.drain(Duration::from_millis(50)).await, 1);
    }
}
