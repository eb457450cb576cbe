//! `sagabox migrate`: sagabox's migrations and the inbox partitions of this month and
//! the months ahead.

use std::process::ExitCode;

use sagabox::InboxConfig;
use sagabox::database::migrate;
use sagabox::logging::redact;
use sagabox_cli::args::DEFAULT_DATABASE_URL;

use crate::{emit, failed, usage_error};

/// The options of `sagabox migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Months ahead of the current one to create partitions for.
    #[arg(long, default_value_t = 2)]
    pub(crate) partitions_ahead: u32,
}

/// Runs `sagabox migrate`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: MigrateArgs) -> Result<ExitCode, ExitCode> {
    let MigrateArgs {
        database_url,
        db_schema,
        partitions_ahead,
    } = args;
    let config = InboxConfig::default().with_partitions_ahead(partitions_ahead);
    if let Err(error) = config.validate() {
        usage_error("migrate", error);
    }
    let created = migrate(&database_url, &db_schema, config)
        .await
        .map_err(|error| failed("migrate", error, false))?;
    let created: Vec<String> = created.iter().map(ToString::to_string).collect();
    emit(
        "migrate",
        format_args!(
            "migrated {}; partitions created: {}\n",
            redact(&database_url),
            if created.is_empty() {
                "none (all present)".to_owned()
            } else {
                created.join(", ")
            }
        ),
    )?;
    Ok(ExitCode::SUCCESS)
}
