//! The TLS test material made by `scripts/tls-setup.sh` (a test CA, certificates for
//! `localhost`, a client certificate, an unrelated CA, an expired certificate), found in
//! `SAGABOX_TLS_DIR`, else `/etc/sagabox-test/tls`; and what the servers say of their
//! connections' encryption (`rabbitmqctl`, NATS's `/connz`).

use std::path::PathBuf;
use std::process::Command;

/// The folder of the test CA and certificates; fails, saying how to make them, when they
/// are missing.
pub fn tls_dir() -> PathBuf {
    let dir = std::env::var_os("SAGABOX_TLS_DIR")
        .map_or_else(|| PathBuf::from("/etc/sagabox-test/tls"), PathBuf::from);
    assert!(
        dir.join("ca.pem").is_file() && dir.join("server.pem").is_file(),
        "no TLS test material in {}: run scripts/tls-setup.sh (scripts/test.sh runs it), or \
         point SAGABOX_TLS_DIR at its folder",
        dir.display()
    );
    dir
}

/// The path of the material's file `name` (`ca.pem`, `client.key`, …).
pub fn file(name: &str) -> String {
    tls_dir().join(name).display().to_string()
}

/// `(ssl, peer_cert_subject)` of every RabbitMQ connection whose client properties hold
/// `needle` (sagabox names its connections `<prefix>/<role>`), from
/// `rabbitmqctl list_connections`.
pub fn broker_connections(needle: &str) -> Vec<(String, String)> {
    let output = Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "ssl",
            "peer_cert_subject",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl runs");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.contains(needle))
        .map(|line| {
            let mut columns = line.split('\t');
            (
                columns.next().unwrap_or("").to_owned(),
                columns.next().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// The connections named `prefix/…` on the NATS monitoring endpoint at `monitor`, as
/// `(name, tls_version)`.
pub async fn nats_connections(monitor: u16, prefix: &str) -> Vec<(String, Option<String>)> {
    let body = http_get(monitor, "/connz").await;
    let connz: serde_json::Value = serde_json::from_str(&body).expect("/connz is JSON");
    connz["connections"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|connection| {
            let name = connection["name"].as_str()?;
            name.starts_with(&format!("{prefix}/")).then(|| {
                (
                    name.to_owned(),
                    connection["tls_version"].as_str().map(str::to_owned),
                )
            })
        })
        .collect()
}

/// The body of a plain HTTP GET of `path` on loopback port `port`.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the monitoring port answers");
    socket
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .expect("request sent");
    let mut response = String::new();
    socket
        .read_to_string(&mut response)
        .await
        .expect("response read");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}
