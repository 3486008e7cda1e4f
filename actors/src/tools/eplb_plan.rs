//! `deepinfer-node eplb-plan`: DeepSeek's EPLB for operators who plan expert placements offline.
//! Reads `[[layer loads...], ...]`, prints `{"phy2log", "log2phy", "logcnt"}`.

use std::path::Path;

use deepinfer_topology::eplb::{PlacementShape, eplb_plan_json};

/// Reads the load file and solves the placement.
pub fn run(load_path: &Path, shape: PlacementShape) -> Result<serde_json::Value, String> {
    let text =
        std::fs::read_to_string(load_path).map_err(|e| format!("{}: {e}", load_path.display()))?;
    eplb_plan_json(&text, shape).map_err(|e| format!("{}: {e}", load_path.display()))
}
