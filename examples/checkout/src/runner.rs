//! [`run`]: the demo. It places orders, runs their sagas with the orchestrator over
//! step pools in process or RabbitMQ under the configured faults, with the pruner
//! beside it, and reads the [`DemoSummary`] from the tables.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use ractor::ActorRef;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sagabox::Schema;
use sagabox::clock::{Clock, ScaledClock};
use sagabox::database::{AnyStore, OnStore, Store};
use sagabox::gather::Gather;
use sagabox::inbox::{InboxConfig, InboxError, InboxGuard};
use sagabox::logging::redact;
use sagabox::month::Month;
use sagabox::orchestrator::{DriveStats, Orchestrator, OrchestratorArguments, OrchestratorMessage};
use sagabox::pruner::{Maintenance, PrunePass, Pruner, PrunerArguments, PrunerMessage};
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance};
use sagabox::step::StepHandler;
use sagabox::supervisor::Supervision;
use sagabox::testing::FaultyDispatch;
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Encode, Executor, IntoArguments, Pool, Type};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::order::OrderDb;
use crate::schema::CheckoutTables;
use crate::summary::SUMMARY_SQL;
use crate::{
    CHECKOUT_TOML, CheckoutStep, DemoConfig, DemoDispatch, DemoError, DemoSummary, FreshIds,
    Verdict,
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

/// How long stopping a run waits for the dispatches still on their way to end.
const DISPATCH_ENDS_WITHIN: Duration = Duration::from_secs(30);

/// One order of the run: its row in `demo_orders` and its saga's data.
pub(crate) struct Order {
    pub(crate) id: String,
    pub(crate) data: Value,
}

impl Order {
    /// A random order: a sku, 1 to 3 of it, an amount, declined at `decline_rate`.
    pub(crate) fn random(rng: &mut StdRng, decline_rate: f64) -> Self {
        let id = Uuid::now_v7().to_string();
        let sku = SKUS[rng.random_range(0..SKUS.len())];
        let quantity: i64 = rng.random_range(1..=3);
        let amount_cents: i64 = rng.random_range(100..=20_000);
        let decline = rng.random_bool(decline_rate);
        let data = json!({
            "order_id": id, "sku": sku, "quantity": quantity,
            "amount_cents": amount_cents, "decline": decline,
        });
        Self { id, data }
    }
}

/// The most orders one transaction places.
const PLACE_BATCH: usize = 64;

/// Stock per sku: about 85 % of the expected demand, so some orders run out.
fn initial_stock(orders: usize) -> i64 {
    let expected = (orders as f64 * 2.0 / SKUS.len() as f64).ceil();
    (expected * 0.85).max(1.0) as i64
}

/// The demo's own SQL, written once for both databases: its tables set up for a run,
/// an order placed with its saga, the damage figures read back. Implemented for every
/// database sqlx can bind and decode the demo's values on.
pub(crate) trait DemoDb: CheckoutTables + OrderDb {
    /// Creates the demo's tables if missing and, for a fresh run, resets them, records
    /// the run's size and stocks the inventory; for `resume`, reads the size on record.
    /// Returns the orders still to place.
    fn prepare(
        pool: &Pool<Self>,
        schema: &Schema,
        config: &DemoConfig,
        url: &str,
    ) -> impl Future<Output = Result<usize, DemoError>> + Send;

    /// Inserts the order and its saga in one transaction: no order without its saga.
    fn place<S: SagaInsert<SagaDb = Self>>(
        pool: &Pool<Self>,
        store: &S,
        order: &Order,
        saga: &SagaInstance,
    ) -> impl Future<Output = Result<(), DemoError>> + Send;

    /// Inserts many orders with their sagas in one transaction and one commit (two
    /// statements); if that fails, each order as [`place`](Self::place) does, so one bad
    /// order fails alone. Answers each, in order.
    fn place_all<S: SagaInsert<SagaDb = Self>>(
        pool: &Pool<Self>,
        store: &S,
        placed: Vec<(Order, SagaInstance)>,
    ) -> impl Future<Output = Vec<Result<(), DemoError>>> + Send;

    /// The summary's figures ([`SUMMARY_SQL`]) by name.
    fn figures(
        pool: &Pool<Self>,
        schema: &Schema,
    ) -> impl Future<Output = Result<HashMap<&'static str, i64>, sqlx::Error>> + Send;
}

impl<DB> DemoDb for DB
where
    DB: CheckoutTables + OrderDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    usize: ColumnIndex<DB::Row>,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Decode<'t, DB> + Type<DB>,
    for<'t> Option<i64>: Encode<'t, DB> + Type<DB>,
{
    async fn prepare(
        pool: &Pool<DB>,
        schema: &Schema,
        config: &DemoConfig,
        url: &str,
    ) -> Result<usize, DemoError> {
        sqlx::raw_sql(DB::TABLES).execute(pool).await?;
        // The run's size is stored, so that `resume` can place what a killed run had not
        // placed yet.
        let target = if config.resume {
            let stored: Option<i64> = sqlx::query_scalar("SELECT orders FROM demo_run")
                .fetch_optional(pool)
                .await?;
            let stored = stored.ok_or_else(|| DemoError::NothingToResume {
                database: redact(url),
            })?;
            usize::try_from(stored).unwrap_or(0)
        } else {
            // One transaction: a run killed while setting up is either on record,
            // stocked, or not started at all.
            let mut tx = pool.begin().await?;
            sqlx::raw_sql(AssertSqlSafe(schema.sql(RESET)))
                .execute(&mut *tx)
                .await?;
            sqlx::query("INSERT INTO demo_run (orders) VALUES ($1)")
                .bind(i64::try_from(config.orders).unwrap_or(i64::MAX))
                .execute(&mut *tx)
                .await?;
            for sku in SKUS {
                sqlx::query("INSERT INTO inventory (sku, initial, on_hand) VALUES ($1, $2, $2)")
                    .bind(sku)
                    .bind(initial_stock(config.orders))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            config.orders
        };
        let placed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM demo_orders")
            .fetch_one(pool)
            .await?;
        Ok(target.saturating_sub(usize::try_from(placed).unwrap_or(0)))
    }

    async fn place<S: SagaInsert<SagaDb = DB>>(
        pool: &Pool<DB>,
        store: &S,
        order: &Order,
        saga: &SagaInstance,
    ) -> Result<(), DemoError> {
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(order.id.as_str())
        .bind(saga.id.as_str())
        .bind(order.data["sku"].as_str())
        .bind(order.data["quantity"].as_i64())
        .bind(order.data["amount_cents"].as_i64())
        .execute(&mut *tx)
        .await?;
        store.insert(&mut tx, saga).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn place_all<S: SagaInsert<SagaDb = DB>>(
        pool: &Pool<DB>,
        store: &S,
        placed: Vec<(Order, SagaInstance)>,
    ) -> Vec<Result<(), DemoError>> {
        let (orders, sagas): (Vec<Order>, Vec<SagaInstance>) = placed.into_iter().unzip();
        if orders.len() > 1 && place_together(pool, store, &orders, &sagas).await.is_ok() {
            return orders.iter().map(|_| Ok(())).collect();
        }
        let mut answers = Vec::with_capacity(orders.len());
        for (order, saga) in orders.iter().zip(&sagas) {
            answers.push(Self::place(pool, store, order, saga).await);
        }
        answers
    }

    async fn figures(
        pool: &Pool<DB>,
        schema: &Schema,
    ) -> Result<HashMap<&'static str, i64>, sqlx::Error> {
        let mut figures = HashMap::new();
        for (name, sql) in SUMMARY_SQL {
            let value: i64 = sqlx::query_scalar(AssertSqlSafe(schema.sql(sql)))
                .fetch_one(pool)
                .await?;
            figures.insert(name, value);
        }
        Ok(figures)
    }
}

/// The orders and their sagas in one transaction: the orders with one statement (their
/// columns as JSON rows), the sagas with [`SagaInsert::insert_all`].
async fn place_together<DB, S>(
    pool: &Pool<DB>,
    store: &S,
    orders: &[Order],
    sagas: &[SagaInstance],
) -> Result<(), DemoError>
where
    DB: OrderDb,
    S: SagaInsert<SagaDb = DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB> + Default,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    let rows: Vec<Value> = orders
        .iter()
        .zip(sagas)
        .map(|(order, saga)| {
            json!({
                "id": order.id, "saga_id": saga.id, "sku": order.data["sku"],
                "quantity": order.data["quantity"], "amount_cents": order.data["amount_cents"],
            })
        })
        .collect();
    let insert = format!(
        "INSERT INTO demo_orders (id, saga_id, sku, quantity, amount_cents) \
         SELECT x.id, x.saga_id, x.sku, x.quantity, x.amount_cents FROM {}",
        DB::json_rows(&[
            ("id", "text"),
            ("saga_id", "text"),
            ("sku", "text"),
            ("quantity", "bigint"),
            ("amount_cents", "bigint"),
        ])
    );
    let mut tx = pool.begin().await?;
    sqlx::query(AssertSqlSafe(insert))
        .bind(Value::Array(rows).to_string().as_str())
        .execute(&mut *tx)
        .await?;
    store.insert_all(&mut tx, sagas).await?;
    tx.commit().await?;
    Ok(())
}

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
    AnyStore::connect(url, connections, &config.schema)
        .await?
        .run(DemoRun { url, config })
        .await
}

/// [`run`]'s work on the store the URL named.
struct DemoRun<'a> {
    url: &'a str,
    config: &'a DemoConfig,
}

impl<S> OnStore<S> for DemoRun<'_>
where
    S: Store,
    S::Db: DemoDb,
    CheckoutStep: StepHandler<S::Db>,
{
    type Output = Result<DemoSummary, DemoError>;

    async fn run(self, store: S) -> Self::Output {
        run_on(self.url, store, self.config).await
    }
}

/// The actors of a run, linked to one supervisor: if one dies, the run ends with its
/// cause instead of waiting on it.
struct Actors<S: Store> {
    supervision: Supervision,
    pruner: (ActorRef<PrunerMessage>, JoinHandle<()>),
    orchestrator: (ActorRef<OrchestratorMessage>, JoinHandle<()>),
    dispatch: Arc<DemoDispatch>,
    stats: Arc<DriveStats>,
    months_pruned: Arc<Mutex<Vec<Month>>>,
    guard: InboxGuard<S>,
}

impl<S: Store> Actors<S>
where
    CheckoutStep: StepHandler<S::Db>,
{
    /// Starts the pruner, the steps' dispatch and the orchestrator.
    async fn start(
        guard: InboxGuard<S>,
        definition: &Arc<SagaDefinition>,
        clock: &ScaledClock,
        config: &DemoConfig,
    ) -> Result<Self, DemoError> {
        let supervision = Supervision::start()
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
        // The pruner runs as it would beside a deployment; under a fast clock it is what
        // keeps creating the months ahead and dropping the expired ones.
        let months_pruned = Arc::new(Mutex::new(Vec::new()));
        let pruner = supervision
            .spawn(
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
        let dispatch = DemoDispatch::start(
            &guard,
            *clock,
            definition,
            (config.fail_rate, config.seed ^ 0x5eed),
            config.claim_batch,
            config.transport.as_ref(),
            &supervision,
        )
        .await?;
        let dispatch = Arc::new(dispatch);
        let faulty = FaultyDispatch::new(
            FreshIds::new(Arc::clone(&dispatch), config.no_inbox),
            config.duplicate_rate,
            config.lost_reply_rate,
            config.seed,
        )
        .map_err(|error| DemoError::Config(error.to_string()))?;
        let stats = Arc::new(DriveStats::default());
        let orchestrator = supervision
            .spawn(
                "orchestrator",
                Orchestrator::new(),
                OrchestratorArguments::new(
                    Arc::clone(definition),
                    guard.store().clone(),
                    Arc::new(faulty),
                )
                .with_stats(Arc::clone(&stats))
                .with_clock(Arc::new(*clock)),
            )
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
        Ok(Self {
            supervision,
            pruner,
            orchestrator,
            dispatch,
            stats,
            months_pruned,
            guard,
        })
    }

    /// Stops every actor, the orchestrator first, and returns the months the pruner
    /// dropped.
    async fn stop(self) -> Vec<Month> {
        let (orchestrator, orchestrator_handle) = self.orchestrator;
        orchestrator.stop(None);
        let _ = orchestrator_handle.await;
        // The orchestrator's state (and its handle on the dispatch) is gone with it; a
        // dispatch still on its way (its task ends at the step's timeout at the latest)
        // holds another handle until it ends.
        let mut dispatch = self.dispatch;
        let deadline = Instant::now() + DISPATCH_ENDS_WITHIN;
        loop {
            match Arc::try_unwrap(dispatch) {
                Ok(alone) => {
                    alone.stop().await;
                    break;
                }
                Err(shared) if Instant::now() < deadline => {
                    dispatch = shared;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_) => {
                    tracing::warn!(
                        "the steps' dispatch is still in use {DISPATCH_ENDS_WITHIN:?} after the \
                         orchestrator stopped: its participants stop with the process"
                    );
                    break;
                }
            }
        }
        let (pruner, pruner_handle) = self.pruner;
        pruner.stop(None);
        let _ = pruner_handle.await;
        self.supervision.stop().await;
        std::mem::take(
            &mut *self
                .months_pruned
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// [`run`] on a store of one database type.
async fn run_on<S>(url: &str, store: S, config: &DemoConfig) -> Result<DemoSummary, DemoError>
where
    S: Store,
    S::Db: DemoDb,
    CheckoutStep: StepHandler<S::Db>,
{
    let definition = Arc::new(SagaDefinition::from_toml_str(CHECKOUT_TOML)?);
    let clock = config.clock()?;
    let guard = InboxGuard::new(store.clone(), InboxConfig::default())
        .map_err(InboxError::from)?
        .with_clock(clock);
    guard.migrate().await?;
    let pool = Store::pool(&store).clone();
    let to_place = S::Db::prepare(&pool, store.schema(), config, url).await?;
    // Dropped on any return, the supervisor stops every actor of the run.
    let actors = Actors::start(guard, &definition, &clock, config).await?;
    let started = Instant::now();
    let work = place_and_finish(&pool, &actors, &definition, &clock, config, to_place);
    let finished = tokio::select! {
        done = work => match done {
            Ok(finished) => finished,
            // An actor that died makes the calls to it fail: its death is the cause. Its
            // report reaches the supervisor just after those calls fail.
            Err(error) => {
                let died = tokio::time::timeout(DEATH_REPORT_WITHIN, actors.supervision.died()).await;
                return Err(died.map_or(error, DemoError::from));
            }
        },
        died = actors.supervision.died() => return Err(died.into()),
        failed = actors.dispatch.failed() => return Err(failed),
    };
    let elapsed = started.elapsed();
    let stats = Arc::clone(&actors.stats);
    let guard = actors.guard.clone();
    let months_pruned = actors.stop().await;
    let months_kept = guard.partitions().await?;
    let figures = S::Db::figures(&pool, store.schema()).await?;
    let figure = |name: &str| figures.get(name).copied().unwrap_or_default();
    let mut summary = DemoSummary {
        database: redact(url),
        transport: config.transport.as_ref().map_or_else(
            || "in-process".to_owned(),
            |transport| redact(&transport.url),
        ),
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

/// Resumes the run's unfinished sagas (with `resume`), places `to_place` orders with
/// at most `concurrency` sagas in flight, and waits for every saga to finish. Returns
/// how many finished.
async fn place_and_finish<S>(
    pool: &Pool<S::Db>,
    actors: &Actors<S>,
    definition: &SagaDefinition,
    clock: &ScaledClock,
    config: &DemoConfig,
    to_place: usize,
) -> Result<usize, DemoError>
where
    S: Store,
    S::Db: DemoDb,
{
    let orchestrator = &actors.orchestrator.0;
    let progress = progress_bar(config.progress);
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
    // The orders placed while a batch of them commits go together in the next: one
    // commit for many starts when they come fast, none waiting when they come slowly.
    let placing = {
        let (pool, store) = (pool.clone(), actors.guard.store().clone());
        Gather::new(1, PLACE_BATCH, move |placed: Vec<(Order, SagaInstance)>| {
            let (pool, store) = (pool.clone(), store.clone());
            async move { S::Db::place_all(&pool, &store, placed).await }
        })
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(config.concurrency));
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut running = tokio::task::JoinSet::new();
    let placing_since = tokio::time::Instant::now();
    for placed in 0..to_place {
        if let Some(pace) = config.pace {
            let due = Duration::from_secs_f64(placed as f64 / pace);
            tokio::time::sleep_until(placing_since + due).await;
        }
        // Reap the sagas already finished: a finished task is kept until joined, so
        // without this the run's memory would grow with every order placed.
        while let Some(joined) = running.try_join_next() {
            joined.map_err(|e| DemoError::Actor(e.to_string()))??;
        }
        let permit = Arc::clone(&permits)
            .acquire_owned()
            .await
            .map_err(|e| DemoError::Actor(e.to_string()))?;
        let order = Order::random(&mut rng, config.decline_rate);
        // Saga times come from the run's clock: command ids are derived from them.
        let saga = SagaInstance::under(
            definition,
            Uuid::now_v7().to_string(),
            order.data.clone(),
            clock.now(),
        );
        let (orchestrator, progress) = (orchestrator.clone(), progress.clone());
        let placing = placing.clone();
        // Placed in the saga's own task: placed one after another, the orders' commits
        // would bound the run to one commit at a time.
        running.spawn(async move {
            placing
                .submit((order, saga.clone()))
                .await
                .unwrap_or_else(|| Err(DemoError::Actor("the placing of orders ended".into())))?;
            // Its driver starts from the saga as placed, without reading it back.
            let done = ractor::call!(orchestrator, OrchestratorMessage::RunStored, Box::new(saga));
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
    progress.finish_and_clear();
    Ok(resumed + to_place)
}

/// The run's progress bar, hidden unless asked for.
fn progress_bar(shown: bool) -> ProgressBar {
    let progress = if shown {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:40}] {pos}/{len} sagas ({per_sec})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    progress
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of orders that cannot be placed together (one repeats a placed order's
    /// id) is placed order by order: the others are placed with their sagas, the repeat
    /// fails alone and leaves no saga.
    #[tokio::test]
    async fn a_batch_of_orders_that_fails_together_is_placed_order_by_order() {
        use sagabox::{InboxStore, SqliteStore};

        let path = std::env::temp_dir().join(format!("sagabox-place-{}.db", Uuid::new_v4()));
        let url = format!("sqlite:{}", path.display());
        let store = SqliteStore::connect(&url, 2).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::raw_sql(crate::SQLITE_TABLES)
            .execute(store.pool())
            .await
            .unwrap();
        let definition = SagaDefinition::from_toml_str(CHECKOUT_TOML).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let mut next = || {
            let order = Order::random(&mut rng, 0.0);
            let saga = SagaInstance::under(
                &definition,
                Uuid::now_v7().to_string(),
                order.data.clone(),
                chrono::Utc::now(),
            );
            (order, saga)
        };
        let (first, first_saga) = next();
        sqlx::Sqlite::place(store.pool(), &store, &first, &first_saga)
            .await
            .unwrap();
        let (again, mut again_saga) = next();
        let again = Order {
            id: first.id.clone(),
            ..again
        };
        again_saga.data = again.data.clone();
        let batch = vec![next(), (again, again_saga), next()];
        let answers = sqlx::Sqlite::place_all(store.pool(), &store, batch).await;
        assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
        assert!(answers[1].is_err(), "{answers:?}");
        let pool = store.pool();
        for (sql, expected) in [
            ("SELECT COUNT(*) FROM demo_orders", 3),
            ("SELECT COUNT(*) FROM sagabox_saga_instances", 3),
        ] {
            let found: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
            assert_eq!(found, expected, "{sql}");
        }
        store.pool().close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

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
        for pace in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let unpaced = DemoConfig {
                pace: Some(pace),
                ..DemoConfig::default()
            };
            assert!(unpaced.validate().is_err(), "{pace}");
        }
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
