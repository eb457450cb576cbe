//! No caller waits forever on an actor that died: a saga driver that panics fails the
//! callers waiting on its saga with a typed error and the orchestrator goes on; a killed
//! orchestrator fails its callers and is reported by the supervision; a pruner whose
//! pass panics is reported; and an actor stopped on purpose is not a death. (The built
//! `sagabox demo` and `serve` with an unwritable stderr: `cli/tests/stderr.rs`.)
//!
//! Every wait here is bounded (`call_t!`, `tokio::time::timeout`): a regression shows as a
//! failed test, never as a hung suite.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use ractor::rpc::CallResult;
use sagabox::orchestrator::{
    Dispatch, DriveError, Orchestrator, OrchestratorArguments, OrchestratorMessage,
};
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments};
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance, SagaStore};
use sagabox::step::{StepFailure, StepOutcome, StepReply};
use sagabox::supervisor::Supervision;
use sagabox::{ConsumerType, Envelope, InboxError, SqliteStore};
use serde_json::{Value, json};

/// Long enough for a busy machine, short enough that a hang fails the test quickly.
const BOUND: Duration = Duration::from_secs(20);
const BOUND_MS: u64 = 20_000;

const ONE_STEP: &str = r#"
name = "one"

[[steps]]
name = "work"
consumer_type = "worker"
command = "do_work"
timeout = "30s"
[steps.retry]
initial_backoff = "1ms"
max_backoff = "2ms"
"#;

/// A dispatch that panics for sagas whose data says `"panic": true`, never answers
/// those that say `"hang": true`, and answers `Done` for the rest.
#[derive(Debug, Default)]
struct Scripted {
    calls: AtomicUsize,
}

impl Dispatch for Scripted {
    async fn dispatch(
        &self,
        _consumer_type: &ConsumerType,
        envelope: Envelope,
        _timeout: Duration,
    ) -> Result<StepReply, StepFailure> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if envelope.payload["panic"] == json!(true) {
            panic!("dispatch bug for {}", envelope.saga_id.unwrap_or_default());
        }
        if envelope.payload["hang"] == json!(true) {
            std::future::pending::<()>().await;
        }
        Ok(StepReply {
            outcome: StepOutcome::Done(Value::Null),
            duplicate: false,
        })
    }
}

async fn saga(store: &SqliteStore, id: &str, data: Value) {
    let saga = SagaInstance::new(id, "one", data, Utc::now());
    let mut conn = store.pool().acquire().await.unwrap();
    store.insert(&mut conn, &saga).await.unwrap();
}

async fn status(store: &SqliteStore, id: &str) -> String {
    store
        .load(id)
        .await
        .unwrap()
        .unwrap()
        .status
        .as_str()
        .to_owned()
}

async fn orchestrator(
    supervision: &Supervision,
    store: &SqliteStore,
    dispatch: Arc<Scripted>,
) -> ractor::ActorRef<OrchestratorMessage> {
    let (orchestrator, _) = supervision
        .spawn(
            "orchestrator",
            Orchestrator::new(),
            OrchestratorArguments::new(
                Arc::new(SagaDefinition::from_toml_str(ONE_STEP).unwrap()),
                store.clone(),
                dispatch,
            ),
        )
        .await
        .unwrap();
    orchestrator
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_panics_fails_its_callers_and_the_orchestrator_goes_on() {
    let fx = common::Lite::new().await;
    let store = fx.store(4).await;
    let supervision = Supervision::start().await.unwrap();
    let dispatch = Arc::new(Scripted::default());
    let orchestrator = orchestrator(&supervision, &store, Arc::clone(&dispatch)).await;
    saga(&store, "bad", json!({"panic": true})).await;
    saga(&store, "good", json!({})).await;

    // Two callers wait on the same saga: both hear of the crash.
    let (first, second) = tokio::join!(
        async {
            ractor::call_t!(
                orchestrator,
                OrchestratorMessage::Run,
                BOUND_MS,
                "bad".to_owned()
            )
        },
        async {
            ractor::call_t!(
                orchestrator,
                OrchestratorMessage::Run,
                BOUND_MS,
                "bad".to_owned()
            )
        },
    );
    for answer in [first, second] {
        match answer.expect("an answer, not a hang") {
            Err(DriveError::Panicked { saga_id, message }) => {
                assert_eq!(saga_id, "bad");
                assert!(message.contains("dispatch bug for bad"), "{message}");
            }
            other => panic!("expected the driver's panic, got {other:?}"),
        }
    }
    assert_eq!(
        status(&store, "bad").await,
        "running",
        "left as last stored"
    );

    // The orchestrator is still there and drives the next saga to its end.
    ractor::call_t!(
        orchestrator,
        OrchestratorMessage::Run,
        BOUND_MS,
        "good".to_owned()
    )
    .unwrap()
    .unwrap();
    assert_eq!(status(&store, "good").await, "completed");
    ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, BOUND_MS).unwrap();
    // Resuming leaves the crashed saga alone (it would crash again on every pass); an
    // explicit Run drives it again.
    let calls = dispatch.calls.load(Ordering::SeqCst);
    let resumed = ractor::call_t!(orchestrator, OrchestratorMessage::ResumeAll, BOUND_MS)
        .unwrap()
        .unwrap();
    assert_eq!(resumed, 0);
    ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, BOUND_MS).unwrap();
    assert_eq!(
        dispatch.calls.load(Ordering::SeqCst),
        calls,
        "not driven again"
    );
    let again = ractor::call_t!(
        orchestrator,
        OrchestratorMessage::Run,
        BOUND_MS,
        "bad".to_owned()
    )
    .unwrap();
    assert!(
        matches!(again, Err(DriveError::Panicked { .. })),
        "{again:?}"
    );
    assert_eq!(
        supervision.check(),
        Ok(()),
        "a crashed driver is not a dead actor"
    );
    supervision.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_orchestrator_fails_its_callers_and_the_supervision_names_it() {
    let fx = common::Lite::new().await;
    let store = fx.store(4).await;
    let supervision = Supervision::start().await.unwrap();
    let dispatch = Arc::new(Scripted::default());
    let orchestrator = orchestrator(&supervision, &store, Arc::clone(&dispatch)).await;
    saga(&store, "stuck", json!({"hang": true})).await;

    let caller = {
        let orchestrator = orchestrator.clone();
        tokio::spawn(async move {
            orchestrator
                .call(
                    |reply| OrchestratorMessage::Run("stuck".to_owned(), reply),
                    Some(BOUND),
                )
                .await
        })
    };
    // Kill it only once the driver is waiting on its step.
    let deadline = Instant::now() + BOUND;
    while dispatch.calls.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the driver never dispatched");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    orchestrator.kill();

    let answer = tokio::time::timeout(BOUND, caller)
        .await
        .expect("the caller is answered, not left waiting")
        .unwrap();
    assert!(
        matches!(answer, Ok(CallResult::SenderError) | Err(_)),
        "the caller learns the orchestrator is gone: {answer:?}"
    );
    let died = tokio::time::timeout(BOUND, supervision.died())
        .await
        .expect("the death is reported");
    assert_eq!(died.actor, "orchestrator");
    assert_eq!(died.cause, "was killed");
    assert!(died.to_string().contains("orchestrator"), "{died}");
    assert_eq!(supervision.check(), Err(died));
}

/// A pruner whose every pass panics.
#[derive(Debug)]
struct PanickingPass;

impl Maintenance for PanickingPass {
    async fn run_pass(&self, _dry_run: bool) -> Result<PrunePass, InboxError> {
        panic!("partition bookkeeping bug");
    }
}

#[tokio::test]
async fn a_pruner_that_panics_is_reported_with_its_cause() {
    let supervision = Supervision::start().await.unwrap();
    supervision
        .spawn(
            "pruner",
            Pruner::new(),
            PrunerArguments {
                maintenance: PanickingPass,
                interval: Duration::from_millis(10),
            },
        )
        .await
        .unwrap();
    let died = tokio::time::timeout(BOUND, supervision.died())
        .await
        .expect("the death is reported");
    assert_eq!(died.actor, "pruner");
    assert!(died.cause.starts_with("failed"), "{died:?}");
    assert!(died.cause.contains("partition bookkeeping bug"), "{died:?}");
}

#[tokio::test]
async fn actors_stopped_on_purpose_are_not_deaths() {
    let fx = common::Lite::new().await;
    let store = fx.store(2).await;
    let supervision = Supervision::start().await.unwrap();
    let orchestrator = orchestrator(&supervision, &store, Arc::default()).await;
    orchestrator.stop_and_wait(None, Some(BOUND)).await.unwrap();
    // After every event the supervisor already had: a wrongly reported death shows.
    assert_eq!(supervision.check_now().await, Ok(()));
    let second = self::orchestrator(&supervision, &store, Arc::default()).await;
    tokio::time::timeout(BOUND, supervision.stop())
        .await
        .expect("stop returns");
    assert!(
        second.get_status() == ractor::ActorStatus::Stopped,
        "stop stops the linked actors: {:?}",
        second.get_status()
    );
}
