"""Position embeddings: the fixed 2-D sin-cos table and resampling of learned tables to a new grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserError

Grid = tuple[int, int]


def to_2tuple(x: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    if len(x) != 2:
        raise UserError(f"expected an int or a pair of ints, got {x!r}")
    return (int(x[0]), int(x[1]))


def sincos_2d(grid: Grid, dim: int, temperature: float = 10_000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding (as big_vision's posemb_sincos_2d): (gh * gw, dim), rows in raster order."""
    if dim % 4:
        raise UserError(f"sincos_2d needs a width divisible by 4, got {dim}")
    gh, gw = grid
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32), indexing="ij")
    omega = torch.arange(dim // 4, dtype=torch.float32) / max(dim // 4 - 1, 1)
    omega = 1.0 / temperature**omega
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)


def resample_pos_embed(
    posemb: torch.Tensor,
    new_grid: int | Grid,
    old_grid: int | Grid | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bilinear",
    align_corners: bool | None = None,
) -> torch.Tensor:
    """Resize a learned (1, prefix + gh * gw, D) position embedding to a new patch grid.

    The default is the official algorithm: the class-token row is kept aside, the grid is interpolated
    bilinearly with align_corners=True (what ``scipy.ndimage.zoom(order=1)`` computes) and the rows are
    put back in raster order. ``mode="bicubic"`` uses align_corners=False unless told otherwise.
    The old grid may be non-square; when not given it is taken as the square root of the row count.
    """
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise UserError(f"position embedding must have shape (1, N, D), got {tuple(posemb.shape)}")
    new_grid = to_2tuple(new_grid)
    n_grid = posemb.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = int(round(n_grid**0.5))
        if side * side != n_grid:
            raise UserError(
                f"position embedding has {n_grid} grid rows, not a square: pass old_grid=(rows, cols) explicitly"
            )
        old_grid = (side, side)
    old_grid = to_2tuple(old_grid)
    if old_grid[0] * old_grid[1] != n_grid:
        raise UserError(f"old_grid {old_grid} does not match the {n_grid} grid rows of the position embedding")
    if old_grid == new_grid:
        return posemb
    if align_corners is None:
        align_corners = mode in ("bilinear", "linear")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dtype = grid.dtype
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], -1).permute(0, 3, 1, 2)  # (1, D, gh, gw)
    grid = F.interpolate(grid, size=new_grid, mode=mode, align_corners=align_corners)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], -1).to(dtype)
    return torch.cat([prefix, grid], dim=1)


def resample_1d(table: torch.Tensor, new_len: int) -> torch.Tensor:
    """Linear (align_corners=True) resampling of a (1, L, D) table along L, for the X/Y halves of learned_2d."""
    if table.shape[1] == new_len:
        return table
    out = F.interpolate(table.float().transpose(1, 2), size=new_len, mode="linear", align_corners=True)
    return out.transpose(1, 2).to(table.dtype)
