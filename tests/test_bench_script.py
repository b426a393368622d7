"""benchmarks/bench_vit.py's equal-precision comparison on a tiny ViT: every library under the same switch, the
peak of each precision timed beside them, a target row per precision. Nothing is timed against a threshold."""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vitkit.bench import dense_bf16_peak, vit_flops
from vitkit.models import create_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vit.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))  # as running the script does: its sibling peers.py imports
    spec = importlib.util.spec_from_file_location("bench_vit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_vit"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["bench_vit"]
        sys.path.remove(str(SCRIPT.parent))


def test_peer_switches_are_the_documented_ones(bench):
    torch.manual_seed(0)
    model = create_model("vit_ti16", img_size=32, depth=2, num_classes=5).eval()
    nn.init.normal_(model.head.weight, std=0.02)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        int8 = bench.peer_switch(model, "int8", "none")
        assert not any(type(m) is nn.Linear for m in int8.modules())  # every Linear quantised
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the peer itself left as it was
        torch.testing.assert_close(int8(x), want, atol=0.05, rtol=0)
        bf16 = bench.peer_switch(model, "bf16", "none")
        got = bf16(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0)
        torch.testing.assert_close(bench.peer_switch(model, "fp32", "none")(x), want)


def test_precision_comparison_times_each_precision_against_its_own_peak(bench):
    args = argparse.Namespace(compile="none", repeats=3, max_repeats=3, warmup=0, target=0.02)
    text, targets, doc = bench.precision_comparison(
        args, 2, ["fp32", "int8"], {}, "vit_ti16", img_size=32, depth=2, num_classes=10
    )
    assert set(doc["rows"]) == {
        "fp32 vitkit",
        "fp32 vitkit, peers' switch",  # vitkit's model as the peers run: as built in fp32 (int8 has no such row)
        "fp32 transformers",
        "int8 vitkit",
        "int8 transformers",
    }
    assert set(doc["peaks_g_per_s"]) == {"fp32", "int8"} and all(v > 0 for v in doc["peaks_g_per_s"].values())
    config = create_model("vit_ti16", img_size=32, depth=2, num_classes=10).config
    executed = {True: vit_flops(config, logits_path=True)["total"], False: vit_flops(config)["total"]}
    assert executed[True] < executed[False]  # vitkit's last block computes the class token alone
    for name, row in doc["rows"].items():
        p, impl = name.split(" ", 1)
        # each row against the peak of its own precision timed in the same round, with the FLOPs that implementation
        # executes (vitkit's model under either switch: its class-token block), then the median over rounds
        probe_s = doc["times_s"][f"{p} matmul peak"]
        probe_ops = doc["peaks_g_per_s"][p] * 1e9 * statistics.median(probe_s)
        flops = executed[impl.startswith("vitkit")]
        shares = [2 * flops / t / (probe_ops / s) for t, s in zip(doc["times_s"][name], probe_s)]
        assert len(shares) == 3 and row["utilisation"] == pytest.approx(statistics.median(shares), rel=1e-9), name
        assert (row["ratio"] is None) == (impl == "vitkit"), name
    assert [t[0].split(":")[0] for t in targets] == ["batch 2 fp32"] * 3 + ["batch 2 int8"] * 2
    assert targets[2][0] == "batch 2 fp32: vitkit under the peers' switch / transformers" and targets[2][2] is None
    assert "int8 matmul peak" not in doc["rows"] and "fp32 transformers" in text


def test_precision_comparison_without_an_fp32_row_checks_against_the_fp32_model(bench):
    args = argparse.Namespace(compile="none", repeats=1, max_repeats=1, warmup=0, target=0.02)
    _, targets, doc = bench.precision_comparison(args, 1, ["int8"], {}, "vit_ti16", img_size=32, depth=1)
    assert set(doc["rows"]) == {"int8 vitkit", "int8 transformers"} and set(doc["peaks_g_per_s"]) == {"int8"}
    assert len(targets) == 2


def test_gpu_bench_takes_each_gpus_own_datasheet_peak_and_gives_each_row_its_switches(monkeypatch):
    """The datasheet peaks that the GPU scripts state MFU against: an H100 PCIe is not taken for an SXM part (756
    against 989.4 dense bf16 TFLOP/s), an unknown GPU gets no invented peak; and bench_gpu.py's rows: batch 1 is
    compiled with CUDA graphs, large batches and training with mode "default"."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as running the script does: its sibling peers.py imports
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT.parent / "bench_gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    for name, want in [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert dense_bf16_peak(torch.device("cuda")) == (want, name)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA T4")
    assert math.isnan(dense_bf16_peak(torch.device("cuda"))[0])
    args = argparse.Namespace(infer_batches=[1, 256], train_batch=128, repeats=3, max_repeats=3, warmup=1, overrides={})
    rows = {
        label: (cfg.mode, cfg.dtype, cfg.batch_size, modes) for label, cfg, modes in gpu.bench_rows("vit_b16", args)
    }
    assert rows == {
        "vit_b16 inference batch 1": ("infer", "bf16", 1, ("none", "reduce-overhead")),
        "vit_b16 inference batch 256": ("infer", "bf16", 256, ("none", "default")),
        "vit_b16 training batch 128": ("train", "bf16-autocast", 128, ("none", "default")),
    }
