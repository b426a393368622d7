"""The Dense layers' matmuls on a CPU, in training and inference: oneDNN where it is faster than BLAS or autocast.

An nn.Linear on the CPU in fp32 multiplies through BLAS (MKL's sgemm), forward and backward. On 2 AMD EPYC
cores (AVX512), oneDNN's matmul ran ViT-S/16's layer shapes at batch 32 (6,304 rows) about 10% faster forward and
for the input's gradient (155-220 GFLOP/s against 115-200; forward, its weight reordered into oneDNN's layout on
each call; for the input's gradient, read transposed in place), while MKL stays the faster for the weight's
gradient (g^T x: 164-172 GFLOP/s, oneDNN 87-118 through the transposed copies it needs). So in fp32 training a
large enough layer runs forward and input gradient through oneDNN and the weight gradient through MKL: one layer's
forward and backward 0.97-1.25x nn.Linear's (median 1.08x, 15 cases) at 2,364 to 12,608 rows, a ViT-S/16 fp32
training step 1.09x. The same function to the rounding of another fp32 summation order. Below 2,048 rows the
forward reads the weight as it is rather than reordering it first, which costs more than it saves there (with the
reorder oneDNN was no faster at 1,576 rows, and down to 0.61x at 8 rows on ViT-S/16's shapes): the layer's
forward and backward then ran 1.00-1.86x nn.Linear's at 8 rows, 1.07-1.44x at 32, 1.03-1.23x at 197 and
1.01-1.07x at 1,576 (ViT-S/16's and ViT-B/16's layer shapes, 9 rounds taking turns in one process), and a whole
fp32 training step 1.037x for ViT-S/16 at batch 8 (95% interval 1.028-1.055, 12 rounds) and 1.049x for ViT-B/16 at
batch 4 (1.044-1.062, 10 rounds); at 6,304 rows the reorder still pays (1.07-1.12x against 1.05-1.10x as it is).
Small batches gain (fine-tuning on a CPU), and the class-token-only last block's layers at any batch.

Under CPU bf16 autocast the products are oneDNN's already, but autocast's addmm first copies the bias into the
output and then accumulates into it; oneDNN adds the bias inside its matmul instead, with the same bits (the
output, and every gradient, as autocast gives them): 1.2-2 ms less of a ViT-S/16 layer's 13-19 ms at batch 32, a
bf16-autocast ViT-S/16 training step 1.04x. A gradient of the gradient is refused there (the backward pass reads
the weight's bf16 copy, which autograd cannot trace back to the parameter); in fp32 it is F.linear's.

Where it does not pay it is nn.Linear as it is: under bf16 autocast fewer than 2,048 rows (at 32 to 197 rows
0.94-1.05x with the weight as it is, 0.72-0.93x reordered), a side narrower than 128 (64-wide layers ran 0.90-1.02x
at 6,120 rows; measured in fp32, bf16 keeps it), other dtypes (autocast to fp16 too) and devices, and anything
that needs to see an nn.Linear call: traced and compiled graphs (inductor picks its own kernels), torch.func
transforms and forward-mode AD, Python dispatch modes (FlopCounterMode, which has no formula for oneDNN's op),
tensor subclasses (torchao's quantised weights), and a layer with hooks or a subclass (LoRA, quantised layers).

The MLP's second layer reads the GELU's output twice: as its input, and in the backward pass for its weight's
gradient, so the two called apart keep both the GELU's input (for its gradient) and its output, two hidden
activations a block. Where both run the code above (the GELU its compiled kernels, vitkit.models.gelu), the MLP
calls them as one function (``gelu_dense``) that keeps the GELU's input alone and computes its output again in the
backward pass, in the kernel that gives the input's gradient: the same outputs and gradients bit for bit, and a
ViT-S/16 training step at batch 32 (2 AMD EPYC cores) took 1637-1653 MiB against 1905-1914 in fp32 and 1203-1318
against 1453-1458 under bf16 autocast, as fast (1.011x, 95% interval 0.998-1.025, and 0.996x, 0.972-1.003;
13 and 15 rounds taking turns in one process).

In inference (autograd not recording) a layer whose sides are both at least 128, in fp32 or bf16 with the weight
in the input's dtype and no autocast, is one oneDNN matmul on the weight as it is (no reorder, no autograd
function), whatever its rows, where nn.Linear runs MKL's sgemm in fp32 (in bf16 it runs oneDNN's matmul already,
with the same bits). The MLP's first layer then applies the GELU (erf or tanh, as the nn.GELU after it says) to the
matmul's fp32 output inside the same call (``dense_gelu``): a pass over the hidden activations fewer and, in bf16,
one rounding fewer, where ATen's tanh GELU is slow on the CPU in both precisions. ``python
benchmarks/inference_onednn.py``, two runs on 2 AMD EPYC cores (AVX512-BF16), 9 rounds taking turns in one process:
ViT-B/16's layer shapes 1.07-1.27x faster in fp32 at 197 rows and 1.01-1.11x at 1,576 and 12,608, 0.99-1.06x in
bf16; its first MLP layer with the GELU 1.13-1.37x in fp32 and 1.16-1.22x in bf16; and the model itself, as built
or after ``model.to(torch.bfloat16)``, eagerly against the same model with its layers called as nn.Linear and
nn.GELU, 1.22x and 1.35x in fp32 at batch 1, 1.11x and 1.09x at batch 8, 1.06x and 1.09x in bf16 at batch 1,
1.09x and 1.10x at batch 8. fp32's largest error against float64 is oneDNN's summation's, 3-6e-6 where MKL's is
1-3e-6 at these shapes; bf16's logits are the closer to float64's (mean error 0.0044 against 0.0048 at batch 1).
Under bf16 autocast inference keeps F.linear: autocast casts each fp32 weight to bf16 once for as long as its
context lasts, where casting the operands here cast them on every call; with the context held over the calls,
the model ran 0.98x at batch 1 (1.04x at batch 8), though the first MLP layer with its GELU ran 1.11-1.20x.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from ..device import cpu_autocast_is_bf16
from .gelu import GELU, Kernels, recorded_backward_and_output
from .transforms import transformed, transformed_backward

MIN_ROWS = 2048  # rows of the input (all but its last dim): from these fp32's forward packs the weight first, and
# bf16 autocast runs oneDNN's matmul at all
MIN_SIDE = 128  # in_features and out_features both at least this


@functools.cache
def _has_onednn() -> bool:
    # measured on x86 only; on other CPUs torch's oneDNN build runs other kernels (Arm: ACL)
    return torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX512 or AVX-NE-CONVERT; torch's own check): without, its bf16
    matmul and weight reorder refuse to run (AVX2-only CPUs), and bf16 stays with F.linear."""
    return _has_onednn() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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


def _input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """g W. In fp32 through oneDNN reading W^T in place; in bf16 torch's matmul, on oneDNN already; and with
    create_graph=True (a gradient of the gradient) or under a transform (is_grads_batched's vmap) torch's matmul,
    which those see through."""
    if weight.dtype == torch.float32 and not torch.is_grad_enabled() and not transformed_backward(grad):
        return _matmul(grad, weight.t(), None, pack=False)
    return grad.matmul(weight)


def _in_dtypes(grads: tuple[torch.Tensor | None, ...], dtypes: tuple[torch.dtype | None, ...]) -> tuple:
    """Each gradient in its input's dtype, as autocast's casts give them."""
    return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True))


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _matmul(x, weight, bias, pack=x.numel() >= MIN_ROWS * x.shape[-1])  # fewer rows: the weight as it is

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = _input_grad(grad, weight) if ctx.needs_input_grad[0] else None
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
        gx = _input_grad(grad, wb) if ctx.needs_input_grad[0] else None
        return _in_dtypes((gx, *_param_grads(ctx, grad, xb)), ctx.dtypes)


def has_hooks(module: nn.Module) -> bool:
    """Whether module has hooks of its own (forward, forward-pre or backward), which run only where it is called."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def unhooked(module: nn.Module) -> bool:
    """Whether a call of module would run nothing but its forward: no hooks on it, and no global module hooks."""
    return not (
        has_hooks(module)
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    )


class _GeluLinear(torch.autograd.Function):
    """linear(gelu(h), weight, bias) in training, the GELU's compiled kernels and the matmuls as above (fp32, or
    bf16 autocast's casts), keeping h alone for the backward pass: the GELU's output, which the weight's gradient
    reads, is computed again by the GELU's backward kernel in the pass that gives h's gradient, rather than kept
    from the forward pass. The outputs and gradients are those of the GELU and the layer called apart, bit for bit."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels, autocast: bool
    ) -> torch.Tensor:
        ctx.kernels, ctx.has_bias, ctx.autocast = kernels, bias is not None, autocast
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        x = kernels.forward(h)
        if autocast:
            x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
            bias = None if bias is None else bias.to(torch.bfloat16)
        ctx.save_for_backward(h, weight)
        return _matmul(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # create_graph=True in fp32: the GELU as torch's ops, which autograd records with the matmuls, so that a
        # gradient of the gradient is that of the two layers; under autocast the saved bf16 weight is a copy that
        # autograd cannot trace back to the parameter, and a gradient of the gradient is refused
        recorded = torch.is_grad_enabled()
        if (recorded and not ctx.autocast) or (transformed_backward(grad) and not recorded):
            return _GeluLinear._gradients(ctx, grad, recorded_backward_and_output)
        return _GeluLinear._kernel_backward(ctx, grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _kernel_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _GeluLinear._gradients(ctx, grad, ctx.kernels.backward_and_output)

    @staticmethod
    def _gradients(ctx: Any, grad: torch.Tensor, gelu_backward: Callable[..., Any]) -> tuple[torch.Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype).contiguous()
        # the GELU output's gradient as the two layers above give it, in the GELU's dtype
        gh, x = gelu_backward(_input_grad(grad, weight).to(h.dtype), h)
        return gh, *_in_dtypes(_param_grads(ctx, grad, x.to(weight.dtype)), ctx.dtypes), None, None


def _plain(layer: nn.Module) -> bool:
    """An nn.Linear itself whose call would run nothing but its forward."""
    return type(layer) is nn.Linear and unhooked(layer)


def _plain_tensors(*tensors: torch.Tensor | None) -> bool:
    """Whether each is a tensor or parameter itself, no subclass: a tensor subclass (torchao's quantised weights,
    DTensor, ...) implements F.linear's ops for itself, and knows nothing of oneDNN's."""
    return all(t is None or type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


def _dispatch_mode() -> bool:
    """Whether a Python dispatch mode is active (FlopCounterMode, torch's tracing modes): it sees each ATen call,
    and knows nothing of oneDNN's matmul op (FlopCounterMode counts it as no FLOPs)."""
    return torch._C._len_torch_dispatch_stack() > 0


def _onednn_may_run(x: torch.Tensor, *operands: torch.Tensor | None) -> bool:
    """What both of vitkit's oneDNN paths ask past their sizes and dtypes: a CPU input, no tensor subclass, oneDNN
    here, and nothing that must see F.linear's own ops (torch.func transforms, forward-mode AD, dispatch modes)."""
    return (
        x.device.type == "cpu"
        and _plain_tensors(x, *operands)
        and _has_onednn()
        and not transformed()
        and not _dispatch_mode()
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight, bias)`` runs vitkit's oneDNN matmuls in training (the cases in the module's
    docstring)."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps F.linear, and inductor picks its kernels
        return False
    # the size checks first: they turn away small models' layers for the least time a call
    if x.dim() < 2 or min(weight.shape) < MIN_SIDE:
        return False
    autocast = torch.is_autocast_enabled("cpu")
    if autocast and x.numel() < MIN_ROWS * x.shape[-1]:
        return False
    return (
        weight.dtype == torch.float32
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and autocast))
        and (not autocast or (cpu_autocast_is_bf16() and onednn_bf16()))
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad)
        and _onednn_may_run(x, weight)
    )


def infers_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs as one oneDNN matmul in inference (the module's docstring): on a
    CPU, autograd not recording, fp32 or bf16 throughout, a contiguous weight, no autocast, both sides at least
    MIN_SIDE."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps F.linear, and inductor picks its kernels
        return False
    if x.dim() < 2 or min(weight.shape) < MIN_SIDE:  # first: they turn away small models' layers soonest
        return False
    dtype = x.dtype
    recorded = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    return (
        (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16()))
        and weight.dtype == dtype
        and weight.is_contiguous()  # as a layer's own (row slices too): the layout these rates were measured in
        and (bias is None or bias.dtype == dtype)
        and not recorded
        and not torch.is_autocast_enabled("cpu")
        and _onednn_may_run(x, weight, bias)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on a CPU, where it is faster, through oneDNN: in training vitkit's autograd
    functions (fp32: forward and input gradient; bf16 autocast: the bias inside the matmul), in inference one
    oneDNN matmul on the weight as it is."""
    if uses_onednn(x, weight):
        function = _OneDnnLinearAutocast if torch.is_autocast_enabled("cpu") else _OneDnnLinear
        return function.apply(x, weight, bias)
    if infers_onednn(x, weight, bias):
        return _matmul(x, weight, bias, pack=False)
    return F.linear(x, weight, bias)


def dense_gelu(layer: nn.Module, act: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """act(layer(x)) as one oneDNN matmul that applies the GELU to its output, where ``linear`` would infer
    through oneDNN (``infers_onednn``) and act is an nn.GELU (erf or tanh); None elsewhere, where the caller runs
    the two apart. Neither module may have hooks: their calls are not made."""
    if type(layer) is not nn.Linear or not infers_onednn(x, layer.weight, layer.bias):
        return None
    if type(act) not in (GELU, nn.GELU) or not (unhooked(layer) and unhooked(act)):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "gelu", [], act.approximate)


def gelu_dense(act: nn.Module, layer: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """layer(act(h)) as one autograd function (_GeluLinear) where act is vitkit's GELU running its compiled kernels
    on h and ``dense(layer, ...)`` would run vitkit's oneDNN matmuls; None elsewhere, where the caller runs the two
    apart. Neither module may have hooks: their calls are not made."""
    # the size checks in uses_onednn first: they turn small models away for the least time a call
    if not (type(layer) is nn.Linear and uses_onednn(h, layer.weight) and type(act) is GELU):
        return None
    if not (unhooked(layer) and unhooked(act)):
        return None
    kernels = act.kernels(h)
    if kernels is None:
        return None
    return _GeluLinear.apply(h, layer.weight, layer.bias, kernels, torch.is_autocast_enabled("cpu"))


def dense(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a Dense layer: ``linear`` for a plain nn.Linear, the layer's own call for anything else."""
    if isinstance(layer, nn.Linear) and _plain(layer):
        return linear(x, layer.weight, layer.bias)
    return layer(x)
