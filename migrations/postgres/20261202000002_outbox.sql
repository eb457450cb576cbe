-- The transactional outbox: messages written in the same transaction as the change that
-- causes them, published later by a relay (at least once; the consumer's inbox absorbs a
-- second publish). `id` (a UUIDv7) is the message id downstream; `seq` is publish order,
-- kept per `aggregate`.
CREATE TABLE sagabox_outbox (
    seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id          text        NOT NULL UNIQUE,
    aggregate   text        NOT NULL,
    destination text        NOT NULL,
    kind        text        NOT NULL,
    saga_id     text,
    payload     jsonb       NOT NULL,
    headers     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL,
    sent_at     timestamptz
);
CREATE INDEX sagabox_outbox_pending ON sagabox_outbox (seq) WHERE sent_at IS NULL;
