-- 1,000,000 synthetic checkout sagas over the last 30 days, with 4 history events each.
\timing on
INSERT INTO saga_instances (id, saga_name, status, current_step, attempts, data, created_at,
                            updated_at, last_error, version, definition_version, parked_reason)
SELECT 'synthetic-' || lpad(g::text, 7, '0'),
       CASE WHEN g % 10 = 0 THEN 'trip' ELSE 'checkout' END,
       CASE WHEN g % 100 < 80 THEN 'completed'
            WHEN g % 100 < 95 THEN 'compensated'
            WHEN g % 100 < 99 THEN 'running'
            ELSE 'compensating' END,
       CASE WHEN g % 100 < 95 THEN 3 ELSE 1 END,
       0,
       jsonb_build_object('order_id', g, 'amount_cents', 1000 + g % 5000, 'sku', 'sku-' || g % 7),
       now() - (g * interval '2.592 seconds'),
       now() - (g * interval '2.592 seconds') + interval '1 second',
       CASE WHEN g % 100 BETWEEN 80 AND 94 THEN 'inventory refused: out of stock: sku-' || g % 7 END,
       3, 1,
       CASE WHEN g % 1000 = 999 THEN 'compensation refused' END
FROM generate_series(1, 1000000) AS g;
INSERT INTO sagabox_saga_events (saga_id, saga_created_at, version, ordinal, at, kind, step,
                                 direction, attempt, duration_ms, detail)
SELECT s.id, s.created_at, e.v, 0, s.created_at + e.v * interval '100 ms',
       (ARRAY['started','sent','applied','completed'])[e.v + 1],
       CASE WHEN e.v IN (1, 2) THEN 'payment' END,
       CASE WHEN e.v IN (1, 2) THEN 'forward' END,
       CASE WHEN e.v IN (1, 2) THEN 1 END,
       CASE WHEN e.v = 2 THEN 12 END, NULL
FROM saga_instances s CROSS JOIN generate_series(0, 3) AS e(v)
WHERE s.id LIKE 'synthetic-%';
ANALYZE;
SELECT status, count(*) FROM saga_instances GROUP BY 1 ORDER BY 1;
SELECT pg_size_pretty(pg_database_size(current_database()));
