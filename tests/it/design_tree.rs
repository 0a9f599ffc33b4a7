//! DESIGN.md's tree of the repository is checked against the files: every path it lists at
//! the top level exists, and every file and folder of `src/` (and of its folders) is named
//! in its `src/` entry.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The tree: the indented block that starts with `Cargo.toml build.rs`, as (first column,
/// the entry's whole text).
fn tree() -> Vec<(String, String)> {
    let design = std::fs::read_to_string(Path::new(ROOT).join("DESIGN.md")).unwrap();
    let mut entries: Vec<(String, String)> = Vec::new();
    let mut inside = false;
    for line in design.lines() {
        if line.starts_with("    Cargo.toml build.rs") {
            inside = true;
        }
        if !inside {
            continue;
        }
        if !line.starts_with("    ") {
            break;
        }
        let body = &line[4..];
        if body.starts_with(' ') {
            if let Some(last) = entries.last_mut() {
                last.1.push(' ');
                last.1.push_str(body.trim());
            }
        } else {
            let (head, rest) = body.split_at(body.find("  ").unwrap_or(body.len()));
            entries.push((head.trim().to_owned(), rest.trim().to_owned()));
        }
    }
    entries
}

#[test]
fn design_s_tree_names_what_is_there() {
    let entries = tree();
    assert!(entries.len() > 10, "no tree found in DESIGN.md");
    for (head, _) in &entries {
        for path in head.split_whitespace() {
            assert!(
                Path::new(ROOT).join(path).exists(),
                "DESIGN.md's tree lists {path}, which does not exist"
            );
        }
    }
    let src = &entries
        .iter()
        .find(|(h, _)| h == "src/")
        .expect("an entry for src/")
        .1;
    let mut missing = Vec::new();
    for dir in [
        "src",
        "src/pager",
        "src/backup",
        "src/backend",
        "src/region",
        "src/pump",
    ] {
        for e in std::fs::read_dir(Path::new(ROOT).join(dir)).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let shown = if e.path().is_dir() {
                format!("{name}/")
            } else {
                name.clone()
            };
            if (name.ends_with(".rs") || e.path().is_dir()) && !src.contains(&shown) {
                missing.push(format!("{dir}/{shown}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "DESIGN.md's src/ entry does not name {missing:?}"
    );
}
