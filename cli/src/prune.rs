//! `sagabox prune`: one pruner pass over the inbox's months, then the saga history's.

use std::process::ExitCode;
use std::time::Duration;

use sagabox::database::{prune, prune_history};
use sagabox::logging::redact;
use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};

use crate::{emit, failed, usage_error};

/// The options of `sagabox prune`.
#[derive(Debug, clap::Args)]
pub(crate) struct PruneArgs {
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Only report what the pass would do.
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    pub(crate) retention: args::RetentionArgs,
    /// Days the history of a finished saga is kept (counted in whole months: a month
    /// of history goes once all of it is older than this). 0 keeps it forever.
    #[arg(long, default_value_t = 90)]
    pub(crate) history_retention_days: u64,
}

/// Runs `sagabox prune`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: PruneArgs) -> Result<ExitCode, ExitCode> {
    let PruneArgs {
        database_url,
        db_schema,
        dry_run,
        retention,
        history_retention_days,
    } = args;
    let config = retention
        .config()
        .unwrap_or_else(|error| usage_error("prune", error));
    let pass = prune(&database_url, &db_schema, config.clone(), dry_run)
        .await
        .map_err(|error| failed("prune", error, false))?;
    let verb = if dry_run { "would be " } else { "" };
    let database = redact(&database_url);
    if pass.skipped {
        return emit(
                "prune",
                format_args!(
                    "{database}: another instance is running a pruner pass; nothing done (try again later)\n"
                ),
            )
            .map(|()| ExitCode::SUCCESS);
    }
    emit(
        "prune",
        format_args!(
            "{database}: partitions {verb}created: {}\n{database}: partitions {verb}dropped: {}\n",
            list(&pass.created),
            list(&pass.dropped)
        ),
    )?;
    if history_retention_days > 0 {
        let retention = Duration::from_secs(history_retention_days.saturating_mul(86_400));
        let history = prune_history(&database_url, &db_schema, config, retention, dry_run)
            .await
            .map_err(|error| failed("prune", error, false))?;
        emit(
            "prune",
            format_args!(
                "{database}: saga history months {verb}dropped: {}; rows {verb}deleted: {}\n",
                list(&history.months_dropped),
                history.rows_deleted
            ),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `months` as a list for people: `2026-01, 2026-02`, or `none`.
fn list(months: &[sagabox::Month]) -> String {
    if months.is_empty() {
        "none".to_owned()
    } else {
        months
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}
