//! [`PostgresStore`]: the production inbox, one table partitioned by month.
//!
//! Uniqueness across partitions: PostgreSQL cannot enforce a unique key that omits the
//! partition key, so the partition key is made a function of the message: the month of
//! its UUIDv7 id or publish time ([`Envelope::dedup_time`](crate::Envelope::dedup_time)).
//! When that time cannot differ between deliveries (a UUIDv7 id, or a trusted publish
//! time) every delivery targets the same partition, where the primary key
//! `(consumer_type, message_id, bucket)` is in effect global: the claim inserts the key's
//! row into that partition straight away and the insert is the arbiter. Otherwise the
//! claim locks the key, then probes every live partition, and the row is inserted after
//! the handler. Both kinds of claim hold the same per-key advisory lock, so they also
//! serialise with each other.
//! `docs/partitioning.md` has the reasoning and the measurements.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use serde_json::Value;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgArguments, PgPool, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Connection, Postgres, Row, Transaction};

use crate::connection::ConnectError;
use crate::envelope::ConsumerType;
use crate::month::Month;
use crate::schema::Schema;
use crate::store::{
    BatchClaim, ClaimKey, Claimed, FirstDelivery, InboxStore, MaintenanceLock, PARTITION_PREFIX,
    PartitionCreation,
};

/// The PostgreSQL migrations, embedded at build time. They create unqualified names and
/// run with `search_path` set to the store's schema (see `store::layout`).
pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("migrations/postgres");

/// Advisory lock class of sagabox ('Saga' in ASCII), clear of other users' locks taken
/// with a single bigint key. Object 0 serialises partition DDL; claims use the key hash.
const LOCK_CLASS: i32 = 1_398_892_385;

/// The advisory lock object of a claim key: 32-bit FNV-1a of `consumer_type`, a unit
/// separator (which keys cannot contain) and `message_id`, never 0.
///
/// Every process that claims from the same inbox must compute the same number, so this
/// function must never change. A collision only makes two keys wait for each other.
fn key_lock(key: &ClaimKey<'_>) -> i32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let bytes = key
        .consumer_type
        .as_str()
        .bytes()
        .chain([0x1f])
        .chain(key.message_id.as_str().bytes());
    let hash = bytes.fold(OFFSET, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(PRIME)
    });
    match i32::from_ne_bytes(hash.to_ne_bytes()) {
        0 => 1,
        object => object,
    }
}

/// The inbox in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    schema: Schema,
}

impl PostgresStore {
    /// Takes maintenance lock `object` without waiting. A session lock, on a connection
    /// taken out of the pool: it is released when the lock is dropped (the connection
    /// closes) or the process dies, and never goes back to the pool still held.
    async fn try_session_lock(&self, object: i32) -> Result<Option<MaintenanceLock>, sqlx::Error> {
        let mut session = self.pool.acquire().await?.detach();
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(MAINTENANCE_CLASS)
            .bind(object)
            .fetch_one(&mut session)
            .await?;
        if locked {
            Ok(Some(MaintenanceLock::postgres(session)))
        } else {
            let _ = session.close().await;
            Ok(None)
        }
    }

    /// A store on an existing pool, with its tables in the default schema (`sagabox`;
    /// see [`with_schema`](Self::with_schema)). The pool may be one the application
    /// shares: every statement names its schema, none changes the connection's settings.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            schema: Schema::default(),
        }
    }

    /// The same store with its tables in `schema` instead: several installations of
    /// sagabox can share one database, each in a schema of its own.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// The schema that holds the store's tables.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Connects a pool of up to `max_connections` to `url`
    /// (`postgres://user@host:port/db`). Connections are not pinged before each use: a
    /// broken one fails its transaction with a retryable database error instead of
    /// costing every message an extra round trip.
    ///
    /// A database that cannot be reached now fails at once with the cause (connection
    /// refused, authentication, no such database): the pool's own first connection would
    /// retry for its whole acquire timeout (30 s) and then report only a pool timeout.
    /// Later outages are ridden through: a connection is opened again when needed. The
    /// error names the host and port (the URL's password redacted).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, ConnectError> {
        let failed = |error| ConnectError::new(url, error);
        let options = crate::connection::postgres_options(url)?.application_name("sagabox");
        crate::connection::connect_postgres(url, &options)
            .await?
            .close()
            .await
            .map_err(failed)?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(30))
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(failed)?;
        Ok(Self::new(pool))
    }

    /// The pool, for the caller's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The inbox partition of `month`, in `schema`: `"sagabox".sagabox_inbox_2026_12`.
fn partition_name(schema: &Schema, month: Month) -> String {
    schema.table(&format!("{PARTITION_PREFIX}{}", month.suffix()))
}

/// Tries the key's advisory lock (`$1`, `$2`) and looks up its first delivery (`$3`,
/// `$4`) in one statement: one row, `locked` and the first delivery's columns or NULLs.
/// The claim of a key without its own bucket (after taking the lock) and of a key whose
/// handler records a result (the row is inserted after it). A key with its own bucket
/// whose handler records none is claimed by [`claim_fast_sql`], then, if that wrote
/// nothing, looked up with [`claim_counting_sql`].
///
/// The try and the lookup share the statement's snapshot: a delivery that commits
/// between the two stays unseen. That is why a claim without its own bucket, whose row
/// no primary key could catch, locks first.
///
/// With a bucket the lookup reads that partition itself, not the parent: a prepared
/// statement on the parent gets a generic plan that opens every partition before pruning
/// at run time, which makes the lookup cost more than the insert it guards. Without one
/// it reads every live partition.
fn claim_sql(schema: &Schema, key: &ClaimKey<'_>) -> String {
    let from = if key.probe_all {
        schema.sql(
            "SELECT processed_at, result FROM {schema}.sagabox_inbox \
             WHERE consumer_type = $3 AND message_id = $4 ORDER BY processed_at LIMIT 1",
        )
    } else {
        format!(
            "SELECT processed_at, result FROM {} WHERE consumer_type = $3 AND message_id = $4",
            partition_name(schema, key.bucket)
        )
    };
    format!(
        "SELECT pg_try_advisory_xact_lock($1, $2) AS locked, i.processed_at, i.result \
         FROM (SELECT 1) one LEFT JOIN LATERAL ({from}) i ON true"
    )
}

/// The claim of a key filed in its own month (`!probe_all`) whose handler records no
/// result, in one statement: if the key's advisory lock (`$5`, `$6`) is free, take it and
/// insert the key's row (`$1` consumer type, `$2` message id, `$3` bucket, `$4`
/// processed at) with a null result, `ON CONFLICT DO NOTHING` — the hand-written inbox's
/// statement with the lock as its condition.
///
/// One row inserted: the claim is fresh, with the lock held, in the round trips of a
/// hand-written inbox (`BEGIN`, claim, the handler's statements, `COMMIT`). The
/// partition's primary key is global for such keys and every writer of a key's row
/// holds its lock, so the insert itself is the arbiter. None: the lock is taken or the
/// row exists; [`claim_counting_sql`] (after waiting for the lock if need be) then tells
/// which, in a statement whose fresh snapshot sees the row that won. Only duplicates pay
/// for that second statement.
fn claim_fast_sql(schema: &Schema, key: &ClaimKey<'_>) -> String {
    format!(
        "INSERT INTO {} (consumer_type, message_id, bucket, processed_at, result) \
         SELECT $1, $2, $3, $4, 'null'::jsonb WHERE pg_try_advisory_xact_lock($5, $6) \
         ON CONFLICT DO NOTHING",
        partition_name(schema, key.bucket)
    )
}

/// The second look of a claim whose insert ([`claim_fast_sql`]) wrote nothing, counting
/// the duplicate it finds: tries the key's advisory lock (`$1`, `$2`) and, if it is
/// taken, adds one to the duplicate count of the key's row in its month (`$3` consumer
/// type, `$4` message id, `$5` the duplicate's time), returning the first delivery's
/// columns. One row: `locked`, and the first delivery's `processed_at` and `result` or
/// NULLs. A duplicate is then answered and counted in one statement, one round trip more
/// than a hand-written inbox's duplicate, and its transaction commits without waiting for
/// the WAL flush (the count is a statistic; see [`InboxStore::record_duplicate`]).
///
/// Kept apart from the insert on purpose: folded into it (an `UPDATE` in the insert's
/// statement), every fresh claim paid for the update's index probe, and the guard's
/// throughput at 20 % duplicates fell by more than the saved round trip gained.
fn claim_counting_sql(schema: &Schema, key: &ClaimKey<'_>) -> String {
    format!(
        "WITH k AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1, $2) AS locked), \
         dup AS ( \
             UPDATE {} SET duplicates = duplicates + 1, \
                    last_duplicate_at = GREATEST(last_duplicate_at, $5) \
              WHERE consumer_type = $3 AND message_id = $4 AND (SELECT locked FROM k) \
             RETURNING processed_at, result, \
                       set_config('synchronous_commit', 'off', true) AS async_commit) \
         SELECT k.locked, d.processed_at, d.result FROM k LEFT JOIN dup d ON true",
        partition_name(schema, key.bucket)
    )
}

/// The first delivery's columns of a claim's row, if it found one.
fn first_delivery(row: &PgRow) -> Result<Option<FirstDelivery>, sqlx::Error> {
    Ok(
        match row.try_get::<Option<DateTime<Utc>>, _>("processed_at")? {
            Some(processed_at) => Some(FirstDelivery {
                processed_at,
                result: row.try_get::<Json<Value>, _>("result")?.0,
            }),
            None => None,
        },
    )
}

/// Advisory lock class of the maintenance locks ('Sagb'): session locks held for a whole
/// pass, in a class of their own so that no claim key's hash can collide with them.
const MAINTENANCE_CLASS: i32 = LOCK_CLASS + 1;
/// The maintenance lock's object for the inbox pruner's pass.
const INBOX_MAINTENANCE: i32 = 0;
/// The maintenance lock's object for the saga history's pass.
const HISTORY_MAINTENANCE: i32 = 1;

/// The advisory lock object that serialises partition DDL and the pruned watermark.
const DDL_LOCK: i32 = 0;

/// Waits for the advisory lock `(LOCK_CLASS, lock)` (a key's, or [`DDL_LOCK`]), held until
/// the transaction ends.
async fn wait_for_lock(
    tx: &mut Transaction<'static, Postgres>,
    lock: i32,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(LOCK_CLASS)
        .bind(lock)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A claim statement with its arguments bound, ready to run.
type ClaimQuery<'q> = Query<'q, Postgres, PgArguments>;

/// Runs `statement`, which tries the key's lock and reports it as `locked`. When another
/// delivery of the key holds the lock, waits for it to end and runs the statement again:
/// a new statement, whose snapshot sees what that delivery committed.
async fn once_locked<'q>(
    tx: &mut Transaction<'static, Postgres>,
    lock: i32,
    statement: impl Fn() -> ClaimQuery<'q>,
) -> Result<PgRow, sqlx::Error> {
    let row = statement().fetch_one(&mut **tx).await?;
    if row.try_get::<bool, _>("locked")? {
        return Ok(row);
    }
    wait_for_lock(tx, lock).await?;
    statement().fetch_one(&mut **tx).await
}

/// The batch form of [`claim_fast_sql`]: for every key (`$3` message ids, `$4` buckets,
/// `$5` lock objects, in class `$1`) try its advisory lock and, where it is taken, insert
/// its row (`$2` consumer type, `$6` processed at, a null result) `ON CONFLICT DO
/// NOTHING`. Returns one row per key *not* inserted, with whether its lock was taken.
///
/// The `MATERIALIZED` CTE tries each lock exactly once. Every writer of a key's row holds
/// the key's lock, so an insert under the lock never waits for another transaction: the
/// statement cannot block, nor deadlock with anything. `target` is the month's partition
/// when every key is filed in it, else the parent.
fn claim_batch_fast_sql(target: &str) -> String {
    format!(
        "WITH k AS MATERIALIZED ( \
             SELECT u.message_id, u.bucket, pg_try_advisory_xact_lock($1, u.lock) AS locked \
               FROM unnest($3::text[], $4::date[], $5::int4[]) AS u(message_id, bucket, lock)), \
         ins AS ( \
             INSERT INTO {target} (consumer_type, message_id, bucket, processed_at, result) \
             SELECT $2, k.message_id, k.bucket, $6, 'null'::jsonb FROM k WHERE k.locked \
             ON CONFLICT DO NOTHING RETURNING message_id) \
         SELECT k.message_id, k.locked FROM k \
          WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.message_id = k.message_id)"
    )
}

/// The first deliveries of `keys` recorded so far, by message id: one lookup per
/// partition the keys name (usually one), one through the parent for the keys whose
/// earlier deliveries may be in any partition.
async fn lookup_batch(
    schema: &Schema,
    tx: &mut Transaction<'static, Postgres>,
    consumer_type: &ConsumerType,
    keys: &[ClaimKey<'_>],
) -> Result<HashMap<String, FirstDelivery>, sqlx::Error> {
    let mut groups: Vec<(Option<Month>, Vec<&str>)> = Vec::new();
    for key in keys {
        let bucket = (!key.probe_all).then_some(key.bucket);
        match groups.iter_mut().find(|(b, _)| *b == bucket) {
            Some((_, ids)) => ids.push(key.message_id.as_str()),
            None => groups.push((bucket, vec![key.message_id.as_str()])),
        }
    }
    let mut found = HashMap::new();
    for (bucket, ids) in groups {
        let sql = match bucket {
            Some(month) => format!(
                "SELECT message_id, processed_at, result FROM {} \
                 WHERE consumer_type = $1 AND message_id = ANY($2)",
                partition_name(schema, month)
            ),
            None => schema.sql(
                "SELECT DISTINCT ON (message_id) message_id, processed_at, result \
                 FROM {schema}.sagabox_inbox WHERE consumer_type = $1 AND message_id = ANY($2) \
                 ORDER BY message_id, processed_at",
            ),
        };
        let rows: Vec<(String, DateTime<Utc>, Json<Value>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer_type.as_str())
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?;
        for (message_id, processed_at, Json(result)) in rows {
            found.insert(
                message_id,
                FirstDelivery {
                    processed_at,
                    result,
                },
            );
        }
    }
    Ok(found)
}

impl PostgresStore {
    /// The insert-first claim of a batch whose keys are all filed in their own month
    /// ([`claim_batch_fast_sql`]): a fresh batch costs one statement, as a fresh single
    /// message does. Keys whose rows exist are then looked up, in a statement of their
    /// own whose snapshot sees those rows. `None` when another transaction held the lock
    /// of some key: this transaction is rolled back, giving up every lock it tried, and
    /// the caller claims the batch with blocking locks in key order instead — holding
    /// some keys while waiting for others could deadlock with a batch doing the same.
    async fn try_batch_insert(
        &self,
        keys: &[ClaimKey<'_>],
        processed_at: DateTime<Utc>,
    ) -> Result<Option<BatchClaim<Postgres>>, sqlx::Error> {
        let Some(consumer_type) = keys.first().map(|key| key.consumer_type) else {
            return Ok(None);
        };
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        let ids: Vec<&str> = keys.iter().map(|key| key.message_id.as_str()).collect();
        let buckets: Vec<NaiveDate> = keys.iter().map(|key| key.bucket.first_day()).collect();
        let locks: Vec<i32> = keys.iter().map(key_lock).collect();
        // Straight into the month's partition when the batch has one (as a rule): no
        // tuple routing per row.
        let bucket = keys[0].bucket;
        let target = if keys.iter().all(|key| key.bucket == bucket) {
            partition_name(&self.schema, bucket)
        } else {
            self.schema.table("sagabox_inbox")
        };
        let missed: Vec<(String, bool)> =
            sqlx::query_as(AssertSqlSafe(claim_batch_fast_sql(&target)))
                .bind(LOCK_CLASS)
                .bind(consumer_type.as_str())
                .bind(&ids)
                .bind(&buckets)
                .bind(&locks)
                .bind(processed_at)
                .fetch_all(&mut *tx)
                .await?;
        if missed.iter().any(|(_, locked)| !locked) {
            tx.rollback().await?;
            return Ok(None);
        }
        let written = |_: &ClaimKey<'_>| Claimed::Fresh { row_written: true };
        if missed.is_empty() {
            let claims = keys.iter().map(written).collect();
            return Ok(Some((tx, claims)));
        }
        let missed: HashSet<String> = missed.into_iter().map(|(id, _)| id).collect();
        let existing: Vec<ClaimKey<'_>> = keys
            .iter()
            .filter(|key| missed.contains(key.message_id.as_str()))
            .copied()
            .collect();
        let mut found = lookup_batch(&self.schema, &mut tx, consumer_type, &existing).await?;
        let claims = keys
            .iter()
            .map(|key| {
                if !missed.contains(key.message_id.as_str()) {
                    return written(key);
                }
                // Not inserted under its lock, so its row exists and is committed; one
                // not found (it cannot be) is left to the insert after the handler, which
                // then meets it and fails the batch.
                Claimed::found(found.remove(key.message_id.as_str()))
            })
            .collect();
        Ok(Some((tx, claims)))
    }
}

impl InboxStore for PostgresStore {
    type Db = Postgres;

    fn pool_size(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    async fn begin_claim(
        &self,
        key: &ClaimKey<'_>,
        write_row_at: Option<DateTime<Utc>>,
    ) -> Result<(Transaction<'static, Postgres>, Claimed), sqlx::Error> {
        // READ COMMITTED whatever the database's default: a lookup after a blocking lock
        // relies on each statement taking a fresh snapshot.
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        let lock = key_lock(key);
        // The SQL is rendered where it runs: the insert-first claim of a fresh message
        // never renders the lookup.
        let lookup = || {
            sqlx::query(AssertSqlSafe(claim_sql(&self.schema, key)))
                .bind(LOCK_CLASS)
                .bind(lock)
                .bind(key.consumer_type.as_str())
                .bind(key.message_id.as_str())
        };
        let found = |row: &PgRow| first_delivery(row).map(Claimed::found);

        if key.probe_all {
            // A message without a time may have its first row in another partition than
            // the one this claim writes to, so no primary key would catch a race: take
            // the lock first, then look in every partition (the try in `lookup` succeeds).
            wait_for_lock(&mut tx, lock).await?;
            let row = lookup().fetch_one(&mut *tx).await?;
            let claimed = found(&row)?;
            return Ok((tx, claimed));
        }
        let Some(processed_at) = write_row_at else {
            // Look only; the row is inserted after the handler, with its result. A
            // delivery committing between this lookup's snapshot and its lock is caught
            // by that insert meeting its row (the guard then rolls back).
            let row = once_locked(&mut tx, lock, lookup).await?;
            let claimed = found(&row)?;
            return Ok((tx, claimed));
        };

        let inserted = sqlx::query(AssertSqlSafe(claim_fast_sql(&self.schema, key)))
            .bind(key.consumer_type.as_str())
            .bind(key.message_id.as_str())
            .bind(key.bucket.first_day())
            .bind(processed_at)
            .bind(LOCK_CLASS)
            .bind(lock)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
        if inserted {
            return Ok((tx, Claimed::Fresh { row_written: true }));
        }
        // Locked out, or the row exists: look and count, after the holder of the lock
        // (if any) ended. No row then (the holder rolled back) leaves the claim fresh
        // with the lock held, and the row is written after the handler.
        let row = once_locked(&mut tx, lock, || {
            sqlx::query(AssertSqlSafe(claim_counting_sql(&self.schema, key)))
                .bind(LOCK_CLASS)
                .bind(lock)
                .bind(key.consumer_type.as_str())
                .bind(key.message_id.as_str())
                .bind(processed_at)
        })
        .await?;
        let claimed = match first_delivery(&row)? {
            Some(first) => Claimed::Duplicate {
                first,
                counted: true,
            },
            None => Claimed::Fresh { row_written: false },
        };
        Ok((tx, claimed))
    }

    async fn begin_batch_claim(
        &self,
        keys: &[ClaimKey<'_>],
        write_rows_at: Option<DateTime<Utc>>,
    ) -> Result<BatchClaim<Postgres>, sqlx::Error> {
        let Some(consumer_type) = keys.first().map(|key| key.consumer_type) else {
            return Ok((self.pool.begin().await?, Vec::new()));
        };
        if let Some(processed_at) = write_rows_at
            && keys.iter().all(|key| !key.probe_all)
            && let Some(claimed) = self.try_batch_insert(keys, processed_at).await?
        {
            return Ok(claimed);
        }
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        // Blocking locks, ascending, in one statement (a function scan yields the array
        // in order): two overlapping batches take their common keys in the same order and
        // cannot deadlock. Locks come before the lookups, in a statement of their own, so
        // the lookups' snapshot sees whatever a racing claim of these keys committed —
        // no late conflict is possible, whichever partition a key's first row is in.
        let mut locks: Vec<i32> = keys.iter().map(key_lock).collect();
        locks.sort_unstable();
        locks.dedup();
        sqlx::query("SELECT pg_advisory_xact_lock($1, k) FROM unnest($2::int4[]) AS u(k)")
            .bind(LOCK_CLASS)
            .bind(&locks)
            .execute(&mut *tx)
            .await?;
        let mut found = lookup_batch(&self.schema, &mut tx, consumer_type, keys).await?;
        let claims = keys
            .iter()
            .map(|key| Claimed::found(found.remove(key.message_id.as_str())))
            .collect();
        Ok((tx, claims))
    }

    async fn record_batch_results(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        keys: &[ClaimKey<'_>],
        results: &[&Value],
    ) -> Result<u64, sqlx::Error> {
        let Some(consumer_type) = keys.first().map(|key| key.consumer_type) else {
            return Ok(0);
        };
        let ids: Vec<&str> = keys.iter().map(|key| key.message_id.as_str()).collect();
        let buckets: Vec<NaiveDate> = keys.iter().map(|key| key.bucket.first_day()).collect();
        let results: Vec<Json<&Value>> = results.iter().map(|result| Json(*result)).collect();
        // The rows are this transaction's own inserts; the bucket in the join lets the
        // planner prune to their partitions.
        let done = sqlx::query(AssertSqlSafe(self.schema.sql(
            "UPDATE {schema}.sagabox_inbox i SET result = u.result \
               FROM unnest($2::text[], $3::date[], $4::jsonb[]) AS u(message_id, bucket, result) \
              WHERE i.consumer_type = $1 AND i.message_id = u.message_id AND i.bucket = u.bucket",
        )))
        .bind(consumer_type.as_str())
        .bind(&ids)
        .bind(&buckets)
        .bind(&results)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected())
    }

    async fn record_batch(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        keys: &[ClaimKey<'_>],
        processed_at: DateTime<Utc>,
        results: &[&Value],
    ) -> Result<u64, sqlx::Error> {
        let Some(consumer_type) = keys.first().map(|key| key.consumer_type) else {
            return Ok(0);
        };
        let ids: Vec<&str> = keys.iter().map(|key| key.message_id.as_str()).collect();
        let buckets: Vec<NaiveDate> = keys.iter().map(|key| key.bucket.first_day()).collect();
        let results: Vec<Json<&Value>> = results.iter().map(|result| Json(*result)).collect();
        let done = sqlx::query(AssertSqlSafe(self.schema.sql(
            "INSERT INTO {schema}.sagabox_inbox (consumer_type, message_id, bucket, processed_at, result) \
             SELECT $1, u.message_id, u.bucket, $2, u.result \
               FROM unnest($3::text[], $4::date[], $5::jsonb[]) AS u(message_id, bucket, result) \
             ON CONFLICT DO NOTHING",
        )))
        .bind(consumer_type.as_str())
        .bind(processed_at)
        .bind(&ids)
        .bind(&buckets)
        .bind(&results)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected())
    }

    async fn record(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        key: &ClaimKey<'_>,
        processed_at: DateTime<Utc>,
        result: &Value,
    ) -> Result<bool, sqlx::Error> {
        // Through the parent: tuple routing finds the month's partition at about the
        // cost of a direct insert, and the statement stays one prepared text for every
        // month instead of one per partition name.
        let done = sqlx::query(AssertSqlSafe(self.schema.sql(
            "INSERT INTO {schema}.sagabox_inbox (consumer_type, message_id, bucket, processed_at, result) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )))
        .bind(key.consumer_type.as_str())
        .bind(key.message_id.as_str())
        .bind(key.bucket.first_day())
        .bind(processed_at)
        .bind(Json(result))
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_result(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        key: &ClaimKey<'_>,
        result: &Value,
    ) -> Result<(), sqlx::Error> {
        // The row is this transaction's own insert, in the partition the claim named.
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET result = $3 WHERE consumer_type = $1 AND message_id = $2",
            partition_name(&self.schema, key.bucket)
        )))
        .bind(key.consumer_type.as_str())
        .bind(key.message_id.as_str())
        .bind(Json(result))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn record_duplicate(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        key: &ClaimKey<'_>,
        first: &FirstDelivery,
        at: DateTime<Utc>,
    ) -> Result<(), sqlx::Error> {
        // The count is a statistic: this transaction commits without waiting for its
        // WAL flush (a crash may lose the last few counts, never a claim), so the
        // duplicate path costs an UPDATE, not an fsync. The CTE is evaluated with the
        // update, in the same round trip. With a bucket the row's partition is named
        // directly (see `claim_sql` on generic plans); without one, the parent is
        // searched for the row the claim returned.
        let target = if key.probe_all {
            self.schema.table("sagabox_inbox")
        } else {
            partition_name(&self.schema, key.bucket)
        };
        sqlx::query(AssertSqlSafe(format!(
            "WITH async_commit AS (SELECT set_config('synchronous_commit', 'off', true)) \
             UPDATE {target} SET duplicates = duplicates + 1, \
                    last_duplicate_at = GREATEST(last_duplicate_at, $4) \
             FROM async_commit \
             WHERE consumer_type = $1 AND message_id = $2 AND processed_at = $3"
        )))
        .bind(key.consumer_type.as_str())
        .bind(key.message_id.as_str())
        .bind(first.processed_at)
        .bind(at)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn create_partition(&self, month: Month) -> Result<PartitionCreation, sqlx::Error> {
        let name = partition_name(&self.schema, month);
        let parent = self.schema.table("sagabox_inbox");
        let mut tx = self.pool.begin().await?;
        // Serialises with other creators and with the pruner's watermark update.
        wait_for_lock(&mut tx, DDL_LOCK).await?;
        let (exists, attached, pruned_through): (bool, bool, Option<NaiveDate>) =
            sqlx::query_as(AssertSqlSafe(self.schema.sql(
                "SELECT to_regclass($1) IS NOT NULL, \
                    EXISTS (SELECT 1 FROM pg_inherits \
                             WHERE inhparent = to_regclass($2) AND inhrelid = to_regclass($1)), \
                    (SELECT pruned_through FROM {schema}.sagabox_inbox_pruned)",
            )))
            .bind(&name)
            .bind(&parent)
            .fetch_one(&mut *tx)
            .await?;
        if pruned_through.is_some_and(|through| month.first_day() <= through) {
            tx.commit().await?;
            return Ok(PartitionCreation::Pruned);
        }
        if attached {
            tx.commit().await?;
            return Ok(PartitionCreation::Existed);
        }
        if exists {
            // A table of this name that is not attached: not ours to keep.
            sqlx::query(AssertSqlSafe(format!("DROP TABLE {name}")))
                .execute(&mut *tx)
                .await?;
        }
        // Created standalone, then attached: `CREATE TABLE … PARTITION OF` would take an
        // ACCESS EXCLUSIVE lock on the parent and stall every claim behind the longest
        // open transaction; `ATTACH PARTITION` takes SHARE UPDATE EXCLUSIVE, which
        // inserts and lookups do not conflict with. `name` and both bounds are rendered
        // from a validated Month: no outside text.
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {name} (LIKE {parent} INCLUDING ALL)"
        )))
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ('{}') TO ('{}')",
            month.first_day(),
            month.end().date_naive(),
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(PartitionCreation::Created)
    }

    async fn partitions(&self) -> Result<Vec<Month>, sqlx::Error> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r' \
               AND c.relname ~ '^sagabox_inbox_[0-9]{4}_[0-9]{2}$'",
        )
        .bind(self.schema.name())
        .fetch_all(&self.pool)
        .await?;
        let mut months: Vec<Month> = names
            .iter()
            .filter_map(|name| Month::from_table_name(PARTITION_PREFIX, name))
            .collect();
        months.sort();
        Ok(months)
    }

    async fn try_maintenance_lock(&self) -> Result<Option<MaintenanceLock>, sqlx::Error> {
        self.try_session_lock(INBOX_MAINTENANCE).await
    }

    async fn try_history_lock(&self) -> Result<Option<MaintenanceLock>, sqlx::Error> {
        self.try_session_lock(HISTORY_MAINTENANCE).await
    }

    async fn drop_partition(&self, month: Month) -> Result<bool, sqlx::Error> {
        let name = partition_name(&self.schema, month);
        let parent = self.schema.table("sagabox_inbox");
        // The watermark first, under the creators' lock, and committed: from here on no
        // claim can recreate this month, even between the detach and the drop below.
        let mut tx = self.pool.begin().await?;
        wait_for_lock(&mut tx, DDL_LOCK).await?;
        sqlx::query(AssertSqlSafe(self.schema.sql(
            "INSERT INTO {schema}.sagabox_inbox_pruned AS p (pruned_through) VALUES ($1) \
             ON CONFLICT (singleton) DO UPDATE \
             SET pruned_through = GREATEST(p.pruned_through, excluded.pruned_through)",
        )))
        .bind(month.first_day())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;

        let mut conn = self.pool.acquire().await?;
        let state: Option<(bool, Option<bool>)> = sqlx::query_as(
            "SELECT true, (SELECT inhdetachpending FROM pg_inherits \
                            WHERE inhparent = to_regclass($2) AND inhrelid = to_regclass($1)) \
             WHERE to_regclass($1) IS NOT NULL",
        )
        .bind(&name)
        .bind(&parent)
        .fetch_optional(&mut *conn)
        .await?;
        let Some((_, detach_pending)) = state else {
            return Ok(false);
        };
        // Detach first, CONCURRENTLY, so claims on the other partitions never wait for
        // an exclusive lock on the parent; then the drop touches only the detached table.
        // CONCURRENTLY cannot run in a transaction block: a simple-protocol statement.
        // A detach interrupted half-way is finished with FINALIZE.
        let detach = match detach_pending {
            Some(false) => Some("CONCURRENTLY"),
            Some(true) => Some("FINALIZE"),
            None => None,
        };
        if let Some(how) = detach {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE {parent} DETACH PARTITION {name} {how}"
            )))
            .execute(&mut *conn)
            .await?;
        }
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}")))
            .execute(&mut *conn)
            .await?;
        Ok(true)
    }

    fn is_missing_partition(error: &sqlx::Error) -> bool {
        // 42P01 undefined_table: the partition a claim looked up by name is gone;
        // 23514 check_violation: "no partition of relation found for row", an insert
        // routed to a month that is gone (the inbox has no other check constraints).
        matches!(error, sqlx::Error::Database(e)
            if matches!(e.code().as_deref(), Some("42P01" | "23514")))
    }

    async fn migrate(&self) -> Result<(), MigrateError> {
        // A connection of its own, closed afterwards: the migrations run with
        // `search_path` set to the schema, which must not reach the pool.
        let mut conn = self.pool.acquire().await?.detach();
        let migrated = super::layout::migrate_postgres(&mut conn, &self.schema, &MIGRATOR).await;
        let _ = conn.close().await;
        migrated
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    async fn ping(&self) -> Result<(), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        sqlx::Connection::ping(&mut *conn).await
    }
}
