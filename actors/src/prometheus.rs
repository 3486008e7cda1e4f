//! The opt-in Prometheus endpoint: a recorder from `metrics-exporter-prometheus` and a tiny
//! tokio TCP handler that answers `GET /metrics` with `render()`. It binds loopback addresses
//! only (the endpoint has no authentication). Installing the recorder is process-wide (the
//! `metrics` facade's one global), so only the binary does it; libraries just record.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::EngineError;

/// Histogram buckets (seconds) for every duration histogram: from 100 µs steps to requests of
/// several minutes.
pub const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];

fn config_error(message: impl std::fmt::Display) -> EngineError {
    EngineError::Config {
        field: "metrics.prometheus_listen".into(),
        message: message.to_string(),
    }
}

fn builder() -> Result<PrometheusBuilder, EngineError> {
    PrometheusBuilder::new()
        .set_buckets(DURATION_BUCKETS)
        .map_err(config_error)
}

/// A recorder that is not installed globally (tests, embedding apps with their own recorder).
pub fn local_recorder() -> Result<PrometheusRecorder, EngineError> {
    Ok(builder()?.build_recorder())
}

/// Installs the global recorder and registers the metric descriptions.
pub fn install() -> Result<PrometheusHandle, EngineError> {
    let handle = builder()?.install_recorder().map_err(config_error)?;
    crate::metrics::describe();
    Ok(handle)
}

/// A running endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `handle` on `addr` (loopback only; port 0 picks a free port).
pub async fn serve(
    handle: PrometheusHandle,
    addr: SocketAddr,
) -> Result<MetricsServer, EngineError> {
    if !addr.ip().is_loopback() {
        return Err(config_error(format!(
            "{addr} is not a loopback address; the endpoint binds loopback only"
        )));
    }
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| config_error(format!("cannot bind {addr}: {e}")))?;
    let addr = listener.local_addr().map_err(config_error)?;
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handle = handle.clone();
            tokio::spawn(async move {
                if let Err(e) = answer(stream, &handle).await {
                    tracing::debug!(error = %e, "metrics request failed");
                }
            });
        }
    });
    tracing::info!(%addr, "Prometheus metrics on http://{addr}/metrics");
    Ok(MetricsServer { addr, task })
}

async fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let (status, content_type, body) =
        if head.starts_with(b"GET /metrics ") || head.starts_with(b"GET /metrics?") {
            ("200 OK", "text/plain; version=0.0.4", handle.render())
        } else {
            (
                "404 Not Found",
                "text/plain",
                "only GET /metrics is served\n".to_string(),
            )
        };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_rendered_metrics_on_loopback_only() {
        let recorder = local_recorder().unwrap();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!(crate::metrics::ERRORS_TOTAL, "code" => "overloaded").increment(3);
        });
        let server = serve(handle, "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let page = get(server.addr, "/metrics").await;
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        assert!(
            page.contains("deepinfer_errors_total{code=\"overloaded\"} 3"),
            "{page}"
        );
        assert!(get(server.addr, "/other").await.starts_with("HTTP/1.1 404"));
        let refused = serve(recorder.handle(), "0.0.0.0:0".parse().unwrap())
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("loopback"));
    }
}
