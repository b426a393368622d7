"""benchmarks/int8_ceiling.py: the share of the int8 peak a ViT could reach if only its matmuls and attention ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "int8_ceiling.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("int8_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ceiling_is_the_flops_over_the_time_at_the_peak(script) -> None:
    assert script.ceiling(100.0, 100.0, 0.0, 10.0) == 1.0  # matmuls at the peak and nothing else: all of it
    # 96 FLOPs of matmuls at 10 a second take 9.6 s, attention 2.4 s more: 100 FLOPs in 12 s, a peak of 10
    assert script.ceiling(100.0, 96.0, 2.4, 10.0) == pytest.approx(100 / 12 / 10)


def test_a_run_prints_both_precisions_of_attention_for_each_batch(script, capsys) -> None:
    script.main(["--model", "vit_ti16", "--batch-sizes", "1,2", "--rounds", "1"])
    out = capsys.readouterr().out
    assert out.startswith("vit_ti16: ") and "attention " in out
    for batch in (1, 2):
        (line,) = [line for line in out.splitlines() if line.startswith(f"  batch {batch:3d}: ")]
        assert "fp32 SDPA" in line and "bf16 SDPA" in line and line.count("ceiling") == 2


def test_not_a_vit_is_refused(script) -> None:
    with pytest.raises(SystemExit):
        script.main(["--model", "bit_r50x1"])
