//! Every invariant of the checkout saga, each an SQL query that counts its violations
//! (0 when it holds): shared by the demo, crash-loop and database-fault tests.

#![allow(dead_code, unreachable_pub)]

/// `(what, query)`: the query counts the rows that break `what`.
pub const CHECKOUT: [(&str, &str); 10] = [
    (
        "order with more than one charge",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'charge' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "order with more than one refund",
        "SELECT COUNT(*) FROM (SELECT order_id FROM payment_charges WHERE kind = 'refund' GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "order with more than one email",
        "SELECT COUNT(*) FROM (SELECT order_id FROM emails_sent GROUP BY order_id HAVING COUNT(*) > 1) d",
    ),
    (
        "saga neither completed nor compensated",
        "SELECT COUNT(*) FROM sagabox_saga_instances WHERE status NOT IN ('completed', 'compensated')",
    ),
    (
        "order without its saga",
        "SELECT COUNT(*) FROM demo_orders o WHERE NOT EXISTS (SELECT 1 FROM sagabox_saga_instances s WHERE s.id = o.saga_id)",
    ),
    (
        "completed order without exactly one charge, no refund and one email",
        "SELECT COUNT(*) FROM demo_orders o JOIN sagabox_saga_instances s ON s.id = o.saga_id WHERE s.status = 'completed' AND ( \
        (SELECT COUNT(*) FROM payment_charges c WHERE c.order_id = o.id AND c.kind = 'charge') <> 1 OR \
        (SELECT COUNT(*) FROM payment_charges c WHERE c.order_id = o.id AND c.kind = 'refund') <> 0 OR \
        (SELECT COUNT(*) FROM emails_sent e WHERE e.order_id = o.id) <> 1)",
    ),
    (
        "compensated order whose charges and refunds do not net to zero, or with an email",
        "SELECT COUNT(*) FROM demo_orders o JOIN sagabox_saga_instances s ON s.id = o.saga_id WHERE s.status = 'compensated' AND ( \
        (SELECT COALESCE(SUM(CASE kind WHEN 'charge' THEN amount_cents ELSE -amount_cents END), 0) \
           FROM payment_charges c WHERE c.order_id = o.id) <> 0 OR \
        (SELECT COUNT(*) FROM emails_sent e WHERE e.order_id = o.id) <> 0)",
    ),
    (
        "sku whose stock is not initial minus the completed orders",
        "SELECT COUNT(*) FROM inventory i WHERE i.on_hand <> i.initial - COALESCE((SELECT SUM(o.quantity) \
        FROM demo_orders o JOIN sagabox_saga_instances s ON s.id = o.saga_id WHERE o.sku = i.sku AND s.status = 'completed'), 0)",
    ),
    (
        "sku with negative stock",
        "SELECT COUNT(*) FROM inventory WHERE on_hand < 0",
    ),
    (
        "saga whose history disagrees with its state (a version without its events, or events past its version)",
        "SELECT COUNT(*) FROM sagabox_saga_instances s WHERE \
        (SELECT COUNT(DISTINCT e.version) FROM sagabox_saga_events e WHERE e.saga_id = s.id) <> s.version + 1 OR \
        (SELECT MAX(e.version) FROM sagabox_saga_events e WHERE e.saga_id = s.id) <> s.version",
    ),
];

/// The invariants `pool` breaks, with their counts; empty when all hold.
pub async fn violations(pool: &sqlx::PgPool) -> Vec<(&'static str, i64)> {
    let mut broken = Vec::new();
    for (what, sql) in CHECKOUT {
        let count: i64 = sqlx::query_scalar(sql)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|error| panic!("{what}: {error}"));
        if count != 0 {
            broken.push((what, count));
        }
    }
    broken
}
