"""A tiny random Qwen3 checkpoint (config.json, model.safetensors, MiniMind's tokenizer), written
with the standard library only: for the tests (conftest.py) and the load test
(tests/load/run.sh).

    python3 tests/python/tiny_checkpoint.py OUT_DIR
"""

from __future__ import annotations

import array
import json
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MINIMIND_TOKENIZER = REPO.parent / "shared" / "models" / "minimind-tokenizer"


# --- the tiny random Qwen3 checkpoint --------------------------------------------------------

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 6400,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def qwen3_tensors(seed: int = 1234) -> list[tuple[str, list[int], array.array]]:
    """The tensors of the tiny Qwen3 (F32), drawn from a fixed-seed generator."""
    rng = random.Random(seed)
    c = QWEN3_CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out = c["num_attention_heads"] * hd
    kv_out = c["num_key_value_heads"] * hd

    def uniform(shape: list[int], scale: float, centre: float = 0.0):
        count = 1
        for d in shape:
            count *= d
        u = rng.uniform
        return array.array("f", [centre + u(-scale, scale) for _ in range(count)])

    out = [("model.embed_tokens.weight", [c["vocab_size"], h], 0.5, 0.0),
           ("model.norm.weight", [h], 0.1, 1.0)]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", [h], 0.1, 1.0),
            (f"{p}.post_attention_layernorm.weight", [h], 0.1, 1.0),
            (f"{p}.self_attn.q_norm.weight", [hd], 0.1, 1.0),
            (f"{p}.self_attn.k_norm.weight", [hd], 0.1, 1.0),
            (f"{p}.self_attn.q_proj.weight", [q_out, h], 0.125, 0.0),
            (f"{p}.self_attn.k_proj.weight", [kv_out, h], 0.125, 0.0),
            (f"{p}.self_attn.v_proj.weight", [kv_out, h], 0.125, 0.0),
            (f"{p}.self_attn.o_proj.weight", [h, q_out], 0.09, 0.0),
            (f"{p}.mlp.gate_proj.weight", [inter, h], 0.125, 0.0),
            (f"{p}.mlp.up_proj.weight", [inter, h], 0.125, 0.0),
            (f"{p}.mlp.down_proj.weight", [h, inter], 0.1, 0.0),
        ]
    return [(name, shape, uniform(shape, scale, centre)) for name, shape, scale, centre in out]


def write_safetensors(path: Path, tensors: list[tuple[str, list[int], array.array]]) -> None:
    """A safetensors file by hand: u64 LE header length, the JSON header padded with spaces
    to a multiple of 8, then the raw little-endian bytes."""
    header: dict[str, object] = {}
    blobs = []
    offset = 0
    for name, shape, data in tensors:
        if sys.byteorder != "little":
            data = array.array("f", data)
            data.byteswap()
        raw = data.tobytes()
        header[name] = {"dtype": "F32", "shape": shape,
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def write_tiny_qwen3(d: Path) -> Path:
    """A tiny random Qwen3 folder in `d` with MiniMind's tokenizer (and its ChatML template)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=1))
    write_safetensors(d / "model.safetensors", qwen3_tensors())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MINIMIND_TOKENIZER / name, d / name)
    return d


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_checkpoint.py OUT_DIR")
    print(write_tiny_qwen3(Path(sys.argv[1])))
