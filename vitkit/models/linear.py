"""The Dense layers' matmuls in training on a CPU: oneDNN where it multiplies faster than BLAS or autocast.

An nn.Linear on the CPU in fp32 multiplies through BLAS (MKL's sgemm), forward and backward. On 2 AMD EPYC
cores (AVX512), oneDNN's matmul ran ViT-S/16's layer shapes at batch 32 (6,304 rows) about 10% faster forward and
for the input's gradient (155-220 GFLOP/s against 115-200; forward, its weight reordered into oneDNN's layout on
each call; for the input's gradient, read transposed in place), while MKL stays the faster for the weight's
gradient (g^T x: 164-172 GFLOP/s, oneDNN 87-118 through the transposed copies it needs). So in fp32 training a
large enough layer runs forward and input gradient through oneDNN and the weight gradient through MKL: one layer's
forward and backward 0.97-1.25x nn.Linear's (median 1.08x, 15 cases) at 2,364 to 12,608 rows, a ViT-S/16 fp32
training step 1.09x. The same function to the rounding of another fp32 summation order.

Under CPU bf16 autocast the products are oneDNN's already, but autocast's addmm first copies the bias into the
output and then accumulates into it; oneDNN adds the bias inside its matmul instead, with the same bits (the
output, and every gradient, as autocast gives them): 1.2-2 ms less of a ViT-S/16 layer's 13-19 ms at batch 32, a
bf16-autocast ViT-S/16 training step 1.04x. A gradient of the gradient is refused there, as by the bf16 GELU
kernel.

Where it does not pay it is nn.Linear as it is: fewer than 2,048 rows (at 1,576 rows oneDNN was no faster and at
197 it was 0.74x, the reorders and the Python autograd function costing more than they save), a side narrower
than 128 (64-wide layers ran 0.90-1.02x at 6,120 rows), inference (no autograd recording), other dtypes
(autocast to fp16 too) and devices, and anything that needs to see an nn.Linear call: traced and compiled graphs
(inductor picks its own kernels), torch.func transforms, and a layer with hooks or a subclass (LoRA, quantised
layers). The thresholds were measured in fp32; bf16 keeps them.
"""

from __future__ import annotations

import functools
import platform
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from ..device import cpu_autocast_is_bf16

MIN_ROWS = 2048  # rows of the input (all but its last dim) from which oneDNN's matmul is the faster
MIN_SIDE = 128  # in_features and out_features both at least this


@functools.cache
def _has_onednn() -> bool:
    # measured on x86 only; on other CPUs torch's oneDNN build runs other kernels (Arm: ACL)
    return torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


def _reordered(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True) -> torch.Tensor:
    """x W^T + b through oneDNN (x: (..., in), weight: (out, in), any strides). ``pack``: reorder the weight into
    oneDNN's layout first, as the forward does; the input's gradient passes W^T as a view of the weight, which oneDNN
    reads in place: at ViT-S/16's layer shapes and 6,304 rows 1.01-1.04x faster than packing a transposed copy
    (21 rounds taking turns; a ViT-S/16 fp32 training step 1.021x, 15 rounds)."""
    return torch.ops.mkldnn._linear_pointwise(x, _reordered(weight) if pack else weight, bias, "none", [], "")


def _param_grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight's gradient g^T x through BLAS (faster than oneDNN there) and the bias's, in grad's dtype."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # (rows, out), (rows, in)
    gw = g2.t().mm(x2) if ctx.needs_input_grad[1] else None
    gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return gw, gb


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _matmul(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = None
        if ctx.needs_input_grad[0]:  # with create_graph=True (a gradient of the gradient) in differentiable ops
            gx = grad.matmul(weight) if torch.is_grad_enabled() else _matmul(grad, weight.t(), None, pack=False)
        return gx, *_param_grads(ctx, grad, x)


class _OneDnnLinearAutocast(torch.autograd.Function):
    """Under CPU bf16 autocast: the bias added inside oneDNN's matmul, where autocast's addmm first copies it into
    the output (1.2-2 ms of a ViT-S/16 layer's 13-19 at batch 32). Casts, products and gradients as autocast's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.has_bias = bias is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return _matmul(xb, wb, None if bias is None else bias.to(torch.bfloat16))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xb, wb = ctx.saved_tensors
        grad = grad.to(torch.bfloat16).contiguous()
        gx = grad.matmul(wb) if ctx.needs_input_grad[0] else None  # bf16 products run on oneDNN already
        # each gradient in its input's dtype, as autocast's casts give them
        return tuple(
            None if g is None else g.to(dtype)
            for g, dtype in zip((gx, *_param_grads(ctx, grad, xb)), ctx.dtypes, strict=True)
        )


def _plain(layer: nn.Module) -> bool:
    """An nn.Linear itself whose call would run nothing but its forward: no hooks on it, and no global module
    hooks."""
    return type(layer) is nn.Linear and not (
        layer._forward_hooks
        or layer._forward_pre_hooks
        or layer._backward_hooks
        or layer._backward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight, bias)`` runs vitkit's oneDNN matmuls (the cases in the module's docstring)."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps F.linear, and inductor picks its kernels
        return False
    # the size checks first: they turn away small models' layers for the least time a call
    if x.dim() < 2 or min(weight.shape) < MIN_SIDE or x.numel() < MIN_ROWS * x.shape[-1]:
        return False
    autocast = torch.is_autocast_enabled("cpu")
    return (
        x.device.type == "cpu"
        and weight.dtype == torch.float32
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and autocast))
        and (not autocast or cpu_autocast_is_bf16())
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad)
        and _has_onednn()
        and not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); in training on a CPU, at sizes where it is faster, through vitkit's oneDNN calls
    (fp32: forward and input gradient; bf16 autocast: the bias inside the matmul)."""
    if uses_onednn(x, weight):
        function = _OneDnnLinearAutocast if torch.is_autocast_enabled("cpu") else _OneDnnLinear
        return function.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def dense(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a Dense layer: ``linear`` for a plain nn.Linear, the layer's own call for anything else."""
    if isinstance(layer, nn.Linear) and _plain(layer):
        return linear(x, layer.weight, layer.bias)
    return layer(x)
