//! Buffer descriptors that outlive a borrow.
//!
//! Async operations and the C ABI hand buffers to the communicator's worker thread. The
//! descriptors here erase the borrow; whoever creates one promises the memory stays valid and
//! unaliased until the operation completes (the safe Rust API keeps owned buffers alive inside
//! the work handle; C callers promise it in the contract). Turning descriptors back into slices
//! is the one unsafe step, done once per operation just before it runs.

use crate::collective::Bufs;
use crate::error::{Error, Result};

/// A read-only byte range.
#[derive(Debug, Clone, Copy)]
pub struct RawBuf {
    ptr: *const u8,
    len: usize,
}

/// A writable byte range.
#[derive(Debug, Clone, Copy)]
pub struct RawBufMut {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the descriptors are plain addresses; the creator guarantees the memory may be used
// from the worker thread until the operation completes (see the module docs).
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Send for RawBufMut {}

impl RawBuf {
    /// Describes `s`.
    pub fn new(s: &[u8]) -> RawBuf {
        RawBuf { ptr: s.as_ptr(), len: s.len() }
    }

    /// Describes `len` bytes at `ptr` (C callers). A null pointer is allowed only for `len == 0`.
    ///
    /// # Safety
    /// Unless `len == 0`, `ptr` must be valid for reads of `len` bytes, and not written by
    /// anything else, until every operation given this descriptor has completed.
    pub unsafe fn from_raw(ptr: *const u8, len: usize) -> Result<RawBuf> {
        if ptr.is_null() && len != 0 {
            return Err(Error::InvalidArgument("null buffer pointer".into()));
        }
        Ok(RawBuf { ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The slice again.
    ///
    /// # Safety
    /// The memory must be valid for reads of `len` bytes for `'a` and not written meanwhile.
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees validity; non-null because len > 0 (from_raw checks).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl RawBufMut {
    /// Describes `s`.
    pub fn new(s: &mut [u8]) -> RawBufMut {
        RawBufMut { ptr: s.as_mut_ptr(), len: s.len() }
    }

    /// Describes `len` bytes at `ptr` (C callers). A null pointer is allowed only for `len == 0`.
    ///
    /// # Safety
    /// Unless `len == 0`, `ptr` must be valid for reads and writes of `len` bytes, and
    /// accessed by nothing else, until every operation given this descriptor has completed.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<RawBufMut> {
        if ptr.is_null() && len != 0 {
            return Err(Error::InvalidArgument("null buffer pointer".into()));
        }
        Ok(RawBufMut { ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The same bytes, described for reading.
    pub fn as_read(&self) -> RawBuf {
        RawBuf { ptr: self.ptr, len: self.len }
    }

    /// The slice again.
    ///
    /// # Safety
    /// The memory must be valid for reads and writes of `len` bytes for `'a` and accessed by
    /// nothing else meanwhile.
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the caller guarantees validity and exclusivity; non-null because len > 0.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The buffers of one operation.
#[derive(Debug, Clone, Copy)]
pub enum RawBufs {
    /// No data (barrier).
    None,
    /// One buffer read and written.
    InPlace(RawBufMut),
    /// Read one, write the other (disjoint).
    OutOfPlace(RawBuf, RawBufMut),
    /// Read only (send).
    Read(RawBuf),
}

impl RawBufs {
    /// Builds the descriptor from C-style pointers: equal addresses mean in place; partially
    /// overlapping ranges are rejected.
    pub fn from_pair(send: RawBuf, recv: RawBufMut) -> Result<RawBufs> {
        if send.addr() == recv.addr() && !send.is_empty() {
            if send.len() != recv.len() {
                return Err(Error::InvalidArgument(
                    format!(
                        "in-place call (send == recv) with different lengths {} and {}",
                        send.len(),
                        recv.len()
                    )
                    .into(),
                ));
            }
            return Ok(RawBufs::InPlace(recv));
        }
        let (s, r) = (send.addr(), recv.addr());
        if !send.is_empty() && !recv.is_empty() && s < r + recv.len() && r < s + send.len() {
            return Err(Error::InvalidArgument(
                "send and receive buffers overlap without being the same buffer".into(),
            ));
        }
        Ok(RawBufs::OutOfPlace(send, recv))
    }

    /// The input length in bytes.
    pub fn input_len(&self) -> usize {
        match self {
            RawBufs::None => 0,
            RawBufs::InPlace(b) => b.len(),
            RawBufs::OutOfPlace(s, _) | RawBufs::Read(s) => s.len(),
        }
    }

    /// The output length in bytes.
    pub fn output_len(&self) -> usize {
        match self {
            RawBufs::None | RawBufs::Read(_) => 0,
            RawBufs::InPlace(b) | RawBufs::OutOfPlace(_, b) => b.len(),
        }
    }

    /// The slices for an algorithm.
    ///
    /// # Safety
    /// As [`RawBuf::as_slice`] and [`RawBufMut::as_mut_slice`] for every buffer.
    pub unsafe fn bufs<'a>(self) -> Option<Bufs<'a>> {
        // SAFETY: forwarded to the caller.
        unsafe {
            match self {
                RawBufs::InPlace(b) => Some(Bufs::InPlace(b.as_mut_slice())),
                RawBufs::OutOfPlace(s, r) => {
                    Some(Bufs::OutOfPlace { send: s.as_slice(), recv: r.as_mut_slice() })
                }
                RawBufs::None | RawBufs::Read(_) => None,
            }
        }
    }

    /// The read-only slice of a `Read` descriptor.
    ///
    /// # Safety
    /// As [`RawBuf::as_slice`].
    pub unsafe fn read<'a>(self) -> Option<&'a [u8]> {
        match self {
            // SAFETY: forwarded to the caller.
            RawBufs::Read(s) => Some(unsafe { s.as_slice() }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_classification() {
        // SAFETY (every from_raw below): `a` outlives the descriptors, which are only compared.
        let mut a = [0u8; 16];
        let p = a.as_mut_ptr();
        let same = unsafe {
            RawBufs::from_pair(RawBuf::from_raw(p, 16).unwrap(), RawBufMut::from_raw(p, 16).unwrap())
        }
        .unwrap();
        assert!(matches!(same, RawBufs::InPlace(_)));
        // SAFETY: offsets stay inside `a`.
        let q = unsafe { p.add(8) };
        assert!(
            unsafe {
                RawBufs::from_pair(RawBuf::from_raw(p, 16).unwrap(), RawBufMut::from_raw(q, 8).unwrap())
            }
            .is_err()
        );
        assert!(
            unsafe {
                RawBufs::from_pair(RawBuf::from_raw(p, 8).unwrap(), RawBufMut::from_raw(q, 8).unwrap())
            }
            .is_ok()
        );
        assert!(unsafe { RawBuf::from_raw(std::ptr::null(), 4) }.is_err());
        assert!(unsafe { RawBuf::from_raw(std::ptr::null(), 0) }.is_ok());
    }
}
