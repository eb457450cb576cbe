//! Options from the environment, the way services are deployed: every option of the
//! service and operator commands also reads `SAGABOX_<OPTION>` (listed in `--help`), and
//! each option that may hold a secret also reads `SAGABOX_<OPTION>_FILE`, the path of a
//! file holding it (a mounted container secret), so a password never has to be on a
//! command line, where `ps` shows it to every user of the machine.
//!
//! A flag on the command line wins over the variable, and the variable over its `_FILE`
//! form; giving both the variable and its `_FILE` form is refused as ambiguous.

use std::ffi::OsString;

use clap::Command;

/// The subcommands whose every option also reads `SAGABOX_<OPTION>`.
pub(crate) const FROM_ENVIRONMENT: [&str; 6] = [
    "serve",
    "orchestrate",
    "console",
    "migrate",
    "prune",
    "inspect",
];

/// The options that may hold a secret (a password in a URL, the console's token): their
/// values from the environment stay out of `--help`, and each also reads
/// `SAGABOX_<OPTION>_FILE`.
pub(crate) const SECRETS: [&str; 6] = [
    "database-url",
    "transport",
    "amqp-url",
    "nats-url",
    "token",
    "amqp-management-url",
];

/// Why the environment could not be read into the options.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EnvironmentError {
    /// A `_FILE` variable names a file that cannot be read.
    #[error(
        "{variable}={path}: cannot read the file ({source}); check the path and that this process may read it"
    )]
    Unreadable {
        /// The variable.
        variable: String,
        /// The file it names.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds nothing but white space.
    #[error("{variable}={path}: the file is empty")]
    Empty {
        /// The variable.
        variable: String,
        /// The file it names.
        path: String,
    },
    /// Both the variable and its `_FILE` form are set.
    #[error("both {variable} and {variable}_FILE are set: give one")]
    Ambiguous {
        /// The variable.
        variable: String,
    },
}

/// The variable an option reads: `--queue-prefix` → `SAGABOX_QUEUE_PREFIX`.
pub(crate) fn variable(long: &str) -> String {
    format!("SAGABOX_{}", long.replace('-', "_").to_ascii_uppercase())
}

/// `command` with every option of [`FROM_ENVIRONMENT`]'s subcommands reading its
/// variable, and every [`SECRETS`] option of any subcommand taking its value from the
/// file its `_FILE` variable names, when that is set. `read` reads a variable (the
/// process's environment, or a test's).
pub(crate) fn apply(
    mut command: Command,
    read: &impl Fn(&str) -> Option<OsString>,
) -> Result<Command, EnvironmentError> {
    for name in FROM_ENVIRONMENT {
        if command.find_subcommand(name).is_some() {
            command = command.mut_subcommand(name, with_variables);
        }
    }
    let mut secrets = Vec::new();
    for long in SECRETS {
        let variable = variable(long);
        let file_variable = format!("{variable}_FILE");
        let Some(path) = read(&file_variable) else {
            continue;
        };
        if read(&variable).is_some() {
            return Err(EnvironmentError::Ambiguous { variable });
        }
        let path = path.to_string_lossy().into_owned();
        let text =
            std::fs::read_to_string(&path).map_err(|source| EnvironmentError::Unreadable {
                variable: file_variable.clone(),
                path: path.clone(),
                source,
            })?;
        let value = text.trim().to_owned();
        if value.is_empty() {
            return Err(EnvironmentError::Empty {
                variable: file_variable,
                path,
            });
        }
        secrets.push((long, value));
    }
    Ok(with_secrets(command, &secrets))
}

/// Every long option of `command` without a variable of its own reads
/// [`variable`]`(long)`; the values of [`SECRETS`] stay out of `--help`.
fn with_variables(mut command: Command) -> Command {
    let longs: Vec<(clap::Id, String, bool)> = command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            (!matches!(long, "help" | "version")).then(|| {
                (
                    arg.get_id().clone(),
                    long.to_owned(),
                    arg.get_env().is_some(),
                )
            })
        })
        .collect();
    for (id, long, has_env) in longs {
        let secret = SECRETS.contains(&long.as_str());
        command = command.mut_arg(id, |arg| {
            let arg = if has_env {
                arg
            } else {
                arg.env(variable(&long))
            };
            arg.hide_env_values(secret)
        });
    }
    command
}

/// `secrets` (an option's long name and the value read from its file) as the defaults
/// of those options, in `command` and all its subcommands, kept out of `--help`.
fn with_secrets(mut command: Command, secrets: &[(&str, String)]) -> Command {
    for (long, value) in secrets {
        let ids: Vec<clap::Id> = command
            .get_arguments()
            .filter(|arg| arg.get_long() == Some(*long))
            .map(|arg| arg.get_id().clone())
            .collect();
        for id in ids {
            command = command.mut_arg(id, |arg| {
                arg.default_value(value.clone())
                    .hide_default_value(true)
                    .required(false)
            });
        }
    }
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |sub| with_secrets(sub, secrets));
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn command() -> Command {
        Command::new("sagabox")
            .subcommand(
                Command::new("serve")
                    .arg(
                        Arg::new("queue_prefix")
                            .long("queue-prefix")
                            .default_value("sagabox"),
                    )
                    .arg(Arg::new("database_url").long("database-url").required(true))
                    .arg(
                        Arg::new("dry_run")
                            .long("dry-run")
                            .action(ArgAction::SetTrue),
                    ),
            )
            .subcommand(
                Command::new("demo")
                    .arg(Arg::new("orders").long("orders").default_value("1000"))
                    .arg(Arg::new("database_url").long("database-url").required(true)),
            )
    }

    fn environment(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + use<> {
        let pairs: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), OsString::from(value)))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
        }
    }

    #[test]
    fn every_option_of_a_service_command_names_its_variable() {
        let command = apply(command(), &environment(&[])).unwrap();
        let serve = command.find_subcommand("serve").unwrap();
        let env = |id: &str| {
            serve
                .get_arguments()
                .find(|arg| arg.get_id() == id)
                .and_then(|arg| arg.get_env())
                .map(|env| env.to_string_lossy().into_owned())
        };
        assert_eq!(env("queue_prefix").as_deref(), Some("SAGABOX_QUEUE_PREFIX"));
        assert_eq!(env("database_url").as_deref(), Some("SAGABOX_DATABASE_URL"));
        assert_eq!(env("dry_run").as_deref(), Some("SAGABOX_DRY_RUN"));
        // Other commands are left as they are.
        let demo = command.find_subcommand("demo").unwrap();
        assert!(demo.get_arguments().all(|arg| arg.get_env().is_none()));
    }

    #[test]
    fn a_secret_is_read_from_its_file_and_a_flag_still_wins() {
        let dir = std::env::temp_dir().join(format!("sagabox-env-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("url");
        std::fs::write(&secret, "postgres://app:s3cret@db/x\n").unwrap();
        let path = secret.display().to_string();
        let read = environment(&[("SAGABOX_DATABASE_URL_FILE", &path)]);
        let matches = apply(command(), &read)
            .unwrap()
            .try_get_matches_from(["sagabox", "demo"])
            .unwrap();
        let (_, demo) = matches.subcommand().unwrap();
        assert_eq!(
            demo.get_one::<String>("database_url").unwrap(),
            "postgres://app:s3cret@db/x"
        );
        let help = apply(command(), &read)
            .unwrap()
            .find_subcommand_mut("demo")
            .unwrap()
            .render_help()
            .to_string();
        assert!(!help.contains("s3cret"), "{help}");
        let matches = apply(command(), &read)
            .unwrap()
            .try_get_matches_from(["sagabox", "demo", "--database-url", "sqlite:a.db"])
            .unwrap();
        let (_, demo) = matches.subcommand().unwrap();
        assert_eq!(
            demo.get_one::<String>("database_url").unwrap(),
            "sqlite:a.db"
        );

        let both = environment(&[
            ("SAGABOX_DATABASE_URL_FILE", &path),
            ("SAGABOX_DATABASE_URL", "sqlite:b.db"),
        ]);
        let error = apply(command(), &both).unwrap_err();
        assert!(error.to_string().contains("give one"), "{error}");
        let missing = environment(&[("SAGABOX_TRANSPORT_FILE", "/nonexistent/secret")]);
        let error = apply(command(), &missing).unwrap_err();
        assert!(error.to_string().contains("/nonexistent/secret"), "{error}");
        std::fs::write(&secret, "\n").unwrap();
        let error = apply(command(), &read).unwrap_err();
        assert!(error.to_string().contains("empty"), "{error}");
        std::fs::remove_dir_all(dir).ok();
    }
}
