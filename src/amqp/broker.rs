//! Connecting, declaring the queues, and publishing with confirms.

use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lapin::{Confirmation, PublisherConfirm};

use super::codec;
use super::config::{AmqpConfig, AmqpError, QueueType};
use crate::envelope::{ConsumerType, Envelope};
use crate::logging::redact;
use crate::tls::TlsFiles;

/// Where the next connection starts in a cluster's URL list: one node further along for
/// each connection the process opens.
static NEXT_NODE: AtomicUsize = AtomicUsize::new(0);

/// Opens a connection to the broker in `config`, named `<prefix>/<role>` in the broker's
/// connection list (`rabbitmqctl list_connections user_provided_name`). For a cluster's
/// URL list, the nodes are tried in turn from the one after the last connection's start,
/// until one accepts ([`AmqpError::NoNodeAnswered`] when none does).
pub(crate) async fn connect(config: &AmqpConfig, role: &str) -> Result<Connection, AmqpError> {
    let nodes = config.nodes();
    if let [node] = nodes.as_slice() {
        return connect_node(node, role).await;
    }
    let start = NEXT_NODE.fetch_add(1, Ordering::Relaxed);
    let mut last = None;
    for turn in 0..nodes.len() {
        let node = &nodes[(start + turn) % nodes.len()];
        match connect_node(node, role).await {
            Ok(connection) => return Ok(connection),
            Err(error) => {
                tracing::warn!(node = %node.server(), %error, "trying the next RabbitMQ node");
                last = Some(error);
            }
        }
    }
    Err(AmqpError::NoNodeAnswered {
        nodes: nodes.len(),
        last: Box::new(last.unwrap_or_else(|| AmqpError::Config("no node in the URL list".into()))),
    })
}

/// [`connect`] to one node.
async fn connect_node(config: &AmqpConfig, role: &str) -> Result<Connection, AmqpError> {
    let properties = ConnectionProperties::default()
        .with_connection_name(format!("{}/{role}", config.queue_prefix).into());
    let tls = config.load_tls()?;
    let tls = OwnedTLSConfig {
        identity: tls.identity.map(|identity| OwnedIdentity::PKCS8 {
            pem: identity.cert_pem,
            key: identity.key_pem,
        }),
        cert_chain: tls.ca_pem,
    };
    let (url, _) = TlsFiles::split_url(&config.url);
    let runtime = lapin::runtime::default_runtime().map_err(|error| {
        AmqpError::Config(format!("cannot start lapin's runtime on tokio: {error}"))
    })?;
    let opening = async {
        probe(config).await?;
        Connection::connect_with_config(&url, properties, tls, runtime)
            .await
            .map_err(|source| connect_error(config, source))
    };
    tokio::time::timeout(CONNECT_TIMEOUT, opening)
        .await
        .unwrap_or_else(|_| {
            Err(AmqpError::ConnectTimeout {
                url: redact(&config.url),
                after: CONNECT_TIMEOUT,
            })
        })
}

/// lapin's error of opening a connection: a TLS failure on an `amqps://` URL said as one,
/// with what to change.
fn connect_error(config: &AmqpConfig, source: lapin::Error) -> AmqpError {
    if config.is_tls() {
        let host = config
            .url
            .parse::<lapin::uri::AMQPUri>()
            .map(|uri| uri.authority.host)
            .unwrap_or_default();
        let reason = crate::tls::handshake_advice(&source.to_string(), &host, "cacertfile", None);
        if let Some(reason) = reason {
            return AmqpError::TlsHandshake {
                url: redact(&config.url),
                reason,
            };
        }
    }
    AmqpError::Connect {
        url: redact(&config.url),
        source,
    }
}

/// How long opening a connection (the TCP probe, then lapin's TCP connection and the AMQP
/// handshake) may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens and drops a TCP connection to the broker's host and port, so a broker that is
/// down is reported at once as refused. lapin's own connect can miss a refusal that comes
/// before it has queued the protocol header (its I/O thread reports the error to nobody)
/// and then waits for a handshake that never comes, until [`CONNECT_TIMEOUT`]. A URL
/// that does not parse is left to lapin, which names what is wrong with it.
async fn probe(config: &AmqpConfig) -> Result<(), AmqpError> {
    let Ok(uri) = config.url.parse::<lapin::uri::AMQPUri>() else {
        return Ok(());
    };
    tokio::net::TcpStream::connect((uri.authority.host.as_str(), uri.authority.port))
        .await
        .map(drop)
        .map_err(|source| AmqpError::Unreachable {
            url: redact(&config.url),
            source,
        })
}

/// Declares `consumer_type`'s queue and its dead-letter queue, both durable, on
/// channels of their own over `connection`. The main queue dead-letters into the dead
/// queue, so a message rejected without requeue by any client, one past its
/// `x-message-ttl`, or (quorum) one past its delivery limit lands there too.
///
/// The main queue is a [`QueueType`] queue with `x-message-ttl` set to
/// [`AmqpConfig::message_ttl`]; a quorum queue also gets `x-delivery-limit` (a message
/// is delivered at most [`AmqpConfig::max_redeliveries`] times) and at-least-once
/// dead-lettering, so a letter the broker moves is not dropped on the way. The dead queue
/// has no TTL: a dead letter waits for an operator (`sagabox dlq`) however long that
/// takes. Beside a quorum queue it is a quorum queue too, replicated like it, so that
/// losing one node of a cluster neither loses dead letters nor stops the consumers (a
/// classic queue whose node is down cannot even be declared). A classic dead queue that
/// exists (declared by an older sagabox) is kept as it is, letters and all.
///
/// A queue that exists with other arguments is [`AmqpError::QueueMismatch`], with the fix.
pub(crate) async fn declare(
    connection: &Connection,
    config: &AmqpConfig,
    consumer_type: &ConsumerType,
) -> Result<String, AmqpError> {
    let queue = config.queue(consumer_type);
    let dead = config.dead_queue(consumer_type);
    declare_dead(connection, config, &dead).await?;
    let channel = declaring_channel(connection).await?;
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            queue_arguments(config, &dead),
        )
        .await
        .map_err(|source| match precondition_failed(&source) {
            Some(detail) => AmqpError::QueueMismatch {
                queue: queue.clone(),
                queue_type: config.queue_type,
                ttl: match config.message_ttl {
                    Some(ttl) => format!("x-message-ttl {} ms", ttl.as_millis()),
                    None => "no x-message-ttl".to_owned(),
                },
                detail,
            },
            None => AmqpError::Broker {
                operation: "declare the queue",
                source,
            },
        })?;
    close(channel).await;
    Ok(queue)
}

/// Declares the dead-letter queue `dead`: a quorum queue beside a quorum queue, unless
/// a classic one exists already; a classic queue beside a classic one.
async fn declare_dead(
    connection: &Connection,
    config: &AmqpConfig,
    dead: &str,
) -> Result<(), AmqpError> {
    let failed = AmqpError::broker("declare the dead-letter queue");
    if config.queue_type == QueueType::Quorum {
        let channel = declaring_channel(connection).await?;
        match channel
            .queue_declare(
                dead.into(),
                QueueDeclareOptions::durable(),
                dead_queue_arguments(config),
            )
            .await
        {
            Ok(_) => {
                close(channel).await;
                return Ok(());
            }
            // A classic dead queue, declared by an older sagabox: kept (the refusal
            // closed the channel, so it is declared again on a new one).
            Err(error) if precondition_failed(&error).is_some() => {}
            Err(error) => return Err(failed(error)),
        }
    }
    let channel = declaring_channel(connection).await?;
    channel
        .queue_declare(
            dead.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(failed)?;
    close(channel).await;
    Ok(())
}

/// Deletes `queue` with whatever it holds, on a channel of its own (a refusal closes its
/// channel); a queue that does not exist is no error (RabbitMQ answers its delete).
pub(crate) async fn delete_queue(connection: &Connection, queue: &str) -> Result<(), AmqpError> {
    let channel = declaring_channel(connection).await?;
    channel
        .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
        .await
        .map_err(AmqpError::broker("delete the queue"))?;
    close(channel).await;
    Ok(())
}

/// A channel for declaring queues: a declare the broker refuses closes its channel, so
/// declares do not share one with a consumer or a publisher.
async fn declaring_channel(connection: &Connection) -> Result<Channel, AmqpError> {
    connection
        .create_channel()
        .await
        .map_err(AmqpError::broker("open a channel to declare queues"))
}

/// Closes a declaring channel; a failure leaves it to the connection's end.
async fn close(channel: Channel) {
    let _ = channel.close(200, "declared".into()).await;
}

/// The arguments of a quorum dead-letter queue: replicated like its main queue, and
/// with a delivery limit no operator reaches, since `sagabox dlq` gives back (nacks with
/// requeue) the letters it shows, and a quorum queue counts those returns (RabbitMQ 4
/// drops a letter past a default limit of 20).
fn dead_queue_arguments(config: &AmqpConfig) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    arguments.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::from(i32::MAX)),
    );
    if let Some(replicas) = config.replicas {
        arguments.insert(
            "x-quorum-initial-group-size".into(),
            AMQPValue::LongLongInt(i64::from(replicas)),
        );
    }
    arguments
}

/// The arguments of a consumer type's main queue, dead-lettering into `dead`.
pub(crate) fn queue_arguments(config: &AmqpConfig, dead: &str) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    arguments.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead.into()),
    );
    if let Some(ttl) = config.message_ttl {
        // validate() keeps it within RabbitMQ's range; saturate rather than wrap anyway.
        let millis = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        arguments.insert("x-message-ttl".into(), AMQPValue::LongLongInt(millis));
    }
    if config.queue_type == QueueType::Quorum {
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        arguments.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(delivery_limit(config))),
        );
        // At-least-once dead-lettering keeps a letter in the queue until the dead queue
        // confirmed it; RabbitMQ requires reject-publish overflow with it (no length
        // limit is set, so nothing is ever rejected for it).
        arguments.insert(
            "x-dead-letter-strategy".into(),
            AMQPValue::LongString("at-least-once".into()),
        );
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        if let Some(replicas) = config.replicas {
            arguments.insert(
                "x-quorum-initial-group-size".into(),
                AMQPValue::LongLongInt(i64::from(replicas)),
            );
        }
    }
    arguments
}

/// The `x-delivery-limit` of a quorum queue: RabbitMQ dead-letters a message returned
/// when it has been delivered more than the limit, so a message is delivered at most
/// `limit + 1` times, the `max_redeliveries` attempts of the classic path.
pub(crate) fn delivery_limit(config: &AmqpConfig) -> u32 {
    config.max_redeliveries.saturating_sub(1)
}

/// The broker's explanation when it refused a declare as `PRECONDITION_FAILED` (the
/// queue exists with other arguments).
fn precondition_failed(error: &lapin::Error) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(
                amqp.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
            ) =>
        {
            Some(amqp.get_message().to_string())
        }
        _ => None,
    }
}

/// Whether a publish must reach a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routing {
    /// The queue must exist: an unroutable message is returned and reported as
    /// [`AmqpError::NotConfirmed`] (commands, outbox rows, dead letters).
    Required,
    /// Dropped by the broker when no queue takes it, and not written to disk (replies:
    /// an orchestrator that is gone, or restarted with the broker, asks again with the
    /// same command id and the step's inbox answers with the first result).
    BestEffort,
}

/// A channel in confirm mode: [`Publisher::publish`] returns once the broker has taken
/// the message (persisted, for a durable queue).
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    channel: Channel,
}

impl Publisher {
    /// A new confirm-mode channel on `connection`.
    pub(crate) async fn open(connection: &Connection) -> Result<Self, AmqpError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("open a channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::broker("enable publisher confirms"))?;
        Ok(Self { channel })
    }

    /// The channel, for declaring queues.
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publishes `envelope` to `queue` (through the default exchange) and waits for the
    /// broker's confirm. `reply_to` and `correlation_id` are set when given. With
    /// `Routing::Required` a message no queue takes is an error
    /// ([`AmqpError::NotConfirmed`]), not a silent drop.
    pub(crate) async fn publish(
        &self,
        queue: &str,
        envelope: &Envelope,
        reply_to: Option<&str>,
        correlation_id: Option<&str>,
        routing: Routing,
    ) -> Result<(), AmqpError> {
        let (body, mut properties) = codec::encode(envelope);
        if let Some(reply_to) = reply_to {
            properties = properties.with_reply_to(reply_to.into());
        }
        if let Some(correlation_id) = correlation_id {
            properties = properties.with_correlation_id(correlation_id.into());
        }
        if routing == Routing::BestEffort {
            properties = properties.with_delivery_mode(1);
        }
        self.publish_raw(queue, &body, properties, routing).await
    }

    /// Publishes `body` with `properties` to `queue` and waits for the confirm.
    pub(crate) async fn publish_raw(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
        routing: Routing,
    ) -> Result<(), AmqpError> {
        let confirm = self.start_publish(queue, body, properties, routing).await?;
        Self::confirmed(queue, confirm).await
    }

    /// Sends without waiting for the confirm: for publishing a batch in order and then
    /// awaiting every confirm with [`Publisher::confirmed`].
    pub(crate) async fn start_publish(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
        routing: Routing,
    ) -> Result<PublisherConfirm, AmqpError> {
        let options = BasicPublishOptions {
            mandatory: routing == Routing::Required,
            ..BasicPublishOptions::default()
        };
        self.channel
            .basic_publish("".into(), queue.into(), options, body, properties)
            .await
            .map_err(AmqpError::broker("publish"))
    }

    /// Waits for the broker's answer to one publish.
    pub(crate) async fn confirmed(queue: &str, confirm: PublisherConfirm) -> Result<(), AmqpError> {
        match confirm
            .await
            .map_err(AmqpError::broker("wait for the confirm"))?
        {
            Confirmation::Ack(None) => Ok(()),
            // Ack(Some(_)) is a mandatory message returned as unroutable.
            Confirmation::Ack(Some(_)) | Confirmation::Nack(_) | Confirmation::NotRequested => {
                Err(AmqpError::NotConfirmed {
                    queue: queue.to_owned(),
                })
            }
        }
    }
}
