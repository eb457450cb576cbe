//! TLS to every server, against real TLS endpoints: this machine's PostgreSQL (serving
//! a certificate of the test CA, and checking client certificates against it), RabbitMQ's AMQPS
//! listener and its management API over HTTPS, and a `nats-server` the test starts with
//! `--tls`. Each connection is shown to be encrypted from the server's side
//! (`pg_stat_ssl`, `rabbitmqctl list_connections`, NATS's `/connz`), and each bad input
//! (a wrong CA, a wrong host name, an expired certificate, a plain-text server, a file
//! that is missing or not PEM) is refused with an error that says what to fix.
//!
//! The TLS material and the listeners come from `scripts/tls-setup.sh` (run by the
//! README's test command, `scripts/test.sh`); the tests find them in `SAGABOX_TLS_DIR`,
//! else `/etc/sagabox-test/tls`, and fail, saying so, when they are missing.

#![allow(clippy::unwrap_used)]

// Refused rather than skipped: under `cargo test -p sagabox` the library's default features
// leave some of these out, and a suite that silently does not run proves nothing.
#[cfg(not(all(feature = "postgres", feature = "rabbitmq", feature = "nats")))]
compile_error!(
    "tests/tls.rs needs the features postgres, rabbitmq and nats: run `cargo test` at the workspace's root, \
     or `cargo test -p sagabox --all-features`"
);

mod common;
#[path = "common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use common::Pg;
use common::rabbit::Rabbit;
use common::tls::{broker_connections, file, nats_connections, tls_dir};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use sagabox::amqp::{AmqpConfig, AmqpError};
use sagabox::database::ConnectError;
use sagabox::delivery::Disposition;
use sagabox::nats::{NatsConfig, NatsError};
use sagabox::tls::TlsError;
use sagabox::transport::{Sender, TransportError};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore};
use serde_json::json;
use sqlx::Row;

/// `pg.url` on host `host` with `query` added.
fn pg_url(pg: &Pg, host: &str, query: &str) -> String {
    let url = pg.url.replacen("127.0.0.1", host, 1);
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{query}")
}

/// What PostgreSQL reports of the session behind one of `store`'s connections.
async fn session_ssl(store: &PostgresStore) -> (bool, Option<String>, Option<String>) {
    let row =
        sqlx::query("SELECT ssl, version, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(store.pool())
            .await
            .unwrap();
    (
        row.get("ssl"),
        row.get("version"),
        row.get::<Option<String>, _>("client_dn"),
    )
}

#[tokio::test]
async fn a_require_session_is_encrypted_and_the_inbox_works_over_it() {
    let pg = Pg::new().await;
    let store = PostgresStore::connect(&pg_url(&pg, "127.0.0.1", "sslmode=require"), 2)
        .await
        .unwrap();
    let (ssl, version, _) = session_ssl(&store).await;
    assert!(ssl, "sslmode=require gave a plain-text session");
    assert!(version.unwrap().starts_with("TLS"));
    // The whole claim path over it: applied once, the duplicate gets the first answer.
    let guard = InboxGuard::new(store, InboxConfig::default()).unwrap();
    let payment = ConsumerType::new("payment").unwrap();
    let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({"cents": 1})).unwrap();
    for _ in 0..2 {
        guard
            .process(&payment, &envelope, async |_, _| {
                Ok::<_, sqlx::Error>(json!({"ok": 1}))
            })
            .await
            .unwrap();
    }
    assert_eq!(pg.inbox_rows().await, 1);
    assert_eq!(pg.duplicates_counted().await, 1);
    // And the same query tells a plain session apart.
    let plain = PostgresStore::connect(&pg_url(&pg, "127.0.0.1", "sslmode=disable"), 1)
        .await
        .unwrap();
    assert!(!session_ssl(&plain).await.0);
}

#[tokio::test]
async fn verify_full_checks_the_servers_certificate_and_host_name() {
    let pg = Pg::new().await;
    let root = file("ca.pem");
    let store = PostgresStore::connect(
        &pg_url(
            &pg,
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={root}"),
        ),
        1,
    )
    .await
    .unwrap();
    assert!(session_ssl(&store).await.0);

    // The certificate names `localhost`, not the address.
    let error = PostgresStore::connect(
        &pg_url(
            &pg,
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={root}"),
        ),
        1,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::PostgresTls { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("does not name the host 127.0.0.1") && message.contains("verify-ca"),
        "{message}"
    );
    // verify-ca checks the signer only, so the address is fine there.
    PostgresStore::connect(
        &pg_url(
            &pg,
            "127.0.0.1",
            &format!("sslmode=verify-ca&sslrootcert={root}"),
        ),
        1,
    )
    .await
    .unwrap();

    // A CA that did not sign it, and the system's roots alone (the test CA is in none).
    for query in [
        format!("sslmode=verify-full&sslrootcert={}", file("other-ca.pem")),
        "sslmode=verify-full".to_owned(),
    ] {
        let error = PostgresStore::connect(&pg_url(&pg, "localhost", &query), 1)
            .await
            .unwrap_err();
        assert!(
            matches!(error, ConnectError::PostgresTls { .. }),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .contains("not signed by a CA this client trusts")
                && error.to_string().contains("sslrootcert="),
            "{error}"
        );
    }
}

#[tokio::test]
async fn a_client_certificate_is_presented_and_seen_by_the_server() {
    let pg = Pg::new().await;
    let query = format!(
        "sslmode=require&sslcert={}&sslkey={}",
        file("client.pem"),
        file("client.key")
    );
    let store = PostgresStore::connect(&pg_url(&pg, "127.0.0.1", &query), 1)
        .await
        .unwrap();
    let (ssl, _, client) = session_ssl(&store).await;
    assert!(ssl);
    assert_eq!(client.as_deref(), Some("/CN=sagabox-client"));
}

#[tokio::test]
async fn bad_postgres_tls_input_is_refused_with_what_to_fix() {
    let pg = Pg::new().await;
    let error = PostgresStore::connect(&pg_url(&pg, "127.0.0.1", "sslmode=verify-fool"), 1)
        .await
        .unwrap_err();
    assert!(
        matches!(error, ConnectError::InvalidUrl { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("verify-full"), "{error}");

    let missing = tls_dir().join("no-such-ca.pem");
    let error = PostgresStore::connect(
        &pg_url(
            &pg,
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", missing.display()),
        ),
        1,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::Tls(TlsError::Unreadable { .. })),
        "{error:?}"
    );
    assert!(error.to_string().contains("no-such-ca.pem"), "{error}");

    let not_pem = std::env::temp_dir().join(format!("not-pem-{}.pem", uuid::Uuid::new_v4()));
    std::fs::write(&not_pem, "hello\n").unwrap();
    let error = PostgresStore::connect(
        &pg_url(
            &pg,
            "localhost",
            &format!("sslmode=verify-full&sslrootcert={}", not_pem.display()),
        ),
        1,
    )
    .await
    .unwrap_err();
    std::fs::remove_file(&not_pem).ok();
    assert!(
        matches!(error, ConnectError::Tls(TlsError::NotPem { .. })),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("PostgreSQL at localhost:5432"),
        "{error}"
    );

    let error = PostgresStore::connect(
        &pg_url(
            &pg,
            "127.0.0.1",
            &format!("sslmode=require&sslcert={}", file("client.pem")),
        ),
        1,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::Tls(TlsError::HalfIdentity { .. })),
        "{error:?}"
    );
    assert!(error.to_string().contains("sslkey"), "{error}");
}

/// A server that answers PostgreSQL's TLS request with "no" (`N`), as one with
/// `ssl = off` does; with `sslmode=require` that is refused at once, naming the cause.
#[tokio::test]
async fn a_plain_text_postgres_where_tls_is_required_is_refused() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).await.unwrap();
        // SSLRequest: length 8, code 80877103.
        assert_eq!(request, [0, 0, 0, 8, 4, 210, 22, 47]);
        socket.write_all(b"N").await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=require");
    let error = tokio::time::timeout(Duration::from_secs(10), PostgresStore::connect(&url, 1))
        .await
        .expect("an answer, not a hang")
        .unwrap_err();
    assert!(
        matches!(error, ConnectError::PostgresTls { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("does not accept TLS"), "{error}");
    server.abort();
}

/// A consumer's handler that writes one `effects` row per message through the guard
/// and counts every delivery it settles in `deliveries`.
fn applying(
    guard: InboxGuard<PostgresStore>,
    consumer_type: ConsumerType,
    deliveries: Arc<AtomicU32>,
) -> impl Fn(Envelope) -> std::pin::Pin<Box<dyn Future<Output = Disposition> + Send>>
+ Send
+ Sync
+ 'static {
    move |envelope: Envelope| {
        let (guard, consumer_type, deliveries) = (
            guard.clone(),
            consumer_type.clone(),
            Arc::clone(&deliveries),
        );
        Box::pin(async move {
            guard
                .process(&consumer_type, &envelope, async |conn, envelope| {
                    sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                        .bind(envelope.id.as_str())
                        .execute(&mut *conn)
                        .await?;
                    Ok::<_, sqlx::Error>(json!({}))
                })
                .await
                .unwrap();
            deliveries.fetch_add(1, SeqCst);
            Disposition::Done { reply: None }
        })
    }
}

// RabbitMQ

/// The AMQPS URL of the test broker with `query` (TLS files) added.
fn amqps_url(port: u16, query: &str) -> String {
    format!("amqps://guest:guest@localhost:{port}/%2f?{query}")
}

#[tokio::test]
async fn an_amqps_consumer_is_tls_on_the_brokers_side_and_reads_retention_over_https() {
    let pg = Pg::new().await;
    let rabbit = Rabbit::new(&["payment"]).await;
    let mut config = rabbit.config.clone();
    config.url = amqps_url(
        5671,
        &format!(
            "cacertfile={}&certfile={}&keyfile={}",
            file("ca.pem"),
            file("client.pem"),
            file("client.key")
        ),
    );
    config.validate().unwrap();
    assert_eq!(config.management_base(), "https://localhost:15671");
    pg.exec("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .await;
    let guard = InboxGuard::new(pg.store(2).await, InboxConfig::default()).unwrap();
    let consumer_type = ConsumerType::new("payment").unwrap();
    let options = sagabox::amqp::ConsumerOptions::new(consumer_type.clone(), ["charge"]);
    let applied = Arc::new(AtomicU32::new(0));
    // Starting checks the queue's retention through the management API, here over HTTPS.
    let consumer = sagabox::amqp::Consumer::spawn(
        config.clone(),
        options,
        applying(guard, consumer_type, Arc::clone(&applied)),
    )
    .await
    .unwrap();
    let id = MessageId::new_v7();
    for _ in 0..2 {
        let (body, properties) =
            sagabox::amqp::codec::encode(&Envelope::new(id.clone(), "charge", json!({})).unwrap());
        rabbit
            .publish_raw(&rabbit.queue("payment"), &body, properties)
            .await;
    }
    common::wait_for("two deliveries", async || applied.load(SeqCst) == 2).await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);

    let ours = broker_connections(&format!("\"{}/", config.queue_prefix));
    assert!(!ours.is_empty(), "the consumer's connection is not listed");
    for (ssl, subject) in &ours {
        assert_eq!(ssl, "true", "{ours:?}");
        assert!(subject.contains("CN=sagabox-client"), "{ours:?}");
    }
    consumer.stop().await;
}

#[tokio::test]
async fn bad_amqps_input_is_refused_with_what_to_fix_and_never_hangs() {
    let rabbit = Rabbit::new(&[]).await;
    let connect = async |url: String| {
        let mut config = rabbit.config.clone();
        config.url = url;
        config.validate()?;
        let connected = tokio::time::timeout(
            Duration::from_secs(15),
            Sender::connect(&config.into(), "tls-test"),
        )
        .await
        .expect("an answer, not a hang");
        match connected {
            Ok(sender) => {
                sender.close().await;
                Ok(())
            }
            Err(TransportError::Amqp(error)) => Err(error),
            Err(other) => panic!("not a RabbitMQ error: {other}"),
        }
    };
    let error = connect(amqps_url(
        5671,
        &format!("cacertfile={}", file("other-ca.pem")),
    ))
    .await
    .unwrap_err();
    assert!(matches!(error, AmqpError::TlsHandshake { .. }), "{error:?}");
    assert!(
        error.to_string().contains("cacertfile=/path/ca.pem"),
        "{error}"
    );
    // The system's roots alone do not know the test CA.
    let error = connect(amqps_url(5671, "")).await.unwrap_err();
    assert!(matches!(error, AmqpError::TlsHandshake { .. }), "{error:?}");
    // TLS to the plain-text port.
    let error = connect(amqps_url(5672, &format!("cacertfile={}", file("ca.pem"))))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            AmqpError::TlsHandshake { .. } | AmqpError::Connect { .. }
        ),
        "{error:?}"
    );
    // TLS files on a plain URL, a missing file, half a client identity.
    let error = connect(format!(
        "amqp://guest:guest@localhost:5672/%2f?cacertfile={}",
        file("ca.pem")
    ))
    .await
    .unwrap_err();
    assert!(error.to_string().contains("use amqps://"), "{error}");
    let error = connect(amqps_url(5671, "cacertfile=/nonexistent/ca.pem"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, AmqpError::Tls(TlsError::Unreadable { .. })),
        "{error:?}"
    );
    assert!(error.to_string().contains("/nonexistent/ca.pem"), "{error}");
    let error = connect(amqps_url(5671, &format!("certfile={}", file("client.pem"))))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("keyfile"), "{error}");
    // The good one, to show the failures above were the inputs.
    connect(amqps_url(5671, &format!("cacertfile={}", file("ca.pem"))))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_management_api_over_https_refuses_a_certificate_it_cannot_trust() {
    let rabbit = Rabbit::new(&["refund"]).await;
    rabbit.declare("refund").await;
    let mut config: AmqpConfig = rabbit.config.clone();
    config.url = amqps_url(5671, &format!("cacertfile={}", file("ca.pem")));
    let measured = sagabox::amqp::measure_retention(&config, &rabbit.queue("refund"))
        .await
        .unwrap();
    assert!(measured.measured);
    config.url = amqps_url(5671, &format!("cacertfile={}", file("other-ca.pem")));
    let error = sagabox::amqp::measure_retention(&config, &rabbit.queue("refund"))
        .await
        .unwrap_err();
    assert!(matches!(error, AmqpError::Management { .. }), "{error:?}");
    assert!(
        error.to_string().contains("over HTTPS") && error.to_string().contains("cacertfile"),
        "{error}"
    );
}

// NATS

#[tokio::test]
async fn a_nats_consumer_over_tls_is_tls_on_the_servers_side() {
    let server = jetstream::OwnServer::start_tls(&file("server.pem"), &file("server.key")).await;
    let url = format!(
        "tls://localhost:{}?cacertfile={}",
        server.port,
        file("ca.pem")
    );
    let pg = Pg::new().await;
    pg.exec("CREATE TABLE effects (message_id TEXT NOT NULL)")
        .await;
    let guard = InboxGuard::new(pg.store(2).await, InboxConfig::default()).unwrap();
    let prefix = format!("tls{}", uuid::Uuid::new_v4().simple());
    let config = NatsConfig::new(url).with_prefix(prefix.clone());
    config.validate().unwrap();
    let consumer_type = ConsumerType::new("payment").unwrap();
    let options = sagabox::nats::ConsumerOptions::new(consumer_type.clone(), ["charge"]);
    let subject = config.subject(&consumer_type);
    let applied = Arc::new(AtomicU32::new(0));
    let consumer = sagabox::nats::Consumer::spawn(
        config.clone(),
        options,
        applying(guard, consumer_type, Arc::clone(&applied)),
    )
    .await
    .unwrap();
    // A plain client, trusting the test CA, as a producer outside sagabox connects.
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(file("ca.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let client = async_nats::ConnectOptions::new()
        .name(format!("{prefix}/tls-test-publisher"))
        .tls_client_config(tls)
        .require_tls(true)
        .connect(format!("tls://localhost:{}", server.port))
        .await
        .unwrap();
    let context = async_nats::jetstream::new(client);
    let envelope = Envelope::new(MessageId::new_v7(), "charge", json!({})).unwrap();
    for _ in 0..2 {
        // The id in sagabox's own header, not in Nats-Msg-Id, so the server's duplicate
        // window lets both copies in and the inbox is what absorbs the second.
        let (body, _) = sagabox::nats::codec::encode(&envelope);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            sagabox::nats::codec::MESSAGE_ID_HEADER,
            envelope.id.as_str(),
        );
        context
            .publish_with_headers(subject.clone(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    common::wait_for("two deliveries", async || applied.load(SeqCst) == 2).await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);

    let ours = nats_connections(server.monitor_port, &prefix).await;
    assert!(ours.len() >= 2, "{ours:?}");
    for (name, tls) in &ours {
        assert!(
            tls.as_deref().is_some_and(|v| v.starts_with("1.")),
            "{name}: {tls:?}"
        );
    }
    consumer.stop().await;
}

#[tokio::test]
async fn nats_refuses_a_wrong_ca_and_an_expired_certificate_with_what_to_fix() {
    let server = jetstream::OwnServer::start_tls(&file("server.pem"), &file("server.key")).await;
    let connect = async |url: String| {
        let config = NatsConfig::new(url);
        config.validate()?;
        let connected = tokio::time::timeout(
            Duration::from_secs(20),
            Sender::connect(&config.into(), "tls-test"),
        )
        .await
        .expect("an answer, not a hang");
        match connected {
            Ok(sender) => {
                sender.close().await;
                Ok(())
            }
            Err(TransportError::Nats(error)) => Err(error),
            Err(other) => panic!("not a NATS error: {other}"),
        }
    };
    let error: NatsError = connect(format!(
        "tls://localhost:{}?cacertfile={}",
        server.port,
        file("other-ca.pem")
    ))
    .await
    .unwrap_err();
    assert!(matches!(error, NatsError::TlsHandshake { .. }), "{error:?}");
    assert!(error.to_string().contains("cacertfile="), "{error}");
    let error = connect("tls://localhost:1?cacertfile=/nonexistent/ca.pem".to_owned())
        .await
        .unwrap_err();
    assert!(
        matches!(error, NatsError::Tls(TlsError::Unreadable { .. })),
        "{error:?}"
    );

    let expired = jetstream::OwnServer::start_tls(&file("expired.pem"), &file("expired.key")).await;
    let error = connect(format!(
        "tls://localhost:{}?cacertfile={}",
        expired.port,
        file("ca.pem")
    ))
    .await
    .unwrap_err();
    assert!(matches!(error, NatsError::TlsHandshake { .. }), "{error:?}");
    assert!(error.to_string().contains("expired"), "{error}");
}
