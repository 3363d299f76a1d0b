//! Property-based fuzzing of request decoding and validation: any method,
//! path, headers and body give a well-formed JSON answer with a status and
//! code from the contract, and never a panic.
//!
//! The app here has no Redis (its seed is a closed port and nothing connects
//! it), so every request that passes validation ends in 503
//! `redis_unavailable`: validation alone decides everything else. CI runs
//! more cases with `PROPTEST_CASES`.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use proptest::prelude::*;
use seathold::config::Options;
use seathold::http::App;
use serde_json::Value;

fn app() -> Arc<App> {
    let opts = Options {
        redis_nodes: vec!["redis://127.0.0.1:1".into()],
        ..Options::default()
    };
    seathold::server::app(&opts).expect("app")
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

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..200),
        proptest::collection::vec(segment(), 0..30).prop_map(|seats| {
            serde_json::json!({ "seats": seats })
                .to_string()
                .into_bytes()
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        // A default a developer's `cargo test` pays little for; CI sets
        // PROPTEST_CASES higher.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
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
        let Ok(req) = builder.body(Full::new(Bytes::from(body.clone()))) else {
            // Not a request hyper would ever hand us.
            return Ok(());
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let (status, bytes) = rt.block_on(async {
            let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 40000));
            let resp = seathold::http::handle(app(), req, peer).await;
            let status = resp.status().as_u16();
            (status, resp.into_body().collect().await.expect("body").to_bytes())
        });
        if status < 300 {
            // Only the probes succeed without Redis.
            prop_assert!(path == "/healthz" || path == "/readyz" || method == "HEAD", "{method} {path} -> {status}");
            return Ok(());
        }
        let answer: Value = serde_json::from_slice(&bytes).expect("every error is JSON");
        let code = answer["error"].as_str().unwrap_or_default();
        prop_assert!(
            CODES.contains(&(status, code)) || (path == "/readyz" && status == 503),
            "{method} {path} {body:?} -> {status} {answer}"
        );
        prop_assert!(answer["message"].as_str().is_some_and(|m| !m.is_empty()) || path == "/readyz");
    }
}
