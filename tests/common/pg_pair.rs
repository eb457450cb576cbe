//! A PostgreSQL primary and its streaming standby of the test's own, on loopback ports
//! of their own beside the machine's server: [`PgPair`] makes the primary (`initdb`),
//! the standby from it (`pg_basebackup -R`), with its replication connection through a
//! [`FaultProxy`] that can hold the WAL back, and replication synchronous
//! (`synchronous_standby_names = '*'`, `synchronous_commit = on`) or asynchronous. It kills
//! the primary as a crash would (SIGKILL to the postmaster) and promotes the standby.
//! Both are stopped, and their folder removed, on drop.
//!
//! The servers run as the `postgres` user (`runuser`), with the binaries of the newest
//! PostgreSQL under `/usr/lib/postgresql`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::proxy::FaultProxy;
use super::scrape::free_port;

/// How the standby confirms the primary's commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A commit returns once the standby has flushed its WAL.
    Synchronous,
    /// A commit returns once the primary has flushed it; the standby follows.
    Asynchronous,
}

/// The primary, its standby, and the proxy the standby replicates through.
pub struct PgPair {
    dir: PathBuf,
    bin: PathBuf,
    primary_port: u16,
    standby_port: u16,
    /// Between the standby's WAL receiver and the primary.
    pub replication: FaultProxy,
}

impl PgPair {
    /// Makes and starts the primary and the standby, and waits until the standby
    /// streams (as a synchronous standby when asked).
    pub async fn start(mode: Replication) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "sagabox-pg-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        std::fs::create_dir_all(&dir).expect("pair folder");
        chown_postgres(&dir);
        let bin = newest_bin();
        let (primary_port, standby_port) = (free_port(), free_port());
        let pair_dir = dir.clone();
        let primary = dir.join("primary");
        run_as_postgres(
            &bin.join("initdb"),
            &[
                "-D",
                path(&primary),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        let synchronous = match mode {
            Replication::Synchronous => "synchronous_standby_names = '*'\n",
            Replication::Asynchronous => "",
        };
        append(
            &primary.join("postgresql.conf"),
            &format!(
                "port = {primary_port}\nlisten_addresses = '127.0.0.1'\n\
                 unix_socket_directories = '{}'\nwal_level = replica\nmax_wal_senders = 4\n\
                 wal_keep_size = '256MB'\nsynchronous_commit = on\n{synchronous}",
                path(&pair_dir)
            ),
        );
        start(&bin, &primary);
        let replication = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], primary_port))).await;
        let standby = dir.join("standby");
        let proxied_port = replication.addr().port().to_string();
        run_as_postgres(
            &bin.join("pg_basebackup"),
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &proxied_port,
                "-U",
                "postgres",
                "-D",
                path(&standby),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        );
        append(
            &standby.join("postgresql.conf"),
            // The primary's configuration came with the backup: once promoted, a server
            // that still names synchronous standbys waits for one forever.
            &format!("port = {standby_port}\nhot_standby = on\nsynchronous_standby_names = ''\n"),
        );
        start(&bin, &standby);
        let pair = Self {
            dir,
            bin,
            primary_port,
            standby_port,
            replication,
        };
        let wanted = match mode {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        pair.wait_for_standby(wanted).await;
        pair
    }

    /// The primary's address.
    pub fn primary(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.primary_port))
    }

    /// The standby's address.
    pub fn standby(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.standby_port))
    }

    /// Kills the primary at once, as a crash of its machine would: the postmaster is
    /// frozen (SIGSTOP, so it starts nothing more), the replication connection cut with
    /// the WAL still on its way, every process it started killed (SIGKILL), then the
    /// postmaster. Nothing it held in memory reaches a disk or a
    /// client afterwards.
    pub fn kill_primary(&self) {
        let pid = std::fs::read_to_string(self.dir.join("primary").join("postmaster.pid"))
            .ok()
            .and_then(|text| {
                text.lines()
                    .next()
                    .and_then(|pid| pid.trim().parse::<u32>().ok())
            })
            .expect("the primary's postmaster.pid")
            .to_string();
        let _ = Command::new("kill").args(["-STOP", &pid]).status();
        // The WAL on its way to the standby dies with the machine's network.
        self.replication.cut();
        let _ = Command::new("pkill").args(["-KILL", "-P", &pid]).status();
        let killed = Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .expect("run kill");
        assert!(killed.success(), "kill -KILL {pid}");
    }

    /// Promotes the standby, and waits until it takes writes.
    pub fn promote_standby(&self) {
        run_as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", path(&self.dir.join("standby")), "-w", "promote"],
        );
    }

    /// Waits until the standby has replayed everything the primary has written so far
    /// (a test's tables, made just before its run, are there when the standby is promoted).
    pub async fn wait_for_standby_to_catch_up(&self) {
        let connect = async |addr: SocketAddr| {
            <sqlx::PgConnection as sqlx::Connection>::connect(&format!(
                "postgres://postgres@{addr}/postgres"
            ))
            .await
            .expect("connect to the pair")
        };
        let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut connect(self.primary()).await)
            .await
            .expect("the primary's WAL position");
        let mut standby = connect(self.standby()).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let replayed: bool =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn")
                    .bind(&written)
                    .fetch_one(&mut standby)
                    .await
                    .expect("the standby's replay position");
            if replayed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby has not replayed up to {written} in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_for_standby(&self, state: &str) {
        let url = format!("postgres://postgres@{}/postgres", self.primary());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let found: Option<String> = async {
                let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
                    .await
                    .ok()?;
                sqlx::query_scalar("SELECT sync_state FROM pg_stat_replication")
                    .fetch_optional(&mut conn)
                    .await
                    .ok()
                    .flatten()
            }
            .await;
            if found.as_deref() == Some(state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby is not streaming as {state} ({found:?}); its log:\n{}",
                std::fs::read_to_string(self.dir.join("standby.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        for server in ["primary", "standby"] {
            let data = self.dir.join(server);
            if data.join("postmaster.pid").exists() {
                let _ = Command::new("runuser")
                    .args(["-u", "postgres", "--"])
                    .arg(self.bin.join("pg_ctl"))
                    .args(["-D", path(&data), "-m", "immediate", "-w", "stop"])
                    .output();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The binaries of the newest PostgreSQL installed.
fn newest_bin() -> PathBuf {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's binaries under /usr/lib/postgresql")
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort_unstable();
    let version = versions.last().expect("a PostgreSQL version installed");
    PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"))
}

fn path(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn chown_postgres(dir: &Path) {
    let owned = Command::new("chown")
        .args(["-R", "postgres:postgres", path(dir)])
        .status()
        .expect("run chown");
    assert!(owned.success(), "chown postgres {}", dir.display());
}

fn append(file: &Path, text: &str) {
    use std::io::Write;
    let mut opened = std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .unwrap_or_else(|error| panic!("open {}: {error}", file.display()));
    opened.write_all(text.as_bytes()).expect("append");
}

fn start(bin: &Path, data: &Path) {
    let log = data.with_extension("log");
    run_as_postgres(
        &bin.join("pg_ctl"),
        &["-D", path(data), "-l", path(&log), "-w", "start"],
    );
}

/// Runs `program args` as the `postgres` user; it must succeed.
fn run_as_postgres(program: &Path, args: &[&str]) {
    let output = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .output()
        .expect("run runuser");
    assert!(
        output.status.success(),
        "{} {args:?} failed: {}{}",
        program.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
