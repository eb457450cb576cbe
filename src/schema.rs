//! [`Schema`]: where sagabox's tables live, so that they never meet a team's own.
//!
//! On PostgreSQL every sagabox table, index, sequence and partition lives in a schema of
//! its own (`sagabox` unless set), and its migrations are recorded in
//! [`MIGRATIONS_TABLE`] inside it, apart from the `_sqlx_migrations` a team's own sqlx
//! migrations use. On SQLite, which has no schemas, the tables live in the `main`
//! database and carry the `sagabox_` prefix, as they do on PostgreSQL.
//!
//! Every statement names its schema (`"sagabox".sagabox_inbox`) rather than relying on a
//! connection's `search_path`: a team's handler runs its own statements on the guard's
//! connection, and a `search_path` that put sagabox's schema first would send the team's
//! unqualified `CREATE TABLE` there. Only the migrations, on a connection of their own
//! that is closed afterwards, run with `search_path` set to the schema.

use std::fmt;
use std::sync::Arc;

/// The table, in the schema, that records which of sagabox's migrations have run.
pub const MIGRATIONS_TABLE: &str = "sagabox_migrations";

/// The longest name PostgreSQL keeps whole (`NAMEDATALEN` − 1 bytes).
const MAX_NAME_BYTES: usize = 63;

/// A schema name that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid schema name {name:?}: {reason}; use 1 to 63 lowercase ASCII letters, digits and \
     underscores, starting with a letter or an underscore (for example sagabox or payments_sagabox)"
)]
pub struct SchemaError {
    /// The name given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// The schema that holds sagabox's tables: `sagabox` by default on PostgreSQL (settable,
/// for several installations in one database), `main` on SQLite.
///
/// Names are plain lowercase identifiers, so that the schema is spelled the same by
/// sagabox, `psql` and a team's own queries, and is quoted in every statement (a name
/// such as `user` is a keyword).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Schema {
    name: Arc<str>,
    quoted: Arc<str>,
}

impl Schema {
    /// The schema sagabox uses on PostgreSQL unless told otherwise.
    pub const DEFAULT_NAME: &'static str = "sagabox";

    /// A schema called `name`: 1 to 63 lowercase ASCII letters, digits and underscores,
    /// not starting with a digit, and not `pg_…` (reserved by PostgreSQL).
    pub fn new(name: impl Into<String>) -> Result<Self, SchemaError> {
        let name = name.into();
        let refuse = |reason| {
            Err(SchemaError {
                name: name.clone(),
                reason,
            })
        };
        if name.is_empty() {
            return refuse("it is empty");
        }
        if name.len() > MAX_NAME_BYTES {
            return refuse("it is longer than 63 bytes");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return refuse("it holds a character other than a-z, 0-9 and _");
        }
        if name.as_bytes()[0].is_ascii_digit() {
            return refuse("it starts with a digit");
        }
        if name.starts_with("pg_") {
            return refuse("names starting with pg_ are reserved by PostgreSQL");
        }
        Ok(Self::trusted(&name))
    }

    /// SQLite's: the `main` database of the file.
    pub fn sqlite() -> Self {
        Self::trusted("main")
    }

    fn trusted(name: &str) -> Self {
        Self {
            name: name.into(),
            quoted: format!("\"{name}\"").into(),
        }
    }

    /// The name, unquoted.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name quoted for SQL: `"sagabox"`.
    pub fn quoted(&self) -> &str {
        &self.quoted
    }

    /// `table` in this schema, ready for SQL: `"sagabox".sagabox_inbox`.
    pub fn table(&self, table: &str) -> String {
        format!("{}.{table}", self.quoted)
    }

    /// `sql` with every `{schema}` replaced by this schema's quoted name. The statements
    /// shared by both databases are written this way.
    pub fn sql(&self, sql: &str) -> String {
        sql.replace("{schema}", &self.quoted)
    }
}

impl Default for Schema {
    /// The PostgreSQL default, `sagabox`.
    fn default() -> Self {
        Self::trusted(Self::DEFAULT_NAME)
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Schema({})", self.name)
    }
}

impl std::str::FromStr for Schema {
    type Err = SchemaError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::new(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lowercase_names_are_taken_and_quoted() {
        let schema = Schema::new("payments_sagabox2").unwrap();
        assert_eq!(schema.name(), "payments_sagabox2");
        assert_eq!(
            schema.table("sagabox_inbox"),
            "\"payments_sagabox2\".sagabox_inbox"
        );
        assert_eq!(
            schema.sql("SELECT 1 FROM {schema}.sagabox_outbox o, {schema}.x"),
            "SELECT 1 FROM \"payments_sagabox2\".sagabox_outbox o, \"payments_sagabox2\".x"
        );
        assert_eq!(Schema::default().name(), "sagabox");
        assert_eq!(Schema::sqlite().quoted(), "\"main\"");
    }

    #[test]
    fn names_sql_could_misread_are_refused_with_the_reason() {
        for (name, reason) in [
            ("", "empty"),
            ("Sagabox", "other than"),
            ("saga box", "other than"),
            ("sagabox\"; DROP TABLE x; --", "other than"),
            ("1sagabox", "digit"),
            ("pg_sagabox", "reserved"),
            (&"s".repeat(64), "longer"),
        ] {
            let error = Schema::new(name).unwrap_err();
            assert!(error.reason.contains(reason), "{name:?}: {error}");
            assert!(error.to_string().contains("for example sagabox"), "{error}");
        }
        assert!(Schema::new("s".repeat(63)).is_ok());
        assert!(Schema::new("_x").is_ok());
    }
}
