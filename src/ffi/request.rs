//! Persistent collectives from C: `toroid_all_reduce_init` sets up an all-reduce once (checked,
//! its algorithm chosen), `toroid_request_run` runs it as often as needed on the buffers it was
//! given, `toroid_request_free` releases it. The C side of [`crate::Persistent`].

use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

use super::boundary::{
    CommHandle, Handle, Registry, check_out, code, fail, ffi_boundary, with_comm, write_out,
};
use super::ops::{Args, Coll, prepare};
use super::types::{RawDatatype, RawRedop, toroid_comm, toroid_request, toroid_result};
use crate::collective::CallOptions;
use crate::comm::RawOp;
use crate::error::{Error, Result};

/// What a `toroid_request *` stands for.
pub(crate) struct RequestHandle {
    /// The communicator (not kept alive by the request).
    comm: Weak<CommHandle>,
    /// The validated operation, its algorithm pinned; locked while it runs, so that two
    /// threads running one request take turns on its buffers.
    op: Mutex<RawOp>,
}

static REQUESTS: Registry<RequestHandle> = Registry::new();

impl Handle for RequestHandle {
    type C = toroid_request;
    const NAME: &'static str = "toroid_request";
    fn registry() -> &'static Registry<Self> {
        &REQUESTS
    }
}

/// Sets up an all-reduce of `count` elements from `sendbuf` into `recvbuf` (equal: in place)
/// to be run many times with toroid_request_run: the arguments are checked and the algorithm
/// chosen once, here, so each run skips both (MPI 4's MPI_Allreduce_init). Every rank must set
/// up the same all-reduce and run it as often. The buffers must stay valid until the request
/// is freed; between runs the caller may read and write them. Sets *req on success.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_all_reduce_init(
    comm: *mut toroid_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: RawDatatype,
    op: RawRedop,
    req: *mut *mut toroid_request,
) -> toroid_result {
    const NAME: &str = "toroid_all_reduce_init";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(req, "req")?;
            let a = Args { send: sendbuf, recv: recvbuf, count, dtype };
            // SAFETY: the C contract: the buffers stay valid until the request is freed.
            let (raw, _) =
                unsafe { prepare(&h.comm, Coll::AllReduce(op), a, CallOptions::default())? }.into_parts();
            let raw = h.comm.pin_algorithm(raw);
            let handle = RequestHandle::into_handle(Arc::new(RequestHandle {
                comm: Arc::downgrade(h),
                op: Mutex::new(raw),
            }));
            // SAFETY: `req` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(req, handle) };
            Ok(())
        })
    })
}

/// Runs the request's all-reduce on its buffers as they are now and returns when it has
/// completed (blocking, like toroid_all_reduce). TOROID_INVALID_USAGE once its communicator was
/// destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_request_run(req: *mut toroid_request) -> toroid_result {
    const NAME: &str = "toroid_request_run";
    ffi_boundary!(NAME, {
        match RequestHandle::get(req) {
            Ok(r) => {
                let comm = r.comm.upgrade();
                let result = run(&r, comm.as_deref());
                code(NAME, comm.as_deref(), result)
            }
            Err(e) => fail(NAME, None, &e),
        }
    })
}

fn run(r: &RequestHandle, comm: Option<&CommHandle>) -> Result<()> {
    let comm = comm.ok_or_else(|| Error::InvalidUsage("the request's communicator was destroyed".into()))?;
    super::group::refuse_in_group(comm, "a persistent request")?;
    let op = r.op.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the operation was validated on this communicator at set-up, and its buffers are
    // valid until the request is freed (the C contract of toroid_all_reduce_init).
    unsafe { comm.comm.run_validated(op.clone()) }
}

/// Releases a request (it must not be running). NULL is a no-op.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_request_free(req: *mut toroid_request) {
    const NAME: &str = "toroid_request_free";
    ffi_boundary!(NAME, {
        if !req.is_null()
            && let Err(e) = RequestHandle::remove(req)
        {
            let _ = fail(NAME, None, &e);
        }
    })
}
