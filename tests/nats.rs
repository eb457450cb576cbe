//! What only the NATS JetStream transport has, against a real server and real PostgreSQL
//! (what every broker does is `tests/broker.rs`): a plain publisher's repeats dropped by
//! JetStream's duplicate window, dead letters kept in a stream, listed in place and
//! replayed under their id, the stream's retention checked against the inbox TTL, and
//! a server restarted or killed under a running consumer.

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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::stream::{self, RetentionPolicy};
use common::{Pg, effects};
use jetstream::{Js, OwnServer};
use sagabox::consumer::ConsumerHandle;
use sagabox::dead_reason::{DEAD_REASON_HEADER, DeadReason};
use sagabox::delivery::Disposition;
use sagabox::dlq::{DeadLetters, DlqError, ReplayOptions};
use sagabox::nats::{Consumer, ConsumerOptions, NatsError, codec};
use sagabox::retention::RetentionError;
use sagabox::transport::Transport;
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, PostgresStore};
use serde_json::{Value, json};

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
    let handler = effects::guarded(guard, &consumer_type, duplicates);
    Consumer::spawn(js.config.clone(), options, handler)
        .await
        .unwrap()
}

fn message(id: &MessageId, payload: Value) -> (Vec<u8>, HeaderMap) {
    codec::encode(&Envelope::new(id.clone(), "charge", payload).unwrap())
}

fn guard(pg_store: PostgresStore) -> InboxGuard<PostgresStore> {
    InboxGuard::new(pg_store, InboxConfig::default()).unwrap()
}

/// A plain publisher's repeats under one `Nats-Msg-Id` are dropped by JetStream's
/// duplicate window: stored once, applied once, never seen by the inbox. (Repeats past
/// the window, under ids of their own, are the broker suite's: the inbox absorbs them.)
#[tokio::test]
async fn a_plain_publishers_repeats_under_one_id_are_dropped_by_the_window() {
    let (pg, js) = (Pg::new().await, Js::new(&["payment"]).await);
    pg.exec(EFFECTS).await;
    let guard = guard(pg.store(4).await);
    js.declare("payment").await;
    let subject = js.subject("payment");
    let id = MessageId::new_v7();
    let mut dropped = 0;
    for _ in 0..3 {
        let (body, headers) = message(&id, json!({"cents": 100}));
        dropped += u32::from(js.publish_raw(&subject, headers, body).await);
    }
    assert_eq!(dropped, 2, "the duplicate window dropped the repeats");
    assert_eq!(js.pending("payment").await, 1, "stored once");
    let duplicates = Arc::new(AtomicU32::new(0));
    let consumer = guarded_consumer(&js, &guard, "payment", Arc::clone(&duplicates)).await;
    let stats = Arc::clone(consumer.stats());
    common::wait_for("one ack", async || stats.acked.load(SeqCst) == 1).await;
    consumer.stop().await;
    assert_eq!(pg.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(duplicates.load(SeqCst), 0, "the inbox never saw a repeat");
    assert_eq!(js.pending("payment").await, 0, "acked");
    assert_eq!(js.dead("payment").await, 0);
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
