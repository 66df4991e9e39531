/* toroid_all_reduce_wire and toroid_all_reduce_wire_async: float32 and float64 all-reduces
 * whose bytes travel in bfloat16 or float16. Every rank computes every rank's random input
 * (seeded by rank), so each element of the result is checked against the exact sum (in long
 * double) and the documented bound, per element,
 *   |result - exact| <= (2u + u^2) sum_r |x_r| + n 2^-24 sum_r |x_r|   (u = 2^-8 bf16, 2^-11 f16),
 * divided by n for TOROID_AVG; the rounding shows (some element differs from the plain
 * all-reduce's), every rank holds the same bits (checked by an all-gather of a hash), and the
 * misuses fail: an integer wire type, a value that is no type. */
#include "test_util.h"

#define COUNT 4099

static double input(uint64_t *s, int scale) {
  /* uniform in (-1, 1) times 10^(scale - 2): magnitudes from 0.01 to 100 */
  double x = (double)(rng_next(s) >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  static const double scales[] = {0.01, 0.1, 1.0, 10.0, 100.0};
  return x * scales[scale % 5];
}

static uint64_t fnv(const void *p, size_t len) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < len; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static void check_one(toroid_comm *comm, int size, toroid_datatype dtype, toroid_redop op,
                      toroid_datatype wire, int async, uint64_t test) {
  static float f[COUNT], fplain[COUNT];
  static double d[COUNT], dplain[COUNT];
  static long double exact[COUNT], mag[COUNT];
  int is_f32 = dtype == TOROID_FLOAT32;
  for (int i = 0; i < COUNT; i++) exact[i] = mag[i] = 0;
  for (int r = 0; r < size; r++) {
    uint64_t s = seed_of(test, r);
    for (int i = 0; i < COUNT; i++) {
      double x = input(&s, i);
      if (is_f32) x = (float)x;
      exact[i] += x;
      mag[i] += x < 0 ? -x : x;
      if (r == g_rank) {
        f[i] = fplain[i] = (float)x;
        d[i] = dplain[i] = x;
      }
    }
  }
  void *buf = is_f32 ? (void *)f : (void *)d;
  void *plain = is_f32 ? (void *)fplain : (void *)dplain;
  if (async) {
    toroid_work *w = NULL;
    CHECK(toroid_all_reduce_wire_async(comm, buf, buf, COUNT, dtype, op, wire, &w));
    CHECK(toroid_work_wait(w, -1));
    toroid_work_free(w);
  } else {
    CHECK(toroid_all_reduce_wire(comm, buf, buf, COUNT, dtype, op, wire));
  }
  /* wire == dtype: not compressed (exact up to the sum's own rounding). */
  CHECK(toroid_all_reduce_wire(comm, plain, plain, COUNT, dtype, op, dtype));

  long double u = wire == TOROID_BFLOAT16 ? 1.0L / 256 : 1.0L / 2048;
  long double div = op == TOROID_AVG ? size : 1;
  int rounded = 0;
  for (int i = 0; i < COUNT; i++) {
    long double got = is_f32 ? (long double)f[i] : (long double)d[i];
    long double want = exact[i] / div;
    long double bound = ((2 * u + u * u) * mag[i] + size * mag[i] / 16777216.0L) / div * 1.000001L;
    long double err = got > want ? got - want : want - got;
    if (err > bound)
      FAIL("dtype %d wire %d op %d: element %d is %.9Lg, exact %.9Lg, error %.3Lg > bound %.3Lg", (int)dtype,
           (int)wire, (int)op, i, got, want, err, bound);
    long double p = is_f32 ? (long double)fplain[i] : (long double)dplain[i];
    if (p != got) rounded = 1;
  }
  if (!rounded) FAIL("dtype %d wire %d: the result equals the uncompressed one: not compressed", (int)dtype, (int)wire);

  /* The same bits on every rank. */
  uint64_t h = fnv(buf, COUNT * (is_f32 ? 4 : 8));
  uint64_t *all = calloc((size_t)size, sizeof *all);
  if (!all) FAIL("out of memory");
  CHECK(toroid_all_gather(comm, &h, all, 1, TOROID_UINT64));
  for (int r = 0; r < size; r++)
    if (all[r] != h) FAIL("dtype %d wire %d: rank %d holds other bits", (int)dtype, (int)wire, r);
  free(all);
}

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  int size = 0;
  CHECK(toroid_comm_rank(comm, &g_rank));
  CHECK(toroid_comm_size(comm, &size));
  uint64_t test = 1;
  const toroid_datatype wires[] = {TOROID_BFLOAT16, TOROID_FLOAT16};
  const toroid_datatype dtypes[] = {TOROID_FLOAT32, TOROID_FLOAT64};
  const toroid_redop ops[] = {TOROID_SUM, TOROID_AVG};
  for (int w = 0; w < 2; w++)
    for (int t = 0; t < 2; t++)
      for (int o = 0; o < 2; o++, test++) check_one(comm, size, dtypes[t], ops[o], wires[w], (int)(test % 2), test);

  /* Misuse: an integer wire type, a number that is no type; integers ignore a float wire. */
  float x[4] = {1, 2, 3, 4};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_wire(comm, x, x, 4, TOROID_FLOAT32, TOROID_SUM, TOROID_INT32));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT,
              toroid_all_reduce_wire(comm, x, x, 4, TOROID_FLOAT32, TOROID_SUM, (toroid_datatype)99));
  toroid_work *w = (toroid_work *)0x1;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT,
              toroid_all_reduce_wire_async(comm, x, x, 4, TOROID_FLOAT32, TOROID_SUM, TOROID_INT8, &w));
  EXPECT(w == (toroid_work *)0x1); /* written on success only */
  int32_t n[3] = {g_rank, 1 << 20, -7};
  CHECK(toroid_all_reduce_wire(comm, n, n, 3, TOROID_INT32, TOROID_SUM, TOROID_BFLOAT16));
  EXPECT(n[0] == size * (size - 1) / 2 && n[1] == size * (1 << 20) && n[2] == -7 * size);

  CHECK(toroid_comm_destroy(comm));
  printf("wire passed\n");
  return 0;
}
