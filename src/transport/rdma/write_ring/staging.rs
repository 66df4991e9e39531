//! The ring's registered memory ([`Buf`]): page-aligned, zeroed, written by the device while it
//! is registered, so this side touches it only through raw pointers to the ranges a completion
//! made its own.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Page-aligned, zeroed memory that the device (or the fake) may write while it is registered:
/// touched only through raw pointers to the ranges a completion made ours.
#[derive(Debug)]
pub(super) struct Buf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Buf` owns its allocation (no aliasing handle exists outside the ring that owns it),
// so moving it to another thread moves the only access.
unsafe impl Send for Buf {}

impl Buf {
    pub(super) fn new(len: usize) -> Result<Buf> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|_| Error::InvalidArgument(format!("RDMA ring buffer of {len} bytes").into()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::System(format!("cannot allocate {len} bytes for an RDMA ring").into()))?;
        Ok(Buf { ptr, layout })
    }

    /// The start of the memory, for registering it with the device.
    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `src` to offset `at` (in bounds: checked).
    pub(super) fn write(&mut self, at: usize, src: &[u8]) {
        assert!(
            at.checked_add(src.len()).is_some_and(|e| e <= self.layout.size()),
            "stage write out of bounds"
        );
        // SAFETY: in bounds (above); the stage's bytes are read by the device only after a
        // post of this range, which happens after this copy on this thread.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(at), src.len()) };
    }

    /// The `len` bytes at offset `at` (in bounds: checked), lent in place.
    pub(super) fn slice(&self, at: usize, len: usize) -> &[u8] {
        assert!(at.checked_add(len).is_some_and(|e| e <= self.layout.size()), "ring lend out of bounds");
        // SAFETY: in bounds (above); the caller lends only bytes of a slot whose write
        // completed, which the peer does not write again before it gets the slot back as a
        // credit, after the borrow ends (credits go out only from `&mut self` calls).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), len) }
    }

    /// Copies from offset `at` into `dst` (in bounds: checked).
    pub(super) fn read(&self, at: usize, dst: &mut [u8]) {
        assert!(
            at.checked_add(dst.len()).is_some_and(|e| e <= self.layout.size()),
            "ring read out of bounds"
        );
        // SAFETY: in bounds (above); the caller reads only a slot whose write completed (its
        // completion was polled), which the peer does not write again before it gets the slot
        // back as a credit, after this read.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), dst.as_mut_ptr(), dst.len()) };
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
