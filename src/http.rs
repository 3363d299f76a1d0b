//! Routing, request bodies and responses of the HTTP API.
//!
//! The router is a match over path segments: eleven fixed routes do not need
//! a routing crate, and the match gives each route its template for the
//! latency histogram without building strings per request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Body;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;

use crate::error::Error;
use crate::hold::{SeatRef, Seats, Service};
use crate::metrics as m;

/// Everything a request handler needs.
pub struct App {
    pub service: Service,
    pub metrics: PrometheusHandle,
    /// Set at the start of shutdown: `/readyz` answers 503 from then on.
    pub shutting_down: AtomicBool,
    max_body_bytes: usize,
    max_in_flight: usize,
    /// How long a client may take to send a body.
    body_timeout: Duration,
    api_token: Option<String>,
    in_flight: AtomicUsize,
}

impl App {
    /// The application state, with the HTTP limits of `opts`.
    pub fn new(service: Service, metrics: PrometheusHandle, opts: &crate::config::Options) -> Self {
        Self {
            service,
            metrics,
            shutting_down: AtomicBool::new(false),
            max_body_bytes: opts.max_body_bytes,
            max_in_flight: opts.max_in_flight,
            body_timeout: Duration::from_millis(opts.header_read_timeout_ms),
            api_token: opts.api_token.clone(),
            in_flight: AtomicUsize::new(0),
        }
    }
}

/// The response type of every route.
pub type Resp = Response<Full<Bytes>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ShowHoldBody {
    seats: Vec<String>,
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MultiHoldBody {
    /// Objects only: read as `SeatRef` directly, serde would also take a
    /// `["show", "seat"]` array (see `json_body`).
    seats: Vec<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TtlBody {
    #[serde(default)]
    ttl_ms: Option<serde_json::Value>,
}

/// `ttlMs` must be a positive integer; range is checked by the service.
fn ttl(value: Option<serde_json::Value>) -> Result<Option<u64>, Error> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(v) if v > 0 => Ok(Some(v)),
            _ => Err(Error::InvalidTtl("ttlMs must be a positive integer".into())),
        },
        Some(_) => Err(Error::InvalidTtl("ttlMs must be a positive integer".into())),
    }
}

/// Serves one request.
pub async fn handle<B>(app: Arc<App>, req: Request<B>) -> Resp
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let start = Instant::now();
    let (head, body) = req.into_parts();
    let route = Route::parse(head.uri.path());
    let response = serve(&app, &route, &head, body)
        .await
        .unwrap_or_else(error_response);
    let template = route.template();
    metrics::histogram!(m::HTTP_DURATION, "route" => template, "status" => status_label(response.status()))
        .record(start.elapsed().as_secs_f64());
    tracing::debug!(
        route = template,
        status = response.status().as_u16(),
        micros = start.elapsed().as_micros() as u64,
        "request"
    );
    response
}

/// The routes, parsed from the path alone; each borrows its ids from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'p> {
    Healthz,
    Readyz,
    Metrics,
    MultiHold,
    ShowHolds { show: &'p str },
    SeatHold { show: &'p str, seat: &'p str },
    Hold { show: &'p str, token: &'p str },
    Extend { show: &'p str, token: &'p str },
    Confirm { show: &'p str, token: &'p str },
    Seat { show: &'p str, seat: &'p str },
    Seats { show: &'p str },
    Unknown,
}

impl<'p> Route<'p> {
    /// Matches a path (without query) to a route.
    pub fn parse(path: &'p str) -> Self {
        let mut segs = [""; 7];
        let mut n = 0;
        for seg in path.strip_prefix('/').unwrap_or(path).split('/') {
            if n == segs.len() {
                return Self::Unknown;
            }
            segs[n] = seg;
            n += 1;
        }
        match &segs[..n] {
            ["healthz"] => Self::Healthz,
            ["readyz"] => Self::Readyz,
            ["metrics"] => Self::Metrics,
            ["v1", "holds"] => Self::MultiHold,
            ["v1", "shows", show, "holds"] => Self::ShowHolds { show },
            ["v1", "shows", show, "seats", seat, "hold"] => Self::SeatHold { show, seat },
            ["v1", "shows", show, "holds", token] => Self::Hold { show, token },
            ["v1", "shows", show, "holds", token, "extend"] => Self::Extend { show, token },
            ["v1", "shows", show, "holds", token, "confirm"] => Self::Confirm { show, token },
            ["v1", "shows", show, "seats", seat] => Self::Seat { show, seat },
            ["v1", "shows", show, "seats"] => Self::Seats { show },
            _ => Self::Unknown,
        }
    }

    /// The route's template: the `route` label of the latency histogram.
    pub fn template(&self) -> &'static str {
        match self {
            Self::Healthz => "/healthz",
            Self::Readyz => "/readyz",
            Self::Metrics => "/metrics",
            Self::MultiHold => "/v1/holds",
            Self::ShowHolds { .. } => "/v1/shows/{show}/holds",
            Self::SeatHold { .. } => "/v1/shows/{show}/seats/{seat}/hold",
            Self::Hold { .. } => "/v1/shows/{show}/holds/{token}",
            Self::Extend { .. } => "/v1/shows/{show}/holds/{token}/extend",
            Self::Confirm { .. } => "/v1/shows/{show}/holds/{token}/confirm",
            Self::Seat { .. } => "/v1/shows/{show}/seats/{seat}",
            Self::Seats { .. } => "/v1/shows/{show}/seats",
            Self::Unknown => "unmatched",
        }
    }

    /// The methods the route answers, for 405's `Allow`.
    fn allow(&self) -> &'static str {
        match self {
            Self::Healthz
            | Self::Readyz
            | Self::Metrics
            | Self::Seat { .. }
            | Self::Seats { .. } => "GET",
            Self::Hold { .. } => "GET, DELETE",
            _ => "POST",
        }
    }

    /// The show id in the path, if any.
    fn show(&self) -> Option<&'p str> {
        match *self {
            Self::ShowHolds { show }
            | Self::SeatHold { show, .. }
            | Self::Hold { show, .. }
            | Self::Extend { show, .. }
            | Self::Confirm { show, .. }
            | Self::Seat { show, .. }
            | Self::Seats { show } => Some(show),
            _ => None,
        }
    }
}

/// Counts a request in flight while alive.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(m::HTTP_IN_FLIGHT).decrement(1.0);
    }
}

impl App {
    /// Admits one more API request, or refuses it at the in-flight limit:
    /// past it, queueing would only turn overload into timeouts.
    fn admit(&self) -> Result<InFlight<'_>, Error> {
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            metrics::counter!(m::HTTP_OVERLOADED).increment(1);
            return Err(Error::Overloaded);
        }
        metrics::gauge!(m::HTTP_IN_FLIGHT).increment(1.0);
        Ok(InFlight(&self.in_flight))
    }

    /// With `--api-token`, write routes need `Authorization: Bearer <token>`,
    /// compared in constant time.
    fn authorize(&self, method: &Method, headers: &hyper::HeaderMap) -> Result<(), Error> {
        let Some(expected) = &self.api_token else {
            return Ok(());
        };
        if !matches!(*method, Method::POST | Method::DELETE) {
            return Ok(());
        }
        let given = headers
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        if bool::from(subtle::ConstantTimeEq::ct_eq(
            given.as_bytes(),
            expected.as_bytes(),
        )) {
            Ok(())
        } else {
            Err(Error::Unauthorized)
        }
    }
}

async fn serve<B>(app: &App, route: &Route<'_>, head: &Parts, body: B) -> Result<Resp, Error>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let method = &head.method;
    // Probes and metrics are never refused: a load balancer must see an
    // overloaded instance as alive.
    match (route, method) {
        (Route::Healthz, &Method::GET | &Method::HEAD) => {
            return Ok(json(StatusCode::OK, &serde_json::json!({"status": "ok"})))
        }
        (Route::Readyz, &Method::GET | &Method::HEAD) => return Ok(readyz(app)),
        (Route::Metrics, &Method::GET) => return Ok(metrics_text(app)),
        (Route::Healthz | Route::Readyz | Route::Metrics, _) => {
            return Err(Error::MethodNotAllowed(route.allow()))
        }
        (Route::Unknown, _) => return Err(Error::NotFound),
        _ => {}
    }
    let allowed = match route {
        Route::Hold { .. } => matches!(*method, Method::GET | Method::DELETE),
        Route::Seat { .. } | Route::Seats { .. } => method == Method::GET,
        _ => method == Method::POST,
    };
    if !allowed {
        return Err(Error::MethodNotAllowed(route.allow()));
    }
    app.authorize(method, &head.headers)?;
    let _in_flight = app.admit()?;
    if let Some(show) = route.show() {
        valid_show(show)?;
    }
    let svc = &app.service;
    match *route {
        Route::MultiHold => {
            let body: MultiHoldBody = json_body(app, head, body, true).await?;
            let seats = body
                .seats
                .into_iter()
                .map(|s| serde_json::from_value::<SeatRef>(serde_json::Value::Object(s)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| Error::InvalidRequest(format!("invalid JSON body: {e}")))?;
            let Some(home) = seats.first().map(|s| s.show.clone()) else {
                return Err(Error::InvalidRequest(
                    "seats must name at least one seat".into(),
                ));
            };
            let hold = svc
                .hold(&home, Seats::Multi(seats), ttl(body.ttl_ms)?)
                .await?;
            Ok(json(StatusCode::CREATED, &hold))
        }
        Route::ShowHolds { show } => {
            let body: ShowHoldBody = json_body(app, head, body, true).await?;
            let hold = svc
                .hold(show, Seats::Show(body.seats), ttl(body.ttl_ms)?)
                .await?;
            Ok(json(StatusCode::CREATED, &hold))
        }
        Route::SeatHold { show, seat } => {
            let body: TtlBody = json_body(app, head, body, false).await?;
            let hold = svc
                .hold(show, Seats::Show(vec![seat.to_owned()]), ttl(body.ttl_ms)?)
                .await?;
            Ok(json(StatusCode::CREATED, &hold))
        }
        Route::Hold { show, token } if method == Method::GET => {
            Ok(json(StatusCode::OK, &svc.get(show, token).await?))
        }
        Route::Hold { show, token } => {
            svc.release(show, token).await?;
            Ok(empty(StatusCode::NO_CONTENT))
        }
        Route::Extend { show, token } => {
            let body: TtlBody = json_body(app, head, body, false).await?;
            Ok(json(
                StatusCode::OK,
                &svc.extend(show, token, ttl(body.ttl_ms)?).await?,
            ))
        }
        Route::Confirm { show, token } => {
            let _: TtlBody = json_body(app, head, body, false).await?;
            Ok(json(StatusCode::OK, &svc.confirm(show, token).await?))
        }
        Route::Seat { show, seat } => {
            if !crate::keys::valid_id(seat) {
                return Err(Error::InvalidSeat);
            }
            let mut states = svc.seat_states(show, &[seat]).await?;
            let mut state = states
                .pop()
                .ok_or_else(|| Error::Internal("no seat state".into()))?;
            state.show = Some(show.to_owned());
            state.seat = Some(seat.to_owned());
            Ok(json(StatusCode::OK, &state))
        }
        Route::Seats { show } => {
            let query = head.uri.query().unwrap_or_default();
            let ids = form_urlencoded::parse(query.as_bytes())
                .find(|(k, _)| k == "ids")
                .map(|(_, v)| v.into_owned())
                .ok_or_else(|| Error::InvalidRequest("name the seats with ?ids=E7,E8".into()))?;
            let seats: Vec<&str> = ids.split(',').collect();
            let mut seen = std::collections::HashSet::new();
            if let Some(dup) = seats.iter().find(|s| !seen.insert(**s)) {
                if crate::keys::valid_id(dup) {
                    return Err(Error::DuplicateSeat((*dup).to_owned()));
                }
            }
            let states = svc.seat_states(show, &seats).await?;
            let map: serde_json::Map<String, serde_json::Value> = seats
                .iter()
                .zip(states)
                .map(|(seat, mut state)| {
                    state.seat = Some((*seat).to_owned());
                    (
                        (*seat).to_owned(),
                        serde_json::to_value(state).unwrap_or_default(),
                    )
                })
                .collect();
            Ok(json(
                StatusCode::OK,
                &serde_json::json!({"show": show, "seats": map}),
            ))
        }
        Route::Healthz | Route::Readyz | Route::Metrics | Route::Unknown => Err(Error::NotFound),
    }
}

fn valid_show(show: &str) -> Result<(), Error> {
    if crate::keys::valid_id(show) {
        Ok(())
    } else {
        Err(Error::InvalidShow)
    }
}

/// Collects a body of at most `max` bytes within the body timeout.
async fn read_body<B>(app: &App, body: B, max: usize) -> Result<Bytes, Error>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let collect = tokio::time::timeout(app.body_timeout, Limited::new(body, max).collect());
    match collect.await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(err)) if err.is::<http_body_util::LengthLimitError>() => {
            Err(Error::PayloadTooLarge(max))
        }
        Ok(Err(err)) => Err(Error::InvalidRequest(format!(
            "could not read the body: {err}"
        ))),
        Err(_) => Err(Error::RequestTimeout),
    }
}

/// Reads and decodes a JSON body. With `required`, an empty body is an
/// error; otherwise it decodes as `{}`. A non-empty body must say it is JSON.
async fn json_body<B, T>(app: &App, head: &Parts, body: B, required: bool) -> Result<T, Error>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
    T: serde::de::DeserializeOwned,
{
    let max = app.max_body_bytes;
    let declared = head
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(Error::PayloadTooLarge(max));
    }
    let is_json = head
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .eq_ignore_ascii_case("application/json")
        });
    // A body that trickles in would hold an in-flight slot forever. A body
    // that is already known to be empty (no Content-Length, or 0) needs no
    // timer: most single-seat holds have none.
    let bytes = if body.is_end_stream() {
        Bytes::new()
    } else {
        read_body(app, body, max).await?
    };
    if bytes.is_empty() {
        if required {
            return Err(if is_json == Some(true) {
                Error::InvalidRequest("the body is empty".into())
            } else {
                Error::UnsupportedMediaType
            });
        }
        return serde_json::from_slice(b"{}").map_err(|e| Error::InvalidRequest(e.to_string()));
    }
    if is_json != Some(true) {
        return Err(Error::UnsupportedMediaType);
    }
    // serde also reads a struct from a JSON array of its fields in order
    // (`[["E7"], 60000]`, or `[]` for a body whose fields are optional);
    // every body of the API is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(Error::InvalidRequest(
            "the body must be a JSON object".into(),
        ));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::InvalidRequest(format!("invalid JSON body: {e}")))
}

fn readyz(app: &App) -> Resp {
    let shutting_down = app.shutting_down.load(Ordering::Relaxed);
    let ready = !shutting_down && app.service.cluster().is_ready();
    if ready {
        json(StatusCode::OK, &serde_json::json!({"status": "ready"}))
    } else {
        let reason = if shutting_down {
            "shutting down".to_owned()
        } else {
            app.service.cluster().readiness()
        };
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"status": "not_ready", "reason": reason}),
        )
    }
}

fn metrics_text(app: &App) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(app.metrics.render())));
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// A JSON response.
pub fn json<T: serde::Serialize + ?Sized>(status: StatusCode, value: &T) -> Resp {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn empty(status: StatusCode) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::new()));
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
        429 => "429",
        409 => "409",
        413 => "413",
        415 => "415",
        422 => "422",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}
