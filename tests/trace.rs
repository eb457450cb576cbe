//! Traces across a real RabbitMQ hop: an orchestrator with `AmqpDispatch` and a
//! `Participant` consuming its commands (in this process, over the broker), with every
//! span recorded by the OpenTelemetry SDK's in-memory exporter. One saga is one trace,
//! whose id comes from the saga's id; a participant's span for a command is the child of
//! the orchestrator's `saga.step` span that sent it; an outbox row a handler writes
//! carries the handler's context; a malformed `traceparent` starts a new trace and is
//! never dead-lettered.

#![allow(clippy::unwrap_used)]

// Refused rather than skipped: under `cargo test -p sagabox` the library's default features
// leave some of these out, and a suite that silently does not run proves nothing.
#[cfg(not(all(feature = "postgres", feature = "rabbitmq", feature = "otel")))]
compile_error!(
    "tests/trace.rs needs the features postgres, rabbitmq and otel: run `cargo test` at the workspace's root, \
     or `cargo test -p sagabox --all-features`"
);

mod common;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::Pg;
use common::rabbit::Rabbit;
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use ractor::Actor;
use sagabox::amqp::{AmqpDispatch, Consumer, ConsumerOptions, codec};
use sagabox::delivery::Disposition;
use sagabox::orchestrator::{Orchestrator, OrchestratorArguments, OrchestratorMessage};
use sagabox::outbox::OutboxWriter;
use sagabox::participant::StepOptions;
use sagabox::saga::SagaDefinition;
use sagabox::step::{StepError, StepHandler};
use sagabox::trace::{TRACEPARENT, TraceParent, saga_trace_id};
use sagabox::{ConsumerType, Envelope, MessageId, Participant, PostgresStore};
use serde_json::{Value, json};
use sqlx::PgConnection;
use tracing_subscriber::layer::SubscriberExt;

const TRIP: &str = r#"
name = "trip"

[[steps]]
name = "hotel"
consumer_type = "hotel"
command = "book_hotel"
compensation = "cancel_hotel"
timeout = "10s"

[[steps]]
name = "flight"
consumer_type = "flight"
command = "book_flight"
timeout = "10s"
"#;

/// The exporter every test of this binary records into: one global subscriber, since
/// the spans are opened on the runtime's and the actors' threads. Tests tell their spans
/// apart by trace id.
fn exporter() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        (exporter, provider)
    })
}

fn spans() -> Vec<SpanData> {
    let (exporter, provider) = exporter();
    provider.force_flush().unwrap();
    exporter.get_finished_spans().unwrap()
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<std::borrow::Cow<'a, str>> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str())
}

/// Books: writes an outbox row (a notice for another service) in its transaction.
#[derive(Debug)]
struct Books;

impl StepHandler<sqlx::Postgres> for Books {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        envelope: &Envelope,
    ) -> Result<Value, StepError> {
        let mut notice =
            <PgConnection as OutboxWriter>::message("booked", json!({"kind": envelope.kind}))
                .map_err(|error| StepError::Permanent(error.to_string()))?;
        notice.saga_id = envelope.saga_id.clone();
        let notify = ConsumerType::new("notify").unwrap();
        conn.publish(
            &notify,
            envelope.saga_id.as_deref().unwrap_or("none"),
            &notice,
        )
        .await
        .map_err(|error| StepError::Retryable(error.to_string()))?;
        Ok(json!({"booked": envelope.kind}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_saga_is_one_trace_across_the_broker() {
    exporter();
    let (pg, rabbit) = (
        Pg::new().await,
        Rabbit::new(&["hotel", "flight", "notify"]).await,
    );
    let participant = Participant::new(pg.store(8).await, rabbit.config.clone())
        .step("hotel", Books)
        // Batched claims: the batch runs in a task of its own, and each command's span
        // must still continue its own delivery's context.
        .step_with("flight", Books, StepOptions::default().batch(4))
        .workers(2)
        .start()
        .await
        .unwrap();
    let dispatch = AmqpDispatch::connect(
        rabbit.config.clone(),
        ConsumerType::new("orchestrator").unwrap(),
    )
    .await
    .unwrap();
    let dispatch = Arc::new(dispatch);
    let store: PostgresStore = pg.store(4).await;
    let (orchestrator, handle) = Actor::spawn(
        None,
        Orchestrator::new(),
        OrchestratorArguments::new(
            Arc::new(SagaDefinition::from_toml_str(TRIP).unwrap()),
            store,
            Arc::clone(&dispatch),
        ),
    )
    .await
    .unwrap();

    let mut sagas = Vec::new();
    for n in 0..2 {
        let start = Envelope::new(MessageId::new_v7(), "trip", json!({"n": n})).unwrap();
        let id = ractor::call_t!(orchestrator, OrchestratorMessage::Start, 10_000, start)
            .unwrap()
            .unwrap();
        sagas.push(id);
    }
    for id in &sagas {
        ractor::call_t!(orchestrator, OrchestratorMessage::Run, 60_000, id.clone())
            .unwrap()
            .unwrap();
    }
    orchestrator.stop(None);
    handle.await.unwrap();
    dispatch.stop().await;
    participant.stop().await.unwrap();
    assert_eq!(
        pg.scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status = 'completed'")
            .await,
        2
    );

    let spans = spans();
    let by_id: HashMap<SpanId, &SpanData> = spans
        .iter()
        .map(|span| (span.span_context.span_id(), span))
        .collect();
    let mut traces = Vec::new();
    for saga in &sagas {
        let trace_id = TraceId::from_bytes(saga_trace_id(saga));
        traces.push(trace_id);
        let of_saga: Vec<&SpanData> = spans
            .iter()
            .filter(|span| attribute(span, "saga_id").as_deref() == Some(saga.as_str()))
            .collect();
        // Every span that names the saga is in its trace.
        for span in &of_saga {
            assert_eq!(
                span.span_context.trace_id(),
                trace_id,
                "{} of saga {saga} is in another trace",
                span.name
            );
        }
        let count = |name: &str| of_saga.iter().filter(|span| span.name == name).count();
        // `Run` of a saga that finished first drives it once more, to find it done.
        assert!((1..=2).contains(&count("saga")), "one drive or two");
        assert_eq!(count("saga.step"), 2, "two step attempts");
        // Two commands consumed by the participant, two replies by the orchestrator.
        assert_eq!(count("amqp.consume"), 4);
        assert_eq!(count("step.handle"), 2);
        // And nothing of the saga sits in a trace of its own: every span of the trace
        // hangs off another span of it, but for the `saga` span and its virtual root.
        for span in spans
            .iter()
            .filter(|span| span.span_context.trace_id() == trace_id)
        {
            if span.name == "saga" {
                assert!(span.parent_span_is_remote, "the saga's root is virtual");
                continue;
            }
            assert!(
                by_id.contains_key(&span.parent_span_id),
                "{} has a parent outside the recorded trace",
                span.name
            );
        }

        // The participant's span for each command is a child of the `saga.step` span
        // that sent it, and the step worker's span a child of that.
        for (step, kind) in [("hotel", "book_hotel"), ("flight", "book_flight")] {
            let consumed = of_saga
                .iter()
                .find(|span| {
                    span.name == "amqp.consume" && attribute(span, "kind").as_deref() == Some(kind)
                })
                .unwrap_or_else(|| panic!("no amqp.consume span for {kind}"));
            assert!(
                consumed.parent_span_is_remote,
                "its parent came over the wire"
            );
            let sender = by_id
                .get(&consumed.parent_span_id)
                .unwrap_or_else(|| panic!("the parent of {kind}'s consumer span was recorded"));
            assert_eq!(sender.name, "saga.step");
            assert_eq!(attribute(sender, "step").as_deref(), Some(step));
            assert_eq!(attribute(sender, "saga_id").as_deref(), Some(saga.as_str()));
            let handled = of_saga
                .iter()
                .find(|span| {
                    span.name == "step.handle" && attribute(span, "kind").as_deref() == Some(kind)
                })
                .unwrap();
            assert_eq!(handled.parent_span_id, consumed.span_context.span_id());
        }

        // The outbox rows the handlers wrote carry the handler's context.
        let headers: Vec<sqlx::types::Json<HashMap<String, String>>> =
            sqlx::query_scalar("SELECT headers FROM sagabox_outbox WHERE saga_id = $1")
                .bind(saga)
                .fetch_all(&pg.pool)
                .await
                .unwrap();
        assert_eq!(headers.len(), 2);
        for row in headers {
            let parent = TraceParent::parse(&row.0[TRACEPARENT]).unwrap();
            assert_eq!(parent.trace_id, saga_trace_id(saga));
            let writer = by_id
                .get(&SpanId::from_bytes(parent.span_id))
                .expect("the row names a recorded span");
            assert!(
                ["step.handle", "inbox.process"].contains(&&*writer.name),
                "written under {}",
                writer.name
            );
        }
    }
    assert_ne!(traces[0], traces[1], "two sagas, two traces");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_traceparent_starts_a_new_trace_and_is_not_dead_lettered() {
    exporter();
    let rabbit = Rabbit::new(&["audit"]).await;
    rabbit.declare("audit").await;
    let (seen, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let consumer = Consumer::spawn(
        rabbit.config.clone(),
        ConsumerOptions::new(ConsumerType::new("audit").unwrap(), ["note"]),
        move |envelope: Envelope| {
            let seen = seen.clone();
            async move {
                let _ = seen.send(envelope.id.clone());
                Disposition::Done { reply: None }
            }
        },
    )
    .await
    .unwrap();
    let ids: Vec<String> = (0..3).map(|_| MessageId::new_v7().to_string()).collect();
    for (id, traceparent) in ids.iter().zip([
        "junk",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    ]) {
        let envelope = Envelope::new(MessageId::new(id.as_str()).unwrap(), "note", json!({}))
            .unwrap()
            .with_header(TRACEPARENT, traceparent);
        let (body, properties) = codec::encode(&envelope);
        // The AMQP header says the same junk, as a publisher that set both would.
        let properties: BasicProperties = codec::with_headers(
            properties,
            [(TRACEPARENT, AMQPValue::LongString(traceparent.into()))],
        );
        rabbit
            .publish_raw(&rabbit.queue("audit"), &body, properties)
            .await;
    }
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(20), seen_rx.recv())
            .await
            .expect("every message handled")
            .unwrap();
    }
    let stats = Arc::clone(consumer.stats());
    consumer.stop().await;
    assert_eq!(
        stats
            .dead_lettered
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    assert_eq!(rabbit.ready(&rabbit.dead_queue("audit")).await, 0);

    let spans = spans();
    // The trace the third header names, had its extra field been allowed.
    let named = TraceId::from_bytes(0x4bf92f3577b34da6a3ce929d0e0e4736u128.to_be_bytes());
    for id in &ids {
        let span = spans
            .iter()
            .find(|span| {
                span.name == "amqp.consume" && attribute(span, "message_id").as_deref() == Some(id)
            })
            .unwrap_or_else(|| panic!("a span for {id}"));
        assert_eq!(span.parent_span_id, SpanId::INVALID, "a root: a new trace");
        assert!(span.span_context.is_valid());
        assert_ne!(span.span_context.trace_id(), named);
    }
}
