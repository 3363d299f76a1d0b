//! Routing, request bodies and responses of the HTTP API.
//!
//! The router is a match over path segments: eleven fixed routes do not need
//! a routing crate, and the match gives each route its template for the
//! latency histogram without building strings per request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Body;
use hyper::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
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
    pub max_body_bytes: usize,
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
    seats: Vec<SeatRef>,
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
    let in_flight = metrics::gauge!(m::HTTP_IN_FLIGHT);
    in_flight.increment(1.0);
    let (route, result) = route(&app, req).await;
    let response = result.unwrap_or_else(error_response);
    in_flight.decrement(1.0);
    metrics::histogram!(m::HTTP_DURATION, "route" => route, "status" => status_label(response.status()))
        .record(start.elapsed().as_secs_f64());
    tracing::debug!(
        route,
        status = response.status().as_u16(),
        micros = start.elapsed().as_micros() as u64,
        "request"
    );
    response
}

async fn route<B>(app: &App, req: Request<B>) -> (&'static str, Result<Resp, Error>)
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let path = req.uri().path().to_owned();
    let segs: Vec<&str> = path.strip_prefix('/').unwrap_or(&path).split('/').collect();
    let method = req.method().clone();
    let svc = &app.service;
    macro_rules! only {
        ($route:expr, $allow:expr, $($m:pat => $body:expr),+ $(,)?) => {
            ($route, match method {
                $($m => $body,)+
                _ => Err(Error::MethodNotAllowed($allow)),
            })
        };
    }
    match segs.as_slice() {
        ["healthz"] => {
            only!("/healthz", "GET", Method::GET | Method::HEAD => Ok(json(StatusCode::OK, &serde_json::json!({"status":"ok"}))))
        }
        ["readyz"] => only!("/readyz", "GET", Method::GET | Method::HEAD => Ok(readyz(app))),
        ["metrics"] => only!("/metrics", "GET", Method::GET => Ok(metrics_text(app))),
        ["v1", "holds"] => only!("/v1/holds", "POST", Method::POST => async {
            let body: MultiHoldBody = json_body(app, req, true).await?;
            let home = body.seats.first().map(|s| s.show.clone()).unwrap_or_default();
            if body.seats.is_empty() {
                return Err(Error::InvalidRequest("seats must name at least one seat".into()));
            }
            let hold = svc.hold(&home, Seats::Multi(body.seats), ttl(body.ttl_ms)?).await?;
            Ok(json(StatusCode::CREATED, &hold))
        }.await),
        ["v1", "shows", show, "holds"] => {
            only!("/v1/shows/{show}/holds", "POST", Method::POST => async {
            valid_show(show)?;
            let body: ShowHoldBody = json_body(app, req, true).await?;
            let hold = svc.hold(show, Seats::Show(body.seats), ttl(body.ttl_ms)?).await?;
            Ok(json(StatusCode::CREATED, &hold))
        }.await)
        }
        ["v1", "shows", show, "seats", seat, "hold"] => {
            only!("/v1/shows/{show}/seats/{seat}/hold", "POST", Method::POST => async {
            valid_show(show)?;
            let body: TtlBody = json_body(app, req, false).await?;
            let hold = svc.hold(show, Seats::Show(vec![(*seat).to_owned()]), ttl(body.ttl_ms)?).await?;
            Ok(json(StatusCode::CREATED, &hold))
        }.await)
        }
        ["v1", "shows", show, "holds", token] => {
            only!("/v1/shows/{show}/holds/{token}", "GET, DELETE",
                Method::GET => async {
                    valid_show(show)?;
                    Ok(json(StatusCode::OK, &svc.get(show, token).await?))
                }.await,
                Method::DELETE => async {
                    valid_show(show)?;
                    svc.release(show, token).await?;
                    Ok(empty(StatusCode::NO_CONTENT))
                }.await,
            )
        }
        ["v1", "shows", show, "holds", token, "extend"] => {
            only!("/v1/shows/{show}/holds/{token}/extend", "POST", Method::POST => async {
            valid_show(show)?;
            let body: TtlBody = json_body(app, req, false).await?;
            Ok(json(StatusCode::OK, &svc.extend(show, token, ttl(body.ttl_ms)?).await?))
        }.await)
        }
        ["v1", "shows", show, "holds", token, "confirm"] => {
            only!("/v1/shows/{show}/holds/{token}/confirm", "POST", Method::POST => async {
            valid_show(show)?;
            let _: TtlBody = json_body(app, req, false).await?;
            Ok(json(StatusCode::OK, &svc.confirm(show, token).await?))
        }.await)
        }
        ["v1", "shows", show, "seats", seat] => {
            only!("/v1/shows/{show}/seats/{seat}", "GET", Method::GET => async {
            valid_show(show)?;
            if !crate::keys::valid_id(seat) {
                return Err(Error::InvalidSeat);
            }
            let mut states = svc.seat_states(show, &[seat]).await?;
            let mut state = states.pop().ok_or_else(|| Error::Internal("no seat state".into()))?;
            state.show = Some((*show).to_owned());
            state.seat = Some((*seat).to_owned());
            Ok(json(StatusCode::OK, &state))
        }.await)
        }
        ["v1", "shows", show, "seats"] => {
            only!("/v1/shows/{show}/seats", "GET", Method::GET => async {
            valid_show(show)?;
            let query = req.uri().query().unwrap_or_default();
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
                    ((*seat).to_owned(), serde_json::to_value(state).unwrap_or_default())
                })
                .collect();
            Ok(json(StatusCode::OK, &serde_json::json!({"show": show, "seats": map})))
        }.await)
        }
        _ => ("unmatched", Err(Error::NotFound)),
    }
}

fn valid_show(show: &str) -> Result<(), Error> {
    if crate::keys::valid_id(show) {
        Ok(())
    } else {
        Err(Error::InvalidShow)
    }
}

/// Reads and decodes a JSON body. With `required`, an empty body is an
/// error; otherwise it decodes as `{}`. A non-empty body must say it is JSON.
async fn json_body<B, T>(app: &App, req: Request<B>, required: bool) -> Result<T, Error>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
    T: serde::de::DeserializeOwned,
{
    let max = app.max_body_bytes;
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(Error::PayloadTooLarge(max));
    }
    let is_json = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .eq_ignore_ascii_case("application/json")
        });
    let bytes = match Limited::new(req.into_body(), max).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => {
            return Err(Error::PayloadTooLarge(max))
        }
        Err(err) => {
            return Err(Error::InvalidRequest(format!(
                "could not read the body: {err}"
            )))
        }
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
            "shutting down"
        } else {
            "Redis Cluster is not usable"
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
    if let Error::MethodNotAllowed(allow) = err {
        resp.headers_mut()
            .insert(ALLOW, HeaderValue::from_static(allow));
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
        409 => "409",
        413 => "413",
        415 => "415",
        422 => "422",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}
