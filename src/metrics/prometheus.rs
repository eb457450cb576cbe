//! The Prometheus endpoint (feature `prometheus`): [`install_prometheus`] installs the
//! global recorder with the catalogue's buckets and serves the text format over HTTP.

use std::net::{SocketAddr, ToSocketAddrs};

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

use super::{
    CATALOGUE, LATENCY_BUCKETS, LONG_BUCKETS, OUTBOX_LAG_SECONDS, SAGA_DURATION_SECONDS,
    register_catalogue,
};

/// Why the metrics endpoint could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The listen address is not `HOST:PORT`, or its host does not resolve.
    #[error("invalid metrics address {addr:?}: {reason}; give HOST:PORT, e.g. 127.0.0.1:9464")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The exporter could not start: the port is taken, or a recorder is already
    /// installed in this process (install once, at start-up).
    #[error("cannot start the Prometheus endpoint on {addr}: {source}")]
    Install {
        /// The address it tried to listen on.
        addr: SocketAddr,
        /// The exporter's error.
        #[source]
        source: BuildError,
    },
}

/// The exporter's builder with sagabox's histogram buckets: [`LATENCY_BUCKETS`] (100 µs
/// to 10 s) for every histogram, [`LONG_BUCKETS`] (10 ms to 1 h) for whole sagas and the
/// outbox lag. Add a listener (or use [`build_recorder`](PrometheusBuilder::build_recorder))
/// to embed it in another setup. (`set_buckets*` only fail on an empty list; the
/// catalogue's are not, which a unit test checks.)
pub fn prometheus_builder() -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(SAGA_DURATION_SECONDS.to_owned()),
            LONG_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full(OUTBOX_LAG_SECONDS.to_owned()), LONG_BUCKETS)
}

/// Starts serving Prometheus text at `http://ADDR/metrics` (any path answers) and
/// installs the recorder every sagabox metric goes to, with the catalogue described, the
/// metrics without labels registered at zero and `sagabox_build_info` set (see
/// [`register_catalogue`]). Call it once per process, from
/// within a Tokio runtime; `addr` is `HOST:PORT` (`0.0.0.0:9464` to listen on every
/// interface). Returns the address it listens on.
pub fn install_prometheus(addr: &str) -> Result<SocketAddr, MetricsError> {
    let socket = resolve(addr)?;
    prometheus_builder()
        .and_then(|builder| builder.with_http_listener(socket).install())
        .map_err(|source| MetricsError::Install {
            addr: socket,
            source,
        })?;
    register_catalogue();
    tracing::info!(%socket, metrics = CATALOGUE.len(), "prometheus endpoint listening");
    Ok(socket)
}

fn resolve(addr: &str) -> Result<SocketAddr, MetricsError> {
    let invalid = |reason: String| MetricsError::InvalidAddress {
        addr: addr.to_owned(),
        reason,
    };
    if addr.trim().is_empty() {
        return Err(invalid("it is empty".to_owned()));
    }
    if !addr.contains(':') {
        return Err(invalid("it has no port".to_owned()));
    }
    addr.to_socket_addrs()
        .map_err(|error| invalid(error.to_string()))?
        .next()
        .ok_or_else(|| invalid("the host resolves to no address".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_validated() {
        assert_eq!(
            resolve("127.0.0.1:9464").ok(),
            Some(SocketAddr::from(([127, 0, 0, 1], 9464)))
        );
        assert!(resolve("localhost:9464").is_ok());
        for bad in [
            "",
            "  ",
            "9464",
            "127.0.0.1",
            "127.0.0.1:notaport",
            "[::1:9464",
        ] {
            let error = resolve(bad).expect_err(bad);
            assert!(error.to_string().contains("HOST:PORT"), "{error}");
        }
    }

    #[test]
    fn the_builder_takes_the_buckets() {
        assert!(prometheus_builder().is_ok());
    }
}
