//! Parse, don't validate: the ids of the API as types. An id that exists is
//! valid, so code behind the HTTP edge never checks one again.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Longest show or seat id the API accepts.
pub const MAX_ID_LEN: usize = 64;

/// Whether `id` follows the show and seat id rule: 1 to 64 characters from
/// `[A-Za-z0-9_.-]`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// `id` as an error names it: at most 80 characters, so that a client's
/// megabyte of garbage is not echoed back.
fn truncated(id: &str) -> String {
    match id.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &id[..at]),
        None => id.to_owned(),
    }
}

/// Defines a string newtype that can only hold a valid id.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $error:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Parses `id`, or refuses it with its 400 error.
            pub fn parse(id: &str) -> Result<Self, Error> {
                if valid_id(id) {
                    Ok(Self(id.to_owned()))
                } else {
                    Err($error(truncated(id)))
                }
            }

            /// The id as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(d)?;
                if valid_id(&raw) {
                    Ok(Self(raw))
                } else {
                    Err(serde::de::Error::custom(format_args!(
                        "{:?} is not a valid id: 1-64 characters from [A-Za-z0-9_.-]",
                        raw
                    )))
                }
            }
        }
    };
}

id_type!(
    /// A show id: the partition of an on-sale; every key of a show shares
    /// its hash tag.
    ShowId,
    Error::InvalidShow
);
id_type!(
    /// A seat id within a show.
    SeatId,
    Error::InvalidSeat
);

id_type!(
    /// A pool id within a show: general admission areas, limited stock.
    PoolId,
    Error::InvalidPool
);

/// Longest holder id accepted.
pub const MAX_HOLDER_LEN: usize = 128;

/// Whether `id` is a valid holder id: 1 to 128 characters from
/// `[A-Za-z0-9_.:@-]`.
pub fn valid_holder(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_HOLDER_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'@' | b'-'))
}

/// The buyer a hold is for, as the client names it: holder limits count
/// per holder and show.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct HolderId(String);

impl HolderId {
    /// Parses `id`, or refuses it with 400 `invalid_holder`.
    pub fn parse(id: &str) -> Result<Self, Error> {
        if valid_holder(id) {
            Ok(Self(id.to_owned()))
        } else {
            Err(Error::InvalidHolder)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A hold token as issued: a lowercase hyphenated UUID v4 string. A string
/// of any other shape was never issued, so it is a hold that does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldToken(String);

impl HoldToken {
    /// A fresh random token.
    pub fn new() -> Self {
        Self(uuid::Uuid::new_v4().hyphenated().to_string())
    }

    /// Parses a token from a path: 404 `hold_not_found` when it is not in
    /// the canonical form, without asking Redis.
    pub fn parse(token: &str) -> Result<Self, Error> {
        match uuid::Uuid::try_parse(token) {
            Ok(u) if u.hyphenated().to_string() == token => Ok(Self(token.to_owned())),
            _ => Err(Error::HoldNotFound),
        }
    }

    /// The token as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hold's public ref in events: the first 16 hex digits of
    /// SHA-256 of the token. A holder can compute it; nobody can go back.
    pub fn hold_ref(&self) -> String {
        hex::encode(self.ref_bytes())
    }

    /// The hold's ref as a number (the same 64 bits as [`Self::hold_ref`]'s
    /// hex digits): what the sweeper remembers of the holds it expired.
    pub fn ref_number(&self) -> u64 {
        u64::from_be_bytes(self.ref_bytes())
    }

    fn ref_bytes(&self) -> [u8; 8] {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(self.0.as_bytes());
        let mut first = [0; 8];
        first.copy_from_slice(&digest[..8]);
        first
    }
}

impl AsRef<str> for HoldToken {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Default for HoldToken {
    fn default() -> Self {
        Self::new()
    }
}

impl Serialize for HoldToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(valid_id("E7"));
        assert!(valid_id("42-floor.upper_1"));
        assert!(valid_id(&"a".repeat(64)));
        assert!(!valid_id(&"a".repeat(65)));
        for bad in ["", "a b", "a{b", "a}b", "a:b", "a/b", "é", "a,b", "a\n"] {
            assert!(!valid_id(bad), "{bad:?}");
            assert!(ShowId::parse(bad).is_err());
            assert!(SeatId::parse(bad).is_err());
        }
    }

    #[test]
    fn holders() {
        for good in ["alice", "a@b.c", "user:17", "x-y_z.1", &"h".repeat(128)] {
            assert!(HolderId::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "a b", "a/b", "a|b", "é", &"h".repeat(129)] {
            assert!(HolderId::parse(bad).is_err(), "{bad}");
        }
        assert!(PoolId::parse("floor").is_ok() && PoolId::parse("a@b").is_err());
    }

    #[test]
    fn tokens() {
        let t = HoldToken::new();
        assert_eq!(HoldToken::parse(t.as_str()).ok(), Some(t));
        assert!(HoldToken::parse("3F0C0000-0000-4000-8000-000000000000").is_err());
        assert!(HoldToken::parse("nope").is_err());
        // sha256("3f0c0000-0000-4000-8000-000000000000"), first 8 bytes.
        let known = HoldToken::parse("3f0c0000-0000-4000-8000-000000000000").expect("token");
        assert_eq!(known.hold_ref(), "9003699547b6db14");
        assert_eq!(known.ref_number(), 0x9003_6995_47b6_db14);
    }
}
