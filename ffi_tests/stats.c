/* toroid_comm_stats on 2 ranks started by toroid-run:
 *
 *   toroid-run -n 2 -- ./stats [tcp]
 *
 * After 5 all-reduces of 1024 floats (4 KiB: size class 12) and one broadcast of 100 doubles
 * (800 bytes: size class 10), the sizing call reports every row, the all_reduce row has exactly
 * count 5 and bytes 20480 with consistent times and histogram, a short array is filled up to
 * its capacity, and the argument errors leave the outputs untouched. */
#include "test_util.h"

static const toroid_stat *find(const toroid_stat *s, size_t n, int kind, int size_class) {
  for (size_t i = 0; i < n; i++)
    if (s[i].kind == kind && s[i].size_class == size_class) return &s[i];
  return NULL;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* "tcp": run with TOROID_SHM_DISABLE=1, where the socket exchange reports bytes moved. */
  int tcp = argc > 1 && strcmp(argv[1], "tcp") == 0;
  g_rank = env_int("TOROID_RANK");
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));

  /* Set-up's own operations (if any) are counted too: a baseline of everything before ours. */
  size_t n = 0;
  CHECK(toroid_comm_stats(comm, NULL, 0, &n));
  toroid_stat base[64];
  EXPECT(n <= 64);
  CHECK(toroid_comm_stats(comm, base, 64, &n));
  size_t n_base = n;
  uint64_t ops_base = 0;
  for (size_t i = 0; i < n_base; i++) ops_base += base[i].count;
  EXPECT(find(base, n_base, 1, 12) == NULL && find(base, n_base, 4, 10) == NULL);

  float a[1024];
  for (int it = 0; it < 5; it++) {
    for (int i = 0; i < 1024; i++) a[i] = (float)(i + g_rank + it);
    CHECK(toroid_all_reduce(comm, a, a, 1024, TOROID_FLOAT32, TOROID_SUM));
    EXPECT(a[7] == (float)(2 * (7 + it) + 1));
  }
  double d[100];
  for (int i = 0; i < 100; i++) d[i] = g_rank == 0 ? (double)i : -1.0;
  CHECK(toroid_broadcast(comm, d, d, 100, TOROID_FLOAT64, 0));
  EXPECT(d[99] == 99.0);

  /* Sizing call. */
  CHECK(toroid_comm_stats(comm, NULL, 0, &n));
  EXPECT(n == n_base + 2);
  toroid_stat *all = calloc(n, sizeof *all);
  EXPECT(all != NULL);
  size_t got = 0;
  CHECK(toroid_comm_stats(comm, all, n, &got));
  EXPECT(got == n);

  const toroid_stat *ar = find(all, n, 1, 12);
  if (ar == NULL) FAIL("no all_reduce row of size class 12 among %zu rows", n);
  if (ar->count != 5 || ar->bytes != 20480)
    FAIL("all_reduce row: count %llu bytes %llu, expected 5 and 20480", (unsigned long long)ar->count,
         (unsigned long long)ar->bytes);
  /* Over TCP an all_reduce of 4 KiB on 2 ranks sends 4 KiB and receives 4 KiB, whichever of
   * ring, doubling or halving-doubling runs it; the shared-memory path does not report bytes
   * moved (moved stays 0 there). */
  if (tcp && ar->moved != 5 * 8192)
    FAIL("all_reduce row over tcp: moved %llu, expected 40960", (unsigned long long)ar->moved);
  EXPECT(ar->min_ns > 0 && ar->min_ns <= ar->max_ns);
  EXPECT(ar->total_ns >= 5 * ar->min_ns && ar->total_ns <= 5 * ar->max_ns);
  uint64_t in_hist = 0;
  for (int i = 0; i < 32; i++) in_hist += ar->hist[i];
  EXPECT(in_hist == 5);
  const toroid_stat *bc = find(all, n, 4, 10);
  if (bc == NULL) FAIL("no broadcast row of size class 10 among %zu rows", n);
  EXPECT(bc->count == 1 && bc->bytes == 800);
  uint64_t ops = 0;
  for (size_t i = 0; i < n; i++) ops += all[i].count;
  EXPECT(ops == ops_base + 6); /* nothing else was counted */

  /* Truncation: one row written, the row after it untouched, the full count reported. */
  toroid_stat two[2];
  memset(two, 0xAB, sizeof two);
  got = 0;
  CHECK(toroid_comm_stats(comm, two, 1, &got));
  EXPECT(got == n);
  EXPECT(two[0].kind == all[0].kind && two[0].algorithm == all[0].algorithm &&
         two[0].size_class == all[0].size_class && two[0].count == all[0].count &&
         two[0].bytes == all[0].bytes && two[0].total_ns == all[0].total_ns &&
         memcmp(two[0].hist, all[0].hist, sizeof two[0].hist) == 0);
  unsigned char pattern[sizeof two[1]];
  memset(pattern, 0xAB, sizeof pattern);
  EXPECT(memcmp(&two[1], pattern, sizeof pattern) == 0);

  /* Every row's kind and algorithm have a name; values that are neither have none. */
  for (size_t i = 0; i < n; i++) {
    EXPECT(toroid_kind_name(all[i].kind) != NULL && toroid_algorithm_name(all[i].algorithm) != NULL);
  }
  EXPECT(strcmp(toroid_kind_name(1), "all_reduce") == 0 && strcmp(toroid_kind_name(8), "send/recv") == 0);
  EXPECT(strcmp(toroid_algorithm_name(1), "ring") == 0);
  EXPECT(toroid_kind_name(0) == NULL && toroid_kind_name(-1) == NULL && toroid_kind_name(256 + 1) == NULL);
  EXPECT(toroid_algorithm_name(0) == NULL && toroid_algorithm_name(1 << 20) == NULL);

  /* Errors: code, last error, outputs untouched. */
  got = 77;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_stats(NULL, all, n, &got));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_stats(comm, all, n, NULL));
  EXPECT(strstr(toroid_get_last_error(comm), "count") != NULL);
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_stats(comm, NULL, 3, &got));
  EXPECT(strstr(toroid_get_last_error(comm), "capacity") != NULL);
  EXPECT(got == 77);
  /* The communicator is still usable. */
  CHECK(toroid_barrier(comm));

  free(all);
  CHECK(toroid_comm_destroy(comm));
  printf("rank %d: stats passed\n", g_rank);
  return 0;
}
