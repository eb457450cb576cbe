//! The transport boundary: [`Transport`] names a broker (RabbitMQ or NATS JetStream) and
//! its settings, chosen by the URL's scheme ([`Transport::from_url`]); what the runtime
//! does with a broker — serve a step ([`serve_step`]), consume a consumer type
//! ([`consume`]), dispatch an orchestrator's commands ([`Dispatcher`]), send a command or
//! a start message with the broker's confirm ([`Sender`]) — goes through here, so the [`Participant`](crate::Participant) runtime, the outbox
//! [`Relay`](crate::relay::Relay) and [`orchestrate`](crate::orchestrate::orchestrate)
//! run on either broker with the same guarantees.

mod sender;
mod settings;

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "rabbitmq")]
use crate::amqp::{self, AmqpConfig, AmqpDispatch, AmqpError};
use crate::delivery::DeliveryHandler;
use crate::envelope::{ConsumerType, KeyError};
use crate::inbox::InboxConfig;
#[cfg(feature = "nats")]
use crate::nats::{self, NatsConfig, NatsDispatch, NatsError};
use crate::orchestrator::Dispatch;
use crate::step::{StepFailure, StepPool, StepReply};

use crate::consumer::ConsumerHandle;
pub use sender::{Sender, Sent};
pub(crate) use settings::BrokerSettings;

/// A broker and how to use it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Transport {
    /// RabbitMQ (feature `rabbitmq`).
    #[cfg(feature = "rabbitmq")]
    Amqp(AmqpConfig),
    /// NATS JetStream (feature `nats`).
    #[cfg(feature = "nats")]
    Nats(NatsConfig),
}

#[cfg(feature = "rabbitmq")]
impl From<AmqpConfig> for Transport {
    fn from(config: AmqpConfig) -> Self {
        Transport::Amqp(config)
    }
}

#[cfg(feature = "nats")]
impl From<NatsConfig> for Transport {
    fn from(config: NatsConfig) -> Self {
        Transport::Nats(config)
    }
}

/// What went wrong on the transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A URL whose scheme names no transport this build has.
    #[error(
        "{url} is not a broker URL this build speaks: use amqp://user:password@host:port/vhost \
         (RabbitMQ) or nats://host:port (NATS JetStream)"
    )]
    UnknownScheme {
        /// The URL, password redacted.
        url: String,
    },
    /// A destination that cannot name a queue or stream (a start message whose kind,
    /// the saga's name, is not a valid consumer type).
    #[error("cannot send there: {0}")]
    Destination(#[from] KeyError),
    /// RabbitMQ failed or was refused.
    #[cfg(feature = "rabbitmq")]
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    /// NATS failed or was refused.
    #[cfg(feature = "nats")]
    #[error(transparent)]
    Nats(#[from] NatsError),
}

impl Transport {
    /// The transport `url` names (`amqp://`, `amqps://`: RabbitMQ; `nats://`, `tls://`:
    /// NATS), its queues or subjects under `prefix`, with each transport's defaults.
    pub fn from_url(url: &str, prefix: &str) -> Result<Self, TransportError> {
        #[cfg(feature = "rabbitmq")]
        if url.starts_with("amqp://") || url.starts_with("amqps://") {
            return Ok(Transport::Amqp(
                AmqpConfig::new(url).with_queue_prefix(prefix),
            ));
        }
        #[cfg(feature = "nats")]
        if url.starts_with("nats://") || url.starts_with("tls://") {
            return Ok(Transport::Nats(NatsConfig::new(url).with_prefix(prefix)));
        }
        let _ = prefix;
        Err(TransportError::UnknownScheme {
            url: crate::logging::redact(url),
        })
    }

    /// Its broker's configuration, as the transport boundary sees it.
    fn settings(&self) -> &dyn BrokerSettings {
        match self {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => config,
            #[cfg(feature = "nats")]
            Transport::Nats(config) => config,
        }
    }

    fn settings_mut(&mut self) -> &mut dyn BrokerSettings {
        match self {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => config,
            #[cfg(feature = "nats")]
            Transport::Nats(config) => config,
        }
    }

    /// Checks every setting; the error says which and what to do.
    pub fn validate(&self) -> Result<(), TransportError> {
        self.settings().validate()
    }

    /// The broker's name, for logs and reports.
    pub fn broker(&self) -> &'static str {
        self.settings().broker()
    }

    /// The broker's URL (with its password: redact it before showing it,
    /// [`logging::redact`](crate::logging::redact)).
    pub fn url(&self) -> &str {
        self.settings().url()
    }

    /// The prefix of its queues or subjects.
    pub fn prefix(&self) -> &str {
        self.settings().prefix()
    }

    /// Unacknowledged messages a consumer holds at once.
    pub fn prefetch(&self) -> u16 {
        self.settings().prefetch()
    }

    /// Holds at most `prefetch` unacknowledged messages per consumer.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.settings_mut().set_prefetch(prefetch);
        self
    }

    /// Delivers one message at most `deliveries` times before it is dead-lettered
    /// (`retries_exhausted`): RabbitMQ's [`AmqpConfig::max_redeliveries`] (a quorum
    /// queue's `x-delivery-limit` is one less), JetStream's
    /// `NatsConfig::max_deliver`. On RabbitMQ quorum queues the limit is a queue
    /// argument: every process that declares a queue must use the same number, and
    /// changing it for an existing queue means deleting the queue (or setting a
    /// `delivery-limit` policy instead).
    pub fn with_max_deliveries(mut self, deliveries: u32) -> Self {
        self.settings_mut().set_max_deliveries(deliveries);
        self
    }

    /// Keeps `replicas` copies of the queues or streams the transport declares, on as
    /// many nodes of a cluster: a JetStream stream's `num_replicas`, a RabbitMQ quorum
    /// queue's `x-quorum-initial-group-size`. What exists already keeps its own.
    pub fn with_replicas(mut self, replicas: u8) -> Self {
        self.settings_mut().set_replicas(replicas);
        self
    }

    /// Sets the retention of what the transport declares (a RabbitMQ queue's
    /// `x-message-ttl`, a JetStream stream's `max_age`) from the inbox's
    /// [`broker_retention`](InboxConfig::broker_retention); on RabbitMQ, also the inbox
    /// its consumers check the queues' measured retention against
    /// ([`AmqpConfig::with_inbox`]).
    pub fn with_retention_of(mut self, inbox: &InboxConfig) -> Self {
        self.settings_mut().set_retention_of(inbox);
        self
    }

    /// Where `consumer_type`'s messages are sent: a queue or a subject.
    pub fn destination(&self, consumer_type: &ConsumerType) -> String {
        self.settings().destination(consumer_type)
    }
}

/// Consumes `consumer_type`'s messages of `kinds` with `handler`, on the transport's
/// durable queue or stream. With `inbox`, a JetStream stream's retention is checked
/// against its TTL first (a RabbitMQ queue's is checked against the inbox its
/// [`AmqpConfig::retention_check`] names).
pub async fn consume<H: DeliveryHandler>(
    transport: &Transport,
    consumer_type: ConsumerType,
    kinds: BTreeSet<String>,
    inbox: Option<&InboxConfig>,
    handler: H,
) -> Result<ConsumerHandle, TransportError> {
    match transport {
        #[cfg(feature = "rabbitmq")]
        Transport::Amqp(config) => {
            let _ = inbox;
            let options = amqp::ConsumerOptions::new(consumer_type, kinds);
            Ok(amqp::Consumer::spawn(config.clone(), options, handler).await?)
        }
        #[cfg(feature = "nats")]
        Transport::Nats(config) => {
            let mut options = nats::ConsumerOptions::new(consumer_type, kinds);
            options.inbox = inbox.cloned();
            Ok(nats::Consumer::spawn(config.clone(), options, handler).await?)
        }
    }
}

/// Serves `pool` on the transport: its consumer type's commands of `kinds` run through
/// the pool (and so its inbox, configured as `inbox`), each waiting up to `timeout`,
/// replied to and acked after commit. With `batch` above 1, the messages the consumer
/// holds are claimed in batches of up to `batch`, one batch at a time
/// ([`GroupCommit`](crate::batching::GroupCommit)).
pub async fn serve_step(
    transport: &Transport,
    pool: Arc<StepPool>,
    kinds: BTreeSet<String>,
    timeout: Duration,
    batch: usize,
    inbox: &InboxConfig,
) -> Result<ConsumerHandle, TransportError> {
    // A RabbitMQ queue's retention is checked against the inbox in its own config.
    #[cfg(not(feature = "nats"))]
    let _ = inbox;
    match transport {
        #[cfg(feature = "rabbitmq")]
        Transport::Amqp(config) => {
            Ok(amqp::serve_step_in_batches(config.clone(), pool, kinds, timeout, batch).await?)
        }
        #[cfg(feature = "nats")]
        Transport::Nats(config) => {
            Ok(nats::serve_step(config.clone(), pool, kinds, timeout, batch, inbox).await?)
        }
    }
}

/// An orchestrator's [`Dispatch`] over the broker it was connected to.
#[derive(Debug)]
pub struct Dispatcher(Box<dyn BrokerDispatch>);

/// A broker's dispatch as [`Dispatcher`] holds it: its [`Dispatch`], and its stop.
trait BrokerDispatch: std::fmt::Debug + Send + Sync {
    fn dispatch_boxed<'a>(
        &'a self,
        consumer_type: &'a ConsumerType,
        envelope: crate::envelope::Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StepReply, StepFailure>>;

    fn stop_boxed(&self) -> BoxFuture<'_, ()>;
}

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a broker's dispatch brings besides its [`Dispatch`]: how it stops (no more
/// replies taken, its connections closed). With it, the dispatch is a
/// [`BrokerDispatch`].
pub(crate) trait StopDispatch {
    /// Stops taking replies and closes the connections.
    fn stop_dispatch(&self) -> impl Future<Output = ()> + Send;
}

#[cfg(feature = "rabbitmq")]
impl StopDispatch for crate::amqp::AmqpDispatch {
    fn stop_dispatch(&self) -> impl Future<Output = ()> + Send {
        self.stop()
    }
}

#[cfg(feature = "nats")]
impl StopDispatch for crate::nats::NatsDispatch {
    fn stop_dispatch(&self) -> impl Future<Output = ()> + Send {
        self.stop()
    }
}

impl<D: Dispatch + StopDispatch + std::fmt::Debug> BrokerDispatch for D {
    fn dispatch_boxed<'a>(
        &'a self,
        consumer_type: &'a ConsumerType,
        envelope: crate::envelope::Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StepReply, StepFailure>> {
        Box::pin(self.dispatch(consumer_type, envelope, timeout))
    }

    fn stop_boxed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.stop_dispatch())
    }
}

impl Dispatcher {
    /// Connects, and starts taking replies on a private queue or subject named after
    /// `consumer_type`.
    pub async fn connect(
        transport: &Transport,
        consumer_type: ConsumerType,
    ) -> Result<Self, TransportError> {
        let dispatch: Box<dyn BrokerDispatch> = match transport {
            #[cfg(feature = "rabbitmq")]
            Transport::Amqp(config) => {
                Box::new(AmqpDispatch::connect(config.clone(), consumer_type).await?)
            }
            #[cfg(feature = "nats")]
            Transport::Nats(config) => {
                Box::new(NatsDispatch::connect(config.clone(), consumer_type).await?)
            }
        };
        Ok(Dispatcher(dispatch))
    }

    /// Stops taking replies and closes the connections.
    pub async fn stop(&self) {
        self.0.stop_boxed().await;
    }
}

impl Dispatch for Dispatcher {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: crate::envelope::Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        self.0
            .dispatch_boxed(consumer_type, envelope, timeout)
            .await
    }
}
