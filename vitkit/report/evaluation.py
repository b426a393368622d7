"""A model's held-out predictions, as a confusion matrix and the images it gets most wrong."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset

from ..evaluate.loop import Data, batches, evaluating
from ..predict import Preprocessing
from .html import Html, Row, fmt, image, join, percent, png_of_array, table, tag

MAX_EVAL_IMAGES = 10_000  # more held-out images than this: a seeded random sample of them, said on the page
MATRIX_MAX_CLASSES = 30  # more classes than this: the most frequent confusions instead of the matrix
WORST_IMAGES = 16  # the held-out images shown as the worst classified


@dataclass
class Predictions:
    """The model's answer for each scored held-out image."""

    indices: np.ndarray  # into the evaluation set
    labels: np.ndarray  # the true classes
    predicted: np.ndarray
    true_prob: np.ndarray  # the probability of the true class
    top_prob: np.ndarray  # the probability of the predicted one
    num_classes: int
    total: int  # the size of the whole evaluation set
    worst: np.ndarray  # rows of the arrays above: the lowest true-class probabilities, lowest first
    worst_inputs: torch.Tensor  # (len(worst), C, H, W) their model inputs, on the CPU

    @property
    def accuracy(self) -> float:
        return float((self.labels == self.predicted).mean())


def predict_held_out(
    model: nn.Module,
    dataset: Dataset[Any],
    num_classes: int,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    max_images: int = MAX_EVAL_IMAGES,
    seed: int = 0,
    worst: int = WORST_IMAGES,
) -> Predictions:
    """Predictions of model on the evaluation set (fp32), on a seeded sample of ``max_images`` when there are more
    (a stream's first ``max_images``); the ``worst`` lowest true-class probabilities keep their inputs as they pass,
    so that a stream needs no second reading."""
    assert isinstance(dataset, Sized), "an evaluation set has a length"
    total = len(dataset)
    indices = np.arange(min(total, max_images) if isinstance(dataset, IterableDataset) else total)
    if len(indices) > max_images:
        indices = np.sort(np.random.default_rng(seed).choice(total, max_images, replace=False))
    data: Data = dataset
    images, labels = getattr(dataset, "images", None), getattr(dataset, "labels", None)
    if len(indices) < total and not isinstance(dataset, IterableDataset):
        if isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor):  # in memory: slice, no per-item work
            data = (images[indices], labels[indices])
        else:
            data = Subset(dataset, indices.tolist())
    outs: list[tuple[torch.Tensor, ...]] = []
    seen = 0  # rows scored so far
    kept, kept_p, kept_x = torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0)
    with evaluating(model):
        for x, y in batches(data, batch_size, device):
            x, y = x[: len(indices) - seen], y[: len(indices) - seen]  # a stream: its first len(indices) rows
            probs = model(x).float().softmax(dim=-1)  # (B, K)
            top = probs.max(dim=-1)
            p_true = probs.gather(1, y[:, None])[:, 0].cpu()
            outs.append((y.cpu(), top.indices.cpu(), p_true, top.values.cpu()))
            low = torch.sort(p_true, stable=True).indices[:worst]  # stable: among equals the earlier row first
            order = torch.sort(torch.cat([kept_p, p_true[low]]), stable=True).indices[:worst]
            kept, kept_p = torch.cat([kept, seen + low])[order], torch.cat([kept_p, p_true[low]])[order]
            kept_x = torch.cat([kept_x.reshape(-1, *x.shape[1:]), x[low].cpu()])[order]
            seen += len(y)
            if seen >= len(indices):
                break
    labels_, pred, p_true_, p_top = (torch.cat(t).numpy() for t in zip(*outs))
    return Predictions(indices, labels_, pred, p_true_, p_top, num_classes, total, kept.numpy(), kept_x)


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """(K, K) counts: row = true class, column = predicted class."""
    flat = np.asarray(labels, dtype=np.int64) * num_classes + np.asarray(predicted, dtype=np.int64)
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def _name(names: Sequence[str], k: int) -> str:
    return names[k] if k < len(names) else str(k)


def confusion_section(pred: Predictions, names: Sequence[str]) -> Html:
    """The confusion matrix (rows: true class, with its recall), or for many classes the most frequent confusions."""
    k = pred.num_classes
    cm = confusion_matrix(pred.labels, pred.predicted, k)
    if k > MATRIX_MAX_CLASSES:
        off = [(int(cm[i, j]), i, j) for i in range(k) for j in range(k) if i != j and cm[i, j]]
        off.sort(reverse=True)
        rows = [Row([_name(names, i), _name(names, j), fmt(n)]) for n, i, j in off[:25]]
        return table(
            ["true class", "predicted as", "images"],
            rows,
            caption=f"The most frequent confusions ({k} classes: too many for a matrix)",
        )
    head = ["true \\ predicted", *(_name(names, j) for j in range(k)), "images", "recall"]
    body = []
    for i in range(k):
        n = int(cm[i].sum())
        cells = [tag("th", _name(names, i), scope="row")]
        for j in range(k):
            share = cm[i, j] / n if n else 0.0
            cls = " ".join(c for c in ("diagonal" if i == j else "", "zero" if cm[i, j] == 0 else "") if c)
            title = f"true {_name(names, i)}, predicted {_name(names, j)}: {cm[i, j]} of {n} images"
            cells.append(tag("td", str(cm[i, j]), cls=cls or None, style=f"--share:{0.85 * share:.3f}", title=title))
        cells += [tag("td", fmt(n), cls="num"), tag("td", percent(cm[i, i] / n, 1) if n else "–", cls="num")]
        body.append(tag("tr", join(cells)))
    caption = "Confusion matrix: rows are the true class, columns the prediction; shade: the share of the row"
    parts = [tag("caption", caption), tag("thead", tag("tr", join(tag("th", h, scope="col") for h in head)))]
    return tag("div", tag("table", join([*parts, tag("tbody", join(body))]), cls="confusion"), cls="table-box")


def worst_section(pred: Predictions, prep: Preprocessing, names: Sequence[str]) -> Html:
    """The held-out images whose true class got the least probability, with what the model said instead."""
    wrong = int((pred.labels != pred.predicted).sum())
    items = []
    for r, x in zip(pred.worst, pred.worst_inputs):
        truth, guess = _name(names, int(pred.labels[r])), _name(names, int(pred.predicted[r]))
        said = f"predicted {guess} ({percent(float(pred.top_prob[r]), 0)})"
        verdict = said if truth != guess else f"right, at {percent(float(pred.true_prob[r]), 0)}"
        detail = f"p(true) {percent(float(pred.true_prob[r]), 1)} · #{int(pred.indices[r])}"
        caption = join([tag("strong", f"true {truth}"), Html("<br>"), verdict, Html("<br>"), detail])
        png = png_of_array(prep.to_display(x).numpy())
        alt = f"held-out image {int(pred.indices[r])}: true class {truth}, {said}"
        items.append(image(png, alt, caption, cls="thumb", pixelated=max(prep.size) <= 64))
    intro = (
        f"{wrong} of {len(pred.labels)} scored images are misclassified. The {len(pred.worst)} below gave their true "
        "class the least probability, lowest first."
    )
    return join([tag("p", intro, cls="note"), tag("div", join(items), cls="gallery")])
