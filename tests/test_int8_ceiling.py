"""benchmarks/int8_ceiling.py: the share of the int8 peak a ViT could reach if only its matmuls and attention ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitkit.device import cpu_has_vnni

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "int8_ceiling.py"


def test_the_ceiling_is_the_flops_over_the_time_at_the_peak(script) -> None:
    assert script.ceiling(100.0, 100.0, 0.0, 10.0) == 1.0  # matmuls at the peak and nothing else: all of it
    # 96 FLOPs of matmuls at 10 a second take 9.6 s, attention 2.4 s more: 100 FLOPs in 12 s, a peak of 10
    assert script.ceiling(100.0, 96.0, 2.4, 10.0) == pytest.approx(100 / 12 / 10)


@pytest.mark.skipif(not cpu_has_vnni(), reason="times vitkit's VNNI int8 layer")
def test_a_run_prints_every_attention_and_both_ceilings_for_each_batch(script, capsys) -> None:
    script.main(["--model", "vit_ti16", "--batch-sizes", "1,2", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("vit_ti16: ") and "attention " in lines[0]
    for batch in (1, 2):
        (start,) = [i for i, line in enumerate(lines) if line.startswith(f"  batch {batch:3d}: int8 matmuls")]
        rows = lines[start + 1 : start + 5]
        names = ("fp32 SDPA", "bf16 SDPA", "bf16 written out", "int8 products")
        assert [row.strip().split("  ")[0] for row in rows] == list(names)
        for row in rows:  # at the peak, then at the matmuls' measured rates: never above the first
            at_peak, at_rates = (float(c.strip(" %")) for c in row.split("ceiling")[1].split("/"))
            assert 0 < at_rates <= at_peak <= 100


def test_the_int8_products_are_the_two_attention_matmuls_for_every_image_and_head(script, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(script.torch, "_int_mm", lambda a, b: calls.append((tuple(a.shape), tuple(b.shape))))
    q, k_t, probs = torch.zeros(5, 4, dtype=torch.int8), torch.zeros(4, 5, dtype=torch.int8), torch.zeros(5, 5)
    script._int8_products(q, k_t, probs, 3)
    assert calls == [((5, 4), (4, 5)), ((5, 5), (5, 4))] * 3


def test_a_cpu_without_vnni_is_refused(script, monkeypatch, capsys) -> None:
    monkeypatch.setattr(script, "int8_kernel", lambda: "fbgemm")
    with pytest.raises(SystemExit):
        script.main(["--model", "vit_ti16"])
    assert "no VNNI" in capsys.readouterr().err


def test_not_a_vit_is_refused(script) -> None:
    with pytest.raises(SystemExit):
        script.main(["--model", "bit_r50x1"])
