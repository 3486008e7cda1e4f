//! Running the `deepinfer-node` binary from a test: the command on the demo model, and SIGTERM.

use std::process::{Child, Command};

/// `deepinfer-node` in the repository root, with no model directory from the environment.
pub fn node() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_deepinfer-node"));
    command
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env_remove("DEEPINFER_HF_MODEL_DIR");
    command
}

/// Sends SIGTERM to `child`.
pub fn terminate(child: &Child) {
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(kill.success(), "kill -TERM {}", child.id());
}
