"""Choosing a run's weights on selection images (data.select_images): the selection set is a stream of its own; the
chosen weights are the best-scoring evaluation's, scored here again from the saved model with plain torch; the
held-out set chooses nothing; a resume chooses as an uninterrupted run; the sweep reports the chosen evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from vitkit import UserError, load_model
from vitkit.checkpoint import read_native
from vitkit.data import DataConfig, build_datasets, build_selection
from vitkit.data.procedural import EVAL_STREAM, SELECT_STREAM, TRAIN_STREAM, ProceduralShapes, render_shape_image
from vitkit.report.run import run_report
from vitkit.sweep import run_sweep
from vitkit.train import STATE_NAME, Trainer, config_from_dict, read_train_state, train
from vitkit.train.select import Selection


def shapes_doc(tmp_path: Path, name: str, **data) -> dict:
    return {
        "model": {"name": "vit_ti16", "patch_size": 4, "width": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32},
        "data": {"source": "shapes", "img_size": 8, "num_images": 64, "eval_images": 40, "select_images": 40, **data},
        "optim": {"name": "adamw", "lr": 3e-3, "batch_size": 16},
        "schedule": {"steps": 24, "warmup_steps": 2},
        "run": {
            "out_dir": str(tmp_path / "runs"), "name": name, "progress": False, "plots": False, "threads": 1,
            "eval_every": 2, "save_every": 6, "log_every": 6,
        },
    }  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def top1(model: nn.Module, data: ProceduralShapes) -> float:
    """Plain torch: the share of the set's images whose largest logit is their label."""
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.tensor([data[i][1] for i in range(len(data))])
    with torch.no_grad():
        return float((model.eval()(x).argmax(-1) == y).float().mean())


def test_the_selection_images_are_a_stream_of_their_own():
    cfg = DataConfig(source="shapes", img_size=8, num_images=30, eval_images=30, select_images=30).resolve()
    train_set, eval_set, _ = build_datasets(cfg)
    chooser = build_selection(cfg)
    assert isinstance(chooser, ProceduralShapes) and len(chooser) == 30
    assert (train_set.stream, eval_set.stream, chooser.stream) == (TRAIN_STREAM, EVAL_STREAM, SELECT_STREAM)
    assert len({TRAIN_STREAM, EVAL_STREAM, SELECT_STREAM}) == 3
    for index in (0, 3, 17):  # image i of the selection stream, drawn and normalised (mean = std = 0.5) here
        pixels, label = render_shape_image(0, SELECT_STREAM, index, 8)
        plain = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
        assert torch.equal(chooser[index][0], (plain - 0.5) / 0.5) and chooser[index][1] == label
        assert not torch.equal(chooser[index][0], eval_set[index][0])
    assert build_selection(DataConfig(source="shapes").resolve()) is None


def test_select_images_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(UserError, match=r"data.select_images=5: .*data.source=shapes .*'digits'"):
        DataConfig(source="digits", select_images=5).resolve()
    with pytest.raises(UserError, match="data.select_images=-1"):
        DataConfig(source="shapes", select_images=-1).resolve()
    doc = shapes_doc(tmp_path, "once")
    doc["run"]["eval_every"] = 0
    with pytest.raises(UserError, match=r"data.select_images=40 chooses among .* set run.eval_every"):
        train(config_from_dict(doc))
    assert not (tmp_path / "runs" / "once").exists()


def test_a_selection_keeps_the_first_best_evaluation_and_its_weights():
    model = nn.Linear(2, 1)
    selection = Selection(dataset=[])  # type: ignore[arg-type]
    for step, score in [(2, 0.3), (4, 0.5), (6, 0.5), (8, 0.4)]:
        nn.init.constant_(model.weight, float(step))
        selection.offer(step, {"select_top1": score, "eval_top1": score / 2}, model)
    assert (selection.step, selection.score) == (4, 0.5)
    assert selection.result() == {"select_top1": 0.5, "eval_top1": 0.25, "selected_step": 4}
    with selection.chosen(model) as inside:
        assert torch.equal(inside.weight, torch.full((1, 2), 4.0))
    assert torch.equal(model.weight, torch.full((1, 2), 8.0))  # its own weights back after the block


def test_the_run_keeps_and_reports_the_weights_that_scored_best_on_the_selection_images(tmp_path):
    result = train(config_from_dict(shapes_doc(tmp_path, "chosen")))
    evals = [r for r in records(result.run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == list(range(2, 25, 2))
    best = max(r["select_top1"] for r in evals)
    first_best = next(r for r in evals if r["select_top1"] == best)  # chosen on the selection images alone
    last = records(result.run_dir)[-1]
    assert last["kind"] == "selected" and last["selected_step"] == first_best["step"]
    assert {k: last[k] for k in first_best if k not in ("kind", "step", "epoch")} == {
        k: v for k, v in first_best.items() if k not in ("kind", "step", "epoch")
    }
    assert result.metrics["selected_step"] == first_best["step"] and "chosen (step" in result.summary()

    model = load_model(str(result.run_dir))  # the saved model: the chosen weights, scored again here
    cfg = DataConfig(source="shapes", img_size=8, num_images=64, eval_images=40, select_images=40).resolve()
    _, eval_set, _ = build_datasets(cfg)
    assert top1(model, build_selection(cfg)) == pytest.approx(best, abs=1e-6)
    assert top1(model, eval_set) == pytest.approx(first_best["eval_top1"], abs=1e-6)
    assert read_native(result.run_dir)[2]["metrics"]["selected_step"] == first_best["step"]
    assert first_best["step"] < 24  # this run's best is not its last: the weights saved are not the final ones
    page = run_report(result.run_dir, "cpu")  # the run's page leads with the kept weights' score and step
    kept = f'<span class="value">{first_best["step"]}</span><span class="label">step of the weights kept</span>'
    score = f'<span class="value">{100 * first_best["eval_top1"]:.2f}%</span><span class="label">held-out top-1'
    assert kept in page and score in page and first_best["eval_top1"] != evals[-1]["eval_top1"]


def test_a_resumed_run_chooses_as_an_uninterrupted_one(tmp_path):
    reference = train(config_from_dict(shapes_doc(tmp_path, "straight")))
    trainer = Trainer(config_from_dict(shapes_doc(tmp_path, "stopped")))
    try:
        batches = trainer.batches(0)
        while trainer.step < 12:
            trainer.train_one_epoch(batches)
        trainer.save()
        stopped_at = trainer.step
    finally:
        trainer.close()
    state, tensors = read_train_state(tmp_path / "runs" / "stopped" / STATE_NAME)
    assert state["best"]["step"] <= stopped_at and any(k.startswith("best.") for k in tensors)
    resumed = train(config_from_dict(shapes_doc(tmp_path, "stopped"), ["run.resume=true"]))
    assert resumed.metrics == reference.metrics
    a, b = (load_model(str(r.run_dir)).state_dict() for r in (reference, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_sweep_reports_the_chosen_evaluation_not_the_last(tmp_path):
    doc = shapes_doc(tmp_path, "unused")
    del doc["run"]["out_dir"], doc["run"]["name"]
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"config": doc, "cells": [{}], "seeds": [0], "metrics": ["eval_top1"]}))
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if (p / "metrics.jsonl").is_file()]
    chosen, last_eval = records(run_dir)[-1], [r for r in records(run_dir) if r["kind"] == "eval"][-1]
    assert chosen["kind"] == "selected" and chosen["eval_top1"] != last_eval["eval_top1"]
    assert result.rows[0].mean["eval_top1"] == chosen["eval_top1"]


def test_masked_patch_prediction_chooses_on_its_colour_accuracy(tmp_path):
    doc = shapes_doc(tmp_path, "mpp")
    doc["run"]["objective"] = "mpp"
    result = train(config_from_dict(doc))
    evals = [r for r in records(result.run_dir) if r["kind"] == "eval"]
    best = max(r["select_mpp_acc"] for r in evals)
    assert "select_top1" not in evals[0]
    assert result.metrics["selected_step"] == next(r["step"] for r in evals if r["select_mpp_acc"] == best)
