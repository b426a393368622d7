"""A sweep's figures: a line that varies the model says what its model is (family, parameters and FLOPs of the model
its run's config.json builds), and an accuracy has its chance line at k/K of the classes its runs record."""

from __future__ import annotations

import json
import shutil

import matplotlib.colors
import pytest
import yaml
from test_sweep import tiny_digits

from vitkit.checkpoint.base import read_config_json
from vitkit.models import model_from_config
from vitkit.models.flops import model_flops
from vitkit.sweep import load_spec, run_sweep
from vitkit.sweep.aggregate import Row
from vitkit.sweep.figures import (
    SEED_SHIFT,
    ModelSummary,
    axis_label,
    chance,
    curves_figure,
    line_label,
    log_axis,
    metric_figure,
    metric_runs,
    model_summary,
)
from vitkit.sweep.probes import FEWSHOT_FILE, PARTS_FILE

TINY = tiny_digits(schedule={"steps": 2, "warmup_steps": 0}, run={"save_every": 0, "log_every": 1})
VIT = {k: v for k, v in TINY["model"].items() if k != "name"}
CELLS = [
    {"model.name": "vit_ti16", **{f"model.{k}": v for k, v in VIT.items()}},
    {"model.name": "vit_ti16", **{f"model.{k}": v for k, v in VIT.items()}, "model.patch_size": 1,
     "model.resnet_layers": [1], "model.resnet_width": 0.5},
    {"model.name": "bit_r50x1", "model.layers": [1, 1], "model.width_factor": 0.5},
]  # fmt: skip


def test_figure_legends_say_what_each_model_is_and_accuracies_show_chance(tmp_path):
    doc = {"config": {k: v for k, v in TINY.items() if k != "model"}, "cells": CELLS, "seeds": [0]}
    doc |= {
        "metrics": ["eval_top1", "eval_top5", "compute"],
        "figure": {"x": "compute", "lines": ["model.name", "model.resnet_layers"]},
    }
    doc["overrides"] = ["run.eval_batch_size=512"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = run_sweep(tmp_path / "s.yaml", out, log=lambda line: None)
    spec = load_spec(tmp_path / "s.yaml")
    assert (out / "eval_top1.png").is_file() and not result.failed

    ax = metric_figure(spec, result.rows, "eval_top1", out).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    classes = read_config_json(out / spec.expand()[0].name / "config.json")["model"]["num_classes"]
    assert legend[0] == f"chance (1/{classes})"  # then a line per model, in the spec's order
    legend = legend[1:]
    families = ["ViT", "hybrid (ResNet+ViT)", "ResNet (BiT)"]
    for cell, family, label in zip(spec.expand(), families, legend):
        config = read_config_json(out / cell.name / "config.json")  # the model built anew from the run's config
        model = model_from_config(config["model"])
        params = sum(p.numel() for p in model.parameters())
        flops = model_flops(model, config["metadata"]["img_size"])
        summary = model_summary(out / cell.name)
        assert (summary.family, summary.params, summary.flops) == (family, params, flops)
        assert label == str(summary) and label.startswith(f"{family} ") and label.endswith("FLOPs")
        assert "vit_ti16" not in label and "bit_r50x1" not in label  # the registered name the cell overrides
    assert len(legend) == 3 and len(ax.texts) == 0  # a line of one model: its legend says it, no point is labelled
    (chance_line,) = [line for line in ax.get_lines() if line.get_label().startswith("chance")]
    assert list(chance_line.get_ydata()) == [1 / classes] * 2 and chance_line.get_linestyle() == "--"
    assert ax.get_ylim() == (0, 1)
    assert ax.get_xlabel() == "training compute (FLOPs: 3 x forward x images) [compute]"
    assert ax.get_ylabel().startswith("held-out top-1\n") and ax.get_title().endswith(": eval_top1")
    top5 = metric_figure(spec, result.rows, "eval_top5", out).axes[0]
    assert [line.get_ydata()[0] for line in top5.get_lines() if line.get_label() == f"chance (5/{classes})"] == [
        5 / classes
    ]
    compute = metric_figure(spec, result.rows, "compute", out).axes[0]
    assert [t.get_text() for t in compute.get_legend().get_texts()] == legend  # no chance for what is no accuracy
    metric_figure(spec, result.rows, "eval_top1", out).savefig(tmp_path / "eval_top1_again.png")

    # few-shot: the probe's own record of its classes, else the finetune run's model (none here): never a guess
    runs = metric_runs(spec.expand(), result.rows, "fewshot.5shot", out)
    for run in runs:
        (run / FEWSHOT_FILE).write_text(json.dumps({"num_classes": 7, "results": {}}))
    assert chance(runs, "fewshot.5shot") == (1 / 7, "chance (1/7)")
    (runs[0] / FEWSHOT_FILE).write_text(json.dumps({"results": {}}))
    assert chance(runs, "fewshot.5shot") is None
    shutil.copytree(runs[0], out / "other")  # runs that disagree on their classes have no one chance
    config = read_config_json(out / "other" / "config.json")
    config["model"]["num_classes"] = 3
    (out / "other" / "config.json").write_text(json.dumps(config))
    assert chance([runs[1], out / "other"], "eval_top1") is None
    for run in runs:  # a part of the label: the values the parts probe recorded it takes
        (run / PARTS_FILE).write_text(json.dumps({"accuracy": {"side": 0.5}, "values": {"side": 2, "shape": 5}}))
    assert chance(runs, "parts.side") == (0.5, "chance (1/2)") and chance(runs, "parts.shape") == (0.2, "chance (1/5)")
    assert chance([out / "other"], "eval_top1") == (1 / 3, "chance (1/3)")
    assert chance(runs, "train.loss") is None


def test_an_axis_says_what_it_measures_in_words_beside_the_name_the_table_uses():
    assert axis_label("eval_loss") == "held-out loss [eval_loss]"
    assert axis_label("finetune.eval_top1") == "held-out top-1 after fine-tuning [finetune.eval_top1]"
    assert axis_label("fewshot.10shot", named=False) == "10-shot linear top-1 (frozen features)"
    assert axis_label("attention.layer3", named=False) == "mean attention distance (px), layer 3"
    assert axis_label("attention.local0", named=False) == "share of local heads, layer 0"
    assert axis_label("data.num_images") == "pretraining images [data.num_images]"
    assert axis_label("model.width") == axis_label("model.width", named=False) == "model.width"  # no words: the name
    assert axis_label("fewshot.5shotx") == "fewshot.5shotx"


@pytest.mark.parametrize(
    ("values", "ticks"),
    [([8.9e11, 2.7e12], ["1T", "1.5T", "2T"]), ([1000, 64000], ["1k", "2k", "5k", "10k", "20k", "50k"])],
)
def test_a_log_axis_has_ticks_that_read_as_numbers(values, ticks):
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    ax.plot(values, [0, 1])
    log_axis(ax, values)
    low, high = ax.get_xlim()
    shown = [t for t in ax.xaxis.get_major_locator()() if low <= t <= high]
    assert [ax.xaxis.get_major_formatter()(t, 0) for t in shown] == ticks  # a span under a decade: 1.5 and 3 too


def test_the_curves_figure_averages_each_rows_seeds_at_the_steps_all_evaluated(tmp_path):
    """Two seeds of each of two rows, evaluated at steps the other seed partly lacks: each line is the mean over
    seeds at the common steps, read from the runs' metrics.jsonl; runs evaluated once draw nothing."""
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump({"config": TINY, "grid": {"optim.lr": [0.1, 0.2]}, "seeds": [0, 1]}))
    spec = load_spec(spec_path)
    curves = {0.1: [{1: 0.2, 2: 0.4, 3: 0.5}, {1: 0.4, 2: 0.6}], 0.2: [{2: 0.1, 4: 0.3}, {2: 0.3, 4: 0.5, 6: 0.9}]}
    for cell in spec.expand():
        (tmp_path / cell.name).mkdir()
        points = curves[dict(cell.values)["optim.lr"]][cell.seed]
        lines = [json.dumps({"kind": "eval", "step": s, "eval_top1": v}) for s, v in points.items()]
        (tmp_path / cell.name / "metrics.jsonl").write_text("\n".join([*lines, '{"kind": "train"']) + "\n")
    rows = [Row({"optim.lr": lr}, 2, {}, {}, [0, 1]) for lr in (0.1, 0.2)]
    fig = curves_figure(spec, rows, tmp_path)
    lines = fig.axes[0].lines
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in lines}
    assert drawn.keys() == {"lr=0.1", "lr=0.2", "_seed"}  # the seeds' lines stay out of the legend
    assert drawn["lr=0.1"][0] == [1, 2] and drawn["lr=0.1"][1] == pytest.approx([0.3, 0.5])
    assert drawn["lr=0.2"][0] == [2, 4] and drawn["lr=0.2"][1] == pytest.approx([0.2, 0.4])
    # each seed's whole curve, thin, in its row's colour
    means = {line.get_label(): line.get_color() for line in lines if line.get_label() != "_seed"}
    seeds = sorted(
        (line.get_color(), list(line.get_xdata()), list(line.get_ydata()))
        for line in lines
        if line.get_label() == "_seed"
    )
    want = [(means[f"lr={lr}"], sorted(c), [c[s] for s in sorted(c)]) for lr in (0.1, 0.2) for c in curves[lr]]
    assert seeds == sorted(want)
    assert all(line.get_linewidth() < lines[0].get_linewidth() for line in lines if line.get_label() == "_seed")
    for cell in spec.expand():  # one evaluation each: no curve to draw
        (tmp_path / cell.name / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 9, "eval_top1": 1}))
    assert curves_figure(spec, rows, tmp_path) is None


def test_a_line_of_several_models_of_one_family_is_labelled_by_the_family(tmp_path):
    sizes = {
        tmp_path / "small": ModelSummary("ViT", 139_000, 4_850_000),
        tmp_path / "big": ModelSummary("ViT", 456_000, 1),
    }
    rows = [Row({"model.name": "vit_ti16", "model.width": w, "model.patch_size": 4}, 1, {}, {}, [0]) for w in (64, 96)]
    keys = ["model.name", "model.patch_size"]
    assert line_label(keys, rows, list(sizes), sizes.__getitem__) == "ViT"
    sizes[tmp_path / "big"] = ModelSummary("hybrid (ResNet+ViT)", 1, 1)  # two families: the keys say it
    assert line_label(keys, rows, list(sizes), sizes.__getitem__) == "name=vit_ti16, patch_size=4"
    assert (
        line_label(keys, rows[:1], [tmp_path / "small"], sizes.__getitem__)
        == "ViT 139k params, 4.85 MFLOPs, patch_size=4"
    )


def test_a_line_of_cells_without_the_pretrain_key_is_labelled_as_pretraining():
    """mpp's figure: the pre-trained cells set only run.objective, the baseline ``pretrain: false``; the line key
    pretrain then names both lines (a cell without it pre-trains), where the first had no label of its own."""
    trained = [Row({"run.objective": o}, 1, {}, {}, [0]) for o in ("mpp", "classification")]
    scratch = [Row({"pretrain": False}, 1, {}, {}, [0])]
    assert line_label(["pretrain"], trained, [], model_summary) == "pretrain=true"
    assert line_label(["pretrain"], scratch, [], model_summary) == "pretrain=false"
    assert not load_spec("mpp").figure_lines and "pretrain" in load_spec("mpp").axes  # the case, as shipped


def test_the_points_of_a_line_of_several_sizes_each_say_their_models_size(tmp_path):
    """Two widths of one ViT on one line against compute (the hybrids figure): the legend names the family and each
    point is labelled with the parameters and FLOPs an image of the model its run's config.json builds."""
    cells = [{**CELLS[0], "model.width": width, "model.mlp_dim": 2 * width} for width in (16, 32)]
    doc = {"config": {k: v for k, v in TINY.items() if k != "model"}, "cells": cells, "seeds": [0]}
    doc |= {"metrics": ["eval_top1", "compute"]}
    doc |= {"figure": {"x": "compute", "lines": ["model.name"]}, "overrides": ["run.eval_batch_size=512"]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = run_sweep(tmp_path / "s.yaml", out, log=lambda line: None)
    spec = load_spec(tmp_path / "s.yaml")
    ax = metric_figure(spec, result.rows, "eval_top1", out).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "ViT"
    expected = []
    for cell, row in zip(spec.expand(), result.rows):
        config = read_config_json(out / cell.name / "config.json")
        model = model_from_config(config["model"])
        params = sum(p.numel() for p in model.parameters())
        flops = model_flops(model, config["metadata"]["img_size"])
        assert config["model"]["width"] == row.values["model.width"]
        assert 1e3 <= params < 1e6 and 1e3 <= flops < 1e6  # thousands: "k"
        text = f"{params / 1e3:.3g}k, {flops / 1e3:.3g} kFLOPs"
        expected.append((text, (row.mean["compute"], row.mean["eval_top1"])))
    assert [(t.get_text(), t.xy) for t in ax.texts] == expected
    assert expected[0][0] != expected[1][0]


def test_each_seeds_value_is_a_dot_beside_its_rows_mean(tmp_path):
    """Categories (two position embeddings) of two seeds each: every seed's held-out top-1, read from its run's own last
    evaluation, is a dot just right of its category's mean, in its colour, left out of the legend."""
    kinds = ["learned", "none"]
    doc = {"config": TINY, "grid": {"model.pos_embed": kinds}, "seeds": [0, 1], "metrics": ["eval_top1"]}
    doc |= {"figure": {"x": "model.pos_embed"}, "overrides": ["run.eval_batch_size=512"]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = run_sweep(tmp_path / "s.yaml", out, log=lambda line: None)
    spec = load_spec(tmp_path / "s.yaml")
    ax = metric_figure(spec, result.rows, "eval_top1", out).axes[0]
    (bars,) = ax.containers  # the means ± std, one errorbar
    mean = bars.lines[0]
    dots = [c for c in ax.collections if c.get_label() == "_seed"]
    assert all(tuple(c.get_facecolor()[0][:3]) == matplotlib.colors.to_rgb(mean.get_color()) for c in dots)
    drawn = sorted((float(x), float(y)) for c in dots for x, y in c.get_offsets())
    want = []
    for cell in spec.expand():
        evals = [json.loads(line) for line in (out / cell.name / "metrics.jsonl").read_text().splitlines()]
        top1 = [e["eval_top1"] for e in evals if e.get("kind") == "eval"][-1]
        want.append((kinds.index(dict(cell.values)["model.pos_embed"]) + SEED_SHIFT, top1))
    assert drawn == sorted(want) and len(drawn) == 4
    assert [t.get_text() for t in ax.get_xticklabels()] == kinds
    classes = read_config_json(out / spec.expand()[0].name / "config.json")["model"]["num_classes"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"chance (1/{classes})"]  # one line: no entry
