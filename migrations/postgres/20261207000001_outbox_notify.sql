-- Wakes the outbox relay when rows commit: a statement that inserts into the outbox
-- queues a NOTIFY on the table's own channel (`sagabox_outbox_` and the table's oid, so
-- two schemas of one database never wake each other's relays, and the name stays within
-- PostgreSQL's 63 bytes), which PostgreSQL delivers when the transaction commits, once
-- per transaction, and never when it rolls back. A relay that listens publishes at once
-- instead of at its next poll; one that does not loses nothing.
CREATE FUNCTION sagabox_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sagabox_outbox_' || TG_RELID::text, '');
    RETURN NULL;
END
$$;
CREATE TRIGGER sagabox_outbox_notify AFTER INSERT ON sagabox_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION sagabox_outbox_notify();
