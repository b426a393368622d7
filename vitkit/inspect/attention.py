"""What the attention does: per-layer maps, attention rollout (paper Fig 6) and mean attention distance (Fig 7, 11).

Every function works for class-token, GAP, MAP-head and first-token models and for hybrids (token positions come
from the model's grid and stride). The rows a map shows are those the pooled output reads of the last layer's
tokens: the class token's, the mean of all (GAP), the first token's, or for a MAP head the rows weighted by its
probe's attention (the probe has no residual, so that attention is exactly how the pooled output draws on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..evaluate.loop import evaluating
from ..models import VisionTransformer
from ..models.heads import FIRST_TOKEN

Attention = torch.Tensor | Sequence[torch.Tensor]  # (L, B, nh, N, N) or L x (B, nh, N, N)


@dataclass
class AttentionRecord:
    """One forward pass with its attention probabilities, as record_attention keeps it."""

    attention: torch.Tensor  # (L, B, nh, N, N)
    grid: tuple[int, int]  # (gh, gw) patch tokens
    num_prefix_tokens: int
    stride: tuple[int, int]  # input pixels per token
    logits: torch.Tensor
    # (B, N): how the pooled output weighs the last layer's tokens when it is neither the class token nor their mean
    readout: torch.Tensor | None = None  # MAP: the probe's head-averaged attention; first-token: one-hot
    map_attention: torch.Tensor | None = None  # (B, nh, N): a MAP head's probe attention


@torch.no_grad()
def record_attention(model: nn.Module, images: torch.Tensor) -> AttentionRecord:
    """Run images (B, C, H, W) through the model in eval mode and keep every layer's attention probabilities."""
    if not isinstance(model, VisionTransformer):
        raise UserError(f"attention inspection needs a VisionTransformer, got {type(model).__name__}")
    with evaluating(model):
        out = model.forward_intermediates(images, return_attention=True)
    grid = tuple(out["patches"].shape[-2:])
    attention = torch.stack(out["attention"])  # (L, B, nh, N, N)
    probe, readout = out.get("map_attention"), None
    if probe is not None:
        probe = probe[:, :, 0]  # (B, nh, N): the one probe's row
        readout = probe.mean(dim=1)
    elif model.config.classifier == "first":
        readout = F.one_hot(torch.zeros(attention.shape[1], dtype=torch.long), attention.shape[-1]).to(attention)
    return AttentionRecord(attention, grid, model.num_prefix_tokens, model.config.stride, out["logits"], readout, probe)


def attention_maps(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Attention probabilities of every layer and head: (L, B, nh, N, N); rows (queries) sum to 1."""
    return record_attention(model, images).attention


def _stack(attention: Attention) -> torch.Tensor:
    attn = attention if isinstance(attention, torch.Tensor) else torch.stack(list(attention))
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2] or attn.shape[0] == 0:
        raise UserError(f"attention must be (layers >= 1, batch, heads, N, N), got {tuple(attn.shape)}")
    return attn.float()


def query_attention(record: AttentionRecord) -> torch.Tensor:
    """Per layer and head, where the pooled output looks: (L, B, nh, gh, gw) over the patch tokens."""
    attn, p = _stack(record.attention), record.num_prefix_tokens
    if record.readout is not None:
        rows = torch.einsum("bn,lbhnm->lbhm", record.readout.float(), attn)[..., p:]
    else:
        rows = attn[..., 0, p:] if p else attn.mean(dim=-2)  # (L, B, nh, gh * gw)
    return rows.reshape(*rows.shape[:3], *record.grid)


def attention_rollout(attention: Attention, residual: bool = True) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): how much each output token draws on each input token; ``attention``
    (L, B, nh, N, N) -> (B, N, N). Per layer: average the heads, add the identity for the residual connection,
    renormalise each row to sum to 1; then multiply the layers, last layer leftmost (R = A_L ... A_2 A_1), so R[b, i, j]
    is output token i's share of input token j. Rows of R sum to 1."""
    attn = _stack(attention)
    eye = torch.eye(attn.shape[-1], dtype=attn.dtype, device=attn.device)
    joint: torch.Tensor | None = None
    for layer in attn:  # (B, nh, N, N)
        a = layer.mean(dim=1)  # (B, N, N)
        if residual:
            a = a + eye
        a = a / a.sum(dim=-1, keepdim=True)
        joint = a if joint is None else a @ joint
    assert joint is not None, "no layers"  # _stack refuses an empty stack
    return joint


def rollout_map(record: AttentionRecord) -> torch.Tensor:
    """The rollout of the output that feeds the head, over the patch grid: (B, gh, gw), sums to <= 1 (the class
    token's own share is dropped; a MAP head's probe is one more step, without identity: it has no residual)."""
    joint, p = attention_rollout(record.attention), record.num_prefix_tokens
    if record.readout is not None:
        rows = (record.readout.float()[:, None, :] @ joint)[:, 0, p:]
    else:
        rows = joint[:, 0, p:] if p else joint.mean(dim=1)  # (B, gh * gw)
    return rows.reshape(rows.shape[0], *record.grid)


def probe_attention(record: AttentionRecord) -> torch.Tensor | None:
    """A MAP head's probe attention per head as maps over the patch grid: (B, nh, gh, gw); None for other models."""
    if record.map_attention is None:
        return None
    rows = record.map_attention[..., record.num_prefix_tokens :].float()
    return rows.reshape(*rows.shape[:2], *record.grid)


def upsample_map(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, gh, gw) token maps -> (B, H, W) per-pixel maps by bilinear interpolation, for overlays on the image."""
    return F.interpolate(maps[:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0]


def token_distances(grid: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor:
    """Euclidean distance in input pixels between the centres of every pair of patch tokens: (N, N), N = gh * gw."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    pos = torch.stack([rows.flatten() * stride[0], cols.flatten() * stride[1]], dim=1).double()  # (N, 2)
    return torch.cdist(pos, pos)


def mean_attention_distance(
    attention: Attention, grid: tuple[int, int], stride: tuple[int, int], num_prefix_tokens: int = 0
) -> torch.Tensor:
    """Mean attention distance in input pixels per layer and head, averaged over images and queries: (L, nh). Per patch
    query, the distance to each patch key weighted by its attention (a CNN's receptive field size, paper Fig 7 right).
    Queries: the patch tokens' only; the class token has no position, so its row and column are left out and each
    patch query's weights renormalised over the patch keys."""
    attn = _stack(attention)
    n = grid[0] * grid[1]
    if attn.shape[-1] != num_prefix_tokens + n:
        raise UserError(f"attention has {attn.shape[-1]} tokens but {num_prefix_tokens} + the grid {grid} make {n}")
    dist = token_distances(grid, stride).to(attn.device)  # (P, P)
    out = []
    for layer in attn:  # one layer at a time: the float64 copy of all of them can be large
        a = layer[..., num_prefix_tokens:, num_prefix_tokens:].double()  # (B, nh, P, P)
        a = a / a.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        out.append((a * dist).sum(dim=-1).mean(dim=(0, 2)))  # (nh,): over queries and images
    return torch.stack(out).float()  # (L, nh)


def attention_distance(model: nn.Module, images: torch.Tensor, batch_size: int = 8) -> np.ndarray:
    """Mean attention distance (pixels) per layer and head over images (B, C, H, W): (L, nh), in batches so that
    the attention of a large set is never held at once."""
    if len(images) == 0:
        raise UserError("attention_distance: no images given")
    total: torch.Tensor | None = None
    count = 0
    for i in range(0, len(images), batch_size):
        rec = record_attention(model, images[i : i + batch_size])
        d = mean_attention_distance(rec.attention, rec.grid, rec.stride, rec.num_prefix_tokens)  # (L, nh)
        b = rec.attention.shape[1]
        total = d * b if total is None else total + d * b
        count += b
    assert total is not None  # images is not empty
    return (total / count).cpu().numpy()


def untrained_layers(model: VisionTransformer) -> list[int]:
    """The layers that the attention distance (an average over patch queries) leaves out, because training never
    shapes their patch queries' attention: the last layer of a model whose classifier reads the first token alone
    (the class token, or one patch token for "first"), as that layer's other outputs are dropped; none when the
    pooling reads every token (GAP, MAP)."""
    return [len(model.blocks) - 1] if model.config.classifier in FIRST_TOKEN else []
