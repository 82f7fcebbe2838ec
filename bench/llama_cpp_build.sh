#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU) for bench/peers.py, from the llama.cpp source vendored
# in the PyPI sdist of llama-cpp-python (PyPI is the only registry this workplace reaches).
#
#   bash bench/llama_cpp_build.sh                  # -> $LLAMA_CPP_DIR/bin/llama-server
#   LLAMA_CPP_DIR=/tmp/llama JOBS=2 bash bench/llama_cpp_build.sh
#
# Nothing lands in the repository: the sdist, the source and the build live under
# $LLAMA_CPP_DIR (default ${SPLITSERVE_CACHE_DIR:-~/.cache/splitserve}/llama.cpp).
# About 4 minutes with -j2 on a 2-core machine. Re-running reuses what is there.
# Prints the path of the binary as its last line.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPLITSERVE_CACHE_DIR:-$HOME/.cache/splitserve}"
DIR="${LLAMA_CPP_DIR:-$CACHE/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP="${PIP:-$HERE/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"

BIN="$DIR/build/bin/llama-server"
if [ -x "$BIN" ] && [ -z "${FORCE:-}" ]; then
    echo "already built (FORCE=1 rebuilds)" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIR/sdist"
SDIST="$(ls "$DIR"/sdist/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    echo "downloading the llama-cpp-python $VERSION sdist ..." >&2
    $PIP download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist" >&2
    SDIST="$DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
fi

SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$DIR/src"
    tar -xzf "$SDIST" -C "$DIR/src"
fi

# GGML_NATIVE compiles for what CPUID reports. Some VMs/sandboxes report AMX yet fault on the
# tile instructions (llama-server then dies on its warm-up matmul), so probe AMX first and build
# without it where it does not run.
NOAMX=""
PROBE="$(mktemp -d)"
cat >"$PROBE/amx.c" <<'C'
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2; /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
    unsigned char cfg[64] __attribute__((aligned(64)));
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16; /* palette 1; tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    if ! { cc -O1 -mamx-tile "$PROBE/amx.c" -o "$PROBE/amx" 2>/dev/null && "$PROBE/amx"; } \
        2>/dev/null; then
        echo "AMX is reported but does not run here: building without it" >&2
        NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
fi
rm -rf "$PROBE"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC" -B "$DIR/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NOAMX" \
    -DCMAKE_CXX_FLAGS="$NOAMX" \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DIR/build" --target llama-server -j "$JOBS" >&2
"$BIN" --version >&2 || true
echo "$BIN"
