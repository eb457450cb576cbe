//! The `sagabox` command over TLS to every server, as a team on managed services runs it:
//! `migrate`, `inspect`, `serve`, `orchestrate`, `console` and `demo` against PostgreSQL
//! with `sslmode=verify-full`, RabbitMQ over `amqps://` with a client certificate (the
//! management API over HTTPS), and NATS over `tls://`. While the long-running commands
//! run, the servers are asked whether each of their connections is encrypted
//! (`pg_stat_ssl`, `rabbitmqctl list_connections`, NATS's `/connz`).
//!
//! The TLS material and listeners come from `scripts/tls-setup.sh` (run by
//! `scripts/test.sh`), found in `SAGABOX_TLS_DIR`, else `/etc/sagabox-test/tls`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use std::io::{BufRead, BufReader};
use std::process::{Child, Output, Stdio};
use std::time::Duration;

use common::Pg;
use common::children::{Children, stop};
use common::rabbit::Rabbit;
use common::tls::{broker_connections, file, nats_connections};

/// The fixture's database on `host`, with `sslmode=verify-full` and the test CA.
fn verified_url(pg: &Pg, host: &str) -> String {
    format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url.replacen("127.0.0.1", host, 1),
        file("ca.pem")
    )
}

fn sagabox(args: &[&str]) -> Output {
    common::sagabox_command(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("run sagabox")
}

fn spawn(args: &[&str]) -> Child {
    common::sagabox_command(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sagabox")
}

fn assert_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The sessions of the fixture's database, as `(application_name, ssl, client_dn)`,
/// read from another database so the reading session is not among them.
async fn sessions(pg: &Pg) -> Vec<(String, bool, Option<String>)> {
    let admin = common::admin_url();
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
        .await
        .unwrap();
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pg.pool)
        .await
        .unwrap();
    let own: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend' \
         AND application_name = ''",
    )
    .bind(&database)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let rows: Vec<(i32, String, bool, Option<String>)> = sqlx::query_as(
        "SELECT a.pid, a.application_name, s.ssl, s.client_dn FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.datname = $1 AND a.backend_type = 'client backend'",
    )
    .bind(&database)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    rows.into_iter()
        .filter(|(pid, ..)| !own.contains(pid))
        .map(|(_, name, ssl, dn)| (name, ssl, dn))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_runs_over_verified_tls_to_postgres_and_rabbitmq() {
    let pg = Pg::unmigrated().await;
    let db = verified_url(&pg, "localhost");
    let rabbit = Rabbit::new(&["payment", "inventory", "email", "checkout.start"]).await;
    let prefix = rabbit.config.queue_prefix.clone();
    let amqps = format!(
        "amqps://guest:guest@localhost:5671/%2f?cacertfile={}&certfile={}&keyfile={}",
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );

    assert_ok(&sagabox(&["migrate", "--database-url", &db]), "migrate");
    assert_ok(&sagabox(&["inspect", "--database-url", &db]), "inspect");
    // The same database by address: refused for the certificate's host name, which only
    // a verified TLS session checks.
    let refused = sagabox(&["inspect", "--database-url", &verified_url(&pg, "127.0.0.1")]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("TLS to PostgreSQL") && said.contains("does not name the host 127.0.0.1"),
        "{said}"
    );

    let mut running = Children::new(vec![
        spawn(&[
            "serve",
            "--role",
            "payment,inventory,email",
            "--database-url",
            &db,
            "--transport",
            &amqps,
            "--queue-prefix",
            &prefix,
        ]),
        spawn(&[
            "orchestrate",
            "--saga",
            &format!("{}/../sagas/checkout.toml", env!("CARGO_MANIFEST_DIR")),
            "--database-url",
            &db,
            "--transport",
            &amqps,
            "--queue-prefix",
            &prefix,
        ]),
    ]);
    let mut console = spawn(&[
        "console",
        "--database-url",
        &db,
        "--amqp-url",
        &amqps,
        "--dead-letter-queue",
        &format!("{prefix}.payment.dead"),
        "--listen",
        "127.0.0.1:0",
    ]);
    let line = BufReader::new(console.stderr.take().unwrap())
        .lines()
        .next()
        .expect("the console's first line")
        .unwrap();
    let base = line
        .strip_prefix("console at ")
        .unwrap_or_else(|| panic!("not the console's line: {line}"))
        .trim_end_matches('/')
        .to_owned();
    running.push(console);
    for role in ["payment", "inventory", "email", "checkout.start"] {
        let queue = rabbit.queue(role);
        common::wait_for(&format!("a consumer on {queue}"), async || {
            rabbit.consumers(&queue).await > 0
        })
        .await;
    }

    let demo = sagabox(&[
        "demo",
        "--database-url",
        &db,
        "--transport",
        &amqps,
        "--queue-prefix",
        &prefix,
        "--external-participants",
        "--orders",
        "40",
        "--json",
    ]);
    assert_ok(&demo, "demo");
    let report: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(report["unfinished"], 0, "{report}");
    assert_eq!(report["double_charges"], 0, "{report}");

    for page in ["/", "/sagas", "/inbox", "/dead"] {
        let response = reqwest::get(format!("{base}{page}")).await.unwrap();
        assert_eq!(response.status().as_u16(), 200, "GET {page}");
    }

    // From the servers' side: every session of the database, and every broker connection
    // of this prefix, is encrypted; the broker saw the client certificate.
    let sessions = sessions(&pg).await;
    assert!(
        sessions.iter().any(|(name, ..)| name == "sagabox"),
        "{sessions:?}"
    );
    for (name, ssl, _) in &sessions {
        assert!(
            *ssl,
            "the session of {name:?} is not encrypted: {sessions:?}"
        );
    }
    let connections = broker_connections(&format!("\"{prefix}/"));
    assert!(connections.len() >= 4, "{connections:?}");
    for (ssl, subject) in &connections {
        assert_eq!(ssl, "true", "{connections:?}");
        assert!(subject.contains("CN=sagabox-client"), "{connections:?}");
    }

    for (child, what) in running.iter_mut().zip(["serve", "orchestrate", "console"]) {
        let status = stop(child, what, Duration::from_secs(30)).await;
        assert!(status.success(), "{what}: {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_demo_run_over_nats_with_tls() {
    let server = jetstream::OwnServer::start_tls(&file("server.pem"), &file("server.key")).await;
    let url = format!(
        "tls://localhost:{}?cacertfile={}",
        server.port,
        file("ca.pem")
    );
    let pg = Pg::new().await;
    let db = verified_url(&pg, "localhost");
    let prefix = format!("tls{}", uuid::Uuid::new_v4().simple());
    let mut running = Children::new(vec![spawn(&[
        "serve",
        "--role",
        "payment,inventory,email",
        "--database-url",
        &db,
        "--transport",
        &url,
        "--queue-prefix",
        &prefix,
    ])]);
    let connz = async || nats_connections(server.monitor_port, &prefix).await;
    common::wait_for("serve's connections on NATS", async || {
        !connz().await.is_empty()
    })
    .await;
    let demo = sagabox(&[
        "demo",
        "--database-url",
        &db,
        "--transport",
        &url,
        "--queue-prefix",
        &prefix,
        "--external-participants",
        "--orders",
        "30",
        "--json",
    ]);
    assert_ok(&demo, "demo over NATS with TLS");
    let report: serde_json::Value = serde_json::from_slice(&demo.stdout).unwrap();
    assert_eq!(report["unfinished"], 0, "{report}");

    let connections = connz().await;
    for (name, tls) in &connections {
        assert!(
            tls.as_deref()
                .is_some_and(|version| version.starts_with("1.")),
            "{name} is not TLS: {connections:?}"
        );
    }
    for (name, ssl, _) in sessions(&pg).await {
        assert!(ssl, "the session of {name:?} is not encrypted");
    }
    for child in running.iter_mut() {
        let status = stop(child, "serve", Duration::from_secs(30)).await;
        assert!(status.success(), "serve: {status}");
    }
}
