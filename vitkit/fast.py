"""One switch for fast inference: ``optimize_for_inference(model, dtype=torch.bfloat16)``.

The model's own forward is already lean, with or without this switch: q, k and v come from one fused matmul,
laid out so that backward stacks their gradients without a copy, and a class-token model's last block computes
the class token alone (the head reads nothing else; ViT-B/16: 32.7 instead of 35.1 GFLOP per image).

What the switch adds, and why each step pays (measured with ``vitkit bench``):
- eval mode, no autograd, parameters frozen: no dropout, no graph bookkeeping.
- bf16 weights where the hardware runs bf16 matmuls natively (CUDA with bf16, CPUs with AMX or AVX512-BF16):
  half the memory traffic and several times the matmul rate. Elsewhere bf16 is emulated and slower than fp32,
  so the model stays fp32 with a warning.
- the fused attention kernel (SDPA) rather than the explicit softmax(q k^T) v.
- freed memory kept for reuse (tune_cpu_allocator, on the CPU): activations of tens of MB otherwise come from
  fresh pages that the kernel faults in and zero-fills on every call.
- torch.compile with inductor *freezing*: weights become constants, so inductor folds them, pre-packs them for
  oneDNN on CPU and fuses bias/GELU/residual epilogues. Freezing is a global inductor setting; it is switched
  on only around this model's calls (compilation happens lazily on the first call, and again on a new shape).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import UserError
from .models import VisionTransformer

DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
COMPILE_MODES = ("none", "default", "max-autotune")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16, also spelled 'fp32' / 'bf16'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise UserError(f"dtype {dtype}: expected torch.float32 or torch.bfloat16")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16); otherwise bf16 is emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        return "amx_bf16" in flags or "avx512_bf16" in flags
    except OSError:  # not Linux: trust oneDNN's own check
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_is_fast(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_fast_bf16()


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


class InferenceModel(nn.Module):
    """A frozen model in its inference dtype: inputs are cast in, outputs cast back to the input's dtype."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, compile_mode: str) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.compile_mode = compile_mode
        # a ViT runs the fused kernel whatever its configured default: same numerics, no (B, nh, N, N) probabilities
        self.call_kwargs = {"attn_impl": "sdpa"} if isinstance(model, VisionTransformer) else {}
        run = model if compile_mode == "none" else compile_for_inference(model, compile_mode)
        self.__dict__["_run"] = run  # not a submodule: the weights are registered once, under .model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        with torch.no_grad():
            y = self._run(x.to(self.dtype), **self.call_kwargs)
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, compile={self.compile_mode!r}"


def optimize_for_inference(
    model: nn.Module, dtype: torch.dtype | str = torch.bfloat16, compile: str | bool = "auto"
) -> InferenceModel:
    """The fastest inference path for a model: eval, frozen, bf16 where native, fused SDPA, compiled.

    On the CPU this also calls tune_cpu_allocator(), which is process-wide.

    ``dtype``: bf16 (default) falls back to fp32 with a warning where bf16 is emulated. ``compile``: "auto"
    (compile wherever inductor can build kernels), "none"/False, "default", "max-autotune" (slow to compile,
    sometimes faster on CUDA), True = "default". The model is converted in place (like ``model.to``) and wrapped;
    outputs come back in the input's dtype and match the fp32 model within the chosen dtype's tolerance.
    With compilation the first call, and the first at each new input shape, compiles: seconds on CUDA, up to a
    few minutes for ViT-B on a small CPU.
    """
    dtype = resolve_dtype(dtype)
    ref = next(model.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    if dtype == torch.bfloat16 and not bf16_is_fast(device):
        warnings.warn(
            f"bf16 is not native on this {device.type} (no AMX/AVX512-BF16 or CUDA bf16): keeping fp32, "
            "which is faster here",
            stacklevel=2,
        )
        dtype = torch.float32
    if compile is True:
        compile = "default"
    elif compile is False:
        compile = "none"
    elif compile == "auto":
        compile = "default" if can_compile(device) else "none"
    elif compile not in COMPILE_MODES:
        raise UserError(f"compile={compile!r}: expected 'auto', True/False or one of {COMPILE_MODES}")
    if device.type == "cpu":
        tune_cpu_allocator()
    model.eval().requires_grad_(False).to(dtype)
    return InferenceModel(model, dtype, compile)
