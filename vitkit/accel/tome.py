"""Token merging (ToMe: Bolya et al. 2023, "Token Merging: Your ViT But Faster"): a trade of accuracy for speed.

In each block, between attention and the MLP, the r most similar pairs of tokens are merged into one, so every later
layer runs on fewer tokens. Similarity is the cosine of the tokens' keys (averaged over heads), which the attention
computed anyway. Matching is bipartite: tokens at even positions (set A) each pick their most similar token at an odd
position (set B); the r A tokens with the most similar picks are averaged into them, weighted by how many patches each
token already stands for (its size). Attention then weights each key by its size (proportional attention: log size is
added to the logits), so a token that stands for s identical tokens draws the attention those s tokens would. Merging
two identical tokens therefore changes nothing downstream: the test that pins the bookkeeping.

Protected tokens (the class token, which the head reads) are never merged away and nothing is merged into them.
``apply_token_merging(model, r)`` patches a built model as ToMe patches timm's: its class, its blocks' and their
attention's become subclasses that merge within forward() (forward_features still gives every token).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError
from ..models.vit import Attention, Block, Probs, Rel, VisionTransformer


def merged_away(tokens: int, r: int, protected: int = 1) -> int:
    """How many of ``tokens`` a merge of r pairs removes: r, capped at half the unprotected tokens."""
    return max(0, min(r, (tokens - protected) // 2))


def merge_tokens(
    x: torch.Tensor, sizes: torch.Tensor | None, keys: torch.Tensor, r: int, protected: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge r pairs of tokens: (B, N, D) -> (B, N - r, D), with the merged tokens' sizes (B, N - r, 1). ``sizes``: how
    many input patches each token stands for (None: one each). ``keys``: (B, N, d) the tokens' keys averaged over heads,
    the similarity metric. ``protected``: the first tokens, never merged (the class token, which stays first). The
    result is the unmerged A tokens in their order, then the B tokens, so token order is not the image's. r is capped at
    half the unprotected tokens; with r <= 0 nothing changes."""
    B, N, D = x.shape
    r = merged_away(N, r, protected)
    if not r:
        return x, sizes
    with torch.no_grad():  # the matching is discrete: gradients flow through the averages below, not through it
        metric = F.normalize(keys, dim=-1)
        scores = metric[:, ::2] @ metric[:, 1::2].transpose(1, 2)  # (B, |A|, |B|) cosine similarities
        # token i is A[i // 2] for even i, else B[i // 2]: protected A tokens pick none, protected B ones are not picked
        scores[:, : (protected + 1) // 2] = -torch.inf
        scores[:, :, : protected // 2] = -torch.inf
        best, best_b = scores.max(dim=-1)  # (B, |A|): each A token's most similar B token
        order = best.argsort(dim=-1, descending=True)[..., None]  # A tokens, most similar pick first
        kept_a = order[:, r:].sort(dim=1).values  # unmerged A tokens, in their order (protected ones first)
        merged_a = order[:, :r]
        into_b = best_b[..., None].gather(1, merged_a)  # (B, r, 1): the B token each merged A token joins

    def merge(t: torch.Tensor) -> torch.Tensor:  # (B, N, C) summed: kept A tokens, then B with A's merged in
        a, b = t[:, ::2], t[:, 1::2]
        C = t.shape[-1]
        kept = a.gather(1, kept_a.expand(B, -1, C))
        b = b.scatter_add(1, into_b.expand(B, r, C), a.gather(1, merged_a.expand(B, r, C)))
        return torch.cat([kept, b], dim=1)

    if sizes is None:
        sizes = x.new_ones(B, N, 1)
    merged_sizes = merge(sizes)
    return merge(x * sizes) / merged_sizes, merged_sizes


def size_bias(sizes: torch.Tensor | None) -> torch.Tensor | None:
    """Proportional attention's additive logit bias (B, 1, 1, N), log of each key's size; None before any merge."""
    return None if sizes is None else sizes.log()[:, None, None, :, 0]


class ToMeAttention(Attention):
    """Attention that, while its model merges, records the keys averaged over heads (the merge's similarity) and
    adds log size to the logits (proportional attention)."""

    _tome: dict[str, Any]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, explicit: bool, attention: Probs = None
    ) -> Tensor:
        state = self._tome
        if state["active"]:
            state["keys"] = k.mean(1)
            sizes = size_bias(state["sizes"])
            if sizes is not None:
                bias = sizes if bias is None else bias + sizes
        return super().attend(q, k, v, bias, explicit, attention)


class ToMeBlock(Block):
    """A Block that, while its model merges, merges r pairs of tokens between attention and the MLP."""

    _tome: dict[str, Any]

    def forward(self, x: Tensor, rel: Rel = None, explicit: bool = False, attention: Probs = None) -> Tensor:
        state = self._tome
        if not state["active"]:
            return super().forward(x, rel, explicit, attention)
        x = x + self.drop_path1(self.attn(self.norm1(x), rel, explicit, attention))
        x, state["sizes"] = merge_tokens(x, state["sizes"], state["keys"], state["r"], protected=1)
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class ToMeViT(VisionTransformer):
    """A VisionTransformer whose forward() merges ``token_merge`` pairs of tokens in every block."""

    _tome: dict[str, Any]

    @property
    def token_merge(self) -> int:
        return int(self._tome["r"])

    def forward(self, x: Tensor, attn_impl: str | None = None) -> Tensor:
        self._tome.update(active=True, sizes=None, keys=None)
        try:
            return super().forward(x, attn_impl)
        finally:
            self._tome.update(active=False, sizes=None, keys=None)


def apply_token_merging(model: VisionTransformer, r: int) -> VisionTransformer:
    """Patch model in place so that forward() merges r pairs of tokens in every block (r = 0: merging off again,
    where it was on); returns the model. Refused where merged tokens have no meaning: a head that does not read the
    first token, positions other than at the input, relative positions, gradient checkpointing."""
    cfg = model.config
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ConfigError(f"token_merge={r!r}: expected tokens per block, >= 0")
    if r and (cfg.classifier not in ("token", "first") or cfg.relative_dims or cfg.pos_embed_where != "input"):
        raise ConfigError(
            f"token_merge={r}: token merging needs a head that reads the first token (classifier 'token' or "
            f"'first', not {cfg.classifier!r}) and positions added at the input only (not pos_embed={cfg.pos_embed!r}, "
            f"pos_embed_where={cfg.pos_embed_where!r}): merged tokens have no place on the grid"
        )
    if r and cfg.grad_checkpointing:
        raise ConfigError(f"token_merge={r}: not with grad_checkpointing, whose recomputation would merge again")
    if isinstance(model, ToMeViT):
        model._tome["r"] = r
        return model
    if not r:
        return model
    if type(model) is not VisionTransformer:
        raise ConfigError(
            f"token_merge={r}: a {type(model).__name__} is patched already; merge tokens in a model as built"
        )
    state: dict[str, Any] = {"r": r, "active": False, "sizes": None, "keys": None}
    for module, patched in ((model, ToMeViT), *((blk, ToMeBlock) for blk in model.blocks)):
        module.__class__ = patched
        module.__dict__["_tome"] = state  # one state shared by the model, its blocks and their attention
    for blk in model.typed_blocks():
        blk.attn.__class__ = ToMeAttention
        blk.attn.__dict__["_tome"] = state
    return model
