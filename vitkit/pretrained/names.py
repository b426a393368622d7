"""Names of released weights: vitkit's tags, timm's and Hugging Face's names for the same rows, and the one
did-you-mean for a name vitkit does not know.

An alias gives an architecture (a registered model at the alias's resolution) and, where it names weights, the
vitkit tag of the very file it names (an AugReg alias: the row with timm's default_cfgs URL). Sources: timm's
vision_transformer*.py and resnetv2.py ``default_cfgs`` (an architecture's first tag is timm's default), and the
google/vit-* repositories on the Hugging Face Hub (the transformers conversions of the 2020 release).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import UserError, did_you_mean
from ..models.registry import KNOWN_AS, MODELS, RENAMED, unknown_model
from .row import PretrainedRow
from .table import AUGREG, DEFAULT_WEIGHTS, PRETRAINED, RUNS


# ------------------------------------------------------------------------------------------------------ tags
def default_pretrained(model: str) -> PretrainedRow:
    """The row ``pretrained=True`` loads for a registered model (DEFAULT_WEIGHTS)."""
    if model not in DEFAULT_WEIGHTS:
        raise UserError(f"{model} has no released weights; models with weights: {', '.join(DEFAULT_WEIGHTS)}")
    return PRETRAINED[f"{model}.{DEFAULT_WEIGHTS[model]}"]


def list_pretrained(pattern: str = "", table: Mapping[str, PretrainedRow] | None = None) -> list[str]:
    """Tags matching ``pattern``: a glob (``vit_b16.*``, ``*augreg*``) or, without wildcards, a substring."""
    tags = list(PRETRAINED if table is None else table)
    if not pattern:
        return tags
    glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
    return [t for t in tags if fnmatch.fnmatchcase(t, glob)]


def is_tag(name: str | os.PathLike) -> bool:
    """Whether a string has the shape of a tag: ``<registered model>.<weights>``, no path separators."""
    if not isinstance(name, str) or "/" in name or os.sep in name:
        return False
    model, dot, weights = name.partition(".")
    return bool(dot and weights) and model in MODELS and "." not in weights


def get_pretrained(tag: str, table: Mapping[str, PretrainedRow] | None = None) -> PretrainedRow:
    """The row of a tag, or a UserError naming the close matches."""
    table = PRETRAINED if table is None else table
    if tag in table:
        return table[tag]
    model = tag.partition(".")[0]
    same_model = [t for t in table if t.partition(".")[0] == model]
    otherwise = f"{model} has {', '.join(same_model)}" if same_model else "see `vitkit models --pretrained`"
    raise UserError(f"unknown pretrained weights {tag!r}; {name_hint(tag, list(table), otherwise)}")


# --------------------------------------------------------------------------------------------------- aliases
@dataclass(frozen=True)
class Resolved:
    """What a model name means: a registered model, the input size it gives, the tag of the weights it names (else
    ``default_tag``: what pretrained=True loads) and the timm or Hugging Face name it was spelt as (``foreign``)."""

    model: str
    img_size: int | None = None
    tag: str | None = None
    default_tag: str | None = None
    foreign: str | None = None


# timm architecture -> (vitkit model, resolution); None: an architecture vitkit does not register
TIMM_ARCHS: dict[str, tuple[str, int] | None] = {
    **{
        f"vit_{size}_patch{patch}_{res}": (f"vit_{short}{patch}", res)
        for size, short, patch, resolutions in (
            ("tiny", "ti", 16, (224, 384)),
            ("small", "s", 32, (224, 384)),
            ("small", "s", 16, (224, 384)),
            ("base", "b", 32, (224, 384)),
            ("base", "b", 16, (224, 384)),
            ("base", "b", 8, (224,)),
            ("large", "l", 32, (224, 384)),
            ("large", "l", 16, (224, 384)),
            ("huge", "h", 14, (224,)),
        )
        for res in resolutions
    },
    "vit_tiny_r_s16_p8_224": ("r_vit_ti32", 224),
    "vit_tiny_r_s16_p8_384": ("r_vit_ti32", 384),
    "vit_small_r26_s32_224": ("r26_vit_s32", 224),
    "vit_small_r26_s32_384": ("r26_vit_s32", 384),
    "vit_base_r26_s32_224": ("r26_vit_b32", 224),
    "vit_base_r50_s16_224": ("r50_vit_b16", 224),
    "vit_base_r50_s16_384": ("r50_vit_b16", 384),
    "vit_large_r50_s32_224": ("r50_vit_l32", 224),
    "vit_large_r50_s32_384": ("r50_vit_l32", 384),
    # BiT's ResNet-v2 takes any input size: the name gives none
    **{f"resnetv2_{a}_bit": (f"bit_r{a}", 0) for a in ("50x1", "50x3", "101x1", "101x3", "152x2", "152x4")},
    # timm architectures with no vitkit row (their names still get a did-you-mean)
    "vit_small_patch8_224": None,
    "vit_large_patch14_224": None,
    "vit_giant_patch14_224": None,
}


def _augreg(run: str, finetune: str | None = None) -> str:
    """The official bucket's URL of an AugReg file, as timm's default_cfgs name it."""
    return f"{AUGREG}/{run}{'' if finetune is None else '--imagenet2012-' + finetune}.npz"


# the AugReg runs timm's default_cfgs name besides the table's own (pretrained.table.RUNS)
_S32 = "S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0"
_B32 = "B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0"
_L16 = "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1"
_R26_S32 = "R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0"
_R26_S32_224 = "R26_S_32-i21k-300ep-lr_0.001-aug_light0-wd_0.03-do_0.1-sd_0.1"
_R50_L32 = "R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0"
_FT224, _FT384 = "steps_20k-lr_0.03-res_224", "steps_20k-lr_0.03-res_384"
_FT224_01, _FT384_01 = "steps_20k-lr_0.01-res_224", "steps_20k-lr_0.01-res_384"

# timm tag -> the weights it names: a vitkit tag (the same upstream file), an AugReg URL (the row with that file),
# or None (no row). In timm's order: an architecture's first is its default.
TIMM_WEIGHTS: dict[str, str | None] = {
    "vit_base_patch16_224.augreg2_in21k_ft_in1k": "vit_b16.augreg2_in21k_ft_in1k",
    "vit_base_patch8_224.augreg2_in21k_ft_in1k": "vit_b8.augreg2_in21k_ft_in1k",
    "vit_tiny_patch16_224.augreg_in21k_ft_in1k": _augreg(RUNS["vit_ti16"], _FT224),
    "vit_tiny_patch16_384.augreg_in21k_ft_in1k": _augreg(RUNS["vit_ti16"], _FT384),
    "vit_small_patch32_224.augreg_in21k_ft_in1k": _augreg(_S32, _FT224),
    "vit_small_patch32_384.augreg_in21k_ft_in1k": _augreg(_S32, _FT384),
    "vit_small_patch16_224.augreg_in21k_ft_in1k": _augreg(RUNS["vit_s16"], _FT224),
    "vit_small_patch16_384.augreg_in21k_ft_in1k": _augreg(RUNS["vit_s16"], _FT384),
    "vit_base_patch32_224.augreg_in21k_ft_in1k": _augreg(_B32, _FT224),
    "vit_base_patch32_384.augreg_in21k_ft_in1k": _augreg(RUNS["vit_b32"], _FT384),
    "vit_base_patch16_224.augreg_in21k_ft_in1k": _augreg(RUNS["vit_b16"], _FT224_01),
    "vit_base_patch16_384.augreg_in21k_ft_in1k": _augreg(RUNS["vit_b16"], _FT384_01),
    "vit_base_patch8_224.augreg_in21k_ft_in1k": _augreg(RUNS["vit_b8"], _FT224_01),
    "vit_large_patch16_224.augreg_in21k_ft_in1k": _augreg(_L16, _FT224_01),
    "vit_large_patch16_384.augreg_in21k_ft_in1k": _augreg(_L16, _FT384_01),
    "vit_base_patch16_224.orig_in21k_ft_in1k": "vit_b16.orig_in21k_ft_in1k_224",
    "vit_base_patch16_384.orig_in21k_ft_in1k": "vit_b16.orig_in21k_ft_in1k",
    "vit_large_patch32_384.orig_in21k_ft_in1k": "vit_l32.orig_in21k_ft_in1k",
    "vit_small_patch16_224.augreg_in1k": None,
    "vit_small_patch16_384.augreg_in1k": None,
    "vit_base_patch32_224.augreg_in1k": None,
    "vit_base_patch32_384.augreg_in1k": None,
    "vit_base_patch16_224.augreg_in1k": None,
    "vit_base_patch16_384.augreg_in1k": None,
    "vit_base_patch32_224.orig_in21k": "vit_b32.orig_in21k",
    "vit_base_patch16_224.orig_in21k": "vit_b16.orig_in21k",
    "vit_large_patch32_224.orig_in21k": "vit_l32.orig_in21k",
    "vit_large_patch16_224.orig_in21k": "vit_l16.orig_in21k",
    "vit_huge_patch14_224.orig_in21k": "vit_h14.orig_in21k",
    "vit_tiny_patch16_224.augreg_in21k": _augreg(RUNS["vit_ti16"]),
    "vit_small_patch32_224.augreg_in21k": _augreg(_S32),
    "vit_small_patch16_224.augreg_in21k": _augreg(RUNS["vit_s16"]),
    "vit_base_patch32_224.augreg_in21k": _augreg(_B32),
    "vit_base_patch16_224.augreg_in21k": _augreg(RUNS["vit_b16"]),
    "vit_base_patch8_224.augreg_in21k": _augreg(RUNS["vit_b8"]),
    "vit_large_patch16_224.augreg_in21k": _augreg(_L16),
    # hybrids (vision_transformer_hybrid.py)
    "vit_tiny_r_s16_p8_224.augreg_in21k_ft_in1k": _augreg(RUNS["r_vit_ti32"], _FT224),
    "vit_tiny_r_s16_p8_384.augreg_in21k_ft_in1k": _augreg(RUNS["r_vit_ti32"], _FT384),
    "vit_small_r26_s32_224.augreg_in21k_ft_in1k": _augreg(_R26_S32_224, _FT224),
    "vit_small_r26_s32_384.augreg_in21k_ft_in1k": _augreg(_R26_S32, _FT384),
    "vit_base_r50_s16_384.orig_in21k_ft_in1k": "r50_vit_b16.orig_in21k_ft_in1k",
    "vit_large_r50_s32_224.augreg_in21k_ft_in1k": _augreg(RUNS["r50_vit_l32"], _FT224_01),
    "vit_large_r50_s32_384.augreg_in21k_ft_in1k": _augreg(_R50_L32, _FT384_01),
    "vit_tiny_r_s16_p8_224.augreg_in21k": _augreg(RUNS["r_vit_ti32"]),
    "vit_small_r26_s32_224.augreg_in21k": _augreg(_R26_S32),
    "vit_base_r50_s16_224.orig_in21k": "r50_vit_b16.orig_in21k",
    "vit_large_r50_s32_224.augreg_in21k": _augreg(_R50_L32),
    # Big Transfer (resnetv2.py): BiT-M's ImageNet-21k files are vitkit's; the distilled and fine-tuned are not
    "resnetv2_50x1_bit.goog_distilled_in1k": None,
    "resnetv2_152x2_bit.goog_teacher_in21k_ft_in1k": None,
    **{f"resnetv2_{a}_bit.goog_in21k_ft_in1k": None for a in ("50x1", "50x3", "101x1", "101x3", "152x2", "152x4")},
    **{f"resnetv2_{a}_bit.goog_in21k": f"bit_r{a}.bit_m_in21k" for a in ("50x1", "50x3", "101x1", "101x3", "152x2")},
    "resnetv2_152x4_bit.goog_in21k": "bit_r152x4.bit_m_in21k",
}

# Hugging Face Hub repository -> (vitkit model, resolution, vitkit tag of the same weights). Where vitkit has the
# Hub copy itself (the two B/16 fine-tunes) that row; else the official file the repository was converted from.
HF_NAMES: dict[str, tuple[str, int, str]] = {
    "google/vit-base-patch16-224": ("vit_b16", 224, "vit_b16.orig_in21k_ft_in1k_224_hf"),
    "google/vit-base-patch16-384": ("vit_b16", 384, "vit_b16.orig_in21k_ft_in1k_hf"),
    "google/vit-base-patch32-384": ("vit_b32", 384, "vit_b32.orig_in21k_ft_in1k"),
    "google/vit-large-patch16-224": ("vit_l16", 224, "vit_l16.orig_in21k_ft_in1k_224"),
    "google/vit-large-patch16-384": ("vit_l16", 384, "vit_l16.orig_in21k_ft_in1k"),
    "google/vit-large-patch32-384": ("vit_l32", 384, "vit_l32.orig_in21k_ft_in1k"),
    "google/vit-base-patch16-224-in21k": ("vit_b16", 224, "vit_b16.orig_in21k"),
    "google/vit-base-patch32-224-in21k": ("vit_b32", 224, "vit_b32.orig_in21k"),
    "google/vit-large-patch16-224-in21k": ("vit_l16", 224, "vit_l16.orig_in21k"),
    "google/vit-large-patch32-224-in21k": ("vit_l32", 224, "vit_l32.orig_in21k"),
    "google/vit-huge-patch14-224-in21k": ("vit_h14", 224, "vit_h14.orig_in21k"),
}


def _tag_of(timm_tag: str) -> str | None:
    """The vitkit tag of a timm tag's weights, or None when the table has no row of them."""
    target = TIMM_WEIGHTS[timm_tag]
    if target is None or not target.startswith("https://"):
        return target
    return next((row.tag for row in PRETRAINED.values() if row.url == target), None)


def _no_row(timm_tag: str, model: str) -> UserError:
    target = TIMM_WEIGHTS[timm_tag]
    what = f" (the file {target.rsplit('/', 1)[-1]})" if target else ""
    rows = _rows_of(model)
    have = f"vitkit's weights of {model}: {', '.join(rows)}" if rows else f"vitkit has no weights of {model}"
    return UserError(f"timm's {timm_tag}{what} is not in vitkit's weights table; {have}")


def resolve_name(name: str, pretrained: bool = False) -> Resolved:
    """What a model name, a tag or a timm / HF name means; with ``pretrained`` a bare model gives its default
    weights (a timm architecture: timm's default tag). An unknown name is a UserError with the closest names."""
    if name in MODELS:
        default = default_pretrained(name).tag if pretrained else None
        return Resolved(name, default_tag=default)
    if is_tag(name):
        return Resolved(get_pretrained(name).model, tag=name)
    if name in HF_NAMES:
        model, res, tag = HF_NAMES[name]
        return Resolved(model, res, tag, foreign=name)
    arch, dot, _ = name.partition(".")
    if arch in TIMM_ARCHS:
        target = TIMM_ARCHS[arch]
        if target is None:
            raise UserError(f"timm's {arch} has no vitkit row; {name_hint(arch)}")
        model, res = target
        if not dot and not pretrained:
            return Resolved(model, res or None, foreign=name)
        known = [t for t in TIMM_WEIGHTS if t.partition(".")[0] == arch]  # in timm's order: the first is its default
        timm_tag = name if dot else next(iter(known), None)
        if timm_tag is None:
            raise UserError(f"timm lists no weights of {arch}; vitkit's: {', '.join(_rows_of(model)) or 'none'}")
        if timm_tag not in TIMM_WEIGHTS:
            raise UserError(f"unknown timm weights {name!r}; {name_hint(name, known, cutoff=0.0)}")
        found = _tag_of(timm_tag)
        if found is None and pretrained:
            raise _no_row(timm_tag, model)
        if found is None:  # weights vitkit does not hold, asked for as an architecture only
            return Resolved(model, res or None, foreign=name)
        return Resolved(model, res or None, found if dot else None, None if dot else found, foreign=name)
    if name in RENAMED or name.lower().split(".")[0] in KNOWN_AS:
        raise unknown_model(name)  # a renamed row, or Big Transfer's own spelling: the registry names the row
    raise UserError(f"unknown model {name!r}; {name_hint(name)}")


def _rows_of(model: str) -> list[str]:
    return [t for t in PRETRAINED if t.partition(".")[0] == model]


# --------------------------------------------------------------------------------------------- did you mean
SEE_LISTS = "see vitkit.list_models() or `vitkit models`"


def _meaning(name: str) -> str:
    """What a candidate name stands for, shown beside it: the vitkit row of an alias ("" for vitkit's own)."""
    if name in HF_NAMES:
        return HF_NAMES[name][2]
    arch = name.partition(".")[0]
    target = TIMM_ARCHS.get(arch)
    if target is None:
        return ""
    if "." in name:
        return _tag_of(name) or f"{target[0]}, weights not in vitkit"
    return target[0] + (f" at {target[1]}" if target[1] else "")


def name_hint(name: str, among: Sequence[str] | None = None, otherwise: str = SEE_LISTS, cutoff: float = 0.6) -> str:
    """did_you_mean among ``among`` (default: all names), aliases shown as ``vit_base_patch16_224 (vit_b16 at 224)``."""
    if among is None:  # every name vitkit resolves: its models and tags, then the timm / Hugging Face aliases
        among = [*MODELS, *(a for a, t in TIMM_ARCHS.items() if t), *PRETRAINED, *TIMM_WEIGHTS, *HF_NAMES]
    candidates = list(among)
    return did_you_mean(name, candidates, otherwise, lambda c: f"{c} ({_meaning(c)})" if _meaning(c) else c, cutoff)
