//! Gives libgpu_pager.so its SONAME on ELF targets, so programs linked against it record
//! `libgpu_pager.so` (found through their rpath or LD_LIBRARY_PATH), not the path it was
//! linked from.

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "macos" && os != "ios" && os != "windows" {
        println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libgpu_pager.so");
    }
}
