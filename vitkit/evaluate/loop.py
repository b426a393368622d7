"""The one batched evaluation loop: a frozen model over a data set, batch by batch.

    with evaluating(model):
        for x, y in batches(data, batch_size, device):
            with autocast(device, amp):        # vitkit.device
                out = model(x)

Training's evaluation, ``vitkit eval`` and few-shot features all read their data and freeze their model here.
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
    """The model in eval mode and autograd off for the block; its mode restored afterwards, whatever happens."""
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
    """(images, labels) of a data set held as two tensors (TensorImageDataset), sliced without per-item work."""
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
    """(images, labels) batches of data in order, on device, images cast to dtype; an empty data set is a UserError.
    Several ``num_workers`` each load a chunk of every batch, so that a small set keeps them all busy."""
    device = torch.device(device)
    source: Iterable[Any]
    chunk = batch_size
    if isinstance(data, DataLoader):
        source = data
    elif isinstance(data, (tuple, list)):
        source = _slices(*_pair(data), batch_size)
    elif (tensors := _in_memory(data)) is not None:
        source = _slices(*tensors, batch_size)
    else:
        chunk = -(-batch_size // max(num_workers, 1))
        source = DataLoader(data, batch_size=chunk, num_workers=num_workers, pin_memory=device.type == "cuda")
    pairs = (
        (x.to(device, dtype, non_blocking=True), torch.as_tensor(y).to(device, non_blocking=True))
        for x, y, *_ in source
    )
    empty = True
    for pair in pairs if chunk == batch_size else _joined(pairs, batch_size):
        empty = False
        yield pair
    if empty:
        raise UserError("the evaluation set is empty")


def _joined(
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (images, labels) chunks as batches of batch_size, in order; the last batch holds the rest."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    held = 0
    for x, y in chunks:
        xs.append(x)
        ys.append(y)
        held += len(x)
        if held >= batch_size:
            x, y = torch.cat(xs), torch.cat(ys)
            yield x[:batch_size], y[:batch_size]
            xs, ys, held = [x[batch_size:]], [y[batch_size:]], held - batch_size
    if held:
        yield torch.cat(xs), torch.cat(ys)
