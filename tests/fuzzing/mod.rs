//! The fuzzing harness shared by the fuzz targets of the workspace's packages: run a
//! check over proptest-generated values for a case count and a time budget, replay a
//! target's corpus (`tests/corpus/<target>/`), and text generators that look like their
//! target often enough to get past its first check.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} is a number")))
        .unwrap_or(default)
}

/// Runs `check` over generated values until both the case count and the time budget
/// are spent (the caller replays the corpus first). Panics with the minimal failing input.
pub fn fuzz<S>(target: &str, strategy: S, check: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let min_cases = env_number("FUZZ_CASES", 20_000);
    let budget = Duration::from_secs(env_number("FUZZ_SECONDS", 0));
    let started = Instant::now();
    let mut cases = 0u64;
    while cases < min_cases || started.elapsed() < budget {
        let batch = 10_000u32;
        let mut runner = TestRunner::new(Config {
            cases: batch,
            failure_persistence: None,
            // Generated strings are often rejected by their own rules: that is the point.
            max_global_rejects: u32::MAX,
            ..Config::default()
        });
        match runner.run(&strategy, &check) {
            Ok(()) => {}
            Err(TestError::Fail(reason, value)) => panic!(
                "fuzz target {target} failed after {cases} cases: {reason}\nminimal input: {value:#?}\n\
                 add it to tests/corpus/{target}/"
            ),
            Err(TestError::Abort(reason)) => panic!("fuzz target {target} aborted: {reason}"),
        }
        cases += u64::from(batch);
    }
    eprintln!(
        "fuzz target {target}: {cases} generated cases in {:.1} s, no failure",
        started.elapsed().as_secs_f64()
    );
}

/// The files of `tests/corpus/<target>/`, sorted.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    // The corpus is the workspace's, whichever package's tests replay it.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|dir| dir.join("tests/corpus"))
        .find(|dir| dir.is_dir())
        .expect("tests/corpus in the package or an ancestor")
        .join(target);
    let mut entries: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("corpus {}: {error}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "corpus {} is empty", dir.display());
    entries
}

/// Text that looks like its target often enough to get past the first check: pieces
/// glued together, with control characters, quotes and multi-byte characters.
pub fn fragments(pieces: &'static [&'static str]) -> BoxedStrategy<String> {
    prop::collection::vec(
        prop_oneof![
            4 => prop::sample::select(pieces).prop_map(str::to_owned),
            2 => "[a-z0-9_./:@?&=%-]{0,12}",
            1 => any::<String>(),
            1 => prop::sample::select(&["\0", "\n", "\u{7f}", "\u{202e}", "é", "𝕏", "\"", "'", "\\", " "][..])
                .prop_map(str::to_owned),
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
    .boxed()
}
