#!/usr/bin/env bash
# Installs the C library, header and pkg-config file under a prefix:
#   PREFIX/include/toroid.h, PREFIX/lib/libtoroid.{so,a}, PREFIX/lib/pkgconfig/toroid.pc
#
#   scripts/install.sh PREFIX [PROFILE]      (PROFILE: release (default) or debug)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PREFIX [release|debug]" >&2; exit 2; }
cd "$(dirname "$0")/.."
prefix=$(mkdir -p "$1" && cd "$1" && pwd)
profile=${2:-release}
if [ "$profile" = release ]; then cargo build --release --lib; else cargo build --lib; fi
lib=${CARGO_TARGET_DIR:-target}/$profile
install -d "$prefix/include" "$prefix/lib/pkgconfig"
install -m 644 include/toroid.h "$prefix/include/"
install -m 755 "$lib/libtoroid.so" "$prefix/lib/"
install -m 644 "$lib/libtoroid.a" "$prefix/lib/"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sed -e "s|@PREFIX@|$prefix|" -e 's|@LIBDIR@|${prefix}/lib|' -e 's|@INCLUDEDIR@|${prefix}/include|' \
    -e "s|@VERSION@|$version|" toroid.pc.in > "$prefix/lib/pkgconfig/toroid.pc"
echo "installed toroid $version under $prefix (PKG_CONFIG_PATH=$prefix/lib/pkgconfig)"
