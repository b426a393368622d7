"""Measurements of a cell's trained model beyond its training metrics, each written once to a JSON file in the
run directory, so that aggregation reads them like the run's own metrics.

    probes: {fewshot: {data: digits, overrides: [data.in_chans=3], shots: [5, 10]}, attention: {images: 256}, parts: {}}

- ``fewshot`` (paper sec 4.1): few-shot linear accuracy of the frozen model on another dataset, in the
  ``fewshot.json`` that ``vitkit fewshot`` writes; metrics ``fewshot.<k>shot``, the mean over its seeds.
- ``attention`` (paper fig. 7): the mean attention distance (over patch queries) of every layer and head over the
  first ``images`` held-out images, and the position embeddings' similarity, in ``attention.json``; metrics
  ``attention.layer<i>`` (averaged over heads), ``attention.spread<i>`` (farthest head minus nearest),
  ``attention.local<i>`` (the share of its heads under LOCAL x uniform attention's distance) and ``attention.rise``
  (last measured layer minus the first), blank for a model without attention and for a layer whose patch queries are
  untrained (inspect.attention.untrained_layers: a class-token model's last; null in the file).
- ``parts``: accuracy on each factor of the label (data.procedural.LABEL_PARTS: the shapes' shape and side) and
  top-1, over the first ``images`` held-out images (default all), in ``parts.json``; metrics ``parts.<factor>``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..data.procedural import LABEL_PARTS
from ..errors import UserError
from ..io import atomic_write_text
from ..train.overrides import value_text

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.figure import Figure

ATTENTION_FIGURE = "attention_distance.png"  # write_attention_figures' figure of the whole sweep
PROBE_KEYS = ("fewshot", "attention", "parts")
FEWSHOT_FILE, ATTENTION_FILE, PARTS_FILE = "fewshot.json", "attention.json", "parts.json"
ATTENTION_METRICS = re.compile(r"(layer|spread|local)(\d+)|rise")  # the names after "attention." (_attention_metric)
# A local head: its mean distance under this share of uniform attention's. The paper's lowest layers (fig. 7) hold
# heads at a small fraction of the image beside heads across it; training alone moves every head a little off
# uniform, which is not that. On 8x8 tokens a head spread evenly over the 5x5 tokens around its query sits at 0.42
# of uniform, over the 7x7 at 0.58.
LOCAL = 0.5
FILES = {"fewshot": FEWSHOT_FILE, "attention": ATTENTION_FILE, "parts": PARTS_FILE}
FEWSHOT_KEYS = {"data", "overrides", "shots", "seeds"}


@dataclass(frozen=True)
class Probes:
    """What to measure after a cell's first run (nothing by default)."""

    fewshot_data: str | None = None  # a source or config for checkpoint_data's --data
    fewshot_overrides: tuple[str, ...] = ()
    fewshot_shots: tuple[int, ...] = (5, 10)
    fewshot_seeds: int = 3
    attention_images: int = 0  # 0: no attention probe
    parts: bool = False
    parts_images: int = 0  # 0: every held-out image

    @property
    def files(self) -> list[str]:
        wanted = (bool(self.fewshot_data), bool(self.attention_images), self.parts)
        return [name for name, want in zip(FILES.values(), wanted) if want]

    def done(self, run_dir: Path) -> bool:
        return all((run_dir / name).is_file() for name in self.files)

    def metrics(self, kind: str = "") -> list[str]:
        """Every metric name these probes can give (``attention.layer<i>`` for any i aside), of ``kind`` if given."""
        names = [f"fewshot.{k}shot" for k in self.fewshot_shots] * bool(self.fewshot_data)
        names += [f"parts.{name}" for name in LABEL_PARTS] * self.parts
        return [m for m in names if m.startswith(f"{kind}.") or not kind]


def parse_probes(doc: Any, where: str) -> Probes:
    if doc is None:
        return Probes()
    if not isinstance(doc, dict) or set(doc) - set(PROBE_KEYS):
        raise UserError(f"{where}: expected a mapping with some of {', '.join(PROBE_KEYS)}, got {doc!r}")
    kwargs: dict[str, Any] = {}
    fs = doc.get("fewshot")
    if fs is not None:
        if not isinstance(fs, dict) or not isinstance(fs.get("data"), str) or set(fs) - FEWSHOT_KEYS:
            raise UserError(
                f"{where}.fewshot: expected {{data: SOURCE, overrides: [...], shots: [...], seeds: N}}, got {fs!r}"
            )
        shots = fs.get("shots", [5, 10])
        if not isinstance(shots, list) or not shots or not all(isinstance(k, int) and k > 0 for k in shots):
            raise UserError(f"{where}.fewshot.shots: expected a list of positive integers, got {shots!r}")
        overrides = fs.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise UserError(f"{where}.fewshot.overrides: expected a list of data.key=value strings, got {overrides!r}")
        seeds = fs.get("seeds", 3)
        if not isinstance(seeds, int) or seeds < 1:
            raise UserError(f"{where}.fewshot.seeds: expected a positive number of subsets, got {seeds!r}")
        kwargs.update(fewshot_data=fs["data"], fewshot_overrides=tuple(overrides), fewshot_shots=tuple(shots))
        kwargs["fewshot_seeds"] = seeds
    att = doc.get("attention")
    if att is not None:
        images = att.get("images") if isinstance(att, dict) else None
        if not isinstance(images, int) or images < 1 or set(att) - {"images"}:
            raise UserError(f"{where}.attention: expected {{images: N}} with N > 0, got {att!r}")
        kwargs["attention_images"] = images
    if "parts" in doc:
        parts = doc["parts"]
        images = parts.get("images", 0) if isinstance(parts, dict) else None  # 0: all
        if not isinstance(images, int) or (images < 1 and "images" in parts) or set(parts) - {"images"}:
            raise UserError(f"{where}.parts: expected {{}} or {{images: N}} with N > 0, got {parts!r}")
        kwargs.update(parts=True, parts_images=images)
    return Probes(**kwargs)


def run_probes(probes: Probes, run_dir: Path) -> None:
    """Write each probe's file that is missing in ``run_dir`` (a finished run)."""
    if probes.done(run_dir):
        return
    from ..data import build_datasets
    from ..predict import load_for_inference
    from ..train.run_eval import checkpoint_data

    model, prep, metadata = load_for_inference(run_dir)
    if probes.fewshot_data and not (run_dir / FEWSHOT_FILE).is_file():
        from ..evaluate import fewshot

        cfg = checkpoint_data(run_dir, metadata, prep, probes.fewshot_data, probes.fewshot_overrides)
        train, test, info = build_datasets(cfg)
        result = fewshot(model, train, test, probes.fewshot_shots, probes.fewshot_seeds, num_classes=info.num_classes)
        doc = result.record(str(run_dir), cfg.to_dict())
        atomic_write_text(run_dir / FEWSHOT_FILE, json.dumps(doc, indent=2) + "\n")
    missing = [name for name in (ATTENTION_FILE, PARTS_FILE) if name in probes.files and not (run_dir / name).is_file()]
    if not missing:
        return
    _, held_out, _ = build_datasets(checkpoint_data(run_dir, metadata, prep))  # the run's own held-out split
    if ATTENTION_FILE in missing:
        doc = attention_record(model, held_out, probes.attention_images)
        atomic_write_text(run_dir / ATTENTION_FILE, json.dumps(doc) + "\n")
    if PARTS_FILE in missing:
        doc = label_part_accuracy(model, held_out, probes.parts_images)
        atomic_write_text(run_dir / PARTS_FILE, json.dumps(doc, indent=2) + "\n")


def attention_record(model: nn.Module, held_out: Dataset, max_images: int) -> dict:
    """``attention.json``'s content for model over the first ``max_images`` of held_out (see the module docstring)."""
    from ..inspect.attention import attention_distance, token_distances, untrained_layers
    from ..inspect.embeddings import position_embedding_grid, position_similarity
    from ..models.vit import VisionTransformer

    if not isinstance(model, VisionTransformer):
        return {"skipped": f"{type(model).__name__} has no attention"}
    n = min(max_images, len(held_out))  # type: ignore[arg-type]  # vitkit's datasets are sized
    images = torch.stack([held_out[i][0] for i in range(n)])
    distance = attention_distance(model, images).tolist()  # (L, nh)
    untrained = untrained_layers(model)
    uniform = token_distances(model.grid, model.config.stride).mean()  # every patch attended alike
    doc: dict[str, Any] = {
        "images": n,
        "distance": [None if i in untrained else row for i, row in enumerate(distance)],  # None: not measured
        "untrained_layers": untrained,
        "uniform": float(uniform),
    }
    if model.config.pos_embed != "none" and model.config.pos_embed != "relative":
        doc["position_similarity"] = position_similarity(position_embedding_grid(model)).tolist()
    return doc


def label_part_accuracy(model: nn.Module, data: Dataset, max_images: int = 0, batch_size: int = 64) -> dict[str, Any]:
    """Top-1 and the accuracy on each factor of the label (``data.label_parts``: name -> function of labels) over
    the first ``max_images`` of data (0: all): a prediction gets a factor right when its factor is the label's."""
    from ..evaluate.loop import batches, evaluating

    parts = getattr(data, "label_parts", None)
    if not parts:
        raise UserError(f"probes.parts: the labels of {type(data).__name__} do not factor (the shapes' do)")
    n = min(max_images or len(data), len(data))  # type: ignore[arg-type]  # vitkit's datasets are sized
    predicted, labels = [], []
    with evaluating(model), torch.inference_mode():
        for x, y in batches(Subset(data, range(n)), batch_size):
            predicted.append(model(x).argmax(dim=-1))
            labels.append(y)
    pred, true = torch.cat(predicted), torch.cat(labels)
    right = {"top1": pred == true, **{name: part(pred) == part(true) for name, part in parts.items()}}
    classes = torch.arange(len(data.class_names))  # type: ignore[attr-defined]  # a factored set names its classes
    values = {name: len(part(classes).unique()) for name, part in parts.items()}  # where guessing lands: 1 / values
    return {"images": n, "accuracy": {name: r.double().mean().item() for name, r in right.items()}, "values": values}


def probe_metric(run_dir: Path, metric: str) -> float | None:
    """A probe's metric from the run's probe file (None: no attention, or a layer not measured)."""
    kind, _, name = metric.partition(".")
    path = run_dir / FILES[kind]
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"metrics: {metric!r} needs {path}, which the sweep's probes write (rerun the sweep)") from None
    if kind == "fewshot":
        shots = name.removesuffix("shot")
        if shots not in doc.get("results", {}):
            raise UserError(f"metrics: {metric!r}: {path} has shots {sorted(doc.get('results', {}))}")
        return float(doc["results"][shots]["mean"])
    if kind == "parts":
        if name not in doc["accuracy"]:
            raise UserError(f"metrics: {metric!r}: {path} has {sorted(doc['accuracy'])}")
        return float(doc["accuracy"][name])
    return None if "skipped" in doc else _attention_metric(doc, name, f"metrics: {metric!r}: {path}")


def _attention_metric(doc: dict[str, Any], name: str, where: str) -> float | None:
    """``layer<i>``: layer i's mean over heads; ``spread<i>``: its farthest head's distance minus its nearest's;
    ``local<i>``: the share of its heads nearer than LOCAL x uniform; ``rise``: the last measured layer's mean minus
    the first's (None: a layer not measured, or fewer than two)."""
    distance: list[list[float] | None] = doc["distance"]
    if name == "rise":
        measured = [sum(row) / len(row) for row in distance if row is not None]
        return measured[-1] - measured[0] if len(measured) > 1 else None
    found = ATTENTION_METRICS.fullmatch(name)
    assert found is not None  # spec._check_metrics allows no other name
    kind, index = found[1], int(found[2])
    if index >= len(distance):
        raise UserError(f"{where} has {len(distance)} layers (0 to {len(distance) - 1})")
    row = distance[index]
    if row is None:
        return None
    if kind == "local":
        if "uniform" not in doc:  # written before the probe recorded it: delete the file and rerun the sweep
            raise UserError(f"{where} has no uniform attention distance; delete it and rerun the sweep")
        return sum(d < LOCAL * doc["uniform"] for d in row) / len(row)
    return sum(row) / len(row) if kind == "layer" else max(row) - min(row)


def is_probe_metric(metric: str) -> bool:
    return metric.partition(".")[0] in PROBE_KEYS


def write_attention_figures(name: str, groups: list[tuple[str, dict[str, Any], list[Path]]], out: Path) -> list[Path]:
    """The paper's fig. 7 for a sweep's groups (name, axis values, run directories): ``attention_distance.png``
    (attention_figure's) and per group with a position table ``position_similarity_<group>.png``."""
    from ..inspect.figures import plot_position_similarity
    from ..train.metrics import save_figure

    found = measured_groups(groups)
    if not found:
        return []
    paths = []
    for label, short, docs in found:
        if "position_similarity" in docs[0]:
            sim = torch.tensor(docs[0]["position_similarity"]).numpy()
            title = f"{name}: {short}, first seed"
            paths.append(plot_position_similarity(sim, out / f"position_similarity_{label}.png", title))
    return [save_figure(attention_figure(name, found), out / ATTENTION_FIGURE), *paths]


Measured = list[tuple[str, str, list[dict[str, Any]]]]  # (label, its short form, its runs' probe files)


def measured_groups(groups: list[tuple[str, dict[str, Any], list[Path]]]) -> Measured:
    """The groups with an attention probe file that measured a layer, each with those files read and a short label:
    the axes that differ between them (``differing``), or its label when it is alone."""
    found = []
    for label, axes, run_dirs in groups:
        docs = [json.loads(p.read_text()) for d in run_dirs if (p := d / ATTENTION_FILE).is_file()]
        docs = [d for d in docs if any(row is not None for row in d.get("distance", []))]
        if docs:
            found.append((label, axes, docs))
    shorts = differing([axes for _, axes, _ in found]) if len(found) > 1 else [label for label, _, _ in found]
    return [(label, short, docs) for (label, _, docs), short in zip(found, shorts)]


def attention_figure(name: str, found: Measured) -> Figure:
    """Mean attention distance against depth: a line per group (the mean over its heads and seeds), a dot per head
    and seed, uniform attention's distance dashed. The depth axis ends at the deepest layer measured."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    for k, (_, short, docs) in enumerate(found):
        heads = len(next(row for row in docs[0]["distance"] if row is not None))
        dist = torch.tensor([[row or [math.nan] * heads for row in d["distance"]] for d in docs])  # (seeds, L, nh)
        depth = torch.arange(1, dist.shape[1] + 1).float()  # a layer not measured (NaN) has no dot and ends the line
        colour = f"C{k % 10}"
        jitter = (k - (len(found) - 1) / 2) * 0.06
        for s in range(dist.shape[0]):
            for h in range(dist.shape[2]):
                ax.scatter(depth + jitter, dist[s, :, h], s=6, color=colour, alpha=0.35, linewidths=0)
        ax.plot(depth + jitter, dist.mean(dim=(0, 2)), marker="o", color=colour, label=f"{short} (n={len(docs)})")
    runs = [d for _, _, docs in found for d in docs]
    uniform = {float(d["uniform"]) for d in runs if d.get("uniform") is not None}
    if len(uniform) == 1:  # one grid for all: the distance of attention spread evenly over it
        (even,) = uniform
        ax.axhline(even, color="0.5", linestyle="--", linewidth=1, label="uniform attention")
        ax.axhline(LOCAL * even, color="0.5", linestyle=":", linewidth=1, label="half of uniform: local heads below")
    layers = max(i + 1 for d in runs for i, row in enumerate(d["distance"]) if row is not None)
    ax.set_xticks(range(1, layers + 1))  # whole layers, and none past the deepest measured
    ax.set_xlim(0.5, layers + 0.5)
    top = max([v for d in runs for row in d["distance"] if row is not None for v in row] + list(uniform))
    ax.set_ylim(0, 1.1 * top)  # from zero (a zoomed axis makes near-uniform heads look spread out), room above
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    untrained = "; untrained layers left out" if any(d.get("untrained_layers") for d in runs) else ""
    what = f"(dots: every head of every seed; line: their mean{untrained})"
    ax.set_title(f"{name}: mean attention distance\n{what}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def differing(values: list[dict[str, Any]]) -> list[str]:
    """``key=value, ...`` of the axes whose values differ between the groups (the last part of each key; a key a
    group lacks left out of its label)."""
    keys = [k for k in dict.fromkeys(k for v in values for k in v) if len({value_text(v.get(k)) for v in values}) > 1]
    return [", ".join(f"{k.rsplit('.', 1)[-1]}={value_text(v[k])}" for k in keys if k in v) for v in values]
