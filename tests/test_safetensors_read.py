"""Reading a .safetensors file that a live process replaces (an atomic save: a new file renamed over the old)
gives one whole version of it, header and tensors together, never a mix of two and never torch's mapping error."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vitkit.checkpoint import base
from vitkit.checkpoint.base import read_safetensors
from vitkit.errors import UserError


def _version_file(path: str, i: int) -> None:
    """Version i: its number in the header (a header that grows with it) and in every value of a tensor whose
    length varies with it, written beside ``path`` and renamed over it."""
    tmp = f"{path}.{i}.tmp"
    save_file({"t": torch.full((1000 + i % 7,), float(i))}, tmp, metadata={"version": str(i), "pad": "x" * (i % 5)})
    os.replace(tmp, path)


def _replace_until(path: str, stop: Any) -> None:
    for i in itertools.count(1):  # a new version every 5 ms or so: far more often than any run saves
        if stop.wait(0.005):
            return
        _version_file(path, i)


def test_a_file_replaced_while_read_is_read_as_one_whole_version(tmp_path):
    path = str(tmp_path / "state.safetensors")
    _version_file(path, 0)
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    writer = context.Process(target=_replace_until, args=(path, stop))
    writer.start()
    try:
        reads, versions = 0, set()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or len(versions) < 50:
            meta, tensors = read_safetensors(path, tensors=reads % 2 == 0)
            i = int(meta["version"])
            versions.add(i)
            if tensors:  # the tensors of the version the header says, not another's bytes at its offsets
                assert torch.equal(tensors["t"], torch.full((1000 + i % 7,), float(i)))
            reads += 1
            assert time.monotonic() < deadline + 60, "the writer stopped replacing the file"
    finally:
        stop.set()
        writer.join(timeout=30)
    assert len(versions) >= 50


def test_a_file_that_changes_under_every_read_is_one_line_error(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"t": torch.zeros(3)}, str(path))
    assert read_safetensors(path)[1]["t"].tolist() == [0.0, 0.0, 0.0]
    versions = itertools.count()
    monkeypatch.setattr(base, "_version", lambda p: next(versions))  # a new version at every look
    with pytest.raises(UserError, match=rf"w\.safetensors: replaced while being read, {base.READ_TRIES} times"):
        read_safetensors(path)
