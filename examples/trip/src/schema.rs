//! The participants' own tables, for PostgreSQL and SQLite, and [`TripDb`]: what the
//! handlers need from a database, so each handler is written once for both.
//!
//! Like checkout's tables, these are deliberately **not** naturally idempotent: no
//! unique key on `trip_id`, a booking is an `INSERT`, a cancellation adds one to
//! `cancellations` and takes a new `cancel_seq`. A command applied twice would show as a
//! second row, `cancellations = 2`, or a moved `cancel_seq`; the inbox is what keeps
//! them exact.
//!
//! Every booking and cancellation takes the next value of one sequence shared by the
//! four participants (`booked_seq`, `cancel_seq`, `notifications.seq`): the order in
//! which they applied, which the tests read to check that compensations ran in reverse.
//! (Separate services would each have their own database; the shared sequence is what
//! this example adds so that one query can order events across participants.)

use std::future::Future;

use sqlx::{Database, Pool, Postgres, Sqlite};

/// The tables on PostgreSQL.
pub const POSTGRES: &str = r#"
CREATE SEQUENCE IF NOT EXISTS trip_seq;

CREATE TABLE IF NOT EXISTS flight_bookings (
    trip_id       text        NOT NULL,
    status        text        NOT NULL CHECK (status IN ('booked', 'cancelled')),
    booked_seq    bigint      NOT NULL,
    booked_at     timestamptz NOT NULL DEFAULT now(),
    cancel_seq    bigint,
    cancelled_at  timestamptz,
    cancellations integer     NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS flight_bookings_trip ON flight_bookings (trip_id);

CREATE TABLE IF NOT EXISTS hotel_bookings (
    trip_id       text        NOT NULL,
    status        text        NOT NULL CHECK (status IN ('booked', 'cancelled')),
    booked_seq    bigint      NOT NULL,
    booked_at     timestamptz NOT NULL DEFAULT now(),
    cancel_seq    bigint,
    cancelled_at  timestamptz,
    cancellations integer     NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS hotel_bookings_trip ON hotel_bookings (trip_id);

CREATE TABLE IF NOT EXISTS car_rentals (
    trip_id       text        NOT NULL,
    status        text        NOT NULL CHECK (status IN ('rented', 'returned')),
    booked_seq    bigint      NOT NULL,
    booked_at     timestamptz NOT NULL DEFAULT now(),
    cancel_seq    bigint,
    cancelled_at  timestamptz,
    cancellations integer     NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS car_rentals_trip ON car_rentals (trip_id);

CREATE TABLE IF NOT EXISTS notifications (
    trip_id text        NOT NULL,
    seq     bigint      NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS notifications_trip ON notifications (trip_id);
"#;

/// The tables on SQLite. SQLite has no sequences: a one-row counter stands in, taken
/// inside the guard's write transaction (SQLite's single writer orders them).
pub const SQLITE: &str = r#"
CREATE TABLE IF NOT EXISTS trip_seq (value INTEGER NOT NULL);
INSERT INTO trip_seq (value) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM trip_seq);

CREATE TABLE IF NOT EXISTS flight_bookings (
    trip_id       TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('booked', 'cancelled')),
    booked_seq    INTEGER NOT NULL,
    booked_at     TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP,
    cancel_seq    INTEGER,
    cancelled_at  TEXT,
    cancellations INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS flight_bookings_trip ON flight_bookings (trip_id);

CREATE TABLE IF NOT EXISTS hotel_bookings (
    trip_id       TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('booked', 'cancelled')),
    booked_seq    INTEGER NOT NULL,
    booked_at     TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP,
    cancel_seq    INTEGER,
    cancelled_at  TEXT,
    cancellations INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS hotel_bookings_trip ON hotel_bookings (trip_id);

CREATE TABLE IF NOT EXISTS car_rentals (
    trip_id       TEXT    NOT NULL,
    status        TEXT    NOT NULL CHECK (status IN ('rented', 'returned')),
    booked_seq    INTEGER NOT NULL,
    booked_at     TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP,
    cancel_seq    INTEGER,
    cancelled_at  TEXT,
    cancellations INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS car_rentals_trip ON car_rentals (trip_id);

CREATE TABLE IF NOT EXISTS notifications (
    trip_id TEXT    NOT NULL,
    seq     INTEGER NOT NULL,
    sent_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE INDEX IF NOT EXISTS notifications_trip ON notifications (trip_id);
"#;

/// A database the trip's participants run on: PostgreSQL or SQLite. The handlers'
/// statements are the same on both (`$n` placeholders, `CURRENT_TIMESTAMP`); only the
/// schema and the shared sequence differ.
pub trait TripDb: Database {
    /// The tables, as one script ([`POSTGRES`] or [`SQLITE`]).
    const SCHEMA: &'static str;

    /// Creates the tables (idempotent: every statement is `IF NOT EXISTS`).
    fn install(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Takes the next value of the shared sequence, inside the caller's transaction.
    fn next_seq(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Runs one of the handlers' writes: `sql` with `$1` = `trip_id`, `$2` = `seq`.
    /// Returns the rows it changed.
    fn write(
        conn: &mut Self::Connection,
        sql: &'static str,
        trip_id: &str,
        seq: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

impl TripDb for Postgres {
    const SCHEMA: &'static str = POSTGRES;

    async fn install(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(POSTGRES).execute(pool).await.map(drop)
    }

    async fn next_seq(conn: &mut Self::Connection) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT nextval('trip_seq')")
            .fetch_one(&mut *conn)
            .await
    }

    async fn write(
        conn: &mut Self::Connection,
        sql: &'static str,
        trip_id: &str,
        seq: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(sql)
            .bind(trip_id)
            .bind(seq)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }
}

impl TripDb for Sqlite {
    const SCHEMA: &'static str = SQLITE;

    async fn install(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(SQLITE).execute(pool).await.map(drop)
    }

    async fn next_seq(conn: &mut Self::Connection) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("UPDATE trip_seq SET value = value + 1 RETURNING value")
            .fetch_one(&mut *conn)
            .await
    }

    async fn write(
        conn: &mut Self::Connection,
        sql: &'static str,
        trip_id: &str,
        seq: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(sql)
            .bind(trip_id)
            .bind(seq)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }
}
