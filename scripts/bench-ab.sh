#!/usr/bin/env bash
# Two builds side by side in one run: the README's one-host benchmark
# (toroid-run -n RANKS -- toroid-bench -b 4K -e 64M -f 4) alternately with the binaries of
# directory A and of directory B, ROUNDS times each (A B A B ...), then per size the median
# out-of-place and in-place time of each build and their ratio B/A (< 1: B is faster).
# Alternating rounds spreads the machine's drift (and toroid-bench's occasional slow launch,
# see issue 36) over both builds alike.
#
#   scripts/bench-ab.sh OLD_BIN_DIR NEW_BIN_DIR [ROUNDS=5] [RANKS=4] [extra toroid-bench args]
set -euo pipefail
a=${1:?directory with the first build: toroid-run and toroid-bench}
b=${2:?directory with the second build: toroid-run and toroid-bench}
rounds=${3:-5}
ranks=${4:-4}
shift $(( $# < 4 ? $# : 4 ))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((i = 0; i < rounds; i++)); do
    for side in a b; do
        if [ "$side" = a ]; then dir=$a; else dir=$b; fi
        "$dir/toroid-run" -n "$ranks" -- "$dir/toroid-bench" -b 4K -e 64M -f 4 "$@" \
            >"$out/$side.$i" 2>&1 || { cat "$out/$side.$i"; exit 1; }
    done
done
python3 - "$out" "$rounds" "$a" "$b" <<'PY'
import pathlib, statistics, sys
out, rounds, a, b = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def rows(side):
    per = {}
    for i in range(rounds):
        for line in (out / f"{side}.{i}").read_text().splitlines():
            f = line.split(":", 1)[-1].split()
            if len(f) >= 14 and f[0].isdigit():
                if f[8] != "0" or f[12] != "0":
                    sys.exit(f"{side} round {i}: wrong results at {f[0]} bytes")
                per.setdefault(int(f[0]), []).append((float(f[5]), float(f[9]), f[-1]))
    return per
ra, rb = rows("a"), rows("b")
print(f"A = {a}\nB = {b}\n{rounds} alternating rounds each; median time in us")
print(f"{'bytes':>10} {'A out':>16} {'B out':>16} {'B/A':>5} {'A in':>16} {'B in':>16} {'B/A':>5}  algorithm")
for size in sorted(ra):
    ao = statistics.median(r[0] for r in ra[size]); bo = statistics.median(r[0] for r in rb[size])
    ai = statistics.median(r[1] for r in ra[size]); bi = statistics.median(r[1] for r in rb[size])
    print(f"{size:>10} {ao:>16.2f} {bo:>16.2f} {bo/ao:>5.2f} {ai:>16.2f} {bi:>16.2f} {bi/ai:>5.2f}  {rb[size][0][2]}")
PY
