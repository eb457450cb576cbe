-- What the console's pages read from a large saga table, each through an index: a listing
-- newest first, all sagas or narrowed by status or by definition (both together use
-- `sagabox_saga_instances_listing`), paged by (created_at, id); and the sagas finished per minute
-- over the last hours, by the time of their last change.
CREATE INDEX sagabox_saga_instances_newest ON sagabox_saga_instances (created_at, id);
CREATE INDEX sagabox_saga_instances_by_status ON sagabox_saga_instances (status, created_at, id);
CREATE INDEX sagabox_saga_instances_by_name ON sagabox_saga_instances (saga_name, created_at, id);
CREATE INDEX sagabox_saga_instances_finished ON sagabox_saga_instances (updated_at, status)
    WHERE status IN ('completed', 'compensated');
