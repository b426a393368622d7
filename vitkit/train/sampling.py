"""Seeded data order: every random choice of a run is a function of (seed, epoch, step, position).

Epoch e visits the training set in a permutation seeded with (seed, e); each optimizer step takes the next
batch_size indices (a last partial batch is dropped), split into accum_steps micro-batches and each of those into
one contiguous shard per rank; each item's augmentation is seeded with (seed, epoch, position). So a run restarted
at step s sees exactly the batches it would have seen, with any number of workers and ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..data import TensorImageDataset, WebDatasetStream
from ..data.procedural import ProceduralShapes
from ..device import seed_rng
from ..errors import UserError


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from a tuple of ints (stable across processes and Python versions)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class StepPlan:
    """Which dataset items each rank uses for each micro-batch of each optimizer step."""

    num_items: int
    batch_size: int  # global, per optimizer step
    accum_steps: int = 1
    world_size: int = 1
    rank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        micro = self.batch_size // self.accum_steps
        if self.batch_size % self.accum_steps or micro % self.world_size:
            raise UserError(
                f"optim.batch_size={self.batch_size} must split into optim.accum_steps={self.accum_steps} "
                f"micro-batches of a size divisible by the world size {self.world_size}"
            )
        if self.num_items < self.batch_size:
            raise UserError(
                f"the training set has {self.num_items} items, fewer than one batch (optim.batch_size="
                f"{self.batch_size}); lower the batch size"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    @property
    def micro_batch_size(self) -> int:
        """Items per micro-batch over all ranks."""
        return self.batch_size // self.accum_steps

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 0xDA7A))
        return torch.randperm(self.num_items, generator=g)

    def micro_batch(self, step: int, micro: int, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """(indices, per-item seeds) of this rank's shard of micro-batch ``micro`` of step ``step``."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch) if perm is None else perm
        shard = self.micro_batch_size // self.world_size
        start = pos * self.batch_size + micro * self.micro_batch_size + self.rank * shard
        positions = range(start, start + shard)
        return perm[start : start + shard], [mix_seed(self.seed, epoch, p) for p in positions]

    def global_micro_batch(self, step: int, micro: int, perm: torch.Tensor) -> torch.Tensor:
        """All ranks' indices of a micro-batch (for vectorised augmentation done identically on every rank)."""
        pos = step % self.steps_per_epoch
        start = pos * self.batch_size + micro * self.micro_batch_size
        return perm[start : start + self.micro_batch_size]


class SeededBatches:
    """Batch sampler over steps [start_step, total_steps): yields this rank's micro-batches of (index, seed)."""

    def __init__(self, plan: StepPlan, start_step: int, total_steps: int) -> None:
        self.plan, self.start_step, self.total_steps = plan, start_step, total_steps

    def __len__(self) -> int:
        return max(0, self.total_steps - self.start_step) * self.plan.accum_steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, perm = -1, None
        for step in range(self.start_step, self.total_steps):
            if step // self.plan.steps_per_epoch != epoch:
                epoch = step // self.plan.steps_per_epoch
                perm = self.plan.permutation(epoch)
            for micro in range(self.plan.accum_steps):
                indices, seeds = self.plan.micro_batch(step, micro, perm)
                yield list(zip(indices.tolist(), seeds))


class SeededItems(Dataset):
    """A dataset whose item (index, seed) runs its random transform from the CPU generator seeded with seed."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        seed_rng(seed)
        return self.dataset[index]


def run_batches(
    ds: Dataset[Any], plan: StepPlan, start_step: int, total_steps: int, num_workers: int = 0, pin_memory: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of steps [start_step, total_steps), in the plan's seeded order: in memory (or drawn,
    the shapes without DataLoader workers) with vectorised augmentation, as WebDataset shards (vitkit.data.wds), or
    through a DataLoader of seeded items."""
    if isinstance(ds, TensorImageDataset) or (isinstance(ds, ProceduralShapes) and num_workers == 0):
        shard = plan.micro_batch_size // plan.world_size
        rows = slice(plan.rank * shard, (plan.rank + 1) * shard)
        epoch = start_step // plan.steps_per_epoch
        perm = plan.permutation(epoch)
        for step in range(start_step, total_steps):
            if step // plan.steps_per_epoch != epoch:
                epoch = step // plan.steps_per_epoch
                perm = plan.permutation(epoch)
            for micro in range(plan.accum_steps):
                idx = plan.global_micro_batch(step, micro, perm)
                seed_rng(mix_seed(plan.seed, step, micro, 0xA06))  # CPU tensors; the same on every rank
                yield ds.augment_batch(ds.images_at(idx))[rows], ds.labels[idx][rows]
        return
    if isinstance(ds, WebDatasetStream):  # shards: the stream follows the same plan
        yield from ds.batches(
            batch_size=plan.batch_size,
            accum_steps=plan.accum_steps,
            world_size=plan.world_size,
            rank=plan.rank,
            seed=plan.seed,
            start_step=start_step,
            total_steps=total_steps,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
        return
    sampler = SeededBatches(plan, start_step, total_steps)
    yield from DataLoader(SeededItems(ds), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory)
