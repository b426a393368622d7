"""benchmarks/int8_torchao.py: vitkit's int8 against torchao's dynamic int8 on the same model."""

from __future__ import annotations

import copy
import importlib.metadata
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from vitkit.device import cpu_has_vnni
from vitkit.models import create_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "int8_torchao.py"
TINY = {"img_size": 32, "patch_size": 8, "width": 64, "depth": 2, "num_heads": 2, "mlp_dim": 128, "num_classes": 10}
vnni = pytest.mark.skipif(not cpu_has_vnni(), reason="vitkit's int8 layer needs VNNI")
# torchao's int8 products are torch._int_mm's, which on a CPU without VNNI saturate (oneDNN's u8 x s8 pair sums)
exact_int8 = pytest.mark.skipif(not cpu_has_vnni(), reason="torch._int_mm saturates without VNNI")


def tiny() -> nn.Module:
    torch.manual_seed(0)
    model = create_model("vit_ti16", **TINY).eval()
    nn.init.normal_(model.head.weight, std=0.5)  # the zero-initialised head would give zero logits
    return model


@exact_int8
def test_torchao_quantises_every_linear_of_a_copy_and_stays_near_fp32(script) -> None:
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantised = script.torchao_int8(model)
    linears = [m for m in quantised.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, proj, fc1, fc2 a block, and the head
    for layer in linears:  # torchao's int8 tensor in place of the fp32 weight
        assert type(layer.weight) is not nn.Parameter and "Int8" in type(layer.weight).__name__
    for k, v in model.state_dict().items():  # the model itself is untouched
        assert type(v) is torch.Tensor and torch.equal(v, before[k])
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want, got = model(x), quantised(x)
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.05  # quantised, so not fp32's bits, but close to them


@vnni
@pytest.mark.parametrize("with_timm", [False, True], ids=["without timm", "with timm"])
def test_a_run_times_every_row_at_every_batch_and_prints_their_errors(script, monkeypatch, capsys, with_timm) -> None:
    # timm is not installed here: where it is asked for, a stand-in holding the same weights takes its row
    monkeypatch.setattr(script, "timm_model", (lambda m: copy.deepcopy(m).eval()) if with_timm else (lambda m: None))
    script.main(["--model", "vit_ti16", "--batch-sizes", "1,2", "--rounds", "1", "--compile", "none"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("int8 on vit_ti16, vitkit against torchao ")
    rows = [*script.SWITCHES, *([script.TIMM] if with_timm else [])]
    for batch in (1, 2):
        (start,) = [i for i, line in enumerate(lines) if line.startswith(f"  batch {batch:3d}: ")]
        ms = {name: float(t) for name, t in re.findall(r"(\S+) ([\d.]+) ms", lines[start])}
        assert list(ms) == rows
        for line, name in zip(lines[start + 1 : start + len(rows)], rows[1:]):
            ratio = float(re.search(rf"vitkit / {re.escape(name)} ([\d.]+)x", line).group(1))
            assert ratio == pytest.approx(ms[name] / ms["vitkit"], rel=1e-2)  # one round: its two times' ratio
        errors = lines[start + len(rows) : start + 2 * len(rows)]
        assert [line.split()[0] for line in errors] == rows
        for line in errors:
            assert f"of {batch}," in line
            mean, largest = (float(v) for v in re.search(r"mean ([\d.e-]+) max ([\d.e-]+)", line).groups())
            assert 0 < mean <= largest  # all quantised: none gives fp32's logits


@vnni
def test_the_digits_accuracy_compares_both_switches_with_fp32(script) -> None:
    images = torch.rand(6, 3, 32, 32)
    lines = script.accuracy(tiny(), images, "none")
    assert [line.split()[0] for line in lines] == list(script.SWITCHES)
    assert all("of 6," in line for line in lines)


def test_without_torchao_it_says_how_to_install_it(script, monkeypatch, capsys) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(script.importlib.metadata, "version", missing)
    with pytest.raises(SystemExit):
        script.main(["--model", "vit_ti16"])
    assert "pip install torchao" in capsys.readouterr().err


def test_a_cpu_without_vnni_and_a_model_not_a_vit_are_refused(script, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        script.main(["--model", "bit_r50x1"])
    assert "expected a ViT" in capsys.readouterr().err
    monkeypatch.setattr(script, "int8_kernel", lambda: "fbgemm")
    with pytest.raises(SystemExit):
        script.main(["--model", "vit_ti16"])
    assert "no VNNI" in capsys.readouterr().err
