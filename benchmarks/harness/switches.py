"""Each library's documented switch for an inference precision, and the rows that time them at equal precision.

The peers get the switch their documentation gives: fp32 as built, bf16 by ``model.to(torch.bfloat16)``, int8 by
torch's ``quantize_dynamic`` of every nn.Linear; vitkit gets its own, ``optimize_for_inference(model, precision)``.
benchmarks/speed_targets.py times them; accuracy.py says what each costs in accuracy.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitkit.accel.inference import auto_compile_mode, compile_for_inference, optimize_for_inference

from .config import PARITY_TOL


def peer_switch(peer: nn.Module, precision: str, compile_mode: str) -> Callable[[torch.Tensor], Any]:
    """A peer under the switch its documentation gives for a precision (on a copy; the peer is left as it was).

    bf16: ``model.to(torch.bfloat16)`` with bf16 inputs. int8: ``quantize_dynamic`` of every nn.Linear to qint8
    (torch's documented dynamic quantisation, as transformers' and timm's guides show it). compile_mode other than
    "none": torch.compile with inductor freezing, as vitkit's fast path uses (not for int8, which it cannot trace).
    """
    model = copy.deepcopy(peer).eval().requires_grad_(False)
    if precision == "int8":
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
            quantized = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        return quantized
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    run = model if compile_mode == "none" else compile_for_inference(model, compile_mode)
    return lambda x: run(x.to(dtype))


def vitkit_switch(model: nn.Module, precision: str, compile_mode: str) -> Callable[[torch.Tensor], Any]:
    """vitkit's own switch: optimize_for_inference(model, precision) on a copy. int8 keeps its default, compiled
    wherever inductor builds CPU kernels, whatever compile_mode says (the peers' int8 cannot be compiled)."""
    mode = "auto" if precision == "int8" else compile_mode
    return optimize_for_inference(copy.deepcopy(model), precision, compile=mode)


def int8_compile_note() -> str:
    """How the int8 rows run: vitkit's int8 compiles where the CPU has VNNI and inductor builds kernels."""
    compiled = auto_compile_mode("int8", torch.device("cpu")) != "none"
    return f" (int8: vitkit {'compiled' if compiled else 'eager'}, peers eager)"


PEERS_SWITCH = "vitkit, peers' switch"  # the row of vitkit's model under the peers' switch


def _infer(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return fn(x)

    return step


def precision_rows(
    model: nn.Module, peers: dict[str, nn.Module], precisions: list[str], compile_mode: str, x: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    """One timed step per (precision, implementation), named "<precision> <implementation>"."""
    steps = {}
    for p in precisions:
        steps[f"{p} vitkit"] = _infer(vitkit_switch(model, p, compile_mode), x)
        if p != "int8":  # vitkit's model as the peers are given it
            steps[f"{p} {PEERS_SWITCH}"] = _infer(peer_switch(model, p, compile_mode), x)
        for name, peer in peers.items():
            steps[f"{p} {name}"] = _infer(peer_switch(peer, p, compile_mode), x)
    return steps


def check_rows(
    steps: dict[str, Callable[[], Any]], ref: torch.Tensor, log: Callable[[str], None] = lambda s: None
) -> None:
    """Rows of one precision compute the same thing: within the precision's tolerance of that precision's vitkit
    row (fp32: of ref, the fp32 model's output; int8: each library quantises in its own way, so only ref bounds
    it, loosely). A row that does not is a SystemExit naming it."""
    scale = max(1.0, float(ref.abs().max()))
    tol = {"fp32": PARITY_TOL["fp32"], "bf16": PARITY_TOL["bf16"], "int8": 0.25}
    for name, step in steps.items():
        p = name.split()[0]
        base = ref if p in ("fp32", "int8") else torch.as_tensor(steps[f"{p} vitkit"]()).float()
        err = float((torch.as_tensor(step()).float() - base).abs().max()) / scale
        log(f"{name}: max |diff| vs vitkit {'fp32' if p == 'int8' else p} {err:.2e} (tolerance {tol[p]:g})")
        if err > tol[p]:
            raise SystemExit(f"{name} differs by {err:.2e}: not timing implementations that compute different things")
