//! The residency audit and the release's warning, on the host backend: the audit's numbers
//! are the regions' and the backend's own accounting.

use std::sync::{Arc, Mutex, OnceLock};

use gpu_pager::backend::Backend;
use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Pager, PagerConfig, Policy, State};
use gpu_pager_testkit::Hog;

const MIB: usize = 1 << 20;

/// Warnings logged by any test of this binary, kept for the tests that look for theirs.
struct Captured(Mutex<Vec<String>>);

impl log::Log for Captured {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Warn
    }
    /// Keeps the message, then ` |` and the record's fields as ` key=value`.
    fn log(&self, r: &log::Record<'_>) {
        struct Fields(String);
        impl<'k> log::kv::VisitSource<'k> for Fields {
            fn visit_pair(
                &mut self,
                k: log::kv::Key<'k>,
                v: log::kv::Value<'k>,
            ) -> Result<(), log::kv::Error> {
                self.0 += &format!(" {k}={v}");
                Ok(())
            }
        }
        if self.enabled(r.metadata()) {
            let mut fields = Fields(format!("{} |", r.args()));
            r.key_values().visit(&mut fields).unwrap();
            self.0.lock().unwrap().push(fields.0);
        }
    }
    fn flush(&self) {}
}

fn warnings_naming(needle: &str) -> Vec<String> {
    static LOGGER: OnceLock<&'static Captured> = OnceLock::new();
    let logger = LOGGER.get_or_init(|| {
        let l: &'static Captured = Box::leak(Box::new(Captured(Mutex::new(Vec::new()))));
        let _ = log::set_logger(l);
        log::set_max_level(log::LevelFilter::Warn);
        l
    });
    logger
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.contains(needle))
        .cloned()
        .collect()
}

fn setup(warn_above: usize) -> (Arc<HostBackend>, Pager) {
    warnings_naming(""); // the logger, before anything logs
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 << 10,
    }));
    let pager = Pager::with_config(
        backend.clone(),
        PagerConfig {
            resident_warning_bytes: warn_above,
            ..PagerConfig::default()
        },
    );
    (backend, pager)
}

#[test]
fn the_audit_adds_up_to_the_regions_and_the_backend() {
    let (backend, p) = setup(usize::MAX);
    p.region("audit-w", 8 * MIB, Policy::Preserve).unwrap();
    p.region("audit-kv", 16 * MIB, Policy::Discard).unwrap();
    let w = p.alloc("audit-w", MIB).unwrap();
    p.write(&w, 0, &[1u8; MIB]).unwrap();
    let hog = Hog::take(backend.as_ref(), 4 * MIB).unwrap(); // memory outside every region

    let a = p.audit().unwrap();
    let mem = backend.mem_info().unwrap();
    assert_eq!(
        (a.device_total_bytes, a.device_free_bytes),
        (mem.total, mem.free)
    );
    assert_eq!(a.mapped_bytes(), p.stats().resident_bytes());
    assert_eq!(a.mapped_bytes(), 24 * MIB);
    assert_eq!(a.outside_bytes(), 4 * MIB, "the hog, and nothing else");
    assert_eq!(a.device_used_bytes(), 28 * MIB);
    // The host backend's device is this process's alone, as NVML would report it.
    assert_eq!(a.this_process_bytes(), Some(28 * MIB));
    assert_eq!(a.other_processes_bytes(), Some(0));
    assert!(a.to_string().contains(" (this one) "), "{a}");

    p.release(&["audit-kv", "audit-w"]).unwrap();
    let a = p.audit().unwrap();
    let w_entry = a.region("audit-w").unwrap();
    assert_eq!(w_entry.state, State::Released);
    assert_eq!((w_entry.mapped_bytes, w_entry.reserved_bytes), (0, 8 * MIB));
    assert_eq!(w_entry.allocated_bytes, MIB);
    assert!(w_entry.backup_bytes >= MIB);
    assert_eq!(a.mapped_bytes(), 0);
    assert_eq!(a.outside_bytes(), 4 * MIB);
    let table = a.to_string();
    assert!(
        table.contains("audit-w") && table.contains("released"),
        "{table}"
    );
    assert!(table.contains("outside every region"), "{table}");
    drop(hog);
    assert_eq!(p.audit().unwrap().device_used_bytes(), 0);
}

#[test]
fn a_release_warns_when_much_stays_outside_the_regions_and_is_quiet_otherwise() {
    let (backend, p) = setup(6 * MIB);
    p.region("warn-kept", 8 * MIB, Policy::Discard).unwrap();
    p.region("warn-gone", 4 * MIB, Policy::Discard).unwrap();
    p.region("quiet-a", 2 * MIB, Policy::Discard).unwrap();
    // 8 MiB stay resident in `warn-kept`: a release in stages keeps it on purpose, quiet.
    p.release(&["warn-gone"]).unwrap();
    assert!(warnings_naming("[\"warn-gone\"]").is_empty());
    // 10 MiB held outside every region (another allocator's): more than 6 MiB, named.
    let hog = Hog::take(backend.as_ref(), 10 * MIB).unwrap();
    p.release(&["quiet-a"]).unwrap();
    let w = warnings_naming("[\"quiet-a\"]");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains(
            "0.01 GiB of this process's device memory is still in use outside every region"
        ),
        "{}",
        w[0]
    );
    assert!(
        w[0].contains("regions left resident: `warn-kept` 0.01 GiB"),
        "{}",
        w[0]
    );
    // The same as data, for bindings (Python's torch module adds torch's holders by it).
    assert!(
        w[0].ends_with(&format!(
            " | event={} device=0 outside_bytes={}",
            gpu_pager::RESIDENT_EVENT,
            10 * MIB
        )),
        "{}",
        w[0]
    );
    // Released already: nothing moves, no second warning.
    p.release(&["quiet-a"]).unwrap();
    assert_eq!(warnings_naming("[\"quiet-a\"]").len(), 1);
    // With 2 MiB outside the regions: quiet.
    drop(hog);
    let _hog = Hog::take(backend.as_ref(), 2 * MIB).unwrap();
    p.release(&["warn-kept"]).unwrap();
    assert!(warnings_naming("[\"warn-kept\"]").is_empty());
}

/// The release's warning never waits for a region: a companion of `outer` that releases
/// `inner` (its release walks the regions while this thread holds `outer`) and a release
/// beside a resume of another tag on another thread both finish, with the warning path
/// active (much memory outside every region).
#[test]
fn the_warning_never_waits_for_a_region() {
    struct ReleasesInner(std::sync::Weak<Pager>);
    impl gpu_pager::Companion for ReleasesInner {
        fn name(&self) -> &str {
            "releases inner"
        }
        fn before_release(&self, _: &str) -> Result<(), gpu_pager::CompanionError> {
            let p = self.0.upgrade().ok_or("no pager")?;
            p.release(&["nowait-inner"]).map_err(|e| e.to_string())?;
            Ok(())
        }
        fn after_resume(&self, _: &str) -> Result<(), gpu_pager::CompanionError> {
            Ok(())
        }
    }
    let (backend, p) = setup(MIB);
    let p = Arc::new(p);
    p.region("nowait-outer", 4 * MIB, Policy::Discard).unwrap();
    p.region("nowait-inner", 4 * MIB, Policy::Discard).unwrap();
    p.add_companion("nowait-outer", Arc::new(ReleasesInner(Arc::downgrade(&p))))
        .unwrap();
    let hog = Hog::take(backend.as_ref(), 10 * MIB).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let q = p.clone();
    std::thread::spawn(move || {
        tx.send(q.release(&["nowait-outer"]).map(|_| ())).unwrap();
    });
    let done = rx.recv_timeout(std::time::Duration::from_secs(20));
    assert!(
        matches!(done, Ok(Ok(()))),
        "a companion's release of another tag hung or failed: {done:?}"
    );
    assert_eq!(p.info("nowait-inner").unwrap().state, State::Released);
    drop(hog);
}

/// A tag with a newline stays on its own row of the audit's table (escaped), as it does
/// in the release's warning.
#[test]
fn a_tag_with_a_newline_keeps_the_table_s_rows() {
    let (_, p) = setup(usize::MAX);
    p.region("two\nlines", 4 * MIB, Policy::Discard).unwrap();
    let table = p.audit().unwrap().to_string();
    assert!(table.contains("two\\nlines"), "{table}");
    assert!(
        !table.lines().any(|l| l.starts_with("lines")),
        "the tag split a row: {table}"
    );
}
