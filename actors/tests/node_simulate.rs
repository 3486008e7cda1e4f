//! `deepinfer-node --topology configs/sm100x64.toml --simulate`: the 64-GPU topology runs here (no
//! GPU, no weights) and prints its report; a bad trace is refused in one line naming its line.

use std::process::Command;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn node(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer-node"))
        .current_dir(ROOT)
        .args(args)
        .output()
        .expect("the binary runs")
}

#[test]
fn sm100x64_simulates_the_default_trace_and_prints_the_report() {
    let run = node(&["--topology", "configs/sm100x64.toml", "--simulate"]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    for expected in [
        "on B200 x64 (virtual time)",
        "requests: 256 submitted, 256 completed, 0 failed",
        "tok/s per GPU",
        "TTFT: p50",
        "inter-token latency: p50",
        "utilisation per GPU",
        "EPLB: ",
        "DSpark: ",
        "0 with a rank empty while another had requests waiting",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing from:\n{stdout}"
        );
    }
}

#[test]
fn a_bad_trace_is_refused_naming_its_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"arrival_s\": 0, \"prompt_tokens\": 8, \"output_tokens\": 4}\n\
         {\"arrival_s\": 1, \"prompt_tokens\": 0, \"output_tokens\": 4}\n",
    )
    .expect("written");
    let path = trace.display().to_string();
    let run = node(&[
        "--topology",
        "configs/sm100x64.toml",
        "--simulate",
        "--trace",
        &path,
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!("error: {path}:2: prompt_tokens must be >= 1")
    );
    let run = node(&["--topology", "configs/sm100x64.toml", "--trace", &path]);
    assert_ne!(run.status.code(), Some(0), "--trace needs --simulate");
}
