/* The stream-ordered contract of toroid_*_stream on device memory (NCCL's): a call only
 * ENQUEUES the collective on the caller's stream and returns at once; later work on that
 * stream sees the result. Built and run on a GPU machine, 2+ ranks under toroid-run (never in
 * the CPU test suite), with the CUDA driver API only (no runtime API, no kernels of our own):
 *
 *   cc -O1 -I include -I ffi_tests -I $CUDA/include ffi_tests/gpu/ordered.c -L DIR -ltoroid -lcuda
 *   toroid-run -n 2 ./ordered
 *
 * 1. Returns before completion: the stream is blocked by cuStreamWaitValue32 on a host flag
 *    that only this thread sets, and the collective is called behind it. A library that waits
 *    for the stream (the old "result is in recvbuf when the call returns") could never return;
 *    a watchdog then releases the flag after WATCHDOG_S seconds so the test fails with a
 *    message instead of hanging. After the call: cuStreamQuery is NOT_READY, a copy of the
 *    output to the host is queued behind it (the consumer), the flag is released, and every
 *    element of that copy must be exact. Done for all_reduce, broadcast, all_gather and
 *    reduce_scatter.
 * 2. CUDA graph: 10 collectives (and a device copy) captured on a non-blocking stream in
 *    relaxed mode, instantiated, replayed 100 times back to back; every output buffer is
 *    checked exactly after the first replay and after the last. */
#include "test_util.h" /* first: it sets _POSIX_C_SOURCE (sigaction, alarm) before libc's headers */

#include <signal.h>

#include <cuda.h>

#define CU(call)                                                          \
  do {                                                                    \
    CUresult e_ = (call);                                                 \
    if (e_ != CUDA_SUCCESS) FAIL("%s failed with CUDA error %d", #call, (int)e_); \
  } while (0)

static toroid_comm *g_comm;
static int g_size;

#define WATCHDOG_S 30    /* a call blocked this long on its own stream is a failure, not slow */
#define HANG_S 240       /* anything else stuck this long: exit with a message, do not hang */
#define SENTINEL 0xFFFFFFFFu /* a NaN: never an expected value, so an unwritten output fails */

/* The watchdog (SIGALRM). Armed: the call under test may be blocked behind the stream, so
 * release the stream (only a store, async-signal-safe) and record it; the check then fails.
 * Unarmed: something hangs; say so and exit. */
static volatile uint32_t *g_flag; /* page-locked, mapped: the host's view of the stream's flag */
static volatile sig_atomic_t g_armed, g_fired;

static void on_alarm(int sig) {
  (void)sig;
  if (g_armed) {
    *g_flag = 1;
    g_fired = 1;
    return;
  }
  static const char msg[] = "ordered.c: no progress within the watchdog's time (a hang): exiting\n";
  ssize_t w = write(2, msg, sizeof msg - 1);
  (void)w;
  _exit(2);
}

static void watchdog(unsigned seconds, int armed) {
  alarm(0);
  g_fired = 0;
  g_armed = armed;
  alarm(seconds);
}

/* Inputs: small integers, so float sums over ranks are exact whatever the reduction order. */
static float value(int rank, size_t i) { return (float)((rank * 7 + i * 13) % 101) - 50.0f; }
/* The graph's inputs, in {-1, 0, 1}: 6 in-place sums multiply by size^6, exact up to ~10 ranks. */
static float small(int rank, size_t i) { return (float)((rank + i * 5) % 3) - 1.0f; }

enum { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, NKINDS };
static const char *const kind_name[NKINDS] = {"toroid_all_reduce_stream", "toroid_broadcast_stream",
                                              "toroid_all_gather_stream", "toroid_reduce_scatter_stream"};

/* Element counts of each kind's input and output, n elements per rank. */
static size_t in_count(int kind, size_t n) { return kind == REDUCE_SCATTER ? (size_t)g_size * n : n; }
static size_t out_count(int kind, size_t n) { return kind == ALL_GATHER ? (size_t)g_size * n : n; }

/* Element i of `kind`'s output at this rank, when rank r's input element j is value(r, j). */
static float expected(int kind, size_t n, size_t i) {
  float s = 0;
  switch (kind) {
    case ALL_REDUCE:
      for (int r = 0; r < g_size; r++) s += value(r, i);
      return s;
    case BROADCAST:
      return value(g_size - 1, i);
    case ALL_GATHER:
      return value((int)(i / n), i % n);
    default: /* REDUCE_SCATTER, sum: piece `rank` of the sum of every rank's input */
      for (int r = 0; r < g_size; r++) s += value(r, (size_t)g_rank * n + i);
      return s;
  }
}

static toroid_result call(int kind, CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s) {
  switch (kind) {
    case ALL_REDUCE:
      return toroid_all_reduce_stream(g_comm, (void *)a, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, s);
    case BROADCAST:
      return toroid_broadcast_stream(g_comm, (void *)a, (void *)b, n, TOROID_FLOAT32, g_size - 1, s);
    case ALL_GATHER:
      return toroid_all_gather_stream(g_comm, (void *)a, (void *)b, n, TOROID_FLOAT32, s);
    default:
      return toroid_reduce_scatter_stream(g_comm, (void *)a, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, s);
  }
}

/* Check 1 for one collective. Both ranks run it in the same order: both block their streams,
 * both call, then each releases its own flag (the collective needs both streams released). */
static void check_ordered(int kind, CUstream s, CUdeviceptr flagdev, CUdeviceptr a, CUdeviceptr b,
                          float *host, size_t n) {
  const char *name = kind_name[kind];
  size_t nin = in_count(kind, n), nout = out_count(kind, n);
  /* Input and a sentinel-filled output, complete before the test starts. */
  for (size_t j = 0; j < nin; j++) host[j] = value(g_rank, j);
  CU(cuMemcpyHtoDAsync(a, host, nin * sizeof(float), s));
  CU(cuMemsetD32Async(b, SENTINEL, nout, s));
  CU(cuStreamSynchronize(s));

  *g_flag = 0;
  CUresult w = cuStreamWaitValue32(s, flagdev, 1, CU_STREAM_WAIT_VALUE_GEQ);
  if (w != CUDA_SUCCESS && w != CUDA_ERROR_NOT_SUPPORTED)
    FAIL("cuStreamWaitValue32 failed with CUDA error %d", (int)w);
  int blocked = w == CUDA_SUCCESS;
  /* Unsupported: still call the collective (the other rank does), only without the block. */
  watchdog(blocked ? WATCHDOG_S : HANG_S, blocked);
  toroid_result r = call(kind, a, b, n, s);
  watchdog(HANG_S, 0);
  if (r != TOROID_SUCCESS)
    FAIL("%s (stream blocked: %d) returned %d: %s\n  last error: %s", name, blocked, (int)r,
         toroid_get_error_string(r), toroid_get_last_error(g_comm));
  if (blocked) {
    if (g_fired)
      FAIL("%s did not return while its stream was blocked: it returned only after the watchdog "
           "released the stream (%d s), so it waits for earlier work on the stream instead of "
           "enqueueing behind it", name, WATCHDOG_S);
    CUresult q = cuStreamQuery(s);
    if (q != CUDA_ERROR_NOT_READY)
      FAIL("cuStreamQuery right after %s returned %d, expected CUDA_ERROR_NOT_READY (%d): the "
           "stream was blocked", name, (int)q, (int)CUDA_ERROR_NOT_READY);
  }
  /* The consumer: queued behind the collective on the same stream, before the release. */
  CU(cuMemcpyDtoHAsync(host, b, nout * sizeof(float), s));
  *g_flag = 1; /* volatile store: the stream's wait sees it and runs on */
  CU(cuStreamSynchronize(s));
  watchdog(0, 0);
  for (size_t i = 0; i < nout; i++) {
    float want = expected(kind, n, i);
    if (host[i] != want) FAIL("%s: [%zu] of %zu = %g, expected %g", name, i, nout, host[i], want);
  }
  if (blocked)
    printf("ok: %s returned before completion (stream blocked) and the next copy on the stream "
           "saw its result (%zu elements, rank %d)\n", name, nout, g_rank);
  else
    printf("SKIPPED returns-before-completion: cuStreamWaitValue32 unsupported\n"
           "ok: %s result ordered before the next copy on the stream (rank %d)\n", name, g_rank);
}

/* Copies `count` floats of `dev` to `host` on `s` and waits. */
static void fetch(float *host, CUdeviceptr dev, size_t count, CUstream s) {
  CU(cuMemcpyDtoHAsync(host, dev, count * sizeof(float), s));
  CU(cuStreamSynchronize(s));
}

/* The graph's outputs: b = size^6 x (sum of every rank's x), g = every rank's x (all_gather),
 * c = the last rank's x (broadcast), d = size x this rank's x (reduce_scatter of g). */
static void check_graph_outputs(CUstream s, CUdeviceptr b, CUdeviceptr g, CUdeviceptr c, CUdeviceptr d,
                                float *host, size_t n, const char *when) {
  float scale = 1;
  for (int k = 0; k < 6; k++) scale *= (float)g_size;
  fetch(host, b, n, s);
  for (size_t i = 0; i < n; i++) {
    float sum = 0;
    for (int r = 0; r < g_size; r++) sum += small(r, i);
    if (host[i] != sum * scale) FAIL("graph (%s): all_reduce [%zu] = %g, expected %g", when, i, host[i], sum * scale);
  }
  fetch(host, g, (size_t)g_size * n, s);
  for (size_t i = 0; i < (size_t)g_size * n; i++)
    if (host[i] != small((int)(i / n), i % n))
      FAIL("graph (%s): all_gather [%zu] = %g, expected %g", when, i, host[i], small((int)(i / n), i % n));
  fetch(host, c, n, s);
  for (size_t i = 0; i < n; i++)
    if (host[i] != small(g_size - 1, i))
      FAIL("graph (%s): broadcast [%zu] = %g, expected %g", when, i, host[i], small(g_size - 1, i));
  fetch(host, d, n, s);
  for (size_t i = 0; i < n; i++)
    if (host[i] != (float)g_size * small(g_rank, i))
      FAIL("graph (%s): reduce_scatter [%zu] = %g, expected %g", when, i, host[i], (float)g_size * small(g_rank, i));
  printf("ok: CUDA graph of 10 toroid collectives, every output exact after %s (rank %d)\n", when, g_rank);
}

/* A collective recorded into the graph: a refusal (or any error) fails, naming which one. */
#define CAPTURED(idx, what, call)                                                                 \
  do {                                                                                            \
    toroid_result r_ = (call);                                                                    \
    if (r_ != TOROID_SUCCESS)                                                                     \
      FAIL("stream capture: collective %d of 10 (%s) returned %d: %s\n  last error: %s", (idx),  \
           (what), (int)r_, toroid_get_error_string(r_), toroid_get_last_error(g_comm));         \
  } while (0)

static void check_graph(CUstream s, float *host, size_t n) {
  size_t bytes = n * sizeof(float);
  CUdeviceptr x, b, g, c, d;
  CU(cuMemAlloc(&x, bytes));
  CU(cuMemAlloc(&b, bytes));
  CU(cuMemAlloc(&g, (size_t)g_size * bytes));
  CU(cuMemAlloc(&c, bytes));
  CU(cuMemAlloc(&d, bytes));
  for (size_t i = 0; i < n; i++) host[i] = small(g_rank, i);
  CU(cuMemcpyHtoDAsync(x, host, bytes, s));
  CU(cuStreamSynchronize(s));

  /* Relaxed: the library may call driver functions that are not capturable (e.g.
   * cuPointerGetAttribute) while this stream captures. x is never written, so every replay
   * computes the same: b is reset from x first (captured too), then summed in place. */
  watchdog(HANG_S, 0);
  CU(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
  CU(cuMemcpyDtoDAsync(b, x, bytes, s));
  void *vx = (void *)x, *vb = (void *)b, *vg = (void *)g, *vc = (void *)c, *vd = (void *)d;
  CAPTURED(1, "all_reduce x -> b", toroid_all_reduce_stream(g_comm, vx, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(2, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(3, "all_gather x -> g", toroid_all_gather_stream(g_comm, vx, vg, n, TOROID_FLOAT32, s));
  CAPTURED(4, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(5, "broadcast x -> c", toroid_broadcast_stream(g_comm, vx, vc, n, TOROID_FLOAT32, g_size - 1, s));
  CAPTURED(6, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(7, "reduce_scatter g -> d", toroid_reduce_scatter_stream(g_comm, vg, vd, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(8, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(9, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CAPTURED(10, "all_reduce b in place", toroid_all_reduce_stream(g_comm, vb, vb, n, TOROID_FLOAT32, TOROID_SUM, s));
  CUgraph graph;
  CU(cuStreamEndCapture(s, &graph));
  CUgraphExec exec;
  /* cuGraphInstantiateWithFlags: the same 3-argument form in CUDA 11.4 through 13. */
  CU(cuGraphInstantiateWithFlags(&exec, graph, 0));
  printf("ok: 10 toroid collectives captured into a CUDA graph and instantiated (rank %d)\n", g_rank);

  /* Sentinels first, so an output the graph did not write fails. Both ranks replay 1 + 99. */
  CUdeviceptr outs[4] = {b, g, c, d};
  size_t counts[4] = {n, (size_t)g_size * n, n, n};
  for (int k = 0; k < 4; k++) CU(cuMemsetD32Async(outs[k], SENTINEL, counts[k], s));
  CU(cuGraphLaunch(exec, s));
  CU(cuStreamSynchronize(s));
  check_graph_outputs(s, b, g, c, d, host, n, "the first replay");
  for (int k = 0; k < 4; k++) CU(cuMemsetD32Async(outs[k], SENTINEL, counts[k], s));
  for (int k = 1; k < 100; k++) CU(cuGraphLaunch(exec, s)); /* back to back, no host sync */
  CU(cuStreamSynchronize(s));
  check_graph_outputs(s, b, g, c, d, host, n, "100 replays");
  watchdog(0, 0);

  CU(cuGraphExecDestroy(exec));
  CU(cuGraphDestroy(graph));
  CUdeviceptr all[5] = {x, b, g, c, d};
  for (int k = 0; k < 5; k++) CU(cuMemFree(all[k]));
}

int main(void) {
  CHECK(toroid_comm_init_env(&g_comm));
  CHECK(toroid_comm_rank(g_comm, &g_rank));
  CHECK(toroid_comm_size(g_comm, &g_size));
  CU(cuInit(0));
  CUdevice dev;
  CUcontext ctx;
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  /* Non-blocking: the legacy default stream must not order anything around our tests. */
  CUstream stream, gstream;
  CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CU(cuStreamCreate(&gstream, CU_STREAM_NON_BLOCKING));

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_alarm;
  sa.sa_flags = SA_RESTART; /* a library call interrupted by the watchdog carries on */
  sigemptyset(&sa.sa_mask);
  EXPECT(sigaction(SIGALRM, &sa, NULL) == 0);

  /* The flag the stream waits on: page-locked host memory mapped into the device. */
  void *flag_host = NULL;
  CUdeviceptr flagdev;
  CU(cuMemHostAlloc(&flag_host, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP));
  CU(cuMemHostGetDevicePointer(&flagdev, flag_host, 0));
  g_flag = (volatile uint32_t *)flag_host;
  *g_flag = 0;

  const size_t n = (size_t)1 << 20; /* per rank: above any small-message fast path */
  float *host = NULL;               /* page-locked: the consumer's async copy needs it */
  CU(cuMemAllocHost((void **)&host, (size_t)g_size * n * sizeof(float)));
  CUdeviceptr a, b;
  CU(cuMemAlloc(&a, (size_t)g_size * n * sizeof(float)));
  CU(cuMemAlloc(&b, (size_t)g_size * n * sizeof(float)));

  for (int kind = 0; kind < NKINDS; kind++) check_ordered(kind, stream, flagdev, a, b, host, n);
  check_graph(gstream, host, n);

  CU(cuMemFree(a));
  CU(cuMemFree(b));
  CU(cuMemFreeHost(host));
  CU(cuMemFreeHost(flag_host));
  CU(cuStreamDestroy(gstream));
  CU(cuStreamDestroy(stream));
  CU(cuDevicePrimaryCtxRelease(dev));
  CHECK(toroid_comm_destroy(g_comm)); /* its detail is toroid_get_last_error(NULL)'s */
  printf("ordered.c: all checks passed on rank %d\n", g_rank);
  return 0;
}
