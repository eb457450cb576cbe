//! The `sagabox` command line: `sagabox migrate --database-url URL`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sagabox::InboxConfig;
use sagabox::database::{migrate, redact};

/// Saga participants that process every message effectively exactly once.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the migrations and create the current and upcoming inbox partitions.
    Migrate {
        /// postgres://user@host:port/db or sqlite:path/to/file.db
        #[arg(long, env = "DATABASE_URL", default_value = "sqlite:sagabox.db")]
        database_url: String,
        /// Months ahead of the current one to create partitions for.
        #[arg(long, default_value_t = 2)]
        partitions_ahead: u32,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Migrate {
            database_url,
            partitions_ahead,
        } => {
            let config = InboxConfig::default().with_partitions_ahead(partitions_ahead);
            match migrate(&database_url, config).await {
                Ok(created) => {
                    let created: Vec<String> = created.iter().map(ToString::to_string).collect();
                    println!(
                        "migrated {}; partitions created: {}",
                        redact(&database_url),
                        if created.is_empty() {
                            "none (all present)".to_owned()
                        } else {
                            created.join(", ")
                        }
                    );
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("sagabox migrate: {error}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
