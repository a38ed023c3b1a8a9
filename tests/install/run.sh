#!/usr/bin/env bash
# tests/install/run.sh BUILD_DIR TQKV_SERVER - libtqkv as an engine developer gets it:
# `cmake --install` into a temporary prefix, then, against the INSTALLED files only:
#   - include/tqkv holds exactly the API headers (docs/api.md), none with static inline
#     code or an include of a header that is not installed;
#   - libtqkv.so carries its soname (libtqkv.so.1) and exports exactly the names of
#     transport/libtqkv.sym, each in version node TQKV_1.0 (nm -D), every one declared
#     by the installed headers; the names libtqkv.so.0 exported and 1.0 dropped are
#     exactly those docs/api.md lists (tests/install/libtqkv-0.syms: nm -D of the 0.x
#     library built from 4a5a7f7);
#   - libtqkv.so has no NEEDED libnccl (NCCL is opened on first use);
#   - tqkv-server, tqkv-codec and tqkv-bench are installed in bin/ and run from there
#     without LD_LIBRARY_PATH;
#   - a C11 and a C++17 consumer build with `pkg-config --cflags --libs tqkv` and
#     -Wall -Werror alone, and a CMake project with find_package(tqkv) / tqkv::tqkv;
#   - the consumers run against a real tqkv-server on a free loopback port (with a TCP
#     data channel) with the installed library (ldd checked): Put, Lookup, Get packed,
#     decode, compare with the server's BF16 decode of the same pages.
#   - the installed Python package (when present) imports from the printed PYTHONPATH.
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SERVER=$2
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d /tmp/tqkv-install.XXXXXX)
SPID=""
cleanup() {
  [ -n "$SPID" ] && kill "$SPID" 2>/dev/null && wait "$SPID" 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
die() { echo "install test: FAIL: $*" >&2; exit 1; }

PREFIX=$TMP/prefix
cmake --install "$BUILD" --prefix "$PREFIX" > "$TMP/install.log" || { cat "$TMP/install.log"; die "cmake --install"; }
LIB=$(find "$PREFIX" -name 'libtqkv.so.*.*.*' | head -1)
[ -n "$LIB" ] || die "no libtqkv.so.X.Y.Z installed"
LIBDIR=$(dirname "$LIB")
SRC=$(dirname "$(dirname "$HERE")")
# The installed headers: exactly the API's.
WANT_H="client.h client_bulk.h kernels/block_shape.h kernels/status.h kernels/version.h"
GOT_H=$(cd "$PREFIX/include/tqkv" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')
[ "$GOT_H" = "$(echo $WANT_H | tr ' ' '\n' | sort | tr '\n' ' ')" ] \
  || die "installed headers '$GOT_H', want '$WANT_H' (docs/api.md)"
[ "$(find "$PREFIX/include" -type f | wc -l)" = 5 ] || die "files under include/ outside include/tqkv"
! grep -l 'static inline\|TQKV_HD' "$PREFIX"/include/tqkv/*.h "$PREFIX"/include/tqkv/kernels/*.h \
  || die "an installed header carries inline code"
for h in $WANT_H; do
  for inc in $(sed -n 's/^#include "\(.*\)"/\1/p' "$PREFIX/include/tqkv/$h"); do
    [ -f "$PREFIX/include/tqkv/$inc" ] || die "$h includes \"$inc\", which is not installed"
  done
done
[ -L "$LIBDIR/libtqkv.so" ] || die "no libtqkv.so link (the dev link)"
SONAME=$(objdump -p "$LIB" | awk '/SONAME/ {print $2}')
[ "$SONAME" = libtqkv.so.1 ] || die "soname '$SONAME', want libtqkv.so.1"
[ -e "$LIBDIR/$SONAME" ] || die "$SONAME link missing"
echo "install test: $LIB soname $SONAME"

# Exports: exactly transport/libtqkv.sym, in version node TQKV_1.0.
grep -v '^\s*#' "$SRC/transport/libtqkv.sym" | grep . | sort -u > "$TMP/want_syms"
nm -D --defined-only "$LIB" | awk '$2 ~ /[TWDBRV]/ {print $3}' | grep -v '^TQKV_1\.0$' | sort -u > "$TMP/vsyms"
sed 's/@.*//' "$TMP/vsyms" | sort -u > "$TMP/syms"
if ! diff -u "$TMP/want_syms" "$TMP/syms" > "$TMP/syms.diff"; then
  cat "$TMP/syms.diff"
  die "exported symbols differ from transport/libtqkv.sym (- listed only, + exported only)"
fi
# libnccl is opened on first use (transport/nccl_channel.c), never a NEEDED entry: a
# process that loads PyTorch after libtqkv must get torch's NCCL under that soname.
if readelf -d "$LIB" | grep -E 'NEEDED.*libnccl' >&2; then
  die "libtqkv.so links libnccl (it must dlopen it: import tqkv; import torch breaks)"
fi
NOTV=$(grep -v '@@TQKV_1\.0$' "$TMP/vsyms" || true)
[ -z "$NOTV" ] || die "exported without version node TQKV_1.0: $(echo $NOTV | head -c 300)"
# Every listed function is declared by the installed headers (C11, no implicit
# declarations): its address is taken with nothing but the public includes.
{
  echo '#include <tqkv/client.h>'
  echo '#include <tqkv/client_bulk.h>'
  echo 'void (*const tqkv_api_fns[])(void) = {'
  sed 's/.*/    (void (*)(void))\&&,/' "$TMP/want_syms"
  echo '};'
} > "$TMP/decl.c"
cc -std=c11 -Wall -Werror=implicit-function-declaration -Werror -I"$PREFIX/include" -c \
  "$TMP/decl.c" -o "$TMP/decl.o" 2> "$TMP/decl.err" \
  || { cat "$TMP/decl.err"; die "a libtqkv.sym name is not declared by the installed headers"; }
# The break from libtqkv.so.0: what 0.x exported and 1.0 does not is docs/api.md's list.
comm -23 <(sort -u "$HERE/libtqkv-0.syms") "$TMP/want_syms" > "$TMP/removed"
sed -n '/<!-- removed-symbols -->/,/<!-- \/removed-symbols -->/p' "$SRC/docs/api.md" \
  | sed -n 's/^- `\(tqkv_[a-z0-9_]*\)`.*/\1/p' | sort -u > "$TMP/removed_doc"
diff -u "$TMP/removed_doc" "$TMP/removed" > "$TMP/removed.diff" \
  || { cat "$TMP/removed.diff"; die "docs/api.md's removed list differs from libtqkv.so.0 minus 1.0 (+: undocumented removal)"; }
echo "install test: $(wc -l < "$TMP/syms") exported symbols = libtqkv.sym, all @@TQKV_1.0; $(wc -l < "$TMP/removed") removed since 0.x, as docs/api.md lists"

# The executables, run from bin/ with no library path.
for x in tqkv-server tqkv-codec tqkv-bench; do
  [ -x "$PREFIX/bin/$x" ] || die "bin/$x not installed"
  env -u LD_LIBRARY_PATH "$PREFIX/bin/$x" --version > "$TMP/$x.version" 2>&1 \
    || { cat "$TMP/$x.version"; die "bin/$x --version"; }
done
SERVER=$PREFIX/bin/tqkv-server

export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
FLAGS=$(pkg-config --cflags --libs tqkv)
echo "install test: pkg-config tqkv $(pkg-config --modversion tqkv): $FLAGS"
case "$FLAGS" in *"$BUILD"*|*"$(dirname "$HERE")"*) die "pkg-config flags point into the tree";; esac
case " $(pkg-config --cflags tqkv) " in *"/include/tqkv "*) die "pkg-config puts include/tqkv itself on the path";; esac
cc -std=c11 -Wall -Werror -o "$TMP/consumer_c" "$HERE/consumer.c" $FLAGS || die "C consumer build"
c++ -std=c++17 -Wall -Werror -o "$TMP/consumer_cpp" "$HERE/consumer.cpp" $FLAGS || die "C++ consumer build"
# Also without C11 extensions: -pedantic on the C side catches non-portable headers.
cc -std=c11 -Wall -Wextra -pedantic -Werror -fsyntax-only "$HERE/consumer.c" $(pkg-config --cflags tqkv) \
  || die "C consumer with -Wextra -pedantic"

# find_package(tqkv) -> tqkv::tqkv.
mkdir -p "$TMP/cmk"
cat > "$TMP/cmk/CMakeLists.txt" <<CMK
cmake_minimum_required(VERSION 3.16)
project(tqkv_consumer C)
find_package(tqkv REQUIRED)
add_executable(consumer_cmake $HERE/consumer.c)
target_compile_options(consumer_cmake PRIVATE -Wall -Werror)
target_link_libraries(consumer_cmake PRIVATE tqkv::tqkv)
CMK
cmake -S "$TMP/cmk" -B "$TMP/cmk/build" -DCMAKE_PREFIX_PATH="$PREFIX" > "$TMP/cmk.log" 2>&1 \
  || { cat "$TMP/cmk.log"; die "find_package(tqkv)"; }
cmake --build "$TMP/cmk/build" > "$TMP/cmkb.log" 2>&1 || { cat "$TMP/cmkb.log"; die "tqkv::tqkv build"; }

export LD_LIBRARY_PATH=$LIBDIR
for b in consumer_c consumer_cpp cmk/build/consumer_cmake; do
  DEPS=$(ldd "$TMP/$b")
  grep -q "libtqkv.so.* => $LIBDIR/" <<< "$DEPS" || { echo "$DEPS" | grep tqkv; die "$b does not load the installed libtqkv"; }
done

"$SERVER" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 --threads 2 --encoder-threads 1 \
  --dram-capacity 64M > "$TMP/server.out" 2> "$TMP/server.err" &
SPID=$!
PORT=""
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*listening on .*:\([0-9][0-9]*\)$/\1/p' "$TMP/server.out" | head -1)
  [ -n "$PORT" ] && break
  kill -0 "$SPID" 2>/dev/null || { cat "$TMP/server.err"; die "tqkv-server did not start"; }
  sleep 0.1
done
[ -n "$PORT" ] || die "tqkv-server printed no port"
"$TMP/consumer_c" "127.0.0.1:$PORT" || die "C consumer run"
"$TMP/consumer_cpp" "127.0.0.1:$PORT" || die "C++ consumer run"
"$TMP/cmk/build/consumer_cmake" "127.0.0.1:$PORT" || die "find_package consumer run"

# The Python package, when the install step put one there.
PYDIR=$(find "$PREFIX" -type d -path '*dist-packages/tqkv' | head -1)
if [ -n "$PYDIR" ]; then
  env -u LD_LIBRARY_PATH -u TQKV_LIBRARY PYTHONPATH=$(dirname "$PYDIR") /usr/bin/python3 -c "
import numpy as np, tqkv
assert tqkv.__file__.startswith('$PREFIX') and tqkv.library_path.startswith('$PREFIX'), tqkv.library_path
c = tqkv.Client(['127.0.0.1:$PORT'])
h = [bytes([7]) * 32]
k = tqkv.bf16_from_float32(np.random.default_rng(1).standard_normal((1, 1, 16, 8, 128)))
c.put('install-py', h, k, k)
kk, vv, found = c.get('install-py', h, shape=(16, 8, 128))
assert found.all() and np.array_equal(kk, c.get('install-py', h, shape=(16, 8, 128), encoding='bf16')[0])
print('install test: python', tqkv.version(), tqkv.library_path)" || die "installed Python package"
  EX=$PREFIX/share/tqkv/examples/put_get.py
  [ -x "$EX" ] || die "put_get.py example not installed"
  env -u LD_LIBRARY_PATH -u TQKV_LIBRARY PYTHONPATH=$(dirname "$PYDIR") /usr/bin/python3 "$EX" \
    "127.0.0.1:$PORT" || die "the installed Python example"
fi
echo "install test: ok"
