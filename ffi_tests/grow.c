/* toroid_comm_grow and toroid_comm_join on 3 processes: rank 2 leaves, ranks 0 and 1 shrink to
 * 2 and offer one rank; rank 0 writes the token to a file (argv[1]), and process 2, holding no
 * communicator any more, joins as rank 2 with it. All three all-reduce, checked against the
 * sum computed independently. Also the misuse: a buffer too small for the token, an offer used
 * twice, a NULL or malformed token, a config whose size is not the token's. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>

#include "test_util.h"

#define COUNT 4096

static float value(int r, int i) { return (float)((r * 7919 + i * 104729) % 1000); }

static void check_sum(toroid_comm *comm, int size) {
  static float buf[COUNT];
  int rank = -1;
  CHECK(toroid_comm_rank(comm, &rank));
  for (int i = 0; i < COUNT; i++) buf[i] = value(rank, i);
  CHECK(toroid_all_reduce(comm, buf, buf, COUNT, TOROID_FLOAT32, TOROID_SUM));
  for (int i = 0; i < COUNT; i++) {
    float want = 0;
    for (int r = 0; r < size; r++) want += value(r, i);
    if (buf[i] != want) FAIL("element %d is %g, want %g", i, (double)buf[i], (double)want);
  }
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* The new process: waits for the token file (bounded), then joins as rank 2 of 3. */
static toroid_comm *join(const char *path) {
  char token[TOROID_JOIN_TOKEN_MAX];
  memset(token, 0, sizeof token);
  for (int tries = 0;; tries++) {
    FILE *f = fopen(path, "r");
    if (f) {
      size_t n = fread(token, 1, sizeof token - 1, f);
      fclose(f);
      if (n > 0) break;
    }
    if (tries > 30000) FAIL("no token in %s within 60 s", path);
    sleep_ms(2);
  }
  toroid_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.rank = 2;
  cfg.size = 3;
  cfg.timeout_ms = 30000;
  toroid_comm *comm = NULL;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_join(NULL, &cfg, &comm));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_join("toroid-join1/3/00/127.0.0.1:1", &cfg, &comm));
  cfg.size = 4;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_join(token, &cfg, &comm));
  cfg.size = 3;
  EXPECT(comm == NULL);
  CHECK(toroid_comm_join(token, &cfg, &comm));
  return comm;
}

int main(int argc, char **argv) {
  if (argc != 2) FAIL("usage: grow TOKEN_FILE");
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  CHECK(toroid_comm_rank(comm, &g_rank));
  if (g_rank == 2) {
    CHECK(toroid_comm_destroy(comm));
    toroid_comm *grown = join(argv[1]);
    check_sum(grown, 3);
    CHECK(toroid_comm_destroy(grown));
    printf("grow passed (joined)\n");
    return 0;
  }
  const int failed[1] = {2};
  toroid_comm *small = NULL;
  CHECK(toroid_comm_shrink(comm, failed, 1, &small));
  toroid_grow_offer *offer = NULL;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_grow_offer(small, -1, &offer));
  CHECK(toroid_comm_grow_offer(small, 1, &offer));
  char token[TOROID_JOIN_TOKEN_MAX];
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_grow_offer_token(offer, token, 8));
  CHECK(toroid_grow_offer_token(offer, token, sizeof token));
  if (strncmp(token, "toroid-join1/3/", 15) != 0) FAIL("token %s", token);
  if (g_rank == 0) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE *f = fopen(tmp, "w");
    if (!f || fputs(token, f) < 0 || fclose(f) != 0) FAIL("write %s: %s", tmp, strerror(errno));
    if (rename(tmp, argv[1]) != 0) FAIL("rename: %s", strerror(errno));
  }
  toroid_comm *grown = NULL;
  CHECK(toroid_comm_grow(small, offer, &grown));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_grow(small, offer, &grown));
  toroid_grow_offer_free(offer);
  int rank = -1, size = -1;
  CHECK(toroid_comm_rank(grown, &rank));
  CHECK(toroid_comm_size(grown, &size));
  if (size != 3 || rank != g_rank) FAIL("grown to rank %d of %d", rank, size);
  check_sum(grown, 3);
  CHECK(toroid_comm_destroy(grown));
  CHECK(toroid_comm_destroy(small));
  CHECK(toroid_comm_destroy(comm));
  printf("grow passed\n");
  return 0;
}
