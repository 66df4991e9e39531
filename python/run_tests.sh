#!/usr/bin/env bash
# Runs the Python tests (numpy binding, torch.distributed backend) against the libtoroid.so built
# from this checkout (and torch's own distributed suite on gloo and toroid, test_torch_suite.py).
# Installs numpy, pytest and torch (expecttest, hypothesis for torch's suite) with pip when missing (torch from
# PyPI is the CUDA build, about 3 GB; it runs on CPU, and pip reuses its cache).
#
#   python/run_tests.sh [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import numpy, pytest, torch, expecttest, hypothesis" 2>/dev/null; then
  echo "run_tests.sh: installing numpy, pytest, torch, expecttest and hypothesis with pip" >&2
  "$PYTHON" -m pip install --quiet numpy pytest torch expecttest hypothesis
fi

cargo build --lib --quiet
export TOROID_LIBRARY="$PWD/target/debug/libtoroid.so"
echo "run_tests.sh: toroid $(PYTHONPATH=python "$PYTHON" -c 'import toroid; print(toroid.version())') from $TOROID_LIBRARY; torch $("$PYTHON" -c 'import torch; print(torch.__version__)')" >&2
# Temporary files (torch's suite leaves its FileStore files behind) go to a directory of this
# run, removed at the end whatever the outcome.
tmp=$(mktemp -d -t toroid-python-tests.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
TMPDIR="$tmp" "$PYTHON" -m pytest -q python/tests "$@"
