//! The HTTP API: [`handle`] serves one request.
//!
//! - [`route`]: paths to routes, templates, and the methods each allows.
//! - [`body`]: reading bodies within their limits, and their JSON.
//! - [`handlers`]: one handler per route, parsing its ids once.
//!
//! This file holds the application state, the dispatch (probes first, then
//! authorization and admission for API routes), and the one place an error
//! becomes a response.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, ALLOW, CACHE_CONTROL, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::cluster::Readiness;
use crate::config::TokenScope;
use crate::error::Error;
use crate::hold::Service;
use crate::metrics as m;
use crate::model::Health;
use body::ReqBody;

pub mod body;
mod handlers;
pub mod route;

pub use route::{Route, Segments};

/// Everything a request handler needs.
pub struct App {
    pub service: Service,
    pub metrics: PrometheusHandle,
    /// Whether `/readyz` answers 200; the shutdown path turns it off.
    pub readiness: Arc<Readiness>,
    /// The event sweeper and readers; `None` with `--events off`.
    pub events: Option<crate::events::Events>,
    /// Turns true when the server stops serving (after the drain): event
    /// streams end then.
    pub closing: tokio::sync::watch::Sender<bool>,
    /// Whether the seat-map page is served.
    pub ui: bool,
    body: body::Limits,
    max_in_flight: usize,
    api_token: Option<String>,
    api_token_scope: TokenScope,
    in_flight: AtomicUsize,
}

impl App {
    /// The application state, with the HTTP limits of `opts`.
    pub fn new(
        service: Service,
        metrics: PrometheusHandle,
        readiness: Arc<Readiness>,
        events: Option<crate::events::Events>,
        opts: &crate::config::Options,
    ) -> Self {
        Self {
            service,
            metrics,
            readiness,
            events,
            closing: tokio::sync::watch::channel(false).0,
            ui: opts.ui.is_on(),
            body: body::Limits {
                max_bytes: opts.max_body_bytes,
                timeout: Duration::from_millis(opts.body_read_timeout_ms),
            },
            max_in_flight: opts.max_in_flight,
            api_token: opts.api_token.clone(),
            api_token_scope: opts.api_token_scope,
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Admits one more API request, or refuses it at the in-flight limit:
    /// past it, queueing would only turn overload into timeouts.
    fn admit(&self) -> Result<InFlight<'_>, Error> {
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            metrics::counter!(m::HTTP_OVERLOADED).increment(1);
            return Err(Error::Overloaded);
        }
        m::hot::gauge_add(m::HTTP_IN_FLIGHT, 1.0);
        Ok(InFlight(&self.in_flight))
    }

    /// With `--api-token`, the routes of its scope need `Authorization:
    /// Bearer <token>`, compared in constant time: the `PUT` routes, or
    /// with `--api-token-scope writes` every write.
    fn authorize(&self, method: &Method, headers: &hyper::HeaderMap) -> Result<(), Error> {
        let Some(expected) = &self.api_token else {
            return Ok(());
        };
        let guarded = match self.api_token_scope {
            TokenScope::Config => *method == Method::PUT,
            TokenScope::Writes => matches!(
                *method,
                Method::POST | Method::DELETE | Method::PUT | Method::PATCH
            ),
        };
        if !guarded {
            return Ok(());
        }
        // The scheme is case-insensitive (RFC 9110). The tokens are compared
        // as SHA-256 digests: equal lengths, so that the time taken does not
        // tell the token's length either.
        let given = headers
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map_or("", |(_, token)| token.trim_start_matches(' '));
        let digest = |t: &str| <sha2::Sha256 as sha2::Digest>::digest(t.as_bytes());
        if !given.is_empty()
            && bool::from(subtle::ConstantTimeEq::ct_eq(
                digest(given).as_slice(),
                digest(expected).as_slice(),
            ))
        {
            Ok(())
        } else {
            Err(Error::Unauthorized)
        }
    }
}

/// Closes a client's connection at once, whatever its response still has to
/// send. The server puts one in every request's extensions; an event stream
/// uses it for a client that stopped reading: ending the body instead would
/// leave the connection open, its unsent bytes buffered, for as long as the
/// client lingers without reading.
#[derive(Clone, Default)]
pub struct Disconnect(Arc<DisconnectState>);

#[derive(Default)]
struct DisconnectState {
    asked: tokio::sync::Notify,
    /// The connection's writes failed because its client took nothing for
    /// too long (the server's `WriteStall`).
    stalled: std::sync::atomic::AtomicBool,
}

impl Disconnect {
    /// Asks the connection's task to drop the connection.
    pub fn now(&self) {
        self.0.asked.notify_one();
    }

    /// Completes once [`Disconnect::now`] was called (before or after).
    pub async fn requested(&self) {
        self.0.asked.notified().await;
    }

    /// Marks the connection as closed because its client took nothing of
    /// the answer for too long.
    pub fn stalled(&self) {
        self.0.stalled.store(true, Ordering::Relaxed);
    }

    /// Whether [`Disconnect::stalled`] was called: an event stream that
    /// ends with its connection then counts its client as one that stopped
    /// reading.
    pub fn was_stalled(&self) -> bool {
        self.0.stalled.load(Ordering::Relaxed)
    }
}

/// Counts a request in flight while alive.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        m::hot::gauge_add(m::HTTP_IN_FLIGHT, -1.0);
    }
}

/// The response type of every route.
pub type Resp = Response<crate::events::sse::Body>;

/// A whole body, boxed as every response body is.
pub fn full(bytes: impl Into<Bytes>) -> crate::events::sse::Body {
    Full::new(bytes.into()).boxed_unsync()
}

/// Whether a request must run to its end even when its client hangs up:
/// a change of a hold (release, extend, confirm, PATCH) or of a show's
/// pools and settings, but not a new hold (dropped with its client, it is
/// abandoned: nobody else will learn its token) nor a read.
pub fn runs_to_its_end(method: &hyper::Method, path: &str) -> bool {
    use hyper::Method;
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return false;
    }
    let segments = Segments::of(path);
    let creates_hold = *method == Method::POST
        && matches!(
            Route::parse(segments.as_ref()),
            Route::MultiHold | Route::ShowHolds { .. } | Route::SeatHold { .. }
        );
    !creates_hold
}

/// Records a request whose client hung up before its answer (its future
/// dropped) in the request histogram, with status `499` (as nginx logs
/// it), so that slow periods whose clients gave up still show.
struct Unanswered {
    route: &'static str,
    start: Instant,
    answered: bool,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if !self.answered {
            m::hot::observe(
                m::HTTP_DURATION,
                &[("route", self.route), ("status", "499")],
                self.start.elapsed().as_secs_f64(),
            );
        }
    }
}

/// Serves one request from `peer`.
pub async fn handle(app: Arc<App>, req: Request<impl ReqBody>, peer: SocketAddr) -> Resp {
    let start = Instant::now();
    let (head, body) = req.into_parts();
    let segments = Segments::of(head.uri.path());
    let route = Route::parse(segments.as_ref());
    let mut unanswered = Unanswered {
        route: route.template(),
        start,
        answered: false,
    };
    let mut response = dispatch(&app, route, &head, body)
        .await
        .unwrap_or_else(error_response);
    if app.readiness.shutting_down() {
        // Draining: the client's next request goes on a new connection
        // (elsewhere, once the load balancer has seen /readyz), not on this
        // one, which the end of the drain would close unread. hyper closes
        // the connection after an answer that says so.
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    unanswered.answered = true;
    let template = route.template();
    let elapsed = start.elapsed();
    m::hot::observe(
        m::HTTP_DURATION,
        &[
            ("route", template),
            ("status", status_label(response.status())),
        ],
        elapsed.as_secs_f64(),
    );
    tracing::debug!(
        method = %head.method,
        route = template,
        // Only a valid id: the raw segment is whatever the client sent.
        show = route.show().filter(|s| crate::ids::valid_id(s)),
        status = response.status().as_u16(),
        micros = elapsed.as_micros() as u64,
        %peer,
        "request"
    );
    response
}

/// Probes, metrics and the API document are answered at once and never
/// refused: a load balancer must see an overloaded instance as alive. API
/// routes are authorized, their body is read (with its own time bound,
/// before the request takes an in-flight slot, so slow senders cannot hold
/// slots), and they are admitted and go to their handler.
async fn dispatch(
    app: &App,
    route: Route<'_>,
    head: &hyper::http::request::Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    // A route switched off (`--events off`, `--ui off`) is not there at
    // all: 404 whatever its method or ids.
    let off = match route {
        Route::Events { .. } => app.events.is_none(),
        Route::Ui { .. } => !app.ui,
        _ => false,
    };
    if route == Route::Unknown || off {
        return Err(Error::NotFound);
    }
    if !route.allows(&head.method) {
        return Err(Error::MethodNotAllowed(route.allow_header()));
    }
    match route {
        Route::Healthz => return Ok(json(StatusCode::OK, &Health::up("ok"))),
        Route::Readyz => return Ok(readyz(app)),
        Route::Metrics => return Ok(metrics_text(app)),
        Route::OpenApi => return Ok(openapi()),
        Route::Ui { show } => return crate::ui::page(app.ui, show),
        _ => {}
    }
    app.authorize(&head.method, &head.headers)?;
    let body = body::read(app.body, head, body).await?;
    let _in_flight = app.admit()?;
    handlers::serve(app, route, head, &body).await
}

fn readyz(app: &App) -> Resp {
    if app.readiness.is_ready() {
        json(StatusCode::OK, &Health::up("ready"))
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &Health::not_ready(app.readiness.reason()),
        )
    }
}

fn metrics_text(app: &App) -> Resp {
    let mut resp = Response::new(full(m::render(&app.metrics)));
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// The OpenAPI 3.1 document of the API, as compiled in.
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

fn openapi() -> Resp {
    let mut resp = Response::new(full(OPENAPI));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// A JSON response. `Cache-Control: no-store`: answers carry hold tokens
/// and seat states that change by the millisecond, which no browser cache
/// or proxy may keep.
pub fn json<T: serde::Serialize + ?Sized>(status: StatusCode, value: &T) -> Resp {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// A response without a body.
fn empty(status: StatusCode) -> Resp {
    let mut resp = Response::new(full(Bytes::new()));
    *resp.status_mut() = status;
    resp
}

/// The one place an [`Error`] becomes a response.
pub fn error_response(err: Error) -> Resp {
    if let Error::Internal(detail) = &err {
        tracing::error!(%detail, "internal error");
    }
    let mut resp = json(err.status(), &err.body());
    let headers = resp.headers_mut();
    match err {
        Error::MethodNotAllowed(allow) => {
            headers.insert(ALLOW, HeaderValue::from_static(allow));
        }
        Error::Unauthorized => {
            headers.insert(
                hyper::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
        }
        Error::Overloaded | Error::RedisUnavailable(..) => {
            headers.insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        _ => {}
    }
    resp
}

/// The `status` label: the statuses the API answers, and `other`.
fn status_label(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200 => "200",
        201 => "201",
        204 => "204",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        408 => "408",
        409 => "409",
        410 => "410",
        413 => "413",
        415 => "415",
        422 => "422",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every status the daemon answers has its own label (`other` is for
    /// what hyper may answer by itself).
    #[test]
    fn every_answered_status_has_its_label() {
        for code in [
            200, 201, 204, 400, 401, 404, 405, 408, 409, 410, 413, 415, 422, 500, 503,
        ] {
            let status = StatusCode::from_u16(code).expect("status");
            assert_eq!(status_label(status), status.as_str(), "{code}");
        }
        assert_eq!(status_label(StatusCode::IM_A_TEAPOT), "other");
    }
}
