//! Saga steps over RabbitMQ: [`serve_step`] puts a [`StepPool`] behind a queue, and
//! [`AmqpDispatch`] lets the [`Orchestrator`](crate::orchestrator::Orchestrator) reach
//! such steps in other processes.
//!
//! A command goes to `<prefix>.<consumer_type>` with its stable message id and a
//! `reply_to` naming the orchestrator's private reply queue. The step's consumer runs it
//! through the step pool (and so through the step's inbox), publishes the reply, and
//! only then acks the command. The reply's id is derived from the command's
//! ([`MessageId::derived`]), so a command redelivered after a crash produces the same
//! reply message, saying what the step's inbox recorded; the orchestrator's saga row
//! records which answer it took ([`crate::reply`]). A reply lost with a crashed
//! orchestrator costs nothing: the orchestrator's timeout sends the command again, and
//! the step's inbox answers with the first result.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::broker::{self, Publisher, Routing};
use super::config::{AmqpConfig, AmqpError};
use super::consumer::{Consumer, ConsumerOptions};
use crate::batching::GroupCommit;
use crate::consumer::ConsumerHandle;
use crate::envelope::{ConsumerType, Envelope};
use crate::orchestrator::Dispatch;
use crate::reply::{REPLY_KIND, Waiters, batch_dispositions, step_disposition, take_reply};
use crate::step::{StepFailure, StepPool, StepReply};

/// Consumes `<prefix>.<consumer_type of pool>` and delivers each command (of `kinds`)
/// to `pool`, waiting up to `timeout` for its answer; replies to the sender. A step
/// failure that may pass is requeued; one the inbox refuses is dead-lettered.
///
/// Each delivery awaits its answer, so the commands in flight are at most the prefetch
/// — except that a delivery that timed out leaves its command in the pool's queue while
/// the broker hands over the next one. Give a pool made with
/// [`StepPool::spawn_bounded`] (the [`Participant`](crate::Participant) does) to cap
/// that queue too.
pub async fn serve_step(
    config: AmqpConfig,
    pool: Arc<StepPool>,
    kinds: impl IntoIterator<Item = String>,
    timeout: Duration,
) -> Result<ConsumerHandle, AmqpError> {
    let options = ConsumerOptions::new(pool.consumer_type().clone(), kinds);
    Consumer::spawn(config, options, move |command: Envelope| {
        let pool = Arc::clone(&pool);
        async move { step_disposition(&pool, command, timeout).await }
    })
    .await
}

/// [`serve_step`] for `batch` 1, [`serve_step_batched`] above.
pub(crate) async fn serve_step_in_batches(
    config: AmqpConfig,
    pool: Arc<StepPool>,
    kinds: impl IntoIterator<Item = String>,
    timeout: Duration,
    batch: usize,
) -> Result<ConsumerHandle, AmqpError> {
    if batch > 1 {
        serve_step_batched(config, pool, kinds, timeout, batch).await
    } else {
        serve_step(config, pool, kinds, timeout).await
    }
}

/// [`serve_step`] with batched claims: the deliveries the consumer holds at once (set
/// its prefetch to at least `max`) are claimed in batches of up to `max` with
/// [`StepPool::deliver_batch`], one batch at a time ([`GroupCommit`]: the commands that
/// arrive while a batch runs go in the next, one arriving while none runs goes alone, at
/// once) — one transaction and one commit per batch. Each command still gets its own
/// reply and ack; a batch that fails as a whole is run one by one, so a bad command
/// fails alone.
pub async fn serve_step_batched(
    config: AmqpConfig,
    pool: Arc<StepPool>,
    kinds: impl IntoIterator<Item = String>,
    timeout: Duration,
    max: usize,
) -> Result<ConsumerHandle, AmqpError> {
    let options = ConsumerOptions::new(pool.consumer_type().clone(), kinds);
    let handler = GroupCommit::new(max, move |commands: Vec<Envelope>| {
        let pool = Arc::clone(&pool);
        async move { batch_dispositions(&pool, commands, timeout).await }
    });
    Consumer::spawn(config, options, handler).await
}

/// Sends step commands through RabbitMQ and waits for their replies: the
/// [`Dispatch`] of an orchestrator whose steps run in other processes.
#[derive(Debug)]
pub struct AmqpDispatch {
    config: AmqpConfig,
    reply_queue: String,
    waiters: Waiters,
    link: tokio::sync::Mutex<Option<Link>>,
    replies: Mutex<Option<ConsumerHandle>>,
}

#[derive(Debug)]
struct Link {
    connection: lapin::Connection,
    publisher: Publisher,
    declared: HashSet<String>,
}

impl AmqpDispatch {
    /// Connects, and starts consuming replies on a private queue named after
    /// `consumer_type` (`<prefix>.<consumer_type>.replies.<uuid>`).
    pub async fn connect(
        config: AmqpConfig,
        consumer_type: ConsumerType,
    ) -> Result<Self, AmqpError> {
        config.validate()?;
        let reply_queue = format!(
            "{}.{}.replies.{}",
            config.queue_prefix,
            consumer_type,
            uuid::Uuid::new_v4().simple()
        );
        let waiters = Waiters::default();
        let options = ConsumerOptions {
            consumer_type: consumer_type.clone(),
            kinds: BTreeSet::from([REPLY_KIND.to_owned()]),
            private_queue: Some(reply_queue.clone()),
        };
        let replies = {
            let waiters = waiters.clone();
            Consumer::spawn(config.clone(), options, move |reply: Envelope| {
                let disposition = take_reply(&waiters, &reply);
                async move { disposition }
            })
            .await?
        };
        let dispatch = Self {
            config,
            reply_queue,
            waiters,
            link: tokio::sync::Mutex::new(None),
            replies: Mutex::new(Some(replies)),
        };
        dispatch.publisher_for(None).await?;
        Ok(dispatch)
    }

    /// Stops consuming replies and closes the connections.
    pub async fn stop(&self) {
        let replies = self
            .replies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(replies) = replies {
            replies.stop().await;
        }
        if let Some(link) = self.link.lock().await.take() {
            let _ = link.connection.close(200, "stopping".into()).await;
        }
    }

    /// A publisher on a live connection, with `consumer_type`'s queues declared when
    /// given.
    async fn publisher_for(
        &self,
        consumer_type: Option<&ConsumerType>,
    ) -> Result<Publisher, AmqpError> {
        let mut link = self.link.lock().await;
        let alive = link
            .as_ref()
            .is_some_and(|link| link.connection.status().connected());
        if !alive {
            let connection = broker::connect(&self.config, "dispatch").await?;
            let publisher = Publisher::open(&connection).await?;
            *link = Some(Link {
                connection,
                publisher,
                declared: HashSet::new(),
            });
        }
        let Some(link) = link.as_mut() else {
            return Err(AmqpError::Config("no broker connection".into()));
        };
        if let Some(consumer_type) = consumer_type {
            let queue = self.config.queue(consumer_type);
            if !link.declared.contains(&queue) {
                broker::declare(&link.connection, &self.config, consumer_type).await?;
                link.declared.insert(queue);
            }
        }
        Ok(link.publisher.clone())
    }
}

impl Dispatch for AmqpDispatch {
    async fn dispatch(
        &self,
        consumer_type: &ConsumerType,
        envelope: Envelope,
        timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        let queue = self.config.queue(consumer_type);
        self.waiters
            .send_and_wait(envelope, timeout, async |command| {
                // Bounded like the wait for the reply: a connection that stopped
                // answering must not hold every saga's next command for ever.
                let publishing = async {
                    let publisher = self.publisher_for(Some(consumer_type)).await?;
                    publisher
                        .publish(
                            &queue,
                            &command,
                            Some(&self.reply_queue),
                            None,
                            Routing::Required,
                        )
                        .await
                };
                let published = tokio::time::timeout(timeout, publishing)
                    .await
                    .unwrap_or(Err(AmqpError::NoAnswer {
                        operation: "publish a step command",
                        after: timeout,
                    }));
                if published.is_err()
                    && let Some(link) = self.link.lock().await.take()
                {
                    // Closed in the background: a connection that stopped answering
                    // would hold this command's failure as long as its close waits.
                    tokio::spawn(async move {
                        let closing = link.connection.close(200, "reconnecting".into());
                        let _ = tokio::time::timeout(Duration::from_secs(5), closing).await;
                    });
                }
                published
            })
            .await
    }
}
