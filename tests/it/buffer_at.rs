//! `Pager::buffer_at` / `buffer_containing`: from a device address back to its buffer.

use crate::common;

use gpu_pager::{Pager, Policy};

fn pager() -> Pager {
    common::host_pager(256 << 20)
}

#[test]
fn finds_live_buffers_by_address_in_any_region_and_state() {
    let p = pager();
    let a = p.region("a", 4 << 20, Policy::Preserve).unwrap();
    let b = p.region("b", 4 << 20, Policy::Discard).unwrap();
    let x = p.alloc("a", 1000).unwrap();
    let y = p.alloc("b", 300).unwrap();
    let z = p.alloc("b", 300).unwrap();
    let (px, py, pz) = (p.ptr(&x).unwrap(), p.ptr(&y).unwrap(), p.ptr(&z).unwrap());
    assert_eq!(p.buffer_at(px), Some(x.clone()));
    assert_eq!(p.buffer_at(py), Some(y.clone()));
    assert_eq!(p.buffer_at(pz), Some(z.clone()));
    assert_eq!(p.buffer_at(px + 1), None);
    assert_eq!(p.buffer_containing(px + 999), Some((x.clone(), 999)));
    assert_eq!(p.buffer_containing(px + 1000), None);
    assert_eq!(p.buffer_at(a.base.wrapping_sub(1)), None);
    assert_eq!(p.buffer_at(0), None);
    assert_eq!(p.buffer_at(u64::MAX), None);
    assert_eq!(p.buffer_at(b.base + b.size as u64), None);

    // Released regions keep their bookkeeping: the lookup still answers.
    p.release(&["a", "b"]).unwrap();
    assert_eq!(p.buffer_at(px), Some(x.clone()));
    p.resume(&["a", "b"]).unwrap();

    // What the lookup returns is the buffer: it frees it, once.
    let found = p.buffer_at(py).unwrap();
    p.free(&found).unwrap();
    assert!(p.free(&y).is_err());
    assert_eq!(p.buffer_at(py), None);
    assert_eq!(p.buffer_at(pz), Some(z));

    // A removed region's addresses are gone from the index.
    p.free(&x).unwrap();
    p.remove("a").unwrap();
    assert_eq!(p.buffer_at(px), None);
    let c = p.region("c", 2 << 20, Policy::Discard).unwrap();
    let w = p.alloc("c", 64).unwrap();
    assert_eq!(p.buffer_at(c.base), Some(w));
}
