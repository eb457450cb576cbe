-- What the console's pages read from a large saga table, each through an index: a listing
-- newest first, all sagas or narrowed by status or by definition (both together use
-- `saga_instances_listing`), paged by (created_at, id); and the sagas finished per minute
-- over the last hours, by the time of their last change.
CREATE INDEX saga_instances_newest ON saga_instances (created_at, id);
CREATE INDEX saga_instances_by_status ON saga_instances (status, created_at, id);
CREATE INDEX saga_instances_by_name ON saga_instances (saga_name, created_at, id);
CREATE INDEX saga_instances_finished ON saga_instances (updated_at, status)
    WHERE status IN ('completed', 'compensated');
