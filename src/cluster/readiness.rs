//! Readiness: whether `/readyz` answers 200, shared by whoever can make the
//! process unready (the background probe of the cluster, the shutdown path),
//! and the one place that sets `seathold_cluster_ready`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::metrics as m;

/// The readiness verdict and why.
#[derive(Debug)]
pub struct Readiness {
    /// The last probe found the cluster usable.
    cluster_ok: AtomicBool,
    /// Shutdown has begun: never ready again.
    shutting_down: AtomicBool,
    /// The probe's last reason, for logs and `/readyz`.
    reason: Mutex<String>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self {
            cluster_ok: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            reason: Mutex::new("not connected to Redis Cluster yet".into()),
        }
    }
}

impl Readiness {
    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.cluster_ok.load(Ordering::Relaxed) && !self.shutting_down.load(Ordering::Relaxed)
    }

    /// Whether shutdown has begun.
    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Why not ready (or that it is).
    pub fn reason(&self) -> String {
        if self.shutting_down.load(Ordering::Relaxed) {
            return "shutting down".into();
        }
        // A panic while the reason was being copied leaves a whole String:
        // a poisoned lock still holds a usable value.
        self.reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The probe's verdict; logs changes only (the probe runs twice a second).
    pub fn set_cluster(&self, ok: bool, why: &str) {
        // Under the lock, as in `start_shutdown`: the gauge is set in the
        // order the verdicts change, never to a reading taken before
        // shutdown began after shutdown set it to 0.
        let mut reason = self
            .reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let was = self.cluster_ok.swap(ok, Ordering::Relaxed);
        self.publish();
        if was != ok || *reason != why {
            if ok {
                tracing::info!("{why}");
            } else {
                tracing::warn!(reason = why, "not ready");
            }
            why.clone_into(&mut reason);
        }
    }

    /// Shutdown begins: unready from now on, whatever the probe finds.
    pub fn start_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
        let _in_order = self
            .reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.publish();
    }

    fn publish(&self) {
        metrics::gauge!(m::CLUSTER_READY).set(if self.is_ready() { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shutdown_wins_over_the_probe() {
        let r = Readiness::default();
        assert!(!r.is_ready());
        r.set_cluster(true, "ok");
        assert!(r.is_ready());
        r.start_shutdown();
        r.set_cluster(true, "ok");
        assert!(!r.is_ready());
        assert_eq!(r.reason(), "shutting down");
    }
}
