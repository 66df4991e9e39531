#!/usr/bin/env bash
# The whole test suite: formatting, lints, every Rust test (unit, integration with real
# processes, C programs against the generated header, doc tests), then the Python binding and
# the torch.distributed backend against real processes. Each multi-process test carries its own
# timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
python/run_tests.sh
