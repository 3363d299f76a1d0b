//! Idempotency keys: a client's `Idempotency-Key` header, the fingerprint of
//! the request it names, and the outcome a script recorded under it.
//!
//! The outcome of a successful write is recorded by the same Lua script that
//! makes the change (see `lua/hold.lua`), as `<fingerprint> <status>
//! <fields…>`, under `<prefix>{show:<home>}#idem:<key>` for
//! `--idempotency-ttl-ms`. The same key with the same request (method, path,
//! body) answers that outcome again; with another request it is 422.

use sha2::{Digest, Sha256};

use crate::error::Error;

/// Longest idempotency key accepted.
pub const MAX_KEY_LEN: usize = 255;

/// A valid `Idempotency-Key`: 1-255 characters from `[A-Za-z0-9_.:-]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemKey(String);

impl IdemKey {
    /// Parses the header's value, or refuses it with 400.
    pub fn parse(raw: &[u8]) -> Result<Self, Error> {
        let valid = !raw.is_empty()
            && raw.len() <= MAX_KEY_LEN
            && raw
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
        match std::str::from_utf8(raw) {
            Ok(key) if valid => Ok(Self(key.to_owned())),
            _ => Err(Error::InvalidIdempotencyKey),
        }
    }

    /// A key of the daemon's own, for one request that needs a resend of
    /// its script to answer as the first run (release): `~` is outside the
    /// client's alphabet, so it can never equal a client's key.
    pub fn internal() -> Self {
        Self(format!("~{}", uuid::Uuid::new_v4().simple()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An idempotency key with the fingerprint of its request.
#[derive(Debug, Clone)]
pub struct Idem {
    pub key: IdemKey,
    /// Hex SHA-256 (first 32 digits) of method, path and body.
    pub fingerprint: String,
}

impl Idem {
    /// `key` for the request `method path` with `body`. JSON bodies are
    /// fingerprinted in a canonical form (see [`canonical`]), so a client
    /// that re-serialises the same request is not refused.
    pub fn new(key: IdemKey, method: &str, path: &str, body: &[u8]) -> Self {
        let canonical = canonical(body);
        let mut hash = Sha256::new();
        hash.update(method.as_bytes());
        hash.update(b" ");
        hash.update(path.as_bytes());
        hash.update(b"\n");
        hash.update(canonical.as_deref().unwrap_or(body));
        let digest = hash.finalize();
        let fingerprint = hex::encode(&digest[..16]);
        Self { key, fingerprint }
    }

    /// A daemon-made key for one request (see [`IdemKey::internal`]).
    pub fn internal() -> Self {
        Self {
            key: IdemKey::internal(),
            fingerprint: "daemon".into(),
        }
    }
}

/// `body` as the handlers read it, written one way: object members sorted
/// and without white space, a member that is null left out (the handlers
/// read it as absent), a number with no fraction written as an integer
/// (`6e4` and `60000.0` are the `60000` the handlers read), and an empty
/// object as no body at all (the routes whose body is optional read both
/// alike). `None` for a body that is not JSON (fingerprinted as sent; the
/// handlers refuse it anyway). No body, and JSON with no null member, no
/// integral fraction and not `{}`, keep the fingerprint older daemons gave
/// them, so their records still replay across an upgrade.
fn canonical(body: &[u8]) -> Option<Vec<u8>> {
    use serde_json::Value;
    fn tidy(v: Value) -> Value {
        match v {
            Value::Object(members) => Value::Object(
                members
                    .into_iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k, tidy(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.into_iter().map(tidy).collect()),
            Value::Number(n) if n.is_f64() => {
                // Integral values within i64 become integers; i64's range
                // as f64 is [-2^63, 2^63).
                match n.as_f64() {
                    Some(f) if f.fract() == 0.0 && f >= -(2f64.powi(63)) && f < 2f64.powi(63) => {
                        Value::from(f as i64)
                    }
                    _ => Value::Number(n),
                }
            }
            other => other,
        }
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Some(Vec::new());
    }
    let value = tidy(serde_json::from_slice::<Value>(body).ok()?);
    if value.as_object().is_some_and(serde_json::Map::is_empty) {
        return Some(Vec::new());
    }
    serde_json::to_vec(&value).ok()
}

/// An outcome recorded under an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub status: u16,
    /// The operation's own fields, in the order its script wrote them.
    pub fields: Vec<String>,
}

impl Recorded {
    /// Reads `record` as written for `idem`'s request: 422 when the key was
    /// used for another request.
    pub fn parse(record: &str, idem: &Idem) -> Result<Self, Error> {
        let mut parts = record.split(' ');
        let fingerprint = parts.next().unwrap_or_default();
        if fingerprint != idem.fingerprint {
            return Err(Error::IdempotencyKeyReused);
        }
        let status = parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Internal(format!("unreadable idempotency record {record:?}")))?;
        Ok(Self {
            status,
            fields: parts.map(str::to_owned).collect(),
        })
    }

    /// Field `i` as an integer.
    pub fn int(&self, i: usize) -> Result<i64, Error> {
        self.fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| Error::Internal("unreadable idempotency record".into()))
    }

    /// Field `i` and every field after it, joined as they were.
    pub fn rest(&self, i: usize) -> String {
        self.fields.get(i..).unwrap_or_default().join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(IdemKey::parse(b"order-17:try.1_A").is_ok());
        assert!(IdemKey::parse(&[b'a'; 255]).is_ok());
        for bad in [&b""[..], &[b'a'; 256], b"a b", b"a/b", b"\xff", b"~x"] {
            assert!(IdemKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fingerprints_ignore_json_layout_but_not_content() {
        let key = IdemKey::parse(b"k").expect("key");
        let a = Idem::new(
            key.clone(),
            "POST",
            "/v1/x",
            br#"{"seats":["E7"], "ttlMs":5}"#,
        );
        let b = Idem::new(
            key.clone(),
            "POST",
            "/v1/x",
            br#"{"ttlMs":5,"seats":["E7"]}"#,
        );
        let c = Idem::new(
            key.clone(),
            "POST",
            "/v1/x",
            br#"{"ttlMs":6,"seats":["E7"]}"#,
        );
        let d = Idem::new(key, "POST", "/v1/y", br#"{"ttlMs":5,"seats":["E7"]}"#);
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_ne!(a.fingerprint, c.fingerprint);
        assert_ne!(a.fingerprint, d.fingerprint);
        let rec = format!("{} 201 tok 17 99", a.fingerprint);
        let r = Recorded::parse(&rec, &a).expect("same request");
        assert_eq!((r.status, r.int(1).ok()), (201, Some(17)));
        assert!(matches!(
            Recorded::parse(&rec, &c),
            Err(Error::IdempotencyKeyReused)
        ));
    }

    #[test]
    fn canonical_forms() {
        let form =
            |body: &str| canonical(body.as_bytes()).map(|v| String::from_utf8(v).expect("utf-8"));
        let same = [
            (
                r#"{"ttlMs":60000,"seats":["A1"]}"#,
                r#"{"seats":["A1"],"ttlMs":60000}"#,
            ),
            (
                r#"{ "seats" : [ "A1" ], "ttlMs" : 6e4 }"#,
                r#"{"seats":["A1"],"ttlMs":60000}"#,
            ),
            (
                r#"{"seats":["A1"],"ttlMs":60000.0,"holder":null}"#,
                r#"{"seats":["A1"],"ttlMs":60000}"#,
            ),
            (r#"{"a":{"b":null,"c":-2.0}}"#, r#"{"a":{"c":-2}}"#),
            (r#"{"a":[null,1.0]}"#, r#"{"a":[null,1]}"#),
            ("{}", ""),
            (r#"{"ttlMs":null}"#, ""),
            ("  \n", ""),
            ("", ""),
        ];
        for (body, want) in same {
            assert_eq!(form(body).as_deref(), Some(want), "{body}");
        }
        for (body, want) in [
            (r#"{"ttlMs":60000.5}"#, r#"{"ttlMs":60000.5}"#),
            (r#"{"n":1e300}"#, r#"{"n":1e+300}"#),
            ("[]", "[]"),
        ] {
            assert_eq!(form(body).as_deref(), Some(want), "{body}");
        }
        assert_eq!(form("{nope"), None);
    }
}
