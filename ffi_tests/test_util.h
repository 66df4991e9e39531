/* Helpers shared by the C tests: checks, a seeded generator, 16-bit float conversions, and
 * communicator set-up in three ways (environment, toroid_config, a caller-supplied file store).
 * Uses only toroid.h and the C library. */
#ifndef TOROID_TEST_UTIL_H
#define TOROID_TEST_UTIL_H

#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "toroid.h"

static int g_rank = -1;

#define FAIL(...)                                                     \
  do {                                                                \
    fprintf(stderr, "rank %d: %s:%d: ", g_rank, __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__);                                     \
    fprintf(stderr, "\n");                                            \
    exit(1);                                                          \
  } while (0)

/* A call that must succeed. */
#define CHECK(call)                                                                         \
  do {                                                                                      \
    toroid_result r_ = (call);                                                              \
    if (r_ != TOROID_SUCCESS)                                                               \
      FAIL("%s returned %d: %s\n  last error: %s", #call, (int)r_, toroid_get_error_string(r_), \
           toroid_get_last_error(NULL));                                                    \
  } while (0)

/* A call that must fail with `code`. */
#define EXPECT_CODE(code, call)                                                                \
  do {                                                                                         \
    toroid_result r_ = (call);                                                                 \
    if (r_ != (code))                                                                          \
      FAIL("%s returned %d (%s), expected %s\n  last error: %s", #call, (int)r_,                \
           toroid_get_error_string(r_), #code, toroid_get_last_error(NULL));                   \
  } while (0)

#define EXPECT(cond) \
  do {               \
    if (!(cond)) FAIL("expected %s", #cond); \
  } while (0)

/* splitmix64: a small seeded generator, so every rank can compute every rank's data. */
static inline uint64_t rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint64_t seed_of(uint64_t test, int rank) {
  uint64_t s = test * 1000003ull + (uint64_t)rank * 7919ull + 17;
  rng_next(&s);
  return s;
}

/* bfloat16: the upper half of a float (exact for the small integers the tests use). */
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* IEEE half precision for normal numbers and zero (truncating; the tests use values that are
 * exact in half precision, and compare results with a tolerance where they are not). */
static inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = (int32_t)((u >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = u & 0x7FFFFFu;
  if (exp <= 0) return (uint16_t)sign;
  if (exp >= 31) return (uint16_t)(sign | 0x7C00u);
  return (uint16_t)(sign | ((uint32_t)exp << 10) | (mant >> 13));
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    u = sign; /* zero (subnormals do not occur in the tests) */
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (mant << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline size_t dtype_size(toroid_datatype d) {
  switch (d) {
    case TOROID_INT8:
    case TOROID_UINT8:
      return 1;
    case TOROID_FLOAT16:
    case TOROID_BFLOAT16:
      return 2;
    case TOROID_INT32:
    case TOROID_UINT32:
    case TOROID_FLOAT32:
      return 4;
    default:
      return 8;
  }
}

static inline int env_int(const char *name) {
  const char *v = getenv(name);
  if (v == NULL) FAIL("%s is not set (run under toroid-run)", name);
  return atoi(v);
}

/* ---- A caller-supplied store: one file per key in a directory every rank sees. ---- */

static inline void store_path(char *out, size_t cap, const char *dir, const char *key) {
  /* Keys contain '/': flatten them. */
  int n = snprintf(out, cap, "%s/", dir);
  for (const char *k = key; *k && (size_t)n + 2 < cap; k++) out[n++] = (*k == '/') ? '_' : *k;
  out[n] = '\0';
}

static inline int file_store_set(void *ctx, const char *key, const void *value, size_t len) {
  char path[4096], tmp[4200];
  store_path(path, sizeof path, (const char *)ctx, key);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "wb");
  if (f == NULL) return 1;
  int ok = fwrite(value, 1, len, f) == len;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) return 1; /* rename: readers never see half a value */
  return 0;
}

static inline int file_store_get(void *ctx, const char *key, void *value, size_t cap, size_t *len,
                          int64_t timeout_ms) {
  char path[4096];
  store_path(path, sizeof path, (const char *)ctx, key);
  struct timespec nap = {0, 2 * 1000 * 1000};
  for (int64_t waited = 0;; waited += 2) {
    FILE *f = fopen(path, "rb");
    if (f != NULL) {
      fseek(f, 0, SEEK_END);
      long size = ftell(f);
      fseek(f, 0, SEEK_SET);
      size_t n = (size_t)size < cap ? (size_t)size : cap;
      size_t got = fread(value, 1, n, f);
      fclose(f);
      if (got != n) return 1;
      *len = (size_t)size;
      return 0;
    }
    if (waited >= timeout_ms) return 1;
    nanosleep(&nap, NULL);
  }
}

/* Creates the communicator of this rank (rank and size from toroid-run's variables):
 * mode "env": toroid_comm_init_env; "config": toroid_comm_init with store_addr NULL (taken
 * from TOROID_STORE_ADDR); "store": toroid_comm_init_with_store over files in `dir`;
 * "store_config": the same through toroid_comm_init_with_store_config with a 60 s timeout. */
static inline toroid_comm *init_comm(const char *mode, const char *dir) {
  toroid_comm *comm = NULL;
  /* This rank's settings, from toroid-run's variables, with a 60 s timeout. */
  toroid_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.rank = env_int("TOROID_RANK");
  cfg.size = env_int("TOROID_WORLD_SIZE");
  cfg.store_addr = NULL;
  cfg.timeout_ms = 60000;
  /* The file store over `dir`, for the two "store" modes. */
  static toroid_store_ops ops;
  ops.struct_size = sizeof ops;
  ops.set = file_store_set;
  ops.get = file_store_get;
  int with_store = strcmp(mode, "store") == 0 || strcmp(mode, "store_config") == 0;
  if (with_store && dir == NULL) FAIL("mode %s needs a directory", mode);
  if (strcmp(mode, "env") == 0) {
    CHECK(toroid_comm_init_env(&comm));
  } else if (strcmp(mode, "config") == 0) {
    CHECK(toroid_comm_init(&comm, &cfg));
  } else if (strcmp(mode, "store") == 0) {
    CHECK(toroid_comm_init_with_store(&comm, cfg.rank, cfg.size, &ops, (void *)dir));
  } else if (strcmp(mode, "store_config") == 0) {
    CHECK(toroid_comm_init_with_store_config(&comm, &cfg, &ops, (void *)dir));
  } else {
    FAIL("unknown init mode %s", mode);
  }
  EXPECT(comm != NULL);
  return comm;
}

#endif /* TOROID_TEST_UTIL_H */
