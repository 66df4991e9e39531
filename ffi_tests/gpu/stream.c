/* toroid_all_reduce_stream, toroid_broadcast_stream, toroid_all_gather_stream,
 * toroid_reduce_scatter_stream, toroid_reduce_stream, toroid_all_to_all_stream,
 * toroid_send_stream and toroid_recv_stream on device memory from C, with the CUDA driver API (built and
 * run by scripts/gpu-check.sh on a GPU machine, 2 ranks on one GPU under toroid-run; never in
 * the CPU test suite):
 *
 *   cc -I include -I ffi_tests -I $CUDA/include ffi_tests/gpu/stream.c -L DIR -ltoroid -lcuda
 *
 * Each rank fills a device buffer with its own exact values (small integers), runs the
 * collective on a stream of its own, in place and out of place, and checks every element
 * against what it computes for every rank; host memory is refused as an argument error. */
#include <cuda.h>

#include "test_util.h"

#define CU(call)                                                          \
  do {                                                                    \
    CUresult e_ = (call);                                                 \
    if (e_ != CUDA_SUCCESS) FAIL("%s failed with CUDA error %d", #call, (int)e_); \
  } while (0)

static float value(int rank, size_t i) { return (float)((rank * 7919 + i * 31) % 1000); }

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  int size = 0;
  CHECK(toroid_comm_rank(comm, &g_rank));
  CHECK(toroid_comm_size(comm, &size));
  CU(cuInit(0));
  CUdevice dev;
  CUcontext ctx;
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  CUstream stream;
  CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

  /* (Every fill of a device buffer below is queued on `stream`, which was made non-blocking: a
   * copy on the legacy default stream would not be ordered before the toroid call.) */
  /* 12 MB: three staging chunks; 80 MB: two CUDA IPC windows' worth (64 MiB each). */
  const size_t counts[] = {1, 4099, 3000000, 20000000};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    size_t n = counts[c];
    float *host = malloc(n * sizeof(float));
    EXPECT(host != NULL);
    for (size_t i = 0; i < n; i++) host[i] = value(g_rank, i);
    CUdeviceptr a, b;
    CU(cuMemAlloc(&a, n * sizeof(float)));
    CU(cuMemAlloc(&b, n * sizeof(float)));
    CU(cuMemcpyHtoDAsync(a, host, n * sizeof(float), stream));

    /* Out of place, ordered after the copy on the same stream. */
    CHECK(toroid_all_reduce_stream(comm, (void *)a, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
      float want = 0;
      for (int r = 0; r < size; r++) want += value(r, i);
      if (host[i] != want) FAIL("out of place: [%zu] of %zu = %g, expected %g", i, n, host[i], want);
    }
    /* In place on b: every element becomes size x the sum. */
    CHECK(toroid_all_reduce_stream(comm, (void *)b, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
      float want = 0;
      for (int r = 0; r < size; r++) want += value(r, i);
      if (host[i] != want * size) FAIL("in place: [%zu] of %zu = %g, expected %g", i, n, host[i], want * size);
    }
    /* Broadcast a from the last rank into b. */
    CHECK(toroid_broadcast_stream(comm, (void *)a, (void *)b, n, TOROID_FLOAT32, size - 1, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++)
      if (host[i] != value(size - 1, i)) FAIL("broadcast: [%zu] of %zu = %g", i, n, host[i]);
    /* Asynchronous: the work completes, then the result is in b. */
    toroid_work *work = NULL;
    CHECK(toroid_all_reduce_stream_async(comm, (void *)a, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, stream, &work));
    if (work != NULL) {
      CHECK(toroid_work_wait(work, -1));
      toroid_work_free(work);
    }
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
      float want = 0;
      for (int r = 0; r < size; r++) want += value(r, i);
      if (host[i] != want) FAIL("async: [%zu] of %zu = %g, expected %g", i, n, host[i], want);
    }
    /* All-gather of a into g (size x n), then reduce-scatter of g back into b: piece r of the
     * sum over ranks of g is size x (rank r's values). */
    CUdeviceptr g;
    float *all = malloc((size_t)size * n * sizeof(float));
    EXPECT(all != NULL);
    CU(cuMemAlloc(&g, (size_t)size * n * sizeof(float)));
    CHECK(toroid_all_gather_stream(comm, (void *)a, (void *)g, n, TOROID_FLOAT32, stream));
    CU(cuMemcpyDtoH(all, g, (size_t)size * n * sizeof(float)));
    for (int r = 0; r < size; r++)
      for (size_t i = 0; i < n; i++)
        if (all[(size_t)r * n + i] != value(r, i)) FAIL("all_gather: [%d][%zu] of %zu = %g", r, i, n, all[(size_t)r * n + i]);
    CHECK(toroid_reduce_scatter_stream(comm, (void *)g, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++)
      if (host[i] != value(g_rank, i) * size) FAIL("reduce_scatter: [%zu] of %zu = %g", i, n, host[i]);
    /* Reduce of a (max) into b at rank 1 % size, out of place; then in place at the root on a
     * copy of a. Other ranks pass NULL as recvbuf, and their b stays as it was. */
    int root = 1 % size;
    CU(cuMemsetD32Async(b, 0, n, stream));
    CHECK(toroid_reduce_stream(comm, (void *)a, g_rank == root ? (void *)b : NULL, n, TOROID_FLOAT32, TOROID_MAX,
                               root, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
      float want = 0;
      for (int r = 0; r < size; r++) want = value(r, i) > want ? value(r, i) : want;
      if (g_rank != root) want = 0;
      if (host[i] != want) FAIL("reduce: [%zu] of %zu = %g, expected %g", i, n, host[i], want);
    }
    CU(cuMemcpyDtoDAsync(b, a, n * sizeof(float), stream));
    CHECK(toroid_reduce_stream(comm, (void *)b, (void *)b, n, TOROID_FLOAT32, TOROID_SUM, root, stream));
    CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
      float want = 0; /* exact: sums of small integers */
      for (int r = 0; r < size; r++) want += value(r, i);
      if (g_rank != root) want = value(g_rank, i); /* a non-root's sendbuf is only read */
      if (host[i] != want) FAIL("reduce in place: [%zu] of %zu = %g, expected %g", i, n, host[i], want);
    }
    /* All-to-all of g (block j: this rank's values shifted by j) into a fresh buffer, then in
     * place: block r of the result is what rank r put in block `rank`. */
    for (int j = 0; j < size; j++)
      for (size_t i = 0; i < n; i++) all[(size_t)j * n + i] = value(g_rank, i) + (float)j;
    CU(cuMemcpyHtoDAsync(g, all, (size_t)size * n * sizeof(float), stream));
    CUdeviceptr t;
    CU(cuMemAlloc(&t, (size_t)size * n * sizeof(float)));
    for (int in_place = 0; in_place < 2; in_place++) {
      CUdeviceptr dst = in_place ? g : t;
      CHECK(toroid_all_to_all_stream(comm, (void *)g, (void *)dst, n, TOROID_FLOAT32, stream));
      CU(cuMemcpyDtoH(all, dst, (size_t)size * n * sizeof(float)));
      for (int r = 0; r < size; r++)
        for (size_t i = 0; i < n; i++)
          if (all[(size_t)r * n + i] != value(r, i) + (float)g_rank)
            FAIL("all_to_all (in place %d): [%d][%zu] of %zu = %g", in_place, r, i, n, all[(size_t)r * n + i]);
      if (!in_place) { /* g keeps this rank's blocks for the in-place round */
        for (int j = 0; j < size; j++)
          for (size_t i = 0; i < n; i++) all[(size_t)j * n + i] = value(g_rank, i) + (float)j;
      }
    }
    CU(cuMemFree(t));
    /* Send and receive around the ring: a to the right, into b from the left. */
    if (size > 1) {
      int right = (g_rank + 1) % size, left = (g_rank + size - 1) % size;
      if (g_rank % 2 == 0) {
        CHECK(toroid_send_stream(comm, (void *)a, n, TOROID_FLOAT32, right, stream));
        CHECK(toroid_recv_stream(comm, (void *)b, n, TOROID_FLOAT32, left, stream));
      } else {
        CHECK(toroid_recv_stream(comm, (void *)b, n, TOROID_FLOAT32, left, stream));
        CHECK(toroid_send_stream(comm, (void *)a, n, TOROID_FLOAT32, right, stream));
      }
      CU(cuMemcpyDtoH(host, b, n * sizeof(float)));
      for (size_t i = 0; i < n; i++)
        if (host[i] != value(left, i)) FAIL("send/recv: [%zu] of %zu = %g, expected %g", i, n, host[i], value(left, i));
    }
    CU(cuMemFree(g));
    free(all);
    CU(cuMemFree(a));
    CU(cuMemFree(b));
    free(host);
  }
  float h[4] = {0};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_stream(comm, h, h, 4, TOROID_FLOAT32, TOROID_SUM, stream));
  EXPECT(strstr(toroid_get_last_error(comm), "host memory") != NULL);
  CU(cuStreamDestroy(stream));
  CU(cuDevicePrimaryCtxRelease(dev));
  CHECK(toroid_comm_destroy(comm));
  printf("rank %d: stream collectives on device memory passed\n", g_rank);
  return 0;
}
