"""A class-token model's forward() with its last block computing the first token alone.

The head of a class-token (or first-token) model reads one token of the last block's output, and every step of a
block but attention is per token, while attention still reads the keys and values of all. So forward() can run the
last block for the first token alone: the same logits and gradients for about 1/depth less work. Applied from
outside, as ToMe patches a model: the model's class becomes a subclass whose forward() does this, its last block's
a subclass that can; forward_features and forward_intermediates still give every token, and the state dict is the
model's. Measured by benchmarks/main_job_step.py and benchmarks/bench_vit.py.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from ..models.vit import Block, Probs, Rel, VisionTransformer
from .cpu import OneDnnLinear, has_hooks, linear


class FirstTokenBlock(Block):
    """A Block that, while ``first_only`` is set, gives (B, 1, D): its output for the first token alone."""

    first_only: bool = False

    def forward(self, x: Tensor, rel: Rel = None, explicit: bool = False, attention: Probs = None) -> Tensor:
        if not self.first_only:
            return super().forward(x, rel, explicit, attention)
        attn, h = self.attn, self.norm1(x)
        B, N, D = h.shape
        if type(attn.qkv) in (nn.Linear, OneDnnLinear) and not has_hooks(attn.qkv):
            w, b = attn.qkv.weight, attn.qkv.bias  # the query's rows of the weight, for the first token only
            q = linear(h[:, :1], w[:D], None if b is None else b[:D])
            k, v = linear(h, w[D:], None if b is None else b[D:]).reshape(B, N, 2, D).unbind(2)
        else:  # a wrapped or hooked projection (LoRA, packed, quantised): called as it is, the queries sliced
            q, k, v = attn.qkv(h).reshape(B, N, 3, D).unbind(2)
            q = q[:, :1]
        q = q.reshape(B, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
        k, v = (t.reshape(B, N, attn.num_heads, attn.head_dim).transpose(1, 2) for t in (k, v))
        out = attn.attend(q, k, v, attn.logit_bias(q, rel), explicit)  # (B, nh, 1, hd)
        x = x[:, :1] + self.drop_path1(attn.proj_drop(attn.proj(out.transpose(1, 2).reshape(B, 1, D))))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class FirstTokenViT(VisionTransformer):
    """A VisionTransformer whose forward() runs its last block (a FirstTokenBlock) for the first token alone."""

    def forward(self, x: Tensor, attn_impl: str | None = None) -> Tensor:
        last = cast(FirstTokenBlock, self.blocks[-1])
        last.first_only = True
        try:
            return super().forward(x, attn_impl)
        finally:
            last.first_only = False


def applies(model: object) -> bool:
    """Whether first_token_forward changes model: a VisionTransformer as built (or already patched) whose head reads
    the first token, without gradient checkpointing (whose recomputation runs after forward() has returned)."""
    if type(model) not in (VisionTransformer, FirstTokenViT):
        return False
    vit = cast(VisionTransformer, model)
    heads_first = vit.config.classifier in ("token", "first")
    return heads_first and not vit.config.grad_checkpointing and type(vit.blocks[-1]) in (Block, FirstTokenBlock)


def first_token_forward(model: VisionTransformer, always: bool = False) -> bool:
    """Patch model in place so that forward() runs its last block for the first token alone; whether it applied.
    ``always``: the last block gives the first token alone in every call, forward_features' too, for a copy only ever
    called through forward() (optimize_for_inference's): no state changes per call, which compiles simply."""
    if not applies(model):
        return False
    last = cast(FirstTokenBlock, model.blocks[-1])
    last.__class__ = FirstTokenBlock
    if always:
        last.first_only = True
    else:
        model.__class__ = FirstTokenViT
    return True
