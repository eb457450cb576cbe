//! Connecting to NATS, creating a consumer type's streams and durable consumer, reading
//! a stream's real retention, and publishing with JetStream's acknowledgement.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType, Stream};
use async_nats::jetstream::{self as js, Context};
use async_nats::{Client, ConnectOptions, HeaderMap};

use super::config::{NatsConfig, NatsError};
use crate::envelope::ConsumerType;
use crate::logging::redact;
use crate::retention::Retention;

/// How long connecting (TCP and the NATS handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a JetStream stream's retention is called, for errors that say what to change.
pub const RETENTION_SETTING: &str = "the stream's max_age";

/// Opens a client to the server in `config`, named `<prefix>/<role>` in the server's
/// connection list (`nats server report connections`). It reconnects by itself after a
/// lost connection, without limit.
pub(crate) async fn connect(config: &NatsConfig, role: &str) -> Result<Client, NatsError> {
    let server = config.server();
    let tls = config.load_tls()?.client_config(&server)?;
    let url = config.client_url();
    // Our own configuration even for a `nats://` URL: a server that requires TLS turns
    // the connection to TLS, and then it trusts what the URL says to trust.
    let options = ConnectOptions::new()
        .name(format!("{}/{role}", config.prefix))
        .connection_timeout(CONNECT_TIMEOUT)
        .max_reconnects(None)
        .tls_client_config(tls)
        .require_tls(url.starts_with("tls://"));
    options.connect(config.servers()).await.map_err(|error| {
        let words = crate::tls::error_chain(&error);
        // The advice names one host; of a cluster's list, the first.
        let hosts = config.host_port();
        let first = hosts.split(',').next().unwrap_or(&hosts);
        let host = first.rsplit_once(':').map_or(first, |(host, _)| host);
        match crate::tls::handshake_advice(&words, host, "cacertfile", None) {
            Some(reason) => NatsError::TlsHandshake {
                url: redact(&config.url),
                reason,
            },
            None => NatsError::Connect {
                url: redact(&config.url),
                reason: words,
            },
        }
    })
}

/// Whether `name` cannot be a NATS subject whose dots, made underscores, name a stream:
/// a wildcard, a slash or white space, or an empty token.
pub(crate) fn unfit_for_subject(name: &str) -> bool {
    let bad = |c: char| matches!(c, '*' | '>' | '/' | '\\') || c.is_whitespace();
    name.chars().any(bad) || name.starts_with('.') || name.ends_with('.') || name.contains("..")
}

/// Checks that `consumer_type` can be a subject token and a stream name.
pub(crate) fn check_consumer_type(consumer_type: &ConsumerType) -> Result<(), NatsError> {
    let name = consumer_type.as_str();
    if unfit_for_subject(name) {
        return Err(NatsError::Config(format!(
            "the consumer type {name:?} cannot name a NATS subject: use letters, digits, '-', \
             '_' and single dots"
        )));
    }
    Ok(())
}

/// Creates `consumer_type`'s work stream (work queue, `max_age` = the configured
/// retention) and dead-letter stream (kept until taken), unless they exist; returns the
/// work stream. An existing stream keeps its settings.
pub(crate) async fn declare(
    jetstream: &Context,
    config: &NatsConfig,
    consumer_type: &ConsumerType,
) -> Result<Stream, NatsError> {
    check_consumer_type(consumer_type)?;
    jetstream
        .get_or_create_stream(stream::Config {
            name: config.dead_stream(consumer_type),
            subjects: vec![config.dead_subject(consumer_type)],
            retention: RetentionPolicy::Limits,
            storage: StorageType::File,
            duplicate_window: config.duplicate_window,
            num_replicas: config.replicas,
            ..Default::default()
        })
        .await
        .map_err(NatsError::broker("create the dead-letter stream"))?;
    jetstream
        .get_or_create_stream(stream::Config {
            name: config.stream(consumer_type),
            subjects: vec![config.subject(consumer_type)],
            retention: RetentionPolicy::WorkQueue,
            storage: StorageType::File,
            max_age: config.retention,
            duplicate_window: config.duplicate_window,
            num_replicas: config.replicas,
            ..Default::default()
        })
        .await
        .map_err(NatsError::broker("create the stream"))
}

/// Deletes stream `name` with whatever it holds; a stream that does not exist is no
/// error.
pub(crate) async fn delete_stream(jetstream: &Context, name: &str) -> Result<(), NatsError> {
    match jetstream.delete_stream(name).await {
        Ok(_) => Ok(()),
        Err(error)
            if matches!(error.kind(), js::context::DeleteStreamErrorKind::JetStream(ref failure)
                if failure.error_code() == js::ErrorCode::STREAM_NOT_FOUND) =>
        {
            Ok(())
        }
        Err(error) => Err(NatsError::broker("delete the stream")(error)),
    }
}

/// The durable pull consumer every process serving `consumer_type` shares: explicit
/// acks, `ack_wait` and `max_ack_pending` from `config`. Redeliveries are not limited
/// by the server: the consumer dead-letters a message past `max_deliver` itself, so
/// none is left stranded in the stream.
pub(super) async fn durable_consumer(
    stream: &Stream,
    config: &NatsConfig,
    consumer_type: &ConsumerType,
) -> Result<PullConsumer, NatsError> {
    let name = config.stream(consumer_type);
    stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                max_deliver: -1,
                max_ack_pending: i64::from(config.prefetch),
                ..Default::default()
            },
        )
        .await
        .map_err(NatsError::broker("create the durable consumer"))
}

/// What `stream` really keeps a message for: its `max_age`, unbounded when zero.
pub async fn measured_retention(stream: &mut Stream) -> Result<Retention, NatsError> {
    let info = stream
        .info()
        .await
        .map_err(NatsError::broker("read the stream's settings"))?;
    Ok(match info.config.max_age {
        age if age.is_zero() => Retention::Unbounded,
        age => Retention::Bounded(age),
    })
}

/// Publishes `body` with `headers` to `subject` and waits for JetStream to store it.
/// `true` when the server dropped it as a duplicate of a message published with the same
/// `Nats-Msg-Id` within the duplicate window.
pub(crate) async fn publish(
    jetstream: &Context,
    subject: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<bool, NatsError> {
    let not_acknowledged = |error: &dyn std::fmt::Display| NatsError::NotAcknowledged {
        subject: subject.to_owned(),
        reason: error.to_string(),
    };
    let ack = jetstream
        .publish_with_headers(subject.to_owned(), headers, body.into())
        .await
        .map_err(|error| not_acknowledged(&error))?
        .await
        .map_err(|error| not_acknowledged(&error))?;
    Ok(ack.duplicate)
}

/// A JetStream context on `client`.
pub(crate) fn context(client: &Client) -> Context {
    js::new(client.clone())
}

/// The work streams of `config`'s prefix (`<prefix>_…`, dead-letter streams left out),
/// each with its measured retention, by name.
pub async fn prefixed_streams(config: &NatsConfig) -> Result<Vec<(String, Retention)>, NatsError> {
    use futures_util::StreamExt;
    config.validate()?;
    let client = connect(config, "inspect").await?;
    let jetstream = context(&client);
    let start = format!("{}_", config.prefix);
    let mut names = Vec::new();
    let mut listed = jetstream.stream_names();
    while let Some(name) = listed.next().await {
        let name = name.map_err(NatsError::broker("list the streams"))?;
        if name.starts_with(&start) && !name.ends_with("_dead") {
            names.push(name);
        }
    }
    names.sort();
    let mut streams = Vec::with_capacity(names.len());
    for name in names {
        let mut stream = jetstream
            .get_stream(&name)
            .await
            .map_err(NatsError::broker("read a stream"))?;
        let retention = measured_retention(&mut stream).await?;
        streams.push((name, retention));
    }
    let _ = client.drain().await;
    Ok(streams)
}
