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
//! A request flows `server` -> `http` -> `hold` -> `cluster` -> `scripts`.
//!
//! - [`config`]: the command line and environment, and its checks.
//! - [`server`]: accept loop, graceful shutdown, `seathold dev`'s banner.
//! - [`tasks`]: background tasks, started and stopped the same way.
//! - [`http`]: routes and their methods, bodies, one handler per route, and
//!   the OpenAPI document of them all (`docs/openapi.json`), compiled in.
//! - [`ids`]: show, seat and token ids, parsed once at the HTTP edge.
//! - [`idempotency`]: `Idempotency-Key`s, request fingerprints, recorded outcomes.
//! - [`model`]: every body the API answers with, typed.
//! - [`error`]: the one error type, its status codes and bodies.
//! - [`hold`]: the hold operations: typed ids in, one script, a shaped
//!   answer; holds, changes, pools and settings.
//! - [`keys`]: the key schema and hash slots (CRC16 as Redis does).
//! - [`scripts`]: the Lua scripts of `lua/`, run by EVALSHA.
//! - [`cluster`]: the Redis Cluster side: slot map, direct per-master path
//!   (scripts batched into one write per master),
//!   confirm's dedicated connections and `WAIT`, fault classes, the request
//!   deadline, readiness.
//! - [`events`]: event streams: `expired` events once, per-show readers,
//!   SSE, and the local seat view of busy shows.
//! - [`ui`]: the live seat-map page, compiled in.
//! - [`expiry`]: keyspace events of expired holds: the sweeper's wake-up hint.
//! - [`metrics`]: metric names, the Prometheus recorder and its upkeep.
//! - [`dev`]: a local Redis Cluster from `redis-server`, for `seathold dev`
//!   and the tests.
//! - [`doctor`]: `seathold doctor`, the pre-on-sale checks of a cluster.
//! - [`delete_show`]: `seathold delete-show`, the keys of shows that are over.
//! - [`logging`]: log lines on stderr, text or JSON.

pub mod cluster;
pub mod config;
pub mod delete_show;
pub mod dev;
pub mod doctor;
pub mod error;
pub mod events;
pub mod expiry;
pub mod hold;
pub mod http;
pub mod idempotency;
pub mod ids;
pub mod keys;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod scripts;
pub mod server;
pub mod tasks;
pub mod ui;
