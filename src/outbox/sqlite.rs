//! The outbox on SQLite: one writer at a time, so a relay's claim is the pending rows.

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Sqlite, SqliteConnection};

use super::{
    MARK_SENT, OutboxReader, OutboxRow, OutboxWriter, PENDING, PRUNE_SENT, count_pending,
    insert_row, select_rows,
};
use crate::envelope::{ConsumerType, Envelope};
use crate::schema::Schema;

impl OutboxWriter for SqliteConnection {
    async fn publish(
        &mut self,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> Result<(), sqlx::Error> {
        self.publish_in(&Schema::sqlite(), destination, aggregate, envelope)
            .await
    }

    async fn publish_in(
        &mut self,
        schema: &Schema,
        destination: &ConsumerType,
        aggregate: &str,
        envelope: &Envelope,
    ) -> Result<(), sqlx::Error> {
        insert_row::<Sqlite>(self, schema, destination, aggregate, envelope).await
    }
}

impl OutboxReader for SqliteConnection {
    async fn pending(
        &mut self,
        schema: &Schema,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        select_rows::<Sqlite>(self, schema.sql(PENDING), limit).await
    }

    async fn claim(&mut self, schema: &Schema, limit: i64) -> Result<Vec<OutboxRow>, sqlx::Error> {
        self.pending(schema, limit).await
    }

    async fn pending_count(&mut self, schema: &Schema) -> Result<u64, sqlx::Error> {
        count_pending::<Sqlite>(self, schema).await
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
