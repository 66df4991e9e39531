#!/usr/bin/env bash
# The whole test suite: formatting, lints, then every Rust test (unit, integration with real
# processes, doc tests). Bounded: each multi-process test carries its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
