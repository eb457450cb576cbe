//! The HTTP side of the metrics endpoint: `/metrics` (Prometheus text), `/healthz` and
//! `/readyz` ([`crate::health`]), one HTTP/1 connection per task.

use std::convert::Infallible;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;

/// Accepts connections on `listener` for as long as the process runs.
pub(super) async fn serve(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: wait, rather than spin.
                tracing::warn!(%error, "metrics endpoint cannot accept a connection");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let handle = handle.clone();
                async move { Ok::<_, Infallible>(answer(&request, &handle).await) }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "metrics endpoint connection ended with an error");
            }
        });
    }
}

/// The answer to one request.
async fn answer(request: &Request<Incoming>, handle: &PrometheusHandle) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "GET or HEAD only\n".to_owned(),
        );
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".to_owned()),
        "/readyz" => {
            let readiness = crate::health::global().readiness().await;
            let status = if readiness.is_ready() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            text(status, readiness.report())
        }
        // Any other path serves the metrics, as the exporter's own listener did, so a
        // scrape configured for `/` keeps working.
        _ => {
            let mut response = text(StatusCode::OK, handle.render());
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            response
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
