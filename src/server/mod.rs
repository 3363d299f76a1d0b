//! The accept loop, graceful shutdown, and `seathold dev`.
//!
//! [`run`] takes the shutdown signal as a future, so tests start and stop
//! servers in-process. Shutdown is in three steps: `/readyz` turns 503 at
//! once; the server keeps accepting and serving for the drain time, so load
//! balancers notice and move traffic (every answer then closes its
//! connection: keep-alive clients move too); then it stops accepting, lets requests
//! in flight finish (bounded, since every Redis call is), gives the
//! background releases of holds answered 503 one more Redis timeout while
//! its tasks stop, and returns.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::cluster::{Cluster, Readiness};
use crate::config::{DevOptions, Options};
use crate::events::hub::Hub;
use crate::events::sweep::Sweeper;
use crate::events::view::Views;
use crate::hold::Service;
use crate::http::App;
use crate::keys::KeySpace;
use crate::scripts::Scripts;
use crate::tasks::Background;

mod accept;
use accept::Accept;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Redis(#[from] crate::cluster::ConfigError),
    #[error("cannot listen on {addr}: {source}{}", in_use_hint(source))]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Dev(#[from] crate::dev::DevError),
}

/// Checks what start-up can check before it binds the port: the settings,
/// and the Redis options (seeds, their URLs, the TLS files). A missing
/// seed is then named even while the port is taken.
pub fn check(opts: &Options) -> Result<(), StartError> {
    opts.validate()?;
    let redis = opts.redis()?;
    Cluster::new(&redis, Scripts::embedded(), Arc::default())?;
    Ok(())
}

/// Builds the application state for `opts`; connects to Redis in the
/// background (see [`run`]).
pub fn app(opts: &Options) -> Result<Arc<App>, StartError> {
    opts.validate()?;
    let redis = opts.redis()?;
    let readiness = Arc::new(Readiness::default());
    let cluster = Cluster::new(&redis, Scripts::embedded(), Arc::clone(&readiness))?;
    let metrics = crate::metrics::install();
    crate::metrics::register_zeroes();
    let keys = KeySpace::new(opts.key_prefix.clone());
    let events = opts.events.is_on().then(|| {
        // A reader is current as of when it sent its last XREAD that came
        // back short; on a quiet stream the next one comes back a block
        // later, so that time is up to two blocks (and round trips) old.
        // Blocking a third of the view's lag bound keeps it within the
        // bound, and the view answering.
        let block = match opts.view_max_lag_ms {
            0 => Duration::from_millis(crate::events::hub::BLOCK_MS),
            lag => Duration::from_millis((lag / 3).max(10)),
        };
        let hub = Hub::new(
            Arc::clone(&cluster),
            keys.clone(),
            block,
            opts.events_max_len,
            opts.max_event_readers,
        );
        crate::events::Events {
            sweeper: Sweeper::new(
                Arc::clone(&cluster),
                keys.clone(),
                opts.events_max_len,
                Duration::from_millis(opts.sweep_scan_interval_ms),
            ),
            views: (opts.view_max_lag_ms > 0).then(|| {
                Arc::new(Views::new(
                    Arc::clone(&hub),
                    Arc::clone(&cluster),
                    keys.clone(),
                    opts.view_max_lag_ms,
                    opts.view_min_rate,
                ))
            }),
            hub,
            heartbeat: Duration::from_millis(opts.sse_heartbeat_ms),
        }
    });
    let sweeper = events.as_ref().map(|e| Arc::clone(&e.sweeper));
    let views = events.as_ref().and_then(|e| e.views.clone());
    let service = Service::new(cluster, keys, opts.limits(), sweeper, views);
    Ok(Arc::new(App::new(
        service, metrics, readiness, events, opts,
    )))
}

/// Starts the background work of `app`: the cluster's upkeep (connection,
/// slot map, readiness), the expiry subscriptions, the sweeper of `expired`
/// events and the metrics upkeep.
fn background(app: &App, opts: &Options) -> Background {
    let mut tasks = Background::default();
    let cluster = Arc::clone(app.service.cluster());
    tasks.spawn("cluster", |stop| cluster.maintain(stop));
    let (cluster, keys) = (
        Arc::clone(app.service.cluster()),
        app.service.keys().clone(),
    );
    let ping = Duration::from_millis(opts.expiry_ping_interval_ms);
    let sweeper = app.events.as_ref().map(|e| Arc::clone(&e.sweeper));
    tasks.spawn("expiry", move |stop| {
        crate::expiry::run(cluster, keys, ping, sweeper, stop)
    });
    if let Some(events) = &app.events {
        let sweeper = Arc::clone(&events.sweeper);
        tasks.spawn("sweeper", |stop| sweeper.run(stop));
    }
    let handle = app.metrics.clone();
    tasks.spawn("metrics", |stop| crate::metrics::upkeep(handle, stop));
    tasks
}

/// Binds `opts.listen`.
pub async fn bind(opts: &Options) -> Result<TcpListener, StartError> {
    TcpListener::bind(opts.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: opts.listen,
            source,
        })
}

/// What to do about an address in use (another seathold, maybe a `seathold
/// dev` still running).
fn in_use_hint(err: &std::io::Error) -> &'static str {
    if err.kind() == std::io::ErrorKind::AddrInUse {
        " (another process, maybe another seathold, listens there; --listen picks another address)"
    } else {
        ""
    }
}

/// Serves the API on `listener` until `shutdown` completes, then shuts down
/// gracefully as described in the module docs.
pub async fn run(
    opts: Options,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let mut opts = opts;
    opts.settle();
    let app = app(&opts)?;
    let tasks = background(&app, &opts);
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving HTTP");
    }

    let graceful = GracefulShutdown::new();
    let accept = Accept {
        listener: &listener,
        app: &app,
        graceful: &graceful,
        open: Arc::new(AtomicUsize::new(0)),
        max_connections: opts.max_connections,
        header_read_timeout: Duration::from_millis(opts.header_read_timeout_ms),
    };
    accept.until(shutdown).await;

    app.readiness.start_shutdown();
    let drain = opts.shutdown_drain();
    tracing::info!(
        drain_ms = drain.as_millis() as u64,
        "shutdown requested: /readyz answers 503; draining"
    );
    accept.until(tokio::time::sleep(drain)).await;
    accept.take_queued();
    drop(accept);
    drop(listener);
    // hyper closes a connection on which it has read nothing yet as soon as
    // graceful shutdown starts, even when its request is already on the
    // wire: give the connections accepted last a moment to be read.
    tokio::time::sleep(ACCEPTED_LAST_GRACE).await;

    // A request in flight ends within the body's read timeout (its Redis
    // deadline starts once the body is in) plus the Redis timeout; the
    // margin covers writing the response. Cut short, a hold's script may
    // have run with no one to answer.
    // Event streams would hold their connections open forever: they end now.
    app.closing.send_replace(true);
    let bound = Duration::from_millis(opts.body_read_timeout_ms)
        + Duration::from_millis(opts.redis_timeout_ms)
        + Duration::from_secs(1);
    if tokio::time::timeout(bound, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not finish in time; closing them");
    }
    if let Some(events) = &app.events {
        events.hub.close();
    }
    // Holds answered 503 before now may have run in Redis after all: their
    // background releases get one more Redis timeout, alongside the tasks'
    // stop. (A request still running after the bound above goes on in its
    // connection's task; a release it starts after this is dropped.)
    let orphans = app
        .service
        .drain_orphans(Duration::from_millis(opts.redis_timeout_ms));
    // No hold comes any more: the shows this instance would have swept go
    // to the instances that go on.
    let hand_over = async {
        if let Some(events) = &app.events {
            events.sweeper.hand_over().await;
        }
    };
    let ((), (), left) = tokio::join!(hand_over, tasks.stop(), orphans);
    if left > 0 {
        tracing::warn!(
            holds = left,
            "holds left without an answer were not released in time; they expire by themselves"
        );
    }
    tracing::info!("stopped");
    Ok(())
}

/// How long connections accepted at the end of the drain get to deliver
/// their request before graceful shutdown closes the ones that sent nothing.
const ACCEPTED_LAST_GRACE: Duration = Duration::from_millis(100);

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Completes on the first SIGINT or SIGTERM, as [`shutdown_signal`]; a
/// second one stops the process at once (exit code 130), without the rest
/// of the drain: for an operator at a terminal who will not wait it out.
/// (`seathold dev` keeps to one signal: it has nodes to stop after the
/// daemon, and no drain.)
pub async fn shutdown_signal_then_force() {
    shutdown_signal().await;
    tokio::spawn(async {
        shutdown_signal().await;
        tracing::warn!(
            "a second signal: stopping now, without the rest of the drain; requests in flight get no answer, and holds answered 503 that were not released yet expire by themselves"
        );
        std::process::exit(130);
    });
}

/// Prints a line of `seathold dev`'s banner. Unlike `println!` it does not
/// panic when stdout is closed (`seathold dev | head`): the banner is a
/// courtesy, not worth dying for.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// Where a browser on this machine reaches the seat map: a wildcard listen
/// address (`0.0.0.0`, `[::]`) is not one to browse, and the page needs a
/// secure context (loopback counts) for `crypto.subtle`.
fn page_base(listener: &TcpListener, opts: &Options) -> String {
    let mut addr = listener.local_addr().unwrap_or(opts.listen);
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    format!("http://{addr}")
}

/// `seathold dev`: a local cluster, the API on it, and a clean stop.
pub async fn dev(dev: DevOptions, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut opts = dev.options;
    opts.settle();
    opts.validate()?;
    opts.refuse_for_dev()?;
    opts.fit_confirm_wait_to(u32::from(dev.replicas))?;
    let listener = bind(&opts).await?;
    let plural = |n: u16, one: &str| match n {
        0 => format!("no {one}s"),
        1 => format!("1 {one}"),
        n => format!("{n} {one}s"),
    };
    let replicas = match dev.replicas {
        0 => "no replicas".to_owned(),
        n => format!("{} each", plural(n, "replica")),
    };
    say!(
        "starting a local Redis Cluster ({}, {replicas})...",
        plural(dev.masters, "master")
    );
    let start = crate::dev::LocalCluster::start(crate::dev::ClusterOptions {
        masters: usize::from(dev.masters),
        replicas_per_master: usize::from(dev.replicas),
        extra_config: vec![("notify-keyspace-events".into(), "Ex".into())],
        ..Default::default()
    });
    // `biased`: `shutdown` is polled before the start spawns its first
    // redis-server. A signal future installs its handler when first
    // polled; until then Ctrl-C kills the process outright, which would
    // leave the nodes started so far and their folders behind.
    let cluster = tokio::select! {
        biased;
        () = shutdown.as_mut() => {
            // Dropping `start` stops the nodes it started and removes
            // its folder.
            say!("stopped while the cluster was starting");
            return Ok(());
        }
        cluster = start => cluster?,
    };
    opts.redis_nodes = cluster.seed_urls();
    // Nothing balances load in front of a dev server: stop at once, unless
    // asked otherwise.
    opts.shutdown_drain_ms = opts.shutdown_drain_ms.or(Some(0));
    let url = format!("http://{}", listener.local_addr().unwrap_or(opts.listen));
    say!("Redis Cluster nodes: {}", opts.redis_nodes.join(","));
    say!("Redis data folder:   {}", cluster.dir().display());
    say!("seathold is serving on {url}  (Ctrl-C stops it and the cluster)\n");
    if opts.ui.is_on() {
        let page = format!("{}/ui/shows/42", page_base(&listener, &opts));
        say!("  open {page} in a browser for the live seat map of show 42\n");
    }
    say!("  curl -s -XPOST {url}/v1/shows/42/holds -H 'content-type: application/json' -d '{{\"seats\":[\"E7\",\"E8\"]}}'");
    say!("  curl -s {url}/v1/shows/42/seats/E7\n");
    if opts.api_token.is_some() {
        say!("  (this daemon wants its --api-token: add -H 'authorization: Bearer <token>')\n");
    }
    let result = run(opts, listener, shutdown).await;
    say!("stopping the local Redis Cluster...");
    let dir = cluster.dir().to_path_buf();
    cluster.stop();
    if dir.exists() {
        say!("stopped; its data stays in {}", dir.display());
    } else {
        say!("stopped; {} removed", dir.display());
    }
    result
}
