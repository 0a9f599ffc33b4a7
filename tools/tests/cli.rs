//! The `gpu-pager` program as a user runs it (on the host backend here): review items 13
//! (a small KV cache is no failure), 14 (the seed it prints is one `--seed` takes) and 15
//! (errors say what is wrong without a placeholder tag, before any banner) and 18 (the first
//! cycle's copy rate is no 0.0 GB/s; each command's `--help` shows its own defaults).

use std::process::Command;

fn gpu_pager(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-pager"))
        .args(args)
        .env("GPU_PAGER_HOST_CAPACITY", "2G")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_demo_with_a_small_kv_cache_passes() {
    let (ok, out) = gpu_pager(&[
        "demo",
        "--weights-gib",
        "0.25",
        "--kv-gib",
        "0.5",
        "--cycles",
        "1",
    ]);
    assert!(ok, "{out}");
    assert!(!out.contains("FAILED"), "{out}");
    assert!(!out.contains(" 0.0 GB/s"), "every copy has a rate: {out}");
    assert!(out.contains("while pinning"), "{out}");
}

#[test]
fn each_command_s_help_shows_its_own_defaults() {
    let (ok, demo) = gpu_pager(&["demo", "--help"]);
    assert!(ok, "{demo}");
    assert!(demo.contains("default: 4 on a GPU"), "{demo}");
    assert!(!demo.contains("bench") && !demo.contains("16"), "{demo}");
    let (ok, bench) = gpu_pager(&["bench", "--help"]);
    assert!(ok, "{bench}");
    assert!(bench.contains("default: 16 on a GPU"), "{bench}");
    assert!(!bench.contains("demo"), "{bench}");
}

#[test]
fn the_printed_seed_replays() {
    let (ok, out) = gpu_pager(&[
        "stress",
        "--duration",
        "300ms",
        "--seed",
        "0x2a",
        "--threads",
        "1",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("seed 42"),
        "the seed in the form --seed takes: {out}"
    );
    assert!(!out.contains("0x2a"), "{out}");
    let (ok, out) = gpu_pager(&[
        "stress",
        "--duration",
        "300ms",
        "--seed",
        "42",
        "--threads",
        "1",
    ]);
    assert!(ok, "{out}");
}

#[test]
fn bad_arguments_are_refused_before_anything_runs() {
    let (ok, out) = gpu_pager(&["stress", "--threads", "0"]);
    assert!(!ok);
    assert!(
        !out.contains("stress:"),
        "no banner before the refusal: {out}"
    );
    let (ok, out) = gpu_pager(&["demo", "--chunk-mib", "0"]);
    assert!(!ok);
    assert!(out.contains("chunk-mib"), "{out}");
    let (ok, out) = gpu_pager(&["demo", "--weights-gib", "-1"]);
    assert!(!ok);
    assert!(
        !out.contains("`*`"),
        "no placeholder tag in the message: {out}"
    );
}

/// One host-fallback rule for the program and the library's registry: a malformed host
/// capacity is an error that names the variable, not a silent default.
#[test]
fn a_malformed_host_capacity_is_refused_as_the_library_refuses_it() {
    // Without --host a GPU machine opens its GPU and never reads the variable.
    let gpu = std::path::Path::new("/dev/nvidia0").exists();
    for host in [gpu, true] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-pager"));
        if host {
            cmd.arg("--host");
        }
        let out = cmd
            .arg("info")
            .env("GPU_PAGER_HOST_CAPACITY", "lots")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "--host {host}: {text}");
        assert!(
            text.contains("GPU_PAGER_HOST_CAPACITY"),
            "--host {host}: {text}"
        );
    }
}
