//! A queue's real retention, read from the RabbitMQ management HTTP API:
//! [`measure_retention`] and [`check_retention`], which a [`Consumer`](super::Consumer)
//! runs on its durable queue before it takes a message.
//!
//! RabbitMQ bounds how long a queue keeps a message with the queue's `x-message-ttl`
//! argument, or a `message-ttl` in a policy (or an operator policy) applied to it; when
//! both are set, the lower applies. Neither is visible through AMQP, so the management
//! API is asked: the queue's arguments and the policies it has. A policy can only lower
//! the retention, so when no policy of the vhost sets a `message-ttl` below the queue's
//! argument, the argument is the answer without waiting for the API's statistics (which
//! report a new quorum queue's policy only after a few seconds).
//!
//! When the API cannot be reached, [`check_retention`] refuses to start and says how to
//! enable it, unless [`AmqpConfig::trust_declared_retention`] is set: then the
//! `x-message-ttl` sagabox declared is taken as the retention. That is sound when one is
//! declared, since RabbitMQ refuses a declare whose `x-message-ttl` differs from the
//! existing queue's, and a policy only lowers it.

use std::time::Duration;

use serde_json::Value;

use super::config::{AmqpConfig, AmqpError};
use crate::inbox::InboxConfig;
use crate::retention::{self, Retention};

/// Where a RabbitMQ queue's retention is set, for the retention check's messages.
pub const RETENTION_SETTING: &str = "the queue's x-message-ttl or a message-ttl policy";

/// How long one request to the management API may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long to wait for the API to report which policy a new queue has, when a policy
/// of the vhost could lower its retention.
const POLICY_WAIT: Duration = Duration::from_secs(12);

/// What a queue keeps messages for, as measured on the broker.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueRetention {
    /// The queue.
    pub queue: String,
    /// Its type as the broker reports it (`quorum`, `classic`), when known.
    pub queue_type: Option<String>,
    /// Its `x-message-ttl` argument.
    pub argument: Option<Duration>,
    /// The lowest `message-ttl` of the policy and operator policy applied to it.
    pub policy: Option<Duration>,
    /// What applies: the lower of the two, or unbounded when neither is set.
    pub retention: Retention,
    /// Whether it was read from the management API (`false`: the declared
    /// `x-message-ttl` was trusted, the API being out of reach).
    pub measured: bool,
}

/// Reads `queue`'s retention from the management API
/// ([`AmqpConfig::management_base`]), with the AMQP URL's credentials and vhost. For a
/// cluster's URL list (and no management URL of its own), each node's API is asked in
/// turn until one answers.
pub async fn measure_retention(
    config: &AmqpConfig,
    queue: &str,
) -> Result<QueueRetention, AmqpError> {
    let mut measured = Err(AmqpError::Config("no node in the URL list".into()));
    for node in api_nodes(config) {
        measured = measure_on(&node, queue).await;
        if !matches!(measured, Err(AmqpError::Management { .. })) {
            break;
        }
    }
    measured
}

/// The configurations whose management API to ask, in turn: each node's of a cluster's
/// URL list, or only the first node's when the API is configured (the credentials and
/// the vhost come from a node's URL).
fn api_nodes(config: &AmqpConfig) -> Vec<AmqpConfig> {
    let mut nodes = config.nodes();
    if config.management_url.is_some() {
        nodes.truncate(1);
    }
    nodes
}

/// [`measure_retention`] through one node's API.
async fn measure_on(config: &AmqpConfig, queue: &str) -> Result<QueueRetention, AmqpError> {
    let api = Api::new(config, queue)?;
    let mut info = api
        .get(&format!("queues/{}/{}", api.vhost, encode(queue)))
        .await?;
    let argument = info
        .get("arguments")
        .and_then(|arguments| arguments.get("x-message-ttl"))
        .and_then(millis);
    let mut lowering = Vec::new();
    for kind in ["policies", "operator-policies"] {
        let listed = api.get(&format!("{kind}/{}", api.vhost)).await?;
        for policy in listed.as_array().into_iter().flatten() {
            let ttl = policy
                .get("definition")
                .and_then(|definition| definition.get("message-ttl"))
                .and_then(millis);
            if let Some(ttl) = ttl
                && argument.is_none_or(|argument| ttl < argument)
            {
                lowering.push((
                    policy
                        .get("name")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    ttl,
                ));
            }
        }
    }
    let mut policy = None;
    if !lowering.is_empty() {
        // A policy could lower the retention: learn which applies to the queue. The API
        // reports a quorum queue's policy with its statistics, a few seconds after the
        // queue is declared; until then its effective definition is null.
        let deadline = tokio::time::Instant::now() + POLICY_WAIT;
        while info
            .get("effective_policy_definition")
            .is_none_or(Value::is_null)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(500)).await;
            info = api
                .get(&format!("queues/{}/{}", api.vhost, encode(queue)))
                .await?;
        }
        let mut applied: Vec<Duration> = info
            .get("effective_policy_definition")
            .and_then(|definition| definition.get("message-ttl"))
            .and_then(millis)
            .into_iter()
            .collect();
        for field in ["policy", "operator_policy"] {
            if let Some(name) = info.get(field).and_then(Value::as_str) {
                applied.extend(
                    lowering
                        .iter()
                        .filter(|(policy, _)| policy.as_deref() == Some(name))
                        .map(|(_, ttl)| *ttl),
                );
            }
        }
        // Not reported in time: the argument alone is still an upper bound (a policy
        // only lowers it), so the check stays on the safe side.
        policy = applied.into_iter().min();
    }
    let retention = match (argument, policy) {
        (Some(argument), Some(policy)) => Retention::Bounded(argument.min(policy)),
        (Some(ttl), None) | (None, Some(ttl)) => Retention::Bounded(ttl),
        (None, None) => Retention::Unbounded,
    };
    Ok(QueueRetention {
        queue: queue.to_owned(),
        queue_type: info.get("type").and_then(Value::as_str).map(str::to_owned),
        argument,
        policy,
        retention,
        measured: true,
    })
}

/// Measures `queue`'s retention and checks it against `inbox`'s TTL
/// ([`retention::check`]): an error when the queue keeps messages longer than the TTL,
/// or without limit, unless `inbox` allows it (then logged as a warning). When the
/// management API is out of reach, the declared `x-message-ttl` stands in for the
/// measure if [`AmqpConfig::trust_declared_retention`] is set, with a warning.
pub async fn check_retention(
    config: &AmqpConfig,
    queue: &str,
    inbox: &InboxConfig,
) -> Result<QueueRetention, AmqpError> {
    let measured = match measure_retention(config, queue).await {
        Ok(measured) => measured,
        Err(error @ AmqpError::Management { .. }) if config.trust_declared_retention => {
            tracing::warn!(
                queue,
                %error,
                "the management API is out of reach; trusting the declared x-message-ttl"
            );
            QueueRetention {
                queue: queue.to_owned(),
                queue_type: None,
                argument: config.message_ttl,
                policy: None,
                retention: config
                    .message_ttl
                    .map_or(Retention::Unbounded, Retention::Bounded),
                measured: false,
            }
        }
        Err(error) => return Err(error),
    };
    retention::check(queue, measured.retention, inbox, RETENTION_SETTING)?;
    tracing::debug!(
        queue,
        retention = %measured.retention,
        ttl_days = inbox.ttl.as_secs_f64() / 86_400.0,
        "the queue's retention is within the inbox ttl"
    );
    Ok(measured)
}

/// The durable queues named `<prefix>.…` on the broker, except the `.dead` ones, each
/// with its retention: what `sagabox inspect` reports beside the inbox TTL.
pub async fn prefixed_queues(config: &AmqpConfig) -> Result<Vec<QueueRetention>, AmqpError> {
    let mut listed = Err(AmqpError::Config("no node in the URL list".into()));
    for node in api_nodes(config) {
        listed = prefixed_queues_on(&node).await;
        if !matches!(listed, Err(AmqpError::Management { .. })) {
            break;
        }
    }
    listed
}

/// [`prefixed_queues`] through one node's API.
async fn prefixed_queues_on(config: &AmqpConfig) -> Result<Vec<QueueRetention>, AmqpError> {
    let api = Api::new(config, &format!("{}.*", config.queue_prefix))?;
    let listed = api
        .get(&format!("queues/{}?columns=name,durable", api.vhost))
        .await?;
    let start = format!("{}.", config.queue_prefix);
    let mut names: Vec<String> = listed
        .as_array()
        .into_iter()
        .flatten()
        .filter(|queue| queue.get("durable").and_then(Value::as_bool) == Some(true))
        .filter_map(|queue| queue.get("name").and_then(Value::as_str))
        .filter(|name| name.starts_with(&start) && !name.ends_with(crate::dlq::DEAD_SUFFIX))
        .map(str::to_owned)
        .collect();
    names.sort();
    let mut queues = Vec::with_capacity(names.len());
    for name in names {
        queues.push(measure_on(config, &name).await?);
    }
    Ok(queues)
}

/// The management API's HTTP client: plain HTTP, or HTTPS with sagabox's rustls
/// configuration.
type HttpClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Empty<hyper::body::Bytes>,
>;

/// Requests to the management API about one queue (named in errors).
struct Api {
    client: HttpClient,
    base: String,
    vhost: String,
    authorization: String,
    queue: String,
}

impl Api {
    fn new(config: &AmqpConfig, queue: &str) -> Result<Self, AmqpError> {
        use base64::Engine;
        let base = config.management_base();
        let uri: lapin::uri::AMQPUri = config
            .url
            .parse()
            .map_err(|reason: String| AmqpError::Config(format!("the broker URL: {reason}")))?;
        // Over HTTPS the API trusts and presents what the AMQP URL's TLS does.
        let tls = config
            .load_tls()?
            .client_config(&format!("the management API at {base}"))?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector);
        let credentials = format!(
            "{}:{}",
            uri.authority.userinfo.username, uri.authority.userinfo.password
        );
        Ok(Self {
            client,
            base,
            vhost: encode(&uri.vhost),
            authorization: format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(credentials)
            ),
            queue: queue.to_owned(),
        })
    }

    async fn get(&self, path: &str) -> Result<Value, AmqpError> {
        use http_body_util::BodyExt;
        let failed = |reason: String| AmqpError::Management {
            url: self.base.clone(),
            queue: self.queue.clone(),
            reason,
        };
        let url = format!("{}/api/{path}", self.base);
        let request = hyper::Request::get(&url)
            .header(hyper::header::AUTHORIZATION, &self.authorization)
            .body(http_body_util::Empty::new())
            .map_err(|error| failed(format!("{url} is not a URL ({error})")))?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|error| {
                let words = crate::tls::error_chain(&error);
                match crate::tls::handshake_advice(&words, &self.host(), "cacertfile", None) {
                    Some(advice) if self.base.starts_with("https://") => {
                        failed(format!("no answer over HTTPS: {advice}"))
                    }
                    _ => failed(format!("no answer ({words})")),
                }
            })?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|error| failed(format!("the answer broke off ({error})")))?
                .to_bytes();
            Ok::<_, AmqpError>((status, body))
        };
        let (status, body) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| failed(format!("no answer within {REQUEST_TIMEOUT:?}")))??;
        if status == hyper::StatusCode::UNAUTHORIZED {
            return Err(failed(
                "it refused the AMQP URL's credentials (401); the user needs the management \
                 or monitoring tag"
                    .to_owned(),
            ));
        }
        if status == hyper::StatusCode::NOT_FOUND {
            return Err(failed(format!(
                "it does not know /api/{path} (404): the queue or vhost does not exist"
            )));
        }
        if !status.is_success() {
            return Err(failed(format!("/api/{path} answered {status}")));
        }
        serde_json::from_slice(&body)
            .map_err(|error| failed(format!("the answer to /api/{path} is not JSON ({error})")))
    }

    /// The API's host name, for what a refused certificate means.
    fn host(&self) -> String {
        let rest = self
            .base
            .split_once("://")
            .map_or(self.base.as_str(), |(_, rest)| rest);
        let authority = rest.split('/').next().unwrap_or(rest);
        authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host)
            .to_owned()
    }
}

/// A TTL in milliseconds, as the API gives it.
fn millis(value: &Value) -> Option<Duration> {
    value.as_u64().map(Duration::from_millis)
}

/// `value` as one path segment: every byte but the unreserved ones percent-encoded (the
/// default vhost `/` is `%2F`).
fn encode(value: &str) -> String {
    let mut encoded = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(encode("/"), "%2F");
        assert_eq!(encode("sagabox.payment"), "sagabox.payment");
        assert_eq!(encode("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn the_management_url_defaults_to_the_brokers_host() {
        let config = AmqpConfig::new("amqps://guest:guest@rabbit.internal/%2f?cacertfile=ca.pem");
        assert_eq!(config.management_base(), "https://rabbit.internal:15671");
        let config = AmqpConfig::new("amqp://guest:guest@rabbit.internal:5672/%2f");
        assert_eq!(config.management_base(), "http://rabbit.internal:15672");
        let mut config = config;
        config.management_url = Some("http://127.0.0.1:15673/".into());
        assert_eq!(config.management_base(), "http://127.0.0.1:15673");
    }
}
