//! The broker bench over NATS JetStream: a hand-written `async-nats` pull consumer,
//! sagabox's [`Consumer`] with the guard, and the participant runtime, each on its own
//! work-queue stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use futures_lite::StreamExt;
use sagabox::consumer::ConsumerHandle;
use sagabox::nats::codec::{self, MESSAGE_ID_HEADER};
use sagabox::nats::{Consumer, ConsumerOptions, NatsConfig};
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

/// The three modes' subjects, and the JetStream context that fills their streams.
struct Subjects {
    jetstream: Context,
    names: Vec<String>,
}

impl Publish for Subjects {
    async fn publish(&self, mode: usize, message: &Message, paced: bool) -> Result<(), BoxError> {
        let (body, _) = codec::encode(&envelope(message, paced)?);
        // The id in sagabox's own header, not in `Nats-Msg-Id`: the server's duplicate
        // window would drop the workload's repeats before any consumer saw them.
        let mut headers = HeaderMap::new();
        headers.insert(MESSAGE_ID_HEADER, message.0.as_str());
        self.jetstream
            .publish_with_headers(self.names[mode].clone(), headers, body.into())
            .await?
            .await?;
        Ok(())
    }
}

/// Creates the streams, measures the three modes in turn, and deletes the streams.
pub(super) async fn drains(
    args: &BrokerBenchArgs,
    pool: &PgPool,
    store: PostgresStore,
    workload: &Workload<'_>,
) -> Result<[Drain; 3], BoxError> {
    let mut config = NatsConfig::new(args.broker_url.clone())
        .with_prefix(format!("sagabox-bench-{}", std::process::id()))
        .with_retention(InboxConfig::default().broker_retention);
    config.prefetch = args.prefetch;
    config.validate()?;
    let transport = Transport::Nats(config.clone());
    let mut sender = Sender::connect(&transport, "bench").await?;
    let client = async_nats::connect(args.broker_url.as_str()).await?;
    let jetstream = async_nats::jetstream::new(client.clone());
    let consumer_types = MODES
        .iter()
        .map(|(_, name)| ConsumerType::new(*name))
        .collect::<Result<Vec<_>, _>>()?;
    let subjects = Subjects {
        jetstream: jetstream.clone(),
        names: consumer_types.iter().map(|ct| config.subject(ct)).collect(),
    };
    let outcome = async {
        for consumer_type in &consumer_types {
            sender.declare(consumer_type).await?;
        }
        // The durable pull consumer sagabox's would create, with the same settings: only
        // the code that reads from it is hand-written.
        let name = config.stream(&consumer_types[0]);
        let pull = jetstream
            .get_stream(&name)
            .await?
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
            .await?;
        let (handwritten, hand) = measure(
            &subjects,
            0,
            workload,
            Handwritten::start(args, pool.clone(), pull),
        )
        .await?;
        handwritten.task.abort();

        let guarded = Guarded::new(store.clone(), args.workers)?;
        let options = ConsumerOptions::new(guarded.consumer_type.clone(), ["deposit"]);
        let (direct, consumer) = measure(&subjects, 1, workload, async {
            Ok(Direct(
                Consumer::spawn(config.clone(), options, guarded).await?,
            ))
        })
        .await?;
        direct.0.stop().await;

        let sagabox =
            participant_drain(&subjects, transport.clone(), store, workload, args.workers).await?;
        Ok::<_, BoxError>([hand, consumer, sagabox])
    }
    .await;
    for consumer_type in &consumer_types {
        let _ = sender.remove(consumer_type).await;
    }
    sender.close().await;
    let _ = client.flush().await;
    outcome
}

/// The hand-written consumer: its pulling task and the count of its acks.
struct Handwritten {
    acked: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Result<(), BoxError>>,
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
            Ok(Ok(())) => "its messages ended".into(),
            Ok(Err(error)) => error,
            Err(panicked) => panicked.into(),
        })
    }
}

impl Handwritten {
    async fn start(
        args: &BrokerBenchArgs,
        pool: PgPool,
        pull: PullConsumer,
    ) -> Result<Self, BoxError> {
        let mut messages = pull
            .stream()
            .max_messages_per_batch(usize::from(args.prefetch))
            .messages()
            .await?;
        let acked = Arc::new(AtomicU64::new(0));
        let workers = Arc::new(Semaphore::new(args.workers));
        let task = tokio::spawn({
            let acked = acked.clone();
            async move {
                let mut running = JoinSet::new();
                while let Some(message) = messages.next().await {
                    let message = message?;
                    let permit = workers.clone().acquire_owned().await?;
                    let (pool, acked) = (pool.clone(), acked.clone());
                    running.spawn(async move {
                        let id = message
                            .headers
                            .as_ref()
                            .and_then(|headers| codec::header(headers, MESSAGE_ID_HEADER))
                            .ok_or("a message without its id header")?;
                        let body: serde_json::Value = serde_json::from_slice(&message.payload)?;
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
                        message.ack().await?;
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
        Ok(Self { acked, task })
    }
}

/// The `consumer` mode: sagabox's JetStream consumer calling the guard itself.
struct Direct(ConsumerHandle);

impl Running for Direct {
    fn acked(&self) -> u64 {
        self.0.stats().acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        self.0.is_finished().then(|| "the consumer ended".into())
    }
}
