//! TLS to the servers sagabox talks to: the files a connection trusts and presents
//! ([`TlsFiles`]), read and checked before anything connects, and [`TlsError`], which
//! names the server, the file and what to fix.
//!
//! Every connection verifies the server against the system's trusted roots plus the CA
//! file given, if any; a client certificate is presented when a certificate and its key
//! are both given. The brokers take the files from their URL's query, in the names of
//! RabbitMQ's URI specification (`cacertfile`, `certfile`, `keyfile`), which sagabox
//! removes before the URL reaches the client library; PostgreSQL takes libpq's
//! (`sslrootcert`, `sslcert`, `sslkey`), which sqlx reads itself.
//!
//! rustls with the `ring` provider does the work everywhere, so no system TLS library is
//! needed.

// Without a broker only PostgreSQL's files are checked here; the parts that hand the
// files to a broker's client are then unused.
#![cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]

use std::fmt;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The query parameters of a broker URL that name TLS files, as RabbitMQ's URI
/// specification spells them: the CA file, the client certificate, its key.
pub const URL_PARAMETERS: [&str; 3] = ["cacertfile", "certfile", "keyfile"];

/// The files a TLS connection trusts and presents, all PEM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificates to trust beside the system's roots: a private CA, or a server's own
    /// self-signed certificate. Defaults to `None`: the system's roots only.
    pub ca_file: Option<PathBuf>,
    /// The client certificate (chain) to present. Defaults to `None`: none presented.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PKCS#8, PKCS#1 or SEC1). Defaults to `None`.
    pub key_file: Option<PathBuf>,
}

/// Why TLS to a server could not be set up: which server, which file, what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error(
        "cannot read the {role} {path} for TLS to {server}: {source}; check the path and \
         that this process may read the file"
    )]
    Unreadable {
        /// The server, as "RabbitMQ at host:port".
        server: String,
        /// What the file is for ("CA file", "client certificate", "client key").
        role: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no PEM item of the kind needed.
    #[error(
        "the {role} {path} for TLS to {server} holds no PEM {expected}: {detail}; give a PEM \
         file ({header})",
        expected = pem_kind(role).0,
        header = pem_kind(role).1
    )]
    NotPem {
        /// The server.
        server: String,
        /// What the file is for.
        role: &'static str,
        /// The file.
        path: PathBuf,
        /// What was found instead.
        detail: String,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error(
        "TLS to {server}: a client certificate needs its key and a key its certificate; \
         give both {cert} and {key}, or neither"
    )]
    HalfIdentity {
        /// The server.
        server: String,
        /// How the certificate is named where it is given (`certfile`, `sslcert`).
        cert: &'static str,
        /// How the key is named where it is given (`keyfile`, `sslkey`).
        key: &'static str,
    },
    /// rustls refused the files (a key that does not match the certificate, say).
    #[error("TLS to {server}: {reason}")]
    Rejected {
        /// The server.
        server: String,
        /// rustls's words.
        reason: String,
    },
}

/// What a file of `role` should hold, and the PEM header it starts with.
fn pem_kind(role: &str) -> (&'static str, &'static str) {
    if role.ends_with("key") {
        ("private key", "-----BEGIN PRIVATE KEY-----")
    } else {
        ("certificate", "-----BEGIN CERTIFICATE-----")
    }
}

/// The files of [`TlsFiles`], read and checked.
#[derive(Clone)]
pub(crate) struct LoadedTls {
    /// The CA file's text, as read (lapin takes the text).
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) ca_pem: Option<String>,
    /// The CA file's certificates.
    pub(crate) ca: Vec<CertificateDer<'static>>,
    /// The client certificate's and key's text, as read, and as parsed.
    pub(crate) identity: Option<Identity>,
}

/// A client certificate and its key.
#[derive(Clone)]
pub(crate) struct Identity {
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) cert_pem: Vec<u8>,
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) key_pem: Vec<u8>,
    pub(crate) certs: Vec<CertificateDer<'static>>,
    pub(crate) key: std::sync::Arc<PrivateKeyDer<'static>>,
}

impl fmt::Debug for LoadedTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedTls")
            .field("ca", &self.ca.len())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl TlsFiles {
    /// Whether no file is named.
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }

    /// Takes the [`URL_PARAMETERS`] out of `url`'s query: the URL without them, and the
    /// files they name (percent-decoded).
    pub fn split_url(url: &str) -> (String, TlsFiles) {
        let Some((base, rest)) = url.split_once('?') else {
            return (url.to_owned(), TlsFiles::default());
        };
        let (query, fragment) = match rest.split_once('#') {
            Some((query, fragment)) => (query, Some(fragment)),
            None => (rest, None),
        };
        let mut files = TlsFiles::default();
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let path = || Some(PathBuf::from(percent_decode(value)));
            match name {
                "cacertfile" => files.ca_file = path(),
                "certfile" => files.cert_file = path(),
                "keyfile" => files.key_file = path(),
                _ => kept.push(pair),
            }
        }
        let mut out = base.to_owned();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
        if let Some(fragment) = fragment {
            out.push('#');
            out.push_str(fragment);
        }
        (out, files)
    }

    /// Reads and checks every file named, for TLS to `server` (as "RabbitMQ at
    /// host:port"). `names` says how the certificate and key are given, for the error
    /// when only one of them is.
    pub(crate) fn load(
        &self,
        server: &str,
        names: (&'static str, &'static str),
    ) -> Result<LoadedTls, TlsError> {
        let (ca_pem, ca) = match &self.ca_file {
            Some(path) => {
                let text = read(server, "CA file", path)?;
                let certs = certificates(server, "CA file", path, text.as_bytes())?;
                (Some(text), certs)
            }
            None => (None, Vec::new()),
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let cert_pem = read(server, "client certificate", cert)?.into_bytes();
                let key_pem = read(server, "client key", key)?.into_bytes();
                let certs = certificates(server, "client certificate", cert, &cert_pem)?;
                let key_der =
                    PrivateKeyDer::from_pem_slice(&key_pem).map_err(|error| TlsError::NotPem {
                        server: server.to_owned(),
                        role: "client key",
                        path: key.clone(),
                        detail: error.to_string(),
                    })?;
                Some(Identity {
                    cert_pem,
                    key_pem,
                    certs,
                    key: std::sync::Arc::new(key_der),
                })
            }
            _ => {
                return Err(TlsError::HalfIdentity {
                    server: server.to_owned(),
                    cert: names.0,
                    key: names.1,
                });
            }
        };
        Ok(LoadedTls {
            ca_pem,
            ca,
            identity,
        })
    }
}

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
impl LoadedTls {
    /// A rustls client configuration (the `ring` provider) that trusts the system's roots
    /// and the CA file's certificates, and presents the client certificate if there is
    /// one.
    pub(crate) fn client_config(&self, server: &str) -> Result<rustls::ClientConfig, TlsError> {
        let rejected = |error: rustls::Error| TlsError::Rejected {
            server: server.to_owned(),
            reason: error.to_string(),
        };
        let mut roots = rustls::RootCertStore::empty();
        // A system store that cannot be read leaves only the CA file, which is what a
        // private deployment relies on anyway; the handshake then says what is missing.
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        for cert in &self.ca {
            roots.add(cert.clone()).map_err(rejected)?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(rejected)?
            .with_root_certificates(roots);
        match &self.identity {
            Some(identity) => builder
                .with_client_auth_cert(identity.certs.clone(), identity.key.clone_key())
                .map_err(rejected),
            None => Ok(builder.with_no_client_auth()),
        }
    }
}

fn read(server: &str, role: &'static str, path: &Path) -> Result<String, TlsError> {
    let unreadable = |source| TlsError::Unreadable {
        server: server.to_owned(),
        role,
        path: path.to_owned(),
        source,
    };
    let bytes = std::fs::read(path).map_err(unreadable)?;
    String::from_utf8(bytes).map_err(|_| TlsError::NotPem {
        server: server.to_owned(),
        role,
        path: path.to_owned(),
        detail: "the file is binary (DER or PKCS#12?), not PEM text".to_owned(),
    })
}

fn certificates(
    server: &str,
    role: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let not_pem = |detail: String| TlsError::NotPem {
        server: server.to_owned(),
        role,
        path: path.to_owned(),
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| not_pem(error.to_string()))?;
    if certs.is_empty() {
        return Err(not_pem(
            "no -----BEGIN CERTIFICATE----- block in it".to_owned(),
        ));
    }
    Ok(certs)
}

/// What a failed TLS handshake means and what to change, from the TLS library's words
/// (`error`), or `None` when they are not about TLS. `host` is the name connected to;
/// `ca_param` how a CA file is given where the URL came from (`sslrootcert`,
/// `cacertfile`); `name_only` how to check the signer only, where there is a way.
pub(crate) fn handshake_advice(
    error: &str,
    host: &str,
    ca_param: &str,
    name_only: Option<&str>,
) -> Option<String> {
    let lower = error.to_ascii_lowercase();
    let advice = if lower.contains("unknownissuer") || lower.contains("unknown issuer") {
        format!(
            "the server's certificate is not signed by a CA this client trusts (a self-signed \
             or private CA's certificate?): give that CA's certificate as {ca_param}=/path/ca.pem"
        )
    } else if lower.contains("not valid for name") || lower.contains("notvalidforname") {
        let mut advice = format!(
            "the server's certificate does not name the host {host}: connect by a name the \
             certificate holds"
        );
        if let Some(name_only) = name_only {
            advice.push_str(&format!(", or use {name_only} to check only who signed it"));
        }
        advice
    } else if lower.contains("expired") {
        "the server's certificate has expired: the server needs a new one".to_owned()
    } else if lower.contains("notyetvalid") || lower.contains("not yet valid") {
        "the server's certificate is not valid yet: check the clocks of both machines".to_owned()
    } else if lower.contains("does not support tls") || lower.contains("tls required") {
        "the server does not accept TLS there, and TLS was required: turn TLS on at the \
         server, or connect without it"
            .to_owned()
    } else if lower.contains("invalidcontenttype")
        || lower.contains("corrupt message")
        || lower.contains("invalid content type")
    {
        "the server did not answer in TLS: is that port a plain-text listener?".to_owned()
    } else if lower.contains("certificate") || lower.contains("handshake") || lower.contains("tls")
    {
        format!("the TLS handshake failed: check {ca_param} and the server's certificate")
    } else {
        return None;
    };
    Some(format!("{advice} ({error})"))
}

/// `error` and each of its sources, joined without repeats: the clients' own words
/// ("tls error", "client error (Connect)") hide the cause (a refused certificate, a
/// refused connection) in the sources.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut words = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_words = cause.to_string();
        if !words.contains(&cause_words) {
            words.push_str(": ");
            words.push_str(&cause_words);
        }
        source = cause.source();
    }
    words
}

/// `%XX` escapes decoded; anything malformed is kept as written.
pub(crate) fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = value.get(i + 1..i + 3)
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_parameters_are_taken_out_of_the_url() {
        let (url, files) = TlsFiles::split_url(
            "amqps://u:p@rabbit:5671/%2f?heartbeat=10&cacertfile=/etc/ca%20dir/ca.pem&certfile=c.pem&keyfile=k.pem#x",
        );
        assert_eq!(url, "amqps://u:p@rabbit:5671/%2f?heartbeat=10#x");
        assert_eq!(
            files,
            TlsFiles {
                ca_file: Some("/etc/ca dir/ca.pem".into()),
                cert_file: Some("c.pem".into()),
                key_file: Some("k.pem".into()),
            }
        );
        let (url, files) = TlsFiles::split_url("tls://nats:4222?cacertfile=ca.pem");
        assert_eq!(url, "tls://nats:4222");
        assert_eq!(files.ca_file, Some("ca.pem".into()));
        let (url, files) = TlsFiles::split_url("nats://nats:4222");
        assert_eq!(url, "nats://nats:4222");
        assert!(files.is_empty());
    }

    #[test]
    fn files_that_are_missing_or_not_pem_are_named() {
        let dir = std::env::temp_dir().join(format!("sagabox-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let text = dir.join("notes.txt");
        std::fs::write(&text, "not a certificate\n").expect("write");
        let missing = TlsFiles {
            ca_file: Some(dir.join("absent.pem")),
            ..TlsFiles::default()
        };
        let error = missing
            .load("RabbitMQ at h:5671", ("certfile", "keyfile"))
            .expect_err("missing");
        assert!(matches!(error, TlsError::Unreadable { .. }), "{error}");
        assert!(error.to_string().contains("absent.pem"), "{error}");
        let not_pem = TlsFiles {
            ca_file: Some(text.clone()),
            ..TlsFiles::default()
        };
        let error = not_pem
            .load("NATS at h:4222", ("certfile", "keyfile"))
            .expect_err("not pem");
        assert!(matches!(error, TlsError::NotPem { .. }), "{error}");
        let message = error.to_string();
        assert!(
            message.contains("notes.txt") && message.contains("NATS at h:4222"),
            "{message}"
        );
        let half = TlsFiles {
            cert_file: Some(text),
            ..TlsFiles::default()
        };
        let error = half
            .load("PostgreSQL at h:5432", ("sslcert", "sslkey"))
            .expect_err("half");
        assert!(error.to_string().contains("sslkey"), "{error}");
        std::fs::remove_dir_all(dir).ok();
    }
}
