"""benchmarks/train_ceiling.py: a training step's time sorted into its products (with their FLOPs) and the rest, and
the share of the peak the products alone would allow."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from harness import BenchConfig, build_model, vitkit_step

from vitkit.device import bf16_is_fast
from vitkit.models.flops import vit_flops

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_ceiling.py"


def _profiled_products(
    script, dtype: str, attn: str, img: int, batch: int, compile: str = "none"
) -> tuple[dict, dict[str, int]]:
    cfg = BenchConfig(
        model="vit_ti16",
        img_size=img,
        batch_size=batch,
        dtype=dtype,
        attn=attn,
        mode="train",
        device="cpu",
        compile=compile,
        overrides={"depth": 2},
    )
    model = build_model(cfg, torch.device("cpu"))
    x, y = torch.randn(batch, 3, img, img), torch.randint(0, 1000, (batch,))
    step = vitkit_step(model, cfg, x, y, torch.device("cpu"))  # through optimize_for_training, as the script runs it
    step()
    products, _ = script.breakdown(script.profiled(step, shapes=True)[0])
    return products, vit_flops(model.config, img, first_token=True)


@pytest.mark.parametrize(
    ("dtype", "attn", "img", "batch"),
    [
        ("fp32", "sdpa", 32, 2),  # 10 rows: vitkit's oneDNN matmuls on the weight as it is, SDPA's kernels
        # 10 rows under autocast: F.linear (addmm, mm)
        pytest.param("bf16-autocast", "sdpa", 32, 2, marks=pytest.mark.onednn_bf16),
        ("fp32", "sdpa", 224, 11),  # 2,167 rows of width 192: vitkit's oneDNN matmuls forward and for the input
        ("fp32", "explicit", 224, 11),  # attention as batched matmuls
        # written out under bf16 autocast, the bias inside oneDNN's matmul
        pytest.param("bf16-autocast", "auto", 224, 11, marks=pytest.mark.onednn_bf16),
    ],
)
def test_the_products_found_are_the_flops_the_step_counts_forward_and_backward(script, dtype, attn, img, batch):
    # independent of the profiler: the analytic count of what the forward executes (optimize_for_training's last
    # block computes the class token alone); the backward is twice every product but the patch convolution's, whose
    # input (the image) needs no gradient
    products, flops = _profiled_products(script, dtype, attn, img, batch)
    forward = sum(f for group, (_, f) in products.items() if group.startswith("forward "))
    backward = sum(f for group, (_, f) in products.items() if group.startswith("backward "))
    assert forward == flops["total"] * batch
    assert backward == (2 * flops["total"] - flops["patch_embed"]) * batch
    assert all(seconds > 0 for seconds, _ in products.values())
    kernels = {group.split(" ", 1)[1] for group in products}
    assert ("SDPA kernels" in kernels) == (attn == "sdpa")
    assert ("oneDNN linear" in kernels) == (img == 224 or dtype == "fp32")  # autocast: from 2,048 rows


def test_a_compiled_steps_products_are_its_count_too(script):
    """Through torch.compile the products stay library calls, which the breakdown finds and counts as eagerly, but
    for the class-token block's attention: one query a head, which inductor computes as a reduction of its own."""
    products, flops = _profiled_products(script, "fp32", "explicit", 32, 2, compile="default")
    forward = sum(f for group, (_, f) in products.items() if group.startswith("forward "))
    backward = sum(f for group, (_, f) in products.items() if group.startswith("backward "))
    tokens, width = (32 // 16) ** 2 + 1, 192  # vit_ti16 at 32 px
    class_token_attention = 2 * 2 * tokens * width  # q k^T and p v for the one query, every head: 2 FLOPs a term
    assert forward == (flops["total"] - class_token_attention) * 2
    assert backward == (2 * flops["total"] - flops["patch_embed"] - 2 * class_token_attention) * 2


def test_attention_kernels_count_queries_against_keys(script):
    # the class-token-only last block: 1 query against 17 keys, forward (q, k, v) and backward (grad, q, k, v)
    q, k = (2, 3, 1, 64), (2, 3, 17, 64)
    fwd = script.PRODUCTS["aten::_scaled_dot_product_flash_attention_for_cpu"][1]
    bwd = script.PRODUCTS["aten::_scaled_dot_product_flash_attention_for_cpu_backward"][1]
    assert fwd([q, k, k]) == 2 * 2 * 2 * 3 * 1 * 17 * 64
    assert bwd([q, q, k, k, q]) == 2 * fwd([q, k, k])


def test_the_ceiling_and_the_budget_left_at_80_percent(script):
    # 100 FLOPs a step; the products take 0.5 s of a 0.8 s step at a peak of 250 FLOP/s, in both rounds
    rounds = [(250.0, {"forward gemm": [0.2, 0.0], "backward gemm": [0.3, 0.0]}, {"copy_": 0.3}, 0)] * 2
    counted = {"forward gemm": [0.0, 40.0], "backward gemm": [0.0, 60.0]}
    lines = script.report("label", 0.5, 100.0, 0.0, rounds, counted)
    assert lines[0] == "label: 50.0% of the peak, 0.0 GFLOP executed"
    # the products alone: 100 / 0.5 / 250 = 80%; at 80% a step takes 0.5 s, leaving the rest 0 ms
    assert lines[-1].startswith("  ceiling, the products alone at these rates: 80.0% of the peak; 80% of it leaves")
    assert lines[-1].endswith("everything else 0 ms a step (it took 300)")
    backward = next(line for line in lines if "backward gemm" in line)
    assert "300.0 ms" in backward and "37.5%" in backward and "at  80% of the peak" in backward  # 60 / 0.3 / 250


def test_a_run_prints_fp32_and_bf16_where_it_is_native(script, capsys, monkeypatch):
    monkeypatch.setattr(script, "matmul_probe", functools.partial(script.matmul_probe, max_n=256))  # a short probe
    script.main(["--model", "vit_ti16", "--img-size", "32", "--batch-size", "2", "--rounds", "1", "--profile", "1"])
    out = capsys.readouterr().out
    native = bf16_is_fast(torch.device("cpu"))  # emulated bf16 is left out, as speed_targets.py leaves it
    assert "vit_ti16 training step, batch 2, fp32 (" in out
    assert ("vit_ti16 training step, batch 2, bf16-autocast (" in out) == native
    assert ("bf16 is emulated on this CPU" in out) == (not native)
    assert out.count("ceiling, the products alone at these rates: ") == 1 + native


def test_emulated_bf16_is_left_out(script, capsys, monkeypatch):
    monkeypatch.setattr(script, "bf16_is_fast", lambda device: False)
    monkeypatch.setattr(script, "matmul_probe", functools.partial(script.matmul_probe, max_n=256))
    script.main(["--model", "vit_ti16", "--img-size", "32", "--batch-size", "2", "--rounds", "1", "--profile", "1"])
    out = capsys.readouterr().out
    assert out.startswith("bf16 is emulated on this CPU") and "bf16-autocast (" not in out


def test_not_a_vit_is_refused(script):
    with pytest.raises(SystemExit):
        script.main(["--model", "bit_r50x1"])
