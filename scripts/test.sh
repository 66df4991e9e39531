#!/usr/bin/env bash
# The whole test suite: installs what it needs (scripts/setup.sh: Debian packages and numpy,
# pytest and torch, only those missing; root or sudo when something must be installed), then
# formatting, lints, every Rust test (unit, integration with real processes and real launchers,
# C programs against the generated header, doc tests), then the Python binding and the
# torch.distributed backend against real processes. Each multi-process test carries its own
# timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
python/run_tests.sh
