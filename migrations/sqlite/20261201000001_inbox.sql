-- The SQLite inbox is a set of monthly tables, sagabox_inbox_YYYY_MM, created and dropped
-- at run time by the store (SqliteStore::create_partition / drop_partition), each:
--
--   consumer_type TEXT NOT NULL, message_id TEXT NOT NULL,
--   processed_at TEXT NOT NULL, result TEXT NOT NULL,
--   PRIMARY KEY (consumer_type, message_id)  -- WITHOUT ROWID
--
-- The newest month the pruner has dropped ('YYYY-MM'). A month at or before it is never
-- created again: a late redelivery must be refused, not find an empty table and be
-- applied a second time. No row: nothing pruned.
CREATE TABLE sagabox_inbox_pruned (
    singleton      INTEGER PRIMARY KEY CHECK (singleton = 1),
    pruned_through TEXT NOT NULL
);
