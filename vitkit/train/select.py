"""Choosing a run's weights on images of their own (``data.select_images``): early stopping, as the paper trains each
pre-training subset of its Fig. 4 to its best held-out point.

Every evaluation also scores the selection images (``select_top1`` ..., MPP: ``select_mpp_acc`` ...). The weights
with the best score so far (top-1, or MPP's colour accuracy; the earliest of equals) are kept, in memory and in the
training state (``best.<name>``). They are what the run saves as its model, and the held-out scores recorded beside
them at their step are the run's result: the ``selected`` record at the end of metrics.jsonl. The held-out
evaluation set chooses nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..errors import UserError

SCORES = ("select_top1", "select_mpp_acc")  # what a selection compares: the first of these an evaluation has


def selection_metrics(scores: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics (``eval_top1`` ...) renamed as the selection set's (``select_top1`` ...)."""
    return {"select_" + key.removeprefix("eval_"): value for key, value in scores.items()}


def _copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Selection:
    """The selection images and the best weights seen so far: their step, score and evaluation."""

    dataset: Dataset[Any]
    step: int | None = None  # None: no evaluation yet
    score: float = -math.inf
    metrics: dict[str, float] = field(default_factory=dict)  # the whole evaluation at that step
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def offer(self, step: int, metrics: dict[str, float], model: nn.Module) -> None:
        """Keep model's weights if this evaluation (with the selection set's scores) beats every earlier one."""
        score = next(metrics[key] for key in SCORES if key in metrics)
        if score > self.score:
            self.step, self.score, self.metrics, self.weights = step, score, dict(metrics), _copy(model)

    @contextlib.contextmanager
    def chosen(self, model: nn.Module) -> Iterator[nn.Module]:
        """model holding the chosen weights inside the block (its own where none is chosen yet), its own after."""
        if self.step is None:
            yield model
            return
        own = _copy(model)
        model.load_state_dict(self.weights)
        try:
            yield model
        finally:
            model.load_state_dict(own)

    def result(self) -> dict[str, float]:
        """The run's result: the held-out scores of the chosen weights, with the step they are from."""
        return {**self.metrics, "selected_step": self.step or 0}

    def state(self) -> dict[str, Any]:
        """What the training state keeps of it (its JSON document's ``best``); the weights go as tensors."""
        return {"step": self.step, "score": self.score, "metrics": self.metrics} if self.step is not None else {}

    def restore(self, doc: dict[str, Any], weights: dict[str, torch.Tensor], path: str | Path) -> None:
        """The best so far from a training state (its ``best`` and ``best.<name>`` tensors); nothing if it has none."""
        best = doc.get("best") or {}
        if not best:
            return
        ok = isinstance(best.get("step"), int) and isinstance(best.get("score"), (int, float))
        if not ok or not isinstance(best.get("metrics"), dict) or not weights:
            raise UserError(
                f"{path}: the training state's 'best' is {str(best)[:80]} with {len(weights)} best.* tensors; "
                "expected the step, score and metrics that vitkit writes, and the weights"
            )
        self.step, self.score, self.metrics, self.weights = best["step"], float(best["score"]), best["metrics"], weights
