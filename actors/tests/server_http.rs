//! The HTTP server over real loopback sockets on the demo model (two DP ranks): routes, OpenAI
//! errors (400 naming the field, 413, 429 with Retry-After), streamed text equal to the JSON
//! answer, a client disconnect aborting its request in the engine (counted, state freed), and
//! graceful shutdown letting an in-flight stream finish. The raw HTTP client here is
//! deliberately dumb; the real-client test is `tests/python/openai_client.py`.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use deepinfer_actors::openai::ServedModel;
use deepinfer_actors::server::{ServeOptions, Server};
use deepinfer_actors::{Engine, EngineHandle, prometheus};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_BODY: usize = 4096;

async fn start_demo_engine() -> (Engine, ServedModel, tempfile::TempDir) {
    common::demo_engine::start_demo_engine(
        "[model]\nsource = \"demo\"\n[device]\nbackend = \"cpu\"\n[parallel]\ndp = 2\nep = 1\n\
         [scheduler]\nmax_batched_tokens = 1024\nmax_running_requests = 8\n\
         prefill_chunk_tokens = 256\noverlap_depth = 2\nadmission_queue_capacity = 2\n\
         [sampling]\nmax_tokens = 16\n",
        "server test",
    )
    .await
}

/// Writes one HTTP/1.1 request (`Connection: close`) and returns the open socket.
async fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await.expect("write");
    socket.write_all(body.as_bytes()).await.expect("write");
    socket
}

/// A whole response: status, head (lower-cased) and body.
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

async fn read_reply(mut socket: TcpStream) -> Reply {
    let mut raw = Vec::new();
    socket.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    let status = head[9..12].parse().expect("status code");
    Reply {
        status,
        head: head.to_lowercase(),
        body: body.to_string(),
    }
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    read_reply(send(addr, method, path, body).await).await
}

/// Reads until the first `data:` event of a stream has arrived.
async fn await_first_event(socket: &mut TcpStream) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = socket.read(&mut buf).await.expect("read");
        assert!(
            n > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
}

/// The value of an unlabelled-or-labelled sample in `/metrics` (0 when absent).
async fn metric(addr: SocketAddr, sample: &str) -> f64 {
    let page = call(addr, "GET", "/metrics", None).await.body;
    page.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

/// Text of a completion: the JSON answer, or the streamed deltas concatenated.
fn completion_text(body: &Value) -> String {
    let choice = &body["choices"][0];
    choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .expect("a text")
        .to_string()
}

fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).expect("chunk JSON"))
        .filter_map(|c| {
            let choice = c["choices"].get(0)?.clone();
            choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .map(str::to_string)
        })
        .collect()
}

async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn engine_is_empty(engine: &EngineHandle) -> bool {
    let stats = engine.scheduler_stats().await.expect("stats");
    stats
        .iter()
        .all(|s| s.running == 0 && s.waiting == 0 && s.rank_live_sequences == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_api_over_loopback() {
    let metrics = prometheus::install().expect("the recorder installs once");
    let (engine, served, _dir) = start_demo_engine().await;
    let handle = engine.handle();
    let options = ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        max_body_bytes: MAX_BODY,
        shutdown_timeout: Duration::from_secs(30),
        served,
    };
    let server = Server::bind(&engine, options, Some(metrics))
        .await
        .expect("binds");
    let addr = server.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(engine, async move {
        let _ = stopped.await;
    }));

    // Liveness, readiness, models, metrics, unknown routes.
    let health = call(addr, "GET", "/health", None).await;
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let ready = call(addr, "GET", "/ready", None).await;
    assert_eq!(
        (ready.status, ready.json()["status"].clone()),
        (200, json!("running"))
    );
    let models = call(addr, "GET", "/v1/models", None).await.json();
    assert_eq!(models["data"][0]["id"], "deepinfer-demo");
    let page = call(addr, "GET", "/metrics", None).await;
    assert_eq!(page.status, 200);
    assert!(
        page.head.contains("content-type: text/plain"),
        "{}",
        page.head
    );
    let missing = call(addr, "GET", "/v2/nothing", None).await;
    assert_eq!(missing.status, 404);
    assert!(
        missing.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v2/nothing")
    );

    // The JSON answer and the streamed one carry the same text for the same seed.
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "The sea", "max_tokens": 6, "seed": 7, "temperature": 0.9, "stop": ["zz"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 7}),
        ),
    ] {
        let whole = call(addr, "POST", path, Some(&body.to_string())).await;
        assert_eq!(whole.status, 200, "{}", whole.body);
        let whole = whole.json();
        assert_eq!(whole["usage"]["completion_tokens"], 6, "{whole}");
        let mut streamed_body = body.clone();
        streamed_body["stream"] = json!(true);
        streamed_body["stream_options"] = json!({"include_usage": true});
        let streamed = call(addr, "POST", path, Some(&streamed_body.to_string())).await;
        assert!(
            streamed.head.contains("content-type: text/event-stream"),
            "{}",
            streamed.head
        );
        let events = streamed.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 6, "{usage}");
        let text = completion_text(&whole);
        assert!(!text.is_empty());
        assert_eq!(streamed_text(&events), text, "{path}");
    }

    // Bad requests: 400 naming the field, 413 over the body limit.
    let cases = [
        (
            r#"{"prompt": "x", "temperature": "hot"}"#,
            Some("temperature"),
            "`temperature` must be a number",
        ),
        (
            r#"{"prompt": "x", "max_tokens": 100000000}"#,
            Some("max_tokens"),
            "`max_tokens` = 100000000 is out of range",
        ),
        (r#"{"prompt": "x""#, None, "not valid JSON"),
    ];
    for (body, param, needle) in cases {
        let reply = call(addr, "POST", "/v1/completions", Some(body)).await;
        assert_eq!(reply.status, 400, "{}", reply.body);
        let error = &reply.json()["error"];
        assert_eq!(error["param"].as_str(), param, "{error}");
        assert_eq!(error["type"], "invalid_request_error");
        assert!(
            error["message"].as_str().unwrap().contains(needle),
            "{error}"
        );
    }
    let huge = json!({"prompt": "x".repeat(MAX_BODY)}).to_string();
    let reply = call(addr, "POST", "/v1/completions", Some(&huge)).await;
    assert_eq!(reply.status, 413, "{}", reply.body);
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("4096 bytes")
    );

    // Two long streams fill the admission bound (2): one per DP rank, then 429.
    let long = json!({"prompt": "Once", "max_tokens": 400, "stream": true}).to_string();
    let mut first = send(addr, "POST", "/v1/completions", Some(&long)).await;
    await_first_event(&mut first).await;
    let mut second = send(addr, "POST", "/v1/completions", Some(&long)).await;
    await_first_event(&mut second).await;
    for dp in ["0", "1"] {
        let sample = format!("deepinfer_frontend_outstanding_tokens{{dp=\"{dp}\"}}");
        assert_eq!(
            metric(addr, &sample).await,
            402.0,
            "{sample}: BOS + 1 prompt token + 400"
        );
    }
    let full = call(addr, "POST", "/v1/completions", Some(&long)).await;
    assert_eq!(full.status, 429, "{}", full.body);
    assert!(full.head.contains("retry-after: 1"), "{}", full.head);
    assert_eq!(full.json()["error"]["type"], "rate_limit_error");

    // Both clients go away mid-stream: both requests are aborted, counted, and freed.
    let aborted = "deepinfer_frontend_aborted_requests_total";
    let before = metric(addr, aborted).await;
    drop(first);
    drop(second);
    until("two aborts counted", async || {
        metric(addr, aborted).await == before + 2.0
    })
    .await;
    until("engine state freed", async || {
        engine_is_empty(&handle).await
    })
    .await;
    for dp in ["0", "1"] {
        let sample = format!("deepinfer_frontend_outstanding_tokens{{dp=\"{dp}\"}}");
        assert_eq!(metric(addr, &sample).await, 0.0, "{sample}");
    }

    // Shutdown with a stream in flight: it still finishes, then the server is gone.
    let short = json!({"prompt": "Once", "max_tokens": 12, "stream": true}).to_string();
    let mut last = send(addr, "POST", "/v1/completions", Some(&short)).await;
    await_first_event(&mut last).await;
    stop.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the server stops within the grace period")
        .expect("server task")
        .expect("drain");
    assert!(report.drained);
    let mut rest = Vec::new();
    last.read_to_end(&mut rest).await.unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("data: [DONE]"));
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}
