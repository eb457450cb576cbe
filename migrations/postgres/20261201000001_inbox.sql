-- The inbox: one row per (consumer_type, message_id), partitioned by month.
--
-- `bucket` is the first day of the month the message is filed under. It is derived from
-- the message itself (the timestamp of a UUIDv7 id, else its publish time), so every
-- redelivery of a message lands in the same partition and the per-partition primary key
-- is a global one. A message without any time is filed under its processing month; its
-- claim probes every live partition instead (see sagabox_inbox_claim).
CREATE TABLE sagabox_inbox (
    consumer_type text        NOT NULL,
    message_id    text        NOT NULL,
    bucket        date        NOT NULL,
    processed_at  timestamptz NOT NULL,
    result        jsonb       NOT NULL,
    PRIMARY KEY (consumer_type, message_id, bucket)
) PARTITION BY RANGE (bucket);

-- Claims (consumer_type, message_id) for the calling transaction and returns the first
-- delivery's row if there is one.
--
-- The transaction-scoped advisory lock serialises every claim of one key, whichever
-- partition it targets: a racing delivery waits here until the holder commits or rolls
-- back, then sees its row (or none). The lookup is a separate statement after the lock,
-- and a VOLATILE function takes a fresh snapshot per statement under READ COMMITTED, so
-- a row committed while we waited is visible. One round trip for lock + lookup.
--
-- The lock key: class 1398892385 ('Saga' in ASCII) keeps clear of other users' advisory
-- locks; the object is a 32-bit hash of the key. A hash collision only makes two
-- unrelated keys wait for each other.
CREATE FUNCTION sagabox_inbox_claim(
    p_consumer_type text,
    p_message_id    text,
    p_bucket        date,
    p_probe_all     boolean
) RETURNS TABLE (processed_at timestamptz, result jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1398892385, hashtext(p_consumer_type || chr(31) || p_message_id));
    IF p_probe_all THEN
        RETURN QUERY
            SELECT i.processed_at, i.result FROM sagabox_inbox i
             WHERE i.consumer_type = p_consumer_type AND i.message_id = p_message_id
             ORDER BY i.processed_at
             LIMIT 1;
    ELSE
        RETURN QUERY
            SELECT i.processed_at, i.result FROM sagabox_inbox i
             WHERE i.consumer_type = p_consumer_type AND i.message_id = p_message_id
               AND i.bucket = p_bucket;
    END IF;
END
$$;
