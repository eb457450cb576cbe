-- The business table: append-only, no unique key on the command. The inbox is what
-- keeps it exact.
CREATE TABLE ledger_entries (
    account TEXT NOT NULL,
    cents BIGINT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
