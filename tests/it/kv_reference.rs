//! The plain-Rust references of the KV kernels (`gpu_pager::kv::reference`) over many layouts
//! on fresh pseudo-random data with the outputs poisoned first, and every error path (which
//! must write nothing).

use gpu_pager::kv::reference::{
    blocks_in, copy_blocks, gather, swap_in, swap_out, token_bytes, write,
};
use gpu_pager::kv::{Kv, KvDtype, KvError, KvLayout, KvOrder};

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

const POISON: u8 = 0xA5;

fn poisoned(n: usize) -> Vec<u8> {
    vec![POISON; n]
}

/// {NHD, HND} × {bf16, f16, f32} × head_dim {64, 80, 96, 128, 3} × block_size {16, 32}, with
/// 1–3 layers and 1–3 heads varying across them (small enough to run in milliseconds).
fn layouts() -> Vec<KvLayout> {
    let mut v = Vec::new();
    for order in [KvOrder::Nhd, KvOrder::Hnd] {
        for dtype in [KvDtype::Bf16, KvDtype::F16, KvDtype::F32] {
            for head_dim in [64, 80, 96, 128, 3] {
                for block_size in [16, 32] {
                    let i = v.len() as u32;
                    let layers = 1 + i % 3;
                    let heads = 1 + (i / 3) % 3;
                    v.push(
                        KvLayout::new(layers, heads, head_dim, block_size, dtype, order).unwrap(),
                    );
                }
            }
        }
    }
    v
}

fn usz(x: u64) -> usize {
    usize::try_from(x).unwrap()
}

fn block<'a>(cache: &'a [u8], l: &KvLayout, b: u32) -> &'a [u8] {
    let bpb = usz(l.bytes_per_block());
    &cache[b as usize * bpb..][..bpb]
}

#[test]
fn write_then_gather_returns_what_was_written() {
    for (i, l) in layouts().iter().enumerate() {
        let mut rng = Rng(0x5EED_0000 + i as u64);
        let cap = 6u32;
        let bs = l.block_size() as usize;
        let row = usz(l.row_bytes());
        let heads = l.kv_heads() as usize;
        let tb = usz(token_bytes(l));
        assert_eq!(tb, heads * row);
        let elem = usz(l.dtype().size());
        // one trailing partial block's worth of bytes that must never be touched
        let mut cache = poisoned(usz(l.total_bytes(cap).unwrap()) + row + 1);
        assert_eq!(blocks_in(l, cache.len()), cap);
        let mut expected = cache.clone();

        // A sequence of n tokens through a random block table, written in shuffled order with
        // padding entries mixed in.
        let n = 2 * bs + 1 + rng.below(3 * bs);
        let mut perm: Vec<u32> = (0..cap).collect();
        rng.shuffle(&mut perm);
        let used = n.div_ceil(bs);
        let mut table = perm[..used].to_vec();
        table.push(u32::MAX); // a padded table: entries past the used ones are not read
        let mut entries: Vec<Option<usize>> = (0..n).map(Some).collect();
        entries.extend(std::iter::repeat_n(None, n / 4 + 1));
        rng.shuffle(&mut entries);
        let tokens = entries.len();
        let slots: Vec<i64> = entries
            .iter()
            .map(|e| match e {
                Some(p) => i64::from(table[p / bs]) * bs as i64 + (p % bs) as i64,
                None if rng.below(4) == 0 => i64::MIN,
                None => -1 - rng.below(5) as i64,
            })
            .collect();

        let mut want = vec![(Vec::new(), Vec::new()); l.layers() as usize];
        for layer in 0..l.layers() {
            let stride = tb + elem * rng.below(3);
            let len = (tokens - 1) * stride + tb;
            let extra = rng.below(5);
            let keys = rng.bytes(len + extra);
            let values = rng.bytes(len);
            write(&mut cache, l, layer, &keys, &values, tokens, stride, &slots).unwrap();

            let (wk, wv) = &mut want[layer as usize];
            *wk = poisoned(n * tb);
            *wv = poisoned(n * tb);
            for (t, e) in entries.iter().enumerate() {
                let Some(p) = *e else { continue };
                let (b, tok) = (table[p / bs], (p % bs) as u32);
                for h in 0..heads {
                    let src = t * stride + h * row;
                    let dst = p * tb + h * row;
                    wk[dst..dst + row].copy_from_slice(&keys[src..src + row]);
                    wv[dst..dst + row].copy_from_slice(&values[src..src + row]);
                    for (kv, data) in [(Kv::K, &keys), (Kv::V, &values)] {
                        let off = usz(l.offset(layer, kv, b, tok, h as u32).unwrap());
                        expected[off..off + row].copy_from_slice(&data[src..src + row]);
                    }
                }
            }
        }
        // exactly the written rows changed: padding and unused slots are still poison
        assert!(cache == expected, "layout {l:?}");

        for layer in 0..l.layers() {
            for kv in [Kv::K, Kv::V] {
                let mut out = poisoned(n * tb + 7);
                gather(&cache, l, layer, kv, &table, n, &mut out).unwrap();
                let (wk, wv) = &want[layer as usize];
                let w = if kv == Kv::K { wk } else { wv };
                assert!(out[..n * tb] == w[..], "layout {l:?} layer {layer} {kv:?}");
                assert!(out[n * tb..].iter().all(|&b| b == POISON));
                // a prefix of the sequence reads the same prefix
                let k = 1 + rng.below(n);
                let mut part = poisoned(k * tb);
                gather(&cache, l, layer, kv, &table[..k.div_ceil(bs)], k, &mut part).unwrap();
                assert!(part == w[..k * tb]);
            }
        }
    }
}

#[test]
fn padding_slots_leave_the_cache_untouched() {
    for (i, l) in layouts().iter().enumerate() {
        let mut rng = Rng(0xBAD0 + i as u64);
        let mut cache = rng.bytes(usz(l.total_bytes(3).unwrap()));
        let orig = cache.clone();
        let tb = usz(token_bytes(l));
        let tokens = 1 + rng.below(40);
        let slots: Vec<i64> = (0..tokens)
            .map(|t| match t % 3 {
                0 => -1,
                1 => i64::MIN,
                _ => -((rng.next() >> 1) as i64) - 1,
            })
            .collect();
        let keys = rng.bytes(tokens * tb);
        let values = rng.bytes(tokens * tb);
        for layer in 0..l.layers() {
            write(&mut cache, l, layer, &keys, &values, tokens, tb, &slots).unwrap();
        }
        assert!(cache == orig, "layout {l:?}");
        // zero tokens: nothing read, nothing written
        write(&mut cache, l, 0, &[], &[], 0, tb, &[]).unwrap();
        assert!(cache == orig);
    }
}

#[test]
fn copy_blocks_then_gather_equals_the_source() {
    for (i, l) in layouts().iter().enumerate() {
        let mut rng = Rng(0xC0B1 + i as u64);
        let cap = 8u32;
        let bs = l.block_size() as usize;
        let tb = usz(token_bytes(l));
        let mut cache = rng.bytes(usz(l.total_bytes(cap).unwrap()));
        let orig = cache.clone();

        // sources from the first three of a permutation (repeats allowed), distinct
        // destinations from the rest
        let mut perm: Vec<u32> = (0..cap).collect();
        rng.shuffle(&mut perm);
        let m = 1 + rng.below(5);
        let pairs: Vec<(u32, u32)> = perm[3..3 + m]
            .iter()
            .map(|&dst| (perm[rng.below(3)], dst))
            .collect();
        copy_blocks(&mut cache, l, &pairs).unwrap();

        let mut expected = orig.clone();
        let bpb = usz(l.bytes_per_block());
        for &(s, d) in &pairs {
            expected[d as usize * bpb..][..bpb].copy_from_slice(block(&orig, l, s));
        }
        assert!(cache == expected, "layout {l:?} pairs {pairs:?}");

        let srcs: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        let dsts: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let n = m * bs;
        for layer in 0..l.layers() {
            for kv in [Kv::K, Kv::V] {
                let mut a = poisoned(n * tb);
                let mut b = poisoned(n * tb);
                gather(&cache, l, layer, kv, &dsts, n, &mut a).unwrap();
                gather(&orig, l, layer, kv, &srcs, n, &mut b).unwrap();
                assert!(a == b, "layout {l:?} layer {layer} {kv:?}");
            }
        }
        copy_blocks(&mut cache, l, &[]).unwrap();
        assert!(cache == expected);
    }
}

#[test]
fn swap_out_then_swap_in_restores_blocks() {
    for (i, l) in layouts().iter().enumerate() {
        let mut rng = Rng(0x5A4B + i as u64);
        let cap = 8u32;
        let bpb = usz(l.bytes_per_block());
        let cache = rng.bytes(usz(l.total_bytes(cap).unwrap()));
        let mut perm: Vec<u32> = (0..cap).collect();
        rng.shuffle(&mut perm);
        let blocks = &perm[..1 + rng.below(5)];

        let mut host = poisoned(blocks.len() * bpb + 13);
        swap_out(&cache, l, blocks, &mut host).unwrap();
        for (j, &b) in blocks.iter().enumerate() {
            assert!(
                host[j * bpb..][..bpb] == *block(&cache, l, b),
                "layout {l:?}"
            );
        }
        assert!(host[blocks.len() * bpb..].iter().all(|&b| b == POISON));

        let mut back = poisoned(cache.len());
        swap_in(&mut back, l, blocks, &host).unwrap();
        for b in 0..cap {
            if blocks.contains(&b) {
                assert!(
                    block(&back, l, b) == block(&cache, l, b),
                    "layout {l:?} block {b}"
                );
            } else {
                assert!(block(&back, l, b).iter().all(|&x| x == POISON), "block {b}");
            }
        }

        // swap_out may list a block twice
        let dup = [blocks[0], blocks[0]];
        let mut host2 = poisoned(2 * bpb);
        swap_out(&cache, l, &dup, &mut host2).unwrap();
        assert!(host2[..bpb] == host2[bpb..] && host2[..bpb] == *block(&cache, l, blocks[0]));
    }
}

fn oor(what: &'static str, index: u64, limit: u64) -> KvError {
    KvError::OutOfRange { what, index, limit }
}

fn short(what: &'static str, needed: u64, len: u64) -> KvError {
    KvError::BufferTooSmall { what, needed, len }
}

#[track_caller]
fn invalid<T: std::fmt::Debug>(r: Result<T, KvError>, needle: &str) {
    match r {
        Err(KvError::InvalidArgument { reason }) => assert!(reason.contains(needle), "{reason}"),
        other => panic!("expected InvalidArgument ({needle}), got {other:?}"),
    }
}

fn error_layouts() -> Vec<KvLayout> {
    vec![
        KvLayout::new(2, 3, 3, 4, KvDtype::Bf16, KvOrder::Nhd).unwrap(),
        KvLayout::new(3, 2, 8, 16, KvDtype::F32, KvOrder::Hnd).unwrap(),
    ]
}

#[test]
fn write_errors_write_nothing() {
    for l in error_layouts() {
        let mut rng = Rng(1);
        let cap = 3u32;
        let bs = u64::from(l.block_size());
        let mut cache = rng.bytes(usz(l.total_bytes(cap).unwrap()));
        let orig = cache.clone();
        let tb = usz(token_bytes(&l));
        let elem = usz(l.dtype().size());
        let stride = tb + elem;
        let tokens = 3;
        let len = (tokens - 1) * stride + tb;
        let keys = rng.bytes(len);
        let values = rng.bytes(len);
        let slots = [0i64, 1, -1];
        let layers = l.layers();

        assert_eq!(
            write(
                &mut cache, &l, layers, &keys, &values, tokens, stride, &slots
            ),
            Err(oor("layer", layers.into(), layers.into()))
        );
        invalid(
            write(&mut cache, &l, 0, &keys, &values, tokens, tb - elem, &slots),
            "smaller than one token",
        );
        invalid(
            write(&mut cache, &l, 0, &keys, &values, tokens, tb + 1, &slots),
            "multiple of the element size",
        );
        assert_eq!(
            write(
                &mut cache,
                &l,
                0,
                &keys,
                &values,
                tokens,
                stride,
                &slots[..2]
            ),
            Err(oor("token of slot_mapping", 2, 2))
        );
        assert_eq!(
            write(
                &mut cache,
                &l,
                0,
                &keys[..len - 1],
                &values,
                tokens,
                stride,
                &slots
            ),
            Err(short("keys", len as u64, len as u64 - 1))
        );
        assert_eq!(
            write(
                &mut cache,
                &l,
                0,
                &keys,
                &values[..len - 1],
                tokens,
                stride,
                &slots
            ),
            Err(short("values", len as u64, len as u64 - 1))
        );
        let limit = u64::from(cap) * bs;
        for bad in [limit, limit + 1, i64::MAX as u64] {
            // the valid slots before the bad one must not be written either
            assert_eq!(
                write(
                    &mut cache,
                    &l,
                    0,
                    &keys,
                    &values,
                    tokens,
                    stride,
                    &[0, 1, bad as i64]
                ),
                Err(oor("slot", bad, limit))
            );
        }
        assert!(cache == orig, "{l:?}");

        // a cache smaller than one block has no slot at all
        let short = usz(l.bytes_per_block()) - 1;
        let mut small = orig[..short].to_vec();
        assert_eq!(
            write(&mut small, &l, 0, &keys, &values, 1, stride, &[0]),
            Err(oor("slot", 0, 0))
        );
        assert!(small == orig[..short]);
        // ... but all-padding input is fine
        write(&mut small, &l, 0, &keys, &values, 1, stride, &[-1]).unwrap();
        assert!(small == orig[..short]);
    }
}

#[test]
fn copy_blocks_errors_write_nothing() {
    for l in error_layouts() {
        let mut cache = Rng(2).bytes(usz(l.total_bytes(5).unwrap()));
        let orig = cache.clone();
        assert_eq!(
            copy_blocks(&mut cache, &l, &[(0, 1), (5, 2)]),
            Err(oor("source block", 5, 5))
        );
        assert_eq!(
            copy_blocks(&mut cache, &l, &[(0, 1), (2, u32::MAX)]),
            Err(oor("destination block", u64::from(u32::MAX), 5))
        );
        invalid(copy_blocks(&mut cache, &l, &[(3, 3)]), "also a source");
        invalid(
            copy_blocks(&mut cache, &l, &[(0, 1), (1, 2)]),
            "also a source",
        );
        invalid(
            copy_blocks(&mut cache, &l, &[(1, 2), (0, 1)]),
            "also a source",
        );
        invalid(
            copy_blocks(&mut cache, &l, &[(0, 2), (1, 3), (4, 2)]),
            "earlier pair",
        );
        assert!(cache == orig, "{l:?}");
    }
}

#[test]
fn gather_errors_write_nothing() {
    for l in error_layouts() {
        let cache = Rng(3).bytes(usz(l.total_bytes(4).unwrap()));
        let bs = u64::from(l.block_size());
        let tb = usz(token_bytes(&l));
        let n = bs as usize + 1;
        let mut out = poisoned(n * tb);
        let layers = l.layers();
        assert_eq!(
            gather(&cache, &l, layers, Kv::V, &[0, 1], n, &mut out),
            Err(oor("layer", layers.into(), layers.into()))
        );
        assert_eq!(
            gather(&cache, &l, 0, Kv::K, &[0], n, &mut out),
            Err(oor("token of the block table", n as u64 - 1, bs))
        );
        assert_eq!(
            gather(&cache, &l, 0, Kv::K, &[0, 4], n, &mut out),
            Err(oor("block of the block table", 4, 4))
        );
        assert_eq!(
            gather(&cache, &l, 0, Kv::V, &[0, 1], n, &mut out[..n * tb - 1]),
            Err(short("output", (n * tb) as u64, (n * tb - 1) as u64))
        );
        assert!(out.iter().all(|&b| b == POISON), "{l:?}");
        // zero tokens need no table and no output
        gather(&cache, &l, 0, Kv::K, &[], 0, &mut []).unwrap();
    }
}

#[test]
fn swap_errors_write_nothing() {
    for l in error_layouts() {
        let mut rng = Rng(4);
        let bpb = usz(l.bytes_per_block());
        let mut cache = rng.bytes(usz(l.total_bytes(4).unwrap()));
        let orig = cache.clone();
        let mut host = poisoned(2 * bpb);

        assert_eq!(
            swap_out(&cache, &l, &[1, 4], &mut host),
            Err(oor("block", 4, 4))
        );
        assert_eq!(
            swap_out(&cache, &l, &[1, 2, 3], &mut host),
            Err(short("host", 3 * bpb as u64, 2 * bpb as u64))
        );
        assert!(host.iter().all(|&b| b == POISON), "{l:?}");

        let src = rng.bytes(2 * bpb);
        assert_eq!(
            swap_in(&mut cache, &l, &[1, 4], &src),
            Err(oor("block", 4, 4))
        );
        assert_eq!(
            swap_in(&mut cache, &l, &[0, 1], &src[..2 * bpb - 1]),
            Err(short("host", 2 * bpb as u64, 2 * bpb as u64 - 1))
        );
        invalid(swap_in(&mut cache, &l, &[2, 2], &src), "listed twice");
        assert!(cache == orig, "{l:?}");

        swap_in(&mut cache, &l, &[], &[]).unwrap();
        swap_out(&cache, &l, &[], &mut []).unwrap();
        assert!(cache == orig);
    }
}
