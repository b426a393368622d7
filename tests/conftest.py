"""Shared fixtures: ``device`` runs a test on the CPU and, where CUDA is available, again on the GPU; ``script`` is
the benchmark script a test module names in its SCRIPT, loaded as a module (benchmarks/ is on sys.path, so the
scripts' ``harness`` package imports as it does for them). The ``onednn_bf16`` marker skips a test where oneDNN
multiplies no bf16. vitkit's download cache (where sweeps keep drawn shapes) is a temporary directory of the session."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))  # `import harness`, as a script beside it does; appended: it shadows nothing


def pytest_configure(config: pytest.Config) -> None:
    os.environ["VITKIT_CACHE"] = cache = tempfile.mkdtemp(prefix="vitkit-test-cache-")  # never the user's cache
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    config.addinivalue_line("markers", "onednn_bf16: needs oneDNN's bf16 matmuls (vitkit's bf16 Dense paths)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked onednn_bf16 skip where oneDNN multiplies no bf16 (AVX2-only CPUs: it needs AVX512 or
    AVX-NE-CONVERT); there vitkit.accel's bf16 Dense paths give way to F.linear."""
    marked = [item for item in items if "onednn_bf16" in item.keywords]
    if not marked:
        return
    from vitkit.accel.cpu import onednn_bf16  # only where a collected test needs it: the rest runs without accel

    if onednn_bf16():
        return
    skip = pytest.mark.skip(reason="oneDNN multiplies no bf16 on this CPU")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(params=DEVICES, ids=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _cpu_unless_given_a_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that takes no ``device`` (and is not in test_cuda.py) is a CPU test, also on a GPU machine: "auto"
    devices resolve to the CPU in it. (Not through CUDA_VISIBLE_DEVICES, which would hide the GPU from the tests
    that run after it in this process; tests that start processes give them run.device=cpu.)"""
    if "device" in request.fixturenames or request.module.__name__.endswith("test_cuda"):
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def script(request: pytest.FixtureRequest) -> ModuleType:
    path = request.module.SCRIPT
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
