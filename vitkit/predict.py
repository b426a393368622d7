"""Classify image files with a trained model: top-k classes with probabilities. Images are preprocessed as the
checkpoint's record says (vitkit.preprocessing) and classified in batches; a file that cannot be read is reported in its
result and the others are still classified."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config_of import config_of
from .data import image_transform, load_image
from .errors import UserError, UserFileNotFoundError
from .hub import load_model
from .preprocessing import Preprocessing, read_preprocessing


@dataclass
class Prediction:
    """Top-k result for one file: (class index, name, probability) best first, or the error that stopped it."""

    file: str
    top: list[tuple[int, str, float]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"file": self.file, "error": self.error}
        preds = [{"index": i, "label": name, "probability": p} for i, name, p in self.top]
        return {"file": self.file, "predictions": preds}


def load_for_inference(path: str | Path, **overrides: Any) -> tuple[nn.Module, Preprocessing, dict[str, Any]]:
    """(model in eval mode, its preprocessing, its metadata) of a checkpoint or tag; its input must be square."""
    model, metadata = load_model(path, return_metadata=True, **overrides)
    prep = read_preprocessing(metadata, config_of(model).to_dict(), source=str(path))
    prep.square_size(str(path))
    return model.eval(), prep, metadata or {}


def read_labels(path: str | Path) -> list[str]:
    """Class names from a text file, one per line (surrounding blank lines ignored)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise UserFileNotFoundError(f"{path}: labels file not found") from None
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise UserError(f"{path}: labels file is empty (expected one class name per line)")
    return [line.strip() for line in lines]


# ------------------------------------------------------------------------------------------------ predict
def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.no_grad()
def class_probabilities(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Softmax over the model's classes: images (B, C, H, W) -> (B, K) float32 probabilities."""
    param = next(model.parameters())
    return model(images.to(param.device, param.dtype)).float().softmax(dim=-1)


def predict_files(
    model: nn.Module,
    files: Sequence[str | Path],
    prep: Preprocessing,
    k: int = 5,
    batch_size: int = 32,
    class_names: Sequence[str] | None = None,
) -> list[Prediction]:
    """Top-k predictions for image files, in order; unreadable files get a Prediction with ``error`` set."""
    if k < 1 or batch_size < 1:
        raise UserError(f"predict: top-k and batch size must be >= 1, got k={k}, batch_size={batch_size}")
    names = list(class_names) if class_names is not None else prep.class_names
    transform = image_transform(prep)
    model.eval()
    results: list[Prediction] = []
    for chunk in _chunks(list(files), batch_size):
        batch, ok = [], []
        for f in chunk:
            results.append(Prediction(str(f)))
            try:
                batch.append(transform(load_image(f)))
                ok.append(results[-1])
            except (ValueError, FileNotFoundError, OSError) as e:
                results[-1].error = str(e)
        if not batch:
            continue
        probs = class_probabilities(model, torch.stack(batch))  # (B, K)
        if names is not None and len(names) != probs.shape[-1]:
            raise UserError(f"predict: {len(names)} class names given but the model has {probs.shape[-1]} classes")
        probs, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)  # (B, k) each, best first
        for pred, p_row, i_row in zip(ok, probs.tolist(), idx.tolist()):
            pred.top = [(i, names[i] if names else str(i), p) for i, p in zip(i_row, p_row)]
    return results


def format_predictions(results: Sequence[Prediction]) -> str:
    """Human-readable top-k lists, one block per file (errors are left to the caller's error stream)."""
    blocks = []
    for r in results:
        if r.error is not None:
            continue
        width = max(len(name) for _, name, _ in r.top)
        rows = [f"  {rank}. {name:<{width}}  {100 * p:6.2f}%" for rank, (_, name, p) in enumerate(r.top, 1)]
        blocks.append("\n".join([r.file, *rows]))
    return "\n".join(blocks)
