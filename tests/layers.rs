//! The crate's layers import only the layers below them. This reads every `crate::` path of
//! every source file (and `gems::` in the binary) and fails on one that points sideways or up,
//! naming the file, the line and the two layers.

use std::path::{Path, PathBuf};

/// Bottom to top; a module may use the modules of lower layers and its own.
const LAYERS: &[&[&str]] = &[
    &["core"],
    &["memory"],
    &["backend"],
    &["tensor"],
    &["comm", "data"],
    &["ops"],
    &["graph"],
    &["models", "optim", "schemes"],
    &["bench"],
    &["plan"],
    &["runtime"],
    &["fit"],
    &["bin"],
];

/// The layer of a module, or of an item the crate root re-exports from `core`.
fn layer(module: &str) -> Option<usize> {
    let module = match module {
        "Error" | "Result" | "WhatFits" => "core",
        m => m,
    };
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every (line, module) a source names through `prefix` (`crate::` or `gems::`), comments
/// aside.
fn uses(text: &str, prefix: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for (i, _) in line.match_indices(prefix) {
            let before = line[..i].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &line[i + prefix.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push((n + 1, name));
            }
        }
    }
    out
}

/// The module of `file` under `root`: its first path component, without `.rs`.
fn top(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The wrong-direction imports under `src`, one line each.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut bad = Vec::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let module = top(src, &file);
        if module == "lib" {
            // The facade re-exports from every layer.
            continue;
        }
        let own = layer(&module).unwrap_or_else(|| panic!("{module} is in no layer"));
        let text = std::fs::read_to_string(&file).unwrap();
        let prefix = if module == "bin" { "gems::" } else { "crate::" };
        for (line, used) in uses(&text, prefix) {
            let Some(theirs) = layer(&used) else {
                if module != "bin" {
                    bad.push(format!(
                        "{}:{line}: crate::{used} is not a module of a layer (use the module's path)",
                        rel.display()
                    ));
                }
                continue;
            };
            if theirs > own || (theirs == own && used != module) {
                bad.push(format!(
                    "{}:{line}: {module} (layer {own}) uses {used} (layer {theirs})",
                    rel.display()
                ));
            }
        }
    }
    bad
}

#[test]
fn every_import_points_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = violations(&src);
    assert!(
        bad.is_empty(),
        "imports against the layers:\n{}",
        bad.join("\n")
    );
}

#[test]
fn a_planted_upward_import_is_caught() {
    let dir = std::env::temp_dir().join(format!("gems-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tensor")).unwrap();
    std::fs::write(dir.join("tensor/mod.rs"), "use crate::runtime::Session;\n").unwrap();
    std::fs::write(dir.join("data.rs"), "use crate::comm::Comm; // peers\n").unwrap();
    std::fs::write(
        dir.join("plan.rs"),
        "// crate::fit in a comment\nuse crate::graph::Graph;\n",
    )
    .unwrap();
    let bad = violations(&dir);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        bad.iter()
            .any(|b| b.contains("tensor (layer 3) uses runtime (layer 10)")),
        "{bad:?}"
    );
    assert!(
        bad.iter()
            .any(|b| b.contains("data (layer 4) uses comm (layer 4)")),
        "{bad:?}"
    );
}

/// A circle among the files of one module (`crate::m::a` uses `crate::m::b`, which uses
/// `crate::m::a`, perhaps through others), named by its files; `None` without one.
fn circle(src: &Path, module: &str) -> Option<Vec<String>> {
    let dir = src.join(module);
    let mut files = Vec::new();
    sources(&dir, &mut files);
    let name = |p: &Path| top(&dir, p);
    let prefix = format!("crate::{module}::");
    let mut edges: Vec<(String, String)> = Vec::new();
    for f in &files {
        let from = name(f);
        for (_, to) in uses(&std::fs::read_to_string(f).unwrap(), &prefix) {
            let sibling = dir.join(format!("{to}.rs")).exists() || dir.join(&to).is_dir();
            if sibling && to != from && from != "mod" {
                edges.push((from.clone(), to));
            }
        }
    }
    // Depth-first from each file; a file met again on the current path closes a circle.
    fn walk(at: &str, edges: &[(String, String)], path: &mut Vec<String>) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            return Some([&path[i..], &[at.to_string()]].concat());
        }
        path.push(at.to_string());
        for (_, to) in edges.iter().filter(|(from, _)| from == at) {
            if let Some(c) = walk(to, edges, path) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    edges
        .iter()
        .find_map(|(from, _)| walk(from, &edges, &mut Vec::new()))
}

#[test]
fn no_module_s_files_import_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            let module = p.file_name().unwrap().to_string_lossy().into_owned();
            if let Some(c) = circle(&src, &module) {
                panic!("{module}'s files import in a circle: {}", c.join(" → "));
            }
        }
    }
}

#[test]
fn a_planted_circle_is_caught() {
    let dir = std::env::temp_dir().join(format!("gems-circle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("plan")).unwrap();
    std::fs::write(
        dir.join("plan/mod.rs"),
        "pub mod a;\npub mod b;\npub mod c;\n",
    )
    .unwrap();
    std::fs::write(dir.join("plan/a.rs"), "use crate::plan::b::B;\n").unwrap();
    std::fs::write(dir.join("plan/b.rs"), "use crate::plan::c::C;\n").unwrap();
    std::fs::write(dir.join("plan/c.rs"), "// crate::plan::b\n").unwrap();
    assert_eq!(circle(&dir, "plan"), None);
    std::fs::write(dir.join("plan/c.rs"), "fn f() { crate::plan::a::g() }\n").unwrap();
    let c = circle(&dir, "plan").expect("a → b → c → a");
    assert_eq!(c.len(), 4, "{c:?}");
    std::fs::remove_dir_all(dir).ok();
}
