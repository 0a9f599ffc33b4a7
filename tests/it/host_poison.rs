//! Poisoned discards (`PagerConfig::poison_discards`): memory that comes back without its
//! contents reads as NaN, on the host backend.

use std::sync::Arc;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager::{POISON, Pager, PagerConfig, Policy, ReleaseOptions};

const MIB: usize = 1 << 20;

fn pager(poison: bool) -> Pager {
    Pager::with_config(
        Arc::new(HostBackend::new(HostConfig {
            capacity: 64 * MIB,
            granularity: 64 << 10,
        })),
        PagerConfig {
            poison_discards: poison,
            ..PagerConfig::default()
        },
    )
}

fn poisoned(len: usize) -> Vec<u8> {
    POISON
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(len)
        .collect()
}

#[test]
fn poison_reads_as_nan_in_bf16_fp16_and_fp32() {
    let word = POISON;
    assert!(f32::from_bits(word).is_nan());
    for half in [(word & 0xFFFF) as u16, (word >> 16) as u16] {
        // bf16: the upper half of an fp32.
        assert!(
            f32::from_bits(u32::from(half) << 16).is_nan(),
            "bf16 {half:#x}"
        );
        // fp16: exponent bits all ones, mantissa not zero.
        assert!(
            half & 0x7C00 == 0x7C00 && half & 0x03FF != 0,
            "fp16 {half:#x}"
        );
    }
}

#[test]
fn discarded_and_dropped_memory_comes_back_poisoned() {
    let p = pager(true);
    assert!(p.config().poison_discards);
    p.region("kv", 4 * MIB, Policy::Discard).unwrap();
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    p.region("z", 4 * MIB, Policy::DiscardZeroed).unwrap();
    let kv = p.alloc("kv", MIB).unwrap();
    let w = p.alloc("w", MIB).unwrap();
    let z = p.alloc("z", MIB).unwrap();
    for b in [&kv, &w, &z] {
        p.write(b, 0, &[1u8; MIB]).unwrap();
    }
    let mut back = vec![0u8; MIB];

    // A Discard region, and a Preserve region dropped at its release: the pattern.
    p.release_with(
        &["kv", "w", "z"],
        &ReleaseOptions {
            drop: vec!["w".into()],
        },
    )
    .unwrap();
    let report = p.resume(&["kv", "w", "z"]).unwrap();
    for b in [&kv, &w] {
        p.read(b, 0, &mut back).unwrap();
        assert_eq!(back, poisoned(MIB), "{}", b.tag());
    }
    // DiscardZeroed keeps its promise.
    p.read(&z, 0, &mut back).unwrap();
    assert_eq!(back, vec![0u8; MIB]);
    assert!(report.region("kv").is_some());

    // A Preserve region released with its contents kept: bit-exact, no poison.
    p.write(&w, 0, &[9u8; MIB]).unwrap();
    p.release(&["w"]).unwrap();
    p.resume(&["w"]).unwrap();
    p.read(&w, 0, &mut back).unwrap();
    assert_eq!(back, vec![9u8; MIB]);
}

#[test]
fn without_the_option_a_dropped_tag_comes_back_zeroed() {
    let p = pager(false);
    p.region("w", 4 * MIB, Policy::Preserve).unwrap();
    let w = p.alloc("w", MIB).unwrap();
    p.write(&w, 0, &[1u8; MIB]).unwrap();
    p.release_with(
        &["w"],
        &ReleaseOptions {
            drop: vec!["w".into()],
        },
    )
    .unwrap();
    p.resume(&["w"]).unwrap();
    let mut back = vec![7u8; MIB];
    p.read(&w, 0, &mut back).unwrap();
    assert_eq!(back, vec![0u8; MIB]);
}
