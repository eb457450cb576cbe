//! Scraping a Prometheus endpoint with a bare HTTP/1.1 request (no client crate needed),
//! and reading values out of the text format.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A port that was free a moment ago, for an endpoint to listen on.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}

/// The body of `GET /metrics`, or the connection error (the endpoint is not up yet).
pub async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let (status, body) = get(addr, "/metrics").await?;
    assert_eq!(status, 200, "scrape answered {status}: {body}");
    Ok(body)
}

/// `GET path` on `addr`: the status code and the body.
pub async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)).await??;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response)).await??;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head:?}"));
    Ok((status, body.to_owned()))
}

/// Polls `GET /readyz` every 20 ms until it answers `want`, and returns the body then;
/// panics after `within`, with the last answer.
pub async fn readyz_becomes(addr: SocketAddr, want: u16, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let answer = get(addr, "/readyz").await;
        if let Ok((status, body)) = &answer
            && *status == want
        {
            return body.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/readyz did not answer {want} within {within:?}: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the text has a series of metric `name` (with or without labels; for a
/// histogram, its `_bucket`, `_sum` and `_count` series).
pub fn has_metric(text: &str, name: &str) -> bool {
    text.lines().any(|line| {
        line.strip_prefix(name).is_some_and(|rest| {
            let rest = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| rest.strip_prefix(suffix))
                .unwrap_or(rest);
            rest.starts_with('{') || rest.starts_with(' ')
        })
    })
}

/// Whether the text has a series of metric `name` without any label of its own (for a
/// histogram, a `_bucket` series with only `le`, or a bare `_sum` or `_count`).
pub fn has_unlabelled_series(text: &str, name: &str) -> bool {
    text.lines().any(|line| {
        line.strip_prefix(name).is_some_and(|rest| {
            rest.starts_with(' ')
                || rest.starts_with("{}")
                || rest.starts_with("_bucket{le=")
                || rest.starts_with("_sum ")
                || rest.starts_with("_count ")
        })
    })
}

/// The sum of the values of every series of `name` whose labels contain all of `labels`
/// (`key="value"` strings).
pub fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
