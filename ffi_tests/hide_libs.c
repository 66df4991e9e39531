/* An LD_PRELOAD interposer that hides shared libraries from dlopen, as on a machine without
 * them: dlopen of a library whose file name starts with one of the comma-separated prefixes in
 * TOROID_TEST_HIDE fails (and says so on stderr, "hide_libs: refused NAME"); every other call
 * goes to the real dlopen. Libraries a program needs at load time (DT_NEEDED) are not affected:
 * tests/ffi.rs checks those separately with readelf.
 *
 *   cc -shared -fPIC hide_libs.c -o hide_libs.so -ldl
 *   LD_PRELOAD=./hide_libs.so TOROID_TEST_HIDE=libcuda,libibverbs ./program */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int hidden(const char *name) {
  const char *list = getenv("TOROID_TEST_HIDE");
  if (name == NULL || list == NULL) return 0;
  const char *base = strrchr(name, '/');
  base = base ? base + 1 : name;
  while (*list) {
    size_t n = strcspn(list, ",");
    if (n > 0 && strncmp(base, list, n) == 0) return 1;
    list += n + (list[n] == ',');
  }
  return 0;
}

void *dlopen(const char *name, int flags) {
  static void *(*real)(const char *, int);
  if (real == NULL) *(void **)(&real) = dlsym(RTLD_NEXT, "dlopen");
  if (hidden(name)) {
    fprintf(stderr, "hide_libs: refused %s\n", name);
    return NULL;
  }
  return real(name, flags);
}
