//! The Grafana dashboards reference only metrics the runtime registers, and show all of them.

use std::collections::BTreeSet;
use std::path::Path;

use deepinfer_actors::metrics::ALL;

/// Every `deepinfer_*` name in a PromQL expression, histogram suffixes removed.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("deepinfer_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(base.to_string());
        rest = &tail[end..];
    }
    names
}

fn collect_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                if let (true, Some(s)) = (key == "expr", v.as_str()) {
                    out.push(s.to_string());
                }
                collect_exprs(v, out);
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn dashboards_reference_registered_metrics_only() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/dashboards");
    let registered: BTreeSet<String> = ALL.iter().map(|s| s.to_string()).collect();
    let mut used = BTreeSet::new();
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        files += 1;
        let value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut exprs = Vec::new();
        collect_exprs(&value, &mut exprs);
        assert!(!exprs.is_empty(), "{} has no queries", path.display());
        for expr in exprs {
            for name in metric_names(&expr) {
                assert!(
                    registered.contains(&name),
                    "{}: `{name}` is not in deepinfer_actors::metrics::ALL",
                    path.display()
                );
                used.insert(name);
            }
        }
    }
    assert!(files >= 1, "no dashboards in {}", dir.display());
    let unused: Vec<_> = registered.difference(&used).collect();
    assert!(unused.is_empty(), "metrics no dashboard shows: {unused:?}");
}

#[test]
fn metric_name_extraction_strips_histogram_suffixes() {
    let names = metric_names(
        "histogram_quantile(0.5, rate(deepinfer_step_duration_seconds_bucket[5m])) / deepinfer_x_total",
    );
    assert_eq!(
        names,
        BTreeSet::from([
            "deepinfer_step_duration_seconds".to_string(),
            "deepinfer_x_total".to_string()
        ])
    );
}
