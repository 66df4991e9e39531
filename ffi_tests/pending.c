/* The non-blocking forms on 3 ranks: creation polled with toroid_pending_test while rank 2 comes
 * late, then an all-reduce checked element by element; a shrink without rank 1, polled, then an
 * all-reduce of the two survivors; the handle's misuse (NULL, a second wait, a freed handle);
 * and, on rank 0 alone, a creation that can never complete aborted within a second. */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "test_util.h"

#define COUNT 4096

static float value(int r, int i) { return (float)((r * 7919 + i * 104729) % 1000); }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* Polls `p` until done (bounded); returns how many polls said "not yet". */
static int poll_until_done(toroid_pending *p) {
  int done = 0, polls = 0;
  double start = now_s();
  for (;;) {
    CHECK(toroid_pending_test(p, &done));
    if (done) return polls;
    polls++;
    if (now_s() - start > 60) FAIL("set-up not done within 60 s");
    sleep_ms(2);
  }
}

/* All-reduces every rank's values on `comm`; `ranks` are the parent ranks of its members. */
static void check_sum(toroid_comm *comm, const int *ranks, int n) {
  static float buf[COUNT];
  for (int i = 0; i < COUNT; i++) buf[i] = value(g_rank, i);
  CHECK(toroid_all_reduce(comm, buf, buf, COUNT, TOROID_FLOAT32, TOROID_SUM));
  for (int i = 0; i < COUNT; i++) {
    float want = 0;
    for (int k = 0; k < n; k++) want += value(ranks[k], i);
    if (buf[i] != want) FAIL("element %d is %g, want %g", i, (double)buf[i], (double)want);
  }
}

/* A port free a moment ago on the loopback interface (the kernel's choice for port 0). */
static int free_port(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) FAIL("socket: %s", strerror(errno));
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(s, (struct sockaddr *)&a, &len) != 0)
    FAIL("bind: %s", strerror(errno));
  close(s);
  return ntohs(a.sin_port);
}

/* Rank 0 of a world of 2 whose rank 1 never comes: the set-up waits in the store until aborted. */
static void abort_a_creation_that_cannot_complete(void) {
  toroid_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.rank = 0;
  cfg.size = 2;
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", free_port());
  cfg.store_addr = addr; /* rank 0 serves it */
  cfg.timeout_ms = 60000;
  toroid_pending *p = NULL;
  CHECK(toroid_comm_init_async(&p, &cfg));
  sleep_ms(300);
  int done = 1;
  CHECK(toroid_pending_test(p, &done));
  if (done) FAIL("a creation missing a rank finished");
  double t = now_s();
  CHECK(toroid_pending_abort(p));
  double took = now_s() - t;
  if (took > 1.0) FAIL("abort took %.3f s", took);
  CHECK(toroid_pending_test(p, &done));
  EXPECT(done == 1);
  toroid_comm *c = NULL;
  EXPECT_CODE(TOROID_ABORTED, toroid_pending_wait(p, &c));
  EXPECT(c == NULL);
  toroid_pending_free(p);
  printf("abort took %.0f ms\n", took * 1e3);
}

int main(void) {
  int me = atoi(getenv("TOROID_RANK") ? getenv("TOROID_RANK") : "-1");
  if (me == 2) sleep_ms(500); /* the others poll meanwhile */
  toroid_pending *p = NULL;
  CHECK(toroid_comm_init_env_async(&p));
  int polls = poll_until_done(p);
  toroid_comm *comm = NULL;
  CHECK(toroid_pending_wait(p, &comm));
  CHECK(toroid_comm_rank(comm, &g_rank));
  if (g_rank != me) FAIL("rank %d, launched as %d", g_rank, me);
  if (g_rank == 0 && polls == 0) FAIL("rank 0 created without waiting for the late rank 2");
  /* Misuse: NULL arguments, a second wait, abort after the communicator was taken. */
  int done = 0;
  toroid_comm *again = NULL;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_pending_test(NULL, &done));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_pending_test(p, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_pending_wait(p, NULL));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_pending_wait(p, &again));
  EXPECT(again == NULL);
  CHECK(toroid_pending_abort(p)); /* a no-op: the communicator is taken */
  toroid_pending_free(p);
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_pending_test(p, &done));
  toroid_pending_free(NULL);
  const int all[3] = {0, 1, 2};
  check_sum(comm, all, 3); /* still usable after the abort call above */
  printf("created after %d polls\n", polls);

  if (g_rank == 1) {
    CHECK(toroid_comm_destroy(comm));
    printf("left\n");
    return 0;
  }
  const int failed[1] = {1};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_shrink_async(comm, failed, -1, &p));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_shrink_async(comm, NULL, 1, &p));
  if (g_rank == 2) sleep_ms(300);
  CHECK(toroid_comm_shrink_async(comm, failed, 1, &p));
  poll_until_done(p);
  toroid_comm *small = NULL;
  CHECK(toroid_pending_wait(p, &small));
  toroid_pending_free(p);
  int rank = -1, size = -1;
  CHECK(toroid_comm_rank(small, &rank));
  CHECK(toroid_comm_size(small, &size));
  if (size != 2 || rank != (g_rank == 0 ? 0 : 1)) FAIL("shrunk to rank %d of %d", rank, size);
  const int survivors[2] = {0, 2};
  check_sum(small, survivors, 2);
  CHECK(toroid_comm_destroy(small));
  CHECK(toroid_comm_destroy(comm));
  if (g_rank == 0) abort_a_creation_that_cannot_complete();
  printf("pending passed\n");
  return 0;
}
