//! One slow call does not stall the calls on other tags (review item 7): a region being
//! created (mapping its memory) and a region being removed (waiting for the device) hold no
//! lock that every tag needs.

use crate::common;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{Pager, Policy};
use gpu_pager_testkit::{FaultPlan, FaultyBackend, HoldPoint};

const MIB: usize = 1 << 20;
/// How long another tag's call may take while one call is held: far more than it needs.
const PATIENCE: Duration = Duration::from_secs(10);

fn setup() -> (Arc<FaultyBackend>, Arc<Pager>) {
    let host = Arc::new(HostBackend::new(HostConfig {
        capacity: 256 * MIB,
        granularity: 2 * MIB,
    }));
    let faulty = Arc::new(FaultyBackend::new(host, FaultPlan::none()));
    let pager = Arc::new(Pager::new(faulty.clone()));
    pager.region("other", 8 * MIB, Policy::Preserve).unwrap();
    (faulty, pager)
}

/// Runs `f` on another thread; true when it returned within `PATIENCE`.
fn finishes(pager: &Arc<Pager>, f: impl FnOnce(&Pager) + Send + 'static) -> bool {
    let (tx, rx) = mpsc::channel();
    let p = pager.clone();
    std::thread::spawn(move || {
        f(&p);
        let _ = tx.send(());
    });
    rx.recv_timeout(PATIENCE).is_ok()
}

#[test]
fn creating_a_region_does_not_stall_calls_on_other_tags() {
    let (faulty, pager) = setup();
    let hold = faulty.hold_next(HoldPoint::Map);
    let p = pager.clone();
    let creating =
        std::thread::spawn(move || p.region("new", 16 * MIB, Policy::Discard).map(|_| ()));
    assert!(hold.wait_entered(PATIENCE), "the creation reached its map");
    assert!(
        finishes(&pager, |p| {
            let b = p.alloc("other", 4096).unwrap();
            p.write(&b, 0, &[1; 4096]).unwrap();
            assert_eq!(
                p.tags(),
                vec!["other".to_owned()],
                "the new region is not there yet"
            );
        }),
        "a call on another tag waited for the creation's map"
    );
    hold.open();
    creating.join().unwrap().unwrap();
    assert_eq!(pager.tags(), vec!["new".to_owned(), "other".to_owned()]);
}

#[test]
fn removing_a_region_does_not_stall_calls_on_other_tags() {
    let (faulty, pager) = setup();
    pager.region("gone", 8 * MIB, Policy::Discard).unwrap();
    let hold = faulty.hold_next(HoldPoint::Synchronize);
    let p = pager.clone();
    let removing = std::thread::spawn(move || p.remove("gone"));
    assert!(
        hold.wait_entered(PATIENCE),
        "the removal reached its wait for the device"
    );
    assert!(
        finishes(&pager, |p| {
            p.info("other").unwrap();
            p.region("third", 2 * MIB, Policy::Discard).unwrap();
        }),
        "a call on another tag waited for the removal"
    );
    hold.open();
    removing.join().unwrap().unwrap();
    assert!(pager.info("gone").is_err());
}

#[test]
fn a_lease_taken_while_a_removal_waits_keeps_the_region() {
    let (faulty, pager) = setup();
    pager.region("leased", 8 * MIB, Policy::Discard).unwrap();
    let hold = faulty.hold_next(HoldPoint::Synchronize);
    let p = pager.clone();
    let removing = std::thread::spawn(move || p.remove("leased"));
    assert!(hold.wait_entered(PATIENCE));
    let lease = pager.lease(&["leased"]).unwrap();
    hold.open();
    let e = removing.join().unwrap().unwrap_err();
    assert!(matches!(e, gpu_pager::Error::Busy { .. }), "{e}");
    assert!(pager.info("leased").is_ok());
    drop(lease);
}

/// Asking again for an existing region with `prepin` pins its backup then (review item 9),
/// instead of ignoring the option.
#[test]
fn prepin_on_an_existing_region_pins_then() {
    let (_faulty, pager) = setup();
    for (tag, bytes) in [("fixed", 8 * MIB), ("growing", 0)] {
        common::table_region(
            &pager,
            tag,
            bytes,
            Policy::Preserve,
            gpu_pager::RegionOptions::default(),
        )
        .unwrap();
        let b = pager.alloc(tag, 3 * MIB).unwrap();
        pager.write(&b, 0, &[4; 4096]).unwrap();
        assert_eq!(pager.region_stats(tag).unwrap().backup_bytes, 0);
        let prepin = gpu_pager::RegionOptions {
            prepin: true,
            ..Default::default()
        };
        common::table_region(&pager, tag, bytes, Policy::Preserve, prepin).unwrap();
        assert!(
            pager.region_stats(tag).unwrap().backup_bytes >= 3 * MIB,
            "{tag}"
        );
        if bytes == 0 {
            // Later buffers of a growing region are pinned as they are allocated.
            pager.alloc(tag, 2 * MIB).unwrap();
            assert!(
                pager.region_stats(tag).unwrap().backup_bytes >= 5 * MIB,
                "{tag}"
            );
        }
    }
}
