//! `GET /dead`: the dead letters of each configured queue — reason, detail, attempts,
//! age — read with the library's [`DeadLetters`], which leaves every message in place.

use axum::extract::State;
use chrono::Utc;
use maud::{Markup, html};
use sagabox::dlq::{DeadLetterList, DeadLetters, DlqError};

use super::{Console, PageError, Shared, pages};

/// Dead letters shown per queue: the oldest, which tell what went wrong first.
const SHOWN: usize = 100;

/// The number of dead letters per configured queue (an error for a queue that could not
/// be read); `None` without a broker.
pub(crate) async fn counts(console: &Console) -> Option<Vec<(String, Result<u32, DlqError>)>> {
    let broker = console.config.broker.as_ref()?;
    let mut counts = Vec::new();
    for queue in &console.config.dead_letter_queues {
        let count = match DeadLetters::open(broker, queue).await {
            Ok(dlq) => {
                let count = dlq.count().await;
                dlq.close().await;
                count
            }
            Err(error) => Err(error),
        };
        counts.push((queue.clone(), count));
    }
    Some(counts)
}

/// `GET /dead`.
pub(crate) async fn page(State(console): State<Shared>) -> Result<Markup, PageError> {
    let Some(broker) = console.config.broker.as_ref() else {
        return Ok(pages::frame(
            "Dead letters",
            "/dead",
            html! {
                h1 { "Dead letters" }
                p.muted { "No broker given: start the console with --amqp-url amqp://user:password@host:port/vhost (or --nats-url nats://host:port) to see the dead letters." }
            },
        ));
    };
    let mut lists: Vec<(String, Result<DeadLetterList, DlqError>)> = Vec::new();
    for queue in &console.config.dead_letter_queues {
        let listed = match DeadLetters::open(broker, queue).await {
            Ok(dlq) => {
                let listed = dlq.list(Some(SHOWN)).await;
                dlq.close().await;
                listed
            }
            Err(error) => Err(error),
        };
        lists.push((queue.clone(), listed));
    }
    let now = Utc::now();
    Ok(pages::frame(
        "Dead letters",
        "/dead",
        html! {
            h1 { "Dead letters" }
            @for (queue, listed) in &lists {
                section.queue data-queue=(queue) {
                    @match listed {
                        Err(error) => { h2 { (queue) } p.error { (error) } }
                        Ok(list) => {
                            h2 { (list.queue) " · " span.total { (list.total) } " message(s), back to " (list.source_queue) }
                            @if console.config.allow_actions && list.total > 0 {
                                form.action method="post" action="/dead/replay" {
                                    input type="hidden" name="csrf" value=(console.csrf);
                                    input type="hidden" name="queue" value=(list.source_queue);
                                    button type="submit" { "Replay all to " (list.source_queue) }
                                }
                            }
                            @if !list.messages.is_empty() {
                                table {
                                    thead { tr { th { "message id" } th { "kind" } th { "saga" } th { "reason" } th { "detail" } th.num { "attempts" } th.num { "age" } } }
                                    tbody {
                                        @for message in &list.messages {
                                            tr {
                                                td { (message.message_id.as_deref().unwrap_or("–")) }
                                                td { (message.kind.as_deref().unwrap_or("–")) }
                                                td { @if let Some(saga) = &message.saga_id { a href={ "/sagas/" (super::sagas::path_segment(saga)) } { (saga) } } }
                                                td { (message.reason.as_deref().unwrap_or("–")) }
                                                td.error { (message.detail.as_deref().unwrap_or("")) }
                                                td.num { @if let Some(n) = message.attempts { (n) } }
                                                td.num { @if let Some(at) = message.published_at { (pages::age(at, now)) } @else if let Some(s) = message.age_seconds { (pages::duration_text(i64::try_from(s).unwrap_or(i64::MAX))) } }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
    ))
}
