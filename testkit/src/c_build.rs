//! Building and finding the C pieces of the C tests: the system C compiler on a test
//! program against `include/`, and the shared library cargo built for the test's package.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (this crate lies in `testkit/`).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ has a parent")
        .to_path_buf()
}

/// Runs the C compiler (`$CC`, else `cc`) on `source` with warnings as errors, `include/`
/// on the include path and `args`, writing `out`; returns `out`.
pub fn cc(source: &Path, out: PathBuf, args: &[&OsStr]) -> PathBuf {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args(["-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg("-I")
        .arg(workspace().join("include"))
        .arg(source)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (set CC): {e}"));
    assert!(
        status.success(),
        "{cc} failed on {} ({status})",
        source.display()
    );
    out
}

/// The shared library `file` (`libgpu_pager.so`, ...) that cargo built for the running
/// test's package: in `deps/` beside the test binary, where the build for this test puts
/// it (`target/<profile>/` holds a copy only after `cargo build`, maybe an older one).
pub fn built_library(file: &str, package: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    let deps = exe.parent().expect("the test lies in deps/");
    let candidates = [Some(deps.join(file)), deps.parent().map(|d| d.join(file))];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{file} not found next to {}; build it with `cargo build -p {package}` (cargo \
                 test builds it first)",
                deps.display()
            )
        })
}

/// The functions `library` (a shared library) defines and exports, sorted, as `nm -D
/// --defined-only` lists them (text symbols).
pub fn exported(library: &Path) -> Vec<String> {
    let nm = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(library)
        .output()
        .expect("nm (binutils) runs");
    assert!(nm.status.success(), "nm failed");
    let mut names: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, kind, name) = (f.next()?, f.next()?, f.next()?);
            (kind == "T").then(|| name.to_owned())
        })
        .collect();
    names.sort();
    names
}

/// The `gpu_pager_*` functions the header `include/<header>` declares, sorted: identifiers
/// directly followed by `(`, outside `//` comments.
pub fn declared(header: &str) -> Vec<String> {
    let text = std::fs::read_to_string(workspace().join("include").join(header))
        .expect("the header is there");
    let mut names: Vec<String> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .flat_map(|l| {
            l.match_indices("gpu_pager_")
                .filter_map(|(i, _)| {
                    let name: String = l[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    l[i + name.len()..].starts_with('(').then_some(name)
                })
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names
}
