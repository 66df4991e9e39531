//! Synchronous data parallelism over toroid (the Caffe2 data_parallel_model / PyTorch DDP
//! contract):
//!
//! - at start, rank 0's parameters and BN buffers are broadcast to everyone;
//! - gradients go into flat buckets of about 25 MB in reverse parameter order (the first bucket,
//!   the network's last layers, is capped at 1 MiB so communication starts early, as DDP does);
//!   each bucket's all-reduce (average) is issued asynchronously as soon as the backward segments
//!   that produce its gradients are done, so it overlaps the backward pass of earlier segments;
//!   it is a persistent all-reduce, checked and its algorithm chosen at the bucket's first launch
//!   and only started after that (MPI's `MPI_Allreduce_init`; see [`launch`]);
//! - the optimiser then updates bucket by bucket as each all-reduce completes, overlapping the
//!   buckets still in flight;
//! - every rank applies the same update to the same averaged gradient, so parameters stay
//!   identical; [`Replicas::check_identical`] asserts it with a 64-bit hash every k steps.
//!
//! Losses are means over the local micro-batch; micro-batch gradients are summed with weight
//! 1/accum and the all-reduce averages over ranks, so the result is the mean gradient over the
//! global batch (scaled once, never twice).

use std::time::{Duration, Instant};

use candle_core::{Tensor, Var};
use toroid::internals::comm::AllReducePlan;
use toroid::{CallOptions, Communicator, ReduceOp, Work};

use crate::bail;
use crate::error::Result;
use crate::model::{Buffer, Param};
use crate::wire::GradWire;

/// Default bucket size in bytes (DDP's bucket_cap_mb = 25).
pub const BUCKET_BYTES: usize = 25 * 1024 * 1024;
/// Cap on the first bucket (DDP's _DEFAULT_FIRST_BUCKET_BYTES).
pub const FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// A group of parameters whose gradients travel in one all-reduce.
#[derive(Debug)]
pub struct Bucket {
    /// Indices into the parameter list, in reverse forward order.
    pub params: Vec<usize>,
    /// Offset of each parameter in the flat buffer.
    pub offsets: Vec<usize>,
    /// Lowest backward segment of its parameters: the bucket is complete once backward has
    /// finished that segment.
    pub min_segment: usize,
    buf: Option<Vec<f32>>,
    work: Option<Work<Vec<f32>>>,
    /// The bucket's persistent all-reduce, made at its first launch (see [`launch`]).
    plan: Option<AllReducePlan>,
    /// Error feedback's rounding residual (empty unless `--error-feedback`).
    residual: Vec<f32>,
}

/// Splits parameters (given as (elements, segment) in forward order) into buckets in reverse
/// order: each bucket holds up to `cap` bytes (`first_cap` for the first), and a parameter larger
/// than the cap gets a bucket of its own.
pub fn make_buckets(sizes: &[(usize, usize)], cap: usize, first_cap: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = vec![];
    let mut cur: Vec<usize> = vec![];
    let mut bytes = 0;
    let flush = |cur: &mut Vec<usize>, buckets: &mut Vec<Bucket>| {
        if cur.is_empty() {
            return;
        }
        let mut offsets = vec![];
        let mut off = 0;
        for &i in cur.iter() {
            offsets.push(off);
            off += sizes[i].0;
        }
        let min_segment = cur.iter().map(|&i| sizes[i].1).min().unwrap_or(0);
        buckets.push(Bucket {
            params: std::mem::take(cur),
            offsets,
            min_segment,
            buf: Some(vec![0.0; off]),
            work: None,
            plan: None,
            residual: vec![],
        });
    };
    for i in (0..sizes.len()).rev() {
        let b = sizes[i].0 * 4;
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if !cur.is_empty() && bytes + b > limit {
            flush(&mut cur, &mut buckets);
            bytes = 0;
        }
        cur.push(i);
        bytes += b;
    }
    flush(&mut cur, &mut buckets);
    buckets
}

/// Starts the average of a bucket's gradients `buf` over ranks, asynchronously (the work gives
/// `buf` back). Through the bucket's persistent all-reduce `plan`, made at its first launch: the
/// checks and the algorithm's choice are done then, once, and every later step only starts it.
/// A plain call where a plan cannot serve: `opts` with a compressed wire (`--wire bf16`), whose
/// all-reduce is a composition of collectives that a plan does not pin, and `persistent` off.
fn launch(
    comm: &Communicator,
    plan: &mut Option<AllReducePlan>,
    mut buf: Vec<f32>,
    opts: CallOptions,
    persistent: bool,
) -> Result<Work<Vec<f32>>> {
    if !persistent || opts != CallOptions::default() {
        return Ok(comm.all_reduce_async_with(buf, ReduceOp::Avg, opts)?);
    }
    let p = match plan {
        Some(p) => p,
        None => plan.insert(AllReducePlan::new(comm, &mut buf, ReduceOp::Avg)?),
    };
    Ok(p.start_async(comm, buf)?)
}

/// 64-bit FNV-1a hash of the bits of `values`: equal only if they are (almost surely)
/// bit-identical.
pub fn hash(values: &[&[f32]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for x in v.iter() {
            for byte in x.to_bits().to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    h
}

/// Time accounting of the collectives of one step.
#[derive(Debug, Default, Clone, Copy)]
pub struct CommTime {
    /// Time the training thread spent blocked waiting for gradient all-reduces.
    pub wait: Duration,
    /// Bytes all-reduced.
    pub bytes: usize,
}

/// The data-parallel state of one rank: communicator (None when running alone) and buckets.
pub struct Replicas {
    comm: Option<Communicator>,
    /// Gradient buckets.
    pub buckets: Vec<Bucket>,
    /// (bucket, offset) of each parameter.
    place: Vec<(usize, usize)>,
    /// When false, all-reduces are issued only after the whole backward pass and waited for at
    /// once (to measure what the overlap buys).
    pub overlap: bool,
    /// When false (BMUF's local steps), gradients are not all-reduced: each rank applies its
    /// own.
    pub sync_grads: bool,
    /// When false, every bucket's all-reduce is a plain async call instead of a start of its
    /// persistent all-reduce (the reference the tests compare the persistent path with).
    pub persistent: bool,
    launched: usize,
    /// The bucket size `new` was given (to rebuild over another communicator).
    bucket_bytes: usize,
    /// The type gradients travel in, and error feedback.
    pub wire: GradWire,
}

impl Replicas {
    /// Sets up buckets for `params`. `comm` is None for a single process without a launcher.
    pub fn new(comm: Option<Communicator>, params: &[Param], bucket_bytes: usize, overlap: bool) -> Replicas {
        let sizes: Vec<(usize, usize)> = params.iter().map(|p| (p.var.elem_count(), p.segment)).collect();
        let buckets = make_buckets(&sizes, bucket_bytes, FIRST_BUCKET_BYTES.min(bucket_bytes));
        let mut place = vec![(0, 0); params.len()];
        for (bi, b) in buckets.iter().enumerate() {
            for (&p, &o) in b.params.iter().zip(&b.offsets) {
                place[p] = (bi, o);
            }
        }
        let wire = GradWire::default();
        Replicas {
            comm,
            buckets,
            place,
            overlap,
            sync_grads: true,
            persistent: true,
            launched: 0,
            bucket_bytes,
            wire,
        }
    }

    /// The same replicas over `comm` (the survivors, after a shrink): fresh buckets, nothing in
    /// flight, error feedback's residuals back to zero, and no persistent all-reduces yet (the
    /// old ones were made for the old communicator; the first launches make new ones).
    pub fn rebuilt(&self, comm: Communicator, params: &[Param]) -> Replicas {
        let mut r = Replicas::new(Some(comm), params, self.bucket_bytes, self.overlap);
        r.sync_grads = self.sync_grads;
        r.persistent = self.persistent;
        r.wire = self.wire;
        r
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.size())
    }

    /// The communicator, if any.
    pub fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    /// Copies tensors to one flat vector.
    fn flatten(vars: &[&Var]) -> Result<Vec<f32>> {
        let mut flat = Vec::with_capacity(vars.iter().map(|v| v.elem_count()).sum());
        for v in vars {
            flat.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(flat)
    }

    fn unflatten(vars: &[&Var], flat: &[f32]) -> Result<()> {
        let mut off = 0;
        for v in vars {
            let n = v.elem_count();
            v.set(&Tensor::from_slice(&flat[off..off + n], v.shape(), v.device())?)?;
            off += n;
        }
        Ok(())
    }

    /// Makes every rank's `vars` equal to rank 0's (one broadcast of the concatenation).
    pub fn broadcast_vars(&self, vars: &[&Var]) -> Result<()> {
        let Some(comm) = &self.comm else { return Ok(()) };
        let mut flat = Self::flatten(vars)?;
        comm.broadcast(&mut flat, 0)?;
        Self::unflatten(vars, &flat)
    }

    /// Replaces every rank's `vars` by their average over ranks (BN running statistics before
    /// evaluation and checkpoints: each rank's were computed on its own examples).
    pub fn average_vars(&self, vars: &[&Var]) -> Result<()> {
        let Some(comm) = &self.comm else { return Ok(()) };
        let mut flat = Self::flatten(vars)?;
        comm.all_reduce(&mut flat, ReduceOp::Avg)?;
        Self::unflatten(vars, &flat)
    }

    /// Broadcasts host vectors (optimiser state) from rank 0.
    pub fn broadcast_host(&self, v: &mut [f32]) -> Result<()> {
        if let Some(comm) = &self.comm {
            comm.broadcast(v, 0)?;
        }
        Ok(())
    }

    /// Sums `v` over ranks.
    pub fn sum_f64(&self, v: &mut [f64]) -> Result<()> {
        if let Some(comm) = &self.comm {
            comm.all_reduce(v, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Start of a step: zero the gradient buffers.
    pub fn begin_step(&mut self) {
        for b in &mut self.buckets {
            if let Some(buf) = &mut b.buf {
                buf.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        self.launched = 0;
    }

    /// Adds `scale * grad` of parameter `p` into its bucket (None: the parameter got no gradient).
    pub fn add_grad(&mut self, p: usize, grad: Option<&Tensor>, scale: f32) -> Result<()> {
        let Some(g) = grad else { return Ok(()) };
        let (bi, off) = self.place[p];
        let Some(buf) = self.buckets[bi].buf.as_mut() else { bail!("bucket {bi} is in flight") };
        let g = g.flatten_all()?.to_vec1::<f32>()?;
        for (d, s) in buf[off..off + g.len()].iter_mut().zip(&g) {
            *d += scale * s;
        }
        Ok(())
    }

    /// Backward has finished `segment` (segments finish last to first) on the last micro-batch:
    /// launch, in order, every bucket that is now complete.
    pub fn segment_done(&mut self, segment: usize) -> Result<()> {
        if !self.overlap && segment > 0 {
            return Ok(());
        }
        while self.launched < self.buckets.len() && self.buckets[self.launched].min_segment >= segment {
            let b = &mut self.buckets[self.launched];
            if let Some(comm) = self.comm.as_ref().filter(|_| self.sync_grads) {
                let Some(mut buf) = b.buf.take() else { bail!("bucket launched twice") };
                self.wire.compensate(&mut buf, &mut b.residual);
                b.work = Some(launch(comm, &mut b.plan, buf, self.wire.options(), self.persistent)?);
            }
            self.launched += 1;
        }
        Ok(())
    }

    /// Waits for each bucket in turn and calls `apply(params, offsets, averaged gradients)` on it
    /// while later buckets may still be reducing.
    pub fn finish(
        &mut self,
        mut apply: impl FnMut(&[usize], &[usize], &[f32]) -> Result<()>,
    ) -> Result<CommTime> {
        self.segment_done(0)?;
        let mut t = CommTime::default();
        for b in &mut self.buckets {
            if let Some(work) = b.work.take() {
                let start = Instant::now();
                let buf = work.wait()?;
                t.wait += start.elapsed();
                t.bytes += buf.len() * self.wire.bytes_per_element();
                b.buf = Some(buf);
            }
            let Some(buf) = b.buf.as_ref() else { bail!("bucket lost its buffer") };
            apply(&b.params, &b.offsets, buf)?;
        }
        Ok(t)
    }

    /// Fails unless every rank holds bit-identical `values` (compared by a 64-bit FNV-1a hash;
    /// min and max over ranks must agree).
    pub fn check_identical(&self, values: &[&[f32]], what: &str) -> Result<()> {
        let Some(comm) = &self.comm else { return Ok(()) };
        let h = hash(values);
        let mut lo = [h];
        let mut hi = [h];
        comm.all_reduce(&mut lo, ReduceOp::Min)?;
        comm.all_reduce(&mut hi, ReduceOp::Max)?;
        if lo != hi {
            bail!("ranks diverged: {what} differ across ranks (hash on rank {}: {h:#018x})", comm.rank());
        }
        Ok(())
    }

    /// All BN buffers as vars.
    pub fn buffer_vars(buffers: &[Buffer]) -> Vec<&Var> {
        buffers.iter().map(|b| &b.var).collect()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::test_ranks::on_ranks;

    /// Rank `rank`'s gradient of parameter `p` at `step`, element `i`: a multiple of 1/4 below
    /// 64 in magnitude, so that sums and averages over 2 or 4 ranks are exact in f32.
    fn grad(rank: usize, step: usize, p: usize, i: usize) -> f32 {
        let h = (rank * 7919 + step * 104_729 + p * 1_299_709 + i * 15_485_863) % 511;
        (h as f32 - 255.0) / 4.0
    }

    /// `steps` optimiser steps of `rep` (every parameter's gradient from [`grad`], launched
    /// segment by segment as backward does); the averaged gradients each step hands to the
    /// optimiser, per parameter.
    fn run_steps(rep: &mut Replicas, params: &[Param], steps: usize) -> Vec<Vec<Vec<f32>>> {
        let rank = rep.rank();
        let mut seen = vec![];
        for step in 0..steps {
            rep.begin_step();
            for s in (0..3).rev() {
                for (pi, p) in params.iter().enumerate().filter(|(_, p)| p.segment == s) {
                    let n = p.var.elem_count();
                    let g =
                        Tensor::from_vec((0..n).map(|i| grad(rank, step, pi, i)).collect(), n, &Device::Cpu)
                            .unwrap();
                    rep.add_grad(pi, Some(&g), 1.0).unwrap();
                }
                rep.segment_done(s).unwrap();
            }
            let mut got = vec![vec![]; params.len()];
            rep.finish(|ps, offsets, grads| {
                for (&pi, &off) in ps.iter().zip(offsets) {
                    got[pi] = grads[off..off + params[pi].var.elem_count()].to_vec();
                }
                Ok(())
            })
            .unwrap();
            seen.push(got);
        }
        seen
    }

    /// The bucketed all-reduces through persistent all-reduces (made at the first step, started
    /// at every later one) hand the optimiser bit for bit the gradients of plain async calls,
    /// and those are the average over ranks computed here, every element of every step.
    #[test]
    fn persistent_bucket_all_reduces_give_the_plain_calls_gradients() {
        for n in [2, 4] {
            on_ranks(n, move |_, comm| {
                // (elements, segment): buckets of at most 2 KB, so that five buckets launch as
                // backward goes, two of them a parameter alone over the cap.
                let sizes = [(300, 0), (70, 0), (2000, 1), (5, 1), (900, 2), (64, 2)];
                let params: Vec<Param> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &(len, segment))| Param {
                        name: format!("p{i}"),
                        var: Var::zeros(len, DType::F32, &Device::Cpu).unwrap(),
                        decay: false,
                        segment,
                    })
                    .collect();
                let mut rep = Replicas::new(Some(comm), &params, 2048, true);
                assert_eq!(rep.buckets.len(), 5);
                assert!(rep.persistent);
                let persistent = run_steps(&mut rep, &params, 3);
                assert!(rep.buckets.iter().all(|b| b.plan.as_ref().is_some_and(|p| p.algorithm().is_some())));
                rep.persistent = false;
                let plain = run_steps(&mut rep, &params, 3);
                assert_eq!(persistent, plain, "rank {}: persistent and plain gradients differ", rep.rank());
                for (step, got) in persistent.iter().enumerate() {
                    for (pi, g) in got.iter().enumerate() {
                        assert_eq!(g.len(), sizes[pi].0);
                        for (i, x) in g.iter().enumerate() {
                            let want = (0..n).map(|r| grad(r, step, pi, i)).sum::<f32>() / n as f32;
                            assert_eq!(
                                *x,
                                want,
                                "rank {}: step {step}, parameter {pi}, element {i}",
                                rep.rank()
                            );
                        }
                    }
                }
            });
        }
    }

    #[test]
    fn buckets_are_reverse_ordered_and_capped() {
        // (elements, segment) in forward order.
        let sizes = [(100, 0), (300_000, 0), (10, 1), (200_000, 2), (50, 3), (1000, 3)];
        let b = make_buckets(&sizes, 1_000_000, 4_100);
        let order: Vec<Vec<usize>> = b.iter().map(|b| b.params.clone()).collect();
        // The first bucket is capped at 4100 bytes: param 5 (4000 B) alone. Then 4, 3 and 2
        // (800,240 B) fit in 1 MB; param 1 (1.2 MB) is over the cap and goes alone; then 0.
        assert_eq!(order, vec![vec![5], vec![4, 3, 2], vec![1], vec![0]]);
        assert_eq!(b[1].offsets, vec![0, 50, 200_050]);
        assert_eq!(b.iter().map(|b| b.min_segment).collect::<Vec<_>>(), vec![3, 1, 0, 0]);
        let all: usize = b.iter().map(|b| b.buf.as_ref().unwrap().len()).sum();
        assert_eq!(all, sizes.iter().map(|s| s.0).sum::<usize>());
    }
}
