//! How to reach Redis: the seed nodes, credentials and TLS files, checked
//! at start-up (a TLS file with plain seeds, or one without PEM contents,
//! would otherwise show only as a timeout or `UnknownIssuer` later).

use std::time::Duration;

use super::{set_flags, ConfigError, Options};
use crate::cluster::RedisOptions;

impl Options {
    /// The TLS file flags given.
    pub(super) fn tls_flags(&self) -> Vec<&'static str> {
        set_flags(&[
            (self.redis_ca_file.is_some(), "--redis-ca-file"),
            (self.redis_cert_file.is_some(), "--redis-cert-file"),
            (self.redis_key_file.is_some(), "--redis-key-file"),
        ])
    }

    /// How to reach Redis; reads the TLS files and checks that they hold
    /// what their flags say, and that the seeds are `rediss://` when there
    /// are any.
    pub fn redis(&self) -> Result<RedisOptions, ConfigError> {
        let nodes: Vec<String> = self
            .redis_nodes
            .iter()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        let tls_flags = self.tls_flags();
        // The Redis client makes every connection TLS once it has
        // certificates, whatever the URL says: a plain port then never
        // answers, and all start-up would show is a timeout.
        if !tls_flags.is_empty() {
            if let Some(plain) = nodes.iter().find(|n| is_plain_url(n)) {
                return Err(ConfigError(format!(
                    "{} given, but the seed node {} is a plain redis:// URL: the TLS files make every connection TLS, which a plain port never answers; give the nodes' TLS ports as rediss:// URLs, or drop the TLS flags",
                    tls_flags.join(", "),
                    crate::cluster::redact_url(plain)
                )));
            }
        }
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path)
                .map_err(|e| ConfigError(format!("cannot read {what} {}: {e}", path.display())))
        };
        let tls = if self.redis_ca_file.is_some() || self.redis_cert_file.is_some() {
            let root_cert = match &self.redis_ca_file {
                Some(path) => {
                    let pem = read(path, "--redis-ca-file")?;
                    check_certificates(&pem, "--redis-ca-file", path, true)?;
                    Some(pem)
                }
                None => None,
            };
            let client_tls = match (&self.redis_cert_file, &self.redis_key_file) {
                (Some(cert), Some(key)) => {
                    let client_cert = read(cert, "--redis-cert-file")?;
                    check_certificates(&client_cert, "--redis-cert-file", cert, false)?;
                    let client_key = read(key, "--redis-key-file")?;
                    check_key(&client_key, key)?;
                    Some(redis::ClientTlsConfig {
                        client_cert,
                        client_key,
                    })
                }
                _ => None,
            };
            Some(redis::TlsCertificates {
                client_tls,
                root_cert,
            })
        } else {
            None
        };
        Ok(RedisOptions {
            tls,
            nodes,
            username: self.redis_username.clone(),
            password: self.redis_password.clone(),
            timeout: Duration::from_millis(self.redis_timeout_ms),
        })
    }
}

/// Whether a seed URL is a plain (not TLS) `redis://` one.
fn is_plain_url(url: &str) -> bool {
    url.split_once("://")
        .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("redis"))
}

/// Checks that `pem` holds at least one PEM certificate, all readable (and,
/// for a CA file, usable as trust anchors): the Redis client would take a
/// file without one as an empty list, and a CA file without one as a trust
/// store that trusts nothing (every connection failing with
/// `UnknownIssuer`).
fn check_certificates(
    pem: &[u8],
    flag: &str,
    path: &std::path::Path,
    trust_anchors: bool,
) -> Result<(), ConfigError> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut store = rustls::RootCertStore::empty();
    let mut found = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| {
            ConfigError(format!(
                "{flag} {}: unreadable PEM certificate: {e}",
                path.display()
            ))
        })?;
        if trust_anchors {
            store.add(cert).map_err(|e| {
                ConfigError(format!(
                    "{flag} {}: a certificate in it is not usable as a CA: {e}",
                    path.display()
                ))
            })?;
        }
        found += 1;
    }
    if found == 0 {
        return Err(ConfigError(format!(
            "{flag} {} holds no PEM certificate (a -----BEGIN CERTIFICATE----- block)",
            path.display()
        )));
    }
    Ok(())
}

/// Checks that `pem` holds a PEM private key.
fn check_key(pem: &[u8], path: &std::path::Path) -> Result<(), ConfigError> {
    use rustls::pki_types::{pem::PemObject, PrivateKeyDer};
    PrivateKeyDer::from_pem_slice(pem).map(drop).map_err(|e| {
        let why = match e {
            rustls::pki_types::pem::Error::NoItemsFound => {
                "holds no PEM private key (a -----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY block)".to_owned()
            }
            other => format!("has no readable PEM private key: {other}"),
        };
        ConfigError(format!("--redis-key-file {} {why}", path.display()))
    })
}
