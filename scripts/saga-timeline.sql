-- Where a completed checkout saga's time goes, averaged over every completed saga of a
-- demo database: from its start to the first command sent, each step (command sent to
-- reply taken, queueing in the step's batches included), and each save between two
-- steps (reply taken to the next command sent), in milliseconds, read from the saga
-- history's event times.
--
--   psql "$DATABASE_URL" -f scripts/saga-timeline.sql      (tables in schema `sagabox`)
WITH e AS (
  SELECT saga_id, kind, coalesce(step, '') AS step, at FROM sagabox.sagabox_saga_events
), s AS (
  SELECT i.id, i.created_at, i.updated_at,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'started') AS started,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'sent' AND step = 'payment') AS s1,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'applied' AND step = 'payment') AS a1,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'sent' AND step = 'inventory') AS s2,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'applied' AND step = 'inventory') AS a2,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'sent' AND step = 'email') AS s3,
    (SELECT min(at) FROM e WHERE e.saga_id = i.id AND kind = 'applied' AND step = 'email') AS a3
  FROM sagabox.sagabox_saga_instances i WHERE status = 'completed'
)
SELECT count(*) AS sagas,
  round(avg(extract(epoch FROM s1 - started)) * 1000, 1) AS start_to_payment,
  round(avg(extract(epoch FROM a1 - s1)) * 1000, 1) AS payment,
  round(avg(extract(epoch FROM s2 - a1)) * 1000, 1) AS save_1,
  round(avg(extract(epoch FROM a2 - s2)) * 1000, 1) AS inventory,
  round(avg(extract(epoch FROM s3 - a2)) * 1000, 1) AS save_2,
  round(avg(extract(epoch FROM a3 - s3)) * 1000, 1) AS email,
  round(avg(extract(epoch FROM updated_at - created_at)) * 1000, 1) AS total
FROM s;
