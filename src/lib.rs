//! seathold: holds seats for high-traffic ticket sales on Redis Cluster.
//!
//! Exactly one customer gets a seat; an abandoned hold gives the seat back by
//! itself when its TTL runs out; only the holder (who has the hold token) can
//! release, extend or confirm it. Seats are Redis keys
//! `seat-hold:{show:<show>}:<seat>` set with `SET … NX PX` semantics by Lua
//! scripts, and all of one show's keys share a hash tag, hence a slot.
//!
//! # Layout
//!
//! - [`config`]: the command line and environment, and its checks.
//! - [`server`]: accept loop, graceful shutdown, `seathold dev`.
//! - [`http`]: routing, bodies, responses.
//! - [`hold`]: the hold operations behind the routes.
//! - [`error`]: the one error type and its status codes and bodies.
//! - [`keys`]: id rules, the key schema, hash slots (CRC16 as Redis does).
//! - [`scripts`]: the Lua scripts of `lua/`, run by EVALSHA.
//! - [`cluster`]: the Redis Cluster connection, slot map, readiness.
//! - [`expiry`]: counts expired holds from every master's keyspace events.
//! - [`metrics`]: metric names and the Prometheus recorder.
//! - [`dev`]: a local Redis Cluster from `redis-server`, for `seathold dev`
//!   and the tests.

pub mod cluster;
pub mod config;
pub mod dev;
pub mod error;
pub mod expiry;
pub mod hold;
pub mod http;
pub mod keys;
pub mod metrics;
pub mod scripts;
pub mod server;

/// Sets up logging to stderr in the chosen format.
pub fn init_tracing(format: config::LogFormat, filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        config::LogFormat::Text => builder.try_init(),
        config::LogFormat::Json => builder.json().try_init(),
    };
}
