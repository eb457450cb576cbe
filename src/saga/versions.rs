//! Definition versions: every version of a saga definition that an orchestrator runs is
//! stored ([`SagaStore::register_definition`]), and each saga is driven on the version
//! it started under ([`SagaInstance::definition_version`](crate::saga::SagaInstance)),
//! read back from the database when it is not the orchestrator's own. Changing a saga's
//! steps while sagas run is then safe: raise `version` in the TOML, restart the
//! orchestrators, and the sagas already running finish on their old steps.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::saga::{DefinitionError, SagaDefinition, SagaStore};

/// Why a definition was not registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The database holds another definition under the same name and version.
    #[error(
        "saga `{name}` version {version} is stored with other steps or settings than this \
         definition: sagas already started on it would change course. Raise `version` in \
         the definition (the running sagas finish on the stored one), or undo the change"
    )]
    Changed {
        /// The saga.
        name: String,
        /// The version both claim.
        version: u32,
    },
    /// The database could not be read or written.
    #[error("cannot register the saga definition: {0}")]
    Store(#[from] sqlx::Error),
}

/// Why a saga's definition version could not be found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionError {
    /// No orchestrator ever registered that version.
    #[error(
        "saga `{name}` version {version} is not stored: start an orchestrator with that \
         definition version once, so that its sagas can be driven"
    )]
    Unknown {
        /// The saga.
        name: String,
        /// The missing version.
        version: u32,
    },
    /// The stored text no longer reads as a definition (a newer or older sagabox wrote it).
    #[error("saga `{name}` version {version} is stored but invalid: {source}")]
    Invalid {
        /// The saga.
        name: String,
        /// The version.
        version: u32,
        /// Why it does not read.
        #[source]
        source: DefinitionError,
    },
    /// The database could not be read.
    #[error("cannot read saga definition versions: {0}")]
    Store(#[from] sqlx::Error),
}

/// The versions of one saga's definition an orchestrator drives: its own (current) one,
/// and the older or newer ones its sagas started under, read from the store once each.
#[derive(Debug)]
pub struct Definitions {
    current: Arc<SagaDefinition>,
    others: Mutex<HashMap<u32, Arc<SagaDefinition>>>,
}

impl Definitions {
    /// The versions of `current`'s saga, starting new sagas on `current`.
    pub fn new(current: Arc<SagaDefinition>) -> Self {
        Self {
            current,
            others: Mutex::new(HashMap::new()),
        }
    }

    /// The version new sagas start on.
    pub fn current(&self) -> &Arc<SagaDefinition> {
        &self.current
    }

    /// Version `version` of the saga, from the store when it is not the current one.
    pub async fn version<St: SagaStore>(
        &self,
        store: &St,
        version: u32,
    ) -> Result<Arc<SagaDefinition>, VersionError> {
        if version == self.current.version() {
            return Ok(Arc::clone(&self.current));
        }
        if let Some(known) = self.lock().get(&version) {
            return Ok(Arc::clone(known));
        }
        let name = self.current.name();
        let text = store
            .stored_definition(name, version)
            .await?
            .ok_or_else(|| VersionError::Unknown {
                name: name.to_owned(),
                version,
            })?;
        let definition =
            SagaDefinition::from_toml_str(&text).map_err(|source| VersionError::Invalid {
                name: name.to_owned(),
                version,
                source,
            })?;
        let definition = Arc::new(definition);
        self.lock().insert(version, Arc::clone(&definition));
        Ok(definition)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<SagaDefinition>>> {
        self.others.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Version `version` of saga `name`'s definition, as the orchestrator that ran it stored
/// it.
pub async fn stored_definition<St: SagaStore>(
    store: &St,
    name: &str,
    version: u32,
) -> Result<SagaDefinition, VersionError> {
    let text = store
        .stored_definition(name, version)
        .await?
        .ok_or_else(|| VersionError::Unknown {
            name: name.to_owned(),
            version,
        })?;
    SagaDefinition::from_toml_str(&text).map_err(|source| VersionError::Invalid {
        name: name.to_owned(),
        version,
        source,
    })
}
