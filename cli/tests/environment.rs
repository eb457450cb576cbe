//! Configuration the way services are deployed: the URLs read from files named by
//! `SAGABOX_…_FILE` (mounted secrets) and every other option from `SAGABOX_…`
//! variables, so that no password is on the command line, where `ps` shows it; the
//! database pool's size as an option.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::Pg;
use common::children::{Children, stop};
use common::rabbit::Rabbit;

/// A file holding `text`, removed on drop.
struct Secret(std::path::PathBuf);

impl Secret {
    fn new(text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("sagabox-secret-{}", uuid::Uuid::new_v4()));
        std::fs::write(&path, format!("{text}\n")).unwrap();
        Self(path)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The `sagabox` binary with no option on its command line but the subcommand's name.
fn bare(subcommand: &str) -> Command {
    let mut command = common::sagabox_command(&[subcommand]);
    command.env("RUST_LOG", "error");
    command
}

#[tokio::test]
async fn migrate_reads_its_database_url_from_a_file() {
    let pg = Pg::unmigrated().await;
    let secret = Secret::new(&pg.url);
    let output = bare("migrate")
        .env("SAGABOX_DATABASE_URL_FILE", secret.path())
        .env("SAGABOX_PARTITIONS_AHEAD", "1")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let migrated: bool = sqlx::query_scalar("SELECT to_regclass('sagabox_inbox') IS NOT NULL")
        .fetch_one(&pg.pool)
        .await
        .unwrap();
    assert!(migrated);

    // The variable and its file at once are refused, as is a file that is not there.
    let output = bare("migrate")
        .env("SAGABOX_DATABASE_URL_FILE", secret.path())
        .env("SAGABOX_DATABASE_URL", &pg.url)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("give one"));
    let output = bare("migrate")
        .env("SAGABOX_DATABASE_URL_FILE", "/nonexistent/db-url")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("/nonexistent/db-url"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_from_the_environment_with_no_secret_on_its_command_line() {
    let pg = Pg::new().await;
    let rabbit = Rabbit::new(&["payment"]).await;
    let database = Secret::new(&pg.url);
    let broker = Secret::new(&rabbit.config.url);
    let child = bare("serve")
        .env("SAGABOX_DATABASE_URL_FILE", database.path())
        .env("SAGABOX_TRANSPORT_FILE", broker.path())
        .env("SAGABOX_ROLE", "payment")
        .env("SAGABOX_QUEUE_PREFIX", &rabbit.config.queue_prefix)
        .env("SAGABOX_WORKERS", "2")
        .env("SAGABOX_DB_POOL_SIZE", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut running = Children::new(vec![child]);
    let queue = rabbit.queue("payment");
    common::wait_for("serve consuming from the environment's queue", async || {
        rabbit.consumers(&queue).await > 0
    })
    .await;

    // What `ps` shows: the command line holds no URL.
    let command_line = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let command_line = String::from_utf8_lossy(&command_line).replace('\0', " ");
    assert!(
        !command_line.contains("postgres://") && !command_line.contains("amqp://"),
        "{command_line}"
    );
    // The pool's size came from SAGABOX_DB_POOL_SIZE: never more sessions than 3.
    let sessions: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'sagabox'",
    )
    .fetch_one(&pg.pool)
    .await
    .unwrap();
    assert!((1..=3).contains(&sessions), "{sessions} sessions");

    let status = stop(&mut running[0], "serve", Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
}

#[test]
fn help_names_each_options_variable_and_hides_secret_values() {
    let output = common::sagabox_command(&["serve", "--help"])
        .env(
            "SAGABOX_TRANSPORT",
            "amqp://guest:hunter2-secret@127.0.0.1:5672/%2f",
        )
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for variable in [
        "SAGABOX_ROLE",
        "SAGABOX_TRANSPORT",
        "SAGABOX_DATABASE_URL",
        "SAGABOX_QUEUE_PREFIX",
        "SAGABOX_DB_POOL_SIZE",
        "SAGABOX_MAX_DELIVERIES",
    ] {
        assert!(help.contains(variable), "{variable} missing from:\n{help}");
    }
    assert!(!help.contains("hunter2"), "{help}");
    let output = Command::new(common::sagabox_bin())
        .args(["serve", "--db-pool-size", "0", "--role", "payment"])
        .args(["--transport", "amqp://127.0.0.1:5672/%2f"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("1 to 1000"));
}

/// The role that `scripts/test-setup.sh` makes give a password (scram-sha-256 in
/// `pg_hba.conf`); every other role here is trusted.
const PASSWORD_ROLE: &str = "sagabox_password";

#[tokio::test]
async fn postgres_passwords_come_from_pgpassword_or_a_pgpass_file_never_the_url() {
    let pg = Pg::unmigrated().await;
    let password = uuid::Uuid::new_v4().simple().to_string();
    pg.exec_owned(format!(
        "DO $$ BEGIN CREATE ROLE {PASSWORD_ROLE}; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
         ALTER ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{password}'; \
         GRANT ALL ON DATABASE {} TO {PASSWORD_ROLE}",
        pg.name()
    ))
    .await;
    let url = format!("postgres://{PASSWORD_ROLE}@127.0.0.1:5432/{}", pg.name());
    let home = tempdir();
    let migrate = || {
        let mut command = bare("migrate");
        command
            .env("SAGABOX_DATABASE_URL", &url)
            .env("HOME", &home)
            .env_remove("PGPASSWORD")
            .env_remove("PGPASSFILE");
        command
    };

    // No password anywhere: refused by the server, which shows the check is real.
    let output = migrate().output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("password"),
        "{PASSWORD_ROLE} logged in without a password: run scripts/test-setup.sh, which \
         makes PostgreSQL ask it for one; {stderr}"
    );

    let output = migrate().env("PGPASSWORD", &password).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let pgpass = Secret::new(&format!("127.0.0.1:5432:*:{PASSWORD_ROLE}:{password}"));
    std::fs::set_permissions(
        &pgpass.0,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let output = migrate().env("PGPASSFILE", pgpass.path()).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let owner: String = sqlx::query_scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'sagabox'",
    )
    .fetch_one(&pg.pool)
    .await
    .unwrap();
    assert_eq!(
        owner, PASSWORD_ROLE,
        "migrated as the role, with its password"
    );
    let _ = std::fs::remove_dir_all(&home);
}

/// An empty directory for `HOME`, so no `~/.pgpass` of the machine's is read.
fn tempdir() -> String {
    let path = std::env::temp_dir().join(format!("sagabox-home-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&path).unwrap();
    path.display().to_string()
}
