//! The JSON log line: `{"timestamp", "level", "fields", "target", "span"}`, one object per
//! event, with the fields of the event's span under `span`. An event field named in
//! [`LIST_FIELDS`](sagabox::logging::LIST_FIELDS) whose text is a JSON list (logged with
//! [`json_list`](sagabox::logging::json_list)) is written as that list, so a shipper reads
//! `"queues": ["a", "b"]`, not a string to parse again. No other field is ever turned
//! into JSON: a message id that happens to read `[1]` stays a string, so every field
//! keeps one type from line to line.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The event formatter behind `--log-format json`.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let mut fields = Map::new();
        event.record(&mut Fields(&mut fields));
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            Value::String(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
        );
        line.insert("level".into(), Value::String(metadata.level().to_string()));
        line.insert("fields".into(), Value::Object(fields));
        line.insert("target".into(), Value::String(metadata.target().to_owned()));
        // A span's closing line is an event whose parent is that span.
        let span = event
            .parent()
            .and_then(|id| ctx.span(id))
            .or_else(|| ctx.lookup_current());
        if let Some(span) = span {
            // The span's fields were recorded as a JSON object by `JsonFields`.
            let mut object = span
                .extensions()
                .get::<FormattedFields<N>>()
                .and_then(|recorded| serde_json::from_str::<Map<String, Value>>(recorded).ok())
                .unwrap_or_default();
            object.insert("name".into(), Value::String(span.name().to_owned()));
            line.insert("span".into(), Value::Object(object));
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// A string holding a JSON list becomes that list.
fn lift(value: &mut Value) {
    if let Value::String(text) = value
        && text.starts_with('[')
        && let Ok(parsed @ Value::Array(_)) = serde_json::from_str::<Value>(text)
    {
        *value = parsed;
    }
}

/// Records an event's fields into a JSON map.
struct Fields<'a>(&'a mut Map<String, Value>);

impl Fields<'_> {
    fn put(&mut self, field: &Field, mut value: Value) {
        if sagabox::logging::LIST_FIELDS.contains(&field.name()) {
            lift(&mut value);
        }
        self.0.insert(field.name().to_owned(), value);
    }
}

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::from(value));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::from(value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::from(value.to_string()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::from(format!("{value:?}")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::format::JsonFields;

    /// Log lines written into memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(emit: impl FnOnce()) -> Vec<Value> {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(JsonFields::new())
            .event_format(JsonLines)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    #[test]
    fn list_fields_are_lists_and_every_other_field_keeps_its_text() {
        let lines = logged(|| {
            let span = tracing::info_span!("inbox.process", message_id = "[1]");
            let _entered = span.enter();
            tracing::info!(
                queues = %sagabox::logging::json_list(["a.email", "a.payment"]),
                message_id = "[2]",
                detail = r#"{"k":1}"#,
                attempt = 3,
                "serving"
            );
        });
        let line = &lines[0];
        assert_eq!(
            line["fields"]["queues"],
            json!(["a.email", "a.payment"]),
            "{line}"
        );
        assert_eq!(line["fields"]["message_id"], json!("[2]"), "{line}");
        assert_eq!(line["fields"]["detail"], json!(r#"{"k":1}"#), "{line}");
        assert_eq!(line["fields"]["attempt"], json!(3), "{line}");
        assert_eq!(line["fields"]["message"], json!("serving"), "{line}");
        assert_eq!(line["span"]["message_id"], json!("[1]"), "{line}");
        assert_eq!(line["span"]["name"], json!("inbox.process"), "{line}");
        assert_eq!(line["level"], json!("INFO"), "{line}");
    }

    #[test]
    fn json_text_of_a_list_is_lifted_and_other_text_is_not() {
        for (text, expected) in [
            (r#"["a","b"]"#, json!(["a", "b"])),
            (r#"{"k":1}"#, json!(r#"{"k":1}"#)),
            ("[not json", json!("[not json")),
            ("plain", json!("plain")),
            ("42", json!("42")),
        ] {
            let mut value = Value::from(text);
            lift(&mut value);
            assert_eq!(value, expected, "{text}");
        }
    }
}
