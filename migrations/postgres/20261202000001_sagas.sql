-- Saga instances driven by the orchestrator. One row per saga; the orchestrator updates
-- it after every step, so a restarted orchestrator resumes from here.
CREATE TABLE sagabox_saga_instances (
    id           text        PRIMARY KEY,
    saga_name    text        NOT NULL,
    status       text        NOT NULL CHECK (status IN ('running', 'compensating', 'completed', 'compensated')),
    -- running: the step being run; compensating: the step being compensated (-1: done).
    current_step integer     NOT NULL,
    attempts     integer     NOT NULL DEFAULT 0,
    data         jsonb       NOT NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    last_error   text,
    -- Bumped by every save; a save from a stale copy changes nothing (see SagaStore::save).
    version      bigint      NOT NULL DEFAULT 0
);
CREATE INDEX sagabox_saga_instances_unfinished ON sagabox_saga_instances (created_at)
    WHERE status IN ('running', 'compensating');
