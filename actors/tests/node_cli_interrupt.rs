//! `deepinfer-node` jobs that are interrupted, resumed or given bad files, run through the real
//! binary on the built-in demo model: results are streamed as they finish, a SIGTERM keeps every
//! finished line, `--resume` completes the job exactly as an uninterrupted run would, and bad
//! paths or undecodable lines are reported clearly (paths before the model loads).

#[path = "common/node.rs"]
mod node_command;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use node_command::{node, terminate};
use serde_json::{Value, json};

const SERVED: &str = "deepinfer-demo";

/// The embedded demo topology with one request admitted at a time, so lines finish one by one.
fn one_at_a_time(dir: &Path) -> String {
    let local = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/local.toml"
    ))
    .unwrap();
    let topology = local.replace(
        "admission_queue_capacity = 256",
        "admission_queue_capacity = 1",
    );
    assert_ne!(
        topology, local,
        "configs/local.toml changed its admission line"
    );
    let path = dir.join("topology.toml");
    std::fs::write(&path, topology).unwrap();
    path.to_str().unwrap().to_string()
}

fn run(args: &[&str]) -> Output {
    node().args(args).output().unwrap()
}

fn output_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

/// What must not change between runs: per `custom_id`, the choices and the usage.
fn results(lines: &[Value]) -> BTreeMap<String, Value> {
    lines
        .iter()
        .map(|l| {
            let body = &l["response"]["body"];
            assert_eq!(l["response"]["status_code"], 200, "{l}");
            assert_eq!(body["model"], SERVED, "{l}");
            (
                l["custom_id"].as_str().unwrap().to_string(),
                json!({"choices": body["choices"], "usage": body["usage"]}),
            )
        })
        .collect()
}

#[test]
fn sigterm_keeps_finished_lines_and_resume_completes_the_job_identically() {
    let dir = tempfile::tempdir().unwrap();
    let topology = one_at_a_time(dir.path());
    let input = dir.path().join("in.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| {
            let body = if i % 2 == 0 {
                json!({"messages": [{"role": "user", "content": format!("Question {i}?")}],
                       "max_tokens": 5, "seed": i, "temperature": 0.8})
            } else {
                // Unseeded: the job seeds it from its custom_id.
                json!({"prompt": format!("Story {i}:"), "max_tokens": 5, "temperature": 0.8})
            };
            let url = if i % 2 == 0 {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            json!({"custom_id": format!("r{i}"), "method": "POST", "url": url, "body": body})
                .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let input = input.to_str().unwrap();

    // The reference: one uninterrupted run.
    let full = dir.path().join("full.jsonl");
    let done = run(&[
        "--topology",
        &topology,
        "--input",
        input,
        "--output",
        full.to_str().unwrap(),
    ]);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let reference = results(&output_lines(&full));
    assert_eq!(reference.len(), 6);

    // Interrupted once two lines are in the file (each was flushed as it finished).
    let out = dir.path().join("out.jsonl");
    let job = [
        "--topology",
        &topology,
        "--input",
        input,
        "--output",
        out.to_str().unwrap(),
    ];
    let mut child = node()
        .args(job)
        .args(["--drain-secs", "0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        let written = std::fs::read_to_string(&out).map_or(0, |t| t.lines().count());
        if written >= 2 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no results streamed"
        );
        assert!(child.try_wait().unwrap().is_none(), "the job ended early");
        std::thread::sleep(Duration::from_millis(100));
    }
    terminate(&child);
    let stopped = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&stopped.stderr);
    assert_eq!(stopped.status.code(), Some(143), "{stderr}");
    let partial = output_lines(&out);
    assert!((2..6).contains(&partial.len()), "{} lines", partial.len());
    let not_done = 6 - partial.len();
    assert!(
        stderr.contains(&format!(
            "interrupted by SIGTERM: {not_done} of 6 lines were not done"
        )),
        "{stderr}"
    );
    // Every line in the file is a finished result, equal to the reference.
    for (id, result) in results(&partial) {
        assert_eq!(result, reference[&id], "{id}");
    }

    // --resume runs the rest only and appends it.
    let resumed = node().args(job).arg("--resume").output().unwrap();
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "6 requests: {not_done} succeeded, 0 failed, {} already done",
            6 - not_done
        )),
        "{stderr}"
    );
    let all = output_lines(&out);
    assert_eq!(all.len(), 6, "each line exactly once");
    assert_eq!(results(&all), reference);
}

#[test]
fn bad_paths_fail_before_the_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, r#"{"prompt": "x", "max_tokens": 1}"#).unwrap();
    let input = input.to_str().unwrap();
    let missing_dir = dir.path().join("no/such/dir/out.jsonl");
    let cases = [
        (
            vec!["--input", input, "--output", missing_dir.to_str().unwrap()],
            format!("cannot write the output {}", missing_dir.display()),
        ),
        (
            vec!["--input", input, "--output", input],
            format!("--output {input} is the input file"),
        ),
        (
            vec!["--input", "/no/such/input.jsonl"],
            "reading /no/such/input.jsonl".to_string(),
        ),
    ];
    for (args, needle) in cases {
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&needle), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("random weights"),
            "the model loaded: {stderr}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(input).unwrap(),
        r#"{"prompt": "x", "max_tokens": 1}"#,
        "the input is untouched"
    );
}

#[test]
fn undecodable_and_repeated_lines_are_their_own_errors() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let good = |id: &str| {
        json!({"custom_id": id, "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x", "max_tokens": 1}})
        .to_string()
    };
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend(good("bom").as_bytes());
    bytes.extend(b"\n{\"prompt\": \"caf\xE9\"}\n");
    bytes.extend(good("a").as_bytes());
    bytes.extend(b"\n");
    bytes.extend(good("a").as_bytes());
    bytes.extend(b"\n");
    bytes.extend(
        json!({"custom_id": "hot", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x", "temperature": 9}})
        .to_string()
        .as_bytes(),
    );
    std::fs::write(&input, bytes).unwrap();
    let output = dir.path().join("out.jsonl");
    let out = run(&[
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("5 requests: 1 succeeded, 4 failed"),
        "{stderr}"
    );
    let lines = output_lines(&output);
    let message = |i: usize| {
        lines[i]["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(
        message(0).starts_with("line 1: ") && message(0).contains("byte order mark"),
        "{}",
        lines[0]
    );
    assert_eq!(message(1), "line 2: not valid UTF-8 at byte 16 of the line");
    assert_eq!(lines[2]["response"]["status_code"], 200);
    assert_eq!(lines[3]["custom_id"], "a");
    assert_eq!(
        message(3),
        "line 4: duplicate `custom_id` \"a\" (first on line 3)"
    );
    let error = &lines[4]["response"]["body"]["error"];
    assert_eq!(lines[4]["response"]["status_code"], 400);
    assert_eq!(
        (error["param"].as_str(), error["code"].as_str()),
        (Some("temperature"), Some("invalid_value"))
    );
}
