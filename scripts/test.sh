#!/usr/bin/env bash
# The whole test suite: installs what it needs (scripts/setup.sh: Debian packages and numpy,
# pytest and torch, only those missing; root or sudo when something must be installed), then
# formatting, lints, every Rust test (unit, integration with real processes and real launchers,
# C programs against the generated header, doc tests), the same again for what the cargo
# feature rdma adds, then scripts/test-package.sh: the crate packaged and installed, the Python
# wheel built from the sdist and installed in a fresh virtual environment, the Python binding and
# the torch.distributed backend tested against that installation, and the README's quick starts
# run as written. Each multi-process test carries its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# NVRTC comes with torch's CUDA wheel: tests/gpu.rs compiles every device kernel with it and
# fails rather than skips when it is missing here (the GPU itself is scripts/gpu-check.sh's).
TOROID_REQUIRE_NVRTC=1 cargo test --workspace
# The RDMA verbs transport (cargo feature rdma, off by default; sideway's build needs cmake and
# libclang, which setup.sh installs): lints, the ring protocol's unit tests over the in-memory
# fake of the verbs, and libtoroid loading with libibverbs (and CUDA) hidden from dlopen. Same
# target directory: only toroid and sideway's crates are compiled again.
cargo clippy --all-targets --features rdma -- -D warnings
cargo test --lib --features rdma -- transport::rdma transport::ledger transport::shm
cargo test --features rdma --test ffi -- libtoroid_
# The Rust crate and the Python wheel as they install, the Python and torch tests against the
# installed wheel, and the README's quick starts as written.
scripts/test-package.sh
