"""Run metrics: metrics.jsonl (one JSON record per line) and PNG plots of the loss and accuracy curves.

Records are ``{"kind": "train", "step", "epoch", "loss", "lr", "images_per_s", "time"}`` every log_every steps and
``{"kind": "eval", "step", "epoch", "eval_loss", "eval_top1", "eval_top5"}`` (MPP: ``eval_mpp_loss``,
``eval_mpp_acc``) at each evaluation; with data.select_images, each also holds the selection set's ``select_*``
scores, and the run ends with ``{"kind": "selected", "selected_step", ...}``: the evaluation of the weights it chose
(train/select.py). A train record's loss is the mean over the steps since the previous record,
``images_per_s`` their training alone, ``time`` the run's wall time. A resume cuts the file back to its step, so it
reads as one uninterrupted run. With run.tensorboard the same scalars also go to run_dir/tensorboard.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..device import busy_core_seconds, usable_cores
from ..io import append_text, atomic_write, atomic_write_text
from ..optional import require

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn: runs without plots never load it
    from matplotlib.figure import Figure

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_NAMES = ("loss.png", "accuracy.png")  # plot_metrics' figures


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of samples whose label is among the top-k logits, for each k (k capped at the class count)."""
    kmax = min(max(ks), logits.shape[-1])
    top = logits.topk(kmax, dim=-1).indices  # (B, kmax)
    hit = top == labels[:, None]  # (B, kmax)
    return [int(hit[:, : min(k, kmax)].any(dim=-1).sum()) for k in ks]


class MetricsLog:
    """Appends records to run_dir/metrics.jsonl (only the writing rank creates one)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_NAME
        self.writer: Any = None  # a SummaryWriter once open_tensorboard is called

    def open_tensorboard(self, purge_step: int | None = None) -> None:
        """Also write scalars to run_dir/tensorboard; events past purge_step (a resumed run's) are discarded."""
        require("tensorboard", "run.tensorboard=true")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.path.parent / TENSORBOARD_DIR), purge_step=purge_step or None)

    def write(self, record: dict[str, Any]) -> None:
        append_text(self.path, json.dumps(record) + "\n")  # never through a link planted under its name
        if self.writer is not None:
            kind, step = record.get("kind", "train"), int(record.get("step", 0))
            for key, value in record.items():
                if key in ("kind", "step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                tag = f"eval/{key.removeprefix('eval_')}" if kind == "eval" else f"{kind}/{key}"
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()  # at the log cadence: a killed run keeps what it logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(record, dict):  # a line cut to a bare number is no record either
                out.append(record)
        return out

    def truncate(self, step: int) -> None:
        """Keep only the records up to ``step`` (what the resumed state had seen)."""
        kept = [r for r in self.records() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


MARKER_MAX_POINTS = 20  # a series this short gets markers, so a lone point still shows


def plot_metrics(
    records: list[dict[str, Any]],
    out_dir: str | Path,
    *,
    label_smoothing: float = 0.0,
    mixup: float = 0.0,
    cutmix: float = 0.0,
) -> list[Path]:
    """loss.png (train and eval loss) and accuracy.png (eval top-1/top-5) from metric records. With label smoothing,
    mixup or cutmix the train loss is against soft targets and sits above the eval loss: its legend says so."""
    out_dir = Path(out_dir)
    figure = loss_figure(records, label_smoothing=label_smoothing, mixup=mixup, cutmix=cutmix)
    loss, accuracy = (out_dir / name for name in PLOT_NAMES)
    return [save_figure(figure, loss), save_figure(accuracy_figure(records), accuracy)]


def train_loss_label(label_smoothing: float = 0.0, mixup: float = 0.0, cutmix: float = 0.0) -> str:
    """The train loss's legend: what its targets were, when they were not the labels themselves."""
    mixing = [f"{name} {alpha:g}" for name, alpha in (("mixup", mixup), ("cutmix", cutmix)) if alpha > 0]
    smoothing = [f"label smoothing {label_smoothing:g}"] if label_smoothing > 0 else []
    if mixing:
        return f"train loss ({' / '.join(mixing + smoothing)}: soft targets)"
    return f"train loss ({smoothing[0]})" if smoothing else "train loss"


def loss_figure(
    records: list[dict[str, Any]], *, label_smoothing: float = 0.0, mixup: float = 0.0, cutmix: float = 0.0
) -> Figure:
    """Train and eval loss against step; a log scale only when the loss spans more than a decade."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = _figure()
    label = train_loss_label(label_smoothing, mixup, cutmix)
    _plot(ax, [r["step"] for r in train], [r["loss"] for r in train], "o", "-", label)
    mpp = any("eval_mpp_loss" in r for r in evals)
    key = "eval_mpp_loss" if mpp else "eval_loss"
    evals = [r for r in evals if key in r]
    averaged = " (Polyak average)" if _weights(evals) else ""  # the title names the factor
    label = ("eval MPP loss" if mpp else "eval loss") + averaged
    _plot(ax, [r["step"] for r in evals], [r[key] for r in evals], "s", "-", label)
    ys = [float(v) for line in ax.get_lines() for v in np.asarray(line.get_ydata(), dtype=float).ravel()]
    losses = [v for v in ys if math.isfinite(v) and v > 0]
    if losses and max(losses) > 10 * min(losses):
        ax.set_yscale("log")
    ax.set(
        xlabel="step", ylabel="masked patch prediction loss" if mpp else "cross-entropy", title="loss" + _weights(evals)
    )
    _finish(ax)
    return fig


def accuracy_figure(records: list[dict[str, Any]]) -> Figure:
    """Held-out top-1 and top-5 accuracy against step, in percent (MPP: the colour prediction accuracy)."""
    from matplotlib.ticker import PercentFormatter

    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = _figure()
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    mpp = [r for r in evals if "eval_mpp_acc" in r]
    evals = [r for r in evals if "eval_top1" in r]
    steps = [r["step"] for r in evals]
    _plot(ax, steps, [r["eval_top1"] for r in evals], "o", "-", "eval top-1")
    _plot(ax, steps, [r["eval_top5"] for r in evals], "s", "--", "eval top-5")
    _plot(ax, [r["step"] for r in mpp], [r["eval_mpp_acc"] for r in mpp], "o", "-", "eval MPP colour accuracy")
    ax.set(xlabel="step", ylabel="accuracy", title="held-out accuracy" + _weights(evals + mpp))
    ax.set_ylim(0, 1)  # accuracy's whole range, 0-100%: no tick past 100%, and runs compare at a glance
    for line in ax.get_lines():
        line.set_clip_on(False)  # a marker at 100% drawn whole on the top edge
    _finish(ax)
    return fig


def _weights(evals: list[dict[str, Any]]) -> str:
    """A title's second line when the evaluated weights were the Polyak average (the eval records say so)."""
    about = next((r["weights"] for r in evals if "weights" in r), None)
    return f"\nevaluated: the {about}" if about else ""


def _plot(ax, x: list[float], y: list[float], marker: str, linestyle: str, label: str) -> None:
    if x:
        ax.plot(x, y, linestyle=linestyle, marker=marker if len(x) <= MARKER_MAX_POINTS else None, label=label)


def _figure() -> tuple[Figure, Any]:
    """A figure's one axes: whole-number steps, tick labels written out in full (no offset or multiplier)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # integers even around a lone point
    ax.ticklabel_format(style="plain", useOffset=False)
    return fig, ax


def _finish(ax) -> None:
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()


def save_figure(fig: Figure, path: Path) -> Path:
    """The figure, laid out tight, as a PNG at path (written atomically); returns path."""
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return path


def format_duration(seconds: float) -> str:
    """A duration as a person says it: seconds, minutes, hours or days."""
    for unit, size, limit in (("s", 1, 90), ("min", 60, 90 * 60), ("hours", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.0f} days"


class Pace:
    """The run's remaining duration, measured on its first steps (after the first, which pays for warm-up) and
    said: ``tick(step)`` after each step returns the line to print, or None. It is measured again within the next
    tenth of the run and said again where the pace changed twofold and the time left by a minute or more (first
    steps that draw and keep their data, say). On a CPU run of ``threads`` > 1 the first line gets another when
    other processes kept its cores busy meanwhile: threads that wait for a core stall every op."""

    def __init__(self, step: int, total_steps: int, steps: int = 5, threads: int | None = None) -> None:
        self.start, self.total, self.steps, self.threads = step + 1, total_steps, steps, threads
        self.t0: float | None = None
        self.cpu0: tuple[float, float | None] = (0.0, None)  # (this process's CPU time, all processes') at t0
        self.first: tuple[int, float] | None = None  # the first line's step and seconds a step
        self.mark: tuple[int, float] | None = None  # (step, clock) where the second measurement starts
        self.done = total_steps - step <= 1 + steps  # a run that short is over before a figure would help

    def tick(self, step: int) -> str | None:
        if self.done:
            return None
        if step == self.start:
            self.t0, self.cpu0 = time.perf_counter(), (time.process_time(), busy_core_seconds())
            return None
        if self.first is not None:
            return self._again(step, *self.first)
        if self.t0 is None or step < self.start + self.steps:
            return None
        now = time.perf_counter()
        per_step = (now - self.t0) / (step - self.start)
        self.first = (step, per_step)
        return self._line("measured", per_step, self.start + 1, step) + self._contention(now - self.t0)

    def _again(self, step: int, first: int, per_step: float) -> str | None:
        """Measured over the second half of the tenth after the first line: the change should be over by then."""
        window = max(self.steps, (self.total - first) // 10)
        if self.mark is None:
            if step >= first + window // 2:
                self.mark = (step, time.perf_counter())
            return None
        if step < first + window:
            return None
        self.done = True
        mark, clock = self.mark
        again = (time.perf_counter() - clock) / (step - mark)
        if max(again, per_step) < 2 * min(again, per_step) or abs(again - per_step) * (self.total - step) < 60:
            return None
        return self._line("measured again", again, mark + 1, step)

    def _line(self, said: str, per_step: float, first: int, step: int) -> str:
        left = self.total - step
        return (
            f"{said} {per_step:.3g} s a step (steps {first}-{step}): about {format_duration(per_step * left)} for the "
            f"{left:,} steps left, evaluations aside"
        )

    def _contention(self, wall: float) -> str:
        """A line when other processes used more of this run's cores than its threads leave free (see Pace)."""
        busy = busy_core_seconds()
        if not self.threads or self.threads < 2 or busy is None or self.cpu0[1] is None:
            return ""
        others = (busy - self.cpu0[1] - (time.process_time() - self.cpu0[0])) / wall  # cores, on average
        cores = usable_cores()
        if others <= cores - self.threads + 0.5:
            return ""
        return (
            f"\n  busy cores: other processes kept {others:.1f} of the {cores} cores this run may use busy during "
            f"these steps, where its {self.threads} threads wait for each other: run.threads=1 is likely faster now"
        )
