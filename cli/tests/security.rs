//! Security: keys that look like SQL are data (stored verbatim, on both databases);
//! passwords in database URLs never reach a log line, an error or a `--json` report of
//! the `sagabox` binary; the pruner refuses a TTL below the broker retention unless
//! forced, and a forced run is logged as a warning.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use sagabox::{ConsumerType, Envelope, InboxConfig, InboxGuard, MessageId, Outcome};
use serde_json::json;

/// Keys chosen to break string-built SQL: quotes, comments, statement separators,
/// placeholders, LIKE wildcards, backslashes, identifiers and non-ASCII text.
const HOSTILE: [&str; 10] = [
    "'); DROP TABLE sagabox_inbox; --",
    "x' OR '1'='1",
    "\"; DELETE FROM sagabox_saga_instances; --",
    "$1, $2) ON CONFLICT DO NOTHING; --",
    "%_%",
    "back\\slash\\'",
    "sagabox_inbox_2026_01",
    "/* comment */ SELECT pg_sleep(10)",
    "Robert'); DROP TABLE students;--",
    "ünïcødé \u{202e} ✓ 𝕏",
];

macro_rules! verbatim_suite {
    ($backend:ident, $fixture:ty, $tables:expr) => {
        mod $backend {
            use super::*;

            #[tokio::test]
            async fn sql_looking_ids_and_consumer_types_are_stored_verbatim() {
                let fx = <$fixture>::new().await;
                let guard = InboxGuard::new(fx.store(2).await, InboxConfig::default()).unwrap();
                guard.migrate().await.unwrap();
                for text in HOSTILE {
                    let consumer = ConsumerType::new(text).unwrap();
                    let envelope = Envelope::new(MessageId::new(text).unwrap(), "k", json!(null)).unwrap();
                    for delivery in 0..2 {
                        let outcome = guard
                            .process(&consumer, &envelope, async |_conn, _envelope| {
                                Ok::<_, sqlx::Error>(json!({ "echo": text }))
                            })
                            .await
                            .unwrap();
                        match (delivery, outcome) {
                            (0, Outcome::Applied(result)) | (1, Outcome::Duplicate { result, .. }) => {
                                assert_eq!(result, json!({ "echo": text }));
                            }
                            (_, other) => panic!("delivery {delivery} of {text:?}: {other:?}"),
                        }
                    }
                }
                let stored: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe($tables))
                    .fetch_all(&fx.pool)
                    .await
                    .unwrap();
                let mut expected: Vec<(String, String)> =
                    HOSTILE.iter().map(|t| (t.to_string(), t.to_string())).collect();
                let mut stored = stored;
                stored.sort();
                expected.sort();
                assert_eq!(stored, expected, "every key stored once, byte for byte");
            }
        }
    };
}

verbatim_suite!(
    postgres,
    common::Pg,
    "SELECT consumer_type, message_id FROM sagabox_inbox".to_owned()
);
verbatim_suite!(
    sqlite,
    common::Lite,
    // The ids carry no time: they are filed under the current month's table.
    format!(
        "SELECT consumer_type, message_id FROM sagabox_inbox_{}",
        sagabox::Month::of(chrono::Utc::now()).unwrap().suffix()
    )
);

const SECRET: &str = "Pw-s3cret-9f2c";

fn sagabox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        // Every log line there is: the password must not be in any of them.
        .env("RUST_LOG", "trace")
        .output()
        .unwrap()
}

fn all_text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A server that refuses the connection (nothing listens on port 1): each command fails,
/// and its error must not quote the password.
#[test]
fn failing_commands_never_print_the_password() {
    let urls = [
        format!("postgres://app:{SECRET}@127.0.0.1:1/x"),
        format!("postgresql://app@127.0.0.1:1/x?password={SECRET}"),
        format!("postgres://app:{SECRET}@127.0.0.1:99999/x"),
        format!("mysql://app:{SECRET}@127.0.0.1/x"),
    ];
    for url in &urls {
        for args in [
            vec!["migrate", "--database-url", url],
            vec!["prune", "--database-url", url],
            vec!["prune", "--database-url", url, "--dry-run"],
            vec!["demo", "--database-url", url, "--orders", "1", "--json"],
        ] {
            let output = sagabox(&args);
            let text = all_text(&output);
            assert!(!output.status.success(), "{args:?} failed: {text}");
            assert!(
                !text.contains(SECRET),
                "{args:?} leaked the password:\n{text}"
            );
            assert!(!text.trim().is_empty(), "{args:?} said nothing");
        }
    }
    // `bench` opens its own pools; the URLs it refuses before connecting.
    for url in &urls[2..] {
        let output = sagabox(&["bench", "--database-url", url, "--messages", "1", "--json"]);
        let text = all_text(&output);
        assert!(!output.status.success(), "{text}");
        assert!(!text.contains(SECRET), "bench leaked the password:\n{text}");
    }
}

/// PostgreSQL here trusts local connections, so a URL with a password connects: the
/// successful outputs (`--json` included) show the URL redacted.
#[tokio::test]
async fn successful_commands_show_the_url_redacted() {
    let fx = common::Pg::new().await;
    let (_, database) = fx.url.rsplit_once('/').unwrap();
    let url = format!("postgres://postgres:{SECRET}@127.0.0.1:5432/{database}");
    for args in [
        vec!["migrate", "--database-url", &url],
        vec!["prune", "--database-url", &url],
        vec!["demo", "--database-url", &url, "--orders", "20", "--json"],
        vec!["demo", "--database-url", &url, "--orders", "20"],
        vec!["demo", "--database-url", &url, "--resume", "--json"],
    ] {
        let output = sagabox(&args);
        let text = all_text(&output);
        assert!(output.status.success(), "{args:?}: {text}");
        assert!(
            !text.contains(SECRET),
            "{args:?} leaked the password:\n{text}"
        );
        assert!(
            text.contains("postgres:***@127.0.0.1:5432"),
            "{args:?} names the database, redacted:\n{text}"
        );
    }
    let json = sagabox(&["demo", "--database-url", &url, "--orders", "5", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        report["database"],
        format!("postgres://postgres:***@127.0.0.1:5432/{database}")
    );
}

#[tokio::test]
async fn the_pruner_refuses_a_short_ttl_unless_forced_and_then_warns() {
    let fx = common::Pg::new().await;
    let refused = sagabox(&["prune", "--database-url", &fx.url, "--ttl-days", "7"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("shorter than the broker retention")
            && stderr.contains("--force-short-ttl"),
        "{stderr}"
    );
    let partitions = "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'sagabox_inbox'::regclass";
    assert_eq!(
        fx.scalar(partitions).await,
        0,
        "a refused run touched nothing"
    );

    let forced = Command::new(env!("CARGO_BIN_EXE_sagabox"))
        .args([
            "prune",
            "--database-url",
            &fx.url,
            "--ttl-days",
            "7",
            "--force-short-ttl",
        ])
        .env_remove("DATABASE_URL")
        .env_remove("SAGABOX_DATABASE_URL")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&forced.stderr);
    assert!(forced.status.success(), "{stderr}");
    assert!(
        stderr.contains("WARN") && stderr.contains("shorter than the broker retention, forced"),
        "the override is logged as a warning at the default log level: {stderr}"
    );
    assert_eq!(fx.scalar(partitions).await, 3, "the forced pass ran");

    // The override covers that one check: other limits still hold.
    let zero = sagabox(&[
        "prune",
        "--database-url",
        &fx.url,
        "--broker-retention-days",
        "0",
        "--force-short-ttl",
    ]);
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("broker retention is zero"));
}
