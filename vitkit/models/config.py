"""The configuration of a Vision Transformer: every field vit.VisionTransformer is built from, checked where built."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from . import common, posemb
from .heads import CLASSIFIERS
from .resnet import stem_reduction

if TYPE_CHECKING:
    Size = tuple[int, int]  # what a built config holds: __post_init__ makes every size a (height, width) pair
else:
    Size = int | tuple[int, int]  # what it accepts, as the typed key=value parser reads it (get_type_hints)

POS_EMBEDS = ("learned", "learned_2d", "sincos_2d", "relative", "relative_2d", "none")
POS_EMBED_WHERE = ("input", "every_layer", "every_layer_shared")
RELATIVE_DIMS = {"relative": 1, "relative_2d": 2}  # offsets in raster order (the paper's), or (row, column)
GELUS = ("tanh", "exact")
ATTN_IMPLS = ("auto", "sdpa", "explicit")
POSITIVE = ("img_size", "patch_size", "in_chans", "width", "depth", "num_heads", "mlp_dim")  # positive integers


@dataclass(frozen=True)
class ViTConfig:
    """Everything needed to rebuild a VisionTransformer; a value (change it with ``dataclasses.replace``)."""

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
    grad_checkpointing: bool = False  # recompute each block's activations in backward: memory for compute
    ln_eps: float = 1e-6  # LayerNorm epsilon (official 1e-6; Hugging Face 1e-12)
    gelu: str = "tanh"  # "tanh" (official, Flax) or "exact" (erf: torch, timm, HF)
    pos_embed: str = "learned"  # "learned" (1-D), "learned_2d", "sincos_2d", "relative", "relative_2d", "none"
    pos_embed_where: str = "input"  # absolute tables: "input", "every_layer" (own per block), "every_layer_shared"
    resnet_layers: tuple[int, ...] | None = None  # hybrid stem: None = no stem, () = root only
    resnet_width: float = 1  # hybrid stem width factor (64 x it channels at the root)
    attn_impl: str = "auto"  # "sdpa" (fused), "explicit" (written out), "auto" (explicit in bf16 on a CPU, else sdpa)
    dynamic_img_size: bool = False  # accept other input sizes by resampling position embeddings per call
    arch: str = field(default="vit", init=False)

    def __post_init__(self) -> None:
        # normalise spellings once, here (lists from JSON/YAML, ints for square sizes); the config stays a value
        normal: dict[str, Any] = dict(img_size=common.as_pair("ViTConfig", "img_size", self.img_size))
        normal["patch_size"] = common.as_pair("ViTConfig", "patch_size", self.patch_size)
        if self.resnet_layers is not None:
            normal["resnet_layers"] = tuple(self.resnet_layers)
        if self.representation_size == 0:
            normal["representation_size"] = None
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        self._check_values()
        self._check_combinations()

    def _check_values(self) -> None:
        common.check_positive("ViTConfig", **{name: getattr(self, name) for name in POSITIVE})
        if self.representation_size is not None:
            common.check_positive("ViTConfig", representation_size=self.representation_size)
        if self.resnet_layers:
            common.check_positive("ViTConfig", resnet_layers=self.resnet_layers)
        common.check_num_classes("ViTConfig", self.num_classes)
        common.check_choices(self, classifier=CLASSIFIERS, pos_embed=POS_EMBEDS, pos_embed_where=POS_EMBED_WHERE)
        common.check_choices(self, gelu=GELUS, attn_impl=ATTN_IMPLS)
        common.check_rates(self, "dropout", "attn_dropout", "drop_path")
        common.check_above_zero(self, "ln_eps", "resnet_width")

    def _check_combinations(self) -> None:
        if self.width % self.num_heads:
            raise ConfigError(f"ViTConfig: width {self.width} is not divisible by num_heads {self.num_heads}")
        posemb.check_config(self.width, self.pos_embed, self.pos_embed_where)
        r = self.stride[0] // self.patch_size[0]  # what the patch conv sees: the stem rounds up ('SAME' padding)
        features = (-(-self.img_size[0] // r), -(-self.img_size[1] // r))
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
        r = self.stride[0] // self.patch_size[0]
        return (-(-h // r) // self.patch_size[0], -(-w // r) // self.patch_size[1])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
