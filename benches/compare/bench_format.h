/* What mpi_allreduce_bench.c and oneccl_allreduce_bench.cpp share: toroid-bench's options, its
 * inputs and check, and nccl-tests' columns (C, and C++ for the oneCCL program). */
#ifndef BENCH_FORMAT_H
#define BENCH_FORMAT_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "4K", "64M", "1G", or bytes. */
static size_t parse_size(const char *s) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    switch (end && *end ? *end : 0) {
    case 'K': case 'k': v <<= 10; break;
    case 'M': case 'm': v <<= 20; break;
    case 'G': case 'g': v <<= 30; break;
    default: break;
    }
    return (size_t)v;
}

/* The sweep: sizes from -b to -e bytes multiplied by -f, -w warm-up and -n timed iterations. */
struct sweep {
    size_t minb, maxb;
    int factor, iters, warmup;
};

/* Reads -b -e -f -n -w into `s`, and the option named `extra` (NULL: none) into *extra_value;
 * returns 0, or the index of an option it does not know. */
static int parse_sweep(int argc, char **argv, struct sweep *s, const char *extra, const char **extra_value) {
    s->minb = 4096, s->maxb = 64 << 20, s->factor = 4, s->iters = 20, s->warmup = 5;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) return i;
        if (!strcmp(argv[i], "-b")) s->minb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) s->maxb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) s->factor = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) s->iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) s->warmup = atoi(argv[i + 1]);
        else if (extra && !strcmp(argv[i], extra)) *extra_value = argv[i + 1];
        else return i;
    }
    if (s->factor < 2) s->factor = 2;
    return 0;
}

/* The input element i of rank r (small integers: sums are exact in float). */
static float value(int r, size_t i) { return (float)((r * 7 + i * 3) % 5); }

static void prepare(float *send, float *recv, size_t count, int rank, int in_place) {
    for (size_t i = 0; i < count; i++) send[i] = value(rank, i);
    if (in_place) memcpy(recv, send, count * sizeof(float));
    else memset(recv, 0, count * sizeof(float));
}

/* Elements of `recv` that are not the sum over the n ranks' inputs. */
static long count_wrong(const float *recv, size_t count, int n) {
    long bad = 0;
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < n; r++) want += value(r, i);
        if (recv[i] != want) bad++;
    }
    return bad;
}

static void print_header(const char *title, int n, const struct sweep *s) {
    printf("# %s\n", title);
    printf("# nRanks %d minBytes %zu maxBytes %zu step: %d(factor) warmup iters: %d iters: %d validation: 1\n", n,
           s->minb, s->maxb, s->factor, s->warmup, s->iters);
    printf("#%60s%35s\n", "out-of-place", "in-place");
    printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count", "type", "redop",
           "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
    printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)", "(elements)", "", "", "",
           "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
}

/* One row: `mean` seconds per call and `wrong` elements, out-of-place [0] and in-place [1]. */
static void print_row(size_t bytes, int n, const double mean[2], const long wrong[2], const char *tag) {
    double algbw[2], busbw[2];
    for (int ip = 0; ip < 2; ip++) {
        algbw[ip] = (double)bytes / 1e9 / mean[ip];
        busbw[ip] = algbw[ip] * 2.0 * (n - 1) / n;
    }
    printf("%12zu  %12zu  %8s  %6s  %6s  %7.2f  %6.2f  %6.2f  %6ld  %7.2f  %6.2f  %6.2f  %6ld  %s\n", bytes,
           bytes / sizeof(float), "float", "sum", "-1", mean[0] * 1e6, algbw[0], busbw[0], wrong[0], mean[1] * 1e6,
           algbw[1], busbw[1], wrong[1], tag);
    fflush(stdout);
}

#endif
