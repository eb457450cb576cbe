-- Duplicates suppressed, counted on the first delivery's row: the duplicate path adds
-- one to `duplicates` and sets `last_duplicate_at`, in the claim's transaction (which
-- holds the key). `sagabox inspect` sums them per consumer type. The applied path does
-- not touch these columns. Both are added to every partition, existing and future
-- (partitions are created `LIKE sagabox_inbox`); a constant default needs no rewrite.
ALTER TABLE sagabox_inbox
    ADD COLUMN duplicates        integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_duplicate_at timestamptz;
