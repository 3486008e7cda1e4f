//! The OpenAI-compatible HTTP server of `deepinfer-node serve` (axum).
//!
//! Routes: `POST /v1/chat/completions` and `POST /v1/completions` (a JSON body, or server-sent
//! events with `stream: true`), `GET /v1/models`, `GET /health` (liveness: the process
//! answers), `GET /ready` (readiness: the engine's `EngineHealth`, 503 once stopped or
//! shutting down), `GET /metrics` (Prometheus text).
//!
//! Bodies, validation, defaults, responses, stream chunks and error objects are the OpenAI
//! request surface the offline job uses too (`crate::openai`): the server only reads the body,
//! runs each of the request's `n` choices on the engine and sends what the surface builds. An
//! error is `{"error": {...}}` with its status (400 naming the field, 404, 413, 429 with
//! `Retry-After`, 500, 503); an error in the middle of a stream is sent as that object in a last
//! `data:` event (no `[DONE]`).
//!
//! Each choice is one `EventStream`; a client that goes away drops it, which aborts the
//! request in the engine and counts it (`deepinfer_frontend_aborted_requests_total`). Placement
//! on DP ranks and the admission bound are the frontend's. Shutdown (`Server::run`'s signal):
//! stop accepting, let in-flight requests finish within the grace period, abort the rest,
//! return once every connection is closed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{Stream, StreamExt};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower_http::trace::TraceLayer;

use crate::engine::{Engine, EngineHandle};
use crate::error::EngineError;
use crate::messages::supervisor::DrainReport;
use crate::openai::{
    self, ApiError, ChoiceStream, Endpoint, ServedModel, model_list, response_id, unix_now,
};
use crate::supervisor::policy::EngineHealth;

/// Seconds a client is told to wait after a 429.
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Largest request body (bytes).
    pub max_body_bytes: usize,
    /// Grace period for in-flight requests after the shutdown signal.
    pub shutdown_timeout: Duration,
    /// The model `/v1/models` lists and every response reports, and the request surface's
    /// limits (context, thinking default).
    pub served: ServedModel,
}

/// What every handler sees.
#[derive(Debug)]
struct Shared {
    engine: EngineHandle,
    served: ServedModel,
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
                served: options.served,
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
        Err(rejection) => return ApiError::request(rejection.body_text()).into_response(),
    };
    let body: Value = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(e) => {
            return ApiError::request(format!("the body is not valid JSON: {e}")).into_response();
        }
    };
    let request = match openai::parse(endpoint, &body, &shared.served) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    // Every choice is admitted before anything is answered; a refusal drops (aborts) the
    // choices already admitted.
    let mut choices = Vec::with_capacity(request.n);
    for choice in request.choice_requests(None) {
        match shared.engine.generate(choice).await {
            Ok(events) => choices.push(events),
            Err(error) => return ApiError::from_engine(&error).into_response(),
        }
    }
    let created = unix_now();
    if request.stream {
        let id = response_id(endpoint, choices[0].id().get());
        let streams: Vec<ChoiceStream> = choices
            .into_iter()
            .enumerate()
            .map(|(index, events)| {
                request.choice_stream(index, &id, &shared.served, created, events)
            })
            .collect();
        return Sse::new(sse_events(futures_util::stream::select_all(streams)))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    // A client that disconnects drops this future and with it the choices: they abort.
    let collected = futures_util::future::join_all(choices.into_iter().map(|c| c.collect())).await;
    let mut done = Vec::with_capacity(collected.len());
    for result in collected {
        match result {
            Ok(completion) => done.push(completion),
            Err(error) => return ApiError::from_engine(&error).into_response(),
        }
    }
    match request.response(&shared.served, &done, created).await {
        Ok(body) => axum::Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// The chunks as SSE events, `[DONE]` last; an error is sent as its `{"error": ...}` object and
/// ends the stream. Dropping the stream (the client went away) drops the choices' event
/// streams, which aborts them.
fn sse_events(
    chunks: impl Stream<Item = Result<Value, ApiError>> + Send + Unpin,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    futures_util::stream::unfold(Some(chunks), |chunks| async move {
        let mut chunks = chunks?;
        let event = match chunks.next().await {
            Some(Ok(chunk)) => return Some((Ok(data(&chunk)), Some(chunks))),
            Some(Err(error)) => data(&error.body()),
            None => Event::default().data("[DONE]"),
        };
        Some((Ok(event), None))
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        response
    }
}

async fn models(State(shared): State<AppState>) -> Response {
    axum::Json(model_list(&shared.served, shared.created)).into_response()
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
