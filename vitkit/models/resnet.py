"""BiT ResNet: the hybrid ViT's convolutional stem and the paper's ResNet baseline.

Numerics follow the official vit_jax ResNet: weight-standardised convolutions ((w - mean) / (std + 1e-5) per output
channel), GroupNorm with 32 groups and eps 1e-6, TensorFlow 'SAME' padding (asymmetric for strided layers),
post-activation bottleneck units with the stride on the 3x3 conv and relu(residual + y). Module names follow timm's
ResNetV2 (stem.conv, stages.0.blocks.0.conv1, ...), so hybrid state dicts map one to one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .common import PooledClassifier, Stage, lecun_normal_, normalise_stages, replace_config, zero_head


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow 'SAME' padding (before, after) for one spatial dimension; the extra pixel goes after."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], value: float = 0.0) -> torch.Tensor:
    top, bottom = same_padding(x.shape[-2], kernel[0], stride[0])
    left, right = same_padding(x.shape[-1], kernel[1], stride[1])
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom), value=value)
    return x


class StdConv2d(nn.Conv2d):
    """Bias-free conv with weight standardisation and TF 'SAME' padding. The stored kernel is unstandardised."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int, stride: int = 1, eps: float = 1e-5) -> None:
        super().__init__(in_chs, out_chs, kernel_size, stride=stride, padding=0, bias=False)
        self.eps = eps
        self.same_kernel, self.same_stride = (kernel_size, kernel_size), (stride, stride)  # for pad_same
        lecun_normal_(self.weight)

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, correction=0)
        return (w - mean) / (std + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.same_kernel, self.same_stride)
        return F.conv2d(x, self.standardized_weight(), None, self.stride)


class GroupNorm(nn.GroupNorm):
    """GroupNorm with statistics computed in two passes (mean, then variance about the mean). torch's fused CPU kernel
    loses about 1e-5 absolute on stem activations (which sit far from zero), enough to miss the official outputs; the
    two-pass form matches them to about 1e-6."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C = x.shape[:2]
        # (B, G, C/G * H * W); the size named, not -1, which no elements (B = 0) cannot infer
        g = x.reshape(B, self.num_groups, math.prod(x.shape[1:]) // self.num_groups)
        mean = g.mean(dim=-1, keepdim=True)
        var = (g - mean).square().mean(dim=-1, keepdim=True)
        y = ((g - mean) * torch.rsqrt(var + self.eps)).reshape(x.shape)
        return y * self.weight.view(1, C, 1, 1) + self.bias.view(1, C, 1, 1)


def group_norm(channels: int, zero_init: bool = False) -> GroupNorm:
    gn = GroupNorm(32, channels, eps=1e-6)
    if zero_init:
        nn.init.zeros_(gn.weight)
    return gn


class Downsample(nn.Module):
    """Projection shortcut: 1x1 StdConv (carrying the stride) + GroupNorm ('conv_proj' / 'gn_proj')."""

    def __init__(self, in_chs: int, out_chs: int, stride: int) -> None:
        super().__init__()
        self.conv = StdConv2d(in_chs, out_chs, 1, stride=stride)
        self.norm = group_norm(out_chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """Post-activation bottleneck unit: 1x1 -> 3x3 (stride) -> 1x1 (x4), GroupNorm after each, relu(res + y)."""

    def __init__(self, in_chs: int, features: int, stride: int = 1) -> None:
        super().__init__()
        out_chs = features * 4
        self.downsample = Downsample(in_chs, out_chs, stride) if (in_chs != out_chs or stride != 1) else None
        self.conv1 = StdConv2d(in_chs, features, 1)
        self.norm1 = group_norm(features)
        self.conv2 = StdConv2d(features, features, 3, stride=stride)
        self.norm2 = group_norm(features)
        self.conv3 = StdConv2d(features, out_chs, 1)
        self.norm3 = group_norm(out_chs, zero_init=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(residual + y)


class Stem(nn.Module):
    """Root block: StdConv 7x7/2 + GroupNorm + ReLU + max-pool 3x3/2, both with TF 'SAME' padding (/4 overall)."""

    def __init__(self, in_chs: int, width: int) -> None:
        super().__init__()
        self.conv = StdConv2d(in_chs, width, 7, stride=2)
        self.norm = group_norm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        x = pad_same(x, (3, 3), (2, 2), value=float("-inf"))
        return F.max_pool2d(x, 3, 2)


def stem_reduction(layers: tuple[int, ...]) -> int:
    """Input pixels per output pixel of a backbone: 4 for the root, x2 for each stage after the first."""
    return 4 * 2 ** max(len(layers) - 1, 0)


class ResNetBackbone(nn.Module):
    """Root + stages. layers=() is the root alone (/4); each stage after the first halves the resolution."""

    def __init__(self, layers: tuple[int, ...], width_factor: float = 1, in_chs: int = 3) -> None:
        super().__init__()
        width = int(64 * width_factor)
        self.stem = Stem(in_chs, width)
        stages, chs = [], width
        for i, depth in enumerate(layers):
            features = width * 2**i
            first = Bottleneck(chs, features, stride=1 if i == 0 else 2)
            stages.append(Stage([first, *(Bottleneck(features * 4, features) for _ in range(depth - 1))]))
            chs = features * 4
        self.stages = nn.Sequential(*stages)
        self.out_chs = chs
        self.reduction = stem_reduction(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


@dataclass(frozen=True)
class ResNetConfig:
    """The hybrid stem's post-activation ResNet as a classifier (hybrid_resnet_r*): a backbone, global average
    pooling and a zero-initialised head. (The paper's BiT baseline is the pre-activation ResNet-v2 in bit.py.)

    A value, like ViTConfig: checked where it is built, changed with ``dataclasses.replace``."""

    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_factor: float = 1
    num_classes: int = 1000
    in_chans: int = 3
    img_size: int | tuple[int, int] = 224
    arch: str = field(default="resnet", init=False)

    def __post_init__(self) -> None:
        normalise_stages(self)
        if not self.width_factor > 0:
            raise ConfigError(f"ResNetConfig.width_factor={self.width_factor!r}: expected a positive number")

    def to_dict(self) -> dict:
        return asdict(self)


class ResNet(PooledClassifier):
    """The hybrid stem's post-activation ResNet as a classifier (hybrid_resnet_r*); BiT is models/bit.py."""

    def __init__(self, config: ResNetConfig | None = None, **overrides) -> None:
        super().__init__()
        config = replace_config(config or ResNetConfig(), overrides)
        self.config = config
        self.backbone = ResNetBackbone(config.layers, config.width_factor, config.in_chans)
        self.num_features = self.backbone.out_chs
        self.head = zero_head(self.num_features, config.num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images -> (B, C', H/32, W/32) feature map."""
        return self.backbone(x)
