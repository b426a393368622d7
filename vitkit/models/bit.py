"""BiT: the pre-activation ResNet-v2 of Big Transfer (Kolesnikov et al. 2020), the paper's CNN baseline.

Numerics follow google-research/big_transfer, whose three implementations (bit_pytorch, bit_jax, bit_tf2) agree
and were used to release the weights:
- weight standardisation per output channel: (w - mean) / sqrt(var + 1e-10), variance about the mean;
- GroupNorm with 32 groups and eps 1e-5;
- root: StdConv 7x7/2 with 3 pixels of zeros on every side, then 1 pixel of zeros and max-pool 3x3/2. There is no
  norm or activation in the root (the first unit pre-activates), so the root's output can be negative and the
  zero border can win the max: this is not TF 'SAME' (nor -inf padding), and matches the released weights;
- pre-activation bottleneck units: GN+ReLU, then a projection shortcut (1x1 StdConv carrying the stride) read
  from the pre-activated input where the shape changes; conv1 1x1, GN+ReLU, conv2 3x3 with the stride (3x3 convs
  pad 1 on every side), GN+ReLU, conv3 1x1 to 4x the bottleneck width; y + shortcut, no activation after the add;
- a final GN+ReLU, global average pooling and a zero-initialised dense head (big_transfer's ``zero_head``).
Unlike the hybrid ViT's post-activation ResNet (resnet.py). Module names follow timm's ResNetV2, so its
resnetv2_*_bit state dicts map one to one but for the head: timm's is a 1x1 conv, here the same map as a Linear.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .common import PooledClassifier, Stage, lecun_normal_, normalise_stages, replace_config, zero_head
from .resnet import GroupNorm

WS_EPS = 1e-10  # added to the kernel's variance (big_transfer StdConv2d / standardize)
GN_EPS = 1e-5  # nn.GroupNorm's default in bit_pytorch; standardize(..., eps=1e-5) in bit_jax
GN_GROUPS = 32


class BiTStdConv2d(nn.Conv2d):
    """Bias-free conv with BiT's weight standardisation and symmetric zero padding. The stored kernel is raw."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_chs, out_chs, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
        lecun_normal_(self.weight)  # flax nn.Conv's default; the scale is standardised away

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight  # (out, in, kh, kw)
        var, mean = torch.var_mean(w, dim=(1, 2, 3), keepdim=True, correction=0)
        return (w - mean) / torch.sqrt(var + WS_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), None, self.stride, self.padding)


def group_norm(channels: int) -> GroupNorm:
    """GroupNorm(32, eps 1e-5), in the two-pass form of resnet.GroupNorm (scale 1, bias 0 at init)."""
    return GroupNorm(GN_GROUPS, channels, eps=GN_EPS)


class Projection(nn.Module):
    """Projection shortcut: a 1x1 StdConv carrying the stride, no norm ('a/proj' in the released files)."""

    def __init__(self, in_chs: int, out_chs: int, stride: int) -> None:
        super().__init__()
        self.conv = BiTStdConv2d(in_chs, out_chs, 1, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck unit: GN+ReLU before each of 1x1 -> 3x3 (stride) -> 1x1 (x4), y + shortcut."""

    def __init__(self, in_chs: int, out_chs: int, stride: int = 1) -> None:
        super().__init__()
        mid = out_chs // 4
        self.downsample = Projection(in_chs, out_chs, stride) if (stride != 1 or in_chs != out_chs) else None
        self.norm1 = group_norm(in_chs)
        self.conv1 = BiTStdConv2d(in_chs, mid, 1)
        self.norm2 = group_norm(mid)
        self.conv2 = BiTStdConv2d(mid, mid, 3, stride=stride)
        self.norm3 = group_norm(mid)
        self.conv3 = BiTStdConv2d(mid, out_chs, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_preact = F.relu(self.norm1(x))
        # the projection reads the pre-activated input; the identity shortcut the raw one
        shortcut = x if self.downsample is None else self.downsample(x_preact)
        y = self.conv1(x_preact)
        y = self.conv2(F.relu(self.norm2(y)))
        y = self.conv3(F.relu(self.norm3(y)))
        return y + shortcut


class Stem(nn.Module):
    """Root block: StdConv 7x7/2 (pad 3), 1 pixel of zeros, max-pool 3x3/2: /4, no norm or activation."""

    def __init__(self, in_chs: int, width: int) -> None:
        super().__init__()
        self.conv = BiTStdConv2d(in_chs, width, 7, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(self.conv(x), (1, 1, 1, 1), value=0.0)  # zeros, as ConstantPad2d(1, 0) / jax.lax.pad(x, 0.0)
        return F.max_pool2d(x, 3, 2)


@dataclass(frozen=True)
class BiTConfig:
    """A BiT ResNet-v2: units per stage, the width factor (x1 .. x4), classes, input channels, default image size.

    Stage i has a bottleneck width of 64 * width_factor * 2**i and outputs 4x that; every stage after the first
    halves the resolution. A value, like ViTConfig: checked where it is built, changed with ``dataclasses.replace``."""

    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_factor: float = 1
    num_classes: int = 1000
    in_chans: int = 3
    img_size: int | tuple[int, int] = 224
    arch: str = field(default="bit", init=False)

    def __post_init__(self) -> None:
        normalise_stages(self)
        wf = self.width_factor
        # every GroupNorm has 32 groups: the root's 64 * width_factor channels must be a multiple of 32
        if isinstance(wf, bool) or not isinstance(wf, (int, float)) or not wf > 0 or (64 * wf) % GN_GROUPS:
            raise ConfigError(
                f"BiTConfig.width_factor={wf!r}: expected a positive multiple of 0.5 (64 * width_factor channels "
                f"in {GN_GROUPS} groups)"
            )

    @property
    def width(self) -> int:
        """Channels of the root conv (and bottleneck width of the first stage)."""
        return int(64 * self.width_factor)

    def to_dict(self) -> dict:
        return asdict(self)


class BiT(PooledClassifier):
    """BiT ResNet-v2 classifier: root, pre-activation stages, GN+ReLU, global average pooling, zero dense head."""

    def __init__(self, config: BiTConfig | None = None, **overrides) -> None:
        super().__init__()
        config = replace_config(config or BiTConfig(), overrides)
        self.config = config
        self.stem = Stem(config.in_chans, config.width)
        stages, chs = [], config.width
        for i, depth in enumerate(config.layers):
            out_chs = 4 * config.width * 2**i
            first = PreActBottleneck(chs, out_chs, stride=1 if i == 0 else 2)
            stages.append(Stage([first, *(PreActBottleneck(out_chs, out_chs) for _ in range(depth - 1))]))
            chs = out_chs
        self.stages = nn.Sequential(*stages)
        self.norm = group_norm(chs)  # the pre-head GN ('resnet/group_norm'), ReLU in forward_features
        self.num_features = chs
        self.head = zero_head(self.num_features, config.num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, 2048 * width_factor, H/32, W/32) pre-activated feature map (4 stages)."""
        return F.relu(self.norm(self.stages(self.stem(x))))
