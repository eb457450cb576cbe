//! Errors of the inbox ([`InboxError`]) and of one guarded call ([`GuardError`]).

use chrono::{DateTime, Utc};

use crate::envelope::{ConsumerType, MessageId};
use crate::inbox::ConfigError;
use crate::month::{Month, MonthError};

/// What went wrong in the inbox itself (not in the caller's handler).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The message was filed longer ago than the TTL: its inbox row may already be pruned,
    /// so it cannot be deduplicated safely and is refused instead of applied blindly.
    #[error(
        "message {message_id} dates from {filed_at}, before the deduplication window that starts at {window_start}: \
         it may already have been processed and its inbox row pruned, so it is refused; \
         raise the inbox ttl above the broker's redelivery window, or dead-letter it"
    )]
    Expired {
        /// The refused message.
        message_id: MessageId,
        /// The time the message is filed under (UUIDv7 time or publish time).
        filed_at: DateTime<Utc>,
        /// The oldest time still inside the window (now − ttl).
        window_start: DateTime<Utc>,
    },
    /// The message's time lies further in the future than the allowed clock skew.
    #[error(
        "message {message_id} dates from {filed_at}, more than the allowed skew ahead of now ({now}): \
         fix the producer's clock or raise max_future_skew"
    )]
    PublishedInFuture {
        /// The refused message.
        message_id: MessageId,
        /// The time the message is filed under.
        filed_at: DateTime<Utc>,
        /// The inbox's current time.
        now: DateTime<Utc>,
    },
    /// A time outside what partitions can name.
    #[error("message time out of range: {0}")]
    Month(#[from] MonthError),
    /// A configuration the inbox refuses.
    #[error("invalid inbox configuration: {0}")]
    Config(#[from] ConfigError),
    /// A database URL this build cannot open.
    #[error(
        "unsupported database url {0:?}: use postgres://… or sqlite:… (and the matching cargo feature)"
    )]
    UnsupportedUrl(String),
    /// The message's month was already pruned: its first delivery, if there was one, is no
    /// longer on record, so it cannot be deduplicated and is refused.
    #[error(
        "inbox partition {0} was already pruned: the message is older than the deduplication window \
         and is refused; raise the inbox ttl above the broker's redelivery window, or dead-letter it"
    )]
    PartitionPruned(Month),
    /// Another delivery recorded the key while this one ran, but its row could not be read
    /// back. Nothing was applied; try again.
    #[error(
        "message {message_id} for {consumer_type} was recorded by a racing delivery whose row \
         could not be read back; nothing was applied, retry"
    )]
    ClaimVanished {
        /// The consumer.
        consumer_type: ConsumerType,
        /// The message.
        message_id: MessageId,
    },
    /// A batch larger than [`MAX_BATCH`](crate::inbox::MAX_BATCH) envelopes.
    #[error(
        "batch of {len} envelopes is larger than the limit of {max}: split it into smaller batches"
    )]
    BatchTooLarge {
        /// The envelopes passed.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A set-based batch handler returned a different number of results than it was
    /// given envelopes. Nothing of the batch was applied.
    #[error(
        "the batch handler returned {returned} results for {expected} envelopes: return exactly \
         one result per envelope it was given, in order; nothing of the batch was applied"
    )]
    BatchResultCount {
        /// Envelopes given to the handler.
        expected: usize,
        /// Results it returned.
        returned: usize,
    },
    /// A key of the batch was recorded by another delivery while the batch ran, although
    /// the batch held its lock. Nothing of the batch was applied; retry it.
    #[error(
        "a message of the batch for {consumer_type} was recorded by a racing delivery while the \
         batch held its lock; nothing of the batch was applied, retry"
    )]
    BatchRaced {
        /// The consumer.
        consumer_type: ConsumerType,
    },
    /// The database could not be opened or reached (boxed: it is the largest variant).
    #[error(transparent)]
    Connect(Box<crate::connection::ConnectError>),
    /// The database is missing or has not had sagabox's migrations (all of them).
    #[error(
        "{url} is not a sagabox database at the current version ({what}); run `sagabox migrate --database-url …` first"
    )]
    NotMigrated {
        /// The database, password redacted.
        url: String,
        /// What was missing.
        what: String,
    },
    /// Running the migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database failed; the transaction was rolled back and nothing was recorded.
    #[error("database error: {}", crate::connection::describe(.0))]
    Database(#[source] sqlx::Error),
    /// No pooled connection became free within the pool's acquire timeout: every one was
    /// busy, or the database could not be reached to open a new one. Nothing was done.
    #[error(
        "no connection of the inbox's database pool{} became free within the pool's acquire \
         timeout: every connection is busy or the database is unreachable; nothing was \
         applied, retry later, and if it persists raise the pool size (sagabox's \
         --db-pool-size, or the max_connections given to the store), lower the concurrency \
         (workers, prefetch) or check the database",
        size.map_or_else(String::new, |size| format!(" (which holds at most {size})"))
    )]
    PoolTimedOut {
        /// The most connections the pool holds, where the store knows it.
        size: Option<u32>,
    },
}

impl From<sqlx::Error> for InboxError {
    /// A pool timeout becomes [`InboxError::PoolTimedOut`], which says what to do; any
    /// other failure [`InboxError::Database`].
    fn from(error: sqlx::Error) -> Self {
        match error {
            sqlx::Error::PoolTimedOut => InboxError::PoolTimedOut { size: None },
            error => InboxError::Database(error),
        }
    }
}

impl From<crate::connection::ConnectError> for InboxError {
    fn from(error: crate::connection::ConnectError) -> Self {
        InboxError::Connect(Box::new(error))
    }
}

impl InboxError {
    /// Whether trying the same message again later may succeed (a database or connection
    /// failure) as opposed to a refusal that will repeat (expired, bad configuration).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            InboxError::Database(_)
                | InboxError::PoolTimedOut { .. }
                | InboxError::ClaimVanished { .. }
                | InboxError::BatchRaced { .. }
        )
    }
}

/// The error of one [`InboxGuard::process`](crate::InboxGuard::process) call. Either way
/// the transaction was rolled back: no side effect and no inbox row remain, so a
/// redelivery is processed normally.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError<E> {
    /// The handler returned an error.
    #[error("handler failed: {0}")]
    Handler(#[source] E),
    /// The inbox refused the message or the database failed.
    #[error(transparent)]
    Inbox(#[from] InboxError),
}

impl<E> From<sqlx::Error> for GuardError<E> {
    fn from(error: sqlx::Error) -> Self {
        GuardError::Inbox(InboxError::from(error))
    }
}
