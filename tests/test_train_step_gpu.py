"""benchmarks/train_step_gpu.py: kernels sorted into kinds by the names a CUDA profile of a ViT training step
shows (those below were read on an H200 with torch 2.11), and the whole script run on the CPU on a tiny ViT."""

from __future__ import annotations

import importlib.util
import re
import statistics
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step_gpu.py"


@pytest.fixture
def script():
    """A fresh copy of the script for each test (one replaces its timm_peer)."""
    spec = importlib.util.spec_from_file_location("train_step_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "kernel, kind",
    [
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "gemm"),
        ("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8", "gemm"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
            "attention",
        ),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false>, true>", "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
        ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_21", "fused"),
        ("triton_poi_fused_gelu_gelu_backward_view_19", "fused"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>",
            "optimizer",
        ),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
        ("Memcpy DtoD (Device -> Device)", "other"),
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::_fused_adamw_", "optimizer"),
        ("aten::native_layer_norm", "other"),
    ],
)
def test_each_kernel_of_a_training_step_gets_its_kind(script, kernel, kind):
    assert script.kind_of(kernel) == kind


def test_the_script_runs_on_the_cpu_and_its_columns_agree(script, capsys):
    """A one-block ViT-S/16 at batch 2, eager and compiled: each row's images/s is the batch over its step time,
    its MFU is not invented for a CPU, and its step holds matrix products (the gemm kind) and an optimizer step."""
    args = ["--device", "cpu", "--models", "vit_s16", "--depth", "1", "--batch", "2", "--modes", "none"]
    args += ["--warmup", "1", "--steps", "1", "--rounds", "1", "--profile-steps", "1"]
    assert script.main(args) == 0
    out = capsys.readouterr().out
    assert "timm is not importable: vitkit alone" in out or "timm/none" in out
    rows = re.findall(r"^(\S+/none)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)%\s+((?:[\d.]+ms\s*){5})", out, re.M)
    assert rows and rows[0][0] == "vitkit/none", out
    for _, ms, per_s, mfu, busy, kinds in rows:
        assert float(per_s) == pytest.approx(2 / (float(ms) / 1e3), rel=2e-3, abs=0.05)  # img/s printed to 0.1
        assert mfu == "nan%"
        gemm, attention, fused, optimizer, other = (float(v) for v in re.findall(r"([\d.]+)ms", kinds))
        assert gemm > 0 and optimizer > 0
        # busy: the kinds' time over the (unprofiled) step's; on a CPU the profiler's own cost per operator can take
        # it past 100%, so the columns are checked against each other
        total = gemm + attention + fused + optimizer + other
        assert total == pytest.approx(float(busy) / 100 * float(ms), rel=2e-3, abs=0.05)


def test_a_peer_row_gets_a_paired_ratio_against_vitkit_in_its_mode(script, monkeypatch, capsys):
    """With a peer importable (here vitkit's own model standing in for timm's, which cannot be installed beside
    this suite), each peer row is timed beside vitkit's and gets the paired ratio of their rounds."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "timm" else find_spec(name, *a)
    )
    monkeypatch.setattr(script, "timm_peer", lambda model: model)
    timed, timed_rounds = {}, script.timed_rounds

    def kept_rounds(*args):
        timed.update(timed_rounds(*args))
        return timed

    monkeypatch.setattr(script, "timed_rounds", kept_rounds)
    args = ["--device", "cpu", "--models", "vit_s16", "--depth", "1", "--batch", "2", "--modes", "none"]
    assert script.main([*args, "--warmup", "1", "--steps", "1", "--rounds", "3", "--profile-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^timm/none\s+[\d.]+", out, re.M), out
    line = r"^vitkit/none over timm/none: ([\d.]+)x \(95% CI ([\d.]+)-([\d.]+), .*3 rounds\)$"
    ((ratio, low, high),) = re.findall(line, out, re.M)
    # the same rounds' peer-over-vitkit ratios, paired round by round: the printed ratio is their median (timings
    # are noise here, so the figure is checked against the rounds it came from, not against a range)
    paired = [t / v for t, v in zip(timed["timm/none"], timed["vitkit/none"], strict=True)]
    assert len(paired) == 3
    assert float(ratio) == pytest.approx(statistics.median(paired), abs=6e-4)
    assert min(paired) - 6e-4 <= float(low) <= float(ratio) <= float(high) <= max(paired) + 6e-4


def test_the_gemm_rate_counts_the_products_each_library_executes(script):
    """vitkit's class-token-only last block (optimize_for_training's) computes one token's query, projection and MLP:
    its step's products outside attention are the model's less 196 tokens' worth of those in one block (3x forward),
    which timm computes."""
    from vitkit.models import create_model

    model = create_model("vit_b16")
    full, executed = (script.gemm_flops(model, 224, executed=e) for e in (False, True))
    d, m, t = 768, 3072, 197
    assert full - executed == 3 * (t - 1) * (2 * d * d + 2 * d * d + 2 * 2 * d * m)  # q, proj, MLP
