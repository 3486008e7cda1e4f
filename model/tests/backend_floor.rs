//! The backend is the floor of the model crate: no file of `src/backend/` reaches a file of the
//! model families (`src/v4/`, `src/v41/`, `src/config/`) through `crate::` imports, and no file
//! the backend reaches imports the backend back (no import cycle through it). The families share
//! through `src/layers/` only: no file of `v4/` imports `v41/` or the reverse, and `layers/`
//! imports neither. Test modules
//! (`#[cfg(test)]` to the end of a file) are not part of the graph: a lower module's tests may use
//! the backend.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Directories under `src/` the backend must not reach.
const FAMILIES: [&str; 3] = ["v4/", "v41/", "config/"];

/// Every `.rs` file under `dir`, relative to `root` with `/` separators.
fn sources(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            sources(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).expect("under root");
            out.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// The module paths (`a::b::c`, lowercase segments only) named after each `crate::` of `text`.
fn crate_paths(text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            paths.extend(group.split(',').map(|item| module_segments(item.trim())));
        } else {
            paths.push(module_segments(rest));
        }
    }
    paths.retain(|p| !p.is_empty());
    paths
}

fn module_segments(path: &str) -> Vec<String> {
    let mut segments = Vec::new();
    for segment in path.split("::") {
        let name: String = segment
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let is_module = !name.is_empty()
            && name.len() == segment.len()
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !is_module {
            // The last segment may be a function or a module: keep a lowercase name that ends it.
            if !name.is_empty() && name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                segments.push(name);
            }
            break;
        }
        segments.push(name);
    }
    segments
}

/// The deepest file of `files` that the module path names (`a/b.rs` or `a/b/mod.rs`).
fn resolve(files: &BTreeSet<String>, path: &[String]) -> Option<String> {
    (1..=path.len()).rev().find_map(|depth| {
        let stem = path[..depth].join("/");
        [format!("{stem}.rs"), format!("{stem}/mod.rs")]
            .into_iter()
            .find(|f| files.contains(f))
    })
}

/// File → the files its non-test code imports through `crate::`.
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut list = Vec::new();
    sources(src, src, &mut list);
    let files: BTreeSet<String> = list.into_iter().collect();
    files
        .iter()
        .map(|file| {
            let text =
                std::fs::read_to_string(src.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let targets = crate_paths(code)
                .iter()
                .filter_map(|p| resolve(&files, p))
                .filter(|t| t != file)
                .collect();
            (file.clone(), targets)
        })
        .collect()
}

fn is_backend(file: &str) -> bool {
    file.starts_with("backend/")
}

#[test]
fn backend_reaches_no_family_and_no_cycle() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = import_graph(&src);
    assert!(
        graph.keys().filter(|f| is_backend(f)).count() >= 5,
        "no backend files found under {}",
        src.display()
    );
    // Everything the backend's files reach, and through which edge each file was first reached.
    let mut reached: BTreeMap<String, String> = BTreeMap::new();
    let mut frontier: Vec<String> = graph.keys().filter(|f| is_backend(f)).cloned().collect();
    while let Some(file) = frontier.pop() {
        for target in &graph[&file] {
            if !is_backend(target) && !reached.contains_key(target) {
                reached.insert(target.clone(), file.clone());
                frontier.push(target.clone());
            }
        }
    }
    let into_families: Vec<String> = reached
        .iter()
        .filter(|(target, _)| FAMILIES.iter().any(|f| target.starts_with(f)))
        .map(|(target, from)| format!("{from} -> {target}"))
        .collect();
    let back_into_backend: Vec<String> = reached
        .keys()
        .flat_map(|file| {
            graph[file]
                .iter()
                .filter(|t| is_backend(t))
                .map(move |t| format!("{file} -> {t}"))
        })
        .collect();
    println!(
        "backend reaches {} files outside it: {:?}",
        reached.len(),
        reached.keys().collect::<Vec<_>>()
    );
    assert!(
        into_families.is_empty() && back_into_backend.is_empty(),
        "the backend reaches the families through {into_families:?}; \
         files it reaches import it back: {back_into_backend:?}"
    );
}

#[test]
fn families_share_through_layers_only() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = import_graph(&src);
    let crossing: Vec<String> = graph
        .iter()
        .flat_map(|(file, targets)| targets.iter().map(move |t| (file, t)))
        .filter(|(file, target)| {
            let (from_v4, from_v41) = (file.starts_with("v4/"), file.starts_with("v41/"));
            let into_family = target.starts_with("v4/") || target.starts_with("v41/");
            (from_v4 && target.starts_with("v41/"))
                || (from_v41 && target.starts_with("v4/"))
                || (file.starts_with("layers/") && into_family)
        })
        .map(|(file, target)| format!("{file} -> {target}"))
        .collect();
    let shared = graph.keys().filter(|f| f.starts_with("layers/")).count();
    assert!(shared >= 6, "{shared} files under src/layers/");
    assert!(
        crossing.is_empty(),
        "imports across the families (share them through layers/): {crossing:?}"
    );
}

#[test]
fn the_path_parser_sees_groups_and_stops_at_items() {
    let paths = crate_paths(
        "use crate::{LogitsWanted, v4, v41};\nuse crate::v41::weights::{ExpertLinear};\n\
         let x = crate::quant::round_bf16(y);",
    );
    let paths: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(paths, ["v4", "v41", "v41::weights", "quant::round_bf16"]);
}
