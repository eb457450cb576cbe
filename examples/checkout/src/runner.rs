//! [`run`]: the demo. It places orders, runs their sagas with the orchestrator over
//! step pools in process or RabbitMQ under the configured faults, with the pruner
//! beside it, and reads the [`DemoSummary`] from the tables.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::clock::Clock;
use sagabox::database::Backend;
use sagabox::inbox::{InboxConfig, InboxError, InboxGuard};
use sagabox::logging::redact;
use sagabox::month::Month;
use sagabox::orchestrator::{DriveStats, Orchestrator, OrchestratorArguments, OrchestratorMessage};
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments};
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance};
use sagabox::supervisor::Supervision;
use sagabox::testing::FaultyDispatch;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::summary::SUMMARY_SQL;
use crate::{
    CHECKOUT_TOML, DemoConfig, DemoDispatch, DemoError, DemoSummary, FreshIds, POSTGRES_TABLES,
    SQLITE_TABLES, Verdict,
};

/// Stock keeping units in the demo's inventory.
const SKUS: [&str; 5] = [
    "sku-apple",
    "sku-bread",
    "sku-cheese",
    "sku-dates",
    "sku-eggs",
];

/// The demo's pruner: a pass of the guard's, keeping the months it dropped for the
/// summary.
#[derive(Debug)]
struct TalliedMaintenance<M> {
    inner: M,
    dropped: Arc<Mutex<Vec<Month>>>,
}

impl<M: Maintenance> Maintenance for TalliedMaintenance<M> {
    async fn run_pass(&self, dry_run: bool) -> Result<PrunePass, InboxError> {
        let pass = self.inner.run_pass(dry_run).await?;
        if !dry_run {
            self.dropped
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(pass.dropped.iter().copied());
        }
        Ok(pass)
    }
}

const RESET: &str = "
DELETE FROM demo_orders; DELETE FROM payment_charges; DELETE FROM inventory;
DELETE FROM inventory_moves; DELETE FROM emails_sent; DELETE FROM demo_run;
DELETE FROM {schema}.sagabox_saga_instances WHERE saga_name = 'checkout';
";

/// How long a run that failed waits for the death of an actor to be reported, to name
/// it as the cause.
const DEATH_REPORT_WITHIN: Duration = Duration::from_millis(500);

/// One order of the run: what goes into `demo_orders` and the saga's data.
fn order(rng: &mut StdRng, decline_rate: f64) -> (String, Value) {
    let order_id = Uuid::now_v7().to_string();
    let sku = SKUS[rng.random_range(0..SKUS.len())];
    let quantity: i64 = rng.random_range(1..=3);
    let amount_cents: i64 = rng.random_range(100..=20_000);
    let decline = rng.random_bool(decline_rate);
    let data = json!({
        "order_id": order_id, "sku": sku, "quantity": quantity,
        "amount_cents": amount_cents, "decline": decline,
    });
    (order_id, data)
}

/// Stock per sku: about 85 % of the expected demand, so some orders run out.
fn initial_stock(orders: usize) -> i64 {
    let expected = (orders as f64 * 2.0 / SKUS.len() as f64).ceil();
    (expected * 0.85).max(1.0) as i64
}

macro_rules! backend_run {
    ($name:ident, $store:ty, $db:ty, $tables:expr) => {
        async fn $name(
            url: &str,
            store: $store,
            config: &DemoConfig,
        ) -> Result<DemoSummary, DemoError> {
            let definition = Arc::new(SagaDefinition::from_toml_str(CHECKOUT_TOML)?);
            let clock = config.clock()?;
            let guard = InboxGuard::new(store.clone(), InboxConfig::default())
                .map_err(InboxError::from)?
                .with_clock(clock);
            guard.migrate().await?;
            // Every actor of the run is linked to one supervisor: if one dies, the run
            // ends with its cause instead of waiting on it. Dropped on any return, it
            // stops them all.
            let supervision = Supervision::start()
                .await
                .map_err(|e| DemoError::Actor(e.to_string()))?;
            // The pruner runs as it would beside a deployment; under a fast clock it is
            // what keeps creating the months ahead and dropping the expired ones.
            let months_pruned = Arc::new(Mutex::new(Vec::new()));
            let (pruner, pruner_handle) = supervision.spawn(
                "pruner",
                Pruner::new(),
                PrunerArguments {
                    maintenance: TalliedMaintenance {
                        inner: guard.clone(),
                        dropped: Arc::clone(&months_pruned),
                    },
                    interval: config.prune_interval(),
                },
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
            let pool = store.pool().clone();
            sqlx::raw_sql($tables).execute(&pool).await?;
            // The run's size is stored, so that `resume` can place what a killed run
            // had not placed yet.
            let target = if config.resume {
                let stored: Option<i64> = sqlx::query_scalar("SELECT orders FROM demo_run")
                    .fetch_optional(&pool)
                    .await?;
                let stored = stored.ok_or_else(|| DemoError::NothingToResume { database: redact(url) })?;
                usize::try_from(stored).unwrap_or(0)
            } else {
                // One transaction: a run killed while setting up is either on record,
                // stocked, or not started at all.
                let mut tx = pool.begin().await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(store.schema().sql(RESET))).execute(&mut *tx).await?;
                sqlx::query("INSERT INTO demo_run (orders) VALUES ($1)")
                    .bind(i64::try_from(config.orders).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await?;
                for sku in SKUS {
                    let stock = initial_stock(config.orders);
                    sqlx::query("INSERT INTO inventory (sku, initial, on_hand) VALUES ($1, $2, $2)")
                        .bind(sku)
                        .bind(stock)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                config.orders
            };
            let placed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM demo_orders")
                .fetch_one(&pool)
                .await?;
            let to_place = target.saturating_sub(usize::try_from(placed).unwrap_or(0));

            let dispatch = DemoDispatch::start(
                &guard,
                clock.clone(),
                &definition,
                (config.fail_rate, config.seed ^ 0x5eed),
                config.transport.as_ref(),
                &supervision,
            )
            .await?;
            let dispatch = Arc::new(dispatch);
            let stats = Arc::new(DriveStats::default());
            let (orchestrator, orchestrator_handle) = supervision.spawn(
                "orchestrator",
                Orchestrator::new(),
                OrchestratorArguments::new(
                    Arc::clone(&definition),
                    store.clone(),
                    Arc::new(
                        FaultyDispatch::new(
                            FreshIds::new(Arc::clone(&dispatch), config.no_inbox),
                            config.duplicate_rate,
                            config.lost_reply_rate,
                            config.seed,
                        )
                        .map_err(|error| DemoError::Config(error.to_string()))?,
                    ),
                )
                .with_stats(Arc::clone(&stats))
                .with_clock(Arc::new(clock.clone())),
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;

            let started = Instant::now();
            let progress = if config.progress {
                ProgressBar::new(0)
            } else {
                ProgressBar::hidden()
            };
            progress.set_style(
                ProgressStyle::with_template("{spinner} {msg} [{bar:40}] {pos}/{len} sagas ({per_sec})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let work = async {
            let resumed = if config.resume {
                progress.set_message("resuming");
                let resumed = ractor::call!(orchestrator, OrchestratorMessage::ResumeAll)
                    .map_err(|e| DemoError::Actor(e.to_string()))?
                    .map_err(DemoError::Actor)?;
                progress.set_length((resumed + to_place) as u64);
                resumed
            } else {
                progress.set_message("checkout");
                progress.set_length(to_place as u64);
                0
            };
            let permits = Arc::new(tokio::sync::Semaphore::new(config.concurrency));
            let mut rng = StdRng::seed_from_u64(config.seed);
            let mut running = tokio::task::JoinSet::new();
            for _ in 0..to_place {
                // Reap the sagas already finished: a finished task is kept until joined,
                // so without this the run's memory would grow with every order placed.
                while let Some(joined) = running.try_join_next() {
                    joined.map_err(|e| DemoError::Actor(e.to_string()))??;
                }
                let permit = Arc::clone(&permits)
                    .acquire_owned()
                    .await
                    .map_err(|e| DemoError::Actor(e.to_string()))?;
                let (order_id, data) = order(&mut rng, config.decline_rate);
                // Saga times come from the run's clock: command ids are derived from them.
                let saga = SagaInstance::under(&definition, Uuid::now_v7().to_string(), data.clone(), clock.now());
                // The order and its saga commit together: no order without its saga.
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) VALUES ($1, $2, $3, $4, $5)")
                    .bind(&order_id)
                    .bind(&saga.id)
                    .bind(data["sku"].as_str())
                    .bind(data["quantity"].as_i64())
                    .bind(data["amount_cents"].as_i64())
                    .execute(&mut *tx)
                    .await?;
                guard.store().insert(&mut tx, &saga).await?;
                tx.commit().await?;
                let (orchestrator, progress) = (orchestrator.clone(), progress.clone());
                running.spawn(async move {
                    let done = ractor::call!(orchestrator, OrchestratorMessage::Run, saga.id);
                    progress.inc(1);
                    drop(permit);
                    done.map_err(|e| DemoError::Actor(e.to_string()))?
                        .map_err(DemoError::from)
                });
            }
            while let Some(joined) = running.join_next().await {
                joined.map_err(|e| DemoError::Actor(e.to_string()))??;
            }
            if config.resume {
                ractor::call!(orchestrator, OrchestratorMessage::WhenIdle)
                    .map_err(|e| DemoError::Actor(e.to_string()))?;
            }
            Ok::<_, DemoError>(resumed + to_place)
            };
            let finished = tokio::select! {
                done = work => match done {
                    Ok(finished) => finished,
                    // An actor that died makes the calls to it fail: its death is the cause.
                    // Its report reaches the supervisor just after those calls fail.
                    Err(error) => {
                        let died = tokio::time::timeout(DEATH_REPORT_WITHIN, supervision.died()).await;
                        return Err(died.map_or(error, DemoError::from));
                    }
                },
                died = supervision.died() => return Err(died.into()),
                failed = dispatch.failed() => return Err(failed),
            };
            progress.finish_and_clear();
            let elapsed = started.elapsed();
            orchestrator.stop(None);
            let _ = orchestrator_handle.await;
            // The orchestrator's state (and its handle on the pools) is gone with it.
            if let Ok(dispatch) = Arc::try_unwrap(dispatch) {
                dispatch.stop().await;
            }
            pruner.stop(None);
            let _ = pruner_handle.await;
            supervision.stop().await;
            let months_pruned = std::mem::take(
                &mut *months_pruned.lock().unwrap_or_else(PoisonError::into_inner),
            );
            let months_kept = guard.partitions().await?;

            let mut figures = std::collections::HashMap::new();
            for (name, sql) in SUMMARY_SQL {
                let value: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(guard.store().schema().sql(sql))).fetch_one(&pool).await?;
                figures.insert(name, value);
            }
            let figure = |name: &str| figures.get(name).copied().unwrap_or_default();
            let mut summary = DemoSummary {
                database: redact(url),
                transport: config
                    .transport
                    .as_ref()
                    .map_or_else(|| "in-process".to_owned(), |transport| redact(&transport.url)),
                no_inbox: config.no_inbox,
                orders: figure("orders"),
                completed: figure("completed"),
                compensated: figure("compensated"),
                unfinished: figure("unfinished"),
                deliveries: stats.deliveries.load(Relaxed),
                duplicate_replies: stats.duplicates.load(Relaxed),
                retries: stats.retries.load(Relaxed),
                double_charges: figure("double_charges"),
                double_refunds: figure("double_refunds"),
                double_emails: figure("double_emails"),
                stock_drift: figure("stock_drift"),
                unbalanced_refunds: figure("unbalanced_refunds"),
                elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                sagas_per_sec: finished as f64 / elapsed.as_secs_f64().max(1e-9),
                clock_speed: config.clock_speed,
                clock_end: clock.now(),
                months_pruned: months_pruned.iter().map(Month::to_string).collect(),
                months_kept: months_kept.iter().map(Month::to_string).collect(),
                verdict: Verdict::Ok,
            };
            summary.verdict = Verdict::of(summary.damage());
            Ok(summary)
        }
    };
}

backend_run!(
    run_postgres,
    sagabox::PostgresStore,
    sqlx::Postgres,
    POSTGRES_TABLES
);
backend_run!(
    run_sqlite,
    sagabox::SqliteStore,
    sqlx::Sqlite,
    SQLITE_TABLES
);

/// Runs the checkout demo on the database at `url` (`sqlite:…` or `postgres://…`).
///
/// Without `resume` it first resets the demo's own tables (`demo_orders`,
/// `payment_charges`, `inventory`, `inventory_moves`, `emails_sent`, `demo_run` and the
/// `checkout` rows of `sagabox_saga_instances`), records the run's size and stocks the
/// inventory. With `resume` it finishes the unfinished sagas of the run on record and
/// places the orders it had not placed yet.
pub async fn run(url: &str, config: &DemoConfig) -> Result<DemoSummary, DemoError> {
    config.validate()?;
    // Nothing to resume where there is no database: do not create one to say so.
    if config.resume && matches!(sagabox::database::missing_sqlite_file(url), Ok(Some(_))) {
        return Err(DemoError::NothingToResume {
            database: redact(url),
        });
    }
    let connections = u32::try_from(config.concurrency.clamp(4, 64)).unwrap_or(16);
    match Backend::of(url)? {
        Backend::Postgres => {
            let store = sagabox::PostgresStore::connect(url, connections)
                .await?
                .with_schema(config.schema.clone());
            run_postgres(url, store, config).await
        }
        Backend::Sqlite => {
            let store = sagabox::SqliteStore::connect(url, connections.min(8)).await?;
            run_sqlite(url, store, config).await
        }
        #[allow(unreachable_patterns)]
        _ => Err(InboxError::UnsupportedUrl(redact(url)).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_checked() {
        let bad = DemoConfig {
            duplicate_rate: 1.5,
            ..DemoConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("--duplicate-rate")
        );
        let forever = DemoConfig {
            fail_rate: 1.0,
            ..DemoConfig::default()
        };
        assert!(forever.validate().is_err());
        assert!(DemoConfig::default().validate().is_ok());
    }

    #[test]
    fn the_shipped_definition_loads() {
        let definition = SagaDefinition::from_toml_str(CHECKOUT_TOML).unwrap();
        assert_eq!(definition.steps().len(), 3);
    }

    #[test]
    fn stock_runs_short_of_demand() {
        assert!(initial_stock(1000) < 400);
        assert!(initial_stock(0) >= 1);
    }
}
