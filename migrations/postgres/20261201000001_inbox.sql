-- The inbox: one row per (consumer_type, message_id), partitioned by month.
--
-- `bucket` is the first day of the month the message is filed under. It is derived from
-- the message itself (the timestamp of a UUIDv7 id, else its publish time), so every
-- redelivery of a message lands in the same partition and the per-partition primary key
-- is a global one. A message without any time is filed under its processing month; its
-- claim probes every live partition instead. Every claim first takes a transaction-scoped
-- advisory lock on the key (class 1398892385, 'Saga'), so racing deliveries serialise
-- whichever partition they look in: see src/store/postgres.rs.
CREATE TABLE sagabox_inbox (
    consumer_type text        NOT NULL,
    message_id    text        NOT NULL,
    bucket        date        NOT NULL,
    processed_at  timestamptz NOT NULL,
    result        jsonb       NOT NULL,
    PRIMARY KEY (consumer_type, message_id, bucket)
) PARTITION BY RANGE (bucket);

-- The newest month the pruner has dropped (or is dropping). A month at or before it is
-- never created again: a late redelivery must be refused, not find an empty partition and
-- be applied a second time. Written before a partition is detached, under the same
-- advisory lock (1398892385, 0) that partition creation takes. No row: nothing pruned.
CREATE TABLE sagabox_inbox_pruned (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    pruned_through date    NOT NULL
);
