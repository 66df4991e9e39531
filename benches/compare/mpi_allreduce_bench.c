/* mpi_allreduce_bench: times MPI_Allreduce the way toroid-bench times toroid's all-reduce.
 *
 * Same sweep and columns as toroid-bench (nccl-tests' format; bench_format.h): sizes from -b to
 * -e bytes multiplied by -f, -w warm-up and -n timed iterations per size, float sum, out-of-place
 * then in-place (MPI_IN_PLACE). Each rank times its own iterations after a barrier; the printed
 * time is the mean over ranks of the per-iteration average, in microseconds. algbw = bytes /
 * time (decimal GB/s), busbw = algbw * 2 (n - 1) / n. Values are checked after the timed loop.
 *
 *   mpicc -O2 -o mpi_allreduce_bench mpi_allreduce_bench.c
 *   mpirun -n 4 ./mpi_allreduce_bench -b 4K -e 64M -f 4
 */
#include <mpi.h>

#include "bench_format.h"

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

int main(int argc, char **argv) {
    struct sweep s;
    int bad = parse_sweep(argc, argv, &s, NULL, NULL);
    if (bad) { fprintf(stderr, "unknown option %s\n", argv[bad]); return 2; }
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t maxcount = s.maxb / sizeof(float);
    float *send = malloc(maxcount * sizeof(float) + 64), *recv = malloc(maxcount * sizeof(float) + 64);
    if (!send || !recv) { fprintf(stderr, "out of memory\n"); MPI_Abort(MPI_COMM_WORLD, 1); }
    if (rank == 0) print_header("mpi_allreduce_bench (MPI_Allreduce, float, sum)", n, &s);
    long total_wrong = 0;
    for (size_t bytes = s.minb; bytes <= s.maxb; bytes *= s.factor) {
        size_t count = bytes / sizeof(float);
        double mean[2];
        long wrong[2];
        for (int ip = 0; ip < 2; ip++) {
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, s.warmup);
            MPI_Barrier(MPI_COMM_WORLD);
            double secs = run(send, recv, count, ip, s.iters);
            MPI_Allreduce(&secs, &mean[ip], 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            mean[ip] /= n;
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, 1);
            long bad = count_wrong(recv, count, n);
            MPI_Allreduce(&bad, &wrong[ip], 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
            total_wrong += wrong[ip];
        }
        if (rank == 0) print_row(bytes, n, mean, wrong, "mpi");
    }
    if (rank == 0) printf("# Out of bounds values : %ld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    free(send);
    free(recv);
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}
