//! Fuzzed input, with proptest (the toolchain is stable: no `cargo fuzz`): envelope
//! decoding from bytes, `MessageId`/`ConsumerType` construction, saga definitions
//! (`sagas/*.toml`), and the CLI's URL and rate arguments. Each target checks that
//! nothing panics, that every rejection is a typed error with a message, and that
//! what is accepted obeys the rules.
//!
//! Each target first replays its corpus, `tests/corpus/<target>/*` (inputs that once
//! mattered: keep adding the minimal failing input a run prints), then runs generated
//! cases: at least `FUZZ_CASES` (100,000 by default), and then more until `FUZZ_SECONDS`
//! have passed (0 by default). A long run outside CI:
//!
//! ```text
//! FUZZ_SECONDS=600 cargo test --release --test fuzz -- --nocapture --test-threads 1
//! ```

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use sagabox::args::{self, ArgError};
use sagabox::database::redact;
use sagabox::saga::SagaDefinition;
use sagabox::{ConsumerType, Envelope, KeyError, MAX_KEY_BYTES, MessageId};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} is a number")))
        .unwrap_or(default)
}

/// Runs `check` over generated values until both the case count and the time budget
/// are spent (the caller replays the corpus first). Panics with the minimal failing input.
fn fuzz<S>(target: &str, strategy: S, check: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let min_cases = env_number("FUZZ_CASES", 100_000);
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
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
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
fn fragments(pieces: &'static [&'static str]) -> BoxedStrategy<String> {
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

// ---------------------------------------------------------------------------------------
// Envelope decoding from bytes

fn check_envelope_bytes(bytes: &[u8]) -> Result<(), TestCaseError> {
    match serde_json::from_slice::<Envelope>(bytes) {
        Ok(envelope) => {
            // What decodes obeys the key rules and survives a round trip unchanged.
            prop_assert!(MessageId::new(envelope.id.as_str()).is_ok());
            prop_assert!(
                Envelope::new(
                    envelope.id.clone(),
                    envelope.kind.clone(),
                    serde_json::Value::Null
                )
                .is_ok()
            );
            let text = serde_json::to_vec(&envelope).unwrap();
            let again: Envelope = serde_json::from_slice(&text).unwrap();
            prop_assert_eq!(again, envelope);
        }
        Err(error) => prop_assert!(!error.to_string().is_empty()),
    }
    Ok(())
}

fn envelope_json() -> impl Strategy<Value = Vec<u8>> {
    let key = prop_oneof![
        fragments(&[
            "m1",
            "order-42/charge",
            "0190f5c2-7d1e-7cc3-8a4e-2b1d4a0c9e11",
            ""
        ]),
        "[a-z]{250,260}",
    ];
    let value = prop_oneof![
        key.clone().prop_map(serde_json::Value::String),
        Just(serde_json::Value::Null),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<bool>().prop_map(serde_json::Value::from),
        Just(serde_json::json!({"nested": [1, 2, {"x": null}]})),
        Just(serde_json::json!(["charge"])),
    ];
    let time = prop_oneof![
        Just(serde_json::json!("2026-11-30T23:59:59Z")),
        Just(serde_json::json!("+262143-12-31T23:59:59Z")),
        Just(serde_json::json!("yesterday")),
        any::<i64>().prop_map(serde_json::Value::from),
    ];
    (
        prop::option::of(value.clone()),
        prop::option::of(value.clone()),
        prop::option::of(value.clone()),
        prop::option::of(value.clone()),
        prop::option::of(time),
        prop::option::of(prop::collection::btree_map(key, value.clone(), 0..3)),
        prop::option::of(("[a-z_]{1,10}", value)),
    )
        .prop_map(|(id, kind, saga, payload, time, headers, extra)| {
            let mut object = serde_json::Map::new();
            for (name, field) in [
                ("id", id),
                ("kind", kind),
                ("saga_id", saga),
                ("payload", payload),
                ("published_at", time),
            ] {
                if let Some(field) = field {
                    object.insert(name.to_owned(), field);
                }
            }
            if let Some(headers) = headers {
                object.insert("headers".into(), serde_json::to_value(headers).unwrap());
            }
            if let Some((name, field)) = extra {
                object.insert(name, field);
            }
            serde_json::to_vec(&object).unwrap()
        })
}

#[test]
fn fuzz_envelope_decoding_from_bytes() {
    for (path, bytes) in corpus("envelope") {
        check_envelope_bytes(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let strategy = prop_oneof![
        2 => envelope_json(),
        1 => prop::collection::vec(any::<u8>(), 0..256),
        // A valid envelope with bytes flipped or cut.
        1 => (envelope_json(), any::<prop::sample::Index>(), any::<u8>(), any::<bool>())
            .prop_map(|(mut bytes, at, byte, cut)| {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    if cut { bytes.truncate(i) } else { bytes[i] = byte }
                }
                bytes
            }),
    ];
    fuzz("envelope", strategy, |bytes| check_envelope_bytes(&bytes));
}

// ---------------------------------------------------------------------------------------
// MessageId / ConsumerType construction

fn check_key(text: &str) -> Result<(), TestCaseError> {
    let expected = if text.is_empty() {
        Err("empty")
    } else if text.len() > MAX_KEY_BYTES {
        Err("too long")
    } else if text.chars().any(char::is_control) {
        Err("control")
    } else {
        Ok(())
    };
    let id = MessageId::new(text);
    let consumer = ConsumerType::new(text);
    for (what, result) in [
        ("message id", id.as_ref().map(MessageId::as_str)),
        ("consumer type", consumer.as_ref().map(ConsumerType::as_str)),
    ] {
        match (expected, result) {
            (Ok(()), Ok(stored)) => prop_assert_eq!(stored, text),
            (Err("empty"), Err(KeyError::Empty { what: w })) => prop_assert_eq!(*w, what),
            (Err("too long"), Err(KeyError::TooLong { what: w, len })) => {
                prop_assert_eq!(*w, what);
                prop_assert_eq!(*len, text.len());
            }
            (
                Err("control"),
                Err(KeyError::ControlCharacter {
                    what: w,
                    character,
                    position,
                }),
            ) => {
                prop_assert_eq!(*w, what);
                prop_assert!(character.is_control());
                prop_assert_eq!(text[*position..].chars().next(), Some(*character));
            }
            (expected, got) => {
                prop_assert!(false, "{what} {text:?}: expected {expected:?}, got {got:?}")
            }
        }
    }
    // Every way in agrees: FromStr and serde take the same rules.
    prop_assert_eq!(text.parse::<MessageId>().ok(), id.clone().ok());
    let json = serde_json::to_string(text).unwrap();
    prop_assert_eq!(
        serde_json::from_str::<ConsumerType>(&json).ok(),
        consumer.ok()
    );
    if let Err(error) = id {
        prop_assert!(!error.to_string().is_empty());
    }
    Ok(())
}

#[test]
fn fuzz_message_id_and_consumer_type_construction() {
    for (path, bytes) in corpus("keys") {
        let text = String::from_utf8_lossy(&bytes);
        check_key(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let strategy = prop_oneof![
        any::<String>(),
        fragments(&["payment", "order-42", "'); DROP TABLE x;--", "\u{1f}"]),
        // Around the length limit, in one- to four-byte characters.
        "[a-z]{250,260}",
        "[é]{120,130}",
        "[𝕏]{60,66}",
        ("[a-z]{0,254}", prop::char::range('\0', '\u{a0}')).prop_map(|(s, c)| format!("{s}{c}")),
    ];
    fuzz("keys", strategy, |text| check_key(&text));
}

// ---------------------------------------------------------------------------------------
// Saga definition parsing

fn check_definition(text: &str) -> Result<(), TestCaseError> {
    match SagaDefinition::from_toml_str(text) {
        Ok(definition) => {
            let steps = definition.steps();
            prop_assert!(!steps.is_empty());
            prop_assert!(MessageId::new(definition.name()).is_ok());
            let mut names: Vec<&str> = steps.iter().map(|s| s.name()).collect();
            names.sort_unstable();
            names.dedup();
            prop_assert_eq!(names.len(), steps.len(), "step names are unique");
            let first_plain = steps.iter().position(|s| s.compensation().is_none());
            if let Some(first) = first_plain {
                prop_assert!(steps[first..].iter().all(|s| s.compensation().is_none()));
                prop_assert!(
                    steps[first..]
                        .iter()
                        .all(|s| s.retry().max_attempts.is_none())
                );
            }
            for step in steps {
                prop_assert!(!step.timeout().is_zero());
                let retry = step.retry();
                prop_assert!(retry.multiplier >= 1.0 && retry.multiplier.is_finite());
                prop_assert!((0.0..=1.0).contains(&retry.jitter));
                prop_assert!(retry.initial_backoff <= retry.max_backoff);
                let mut rng = rand::rng();
                for attempt in [0, 1, 2, 30, 1000, u32::MAX] {
                    prop_assert!(retry.delay(attempt, &mut rng) <= retry.max_backoff);
                }
            }
        }
        Err(error) => prop_assert!(!error.to_string().is_empty()),
    }
    Ok(())
}

fn definition_toml() -> impl Strategy<Value = String> {
    let text = fragments(&["payment", "charge", "refund", "", "a b", "x\ty"]);
    let duration = prop_oneof![
        prop::sample::select(
            &[
                "5s",
                "20ms",
                "0ms",
                "0s",
                "1m 30s",
                "-1s",
                "5",
                "",
                "99999999999999999999y",
                "1ns"
            ][..]
        )
        .prop_map(str::to_owned),
        "[0-9]{1,22}(ns|ms|s|m|h|d|y)",
    ];
    let number = prop_oneof![
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("nan".to_owned()),
        Just("inf".to_owned()),
        Just("1e400".to_owned()),
        Just("4294967296".to_owned()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        any::<u32>().prop_map(|n| n.to_string()),
    ];
    let step = (
        prop::option::of(text.clone()),
        prop::option::of(text.clone()),
        prop::option::of(text.clone()),
        prop::option::of(text.clone()),
        prop::option::of(duration.clone()),
        prop::option::of(number.clone()),
        prop::option::of(duration.clone()),
        prop::option::of(duration),
        prop::option::of(number.clone()),
        prop::option::of(number),
    )
        .prop_map(
            |(
                name,
                consumer,
                command,
                compensation,
                timeout,
                attempts,
                initial,
                max,
                multiplier,
                jitter,
            )| {
                let quote = |s: String| serde_json::to_string(&s).unwrap();
                let mut out = String::from("[[steps]]\n");
                for (key, value) in [
                    ("name", name),
                    ("consumer_type", consumer),
                    ("command", command),
                    ("compensation", compensation),
                ] {
                    if let Some(value) = value {
                        out.push_str(&format!("{key} = {}\n", quote(value)));
                    }
                }
                if let Some(timeout) = timeout {
                    out.push_str(&format!("timeout = {}\n", quote(timeout)));
                }
                out.push_str("[steps.retry]\n");
                if let Some(n) = attempts {
                    out.push_str(&format!("max_attempts = {n}\n"));
                }
                for (key, value) in [("initial_backoff", initial), ("max_backoff", max)] {
                    if let Some(value) = value {
                        out.push_str(&format!("{key} = {}\n", quote(value)));
                    }
                }
                for (key, value) in [("multiplier", multiplier), ("jitter", jitter)] {
                    if let Some(value) = value {
                        out.push_str(&format!("{key} = {value}\n"));
                    }
                }
                out
            },
        );
    (
        prop::option::of(text),
        prop::collection::vec(step, 0..5),
        prop::option::of(proptest::string::string_regex("[a-z]{1,8} = [0-9]{1,3}").unwrap()),
    )
        .prop_map(|(name, steps, extra)| {
            let mut out = String::new();
            if let Some(name) = name {
                out.push_str(&format!(
                    "name = {}\n",
                    serde_json::to_string(&name).unwrap()
                ));
            }
            if let Some(extra) = extra {
                out.push_str(&extra);
                out.push('\n');
            }
            out.push_str(&steps.concat());
            out
        })
}

#[test]
fn fuzz_saga_definition_parsing() {
    for (path, bytes) in corpus("saga") {
        check_definition(&String::from_utf8_lossy(&bytes))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    // The shipped definitions must also pass.
    let sagas = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("sagas");
    for entry in std::fs::read_dir(sagas).unwrap() {
        let path = entry.unwrap().path();
        SagaDefinition::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let strategy = prop_oneof![
        4 => definition_toml(),
        1 => any::<String>(),
        // The shipped checkout with a byte changed or cut.
        1 => (any::<prop::sample::Index>(), any::<char>(), any::<bool>()).prop_map(|(at, c, cut)| {
            let mut text = sagabox::demo::CHECKOUT_TOML.to_owned();
            let mut i = at.index(text.len());
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            if cut {
                text.truncate(i);
            } else {
                text.insert(i, c);
            }
            text
        }),
    ];
    fuzz("saga", strategy, |text| check_definition(&text));
}

// ---------------------------------------------------------------------------------------
// The CLI's URL and rate arguments

/// Generated passwords start and end with these marks; the rest of a generated URL is
/// lower case, so neither mark may come out of `redact` or an error, nor any part of
/// the password between them.
const PASSWORD_MARK: &str = "PW";
const PASSWORD_END: &str = "ZQ";

fn check_url(url: &str, password: Option<&str>) -> Result<(), TestCaseError> {
    let redacted = redact(url);
    let checked = args::database_url(url);
    if let Some(password) = password {
        let mut outputs = vec![redacted.clone()];
        if let Err(error) = &checked {
            outputs.push(error.to_string());
        }
        for text in outputs {
            prop_assert!(!text.contains(password), "{url:?} → {text:?}");
            prop_assert!(
                !text.contains(PASSWORD_MARK),
                "start of the password in {text:?} from {url:?}"
            );
            prop_assert!(
                !text.contains(PASSWORD_END),
                "end of the password in {text:?} from {url:?}"
            );
        }
    }
    match checked {
        Ok(same) => {
            prop_assert_eq!(same.as_str(), url);
            prop_assert!(
                url.starts_with("postgres://")
                    || url.starts_with("postgresql://")
                    || url.starts_with("sqlite:")
            );
            prop_assert!(!url.chars().any(char::is_control));
        }
        Err(error) => {
            prop_assert!(!error.to_string().is_empty());
            let expected_kind = match error {
                ArgError::EmptyUrl => url.is_empty(),
                ArgError::UrlTooLong(len) => len == url.len() && len > args::MAX_URL_BYTES,
                ArgError::UrlControlCharacter { .. } => url.chars().any(char::is_control),
                ArgError::UnsupportedUrl(_) => {
                    !(url.starts_with("postgres://")
                        || url.starts_with("postgresql://")
                        || url.starts_with("sqlite:"))
                }
                ArgError::InvalidUrl { .. } => url.starts_with("postgres"),
                _ => false,
            };
            prop_assert!(expected_kind, "{url:?}: unexpected {error:?}");
        }
    }
    Ok(())
}

fn check_rate(text: &str) -> Result<(), TestCaseError> {
    match args::rate(text) {
        Ok(value) => prop_assert!((0.0..=1.0).contains(&value)),
        Err(error) => {
            let typed = matches!(
                error,
                ArgError::RateNotANumber(_) | ArgError::RateOutOfRange { .. }
            );
            prop_assert!(typed, "{text:?}: {error:?}");
        }
    }
    match args::rate_below_one(text) {
        Ok(value) => prop_assert!((0.0..1.0).contains(&value)),
        Err(error) => {
            prop_assert!(!error.to_string().is_empty());
            // An error never quotes more than a short prefix of what it was given.
            prop_assert!(error.to_string().len() < 300);
        }
    }
    // The same numbers as `demo --clock-speed`.
    match args::clock_speed(text) {
        Ok(value) => prop_assert!(value.is_finite() && (1.0..=1e9).contains(&value)),
        Err(error) => {
            let typed = matches!(
                error,
                ArgError::ClockSpeedNotANumber(_) | ArgError::ClockSpeed(_)
            );
            prop_assert!(typed, "{text:?}: {error:?}");
            prop_assert!(error.to_string().len() < 300, "{error}");
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum CliInput {
    Url(String),
    UrlWithPassword(String, String),
    Rate(String),
    Retention(u64, u64, u32, bool),
}

fn check_cli(input: CliInput) -> Result<(), TestCaseError> {
    match input {
        CliInput::Url(url) => check_url(&url, None),
        CliInput::UrlWithPassword(url, password) => check_url(&url, Some(&password)),
        CliInput::Rate(text) => check_rate(&text),
        CliInput::Retention(ttl, retention, ahead, force) => {
            match args::retention_config(ttl, retention, ahead, force) {
                Ok(config) => {
                    prop_assert!(config.validate().is_ok());
                    prop_assert!(force || config.ttl >= config.broker_retention);
                }
                Err(error) => prop_assert!(!error.to_string().is_empty()),
            }
            Ok(())
        }
    }
}

fn url_with_password() -> impl Strategy<Value = CliInput> {
    let scheme =
        prop::sample::select(&["postgres", "postgresql", "amqp", "amqps", "mysql", "sqlite"][..]);
    // Any printable text: a password may hold `@`, `/`, `?`, `:`, `=`, `#`.
    let password = "[^\\p{Cc}]{0,24}";
    (
        scheme,
        "[a-z]{1,8}",
        password,
        "[a-z0-9.]{1,12}(:[0-9]{1,6})?",
        "[a-z0-9_/%]{0,12}",
        prop::option::of("[a-z_]{1,10}=[a-z0-9]{0,6}"),
        any::<bool>(),
    )
        .prop_map(|(scheme, user, password, host, path, param, in_query)| {
            let param = param.map(|p| format!("&{p}")).unwrap_or_default();
            if in_query {
                // A query value ends at the next `&`: a real one would be escaped.
                let password =
                    format!("{PASSWORD_MARK}{}{PASSWORD_END}", password.replace('&', ""));
                let url = format!("{scheme}://{user}@{host}/{path}?password={password}{param}");
                CliInput::UrlWithPassword(url, password)
            } else {
                let password = format!("{PASSWORD_MARK}{password}{PASSWORD_END}");
                let url = format!("{scheme}://{user}:{password}@{host}/{path}?x=1{param}");
                CliInput::UrlWithPassword(url, password)
            }
        })
}

#[test]
fn fuzz_cli_url_and_rate_arguments() {
    for (path, bytes) in corpus("cli") {
        let text = String::from_utf8_lossy(&bytes);
        check_url(&text, None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        check_rate(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let strategy = prop_oneof![
        2 => fragments(&["postgres://", "postgresql://", "sqlite:", "amqp://", "u:p@", "@", ":", "/", "?password=", "&", "127.0.0.1", ":5432", ":99999", "%2f", "[::1]"])
            .prop_map(CliInput::Url),
        2 => url_with_password(),
        2 => prop_oneof![
            any::<f64>().prop_map(|f| f.to_string()),
            fragments(&["0", "1", ".", "5", "e", "-", "+", "inf", "NaN", "1e-400", "0x1"]),
        ]
        .prop_map(CliInput::Rate),
        1 => (any::<u64>(), any::<u64>(), any::<u32>(), any::<bool>())
            .prop_map(|(t, r, a, f)| CliInput::Retention(t % 5000, r % 50, a % 20, f)),
        1 => (any::<u64>(), any::<u64>(), any::<u32>(), any::<bool>())
            .prop_map(|(t, r, a, f)| CliInput::Retention(t, r, a, f)),
    ];
    fuzz("cli", strategy, check_cli);
}
