//! Reading a released buffer's contents from its pinned host backup, without resuming.

use super::buffers::buffer_range;
use super::{Buffer, Pager, lock};
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
    /// overwritten at the release, see [`Pager::set_overwritten`]); [`Error::Backend`] when
    /// a file backup cannot be read.
    pub fn read_backup(&self, buf: &Buffer, offset: usize, out: &mut [u8]) -> Result<()> {
        let slot = self.slot_of(buf)?;
        let r = lock(&slot);
        let range = buffer_range(&r, buf, offset, out.len())?;
        if r.is_resident() {
            return Err(Error::InvalidArgument {
                tag: Some(buf.tag.to_string()),
                reason: "the region is resident, so its device memory is current and its \
                         backup may be older; read the device memory (Pager::read) instead"
                    .to_owned(),
            });
        }
        let held = out.is_empty()
            || r.read_backup(range, out)
                .map_err(|e| Error::backend(&buf.tag, "reading the backup", e))?;
        if !held {
            return Err(Error::InvalidArgument {
                tag: Some(buf.tag.to_string()),
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

    /// The host address of the backup's copy of `len` bytes of `buf` from `offset`, when the
    /// region's backup is in host memory ([`crate::Medium::Pinned`] or
    /// [`crate::Medium::Host`]) and validly holds all of them; `None` otherwise (a file
    /// backup, a `Discard` region, bytes not saved yet or marked overwritten at the last
    /// release). Works while the region is released (the bytes the next resume restores) and
    /// while it is resident (what the last release saved, if the backup is still held).
    ///
    /// For zero-copy readers (torch_memory_saver's `get_cpu_backup(zero_copy=True)`). The
    /// address is plain host memory that the pager keeps using: the next release of the
    /// region overwrites it, and a resume that gives `Host` backups back, `free_backup`,
    /// freeing the buffer or removing the region unmap it. Reading it after that is the
    /// caller's error, as with any raw pointer.
    pub fn backup_ptr(&self, buf: &Buffer, offset: usize, len: usize) -> Result<Option<u64>> {
        let slot = self.slot_of(buf)?;
        let r = lock(&slot);
        Ok(r.backup_host_ptr(buffer_range(&r, buf, offset, len)?))
    }
}
