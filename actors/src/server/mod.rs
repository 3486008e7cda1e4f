//! The OpenAI-compatible HTTP server of `deepinfer-node serve` (axum).
//!
//! Routes: `POST /v1/chat/completions` and `POST /v1/completions` (a JSON body, or server-sent
//! events with `stream: true`), `GET /v1/models`, `GET /health` (liveness: the process
//! answers), `GET /ready` (readiness: the engine's `EngineHealth`, 503 once stopped or
//! shutting down), `GET /metrics` (Prometheus text).
//!
//! Each request is one `EventStream`; a client that goes away drops it, which aborts the
//! request in the engine and counts it (`deepinfer_frontend_aborted_requests_total`). Placement
//! on DP ranks and the admission bound are the frontend's. Shutdown (`Server::run`'s signal):
//! stop accepting, let in-flight requests finish within the grace period, abort the rest,
//! return once every connection is closed. Formats are in `api.rs`, errors in `error.rs`.

pub mod api;
pub mod error;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::Stream;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

use crate::engine::stream::{EventStream, GenerationEvent};
use crate::engine::{Engine, EngineHandle};
use crate::error::EngineError;
use crate::job::format::{Endpoint, unix_now};
use crate::messages::supervisor::DrainReport;
use crate::supervisor::policy::EngineHealth;
use api::{ApiRequest, ChunkWriter, parse_request, response_body};
use error::ApiError;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Largest request body (bytes).
    pub max_body_bytes: usize,
    /// Grace period for in-flight requests after the shutdown signal.
    pub shutdown_timeout: Duration,
    /// The model name `/v1/models` lists and responses report when a body names none.
    pub model_name: String,
}

/// What every handler sees.
#[derive(Debug)]
struct Shared {
    engine: EngineHandle,
    model_name: String,
    created: u64,
    max_body_bytes: usize,
    metrics: Option<PrometheusHandle>,
    /// Set by the shutdown signal: readiness answers 503 from then on.
    draining: AtomicBool,
}

type AppState = Arc<Shared>;

/// A bound, not yet running server.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    shared: AppState,
    shutdown_timeout: Duration,
}

impl Server {
    /// Binds `options.listen` (port 0 picks a free port). `metrics` renders `/metrics`; `None`
    /// answers it 404 (no recorder installed).
    pub async fn bind(
        engine: &Engine,
        options: ServeOptions,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Server, EngineError> {
        let listener =
            TcpListener::bind(options.listen)
                .await
                .map_err(|e| EngineError::Config {
                    field: "server.listen".into(),
                    message: format!("cannot bind {}: {e}", options.listen),
                })?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                engine: engine.handle(),
                model_name: options.model_name,
                created: unix_now(),
                max_body_bytes: options.max_body_bytes,
                metrics,
                draining: AtomicBool::new(false),
            }),
            shutdown_timeout: options.shutdown_timeout,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, EngineError> {
        self.listener
            .local_addr()
            .map_err(|e| EngineError::internal(format!("the listener has no address: {e}")))
    }

    /// Serves until `shutdown` resolves, then stops accepting, drains the engine (in-flight
    /// requests may finish within the grace period; the rest end with `shutting_down`) and
    /// returns once the connections are closed.
    pub async fn run(
        self,
        engine: Engine,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<DrainReport, EngineError> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = router(self.shared.clone());
        let mut http = tokio::spawn(
            axum::serve(self.listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .into_future(),
        );
        tokio::select! {
            () = shutdown => {}
            result = &mut http => {
                return Err(EngineError::internal(format!("the HTTP server stopped: {result:?}")));
            }
        }
        tracing::info!("shutdown signal: no new connections, draining in-flight requests");
        self.shared.draining.store(true, Ordering::Release);
        let _ = stop.send(());
        let report = engine.shutdown(self.shutdown_timeout).await?;
        // Every request has ended, so every response is complete; idle keep-alive
        // connections are closed by the graceful shutdown.
        match tokio::time::timeout(Duration::from_secs(10), http).await {
            Ok(_) => {}
            Err(_) => tracing::warn!("connections still open 10 s after the drain; closing"),
        }
        Ok(report)
    }
}

/// The routes over `shared`.
fn router(shared: AppState) -> Router {
    let limit = shared.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .layer(DefaultBodyLimit::max(limit))
        .layer(TraceLayer::new_for_http())
        .with_state(shared)
}

async fn chat_completions(
    State(shared): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(&shared, Endpoint::ChatCompletions, body).await
}

async fn completions(
    State(shared): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(&shared, Endpoint::Completions, body).await
}

async fn generate(
    shared: &Shared,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return ApiError::too_large(shared.max_body_bytes).into_response();
        }
        Err(rejection) => return ApiError::invalid(rejection.body_text(), None).into_response(),
    };
    let ApiRequest {
        job,
        stream,
        include_usage,
    } = match parse_request(endpoint, &body, &shared.model_name) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let events = match shared.engine.generate(job.request.clone()).await {
        Ok(events) => events,
        Err(error) => return ApiError::from(error).into_response(),
    };
    let created = unix_now();
    if stream {
        let writer = ChunkWriter::new(
            endpoint,
            events.id().get(),
            &job.model,
            created,
            include_usage,
        );
        return Sse::new(sse_events(events, writer))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    // A client that disconnects drops this future and with it `events`: the request aborts.
    match events.collect().await {
        Ok(done) => axum::Json(response_body(&job, &done, created)).into_response(),
        Err(error) => ApiError::from(error).into_response(),
    }
}

/// The state of one SSE response.
struct SseState {
    events: EventStream,
    writer: ChunkWriter,
    /// Bytes of text already sent.
    sent: usize,
    queue: VecDeque<Event>,
    ended: bool,
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// The request's events as OpenAI chunks, `[DONE]` last; an engine error mid-stream is sent as
/// an `{"error": ...}` event and ends the stream. Dropping the stream (the client went away)
/// drops the `EventStream`, which aborts the request.
fn sse_events(
    events: EventStream,
    writer: ChunkWriter,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let queue: VecDeque<Event> = writer.start().iter().map(data).collect();
    let state = SseState {
        events,
        writer,
        sent: 0,
        queue,
        ended: false,
    };
    futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                return Some((Ok(event), s));
            }
            if s.ended {
                return None;
            }
            match s.events.next().await {
                Some(GenerationEvent::Token { text, .. }) => {
                    if !text.is_empty() {
                        s.sent += text.len();
                        s.queue.push_back(data(&s.writer.delta(&text)));
                    }
                }
                Some(GenerationEvent::Finished {
                    reason,
                    usage,
                    text,
                }) => {
                    // Text held back while it could have started a stop sequence.
                    let rest = text.get(s.sent..).unwrap_or_default();
                    for chunk in s.writer.finish(rest, reason, usage) {
                        s.queue.push_back(data(&chunk));
                    }
                    s.queue.push_back(Event::default().data("[DONE]"));
                    s.ended = true;
                }
                Some(GenerationEvent::Error(error)) => {
                    s.queue.push_back(data(&ApiError::from(error).body()));
                    s.ended = true;
                }
                None => s.ended = true,
            }
        }
    })
}

async fn models(State(shared): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": shared.model_name,
            "object": "model",
            "created": shared.created,
            "owned_by": "deepinfer",
        }],
    }))
    .into_response()
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// 200 while the engine serves (`running`, or `degraded` with the failed ranks named), 503
/// once it stopped or the server is shutting down.
async fn ready(State(shared): State<AppState>) -> Response {
    if shared.draining.load(Ordering::Acquire) {
        let body = json!({"status": "shutting_down"});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    let (status, body) = match shared.engine.health().await {
        Ok(EngineHealth::Running) => (StatusCode::OK, json!({"status": "running"})),
        Ok(EngineHealth::Degraded {
            failed_ranks,
            lost_services,
        }) => (
            StatusCode::OK,
            json!({
                "status": "degraded",
                "failed_ranks": failed_ranks.iter().map(|r| r.index()).collect::<Vec<_>>(),
                "lost_services": lost_services.iter().map(ToString::to_string).collect::<Vec<_>>(),
            }),
        ),
        Ok(EngineHealth::Stopped { reason }) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "stopped", "reason": reason}),
        ),
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "unreachable", "reason": error.to_string()}),
        ),
    };
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(shared): State<AppState>, uri: Uri) -> Response {
    match &shared.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => ApiError::not_found(uri.path()).into_response(),
    }
}
