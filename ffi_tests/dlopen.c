/* Loads libtoroid.so at run time and resolves every entry point with dlsym, as a framework
 * backend does; then runs collectives through the resolved pointers. Not linked with -ltoroid.
 *
 *   toroid-run -n 2 -- ./dlopen /path/to/libtoroid.so */
#include "test_util.h" /* first: it sets the POSIX feature level */

#include <dlfcn.h>

static const char *const ENTRY_POINTS[] = {
    "toroid_comm_init_env", "toroid_comm_init", "toroid_comm_init_with_store",
    "toroid_comm_init_with_store_config", "toroid_comm_split", "toroid_comm_shrink", "toroid_comm_stats",
    "toroid_comm_rank", "toroid_comm_size", "toroid_comm_abort", "toroid_comm_revoke", "toroid_comm_is_revoked", "toroid_comm_dump", "toroid_comm_health", "toroid_comm_destroy",
    "toroid_all_reduce", "toroid_reduce_scatter", "toroid_all_gather", "toroid_broadcast",
    "toroid_reduce", "toroid_all_to_all", "toroid_all_to_all_v", "toroid_barrier", "toroid_send", "toroid_recv",
    "toroid_recv_any",
    "toroid_all_reduce_async", "toroid_reduce_scatter_async", "toroid_all_gather_async",
    "toroid_broadcast_async", "toroid_reduce_async", "toroid_all_to_all_async", "toroid_all_to_all_v_async",
    "toroid_barrier_async", "toroid_send_async", "toroid_recv_async", "toroid_recv_any_async",
    "toroid_work_wait", "toroid_work_test", "toroid_work_source", "toroid_work_free",
    "toroid_comm_init_env_async", "toroid_comm_init_async", "toroid_comm_shrink_async",
    "toroid_comm_grow_offer", "toroid_grow_offer_token", "toroid_comm_grow", "toroid_comm_grow_async",
    "toroid_grow_offer_free", "toroid_comm_join", "toroid_comm_join_async",
    "toroid_pending_test", "toroid_pending_wait", "toroid_pending_abort", "toroid_pending_free",
    "toroid_group_start", "toroid_group_end", "toroid_group_end_async", "toroid_all_reduce_init",
    "toroid_request_run", "toroid_request_free", "toroid_all_reduce_wire", "toroid_all_reduce_wire_async",
    "toroid_all_reduce_stream", "toroid_broadcast_stream", "toroid_all_gather_stream",
    "toroid_reduce_scatter_stream", "toroid_all_reduce_stream_async", "toroid_broadcast_stream_async",
    "toroid_all_gather_stream_async", "toroid_reduce_scatter_stream_async", "toroid_reduce_stream",
    "toroid_all_to_all_stream", "toroid_send_stream", "toroid_recv_stream",
    "toroid_get_error_string", "toroid_get_last_error",
    "toroid_version",
    "toroid_kind_name",
    "toroid_algorithm_name",
};

/* The pointer types, from the header's declarations (the functions are never called directly:
 * this program is not linked with libtoroid). */
typedef toroid_result (*init_env_fn)(toroid_comm **);
typedef toroid_result (*rank_fn)(const toroid_comm *, int *);
typedef toroid_result (*all_reduce_fn)(toroid_comm *, const void *, void *, size_t, toroid_datatype,
                                       toroid_redop);
typedef toroid_result (*all_reduce_async_fn)(toroid_comm *, const void *, void *, size_t,
                                             toroid_datatype, toroid_redop, toroid_work **);
typedef toroid_result (*all_gather_fn)(toroid_comm *, const void *, void *, size_t, toroid_datatype);
typedef toroid_result (*work_wait_fn)(toroid_work *, int64_t);
typedef void (*work_free_fn)(toroid_work *);
typedef toroid_result (*destroy_fn)(toroid_comm *);
typedef const char *(*string_fn)(void);
typedef const char *(*error_string_fn)(toroid_result);

/* dlsym returns an object pointer; POSIX guarantees it converts to a function pointer. */
#define RESOLVE(lib, var, name)                              \
  do {                                                       \
    *(void **)(&(var)) = dlsym((lib), (name));               \
    if ((var) == NULL) FAIL("dlsym(%s): %s", name, dlerror()); \
  } while (0)

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc != 2) FAIL("usage: dlopen /path/to/libtoroid.so");
  g_rank = env_int("TOROID_RANK");
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) FAIL("dlopen: %s", dlerror());
  size_t n = sizeof ENTRY_POINTS / sizeof ENTRY_POINTS[0];
  for (size_t i = 0; i < n; i++) {
    if (dlsym(lib, ENTRY_POINTS[i]) == NULL) FAIL("missing entry point %s: %s", ENTRY_POINTS[i], dlerror());
  }
  string_fn version;
  error_string_fn error_string;
  init_env_fn init_env;
  rank_fn comm_rank, comm_size;
  all_reduce_fn all_reduce;
  all_reduce_async_fn all_reduce_async;
  all_gather_fn all_gather;
  work_wait_fn work_wait;
  work_free_fn work_free;
  destroy_fn destroy;
  RESOLVE(lib, version, "toroid_version");
  RESOLVE(lib, error_string, "toroid_get_error_string");
  RESOLVE(lib, init_env, "toroid_comm_init_env");
  RESOLVE(lib, comm_rank, "toroid_comm_rank");
  RESOLVE(lib, comm_size, "toroid_comm_size");
  RESOLVE(lib, all_reduce, "toroid_all_reduce");
  RESOLVE(lib, all_reduce_async, "toroid_all_reduce_async");
  RESOLVE(lib, all_gather, "toroid_all_gather");
  RESOLVE(lib, work_wait, "toroid_work_wait");
  RESOLVE(lib, work_free, "toroid_work_free");
  RESOLVE(lib, destroy, "toroid_comm_destroy");

  EXPECT(strchr(version(), '.') != NULL);
  EXPECT(strstr(error_string(TOROID_TIMEOUT), "timeout") != NULL);
  toroid_comm *comm = NULL;
  toroid_result r = init_env(&comm);
  if (r != TOROID_SUCCESS) FAIL("init: %s", error_string(r));
  int rank = -1, size = -1;
  EXPECT(comm_rank(comm, &rank) == TOROID_SUCCESS && comm_size(comm, &size) == TOROID_SUCCESS);
  EXPECT(rank == g_rank && size == env_int("TOROID_WORLD_SIZE"));

  double v[1000];
  for (int i = 0; i < 1000; i++) v[i] = i * (rank + 1);
  EXPECT(all_reduce(comm, v, v, 1000, TOROID_FLOAT64, TOROID_SUM) == TOROID_SUCCESS);
  double tri = size * (size + 1) / 2.0;
  for (int i = 0; i < 1000; i++) EXPECT(v[i] == i * tri);
  toroid_work *w = NULL;
  EXPECT(all_reduce_async(comm, v, v, 1000, TOROID_FLOAT64, TOROID_MAX, &w) == TOROID_SUCCESS);
  EXPECT(work_wait(w, -1) == TOROID_SUCCESS);
  work_free(w);
  for (int i = 0; i < 1000; i++) EXPECT(v[i] == i * tri);
  int32_t mine = rank * 10, all[64];
  EXPECT(all_gather(comm, &mine, all, 1, TOROID_INT32) == TOROID_SUCCESS);
  for (int i = 0; i < size; i++) EXPECT(all[i] == i * 10);
  EXPECT(destroy(comm) == TOROID_SUCCESS);
  printf("rank %d: resolved %zu entry points with dlsym; collectives passed (toroid %s)\n", rank, n,
         version());
  /* Unloading is not done: like most Rust cdylibs (thread-local destructors), toroid stays
   * loaded for the life of the process. */
  return 0;
}
