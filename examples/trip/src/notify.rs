//! The notification participant: `send_itinerary` records the itinerary sent, in
//! `notifications` (append-only). A message cannot be unsent, so the step has no
//! compensation and is the saga's last.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};

use crate::Trip;
use crate::booking::{self, retryable};
use crate::schema::TripDb;

/// The consumer type the notify step deduplicates as.
pub const CONSUMER: &str = "notify";
/// The command that sends the itinerary.
pub const SEND: &str = "send_itinerary";

const INSERT: &str = "INSERT INTO notifications (trip_id, seq) VALUES ($1, $2)";

/// Sends a [`Trip`]'s itinerary (records it as sent). Answers `{"seq": n}`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Notify;

impl<Db: TripDb> StepHandler<Db> for Notify {
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let trip = Trip::of(envelope)?;
        if envelope.kind != SEND {
            return Err(booking::unknown(CONSUMER, &envelope.kind));
        }
        let seq = Db::next_seq(conn).await.map_err(retryable)?;
        Db::write(conn, INSERT, &trip.trip_id, seq)
            .await
            .map_err(retryable)?;
        Ok(json!({ "seq": seq }))
    }
}
