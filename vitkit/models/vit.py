"""The Vision Transformer (Dosovitskiy et al., 2020), numerically faithful to the official vit_jax model.

    image (B, C, H, W) -> [ResNet stem] -> patch conv (k = s = P) -> (B, N, D) tokens
    -> [class token] + position embedding -> dropout -> depth x pre-norm block -> LayerNorm
    -> pool (class token, mean of patch tokens, attention pooling or first token) -> [pre-logits Dense + tanh] -> head

Defaults follow the official code (LayerNorm eps 1e-6, tanh GELU, its initialisation, a zero head); parameter names
follow timm's, so its state dicts map one to one. Position information as ablated in Table 8 is in posemb.py, what
the classifier reads of the tokens in heads.py. Speed for one kind of hardware is attached from outside (vitkit.accel).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..device import cpu_autocast_is_bf16
from ..errors import ConfigError, UserError
from . import posemb
from .common import DropPath, count_params, drop_path_rates, lecun_normal_, replace_config, zero_head
from .config import ATTN_IMPLS, ViTConfig
from .heads import MAPHead, pool_tokens
from .posemb import RelativePositions
from .resnet import ResNetBackbone

Probs = list[Tensor] | None  # where a written-out attention appends its probabilities
Rel = RelativePositions | None  # relative position attention's token layout

__all__ = ["Attention", "Block", "DropPath", "Mlp", "PatchEmbed", "VisionTransformer", "ViTConfig", "drop_path_rates"]


def attends_explicitly(attn_impl: str, x: Tensor) -> bool:
    """Whether attention runs written out rather than fused (SDPA) for this attn_impl and input x: "auto" writes it
    out where it computes in bf16 on a CPU, the faster path there (benchmarks/bench_vit.py)."""
    if attn_impl not in ATTN_IMPLS:
        raise ConfigError(f"attn_impl={attn_impl!r}: expected one of {ATTN_IMPLS}")
    if attn_impl != "auto":
        return attn_impl == "explicit"
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or cpu_autocast_is_bf16())


class Attention(nn.Module):
    """Multi-head self-attention: softmax(q k^T / sqrt(d) [+ relative logits]) v, q, k, v and out with biases. With
    ``rel_table`` (offset axes: posemb.relative_table_shape), ``rel_pos_embed`` holds a learned embedding per offset."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        rel_table: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_pos_embed: nn.Parameter | None = nn.Parameter(torch.zeros(*rel_table, dim)) if rel_table else None

    def forward(self, x: Tensor, rel: Rel = None, explicit: bool = False, attention: Probs = None) -> Tensor:
        """(B, N, D) -> (B, N, D). ``explicit``: the softmax written out, its probabilities (B, nh, N, N) appended to
        ``attention`` when given; else the fused kernel (SDPA), the same function."""
        B, N, D = x.shape
        # unbind along (B, N, 3, nh, hd) itself: backward then stacks the three gradients without a copy
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # 3 x (B, nh, N, hd)
        out = self.attend(q, k, v, self.logit_bias(q, rel), explicit, attention)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, D)))

    def logit_bias(self, q: Tensor, rel: Rel) -> Tensor | None:
        """What is added to the logits of queries q (B, nh, n, hd): the relative logits, or None."""
        if rel is None:
            return None
        if self.rel_pos_embed is None:
            raise RuntimeError("relative positions given to an attention layer without a relative table")
        return posemb.relative_logits(q * self.scale, self.rel_pos_embed, rel)  # scaled as the content logits are

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, explicit: bool, attention: Probs = None
    ) -> Tensor:
        """softmax(q k^T / sqrt(d) + bias) v: (B, nh, n, hd)."""
        if not explicit:
            dropout = self.attn_drop if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
        logits = (q * self.scale) @ k.transpose(-2, -1)  # (B, nh, n, N)
        probs = (logits if bias is None else logits + bias).softmax(dim=-1)
        if attention is not None:
            attention.append(probs)
        return (F.dropout(probs, self.attn_drop, self.training) if self.attn_drop else probs) @ v


class Mlp(nn.Module):
    """The transformer MLP: Dense -> GELU -> dropout -> Dense -> dropout (encoder blocks and the MAP head)."""

    def __init__(self, dim: int, hidden: int, gelu: str = "tanh", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if gelu == "tanh" else "none")
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))

    @torch.no_grad()
    def init_weights(self) -> None:
        """The official init: xavier_uniform kernels, biases N(0, 1e-6)."""
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)


class Block(nn.Module):
    """Pre-norm encoder block (eq. 2-3): x + MSA(LN(x)), then x + MLP(LN(x)), each branch with stochastic depth."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.drop_path1 = DropPath(drop_path)  # parameter-free: state dicts are the same with or without it
        self.drop_path2 = DropPath(drop_path)
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        rel_table = posemb.relative_table_shape(cfg.grid(), cfg.relative_dims) if cfg.relative_dims else None
        self.attn = Attention(cfg.width, cfg.num_heads, cfg.attn_dropout, cfg.dropout, rel_table)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = Mlp(cfg.width, cfg.mlp_dim, cfg.gelu, cfg.dropout)

    def forward(self, x: Tensor, rel: Rel = None, explicit: bool = False, attention: Probs = None) -> Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), rel, explicit, attention))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """Optional ResNet stem, then a conv with kernel = stride = patch size: (B, C, H, W) -> (B, N, D) tokens."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        in_chs = cfg.in_chans
        self.backbone = None
        if cfg.resnet_layers is not None:
            self.backbone = ResNetBackbone(cfg.resnet_layers, cfg.resnet_width, cfg.in_chans)
            in_chs = self.backbone.out_chs
        self.proj = nn.Conv2d(in_chs, cfg.width, cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        if self.backbone is not None:
            x = self.backbone(x)
        return self.project(x)

    def project(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Image or feature map (B, C, H, W) -> tokens (B, gh * gw, D) in raster order, and the grid (gh, gw)."""
        x = self.proj(x)  # (B, D, gh, gw); a remainder smaller than a patch is dropped ('VALID')
        return x.flatten(2).transpose(1, 2), (x.shape[-2], x.shape[-1])


class VisionTransformer(nn.Module):
    """ViT. Build with a ViTConfig and/or keyword overrides: ``VisionTransformer(width=192, depth=12, ...)``."""

    config: ViTConfig
    pos_embed_fixed: Tensor  # sincos_2d: the fixed (1, gh * gw, D) table, a non-persistent buffer

    def __init__(self, config: ViTConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        cfg = replace_config(config, overrides) if config is not None else ViTConfig(**overrides)
        self.config, D = cfg, cfg.width
        self.num_prefix_tokens = 1 if cfg.classifier == "token" else 0
        self.grid = cfg.grid()
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token: nn.Parameter | None = nn.Parameter(torch.zeros(1, 1, D)) if self.num_prefix_tokens else None
        # absolute tables: one per block for "every_layer" (table l added before block l, table 0 at the input),
        # else one; row 0 of a 1-D table is the class token's
        tables = cfg.depth if cfg.pos_embed_where == "every_layer" else 1
        self.pos_embed: nn.Parameter | None = None  # learned: (tables, prefix + gh * gw, D)
        self.pos_embed_x: nn.Parameter | None = None  # learned_2d: (tables, gw, D/2), the first half of D
        self.pos_embed_y: nn.Parameter | None = None  # learned_2d: (tables, gh, D/2), the second half
        if cfg.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(tables, self.num_prefix_tokens + self.grid[0] * self.grid[1], D))
        elif cfg.pos_embed == "learned_2d":
            self.pos_embed_x = nn.Parameter(torch.zeros(tables, self.grid[1], D // 2))
            self.pos_embed_y = nn.Parameter(torch.zeros(tables, self.grid[0], D // 2))
        elif cfg.pos_embed == "sincos_2d":
            self.register_buffer("pos_embed_fixed", posemb.sincos_2d(self.grid, D)[None], persistent=False)
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg, p) for p in drop_path_rates(cfg.drop_path, cfg.depth)])
        self.norm = nn.LayerNorm(D, eps=cfg.ln_eps)
        self.attn_pool: MAPHead | None = None  # reads the normalised tokens; its MLP has no dropout
        if cfg.classifier == "map":
            self.attn_pool = MAPHead(D, cfg.num_heads, Mlp(D, cfg.mlp_dim, cfg.gelu), ln_eps=cfg.ln_eps)
        self.num_features = cfg.representation_size or D
        self.pre_logits: nn.Linear | None = nn.Linear(D, cfg.representation_size) if cfg.representation_size else None
        self.head = zero_head(self.num_features, cfg.num_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The official initialisation (vit_jax)."""
        proj = self.patch_embed.proj
        assert proj.bias is not None  # built with a bias
        lecun_normal_(proj.weight)
        nn.init.zeros_(proj.bias)
        rel_tables = [blk.attn.rel_pos_embed for blk in self.typed_blocks()]
        for p in (self.pos_embed, self.pos_embed_x, self.pos_embed_y, *rel_tables):
            if p is not None:
                nn.init.normal_(p, std=0.02)  # as the official code initialises its position embedding
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        D = self.config.width
        for blk in self.typed_blocks():
            for i in range(3):  # q, k, v: xavier_uniform on each D x D kernel (Flax flattens (D, heads, hd))
                nn.init.xavier_uniform_(blk.attn.qkv.weight[i * D : (i + 1) * D])
            nn.init.zeros_(blk.attn.qkv.bias)
            nn.init.xavier_uniform_(blk.attn.proj.weight)
            nn.init.zeros_(blk.attn.proj.bias)
            blk.mlp.init_weights()
        if self.attn_pool is not None:
            self.attn_pool.init_weights()
            cast(Mlp, self.attn_pool.mlp).init_weights()
        if self.pre_logits is not None:
            lecun_normal_(self.pre_logits.weight)
            nn.init.zeros_(self.pre_logits.bias)

    def typed_blocks(self) -> list[Block]:
        """The encoder blocks, typed (``self.blocks`` is the ModuleList of Block that __init__ builds)."""
        return cast(list[Block], list(self.blocks))

    def _pos_embed_for(self, grid: tuple[int, int]) -> Tensor | None:
        """A grid's absolute table(s), resampled if not the model's: (tables, prefix + gh * gw, D); None without one."""
        if self.pos_embed is not None:
            if grid == self.grid:
                return self.pos_embed
            return posemb.resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix_tokens)
        if self.pos_embed_x is not None and self.pos_embed_y is not None:
            table = posemb.learned_2d(self.pos_embed_x, self.pos_embed_y, grid)
        elif self.config.pos_embed == "sincos_2d":
            table = self.pos_embed_fixed if grid == self.grid else posemb.sincos_2d(grid, self.config.width)[None]
            table = table.to(self.norm.weight.device)
        else:
            return None
        return F.pad(table, (0, 0, self.num_prefix_tokens, 0))  # the class token is learned: no position added

    def set_image_size(self, img_size: int | tuple[int, int], mode: str = "bilinear") -> None:
        """Change the model's resolution for good, resampling learned position embeddings (paper sec 3.2) and
        relative-position tables (stretched to the new offset range: see posemb.resample_relative)."""
        cfg = replace_config(self.config, {"img_size": img_size})
        grid = cfg.grid()
        if self.pos_embed is not None:
            table = posemb.resample_pos_embed(self.pos_embed.data, grid, self.grid, self.num_prefix_tokens, mode=mode)
            self.pos_embed = nn.Parameter(table)
        elif self.pos_embed_x is not None and self.pos_embed_y is not None:
            self.pos_embed_x = nn.Parameter(posemb.resample_1d(self.pos_embed_x.data, grid[1]))
            self.pos_embed_y = nn.Parameter(posemb.resample_1d(self.pos_embed_y.data, grid[0]))
        elif cfg.pos_embed == "sincos_2d":
            self.pos_embed_fixed = posemb.sincos_2d(grid, cfg.width)[None].to(self.norm.weight.device)
        for blk in self.typed_blocks():
            offsets = blk.attn.rel_pos_embed
            if offsets is not None:
                shape = posemb.relative_table_shape(grid, cfg.relative_dims)
                blk.attn.rel_pos_embed = nn.Parameter(posemb.resample_relative(offsets.data, shape, self.grid, grid))
        self.config, self.grid = cfg, grid

    def embed(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> input tokens (B, N, D): patches, class token, position embedding, dropout."""
        return self.embed_tokens(*self.patch_embed(x))

    def embed_tokens(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """Patch tokens (B, gh * gw, D) -> input tokens (B, N, D): class token, position embedding, dropout. The
        tokens are cast to the parameters' dtype, so that under autocast the residual stream stays in it."""
        x = x.to(self.patch_embed.proj.weight.dtype)
        if grid != self.grid and not self.config.dynamic_img_size:
            raise UserError(
                f"input gives a {grid[0]}x{grid[1]} token grid but the model was built for {self.grid[0]}x"
                f"{self.grid[1]} (img_size={self.config.img_size}): call model.set_image_size(...) or build it "
                "with dynamic_img_size=True"
            )
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self._pos_embed_for(grid)
        return self.pos_drop(x if pos is None else x + pos[:1])  # (1, N, D): the table of block 0

    def encode(
        self,
        x: Tensor,
        attn_impl: str | None = None,
        *,
        grid: tuple[int, int] | None = None,
        blocks: Probs = None,
        attention: Probs = None,
    ) -> Tensor:
        """Input tokens (B, N, D) through every block and the final LayerNorm: the one block loop.

        ``attn_impl``: "sdpa", "explicit" or "auto" for this call (default: the config's). ``grid``: the tokens'
        grid (default: the model's), which per-layer tables and relative positions read. ``blocks`` and ``attention``,
        when given, receive each block's output and its attention probabilities (B, nh, N, N; written out)."""
        explicit = attention is not None or attends_explicitly(attn_impl or self.config.attn_impl, x)
        grid = grid or self.grid
        dims, prefix = self.config.relative_dims, self.num_prefix_tokens
        rel = posemb.relative_positions(grid, self.grid, dims, prefix, x.device) if dims else None
        layer_pos = self._pos_embed_for(grid) if self.config.pos_embed_where != "input" else None
        if (rel is not None or layer_pos is not None) and x.shape[1] != prefix + grid[0] * grid[1]:
            raise UserError(
                f"encode: {x.shape[1]} tokens are not {prefix} + a {grid[0]}x{grid[1]} grid of patches; pass the "
                "tokens' grid=(gh, gw)"
            )
        # recompute in backward only where a backward pass will follow; the RNG state is restored for the masks
        ckpt = self.config.grad_checkpointing and self.training and torch.is_grad_enabled()
        for i, blk in enumerate(self.blocks):
            if i and layer_pos is not None:  # block 0's table was added at the input, before the dropout
                x = x + layer_pos[i if len(layer_pos) > 1 else 0]
            probs: Probs = None if attention is None else []
            if ckpt:
                x = checkpoint(blk, x, rel, explicit, probs, use_reentrant=False, preserve_rng_state=True)
            else:
                x = blk(x, rel, explicit, probs)
            if attention is not None and probs:
                attention.append(probs[0])  # the forward's (a recomputation in backward appends again)
            if blocks is not None:
                blocks.append(x)
        return self.norm(x)

    def forward_features(self, x: Tensor, attn_impl: str | None = None) -> Tensor:
        """Images -> the final normalised token sequence (B, N, D) (the official 'encoded')."""
        patches, grid = self.patch_embed(x)
        return self.encode(self.embed_tokens(patches, grid), attn_impl, grid=grid)

    def pool(self, x: Tensor) -> Tensor:
        """(B, N, D) -> (B, D): the class token or first token, the mean of the patch tokens, or the MAP head."""
        return pool_tokens(x, self.config.classifier, self.num_prefix_tokens, self.attn_pool)

    def _represent(self, pooled: Tensor) -> Tensor:
        """Pooled (B, D) -> the representation the head reads: pre-logits Dense + tanh, if the model has one."""
        return pooled if self.pre_logits is None else torch.tanh(self.pre_logits(pooled))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Encoded tokens (B, N, D) -> logits (B, K), or the representation before the head if pre_logits."""
        x = self._represent(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor, attn_impl: str | None = None) -> Tensor:
        """Images (B, C, H, W) -> logits (B, K)."""
        return self.forward_head(self.forward_features(x, attn_impl))

    def forward_intermediates(
        self, x: Tensor, return_attention: bool = False, attn_impl: str | None = None
    ) -> dict[str, Any]:
        """Run the model once and return every stage's output: ``stem`` (hybrids: the ResNet feature map),
        ``patches`` (B, D, gh, gw), ``tokens`` (input to the first block), ``blocks`` (list of (B, N, D)),
        ``attention`` (with return_attention: list of (B, nh, N, N), written out), ``encoded``, ``pooled``,
        ``pre_logits``, ``logits``; a MAP-head model with return_attention also gives ``map_attention`` (B, nh, 1,
        N), the probe's attention over the encoded tokens."""
        out: dict[str, Any] = {"blocks": []}
        if self.patch_embed.backbone is not None:
            out["stem"] = x = self.patch_embed.backbone(x)
        patches, grid = self.patch_embed.project(x)
        out["patches"] = patches.transpose(1, 2).reshape(patches.shape[0], -1, *grid)  # (B, D, gh, gw)
        out["tokens"] = x = self.embed_tokens(patches, grid)
        if return_attention:
            out["attention"] = []
        out["encoded"] = encoded = self.encode(
            x, attn_impl, grid=grid, blocks=out["blocks"], attention=out.get("attention")
        )
        if self.attn_pool is not None and (return_attention or (attn_impl or self.config.attn_impl) == "explicit"):
            out["pooled"], probs = self.attn_pool(encoded, explicit=True)
            if return_attention:
                out["map_attention"] = probs
        else:
            out["pooled"] = self.pool(encoded)
        out["pre_logits"] = feats = self._represent(out["pooled"])
        out["logits"] = self.head(feats)
        return out

    def reset_classifier(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """A fresh zero-initialised head for num_classes; drops the pre-logits layer (paper's fine-tuning)."""
        if not keep_pre_logits and self.pre_logits is not None:
            self.pre_logits = None
            self.num_features = self.config.width
            self.config = replace_config(self.config, {"representation_size": None})
        self.config = replace_config(self.config, {"num_classes": num_classes})
        self.head = zero_head(self.num_features, num_classes).to(self.norm.weight.device, self.norm.weight.dtype)

    def no_weight_decay(self) -> set[str]:
        """Parameters that are embeddings rather than weights; optimizers also skip biases and norms."""
        names = {n for n in ("cls_token", "pos_embed", "pos_embed_x", "pos_embed_y") if getattr(self, n) is not None}
        if self.attn_pool is not None:  # the MAP head's probe is a learned token, as the class token is
            names.add("attn_pool.latent")
        blocks = self.typed_blocks()
        return names | {
            f"blocks.{i}.attn.rel_pos_embed" for i, b in enumerate(blocks) if b.attn.rel_pos_embed is not None
        }

    def num_params(self, trainable_only: bool = False) -> int:
        return count_params(self, trainable_only)
