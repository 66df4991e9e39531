/* Every error path of the C ABI, each asserted, on 2 ranks started by toroid-run:
 *
 *   toroid-run -n 2 -- ./errors
 *
 * Argument errors (NULL pointers and handles, unknown types and ops, count overflow, bad
 * roots and peers, overlapping buffers, short structs) must return their code, leave outputs
 * untouched and the communicator usable; destroyed handles must be detected; abort and
 * timeouts must fail pending work and later calls. */
#include "test_util.h"

static int contains(const char *haystack, const char *needle) {
  return haystack != NULL && strstr(haystack, needle) != NULL;
}

#define EXPECT_LAST(comm, needle)                                                         \
  do {                                                                                    \
    const char *e_ = toroid_get_last_error(comm);                                         \
    if (!contains(e_, needle)) FAIL("last error \"%s\" lacks \"%s\"", e_ ? e_ : "(null)", needle); \
  } while (0)

static toroid_comm *SENTINEL_COMM = (toroid_comm *)0x5;
static toroid_work *SENTINEL_WORK = (toroid_work *)0x7;

static int store_calls;
static int failing_get(void *ctx, const char *key, void *value, size_t cap, size_t *len, int64_t t) {
  (void)ctx, (void)key, (void)value, (void)cap, (void)len, (void)t;
  store_calls++;
  return 1;
}
static int counting_set(void *ctx, const char *key, const void *value, size_t len) {
  (void)ctx, (void)key, (void)value, (void)len;
  store_calls++;
  return 0;
}

static void init_errors(void) {
  toroid_comm *c = SENTINEL_COMM;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_env(NULL));
  EXPECT_LAST(NULL, "toroid_comm_init_env");
  EXPECT_LAST(NULL, "NULL");

  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, NULL));
  EXPECT(c == SENTINEL_COMM);
  toroid_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof(size_t); /* an older, smaller struct than any version */
  cfg.rank = 0, cfg.size = 1;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, &cfg));
  EXPECT_LAST(NULL, "struct_size");
  cfg.struct_size = sizeof cfg;
  cfg.rank = 2, cfg.size = 2;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, &cfg));
  EXPECT_LAST(NULL, "rank 2");
  cfg.rank = -1;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, &cfg));
  cfg.rank = 0, cfg.size = 0;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, &cfg));
  cfg.size = 1;
  cfg.store_addr = "no port here";
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init(&c, &cfg));
  EXPECT_LAST(NULL, "no port here");
  EXPECT(c == SENTINEL_COMM);

  toroid_store_ops ops = {sizeof ops, counting_set, failing_get};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store(&c, 0, 2, NULL, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store(NULL, 0, 2, &ops, NULL));
  toroid_store_ops no_get = {sizeof no_get, counting_set, NULL};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store(&c, 0, 2, &no_get, NULL));
  EXPECT_LAST(NULL, "get is NULL");
  toroid_store_ops short_ops = {sizeof(size_t), counting_set, failing_get};
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store(&c, 0, 2, &short_ops, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store(&c, 3, 2, &ops, NULL));
  /* The same with a config: its store_addr must be NULL (the store is the caller's). */
  toroid_config scfg;
  memset(&scfg, 0, sizeof scfg);
  scfg.struct_size = sizeof scfg;
  scfg.rank = 0, scfg.size = 2;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store_config(&c, NULL, &ops, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store_config(&c, &scfg, NULL, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store_config(NULL, &scfg, &ops, NULL));
  scfg.store_addr = "127.0.0.1:1";
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store_config(&c, &scfg, &ops, NULL));
  EXPECT_LAST(NULL, "store_addr");
  scfg.store_addr = NULL;
  scfg.rank = 2;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_init_with_store_config(&c, &scfg, &ops, NULL));
  EXPECT(store_calls == 0); /* argument errors are found before the store is touched */
  /* A store whose get always fails: rank 1 cannot find rank 0's communicator id. */
  EXPECT_CODE(TOROID_TIMEOUT, toroid_comm_init_with_store(&c, 1, 2, &ops, NULL));
  EXPECT_LAST(NULL, "store get");
  EXPECT(store_calls > 0 && c == SENTINEL_COMM);
}

static void static_strings(void) {
  for (int code = TOROID_SUCCESS; code <= TOROID_UNSUPPORTED; code++) {
    const char *s = toroid_get_error_string((toroid_result)code);
    EXPECT(s != NULL && strlen(s) > 5);
    if (code != TOROID_SUCCESS) EXPECT(contains(s, "TOROID_DEBUG"));
  }
  EXPECT(contains(toroid_get_error_string((toroid_result)99), "unknown"));
  EXPECT(contains(toroid_get_error_string((toroid_result)-3), "unknown"));
  const char *v = toroid_version();
  EXPECT(v != NULL && strlen(v) >= 5 && strchr(v, '.') != NULL);
}

/* Argument errors on a live communicator: each returns its code and changes nothing. */
static void argument_errors(toroid_comm *comm) {
  float a[8] = {0}, b[8] = {0};
  int r = -7;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_rank(NULL, &r));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_rank(comm, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_size(comm, NULL));
  EXPECT(r == -7);
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(NULL, a, b, 8, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_LAST(NULL, "NULL");

  /* Unknown element types and ops: validated as integers. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, b, 8, (toroid_datatype)42, TOROID_SUM));
  EXPECT_LAST(comm, "42 is not a toroid_datatype");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, b, 8, (toroid_datatype)-1, TOROID_SUM));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_gather(comm, a, b, 1, (toroid_datatype)10));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, b, 8, TOROID_FLOAT32, (toroid_redop)5));
  EXPECT_LAST(comm, "5 is not a toroid_redop");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce(comm, a, b, 8, TOROID_FLOAT32, (toroid_redop)-2, 0));
  EXPECT_CODE(TOROID_UNSUPPORTED, toroid_all_reduce(comm, a, b, 2, TOROID_INT32, TOROID_AVG));
  EXPECT_LAST(comm, "avg");

  /* The stream forms take device memory: without CUDA they are unsupported and say why; with
   * CUDA (a GPU machine), host memory is refused as an argument error. */
  toroid_result rs = toroid_all_reduce_stream(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, NULL);
  if (rs == TOROID_UNSUPPORTED) {
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_broadcast_stream(comm, a, a, 8, TOROID_FLOAT32, 0, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_all_gather_stream(comm, a, b, 1, TOROID_FLOAT32, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_reduce_scatter_stream(comm, a, b, 1, TOROID_FLOAT32, TOROID_SUM, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    toroid_work *sw = (toroid_work *)&sw; /* set to NULL by the call */
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_all_reduce_stream_async(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, NULL, &sw));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT(sw == NULL);
    EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_gather_stream_async(comm, a, b, 1, TOROID_FLOAT32, NULL, NULL));
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_reduce_stream(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, 0, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_all_to_all_stream(comm, a, b, 1, TOROID_FLOAT32, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_send_stream(comm, a, 8, TOROID_FLOAT32, 0, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
    EXPECT_CODE(TOROID_UNSUPPORTED, toroid_recv_stream(comm, b, 8, TOROID_FLOAT32, 0, NULL));
    EXPECT_LAST(comm, "CUDA is not available");
  } else {
    EXPECT_CODE(TOROID_INVALID_ARGUMENT, rs);
    EXPECT_LAST(comm, "host memory");
    /* Each form names the memory it refuses (a send reads only buf, a receive writes only
     * buf); a rank cannot be its own peer. */
    int me = 0, n = 0;
    CHECK(toroid_comm_rank(comm, &me));
    CHECK(toroid_comm_size(comm, &n));
    if (n > 1) {
      EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send_stream(comm, a, 8, TOROID_FLOAT32, (me + 1) % n, NULL));
      EXPECT_LAST(comm, "sendbuf is host memory, recvbuf is not used");
      EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_recv_stream(comm, b, 8, TOROID_FLOAT32, (me + 1) % n, NULL));
      EXPECT_LAST(comm, "sendbuf is not used, recvbuf is host memory");
    }
    EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send_stream(comm, a, 8, TOROID_FLOAT32, me, NULL));
    EXPECT_LAST(comm, "cannot send to or receive from itself");
  }
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_stream(comm, a, b, 8, (toroid_datatype)42, TOROID_SUM, NULL));
  /* A negative root or peer is an argument error with or without CUDA. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce_stream(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, -1, NULL));
  EXPECT_LAST(comm, "root -1 is negative");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send_stream(comm, a, 8, TOROID_FLOAT32, -3, NULL));
  EXPECT_LAST(comm, "peer -3 is negative");
  /* A stream collective runs at once, so inside a group it would overtake the recorded calls. */
  EXPECT_CODE(TOROID_SUCCESS, toroid_group_start(comm));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_all_reduce_stream(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, NULL));
  EXPECT_LAST(comm, "inside a group");
  EXPECT_CODE(TOROID_SUCCESS, toroid_group_end(comm));

  /* Counts whose byte size overflows. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, b, SIZE_MAX / 2, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_LAST(comm, "overflows");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_gather(comm, a, b, SIZE_MAX / 8, TOROID_UINT8));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce_scatter(comm, a, b, SIZE_MAX / 3, TOROID_INT8, TOROID_SUM));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_to_all(comm, a, b, SIZE_MAX / 2, TOROID_INT8));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send(comm, a, SIZE_MAX / 4, TOROID_FLOAT64, 1 - g_rank));

  /* Wrong buffer use: NULL with a count, partial overlap, wrong in-place layouts. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, NULL, b, 4, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_LAST(comm, "sendbuf is NULL");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, NULL, 4, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce(comm, a, a + 1, 4, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_LAST(comm, "overlap");
  /* reduce_scatter of 2 ranks x 2: recvbuf inside sendbuf but not at rank*recvcount. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce_scatter(comm, a, a + 1, 2, TOROID_FLOAT32, TOROID_SUM));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_gather(comm, a + 1, a, 2, TOROID_FLOAT32));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_to_all(comm, a, a + 2, 2, TOROID_FLOAT32));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_recv(comm, NULL, 3, TOROID_FLOAT32, 1 - g_rank));
  /* The root must have its buffers; a buffer wrapping the address space. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_broadcast(comm, NULL, b, 4, TOROID_FLOAT32, g_rank));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce(comm, a, NULL, 4, TOROID_FLOAT32, TOROID_SUM, g_rank));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT,
              toroid_all_reduce(comm, (void *)(uintptr_t)(UINTPTR_MAX - 3), b, 2, TOROID_FLOAT32, TOROID_SUM));

  /* Roots and peers out of range. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_broadcast(comm, a, b, 4, TOROID_FLOAT32, 2));
  EXPECT_LAST(comm, "root 2");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_broadcast(comm, a, b, 4, TOROID_FLOAT32, -1));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_reduce(comm, a, b, 4, TOROID_FLOAT32, TOROID_SUM, 9));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send(comm, a, 4, TOROID_FLOAT32, g_rank));
  EXPECT_LAST(comm, "itself");
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_send(comm, a, 4, TOROID_FLOAT32, 7));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_recv(comm, b, 4, TOROID_FLOAT32, -1));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_recv_any(comm, b, 4, TOROID_FLOAT32, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_recv_any(comm, NULL, 4, TOROID_FLOAT32, &(int){0}));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_work_source(NULL, &(int){0}));

  /* Async: a NULL work pointer queues nothing (the ranks stay in step below). */
  toroid_work *w = SENTINEL_WORK;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_async(comm, a, b, 8, TOROID_FLOAT32, TOROID_SUM, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_barrier_async(comm, NULL));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_all_reduce_async(comm, a, b, 8, (toroid_datatype)77, TOROID_SUM, &w));
  EXPECT(w == SENTINEL_WORK);
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_work_wait(NULL, -1));
  int done = 5;
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_work_test(NULL, &done));
  EXPECT(done == 5);
  toroid_work_free(NULL); /* a no-op */

  /* Split with a NULL output fails on every rank before anything is exchanged. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_comm_split(comm, 0, 0, NULL));

  /* A work handle passed as a communicator, and a made-up handle. */
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_barrier((toroid_comm *)SENTINEL_WORK));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_abort((toroid_comm *)(uintptr_t)0xdeadbee0));
}

/* The communicator is still usable: a collective succeeds with the right result. */
static void still_usable(toroid_comm *comm, int tag) {
  int64_t v[3] = {g_rank + tag, 1, -g_rank};
  CHECK(toroid_all_reduce(comm, v, v, 3, TOROID_INT64, TOROID_SUM));
  EXPECT(v[0] == 1 + 2 * tag && v[1] == 2 && v[2] == -1);
}

static void work_errors(toroid_comm *comm) {
  float a[4] = {1, 2, 3, 4};
  toroid_work *w = NULL;
  CHECK(toroid_all_reduce_async(comm, a, a, 4, TOROID_FLOAT32, TOROID_MAX, &w));
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_work_test(w, NULL));
  CHECK(toroid_work_wait(w, -1));
  toroid_work_free(w);
  /* Freed: detected, never dereferenced. */
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_work_wait(w, -1));
  EXPECT_LAST(NULL, "not live");
  int done = 3;
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_work_test(w, &done));
  EXPECT(done == 3);
  toroid_work_free(w); /* double free: detected and ignored */
  EXPECT_LAST(NULL, "toroid_work_free");
}

/* Abort with pending work, on a sub-communicator of both ranks. */
static void abort_pending(toroid_comm *comm) {
  toroid_comm *sub = NULL;
  CHECK(toroid_comm_split(comm, 0, g_rank, &sub));
  EXPECT(sub != NULL);
  double x[64] = {0};
  if (g_rank == 0) {
    /* Rank 1 never joins this all_reduce: it stays pending until the abort. */
    toroid_work *w;
    CHECK(toroid_all_reduce_async(sub, x, x, 64, TOROID_FLOAT64, TOROID_SUM, &w));
    int done = -1;
    CHECK(toroid_work_test(w, &done));
    EXPECT(done == 0);
    CHECK(toroid_comm_abort(sub)); /* never blocks */
    toroid_result r = toroid_work_wait(w, -1);
    EXPECT(r == TOROID_ABORTED || r == TOROID_REMOTE_ERROR);
    CHECK(toroid_work_test(w, &done));
    EXPECT(done == 1);
    toroid_work_free(w);
    EXPECT_CODE(TOROID_ABORTED, toroid_all_reduce(sub, x, x, 64, TOROID_FLOAT64, TOROID_SUM));
    EXPECT_LAST(sub, "abort");
    CHECK(toroid_comm_abort(sub)); /* again: still fine */
  }
  /* Tell rank 1 to go on (over the parent communicator, which is unaffected). */
  int64_t go = 1;
  CHECK(toroid_broadcast(comm, &go, &go, 1, TOROID_INT64, 0));
  if (g_rank == 1) {
    /* Rank 0's side is aborted: this rank's next operation on it fails, without hanging. */
    toroid_result r = toroid_barrier(sub);
    EXPECT(r != TOROID_SUCCESS);
  }
  CHECK(toroid_comm_destroy(sub));
  /* Destroyed: every use is detected. */
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_all_reduce(sub, x, x, 1, TOROID_FLOAT64, TOROID_SUM));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_rank(sub, &(int){0}));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_destroy(sub));
  EXPECT(contains(toroid_get_last_error(sub), "not live"));
  CHECK(toroid_comm_destroy(NULL));
}

/* A work that does not complete within its wait: TIMEOUT, and the communicator is aborted. */
static void wait_timeout(toroid_comm *comm) {
  toroid_comm *sub = NULL;
  CHECK(toroid_comm_split(comm, 0, g_rank, &sub));
  int32_t x[16] = {0};
  if (g_rank == 0) {
    toroid_work *w;
    CHECK(toroid_all_reduce_async(sub, x, x, 16, TOROID_INT32, TOROID_SUM, &w));
    EXPECT_CODE(TOROID_TIMEOUT, toroid_work_wait(w, 200));
    EXPECT_LAST(sub, "timeout");
    EXPECT_CODE(TOROID_ABORTED, toroid_barrier(sub));
    toroid_work_free(w);
  }
  int64_t go = 1;
  CHECK(toroid_broadcast(comm, &go, &go, 1, TOROID_INT64, 0));
  if (g_rank == 1) EXPECT(toroid_barrier(sub) != TOROID_SUCCESS);
  CHECK(toroid_comm_destroy(sub));
}

/* Destroy while queued work fails (rank 1 leaves): the first failure's code, and how many. */
static void destroy_reports_failures(toroid_comm *comm) {
  toroid_comm *sub = NULL;
  CHECK(toroid_comm_split(comm, 0, g_rank, &sub));
  int32_t x[16] = {0}, y[16] = {0};
  if (g_rank == 0) {
    toroid_work *w1, *w2;
    CHECK(toroid_all_reduce_async(sub, x, x, 16, TOROID_INT32, TOROID_SUM, &w1));
    CHECK(toroid_all_reduce_async(sub, y, y, 16, TOROID_INT32, TOROID_SUM, &w2));
    toroid_result r = toroid_comm_destroy(sub); /* rank 1 destroys its side meanwhile */
    EXPECT(r == TOROID_REMOTE_ERROR || r == TOROID_ABORTED);
    EXPECT(contains(toroid_get_last_error(NULL), "2 operations still queued"));
    EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_destroy(sub)); /* released all the same */
    toroid_work_free(w1);
    toroid_work_free(w2);
  } else {
    struct timespec nap = {0, 300 * 1000 * 1000}; /* rank 0 is in toroid_comm_destroy by then */
    nanosleep(&nap, NULL);
    CHECK(toroid_comm_destroy(sub));
  }
}

/* Split with no color: NULL out; and a version-2 config (larger struct) is accepted. */
static void split_nocolor(toroid_comm *comm) {
  toroid_comm *sub = SENTINEL_COMM;
  CHECK(toroid_comm_split(comm, g_rank == 1 ? TOROID_SPLIT_NOCOLOR : 3, 0, &sub));
  if (g_rank == 1) {
    EXPECT(sub == NULL);
  } else {
    int size = 0;
    CHECK(toroid_comm_size(sub, &size));
    EXPECT(size == 1);
    CHECK(toroid_barrier(sub));
    CHECK(toroid_comm_destroy(sub));
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  g_rank = env_int("TOROID_RANK");
  EXPECT(env_int("TOROID_WORLD_SIZE") == 2);
  init_errors();
  static_strings();

  /* A later, longer version of the config struct: fields past the first version are ignored. */
  struct {
    toroid_config v1;
    int64_t field_of_a_later_version;
  } cfg2;
  memset(&cfg2, 0, sizeof cfg2);
  cfg2.v1.struct_size = sizeof cfg2;
  cfg2.v1.rank = g_rank;
  cfg2.v1.size = 2;
  cfg2.v1.store_addr = NULL; /* from TOROID_STORE_ADDR */
  cfg2.v1.timeout_ms = 30000;
  cfg2.field_of_a_later_version = -1;
  toroid_comm *comm = NULL;
  CHECK(toroid_comm_init(&comm, &cfg2.v1));
  EXPECT(strcmp(toroid_get_last_error(comm), "") == 0);

  argument_errors(comm);
  still_usable(comm, 1);
  work_errors(comm);
  still_usable(comm, 2);
  abort_pending(comm);
  still_usable(comm, 3);
  wait_timeout(comm);
  still_usable(comm, 4);
  split_nocolor(comm);
  still_usable(comm, 5);
  destroy_reports_failures(comm);
  still_usable(comm, 6);

  /* The pointer from toroid_get_last_error stays valid while the message is unchanged. */
  EXPECT_CODE(TOROID_INVALID_ARGUMENT, toroid_barrier_async(comm, NULL));
  const char *e1 = toroid_get_last_error(comm);
  const char *e2 = toroid_get_last_error(comm);
  EXPECT(e1 == e2 && contains(e1, "toroid_barrier_async"));

  CHECK(toroid_comm_abort(comm));
  EXPECT_CODE(TOROID_ABORTED, toroid_barrier(comm));
  CHECK(toroid_comm_destroy(comm));
  EXPECT_CODE(TOROID_INVALID_USAGE, toroid_comm_destroy(comm));
  printf("rank %d: error paths passed\n", g_rank);
  return 0;
}
