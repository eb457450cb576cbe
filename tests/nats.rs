//! The NATS JetStream transport against a real server and real PostgreSQL: a plain
//! publisher's duplicates dropped by JetStream's window or absorbed by the inbox, bad
//! input dead-lettered with its reason, acks only after commit, retries then
//! dead-letters, the orchestrator's dispatch, the stream's retention checked against the
//! inbox TTL, and a server restarted under a running consumer.

#![allow(clippy::unwrap_used)]

// Refused rather than skipped: under `cargo test -p sagabox` the library's default features
// leave some of these out, and a suite that silently does not run proves nothing.
#[cfg(not(all(feature = "postgres", feature = "nats")))]
compile_error!(
    "tests/nats.rs needs the features postgres and nats: run `cargo test` at the workspace's root, \
     or `cargo test -p sagabox --all-features`"
);

mod common;
#[path = "common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::stream::{self, RetentionPolicy};
use common::{Pg, effects};
use jetstream::{Js, OwnServer};
use sagabox::consumer::ConsumerHandle;
use sagabox::delivery::{DEAD_REASON_HEADER, DeadReason, Disposition};
use sagabox::dlq::{DeadLetters, DlqError, ReplayOptions};
use sagabox::nats::{Consumer, ConsumerOptions, NatsDispatch, NatsError, codec, serve_step};
use sagabox::orchestrator::Dispatch;
use sagabox::outbox::OutboxWriter;
use sagabox::relay::{Relay, RelayArguments, RelayConfig, RelayMessage};
use sagabox::retention::RetentionError;
use sagabox::step::{StepError, StepHandler, StepOutcome, StepPool, StepPoolConfig};
use sagabox::transport::Transport;
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore};
use serde_json::{Value, json};
use sqlx::PgConnection;

const EFFECTS: &str = "CREATE TABLE effects (message_id TEXT NOT NULL, body JSONB NOT NULL)";
const DAY: Duration = Duration::from_secs(86_400);

/// A consumer of `consumer_type` that runs each message through the guard and writes one
/// `effects` row per applied message (no unique constraint: only the inbox keeps it
/// exact). Counts duplicates in `duplicates`.
async fn guarded_consumer(
    js: &Js,
    guard: &InboxGuard<PostgresStore>,
    consumer_type: &str,
    duplicates: Arc<AtomicU32>,
) -> ConsumerHandle {
    let consumer_type = ConsumerType::new(consumer_type).unwrap();
    let options = ConsumerOptions::new(consumer_type.clone(), ["charge"])
        .checked_against(guard.config().clone());
    let guard = guard.clone();
    Consumer::spawn(js.config.clone(), options, move |envelope: Envelope| {
        let (guard, consumer_type, duplicates) = (
            guard.clone(),
            consumer_type.clone(),
            Arc::clone(&duplicates),
        );
        async move { effects::apply(&guard, &consumer_type, &envelope, &duplicates).await }
    })
    .await
    .unwrap()
}

fn message(id: &MessageId, payload: Value) -> (Vec<u8>, HeaderMap) {
    codec::encode(&Envelope::new(id.clone(), "charge", payload).unwrap())
}

fn guard(pg_store: PostgresStore) -> InboxGuard<PostgresStore> {
    InboxGuard::new(pg_store, InboxConfig::default()).unwrap()
}

#[tokio::test]
async fn a_plain_publishers_duplicates_are_dropped_by_the_window_or_absorbed_by_the_inbox() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    js.declare("payment").await;
    let subject = js.subject("payment");
    // The same message three times under one Nats-Msg-Id: JetStream stores it once.
    let first = MessageId::new_v7();
    let mut dropped = 0;
    for _ in 0..3 {
        let (body, headers) = message(&first, json!({"cents": 100}));
        dropped += u32::from(js.publish_raw(&subject, headers, body).await);
    }
    assert_eq!(dropped, 2, "the duplicate window dropped the repeats");
    // Another three times past the window (a fresh Nats-Msg-Id each, the real id in the
    // sagabox header, as a publisher that restarted after the window would): stored
    // three times, applied once.
    let second = MessageId::new_v7();
    for n in 0..3 {
        let (body, mut headers) = message(&second, json!({"cents": 200}));
        headers.insert(codec::MESSAGE_ID_HEADER, second.as_str());
        headers.insert("Nats-Msg-Id", format!("{second}-{n}"));
        assert!(!js.publish_raw(&subject, headers, body).await);
    }
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::clone(&duplicates)).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("four acks", async || stats.acked.load(SeqCst) == 4).await;
    consumer.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 2);
    assert_eq!(duplicates.load(SeqCst), 2);
    assert_eq!(js.pending("payment").await, 0, "every message acked");
    assert_eq!(js.dead("payment").await, 0);
}

#[tokio::test]
async fn malformed_messages_are_dead_lettered_with_their_reason_and_consuming_goes_on() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    js.declare("payment").await;
    let subject = js.subject("payment");
    let with_id = |id: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        headers
    };
    js.publish_raw(
        &subject,
        HeaderMap::new(),
        br#"{"kind":"charge","payload":{}}"#.to_vec(),
    )
    .await;
    js.publish_raw(&subject, with_id("not-json"), b"{oops".to_vec())
        .await;
    js.publish_raw(
        &subject,
        with_id("refund-1"),
        br#"{"kind":"refund","payload":{}}"#.to_vec(),
    )
    .await;
    let (body, headers) = message(&MessageId::new_v7(), json!({"cents": 1}));
    js.publish_raw(&subject, headers, body).await;
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::default()).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("three dead letters and one ack", async || {
        stats.dead_lettered.load(SeqCst) == 3 && stats.acked.load(SeqCst) == 1
    })
    .await;
    consumer.stop().await;
    let reasons: Vec<String> = js
        .dead_headers("payment")
        .await
        .iter()
        .map(|headers| codec::header(headers, DEAD_REASON_HEADER).unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["missing_message_id", "not_an_envelope", "unknown_kind"]
    );
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(js.pending("payment").await, 0);
}

/// A consumer that rejects every message while `reject` holds (dead-lettered as
/// `rejected`) and applies it through the guard once it no longer does.
async fn rejecting_consumer(
    js: &Js,
    guard: &InboxGuard<PostgresStore>,
    reject: Arc<AtomicBool>,
) -> ConsumerHandle {
    let consumer_type = ConsumerType::new("payment").unwrap();
    let options = ConsumerOptions::new(consumer_type.clone(), ["charge"]);
    let guard = guard.clone();
    Consumer::spawn(js.config.clone(), options, move |envelope: Envelope| {
        let (guard, consumer_type, reject) =
            (guard.clone(), consumer_type.clone(), Arc::clone(&reject));
        async move {
            if reject.load(SeqCst) {
                return Disposition::Reject("the card is not on file".to_owned());
            }
            effects::apply(&guard, &consumer_type, &envelope, &AtomicU32::new(0)).await
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn dead_letters_are_listed_in_place_and_replayed_under_their_id_once() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    js.declare("payment").await;
    let subject = js.subject("payment");
    let ids: Vec<MessageId> = (0..3).map(|_| MessageId::new_v7()).collect();
    for (n, id) in ids.iter().enumerate() {
        let (body, headers) = message(id, json!({"cents": n}));
        js.publish_raw(&subject, headers, body).await;
    }
    js.publish_raw(
        &subject,
        {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", "refund-1");
            headers
        },
        br#"{"kind":"refund","payload":{}}"#.to_vec(),
    )
    .await;
    let reject = Arc::new(AtomicBool::new(true));
    let consumer = rejecting_consumer(&js, &guard, Arc::clone(&reject)).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("four dead letters", async || {
        stats.dead_lettered.load(SeqCst) == 4
    })
    .await;

    let transport = Transport::Nats(js.config.clone());
    let dead = DeadLetters::open(&transport, &subject).await.unwrap();
    let listed = dead.list(None).await.unwrap();
    assert_eq!(listed.total, 4);
    assert_eq!(listed.queue, format!("{subject}.dead"));
    let read: Vec<(Option<String>, Option<String>, Option<String>)> = listed
        .messages
        .iter()
        .map(|m| (m.message_id.clone(), m.reason.clone(), m.kind.clone()))
        .collect();
    let charge = |id: &MessageId| {
        (
            Some(id.to_string()),
            Some("rejected".to_owned()),
            Some("charge".to_owned()),
        )
    };
    assert_eq!(
        read,
        [
            charge(&ids[0]),
            charge(&ids[1]),
            charge(&ids[2]),
            (
                Some("refund-1".to_owned()),
                Some("unknown_kind".to_owned()),
                Some("refund".to_owned())
            ),
        ]
    );
    assert!(listed.messages[0].bytes > 0);
    assert_eq!(
        listed.messages[0].detail.as_deref(),
        Some("the card is not on file")
    );
    let again = DeadLetters::open(&transport, &format!("{subject}.dead"))
        .await
        .unwrap();
    assert_eq!(
        again.list(Some(2)).await.unwrap().messages,
        listed.messages[..2]
    );
    assert_eq!(again.count().await.unwrap(), 4, "a listing takes nothing");
    again.close().await;

    // The card is on file now: replay two of the rejected ones, then the rest of them.
    reject.store(false, SeqCst);
    let first = dead
        .replay(&ReplayOptions {
            reason: Some(DeadReason::Rejected),
            limit: Some(2),
        })
        .await
        .unwrap();
    assert_eq!((first.replayed, first.left), (2, 2));
    let rest = dead
        .replay(&ReplayOptions {
            reason: Some(DeadReason::Rejected),
            limit: None,
        })
        .await
        .unwrap();
    assert_eq!((rest.replayed, rest.left), (1, 1));
    common::wait_for("three applied", async || stats.acked.load(SeqCst) == 3).await;
    let left = dead.list(None).await.unwrap();
    assert_eq!(left.messages.len(), 1);
    assert_eq!(left.messages[0].message_id.as_deref(), Some("refund-1"));

    // A replayed copy of an applied message is answered by the inbox, not applied again.
    // (Under a Nats-Msg-Id of its own: the dead-letter stream's window drops a repeat.)
    let (body, mut headers) = message(&ids[0], json!({"cents": 0}));
    headers.insert(DEAD_REASON_HEADER, "rejected");
    headers.insert(codec::MESSAGE_ID_HEADER, ids[0].as_str());
    headers.insert("Nats-Msg-Id", format!("{}-copy", ids[0]));
    js.publish_raw(&format!("{subject}.dead"), headers, body)
        .await;
    let once_more = dead.replay(&ReplayOptions::default()).await.unwrap();
    assert_eq!(once_more.replayed, 2, "the applied one and the refund");
    common::wait_for("the copy acked, the refund dead again", async || {
        stats.acked.load(SeqCst) == 4 && stats.dead_lettered.load(SeqCst) == 5
    })
    .await;
    consumer.stop().await;
    let replays = dead.list(None).await.unwrap();
    assert_eq!(replays.messages[0].replayed, Some(1));
    dead.close().await;
    let applied: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY 1")
        .fetch_all(&pg.pool)
        .await
        .unwrap();
    let mut expected: Vec<String> = ids.iter().map(ToString::to_string).collect();
    expected.sort();
    assert_eq!(applied, expected, "each applied once");
    assert_eq!(js.pending("payment").await, 0);
}

#[tokio::test]
async fn dead_letters_of_a_subject_without_streams_are_not_found() {
    let js = Js::new(&["payment"]).await;
    let transport = Transport::Nats(js.config.clone());
    let subject = js.subject("payment");
    let error = DeadLetters::open(&transport, &subject).await.unwrap_err();
    assert!(
        matches!(
            &error,
            DlqError::QueueNotFound {
                broker: "NATS JetStream",
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("_dead"), "{error}");
    let error = DeadLetters::open(&transport, "sagabox.*")
        .await
        .unwrap_err();
    assert!(matches!(error, DlqError::InvalidQueue { .. }), "{error}");
}

#[tokio::test]
async fn a_consumer_dropped_between_commit_and_ack_gets_a_duplicate_and_one_side_effect() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    js.declare("payment").await;
    let (body, headers) = message(&MessageId::new_v7(), json!({}));
    js.publish_raw(&js.subject("payment"), headers, body).await;

    // The first consumer commits, then hangs before its ack until it is dropped.
    let (committed, mut committed_rx) = tokio::sync::mpsc::unbounded_channel();
    let crashing = {
        let guard = guard.clone();
        let payment = Js::consumer_type("payment");
        Consumer::spawn(
            js.config.clone(),
            ConsumerOptions::new(payment.clone(), ["charge"]),
            move |envelope: Envelope| {
                let (guard, payment, committed) =
                    (guard.clone(), payment.clone(), committed.clone());
                async move {
                    guard
                        .process(&payment, &envelope, async |conn, envelope| {
                            sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
                                .bind(envelope.id.as_str())
                                .bind(&envelope.payload)
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(json!({}))
                        })
                        .await
                        .unwrap();
                    committed.send(()).unwrap();
                    std::future::pending::<Disposition>().await
                }
            },
        )
        .await
        .unwrap()
    };
    committed_rx.recv().await.unwrap();
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    crashing.abort();

    // Redelivered after ack_wait to the next consumer on the same durable consumer.
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::clone(&duplicates)).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("the redelivery", async || stats.acked.load(SeqCst) == 1).await;
    consumer.stop().await;
    assert_eq!(duplicates.load(SeqCst), 1, "the redelivery was a duplicate");
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(js.pending("payment").await, 0);
}

#[tokio::test]
async fn a_retryable_failure_is_redelivered_then_dead_lettered_when_it_keeps_failing() {
    let js = Js::new(&["payment"]).await;
    let mut config = js.config.clone();
    config.max_deliver = 3;
    let calls = Arc::new(AtomicU32::new(0));
    let consumer = {
        let calls = Arc::clone(&calls);
        Consumer::spawn(
            config,
            ConsumerOptions::new(Js::consumer_type("payment"), ["charge"]),
            move |envelope: Envelope| {
                let calls = Arc::clone(&calls);
                async move {
                    let n = calls.fetch_add(1, SeqCst);
                    match envelope.payload["flaky"].as_bool() {
                        Some(true) if n == 0 => Disposition::Retry("database restarting".into()),
                        Some(true) => Disposition::Done { reply: None },
                        _ => Disposition::Retry("always down".into()),
                    }
                }
            },
        )
        .await
        .unwrap()
    };
    let (body, headers) = message(&MessageId::new_v7(), json!({"flaky": true}));
    js.publish_raw(&js.subject("payment"), headers, body).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for(
        "the flaky message redelivered once, then done",
        async || stats.acked.load(SeqCst) == 1 && stats.requeued.load(SeqCst) == 1,
    )
    .await;
    let (body, headers) = message(&MessageId::new_v7(), json!({"flaky": false}));
    js.publish_raw(&js.subject("payment"), headers, body).await;
    common::wait_for("the broken message dead-lettered", async || {
        stats.dead_lettered.load(SeqCst) == 1
    })
    .await;
    consumer.stop().await;
    assert_eq!(
        stats.requeued.load(SeqCst),
        1 + 2,
        "redelivered twice before the third failure"
    );
    let dead = js.dead_headers("payment").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        codec::header(&dead[0], DEAD_REASON_HEADER).as_deref(),
        Some("retries_exhausted")
    );
    assert_eq!(js.pending("payment").await, 0);
}

struct Charges;

impl StepHandler<sqlx::Postgres> for Charges {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        if envelope.payload["decline"].as_bool() == Some(true) {
            return Err(StepError::Permanent("card declined".into()));
        }
        sqlx::query("INSERT INTO effects (message_id, body) VALUES ($1, $2)")
            .bind(envelope.id.as_str())
            .bind(&envelope.payload)
            .execute(&mut *conn)
            .await
            .map_err(|error| StepError::Retryable(error.to_string()))?;
        Ok(json!({"charged": envelope.payload["cents"]}))
    }
}

#[tokio::test]
async fn the_orchestrator_reaches_a_step_through_jetstream_and_repeats_get_the_first_answer() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(8).await);
    let payment = Js::consumer_type("payment");
    let pool = StepPool::spawn(
        guard.clone(),
        payment.clone(),
        Charges,
        StepPoolConfig::default(),
    )
    .await
    .unwrap();
    let step = serve_step(
        js.config.clone(),
        Arc::new(pool),
        ["charge".to_owned()],
        Duration::from_secs(5),
        1,
        guard.config(),
    )
    .await
    .unwrap();
    let dispatch = Arc::new(
        NatsDispatch::connect(
            js.config.clone(),
            ConsumerType::new("orchestrator").unwrap(),
        )
        .await
        .unwrap(),
    );
    let command = Envelope::new(MessageId::new_v7(), "charge", json!({"cents": 700})).unwrap();
    // Sent five times at once, as retries after lost replies would be: JetStream drops
    // the repeats as duplicates, the dispatch sends them past the window, and the step's
    // inbox answers each with the first result.
    let mut sends = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (dispatch, payment, command) =
            (Arc::clone(&dispatch), payment.clone(), command.clone());
        sends.spawn(async move {
            dispatch
                .dispatch(&payment, command, Duration::from_secs(10))
                .await
        });
    }
    while let Some(answer) = sends.join_next().await {
        let reply = answer
            .unwrap()
            .unwrap_or_else(|failure| panic!("dispatch failed: {failure}"));
        assert_eq!(reply.outcome, StepOutcome::Done(json!({"charged": 700})));
    }
    let declined = Envelope::new(MessageId::new_v7(), "charge", json!({"decline": true})).unwrap();
    let reply = dispatch
        .dispatch(&payment, declined.clone(), Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(reply.outcome, StepOutcome::Refused("card declined".into()));
    let again = dispatch
        .dispatch(&payment, declined, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(again.outcome, StepOutcome::Refused("card declined".into()));
    assert!(
        again.duplicate,
        "the second send was answered from the step's inbox"
    );
    dispatch.stop().await;
    step.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(js.pending("payment").await, 0);
}

/// Creates `consumer_type`'s work stream by hand, with `max_age` (zero: none).
async fn stream_kept_for(js: &Js, consumer_type: &str, max_age: Duration) {
    let consumer_type = Js::consumer_type(consumer_type);
    js.context
        .create_stream(stream::Config {
            name: js.config.stream(&consumer_type),
            subjects: vec![js.config.subject(&consumer_type)],
            retention: RetentionPolicy::WorkQueue,
            max_age,
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_stream_that_keeps_messages_longer_than_the_ttl_refuses_the_start() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment", "email"]).await);
    let guard =
        InboxGuard::new(pg.store(2).await, InboxConfig::default().with_ttl(30 * DAY)).unwrap();
    stream_kept_for(&js, "payment", 45 * DAY).await;
    let options = ConsumerOptions::new(Js::consumer_type("payment"), ["charge"])
        .checked_against(guard.config().clone());
    let error = Consumer::spawn(js.config.clone(), options, |_: Envelope| async {
        Disposition::Done { reply: None }
    })
    .await
    .unwrap_err();
    assert!(
        matches!(
            error,
            NatsError::Retention(RetentionError::LongerThanTtl { .. })
        ),
        "{error}"
    );
    let text = error.to_string();
    for part in ["45.0 days", "30.0 days", "max_age", "--ttl-days"] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    // A stream the library creates gets the configured retention and passes.
    let options = ConsumerOptions::new(Js::consumer_type("email"), ["send"])
        .checked_against(guard.config().clone());
    let consumer = Consumer::spawn(js.config.clone(), options, |_: Envelope| async {
        Disposition::Done { reply: None }
    })
    .await
    .unwrap();
    consumer.stop().await;
}

#[tokio::test]
async fn a_stream_without_max_age_is_refused_unless_forced() {
    let js = Js::new(&["payment"]).await;
    stream_kept_for(&js, "payment", Duration::ZERO).await;
    let spawn = |inbox: InboxConfig| {
        let options =
            ConsumerOptions::new(Js::consumer_type("payment"), ["charge"]).checked_against(inbox);
        Consumer::spawn(js.config.clone(), options, |_: Envelope| async {
            Disposition::Done { reply: None }
        })
    };
    let error = spawn(InboxConfig::default()).await.unwrap_err();
    assert!(
        matches!(
            error,
            NatsError::Retention(RetentionError::Unbounded { .. })
        ),
        "{error}"
    );
    assert!(error.to_string().contains("--force-short-ttl"), "{error}");
    let forced = spawn(InboxConfig::default().with_ttl_below_retention_allowed(true))
        .await
        .unwrap();
    forced.stop().await;
}

/// `orchestrate` checks its start streams against its own inbox: refused when the
/// stream keeps messages longer than the TTL, run when that inbox allows it.
#[tokio::test]
async fn orchestrate_refuses_a_start_stream_longer_than_its_ttl_unless_its_inbox_allows_it() {
    const SAGA: &str = r#"
name = "ping"

[[steps]]
name = "ping"
consumer_type = "pong"
command = "ping"
timeout = "5s"
"#;
    let (pg, js) = (Pg::new().await, Js::new(&["ping.start", "pong"]).await);
    stream_kept_for(&js, "ping.start", 45 * DAY).await;
    let run = async |inbox: InboxConfig| {
        let config = sagabox::orchestrate::OrchestrateConfig {
            definitions: vec![sagabox::saga::SagaDefinition::from_toml_str(SAGA).unwrap()],
            transport: js.config.clone().into(),
            resume_interval: Duration::from_secs(1),
            history_retention: None,
            inbox,
            pruner: None,
        };
        let stop = tokio::time::sleep(Duration::from_secs(1));
        sagabox::orchestrate::orchestrate(pg.store(4).await, config, stop).await
    };
    let refused = run(InboxConfig::default().with_ttl(30 * DAY))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            sagabox::orchestrate::OrchestrateError::Transport(
                sagabox::transport::TransportError::Nats(NatsError::Retention(
                    RetentionError::LongerThanTtl { .. }
                ))
            )
        ),
        "{refused}"
    );
    let text = refused.to_string();
    for part in ["45.0 days", "30.0 days", "max_age", "--force-short-ttl"] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    run(InboxConfig::default()
        .with_ttl(30 * DAY)
        .with_ttl_below_retention_allowed(true))
    .await
    .expect("the inbox allows a shorter TTL: orchestrate runs and stops cleanly");
}

#[tokio::test]
/// A server restarted by its operator (SIGTERM, then started on the same store).
async fn a_server_restarted_under_a_running_consumer_loses_nothing_and_applies_once() {
    restarted_under_a_consumer(false).await;
}

/// A server killed (SIGKILL) and started again: nothing is applied twice, and every
/// message sent after the restart is applied. What the server had stored before the
/// crash is JetStream's durability, not sagabox's: version 2.9 syncs its file store on an
/// interval, and was seen to lose or strand (keep in the work queue without delivering
/// again) a few acknowledged messages; the test reports how many.
#[tokio::test]
async fn a_server_killed_under_a_running_consumer_loses_nothing_and_applies_once() {
    restarted_under_a_consumer(true).await;
}

async fn restarted_under_a_consumer(crash: bool) {
    let mut server = OwnServer::start().await;
    let (pg, js) = (Pg::new().await, Js::on(&server.url(), &["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::clone(&duplicates)).await;
    let publish = async |from: u32, to: u32| {
        for n in from..to {
            let (body, headers) =
                message(&MessageId::new(format!("m-{n}")).unwrap(), json!({"n": n}));
            js.publish_raw(&js.subject("payment"), headers, body).await;
        }
    };
    publish(0, 50).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("a first part applied", async || {
        stats.acked.load(SeqCst) >= 10
    })
    .await;
    if crash {
        server.kill();
    }
    server.restart().await;
    // The publisher's client reconnects too; what it sends after the restart arrives.
    publish(50, 100).await;
    if crash {
        // What the server stored before a SIGKILL is JetStream's to keep (version 2.9
        // syncs its file store on an interval): the messages sent after the restart must
        // all be applied, and nothing may be applied twice.
        common::wait_for("every message sent after the restart applied", async || {
            pg.scalar(
                "SELECT COUNT(DISTINCT message_id) FROM effects WHERE (body->>'n')::int >= 50",
            )
            .await
                == 50
        })
        .await;
        // Redeliveries of what the crash left unacked come after ack_wait (2 s here).
        tokio::time::sleep(Duration::from_secs(6)).await;
    } else {
        common::wait_for("every message applied after the restart", async || {
            pg.scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
                .await
                == 100
                && js.pending("payment").await == 0
        })
        .await;
    }
    consumer.stop().await;
    let applied = pg
        .scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
        .await;
    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM effects").await,
        applied,
        "each message applied at most once"
    );
    assert_eq!(js.dead("payment").await, 0);
    if crash {
        eprintln!(
            "after the crash: {applied} of 100 applied, {} left in the work queue",
            js.pending("payment").await
        );
    } else {
        assert_eq!(applied, 100, "nothing lost");
    }
}

/// Fails every UPDATE of the outbox while `fail_marks` has a row: a relay that
/// published and then could not mark — what a crash between the two leaves.
const FAIL_MARKS: &str = "
CREATE TABLE fail_marks (armed BOOLEAN);
INSERT INTO fail_marks VALUES (true);
CREATE FUNCTION fail_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM fail_marks) THEN RAISE EXCEPTION 'relay crashed before marking'; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_mark BEFORE UPDATE ON sagabox_outbox FOR EACH ROW EXECUTE FUNCTION fail_mark();";

async fn write_outbox(pg: &Pg, aggregates: usize, per_aggregate: usize) {
    let payment = Js::consumer_type("payment");
    let mut tx = pg.pool.begin().await.unwrap();
    for n in 0..per_aggregate {
        for a in 0..aggregates {
            let out =
                <PgConnection as OutboxWriter>::message("charge", json!({"aggregate": a, "n": n}))
                    .unwrap();
            (*tx)
                .publish(&payment, &format!("order-{a}"), &out)
                .await
                .unwrap();
        }
    }
    tx.commit().await.unwrap();
}

async fn spawn_relay(
    source: sqlx::PgPool,
    js: &Js,
) -> (ractor::ActorRef<RelayMessage>, tokio::task::JoinHandle<()>) {
    let arguments = RelayArguments {
        source,
        transport: js.config.clone().into(),
        config: RelayConfig {
            batch: 20,
            poll_interval: Duration::from_millis(10),
            ..RelayConfig::default()
        },
    };
    let (relay, handle) = ractor::Actor::spawn(None, Relay::new(), arguments)
        .await
        .unwrap();
    (relay, handle)
}

#[tokio::test]
async fn rows_a_relay_published_before_failing_to_mark_go_again_and_the_window_drops_them() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    pg.exec(FAIL_MARKS).await;
    write_outbox(&pg, 1, 5).await;
    let guard = guard(pg.store(4).await);
    let (relay, relay_handle) = spawn_relay(pg.pool.clone(), &js).await;
    // Published, then the mark fails: the rows stay pending.
    let flushed = ractor::call!(relay, RelayMessage::Flush).unwrap();
    assert!(
        flushed
            .unwrap_err()
            .contains("relay crashed before marking")
    );
    assert_eq!(js.pending("payment").await, 5);
    pg.exec("DELETE FROM fail_marks").await;
    common::wait_for("the rows marked sent", async || {
        pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
            .await
            == 0
    })
    .await;
    relay.stop(None);
    relay_handle.await.unwrap();
    // Published twice under the same Nats-Msg-Id: JetStream kept one copy of each.
    assert_eq!(js.pending("payment").await, 5);
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::clone(&duplicates)).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("five deliveries", async || stats.acked.load(SeqCst) == 5).await;
    consumer.stop().await;
    assert_eq!(
        pg.scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
            .await,
        5
    );
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 5);
    assert_eq!(js.pending("payment").await, 0);
}

#[tokio::test]
async fn several_relays_publish_each_row_once_in_order_per_aggregate() {
    const AGGREGATES: usize = 8;
    const PER_AGGREGATE: usize = 40;
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    write_outbox(&pg, AGGREGATES, PER_AGGREGATE).await;
    let mut relays = Vec::new();
    for _ in 0..4 {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&pg.url)
            .await
            .unwrap();
        relays.push(spawn_relay(pool, &js).await);
    }
    common::wait_for("every row sent", async || {
        pg.scalar("SELECT COUNT(*) FROM sagabox_outbox WHERE sent_at IS NULL")
            .await
            == 0
    })
    .await;
    for (relay, handle) in relays {
        relay.stop(None);
        handle.await.unwrap();
    }
    let total = (AGGREGATES * PER_AGGREGATE) as u64;
    assert_eq!(js.pending("payment").await, total, "each row stored once");
    // The stream's order, read by sequence, is the order per aggregate.
    let stream = js
        .context
        .get_stream(js.config.stream(&Js::consumer_type("payment")))
        .await
        .unwrap();
    let mut seen: HashMap<u64, Vec<u64>> = HashMap::new();
    for sequence in 1..=total {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let envelope = codec::decode(
            Some(&message.headers),
            &message.payload,
            &Default::default(),
        )
        .unwrap();
        seen.entry(envelope.payload["aggregate"].as_u64().unwrap())
            .or_default()
            .push(envelope.payload["n"].as_u64().unwrap());
    }
    assert_eq!(seen.len(), AGGREGATES);
    for (aggregate, ns) in seen {
        let expected: Vec<u64> = (0..PER_AGGREGATE as u64).collect();
        assert_eq!(
            ns, expected,
            "aggregate {aggregate} out of order or repeated"
        );
    }
}
