//! The one classification of Redis errors: what went wrong (the `kind` label
//! of `seathold_redis_errors_total`) and whether sending the command again,
//! elsewhere or later, can help.

/// Why Redis could not serve a request; the `kind` label of
/// `seathold_redis_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisFault {
    /// No answer within the request's deadline.
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
    /// A reply that seathold did not expect, or an error that retrying
    /// cannot mend: a key of a foreign type (`WRONGTYPE`), a script error.
    /// Answered 500, never "try again".
    Protocol,
    /// Any other error reply.
    Other,
}

/// What a failed command's error says about sending it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The slot is served elsewhere now (`MOVED`, `ASK`, a replica's
    /// `READONLY`): learn the new owner and send it there.
    Elsewhere,
    /// The cluster is changing (`TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`,
    /// `LOADING`): the same command may succeed shortly.
    Later,
    /// The connection broke or was refused: another connection may serve.
    Reconnect,
    /// An answer to give as it is (a script error, a timeout, an ACL refusal).
    No,
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
        classify(err).0
    }
}

/// The fault and the retry advice of one error of the redis client.
pub fn classify(err: &redis::RedisError) -> (RedisFault, Retry) {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    if err.is_timeout() {
        return (RedisFault::Timeout, Retry::No);
    }
    // The cluster client reports a failed initial connection as an I/O
    // error whose text names the authentication failure.
    let text = err.to_string();
    // Inside a script, an ACL refusal is an `ERR` that says so.
    if [
        "AuthenticationFailed",
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "user executing the script can't",
    ]
    .iter()
    .any(|c| text.contains(c))
    {
        return (RedisFault::Auth, Retry::No);
    }
    match err.kind() {
        K::Io | K::ClusterConnectionNotFound => (RedisFault::Io, Retry::Reconnect),
        K::AuthenticationFailed | K::Server(S::NoPerm) => (RedisFault::Auth, Retry::No),
        K::Parse | K::UnexpectedReturnType => (RedisFault::Protocol, Retry::No),
        _ if err.code() == Some("WRONGTYPE")
            || (err.kind() == K::Server(S::ResponseError) && text.contains("script")) =>
        {
            (RedisFault::Protocol, Retry::No)
        }
        K::Server(S::ReadOnly) => (RedisFault::ReadOnly, Retry::Elsewhere),
        K::Server(S::Moved | S::Ask) => (RedisFault::Cluster, Retry::Elsewhere),
        K::Server(S::ClusterDown | S::MasterDown | S::TryAgain | S::BusyLoading) => {
            (RedisFault::Cluster, Retry::Later)
        }
        _ if err.is_connection_dropped() || err.is_connection_refusal() || err.is_io_error() => {
            (RedisFault::Io, Retry::Reconnect)
        }
        _ if err.code() == Some("NOAUTH") || err.code() == Some("WRONGPASS") => {
            (RedisFault::Auth, Retry::No)
        }
        _ => (RedisFault::Other, Retry::No),
    }
}
