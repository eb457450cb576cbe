//! Fuzzed input, with proptest (the toolchain is stable: no `cargo fuzz`): envelope
//! decoding from bytes, `MessageId`/`ConsumerType` construction and saga definitions
//! (`sagas/*.toml`); the CLI's arguments are fuzzed in `cli/tests/fuzz_cli.rs`. Each target checks that
//! nothing panics, that every rejection is a typed error with a message, and that
//! what is accepted obeys the rules.
//!
//! Each target first replays its corpus, `tests/corpus/<target>/*` (inputs that once
//! mattered: keep adding the minimal failing input a run prints), then runs generated
//! cases: at least `FUZZ_CASES` (20,000 by default), and then more until `FUZZ_SECONDS`
//! have passed (0 by default). A long run outside CI:
//!
//! ```text
//! FUZZ_SECONDS=600 cargo test --release --test fuzz -- --nocapture --test-threads 1
//! ```

#![allow(clippy::unwrap_used)]

mod fuzzing;

use std::path::PathBuf;

use fuzzing::{corpus, fragments, fuzz};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use sagabox::saga::SagaDefinition;
use sagabox::{ConsumerType, Envelope, KeyError, MAX_KEY_BYTES, MessageId};

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
            let mut text = include_str!("../sagas/checkout.toml").to_owned();
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
