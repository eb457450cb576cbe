-- The SQLite inbox is a set of monthly tables, sagabox_inbox_YYYY_MM, created and dropped
-- at run time by the store (SqliteStore::create_partition / drop_partition), each:
--
--   consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
--   processed_at TEXT NOT NULL, result TEXT NOT NULL,
--   PRIMARY KEY (consumer_type, message_id)  -- WITHOUT ROWID
--
-- This migration records the layout version; later migrations build on it.
CREATE TABLE IF NOT EXISTS sagabox_layout (
    component TEXT PRIMARY KEY,
    version   INTEGER NOT NULL
);
INSERT INTO sagabox_layout (component, version) VALUES ('inbox', 1)
    ON CONFLICT (component) DO UPDATE SET version = excluded.version;
