"""The released weights, one row per file (vitkit.pretrained.row.PretrainedRow), and the default of each model.

Sources: the original release (2020; google-research/vision_transformer README and the bucket listing in
vit_jax.ipynb, whose sizes are listed here; its ImageNet-21k files keep their pre-logits and a zeroed head),
AugReg (2021; the README's recommended checkpoints, their fine-tunes and the files timm's default_cfgs point to),
Hub copies (timm's "augreg2" re-fine-tunes, the transformers conversions) and Big Transfer (BiT-M, BiT-S). Sizes
and checksums are the hosts' own (None where none is published). A data table, excepted from the size budget.
"""

from __future__ import annotations

from typing import Any

from .row import CLASS_COUNTS, PretrainedRow

GCS = "https://storage.googleapis.com/vit_models"
# '+' in the bucket's folder and file names is sent percent-encoded, so no server can read it as a space
ORIG_21K = f"{GCS}/imagenet21k"
ORIG_1K = f"{GCS}/imagenet21k%2Bimagenet2012"
AUGREG = f"{GCS}/augreg"


def _in21k(tag: str, url: str, listed: str | None = None, **config: Any) -> PretrainedRow:
    """A file pretrained on ImageNet-21k at 224 pixels (21843 classes), on the official bucket."""
    model, weights = tag.split(".")
    config = {"num_classes": 21843, "img_size": 224, **config}
    return PretrainedRow(model, weights, "official", url=url, listed_size=listed, classes="imagenet-21k", config=config)


def _in1k(tag: str, url: str, img_size: int, listed: str | None = None) -> PretrainedRow:
    """An ImageNet-1k fine-tune (a plain head, no pre-logits) on the official bucket."""
    model, weights = tag.split(".")
    config = {"num_classes": 1000, "img_size": img_size}
    return PretrainedRow(model, weights, "official", url=url, img_size=img_size, listed_size=listed, config=config)


def _augreg(
    tag: str, run: str, finetune: str | None = None, img_size: int = 224, listed: str | None = None
) -> PretrainedRow:
    """An AugReg file: the ImageNet-21k run itself, or (finetune given) its ImageNet-1k fine-tune."""
    if finetune is None:
        return _in21k(tag, f"{AUGREG}/{run}.npz", listed)
    return _in1k(tag, f"{AUGREG}/{run}--imagenet2012-{finetune}.npz", img_size, listed)


def _hub(tag: str, repo: str, files: tuple[str, ...], format: str, listed: str, **kw: Any) -> PretrainedRow:
    """A Hub copy of ImageNet-1k weights (the files of one repository)."""
    model, weights = tag.split(".")
    img_size = kw.pop("img_size", 224)
    config = {"num_classes": 1000, "img_size": img_size, **kw.pop("config", {})}
    return PretrainedRow(
        model, weights, format, hub_repo=repo, hub_files=files, listed_size=listed, img_size=img_size,
        config=config, **kw,
    )  # fmt: skip


# the AugReg runs the vision_transformer README recommends (best upstream per model), as file-name stems
RUNS = {
    "vit_ti16": "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
    "vit_s16": "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0",
    "vit_s32": "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0",
    "vit_b16": "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
    "vit_b32": "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0",
    "vit_l16": "L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0",
    "r_vit_ti32": "R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
    "r26_vit_s32": "R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0",
    "r50_vit_l32": "R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1",
    # B/8 (added 2021-07) is not in the README table; this is the run timm's default_cfgs use
    "vit_b8": "B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0",
}
TIMM_AUGREG2 = dict(crop_fraction=0.9, interpolation="bicubic", config={"gelu": "exact"})  # timm's _cfg defaults
HF_NUMERICS = {"gelu": "exact", "ln_eps": 1e-12}  # what the transformers config.json of these copies says

BIT = "https://storage.googleapis.com/bit_models"
BIT_M = ("r50x1", "r50x3", "r101x1", "r101x3", "r152x2", "r152x4")  # R152x2 was added to the release later
BIT_S = ("r50x1", "r50x3", "r101x1", "r101x3", "r152x4")


def _bit(model: str, upstream: str) -> PretrainedRow:
    """A Big Transfer file, pretrained at 224 pixels, fed pixels with mean = std = 0.5 as big_transfer does."""
    classes = "imagenet-21k" if upstream == "M" else "imagenet-1k"
    name = f"BiT-{upstream}-R{model.removeprefix('bit_r')}.npz"
    weights = "bit_m_in21k" if upstream == "M" else "bit_s_in1k"
    config = {"num_classes": CLASS_COUNTS[classes], "img_size": 224}
    return PretrainedRow(model, weights, "big_transfer", url=f"{BIT}/{name}", classes=classes, config=config)


# fmt: off
PRETRAINED: dict[str, PretrainedRow] = {row.tag: row for row in (
    # --- the original release: ImageNet-21k (pre-logits + zeroed head) and its ImageNet-1k fine-tunes
    _in21k("vit_b16.orig_in21k", f"{ORIG_21K}/ViT-B_16.npz", "393.69 MiB", representation_size=768),
    _in21k("vit_b32.orig_in21k", f"{ORIG_21K}/ViT-B_32.npz", "400.01 MiB", representation_size=768),
    _in21k("vit_l16.orig_in21k", f"{ORIG_21K}/ViT-L_16.npz", "1.22 GiB", representation_size=1024),
    _in21k("vit_l32.orig_in21k", f"{ORIG_21K}/ViT-L_32.npz", "1.23 GiB", representation_size=1024),
    _in21k("vit_h14.orig_in21k", f"{ORIG_21K}/ViT-H_14.npz", "2.46 GiB", representation_size=1280),
    _in21k("r50_vit_b16.orig_in21k", f"{ORIG_21K}/R50%2BViT-B_16.npz", "439.85 MiB", representation_size=768),
    _in1k("vit_b16.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-B_16.npz", 384, "331.4 MiB"),
    _in1k("vit_b16.orig_in21k_ft_in1k_224", f"{ORIG_1K}/ViT-B_16-224.npz", 224, "330.29 MiB"),
    _in1k("vit_b32.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-B_32.npz", 384, "336.89 MiB"),
    _in1k("vit_l16.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-L_16.npz", 384, "1.14 GiB"),
    _in1k("vit_l16.orig_in21k_ft_in1k_224", f"{ORIG_1K}/ViT-L_16-224.npz", 224, "1.13 GiB"),
    _in1k("vit_l32.orig_in21k_ft_in1k", f"{ORIG_1K}/ViT-L_32.npz", 384, "1.14 GiB"),
    _in1k("r50_vit_b16.orig_in21k_ft_in1k", f"{ORIG_1K}/R50%2BViT-B_16.npz", 384, "377.57 MiB"),
    # --- AugReg: the recommended ImageNet-21k runs (no pre-logits, trained head) and their 384 fine-tunes
    _augreg("vit_ti16.augreg_in21k", RUNS["vit_ti16"], listed="37 MiB"),
    _augreg("vit_ti16.augreg_in21k_ft_in1k", RUNS["vit_ti16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_ti16.augreg_in21k_ft_in1k_224", RUNS["vit_ti16"], "steps_20k-lr_0.03-res_224"),
    _augreg("vit_s16.augreg_in21k", RUNS["vit_s16"], listed="115 MiB"),
    _augreg("vit_s16.augreg_in21k_ft_in1k", RUNS["vit_s16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_s16.augreg_in21k_ft_in1k_224", RUNS["vit_s16"], "steps_20k-lr_0.03-res_224"),
    _augreg("vit_s32.augreg_in21k", RUNS["vit_s32"], listed="118 MiB"),
    _augreg("vit_s32.augreg_in21k_ft_in1k", RUNS["vit_s32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_b16.augreg_in21k", RUNS["vit_b16"], listed="391 MiB"),
    _augreg("vit_b16.augreg_in21k_ft_in1k", RUNS["vit_b16"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("vit_b16.augreg_in21k_ft_in1k_224", RUNS["vit_b16"], "steps_20k-lr_0.01-res_224"),
    _augreg("vit_b32.augreg_in21k", RUNS["vit_b32"], listed="398 MiB"),
    _augreg("vit_b32.augreg_in21k_ft_in1k", RUNS["vit_b32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_l16.augreg_in21k", RUNS["vit_l16"], listed="1243 MiB"),
    _augreg("vit_l16.augreg_in21k_ft_in1k", RUNS["vit_l16"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("vit_b8.augreg_in21k", RUNS["vit_b8"]),
    _augreg("vit_b8.augreg_in21k_ft_in1k_224", RUNS["vit_b8"], "steps_20k-lr_0.01-res_224"),
    # AugReg hybrids: R+Ti/16 is the ResNet root alone with 8x8 patches; R26 and R50 use four stages (/32)
    _augreg("r_vit_ti32.augreg_in21k", RUNS["r_vit_ti32"], listed="40 MiB"),
    _augreg("r_vit_ti32.augreg_in21k_ft_in1k", RUNS["r_vit_ti32"], "steps_20k-lr_0.03-res_384", 384),
    _augreg("r26_vit_s32.augreg_in21k", RUNS["r26_vit_s32"], listed="170 MiB"),
    _augreg("r26_vit_s32.augreg_in21k_ft_in1k", RUNS["r26_vit_s32"], "steps_20k-lr_0.01-res_384", 384),
    _augreg("r50_vit_l32.augreg_in21k", RUNS["r50_vit_l32"], listed="1337 MiB"),
    _augreg("r50_vit_l32.augreg_in21k_ft_in1k", RUNS["r50_vit_l32"], "steps_20k-lr_0.01-res_384", 384),
    # --- Hub copies: timm's augreg2 re-fine-tunes, transformers conversions of the original fine-tunes
    _hub("vit_b16.augreg2_in21k_ft_in1k", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k",
         ("model.safetensors",), "timm", "346 MB", **TIMM_AUGREG2),
    _hub("vit_b8.augreg2_in21k_ft_in1k", "timm/vit_base_patch8_224.augreg2_in21k_ft_in1k",
         ("model.safetensors",), "timm", "346 MB", **TIMM_AUGREG2),
    _hub("vit_b16.orig_in21k_ft_in1k_224_hf", "google/vit-base-patch16-224",
         ("config.json", "model.safetensors"), "hf", "346 MB", config=HF_NUMERICS),
    _hub("vit_b16.orig_in21k_ft_in1k_hf", "google/vit-base-patch16-384",
         ("config.json", "model.safetensors"), "hf", "347 MB", img_size=384, config=HF_NUMERICS),
    # --- the paper's CNN baselines: Big Transfer ResNet-v2
    *(_bit(f"bit_{arch}", "M") for arch in BIT_M),
    *(_bit(f"bit_{arch}", "S") for arch in BIT_S),
)}
# fmt: on

# The weights ``pretrained=True`` loads, one per model with released weights: the ImageNet-1k fine-tune of the
# strongest ImageNet-21k pretraining the table holds, from the official bucket (AugReg over the 2020 release, as
# the vision_transformer README recommends; the 384-pixel fine-tune where there are two); a model without an
# ImageNet-1k fine-tune gets its ImageNet-21k weights (ViT-H/14; BiT-M, whose upstream the paper compares with).
DEFAULT_WEIGHTS: dict[str, str] = {
    **{m: "augreg_in21k_ft_in1k" for m in ("vit_ti16", "vit_s16", "vit_s32", "vit_b16", "vit_b32", "vit_l16")},
    **{m: "augreg_in21k_ft_in1k" for m in ("r_vit_ti32", "r26_vit_s32", "r50_vit_l32")},
    "vit_b8": "augreg_in21k_ft_in1k_224",
    "vit_l32": "orig_in21k_ft_in1k",
    "vit_h14": "orig_in21k",
    "r50_vit_b16": "orig_in21k_ft_in1k",
    **{f"bit_{arch}": "bit_m_in21k" for arch in BIT_M},
}
