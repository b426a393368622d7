"""Small helpers shared by the model modules."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import fields
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import ConfigError

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


def check_choices(config: Any, **allowed: tuple[str, ...]) -> None:
    """ConfigError unless each named field of config is one of its allowed values."""
    for name, values in allowed.items():
        if getattr(config, name) not in values:
            raise ConfigError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: expected one of {values}")


def check_rates(config: Any, *names: str) -> None:
    """ConfigError unless each named field of config is a rate in [0, 1)."""
    for name in names:
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ConfigError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: expected a rate in [0, 1)")


def check_above_zero(config: Any, *names: str) -> None:
    """ConfigError unless each named field of config is a number > 0."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ConfigError(f"{type(config).__name__}.{name}={getattr(config, name)!r}: expected a positive number")


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
