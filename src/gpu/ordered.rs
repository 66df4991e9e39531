//! Collectives on device memory enqueued on the caller's stream (NCCL's contract): between ranks
//! of one host that are each their own process, an all-reduce, a broadcast, an all-gather, a
//! reduce-scatter, a reduce or an all-to-all is one kernel launched on the caller's stream
//! ([`super::ordered_kernels`]);
//! the call returns once it is launched. The kernels of the ranks meet through the flag
//! protocol of [`super::signal`] in their device windows' signal areas, so no chunk needs the
//! host, later work on the stream sees the result, the host never blocks, and the call can be
//! captured in a CUDA graph and replayed (the step counters live in device memory).
//!
//! **Errors, as NCCL's asynchronous errors.** A kernel whose wait passes the communicator's
//! timeout, or that finds another rank making another call (the fingerprint of kind, operation
//! or root, type and count differs), records the fault in a status word in page-locked host
//! memory and ends; the kernels of the other ranks then time out or see the same mismatch. The
//! host reads the word before every call ([`Ordered::fault`]): a fault fails the communicator
//! (every later call, and the other ranks through the links, report it) and is returned. An
//! abort sets the second status word, which every waiting kernel polls, so they end at once.
//!
//! **Why separate processes only.** Kernels that wait for each other must run at the same time.
//! Ranks of one process put their kernels on streams of one context, which may share one of the
//! device's hardware queues, where a waiting kernel holds back the very launch it waits for
//! (the deadlock [`super::stream`] describes for stream memory operations). Ranks that are
//! threads of one process keep the host-driven path ([`super::ipc`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::cuda::{self, CudaContext, CudaEvent, CudaFunction, CudaStream, Grid, HostMapped};
use super::host_comm::DeviceCall;
use super::ipc::{HALF, IpcWindows};
use super::ordered_kernels::{self as k, THREADS};
use super::signal::{self, Fault, MAX_BLOCKS, MAX_RANKS};

/// Bytes of a block's region of a window half (a step's chunk: `ordered_kernels`).
const REGION: usize = HALF / MAX_BLOCKS;
use crate::collective::OpKind;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

/// The argument of every ordered kernel (`TrArgs` in its source): same layout.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Args {
    /// This rank's input.
    pub input: u64,
    /// This rank's output.
    pub output: u64,
    /// Elements per rank (bytes for broadcast and all-gather).
    pub count: u64,
    /// Elements per chunk (per piece, for reduce-scatter).
    pub chunk: u64,
    /// Bytes of a window half.
    pub half: u64,
    /// The call's fingerprint.
    pub fp: u64,
    /// How long a wait may last.
    pub timeout_ns: u64,
    /// The status words (fault, abort), host memory mapped for the device.
    pub status: u64,
    /// Every rank's window, in this process.
    pub win: [u64; MAX_RANKS],
    /// Every rank's signal area, in this process.
    pub sig: [u64; MAX_RANKS],
    /// Scale of an average (1/n), when `scale` is 1.
    pub factor: f64,
    /// Ranks.
    pub nranks: i32,
    /// This rank.
    pub rank: i32,
    /// The root of a broadcast.
    pub root: i32,
    /// 1: scale the reduction by `factor`.
    pub scale: i32,
}

/// Which kinds the stream-ordered path runs (sends and receives are staged: only two ranks make
/// them, and the protocol's steps are every rank's).
pub fn runs(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::AllReduce(_)
            | OpKind::Broadcast(_)
            | OpKind::AllGather
            | OpKind::ReduceScatter(_)
            | OpKind::Reduce(..)
            | OpKind::AllToAll
    )
}

/// The ordered kernels of one device, by name.
#[derive(Debug)]
struct Functions {
    all_reduce: Vec<CudaFunction>,
    reduce_scatter: Vec<CudaFunction>,
    reduce: Vec<CudaFunction>,
    broadcast: CudaFunction,
    all_gather: CudaFunction,
    all_to_all: CudaFunction,
}

impl Functions {
    /// Loads the ordered kernels' module in `ctx` (compiled once per process).
    fn load(ctx: &Arc<CudaContext>) -> Result<Functions> {
        let module = cuda::load_module(ctx, super::ordered_ptx()?)?;
        let kernels = |name: &str| cuda::load_function(&module, name);
        let mut all_reduce = Vec::new();
        let mut reduce_scatter = Vec::new();
        let mut reduce = Vec::new();
        for &d in &super::kernels::TYPES {
            for &op in &super::kernels::OPS {
                all_reduce.push(kernels(&k::all_reduce_kernel(d, op))?);
                reduce_scatter.push(kernels(&k::reduce_scatter_kernel(d, op))?);
                reduce.push(kernels(&k::reduce_kernel(d, op))?);
            }
        }
        Ok(Functions {
            all_reduce,
            reduce_scatter,
            reduce,
            broadcast: kernels(k::BROADCAST)?,
            all_gather: kernels(k::ALL_GATHER)?,
            all_to_all: kernels(k::ALL_TO_ALL)?,
        })
    }

    /// The reduction kernel of `dtype` with `op` (avg: the sum's) from `table`.
    fn reduction(table: &[CudaFunction], dtype: DataType, op: ReduceOp) -> Result<&CudaFunction> {
        let op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let t = super::kernels::TYPES.iter().position(|&d| d == dtype);
        let o = super::kernels::OPS.iter().position(|&x| x == op);
        t.zip(o)
            .and_then(|(t, o)| table.get(t * super::kernels::OPS.len() + o))
            .ok_or_else(|| Error::Internal(format!("no ordered kernel for {op:?} of {dtype}").into()))
    }
}

/// Which ordered kernel a call launches (the reductions by type and op: avg launches the sum's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    AllReduce(DataType, ReduceOp),
    ReduceScatter(DataType, ReduceOp),
    Reduce(DataType, ReduceOp),
    Broadcast,
    AllGather,
    AllToAll,
}

/// The kernel and argument of `call` on rank `rank` of the ranks whose windows are at `ptrs`
/// (each followed by its signal area), with the status words at `status` (a device address)
/// and waits bounded by `timeout`. Pure: the same call gives the same grid-independent argument
/// on every rank but for its own buffers and rank.
fn plan(
    call: &DeviceCall,
    ptrs: &[u64],
    rank: usize,
    status: u64,
    timeout: Duration,
) -> Result<(Kernel, Args)> {
    let n = ptrs.len();
    if n > MAX_RANKS || rank >= n {
        return Err(Error::Internal(
            format!("rank {rank} of {n}: the ordered path takes at most {MAX_RANKS}").into(),
        ));
    }
    let (es, d) = (call.dtype.size(), call.dtype);
    let mut a = Args {
        input: call.send,
        output: call.recv,
        count: call.count as u64,
        chunk: (REGION / es) as u64,
        half: HALF as u64,
        fp: 0,
        timeout_ns: timeout.as_nanos().min(u128::from(u64::MAX)) as u64,
        status,
        win: [0; MAX_RANKS],
        sig: [0; MAX_RANKS],
        factor: 0.0,
        nranks: n as i32,
        rank: rank as i32,
        root: 0,
        scale: 0,
    };
    for (r, p) in ptrs.iter().enumerate() {
        a.win[r] = *p;
        a.sig[r] = *p + super::ipc::WINDOW as u64;
    }
    let scale = |a: &mut Args, op: ReduceOp| -> Result<()> {
        if op == ReduceOp::Avg {
            if !d.is_float() {
                return Err(Error::Unsupported(format!("avg of {d}: averages take float types").into()));
            }
            a.scale = 1;
            a.factor = 1.0 / n as f64;
        }
        Ok(())
    };
    // Pieces of every rank in a region, each a multiple of 16 bytes (reduce-scatter, all-to-all).
    let piece = (REGION / n / 16) * 16;
    // (kernel, what the fingerprint adds to the type and count: kind and op or root).
    let (kernel, what) = match call.kind {
        OpKind::AllReduce(op) => {
            scale(&mut a, op)?;
            (Kernel::AllReduce(d, op), (1 << 32) | op as u64)
        }
        OpKind::ReduceScatter(op) => {
            scale(&mut a, op)?;
            a.chunk = (piece / es) as u64;
            (Kernel::ReduceScatter(d, op), (2 << 32) | op as u64)
        }
        OpKind::Reduce(op, root) => {
            scale(&mut a, op)?;
            a.root = root as i32;
            (Kernel::Reduce(d, op), (3 << 32) | (op as u64) << 16 | root as u64)
        }
        OpKind::Broadcast(root) => {
            a.root = root as i32;
            a.count = call.bytes() as u64;
            a.chunk = REGION as u64;
            (Kernel::Broadcast, (4 << 32) | root as u64)
        }
        OpKind::AllGather => {
            a.count = call.bytes() as u64;
            a.chunk = REGION as u64;
            (Kernel::AllGather, 5 << 32)
        }
        OpKind::AllToAll => {
            a.count = call.bytes() as u64;
            a.chunk = piece as u64;
            (Kernel::AllToAll, 6 << 32)
        }
        other => return Err(Error::Internal(format!("{other:?} is not an ordered collective").into())),
    };
    a.fp = signal::fingerprint([what, d as u64, call.count as u64, n as u64]);
    Ok((kernel, a))
}

/// The stream-ordered path of one communicator: where the windows are, the status words, the
/// kernels. Its owner keeps the [`IpcWindows`] it was made from and unmaps them only once
/// [`Ordered::quiesce`] says no kernel reads them any more.
#[derive(Debug)]
pub struct Ordered {
    /// Every rank's window (then its signal area, at [`super::ipc::WINDOW`]) in this process.
    ptrs: Vec<u64>,
    rank: usize,
    status: HostMapped,
    functions: Functions,
    /// Blocks a launch may have.
    max_blocks: u32,
    /// Recorded after every launch, so that [`Self::quiesce`] waits for the last kernel, and a
    /// call on another stream than the last one's runs after it.
    last: CudaEvent,
    /// The stream of the last launch (its address + 1; 0: none yet).
    last_stream: AtomicUsize,
    /// The communicator's timeout (how long `quiesce` lets the last kernel run, twice).
    timeout: Duration,
}

impl Ordered {
    /// The path over `windows` (set up by every rank: the same on all); `timeout` bounds every
    /// wait of its kernels.
    pub fn new(ctx: &Arc<CudaContext>, windows: &IpcWindows, timeout: Duration) -> Result<Ordered> {
        let (ptrs, rank) = (windows.ptrs(), windows.rank());
        if ptrs.len() > MAX_RANKS {
            return Err(Error::Unsupported(format!("{} ranks: at most {MAX_RANKS}", ptrs.len()).into()));
        }
        let functions = Functions::load(ctx)?;
        let status = HostMapped::new(ctx, 2)?;
        // The kernels of the ranks on one device must all be resident at once (block b of each
        // waits for block b of the others): the device's multiprocessors shared among them, at
        // most one block each.
        let sms = cuda::multiprocessor_count(ctx)? as usize;
        let max_blocks = (sms / windows.ranks_on_device()).clamp(1, MAX_BLOCKS) as u32;
        let last = cuda::new_event(ctx, false)?;
        Ok(Ordered {
            ptrs,
            rank,
            status,
            functions,
            max_blocks,
            last,
            last_stream: AtomicUsize::new(0),
            timeout,
        })
    }

    /// The fault a kernel recorded, as an error (`None`: none).
    pub fn fault(&self) -> Option<Error> {
        let (w, timeout) = (self.status.load(0), self.timeout);
        if w == 0 {
            return None;
        }
        Some(match Fault::from_word(w) {
            Some(Fault::Timeout { peer }) => Error::Timeout(
                format!("a collective on device memory waited more than {timeout:?} for rank {peer} (on the device)")
                    .into(),
            ),
            Some(Fault::Mismatch { peer }) => Error::InvalidUsage(
                format!(
                    "collectives on device memory: rank {peer} made another call (kind, operation or root, type \
                     or count differ)"
                )
                .into(),
            ),
            _ => Error::Internal(format!("a collective on device memory ended with status {w:#x}").into()),
        })
    }

    /// Blocks a launch may have (at most one per multiprocessor of this device).
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// Lowers the blocks a launch may have to `blocks` (what every rank agreed on: the ranks'
    /// launches of one call must have the same grid).
    pub fn limit_blocks(&mut self, blocks: u32) {
        self.max_blocks = self.max_blocks.min(blocks).max(1);
    }

    /// Makes every waiting kernel end (abort).
    pub fn abort(&self) {
        self.status.store(1, 1);
    }

    /// Waits until the last kernel launched has ended, so the windows it reads may go: it may
    /// still be waiting for its peers (the caller destroys the communicator before its stream
    /// ran it), so it gets the communicator's timeout, then is made to end (abort) and gets as
    /// long again (it could sit behind other work on its stream). False when it has not ended
    /// by then: the owner must then keep the windows mapped (leak them) rather than unmap memory
    /// a kernel may still touch.
    pub fn quiesce(&self) -> bool {
        let idle = |deadline: Instant| {
            let mut nap = Duration::from_micros(50);
            while !cuda::is_complete(&self.last) {
                if Instant::now() > deadline {
                    return false;
                }
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(10));
            }
            true
        };
        if idle(Instant::now() + self.timeout) {
            return true;
        }
        self.abort();
        idle(Instant::now() + self.timeout)
    }

    /// The launch of `call`: its kernel and argument.
    fn prepare(&self, call: &DeviceCall) -> Result<(&CudaFunction, Args, u64)> {
        let (kernel, args) = plan(call, &self.ptrs, self.rank, self.status.device_ptr(), self.timeout)?;
        let f = match kernel {
            Kernel::AllReduce(d, op) => Functions::reduction(&self.functions.all_reduce, d, op)?,
            Kernel::ReduceScatter(d, op) => Functions::reduction(&self.functions.reduce_scatter, d, op)?,
            Kernel::Reduce(d, op) => Functions::reduction(&self.functions.reduce, d, op)?,
            Kernel::Broadcast => &self.functions.broadcast,
            Kernel::AllGather => &self.functions.all_gather,
            Kernel::AllToAll => &self.functions.all_to_all,
        };
        Ok((f, args, call.bytes() as u64))
    }

    /// Blocks of a launch moving `bytes` per rank: one per 64 KiB, at most the device's
    /// multiprocessors over the ranks sharing it (the ranks' kernels must all fit at once). The
    /// same on every rank making the same call.
    fn blocks(&self, bytes: u64) -> u32 {
        (bytes.div_ceil(64 << 10).min(u64::from(u32::MAX)) as u32).clamp(1, self.max_blocks)
    }

    /// Enqueues `call` on `stream` and returns.
    ///
    /// # Safety
    /// `call`'s buffers are device memory of this context valid for its sizes (as the argument
    /// check accepted them) until the stream has run the kernel; `stream` is a live stream of
    /// this context.
    pub unsafe fn enqueue(&self, stream: &CudaStream, call: &DeviceCall) -> Result<()> {
        if let Some(e) = self.fault() {
            return Err(e);
        }
        if call.count == 0 {
            return Ok(());
        }
        let (f, args, bytes) = self.prepare(call)?;
        let grid = Grid { blocks: self.blocks(bytes), threads: THREADS };
        // The calls of a communicator run in issue order, also across streams (as NCCL's): a
        // call on another stream waits for the last one's kernel. Not while a graph is being
        // captured: a capture cannot wait for work outside it (ordering inside it is the
        // capture's), and an event recorded into it is the graph's, not this launch's.
        let capturing = cuda::is_capturing(stream);
        let raw = (cuda::raw_stream(stream) as usize).wrapping_add(1); // (the NULL stream too is not 0)
        if !capturing {
            let before = self.last_stream.swap(raw, Ordering::Relaxed);
            if before != 0 && before != raw {
                cuda::wait_stream(stream, &self.last, "waiting for the communicator's last collective")?;
            }
        }
        // SAFETY: `f` takes one `TrArgs` (this layout); the buffers are valid as the caller
        // says; the windows and signal areas are every rank's, mapped by the owner's
        // IpcWindows, unmapped only once `quiesce` saw the last kernel end (else leaked, with
        // `self` and its status words: the owner's Drop).
        unsafe { cuda::launch_args(stream, f, grid, &args) }?;
        if capturing { Ok(()) } else { cuda::record(&self.last, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(kind: OpKind, dtype: DataType, count: usize) -> DeviceCall {
        DeviceCall { kind, dtype, count, send: 0x1000, recv: 0x2000 }
    }

    fn planned(kind: OpKind, dtype: DataType, count: usize, n: usize) -> (Kernel, Args) {
        let ptrs: Vec<u64> = (0..n as u64).map(|r| (r + 1) << 32).collect();
        plan(&call(kind, dtype, count), &ptrs, n - 1, 0x77, Duration::from_secs(2)).expect("a plan")
    }

    #[test]
    fn every_kind_gets_its_kernel_chunks_that_fit_a_region_and_the_windows() {
        for n in [2, 3, 5, MAX_RANKS] {
            let (k, a) = planned(OpKind::AllReduce(ReduceOp::Avg), DataType::BF16, 1000, n);
            assert_eq!(k, Kernel::AllReduce(DataType::BF16, ReduceOp::Avg));
            assert_eq!((a.chunk * 2, a.count, a.scale, a.factor), (REGION as u64, 1000, 1, 1.0 / n as f64));
            assert_eq!(
                (a.nranks, a.rank, a.status, a.timeout_ns),
                (n as i32, n as i32 - 1, 0x77, 2_000_000_000)
            );
            for r in 0..n {
                assert_eq!(a.win[r], (r as u64 + 1) << 32);
                assert_eq!(a.sig[r], a.win[r] + super::super::ipc::WINDOW as u64);
            }
            // n pieces of a region, each 16-byte aligned.
            let (_, a) = planned(OpKind::ReduceScatter(ReduceOp::Sum), DataType::F64, 7, n);
            assert!(
                a.chunk * 8 * n as u64 <= REGION as u64 && (a.chunk * 8).is_multiple_of(16) && a.chunk > 0
            );
            let (k, a) = planned(OpKind::AllToAll, DataType::I32, 7, n);
            assert_eq!((k, a.count), (Kernel::AllToAll, 28));
            assert!(a.chunk * n as u64 <= REGION as u64 && a.chunk.is_multiple_of(16) && a.chunk > 0);
            let (k, a) = planned(OpKind::Broadcast(1), DataType::F16, 5, n);
            assert_eq!((k, a.count, a.chunk, a.root), (Kernel::Broadcast, 10, REGION as u64, 1));
            let (k, a) = planned(OpKind::Reduce(ReduceOp::Max, 0), DataType::U8, 5, n);
            assert_eq!((k, a.count, a.scale), (Kernel::Reduce(DataType::U8, ReduceOp::Max), 5, 0));
        }
    }

    #[test]
    fn calls_that_differ_differ_in_fingerprint_and_the_rest_is_refused() {
        let fp = |kind, dtype, count| planned(kind, dtype, count, 3).1.fp;
        let base = fp(OpKind::AllReduce(ReduceOp::Sum), DataType::F32, 64);
        assert_eq!(base, fp(OpKind::AllReduce(ReduceOp::Sum), DataType::F32, 64));
        for other in [
            fp(OpKind::AllReduce(ReduceOp::Max), DataType::F32, 64),
            fp(OpKind::AllReduce(ReduceOp::Sum), DataType::I32, 64),
            fp(OpKind::AllReduce(ReduceOp::Sum), DataType::F32, 65),
            fp(OpKind::ReduceScatter(ReduceOp::Sum), DataType::F32, 64),
            fp(OpKind::Reduce(ReduceOp::Sum, 0), DataType::F32, 64),
            fp(OpKind::Reduce(ReduceOp::Sum, 1), DataType::F32, 64),
            fp(OpKind::Broadcast(0), DataType::F32, 64),
            fp(OpKind::AllGather, DataType::F32, 64),
            fp(OpKind::AllToAll, DataType::F32, 64),
        ] {
            assert_ne!(other, base);
        }
        let ptrs = [1u64 << 32, 2 << 32];
        let t = Duration::from_secs(1);
        let avg_int = call(OpKind::AllReduce(ReduceOp::Avg), DataType::I32, 4);
        assert!(matches!(plan(&avg_int, &ptrs, 0, 0, t), Err(Error::Unsupported(_))));
        assert!(plan(&call(OpKind::Barrier, DataType::U8, 0), &ptrs, 0, 0, t).is_err());
        assert!(plan(&call(OpKind::AllGather, DataType::U8, 1), &ptrs, 2, 0, t).is_err());
        for kind in [OpKind::Send(1), OpKind::Recv(0), OpKind::Barrier] {
            assert!(!runs(kind));
        }
    }

    #[test]
    fn the_argument_has_the_kernels_layout() {
        // A region holds a piece of every rank for a reduce-scatter, 16-byte aligned.
        const { assert!(REGION / MAX_RANKS >= 16 && REGION.is_multiple_of(16)) };
        // Eight words, two tables of MAX_RANKS words, a double and four ints, no padding.
        assert_eq!(std::mem::size_of::<Args>(), 8 * 8 + 2 * MAX_RANKS * 8 + 8 + 4 * 4);
        assert_eq!(std::mem::offset_of!(Args, win), 64);
        assert_eq!(std::mem::offset_of!(Args, factor), 64 + 2 * MAX_RANKS * 8);
    }
}
