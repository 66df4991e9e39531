#!/usr/bin/env bash
# The soak of tests/soak.rs at length: random collectives (every kind, integer type, op and
# algorithm; 0 to 4 MiB per rank) on jobs of 3 and 4 processes, over shared memory and over
# TCP, every element verified bit for bit; then create/destroy in a loop on 2 ranks under
# valgrind. Prints each job's operations verified and corruptions, and the totals.
#
#   scripts/soak.sh [OPS] [CYCLES]   # operations per job (default 2500: 10000 in all) and
#                                    # create/destroy cycles under valgrind (default 50)
#
# TOROID_SOAK_SEED=N replays a run. Exits non-zero on any corruption, error, hang or leak.
set -euo pipefail
cd "$(dirname "$0")/.."
ops=${1:-2500}
cycles=${2:-50}
cargo test --test soak --no-run -q 2>/dev/null || cargo test --test soak --no-run
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
TOROID_SOAK_OPS=$ops TOROID_SOAK_MAX_BYTES=$((4 << 20)) TOROID_SOAK_CYCLES=$cycles \
    timeout $((ops * 4 + 1200)) \
    cargo test -q --test soak -- --nocapture --test-threads=1 >"$log" 2>&1 || status=$?
# libtest's progress ("test NAME ... ", or a dot with -q) precedes a test's own first line:
# cut it off.
sed -i 's/^.*\(\(SOAK\|VALGRIND\|CORRUPTION\) \)/\1/' "$log"
grep -E '^(SOAK|VALGRIND|CORRUPTION) ' "$log" | cut -c1-220 || true
awk -F' [|] ' '/^SOAK \|/ {
    split($4, v, " "); split($5, c, " "); verified += v[2]; corrupt += c[2]
} END { printf "\ncollectives verified: %d (each on every rank of its job), corruptions: %d\n", verified, corrupt }' "$log"
if [ "$status" -ne 0 ]; then
    echo "soak failed (exit $status):" >&2
    grep -E 'panicked|FAILED' "$log" | head -20 >&2 || true
fi
exit "$status"
