-- The transactional outbox: messages written in the same transaction as the change that
-- causes them, published later by a relay (at least once; the consumer's inbox absorbs a
-- second publish). `id` (a UUIDv7) is the message id downstream; `seq` is publish order,
-- kept per `aggregate`.
CREATE TABLE sagabox_outbox (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    id          TEXT    NOT NULL UNIQUE,
    aggregate   TEXT    NOT NULL,
    destination TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    saga_id     TEXT,
    payload     TEXT    NOT NULL,
    headers     TEXT    NOT NULL,
    created_at  TEXT    NOT NULL,
    sent_at     TEXT
);
CREATE INDEX sagabox_outbox_pending ON sagabox_outbox (seq) WHERE sent_at IS NULL;
