"""Multi-process training through PyTorch's own engine: ``torchrun --nproc_per_node N -m vitkit.cli train ...`` (or
any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' -> the local rank's GPU if CUDA is available, else CPU; 'cuda' -> the local rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("run.device=cuda but CUDA is not available; use run.device=cpu or auto")
        return torch.device("cuda", local_rank)
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"run.device={name!r}: not a torch device (expected auto, cpu, cuda, cuda:N)") from None


def setup(device: str = "auto") -> DistInfo:
    """Join the process group if launched by torchrun (WORLD_SIZE > 1); otherwise a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo(device=pick_device(device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's value of obj on every rank (e.g. the run directory it chose)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_mean(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; x is unchanged)."""
    if not info.enabled:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x / info.world_size


def all_reduce_max(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The largest value of x over all ranks (x itself in a single process)."""
    if info.enabled:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x
