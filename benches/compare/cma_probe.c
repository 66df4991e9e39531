// Cross-memory attach (process_vm_readv / process_vm_writev) against memcpy on this machine:
// the evidence behind docs/decisions/no-single-copy-cma.md.
//
//   gcc -O2 benches/compare/cma_probe.c -o target/cma_probe && target/cma_probe
//
// A forked child fills a private 64 MiB buffer; the parent copies it out of the child with
// process_vm_readv (and into it with process_vm_writev) in blocks of 16 KiB to 64 MiB, best of
// 5, first with 4 KiB pages (what malloc and torch hand out here: transparent huge pages are
// "madvise"), then with both buffers madvise(MADV_HUGEPAGE); memcpy of the same size beside it.
// Every copy is checked (the first and last byte of each block).
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SIZE ((size_t)64 << 20)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(int huge, int fill) {
  char *p = aligned_alloc((size_t)2 << 20, SIZE);
  if (p == NULL) { perror("aligned_alloc"); exit(1); }
  if (huge) madvise(p, SIZE, MADV_HUGEPAGE);
  memset(p, fill, SIZE);
  return p;
}

static int run(int huge) {
  volatile char **shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  volatile int *state = (volatile int *)(shared + 8);
  pid_t child = fork();
  if (child == 0) {
    shared[0] = buffer(huge, 2);
    __sync_synchronize();
    *state = 1;
    while (*state != 2) usleep(1000);
    _exit(0);
  }
  while (*state != 1) usleep(100);
  char *remote = (char *)shared[0];
  char *local = buffer(huge, 0);
  size_t blocks[] = {16 << 10, 256 << 10, 1 << 20, 4 << 20, SIZE};
  printf("%s pages\n", huge ? "huge (MADV_HUGEPAGE)" : "4 KiB");
  for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
    size_t block = blocks[b];
    double best_read = 1e9, best_write = 1e9;
    for (int rep = 0; rep < 5; rep++) {
      memset(local, 0, SIZE);
      double t = now();
      for (size_t at = 0; at < SIZE; at += block) {
        struct iovec l = {local + at, block}, r = {remote + at, block};
        if (process_vm_readv(child, &l, 1, &r, 1, 0) != (ssize_t)block) { perror("process_vm_readv"); return 1; }
      }
      t = now() - t;
      best_read = t < best_read ? t : best_read;
      for (size_t at = 0; at < SIZE; at += block) {
        if (local[at] != 2 || local[at + block - 1] != 2) { fprintf(stderr, "wrong data at %zu\n", at); return 1; }
      }
      t = now();
      for (size_t at = 0; at < SIZE; at += block) {
        struct iovec l = {local + at, block}, r = {remote + at, block};
        if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)block) { perror("process_vm_writev"); return 1; }
      }
      t = now() - t;
      best_write = t < best_write ? t : best_write;
    }
    printf("  block %6zu KiB: readv %5.2f GB/s, writev %5.2f GB/s\n", block >> 10, SIZE / best_read / 1e9,
           SIZE / best_write / 1e9);
  }
  char *other = buffer(huge, 3);
  double best = 1e9;
  for (int rep = 0; rep < 5; rep++) {
    double t = now();
    memcpy(local, other, SIZE);
    t = now() - t;
    best = t < best ? t : best;
  }
  if (local[0] != 3 || local[SIZE - 1] != 3) { fprintf(stderr, "memcpy: wrong data\n"); return 1; }
  printf("  memcpy 64 MiB: %5.2f GB/s\n", SIZE / best / 1e9);
  *state = 2;
  waitpid(child, NULL, 0);
  free(local);
  free(other);
  return 0;
}

int main(void) {
  return run(0) || run(1);
}
