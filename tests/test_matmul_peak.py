"""benchmarks/matmul_peak.py: each precision's matmul peak kernel by kernel, and which one the benchmarks take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "matmul_peak.py"


def test_a_run_prints_every_kernel_and_the_fastest(script, monkeypatch, capsys) -> None:
    monkeypatch.setattr(script, "probe_size", lambda dtype, device: 256)
    script.main(["--dtypes", "fp32", "--rounds", "1"])
    out = capsys.readouterr().out.splitlines()
    (line,) = [row for row in out if row.startswith("  fp32 256x256: ")]
    names = [k.kernel for k in script.probe_kernels(torch.float32, torch.device("cpu"), 256)]
    assert all(f"{name} " in line for name in names) and "; the peak: " in line and line.endswith("x torch's")
    fastest = line.split("; the peak: ")[1].rsplit(", ", 1)[0]
    assert fastest in names


def test_unknown_dtypes_are_refused(script) -> None:
    with pytest.raises(SystemExit):
        script.main(["--dtypes", "fp16"])
