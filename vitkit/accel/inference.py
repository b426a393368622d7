"""One switch for fast inference: ``optimize_for_inference(model, precision="auto" | "fp32" | "bf16" | "int8")``.

What it does, each step attached from outside the model (its state dict unchanged):
- eval mode, no autograd, parameters frozen; bf16 weights where the hardware multiplies bf16 natively (CUDA, CPUs
  with AMX or AVX512-BF16; elsewhere bf16 is emulated and slower, so fp32 is kept with a warning), or int8 on
  request (accel.int8; "auto" never picks it, as it changes predictions more than bf16 does);
- the attention path the precision runs fastest (``attn_impl="auto"``), and a class-token model's last block for
  the class token alone (accel.first_token), in a copy of the model that shares its tensors;
- on a CPU: the Linear weights packed once for oneDNN, the MLP's GELU applied inside its first layer's matmul
  (accel.cpu), and freed memory kept for reuse (accel.training.tune_cpu_allocator);
- torch.compile with inductor freezing (weights become constants it folds and packs), switched on around this
  model's calls only. Measured by benchmarks/bench_vit.py.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..device import COMPILE_MODES, bf16_is_fast
from ..errors import UserError
from ..models.vit import VisionTransformer
from .cpu import can_pack_linears, pack_linears, shared_copy
from .first_token import first_token_forward
from .int8 import int8_kernel, quantize_int8
from .kernels import swap_gelus
from .training import tune_cpu_allocator

PRECISIONS = ("auto", "fp32", "bf16", "int8")
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


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
        # every in-place write bumps, and the storage, which moving or casting replaces)
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
        with torch.inference_mode(False):  # its copies are then normal tensors, whose changes are counted
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


def _compile_mode(compile: str | bool, precision: str, device: torch.device) -> str:
    """The torch.compile mode optimize_for_inference's ``compile`` argument means for a resolved precision."""
    mode = "default" if compile is True else "none" if compile is False else compile
    if mode == "auto":
        return auto_compile_mode(precision, device)
    if mode not in COMPILE_MODES:
        raise UserError(f"compile={compile!r}: expected 'auto', True/False or one of {COMPILE_MODES}")
    if not _traceable(precision) and mode != "none":
        warnings.warn(
            f"compile={mode!r} with int8 on a CPU without VNNI: torch.compile does not trace fbgemm's quantised "
            "layers; running eagerly",
            stacklevel=3,
        )
        return "none"
    return mode


def _inference_copy(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of a frozen model sharing its tensors, with the inference swaps of this module's docstring."""
    run = pack_linears(model) if can_pack_linears(device, dtype) else shared_copy(model)
    if isinstance(run, VisionTransformer):
        first_token_forward(run, always=True)
    swap_gelus(run)
    return run


def optimize_for_inference(
    model: nn.Module,
    precision: str | torch.dtype = "auto",
    compile: str | bool = "auto",
    *,
    dtype: torch.dtype | str | None = None,
) -> InferenceModel:
    """The fastest inference path for a model (the module docstring). On the CPU it also keeps freed memory for reuse,
    process-wide (tune_cpu_allocator).

    ``precision``: "auto" (default: bf16 where native, else fp32), "fp32", "bf16" (fp32 with a warning where bf16
    is emulated) or "int8" (CPU: Linear layers in int8, see quantize_int8). ``dtype`` is the older spelling of fp32 /
    bf16 and still accepted. ``compile``: "auto" (wherever inductor can build kernels), "none"/False, "default",
    "reduce-overhead" (CUDA graphs), "max-autotune", True = "default".

    fp32 and bf16 convert the model in place (like ``model.to``: eval mode, frozen, cast) and run a copy of it that
    shares its tensors; they compute with the model's weights as they are now (packed, or constants of the compiled
    graph): once those change (load_state_dict, an in-place update, .to()), a call raises UserError naming one (a
    parameter made under torch.inference_mode, which counts no changes, is replaced by a copy that does). int8
    quantises a copy and leaves the model as it was. The config is never changed. Outputs come back in the input's
    dtype and match the fp32 model within the precision's tolerance. With compilation the first call, and the first
    at each new input shape, compiles (up to minutes for ViT-B on a small CPU). ``copy.deepcopy`` of the result is a
    model of its own that shares only the packed oneDNN weights and compiles on its own first call.
    """
    if dtype is not None:
        if precision != "auto":
            raise UserError("optimize_for_inference: give precision or dtype, not both")
        precision = dtype
    ref = next(model.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    precision = resolve_precision(precision, device)
    mode = _compile_mode(compile, precision, device)
    if device.type == "cpu":
        tune_cpu_allocator()
    # what it makes are normal tensors, whose in-place changes autograd's version counter sees, even when called
    # under torch.inference_mode (whose tensors have no such counter)
    with torch.inference_mode(False):
        if precision == "int8":
            frozen = quantize_int8(model)
            if isinstance(frozen, VisionTransformer):
                first_token_forward(frozen, always=True)
            swap_gelus(frozen)
            return InferenceModel(frozen, torch.float32, mode, "int8")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        without_inference_tensors(model).eval().requires_grad_(False).to(dtype)
        return InferenceModel(_inference_copy(model, device, dtype), dtype, mode, precision, source=model)


def without_inference_tensors(model: nn.Module) -> nn.Module:
    """The model, in place, with each parameter or buffer made under torch.inference_mode replaced by a normal copy
    (the same values): the fast model must see later changes to them, and inference tensors count none."""
    with torch.inference_mode(False):
        tables: list[dict[str, Any]] = [t for m in model.modules() for t in (m._parameters, m._buffers)]
        for table in tables:
            for name, t in [(name, t) for name, t in table.items() if t is not None and t.is_inference()]:
                table[name] = nn.Parameter(t.clone(), t.requires_grad) if isinstance(t, nn.Parameter) else t.clone()
    return model
