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
 *   toroid-run -n 2 -- ./oneccl_allreduce_bench -i ccl-kvs -b 4K -e 64M -f 4
 */
#include <oneapi/ccl.hpp>
#include <time.h>
#include <unistd.h>

#include "bench_format.h"

static ccl::communicator *comm;

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

static void barrier(void) { ccl::barrier(*comm).wait(); }

static double run(float *send, float *recv, size_t count, int in_place, int iters) {
    double t = now();
    for (int k = 0; k < iters; k++)
        ccl::allreduce(in_place ? recv : send, recv, count, ccl::reduction::sum, *comm).wait();
    return (now() - t) / (iters > 0 ? iters : 1);
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
    struct sweep s;
    const char *id_path = NULL;
    int bad = parse_sweep(argc, argv, &s, "-i", &id_path);
    if (bad) { fprintf(stderr, "unknown option %s\n", argv[bad]); return 2; }
    int rank = env_int("TOROID_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK");
    int n = env_int("TOROID_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE");
    if (rank < 0 || n < 1 || rank >= n || !id_path) {
        fprintf(stderr, "needs a launcher's rank and size in the environment and -i ID_FILE\n");
        return 2;
    }
    ccl::init();
    ccl::communicator c = ccl::create_communicator(n, rank, share_kvs(rank, id_path));
    comm = &c;
    size_t maxcount = s.maxb / sizeof(float);
    float *send = (float *)malloc(maxcount * sizeof(float) + 64), *recv = (float *)malloc(maxcount * sizeof(float) + 64);
    if (!send || !recv) { fprintf(stderr, "out of memory\n"); return 1; }
    if (rank == 0) {
        char title[256];
        snprintf(title, sizeof title, "oneccl_allreduce_bench (ccl::allreduce, float, sum; oneCCL %s)",
                 ccl::get_library_version().full);
        print_header(title, n, &s);
    }
    long total_wrong = 0;
    for (size_t bytes = s.minb; bytes <= s.maxb; bytes *= s.factor) {
        size_t count = bytes / sizeof(float);
        double mean[2];
        long wrong[2];
        for (int ip = 0; ip < 2; ip++) {
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, s.warmup);
            barrier();
            double sums[2] = {run(send, recv, count, ip, s.iters), 0};  // seconds per call, wrong elements
            prepare(send, recv, count, rank, ip);
            run(send, recv, count, ip, 1);
            sums[1] = (double)count_wrong(recv, count, n);
            ccl::allreduce(sums, sums, 2, ccl::reduction::sum, *comm).wait();
            mean[ip] = sums[0] / n;
            wrong[ip] = (long)sums[1];
            total_wrong += wrong[ip];
        }
        if (rank == 0) print_row(bytes, n, mean, wrong, "oneccl");
    }
    if (rank == 0) printf("# Out of bounds values : %ld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    free(send);
    free(recv);
    return total_wrong ? 1 : 0;
}
