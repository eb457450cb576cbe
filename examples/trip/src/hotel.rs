//! The hotel participant: `book_hotel` books, `cancel_hotel` cancels, in `hotel_bookings`.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::Value;

use crate::Trip;
use crate::booking;
use crate::schema::TripDb;

/// The consumer type the hotel step deduplicates as.
pub const CONSUMER: &str = "hotel";
/// The command that books.
pub const BOOK: &str = "book_hotel";
/// The compensation that cancels.
pub const CANCEL: &str = "cancel_hotel";

const INSERT: &str =
    "INSERT INTO hotel_bookings (trip_id, status, booked_seq) VALUES ($1, 'booked', $2)";
const UPDATE: &str = "UPDATE hotel_bookings SET status = 'cancelled', cancel_seq = $2, \
    cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1";

/// Books and cancels the hotel booking of a [`Trip`]. Answers `{"seq": n}` to a booking and
/// `{"cancelled": bool, "seq": n}` to a cancellation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hotel;

impl<Db: TripDb> StepHandler<Db> for Hotel {
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
