#!/usr/bin/env bash
# Runs each cargo-fuzz target of fuzz/ for a bounded time, one after the other.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]     (default 60 s; all targets)
#
# e.g. `scripts/fuzz.sh 600` runs every target for 10 minutes. Needs the nightly toolchain
# (`rustup toolchain install nightly`); installs cargo-fuzz when it is missing. Each target
# starts from its committed seeds (fuzz/seeds/<target>) and grows fuzz/corpus/<target>
# (ignored by git). A crash stops the script with libFuzzer's report; the input is left in
# fuzz/artifacts/<target>/: minimise it with `cargo +nightly fuzz tmin <target> <file>`,
# commit it under fuzz/regressions/<target>/ (tests/fuzz_corpus.rs replays it) and fix it.
# Set CARGO_TARGET_DIR to build elsewhere than fuzz/target.
set -euo pipefail

secs=${1:-60}
shift || true
cd "$(dirname "$0")/../fuzz"
if [ $# -gt 0 ]; then targets=("$@"); else targets=(frame handshake shm_offer store_decode store record tls_handshake); fi

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi

mkdir -p artifacts
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log="artifacts/$t.log"
  echo "== $t: ${secs}s (log: fuzz/$log)"
  # -rss_limit_mb: a decoder that allocates by a length from the input fails here;
  # -timeout: one input taking over 10 s is a hang.
  status=0
  cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E '^(#[0-9]+ +DONE|Done [0-9]+ runs|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "== $t: CRASH (exit $status; input in fuzz/artifacts/$t/)" >&2
    exit 1
  fi
done
echo "== all targets ran ${secs}s each with no crash"
