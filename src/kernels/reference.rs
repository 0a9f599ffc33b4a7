//! Plain Rust reference implementations of the kernels, bit-exact with them.
//!
//! The host backend runs these on (possibly multi-GiB) host memory, and the GPU tests
//! compare the kernels' output against them.

use super::abi::{GP_HASH_K1, GP_HASH_K2};

/// MurmurHash3's 64-bit finaliser (all arithmetic wrapping):
/// `k ^= k >> 33; k *= 0xff51afd7ed558ccd; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53; k ^= k >> 33`.
#[inline]
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// What `gp_fill` does: byte `j` of `buf` becomes byte `j % 4` of `pattern` in
/// little-endian order (pattern 0 zeroes).
pub fn fill(buf: &mut [u8], pattern: u32) {
    let p = pattern.to_le_bytes();
    // Whole 16-byte blocks start at multiples of 4, so each is the pattern four times.
    let block: [u8; 16] = std::array::from_fn(|j| p[j % 4]);
    let (blocks, rest) = buf.as_chunks_mut::<16>();
    blocks.fill(block);
    for (j, b) in rest.iter_mut().enumerate() {
        *b = p[j % 4];
    }
}

/// What `gp_copy` does: `dst` becomes `src`, byte for byte, whatever the alignment of
/// either (the kernel picks its word width from their relative alignment; the bytes are the
/// same). The kernel's ranges must not overlap, which two Rust slices here cannot.
///
/// # Panics
/// If the lengths differ.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// What `gp_chunk_hash_partial` + `gp_chunk_hash_finalize` compute: one hash per chunk of
/// `chunk_bytes` bytes of `data` (the last chunk may be shorter; empty `data` has no
/// chunks).
///
/// For a chunk of `len` bytes read as little-endian `u64` words `w_0 .. w_{n-1}`
/// (`n = ceil(len / 8)`, the last word zero-padded), with wrapping arithmetic:
///
/// ```text
/// sum  = Σ_i fmix64(w_i ^ (i * GP_HASH_K1))
/// hash = fmix64(sum ^ (len * GP_HASH_K2))
/// ```
///
/// (`GP_HASH_K1`, `GP_HASH_K2` come from `kernels/abi.h`.) The word index makes the hash
/// depend on where each word sits; the length term separates chunks that differ only by
/// trailing zero bytes.
///
/// # Panics
/// If `chunk_bytes` is 0.
pub fn chunk_hash(data: &[u8], chunk_bytes: usize) -> Vec<u64> {
    assert!(chunk_bytes > 0, "chunk_hash needs chunk_bytes > 0");
    data.chunks(chunk_bytes).map(hash_one_chunk).collect()
}

/// The hash of one chunk (see [`chunk_hash`]).
fn hash_one_chunk(chunk: &[u8]) -> u64 {
    // Whole words as arrays: no per-word slice split and no conversion that could fail
    // (the split's checks cost more than the hash in builds without full optimisation).
    let (words, tail) = chunk.as_chunks::<8>();
    let mut sum = 0u64;
    // i * K1 for word i, advanced by addition.
    let mut ik = 0u64;
    for &w in words {
        sum = sum.wrapping_add(fmix64(u64::from_le_bytes(w) ^ ik));
        ik = ik.wrapping_add(GP_HASH_K1);
    }
    if !tail.is_empty() {
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(fmix64(u64::from_le_bytes(last) ^ ik));
    }
    fmix64(sum ^ (chunk.len() as u64).wrapping_mul(GP_HASH_K2))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: deterministic test data without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            fmix64(self.0)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// The definition, written as literally as possible (byte by byte), to check the fast
    /// version against.
    fn naive_chunk_hash(data: &[u8], chunk_bytes: usize) -> Vec<u64> {
        let mut out = Vec::new();
        let mut start = 0;
        while start < data.len() {
            let len = chunk_bytes.min(data.len() - start);
            let chunk = &data[start..start + len];
            let n = len.div_ceil(8);
            let mut sum = 0u64;
            for i in 0..n {
                let mut w = 0u64;
                for b in 0..8 {
                    let byte = chunk.get(8 * i + b).copied().unwrap_or(0);
                    w |= u64::from(byte) << (8 * b);
                }
                sum = sum.wrapping_add(fmix64(w ^ (i as u64).wrapping_mul(GP_HASH_K1)));
            }
            out.push(fmix64(sum ^ (len as u64).wrapping_mul(GP_HASH_K2)));
            start += len;
        }
        out
    }

    #[test]
    fn fmix64_known_values() {
        assert_eq!(fmix64(0), 0);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
        assert_eq!(fmix64(GP_HASH_K1), 0x9ca0_66f1_a4ab_2eea);
    }

    #[test]
    fn fill_follows_the_byte_position_rule() {
        let pattern = 0xA1B2_C3D4u32;
        let p = pattern.to_le_bytes();
        let mut rng = Rng(1);
        let mut backing = vec![0x5Au8; 4096];
        for len in (0..80).chain([255, 1000, 4000]) {
            for offset in [0, 1, 2, 3, 5, 7, 13, 15, 16, 17] {
                if offset + len > backing.len() {
                    continue;
                }
                let poison = rng.next() as u8;
                backing.fill(poison);
                fill(&mut backing[offset..offset + len], pattern);
                for (j, &b) in backing[offset..offset + len].iter().enumerate() {
                    assert_eq!(b, p[j % 4], "offset {offset} len {len} byte {j}");
                }
                assert!(backing[..offset].iter().all(|&b| b == poison));
                assert!(backing[offset + len..].iter().all(|&b| b == poison));
            }
        }
    }

    #[test]
    fn fill_zero_pattern_zeroes() {
        let mut buf = [0xFFu8; 103];
        fill(&mut buf[3..], 0);
        assert_eq!(&buf[..3], &[0xFF; 3]);
        assert!(buf[3..].iter().all(|&b| b == 0));
    }

    #[test]
    fn chunk_hash_known_values() {
        // Computed independently (from the definition in kernels/abi.h, in Python).
        let data: Vec<u8> = (0..100u32).map(|i| (i * 31 + 7) as u8).collect();
        assert_eq!(
            chunk_hash(&data, 32),
            [
                0xceb4_ddff_4571_5c68,
                0xf53d_2676_67b2_9198,
                0xb83d_1a1d_54db_5737,
                0x924d_66ae_2400_a22d
            ]
        );
        assert_eq!(chunk_hash(&[0; 16], 16), [0x84ef_d21a_b93d_7ef1]);
        assert_eq!(chunk_hash(&[0; 17], 32), [0x84b7_d3bb_cfa5_eee6]);
        assert!(chunk_hash(&[], 16).is_empty());
    }

    #[test]
    fn chunk_hash_matches_the_definition_on_odd_shapes() {
        let mut rng = Rng(2);
        for len in [1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 255, 256, 257, 1000] {
            let data = rng.bytes(len);
            for chunk_bytes in [1, 3, 8, 16, 32, 48, 64, 1024] {
                assert_eq!(
                    chunk_hash(&data, chunk_bytes),
                    naive_chunk_hash(&data, chunk_bytes),
                    "len {len} chunk {chunk_bytes}"
                );
            }
        }
    }

    #[test]
    fn last_chunk_is_short_and_chunk_size_need_not_divide() {
        let mut rng = Rng(3);
        let data = rng.bytes(1000);
        let hashes = chunk_hash(&data, 64);
        assert_eq!(hashes.len(), 16); // 15 full chunks + 40 bytes
        // Each chunk hashes on its own: the last equals the hash of its 40 bytes alone.
        assert_eq!(hashes[15], chunk_hash(&data[960..], 64)[0]);
        assert_eq!(hashes[15], chunk_hash(&data[960..], 40)[0]);
        assert_eq!(hashes[3], chunk_hash(&data[192..256], 64)[0]);
        // A chunk size larger than the data gives one chunk.
        assert_eq!(chunk_hash(&data, 4096), chunk_hash(&data, 1000));
    }

    #[test]
    fn any_single_byte_change_changes_its_chunk_only() {
        let mut rng = Rng(4);
        let chunk_bytes = 256;
        let mut data = rng.bytes(4096 + 80);
        let before = chunk_hash(&data, chunk_bytes);
        for _ in 0..500 {
            let pos = rng.below(data.len());
            let flip = 1u8 << rng.below(8);
            data[pos] ^= flip;
            let after = chunk_hash(&data, chunk_bytes);
            for (c, (a, b)) in after.iter().zip(&before).enumerate() {
                if c == pos / chunk_bytes {
                    assert_ne!(a, b, "byte {pos} bit {flip:#x} did not change chunk {c}");
                } else {
                    assert_eq!(a, b, "byte {pos} changed chunk {c}");
                }
            }
            data[pos] ^= flip;
        }
        assert_eq!(chunk_hash(&data, chunk_bytes), before);
    }

    #[test]
    fn swapping_words_changes_the_hash() {
        let mut data: Vec<u8> = (0..64u8).collect();
        let before = chunk_hash(&data, 64);
        let (a, b) = data.split_at_mut(8);
        a.swap_with_slice(&mut b[..8]);
        assert_ne!(chunk_hash(&data, 64), before);
    }

    #[test]
    fn length_is_part_of_the_hash() {
        // Trailing zeros give the same words (zero padding) but a different length.
        let mut data = vec![0u8; 64];
        data[..5].copy_from_slice(b"hello");
        let h5 = chunk_hash(&data[..5], 64)[0];
        let h8 = chunk_hash(&data[..8], 64)[0];
        let h16 = chunk_hash(&data[..16], 64)[0];
        let h64 = chunk_hash(&data, 64)[0];
        assert_ne!(h5, h8);
        assert_ne!(h8, h16);
        assert_ne!(h16, h64);
        // All-zero chunks of different lengths differ too.
        let zeros = [0u8; 64];
        let hashes: Vec<u64> = (1..=64).map(|n| chunk_hash(&zeros[..n], 64)[0]).collect();
        for (i, a) in hashes.iter().enumerate() {
            assert!(hashes[i + 1..].iter().all(|b| a != b));
        }
    }

    #[test]
    fn deterministic() {
        let data = Rng(5).bytes(10_000);
        assert_eq!(chunk_hash(&data, 1024), chunk_hash(&data.clone(), 1024));
        assert_eq!(
            chunk_hash(&data, 1024),
            Rng(5)
                .bytes(10_000)
                .chunks(1024)
                .flat_map(|c| chunk_hash(c, 1024))
                .collect::<Vec<_>>()
        );
    }
}
