"""What the embeddings learned: position-embedding similarity (paper Fig 7 centre) and the principal components
of the patch-embedding filters (Fig 7 left)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..models import VisionTransformer


def position_embedding_grid(model: nn.Module) -> torch.Tensor:
    """The position embedding added to each patch token at the model's grid, as (gh, gw, D), for any table."""
    if not isinstance(model, VisionTransformer):
        raise UserError(f"{type(model).__name__} has no position embedding (only ViTs do)")
    gh, gw = model.grid
    with torch.no_grad():
        table = model._pos_embed_for((gh, gw))
    if table is None:
        raise UserError(f"the model has no position embedding (pos_embed={model.config.pos_embed!r})")
    table = table[0, model.num_prefix_tokens :].detach().float().cpu()  # (gh * gw, D)
    return table.reshape(gh, gw, -1)


def position_similarity(grid_embeddings: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each patch's position embedding with every patch's: (gh, gw, D) -> (gh, gw, gh, gw)."""
    gh, gw, d = grid_embeddings.shape
    flat = F.normalize(grid_embeddings.reshape(gh * gw, d).double(), dim=1)  # (N, D) unit rows
    return (flat @ flat.T).float().reshape(gh, gw, gh, gw)


def patch_filter_components(model: nn.Module, num_components: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Top principal components (n, C, P, P) of the D patch-embedding filters and their share of the variance (n,):
    the basis the model mostly projects patches onto. A hybrid, whose patches are no pixels, is a UserError."""
    embed = getattr(model, "patch_embed", None)
    if embed is None:
        raise UserError(f"{type(model).__name__} has no patch embedding (only ViTs do)")
    if embed.backbone is not None:
        raise UserError(
            "hybrid model: its patch embedding projects ResNet feature maps (1x1 patches in the paper), not pixels"
        )
    w = embed.proj.weight.detach().double().cpu()  # (D, C, P, P)
    flat = w.flatten(1)  # (D, C * P * P)
    flat = flat - flat.mean(dim=0, keepdim=True)
    _, s, vt = torch.linalg.svd(flat, full_matrices=False)  # vt (min(D, CPP), CPP)
    n = min(num_components, vt.shape[0])
    var = s**2
    explained = var[:n] / var.sum().clamp_min(1e-30)
    return vt[:n].reshape(n, *w.shape[1:]).float(), explained.float()
