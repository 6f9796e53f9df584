"""The native module's stubs (python/nucleus/_core.pyi) against the built module, with mypy's
stubtest: every function, class and method the extension defines is in the stubs with the same
parameters, and the stubs name nothing the extension lacks. (The pure-Python modules carry
their own annotations; ``py.typed`` marks the package as typed.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

import nucleus  # noqa: E402


def test_py_typed_marker_is_installed():
    assert (Path(nucleus.__file__).parent / "py.typed").exists()
    assert (Path(nucleus.__file__).parent / "_core.pyi").exists()


def test_stubtest_finds_no_difference(tmp_path):
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "mypy-cache"))
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "nucleus._core",
                        "--ignore-disjoint-bases"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
