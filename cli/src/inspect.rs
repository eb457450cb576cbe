//! `sagabox inspect`: the inbox's partitions and reach, duplicates, sagas and the outbox,
//! counted from the tables, and optionally the broker's retention.

use std::process::ExitCode;
use std::time::Duration;

use sagabox::inspect::{InspectOptions, inspect};
use sagabox_cli::args::DEFAULT_DATABASE_URL;

mod text;

use crate::{failed, report, usage_error};

use sagabox::InboxConfig;

/// The options of `sagabox inspect`.
#[derive(Debug, clap::Args)]
pub(crate) struct InspectArgs {
    /// postgres://user@host:port/db or sqlite:path/to/file.db
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// The PostgreSQL schema that holds sagabox's tables (SQLite has none): give each
    /// installation sharing a database its own.
    #[arg(long, env = "SAGABOX_DB_SCHEMA", default_value = sagabox::Schema::DEFAULT_NAME)]
    pub(crate) db_schema: sagabox::Schema,
    /// Days a message stays deduplicated (as the inbox is configured).
    #[arg(long, default_value_t = 30)]
    pub(crate) ttl_days: u64,
    /// The broker's maximum redelivery window, in days (SQS: 14).
    #[arg(long, default_value_t = 14)]
    pub(crate) broker_retention_days: u64,
    /// Months ahead of the current one that should have partitions.
    #[arg(long, default_value_t = 2)]
    pub(crate) partitions_ahead: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Also report the retention of the broker's queues (<prefix>.*), measured
    /// through its management API: amqp://user:password@host:port/vhost.
    #[arg(long, value_name = "URL")]
    pub(crate) amqp_url: Option<String>,
    /// Also report the retention (max_age) of the NATS JetStream work streams of the
    /// prefix, measured on the server: nats://host:port.
    #[arg(long, value_name = "URL")]
    pub(crate) nats_url: Option<String>,
    /// The queues reported with --amqp-url are <prefix>.<consumer_type> (the streams
    /// with --nats-url, <prefix>_<consumer_type>).
    #[arg(long, default_value = "sagabox")]
    pub(crate) queue_prefix: String,
    /// The RabbitMQ management API (default: http://<broker host>:15672, or
    /// https://<broker host>:15671 for an amqps:// URL).
    #[arg(long, value_name = "URL")]
    pub(crate) amqp_management_url: Option<String>,
}

/// Runs `sagabox inspect`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run(args: InspectArgs) -> Result<ExitCode, ExitCode> {
    let InspectArgs {
        database_url,
        db_schema,
        ttl_days,
        broker_retention_days,
        partitions_ahead,
        json,
        amqp_url,
        nats_url,
        queue_prefix,
        amqp_management_url,
    } = args;
    let config = inbox_config(ttl_days, broker_retention_days, partitions_ahead);
    if let Err(error) = config.validate() {
        usage_error("inspect", error);
    }
    let options = InspectOptions {
        config: config.clone(),
        schema: db_schema,
        ..InspectOptions::default()
    };
    let mut inspected = inspect(&database_url, &options)
        .await
        .map_err(|error| failed("inspect", error, json))?;
    if let Some(url) = amqp_url {
        let mut amqp = sagabox::amqp::AmqpConfig::new(url).with_queue_prefix(queue_prefix.clone());
        amqp.management_url = amqp_management_url;
        if let Err(error) = amqp.validate() {
            usage_error("inspect", format_args!("--amqp-url: {error}"));
        }
        inspected = inspected
            .with_broker(&amqp, &config)
            .await
            .map_err(|error| failed("inspect", error, json))?;
    }
    if let Some(url) = nats_url {
        let nats = sagabox::nats::NatsConfig::new(url).with_prefix(queue_prefix);
        if let Err(error) = nats.validate() {
            usage_error("inspect", format_args!("--nats-url: {error}"));
        }
        inspected = inspected
            .with_streams(&nats, &config)
            .await
            .map_err(|error| failed("inspect", error, json))?;
    }
    report(
        "inspect",
        Ok::<_, std::convert::Infallible>(text::Text(inspected)),
        json,
    )?;
    Ok(ExitCode::SUCCESS)
}

/// The inbox configuration the flags describe.
fn inbox_config(ttl_days: u64, broker_retention_days: u64, partitions_ahead: u32) -> InboxConfig {
    const DAY: u64 = 86_400;
    InboxConfig::default()
        .with_ttl(Duration::from_secs(ttl_days.saturating_mul(DAY)))
        .with_broker_retention(Duration::from_secs(
            broker_retention_days.saturating_mul(DAY),
        ))
        .with_partitions_ahead(partitions_ahead)
}
