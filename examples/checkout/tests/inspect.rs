//! `sagabox::inspect` against real PostgreSQL and SQLite: after a demo run its figures
//! equal SQL counts over the same tables; duplicates are counted exactly, from the inbox
//! rows, also when deliveries race; the windows, the not-migrated refusal and the SQLite
//! upgrade of monthly tables made before the duplicate columns existed.

#![allow(clippy::unwrap_used)]

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{TimeDelta, Utc};
use sagabox::inspect::{InspectError, InspectOptions, inspect, inspect_at};
use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Month, Outcome};
use sagabox_checkout::{DemoConfig, run};
use serde_json::json;

fn faulty(orders: usize) -> DemoConfig {
    DemoConfig {
        orders,
        concurrency: 16,
        duplicate_rate: 0.5,
        lost_reply_rate: 0.1,
        fail_rate: 0.1,
        decline_rate: 0.05,
        seed: 7,
        ..DemoConfig::default()
    }
}

/// A message with a UUIDv7 id (filed in its own month) or, with `timeless`, a UUIDv4 id
/// and no publish time (the claim probes every month).
fn message(timeless: bool) -> Envelope {
    let id = if timeless {
        MessageId::new(uuid::Uuid::new_v4().to_string()).unwrap()
    } else {
        MessageId::new_v7()
    };
    Envelope::new(id, "charge", json!({"cents": 100})).unwrap()
}

macro_rules! inspect_suite {
    ($backend:ident, $fixture:ty, $db:ty) => {
        mod $backend {
            use super::*;

            async fn guard(fx: &$fixture, connections: u32) -> InboxGuard<impl sagabox::InboxStore<Db = $db>> {
                let guard = InboxGuard::new(fx.store(connections).await, InboxConfig::default()).unwrap();
                guard.prepare_partitions().await.unwrap();
                guard
            }

            async fn deliver(guard: &InboxGuard<impl sagabox::InboxStore<Db = $db>>, consumer: &ConsumerType, envelope: &Envelope) -> Outcome {
                guard
                    .process(consumer, envelope, async |_conn, _envelope| Ok::<_, sqlx::Error>(json!({"ok": true})))
                    .await
                    .unwrap()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn after_a_demo_run_every_figure_matches_sql() {
                let fx = <$fixture>::new().await;
                let summary = run(&fx.url, &faulty(300)).await.unwrap();
                assert_eq!(summary.unfinished, 0, "{summary:?}");
                let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();

                // Partitions: the current month and two ahead, rows as counted by SQL.
                let current = Month::of(Utc::now()).unwrap();
                let months: Vec<String> = report.partitions.iter().map(|p| p.month.clone()).collect();
                let expected: Vec<String> = current.through(current.plus(2)).map(|m| m.to_string()).collect();
                assert_eq!(months, expected);
                assert!(report.missing_ahead.is_empty());
                let rows: i64 = report.partitions.iter().map(|p| p.rows).sum();
                assert_eq!(rows, fx.inbox_rows().await);
                assert!(rows > 0);
                for partition in &report.partitions {
                    assert!(partition.bytes.is_some_and(|b| b > 0), "{partition:?}");
                }

                // Duplicates: the report's per-type totals are SUM(duplicates) by SQL, and
                // a demo that delivers half its commands twice suppressed some of each.
                let by_sql: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sum_duplicates_sql(&report)))
                    .fetch_all(&fx.pool)
                    .await
                    .unwrap();
                let reported: Vec<(String, i64)> = report
                    .duplicate_deliveries
                    .iter()
                    .map(|d| (d.consumer_type.clone(), d.in_inbox))
                    .collect();
                assert_eq!(reported, by_sql);
                let types: Vec<&str> = reported.iter().map(|(t, _)| t.as_str()).collect();
                assert_eq!(types, ["email", "inventory", "payment"]);
                for d in &report.duplicate_deliveries {
                    assert!(d.in_inbox > 0, "{d:?}");
                    // All of them happened in the last minutes.
                    assert_eq!((d.last_hour, d.last_day), (d.in_inbox, d.in_inbox), "{d:?}");
                }

                // Sagas by status, as SQL groups them, and the summary's totals.
                let statuses: Vec<(String, i64)> =
                    sqlx::query_as("SELECT status, COUNT(*) FROM sagabox_saga_instances GROUP BY status")
                        .fetch_all(&fx.pool)
                        .await
                        .unwrap();
                let statuses: BTreeMap<String, i64> = statuses.into_iter().collect();
                assert_eq!(report.sagas.by_status, statuses);
                assert_eq!(report.sagas.by_status.get("completed"), Some(&summary.completed));
                assert_eq!(report.sagas.by_status.get("compensated"), Some(&summary.compensated));
                assert_eq!(report.sagas.oldest_unfinished, None);
                assert_eq!(report.outbox.pending, 0);
                assert_eq!(report.warnings, Vec::<String>::new());

                // The JSON form carries the same figures.
                let value = serde_json::to_value(&report).unwrap();
                assert_eq!(value["sagas"]["by_status"]["completed"], json!(summary.completed));
            }

            /// The SQL that sums `duplicates` per consumer type over every partition.
            fn sum_duplicates_sql(report: &sagabox::inspect::InspectReport) -> String {
                let parts: Vec<String> = report
                    .partitions
                    .iter()
                    .map(|p| {
                        format!(
                            "SELECT consumer_type, duplicates FROM sagabox_inbox_{}",
                            p.month.replace('-', "_")
                        )
                    })
                    .collect();
                format!(
                    "SELECT consumer_type, CAST(SUM(duplicates) AS BIGINT) FROM ({}) d \
                     WHERE duplicates > 0 GROUP BY consumer_type ORDER BY consumer_type",
                    parts.join(" UNION ALL ")
                )
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn each_suppressed_duplicate_is_counted_once_on_its_row() {
                let fx = <$fixture>::new().await;
                let guard = guard(&fx, 4).await;
                let payment = ConsumerType::new("payment").unwrap();
                let email = ConsumerType::new("email").unwrap();
                // payment: 3 messages delivered 1, 2 and 4 times (4 duplicates), one of
                // them without any time (the probe-every-month path); email: 1 message
                // twice (1 duplicate).
                let plan = [(&payment, message(false), 1), (&payment, message(false), 2), (&payment, message(true), 4), (&email, message(false), 2)];
                for (consumer, envelope, deliveries) in &plan {
                    for delivery in 0..*deliveries {
                        let outcome = deliver(&guard, consumer, envelope).await;
                        assert_eq!(matches!(outcome, Outcome::Duplicate { .. }), delivery > 0);
                    }
                }
                let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();
                let counts: Vec<(&str, i64, i64, i64)> = report
                    .duplicate_deliveries
                    .iter()
                    .map(|d| (d.consumer_type.as_str(), d.last_hour, d.last_day, d.in_inbox))
                    .collect();
                assert_eq!(counts, [("email", 1, 1, 1), ("payment", 4, 4, 4)]);
                let rows: i64 = report.partitions.iter().map(|p| p.rows).sum();
                assert_eq!(rows, 4, "duplicates add no rows");

                // An hour later the same rows fall out of the last-hour window only; a
                // day and a half later out of both; the rows still hold every count.
                let options = InspectOptions::default();
                let later = |hours| inspect_at(&fx.url, &options, Utc::now() + TimeDelta::hours(hours));
                let report = later(2).await.unwrap();
                assert_eq!(report.duplicate_deliveries[1].last_hour, 0);
                assert_eq!(report.duplicate_deliveries[1].last_day, 4);
                let report = later(36).await.unwrap();
                assert_eq!((report.duplicate_deliveries[1].last_day, report.duplicate_deliveries[1].in_inbox), (0, 4));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn racing_deliveries_count_every_duplicate_exactly() {
                let fx = <$fixture>::new().await;
                let guard = Arc::new(guard(&fx, 8).await);
                let payment = ConsumerType::new("payment").unwrap();
                let mut expected_duplicates = 0;
                for round in 0..10 {
                    let envelope = message(round % 2 == 1);
                    let deliveries: Vec<_> = (0..8)
                        .map(|_| {
                            let (guard, payment, envelope) = (Arc::clone(&guard), payment.clone(), envelope.clone());
                            tokio::spawn(async move { deliver(&guard, &payment, &envelope).await })
                        })
                        .collect();
                    let mut applied = 0;
                    for delivery in deliveries {
                        if matches!(delivery.await.unwrap(), Outcome::Applied(_)) {
                            applied += 1;
                        }
                    }
                    assert_eq!(applied, 1, "round {round}");
                    expected_duplicates += 7;
                }
                let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();
                assert_eq!(report.duplicate_deliveries.len(), 1);
                assert_eq!(report.duplicate_deliveries[0].in_inbox, expected_duplicates);
                assert_eq!(report.duplicate_deliveries[0].last_hour, expected_duplicates);
            }

            #[tokio::test]
            async fn unfinished_sagas_and_pending_outbox_rows_are_reported() {
                let fx = <$fixture>::new().await;
                let old = Utc::now() - TimeDelta::hours(3);
                sqlx::query(
                    "INSERT INTO sagabox_saga_instances (id, saga_name, status, current_step, attempts, data, created_at, updated_at, last_error) \
                     VALUES ('s-old', 'checkout', 'compensating', 0, 12, '{}', $1, $1, 'undo payment: timeout'), \
                            ('s-new', 'checkout', 'running', 1, 1, '{}', $2, $2, NULL)",
                )
                .bind(old)
                .bind(Utc::now())
                .execute(&fx.pool)
                .await
                .unwrap();
                sqlx::query(
                    "INSERT INTO sagabox_outbox (id, aggregate, destination, kind, payload, headers, created_at) \
                     VALUES ('o-1', 'order-1', 'email', 'send', '{}', '{}', $1), ('o-2', 'order-2', 'email', 'send', '{}', '{}', $2)",
                )
                .bind(old)
                .bind(Utc::now())
                .execute(&fx.pool)
                .await
                .unwrap();
                let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();
                let oldest = report.sagas.oldest_unfinished.as_ref().unwrap();
                assert_eq!((oldest.id.as_str(), oldest.attempts), ("s-old", 12));
                assert_eq!(report.outbox.pending, 2);
                assert_eq!(
                    report.outbox.oldest_pending_at.map(|t| t.timestamp_micros()),
                    Some(old.timestamp_micros())
                );
                assert!(report.warnings.iter().any(|w| w.contains("s-old")), "{:?}", report.warnings);
                assert!(report.warnings.iter().any(|w| w.contains("2 outbox rows pending")), "{:?}", report.warnings);
                assert!(!report.warnings.iter().any(|w| w.contains("parked")), "{:?}", report.warnings);

                // Parked sagas are counted apart, warned about, and not the oldest unfinished.
                sqlx::query("UPDATE sagabox_saga_instances SET parked_reason = 'undo payment refused: closed' WHERE id = 's-old'")
                    .execute(&fx.pool)
                    .await
                    .unwrap();
                let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();
                assert_eq!(report.sagas.by_status.get("parked"), Some(&1));
                assert_eq!(report.sagas.by_status.get("compensating"), None);
                assert_eq!(report.sagas.by_status.get("running"), Some(&1));
                assert_eq!(report.sagas.oldest_unfinished.as_ref().map(|s| s.id.as_str()), Some("s-new"));
                assert!(
                    report.warnings.iter().any(|w| w.contains("1 saga(s) parked") && w.contains("sagabox saga list --status parked")),
                    "{:?}",
                    report.warnings
                );
            }
        }
    };
}

inspect_suite!(postgres, common::Pg, sqlx::Postgres);
inspect_suite!(sqlite, common::Lite, sqlx::Sqlite);

#[tokio::test]
async fn a_database_without_the_migrations_is_refused_and_a_missing_file_not_created() {
    let path = std::env::temp_dir().join(format!(
        "sagabox_inspect_{}.db",
        uuid::Uuid::new_v4().simple()
    ));
    let url = format!("sqlite:{}", path.display());
    let error = inspect(&url, &InspectOptions::default()).await.unwrap_err();
    assert!(matches!(error, InspectError::NotMigrated { .. }), "{error}");
    assert!(
        error.to_string().contains("there is no file")
            && error.to_string().contains("run `sagabox migrate"),
        "{error}"
    );
    assert!(!path.exists(), "inspect created {}", path.display());

    // An empty database: no migrations.
    let fx = common::Lite::new().await;
    sqlx::raw_sql("DROP TABLE sagabox_migrations")
        .execute(&fx.pool)
        .await
        .unwrap();
    let error = inspect(&fx.url, &InspectOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(error, InspectError::NotMigrated { .. }), "{error}");
    assert!(error.to_string().contains("sagabox migrate"), "{error}");

    let error = inspect("mysql://app:hunter2@db/x", &InspectOptions::default())
        .await
        .unwrap_err();
    assert!(!error.to_string().contains("hunter2"), "{error}");
}

#[tokio::test]
async fn postgres_without_the_latest_migration_is_refused() {
    let fx = common::Pg::new().await;
    fx.exec("DELETE FROM sagabox_migrations WHERE version = 20261203000001")
        .await;
    let error = inspect(&fx.url, &InspectOptions::default())
        .await
        .unwrap_err();
    assert!(error.to_string().contains("inbox duplicates"), "{error}");
}

/// A monthly table created before the duplicate columns existed gets them from
/// `migrate`, keeps its rows, and counts duplicates afterwards.
#[tokio::test]
async fn sqlite_monthly_tables_from_before_the_duplicate_columns_are_upgraded() {
    let fx = common::Lite::new().await;
    let envelope = message(false);
    let month = Month::of(envelope.id.uuid_v7_time().unwrap()).unwrap();
    let table = format!("sagabox_inbox_{}", month.suffix());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (consumer_type TEXT NOT NULL, message_id TEXT NOT NULL, \
         processed_at TEXT NOT NULL, result TEXT NOT NULL, PRIMARY KEY (consumer_type, message_id)) WITHOUT ROWID"
    )))
    .execute(&fx.pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} VALUES ('payment', $1, $2, '{{\"ok\":true}}')"
    )))
    .bind(envelope.id.as_str())
    .bind(Utc::now())
    .execute(&fx.pool)
    .await
    .unwrap();

    let store = fx.store(2).await;
    sagabox::InboxStore::migrate(&store).await.unwrap();
    sagabox::InboxStore::migrate(&store).await.unwrap(); // idempotent
    let guard = InboxGuard::new(store, InboxConfig::default()).unwrap();
    let payment = ConsumerType::new("payment").unwrap();
    let outcome = guard
        .process(&payment, &envelope, async |_conn, _e| {
            Ok::<_, sqlx::Error>(json!(null))
        })
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Duplicate { .. }),
        "the old row still deduplicates"
    );
    let report = inspect(&fx.url, &InspectOptions::default()).await.unwrap();
    assert_eq!(report.duplicate_deliveries[0].in_inbox, 1);
}
