/* nccl_device_bench: times NCCL's collectives on device memory, with nccl-tests' columns, for a
 * side-by-side with toroid. Several ranks (processes) share ONE GPU.
 *
 *   cc -O2 -o nccl_device_bench benches/compare/nccl_device_bench.c -ldl
 *   toroid-run -n 2 ./nccl_device_bench --id-file nccl-id -b 1M -e 256M -f 4 -n 20 -w 5
 *
 * Options: -b MINBYTES -e MAXBYTES -f FACTOR -n ITERS -w WARMUP (K/M/G suffixes; as toroid-bench,
 * through bench_format.h), -c 0|1 (check, default 1), --collective all_reduce|broadcast|reduce|
 * all_gather|reduce_scatter|all_to_all (default all_reduce), --device N (default 0), --id-file PATH
 * (needed with more than one rank). Rank and world size come from TOROID_RANK / TOROID_WORLD_SIZE
 * (set by toroid-run), else RANK / WORLD_SIZE, else one rank.
 *
 * No CUDA or NCCL headers are needed to build it: the driver (libcuda.so.1) and NCCL ($NCCL_LIBRARY,
 * else libnccl.so.2 from the loader's path, e.g. the nvidia-nccl-cu13 wheel's nvidia/nccl/lib) are
 * loaded at run time, and the few types and enum values used are declared below (from nccl.h).
 * Several ranks on one GPU need NCCL >= 2.31 and NCCL_MULTI_RANK_GPU_ENABLE=1, which this program
 * sets unless the caller did.
 *
 * Like nccl-tests: float32, sum, root 0 (broadcast, reduce); the size column is the bytes of the
 * whole collective (all_gather, reduce_scatter, all_to_all: the whole buffer, so each rank's block
 * is size / nranks / 4 elements); each size is timed out-of-place then in-place (all_gather: send =
 * recv + rank * block; reduce_scatter: recv = send + rank * block; all_to_all: send == recv, not
 * checked, as in nccl-tests) with CUDA events around ITERS calls after WARMUP calls; the printed
 * time is the MAX over ranks of each rank's time per call (nccl-tests' -a 3; its default is the
 * mean). busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all),
 * 1 (broadcast, reduce). With -c 1 one more call's output is compared, every element, with the
 * exact value computed on the host; #wrong is the sum over ranks.
 *
 * Exit status: 0; 1 when some value was wrong; 2 on any error (usage, dlopen/dlsym, CUDA, NCCL);
 * 3 when libcuda.so.1 or libnccl.so.2 cannot be loaded (a script can print SKIPPED).
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* parse_size, parse_sweep and print_header are used here; the rest of it (value(), prepare(),
 * count_wrong(), print_row(): all-reduce only) is not, hence the pragma. It needs no MPI. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "bench_format.h"
#pragma GCC diagnostic pop

/* The CUDA driver API, as cuda.h declares it on 64-bit Linux. */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream; /* the same object as cudaStream_t */
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*GetErrorString)(CUresult, const char **);
} cu;

/* NCCL, as nccl.h declares it: enums are int-sized, ncclUniqueId is 128 bytes passed by value. */
typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
enum { ncclFloat32 = 7, ncclFloat64 = 8 };  /* ncclDataType_t */
enum { ncclSum = 0, ncclMax = 2 };          /* ncclRedOp_t */
static struct {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char *(*GetErrorString)(ncclResult_t);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
    ncclResult_t (*Reduce)(const void *, void *, size_t, int, int, int, ncclComm_t, CUstream);
    ncclResult_t (*AllGather)(const void *, void *, size_t, int, ncclComm_t, CUstream);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, int, int, ncclComm_t, CUstream);
    ncclResult_t (*Send)(const void *, size_t, int, int, ncclComm_t, CUstream);
    ncclResult_t (*Recv)(void *, size_t, int, int, ncclComm_t, CUstream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
} nc;

static int rank = 0, nranks = 1;

static void die(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "nccl_device_bench: rank %d: ", rank);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(status);
}

static void cu_check(CUresult r, const char *call) {
    const char *msg = NULL;
    if (r == 0) return;
    if (cu.GetErrorString) cu.GetErrorString(r, &msg);
    die(2, "cu%s failed: CUDA error %d (%s)", call + 3, r, msg ? msg : "unknown"); /* "cu.X(..)" */
}
static void nccl_check(ncclResult_t r, const char *call) {
    if (r != 0)
        die(2, "nccl%s failed: NCCL error %d (%s; NCCL_DEBUG=WARN tells more)", call + 3, r, nc.GetErrorString(r));
}
#define CU(call) cu_check((call), #call)
#define NC(call) nccl_check((call), #call)

/* dlsym into a function pointer: memcpy, since C has no cast from void * to a function pointer. */
static void load(void *lib, const char *libname, const char *name, const char *fallback, void *fnptr) {
    void *p = dlsym(lib, name);
    if (!p && fallback) p = dlsym(lib, fallback);
    if (!p) die(2, "dlsym(%s, \"%s\") failed: %s", libname, name, dlerror());
    memcpy(fnptr, &p, sizeof p);
}

static void load_libraries(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) die(3, "libcuda.so.1 not found (no NVIDIA driver?): %s", dlerror());
    load(lib, "libcuda.so.1", "cuGetErrorString", NULL, &cu.GetErrorString);
    load(lib, "libcuda.so.1", "cuInit", NULL, &cu.Init);
    load(lib, "libcuda.so.1", "cuDeviceGet", NULL, &cu.DeviceGet);
    load(lib, "libcuda.so.1", "cuDevicePrimaryCtxRetain", NULL, &cu.DevicePrimaryCtxRetain);
    load(lib, "libcuda.so.1", "cuCtxSetCurrent", NULL, &cu.CtxSetCurrent);
    load(lib, "libcuda.so.1", "cuMemAlloc_v2", NULL, &cu.MemAlloc);
    load(lib, "libcuda.so.1", "cuMemFree_v2", NULL, &cu.MemFree);
    load(lib, "libcuda.so.1", "cuMemcpyHtoD_v2", NULL, &cu.MemcpyHtoD);
    load(lib, "libcuda.so.1", "cuMemcpyDtoH_v2", NULL, &cu.MemcpyDtoH);
    load(lib, "libcuda.so.1", "cuStreamCreate", NULL, &cu.StreamCreate);
    load(lib, "libcuda.so.1", "cuStreamSynchronize", NULL, &cu.StreamSynchronize);
    load(lib, "libcuda.so.1", "cuEventCreate", NULL, &cu.EventCreate);
    load(lib, "libcuda.so.1", "cuEventRecord", NULL, &cu.EventRecord);
    load(lib, "libcuda.so.1", "cuEventSynchronize", NULL, &cu.EventSynchronize);
    /* _v2 since CUDA 12.8 (the only name CUDA 13's header knows); same arguments. */
    load(lib, "libcuda.so.1", "cuEventElapsedTime_v2", "cuEventElapsedTime", &cu.EventElapsedTime);

    /* NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless told; read at init. */
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
    const char *path = getenv("NCCL_LIBRARY");
    if (path && *path && access(path, F_OK) != 0) die(3, "NCCL_LIBRARY=%s: no such file", path);
    void *nccl = dlopen(path && *path ? path : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!nccl && path && *path) die(2, "dlopen(%s) failed: %s", path, dlerror());
    if (!nccl) die(3, "libnccl.so.2 not found: set NCCL_LIBRARY (%s)", dlerror());
    const char *n = "libnccl.so.2";
    load(nccl, n, "ncclGetErrorString", NULL, &nc.GetErrorString);
    load(nccl, n, "ncclGetVersion", NULL, &nc.GetVersion);
    load(nccl, n, "ncclGetUniqueId", NULL, &nc.GetUniqueId);
    load(nccl, n, "ncclCommInitRank", NULL, &nc.CommInitRank);
    load(nccl, n, "ncclCommDestroy", NULL, &nc.CommDestroy);
    load(nccl, n, "ncclAllReduce", NULL, &nc.AllReduce);
    load(nccl, n, "ncclBroadcast", NULL, &nc.Broadcast);
    load(nccl, n, "ncclReduce", NULL, &nc.Reduce);
    load(nccl, n, "ncclAllGather", NULL, &nc.AllGather);
    load(nccl, n, "ncclReduceScatter", NULL, &nc.ReduceScatter);
    load(nccl, n, "ncclSend", NULL, &nc.Send);
    load(nccl, n, "ncclRecv", NULL, &nc.Recv);
    load(nccl, n, "ncclGroupStart", NULL, &nc.GroupStart);
    load(nccl, n, "ncclGroupEnd", NULL, &nc.GroupEnd);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The unique id goes through a file: rank 0 writes id + job token to PATH.tmp and renames it (so
 * nobody reads half a file); the others poll. The token (toroid-run's TOROID_STORE_ADDR, a port
 * chosen per job) keeps a rank from taking a stale file that an earlier, killed job left behind;
 * without toroid-run there is no token, so give each job a fresh PATH. */
static ncclUniqueId exchange_id(const char *path) {
    ncclUniqueId id;
    const char *token = getenv("TOROID_STORE_ADDR") ? getenv("TOROID_STORE_ADDR") : "";
    size_t tlen = strlen(token);
    char buf[sizeof id + 256];
    if (tlen > 256) die(2, "TOROID_STORE_ADDR is too long");
    if (rank == 0) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        unlink(path);
        NC(nc.GetUniqueId(&id));
        FILE *f = fopen(tmp, "wb");
        if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fwrite(token, 1, tlen, f) != tlen || fclose(f) != 0)
            die(2, "cannot write %s", tmp);
        if (rename(tmp, path) != 0) die(2, "rename(%s, %s) failed", tmp, path);
        return id;
    }
    for (int waited = 0;; waited += 10) {
        FILE *f = fopen(path, "rb");
        if (f) {
            size_t got = fread(buf, 1, sizeof buf, f);
            fclose(f);
            if (got == sizeof id + tlen && memcmp(buf + sizeof id, token, tlen) == 0) {
                memcpy(&id, buf, sizeof id);
                return id;
            }
        }
        if (waited >= 60000) die(2, "no NCCL unique id in %s after 60 s (rank 0 writes it)", path);
        sleep_ms(10);
    }
}

enum coll { ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL };
static const char *coll_names[] = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"};

/* One size of one collective on this rank: `count` is NCCL's count argument (all_gather,
 * reduce_scatter, all_to_all: one rank's block), `nin` / `nout` the elements of the input and
 * output, `in` / `out` where they are, for out-of-place [0] and in-place [1]. */
struct shape {
    enum coll c;
    size_t count, nin, nout;
    CUdeviceptr in[2], out[2];
};

static struct shape shape_of(enum coll c, size_t bytes, CUdeviceptr send, CUdeviceptr recv) {
    struct shape s = {c, bytes / sizeof(float), 0, 0, {send, recv}, {recv, recv}};
    s.nin = s.nout = s.count;
    size_t off = 0;
    if (c == ALL_GATHER || c == REDUCE_SCATTER || c == ALL_TO_ALL) {
        s.count = bytes / sizeof(float) / (size_t)nranks;
        off = (size_t)rank * s.count * sizeof(float);
        s.nin = c == ALL_GATHER ? s.count : s.count * nranks;
        s.nout = c == REDUCE_SCATTER ? s.count : s.count * nranks;
    }
    if (c == ALL_GATHER) s.in[1] = recv + off;   /* NCCL's in-place all-gather */
    if (c == REDUCE_SCATTER) s.in[1] = send, s.out[1] = send + off;  /* and reduce-scatter */
    return s;
}

static void run(const struct shape *s, int ip, ncclComm_t comm, CUstream st) {
    const void *in = (const void *)(uintptr_t)s->in[ip];
    void *out = (void *)(uintptr_t)s->out[ip];
    switch (s->c) {
    case ALL_REDUCE: NC(nc.AllReduce(in, out, s->count, ncclFloat32, ncclSum, comm, st)); break;
    case BROADCAST: NC(nc.Broadcast(in, out, s->count, ncclFloat32, 0, comm, st)); break;
    case REDUCE: NC(nc.Reduce(in, out, s->count, ncclFloat32, ncclSum, 0, comm, st)); break;
    case ALL_GATHER: NC(nc.AllGather(in, out, s->count, ncclFloat32, comm, st)); break;
    case REDUCE_SCATTER: NC(nc.ReduceScatter(in, out, s->count, ncclFloat32, ncclSum, comm, st)); break;
    case ALL_TO_ALL: /* as nccl-tests: a group of sends and receives, one pair per peer */
        NC(nc.GroupStart());
        for (int r = 0; r < nranks; r++) {
            size_t off = (size_t)r * s->count * sizeof(float);
            NC(nc.Send((const char *)in + off, s->count, ncclFloat32, r, comm, st));
            NC(nc.Recv((char *)out + off, s->count, ncclFloat32, r, comm, st));
        }
        NC(nc.GroupEnd());
        break;
    }
}

/* Input element i of rank r: small integers, so that float sums are exact in any order. */
static float elem(int r, size_t i) { return (float)((r * 7 + i * 13) % 101) - 50; }

/* The exact output element i on this rank. */
static float expected(const struct shape *s, size_t i) {
    size_t blk = s->count ? i / s->count : 0, j = s->count ? i % s->count : 0;
    if (s->c == BROADCAST) return elem(0, i);
    if (s->c == ALL_GATHER) return elem((int)blk, j);                      /* block b: rank b's input */
    if (s->c == ALL_TO_ALL) return elem((int)blk, (size_t)rank * s->count + j); /* rank b's block `rank` */
    if (s->c == REDUCE_SCATTER) i += (size_t)rank * s->count;             /* piece `rank` of the sum */
    float sum = 0;
    for (int r = 0; r < nranks; r++) sum += elem(r, i);
    return sum;
}

#define SENTINEL 1e30f /* in the output before a checked call: a call that writes nothing is caught */

/* Output first, then input: in-place, the input lands inside the output and the rest keeps the
 * sentinel. Blocking uploads: the stream (flags 0) is ordered after them. */
static void fill(const struct shape *s, int ip, float *host) {
    for (size_t i = 0; i < s->nout; i++) host[i] = SENTINEL;
    CU(cu.MemcpyHtoD(s->out[ip], host, s->nout * sizeof(float)));
    for (size_t i = 0; i < s->nin; i++) host[i] = elem(rank, i);
    CU(cu.MemcpyHtoD(s->in[ip], host, s->nin * sizeof(float)));
}

static void usage(void) {
    fprintf(stderr, "usage: nccl_device_bench [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-n ITERS] [-w WARMUP]\n"
                    "         [-c 0|1] [--collective NAME] [--device N] [--id-file PATH]\n"
                    "  NAME: all_reduce broadcast reduce all_gather reduce_scatter all_to_all\n"
                    "  e.g. toroid-run -n 2 ./nccl_device_bench --id-file nccl-id -b 1M -e 256M\n");
}

static int env_int(const char *name, const char *fallback, int dflt) {
    const char *v = getenv(name);
    if (!v || !*v) v = getenv(fallback);
    return v && *v ? atoi(v) : dflt;
}

int main(int argc, char **argv) {
    rank = env_int("TOROID_RANK", "RANK", 0);
    nranks = env_int("TOROID_WORLD_SIZE", "WORLD_SIZE", 1);
    if (nranks < 1 || rank < 0 || rank >= nranks) die(2, "bad rank %d of world size %d", rank, nranks);

    /* Our options out, then bench_format.h's parse_sweep reads the rest (-b -e -f -n -w). */
    const char *id_file = NULL, *coll_name = "all_reduce";
    int device = 0, check = 1, c = -1;
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    if (!rest) die(2, "out of host memory");
    int nrest = 1;
    rest[0] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        int ours = !strcmp(a, "--id-file") || !strcmp(a, "--device") || !strcmp(a, "-c") || !strcmp(a, "--collective");
        if (ours && i + 1 >= argc) { usage(); die(2, "%s needs a value", a); }
        if (!strcmp(a, "--id-file")) id_file = argv[++i];
        else if (!strcmp(a, "--device")) device = atoi(argv[++i]);
        else if (!strcmp(a, "-c")) check = atoi(argv[++i]);
        else if (!strcmp(a, "--collective")) coll_name = argv[++i];
        else rest[nrest++] = argv[i];
    }
    struct sweep sw;
    int bad = parse_sweep(nrest, rest, &sw, NULL, NULL);
    if (bad) { usage(); die(2, "unknown option or missing value: %s", rest[bad]); }
    for (int k = 0; k < 6; k++) if (!strcmp(coll_name, coll_names[k])) c = k;
    if (c < 0) { usage(); die(2, "unknown collective %s", coll_name); }
    if (nranks > 1 && !id_file) { usage(); die(2, "--id-file PATH is needed with %d ranks", nranks); }
    if (sw.iters < 1) sw.iters = 1;
    if (sw.warmup < 0) sw.warmup = 0;

    load_libraries();
    CUdevice dev;
    CUcontext ctx;
    CU(cu.Init(0));
    CU(cu.DeviceGet(&dev, device));
    /* The primary context is the one NCCL's CUDA runtime uses for this device. */
    CU(cu.DevicePrimaryCtxRetain(&ctx, dev));
    CU(cu.CtxSetCurrent(ctx));

    int v;
    NC(nc.GetVersion(&v));
    int major = v >= 10000 ? v / 10000 : v / 1000, minor = v >= 10000 ? v / 100 % 100 : v / 100 % 10;
    ncclUniqueId id;
    if (nranks > 1) id = exchange_id(id_file);
    else NC(nc.GetUniqueId(&id));
    ncclComm_t comm;
    NC(nc.CommInitRank(&comm, nranks, id, rank));
    /* Every rank has read the id once init returns (it needs them all), so the file can go now. */
    if (rank == 0 && id_file) unlink(id_file);

    size_t maxcount = sw.maxb / sizeof(float) ? sw.maxb / sizeof(float) : 1;
    CUdeviceptr send, recv, stats;
    CUstream st;
    CUevent start, stop;
    CU(cu.MemAlloc(&send, maxcount * sizeof(float)));
    CU(cu.MemAlloc(&recv, maxcount * sizeof(float)));
    CU(cu.MemAlloc(&stats, 4 * sizeof(double)));
    CU(cu.StreamCreate(&st, 0));
    CU(cu.EventCreate(&start, 0));
    CU(cu.EventCreate(&stop, 0));
    float *host = malloc(maxcount * sizeof(float));
    if (!host) die(2, "out of host memory");

    const char *redop = c == BROADCAST || c == ALL_GATHER || c == ALL_TO_ALL ? "none" : "sum";
    if (rank == 0) {
        char title[256];
        snprintf(title, sizeof title, "nccl_device_bench: NCCL %d.%d.%d, %d ranks, device %d (%s, float, %s)",
                 major, minor, v % 100, nranks, device, coll_name, redop);
        print_header(title, nranks, &sw);
    }
    int root = c == BROADCAST || c == REDUCE ? 0 : -1;
    double factor = c == ALL_REDUCE ? 2.0 * (nranks - 1) / nranks
                  : c == BROADCAST || c == REDUCE ? 1.0 : (double)(nranks - 1) / nranks;
    long total_wrong = 0, rows = 0;
    double busbw_sum = 0;
    for (size_t bytes = sw.minb; bytes <= sw.maxb; bytes = bytes ? bytes * sw.factor : 4) {
        struct shape s = shape_of((enum coll)c, bytes, send, recv);
        double stat[4]; /* seconds per call [oop, ip], then wrong elements [oop, ip] (-1: not checked) */
        for (int ip = 0; ip < 2; ip++) {
            fill(&s, ip, host);
            for (int k = 0; k < sw.warmup; k++) run(&s, ip, comm, st);
            CU(cu.StreamSynchronize(st));
            CU(cu.EventRecord(start, st));
            for (int k = 0; k < sw.iters; k++) run(&s, ip, comm, st);
            CU(cu.EventRecord(stop, st));
            CU(cu.EventSynchronize(stop));
            float ms;
            CU(cu.EventElapsedTime(&ms, start, stop));
            stat[ip] = ms / 1e3 / sw.iters;
            stat[2 + ip] = -1;
            /* nccl-tests does not check in-place all-to-all either: send == recv races */
            if (!check || (c == ALL_TO_ALL && ip)) continue;
            fill(&s, ip, host);
            run(&s, ip, comm, st);
            CU(cu.StreamSynchronize(st));
            CU(cu.MemcpyDtoH(host, s.out[ip], s.nout * sizeof(float)));
            long wrong = 0;
            if (c != REDUCE || rank == 0) /* reduce: only the root has a result */
                for (size_t i = 0; i < s.nout; i++) wrong += host[i] != expected(&s, i);
            stat[2 + ip] = (double)wrong;
        }
        /* Max time and total wrong over the ranks, through NCCL itself (no MPI here). */
        CU(cu.MemcpyHtoD(stats, stat, sizeof stat));
        CUdeviceptr w = stats + 2 * sizeof(double);
        NC(nc.AllReduce((void *)(uintptr_t)stats, (void *)(uintptr_t)stats, 2, ncclFloat64, ncclMax, comm, st));
        NC(nc.AllReduce((void *)(uintptr_t)w, (void *)(uintptr_t)w, 2, ncclFloat64, ncclSum, comm, st));
        CU(cu.StreamSynchronize(st));
        CU(cu.MemcpyDtoH(stat, stats, sizeof stat));
        for (int ip = 0; ip < 2; ip++) total_wrong += stat[2 + ip] > 0 ? (long)stat[2 + ip] : 0;
        if (rank == 0) {
            size_t total = c == ALL_GATHER || c == ALL_TO_ALL ? s.nout : s.nin; /* whole collective */
            char wrong[2][24];
            printf("%12zu  %12zu  %8s  %6s  %6d", total * sizeof(float), total, "float", redop, root);
            for (int ip = 0; ip < 2; ip++) {
                double algbw = (double)(total * sizeof(float)) / 1e9 / stat[ip];
                busbw_sum += algbw * factor;
                if (stat[2 + ip] < 0) snprintf(wrong[ip], sizeof wrong[ip], "N/A");
                else snprintf(wrong[ip], sizeof wrong[ip], "%.0f", stat[2 + ip]);
                printf("  %7.2f  %6.2f  %6.2f  %6s", stat[ip] * 1e6, algbw, algbw * factor, wrong[ip]);
            }
            printf("  nccl\n");
            fflush(stdout);
            rows += 2;
        }
    }
    if (rank == 0) {
        printf("# Out of bounds values : %ld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
        printf("# Avg bus bandwidth    : %g\n", rows ? busbw_sum / rows : 0.0);
    }
    NC(nc.CommDestroy(comm));
    CU(cu.MemFree(send));
    CU(cu.MemFree(recv));
    CU(cu.MemFree(stats));
    free(host);
    free(rest);
    return total_wrong ? 1 : 0;
}
