-- Lets a saga's saves between its start and its end be heap-only (HOT) updates: the new row
-- version on the same page, no index entry written. PostgreSQL does that only for an
-- update that changes no indexed column, and `updated_at`, which every save changes, was
-- indexed twice (the finished sagas per minute, the parked sagas), so every save wrote an
-- entry into each of the table's indexes.
--
-- The finished sagas are now found by `finished_at`, which only the save that finishes a
-- saga sets; the parked ones are listed by `created_at`, as every saga listing is. Pages
-- are filled to 80 % by inserts, leaving room for the new versions of their rows.
ALTER TABLE sagabox_saga_instances ADD COLUMN finished_at timestamptz;
UPDATE sagabox_saga_instances SET finished_at = updated_at
    WHERE status IN ('completed', 'compensated');
DROP INDEX sagabox_saga_instances_finished;
CREATE INDEX sagabox_saga_instances_finished ON sagabox_saga_instances (finished_at, status)
    WHERE finished_at IS NOT NULL;
DROP INDEX sagabox_saga_instances_parked;
CREATE INDEX sagabox_saga_instances_parked ON sagabox_saga_instances (created_at, id)
    WHERE parked_reason IS NOT NULL;
ALTER TABLE sagabox_saga_instances SET (fillfactor = 80);
