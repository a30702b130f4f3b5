//! The crate graph of docs/design.md §4.2 is the manifests' graph, and the
//! manifests keep the layering rules written there: a dependency added
//! against a rule, or one the design page does not show, fails here.

#![allow(clippy::unwrap_used)] // common/'s helpers fail loudly on unexpected errors

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The checkout's root.
fn root() -> PathBuf {
    common::manifest_dir().join("../..")
}

/// Each crate's inferscale dependencies from `[dependencies]`, by short
/// name (`inferscale-memory` is `memory`): the crates under `crates/` and
/// the load-test harness at the top level (`loadtest/`, as §5 lays out).
fn manifests() -> Graph {
    let mut graph = Graph::new();
    let dirs = std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .map(|entry| entry.expect("entry").path())
        .chain([root().join("loadtest")]);
    for dir in dirs {
        let manifest = dir.join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else { continue };
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name = \"inferscale-"))
            .and_then(|l| l.strip_suffix('"'))
            .unwrap_or_else(|| panic!("{}: no inferscale name", manifest.display()))
            .to_string();
        let mut deps = BTreeSet::new();
        let mut section = "";
        for line in text.lines() {
            if line.starts_with('[') {
                section = line.trim();
            } else if section == "[dependencies]"
                && let Some(rest) = line.strip_prefix("inferscale-")
            {
                let dep = rest.split(['.', ' ', '=']).next().unwrap_or_default();
                deps.insert(dep.to_string());
            }
        }
        graph.insert(name, deps);
    }
    graph
}

/// The table of docs/design.md §4.2.
fn documented() -> Graph {
    let page = std::fs::read_to_string(root().join("docs/design.md")).expect("docs/design.md");
    let start = page.find("### 4.2").expect("docs/design.md has §4.2");
    let end = start + page[start..].find("\n### ").expect("a section after §4.2");
    let mut graph = Graph::new();
    for line in page[start..end].lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let [_, krate, deps, _] = cells[..] else { continue };
        let Some(krate) = krate.strip_prefix('`').and_then(|c| c.strip_suffix('`')) else { continue };
        let deps = deps
            .split(',')
            .map(|d| d.trim().trim_end_matches("(optional)").trim())
            .filter(|d| !d.is_empty() && *d != "—")
            .map(str::to_string)
            .collect();
        graph.insert(krate.to_string(), deps);
    }
    graph
}

/// Everything `krate` depends on, directly or not.
fn closure(graph: &Graph, krate: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![krate.to_string()];
    while let Some(c) = todo.pop() {
        for d in graph.get(&c).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn the_design_page_shows_the_manifests_graph() {
    let (real, shown) = (manifests(), documented());
    assert!(real.len() >= 14, "read {} manifests", real.len());
    assert_eq!(
        shown, real,
        "docs/design.md §4.2 (left) differs from crates/*/Cargo.toml and loadtest/Cargo.toml (right)"
    );
}

#[test]
fn the_layering_rules_hold() {
    let graph = manifests();
    for (krate, deps) in &graph {
        assert!(!closure(&graph, krate).contains(krate), "{krate} depends on itself: a cycle");
        let all = closure(&graph, krate);
        let forbidden: &[&str] = match krate.as_str() {
            // Leaves: the shared words, the model files, telemetry.
            "types" | "model" | "telemetry" => &["*"],
            // Whatever speaks only HTTP, gRPC or files never pulls in the engine stack.
            "proto" | "eval" | "cluster" | "router" | "loadtest" => &["model", "engine", "cuda", "memory", "worker"],
            // Backends and the forward know nothing of memory or serving.
            "engine" | "cuda" => &["memory", "worker", "cluster", "router"],
            "memory" => &["worker", "cuda", "cluster", "router", "proto"],
            // The worker is generic over backends and takes device links as a trait.
            "worker" => &["cuda", "cluster", "router", "loadtest", "eval"],
            _ => &[],
        };
        if forbidden == ["*"] {
            assert!(deps.is_empty(), "{krate} must depend on no inferscale crate, has {deps:?}");
        }
        for f in forbidden {
            assert!(!all.contains(*f), "{krate} must not depend on {f} (it does, through {all:?})");
        }
    }
}
