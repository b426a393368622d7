"""benchmarks/bench_vit.py (one model, optionally beside peers: what `vitkit bench` was) and
benchmarks/speed_targets.py's equal-precision comparison on a tiny ViT: every library under the same switch, the
peak of each precision timed beside them, a target row per precision. Nothing is timed against a threshold."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import dense_bf16_peak, peer_switch
from torch import nn

from vitkit.models import create_model
from vitkit.models.flops import vit_flops

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "speed_targets.py"  # conftest's ``script``
TINY_RUN = ["--model", "vit_ti16", "--img-size", "32", "--batch-size", "2", "--repeats", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def bench_vit_module():
    """benchmarks/bench_vit.py loaded as a module."""
    spec = importlib.util.spec_from_file_location("bench_vit", BENCHMARKS / "bench_vit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_vit(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/bench_vit.py run as a user runs it, on the CPU."""
    command = [sys.executable, str(BENCHMARKS / "bench_vit.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


# --------------------------------------------------------------------------------------------------- bench_vit.py
def test_bench_vit_runs_one_model_and_writes_json_and_a_result_file(tmp_path):
    out, results = tmp_path / "bench.json", tmp_path / "results" / "tiny.md"
    done = bench_vit(*TINY_RUN, "--device", "cpu", "--json", str(out), "--results", str(results))
    assert done.returncode == 0, done.stderr
    assert "vit_ti16 infer img 32 batch 2 fp32" in done.stdout
    assert f"wrote {results}" in done.stdout and f"wrote {out}" in done.stdout
    assert json.loads(out.read_text())["config"]["model"] == "vit_ti16"
    written = results.read_text()
    assert written.startswith("# bench_vit.py\n") and "--results " in written and "- machine: " in written
    assert "vit_ti16 infer img 32 batch 2 fp32" in written
    # --json is replaced only with --force, refused before anything is timed, in one line
    out.write_text("earlier results\n")
    refused = bench_vit(*TINY_RUN, "--device", "cpu", "--json", str(out))
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == f"bench_vit.py: error: {out}: exists; pass --force to replace it\n"
    assert out.read_text() == "earlier results\n"


def test_bench_vit_user_errors_are_one_line():
    done = bench_vit("--model", "vit_b61", "--device", "cpu")
    assert done.returncode == 2 and done.stderr == (
        "bench_vit.py: error: unknown model 'vit_b61'; did you mean vit_b16, vit_b8, vit_s16?\n"
    )


@pytest.mark.parametrize(
    "peer, missing, expected",
    [("hf", "transformers", "--compare hf needs the transformers"), ("onnx", "onnxruntime", "--compare onnx needs")],
)
def test_bench_vit_names_a_missing_peer_and_its_pip_line(
    bench_vit_module, monkeypatch, capsys, peer, missing, expected
):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    assert bench_vit_module.main(["--model", "vit_ti16", "--compare", peer]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bench_vit.py: error: {expected}") and "pip install 'vitkit[" in err and err.count("\n") == 1


def test_bench_vit_goes_on_without_timm(bench_vit_module, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else find_spec(name, *a))
    assert bench_vit_module.peers_here(["hf", "timm", "hf"]) == ("hf",)
    assert "timm is not importable (pip install timm): timed without it" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- speed_targets.py
def test_peer_switches_are_the_documented_ones():
    torch.manual_seed(0)
    model = create_model("vit_ti16", img_size=32, depth=2, num_classes=5).eval()
    nn.init.normal_(model.head.weight, std=0.02)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        int8 = peer_switch(model, "int8", "none")
        assert not any(type(m) is nn.Linear for m in int8.modules())  # every Linear quantised
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the peer itself left as it was
        torch.testing.assert_close(int8(x), want, atol=0.05, rtol=0)
        bf16 = peer_switch(model, "bf16", "none")
        got = bf16(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0)
        torch.testing.assert_close(peer_switch(model, "fp32", "none")(x), want)


def test_precision_comparison_times_each_precision_against_its_own_peak(script):
    args = argparse.Namespace(compile="none", repeats=3, max_repeats=3, warmup=0, target=0.02)
    text, targets, doc = script.precision_comparison(
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
    executed = {True: vit_flops(config, first_token=True)["total"], False: vit_flops(config)["total"]}
    assert executed[True] < executed[False]  # vitkit's switch runs its last block for the class token alone
    for name, row in doc["rows"].items():
        p, impl = name.split(" ", 1)
        # each row against the peak of its own precision timed in the same round, with the FLOPs that implementation
        # executes (vitkit's switch: its class-token block; its plain model under the peers' switch: every token),
        # then the median over rounds
        probe_s = doc["times_s"][f"{p} matmul peak"]
        probe_ops = doc["peaks_g_per_s"][p] * 1e9 * statistics.median(probe_s)
        flops = executed[impl == "vitkit"]
        shares = [2 * flops / t / (probe_ops / s) for t, s in zip(doc["times_s"][name], probe_s)]
        assert len(shares) == 3 and row["utilisation"] == pytest.approx(statistics.median(shares), rel=1e-9), name
        assert (row["ratio"] is None) == (impl == "vitkit"), name
    assert [t[0].split(":")[0] for t in targets] == ["batch 2 fp32"] * 3 + ["batch 2 int8"] * 2
    assert targets[2][0] == "batch 2 fp32: vitkit under the peers' switch / transformers" and targets[2][2] is None
    assert "int8 matmul peak" not in doc["rows"] and "fp32 transformers" in text


def test_precision_comparison_without_an_fp32_row_checks_against_the_fp32_model(script):
    args = argparse.Namespace(compile="none", repeats=1, max_repeats=1, warmup=0, target=0.02)
    _, targets, doc = script.precision_comparison(args, 1, ["int8"], {}, "vit_ti16", img_size=32, depth=1)
    assert set(doc["rows"]) == {"int8 vitkit", "int8 transformers"} and set(doc["peaks_g_per_s"]) == {"int8"}
    assert len(targets) == 2


def test_gpu_bench_takes_each_gpus_own_datasheet_peak_and_gives_each_row_its_switches(monkeypatch):
    """The datasheet peaks that the GPU scripts state MFU against: an H100 PCIe is not taken for an SXM part (756
    against 989.4 dense bf16 TFLOP/s), an unknown GPU gets no invented peak; and bench_gpu.py's rows: batch 1 is
    compiled with CUDA graphs, large batches and training with mode "default"."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCHMARKS / "bench_gpu.py")
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
