-- The finished sagas are found by `finished_at`, which only the save that finishes a saga
-- sets, and the parked ones are listed by `created_at`: no index holds `updated_at`, which
-- every save changes (on PostgreSQL that keeps a saga's saves between its start and its
-- end out of every index; the two databases keep one schema).
ALTER TABLE sagabox_saga_instances ADD COLUMN finished_at TEXT;
UPDATE sagabox_saga_instances SET finished_at = updated_at
    WHERE status IN ('completed', 'compensated');
DROP INDEX sagabox_saga_instances_finished;
CREATE INDEX sagabox_saga_instances_finished ON sagabox_saga_instances (finished_at, status)
    WHERE finished_at IS NOT NULL;
DROP INDEX sagabox_saga_instances_parked;
CREATE INDEX sagabox_saga_instances_parked ON sagabox_saga_instances (created_at, id)
    WHERE parked_reason IS NOT NULL;
