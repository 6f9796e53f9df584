#!/usr/bin/env bash
# The load test of `nucleus serve` (BENCHMARKS.md, "Serving"): `nucleus bench serve` on
# stories260K (../shared/models) and on a tiny random Qwen3 checkpoint written here, over
# loopback. Each run starts its own server, is bounded in requests and seconds, and exits
# non-zero when a request is lost, a 4xx/5xx comes back, the server does not return to 0
# running after the clients that hang up, or its memory grows beyond the bound.
#
#   tests/load/run.sh --short   # CI: about 30 s on the debug binary
#   tests/load/run.sh --full    # the figures: 500 requests at 1, 8 and 32 streams on each
#                               # model, 200 with 20% hang-ups, a 10-minute soak (~13 min)
#
# The binary: $NUCLEUS_BIN, else target/debug/nucleus (--short) or target/release/nucleus
# (--full). Builds nothing.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mode="${1:---short}"
case "$mode" in
    --short) bin="${NUCLEUS_BIN:-$repo/target/debug/nucleus}" ;;
    --full) bin="${NUCLEUS_BIN:-$repo/target/release/nucleus}" ;;
    *) echo "usage: tests/load/run.sh [--short|--full]" >&2; exit 2 ;;
esac
if [ ! -x "$bin" ]; then
    echo "tests/load/run.sh: no nucleus binary at $bin (build it, or set NUCLEUS_BIN)" >&2
    exit 1
fi
stories="$repo/../shared/models/stories260K.gguf"
qwen3="$repo/target/load/tiny-qwen3"
python3 "$repo/tests/python/tiny_checkpoint.py" "$qwen3" >/dev/null

# The server gets one engine thread, the client (this process) the other core.
if [ "$mode" = --short ]; then
    "$bin" bench serve --model "$stories" --threads 1 --concurrency 1,8 --requests 40 \
        --fault-requests 40 --fault-concurrency 16 --soak-seconds 10 --rss-interval 2
    "$bin" bench serve --model "$qwen3" --endpoint chat --threads 1 --concurrency 8 \
        --requests 20 --fault-requests 20 --fault-concurrency 8
else
    "$bin" bench serve --model "$stories" --threads 1 --concurrency 1,8,32 --requests 500 \
        --fault-requests 200 --fault-concurrency 32 --soak-seconds 600 --rss-interval 10 \
        --max-rss-growth-mib 8
    "$bin" bench serve --model "$qwen3" --endpoint chat --threads 1 --concurrency 1,8,32 \
        --requests 500 --fault-requests 200 --fault-concurrency 32
fi
