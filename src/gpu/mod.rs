//! CUDA, loaded at run time (cargo feature `cuda`, on by default): the reduction kernels every
//! collective on device memory will use, compiled from CUDA C with NVRTC and run through the
//! driver API, both through `cudarc`, which opens `libcuda.so.1` and `libnvrtc.so.13` only when
//! first used. A machine without them loads and runs libtoroid as before; asking for CUDA there
//! returns [`Error::Unsupported`] saying what is missing.
//!
//! `cudarc` panics when a library it needs cannot be loaded, so every entry here first loads
//! the library itself ([`crate::sys::dl`]) and reports its absence as an error, and every call
//! into `cudarc` runs behind [`guard`] (in [`cuda`]), which turns a panic into an error: none
//! crosses into a caller (or the C ABI).
//!
//! Built for the CUDA 13.0 driver API (cudarc feature `cuda-13000`, matching NVRTC 13 that torch
//! installs): the driver must support CUDA 13.0 (R580 or later).
//!
//! `gpu` never names the communicator: what it needs from one is the trait [`host_comm::HostComm`],
//! which `comm` implements (and `comm` owns each communicator's [`stream::DeviceState`]).
//!
//! | part | what |
//! |---|---|
//! | [`host_comm`] | what the GPU path needs from a communicator (traits), and a call's description |
//! | [`cuda`] | every cudarc call on memory, streams, events and IPC handles: guarded, errors mapped |
//! | [`kernels`] | the kernels as CUDA C, one per (type, op), and their names |
//! | [`device`] | the kernels loaded on one device, and launching them |
//! | [`stream`] | collectives on device memory ordered on a caller's stream: picks the path |
//! | [`ipc`] | CUDA IPC between the ranks of one host, reduced on the GPU, driven by the host |
//! | [`window_map`] | what each rank publishes about its device window, and how each is reached |
//! | [`ordered`] | CUDA IPC between processes of one host, one kernel per call on the caller's stream |
//! | [`ordered_kernels`] | those kernels as CUDA C |
//! | [`signal`] | the flag protocol the ordered kernels meet through: its model and its CUDA C |
//! | [`staged`] | collectives on device memory through pinned host memory, one chunk pipeline |
//! | this file | finding the libraries, compiling |
//!
//! Asynchronous for the host on the IPC path (all-reduce, broadcast, all-gather and
//! reduce-scatter: [`stream::on_stream_async`]); every collective and send/receive on device
//! memory runs, the others staged and blocking. Enqueued on the caller's stream (NCCL's
//! contract) on the stream-ordered path ([`ordered`], `TOROID_CUDA_ORDERED=1`: off by default
//! until it has run on a GPU). Not built: IPC combined with staging for ranks on several hosts
//! (those stage everything), the stream-ordered path for ranks that are threads of one process.

pub mod cuda;
pub mod device;
pub mod host_comm;
pub mod ipc;
pub mod kernels;
pub mod ordered;
pub mod ordered_kernels;
pub mod signal;
pub mod staged;
pub mod stream;
pub mod window_map;

use std::sync::OnceLock;

pub use cuda::guard;

use crate::error::{Error, Result};

/// The driver library's name.
pub const LIBCUDA: &str = "libcuda.so.1";
/// The NVRTC library's name (what cudarc looks for, among others, for CUDA 13).
pub const LIBNVRTC: &str = "libnvrtc.so.13";

/// Whether the CUDA driver can be loaded: `Err(Unsupported)` saying so when it cannot (no
/// NVIDIA driver on this machine).
pub fn driver_available() -> Result<()> {
    crate::sys::dl::load(LIBCUDA).map_err(|e| {
        Error::Unsupported(
            format!("CUDA is not available: the driver library {LIBCUDA} cannot be loaded ({e})").into(),
        )
    })
}

/// Loads NVRTC: from `path` when given (e.g. the `nvidia/cu13/lib/libnvrtc.so.13` that torch's
/// wheel installs), else by name from the loader's search path. Once loaded by path, cudarc's
/// lookup by name finds it.
pub fn load_nvrtc(path: Option<&std::path::Path>) -> Result<()> {
    let name = path.map_or(LIBNVRTC.to_string(), |p| p.display().to_string());
    crate::sys::dl::load(&name).map_err(|e| {
        Error::Unsupported(
            format!("NVRTC is not available: {name} cannot be loaded ({e}); set TOROID_NVRTC_PATH to libnvrtc.so.13")
                .into(),
        )
    })
}

/// The virtual architecture the PTX targets: the JIT compiles it for the device at load time,
/// and every feature the kernels use (f16 conversions need sm_53) is in it.
pub const PTX_ARCH: &str = "compute_75";

/// The kernels' PTX, compiled once per process with NVRTC (found as [`load_nvrtc`] says, with
/// `TOROID_NVRTC_PATH`).
pub fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled_once(&PTX, kernels::source)
}

/// The stream-ordered kernels' PTX ([`ordered_kernels`]), compiled once per process, when the
/// first communicator takes that path.
pub fn ordered_ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    compiled_once(&PTX, ordered_kernels::source)
}

/// The PTX of `source()` kept in `cell`: compiled by the first caller, the outcome (the PTX or
/// why not) the same for every later one.
fn compiled_once(
    cell: &'static OnceLock<std::result::Result<String, String>>,
    source: fn() -> String,
) -> Result<&'static str> {
    cell.get_or_init(|| {
        let path = crate::config::nvrtc_path();
        load_nvrtc(path.as_deref()).map_err(|e| e.to_string())?;
        compile(&source()).map_err(|e| e.to_string())
    })
    .as_deref()
    .map_err(|e| Error::Unsupported(e.clone().into()))
}

/// Compiles `src` to PTX for [`PTX_ARCH`], exact arithmetic (no fast math, no flush to zero, no
/// contraction). NVRTC must be loaded ([`load_nvrtc`]).
pub fn compile(src: &str) -> Result<String> {
    cuda::compile_ptx(src, PTX_ARCH)
}
