/* toroid_group_start / toroid_group_end: 100 small all-reduces of pseudo-random lengths with a
 * broadcast and NCCL's in-place all-gather between them, recorded and run as one group, every
 * element checked against sums computed independently; the statistics show the all-reduces
 * packed into 2; nested groups, and misuse (end without start, async and send inside a group). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>

#include "test_util.h"

#define CALLS 100
#define MAXLEN 600

static double value(int r, int call, int i) { return (double)((r * 7919 + call * 131 + i * 104729) % 1000) - 500; }
static int len_of(int call) { return call % 13 == 4 ? 0 : (int)((call * 2654435761u) % MAXLEN); }

static uint64_t all_reduces(toroid_comm *comm) {
  toroid_stat cells[256];
  size_t n = 0;
  CHECK(toroid_comm_stats(comm, cells, 256, &n));
  uint64_t c = 0;
  for (size_t i = 0; i < n && i < 256; i++)
    if (cells[i].kind == 1) c += cells[i].count;
  return c;
}

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  int size = 0;
  CHECK(toroid_comm_rank(comm, &g_rank));
  CHECK(toroid_comm_size(comm, &size));
  static double bufs[CALLS][MAXLEN];
  static int32_t bcast[77];
  int32_t *gathered = calloc((size_t)size * 19, sizeof(int32_t));
  if (!gathered) FAIL("out of memory");
  for (int c = 0; c < CALLS; c++)
    for (int i = 0; i < len_of(c); i++) bufs[c][i] = value(g_rank, c, i);
  for (int i = 0; i < 77; i++) bcast[i] = g_rank == 0 ? i * 3 - 40 : -1;
  for (int i = 0; i < 19; i++) gathered[g_rank * 19 + i] = g_rank * 1000 + i;

  uint64_t before = all_reduces(comm);
  CHECK(toroid_group_start(comm));
  CHECK(toroid_group_start(comm)); /* nested: only the outer end runs the group */
  for (int c = 0; c < CALLS / 2; c++)
    CHECK(toroid_all_reduce(comm, bufs[c], bufs[c], (size_t)len_of(c), TOROID_FLOAT64, TOROID_SUM));
  CHECK(toroid_group_end(comm));
  /* Nothing ran yet: the buffers still hold this rank's own values. */
  if (size > 1 && len_of(1) > 0 && bufs[1][0] != value(g_rank, 1, 0)) FAIL("a call ran before the group's end");
  CHECK(toroid_broadcast(comm, bcast, bcast, 77, TOROID_INT32, 0));
  CHECK(toroid_all_gather(comm, gathered + g_rank * 19, gathered, 19, TOROID_INT32));
  for (int c = CALLS / 2; c < CALLS; c++)
    CHECK(toroid_all_reduce(comm, bufs[c], bufs[c], (size_t)len_of(c), TOROID_FLOAT64, TOROID_SUM));
  /* Inside a group: async calls and point-to-point are refused, and nothing is recorded. */
  toroid_work *w = NULL;
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_all_reduce_async(comm, bufs[0], bufs[0], 1, TOROID_FLOAT64, TOROID_SUM, &w));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_send(comm, bufs[0], 1, TOROID_FLOAT64, (g_rank + 1) % size));
  CHECK(toroid_group_end(comm));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_group_end(comm));

  uint64_t ran = all_reduces(comm) - before;
  if (size > 1 && ran != 2) FAIL("100 all-reduces ran as %llu all-reduces, want 2 packs", (unsigned long long)ran);
  for (int c = 0; c < CALLS; c++)
    for (int i = 0; i < len_of(c); i++) {
      double want = 0;
      for (int r = 0; r < size; r++) want += value(r, c, i);
      if (bufs[c][i] != want) FAIL("call %d element %d is %g, want %g", c, i, bufs[c][i], want);
    }
  for (int i = 0; i < 77; i++)
    if (bcast[i] != i * 3 - 40) FAIL("broadcast element %d is %d", i, bcast[i]);
  for (int r = 0; r < size; r++)
    for (int i = 0; i < 19; i++)
      if (gathered[r * 19 + i] != r * 1000 + i) FAIL("all-gather piece %d element %d is %d", r, i, gathered[r * 19 + i]);
  free(gathered);
  CHECK(toroid_comm_destroy(comm));
  printf("group passed\n");
  return 0;
}
