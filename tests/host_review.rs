//! Review items with a wrong answer, each with the test that showed it: a growing region's
//! buffer has one length (item 10), the host backend keeps no descriptor per mapped chunk
//! (item 11), an address is handed out only for a live buffer (item 12).

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Error, Pager, Policy};

const MIB: usize = 1 << 20;

fn pager() -> Pager {
    Pager::new(Arc::new(HostBackend::new(HostConfig {
        capacity: 1024 * MIB,
        granularity: 2 * MIB,
    })))
}

#[test]
fn a_growing_region_s_buffer_has_the_length_it_was_asked_for() {
    let pager = pager();
    pager.region("g", 0, Policy::Preserve).unwrap();
    let b = pager.alloc("g", 100).unwrap();
    let p = pager.ptr(&b).unwrap();
    let (found, offset) = pager.buffer_containing(p).unwrap();
    assert_eq!((found.len(), offset), (100, 0));
    assert_eq!(found, b, "one buffer, one handle");
    assert_eq!(
        pager.buffer_containing(p + 99).map(|(f, o)| (f.len(), o)),
        Some((100, 99))
    );
    assert!(
        pager.buffer_containing(p + 100).is_none(),
        "the padding is no buffer's"
    );
    assert!(matches!(
        pager.write(&found, 100, &[1]),
        Err(Error::OutOfRange { .. })
    ));
}

/// In a child process with at most 64 open descriptors: 300 buffers of a growing region.
#[test]
fn many_mapped_chunks_need_no_descriptor_each() {
    const CHILD: &str = "GPU_PAGER_NOFILE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let limit = libc::rlimit {
            rlim_cur: 64,
            rlim_max: 64,
        };
        // SAFETY: a plain system call with a valid rlimit; this child runs this test alone.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
        let pager = pager();
        pager.region("g", 0, Policy::Discard).unwrap();
        let bufs: Vec<_> = (0..300).map(|_| pager.alloc("g", 4096).unwrap()).collect();
        pager.release(&["g"]).unwrap();
        pager.resume(&["g"]).unwrap();
        for b in &bufs {
            pager.write(b, 0, &[1; 16]).unwrap();
        }
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "many_mapped_chunks_need_no_descriptor_each",
            "--test-threads",
            "1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && log.contains("1 passed"), "{log}");
}

#[test]
fn an_address_is_only_handed_out_for_a_live_buffer() {
    let pager = pager();
    pager.region("w", 8 * MIB, Policy::Discard).unwrap();
    let b = pager.alloc("w", 4096).unwrap();
    let first = pager.address(&b).unwrap();
    assert_eq!(first, pager.ptr(&b).unwrap());
    pager.release(&["w"]).unwrap();
    assert_eq!(
        pager.address(&b).unwrap(),
        first,
        "released: the address still stands"
    );
    pager.resume(&["w"]).unwrap();
    // The region removed and made again under the same tag: the old buffer has no address
    // there (its offset would name memory of the new region).
    pager.remove("w").unwrap();
    pager.region("w", 8 * MIB, Policy::Discard).unwrap();
    assert!(matches!(pager.address(&b), Err(Error::StaleBuffer { .. })));
}
