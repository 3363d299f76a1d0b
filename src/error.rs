//! The one error type of the API, and the one place that turns it into a
//! status code and a JSON body.
//!
//! Details of 5xx errors are logged, not sent: the client gets the error code
//! and a sentence, never Redis's own message.

use hyper::StatusCode;
use serde::Serialize;

/// A seat that a hold could not take.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Taken {
    /// Set for holds made with `POST /v1/holds`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show: Option<String>,
    pub seat: String,
    /// `held` or `sold`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<i64>,
}

/// The slot of one seat of a refused cross-slot hold.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SeatSlot {
    pub show: String,
    pub seat: String,
    pub slot: u16,
}

/// A confirmation, sent with 200 or, when replication fell short, inside the
/// 503 `not_replicated` body.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Confirmation {
    pub hold_token: String,
    pub show: String,
    pub seats: serde_json::Value,
    pub fence: i64,
    pub replicas: i64,
}

/// Why Redis could not serve a request; the `kind` label of
/// `seathold_redis_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisFault {
    /// No answer within `--redis-timeout-ms`.
    Timeout,
    /// Connection refused, reset or closed.
    Io,
    /// The cluster is down, a master is unreachable, or slots are moving.
    Cluster,
    /// A node refused a write because it is a replica.
    ReadOnly,
    /// The ACL user lacks a permission, or authentication failed.
    Auth,
    /// No cluster connection yet (start-up before the cluster was reachable).
    NotConnected,
    /// A reply that seathold did not expect (a bug, or a key of a foreign type).
    Protocol,
    /// Any other error reply.
    Other,
}

impl RedisFault {
    /// Every kind, for registering the series at zero.
    pub const ALL: [Self; 8] = [
        Self::Timeout,
        Self::Io,
        Self::Cluster,
        Self::ReadOnly,
        Self::Auth,
        Self::NotConnected,
        Self::Protocol,
        Self::Other,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Io => "io",
            Self::Cluster => "cluster",
            Self::ReadOnly => "readonly",
            Self::Auth => "auth",
            Self::NotConnected => "not_connected",
            Self::Protocol => "protocol",
            Self::Other => "other",
        }
    }

    /// Classifies an error of the redis client.
    pub fn of(err: &redis::RedisError) -> Self {
        use redis::{ErrorKind as K, ServerErrorKind as S};
        if err.is_timeout() {
            return Self::Timeout;
        }
        // The cluster client reports a failed initial connection as an I/O
        // error whose text names the authentication failure.
        let text = err.to_string();
        if ["AuthenticationFailed", "WRONGPASS", "NOAUTH", "NOPERM"]
            .iter()
            .any(|c| text.contains(c))
        {
            return Self::Auth;
        }
        match err.kind() {
            K::Io | K::ClusterConnectionNotFound => Self::Io,
            K::AuthenticationFailed => Self::Auth,
            K::Parse | K::UnexpectedReturnType => Self::Protocol,
            K::Server(S::NoPerm) => Self::Auth,
            K::Server(S::ReadOnly) => Self::ReadOnly,
            K::Server(
                S::ClusterDown | S::MasterDown | S::TryAgain | S::Moved | S::Ask | S::BusyLoading,
            ) => Self::Cluster,
            _ if err.is_connection_dropped()
                || err.is_connection_refusal()
                || err.is_io_error() =>
            {
                Self::Io
            }
            _ if err.code() == Some("NOAUTH") || err.code() == Some("WRONGPASS") => Self::Auth,
            _ => Self::Other,
        }
    }
}

/// Every way a request can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("show ids are 1-64 characters from [A-Za-z0-9_.-]")]
    InvalidShow,
    #[error("seat ids are 1-64 characters from [A-Za-z0-9_.-]")]
    InvalidSeat,
    #[error("{0}")]
    InvalidTtl(String),
    #[error("seat {0} appears more than once")]
    DuplicateSeat(String),
    #[error("a hold may have at most {0} seats")]
    TooManySeats(usize),
    #[error("no hold with this token: it expired, was released or confirmed, or never existed")]
    HoldNotFound,
    #[error("no such route")]
    NotFound,
    #[error("method not allowed on this route")]
    MethodNotAllowed(&'static str),
    #[error("some of the seats are already held or sold")]
    SeatsTaken(Vec<Taken>),
    #[error("the body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    #[error("the body must be JSON (Content-Type: application/json)")]
    UnsupportedMediaType,
    #[error("the seats fall in more than one Redis Cluster hash slot and cannot be held together")]
    CrossSlot(Vec<SeatSlot>),
    #[error("the hold would live longer than {max_ms} ms from its creation")]
    LifetimeExceeded { max_ms: u64, remaining_ms: i64 },
    #[error("Redis Cluster is unavailable; try again")]
    RedisUnavailable(RedisFault, String),
    #[error("the seats are sold, but fewer replicas than required acknowledged the sale in time; retry the confirm")]
    NotReplicated(Confirmation),
    #[error("a missing or wrong API token")]
    Unauthorized,
    #[error("the request body did not arrive in time")]
    RequestTimeout,
    #[error("the server is at its limit of requests or connections; try again shortly")]
    Overloaded,
    #[error("internal error")]
    Internal(String),
}

impl Error {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest(_)
            | Self::InvalidShow
            | Self::InvalidSeat
            | Self::InvalidTtl(_)
            | Self::DuplicateSeat(_)
            | Self::TooManySeats(_) => StatusCode::BAD_REQUEST,
            Self::HoldNotFound | Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::SeatsTaken(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::CrossSlot(_) | Self::LifetimeExceeded { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::RedisUnavailable(..) | Self::NotReplicated(_) | Self::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `error` code of the body.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => "invalid_request",
            Self::InvalidShow => "invalid_show",
            Self::InvalidSeat => "invalid_seat",
            Self::InvalidTtl(_) => "invalid_ttl",
            Self::DuplicateSeat(_) => "duplicate_seat",
            Self::TooManySeats(_) => "too_many_seats",
            Self::HoldNotFound => "hold_not_found",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed(_) => "method_not_allowed",
            Self::SeatsTaken(_) => "seats_taken",
            Self::PayloadTooLarge(_) => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::CrossSlot(_) => "cross_slot",
            Self::LifetimeExceeded { .. } => "lifetime_exceeded",
            Self::RedisUnavailable(..) => "redis_unavailable",
            Self::Overloaded => "overloaded",
            Self::NotReplicated(_) => "not_replicated",
            Self::Unauthorized => "unauthorized",
            Self::RequestTimeout => "request_timeout",
            Self::Internal(_) => "internal",
        }
    }

    /// The JSON body: `error`, `message` and the details the contract names.
    pub fn body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({ "error": self.code(), "message": self.to_string() });
        let extra = match self {
            Self::SeatsTaken(taken) => serde_json::json!({ "taken": taken }),
            Self::CrossSlot(slots) => serde_json::json!({ "slots": slots }),
            Self::LifetimeExceeded {
                max_ms,
                remaining_ms,
            } => {
                serde_json::json!({ "maxHoldLifetimeMs": max_ms, "allowedTtlMs": remaining_ms.max(&0) })
            }
            Self::NotReplicated(c) => serde_json::to_value(c).unwrap_or_default(),
            Self::TooManySeats(max) => serde_json::json!({ "maxSeats": max }),
            Self::PayloadTooLarge(max) => serde_json::json!({ "maxBytes": max }),
            _ => return body,
        };
        if let (Some(body), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        body
    }
}

impl From<redis::RedisError> for Error {
    fn from(err: redis::RedisError) -> Self {
        Self::RedisUnavailable(RedisFault::of(&err), err.to_string())
    }
}
