// The stream-ordered kernels (src/gpu/ordered_kernels.rs, the protocol of src/gpu/signal.rs)
// run on the CPU: the very CUDA C the library compiles with NVRTC, compiled here by a host C++
// compiler with the CUDA built-ins emulated. Each rank is a process (fork), as on the GPU path;
// the windows and signal areas of every rank are one shared mapping, the inputs, outputs and
// status words each rank's own (shared with its blocks). A launch runs every block at once, each
// a process of its own (so a block's __shared__ statics are its own) of blockDim threads with a
// barrier for __syncthreads. tests/ordered_emulation.rs builds this file after the kernels'
// source and runs it.
//
//   driver NRANKS   exit 0 when every check on every rank passed
//
// Checks, every element against a reference computed here: all-reduce (sum, max, avg, in place,
// misaligned, many chunks), reduce-scatter (and NCCL's in-place form), broadcast, all-gather
// (and its in-place form), reduce (every root, in place), all-to-all (in place), ten launches of the same argument (a graph replayed), a rank making
// another call (a mismatch on every rank), a rank that never launches (a timeout naming it).

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

// ---- what the driver needs of the kernels' layout (TR_* macros come from the source) ----
static const u64_t SIG_BYTES = (TR_STEP(0) + TR_MAX_BLOCKS) * 8;
static const u64_t HALF = 64 * 1024;  // small halves: regions of 512 bytes, many steps per call
static const u64_t REGION = HALF / TR_MAX_BLOCKS;
static int N, ME;
static char* g_shared;           // every rank's window (2 * HALF) then signal area
static u64_t* g_status;          // this rank's status words (fault, abort), shared with its blocks

// The rank's buffers: shared with the block processes, which write the outputs.
static char* g_arena;
static u64_t g_used;
static const u64_t ARENA = 8 << 20;
template <typename T>
static T* alloc(u64_t n, T fill) {
  T* p = (T*)(g_arena + g_used);
  g_used += (n * sizeof(T) + 63) / 64 * 64;
  if (g_used > ARENA) { fprintf(stderr, "arena exhausted\n"); _exit(3); }
  for (u64_t i = 0; i < n; i++) p[i] = fill;
  return p;
}

static char* window(int r) { return g_shared + (u64_t)r * (2 * HALF + SIG_BYTES); }

static int g_failed;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "rank %d: FAIL: ", ME);              \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);   \
      g_failed = 1;                                        \
    }                                                      \
  } while (0)

// Runs kernel(a) as `blocks` blocks, each a process of THREADS emulated threads, all at once;
// returns when every block has ended (the buffers reset for the next test case).
static const unsigned THREADS = 4;
static void launch(void (*kernel)(TrArgs), const TrArgs& a, unsigned blocks) {
  gridDim.x = blocks;
  blockDim.x = THREADS;
  std::vector<pid_t> pids;
  for (unsigned b = 0; b < blocks; b++) {
    pid_t p = fork();
    if (p == 0) {
      blockIdx.x = b;
      std::barrier<> bar(THREADS);
      tr_block_barrier = &bar;
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < THREADS; t++) ts.emplace_back([&, t] { threadIdx.x = t; kernel(a); });
      for (auto& t : ts) t.join();
      _exit(0);
    }
    pids.push_back(p);
  }
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "rank %d: a block died\n", ME); g_failed = 1; }
  }
}

// The argument ordered.rs makes (chunks of a region, the fingerprint from the call).
static TrArgs args(u64_t in, u64_t out, u64_t count, u64_t chunk, u64_t fp) {
  TrArgs a = {};
  a.in = in; a.out = out; a.count = count; a.chunk = chunk; a.half = HALF; a.fp = fp;
  a.timeout_ns = 5ull * 1000 * 1000 * 1000;
  a.status = (u64_t)g_status;
  for (int r = 0; r < N; r++) {
    a.win[r] = (u64_t)window(r);
    a.sig[r] = (u64_t)(window(r) + 2 * HALF);
  }
  a.nranks = N; a.rank = ME; a.root = 0; a.scale = 0; a.factor = 0;
  return a;
}

// Small integers: every sum and every order of summing is exact in float.
static float val(int r, u64_t i, int call) { return (float)((r * 7 + (int)i * 13 + call * 5) % 23) - 11; }

static void all_reduce_f32(int call, u64_t count, int misalign, bool in_place, unsigned blocks) {
  g_used = 0;
  float* in = alloc<float>(count + 4, 0.f);
  float* out = alloc<float>(count + 4, -999.f);
  float* src = in + misalign;
  float* dst = in_place ? src : out + misalign;
  for (u64_t i = 0; i < count; i++) src[i] = val(ME, i, call);
  launch(toroid_ordered_all_reduce_sum_float, args((u64_t)src, (u64_t)dst, count, REGION / 4, 100 + count), blocks);
  for (u64_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < N; r++) want += val(r, i, call);
    CHECK(dst[i] == want, "all_reduce sum call %d count %llu misalign %d in_place %d: [%llu] = %g, want %g", call,
          count, misalign, in_place, i, dst[i], want);
    if (dst[i] != want) break;
  }
  CHECK(g_status[0] == 0, "all_reduce status %#llx", g_status[0]);
}

static void all_reduce_other_ops(int call) {
  const u64_t count = 3000;  // many regions' worth
  g_used = 0;
  int* ii = alloc<int>(count, 0);
  int* io = alloc<int>(count, 0);
  for (u64_t i = 0; i < count; i++) ii[i] = (int)(val(ME, i, call) * 1000);
  launch(toroid_ordered_all_reduce_max_int32, args((u64_t)ii, (u64_t)io, count, REGION / 4, 7), 2);
  for (u64_t i = 0; i < count; i++) {
    int want = (int)(val(0, i, call) * 1000);
    for (int r = 1; r < N; r++) want = std::max(want, (int)(val(r, i, call) * 1000));
    CHECK(io[i] == want, "all_reduce max int32: [%llu] = %d, want %d", i, io[i], want);
    if (io[i] != want) break;
  }
  double* di = alloc<double>(count, 0.);
  double* dout = alloc<double>(count, 0.);
  for (u64_t i = 0; i < count; i++) di[i] = val(ME, i, call);
  TrArgs a = args((u64_t)di, (u64_t)dout, count, REGION / 8, 8);
  a.scale = 1;
  a.factor = 1.0 / N;
  launch(toroid_ordered_all_reduce_sum_double, a, 3);
  for (u64_t i = 0; i < count; i++) {
    double sum = 0;
    for (int r = 0; r < N; r++) sum += val(r, i, call);
    CHECK(dout[i] == sum * (1.0 / N), "all_reduce avg double: [%llu] = %g, want %g", i, dout[i], sum / N);
    if (dout[i] != sum * (1.0 / N)) break;
  }
}

static void reduce_scatter_f32(int call, u64_t count, bool in_place) {
  g_used = 0;
  float* in = alloc<float>(N * count, 0.f);
  float* out = alloc<float>(count, -999.f);
  for (u64_t i = 0; i < N * count; i++) in[i] = val(ME, i, call);
  float* dst = in_place ? in + ME * count : out;
  const u64_t chunk = (REGION / N / 16) * 16 / 4;
  launch(toroid_ordered_reduce_scatter_sum_float, args((u64_t)in, (u64_t)dst, count, chunk, 200 + count),
         1 + call % 4);
  for (u64_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < N; r++) want += val(r, ME * count + i, call);
    CHECK(dst[i] == want, "reduce_scatter count %llu in_place %d: [%llu] = %g, want %g", count, in_place, i, dst[i],
          want);
    if (dst[i] != want) break;
  }
}

static void broadcast_bytes(int call, u64_t bytes, int root) {
  g_used = 0;
  unsigned char* in = alloc<unsigned char>(bytes, 0);
  unsigned char* out = alloc<unsigned char>(bytes, 0);
  for (u64_t i = 0; i < bytes; i++) in[i] = (unsigned char)(ME * 31 + i * 7 + call);
  TrArgs a = args((u64_t)in, (u64_t)(ME == root ? in : out), bytes, REGION, 300 + root);
  a.root = root;
  launch(toroid_ordered_broadcast, a, 1 + call % 4);
  const unsigned char* got = ME == root ? in : out;
  for (u64_t i = 0; i < bytes; i++) {
    unsigned char want = (unsigned char)(root * 31 + i * 7 + call);
    CHECK(got[i] == want, "broadcast root %d: [%llu] = %d, want %d", root, i, got[i], want);
    if (got[i] != want) break;
  }
}

static void all_gather_bytes(int call, u64_t bytes, bool in_place) {
  g_used = 0;
  unsigned char* in = alloc<unsigned char>(bytes, 0);
  unsigned char* out = alloc<unsigned char>(N * bytes, 0);
  unsigned char* src = in_place ? out + ME * bytes : in;
  for (u64_t i = 0; i < bytes; i++) src[i] = (unsigned char)(ME * 31 + i * 7 + call);
  launch(toroid_ordered_all_gather, args((u64_t)src, (u64_t)out, bytes, REGION, 400), 1 + call % 4);
  for (int r = 0; r < N; r++)
    for (u64_t i = 0; i < bytes; i++) {
      unsigned char want = (unsigned char)(r * 31 + i * 7 + call);
      CHECK(out[r * bytes + i] == want, "all_gather in_place %d: rank %d [%llu] = %d, want %d", in_place, r, i,
            out[r * bytes + i], want);
      if (out[r * bytes + i] != want) break;
    }
}

static void reduce_f32(int call, u64_t count, int root, bool in_place) {
  g_used = 0;
  float* in = alloc<float>(count, 0.f);
  float* out = alloc<float>(count, -999.f);
  for (u64_t i = 0; i < count; i++) in[i] = val(ME, i, call);
  float* dst = in_place ? in : out;
  TrArgs a = args((u64_t)in, (u64_t)(ME == root ? dst : nullptr), count, REGION / 4, 500 + root);
  a.root = root;
  launch(toroid_ordered_reduce_sum_float, a, 1 + call % 4);
  if (ME != root) {
    CHECK(out[0] == -999.f && in[0] == val(ME, 0, call), "reduce: a non-root's buffers changed");
    return;
  }
  for (u64_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < N; r++) want += val(r, i, call);
    CHECK(dst[i] == want, "reduce root %d in_place %d: [%llu] = %g, want %g", root, in_place, i, dst[i], want);
    if (dst[i] != want) break;
  }
}

static void all_to_all_bytes(int call, u64_t bytes, bool in_place) {
  g_used = 0;
  unsigned char* in = alloc<unsigned char>(N * bytes, 0);
  unsigned char* out = in_place ? in : alloc<unsigned char>(N * bytes, 0);
  // Block k of rank r's input: what rank k receives from r.
  for (int k = 0; k < N; k++)
    for (u64_t i = 0; i < bytes; i++) in[k * bytes + i] = (unsigned char)(ME * 41 + k * 13 + i * 7 + call);
  TrArgs a = args((u64_t)in, (u64_t)out, bytes, (REGION / N / 16) * 16, 600);
  launch(toroid_ordered_all_to_all, a, 1 + call % 4);
  for (int r = 0; r < N; r++)
    for (u64_t i = 0; i < bytes; i++) {
      unsigned char want = (unsigned char)(r * 41 + ME * 13 + i * 7 + call);
      CHECK(out[r * bytes + i] == want, "all_to_all in_place %d: from rank %d [%llu] = %d, want %d", in_place, r, i,
            out[r * bytes + i], want);
      if (out[r * bytes + i] != want) break;
    }
}

// A rank making another call: every rank's status says mismatch (naming a rank that differs).
static void mismatch() {
  g_used = 0;
  float* in = alloc<float>(64, 1.f);
  float* out = alloc<float>(64, 0.f);
  const u64_t count = ME == N - 1 ? 63 : 64;
  TrArgs a = args((u64_t)in, (u64_t)out, count, REGION / 4, 1000 + count);
  a.timeout_ns = 3ull * 1000 * 1000 * 1000;
  launch(toroid_ordered_all_reduce_sum_float, a, 1);
  const u64_t w = g_status[0];
  CHECK((w & 0xff) == TR_CODE_MISMATCH, "mismatch: status %#llx, want code %llu", w, TR_CODE_MISMATCH);
  const int peer = (int)((w >> 8) & 0xff);
  CHECK(ME == N - 1 ? peer == 0 : peer == N - 1, "mismatch: rank %d named, not the one that differs", peer);
}

// Rank N-1 never launches: the others time out naming it (the first rank they wait for that
// did not come, which is N-1 as every other rank posts).
static void timeout_case() {
  if (ME == N - 1) return;
  g_used = 0;
  float* in = alloc<float>(64, 1.f);
  float* out = alloc<float>(64, 0.f);
  TrArgs a = args((u64_t)in, (u64_t)out, 64, REGION / 4, 5);
  a.timeout_ns = 300ull * 1000 * 1000;
  launch(toroid_ordered_all_reduce_sum_float, a, 1);
  const u64_t w = g_status[0];
  CHECK(w == (TR_CODE_TIMEOUT | (u64_t)(N - 1) << 8), "timeout: status %#llx, want rank %d's timeout", w, N - 1);
}

static int rank_main() {
  int call = 0;
  for (u64_t count : {1ull, 3ull, 5ull, 1024ull, 1025ull, 5000ull})
    for (int mis : {0, 1})
      for (bool ip : {false, true}) all_reduce_f32(call++, count, mis, ip, 1 + call % 4);
  all_reduce_other_ops(call++);
  for (u64_t count : {1ull, 7ull, 600ull, 2000ull})
    for (bool ip : {false, true}) reduce_scatter_f32(call++, count, ip);
  for (int root = 0; root < N; root++) broadcast_bytes(call++, 10000 + root, root);
  for (bool ip : {false, true}) all_gather_bytes(call++, 9001, ip);
  for (int root = 0; root < N; root++)
    for (bool ip : {false, true}) reduce_f32(call++, 1500 + root, root, ip);
  for (u64_t bytes : {1ull, 17ull, 5000ull})
    for (bool ip : {false, true}) all_to_all_bytes(call++, bytes, ip);
  // A graph's replays: the same argument ten times, the step counters carried by the areas.
  for (int k = 0; k < 10; k++) all_reduce_f32(0, 3000, 0, false, 3);
  if (g_failed) return 1;
  printf("rank %d of %d: every collective exact\n", ME, N);
  mismatch();
  if (g_failed) return 1;
  // After a fault the areas are out of step (as the communicator, which fails): start afresh.
  return 0;
}

static int timeout_main() {
  timeout_case();
  if (!g_failed) printf("rank %d of %d: mismatch and timeout reported\n", ME, N);
  return g_failed;
}

// Forks N ranks over one fresh shared mapping running `body`; 0 when every rank passed.
static int run_ranks(int (*body)()) {
  const u64_t per = 2 * HALF + SIG_BYTES;
  g_shared = (char*)mmap(nullptr, per * N, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (g_shared == MAP_FAILED) { perror("mmap"); return 1; }
  std::vector<pid_t> pids;
  for (int r = 0; r < N; r++) {
    pid_t p = fork();
    if (p == 0) {
      ME = r;
      alarm(120);  // never hang the test
      g_arena = (char*)mmap(nullptr, ARENA + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (g_arena == MAP_FAILED) { perror("mmap"); _exit(3); }
      g_status = (u64_t*)(g_arena + ARENA);
      _exit(body());
    }
    pids.push_back(p);
  }
  int bad = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  munmap(g_shared, per * N);
  return bad;
}

int main(int argc, char** argv) {
  N = argc > 1 ? atoi(argv[1]) : 2;
  if (N < 2 || N > TR_MAX_RANKS) { fprintf(stderr, "usage: driver NRANKS (2..%d)\n", TR_MAX_RANKS); return 2; }
  if (run_ranks(rank_main)) return 1;
  if (run_ranks(timeout_main)) return 1;
  printf("ordered kernels on %d emulated ranks: all checks passed\n", N);
  return 0;
}
