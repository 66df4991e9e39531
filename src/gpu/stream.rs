//! Collectives on device memory ordered on a caller's CUDA stream (the C entry points
//! `toroid_*_stream`, and through them the torch backend): the path is picked once per
//! communicator, the same on every rank.
//!
//! - **Stream-ordered** ([`super::ordered`]) when the IPC path below is taken, every rank is a
//!   process of its own and `TOROID_CUDA_ORDERED=1` on every rank: each all-reduce, broadcast,
//!   all-gather, reduce-scatter, reduce and all-to-all is one kernel enqueued on the caller's
//!   stream, and the call returns once it is (blocking and `_async` alike: there is nothing to
//!   wait for on the host). Sends and receives are staged.
//! - **CUDA IPC** ([`super::ipc`]) when every rank is on this host, each could make its device
//!   window and load the kernels, and `TOROID_CUDA_IPC` is not off: data moves and is reduced
//!   on the GPU, the host meeting the ranks between chunks.
//! - **Staged** ([`super::staged`]) otherwise (ranks on several hosts, no NVRTC, IPC refused
//!   by the driver): through pinned host memory and the communicator's host collectives.
//!   Reduce, all-to-all, send and receive are always staged: the device windows run the
//!   all-reduce, broadcast, all-gather and reduce-scatter.
//!
//! Every rank ends with the same bits on either path. They differ in one rounding: an average
//! on the IPC path is the sum scaled by 1/n; the host algorithms scale each input by 1/n first.
//!
//! The first call on a communicator binds it to the device of its buffers (as an NCCL
//! communicator is bound to one device); the first collective (not a send or a receive, which
//! only two ranks make) sets the path up, collectively, so every rank makes it at the same
//! point; what was chosen and why is logged at INFO (target `toroid::gpu`).
//!
//! **Asynchronous for the host on the IPC path** ([`on_stream_async`]). The call records an
//! event on the caller's stream (its input is ready there) and queues the collective on the
//! communicator's queue, so it keeps its place in issue order among every other call, on every
//! rank; it returns at once with a work. The communicator's worker thread runs the collective
//! in a hook of that queued job: its own stream waits for the event, the protocol of
//! [`super::ipc`] runs there with the meetings made directly on the engine (the job holds the
//! queue; [`super::host_comm::Meet`]), and the stream is synchronised before the work completes. A failure fails the
//! communicator with the error, as a failed host collective does, and the work reports it.
//! The caller's stream is **not** made to wait for the collective: the output is ready once
//! the work has completed (wait on it before reading the output or writing either buffer). A
//! wait on the device (a stream memory operation on a counter the worker sets) was tried and
//! dropped: it deadlocked in a test with 3 ranks as threads on an H200, most likely because a
//! caller's stream and toroid's stream shared one of the device's hardware queues, where the
//! blocked wait holds the work that would release it. Ordering the caller's stream after the collective needs the
//! whole collective enqueued at call time, with the ranks meeting on the device instead of
//! the host (NCCL's design); not built. At most [`IN_FLIGHT`] calls are in flight (one event
//! each). The staged path stays blocking.
//!
//! The arguments are checked by the communicator's argument check ([`HostComm::check`]), the
//! one every call on it goes through; this module only picks the path and runs.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::cuda::{self, CudaContext, CudaEvent, CudaStream};
use super::device::DeviceKernels;
use super::host_comm::{DeviceCall, HostComm, Meet};
use super::ipc::IpcWindows;
use super::ordered::Ordered;
use super::staged::DeviceCollectives;
use crate::collective::OpKind;
use crate::dtype::DataType;
use crate::error::{Error, Result};

/// Collectives on the IPC path in flight at most per communicator (one event each).
pub const IN_FLIGHT: usize = 32;

/// The IPC path's windows and the stream its collectives run on (toroid's own).
#[derive(Debug)]
struct IpcRun {
    windows: IpcWindows,
    stream: Arc<CudaStream>,
}

/// The stream-ordered path: the kernels and the windows they read. Dropping it waits (bounded)
/// for the last kernel; one that does not end keeps both alive for the process's life, since
/// unmapping memory a kernel still touches would fault the device.
#[derive(Debug)]
struct OrderedRun {
    ordered: ManuallyDrop<Ordered>,
    windows: ManuallyDrop<IpcWindows>,
}

impl Drop for OrderedRun {
    fn drop(&mut self) {
        if self.ordered.quiesce() {
            // SAFETY: each is dropped once, here, and never used again.
            unsafe {
                ManuallyDrop::drop(&mut self.ordered);
                ManuallyDrop::drop(&mut self.windows);
            }
        } else {
            tracing::warn!(target: "toroid::gpu",
                "a collective on device memory did not end: its device windows stay mapped (leaked)");
        }
    }
}

/// The path a communicator's collectives on device memory take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePath {
    /// Enqueued on the caller's stream, one kernel per call, the ranks meeting on the device
    /// (CUDA IPC between processes of one host: [`super::ordered`]).
    Ordered,
    /// CUDA IPC between the ranks of one host, reduced on the GPU, driven by the host.
    Ipc,
    /// Staged through pinned host memory.
    Staged,
}

/// Where a communicator's collectives on device memory run: chosen by the first collective
/// (sends and receives do not choose), then fixed.
#[derive(Debug)]
enum Route {
    Unchosen,
    Staged,
    Ipc(Arc<Mutex<IpcRun>>),
    Ordered(Box<OrderedRun>),
}

/// A communicator's device, staging and (when it runs) IPC path.
#[derive(Debug)]
pub struct DeviceState {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    staging: DeviceCollectives,
    route: Route,
    /// The sequence number of the last IPC collective that completed.
    done: Arc<AtomicU64>,
    /// "The input is ready on the caller's stream", one per call in flight.
    ready: Arc<Vec<CudaEvent>>,
    /// IPC collectives issued (the last sequence number).
    issued: u64,
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
    /// A communicator's device state on device `ordinal`: the context, the staging buffers and
    /// the events; the path is chosen later, by the first collective ([`Self::choose_path`]).
    /// Not collective, so a send or a receive may come first.
    fn new(ordinal: usize) -> Result<DeviceState> {
        let ctx = cuda::open_device(ordinal)?;
        let staging = DeviceCollectives::new(ctx.clone())?;
        let done = Arc::new(AtomicU64::new(0));
        let ready =
            Arc::new((0..IN_FLIGHT).map(|_| cuda::new_event(&ctx, false)).collect::<Result<Vec<_>>>()?);
        Ok(DeviceState { ordinal, ctx, staging, route: Route::Unchosen, done, ready, issued: 0 })
    }

    /// Chooses the path, once, at the first collective on device memory (every rank makes that
    /// same call, so every rank gets here at the same point): collective when the ranks share a
    /// host (the device windows are made and their handles exchanged).
    fn choose_path(&mut self, comm: &impl HostComm) -> Result<()> {
        if !matches!(self.route, Route::Unchosen) {
            return Ok(());
        }
        let ordinal = self.ordinal;
        let one_host = comm.hosts() == 1;
        let ipc = if one_host && comm.size() > 1 {
            match IpcWindows::open(comm, &self.ctx, ordinal, comm.cuda_ipc(), || kernels_for(ordinal)) {
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
                comm.hosts());
        }
        self.route = match ipc {
            Some(windows) => match self.ordered(comm, &windows)? {
                Some(ordered) => {
                    tracing::info!(target: "toroid::gpu", rank = comm.rank(),
                        "device collectives on device {ordinal}: enqueued on the caller's stream (one process per rank)");
                    Route::Ordered(Box::new(OrderedRun {
                        ordered: ManuallyDrop::new(ordered),
                        windows: ManuallyDrop::new(windows),
                    }))
                }
                None => {
                    let stream = cuda::new_stream(&self.ctx)?;
                    Route::Ipc(Arc::new(Mutex::new(IpcRun { windows, stream })))
                }
            },
            None => Route::Staged,
        };
        Ok(())
    }

    /// The stream-ordered path over `windows`, when every rank can take it (each its own
    /// process, `TOROID_CUDA_ORDERED` not off, its parts made): collective, the same answer
    /// on every rank.
    fn ordered(&self, comm: &impl HostComm, windows: &IpcWindows) -> Result<Option<Ordered>> {
        let mine = if windows.separate_processes() && comm.cuda_ordered() {
            Ordered::new(&self.ctx, windows, comm.timeout()).map_err(|e| {
                tracing::info!(target: "toroid::gpu", rank = comm.rank(), "no stream-ordered path: {e}");
            })
        } else {
            Err(())
        };
        // Every rank takes it or none does, with the same most blocks per launch.
        let mut agreed = [u32::from(mine.is_ok()), mine.as_ref().map_or(0, Ordered::max_blocks)];
        let as_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut agreed);
        comm.run_bytes(OpKind::AllReduce(crate::dtype::ReduceOp::Min), DataType::U32, None, Some(as_bytes))?;
        Ok(match mine {
            Ok(mut o) if agreed[0] == 1 => {
                o.limit_blocks(agreed[1]);
                Some(o)
            }
            _ => None,
        })
    }

    /// Makes every kernel of the stream-ordered path that is waiting end (an abort).
    pub fn abort(&self) {
        if let Route::Ordered(run) = &self.route {
            run.ordered.abort();
        }
    }

    /// The path this state's collectives take; `None` before the first collective.
    pub fn path(&self) -> Option<DevicePath> {
        match self.route {
            Route::Unchosen => None,
            Route::Staged => Some(DevicePath::Staged),
            Route::Ipc(_) => Some(DevicePath::Ipc),
            Route::Ordered(_) => Some(DevicePath::Ordered),
        }
    }
}

/// The path `comm`'s collectives on device memory take; `None` before the first one.
pub fn path(comm: &impl HostComm) -> Option<DevicePath> {
    comm.device_state().lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(DeviceState::path)
}

/// Whether the device windows run `kind` (on the IPC path): all-reduce, broadcast, all-gather
/// and reduce-scatter do; every other kind is staged on either path.
fn on_windows(kind: OpKind) -> bool {
    matches!(kind, OpKind::AllReduce(_) | OpKind::Broadcast(_) | OpKind::AllGather | OpKind::ReduceScatter(_))
}

/// The path a call of `kind` on `comm`'s device memory takes: [`path`] for the kinds that path
/// runs, [`DevicePath::Staged`] for the others; `None` before the first collective chose the
/// path.
pub fn route_of(comm: &impl HostComm, kind: OpKind) -> Option<DevicePath> {
    path(comm).map(|p| match p {
        DevicePath::Ordered if super::ordered::runs(kind) => p,
        DevicePath::Ipc if on_windows(kind) => p,
        _ => DevicePath::Staged,
    })
}

/// What a C caller asks: `kind` (an all-reduce, a broadcast, an all-gather, a reduce-scatter,
/// a reduce, an all-to-all, a send or a receive) of `count` elements of `dtype` (per rank: an
/// all-gather's sendcount, a reduce-scatter's recvcount, an all-to-all's count per rank) from
/// device memory `send` into device memory `recv` (in place: the same pointer, or NCCL's forms
/// for all-gather and reduce-scatter), ordered on the CUDA stream `stream` (a
/// `CUstream`/`cudaStream_t` of the buffers' device's primary context; NULL: the legacy default
/// stream). Blocking for the host: the result is in `recv` when it returns. A send uses only
/// `send`, a receive only `recv`, a reduce's non-root only `send` (the other may be anything,
/// NULL included). Reduce, all-to-all, send and receive are staged on either path (the device
/// windows run the other four).
///
/// Without CUDA: `Unsupported` ("CUDA is not available ..."); pointers that are not device
/// memory of one device, or of another device than the communicator's first such call,
/// overlapping buffers other than the in-place forms, a root or peer out of range:
/// `InvalidArgument`.
///
/// # Safety
/// The buffers this rank uses are valid for their sizes on their device until the call returns and
/// nothing else uses them meanwhile; `stream` is NULL or a live stream of that device's primary
/// context.
pub unsafe fn on_stream<C: HostComm>(
    comm: &C,
    kind: OpKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let call = DeviceCall { kind, dtype, count, send, recv };
    // SAFETY: forwarded contract; the buffers stay valid until this returns.
    unsafe { issue(comm, &call, stream, false) }.map(drop)
}

/// [`on_stream`], asynchronous for the host on the IPC path: returns once the collective is
/// queued, with the work that completes when it has; the input is read after the work queued
/// on `stream` before the call, and the output is ready when the work has completed (`stream`
/// is not made to wait for it). `None`: the call already completed (the staged path, or
/// nothing to do).
///
/// # Safety
/// As [`on_stream`], the buffers valid and neither read nor written by anything else until the
/// work completes (or, for `None`, until the call returns); `stream` live until then.
pub unsafe fn on_stream_async<C: HostComm>(
    comm: &C,
    kind: OpKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    stream: *mut std::ffi::c_void,
) -> Result<Option<C::Work>> {
    let call = DeviceCall { kind, dtype, count, send, recv };
    // SAFETY: forwarded contract.
    unsafe { issue(comm, &call, stream, true) }
}

/// [`on_stream_async`] (`queue`) or [`on_stream`] (the IPC collective runs where the
/// communicator's blocking calls run: on this thread when nothing is queued).
///
/// # Safety
/// As [`on_stream_async`].
unsafe fn issue<C: HostComm>(
    comm: &C,
    call: &DeviceCall,
    stream: *mut std::ffi::c_void,
    queue: bool,
) -> Result<Option<C::Work>> {
    super::driver_available()?;
    let Some(ordinal) = comm.check(call)? else { return Ok(None) };
    let mut slot = comm.device_state().lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        *slot = Some(DeviceState::new(ordinal)?);
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
    let stream = unsafe { cuda::borrow_stream(&st.ctx, stream) };
    let DeviceCall { kind, dtype, count, send, recv } = *call;
    if !matches!(kind, OpKind::Send(_) | OpKind::Recv(_)) {
        st.choose_path(comm)?;
    }
    if let Route::Ordered(run) = &st.route
        && super::ordered::runs(kind)
    {
        // SAFETY: forwarded contract: the buffers stay valid until the stream has run the
        // kernel (NCCL's contract), the stream is the caller's, of this context.
        return match unsafe { run.ordered.enqueue(&stream, call) } {
            Ok(()) => Ok(None),
            Err(e) => Err(comm.meet().fail(e)),
        };
    }
    if matches!(st.route, Route::Ipc(_)) && on_windows(kind) {
        // SAFETY: forwarded contract.
        return unsafe { st.queue_ipc(comm, &stream, call, queue) };
    }
    // The staged path, blocking (on the caller's thread, after the queued work); on a
    // communicator with IPC, the kinds the device windows do not run (the same on every rank).
    let staging = &mut st.staging;
    // SAFETY (each): forwarded contract (sizes and overlaps checked); a send and a non-root's
    // reduce use only `send`, a receive only `recv`.
    unsafe {
        match kind {
            OpKind::AllGather | OpKind::ReduceScatter(_) | OpKind::AllToAll => {
                staging.gathered(comm, &stream, call)?
            }
            OpKind::Send(_) => staging.outbound(comm, &stream, send, count, dtype, kind)?,
            OpKind::Reduce(_, root) if root != comm.rank() => {
                staging.outbound(comm, &stream, send, count, dtype, kind)?
            }
            OpKind::Recv(_) => staging.inbound(comm, &stream, recv, count, dtype, kind)?,
            _ => {
                if send != recv {
                    // Both ranges are valid device memory of `bytes` bytes.
                    cuda::copy_dtod(&stream, recv, send, call.bytes(), "copying sendbuf to recvbuf")?;
                }
                staging.staged(comm, &stream, recv, count, dtype, kind)?
            }
        }
    }
    Ok(None)
}

impl DeviceState {
    /// Queues `call` on the IPC path (see the module's documentation), or with `queue` false
    /// runs it as a blocking call of the communicator and returns `None` once it has.
    ///
    /// # Safety
    /// As [`on_stream_async`]; `stream` is the caller's.
    unsafe fn queue_ipc<C: HostComm>(
        &mut self,
        comm: &C,
        stream: &Arc<CudaStream>,
        call: &DeviceCall,
        queue: bool,
    ) -> Result<Option<C::Work>> {
        let Route::Ipc(ipc) = &self.route else { return Err(Error::Internal("no IPC path".into())) };
        let ipc = ipc.clone();
        let seq = self.issued + 1;
        // The event of call seq - IN_FLIGHT is reused: that call must have completed.
        if seq > IN_FLIGHT as u64 {
            let need = seq - IN_FLIGHT as u64;
            let deadline = Instant::now() + comm.timeout();
            let mut nap = Duration::from_micros(2);
            while self.done.load(Ordering::Acquire) < need {
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
        cuda::record(&self.ready[slot], stream)?;
        let (ready, done, meet, call) = (self.ready.clone(), self.done.clone(), comm.meet(), *call);
        let job = move || {
            let mut run = ipc.lock().unwrap_or_else(|e| e.into_inner());
            let IpcRun { windows, stream } = &mut *run;
            let result = cuda::wait_stream(stream, &ready[slot], "waiting for the input").and_then(|()| {
                // SAFETY: the caller keeps the buffers valid until this work completes (checked
                // sizes and overlaps); the stream is of the windows' context.
                unsafe { windows.run(&meet, stream, &call) }
            });
            // Also after a failure: nothing may write the caller's memory once its stream runs on.
            let synced = cuda::sync(stream);
            done.store(seq, Ordering::Release);
            if let Err(e) = result.and(synced) {
                // The communicator fails with it: the job's own step and every later call
                // report it, on every rank (the links close).
                meet.fail(e);
            }
        };
        // The job's own operation is a barrier after the hook: the work completes once every
        // rank has finished the collective.
        if !queue {
            // SAFETY: the caller keeps the buffers valid until this returns.
            let r = unsafe { comm.run_job(Box::new(job)) };
            // (Issued if the hook ran: a call refused before it never sets the counter.)
            self.issued = self.issued.max(self.done.load(Ordering::Acquire));
            return r.map(|()| None);
        }
        // SAFETY: the job touches the caller's buffers, which the caller keeps valid until the
        // work completes (this function's contract).
        let work = unsafe { comm.submit_job(Box::new(job)) }?;
        self.issued = seq;
        Ok(Some(work))
    }
}
