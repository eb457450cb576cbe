//! `sagabox orchestrate`: the library's orchestrator service
//! ([`sagabox::amqp::orchestrate`]) on the store a database URL names.

use std::future::Future;

use sagabox::amqp::{OrchestrateConfig, OrchestrateError, orchestrate};
use sagabox::database::Backend;
use sagabox::{InboxError, PostgresStore, SqliteStore};

/// Connections for the orchestrators' drivers, the start consumers and setup.
const CONNECTIONS: u32 = 16;

/// Opens the store at `url` and drives `config`'s sagas until `shutdown` resolves.
pub(crate) async fn run(
    url: &str,
    config: OrchestrateConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), OrchestrateError> {
    match Backend::of(url)? {
        Backend::Postgres => {
            let store = PostgresStore::connect(url, CONNECTIONS)
                .await
                .map_err(InboxError::from)?;
            orchestrate(store, config, shutdown).await
        }
        Backend::Sqlite => {
            let store = SqliteStore::connect(url, CONNECTIONS)
                .await
                .map_err(InboxError::from)?;
            orchestrate(store, config, shutdown).await
        }
        _ => Err(InboxError::UnsupportedUrl(sagabox::database::redact(url)).into()),
    }
}
