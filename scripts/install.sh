#!/usr/bin/env bash
# Installs the C library, header, pkg-config file and launcher under a prefix (what a
# `make install` of a C library puts there):
#   PREFIX/include/toroid.h, PREFIX/lib/libtoroid.{so,a}, PREFIX/lib/pkgconfig/toroid.pc,
#   PREFIX/bin/toroid-run
# The pkg-config file links with an rpath to PREFIX/lib, so programs run without LD_LIBRARY_PATH.
#
#   scripts/install.sh PREFIX [PROFILE]      (PROFILE: release (default) or debug)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PREFIX [release|debug]" >&2; exit 2; }
cd "$(dirname "$0")/.."
prefix=$(mkdir -p "$1" && cd "$1" && pwd)
profile=${2:-release}
if [ "$profile" = release ]; then cargo build --release --lib --bin toroid-run; else cargo build --lib --bin toroid-run; fi
lib=${CARGO_TARGET_DIR:-target}/$profile
install -d "$prefix/include" "$prefix/lib/pkgconfig" "$prefix/bin"
install -m 644 include/toroid.h "$prefix/include/"
install -m 755 "$lib/libtoroid.so" "$prefix/lib/"
install -m 644 "$lib/libtoroid.a" "$prefix/lib/"
install -m 755 "$lib/toroid-run" "$prefix/bin/"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sed -e "s|@PREFIX@|$prefix|" -e 's|@LIBDIR@|${prefix}/lib|' -e 's|@INCLUDEDIR@|${prefix}/include|' \
    -e "s|@VERSION@|$version|" toroid.pc.in > "$prefix/lib/pkgconfig/toroid.pc"
echo "installed toroid $version under $prefix (PKG_CONFIG_PATH=$prefix/lib/pkgconfig)"
