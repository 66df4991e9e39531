#!/usr/bin/env bash
# The GPU checks: every test of tests/gpu.rs with a GPU required (each kernel on the device
# against the CPU kernels' bits, staged and CUDA IPC collectives on device memory), the C stream
# entry points on 2 processes (ffi_tests/gpu/stream.c, built here with the CUDA driver's
# cuda.h) through CUDA IPC and staged (TOROID_CUDA_IPC=0), the device kernel benchmark
# (examples/gpu_bandwidth.rs), the device all-reduce benchmark (examples/gpu_all_reduce.rs) on
# 2 processes through both paths and on 2 threads of one process, the host-memory all-reduce of
# the same 2 ranks (toroid-bench: the staged path's bound), every collective on device memory
# (toroid-bench --device 0, nccl-tests' columns, every value checked), then the torch backend on
# CUDA tensors (python/tests/gpu_torch_check.py: 2 processes on GPU 0; SKIPPED when python3 has
# no torch).
#
#   scripts/gpu-check.sh               build with cargo (feature `cuda`), then run
#   scripts/gpu-check.sh --build DIR   only build the binaries into DIR, with libtoroid.so and the
#                                      Python package (for a GPU machine without a Rust
#                                      toolchain: carry DIR there)
#   scripts/gpu-check.sh --run DIR     run the checks in DIR
#   scripts/gpu-check.sh --run-ordered DIR   only the stream-ordered checks and the side-by-side
#                                      with NCCL (ORDERED_SWEEP, ORDERED_COLLECTIVES, ORDERED_MPS=0)
#
# NVRTC: TOROID_NVRTC_PATH, else the libnvrtc.so.13 of python3's CUDA wheels or of
# /usr/local/cuda; it must not be newer than the driver (PTX from NVRTC 13.2 does not load on
# a 13.0 driver).
set -euo pipefail
cd "$(dirname "$0")/.."

build() {
  local dir=$1
  mkdir -p "$dir"
  local tests
  tests=$(cargo test --release --features cuda --test gpu --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
  cargo build --release --features cuda --example gpu_bandwidth --example gpu_all_reduce --lib --bin toroid-run \
    --bin toroid-bench
  cp "$tests" "$dir/gpu-tests"
  cp target/release/examples/gpu_bandwidth target/release/examples/gpu_all_reduce target/release/toroid-run \
    target/release/toroid-bench target/release/libtoroid.so "$dir/"
  strip "$dir/gpu-tests" "$dir/gpu_bandwidth" "$dir/gpu_all_reduce" "$dir/toroid-run" "$dir/toroid-bench" \
    "$dir/libtoroid.so" 2>/dev/null || true
  # The torch check and the package it imports, laid out as in the checkout (the script finds
  # the package two levels up; --run points the binding at DIR/libtoroid.so).
  mkdir -p "$dir/python/toroid" "$dir/python/tests"
  cp -r python/toroid/. "$dir/python/toroid/"  # (the modules, torch/ and _abi.json)
  cp python/tests/gpu_torch_check.py "$dir/python/tests/"
}

# Builds ffi_tests/gpu/NAME.c into DIR/NAME against DIR's libtoroid.so with the CUDA toolkit's
# (or python3's CUDA wheels') cuda.h and the driver library; says SKIPPED and returns 1 when
# this machine has no cuda.h; a build that fails ends the script.
build_gpu_c() {
  local dir=$1 name=$2 cuda_h libcuda
  cuda_h=$( (ls /usr/local/cuda/include/cuda.h /usr/local/cuda*/include/cuda.h 2>/dev/null;
    python3 -c 'import nvidia, os
for p in nvidia.__path__:
    f = os.path.join(p, "cu13", "include", "cuda.h")
    if os.path.exists(f): print(f)' 2>/dev/null) | head -1 || true)
  libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  libcuda=${libcuda:-$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1 || true)}
  if [ -z "$cuda_h" ]; then
    echo "SKIPPED ffi_tests/gpu/$name.c: no cuda.h (CUDA toolkit) on this machine"
    return 1
  fi
  cc -O1 -I include -I ffi_tests -I "$(dirname "$cuda_h")" "ffi_tests/gpu/$name.c" \
    -L "$dir" -ltoroid "${libcuda:--lcuda}" -Wl,-rpath,"$(cd "$dir" && pwd)" -o "$dir/$name" ||
    { echo "FAIL: building ffi_tests/gpu/$name.c"; exit 1; }  # (set -e does not stop inside an `if`)
}

# TOROID_NVRTC_PATH, else python3's CUDA wheels' or the toolkit's libnvrtc.so.13.
find_nvrtc() {
  if [ -z "${TOROID_NVRTC_PATH:-}" ]; then
    TOROID_NVRTC_PATH=$( (python3 -c 'import nvidia, os
for p in nvidia.__path__:
    for d in ("cu13", "cuda_nvrtc"):
        f = os.path.join(p, d, "lib", "libnvrtc.so.13")
        if os.path.exists(f): print(f)' 2>/dev/null; ls /usr/local/cuda*/lib64/libnvrtc.so.13 2>/dev/null) | head -1 || true)
    export TOROID_NVRTC_PATH
  fi
  echo "NVRTC: ${TOROID_NVRTC_PATH:-none found}"
}

run() {
  local dir=$1
  local failed=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi: not found"
  echo "RDMA devices (/sys/class/infiniband): $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ' || true)"
  find_nvrtc
  TOROID_REQUIRE_NVRTC=1 "$dir/gpu-tests" --include-ignored --test-threads 1 --nocapture
  if build_gpu_c "$dir" stream; then
    echo "ffi_tests/gpu/stream.c, CUDA IPC:"
    TOROID_DEBUG=INFO TOROID_DEBUG_SUBSYS=GPU "$dir/toroid-run" -n 2 "$dir/stream"
    echo "ffi_tests/gpu/stream.c, staged (TOROID_CUDA_IPC=0):"
    TOROID_CUDA_IPC=0 "$dir/toroid-run" -n 2 "$dir/stream"
  fi
  "$dir/gpu_bandwidth" 256
  "$dir/toroid-run" -n 2 "$dir/gpu_all_reduce" 256
  TOROID_CUDA_IPC=0 "$dir/toroid-run" -n 2 "$dir/gpu_all_reduce" 256
  "$dir/gpu_all_reduce" 256 --threads 2
  # The host-memory all-reduce of the same 2 ranks: what the staged path pipelines its chunks
  # through (its bound, with the copies overlapped).
  if [ -x "$dir/toroid-bench" ]; then
    echo "host memory (toroid-bench), 2 ranks:"
    "$dir/toroid-run" -n 2 "$dir/toroid-bench" -b 1M -e 256M -f 4 -n 10 -w 2
    # Every collective on device memory (toroid-bench --device 0), every value checked.
    for c in all_reduce reduce_scatter all_gather broadcast reduce all_to_all; do
      echo "device memory (toroid-bench --device 0 --collective $c), 2 ranks:"
      "$dir/toroid-run" -n 2 "$dir/toroid-bench" --device 0 --collective "$c" -b 1M -e 256M -f 16 -n 10 -w 2 ||
        { echo "FAIL: toroid-bench --device 0 --collective $c"; failed=1; }
    done
    # The four the device windows run, staged instead (reduce and all-to-all always are).
    for c in all_reduce reduce_scatter all_gather broadcast; do
      echo "device memory, staged (TOROID_CUDA_IPC=0 toroid-bench --device 0 --collective $c), 2 ranks:"
      TOROID_CUDA_IPC=0 "$dir/toroid-run" -n 2 "$dir/toroid-bench" --device 0 --collective "$c" -b 1M -e 256M -f 16 \
        -n 10 -w 2 || { echo "FAIL: TOROID_CUDA_IPC=0 toroid-bench --device 0 --collective $c"; failed=1; }
    done
  fi
  ordered_check "$dir" || failed=1
  torch_check "$dir"
  return "$failed"
}

# The stream-ordered path (src/gpu/ordered.rs): ffi_tests/gpu/ordered.c on 2 processes (each
# call returns before its stream ran it, a consumer on the stream reads the exact result, a CUDA
# graph of 10 collectives replayed 100 times), then toroid and NCCL side by side on the same 2
# ranks of the one GPU (benches/compare/nccl_device_bench.c, NCCL's multi-rank switch on), every
# collective, without MPS and, where the machine has it, with it.
ordered_check() {
  local dir=$1 failed=0
  # Off by default until a GPU run has shown it (docs/ENV.md).
  export TOROID_CUDA_ORDERED=1
  if build_gpu_c "$dir" ordered; then
    echo "ffi_tests/gpu/ordered.c, 2 processes:"
    TOROID_DEBUG=INFO TOROID_DEBUG_SUBSYS=GPU timeout 180 "$dir/toroid-run" -n 2 "$dir/ordered" ||
      { echo "FAIL: ffi_tests/gpu/ordered.c"; failed=1; }
  fi
  NCCL_LIBRARY=${NCCL_LIBRARY:-$(python3 -c 'import nvidia.nccl, os
print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)}
  export NCCL_LIBRARY
  cc -std=c11 -O2 -o "$dir/nccl_device_bench" benches/compare/nccl_device_bench.c -ldl
  local sweep=${ORDERED_SWEEP:--b 8K -e 256M -f 4 -n 20 -w 5}
  side_by_side() {
    local c
    for c in ${ORDERED_COLLECTIVES:-all_reduce all_gather reduce_scatter broadcast reduce all_to_all}; do
      echo "== $c, 2 ranks on GPU 0 ($1): toroid-bench --device 0"
      # shellcheck disable=SC2086
      timeout 150 "$dir/toroid-run" -n 2 "$dir/toroid-bench" --device 0 --collective "$c" $sweep ||
        { echo "FAIL: toroid-bench --device 0 --collective $c ($1)"; failed=1; }
      echo "== $c, 2 ranks on GPU 0 ($1): NCCL ($NCCL_LIBRARY)"
      # shellcheck disable=SC2086
      timeout 150 "$dir/toroid-run" -n 2 "$dir/nccl_device_bench" --id-file "$dir/nccl-id" --collective "$c" $sweep
      case $? in
        0) ;;
        3) echo "SKIPPED NCCL: libnccl.so.2 not found (nvidia-nccl-cu13)" ;;
        *) echo "FAIL: nccl_device_bench --collective $c ($1)"; failed=1 ;;
      esac
    done
  }
  side_by_side "no MPS"
  if [ "${ORDERED_MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=$dir/mps-pipe CUDA_MPS_LOG_DIRECTORY=$dir/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      side_by_side "MPS"
      echo quit | nvidia-cuda-mps-control
    else
      echo "SKIPPED MPS: nvidia-cuda-mps-control -d failed"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    echo "SKIPPED MPS: no nvidia-cuda-mps-control on this machine (or ORDERED_MPS=0)"
  fi
  unset TOROID_CUDA_ORDERED
  return "$failed"
}

# The torch backend on CUDA tensors, with the package and library of DIR.
torch_check() {
  local dir=$1
  if ! python3 -c 'import torch' 2>/dev/null; then
    echo "SKIPPED python/tests/gpu_torch_check.py: torch is not importable by python3"
  elif [ ! -f "$dir/python/tests/gpu_torch_check.py" ]; then
    echo "SKIPPED python/tests/gpu_torch_check.py: not in $dir (a bundle built before it existed)"
  else
    TOROID_DEBUG=INFO TOROID_DEBUG_SUBSYS=GPU TOROID_LIBRARY="$(cd "$dir" && pwd)/libtoroid.so" \
      python3 "$dir/python/tests/gpu_torch_check.py"
  fi
}

case "${1:-}" in
  --build) build "$2" ;;
  --run) run "$2" ;;
  --run-ordered) find_nvrtc; ordered_check "$2" ;;
  "")
    # (Not `build && run`: set -e does not stop on a failure left of &&.)
    build target/gpu-check
    run target/gpu-check
    ;;
  *) sed -n '2,23p' "$0"; exit 2 ;;
esac
