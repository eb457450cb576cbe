-- Monthly inbox tables gain `duplicates INTEGER NOT NULL DEFAULT 0` and
-- `last_duplicate_at TEXT`: the duplicate path counts on the first delivery's row, and
-- `sagabox inspect` sums them. The tables are created at run time, so this migration
-- cannot reach them: SqliteStore::migrate adds the columns to every existing table right
-- after the migrations run (new tables are created with them). This file marks the
-- schema version, so `inspect` can tell an upgraded database from an old one.
SELECT 1;
