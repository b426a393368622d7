"""Throughput, FLOPs, utilisation and memory of a model, side by side with peers in the same process.

    report = run_bench(BenchConfig(model="vit_b16", batch_size=8, dtype="bf16", compare=("hf",)))
    print(report.table()); report.save_json("bench.json")

- FLOPs are counted analytically from the config (matmuls and convolutions, 2 per multiply-add; norms,
  softmax and GELU are left out, as FlopCounterMode does). A training step counts 3x the forward.
- Utilisation is achieved FLOP/s over a large square matmul's rate in the same dtype (the fastest kernel here,
  matmul_probe), repeated to last as long as vitkit's step and timed in turn with the models: the median over
  rounds of each round's rate over that round's peak, so it reads correctly on a machine that other jobs share.
  Two columns: "mfu" counts the model's FLOPs, "hw" the FLOPs each implementation executes. They differ for
  vitkit (and its ONNX export), whose class-token forward computes only the class token in the last block.
- Runs alternate between implementations (vitkit, transformers, onnxruntime, any extra peer) repeat by repeat,
  so a change of machine load hits all of them alike; the ratios, paired repeat by repeat, are the figures to
  trust. Outputs are compared first.
- Peak memory: see memory.py; reported over what is resident before the step (weights, gradients, optimizer
  state), which is reported separately.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..device import autocast, cpu_has_vnni, cpu_model_name
from ..errors import UserError
from ..fast import COMPILE_MODES, compile_for_inference, cpu_allocator_tuned
from ..io import atomic_write_text
from ..models import MODELS, BiTConfig, ResNetConfig, ViTConfig, create_model
from ..models.attention import ATTN_IMPLS
from .flops import model_flops
from .memory import find_max_batch, format_bytes, measure_step_memory, memory_method, parse_bytes, resident_bytes
from .stats import RatioStats, load_average, load_warnings, paired_ratio_stats, settled

DTYPES = ("fp32", "bf16-autocast", "bf16")
MODES = ("infer", "train")
PEERS = ("hf", "onnx")
PROBE = "matmul peak"
SETTLE_S = 0.2  # idle time between timed calls, see time_alternating
RATIO_FIELDS = ("median", "low", "high", "q1", "q3", "n", "confidence")
PARITY_TOL = {"fp32": 1e-4, "bf16-autocast": 5e-2, "bf16": 5e-2}  # max |a - b| / max(1, max |ref|)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: a registered model (plus config overrides) at one shape, dtype, attention and compile mode."""

    model: str = "vit_b16"
    img_size: int = 224
    batch_size: int = 8
    dtype: str = "fp32"
    attn: str = "auto"
    compile: str = "none"
    mode: str = "infer"
    compare: tuple[str, ...] = ()
    repeats: int = 5  # rounds at least; with max_repeats, more until the ratios' intervals settle
    warmup: int = 2
    max_repeats: int = 0  # 0: exactly ``repeats`` rounds
    target_half_width: float = 0.02  # stop once every ratio's 95% interval is within +-2% (see stats.settled)
    max_batch: bool = False
    memory_budget: str = "8GB"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    overrides: dict[str, Any] = field(default_factory=dict)  # more model config fields (tests: tiny models)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("attn", self.attn, ATTN_IMPLS),
            ("compile", self.compile, COMPILE_MODES),
            ("mode", self.mode, MODES),
        ):
            if value not in allowed:
                raise UserError(f"bench {name}={value!r}: expected one of {allowed}")
        object.__setattr__(self, "compare", tuple(self.compare))  # a list given: kept as a tuple, as declared
        for peer in self.compare:
            if peer not in PEERS:
                raise UserError(f"bench compare={peer!r}: expected one of {PEERS}")
        if self.max_repeats and self.max_repeats < self.repeats:
            raise UserError(f"bench max_repeats={self.max_repeats}: must be 0 or at least repeats={self.repeats}")
        if self.batch_size < 1 or self.repeats < 1 or self.warmup < 0:
            raise UserError("bench needs batch_size >= 1, repeats >= 1 and warmup >= 0")
        parse_bytes(self.memory_budget)


@dataclass
class Measurement:
    """One implementation's timings; images/s is the median over repeats, with its min and max."""

    name: str
    images_per_s: float
    images_per_s_min: float
    images_per_s_max: float
    step_s: list[float]
    utilisation: float  # model FLOPs per second over the matmul peak, round by round (paired_utilisation)
    hardware_utilisation: float  # executed FLOPs per second over the matmul peak, likewise
    step_memory_bytes: int | None = None
    resident_bytes: int | None = None
    parity_max_abs: float | None = None


@dataclass
class BenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    gflops_per_image: float  # forward, the model's FLOPs
    executed_gflops_per_image: float  # what vitkit's forward executes (less for class-token ViTs)
    gflops_per_step: float  # forward (infer) or 3x forward (train), whole batch
    matmul_peak_gflops: float
    matmul_peak_kernel: str  # which kernel the peak probe ran (matmul_probe: the fastest here)
    matmul_peak_size: str  # its product's shape and repeats (MatmulProbe.size)
    matmul_peak_s: list[float]  # its seconds in each round, paired with each Measurement.step_s
    memory_method: str
    measurements: list[Measurement]
    ratios: dict[str, float]  # vitkit's speed over each peer's, best rows, paired by repeat (see paired_ratios)
    max_batch: dict[str, Any] | None = None
    ratio_stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # RatioStats.to_dict() per peer
    warnings: list[str] = field(default_factory=list)  # load, and ratios whose interval is wider than the effect

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def table(self) -> str:
        c = self.config
        w = max(8, *(len(m.name) for m in self.measurements))
        compile_modes = ",".join(c.get("compile_modes") or [c["compile"]])
        lines = [
            f"{c['model']} {c['mode']} img {c['img_size']} batch {c['batch_size']} {c['dtype']} attn={c['attn']} "
            f"compile={compile_modes} on {self.environment['device']} ({self.environment['threads']} threads, "
            f"load {self.environment['load_avg']})",
            f"model: {self.gflops_per_image:.4g} GFLOP/image forward (vitkit executes "
            f"{self.executed_gflops_per_image:.4g}); {c['dtype']} matmul peak {self.matmul_peak_gflops:.1f} GFLOP/s "
            f"({self.matmul_peak_kernel}, {self.matmul_peak_size}, timed alongside)",
            f"{'impl':<{w}} {'img/s':>9} {'min-max':>17} {'mfu':>6} {'hw':>6} {'step mem':>10} {'resident':>10} "
            f"{'parity':>9}",
        ]
        for m in self.measurements:
            parity = "-" if m.parity_max_abs is None else f"{m.parity_max_abs:.1e}"
            lines.append(
                f"{m.name:<{w}} {m.images_per_s:>9.2f} {m.images_per_s_min:>8.2f}-{m.images_per_s_max:<8.2f} "
                f"{m.utilisation:>6.1%} {m.hardware_utilisation:>6.1%} {format_bytes(m.step_memory_bytes):>10} "
                f"{format_bytes(m.resident_bytes):>10} {parity:>9}"
            )
        for peer, ratio in self.ratios.items():
            st = self.ratio_stats.get(peer)
            shown = str(RatioStats(**{k: st[k] for k in RATIO_FIELDS})) if st else f"{ratio:.3f}x"
            lines.append(f"vitkit / {peer} (best rows, paired by repeat): {shown}")
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines.append(f"memory: {self.memory_method}")
        if self.max_batch:
            mb = self.max_batch
            lines.append(f"largest batch within {mb['budget']}: {mb['batch_size']} ({mb['method']})")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- peak
@dataclass(frozen=True)
class MatmulProbe:
    """One square product ``a @ b`` through one kernel; calling it computes the product (int8: summed exactly),
    ``repeats`` times over (see matmul_probe's ``seconds``) and returns the last."""

    kernel: str  # which library call: "torch.matmul", "oneDNN, packed", "torch._int_mm", "oneDNN int8, packed"
    a: torch.Tensor
    b: torch.Tensor
    run: Callable[[], torch.Tensor]
    repeats: int = 1

    @property
    def size(self) -> str:
        """The product's shape and repeats, e.g. '2048x2048 x 60'."""
        return f"{self.a.shape[0]}x{self.b.shape[1]} x {self.repeats}"

    def __call__(self) -> torch.Tensor:
        for _ in range(self.repeats - 1):
            self.run()
        return self.run()


def _dense(b: torch.Tensor) -> nn.Linear:
    """The layer whose weight is b^T, so that it computes x @ b."""
    layer = nn.Linear(b.shape[0], b.shape[1], bias=False, device=b.device, dtype=b.dtype)
    with torch.no_grad():
        layer.weight.copy_(b.t())
    return layer


def _torch_kernel(dtype: torch.dtype, device: torch.device, n: int) -> MatmulProbe:
    """torch's own n x n product in dtype: torch.matmul, or torch._int_mm (int8 x int8 -> int32) for int8."""
    if dtype == torch.int8:
        # Without 8-bit dot products (VNNI) torch._int_mm on a CPU is oneDNN's u8 x s8 multiply-add, whose int16
        # pair sums saturate for 8-bit b (255 x 127 x 2 > 32767): 7-bit b keeps its product exact there, at the
        # same speed. With VNNI every column's largest |b| is 127: Int8Linear's per-channel scale is 1, its
        # product exact.
        top = 127 if device.type != "cpu" or cpu_has_vnni() else 63
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-top, top + 1, (n, n), dtype=torch.int8, device=device)
        b[0] = top
        return MatmulProbe("torch._int_mm", a, b, functools.partial(torch._int_mm, a, b))
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return MatmulProbe("torch.matmul", a, b, functools.partial(torch.matmul, a, b))


def probe_kernels(dtype: torch.dtype, device: torch.device, n: int) -> list[MatmulProbe]:
    """Every kernel the peak may come from, each one n x n product in dtype: torch's (torch.matmul, or
    torch._int_mm for int8, its int8 x int8 -> int32 product) and, on a CPU with oneDNN, the kernels of vitkit's
    packed-weight inference layers (PackedLinear; Int8Linear where it runs). On 2 AMD EPYC cores the packed fp32
    product ran 1.37x faster than torch.matmul, which is MKL's sgemm there, the bf16 one 1.09x, and int8 the two
    within a few percent (benchmarks/matmul_peak.py); a peak taken from torch.matmul alone was exceeded by the
    models' own layers."""
    from ..fast import Int8Linear, PackedLinear, _has_vnni_layer, can_pack_linears

    first = _torch_kernel(dtype, device, n)
    a, b = first.a, first.b
    if dtype == torch.int8:
        if device.type == "cpu" and _has_vnni_layer():
            layer = Int8Linear(_dense(b.float()))
            unsigned = (a.to(torch.int16) + 128).to(torch.uint8)  # the layer's input, q(x) + 128
            return [first, MatmulProbe("oneDNN int8, packed", a, b, functools.partial(layer.products, unsigned))]
        return [first]
    if dtype in (torch.float32, torch.bfloat16) and can_pack_linears(device, dtype):
        return [first, MatmulProbe("oneDNN, packed", a, b, functools.partial(PackedLinear(_dense(b)), a))]
    return [first]


def probe_size(dtype: torch.dtype, device: torch.device, max_n: int = 8192) -> int:
    """The probe's size: doubled from 256 while torch's product takes under 0.1 s (up to max_n; 8192 is what a GPU
    needs to reach its peak), so emulated dtypes stay affordable."""
    n = 256
    while n < max_n and _time(_torch_kernel(dtype, device, n), device) <= 0.1:
        n *= 2
    return n


def matmul_probe(
    dtype: torch.dtype, device: torch.device, max_n: int = 8192, seconds: float = 0.0
) -> tuple[MatmulProbe, int]:
    """A large square matmul in this dtype through the fastest kernel here (probe_kernels), and its FLOPs: the
    ceiling utilisation is measured against.

    int8 is the int8 x int8 -> int32 product (VNNI / AMX on CPUs, tensor cores on CUDA), the ceiling of int8
    inference. At probe_size the kernels take turns for three rounds after a call each, and the one with the
    fastest call is the probe: each timed apart, best of two, a bf16 probe built just after torch.compile had
    compiled the models once took torch.matmul, about 9% slower than oneDNN's packed product on 2 AMD EPYC cores.
    With ``seconds`` the probe repeats its product to last about that long (at least once): the harness times it
    in turn with the models, each round's rate against that round's peak, and a probe that lasts as long as the
    step it is compared with takes a moment's load as the step does. One short product (fp32: about 0.08 s on 2
    cores) mostly ran between such moments while a 5 s training step rarely did, which read the share low.
    """
    n = probe_size(dtype, device, max_n)
    kernels = probe_kernels(dtype, device, n)
    once, probe = min(zip(fastest_calls(kernels, device, 3), kernels, strict=True), key=lambda t: t[0])
    repeats = max(1, round(seconds / once))
    return (probe if repeats == 1 else replace(probe, repeats=repeats)), repeats * 2 * n**3


def fastest_calls(kernels: Sequence[MatmulProbe], device: torch.device, rounds: int) -> list[float]:
    """Each kernel's fastest call in seconds over ``rounds`` rounds, the kernels taking turns after a call each
    (packing, oneDNN's primitive cache), so that a passing moment of load weighs on one round, not one kernel."""
    for probe in kernels:
        probe()
    best = [math.inf] * len(kernels)
    for _ in range(rounds):
        for i, probe in enumerate(kernels):
            best[i] = min(best[i], _time(probe, device))
    return best


def step_seconds(step: Callable[[], Any], device: torch.device) -> float:
    """One call's seconds, after a first call (which may compile): how long the matmul probe should last."""
    step()
    return _time(step, device)


def paired_utilisation(flops: float, step_s: Sequence[float], probe_flops: float, probe_s: Sequence[float]) -> float:
    """The share of the peak: the median over rounds of (flops / a step's seconds) over (probe_flops / the probe's
    seconds in the same round), paired as the speed ratios are."""
    return statistics.median(flops / t / (probe_flops / p) for t, p in zip(step_s, probe_s, strict=True))


# dense (not 2:4 sparse) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by a name the GPU reports
DENSE_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}


def dense_bf16_peak(device: torch.device) -> tuple[float, str]:
    """(the datasheet's dense bf16 TFLOP/s, the GPU's name) for a CUDA device: the figure MFU is stated against.
    NaN for a GPU not in DENSE_BF16_TFLOPS."""
    name = torch.cuda.get_device_name(device)
    for key, tflops in DENSE_BF16_TFLOPS.items():  # the more specific names first
        if key in name:
            return tflops, name
    return float("nan"), name


def measure_matmul_peak(dtype: torch.dtype, device: torch.device, seconds: float = 1.0) -> tuple[float, str]:
    """(GFLOP/s of the matmul probe, best over ``seconds`` of repeats: a quiet machine's ceiling; its kernel)."""
    probe, flops = matmul_probe(dtype, device)
    best, start = _time(probe, device), time.perf_counter()
    while time.perf_counter() - start < seconds:
        best = min(best, _time(probe, device))
    return flops / best / 1e9, probe.kernel


def _time(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------- runners
def _autocast(cfg: BenchConfig, device: torch.device) -> contextlib.AbstractContextManager[object]:
    return autocast(device, "bf16" if cfg.dtype == "bf16-autocast" else "none")


def _param_dtype(cfg: BenchConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


class _Logits(nn.Module):
    """transformers' models return an output object; the benchmark wants the logits tensor."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=x).logits


def _forward_fn(model: nn.Module, cfg: BenchConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward a step calls: the model, or its compiled form (with freezing for inference)."""
    if cfg.compile == "none":
        return model
    if cfg.mode == "infer":
        return compile_for_inference(model, cfg.compile)
    return torch.compile(model, mode=cfg.compile)


def make_step(
    model: nn.Module, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> Callable[[], torch.Tensor]:
    """One timed unit: an inference forward, or forward + cross-entropy + backward + AdamW step."""
    forward = _forward_fn(model, cfg)
    if cfg.mode == "infer":
        model.eval()

        def infer() -> torch.Tensor:
            with torch.no_grad(), _autocast(cfg, device):
                return forward(x)

        return infer
    model.train()
    # the fused kernel on CPU too: for ViT-S/16 (22M parameters) its step takes 1.8 s here against 4.8 s unfused
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))

    def train() -> torch.Tensor:
        if cfg.compile == "reduce-overhead":  # a new step: the CUDA graphs' last outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with _autocast(cfg, device):
            loss = F.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train


def onnx_step(model: nn.Module, cfg: BenchConfig, x: torch.Tensor, workdir: Path) -> Callable[[], Any]:
    """An onnxruntime session over the model exported with a dynamic batch axis (fp32 inference only)."""
    from ..export import export_onnx, onnx_session

    path = export_onnx(model, workdir / "model.onnx", img_size=cfg.img_size)
    session = onnx_session(path)
    feed = {session.get_inputs()[0].name: x.float().cpu().numpy()}
    return lambda: session.run(None, feed)[0]


def _relative_max_diff(a: Any, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|): absolute for small outputs, relative for large ones."""
    a = torch.as_tensor(a).float().cpu()
    b = b.float().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def time_alternating(
    steps: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int,
    device: torch.device,
    settle_s: float = SETTLE_S,
    until: Callable[[dict[str, list[float]]], bool] | None = None,
    max_repeats: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each step, the steps taking turns within every round (after warm-up rounds).

    ``repeats`` rounds are timed; then, with ``until`` and ``max_repeats``, further rounds until until(times) is
    true or max_repeats rounds are done (see stats.settled). Between calls the process idles for settle_s (not
    timed): thread pools (OpenMP, onnxruntime) spin for a while after their work, and would otherwise steal the
    cores from whichever step runs next.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    rounds = 0
    while rounds < warmup + repeats or (until is not None and rounds < warmup + max_repeats and not until(times)):
        for name, step in steps.items():
            time.sleep(settle_s)
            elapsed = _time(step, device)
            if rounds >= warmup:
                times[name].append(elapsed)
        rounds += 1
    return times


# ------------------------------------------------------------------------------------------------------- main
def build_model(cfg: BenchConfig, device: torch.device) -> nn.Module:
    """The registered model with random weights; the zero-initialised head gets random weights too, so that
    output parity checks compare informative logits rather than zeros."""
    torch.manual_seed(0)
    attn = {"attn_impl": cfg.attn} if MODELS[cfg.model]["arch"] == "vit" else {}
    model = create_model(cfg.model, img_size=cfg.img_size, **attn, **cfg.overrides)
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        nn.init.normal_(head.weight, std=0.02)
    return model.to(device=device, dtype=_param_dtype(cfg))


def _inputs_and_classes(model: nn.Module) -> tuple[int, int]:
    """(input channels, classes) of a registered model, from its config."""
    config = model.config
    assert isinstance(config, (ViTConfig, ResNetConfig, BiTConfig)), f"not a registered model: {type(model)}"
    return config.in_chans, max(config.num_classes, 1)


def run_bench(
    cfg: BenchConfig,
    log: Callable[[str], None] = lambda s: None,
    compile_modes: Sequence[str] | None = None,
    extra_peers: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None,
) -> BenchReport:
    """Build, check parity, time alternating, measure memory (and the largest batch); see the module docstring.

    ``compile_modes`` (default: just cfg.compile) times every implementation under each mode, all alternating in
    one loop, rows named "vitkit/none", "hf/default", ...; the ratios then compare each side's best row.
    ``extra_peers``: name -> a function building that implementation from vitkit's model (same weights, dtype
    and device), timed and parity-checked like transformers; benchmarks/bench_vit.py adds timm this way.
    """
    device = torch.device(cfg.device)
    modes = tuple(compile_modes or (cfg.compile,))
    model = build_model(cfg, device)
    torch.manual_seed(1)
    in_chans, classes = _inputs_and_classes(model)
    x = torch.randn(cfg.batch_size, in_chans, cfg.img_size, cfg.img_size, device=device)
    x = x.to(_param_dtype(cfg))
    y = torch.randint(0, classes, (cfg.batch_size,), device=device)
    builders = {**({"hf": hf_peer} if "hf" in cfg.compare else {}), **(extra_peers or {})}
    peers = {name: build(model) for name, build in builders.items()}
    parity = check_parity(model, peers, x, cfg, log)

    owners: dict[str, nn.Module] = {}
    steps: dict[str, Callable[[], Any]] = {}
    for impl, module in {"vitkit": model, **peers}.items():
        for mode in modes:
            name = impl if len(modes) == 1 else f"{impl}/{mode}"
            steps[name] = make_step(module, replace(cfg, compile=mode), x, y, device)
            owners[name] = module
    workdir = tempfile.TemporaryDirectory(prefix="vitkit-bench-")
    if "onnx" in cfg.compare:
        if cfg.mode != "infer" or cfg.dtype != "fp32" or device.type != "cpu":
            raise UserError("bench --compare onnx: onnxruntime is measured for fp32 inference on the CPU only")
        steps["onnx"] = onnx_step(model, cfg, x, Path(workdir.name))
        parity["onnx"] = _check_one("onnx", _relative_max_diff(steps["onnx"](), model_output(model, x, cfg)), cfg, log)

    flops = model_flops(model, cfg.img_size)
    executed = model_flops(model, cfg.img_size, logits_path=True)  # vitkit's forward, and so its ONNX export
    step_flops = flops * cfg.batch_size * (3 if cfg.mode == "train" else 1)
    ours = next(name for name in steps if name.startswith("vitkit"))
    probe, probe_flops = matmul_probe(
        torch.float32 if cfg.dtype == "fp32" else torch.bfloat16, device, seconds=step_seconds(steps[ours], device)
    )
    rounds = f"{cfg.repeats}" + (f" to {cfg.max_repeats}" if cfg.max_repeats > cfg.repeats else "")
    log(f"timing {', '.join(steps)}: {cfg.warmup} warm-up and {rounds} timed calls each, alternating")

    def ratios_settled(times: dict[str, list[float]]) -> bool:
        ours = [t for name, t in times.items() if name.startswith("vitkit")]
        peers = [t for name, t in times.items() if not name.startswith(("vitkit", PROBE))]
        return settled([paired_ratio_stats(p, v) for p in peers for v in ours], cfg.target_half_width)

    load_before = load_average()
    times = time_alternating(
        {**steps, PROBE: probe},
        cfg.repeats,
        cfg.warmup,
        device,
        settle_s=SETTLE_S if device.type == "cpu" else 0.0,  # no CPU thread pools to let go idle on a GPU
        until=ratios_settled,
        max_repeats=cfg.max_repeats,
    )
    notes = load_warnings(load_before, load_average(), torch.get_num_threads())
    probe_s = times.pop(PROBE)
    peak = probe_flops / statistics.median(probe_s) / 1e9  # GFLOP/s under the same load as the models
    measurements = []
    for name, step_s in times.items():
        rates = [cfg.batch_size / t for t in step_s]
        median = statistics.median(rates)
        owner = owners.get(name)
        impl = name.split("/")[0]
        mfu = paired_utilisation(step_flops, step_s, probe_flops, probe_s)
        measurements.append(
            Measurement(
                name=name,
                images_per_s=median,
                images_per_s_min=min(rates),
                images_per_s_max=max(rates),
                step_s=step_s,
                utilisation=mfu,
                hardware_utilisation=mfu * executed / flops if impl in ("vitkit", "onnx") else mfu,
                step_memory_bytes=measure_step_memory(steps[name], device, reset_cpu_peak=True)
                if owner is not None
                else None,
                resident_bytes=resident_bytes(owner, cfg.mode) if owner is not None else None,
                parity_max_abs=parity.get(impl),
            )
        )
    stats = paired_ratio_intervals(measurements)
    ratios = {peer: st.median for peer, st in stats.items()}
    for peer, st in stats.items():
        if st.inconclusive:
            notes.append(f"vitkit / {peer}: the interval ({st.low:.3f}-{st.high:.3f}) is wider than the effect")
    max_batch = estimate_max_batch(model, cfg, device, measurements[0], log) if cfg.max_batch else None
    workdir.cleanup()
    return BenchReport(
        config={**asdict(cfg), "compare": list(cfg.compare), "compile_modes": list(modes)},
        environment=environment(device),
        gflops_per_image=flops / 1e9,
        executed_gflops_per_image=executed / 1e9,
        gflops_per_step=step_flops / 1e9,
        matmul_peak_gflops=peak,
        matmul_peak_kernel=probe.kernel,
        matmul_peak_size=probe.size,
        matmul_peak_s=probe_s,
        memory_method=memory_method(device),
        measurements=measurements,
        ratios=ratios,
        max_batch=max_batch,
        ratio_stats={peer: st.to_dict() for peer, st in stats.items()},
        warnings=notes,
    )


def paired_ratios(measurements: Sequence[Measurement]) -> dict[str, float]:
    """vitkit's speed over each peer's: the best row (median images/s over compile modes) of each implementation,
    then the median over repeats of peer seconds / vitkit seconds within the same repeat.

    Both calls of a pair ran seconds apart, so a change of machine load between repeats cancels out, where a
    ratio of two medians would still carry it.
    """
    best = best_rows(measurements)
    ours = best["vitkit"].step_s
    return {
        impl: statistics.median(t / v for t, v in zip(m.step_s, ours)) for impl, m in best.items() if impl != "vitkit"
    }


def paired_ratio_intervals(measurements: Sequence[Measurement]) -> dict[str, RatioStats]:
    """paired_ratios with the spread: each peer's best row against vitkit's, as RatioStats (stats.py)."""
    best = best_rows(measurements)
    ours = best["vitkit"].step_s
    return {impl: paired_ratio_stats(m.step_s, ours) for impl, m in best.items() if impl != "vitkit"}


def best_rows(measurements: Sequence[Measurement]) -> dict[str, Measurement]:
    """Each implementation's fastest row (highest median images/s) over its compile modes ("hf/none", ...)."""
    best: dict[str, Measurement] = {}
    for m in measurements:
        impl = m.name.split("/")[0]
        if impl not in best or m.images_per_s > best[impl].images_per_s:
            best[impl] = m
    return best


def hf_peer(model: nn.Module) -> nn.Module:
    """transformers' ViTForImageClassification with the same weights, dtype and device, on its SDPA attention."""
    from ..checkpoint.hf import to_hf_model

    hf = to_hf_model(model)
    hf.set_attn_implementation("sdpa")  # transformers' fastest attention on CPU and a match for ours on CUDA
    return _Logits(hf)


def model_output(model: nn.Module, x: torch.Tensor, cfg: BenchConfig) -> torch.Tensor:
    """Eval-mode outputs in the benchmark's dtype setting, as fp32."""
    model.eval()
    with torch.no_grad(), _autocast(cfg, x.device):
        return model(x).float()


def batched_logits(fn: Callable[[torch.Tensor], Any], images: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """fn's outputs for images as fp32 logits, ``batch`` images a call, without autograd."""
    with torch.no_grad():
        return torch.cat([torch.as_tensor(fn(b)).float() for b in images.split(batch)])


def logit_agreement(want: torch.Tensor, got: Any) -> dict[str, float]:
    """Top-1 agreement of got with want (the fp32 logits), and the max / mean |logit error|; max_abs_logit, the
    largest |want|, is the scale they read against."""
    got = torch.as_tensor(got).float()
    err = (got - want).abs()
    return {
        "n": len(want),
        "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "max_err": float(err.max()),
        "mean_err": float(err.mean()),
        "max_abs_logit": float(want.abs().max()),
    }


def check_parity(
    model: nn.Module, peers: dict[str, nn.Module], x: torch.Tensor, cfg: BenchConfig, log: Callable[[str], None]
) -> dict[str, float]:
    """Each peer's outputs against vitkit's on the same input, before any timing; raises ValueError on mismatch."""
    ref = model_output(model, x, cfg)
    return {
        name: _check_one(name, _relative_max_diff(model_output(peer, x, cfg), ref), cfg, log)
        for name, peer in peers.items()
    }


def _check_one(name: str, err: float, cfg: BenchConfig, log: Callable[[str], None]) -> float:
    tol = PARITY_TOL[cfg.dtype]
    log(f"parity {name}: max |diff| / max(1, max |ref|) = {err:.2e} (tolerance {tol:.0e})")
    if not err <= tol:
        raise UserError(
            f"bench: {name} outputs differ from vitkit's by {err:.3e} (> {tol:.0e}); "
            "not timing implementations that compute different things"
        )
    return err


def estimate_max_batch(
    model: nn.Module, cfg: BenchConfig, device: torch.device, measured: Measurement, log: Callable[[str], None]
) -> dict[str, Any]:
    """The largest batch whose step fits the memory budget (paper Fig 12).

    CUDA: doubling then bisection, each candidate run for real (an out-of-memory error means it does not fit).
    CPU: there is no allocator limit to hit, so an estimate: resident + fixed + per-image x batch, with the
    per-image step memory from measurements at this batch size and half of it.
    """
    budget = parse_bytes(cfg.memory_budget)
    resident = resident_bytes(model, cfg.mode)
    out = {"budget": cfg.memory_budget, "budget_bytes": budget, "resident_bytes": resident}

    in_chans, classes = _inputs_and_classes(model)

    def step_memory(batch: int) -> int | None:
        xb = torch.randn(batch, in_chans, cfg.img_size, cfg.img_size, device=device)
        yb = torch.randint(0, classes, (batch,), device=device)
        step = make_step(model, cfg, xb.to(_param_dtype(cfg)), yb, device)
        step()  # warm-up: optimizer state, compiled kernels
        return measure_step_memory(step, device, reset_cpu_peak=True)

    if device.type == "cuda":

        def fits(batch: int) -> bool:
            try:
                mem = step_memory(batch)
            except torch.OutOfMemoryError:
                return False
            finally:
                torch.cuda.empty_cache()
            log(f"max batch: {batch} needs {format_bytes(mem)} + resident")
            return mem is not None and resident + mem <= budget

        return {**out, "batch_size": find_max_batch(fits), "method": "measured: doubling + bisection on CUDA"}
    b1, b2 = max(cfg.batch_size // 2, 1), max(cfg.batch_size, 2)
    m1, m2 = step_memory(b1), measured.step_memory_bytes if b2 == cfg.batch_size else step_memory(b2)
    if m1 is None or m2 is None:
        return {**out, "batch_size": None, "method": "unavailable: step memory is not measurable here"}
    per_image = max((m2 - m1) / (b2 - b1), 1.0)
    fixed = max(m1 - per_image * b1, 0.0)
    batch = max(int(math.floor((budget - resident - fixed) / per_image)), 0)
    return {
        **out,
        "batch_size": batch,
        "per_image_bytes": int(per_image),
        "fixed_bytes": int(fixed),
        "method": f"estimate on CPU: resident + fixed + per-image step memory (measured at batch {b1} and {b2})",
    }


def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg": "n/a",
        "cores": os.cpu_count(),
        "cpu_allocator": "freed memory kept (tune_cpu_allocator)" if cpu_allocator_tuned() else "default",
    }
    with contextlib.suppress(OSError, AttributeError):
        env["load_avg"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    if device.type == "cpu":
        env["device"] = cpu_model_name() or env["device"]
    return env
