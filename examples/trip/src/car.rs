//! The car rental participant: `rent_car` rents, `return_car` returns, in `car_rentals`.
//! A trip with no car available ([`Trip::car_available`] `false`) is refused for good,
//! before anything is written: the saga then cancels the hotel and the flight.

use sagabox::Envelope;
use sagabox::step::{StepError, StepHandler};
use serde_json::Value;

use crate::Trip;
use crate::booking;
use crate::schema::TripDb;

/// The consumer type the car step deduplicates as.
pub const CONSUMER: &str = "car";
/// The command that rents.
pub const RENT: &str = "rent_car";
/// The compensation that returns the car.
pub const RETURN: &str = "return_car";

const INSERT: &str =
    "INSERT INTO car_rentals (trip_id, status, booked_seq) VALUES ($1, 'rented', $2)";
const UPDATE: &str = "UPDATE car_rentals SET status = 'returned', cancel_seq = $2, \
    cancelled_at = CURRENT_TIMESTAMP, cancellations = cancellations + 1 WHERE trip_id = $1";

/// Rents and returns the car of a [`Trip`]. Answers `{"seq": n}` to a rental and
/// `{"cancelled": bool, "seq": n}` to a return; refuses a trip with no car available.
#[derive(Debug, Clone, Copy, Default)]
pub struct Car;

impl<Db: TripDb> StepHandler<Db> for Car {
    async fn handle(
        &self,
        conn: &mut Db::Connection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let trip = Trip::of(envelope)?;
        match envelope.kind.as_str() {
            RENT if !trip.car_available => Err(StepError::Permanent(format!(
                "no car available for trip {} to {}",
                trip.trip_id, trip.destination
            ))),
            RENT => booking::book::<Db>(conn, INSERT, &trip).await,
            RETURN => booking::cancel::<Db>(conn, UPDATE, &trip).await,
            other => Err(booking::unknown(CONSUMER, other)),
        }
    }
}
