"""One call that writes every inspection figure of a ViT into a directory, with an index of what was written.

    write_inspection(model, "inspect/", images=[InspectionImage("cat", x, display)], class_names=[...])

Figures (paper sec 4.5): Fig 7 (patch-embedding components, position-embedding similarity, attention distance),
and per image the rollout (Fig 6) and attention maps; what cannot be drawn is listed with the reason. An earlier
inspection is replaced only with ``force=True``, so the directory always holds exactly what its index lists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ..data import image_transform, load_image
from ..errors import UserError
from ..io import atomic_write_text
from ..models import VisionTransformer
from ..models.common import as_pair
from ..preprocessing import Preprocessing
from . import figures
from .attention import (
    attention_distance,
    probe_attention,
    query_attention,
    record_attention,
    rollout_map,
    token_distances,
    untrained_layers,
    upsample_map,
)
from .embeddings import patch_filter_components, position_embedding_grid, position_similarity


@dataclass
class InspectionImage:
    """An image to explain: its ``name``, the model ``input`` (C, H, W) and a ``display`` copy (H, W, C) in [0, 1]."""

    name: str
    input: torch.Tensor
    display: np.ndarray | torch.Tensor
    label: str | None = None  # the true class, when known


def images_from_files(files: Sequence[str | Path], prep: Preprocessing) -> tuple[list[InspectionImage], list[str]]:
    """Load image files with the model's preprocessing; unreadable files are returned as error lines."""
    transform, images, errors = image_transform(prep), [], []
    for f in files:
        try:
            x = transform(load_image(f))  # (C, H, W)
        except UserError as e:  # a missing or unreadable file, named
            errors.append(str(e))
            continue
        images.append(InspectionImage(Path(f).stem, x, prep.to_display(x).numpy()))
    return images, errors


def images_from_dataset(
    dataset: Dataset[Any], prep: Preprocessing, count: int, class_names: Sequence[str] | None = None
) -> list[InspectionImage]:
    """Up to ``count`` images of a dataset of (image, label), one per class first; labels come from its ``labels``
    or ``targets`` (no decoding), else from its first ``50 * count`` items, each read once (a stream's too)."""
    labels = getattr(dataset, "labels", None)
    if labels is None:
        labels = getattr(dataset, "targets", None)
    if labels is not None:  # the labels alone pick; only the picked items are decoded
        labelled = ((i, int(y), None) for i, y in enumerate(labels))
        picked = [(i, y, dataset[i][0]) for i, y, _ in _one_per_class_first(labelled, count)]
    else:
        if not isinstance(dataset, Sized):
            raise UserError(f"inspect: the data set ({type(dataset).__name__}) has no length to pick images from")
        n = min(len(dataset), 50 * count)
        items = iter(dataset) if isinstance(dataset, IterableDataset) else (dataset[i] for i in range(n))
        picked = _one_per_class_first(((i, int(y), x) for i, (x, y) in zip(range(n), items)), count)
    images = []
    for i, y, x in picked:
        name = class_names[y] if class_names and y < len(class_names) else str(y)
        images.append(InspectionImage(f"example{i}_{name}", x, prep.to_display(x).numpy(), label=name))
    return images


def _one_per_class_first(items: Iterable[tuple[Any, ...]], count: int) -> list[tuple[Any, ...]]:
    """Up to ``count`` of the (index, label, ...) items: the first of each class, then the others, each in order."""
    firsts: dict[int, tuple[Any, ...]] = {}
    others: list[tuple[Any, ...]] = []
    for item in items:
        if item[1] not in firsts:
            firsts[item[1]] = item
            if len(firsts) == count:
                break
        elif len(others) < count:
            others.append(item)
    return [*firsts.values(), *others][:count]


def describe(model: VisionTransformer) -> str:
    """A one-line summary of a ViT for figure titles: 'ViT D=192 L=12 heads=3, /16 tokens, 224x224 px, token'."""
    c = model.config
    stem = "" if c.resnet_layers is None else f"ResNet{list(c.resnet_layers)} + "
    h, w = as_pair("ViTConfig", "img_size", c.img_size)
    size = f"{h}x{w} px"
    return f"{stem}ViT D={c.width} L={c.depth} heads={c.num_heads}, /{c.stride[0]} tokens, {size}, {c.classifier}"


INDEX_FILES = ("index.json", "index.md")
# every name write_inspection gives a figure (attention_*.png covers attention_distance.png)
FIGURE_PATTERNS = (
    "patch_embedding_pca.png",
    "position_embedding_similarity.png",
    "attention_*.png",
    "rollout_*.png",
    "map_attention_*.png",
)


def earlier_outputs(out_dir: str | Path) -> list[Path]:
    """The files of an earlier inspection in out_dir: its index files and every file named as a figure is."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = {out / name for name in INDEX_FILES if (out / name).exists()}
    found.update(p for pattern in FIGURE_PATTERNS for p in out.glob(pattern) if p.is_file())
    return sorted(found)


def check_output_dir(out_dir: str | Path, force: bool = False) -> None:
    """Refuse (UserError) to write over an earlier inspection without ``force``; the line names one of its files."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory (expected a directory for the figures)")
    earlier = earlier_outputs(out)
    if earlier and not force:
        first = next((p for p in earlier if p.name == "index.json"), earlier[0])
        more = f" and {len(earlier) - 1} more file(s) of an earlier inspection" if len(earlier) > 1 else ""
        raise UserError(f"{first}: exists{more}; pass --force (force=True) to replace them")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "image"


class _Index:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.written: list[dict[str, str]] = []
        self.skipped: list[dict[str, str]] = []

    def add(self, path: Path, figure: str, description: str) -> None:
        self.written.append({"file": path.name, "figure": figure, "description": description})

    def skip(self, figure: str, reason: str) -> None:
        self.skipped.append({"figure": figure, "reason": reason})

    def save(self, title: str, notes: Sequence[str]) -> dict[str, Any]:
        doc = {"model": title, "written": self.written, "skipped": self.skipped, "notes": list(notes)}
        atomic_write_text(self.out / "index.json", json.dumps(doc, indent=2) + "\n")
        lines = [f"# Inspection of {title}", "", "| file | figure | what it shows |", "|---|---|---|"]
        lines += [f"| [{w['file']}]({w['file']}) | {w['figure']} | {w['description']} |" for w in self.written]
        if self.skipped:
            lines += ["", "## Not drawn", ""] + [f"- **{s['figure']}**: {s['reason']}" for s in self.skipped]
        if notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
        atomic_write_text(self.out / "index.md", "\n".join(lines) + "\n")
        return doc


def write_inspection(
    model: nn.Module,
    out_dir: str | Path,
    images: Sequence[InspectionImage] = (),
    class_names: Sequence[str] | None = None,
    distance_inputs: torch.Tensor | None = None,
    num_components: int = 28,
    notes: Sequence[str] = (),
    force: bool = False,
) -> dict[str, Any]:
    """Write the inspection figures of a ViT into out_dir, plus index.md / index.json; returns the index, with
    ``removed``: the earlier inspection's figures it does not list (deleted). The attention distance is averaged
    over ``distance_inputs`` (B, C, H, W) when given, else ``images``. An earlier inspection needs ``force``."""
    if not isinstance(model, VisionTransformer):
        raise UserError(f"inspect: needs a VisionTransformer, got {type(model).__name__} (no attention to show)")
    check_output_dir(out_dir, force)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index, title = _Index(out), describe(model)  # the figures run the model in eval mode (record_attention)
    _draw_embeddings(model, index, num_components)
    if images:
        inputs = torch.stack([im.input for im in images])  # (B, C, H, W)
        _draw_distance(model, index, title, inputs if distance_inputs is None else distance_inputs)
        for i, im in enumerate(images):
            _draw_image(model, index, i, im, class_names)
    else:
        index.skip("attention distance, rollout and attention maps", "no images given")
    doc = index.save(title, notes)
    # the new index is saved: what an earlier one listed and this one does not goes
    kept = {w["file"] for w in doc["written"]} | set(INDEX_FILES)
    removed = [p for p in earlier_outputs(out) if p.name not in kept]
    for p in removed:
        p.unlink()
    return {**doc, "removed": [p.name for p in removed]}


def inspect_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    files: Sequence[str] = (),
    *,
    labels: str | Path | None = None,
    data: str | None = None,
    data_overrides: Sequence[str] = (),
    num_images: int = 4,
    distance_images: int = 128,
    force: bool = False,
    **model_overrides: Any,
) -> dict[str, Any]:
    """``vitkit inspect``: write_inspection for a checkpoint (any format, ``model_overrides`` changing its config). The
    images explained are ``files``, else ``num_images`` held-out images of the checkpoint's data
    (run_eval.checkpoint_data), ``distance_images`` of them for the attention distance. Returns the index, with
    ``unread`` (files that could not be read) and ``without_images`` (why no image was explained, or None)."""
    from ..data import build_datasets
    from ..predict import load_for_inference, read_labels
    from ..train.run_eval import NO_DATA, checkpoint_data, records_data

    check_output_dir(out_dir, force)  # before the model is loaded and the figures drawn
    model, prep, metadata = load_for_inference(checkpoint, **model_overrides)
    names = read_labels(labels) if labels else prep.class_names
    images: list[InspectionImage] = []
    unread: list[str] = []
    notes: list[str] = []
    without, distance_inputs = None, None
    if files:
        images, unread = images_from_files(files, prep)
        notes += [f"not read: {err}" for err in unread]
    elif data is None and not data_overrides and not records_data(checkpoint, metadata):
        without = f"no images given, and {NO_DATA}"  # the figures that need no image, alone
        notes.append(without)
    else:  # the checkpoint's data: data that cannot be read is an error, not a smaller report
        cfg = checkpoint_data(checkpoint, metadata, prep, data, data_overrides)
        _, eval_set, info = build_datasets(cfg)
        sample = images_from_dataset(eval_set, prep, max(num_images, distance_images), names or info.class_names)
        images, distance_inputs = sample[:num_images], torch.stack([im.input for im in sample])
        notes.append(f"images: evaluation images of the {cfg.source} data ({len(sample)} for the distance)")
    index = write_inspection(model, out_dir, images, names, distance_inputs, notes=notes, force=force)
    return {**index, "unread": unread, "without_images": without}


def _draw_distance(model: VisionTransformer, index: _Index, title: str, sample: torch.Tensor) -> None:
    """Fig 7 right / Fig 11: the mean attention distance per head and layer over the sample (B, C, H, W), of the
    layers whose patch queries are trained."""
    untrained = untrained_layers(model)
    if len(untrained) == len(model.blocks):
        index.skip("mean attention distance (Fig 7 right)", "its one layer's patch queries feed no output")
        return
    dist = attention_distance(model, sample.to(next(model.parameters()).device))  # (L, nh)
    dist[untrained] = np.nan  # drawn as no dots
    uniform = float(token_distances(model.grid, model.config.stride).mean())
    left_out = f"; layer {untrained[0] + 1} left out (its patch queries feed no output)" if untrained else ""
    path = figures.plot_attention_distance(
        dist,
        index.out / "attention_distance.png",
        title="Mean attention distance",
        reference=uniform,
        subtitle=f"{title}; averaged over {len(sample)} image(s){left_out}",
    )
    what = f"mean attention distance (pixels) per head and layer, {len(sample)} images{left_out}"
    index.add(path, "Fig 7 right / Fig 11", what)


def _draw_embeddings(model: VisionTransformer, index: _Index, num_components: int) -> None:
    """Fig 7 left and centre, each skipped with the reason for a model that has no such embedding."""
    out = index.out
    try:
        comps, explained = patch_filter_components(model, num_components)
        path = figures.plot_patch_components(comps.numpy(), explained.numpy(), out / "patch_embedding_pca.png")
        index.add(path, "Fig 7 left", f"first {len(comps)} principal components of the patch-embedding filters")
    except UserError as e:  # a model without pixel patches (a hybrid)
        index.skip("patch-embedding principal components (Fig 7 left)", str(e))
    try:
        sim = position_similarity(position_embedding_grid(model))
        title = f"Position embedding similarity ({model.config.pos_embed}, {sim.shape[0]}x{sim.shape[1]} patches)"
        path = figures.plot_position_similarity(sim.numpy(), out / "position_embedding_similarity.png", title=title)
        index.add(path, "Fig 7 centre", "cosine similarity of each patch's position embedding with all others")
    except UserError as e:  # a model without a position embedding
        index.skip("position-embedding similarity (Fig 7 centre)", str(e))


def _draw_image(
    model: VisionTransformer, index: _Index, i: int, im: InspectionImage, names: Sequence[str] | None
) -> None:
    """Fig 6 (the attention rollout) and the attention maps of every layer and head for image i."""
    out, x = index.out, im.input[None].to(next(model.parameters()).device)  # (1, C, H, W)
    what = {
        "token": "class token's attention over the patches",
        "map": "attention of the tokens the MAP head reads, weighted by its probe's attention",
        "first": "first token's attention over the patches",
    }.get(model.config.classifier, "mean attention of all patches")
    rec = record_attention(model, x)
    display = np.asarray(im.display, dtype=np.float64)
    heat = upsample_map(rollout_map(rec), display.shape[:2])[0].cpu().numpy()  # (H, W)
    probs = rec.logits.float().softmax(-1)[0]
    k = int(probs.argmax())
    guess = names[k] if names and k < len(names) else str(k)
    caption = f"{im.name}: predicted {guess} ({100 * float(probs[k]):.1f}%)"
    caption += f", true {im.label}" if im.label is not None else ""
    stem = f"{i:02d}_{_slug(im.name)}"
    path = figures.plot_rollout(display, heat, out / f"rollout_{stem}.png", title=caption)
    index.add(path, "Fig 6", f"attention rollout for {im.name}")
    maps = query_attention(rec)[:, 0].cpu().numpy()  # (L, nh, gh, gw)
    path = figures.plot_attention_maps(
        maps, out / f"attention_{stem}.png", title=f"Attention maps: {caption}", what=what
    )
    index.add(path, "attention maps", f"{what}, every layer and head, for {im.name}")
    probe = probe_attention(rec)
    if probe is not None:  # the attention that decides what a MAP head pools: one row, one map per head
        path = figures.plot_attention_maps(
            probe[:1].cpu().numpy(),
            out / f"map_attention_{stem}.png",
            title=f"MAP head attention: {caption}",
            what="the MAP head probe's attention over the patches, per head",
        )
        index.add(path, "MAP head attention", f"the MAP probe's attention over the patches for {im.name}")
