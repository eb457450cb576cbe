//! `sagabox dlq list` and `sagabox dlq replay`: the library's
//! [`DeadLetters`](sagabox::dlq::DeadLetters) on the command line, for a RabbitMQ queue
//! or a NATS JetStream subject.

use std::process::ExitCode;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Subcommand};
use sagabox::dead_reason::DeadReason;
use sagabox::dlq::{DeadLetters, DlqError, ReplayOptions};
use sagabox::transport::Transport;
use sagabox_cli::args;

use crate::{EXIT_STATUS, failed, report, usage_error};

/// The broker `dlq` talks to when given neither `--amqp-url` nor `--nats-url`: RabbitMQ's
/// own default.
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Dead letters listed when no `--limit` is given: a screenful, and no more unacked
/// messages held than a person reads.
const DEFAULT_LIST_LIMIT: usize = 100;

/// A `dlq` subcommand.
#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// Show the dead letters of a queue without taking them: each message's id, kind,
    /// reason, detail, attempts and age. The queue holds the same messages, in the same
    /// order, afterwards.
    #[command(after_help = EXIT_STATUS)]
    List {
        #[command(flatten)]
        queue: QueueArgs,
        /// Show at most this many, oldest first (default 100).
        #[arg(long, value_parser = args::at_least_one)]
        limit: Option<usize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Republish dead letters to their source queue under their original message id
    /// (the consumer's inbox absorbs any that were in fact applied), without their
    /// dead-letter headers; each leaves the dead-letter queue only once the broker
    /// confirmed its copy. The others stay where they are.
    #[command(after_help = EXIT_STATUS)]
    Replay {
        #[command(flatten)]
        queue: QueueArgs,
        /// Only the dead letters with this reason.
        #[arg(long, value_parser = reason_parser())]
        reason: Option<DeadReason>,
        /// Replay at most this many, oldest first (default: all).
        #[arg(long, value_parser = args::at_least_one)]
        limit: Option<usize>,
        /// Print one JSON object instead of a summary.
        #[arg(long)]
        json: bool,
    },
}

/// Which queue, on which broker.
#[derive(Debug, Args)]
pub(crate) struct QueueArgs {
    /// The source queue (RabbitMQ) or subject (NATS JetStream) whose dead letters to
    /// read, such as sagabox.payment (sagabox.payment.dead is accepted too).
    #[arg(long, value_name = "NAME")]
    queue: String,
    /// The RabbitMQ broker: amqp://user:password@host:port/vhost
    // The value from the environment stays out of `--help`: it may hold a password.
    #[arg(long, value_name = "URL", env = "SAGABOX_AMQP_URL", hide_env_values = true,
          default_value = DEFAULT_AMQP_URL)]
    amqp_url: String,
    /// A NATS JetStream server instead: nats://host:port or tls://host:port.
    #[arg(
        long,
        value_name = "URL",
        env = "SAGABOX_NATS_URL",
        hide_env_values = true
    )]
    nats_url: Option<String>,
}

/// `--reason`: one of the codes of [`DeadReason::ALL`], which `--help` and the error for
/// any other list.
fn reason_parser() -> impl TypedValueParser<Value = DeadReason> {
    PossibleValuesParser::new(DeadReason::ALL.map(DeadReason::as_str))
        .try_map(|code| code.parse::<DeadReason>())
}

impl QueueArgs {
    /// The broker, or a usage error for a URL that names another one or is malformed.
    fn transport(&self) -> Transport {
        match args::dead_letter_broker(Some(&self.amqp_url), self.nats_url.as_deref()) {
            Ok(Some(transport)) => transport,
            Ok(None) => usage_error("dlq", "give --amqp-url or --nats-url"),
            Err(message) => usage_error("dlq", message),
        }
    }
}

/// Opens the dead-letter queue, ending a name that cannot be a queue as a usage error.
async fn open(subcommand: &str, queue: &QueueArgs, json: bool) -> Result<DeadLetters, ExitCode> {
    let transport = queue.transport();
    match DeadLetters::open(&transport, &queue.queue).await {
        Ok(opened) => Ok(opened),
        Err(error @ DlqError::InvalidQueue { .. }) => {
            usage_error("dlq", format_args!("--queue: {error}"))
        }
        Err(error) => Err(failed(&format!("dlq {subcommand}"), error, json)),
    }
}

/// Runs one `dlq` subcommand.
pub(crate) async fn run(command: DlqCommand) -> Result<ExitCode, ExitCode> {
    match command {
        DlqCommand::List { queue, limit, json } => {
            let dlq = open("list", &queue, json).await?;
            let listed = dlq.list(Some(limit.unwrap_or(DEFAULT_LIST_LIMIT))).await;
            dlq.close().await;
            report("dlq list", listed, json)?;
        }
        DlqCommand::Replay {
            queue,
            reason,
            limit,
            json,
        } => {
            let dlq = open("replay", &queue, json).await?;
            let replayed = dlq.replay(&ReplayOptions { reason, limit }).await;
            dlq.close().await;
            report("dlq replay", replayed, json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
