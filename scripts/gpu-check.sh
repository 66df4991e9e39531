#!/usr/bin/env bash
# The GPU checks: every test of tests/gpu.rs with a GPU required (each kernel on the device
# against the CPU kernels' bits), then the device kernel benchmark (examples/gpu_bandwidth.rs).
#
#   scripts/gpu-check.sh               build with cargo (feature `cuda`), then run
#   scripts/gpu-check.sh --build DIR   only build the two binaries into DIR (for a GPU machine
#                                      without a Rust toolchain: carry DIR there)
#   scripts/gpu-check.sh --run DIR     run the binaries in DIR
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
  cargo build --release --features cuda --example gpu_bandwidth
  cp "$tests" "$dir/gpu-tests"
  cp target/release/examples/gpu_bandwidth "$dir/gpu_bandwidth"
  strip "$dir/gpu-tests" "$dir/gpu_bandwidth" 2>/dev/null || true
}

run() {
  local dir=$1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi: not found"
  if [ -z "${TOROID_NVRTC_PATH:-}" ]; then
    TOROID_NVRTC_PATH=$( (python3 -c 'import nvidia, os
for p in nvidia.__path__:
    for d in ("cu13", "cuda_nvrtc"):
        f = os.path.join(p, d, "lib", "libnvrtc.so.13")
        if os.path.exists(f): print(f)' 2>/dev/null; ls /usr/local/cuda*/lib64/libnvrtc.so.13 2>/dev/null) | head -1 || true)
    export TOROID_NVRTC_PATH
  fi
  echo "NVRTC: ${TOROID_NVRTC_PATH:-none found}"
  TOROID_REQUIRE_GPU=1 TOROID_REQUIRE_NVRTC=1 "$dir/gpu-tests" --test-threads 1 --nocapture
  "$dir/gpu_bandwidth" 256
}

case "${1:-}" in
  --build) build "$2" ;;
  --run) run "$2" ;;
  "") build target/gpu-check && run target/gpu-check ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
