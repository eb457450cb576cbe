//! The broker bench over NATS JetStream: a hand-written `async-nats` pull consumer,
//! sagabox's [`Consumer`] with the guard, and the participant runtime, each on its own
//! work-queue stream.

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, Context};
use sagabox::nats::codec::{self, MESSAGE_ID_HEADER};
use sagabox::nats::{Consumer, ConsumerOptions, NatsConfig};
use sagabox::transport::{Sender, Transport};
use sagabox::{ConsumerType, InboxConfig, PostgresStore};
use sqlx::PgPool;

use super::handwritten::{Direct, HandDelivery, Handwritten};
use super::{
    BrokerBenchArgs, Drain, Guarded, MODES, Message, Publish, Workload, envelope, measure,
    participant_drain,
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
            handwritten(args, pool.clone(), pull),
        )
        .await?;
        handwritten.stop();

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

/// Starts the hand-written consumer on `pull`, `--prefetch` messages a batch.
async fn handwritten(
    args: &BrokerBenchArgs,
    pool: PgPool,
    pull: PullConsumer,
) -> Result<Handwritten, BoxError> {
    let messages = pull
        .stream()
        .max_messages_per_batch(usize::from(args.prefetch))
        .messages()
        .await?;
    Ok(Handwritten::spawn(messages, pool, args.workers))
}

impl HandDelivery for jetstream::Message {
    fn id(&self) -> Option<String> {
        self.headers
            .as_ref()
            .and_then(|headers| codec::header(headers, MESSAGE_ID_HEADER))
    }

    fn body(&self) -> &[u8] {
        &self.payload
    }

    async fn ack(self) -> Result<(), BoxError> {
        jetstream::Message::ack(&self).await
    }
}
