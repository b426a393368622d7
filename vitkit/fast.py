"""One switch for fast inference: ``optimize_for_inference(model, precision="auto" | "fp32" | "bf16" | "int8")``.

The model's own forward is already lean, with or without this switch: q, k and v come from one fused matmul,
laid out so that backward stacks their gradients without a copy, and a class-token model's last block computes
the class token alone (the head reads nothing else; ViT-B/16: 32.7 instead of 35.1 GFLOP per image).

What the switch adds, and why each step pays (measured with ``vitkit bench``):
- eval mode, no autograd, parameters frozen: no dropout, no graph bookkeeping.
- bf16 weights where the hardware runs bf16 matmuls natively (CUDA with bf16, CPUs with AMX or AVX512-BF16):
  half the memory traffic and several times the matmul rate. Elsewhere bf16 is emulated and slower than fp32,
  so the model stays fp32 with a warning.
- int8 on request (``precision="int8"``, CPU): every nn.Linear in int8, weights per output channel, activations
  per token, quantised at each call, products summed in int32 (Int8Linear; on CPUs without VNNI, fbgemm's
  dynamic kernels instead). ViT-B/16 spends ~95% of its FLOPs in those matmuls, which run ~4x faster than fp32;
  the patch embedding, norms and GELU stay fp32, and attention, which has no int8 kernel, is written out in bf16
  where bf16 matmuls are native (Attention.attend_dtype: 1.5-1.8x fp32 SDPA's speed, 1.00-1.04x over a whole
  ViT-B/16). Int8Linear is plain tensor ops around one int8 matmul, so torch.compile fuses each layer's
  quantisation and rescale into its neighbours. It changes the numerics more than bf16 does, so "auto" never picks
  it: the benchmark prints its top-1 agreement with fp32.
- the attention path the precision runs fastest ("auto", whatever the model's configured default): the fused
  kernel (SDPA), except in bf16 on a CPU, where attention written out (two bf16 batched matmuls and a softmax) ran
  ViT-B/16 1.05-1.08x faster than SDPA's CPU kernel (vitkit.models.attention.attends_explicitly).
- freed memory kept for reuse (tune_cpu_allocator, on the CPU): activations of tens of MB otherwise come from
  fresh pages that the kernel faults in and zero-fills on every call.
- fp32 and bf16 Linear weights packed once for oneDNN on the CPU (PackedLinear, in a copy of the model that
  shares its other tensors): each call is then one oneDNN matmul, neither MKL's sgemm (fp32) nor a weight
  reorder on every call (bf16).
- torch.compile with inductor *freezing*: weights become constants, so inductor folds them, packs those it
  finds (fp32 for MKL, bf16 for oneDNN) and fuses bias/GELU/residual epilogues. Freezing is a global inductor
  setting; it is switched on only around this model's calls (compilation happens lazily on the first call, and
  again on a new shape).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

import torch
from torch import nn

from .device import bf16_is_fast, cpu_has_vnni
from .errors import UserError
from .models import VisionTransformer
from .models.attention import Attention
from .models.common import Mlp
from .models.linear import has_hooks, onednn_bf16

PRECISIONS = ("auto", "fp32", "bf16", "int8")
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# torch.compile modes; "reduce-overhead" replays CUDA graphs
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16, also spelled 'fp32' / 'bf16'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise UserError(f"dtype {dtype}: expected torch.float32 or torch.bfloat16")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile's inductor backend can build kernels here (CPU kernels need a C++ compiler)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))


_allocator_tuned = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def tune_cpu_allocator() -> bool:
    """Let glibc's malloc keep and reuse freed memory, for every tensor of this process; True if applied.

    By default an allocation above a threshold (at most 32 MiB) is a fresh mmap, unmapped again when freed, so each
    large activation is page-faulted and zero-filled by the kernel on every step; for an elementwise op that costs
    more than the op (a 39 MB copy: 16.5 ms before, 2.0 ms after, on 2 AVX2 cores). Raising the mmap and trim
    thresholds keeps freed memory in the heap for the next step, the effect of preloading jemalloc or tcmalloc.
    The resident set then stays near its peak instead of shrinking between steps. Idempotent; a no-op (False)
    outside Linux/glibc.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    _allocator_tuned = ok
    return ok


def cpu_allocator_tuned() -> bool:
    return _allocator_tuned


@contextlib.contextmanager
def inductor_freezing() -> Iterator[None]:
    """Inductor freezing switched on for the duration of the block only (it is a process-wide setting)."""
    from torch._inductor import config

    with config.patch(freezing=True):
        yield


def compile_for_inference(fn: Callable[..., Any], mode: str = "default") -> Callable[..., Any]:
    """torch.compile(fn) whose calls (and so its lazy compilations) run with inductor freezing, without grad.

    Shared by the fast path and the benchmark, so that a peer model compiled for comparison gets the same
    settings as vitkit's.
    """
    if mode not in COMPILE_MODES[1:]:
        raise UserError(f"compile mode {mode!r}: expected one of {COMPILE_MODES[1:]}")
    compiled = torch.compile(fn, mode=mode)

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), inductor_freezing():
            return compiled(*args, **kwargs)

    return run


def _copy_sharing_packed(layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """copy.deepcopy of a layer holding an opaque oneDNN ``packed_weight``: the copy shares that tensor, which cannot
    be copied (its storage is not addressable) and which nothing writes to, and copies everything else."""
    memo[id(layer.packed_weight)] = layer.packed_weight
    new = layer.__class__.__new__(layer.__class__)
    memo[id(layer)] = new
    new.__dict__.update(copy.deepcopy(layer.__dict__, memo))
    return new


INT8_KERNELS = ("auto", "onednn", "fbgemm")
_EPS = float(torch.finfo(torch.float32).tiny)


class Int8Linear(nn.Module):
    """An nn.Linear for inference in int8: ``y = (q(x) @ q(W)^T) * s_x * s_w + b``.

    Weights are symmetric int8 per output channel, ``s_w = max|W_o,:| / 127``. Activations are symmetric int8 per
    token (per row of the input flattened to 2-D), ``s_x = max|x_t| / 127``, computed at each call, so that a
    token's rounding error follows its own range and not the largest in the batch. The products sum exactly in
    int32 in oneDNN's int8 matmul on the weight packed once in its blocked layout (torch.ops.onednn's qlinear, the
    kernel of torch's own x86 int8 lowering): the activations go in shifted by 128 to unsigned bytes, the form its
    VNNI kernels multiply, and it takes the shift back exactly in int32 and applies s_w; s_x and the bias follow.
    Written in plain tensor ops around that one call, so torch.compile fuses the quantisation into the op before it
    (LayerNorm, GELU) and the rescale into the op after it: ViT-B/16 at batch 8 on 2 VNNI cores ran at 1.14-1.22x
    fbgemm's dynamic int8 compiled, and at 0.95-0.97x eagerly, where each of those ops is a pass over the
    activations. Against torch._int_mm on the unpacked weight, the packed weight ran a compiled ViT-B/16 1.29x
    faster at batch 1 and 1.04-1.06x at batch 8 and 64 (docs/speed.md).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        _require_vnni()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp_min(_EPS) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor, kept out of state_dict and .to() (as PackedLinear's): int8 models are not saved
        self.packed_weight = torch.ops.onednn.qlinear_prepack((w / scale[:, None]).round().to(torch.int8), None)
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale)
        self.weight_zero_point: torch.Tensor
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.int32), persistent=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(1, keepdim=True).clamp_min(_EPS) / 127  # (tokens, 1)
        unsigned = ((rows / scale).round() + 128).to(torch.uint8)  # q(x) + 128: exact, q(x) is in [-127, 127]
        y = self.products(unsigned) * scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def products(self, unsigned: torch.Tensor) -> torch.Tensor:
        """(q(x) @ q(W)^T) * s_w from the quantised rows shifted to unsigned bytes, q(x) + 128 (tokens, in): the one
        library call, summed in int32 by oneDNN."""
        return torch.ops.onednn.qlinear_pointwise(
            *(unsigned, 1.0, 128, self.packed_weight, self.weight_scale, self.weight_zero_point),
            *(None, 1.0, 0, torch.float32, "none", [None], ""),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return _copy_sharing_packed(self, memo)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _has_vnni_layer() -> bool:
    """Whether Int8Linear runs here: oneDNN present and 8-bit dot products (VNNI) in the CPU."""
    return cpu_has_vnni() and torch.backends.mkldnn.is_available()


def _require_vnni() -> None:
    """Int8Linear's products are exact only with 8-bit dot products (VNNI): without them oneDNN multiplies unsigned
    by signed bytes with vpmaddubsw, whose int16 pair sums saturate (255 x 127 x 2 > 32767), so the layer refuses."""
    if not _has_vnni_layer():
        raise UserError(
            "int8 kernel 'onednn' (Int8Linear): this CPU has no VNNI, where its unsigned x signed byte products would "
            "saturate; use the 'fbgemm' kernel (what 'auto' picks here)"
        )


def int8_kernel(kernel: str = "auto") -> str:
    """The int8 path for this CPU: "onednn" (Int8Linear, oneDNN's int8 matmul on packed weights) with 8-bit
    dot-product instructions, else "fbgemm".

    Without VNNI, int8 x int8 products (torch._int_mm) multiplied slower than fp32 (2 AVX2 cores) and oneDNN's
    unsigned x signed ones saturate (_require_vnni), while fbgemm's dynamic kernels multiply unsigned by signed
    bytes (vpmaddubsw) at about three times fp32 on 7-bit activations.
    """
    if kernel not in INT8_KERNELS:
        raise UserError(f"int8 kernel {kernel!r}: expected one of {INT8_KERNELS}")
    if kernel == "auto":
        return "onednn" if _has_vnni_layer() else "fbgemm"
    if kernel == "onednn":
        _require_vnni()
    return kernel


def quantize_int8(model: nn.Module, kernel: str = "auto") -> nn.Module:
    """A frozen copy of an fp32 model whose nn.Linear layers run in int8; the model is untouched.

    ``kernel`` "onednn" (the default where the CPU has VNNI): every nn.Linear becomes an Int8Linear, with per-token
    activation scales, which torch.compile fuses. "fbgemm" (the default elsewhere): torch's dynamic quantisation,
    weights int8 per output channel, activations quantised per call from the whole input's min/max to 7 bits
    (AVX2's u8 x s8 multiply-add saturates at int16 with 8), run eagerly (torch.compile cannot trace it). With
    either kernel a Linear layer with hooks of its own stays as it is, in fp32: its replacement would not run them.
    Other layers keep their fp32 weights (copies, not the originals). With "onednn", where bf16 matmuls are native,
    the copy's attention layers compute in bf16, written out (Attention.attend_dtype): torch has no int8 kernel for
    attention, and fp32 SDPA took about a fifth of a compiled ViT-B/16's time.
    """
    kernel = int8_kernel(kernel)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise UserError("int8: quantise an fp32 model (this one has other parameter dtypes)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UserError("int8: the int8 kernels run on the CPU only; move the model with .cpu() first")
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    if kernel == "onednn":
        attend_in_bf16 = bf16_is_fast(torch.device("cpu"))
        for parent in list(frozen.modules()):
            if attend_in_bf16 and isinstance(parent, Attention):
                parent.attend_dtype = torch.bfloat16
            for name, child in parent.named_children():
                if _plain_linear(child):
                    setattr(parent, name, Int8Linear(child))
        return frozen
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    # torch.ao.quantization.quantize_dynamic is deprecated in favour of torchao, a separate package; within torch
    # itself it is still the only public route to fbgemm's dynamic int8 linear kernels. Its deprecation warnings
    # are silenced for this call only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(torch\.ao\.quantization|quantized tensor).*deprecated")
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_\w+.* are deprecated", category=UserWarning)
        plain = {name: per_channel_dynamic_qconfig for name, m in frozen.named_modules() if _plain_linear(m)}
        return quantize_dynamic(frozen, plain, dtype=torch.qint8, inplace=True)  # by name: hooked layers stay


class PackedLinear(nn.Module):
    """An nn.Linear for CPU inference whose weight is pre-packed once in oneDNN's blocked layout; with ``gelu``
    (the nn.GELU after it) it computes ``gelu(linear(x))``, the GELU applied by oneDNN to the matmul's output.

    An nn.Linear on the CPU multiplies through BLAS (MKL's sgemm in fp32) or, in bf16, through oneDNN with its
    weight reordered into oneDNN's layout on every call. Packed once, each call is one oneDNN matmul with the bias
    added in it: ViT-B/16 on 2 AMD EPYC cores (AVX512-BF16) ran 1.12-1.23x faster in fp32 and 1.07-1.10x in bf16
    eagerly, and 1.18x faster in fp32 compiled, where inductor's freezing packs fp32 weights for MKL instead (in
    bf16 it packs them for oneDNN itself: 1.00x). The MLP's GELU fused into its first layer saves a pass over the
    hidden activations: 1.02x in fp32, 1.06x in bf16 at batch 1 and 8, eagerly. For inference only: no gradient
    flows through it.
    """

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
    """A copy of a frozen CPU model in which every nn.Linear is a PackedLinear, an MLP's GELU fused into its
    first layer; the model is untouched.

    The copy shares every parameter and buffer with the model (the packed weights are its only new weights), so
    it is the model's function, to the rounding of another matmul kernel, as long as the model's weights stay
    as they were. Subclasses of nn.Linear (LoRA, quantised layers, nn.MultiheadAttention's projection, which
    is read by weight) and layers with hooks (which the replacement would not run) are left as they are.
    """
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    packed = copy.deepcopy(model, shared)
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


class InferenceModel(nn.Module):
    """A frozen model in its inference precision: inputs are cast in, outputs cast back to the input's dtype.

    ``precision`` is "fp32", "bf16" or "int8"; ``dtype`` is the dtype inputs are cast to (fp32 for int8, whose
    layers quantise their inputs themselves).

    ``source``: the model whose tensors it computes with as they were when it was made (its Linear weights packed,
    every weight a constant of the compiled graph); a call after any of them has changed (loaded, updated in place,
    moved or cast) is an error naming it, rather than outputs of the old weights, or of old and new mixed. Default:
    ``model`` itself.
    """

    _run: Callable[..., torch.Tensor]  # the model, or its compiled form: kept out of the module tree
    _watched: list[tuple[str, torch.Tensor, int, int]]  # the source's tensors: name, tensor, version, storage

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        compile_mode: str,
        precision: str | None = None,
        source: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.precision = precision or ("bf16" if dtype == torch.bfloat16 else "fp32")
        self.compile_mode = compile_mode
        # a ViT runs the faster attention path for its precision, whatever its configured default
        self.call_kwargs = {"attn_impl": "auto"} if isinstance(model, VisionTransformer) else {}
        run = model if compile_mode == "none" else compile_for_inference(model, compile_mode)
        self.__dict__["_run"] = run  # not a submodule: the weights are registered once, under .model
        # kept out of the module tree too: the source's tensors and how they were (autograd's version counter, which
        # every in-place write bumps, and the storage, which moving or casting replaces): 20 us a call for ViT-B/16
        watched = [*(source or model).named_parameters(), *(source or model).named_buffers()]
        self.__dict__["_watched"] = [(name, t, t._version, t.data_ptr()) for name, t in watched]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_unchanged()
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        with torch.no_grad():
            y = self._run(x.to(self.dtype), **self.call_kwargs)
        if self.compile_mode == "reduce-overhead" and y.dtype == out_dtype:
            y = y.clone()  # a CUDA graph's output buffer is overwritten by its next replay
        return y.to(out_dtype)

    def _check_unchanged(self) -> None:
        for name, t, version, ptr in self._watched:
            if t._version != version or t.data_ptr() != ptr:
                raise UserError(
                    f"optimize_for_inference: the model's {name} has changed since this fast model was made from it "
                    "(loaded, updated in place, moved or cast), and the fast model computes with the weights as they "
                    "were then; call optimize_for_inference on the model again"
                )

    def __deepcopy__(self, memo: dict[int, Any]) -> InferenceModel:
        self._check_unchanged()  # a copy of weights that no longer agree with their source would be one too
        # the compiled form belongs to this model: the copy compiles its own on its first call
        new = InferenceModel(copy.deepcopy(self.model, memo), self.dtype, self.compile_mode, self.precision)
        memo[id(self)] = new
        return new.train(self.training)

    def extra_repr(self) -> str:
        return f"precision={self.precision}, compile={self.compile_mode!r}"


def resolve_precision(precision: str | torch.dtype, device: torch.device, warn: bool = True) -> str:
    """ "fp32", "bf16" or "int8" for a requested precision (a name or torch.float32 / torch.bfloat16) on a device.

    "auto" is bf16 where the hardware multiplies bf16 natively and fp32 elsewhere. It never picks int8: int8
    changes predictions (a fraction of a percent of top-1 on the benchmark's images), a trade for the user to make.
    An explicit bf16 where bf16 is emulated becomes fp32 with a warning, since emulated bf16 is slower than fp32.
    """
    if isinstance(precision, torch.dtype) or precision in DTYPE_NAMES:
        precision = "bf16" if resolve_dtype(precision) == torch.bfloat16 else "fp32"
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r}: expected one of {PRECISIONS} (or torch.float32 / torch.bfloat16)")
    if precision == "auto":
        return "bf16" if bf16_is_fast(device) else "fp32"
    if precision == "bf16" and not bf16_is_fast(device):
        if warn:
            warnings.warn(
                f"bf16 is not native on this {device.type} (no AMX/AVX512-BF16 or CUDA bf16): keeping fp32, "
                "which is faster here",
                stacklevel=3,
            )
        return "fp32"
    if precision == "int8" and device.type != "cpu":
        raise UserError(f"precision 'int8': dynamic quantisation runs on the CPU only, not {device.type}")
    return precision


def _traceable(precision: str) -> bool:
    """Whether torch.compile can trace the model of a resolved precision (not fbgemm's int8 layers)."""
    return precision != "int8" or int8_kernel() == "onednn"


def auto_compile_mode(precision: str, device: torch.device) -> str:
    """What optimize_for_inference's compile="auto" means for a resolved precision on a device."""
    return "default" if can_compile(device) and _traceable(precision) else "none"


def optimize_for_inference(
    model: nn.Module,
    precision: str | torch.dtype = "auto",
    compile: str | bool = "auto",
    *,
    dtype: torch.dtype | str | None = None,
) -> InferenceModel:
    """The fastest inference path for a model: eval, frozen, bf16 where native (or int8 on request), the faster
    attention path for the precision (attn_impl="auto"), compiled.

    On the CPU this also calls tune_cpu_allocator(), which is process-wide.

    ``precision``: "auto" (default: bf16 where native, else fp32), "fp32", "bf16" (fp32 with a warning where bf16
    is emulated) or "int8" (CPU: Linear layers in int8, see quantize_int8). ``dtype`` is the older
    spelling of fp32 / bf16 and still accepted. ``compile``: "auto" (compile wherever inductor can build kernels),
    "none"/False, "default", "reduce-overhead" (CUDA graphs: one launch per call, for small batches on a GPU),
    "max-autotune" (slow to compile, sometimes faster on CUDA), True = "default".

    fp32 and bf16 convert the model in place (like ``model.to``: eval mode, frozen, cast) and wrap it (on the CPU, a
    copy of it with its Linear weights packed for oneDNN that shares every other tensor: see pack_linears); int8
    quantises a copy and leaves the model as it was, since its quantised layers could not be trained or saved as the
    original. fp32 and bf16 compute with the model's weights as they are now (packed, or constants of the compiled
    graph): once the model's weights change (load_state_dict, an in-place update, .to()), a call raises UserError
    naming one; optimise the model again. The config is never changed. Outputs come back in the input's dtype and
    match the fp32 model within the precision's tolerance. int8 compiles like the others where the CPU has VNNI;
    elsewhere its layers are fbgemm's, which torch.compile does not trace, so it runs eagerly and an explicit
    compile request falls back with a warning. With compilation the first call, and the first at each new input
    shape, compiles: seconds on CUDA, up to a few minutes for ViT-B on a small CPU. ``copy.deepcopy`` of the result
    is a model of its own that shares only the packed oneDNN weights (never written) and compiles on its own first
    call.
    """
    if dtype is not None:
        if precision != "auto":
            raise UserError("optimize_for_inference: give precision or dtype, not both")
        precision = dtype
    ref = next(model.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    precision = resolve_precision(precision, device)
    if compile is True:
        compile = "default"
    elif compile is False:
        compile = "none"
    if compile == "auto":
        compile = auto_compile_mode(precision, device)
    elif compile not in COMPILE_MODES:
        raise UserError(f"compile={compile!r}: expected 'auto', True/False or one of {COMPILE_MODES}")
    if not _traceable(precision) and compile != "none":
        warnings.warn(
            f"compile={compile!r} with int8 on a CPU without VNNI: torch.compile does not trace fbgemm's quantised "
            "layers; running eagerly",
            stacklevel=2,
        )
        compile = "none"
    if device.type == "cpu":
        tune_cpu_allocator()
    if precision == "int8":
        return InferenceModel(quantize_int8(model), torch.float32, compile, "int8")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model.eval().requires_grad_(False).to(dtype)
    run = pack_linears(model) if can_pack_linears(device, dtype) else model
    return InferenceModel(run, dtype, compile, precision, source=model)
