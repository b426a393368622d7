"""The ceiling utilisation is stated against: a large square matmul through the fastest kernel here.

On a CPU the candidates are torch's own product (torch.matmul; torch._int_mm for int8) and the kernels of vitkit's
packed-weight inference layers (vitkit.accel.cpu.PackedLinear, vitkit.accel.int8.Int8Linear), which can be the
faster ones there (benchmarks/matmul_peak.py times each): a peak taken from torch.matmul alone was exceeded by the
models' own layers. On a GPU the figure to state MFU against is the datasheet's (dense_bf16_peak).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from vitkit.accel.cpu import PackedLinear, can_pack_linears
from vitkit.accel.int8 import Int8Linear, int8_kernel
from vitkit.device import cpu_has_vnni

from .timing import time_call


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


def torch_kernel(dtype: torch.dtype, device: torch.device, n: int) -> MatmulProbe:
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
    packed-weight inference layers (PackedLinear; Int8Linear where it runs)."""
    first = torch_kernel(dtype, device, n)
    a, b = first.a, first.b
    if dtype == torch.int8:
        if device.type == "cpu" and int8_kernel() == "onednn":
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
    while n < max_n and time_call(torch_kernel(dtype, device, n), device) <= 0.1:
        n *= 2
    return n


def matmul_probe(
    dtype: torch.dtype, device: torch.device, max_n: int = 8192, seconds: float = 0.0
) -> tuple[MatmulProbe, int]:
    """A large square matmul in this dtype through the fastest kernel here (probe_kernels), and its FLOPs: the
    ceiling utilisation is measured against.

    int8 is the int8 x int8 -> int32 product (VNNI / AMX on CPUs, tensor cores on CUDA), the ceiling of int8
    inference. At probe_size the kernels take turns for three rounds after a call each, and the one with the
    fastest call is the probe: a kernel chosen from one call each could be taken on a passing moment of load.
    With ``seconds`` the probe repeats its product to last about that long (at least once): the harness times it
    in turn with the models, each round's rate against that round's peak, and a probe that lasts as long as the
    step it is compared with takes a moment's load as the step does, where one short product would mostly run
    between such moments and read the share low.
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
            best[i] = min(best[i], time_call(probe, device))
    return best


def paired_utilisation(flops: float, step_s: Sequence[float], probe_flops: float, probe_s: Sequence[float]) -> float:
    """The share of the peak: the median over rounds of (flops / a step's seconds) over (probe_flops / the probe's
    seconds in the same round), paired as the speed ratios are."""
    return statistics.median(flops / t / (probe_flops / p) for t, p in zip(step_s, probe_s, strict=True))


def measure_matmul_peak(dtype: torch.dtype, device: torch.device, seconds: float = 1.0) -> tuple[float, str]:
    """(GFLOP/s of the matmul probe, best over ``seconds`` of repeats: a quiet machine's ceiling; its kernel)."""
    probe, flops = matmul_probe(dtype, device)
    best, start = time_call(probe, device), time.perf_counter()
    while time.perf_counter() - start < seconds:
        best = min(best, time_call(probe, device))
    return flops / best / 1e9, probe.kernel


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
