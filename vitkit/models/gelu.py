"""The MLP's GELU: nn.GELU, with faster CPU code for the tanh approximation.

The official models use the tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. On a CPU,
ATen's bf16 kernel for it ran at a quarter of the speed of its exact (erf) GELU, forward and backward, and
inductor's lowering of it is as slow in any precision (both evaluate tanh with a slow vectorised routine): in a
ViT-S/16 bf16-autocast training step the GELU and its gradient took about 8% of the time, and in vitkit's
compiled int8 ViT-B/16 the GELU in the epilogue of each MLP's first matmul took about 6%. The same function
written as ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`` (``0.5 (1 + tanh(z)) = sigmoid(2 z)``) runs on the
fast vectorised exp instead:

- in training (the module in training mode and autograd recording the GELU; bf16 autocast included), in bf16
  and in fp32 from 2^20 elements, computed in fp32 in one compiled elementwise kernel for the forward and one for
  the backward. On 2 AVX512 cores, over a ViT-S/16 MLP's activations at batch 32, forward and backward: in bf16
  9.4-11.0 ms against ATen's 19.0-20.9, every output the float64 value correctly rounded to bf16 (ATen's are not
  for x < -3); in fp32 ATen's kernel is as slow, 8.7-9.8 ms against 17.5-18.9, a ViT-S/16 fp32 training step
  1.02x. Below 2^20 fp32 elements the saving (under a millisecond a call) does not repay the kernel's
  compilation, so small models keep ATen's. The kernels are compiled on first use for each dtype (a few seconds,
  then cached on disk by torch.compile), once for every size, each loop split over the threads torch runs (the
  same kernels on one thread: a ViT-S/16 training step 1.04x slower in fp32 and in bf16 autocast); where they
  cannot be compiled (no C++ compiler), a warning says so once and ATen's kernel runs instead;
- inside a graph that torch.compile traces on the CPU, in any precision, as plain tensor ops that inductor fuses
  with the ops around them (int8 ViT-B/16, compiled: 1.06-1.09x at batch 1, 8 and 64).

Elsewhere (smaller fp32 tensors, eager inference, other devices, torch.func transforms and forward-mode AD) it is
nn.GELU as it is.

A third kernel computes the gradient and the GELU itself in one pass, for the MLP's second layer
(``vitkit.models.linear.gelu_dense``), which reads the GELU's output for its weight's gradient and so need not
keep it from the forward pass: both outputs are those of the other two kernels, bit for bit.

A backward pass that builds a graph (``create_graph=True``: gradient penalties, second-order methods), or that runs
under a vmap (``is_grads_batched``), computes the gradient with ATen's GELU ops in fp32 instead, which autograd
records and vmap batches: a gradient of the gradient is the GELU's, as with nn.GELU.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .transforms import transformed, transformed_backward

_C2 = 2 * math.sqrt(2 / math.pi)  # 2 sqrt(2/pi): sigmoid(2 z) = (1 + tanh(z)) / 2
_A = 0.044715
FP32_MIN_NUMEL = 2**20  # fp32 elements from which training runs the kernels
_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _gate(xf: torch.Tensor) -> torch.Tensor:
    """s(u), u = C2 (x + a x^3): the GELU is x s(u)."""
    return torch.sigmoid(_C2 * (xf + _A * xf * xf * xf))


def _forward(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * _gate(xf)).to(x.dtype)


def _gradient(grad: torch.Tensor, xf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """grad times d/dx x s(u) = s + x s (1 - s) u', u = C2 (x + a x^3), u' = C2 (1 + 3 a x^2); xf, s in fp32."""
    return grad.float() * (s + xf * s * (1 - s) * _C2 * (1 + 3 * _A * xf * xf))


def _backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return _gradient(grad, xf, _gate(xf)).to(x.dtype)


def _backward_and_output(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_backward(grad, x) and _forward(x), the gate computed once for both."""
    xf = x.float()
    s = _gate(xf)
    return _gradient(grad, xf, s).to(x.dtype), (xf * s).to(x.dtype)


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn compiled for flat tensors of any length, its loop split over the threads torch runs at call time.

    Inductor decides at compile time whether a loop is worth splitting, from the sizes of the first call, and
    torch.compile's on-disk cache then serves that decision to every later process: compiled on the 64-element
    probe below, the kernels ran on one core of two, at half their speed, for ever after. ``cpp.dynamic_threads``
    always emits the parallel loop and reads the thread count (torch.set_num_threads) when it runs; being part of
    the compile options, it also keys a cache entry of its own, so a serial kernel cached earlier is not reused.

    ``cpp.simdlen``, the vector width inductor picks here anyway, keys the entries on it too: the cache does not
    key them on ATen's CPU capability, and kernels compiled under AVX512 and served to a process started with
    ``ATEN_CPU_CAPABILITY=avx2`` gave NaN.
    """
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # imported here: torch._inductor is slow to import

    options: dict[str, Any] = {"cpp.dynamic_threads": True}
    width = pick_vec_isa().bit_width()
    if width:  # 0: no vector ISA, scalar code, as inductor's default gives
        options["cpp.simdlen"] = width
    return torch.compile(fn, dynamic=True, options=options)


def _run(kernel: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    flat = [t.contiguous().view(-1).detach() for t in tensors]  # not a view: its base's shape would be guarded on
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # one compiled variant for every caller's state
        return kernel(*flat)


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels of one dtype, each run on flat tensors whatever the caller's shape."""

    flat_forward: Callable[..., torch.Tensor]
    flat_backward: Callable[..., torch.Tensor]
    flat_backward_and_output: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self.flat_forward, x).view(x.shape)

    def backward(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _run(self.flat_backward, grad, x).view(x.shape)

    def backward_and_output(self, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's gradient and the GELU of x, as backward(grad, x) and forward(x) give them, in one pass."""
        dx, y = _run(self.flat_backward_and_output, grad, x)
        return dx.view(x.shape), y.view(x.shape)


@functools.cache
def _kernels(dtype: torch.dtype) -> Kernels | None:
    """The kernels compiled for flat tensors of dtype and any length; None where torch.compile cannot build them."""
    kernels = Kernels(_compile(_forward), _compile(_backward), _compile(_backward_and_output))
    probe = torch.linspace(-4, 4, 64, dtype=dtype)
    try:  # compiles them now, for every length: a missing compiler shows here, not inside a training step
        kernels.forward(probe)
        kernels.backward(probe, probe)
        kernels.backward_and_output(probe, probe)
    except Exception as e:  # noqa: BLE001 - any failure to build leaves ATen's kernel, which computes the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"the {_NAMES[dtype]} tanh-GELU kernel could not be compiled ({first}); using ATen's", stacklevel=5
        )
        return None
    return kernels


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.kernels = kernels
        return kernels.forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        # create_graph=True (a gradient of the gradient may follow), or a transform over the backward pass
        # (is_grads_batched's vmap): torch's ops, which both see through
        if torch.is_grad_enabled() or transformed_backward(grad):
            return recorded_backward(grad, x), None
        return ctx.kernels.backward(grad, x), None


def recorded_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x's gradient for a backward pass that builds a graph (``create_graph=True``) or runs under a transform
    (``is_grads_batched``): ATen's tanh-GELU gradient computed in fp32, which autograd records and differentiates by
    its analytic formula, so that a gradient of the gradient is the GELU's second derivative (within 5e-7 of
    float64's largest, relative, in fp32; differentiating the kernels' sigmoid form instead lost 1e-5)."""
    return torch.ops.aten.gelu_backward(grad.float(), x.float(), approximate="tanh").to(x.dtype)


def recorded_backward_and_output(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``Kernels.backward_and_output`` computes, for a backward pass that builds a graph: ``recorded_backward``
    and ATen's GELU of x in fp32, both of which autograd records."""
    return recorded_backward(grad, x), F.gelu(x.float(), approximate="tanh").to(x.dtype)


def training_kernels(x: torch.Tensor, training: bool = True) -> Kernels | None:
    """The kernels gelu_tanh runs on x, None where it runs something else: on a CPU, outside a traced graph, a
    torch.func transform and forward-mode AD (``transforms.transformed``), in training (``training`` and autograd
    recording), in bf16 and in fp32 from FP32_MIN_NUMEL elements, where they compile."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    large = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.numel() >= FP32_MIN_NUMEL)
    if not (large and training and x.requires_grad and torch.is_grad_enabled()) or transformed():
        return None
    return _kernels(x.dtype)


def gelu_tanh(x: torch.Tensor, training: bool = True) -> torch.Tensor:
    """The tanh-approximated GELU; on a CPU, in a traced graph as the sigmoid form, and in training through the
    kernels above (training_kernels says where).

    Eager inference keeps ATen's kernel: a first call would otherwise wait seconds for the kernels to compile, for
    a few percent of a forward pass; and on a CPU the MLP applies its GELU inside the matmul before it there, where
    that layer runs as oneDNN's (``linear.dense_gelu``; the fast path's packed layers too).
    """
    if x.device.type == "cpu" and torch.compiler.is_compiling():  # in a compiled model, any precision: inductor
        return _forward(x)  # fuses this form with its neighbours, and lowers tanh itself as slowly as ATen
    kernels = training_kernels(x, training)
    if kernels is None:
        return F.gelu(x, approximate="tanh")
    return _GeluTanh.apply(x, kernels)


class GELU(nn.GELU):
    """nn.GELU (``approximate`` "tanh" or "none"); the tanh approximation runs as ``gelu_tanh``, in training where
    the module is in training mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x, self.training) if self.approximate == "tanh" else F.gelu(x)

    def kernels(self, x: torch.Tensor) -> Kernels | None:
        """The compiled kernels this module's call would run on x; None where it runs another (exact GELU, inference,
        ...: see training_kernels)."""
        return training_kernels(x, self.training) if self.approximate == "tanh" else None
