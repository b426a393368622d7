"""Speed for a training step, asked for: ``optimize_for_training(model)``, and the optimizer's contiguous layout.

``optimize_for_training`` swaps in what a training step on the model's device gains, in place, the state dict
unchanged: a class-token ViT's forward() runs its last block for the class token alone (accel.first_token); on a
CPU the large Dense layers run through oneDNN, the MLP's tanh GELU through compiled kernels fused with its second
layer (accel.cpu, accel.kernels). It changes nothing process-wide; ``vitkit train``, which owns its process, also
keeps freed memory for reuse (``tune_cpu_allocator``), and does both unless ``run.accel=none``.

``ContiguousParams(optimizer)`` (``run.contiguous_params``) lays each parameter group out in one buffer per dtype
and device, so that clipping and the optimizer step run one kernel over a group rather than one per tensor, which
a small model notices: the parameters' ``.data`` and ``.grad`` become views into the buffers, the model and the
optimizer's ``state_dict()`` keep their per-parameter form. A parameter the loss does not reach gets a zero
gradient rather than none, as in optax. Measured by benchmarks/main_job_step.py.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.vit import VisionTransformer
from .cpu import swap_for_training
from .first_token import first_token_forward
from .kernels import swap_gelus

ALIGN = 16  # elements: every parameter's view starts at a multiple of this (64 bytes in fp32)


@dataclass(frozen=True)
class _Member:
    """Where a model parameter lives in its buffer."""

    flat: torch.Tensor  # the buffer (an nn.Parameter the optimizer updates)
    offset: int

    def view(self, buffer: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return buffer[self.offset : self.offset + shape.numel()].view(shape)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numbered(groups: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """State-dict param groups of ``sizes`` parameters each, numbered across groups as Optimizer.state_dict does."""
    starts = itertools.accumulate(sizes, initial=0)
    return [{**g, "params": list(range(start, start + n))} for g, n, start in zip(groups, sizes, starts, strict=False)]


class ContiguousParams:
    """Lays out an optimizer's parameters contiguously; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("parameters are laid out before the optimizer's first step, not after")
        self.optimizer = optimizer
        self.groups = [list(g["params"]) for g in optimizer.param_groups]  # the per-parameter layout
        self.members: dict[torch.Tensor, list[tuple[nn.Parameter, _Member]]] = {}  # buffer -> its parameters
        for group in optimizer.param_groups:
            buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            kept: list[torch.Tensor] = []
            for p in group["params"]:
                if p.is_sparse or p.dim() == 0 or not p.is_contiguous() or p.grad is not None:
                    kept.append(p)
                else:
                    buckets.setdefault((p.dtype, p.device), []).append(p)
            for members in buckets.values():
                if len(members) == 1:  # a buffer of one would only add a copy
                    kept.extend(members)
                else:
                    kept.append(self._flatten(members))
            group["params"] = kept
        optimizer.register_state_dict_post_hook(self._per_parameter)
        optimizer.register_load_state_dict_pre_hook(self._contiguous)

    @property
    def params(self) -> list[torch.Tensor]:
        """What the optimizer updates (buffers and the parameters left out of them): what to clip."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def zero_grad(self) -> None:
        """After an optimizer step: gradients to zero in the buffers, to None elsewhere."""
        for flat, members in self.members.items():
            self._check(flat, members)
            assert flat.grad is not None
            flat.grad.zero_()
        for p in self.params:
            if p not in self.members:
                p.grad = None

    def _check(self, flat: torch.Tensor, members: list[tuple[nn.Parameter, _Member]]) -> None:
        assert flat.grad is not None
        base, grad_base, size = flat.data_ptr(), flat.grad.data_ptr(), flat.element_size()
        for p, at in members:
            start = at.offset * size
            if p.data_ptr() != base + start or p.grad is None or p.grad.data_ptr() != grad_base + start:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} no longer lies in the optimizer's buffer (its data or "
                    "gradient was replaced during training, e.g. by model.to() or model.zero_grad()): its updates "
                    "would be lost"
                )

    @torch.no_grad()
    def _flatten(self, members: list[nn.Parameter]) -> nn.Parameter:
        first = members[0]
        offsets = list(itertools.accumulate((_padded(p.numel()) for p in members), initial=0))
        flat = nn.Parameter(torch.zeros(offsets[-1], dtype=first.dtype, device=first.device))
        grad = flat.grad = torch.zeros_like(flat)
        placed = []
        for p, offset in zip(members, offsets, strict=False):
            at = _Member(flat, offset)
            at.view(flat.data, p.shape).copy_(p)
            p.data = at.view(flat.data, p.shape)
            p.grad = at.view(grad, p.shape)
            placed.append((p, at))
        self.members[flat] = placed
        return flat

    # ------------------------------------------------------------------ the per-parameter form of the state dict
    def _per_parameter(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's state dict as it would be without the buffers: one entry per model parameter."""
        current = {p: i for i, p in enumerate(self.params)}
        where = {p: at for members in self.members.values() for p, at in members}
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(itertools.chain.from_iterable(self.groups)):
            at = where.get(p)
            entries = sd["state"].get(current[at.flat if at is not None else p])
            if entries is None:
                continue
            if at is None:
                state[i] = entries
                continue
            numel = at.flat.numel()
            state[i] = {
                k: (at.view(v, p.shape) if v.numel() == numel else v.clone()) if isinstance(v, torch.Tensor) else v
                for k, v in entries.items()
            }
        return {"state": state, "param_groups": _numbered(sd["param_groups"], [len(g) for g in self.groups])}

    def _contiguous(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        """A per-parameter state dict in the optimizer's layout (buffers), for load_state_dict. A buffer's parameter
        without saved state (the loss never reached it, in an optimizer without this layout) starts at zero moments."""
        saved = sd["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g) for g in self.groups]:
            raise ValueError(
                f"loaded state dict has groups of {[len(g['params']) for g in saved]} parameters, this optimizer "
                f"{[len(g) for g in self.groups]}"
            )
        saved_ids = itertools.chain.from_iterable(g["params"] for g in saved)
        old = {
            p: sd["state"][i]
            for p, i in zip(itertools.chain.from_iterable(self.groups), saved_ids, strict=True)
            if i in sd["state"]
        }
        state: dict[int, dict[str, Any]] = {}
        for i, q in enumerate(self.params):
            members = self.members.get(q)
            if members is None:
                if q in old:
                    state[i] = old[q]
            elif any(p in old for p, _ in members):
                state[i] = self._merged(q, [(p, at, old.get(p)) for p, at in members])
        return {"state": state, "param_groups": _numbered(saved, [len(g["params"]) for g in opt.param_groups])}

    @staticmethod
    def _merged(
        flat: torch.Tensor, entries: list[tuple[nn.Parameter, _Member, dict[str, Any] | None]]
    ) -> dict[str, Any]:
        """One buffer's state from its parameters' states: per-element entries (moments) placed at their offsets,
        the rest (the step count) shared, which they must agree on."""
        present = [(p, e) for p, _, e in entries if e is not None]
        per_element = {
            k: v for p, e in present for k, v in e.items() if isinstance(v, torch.Tensor) and v.shape == p.shape
        }
        shared: dict[str, Any] = {}
        for p, e in present:
            for k, v in e.items():
                if k in per_element and isinstance(v, torch.Tensor) and v.shape == p.shape:
                    continue
                value = v.item() if isinstance(v, torch.Tensor) else v
                known = shared.setdefault(k, (value, v))[0]
                if known != value:
                    raise ValueError(f"loaded state dict has parameters with different {k!r} ({known}, {value})")
        merged = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, (_, v) in shared.items()}
        for name, like in per_element.items():
            buffer = torch.zeros(flat.numel(), dtype=like.dtype, device=like.device)
            for p, at, entry in entries:
                if entry is not None:
                    at.view(buffer, p.shape).copy_(entry[name])
            merged[name] = buffer
        return merged


_allocator_tuned = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def tune_cpu_allocator() -> bool:
    """Let glibc's malloc keep and reuse freed memory, for every tensor of this process; True if applied.

    Above a threshold glibc maps each allocation afresh and unmaps it when freed, so each large activation is
    page-faulted and zero-filled on every step (benchmarks/main_job_step.py --allocator default). Raised thresholds
    keep freed memory for the next step, as jemalloc or tcmalloc would; the resident set stays near its peak.
    Idempotent; a no-op (False) outside Linux/glibc."""
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


def optimize_for_training(model: nn.Module) -> nn.Module:
    """What a training step of model on its device gains, swapped in from outside; returns the model (the same object,
    its state dict and its outputs unchanged within float rounding). See the module docstring."""
    if isinstance(model, VisionTransformer):
        first_token_forward(model)
    ref = next(model.parameters(), None)
    if ref is not None and ref.device.type == "cpu":
        swap_gelus(model)
        swap_for_training(model)
    return model
