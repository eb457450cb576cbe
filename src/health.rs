//! Health for orchestrators and container platforms: is the process alive, and is it
//! ready — its database answers and every consumer it runs is connected and consuming.
//!
//! The process's parts report to one registry, [`global`]: a consumer takes a
//! [`ConsumerReadiness`] when it starts and marks it consuming once its subscription is
//! open (and not consuming while its connection is lost); a service registers its
//! database with [`Health::database`]. Both leave the registry when dropped, so a
//! consumer that stopped on request no longer counts. [`Health::readiness`] asks them
//! all; the metrics endpoint answers `/readyz` with it (`/healthz` only says the process
//! serves HTTP).
//!
//! A process with nothing registered is not ready: until its consumers have subscribed,
//! it is not doing its job yet.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

/// How long a database has to answer a readiness check.
pub const DATABASE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A database check: connect (or take a pooled connection) and ping.
type Check =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

#[derive(Default)]
struct Registry {
    consumers: BTreeMap<u64, (String, Arc<AtomicBool>)>,
    databases: BTreeMap<u64, (String, Check)>,
}

/// The parts of a process that its readiness depends on.
#[derive(Clone, Default)]
pub struct Health {
    registry: Arc<Mutex<Registry>>,
    next_id: Arc<AtomicU64>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let registry = self.lock();
        f.debug_struct("Health")
            .field("consumers", &registry.consumers.len())
            .field("databases", &registry.databases.len())
            .finish()
    }
}

/// The registry of this process, which the metrics endpoint's `/readyz` reads.
pub fn global() -> &'static Health {
    static GLOBAL: OnceLock<Health> = OnceLock::new();
    GLOBAL.get_or_init(Health::default)
}

/// One consumer's part in its process's readiness; leaves the registry when dropped.
#[derive(Debug)]
pub struct ConsumerReadiness {
    health: Health,
    id: u64,
    consuming: Arc<AtomicBool>,
}

impl ConsumerReadiness {
    /// Marks the consumer consuming (its subscription is open on a live connection) or
    /// not (connecting, or its connection was lost).
    pub fn set_consuming(&self, consuming: bool) {
        self.consuming.store(consuming, Ordering::Relaxed);
    }
}

impl Drop for ConsumerReadiness {
    fn drop(&mut self) {
        self.health.lock().consumers.remove(&self.id);
    }
}

/// A database's part in its process's readiness; leaves the registry when dropped.
#[derive(Debug)]
pub struct DatabaseCheck {
    health: Health,
    id: u64,
}

impl Drop for DatabaseCheck {
    fn drop(&mut self) {
        self.health.lock().databases.remove(&self.id);
    }
}

/// What [`Health::readiness`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// Each part, by name, with `None` when it is ready or why it is not.
    pub parts: Vec<(String, Option<String>)>,
}

impl Readiness {
    /// Ready: at least one part, and every part ready.
    pub fn is_ready(&self) -> bool {
        !self.parts.is_empty() && self.parts.iter().all(|(_, problem)| problem.is_none())
    }

    /// One line per part (`ok consumer payment`, `not ready database: …`), or a line
    /// saying nothing is registered yet.
    pub fn report(&self) -> String {
        if self.parts.is_empty() {
            return "not ready: no consumer or database registered yet\n".to_owned();
        }
        self.parts
            .iter()
            .map(|(name, problem)| match problem {
                None => format!("ok {name}\n"),
                Some(problem) => format!("not ready {name}: {problem}\n"),
            })
            .collect()
    }
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a consumer called `name` (its queue or stream), not yet consuming.
    pub fn consumer(&self, name: impl Into<String>) -> ConsumerReadiness {
        let id = self.id();
        let consuming = Arc::new(AtomicBool::new(false));
        self.lock()
            .consumers
            .insert(id, (name.into(), Arc::clone(&consuming)));
        ConsumerReadiness {
            health: self.clone(),
            id,
            consuming,
        }
    }

    /// Registers a database called `name`, ready while `check` succeeds within
    /// [`DATABASE_CHECK_TIMEOUT`].
    pub fn database<F, Fut>(&self, name: impl Into<String>, check: F) -> DatabaseCheck
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        let id = self.id();
        let check: Check = Arc::new(move || Box::pin(check()));
        self.lock().databases.insert(id, (name.into(), check));
        DatabaseCheck {
            health: self.clone(),
            id,
        }
    }

    /// Registers the database of `store` (called `inbox database`), ready while it
    /// hands out a connection that answers a ping.
    pub fn store<S: crate::store::InboxStore + Clone + 'static>(&self, store: &S) -> DatabaseCheck {
        let store = store.clone();
        self.database("inbox database", move || {
            let store = store.clone();
            async move {
                store
                    .ping()
                    .await
                    .map_err(|error| crate::connection::describe(&error))
            }
        })
    }

    /// Asks every registered part, the databases concurrently.
    pub async fn readiness(&self) -> Readiness {
        // Read under the lock, which no await may hold.
        let (consumers, databases) = {
            let registry = self.lock();
            let consumers: Vec<(String, bool)> = registry
                .consumers
                .values()
                .map(|(name, consuming)| (name.clone(), consuming.load(Ordering::Relaxed)))
                .collect();
            let databases: Vec<(String, Check)> = registry
                .databases
                .values()
                .map(|(name, check)| (name.clone(), Arc::clone(check)))
                .collect();
            (consumers, databases)
        };
        let checks = databases.into_iter().map(|(name, check)| async move {
            let answer = tokio::time::timeout(DATABASE_CHECK_TIMEOUT, check()).await;
            let problem = match answer {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error),
                Err(_) => Some(format!(
                    "no answer within {} s",
                    DATABASE_CHECK_TIMEOUT.as_secs()
                )),
            };
            (format!("database {name}"), problem)
        });
        let mut parts = futures_util::future::join_all(checks).await;
        parts.extend(consumers.into_iter().map(|(name, consuming)| {
            let problem = (!consuming).then(|| "not connected and consuming".to_owned());
            (format!("consumer {name}"), problem)
        }));
        Readiness { parts }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ready_only_with_parts_and_every_part_ready() {
        let health = Health::default();
        assert!(!health.readiness().await.is_ready(), "nothing registered");

        let consumer = health.consumer("sagabox.payment");
        let database = health.database("orders", || async { Ok(()) });
        let readiness = health.readiness().await;
        assert!(!readiness.is_ready());
        assert!(
            readiness
                .report()
                .contains("not ready consumer sagabox.payment")
        );

        consumer.set_consuming(true);
        assert!(health.readiness().await.is_ready());

        let failing = health.database("other", || async { Err("refused".to_owned()) });
        let readiness = health.readiness().await;
        assert!(!readiness.is_ready());
        assert!(
            readiness
                .report()
                .contains("not ready database other: refused")
        );

        drop(failing);
        drop(consumer);
        assert!(
            health.readiness().await.is_ready(),
            "only the database left"
        );
        drop(database);
        assert!(!health.readiness().await.is_ready());
    }

    #[tokio::test(start_paused = true)]
    async fn a_database_that_does_not_answer_is_not_ready() {
        let health = Health::default();
        let _database = health.database("stuck", std::future::pending);
        let readiness = health.readiness().await;
        assert!(!readiness.is_ready());
        assert!(
            readiness.report().contains("no answer within 2 s"),
            "{readiness:?}"
        );
    }
}
