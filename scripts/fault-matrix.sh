#!/usr/bin/env bash
# The fault-injection matrix of tests/faults.rs with many trials: kill -9, SIGSTOP, a rank that
# never joins, a connection reset (ss -K), strangers on every listener, a full shared-memory
# tmpfs (private mount namespace: needs root) and the fork of a rank, each over shared memory
# and over TCP. Prints one row per case and transport: trials, outcomes as expected,
# unexpected outcomes, hangs, processes left, shared-memory names left and the worst time from
# the fault to the error on a rank that had to see it.
#
#   scripts/fault-matrix.sh [TRIALS]      # trials per case and transport (default 15: 210 in all)
#
# TOROID_FAULT_SEED=N replays a run (the seed is printed in each row). Exits non-zero when a
# row is not clean; every trial is bounded, so the whole run is too.
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-15}
cargo test --test faults --no-run -q 2>/dev/null || cargo test --test faults --no-run
# FAULT_MATRIX_LOG=FILE keeps the whole log (a TRIAL line per trial, with each rank's delay
# from the fault to its error on the DELAYS line before it).
log=${FAULT_MATRIX_LOG:-$(mktemp)}
[ -n "${FAULT_MATRIX_LOG:-}" ] || trap 'rm -f "$log"' EXIT
status=0
# One case at a time: the timings are the point, and the machine stays usable.
TOROID_FAULT_TRIALS=$trials timeout $((trials * 7 * 2 * 60 + 120)) \
    cargo test -q --test faults -- --nocapture --test-threads=1 >"$log" 2>&1 || status=$?
echo
printf '%-12s %-5s %7s %9s %11s %6s %11s %9s %22s\n' case link trials expected unexpected hangs "procs left" "shm left" "worst fault->error ms"
# libtest prints "test NAME ... " before a test's own first line: cut it off.
sed -n 's/^.*\(SUMMARY |\)/\1/p' "$log" | sort | awk -F' [|] ' '{
    n = split($0, f, / [|] /)
    for (i = 4; i <= 10; i++) { k = split(f[i], w, " "); v[i] = w[k] }
    printf "%-12s %-5s %7s %9s %11s %6s %11s %9s %22s\n", f[2], f[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10]
}'
echo
sed -n 's/^.*\(\(UNEXPECTED\|NOTE\) [a-z_0-9]* \(Shm\|Tcp\) \)/\1/p' "$log" | cut -c1-300 | sed -E 's/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -40 || true
if [ "$status" -ne 0 ]; then
    echo "fault matrix: some case was not clean (exit $status); the rows above say which" >&2
    grep -E '^test .* FAILED' "$log" >&2 || true
fi
exit "$status"
