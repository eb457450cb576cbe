//! Saga steps over NATS JetStream: [`serve_step`] puts a [`StepPool`] behind a consumer
//! type's work stream, and [`NatsDispatch`] lets the
//! [`Orchestrator`](crate::orchestrator::Orchestrator) reach such steps in other
//! processes.
//!
//! A command goes to `<prefix>.<consumer_type>` under its stable message id
//! (`Nats-Msg-Id`), with `x-sagabox-reply-to` naming the orchestrator's private reply
//! subject. The step's consumer runs it through the step pool (and so through the
//! step's inbox), publishes the reply over core NATS, and only then acks the command.
//! Every copy of a reply says what the step's inbox recorded; the orchestrator's saga
//! row records which answer it took ([`crate::reply`]).
//!
//! A reply lost with a crashed orchestrator costs nothing: the orchestrator's timeout
//! sends the command again. JetStream would drop that send as a duplicate within its
//! window when the first one is stored already, so a send the server reports as a
//! duplicate is published once more under a fresh `Nats-Msg-Id`, its real id in
//! `x-sagabox-message-id`: it reaches the step, whose inbox answers with the first result.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::Context;
use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::codec::{self, MESSAGE_ID_HEADER, REPLY_TO_HEADER};
use super::config::{NatsConfig, NatsError};
use super::consumer::{Consumer, ConsumerOptions};
use super::jetstream;
use crate::batching::GroupCommit;
use crate::consumer::ConsumerHandle;
use crate::delivery::Disposition;
use crate::envelope::{ConsumerType, Envelope};
use crate::inbox::InboxConfig;
use crate::orchestrator::Dispatch;
use crate::reply::{REPLY_KIND, Waiters, batch_dispositions, step_disposition, take_reply};
use crate::step::{StepFailure, StepPool, StepReply};

/// Consumes `<prefix>.<consumer_type of pool>` and delivers each command (of `kinds`)
/// to `pool`, waiting up to `timeout` for its answer; replies to the sender. A step
/// failure that may pass is redelivered; one the inbox refuses is dead-lettered. The
/// work stream's retention is checked against `inbox`'s TTL first.
///
/// Each message awaits its answer, so the commands in flight are at most the prefetch
/// (`max_ack_pending`); give a pool made with [`StepPool::spawn_bounded`] to cap the
/// pool's own queue too. With `batch` above 1, the messages the consumer holds are
/// claimed in batches of up to `batch` with [`StepPool::deliver_batch`], one batch at a
/// time ([`GroupCommit`]): one transaction per batch, each command still replied to and
/// acked on its own.
pub async fn serve_step(
    config: NatsConfig,
    pool: Arc<StepPool>,
    kinds: impl IntoIterator<Item = String>,
    timeout: Duration,
    batch: usize,
    inbox: &InboxConfig,
) -> Result<ConsumerHandle, NatsError> {
    let options =
        ConsumerOptions::new(pool.consumer_type().clone(), kinds).checked_against(inbox.clone());
    if batch > 1 {
        let handler = GroupCommit::new(batch, move |commands: Vec<Envelope>| {
            let pool = Arc::clone(&pool);
            async move { batch_dispositions(&pool, commands, timeout).await }
        });
        return Consumer::spawn(config, options, handler).await;
    }
    Consumer::spawn(config, options, move |command: Envelope| {
        let pool = Arc::clone(&pool);
        async move { step_disposition(&pool, command, timeout).await }
    })
    .await
}

/// Sends step commands through JetStream and waits for their replies: the [`Dispatch`]
/// of an orchestrator whose steps run in other processes.
#[derive(Debug)]
pub struct NatsDispatch {
    config: NatsConfig,
    client: Client,
    context: Context,
    reply_subject: String,
    waiters: Waiters,
    declared: tokio::sync::Mutex<std::collections::HashSet<String>>,
    replies: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl NatsDispatch {
    /// Connects, and starts taking replies on a private subject named after
    /// `consumer_type` (`<prefix>.<consumer_type>.replies.<uuid>`).
    pub async fn connect(
        config: NatsConfig,
        consumer_type: ConsumerType,
    ) -> Result<Self, NatsError> {
        config.validate()?;
        let client = jetstream::connect(&config, "dispatch").await?;
        let context = jetstream::context(&client);
        let reply_subject = format!(
            "{}.{}.replies.{}",
            config.prefix,
            consumer_type,
            uuid::Uuid::new_v4().simple()
        );
        let mut subscriber = client
            .subscribe(reply_subject.clone())
            .await
            .map_err(NatsError::broker("subscribe to replies"))?;
        let waiters = Waiters::default();
        let replies = {
            let waiters = waiters.clone();
            let kinds = std::collections::BTreeSet::from([REPLY_KIND.to_owned()]);
            tokio::spawn(async move {
                while let Some(message) = subscriber.next().await {
                    let reply = match codec::decode(
                        message.headers.as_ref(),
                        &message.payload,
                        &kinds,
                    ) {
                        Ok(reply) => reply,
                        Err(malformed) => {
                            tracing::warn!(%malformed, "dropping a message on the reply subject");
                            continue;
                        }
                    };
                    // Core NATS keeps no dead letters: a reply that is not one is logged
                    // and dropped; the orchestrator's timeout asks again.
                    if let Disposition::Retry(reason) | Disposition::Reject(reason) =
                        take_reply(&waiters, &reply)
                    {
                        tracing::warn!(
                            reason,
                            "a reply was not taken; its command will be sent again"
                        );
                    }
                }
            })
        };
        Ok(Self {
            config,
            client,
            context,
            reply_subject,
            waiters,
            declared: tokio::sync::Mutex::default(),
            replies: std::sync::Mutex::new(Some(replies)),
        })
    }

    /// Stops taking replies and drains the connection.
    pub async fn stop(&self) {
        let replies = self
            .replies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(replies) = replies {
            replies.abort();
        }
        let _ = self.client.drain().await;
    }

    /// Creates `consumer_type`'s streams the first time a command goes to it, so a
    /// command sent before its step ever ran is stored, not lost.
    async fn declare(&self, consumer_type: &ConsumerType) -> Result<(), NatsError> {
        let mut declared = self.declared.lock().await;
        if !declared.contains(consumer_type.as_str()) {
            jetstream::declare(&self.context, &self.config, consumer_type).await?;
            declared.insert(consumer_type.as_str().to_owned());
        }
        Ok(())
    }

    /// Publishes `envelope` to `consumer_type`'s stream with the reply subject; once more
    /// under a fresh `Nats-Msg-Id` when the server drops it as a duplicate.
    async fn send(
        &self,
        consumer_type: &ConsumerType,
        envelope: &Envelope,
    ) -> Result<(), NatsError> {
        self.declare(consumer_type).await?;
        let subject = self.config.subject(consumer_type);
        let (body, mut headers) = codec::encode(envelope);
        headers.insert(REPLY_TO_HEADER, self.reply_subject.as_str());
        let duplicate =
            jetstream::publish(&self.context, &subject, headers.clone(), body.clone()).await?;
        if duplicate {
            headers.insert(MESSAGE_ID_HEADER, envelope.id.as_str());
            headers.insert(
                NATS_MESSAGE_ID,
                format!("{}#resend-{}", envelope.id, uuid::Uuid::new_v4().simple()),
            );
            jetstream::publish(&self.context, &subject, headers, body).await?;
        }
        Ok(())
    }
}

impl Dispatch for NatsDispatch {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        self.waiters
            .send_and_wait(envelope, timeout, async |command| {
                self.send(consumer_type, &command).await
            })
            .await
    }
}
