//! The outbox on PostgreSQL: a relay's claim locks the aggregates it takes, so relays
//! running side by side never publish one aggregate's rows out of order.

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgConnection, Postgres};

use super::{
    MARK_SENT, OutboxReader, OutboxRow, OutboxWriter, PENDING, PRUNE_SENT, count_pending,
    decode_row, insert_row, select_rows,
};
use crate::envelope::{ConsumerType, Envelope};
use crate::schema::Schema;

impl OutboxWriter for PgConnection {
    async fn publish(
        &mut self,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> Result<(), sqlx::Error> {
        self.publish_in(&Schema::default(), destination, aggregate, envelope)
            .await
    }

    async fn publish_in(
        &mut self,
        schema: &Schema,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> Result<(), sqlx::Error> {
        insert_row::<Postgres>(self, schema, destination, aggregate, envelope).await
    }
}

impl OutboxReader for PgConnection {
    async fn pending(
        &mut self,
        schema: &Schema,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        select_rows::<Postgres>(self, schema.sql(PENDING), limit).await
    }

    async fn claim(&mut self, schema: &Schema, limit: i64) -> Result<Vec<OutboxRow>, sqlx::Error> {
        claim(self, schema, limit).await
    }

    async fn pending_count(&mut self, schema: &Schema) -> Result<u64, sqlx::Error> {
        count_pending::<Postgres>(self, schema).await
    }

    async fn prune_sent(
        &mut self,
        schema: &Schema,
        before: DateTime<Utc>,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(schema.sql(PRUNE_SENT)))
            .bind(before)
            .execute(&mut *self)
            .await?;
        Ok(done.rows_affected())
    }

    async fn mark_sent(
        &mut self,
        schema: &Schema,
        seq: i64,
        now: DateTime<Utc>,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(schema.sql(MARK_SENT)))
            .bind(seq)
            .bind(now)
            .execute(&mut *self)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// The relay's claim on PostgreSQL, in two statements (see [`OutboxReader::claim`]):
/// the aggregates at the head of the queue, each locked for the transaction if no other
/// relay holds it; then, with a snapshot taken after those locks, the pending rows of
/// the locked aggregates in order. Taking the locks first matters: a lock tried row by
/// row inside one scan could fail on an aggregate's early rows (another relay was
/// sending them) and succeed on its later ones once that relay committed, publishing
/// them ahead of the rows it skipped. The lock's class (first key) keeps it apart from
/// the inbox's claim locks.
const LOCK_HEAD_AGGREGATES: &str = "SELECT aggregate FROM ( \
        SELECT DISTINCT aggregate FROM ( \
            SELECT aggregate FROM {schema}.sagabox_outbox WHERE sent_at IS NULL ORDER BY seq LIMIT $1 \
        ) head \
    ) candidates \
    WHERE pg_try_advisory_xact_lock(1398892386, hashtext(aggregate))";
const PENDING_OF_AGGREGATES: &str = "SELECT seq, id, aggregate, destination, kind, saga_id, payload, headers, created_at \
    FROM {schema}.sagabox_outbox WHERE sent_at IS NULL AND aggregate = ANY($2) ORDER BY seq LIMIT $1 FOR UPDATE";

async fn claim(
    conn: &mut PgConnection,
    schema: &Schema,
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let aggregates: Vec<String> =
        sqlx::query_scalar(AssertSqlSafe(schema.sql(LOCK_HEAD_AGGREGATES)))
            .bind(limit)
            .fetch_all(&mut *conn)
            .await?;
    if aggregates.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(AssertSqlSafe(schema.sql(PENDING_OF_AGGREGATES)))
        .bind(limit)
        .bind(aggregates)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(decode_row).collect()
}
