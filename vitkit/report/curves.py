"""Training curves from a run's metrics.jsonl records: loss, learning rate, held-out accuracy, throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .html import Chart, Html, Row, Series, fmt, percent, table, tag

LOG_SPAN = 10.0  # a loss that spans more than a decade is drawn on a log scale (as loss.png is)


def _series(records: Sequence[dict[str, Any]], key: str, name: str, dashed: bool = False) -> Series | None:
    rows = [r for r in records if key in r and isinstance(r[key], (int, float))]
    if not rows:
        return None
    return Series(name, [r["step"] for r in rows], [float(r[key]) for r in rows], dashed)


def steps_per_epoch(records: Sequence[dict[str, Any]]) -> float | None:
    """Steps per epoch, read off the last record that gives both (the most digits; None when none does)."""
    for r in reversed(records):
        if r.get("step") and r.get("epoch"):
            return float(r["step"]) / float(r["epoch"])
    return None


def training_charts(records: Sequence[dict[str, Any]], label_smoothing: float = 0.0, prefix: str = "") -> list[Chart]:
    """The charts of one run (a chart with no data is left out); ``prefix`` keeps ids apart on a page of many."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    per_epoch = steps_per_epoch(records)
    mpp = any("eval_mpp_loss" in r for r in evals)
    charts: list[Chart] = []

    smoothed = f" (label smoothing {label_smoothing:g})" if label_smoothing > 0 else ""
    loss = [
        _series(train, "loss", f"train loss{smoothed}"),
        _series(evals, "eval_mpp_loss" if mpp else "eval_loss", "eval MPP loss" if mpp else "eval loss", dashed=True),
    ]
    loss_series = [s for s in loss if s is not None]
    values = [v for s in loss_series for v in s.y if v is not None and math.isfinite(v) and v > 0]
    log = bool(values) and max(values) > LOG_SPAN * min(values)
    y_label = "masked patch prediction loss" if mpp else "cross-entropy"
    accuracy = [
        _series(evals, "eval_top1", "eval top-1"),
        _series(evals, "eval_top5", "eval top-5", dashed=True),
        _series(evals, "eval_mpp_acc", "eval MPP colour accuracy"),
    ]
    lr = [s for s in [_series(train, "lr", "learning rate")] if s]
    speed = [s for s in [_series(train, "images_per_s", "train images/s")] if s]
    for id, title, series, y, form, is_log in (
        ("loss", "Loss", loss_series, y_label, "number", log),
        ("accuracy", "Held-out accuracy", [s for s in accuracy if s is not None], "accuracy", "percent", False),
        ("lr", "Learning rate", lr, "learning rate", "sci", False),
        ("throughput", "Throughput", speed, "images per second", "number", False),
    ):
        if series:
            charts.append(Chart(prefix + id, title, series, "step", y, form, is_log, per_epoch))
    return charts


def evaluations_table(records: Sequence[dict[str, Any]]) -> Html:
    """Every evaluation record as a row: step, epoch and the metrics it holds."""
    evals = [r for r in records if r.get("kind") == "eval"]
    if not evals:
        return tag("p", "No evaluation was recorded.", cls="note")
    keys = [k for k in ("eval_top1", "eval_top5", "eval_loss", "eval_mpp_acc", "eval_mpp_loss") if k in evals[-1]]
    header = ["step", "epoch", *(k.removeprefix("eval_").replace("_", " ") for k in keys)]
    rows = []
    for r in evals:
        cells = [fmt(r.get("step")), fmt(r.get("epoch"))]
        for k in keys:
            v = r.get(k)
            cells.append("–" if v is None else percent(v) if "top" in k or "acc" in k else fmt(v))
        rows.append(Row(cells))
    return table(header, rows, caption="Held-out evaluations recorded during training (metrics.jsonl)")
