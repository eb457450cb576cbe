//! The POSTs: retry or cancel a saga ([`sagabox::saga::operator`], as `sagabox saga
//! retry|cancel`), replay a queue's dead letters ([`DeadLetters::replay`], as
//! `sagabox dlq replay`). Each is refused unless the console runs with
//! `--allow-actions` and the form carries the CSRF token; then it redirects (303) to the
//! page that shows its effect.

use axum::Form;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Redirect;
use chrono::Utc;
use sagabox::dlq::{DeadLetters, ReplayOptions};
use sagabox::saga::operator;
use serde::Deserialize;

use super::sagas::path_segment;
use super::security::check_action;
use super::{PageError, Shared};
use crate::saga::signed;

/// A saga action's form.
#[derive(Debug, Deserialize)]
pub(crate) struct SagaForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    note: String,
}

/// A replay's form.
#[derive(Debug, Deserialize)]
pub(crate) struct ReplayForm {
    #[serde(default)]
    csrf: String,
    queue: String,
}

/// The note recorded with the action: the operator's, signed as the CLI signs it, and
/// marked as coming from the console.
fn note(form: &SagaForm, default: &str) -> String {
    let note = form.note.trim();
    signed(&format!(
        "console: {}",
        if note.is_empty() { default } else { note }
    ))
}

/// `POST /sagas/{id}/retry`.
pub(crate) async fn retry(
    State(console): State<Shared>,
    Path(id): Path<String>,
    Form(form): Form<SagaForm>,
) -> Result<Redirect, PageError> {
    check_action(&console, &form.csrf)?;
    let note = note(&form, "retried");
    {
        let store = &console.db;
        operator::retry(store, &id, &note, Utc::now())
            .await
            .map_err(|error| PageError::new(StatusCode::CONFLICT, error.to_string()))?
    };
    Ok(Redirect::to(&format!("/sagas/{}", path_segment(&id))))
}

/// `POST /sagas/{id}/cancel`.
pub(crate) async fn cancel(
    State(console): State<Shared>,
    Path(id): Path<String>,
    Form(form): Form<SagaForm>,
) -> Result<Redirect, PageError> {
    check_action(&console, &form.csrf)?;
    let note = note(&form, "cancelled");
    {
        let store = &console.db;
        operator::cancel(store, &id, &note, Utc::now())
            .await
            .map_err(|error| PageError::new(StatusCode::CONFLICT, error.to_string()))?
    };
    Ok(Redirect::to(&format!("/sagas/{}", path_segment(&id))))
}

/// `POST /dead/replay`: every dead letter of one configured queue back to its source.
pub(crate) async fn replay(
    State(console): State<Shared>,
    Form(form): Form<ReplayForm>,
) -> Result<Redirect, PageError> {
    check_action(&console, &form.csrf)?;
    let broker = console.config.broker.as_ref().ok_or_else(|| {
        PageError::new(
            StatusCode::BAD_REQUEST,
            "no broker: start the console with --amqp-url or --nats-url",
        )
    })?;
    if !console.config.dead_letter_queues.contains(&form.queue) {
        return Err(PageError::new(
            StatusCode::BAD_REQUEST,
            format!("{} is not one of the console's queues", form.queue),
        ));
    }
    let dlq = DeadLetters::open(broker, &form.queue)
        .await
        .map_err(PageError::read)?;
    let replayed = dlq.replay(&ReplayOptions::default()).await;
    dlq.close().await;
    replayed.map_err(PageError::read)?;
    Ok(Redirect::to("/dead"))
}
