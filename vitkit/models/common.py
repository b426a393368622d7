"""Small helpers shared by the model modules."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import fields
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import ConfigError
from .gelu import GELU
from .linear import dense, dense_gelu, gelu_dense, unhooked

C = TypeVar("C")

_TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Flax's default kernel init: truncated normal with variance 1 / fan_in (torch layouts: out dim first)."""
    std = math.sqrt(1.0 / w[0].numel()) / _TRUNC_STD
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


def check_fields(cls: type, names: Any) -> None:
    """Raise ConfigError naming any of ``names`` that is not an init field of dataclass ``cls``."""
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(known)}")


def replace_config(config: C, overrides: dict[str, Any]) -> C:
    """A copy of a (frozen) config dataclass with some fields changed; an unknown field is a clear error."""
    check_fields(type(config), overrides)
    return dataclasses.replace(config, **overrides)  # type: ignore[type-var]


def as_pair(owner: str, name: str, value: Any) -> tuple[int, int]:
    """An int or a pair of ints (list or tuple, as JSON and YAML give it) -> a pair; anything else a ConfigError."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (value[0], value[1])
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    raise ConfigError(f"{owner}.{name}={value!r}: expected an int or a pair of ints")


def check_positive(owner: str, **values: Any) -> None:
    """ConfigError unless every value is a positive int (pairs: both entries); bools are not ints here."""
    for name, value in values.items():
        items = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items):
            raise ConfigError(f"{owner}.{name}={value!r}: expected a positive integer")


def check_num_classes(owner: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{owner}.num_classes={value!r}: expected an integer >= 0 (0: no head)")


def normalise_stages(config: Any) -> None:
    """The fields every ResNet config shares (layers, img_size, in_chans, num_classes): normalised in place on a
    frozen dataclass being built (its __post_init__), then checked."""
    owner = type(config).__name__
    object.__setattr__(config, "layers", tuple(config.layers))
    object.__setattr__(config, "img_size", as_pair(owner, "img_size", config.img_size))
    check_positive(owner, layers=config.layers, in_chans=config.in_chans, img_size=config.img_size)
    if not config.layers:
        raise ConfigError(f"{owner}.layers=(): expected at least one stage")
    check_num_classes(owner, config.num_classes)


class Mlp(nn.Module):
    """The transformer MLP: Dense -> GELU -> dropout -> Dense -> dropout (encoder blocks and the MAP head)."""

    def __init__(self, dim: int, hidden: int, gelu: str = "tanh", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = GELU(approximate="tanh" if gelu == "tanh" else "none")
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = dense_gelu(self.fc1, self.act, x)  # inference on a CPU: the GELU applied inside fc1's matmul
        if a is not None:
            return self.drop(dense(self.fc2, self.drop(a)))
        h = dense(self.fc1, x)
        if not (self.training and self.drop.p) and unhooked(self.drop):  # nothing between the GELU and fc2: in
            y = gelu_dense(self.act, self.fc2, h)  # training on a CPU, one function keeping h alone for backward
            if y is not None:
                return self.drop(y)
        return self.drop(dense(self.fc2, self.drop(self.act(h))))


def zero_head(in_features: int, num_classes: int) -> nn.Module:
    """The classifier head: zero-initialised Dense (as the official code); Identity when num_classes is 0."""
    if not num_classes:
        return nn.Identity()
    head = nn.Linear(in_features, num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class Stage(nn.Module):
    """A stage of residual units, run in order (state-dict names ``blocks.<i>``, as timm's ResNetV2)."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class PooledClassifier(nn.Module):
    """The head of the CNN classifiers: global average pooling of ``forward_features``' map, then a
    zero-initialised Dense ``head`` over ``num_features`` channels (both set by the subclass)."""

    config: Any
    head: nn.Module
    num_features: int

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean(dim=(2, 3))  # (B, C)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        """A fresh zero head for ``num_classes`` (0: none), as the official fine-tuning (and big_transfer's)."""
        self.config = replace_config(self.config, {"num_classes": num_classes})
        self.head = zero_head(self.num_features, num_classes).to(next(self.parameters()).device)

    def no_weight_decay(self) -> set[str]:
        return set()

    def num_params(self, trainable_only: bool = False) -> int:
        return count_params(self, trainable_only)


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """The number of parameters of a model (only those with requires_grad when ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
