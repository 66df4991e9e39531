/* toroid_group_start / toroid_group_end: 100 small all-reduces of pseudo-random lengths with a
 * broadcast and NCCL's in-place all-gather between them, recorded and run as one group, every
 * element checked against sums computed independently; the statistics show the all-reduces
 * packed into 2; nested groups, and misuse (end without start, async calls and receive-from-any
 * inside a group). Sends and receives in a group (NCCL's grouped ncclSend / ncclRecv): every
 * rank sends 4 MiB to both neighbours before receiving (which blocking calls one by one cannot
 * complete), blocking and through toroid_group_end_async, every element checked; a receive
 * overlapping another buffer of the group is refused before anything runs.
 * toroid_group_end_async: a group queued behind async work, one call too large to pack.
 * toroid_all_reduce_init / toroid_request_run: a persistent all-reduce run 10 times on new data,
 * out of place and in place, every element checked; runs refused inside a group and once the
 * request's communicator is destroyed. */
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

#define P2P (1 << 20) /* int32 elements: 4 MiB */

static int32_t p2p_value(int src, int dst, int round, int i) { return (src * 1000003 + dst * 7919 + round * 131 + i) ^ 0x5a5a; }

/* Every rank sends to both neighbours, then receives from both, in one group. */
static void p2p(toroid_comm *comm, int size) {
  if (size < 2) return;
  int next = (g_rank + 1) % size, prev = (g_rank + size - 1) % size;
  int32_t *out_next = malloc(P2P * sizeof(int32_t)), *out_prev = malloc(P2P * sizeof(int32_t));
  int32_t *in_prev = malloc(P2P * sizeof(int32_t)), *in_next = malloc(P2P * sizeof(int32_t));
  if (!out_next || !out_prev || !in_prev || !in_next) FAIL("out of memory");
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < P2P; i++) {
      out_next[i] = p2p_value(g_rank, next, round, i);
      out_prev[i] = p2p_value(g_rank, prev, round, i);
      in_prev[i] = in_next[i] = 0;
    }
    int two = size > 2; /* with 2 ranks both neighbours are one rank: one message each way */
    CHECK(toroid_group_start(comm));
    CHECK(toroid_send(comm, out_next, P2P, TOROID_INT32, next));
    if (two) CHECK(toroid_send(comm, out_prev, P2P, TOROID_INT32, prev));
    CHECK(toroid_recv(comm, in_prev, P2P, TOROID_INT32, prev));
    if (two) CHECK(toroid_recv(comm, in_next, P2P, TOROID_INT32, next));
    if (round == 0) {
      CHECK(toroid_group_end(comm));
    } else {
      toroid_work *w = NULL;
      CHECK(toroid_group_end_async(comm, &w));
      if (!w) FAIL("a group of sends and receives queued no work");
      CHECK(toroid_work_wait(w, -1));
      toroid_work_free(w);
    }
    for (int i = 0; i < P2P; i++) {
      if (in_prev[i] != p2p_value(prev, g_rank, round, i)) FAIL("round %d: element %d from rank %d", round, i, prev);
      if (two && in_next[i] != p2p_value(next, g_rank, round, i)) FAIL("round %d: element %d from rank %d", round, i, next);
    }
  }
  /* A receive overlapping a send of the group: refused at the end, before anything runs (the
   * communicator stays usable: the barrier after it). */
  CHECK(toroid_group_start(comm));
  CHECK(toroid_send(comm, out_next, 100, TOROID_INT32, next));
  CHECK(toroid_recv(comm, out_next + 50, 100, TOROID_INT32, prev));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_group_end(comm));
  CHECK(toroid_barrier(comm));
  free(out_next);
  free(out_prev);
  free(in_prev);
  free(in_next);
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
  /* Inside a group: async calls and receive-from-any are refused, and nothing is recorded. */
  toroid_work *w = NULL;
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_all_reduce_async(comm, bufs[0], bufs[0], 1, TOROID_FLOAT64, TOROID_SUM, &w));
  int src = -1;
  if (size > 1) EXPECT_CODE(TOROID_INVALID_USAGE, toroid_recv_any(comm, bufs[0], 1, TOROID_FLOAT64, &src));
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

  /* toroid_group_end_async: the same calls plus one too large to pack, queued behind an async
   * all-reduce; the work completes once every call has run. */
  static double abufs[CALLS][MAXLEN], lead[1000];
  static double big[40000]; /* 320 KB: over the 256 KiB a packed call may have, runs alone */
  for (int c = 0; c < CALLS; c++)
    for (int i = 0; i < len_of(c); i++) abufs[c][i] = value(g_rank, 400 + c, i);
  for (int i = 0; i < 40000; i++) big[i] = value(g_rank, 999, i);
  for (int i = 0; i < 1000; i++) lead[i] = value(g_rank, 998, i);
  toroid_work *first = NULL, *gw = NULL;
  before = all_reduces(comm);
  CHECK(toroid_all_reduce_async(comm, lead, lead, 1000, TOROID_FLOAT64, TOROID_MAX, &first));
  CHECK(toroid_group_start(comm));
  for (int c = 0; c < CALLS; c++) {
    if (c == CALLS / 2) CHECK(toroid_all_reduce(comm, big, big, 40000, TOROID_FLOAT64, TOROID_SUM));
    CHECK(toroid_all_reduce(comm, abufs[c], abufs[c], (size_t)len_of(c), TOROID_FLOAT64, TOROID_SUM));
  }
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_group_end_async(comm, NULL)); /* the group stays open */
  CHECK(toroid_group_end_async(comm, &gw));
  if (!gw) FAIL("toroid_group_end_async queued nothing");
  CHECK(toroid_work_wait(gw, -1));
  CHECK(toroid_work_wait(first, -1));
  toroid_work_free(gw);
  toroid_work_free(first);
  ran = all_reduces(comm) - before;
  if (size > 1 && ran != 4) FAIL("async group: %llu all-reduces ran, want 4 (lead, pack, large, pack)", (unsigned long long)ran);
  for (int c = 0; c < CALLS; c++)
    for (int i = 0; i < len_of(c); i++) {
      double want = 0;
      for (int r = 0; r < size; r++) want += value(r, 400 + c, i);
      if (abufs[c][i] != want) FAIL("async group call %d element %d is %g, want %g", c, i, abufs[c][i], want);
    }
  for (int i = 0; i < 40000; i++) {
    double want = 0;
    for (int r = 0; r < size; r++) want += value(r, 999, i);
    if (big[i] != want) FAIL("async group large call element %d is %g, want %g", i, big[i], want);
  }
  for (int i = 0; i < 1000; i++) {
    double want = value(0, 998, i);
    for (int r = 1; r < size; r++)
      if (value(r, 998, i) > want) want = value(r, 998, i);
    if (lead[i] != want) FAIL("async all-reduce before the group, element %d", i);
  }
  /* A nested end and an empty group queue nothing: *work is NULL. */
  gw = (toroid_work *)1;
  CHECK(toroid_group_start(comm));
  CHECK(toroid_group_start(comm));
  CHECK(toroid_group_end_async(comm, &gw));
  if (gw) FAIL("a nested toroid_group_end_async returned a work");
  gw = (toroid_work *)1;
  CHECK(toroid_group_end_async(comm, &gw));
  if (gw) FAIL("an empty group's toroid_group_end_async returned a work");
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_group_end_async(comm, &gw));

  /* Persistent all-reduces: out of place (int64, max) and in place (float64, sum). */
  static int64_t psend[1000], precv[1000];
  static double pbuf[777];
  toroid_request *oop = NULL, *inp = NULL;
  CHECK(toroid_all_reduce_init(comm, psend, precv, 1000, TOROID_INT64, TOROID_MAX, &oop));
  CHECK(toroid_all_reduce_init(comm, pbuf, pbuf, 777, TOROID_FLOAT64, TOROID_SUM, &inp));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_init(comm, pbuf, pbuf, 777, TOROID_FLOAT64, TOROID_SUM, NULL));
  for (int step = 0; step < 10; step++) {
    for (int i = 0; i < 1000; i++) psend[i] = (int64_t)value(g_rank, 200 + step, i) * 1000003;
    for (int i = 0; i < 777; i++) pbuf[i] = value(g_rank, 300 + step, i);
    CHECK(toroid_request_run(oop));
    CHECK(toroid_request_run(inp));
    for (int i = 0; i < 1000; i++) {
      int64_t want = (int64_t)value(0, 200 + step, i) * 1000003;
      for (int r = 1; r < size; r++) {
        int64_t v = (int64_t)value(r, 200 + step, i) * 1000003;
        if (v > want) want = v;
      }
      if (precv[i] != want) FAIL("persistent max, run %d element %d", step, i);
    }
    for (int i = 0; i < 777; i++) {
      double want = 0;
      for (int r = 0; r < size; r++) want += value(r, 300 + step, i);
      if (pbuf[i] != want) FAIL("persistent sum, run %d element %d is %g, want %g", step, i, pbuf[i], want);
    }
  }
  CHECK(toroid_group_start(comm));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_request_run(inp));
  CHECK(toroid_group_end(comm));
  p2p(comm, size);
  toroid_request_free(oop);
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_request_run(oop)); /* freed */
  CHECK(toroid_comm_destroy(comm));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_request_run(inp)); /* its communicator is gone */
  toroid_request_free(inp);
  toroid_request_free(NULL);
  printf("group passed\n");
  return 0;
}
