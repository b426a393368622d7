"""Position embeddings: the fixed 2-D sin-cos table, resampling of learned tables to a new grid, and the offset
tables of relative position attention (paper appendix D.4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError, UserError

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


def check_config(width: int, pos_embed: str, where: str) -> None:
    """ConfigError where a ViTConfig's position embedding cannot be built at this width or in this place."""
    if pos_embed == "learned_2d" and width % 2:
        raise ConfigError(f"ViTConfig: learned_2d position embeddings need an even width, got {width}")
    if pos_embed == "sincos_2d" and width % 4:
        raise ConfigError(f"ViTConfig: sincos_2d position embeddings need a width divisible by 4, got {width}")
    if where != "input" and pos_embed not in ("learned", "learned_2d", "sincos_2d"):
        raise ConfigError(
            f"ViTConfig.pos_embed_where={where!r}: pos_embed={pos_embed!r} adds no table to the tokens (relative "
            "positions already act in every block's attention); use 'input'"
        )
    if pos_embed == "sincos_2d" and where == "every_layer":
        raise ConfigError(
            "ViTConfig.pos_embed_where='every_layer': the sincos_2d table is fixed, so each block's own table would "
            "be the same one; use 'every_layer_shared'"
        )


def learned_2d(x_table: torch.Tensor, y_table: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The 2-D learned table of a grid (tables, gh * gw, D) from its column (tables, gw', D/2) and row (tables, gh',
    D/2) embeddings, each resampled to the grid: patch (i, j) gets [x_j, y_i] (the paper's appendix D.4)."""
    x = resample_1d(x_table, grid[1])[:, None, :, :].expand(-1, grid[0], -1, -1)  # (tables, gh, gw, D/2)
    y = resample_1d(y_table, grid[0])[:, :, None, :].expand(-1, -1, grid[1], -1)
    return torch.cat([x, y], dim=-1).flatten(1, 2)


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
    A stack of tables, one per layer (L, prefix + gh * gw, D), is resampled table by table."""
    if posemb.ndim != 3:
        raise UserError(f"position embedding must have shape (1, N, D) or (layers, N, D), got {tuple(posemb.shape)}")
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
    L, dtype = grid.shape[0], grid.dtype
    grid = grid.float().reshape(L, old_grid[0], old_grid[1], -1).permute(0, 3, 1, 2)  # (L, D, gh, gw)
    grid = F.interpolate(grid, size=new_grid, mode=mode, align_corners=align_corners)
    grid = grid.permute(0, 2, 3, 1).reshape(L, new_grid[0] * new_grid[1], -1).to(dtype)
    return torch.cat([prefix, grid], dim=1)


def resample_1d(table: torch.Tensor, new_len: int) -> torch.Tensor:
    """Linear (align_corners=True) resampling of a (layers, L, D) table along L, for the halves of learned_2d."""
    if table.shape[1] == new_len:
        return table
    out = F.interpolate(table.float().transpose(1, 2), size=new_len, mode="linear", align_corners=True)
    return out.transpose(1, 2).to(table.dtype)


# ------------------------------------------------------------------------------------- relative positions
# Appendix D.4: each pair (query patch i, key patch j) reads the learned embedding of its offset j - i. With
# dims=1 (the paper's) the offset is taken in raster order: -(N-1)..N-1, a (2N - 1, D) table. With dims=2 it
# is the (row, column) offset: a (2 gh - 1, 2 gw - 1, D) table, read in raster order. Row 0 of either table
# is the most negative offset, so offset 0 sits in the middle.


def relative_table_shape(grid: Grid, dims: int) -> tuple[int, ...]:
    """The offset axes of a relative-position table for a token grid: (2N - 1,) or (2 gh - 1, 2 gw - 1)."""
    gh, gw = grid
    return (2 * gh * gw - 1,) if dims == 1 else (2 * gh - 1, 2 * gw - 1)


def relative_index(grid: Grid, dims: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(N, N) long: the row of the flattened offset table that query patch i and key patch j read."""
    gh, gw = grid
    if dims == 1:
        pos = torch.arange(gh * gw, device=device)
        return pos[None, :] - pos[:, None] + (gh * gw - 1)
    y, x = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    y, x = y.flatten(), x.flatten()
    dy = y[None, :] - y[:, None] + (gh - 1)  # (N, N) in 0..2gh-2
    dx = x[None, :] - x[:, None] + (gw - 1)  # (N, N) in 0..2gw-2
    return dy * (2 * gw - 1) + dx


def resample_relative(
    table: torch.Tensor, shape: tuple[int, ...], old_grid: Grid | None = None, new_grid: Grid | None = None
) -> torch.Tensor:
    """Resize a relative-position table (*offsets, D) to new offset axes ``shape`` (see relative_table_shape). The
    offset range stretches with the grid, as resample_pos_embed stretches an absolute table: each (row, column) offset
    axis is interpolated linearly with align_corners=True, offset 0 kept at 0 (also where an axis shrinks to one
    offset); the table itself is returned where it fits. A 1-D table's raster offsets depend on the grid's width
    (one row down is +gw), so it is resampled through (row, column) offsets (resample_relative_1d), which needs
    ``old_grid`` and ``new_grid`` (default: the square grids the lengths imply)."""
    if table.ndim - 1 != len(shape):
        raise UserError(f"relative table {tuple(table.shape)} has {table.ndim - 1} offset axes, not {len(shape)}")
    if len(shape) == 1:
        old = old_grid or _square_grid(table.shape[0])
        new = new_grid or _square_grid(shape[0])
        if 2 * new[0] * new[1] - 1 != shape[0]:
            raise UserError(f"relative table shape {tuple(shape)} is not that of a {new[0]}x{new[1]} grid")
        return resample_relative_1d(table, old, new)
    return _stretch_offsets(table, shape)


def resample_relative_1d(table: torch.Tensor, old_grid: Grid, new_grid: Grid) -> torch.Tensor:
    """Resize a 1-D (raster-order) relative table (2 N - 1, D) of an old grid to a new grid's (2 N' - 1, D). The old
    table is read as the (2 gh - 1, 2 gw - 1, D) table of (row, column) offsets it gives each patch pair
    (offset dy * gw + dx), stretched as a 2-D table is, and folded back to raster order. A raster offset of the new grid
    can stand for two (row, column) offsets (in a 4-wide grid +3 is (0, 3) and (1, -1)); it gets the mean of their
    values weighted by how many patch pairs have each, which is the single value closest (least squares over all
    query-key pairs) to what the stretched 2-D table gives them."""
    gh, gw = old_grid
    if table.ndim != 2 or table.shape[0] != 2 * gh * gw - 1:
        raise UserError(f"relative table {tuple(table.shape)} is not the 1-D table of a {gh}x{gw} grid")
    if tuple(old_grid) == tuple(new_grid):
        return table
    dy, dx = torch.arange(1 - gh, gh, device=table.device), torch.arange(1 - gw, gw, device=table.device)
    table_2d = table[dy[:, None] * gw + dx[None, :] + (gh * gw - 1)]  # (2gh-1, 2gw-1, D)
    nh, nw = new_grid
    stretched = _stretch_offsets(table_2d.float(), (2 * nh - 1, 2 * nw - 1)).flatten(0, 1)  # (E2, D)
    dy, dx = torch.arange(1 - nh, nh, device=table.device), torch.arange(1 - nw, nw, device=table.device)
    raster = (dy[:, None] * nw + dx[None, :] + (nh * nw - 1)).flatten()  # (E2,): each offset's 1-D row
    pairs = ((nh - dy.abs())[:, None] * (nw - dx.abs())[None, :]).flatten().float()  # patch pairs per offset
    total = stretched.new_zeros(2 * nh * nw - 1, table.shape[1]).index_add_(0, raster, stretched * pairs[:, None])
    weight = pairs.new_zeros(2 * nh * nw - 1).index_add_(0, raster, pairs)  # > 0: every raster offset occurs
    return (total / weight[:, None]).to(table.dtype)


def _square_grid(offsets: int) -> Grid:
    side = math.isqrt((offsets + 1) // 2)
    if 2 * side * side - 1 != offsets:
        raise UserError(
            f"a 1-D relative table of {offsets} offsets is not a square grid's, so its (row, column) offsets cannot "
            "be recovered to resample it: give the grids it belongs to"
        )
    return (side, side)


def _stretch_offsets(table: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Linear (align_corners=True) resampling of each offset axis of (*offsets, D); see resample_relative."""
    if tuple(table.shape[:-1]) == tuple(shape):
        return table
    out = table.float()
    for axis, new in enumerate(shape):
        old = out.shape[axis]
        if old == new:
            continue
        if new == 1:  # align_corners would pick the most negative offset: keep offset 0 instead
            out = out.narrow(axis, (old - 1) // 2, 1)
            continue
        moved = out.movedim(axis, -1)  # (..., old)
        flat = F.interpolate(moved.reshape(-1, 1, old), size=new, mode="linear", align_corners=True)
        out = flat.reshape(*moved.shape[:-1], new).movedim(-1, axis)
    return out.to(table.dtype)


@dataclass(frozen=True)
class RelativePositions:
    """One call's token layout as relative position attention reads it; built once per forward for all blocks."""

    index: torch.Tensor  # (N, N) long: the offset-table row that query patch i and key patch j read
    table_shape: tuple[int, ...]  # offset axes for this grid: (2N - 1,) or (2 gh - 1, 2 gw - 1)
    grid: Grid  # this call's patch grid (gh, gw)
    table_grid: Grid  # the grid the model's tables were built for: another grid's table is resampled from it
    prefix: int  # tokens before the patches (the class token): pairs involving them get no relative term


def relative_positions(grid: Grid, table_grid: Grid, dims: int, prefix: int, device: torch.device) -> RelativePositions:
    """The layout of a grid's tokens for relative position attention with ``dims``-D offsets."""
    return RelativePositions(
        relative_index(grid, dims, device), relative_table_shape(grid, dims), grid, table_grid, prefix
    )


def relative_logits(q: torch.Tensor, table: torch.Tensor, rel: RelativePositions) -> torch.Tensor | None:
    """The relative logits q_i . r_{j-i} of the first n queries q (B, nh, n, hd), already scaled by 1/sqrt(hd) as
    the content logits are, against all T tokens: (B, nh, n, T). ``table`` is a layer's (*offsets, D) table, each
    head reading its own head_dim slice of an offset's embedding, as it does of a key. Rows and columns of the
    class token are zero; None when no query is a patch."""
    B, nh, n, hd = q.shape
    qp = q[:, :, rel.prefix :]  # (B, nh, n_p, hd): the patch queries
    n_p = qp.shape[2]
    if n_p == 0:
        return None
    table = resample_relative(table, rel.table_shape, rel.table_grid, rel.grid)  # another grid: resampled
    table = table.reshape(-1, nh, hd).transpose(0, 1).to(q.dtype)  # (nh, E, hd), E offsets
    logits = qp @ table.transpose(1, 2)  # (B, nh, n_p, E): each query against every offset's embedding
    bias = logits.gather(-1, rel.index[:n_p].expand(B, nh, -1, -1))  # (B, nh, n_p, N)
    return F.pad(bias, (rel.prefix, 0, n - n_p, 0))  # (B, nh, n, T)
