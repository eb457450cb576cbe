//! The options of `sagabox bench`, as the command line takes them.

use std::process::ExitCode;

use sagabox_cli::args::{self, DEFAULT_DATABASE_URL};

use crate::report;

/// The options of `sagabox bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchOptions {
    /// postgres://user@host:port/db or sqlite:path/to/file.db (a scratch schema in that
    /// database, or a scratch file beside that one, is used and removed)
    #[arg(long, env = "SAGABOX_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub(crate) database_url: String,
    /// Messages per mode (a further 10 % warm up first, unmeasured).
    #[arg(long, default_value_t = 20_000, value_parser = args::at_least_one)]
    pub(crate) messages: usize,
    /// Concurrent tasks (and pool connections), 1 to 10000.
    #[arg(long, default_value_t = 8, value_parser = args::parallel)]
    pub(crate) concurrency: usize,
    /// Share of messages that repeat an earlier id, 0..=1.
    #[arg(long, default_value_t = 0.0, value_parser = args::rate)]
    pub(crate) duplicate_rate: f64,
    /// Measure the claim alone: no business statements.
    #[arg(long)]
    pub(crate) claim_only: bool,
    /// Handlers return a small result that the inbox records (the raw baseline then
    /// stores it too, with an UPDATE of its inbox row); by default they return none.
    #[arg(long)]
    pub(crate) with_result: bool,
    /// Measure in this many rounds, every mode taking its turn in each, so that a
    /// checkpoint or autovacuum slows all modes alike.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub(crate) rounds: u16,
    /// Seed of the workload's random choices.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Only these modes (comma-separated); all by default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) modes: Vec<super::Mode>,
    /// Messages with UUIDv4 ids and no publish time: the guard's slow path.
    #[arg(long)]
    pub(crate) timeless: bool,
    /// Messages per transaction in the `batched` mode (1..=10000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    pub(crate) batch: u16,
    /// PostgreSQL: afterwards, fill the inbox with this many rows over 12 months and
    /// run the guard mode again (claim cost as the table grows).
    #[arg(long, default_value_t = 0)]
    pub(crate) prefill: u64,
    /// PostgreSQL: afterwards, retire months of this many rows by DELETE and by
    /// dropping the partition, idle and under a claim load.
    #[arg(long, default_value_t = 0)]
    pub(crate) prune_rows: u64,
}

/// Runs `sagabox bench`; `Err` carries the exit status of a failure already reported.
pub(crate) async fn run_command(args: BenchOptions) -> Result<ExitCode, ExitCode> {
    let BenchOptions {
        database_url,
        messages,
        concurrency,
        duplicate_rate,
        claim_only,
        with_result,
        rounds,
        seed,
        json,
        modes,
        timeless,
        batch,
        prefill,
        prune_rows,
    } = args;
    let args = super::BenchArgs {
        database_url,
        messages,
        concurrency,
        duplicate_rate,
        claim_only,
        with_result,
        rounds: usize::from(rounds),
        seed,
        modes,
        timeless,
        batch: usize::from(batch),
        prefill,
        prune_rows,
    };
    report("bench", super::run(args).await, json)?;
    Ok(ExitCode::SUCCESS)
}
