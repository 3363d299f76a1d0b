//! The routes: parsed from the path alone, each with its template (the
//! `route` label of the latency histogram) and the methods it allows. This
//! is the one place that decides which methods a route answers.
//!
//! A match over path segments: a dozen fixed routes do not need a routing
//! crate, and the match gives each route its template without building
//! strings per request. Segments are percent-decoded first (`/v1/shows/4%32`
//! is show `42`), like the query's `ids`; an empty segment (`//`, a trailing
//! slash) matches no route.

use std::borrow::Cow;

use hyper::Method;

/// Most segments of any route's path.
const MAX_SEGMENTS: usize = 7;

/// A path's segments, percent-decoded (borrowed when nothing was encoded).
#[derive(Debug)]
pub struct Segments<'p>(Vec<Cow<'p, str>>);

impl<'p> Segments<'p> {
    /// Splits and decodes `path`; `None` when it cannot be a route's (too
    /// many segments). A segment that does not decode to UTF-8 is kept as
    /// sent and refused later as an invalid id.
    pub fn of(path: &'p str) -> Option<Self> {
        let mut segments = Vec::with_capacity(MAX_SEGMENTS);
        for seg in path.strip_prefix('/').unwrap_or(path).split('/') {
            if segments.len() == MAX_SEGMENTS {
                return None;
            }
            // Most segments have nothing to decode (and are UTF-8 already).
            let decoded = if seg.contains('%') {
                percent_encoding::percent_decode_str(seg)
                    .decode_utf8()
                    .unwrap_or(Cow::Borrowed(seg))
            } else {
                Cow::Borrowed(seg)
            };
            segments.push(decoded);
        }
        Some(Self(segments))
    }
}

/// A route, borrowing its ids (unparsed) from the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route<'p> {
    Healthz,
    Readyz,
    Metrics,
    OpenApi,
    MultiHold,
    ShowHolds { show: &'p str },
    SeatHold { show: &'p str, seat: &'p str },
    Hold { show: &'p str, token: &'p str },
    Extend { show: &'p str, token: &'p str },
    Confirm { show: &'p str, token: &'p str },
    Seat { show: &'p str, seat: &'p str },
    Seats { show: &'p str },
    Events { show: &'p str },
    Pool { show: &'p str, pool: &'p str },
    Settings { show: &'p str },
    Ui { show: &'p str },
    Unknown,
}

/// Every route, its ids named as in its template (`{show}`, `{seat}`,
/// `{token}`): [`Route::parse`] of a template gives its route back. The
/// OpenAPI document (`docs/openapi.json`) is checked against this list.
pub const ALL: &[Route<'static>] = &[
    Route::Healthz,
    Route::Readyz,
    Route::Metrics,
    Route::OpenApi,
    Route::MultiHold,
    Route::ShowHolds { show: "{show}" },
    Route::SeatHold {
        show: "{show}",
        seat: "{seat}",
    },
    Route::Hold {
        show: "{show}",
        token: "{token}",
    },
    Route::Extend {
        show: "{show}",
        token: "{token}",
    },
    Route::Confirm {
        show: "{show}",
        token: "{token}",
    },
    Route::Seat {
        show: "{show}",
        seat: "{seat}",
    },
    Route::Seats { show: "{show}" },
    Route::Events { show: "{show}" },
    Route::Pool {
        show: "{show}",
        pool: "{pool}",
    },
    Route::Settings { show: "{show}" },
    Route::Ui { show: "{show}" },
];

/// Every route's template with the methods it answers.
pub fn all() -> impl Iterator<Item = (&'static str, &'static [Method])> {
    ALL.iter().map(|r| (r.template(), r.methods()))
}

impl<'p> Route<'p> {
    /// Matches decoded path segments to a route.
    pub fn parse(segments: Option<&'p Segments<'_>>) -> Self {
        let Some(segments) = segments else {
            return Self::Unknown;
        };
        // A trailing slash matches no route. An empty segment inside the
        // path (`/v1/shows//holds`) is an empty id where the route has one,
        // which its handler refuses with 400 as the contract says of empty
        // ids; elsewhere it matches nothing.
        if segments.0.last().is_some_and(|s| s.is_empty()) {
            return Self::Unknown;
        }
        let mut segs = [""; MAX_SEGMENTS];
        for (slot, seg) in segs.iter_mut().zip(&segments.0) {
            *slot = seg;
        }
        match &segs[..segments.0.len()] {
            ["healthz"] => Self::Healthz,
            ["readyz"] => Self::Readyz,
            ["metrics"] => Self::Metrics,
            ["openapi.json"] => Self::OpenApi,
            ["v1", "holds"] => Self::MultiHold,
            ["v1", "shows", show, "holds"] => Self::ShowHolds { show },
            ["v1", "shows", show, "seats", seat, "hold"] => Self::SeatHold { show, seat },
            ["v1", "shows", show, "holds", token] => Self::Hold { show, token },
            ["v1", "shows", show, "holds", token, "extend"] => Self::Extend { show, token },
            ["v1", "shows", show, "holds", token, "confirm"] => Self::Confirm { show, token },
            ["v1", "shows", show, "seats", seat] => Self::Seat { show, seat },
            ["v1", "shows", show, "seats"] => Self::Seats { show },
            ["v1", "shows", show, "events"] => Self::Events { show },
            ["v1", "shows", show, "pools", pool] => Self::Pool { show, pool },
            ["v1", "shows", show, "settings"] => Self::Settings { show },
            ["ui", "shows", show] => Self::Ui { show },
            _ => Self::Unknown,
        }
    }

    /// The route's template: the `route` label of the latency histogram.
    pub fn template(&self) -> &'static str {
        match self {
            Self::Healthz => "/healthz",
            Self::Readyz => "/readyz",
            Self::Metrics => "/metrics",
            Self::OpenApi => "/openapi.json",
            Self::MultiHold => "/v1/holds",
            Self::ShowHolds { .. } => "/v1/shows/{show}/holds",
            Self::SeatHold { .. } => "/v1/shows/{show}/seats/{seat}/hold",
            Self::Hold { .. } => "/v1/shows/{show}/holds/{token}",
            Self::Extend { .. } => "/v1/shows/{show}/holds/{token}/extend",
            Self::Confirm { .. } => "/v1/shows/{show}/holds/{token}/confirm",
            Self::Seat { .. } => "/v1/shows/{show}/seats/{seat}",
            Self::Seats { .. } => "/v1/shows/{show}/seats",
            Self::Events { .. } => "/v1/shows/{show}/events",
            Self::Pool { .. } => "/v1/shows/{show}/pools/{pool}",
            Self::Settings { .. } => "/v1/shows/{show}/settings",
            Self::Ui { .. } => "/ui/shows/{show}",
            Self::Unknown => "unmatched",
        }
    }

    /// The path with its ids decoded: what identifies the route and its
    /// ids however the client percent-encoded them (`/v1/shows/4%32` is
    /// `/v1/shows/42`), for an idempotency key's fingerprint.
    pub fn canonical(&self) -> String {
        let (first, second) = match *self {
            Self::SeatHold { show, seat } | Self::Seat { show, seat } => (show, seat),
            Self::Hold { show, token }
            | Self::Extend { show, token }
            | Self::Confirm { show, token } => (show, token),
            Self::Pool { show, pool } => (show, pool),
            _ => (self.show().unwrap_or(""), ""),
        };
        let mut path = String::with_capacity(64);
        for (i, seg) in self.template().split('/').enumerate() {
            if i > 0 {
                path.push('/');
            }
            path.push_str(match seg {
                "{show}" => first,
                s if s.starts_with('{') => second,
                s => s,
            });
        }
        path
    }

    /// The show named in the path, as sent (not yet validated).
    pub fn show(&self) -> Option<&'p str> {
        match *self {
            Self::ShowHolds { show }
            | Self::SeatHold { show, .. }
            | Self::Hold { show, .. }
            | Self::Extend { show, .. }
            | Self::Confirm { show, .. }
            | Self::Seat { show, .. }
            | Self::Seats { show }
            | Self::Events { show }
            | Self::Pool { show, .. }
            | Self::Settings { show }
            | Self::Ui { show } => Some(show),
            Self::Healthz
            | Self::Readyz
            | Self::Metrics
            | Self::OpenApi
            | Self::MultiHold
            | Self::Unknown => None,
        }
    }

    /// The methods the route answers (HEAD only where it says so).
    pub fn methods(&self) -> &'static [Method] {
        match self {
            Self::Healthz | Self::Readyz => &[Method::GET, Method::HEAD],
            Self::Metrics
            | Self::OpenApi
            | Self::Seat { .. }
            | Self::Seats { .. }
            | Self::Events { .. }
            | Self::Ui { .. } => &[Method::GET],
            Self::Hold { .. } => &[Method::GET, Method::DELETE, Method::PATCH],
            Self::Pool { .. } => &[Method::GET, Method::PUT],
            Self::Settings { .. } => &[Method::PUT],
            Self::MultiHold
            | Self::ShowHolds { .. }
            | Self::SeatHold { .. }
            | Self::Extend { .. }
            | Self::Confirm { .. } => &[Method::POST],
            Self::Unknown => &[],
        }
    }

    /// Whether the route answers `method`.
    pub fn allows(&self, method: &Method) -> bool {
        self.methods().contains(method)
    }

    /// The `Allow` header of a 405 on this route.
    pub fn allow_header(&self) -> &'static str {
        match self.methods() {
            [Method::GET, Method::HEAD] => "GET, HEAD",
            [Method::GET, Method::DELETE, Method::PATCH] => "GET, DELETE, PATCH",
            [Method::GET, Method::PUT] => "GET, PUT",
            [Method::PUT] => "PUT",
            [Method::POST] => "POST",
            _ => "GET",
        }
    }

    /// Whether the route is an API route (under `/v1`), as opposed to the
    /// probes and metrics, which are never refused for load.
    pub fn is_api(&self) -> bool {
        !matches!(
            self,
            Self::Healthz
                | Self::Readyz
                | Self::Metrics
                | Self::OpenApi
                | Self::Ui { .. }
                | Self::Unknown
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str, check: impl FnOnce(Route<'_>)) {
        let segments = Segments::of(path);
        check(Route::parse(segments.as_ref()));
    }

    #[test]
    fn parses_every_route_and_its_methods() {
        route("/v1/shows/42/holds/t/extend", |r| {
            assert_eq!(
                r,
                Route::Extend {
                    show: "42",
                    token: "t"
                }
            )
        });
        route("/v1/shows/4%32/seats/E%37", |r| {
            assert_eq!(
                r,
                Route::Seat {
                    show: "42",
                    seat: "E7"
                }
            )
        });
        route("/v1/shows/42/seats/%FF", |r| {
            assert_eq!(
                r,
                Route::Seat {
                    show: "42",
                    seat: "%FF"
                }
            )
        });
        route("/v1/shows//holds", |r| {
            assert_eq!(r, Route::ShowHolds { show: "" })
        });
        route("/v1/shows/42/seats//hold", |r| {
            assert_eq!(
                r,
                Route::SeatHold {
                    show: "42",
                    seat: ""
                }
            )
        });
        for unknown in [
            "/v1/shows/42/seats/E7/hold/x",
            "/a/b/c/d/e/f/g/h",
            "/v1/shows/42/holds/",
            "/v1//holds",
            "//healthz",
            "/healthz/",
        ] {
            route(unknown, |r| assert_eq!(r, Route::Unknown, "{unknown}"));
        }
        let segments = Segments::of("/v1/shows/42/holds/t");
        let hold = Route::parse(segments.as_ref());
        assert!(hold.allows(&Method::DELETE) && !hold.allows(&Method::POST));
        assert!(hold.allows(&Method::PATCH));
        assert_eq!(hold.allow_header(), "GET, DELETE, PATCH");
        assert!(Route::Healthz.allows(&Method::HEAD));
        assert!(!Route::Metrics.allows(&Method::HEAD));
        assert_eq!(Route::Readyz.allow_header(), "GET, HEAD");
        assert_eq!(Route::Metrics.allow_header(), "GET");
        assert_eq!(Route::MultiHold.allow_header(), "POST");
    }

    #[test]
    fn canonical_paths_decode_ids_and_keep_the_template() {
        for (sent, canonical) in [
            ("/v1/shows/4%32/holds", "/v1/shows/42/holds"),
            ("/v1/shows/42/seats/E%37/hold", "/v1/shows/42/seats/E7/hold"),
            (
                "/v1/shows/42/holds/a%2Db/confirm",
                "/v1/shows/42/holds/a-b/confirm",
            ),
            ("/v1/shows/42/pools/fl%6For", "/v1/shows/42/pools/floor"),
            ("/v1/%68olds", "/v1/holds"),
        ] {
            route(sent, |r| assert_eq!(r.canonical(), canonical, "{sent}"));
        }
    }

    #[test]
    fn all_lists_every_route_once_and_parses_back() {
        // Adding a variant breaks this match: add it to `ALL` too.
        fn index(r: &Route<'_>) -> usize {
            match r {
                Route::Healthz => 0,
                Route::Readyz => 1,
                Route::Metrics => 2,
                Route::OpenApi => 3,
                Route::MultiHold => 4,
                Route::ShowHolds { .. } => 5,
                Route::SeatHold { .. } => 6,
                Route::Hold { .. } => 7,
                Route::Extend { .. } => 8,
                Route::Confirm { .. } => 9,
                Route::Seat { .. } => 10,
                Route::Seats { .. } => 11,
                Route::Events { .. } => 12,
                Route::Ui { .. } => 13,
                Route::Pool { .. } => 14,
                Route::Settings { .. } => 15,
                Route::Unknown => usize::MAX,
            }
        }
        let indices: std::collections::BTreeSet<usize> = ALL.iter().map(index).collect();
        assert_eq!(indices, (0..=15).collect(), "every route, once");
        for r in ALL {
            route(r.template(), |parsed| assert_eq!(parsed, *r));
        }
    }

    /// `docs/openapi.json` documents exactly the routes of [`ALL`], each with
    /// exactly the methods it answers.
    #[test]
    fn the_openapi_document_has_every_route_and_method() {
        use std::collections::{BTreeMap, BTreeSet};
        let doc: serde_json::Value =
            serde_json::from_str(crate::http::OPENAPI).expect("docs/openapi.json is JSON");
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().expect("paths");
        const OPERATIONS: [&str; 8] = [
            "get", "put", "post", "delete", "options", "head", "patch", "trace",
        ];
        let documented: BTreeMap<&str, BTreeSet<String>> = paths
            .iter()
            .map(|(path, item)| {
                let methods = OPERATIONS
                    .iter()
                    .filter(|m| item.get(**m).is_some())
                    .map(|m| m.to_uppercase())
                    .collect();
                (path.as_str(), methods)
            })
            .collect();
        let routed: BTreeMap<&str, BTreeSet<String>> = all()
            .map(|(template, methods)| (template, methods.iter().map(|m| m.to_string()).collect()))
            .collect();
        assert_eq!(
            routed, documented,
            "the router (left) and docs/openapi.json (right) differ"
        );
        // A 405's `Allow` names exactly the methods documented.
        for r in ALL {
            let allow: BTreeSet<String> = r.allow_header().split(", ").map(str::to_owned).collect();
            assert_eq!(allow, documented[r.template()], "Allow of {}", r.template());
        }
    }
}
