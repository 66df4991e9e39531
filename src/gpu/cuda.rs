//! The one place that calls `cudarc` (tests/layers.rs checks it): memory, streams, events,
//! contexts, pointer attributes, IPC handles, NVRTC, loading modules and launching kernels.
//! Each call runs behind [`guard`] (a panic inside cudarc becomes an error, none crosses into
//! a caller or the C ABI) and maps a driver error to this crate's error, naming what was being
//! done, once, here. The rest of `gpu` speaks these functions and types.
//!
//! Functions on raw device addresses are `unsafe`: the driver cannot tell whether an address
//! range belongs to the caller, so each states the ranges it needs valid.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::sys::{self as cu, CUresult};
pub use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, PinnedHostSlice};

use crate::error::{Error, Result};

/// Runs `f`, a call into cudarc, turning a panic into [`Error::Unsupported`] that names `what`.
pub fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = crate::error::panic_message(&*p).unwrap_or("a panic");
        Error::Unsupported(format!("{what}: CUDA failed: {msg}").into())
    })
}

/// A driver error as this crate's error, naming what was being done.
pub(crate) fn driver_err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::System(format!("CUDA: {what}: {e:?}").into())
}

/// Runs the driver call `f` behind [`guard`], mapping its error with [`driver_err`]; both name
/// `what`.
fn call<T>(
    what: &'static str,
    f: impl FnOnce() -> std::result::Result<T, cudarc::driver::DriverError>,
) -> Result<T> {
    guard(what, f)?.map_err(driver_err(what))
}

/// The device ordinal of the memory `ptr` points into (`cuPointerGetAttribute`: memory type
/// device); `None` for host memory, and on a machine without CUDA.
pub fn device_of(ptr: u64) -> Option<usize> {
    use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute, cuPointerGetAttribute};
    super::driver_available().ok()?;
    guard("reading a pointer's attributes", || {
        cudarc::driver::result::init().ok()?;
        let (mut kind, mut ordinal): (u32, i32) = (0, -1);
        // SAFETY: each destination is a live value of the size its attribute is written as (an
        // unsigned int, an int); any `ptr` value is allowed (an unknown one is an error).
        let ok = unsafe {
            cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            ) == CUresult::CUDA_SUCCESS
                && kind == CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
                && cuPointerGetAttribute(
                    (&mut ordinal as *mut i32).cast(),
                    CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                ) == CUresult::CUDA_SUCCESS
        };
        (ok && ordinal >= 0).then_some(ordinal as usize)
    })
    .ok()
    .flatten()
}

/// The primary context of device `ordinal` (the one the CUDA runtime and torch use).
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    call("opening the device", || CudaContext::new(ordinal))
}

/// A new stream of `ctx`.
pub fn new_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    call("creating a stream", || ctx.new_stream())
}

/// The caller's stream `raw` (a `CUstream`/`cudaStream_t`; NULL: the legacy default stream) as
/// a stream of `ctx`, not destroyed when dropped.
///
/// # Safety
/// `raw` is NULL or a live stream of `ctx`, kept alive by the caller while the result is used.
pub unsafe fn borrow_stream(ctx: &Arc<CudaContext>, raw: *mut std::ffi::c_void) -> Arc<CudaStream> {
    // SAFETY: forwarded contract.
    unsafe { ctx.wrap_borrowed_stream(raw.cast()) }
}

/// A new event of `ctx`; `timing` false: without timing (cheaper to record and wait for).
pub fn new_event(ctx: &Arc<CudaContext>, timing: bool) -> Result<CudaEvent> {
    let flags = (!timing).then_some(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING);
    call("creating an event", || ctx.new_event(flags))
}

/// Records `event` on `stream` (it completes once everything queued before it has run).
pub fn record(event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    call("recording an event", || event.record(stream))
}

/// Waits on the host until `event` has completed (`what`: what the host waits for).
pub fn wait_host(event: &CudaEvent, what: &'static str) -> Result<()> {
    call(what, || event.synchronize())
}

/// Whether `event` has completed (an error reads as completed: nothing more will come of it).
pub fn is_complete(event: &CudaEvent) -> bool {
    guard("querying an event", || event.is_complete()).unwrap_or(true)
}

/// Makes `stream` wait for `event` (`what`: what it waits for).
pub fn wait_stream(stream: &CudaStream, event: &CudaEvent, what: &'static str) -> Result<()> {
    call(what, || stream.wait(event))
}

/// Waits until everything queued on `stream` has run.
pub fn sync(stream: &CudaStream) -> Result<()> {
    call("synchronising", || stream.synchronize())
}

/// `stream` as the driver's raw handle (a `CUstream`/`cudaStream_t`, what the C entry points
/// and [`super::stream::on_stream`] take).
pub fn raw_stream(stream: &CudaStream) -> *mut std::ffi::c_void {
    stream.cu_stream() as *mut std::ffi::c_void
}

/// Whether `stream` is being captured into a CUDA graph (an error reads as not captured).
pub fn is_capturing(stream: &CudaStream) -> bool {
    guard("asking whether a stream is captured", || {
        let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a live value the driver writes; the stream is live (borrowed).
        let r = unsafe { cu::cuStreamIsCapturing(stream.cu_stream(), &mut status) };
        r == CUresult::CUDA_SUCCESS && status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    })
    .unwrap_or(false)
}

/// Queues `dst <- src`, `bytes` bytes of device memory, on `stream` (`what`: what is copied).
///
/// # Safety
/// `dst` and `src` are device memory valid for `bytes` bytes until `stream` has run the copy,
/// not overlapping, and `dst` written by nothing else meanwhile.
pub unsafe fn copy_dtod(
    stream: &CudaStream,
    dst: u64,
    src: u64,
    bytes: usize,
    what: &'static str,
) -> Result<()> {
    // SAFETY: forwarded contract.
    call(what, || unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) })
}

/// Queues `host <- src` (device memory, `host.len()` bytes) on `stream`.
///
/// # Safety
/// `src` is device memory valid for `host.len()` bytes, and `host` (page-locked) is neither
/// read nor freed until `stream` has run the copy.
pub unsafe fn copy_dtoh(stream: &CudaStream, host: &mut [u8], src: u64) -> Result<()> {
    // SAFETY: forwarded contract.
    call("copying to the host", || unsafe {
        cudarc::driver::result::memcpy_dtoh_async(host, src, stream.cu_stream())
    })
}

/// Queues `dst <- host` (device memory, `host.len()` bytes) on `stream`.
///
/// # Safety
/// `dst` is device memory valid for `host.len()` bytes, written by nothing else, and `host`
/// (page-locked) is neither written nor freed until `stream` has run the copy.
pub unsafe fn copy_htod(stream: &CudaStream, dst: u64, host: &[u8]) -> Result<()> {
    // SAFETY: forwarded contract.
    call("copying to the device", || unsafe {
        cudarc::driver::result::memcpy_htod_async(dst, host, stream.cu_stream())
    })
}

/// Page-locked host memory of one context, freed when dropped.
#[derive(Debug)]
pub struct Pinned(PinnedHostSlice<u8>);

impl Pinned {
    /// `bytes` of page-locked memory of `ctx`, cached (not write-combined: the host reads it).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Pinned> {
        // SAFETY: page-locked host memory of `bytes`; its contents are only read after a copy
        // into it completed (or are overwritten by the host first): every user of `ptr` says so.
        call("allocating pinned memory", || unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) })
            .map(Pinned)
    }

    /// Its host address, valid while `self` lives.
    pub fn ptr(&mut self) -> Result<*mut u8> {
        call("pinned memory", || self.0.as_mut_ptr())
    }
}

/// One device allocation in `ctx`, freed when dropped.
#[derive(Debug)]
pub struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    /// Its device address.
    pub ptr: u64,
    /// Its size in bytes.
    pub bytes: usize,
}

impl DeviceAlloc {
    /// `bytes` of device memory in `ctx` (`what`: what it is for).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, what: &'static str) -> Result<DeviceAlloc> {
        guard(what, || -> Result<DeviceAlloc> {
            ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
            // SAFETY: a plain device allocation of `bytes`, owned by the returned value.
            let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(driver_err(what))?;
            Ok(DeviceAlloc { ctx: ctx.clone(), ptr, bytes })
        })?
    }

    /// The range `[offset, offset + len)` of this allocation, checked.
    fn range(&self, offset: usize, len: usize) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(self.ptr + offset as u64),
            _ => Err(Error::InvalidArgument(
                format!("{len} bytes at {offset} do not fit a device allocation of {}", self.bytes).into(),
            )),
        }
    }

    /// Copies `host` to `offset` of this allocation and waits until `stream` (of this
    /// allocation's context) has run the copy (blocking: for set-up and checks, not hot paths).
    pub fn upload(&mut self, stream: &CudaStream, offset: usize, host: &[u8]) -> Result<()> {
        let dst = self.range(offset, host.len())?;
        // SAFETY: `dst` is inside this live allocation (checked), `host` is borrowed until the
        // stream has run the copy (synchronised below before returning), and `&mut self` keeps
        // every other user of this allocation out while it runs.
        unsafe { copy_htod(stream, dst, host)? };
        sync(stream)
    }

    /// Copies `host.len()` bytes from `offset` of this allocation into `host` and waits for it.
    pub fn download(&mut self, stream: &CudaStream, offset: usize, host: &mut [u8]) -> Result<()> {
        let src = self.range(offset, host.len())?;
        // SAFETY: `src` is inside this live allocation (checked); `host` is borrowed mutably
        // until the stream has run the copy (synchronised below before returning).
        unsafe { copy_dtoh(stream, host, src)? };
        sync(stream)
    }

    /// The IPC memory handle of this allocation (`cuIpcGetMemHandle`), for another process to
    /// open with [`ipc_open`].
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
        guard("exporting the device window", || {
            // SAFETY: `h` is a live handle the driver writes; `self.ptr` is a live allocation.
            let r = unsafe { cu::cuIpcGetMemHandle(&mut h, self.ptr) };
            if r == CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(Error::Unsupported(format!("CUDA IPC: cannot export the device window: {r:?}").into()))
            }
        })??;
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(handle)
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = guard("freeing the device window", || {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: `ptr` came from malloc_sync and its owner dropped it: nothing uses it
                // any more (the IPC windows end every call with a barrier after its last read).
                let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
            }
        });
    }
}

/// Opens another process's allocation by its IPC `handle` in `ctx`: its device address here.
/// Close it with [`ipc_close`].
pub fn ipc_open(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<u64> {
    guard("opening a peer's device window", || -> Result<u64> {
        ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
        let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a live u64 the driver writes the mapping's address into; the handle
        // is 64 bytes as the driver defines it (an invalid one is an error, not UB).
        let r = unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        if r == CUresult::CUDA_SUCCESS {
            Ok(ptr)
        } else {
            Err(Error::Unsupported(format!("CUDA IPC: cannot open a peer's device window: {r:?}").into()))
        }
    })?
}

/// Closes a mapping made by [`ipc_open`] (errors ignored: it is going away).
///
/// # Safety
/// `ptr` came from [`ipc_open`] in `ctx`, and nothing reads it any more.
pub unsafe fn ipc_close(ctx: &Arc<CudaContext>, ptr: u64) {
    let _ = guard("closing a peer's device window", || {
        if ctx.bind_to_thread().is_ok() {
            // SAFETY: forwarded contract.
            let _ = unsafe { cu::cuIpcCloseMemHandle(ptr) };
        }
    });
}

/// Compiles `src` to PTX for `arch` with NVRTC, exact arithmetic (no fast math, no flush to
/// zero, no contraction). NVRTC must be loaded.
pub fn compile_ptx(src: &str, arch: &'static str) -> Result<String> {
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        name: Some("toroid_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = guard("compiling the kernels with NVRTC", || cudarc::nvrtc::compile_ptx_with_opts(src, opts))?
        .map_err(|e| Error::Internal(format!("NVRTC rejected the kernels: {e:?}").into()))?;
    Ok(ptx.to_src())
}

/// Loads the PTX module `ptx` into `ctx`.
pub fn load_module(ctx: &Arc<CudaContext>, ptx: &str) -> Result<Arc<CudaModule>> {
    call("loading the kernels' PTX", || ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)))
}

/// The kernel `name` of `module`.
pub fn load_function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction> {
    call("finding a kernel", || module.load_function(name))
}

/// The number of multiprocessors of `ctx`'s device.
pub fn multiprocessor_count(ctx: &Arc<CudaContext>) -> Result<u32> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    call("reading the multiprocessor count", || ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
        .map(|n| n.max(1) as u32)
}

/// A one-dimensional launch: `blocks` blocks of `threads` threads, no shared memory.
#[derive(Debug, Clone, Copy)]
pub struct Grid {
    /// Blocks in the grid.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

impl Grid {
    fn config(self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Enqueues the reduction kernel `f(dst, a, b, n)` on `stream`.
///
/// # Safety
/// `f` takes `(T*, const T*, const T*, u64)` and reads or writes `n` elements through the
/// pointers, which are device pointers of `stream`'s context valid for `n` elements of `T`
/// until the stream has run the kernel.
pub unsafe fn launch_reduce(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: Grid,
    dst: u64,
    [a, b]: [u64; 2],
    n: u64,
) -> Result<()> {
    use cudarc::driver::PushKernelArg;
    call("launching a reduction", || {
        let mut l = stream.launch_builder(f);
        l.arg(&dst).arg(&a).arg(&b).arg(&n);
        // SAFETY: the caller's contract: the kernel's signature and the pointers' validity.
        unsafe { l.launch(grid.config()) }.map(drop)
    })
}

/// Enqueues the scale kernel `f(dst, src, n, factor)` on `stream`.
///
/// # Safety
/// `f` takes `(T*, const T*, u64, double)` and reads or writes `n` elements through the
/// pointers, valid as for [`launch_reduce`].
pub unsafe fn launch_scale(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: Grid,
    dst: u64,
    src: u64,
    n: u64,
    factor: f64,
) -> Result<()> {
    use cudarc::driver::PushKernelArg;
    call("launching a scale", || {
        let mut l = stream.launch_builder(f);
        l.arg(&dst).arg(&src).arg(&n).arg(&factor);
        // SAFETY: the caller's contract: the kernel's signature and the pointers' validity.
        unsafe { l.launch(grid.config()) }.map(drop)
    })
}

/// Enqueues `f(args)` on `stream`: a kernel whose one parameter is `args` by value.
///
/// # Safety
/// `f` takes exactly one parameter of `T`'s layout, and every address in `args` is valid for
/// what the kernel does with it until the stream has run it.
pub unsafe fn launch_args<T: bytemuck::Pod>(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: Grid,
    args: &T,
) -> Result<()> {
    let what = "launching a collective on device memory";
    guard(what, || -> Result<()> {
        stream.context().bind_to_thread().map_err(driver_err("binding the context"))?;
        let mut param = (args as *const T).cast_mut().cast::<std::ffi::c_void>();
        // SAFETY: one parameter, `param` points at `args`, alive for the call (the driver copies
        // parameters at launch); the caller vouches for the kernel's signature and addresses.
        let r = unsafe {
            cu::cuLaunchKernel(
                f.cu_function(),
                grid.blocks,
                1,
                1,
                grid.threads,
                1,
                1,
                0,
                raw_stream(stream).cast(),
                &mut param,
                std::ptr::null_mut(),
            )
        };
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Error::System(format!("CUDA: {what}: {r:?}").into()))
        }
    })?
}

/// `words` 64-bit words of page-locked host memory mapped into the device's address space,
/// zeroed: the device writes and reads them with system-scope operations, the host with
/// atomics, neither through a copy.
#[derive(Debug)]
pub struct HostMapped {
    ctx: Arc<CudaContext>,
    host: *mut u64,
    dev: u64,
    words: usize,
}

// SAFETY: the memory is plain page-locked memory owned by this value; every access goes through
// atomics (`load`, `store`), so sharing it between threads is sound.
unsafe impl Send for HostMapped {}
// SAFETY: as above.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    /// Allocates `words` zeroed words in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>, words: usize) -> Result<HostMapped> {
        let what = "allocating mapped host memory";
        guard(what, || -> Result<HostMapped> {
            ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            let flags = cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: the driver writes the allocation's address into `p`.
            let r = unsafe { cu::cuMemHostAlloc(&mut p, words.max(1) * 8, flags) };
            if r != CUresult::CUDA_SUCCESS || p.is_null() {
                return Err(Error::System(format!("CUDA: {what}: {r:?}").into()));
            }
            let host = p.cast::<u64>();
            // SAFETY: `host` is a fresh allocation of `words` words, 4 KiB-aligned.
            unsafe { std::ptr::write_bytes(host, 0, words.max(1)) };
            let mut dev = 0u64;
            // SAFETY: `p` is a mapped page-locked allocation of this context.
            let r = unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) };
            let m = HostMapped { ctx: ctx.clone(), host, dev, words: words.max(1) };
            if r != CUresult::CUDA_SUCCESS {
                return Err(Error::System(format!("CUDA: mapping host memory for the device: {r:?}").into()));
            }
            Ok(m)
        })?
    }

    /// The device address of word 0.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    fn word(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        let i = i.min(self.words - 1);
        // SAFETY: `i` is in the allocation (clamped), 8-byte aligned, alive while `self` is;
        // every access is atomic.
        unsafe { &*self.host.add(i).cast::<std::sync::atomic::AtomicU64>() }
    }

    /// Word `i` (clamped to the last), as the device last wrote it.
    pub fn load(&self, i: usize) -> u64 {
        self.word(i).load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sets word `i` (clamped to the last).
    pub fn store(&self, i: usize, v: u64) {
        self.word(i).store(v, std::sync::atomic::Ordering::Release)
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        let _ = guard("freeing mapped host memory", || {
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by cuMemHostAlloc in `new`; nothing uses it any more (its
                // owner waited for the last kernel that could).
                let _ = unsafe { cu::cuMemFreeHost(self.host.cast()) };
            }
        });
    }
}

/// Sets `bytes` bytes at `ptr` to zero and waits.
///
/// # Safety
/// `ptr` is device memory of `ctx` valid for `bytes` bytes that nothing else uses meanwhile.
pub unsafe fn zero(ctx: &Arc<CudaContext>, ptr: u64, bytes: usize) -> Result<()> {
    call("zeroing device memory", || {
        ctx.bind_to_thread()?;
        // SAFETY: forwarded contract.
        unsafe { cudarc::driver::result::memset_d8_sync(ptr, 0, bytes) }
    })
}
