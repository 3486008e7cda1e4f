//! Expert parallelism across two `deepinfer-node` processes on one host (loopback bootstrap, CPU
//! backend, the demo model): node 1 serves (`deepinfer-node serve`), node 0 runs an offline job;
//! each holds one DP rank and one of the two EP ranks, the rows of the other's experts crossing
//! the socket every layer, and each process reads only its EP rank's routed experts (half of
//! them, stated at start); node 0's EPLB rebalances both every few steps (both log the same
//! committed epochs). The job's tokens and log-probabilities equal the one-process
//! `dp = ep = 1` run's exactly; killing node 1 mid-run fails node 0's request with an error
//! naming the DP rank, step, layer and EP rank, within the exchange timeout, and node 0 exits.

#[allow(dead_code)] // `terminate` is for the other node tests
#[path = "common/node.rs"]
mod node_command;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use node_command::node;
use serde_json::Value;

/// Longest a child may run before the test calls it a hang.
const LIMIT: Duration = Duration::from_secs(300);
/// `[cluster] exchange_timeout_ms` of the two nodes.
const EXCHANGE_MS: u64 = 5_000;

/// Kills the child when the test ends, passed or not.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Node `node` of two (dp = ep = 2: one DP rank and one EP rank each, 2 redundant expert slots,
/// live EPLB every 6 steps), node 0 listening on `port` for the bootstrap.
fn node_topology(dir: &Path, node: u16, port: u16) -> String {
    let text = format!(
        "[model]\nsource = \"demo\"\n[device]\nnodes = 2\n[parallel]\ndp = 2\nep = 2\n\
         [eplb]\nenabled = true\nredundant_experts = 2\nwindow_steps = 6\n\
         rebalance_interval_steps = 6\n\
         [cluster]\nnode = {node}\nbootstrap = \"127.0.0.1:{port}\"\n\
         exchange_timeout_ms = {EXCHANGE_MS}\nbootstrap_timeout_seconds = 240\n"
    );
    let path = dir.join(format!("node{node}.toml"));
    std::fs::write(&path, text).expect("topology written");
    path.to_str().expect("utf-8 path").to_string()
}

fn single_topology(dir: &Path) -> String {
    let path = dir.join("single.toml");
    std::fs::write(
        &path,
        "[model]\nsource = \"demo\"\n[parallel]\ndp = 1\nep = 1\n",
    )
    .expect("topology written");
    path.to_str().expect("utf-8 path").to_string()
}

/// Every request's sampling seed: a job's lines reach the engine concurrently, so without one a
/// line's seed (derived from its request id) would depend on which line arrived first.
const SEED: u64 = 7;

fn write_input(dir: &Path, lines: &[(&str, &str, u32)]) -> String {
    let text: String = lines
        .iter()
        .map(|(id, prompt, max_tokens)| {
            format!(
                "{{\"custom_id\":\"{id}\",\"method\":\"POST\",\"url\":\"/v1/completions\",\
                 \"body\":{{\"model\":\"demo\",\"prompt\":\"{prompt}\",\"max_tokens\":{max_tokens},\
                 \"logprobs\":3,\"seed\":{SEED}}}}}\n"
            )
        })
        .collect();
    let path = dir.join("input.jsonl");
    std::fs::write(&path, text).expect("input written");
    path.to_str().expect("utf-8 path").to_string()
}

/// The log level of the children: the EPLB's commits are logged at `info`.
const LOG: &str = "warn,deepinfer_actors::eplb=info";

/// The placement epochs a node's log says it committed, in order.
fn committed_epochs(stderr: &str) -> Vec<u32> {
    stderr
        .lines()
        .filter(|line| line.contains("expert placement committed"))
        .map(|line| {
            let (_, rest) = line.split_once("epoch=epoch-").expect("an epoch field");
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().expect("an epoch number")
        })
        .collect()
}

/// Node 1 serving (its HTTP port unused), its stderr written to `log`.
fn start_node1(topology: &str, log: &Path) -> Running {
    let log = std::fs::File::create(log).expect("node 1 log");
    Running(
        node()
            .args(["serve", "--topology", topology, "--listen", "127.0.0.1:0"])
            .env("RUST_LOG", LOG)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("node 1 starts"),
    )
}

/// What a node's start-up line says it holds, e.g. "node 1 of 2 holds the routed experts of EP
/// ranks 1..2: 123 of 246 host bytes (48 of 96 layer-experts); ...".
struct Holdings {
    ranks: String,
    held_bytes: u64,
    whole_bytes: u64,
    held: u64,
    whole: u64,
}

fn holdings(stderr: &str, node: u16) -> Holdings {
    let prefix = format!("node {node} of 2 holds the routed experts of EP ranks ");
    let line = stderr
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("node {node} states what it holds: {stderr}"));
    let (ranks, rest) = line.split_once(": ").expect("ranks: bytes");
    let numbers: Vec<u64> = rest
        .split([' ', '('])
        .filter_map(|word| word.parse().ok())
        .collect();
    Holdings {
        ranks: ranks.to_string(),
        held_bytes: numbers[0],
        whole_bytes: numbers[1],
        held: numbers[2],
        whole: numbers[3],
    }
}

/// An offline job; stderr is kept for the report.
fn start_job(topology: &str, input: &str, output: &Path) -> Running {
    Running(
        node()
            .args([
                "--topology",
                topology,
                "--input",
                input,
                "--order",
                "completion",
            ])
            .arg("--output")
            .arg(output)
            .env("RUST_LOG", LOG)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("job starts"),
    )
}

/// Waits for the job to end (within `LIMIT`): its stderr, and whether it succeeded.
fn finish(mut job: Running) -> (String, bool) {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(status) = job.0.try_wait().expect("job status") {
            let mut stderr = String::new();
            if let Some(mut pipe) = job.0.stderr.take() {
                std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("stderr");
            }
            return (stderr, status.success());
        }
        assert!(Instant::now() < deadline, "the job hung past {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Per `custom_id`: the whole response but its creation time and ids (the engine numbers
/// requests in arrival order, and a job's lines arrive concurrently).
fn results(path: &Path) -> BTreeMap<String, Value> {
    std::fs::read_to_string(path)
        .expect("output")
        .lines()
        .map(|line| {
            let mut value: Value = serde_json::from_str(line).expect("a JSON line");
            let id = value["custom_id"].as_str().expect("custom_id").to_string();
            if let Some(response) = value["response"].as_object_mut() {
                response.remove("request_id");
            }
            let body = &mut value["response"]["body"];
            if let Some(body) = body.as_object_mut() {
                body.remove("created");
                body.remove("id");
            }
            (id, value["response"].take())
        })
        .collect()
}

/// One scenario (each process builds the demo model, seconds in a debug build): node 0's job
/// holds "a" (a few tokens, compared with the one-process run) and "b" (long, still decoding
/// when node 1 is killed, right after "a" finished).
#[test]
fn two_processes_serve_like_one_and_a_killed_node_fails_the_other_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let one_dir = dir.path().join("one");
    std::fs::create_dir(&one_dir).expect("dir");
    let reference = write_input(&one_dir, &[("a", "Hello there", 24)]);
    let input = write_input(
        dir.path(),
        &[("a", "Hello there", 24), ("b", "Long one", 1000)],
    );
    let port = free_port();
    let node1_log = dir.path().join("node1.log");
    let mut node1 = start_node1(&node_topology(dir.path(), 1, port), &node1_log);
    let output = dir.path().join("two.jsonl");
    let job = start_job(&node_topology(dir.path(), 0, port), &input, &output);
    let one = dir.path().join("one.jsonl");
    let (stderr, ok) = finish(start_job(&single_topology(dir.path()), &reference, &one));
    assert!(ok, "one-process run: {stderr}");

    let deadline = Instant::now() + LIMIT;
    while !std::fs::read_to_string(&output).is_ok_and(|text| text.contains("\"custom_id\":\"a\"")) {
        assert!(Instant::now() < deadline, "request a never finished");
        std::thread::sleep(Duration::from_millis(20));
    }
    node1.0.kill().expect("node 1 killed");
    let killed = Instant::now();
    let (stderr, _) = finish(job);
    assert!(
        killed.elapsed() < Duration::from_millis(EXCHANGE_MS + 10_000),
        "node 0 took {:?} to end after node 1 died",
        killed.elapsed()
    );

    // Each process read only its EP rank's routed experts: the experts of its 5 slots per layer
    // (of 8 experts in 10 slots over 2 EP ranks), their share of the bytes, the EP rank named.
    let node1_stderr = std::fs::read_to_string(&node1_log).expect("node 1 log");
    for (node, log, ranks) in [(0, &stderr, "0..1"), (1, &node1_stderr, "1..2")] {
        let h = holdings(log, node);
        assert_eq!(h.ranks, ranks, "node {node}");
        let layers = h.whole / 8;
        assert!(
            h.held <= 5 * layers && h.held >= 4 * layers,
            "node {node}: {} of {}",
            h.held,
            h.whole
        );
        assert_eq!(
            h.held_bytes * h.whole,
            h.whole_bytes * h.held,
            "node {node}"
        );
        println!(
            "node {node} holds {} of {} routed-expert bytes ({} of {} layer-experts)",
            h.held_bytes, h.whole_bytes, h.held, h.whole
        );
    }

    // Node 0's EPLB rebalanced both nodes while "a" ran: the same epochs committed on each, in
    // order (node 1 may have committed one more when it was killed, before node 0 heard back).
    let (first, second) = (committed_epochs(&stderr), committed_epochs(&node1_stderr));
    println!("committed epochs: node 0 {first:?}, node 1 {second:?}");
    assert!(first.len() >= 2, "node 0 committed {first:?}: {stderr}");
    assert_eq!(first, (1..=first.len() as u32).collect::<Vec<_>>());
    assert!(
        second.starts_with(&first) && second.len() <= first.len() + 1,
        "node 0 committed {first:?}, node 1 {second:?}"
    );

    // Across two processes, "a" is exactly the one-process run's: tokens and log-probabilities.
    let (expected, got) = (results(&one), results(&output));
    let a = &expected["a"];
    assert_eq!(a["status_code"], 200, "{a}");
    assert!(a["body"]["choices"][0]["logprobs"].is_object(), "{a}");
    assert_eq!(&got["a"], a, "{stderr}");

    // Killed mid-run: "b" fails with the exchange that found node 1 gone.
    let failed = &got["b"];
    assert_eq!(failed["status_code"], 500, "{failed}");
    let message = failed["body"]["error"]["message"]
        .as_str()
        .expect("message");
    for part in ["DP rank 0 step", "layer", "EP rank 1 on node 1"] {
        assert!(message.contains(part), "{message} lacks {part:?}");
    }
}
