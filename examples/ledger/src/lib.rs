//! The ledger's step handlers.

use sagabox::outbox::OutboxWriter;
use sagabox::step::{StepError, StepHandler};
use sagabox::{ConsumerType, Envelope};
use serde_json::{Value, json};
use sqlx::{PgConnection, Postgres};

/// `credit {account, cents}`: one ledger entry, and a `credited` message for the
/// notifier, both in the inbox guard's transaction.
pub struct Credit;

impl StepHandler<Postgres> for Credit {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let (Some(account), Some(cents)) = (
            envelope.payload["account"].as_str(),
            envelope.payload["cents"].as_i64(),
        ) else {
            // Recorded as the answer; a redelivery gets the same refusal.
            return Err(StepError::Permanent(
                "credit needs account and cents".into(),
            ));
        };
        let retry = |error: sqlx::Error| StepError::Retryable(error.to_string());
        sqlx::query("INSERT INTO ledger_entries (account, cents) VALUES ($1, $2)")
            .bind(account)
            .bind(cents)
            .execute(&mut *conn)
            .await
            .map_err(retry)?;
        let credited =
            PgConnection::message("credited", json!({"account": account, "cents": cents}))
                .map_err(|error| StepError::Permanent(error.to_string()))?;
        let notify =
            ConsumerType::new("notify").map_err(|error| StepError::Permanent(error.to_string()))?;
        conn.publish(&notify, account, &credited)
            .await
            .map_err(retry)?;
        Ok(json!({"credited": cents}))
    }
}
