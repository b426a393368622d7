"""Optimizers, the learning-rate schedule and Polyak averaging of the weights. Weight decay applies to weights only
(ndim >= 2, not in the model's ``no_weight_decay()``), never to biases, norms or embeddings, as in the official code.
The schedule is a pure function of the step: a resume needs no other state.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ..errors import UserError
from .config import OptimConfig, ScheduleConfig


def layer_id(name: str, depth: int) -> int:
    """The depth of a ViT parameter for layer-wise lr decay: 0 the embeddings (patches, class token, position),
    i + 1 block i, depth + 1 whatever reads the last block (final norm, pooling head, pre-logits, head)."""
    if name.startswith(("patch_embed.", "cls_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0) -> list[dict[str, Any]]:
    """Decayed weights and everything else (biases, norms, embeddings); with ``layer_decay`` < 1 also split by
    depth, each group's lr scaled by layer_decay ** (depth + 1 - layer id): the head at the full lr, each block
    below it a factor lower, the embeddings lowest (the fine-tuning recipe of BEiT and MAE)."""
    listed = getattr(model, "no_weight_decay", None)
    skip: set[str] = set(listed()) if callable(listed) else set()
    depth = len(getattr(model, "blocks", ()))
    if layer_decay != 1.0 and not depth:
        raise UserError(f"optim.layer_decay={layer_decay}: layer-wise decay needs a ViT (a model with blocks)")
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = p.ndim >= 2 and name not in skip
        layer = layer_id(name, depth) if layer_decay != 1.0 else 0
        scale = layer_decay ** (depth + 1 - layer) if layer_decay != 1.0 else 1.0
        group = {"params": [], "weight_decay": weight_decay if decayed else 0.0, "lr_scale": scale, "layer": layer}
        groups.setdefault((layer, decayed), group)["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], not k[1]))]


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW, Adam or SGD (momentum) over ``param_groups``; ``fused`` single-kernel updates (CUDA, CPU)."""
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay)
    extra = {"fused": True} if fused else {}
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **extra)


def lr_at(step: int, total_steps: int, base_lr: float, sched: ScheduleConfig) -> float:
    """The learning rate of step ``step`` (0-based) of ``total_steps``: linear warmup from base_lr / warmup_steps,
    then cosine, linear or no decay from base_lr to ``min_lr`` at the last step."""
    if step < sched.warmup_steps:
        return base_lr * (step + 1) / sched.warmup_steps
    if sched.decay == "constant":
        return base_lr
    progress = (step - sched.warmup_steps) / max(1, total_steps - sched.warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if sched.decay == "cosine" else 1.0 - progress
    return sched.min_lr + (base_lr - sched.min_lr) * factor


def run_schedule(schedule: ScheduleConfig, total_steps: int, lr: float) -> ScheduleConfig:
    """The schedule as run: a warmup as long as the run would never reach the peak lr, so it is halved to fit."""
    if schedule.warmup_steps < total_steps:
        return schedule
    warmup = total_steps // 2
    warnings.warn(
        f"schedule.warmup_steps={schedule.warmup_steps} is not shorter than the run ({total_steps} steps), so the "
        f"learning rate would never reach optim.lr={lr:g}; warming up over {warmup} steps instead",
        stacklevel=4,
    )
    return dataclasses.replace(schedule, warmup_steps=warmup)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled lr, times each group's layer-decay scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def polyak_label(decay: float, warmup: bool) -> str:
    """What the run's model is, for its metadata, its eval records and its plots."""
    return f"polyak average {decay:g}" + (" (warm-up (1+t)/(10+t))" if warmup else "")


def polyak_decay(decay: float, t: int, warmup: bool = True) -> float:
    """The factor of Polyak update t (0 for the first): decay, or with the warm-up min(decay, (1 + t) / (10 + t))."""
    return min(decay, (1 + t) / (10 + t)) if warmup else decay


def polyak_average(model: nn.Module, decay: float, warmup: bool, total_steps: int) -> AveragedModel | None:
    """The Polyak-averaged copy of the model (optim.polyak; None when 0), starting from the initial weights; update t
    moves it towards the new weights by ``polyak_decay(decay, t)`` (the warm-up, as TensorFlow's and timm's EMA,
    forgets the initial weights in a run of any length). Every rank does the same on identical weights: DDP-safe."""
    if not decay:
        return None
    horizon = round(1 / (1 - decay))
    if total_steps < horizon:
        if warmup:
            last = polyak_decay(decay, total_steps - 1)
            what = f"the average stays in its warm-up (factor (1 + t) / (10 + t), at most {last:.4f} here)"
        else:
            what = f"{100 * decay**total_steps:.1f}% of the average is still the initial weights at the end"
        warnings.warn(
            f"optim.polyak={decay:g} averages over about {horizon} steps, more than this run's {total_steps}: {what}",
            stacklevel=4,
        )

    @torch.no_grad()
    def update(
        averaged: list[torch.Tensor] | tuple[torch.Tensor, ...],
        current: list[torch.Tensor] | tuple[torch.Tensor, ...],
        num_averaged: torch.Tensor | int,
    ) -> None:
        # num_averaged counts the initial copy: update t is the (t + 1)-th average
        torch._foreach_lerp_(averaged, current, 1 - polyak_decay(decay, int(num_averaged) - 1, warmup))

    averaged = AveragedModel(model, multi_avg_fn=update)
    averaged.update_parameters(model)  # the first update copies: the average starts at the initial weights
    return averaged
