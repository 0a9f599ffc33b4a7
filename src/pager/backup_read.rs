//! Reading a released buffer's contents from its pinned host backup, without resuming.

use super::{Buffer, Pager, lock, stale};
use crate::error::{Error, Result};

impl Pager {
    /// Copies `out.len()` bytes of `buf` from `offset` out of the region's pinned host
    /// backup, while the region is released: what the last release saved, and what the next
    /// resume will restore. For reading weights (a checkpoint, a comparison) without mapping
    /// them back.
    ///
    /// Errors: [`Error::StaleBuffer`], [`Error::OutOfRange`] (the range must lie inside the
    /// buffer), and [`Error::InvalidArgument`] when the region is resident (its device
    /// memory is current and the backup may be older: use [`Pager::read`]) or when the
    /// backup does not hold every requested byte (a `Discard` region, or bytes marked
    /// overwritten at the release, see [`Pager::set_overwritten`]).
    pub fn read_backup(&self, buf: &Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        let slot = self.slot(&buf.tag)?;
        let r = lock(&slot);
        if !r.alloc.is_live(buf.offset, buf.id) {
            return Err(stale(buf));
        }
        if offset
            .checked_add(out.len())
            .is_none_or(|end| end > buf.len)
        {
            return Err(Error::OutOfRange {
                tag: buf.tag.to_string(),
                what: "buffer",
                offset,
                len: out.len(),
                size: buf.len,
            });
        }
        if r.is_resident() {
            return Err(Error::InvalidArgument {
                tag: buf.tag.to_string(),
                reason: "the region is resident, so its device memory is current and its \
                         backup may be older; read the device memory (Pager::read) instead"
                    .to_owned(),
            });
        }
        let start = buf.offset + offset;
        if !out.is_empty() && !r.read_backup(start..start + out.len(), out) {
            return Err(Error::InvalidArgument {
                tag: buf.tag.to_string(),
                reason: format!(
                    "the backup holds no copy of bytes {offset}..{} of this buffer: the \
                     region keeps no contents (Discard), or they were marked overwritten at \
                     the release (Pager::set_overwritten); resume the region and read the \
                     device memory",
                    offset + out.len()
                ),
            });
        }
        Ok(())
    }
}
