"""Compiled CPU kernels for the official models' tanh GELU in training, and where vitkit's own autograd functions
give way to torch's ops.

ATen's tanh GELU is slow on a CPU (its vectorised tanh); the same function written as
``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`` runs on the fast vectorised exp. ``TanhGELU`` (swapped in for a
training model's nn.GELU by vitkit.accel.training) runs it as one compiled kernel forward and one backward, in bf16
and for large fp32 tensors, on a CPU in training; elsewhere, and where no C++ compiler builds the kernels (a
warning says so once), it is nn.GELU. A third kernel gives the gradient and the GELU itself in one pass, for the
fused MLP of vitkit.accel.cpu. Measured by benchmarks/train_ceiling.py.

vitkit's autograd functions (these kernels, accel.cpu's oneDNN matmuls) define a backward pass and nothing for what
looks through ops: torch.jit tracing, torch.func transforms, forward-mode AD and ``is_grads_batched``. There
(``transformed``) they give way to torch's ops, so the model computes the same there as anywhere else.
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
from torch.autograd import forward_ad


def transformed() -> bool:
    """Whether torch.jit is tracing, a torch.func transform is active or forward-mode AD is in use (inside
    ``forward_ad.dual_level()``): there vitkit's own autograd functions give way to torch's ops."""
    return (
        torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or forward_ad._current_level >= 0  # the dual level entered, -1 outside one
    )


def transformed_backward(grad: torch.Tensor) -> bool:
    """Whether a backward pass receiving ``grad`` runs transformed: ``transformed()``, or ``grad`` batched by
    ``is_grads_batched`` (torch.autograd.grad's vmap, the legacy one, which ``transformed`` does not see)."""
    return transformed() or torch._C._functorch.is_legacy_batchedtensor(grad)


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
    """fn compiled for flat tensors of any length, its loop split over the threads torch runs at call time. Inductor
    decides from the first call's sizes whether to split a loop, and its disk cache serves that decision to later
    processes: ``cpp.dynamic_threads`` always splits, reading the thread count at run time, and keys a cache entry of
    its own. ``cpp.simdlen`` keys the entries on the vector width, which the cache otherwise ignores: AVX512 kernels
    served to a process run with ``ATEN_CPU_CAPABILITY=avx2`` gave NaN."""
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
    its analytic formula, so that a gradient of the gradient is the GELU's second derivative (differentiating the
    kernels' sigmoid form instead would lose accuracy)."""
    return torch.ops.aten.gelu_backward(grad.float(), x.float(), approximate="tanh").to(x.dtype)


def recorded_backward_and_output(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``Kernels.backward_and_output`` computes, for a backward pass that builds a graph: ``recorded_backward``
    and ATen's GELU of x in fp32, both of which autograd records."""
    return recorded_backward(grad, x), F.gelu(x.float(), approximate="tanh").to(x.dtype)


def training_kernels(x: torch.Tensor, training: bool = True) -> Kernels | None:
    """The kernels gelu_tanh runs on x, None where it runs something else: on a CPU, outside a traced graph, a
    torch.func transform and forward-mode AD (``transformed``), in training (``training`` and autograd
    recording), in bf16 and in fp32 from FP32_MIN_NUMEL elements, where they compile."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    large = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.numel() >= FP32_MIN_NUMEL)
    if not (large and training and x.requires_grad and torch.is_grad_enabled()) or transformed():
        return None
    return _kernels(x.dtype)


def gelu_tanh(x: torch.Tensor, training: bool = True) -> torch.Tensor:
    """The tanh-approximated GELU: in a graph torch.compile traces on a CPU as the sigmoid form, which inductor fuses
    with its neighbours and lowers faster than tanh; in training through the kernels (``training_kernels``); else
    ATen's. Eager inference keeps ATen's: a first call would otherwise wait seconds for the kernels to compile."""
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return _forward(x)
    kernels = training_kernels(x, training)
    if kernels is None:
        return F.gelu(x, approximate="tanh")
    return _GeluTanh.apply(x, kernels)


class TanhGELU(nn.GELU):
    """nn.GELU(approximate="tanh") running as ``gelu_tanh``; swapped in for one by ``swap_gelus``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(x, self.training)

    def kernels(self, x: torch.Tensor) -> Kernels | None:
        """The compiled kernels this module's call would run on x; None where it runs another (``training_kernels``)."""
        return training_kernels(x, self.training)


def swap_gelus(model: nn.Module) -> int:
    """Make every tanh nn.GELU of model a TanhGELU, in place (the same module, parameter-free); how many."""
    swapped = 0
    for m in model.modules():
        if type(m) is nn.GELU and m.approximate == "tanh":
            m.__class__ = TanhGELU
            swapped += 1
    return swapped
