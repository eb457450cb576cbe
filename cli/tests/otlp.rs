//! One saga is one trace across processes: the orchestrator (`sagabox demo
//! --external-participants`) and the participants (`sagabox serve`) as two real
//! processes, over RabbitMQ and over NATS JetStream, both exporting their spans over
//! OTLP/HTTP (`--otlp-endpoint`) to a receiver this test runs, which decodes what they
//! send as a collector would. Every command a participant consumed is in its saga's
//! trace, its span the child of the orchestrator's `saga.step` span that sent it, and
//! the step worker's span the child of that.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::collections::HashMap;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

/// Sagas each run starts.
const ORDERS: usize = 3;

/// One span as the receiver got it.
#[derive(Debug, Clone)]
struct Received {
    /// The `service.name` of the process that sent it.
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    attributes: HashMap<String, String>,
}

type Spans = Arc<Mutex<Vec<Received>>>;

fn text(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(value) => Some((kv.key.clone(), value.clone())),
            AnyValue::IntValue(value) => Some((kv.key.clone(), value.to_string())),
            _ => None,
        })
        .collect()
}

/// `POST /v1/traces`: an OTLP/HTTP export request in protobuf, as a collector takes it.
async fn record(State(spans): State<Spans>, body: Bytes) -> (StatusCode, Vec<u8>) {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut recorded = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .map(|resource| text(&resource.attributes))
            .and_then(|attributes| attributes.get("service.name").cloned())
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                recorded.push(Received {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id,
                    span_id: span.span_id,
                    parent_span_id: span.parent_span_id,
                    attributes: text(&span.attributes),
                });
            }
        }
    }
    // An empty ExportTraceServiceResponse: everything accepted.
    (StatusCode::OK, Vec::new())
}

/// A receiver on a port of its own: its base URL, and what it has received.
async fn receiver() -> (String, Spans) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let spans = Spans::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(record))
        .with_state(Arc::clone(&spans));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, spans)
}

/// `sagabox <args>`, stderr kept for a failure's message.
fn spawn(args: &[&str]) -> Child {
    common::sagabox_command(args)
        .env("RUST_LOG", "error")
        .env_remove("OTEL_SERVICE_NAME")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sagabox")
}

/// Runs `ORDERS` checkout sagas over `transport` (queues or subjects under `prefix`),
/// the orchestrator and the participants two processes exporting to a receiver, and
/// checks the traces they sent.
async fn one_trace_per_saga_over(transport: &str, prefix: &str, consume_span: &str) {
    let (endpoint, spans) = receiver().await;
    let fx = common::Pg::new().await;
    // Both processes on the same database, broker and queues, exporting to the receiver.
    let start = |args: &[&str]| {
        let shared = [
            "--database-url",
            fx.url.as_str(),
            "--transport",
            transport,
            "--queue-prefix",
            prefix,
            "--otlp-endpoint",
            endpoint.as_str(),
        ];
        spawn(&[args, &shared].concat())
    };
    let serve = start(&["serve", "--role", "payment,inventory,email"]);
    let mut serve = common::children::Children::new(vec![serve]);
    let orders = ORDERS.to_string();
    let demo = start(&[
        "demo",
        "--external-participants",
        "--orders",
        &orders,
        "--duplicate-rate",
        "0",
        "--lost-reply-rate",
        "0",
        "--fail-rate",
        "0",
        "--decline-rate",
        "0",
        "--json",
    ]);
    let output = tokio::task::spawn_blocking(move || demo.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        output.status.success(),
        "the demo failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stderr = common::cluster_run::stop_participants(&mut serve.0, "");

    // Both processes flush their spans as they exit; the receiver may still be reading.
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = spans.lock().unwrap().clone();
        let services: Vec<&str> = spans.iter().map(|span| span.service.as_str()).collect();
        if services.contains(&"sagabox-demo") && services.contains(&"sagabox-serve") {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans from both processes, got {services:?}; serve said: {stderr}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let by_id: HashMap<&[u8], &Received> = spans
        .iter()
        .map(|span| (span.span_id.as_slice(), span))
        .collect();
    let consumed: Vec<&Received> = spans
        .iter()
        .filter(|span| span.service == "sagabox-serve" && span.name == consume_span)
        .collect();
    let mut sagas = std::collections::BTreeSet::new();
    for span in &consumed {
        let saga = span.attributes.get("saga_id").expect("the saga's id");
        let sender = by_id
            .get(span.parent_span_id.as_slice())
            .unwrap_or_else(|| panic!("the parent of {span:?} was received"));
        assert_eq!(sender.service, "sagabox-demo", "sent by the orchestrator");
        assert_eq!(sender.name, "saga.step");
        assert_eq!(sender.attributes.get("saga_id"), Some(saga));
        assert_eq!(
            sender.trace_id, span.trace_id,
            "one trace across the processes"
        );
        let handled = spans
            .iter()
            .find(|handled| handled.name == "step.handle" && handled.parent_span_id == span.span_id)
            .unwrap_or_else(|| panic!("no step.handle span under {span:?}"));
        assert_eq!(handled.service, "sagabox-serve");
        assert_eq!(handled.trace_id, span.trace_id);
        sagas.insert(saga.clone());
    }
    // Three steps of each saga crossed to the participants, in one trace per saga.
    assert_eq!(sagas.len(), ORDERS, "{consumed:#?}");
    assert_eq!(consumed.len(), 3 * ORDERS, "{consumed:#?}");
    let traces: std::collections::BTreeSet<&[u8]> = consumed
        .iter()
        .map(|span| span.trace_id.as_slice())
        .collect();
    assert_eq!(traces.len(), ORDERS, "one trace per saga");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rabbitmq_a_saga_is_one_trace_across_the_orchestrator_and_its_participants() {
    let rabbit = common::rabbit::Rabbit::new(&["payment", "inventory", "email"]).await;
    one_trace_per_saga_over(
        &rabbit.config.url,
        &rabbit.config.queue_prefix,
        "amqp.consume",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_jetstream_a_saga_is_one_trace_across_the_orchestrator_and_its_participants() {
    let js = jetstream::Js::new(&["payment", "inventory", "email"]).await;
    one_trace_per_saga_over(&js.config.url, &js.config.prefix, "nats.consume").await;
}
