//! The Prometheus endpoint (feature `prometheus`): [`install_prometheus`] installs the
//! global recorder with the catalogue's buckets and serves, over HTTP, the text format at
//! `/metrics` beside the process's health at `/healthz` and `/readyz`
//! ([`crate::health`]).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

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
    /// The address cannot be listened on: the port is taken, or the host is not one
    /// of this machine's.
    #[error("cannot listen on {addr} for the metrics endpoint: {source}; choose a free port")]
    Bind {
        /// The address it tried to listen on.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The recorder could not be installed: one is already installed in this process
    /// (install once, at start-up).
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

/// How often the recorder's histograms are compacted (the exporter's own listener does
/// it as often).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Starts serving, at `http://ADDR`, Prometheus text at `/metrics`, `/healthz` (200 while
/// the process serves) and `/readyz` (200 when its database answers and every consumer
/// is connected and consuming, 503 with the reason otherwise; see [`crate::health`]),
/// and installs the recorder every sagabox metric goes to, with the catalogue described,
/// the metrics without labels registered at zero and `sagabox_build_info` set (see
/// [`register_catalogue`]). Call it once per process, from within a Tokio runtime;
/// `addr` is `HOST:PORT` (`0.0.0.0:9464` to listen on every interface). Returns the
/// address it listens on.
pub fn install_prometheus(addr: &str) -> Result<SocketAddr, MetricsError> {
    let socket = resolve(addr)?;
    // Bound here, before the recorder is installed: a port in use is said at once.
    let listener = std::net::TcpListener::bind(socket)
        .and_then(|listener| listener.set_nonblocking(true).map(|()| listener))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|source| MetricsError::Bind {
            addr: socket,
            source,
        })?;
    let bound = listener.local_addr().unwrap_or(socket);
    let handle = prometheus_builder()
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|source| MetricsError::Install {
            addr: socket,
            source,
        })?;
    register_catalogue();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(super::endpoint::serve(listener, handle));
    tracing::info!(socket = %bound, metrics = CATALOGUE.len(), "metrics and health endpoint listening");
    Ok(bound)
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
