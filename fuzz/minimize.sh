#!/usr/bin/env bash
# Minimises the corpus of one target in place (README.md, "Fuzzing"): libFuzzer's greedy set
# cover of the coverage features, then, if that is more than MAX_FILES files or MAX_BYTES
# bytes, its smallest files up to those bounds (libFuzzer merges in order of size, so the
# larger files are the ones that add the fewest features).
#   fuzz/minimize.sh TARGET
set -euo pipefail
cd "$(dirname "$0")"
target=$1
max_files=${MAX_FILES:-200}
max_bytes=${MAX_BYTES:-1000000}
bin=target/x86_64-unknown-linux-gnu/release/$target
[ -x "$bin" ] || cargo +nightly fuzz build -O "$target"
out=$(mktemp -d)
"$bin" -set_cover_merge=1 -max_len=65536 -rss_limit_mb=2048 -timeout=60 "$out" "corpus/$target" 2>&1 |
  grep -E "MERGE-OUTER: [0-9]+ new files" || true
kept=$(mktemp -d)
total=0
count=0
while IFS=$'\t' read -r size file; do
  if [ "$count" -ge "$max_files" ] || [ $((total + size)) -gt "$max_bytes" ]; then
    break
  fi
  cp "$file" "$kept/"
  total=$((total + size))
  count=$((count + 1))
done < <(find "$out" -type f -printf '%s\t%p\n' | sort -n)
echo "$target: $(find "$out" -type f | wc -l) files after the set cover, $count kept ($total bytes)"
rm -rf "corpus/$target" "$out"
mv "$kept" "corpus/$target"
