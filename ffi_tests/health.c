/* toroid_comm_health on a healthy job, on 3 ranks started by toroid-run:
 *
 *   toroid-run -n 3 -- ./health
 *
 * The JSON document names every rank alive; the Prometheus text has a sample per rank; a buffer
 * too small gets TOROID_INVALID_ARGUMENT, nothing written and the size needed; bad arguments are
 * refused. Then rank 0 revokes the communicator: every rank's next all-reduce fails with
 * TOROID_ABORTED (rank 0 sent nothing for it), every rank sees it revoked, and the health query
 * still answers. */
#include "test_util.h"

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  CHECK(toroid_comm_rank(comm, &g_rank));
  float x[16] = {0};
  for (int i = 0; i < 4; i++) CHECK(toroid_all_reduce(comm, x, x, 16, TOROID_FLOAT32, TOROID_SUM));
  /* A second communicator of the same ranks, for the end: the revoke below leaves it alone. */
  toroid_comm *sync = NULL;
  CHECK(toroid_comm_split(comm, 0, g_rank, &sync));

  static char buf[64 * 1024];
  size_t needed = 0;
  /* A generous grace: a loaded machine can keep a live rank from answering within the 60 ms
   * default (0 takes the default: checked below with the misuse cases). */
  CHECK(toroid_comm_health(comm, TOROID_HEALTH_JSON, 2000, buf, sizeof buf, &needed));
  EXPECT(needed == strlen(buf) + 1);
  EXPECT(strncmp(buf, "{", 1) == 0);
  EXPECT(strstr(buf, "\"size\":3") != NULL);
  /* Every rank alive (three "alive" states, no other). */
  int alive = 0;
  for (const char *p = buf; (p = strstr(p, "\"state\":\"alive\"")) != NULL; p++) alive++;
  EXPECT(alive == 3);
  EXPECT(strstr(buf, "\"dead\"") == NULL && strstr(buf, "\"stopped\"") == NULL);

  CHECK(toroid_comm_health(comm, TOROID_HEALTH_PROMETHEUS, 2000, buf, sizeof buf, &needed));
  EXPECT(strstr(buf, "# TYPE toroid_rank_state gauge") != NULL);
  for (int r = 0; r < 3; r++) {
    char want[64];
    snprintf(want, sizeof want, "rank=\"%d\",state=\"alive\"} 1", r);
    EXPECT(strstr(buf, want) != NULL);
  }

  char small[8];
  memset(small, 'x', sizeof small);
  needed = 0;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, TOROID_HEALTH_JSON, 0, small, sizeof small, &needed));
  EXPECT(needed > sizeof small && small[0] == 'x');
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, TOROID_HEALTH_JSON, 0, NULL, 0, &needed));
  EXPECT(needed > 1);
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, TOROID_HEALTH_JSON, 0, NULL, 8, &needed));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, TOROID_HEALTH_JSON, 0, buf, sizeof buf, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, 7, 0, buf, sizeof buf, &needed));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_health(comm, TOROID_HEALTH_JSON, 60001, buf, sizeof buf, &needed));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_health((toroid_comm *)0x5, TOROID_HEALTH_JSON, 0, buf, sizeof buf, &needed));

  /* No collective between the queries and the revoke: a rank still inside one when rank 0,
   * done with it, revokes would fail it. The control plane answers after the revoke, so the
   * others' queries still see every rank alive. */
  int revoked = -1;
  CHECK(toroid_comm_is_revoked(comm, &revoked));
  EXPECT(revoked == 0);
  if (g_rank == 0) {
    CHECK(toroid_comm_revoke(comm));
    CHECK(toroid_comm_revoke(comm)); /* idempotent */
  }
  EXPECT_CODE(TOROID_ABORTED, toroid_all_reduce(comm, x, x, 16, TOROID_FLOAT32, TOROID_SUM));
  CHECK(toroid_comm_is_revoked(comm, &revoked));
  EXPECT(revoked == 1);
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_is_revoked(comm, NULL));
  CHECK(toroid_comm_health(comm, TOROID_HEALTH_JSON, 0, buf, sizeof buf, &needed));
  EXPECT(strstr(buf, "\"size\":3") != NULL);
  /* Until every rank has asked (a rank gone meanwhile would be reported dead). */
  CHECK(toroid_barrier(sync));
  CHECK(toroid_comm_destroy(comm));
  CHECK(toroid_comm_destroy(sync));
  printf("health passed\n");
  return 0;
}
