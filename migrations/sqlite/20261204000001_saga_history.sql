-- What the orchestrator needs to run sagas in production: each saga's history, the
-- definition version it started under, a deadline, and a parked state for a saga that
-- cannot move on its own.

-- The definition version a saga runs on (`version` in its TOML; sagas started before
-- versions existed ran on version 1). Parked: why the saga waits for an operator
-- (`sagabox saga retry` / `cancel`); NULL when it is not parked. Deadline: past it, a
-- running saga is compensated (or parked); NULL when its definition has none. Command
-- round: raised when a saga is parked on a step's final answer (refused, rejected), so
-- that the step's next command is a new message; 0 again once the saga moves on.
ALTER TABLE sagabox_saga_instances ADD COLUMN definition_version INTEGER NOT NULL DEFAULT 1;
ALTER TABLE sagabox_saga_instances ADD COLUMN parked_reason TEXT;
ALTER TABLE sagabox_saga_instances ADD COLUMN deadline_at TEXT;
ALTER TABLE sagabox_saga_instances ADD COLUMN command_round INTEGER NOT NULL DEFAULT 0;

-- Resume passes skip parked sagas: an orchestrator leaves them to an operator.
DROP INDEX sagabox_saga_instances_unfinished;
CREATE INDEX sagabox_saga_instances_unfinished ON sagabox_saga_instances (saga_name, created_at)
    WHERE status IN ('running', 'compensating') AND parked_reason IS NULL;
CREATE INDEX sagabox_saga_instances_parked ON sagabox_saga_instances (updated_at)
    WHERE parked_reason IS NOT NULL;
-- `sagabox saga list`: newest first, by status and definition.
CREATE INDEX sagabox_saga_instances_listing ON sagabox_saga_instances (status, saga_name, created_at);

-- Every definition version an orchestrator has run, so that a saga started under an
-- older version is driven on its own steps after the TOML changed. The definition is
-- stored in canonical TOML; its fingerprint tells a changed definition that kept its
-- version number (refused) from the same one.
CREATE TABLE sagabox_saga_definitions (
    name        TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    fingerprint TEXT    NOT NULL,
    definition  TEXT    NOT NULL,
    first_seen  TEXT    NOT NULL,
    PRIMARY KEY (name, version)
);

-- One row per thing that happened to a saga, written in the same transaction as the
-- saga state it changes: every save of a saga (which bumps `sagabox_saga_instances.version`)
-- writes its events under that new version, so history and state never disagree.
-- `ordinal` orders the events of one save. SQLite has no partitions: its history is
-- pruned by the saga's creation month with a DELETE.
CREATE TABLE sagabox_saga_events (
    saga_id         TEXT    NOT NULL,
    saga_created_at TEXT    NOT NULL,
    version         INTEGER NOT NULL,
    ordinal         INTEGER NOT NULL,
    at              TEXT    NOT NULL,
    kind            TEXT    NOT NULL,
    step            TEXT,
    direction       TEXT,
    attempt         INTEGER,
    duration_ms     INTEGER,
    detail          TEXT,
    PRIMARY KEY (saga_id, version, ordinal)
) WITHOUT ROWID;
CREATE INDEX sagabox_saga_events_month ON sagabox_saga_events (saga_created_at);
