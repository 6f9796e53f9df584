"""Fixtures of the `nucleus serve` integration tests: the binary, the models, one server per
configuration (module-scoped), and the clients that talk to it."""

from __future__ import annotations

import array
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

try:  # openai >= 3 ships its HTTP client as `httpx2`; older ones use `httpx`.
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K.gguf"
MINIMIND_TOKENIZER = SHARED / "models" / "minimind-tokenizer"
READY = "nucleus serve: listening on http://"
START_TIMEOUT_S = 60.0


def nucleus_bin() -> Path:
    env = os.environ.get("NUCLEUS_BIN")
    return Path(env) if env else REPO / "target" / "debug" / "nucleus"


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


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 folder with MiniMind's tokenizer (and its ChatML template)."""
    d = tmp_path_factory.mktemp("tiny-qwen3")
    (d / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=1))
    write_safetensors(d / "model.safetensors", qwen3_tensors())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MINIMIND_TOKENIZER / name, d / name)
    return d


# --- servers ---------------------------------------------------------------------------------

class Server:
    """One `nucleus serve` process, started on a free port."""

    def __init__(self, model: Path | str, *args: str, api_key: str | None = None):
        binary = nucleus_bin()
        if not binary.is_file():
            pytest.fail(f"no nucleus binary at {binary} (build it, or set NUCLEUS_BIN)")
        if not Path(model).exists():
            pytest.fail(f"no model at {model} (the models live in <repo>/../shared/models)")
        self.cmd = [str(binary), "serve", "--model", str(model), "--port", "0",
                    "--threads", "1", *args]
        env = dict(os.environ)
        env.pop("NUCLEUS_API_KEY", None)  # `--api-key` reads it: a stray one would change auth
        self.api_key = api_key
        if api_key is not None:
            self.cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env, text=True, errors="replace")
        self.stderr_lines: list[str] = []
        ready = threading.Event()
        self.url = ""

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                if not ready.is_set() and line.startswith(READY):
                    self.url = line.strip().split("listening on ", 1)[1]
                    ready.set()
            ready.set()  # EOF: the process ended

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        if not ready.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            pytest.fail(f"{self.cmd} did not get ready in {START_TIMEOUT_S} s; stderr:\n"
                        + "".join(self.stderr_lines))
        self.port = int(self.url.rsplit(":", 1)[1])
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", self.api_key or "x")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.base}/v1", **kw)

    def http(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.base, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def stories():
    """stories260K, served as `tiny`."""
    s = Server(STORIES, "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    """The tiny random Qwen3, served as `qwen`."""
    s = Server(qwen3_dir, "--served-model-name", "qwen")
    yield s
    s.stop()
