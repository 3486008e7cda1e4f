//! The `eplb-plan` entry point: a JSON load table `[[load per logical expert] per layer]`
//! in, DeepSeek's `{"phy2log", "log2phy", "logcnt"}` JSON out, with positioned errors.

use serde_json::Value;

use super::{PlacementShape, rebalance_experts};
use crate::error::PlacementError;

/// Parses `[[load, ...], ...]` (numbers >= 0, one row per MoE layer, equal row lengths).
pub fn parse_loads_json(text: &str) -> Result<Vec<Vec<f64>>, PlacementError> {
    let document: Value = serde_json::from_str(text).map_err(|error| PlacementError::Json {
        at: String::new(),
        problem: format!("not valid JSON: {error}"),
    })?;
    let Value::Array(rows) = document else {
        return Err(PlacementError::Json {
            at: String::new(),
            problem: "expected an array of layers, each an array of expert loads".to_owned(),
        });
    };
    let mut loads = Vec::with_capacity(rows.len());
    for (layer, row) in rows.iter().enumerate() {
        let Value::Array(cells) = row else {
            return Err(PlacementError::Json {
                at: format!("[{layer}]"),
                problem: "expected an array of expert loads".to_owned(),
            });
        };
        let mut values = Vec::with_capacity(cells.len());
        for (expert, cell) in cells.iter().enumerate() {
            let value = cell.as_f64().ok_or_else(|| PlacementError::Json {
                at: format!("[{layer}][{expert}]"),
                problem: format!("expected a number, got {cell}"),
            })?;
            values.push(value);
        }
        loads.push(values);
    }
    Ok(loads)
}

/// Solves the placement for a JSON load table and returns the `eplb-plan` JSON document.
pub fn eplb_plan_json(loads_json: &str, shape: PlacementShape) -> Result<Value, PlacementError> {
    let loads = parse_loads_json(loads_json)?;
    Ok(rebalance_experts(&loads, shape)?.to_plan_json())
}
