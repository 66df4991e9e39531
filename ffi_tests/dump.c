/* toroid_comm_dump on a healthy job, on 2 ranks started by toroid-run:
 *
 *   toroid-run -n 2 -- ./dump
 *
 * The report names every rank and blames nobody; it is truncated to the buffer, NUL-terminated,
 * at a character boundary; a NULL buffer is refused unless its length is 0. */
#include "test_util.h"

int main(void) {
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init_env(&comm));
  CHECK(toroid_comm_rank(comm, &g_rank));
  float x[16] = {0};
  CHECK(toroid_all_reduce(comm, x, x, 16, TOROID_FLOAT32, TOROID_SUM));

  static char buf[64 * 1024];
  /* The report is a snapshot: the peer may still be finishing its side of the all-reduce (it
   * then shows as "running all_reduce #n" with nobody missing). Within a second both are idle,
   * unless the peer has finished its own dumps first and waits in the closing barrier: then
   * the report rightly says that this rank is the one missing from it, and nobody else. */
  char me_behind[64];
  snprintf(me_behind, sizeof me_behind, "stall report: rank %d never entered barrier", g_rank);
  int idle = 0, peer_ahead = 0;
  for (int attempt = 0; attempt < 100 && !idle && !peer_ahead; attempt++) {
    memset(buf, 'x', sizeof buf);
    CHECK(toroid_comm_dump(comm, buf, sizeof buf));
    EXPECT(memchr(buf, '\0', sizeof buf) != NULL);
    idle = strncmp(buf, "stall report: no operation in flight", 36) == 0;
    peer_ahead = strncmp(buf, me_behind, strlen(me_behind)) == 0;
    if (!idle && !peer_ahead && strncmp(buf, "stall report: no rank is missing", 32) != 0)
      FAIL("report: %s", buf);
    struct timespec nap = {0, 10 * 1000 * 1000};
    if (!idle && !peer_ahead) nanosleep(&nap, NULL);
  }
  if (!idle && !peer_ahead) FAIL("still busy after 1 s: %s", buf);
  EXPECT(strstr(buf, "\n0 ") != NULL && strstr(buf, "\n1 ") != NULL);
  EXPECT(strstr(buf, "died") == NULL);
  if (idle) EXPECT(strstr(buf, "never entered") == NULL);

  char small[16];
  memset(small, 'x', sizeof small);
  CHECK(toroid_comm_dump(comm, small, sizeof small));
  EXPECT(strlen(small) == sizeof small - 1 && strncmp(small, buf, sizeof small - 1) == 0);

  CHECK(toroid_comm_dump(comm, NULL, 0));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_dump(comm, NULL, 8));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_dump((toroid_comm *)0x5, buf, sizeof buf));

  /* Both ranks keep their control plane up until both have dumped. */
  CHECK(toroid_barrier(comm));
  CHECK(toroid_comm_destroy(comm));
  printf("dump passed\n");
  return 0;
}
