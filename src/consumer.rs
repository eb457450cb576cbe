//! The consumer core every broker shares: the session loop that keeps a subscription
//! open and hands each message to its own task (`run`), how one received message is
//! settled (`Settler`), and the [`ConsumerHandle`] of a running consumer.
//!
//! A broker's consumer brings its subscriptions (`Source`, `Subscription`: open,
//! next message, health, cancel, close). The loop, the same for every broker:
//!
//! - opens a subscription, and opens it again after a loss, waiting by
//!   `Source::backoff` (reset by a message received), until stopped; an opening that
//!   gets no answer within `OPEN_TIMEOUT` (a broker node accepting connections but not
//!   yet serving, a declare never answered) is given up and tried again, so the consumer
//!   cannot wait for ever on one that went silent;
//! - looks at the subscription's health every second: the process's readiness follows
//!   it, and a subscription found lost is replaced;
//! - on stop, cancels the subscription, lets the messages in flight settle, then closes
//!   it; on a loss, gives them `IN_FLIGHT_GRACE` when the broker cannot settle them
//!   on the next subscription (`Source::SETTLES_AFTER_LOSS`), then abandons them to
//!   the broker's redelivery.
//!
//! A broker's consumer brings the message and what only the broker can do with it
//! (`Received`: decode, acknowledge, reply, requeue, dead-letter); the core decides
//! which, in one place for every broker:
//!
//! - a message that is not an envelope, or whose deliveries are spent, is dead-lettered
//!   without running;
//! - otherwise the handler runs (inside the sender's trace), a panic in it taken as a
//!   retryable failure, and its [`Disposition`] settles the message: done → the reply,
//!   then the ack; retry → the broker's requeue, or a dead letter once the attempts are
//!   spent; reject → a dead letter;
//! - a message that cannot be settled (the connection went, a reply the broker refused)
//!   is handed back after a short pause; on a dead connection the broker delivers it
//!   again anyway; the inbox absorbs the repeat.
//!
//! Every dead letter is counted in `sagabox_dead_letters_total` and the consumer's
//! [`ConsumerStats`], whoever ends up writing it.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::Instrument;

use crate::dead_reason::DeadReason;
use crate::delivery::{ConsumerStats, DeliveryHandler, Disposition};
use crate::envelope::{ConsumerType, Envelope, MessageId};
use crate::health::ConsumerReadiness;
use crate::supervisor::panic_message;
use crate::wire::Malformed;

/// A running consumer, on any broker.
#[derive(Debug)]
pub struct ConsumerHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    stats: Arc<ConsumerStats>,
}

impl ConsumerHandle {
    /// What it has done so far (`sessions`: connections or subscriptions started).
    pub fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// Whether the consumer has ended without being stopped: it reconnects after every
    /// broker failure, so only a bug (a panic outside the handler) ends it early.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops consuming, lets the messages in flight finish and settle, and closes the
    /// connection.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Drops the consumer at once, without settling what is in flight: what a crash
    /// does. Unacknowledged messages come back from the broker. With the `testing`
    /// feature, for tests of what a crashed consumer leaves.
    #[cfg(feature = "testing")]
    pub fn abort(self) {
        self.task.abort();
    }
}

/// How long messages in flight get to settle after their subscription was lost, on a
/// broker that cannot settle them on the next one.
pub(crate) const IN_FLIGHT_GRACE: Duration = Duration::from_secs(5);

/// How long an unsettled message is held before it is handed back for redelivery.
const GIVE_BACK_DELAY: Duration = Duration::from_millis(200);

/// How long opening a subscription (connecting, declaring, subscribing) may take
/// before it is given up and tried again: past the connect timeouts of a cluster's
/// nodes, short of what an operator would call a hang.
const OPEN_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a consumer's subscriptions come from: a broker connection and what it consumes.
pub(crate) trait Source: Send + 'static {
    /// The messages its subscriptions yield.
    type Message: Received + 'static;
    /// An open subscription.
    type Subscription: Subscription<Message = Self::Message>;
    /// The broker's error.
    type Error: Display + Send;

    /// Whether a message received on a lost subscription can still be settled (the
    /// client reconnects underneath and its acknowledgement goes through), so messages in
    /// flight are kept rather than abandoned after [`IN_FLIGHT_GRACE`].
    const SETTLES_AFTER_LOSS: bool;

    /// The broker's name, for logs.
    fn broker(&self) -> &'static str;

    /// Opens a subscription (connecting first when the last connection is gone).
    fn open(&mut self) -> impl Future<Output = Result<Self::Subscription, Self::Error>> + Send;

    /// The wait before the subscription after `failures` failed or lost ones.
    fn backoff(&self, failures: u32) -> Duration;
}

/// What came next on a subscription.
pub(crate) enum Next<M> {
    /// A message to settle.
    Message(M),
    /// A hiccup the subscription carries on after (a missed heartbeat): logged only.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))] // JetStream's only
    Interrupted(String),
    /// The subscription is gone, and why.
    Ended(String),
}

/// What the once-a-second look at a subscription found.
pub(crate) enum Health {
    /// It can take messages.
    Consuming,
    /// Not now, but it may recover by itself (the client is reconnecting).
    #[cfg_attr(not(feature = "nats"), allow(dead_code))] // JetStream's only
    Waiting,
    /// It will not come back, and why: open another.
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))] // RabbitMQ's only
    Lost(String),
}

/// An open subscription of a [`Source`].
pub(crate) trait Subscription: Send {
    /// The messages it yields.
    type Message: Send;

    /// The next message, or what happened instead.
    fn next(&mut self) -> impl Future<Output = Next<Self::Message>> + Send;

    /// Whether it still takes messages.
    fn health(&self) -> Health;

    /// Stops the broker from handing it more messages (on stop).
    fn cancel(&mut self) -> impl Future<Output = ()> + Send;

    /// Closes it once what it handed out has settled (on stop).
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// Why a session ended.
enum Ended {
    Stopped,
    Lost(String),
}

/// Starts consuming from `source` — `consumes` names its queue or stream — with
/// `handler` for `consumer_type`'s messages of `kinds`, and reports its readiness under
/// that name: what every broker's `Consumer::spawn` ends with.
pub(crate) fn spawn<S, H>(
    source: S,
    consumes: &str,
    consumer_type: ConsumerType,
    kinds: BTreeSet<String>,
    handler: H,
) -> ConsumerHandle
where
    S: Source,
    H: DeliveryHandler,
{
    let readiness = crate::health::global().consumer(format!("{consumes} ({})", source.broker()));
    let (stop, stopped) = watch::channel(false);
    let stats = Arc::new(ConsumerStats::default());
    let settler = Settler::new(consumer_type, kinds, handler, Arc::clone(&stats));
    let task = tokio::spawn(run(source, Arc::new(settler), readiness, stopped));
    ConsumerHandle { stop, task, stats }
}

/// Consumes from `source` with `settler` until `stopped` turns true: the session loop
/// of every broker's consumer (see the module's documentation).
async fn run<S, H>(
    mut source: S,
    settler: Arc<Settler<H>>,
    readiness: ConsumerReadiness,
    mut stopped: watch::Receiver<bool>,
) where
    S: Source,
    H: DeliveryHandler,
{
    let mut in_flight = JoinSet::new();
    let mut failures = 0u32;
    loop {
        let opened = {
            let opening = tokio::time::timeout(OPEN_TIMEOUT, source.open());
            tokio::pin!(opening);
            loop {
                tokio::select! {
                    opened = &mut opening => break Some(opened),
                    changed = stopped.changed() => {
                        if changed.is_err() || *stopped.borrow() {
                            break None;
                        }
                    }
                }
            }
        };
        let Some(opened) = opened else {
            while in_flight.join_next().await.is_some() {}
            return;
        };
        let lost = match opened {
            Ok(Ok(subscription)) => {
                settler.stats().sessions.fetch_add(1, Relaxed);
                let (ended, subscription) = session(
                    subscription,
                    &settler,
                    &readiness,
                    &mut stopped,
                    &mut in_flight,
                    &mut failures,
                )
                .await;
                readiness.set_consuming(false);
                match ended {
                    Ended::Stopped => {
                        // The messages in flight finish and are acknowledged.
                        while in_flight.join_next().await.is_some() {}
                        subscription.close().await;
                        return;
                    }
                    Ended::Lost(reason) => {
                        if !S::SETTLES_AFTER_LOSS {
                            abandon(&mut in_flight).await;
                        }
                        drop(subscription);
                        reason
                    }
                }
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("the broker did not answer within {OPEN_TIMEOUT:?} of subscribing"),
        };
        let wait = source.backoff(failures);
        failures = failures.saturating_add(1);
        tracing::warn!(
            consumer_type = %settler.consumer_type(),
            broker = source.broker(),
            reason = %lost,
            retry_in = ?wait,
            "consumer lost its subscription; subscribing again"
        );
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stopped.changed() => {}
        }
        if *stopped.borrow() {
            while in_flight.join_next().await.is_some() {}
            return;
        }
    }
}

/// One subscription's worth of consuming: ends on stop or loss, and hands the
/// subscription back.
async fn session<T, H>(
    mut subscription: T,
    settler: &Arc<Settler<H>>,
    readiness: &ConsumerReadiness,
    stopped: &mut watch::Receiver<bool>,
    in_flight: &mut JoinSet<()>,
    failures: &mut u32,
) -> (Ended, T)
where
    T: Subscription,
    T::Message: Received + 'static,
    H: DeliveryHandler,
{
    readiness.set_consuming(true);
    // A subscription whose connection died without its stream ending would sit idle
    // forever: its health is looked at every second too.
    let mut health = tokio::time::interval(Duration::from_secs(1));
    let ended = loop {
        tokio::select! {
            _ = health.tick() => match subscription.health() {
                Health::Consuming => readiness.set_consuming(true),
                Health::Waiting => readiness.set_consuming(false),
                Health::Lost(reason) => break Ended::Lost(reason),
            },
            changed = stopped.changed() => {
                if changed.is_err() || *stopped.borrow() {
                    subscription.cancel().await;
                    break Ended::Stopped;
                }
            }
            next = subscription.next() => match next {
                Next::Message(message) => {
                    *failures = 0;
                    let settler = Arc::clone(settler);
                    in_flight.spawn(async move { settler.settle(message).await });
                }
                Next::Interrupted(reason) => {
                    tracing::debug!(consumer_type = %settler.consumer_type(), reason, "subscription interrupted");
                }
                Next::Ended(reason) => break Ended::Lost(reason),
            },
            Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
        }
    };
    (ended, subscription)
}

/// The connection of the messages in flight is gone: give their work a moment to end,
/// then abandon it rather than wait on a dead connection (the broker redelivers them,
/// the inbox absorbs those applied).
async fn abandon(in_flight: &mut JoinSet<()>) {
    let drained = tokio::time::timeout(IN_FLIGHT_GRACE, async {
        while in_flight.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = in_flight.len(),
            "abandoning messages still in flight on a lost connection"
        );
        in_flight.shutdown().await;
    }
}

/// What became of a message the handler asked to retry.
#[derive(Debug)]
pub(crate) enum Retried {
    /// Back on the queue for another delivery.
    Requeued,
    /// Back on the queue for the last time: the broker dead-letters it at its own
    /// delivery limit (a quorum queue's), so the dead letter is counted here.
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))] // RabbitMQ's only
    RequeuedLast,
    /// Out of attempts: to be dead-lettered, with this detail.
    Exhausted(String),
}

/// A message as a broker's consumer received it, and what only that broker can do with
/// it. Every settling operation acknowledges the message (or hands it back) as its last
/// step, so a failure before that leaves it to be delivered again.
pub(crate) trait Received: Send + Sync {
    /// The broker's error.
    type Error: Display + Send;

    /// Where the message came from (a queue, a subject), for logs.
    fn source(&self) -> &str;

    /// The envelope, or why the message is not one.
    fn decode(&self, kinds: &BTreeSet<String>) -> Result<Envelope, Malformed>;

    /// Why the message must not run although it decodes: its deliveries are spent
    /// without it ever being settled (the consumer died each time).
    fn spent(&self) -> Option<String> {
        None
    }

    /// The span the handler runs in, named for the broker.
    fn span(&self, envelope: &Envelope) -> tracing::Span;

    /// Publishes `reply` to the message's `reply_to`, correlated by `command`, when the
    /// sender gave one; then acknowledges the message.
    fn reply_and_ack(
        &self,
        reply: Option<Envelope>,
        command: &MessageId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Hands the message back for another delivery after a backoff, or says its
    /// attempts are spent.
    fn retry(&self, reason: &str) -> impl Future<Output = Result<Retried, Self::Error>> + Send;

    /// Writes the message to its dead-letter queue or stream with `reason` and `detail`,
    /// then acknowledges it.
    fn dead_letter(
        &self,
        reason: DeadReason,
        detail: &str,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Hands the message back for another delivery now: after a settling operation
    /// failed on a connection that may still be alive (a reply the broker refused to
    /// confirm), where an unsettled message would otherwise stay with this consumer
    /// until its connection closes.
    fn give_back(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// Settles the messages of one consumer type with its handler.
#[derive(Debug)]
pub(crate) struct Settler<H> {
    consumer_type: ConsumerType,
    kinds: BTreeSet<String>,
    handler: H,
    stats: Arc<ConsumerStats>,
}

impl<H: DeliveryHandler> Settler<H> {
    /// Settles `consumer_type`'s messages of `kinds` with `handler`, counting in `stats`.
    fn new(
        consumer_type: ConsumerType,
        kinds: BTreeSet<String>,
        handler: H,
        stats: Arc<ConsumerStats>,
    ) -> Self {
        Self {
            consumer_type,
            kinds,
            handler,
            stats,
        }
    }

    /// The consumer type whose messages it settles.
    pub(crate) fn consumer_type(&self) -> &ConsumerType {
        &self.consumer_type
    }

    /// The consumer's counters.
    pub(crate) fn stats(&self) -> &Arc<ConsumerStats> {
        &self.stats
    }

    /// Decodes, handles and settles one message; a failure to settle is logged and the
    /// message handed back for redelivery (the inbox absorbs it if it was applied).
    pub(crate) async fn settle<M: Received>(&self, message: M) {
        let settled = match message.decode(&self.kinds) {
            Err(malformed) => {
                self.dead_letter(&message, malformed.reason(), &malformed.to_string())
                    .await
            }
            Ok(envelope) => match message.spent() {
                Some(detail) => {
                    self.dead_letter(&message, DeadReason::RetriesExhausted, &detail)
                        .await
                }
                None => {
                    // The sender's span (its context in the envelope) is this one's
                    // parent; the handler, its reply and what it publishes run inside it.
                    let span = message.span(&envelope);
                    crate::trace::continue_from(&span, &envelope.headers);
                    self.handle(&message, envelope).instrument(span).await
                }
            },
        };
        if let Err(error) = settled {
            tracing::warn!(
                from = message.source(),
                %error,
                "message not settled; it will be redelivered"
            );
            // On a dead connection this fails too, and the broker redelivers the message
            // anyway once it sees the connection gone. The pause keeps a refusal that
            // lasts (a full reply queue) from turning into a hot loop of deliveries.
            tokio::time::sleep(GIVE_BACK_DELAY).await;
            if let Err(error) = message.give_back().await {
                tracing::debug!(from = message.source(), %error, "message not given back");
            }
        }
    }

    /// Runs the handler on a decoded message and settles it as the handler says.
    async fn handle<M: Received>(&self, message: &M, envelope: Envelope) -> Result<(), M::Error> {
        let id = envelope.id.clone();
        // A handler that panics must still settle its message: left unacknowledged, it
        // would hold one of the prefetch's slots until the connection closed. Boxed: a
        // handler's future (a guarded transaction's) runs to kilobytes, and this keeps
        // it from being copied with every future that wraps it.
        let disposition = AssertUnwindSafe(Box::pin(self.handler.handle(envelope)))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Disposition::Retry(format!(
                    "the handler panicked: {}",
                    panic_message(panic.as_ref())
                ))
            });
        match disposition {
            Disposition::Done { reply } => {
                message.reply_and_ack(reply, &id).await?;
                self.stats.acked.fetch_add(1, Relaxed);
                Ok(())
            }
            Disposition::Retry(reason) => match message.retry(&reason).await? {
                Retried::Requeued => {
                    self.stats.requeued.fetch_add(1, Relaxed);
                    Ok(())
                }
                Retried::RequeuedLast => {
                    self.stats.requeued.fetch_add(1, Relaxed);
                    crate::metrics::dead_lettered(
                        self.consumer_type.as_str(),
                        DeadReason::RetriesExhausted,
                    );
                    Ok(())
                }
                Retried::Exhausted(detail) => {
                    self.dead_letter(message, DeadReason::RetriesExhausted, &detail)
                        .await
                }
            },
            Disposition::Reject(reason) => {
                self.dead_letter(message, DeadReason::Rejected, &reason)
                    .await
            }
        }
    }

    async fn dead_letter<M: Received>(
        &self,
        message: &M,
        reason: DeadReason,
        detail: &str,
    ) -> Result<(), M::Error> {
        tracing::warn!(
            consumer_type = %self.consumer_type,
            from = message.source(),
            reason = reason.as_str(),
            detail,
            "dead-lettering a message"
        );
        message.dead_letter(reason, detail).await?;
        self.stats.dead_lettered.fetch_add(1, Relaxed);
        crate::metrics::dead_lettered(self.consumer_type.as_str(), reason);
        Ok(())
    }
}
