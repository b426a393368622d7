"""One benchmark's settings, checked when built: a registered model at one shape, dtype, attention and compile mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vitkit.device import COMPILE_MODES
from vitkit.errors import UserError
from vitkit.models.config import ATTN_IMPLS

from .memory import parse_bytes

DTYPES = ("fp32", "bf16-autocast", "bf16", "int8")  # int8: dynamic int8 Linear layers, CPU inference
MODES = ("infer", "train")
PEERS = ("hf", "onnx", "timm")  # transformers, onnxruntime (fp32 CPU inference), timm
# max |a - b| / max(1, max |ref|); int8: a switched model against the fp32 one (the models as built are fp32)
PARITY_TOL = {"fp32": 1e-4, "bf16-autocast": 5e-2, "bf16": 5e-2, "int8": 1e-1}


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
        if self.dtype == "int8" and (self.mode != "infer" or self.device != "cpu"):
            raise UserError("bench dtype='int8': int8 is measured for inference on the CPU only")
        if self.batch_size < 1 or self.repeats < 1 or self.warmup < 0:
            raise UserError("bench needs batch_size >= 1, repeats >= 1 and warmup >= 0")
        parse_bytes(self.memory_budget)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the weights and inputs: bf16 for "bf16", fp32 otherwise (autocast casts inside)."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32
