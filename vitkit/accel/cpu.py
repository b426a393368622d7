"""oneDNN on a CPU: the Dense layers' matmuls in training and inference, and the MLP's GELU fused into them.

An nn.Linear on a CPU multiplies through BLAS (MKL's sgemm in fp32). Swapped in by vitkit.accel.training, a layer
whose sides are both at least MIN_SIDE (``OneDnnLinear``) runs its forward and its input's gradient as oneDNN
matmuls, which are faster there at these shapes, and its weight's gradient through BLAS, which is faster for that
product; under bf16 autocast the bias is added inside oneDNN's matmul rather than copied into the output first.
In inference (autograd not recording) it is one oneDNN matmul on the weight as it is. ``FusedMlp`` runs the MLP's
GELU and second layer as one autograd function that keeps only the GELU's input for the backward pass, computing
its output again in the kernel that gives the input's gradient. ``PackedLinear`` (vitkit.accel.inference) holds a
weight packed once in oneDNN's layout, its GELU applied by oneDNN to the matmul's output.

Each is the function of the layers it replaces, to the rounding of another summation order; each gives way to
torch's ops where something must see them (traced and compiled graphs, torch.func transforms, dispatch modes,
tensor subclasses). Measured by benchmarks/train_ceiling.py and benchmarks/inference_onednn.py.
"""

from __future__ import annotations

import copy
import functools
import platform
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from ..device import cpu_autocast_is_bf16
from ..models.vit import Mlp
from .kernels import Kernels, TanhGELU, recorded_backward_and_output, transformed, transformed_backward

MIN_ROWS = 2048  # rows of the input (all but its last dim): from these fp32's forward packs the weight first, and
# bf16 autocast runs oneDNN's matmul at all
MIN_SIDE = 128  # in_features and out_features both at least this


@functools.cache
def has_onednn() -> bool:
    # measured on x86 only; on other CPUs torch's oneDNN build runs other kernels (Arm: ACL)
    return torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX512 or AVX-NE-CONVERT; torch's own check): without, its bf16
    matmul and weight reorder refuse to run (AVX2-only CPUs), and bf16 stays with F.linear."""
    return has_onednn() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _reordered(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True) -> torch.Tensor:
    """x W^T + b through oneDNN (x: (..., in), weight: (out, in), any strides). ``pack``: reorder the weight into
    oneDNN's layout first, as the forward does; the input's gradient passes W^T as a view of the weight, which oneDNN
    reads in place, faster than packing a transposed copy."""
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
    the output. Casts, products and gradients as autocast's."""

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
        and has_onednn()
        and not transformed()
        and not _dispatch_mode()
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight, bias)`` runs vitkit's oneDNN matmuls in training (the module docstring's cases)."""
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
    """Whether ``linear(x, weight, bias)`` runs as one oneDNN matmul in inference: on a CPU, autograd not recording,
    fp32 or bf16 throughout, a contiguous weight, no autocast, both sides at least MIN_SIDE."""
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


def gelu_dense(act: nn.Module, layer: nn.Module, h: torch.Tensor) -> torch.Tensor | None:
    """layer(act(h)) as one autograd function (_GeluLinear) where act is a TanhGELU running its compiled kernels on h
    and layer would run the oneDNN matmuls; None elsewhere, where the caller runs the two apart. Neither module may
    have hooks: their calls are not made."""
    # the size checks in uses_onednn first: they turn small models away for the least time a call
    if not (isinstance(layer, nn.Linear) and uses_onednn(h, layer.weight) and isinstance(act, TanhGELU)):
        return None
    if not (unhooked(layer) and unhooked(act)):
        return None
    kernels = act.kernels(h)
    if kernels is None:
        return None
    return _GeluLinear.apply(h, layer.weight, layer.bias, kernels, torch.is_autocast_enabled("cpu"))


class OneDnnLinear(nn.Linear):
    """An nn.Linear whose products run through ``linear``: oneDNN where it is the faster on a CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedMlp(Mlp):
    """vit.Mlp whose GELU and second layer run as one function in training where they can (``gelu_dense``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if not (self.training and self.drop.p) and unhooked(self.drop):  # nothing between the GELU and fc2
            y = gelu_dense(self.act, self.fc2, h)
            if y is not None:
                return self.drop(y)
        return self.drop(self.fc2(self.drop(self.act(h))))


def swap_for_training(model: nn.Module) -> int:
    """Make model's nn.Linear layers of sides >= MIN_SIDE OneDnnLinear and the MLPs whose second layer is one FusedMlp,
    in place (same modules and parameters, only their class changes); how many changed. No-op without oneDNN."""
    if not has_onednn():
        return 0
    swapped = 0
    for m in model.modules():
        if type(m) is nn.Linear and min(m.in_features, m.out_features) >= MIN_SIDE:
            m.__class__ = OneDnnLinear
            swapped += 1
        elif type(m) is Mlp and min(m.fc2.in_features, m.fc2.out_features) >= MIN_SIDE:  # where gelu_dense can run
            m.__class__ = FusedMlp
            swapped += 1
    return swapped


def _copy_sharing_packed(layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """copy.deepcopy of a layer holding an opaque oneDNN ``packed_weight``: the copy shares that tensor, which cannot
    be copied (its storage is not addressable) and which nothing writes to, and copies everything else."""
    memo[id(layer.packed_weight)] = layer.packed_weight
    new = layer.__class__.__new__(layer.__class__)
    memo[id(layer)] = new
    new.__dict__.update(copy.deepcopy(layer.__dict__, memo))
    return new


class PackedLinear(nn.Module):
    """An nn.Linear for CPU inference, its weight packed once in oneDNN's layout (rather than MKL's sgemm in fp32, or a
    reorder on every call in bf16): one oneDNN matmul a call, the bias and, with ``gelu`` (the nn.GELU after it), the
    GELU applied inside it. No gradient flows through it."""

    def __init__(self, linear: nn.Linear, gelu: nn.GELU | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor, kept out of state_dict and .to(): the weight as saved is the nn.Linear's
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias  # shared with the linear layer
        # oneDNN's post-op: "gelu" with algorithm "none" (erf) or "tanh", nn.GELU's own names for the two
        self.post_op, self.algorithm = ("gelu", gelu.approximate) if gelu is not None else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self.post_op, [], self.algorithm)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return _copy_sharing_packed(self, memo)

    def extra_repr(self) -> str:
        gelu = f", gelu={self.algorithm!r}" if self.post_op == "gelu" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{gelu}"


def can_pack_linears(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether pack_linears applies to weights of dtype: on the CPU, where torch has oneDNN, and for bf16 where
    oneDNN multiplies it (no AVX2-only CPU: there its bf16 reorder refuses to run)."""
    cpu = device.type == "cpu" and torch.backends.mkldnn.is_available()
    return cpu and (dtype != torch.bfloat16 or onednn_bf16())


def pack_linears(model: nn.Module) -> nn.Module:
    """A copy of a frozen CPU model (``shared_copy``) in which every nn.Linear is a PackedLinear, an MLP's GELU fused
    into its first layer. Subclasses of nn.Linear (LoRA, quantised layers, nn.MultiheadAttention's projection, read
    by weight) and layers with hooks (which the replacement would not run) are left as they are."""
    packed = shared_copy(model)
    for mlp in [m for m in packed.modules() if isinstance(m, Mlp)]:
        if _plain_linear(mlp.fc1) and isinstance(mlp.act, nn.GELU) and not has_hooks(mlp.act):
            mlp.add_module("fc1", PackedLinear(mlp.fc1, mlp.act))  # replaces the layer under its name
            mlp.add_module("act", nn.Identity())
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if _plain_linear(child):
                setattr(parent, name, PackedLinear(child))
    return packed


def _plain_linear(layer: nn.Module) -> TypeGuard[nn.Linear]:
    """An nn.Linear itself without hooks of its own, which a packed or quantised layer may replace (its hooks would
    not run on the replacement; global module hooks run on any module)."""
    return type(layer) is nn.Linear and not has_hooks(layer)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of model's modules that shares every parameter and buffer with it: swaps on the copy leave the model
    as it was, and the copy computes with the model's weights."""
    return copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())})
