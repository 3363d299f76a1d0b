//! The one error type of the API, and the one place that turns it into a
//! status code and a JSON body.
//!
//! Details of 5xx errors are logged, not sent: the client gets the error code
//! and a sentence, never Redis's own message.

use hyper::StatusCode;
use serde::Serialize;

use crate::cluster::RedisFault;
use crate::model::{Confirmation, SeatSlot, Shortfall, Taken};

/// Every way a request can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("show id {0:?} is not 1-64 characters from [A-Za-z0-9_.-]")]
    InvalidShow(String),
    #[error("seat id {0:?} is not 1-64 characters from [A-Za-z0-9_.-]")]
    InvalidSeat(String),
    #[error("pool id {0:?} is not 1-64 characters from [A-Za-z0-9_.-]")]
    InvalidPool(String),
    #[error("holder ids are 1-128 characters from [A-Za-z0-9_.:@-]")]
    InvalidHolder,
    #[error("{0}")]
    InvalidTtl(String),
    #[error("seat {0} appears more than once")]
    DuplicateSeat(String),
    #[error("a hold may have at most {0} seats and at most {0} pools")]
    TooManySeats(usize),
    #[error("no hold with this token: it expired, was released or confirmed, or never existed")]
    HoldNotFound,
    #[error("no such route")]
    NotFound,
    #[error("no such pool: create it with PUT and a capacity")]
    PoolNotFound,
    #[error("method not allowed on this route")]
    MethodNotAllowed(&'static str),
    #[error("some of the seats are already held or sold")]
    SeatsTaken(Vec<Taken>, Vec<Shortfall>),
    #[error("a pool has fewer units available than the hold asks for (a pool never created has none: create it with PUT and a capacity)")]
    PoolExhausted(Vec<Shortfall>),
    #[error("the holder would hold or have bought more than this show allows")]
    HolderLimit {
        limit: i64,
        current: i64,
        requested: i64,
    },
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
    NotReplicated(Box<Confirmation>),
    #[error("a missing or wrong API token")]
    Unauthorized,
    #[error("the request body did not arrive in time")]
    RequestTimeout,
    #[error("the server is at its limit of requests or connections; try again shortly")]
    Overloaded,
    #[error("internal error")]
    Internal(String),
    #[error("Redis refused the operation; this is a bug or foreign data in a seathold key")]
    RedisRefused(RedisFault, String),
    #[error("Idempotency-Key must be one header of 1-255 characters from [A-Za-z0-9_.:-]")]
    InvalidIdempotencyKey,
    #[error("this Idempotency-Key was used for a different request")]
    IdempotencyKeyReused,
    #[error("events after this cursor are no longer all in the stream (trimmed, or the cursor lost in a Redis failover); reload the seat states and resume from the newest event")]
    EventsExpired,
}

impl Error {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest(_)
            | Self::InvalidShow(_)
            | Self::InvalidSeat(_)
            | Self::InvalidPool(_)
            | Self::InvalidHolder
            | Self::InvalidTtl(_)
            | Self::DuplicateSeat(_)
            | Self::TooManySeats(_)
            | Self::InvalidIdempotencyKey => StatusCode::BAD_REQUEST,
            Self::HoldNotFound | Self::NotFound | Self::PoolNotFound => StatusCode::NOT_FOUND,
            Self::EventsExpired => StatusCode::GONE,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::SeatsTaken(..) | Self::PoolExhausted(_) | Self::HolderLimit { .. } => {
                StatusCode::CONFLICT
            }
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::CrossSlot(_) | Self::LifetimeExceeded { .. } | Self::IdempotencyKeyReused => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::RedisUnavailable(..) | Self::NotReplicated(_) | Self::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal(_) | Self::RedisRefused(..) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `error` code of the body.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => "invalid_request",
            Self::InvalidShow(_) => "invalid_show",
            Self::InvalidSeat(_) => "invalid_seat",
            Self::InvalidPool(_) => "invalid_pool",
            Self::InvalidHolder => "invalid_holder",
            Self::InvalidTtl(_) => "invalid_ttl",
            Self::DuplicateSeat(_) => "duplicate_seat",
            Self::TooManySeats(_) => "too_many_seats",
            Self::HoldNotFound => "hold_not_found",
            Self::NotFound | Self::PoolNotFound => "not_found",
            Self::MethodNotAllowed(_) => "method_not_allowed",
            Self::SeatsTaken(..) => "seats_taken",
            Self::PoolExhausted(_) => "pool_exhausted",
            Self::HolderLimit { .. } => "holder_limit",
            Self::PayloadTooLarge(_) => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::CrossSlot(_) => "cross_slot",
            Self::LifetimeExceeded { .. } => "lifetime_exceeded",
            Self::RedisUnavailable(..) => "redis_unavailable",
            Self::Overloaded => "overloaded",
            Self::NotReplicated(_) => "not_replicated",
            Self::Unauthorized => "unauthorized",
            Self::RequestTimeout => "request_timeout",
            Self::Internal(_) | Self::RedisRefused(..) => "internal",
            Self::InvalidIdempotencyKey => "invalid_idempotency_key",
            Self::IdempotencyKeyReused => "idempotency_key_reused",
            Self::EventsExpired => "events_expired",
        }
    }

    /// The JSON body: `error`, `message` and the details the contract names.
    pub fn body(&self) -> ErrorBody<'_> {
        let detail = match self {
            Self::SeatsTaken(taken, pools) => Detail::Taken { taken, pools },
            Self::PoolExhausted(pools) => Detail::Pools { pools },
            Self::HolderLimit {
                limit,
                current,
                requested,
            } => Detail::Holder {
                limit: *limit,
                current: *current,
                requested: *requested,
            },
            Self::CrossSlot(slots) => Detail::Slots { slots },
            Self::LifetimeExceeded {
                max_ms,
                remaining_ms,
            } => Detail::Lifetime {
                max_hold_lifetime_ms: *max_ms,
                allowed_ttl_ms: (*remaining_ms).max(0),
            },
            Self::NotReplicated(confirmation) => Detail::Confirmation(confirmation),
            Self::TooManySeats(max) => Detail::MaxSeats { max_seats: *max },
            Self::PayloadTooLarge(max) => Detail::MaxBytes { max_bytes: *max },
            _ => Detail::None {},
        };
        ErrorBody {
            error: self.code(),
            message: self.to_string(),
            detail,
        }
    }
}

/// An error's JSON body.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    error: &'static str,
    message: String,
    #[serde(flatten)]
    detail: Detail<'a>,
}

/// The details an error code carries besides `error` and `message`.
#[derive(Debug, Serialize)]
#[serde(untagged, rename_all_fields = "camelCase")]
enum Detail<'a> {
    None {},
    Taken {
        taken: &'a [Taken],
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        pools: &'a [Shortfall],
    },
    Pools {
        pools: &'a [Shortfall],
    },
    Holder {
        limit: i64,
        current: i64,
        requested: i64,
    },
    Slots {
        slots: &'a [SeatSlot],
    },
    Lifetime {
        max_hold_lifetime_ms: u64,
        allowed_ttl_ms: i64,
    },
    Confirmation(&'a Confirmation),
    MaxSeats {
        max_seats: usize,
    },
    MaxBytes {
        max_bytes: usize,
    },
}

impl From<redis::RedisError> for Error {
    /// A fault that retrying cannot mend (a key of a foreign type, a script
    /// error) is 500 `internal`; everything else is 503, try again.
    fn from(err: redis::RedisError) -> Self {
        match RedisFault::of(&err) {
            RedisFault::Protocol => Self::RedisRefused(RedisFault::Protocol, err.to_string()),
            fault => Self::RedisUnavailable(fault, err.to_string()),
        }
    }
}
