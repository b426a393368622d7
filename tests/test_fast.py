"""Speed tooling: analytic FLOPs, the benchmark harness, the fast inference path and ONNX export.

Nothing here times anything against a threshold: speed is measured by `vitkit bench` / benchmarks/bench_vit.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitkit import VisionTransformer, optimize_for_inference
from vitkit import fast as fast_mod
from vitkit.bench import (
    BenchConfig,
    MatmulProbe,
    Measurement,
    find_max_batch,
    harness,
    model_flops,
    parse_bytes,
    probe_kernels,
    probe_size,
    run_bench,
    vit_flops,
)
from vitkit.bench.harness import paired_ratios
from vitkit.bench.memory import _proc_status_kib
from vitkit.cli import main
from vitkit.errors import UserError
from vitkit.fast import _has_vnni_layer
from vitkit.models import ResNet, ViTConfig

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8, img_size=32)


def tiny_vit(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, **kw}).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero head would make every output comparison trivial
    return model


def counted_flops(model: torch.nn.Module, img_size: tuple[int, int]) -> int:
    """FlopCounterMode's count for one image, on the meta device (shapes only)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, *img_size, device="meta"))
    return counter.get_total_flops()


# --------------------------------------------------------------------------------------------------------- FLOPs
def test_vit_b16_flops_golden():
    # 12 x (qkv 697.0M + attention 119.2M + proj 232.3M + MLP 1859.2M) + patch 231.2M + head 1.5M
    assert vit_flops(ViTConfig())["total"] == 35_127_656_448


@pytest.mark.parametrize(
    "overrides, img_size",
    [
        (dict(), (32, 32)),
        (dict(classifier="gap", representation_size=24), (32, 32)),
        (dict(img_size=(48, 32), patch_size=(8, 4), num_classes=0), (48, 32)),
        (dict(resnet_layers=(1,), patch_size=1), (32, 32)),  # hybrid: ResNet stem convs counted too
    ],
)
def test_vit_flops_match_flop_counter(overrides, img_size):
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, **overrides})
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        feats = model.forward_features(torch.empty(1, 3, *img_size, device="meta"), attn_impl="explicit")
        model.forward_head(feats)
    want = counter.get_total_flops()
    assert vit_flops(model.config, img_size)["total"] == want


def test_vit_logits_path_flops_golden_and_match_flop_counter():
    # the last block keeps keys and values of all 197 tokens; query, projection and MLP of the class token only
    assert vit_flops(ViTConfig(), logits_path=True)["total"] == 32_696_930_304
    assert vit_flops(ViTConfig(classifier="gap"), logits_path=True) == vit_flops(ViTConfig(classifier="gap"))
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, "representation_size": 24})
    assert model_flops(model, 32, logits_path=True) == counted_flops(model, (32, 32))  # model() on the fused path


@pytest.mark.parametrize(
    "overrides", [dict(token_merge=3), dict(token_merge=40), dict(classifier="first", token_merge=2)]
)
def test_vit_logits_path_flops_with_token_merging_match_flop_counter(overrides):
    # each block's attention runs on the tokens it receives, its MLP and every later block on r fewer
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, **overrides})
    assert model_flops(model, 32, logits_path=True) == counted_flops(model, (32, 32))
    assert vit_flops(model.config, logits_path=True)["merge"] > 0
    assert vit_flops(model.config)["merge"] == 0  # forward_features merges nothing


def test_resnet_flops_match_flop_counter():
    with torch.device("meta"):
        model = ResNet(layers=(1, 1), num_classes=7, img_size=64)
    assert model_flops(model, 64) == counted_flops(model, (64, 64))


# ---------------------------------------------------------------------------------------------------- harness
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_probe_kernel_computes_the_product_it_counts(dtype):
    kernels = probe_kernels(dtype, torch.device("cpu"), 256)
    names = [k.kernel for k in kernels]
    assert names[0] == ("torch._int_mm" if dtype == torch.int8 else "torch.matmul")
    # and vitkit's packed-weight layer's kernel where it runs: not without oneDNN, nor in int8 without VNNI, nor in
    # bf16 where oneDNN multiplies none (AVX2-only CPUs)
    packed = _has_vnni_layer() if dtype == torch.int8 else fast_mod.can_pack_linears(torch.device("cpu"), dtype)
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

    monkeypatch.setattr(harness, "_torch_kernel", kernel)
    monkeypatch.setattr(harness, "_time", lambda n, device: {256: 0.05, 512: 0.05, 1024: 0.5}[n])  # 1024 is slow
    assert probe_size(torch.float32, torch.device("cpu")) == 1024 and seen == [256, 512, 1024]
    seen.clear()
    assert probe_size(torch.float32, torch.device("cpu"), max_n=512) == 512 and seen == [256]


def test_the_probe_is_the_fastest_kernel(monkeypatch):
    seconds = {"torch.matmul": 2.0, "oneDNN, packed": 1.0}  # the first over 0.1 s: the size stays at 256
    fake = [MatmulProbe(name, torch.zeros(1), torch.zeros(1), lambda: torch.zeros(1)) for name in seconds]
    monkeypatch.setattr(harness, "probe_kernels", lambda dtype, device, n: fake)
    monkeypatch.setattr(harness, "_time", lambda fn, device: seconds[fn.kernel])
    probe, flops = harness.matmul_probe(torch.float32, torch.device("cpu"))
    assert probe is fake[1] and flops == 2 * 256**3
    seconds["torch.matmul"] = 0.5
    assert harness.matmul_probe(torch.float32, torch.device("cpu"))[0] is fake[0]
    assert harness.measure_matmul_peak(torch.float32, torch.device("cpu"), seconds=0)[1] == "torch.matmul"


def test_the_probe_kernels_take_turns_and_the_fastest_call_wins(monkeypatch):
    # a passing slowdown (the machine busy for a moment) hits oneDNN's first timed call only
    seconds = {"torch.matmul": iter([1.0, 1.0, 1.0]), "oneDNN, packed": iter([3.0, 0.9, 0.95])}
    fake = [MatmulProbe(name, torch.zeros(1), torch.zeros(1), lambda: torch.zeros(1)) for name in seconds]
    timed = []
    monkeypatch.setattr(harness, "probe_kernels", lambda dtype, device, n: fake)
    monkeypatch.setattr(harness, "probe_size", lambda dtype, device, max_n: 256)
    monkeypatch.setattr(harness, "_time", lambda fn, device: timed.append(fn.kernel) or next(seconds[fn.kernel]))
    assert harness.matmul_probe(torch.float32, torch.device("cpu"))[0] is fake[1]
    assert timed == ["torch.matmul", "oneDNN, packed"] * 3


def test_the_probe_repeats_its_product_to_last_as_long_as_the_step(monkeypatch):
    calls = []
    fake = MatmulProbe("torch.matmul", torch.zeros(256, 256), torch.zeros(256, 256), lambda: calls.append(1))
    monkeypatch.setattr(harness, "probe_kernels", lambda dtype, device, n: [fake])
    monkeypatch.setattr(harness, "probe_size", lambda dtype, device, max_n: 256)
    monkeypatch.setattr(harness, "_time", lambda fn, device: 0.2)  # one product: 0.2 s
    probe, flops = harness.matmul_probe(torch.float32, torch.device("cpu"), seconds=1.0)
    assert probe.repeats == 5 and flops == 5 * 2 * 256**3 and probe.size == "256x256 x 5"
    calls.clear()
    probe()
    assert len(calls) == 5  # the product itself, five times over
    probe, flops = harness.matmul_probe(torch.float32, torch.device("cpu"), seconds=0.05)  # shorter than once
    assert probe is fake and flops == 2 * 256**3


def test_the_share_of_the_peak_pairs_each_round_with_its_own_peak():
    # round 3 ran slower and so did its peak: paired, every round reaches the peak; medians taken apart say 75%
    share = harness.paired_utilisation(100.0, [1.0, 3.0, 2.0], 100.0, [1.0, 3.0, 1.5])
    assert share == pytest.approx(1.0)
    assert (100 / statistics.median([1.0, 3.0, 2.0])) / (100 / statistics.median([1.0, 3.0, 1.5])) == 0.75
    assert harness.paired_utilisation(50.0, [1.0, 1.0], 100.0, [0.5, 1.0]) == pytest.approx((0.25 + 0.5) / 2)


def test_parse_bytes():
    assert parse_bytes("8GB") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_bench_end_to_end_with_hf_and_onnx_writes_json(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    tiny = {k: v for k, v in TINY.items() if k != "img_size"}
    cfg = BenchConfig(
        model="vit_ti16", img_size=32, batch_size=2, repeats=2, warmup=1, compare=("hf", "onnx"), max_batch=True,
        memory_budget="1GB", overrides=tiny, device="cpu",
    )  # fmt: skip
    report = run_bench(cfg)
    doc = json.loads(report.save_json(tmp_path / "bench.json").read_text())
    assert doc["gflops_per_image"] * 1e9 == pytest.approx(vit_flops(ViTConfig(**TINY))["total"])
    assert [m["name"] for m in doc["measurements"]] == ["vitkit", "hf", "onnx"]
    probe_s = doc["matmul_peak_s"]
    probe_flops = doc["matmul_peak_gflops"] * 1e9 * statistics.median(probe_s)
    for m in doc["measurements"]:
        assert len(m["step_s"]) == 2 and m["images_per_s_min"] <= m["images_per_s"] <= m["images_per_s_max"]
        # each round's rate over the peak timed in that round, then the median
        shares = [doc["gflops_per_step"] * 1e9 / t / (probe_flops / p) for t, p in zip(m["step_s"], probe_s)]
        assert m["utilisation"] == pytest.approx(statistics.median(shares))
        ratio = doc["executed_gflops_per_image"] / doc["gflops_per_image"] if m["name"] != "hf" else 1.0
        assert m["hardware_utilisation"] == pytest.approx(m["utilisation"] * ratio)
    assert all(m["resident_bytes"] > 0 for m in doc["measurements"][:2])
    assert all(m["parity_max_abs"] <= 1e-4 for m in doc["measurements"][1:])
    assert set(doc["ratios"]) == {"hf", "onnx"} and doc["matmul_peak_gflops"] > 0
    assert doc["max_batch"]["budget_bytes"] == 2**30 and "estimate" in doc["max_batch"]["method"]
    assert "vitkit / hf" in report.table()


def test_bench_train_mode_runs_adamw_steps():
    tiny = {k: v for k, v in TINY.items() if k != "img_size"}
    cfg = BenchConfig(model="vit_ti16", img_size=32, batch_size=4, repeats=1, warmup=1, mode="train",
                      dtype="bf16-autocast", overrides=tiny, device="cpu")  # fmt: skip
    report = run_bench(cfg)
    (m,) = report.measurements
    assert report.gflops_per_step == pytest.approx(3 * 4 * report.gflops_per_image)
    assert m.resident_bytes == 4 * sum(p.numel() * 4 for p in VisionTransformer(**TINY).parameters())


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
    tiny = {k: v for k, v in TINY.items() if k != "img_size"}
    cfg = BenchConfig(model="vit_ti16", img_size=32, batch_size=2, compare=("hf",), overrides=tiny, device="cpu")
    with pytest.raises(ValueError, match="hf outputs differ"):
        run_bench(cfg)


def test_bench_config_rejects_unknown_values():
    with pytest.raises(ValueError, match="dtype='fp16'"):
        BenchConfig(dtype="fp16")
    with pytest.raises(ValueError, match="compare='timm'"):
        BenchConfig(compare=("timm",))  # timm is not a dependency: benchmarks/bench_vit.py adds it as an extra peer


def test_bench_times_an_extra_peer_built_from_vitkits_model():
    def explicit_twin(model: torch.nn.Module) -> torch.nn.Module:  # same weights, attention written out
        twin = VisionTransformer(dataclasses.replace(model.config, attn_impl="explicit"))
        twin.load_state_dict(model.state_dict())
        return twin

    tiny = {k: v for k, v in TINY.items() if k != "img_size"}
    cfg = BenchConfig(model="vit_ti16", img_size=32, batch_size=2, repeats=2, warmup=0, overrides=tiny, device="cpu")
    report = run_bench(cfg, extra_peers={"explicit": explicit_twin})
    assert [m.name for m in report.measurements] == ["vitkit", "explicit"]
    assert report.measurements[1].parity_max_abs <= 1e-5 and set(report.ratios) == {"explicit"}


def test_cli_bench_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", "vit_ti16", "--img-size", "32", "--batch-size", "2", "--repeats", "1",
               "--warmup", "0", "--device", "cpu", "--json", str(out)])  # fmt: skip
    assert rc == 0
    assert "vit_ti16 infer img 32 batch 2 fp32" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["model"] == "vit_ti16"


# ------------------------------------------------------------------------------------------------- fast path
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_tune_cpu_allocator_keeps_freed_tensor_memory_for_reuse():
    assert fast_mod.tune_cpu_allocator() and fast_mod.tune_cpu_allocator()  # applied, and idempotent
    n = 64 * 2**20 // 4  # 64 MiB: above glibc's default mmap threshold (at most 32 MiB)
    grew = []  # the resident set's growth while each tensor lives: touched, then freed
    for _ in range(8):
        before = _proc_status_kib("VmRSS")
        t = torch.ones(n)
        grew.append(_proc_status_kib("VmRSS") - before)
        del t
    # with the default allocator each one is a fresh mapping, +64 MiB resident every time; kept, the same size is
    # served from the freed pages once the heap has settled (the first rounds may leave the freed block split by
    # small allocations made meanwhile)
    assert all(kib < 16 * 1024 for kib in grew[-3:]), grew
    tiny = {k: v for k, v in TINY.items() if k != "img_size"}
    cfg = BenchConfig(model="vit_ti16", img_size=32, batch_size=1, repeats=1, warmup=0, overrides=tiny, device="cpu")
    assert run_bench(cfg).environment["cpu_allocator"].startswith("freed memory kept")  # reported with the figures


def test_optimize_for_inference_fp32_matches_eager(device):
    model = tiny_vit(attn_impl="explicit").to(device)
    x = torch.randn(3, 3, 32, 32).to(device)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, dtype="fp32", compile="none")
    assert model.config.attn_impl == "explicit" and fast.call_kwargs == {"attn_impl": "auto"} and not model.training
    assert not any(p.requires_grad for p in fast.parameters())
    got = fast(x)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_optimize_for_inference_bf16_close_to_fp32(monkeypatch, device):
    monkeypatch.setattr(fast_mod, "bf16_is_fast", lambda device: True)
    model = tiny_vit().to(device)
    x = torch.randn(3, 3, 32, 32).to(device)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, dtype=torch.bfloat16, compile=False)
    assert next(fast.parameters()).dtype == torch.bfloat16
    assert fast.call_kwargs == {"attn_impl": "auto"}  # bf16 on a CPU: the written-out attention; on CUDA: SDPA
    got = fast(x)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 5e-2 * max(1.0, float(want.abs().max()))
    with torch.no_grad():  # and it is the function SDPA computes, to bf16's rounding
        fused = model(x.bfloat16(), attn_impl="sdpa").float()
    assert float((got - fused).abs().max()) <= 2e-2 * max(1.0, float(want.abs().max()))


def test_optimize_for_inference_falls_back_to_fp32_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(fast_mod, "bf16_is_fast", lambda device: False)
    model = tiny_vit()
    with pytest.warns(UserWarning, match="keeping fp32"):
        fast = optimize_for_inference(model, dtype="bf16", compile="none")
    assert fast.dtype == torch.float32 and next(fast.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="compile='fastest'"):
        optimize_for_inference(tiny_vit(), dtype="fp32", compile="fastest")


ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@ONEDNN
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.onednn_bf16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_packed_linear_computes_the_linear_layer(dtype, bias, gelu):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias).to(dtype).requires_grad_(False)
    packed = fast_mod.PackedLinear(linear, None if gelu is None else torch.nn.GELU(approximate=gelu))
    x = torch.randn(3, 9, 24, dtype=dtype)
    for inp in (x, x[0], x[:, :2], x.transpose(0, 1)):  # 3-D, 2-D and strided views
        want = inp.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
        if gelu == "none":  # the exact GELU, x Phi(x), from the error function
            want = want * 0.5 * (1 + torch.erf(want / 2**0.5))
        elif gelu == "tanh":  # and its tanh approximation
            want = 0.5 * want * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (want + 0.044715 * want**3)))
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 1e-2}
        torch.testing.assert_close(packed(inp), want.to(dtype), **tol)
    # the packed weight is oneDNN's opaque copy, not saved: the state is the linear layer's bias alone
    assert list(packed.state_dict()) == (["bias"] if bias else []) and packed.bias is linear.bias


@ONEDNN
def test_optimize_for_inference_runs_a_packed_copy_sharing_the_models_tensors():
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    fast = optimize_for_inference(model, "fp32", compile="none")
    # the model keeps its layers; the copy it runs has every nn.Linear packed and no tensor of its own besides
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == linears > 0
    assert sum(isinstance(m, fast_mod.PackedLinear) for m in fast.model.modules()) == linears
    assert not any(type(m) is torch.nn.Linear for m in fast.model.modules())
    for block in fast.model.blocks:  # each MLP's GELU runs in its first layer
        assert block.mlp.fc1.post_op == "gelu" and isinstance(block.mlp.act, torch.nn.Identity)
    assert all(isinstance(block.mlp.act, torch.nn.GELU) for block in model.blocks)
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert {id(t) for t in (*fast.parameters(), *fast.buffers())} <= own
    torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)
    # where torch has no oneDNN, the model itself runs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_mod, "can_pack_linears", lambda device, dtype: False)
        assert optimize_for_inference(model, "fp32", compile="none").model is model


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_an_optimised_model_deep_copies_sharing_only_its_packed_weights(precision):
    """copy.deepcopy of an optimised model (EMA copies, ensembles, frameworks that copy modules): a model of its
    own, computing the same outputs; only the packed oneDNN weights, which cannot be copied and are never written,
    are shared."""
    fast = optimize_for_inference(tiny_vit(), precision, compile="none")
    x = torch.randn(3, 3, 32, 32)
    copied = copy.deepcopy(fast)
    assert type(copied) is type(fast) and copied.model is not fast.model and copied._run is copied.model
    assert (copied.precision, copied.dtype, copied.compile_mode) == (fast.precision, fast.dtype, fast.compile_mode)
    torch.testing.assert_close(copied(x), fast(x), atol=0, rtol=0)
    packed = {id(m.packed_weight) for m in fast.model.modules() if hasattr(m, "packed_weight")}
    assert packed == {id(m.packed_weight) for m in copied.model.modules() if hasattr(m, "packed_weight")}
    if precision != "int8" or fast_mod.int8_kernel() == "onednn":
        assert packed  # where vitkit's packed layers run
    tensors = {id(t) for t in (*fast.parameters(), *fast.buffers())}
    assert tensors and not tensors & {id(t) for t in (*copied.parameters(), *copied.buffers())}


@pytest.mark.parametrize(
    "change",
    ["load_state_dict", "in place", "cast", "replaced"],
)
def test_a_fast_model_refuses_a_call_once_its_models_weights_have_changed(change):
    """It computes with the weights as they were (Linear layers packed; compiled, every weight a constant): after the
    model's weights change, a call is an error naming one, not outputs of old weights or of old and new mixed (the
    packed Linear weights old, the shared biases and norms new). A model optimised again computes with the new."""
    model = tiny_vit()
    fast = optimize_for_inference(model, "fp32", compile="none")
    x = torch.randn(3, 3, 32, 32)
    fast(x)
    other = tiny_vit()
    torch.nn.init.normal_(other.blocks[0].attn.qkv.weight)
    if change == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif change == "in place":
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.mul_(2)
    elif change == "cast":
        model.double()
    else:
        model.blocks[0].norm1.weight.data = torch.ones(TINY["width"])
    with pytest.raises(UserError, match=r"the model's [\w.]+ has changed since this fast model was made"):
        fast(x)
    with pytest.raises(UserError, match="call optimize_for_inference on the model again"):
        copy.deepcopy(fast)
    model.float()
    again = optimize_for_inference(model, "fp32", compile="none")
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=1e-5, rtol=1e-5)


HOOKED = ("blocks.0.mlp.fc2", "blocks.1.mlp.fc1")


def hooked_tiny_vit() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tiny_vit with a hook on each layer in HOOKED (the first MLP's branch switched off, the second's input
    doubled), an input, and the model's outputs on it before and after the hooks."""
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        unhooked = model(x)
    layers = dict(model.named_modules())
    layers[HOOKED[0]].register_forward_hook(lambda m, args, out: out * 0)
    layers[HOOKED[1]].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with torch.no_grad():
        hooked = model(x)
    return model, x, unhooked, hooked


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_fast_model_keeps_the_layers_that_have_hooks_and_runs_them(precision):
    """A Linear layer with a hook (an adapter, a mask, a probe) is not packed, quantised or fused with its GELU: the
    replacement would not run the hook. The fast model computes what the model with its hooks computes."""
    model, x, unhooked, hooked = hooked_tiny_vit()
    fast = optimize_for_inference(model, precision, compile="none")
    blocks = fast.model.blocks
    assert type(blocks[0].mlp.fc2) is torch.nn.Linear and type(blocks[1].mlp.fc1) is torch.nn.Linear
    if precision == "fp32" or fast_mod.int8_kernel() == "onednn":  # vitkit's layers replace the others
        assert type(blocks[0].mlp.fc1) is not torch.nn.Linear
    got = fast(x)
    if precision == "fp32":
        torch.testing.assert_close(got, hooked, atol=1e-5, rtol=1e-5)
    else:  # int8's own error is far below what the hooks change
        assert (got - hooked).abs().max() < 0.1 * (unhooked - hooked).abs().max()


def test_fbgemms_int8_keeps_the_layers_that_have_hooks_and_runs_them():
    """The kernel int8 runs on CPUs without VNNI, asked for by name on any CPU: torch's dynamic quantisation
    replaces the plain Linear layers alone; a hooked layer stays an fp32 nn.Linear, and its hook runs."""
    model, x, unhooked, hooked = hooked_tiny_vit()
    quantised = fast_mod.quantize_int8(model, "fbgemm")
    layers = dict(quantised.named_modules())
    linears = {name: type(layers[name]) for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert all(linears.pop(name) is torch.nn.Linear for name in HOOKED)
    assert len(linears) == 7 and set(linears.values()) == {torch.ao.nn.quantized.dynamic.Linear}  # the others
    with torch.no_grad():
        got = quantised(x)
    assert (got - hooked).abs().max() < 0.1 * (unhooked - hooked).abs().max()


def test_an_int8_model_is_a_copy_the_models_later_changes_leave_alone():
    model = tiny_vit()
    fast = optimize_for_inference(model, "int8", compile="none")
    x = torch.randn(3, 3, 32, 32)
    before = fast(x)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(2)
    torch.testing.assert_close(fast(x), before, atol=0, rtol=0)  # quantised from a copy: the weights as they were


@ONEDNN
@pytest.mark.skipif(not fast_mod.can_compile(torch.device("cpu")), reason="inductor needs a C++ compiler")
def test_packed_copy_compiles_to_the_models_function():
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, "fp32", compile="default")
    assert isinstance(fast.model.blocks[0].attn.qkv, fast_mod.PackedLinear)
    torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------- ONNX
def test_export_onnx_dynamic_batch_parity(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vitkit.checkpoint.native import save_pretrained
    from vitkit.export import check_onnx, onnx_session

    model = tiny_vit()
    save_pretrained(model, tmp_path / "ckpt")
    out = tmp_path / "vit.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["export", str(tmp_path / "ckpt"), "--onnx", str(out)]) == 0
    assert "onnxruntime vs torch max |diff|" in capsys.readouterr().out
    session = onnx_session(out)
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a symbolic batch axis
    assert check_onnx(out, model, batch_sizes=(2, 5)) <= 1e-4
    with torch.no_grad():
        model.head.bias += 1.0  # the exported graph no longer matches: the check must say so
    with pytest.raises(ValueError, match="differs from torch"):
        check_onnx(out, model, batch_sizes=(2,))
