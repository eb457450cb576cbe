//! The trip participants as a service, and a way to book a trip by hand:
//!
//! ```text
//! sagabox-trip serve                          # flight, hotel, car, notify until Ctrl-C
//! sagabox-trip book TRIP TRAVELLER CITY [--no-car]
//! ```
//!
//! `DATABASE_URL` names the participants' PostgreSQL database (their tables are created
//! when missing), `BROKER_URL` the broker (amqp://… or nats://…), `QUEUE_PREFIX` the queue
//! prefix (`sagabox`). The saga itself is driven by `sagabox orchestrate --saga
//! sagas/trip.toml` on the same broker and prefix.

use sagabox::participant::PrunerSettings;
use sagabox::transport::{Sender, Transport};
use sagabox::{MessageId, PostgresStore};
use sagabox_trip::Trip;

const USAGE: &str = "usage: sagabox-trip serve | sagabox-trip book TRIP TRAVELLER CITY [--no-car]";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let prefix = std::env::var("QUEUE_PREFIX").unwrap_or_else(|_| "sagabox".into());
    let broker = Transport::from_url(&required("BROKER_URL")?, &prefix)?;
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["serve"] => serve(broker).await,
        ["book", trip, traveller, city, rest @ ..] => {
            let trip = match rest {
                [] => Trip::new(*trip, *traveller, *city),
                ["--no-car"] => Trip::new(*trip, *traveller, *city).without_car(),
                _ => return Err(USAGE.into()),
            };
            book(broker, &trip).await
        }
        _ => Err(USAGE.into()),
    }
}

fn required(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("set {name} ({USAGE})"))
}

/// The four participants until Ctrl-C or SIGTERM.
async fn serve(broker: Transport) -> Result<(), Box<dyn std::error::Error>> {
    let store = PostgresStore::connect(&required("DATABASE_URL")?, 8).await?;
    sqlx::raw_sql(sagabox_trip::schema::POSTGRES)
        .execute(store.pool())
        .await?;
    let report = sagabox_trip::participant(store, broker)
        .workers(2)
        .pruner(PrunerSettings::default())
        .run(async {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                },
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        })
        .await?;
    println!("{report:?}");
    Ok(())
}

/// Sends the start message of `trip`, its id made from the trip's: booking the same trip
/// again starts no second saga.
async fn book(broker: Transport, trip: &Trip) -> Result<(), Box<dyn std::error::Error>> {
    let start = trip.start_message(MessageId::new(format!("book-{}", trip.trip_id))?)?;
    let mut sender = Sender::connect(&broker, "book").await?;
    sender.start_saga(&start).await?;
    sender.close().await;
    println!("asked to book trip {}", trip.trip_id);
    Ok(())
}
