//! The core's modules form layers: the top-level modules of `src/` import one another
//! without a circle. A path through the crate root's re-exports (`crate::Pager`) counts as
//! an import of the module that defines the name, so a module cannot reach one above it
//! that way either.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`src/pager/moves.rs` and `src/pager.rs`
/// are `pager`); `None` for the crate root.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.to_owned();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
    (name != "lib").then_some(name)
}

/// The text of a file without its comments (`//` to the end of the line; the core has no
/// block comments).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn identifier(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of each path after `prefix` in `text`: `prefix x::y` gives `x`, and
/// `prefix {A, b::C}` gives `A` and `b`.
fn first_segments(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        rest = &rest[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            out.extend(
                group[..end]
                    .split(',')
                    .map(|item| identifier(item.trim()).to_owned()),
            );
        } else {
            out.push(identifier(rest).to_owned());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// The crate root's re-exports: each name `pub use m::...` makes public, with its module `m`.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in code(lib).split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        let module = identifier(path).to_owned();
        let items = match path.find('{') {
            Some(i) => path[i + 1..].trim_end_matches('}').to_owned(),
            None => path.rsplit("::").next().unwrap_or("").to_owned(),
        };
        for item in items.split(',') {
            let name = item.trim().rsplit("::").next().unwrap_or("").trim();
            if !name.is_empty() {
                names.insert(name.to_owned(), module.clone());
            }
        }
    }
    names
}

#[test]
fn the_core_s_modules_import_one_another_without_a_circle() {
    let src = Path::new(ROOT).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&src, f)).collect();
    let names = reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    assert!(
        names.get("Pager").map(String::as_str) == Some("pager"),
        "lib.rs's re-exports were not read: {names:?}"
    );
    // module → module it imports → a file that does it
    let mut imports: BTreeMap<String, BTreeMap<String, PathBuf>> = BTreeMap::new();
    for file in &files {
        let Some(from) = module_of(&src, file) else {
            continue;
        };
        let text = code(&std::fs::read_to_string(file).unwrap());
        for first in first_segments(&text, "crate::") {
            let to = if modules.contains(&first) {
                Some(first)
            } else {
                names.get(&first).cloned()
            };
            if let Some(to) = to.filter(|to| *to != from) {
                imports
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| file.clone());
            }
        }
    }
    assert!(
        imports
            .get("pager")
            .is_some_and(|m| m.contains_key("backend")),
        "no imports found: {imports:?}"
    );
    // Depth-first; a module met again while it is on the path closes a circle.
    fn visit(
        m: &str,
        imports: &BTreeMap<String, BTreeMap<String, PathBuf>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut circle = path[i..].to_vec();
            circle.push(m.to_owned());
            return Some(circle);
        }
        if !done.insert(m.to_owned()) {
            return None;
        }
        path.push(m.to_owned());
        for next in imports.get(m).into_iter().flat_map(|t| t.keys()) {
            if let Some(c) = visit(next, imports, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for m in &modules {
        if let Some(circle) = visit(m, &imports, &mut Vec::new(), &mut done) {
            let steps: Vec<String> = circle
                .windows(2)
                .map(|w| format!("{} → {} ({})", w[0], w[1], imports[&w[0]][&w[1]].display()))
                .collect();
            panic!("src/ imports in a circle: {}", steps.join(", "));
        }
    }
}
