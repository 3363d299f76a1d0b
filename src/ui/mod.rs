//! The live seat-map page, `GET /ui/shows/{show}`: one self-contained HTML
//! file (no external scripts, fonts or build step) compiled into the binary.
//! It loads the batch seat states, follows the show's event stream, and
//! holds, releases and confirms seats through the API; see `seatmap.html`.

use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use crate::error::Error;
use crate::http::{full, Resp};
use crate::ids::ShowId;

/// The page, as compiled in.
pub const PAGE: &str = include_str!("seatmap.html");

/// The page for `show`, or 404 when `--ui off`.
pub fn page(enabled: bool, show: &str) -> Result<Resp, Error> {
    if !enabled {
        return Err(Error::NotFound);
    }
    ShowId::parse(show)?;
    let mut resp = Response::new(full(PAGE));
    *resp.status_mut() = StatusCode::OK;
    let headers = resp.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Everything is inline and same-origin: nothing else may load.
    headers.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    // No framing (its buttons hold and buy), no guessing of the type.
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    Ok(resp)
}
