//! The operator tools of the `deepinfer-node` binary, run as a user runs them: `logits` on the
//! golden fixture (chunked feeding changes nothing; bad input is one line and a non-zero exit) and
//! `eplb-plan` (prints the library's plan).

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;

fn node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deepinfer-node"))
}

/// The repository's fixture `rel` (`tests/fixtures/<rel>`); a missing one fails the test.
fn fixture(rel: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    assert!(
        dir.join("config.json").is_file(),
        "fixture {rel} is missing: no {}",
        dir.join("config.json").display()
    );
    dir
}

fn read_logits(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).expect("output written");
    let tensors = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let view = tensors.tensor("logits").expect("tensor `logits`");
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    let values = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (view.shape().to_vec(), values)
}

#[test]
fn logits_tool_writes_the_same_logits_for_any_chunking() {
    let model = fixture("v41/v41-tiny");
    let out = tempfile::tempdir().expect("tempdir");
    let tokens = "482,319,349,457,296,396,425,117";
    let run = |chunks: Option<&str>, name: &str| {
        let path = out.path().join(name);
        let mut cmd = node();
        cmd.args(["logits", "--model"])
            .arg(&model)
            .args(["--tokens", tokens, "--out"])
            .arg(&path);
        if let Some(chunks) = chunks {
            cmd.args(["--chunks", chunks]);
        }
        let output = cmd.output().expect("runs");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("warn") && !stderr.contains("error"),
            "{stderr}"
        );
        read_logits(&path)
    };
    let (shape, one_shot) = run(None, "one.safetensors");
    assert_eq!(shape, vec![8, 512]);
    let (_, chunked) = run(Some("5,1,2"), "chunked.safetensors");
    assert_eq!(one_shot, chunked, "chunked feeding must not change a bit");
    assert!(one_shot.iter().all(|v| v.is_finite()));
    // Rows differ from each other (a real forward, not a constant).
    assert_ne!(one_shot[..512], one_shot[512..1024]);
}

#[test]
fn logits_tool_fails_in_one_line_on_bad_input() {
    let out = tempfile::tempdir().expect("tempdir");
    let target = out.path().join("never.safetensors");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--model".into(),
                "/nonexistent/model".into(),
                "--tokens".into(),
                "1,2".into(),
            ],
            "/nonexistent/model",
        ),
        (
            vec![
                "--model".into(),
                "/nonexistent/model".into(),
                "--tokens".into(),
                "1,x".into(),
            ],
            "--tokens: item 2",
        ),
    ];
    for (args, expected) in cases {
        let output = node()
            .arg("logits")
            .args(&args)
            .arg("--out")
            .arg(&target)
            .output()
            .expect("runs");
        assert!(!output.status.success(), "{args:?} must fail");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(expected),
            "{stderr}"
        );
    }
    assert!(!target.exists());

    // A truncated checkpoint names the file.
    let model = fixture("v41/v41-tiny");
    let corrupt = out.path().join("corrupt");
    std::fs::create_dir(&corrupt).expect("mkdir");
    std::fs::copy(model.join("config.json"), corrupt.join("config.json")).expect("copy");
    let weights = std::fs::read(model.join("model.safetensors")).expect("read");
    std::fs::write(
        corrupt.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .expect("write");
    let output = node()
        .args(["logits", "--tokens", "1", "--model"])
        .arg(&corrupt)
        .arg("--out")
        .arg(&target)
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("model.safetensors"), "{stderr}");
}

#[test]
fn eplb_plan_prints_the_solver_plan() {
    // DeepSeek's EPLB README example (anchors.md §4.4).
    let loads = "[[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], \
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]";
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("load.json");
    std::fs::write(&path, loads).expect("write");
    let output = node()
        .args([
            "eplb-plan",
            "--replicas",
            "16",
            "--groups",
            "4",
            "--nodes",
            "2",
            "--gpus",
            "8",
            "--load",
        ])
        .arg(&path)
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(
        printed["phy2log"][0],
        serde_json::json!([5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1])
    );
    assert_eq!(
        printed["phy2log"][1],
        serde_json::json!([7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1])
    );
    assert_eq!(
        printed["logcnt"][0],
        serde_json::json!([1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1])
    );

    // Ragged rows are refused with the layer named.
    std::fs::write(&path, "[[1, 2, 3], [1, 2]]").expect("write");
    let output = node()
        .args([
            "eplb-plan",
            "--replicas",
            "4",
            "--groups",
            "1",
            "--nodes",
            "1",
            "--gpus",
            "2",
            "--load",
        ])
        .arg(&path)
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("load.json"),
        "{stderr}"
    );
}

/// `logits` on the DeepSeek-V4 fixture (a transformers float32 save): the same command as on V4.1,
/// and the rows match the fixture's transformers logits for the same chunking (README tolerance).
#[test]
fn logits_tool_runs_the_v4_fixture() {
    let dir = fixture("v4/v4-tiny");
    let case: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).expect("case.json"))
            .expect("case.json parses");
    let join = |key: &str| -> String {
        let items: Vec<String> = case
            .pointer(key)
            .and_then(serde_json::Value::as_array)
            .expect("a list in case.json")
            .iter()
            .map(ToString::to_string)
            .collect();
        items.join(",")
    };
    let out = tempfile::tempdir().expect("tempdir");
    let path = out.path().join("v4.safetensors");
    let output = node()
        .args(["logits", "--model"])
        .arg(&dir)
        .args(["--tokens", &join("/input_ids")])
        .args(["--chunks", &join("/schedules/chunked")])
        .arg("--out")
        .arg(&path)
        .output()
        .expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (shape, ours) = read_logits(&path);
    let expected_bytes = std::fs::read(dir.join("expected.safetensors")).expect("expected");
    let expected = SafeTensors::deserialize(&expected_bytes).expect("expected parses");
    let reference: Vec<f32> = expected
        .tensor("logits_chunked")
        .expect("logits_chunked")
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(shape, vec![85, 1024]);
    let (lo, hi) = reference
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let worst = ours
        .iter()
        .zip(&reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-4 * (hi - lo),
        "max |Δ| {worst} over range {}",
        hi - lo
    );
}
