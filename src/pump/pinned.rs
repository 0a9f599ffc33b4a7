//! Pinned host memory borrowed by a pump for its lifetime: the source of copies to the
//! device ([`Pinned`]) and the destination of copies to the host ([`PinnedMut`]).

use super::*;

/// Pinned host bytes borrowed for `'h`, to be read by copies (a restore's source). Cheap to
/// copy; any number may borrow the same buffer.
#[derive(Debug, Clone, Copy)]
pub struct Pinned<'h> {
    pub(super) span: Span,
    _borrow: PhantomData<&'h [u8]>,
}

/// Borrowed pinned bytes as addresses: `len` bytes at `host`, which kernels reach at
/// `device`, and where the buffer's registrations end.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub(super) host: u64,
    device: u64,
    len: usize,
    regs: Regs,
}

impl Span {
    /// All of `buf`, whose bytes start at `host`.
    fn of(buf: &dyn HostBuffer, host: *const u8) -> Self {
        Span {
            host: host as u64,
            device: buf.device_ptr(),
            len: buf.len(),
            regs: Regs::of(buf),
        }
    }

    /// `len` of these bytes from `start` on.
    fn sub(self, start: usize, len: usize) -> Self {
        Span {
            host: self.host + start as u64,
            device: self.device + start as u64,
            len,
            regs: self.regs.advanced(start),
        }
    }

    /// The copies between these bytes and device address `device`, in order: each at most
    /// `unit` bytes, none crossing the end of a registration.
    pub(super) fn copies(
        self,
        direction: Direction,
        device: u64,
        unit: usize,
    ) -> impl Iterator<Item = RawCopy> {
        let mut at = 0usize;
        std::iter::from_fn(move || {
            (at < self.len).then(|| {
                let bytes = (self.len - at).min(unit).min(self.regs.advanced(at).room());
                let off = at as u64;
                at += bytes;
                RawCopy {
                    direction,
                    host: self.host.wrapping_add(off),
                    host_device: self.device.wrapping_add(off),
                    device: device.wrapping_add(off),
                    bytes,
                }
            })
        })
    }
}

/// Where the registrations of a borrowed buffer's bytes end ([`HostBuffer::piece_bytes`]):
/// pieces of `piece` bytes from the buffer's start (0: one registration), the first borrowed
/// byte `phase` bytes into its piece. A copy never crosses a piece's end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Regs {
    piece: usize,
    phase: usize,
}

impl Regs {
    fn of(buf: &dyn HostBuffer) -> Self {
        Regs {
            piece: buf.piece_bytes(),
            phase: 0,
        }
    }

    /// The same, `n` bytes further on.
    fn advanced(self, n: usize) -> Self {
        match self.piece {
            0 => self,
            p => Regs {
                piece: p,
                phase: ((self.phase as u128 + n as u128) % p as u128) as usize,
            },
        }
    }

    /// Bytes from the first borrowed byte to the end of its piece (`usize::MAX`: no end).
    fn room(self) -> usize {
        match self.piece {
            0 => usize::MAX,
            p => p - self.phase,
        }
    }
}

impl<'h> Pinned<'h> {
    /// All of `buf`.
    pub fn new(buf: &'h dyn HostBuffer) -> Self {
        Pinned {
            span: Span::of(buf, buf.as_slice().as_ptr()),
            _borrow: PhantomData,
        }
    }

    /// Bytes.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// The bytes `range` of these; `None` unless the range lies inside them.
    pub fn get(self, range: Range<usize>) -> Option<Self> {
        (range.start <= range.end && range.end <= self.span.len).then(|| Pinned {
            span: self.span.sub(range.start, range.len()),
            _borrow: PhantomData,
        })
    }
}

/// Pinned host bytes borrowed exclusively for `'h`, to be written by copies (a backup's
/// destination). Split it, like a `&mut [u8]`, to hand disjoint parts to several copies.
#[derive(Debug)]
pub struct PinnedMut<'h> {
    pub(super) span: Span,
    _borrow: PhantomData<&'h mut [u8]>,
}

impl<'h> PinnedMut<'h> {
    /// All of `buf`.
    pub fn new(buf: &'h mut dyn HostBuffer) -> Self {
        let host = buf.as_mut_slice().as_mut_ptr();
        PinnedMut {
            span: Span::of(buf, host),
            _borrow: PhantomData,
        }
    }

    /// Bytes.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// The bytes before `mid` and those from `mid` on; `None` if `mid` is past the end.
    pub fn split_at(self, mid: usize) -> Option<(Self, Self)> {
        let part = |start, len| PinnedMut {
            span: self.span.sub(start, len),
            _borrow: PhantomData,
        };
        (mid <= self.span.len).then(|| (part(0, mid), part(mid, self.span.len - mid)))
    }

    /// The bytes `range` of these (the rest is given up); `None` unless the range lies
    /// inside them.
    #[cfg(test)]
    pub fn get(self, range: Range<usize>) -> Option<Self> {
        if range.start > range.end || range.end > self.span.len {
            return None;
        }
        let (_, tail) = self.split_at(range.start)?;
        let (part, _) = tail.split_at(range.len())?;
        Some(part)
    }
}
