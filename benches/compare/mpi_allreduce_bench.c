/* mpi_allreduce_bench: times MPI_Allreduce the way toroid-bench times toroid's all-reduce.
 *
 * Same sweep and columns as toroid-bench (nccl-tests' format): sizes from -b to -e bytes
 * multiplied by -f, -w warm-up and -n timed iterations per size, float sum, out-of-place then
 * in-place (MPI_IN_PLACE). Each rank times its own iterations after a barrier; the printed time
 * is the mean over ranks of the per-iteration average, in microseconds. algbw = bytes / time
 * (decimal GB/s), busbw = algbw * 2 (n - 1) / n. Values are checked after the timed loop.
 *
 *   mpicc -O2 -o mpi_allreduce_bench mpi_allreduce_bench.c
 *   mpirun -n 4 ./mpi_allreduce_bench -b 4K -e 64M -f 4
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The input element i of rank r (small integers: sums are exact in float). */
static float value(int r, size_t i) { return (float)((r * 7 + i * 3) % 5); }

static double run(float *send, float *recv, size_t count, int in_place, int iters) {
    double t = MPI_Wtime();
    for (int k = 0; k < iters; k++) {
        if (in_place)
            MPI_Allreduce(MPI_IN_PLACE, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else
            MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    return (MPI_Wtime() - t) / (iters > 0 ? iters : 1);
}

static void prepare(float *send, float *recv, size_t count, int rank, int in_place) {
    for (size_t i = 0; i < count; i++) send[i] = value(rank, i);
    if (in_place) memcpy(recv, send, count * sizeof(float));
    else memset(recv, 0, count * sizeof(float));
}

int main(int argc, char **argv) {
    size_t minb = 4096, maxb = 64 << 20;
    int factor = 4, iters = 20, warmup = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) minb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) maxb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) factor = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) warmup = atoi(argv[i + 1]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (factor < 2) factor = 2;
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t maxcount = maxb / sizeof(float);
    float *send = malloc(maxcount * sizeof(float) + 64), *recv = malloc(maxcount * sizeof(float) + 64);
    if (!send || !recv) { fprintf(stderr, "out of memory\n"); MPI_Abort(MPI_COMM_WORLD, 1); }
    if (rank == 0) {
        printf("# mpi_allreduce_bench (MPI_Allreduce, float, sum)\n");
        printf("# nRanks %d minBytes %zu maxBytes %zu step: %d(factor) warmup iters: %d iters: %d validation: 1\n",
               n, minb, maxb, factor, warmup, iters);
        printf("#%60s%35s\n", "out-of-place", "in-place");
        printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count", "type",
               "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
        printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)", "(elements)", "", "",
               "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    }
    long total_wrong = 0;
    for (size_t bytes = minb; bytes <= maxb; bytes *= factor) {
        size_t count = bytes / sizeof(float);
        double res[2][3];
        long wrong[2];
        for (int ip = 0; ip < 2; ip++) {
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, warmup);
            MPI_Barrier(MPI_COMM_WORLD);
            double secs = run(send, recv, count, ip, iters), mean = 0;
            MPI_Allreduce(&secs, &mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            mean /= n;
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, 1);
            long bad = 0;
            for (size_t i = 0; i < count; i++) {
                float want = 0;
                for (int r = 0; r < n; r++) want += value(r, i);
                if (recv[i] != want) bad++;
            }
            MPI_Allreduce(&bad, &wrong[ip], 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
            double algbw = (double)bytes / 1e9 / mean;
            res[ip][0] = mean * 1e6;
            res[ip][1] = algbw;
            res[ip][2] = algbw * 2.0 * (n - 1) / n;
            total_wrong += wrong[ip];
        }
        if (rank == 0)
            printf("%12zu  %12zu  %8s  %6s  %6s  %7.2f  %6.2f  %6.2f  %6ld  %7.2f  %6.2f  %6.2f  %6ld  mpi\n", bytes, count,
                   "float", "sum", "-1", res[0][0], res[0][1], res[0][2], wrong[0], res[1][0], res[1][1], res[1][2],
                   wrong[1]);
        fflush(stdout);
    }
    if (rank == 0) printf("# Out of bounds values : %ld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    free(send);
    free(recv);
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}
