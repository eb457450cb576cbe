//! How the library's log events carry lists: a field whose value is a list (the queues
//! a consumer serves, the months a pruner pass created or dropped) is logged as JSON
//! text with [`json_list`], and named in [`LIST_FIELDS`] so that a JSON log formatter
//! can write it as a JSON list rather than as a string.

use std::fmt;

use serde_json::Value;

/// The event fields that carry [`json_list`]'s text. Only these: any other field is a
/// plain string, even when it happens to read like a list.
pub const LIST_FIELDS: &[&str] = &["queues", "created", "dropped"];

/// A list as a log field's value: JSON text, which a JSON log line can carry as a JSON
/// list for a field named in [`LIST_FIELDS`], and a human line shows as `["a","b"]`. Use
/// it with `%`: `tracing::info!(queues = %json_list(&queues), "serving")`.
pub fn json_list<T: fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    Value::Array(
        items
            .into_iter()
            .map(|item| Value::String(item.to_string()))
            .collect(),
    )
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_json_text_and_its_items_stay_strings() {
        assert_eq!(
            json_list(["2026-11", "2026-12"]),
            r#"["2026-11","2026-12"]"#
        );
        assert_eq!(json_list([1, 2]), r#"["1","2"]"#);
        assert_eq!(json_list(Vec::<String>::new()), "[]");
    }
}
