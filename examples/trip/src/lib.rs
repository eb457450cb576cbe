//! # sagabox-trip
//!
//! The **trip** saga, a second example of another shape than checkout, written against
//! sagabox's public API only: four participants, three of them with a compensation.
//!
//! ```text
//! book_flight ──▶ book_hotel ──▶ rent_car ──▶ send_itinerary
//!      ▲               ▲              ▲
//! cancel_flight   cancel_hotel    return_car      (run in reverse when a later step fails for good)
//! ```
//!
//! The saga is data (`sagas/trip.toml`, embedded as [`DEFINITION`]). Each participant is
//! a [`StepHandler`](sagabox::step::StepHandler) written once for PostgreSQL and SQLite
//! ([`TripDb`]) and writing to its own table ([`schema`]); the inbox guard around it makes
//! every command apply once, although the tables themselves would take a duplicate.
//! A trip whose [`Trip::car_available`] is `false` is refused by the car rental for good:
//! the saga cancels the hotel, then the flight, and never sends the itinerary.
//! The tests wrap the orchestrator's dispatch in sagabox's
//! [`FaultyDispatch`](sagabox::testing::FaultyDispatch) to duplicate commands and drop
//! replies.
//!
//! A trip starts from a start message ([`Trip::start_message`]): the same message,
//! delivered again, starts no second trip
//! ([`SagaInstance::from_start`](sagabox::saga::SagaInstance::from_start)).
//!
//! # Layout
//!
//! - [`FLIGHT`], [`HOTEL`], [`CAR`]: the booking participants, one [`Booking`] handler
//!   over each one's names and table; [`notify`]: the itinerary's.
//! - [`schema`]: their tables per database, and [`TripDb`].
//!
//! The tests (`cargo test -p sagabox-trip`) run trips through the in-process
//! orchestrator on SQLite and PostgreSQL and check every outcome by SQL.

mod booking;
pub mod notify;
pub mod schema;

use sagabox::Participant;
use sagabox::orchestrator::InProcess;
use sagabox::saga::{DefinitionError, SagaDefinition};
use sagabox::step::{StepError, StepPool, StepPoolConfig};
use sagabox::{ConsumerType, Envelope, InboxGuard, InboxStore, KeyError, MessageId};
use serde::{Deserialize, Serialize};

pub use booking::{Booking, CAR, FLIGHT, HOTEL};
pub use notify::Notify;
pub use schema::TripDb;

/// The saga's definition, `sagas/trip.toml`, embedded at build time.
pub const DEFINITION: &str = include_str!("../../../sagas/trip.toml");

/// The saga's name: also the kind of its start messages.
pub const SAGA: &str = "trip";

/// The trip saga, parsed and validated from [`DEFINITION`].
pub fn definition() -> Result<SagaDefinition, DefinitionError> {
    SagaDefinition::from_toml_str(DEFINITION)
}

/// A trip: the saga's data, carried as the payload of every command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trip {
    /// The trip's id; the participants' tables are keyed by it.
    pub trip_id: String,
    /// Who travels.
    pub traveller: String,
    /// Where to.
    pub destination: String,
    /// Whether the rental desk has a car for this trip. `false` makes [`CAR`] refuse for
    /// good, so the saga compensates. Defaults to `true`.
    #[serde(default = "available")]
    pub car_available: bool,
}

fn available() -> bool {
    true
}

impl Trip {
    /// A trip with a car available.
    pub fn new(
        trip_id: impl Into<String>,
        traveller: impl Into<String>,
        destination: impl Into<String>,
    ) -> Self {
        Self {
            trip_id: trip_id.into(),
            traveller: traveller.into(),
            destination: destination.into(),
            car_available: true,
        }
    }

    /// The same trip with no car to rent: the car step refuses it for good.
    pub fn without_car(mut self) -> Self {
        self.car_available = false;
        self
    }

    /// The message that starts this trip's saga: kind [`SAGA`], the trip as payload, and
    /// `request_id` as its id — the same id on every resend, so that a resent request
    /// finds the saga the first one started.
    pub fn start_message(&self, request_id: MessageId) -> Result<Envelope, KeyError> {
        // A struct of strings and a bool always serialises.
        let payload = serde_json::to_value(self).unwrap_or_default();
        Envelope::new(request_id, SAGA, payload)
    }

    /// The trip a command carries (the saga's data, which also holds the steps' results:
    /// ignored here). A payload that is not a trip is refused for good: sending it again
    /// cannot help.
    pub fn of(envelope: &Envelope) -> Result<Self, StepError> {
        Self::deserialize(&envelope.payload).map_err(|error| {
            StepError::Permanent(format!(
                "the payload of {} {} is not a trip: {error}",
                envelope.kind, envelope.id
            ))
        })
    }
}

/// Why the participants could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParticipantsError {
    /// A step's consumer type is not a valid key.
    #[error("invalid consumer type for the {step} step: {source}")]
    ConsumerType {
        /// The step.
        step: &'static str,
        /// What is wrong with it.
        #[source]
        source: KeyError,
    },
    /// A step pool's actors did not start.
    #[error("cannot start the {step} step pool: {source}")]
    Spawn {
        /// The step.
        step: &'static str,
        /// Why ractor refused.
        #[source]
        source: ractor::SpawnErr,
    },
}

/// Starts the four participants, each a [`StepPool`] of `workers` competing workers
/// behind its own clone of `guard`, and returns them as the orchestrator's in-process
/// dispatch.
pub async fn participants<S>(
    guard: &InboxGuard<S>,
    workers: usize,
) -> Result<InProcess, ParticipantsError>
where
    S: InboxStore,
    S::Db: TripDb,
{
    let pools = step_pools(guard, workers).await?;
    Ok(pools
        .into_iter()
        .fold(InProcess::new(), InProcess::with_pool))
}

/// The four participants on the [`Participant`] runtime, behind `broker` (an
/// [`AmqpConfig`](sagabox::amqp::AmqpConfig), a NATS config or a
/// [`Transport`](sagabox::transport::Transport)):
/// each consumes `<prefix>.<consumer_type>` (flight, hotel, car, notify) through the
/// inbox of `store`. Add the relay, the pruner or the metrics endpoint before starting it.
pub fn participant<S>(store: S, broker: impl Into<sagabox::transport::Transport>) -> Participant<S>
where
    S: InboxStore + Clone,
    S::Db: TripDb,
{
    Participant::new(store, broker)
        .step(FLIGHT.consumer, FLIGHT)
        .step(HOTEL.consumer, HOTEL)
        .step(CAR.consumer, CAR)
        .step(notify::CONSUMER, Notify)
}

/// The four participants' step pools (flight, hotel, car, notify), each of `workers`
/// competing workers behind its own clone of `guard`: to put behind a broker's queues,
/// or into an [`InProcess`] dispatch ([`participants`]).
pub async fn step_pools<S>(
    guard: &InboxGuard<S>,
    workers: usize,
) -> Result<Vec<StepPool>, ParticipantsError>
where
    S: InboxStore,
    S::Db: TripDb,
{
    let config = StepPoolConfig { workers };
    Ok(vec![
        spawn(guard, FLIGHT.consumer, FLIGHT, &config).await?,
        spawn(guard, HOTEL.consumer, HOTEL, &config).await?,
        spawn(guard, CAR.consumer, CAR, &config).await?,
        spawn(guard, notify::CONSUMER, Notify, &config).await?,
    ])
}

async fn spawn<S, H>(
    guard: &InboxGuard<S>,
    step: &'static str,
    handler: H,
    config: &StepPoolConfig,
) -> Result<StepPool, ParticipantsError>
where
    S: InboxStore,
    H: sagabox::step::StepHandler<S::Db>,
{
    let consumer_type = ConsumerType::new(step)
        .map_err(|source| ParticipantsError::ConsumerType { step, source })?;
    StepPool::spawn(guard.clone(), consumer_type, handler, config.clone())
        .await
        .map_err(|source| ParticipantsError::Spawn { step, source })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_definition_has_the_four_steps_and_three_compensations() {
        let saga = definition().unwrap();
        assert_eq!(saga.to_string(), "trip: flight → hotel → car → notify");
        let consumers: Vec<_> = saga
            .steps()
            .iter()
            .map(|step| step.consumer_type().as_str())
            .collect();
        assert_eq!(
            consumers,
            [
                FLIGHT.consumer,
                HOTEL.consumer,
                CAR.consumer,
                notify::CONSUMER
            ]
        );
        let compensations: Vec<_> = saga.steps().iter().map(|s| s.compensation()).collect();
        assert_eq!(
            compensations,
            [
                Some(FLIGHT.cancel),
                Some(HOTEL.cancel),
                Some(CAR.cancel),
                None
            ]
        );
        let commands: Vec<_> = saga.steps().iter().map(|s| s.command()).collect();
        assert_eq!(commands, [FLIGHT.book, HOTEL.book, CAR.book, notify::SEND]);
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../sagas/trip.toml");
        assert_eq!(SagaDefinition::load(path).unwrap(), saga);
    }

    #[test]
    fn a_trip_round_trips_through_its_start_message() {
        let trip = Trip::new("t-1", "Ada", "Lisbon").without_car();
        let start = trip
            .start_message(MessageId::new("request-1").unwrap())
            .unwrap();
        assert_eq!(start.kind, SAGA);
        assert_eq!(Trip::of(&start).unwrap(), trip);
        let bare = Envelope::new(
            MessageId::new("m").unwrap(),
            FLIGHT.book,
            serde_json::json!({"trip_id": "t-2", "traveller": "Bo", "destination": "Oslo", "steps": {}}),
        )
        .unwrap();
        assert!(Trip::of(&bare).unwrap().car_available, "defaults to a car");
        let bad = Envelope::new(
            MessageId::new("m").unwrap(),
            FLIGHT.book,
            serde_json::json!(7),
        )
        .unwrap();
        assert!(matches!(Trip::of(&bad), Err(StepError::Permanent(_))));
    }
}
