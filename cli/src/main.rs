//! The `sagabox` command line: `demo`, `serve`, `orchestrate`, `migrate`, `prune`,
//! `inspect`, `saga`, `dlq`, `bench`, `bench-broker`, `bench-saga`, `bench-relay`, `console`. This
//! file parses the
//! command line and hands each subcommand to its module, which holds its options and
//! runs it; the helpers every subcommand reports through live here.
//!
//! Exit status: 0 done; 1 the run failed (the cause on stderr, and with `--json` also as
//! `{"error": "…"}` on stdout); 2 a usage error (clap's, or a value refused after
//! parsing, with the same shape); 3 `demo` ran and found damage (its verdict).

mod bench;
mod console;
mod demo;
mod dlq;
mod environment;
mod inspect;
mod migrate;
mod orchestrate;
mod prune;
mod saga;
mod serve;

use std::fmt::Display;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use sagabox::logging::redact;
use sagabox_cli::args;
use sagabox_cli::telemetry::{LogFormat, init_tracing};

/// Starts the Prometheus endpoint, or says why the build has none.
fn start_metrics(addr: &str) -> Result<(), String> {
    {
        let listening = sagabox::metrics::install_prometheus(addr).map_err(|e| e.to_string())?;
        say(format_args!(
            "metrics at http://{listening}/metrics, health at /healthz and /readyz"
        ));
        Ok(())
    }
}

/// The exit status of a `demo` whose verdict is damage: it ran to the end, and found side
/// effects applied twice or not undone.
const EXIT_DAMAGE: u8 = 3;

const EXIT_STATUS: &str = "Exit status: 0 done; 1 the run failed (with --json also {\"error\": …} \
    on stdout); 2 usage error; 3 demo found damage.";

/// Saga participants that process every message effectively exactly once.
#[derive(Debug, Parser)]
#[command(name = "sagabox", version, about, after_help = EXIT_STATUS)]
struct Cli {
    /// Log lines on stderr: human or json (one object per line). RUST_LOG filters them
    /// (default: warnings, and serve's up and stop lines; RUST_LOG=sagabox=debug shows a
    /// line per message and step attempt).
    #[arg(long, global = true, default_value_t = LogFormat::Human, env = "SAGABOX_LOG_FORMAT")]
    log_format: LogFormat,
    /// Export spans over OTLP/HTTP to this collector (a base URL, e.g.
    /// http://localhost:4318; /v1/traces is appended). A saga is one trace across the
    /// orchestrator and its participants. Unset: nothing is exported.
    #[arg(
        long,
        global = true,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL"
    )]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the checkout saga (payment → inventory → email) under injected faults and
    /// report, from the tables, whether anything was charged, decremented or sent twice
    /// (exit status 3 if so).
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Demo(demo::DemoArgs),
    /// Run checkout participants over RabbitMQ or NATS JetStream until interrupted (Ctrl-C
    /// or SIGTERM): each role consumes <prefix>.<role> through its inbox and replies; the
    /// outbox relay and the pruner run beside them.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Serve(serve::ServeArgs),
    /// Drive the sagas defined in TOML files, over RabbitMQ or NATS JetStream, with their steps served by
    /// other processes. A saga starts from a start message on <prefix>.<saga>.start: an
    /// envelope whose kind is the saga's name and whose payload is its data; the same
    /// message delivered twice starts one saga. Stops on SIGINT or SIGTERM.
    Orchestrate(orchestrate::OrchestrateArgs),
    /// Show the inbox's partitions and reach, duplicate deliveries, sagas by status and
    /// the outbox's backlog, counted from the tables, with warnings for what needs a person.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Inspect(inspect::InspectArgs),
    /// List sagas, show one's timeline, retry or cancel a stuck one (safe while
    /// orchestrators run).
    #[command(after_help = EXIT_STATUS)]
    Saga {
        #[command(subcommand)]
        command: saga::SagaCommand,
    },
    /// Run the migrations and create the current and upcoming inbox partitions.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Migrate(migrate::MigrateArgs),
    /// Run one pruner pass: create the partitions ahead, drop the expired ones.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Prune(prune::PruneArgs),
    /// Measure the inbox against hand-written SQL doing the same work, in one run.
    #[command(allow_negative_numbers = true, after_help = EXIT_STATUS)]
    Bench(bench::BenchOptions),
    /// Measure the broker path: messages through RabbitMQ or NATS JetStream into
    /// PostgreSQL, consumed by a hand-written consumer (INSERT … ON CONFLICT DO NOTHING,
    /// the business statements, commit, ack), by sagabox's consumer with the inbox guard,
    /// and by sagabox's Participant runtime, on one broker and one database in one run.
    /// Scratch queues or streams and a scratch schema, removed afterwards.
    #[command(name = "bench-broker")]
    BenchBroker(bench::broker::BrokerBenchArgs),
    /// Measure whole checkout sagas on PostgreSQL — in process and over each --transport
    /// — against the same saga written by hand in plain SQL, in one run: sagas/s, p50/p99
    /// from start to end at full load and paced, commits, WAL and CPU per saga. Each run
    /// on a scratch database of its own, dropped afterwards.
    #[command(name = "bench-saga", allow_negative_numbers = true)]
    BenchSaga(bench::saga::SagaBenchArgs),
    /// Measure how long an outbox row waits for its broker on PostgreSQL: rows committed
    /// one by one at --rate, each timed from its commit to the broker's confirm, sent by
    /// the writer itself (the floor), by the relay woken by the commit's NOTIFY, and by
    /// the relay's poll alone. A scratch schema and a scratch queue or stream, removed
    /// afterwards.
    #[command(name = "bench-relay")]
    BenchRelay(bench::relay::RelayBenchArgs),
    /// Read and replay a RabbitMQ dead-letter queue (<queue>.dead): `list` shows the dead
    /// letters without taking them, `replay` sends them back to their queue.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Serve a web page for operators until interrupted: sagas by state and definition,
    /// each saga's timeline and data, the inbox against its TTL, the dead letters; with
    /// --allow-actions, retry, cancel and replay (the same code as `saga` and `dlq`).
    #[command(after_help = EXIT_STATUS)]
    Console(console::ConsoleArgs),
}

/// Prints `result`: a table, or one JSON object with `json`; a failure through
/// [`failed`].
fn report<T, E>(command: &str, result: Result<T, E>, json: bool) -> Result<(), ExitCode>
where
    T: serde::Serialize + Display,
    E: Display,
{
    let value = result.map_err(|error| failed(command, error, json))?;
    if json {
        let text = serde_json::to_string(&value).map_err(|error| failed(command, error, json))?;
        emit(command, format_args!("{text}\n"))
    } else {
        emit(command, value)
    }
}

/// Writes a line to stderr. Unlike `eprintln!`, which panics when stderr cannot be
/// written (closed, full, a log shipper gone), a line that cannot be written is dropped:
/// the exit status still tells the outcome.
fn say(line: impl Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Writes `text` to stdout. A reader that went away (`sagabox demo | head -1`) ends the
/// command with a failure instead of a panic.
fn emit(command: &str, text: impl Display) -> Result<(), ExitCode> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{text}")
        .and_then(|()| stdout.flush())
        .map_err(|error| {
            say(format_args!(
                "sagabox {command}: cannot write the report to stdout: {error}"
            ));
            ExitCode::FAILURE
        })
}

/// Reports a failed run: `sagabox <command>: <error>` on stderr and, with `json`, one
/// object `{"error": "<error>"}` on stdout, so a script reading stdout sees it too.
fn failed(command: &str, error: impl Display, json: bool) -> ExitCode {
    let message = error.to_string();
    if json {
        // Best effort: the error goes to stderr below whether or not stdout takes it.
        let _ = emit(
            command,
            format_args!("{}\n", serde_json::json!({ "error": message })),
        );
    }
    say(format_args!("sagabox {command}: {message}"));
    ExitCode::FAILURE
}

/// Ends the process as clap does for a usage error (exit status 2): for the values
/// checked after parsing, whose own messages say what is wrong (and quote URLs redacted,
/// which clap's would not).
/// The command line, with the options of [`environment`] read from the environment.
fn parse() -> Cli {
    use clap::FromArgMatches;
    let command = environment::apply(Cli::command(), &|name| std::env::var_os(name))
        .unwrap_or_else(|error| {
            Cli::command()
                .error(ErrorKind::ValueValidation, error)
                .exit()
        });
    let mut matches = command.get_matches();
    Cli::from_arg_matches_mut(&mut matches).unwrap_or_else(|error| error.exit())
}

fn usage_error(subcommand: &str, message: impl Display) -> ! {
    let mut cli = Cli::command();
    cli.build();
    let mut command = cli
        .find_subcommand(subcommand)
        .cloned()
        .unwrap_or_else(Cli::command);
    command.error(ErrorKind::ValueValidation, message).exit()
}

/// Resolves on Ctrl-C or SIGTERM. The handlers are installed when this is called, not
/// when it is first awaited: `serve` says it is up before it awaits, and a SIGTERM sent
/// right after that line must stop it gracefully rather than kill it.
fn interrupted() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = [SignalKind::interrupt(), SignalKind::terminate()].map(signal);
    async move {
        let [interrupt, terminate] = handlers.map(|handler| async move {
            match handler {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                // Without a handler the signal keeps its default action.
                Err(_) => std::future::pending::<()>().await,
            }
        });
        tokio::select! {
            _ = interrupt => {}
            _ = terminate => {}
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = parse();
    // Checked here rather than by clap, whose message would quote the URL unredacted.
    let database = match &cli.command {
        Command::Demo(args) => Some(("demo", &args.database_url)),
        Command::Serve(args) => Some(("serve", &args.database_url)),
        Command::Orchestrate(args) => Some(("orchestrate", &args.database_url)),
        Command::Migrate(args) => Some(("migrate", &args.database_url)),
        Command::Prune(args) => Some(("prune", &args.database_url)),
        Command::Inspect(args) => Some(("inspect", &args.database_url)),
        Command::Bench(args) => Some(("bench", &args.database_url)),
        Command::BenchBroker(args) => Some(("bench-broker", &args.database_url)),
        Command::BenchSaga(args) => Some(("bench-saga", &args.database_url)),
        Command::BenchRelay(args) => Some(("bench-relay", &args.database_url)),
        Command::Saga { command } => Some(("saga", command.database_url())),
        Command::Console(args) => Some(("console", &args.database_url)),
        // The broker only.
        Command::Dlq(_) => None,
    };
    if let Some((name, url)) = database
        && let Err(error) = args::database_url(url)
    {
        usage_error(name, format_args!("--database-url: {error}"));
    }
    let name = database.map_or("dlq", |(name, _)| name);
    // Held to the end of `main`: dropping it sends the last spans.
    let _tracing = match init_tracing(
        cli.log_format,
        cli.otlp_endpoint.as_deref(),
        &format!("sagabox-{name}"),
    ) {
        Ok(guard) => guard,
        Err(error) => {
            say(format_args!("sagabox: {error}"));
            return ExitCode::FAILURE;
        }
    };
    match run(cli.command).await {
        Ok(code) => code,
        Err(code) => {
            // A run that failed may have stopped actors just now (a participant whose
            // start failed stops what it started). ractor drains their supervision
            // notices in tasks of its own and panics on one the runtime's shutdown
            // cancels ("task N was cancelled"), which would print a backtrace after the
            // one line that says what failed. Let those tasks finish first.
            tokio::time::sleep(SETTLE).await;
            code
        }
    }
}

/// How long a failed run waits for the actors' last supervision notices before the
/// runtime shuts down.
const SETTLE: Duration = Duration::from_millis(200);

/// Ends with a usage error unless `url` is PostgreSQL's: the `what` bench runs there only.
/// Checked here rather than by clap, whose message would quote the URL unredacted.
fn postgres_only(subcommand: &str, what: &str, url: &str) {
    if !matches!(
        sagabox::database::Backend::of(url),
        Ok(sagabox::database::Backend::Postgres)
    ) {
        usage_error(
            subcommand,
            format_args!(
                "--database-url {}: the {what} bench runs on PostgreSQL (postgres://…)",
                redact(url)
            ),
        );
    }
}

/// Runs one subcommand; `Err` carries the exit status of a failure already reported.
async fn run(command: Command) -> Result<ExitCode, ExitCode> {
    match command {
        Command::Dlq(command) => dlq::run(command).await,
        Command::Console(args) => console::run(args, interrupted()).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Serve(args) => serve::run(args).await,
        Command::Orchestrate(args) => orchestrate::run(args).await,
        Command::Prune(args) => prune::run(args).await,
        Command::Inspect(args) => inspect::run(args).await,
        Command::BenchBroker(args) => {
            postgres_only("bench-broker", "broker", &args.database_url);
            let json = args.json;
            report("bench-broker", bench::broker::run(args).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(args) => bench::run_command(args).await,
        Command::BenchSaga(args) => {
            postgres_only("bench-saga", "saga", &args.database_url);
            let json = args.json;
            report("bench-saga", bench::saga::run(args).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchRelay(args) => {
            postgres_only("bench-relay", "relay", &args.database_url);
            let json = args.json;
            report("bench-relay", bench::relay::run(args).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Saga { command } => {
            let json = command.json();
            report("saga", saga::run(command).await, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate(args) => migrate::run(args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_of_the_service_and_operator_commands_reads_a_variable() {
        let mut command = environment::apply(Cli::command(), &|_| None).expect("no files");
        command.build();
        for name in environment::FROM_ENVIRONMENT {
            let sub = command.find_subcommand(name).expect("subcommand");
            let mut options = 0;
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if matches!(long, "help" | "version") {
                    continue;
                }
                options += 1;
                assert!(
                    arg.get_env().is_some(),
                    "sagabox {name} --{long} reads no variable"
                );
            }
            assert!(options > 0, "{name}");
        }
        let help = command
            .find_subcommand_mut("serve")
            .expect("serve")
            .render_long_help()
            .to_string();
        assert!(help.contains("SAGABOX_QUEUE_PREFIX"), "{help}");
        assert!(help.contains("SAGABOX_TRANSPORT"), "{help}");
    }
}
