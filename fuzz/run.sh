#!/usr/bin/env bash
# Runs one cargo-fuzz target on its committed corpus (README.md, "Fuzzing"):
#   fuzz/run.sh TARGET SECONDS [extra libFuzzer flags]
# New inputs go to fuzz/corpus/TARGET, crashes to fuzz/artifacts/TARGET. Seeds, if made with
# `cargo run -p nucleus-cli --example fuzz_seeds -- fuzz/seeds`, are read from fuzz/seeds/TARGET.
set -euo pipefail
cd "$(dirname "$0")"
target=$1
seconds=$2
shift 2
mkdir -p "corpus/$target"
dirs=("corpus/$target")
[ -d "seeds/$target" ] && dirs+=("seeds/$target")
case $target in
  grammar) max_len=8192 ;;
  gguf | safetensors) max_len=65536 ;;
  *) max_len=4096 ;;
esac
exec cargo +nightly fuzz run -O "$target" "${dirs[@]}" -- \
  -max_total_time="$seconds" -max_len="$max_len" -timeout=60 -rss_limit_mb=2048 \
  -print_final_stats=1 "$@"
