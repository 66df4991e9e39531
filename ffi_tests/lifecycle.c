/* Create -> collectives (blocking and async, a split) -> destroy, repeated: run under valgrind
 * by the test to show that no memory is leaked or accessed out of bounds.
 *
 *   toroid-run -n 2 -- valgrind ... ./lifecycle DIR ITERATIONS
 *
 * Each iteration meets through a fresh file store DIR/iter<i> (toroid_comm_init), so no rank
 * can reach a store of an earlier iteration. */
#include "test_util.h"

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc != 3) FAIL("usage: lifecycle DIR ITERATIONS");
  g_rank = env_int("TOROID_RANK");
  int size = env_int("TOROID_WORLD_SIZE");
  int iters = atoi(argv[2]);
  for (int it = 0; it < iters; it++) {
    char addr[4096];
    snprintf(addr, sizeof addr, "file://%s/iter%d", argv[1], it);
    toroid_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.rank = g_rank;
    cfg.size = size;
    cfg.store_addr = addr;
    cfg.timeout_ms = 120000;
    toroid_comm *comm = NULL;
    CHECK(toroid_comm_init(&comm, &cfg));

    size_t count = 10000 + (size_t)it;
    float *a = malloc(count * sizeof *a), *b = malloc(count * sizeof *b * (size_t)size);
    for (size_t i = 0; i < count; i++) a[i] = (float)(i % 97) + (float)g_rank;
    CHECK(toroid_all_reduce(comm, a, a, count, TOROID_FLOAT32, TOROID_SUM));
    for (size_t i = 0; i < count; i++) EXPECT(a[i] == (float)(size * (int)(i % 97) + size * (size - 1) / 2));
    CHECK(toroid_all_gather(comm, a, b, count, TOROID_FLOAT32));
    CHECK(toroid_reduce_scatter(comm, b, b, count, TOROID_FLOAT32, TOROID_MAX));
    CHECK(toroid_broadcast(comm, g_rank == 0 ? a : NULL, b, count, TOROID_FLOAT32, 0));
    CHECK(toroid_reduce(comm, a, g_rank == 1 ? b : NULL, count, TOROID_FLOAT32, TOROID_MIN, 1));
    CHECK(toroid_all_to_all(comm, b, b, count / (size_t)size, TOROID_FLOAT32));

    toroid_work *w[3];
    CHECK(toroid_all_reduce_async(comm, a, a, count, TOROID_FLOAT32, TOROID_MAX, &w[0]));
    CHECK(toroid_all_gather_async(comm, b, b, count, TOROID_FLOAT32, &w[1]));
    CHECK(toroid_barrier_async(comm, &w[2]));
    CHECK(toroid_work_wait(w[0], -1));
    toroid_work_free(w[0]);
    toroid_work_free(w[1]); /* freed before it is waited for */
    CHECK(toroid_work_wait(w[2], -1));
    toroid_work_free(w[2]);

    toroid_comm *sub = NULL;
    CHECK(toroid_comm_split(comm, 0, -g_rank, &sub));
    int32_t x = g_rank;
    CHECK(toroid_all_reduce(sub, &x, &x, 1, TOROID_INT32, TOROID_SUM));
    EXPECT(x == size * (size - 1) / 2);
    /* Argument errors allocate messages: they must be freed too. */
    EXPECT(toroid_all_reduce(sub, &x, &x, 1, (toroid_datatype)99, TOROID_SUM) == TOROID_INVALID_ARGUMENT);
    EXPECT(strlen(toroid_get_last_error(sub)) > 0 && strlen(toroid_get_last_error(NULL)) > 0);
    /* Every rank has finished its all-reduce on sub before any aborts it: an abort fails the
     * peers' calls still in flight (a rank may return from the all-reduce while its peer is
     * still reading the last data, and under valgrind that window is wide). */
    CHECK(toroid_barrier(comm));
    CHECK(toroid_comm_abort(sub));
    CHECK(toroid_comm_destroy(sub));
    CHECK(toroid_barrier(comm));
    CHECK(toroid_comm_destroy(comm));
    free(a);
    free(b);
  }
  printf("rank %d: %d create/collectives/destroy iterations passed\n", g_rank, iters);
  return 0;
}
