/* Correctness of every collective through the C ABI, across the ranks started by toroid-run.
 *
 *   toroid-run -n N -- ./collectives MODE [DIR]
 *
 * MODE: how the communicator is created: env (toroid_comm_init_env), config (toroid_comm_init)
 * or store (toroid_comm_init_with_store over a file store in DIR).
 *
 * Every rank generates every rank's input from a seed, so it computes the reference result
 * itself: exactly for integers (wrapping, as the library does) and for 16-bit floats holding
 * small integers; within a tolerance for float sums, products and averages. Each element is
 * checked. */
#include "test_util.h"

static int g_size;
static long g_checks;

static int is_float(toroid_datatype d) {
  return d == TOROID_FLOAT16 || d == TOROID_BFLOAT16 || d == TOROID_FLOAT32 || d == TOROID_FLOAT64;
}

static int is_signed(toroid_datatype d) {
  return d == TOROID_INT8 || d == TOROID_INT32 || d == TOROID_INT64;
}

static double load_f(toroid_datatype d, const unsigned char *p, size_t i) {
  switch (d) {
    case TOROID_FLOAT16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      return f16_to_f32(h);
    }
    case TOROID_BFLOAT16: {
      uint16_t h;
      memcpy(&h, p + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case TOROID_FLOAT32: {
      float f;
      memcpy(&f, p + 4 * i, 4);
      return f;
    }
    default: {
      double f;
      memcpy(&f, p + 8 * i, 8);
      return f;
    }
  }
}

static void store_f(toroid_datatype d, unsigned char *p, size_t i, double v) {
  switch (d) {
    case TOROID_FLOAT16: {
      uint16_t h = f32_to_f16((float)v);
      memcpy(p + 2 * i, &h, 2);
      break;
    }
    case TOROID_BFLOAT16: {
      uint16_t h = f32_to_bf16((float)v);
      memcpy(p + 2 * i, &h, 2);
      break;
    }
    case TOROID_FLOAT32: {
      float f = (float)v;
      memcpy(p + 4 * i, &f, 4);
      break;
    }
    default:
      memcpy(p + 8 * i, &v, 8);
  }
}

/* Integer element i as raw bits, zero-extended. */
static uint64_t load_u(toroid_datatype d, const unsigned char *p, size_t i) {
  size_t es = dtype_size(d);
  uint64_t v = 0;
  memcpy(&v, p + es * i, es); /* little-endian */
  return v;
}

static void store_u(toroid_datatype d, unsigned char *p, size_t i, uint64_t v) {
  size_t es = dtype_size(d);
  memcpy(p + es * i, &v, es);
}

static int64_t sext(toroid_datatype d, uint64_t v) {
  int bits = (int)dtype_size(d) * 8;
  if (bits == 64) return (int64_t)v;
  uint64_t m = 1ull << (bits - 1);
  v &= (1ull << bits) - 1;
  return (int64_t)((v ^ m) - m);
}

/* Input of `rank` for test `tid`: random bits for integers; values suited to `op` for floats. */
static void gen(toroid_datatype d, toroid_redop op, uint64_t tid, int rank, size_t count,
                unsigned char *buf) {
  uint64_t s = seed_of(tid, rank);
  for (size_t i = 0; i < count; i++) {
    uint64_t x = rng_next(&s);
    if (!is_float(d)) {
      store_u(d, buf, i, x);
      continue;
    }
    double u = (double)(x >> 11) / 9007199254740992.0; /* [0, 1) */
    double v;
    int small = d == TOROID_FLOAT16 || d == TOROID_BFLOAT16;
    if (op == TOROID_PROD) {
      v = small ? (double)((int)(x % 4) - 2 + ((x % 4) >= 2)) /* -2,-1,1,2 */ : 0.5 + u;
    } else if (small) {
      v = (double)((int)(x % 17) - 8); /* -8..8: sums and products stay exact */
    } else {
      v = 2.0 * u - 1.0;
    }
    store_f(d, buf, i, v);
  }
}

/* expected[i] = op over ranks of in[r][i] (rank order). */
static void reference(toroid_datatype d, toroid_redop op, int n, size_t count,
                      unsigned char **in, size_t off, unsigned char *expected) {
  for (size_t i = 0; i < count; i++) {
    if (is_float(d)) {
      double acc = load_f(d, in[0], off + i);
      for (int r = 1; r < n; r++) {
        double v = load_f(d, in[r], off + i);
        switch (op) {
          case TOROID_SUM:
          case TOROID_AVG: acc += v; break;
          case TOROID_PROD: acc *= v; break;
          case TOROID_MIN: acc = v < acc ? v : acc; break;
          case TOROID_MAX: acc = v > acc ? v : acc; break;
        }
      }
      if (op == TOROID_AVG) acc /= n;
      store_f(d, expected, i, acc);
    } else {
      uint64_t acc = load_u(d, in[0], off + i);
      for (int r = 1; r < n; r++) {
        uint64_t v = load_u(d, in[r], off + i);
        int less = is_signed(d) ? sext(d, v) < sext(d, acc) : v < acc;
        int greater = is_signed(d) ? sext(d, v) > sext(d, acc) : v > acc;
        switch (op) {
          case TOROID_SUM: acc += v; break;
          case TOROID_PROD: acc *= v; break;
          case TOROID_MIN: acc = less ? v : acc; break;
          case TOROID_MAX: acc = greater ? v : acc; break;
          case TOROID_AVG: FAIL("avg on integers has no reference");
        }
      }
      store_u(d, expected, i, acc);
    }
  }
}

/* Tolerance of a float result: exact where the inputs make it exact. */
static double tolerance(toroid_datatype d, toroid_redop op, int n) {
  int small = d == TOROID_FLOAT16 || d == TOROID_BFLOAT16;
  if (op == TOROID_MIN || op == TOROID_MAX) return 0;
  if (small) return op == TOROID_AVG ? 0.07 : 0; /* integer-valued sums and products are exact */
  double eps = d == TOROID_FLOAT32 ? 1e-5 : 1e-12;
  return eps * n * (op == TOROID_PROD ? 8 : 1);
}

static void verify(const char *what, toroid_datatype d, toroid_redop op, size_t count,
                   const unsigned char *got, const unsigned char *expected) {
  double tol = tolerance(d, op, g_size);
  for (size_t i = 0; i < count; i++) {
    g_checks++;
    if (is_float(d)) {
      double g = load_f(d, got, i), e = load_f(d, expected, i);
      if (!(fabs(g - e) <= tol))
        FAIL("%s: dtype %d op %d count %zu: element %zu is %.9g, expected %.9g (tolerance %g)",
             what, (int)d, (int)op, count, i, g, e, tol);
    } else {
      uint64_t g = load_u(d, got, i), e = load_u(d, expected, i);
      if (g != e)
        FAIL("%s: dtype %d op %d count %zu: element %zu is %llu, expected %llu", what, (int)d,
             (int)op, count, i, (unsigned long long)g, (unsigned long long)e);
    }
  }
}

static void verify_bytes(const char *what, const unsigned char *got, const unsigned char *expected,
                         size_t bytes) {
  g_checks += (long)bytes;
  if (bytes && memcmp(got, expected, bytes) != 0) {
    size_t i = 0;
    while (got[i] == expected[i]) i++;
    FAIL("%s: byte %zu of %zu is %u, expected %u", what, i, bytes, got[i], expected[i]);
  }
}

static unsigned char **inputs(toroid_datatype d, toroid_redop op, uint64_t tid, size_t count) {
  unsigned char **in = malloc(sizeof(*in) * (size_t)g_size);
  for (int r = 0; r < g_size; r++) {
    in[r] = malloc(count * dtype_size(d) + 1);
    gen(d, op, tid, r, count, in[r]);
  }
  return in;
}

static void free_inputs(unsigned char **in) {
  for (int r = 0; r < g_size; r++) free(in[r]);
  free(in);
}

static const size_t COUNTS[] = {0, 1, 7, 4099};
#define NCOUNTS (sizeof COUNTS / sizeof COUNTS[0])
static uint64_t g_tid = 1;

static void test_all_reduce(toroid_comm *comm, toroid_datatype d, toroid_redop op, size_t count,
                            int in_place) {
  size_t bytes = count * dtype_size(d);
  unsigned char **in = inputs(d, op, g_tid++, count);
  unsigned char *expected = malloc(bytes + 1);
  reference(d, op, g_size, count, in, 0, expected);
  unsigned char *send = malloc(bytes + 1);
  memcpy(send, in[g_rank], bytes);
  if (in_place) {
    CHECK(toroid_all_reduce(comm, send, send, count, d, op));
    verify("all_reduce in place", d, op, count, send, expected);
  } else {
    unsigned char *recv = malloc(bytes + 1);
    CHECK(toroid_all_reduce(comm, send, recv, count, d, op));
    verify("all_reduce", d, op, count, recv, expected);
    verify_bytes("all_reduce input untouched", send, in[g_rank], bytes);
    free(recv);
  }
  free(send);
  free(expected);
  free_inputs(in);
}

/* mode 0: out of place; 1: recvbuf == sendbuf + rank*count (NCCL); 2: recvbuf == sendbuf. */
static void test_reduce_scatter(toroid_comm *comm, toroid_datatype d, toroid_redop op, size_t count,
                                int mode) {
  size_t es = dtype_size(d), piece = count * es;
  unsigned char **in = inputs(d, op, g_tid++, count * (size_t)g_size);
  unsigned char *expected = malloc(piece + 1);
  reference(d, op, g_size, count, in, count * (size_t)g_rank, expected);
  unsigned char *send = malloc(piece * (size_t)g_size + 1);
  memcpy(send, in[g_rank], piece * (size_t)g_size);
  unsigned char *recv = malloc(piece + 1);
  unsigned char *out = mode == 0 ? recv : mode == 1 ? send + piece * (size_t)g_rank : send;
  CHECK(toroid_reduce_scatter(comm, send, out, count, d, op));
  verify(mode == 0 ? "reduce_scatter" : mode == 1 ? "reduce_scatter in place (NCCL)"
                                                  : "reduce_scatter in place (front)",
         d, op, count, out, expected);
  if (mode == 0) verify_bytes("reduce_scatter input untouched", send, in[g_rank], piece * (size_t)g_size);
  free(recv);
  free(send);
  free(expected);
  free_inputs(in);
}

/* mode 0: out of place; 1: sendbuf == recvbuf + rank*count (NCCL); 2: sendbuf == recvbuf. */
static void test_all_gather(toroid_comm *comm, toroid_datatype d, size_t count, int mode) {
  size_t es = dtype_size(d), piece = count * es, total = piece * (size_t)g_size;
  unsigned char **in = inputs(d, TOROID_SUM, g_tid++, count);
  unsigned char *expected = malloc(total + 1);
  for (int r = 0; r < g_size; r++) memcpy(expected + piece * (size_t)r, in[r], piece);
  unsigned char *recv = malloc(total + 1);
  memset(recv, 0xAB, total);
  const unsigned char *send;
  unsigned char *own = NULL;
  if (mode == 0) {
    own = malloc(piece + 1);
    memcpy(own, in[g_rank], piece);
    send = own;
  } else if (mode == 1) {
    memcpy(recv + piece * (size_t)g_rank, in[g_rank], piece);
    send = recv + piece * (size_t)g_rank;
  } else {
    memcpy(recv, in[g_rank], piece);
    send = recv;
  }
  CHECK(toroid_all_gather(comm, send, recv, count, d));
  verify_bytes(mode == 0 ? "all_gather" : mode == 1 ? "all_gather in place (NCCL)"
                                                    : "all_gather in place (front)",
               recv, expected, total);
  free(own);
  free(recv);
  free(expected);
  free_inputs(in);
}

/* mode 0: out of place (non-roots pass sendbuf NULL); 1: in place. */
static void test_broadcast(toroid_comm *comm, toroid_datatype d, size_t count, int root, int mode) {
  size_t bytes = count * dtype_size(d);
  unsigned char **in = inputs(d, TOROID_SUM, g_tid++, count);
  unsigned char *buf = malloc(bytes + 1);
  memset(buf, 0x5C, bytes);
  unsigned char *send = NULL;
  if (g_rank == root) {
    if (mode == 0) {
      send = malloc(bytes + 1);
      memcpy(send, in[root], bytes);
    } else {
      memcpy(buf, in[root], bytes);
      send = buf;
    }
  } else if (mode == 1) {
    send = buf;
  }
  CHECK(toroid_broadcast(comm, send, buf, count, d, root));
  verify_bytes(mode == 0 ? "broadcast" : "broadcast in place", buf, in[root], bytes);
  if (send != buf) free(send);
  free(buf);
  free_inputs(in);
}

/* Non-roots pass recvbuf NULL; the root is out of place (mode 0) or in place (mode 1). */
static void test_reduce(toroid_comm *comm, toroid_datatype d, toroid_redop op, size_t count,
                        int root, int mode) {
  size_t bytes = count * dtype_size(d);
  unsigned char **in = inputs(d, op, g_tid++, count);
  unsigned char *expected = malloc(bytes + 1);
  reference(d, op, g_size, count, in, 0, expected);
  unsigned char *send = malloc(bytes + 1);
  memcpy(send, in[g_rank], bytes);
  unsigned char *recv = NULL;
  if (g_rank == root) recv = mode == 0 ? malloc(bytes + 1) : send;
  CHECK(toroid_reduce(comm, send, recv, count, d, op, root));
  if (g_rank == root) {
    verify("reduce", d, op, count, recv, expected);
  } else {
    verify_bytes("reduce: non-root input untouched", send, in[g_rank], bytes);
  }
  if (recv != send) free(recv);
  free(send);
  free(expected);
  free_inputs(in);
}

/* The elements rank i sends rank j in all_to_all_v test `tid`: 0 to max. */
static size_t v_count(int tid, int i, int j, size_t max) {
  return ((size_t)tid * 11 + (size_t)i * 5 + (size_t)j * 3 + (size_t)(i * j)) % (max + 1);
}

/* Blocks of their own sizes (some empty); blocking or queued. Every rank's whole input is
   built from its seed, so this rank cuts what it should receive from each sender's. */
static void test_all_to_all_v(toroid_comm *comm, toroid_datatype d, size_t max, int queued) {
  size_t es = dtype_size(d);
  int tid = g_tid++;
  size_t send_counts[64], recv_counts[64], total_in[64] = {0}, recv_total = 0;
  if (g_size > 64) {
    fprintf(stderr, "test_all_to_all_v: more than 64 ranks\n");
    exit(1);
  }
  for (int i = 0; i < g_size; i++)
    for (int j = 0; j < g_size; j++) total_in[i] += v_count(tid, i, j, max);
  size_t most = 0;
  for (int i = 0; i < g_size; i++) most = total_in[i] > most ? total_in[i] : most;
  unsigned char **in = inputs(d, TOROID_SUM, tid, most);
  for (int j = 0; j < g_size; j++) {
    send_counts[j] = v_count(tid, g_rank, j, max);
    recv_counts[j] = v_count(tid, j, g_rank, max);
    recv_total += recv_counts[j];
  }
  unsigned char *expected = malloc(recv_total * es + 1), *recv = malloc(recv_total * es + 1);
  size_t at = 0;
  for (int j = 0; j < g_size; j++) {
    size_t before = 0;
    for (int k = 0; k < g_rank; k++) before += v_count(tid, j, k, max);
    memcpy(expected + at * es, in[j] + before * es, recv_counts[j] * es);
    at += recv_counts[j];
  }
  memset(recv, 0xA5, recv_total * es);
  if (queued) {
    toroid_work *w;
    CHECK(toroid_all_to_all_v_async(comm, in[g_rank], send_counts, recv, recv_counts, d, &w));
    CHECK(toroid_work_wait(w, -1));
    toroid_work_free(w);
  } else {
    CHECK(toroid_all_to_all_v(comm, in[g_rank], send_counts, recv, recv_counts, d));
  }
  verify_bytes(queued ? "async all_to_all_v" : "all_to_all_v", recv, expected, recv_total * es);
  free(recv);
  free(expected);
  free_inputs(in);
}

static void test_all_to_all(toroid_comm *comm, toroid_datatype d, size_t count, int in_place) {
  size_t piece = count * dtype_size(d), total = piece * (size_t)g_size;
  unsigned char **in = inputs(d, TOROID_SUM, g_tid++, count * (size_t)g_size);
  unsigned char *expected = malloc(total + 1);
  for (int j = 0; j < g_size; j++)
    memcpy(expected + piece * (size_t)j, in[j] + piece * (size_t)g_rank, piece);
  unsigned char *send = malloc(total + 1);
  memcpy(send, in[g_rank], total);
  unsigned char *recv = in_place ? send : malloc(total + 1);
  CHECK(toroid_all_to_all(comm, send, recv, count, d));
  verify_bytes(in_place ? "all_to_all in place" : "all_to_all", recv, expected, total);
  if (recv != send) free(recv);
  free(send);
  free(expected);
  free_inputs(in);
}

static void test_send_recv(toroid_comm *comm, size_t count) {
  int next = (g_rank + 1) % g_size, prev = (g_rank + g_size - 1) % g_size;
  size_t bytes = count * 8;
  unsigned char **in = inputs(TOROID_FLOAT64, TOROID_SUM, g_tid++, count);
  unsigned char *got = malloc(bytes + 1);
  /* Even ranks send first, odd ranks receive first: no cycle of blocked senders. */
  if (g_rank % 2 == 0) {
    CHECK(toroid_send(comm, in[g_rank], count, TOROID_FLOAT64, next));
    CHECK(toroid_recv(comm, got, count, TOROID_FLOAT64, prev));
  } else {
    CHECK(toroid_recv(comm, got, count, TOROID_FLOAT64, prev));
    CHECK(toroid_send(comm, in[g_rank], count, TOROID_FLOAT64, next));
  }
  verify_bytes("send/recv", got, in[prev], bytes);
  free(got);
  free_inputs(in);
}

/* Receive from any source: every other rank sends rank 0 its input; rank 0 takes them in
 * arrival order (blocking, then async with toroid_work_source) and checks each sender once per
 * round and every byte. */
static void test_recv_any(toroid_comm *comm, size_t count) {
  size_t bytes = count * 4;
  unsigned char **in = inputs(TOROID_INT32, TOROID_SUM, g_tid++, count);
  for (int round = 0; round < 2; round++) {
    if (g_rank == 0) {
      int seen[64] = {0};
      unsigned char *got = malloc(bytes + 1);
      for (int k = 1; k < g_size; k++) {
        int src = -1;
        if (round == 0) {
          CHECK(toroid_recv_any(comm, got, count, TOROID_INT32, &src));
        } else {
          toroid_work *w;
          CHECK(toroid_recv_any_async(comm, got, count, TOROID_INT32, &w));
          CHECK(toroid_work_wait(w, -1));
          CHECK(toroid_work_source(w, &src));
          EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_work_source(w, NULL));
          toroid_work_free(w);
        }
        if (src <= 0 || src >= g_size || src >= 64 || seen[src]) FAIL("recv_any: sender %d (round %d)", src, round);
        seen[src] = 1;
        verify_bytes("recv_any", got, in[src], bytes);
      }
      free(got);
    } else {
      CHECK(toroid_send(comm, in[g_rank], count, TOROID_INT32, 0));
    }
    /* A work that is not a receive from any source has no sender. */
    toroid_work *bw;
    int src = -7;
    CHECK(toroid_barrier_async(comm, &bw));
    CHECK(toroid_work_wait(bw, -1));
    EXPECT_CODE(TOROID_INVALID_USAGE, toroid_work_source(bw, &src));
    EXPECT(src == -7);
    toroid_work_free(bw);
  }
  free_inputs(in);
}

/* Several async operations in flight, including the in-place forms that move data. */
static void test_async(toroid_comm *comm) {
  const size_t count = 3001;
  int n = g_size, root = n - 1;
  /* all_reduce f32 sum */
  unsigned char **ar_in = inputs(TOROID_FLOAT32, TOROID_SUM, g_tid++, count);
  unsigned char *ar_exp = malloc(count * 4), *ar = malloc(count * 4);
  reference(TOROID_FLOAT32, TOROID_SUM, n, count, ar_in, 0, ar_exp);
  memcpy(ar, ar_in[g_rank], count * 4);
  /* reduce_scatter int32 max, recvbuf == sendbuf */
  unsigned char **rs_in = inputs(TOROID_INT32, TOROID_MAX, g_tid++, count * (size_t)n);
  unsigned char *rs_exp = malloc(count * 4), *rs = malloc(count * 4 * (size_t)n);
  reference(TOROID_INT32, TOROID_MAX, n, count, rs_in, count * (size_t)g_rank, rs_exp);
  memcpy(rs, rs_in[g_rank], count * 4 * (size_t)n);
  /* all_gather f64, sendbuf == recvbuf */
  unsigned char **ag_in = inputs(TOROID_FLOAT64, TOROID_SUM, g_tid++, count);
  unsigned char *ag = malloc(count * 8 * (size_t)n), *ag_exp = malloc(count * 8 * (size_t)n);
  for (int r = 0; r < n; r++) memcpy(ag_exp + count * 8 * (size_t)r, ag_in[r], count * 8);
  memcpy(ag, ag_in[g_rank], count * 8);
  /* broadcast u8 from the last rank, in place */
  unsigned char **bc_in = inputs(TOROID_UINT8, TOROID_SUM, g_tid++, count);
  unsigned char *bc = malloc(count);
  memcpy(bc, bc_in[g_rank], count);
  /* reduce i64 sum to rank 0 */
  unsigned char **rd_in = inputs(TOROID_INT64, TOROID_SUM, g_tid++, count);
  unsigned char *rd_exp = malloc(count * 8), *rd = malloc(count * 8);
  reference(TOROID_INT64, TOROID_SUM, n, count, rd_in, 0, rd_exp);

  toroid_work *w[8];
  CHECK(toroid_all_reduce_async(comm, ar, ar, count, TOROID_FLOAT32, TOROID_SUM, &w[0]));
  CHECK(toroid_reduce_scatter_async(comm, rs, rs, count, TOROID_INT32, TOROID_MAX, &w[1]));
  CHECK(toroid_all_gather_async(comm, ag, ag, count, TOROID_FLOAT64, &w[2]));
  CHECK(toroid_broadcast_async(comm, bc, bc, count, TOROID_UINT8, root, &w[3]));
  CHECK(toroid_reduce_async(comm, rd_in[g_rank], g_rank == 0 ? rd : NULL, count, TOROID_INT64,
                            TOROID_SUM, 0, &w[4]));
  CHECK(toroid_barrier_async(comm, &w[5]));
  /* The same buffer again, after the all_reduce: issue order is kept. */
  CHECK(toroid_all_reduce_async(comm, ar, ar, count, TOROID_FLOAT32, TOROID_MAX, &w[6]));
  CHECK(toroid_barrier_async(comm, &w[7]));
  int done = 0;
  for (int spins = 0; !done; spins++) {
    CHECK(toroid_work_test(w[7], &done));
    if (spins > 200000) FAIL("async work did not complete");
    if (!done) {
      struct timespec nap = {0, 100000};
      nanosleep(&nap, NULL);
    }
  }
  for (int i = 0; i < 8; i++) {
    CHECK(toroid_work_wait(w[i], -1));
    CHECK(toroid_work_wait(w[i], 0)); /* finished: returns its result again at once */
    toroid_work_free(w[i]);
  }
  /* ar = max over ranks of the sums = the sums (all equal). */
  verify("async all_reduce then max", TOROID_FLOAT32, TOROID_SUM, count, ar, ar_exp);
  verify("async reduce_scatter (front)", TOROID_INT32, TOROID_MAX, count, rs, rs_exp);
  verify_bytes("async all_gather (front)", ag, ag_exp, count * 8 * (size_t)n);
  verify_bytes("async broadcast", bc, bc_in[root], count);
  if (g_rank == 0) verify("async reduce", TOROID_INT64, TOROID_SUM, count, rd, rd_exp);

  /* A work freed before it completes still runs; a later blocking call orders after it. */
  unsigned char *late = malloc(count * 4);
  memcpy(late, ar_in[g_rank], count * 4);
  toroid_work *lw;
  CHECK(toroid_all_reduce_async(comm, late, late, count, TOROID_FLOAT32, TOROID_SUM, &lw));
  toroid_work_free(lw);
  CHECK(toroid_barrier(comm));
  verify("freed async all_reduce", TOROID_FLOAT32, TOROID_SUM, count, late, ar_exp);

  /* Async send/recv between pairs. */
  if (n >= 2 && g_rank < 2) {
    unsigned char *got = malloc(count * 8);
    toroid_work *sw, *rw;
    int peer = 1 - g_rank;
    CHECK(toroid_send_async(comm, ag_in[g_rank], count, TOROID_FLOAT64, peer, &sw));
    CHECK(toroid_recv_async(comm, got, count, TOROID_FLOAT64, peer, &rw));
    CHECK(toroid_work_wait(sw, -1));
    CHECK(toroid_work_wait(rw, -1));
    toroid_work_free(sw);
    toroid_work_free(rw);
    verify_bytes("async send/recv", got, ag_in[peer], count * 8);
    free(got);
  }
  /* Async all_to_all. */
  {
    unsigned char **in = inputs(TOROID_UINT32, TOROID_SUM, g_tid++, count * (size_t)n);
    unsigned char *out = malloc(count * 4 * (size_t)n), *exp = malloc(count * 4 * (size_t)n);
    for (int j = 0; j < n; j++) memcpy(exp + count * 4 * (size_t)j, in[j] + count * 4 * (size_t)g_rank, count * 4);
    toroid_work *aw;
    CHECK(toroid_all_to_all_async(comm, in[g_rank], out, count, TOROID_UINT32, &aw));
    CHECK(toroid_work_wait(aw, -1));
    toroid_work_free(aw);
    verify_bytes("async all_to_all", out, exp, count * 4 * (size_t)n);
    free(out);
    free(exp);
    free_inputs(in);
  }
  free(late);
  free(ar_exp), free(ar), free(rs_exp), free(rs), free(ag), free(ag_exp), free(bc), free(rd_exp), free(rd);
  free_inputs(ar_in), free_inputs(rs_in), free_inputs(ag_in), free_inputs(bc_in), free_inputs(rd_in);
}

static void test_split(toroid_comm *comm) {
  /* Two colors by parity, ordered by descending rank; with 3+ ranks the last one opts out. */
  int opt_out = g_size >= 3 && g_rank == g_size - 1;
  toroid_comm *sub = (toroid_comm *)&sub; /* must be overwritten */
  CHECK(toroid_comm_split(comm, opt_out ? TOROID_SPLIT_NOCOLOR : g_rank % 2, -g_rank, &sub));
  if (opt_out) {
    EXPECT(sub == NULL);
    return;
  }
  EXPECT(sub != NULL);
  int members[16], m = 0, me = -1;
  for (int r = g_size - 1; r >= 0; r--) {
    if (r % 2 != g_rank % 2 || (g_size >= 3 && r == g_size - 1)) continue;
    if (r == g_rank) me = m;
    members[m++] = r;
  }
  int srank = -1, ssize = -1;
  CHECK(toroid_comm_rank(sub, &srank));
  CHECK(toroid_comm_size(sub, &ssize));
  EXPECT(ssize == m && srank == me);
  int64_t v = g_rank, want = 0;
  for (int i = 0; i < m; i++) want += members[i];
  CHECK(toroid_all_reduce(sub, &v, &v, 1, TOROID_INT64, TOROID_SUM));
  EXPECT(v == want);
  g_checks++;
  CHECK(toroid_comm_destroy(sub));
}

int main(int argc, char **argv) {
  if (argc < 2) FAIL("usage: collectives env|config|store|store_config [DIR]");
  setvbuf(stdout, NULL, _IOLBF, 0);
  toroid_comm *comm = init_comm(argv[1], argc > 2 ? argv[2] : NULL);
  CHECK(toroid_comm_rank(comm, &g_rank));
  CHECK(toroid_comm_size(comm, &g_size));
  EXPECT(g_rank == env_int("TOROID_RANK") && g_size == env_int("TOROID_WORLD_SIZE"));

  static const toroid_datatype ALL_TYPES[] = {TOROID_INT8,  TOROID_UINT8,   TOROID_INT32,
                                              TOROID_UINT32, TOROID_INT64,   TOROID_UINT64,
                                              TOROID_FLOAT16, TOROID_BFLOAT16, TOROID_FLOAT32,
                                              TOROID_FLOAT64};
  static const toroid_redop ALL_OPS[] = {TOROID_SUM, TOROID_PROD, TOROID_MIN, TOROID_MAX, TOROID_AVG};
  int k = 0;
  for (size_t t = 0; t < 10; t++)
    for (size_t o = 0; o < 5; o++) {
      if (ALL_OPS[o] == TOROID_AVG && !is_float(ALL_TYPES[t])) continue;
      for (size_t c = 0; c < NCOUNTS; c++) test_all_reduce(comm, ALL_TYPES[t], ALL_OPS[o], COUNTS[c], k++ % 2);
    }
  test_all_reduce(comm, TOROID_FLOAT32, TOROID_SUM, (1u << 18) + 3, 0);
  test_all_reduce(comm, TOROID_INT64, TOROID_MAX, (1u << 17) + 1, 1);

  static const toroid_datatype RS_TYPES[] = {TOROID_INT32, TOROID_FLOAT32, TOROID_FLOAT64, TOROID_BFLOAT16};
  static const toroid_redop RS_OPS[] = {TOROID_SUM, TOROID_MAX, TOROID_AVG};
  for (size_t t = 0; t < 4; t++)
    for (size_t o = 0; o < 3; o++) {
      if (RS_OPS[o] == TOROID_AVG && !is_float(RS_TYPES[t])) continue;
      for (size_t c = 0; c < NCOUNTS; c++)
        for (int mode = 0; mode < 3; mode++) test_reduce_scatter(comm, RS_TYPES[t], RS_OPS[o], COUNTS[c], mode);
    }
  test_reduce_scatter(comm, TOROID_FLOAT32, TOROID_SUM, 65537, 2);

  static const toroid_datatype AG_TYPES[] = {TOROID_INT8, TOROID_INT32, TOROID_FLOAT64, TOROID_FLOAT16};
  for (size_t t = 0; t < 4; t++)
    for (size_t c = 0; c < NCOUNTS; c++)
      for (int mode = 0; mode < 3; mode++) test_all_gather(comm, AG_TYPES[t], COUNTS[c], mode);
  test_all_gather(comm, TOROID_UINT8, 100003, 2);

  for (int root = 0; root < g_size; root++)
    for (size_t c = 0; c < NCOUNTS; c++)
      for (int mode = 0; mode < 2; mode++) {
        test_broadcast(comm, TOROID_FLOAT32, COUNTS[c], root, mode);
        test_broadcast(comm, TOROID_UINT64, COUNTS[c], root, mode);
        test_reduce(comm, TOROID_INT32, TOROID_SUM, COUNTS[c], root, mode);
        test_reduce(comm, TOROID_FLOAT64, TOROID_MIN, COUNTS[c], root, mode);
      }
  test_broadcast(comm, TOROID_UINT8, 300007, g_size / 2, 0);
  test_reduce(comm, TOROID_FLOAT32, TOROID_AVG, 70001, g_size - 1, 0);

  for (size_t c = 0; c < NCOUNTS; c++) {
    test_all_to_all(comm, TOROID_INT32, COUNTS[c], 0);
    test_all_to_all(comm, TOROID_UINT8, COUNTS[c], 1);
    test_all_to_all_v(comm, TOROID_FLOAT64, COUNTS[c], (int)(c % 2));
    test_send_recv(comm, COUNTS[c]);
  }
  test_send_recv(comm, 200003);
  for (size_t c = 0; c < NCOUNTS; c++) test_recv_any(comm, COUNTS[c]);
  test_recv_any(comm, 100001);
  CHECK(toroid_barrier(comm));

  test_async(comm);
  test_split(comm);

  CHECK(toroid_barrier(comm));
  CHECK(toroid_comm_destroy(comm));
  printf("rank %d of %d: collectives passed (%ld element checks, init %s)\n", g_rank, g_size,
         g_checks, argv[1]);
  return 0;
}
