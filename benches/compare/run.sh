#!/usr/bin/env bash
# Side-by-side all-reduce on this host: toroid (toroid-bench under toroid-run) against Open MPI
# (our own mpi_allreduce_bench.c, timed the same way), oneCCL (oneccl_allreduce_bench.cpp), and
# PyTorch's gloo backend when torch is installed. Prints one table per rank count with the median
# over RUNS interleaved runs and the ratio toroid/other per size, for busbw (higher is better) and
# time (lower is better); then, with torch, toroid and gloo through torch.distributed, and
# toroid's numpy binding.
#
#   benches/compare/run.sh                  # 2 and 4 ranks, 4 KiB .. 64 MiB, 5 runs each
#   RANKS="2 4 8" RUNS=3 benches/compare/run.sh
#   GLOO=0 benches/compare/run.sh           # skip torch/gloo even when torch is installed
#   ONECCL=0 benches/compare/run.sh         # skip oneCCL
#   TORCH=0 benches/compare/run.sh          # skip the all-reduce through torch.distributed
#
# oneCCL (Intel's CPU collective library) comes from PyPI into $OUT/oneccl on first use (about
# 500 MB of wheels, 1.9 GB installed): oneccl-cpu 2022.2's libccl.so.1, which needs libccl.so.2
# from the oneccl wheel, which needs Intel's SYCL and compiler runtimes (intel-sycl-rt, intel-cmplr-lib-rt);
# oneccl-devel's headers; Intel MPI (impi-rt), whose mpiexec.hydra launches the ranks and whose
# libmpi is oneCCL's transport (CCL_ATL_TRANSPORT=mpi: the OFI transport needs a libfabric the
# wheels do not carry). Its configuration is the best of those the issue that asked for it
# measured: direct all-reduce (CCL_ALLREDUCE=direct) and, with more ranks than cores, worker
# offload with sched_yield (CCL_WORKER_OFFLOAD=1 CCL_YIELD=sched_yield). The program,
# oneccl_allreduce_bench.cpp, times it as the others are timed.
#
# Installs Open MPI from Debian (apt-get install openmpi-bin libopenmpi-dev) when mpicc or
# mpirun is missing. Both sides bind ranks to cores (toroid-run binds by default; mpirun gets
# --bind-to core, with :overload-allowed and --oversubscribe when ranks outnumber cores), use
# float sum, the same sizes, warm-up and iteration counts, and report nccl-tests' busbw
# (algbw * 2 (n - 1) / n, decimal GB/s). Other load on the machine makes the numbers noisy: the
# script prints `uptime` before and after, and runs the implementations alternately so that
# load hits both alike.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
RANKS=${RANKS:-"2 4"}
RUNS=${RUNS:-5}
MINB=${MINB:-4K}
MAXB=${MAXB:-64M}
FACTOR=${FACTOR:-4}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
GLOO=${GLOO:-1}
ONECCL=${ONECCL:-1}
TORCH=${TORCH:-1}
ONECCL_VERSION=2022.2.0
out="${OUT:-$root/target/compare}"
mkdir -p "$out"

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null \
    || ! echo '#include <mpi.h>' | mpicc -E -x c - >/dev/null 2>&1; then
    echo "# installing Open MPI (openmpi-bin libopenmpi-dev) from Debian" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

echo "# building" >&2
(cd "$root" && cargo build --release --quiet --bin toroid-bench --bin toroid-run)
mpicc -O2 -o "$out/mpi_allreduce_bench" "$here/mpi_allreduce_bench.c"

have_oneccl=0
occl="$out/oneccl"
if [ "$ONECCL" = 1 ]; then
    if [ ! -e "$occl/cpulib/libccl.so.1" ]; then
        echo "# installing oneCCL $ONECCL_VERSION, Intel MPI and their runtimes from PyPI into $occl" >&2
        rm -rf "$occl" && mkdir -p "$occl/cpulib"
        python3 -m venv "$occl/venv"
        "$occl/venv/bin/pip" install -q --no-deps "oneccl==$ONECCL_VERSION" "oneccl-devel==$ONECCL_VERSION" \
            impi-rt intel-sycl-rt intel-cmplr-lib-rt >&2
        # oneccl-cpu's libccl.so.1 in a directory of its own (oneccl's wheel has a libccl.so.1 of
        # its own, for SYCL devices, at the same place).
        "$occl/venv/bin/pip" download -q --no-deps "oneccl-cpu==$ONECCL_VERSION" -d "$occl/wheel" >&2
        python3 - "$occl" <<'PY'
import pathlib, sys, zipfile
occl = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next((occl / "wheel").glob("oneccl_cpu-*.whl"))) as z:
    for name in z.namelist():
        if "/lib/libccl" in name and name.endswith((".so.1.0", ".so.0.1")):
            short = pathlib.Path(name).name.rsplit(".", 1)[0]  # libccl.so.1, libccl_openmp.so.0
            (occl / "cpulib" / short).write_bytes(z.read(name))
PY
    fi
    c++ -O2 -I"$occl/venv/include" -o "$occl/oneccl_allreduce_bench" "$here/oneccl_allreduce_bench.cpp" \
        -L"$occl/cpulib" -l:libccl.so.1 -Wl,-rpath-link,"$occl/venv/lib" -Wl,-rpath,"$occl/cpulib:$occl/venv/lib" \
        2> >(grep -v "may conflict with libccl.so.1" >&2)
    have_oneccl=1
fi

cores=$(getconf _NPROCESSORS_ONLN)
mpi_flags=(-n)
[ "$(id -u)" -eq 0 ] && mpi_flags=(--allow-run-as-root -n)
have_gloo=0
if [ "$GLOO" = 1 ] && python3 -c "import torch.distributed" 2>/dev/null; then
    have_gloo=1
fi

echo "# $(mpirun --version 2>/dev/null | head -1); toroid $(cd "$root" && git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $cores CPUs online"
echo "# uptime before: $(uptime)"
for n in $RANKS; do
    bind=(--bind-to core)
    extra=()
    if [ "$n" -gt "$cores" ]; then
        bind=(--bind-to core:overload-allowed)
        extra=(--oversubscribe)
    fi
    for run in $(seq 1 "$RUNS"); do
        "$root/target/release/toroid-run" -n "$n" -- "$root/target/release/toroid-bench" \
            -b "$MINB" -e "$MAXB" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" \
            >"$out/toroid-n$n-r$run.txt" 2>"$out/toroid-n$n-r$run.err"
        mpirun "${mpi_flags[@]}" "$n" "${bind[@]}" "${extra[@]}" "$out/mpi_allreduce_bench" \
            -b "$MINB" -e "$MAXB" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" \
            >"$out/mpi-n$n-r$run.txt" 2>"$out/mpi-n$n-r$run.err"
        if [ "$have_oneccl" = 1 ]; then
            ccl_env=(CCL_ATL_TRANSPORT=mpi CCL_ALLREDUCE=direct)
            [ "$n" -gt "$cores" ] && ccl_env+=(CCL_WORKER_OFFLOAD=1 CCL_YIELD=sched_yield)
            rm -f "$out/oneccl-kvs"
            env "${ccl_env[@]}" PATH="$occl/venv/bin:$PATH" LD_LIBRARY_PATH="$occl/cpulib:$occl/venv/lib" \
                timeout 600 mpiexec.hydra -n "$n" "$occl/oneccl_allreduce_bench" -i "$out/oneccl-kvs" \
                -b "$MINB" -e "$MAXB" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" \
                >"$out/oneccl-n$n-r$run.txt" 2>"$out/oneccl-n$n-r$run.err" || true
        fi
        if [ "$have_gloo" = 1 ]; then
            python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
                "$here/gloo_allreduce_bench.py" -b "$MINB" -e "$MAXB" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" \
                >"$out/gloo-n$n-r$run.txt" 2>"$out/gloo-n$n-r$run.err" || true
        fi
    done
done
echo "# uptime after:  $(uptime)"
python3 "$here/table.py" "$out" $RANKS
# Through torch: torch.distributed's all_reduce on toroid and on gloo in the same processes,
# alternating (python -m toroid.bench, which checks every result), with this checkout's package
# and release library; beside them toroid's own numpy binding on the same communicator.
if [ "$TORCH" = 1 ] && python3 -c "import torch.distributed, numpy" 2>/dev/null; then
    (cd "$root" && cargo build --release --quiet --lib)
    for n in $RANKS; do
        echo
        echo "## $n ranks through torch.distributed (python -m toroid.bench)"
        PYTHONPATH="$root/python" TOROID_LIBRARY="$root/target/release/libtoroid.so" \
            python3 -m toroid.bench --ranks "$n" -b "$MINB" -e "$MAXB" -f "$FACTOR" --timeout 900 \
            --backends gloo,toroid,numpy \
            || echo "# toroid.bench failed (exit status $?)"
    done
fi
