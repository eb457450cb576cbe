//! The broker bench over RabbitMQ: a hand-written `lapin` consumer, sagabox's
//! [`Consumer`] with the guard, and the participant runtime, each on its own quorum queue.

use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use sagabox::amqp::{AmqpConfig, Consumer, ConsumerOptions, codec};
use sagabox::transport::{Sender, Transport};
use sagabox::{ConsumerType, InboxConfig, PostgresStore};
use sqlx::PgPool;

use super::handwritten::{Direct, HandDelivery, Handwritten};
use super::{
    BrokerBenchArgs, Drain, Guarded, MODES, Message, Publish, Workload, envelope, measure,
    participant_drain,
};
use crate::bench::BoxError;

/// The three modes' queues, and the plain `lapin` channel (in confirm mode) that fills
/// them as a producer outside sagabox would.
struct Queues {
    channel: lapin::Channel,
    names: Vec<String>,
}

impl Publish for Queues {
    async fn publish(&self, mode: usize, message: &Message, paced: bool) -> Result<(), BoxError> {
        let (body, properties) = codec::encode(&envelope(message, paced)?);
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.names[mode].as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &body,
                properties,
            )
            .await?
            .await?;
        if !confirm.is_ack() || confirm.take_message().is_some() {
            return Err(
                format!("RabbitMQ did not store a message for {}", self.names[mode]).into(),
            );
        }
        Ok(())
    }
}

/// Declares the queues, measures the three modes in turn, and deletes the queues.
pub(super) async fn drains(
    args: &BrokerBenchArgs,
    pool: &PgPool,
    store: PostgresStore,
    workload: &Workload<'_>,
) -> Result<[Drain; 3], BoxError> {
    let mut config = AmqpConfig::new(args.broker_url.clone())
        .with_queue_prefix(format!("sagabox-bench-{}", std::process::id()))
        .with_inbox(&InboxConfig::default());
    config.prefetch = args.prefetch;
    config.validate()?;
    let transport = Transport::Amqp(config.clone());
    let consumer_types = MODES
        .iter()
        .map(|(_, name)| ConsumerType::new(*name))
        .collect::<Result<Vec<_>, _>>()?;
    let mut sender = Sender::connect(&transport, "bench").await?;
    let filling = Connection::connect(&args.broker_url, ConnectionProperties::default()).await?;
    let channel = filling.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let queues = Queues {
        channel,
        names: consumer_types.iter().map(|ct| config.queue(ct)).collect(),
    };
    let outcome = async {
        for consumer_type in &consumer_types {
            sender.declare(consumer_type).await?;
        }
        let consuming =
            Connection::connect(&args.broker_url, ConnectionProperties::default()).await?;
        let (handwritten, hand) = measure(
            &queues,
            0,
            workload,
            handwritten(args, pool.clone(), &consuming, &queues.names[0]),
        )
        .await?;
        handwritten.stop();
        consuming.close(200, "bench done".into()).await?;

        let guarded = Guarded::new(store.clone(), args.workers)?;
        let options = ConsumerOptions::new(guarded.consumer_type.clone(), ["deposit"]);
        let (direct, consumer) = measure(&queues, 1, workload, async {
            Ok(Direct(
                Consumer::spawn(config.clone(), options, guarded).await?,
            ))
        })
        .await?;
        direct.0.stop().await;

        let sagabox =
            participant_drain(&queues, transport.clone(), store, workload, args.workers).await?;
        Ok::<_, BoxError>([hand, consumer, sagabox])
    }
    .await;
    for consumer_type in &consumer_types {
        let _ = sender.remove(consumer_type).await;
    }
    sender.close().await;
    let _ = filling.close(200, "bench done".into()).await;
    outcome
}

/// Starts the hand-written consumer on `queue`, on a channel of `connection` with the
/// bench's prefetch.
async fn handwritten(
    args: &BrokerBenchArgs,
    pool: PgPool,
    connection: &Connection,
    queue: &str,
) -> Result<Handwritten, BoxError> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await?;
    let deliveries = channel
        .basic_consume(
            queue.into(),
            "bench-handwritten".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(Handwritten::spawn(deliveries, pool, args.workers))
}

impl HandDelivery for Delivery {
    fn id(&self) -> Option<String> {
        self.properties
            .message_id()
            .as_ref()
            .map(ToString::to_string)
    }

    fn body(&self) -> &[u8] {
        &self.data
    }

    async fn ack(self) -> Result<(), BoxError> {
        self.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }
}
