//! Micro-benchmarks of what needs no database: envelope validation and encoding, message
//! id derivation, and the mailbox hop a step command makes. Run with `cargo bench`; CI
//! only builds them (`cargo bench --no-run`).
//!
//! The database paths are measured end to end by `sagabox bench`, against their own
//! baseline in the same run (docs/benchmarks.md).

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use chrono::{TimeZone, Utc};
use criterion::{Criterion, criterion_group, criterion_main};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use sagabox::saga::{Direction, SagaInstance};
use sagabox::{ConsumerType, Envelope, MessageId};
use serde_json::json;

fn sample_envelope() -> Envelope {
    Envelope::new(
        MessageId::new("0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b").expect("valid id"),
        "charge",
        json!({"order_id": "order-42", "amount_cents": 4200, "currency": "EUR"}),
    )
    .expect("valid kind")
    .with_saga_id("order-42")
    .with_published_at(
        Utc.with_ymd_and_hms(2026, 12, 2, 10, 0, 0)
            .single()
            .expect("time"),
    )
    .with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
}

fn envelopes(c: &mut Criterion) {
    let mut group = c.benchmark_group("envelope");
    group.bench_function("validate message id and consumer type", |b| {
        b.iter(|| {
            let id = MessageId::new(black_box("0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"));
            let consumer = ConsumerType::new(black_box("payment"));
            (id.is_ok(), consumer.is_ok())
        })
    });
    let envelope = sample_envelope();
    group.bench_function("encode to JSON", |b| {
        b.iter(|| serde_json::to_vec(black_box(&envelope)).map(|bytes| bytes.len()))
    });
    let encoded = serde_json::to_vec(&envelope).expect("encode");
    group.bench_function("decode and validate from JSON", |b| {
        b.iter(|| serde_json::from_slice::<Envelope>(black_box(&encoded)).is_ok())
    });
    group.finish();
}

fn message_ids(c: &mut Criterion) {
    let mut group = c.benchmark_group("message id");
    group.bench_function("new UUIDv7", |b| b.iter(MessageId::new_v7));
    let id = MessageId::new_v7();
    group.bench_function("UUIDv7 time (the claim's partition month)", |b| {
        b.iter(|| black_box(&id).uuid_v7_time())
    });
    let saga = SagaInstance::new(
        "order-42",
        "checkout",
        json!({}),
        Utc.with_ymd_and_hms(2026, 12, 2, 10, 0, 0)
            .single()
            .expect("time"),
    );
    group.bench_function("derive a saga command id", |b| {
        b.iter(|| black_box(&saga).command_id(black_box(2), Direction::Forward))
    });
    group.finish();
}

/// An actor that answers every call: the cost of one mailbox hop there and back.
struct Echo;

impl Actor for Echo {
    type Msg = (Envelope, RpcReplyPort<bool>);
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        (envelope, reply): Self::Msg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let _ = reply.send(!envelope.kind.is_empty());
        Ok(())
    }
}

fn mailbox(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (actor, handle) = runtime
        .block_on(Actor::spawn(None, Echo, ()))
        .expect("spawn echo actor");
    let envelope = sample_envelope();
    c.bench_function(
        "mailbox hop: call an actor with an envelope and await its reply",
        |b| {
            b.iter(|| {
                runtime.block_on(async {
                    actor
                        .call(|reply| (envelope.clone(), reply), None)
                        .await
                        .is_ok_and(|answer| answer.is_success())
                })
            })
        },
    );
    actor.stop(None);
    let _ = runtime.block_on(handle);
}

criterion_group!(benches, envelopes, message_ids, mailbox);
criterion_main!(benches);
