//! Property tests of the topology TOML parser (`NodeConfig::from_toml_str`) on untrusted text:
//! the shipped topologies with random values put in place of theirs, with random byte edits and
//! cuts, and arbitrary text give a config or an error, never a panic.

use deepinfer_topology::NodeConfig;
use proptest::prelude::*;

const TOPOLOGIES: [&str; 4] = [
    include_str!("../../configs/config-template.toml"),
    include_str!("../../configs/local.toml"),
    include_str!("../../configs/h200x2.toml"),
    include_str!("../../configs/sm100x64.toml"),
];

/// A TOML value of any type, including out-of-range and malformed ones.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        (-3i64..100).prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        any::<bool>().prop_map(|v| v.to_string()),
        "[a-z0-9_./-]{0,10}".prop_map(|s| format!("\"{s}\"")),
        prop::collection::vec(-2i64..70, 0..5).prop_map(|v| format!("{v:?}")),
        Just("{}".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("\"".to_string()),
        Just(String::new()),
    ]
}

/// `text` with the value of its `line`-th `key = value` line replaced by `value`.
fn with_value(text: &str, line: usize, value: &str) -> String {
    let assignments: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with('#') && l.contains(" = "))
        .map(|(i, _)| i)
        .collect();
    let target = assignments[line % assignments.len()];
    text.lines()
        .enumerate()
        .map(|(i, l)| match (i == target, l.split_once(" = ")) {
            (true, Some((key, _))) => format!("{key} = {value}"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn random_values_in_shipped_topologies_never_panic(
        which in 0..TOPOLOGIES.len(),
        edits in prop::collection::vec((any::<usize>(), toml_value()), 1..4),
    ) {
        let mut text = TOPOLOGIES[which].to_string();
        for (line, value) in &edits {
            text = with_value(&text, *line, value);
        }
        let _ = NodeConfig::from_toml_str(&text, "proptest");
    }

    #[test]
    fn edited_and_cut_topologies_never_panic(
        which in 0..TOPOLOGIES.len(),
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in prop::option::of(any::<usize>()),
        text in ".{0,60}",
    ) {
        let mut bytes = TOPOLOGIES[which].as_bytes().to_vec();
        for (at, byte) in edits {
            let at = at % bytes.len();
            bytes[at] = byte;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut % (bytes.len() + 1));
        }
        let _ = NodeConfig::from_toml_str(&String::from_utf8_lossy(&bytes), "proptest");
        let _ = NodeConfig::from_toml_str(&text, "proptest");
    }
}
