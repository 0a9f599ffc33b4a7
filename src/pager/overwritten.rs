//! Update-aware release: bytes marked "overwritten by the next update" are neither backed
//! up on release nor restored on resume.

use std::ops::Range;

use super::{Buffer, Pager, lock, stale};
use crate::error::{Error, Result};

impl Pager {
    /// Marks (`on`) or unmarks bytes `range` of `buf` (offsets from the buffer's start) as
    /// **overwritten by the next update**: the engine promises to write every marked byte
    /// after the next resume before reading it, as a weight update does to the parameters.
    ///
    /// The contract, for a `Preserve` region:
    /// - A release neither hashes nor copies to the backup the bytes marked at that moment;
    ///   the resume after it restores exactly what that release saved. Marked bytes come
    ///   back mapped at the same addresses and writable, with **undefined contents**: they
    ///   may hold their old values or anything else. Unmarked bytes, in this buffer or any
    ///   other, come back bit-exact as always.
    /// - A release may copy marked bytes anyway where that is cheaper: a run of marked
    ///   bytes (or free space) shorter than [`super::Tuning::copy_gap_bytes`] (1 MiB
    ///   by default) between two spans it saves is copied with them, and then restored too.
    ///   Marked bytes at a buffer's edges next to a long gap, and long marked runs, are never
    ///   copied; with every byte of a region marked, release and resume only unmap and map.
    /// - Marks are kept across cycles until cleared (`on == false`) or the buffer is freed; a
    ///   new buffer, even at the same offset, starts unmarked. Clearing a mark makes the
    ///   next release save those bytes again (never taking them from an older backup).
    /// - A mark set or cleared while the region is released takes effect at the next
    ///   release: the coming resume restores what the last release saved.
    /// - In a growing region a buffer marked whole has no pinned backup at all (none is
    ///   pinned for it; one pinned earlier is kept for later use). A mark that reaches the
    ///   buffer's end also covers the buffer's padding up to the granularity, which no pager
    ///   call reaches.
    ///
    /// A mark on a `Discard` or `DiscardZeroed` region is accepted and has no effect (their
    /// contents are dropped on release anyway), so that a caller can mark tensors without
    /// asking where they live. An empty range changes nothing.
    ///
    /// Errors: [`Error::StaleBuffer`] when the buffer was freed or its region removed,
    /// [`Error::InvalidArgument`] for a reversed range, [`Error::OutOfRange`] unless `range`
    /// ends inside the buffer (`end <= buf.len()`). Takes the region's lock, so it is ordered with the
    /// region's moves like any other call.
    pub fn set_overwritten(&self, buf: &Buffer, range: Range<usize>, on: bool) -> Result<()> {
        let slot = self.slot_of(buf)?;
        let mut r = lock(&slot);
        let Some(alloc_len) = r.extent_of(buf.offset, buf.id) else {
            return Err(stale(buf));
        };
        if range.start > range.end {
            return Err(Error::reversed_range(&buf.tag, &range));
        }
        if range.end > buf.len {
            return Err(Error::OutOfRange {
                tag: buf.tag.to_string(),
                what: "buffer",
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                size: buf.len,
            });
        }
        if range.is_empty() {
            return Ok(());
        }
        // Up to the buffer's end means up to its allocation's end (a growing region's
        // padding).
        let end = if range.end == buf.len {
            alloc_len
        } else {
            range.end
        };
        r.set_marks(buf.offset + range.start..buf.offset + end, on);
        Ok(())
    }

    /// Marks the whole buffer overwritten by the next update; see
    /// [`Pager::set_overwritten`].
    pub fn mark_overwritten(&self, buf: &Buffer) -> Result<()> {
        self.set_overwritten(buf, 0..buf.len, true)
    }

    /// Clears every overwritten mark of the buffer, so that the next release saves it whole
    /// again; see [`Pager::set_overwritten`].
    pub fn unmark_overwritten(&self, buf: &Buffer) -> Result<()> {
        self.set_overwritten(buf, 0..buf.len, false)
    }

    /// The byte ranges of `buf` marked overwritten by the next update (offsets from the
    /// buffer's start, in order, merged where they touch); see [`Pager::set_overwritten`].
    /// [`Error::StaleBuffer`] when the buffer was freed.
    pub fn overwritten(&self, buf: &Buffer) -> Result<Vec<Range<usize>>> {
        let slot = self.slot_of(buf)?;
        let r = lock(&slot);
        if !r.is_live(buf.offset, buf.id) {
            return Err(stale(buf));
        }
        let within = buf.offset..buf.offset + buf.len;
        Ok(r.marks_within(&within)
            .into_iter()
            .map(|m| m.start - buf.offset..m.end - buf.offset)
            .collect())
    }
}
