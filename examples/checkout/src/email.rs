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

    /// A batch of confirmations with two statements, whatever its size: the orders
    /// locked, every email inserted. A batch holding anything else goes one by one.
    async fn handle_batch(
        &self,
        conn: &mut DB::Connection,
        envelopes: &[&Envelope],
    ) -> Option<Vec<Result<Value, StepError>>> {
        order::as_set(
            envelopes,
            SEND_CONFIRMATION,
            send_all::<DB>(conn, envelopes),
        )
        .await
    }
}

/// Sends a batch's confirmations as [`Email::handle`] sends each.
async fn send_all<DB: OrderDb>(
    conn: &mut DB::Connection,
    envelopes: &[&Envelope],
) -> Result<Vec<Result<Value, StepError>>, StepError>
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    let order_ids = order::order_ids(envelopes);
    order::lock_all::<DB>(conn, &order_ids).await?;
    let mut emails = Vec::new();
    let answers = order_ids
        .into_iter()
        .map(|order_id| {
            emails.push(json!({ "order_id": order_id? }));
            Ok(json!({ "email": "confirmation" }))
        })
        .collect();
    let insert = format!(
        "INSERT INTO emails_sent (order_id, template) SELECT x.order_id, 'confirmation' FROM {}",
        DB::json_rows(&[("order_id", "text")])
    );
    order::execute_rows::<DB>(conn, insert, emails).await?;
    Ok(answers)
}
