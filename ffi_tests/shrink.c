/* toroid_comm_shrink: rank 1 of 3 leaves, ranks 0 and 2 shrink to a communicator of 2 and
 * all-reduce, checked against the sum computed independently. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>

#include "test_util.h"

#define COUNT 4096

static float value(int r, int i) { return (float)((r * 7919 + i * 104729) % 1000); }

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  CHECK(toroid_comm_rank(comm, &g_rank));
  if (g_rank == 1) {
    CHECK(toroid_comm_destroy(comm));
    printf("left\n");
    return 0;
  }
  const int failed[1] = {1};
  toroid_comm *small = NULL;
  CHECK(toroid_comm_shrink(comm, failed, 1, &small));
  int rank = -1, size = -1;
  CHECK(toroid_comm_rank(small, &rank));
  CHECK(toroid_comm_size(small, &size));
  if (size != 2 || rank != (g_rank == 0 ? 0 : 1)) FAIL("shrunk to rank %d of %d", rank, size);
  static float buf[COUNT];
  for (int i = 0; i < COUNT; i++) buf[i] = value(g_rank, i);
  CHECK(toroid_all_reduce(small, buf, buf, COUNT, TOROID_FLOAT32, TOROID_SUM));
  for (int i = 0; i < COUNT; i++) {
    float want = value(0, i) + value(2, i);
    if (buf[i] != want) FAIL("element %d is %g, want %g", i, (double)buf[i], (double)want);
  }
  CHECK(toroid_comm_destroy(small));
  CHECK(toroid_comm_destroy(comm));
  printf("shrink passed\n");
  return 0;
}
