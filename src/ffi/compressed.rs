//! Compressed all-reduce from C: `toroid_all_reduce_wire` and its async form name, per call, the
//! type a float all-reduce travels in (what `TOROID_WIRE_DTYPE` sets for every call, and
//! [`CallOptions::wire`] in Rust; the algorithm is `src/comm/compressed.rs`). How the Python binding
//! and the torch backend's DDP comm hook ask for a bf16 wire. Both entry points run
//! [`all_reduce_compressed`], blocking or queued.

use std::ffi::c_void;

use super::boundary::{check_out, ffi_boundary, with_comm, write_out};
use super::host::Completion;
use super::ops::{self, Args, Coll};
use super::types::{RawDatatype, RawRedop, toroid_comm, toroid_result, toroid_work};
use crate::collective::CallOptions;

/// toroid_all_reduce whose bytes travel as `wire`: TOROID_BFLOAT16 or TOROID_FLOAT16 for a
/// TOROID_FLOAT32 or TOROID_FLOAT64 all-reduce (half the bytes; every reduction accumulates in
/// `dtype` and every rank receives the same bits; per element |result - exact| <=
/// (2u + u^2) sum_r |x_r| plus the sum's own rounding, u = 2^-8 for bf16 and 2^-11 for f16,
/// divided by the number of ranks for TOROID_AVG). `wire == dtype`: not compressed, whatever
/// TOROID_WIRE_DTYPE says. Other data types ignore a 16-bit float `wire` (integers are reduced
/// exactly); an integer `wire` is refused with TOROID_INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_wire(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    wire: RawDatatype,
) -> toroid_result {
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid for the call's lengths until it returns.
    unsafe { all_reduce_compressed("toroid_all_reduce_wire", comm, a, (op, wire), Completion::Blocking) }
}

/// toroid_all_reduce_wire, queued; *work is set on success (wait on it, then free it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_wire_async(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    wire: RawDatatype,
    work: *mut *mut toroid_work,
) -> toroid_result {
    let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
    // SAFETY: the C contract: buffers valid until the work completes.
    unsafe {
        all_reduce_compressed("toroid_all_reduce_wire_async", comm, a, (op, wire), Completion::Queued(work))
    }
}

/// The one body of toroid_all_reduce_wire and its async form: `op` reduces, `wire` is the type
/// the bytes travel in.
///
/// # Safety
/// The C contract: the buffers of `a` valid until the call returns (blocking) or the work
/// completes (queued); `work` NULL or valid for a write.
unsafe fn all_reduce_compressed(
    name: &'static str,
    comm: *mut toroid_comm,
    a: Args,
    (op, wire): (RawRedop, RawDatatype),
    how: Completion,
) -> toroid_result {
    ffi_boundary!(name, {
        with_comm(name, comm, |h| {
            let Completion::Queued(work) = how else {
                let opts = CallOptions { wire: Some(wire.get()?), ..CallOptions::default() };
                // SAFETY: forwarded from the caller.
                return unsafe { ops::blocking(h, Coll::AllReduce(op), a, opts) }.map(|_| ());
            };
            check_out(work, "work")?;
            let opts = CallOptions { wire: Some(wire.get()?), ..CallOptions::default() };
            // SAFETY: forwarded from the caller.
            let w = unsafe { ops::submit(h, Coll::AllReduce(op), a, opts)? };
            // SAFETY: `work` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(work, w) };
            Ok(())
        })
    })
}
