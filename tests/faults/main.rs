//! Faults, one binary on one cluster: Redis masters killed under load,
//! replicas frozen under a confirm, the whole cluster frozen or gone, and the
//! daemon shut down under load. Every test here changes the cluster's shape
//! or needs it whole, so each takes the binary's lock exclusively
//! ([`common::exclusive`]) and leaves the cluster healthy
//! ([`common::heal`]).

#[path = "../common/mod.rs"]
mod common;

mod failover;
mod outage;
mod shutdown;
