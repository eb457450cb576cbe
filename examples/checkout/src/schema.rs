//! The checkout participants' tables, for PostgreSQL and SQLite.

/// processes starting together run these at once.
pub const POSTGRES_TABLES: &str = "
SELECT pg_advisory_xact_lock(1398892387);
CREATE TABLE IF NOT EXISTS demo_orders (id TEXT PRIMARY KEY, saga_id TEXT NOT NULL, sku TEXT NOT NULL,
    quantity BIGINT NOT NULL, amount_cents BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS payment_charges (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS payment_charges_order ON payment_charges (order_id);
CREATE TABLE IF NOT EXISTS inventory (sku TEXT PRIMARY KEY, initial BIGINT NOT NULL, on_hand BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory_moves (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, sku TEXT NOT NULL, delta BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS inventory_moves_order ON inventory_moves (order_id);
CREATE TABLE IF NOT EXISTS emails_sent (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id TEXT NOT NULL, template TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS emails_sent_order ON emails_sent (order_id);
CREATE TABLE IF NOT EXISTS demo_run (singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    orders BIGINT NOT NULL);
";

/// The demo's business tables on SQLite (`CREATE TABLE IF NOT EXISTS`).
pub const SQLITE_TABLES: &str = "
CREATE TABLE IF NOT EXISTS demo_orders (id TEXT PRIMARY KEY, saga_id TEXT NOT NULL, sku TEXT NOT NULL,
    quantity BIGINT NOT NULL, amount_cents BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS payment_charges (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, amount_cents BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS payment_charges_order ON payment_charges (order_id);
CREATE TABLE IF NOT EXISTS inventory (sku TEXT PRIMARY KEY, initial BIGINT NOT NULL, on_hand BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory_moves (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, sku TEXT NOT NULL, delta BIGINT NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS inventory_moves_order ON inventory_moves (order_id);
CREATE TABLE IF NOT EXISTS emails_sent (id INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id TEXT NOT NULL, template TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS emails_sent_order ON emails_sent (order_id);
CREATE TABLE IF NOT EXISTS demo_run (singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    orders BIGINT NOT NULL);
";

/// The checkout participants' tables in a database's dialect.
pub trait CheckoutTables {
    /// The statements that create them if missing.
    const TABLES: &'static str;
}

impl CheckoutTables for sqlx::Postgres {
    const TABLES: &'static str = POSTGRES_TABLES;
}

impl CheckoutTables for sqlx::Sqlite {
    const TABLES: &'static str = SQLITE_TABLES;
}
