//! One handler per API route: parse the ids of the path and body once,
//! call the hold service, shape the answer. The request's Redis deadline is
//! made here, once, after its body has arrived.

use hyper::header::HeaderValue;
use hyper::http::request::Parts;
use hyper::{Method, StatusCode};

use super::body::{self, EmptyBody, MultiHoldBody, ShowHoldBody, TtlBody};
use super::route::Route;
use super::{empty, json, App, Resp};
use crate::error::Error;
use crate::hold::Answer;
use crate::idempotency::{Idem, IdemKey};
use crate::ids::{HoldToken, SeatId, ShowId};
use crate::model::{SeatRef, SeatState, SeatStates, Seats};

/// The request header that names an idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header of an answer replayed from an idempotency record.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Serves an admitted API request whose body has been read.
pub(super) async fn serve(
    app: &App,
    route: Route<'_>,
    head: &Parts,
    body: &[u8],
) -> Result<Resp, Error> {
    let req = Req { app, head, body };
    match route {
        Route::MultiHold => multi_hold(&req).await,
        Route::ShowHolds { show } => show_hold(&req, ShowId::parse(show)?).await,
        Route::SeatHold { show, seat } => seat_hold(&req, ShowId::parse(show)?, seat).await,
        Route::Hold { show, token } if head.method == Method::GET => {
            get_hold(&req, ShowId::parse(show)?, token).await
        }
        Route::Hold { show, token } => release(&req, ShowId::parse(show)?, token).await,
        Route::Extend { show, token } => extend(&req, ShowId::parse(show)?, token).await,
        Route::Confirm { show, token } => confirm(&req, ShowId::parse(show)?, token).await,
        Route::Seat { show, seat } => seat_state(&req, ShowId::parse(show)?, seat).await,
        Route::Seats { show } => seat_states(&req, ShowId::parse(show)?).await,
        Route::Events { show } => events(&req, ShowId::parse(show)?).await,
        Route::Healthz
        | Route::Readyz
        | Route::Metrics
        | Route::OpenApi
        | Route::Ui { .. }
        | Route::Unknown => Err(Error::NotFound),
    }
}

/// One request, as the handlers see it.
struct Req<'a> {
    app: &'a App,
    head: &'a Parts,
    body: &'a [u8],
}

impl Req<'_> {
    fn json<T: serde::de::DeserializeOwned>(&self, required: bool) -> Result<T, Error> {
        body::json(self.head, self.body, required)
    }

    /// The request's `Idempotency-Key` with its fingerprint, if it has one.
    fn idem(&self) -> Result<Option<Idem>, Error> {
        let Some(raw) = self.head.headers.get(IDEMPOTENCY_KEY) else {
            return Ok(None);
        };
        let key = IdemKey::parse(raw.as_bytes())?;
        Ok(Some(Idem::new(
            key,
            self.head.method.as_str(),
            self.head.uri.path(),
            self.body,
        )))
    }

    fn service(&self) -> &crate::hold::Service {
        &self.app.service
    }

    fn deadline(&self) -> crate::cluster::Deadline {
        self.app.service.cluster().deadline()
    }
}

/// `answer` as JSON with `status`, marked when replayed.
fn answer<T: serde::Serialize>(status: StatusCode, answer: &Answer<T>) -> Resp {
    mark(json(status, &answer.value), answer.replayed)
}

fn mark(mut resp: Resp, replayed: bool) -> Resp {
    if replayed {
        resp.headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    resp
}

/// Parses seat ids, refusing an empty list first.
fn seat_ids(raw: &[String]) -> Result<Vec<SeatId>, Error> {
    if raw.is_empty() {
        return Err(Error::InvalidRequest(
            "seats must name at least one seat".into(),
        ));
    }
    raw.iter().map(|s| SeatId::parse(s)).collect()
}

/// `POST /v1/holds`: the home show is the first seat's.
async fn multi_hold(req: &Req<'_>) -> Result<Resp, Error> {
    let body: MultiHoldBody = req.json(true)?;
    let raw = body.seats()?;
    let Some(first) = raw.first() else {
        return Err(Error::InvalidRequest(
            "seats must name at least one seat".into(),
        ));
    };
    let ttl = body::ttl(body.ttl_ms)?;
    let home = ShowId::parse(&first.show)?;
    let seats = raw
        .iter()
        .map(|r| {
            Ok(SeatRef {
                show: ShowId::parse(&r.show)?,
                seat: SeatId::parse(&r.seat)?,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    hold(req, &home, Seats::Multi(seats), ttl).await
}

/// `POST /v1/shows/{show}/holds`.
async fn show_hold(req: &Req<'_>, show: ShowId) -> Result<Resp, Error> {
    let body: ShowHoldBody = req.json(true)?;
    let ttl = body::ttl(body.ttl_ms)?;
    hold(req, &show, Seats::Show(seat_ids(&body.seats)?), ttl).await
}

/// `POST /v1/shows/{show}/seats/{seat}/hold`.
async fn seat_hold(req: &Req<'_>, show: ShowId, seat: &str) -> Result<Resp, Error> {
    let body: TtlBody = req.json(false)?;
    let ttl = body::ttl(body.ttl_ms)?;
    hold(req, &show, Seats::Show(vec![SeatId::parse(seat)?]), ttl).await
}

async fn hold(req: &Req<'_>, home: &ShowId, seats: Seats, ttl: Option<u64>) -> Result<Resp, Error> {
    let idem = req.idem()?;
    let deadline = req.deadline();
    let hold = req
        .service()
        .hold(&deadline, home, seats, ttl, idem.as_ref())
        .await?;
    Ok(answer(StatusCode::CREATED, &hold))
}

/// `GET /v1/shows/{show}/holds/{token}`.
async fn get_hold(req: &Req<'_>, show: ShowId, token: &str) -> Result<Resp, Error> {
    let token = HoldToken::parse(token)?;
    let hold = req.service().get(&req.deadline(), &show, token).await?;
    Ok(json(StatusCode::OK, &hold))
}

/// `DELETE /v1/shows/{show}/holds/{token}`.
async fn release(req: &Req<'_>, show: ShowId, token: &str) -> Result<Resp, Error> {
    let idem = req.idem()?;
    let token = HoldToken::parse(token)?;
    let released = req
        .service()
        .release(&req.deadline(), &show, token, idem.as_ref())
        .await?;
    Ok(mark(empty(StatusCode::NO_CONTENT), released.replayed))
}

/// `POST /v1/shows/{show}/holds/{token}/extend`.
async fn extend(req: &Req<'_>, show: ShowId, token: &str) -> Result<Resp, Error> {
    let body: TtlBody = req.json(false)?;
    let ttl = body::ttl(body.ttl_ms)?;
    let idem = req.idem()?;
    let token = HoldToken::parse(token)?;
    let hold = req
        .service()
        .extend(&req.deadline(), &show, token, ttl, idem.as_ref())
        .await?;
    Ok(answer(StatusCode::OK, &hold))
}

/// `POST /v1/shows/{show}/holds/{token}/confirm`.
async fn confirm(req: &Req<'_>, show: ShowId, token: &str) -> Result<Resp, Error> {
    let _: EmptyBody = req.json(false)?;
    let idem = req.idem()?;
    let token = HoldToken::parse(token)?;
    let confirmation = req
        .service()
        .confirm(&req.deadline(), &show, token, idem.as_ref())
        .await?;
    Ok(answer(StatusCode::OK, &confirmation))
}

/// `GET /v1/shows/{show}/seats/{seat}`.
async fn seat_state(req: &Req<'_>, show: ShowId, seat: &str) -> Result<Resp, Error> {
    let seat = SeatId::parse(seat)?;
    let states = req
        .service()
        .seat_states(&req.deadline(), &show, std::slice::from_ref(&seat))
        .await?;
    let state = states
        .first()
        .copied()
        .ok_or_else(|| Error::Internal("no seat state".into()))?;
    Ok(json(
        StatusCode::OK,
        &SeatState::new(Some(show), seat, state),
    ))
}

/// `GET /v1/shows/{show}/seats?ids=E7,E8`.
async fn seat_states(req: &Req<'_>, show: ShowId) -> Result<Resp, Error> {
    let query = req.head.uri.query().unwrap_or_default();
    let ids = form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "ids")
        .map(|(_, v)| v.into_owned())
        .ok_or_else(|| Error::InvalidRequest("name the seats with ?ids=E7,E8".into()))?;
    let raw: Vec<&str> = ids.split(',').collect();
    // A valid id named twice is a duplicate; an invalid one is refused as
    // invalid below, whatever else is wrong.
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = raw.iter().find(|s| !seen.insert(**s)) {
        if let Ok(dup) = SeatId::parse(dup) {
            return Err(Error::DuplicateSeat(dup.to_string()));
        }
    }
    let seats = raw
        .iter()
        .map(|s| SeatId::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let states = req
        .service()
        .seat_states(&req.deadline(), &show, &seats)
        .await?;
    let states = seats
        .into_iter()
        .zip(states)
        .map(|(seat, state)| SeatState::new(None, seat, state));
    Ok(json(StatusCode::OK, &SeatStates::new(show, states)))
}

/// `GET /v1/shows/{show}/events`: Server-Sent Events with
/// `Accept: text/event-stream`, else a page of events for pollers.
async fn events(req: &Req<'_>, show: ShowId) -> Result<Resp, Error> {
    use crate::events::{read, sse, Cursor, EventId, Page, MAX_LIMIT};
    let Some(events) = &req.app.events else {
        return Err(Error::NotFound);
    };
    let query = req.head.uri.query().unwrap_or_default();
    let param = |name: &str| {
        form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    let parse_id = |raw: &str| {
        EventId::from_cursor(raw)
            .ok_or_else(|| Error::InvalidRequest(format!("{raw:?} is not an event id")))
    };
    // Both cursors must be valid when both are sent; `Last-Event-ID` (what
    // an EventSource sends when it reconnects) wins.
    let after_param = param("after").as_deref().map(parse_id).transpose()?;
    let last_event_id = match req.head.headers.get("last-event-id") {
        Some(v) => Some(parse_id(v.to_str().unwrap_or_default())?),
        None => None,
    };
    let after = last_event_id.or(after_param);
    // Checked for both forms, though only a page uses it.
    let limit = match param("limit") {
        None => 100,
        Some(raw) => match raw.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) && raw.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => {
                return Err(Error::InvalidRequest(format!(
                    "limit must be an integer from 1 to {MAX_LIMIT}"
                )))
            }
        },
    };
    let wants_stream = req
        .head
        .headers
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let cluster = req.app.service.cluster();
    let keys = req.app.service.keys();
    if wants_stream {
        let sub = sse::Subscription {
            cluster: std::sync::Arc::clone(cluster),
            keys: keys.clone(),
            show,
            closing: req.app.closing.subscribe(),
        };
        let body = sse::subscribe(events, sub, after.map_or(Cursor::Newest, Cursor::After)).await?;
        let mut resp = hyper::Response::new(body);
        let headers = resp.headers_mut();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(
            hyper::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        // Proxies that buffer (nginx) must pass events through at once.
        headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
        return Ok(resp);
    }
    let cursor = Cursor::After(after.unwrap_or(EventId::ZERO));
    let (page, newest) = read(cluster, keys, &req.deadline(), &show, cursor, limit).await?;
    let next = match (page.last(), after) {
        (Some(last), _) => last.id.clone(),
        (None, Some(after)) => after.to_string(),
        (None, None) => newest.to_string(),
    };
    Ok(json(StatusCode::OK, &Page { events: page, next }))
}
