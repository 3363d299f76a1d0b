//! The command line. Every flag also reads an environment variable, so the
//! daemon can be configured entirely from its deployment's environment.

use std::net::SocketAddr;
use std::time::Duration;

use std::collections::BTreeSet;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::hold::Limits;

mod redis;

/// seathold: holds seats for high-traffic ticket sales on Redis Cluster.
#[derive(Debug, Parser)]
#[command(name = "seathold", version, about, long_about = None, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: Options,
}

impl Cli {
    /// Parses the command line and the `SEATHOLD_*` environment, as
    /// [`Parser::parse`] does (exiting on an error or `--help`), and
    /// records in the options which flags were given, on the command line
    /// or in the environment, rather than left at their defaults
    /// ([`Options::given`]).
    pub fn parse_recording_given() -> Self {
        let matches = Cli::command().get_matches();
        let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        cli.record_given(&matches);
        cli
    }

    /// Fills [`Options::given`] of the options run from `matches`.
    pub fn record_given(&mut self, matches: &ArgMatches) {
        let (opts, sub) = match &mut self.command {
            None => (&mut self.serve, Some(matches)),
            Some(Command::Serve(opts)) => (opts, matches.subcommand_matches("serve")),
            Some(Command::Dev(dev)) => (&mut dev.options, matches.subcommand_matches("dev")),
            Some(Command::Doctor(doctor)) => {
                (&mut doctor.options, matches.subcommand_matches("doctor"))
            }
            Some(Command::DeleteShow(delete)) => (
                &mut delete.options,
                matches.subcommand_matches("delete-show"),
            ),
        };
        if let Some(sub) = sub {
            opts.given = sub
                .ids()
                .filter(|id| {
                    matches!(
                        sub.value_source(id.as_str()),
                        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                    )
                })
                .map(|id| id.as_str().to_owned())
                .collect();
        }
    }
}

/// What to run.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the API against an existing Redis Cluster (the default).
    Serve(Options),
    /// Start a local Redis Cluster (3 masters, 3 replicas) from the
    /// redis-server on PATH, in a temporary folder, and serve against it.
    /// Ctrl-C stops the daemon and every process it started.
    Dev(DevOptions),
    /// Check a Redis Cluster before an on-sale: state and slot coverage,
    /// replicas, the redis.conf settings seathold needs, the user's ACL
    /// rights, the nodes' clocks and script loading. Prints one line per
    /// check (PASS, WARN or FAIL, what was found, what to change); exits 1
    /// when a check fails. Takes serve's flags and uses the Redis ones,
    /// --key-prefix, --redis-timeout-ms and --confirm-wait-replicas.
    Doctor(DoctorOptions),
    /// Delete every Redis key of shows that are over: sold seats, sale
    /// records, event streams, pools, settings and holder counters have no
    /// TTL. Takes serve's flags and uses the Redis ones and --key-prefix;
    /// run it as a user that may run CLUSTER NODES, COUNTKEYSINSLOT and
    /// GETKEYSINSLOT, and UNLINK. Prints one line per show; exits 1 when a
    /// show was refused (live holds, without --force) or not found, or Redis
    /// failed.
    DeleteShow(DeleteShowOptions),
}

/// Options of `seathold delete-show`.
#[derive(Debug, Args)]
pub struct DeleteShowOptions {
    #[command(flatten)]
    pub options: Options,
    /// The shows to delete.
    #[arg(required = true, value_name = "SHOW")]
    pub shows: Vec<String>,
    /// Delete a show even while it has live holds.
    #[arg(long)]
    pub force: bool,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Options of `seathold doctor`: those of `serve`, so that the doctor checks
/// exactly what the daemon will use.
#[derive(Debug, Args)]
pub struct DoctorOptions {
    #[command(flatten)]
    pub options: Options,
}

/// Options of `seathold dev`.
#[derive(Debug, Args)]
pub struct DevOptions {
    #[command(flatten)]
    pub options: Options,
    /// Masters of the local cluster.
    #[arg(long, env = "SEATHOLD_DEV_MASTERS", default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub masters: u16,
    /// Replicas per master of the local cluster.
    #[arg(long, env = "SEATHOLD_DEV_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=4))]
    pub replicas: u16,
}

/// A feature switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

impl Switch {
    pub fn is_on(self) -> bool {
        self == Self::On
    }
}

/// Which routes `--api-token` guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenScope {
    /// The `PUT` routes (pool capacities and show settings), as the
    /// contract has it: what configures a sale, not what buyers do.
    Config,
    /// Every write: `POST`, `PUT`, `PATCH` and `DELETE` under `/v1`.
    Writes,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Options shared by `serve` and `dev`.
#[derive(Debug, Clone, Args)]
pub struct Options {
    /// Address to serve HTTP on.
    #[arg(long, env = "SEATHOLD_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Redis Cluster seed nodes, comma-separated `redis://host:port` or
    /// `rediss://host:port` URLs (credentials may be in the URLs). Refused
    /// by `dev`, which makes its own cluster.
    #[arg(
        long,
        env = "SEATHOLD_REDIS_NODES",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_nodes: Vec<String>,

    /// Redis ACL user name (overrides one in the URLs).
    #[arg(long, env = "SEATHOLD_REDIS_USERNAME")]
    pub redis_username: Option<String>,

    /// Redis password (overrides one in the URLs). Prefer the environment
    /// variable to the flag, which other users can see in the process list.
    #[arg(long, env = "SEATHOLD_REDIS_PASSWORD", hide_env_values = true)]
    pub redis_password: Option<String>,

    /// PEM file of the CA that signed the Redis nodes' TLS certificates
    /// (for `rediss://` nodes); without it the system's roots are used.
    #[arg(long, env = "SEATHOLD_REDIS_CA_FILE")]
    pub redis_ca_file: Option<std::path::PathBuf>,

    /// PEM client certificate, when Redis requires mutual TLS.
    #[arg(long, env = "SEATHOLD_REDIS_CERT_FILE", requires = "redis_key_file")]
    pub redis_cert_file: Option<std::path::PathBuf>,

    /// PEM key of --redis-cert-file.
    #[arg(long, env = "SEATHOLD_REDIS_KEY_FILE", requires = "redis_cert_file")]
    pub redis_key_file: Option<std::path::PathBuf>,

    /// Prefix of every key; must not contain braces. The default is the
    /// reference design's, so its `SET … NX PX` and seathold see each other.
    #[arg(long, env = "SEATHOLD_KEY_PREFIX", default_value = crate::keys::DEFAULT_PREFIX)]
    pub key_prefix: String,

    /// TTL of a hold when the request names none.
    #[arg(long, env = "SEATHOLD_DEFAULT_TTL_MS", default_value_t = 300_000)]
    pub default_ttl_ms: u64,

    /// Longest TTL a hold or extend may ask for.
    #[arg(long, env = "SEATHOLD_MAX_TTL_MS", default_value_t = 1_800_000)]
    pub max_ttl_ms: u64,

    /// Longest a hold may live from its creation, extends included
    /// (measured with Redis's clock).
    #[arg(
        long,
        env = "SEATHOLD_MAX_HOLD_LIFETIME_MS",
        default_value_t = 7_200_000
    )]
    pub max_hold_lifetime_ms: u64,

    /// Most seats in one hold (and in one batch seat-state read).
    #[arg(long, env = "SEATHOLD_MAX_SEATS_PER_HOLD", default_value_t = 20)]
    pub max_seats_per_hold: usize,

    /// Replicas that must acknowledge a sale (Redis WAIT) before a confirm
    /// answers 200; 0 skips WAIT.
    #[arg(long, env = "SEATHOLD_CONFIRM_WAIT_REPLICAS", default_value_t = 1)]
    pub confirm_wait_replicas: u32,

    /// How long a confirm waits for those replicas; must be below
    /// --redis-timeout-ms.
    #[arg(
        long,
        env = "SEATHOLD_CONFIRM_WAIT_TIMEOUT_MS",
        default_value_t = 1_000
    )]
    pub confirm_wait_timeout_ms: u64,

    /// The longest any request waits on Redis; past it the answer is 503.
    #[arg(long, env = "SEATHOLD_REDIS_TIMEOUT_MS", default_value_t = 2_000)]
    pub redis_timeout_ms: u64,

    /// After SIGTERM/SIGINT, how long to keep serving (with /readyz at 503)
    /// so load balancers take the instance out of rotation. Default 5000
    /// for `serve`, 0 for `dev` (nothing balances load in front of it).
    #[arg(long, env = "SEATHOLD_SHUTDOWN_DRAIN_MS")]
    pub shutdown_drain_ms: Option<u64>,

    /// Largest request body accepted; larger ones get 413.
    #[arg(long, env = "SEATHOLD_MAX_BODY_BYTES", default_value_t = 65_536)]
    pub max_body_bytes: usize,

    /// Most requests served at once; past it a request gets 503
    /// `overloaded` at once instead of queueing.
    #[arg(long, env = "SEATHOLD_MAX_IN_FLIGHT", default_value_t = 1024)]
    pub max_in_flight: usize,

    /// Most open HTTP connections; past it a new connection gets one 503
    /// `overloaded` and is closed.
    #[arg(long, env = "SEATHOLD_MAX_CONNECTIONS", default_value_t = 8192)]
    pub max_connections: usize,

    /// How long a client may take to send a request's head (slowloris
    /// guard); an idle keep-alive connection is closed after it too. The
    /// body has its own bound, --body-read-timeout-ms.
    #[arg(
        long,
        env = "SEATHOLD_HEADER_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub header_read_timeout_ms: u64,

    /// How long a client may take to send a request's body once its head
    /// has arrived (then 408). Bodies are read before a request takes one
    /// of the --max-in-flight slots, so slow senders cannot hold them.
    #[arg(long, env = "SEATHOLD_BODY_READ_TIMEOUT_MS", default_value_t = 2_000)]
    pub body_read_timeout_ms: u64,

    /// How long the outcome of a request with an Idempotency-Key is kept
    /// (a repeat within it answers that outcome again).
    #[arg(
        long,
        env = "SEATHOLD_IDEMPOTENCY_TTL_MS",
        default_value_t = 86_400_000
    )]
    pub idempotency_ttl_ms: u64,

    /// Event streams: every hold transition written to the show's Redis
    /// Stream in the same script, `expired` events, and
    /// `GET /v1/shows/{show}/events`. `off` removes all three.
    #[arg(long, env = "SEATHOLD_EVENTS", value_enum, default_value_t = Switch::On)]
    pub events: Switch,

    /// Approximate length cap of each show's event stream.
    #[arg(long, env = "SEATHOLD_EVENTS_MAX_LEN", default_value_t = 10_000)]
    pub events_max_len: u64,

    /// How often the masters are scanned for deadline indexes when nothing
    /// asked for a scan sooner (start, a restarted expiry subscription, a
    /// changed slot map). Each period one instance scans each master: the
    /// first to take that master's scan lease.
    #[arg(
        long,
        env = "SEATHOLD_SWEEP_SCAN_INTERVAL_MS",
        default_value_t = 60_000
    )]
    pub sweep_scan_interval_ms: u64,

    /// Most shows this instance reads the event stream of at once (for
    /// their SSE subscribers and seat views), each over a Redis connection
    /// of its own (XREAD BLOCK stalls a shared one). Past it, a stream of
    /// one more show is refused with 503 `overloaded`; seat views start
    /// readers only up to half of it (past that a busy show gets no view of
    /// its own, and Redis answers it). The events route needs no token: it
    /// bounds what clients naming many shows cost the masters' connections.
    #[arg(long, env = "SEATHOLD_MAX_EVENT_READERS", default_value_t = 1000)]
    pub max_event_readers: usize,

    /// How often an event stream (SSE) without events sends a comment
    /// line, so that proxies keep it open.
    #[arg(long, env = "SEATHOLD_SSE_HEARTBEAT_MS", default_value_t = 15_000)]
    pub sse_heartbeat_ms: u64,

    /// The local seat view of busy shows answers conflicts and reads from
    /// the show's event stream only while its reader is current within this
    /// bound (ms); a seat released through another instance this recently
    /// may still be refused, as if another customer had won it (this
    /// instance's own changes are never answered from before them). 0 turns
    /// the view off. Needs events.
    #[arg(long, env = "SEATHOLD_VIEW_MAX_LAG_MS", default_value_t = 250)]
    pub view_max_lag_ms: u64,

    /// Requests per second for one show that a local seat view could have
    /// answered (seat reads, and holds Redis refused) that give the show
    /// one (0: its first such request); granted holds do not count.
    #[arg(long, env = "SEATHOLD_VIEW_MIN_RATE", default_value_t = 50)]
    pub view_min_rate: u32,

    /// The seat-map page at /ui/shows/{show}; `off` removes it.
    #[arg(long, env = "SEATHOLD_UI", value_enum, default_value_t = Switch::On)]
    pub ui: Switch,

    /// Most seats plus pool units one holder may have held or bought in a
    /// show, where the show's settings (PUT /v1/shows/{show}/settings) name
    /// none; 0 is no limit.
    #[arg(long, env = "SEATHOLD_MAX_PER_HOLDER", default_value_t = 0)]
    pub max_per_holder: u64,

    /// When set, the PUT routes under /v1 (pool capacities, show settings)
    /// need `Authorization: Bearer <token>`, and with `--api-token-scope
    /// writes` every POST, PATCH and DELETE too; reads, health and metrics
    /// stay open. Prefer the environment variable to the flag.
    #[arg(long, env = "SEATHOLD_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,

    /// Which routes --api-token guards: `config`, the PUT routes (pool
    /// capacities, show settings), or `writes`, every POST, PUT, PATCH and
    /// DELETE under /v1 (holds too).
    #[arg(long, env = "SEATHOLD_API_TOKEN_SCOPE", value_enum, default_value_t = TokenScope::Config)]
    pub api_token_scope: TokenScope,

    /// How often an idle expiry-event subscription is pinged, to notice a
    /// master that vanished without closing the connection.
    #[arg(
        long,
        env = "SEATHOLD_EXPIRY_PING_INTERVAL_MS",
        default_value_t = 5_000,
        value_parser = clap::value_parser!(u64).range(100..)
    )]
    pub expiry_ping_interval_ms: u64,

    /// Log format.
    #[arg(long, env = "SEATHOLD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or
    /// `info,seathold=debug` for a line per request. The default keeps the
    /// Redis client's own retry warnings (twice a second while Redis is
    /// down) out: seathold logs each fault and readiness change itself.
    #[arg(long, env = "SEATHOLD_LOG", default_value = "info,redis=error")]
    pub log: String,

    /// The flags given on the command line or in the environment (clap's
    /// ids: field names such as `max_ttl_ms`), filled by
    /// [`Cli::parse_recording_given`]: [`Options::settle`] lowers only
    /// defaults, and a flag given equal to its default is given. Embedders
    /// that set fields directly may leave it empty: a value that differs
    /// from the default counts as given too.
    #[arg(skip)]
    pub given: BTreeSet<String>,

    /// Whether [`Options::settle`] ran: it runs once (main and the server
    /// both call it), so that what it logs is logged once.
    #[arg(skip)]
    pub settled: bool,
}

impl Default for Options {
    /// The parser's own defaults, so the two can never disagree, and
    /// without the `SEATHOLD_*` environment: a value set there is set, not
    /// a default ([`Options::settle`] lowers only defaults), and tests and
    /// embedders get the same defaults whatever the shell exports.
    fn default() -> Self {
        let matches = Cli::command()
            .mut_args(|arg| arg.env(None))
            .get_matches_from(["seathold"]);
        Cli::from_arg_matches(&matches)
            .expect("the defaults parse")
            .serve
    }
}

/// The ceiling of the hold and idempotency durations
/// (`--default-ttl-ms`, `--max-ttl-ms`, `--max-hold-lifetime-ms`,
/// `--idempotency-ttl-ms`): 10 years (of 365 days). Far past it the Lua
/// scripts see numbers they format as floats (every hold answered 500 from
/// about 1e17 ms) and expiries past the year 9999 have no RFC 3339 form.
pub const MAX_DURATION_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

/// The ceiling of `--events-max-len`.
pub const MAX_EVENTS_MAX_LEN: u64 = 1_000_000_000;

/// A contradiction in the configuration.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

impl Options {
    /// Fits the defaults of bounds that must agree to the ones set: a flag
    /// set alone (say `--max-hold-lifetime-ms 3000`, or `--redis-timeout-ms
    /// 500`) lowers the defaults it would contradict (`--max-ttl-ms` and
    /// `--default-ttl-ms`; `--confirm-wait-timeout-ms`) instead of stopping
    /// start-up; values set against each other still stop it
    /// ([`Options::validate`]). Each change is logged. A flag counts as
    /// set when it was given (on the command line or in the environment,
    /// [`Options::given`]), even equal to its default, or differs from its
    /// default. Runs once: a second call does nothing.
    pub fn settle(&mut self) {
        if self.settled {
            return;
        }
        self.settled = true;
        let defaults = Options::default();
        let given = self.given.clone();
        let lower = |id: &str, value: &mut u64, default: u64, to: u64, because: &str| {
            let flag = format!("--{}", id.replace('_', "-"));
            if !given.contains(id) && *value == default && *value > to {
                tracing::info!(
                    "{flag} lowered from its default {default} to {to}, to agree with {because}"
                );
                *value = to;
            }
        };
        let lifetime = self.max_hold_lifetime_ms;
        lower(
            "max_ttl_ms",
            &mut self.max_ttl_ms,
            defaults.max_ttl_ms,
            lifetime,
            "--max-hold-lifetime-ms",
        );
        let max_ttl = self.max_ttl_ms;
        lower(
            "default_ttl_ms",
            &mut self.default_ttl_ms,
            defaults.default_ttl_ms,
            max_ttl,
            "--max-ttl-ms",
        );
        let half = (self.redis_timeout_ms / 2).max(1);
        if self.confirm_wait_timeout_ms >= self.redis_timeout_ms {
            lower(
                "confirm_wait_timeout_ms",
                &mut self.confirm_wait_timeout_ms,
                defaults.confirm_wait_timeout_ms,
                half,
                "--redis-timeout-ms (half of it)",
            );
        }
        if self.api_token.as_deref().is_some_and(|t| t.len() < 16) {
            tracing::warn!(
                "--api-token is shorter than 16 characters: a token that can be guessed guards nothing"
            );
        }
        // A seat id is up to 64 characters; quoted, with its comma and the
        // body's other fields, about 70 bytes each.
        let largest_hold = self.max_seats_per_hold.saturating_mul(70);
        if self.max_body_bytes < largest_hold {
            tracing::warn!(
                "--max-body-bytes ({}) is below 70 bytes per seat of --max-seats-per-hold ({}): a hold of that many long seat ids (up to 64 characters) would get 413; raise --max-body-bytes to {largest_hold} or more",
                self.max_body_bytes,
                self.max_seats_per_hold
            );
        }
    }

    /// For a cluster with `replicas` per master (`seathold dev`): a confirm
    /// cannot wait for more replicas than a master has, or every confirm
    /// would answer 503 `not_replicated` after its wait, forever. The
    /// default (1) is lowered to `replicas`; a value set above it stops
    /// start-up.
    pub fn fit_confirm_wait_to(&mut self, replicas: u32) -> Result<(), ConfigError> {
        if self.confirm_wait_replicas <= replicas {
            return Ok(());
        }
        if !self.given.contains("confirm_wait_replicas")
            && self.confirm_wait_replicas == Options::default().confirm_wait_replicas
        {
            tracing::info!(
                "--confirm-wait-replicas lowered from its default {} to {replicas}: the local cluster has {replicas} replicas per master",
                self.confirm_wait_replicas
            );
            self.confirm_wait_replicas = replicas;
            return Ok(());
        }
        Err(ConfigError(format!(
            "--confirm-wait-replicas {} but the local cluster has {replicas} replicas per master (--replicas): no confirm could succeed",
            self.confirm_wait_replicas
        )))
    }

    /// Checks what clap cannot: bounds that must agree with each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError(m));
        if !crate::keys::valid_prefix(&self.key_prefix) {
            return fail(format!("--key-prefix {:?} must not contain braces: they would change every key's hash slot", self.key_prefix));
        }
        for (flag, value, ceiling, what) in [
            (
                "--default-ttl-ms",
                self.default_ttl_ms,
                MAX_DURATION_MS,
                "10 years",
            ),
            ("--max-ttl-ms", self.max_ttl_ms, MAX_DURATION_MS, "10 years"),
            (
                "--max-hold-lifetime-ms",
                self.max_hold_lifetime_ms,
                MAX_DURATION_MS,
                "10 years",
            ),
            (
                "--idempotency-ttl-ms",
                self.idempotency_ttl_ms,
                MAX_DURATION_MS,
                "10 years",
            ),
            (
                "--events-max-len",
                self.events_max_len,
                MAX_EVENTS_MAX_LEN,
                "a billion events",
            ),
        ] {
            if value > ceiling {
                return fail(format!(
                    "{flag} ({value}) must be at most {ceiling} ({what})"
                ));
            }
        }
        if self.default_ttl_ms == 0 || self.default_ttl_ms > self.max_ttl_ms {
            return fail(format!(
                "--default-ttl-ms ({}) must be positive and at most --max-ttl-ms ({})",
                self.default_ttl_ms, self.max_ttl_ms
            ));
        }
        if self.max_ttl_ms > self.max_hold_lifetime_ms {
            return fail(format!(
                "--max-ttl-ms ({}) must be at most --max-hold-lifetime-ms ({})",
                self.max_ttl_ms, self.max_hold_lifetime_ms
            ));
        }
        if self.max_seats_per_hold == 0 || self.max_seats_per_hold > 1000 {
            return fail("--max-seats-per-hold must be between 1 and 1000".into());
        }
        if self.redis_timeout_ms == 0 {
            return fail("--redis-timeout-ms must be positive".into());
        }
        if self.confirm_wait_replicas > 0 && self.confirm_wait_timeout_ms == 0 {
            return fail(
                "--confirm-wait-timeout-ms must be positive (0 would make WAIT block forever)"
                    .into(),
            );
        }
        if self.confirm_wait_timeout_ms >= self.redis_timeout_ms {
            return fail(format!(
                "--confirm-wait-timeout-ms ({}) must be below --redis-timeout-ms ({}), which bounds the whole confirm",
                self.confirm_wait_timeout_ms, self.redis_timeout_ms
            ));
        }
        if self.max_in_flight == 0 || self.max_connections == 0 || self.max_event_readers == 0 {
            return fail(
                "--max-in-flight, --max-connections and --max-event-readers must be at least 1"
                    .into(),
            );
        }
        if self.header_read_timeout_ms == 0 || self.body_read_timeout_ms == 0 {
            return fail(
                "--header-read-timeout-ms and --body-read-timeout-ms must be positive".into(),
            );
        }
        if self.sweep_scan_interval_ms < 1_000 {
            return fail("--sweep-scan-interval-ms must be at least 1000".into());
        }
        if self.sse_heartbeat_ms < 100 {
            return fail("--sse-heartbeat-ms must be at least 100".into());
        }
        if self.events_max_len == 0 {
            return fail(
                "--events-max-len must be at least 1 (--events off turns streams off)".into(),
            );
        }
        if self.idempotency_ttl_ms == 0 {
            return fail("--idempotency-ttl-ms must be positive".into());
        }
        if self.api_token.as_deref().is_some_and(str::is_empty) {
            return fail("--api-token must not be empty".into());
        }
        // What a client sends after `Bearer `: a token with a space, a
        // control character (a secret file's trailing newline) or non-ASCII
        // could never match, and every guarded route would answer 401.
        if self
            .api_token
            .as_deref()
            .is_some_and(|t| !t.bytes().all(|b| b.is_ascii_graphic()))
        {
            return fail(
                "--api-token must be visible ASCII (0x21-0x7E): no spaces, tabs, newlines (check the secret for a trailing one) or other characters a client cannot send in `Authorization: Bearer <token>`"
                    .into(),
            );
        }
        if self.max_body_bytes < 256 {
            return fail("--max-body-bytes must be at least 256".into());
        }
        Ok(())
    }

    /// The drain after SIGTERM/SIGINT (5000 ms unless set).
    pub fn shutdown_drain(&self) -> Duration {
        Duration::from_millis(self.shutdown_drain_ms.unwrap_or(5_000))
    }

    /// The settings `seathold dev` cannot honour, because it makes its own
    /// cluster: refused rather than silently ignored.
    pub fn refuse_for_dev(&self) -> Result<(), ConfigError> {
        let mut given = set_flags(&[
            (!self.redis_nodes.is_empty(), "--redis-nodes"),
            (self.redis_username.is_some(), "--redis-username"),
            (self.redis_password.is_some(), "--redis-password"),
        ]);
        given.extend(self.tls_flags());
        if given.is_empty() {
            return Ok(());
        }
        Err(ConfigError(format!(
            "seathold dev starts its own Redis Cluster and does not use {} (flags or SEATHOLD_REDIS_* variables); use `seathold serve` for an existing cluster",
            given.join(", ")
        )))
    }

    /// The hold limits.
    pub fn limits(&self) -> Limits {
        Limits {
            default_ttl_ms: self.default_ttl_ms,
            max_ttl_ms: self.max_ttl_ms,
            max_hold_lifetime_ms: self.max_hold_lifetime_ms,
            max_seats_per_hold: self.max_seats_per_hold,
            confirm_wait_replicas: self.confirm_wait_replicas,
            confirm_wait_timeout_ms: self.confirm_wait_timeout_ms,
            idempotency_ttl_ms: self.idempotency_ttl_ms,
            events_max_len: self.events.is_on().then_some(self.events_max_len),
            max_per_holder: self.max_per_holder,
        }
    }
}

/// The flags of `flags` that are set.
fn set_flags(flags: &[(bool, &'static str)]) -> Vec<&'static str> {
    flags
        .iter()
        .filter_map(|&(set, flag)| set.then_some(flag))
        .collect()
}

#[cfg(test)]
mod tests;
