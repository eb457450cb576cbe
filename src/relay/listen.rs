//! Waking the relay when outbox rows commit, instead of at its next poll.
//!
//! On PostgreSQL a trigger on the outbox (migration `outbox_notify`) queues a `NOTIFY`
//! on the table's own channel, which the server delivers when the writing transaction
//! commits. The relay's listener holds one connection of its own (not one of the
//! store's pool) with `LISTEN` on that channel and wakes the relay on each
//! notification. A notification can be missed — the listener's connection drops, or
//! the database predates the trigger — so the listener also wakes the relay each time
//! it starts listening, and the relay keeps its poll: a missed wake costs latency,
//! never a row.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ractor::ActorRef;

use super::RelayMessage;

/// Wakes a relay: sends it one [`RelayMessage::Wake`], and no other until the relay has
/// taken that one, so a burst of commits queues one pass, not one per commit.
#[derive(Debug, Clone)]
pub struct RelayWaker {
    relay: ActorRef<RelayMessage>,
    pending: Arc<AtomicBool>,
}

impl RelayWaker {
    pub(super) fn new(relay: ActorRef<RelayMessage>) -> Self {
        Self {
            relay,
            pending: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Asks the relay for a pass, unless one is already asked for.
    pub fn wake(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            // A stopped relay has nothing left to wake.
            let _ = self.relay.cast(RelayMessage::Wake);
        }
    }

    /// The relay took the wake: a commit from now on asks for another pass.
    pub(super) fn taken(&self) {
        self.pending.store(false, Ordering::Release);
    }
}

#[cfg(feature = "postgres")]
pub(crate) use self::postgres::listen;

#[cfg(feature = "postgres")]
mod postgres {
    use std::time::Duration;

    use sqlx::postgres::{PgListener, PgPoolOptions};

    use super::RelayWaker;
    use crate::schema::Schema;

    /// Starts the listener of `pool`'s outbox in `schema`: a task that wakes the relay
    /// through `waker` on each commit to the outbox, and each time it (re)starts
    /// listening; it retries a lost connection with backoff and ends when the database
    /// has no outbox to listen to. The relay aborts it when it stops.
    pub(crate) fn listen(
        pool: &sqlx::PgPool,
        schema: Schema,
        waker: RelayWaker,
    ) -> tokio::task::JoinHandle<()> {
        // One connection of its own, with the store's options (TLS, search path): the
        // listen holds it for as long as the relay runs.
        let own = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with((*pool.connect_options()).clone());
        tokio::spawn(async move {
            let mut failures = 0;
            loop {
                match session(&own, &schema, &waker).await {
                    Ok(Ended::NoOutbox) => {
                        tracing::warn!(%schema, "no outbox table to listen to: the relay polls only");
                        return;
                    }
                    Err(error) => {
                        let wait = crate::backoff::doubling(
                            Duration::from_millis(100),
                            failures,
                            Duration::from_secs(5),
                        );
                        failures = failures.saturating_add(1);
                        tracing::warn!(%error, retry_in = ?wait, "outbox listener failed; the relay polls meanwhile");
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        })
    }

    /// Why a listening session ended without an error.
    enum Ended {
        /// The schema has no outbox table (not migrated).
        NoOutbox,
    }

    /// Listens until the connection fails: resolves the channel, `LISTEN`s, wakes the
    /// relay once for the rows committed before, then once per notification.
    async fn session(
        own: &sqlx::PgPool,
        schema: &Schema,
        waker: &RelayWaker,
    ) -> Result<Ended, sqlx::Error> {
        let channel: Option<String> =
            sqlx::query_scalar("SELECT 'sagabox_outbox_' || to_regclass($1)::oid::text")
                .bind(schema.table("sagabox_outbox"))
                .fetch_one(own)
                .await?;
        let Some(channel) = channel else {
            return Ok(Ended::NoOutbox);
        };
        let mut listener = PgListener::connect_with(own).await?;
        listener.listen(&channel).await?;
        waker.wake();
        loop {
            // A notification, or `None`: the connection was lost and made again,
            // listening again, and what committed in between woke nobody. A pass is due
            // either way.
            listener.try_recv().await?;
            waker.wake();
        }
    }
}
