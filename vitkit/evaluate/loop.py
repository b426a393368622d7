"""The one batched evaluation loop: a frozen model over a data set, batch by batch.

    with evaluating(model):
        for x, y in batches(data, batch_size, device):
            with autocast(device, amp):        # vitkit.device
                out = model(x)

Used by training's evaluation (classification and masked patch prediction), ``vitkit eval`` and few-shot
feature extraction, so that each reads its data, freezes its model and restores it in the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError

# what the loop reads: a Dataset of (image, label) pairs, a DataLoader, or a pair of tensors (images, labels)
Data = Dataset[Any] | DataLoader[Any] | tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode and autograd off for the block; its train / eval mode restored afterwards, also when
    the block raises."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def _pair(data: tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(data) != 2 or not all(isinstance(t, torch.Tensor) for t in data):
        raise UserError(f"expected a data set, a DataLoader or a pair (images, labels) of tensors, got {type(data)}")
    images, labels = data
    if len(images) != len(labels):
        raise UserError(f"{len(images)} images but {len(labels)} labels")
    return images, labels


def _in_memory(data: Dataset[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(images, labels) of a data set whose items are the rows of its ``images`` and ``labels`` tensors
    (vitkit.data.TensorImageDataset): sliced, they need no per-item work."""
    images, labels = getattr(data, "images", None), getattr(data, "labels", None)
    if isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor):
        return images, labels
    return None


def _slices(images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, len(images), batch_size):
        yield images[i : i + batch_size], labels[i : i + batch_size]


def batches(
    data: Data,
    batch_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    num_workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) batches of data in order, on device (images cast to dtype when given); a DataLoader is
    read as it is. An empty data set is a UserError, raised once the loop finds nothing to read."""
    device = torch.device(device)
    source: Iterable[Any]
    if isinstance(data, DataLoader):
        source = data
    elif isinstance(data, (tuple, list)):
        source = _slices(*_pair(data), batch_size)
    elif (tensors := _in_memory(data)) is not None:
        source = _slices(*tensors, batch_size)
    else:
        source = DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=device.type == "cuda")
    empty = True
    for batch in source:
        x, y = batch[0], torch.as_tensor(batch[1])
        empty = False
        yield x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
    if empty:
        raise UserError("the evaluation set is empty")
