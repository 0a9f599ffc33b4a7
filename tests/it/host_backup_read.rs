//! Reading a released buffer from its pinned backup (`Pager::read_backup`) on the host
//! backend: exactly what the release saved, and typed errors where there is no such copy.

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Error, Pager, PagerConfig, Policy};

const MIB: usize = 1 << 20;

fn pager() -> Pager {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 64 * MIB,
        granularity: 64 << 10,
    }));
    Pager::with_config(
        backend,
        PagerConfig {
            chunk_bytes: MIB,
            tuning: gpu_pager::Tuning {
                copy_gap_bytes: 0,
                ..gpu_pager::Tuning::default()
            },
            ..PagerConfig::default()
        },
    )
}

#[test]
fn a_released_buffer_reads_back_from_its_backup() {
    let p = pager();
    p.region("w", 8 * MIB, Policy::Preserve).unwrap();
    let a = p.alloc("w", MIB).unwrap();
    let b = p.alloc("w", MIB).unwrap();
    let data: Vec<u8> = (0..MIB).map(|i| (i * 7 + 3) as u8).collect();
    p.write(&a, 0, &data).unwrap();
    p.write(&b, 0, &data).unwrap();
    let mut out = vec![0u8; 4096];
    // Resident: the device is current, the backup (none yet) is not the place to read.
    assert!(matches!(
        p.read_backup(&a, 0, &mut out),
        Err(Error::InvalidArgument { .. })
    ));
    p.set_overwritten(&b, 4096..8192, true).unwrap();
    p.release(&["w"]).unwrap();
    p.read_backup(&a, 1000, &mut out).unwrap();
    assert_eq!(out, data[1000..1000 + 4096]);
    p.read_backup(&b, 0, &mut out).unwrap(); // before the marked bytes
    assert_eq!(out, data[..4096]);
    // Marked at the release: not in the backup.
    let e = p.read_backup(&b, 4000, &mut out).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("overwritten"), "{e}");
    // Outside the buffer.
    let mut big = vec![0u8; MIB + 1];
    assert!(matches!(
        p.read_backup(&a, 0, &mut big),
        Err(Error::OutOfRange { .. })
    ));
    // Freed: stale.
    p.free(&a).unwrap();
    assert!(matches!(
        p.read_backup(&a, 0, &mut out),
        Err(Error::StaleBuffer { .. })
    ));
    // The resume restores what the backup held.
    p.resume(&["w"]).unwrap();
    let mut got = vec![0u8; 4096];
    p.read(&b, 8192, &mut got).unwrap();
    assert_eq!(got, data[8192..8192 + 4096]);
}

#[test]
fn a_discard_region_has_no_backup_to_read() {
    let p = pager();
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    let k = p.alloc("kv", MIB).unwrap();
    p.release(&["kv"]).unwrap();
    let mut out = vec![0u8; 16];
    assert!(matches!(
        p.read_backup(&k, 0, &mut out),
        Err(Error::InvalidArgument { .. })
    ));
}
