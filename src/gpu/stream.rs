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

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;

use super::device::DeviceKernels;
use super::ipc::IpcWindows;
use super::staged::{DeviceCollectives, device_of};
use super::{driver_err, guard};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use crate::{Communicator, OpKind};

/// The path a communicator's collectives on device memory take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePath {
    /// CUDA IPC between the ranks of one host, reduced on the GPU.
    Ipc,
    /// Staged through pinned host memory.
    Staged,
}

/// A communicator's device, staging and (when it runs) IPC windows.
#[derive(Debug)]
pub struct DeviceState {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    staging: DeviceCollectives,
    ipc: Option<IpcWindows>,
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
        Ok(DeviceState { ordinal, ctx, staging, ipc })
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
/// stream). Blocking for the host.
///
/// Without CUDA: `Unsupported` ("CUDA is not available ..."); pointers that are not device
/// memory of one device, or of another device than the communicator's first such call:
/// `InvalidArgument`.
///
/// # Safety
/// `send` and `recv` are valid for `count` elements of `dtype` on their device until the call
/// returns and nothing else uses them meanwhile; `stream` is NULL or a live stream of that
/// device's primary context.
pub unsafe fn on_stream(
    comm: &Communicator,
    kind: OpKind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    super::driver_available()?;
    let (n, es) = (comm.size(), dtype.size());
    let overflow = || Error::InvalidArgument(format!("{n} x {count} elements of {dtype} overflow").into());
    let bytes = count.checked_mul(es).ok_or_else(overflow)?;
    let all = bytes.checked_mul(n).ok_or_else(overflow)?;
    if count == 0 {
        return Ok(());
    }
    // The buffers' sizes, and which overlaps are the in-place forms (NCCL's, and for a
    // reduce-scatter the result at the front of sendbuf).
    let mine = (comm.rank() * bytes) as u64;
    let (send_len, recv_len, in_place) = match kind {
        OpKind::AllGather => (bytes, all, send == recv.wrapping_add(mine)),
        OpKind::ReduceScatter(_) => (all, bytes, recv == send || recv == send.wrapping_add(mine)),
        _ => (bytes, bytes, send == recv),
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
    if let Some(ipc) = &mut st.ipc {
        // SAFETY (each): forwarded contract (sizes and overlaps checked above); the stream is
        // of the windows' context.
        let result = match kind {
            OpKind::AllReduce(op) => unsafe { ipc.all_reduce(comm, &stream, send, recv, count, dtype, op) },
            OpKind::Broadcast(root) => unsafe {
                ipc.broadcast(comm, &stream, send, recv, count, dtype, root)
            },
            OpKind::AllGather => unsafe { ipc.all_gather(comm, &stream, send, recv, count, dtype) },
            OpKind::ReduceScatter(op) => unsafe {
                ipc.reduce_scatter(comm, &stream, send, recv, count, dtype, op)
            },
            other => Err(Error::Unsupported(format!("{other:?} on device memory").into())),
        };
        // Also after a failure: nothing may still write the caller's memory once this returns.
        let synced = guard("synchronising", || stream.synchronize())?.map_err(driver_err("synchronising"));
        return result.and(synced);
    }
    if matches!(kind, OpKind::AllGather | OpKind::ReduceScatter(_)) {
        // SAFETY: forwarded contract (sizes and overlaps checked above).
        return unsafe { st.staging.gathered(comm, &stream, kind, send, recv, count, dtype) };
    }
    if !matches!(kind, OpKind::AllReduce(_) | OpKind::Broadcast(_)) {
        return Err(Error::Unsupported(format!("{kind:?} on device memory").into()));
    }
    if send != recv {
        guard("copying sendbuf to recvbuf", || {
            // SAFETY: both ranges are valid device memory of `bytes` bytes (the caller's promise).
            unsafe { cudarc::driver::result::memcpy_dtod_async(recv, send, bytes, stream.cu_stream()) }
        })?
        .map_err(driver_err("copying sendbuf to recvbuf"))?;
    }
    // SAFETY: forwarded contract, for `recv`.
    unsafe { st.staging.staged(comm, &stream, recv, count, dtype, kind) }
}
