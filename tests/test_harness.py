"""benchmarks/harness: the benchmark scripts' harness (run_bench, the matmul peak, paired ratios, result files).

Tiny models and stubbed clocks: nothing here times anything against a threshold. benchmarks/ is on sys.path
(conftest.py), so ``harness`` imports as the scripts import it.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import statistics

import numpy as np
import pytest
import torch
from harness import (
    BenchConfig,
    MatmulProbe,
    Measurement,
    build_model,
    find_max_batch,
    load_warnings,
    make_step,
    paired_ratio_stats,
    paired_ratios,
    parse_bytes,
    peer_step,
    probe_kernels,
    probe_size,
    recorded,
    run_bench,
    settled,
    vitkit_step,
    write_results,
)
from harness import peak as peak_mod
from harness import results as results_mod
from harness import timing as timing_mod

from vitkit import VisionTransformer
from vitkit.accel.cpu import can_pack_linears
from vitkit.accel.first_token import FirstTokenViT
from vitkit.accel.inference import InferenceModel
from vitkit.accel.int8 import int8_kernel
from vitkit.models import ViTConfig
from vitkit.models.flops import vit_flops

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8)  # at img_size 32
CPU = torch.device("cpu")


def tiny_bench(**kw) -> BenchConfig:
    return BenchConfig(
        **{"model": "vit_ti16", "img_size": 32, "batch_size": 2, "device": "cpu", "overrides": TINY, **kw}
    )


# ------------------------------------------------------------------------------------------------- run_bench
def test_bench_end_to_end_with_hf_and_onnx_writes_json(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    cfg = tiny_bench(repeats=2, warmup=1, compare=("hf", "onnx"), max_batch=True, memory_budget="1GB")
    report = run_bench(cfg)
    doc = json.loads(report.save_json(tmp_path / "bench.json").read_text())
    config = ViTConfig(img_size=32, **TINY)
    assert doc["gflops_per_image"] * 1e9 == pytest.approx(vit_flops(config)["total"])
    # vitkit's rows run optimize_for_inference, whose last block computes the class token alone
    assert doc["executed_gflops_per_image"] * 1e9 == pytest.approx(vit_flops(config, first_token=True)["total"])
    assert [m["name"] for m in doc["measurements"]] == ["vitkit", "hf", "onnx"]
    probe_s = doc["matmul_peak_s"]
    probe_flops = doc["matmul_peak_gflops"] * 1e9 * statistics.median(probe_s)
    for m in doc["measurements"]:
        assert len(m["step_s"]) == 2 and m["images_per_s_min"] <= m["images_per_s"] <= m["images_per_s_max"]
        # each round's rate over the peak timed in that round, then the median
        shares = [doc["gflops_per_step"] * 1e9 / t / (probe_flops / p) for t, p in zip(m["step_s"], probe_s)]
        assert m["utilisation"] == pytest.approx(statistics.median(shares))
        ratio = doc["executed_gflops_per_image"] / doc["gflops_per_image"] if m["name"] == "vitkit" else 1.0
        assert m["hardware_utilisation"] == pytest.approx(m["utilisation"] * ratio)
        assert m["parity_max_abs"] <= 1e-4  # vitkit's: its switch against the model as built
    assert all(m["resident_bytes"] > 0 for m in doc["measurements"][:2])
    assert set(doc["ratios"]) == {"hf", "onnx"} and doc["matmul_peak_gflops"] > 0
    assert doc["max_batch"]["budget_bytes"] == 2**30 and "estimate" in doc["max_batch"]["method"]
    assert "vitkit / hf" in report.table()


def test_bench_train_mode_runs_adamw_steps():
    report = run_bench(tiny_bench(batch_size=4, repeats=1, warmup=1, mode="train", dtype="bf16-autocast"))
    (m,) = report.measurements
    assert report.gflops_per_step == pytest.approx(3 * 4 * report.gflops_per_image)
    assert m.resident_bytes == 4 * sum(p.numel() * 4 for p in VisionTransformer(img_size=32, **TINY).parameters())


def test_vitkits_steps_run_its_documented_switches():
    """Inference through optimize_for_inference, a training step through optimize_for_training (the model patched
    in place); a peer's step runs the model as it is given."""
    x, y = torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    cfg = tiny_bench()
    model = build_model(cfg, CPU)
    plain = make_step(model, cfg, x, y, CPU)
    fast = vitkit_step(model, cfg, x, y, CPU)
    assert isinstance(fast.__closure__[0].cell_contents, InferenceModel)  # type: ignore[index]
    torch.testing.assert_close(fast(), plain(), atol=1e-5, rtol=1e-5)
    train = dataclasses.replace(cfg, mode="train")
    model = build_model(train, CPU)
    assert type(model) is VisionTransformer
    loss = vitkit_step(model, train, x, y, CPU)()
    assert type(model) is FirstTokenViT and loss.isfinite()
    assert model.state_dict().keys() == build_model(train, CPU).state_dict().keys()


def test_int8_gives_each_library_its_own_int8_switch():
    """vitkit's rows through optimize_for_inference(model, "int8"), a peer's through torch's quantize_dynamic; every
    switched output near the fp32 model's (and not equal to it: the layers run in int8), before anything is timed."""
    pytest.importorskip("transformers")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    from vitkit.accel.int8 import Int8Linear

    cfg = tiny_bench(dtype="int8", compare=("hf",), repeats=1, warmup=0)
    report = run_bench(cfg)
    assert [m.name for m in report.measurements] == ["vitkit", "hf"]
    assert all(0 < m.parity_max_abs <= 0.1 for m in report.measurements)  # against the fp32 model
    assert report.matmul_peak_kernel in ("torch._int_mm", "oneDNN int8, packed")
    assert all(m.resident_bytes is None for m in report.measurements)  # packed int8 weights: not miscounted

    x, y = torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    fast = inspect.getclosurevars(vitkit_step(build_model(cfg, CPU), cfg, x, y, CPU)).nonlocals["fast"]
    assert any(isinstance(m, (Int8Linear, DynamicInt8Linear)) for m in fast.modules())  # by the CPU: quantize_int8
    peer = inspect.getclosurevars(peer_step(build_model(cfg, CPU), cfg, x, y, CPU)).nonlocals["forward"]
    assert any(isinstance(m, DynamicInt8Linear) for m in peer.modules())


def test_bench_refuses_to_time_a_peer_that_disagrees(monkeypatch):
    pytest.importorskip("transformers")
    from vitkit.checkpoint import hf as hf_mod

    real = hf_mod.to_hf_model

    def perturbed(model):
        hf = real(model)
        with torch.no_grad():
            hf.classifier.bias += 1e-2
        return hf

    monkeypatch.setattr(hf_mod, "to_hf_model", perturbed)
    with pytest.raises(ValueError, match="hf outputs differ"):
        run_bench(tiny_bench(compare=("hf",)))


def test_bench_times_an_extra_peer_built_from_vitkits_model():
    def explicit_twin(model: torch.nn.Module) -> torch.nn.Module:  # same weights, attention written out
        twin = VisionTransformer(dataclasses.replace(model.config, attn_impl="explicit"))
        twin.load_state_dict(model.state_dict())
        return twin

    report = run_bench(tiny_bench(repeats=2, warmup=0), extra_peers={"explicit": explicit_twin})
    assert [m.name for m in report.measurements] == ["vitkit", "explicit"]
    assert report.measurements[1].parity_max_abs <= 1e-5 and set(report.ratios) == {"explicit"}


def test_bench_reports_the_allocator_setting():
    from vitkit.accel.training import tune_cpu_allocator

    tune_cpu_allocator()
    assert run_bench(tiny_bench(batch_size=1, repeats=1, warmup=0)).environment["cpu_allocator"].startswith("freed")


def test_bench_config_is_a_checked_frozen_value():
    with pytest.raises(ValueError, match="dtype='fp16'"):
        BenchConfig(dtype="fp16")
    with pytest.raises(ValueError, match="compare='mxnet'"):
        BenchConfig(compare=("mxnet",))
    assert BenchConfig(compare=("timm",)).compare == ("timm",)  # timm: a peer of the scripts, not of vitkit
    bench = BenchConfig(model="vit_ti16", compare=["hf"], device="cpu")  # type: ignore[arg-type]
    assert bench.compare == ("hf",)  # a list given is kept as the declared tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        bench.batch_size = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown model 'vit_b61'; did you mean vit_b16"):
        build_model(BenchConfig(model="vit_b61"), CPU)
    with pytest.raises(ValueError, match="int8 is measured for inference on the CPU only"):
        BenchConfig(dtype="int8", mode="train", device="cpu")


def test_parse_bytes():
    assert parse_bytes("8GB") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_find_max_batch_bisects_to_the_threshold():
    tried = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= 37

    assert find_max_batch(fits) == 37
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling, then bisection between 32 and 64
    assert find_max_batch(lambda b: False) == 0
    assert find_max_batch(lambda b: True, limit=100) == 100


def test_paired_ratios_pick_each_best_row_and_cancel_load_changes_between_repeats():
    def row(name, step_s):
        rates = [2 / t for t in step_s]
        return Measurement(name, statistics.median(rates), min(rates), max(rates), step_s, 0.5, 0.5)

    rows = [
        row("vitkit/none", [1.0, 2.0, 1.1]),
        row("vitkit/default", [0.5, 1.0, 0.6]),  # best vitkit row; repeat 2 ran on a loaded machine
        row("hf/none", [0.6, 1.3, 0.6]),
        row("hf/default", [0.9, 1.9, 0.9]),
    ]
    # per repeat 0.6/0.5, 1.3/1.0, 0.6/0.6 -> median 1.2; a ratio of medians (0.6/0.6) would say 1.0
    assert paired_ratios(rows) == {"hf": pytest.approx(1.2)}


# --------------------------------------------------------------------------------------------- the matmul peak
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_probe_kernel_computes_the_product_it_counts(dtype):
    kernels = probe_kernels(dtype, CPU, 256)
    names = [k.kernel for k in kernels]
    assert names[0] == ("torch._int_mm" if dtype == torch.int8 else "torch.matmul")
    # and vitkit's packed-weight layer's kernel where it runs: not without oneDNN, nor in int8 without VNNI, nor in
    # bf16 where oneDNN multiplies none (AVX2-only CPUs)
    packed = int8_kernel() == "onednn" if dtype == torch.int8 else can_pack_linears(CPU, dtype)
    assert len(names) == (2 if packed else 1)
    for probe in kernels:
        a, b = probe.a, probe.b
        assert a.shape == b.shape == (256, 256) and a.dtype == b.dtype == dtype
        got = probe()
        if dtype == torch.int8:  # int8 x int8 summed exactly (|sums| < 2^24, exact in float32 too)
            assert torch.equal(got.long(), a.long() @ b.long()), probe.kernel
        else:
            torch.testing.assert_close(got.double(), a.double() @ b.double(), atol=0.5, rtol=0.02)


def test_the_probe_size_doubles_until_a_product_takes_a_tenth_of_a_second(monkeypatch):
    seen = []

    def kernel(dtype, device, n):
        seen.append(n)
        return n

    monkeypatch.setattr(peak_mod, "torch_kernel", kernel)
    monkeypatch.setattr(peak_mod, "time_call", lambda n, device: {256: 0.05, 512: 0.05, 1024: 0.5}[n])  # 1024 slow
    assert probe_size(torch.float32, CPU) == 1024 and seen == [256, 512, 1024]
    seen.clear()
    assert probe_size(torch.float32, CPU, max_n=512) == 512 and seen == [256]


def test_the_probe_is_the_fastest_kernel(monkeypatch):
    seconds = {"torch.matmul": 2.0, "oneDNN, packed": 1.0}  # the first over 0.1 s: the size stays at 256
    fake = [MatmulProbe(name, torch.zeros(1), torch.zeros(1), lambda: torch.zeros(1)) for name in seconds]
    monkeypatch.setattr(peak_mod, "probe_kernels", lambda dtype, device, n: fake)
    monkeypatch.setattr(peak_mod, "time_call", lambda fn, device: seconds[fn.kernel])
    probe, flops = peak_mod.matmul_probe(torch.float32, CPU)
    assert probe is fake[1] and flops == 2 * 256**3
    seconds["torch.matmul"] = 0.5
    assert peak_mod.matmul_probe(torch.float32, CPU)[0] is fake[0]
    assert peak_mod.measure_matmul_peak(torch.float32, CPU, seconds=0)[1] == "torch.matmul"


def test_the_probe_kernels_take_turns_and_the_fastest_call_wins(monkeypatch):
    # a passing slowdown (the machine busy for a moment) hits oneDNN's first timed call only
    seconds = {"torch.matmul": iter([1.0, 1.0, 1.0]), "oneDNN, packed": iter([3.0, 0.9, 0.95])}
    fake = [MatmulProbe(name, torch.zeros(1), torch.zeros(1), lambda: torch.zeros(1)) for name in seconds]
    timed = []
    monkeypatch.setattr(peak_mod, "probe_kernels", lambda dtype, device, n: fake)
    monkeypatch.setattr(peak_mod, "probe_size", lambda dtype, device, max_n: 256)
    monkeypatch.setattr(peak_mod, "time_call", lambda fn, device: timed.append(fn.kernel) or next(seconds[fn.kernel]))
    assert peak_mod.matmul_probe(torch.float32, CPU)[0] is fake[1]
    assert timed == ["torch.matmul", "oneDNN, packed"] * 3


def test_the_probe_repeats_its_product_to_last_as_long_as_the_step(monkeypatch):
    calls = []
    fake = MatmulProbe("torch.matmul", torch.zeros(256, 256), torch.zeros(256, 256), lambda: calls.append(1))
    monkeypatch.setattr(peak_mod, "probe_kernels", lambda dtype, device, n: [fake])
    monkeypatch.setattr(peak_mod, "probe_size", lambda dtype, device, max_n: 256)
    monkeypatch.setattr(peak_mod, "time_call", lambda fn, device: 0.2)  # one product: 0.2 s
    probe, flops = peak_mod.matmul_probe(torch.float32, CPU, seconds=1.0)
    assert probe.repeats == 5 and flops == 5 * 2 * 256**3 and probe.size == "256x256 x 5"
    calls.clear()
    probe()
    assert len(calls) == 5  # the product itself, five times over
    probe, flops = peak_mod.matmul_probe(torch.float32, CPU, seconds=0.05)  # shorter than once
    assert probe is fake and flops == 2 * 256**3


def test_the_share_of_the_peak_pairs_each_round_with_its_own_peak():
    # round 3 ran slower and so did its peak: paired, every round reaches the peak; medians taken apart say 75%
    share = peak_mod.paired_utilisation(100.0, [1.0, 3.0, 2.0], 100.0, [1.0, 3.0, 1.5])
    assert share == pytest.approx(1.0)
    assert (100 / statistics.median([1.0, 3.0, 2.0])) / (100 / statistics.median([1.0, 3.0, 1.5])) == 0.75
    assert peak_mod.paired_utilisation(50.0, [1.0, 1.0], 100.0, [0.5, 1.0]) == pytest.approx((0.25 + 0.5) / 2)


# ------------------------------------------------------------------------------ benchmark statistics (synthetic)
def test_paired_ratio_stats_median_interval_and_quartiles():
    ours = [1.0] * 9
    peer = [1.10, 1.12, 1.08, 1.11, 1.09, 1.10, 1.13, 1.07, 1.10]
    st = paired_ratio_stats(peer, ours)
    assert st.n == 9 and st.median == pytest.approx(1.10)
    assert st.low <= st.median <= st.high and st.low >= 1.07 and st.high <= 1.13
    assert st.q1 == pytest.approx(1.09) and st.q3 == pytest.approx(1.11)
    assert not st.inconclusive and "1.100x (95% CI" in str(st)
    assert paired_ratio_stats(peer, ours) == st  # seeded: the same timings give the same interval


def test_paired_ratios_cancel_a_load_change_that_hits_both_sides():
    load = [1.0, 1.3, 0.9, 1.5, 1.0, 1.2, 1.4]  # each round's slowdown, shared by both calls of the round
    st = paired_ratio_stats([1.2 * f for f in load], [1.0 * f for f in load])
    assert st.median == pytest.approx(1.2) and st.half_width == pytest.approx(0.0, abs=1e-12)


def test_a_spread_wider_than_the_effect_is_inconclusive_and_not_settled():
    rng = np.random.default_rng(0)
    peer = list(1.02 * (1 + 0.3 * rng.standard_normal(12)).clip(0.5))  # +-30% noise over a 2% effect
    st = paired_ratio_stats(peer, [1.0] * 12)
    assert st.inconclusive and st.half_width > abs(st.median - 1)
    assert not settled([st], target=0.02)
    tight = paired_ratio_stats([1.5 + 0.001 * i for i in range(6)], [1.0] * 6)
    assert settled([tight], target=0.02) and not settled([tight], target=0.02, min_rounds=7)


def test_time_alternating_stops_when_settled_or_at_the_cap(monkeypatch):
    clock = iter(range(10**6))
    monkeypatch.setattr(timing_mod, "time_call", lambda step, device: float(next(clock) % 3 + 1))
    steps = {"a": lambda: None, "b": lambda: None}
    seen = []

    def until(times):
        seen.append(len(times["a"]))
        return len(times["a"]) >= 4

    times = timing_mod.time_alternating(steps, 2, 1, CPU, settle_s=0, until=until, max_repeats=10)
    assert len(times["a"]) == len(times["b"]) == 4 and seen == [2, 3, 4]
    never = lambda t: False  # noqa: E731
    capped = timing_mod.time_alternating(steps, 2, 0, CPU, settle_s=0, until=never, max_repeats=5)
    assert len(capped["a"]) == 5


def test_load_warnings():
    assert load_warnings(0.3, 2.1, threads=2, cores=2) == []  # quiet before, our own two threads after
    before, after = load_warnings(1.5, 3.6, threads=2, cores=2)
    assert "before the run" in before and "after the run" in after
    assert load_warnings(None, None, threads=2, cores=2) == []  # no load average on this system


# ------------------------------------------------------------------------------------------------ result files
def test_a_result_file_holds_the_command_the_machine_the_date_and_the_printed_text(tmp_path, monkeypatch):
    monkeypatch.setattr(results_mod, "machine", lambda: "a CPU (avx2), 2 cores; torch 2")
    command = results_mod.command_line(results_mod.REPO / "benchmarks" / "bench_vit.py", ["--model", "vit b"])
    assert command == "python benchmarks/bench_vit.py --model 'vit b'"
    when = datetime.datetime(2026, 11, 27, 9, 5, tzinfo=datetime.timezone.utc)
    text = results_mod.results_text("a | b\n1 | 2\n", command, when=when)
    assert text == (
        "# bench_vit.py\n\n"
        "- command: `python benchmarks/bench_vit.py --model 'vit b'`\n"
        "- machine: a CPU (avx2), 2 cores; torch 2\n"
        "- date: 2026-11-27 09:05 UTC\n\n"
        "```text\na | b\n1 | 2\n```\n"
    )
    path = write_results(tmp_path / "sub" / "r.md", "x", command)
    assert path.read_text().startswith("# bench_vit.py\n") and "```text\nx\n```" in path.read_text()


def test_recorded_prints_as_it_goes_and_writes_what_was_printed(tmp_path, capsys):
    with recorded(tmp_path / "r.md", "python benchmarks/x.py"):
        print("first line")
        print("second line")
    out = capsys.readouterr().out
    assert out == f"first line\nsecond line\nwrote {tmp_path / 'r.md'}\n"
    written = (tmp_path / "r.md").read_text()
    assert "- command: `python benchmarks/x.py`" in written and "```text\nfirst line\nsecond line\n```" in written
    assert "- machine: " in written and "torch " in written
    with pytest.raises(RuntimeError), recorded(tmp_path / "failed.md", "python benchmarks/x.py"):
        raise RuntimeError("a run that fails writes no result")
    assert not (tmp_path / "failed.md").exists()
    with recorded(None, "python benchmarks/x.py"):  # no path: nothing kept
        print("only printed")
    assert capsys.readouterr().out == "only printed\n"
