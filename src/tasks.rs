//! Background tasks, all started the same way and stopped by the same
//! signal: each gets a receiver that turns `true` at shutdown, and
//! [`Background::stop`] sends it and waits for every task to return.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The daemon's background tasks.
pub struct Background {
    stop: watch::Sender<bool>,
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

impl Default for Background {
    fn default() -> Self {
        Self {
            stop: watch::channel(false).0,
            tasks: Vec::new(),
        }
    }
}

impl Background {
    /// Starts task `name`, which must return soon after its receiver turns
    /// `true`.
    pub fn spawn<F, Fut>(&mut self, name: &'static str, task: F)
    where
        F: FnOnce(watch::Receiver<bool>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let handle = tokio::spawn(task(self.stop.subscribe()));
        self.tasks.push((name, handle));
    }

    /// Tells every task to stop and waits until they have.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        for (name, task) in self.tasks {
            if let Err(err) = task.await {
                tracing::warn!(task = name, error = %err, "background task failed");
            }
        }
    }
}
