#!/usr/bin/env python3
"""How far nucleus's and llama.cpp's logits are from an exact computation of a Llama GGUF file.

Reads the prompt ids and the first step's logits of both engines that the `logit_diff` example
of nucleus-bench wrote (`DUMP=DIR target/release/examples/logit_diff MODEL P 1 ...`), computes
the model's logits for that prompt in f64 (numpy) from the file's weights as stored (gguf-py
dequantizes every type to the values the engines multiply), and prints each engine's largest
and root-mean-square distance from them. The computation is llama.cpp's `llm_build_llama`:
RMSNorm, q/k/v, RoPE on adjacent pairs (GGUF llama files store q and k permuted for it),
grouped-query causal softmax attention, o, SwiGLU feed-forward, final norm, LM head
(`output.weight`, else the embedding).

Needs `pip install gguf numpy`. Use a short prompt (16 tokens): it runs in a few seconds on
the 0.85 B random model. Example:

    DUMP=/tmp/d target/release/examples/logit_diff /tmp/models/random-llama-2048x16-q8_0.gguf 16 1 off f32
    python3 scripts/reference-logits.py /tmp/models/random-llama-2048x16-q8_0.gguf /tmp/d
"""

import sys

import gguf
import numpy as np


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path, dump = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def field(name):
        return reader.fields[name].contents()

    def weight(name):
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        return values.reshape([int(d) for d in reversed(t.shape)])

    dim = int(field("llama.embedding_length"))
    layers = int(field("llama.block_count"))
    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv"))
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    base = float(field("llama.rope.freq_base")) if "llama.rope.freq_base" in reader.fields else 10000.0
    hd = dim // heads

    ids = [int(x) for x in open(f"{dump}/ids.txt").read().split()]
    n = len(ids)
    x = weight("token_embd.weight")[ids]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    angles = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(q):
        a, b = q[..., 0::2], q[..., 1::2]
        out = np.empty_like(q)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(layers):
        p = f"blk.{layer}."
        h = rms(x, weight(p + "attn_norm.weight"))
        q = rope((h @ weight(p + "attn_q.weight").T).reshape(n, heads, hd))
        k = rope((h @ weight(p + "attn_k.weight").T).reshape(n, kv_heads, hd))
        v = (h @ weight(p + "attn_v.weight").T).reshape(n, kv_heads, hd)
        out = np.zeros((n, heads, hd))
        for head in range(heads):
            kh = head // (heads // kv_heads)
            s = q[:, head, :] @ k[:, kh, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[:, head, :] = s @ v[:, kh, :]
        x = x + out.reshape(n, dim) @ weight(p + "attn_output.weight").T
        h = rms(x, weight(p + "ffn_norm.weight"))
        gate = h @ weight(p + "ffn_gate.weight").T
        up = h @ weight(p + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ weight(p + "ffn_down.weight").T
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    exact = (rms(x[-1:], weight("output_norm.weight")) @ weight(head_name).T)[0]

    top = np.sort(exact)[-2:]
    print(f"f64: greedy token {int(np.argmax(exact))}, top-2 gap {top[1] - top[0]:.3e}")
    logits = np.fromfile(f"{dump}/step0.bin", dtype=np.float32).reshape(2, -1)
    for name, row in (("llama.cpp", logits[0]), ("nucleus", logits[1])):
        d = np.abs(row.astype(np.float64) - exact)
        print(
            f"{name}: greedy token {int(np.argmax(row))}, max |logit - f64| {d.max():.3e}, "
            f"rms {np.sqrt((d * d).mean()):.3e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
