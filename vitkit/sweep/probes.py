"""Measurements of a cell's trained model beyond its training metrics, each written once to a JSON file in the
run directory, so that aggregation reads them like the run's own metrics.

    probes:
      fewshot: {data: digits, overrides: [data.in_chans=3], shots: [5, 10], seeds: 3}
      attention: {images: 256}

- ``fewshot`` (paper sec 4.1): few-shot linear accuracy of the frozen model on another dataset, in the
  ``fewshot.json`` that ``vitkit fewshot`` writes; metrics ``fewshot.<k>shot``, the mean over its seeds.
- ``attention`` (paper fig. 7): the mean attention distance of every layer and head over the first ``images``
  held-out images, and the position embeddings' similarity, in ``attention.json``; metrics ``attention.layer<i>``,
  averaged over heads (blank for a model without attention).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..io import atomic_write_text
from ..train.overrides import value_text

PROBE_KEYS = ("fewshot", "attention")
FEWSHOT_FILE, ATTENTION_FILE = "fewshot.json", "attention.json"
FEWSHOT_KEYS = {"data", "overrides", "shots", "seeds"}


@dataclass(frozen=True)
class Probes:
    """What to measure after a cell's first run (nothing by default)."""

    fewshot_data: str | None = None  # a source or config for checkpoint_data's --data
    fewshot_overrides: tuple[str, ...] = ()
    fewshot_shots: tuple[int, ...] = (5, 10)
    fewshot_seeds: int = 3
    attention_images: int = 0  # 0: no attention probe

    @property
    def files(self) -> list[str]:
        return [FEWSHOT_FILE] * bool(self.fewshot_data) + [ATTENTION_FILE] * bool(self.attention_images)

    def done(self, run_dir: Path) -> bool:
        return all((run_dir / name).is_file() for name in self.files)

    def metrics(self) -> list[str]:
        """Every metric name these probes can give (``attention.layer<i>`` for any i)."""
        return [f"fewshot.{k}shot" for k in self.fewshot_shots] * bool(self.fewshot_data)


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
    if probes.attention_images and not (run_dir / ATTENTION_FILE).is_file():
        doc = _attention(model, run_dir, metadata, prep, probes)
        atomic_write_text(run_dir / ATTENTION_FILE, json.dumps(doc) + "\n")


def _attention(model: torch.nn.Module, run_dir: Path, metadata: dict[str, Any], prep: Any, probes: Probes) -> dict:
    from ..data import build_datasets
    from ..inspect.attention import attention_distance, token_distances
    from ..inspect.embeddings import position_embedding_grid, position_similarity
    from ..models.vit import VisionTransformer
    from ..train.run_eval import checkpoint_data

    if not isinstance(model, VisionTransformer):
        return {"skipped": f"{type(model).__name__} has no attention"}
    _, held_out, _ = build_datasets(checkpoint_data(run_dir, metadata, prep))
    n = min(probes.attention_images, len(held_out))  # type: ignore[arg-type]  # vitkit's datasets are sized
    images = torch.stack([held_out[i][0] for i in range(n)])
    distance = attention_distance(model, images)  # (L, nh)
    uniform = token_distances(model.grid, model.config.stride).mean()  # every patch attended alike
    doc: dict[str, Any] = {"images": n, "distance": distance.tolist(), "uniform": float(uniform)}
    if model.config.pos_embed != "none" and model.config.pos_embed != "relative":
        doc["position_similarity"] = position_similarity(position_embedding_grid(model)).tolist()
    return doc


def probe_metric(run_dir: Path, metric: str) -> float | None:
    """A ``fewshot.<k>shot`` or ``attention.layer<i>`` metric from the run's probe file (None: no attention)."""
    kind, _, name = metric.partition(".")
    path = run_dir / (FEWSHOT_FILE if kind == "fewshot" else ATTENTION_FILE)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"metrics: {metric!r} needs {path}, which the sweep's probes write (rerun the sweep)") from None
    if kind == "fewshot":
        shots = name.removesuffix("shot")
        if shots not in doc.get("results", {}):
            raise UserError(f"metrics: {metric!r}: {path} has shots {sorted(doc.get('results', {}))}")
        return float(doc["results"][shots]["mean"])
    if "skipped" in doc:
        return None
    layer = int(name.removeprefix("layer"))
    row = doc["distance"][layer]
    return float(sum(row) / len(row))


def is_probe_metric(metric: str) -> bool:
    return metric.partition(".")[0] in PROBE_KEYS


def write_attention_figures(name: str, groups: list[tuple[str, dict[str, Any], list[Path]]], out: Path) -> list[Path]:
    """The paper's fig. 7 for a sweep's groups (name, axis values, run directories): ``attention_distance.png`` (a
    line per group, dots per head and seed) and per group with a position table ``position_similarity_<group>.png``."""
    from matplotlib.figure import Figure

    from ..inspect.figures import plot_position_similarity
    from ..train.metrics import save_figure

    found, values = [], []
    for label, axes, run_dirs in groups:
        docs = [json.loads(p.read_text()) for d in run_dirs if (p := d / ATTENTION_FILE).is_file()]
        docs = [d for d in docs if "distance" in d]
        if docs:
            found.append((label, docs))
            values.append(axes)
    if not found:
        return []
    labels = _differing(values) if len(found) > 1 else [label for label, _ in found]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    paths = []
    for k, ((label, docs), short) in enumerate(zip(found, labels)):
        dist = torch.tensor([d["distance"] for d in docs])  # (seeds, L, nh)
        depth = torch.arange(1, dist.shape[1] + 1).float()
        colour = f"C{k % 10}"
        jitter = (k - (len(found) - 1) / 2) * 0.06
        for s in range(dist.shape[0]):
            for h in range(dist.shape[2]):
                ax.scatter(depth + jitter, dist[s, :, h], s=6, color=colour, alpha=0.35, linewidths=0)
        ax.plot(depth + jitter, dist.mean(dim=(0, 2)), marker="o", color=colour, label=f"{short} (n={len(docs)})")
        if "position_similarity" in docs[0]:
            sim = torch.tensor(docs[0]["position_similarity"]).numpy()
            title = f"{name}: {short}, first seed"
            paths.append(plot_position_similarity(sim, out / f"position_similarity_{label}.png", title))
    uniform = {d.get("uniform") for _, docs in found for d in docs} - {None}
    if len(uniform) == 1:  # one grid for all: the distance of attention spread evenly over it
        ax.axhline(uniform.pop(), color="0.5", linestyle="--", linewidth=1, label="uniform attention")
    ax.set_xticks(range(1, int(depth[-1]) + 1))  # layers are whole numbers
    ax.set_ylim(bottom=0)  # distances from zero: a zoomed axis makes near-uniform heads look spread out
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_title(f"{name}: mean attention distance\n(dots: every head of every seed; line: their mean)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return [save_figure(fig, out / "attention_distance.png"), *paths]


def _differing(values: list[dict[str, Any]]) -> list[str]:
    """``key=value, ...`` of the axes whose values differ between the groups (the last part of each key)."""
    keys = [k for k in values[0] if len({value_text(v.get(k)) for v in values}) > 1]
    return [", ".join(f"{k.rsplit('.', 1)[-1]}={value_text(v.get(k))}" for k in keys) for v in values]
