//! `GET /sagas` (a list filtered by state, definition and age, newest first, a page at a
//! time behind a cursor) and `GET /sagas/{id}` (one saga: its state, its timeline on a
//! time axis and as a table, its data, and the operator's actions).

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use chrono::{DateTime, TimeDelta, Utc};
use maud::{Markup, html};
use sagabox::saga::versions::stored_definition;
use sagabox::saga::{SagaCursor, SagaFilter, SagaInstance, SagaState, SagaStatus, SagaStore};
use serde::Deserialize;

use super::chart::{self, Mark};
use super::pages::STATES;
use super::{PageError, Shared, pages};
use crate::saga::StepNames;

/// Sagas on one page of the list.
const PAGE: u32 = 50;

/// The ages the list can be narrowed to, as `age=` takes them.
const AGES: [(&str, &str, i64); 4] = [
    ("1h", "last hour", 3600),
    ("24h", "last 24 hours", 86_400),
    ("7d", "last 7 days", 7 * 86_400),
    ("30d", "last 30 days", 30 * 86_400),
];

/// The list's query string.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ListQuery {
    status: Option<String>,
    saga: Option<String>,
    age: Option<String>,
    /// The cursor: creation time (RFC 3339) and id of the last saga of the page before.
    after: Option<String>,
    after_id: Option<String>,
}

/// `GET /sagas`.
pub(crate) async fn list(
    State(console): State<Shared>,
    Query(query): Query<ListQuery>,
) -> Result<Markup, PageError> {
    let now = Utc::now();
    let state = match query.status.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some("parked") => Some(SagaState::Parked),
        Some(text) => Some(SagaState::Status(text.parse::<SagaStatus>().map_err(
            |error| PageError::new(StatusCode::BAD_REQUEST, error.to_string()),
        )?)),
    };
    let saga_name = query.saga.clone().filter(|s| !s.is_empty());
    let created_since = match query.age.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(age) => {
            let (_, _, seconds) =
                AGES.iter()
                    .find(|(code, _, _)| *code == age)
                    .ok_or_else(|| {
                        PageError::new(
                            StatusCode::BAD_REQUEST,
                            format!("unknown age {age:?}: use 1h, 24h, 7d or 30d"),
                        )
                    })?;
            Some(now - TimeDelta::seconds(*seconds))
        }
    };
    let after = match (&query.after, &query.after_id) {
        (Some(at), Some(id)) => Some(SagaCursor {
            created_at: DateTime::parse_from_rfc3339(at)
                .map_err(|error| {
                    PageError::new(StatusCode::BAD_REQUEST, format!("after: {error}"))
                })?
                .with_timezone(&Utc),
            id: id.clone(),
        }),
        _ => None,
    };
    let filter = SagaFilter {
        state,
        saga_name,
        created_since,
        after,
        limit: PAGE,
    };
    let rows = {
        let store = &console.db;
        let sagas = store.list(&filter).await.map_err(PageError::read)?;
        let mut steps = StepNames::default();
        let mut rows = Vec::with_capacity(sagas.len());
        for saga in sagas {
            let step = steps.of(store, &saga).await;
            rows.push((saga, step));
        }
        rows
    };
    let next = (rows.len() == PAGE as usize)
        .then(|| rows.last().map(|(saga, _)| next_link(&query, saga)))
        .flatten();
    let selected = |value: &Option<String>, option: &str| value.as_deref() == Some(option);
    Ok(pages::frame(
        "Sagas",
        "/sagas",
        html! {
            h1 { "Sagas" }
            form.filters method="get" action="/sagas" {
                label { "state"
                    select name="status" {
                        option value="" { "any" }
                        @for state in STATES { option value=(state) selected[selected(&query.status, state)] { (state) } }
                    }
                }
                label { "definition" input name="saga" value=[query.saga.as_deref()] placeholder="any"; }
                label { "created"
                    select name="age" {
                        option value="" { "any time" }
                        @for (code, label, _) in AGES { option value=(code) selected[selected(&query.age, code)] { (label) } }
                    }
                }
                button type="submit" { "Filter" }
            }
            section {
                table #sagas {
                    thead { tr {
                        th { "id" } th { "definition" } th { "state" } th { "step" }
                        th.num { "attempts" } th { "created" } th { "updated" } th { "last error" }
                    } }
                    tbody {
                        @for (saga, step) in &rows {
                            @let state = saga.state().as_str();
                            tr {
                                td { a.saga href={ "/sagas/" (path_segment(&saga.id)) } { (saga.id) } }
                                td { (saga.saga_name) " v" (saga.definition_version) }
                                td { (pages::state(state)) }
                                td { @if saga.status.is_terminal() { "–" } @else { (step.clone().unwrap_or_else(|| format!("#{}", saga.current_step))) } }
                                td.num { (saga.attempts) }
                                td title=(pages::time(saga.created_at)) { (pages::age(saga.created_at, now)) " ago" }
                                td title=(pages::time(saga.updated_at)) { (pages::age(saga.updated_at, now)) " ago" }
                                td.error { (saga.parked.as_deref().or(saga.last_error.as_deref()).unwrap_or("")) }
                            }
                        }
                    }
                }
                @if rows.is_empty() { p.muted { "no sagas match" } }
            }
            @if let Some(next) = next { p { a #next href=(next) { "older →" } } }
        },
    ))
}

/// The link to the page after the one ending with `last`, keeping the filters.
fn next_link(query: &ListQuery, last: &SagaInstance) -> String {
    let mut params = Vec::new();
    for (name, value) in [
        ("status", &query.status),
        ("saga", &query.saga),
        ("age", &query.age),
    ] {
        if let Some(value) = value.as_deref().filter(|v| !v.is_empty()) {
            params.push(format!("{name}={}", encode(value)));
        }
    }
    params.push(format!("after={}", encode(&last.created_at.to_rfc3339())));
    params.push(format!("after_id={}", encode(&last.id)));
    format!("/sagas?{}", params.join("&"))
}

/// `text` percent-encoded for a query value or a path segment: every byte but the
/// unreserved ones.
pub(crate) fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// A saga id as one path segment.
pub(crate) fn path_segment(id: &str) -> String {
    encode(id)
}

/// `GET /sagas/{id}`.
pub(crate) async fn show(
    State(console): State<Shared>,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    let now = Utc::now();
    let (saga, history, lanes, step) = {
        let store = &console.db;
        let saga = store
            .load(&id)
            .await
            .map_err(PageError::read)?
            .ok_or_else(|| {
                PageError::new(StatusCode::NOT_FOUND, format!("no saga with id {id}"))
            })?;
        let history = store.history(&id).await.map_err(PageError::read)?;
        let lanes = lanes(store, &saga).await;
        let step = StepNames::default().of(store, &saga).await;
        (saga, history, lanes, step)
    };
    let mut lanes = lanes;
    for entry in &history {
        if let Some(step) = &entry.event.step
            && !lanes.contains(step)
        {
            lanes.push(step.clone());
        }
    }
    let marks: Vec<Mark> = history
        .iter()
        .map(|entry| {
            let event = &entry.event;
            let at_ms = (event.at - saga.created_at).num_milliseconds();
            let mut label = format!("+{:.3} s  {}", at_ms as f64 / 1000.0, event.kind);
            if let Some(step) = &event.step {
                label.push_str(&format!(" · {step}"));
            }
            if let Some(attempt) = event.attempt {
                label.push_str(&format!(" · attempt {attempt}"));
            }
            if let Some(detail) = &event.detail {
                label.push_str(&format!(" · {detail}"));
            }
            Mark {
                at_ms,
                waited_ms: event
                    .duration
                    .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                lane: event.step.clone().unwrap_or_default(),
                kind: event.kind.as_str(),
                label,
            }
        })
        .collect();
    let state = saga.state();
    let data = serde_json::to_string_pretty(&saga.data).unwrap_or_else(|_| saga.data.to_string());
    let actions = console.config.allow_actions;
    let segment = path_segment(&saga.id);
    Ok(pages::frame(
        &format!("Saga {}", saga.id),
        "/sagas",
        html! {
            h1 { "Saga " span #saga-id { (saga.id) } }
            div.cards {
                div.card { div.l { "definition" } div { (saga.saga_name) " v" (saga.definition_version) } }
                div.card { div.l { "state" } div #state { (pages::state(state.as_str())) } }
                div.card { div.l { "step" } div { @if saga.status.is_terminal() { "–" } @else { (step.unwrap_or_else(|| format!("#{}", saga.current_step))) " (attempts " (saga.attempts) ")" } } }
                div.card { div.l { "created" } div title=(pages::time(saga.created_at)) { (pages::age(saga.created_at, now)) " ago" } }
                div.card { div.l { "last change" } div title=(pages::time(saga.updated_at)) { (pages::age(saga.updated_at, now)) " ago" } }
                @if let Some(deadline) = saga.deadline_at { div.card { div.l { "deadline" } div { (pages::time(deadline)) } } }
            }
            @if let Some(reason) = &saga.parked { section.warn { h2 { "Parked" } p.error { (reason) } } }
            @if let Some(error) = &saga.last_error { section { h2 { "Last error" } p.error { (error) } } }
            @if actions && !saga.status.is_terminal() {
                section #actions {
                    h2 { "Actions" }
                    @if state == SagaState::Parked {
                        form.action method="post" action={ "/sagas/" (segment) "/retry" } {
                            input type="hidden" name="csrf" value=(console.csrf);
                            input name="note" value="retried from the console";
                            button type="submit" { "Retry" }
                        }
                    }
                    form.action method="post" action={ "/sagas/" (segment) "/cancel" } {
                        input type="hidden" name="csrf" value=(console.csrf);
                        input name="note" value="cancelled from the console";
                        button.danger type="submit" { "Cancel (compensate)" }
                    }
                }
            }
            section {
                h2 { "Timeline" }
                @if history.is_empty() { p.muted { "no history recorded" } }
                @else { (chart::timeline(&lanes, &marks)) }
                table #timeline {
                    thead { tr { th.num { "at" } th { "step" } th { "event" } th.num { "attempt" } th.num { "waited" } th { "detail" } } }
                    tbody {
                        @for entry in &history {
                            @let event = &entry.event;
                            tr data-kind=(event.kind.as_str()) {
                                td.num title=(pages::time(event.at)) { (format!("+{:.3} s", (event.at - saga.created_at).num_milliseconds() as f64 / 1000.0)) }
                                td { @if let Some(step) = &event.step { @if event.direction.map(|d| d.as_str()) == Some("backward") { "undo " } (step) } }
                                td { (event.kind.as_str()) }
                                td.num { @if let Some(attempt) = event.attempt { (attempt) } }
                                td.num { @if let Some(waited) = event.duration { (waited.as_millis()) " ms" } }
                                td.error { @if let Some(detail) = &event.detail { (detail) } }
                            }
                        }
                    }
                }
            }
            section { h2 { "Data" } pre #data { (data) } }
        },
    ))
}

/// The step names of `saga`'s definition, in order: the timeline's lanes after the
/// saga's own.
async fn lanes<St: SagaStore>(store: &St, saga: &SagaInstance) -> Vec<String> {
    let mut lanes = vec![String::new()];
    if let Ok(definition) = stored_definition(store, &saga.saga_name, saga.definition_version).await
    {
        lanes.extend(definition.steps().iter().map(|step| step.name().to_owned()));
    }
    lanes
}
