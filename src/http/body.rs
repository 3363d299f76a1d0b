//! Request bodies: reading them within their limits, and decoding the JSON
//! of each route.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Body;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::http::request::Parts;
use serde::Deserialize;

use crate::error::Error;

/// A request body as hyper hands it over; every reader takes any such body,
/// so handlers can be driven by tests without a socket.
pub trait ReqBody: Body<Data = Bytes, Error = Self::Fault> {
    type Fault: std::error::Error + Send + Sync + 'static;
}

impl<B> ReqBody for B
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Fault = B::Error;
}

/// A JSON object whose keys are each given once. serde_json keeps the last
/// of a key given twice in a map (a struct refuses it): `{"seat":"E7",
/// "seat":"E8"}` would hold E8 alone, and `{"floor":1,"floor":5}` five
/// units. Such a body is 400 `invalid_request`, as a key twice at the top.
struct Object(serde_json::Map<String, serde_json::Value>);

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = serde_json::Map<String, serde_json::Value>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = serde_json::Map::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.contains_key(&key) {
                        return Err(serde::de::Error::custom(format_args!(
                            "duplicate key `{key}`"
                        )));
                    }
                    let value = map.next_value()?;
                    out.insert(key, value);
                }
                Ok(out)
            }
        }
        d.deserialize_map(Keys).map(Object)
    }
}

/// A map field read as an [`Object`].
fn unique_keys<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<serde_json::Map<String, serde_json::Value>, D::Error> {
    Object::deserialize(d).map(|o| o.0)
}

/// `POST /v1/shows/{show}/holds`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ShowHoldBody {
    #[serde(default)]
    pub seats: Vec<String>,
    /// Pool units: `{"floor":2}`.
    #[serde(default, deserialize_with = "unique_keys")]
    pub pools: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    pub holder: Option<serde_json::Value>,
    #[serde(default)]
    pub ttl_ms: Option<serde_json::Value>,
}

/// One element of `POST /v1/holds`'s `seats`, ids not yet parsed: a seat
/// `{"show","seat"}` or pool units `{"show","pool","quantity"}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSeatRef {
    pub show: String,
    #[serde(default)]
    pub seat: Option<String>,
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default)]
    pub quantity: Option<serde_json::Value>,
}

/// `POST /v1/holds`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MultiHoldBody {
    /// Objects only: read as [`RawSeatRef`] directly, serde would also take
    /// a `["show", "seat"]` array; see [`MultiHoldBody::seats`].
    seats: Vec<Object>,
    #[serde(default)]
    pub ttl_ms: Option<serde_json::Value>,
    #[serde(default)]
    pub holder: Option<serde_json::Value>,
}

/// The optional body of `POST /v1/shows/{show}/seats/{seat}/hold`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SeatHoldBody {
    #[serde(default)]
    pub ttl_ms: Option<serde_json::Value>,
    #[serde(default)]
    pub holder: Option<serde_json::Value>,
}

/// `PUT /v1/shows/{show}/pools/{pool}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolBody {
    pub capacity: serde_json::Value,
}

/// `PUT /v1/shows/{show}/settings`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SettingsBody {
    pub max_per_holder: serde_json::Value,
}

/// `PATCH /v1/shows/{show}/holds/{token}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangeBody {
    #[serde(default)]
    pub add: Vec<String>,
    #[serde(default)]
    pub remove: Vec<String>,
    /// New quantities per pool (0 gives a pool's units back).
    #[serde(default, deserialize_with = "unique_keys")]
    pub pools: serde_json::Map<String, serde_json::Value>,
}

/// A count field: an integer from `min` to `u32::MAX`; 400
/// `invalid_request` otherwise. As for `ttlMs`, an integer is a number
/// without a fractional part however it is written (`2`, `2.0`, `2e0`), as
/// JSON Schema's `integer` (and so the OpenAPI document) has it.
pub fn count(value: &serde_json::Value, name: &str, min: u64) -> Result<u64, Error> {
    let max = u64::from(u32::MAX);
    let n = match value {
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(v), _) => Some(v),
            // Past u32::MAX is refused anyway; the bound keeps the cast exact.
            (None, Some(f)) if f.fract() == 0.0 && (0.0..=max as f64).contains(&f) => {
                Some(f as u64)
            }
            _ => None,
        },
        _ => None,
    };
    match n {
        Some(n) if n >= min && n <= max => Ok(n),
        _ => Err(Error::InvalidRequest(format!(
            "{name} must be an integer of at least {min}"
        ))),
    }
}

/// A `holder` field: absent, or a valid holder id (400 `invalid_holder`).
pub fn holder(value: Option<serde_json::Value>) -> Result<Option<crate::ids::HolderId>, Error> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => crate::ids::HolderId::parse(&s).map(Some),
        Some(_) => Err(Error::InvalidHolder),
    }
}

/// Confirm's optional body: an empty object, nothing else (a `ttlMs` there
/// would be ignored, so it is refused).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EmptyBody {}

impl MultiHoldBody {
    /// The seats, each a `{"show":…,"seat":…}` object.
    pub fn seats(&self) -> Result<Vec<RawSeatRef>, Error> {
        self.seats
            .iter()
            .map(|s| serde_json::from_value(serde_json::Value::Object(s.0.clone())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::InvalidRequest(format!("invalid JSON body: {e}")))
    }
}

/// The optional body of single-seat holds and extend.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TtlBody {
    #[serde(default)]
    pub ttl_ms: Option<serde_json::Value>,
}

/// `ttlMs` must be a positive integer; its range is the service's rule.
/// Any JSON value is accepted by the decoder so that a wrong type answers
/// `invalid_ttl`, not `invalid_request`. An integer is a number without a
/// fractional part however it is written (`60000`, `60000.0`, `6e4`), as
/// JSON Schema's `integer` (and so the OpenAPI document) has it.
pub fn ttl(value: Option<serde_json::Value>) -> Result<Option<u64>, Error> {
    let invalid = || Error::InvalidTtl("ttlMs must be a positive integer".into());
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
            (Some(v), _) if v > 0 => Ok(Some(v)),
            (Some(_), _) => Err(invalid()),
            // Saturates past u64::MAX, which is over any --max-ttl-ms.
            (None, Some(f)) if f >= 1.0 && f.fract() == 0.0 => Ok(Some(f as u64)),
            _ => Err(invalid()),
        },
        Some(_) => Err(invalid()),
    }
}

/// The body limits of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_bytes: usize,
    /// How long a client may take to send a body (--body-read-timeout-ms).
    pub timeout: Duration,
}

/// Reads the whole body: at most `max_bytes` (413 past it, at once when
/// `Content-Length` says so), within the body timeout (then 408).
pub async fn read(limits: Limits, head: &Parts, body: impl ReqBody) -> Result<Bytes, Error> {
    let max = limits.max_bytes;
    let declared = head
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(Error::PayloadTooLarge(max));
    }
    // A body that is already known to be empty (no Content-Length, or 0)
    // needs no timer: most single-seat holds have none.
    if body.is_end_stream() {
        return Ok(Bytes::new());
    }
    let collect = tokio::time::timeout(limits.timeout, Limited::new(body, max).collect());
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

/// Decodes a JSON body. With `required`, an empty body is an error;
/// otherwise it decodes as `{}`. A non-empty body must say it is JSON.
pub fn json<T: serde::de::DeserializeOwned>(
    head: &Parts,
    bytes: &[u8],
    required: bool,
) -> Result<T, Error> {
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
    serde_json::from_slice(bytes)
        .map_err(|e| Error::InvalidRequest(format!("invalid JSON body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_is_a_positive_integer_however_written() {
        let ttl = |raw: &str| ttl(Some(serde_json::from_str(raw).expect("json"))).ok();
        for (raw, want) in [
            ("60000", Some(Some(60000))),
            ("60000.0", Some(Some(60000))),
            ("6e4", Some(Some(60000))),
            ("1", Some(Some(1))),
            ("null", Some(None)),
            ("0", None),
            ("0.0", None),
            ("-5", None),
            ("1.5", None),
            ("0.5", None),
            ("\"100\"", None),
            ("true", None),
        ] {
            assert_eq!(ttl(raw), want, "{raw}");
        }
        assert_eq!(ttl("1e30"), Some(Some(u64::MAX)));
    }

    #[test]
    fn counts_are_integers_however_written() {
        let count =
            |raw: &str, min| count(&serde_json::from_str(raw).expect("json"), "n", min).ok();
        for (raw, min, want) in [
            ("2", 1, Some(2)),
            ("2.0", 1, Some(2)),
            ("2e0", 1, Some(2)),
            ("0", 0, Some(0)),
            ("0.0", 0, Some(0)),
            ("-0.0", 0, Some(0)),
            ("0", 1, None),
            ("0.0", 1, None),
            ("4294967295", 0, Some(4_294_967_295)),
            ("4294967295.0", 0, Some(4_294_967_295)),
            ("4294967296", 0, None),
            ("4294967296.0", 0, None),
            ("1e30", 0, None),
            ("-1", 0, None),
            ("-1.0", 0, None),
            ("1.5", 0, None),
            ("\"2\"", 0, None),
            ("null", 0, None),
            ("true", 0, None),
        ] {
            assert_eq!(count(raw, min), want, "{raw} from {min}");
        }
    }
}
