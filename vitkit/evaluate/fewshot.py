"""Few-shot linear evaluation (paper sec 4.1): how good is a frozen representation with only k labels per class?

For each shot count and seed, ``shots`` examples per class are whitened with their own mean and std, given a
bias feature of 100 (almost unregularised) and fitted by a closed-form ridge regression to {-1, 1} targets:

    primal (n >= d):  W = (X^T X + l2 I)^-1 X^T Y        a (d, d) system
    dual   (n <  d):  W = X^T (X X^T + l2 I)^-1 Y        an (n, n) system, the same W

Test examples, whitened the same, get the argmax of X_test W. As big_vision's fewshot_lsr evaluator, each seed
draws one permutation per class, whose prefixes are the subsets (the 5-shot set contains the 1-shot set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from .loop import Data, batches, evaluating

BIAS_CONSTANT = 100.0
STD_EPS = 1e-5
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_L2 = 2.0**10


@dataclass
class FewShotResult:
    """Accuracies per shot count, one entry per seed; ``mean``/``std`` are over seeds (population std)."""

    accuracy: dict[int, list[float]]
    l2: float
    num_classes: int
    num_test: int
    feature_dim: int
    seeds: list[int] = field(default_factory=list)

    def mean(self, shots: int) -> float:
        return float(np.mean(self.accuracy[shots]))

    def std(self, shots: int) -> float:
        return float(np.std(self.accuracy[shots]))

    def to_dict(self) -> dict[str, Any]:
        """Every field but the accuracies, then ``results``: per shot count the mean, std and per-seed accuracies."""
        results = {str(k): {"mean": self.mean(k), "std": self.std(k), "per_seed": v} for k, v in self.accuracy.items()}
        return {**{k: v for k, v in asdict(self).items() if k != "accuracy"}, "results": results}

    def record(self, checkpoint: str, data: dict[str, Any]) -> dict[str, Any]:
        """The document ``vitkit fewshot`` writes: the checkpoint, the data config, then ``to_dict``."""
        return {"checkpoint": checkpoint, "data": data, **self.to_dict()}

    def table(self) -> str:
        """A plain-text table: one row per shot count, accuracy in percent as mean +- std over seeds."""
        lines = [f"{'shots':>5}  {'accuracy (%)':>15}", f"{'-' * 5}  {'-' * 15}"]
        for k in self.accuracy:
            lines.append(f"{k:>5}  {100 * self.mean(k):>6.2f} +- {100 * self.std(k):>5.2f}")
        lines.append(
            f"({len(self.seeds)} seeds, l2={self.l2:g}, {self.num_classes} classes, {self.num_test} test images, "
            f"{self.feature_dim}-d features)"
        )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ solver
def whiten(train_x: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """Standardise with train_x's mean and std (+1e-5) and append the constant bias column to every input."""
    mean = train_x.mean(dim=0, keepdim=True)
    std = train_x.std(dim=0, keepdim=True, correction=0) + STD_EPS
    out = []
    for x in (train_x, *others):
        x = (x - mean) / std
        out.append(torch.cat([x, x.new_full((x.shape[0], 1), BIAS_CONSTANT)], dim=1))  # (n, d + 1)
    return out


def ridge_regression(x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """argmin_W |X W - Y|^2 + l2 |W|^2: x (n, d), y (n, K) -> W (d, K), as the smaller of the two systems."""
    if l2 <= 0:
        raise UserError(f"ridge_regression: l2 must be positive, got {l2}")
    n, d = x.shape
    if n >= d:
        gram = x.T @ x + l2 * torch.eye(d, dtype=x.dtype, device=x.device)  # (d, d)
        return torch.linalg.solve(gram, x.T @ y)
    gram = x @ x.T + l2 * torch.eye(n, dtype=x.dtype, device=x.device)  # (n, n)
    return x.T @ torch.linalg.solve(gram, y)


def linear_fewshot_accuracy(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    num_classes: int,
    l2: float = DEFAULT_L2,
) -> float:
    """Accuracy on the test set of the whitened ridge classifier fitted to one few-shot subset."""
    train_x, test_x = whiten(train_x.double(), test_x.double())
    targets = 2.0 * torch.nn.functional.one_hot(train_y.long(), num_classes).double() - 1.0  # (n, K) in {-1, 1}
    w = ridge_regression(train_x, targets, l2)  # (d + 1, K)
    pred = (test_x @ w).argmax(dim=1)
    return float((pred == test_y.long()).double().mean())


def sample_shots(labels: torch.Tensor, num_classes: int, shots: Sequence[int], seed: int) -> dict[int, torch.Tensor]:
    """Indices of ``k`` examples per class for each k in shots; larger subsets extend smaller ones."""
    gen = torch.Generator().manual_seed(seed)
    per_class = []
    for c in range(num_classes):
        idx = torch.nonzero(labels == c).flatten()
        if idx.numel() < max(shots):
            raise UserError(
                f"few-shot: class {c} has {idx.numel()} training examples, fewer than the {max(shots)} shots asked"
            )
        per_class.append(idx[torch.randperm(idx.numel(), generator=gen)])
    return {k: torch.cat([p[:k] for p in per_class]) for k in shots}


def fewshot_from_features(
    train_x: torch.Tensor | np.ndarray,
    train_y: torch.Tensor | np.ndarray,
    test_x: torch.Tensor | np.ndarray,
    test_y: torch.Tensor | np.ndarray,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: int | Sequence[int] = 3,
    l2: float = DEFAULT_L2,
    num_classes: int | None = None,
) -> FewShotResult:
    """Few-shot accuracy from precomputed features (N, d) and labels (N,); ``seeds``: a count or a list."""
    train_x, test_x = torch.as_tensor(train_x).double(), torch.as_tensor(test_x).double()
    train_y, test_y = torch.as_tensor(train_y).long(), torch.as_tensor(test_y).long()
    if train_x.ndim != 2 or test_x.ndim != 2 or train_x.shape[1] != test_x.shape[1]:
        raise UserError(
            f"few-shot: features must be (N, d) with the same d, got train {tuple(train_x.shape)} "
            f"and test {tuple(test_x.shape)}"
        )
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise UserError(
            f"few-shot: {len(train_x)} train features vs {len(train_y)} labels, "
            f"{len(test_x)} test features vs {len(test_y)} labels"
        )
    shots = sorted({int(k) for k in shots})
    if not shots or shots[0] < 1:
        raise UserError(f"few-shot: shots must be positive integers, got {shots}")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if num_classes is None:
        num_classes = int(max(train_y.max(), test_y.max())) + 1
    accuracy: dict[int, list[float]] = {k: [] for k in shots}
    for seed in seed_list:
        for k, idx in sample_shots(train_y, num_classes, shots, seed).items():
            accuracy[k].append(linear_fewshot_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
    return FewShotResult(accuracy, float(l2), num_classes, len(test_y), train_x.shape[1], seed_list)


# ---------------------------------------------------------------------------------------------- features
def extract_features(
    model: nn.Module, data: Data, batch_size: int = 128, device: str | torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen representations (N, d) and labels (N,): forward_head(pre_logits=True) of any vitkit model."""
    forward_features, forward_head = getattr(model, "forward_features", None), getattr(model, "forward_head", None)
    if not callable(forward_features) or not callable(forward_head):
        raise UserError(f"few-shot: {type(model).__name__} has no forward_features / forward_head(pre_logits=True)")
    weight = next(model.parameters())
    feats, labels = [], []
    with evaluating(model):
        for x, y in batches(data, batch_size, weight.device if device is None else device, weight.dtype):
            feats.append(forward_head(forward_features(x), pre_logits=True).float().cpu())  # (B, d)
            labels.append(y.long().cpu())
    return torch.cat(feats), torch.cat(labels)


def fewshot(
    model: nn.Module,
    train_data: Data,
    test_data: Data,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: int | Sequence[int] = 3,
    l2: float = DEFAULT_L2,
    batch_size: int = 128,
    num_classes: int | None = None,
    device: str | torch.device | None = None,
) -> FewShotResult:
    """Few-shot linear accuracy of a frozen model: features of both sets once, then every shot count and seed."""
    train_x, train_y = extract_features(model, train_data, batch_size, device)
    test_x, test_y = extract_features(model, test_data, batch_size, device)
    return fewshot_from_features(train_x, train_y, test_x, test_y, shots, seeds, l2, num_classes)
