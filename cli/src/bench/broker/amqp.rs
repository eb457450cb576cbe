//! The broker bench over RabbitMQ: a hand-written `lapin` consumer, sagabox's
//! [`Consumer`] with the guard, and the participant runtime, each on its own quorum queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use sagabox::amqp::{AmqpConfig, Consumer, ConsumerOptions, codec};
use sagabox::consumer::ConsumerHandle;
use sagabox::transport::{Sender, Transport};
use sagabox::{ConsumerType, InboxConfig, PostgresStore};
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{
    BrokerBenchArgs, Drain, Guarded, MODES, Message, Publish, RAW_CLAIM, Running, Workload,
    business, envelope, fields, measure, participant_drain,
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
        let (handwritten, hand) = measure(
            &queues,
            0,
            workload,
            Handwritten::start(args, pool.clone(), &queues.names[0]),
        )
        .await?;
        handwritten.stop().await?;

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

/// The hand-written consumer: its connection and the count of its acks.
struct Handwritten {
    acked: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Result<(), BoxError>>,
    connection: Connection,
}

impl Running for Handwritten {
    fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        if !self.task.is_finished() {
            return None;
        }
        Some(match (&mut self.task).await {
            Ok(Ok(())) => "its deliveries ended".into(),
            Ok(Err(error)) => error,
            Err(panicked) => panicked.into(),
        })
    }
}

impl Handwritten {
    async fn start(args: &BrokerBenchArgs, pool: PgPool, queue: &str) -> Result<Self, BoxError> {
        let connection =
            Connection::connect(&args.broker_url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(args.prefetch, BasicQosOptions::default())
            .await?;
        let mut deliveries = channel
            .basic_consume(
                queue.into(),
                "bench-handwritten".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let acked = Arc::new(AtomicU64::new(0));
        let workers = Arc::new(Semaphore::new(args.workers));
        let task = tokio::spawn({
            let acked = acked.clone();
            async move {
                let mut running = JoinSet::new();
                while let Some(delivery) = deliveries.next().await {
                    let delivery = delivery?;
                    let permit = workers.clone().acquire_owned().await?;
                    let (pool, acked) = (pool.clone(), acked.clone());
                    running.spawn(async move {
                        let id = delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .ok_or("a delivery without message_id")?
                            .to_string();
                        let body: serde_json::Value = serde_json::from_slice(&delivery.data)?;
                        let fields = fields(&body["payload"]).ok_or("payload lacks its fields")?;
                        let mut tx = pool.begin().await?;
                        let fresh = sqlx::query(RAW_CLAIM)
                            .bind(id.as_str())
                            .execute(&mut *tx)
                            .await?
                            .rows_affected()
                            == 1;
                        if fresh {
                            business(&mut tx, MODES[0].0, &id, &fields).await?;
                        }
                        tx.commit().await?;
                        delivery.acker.ack(BasicAckOptions::default()).await?;
                        acked.fetch_add(1, Ordering::Relaxed);
                        drop(permit);
                        Ok::<_, BoxError>(())
                    });
                    while let Some(done) = running.try_join_next() {
                        done??;
                    }
                }
                while let Some(done) = running.join_next().await {
                    done??;
                }
                Ok(())
            }
        });
        Ok(Self {
            acked,
            task,
            connection,
        })
    }

    /// Closes the connection once every delivery is acked; the consumer's loop ends
    /// with it (the error of a stream cut by its own close says nothing).
    async fn stop(self) -> Result<(), BoxError> {
        self.connection.close(200, "bench done".into()).await?;
        self.task.abort();
        Ok(())
    }
}

/// The `consumer` mode: sagabox's RabbitMQ consumer calling the guard itself.
struct Direct(ConsumerHandle);

impl Running for Direct {
    fn acked(&self) -> u64 {
        self.0.stats().acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        self.0.is_finished().then(|| "the consumer ended".into())
    }
}
