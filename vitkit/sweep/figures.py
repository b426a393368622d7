"""A sweep's figures: one per metric, the metric against the spec's figure.x, a line per value of figure.lines.

A legend says what a line's model is (family, parameters, FLOPs an image) where a line holds one model; an accuracy
is drawn on its whole scale with a dashed line where guessing lands (chance); a row without the x (a baseline cell,
such as ``pretrain: untrained``) is a dotted horizontal line across a numeric axis, or a point of its own on a
categorical one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..checkpoint.base import CONFIG_NAME, read_config_json
from ..models import count_params
from ..models.flops import model_flops
from ..train.metrics import MetricsLog, save_figure
from ..train.overrides import value_text
from .aggregate import Row, meta_model
from .probes import ATTENTION_METRICS, FEWSHOT_FILE, PARTS_FILE, differing
from .spec import CELL_DEFAULTS, COMPUTE, FINETUNE, Cell, SweepSpec, finetune_name

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.figure import Figure


def figure_name(metric: str) -> str:
    """The file write_figures draws a metric into."""
    return f"{metric.replace('.', '_')}.png"


@dataclass(frozen=True)
class ModelSummary:
    """What a run's model is, as a legend says it: its family, its parameters and its forward FLOPs an image."""

    family: str
    params: int
    flops: int

    def sizes(self) -> tuple[str, str]:
        """Its parameters and FLOPs an image as a figure writes them: ("139k", "4.87 MFLOPs")."""
        return "".join(_si(self.params)), f"{' '.join(_si(self.flops))}FLOPs"

    def __str__(self) -> str:
        params, flops = self.sizes()
        return f"{self.family} {params} params, {flops}"  # ViT 139k params, 4.87 MFLOPs


FAMILIES = {"vit": "ViT", "hybrid": "hybrid (ResNet+ViT)", "resnet": "ResNet", "bit": "ResNet (BiT)"}
SAID_BY_SUMMARY = ("model.name", "model.resnet_layers")  # a registered name the spec overrides; the family says it
# the model keys a summary's family, parameters and FLOPs stand for in a curve's label (not, say, its pos_embed)
SAID_BY_SIZE = (*SAID_BY_SUMMARY, *(f"model.{k}" for k in ("patch_size", "width", "depth", "num_heads", "mlp_dim",
                "layers", "width_factor", "resnet_width")))  # fmt: skip


Describe = Callable[[Path], "ModelSummary"]  # model_summary, cached for a sweep's figures


def model_summary(run_dir: Path) -> ModelSummary:
    """A finished run's model as built from its config.json (on the meta device): family, parameters, FLOPs."""
    model, meta = meta_model(run_dir)
    config: Any = model.config  # a ViTConfig, ResNetConfig or BiTConfig
    arch = "hybrid" if getattr(config, "resnet_layers", None) is not None else config.arch  # a ViT on a ResNet stem
    return ModelSummary(FAMILIES.get(arch, arch), count_params(model), model_flops(model, int(meta["img_size"])))


def write_figures(spec: SweepSpec, rows: list[Row], out: Path) -> list[Path]:
    """OUT/<metric>.png per metric (metric_figure); each run a legend describes is built once for all of them."""
    if not (spec.figure_x or spec.axes) or not any(r.n for r in rows):
        return []
    describe = functools.cache(model_summary)
    paths = [save_figure(metric_figure(spec, rows, m, out, describe), out / figure_name(m)) for m in spec.metrics]
    curves = curves_figure(spec, rows, out, describe=describe)
    return paths + ([save_figure(curves, out / CURVES_NAME)] if curves is not None else [])


CURVES_NAME = "curves_eval_top1.png"


def curves_figure(
    spec: SweepSpec, rows: list[Row], out: Path, metric: str = "eval_top1", describe: Describe | None = None
) -> Figure | None:
    """The held-out metric against the training step, a line per row: the mean over its seeds at the steps every
    seed evaluated (the runs' metrics.jsonl), labelled by the values that differ between rows (with ``describe``,
    a row's model keys by what its model is: ModelSummary), and each seed's own curve thin in the row's colour
    (not in the legend); None where no run was evaluated more than once."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    drawn = 0
    models = len({tuple((k, v) for k, v in r.values.items() if k.startswith("model.")) for r in rows}) > 1
    shown = [{k: v for k, v in r.values.items() if not (describe and k in SAID_BY_SIZE)} for r in rows]
    for r, label in zip(rows, differing(shown) if len(rows) > 1 else [spec.name]):
        runs = [out / c.name for c in spec.expand() if c.group == tuple(r.values.items()) and c.seed in r.seeds]
        curves = [{e["step"]: e[metric] for e in MetricsLog(d).records() if metric in e} for d in runs]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if describe and models and runs:
            label = ", ".join([str(describe(runs[0])), *([label] if label else [])])
        if len(steps) > 1:
            (mean,) = ax.plot(steps, [sum(c[s] for c in curves) / len(curves) for s in steps], marker=".", label=label)
            for c in curves if len(curves) > 1 else []:  # each seed, thin: a jump in one seed is not averaged away
                ax.plot(sorted(c), [c[s] for s in sorted(c)], color=mean.get_color(), alpha=0.35, lw=0.8, label="_seed")
            drawn += 1
    if not drawn:
        return None
    ax.set_ylim(0, 1)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{axis_label(metric, named=False)}\n(mean over seeds; thin: each seed)")
    ax.set_title(f"{spec.name}: held-out accuracy during training", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return fig


def metric_figure(
    spec: SweepSpec, rows: list[Row], metric: str, out: Path, describe: Callable[[Path], ModelSummary] = model_summary
) -> Figure:
    """The metric against figure.x, one line per value of figure.lines (labelled by line_label), each point the mean
    ± std over seeds with every seed's value a dot; an accuracy on its whole scale, with a dashed line where
    guessing lands (chance)."""
    from matplotlib.figure import Figure

    x_key = spec.figure_x or spec.axes[-1]
    line_keys = spec.figure_lines or [k for k in spec.axes if k != x_key]

    def x_of(r: Row) -> Any:
        return r.mean.get(COMPUTE) if x_key == COMPUTE else r.values.get(x_key)

    xs = list(dict.fromkeys(x_of(r) for r in rows if x_key != COMPUTE or r.n))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs if x is not None)
    xs = [x for x in xs if x is not None] if numeric else xs  # rows without x on a numeric axis: baselines
    cells = spec.expand()
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    lines: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        lines.setdefault(tuple(value_text(r.values.get(k)) for k in line_keys), []).append(r)
    for members in lines.values():
        members = [r for r in members if r.mean[metric] is not None]
        if not members:
            continue
        baselines = [r for r in members if numeric and x_of(r) is None]
        members = [r for r in members if r not in baselines] or baselines
        points = [(x_of(r), cast(float, r.mean[metric]), r.std[metric] or 0.0) for r in members]
        # a line that nothing tells apart from others (the figure's only one) has no legend entry: the y label says it
        name = line_label(line_keys, members, metric_runs(cells, members, metric, out), describe)
        name = name or (metric if len(lines) > 1 else "")
        if members is baselines:  # a line of baselines alone: one horizontal line each
            colour = None
        else:
            pos = [float(cast(float, p[0])) if numeric else float(xs.index(p[0])) for p in points]
            style = "-" if numeric else "none"  # categories are points: no line joins them
            drawn = ax.errorbar(pos, [p[1] for p in points], yerr=[p[2] for p in points], marker="o", capsize=3,
                                label=name or "_line", linestyle=style)  # fmt: skip
            colour = drawn.lines[0].get_color()
            _seed_dots(ax, pos, [r.each.get(metric, []) for r in members], colour, 0.0 if numeric else SEED_SHIFT)
            if numeric:  # where the model changes along the line, each point says its model's size
                _label_sizes(
                    ax, pos, [p[1] for p in points], [metric_runs(cells, [r], metric, out) for r in members], describe
                )
        _baselines(ax, baselines, members, metric, colour, name)
    if not numeric:
        ax.set_xticks(range(len(xs)), [_category(x_key, x, rows) for x in xs])
    _accuracy_scale(ax, metric, metric_runs(cells, rows, metric, out))
    if numeric and spec.log_x:
        log_axis(ax, [float(x) for x in xs])
    ax.set_xlabel(axis_label(x_key))
    ax.set_ylabel(f"{axis_label(metric, named=False)}\n(mean ± std over seeds; dots: each seed)")
    ax.set_title(f"{spec.name}: {metric}")  # the metric as the table heads it
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a line, baseline or chance worth naming
        ax.legend(fontsize=8)
    return fig


# what a metric or config key on an axis measures, in words; the name as the table heads it follows in brackets
AXIS_NAMES = {
    "eval_top1": "held-out top-1",
    "eval_top5": "held-out top-5",
    "eval_loss": "held-out loss",
    COMPUTE: "training compute (FLOPs: 3 x forward x images)",
    "data.num_images": "pretraining images",
    "model.pos_embed": "position embedding",
    "run.objective": "pretraining objective",
    "parts.shape": "top-1 on the shape alone",
    "parts.side": "top-1 on the marker's side alone",
}
ATTENTION_NAMES = {  # by probes.ATTENTION_METRICS' kind; None: rise, the one without a layer
    "layer": "mean attention distance (px)",
    "spread": "farthest head minus nearest (px)",
    "local": "share of local heads",
    None: "mean attention distance, last layer minus first (px)",
}


def axis_label(name: str, named: bool = True) -> str:
    """What an axis shows, in words, and (``named``) the metric's or key's own name: ``held-out top-1 [eval_top1]``;
    a finetune metric ``... after fine-tuning``, ``<k>-shot linear top-1``, an attention metric with its layer; a
    name without words as it is."""
    stem = name.removeprefix(f"{FINETUNE}.")
    words = AXIS_NAMES.get(stem)
    if (shots := re.fullmatch(r"fewshot\.(\d+)shot", stem)) is not None:
        words = f"{shots[1]}-shot linear top-1 (frozen features)"
    elif stem.startswith("attention.") and (part := ATTENTION_METRICS.fullmatch(stem.removeprefix("attention."))):
        words = ATTENTION_NAMES[part[1]] + (f", layer {part[2]}" if part[1] else "")  # rise: no layer
    if words is None:
        return name
    words += " after fine-tuning" if stem != name else ""
    return f"{words} [{name}]" if named else words


def log_axis(ax: Any, values: list[float]) -> None:
    """The x axis on a log scale whose ticks read as numbers: at 1, 2 and 5 of each power of ten (also 1.5, 3 and 7
    where the values span under a decade), written with an SI prefix ("1k", "1.5T")."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    axis = ax.xaxis
    narrow = max(values) < 10 * min(values) if values and min(values) > 0 else False
    axis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if narrow else (1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: "".join(_si(x))))
    axis.set_minor_formatter(NullFormatter())


def _baselines(ax: Any, baselines: list[Row], members: list[Row], metric: str, colour: Any, name: str) -> None:
    """Each baseline row across the axis, in its line's colour, named by what it sets that the others do not."""
    for r in baselines:
        own = {k: v for k, v in r.values.items() if all(k not in m.values for m in members if m is not r)}
        said = ", ".join(f"{k.rsplit('.', 1)[-1]}={value_text(v)}" for k, v in own.items()) or "baseline"
        label = f"{name}: {said}" if name else said
        ax.axhline(cast(float, r.mean[metric]), color=colour, linestyle=":", linewidth=1.5, label=label)


def _accuracy_scale(ax: Any, metric: str, runs: list[Path]) -> None:
    """An accuracy on its whole scale, with a dashed line where guessing lands (chance); else nothing."""
    if not (metric.rsplit(".", 1)[-1].endswith(("top1", "top5", "acc")) or metric.startswith(("fewshot.", "parts."))):
        return
    ax.set_ylim(0, 1)
    guess = chance(runs, metric)
    if guess is not None:
        ax.axhline(guess[0], color="0.5", linestyle="--", linewidth=1, label=guess[1])


SEED_SHIFT = 0.1  # a category's seeds are dotted this far right of its mean, off its error bar


def _seed_dots(ax: Any, xs: list[float], values: list[list[float]], colour: Any, shift: float) -> None:
    """Each seed's value a dot at x + shift, in the line's colour, out of the legend: two modes (some seeds that
    learn a thing, some that do not) do not hide in one mean and its spread."""
    for x, seeds in zip(xs, values):
        ax.scatter([x + shift] * len(seeds), seeds, s=14, color=colour, alpha=0.6, linewidths=0, label="_seed")


def _label_sizes(ax: Any, xs: list[float], ys: list[float], runs: list[list[Path]], describe: Describe) -> None:
    """Each point of a line along which the model changes (sizes of one family, which the legend names) labelled
    with its own model's parameters and FLOPs an image; nothing on a line of one model."""
    models = [describe(point[0]) if point else None for point in runs]
    if len({(m.params, m.flops) for m in models if m is not None}) < 2:
        return
    for x, y, m in zip(xs, ys, models):
        if m is not None:
            ax.annotate(", ".join(m.sizes()), (x, y), xytext=(5, 5), textcoords="offset points", fontsize=7)


def metric_runs(cells: list[Cell], rows: list[Row], metric: str, out: Path) -> list[Path]:
    """The run directories the rows' metric was read from: each finished cell's first run, or its finetune run."""
    tuned = metric.startswith(f"{FINETUNE}.")
    finished = {(tuple(r.values.items()), seed) for r in rows for seed in r.seeds}  # a row's values: its cells' group
    cells = [c for c in cells if (c.group, c.seed) in finished and (tuned or c.pretrains)]
    return [out / (finetune_name(c.name) if tuned else c.name) for c in cells]


def line_label(
    line_keys: list[str], members: list[Row], runs: list[Path], describe: Callable[[Path], ModelSummary]
) -> str:
    """A line's legend: ``key=value`` of its keys (config keys its cells lack left out, cell keys read as their
    defaults), led by what its model is (ModelSummary of its first run) where a key is a model's and the line holds
    one model, or by the family of its models where it holds several of one family; the model's registered name,
    which the spec overrides, is then left out."""
    values = CELL_DEFAULTS | members[0].values
    given = [(k, v) for k in line_keys if (v := value_text(values.get(k))) != "null"]
    model_axes = sorted({k for r in members for k in r.values if k.startswith("model.")})
    one_model = len({tuple(value_text(r.values.get(k)) for k in model_axes) for r in members}) == 1
    parts = []
    families = {describe(run).family for run in runs} if any(k.startswith("model.") for k in line_keys) else set()
    if runs and one_model and families:
        parts.append(str(describe(runs[0])))
        given = [(k, v) for k, v in given if k not in SAID_BY_SUMMARY]
    elif len(families) == 1:  # models of one family along the line (sizes): the family says what the keys would
        parts.append(families.pop())
        given = [(k, v) for k, v in given if not k.startswith("model.")]
    return ", ".join(parts + [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in given])


def chance(runs: list[Path], metric: str) -> tuple[float, str] | None:
    """Where guessing lands on an accuracy, and its legend ``chance (k/K)``: top-k of the K classes of the data it is
    measured on, as the runs record K (a fewshot probe's own record, else its cell's finetune run's model; the
    model's for the rest; for a part of the label, the values the parts probe recorded). None where a run does not
    record K or the runs differ: never a guess."""
    name, fewshot, part = metric.rsplit(".", 1)[-1], metric.startswith("fewshot."), metric.startswith("parts.")
    if not (fewshot or part) and not name.endswith(("top1", "top5")):
        return None  # an accuracy over something else (MPP's colours), not the model's classes
    count = _fewshot_classes if fewshot else functools.partial(_part_values, part=name) if part else _model_classes
    found = {count(run) for run in runs}
    if len(found) != 1 or None in found:
        return None
    k, classes = (5 if name.endswith("top5") else 1), cast(int, found.pop())
    return min(k / classes, 1.0), f"chance ({k}/{classes})"


def _part_values(run_dir: Path, part: str) -> int | None:
    path = run_dir / PARTS_FILE  # the parts probe's record says how many values each part of the label takes
    n = (json.loads(path.read_text()).get("values") or {}).get(part) if path.is_file() else None
    return n if type(n) is int and n > 0 else None


def _model_classes(run_dir: Path) -> int | None:
    path = run_dir / CONFIG_NAME
    n = (read_config_json(path).get("model") or {}).get("num_classes") if path.is_file() else None
    return n if type(n) is int and n > 0 else None


def _fewshot_classes(run_dir: Path) -> int | None:
    path = run_dir / FEWSHOT_FILE  # the probe's record (FewShotResult.record) says its classes
    n = json.loads(path.read_text()).get("num_classes") if path.is_file() else None
    return n if type(n) is int and n > 0 else _model_classes(run_dir.parent / finetune_name(run_dir.name))


def _si(x: float) -> tuple[str, str]:
    """Three significant digits and the SI prefix: ("4.87", "M") for 4,870,000."""
    x = float(f"{x:.3g}")  # rounded first: 999,999 is 1M, not 1e+03k
    prefix, size = next((p, s) for p, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 0)) if x >= s)
    return f"{x / (size or 1):.3g}", prefix


def _category(key: str, x: Any, rows: list[Row]) -> str:
    """A categorical tick: the value, or for rows without the key (a baseline cell) what they set instead."""
    if x is not None:
        return value_text(x)
    baselines = [r.values for r in rows if key not in r.values]
    said = {f"{k.rsplit('.', 1)[-1]}={value_text(v)}" for values in baselines for k, v in values.items()}
    return ", ".join(sorted(said)) or "none"
