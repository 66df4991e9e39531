/* The C quick start (docs/C_AND_PYTHON.md): every rank adds its rank number. */
#include <stdio.h>
#include <toroid.h>

int main(void) {
  toroid_comm *comm;
  toroid_result r = toroid_comm_init_env(&comm); /* rank, size, store: from toroid-run */
  if (r != TOROID_SUCCESS) {
    fprintf(stderr, "init: %s: %s\n", toroid_get_error_string(r), toroid_get_last_error(NULL));
    return 1;
  }
  int rank, size;
  toroid_comm_rank(comm, &rank);
  toroid_comm_size(comm, &size);

  float x[4] = {(float)rank, (float)rank, (float)rank, (float)rank};
  r = toroid_all_reduce(comm, x, x, 4, TOROID_FLOAT32, TOROID_SUM); /* in place */
  if (r != TOROID_SUCCESS) {
    fprintf(stderr, "all_reduce: %s: %s\n", toroid_get_error_string(r), toroid_get_last_error(comm));
    return 1;
  }
  printf("rank %d of %d: sum of ranks = %g\n", rank, size, x[0]);
  return toroid_comm_destroy(comm) == TOROID_SUCCESS ? 0 : 1;
}
