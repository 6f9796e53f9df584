#!/usr/bin/env bash
# Builds `nucleus` with llama.cpp beside it in `nucleus bench generate` (feature llama-cpp of
# nucleus-cli, the llama-cpp-2 crate, which compiles llama.cpp's C++ with cmake), and the
# `llama_quantize` example that scripts/make-random-llama.py calls for Q4_K_M
# (llama.cpp's `llama_model_quantize`, what its `llama-quantize` tool runs).
#
# The build needs cmake, clang and libclang-dev (bindgen); they are installed with apt-get
# when missing (as root, or with sudo). Not part of CI: the feature stays off there.
#
#   bash scripts/build-llama-cpp-bench.sh
#   ./target/release/nucleus bench generate --model FILE.gguf
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v clang >/dev/null || missing+=(clang)
compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null || missing+=(libclang-dev)
if ((${#missing[@]})); then
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif sudo -n true 2>/dev/null; then
        sudo=(sudo)
    else
        echo "error: ${missing[*]} missing, and neither root nor sudo is at hand to install them" >&2
        exit 1
    fi
    echo "installing ${missing[*]} with apt-get" >&2
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq cmake clang libclang-dev
fi

cargo build --release -p nucleus-cli --features llama-cpp
cargo build --release -p nucleus-bench --features llama-cpp --example llama_quantize
echo "built: target/release/nucleus (with llama.cpp), target/release/examples/llama_quantize" >&2
