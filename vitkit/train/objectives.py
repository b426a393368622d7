"""What a run trains its model to do (run.objective): an objective wraps the built model (``wrap``), gives the loss
of a batch (``loss``), scores held-out data (``evaluate``) and hands back what a checkpoint holds (``export``):
``Classification`` here, or masked patch prediction (mpp.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..data import DatasetInfo
from ..device import autocast
from ..evaluate.loop import batches, evaluating
from .config import TrainConfig
from .metrics import topk_correct
from .mpp import MaskedPatchPrediction


def evaluate(
    model: nn.Module,
    dataset: Dataset[Any],
    device: torch.device | str = "cpu",
    batch_size: int = 512,
    amp: str = "none",
    num_workers: int = 0,
) -> dict[str, float]:
    """Top-1, top-5 (capped at the class count) and mean cross-entropy of model on dataset."""
    loss_sum, top1, top5, n = 0.0, 0, 0, 0
    with evaluating(model):
        for x, y in batches(dataset, batch_size, device, num_workers=num_workers):
            with autocast(x.device, amp):
                logits = model(x)
            logits = logits.float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            c1, c5 = topk_correct(logits, y, (1, 5))
            top1, top5, n = top1 + c1, top5 + c5, n + len(y)
    return {"eval_loss": loss_sum / n, "eval_top1": top1 / n, "eval_top5": top5 / n, "eval_images": n}


class Classification:
    """The supervised objective: cross-entropy on the labels, scored by top-1 / top-5 (``evaluate``)."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y: (B,) labels, smoothed here; or (B, K) soft targets (mixup / cutmix), which carry the smoothing."""
        if y.is_floating_point():
            return F.cross_entropy(model(x).float(), y)
        return F.cross_entropy(model(x).float(), y, label_smoothing=self.label_smoothing)

    def evaluate(self, model: nn.Module, dataset: Dataset, *args: Any) -> dict[str, float]:
        return evaluate(model, dataset, *args)

    def export(self, model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
        return model, {}, {}


def build_objective(cfg: TrainConfig, info: DatasetInfo) -> Classification | MaskedPatchPrediction:
    """The objective run.objective names: what the model is trained to do, and how it is scored and saved."""
    if cfg.run.objective == "mpp":
        return MaskedPatchPrediction(cfg.mpp, info, cfg.run.seed)
    return Classification(cfg.optim.label_smoothing)


def headline(metrics: dict[str, float]) -> str:
    """An evaluation in a few words, for the progress bar: MPP's colour accuracy, or top-1."""
    if "eval_mpp_acc" in metrics:
        return f"mpp colour acc {100 * metrics['eval_mpp_acc']:.1f}%"
    return f"top-1 {100 * metrics.get('eval_top1', 0):.1f}%"
