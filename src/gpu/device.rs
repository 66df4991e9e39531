//! The kernels loaded on one device: [`DeviceKernels`] holds the device's context, a stream
//! and every kernel's function, and launches them on device pointers. Grid: 256 threads per
//! block and at most 8 blocks per multiprocessor, the kernels striding over the rest.

use std::sync::Arc;

use super::cuda::{self, CudaContext, CudaFunction, CudaStream, Grid};
use super::kernels;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

const THREADS: u32 = 256;

/// Every kernel, loaded on one device.
#[derive(Debug)]
pub struct DeviceKernels {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The reductions, [`kernels::TYPES`] by [`kernels::OPS`] in that order.
    reduce: Vec<CudaFunction>,
    /// The scales, by [`kernels::TYPES`] (none for integers).
    scale: Vec<Option<CudaFunction>>,
    max_blocks: u32,
}

impl DeviceKernels {
    /// Loads `ptx` (from [`super::ptx`], or compiled elsewhere) on device `ordinal`, with a
    /// stream of its own.
    pub fn new(ordinal: usize, ptx: &str) -> Result<DeviceKernels> {
        super::driver_available()?;
        let ctx = cuda::open_device(ordinal)?;
        let stream = cuda::new_stream(&ctx)?;
        let module = cuda::load_module(&ctx, ptx)?;
        let load = |name: String| cuda::load_function(&module, &name);
        let reduce = kernels::TYPES
            .iter()
            .flat_map(|&d| kernels::OPS.iter().filter_map(move |&o| kernels::reduce_kernel(d, o)))
            .map(load)
            .collect::<Result<Vec<_>>>()?;
        let scale = kernels::TYPES
            .iter()
            .map(|&d| kernels::scale_kernel(d).map(load).transpose())
            .collect::<Result<Vec<_>>>()?;
        let max_blocks = cuda::multiprocessor_count(&ctx)? * 8;
        Ok(DeviceKernels { ctx, stream, reduce, scale, max_blocks })
    }

    /// The context (to allocate and copy in tests and benchmarks).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The reduction of `dtype` with `op` (found by position: nothing is built per launch).
    fn reduce_fn(&self, dtype: DataType, op: ReduceOp) -> Result<&CudaFunction> {
        let t = kernels::TYPES.iter().position(|&d| d == dtype);
        let o = kernels::OPS.iter().position(|&x| x == op);
        t.zip(o).and_then(|(t, o)| self.reduce.get(t * kernels::OPS.len() + o)).ok_or_else(|| {
            Error::InvalidArgument(format!("no {op:?} kernel (avg is a scale and a sum)").into())
        })
    }

    /// The scale of `dtype`.
    fn scale_fn(&self, dtype: DataType) -> Result<&CudaFunction> {
        kernels::TYPES
            .iter()
            .position(|&d| d == dtype)
            .and_then(|t| self.scale[t].as_ref())
            .ok_or_else(|| Error::InvalidArgument(format!("cannot scale {dtype}").into()))
    }

    fn grid(&self, count: usize, dtype: DataType) -> Grid {
        // One thread per 16-byte vector at most.
        let units = (count * dtype.size()).div_ceil(16).max(1);
        let blocks = units.div_ceil(THREADS as usize).min(self.max_blocks as usize) as u32;
        Grid { blocks, threads: THREADS }
    }

    /// Enqueues `dst[i] = a[i] ⊕ b[i]` for `count` elements of `dtype` on [`Self::stream`].
    ///
    /// # Safety
    /// `dst`, `a` and `b` are device pointers of this context, each valid for `count` elements
    /// of `dtype` until the stream has run the kernel; `dst` may equal `a` or `b` but must not
    /// overlap them otherwise, nor be written by anything else meanwhile.
    pub unsafe fn reduce_into(
        &self,
        dtype: DataType,
        op: ReduceOp,
        dst: u64,
        a: u64,
        b: u64,
        count: usize,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.reduce_on(&self.stream, dtype, op, dst, [a, b], count) }
    }

    /// [`Self::reduce_into`] enqueued on `stream` (of this device's primary context), of the
    /// two inputs `[a, b]`.
    ///
    /// # Safety
    /// As [`Self::reduce_into`], the pointers valid until `stream` has run the kernel.
    pub unsafe fn reduce_on(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        op: ReduceOp,
        dst: u64,
        [a, b]: [u64; 2],
        count: usize,
    ) -> Result<()> {
        let f = self.reduce_fn(dtype, op)?;
        // SAFETY: the kernel of (dtype, op) takes (T*, const T*, const T*, u64) and touches
        // `count` elements through the pointers, which the caller guarantees are valid.
        unsafe { cuda::launch_reduce(stream, f, self.grid(count, dtype), dst, [a, b], count as u64) }
    }

    /// Enqueues `dst[i] = src[i] · factor` for `count` elements of the float type `dtype`.
    ///
    /// # Safety
    /// As [`Self::reduce_into`], for `dst` and `src`.
    pub unsafe fn scale_into(
        &self,
        dtype: DataType,
        dst: u64,
        src: u64,
        count: usize,
        factor: f64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.scale_on(&self.stream, dtype, dst, src, count, factor) }
    }

    /// [`Self::scale_into`] enqueued on `stream` (of this device's primary context).
    ///
    /// # Safety
    /// As [`Self::scale_into`], the pointers valid until `stream` has run the kernel.
    pub unsafe fn scale_on(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        dst: u64,
        src: u64,
        count: usize,
        factor: f64,
    ) -> Result<()> {
        let f = self.scale_fn(dtype)?;
        // SAFETY: the scale kernel of `dtype` takes (T*, const T*, u64, double) and touches
        // `count` elements through the pointers, which the caller guarantees are valid.
        unsafe { cuda::launch_scale(stream, f, self.grid(count, dtype), dst, src, count as u64, factor) }
    }

    /// Waits until the stream has run everything enqueued.
    pub fn synchronize(&self) -> Result<()> {
        super::cuda::sync(&self.stream)
    }
}
