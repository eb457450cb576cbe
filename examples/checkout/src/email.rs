//! The email participant: `send_confirmation`, recorded in `emails_sent` (one row per
//! email sent: the inbox is what keeps a customer from getting two).

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};
use sqlx::{Encode, Executor, IntoArguments, Type};

use crate::order::{self, OrderDb, retryable};

/// The consumer type the email step deduplicates as, and its queue's suffix.
pub const CONSUMER: &str = "email";
/// The command that sends the order's confirmation.
pub const SEND_CONFIRMATION: &str = "send_confirmation";

/// Sends confirmations (here: records them). Answers `{"email": "confirmation"}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Email;

impl<DB: OrderDb> StepHandler<DB> for Email
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let order_id = order::lock::<DB>(conn, envelope).await?;
        match envelope.kind.as_str() {
            SEND_CONFIRMATION => {
                sqlx::query(
                    "INSERT INTO emails_sent (order_id, template) VALUES ($1, 'confirmation')",
                )
                .bind(order_id.as_str())
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({ "email": "confirmation" }))
            }
            other => Err(order::unknown(CONSUMER, other)),
        }
    }
}
