//! The trip saga through the in-process orchestrator, on SQLite and a real PostgreSQL
//! (a fresh database per test): a car that fails for good, a happy path, and many trips
//! under duplicated commands, lost replies and duplicated start requests. Every check
//! reads the participants' own tables, `sagabox_saga_instances` and the inbox by SQL.

#![allow(clippy::unwrap_used)]

#[path = "../../../tests/common/mod.rs"]
mod common;
mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{Lite, Pg};
use ractor::{Actor, ActorRef};
use sagabox::orchestrator::{
    DriveStats, InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage,
};
use sagabox::saga::{SagaStatus, SagaStore};
use sagabox::testing::FaultyDispatch;
use sagabox::{InboxConfig, InboxGuard, MessageId};
use sagabox_trip::Trip;
use support::Backend;

/// Trips in the run with faults; every fourth has no car.
const TRIPS: usize = 120;

/// A running trip service: the four participants behind [`FaultyDispatch`], an orchestrator.
struct Service<B: Backend> {
    orchestrator: ActorRef<OrchestratorMessage>,
    faults: Arc<FaultyDispatch<InProcess>>,
    store: B::Store,
    stats: Arc<DriveStats>,
}

impl<B: Backend> Service<B> {
    async fn start(fx: &B, duplicate_rate: f64, lost_reply_rate: f64, seed: u64) -> Self {
        let guard = InboxGuard::new(fx.store(4).await, InboxConfig::default()).unwrap();
        let participants = sagabox_trip::participants(&guard, 3).await.unwrap();
        let faults = Arc::new(
            FaultyDispatch::new(participants, duplicate_rate, lost_reply_rate, seed).unwrap(),
        );
        let store = fx.store(4).await;
        let stats = Arc::new(DriveStats::default());
        let (orchestrator, _) = Actor::spawn(
            None,
            Orchestrator::new(),
            OrchestratorArguments::new(
                Arc::new(sagabox_trip::definition().unwrap()),
                store.clone(),
                Arc::clone(&faults),
            )
            .with_stats(Arc::clone(&stats)),
        )
        .await
        .unwrap();
        Self {
            orchestrator,
            faults,
            store,
            stats,
        }
    }

    /// Sends the start request of `trip` (`times` times, the same request) and returns
    /// the saga id every answer named.
    async fn book(&self, trip: &Trip, times: usize) -> String {
        let request = trip.start_message(MessageId::new_v7()).unwrap();
        let mut ids = Vec::new();
        for _ in 0..times {
            let id = ractor::call_t!(
                self.orchestrator,
                OrchestratorMessage::Start,
                30_000,
                request.clone()
            )
            .unwrap()
            .unwrap();
            ids.push(id);
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "one saga per start request: {ids:?}");
        ids.remove(0)
    }

    async fn wait_idle(&self) {
        ractor::call_t!(self.orchestrator, OrchestratorMessage::WhenIdle, 120_000)
            .expect("every trip finished in time");
    }

    async fn stop(self) {
        self.orchestrator.stop(None);
    }
}

/// `(what, query)`: each query counts the rows that break `what`. The same SQL on both
/// databases (`->>` reads the saga's JSON data on PostgreSQL and on SQLite ≥ 3.38).
const INVARIANTS: [(&str, &str); 10] = [
    (
        "saga neither completed nor compensated",
        "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')",
    ),
    (
        "trip with more than one saga",
        "SELECT COUNT(*) FROM (SELECT data->>'trip_id' FROM sagabox_saga_instances GROUP BY data->>'trip_id' HAVING COUNT(*) > 1) d",
    ),
    (
        "trip without a car compensated, or with one not completed",
        "SELECT COUNT(*) FROM sagabox_saga_instances WHERE \
         (status = 'compensated') <> (data->>'trip_id' LIKE '%-nocar')",
    ),
    (
        "completed trip without exactly one flight, hotel, car and notification, all kept",
        "SELECT COUNT(*) FROM sagabox_saga_instances s WHERE s.status = 'completed' AND ( \
         (SELECT COUNT(*) FROM flight_bookings b WHERE b.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM hotel_bookings b WHERE b.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM car_rentals b WHERE b.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM notifications n WHERE n.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM flight_bookings b WHERE b.trip_id = s.data->>'trip_id' AND (b.status <> 'booked' OR b.cancellations <> 0)) <> 0 OR \
         (SELECT COUNT(*) FROM hotel_bookings b WHERE b.trip_id = s.data->>'trip_id' AND (b.status <> 'booked' OR b.cancellations <> 0)) <> 0 OR \
         (SELECT COUNT(*) FROM car_rentals b WHERE b.trip_id = s.data->>'trip_id' AND (b.status <> 'rented' OR b.cancellations <> 0)) <> 0)",
    ),
    (
        "completed trip not booked in order flight, hotel, car, notification",
        "SELECT COUNT(*) FROM flight_bookings f \
         JOIN hotel_bookings h ON h.trip_id = f.trip_id \
         JOIN car_rentals c ON c.trip_id = f.trip_id \
         JOIN notifications n ON n.trip_id = f.trip_id \
         WHERE NOT (f.booked_seq < h.booked_seq AND h.booked_seq < c.booked_seq AND c.booked_seq < n.seq)",
    ),
    (
        "compensated trip without exactly one flight and one hotel, each cancelled exactly once",
        "SELECT COUNT(*) FROM sagabox_saga_instances s WHERE s.status = 'compensated' AND ( \
         (SELECT COUNT(*) FROM flight_bookings b WHERE b.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM hotel_bookings b WHERE b.trip_id = s.data->>'trip_id') <> 1 OR \
         (SELECT COUNT(*) FROM flight_bookings b WHERE b.trip_id = s.data->>'trip_id' AND b.status = 'cancelled' AND b.cancellations = 1) <> 1 OR \
         (SELECT COUNT(*) FROM hotel_bookings b WHERE b.trip_id = s.data->>'trip_id' AND b.status = 'cancelled' AND b.cancellations = 1) <> 1)",
    ),
    (
        "compensated trip with a car rented or an itinerary sent",
        "SELECT COUNT(*) FROM sagabox_saga_instances s WHERE s.status = 'compensated' AND ( \
         (SELECT COUNT(*) FROM car_rentals b WHERE b.trip_id = s.data->>'trip_id') <> 0 OR \
         (SELECT COUNT(*) FROM notifications n WHERE n.trip_id = s.data->>'trip_id') <> 0)",
    ),
    (
        "cancellation not in reverse order: flight booked, hotel booked, hotel cancelled, flight cancelled",
        "SELECT COUNT(*) FROM flight_bookings f JOIN hotel_bookings h ON h.trip_id = f.trip_id \
         WHERE (f.status = 'cancelled' OR h.status = 'cancelled') AND NOT ( \
         f.booked_seq < h.booked_seq AND h.booked_seq < h.cancel_seq AND h.cancel_seq < f.cancel_seq)",
    ),
    (
        "booking of a trip with no saga",
        "SELECT COUNT(*) FROM (SELECT trip_id FROM flight_bookings UNION ALL SELECT trip_id FROM hotel_bookings \
         UNION ALL SELECT trip_id FROM car_rentals UNION ALL SELECT trip_id FROM notifications) b \
         WHERE NOT EXISTS (SELECT 1 FROM sagabox_saga_instances s WHERE s.data->>'trip_id' = b.trip_id)",
    ),
    (
        "cancellation counted on a booking that is not cancelled",
        "SELECT COUNT(*) FROM (SELECT status, cancellations FROM flight_bookings UNION ALL \
         SELECT status, cancellations FROM hotel_bookings) b \
         WHERE (b.status = 'cancelled') <> (b.cancellations > 0)",
    ),
];

async fn check_invariants<B: Backend>(fx: &B) {
    for (what, sql) in INVARIANTS {
        assert_eq!(fx.scalar(sql.to_owned()).await, 0, "{what}");
    }
}

/// Rows of the inbox for `consumer` (all when `None`), and the duplicates they absorbed.
async fn inbox<B: Backend>(fx: &B, consumer: Option<&str>) -> (i64, i64) {
    let from = fx.inbox().await;
    let filter = consumer
        .map(|consumer| format!(" WHERE i.consumer_type = '{consumer}'"))
        .unwrap_or_default();
    let rows = fx
        .scalar(format!("SELECT COUNT(*) FROM {from} i{filter}"))
        .await;
    let duplicates = fx
        .scalar(format!(
            "SELECT CAST(COALESCE(SUM(i.duplicates), 0) AS BIGINT) FROM {from} i{filter}"
        ))
        .await;
    (rows, duplicates)
}

/// The car rental has no car: the saga ends compensated, the hotel cancelled before the
/// flight (by the shared sequence), each once; no car rented, no itinerary sent.
async fn car_fails_for_good<B: Backend>() {
    let fx = B::create().await;
    let service = Service::<B>::start(&fx, 0.0, 0.0, 1).await;
    let id = service
        .book(&Trip::new("t-1-nocar", "Ada", "Lisbon").without_car(), 1)
        .await;
    service.wait_idle().await;

    let saga = service.store.load(&id).await.unwrap().unwrap();
    assert_eq!(saga.status, SagaStatus::Compensated);
    let error = saga.last_error.unwrap_or_default();
    assert!(error.contains("car refused: no car available"), "{error}");

    let q = |sql: &str| fx.scalar(sql.to_owned());
    assert_eq!(
        q("SELECT COUNT(*) FROM flight_bookings WHERE status = 'cancelled' AND cancellations = 1")
            .await,
        1
    );
    assert_eq!(
        q("SELECT COUNT(*) FROM hotel_bookings WHERE status = 'cancelled' AND cancellations = 1")
            .await,
        1
    );
    assert_eq!(
        q("SELECT COUNT(*) FROM flight_bookings").await,
        1,
        "the flight booked once"
    );
    assert_eq!(
        q("SELECT COUNT(*) FROM hotel_bookings").await,
        1,
        "the hotel booked once"
    );
    let flight_booked = q("SELECT booked_seq FROM flight_bookings").await;
    let hotel_booked = q("SELECT booked_seq FROM hotel_bookings").await;
    let hotel_cancelled = q("SELECT cancel_seq FROM hotel_bookings").await;
    let flight_cancelled = q("SELECT cancel_seq FROM flight_bookings").await;
    assert!(
        flight_booked < hotel_booked
            && hotel_booked < hotel_cancelled
            && hotel_cancelled < flight_cancelled,
        "flight booked {flight_booked}, hotel booked {hotel_booked}, hotel cancelled {hotel_cancelled}, \
         flight cancelled {flight_cancelled}: the hotel is cancelled before the flight"
    );
    assert_eq!(
        q("SELECT COUNT(*) FROM car_rentals").await,
        0,
        "the car was never rented"
    );
    assert_eq!(
        q("SELECT COUNT(*) FROM notifications").await,
        0,
        "no itinerary sent"
    );
    // book + cancel for flight and hotel, the car's recorded refusal; no return_car, no notify.
    assert_eq!(inbox(&fx, Some("car")).await, (1, 0));
    assert_eq!(inbox(&fx, Some("notify")).await, (0, 0));
    assert_eq!(inbox(&fx, None).await, (5, 0));
    check_invariants(&fx).await;
    service.stop().await;
}

/// A trip with everything available: four bookings, in order, none cancelled.
async fn happy_path<B: Backend>() {
    let fx = B::create().await;
    let service = Service::<B>::start(&fx, 0.0, 0.0, 2).await;
    let id = service.book(&Trip::new("t-1", "Ada", "Lisbon"), 1).await;
    service.wait_idle().await;

    let saga = service.store.load(&id).await.unwrap().unwrap();
    assert_eq!(saga.status, SagaStatus::Completed);
    assert_eq!(saga.last_error, None);
    for table in [
        "flight_bookings",
        "hotel_bookings",
        "car_rentals",
        "notifications",
    ] {
        assert_eq!(
            fx.scalar(format!(
                "SELECT COUNT(*) FROM {table} WHERE trip_id = 't-1'"
            ))
            .await,
            1,
            "{table}"
        );
    }
    assert_eq!(
        fx.scalar(
            "SELECT COUNT(*) FROM flight_bookings WHERE cancel_seq IS NULL AND status = 'booked'"
                .to_owned()
        )
        .await,
        1
    );
    assert_eq!(
        inbox(&fx, None).await,
        (4, 0),
        "one inbox row per command, no duplicates"
    );
    check_invariants(&fx).await;
    assert_eq!(service.stats.retries.load(Ordering::SeqCst), 0);
    service.stop().await;
}

/// Many trips, each start request sent twice, commands duplicated and replies lost at
/// seeded rates: every invariant holds, and the inbox accounts for every delivery.
async fn many_trips_under_faults<B: Backend>(seed: u64) {
    let fx = B::create().await;
    let service = Service::<B>::start(&fx, 0.3, 0.2, seed).await;
    let mut ids = Vec::new();
    for n in 0..TRIPS {
        let trip = Trip::new(format!("t-{n:04}"), format!("traveller {n}"), "Lisbon");
        let trip = if n % 4 == 3 {
            Trip {
                trip_id: format!("t-{n:04}-nocar"),
                ..trip.without_car()
            }
        } else {
            trip
        };
        ids.push(service.book(&trip, 2).await);
    }
    service.wait_idle().await;

    let sagas = TRIPS as i64;
    let compensated = (0..TRIPS).filter(|n| n % 4 == 3).count() as i64;
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM sagabox_saga_instances".to_owned())
            .await,
        sagas,
        "one saga per trip"
    );
    assert_eq!(
        fx.scalar(
            "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'compensated'".to_owned()
        )
        .await,
        compensated
    );
    check_invariants(&fx).await;
    // Lost replies made steps time out before they completed: a completed trip keeps no
    // error of those retries (the history does).
    assert_eq!(
        fx.scalar(
            "SELECT COUNT(*) FROM sagabox_saga_instances \
             WHERE status = 'completed' AND last_error IS NOT NULL"
                .to_owned()
        )
        .await,
        0,
        "a completed trip shows no past retry as its error"
    );
    assert!(
        fx.scalar(
            "SELECT COUNT(*) FROM sagabox_saga_events WHERE kind IN ('failed', 'timed_out')"
                .to_owned()
        )
        .await
            > 0,
        "some attempts failed and were retried"
    );

    // The inbox: one row per distinct command, and every other delivery absorbed and
    // counted on it.
    let completed = sagas - compensated;
    assert_eq!(
        inbox(&fx, Some("flight")).await.0,
        sagas + compensated,
        "book + cancel"
    );
    assert_eq!(
        inbox(&fx, Some("hotel")).await.0,
        sagas + compensated,
        "book + cancel"
    );
    assert_eq!(
        inbox(&fx, Some("car")).await.0,
        sagas,
        "a rental or its refusal"
    );
    assert_eq!(inbox(&fx, Some("notify")).await.0, completed);
    let (rows, duplicates) = inbox(&fx, None).await;
    let counts = service.faults.counts();
    let applied = counts.applied.load(Ordering::SeqCst) as i64;
    let absorbed = counts.duplicates.load(Ordering::SeqCst) as i64;
    let failed = counts.failed.load(Ordering::SeqCst) as i64;
    eprintln!(
        "{TRIPS} trips: {rows} inbox rows, {duplicates} duplicates absorbed; \
         deliveries: {applied} first, {absorbed} duplicate, {failed} unanswered; {} commands \
         duplicated, {} replies lost, {} retries",
        counts.duplicated.load(Ordering::SeqCst),
        counts.replies_dropped.load(Ordering::SeqCst),
        service.stats.retries.load(Ordering::SeqCst),
    );
    assert!(
        counts.duplicated.load(Ordering::SeqCst) > 0,
        "commands were duplicated"
    );
    assert!(
        counts.replies_dropped.load(Ordering::SeqCst) > 0,
        "replies were lost"
    );
    assert!(duplicates > 0, "the inbox absorbed duplicates");
    if failed == 0 {
        assert_eq!(rows, applied, "a row per first delivery");
        assert_eq!(
            duplicates, absorbed,
            "every duplicate delivery counted on its row"
        );
    } else {
        // A delivery that timed out in the pool may still have applied, or been absorbed.
        assert!(
            rows >= applied
                && duplicates >= absorbed
                && rows + duplicates <= applied + absorbed + failed
        );
    }
    assert!(
        service.stats.retries.load(Ordering::SeqCst) > 0,
        "lost replies were retried"
    );
    assert_eq!(ids.len(), TRIPS);
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_car_fails_for_good() {
    car_fails_for_good::<Lite>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_car_fails_for_good() {
    car_fails_for_good::<Pg>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_happy_path() {
    happy_path::<Lite>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_happy_path() {
    happy_path::<Pg>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_many_trips_under_faults() {
    many_trips_under_faults::<Lite>(7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_trips_under_faults() {
    many_trips_under_faults::<Pg>(8).await;
}
