//! `sagabox dlq list` and `sagabox dlq replay` run as an operator would, against the real
//! RabbitMQ (and PostgreSQL behind `sagabox serve`): a listing changes nothing; a replay
//! takes the reason and the limit asked and reports what it did; an unknown queue, an
//! unreachable broker and bad arguments say so, exit 1 or 2, and change nothing; a
//! replay of an applied message, and of a replayed one, charges once. The same
//! commands read and replay a JetStream dead-letter stream with `--nats-url`.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/jetstream.rs"]
#[allow(dead_code, unreachable_pub)]
mod jetstream;

use common::sagabox_command as command;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::rabbit::Rabbit;
use lapin::BasicProperties;
use lapin::types::AMQPValue;
use sagabox::amqp::codec;
use sagabox::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use sagabox::dlq::REPLAYED_HEADER;
use sagabox::{Envelope, MessageId};
use serde_json::{Value, json};

/// `sagabox dlq <args> --amqp-url <the test broker>`.
fn dlq(rabbit: &Rabbit, args: &[&str]) -> Output {
    let mut all = vec!["dlq"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--amqp-url", &rabbit.config.url]);
    command(&all).output().expect("run sagabox")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// stdout of a successful run.
fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "sagabox failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        stderr(output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// stdout as the one JSON object it must be.
fn json(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.lines().count(), 1, "one line on stdout: {text}");
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A `charge` of order `id` under message id `id`, as the orchestrator sends one.
fn charge(id: &str) -> (Vec<u8>, BasicProperties) {
    let envelope = Envelope::new(
        MessageId::new(id).unwrap(),
        "charge",
        json!({"order_id": id, "amount_cents": 500}),
    )
    .unwrap()
    .with_published_at(chrono::Utc::now());
    codec::encode(&envelope)
}

/// The charge of `id` as the consumer dead-letters it with `reason`.
fn dead_charge(id: &str, reason: &str) -> (Vec<u8>, BasicProperties) {
    let (body, properties) = charge(id);
    let properties = codec::with_headers(
        properties,
        [
            (DEAD_REASON_HEADER, AMQPValue::LongString(reason.into())),
            (
                DEAD_DETAIL_HEADER,
                AMQPValue::LongString(format!("why {id}").into()),
            ),
        ],
    );
    (body, properties)
}

/// Declares `payment`'s queues and puts these dead letters in its dead-letter queue.
async fn dead_letters(rabbit: &Rabbit, letters: &[(&str, &str)]) {
    rabbit.declare("payment").await;
    for (id, reason) in letters {
        let (body, properties) = dead_charge(id, reason);
        rabbit
            .publish_raw(&rabbit.dead_queue("payment"), &body, properties)
            .await;
    }
}

fn ids(messages: &Value) -> Vec<String> {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message_id"].as_str().unwrap().to_owned())
        .collect()
}

async fn drain_ids(rabbit: &Rabbit, queue: &str) -> Vec<String> {
    rabbit
        .drain(queue)
        .await
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn list_shows_the_dead_letters_and_leaves_the_queue_as_it_was() {
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(
        &rabbit,
        &[
            ("m-1", "rejected"),
            ("m-2", "unknown_kind"),
            ("m-3", "rejected"),
        ],
    )
    .await;
    let source = rabbit.queue("payment");
    let dead = rabbit.dead_queue("payment");

    let table = stdout(&dlq(&rabbit, &["list", "--queue", &source]));
    assert!(
        table.starts_with(&format!(
            "{dead}: 3 dead letter(s) from {source}; showing 3"
        )),
        "{table}"
    );
    for needle in ["message id", "m-2", "unknown_kind", "why m-3", "charge"] {
        assert!(table.contains(needle), "{needle} in {table}");
    }
    assert_eq!(rabbit.ready(&dead).await, 3);

    // The dead-letter queue's own name, a limit, JSON.
    let listed = json(&dlq(
        &rabbit,
        &["list", "--queue", &dead, "--limit", "2", "--json"],
    ));
    assert_eq!(listed["queue"], dead.as_str());
    assert_eq!(listed["source_queue"], source.as_str());
    assert_eq!(listed["total"], 3);
    assert_eq!(ids(&listed["messages"]), ["m-1", "m-2"]);
    let first = &listed["messages"][0];
    assert_eq!(first["kind"], "charge");
    assert_eq!(first["reason"], "rejected");
    assert_eq!(first["detail"], "why m-1");
    assert!(first["age_seconds"].as_u64().unwrap() < 300, "{first}");

    assert_eq!(
        drain_ids(&rabbit, &dead).await,
        ["m-1", "m-2", "m-3"],
        "all there, in order"
    );
}

#[tokio::test]
async fn replay_takes_the_reason_and_the_limit_asked() {
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(
        &rabbit,
        &[
            ("m-1", "rejected"),
            ("m-2", "unknown_kind"),
            ("m-3", "rejected"),
            ("m-4", "retries_exhausted"),
        ],
    )
    .await;
    let source = rabbit.queue("payment");
    let dead = rabbit.dead_queue("payment");

    let report = json(&dlq(
        &rabbit,
        &[
            "replay", "--queue", &source, "--reason", "rejected", "--json",
        ],
    ));
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(report["left"], 2, "{report}");
    assert_eq!(report["reason"], "rejected");
    assert_eq!(ids(&report["messages"]), ["m-1", "m-3"]);
    let copies = rabbit.drain(&source).await;
    assert_eq!(copies.len(), 2);
    let copy = &copies[0].delivery.properties;
    assert_eq!(copy.message_id().as_ref().unwrap().as_str(), "m-1");
    assert_eq!(codec::header(copy, DEAD_REASON_HEADER), None);
    assert_eq!(codec::count_header(copy, REPLAYED_HEADER), Some(1));

    let summary = stdout(&dlq(
        &rabbit,
        &["replay", "--queue", &source, "--limit", "1"],
    ));
    assert!(
        summary.starts_with(&format!(
            "replayed 1 dead letter(s) from {dead} to {source}; 1 left in {dead}"
        )),
        "{summary}"
    );
    assert!(summary.contains("m-2"), "{summary}");
    let rest = json(&dlq(&rabbit, &["replay", "--queue", &source, "--json"]));
    assert_eq!(
        (rest["replayed"].as_u64(), rest["left"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(drain_ids(&rabbit, &source).await, ["m-2", "m-4"]);

    let nothing = stdout(&dlq(&rabbit, &["replay", "--queue", &source]));
    assert!(
        nothing.starts_with("replayed 0 dead letter(s)"),
        "{nothing}"
    );
}

#[tokio::test]
async fn errors_say_what_and_where_and_change_nothing() {
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(&rabbit, &[("m-1", "rejected"), ("m-2", "rejected")]).await;
    let source = rabbit.queue("payment");
    let dead = rabbit.dead_queue("payment");

    // A queue that does not exist: exit 1, named, nothing changed.
    let nowhere = format!("{}.nowhere", rabbit.config.queue_prefix);
    for subcommand in ["list", "replay"] {
        let output = dlq(&rabbit, &[subcommand, "--queue", &nowhere]);
        assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
        let text = stderr(&output);
        assert!(
            text.starts_with(&format!(
                "sagabox dlq {subcommand}: queue {nowhere}.dead does not exist"
            )),
            "{text}"
        );
        assert!(text.contains("nothing was changed"), "{text}");
        assert!(!text.contains("guest:guest"), "password redacted: {text}");
        let output = dlq(&rabbit, &[subcommand, "--queue", &nowhere, "--json"]);
        assert_eq!(output.status.code(), Some(1));
        let error = json(&output)["error"].as_str().unwrap().to_owned();
        assert!(error.contains(&format!("{nowhere}.dead")), "{error}");
    }

    // A dead-letter queue whose source queue is gone: a replay reads nothing.
    let orphan = format!("{}.orphan", rabbit.config.queue_prefix);
    let orphan_dead = format!("{orphan}.dead");
    rabbit
        .channel
        .queue_declare(
            orphan_dead.as_str().into(),
            lapin::options::QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let (body, properties) = dead_charge("o-1", "rejected");
    rabbit.publish_raw(&orphan_dead, &body, properties).await;
    let output = dlq(&rabbit, &["replay", "--queue", &orphan]);
    let text = stderr(&output);
    let deleted = rabbit.ready(&orphan_dead).await;
    rabbit
        .channel
        .queue_delete(orphan_dead.as_str().into(), Default::default())
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("queue {orphan} does not exist")),
        "{text}"
    );
    assert_eq!(deleted, 1, "the dead letter stayed");

    // An unreachable broker: exit 1, the URL named without its password.
    for json_flag in [false, true] {
        let mut args = vec![
            "dlq",
            "replay",
            "--queue",
            &source,
            "--amqp-url",
            "amqp://guest:hunter2@127.0.0.1:5999/%2f",
        ];
        if json_flag {
            args.push("--json");
        }
        let output = command(&args).output().unwrap();
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{text}");
        assert_eq!(text.trim_end().lines().count(), 1, "{text}");
        assert!(
            text.contains("cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:5999/%2f"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        if json_flag {
            let error = json(&output)["error"].as_str().unwrap().to_owned();
            assert!(error.contains("127.0.0.1:5999"), "{error}");
            assert!(!error.contains("hunter2"), "{error}");
        }
    }

    // Bad arguments: exit 2 before anything is read.
    let usage: &[(&[&str], &str)] = &[
        (&["list", "--queue", &source, "--limit", "0"], "--limit"),
        (&["replay", "--queue", &source, "--limit", "0"], "--limit"),
        (
            &["replay", "--queue", &source, "--reason", "bogus"],
            "retries_exhausted",
        ),
        (&["replay", "--queue", ""], "--queue"),
        (&["list", "--queue", ".dead"], "--queue"),
        (&["list"], "--queue"),
    ];
    for (args, needle) in usage {
        let output = dlq(&rabbit, args);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(needle), "{args:?}: {text}");
    }
    let output = command(&[
        "dlq",
        "list",
        "--queue",
        &source,
        "--amqp-url",
        "http://guest:hunter2@127.0.0.1:5672/",
    ])
    .output()
    .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--amqp-url") && !text.contains("hunter2"),
        "{text}"
    );

    assert_eq!(
        drain_ids(&rabbit, &dead).await,
        ["m-1", "m-2"],
        "nothing changed"
    );
    assert_eq!(rabbit.ready(&source).await, 0);
}

/// Polls `sql` (one integer) until it is `want`; panics after 60 s, or when `serve` died.
async fn wait_for_count(
    db: &common::Pg,
    serve: &mut std::process::Child,
    sql: &'static str,
    want: i64,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = db.scalar(sql).await;
        if got == want {
            return;
        }
        if let Some(status) = serve.try_wait().unwrap() {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut text).unwrap();
            panic!("serve ended ({status}): {text}");
        }
        assert!(Instant::now() < deadline, "{sql}: {got}, expected {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn replaying_an_applied_charge_and_a_replayed_one_charges_once() {
    let db = common::Pg::new().await;
    // serve creates them too, but the test counts rows before serve may have started.
    sqlx::raw_sql(sagabox_checkout::POSTGRES_TABLES)
        .execute(&db.pool)
        .await
        .unwrap();
    let rabbit = Rabbit::new(&["payment"]).await;
    rabbit.declare("payment").await;
    let child = command(&[
        "serve",
        "--role",
        "payment",
        "--transport",
        &rabbit.config.url,
        "--queue-prefix",
        &rabbit.config.queue_prefix,
        "--database-url",
        &db.url,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut children = common::children::Children::new(vec![child]);
    const CHARGES: &str = "SELECT COUNT(*) FROM payment_charges";
    const DUPLICATES: &str =
        "SELECT CAST(COALESCE(SUM(duplicates), 0) AS BIGINT) FROM sagabox_inbox";

    let id = MessageId::new_v7();
    let source = rabbit.queue("payment");
    let dead = rabbit.dead_queue("payment");
    let (body, properties) = charge(id.as_str());
    rabbit.publish_raw(&source, &body, properties).await;
    wait_for_count(&db, &mut children[0], CHARGES, 1).await;

    // A copy of the applied charge lands in the dead-letter queue, and is replayed.
    let (body, properties) = dead_charge(id.as_str(), "rejected");
    rabbit.publish_raw(&dead, &body, properties).await;
    let report = json(&dlq(&rabbit, &["replay", "--queue", &source, "--json"]));
    assert_eq!(report["replayed"], 1, "{report}");
    wait_for_count(&db, &mut children[0], DUPLICATES, 1).await;

    // The replayed copy dead-lettered again, then replayed again.
    let (body, properties) = dead_charge(id.as_str(), "retries_exhausted");
    let properties =
        codec::with_headers(properties, [(REPLAYED_HEADER, AMQPValue::LongLongInt(1))]);
    rabbit.publish_raw(&dead, &body, properties).await;
    let listed = json(&dlq(&rabbit, &["list", "--queue", &source, "--json"]));
    assert_eq!(listed["messages"][0]["replayed"], 1, "{listed}");
    let report = json(&dlq(&rabbit, &["replay", "--queue", &source, "--json"]));
    assert_eq!(report["replayed"], 1, "{report}");
    wait_for_count(&db, &mut children[0], DUPLICATES, 2).await;

    let status = common::children::stop(&mut children[0], "serve", Duration::from_secs(60)).await;
    assert!(status.success(), "{status}");
    assert_eq!(db.scalar(CHARGES).await, 1, "charged once");
    assert_eq!(db.inbox_rows().await, 1);
    assert_eq!(rabbit.ready(&dead).await, 0);
    assert_eq!(rabbit.ready(&source).await, 0);
}

#[tokio::test]
async fn over_jetstream_a_listing_takes_nothing_and_a_replay_moves_the_reason_asked() {
    let js = jetstream::Js::new(&["payment"]).await;
    js.declare("payment").await;
    let subject = js.subject("payment");
    let dead_subject = format!("{subject}.dead");
    for (id, reason) in [("m-1", "rejected"), ("m-2", "unknown_kind")] {
        let envelope = Envelope::new(MessageId::new(id).unwrap(), "charge", json!({})).unwrap();
        let (body, mut headers) = sagabox::nats::codec::encode(&envelope);
        headers.insert(DEAD_REASON_HEADER, reason);
        headers.insert(DEAD_DETAIL_HEADER, "from the test");
        js.publish_raw(&dead_subject, headers, body).await;
    }
    let url = js.config.url.clone();
    let run = |args: &[&str]| {
        let mut all = vec!["dlq"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--queue", &subject, "--nats-url", &url, "--json"]);
        command(&all).output().expect("run sagabox")
    };
    let listed = json(&run(&["list"]));
    assert_eq!(listed["total"], 2, "{listed}");
    assert_eq!(listed["queue"], dead_subject.as_str());
    let ids: Vec<&str> = listed["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m-1", "m-2"]);
    assert_eq!(js.dead("payment").await, 2, "a listing takes nothing");

    let replayed = json(&run(&["replay", "--reason", "rejected"]));
    assert_eq!(
        (replayed["replayed"].as_u64(), replayed["left"].as_u64()),
        (Some(1), Some(1)),
        "{replayed}"
    );
    assert_eq!(
        js.pending("payment").await,
        1,
        "the copy is in the work stream"
    );
    assert_eq!(js.dead("payment").await, 1);

    // A subject without streams: exit 1, nothing changed; a URL of another broker: exit 2.
    let output = command(&[
        "dlq",
        "list",
        "--queue",
        "nowhere.payment",
        "--nats-url",
        &url,
    ])
    .output()
    .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("does not exist on NATS JetStream"), "{text}");
    let output = command(&[
        "dlq",
        "list",
        "--queue",
        &subject,
        "--nats-url",
        "amqp://guest:hunter2@127.0.0.1:5672/%2f",
    ])
    .output()
    .unwrap();
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--nats-url") && !text.contains("hunter2"),
        "{text}"
    );
}
