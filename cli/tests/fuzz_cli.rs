//! The `sagabox` command's URL, rate and retention arguments, fuzzed with proptest like
//! the library's inputs (`tests/fuzz.rs` at the workspace root, whose harness this
//! shares): nothing panics, every rejection is a typed error that never quotes a
//! password, and what is accepted obeys the rules. Corpus: `tests/corpus/cli/`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/fuzzing/mod.rs"]
mod fuzzing;

use fuzzing::{corpus, fragments, fuzz};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use sagabox::logging::redact;
use sagabox_cli::args::{self, ArgError};

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
