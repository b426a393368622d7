"""What the ViT's classifier reads of the encoded tokens (B, N, D) (``ViTConfig.classifier``):

- "token": the class token (vit_jax, big_vision's pool_type 'tok');
- "gap": the mean of the patch tokens (big_vision's 'gap');
- "map": multi-head attention pooling (big_vision's MAPHead): a learned probe attends to the tokens;
- "first": the first token of a model without a class token (big_vision's pool_type '0').

Then, optionally, the pretraining head's pre-logits Dense + tanh, and the zero-initialised classifier Dense
(common.zero_head); the ViT holds those, so their state-dict names stay ``pre_logits`` and ``head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSIFIERS = ("token", "gap", "map", "first")
FIRST_TOKEN = ("token", "first")  # the poolings that read the first token alone


class MAPHead(nn.Module):
    """Multi-head attention pooling, as big_vision's MAPHead: a learned probe token attends to the encoded tokens
    (B, N, D), then x + MLP(LN(x)); the probe's output (B, D) is the pooled representation. q, k, v and out have biases;
    the head count, LayerNorm and ``mlp`` (the encoder's, without dropout, built by the caller) are the model's.
    Parameter names follow timm's AttentionPoolLatent, so its state dicts map one to one."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, *, ln_eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))  # big_vision's probe
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)  # keys, then values
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=ln_eps)
        self.mlp = mlp  # fc1, GELU, fc2

    @torch.no_grad()
    def init_weights(self) -> None:
        """As big_vision's MAPHead: xavier_uniform kernels and probe, zero biases (the MLP is the caller's to init)."""
        D = self.latent.shape[-1]
        bound = (6.0 / (1 + D)) ** 0.5  # Flax's xavier_uniform of a (1, 1, D) probe: fan_in 1, fan_out D
        nn.init.uniform_(self.latent, -bound, bound)
        nn.init.xavier_uniform_(self.q.weight)
        for i in range(2):
            nn.init.xavier_uniform_(self.kv.weight[i * D : (i + 1) * D])
        nn.init.xavier_uniform_(self.proj.weight)
        for lin in (self.q, self.kv, self.proj):
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, explicit: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoded tokens (B, N, D) -> (pooled (B, D), the probe's attention probabilities (B, nh, 1, N) when
        explicit, else None)."""
        B, N, D = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, N, hd)
        probs = None
        if explicit:
            probs = ((q * self.head_dim**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, nh, 1, N)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        y = self.proj(y.transpose(1, 2).reshape(B, 1, D))  # (B, 1, D)
        y = y + self.mlp(self.norm(y))
        return y[:, 0], probs


def pool_tokens(
    x: torch.Tensor, classifier: str, num_prefix_tokens: int, attn_pool: MAPHead | None = None
) -> torch.Tensor:
    """Encoded tokens (B, N, D) -> (B, D): the class token or first token, the MAP head's output, or the mean of
    the patch tokens (the tokens after the ``num_prefix_tokens`` class token)."""
    if classifier in FIRST_TOKEN:
        return x[:, 0]
    if classifier == "map":
        if attn_pool is None:
            raise RuntimeError("classifier='map' without a MAP head")
        return attn_pool(x)[0]
    return x[:, num_prefix_tokens:].mean(dim=1)
