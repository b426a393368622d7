"""Outputs compared before anything is timed: implementations that compute different things are not timed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitkit.errors import UserError

from .config import PARITY_TOL, BenchConfig
from .steps import bench_autocast


def model_output(model: nn.Module, x: torch.Tensor, cfg: BenchConfig) -> torch.Tensor:
    """Eval-mode outputs in the benchmark's dtype setting, as fp32."""
    model.eval()
    with torch.no_grad(), bench_autocast(cfg, x.device):
        return model(x).float()


def batched_logits(fn: Callable[[torch.Tensor], Any], images: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """fn's outputs for images as fp32 logits, ``batch`` images a call, without autograd."""
    with torch.no_grad():
        return torch.cat([torch.as_tensor(fn(b)).float() for b in images.split(batch)])


def logit_agreement(want: torch.Tensor, got: Any) -> dict[str, float]:
    """Top-1 agreement of got with want (the fp32 logits), and the max / mean |logit error|; max_abs_logit, the
    largest |want|, is the scale they read against."""
    got = torch.as_tensor(got).float()
    err = (got - want).abs()
    return {
        "n": len(want),
        "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "max_err": float(err.max()),
        "mean_err": float(err.mean()),
        "max_abs_logit": float(want.abs().max()),
    }


def relative_max_diff(a: Any, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|): absolute for small outputs, relative for large ones."""
    a = torch.as_tensor(a).float().cpu()
    b = b.float().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def check_one(name: str, err: float, cfg: BenchConfig, log: Callable[[str], None], as_built: bool = False) -> float:
    """err (relative_max_diff against vitkit's outputs) within the dtype's tolerance, else a UserError; ``as_built``:
    of the models as built, which are fp32 under int8."""
    tol = PARITY_TOL["fp32" if as_built and cfg.dtype == "int8" else cfg.dtype]
    log(f"parity {name}: max |diff| / max(1, max |ref|) = {err:.2e} (tolerance {tol:.0e})")
    if not err <= tol:
        raise UserError(
            f"bench: {name} outputs differ from vitkit's by {err:.3e} (> {tol:.0e}); "
            "not timing implementations that compute different things"
        )
    return err


def check_parity(
    model: nn.Module, peers: dict[str, nn.Module], x: torch.Tensor, cfg: BenchConfig, log: Callable[[str], None]
) -> dict[str, float]:
    """Each peer's outputs against vitkit's on the same input, before any timing; raises UserError on mismatch."""
    ref = model_output(model, x, cfg)
    return {
        name: check_one(name, relative_max_diff(model_output(peer, x, cfg), ref), cfg, log, as_built=True)
        for name, peer in peers.items()
    }
