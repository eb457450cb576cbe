//! `sagabox console` started as an operator would, against a fresh PostgreSQL database
//! filled by a demo run: every page answers, and the numbers it shows are the ones SQL
//! counts; a saga whose data holds markup shows it as text; the dead letters of a real
//! RabbitMQ queue are listed and replayed; actions are refused without
//! `--allow-actions`, without the form's CSRF token, and off loopback without the token;
//! and a real browser (Debian's chromium, headless, through chromedriver) loads the
//! overview, clicks from the list to a saga and to the dead letters, replays them with
//! the page's button, and takes screenshots that are not blank.
//!
//! Set `SAGABOX_CONSOLE_SCREENSHOTS=docs/img` to write the screenshots there (the ones in
//! docs/console.md); otherwise they go to the test's scratch folder.

#![allow(clippy::unwrap_used)]

#[path = "../../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::Duration;

use chrono::Utc;
use common::rabbit::Rabbit;
use lapin::types::AMQPValue;
use sagabox::amqp::codec;
use sagabox::dead_reason::{DEAD_DETAIL_HEADER, DEAD_REASON_HEADER};
use sagabox::saga::{SagaDefinition, SagaInsert, SagaInstance, SagaStatus, SagaStore};
use sagabox::{Envelope, MessageId};
use serde_json::json;

/// A console process, killed on drop.
struct Console {
    child: Child,
    base: String,
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Console {
    /// Starts `sagabox console` with `args` on a free loopback port and waits for its
    /// "console at" line.
    fn start(url: &str, args: &[&str]) -> Console {
        let mut all = vec!["console", "--database-url", url];
        if !args.contains(&"--listen") {
            all.extend_from_slice(&["--listen", "127.0.0.1:0"]);
        }
        all.extend_from_slice(args);
        let mut child = common::sagabox_command(&all)
            .env("USER", "test-operator")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start sagabox console");
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let line = lines
            .next()
            .expect("a line from the console")
            .expect("stderr readable");
        let addr = line
            .strip_prefix("console at http://")
            .unwrap_or_else(|| panic!("not the console's line: {line}"))
            .trim_end_matches('/')
            .replace("0.0.0.0", "127.0.0.1");
        // Keep draining stderr so the console never blocks writing to it.
        std::thread::spawn(move || for _ in lines {});
        Console {
            child,
            base: format!("http://{addr}"),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// `GET path`: its status and body.
async fn get(console: &Console, path: &str) -> (u16, String) {
    let response = client().get(console.url(path)).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// `GET path`, which must answer 200.
async fn page(console: &Console, path: &str) -> String {
    let (status, body) = get(console, path).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// `POST path` with a form body: its status and body.
async fn post(console: &Console, path: &str, form: &str) -> (u16, String) {
    let response = client()
        .post(console.url(path))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form.to_owned())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The text of the first element after `marker` whose opening tag starts with `tag`:
/// `text_after(html, r#"id="count-running""#, r#"<div class="n">"#)`.
fn text_after<'h>(html: &'h str, marker: &str, tag: &str) -> &'h str {
    let start = html
        .find(marker)
        .unwrap_or_else(|| panic!("{marker} not on the page"));
    let rest = &html[start + marker.len()..];
    let open = rest
        .find(tag)
        .unwrap_or_else(|| panic!("{tag} after {marker}"));
    let text = &rest[open + tag.len()..];
    &text[..text.find('<').unwrap()]
}

fn number_after(html: &str, marker: &str, tag: &str) -> i64 {
    let text = text_after(html, marker, tag);
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{text:?} after {marker} is not a number"))
}

/// The saga links of a list page, in order.
fn saga_links(html: &str) -> Vec<String> {
    html.match_indices(r#"<a class="saga" href=""#)
        .map(|(at, m)| {
            let rest = &html[at + m.len()..];
            rest[..rest.find('"').unwrap()].to_owned()
        })
        .collect()
}

/// The CSRF token in a page's forms.
fn csrf(html: &str) -> String {
    text_after(html, r#"name="csrf""#, "value=\"")
        .split('"')
        .next()
        .unwrap()
        .to_owned()
}

/// A fresh database filled by `sagabox demo` (faults on: duplicates, lost replies,
/// failures, declined cards), plus one saga parked while running whose data and reason hold markup.
async fn demo_database(orders: &str) -> common::Pg {
    let fx = common::Pg::new().await;
    let output = common::sagabox_command(&[
        "demo",
        "--database-url",
        &fx.url,
        "--orders",
        orders,
        "--decline-rate",
        "0.2",
    ])
    .output()
    .unwrap();
    assert!(
        output.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let store = fx.store(1).await;
    let definition = SagaDefinition::from_toml_str(
        r#"
name = "hostile"
[[steps]]
name = "a"
consumer_type = "a"
command = "do_a"
compensation = "undo_a"
timeout = "5s"
"#,
    )
    .unwrap();
    store.register_definition(&definition).await.unwrap();
    let mut saga = SagaInstance::under(
        &definition,
        "hostile-1",
        json!({"note": "<script>alert('data')</script>"}),
        Utc::now(),
    );
    saga.status = SagaStatus::Running;
    saga.parked = Some("<img src=x onerror=alert('reason')>".into());
    let mut conn = store.pool().acquire().await.unwrap();
    store.insert(&mut conn, &saga).await.unwrap();
    fx
}

async fn count(fx: &common::Pg, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&fx.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_shows_what_sql_counts() {
    let fx = demo_database("120").await;
    let console = Console::start(&fx.url, &[]);

    let overview = page(&console, "/").await;
    for (state, sql) in [
        (
            "running",
            "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'running' AND parked_reason IS NULL",
        ),
        (
            "compensating",
            "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'compensating' AND parked_reason IS NULL",
        ),
        (
            "parked",
            "SELECT count(*) FROM sagabox_saga_instances WHERE parked_reason IS NOT NULL",
        ),
        (
            "completed",
            "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'completed'",
        ),
        (
            "compensated",
            "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'compensated'",
        ),
    ] {
        let shown = number_after(
            &overview,
            &format!("id=\"count-{state}\""),
            "<div class=\"n\">",
        );
        assert_eq!(shown, count(&fx, sql).await, "{state} on the overview");
    }
    let completed = count(
        &fx,
        "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'completed'",
    )
    .await;
    assert!(completed > 0, "the demo completed sagas");
    assert_eq!(
        number_after(&overview, r#"id="count-parked""#, r#"<div class="n">"#),
        1
    );
    // The per-definition table: checkout's completed cell.
    let checkout = text_after(
        &overview,
        r#"<a href="/sagas?saga=checkout&amp;status=completed">"#,
        "",
    );
    assert_eq!(checkout.parse::<i64>().unwrap(), completed);
    // Duplicates per consumer type, as the inbox rows count them.
    let duplicates = count(
        &fx,
        "SELECT COALESCE(SUM(duplicates), 0) FROM sagabox_inbox",
    )
    .await;
    assert!(duplicates > 0, "the demo delivered duplicates");
    let shown: i64 = overview
        .match_indices(r#"<td class="num in-inbox">"#)
        .map(|(at, m)| {
            let rest = &overview[at + m.len()..];
            rest[..rest.find('<').unwrap()].parse::<i64>().unwrap()
        })
        .sum();
    assert_eq!(shown, duplicates);
    let pending = count(
        &fx,
        "SELECT count(*) FROM sagabox_outbox WHERE sent_at IS NULL",
    )
    .await;
    assert_eq!(
        number_after(&overview, r#"id="outbox""#, r#"<div class="n">"#),
        pending
    );
    assert!(overview.contains("<svg class=\"chart\""), "the chart");
    assert!(
        overview.contains("completed</title>"),
        "bars for the finished sagas"
    );

    // The list: 50 a page, newest first, and the next page carries on without overlap.
    let all = count(&fx, "SELECT count(*) FROM sagabox_saga_instances").await;
    let first = page(&console, "/sagas").await;
    let links = saga_links(&first);
    assert_eq!(links.len() as i64, all.min(50));
    let next = text_after(&first, r#"id="next""#, "href=\"")
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let second = saga_links(&page(&console, &next).await);
    assert_eq!(second.len() as i64, (all - 50).min(50));
    assert!(
        second.iter().all(|link| !links.contains(link)),
        "pages do not overlap"
    );
    let compensated = page(&console, "/sagas?status=compensated&age=1h").await;
    let shown = saga_links(&compensated).len() as i64;
    let sql = count(
        &fx,
        "SELECT count(*) FROM sagabox_saga_instances WHERE status = 'compensated'",
    )
    .await;
    assert_eq!(shown, sql.min(50));
    assert_eq!(
        compensated
            .matches(r#"<span class="state compensated">"#)
            .count() as i64,
        shown
    );
    let (status, _) = get(&console, "/sagas?status=nonsense").await;
    assert_eq!(status, 400);

    // A saga's page: every event of its history, in the table and on the time axis.
    let id: String = sqlx::query_scalar(
        "SELECT saga_id FROM sagabox_saga_events GROUP BY saga_id ORDER BY count(*) DESC LIMIT 1",
    )
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    let saga = page(&console, &format!("/sagas/{id}")).await;
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sagabox_saga_events WHERE saga_id = $1")
            .bind(&id)
            .fetch_one(&fx.pool)
            .await
            .unwrap();
    assert_eq!(saga.matches("<tr data-kind=").count() as i64, events);
    assert!(saga.contains("<svg class=\"timeline\""));
    assert!(saga.contains("&quot;order_id&quot;"), "the saga's data");
    assert_eq!(get(&console, "/sagas/no-such-saga").await.0, 404);

    // Markup in a saga's data and parked reason is shown as text.
    let hostile = page(&console, "/sagas/hostile-1").await;
    assert!(
        hostile.contains("&lt;script&gt;alert('data')&lt;/script&gt;"),
        "{hostile}"
    );
    assert!(hostile.contains("&lt;img src=x onerror=alert('reason')&gt;"));
    assert!(!hostile.contains("<script>") && !hostile.contains("<img"));
    let listed = page(&console, "/sagas?status=parked").await;
    assert!(listed.contains("&lt;img src=x") && !listed.contains("<img"));
    assert!(
        !hostile.contains("id=\"actions\""),
        "no actions without --allow-actions"
    );

    // The inbox: a row per partition, adding up to the table's rows.
    let inbox = page(&console, "/inbox").await;
    let rows: i64 = inbox
        .match_indices(r#"<td class="num rows">"#)
        .map(|(at, m)| {
            let rest = &inbox[at + m.len()..];
            rest[..rest.find('<').unwrap()].parse::<i64>().unwrap()
        })
        .sum();
    assert_eq!(rows, count(&fx, "SELECT count(*) FROM sagabox_inbox").await);
    // The oldest and newest row of the whole inbox are the first oldest and last newest
    // shown (the demo's rows all fall in this month's partition).
    let shown = |class: &str| -> Vec<String> {
        let cell = format!(r#"<td class="{class}">"#);
        inbox
            .match_indices(&cell)
            .map(|(at, m)| {
                let rest = &inbox[at + m.len()..];
                rest[..rest.find('<').unwrap()].to_owned()
            })
            .filter(|text| text != "–")
            .collect()
    };
    let (oldest, newest): (String, String) = sqlx::query_as(
        "SELECT to_char(MIN(processed_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'), \
                to_char(MAX(processed_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') \
         FROM sagabox_inbox",
    )
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(shown("oldest").first(), Some(&oldest));
    assert_eq!(shown("newest").last(), Some(&newest));
    assert!(
        inbox.contains("30 d") && inbox.contains("14 d"),
        "TTL and broker retention"
    );
    assert!(inbox.contains(r#"id="next-drop""#));

    // No broker given: the dead-letter page says how to add one.
    assert!(page(&console, "/dead").await.contains("--amqp-url"));
    assert_eq!(get(&console, "/nowhere").await.0, 404);
    let css = page(&console, "/assets/console.css").await;
    assert!(css.contains("--ink"));
}

/// The same pages on the embedded database: a demo in an SQLite file, the overview's
/// counts, the chart and a timeline as SQL reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_read_an_sqlite_file_too() {
    let fx = common::Lite::new().await;
    let output = common::sagabox_command(&["demo", "--database-url", &fx.url, "--orders", "40"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "demo: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let console = Console::start(&fx.url, &[]);
    let overview = page(&console, "/").await;
    for state in ["completed", "compensated"] {
        let sql: i64 =
            sqlx::query_scalar("SELECT count(*) FROM sagabox_saga_instances WHERE status = $1")
                .bind(state)
                .fetch_one(&fx.pool)
                .await
                .unwrap();
        let shown = number_after(
            &overview,
            &format!("id=\"count-{state}\""),
            "<div class=\"n\">",
        );
        assert_eq!(shown, sql, "{state}");
    }
    assert!(overview.contains("completed</title>"), "the chart's bars");
    let list = page(&console, "/sagas?status=completed&age=1h").await;
    let first = saga_links(&list)
        .into_iter()
        .next()
        .expect("a completed saga");
    let saga = page(&console, &first).await;
    let id = first.trim_start_matches("/sagas/");
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sagabox_saga_events WHERE saga_id = $1")
            .bind(id)
            .fetch_one(&fx.pool)
            .await
            .unwrap();
    assert_eq!(saga.matches("<tr data-kind=").count() as i64, events);
    assert!(
        page(&console, "/inbox")
            .await
            .contains("table id=\"partitions\"")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_need_the_flag_the_csrf_token_and_off_loopback_the_token() {
    let fx = demo_database("5").await;

    // Without --allow-actions: no forms, and a POST is refused whatever it carries.
    let reading = Console::start(&fx.url, &[]);
    let (status, body) = post(&reading, "/sagas/hostile-1/retry", "csrf=anything").await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("--allow-actions"), "{body}");
    // A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) is refused.
    let rebound = client()
        .get(reading.url("/"))
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status().as_u16(), 403);
    drop(reading);

    let acting = Console::start(&fx.url, &["--allow-actions"]);
    let saga = page(&acting, "/sagas/hostile-1").await;
    assert!(saga.contains("id=\"actions\""));
    let token = csrf(&saga);
    assert_eq!(token.len(), 32);
    for form in ["", "csrf=", "csrf=0123456789abcdef0123456789abcdef"] {
        let (status, body) = post(&acting, "/sagas/hostile-1/retry", form).await;
        assert_eq!(status, 403, "{form}: {body}");
        assert!(body.contains("CSRF"), "{body}");
    }
    assert!(
        count(&fx, "SELECT count(*) FROM sagabox_saga_instances WHERE id = 'hostile-1' AND parked_reason IS NOT NULL").await == 1,
        "refused actions change nothing"
    );
    let (status, _) = post(
        &acting,
        "/sagas/hostile-1/retry",
        &format!("csrf={token}&note=fixed+it"),
    )
    .await;
    assert_eq!(status, 303);
    assert_eq!(
        count(
            &fx,
            "SELECT count(*) FROM sagabox_saga_instances WHERE id = 'hostile-1' AND parked_reason IS NULL"
        )
        .await,
        1
    );
    let detail: String = sqlx::query_scalar(
        "SELECT detail FROM sagabox_saga_events WHERE saga_id = 'hostile-1' AND kind = 'retried'",
    )
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(detail, "test-operator: console: fixed it");
    // Retrying it again is refused by the operator code, as the CLI refuses it.
    let (status, body) = post(&acting, "/sagas/hostile-1/retry", &format!("csrf={token}")).await;
    assert_eq!(status, 409, "{body}");
    let (status, _) = post(&acting, "/sagas/hostile-1/cancel", &format!("csrf={token}")).await;
    assert_eq!(status, 303);
    drop(acting);

    // Off loopback: refused to start without a token, and with one every request needs it.
    let output = common::sagabox_command(&[
        "console",
        "--database-url",
        &fx.url,
        "--listen",
        "0.0.0.0:0",
    ])
    .output()
    .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--token"));
    let secret = "a-secret-of-24-characters";
    let public = Console::start(
        &fx.url,
        &[
            "--listen",
            "0.0.0.0:0",
            "--token",
            secret,
            "--allow-actions",
        ],
    );
    assert_eq!(get(&public, "/").await.0, 401);
    assert_eq!(
        get(&public, "/?token=wrong-secret-of-24-chars").await.0,
        401
    );
    let (status, _) = post(&public, "/sagas/hostile-1/cancel", "csrf=x").await;
    assert_eq!(status, 401);
    let response = client()
        .get(public.url("/"))
        .bearer_auth(secret)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let response = client()
        .get(public.url(&format!("/sagas?token={secret}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let cookie = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let response = client()
        .get(public.url("/inbox"))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "the cookie carries the token"
    );
}

/// Dead letters of `payment` with these ids and details, `rejected`, published now.
async fn dead_letters(rabbit: &Rabbit, letters: &[(&str, &str)]) {
    rabbit.declare("payment").await;
    for (id, detail) in letters {
        let envelope = Envelope::new(MessageId::new(*id).unwrap(), "charge", json!({}))
            .unwrap()
            .with_published_at(Utc::now());
        let (body, properties) = codec::encode(&envelope);
        let properties = codec::with_headers(
            properties,
            [
                (DEAD_REASON_HEADER, AMQPValue::LongString("rejected".into())),
                (DEAD_DETAIL_HEADER, AMQPValue::LongString((*detail).into())),
            ],
        );
        rabbit
            .publish_raw(&rabbit.dead_queue("payment"), &body, properties)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_escaped_and_replayed() {
    let fx = common::Pg::new().await;
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(
        &rabbit,
        &[("m-1", "card expired"), ("m-2", "<b>bold</b> detail")],
    )
    .await;
    let queue = rabbit.queue("payment");
    let amqp = common::rabbit::amqp_url();
    let console = Console::start(
        &fx.url,
        &[
            "--amqp-url",
            &amqp,
            "--dead-letter-queue",
            &queue,
            "--allow-actions",
        ],
    );
    let overview = page(&console, "/").await;
    assert_eq!(
        number_after(&overview, r#"id="dead-letters""#, r#"<div class="n">"#),
        2
    );
    let dead = page(&console, "/dead").await;
    assert_eq!(number_after(&dead, r#"<span class="total">"#, ""), 2);
    assert!(dead.contains("m-1") && dead.contains("card expired") && dead.contains("rejected"));
    assert!(dead.contains("&lt;b&gt;bold&lt;/b&gt;") && !dead.contains("<b>"));
    assert_eq!(
        rabbit.ready(&rabbit.dead_queue("payment")).await,
        2,
        "listing takes nothing"
    );
    let (status, body) = post(&console, "/dead/replay", &format!("queue={queue}")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post(
        &console,
        "/dead/replay",
        &format!("csrf={}&queue={queue}", csrf(&dead)),
    )
    .await;
    assert_eq!(status, 303, "{body}");
    assert_eq!(rabbit.ready(&rabbit.dead_queue("payment")).await, 0);
    assert_eq!(
        rabbit.ready(&queue).await,
        2,
        "replayed to the source queue"
    );
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the screenshots go.
fn screenshot_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("SAGABOX_CONSOLE_SCREENSHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Decodes `png` and checks that it is a picture, not one colour.
fn assert_not_blank(png_bytes: &[u8], name: &str) {
    let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buffer = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buffer).unwrap();
    let pixels = &buffer[..info.buffer_size()];
    let step = info.color_type.samples();
    let mut colours = std::collections::HashSet::new();
    for pixel in pixels.chunks(step) {
        colours.insert(pixel.to_vec());
        if colours.len() > 16 {
            break;
        }
    }
    assert!(
        info.width >= 800 && colours.len() > 16,
        "{name}: {}x{} with {} colour(s)",
        info.width,
        info.height,
        colours.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_browser_loads_the_pages_and_clicks_through_to_a_saga() {
    use fantoccini::{ClientBuilder, Locator};

    for binary in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        assert!(
            std::path::Path::new(binary).exists(),
            "{binary} is missing: apt-get install -y chromium chromium-driver (.ci/run does)"
        );
    }
    let fx = demo_database("120").await;
    let rabbit = Rabbit::new(&["payment"]).await;
    dead_letters(&rabbit, &[("m-1", "card expired")]).await;
    let queue = rabbit.queue("payment");
    let amqp = common::rabbit::amqp_url();
    let console = Console::start(
        &fx.url,
        &[
            "--allow-actions",
            "--amqp-url",
            &amqp,
            "--dead-letter-queue",
            &queue,
        ],
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let driver = Driver {
        child: std::process::Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
        port,
    };
    let profile = tempdir();
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--window-size=1280,1000", "--hide-scrollbars",
                format!("--user-data-dir={}", profile.display()),
            ]
        }),
    );
    let mut browser = None;
    for _ in 0..100 {
        match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities.clone())
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
        {
            Ok(client) => {
                browser = Some(client);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let browser = browser.expect("chromedriver answers and starts chromium");
    let shots = screenshot_dir();
    let result = async {
        browser.goto(&console.url("/")).await?;
        let heading = browser.find(Locator::Css("h1")).await?.text().await?;
        assert_eq!(heading, "Overview");
        let completed = browser
            .find(Locator::Css("#count-completed .n"))
            .await?
            .text()
            .await?;
        assert!(completed.parse::<i64>().unwrap() > 0);
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "overview");
        std::fs::write(shots.join("console-overview.png"), &shot).unwrap();

        browser
            .find(Locator::LinkText("Sagas"))
            .await?
            .click()
            .await?;
        browser.find(Locator::Css("table#sagas")).await?;
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "sagas");
        std::fs::write(shots.join("console-sagas.png"), &shot).unwrap();

        // Through the filter to a compensated saga, whose timeline has a compensation.
        browser
            .goto(&console.url("/sagas?status=compensated"))
            .await?;
        let link = browser.find(Locator::Css("a.saga")).await?;
        let id = link.text().await?;
        link.click().await?;
        let shown = browser.find(Locator::Css("#saga-id")).await?.text().await?;
        assert_eq!(shown, id);
        assert!(browser.current_url().await?.path().ends_with(&id));
        let kinds = browser.find_all(Locator::Css("#timeline tbody tr")).await?;
        assert!(kinds.len() >= 4, "a timeline with its events");
        browser.find(Locator::Css("svg.timeline")).await?;
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "saga");
        std::fs::write(shots.join("console-saga.png"), &shot).unwrap();

        browser.goto(&console.url("/inbox")).await?;
        browser.find(Locator::Css("table#partitions")).await?;
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "inbox");
        std::fs::write(shots.join("console-inbox.png"), &shot).unwrap();

        // The hostile saga's markup is text in the browser too: no script ran.
        browser.goto(&console.url("/sagas/hostile-1")).await?;
        let data = browser.find(Locator::Css("#data")).await?.text().await?;
        assert!(data.contains("<script>alert('data')</script>"), "{data}");
        let alerts = browser.get_alert_text().await;
        assert!(alerts.is_err(), "no alert opened: {alerts:?}");

        // The parked saga retried with a note typed into its form, then cancelled: each
        // click posts its form and lands on the saga's page, which shows the new state.
        assert_eq!(state_shown(&browser, "parked").await?, "parked");
        let note = browser
            .find(Locator::Css(
                "form.action[action$='/retry'] input[name='note']",
            ))
            .await?;
        note.clear().await?;
        note.send_keys("fixed in the browser").await?;
        browser
            .find(Locator::Css("form.action[action$='/retry'] button"))
            .await?
            .click()
            .await?;
        assert_eq!(state_shown(&browser, "running").await?, "running");
        let retry_forms = browser
            .find_all(Locator::Css("form.action[action$='/retry']"))
            .await?;
        assert!(
            retry_forms.is_empty(),
            "no retry for a saga that is not parked"
        );
        assert_eq!(
            saga_row(&fx, "'retried'").await,
            (
                "running".to_owned(),
                false,
                "test-operator: console: fixed in the browser".to_owned()
            )
        );
        browser
            .find(Locator::Css("form.action[action$='/cancel'] button"))
            .await?
            .click()
            .await?;
        assert_eq!(state_shown(&browser, "compensating").await?, "compensating");
        assert_eq!(
            saga_row(&fx, "'cancelled'").await,
            (
                "compensating".to_owned(),
                false,
                "test-operator: console: cancelled from the console".to_owned()
            )
        );
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "cancelled saga");
        std::fs::write(shots.join("console-cancelled.png"), &shot).unwrap();

        // The dead letters, from the menu; "Replay all" sends them back to their queue
        // and the page, shown again, has none left.
        browser.goto(&console.url("/")).await?;
        browser
            .find(Locator::LinkText("Dead letters"))
            .await?
            .click()
            .await?;
        let row = browser
            .find(Locator::Css("section.queue tbody tr"))
            .await?
            .text()
            .await?;
        assert!(row.contains("m-1") && row.contains("card expired"), "{row}");
        let shot = browser.screenshot().await?;
        assert_not_blank(&shot, "dead letters");
        std::fs::write(shots.join("console-dead.png"), &shot).unwrap();
        browser
            .find(Locator::Css("form.action button"))
            .await?
            .click()
            .await?;
        // The click posts the form and the page is replaced: until the new one is there,
        // a read may find the old page's count, or an element gone with it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let total = loop {
            let read = async {
                browser
                    .find(Locator::Css("section.queue span.total"))
                    .await?
                    .text()
                    .await
            }
            .await;
            match read {
                Ok(total) if total == "0" || std::time::Instant::now() > deadline => break total,
                Err(error) if std::time::Instant::now() > deadline => return Err(error),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        assert_eq!(total, "0", "nothing left after the replay");
        assert!(browser.current_url().await?.path().ends_with("/dead"));
        Ok::<_, fantoccini::error::CmdError>(())
    }
    .await;
    let _ = browser.close().await;
    let _ = std::fs::remove_dir_all(&profile);
    result.unwrap();
    assert_eq!(
        rabbit.ready(&queue).await,
        1,
        "replayed to the source queue"
    );
    assert_eq!(rabbit.ready(&rabbit.dead_queue("payment")).await, 0);
}

/// The state the saga page in `browser` shows, once it shows `expected` or after ten
/// seconds: a click that posts a form replaces the page, and until the new one is
/// there a read finds the old page, or an element gone with it.
async fn state_shown(
    browser: &fantoccini::Client,
    expected: &str,
) -> Result<String, fantoccini::error::CmdError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let read = async {
            browser
                .find(fantoccini::Locator::Css("#state"))
                .await?
                .text()
                .await
        }
        .await;
        match read {
            Ok(state) if state == expected || std::time::Instant::now() > deadline => {
                return Ok(state);
            }
            Err(error) if std::time::Instant::now() > deadline => return Err(error),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The hostile saga's status, whether it is parked, and the detail of its one event of
/// `kind` (an SQL literal).
async fn saga_row(fx: &common::Pg, kind: &str) -> (String, bool, String) {
    let (status, parked): (String, bool) = sqlx::query_as(
        "SELECT status, parked_reason IS NOT NULL FROM sagabox_saga_instances WHERE id = 'hostile-1'",
    )
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    let detail: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT detail FROM sagabox_saga_events WHERE saga_id = 'hostile-1' AND kind = {kind}"
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    (status, parked, detail)
}

/// A fresh, empty folder for the browser's profile.
fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sagabox-chromium-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
