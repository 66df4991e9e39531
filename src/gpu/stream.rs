//! Collectives on device memory ordered on a caller's CUDA stream (the C entry points
//! `toroid_*_stream`, and through them the torch backend): the path is picked once per
//! communicator, the same on every rank.
//!
//! - **CUDA IPC** ([`super::ipc`]) when every rank is on this host, each could make its device
//!   window and load the kernels, and `TOROID_CUDA_IPC` is not off: data moves and is reduced
//!   on the GPU.
//! - **Staged** ([`super::staged`]) otherwise (ranks on several hosts, no NVRTC, IPC refused
//!   by the driver): through pinned host memory and the communicator's host collectives.
//!
//! Every rank ends with the same bits on either path. They differ in one rounding: an average
//! on the IPC path is the sum scaled by 1/n; the host algorithms scale each input by 1/n first.
//!
//! The first call on a communicator binds it to the device of its buffers (as an NCCL
//! communicator is bound to one device) and sets the path up: a collective, so every rank
//! makes it; what was chosen and why is logged at INFO (target `toroid::gpu`).
//!
//! **Asynchronous on the IPC path** ([`on_stream_async`]). The call records an event on the
//! caller's stream (its input is ready there), queues the collective on the communicator's
//! queue (so it keeps its place in issue order among every other call, on every rank), and
//! makes the caller's stream wait, on the device, until a page-locked counter mapped into the
//! device reaches the call's sequence number (`cuStreamBatchMemOp`, wait-value). The
//! communicator's worker thread runs the collective in a hook of that queued job: its own
//! stream waits for the event, the protocol of [`super::ipc`] runs there with the meetings
//! made directly on the engine (the job holds the queue), the stream is synchronised, and the
//! counter is set, which releases the caller's stream, also after a failure (the communicator
//! then fails with the error, as after a failed host collective, and the work reports it). The
//! host is free meanwhile: the returned work completes when the collective has. At most
//! [`IN_FLIGHT`] calls are in flight (one event each); a device without stream memory
//! operations gets the same path, waited for before the call returns. The staged path stays
//! blocking.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self as cu, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::device::DeviceKernels;
use super::ipc::IpcWindows;
use super::staged::{DeviceCollectives, device_of};
use super::{driver_err, guard};
use crate::comm::RawOp;
use crate::comm::{Hooks, Work};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::memory::RawBufs;
use crate::{CallOptions, Communicator, OpKind};

/// Collectives on the IPC path in flight at most per communicator (one event each).
pub const IN_FLIGHT: usize = 32;

/// A page-locked host counter mapped into the device: the sequence number of the last
/// collective on the IPC path that completed. Callers' streams wait for it on the device.
#[derive(Debug)]
struct DoneCounter {
    ctx: Arc<CudaContext>,
    host: *mut u64,
    dev: u64,
}

// SAFETY: `host` points to 8 bytes of page-locked memory owned by this value until it is
// dropped, and is only accessed as an atomic.
unsafe impl Send for DoneCounter {}
// SAFETY: as above; every access is atomic.
unsafe impl Sync for DoneCounter {}

impl DoneCounter {
    fn new(ctx: &Arc<CudaContext>) -> Result<DoneCounter> {
        guard("allocating the completion counter", || -> Result<DoneCounter> {
            ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            let mut dev = 0u64;
            // SAFETY: the driver writes a pointer to 8 page-locked bytes (page aligned) into `p`,
            // then the device address of that memory into `dev`.
            let ok = unsafe {
                cu::cuMemHostAlloc(&mut p, 8, cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE)
                    == CUresult::CUDA_SUCCESS
                    && !p.is_null()
                    && cu::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) == CUresult::CUDA_SUCCESS
            };
            if !ok {
                return Err(Error::Unsupported(
                    "CUDA: cannot map a page-locked counter into the device".into(),
                ));
            }
            let c = DoneCounter { ctx: ctx.clone(), host: p.cast(), dev };
            c.atomic().store(0, Ordering::Release);
            Ok(c)
        })?
    }

    fn atomic(&self) -> &AtomicU64 {
        // SAFETY: `host` is 8 page-aligned bytes owned by `self`, only accessed atomically.
        unsafe { AtomicU64::from_ptr(self.host) }
    }

    fn load(&self) -> u64 {
        self.atomic().load(Ordering::Acquire)
    }

    fn store(&self, v: u64) {
        self.atomic().store(v, Ordering::Release);
    }

    /// Makes `stream` wait, on the device, until the counter is at least `v`.
    fn wait_on(&self, stream: &CudaStream, v: u64) -> Result<()> {
        // SAFETY: a plain-old-data union, every field of which is valid zeroed.
        let mut p: cu::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
        p.waitValue.operation = cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64;
        p.waitValue.address = self.dev;
        p.waitValue.__bindgen_anon_1.value64 = v;
        p.waitValue.flags = cu::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32;
        guard("waiting on the device", || {
            // SAFETY: one valid wait operation on the device address of this counter, which
            // outlives every stream waiting on it (the communicator waits for its collectives).
            let r = unsafe { cu::cuStreamBatchMemOp_v2(stream.cu_stream(), 1, &mut p, 0) };
            if r == CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(Error::System(format!("CUDA: making a stream wait for a collective: {r:?}").into()))
            }
        })?
    }
}

impl Drop for DoneCounter {
    fn drop(&mut self) {
        let _ = guard("freeing the completion counter", || {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: `host` came from cuMemHostAlloc and nothing waits on it any more.
                let _ = unsafe { cu::cuMemFreeHost(self.host.cast()) };
            }
        });
    }
}

/// The IPC path's windows and the stream its collectives run on (the worker thread's).
#[derive(Debug)]
struct IpcRun {
    windows: IpcWindows,
    stream: Arc<CudaStream>,
}

/// The path a communicator's collectives on device memory take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePath {
    /// CUDA IPC between the ranks of one host, reduced on the GPU.
    Ipc,
    /// Staged through pinned host memory.
    Staged,
}

/// A communicator's device, staging and (when it runs) IPC path.
#[derive(Debug)]
pub struct DeviceState {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    staging: DeviceCollectives,
    ipc: Option<Arc<Mutex<IpcRun>>>,
    /// Completed IPC collectives (their sequence numbers), what callers' streams wait for.
    done: Arc<DoneCounter>,
    /// "The input is ready on the caller's stream", one per call in flight.
    ready: Arc<Vec<CudaEvent>>,
    /// IPC collectives issued (the last sequence number).
    issued: u64,
    /// Whether the device has stream memory operations (else the host waits for each call).
    mem_ops: bool,
}

/// The kernels of each device this process used, loaded on first use and shared by its
/// communicators (loading compiles with NVRTC once per process).
fn kernels_for(ordinal: usize) -> Result<Arc<DeviceKernels>> {
    type ByDevice = Vec<(usize, Arc<DeviceKernels>)>;
    static ALL: OnceLock<Mutex<ByDevice>> = OnceLock::new();
    let mut all = ALL.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, k)) = all.iter().find(|(o, _)| *o == ordinal) {
        return Ok(k.clone());
    }
    let k = Arc::new(DeviceKernels::new(ordinal, super::ptx()?)?);
    all.push((ordinal, k.clone()));
    Ok(k)
}

impl DeviceState {
    /// Sets up `comm`'s collectives on device `ordinal` (collective when the ranks share a host).
    fn new(comm: &Communicator, ordinal: usize) -> Result<DeviceState> {
        let ctx = guard("opening the device", || {
            CudaContext::new(ordinal).map_err(driver_err("opening the device"))
        })??;
        let staging = DeviceCollectives::new(ctx.clone())?;
        let one_host = comm.topology().hosts == 1;
        let ipc = if one_host && comm.size() > 1 {
            match IpcWindows::open(comm, &ctx, ordinal, comm.config().cuda_ipc, || kernels_for(ordinal)) {
                Ok(w) => Some(w),
                Err(e) if matches!(e, Error::Unsupported(_)) => {
                    tracing::info!(target: "toroid::gpu", rank = comm.rank(),
                        "device collectives on device {ordinal}: staged through host memory ({e})");
                    None
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        if ipc.is_some() {
            tracing::info!(target: "toroid::gpu", rank = comm.rank(),
                "device collectives on device {ordinal}: CUDA IPC between the {} ranks of this host", comm.size());
        } else if !one_host {
            tracing::info!(target: "toroid::gpu", rank = comm.rank(),
                "device collectives on device {ordinal}: staged through host memory (ranks on {} hosts)",
                comm.topology().hosts);
        }
        let ipc = match ipc {
            Some(windows) => {
                let stream = guard("creating a stream", || {
                    ctx.new_stream().map_err(driver_err("creating a stream"))
                })??;
                Some(Arc::new(Mutex::new(IpcRun { windows, stream })))
            }
            None => None,
        };
        let done = Arc::new(DoneCounter::new(&ctx)?);
        let event = || {
            let flags = Some(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING);
            guard("creating an event", || ctx.new_event(flags).map_err(driver_err("creating an event")))?
        };
        let ready = Arc::new((0..IN_FLIGHT).map(|_| event()).collect::<Result<Vec<_>>>()?);
        let mem_ops = guard("reading a device attribute", || {
            ctx.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
        })?
        .is_ok_and(|v| v == 1);
        Ok(DeviceState { ordinal, ctx, staging, ipc, done, ready, issued: 0, mem_ops })
    }

    /// The path this state's collectives take.
    pub fn path(&self) -> DevicePath {
        if self.ipc.is_some() { DevicePath::Ipc } else { DevicePath::Staged }
    }
}

/// The path `comm`'s collectives on device memory take; `None` before the first one.
pub fn path(comm: &Communicator) -> Option<DevicePath> {
    comm.device_state().lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(DeviceState::path)
}

/// What a C caller asks: `kind` (an all-reduce, a broadcast, an all-gather or a reduce-scatter)
/// of `count` elements of `dtype` (per rank: an all-gather's sendcount, a reduce-scatter's
/// recvcount) from device memory `send` into device memory `recv` (in place: the same pointer,
/// or NCCL's forms for the last two), ordered on the CUDA stream `stream` (a
/// `CUstream`/`cudaStream_t` of the buffers' device's primary context; NULL: the legacy default
/// stream). Blocking for the host: the result is in `recv` when it returns.
///
/// Without CUDA: `Unsupported` ("CUDA is not available ..."); pointers that are not device
/// memory of one device, or of another device than the communicator's first such call,
/// overlapping buffers other than the in-place forms: `InvalidArgument`.
///
/// # Safety
/// `send` and `recv` are valid for their sizes on their device until the call returns and
/// nothing else uses them meanwhile; `stream` is NULL or a live stream of that device's primary
/// context.
pub unsafe fn on_stream(
    comm: &Communicator,
    kind: OpKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    // SAFETY: forwarded contract; the buffers stay valid until the work below has completed.
    match unsafe { on_stream_async(comm, kind, send, recv, count, dtype, stream) }? {
        Some(work) => work.wait(),
        None => Ok(()),
    }
}

/// [`on_stream`], asynchronous for the host on the IPC path: returns once the collective is
/// queued and the caller's stream made to wait for it (work queued on `stream` later runs after
/// it), with the work that completes when it has. `None`: the call already completed (the
/// staged path, or nothing to do).
///
/// # Safety
/// As [`on_stream`], the buffers valid and untouched by anything but `stream`'s later work
/// until the work completes (or, for `None`, until the call returns); `stream` live until then.
pub unsafe fn on_stream_async(
    comm: &Communicator,
    kind: OpKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    stream: *mut std::ffi::c_void,
) -> Result<Option<Work<()>>> {
    super::driver_available()?;
    let (n, es) = (comm.size(), dtype.size());
    let overflow = || Error::InvalidArgument(format!("{n} x {count} elements of {dtype} overflow").into());
    let bytes = count.checked_mul(es).ok_or_else(overflow)?;
    let all = bytes.checked_mul(n).ok_or_else(overflow)?;
    if count == 0 {
        return Ok(None);
    }
    // The buffers' sizes, and which overlaps are the in-place forms (NCCL's, and for a
    // reduce-scatter the result at the front of sendbuf).
    let mine = (comm.rank() * bytes) as u64;
    let (send_len, recv_len, in_place) = match kind {
        OpKind::AllGather => (bytes, all, send == recv.wrapping_add(mine)),
        OpKind::ReduceScatter(_) => (all, bytes, recv == send || recv == send.wrapping_add(mine)),
        OpKind::AllReduce(_) | OpKind::Broadcast(_) => (bytes, bytes, send == recv),
        other => return Err(Error::Unsupported(format!("{other:?} on device memory").into())),
    };
    let overlap = send < recv.saturating_add(recv_len as u64) && recv < send.saturating_add(send_len as u64);
    if overlap && !in_place {
        return Err(Error::InvalidArgument(
            format!("{kind:?} on device memory: sendbuf and recvbuf overlap, and not in an in-place form")
                .into(),
        ));
    }
    let ordinal = match (device_of(send), device_of(recv)) {
        (Some(a), Some(b)) if a == b => a,
        (a, b) => {
            let say = |d: Option<usize>| d.map_or("host memory".into(), |d| format!("on device {d}"));
            return Err(Error::InvalidArgument(
                format!(
                    "the stream collectives take device memory of one device: sendbuf is {}, recvbuf is {}",
                    say(a),
                    say(b)
                )
                .into(),
            ));
        }
    };
    let mut slot = comm.device_state().lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        *slot = Some(DeviceState::new(comm, ordinal)?);
    }
    let Some(st) = slot.as_mut() else { return Err(Error::Internal("no device state".into())) };
    if st.ordinal != ordinal {
        return Err(Error::InvalidArgument(
            format!(
                "this communicator's device collectives run on device {}; these buffers are on device {ordinal}",
                st.ordinal
            )
            .into(),
        ));
    }
    // SAFETY: the caller's stream is NULL or a live stream of this (primary) context, kept
    // alive by the caller for the call.
    let stream = unsafe { st.ctx.wrap_borrowed_stream(stream.cast()) };
    if st.ipc.is_some() {
        // SAFETY: forwarded contract.
        return unsafe { st.queue_ipc(comm, &stream, kind, send, recv, count, dtype) };
    }
    // The staged path, blocking (on the caller's thread, after the queued work).
    if matches!(kind, OpKind::AllGather | OpKind::ReduceScatter(_)) {
        // SAFETY: forwarded contract (sizes and overlaps checked above).
        unsafe { st.staging.gathered(comm, &stream, kind, send, recv, count, dtype) }?;
        return Ok(None);
    }
    if send != recv {
        guard("copying sendbuf to recvbuf", || {
            // SAFETY: both ranges are valid device memory of `bytes` bytes (the caller's promise).
            unsafe { cudarc::driver::result::memcpy_dtod_async(recv, send, bytes, stream.cu_stream()) }
        })?
        .map_err(driver_err("copying sendbuf to recvbuf"))?;
    }
    // SAFETY: forwarded contract, for `recv`.
    unsafe { st.staging.staged(comm, &stream, recv, count, dtype, kind) }?;
    Ok(None)
}

impl DeviceState {
    /// Queues `kind` on the IPC path (see the module's documentation).
    ///
    /// # Safety
    /// As [`on_stream_async`]; `stream` is the caller's.
    #[allow(clippy::too_many_arguments)]
    unsafe fn queue_ipc(
        &mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        kind: OpKind,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<Option<Work<()>>> {
        let Some(ipc) = self.ipc.clone() else { return Err(Error::Internal("no IPC path".into())) };
        let seq = self.issued + 1;
        // The event of call seq - IN_FLIGHT is reused: that call must have completed.
        if seq > IN_FLIGHT as u64 {
            let need = seq - IN_FLIGHT as u64;
            let deadline = Instant::now() + comm.timeout();
            let mut nap = Duration::from_micros(2);
            while self.done.load() < need {
                if comm.is_aborted() {
                    return Err(Error::Aborted("the communicator was aborted".into()));
                }
                if Instant::now() > deadline {
                    return Err(Error::Timeout(
                        format!(
                            "{IN_FLIGHT} collectives on device memory still in flight after {:?}",
                            comm.timeout()
                        )
                        .into(),
                    ));
                }
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
        let slot = (seq % IN_FLIGHT as u64) as usize;
        guard("recording an event", || self.ready[slot].record(stream))?
            .map_err(driver_err("recording an event"))?;
        let (ready, done, meet) = (self.ready.clone(), self.done.clone(), comm.inline());
        let job = move || {
            let mut run = ipc.lock().unwrap_or_else(|e| e.into_inner());
            let IpcRun { windows, stream } = &mut *run;
            let result = guard("waiting for the input", || stream.wait(&ready[slot]))
                .and_then(|r| r.map_err(driver_err("waiting for the input")))
                .and_then(|()| {
                    // SAFETY (each): the caller keeps the buffers valid until this work completes
                    // (checked sizes and overlaps); the stream is of the windows' context.
                    unsafe {
                        match kind {
                            OpKind::AllReduce(op) => {
                                windows.all_reduce(&meet, stream, send, recv, count, dtype, op)
                            }
                            OpKind::Broadcast(root) => {
                                windows.broadcast(&meet, stream, send, recv, count, dtype, root)
                            }
                            OpKind::AllGather => windows.all_gather(&meet, stream, send, recv, count, dtype),
                            OpKind::ReduceScatter(op) => {
                                windows.reduce_scatter(&meet, stream, send, recv, count, dtype, op)
                            }
                            other => Err(Error::Unsupported(format!("{other:?} on device memory").into())),
                        }
                    }
                });
            // Also after a failure: nothing may write the caller's memory once its stream runs on.
            let synced = guard("synchronising", || stream.synchronize())
                .and_then(|r| r.map_err(driver_err("synchronising")));
            done.store(seq);
            if let Err(e) = result.and(synced) {
                // The communicator fails with it: the job's own step and every later call
                // report it, on every rank (the links close).
                meet.fail(e);
            }
        };
        // The job's own operation is a barrier after the hook: the work completes once every
        // rank has finished the collective.
        let op = RawOp {
            kind: OpKind::Barrier,
            dtype: DataType::U8,
            bufs: RawBufs::None,
            opts: CallOptions::default(),
            source: None,
        };
        // SAFETY: a barrier has no buffers; the hook touches the caller's buffers, which the
        // caller keeps valid until the work completes (this function's contract).
        let work = unsafe {
            comm.submit_raw_with_hooks(op, None, Hooks { before: Some(Box::new(job)), after: None })
        }?;
        self.issued = seq;
        if self.mem_ops {
            self.done.wait_on(stream, seq)?;
            Ok(Some(work))
        } else {
            work.wait()?;
            Ok(None)
        }
    }
}
