"""The Vision Transformer (Dosovitskiy et al., 2020), numerically faithful to the official vit_jax model.

    image (B, C, H, W) -> [ResNet stem] -> patch conv (k = s = P) -> (B, N, D) tokens
    -> [class token] + position embedding -> dropout -> depth x pre-norm block -> LayerNorm
    -> pool (class token, mean of patch tokens, attention pooling or first token) -> [pre-logits Dense + tanh] -> head

Pooling (``classifier``): the class token ("token", vit_jax and big_vision's pool_type 'tok'), the mean of the
patch tokens ("gap"), big_vision's multi-head attention pooling ("map": a learned probe attends to the encoded
tokens, see heads.MAPHead) or the first token of a model without a class token ("first": big_vision's pool_type '0').

Defaults follow the official code: LayerNorm eps 1e-6, tanh-approximated GELU, the official initialisation,
a zero-initialised head. Parameter names follow timm's VisionTransformer, so its state dicts map one to one.

Position information, as ablated in the paper's Table 8 (appendix D.4): an absolute table (learned 1-D, learned
2-D, fixed sin-cos) added to the tokens at the input, or before every block (``pos_embed_where``: one table per
block, ``pos_embed`` of shape (depth, N, D), or one table shared by all blocks); none; or relative position
attention (``pos_embed="relative"`` / ``"relative_2d"``), where no table is added to the tokens and each block's
queries also attend to learned embeddings of the offset between patches, as a bias on the attention logits.

The pieces live beside this file: attention.py (self-attention, fused and explicit, with relative positions),
heads.py (what the classifier reads of the tokens), posemb.py (position tables and their resampling).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError, UserError
from .attention import ATTN_IMPLS, Attention, RelativePositions, attends_explicitly
from .common import (
    Mlp,
    as_pair,
    check_num_classes,
    check_positive,
    count_params,
    lecun_normal_,
    replace_config,
    zero_head,
)
from .heads import CLASSIFIERS, FIRST_TOKEN, MAPHead, pool_tokens
from .linear import has_hooks
from .merge import merge_tokens
from .posemb import (
    relative_index,
    relative_table_shape,
    resample_1d,
    resample_pos_embed,
    resample_relative,
    sincos_2d,
)
from .resnet import ResNetBackbone, stem_reduction

if TYPE_CHECKING:
    Size = tuple[int, int]  # what a built config holds: __post_init__ makes every size a (height, width) pair
else:
    Size = int | tuple[int, int]  # what it accepts, as the typed key=value parser reads it (get_type_hints)

POS_EMBEDS = ("learned", "learned_2d", "sincos_2d", "relative", "relative_2d", "none")
POS_EMBED_WHERE = ("input", "every_layer", "every_layer_shared")
RELATIVE_DIMS = {"relative": 1, "relative_2d": 2}  # offsets in raster order (the paper's), or (row, column)
GELUS = ("tanh", "exact")


@dataclass(frozen=True)
class ViTConfig:
    """Everything needed to rebuild a VisionTransformer; a value (change it with ``dataclasses.replace``).

    Serialisable with ``to_dict`` / ``ViTConfig(**d)``; every field is checked here, where the config is built.
    """

    img_size: Size = (224, 224)  # input size in pixels, (height, width); an int n is (n, n)
    patch_size: Size = (16, 16)  # pixels per patch side (hybrids: feature-map cells)
    in_chans: int = 3  # input channels
    num_classes: int = 1000  # 0: no head (forward gives the representation)
    width: int = 768  # token width D
    depth: int = 12  # encoder blocks L
    num_heads: int = 12  # attention heads per block
    mlp_dim: int = 3072  # hidden width of each block's MLP
    classifier: str = "token"  # "token": class token; "gap": mean of the patch tokens; "map": attention pooling;
    # "first": the first token without a class token (big_vision pool_type '0')
    representation_size: int | None = None  # pre-logits Dense + tanh (pretraining head); None or 0: none
    dropout: float = 0.0  # dropout after the position embedding, attention output and MLP layers
    attn_dropout: float = 0.0  # dropout on the attention probabilities
    drop_path: float = 0.0  # stochastic depth rate of the last block, linear from 0 at the first; training only
    # (block i drops each sample's attention and MLP branches with rate drop_path * i / (depth - 1))
    grad_checkpointing: bool = False  # checkpoint each block: trades compute for memory in training; no effect in eval
    # (each block's activations are recomputed in the backward pass, with the same dropout and drop-path masks)
    ln_eps: float = 1e-6  # LayerNorm epsilon (official 1e-6; Hugging Face 1e-12)
    gelu: str = "tanh"  # "tanh" (official, Flax) or "exact" (erf: torch, timm, HF)
    pos_embed: str = "learned"  # "learned" (1-D), "learned_2d", "sincos_2d", "relative", "relative_2d", "none"
    pos_embed_where: str = "input"  # absolute tables: "input", "every_layer" (own per block), "every_layer_shared"
    resnet_layers: tuple[int, ...] | None = None  # hybrid stem: None = no stem, () = root only
    resnet_width: float = 1  # hybrid stem width factor (64 x it channels at the root)
    attn_impl: str = "auto"  # attention path: "sdpa" (fused), "explicit", "auto" (explicit in bf16 on a CPU, else sdpa)
    dynamic_img_size: bool = False  # accept other input sizes by resampling position embeddings per call
    token_merge: int = 0  # token merging (ToMe): pairs of tokens merged in each block of forward(); 0: off
    # a trade of accuracy for speed (vitkit.models.merge); class-token and 'first' models, positions at the input
    arch: str = field(default="vit", init=False)

    def __post_init__(self) -> None:
        # normalise spellings once, here (lists from JSON/YAML, ints for square sizes); the config stays a value
        normal: dict[str, Any] = dict(img_size=as_pair("ViTConfig", "img_size", self.img_size))
        normal["patch_size"] = as_pair("ViTConfig", "patch_size", self.patch_size)
        if self.resnet_layers is not None:
            normal["resnet_layers"] = tuple(self.resnet_layers)
        if self.representation_size == 0:
            normal["representation_size"] = None
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        check_positive("ViTConfig", img_size=self.img_size, patch_size=self.patch_size, in_chans=self.in_chans)
        check_positive("ViTConfig", width=self.width, depth=self.depth, num_heads=self.num_heads)
        check_positive("ViTConfig", mlp_dim=self.mlp_dim)
        if self.representation_size is not None:
            check_positive("ViTConfig", representation_size=self.representation_size)
        if self.resnet_layers:
            check_positive("ViTConfig", resnet_layers=self.resnet_layers)
        check_num_classes("ViTConfig", self.num_classes)
        for name, value, allowed in (
            ("classifier", self.classifier, CLASSIFIERS),
            ("pos_embed", self.pos_embed, POS_EMBEDS),
            ("pos_embed_where", self.pos_embed_where, POS_EMBED_WHERE),
            ("gelu", self.gelu, GELUS),
            ("attn_impl", self.attn_impl, ATTN_IMPLS),
        ):
            if value not in allowed:
                raise ConfigError(f"ViTConfig.{name}={value!r}: expected one of {allowed}")
        for name in ("dropout", "attn_dropout", "drop_path"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"ViTConfig.{name}={rate!r}: expected a rate in [0, 1)")
        if not self.ln_eps > 0:
            raise ConfigError(f"ViTConfig.ln_eps={self.ln_eps!r}: expected a positive number")
        if not self.resnet_width > 0:
            raise ConfigError(f"ViTConfig.resnet_width={self.resnet_width!r}: expected a positive number")
        if self.width % self.num_heads:
            raise ConfigError(f"ViTConfig: width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.pos_embed == "learned_2d" and self.width % 2:
            raise ConfigError(f"ViTConfig: learned_2d position embeddings need an even width, got {self.width}")
        if self.pos_embed == "sincos_2d" and self.width % 4:
            raise ConfigError(f"ViTConfig: sincos_2d position embeddings need a width divisible by 4, got {self.width}")
        if self.pos_embed_where != "input" and self.pos_embed not in ("learned", "learned_2d", "sincos_2d"):
            raise ConfigError(
                f"ViTConfig.pos_embed_where={self.pos_embed_where!r}: pos_embed={self.pos_embed!r} adds no table to "
                "the tokens (relative positions already act in every block's attention); use 'input'"
            )
        if self.token_merge < 0:
            raise ConfigError(f"ViTConfig.token_merge={self.token_merge!r}: expected tokens per block, >= 0")
        if self.token_merge and (
            self.classifier not in FIRST_TOKEN or self.relative_dims or self.pos_embed_where != "input"
        ):
            raise ConfigError(
                f"ViTConfig.token_merge={self.token_merge}: token merging needs a head that reads the first token "
                f"(classifier 'token' or 'first', not {self.classifier!r}) and positions added at the input only "
                f"(not pos_embed={self.pos_embed!r}, pos_embed_where={self.pos_embed_where!r}): merged tokens have "
                "no place on the grid"
            )
        if self.pos_embed == "sincos_2d" and self.pos_embed_where == "every_layer":
            raise ConfigError(
                "ViTConfig.pos_embed_where='every_layer': the sincos_2d table is fixed, so each block's own table "
                "would be the same one; use 'every_layer_shared'"
            )
        features = self._feature_size()
        if features[0] < self.patch_size[0] or features[1] < self.patch_size[1]:
            raise ConfigError(
                f"ViTConfig: img_size {self.img_size} gives fewer pixels than one {self.patch_size} patch"
                + ("" if self.resnet_layers is None else f" after the ResNet stem (a {features} feature map)")
            )
        if features[0] % self.patch_size[0] or features[1] % self.patch_size[1]:
            warnings.warn(
                f"ViTConfig: img_size {self.img_size} is not a multiple of the {self.stride} pixels per token; "
                "the border that does not fill a patch is dropped",
                stacklevel=4,
            )

    def _feature_size(self) -> tuple[int, int]:
        """What the patch conv sees: the image, or the stem's feature map ('SAME' padding rounds up)."""
        h, w = self.img_size
        if self.resnet_layers is not None:
            r = stem_reduction(self.resnet_layers)
            h, w = -(-h // r), -(-w // r)
        return h, w

    @property
    def relative_dims(self) -> int:
        """Offsets of relative position attention: 1 (raster order, the paper's), 2 (row, column); 0: none."""
        return RELATIVE_DIMS.get(self.pos_embed, 0)

    @property
    def stride(self) -> tuple[int, int]:
        """Input pixels per token along each axis (stem reduction x patch size)."""
        r = 1 if self.resnet_layers is None else stem_reduction(self.resnet_layers)
        return (r * self.patch_size[0], r * self.patch_size[1])

    def grid(self, img_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The token grid for an image size; the stem uses 'SAME' padding (ceil), the patch conv 'VALID'."""
        h, w = img_size or self.img_size
        if self.resnet_layers is not None:
            r = self.stride[0] // self.patch_size[0]
            h, w = -(-h // r), -(-w // r)  # each strided layer rounds up
        return (h // self.patch_size[0], w // self.patch_size[1])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic depth per block: 0 for the first, ``rate`` for the last, linear between (timm, DeiT, AugReg)."""
    if depth == 1:
        return [rate]
    return [rate * i / (depth - 1) for i in range(depth)]


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Zero whole samples of a residual branch x (B, ...) with probability p, scaling the kept ones by 1/(1-p) so
    the expectation is unchanged; identity in eval or at p = 0 (so eval outputs never depend on p)."""
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016) on a residual branch: see drop_path."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p:g}"


class Block(nn.Module):
    """Pre-norm encoder block: x + DropPath(MSA(LN(x))), then x + DropPath(MLP(LN(x))); the two branches are
    dropped independently, as timm's blocks do."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        # parameter-free: state dicts are the same with or without stochastic depth
        self.drop_path1 = DropPath(drop_path)
        self.drop_path2 = DropPath(drop_path)
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        rel_table = relative_table_shape(cfg.grid(), cfg.relative_dims) if cfg.relative_dims else None
        self.attn = Attention(cfg.width, cfg.num_heads, cfg.attn_dropout, cfg.dropout, rel_table)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = Mlp(cfg.width, cfg.mlp_dim, cfg.gelu, cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        out_tokens: int | None = None,
        rel: RelativePositions | None = None,
        explicit: bool = False,
    ) -> torch.Tensor:
        """out_tokens: forward(x)[:, :out_tokens] without computing the other tokens' outputs (every step but
        attention is per token, and attention still reads keys and values of all tokens). rel: the token layout,
        for relative position attention. explicit: attention written out rather than SDPA (Attention.forward)."""
        y = self.attn(self.norm1(x), out_tokens, rel, explicit)
        x = (x if out_tokens is None else x[:, :out_tokens]) + self.drop_path1(y)
        return x + self.drop_path2(self.mlp(self.norm2(x)))

    def forward_merging(
        self,
        x: torch.Tensor,
        sizes: torch.Tensor | None,
        r: int,
        out_tokens: int | None = None,
        explicit: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block with token merging (ToMe): attention weighted by token sizes, then r pairs of tokens merged
        (vitkit.models.merge) before the MLP; the first token is never merged. Returns the tokens and their sizes.
        With out_tokens only those tokens go on, and nothing is merged. encode calls it directly, as it does
        forward_explicit: the block's own forward hooks do not run (its attention's and MLP's do)."""
        keys: list[torch.Tensor] = []
        y = self.attn(self.norm1(x), out_tokens, None, explicit, sizes=sizes, keys=keys)
        if out_tokens is None:
            x, sizes = merge_tokens(x + self.drop_path1(y), sizes, keys[0], r, protected=1)
        else:
            x, sizes = x[:, :out_tokens] + self.drop_path1(y), None
        return x + self.drop_path2(self.mlp(self.norm2(x))), sizes

    def forward_explicit(
        self, x: torch.Tensor, rel: RelativePositions | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, probs = self.attn.forward_explicit(self.norm1(x), rel)
        x = x + self.drop_path1(y)
        return x + self.drop_path2(self.mlp(self.norm2(x))), probs


class PatchEmbed(nn.Module):
    """Optional ResNet stem, then a conv with kernel = stride = patch size: (B, C, H, W) -> (B, N, D) tokens.

    On images the conv kernel is used: it keeps the input for backward without a copy (less memory, faster
    training). On a hybrid's feature map (hundreds of channels, large values) the same map is computed as the
    matmul it is, whose summation is more accurate than CPU conv kernels: 1.1e-5 vs 2.4e-5 from the official
    outputs on 8x8 patches of 64 channels, where the official output's own float32 rounding is 1.05e-5; but the
    conv's call where it has hooks of its own, which the matmul would not run.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        in_chs = cfg.in_chans
        self.backbone = None
        if cfg.resnet_layers is not None:
            self.backbone = ResNetBackbone(cfg.resnet_layers, cfg.resnet_width, cfg.in_chans)
            in_chs = self.backbone.out_chs
        self.proj = nn.Conv2d(in_chs, cfg.width, cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        if self.backbone is not None:
            x = self.backbone(x)
        return self.project(x)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Image or feature map (B, C, H, W) -> tokens (B, gh * gw, D) in raster order, and the grid (gh, gw)."""
        if self.backbone is None or has_hooks(self.proj):
            x = self.proj(x)  # (B, D, gh, gw); a remainder smaller than a patch is dropped
            return x.flatten(2).transpose(1, 2), (x.shape[-2], x.shape[-1])
        B, C, H, W = x.shape
        ph, pw = self.proj.kernel_size
        gh, gw = H // ph, W // pw
        x = x[:, :, : gh * ph, : gw * pw]  # 'VALID': a remainder smaller than a patch is dropped
        x = x.reshape(B, C, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * ph * pw)
        return F.linear(x, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias), (gh, gw)


class VisionTransformer(nn.Module):
    """ViT. Build with a ViTConfig and/or keyword overrides: ``VisionTransformer(width=192, depth=12, ...)``."""

    config: ViTConfig
    pos_embed_fixed: torch.Tensor  # sincos_2d: the fixed (1, gh * gw, D) table, a non-persistent buffer

    def __init__(self, config: ViTConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        cfg = replace_config(config, overrides) if config is not None else ViTConfig(**overrides)
        self.config = cfg
        D = cfg.width
        self.num_prefix_tokens = 1 if cfg.classifier == "token" else 0
        self.grid = cfg.grid()

        self.patch_embed = PatchEmbed(cfg)
        self.cls_token: nn.Parameter | None = nn.Parameter(torch.zeros(1, 1, D)) if self.num_prefix_tokens else None
        # absolute tables: one per block for "every_layer" (table l is added before block l, table 0 at the input),
        # else one (at the input, and for "every_layer_shared" before every block too); row 0 of a 1-D table is
        # the class token's
        tables = cfg.depth if cfg.pos_embed_where == "every_layer" else 1
        self.pos_embed: nn.Parameter | None = None  # learned: (tables, prefix + gh * gw, D)
        self.pos_embed_x: nn.Parameter | None = None  # learned_2d: (tables, gw, D/2), the first half of D
        self.pos_embed_y: nn.Parameter | None = None  # learned_2d: (tables, gh, D/2), the second half
        if cfg.pos_embed == "learned":
            T = self.num_prefix_tokens + self.grid[0] * self.grid[1]
            self.pos_embed = nn.Parameter(torch.zeros(tables, T, D))
        elif cfg.pos_embed == "learned_2d":
            self.pos_embed_x = nn.Parameter(torch.zeros(tables, self.grid[1], D // 2))
            self.pos_embed_y = nn.Parameter(torch.zeros(tables, self.grid[0], D // 2))
        elif cfg.pos_embed == "sincos_2d":
            self.register_buffer("pos_embed_fixed", sincos_2d(self.grid, D)[None], persistent=False)
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg, p) for p in drop_path_rates(cfg.drop_path, cfg.depth)])
        self.norm = nn.LayerNorm(D, eps=cfg.ln_eps)
        self.attn_pool: MAPHead | None = None  # reads the normalised tokens
        if cfg.classifier == "map":
            self.attn_pool = MAPHead(D, cfg.num_heads, cfg.mlp_dim, gelu=cfg.gelu, ln_eps=cfg.ln_eps)
        self.num_features = cfg.representation_size or D
        self.pre_logits: nn.Linear | None = nn.Linear(D, cfg.representation_size) if cfg.representation_size else None
        self.head = zero_head(self.num_features, cfg.num_classes)
        self.init_weights()

    # ----------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self) -> None:
        """The official initialisation (vit_jax): see the module docstring of each piece."""
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
            # q, k, v: xavier_uniform on each D x D kernel (Flax flattens (D, heads, hd)); zero biases
            for i in range(3):
                nn.init.xavier_uniform_(blk.attn.qkv.weight[i * D : (i + 1) * D])
            nn.init.zeros_(blk.attn.qkv.bias)
            nn.init.xavier_uniform_(blk.attn.proj.weight)
            nn.init.zeros_(blk.attn.proj.bias)
            for fc in (blk.mlp.fc1, blk.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                nn.init.normal_(fc.bias, std=1e-6)
        if self.attn_pool is not None:
            self.attn_pool.init_weights()
        if self.pre_logits is not None:
            lecun_normal_(self.pre_logits.weight)
            nn.init.zeros_(self.pre_logits.bias)

    def typed_blocks(self) -> list[Block]:
        """The encoder blocks, typed (``self.blocks`` is the ModuleList of Block that __init__ builds)."""
        return cast(list[Block], list(self.blocks))

    # ---------------------------------------------------------------------------------- position embedding
    def _pos_embed_for(self, grid: tuple[int, int]) -> torch.Tensor | None:
        """The absolute table(s) to add for a token grid (resampled if the grid differs): (tables, prefix + gh * gw,
        D), where tables is the depth for pos_embed_where="every_layer", else 1. None: no absolute table."""
        cfg = self.config
        if self.pos_embed is not None:
            if grid == self.grid:
                return self.pos_embed
            return resample_pos_embed(self.pos_embed, grid, self.grid, self.num_prefix_tokens)
        if self.pos_embed_x is not None and self.pos_embed_y is not None:
            x = resample_1d(self.pos_embed_x, grid[1])  # (tables, gw, D/2)
            y = resample_1d(self.pos_embed_y, grid[0])  # (tables, gh, D/2)
            table = torch.cat(
                [x[:, None, :, :].expand(-1, grid[0], -1, -1), y[:, :, None, :].expand(-1, -1, grid[1], -1)], dim=-1
            ).flatten(1, 2)
        elif cfg.pos_embed == "sincos_2d":
            table = self.pos_embed_fixed if grid == self.grid else sincos_2d(grid, cfg.width)[None]
            table = table.to(self.norm.weight.device)
        else:
            return None
        if self.num_prefix_tokens:  # the class token is itself learned: no position added to it
            table = F.pad(table, (0, 0, self.num_prefix_tokens, 0))
        return table

    def set_image_size(self, img_size: int | tuple[int, int], mode: str = "bilinear") -> None:
        """Change the model's resolution for good, resampling learned position embeddings (paper sec 3.2) and
        relative-position tables (stretched to the new offset range: see posemb.resample_relative)."""
        cfg = self.config
        new_cfg = replace_config(cfg, {"img_size": img_size})
        grid = new_cfg.grid()
        if self.pos_embed is not None:
            self.pos_embed = nn.Parameter(
                resample_pos_embed(self.pos_embed.data, grid, self.grid, self.num_prefix_tokens, mode=mode)
            )
        elif self.pos_embed_x is not None and self.pos_embed_y is not None:
            self.pos_embed_x = nn.Parameter(resample_1d(self.pos_embed_x.data, grid[1]))
            self.pos_embed_y = nn.Parameter(resample_1d(self.pos_embed_y.data, grid[0]))
        elif cfg.pos_embed == "sincos_2d":
            self.pos_embed_fixed = sincos_2d(grid, cfg.width)[None].to(self.norm.weight.device)
        elif cfg.relative_dims:
            shape = relative_table_shape(grid, cfg.relative_dims)
            for blk in self.typed_blocks():
                table = blk.attn.rel_pos_embed
                if table is not None:
                    blk.attn.rel_pos_embed = nn.Parameter(resample_relative(table.data, shape, self.grid, grid))
        self.config, self.grid = new_cfg, grid

    def _relative_positions(self, grid: tuple[int, int], device: torch.device) -> RelativePositions | None:
        """The layout every block's relative position attention reads for this grid; None for other models."""
        dims = self.config.relative_dims
        if not dims:
            return None
        index = relative_index(grid, dims, device)
        return RelativePositions(index, relative_table_shape(grid, dims), grid, self.grid, self.num_prefix_tokens)

    # ------------------------------------------------------------------------------------------- forward
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> input tokens (B, N, D): patches, class token, position embedding, dropout."""
        return self.embed_tokens(*self.patch_embed(x))

    def embed_tokens(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch tokens (B, gh * gw, D) -> input tokens (B, N, D): class token, position embedding (the input's
        table), dropout. The tokens are in the parameters' dtype: under autocast the patch embedding gives bf16 (or
        fp16), and the residual stream would stay in it where nothing of the parameters' dtype is added (relative
        positions or none, with a GAP or MAP head), every block and LayerNorm then in bf16 (in a test model the final
        norm's bias gradient 16-84% off float64's with a MAP or GAP head, against 0.8% with a learned table)."""
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
        if pos is not None:
            x = x + pos[:1]  # (1, N, D): the table of block 0
        return self.pos_drop(x)

    def encode(
        self,
        x: torch.Tensor,
        attn_impl: str | None = None,
        out_tokens: int | None = None,
        blocks: list[torch.Tensor] | None = None,
        attention: list[torch.Tensor] | None = None,
        grid: tuple[int, int] | None = None,
        merge: bool = False,
    ) -> torch.Tensor:
        """Input tokens (B, N, D) through every block and the final LayerNorm: the one block loop.

        ``attn_impl``: "sdpa", "explicit" or "auto" (attention.attends_explicitly) for this call (default: the
        config's). ``out_tokens``: the last block computes only the first out_tokens tokens (its keys and values
        still come from all). ``blocks`` and ``attention``, when given, receive each block's output and (explicit
        path) its attention probabilities (B, nh, N, N); asking for attention selects the explicit path. ``grid``:
        the token grid (default: the model's), which position embeddings added before every block and relative
        positions need. ``merge``: token merging as the config sets it (``token_merge`` tokens a block; not with
        ``attention``).
        """
        attn_impl = attn_impl or self.config.attn_impl
        if attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"attn_impl={attn_impl!r}: expected one of {ATTN_IMPLS}")
        explicit = attends_explicitly(attn_impl, x)
        grid = grid or self.grid
        rel = self._relative_positions(grid, x.device)
        layer_pos = self._pos_embed_for(grid) if self.config.pos_embed_where != "input" else None  # (tables, N, D)
        if (rel is not None or layer_pos is not None) and x.shape[1] != self.num_prefix_tokens + grid[0] * grid[1]:
            raise UserError(
                f"encode: {x.shape[1]} tokens are not {self.num_prefix_tokens} + a {grid[0]}x{grid[1]} grid of "
                "patches; pass the tokens' grid=(gh, gw)"
            )
        last = len(self.blocks) - 1
        # only when a backward pass will follow: recomputation needs the graph, and eval keeps nothing to save
        ckpt = self.config.grad_checkpointing and self.training and torch.is_grad_enabled()
        r = self.config.token_merge if merge and attention is None else 0
        sizes: torch.Tensor | None = None  # with token merging: how many patches each token stands for
        for i, blk in enumerate(self.typed_blocks()):
            if i and layer_pos is not None:  # block 0's table was added at the input, before the dropout
                x = x + layer_pos[i if len(layer_pos) > 1 else 0]
            if r:
                args = (x, sizes, r, out_tokens if i == last else None, explicit)
                if ckpt:
                    x, sizes = checkpoint(blk.forward_merging, *args, use_reentrant=False, preserve_rng_state=True)
                else:
                    x, sizes = blk.forward_merging(*args)
            elif attention is not None:  # the probabilities, of every token: the explicit path in full
                if ckpt:
                    # the RNG state is saved and restored, so dropout and drop-path draw the same masks again
                    x, probs = checkpoint(blk.forward_explicit, x, rel, use_reentrant=False, preserve_rng_state=True)
                else:
                    x, probs = blk.forward_explicit(x, rel)
                attention.append(probs)
            elif ckpt:
                x = checkpoint(
                    blk,
                    x,
                    out_tokens if i == last else None,
                    rel,
                    explicit,
                    use_reentrant=False,
                    preserve_rng_state=True,
                )
            else:
                x = blk(x, out_tokens if i == last else None, rel, explicit)
            if blocks is not None:
                blocks.append(x)
        return self.norm(x)

    def forward_features(self, x: torch.Tensor, attn_impl: str | None = None) -> torch.Tensor:
        """Images -> the final normalised token sequence (B, N, D) (the official 'encoded')."""
        patches, grid = self.patch_embed(x)
        return self.encode(self.embed_tokens(patches, grid), attn_impl, grid=grid)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, D): the class token or first token, the mean of the patch tokens, or the MAP head."""
        return pool_tokens(x, self.config.classifier, self.num_prefix_tokens, self.attn_pool)

    def _represent(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled (B, D) -> the representation the head reads: pre-logits Dense + tanh, if the model has one."""
        return pooled if self.pre_logits is None else torch.tanh(self.pre_logits(pooled))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Encoded tokens (B, N, D) -> logits (B, K), or the representation before the head if pre_logits."""
        x = self._represent(self.pool(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, attn_impl: str | None = None) -> torch.Tensor:
        """Images -> logits. With class-token pooling the head reads one token, so the last block computes that
        token alone (keys and values still from all): the same logits for about 1/depth less work, in training
        too, as no other token of the last block reaches the loss. The last block's output (and what its hooks
        see) is then (B, 1, D); forward_features and forward_intermediates give every token. Token merging
        (config ``token_merge``) applies here only."""
        out_tokens = 1 if self.config.classifier in FIRST_TOKEN else None
        patches, grid = self.patch_embed(x)
        tokens = self.embed_tokens(patches, grid)
        return self.forward_head(self.encode(tokens, attn_impl, out_tokens, grid=grid, merge=True))

    def forward_intermediates(
        self, x: torch.Tensor, return_attention: bool = False, attn_impl: str | None = None
    ) -> dict[str, Any]:
        """Run the model once and return every stage's output.

        Keys: ``stem`` (hybrids: the ResNet feature map), ``patches`` (B, D, gh, gw), ``tokens`` (input to
        the first block), ``blocks`` (list of (B, N, D)), ``attention`` (list of (B, nh, N, N) when
        return_attention; this uses the explicit path), ``encoded``, ``pooled``, ``pre_logits``, ``logits``; for a
        MAP-head model with return_attention also ``map_attention`` (B, nh, 1, N): the probe's attention over the
        encoded tokens, the attention that decides what the head sees.
        """
        out: dict[str, Any] = {}
        if self.patch_embed.backbone is not None:
            out["stem"] = x = self.patch_embed.backbone(x)
        patches, grid = self.patch_embed.project(x)
        out["patches"] = patches.transpose(1, 2).reshape(patches.shape[0], -1, *grid)  # (B, D, gh, gw)
        out["tokens"] = x = self.embed_tokens(patches, grid)
        out["blocks"] = []
        if return_attention:
            out["attention"] = []
        out["encoded"] = encoded = self.encode(
            x, attn_impl, blocks=out["blocks"], attention=out.get("attention"), grid=grid
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

    # --------------------------------------------------------------------------------------------- utils
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
        rel = {f"blocks.{i}.attn.rel_pos_embed" for i, b in enumerate(blocks) if b.attn.rel_pos_embed is not None}
        return names | rel

    def num_params(self, trainable_only: bool = False) -> int:
        return count_params(self, trainable_only)
