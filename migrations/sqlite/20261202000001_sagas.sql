-- Saga instances driven by the orchestrator. One row per saga; the orchestrator updates
-- it after every step, so a restarted orchestrator resumes from here.
CREATE TABLE sagabox_saga_instances (
    id           TEXT    PRIMARY KEY,
    saga_name    TEXT    NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('running', 'compensating', 'completed', 'compensated')),
    -- running: the step being run; compensating: the step being compensated (-1: done).
    current_step INTEGER NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    data         TEXT    NOT NULL,
    created_at   TEXT    NOT NULL,
    updated_at   TEXT    NOT NULL,
    last_error   TEXT,
    -- Bumped by every save; a save from a stale copy changes nothing (see SagaStore::save).
    version      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sagabox_saga_instances_unfinished ON sagabox_saga_instances (created_at)
    WHERE status IN ('running', 'compensating');
