"""A sweep's probes and its from-scratch baseline: few-shot accuracy equal to ``vitkit fewshot``'s on the same
model, the attention probe against a closed form, a ResNet's blank attention, and a ``pretrain: false`` cell that
trains the finetune stage alone from the first stage's model settings."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from vitkit.cli import main
from vitkit.errors import UserError
from vitkit.hub import load_model
from vitkit.models.vit import VisionTransformer
from vitkit.sweep import load_spec, run_sweep
from vitkit.sweep.probes import ATTENTION_FILE, FEWSHOT_FILE, Probes, probe_metric, run_probes
from vitkit.sweep.run import plan_cell, run_status

TINY = {
    "model": {"name": "vit_ti16", "patch_size": 4, "width": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32},
    "data": {"source": "digits"},
    "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 32},
    "schedule": {"steps": 4, "warmup_steps": 0},
    "run": {"log_every": 1, "eval_every": 0, "save_every": 0, "plots": False, "threads": 1},
}


def _spec(path: Path, **changes) -> Path:
    doc = {"config": TINY, "grid": {"model.depth": [1, 2]}, "seeds": [0], "metrics": ["eval_top1"], **changes}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_fewshot_probe_writes_what_vitkit_fewshot_writes(tmp_path):
    spec = _spec(
        tmp_path / "s.yaml",
        grid={"model.depth": [1]},
        metrics=["fewshot.5shot", "fewshot.10shot"],
        probes={"fewshot": {"data": "digits", "shots": [5, 10], "seeds": 2}},
    )
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    run_dir = tmp_path / "out" / "depth-1_seed-0"
    probe = json.loads((run_dir / FEWSHOT_FILE).read_text())
    assert main(["fewshot", str(run_dir), "--data", "digits", "--shots", "5", "10", "--seeds", "2",
                 "--out", str(tmp_path / "cli.json")]) == 0  # fmt: skip
    cli = json.loads((tmp_path / "cli.json").read_text())
    assert probe["results"] == cli["results"] and probe["data"] == cli["data"]
    assert result.rows[0].mean["fewshot.10shot"] == cli["results"]["10"]["mean"]
    assert 0.1 < cli["results"]["10"]["mean"] <= 1.0


def _uniform_attention(model: VisionTransformer) -> None:
    """Zero query and key weights: every query attends to every key equally."""
    with torch.no_grad():
        for block in model.blocks:
            qkv = block.attn.qkv
            width = qkv.weight.shape[1]
            qkv.weight[: 2 * width].zero_()
            qkv.bias[: 2 * width].zero_()


def test_the_attention_probe_gives_the_closed_form_of_uniform_attention(tmp_path):
    """Uniform attention over a 4x4 grid of 4-pixel patches: the mean distance is the mean over all ordered pairs
    of patch centres (self pairs included) of their distance, in pixels, in every layer and head."""
    spec = _spec(tmp_path / "s.yaml", grid={"model.depth": [2]}, metrics=["eval_top1"])
    run_sweep(spec, tmp_path / "out", log=lambda line: None)
    run_dir = tmp_path / "out" / "depth-2_seed-0"
    model = load_model(run_dir)
    _uniform_attention(model)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    run_probes(Probes(attention_images=7), run_dir)
    centres = [(4 * r, 4 * c) for r in range(4) for c in range(4)]
    expected = sum(math.dist(a, b) for a, b in itertools.product(centres, centres)) / len(centres) ** 2
    doc = json.loads((run_dir / ATTENTION_FILE).read_text())
    assert doc["images"] == 7 and doc["uniform"] == pytest.approx(expected, rel=1e-9)
    assert torch.tensor(doc["distance"]) == pytest.approx(torch.full((2, 2), expected), rel=1e-5)
    assert probe_metric(run_dir, "attention.layer1") == pytest.approx(expected, rel=1e-5)
    sim = torch.tensor(doc["position_similarity"])  # (4, 4, 4, 4) cosine similarities: 1 on the diagonal
    assert sim.shape == (4, 4, 4, 4) and all(sim[r, c, r, c] == pytest.approx(1.0) for r in range(4) for c in range(4))


def test_a_resnet_has_no_attention_and_its_metric_is_blank(tmp_path):
    resnet = {**TINY, "model": {"name": "bit_r50x1", "layers": [1], "width_factor": 0.5}}
    spec = _spec(
        tmp_path / "s.yaml",
        config=resnet,
        grid={"model.width_factor": [0.5]},
        metrics=["eval_top1", "attention.layer0"],
        probes={"attention": {"images": 4}},
    )
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    (run_dir,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    assert "skipped" in json.loads((run_dir / ATTENTION_FILE).read_text())
    assert result.rows[0].mean["attention.layer0"] is None and result.rows[0].mean["eval_top1"] is not None


def test_a_cell_that_does_not_pretrain_trains_the_finetune_stage_alone_with_the_same_model(tmp_path):
    spec_path = _spec(
        tmp_path / "s.yaml",
        grid={},
        cells=[{"run.objective": "classification"}, {"pretrain": False}],
        overrides=["model.width=24"],
        metrics=["finetune.eval_top1"],
        finetune={"config": {"data": {"source": "digits", "train_fraction": 0.5}},
                  "overrides": ["schedule.steps=3", "optim.name=adamw", "optim.lr=0.001", "run.plots=false"]},
    )  # fmt: skip
    spec = load_spec(spec_path)
    pre, scratch = (plan_cell(spec, cell, tmp_path / "out", threads=1) for cell in spec.expand())
    assert pre.first is not None and scratch.first is None
    assert any(o.startswith("run.init_from=") for o in pre.finetune[1])
    assert not any(o.startswith("run.init_from=") for o in scratch.finetune[1])
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    assert [r.n for r in result.rows] == [1, 1] and all(r.mean["finetune.eval_top1"] is not None for r in result.rows)
    out = tmp_path / "out"
    assert not (out / "pretrain-false_seed-0").exists()
    assert run_status(out / "pretrain-false_seed-0--finetune") == "finished"
    models = [json.loads((out / f"{n}--finetune" / "config.json").read_text())["model"]
              for n in ("objective-classification_seed-0", "pretrain-false_seed-0")]  # fmt: skip
    assert models[0] == models[1] and models[0]["width"] == 24 and models[0]["depth"] == 2
    rerun = run_sweep(spec, out, log=lambda line: None)  # finished: nothing runs again
    assert rerun.actions == {
        "objective-classification_seed-0": ["skipped", "skipped"],
        "pretrain-false_seed-0": ["skipped"],
    }


def test_probe_and_baseline_specs_are_checked(tmp_path):
    with pytest.raises(UserError, match="fewshot"):
        load_spec(_spec(tmp_path / "a.yaml", metrics=["fewshot.5shot"]))  # no probe
    with pytest.raises(UserError, match="attention.layer"):
        load_spec(_spec(tmp_path / "b.yaml", metrics=["attention.last"], probes={"attention": {"images": 4}}))
    with pytest.raises(UserError, match="probes.attention"):
        load_spec(_spec(tmp_path / "c.yaml", probes={"attention": {"images": 0}}))
    with pytest.raises(UserError, match="probes"):
        load_spec(_spec(tmp_path / "d.yaml", probes={"linear": {}}))
    with pytest.raises(UserError, match="needs a finetune stage"):
        load_spec(_spec(tmp_path / "e.yaml", grid={}, cells=[{"pretrain": False}]))
