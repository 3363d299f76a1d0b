//! The accept loop, graceful shutdown, and `seathold dev`.
//!
//! [`run`] takes the shutdown signal as a future, so tests start and stop
//! servers in-process. Shutdown is in three steps: `/readyz` turns 503 at
//! once; the server keeps accepting and serving for the drain time, so load
//! balancers notice and move traffic; then it stops accepting, lets requests
//! in flight finish (bounded, since every Redis call is), and returns.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::cluster::Cluster;
use crate::config::{DevOptions, Options};
use crate::hold::Service;
use crate::http::{self, App};
use crate::keys::KeySpace;
use crate::scripts::Scripts;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Redis(#[from] crate::cluster::ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Dev(#[from] crate::dev::DevError),
}

/// Builds the application state for `opts`; connects to Redis in the
/// background.
pub fn app(opts: &Options) -> Result<Arc<App>, StartError> {
    opts.validate()?;
    let redis = opts.redis()?;
    let cluster = Cluster::new(&redis, Scripts::embedded())?;
    let metrics = crate::metrics::install();
    crate::metrics::register_zeroes();
    let service = Service::new(
        cluster,
        KeySpace::new(opts.key_prefix.clone()),
        opts.limits(),
    );
    Ok(Arc::new(App::new(service, metrics, opts)))
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

/// Serves the API on `listener` until `shutdown` completes, then shuts down
/// gracefully as described in the module docs.
pub async fn run(
    opts: Options,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let app = app(&opts)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let maintain = tokio::spawn(Arc::clone(app.service.cluster()).maintain(stop_rx.clone()));
    // The recorder buffers histogram samples until they are drained; a
    // scrape drains them, but without scrapes they would pile up.
    let upkeep = {
        let handle = app.metrics.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => handle.run_upkeep(),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    };
    let expiry = tokio::spawn(crate::expiry::run(
        Arc::clone(app.service.cluster()),
        app.service.keys().clone(),
        Duration::from_millis(opts.expiry_ping_interval_ms),
        stop_rx,
    ));
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

    app.shutting_down.store(true, Ordering::Relaxed);
    metrics::gauge!(crate::metrics::CLUSTER_READY).set(0.0);
    let drain = Duration::from_millis(opts.shutdown_drain_ms);
    tracing::info!(
        drain_ms = opts.shutdown_drain_ms,
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

    // Requests in flight end within the Redis timeout; the margin covers
    // writing their responses.
    let bound = Duration::from_millis(opts.redis_timeout_ms) + Duration::from_secs(1);
    if tokio::time::timeout(bound, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not finish in time; closing them");
    }
    let _ = stop_tx.send(true);
    let _ = maintain.await;
    let _ = expiry.await;
    let _ = upkeep.await;
    tracing::info!("stopped");
    Ok(())
}

/// How long connections accepted at the end of the drain get to deliver
/// their request before graceful shutdown closes the ones that sent nothing.
const ACCEPTED_LAST_GRACE: Duration = Duration::from_millis(100);

/// Limits of the accept loop.
struct Accept<'a> {
    listener: &'a TcpListener,
    app: &'a Arc<App>,
    graceful: &'a GracefulShutdown,
    open: Arc<AtomicUsize>,
    max_connections: usize,
    header_read_timeout: Duration,
}

impl Accept<'_> {
    /// Accepts and serves connections until `until` completes.
    async fn until(&self, until: impl Future<Output = ()>) {
        tokio::pin!(until);
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => self.serve(stream),
                    Err(err) => {
                        // Out of file descriptors and the like: back off
                        // briefly instead of spinning.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = &mut until => return,
            }
        }
    }

    /// Serves the connections still waiting in the kernel's listen queue.
    /// The accept loop sees them only after the reactor does, a while
    /// later; closing the listener now would reset them mid-request.
    fn take_queued(&self) {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd;
            // A second descriptor of the same (non-blocking) socket: its
            // accept answers WouldBlock once the queue is empty.
            let Ok(fd) = self.listener.as_fd().try_clone_to_owned() else {
                return;
            };
            let queue = std::net::TcpListener::from(fd);
            while let Ok((stream, _)) = queue.accept() {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                    self.serve(stream);
                }
            }
        }
    }

    fn serve(&self, stream: tokio::net::TcpStream) {
        let _ = stream.set_nodelay(true);
        let over = self.open.fetch_add(1, Ordering::Relaxed) >= self.max_connections;
        let open = Arc::clone(&self.open);
        let gauge = metrics::gauge!(crate::metrics::HTTP_CONNECTIONS);
        gauge.increment(1.0);
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout);
        let done = move || {
            open.fetch_sub(1, Ordering::Relaxed);
            gauge.decrement(1.0);
        };
        if over {
            // Past the connection limit: one clean 503, then close.
            metrics::counter!(crate::metrics::HTTP_OVERLOADED).increment(1);
            builder.keep_alive(false);
            let service = service_fn(|_req| async {
                Ok::<_, Infallible>(http::error_response(crate::error::Error::Overloaded))
            });
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::spawn(async move {
                let _ = conn.await;
                done();
            });
            return;
        }
        let app = Arc::clone(self.app);
        let service = service_fn(move |req| {
            let app = Arc::clone(&app);
            async move { Ok::<_, Infallible>(http::handle(app, req).await) }
        });
        let conn = self
            .graceful
            .watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(err) = conn.await {
                tracing::debug!(error = %err, "connection ended with an error");
            }
            done();
        });
    }
}

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

/// Prints a line of `seathold dev`'s banner. Unlike `println!` it does not
/// panic when stdout is closed (`seathold dev | head`): the banner is a
/// courtesy, not worth dying for.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `seathold dev`: a local cluster, the API on it, and a clean stop.
pub async fn dev(dev: DevOptions, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let mut opts = dev.options;
    opts.validate()?;
    let listener = bind(&opts).await?;
    say!(
        "starting a local Redis Cluster ({} masters, {} replicas each)...",
        dev.masters,
        dev.replicas
    );
    let cluster = crate::dev::LocalCluster::start(crate::dev::ClusterOptions {
        masters: usize::from(dev.masters),
        replicas_per_master: usize::from(dev.replicas),
        extra_config: vec![("notify-keyspace-events".into(), "Ex".into())],
        ..Default::default()
    })
    .await?;
    opts.redis_nodes = cluster.seed_urls();
    // Nothing balances load in front of a dev server: stop at once.
    opts.shutdown_drain_ms = 0;
    let url = format!("http://{}", listener.local_addr().unwrap_or(opts.listen));
    say!("Redis Cluster nodes: {}", opts.redis_nodes.join(","));
    say!("Redis data folder:   {}", cluster.dir().display());
    say!("seathold is serving on {url}  (Ctrl-C stops it and the cluster)\n");
    say!("  curl -s -XPOST {url}/v1/shows/42/holds -H 'content-type: application/json' -d '{{\"seats\":[\"E7\",\"E8\"]}}'");
    say!("  curl -s {url}/v1/shows/42/seats/E7\n");
    let result = run(opts, listener, shutdown).await;
    say!("stopping the local Redis Cluster...");
    cluster.stop();
    result
}
