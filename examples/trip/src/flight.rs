//! The flight participant: `book_flight` books, `cancel_flight` cancels, in `flight_bookings`.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::Value;

use crate::Trip;
use crate::booking;
use crate::schema::TripDb;

/// The consumer type the flight step deduplicates as.
pub const CONSUMER: &str = "flight";
/// The command that books.
pub const BOOK: &str = "book_flight";
/// The compensation that cancels.
pub const CANCEL: &str = "cancel_flight";

const INSERT: &str =
    "INSERT INTO flight_bookings (trip_id, status, booked_seq) VALUES ($1, 'booked', $2)";
const UPDATE: &str = "UPDATE flight_bookings SET status = 'cancelled', cancel_seq = $2, \
    cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1";

/// Books and cancels the flight booking of a [`Trip`]. Answers `{"seq": n}` to a booking and
/// `{"cancelled": bool, "seq": n}` to a cancellation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flight;

impl<Db: TripDb> StepHandler<Db> for Flight {
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let trip = Trip::of(envelope)?;
        match envelope.kind.as_str() {
            BOOK => booking::book::<Db>(conn, INSERT, &trip).await,
            CANCEL => booking::cancel::<Db>(conn, UPDATE, &trip).await,
            other => Err(booking::unknown(CONSUMER, other)),
        }
    }
}
