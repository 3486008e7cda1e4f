//! `deepinfer-node`'s command line as a user meets it: `--version` and `--help`, a closed pipe,
//! `DEEPINFER__SECTION__KEY` overrides without `--topology`, logs without colour on a pipe, and
//! the metrics of a finished job scraped while `--metrics-linger` keeps the endpoint up.

#[path = "common/node.rs"]
mod node_command;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;

use node_command::{node, terminate};
use serde_json::json;

#[test]
fn version_and_help_say_what_the_command_is() {
    let version = node().arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("deepinfer-node {}", env!("CARGO_PKG_VERSION"))
    );
    let help = node().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.starts_with("Offline inference for DeepSeek-V4.1-Flash"),
        "{help}"
    );
    for flag in ["--resume", "--order", "--drain-secs", "--metrics-linger"] {
        assert!(help.contains(flag), "{flag} in {help}");
    }
}

#[test]
fn a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let load = dir.path().join("load.json");
    let rows: Vec<Vec<u32>> = (0..64)
        .map(|l| (0..256).map(|e| (e * 7 + l) % 97).collect())
        .collect();
    std::fs::write(&load, serde_json::to_string(&rows).unwrap()).unwrap();
    let mut child = node()
        .args(["eplb-plan", "--load", load.to_str().unwrap()])
        .args([
            "--replicas",
            "288",
            "--groups",
            "8",
            "--nodes",
            "1",
            "--gpus",
            "8",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(status.success(), "{status}: {stderr}");
}

#[test]
fn a_bad_environment_override_is_an_error_without_topology_too() {
    let out = node()
        .env("DEEPINFER__SAMPLING__MAX_TOKENS", "many")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("sampling.max_tokens"), "{stderr}");
    assert!(
        stderr.contains("DEEPINFER__SAMPLING__MAX_TOKENS"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("random weights"),
        "the model loaded: {stderr}"
    );
    let out = node().args(["--metrics-linger", "5"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("prometheus_listen"), "{stderr}");
}

fn scrape(addr: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    stream.read_to_string(&mut page).unwrap();
    page
}

/// Environment overrides apply without `--topology` (a metrics endpoint and a default
/// `max_tokens`); after the job the endpoint lingers with the final values: a stop-sequence
/// completion is not an error, totals are counters, durations have buckets up to minutes.
#[test]
fn a_finished_jobs_metrics_can_be_scraped() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let lines = [
        json!({"custom_id": "default-limit", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "Once", "seed": 1}}),
        json!({"custom_id": "stopped", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "Once", "seed": 2, "max_tokens": 24, "stop": [" ", "e", "a", "n"]}}),
    ];
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(&input, text.join("\n")).unwrap();
    let mut child = node()
        .env("DEEPINFER__METRICS__PROMETHEUS_LISTEN", "127.0.0.1:0")
        .env("DEEPINFER__SAMPLING__MAX_TOKENS", "3")
        // A log line on a pipe: no colour codes.
        .env("RUST_LOG", "deepinfer_actors::prometheus=info")
        .args([
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
        ])
        .args(["--metrics-linger", "300"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let addr = loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "no linger line: {seen}"
        );
        seen.push_str(&line);
        if let Some(rest) = line.split("serving the final metrics on http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    };
    assert!(seen.contains("Prometheus metrics on"), "{seen}");
    assert!(
        !seen.contains('\x1b'),
        "colour codes off a terminal: {seen:?}"
    );
    let page = scrape(&addr);
    terminate(&child);
    assert!(child.wait().unwrap().success(), "{seen}");

    let out: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let usage = |i: usize| {
        out[i]["response"]["body"]["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(usage(0), 3, "the overridden default max_tokens: {}", out[0]);
    let stopped = &out[1]["response"]["body"]["choices"][0];
    assert_eq!(stopped["finish_reason"], "stop", "{stopped}");
    assert!(usage(1) < 24, "{stopped}");

    assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
    assert!(
        page.contains("deepinfer_frontend_requests_total{outcome=\"admitted\"} 2"),
        "{page}"
    );
    assert!(
        !page.contains("code=\"aborted\""),
        "a completion counted as an error: {page}"
    );
    for total in [
        "deepinfer_rank_host_microseconds_total",
        "deepinfer_rank_hidden_host_microseconds_total",
    ] {
        assert!(
            page.contains(&format!("# TYPE {total} counter")),
            "{total}: {page}"
        );
    }
    assert!(
        page.contains("deepinfer_frontend_request_duration_seconds_bucket{le=\"600\"}"),
        "{page}"
    );
}
