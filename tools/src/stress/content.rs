//! What a buffer should hold, and the host-side reference to check it against.
//!
//! Contents are never kept as bytes (buffers are GiB-scale on a GPU): a buffer written by
//! the fill kernel is described by its pattern, one written from the host by the seed of
//! its random bytes; both carry the reference chunk hashes computed on the host with
//! [`gpu_pager::kernels::reference`], which the device's `chunk_hash` must reproduce.

use std::collections::HashMap;

use gpu_pager::kernels::reference;

/// splitmix64: a small seeded generator, good enough for test data and choices.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function.
pub(crate) fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(mix(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`; 0 when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        self.below(1000) < per_mille as usize
    }

    /// A length in `1..=max`, biased towards small and odd sizes: a quarter below 4 KiB.
    pub fn len(&mut self, max: usize) -> usize {
        let max = max.max(1);
        if self.below(4) == 0 {
            1 + self.below(max.min(4096))
        } else {
            1 + self.below(max)
        }
    }

    /// A non-empty random subset of `0..n` (`n` ≤ 64), in increasing order.
    pub fn subset(&mut self, n: usize) -> Vec<usize> {
        let mask = loop {
            let m = self.next_u64() & ((1u64 << n) - 1);
            if m != 0 {
                break m;
            }
        };
        (0..n).filter(|i| mask >> i & 1 == 1).collect()
    }
}

/// Byte `offset + j` of a buffer filled with `pattern`, for `j` in `0..len`.
pub(crate) fn fill_window(pattern: u32, offset: usize, len: usize) -> Vec<u8> {
    let p = pattern.to_le_bytes();
    (offset..offset + len).map(|j| p[j % 4]).collect()
}

/// Bytes `offset .. offset + len` of the random contents of `seed` (word `i` is
/// `mix(seed + i * GOLDEN)`, little-endian), so any window is cheap to regenerate.
pub(crate) fn random_window(seed: u64, offset: usize, len: usize) -> Vec<u8> {
    let word = |i: usize| mix(seed.wrapping_add((i as u64).wrapping_mul(GOLDEN))).to_le_bytes();
    let (first, last) = (offset / 8, (offset + len).div_ceil(8));
    let mut out = Vec::with_capacity((last - first) * 8);
    for i in first..last {
        out.extend_from_slice(&word(i));
    }
    let skip = offset - first * 8;
    out.drain(..skip);
    out.truncate(len);
    out
}

/// What a buffer holds, as far as its owner knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Content {
    /// Not written since it was allocated: nothing to check.
    Unknown,
    /// Filled with `pattern` (0: zeroes) by the fill kernel.
    Fill {
        /// The 32-bit pattern.
        pattern: u32,
        /// Reference chunk hashes.
        hashes: Vec<u64>,
    },
    /// Written from the host with [`random_window`]`(seed, 0, len)`.
    Bytes {
        /// The seed of the bytes.
        seed: u64,
        /// Reference chunk hashes.
        hashes: Vec<u64>,
    },
}

impl Content {
    /// The reference hashes, if the contents are known.
    pub fn hashes(&self) -> Option<&[u64]> {
        match self {
            Content::Unknown => None,
            Content::Fill { hashes, .. } | Content::Bytes { hashes, .. } => Some(hashes),
        }
    }

    /// Bytes `offset .. offset + len` as they should be, if known.
    pub fn window(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        match self {
            Content::Unknown => None,
            Content::Fill { pattern, .. } => Some(fill_window(*pattern, offset, len)),
            Content::Bytes { seed, .. } => Some(random_window(*seed, offset, len)),
        }
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        match self {
            Content::Unknown => "unwritten".to_owned(),
            Content::Fill { pattern, .. } => format!("filled with {pattern:#010x}"),
            Content::Bytes { seed, .. } => format!("host bytes of seed {seed:#x}"),
        }
    }
}

/// Reference chunk hashes of filled buffers, memoised per (pattern, chunk length): every
/// full chunk of a filled buffer starts at a multiple of 16 bytes, so all full chunks hash
/// alike, and only the first full chunk and the tail need hashing.
#[derive(Debug, Default)]
pub(crate) struct FillHashes {
    memo: HashMap<(u32, usize), u64>,
}

impl FillHashes {
    fn one(&mut self, pattern: u32, len: usize) -> u64 {
        if let Some(&h) = self.memo.get(&(pattern, len)) {
            return h;
        }
        let mut buf = vec![0u8; len];
        reference::fill(&mut buf, pattern);
        let h = reference::chunk_hash(&buf, len.max(1))
            .first()
            .copied()
            .unwrap_or(0);
        if self.memo.len() >= 256 {
            self.memo.clear();
        }
        self.memo.insert((pattern, len), h);
        h
    }

    /// The chunk hashes (chunks of `chunk` bytes, a multiple of 16) of `len` bytes filled
    /// with `pattern`.
    pub fn hashes(&mut self, pattern: u32, len: usize, chunk: usize) -> Vec<u64> {
        let mut out = vec![];
        if len >= chunk {
            out = vec![self.one(pattern, chunk); len / chunk];
        }
        if !len.is_multiple_of(chunk) {
            out.push(self.one(pattern, len % chunk));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_hashes_match_the_reference_on_whole_buffers() {
        let mut memo = FillHashes::default();
        for len in [1, 15, 16, 17, 1000, 4096, 4097, 65_536, 100_003] {
            for pattern in [0, 1, 0xDEAD_BEEF] {
                let mut buf = vec![0u8; len];
                reference::fill(&mut buf, pattern);
                for chunk in [16, 1024, 65_536] {
                    assert_eq!(
                        memo.hashes(pattern, len, chunk),
                        reference::chunk_hash(&buf, chunk),
                        "len {len} pattern {pattern:#x} chunk {chunk}"
                    );
                }
                assert_eq!(fill_window(pattern, 0, len), buf);
                if len > 3 {
                    assert_eq!(fill_window(pattern, 3, len - 3), buf[3..]);
                }
            }
        }
    }

    #[test]
    fn random_windows_agree() {
        let all = random_window(42, 0, 1000);
        assert_eq!(random_window(42, 13, 500), all[13..513]);
        assert_ne!(random_window(43, 0, 1000), all);
        let c = Content::Bytes {
            seed: 42,
            hashes: vec![],
        };
        assert_eq!(c.window(8, 8).as_deref(), Some(&all[8..16]));
    }

    #[test]
    fn subsets_are_non_empty_and_sorted() {
        let mut r = Rng::new(1);
        for _ in 0..100 {
            let s = r.subset(4);
            assert!(!s.is_empty() && s.windows(2).all(|w| w[0] < w[1]) && s[s.len() - 1] < 4);
        }
        assert!((0..1000).map(|_| r.len(10)).all(|l| (1..=10).contains(&l)));
    }
}
