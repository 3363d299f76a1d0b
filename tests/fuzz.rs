//! Property-based fuzzing of request decoding and validation: any method,
//! path, headers and body give a well-formed JSON answer with a status and
//! code from the contract, and never a panic; and each answer agrees with
//! [`expected`], an independent statement of the contract's routing, id,
//! body and TTL rules.
//!
//! The app here has no Redis (its seed is a closed port and nothing connects
//! it), so every request that passes validation ends in 503
//! `redis_unavailable`: validation alone decides everything else, and a 503
//! for input the rules refuse is a validation hole. The app and its runtime
//! are built once for all cases. CI runs more cases with `PROPTEST_CASES`.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use proptest::prelude::*;
use seathold::config::Options;
use seathold::http::App;
use serde_json::Value;

/// The app (no Redis) and a runtime to drive it, built once.
fn app() -> &'static (tokio::runtime::Runtime, Arc<App>) {
    static APP: OnceLock<(tokio::runtime::Runtime, Arc<App>)> = OnceLock::new();
    APP.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let opts = Options {
            redis_nodes: vec!["redis://127.0.0.1:1".into()],
            ..Options::default()
        };
        let app = rt.block_on(async { seathold::server::app(&opts).expect("app") });
        (rt, app)
    })
}

/// The contract's id rule: 1-64 characters from `[A-Za-z0-9_.-]`, checked
/// on the path segment as sent.
fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// CRC16/XMODEM of the hash tag modulo 16384: Redis's slot of a show's keys.
fn show_slot(show: &str) -> u16 {
    let mut crc: u16 = 0;
    for b in format!("show:{show}").bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

const MAX_SEATS: usize = 20;
const MAX_TTL_MS: u64 = 1_800_000;

type Codes = BTreeSet<(u16, &'static str)>;

/// What the contract says a request must get from a daemon whose Redis is
/// unreachable.
#[derive(Debug)]
enum Expect {
    /// Exactly this status and code.
    Exactly(u16, &'static str),
    /// Refused: one of these (status, code), one per broken rule (which one
    /// a daemon checks first is its own choice).
    Refused(Codes),
    /// Valid: it reaches Redis, so 503 `redis_unavailable`.
    Reaches,
    /// Not decided here (probes and metrics).
    Any,
}

/// The `ttlMs` rule: absent or null, or a positive integer of at most
/// `--max-ttl-ms`, written with or without a fraction of zero (`60000.0`).
fn ttl_ok(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(v) => v
            .as_f64()
            .is_some_and(|t| t.fract() == 0.0 && (1.0..=MAX_TTL_MS as f64).contains(&t)),
    }
}

/// The rules of a list of ids: not empty, valid, at most `MAX_SEATS`,
/// distinct. `bad_id` is the code of an invalid one.
fn ids_rules<T: Ord>(
    ids: &[T],
    valid: impl Fn(&T) -> bool,
    bad_id: &'static str,
    broken: &mut Codes,
) {
    if ids.is_empty() {
        broken.insert((400, "invalid_request"));
    }
    if ids.iter().any(|id| !valid(id)) {
        broken.insert((400, bad_id));
    }
    if ids.len() > MAX_SEATS {
        broken.insert((400, "too_many_seats"));
    }
    if ids.iter().collect::<BTreeSet<_>>().len() != ids.len() {
        broken.insert((400, "duplicate_seat"));
    }
}

/// The body rules of a route that takes a JSON object with `fields`: its
/// media type, JSON syntax, an object, no other field. Answers the object.
fn json_object(
    ctype: Option<&str>,
    body: &[u8],
    required: bool,
    fields: &[&str],
    broken: &mut Codes,
) -> Option<serde_json::Map<String, Value>> {
    let is_json = ctype.is_some_and(|c| {
        c.split(';')
            .next()
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    });
    if body.is_empty() {
        if required {
            // An empty body: 400, or 415 when it does not even say JSON.
            broken.insert((400, "invalid_request"));
            if !is_json {
                broken.insert((415, "unsupported_media_type"));
            }
            return None;
        }
        return Some(serde_json::Map::new());
    }
    if !is_json {
        broken.insert((415, "unsupported_media_type"));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) if map.keys().all(|k| fields.contains(&k.as_str())) => Some(map),
        _ => {
            broken.insert((400, "invalid_request"));
            None
        }
    }
}

/// The seats of `POST /v1/holds`: `{"show":…,"seat":…}` objects, nothing
/// else in them.
fn show_seat_pairs(seats: Option<&Value>) -> Option<Vec<(&str, &str)>> {
    seats?
        .as_array()?
        .iter()
        .map(|e| {
            let e = e.as_object()?;
            if e.len() != 2 {
                return None;
            }
            Some((e.get("show")?.as_str()?, e.get("seat")?.as_str()?))
        })
        .collect()
}

/// An independent statement of the contract for one request.
fn expected(method: &str, path: &str, ctype: Option<&str>, body: &[u8]) -> Expect {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    // Segments are percent-decoded before routing (`/v1/shows/4%32` is show
    // `42`); one that does not decode to UTF-8 is kept as sent.
    let decoded: Vec<std::borrow::Cow<'_, str>> = path
        .strip_prefix('/')
        .unwrap_or(path)
        .split('/')
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .unwrap_or(std::borrow::Cow::Borrowed(s))
        })
        .collect();
    let segs: Vec<&str> = decoded.iter().map(|s| s.as_ref()).collect();
    // A trailing slash matches no route; an empty segment inside the path
    // is an empty id where a route has one (400, as the contract says of
    // empty ids), and matches nothing elsewhere (src/http/route.rs).
    if segs.last().is_some_and(|s| s.is_empty()) {
        return Expect::Exactly(404, "not_found");
    }
    let (methods, show, kind): (&[&str], Option<&str>, &str) = match segs.as_slice() {
        ["healthz"] | ["readyz"] => (&["GET", "HEAD"], None, "probe"),
        ["metrics"] => (&["GET"], None, "probe"),
        ["v1", "holds"] => (&["POST"], None, "multi"),
        ["v1", "shows", show, "holds"] => (&["POST"], Some(*show), "holds"),
        ["v1", "shows", show, "seats", _, "hold"] => (&["POST"], Some(*show), "seat-hold"),
        ["v1", "shows", show, "holds", _] if method == "PATCH" => {
            (&["PATCH"], Some(*show), "change")
        }
        ["v1", "shows", show, "holds", _] => (&["GET", "DELETE", "PATCH"], Some(*show), "hold"),
        ["v1", "shows", show, "holds", _, "extend"] => (&["POST"], Some(*show), "extend"),
        ["v1", "shows", show, "holds", _, "confirm"] => (&["POST"], Some(*show), "confirm"),
        ["v1", "shows", show, "seats", _] => (&["GET"], Some(*show), "seat"),
        ["v1", "shows", show, "seats"] => (&["GET"], Some(*show), "seats"),
        ["v1", "shows", show, "events"] => (&["GET"], Some(*show), "events"),
        ["v1", "shows", show, "pools", _] => (&["GET", "PUT"], Some(*show), "inventory"),
        ["v1", "shows", show, "settings"] => (&["PUT"], Some(*show), "inventory"),
        ["ui", "shows", show] => (&["GET"], Some(*show), "ui"),
        _ => return Expect::Exactly(404, "not_found"),
    };
    if !methods.contains(&method) {
        return Expect::Exactly(405, "method_not_allowed");
    }
    if kind == "probe" {
        return Expect::Any;
    }
    let mut broken = Codes::new();
    if show.is_some_and(|s| !valid_id(s)) {
        broken.insert((400, "invalid_show"));
    }
    // A token that is not a canonical (lowercase, hyphenated) UUID was never
    // issued: 404 without asking Redis.
    let unknown_token = matches!(kind, "hold" | "extend" | "confirm" | "change")
        && !uuid::Uuid::try_parse(segs[4]).is_ok_and(|u| u.hyphenated().to_string() == segs[4]);
    let ttl_rule = |obj: &serde_json::Map<String, Value>, broken: &mut Codes| {
        if !ttl_ok(obj.get("ttlMs")) {
            broken.insert((400, "invalid_ttl"));
        }
    };
    let mut cross_slot = false;
    match kind {
        "multi" => {
            if let Some(obj) = json_object(ctype, body, true, &["seats", "ttlMs"], &mut broken) {
                ttl_rule(&obj, &mut broken);
                match show_seat_pairs(obj.get("seats")) {
                    None => {
                        broken.insert((400, "invalid_request"));
                    }
                    Some(pairs) => {
                        if pairs.iter().any(|(s, _)| !valid_id(s)) {
                            broken.insert((400, "invalid_show"));
                        }
                        ids_rules(&pairs, |(_, s)| valid_id(s), "invalid_seat", &mut broken);
                        let slots: BTreeSet<u16> =
                            pairs.iter().map(|(s, _)| show_slot(s)).collect();
                        cross_slot = slots.len() > 1;
                    }
                }
            }
        }
        "holds" => {
            if let Some(obj) = json_object(ctype, body, true, &["seats", "ttlMs"], &mut broken) {
                ttl_rule(&obj, &mut broken);
                let ids: Option<Vec<&str>> = obj
                    .get("seats")
                    .and_then(Value::as_array)
                    .and_then(|l| l.iter().map(Value::as_str).collect());
                match ids {
                    None => {
                        broken.insert((400, "invalid_request"));
                    }
                    Some(ids) => ids_rules(&ids, |s| valid_id(s), "invalid_seat", &mut broken),
                }
            }
        }
        "seat-hold" | "extend" => {
            if kind == "seat-hold" && !valid_id(segs[4]) {
                broken.insert((400, "invalid_seat"));
            }
            if let Some(obj) = json_object(ctype, body, false, &["ttlMs"], &mut broken) {
                ttl_rule(&obj, &mut broken);
            }
        }
        "confirm" => {
            // Confirm takes no fields: a `ttlMs` there would be ignored.
            json_object(ctype, body, false, &[], &mut broken);
        }
        "change" => {
            // add/remove seat lists and pool quantities; whether they fit
            // the hold is Redis's to say.
            if let Some(obj) =
                json_object(ctype, body, true, &["add", "remove", "pools"], &mut broken)
            {
                for list in ["add", "remove"] {
                    let ids: Option<Vec<&str>> = match obj.get(list) {
                        None => Some(Vec::new()),
                        Some(v) => v
                            .as_array()
                            .and_then(|l| l.iter().map(Value::as_str).collect()),
                    };
                    match ids {
                        None => {
                            broken.insert((400, "invalid_request"));
                        }
                        Some(ids) if ids.iter().any(|s| !valid_id(s)) => {
                            broken.insert((400, "invalid_seat"));
                        }
                        Some(_) => {}
                    }
                }
            }
            return if broken.is_empty() {
                if unknown_token {
                    Expect::Exactly(404, "hold_not_found")
                } else {
                    Expect::Any
                }
            } else {
                if unknown_token {
                    broken.insert((404, "hold_not_found"));
                }
                broken.insert((400, "invalid_pool"));
                broken.insert((400, "invalid_request"));
                Expect::Refused(broken)
            };
        }
        "events" | "ui" | "inventory" => {
            // The cursor and limit rules are the events tests' to check.
            return if broken.is_empty() {
                Expect::Any
            } else {
                Expect::Refused(broken)
            };
        }
        "hold" => {}
        "seat" => {
            if !valid_id(segs[4]) {
                broken.insert((400, "invalid_seat"));
            }
        }
        _ => {
            // ?ids=: 1 to --max-seats-per-hold valid, distinct ids.
            let ids = form_urlencoded::parse(query.as_bytes())
                .find(|(k, _)| k == "ids")
                .map(|(_, v)| v.into_owned());
            match ids {
                None => {
                    broken.insert((400, "invalid_request"));
                }
                Some(ids) => {
                    let ids: Vec<&str> = ids.split(',').collect();
                    ids_rules(&ids, |s| valid_id(s), "invalid_seat", &mut broken);
                }
            }
        }
    }
    if !broken.is_empty() {
        // An unknown token may be answered first: nothing can be done with
        // it whatever else is wrong.
        if unknown_token {
            broken.insert((404, "hold_not_found"));
        }
        Expect::Refused(broken)
    } else if unknown_token {
        Expect::Exactly(404, "hold_not_found")
    } else if cross_slot {
        Expect::Exactly(422, "cross_slot")
    } else {
        Expect::Reaches
    }
}

/// The app's answer to `req`: status and body.
fn answer(req: Request<Full<Bytes>>) -> (u16, Bytes) {
    let (rt, app) = app();
    rt.block_on(async {
        let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 40000));
        let resp = seathold::http::handle(Arc::clone(app), req, peer).await;
        let status = resp.status().as_u16();
        (
            status,
            resp.into_body().collect().await.expect("body").to_bytes(),
        )
    })
}

/// Whether the answer `got` (status, code) is what `expect` allows.
fn check(expect: Expect, got: (u16, &str), why: &str) -> Result<(), TestCaseError> {
    match expect {
        Expect::Exactly(s, c) => prop_assert_eq!(got, (s, c), "{}", why),
        Expect::Refused(allowed) => {
            prop_assert!(allowed.contains(&got), "refused by {allowed:?}: {why}")
        }
        Expect::Reaches => prop_assert_eq!(got, (503, "redis_unavailable"), "valid: {}", why),
        Expect::Any => {}
    }
    Ok(())
}

const CODES: &[(u16, &str)] = &[
    (400, "invalid_request"),
    (400, "invalid_show"),
    (400, "invalid_seat"),
    (400, "invalid_ttl"),
    (400, "duplicate_seat"),
    (400, "too_many_seats"),
    (404, "hold_not_found"),
    (404, "not_found"),
    (405, "method_not_allowed"),
    (408, "request_timeout"),
    (413, "payload_too_large"),
    (415, "unsupported_media_type"),
    (422, "cross_slot"),
    (503, "redis_unavailable"),
];

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("42".to_owned()),
        Just("E7".to_owned()),
        Just("3f0c0000-0000-4000-8000-000000000000".to_owned()),
        "[A-Za-z0-9_.-]{0,70}",
        "[ -~]{0,12}".prop_map(|s| s.replace(['?', '#', ' ', '/'], "%20")),
        "(%[0-9A-Fa-f]{2}){1,4}",
    ]
}

fn path() -> impl Strategy<Value = String> {
    let known = prop_oneof![
        Just("/v1/holds".to_owned()),
        segment().prop_map(|s| format!("/v1/shows/{s}/holds")),
        (segment(), segment()).prop_map(|(a, b)| format!("/v1/shows/{a}/seats/{b}/hold")),
        (segment(), segment()).prop_map(|(a, b)| format!("/v1/shows/{a}/holds/{b}")),
        (segment(), segment()).prop_map(|(a, b)| format!("/v1/shows/{a}/holds/{b}/extend")),
        (segment(), segment()).prop_map(|(a, b)| format!("/v1/shows/{a}/holds/{b}/confirm")),
        (segment(), segment()).prop_map(|(a, b)| format!("/v1/shows/{a}/seats/{b}")),
        (segment(), "[A-Za-z0-9,%]{0,40}")
            .prop_map(|(a, q)| format!("/v1/shows/{a}/seats?ids={q}")),
        Just("/healthz".to_owned()),
        Just("/readyz".to_owned()),
    ];
    prop_oneof![
        4 => known,
        1 => proptest::collection::vec(segment(), 0..8).prop_map(|s| format!("/{}", s.join("/"))),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (1u64..4_000_000).prop_map(Value::from),
        segment().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..25).prop_map(Value::Array),
            proptest::collection::vec(
                (
                    prop_oneof![
                        Just("seats".to_owned()),
                        Just("ttlMs".to_owned()),
                        Just("show".to_owned()),
                        Just("seat".to_owned()),
                        "[a-z]{1,6}"
                    ],
                    inner
                ),
                0..4
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// `ttlMs` values at and around the edges of the TTL rules.
fn ttl_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..3).prop_map(Value::from),
        (MAX_TTL_MS - 2..MAX_TTL_MS + 3).prop_map(Value::from),
        (-3i64..0).prop_map(Value::from),
        Just(serde_json::json!(1.5)),
        Just(serde_json::json!(60000.0)),
        Just(serde_json::json!("60000")),
        Just(Value::Null),
        any::<u64>().prop_map(Value::from),
    ]
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..200),
        // Arrays where objects belong: serde reads a struct from an array
        // of its fields in order unless the daemon refuses them.
        proptest::collection::vec(json_value(), 0..3)
            .prop_map(|v| Value::Array(v).to_string().into_bytes()),
        (segment(), segment()).prop_map(|(a, b)| {
            serde_json::json!({ "seats": [[a, b]] })
                .to_string()
                .into_bytes()
        }),
        // TTLs around the rules' edges, alone and with seats.
        (
            ttl_value(),
            proptest::option::of(proptest::collection::vec(segment(), 1..4))
        )
            .prop_map(|(ttl, seats)| match seats {
                Some(seats) => serde_json::json!({ "seats": seats, "ttlMs": ttl }),
                None => serde_json::json!({ "ttlMs": ttl }),
            }
            .to_string()
            .into_bytes()),
        proptest::collection::vec(segment(), 0..30).prop_map(|seats| {
            serde_json::json!({ "seats": seats })
                .to_string()
                .into_bytes()
        }),
    ]
}

/// Cases per property: a default a developer's `cargo test` pays little
/// for; CI sets PROPTEST_CASES higher.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        // Raw paths that are no URI at all (about one in twelve) are
        // rejected, not counted as passes: allow as many as there are
        // cases, whatever PROPTEST_CASES says.
        max_global_rejects: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_request_gets_a_contract_answer(
        method in prop_oneof![Just("GET"), Just("POST"), Just("DELETE"), Just("PUT"), Just("HEAD"), Just("PATCH")],
        path in path(),
        ctype in prop_oneof![Just(None), Just(Some("application/json")), Just(Some("application/json; charset=utf-8")), Just(Some("text/plain")), Just(Some("APPLICATION/JSON"))],
        body in body(),
    ) {
        let mut builder = Request::builder().method(method).uri(&path);
        if let Some(ctype) = ctype {
            builder = builder.header("content-type", ctype);
        }
        let req = builder.body(Full::new(Bytes::from(body.clone())));
        // Not a request hyper would ever hand us: rejected, not passed.
        prop_assume!(req.is_ok());
        let req = req.expect("checked");
        let (status, bytes) = answer(req);
        if status < 300 {
            // Only the probes and the seat-map page succeed without Redis.
            prop_assert!(path == "/healthz" || path == "/readyz" || path.starts_with("/ui/"), "{method} {path} -> {status}");
            return Ok(());
        }
        let answer: Value = serde_json::from_slice(&bytes).expect("every error is JSON");
        let code = answer["error"].as_str().unwrap_or_default();
        prop_assert!(
            CODES.contains(&(status, code)) || (path == "/readyz" && status == 503),
            "{method} {path} {body:?} -> {status} {answer}"
        );
        prop_assert!(answer["message"].as_str().is_some_and(|m| !m.is_empty()) || path == "/readyz");
        let why = format!("{method} {path} {ctype:?} {:?} -> {status} {answer}", String::from_utf8_lossy(&body));
        check(expected(method, &path, ctype, &body), (status, code), &why)?;
    }
}

/// Ids at and around the edges of the id rule.
fn id_value() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[A-Za-z0-9_.-]{1,8}",
        1 => "[A-Za-z0-9_.-]{63,66}",
        1 => Just(String::new()),
        2 => ("[A-Za-z0-9]{0,4}", "[:{}/ ,é%\u{0}#?*]", "[A-Za-z0-9]{0,4}")
            .prop_map(|(a, bad, b)| format!("{a}{bad}{b}")),
    ]
}

/// Well-formed requests to the routes that validate ids and TTLs, with ids
/// and TTLs around the edges of their rules, so that every rule is tried
/// often at the default number of cases.
fn rule_request() -> impl Strategy<Value = (&'static str, String, Vec<u8>)> {
    let ids = || proptest::collection::vec(id_value(), 0..23);
    /// An id as a path segment: `/`, `?`, `#` and space all become an
    /// (invalid) space, and every other byte a URI cannot carry as it is
    /// (NUL, `é`, `%`, braces) is percent-encoded, so that the daemon sees
    /// the id itself after decoding.
    fn enc(s: &str) -> String {
        let mut out = String::new();
        for c in s.chars() {
            match c {
                '/' | '?' | '#' | ' ' => out.push_str("%20"),
                c if c.is_ascii_alphanumeric() || "-._~:@!$&'()*+,;=".contains(c) => out.push(c),
                c => {
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.push_str(&format!("%{b:02X}"));
                    }
                }
            }
        }
        out
    }
    let token = || {
        prop_oneof![
            Just("3f0c0000-0000-4000-8000-000000000000".to_owned()),
            Just("3F0C0000-0000-4000-8000-000000000000".to_owned()),
            "[a-z0-9-]{1,40}",
        ]
    };
    let ttl = || proptest::option::of(ttl_value());
    fn with_ttl(mut v: Value, ttl: Option<Value>) -> Vec<u8> {
        if let Some(ttl) = ttl {
            v["ttlMs"] = ttl;
        }
        v.to_string().into_bytes()
    }
    prop_oneof![
        (id_value(), ids(), ttl()).prop_map(move |(show, seats, ttl)| {
            let body = with_ttl(serde_json::json!({ "seats": seats }), ttl);
            ("POST", format!("/v1/shows/{}/holds", enc(&show)), body)
        }),
        (id_value(), id_value(), ttl()).prop_map(move |(show, seat, ttl)| {
            let body = with_ttl(serde_json::json!({}), ttl);
            (
                "POST",
                format!("/v1/shows/{}/seats/{}/hold", enc(&show), enc(&seat)),
                body,
            )
        }),
        (id_value(), token(), ttl()).prop_map(move |(show, token, ttl)| {
            let body = with_ttl(serde_json::json!({}), ttl);
            (
                "POST",
                format!("/v1/shows/{}/holds/{token}/extend", enc(&show)),
                body,
            )
        }),
        (id_value(), token()).prop_map(move |(show, token)| {
            (
                "POST",
                format!("/v1/shows/{}/holds/{token}/confirm", enc(&show)),
                Vec::new(),
            )
        }),
        (
            proptest::collection::vec((id_value(), id_value()), 0..23),
            ttl()
        )
            .prop_map(move |(seats, ttl)| {
                let seats: Vec<Value> = seats
                    .into_iter()
                    .map(|(show, seat)| serde_json::json!({ "show": show, "seat": seat }))
                    .collect();
                let body = with_ttl(serde_json::json!({ "seats": seats }), ttl);
                ("POST", "/v1/holds".to_owned(), body)
            }),
        (id_value(), id_value()).prop_map(move |(show, seat)| {
            (
                "GET",
                format!("/v1/shows/{}/seats/{}", enc(&show), enc(&seat)),
                Vec::new(),
            )
        }),
        (id_value(), ids()).prop_map(move |(show, seats)| {
            let query: String = form_urlencoded::Serializer::new(String::new())
                .append_pair("ids", &seats.join(","))
                .finish();
            (
                "GET",
                format!("/v1/shows/{}/seats?{query}", enc(&show)),
                Vec::new(),
            )
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// 400 exactly when the id and TTL rules say so; otherwise the request
    /// reaches Redis (503 here), is cross-slot (422) or names a token that
    /// was never issued (404).
    #[test]
    fn ids_and_ttls_are_refused_exactly_by_the_rules((method, path, body) in rule_request()) {
        let Ok(req) = Request::builder()
            .method(method)
            .uri(&path)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
        else {
            // Every id is percent-encoded: each request is one hyper
            // could hand the daemon.
            return Err(TestCaseError::fail(format!("not a valid request: {method} {path}")));
        };
        let (status, bytes) = answer(req);
        let answer: Value = serde_json::from_slice(&bytes).expect("every error is JSON");
        let code = answer["error"].as_str().unwrap_or_default();
        let why = format!("{method} {path} {:?} -> {status} {answer}", String::from_utf8_lossy(&body));
        let expect = expected(method, &path, Some("application/json"), &body);
        prop_assert!(!matches!(expect, Expect::Any), "not a rule request: {}", why);
        check(expect, (status, code), &why)?;
    }
}
