#!/usr/bin/env python3
"""Write random Llama GGUF files for `nucleus bench generate` (issue 23, point 1).

The default shape is TinyLlama-1.1B's: dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 5632,
vocab 32,000 (about 0.85 B parameters, without TinyLlama's 22 layers). The tokenizer (and so
the vocabulary) is Llama 2's SentencePiece one, copied from llama.cpp's tokenizer-test file
`../shared/models/vocab/ggml-vocab-llama-spm.gguf`. Weights are seeded normal(0, 0.02)
values, one stream per tensor name, so every type holds the same model. Norm weights are F32
ones (as llama.cpp writes 1-D tensors). Types: `f16`, `bf16`, `q8_0` (quantized by gguf-py's
`gguf.quants`, llama.cpp's reference Q8_0), `q4_k_m` (llama.cpp's mix of types: Q4_K, with
Q6_K for some tensors) and `q4_0` (Q4_0, with llama.cpp's Q6_K output matrix), made from the F16 file (written first when `f16` is not asked for) by
llama.cpp's `llama_model_quantize`, the function its `llama-quantize` tool runs, in the
`llama_quantize` example of nucleus-bench that `scripts/build-llama-cpp-bench.sh` builds
(`target/release/examples/llama_quantize`; `--quantize PATH` for another place). Q4_K needs
`--dim` and `--ffn` to be multiples of 256 (llama.cpp falls back to other types otherwise).

Needs `pip install gguf numpy` (a virtual environment). Example:

    python3 scripts/make-random-llama.py --out /tmp/models --types f16,bf16,q8_0,q4_k_m
    python3 scripts/make-random-llama.py --out /tmp/small --dim 256 --layers 2 --ffn 688

Each file is named `random-llama-<dim>x<layers>-<type>.gguf`; the path is printed.
"""

import argparse
import hashlib
import pathlib
import subprocess
import sys

import gguf
import numpy as np

VOCAB_FILE = (
    pathlib.Path(__file__).resolve().parent.parent.parent
    / "shared/models/vocab/ggml-vocab-llama-spm.gguf"
)

TYPES = {
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Types made from the F16 file by llama.cpp's llama_model_quantize (the llama_quantize
# example): the name it takes.
LLAMA_QUANTIZED = {"q4_k_m": "q4_k_m", "q4_0": "q4_0"}

QUANTIZE = (
    pathlib.Path(__file__).resolve().parent.parent / "target/release/examples/llama_quantize"
)


def weights(name: str, rows: int, cols: int) -> np.ndarray:
    """The seeded normal(0, 0.02) values of tensor `name`, [rows, cols] f32."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)


def tokenizer_fields(path: pathlib.Path):
    """The tokenizer.* fields of a GGUF file: (name, value, GGUF value type)."""
    reader = gguf.GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            yield field.name, field.contents(), field.types


def path_of(args, kind: str) -> pathlib.Path:
    """The file of type `kind`."""
    return pathlib.Path(args.out) / f"random-llama-{args.dim}x{args.layers}-{kind}.gguf"


def quantize(args, kind: str, f16: pathlib.Path) -> pathlib.Path:
    """Type `kind` of LLAMA_QUANTIZED, made from the F16 file by llama.cpp."""
    tool = pathlib.Path(args.quantize)
    if not tool.is_file():
        sys.exit(
            f"error: {tool} is missing: {kind} is made by llama.cpp's llama_model_quantize, "
            "which `bash scripts/build-llama-cpp-bench.sh` builds (or pass --quantize PATH)"
        )
    out = path_of(args, kind)
    done = subprocess.run(
        [str(tool), str(f16), str(out), LLAMA_QUANTIZED[kind]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        sys.exit(f"error: {tool} failed (exit {done.returncode}) on {f16}:\n{tail}")
    return out


def write(args, kind: str) -> pathlib.Path:
    qtype, ftype = TYPES[kind]
    out = path_of(args, kind)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random llama {args.dim}x{args.layers} {kind}")
    w.add_context_length(args.context)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(args.dim // args.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(ftype)
    vocab = 0
    for name, value, types in tokenizer_fields(VOCAB_FILE):
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, types[0], sub_type=types[1])
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            w.add_key_value(name, value, types[0])
    w.add_vocab_size(vocab)

    head_dim = args.dim // args.heads
    kv = args.kv_heads * head_dim
    shapes = [("token_embd.weight", vocab, args.dim)]
    for b in range(args.layers):
        p = f"blk.{b}."
        shapes += [
            (p + "attn_q.weight", args.dim, args.dim),
            (p + "attn_k.weight", kv, args.dim),
            (p + "attn_v.weight", kv, args.dim),
            (p + "attn_output.weight", args.dim, args.dim),
            (p + "ffn_gate.weight", args.ffn, args.dim),
            (p + "ffn_up.weight", args.ffn, args.dim),
            (p + "ffn_down.weight", args.dim, args.ffn),
        ]
    shapes.append(("output.weight", vocab, args.dim))

    for name, rows, cols in shapes:
        data = gguf.quants.quantize(weights(name, rows, cols), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    ones = np.ones(args.dim, dtype=np.float32)
    for b in range(args.layers):
        w.add_tensor(f"blk.{b}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{b}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the folder to write into")
    ap.add_argument(
        "--types", default="f16,bf16,q8_0", help="comma-separated: f16, bf16, q8_0, q4_k_m, q4_0"
    )
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument(
        "--quantize",
        default=str(QUANTIZE),
        help="llama.cpp's quantizer for q4_k_m (default: the example "
        "scripts/build-llama-cpp-bench.sh builds)",
    )
    args = ap.parse_args()
    kinds = [k.strip() for k in args.types.split(",") if k.strip()]
    known = sorted(TYPES) + sorted(LLAMA_QUANTIZED)
    bad = [k for k in kinds if k not in known]
    if bad:
        ap.error(f"unknown type(s) {bad}; known: {known}")
    if args.dim % args.heads or args.heads % args.kv_heads:
        ap.error("--dim must be a multiple of --heads, and --heads of --kv-heads")
    if args.dim % 32 or args.ffn % 32:
        ap.error("--dim and --ffn must be multiples of 32 (Q8_0 blocks)")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    quantized = [k for k in kinds if k in LLAMA_QUANTIZED]
    if quantized and not pathlib.Path(args.quantize).is_file():
        # Before any file is written: the tool is needed, and missing.
        quantize(args, quantized[0], path_of(args, "f16"))
    f16 = None
    for kind in [k for k in kinds if k in TYPES]:
        out = write(args, kind)
        if kind == "f16":
            f16 = out
        print(out)
    if quantized:
        if f16 is None:
            f16 = write(args, "f16")
            print(f16, "(the source of " + ", ".join(quantized) + ")")
        for kind in quantized:
            print(quantize(args, kind, f16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
