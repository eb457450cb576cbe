//! The `handwritten` mode's consumer, the same loop on either broker: deliveries taken
//! from the broker client's stream, up to `--workers` at once, each through the SQL a
//! team writes by hand (`INSERT … ON CONFLICT DO NOTHING` into an inbox table, the
//! business statements if the insert was fresh, `COMMIT`) and then acked. A broker
//! brings only how its delivery gives its id, its body and its ack ([`HandDelivery`]).
//! Beside it, the `consumer` mode's handle ([`Direct`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_lite::{Stream, StreamExt};
use sagabox::consumer::ConsumerHandle;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

use super::{MODES, RAW_CLAIM, Running, business, fields};
use crate::bench::BoxError;

/// One delivery of the broker's client, as the hand-written consumer reads it.
pub(super) trait HandDelivery: Send + Sync + 'static {
    /// The message id, where the publisher put it.
    fn id(&self) -> Option<String>;
    /// The body: the envelope's JSON.
    fn body(&self) -> &[u8];
    /// Acknowledges the delivery.
    fn ack(self) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// The hand-written consumer running: its task and the count of its acks.
pub(super) struct Handwritten {
    acked: Arc<AtomicU64>,
    task: JoinHandle<Result<(), BoxError>>,
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
    /// Consumes `deliveries` on `pool`, `workers` at once.
    pub(super) fn spawn<S, D, E>(mut deliveries: S, pool: PgPool, workers: usize) -> Self
    where
        S: Stream<Item = Result<D, E>> + Send + Unpin + 'static,
        D: HandDelivery,
        E: std::error::Error + Send + Sync + 'static,
    {
        let acked = Arc::new(AtomicU64::new(0));
        let workers = Arc::new(Semaphore::new(workers));
        let task = tokio::spawn({
            let acked = acked.clone();
            async move {
                let mut running = JoinSet::new();
                while let Some(delivery) = deliveries.next().await {
                    let delivery = delivery?;
                    let permit = workers.clone().acquire_owned().await?;
                    let (pool, acked) = (pool.clone(), acked.clone());
                    running.spawn(async move {
                        apply(&pool, &delivery).await?;
                        delivery.ack().await?;
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
        Self { acked, task }
    }

    /// Stops consuming; what was not acked goes back to the broker.
    pub(super) fn stop(self) {
        self.task.abort();
    }
}

/// The claim and, if it was fresh, the business statements, in one transaction.
async fn apply(pool: &PgPool, delivery: &impl HandDelivery) -> Result<(), BoxError> {
    let id = delivery.id().ok_or("a delivery without its message id")?;
    let body: serde_json::Value = serde_json::from_slice(delivery.body())?;
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
    Ok(())
}

/// The `consumer` mode: sagabox's consumer for the broker calling the guard itself.
pub(super) struct Direct(pub(super) ConsumerHandle);

impl Running for Direct {
    fn acked(&self) -> u64 {
        self.0.stats().acked.load(Ordering::Relaxed)
    }

    async fn failure(&mut self) -> Option<BoxError> {
        self.0.is_finished().then(|| "the consumer ended".into())
    }
}
