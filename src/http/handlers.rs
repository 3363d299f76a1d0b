//! One handler per API route: parse the ids of the path and body once,
//! call the hold service, shape the answer. The request's Redis deadline is
//! made here, once, after its body has arrived.

use hyper::header::HeaderValue;
use hyper::http::request::Parts;
use hyper::{Method, StatusCode};

use super::body::{
    self, ChangeBody, EmptyBody, MultiHoldBody, PoolBody, SeatHoldBody, SettingsBody, ShowHoldBody,
    TtlBody,
};
use super::route::Route;
use super::{empty, json, App, Resp};
use crate::error::Error;
use crate::hold::Answer;
use crate::idempotency::{Idem, IdemKey};
use crate::ids::{HoldToken, PoolId, SeatId, ShowId};
use crate::model::{Contents, PoolUnits, SeatRef, SeatState, SeatStates, Seats};

/// The request header that names an idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header of an answer replayed from an idempotency record.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Serves an admitted API request whose body has been read.
///
/// Each route's future is boxed. A request's future is otherwise as large
/// as the largest route's (9 KB for a confirm, which WAITs on a dedicated
/// connection; 2-3 KB for the others), and hyper moves every request's
/// future into place by copying it. Unboxed, the future hyper holds was
/// 10,192 bytes, now 1,152, and a single-seat hold costs the daemon 66.9k
/// instructions instead of 76.5k (`cluster/bench/daemon-cost.sh`). A box
/// costs one allocation.
pub(super) async fn serve(
    app: &App,
    route: Route<'_>,
    head: &Parts,
    body: &[u8],
) -> Result<Resp, Error> {
    let req = Req {
        app,
        route,
        head,
        body,
    };
    match route {
        Route::MultiHold => Box::pin(multi_hold(&req)).await,
        Route::ShowHolds { show } => Box::pin(show_hold(&req, ShowId::parse(show)?)).await,
        Route::SeatHold { show, seat } => {
            Box::pin(seat_hold(&req, ShowId::parse(show)?, seat)).await
        }
        Route::Hold { show, token } if head.method == Method::GET => {
            Box::pin(get_hold(&req, ShowId::parse(show)?, token)).await
        }
        Route::Hold { show, token } if head.method == Method::PATCH => {
            Box::pin(modify(&req, ShowId::parse(show)?, token)).await
        }
        Route::Hold { show, token } => Box::pin(release(&req, ShowId::parse(show)?, token)).await,
        Route::Pool { show, pool } => Box::pin(pool_route(&req, ShowId::parse(show)?, pool)).await,
        Route::Settings { show } => Box::pin(settings(&req, ShowId::parse(show)?)).await,
        Route::Extend { show, token } => Box::pin(extend(&req, ShowId::parse(show)?, token)).await,
        Route::Confirm { show, token } => {
            Box::pin(confirm(&req, ShowId::parse(show)?, token)).await
        }
        Route::Seat { show, seat } => Box::pin(seat_state(&req, ShowId::parse(show)?, seat)).await,
        Route::Seats { show } => Box::pin(seat_states(&req, ShowId::parse(show)?)).await,
        Route::Events { show } => Box::pin(events(&req, ShowId::parse(show)?)).await,
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
    route: Route<'a>,
    head: &'a Parts,
    body: &'a [u8],
}

impl Req<'_> {
    fn json<T: serde::de::DeserializeOwned>(&self, required: bool) -> Result<T, Error> {
        body::json(self.head, self.body, required)
    }

    /// The request's `Idempotency-Key` with its fingerprint, if it has one.
    /// Two of them are 400: recording the request under either would
    /// surprise a client that meant the other.
    fn idem(&self) -> Result<Option<Idem>, Error> {
        let mut all = self.head.headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(raw) = all.next() else {
            return Ok(None);
        };
        if all.next().is_some() {
            return Err(Error::InvalidIdempotencyKey);
        }
        let key = IdemKey::parse(raw.as_bytes())?;
        Ok(Some(Idem::new(
            key,
            self.head.method.as_str(),
            &self.route.canonical(),
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

/// Parses seat ids.
fn seat_ids(raw: &[String]) -> Result<Vec<SeatId>, Error> {
    raw.iter().map(|s| SeatId::parse(s)).collect()
}

/// [`seat_ids`], each named once (400 `duplicate_seat` otherwise).
fn distinct_seat_ids(raw: &[String]) -> Result<Vec<SeatId>, Error> {
    let seats = seat_ids(raw)?;
    let mut seen = std::collections::HashSet::with_capacity(seats.len());
    match seats.iter().find(|s| !seen.insert(*s)) {
        Some(dup) => Err(Error::DuplicateSeat(dup.to_string())),
        None => Ok(seats),
    }
}

/// Parses `{"floor":2}` pool units of `show`.
fn pool_units(
    show: &ShowId,
    raw: &serde_json::Map<String, serde_json::Value>,
    min: u64,
) -> Result<Vec<PoolUnits>, Error> {
    raw.iter()
        .map(|(pool, quantity)| {
            Ok(PoolUnits {
                show: show.clone(),
                pool: PoolId::parse(pool)?,
                quantity: u32::try_from(body::count(quantity, "a pool quantity", min)?)
                    .unwrap_or(u32::MAX),
            })
        })
        .collect()
}

/// `POST /v1/holds`: the home show is the first element's.
async fn multi_hold(req: &Req<'_>) -> Result<Resp, Error> {
    let body: MultiHoldBody = req.json(true)?;
    let raw = body.seats()?;
    let Some(first) = raw.first() else {
        return Err(Error::InvalidRequest(
            "seats must name at least one seat or pool".into(),
        ));
    };
    let ttl = body::ttl(body.ttl_ms)?;
    let home = ShowId::parse(&first.show)?;
    let mut seats = Vec::new();
    let mut pools = Vec::new();
    for r in &raw {
        let show = ShowId::parse(&r.show)?;
        match (&r.seat, &r.pool, &r.quantity) {
            (Some(seat), None, None) => seats.push(SeatRef {
                show,
                seat: SeatId::parse(seat)?,
            }),
            (None, Some(pool), Some(quantity)) => pools.push(PoolUnits {
                show,
                pool: PoolId::parse(pool)?,
                quantity: u32::try_from(body::count(quantity, "quantity", 1)?).unwrap_or(u32::MAX),
            }),
            _ => {
                return Err(Error::InvalidRequest(
                    "each element is {\"show\",\"seat\"} or {\"show\",\"pool\",\"quantity\"}"
                        .into(),
                ))
            }
        }
    }
    let contents = Contents {
        seats: Seats::Multi(seats),
        pools,
        holder: body::holder(body.holder)?,
    };
    hold(req, &home, contents, ttl).await
}

/// `POST /v1/shows/{show}/holds`.
async fn show_hold(req: &Req<'_>, show: ShowId) -> Result<Resp, Error> {
    let body: ShowHoldBody = req.json(true)?;
    let ttl = body::ttl(body.ttl_ms)?;
    let contents = Contents {
        seats: Seats::Show(seat_ids(&body.seats)?),
        pools: pool_units(&show, &body.pools, 1)?,
        holder: body::holder(body.holder)?,
    };
    hold(req, &show, contents, ttl).await
}

/// `POST /v1/shows/{show}/seats/{seat}/hold`.
async fn seat_hold(req: &Req<'_>, show: ShowId, seat: &str) -> Result<Resp, Error> {
    let body: SeatHoldBody = req.json(false)?;
    let ttl = body::ttl(body.ttl_ms)?;
    let contents = Contents {
        seats: Seats::Show(vec![SeatId::parse(seat)?]),
        pools: Vec::new(),
        holder: body::holder(body.holder)?,
    };
    hold(req, &show, contents, ttl).await
}

async fn hold(
    req: &Req<'_>,
    home: &ShowId,
    contents: Contents,
    ttl: Option<u64>,
) -> Result<Resp, Error> {
    let idem = req.idem()?;
    let deadline = req.deadline();
    let hold = req
        .service()
        .hold(&deadline, home, contents, ttl, idem.as_ref())
        .await?;
    let mut resp = answer(StatusCode::CREATED, &hold);
    // Where the hold is read, released, extended: ids and tokens need no
    // escaping in a path. The string becomes the header's bytes, uncopied.
    let at = format!(
        "/v1/shows/{}/holds/{}",
        hold.value.show,
        hold.value.hold_token.as_str()
    );
    if let Ok(at) = HeaderValue::try_from(at) {
        resp.headers_mut().insert(hyper::header::LOCATION, at);
    }
    Ok(resp)
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
    // `ids` may come more than once (`?ids=E7&ids=E8`, as forms write
    // lists): every one counts.
    let ids: Vec<String> = form_urlencoded::parse(query.as_bytes())
        .filter(|(k, _)| k == "ids")
        .map(|(_, v)| v.into_owned())
        .collect();
    if ids.is_empty() {
        return Err(Error::InvalidRequest(
            "name the seats with ?ids=E7,E8".into(),
        ));
    }
    let raw: Vec<&str> = ids.iter().flat_map(|v| v.split(',')).collect();
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
    // `Last-Event-ID` names an event this client had from the stream: one
    // the stream no longer has (a failover lost it) cannot be resumed from
    // either. `?after=` is a position, which may be made from a time.
    let cursor = last_event_id
        .map(Cursor::Resume)
        .or(after_param.map(Cursor::After));
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
        .get_all(hyper::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(accepts_event_stream);
    let cluster = req.app.service.cluster();
    let keys = req.app.service.keys();
    if wants_stream {
        let sub = sse::Subscription {
            cluster: std::sync::Arc::clone(cluster),
            keys: keys.clone(),
            show,
            max_len: events.hub.max_len(),
            closing: req.app.closing.subscribe(),
            disconnect: req.head.extensions.get::<super::Disconnect>().cloned(),
        };
        let body = sse::subscribe(
            events,
            sub,
            &req.deadline(),
            cursor.unwrap_or(Cursor::Newest),
        )
        .await?;
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
    let cursor = cursor.unwrap_or(Cursor::Start);
    let span = crate::events::Span::new(limit, events.hub.max_len());
    let read = read(cluster, keys, &req.deadline(), &show, cursor, span).await?;
    // Past the last entry read, an event or not: a page of entries that
    // are not events (written by hand) must not answer its own cursor.
    let next = match (read.last, after) {
        (Some(last), _) => last.to_string(),
        (None, Some(after)) => after.to_string(),
        (None, None) => read.newest.to_string(),
    };
    let page = Page {
        events: read.events,
        next,
    };
    Ok(json(StatusCode::OK, &page))
}

/// `PATCH /v1/shows/{show}/holds/{token}`.
async fn modify(req: &Req<'_>, show: ShowId, token: &str) -> Result<Resp, Error> {
    let body: ChangeBody = req.json(true)?;
    let change = crate::hold::Change {
        add: distinct_seat_ids(&body.add)?,
        remove: distinct_seat_ids(&body.remove)?,
        pools: pool_units(&show, &body.pools, 0)?
            .into_iter()
            .map(|p| (p.pool, p.quantity))
            .collect(),
    };
    let idem = req.idem()?;
    let token = HoldToken::parse(token)?;
    let hold = req
        .service()
        .modify(&req.deadline(), &show, token, change, idem.as_ref())
        .await?;
    Ok(answer(StatusCode::OK, &hold))
}

/// `GET` and `PUT /v1/shows/{show}/pools/{pool}`.
async fn pool_route(req: &Req<'_>, show: ShowId, pool: &str) -> Result<Resp, Error> {
    let pool = PoolId::parse(pool)?;
    let capacity = if req.head.method == Method::PUT {
        let body: PoolBody = req.json(true)?;
        Some(body::count(&body.capacity, "capacity", 0)?)
    } else {
        None
    };
    let pool = req
        .service()
        .pool(&req.deadline(), &show, &pool, capacity)
        .await?;
    Ok(json(StatusCode::OK, &pool))
}

/// `PUT /v1/shows/{show}/settings`.
async fn settings(req: &Req<'_>, show: ShowId) -> Result<Resp, Error> {
    let body: SettingsBody = req.json(true)?;
    let max = body::count(&body.max_per_holder, "maxPerHolder", 0)?;
    let settings = req.service().settings(&req.deadline(), &show, max).await?;
    Ok(json(StatusCode::OK, &settings))
}

/// Whether an `Accept` value names `text/event-stream` (media types are
/// case-insensitive) with a weight above 0 (`;q=0` means "not this").
fn accepts_event_stream(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or_default().trim();
        media.eq_ignore_ascii_case("text/event-stream")
            && !parts.any(|param| {
                let (name, value) = param.split_once('=').unwrap_or((param, ""));
                name.trim().eq_ignore_ascii_case("q")
                    && value.trim().parse::<f32>().is_ok_and(|q| q <= 0.0)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::accepts_event_stream;

    #[test]
    fn event_streams_are_asked_for_in_any_case_and_not_with_weight_zero() {
        for yes in [
            "text/event-stream",
            "TEXT/EVENT-STREAM",
            "application/json, text/event-stream;q=0.5",
            "text/event-stream; charset=utf-8",
            " text/event-stream ;q=1",
        ] {
            assert!(accepts_event_stream(yes), "{yes}");
        }
        for no in [
            "",
            "*/*",
            "application/json",
            "text/event-stream;q=0",
            "text/event-stream; q=0.0",
            "text/event-streams",
            "application/json;x=\"text/event-stream\"",
        ] {
            assert!(!accepts_event_stream(no), "{no}");
        }
    }
}
