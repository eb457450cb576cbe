//! Database faults, through a TCP proxy between the pools and PostgreSQL
//! (`common::proxy::FaultProxy`): connections cut mid-transaction, delays, new
//! connections refused for a while, and a pool with every connection taken.
//!
//! What must hold: a failed transaction leaves no inbox row and no side effect and is
//! reported as retryable; a retry after an ambiguous commit (cut while the COMMIT was in
//! flight) is answered as a duplicate, never applied twice; the orchestrator and the
//! pruner keep going and every saga finishes once the database is back; an exhausted pool
//! is a typed, retryable timeout error, not a hang.

#![allow(clippy::unwrap_used)]

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use common::proxy::FaultProxy;
use ractor::Actor;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::orchestrator::{
    DriveStats, InProcess, Orchestrator, OrchestratorArguments, OrchestratorMessage,
};
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments, PrunerMessage};
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance};
use sagabox::step::{StepFailure, StepPool, StepPoolConfig};
use sagabox::{
    ConsumerType, Envelope, GuardError, InboxConfig, InboxError, InboxGuard, MessageId, Outcome,
    PostgresStore,
};
use sagabox_checkout::{CheckoutStep, POSTGRES_TABLES};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const EFFECTS: &str =
    "CREATE TABLE effects (id BIGINT GENERATED ALWAYS AS IDENTITY, message_id TEXT NOT NULL)";

/// A store whose pool goes through `proxy`, waiting at most `acquire` for a connection.
async fn store_through(
    proxy: &FaultProxy,
    url: &str,
    connections: u32,
    acquire: Duration,
) -> PostgresStore {
    // Plain text: the faults' rates (a cut every 20-120 ms, delays of 5-40 ms per chunk)
    // are set for a connection that opens in two round trips; TLS's handshake adds two
    // more, and under those cuts new connections would rarely finish opening at all.
    let options: PgConnectOptions = proxy.url(url).parse().unwrap();
    let options = options.ssl_mode(sqlx::postgres::PgSslMode::Disable);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(acquire)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap();
    PostgresStore::new(pool)
}

async fn insert_effect(
    conn: &mut sqlx::PgConnection,
    envelope: &Envelope,
) -> Result<serde_json::Value, sqlx::Error> {
    sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
        .bind(envelope.id.as_str())
        .execute(&mut *conn)
        .await?;
    Ok(json!({ "applied": envelope.id.as_str() }))
}

/// The connection is cut while the handler's transaction is open, after its write: the
/// guard reports a retryable database error, nothing is left behind, and the redelivery
/// (on a fresh connection) applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_mid_transaction_leaves_nothing_and_the_retry_applies_once() {
    let fx = common::Pg::new().await;
    fx.exec(EFFECTS).await;
    let proxy = FaultProxy::in_front_of(&fx.url).await;
    let guard = InboxGuard::new(
        store_through(&proxy, &fx.url, 2, Duration::from_secs(5)).await,
        InboxConfig::default(),
    )
    .unwrap();
    let consumer = ConsumerType::new("payment").unwrap();
    let envelope = Envelope::new(MessageId::new_v7(), "charge", json!(null)).unwrap();

    let (inside, mut wait_inside) = tokio::sync::mpsc::channel::<()>(1);
    let (cut_done, wait_cut) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (guard, consumer, envelope) = (guard.clone(), consumer.clone(), envelope.clone());
        tokio::spawn(async move {
            guard
                .process(&consumer, &envelope, async |conn, envelope| {
                    let result = insert_effect(conn, envelope).await?;
                    inside.send(()).await.unwrap();
                    wait_cut.await.unwrap();
                    Ok::<_, sqlx::Error>(result)
                })
                .await
        })
    };
    wait_inside.recv().await.unwrap();
    proxy.cut();
    cut_done.send(()).unwrap();
    let failed = first.await.unwrap();
    match failed {
        Err(GuardError::Inbox(error)) => {
            assert!(error.is_retryable(), "{error}");
            assert!(matches!(error, InboxError::Database(_)), "{error:?}");
        }
        other => panic!("a cut transaction must fail: {other:?}"),
    }
    assert_eq!(
        fx.scalar("SELECT COUNT(*) FROM effects").await,
        0,
        "rolled back"
    );
    assert_eq!(
        fx.inbox_rows().await,
        0,
        "no inbox row: the redelivery is a first delivery"
    );

    // The pool may hand out the dead connection once more: retry as a consumer would.
    let mut attempts = 0;
    let outcome = loop {
        attempts += 1;
        match guard.process(&consumer, &envelope, insert_effect).await {
            Ok(outcome) => break outcome,
            Err(GuardError::Inbox(error)) if error.is_retryable() && attempts < 5 => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("retry {attempts}: {error}"),
        }
    };
    assert!(matches!(outcome, Outcome::Applied(_)), "{outcome:?}");
    assert_eq!(fx.scalar("SELECT COUNT(*) FROM effects").await, 1);
    assert_eq!(fx.inbox_rows().await, 1);
}

/// Many consumers retrying every message until the guard says `Ok`, while the proxy cuts
/// every connection at random moments, delays traffic and refuses new connections for a
/// while. Cuts that land on a COMMIT in flight make the outcome ambiguous to the caller;
/// its retry must then be answered as a duplicate. Every message is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumers_ride_through_cuts_delays_and_refusals_without_a_double_effect() {
    const MESSAGES: usize = 400;
    const CONSUMERS: usize = 8;
    let fx = common::Pg::new().await;
    fx.exec(EFFECTS).await;
    let proxy = Arc::new(FaultProxy::in_front_of(&fx.url).await);
    let guard = InboxGuard::new(
        store_through(&proxy, &fx.url, CONSUMERS as u32, Duration::from_secs(10)).await,
        InboxConfig::default(),
    )
    .unwrap();
    guard.migrate().await.unwrap();
    let consumer = ConsumerType::new("payment").unwrap();
    let envelopes: Arc<Vec<Envelope>> = Arc::new(
        (0..MESSAGES)
            .map(|_| Envelope::new(MessageId::new_v7(), "charge", json!(null)).unwrap())
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(AtomicUsize::new(0));
    let duplicates = Arc::new(AtomicUsize::new(0));

    let seed: u64 = rand::random();
    let chaos = {
        let (proxy, next) = (Arc::clone(&proxy), Arc::clone(&next));
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed);
            // The first cut waits for an amount of work, not a span of time: a tenth of
            // the messages taken, so it lands mid-run however fast the consumers are.
            while next.load(Ordering::SeqCst) < MESSAGES / 10 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            proxy.cut();
            for round in 0.. {
                tokio::time::sleep(Duration::from_millis(rng.random_range(20..120))).await;
                match round % 10 {
                    3 => proxy.set_delay(Duration::from_millis(rng.random_range(5..40))),
                    6 => proxy.set_delay(Duration::ZERO),
                    8 => {
                        proxy.refuse();
                        proxy.cut();
                        tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
                        proxy.accept();
                    }
                    _ => proxy.cut(),
                }
            }
        })
    };
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..CONSUMERS {
        let (guard, consumer, envelopes) =
            (guard.clone(), consumer.clone(), Arc::clone(&envelopes));
        let (next, failures, duplicates) = (
            Arc::clone(&next),
            Arc::clone(&failures),
            Arc::clone(&duplicates),
        );
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(envelope) = envelopes.get(i) else {
                    return;
                };
                let mut backoff = Duration::from_millis(5);
                // Acknowledged (the loop moves on) only after `Ok`.
                loop {
                    match guard.process(&consumer, envelope, insert_effect).await {
                        Ok(Outcome::Applied(_)) => break,
                        Ok(Outcome::Duplicate { .. }) => {
                            duplicates.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        Err(error) => {
                            let retryable = match &error {
                                GuardError::Inbox(e) => e.is_retryable(),
                                GuardError::Handler(_) => true,
                                _ => false,
                            };
                            assert!(retryable, "a database fault must be retryable: {error}");
                            failures.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_millis(200));
                        }
                    }
                }
            }
        });
    }
    let deadline = Duration::from_secs(120);
    let finished = tokio::time::timeout(deadline, async {
        while let Some(joined) = workers.join_next().await {
            joined.unwrap();
        }
    })
    .await;
    chaos.abort();
    let (cuts, refused) = (proxy.cuts(), proxy.refused());
    let context = format!(
        "seed {seed}: {cuts} cuts, {refused} refused connections, {} failed attempts, {} duplicates",
        failures.load(Ordering::SeqCst),
        duplicates.load(Ordering::SeqCst)
    );
    assert!(
        finished.is_ok(),
        "stuck: not every message was acknowledged within {deadline:?}; {context}"
    );
    eprintln!("{context}");
    assert!(
        // How many faults land before the last message is acknowledged depends on the
        // machine's speed; the first lands mid-run, and was ridden through.
        cuts >= 1 && failures.load(Ordering::SeqCst) > 0,
        "the faults happened: {context}"
    );
    let effects = fx.scalar("SELECT COUNT(*) FROM effects").await;
    let distinct = fx
        .scalar("SELECT COUNT(DISTINCT message_id) FROM effects")
        .await;
    assert_eq!(
        (effects, distinct),
        (MESSAGES as i64, MESSAGES as i64),
        "each applied once: {context}"
    );
    assert_eq!(fx.inbox_rows().await, MESSAGES as i64, "{context}");
}

/// The checkout saga without the demo's own faults, driven by the orchestrator over step
/// pools whose guards — and the orchestrator's saga store — reach PostgreSQL through the
/// proxy, which cuts, delays beyond the step timeout, and refuses connections for a
/// while. Once the database is back, every saga finishes and every invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_orchestrator_finishes_every_saga_once_the_database_is_back() {
    const SAGAS: usize = 150;
    const DEFINITION: &str = r#"
name = "checkout"
[[steps]]
name = "payment"
consumer_type = "payment"
command = "charge"
compensation = "refund"
timeout = "300ms"
[steps.retry]
max_attempts = 6
initial_backoff = "20ms"
max_backoff = "500ms"
[[steps]]
name = "inventory"
consumer_type = "inventory"
command = "decrement_stock"
compensation = "restock"
timeout = "300ms"
[steps.retry]
max_attempts = 6
initial_backoff = "20ms"
max_backoff = "500ms"
[[steps]]
name = "email"
consumer_type = "email"
command = "send_confirmation"
timeout = "300ms"
[steps.retry]
initial_backoff = "20ms"
max_backoff = "500ms"
"#;
    let fx = common::Pg::new().await;
    sqlx::raw_sql(POSTGRES_TABLES)
        .execute(&fx.pool)
        .await
        .unwrap();
    for sku in ["sku-apple", "sku-bread"] {
        sqlx::query("INSERT INTO inventory (sku, initial, on_hand) VALUES ($1, 200, 200)")
            .bind(sku)
            .execute(&fx.pool)
            .await
            .unwrap();
    }
    // Orders and their sagas are placed directly; only the drivers go through the proxy.
    let direct = fx.store(2).await;
    let mut rng = StdRng::seed_from_u64(7);
    let mut ids = Vec::new();
    for i in 0..SAGAS {
        let order_id = format!("o-{i}");
        let sku = if rng.random_bool(0.5) {
            "sku-apple"
        } else {
            "sku-bread"
        };
        let data = json!({"order_id": order_id, "sku": sku, "quantity": rng.random_range(1..=3),
                          "amount_cents": 500, "decline": rng.random_bool(0.1)});
        let saga = SagaInstance::new(format!("s-{i}"), "checkout", data.clone(), Utc::now());
        let mut tx = direct.pool().begin().await.unwrap();
        sqlx::query("INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) VALUES ($1, $2, $3, $4, 500)")
            .bind(&order_id)
            .bind(&saga.id)
            .bind(sku)
            .bind(data["quantity"].as_i64())
            .execute(&mut *tx)
            .await
            .unwrap();
        direct.insert(&mut tx, &saga).await.unwrap();
        tx.commit().await.unwrap();
        ids.push(saga.id);
    }

    let proxy = Arc::new(FaultProxy::in_front_of(&fx.url).await);
    let definition = Arc::new(SagaDefinition::from_toml_str(DEFINITION).unwrap());
    let mut dispatch = InProcess::new();
    for step in definition.steps() {
        let guard = InboxGuard::new(
            store_through(&proxy, &fx.url, 4, Duration::from_secs(30)).await,
            InboxConfig::default(),
        )
        .unwrap();
        let pool = StepPool::spawn(
            guard,
            step.consumer_type().clone(),
            CheckoutStep::of(step.consumer_type().as_str()).unwrap(),
            StepPoolConfig { workers: 4 },
        )
        .await
        .unwrap();
        dispatch = dispatch.with_pool(pool);
    }
    let store = store_through(&proxy, &fx.url, 4, Duration::from_secs(30)).await;
    let stats = Arc::new(DriveStats::default());
    let (orchestrator, handle) = Actor::spawn(
        None,
        Orchestrator::new(),
        OrchestratorArguments::new(definition, store, Arc::new(dispatch))
            .with_stats(Arc::clone(&stats)),
    )
    .await
    .unwrap();

    let seed: u64 = rand::random();
    let faults = {
        let proxy = Arc::clone(&proxy);
        async move {
            let mut rng = StdRng::seed_from_u64(seed);
            let started = Instant::now();
            let mut round = 0;
            while started.elapsed() < Duration::from_secs(6) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
                round += 1;
                match round % 8 {
                    // Slower than the step timeout: replies time out, commands are resent.
                    2 => {
                        proxy.set_delay(Duration::from_millis(350));
                        tokio::time::sleep(Duration::from_millis(400)).await;
                        proxy.set_delay(Duration::ZERO);
                    }
                    5 => {
                        proxy.refuse();
                        proxy.cut();
                        tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500)))
                            .await;
                        proxy.accept();
                    }
                    _ => proxy.cut(),
                }
            }
        }
    };
    let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll).unwrap();
    assert_eq!(resumed, Ok(SAGAS));
    faults.await;
    let context = format!(
        "seed {seed}: {} cuts, {} refused; {} deliveries, {} retries",
        proxy.cuts(),
        proxy.refused(),
        stats.deliveries.load(Ordering::Relaxed),
        stats.retries.load(Ordering::Relaxed)
    );
    // The database is back: everything must finish, in bounded time.
    let idle = ractor::call_t!(orchestrator, OrchestratorMessage::WhenIdle, 120_000);
    assert!(
        idle.is_ok(),
        "sagas still in flight 120 s after the faults stopped; {context}"
    );
    eprintln!("{context}");
    assert!(
        stats.retries.load(Ordering::Relaxed) > 0,
        "the faults forced retries: {context}"
    );
    let broken = common::invariants::violations(&fx.pool).await;
    assert!(broken.is_empty(), "{context}: {broken:?}");
    let finished = fx
        .scalar("SELECT COUNT(*) FROM sagabox_saga_instances WHERE status IN ('completed', 'compensated')")
        .await;
    assert_eq!(finished, SAGAS as i64, "{context}");
    orchestrator.stop(None);
    handle.await.unwrap();
}

/// The guard's maintenance, counting the passes that failed: how a test sees the
/// pruner's timer ticks fail instead of guessing how long they take.
struct CountingFailures {
    inner: InboxGuard<PostgresStore>,
    failures: Arc<AtomicUsize>,
}

impl Maintenance for CountingFailures {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let result = self.inner.run_pass(dry_run).await;
        if result.is_err() {
            self.failures.fetch_add(1, Ordering::SeqCst);
        }
        result
    }
}

/// The pruner's passes fail while the database refuses connections — each failure a
/// clear error, the actor staying up — and succeed once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pruner_fails_its_passes_while_the_database_is_gone_and_recovers() {
    let fx = common::Pg::new().await;
    let proxy = FaultProxy::in_front_of(&fx.url).await;
    let guard = InboxGuard::new(
        store_through(&proxy, &fx.url, 2, Duration::from_millis(500)).await,
        InboxConfig::default(),
    )
    .unwrap();
    let failures = Arc::new(AtomicUsize::new(0));
    let (pruner, handle) = Actor::spawn(
        None,
        Pruner::new(),
        PrunerArguments {
            maintenance: CountingFailures {
                inner: guard,
                failures: Arc::clone(&failures),
            },
            interval: Duration::from_millis(100),
        },
    )
    .await
    .unwrap();
    let first = ractor::call!(pruner, PrunerMessage::RunNow).unwrap();
    assert!(first.is_ok(), "{first:?}");

    proxy.refuse();
    proxy.cut();
    let down = ractor::call_t!(pruner, PrunerMessage::RunNow, 10_000).unwrap();
    let error = down.expect_err("no database, no pass");
    assert!(
        error.contains("database")
            && (error.contains("acquire timeout") || error.contains("error communicating")),
        "the failure says what went wrong: {error}"
    );
    // Timer ticks fail meanwhile; the actor stays up through them.
    let failed_before = failures.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    while failures.load(Ordering::SeqCst) < failed_before + 2 {
        assert!(
            Instant::now() < deadline,
            "no timer tick ran a pass in 30 s (the pruner is {:?})",
            pruner.get_status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(pruner.get_status(), ractor::ActorStatus::Running);

    proxy.accept();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ractor::call_t!(pruner, PrunerMessage::RunNow, 10_000).unwrap() {
            Ok(pass) => {
                assert!(pass.oldest.is_some(), "{pass:?}");
                break;
            }
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "the pruner never recovered: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    pruner.stop(None);
    handle.await.unwrap();
}

/// Every connection of the pool is held: a claim waits for the acquire timeout and then
/// fails with a typed, retryable error that says what to do — it does not hang. Through
/// a step pool the caller sees a retryable failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_clear_retryable_timeout_not_a_hang() {
    let fx = common::Pg::new().await;
    let options: PgConnectOptions = fx.url.parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(options)
        .await
        .unwrap();
    let guard = InboxGuard::new(PostgresStore::new(pool.clone()), InboxConfig::default()).unwrap();
    guard.migrate().await.unwrap();
    let held = pool.acquire().await.unwrap();

    let consumer = ConsumerType::new("payment").unwrap();
    let envelope = Envelope::new(MessageId::new_v7(), "charge", json!(null)).unwrap();
    let started = Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        guard.process(&consumer, &envelope, async |_conn, _envelope| {
            Ok::<_, sqlx::Error>(json!(1))
        }),
    )
    .await
    .expect("a full pool must not hang the caller");
    match result {
        Err(GuardError::Inbox(error @ InboxError::PoolTimedOut { size: Some(1) })) => {
            assert!(error.is_retryable());
            let text = error.to_string();
            assert!(
                text.contains("acquire timeout")
                    && text.contains("which holds at most 1)")
                    && text.contains("--db-pool-size"),
                "{text}"
            );
        }
        other => panic!("expected a pool timeout: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));

    let step = StepPool::spawn(
        guard,
        consumer.clone(),
        CheckoutStep::of(consumer.as_str()).unwrap(),
        StepPoolConfig::default(),
    )
    .await
    .unwrap();
    let failure = step
        .deliver(envelope.clone(), Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, StepFailure::Retryable(text) if text.contains("acquire timeout")),
        "{failure:?}"
    );
    drop(held);
    step.stop().await;
    assert_eq!(fx.inbox_rows().await, 0);
}
