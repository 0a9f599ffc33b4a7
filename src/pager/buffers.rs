//! Buffers: sub-allocation inside a region, lookup by device address, and access to their
//! contents through the pager (typed errors, never a fault, on a released region).

use super::*;

/// A buffer sub-allocated inside a region: a handle (tag, offset, length), not a pointer.
/// Get its device address with [`Pager::ptr`] while the region is resident.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Buffer {
    pub(super) tag: Arc<str>,
    pub(super) id: u64,
    pub(super) offset: usize,
    pub(super) len: usize,
}

impl Buffer {
    /// The region's tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }
    /// Offset from the region's base address.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer is empty (never: zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Pager {
    /// Allocates a buffer of `bytes` in region `tag`, aligned to [`DEFAULT_ALIGN`].
    pub fn alloc(&self, tag: &str, bytes: usize) -> Result<Buffer> {
        self.alloc_aligned(tag, bytes, DEFAULT_ALIGN)
    }

    /// Allocates a buffer of `bytes` in region `tag` at an offset that is a multiple of
    /// `align` (a power of two, at most the granularity: `InvalidArgument` otherwise, as a
    /// region's base is aligned to no more). Works whether the region is resident or released.
    pub fn alloc_aligned(&self, tag: &str, bytes: usize, align: usize) -> Result<Buffer> {
        let slot = self.slot(tag)?;
        let mut r = lock(&slot);
        let id = next_id();
        // A growing region maps each buffer by itself, so buffers own whole granules.
        let g = self.backend.info().granularity;
        // A region's base is aligned to the granularity and no more, so an offset cannot
        // give an address a larger alignment.
        if align > g {
            return Err(Error::InvalidArgument {
                tag: Some(tag.to_owned()),
                reason: format!(
                    "an alignment of {align} bytes is above the device's granularity ({g} \
                     bytes), the most a region's addresses are aligned to; ask for at most {g}"
                ),
            });
        }
        let (want, align) = if r.growing() && bytes > 0 {
            let Some(rounded) = bytes.checked_next_multiple_of(g) else {
                return Err(Error::InvalidSize {
                    tag: tag.to_owned(),
                    reason: format!("{bytes} bytes cannot be rounded to the {g}-byte granularity"),
                });
            };
            (rounded, align.max(g))
        } else {
            (bytes, align)
        };
        let offset = r.add_buffer(self.backend.as_ref(), bytes, want, align, id)?;
        Ok(Buffer {
            tag: Arc::from(tag),
            id,
            offset,
            len: bytes,
        })
    }

    /// The live buffer that starts exactly at device address `ptr`, in any region, resident
    /// or released; `None` when no live buffer starts there (an address inside a buffer, a
    /// freed buffer, memory of another pager). For callers that only keep the pointer, such
    /// as PyTorch's allocator hooks (`free(ptr, ..)`). O(log regions + log buffers).
    pub fn buffer_at(&self, ptr: u64) -> Option<Buffer> {
        self.buffer_containing(ptr)
            .filter(|(_, offset)| *offset == 0)
            .map(|(buf, _)| buf)
    }

    /// The live buffer whose bytes include device address `ptr`, and `ptr`'s offset in it
    /// (what [`Pager::write`] and [`Pager::read`] take). Same cost as [`Pager::buffer_at`].
    pub fn buffer_containing(&self, ptr: u64) -> Option<(Buffer, usize)> {
        if !self.in_own_process() {
            return None;
        }
        let (base, slot) = {
            let by_base = self.by_base.read().unwrap_or_else(|p| p.into_inner());
            let (&base, slot) = by_base.range(..=ptr).next_back()?;
            (base, slot.clone())
        };
        if let Some(found) = self.with_held(|r| r.base() == base, |r| buffer_in(r, ptr)) {
            return found;
        }
        buffer_in(&lock(&slot), ptr)
    }

    /// Frees a buffer. A second free of the same buffer returns `StaleBuffer`.
    ///
    /// In a growing region the free gives the buffer's memory back to the device at once:
    /// it waits for all outstanding device work (as a release does), then unmaps the buffer.
    pub fn free(&self, buf: &Buffer) -> Result<()> {
        let slot = self.slot_of(buf)?;
        let mut r = lock(&slot);
        r.remove_buffer(self.backend.as_ref(), buf.offset, buf.id)
    }

    /// Runs `f` on the locked region of `buf` after checking that the buffer is live, that
    /// `offset + len` fits in it, that the region is resident and, elastic, that the range
    /// is backed. `f` gets the device address of `buf + offset`; a zero `len` runs nothing.
    fn with_resident<T: Default>(
        &self,
        buf: &Buffer,
        offset: usize,
        len: usize,
        op: &'static str,
        f: impl FnOnce(&Region, u64) -> Result<T>,
    ) -> Result<T> {
        self.on_region(
            &buf.tag,
            || self.slot_of(buf),
            |a| {
                let range = usable_range(a.region(), buf, offset, len, op, a.moving())?;
                a.settle()?;
                if len == 0 {
                    return Ok(T::default());
                }
                f(a.region(), a.region().base() + range.start as u64)
            },
        )
    }

    /// The device address of a buffer. `NotResident` while its region is released;
    /// `NotBacked` when the region is elastic and the buffer not wholly backed. The address
    /// is stable across cycles, but see the type's docs on using it.
    pub fn ptr(&self, buf: &Buffer) -> Result<u64> {
        self.with_resident(buf, 0, buf.len, "a pointer lookup", |_, addr| Ok(addr))
    }

    /// The device address of a live buffer, resident or released (unlike [`Pager::ptr`],
    /// which needs the memory mapped): where it is and will be. `StaleBuffer` for a buffer
    /// freed, or of a region removed (even if a region of the same tag was made again: its
    /// addresses belong to that one).
    pub fn address(&self, buf: &Buffer) -> Result<u64> {
        self.on_region(
            &buf.tag,
            || self.slot_of(buf),
            |a| {
                let r = a.region();
                if !r.is_live(buf.offset, buf.id) {
                    return Err(stale(buf));
                }
                Ok(r.base() + buf.offset as u64)
            },
        )
    }

    /// Copies `data` from the host into `buf` at `offset` and waits for it.
    /// Zero bytes copy nothing, after the same checks.
    pub fn write(&self, buf: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.with_resident(buf, offset, data.len(), "a write", |r, addr| {
            // SAFETY: the range is inside a live buffer of a resident region (checked), and
            // the region's lock is held, so it is mapped for the whole copy.
            unsafe { self.backend.copy_to_device(addr, data) }
                .map_err(|e| Error::backend(&r.tag, "copying host data to the device", e))
        })
    }

    /// Copies `out.len()` bytes of `buf` at `offset` to the host and waits for it.
    /// Zero bytes copy nothing, after the same checks.
    pub fn read(&self, buf: &Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.with_resident(buf, offset, out.len(), "a read", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.copy_to_host(out, addr) }
                .map_err(|e| Error::backend(&r.tag, "copying device data to the host", e))
        })
    }

    /// Fills the whole buffer with the 32-bit `pattern` (0 zeroes) with the `fill` kernel.
    pub fn fill(&self, buf: &Buffer, pattern: u32) -> Result<()> {
        self.with_resident(buf, 0, buf.len, "the fill kernel", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.fill(addr, buf.len, pattern) }
                .map_err(|e| Error::backend(&r.tag, "the fill kernel", e))
        })
    }

    /// Hashes the buffer in chunks of `chunk_bytes` (a multiple of 16) with the `chunk_hash`
    /// kernel; see [`crate::kernels::reference::chunk_hash`] for the function.
    pub fn hash(&self, buf: &Buffer, chunk_bytes: usize) -> Result<Vec<u64>> {
        // The kernel's argument rules, checked here so that a bad chunk size is the caller's
        // InvalidArgument, not a backend failure. Regions and buffers are 256-aligned.
        crate::kernels::check_chunk_hash_args(0, buf.len, chunk_bytes).map_err(|reason| {
            Error::InvalidArgument {
                tag: Some(buf.tag().to_owned()),
                reason,
            }
        })?;
        self.with_resident(buf, 0, buf.len, "the chunk_hash kernel", |r, addr| {
            // SAFETY: as in `write`: mapped, live, locked.
            unsafe { self.backend.chunk_hash(addr, buf.len, chunk_bytes) }
                .map_err(|e| Error::backend(&r.tag, "the chunk_hash kernel", e))
        })
    }
}

/// The region's bytes `offset .. offset + len` of `buf`: [`Error::StaleBuffer`] unless `buf`
/// is live in `r`, [`Error::OutOfRange`] unless the range lies inside it.
pub(super) fn buffer_range(
    r: &Region,
    buf: &Buffer,
    offset: usize,
    len: usize,
) -> Result<Range<usize>> {
    if !r.is_live(buf.offset, buf.id) {
        return Err(stale(buf));
    }
    if offset.checked_add(len).is_none_or(|end| end > buf.len) {
        return Err(Error::OutOfRange {
            tag: buf.tag.to_string(),
            what: "buffer",
            offset,
            len,
            size: buf.len,
        });
    }
    let start = buf.offset + offset;
    Ok(start..start + len)
}

pub(super) fn stale(buf: &Buffer) -> Error {
    Error::StaleBuffer {
        tag: buf.tag.to_string(),
        id: buf.id,
        offset: buf.offset,
    }
}

/// The bytes `buf + offset .. + len` of region `r` that an access (`op`) may touch: the
/// buffer live, the range inside it, and the memory there: the region resident and, mapped
/// on demand, the range backed; or, while the region moves (`moving`: its companions run,
/// its state not yet flipped), the range mapped.
fn usable_range(
    r: &Region,
    buf: &Buffer,
    offset: usize,
    len: usize,
    op: &'static str,
    moving: bool,
) -> Result<Range<usize>> {
    let range = buffer_range(r, buf, offset, len)?;
    let backed = r.is_backed(&range);
    if !(moving && backed) {
        r.require_resident(op)?;
        if (moving || r.on_demand()) && !backed {
            return Err(Error::NotBacked {
                tag: buf.tag.to_string(),
                offset: range.start,
                len,
            });
        }
    }
    Ok(range)
}

/// The live buffer of region `r` whose bytes include device address `ptr`, and `ptr`'s
/// offset in it.
fn buffer_in(r: &Region, ptr: u64) -> Option<(Buffer, usize)> {
    let offset = usize::try_from(ptr.checked_sub(r.base())?).ok()?;
    if offset >= r.size() {
        return None;
    }
    // A growing region rounds its buffers up to the granularity: the rest is padding.
    let (start, id, len) = r.buffer_at(offset)?;
    Some((
        Buffer {
            tag: Arc::from(r.tag.as_str()),
            id,
            offset: start,
            len,
        },
        offset - start,
    ))
}
