//! What the library's log events and error messages carry: lists as JSON text, and URLs
//! without their passwords.
//!
//! A field whose value is a list (the queues a consumer serves, the months a pruner pass
//! created or dropped) is logged as JSON text with [`json_list`], and named in
//! [`LIST_FIELDS`] so that a JSON log formatter can write it as a JSON list rather than as
//! a string. A URL (a database's, a broker's) reaches a log line, an error or a report
//! only through [`redact`].

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

/// `url` with every password replaced by `***`: the one in the user info
/// (`postgres://user:secret@host/db`, `amqp://user:secret@host/vhost`) and the value of
/// any query parameter whose name ends in `password` (`?password=secret`).
///
/// Meant for text that reaches logs, errors and reports, so it errs on the side of hiding
/// and never fails, whatever the input: the user info runs to the **last** `@` (a
/// password may hold an unescaped `/`, `?`, `@` or `:`), a query password runs to the
/// next `&`, and where the two readings overlap both are hidden.
pub fn redact(url: &str) -> String {
    let mut hidden = password_spans(url);
    hidden.sort_unstable();
    let mut out = String::with_capacity(url.len());
    let mut shown_from = 0;
    for (start, end) in hidden {
        if end <= shown_from {
            continue;
        }
        if start >= shown_from {
            out.push_str(&url[shown_from..start]);
            out.push_str("***");
        }
        shown_from = end;
    }
    out.push_str(&url[shown_from..]);
    out
}

/// `text` with every password of `url` (as [`redact`] finds them) replaced by `***`: a
/// parser's message may quote the part of a URL it choked on.
pub fn scrub(text: &str, url: &str) -> String {
    let mut text = text.to_owned();
    for (start, end) in password_spans(url) {
        let secret = &url[start..end];
        if !secret.is_empty() {
            text = text.replace(secret, "***");
        }
    }
    text
}

/// Where the passwords of `url` are: the user info's, and every query parameter whose
/// name ends in `password`.
fn password_spans(url: &str) -> Vec<(usize, usize)> {
    let mut hidden: Vec<(usize, usize)> = Vec::new();
    // The user info's password: between the first `:` after the scheme and the last `@`.
    if let Some(scheme_end) = url.find("://") {
        let start = scheme_end + 3;
        let rest = &url[start..];
        if let Some(at) = rest.rfind('@')
            && let Some(colon) = rest[..at].find(':')
            && !rest[..colon].contains(['/', '?', '#'])
        {
            hidden.push((start + colon + 1, start + at));
        }
    }
    // Query passwords: after any `?` or `&`, `…password=` up to the next `&`.
    for (delimiter, _) in url.match_indices(['?', '&']) {
        let param_start = delimiter + 1;
        let param_end = url[param_start..]
            .find('&')
            .map_or(url.len(), |i| param_start + i);
        let param = &url[param_start..param_end];
        if let Some(eq) = param.find('=')
            && param[..eq].to_ascii_lowercase().ends_with("password")
        {
            hidden.push((param_start + eq + 1, param_end));
        }
    }
    hidden
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

    #[test]
    fn amqp_urls_and_awkward_passwords_are_redacted() {
        let cases = [
            (
                "amqp://guest:guest-pw@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "amqps://u:p@rabbit/vhost?heartbeat=10",
                "amqps://u:***@rabbit/vhost?heartbeat=10",
            ),
            // Unescaped `/`, `@` and `:` in the password.
            ("postgres://u:pa/ss@db/x", "postgres://u:***@db/x"),
            (
                "postgres://u:p@ss:w@db:5432/x",
                "postgres://u:***@db:5432/x",
            ),
            // A password in the query string.
            (
                "postgres://u@db/x?sslmode=disable&password=qwerty&application_name=a",
                "postgres://u@db/x?sslmode=disable&password=***&application_name=a",
            ),
            ("postgres://u:pa?ss@db/x", "postgres://u:***@db/x"),
            // Both readings overlap: both hidden.
            ("postgres://u:pw?password=z@h/p?x=1", "postgres://u:***"),
            ("postgres://u@h:5432/d?password=a@b", "postgres://u@h:***"),
            (
                "postgres://db/x?PassWord=qwerty",
                "postgres://db/x?PassWord=***",
            ),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact(url), redacted, "{url}");
        }
    }

    #[test]
    fn a_message_quoting_a_url_loses_its_passwords() {
        let url = "postgres://u:s3cret@db:5432/x?sslpassword=k3y&sslmode=require";
        let message = "invalid port in postgres://u:s3cret@db:5432 (sslpassword=k3y)";
        assert_eq!(
            scrub(message, url),
            "invalid port in postgres://u:***@db:5432 (sslpassword=***)"
        );
        // Nothing to hide: the text is unchanged.
        assert_eq!(scrub("bad port", "sqlite:x.db"), "bad port");
    }
}
