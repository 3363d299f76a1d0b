//! One handler per API route: parse the ids of the path and body once,
//! call the hold service, shape the answer. The request's Redis deadline is
//! made here, once, when its body has arrived.

use hyper::http::request::Parts;
use hyper::{Method, StatusCode};

use super::body::{self, MultiHoldBody, ReqBody, ShowHoldBody, TtlBody};
use super::route::Route;
use super::{empty, json, App, Resp};
use crate::error::Error;
use crate::ids::{HoldToken, SeatId, ShowId};
use crate::model::{SeatRef, SeatState, SeatStates, Seats};

/// Serves an admitted API request.
pub(super) async fn serve(
    app: &App,
    route: Route<'_>,
    head: &Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    match route {
        Route::MultiHold => multi_hold(app, head, body).await,
        Route::ShowHolds { show } => show_hold(app, ShowId::parse(show)?, head, body).await,
        Route::SeatHold { show, seat } => {
            seat_hold(app, ShowId::parse(show)?, seat, head, body).await
        }
        Route::Hold { show, token } if head.method == Method::GET => {
            get_hold(app, ShowId::parse(show)?, token).await
        }
        Route::Hold { show, token } => release(app, ShowId::parse(show)?, token).await,
        Route::Extend { show, token } => extend(app, ShowId::parse(show)?, token, head, body).await,
        Route::Confirm { show, token } => {
            confirm(app, ShowId::parse(show)?, token, head, body).await
        }
        Route::Seat { show, seat } => seat_state(app, ShowId::parse(show)?, seat).await,
        Route::Seats { show } => seat_states(app, ShowId::parse(show)?, head).await,
        Route::Healthz | Route::Readyz | Route::Metrics | Route::Unknown => Err(Error::NotFound),
    }
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
async fn multi_hold(app: &App, head: &Parts, body: impl ReqBody) -> Result<Resp, Error> {
    let body: MultiHoldBody = body::json(app.body, head, body, true).await?;
    let Some(first) = body.seats.first() else {
        return Err(Error::InvalidRequest(
            "seats must name at least one seat".into(),
        ));
    };
    let ttl = body::ttl(body.ttl_ms)?;
    let home = ShowId::parse(&first.show)?;
    let seats = body
        .seats
        .iter()
        .map(|r| {
            Ok(SeatRef {
                show: ShowId::parse(&r.show)?,
                seat: SeatId::parse(&r.seat)?,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    hold(app, &home, Seats::Multi(seats), ttl).await
}

/// `POST /v1/shows/{show}/holds`.
async fn show_hold(
    app: &App,
    show: ShowId,
    head: &Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    let body: ShowHoldBody = body::json(app.body, head, body, true).await?;
    let ttl = body::ttl(body.ttl_ms)?;
    hold(app, &show, Seats::Show(seat_ids(&body.seats)?), ttl).await
}

/// `POST /v1/shows/{show}/seats/{seat}/hold`.
async fn seat_hold(
    app: &App,
    show: ShowId,
    seat: &str,
    head: &Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    let body: TtlBody = body::json(app.body, head, body, false).await?;
    let ttl = body::ttl(body.ttl_ms)?;
    hold(app, &show, Seats::Show(vec![SeatId::parse(seat)?]), ttl).await
}

async fn hold(app: &App, home: &ShowId, seats: Seats, ttl: Option<u64>) -> Result<Resp, Error> {
    let deadline = app.service.cluster().deadline();
    let hold = app.service.hold(&deadline, home, seats, ttl).await?;
    Ok(json(StatusCode::CREATED, &hold))
}

/// `GET /v1/shows/{show}/holds/{token}`.
async fn get_hold(app: &App, show: ShowId, token: &str) -> Result<Resp, Error> {
    let token = HoldToken::parse(token)?;
    let deadline = app.service.cluster().deadline();
    let hold = app.service.get(&deadline, &show, token).await?;
    Ok(json(StatusCode::OK, &hold))
}

/// `DELETE /v1/shows/{show}/holds/{token}`.
async fn release(app: &App, show: ShowId, token: &str) -> Result<Resp, Error> {
    let token = HoldToken::parse(token)?;
    let deadline = app.service.cluster().deadline();
    app.service.release(&deadline, &show, token).await?;
    Ok(empty(StatusCode::NO_CONTENT))
}

/// `POST /v1/shows/{show}/holds/{token}/extend`.
async fn extend(
    app: &App,
    show: ShowId,
    token: &str,
    head: &Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    let body: TtlBody = body::json(app.body, head, body, false).await?;
    let ttl = body::ttl(body.ttl_ms)?;
    let token = HoldToken::parse(token)?;
    let deadline = app.service.cluster().deadline();
    let hold = app.service.extend(&deadline, &show, token, ttl).await?;
    Ok(json(StatusCode::OK, &hold))
}

/// `POST /v1/shows/{show}/holds/{token}/confirm`.
async fn confirm(
    app: &App,
    show: ShowId,
    token: &str,
    head: &Parts,
    body: impl ReqBody,
) -> Result<Resp, Error> {
    let _: TtlBody = body::json(app.body, head, body, false).await?;
    let token = HoldToken::parse(token)?;
    let deadline = app.service.cluster().deadline();
    let confirmation = app.service.confirm(&deadline, &show, token).await?;
    Ok(json(StatusCode::OK, &confirmation))
}

/// `GET /v1/shows/{show}/seats/{seat}`.
async fn seat_state(app: &App, show: ShowId, seat: &str) -> Result<Resp, Error> {
    let seat = SeatId::parse(seat)?;
    let deadline = app.service.cluster().deadline();
    let states = app
        .service
        .seat_states(&deadline, &show, std::slice::from_ref(&seat))
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
async fn seat_states(app: &App, show: ShowId, head: &Parts) -> Result<Resp, Error> {
    let query = head.uri.query().unwrap_or_default();
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
    let deadline = app.service.cluster().deadline();
    let states = app.service.seat_states(&deadline, &show, &seats).await?;
    let states = seats
        .into_iter()
        .zip(states)
        .map(|(seat, state)| SeatState::new(None, seat, state));
    Ok(json(StatusCode::OK, &SeatStates::new(show, states)))
}
