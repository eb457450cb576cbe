//! `sagabox orchestrate`: the library's orchestrator service
//! ([`sagabox::amqp::orchestrate`]) on the store a database URL names.

use std::future::Future;

use sagabox::amqp::{OrchestrateConfig, OrchestrateError, orchestrate};
use sagabox::database::Backend;
use sagabox::{InboxError, PostgresStore, SqliteStore};

/// Opens the store at `url` (sagabox's tables in `schema`, on PostgreSQL) with a pool of up to `connections` (the orchestrators'
/// drivers, the start consumers and setup share them) and drives `config`'s sagas until
/// `shutdown` resolves.
pub(crate) async fn run(
    url: &str,
    schema: &sagabox::Schema,
    connections: u32,
    config: OrchestrateConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), OrchestrateError> {
    match Backend::of(url)? {
        Backend::Postgres => {
            let store = PostgresStore::connect(url, connections)
                .await
                .map_err(InboxError::from)?
                .with_schema(schema.clone());
            orchestrate(store, config, shutdown).await
        }
        Backend::Sqlite => {
            let store = SqliteStore::connect(url, connections)
                .await
                .map_err(InboxError::from)?;
            orchestrate(store, config, shutdown).await
        }
        _ => Err(InboxError::UnsupportedUrl(sagabox::database::redact(url)).into()),
    }
}
