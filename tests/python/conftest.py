"""Fixtures of the `nucleus serve` integration tests: the binary, the models, one server per
configuration (module-scoped), and the clients that talk to it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import openai
import pytest

from tiny_checkpoint import write_tiny_qwen3

try:  # openai >= 3 ships its HTTP client as `httpx2`; older ones use `httpx`.
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K.gguf"
READY = "nucleus serve: listening on http://"
START_TIMEOUT_S = 60.0


def nucleus_bin() -> Path:
    env = os.environ.get("NUCLEUS_BIN")
    return Path(env) if env else REPO / "target" / "debug" / "nucleus"


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 folder with MiniMind's tokenizer (and its ChatML template)."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


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
