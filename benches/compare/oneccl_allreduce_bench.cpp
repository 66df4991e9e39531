/* oneccl_allreduce_bench: times oneCCL's ccl::allreduce the way toroid-bench times toroid's.
 *
 * The same sweep, columns and checks as mpi_allreduce_bench.c (nccl-tests' format), through
 * oneCCL's C++ API (oneapi/ccl.hpp; host buffers; oneCCL 2022.2 from PyPI, whose C API,
 * oneapi/ccl.h, needs a SYCL device or crashes in its CPU plugin here).
 * Without MPI in the program: rank and world size come from the launcher's environment
 * (TOROID_RANK / TOROID_WORLD_SIZE from toroid-run, else PMI_RANK / PMI_SIZE from Intel MPI's
 * mpiexec, else OMPI_COMM_WORLD_RANK / _SIZE from Open MPI's), and rank 0 hands its key-value
 * store's address to the others through the file named by -i (written whole, then renamed).
 * oneCCL's own transport between the ranks is chosen by its environment (CCL_ATL_TRANSPORT,
 * CCL_ATL_SHM, ...: run.sh says which). Barriers are ccl::barrier.
 *
 *   c++ -O2 -I$VENV/include -o oneccl_allreduce_bench oneccl_allreduce_bench.cpp -L$VENV/lib -lccl
 *   toroid-run -n 2 -- ./oneccl_allreduce_bench -i /tmp/ccl-kvs -b 4K -e 64M -f 4
 */
#include <oneapi/ccl.hpp>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static ccl::communicator *comm;

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

static int env_int(const char *a, const char *b, const char *c) {
    const char *v = getenv(a);
    if (!v) v = getenv(b);
    if (!v) v = getenv(c);
    return v ? atoi(v) : -1;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The input element i of rank r (small integers: sums are exact in float). */
static float value(int r, size_t i) { return (float)((r * 7 + i * 3) % 5); }

static void barrier(void) { ccl::barrier(*comm).wait(); }

static double run(float *send, float *recv, size_t count, int in_place, int iters) {
    double t = now();
    for (int k = 0; k < iters; k++)
        ccl::allreduce(in_place ? recv : send, recv, count, ccl::reduction::sum, *comm).wait();
    return (now() - t) / (iters > 0 ? iters : 1);
}

static void prepare(float *send, float *recv, size_t count, int rank, int in_place) {
    for (size_t i = 0; i < count; i++) send[i] = value(rank, i);
    if (in_place) memcpy(recv, send, count * sizeof(float));
    else memset(recv, 0, count * sizeof(float));
}

/* Rank 0 publishes its key-value store's address in `path`; the others wait for it (at most
 * 60 s) and connect to that store. */
static std::shared_ptr<ccl::kvs> share_kvs(int rank, const char *path) {
    ccl::kvs::address_type addr;
    if (rank == 0) {
        std::shared_ptr<ccl::kvs> kvs = ccl::create_main_kvs();
        addr = kvs->get_address();
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *f = fopen(tmp, "wb");
        if (!f || fwrite(addr.data(), addr.size(), 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
            perror("writing the store's address");
            exit(1);
        }
        return kvs;
    }
    for (int tries = 0; tries < 60000; tries++) {
        FILE *f = fopen(path, "rb");
        if (f) {
            size_t got = fread(addr.data(), addr.size(), 1, f);
            fclose(f);
            if (got == 1) return ccl::create_kvs(addr);
        }
        usleep(1000);
    }
    fprintf(stderr, "rank %d: no store address in %s after 60 s\n", rank, path);
    exit(1);
}

int main(int argc, char **argv) {
    size_t minb = 4096, maxb = 64 << 20;
    int factor = 4, iters = 20, warmup = 5;
    const char *id_path = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-b")) minb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-e")) maxb = parse_size(argv[i + 1]);
        else if (!strcmp(argv[i], "-f")) factor = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-n")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-i")) id_path = argv[i + 1];
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (factor < 2) factor = 2;
    int rank = env_int("TOROID_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK");
    int n = env_int("TOROID_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE");
    if (rank < 0 || n < 1 || rank >= n || !id_path) {
        fprintf(stderr, "needs a launcher's rank and size in the environment and -i ID_FILE\n");
        return 2;
    }
    ccl::init();
    ccl::communicator c = ccl::create_communicator(n, rank, share_kvs(rank, id_path));
    comm = &c;
    size_t maxcount = maxb / sizeof(float);
    float *send = (float *)malloc(maxcount * sizeof(float) + 64), *recv = (float *)malloc(maxcount * sizeof(float) + 64);
    double *secs = (double *)malloc(2 * sizeof(double));
    if (!send || !recv || !secs) { fprintf(stderr, "out of memory\n"); return 1; }
    if (rank == 0) {
        ccl::library_version v = ccl::get_library_version();
        printf("# oneccl_allreduce_bench (ccl::allreduce, float, sum; oneCCL %s)\n", v.full);
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
            barrier();
            secs[0] = run(send, recv, count, ip, iters);
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, 1);
            long bad = 0;
            for (size_t i = 0; i < count; i++) {
                float want = 0;
                for (int r = 0; r < n; r++) want += value(r, i);
                if (recv[i] != want) bad++;
            }
            secs[1] = (double)bad;
            ccl::allreduce(secs, secs, 2, ccl::reduction::sum, *comm).wait();
            double mean = secs[0] / n;
            wrong[ip] = (long)secs[1];
            double algbw = (double)bytes / 1e9 / mean;
            res[ip][0] = mean * 1e6;
            res[ip][1] = algbw;
            res[ip][2] = algbw * 2.0 * (n - 1) / n;
            total_wrong += wrong[ip];
        }
        if (rank == 0)
            printf("%12zu  %12zu  %8s  %6s  %6s  %7.2f  %6.2f  %6.2f  %6ld  %7.2f  %6.2f  %6.2f  %6ld  oneccl\n", bytes,
                   count, "float", "sum", "-1", res[0][0], res[0][1], res[0][2], wrong[0], res[1][0], res[1][1],
                   res[1][2], wrong[1]);
        fflush(stdout);
    }
    if (rank == 0) printf("# Out of bounds values : %ld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    free(send);
    free(recv);
    free(secs);
    return total_wrong ? 1 : 0;
}
