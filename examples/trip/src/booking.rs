//! The three booking participants — flight, hotel and car — as one handler over their
//! own names and tables ([`Booking`]): book inserts a row; cancel marks it, counts the
//! cancellation and takes a new place in the shared sequence; each a single statement
//! in the guard's transaction. The car refuses a trip with no car available
//! ([`Trip::car_available`] `false`) for good, before anything is written: the saga
//! then cancels the hotel and the flight.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::{Value, json};

use crate::Trip;
use crate::schema::TripDb;

/// A booking participant: its consumer type, the command that books and the
/// compensation that cancels, the statement of each (`$1` trip, `$2` seq), and what it
/// refuses for good. Answers `{"seq": n}` to a booking and `{"cancelled": bool, "seq": n}`
/// to a cancellation.
#[derive(Debug, Clone, Copy)]
pub struct Booking {
    /// The consumer type the step deduplicates as.
    pub consumer: &'static str,
    /// The command that books.
    pub book: &'static str,
    /// The compensation that cancels.
    pub cancel: &'static str,
    insert: &'static str,
    update: &'static str,
    /// Why a trip cannot be booked at all, if it cannot.
    refuses: fn(&Trip) -> Option<String>,
}

/// The flight participant: `book_flight` books, `cancel_flight` cancels, in
/// `flight_bookings`.
pub const FLIGHT: Booking = Booking {
    consumer: "flight",
    book: "book_flight",
    cancel: "cancel_flight",
    insert: "INSERT INTO flight_bookings (trip_id, status, booked_seq) VALUES ($1, 'booked', $2)",
    update: "UPDATE flight_bookings SET status = 'cancelled', cancel_seq = $2, \
        cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1",
    refuses: |_| None,
};

/// The hotel participant: `book_hotel` books, `cancel_hotel` cancels, in
/// `hotel_bookings`.
pub const HOTEL: Booking = Booking {
    consumer: "hotel",
    book: "book_hotel",
    cancel: "cancel_hotel",
    insert: "INSERT INTO hotel_bookings (trip_id, status, booked_seq) VALUES ($1, 'booked', $2)",
    update: "UPDATE hotel_bookings SET status = 'cancelled', cancel_seq = $2, \
        cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1",
    refuses: |_| None,
};

/// The car rental participant: `rent_car` rents, `return_car` returns, in
/// `car_rentals`; a trip with no car available is refused.
pub const CAR: Booking = Booking {
    consumer: "car",
    book: "rent_car",
    cancel: "return_car",
    insert: "INSERT INTO car_rentals (trip_id, status, booked_seq) VALUES ($1, 'rented', $2)",
    update: "UPDATE car_rentals SET status = 'returned', cancel_seq = $2, \
        cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1",
    refuses: |trip| {
        (!trip.car_available).then(|| {
            format!(
                "no car available for trip {} to {}",
                trip.trip_id, trip.destination
            )
        })
    },
};

impl<Db: TripDb> StepHandler<Db> for Booking {
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let trip = Trip::of(envelope)?;
        match envelope.kind.as_str() {
            kind if kind == self.book => match (self.refuses)(&trip) {
                Some(reason) => Err(StepError::Permanent(reason)),
                None => book::<Db>(conn, self.insert, &trip).await,
            },
            kind if kind == self.cancel => cancel::<Db>(conn, self.update, &trip).await,
            other => Err(unknown(self.consumer, other)),
        }
    }
}

/// A database failure is transient as far as the step knows: the transaction rolls
/// back, nothing is recorded, and the orchestrator sends the command again.
pub(crate) fn retryable(error: sqlx::Error) -> StepError {
    StepError::Retryable(error.to_string())
}

/// Inserts the booking with `insert` (`$1` trip, `$2` seq).
async fn book<Db: TripDb>(
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
async fn cancel<Db: TripDb>(
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
