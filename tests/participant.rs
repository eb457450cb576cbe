//! The `Participant` runtime against a real RabbitMQ and real PostgreSQL and SQLite: a
//! toy ledger domain (`ledger` takes `credit`, `notify` takes `notify` and `credited`)
//! hosted behind the broker — duplicates applied once and every delivery answered, an
//! orderly stop that drains what is in flight, a crashed worker replaced, the outbox
//! relayed, one pruner pass at a time among instances, a dead actor ending the run with
//! its name, and every bad setting refused with a typed error.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use chrono::{TimeZone, Utc};
use common::rabbit::Rabbit;
use common::{Lite, Pg};
use ractor::Actor;
use sagabox::amqp::{AmqpConfig, codec};
use sagabox::outbox::OutboxWriter;
use sagabox::participant::{PrunerSettings, StepOptions};
use sagabox::relay::{OutboxSource, Relay, RelayArguments, RelayConfig, RelayMessage};
use sagabox::reply::REPLY_KIND;
use sagabox::step::{StepError, StepFailure, StepHandler, StepPool, StepPoolConfig};
use sagabox::supervisor::Supervision;
use sagabox::{
    ConfigError, ConsumerType, Envelope, InboxConfig, InboxGuard, InboxStore, ManualClock,
    MessageId, Month, Participant, ParticipantError, PostgresStore, SqliteStore,
};
use serde_json::{Value, json};
use tokio::sync::watch;

const TABLES: &str = "
    CREATE TABLE ledger_entries (message_id TEXT NOT NULL, account TEXT NOT NULL, cents BIGINT NOT NULL);
    CREATE TABLE notifications (message_id TEXT NOT NULL, account TEXT NOT NULL, kind TEXT NOT NULL);
";

/// Credits an account: one `ledger_entries` row per applied command (no unique key:
/// only the inbox keeps it exact). Optionally tells `notify` through the outbox, panics
/// a number of times first (a bug), or waits for a gate (a slow handler).
#[derive(Debug, Clone, Default)]
struct Ledger {
    notify_through_outbox: bool,
    panics_left: Arc<AtomicUsize>,
    started: Arc<AtomicUsize>,
    gate: Option<watch::Receiver<bool>>,
}

/// Records a notification per applied command.
#[derive(Debug, Clone, Default)]
struct Notify;

fn retryable(error: impl std::fmt::Display) -> StepError {
    StepError::Retryable(error.to_string())
}

fn field<'a>(envelope: &'a Envelope, name: &str) -> Result<&'a Value, StepError> {
    envelope
        .payload
        .get(name)
        .ok_or_else(|| StepError::Permanent(format!("the command has no {name}")))
}

macro_rules! toy_handlers {
    ($db:ty) => {
        impl StepHandler<$db> for Ledger {
            async fn handle(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                envelope: &Envelope,
            ) -> Result<Value, StepError> {
                self.started.fetch_add(1, SeqCst);
                if self
                    .panics_left
                    .fetch_update(SeqCst, SeqCst, |left| left.checked_sub(1))
                    .is_ok()
                {
                    panic!("a bug in the ledger handler");
                }
                if let Some(gate) = &self.gate {
                    gate.clone()
                        .wait_for(|open| *open)
                        .await
                        .map_err(retryable)?;
                }
                let account = field(envelope, "account")?.as_str().unwrap_or_default();
                let cents = field(envelope, "cents")?.as_i64().unwrap_or_default();
                sqlx::query(
                    "INSERT INTO ledger_entries (message_id, account, cents) VALUES ($1, $2, $3)",
                )
                .bind(envelope.id.as_str())
                .bind(account)
                .bind(cents)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                if self.notify_through_outbox {
                    let credited =
                        <<$db as sqlx::Database>::Connection as OutboxWriter>::message(
                            "credited",
                            json!({"account": account, "cents": cents}),
                        )
                        .map_err(retryable)?;
                    conn.publish(&ConsumerType::new("notify").unwrap(), account, &credited)
                        .await
                        .map_err(retryable)?;
                }
                Ok(json!({"credited": cents}))
            }
        }

        impl StepHandler<$db> for Notify {
            async fn handle(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                envelope: &Envelope,
            ) -> Result<Value, StepError> {
                let account = field(envelope, "account")?.as_str().unwrap_or_default();
                sqlx::query(
                    "INSERT INTO notifications (message_id, account, kind) VALUES ($1, $2, $3)",
                )
                .bind(envelope.id.as_str())
                .bind(account)
                .bind(&envelope.kind)
                .execute(&mut *conn)
                .await
                .map_err(retryable)?;
                Ok(json!({"sent": true}))
            }
        }
    };
}

toy_handlers!(sqlx::Postgres);
toy_handlers!(sqlx::Sqlite);

/// A database fixture the same scenario runs on.
trait Backend: Sized {
    type Store: InboxStore + Clone + OutboxSource;
    async fn create() -> Self;
    async fn store(&self, connections: u32) -> Self::Store;
    async fn count(&self, sql: &'static str) -> i64;
    async fn exec(&self, sql: &'static str);
}

impl Backend for Pg {
    type Store = PostgresStore;
    async fn create() -> Self {
        Pg::new().await
    }
    async fn store(&self, connections: u32) -> PostgresStore {
        Pg::store(self, connections).await
    }
    async fn count(&self, sql: &'static str) -> i64 {
        self.scalar(sql).await
    }
    async fn exec(&self, sql: &'static str) {
        Pg::exec(self, sql).await
    }
}

impl Backend for Lite {
    type Store = SqliteStore;
    async fn create() -> Self {
        Lite::new().await
    }
    async fn store(&self, connections: u32) -> SqliteStore {
        Lite::store(self, connections).await
    }
    async fn count(&self, sql: &'static str) -> i64 {
        self.scalar(sql).await
    }
    async fn exec(&self, sql: &'static str) {
        Lite::exec(self, sql).await
    }
}

/// Publishes `command` to `consumer_type`'s queue as any AMQP client would, asking for
/// replies on `reply_to`.
async fn send(rabbit: &Rabbit, consumer_type: &str, command: &Envelope, reply_to: Option<&str>) {
    let (body, mut properties) = codec::encode(command);
    if let Some(reply_to) = reply_to {
        properties = properties.with_reply_to(reply_to.into());
    }
    rabbit
        .publish_raw(&rabbit.queue(consumer_type), &body, properties)
        .await;
}

fn credit(account: &str, cents: i64) -> Envelope {
    Envelope::new(
        MessageId::new_v7(),
        "credit",
        json!({"account": account, "cents": cents}),
    )
    .unwrap()
}

/// Every reply waiting in `queue`, by the command id it answers: `(duplicate, outcome)`.
async fn replies(rabbit: &Rabbit, queue: &str) -> HashMap<String, Vec<(bool, Value)>> {
    let mut by_command: HashMap<String, Vec<(bool, Value)>> = HashMap::new();
    for message in rabbit.drain(queue).await {
        let reply = codec::decode(
            &message.delivery.properties,
            &message.delivery.data,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(reply.kind, REPLY_KIND);
        let command_id = reply.payload["command_id"].as_str().unwrap().to_owned();
        by_command.entry(command_id).or_default().push((
            reply.payload["duplicate"].as_bool().unwrap(),
            reply.payload["outcome"].clone(),
        ));
    }
    by_command
}

/// Two steps; every command published twice; each applied once, each delivery
/// answered (the second as a duplicate with the first answer), every delivery acked.
/// With `batch` above 1, the ledger claims what its consumer holds in batches.
async fn duplicates_are_applied_once_and_every_delivery_is_answered<B: Backend>(batch: usize)
where
    Ledger: StepHandler<<B::Store as InboxStore>::Db>,
    Notify: StepHandler<<B::Store as InboxStore>::Db>,
{
    let (db, rabbit) = (
        B::create().await,
        Rabbit::new(&["ledger", "notify", "replies"]).await,
    );
    db.exec(TABLES).await;
    rabbit.declare("replies").await;
    let handle = Participant::new(db.store(8).await, rabbit.config.clone())
        .step_with(
            "ledger",
            Ledger::default(),
            StepOptions::default().kinds(["credit"]).batch(batch),
        )
        .step_with("notify", Notify, StepOptions::default().kinds(["notify"]))
        .workers(2)
        .start()
        .await
        .unwrap();

    let replies_to = rabbit.queue("replies");
    let mut commands = vec![
        ("ledger", credit("alice", 500)),
        ("ledger", credit("bob", 700)),
        ("ledger", credit("alice", 300)),
    ];
    for account in ["alice", "bob"] {
        let notify =
            Envelope::new(MessageId::new_v7(), "notify", json!({"account": account})).unwrap();
        commands.push(("notify", notify));
    }
    for (consumer_type, command) in &commands {
        for _ in 0..2 {
            send(&rabbit, consumer_type, command, Some(&replies_to)).await;
        }
    }
    rabbit.wait_ready(&replies_to, 10).await;
    let report = handle.stop().await.unwrap();

    assert_eq!(db.count("SELECT COUNT(*) FROM ledger_entries").await, 3);
    assert_eq!(
        db.count("SELECT CAST(SUM(cents) AS BIGINT) FROM ledger_entries")
            .await,
        1500
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM notifications").await, 2);
    let replies = replies(&rabbit, &replies_to).await;
    assert_eq!(replies.len(), commands.len(), "{replies:?}");
    for (_, command) in &commands {
        let answers = &replies[command.id.as_str()];
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert_eq!(
            answers.iter().filter(|(duplicate, _)| !duplicate).count(),
            1,
            "one first delivery, one duplicate: {answers:?}"
        );
        assert_eq!(
            answers[0].1, answers[1].1,
            "the duplicate gets the first answer"
        );
    }
    assert_eq!(
        replies[commands[1].1.id.as_str()][0].1,
        json!({"done": {"credited": 700}})
    );
    let (ledger, notify) = (
        report.step("ledger").unwrap(),
        report.step("notify").unwrap(),
    );
    assert_eq!(
        (ledger.acked, ledger.dead_lettered, ledger.requeued),
        (6, 0, 0)
    );
    assert_eq!(
        (notify.acked, notify.dead_lettered, notify.requeued),
        (4, 0, 0)
    );
    for queue in ["ledger", "notify"] {
        assert_eq!(rabbit.ready(&rabbit.queue(queue)).await, 0);
        assert_eq!(rabbit.ready(&rabbit.dead_queue(queue)).await, 0);
    }
}

/// A credit written by `ledger` tells `notify` through the outbox; the relay publishes
/// it to `notify`'s queue, where the same participant applies it.
async fn the_relay_publishes_what_a_handler_wrote_to_the_outbox<B: Backend>()
where
    Ledger: StepHandler<<B::Store as InboxStore>::Db>,
    Notify: StepHandler<<B::Store as InboxStore>::Db>,
    Relay<B::Store>: Actor<Msg = RelayMessage, Arguments = RelayArguments<B::Store>>,
{
    let (db, rabbit) = (B::create().await, Rabbit::new(&["ledger", "notify"]).await);
    db.exec(TABLES).await;
    let ledger = Ledger {
        notify_through_outbox: true,
        ..Ledger::default()
    };
    let relay = RelayConfig {
        poll_interval: Duration::from_millis(20),
        ..RelayConfig::default()
    };
    let handle = Participant::new(db.store(8).await, rabbit.config.clone())
        .step_with("ledger", ledger, StepOptions::default().kinds(["credit"]))
        .step_with(
            "notify",
            Notify,
            StepOptions::default().kinds(["notify", "credited"]),
        )
        .relay(relay)
        .start()
        .await
        .unwrap();
    let command = credit("carol", 900);
    send(&rabbit, "ledger", &command, None).await;
    send(&rabbit, "ledger", &command, None).await;
    common::wait_for("the relayed notification applied", async || {
        db.count("SELECT COUNT(*) FROM notifications WHERE kind = 'credited'")
            .await
            == 1
    })
    .await;
    let report = handle.stop().await.unwrap();
    assert_eq!(db.count("SELECT COUNT(*) FROM ledger_entries").await, 1);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NOT NULL")
            .await,
        1,
        "one outbox row, marked sent after the broker's confirm"
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM notifications").await, 1);
    assert_eq!(report.step("ledger").unwrap().acked, 2);
    assert_eq!(report.step("notify").unwrap().acked, 1);
    assert_eq!(rabbit.ready(&rabbit.queue("notify")).await, 0);
}

#[tokio::test]
async fn postgres_duplicates_are_applied_once_and_every_delivery_is_answered() {
    duplicates_are_applied_once_and_every_delivery_is_answered::<Pg>(1).await;
}

#[tokio::test]
async fn sqlite_duplicates_are_applied_once_and_every_delivery_is_answered() {
    duplicates_are_applied_once_and_every_delivery_is_answered::<Lite>(1).await;
}

#[tokio::test]
async fn postgres_batched_claims_apply_duplicates_once_and_answer_every_delivery() {
    duplicates_are_applied_once_and_every_delivery_is_answered::<Pg>(4).await;
}

#[tokio::test]
async fn sqlite_batched_claims_apply_duplicates_once_and_answer_every_delivery() {
    duplicates_are_applied_once_and_every_delivery_is_answered::<Lite>(4).await;
}

#[tokio::test]
async fn postgres_the_relay_publishes_what_a_handler_wrote_to_the_outbox() {
    the_relay_publishes_what_a_handler_wrote_to_the_outbox::<Pg>().await;
}

#[tokio::test]
async fn sqlite_the_relay_publishes_what_a_handler_wrote_to_the_outbox() {
    the_relay_publishes_what_a_handler_wrote_to_the_outbox::<Lite>().await;
}

/// Shutdown resolves while five handlers are in the middle of their transaction: they
/// finish, are acked once, and nothing is left in the queue or applied twice.
#[tokio::test]
async fn shutdown_finishes_and_acks_the_deliveries_in_flight() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger"]).await);
    pg.exec(TABLES).await;
    let (open, gate) = watch::channel(false);
    let ledger = Ledger {
        gate: Some(gate),
        ..Ledger::default()
    };
    let started = Arc::clone(&ledger.started);
    // A classic queue: a quorum queue keeps a cancelled consumer in its consumer count
    // until that consumer's deliveries are settled, which hides the cancel this test
    // watches for.
    let mut config = rabbit.config.clone();
    config.queue_type = sagabox::amqp::QueueType::Classic;
    let participant = Participant::new(pg.store(8).await, config)
        .step("ledger", ledger)
        .workers(5);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(participant.run(async {
        let _ = stopped.await;
    }));
    let queue = rabbit.queue("ledger");
    common::wait_for("the ledger queue consumed", async || {
        rabbit.consumers(&queue).await == 1
    })
    .await;
    for n in 0..5 {
        send(&rabbit, "ledger", &credit("dave", n), None).await;
    }
    common::wait_for("five handlers running", async || started.load(SeqCst) == 5).await;

    stop.send(()).unwrap();
    // The subscription is cancelled first: no new delivery is taken after the signal.
    common::wait_for("the subscription cancelled", async || {
        rabbit.consumers(&queue).await == 0
    })
    .await;
    assert!(
        !running.is_finished(),
        "it waits for the handlers in flight"
    );
    open.send(true).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the participant stopped")
        .unwrap()
        .unwrap();

    let ledger = report.step("ledger").unwrap();
    assert_eq!(
        (ledger.acked, ledger.requeued, ledger.dead_lettered),
        (5, 0, 0)
    );
    assert_eq!(started.load(SeqCst), 5, "no delivery ran twice");
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM ledger_entries").await, 5);
    assert_eq!(pg.inbox_rows().await, 5);
    // The connection is closed: anything left unacked would be back in the queue.
    assert_eq!(rabbit.ready(&queue).await, 0);
    assert_eq!(rabbit.ready(&rabbit.dead_queue("ledger")).await, 0);
}

/// One worker; its handler panics on the first command it gets. The pool replaces
/// the worker, which serves the other command; the first is requeued by the consumer
/// and applied on its second delivery. The participant goes on: a worker's crash is not
/// the pool's death.
#[tokio::test]
async fn a_worker_that_panics_is_replaced_and_the_next_command_is_served() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger", "replies"]).await);
    pg.exec(TABLES).await;
    rabbit.declare("replies").await;
    let ledger = Ledger {
        panics_left: Arc::new(AtomicUsize::new(1)),
        ..Ledger::default()
    };
    let (started, panics_left) = (Arc::clone(&ledger.started), Arc::clone(&ledger.panics_left));
    let handle = Participant::new(pg.store(4).await, rabbit.config.clone())
        .step("ledger", ledger)
        .workers(1)
        .start()
        .await
        .unwrap();
    let replies_to = rabbit.queue("replies");
    let (first, second) = (credit("erin", 100), credit("frank", 200));
    send(&rabbit, "ledger", &first, Some(&replies_to)).await;
    send(&rabbit, "ledger", &second, Some(&replies_to)).await;
    rabbit.wait_ready(&replies_to, 2).await;
    let report = handle.stop().await.expect("no actor died");

    assert_eq!(panics_left.load(SeqCst), 0, "the handler panicked once");
    assert_eq!(started.load(SeqCst), 3, "two commands, one of them twice");
    let replies = replies(&rabbit, &replies_to).await;
    for command in [&first, &second] {
        assert_eq!(
            replies[command.id.as_str()],
            vec![(
                false,
                json!({"done": {"credited": command.payload["cents"]}})
            )],
        );
    }
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM ledger_entries").await, 2);
    let ledger = report.step("ledger").unwrap();
    assert_eq!(
        (ledger.acked, ledger.requeued, ledger.dead_lettered),
        (2, 1, 0)
    );
    assert_eq!(rabbit.ready(&rabbit.queue("ledger")).await, 0);
}

/// A command whose id dates from before the inbox's window (its UUIDv7 time 60 days
/// ago, past the 30-day TTL) may have been applied already with its row pruned: the
/// guard refuses it without running the handler, and the participant dead-letters it as
/// `rejected`, the refusal in its detail. The next command is served as usual.
#[tokio::test]
async fn a_command_older_than_the_inbox_window_is_dead_lettered_as_rejected() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger"]).await);
    pg.exec(TABLES).await;
    let ledger = Ledger::default();
    let started = Arc::clone(&ledger.started);
    let handle = Participant::new(pg.store(4).await, rabbit.config.clone())
        .step("ledger", ledger)
        .start()
        .await
        .unwrap();
    let old = Envelope::new(
        MessageId::derive_v7(Utc::now() - chrono::Duration::days(60), "old credit"),
        "credit",
        json!({"account": "gus", "cents": 100}),
    )
    .unwrap();
    send(&rabbit, "ledger", &old, None).await;
    send(&rabbit, "ledger", &credit("hana", 200), None).await;
    let dead = rabbit.dead_queue("ledger");
    rabbit.wait_ready(&dead, 1).await;
    common::wait_for("the fresh command acked", async || {
        handle.report().step("ledger").unwrap().acked == 1
    })
    .await;
    let report = handle.stop().await.expect("no actor died");

    let letters = rabbit.drain(&dead).await;
    assert_eq!(letters.len(), 1);
    let headers = letters[0]
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    let header = |name: &str| match headers.inner().get(name) {
        Some(lapin::types::AMQPValue::LongString(text)) => text.to_string(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(header(sagabox::dead_reason::DEAD_REASON_HEADER), "rejected");
    assert!(
        header(sagabox::dead_reason::DEAD_DETAIL_HEADER)
            .contains("before the deduplication window"),
        "{}",
        header(sagabox::dead_reason::DEAD_DETAIL_HEADER)
    );
    assert_eq!(
        letters[0]
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        Some(old.id.to_string())
    );
    assert_eq!(
        started.load(SeqCst),
        1,
        "the handler never ran for the old one"
    );
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM ledger_entries").await, 1);
    let ledger = report.step("ledger").unwrap();
    assert_eq!((ledger.acked, ledger.dead_lettered), (1, 1));
}

/// Three instances of a service on one PostgreSQL database, each with a pruner every
/// 50 ms, on a shared manual clock. When a month expires, exactly one instance drops
/// it; the others skip while it holds the maintenance lock; no pass fails.
#[tokio::test]
async fn three_instances_drop_an_expired_month_exactly_once() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger"]).await);
    pg.exec(TABLES).await;
    let month = |year, month| Month::new(year, month).unwrap();
    let clock = ManualClock::new(Utc.with_ymd_and_hms(2026, 10, 20, 0, 0, 0).unwrap());
    let inbox = InboxConfig::default().with_ttl(Duration::from_secs(14 * 86_400));
    let mut handles = Vec::new();
    for _ in 0..3 {
        handles.push(
            Participant::new(pg.store(3).await, rabbit.config.clone())
                .step("ledger", Ledger::default())
                .workers(1)
                .inbox(inbox.clone())
                .clock(clock.clone())
                .pruner(PrunerSettings {
                    interval: Duration::from_millis(50),
                })
                .start()
                .await
                .unwrap(),
        );
    }
    let observer = InboxGuard::new(pg.store(1).await, inbox)
        .unwrap()
        .with_clock(clock.clone());
    let passes = |handles: &[sagabox::ParticipantHandle]| -> Vec<u64> {
        handles
            .iter()
            .map(|handle| {
                let pruner = handle.report().pruner.unwrap();
                pruner.passes + pruner.skipped
            })
            .collect()
    };
    common::wait_for("a few passes with nothing expired", async || {
        passes(&handles).iter().all(|&count| count >= 3)
    })
    .await;
    assert_eq!(
        observer.partitions().await.unwrap(),
        vec![month(2026, 10), month(2026, 11), month(2026, 12)]
    );

    // A month later, October is wholly older than the 14-day TTL.
    clock.set(Utc.with_ymd_and_hms(2026, 11, 20, 0, 0, 0).unwrap());
    let done = vec![month(2026, 11), month(2026, 12), month(2027, 1)];
    common::wait_for("October dropped and January created", async || {
        observer.partitions().await.unwrap() == done
    })
    .await;
    // More passes each, so that a second drop of October would show.
    let seen = passes(&handles);
    common::wait_for("five more passes each", async || {
        passes(&handles)
            .iter()
            .zip(&seen)
            .all(|(now, then)| now >= &(then + 5))
    })
    .await;

    let mut dropped = Vec::new();
    let mut ran = 0;
    for handle in handles {
        let pruner = handle.stop().await.unwrap().pruner.unwrap();
        assert_eq!(pruner.failed, 0, "{pruner:?}");
        ran += pruner.passes;
        dropped.extend(pruner.dropped);
    }
    assert_eq!(dropped, vec![month(2026, 10)], "dropped exactly once");
    assert!(ran >= 1);
    assert_eq!(observer.partitions().await.unwrap(), done);
}

/// A supervised actor that dies ends the run with an error naming it, promptly, after
/// the orderly stop.
#[tokio::test]
async fn a_dead_relay_ends_the_run_with_an_error_naming_it() {
    let (lite, rabbit) = (Lite::new().await, Rabbit::new(&["ledger"]).await);
    lite.exec(TABLES).await;
    let handle = Participant::new(lite.store(4).await, rabbit.config.clone())
        .step("ledger", Ledger::default())
        .relay(RelayConfig::default())
        .start()
        .await
        .unwrap();
    let labels: Vec<&str> = handle
        .actors()
        .iter()
        .map(|(label, _)| label.as_str())
        .collect();
    assert_eq!(labels, ["step pool ledger", "relay"]);
    let relay = handle.actors()[1].1.clone();
    relay.kill();
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        handle.run_until(std::future::pending()),
    )
    .await
    .expect("the run ended instead of hanging");
    match ended {
        Err(ParticipantError::ActorDied(died)) => {
            assert_eq!(died.actor, "relay", "{died}");
            assert!(died.to_string().contains("relay"), "{died}");
        }
        other => panic!("expected the relay's death, got {other:?}"),
    }
    common::wait_for("the consumer gone", async || {
        rabbit.consumers(&rabbit.queue("ledger")).await == 0
    })
    .await;
}

/// Every bad setting is refused before anything connects, with a typed error that
/// says what is wrong.
#[tokio::test]
async fn bad_settings_are_refused_with_typed_errors() {
    let lite = Lite::new().await;
    let store = lite.store(1).await;
    let amqp = AmqpConfig::new(common::rabbit::amqp_url());
    let base = || Participant::new(store.clone(), amqp.clone());
    let refused = |participant: Participant<SqliteStore>| participant.validate().unwrap_err();

    assert!(matches!(refused(base()), ParticipantError::NoSteps));
    assert!(matches!(
        refused(base().step("", Notify)),
        ParticipantError::InvalidConsumerType { .. }
    ));
    let twice = refused(base().step("notify", Notify).step("notify", Notify));
    assert!(
        matches!(&twice, ParticipantError::DuplicateConsumerType(ct) if ct.as_str() == "notify"),
        "{twice}"
    );
    assert!(matches!(
        refused(base().step("notify", Notify).workers(0)),
        ParticipantError::ZeroWorkers { .. }
    ));
    assert!(matches!(
        refused(base().step_with("notify", Notify, StepOptions::default().workers(0))),
        ParticipantError::ZeroWorkers { .. }
    ));
    assert!(matches!(
        refused(base().step("notify", Notify).timeout(Duration::ZERO)),
        ParticipantError::ZeroTimeout { .. }
    ));
    assert!(matches!(
        refused(base().step_with("notify", Notify, StepOptions::default().kinds([""]))),
        ParticipantError::EmptyKind { .. }
    ));
    for batch in [0, usize::from(amqp.prefetch) + 1] {
        let batched =
            refused(base().step_with("notify", Notify, StepOptions::default().batch(batch)));
        assert!(
            matches!(batched, ParticipantError::InvalidBatch { batch: b, .. } if b == batch),
            "{batched}"
        );
    }
    assert!(matches!(
        refused(base().step("notify", Notify).relay(RelayConfig {
            batch: 0,
            ..RelayConfig::default()
        })),
        ParticipantError::InvalidRelay(_)
    ));
    assert!(matches!(
        refused(base().step("notify", Notify).pruner(PrunerSettings {
            interval: Duration::ZERO,
        })),
        ParticipantError::ZeroPrunerInterval
    ));
    let short_ttl = refused(
        base()
            .step("notify", Notify)
            .inbox(InboxConfig::default().with_ttl(Duration::from_secs(86_400))),
    );
    assert!(
        matches!(
            short_ttl,
            ParticipantError::InboxConfig(ConfigError::TtlShorterThanRetention { .. })
        ),
        "{short_ttl}"
    );
    let mut no_prefetch = amqp.clone();
    no_prefetch.prefetch = 0;
    let prefetch = refused(Participant::new(store.clone(), no_prefetch).step("notify", Notify));
    assert!(
        matches!(prefetch, ParticipantError::Transport(_)),
        "{prefetch}"
    );
    assert!(base().step("notify", Notify).validate().is_ok());

    // Start checks the same before touching anything.
    let started = base().start().await.unwrap_err();
    assert!(matches!(started, ParticipantError::NoSteps), "{started}");
}

/// The Prometheus endpoint serves the guard's counters for the hosted steps. (The
/// recorder is per process: this is the only test here that installs one.)
#[tokio::test]
async fn the_metrics_endpoint_counts_the_hosted_steps_messages() {
    let (lite, rabbit) = (Lite::new().await, Rabbit::new(&["tally"]).await);
    lite.exec(TABLES).await;
    let addr = format!("127.0.0.1:{}", common::scrape::free_port());
    let handle = Participant::new(lite.store(4).await, rabbit.config.clone())
        .step("tally", Ledger::default())
        .metrics_addr(addr)
        .start()
        .await
        .unwrap();
    let endpoint = handle.metrics_addr().unwrap();
    let command = credit("gina", 50);
    send(&rabbit, "tally", &command, None).await;
    send(&rabbit, "tally", &command, None).await;
    common::wait_for("two acks", async || {
        handle.report().step("tally").unwrap().acked == 2
    })
    .await;
    let text = common::scrape::scrape(endpoint).await.unwrap();
    let count = |outcome: &str| {
        common::scrape::sum(
            &text,
            sagabox::metrics::INBOX_MESSAGES_TOTAL,
            &["consumer_type=\"tally\"", &format!("outcome=\"{outcome}\"")],
        )
    };
    assert_eq!((count("applied"), count("duplicate")), (1.0, 1.0), "{text}");
    handle.stop().await.unwrap();
}

/// The step pool's own queue is bounded when asked (the participant bounds it by the
/// prefetch): with its one worker busy and one command waiting, the next is answered at
/// once with a retryable failure instead of queueing behind them. A limit of 0 is taken
/// as 1 (a command always waits in the queue until a worker takes it).
#[tokio::test]
async fn a_bounded_pool_answers_at_once_when_its_queue_is_full() {
    for queue_limit in [1, 0] {
        bounded_pool_with_one_waiting(queue_limit).await;
    }
}

async fn bounded_pool_with_one_waiting(queue_limit: usize) {
    let lite = Lite::new().await;
    lite.exec(TABLES).await;
    let (open, gate) = watch::channel(false);
    let ledger = Ledger {
        gate: Some(gate),
        ..Ledger::default()
    };
    let started = Arc::clone(&ledger.started);
    let supervision = Supervision::start().await.unwrap();
    let guard = InboxGuard::new(lite.store(4).await, InboxConfig::default()).unwrap();
    let pool = Arc::new(
        StepPool::spawn_bounded(
            guard,
            ConsumerType::new("ledger").unwrap(),
            ledger,
            StepPoolConfig { workers: 1 },
            queue_limit,
            &supervision,
        )
        .await
        .unwrap(),
    );
    let wait = Duration::from_secs(30);
    let running = tokio::spawn({
        let pool = Arc::clone(&pool);
        async move { pool.deliver(credit("hank", 1), wait).await }
    });
    common::wait_for("the worker busy", async || started.load(SeqCst) == 1).await;
    let mut waiting = Box::pin(pool.deliver(credit("hank", 2), wait));
    // Polled until it is sent and waits: the worker is held at the gate.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut waiting)
            .await
            .is_err()
    );
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        pool.deliver(credit("hank", 3), wait),
    )
    .await
    .expect("answered at once");
    match refused {
        Err(StepFailure::Retryable(reason)) => {
            assert!(reason.contains("queue limit"), "{reason}");
        }
        other => panic!("expected a retryable refusal, got {other:?}"),
    }
    open.send(true).unwrap();
    assert!(running.await.unwrap().is_ok());
    assert!(waiting.await.is_ok());
    assert_eq!(lite.scalar("SELECT COUNT(*) FROM ledger_entries").await, 2);
    supervision.stop().await;
}

/// Collects the messages of the WARN events of the thread it is the default of.
#[derive(Clone, Default)]
struct Warnings(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message<'a>(&'a mut String);
        impl tracing::field::Visit for Message<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                use std::fmt::Write;
                let _ = write!(self.0, " {}={value:?}", field.name());
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut text = String::new();
            event.record(&mut Message(&mut text));
            self.0.lock().unwrap().push(text);
        }
    }
}

/// A queue with no TTL at all (declared without one, no policy) lets the broker redeliver
/// at any age: the participant refuses to start unless forced, and the force is a warning.
#[tokio::test]
async fn a_queue_without_retention_is_refused_unless_forced_and_the_force_is_logged() {
    use tracing_subscriber::layer::SubscriberExt;
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger"]).await);
    pg.exec(TABLES).await;
    let mut amqp = rabbit.config.clone();
    amqp.message_ttl = None;
    let error = Participant::new(pg.store(4).await, amqp.clone())
        .step("ledger", Ledger::default())
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            ParticipantError::Transport(sagabox::transport::TransportError::Amqp(
                sagabox::amqp::AmqpError::Retention(
                    sagabox::retention::RetentionError::Unbounded { .. }
                )
            ))
        ),
        "{error}"
    );
    let text = error.to_string();
    for part in [
        rabbit.queue("ledger").as_str(),
        "without limit",
        "x-message-ttl",
        "--force-short-ttl",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }

    let warnings = Warnings::default();
    let _logging =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(warnings.clone()));
    let forced = InboxConfig::default().with_ttl_below_retention_allowed(true);
    let handle = Participant::new(pg.store(4).await, amqp)
        .step("ledger", Ledger::default())
        .inbox(forced)
        .start()
        .await
        .unwrap();
    handle.stop().await.unwrap();
    let logged = warnings.0.lock().unwrap().join("\n");
    assert!(
        logged.contains("forced") && logged.contains(&rabbit.queue("ledger")),
        "no warning of the forced start in: {logged}"
    );
}

/// The retention a policy sets is read from the broker (management API): a policy
/// longer than the inbox TTL on a queue without x-message-ttl refuses the start.
#[tokio::test]
async fn a_message_ttl_policy_longer_than_the_inbox_ttl_is_read_and_refused() {
    let (pg, rabbit) = (Pg::new().await, Rabbit::new(&["ledger"]).await);
    pg.exec(TABLES).await;
    let mut amqp = rabbit.config.clone();
    amqp.message_ttl = None;
    let queue = rabbit.queue("ledger");
    let policy = format!("{}-ttl", rabbit.config.queue_prefix);
    let definition = format!("{{\"message-ttl\":{}}}", 45u64 * 86_400_000);
    let set = std::process::Command::new("rabbitmqctl")
        .args(["set_policy", "--apply-to", "queues", &policy])
        .arg(format!("^{}$", queue.replace('.', "\\.")))
        .arg(&definition)
        .output()
        .expect("rabbitmqctl (RabbitMQ's CLI) must be installed for this test");
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let started = Participant::new(pg.store(4).await, amqp)
        .step("ledger", Ledger::default())
        .start()
        .await;
    let _ = std::process::Command::new("rabbitmqctl")
        .args(["clear_policy", &policy])
        .output();
    let error = started.unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("45.0 days") && text.contains("30.0 days"),
        "{text}"
    );
    assert!(text.contains(&queue), "{text}");
}
