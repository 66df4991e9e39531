// CUDA's built-ins on the host, for running the stream-ordered kernels on the CPU
// (tests/ordered_emulation.rs): threads for a block's threads, a barrier for __syncthreads,
// C++ atomics for the protocol's acquire loads and release stores (the kernels' CUDA C skips
// its PTX when TR_EMULATION is defined), the host clock for %globaltimer. One block runs at a
// time in a process, so a block's __shared__ variables are plain statics.
#pragma once
#include <sched.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>

#define TR_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

typedef unsigned long long u64_t;
struct uint4 { unsigned x, y, z, w; };
struct TrDim { unsigned x; };
static thread_local TrDim threadIdx;
static TrDim blockIdx, blockDim, gridDim;
static std::barrier<>* tr_block_barrier;

// Now and then a thread pauses before the barrier: other interleavings of the ranks' steps.
static inline void __syncthreads() {
  static thread_local unsigned long long x = 0x9e3779b97f4a7c15ull ^ (unsigned long long)getpid() << 16 ^ threadIdx.x;
  x ^= x << 13; x ^= x >> 7; x ^= x << 17;
  if (x % 32 == 0) usleep((useconds_t)(x >> 40) % 200);
  tr_block_barrier->arrive_and_wait();
}
static inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline u64_t min(u64_t a, u64_t b) { return a < b ? a : b; }
static inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float h2f(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short f2h(float f) { _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h; }

static inline u64_t tr_load(const u64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void tr_store(u64_t* p, u64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline u64_t tr_now() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (u64_t)t.tv_sec * 1000000000ull + (u64_t)t.tv_nsec;
}
// Ranks outnumber this machine's cores: a waiting thread lets the others run.
#define TR_SPIN_HINT() sched_yield()
