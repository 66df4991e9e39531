//! The stream-ordered collectives as CUDA C ([`super::ordered`] launches them): one kernel per
//! call, enqueued on the caller's stream, that moves a whole collective through the ranks'
//! device windows chunk by chunk, meeting the other ranks' kernels through the flag protocol of
//! [`super::signal`] (whose CUDA C this source includes). No host in between, so the call is
//! ordered on the stream like any kernel and can be captured in a CUDA graph.
//!
//! Every launch has the same argument, [`super::ordered::Args`] (`TrArgs` here). Block `b` of
//! `gridDim.x` takes part `b` of the call (in 16-byte units, so vectors stay aligned) and moves
//! it through its own region of each window half (`half / TR_MAX_BLOCKS` bytes), a step per
//! region's worth: region `b` is written only by block `b` of its rank and read only by block
//! `b` of the others, whatever a call's grid, which is what the protocol's argument needs (the
//! launches of one call must have the same grid on every rank: the host derives it from the
//! call alone).
//!
//! - `toroid_ordered_all_reduce_<op>_<type>`: each rank copies its slice of the chunk into its
//!   window; then every rank reduces the slice from its own input and every peer's window, in
//!   rank order (so every rank gets the same bits), scaled by `factor` for an average.
//! - `toroid_ordered_reduce_scatter_<op>_<type>`: each rank copies piece `k` of its chunk into
//!   its window at `k x chunk` (every `k` but its own); rank `r` reduces piece `r`.
//! - `toroid_ordered_reduce_<op>_<type>`: every rank but the root copies its chunk into its
//!   window; the root reduces.
//! - `toroid_ordered_broadcast`, `toroid_ordered_all_gather`: bytes; the root (every rank) copies
//!   into its window, the others copy out.
//! - `toroid_ordered_all_to_all`: bytes; each rank copies block `k` of its chunk into piece `k`
//!   of its window region; rank `r` copies piece `r` of every region out.

use super::kernels::{OPS, TYPES, combine, op_name, repr, scale_expr, storage};
use crate::dtype::{DataType, ReduceOp};

/// Threads per block of every ordered kernel.
pub const THREADS: u32 = 512;

/// The all-reduce kernel of `d` with `op` (`Avg`: the sum's, scaled).
pub fn all_reduce_kernel(d: DataType, op: ReduceOp) -> String {
    let op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    format!("toroid_ordered_all_reduce_{}_{}", op_name(op), d.name())
}

/// The reduce kernel of `d` with `op` (`Avg`: the sum's, scaled).
pub fn reduce_kernel(d: DataType, op: ReduceOp) -> String {
    let op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    format!("toroid_ordered_reduce_{}_{}", op_name(op), d.name())
}

/// The reduce-scatter kernel of `d` with `op` (`Avg`: the sum's, scaled).
pub fn reduce_scatter_kernel(d: DataType, op: ReduceOp) -> String {
    let op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    format!("toroid_ordered_reduce_scatter_{}_{}", op_name(op), d.name())
}

/// The broadcast kernel (bytes).
pub const BROADCAST: &str = "toroid_ordered_broadcast";
/// The all-gather kernel (bytes).
pub const ALL_GATHER: &str = "toroid_ordered_all_gather";
/// The all-to-all kernel (bytes).
pub const ALL_TO_ALL: &str = "toroid_ordered_all_to_all";

/// Every ordered kernel's name.
pub fn names() -> Vec<String> {
    let mut v = Vec::new();
    for &d in &TYPES {
        for &op in &OPS {
            v.push(all_reduce_kernel(d, op));
            v.push(reduce_scatter_kernel(d, op));
            v.push(reduce_kernel(d, op));
        }
    }
    v.push(BROADCAST.into());
    v.push(ALL_GATHER.into());
    v.push(ALL_TO_ALL.into());
    v
}

/// What every kernel shares: the argument, the slice, copies and the fold, and the protocol's
/// loop around a step's write and read.
const COMMON: &str = r#"
struct TrArgs {
  u64_t in, out, count, chunk, half, fp, timeout_ns, status;
  u64_t win[TR_MAX_RANKS];
  u64_t sig[TR_MAX_RANKS];
  double factor;
  int nranks, rank, root, scale;
};
/* Block b's part [lo, hi) of `count` elements, in units of `unit` elements (16 bytes). */
__device__ __forceinline__ void tr_part(u64_t count, u64_t unit, u64_t* lo, u64_t* hi) {
  const u64_t units = (count + unit - 1) / unit, b = blockIdx.x, nb = gridDim.x;
  *lo = min(count, units * b / nb * unit);
  *hi = min(count, units * (b + 1) / nb * unit);
}
/* Block b's region of a window: bytes [h * half + b * region, ... + region) of step s's half h,
   written only by block b of the window's rank and read only by block b of the others, whatever
   the grid of the call. */
__device__ __forceinline__ u64_t tr_region(const TrArgs& a, int rank, u64_t s) {
  return a.win[rank] + (s & 1) * a.half + (u64_t)blockIdx.x * (a.half / TR_MAX_BLOCKS);
}
/* dst <- src, bytes, by the block's threads: 16 bytes at a time when both are aligned, four such
   loads in flight per thread before their stores (more bytes in flight per thread is what keeps
   the memory system busy), then one at a time, then bytes. */
__device__ void tr_copy(char* dst, const char* src, u64_t bytes) {
  if (dst == src || bytes == 0) return;
  const u64_t nv = ((((u64_t)dst | (u64_t)src) & 15) == 0) ? bytes / 16 : 0;
  const uint4* s = (const uint4*)src;
  uint4* d = (uint4*)dst;
  const u64_t bd = blockDim.x;
  u64_t i = threadIdx.x;
  for (; i + 3 * bd < nv; i += 4 * bd) {
    const uint4 a = s[i], b = s[i + bd], c = s[i + 2 * bd], e = s[i + 3 * bd];
    d[i] = a; d[i + bd] = b; d[i + 2 * bd] = c; d[i + 3 * bd] = e;
  }
  for (; i < nv; i += bd) d[i] = s[i];
  for (u64_t j = nv * 16 + threadIdx.x; j < bytes; j += bd) dst[j] = src[j];
}
/* out[i] = src[0][i] op src[1][i] op ... (rank order), scaled when asked: U vectors of 16 bytes
   per thread per round (every source's loads issued together), then one vector at a time, then
   element by element (the tail, and everything when a pointer is not 16-byte aligned). */
template <typename T, typename F, typename S>
__device__ void tr_fold(T* out, const T* const* src, int n, u64_t len, F f, S sc, int scale, double factor) {
  enum { V = 16 / sizeof(T), U = 4 };
  typedef union { uint4 u; T e[V]; } Vec;
  u64_t al = (u64_t)out;
  for (int r = 0; r < n; r++) al |= (u64_t)src[r];
  const u64_t nv = (al & 15) == 0 ? len / V : 0;
  const u64_t bd = blockDim.x;
  u64_t i = threadIdx.x;
  for (; i + (U - 1) * bd < nv; i += U * bd) {
    Vec acc[U];
#pragma unroll
    for (int u = 0; u < U; u++) acc[u].u = ((const uint4*)src[0])[i + u * bd];
    for (int r = 1; r < n; r++) {
      Vec x[U];
#pragma unroll
      for (int u = 0; u < U; u++) x[u].u = ((const uint4*)src[r])[i + u * bd];
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int k = 0; k < V; k++) acc[u].e[k] = f(acc[u].e[k], x[u].e[k]);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (scale) {
#pragma unroll
        for (int k = 0; k < V; k++) acc[u].e[k] = sc(acc[u].e[k], factor);
      }
      ((uint4*)out)[i + u * bd] = acc[u].u;
    }
  }
  for (; i < nv; i += bd) {
    Vec acc; acc.u = ((const uint4*)src[0])[i];
    for (int r = 1; r < n; r++) {
      Vec x; x.u = ((const uint4*)src[r])[i];
#pragma unroll
      for (int k = 0; k < V; k++) acc.e[k] = f(acc.e[k], x.e[k]);
    }
    if (scale) {
#pragma unroll
      for (int k = 0; k < V; k++) acc.e[k] = sc(acc.e[k], factor);
    }
    ((uint4*)out)[i] = acc.u;
  }
  for (u64_t j = nv * V + threadIdx.x; j < len; j += bd) {
    T acc = src[0][j];
    for (int r = 1; r < n; r++) acc = f(acc, src[r][j]);
    if (scale) acc = sc(acc, factor);
    out[j] = acc;
  }
}
/* The protocol around one step: W writes this rank's part of the slice [lo, hi) of half h,
   R reads every rank's. Returns the fault (0: none). The next step's write starts right after
   R: it is to the other half, and this half is written again only after every rank posted the
   next step, which each does after its own R (src/gpu/signal.rs). */
template <typename W, typename R>
__device__ u64_t tr_step(const TrArgs& a, u64_t s, W write, R read) {
  __shared__ u64_t fault;
  u64_t* const* sig = (u64_t* const*)a.sig;
  const u64_t* status = (const u64_t*)a.status;
  const int b = blockIdx.x;
  write();
  __syncthreads();
  if (threadIdx.x == 0) {
    tr_publish(sig, a.rank, b, s, a.fp);
    fault = tr_before_read(sig, a.rank, a.nranks, b, s, a.fp, status, a.timeout_ns);
  }
  __syncthreads();
  const u64_t f = fault;
  if (f) return f;
  read();
  return 0;
}
/* Runs block b's part of the call, `a.chunk` elements (a region's worth) per step, keeping the
   block's step counter in the rank's signal area; records a fault in the status word. */
template <typename C>
__device__ void tr_run(const TrArgs& a, u64_t unit, C chunk) {
  u64_t* const* sig = (u64_t* const*)a.sig;
  const int b = blockIdx.x;
  u64_t s = sig[a.rank][TR_STEP(b)];
  u64_t fault = 0, lo, hi;
  tr_part(a.count, unit, &lo, &hi);
  for (u64_t c0 = lo; c0 < hi && !fault; c0 += a.chunk) {
    s++;
    fault = chunk(c0, min(a.chunk, hi - c0), s);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sig[a.rank][TR_STEP(b)] = s;
    if (fault && fault != TR_STOPPED) atomicCAS((unsigned long long*)a.status, 0ull, (unsigned long long)fault);
  }
}
template <typename T, typename F, typename S>
__device__ void tr_all_reduce(const TrArgs& a, F f, S sc) {
  const T* in = (const T*)a.in;
  T* out = (T*)a.out;
  tr_run(a, 16 / sizeof(T), [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] { tr_copy((char*)tr_region(a, a.rank, s), (const char*)(in + c0), len * sizeof(T)); },
      [&] {
        const T* src[TR_MAX_RANKS];
        for (int r = 0; r < a.nranks; r++) src[r] = r == a.rank ? in + c0 : (const T*)tr_region(a, r, s);
        tr_fold<T>(out + c0, src, a.nranks, len, f, sc, a.scale, a.factor);
      });
  });
}
/* Piece k of a step's chunk is at k * chunk elements of the region. */
template <typename T, typename F, typename S>
__device__ void tr_reduce_scatter(const TrArgs& a, F f, S sc) {
  const T* in = (const T*)a.in;
  T* out = (T*)a.out;
  tr_run(a, 16 / sizeof(T), [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] {
        T* mine = (T*)tr_region(a, a.rank, s);
        for (int k = 0; k < a.nranks; k++)
          if (k != a.rank) tr_copy((char*)(mine + k * a.chunk), (const char*)(in + k * a.count + c0), len * sizeof(T));
      },
      [&] {
        const T* src[TR_MAX_RANKS];
        for (int r = 0; r < a.nranks; r++)
          src[r] = r == a.rank ? in + a.rank * a.count + c0 : (const T*)tr_region(a, r, s) + a.rank * a.chunk;
        tr_fold<T>(out + c0, src, a.nranks, len, f, sc, a.scale, a.factor);
      });
  });
}
/* Every rank writes its chunk; the root reduces (its own input and every peer's region). */
template <typename T, typename F, typename S>
__device__ void tr_reduce(const TrArgs& a, F f, S sc) {
  const T* in = (const T*)a.in;
  T* out = (T*)a.out;
  tr_run(a, 16 / sizeof(T), [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] { if (a.rank != a.root) tr_copy((char*)tr_region(a, a.rank, s), (const char*)(in + c0), len * sizeof(T)); },
      [&] {
        if (a.rank != a.root) return;
        const T* src[TR_MAX_RANKS];
        for (int r = 0; r < a.nranks; r++) src[r] = r == a.rank ? in + c0 : (const T*)tr_region(a, r, s);
        tr_fold<T>(out + c0, src, a.nranks, len, f, sc, a.scale, a.factor);
      });
  });
}
/* Bytes; block k of `count` bytes of this rank's input goes to rank k: piece k of a step's region
   holds its chunk (`chunk` bytes a piece), rank r reads piece r of every region. */
extern "C" __global__ void __launch_bounds__(512) toroid_ordered_all_to_all(TrArgs a) {
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  tr_run(a, 16, [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] {
        char* mine = (char*)tr_region(a, a.rank, s);
        for (int k = 0; k < a.nranks; k++)
          if (k != a.rank) tr_copy(mine + k * a.chunk, in + k * a.count + c0, len);
      },
      [&] {
        for (int r = 0; r < a.nranks; r++) {
          const char* src = r == a.rank ? in + r * a.count + c0 : (const char*)tr_region(a, r, s) + a.rank * a.chunk;
          tr_copy(out + r * a.count + c0, src, len);
        }
      });
  });
}
extern "C" __global__ void __launch_bounds__(512) toroid_ordered_broadcast(TrArgs a) {
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  tr_run(a, 16, [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] { if (a.rank == a.root) tr_copy((char*)tr_region(a, a.rank, s), in + c0, len); },
      [&] { tr_copy(out + c0, a.rank == a.root ? in + c0 : (const char*)tr_region(a, a.root, s), len); });
  });
}
extern "C" __global__ void __launch_bounds__(512) toroid_ordered_all_gather(TrArgs a) {
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  tr_run(a, 16, [&](u64_t c0, u64_t len, u64_t s) {
    return tr_step(a, s,
      [&] { tr_copy((char*)tr_region(a, a.rank, s), in + c0, len); },
      [&] {
        for (int r = 0; r < a.nranks; r++)
          tr_copy(out + r * a.count + c0, r == a.rank ? in + c0 : (const char*)tr_region(a, r, s), len);
      });
  });
}
"#;

/// The whole source of the ordered kernels: a module of its own, compiled and loaded only when
/// a communicator takes the stream-ordered path ([`super::ordered_ptx`]).
pub fn source() -> String {
    let mut s = String::from(super::kernels::PRELUDE);
    s.push_str(&super::signal::cuda_source());
    s.push_str(COMMON);
    for &d in &TYPES {
        let r = repr(d);
        let t = storage(r);
        let ty = d.name();
        s.push_str(&format!(
            "struct TrScale_{ty} {{ __device__ __forceinline__ {t} operator()({t} a, double factor) const {{ return {}; }} }};\n",
            scale_expr(d)
        ));
        for &op in &OPS {
            let o = op_name(op);
            s.push_str(&format!(
                "struct TrOp_{o}_{ty} {{ __device__ __forceinline__ {t} operator()({t} a, {t} b) const {{ return {}; }} }};\n",
                combine(r, op)
            ));
            for (name, body) in [
                (all_reduce_kernel(d, op), "tr_all_reduce"),
                (reduce_scatter_kernel(d, op), "tr_reduce_scatter"),
                (reduce_kernel(d, op), "tr_reduce"),
            ] {
                s.push_str(&format!(
                    "extern \"C\" __global__ void __launch_bounds__(512) {name}(TrArgs a) {{ {body}<{t}>(a, TrOp_{o}_{ty}(), TrScale_{ty}()); }}\n"
                ));
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_and_op_has_both_reductions_and_avg_is_the_sum() {
        let src = source();
        for n in names() {
            assert_eq!(src.matches(&format!("void __launch_bounds__(512) {n}(")).count(), 1, "{n}");
        }
        assert_eq!(names().len(), 10 * 4 * 3 + 3);
        assert_eq!(
            all_reduce_kernel(DataType::F32, ReduceOp::Avg),
            all_reduce_kernel(DataType::F32, ReduceOp::Sum)
        );
        assert!(src.contains(&format!("__launch_bounds__({THREADS})")));
    }
}
