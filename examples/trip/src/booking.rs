//! What the three booking participants share: book (insert a row) and cancel (mark it,
//! count the cancellation, take a new place in the shared sequence), each a single
//! statement in the guard's transaction.

use sagabox::step::StepError;
use serde_json::{Value, json};

use crate::Trip;
use crate::schema::TripDb;

/// A database failure is transient as far as the step knows: the transaction rolls
/// back, nothing is recorded, and the orchestrator sends the command again.
pub(crate) fn retryable(error: sqlx::Error) -> StepError {
    StepError::Retryable(error.to_string())
}

/// Inserts the booking with `insert` (`$1` trip, `$2` seq).
pub(crate) async fn book<Db: TripDb>(
    conn: &mut Db::Connection,
    insert: &'static str,
    trip: &Trip,
) -> Result<Value, StepError> {
    let seq = Db::next_seq(conn).await.map_err(retryable)?;
    Db::write(conn, insert, &trip.trip_id, seq)
        .await
        .map_err(retryable)?;
    Ok(json!({ "seq": seq }))
}

/// Cancels the trip's booking with `update` (`$1` trip, `$2` seq). A trip with no
/// booking (its step ran out of attempts before it ever applied) has nothing to cancel:
/// that is a success too, or the saga could never finish compensating.
pub(crate) async fn cancel<Db: TripDb>(
    conn: &mut Db::Connection,
    update: &'static str,
    trip: &Trip,
) -> Result<Value, StepError> {
    let seq = Db::next_seq(conn).await.map_err(retryable)?;
    let cancelled = Db::write(conn, update, &trip.trip_id, seq)
        .await
        .map_err(retryable)?;
    Ok(json!({ "cancelled": cancelled > 0, "seq": seq }))
}

/// The refusal of a command kind the participant does not handle: sending it again
/// cannot help.
pub(crate) fn unknown(participant: &str, kind: &str) -> StepError {
    StepError::Permanent(format!(
        "the {participant} participant does not handle `{kind}`"
    ))
}
