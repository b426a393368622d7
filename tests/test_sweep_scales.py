"""Sweep scales and baselines: every shipped spec has a GPU scale whose configs build and whose quick variant runs
the same code on a CPU; the GPU scale measures attention on 8x8 tokens of 4 px; lists of cells multiply; an
untrained cell's weights are its model as initialised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_sweep import tiny_digits

from vitkit.cli import main
from vitkit.data import build_datasets
from vitkit.errors import UserError
from vitkit.inspect.attention import attention_distance
from vitkit.models.vit import VisionTransformer
from vitkit.sweep import load_spec, run_sweep, shipped_sweeps
from vitkit.sweep.probes import ATTENTION_FILE, attention_record, probe_metric
from vitkit.sweep.run import plan_cell
from vitkit.sweep.spec import Claim
from vitkit.train.model import build_model
from vitkit.train.recipe import load_config
from vitkit.train.sampling import mix_seed


@pytest.mark.parametrize("name", sorted(shipped_sweeps()))
def test_every_shipped_spec_has_a_gpu_scale_that_builds_and_is_bigger(name, tmp_path):
    cpu, gpu = load_spec(name), load_spec(name, scale="gpu")
    assert gpu.scale == "gpu" and gpu.options == "--scale gpu" and gpu.jobs > 1
    assert len(gpu.seeds) >= 5  # the differences it claims are tested on five seeds or more
    assert gpu.claims, "a GPU scale states the orderings it tests"
    plans = [plan_cell(gpu, cell, tmp_path, threads=1) for cell in gpu.expand()]
    firsts = [p.first for p in plans if p.first is not None]
    assert {c.data.img_size for c in firsts} == {32}  # 8x8 tokens of 4 px patches, where the CPU scale has 4x4
    cpu_firsts = [p.first for p in (plan_cell(cpu, cell, tmp_path, threads=1) for cell in cpu.expand()) if p.first]
    assert {c.data.img_size for c in cpu_firsts} == {16}
    # the GPU scale trains and fine-tunes under bf16 autocast (a tensor core's rate), the CPU scale in fp32
    assert {c.run.amp for c in firsts} == {"bf16"} and {c.run.amp for c in cpu_firsts} == {"none"}
    finetunes = [[o for o in p.finetune[1] if o.startswith("run.amp=")] for p in plans if p.finetune is not None]
    assert all(amp[-1:] == ["run.amp=bf16"] for amp in finetunes)  # its overrides, read once the first run is done
    quick = load_spec(name, scale="gpu", quick=True)
    assert quick.options == "--scale gpu --quick" and len(quick.expand()) < len(gpu.expand())


@pytest.mark.parametrize(
    "name", [n for n in sorted(shipped_sweeps()) if load_spec(n, scale="gpu").probes.attention_images]
)
def test_the_gpu_scales_attention_is_measured_on_8x8_tokens_of_4_pixels_and_runs(name, tmp_path):
    """Every ViT whose attention a GPU scale measures (hybrids included, whose ResNet makes the /4) has the same 8x8
    grid of 4-pixel tokens, so its distances compare with the others', and its first-stage model runs at 32 px."""
    spec = load_spec(name, scale="gpu")
    vits = 0
    cells = [cell for cell in spec.expand() if cell.seed == spec.seeds[0]]  # the seeds build the same models
    for plan in (plan_cell(spec, cell, tmp_path, threads=1) for cell in cells):
        if plan.first is None or plan.first.model.name.startswith("bit_"):
            continue
        model = build_model(plan.first, build_datasets(plan.first.data)[2], None)
        assert isinstance(model, VisionTransformer) and (model.grid, model.config.stride) == ((8, 8), (4, 4))
        distance = attention_distance(model, torch.randn(2, 3, 32, 32))
        assert distance.shape == (model.config.depth, model.config.num_heads) and np.isfinite(distance).all()
        vits += 1
    assert vits >= 2


ATTENTION_CLAIMS = [
    (name, scale)
    for name in sorted(shipped_sweeps())
    for scale in ("cpu", "gpu")
    if any(c.metric.startswith("attention.") for c in load_spec(name, scale=scale).claims)
]


@pytest.mark.parametrize(("name", "scale"), ATTENTION_CLAIMS)
def test_no_attention_claim_holds_already_at_initialisation(name, scale, tmp_path):
    """An attention claim tests what training does, so its two rows' models as the trainer draws them (seeds 0-2,
    the probe on their held-out images) must not show the claimed ordering already: the hybrid's first layer starts
    farther than the ViT's, and "hybrid farther" would be shown with no training at all."""
    spec = load_spec(name, scale=scale)
    cells = spec.expand()
    for claim in (c for c in spec.claims if c.metric.startswith("attention.")):
        differences = []
        for seed in spec.seeds[:3]:
            values = []
            for side in (claim.higher, claim.lower):
                cell = next(c for c in cells if c.seed == seed and Claim.matches(side, dict(c.values)))
                cfg = plan_cell(spec, cell, tmp_path, threads=1).first
                _, held_out, info = build_datasets(cfg.data)
                torch.manual_seed(mix_seed(seed, 0x1417))  # the trainer's init draw (train/setup.py)
                model = build_model(cfg, info, None).eval()
                run_dir = tmp_path / cell.name
                run_dir.mkdir(exist_ok=True)
                (run_dir / ATTENTION_FILE).write_text(json.dumps(attention_record(model, held_out, 64)))
                values.append(probe_metric(run_dir, claim.metric))
            differences.append(values[0] - values[1])
        assert np.mean(differences) <= 0, f"{name} {scale}: {claim.metric} holds untrained: {differences}"


def test_the_gpu_scale_refuses_a_machine_without_one_unless_a_device_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["sweep", "hybrids", "--scale", "gpu", "--quick", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and "--scale gpu: no GPU here; add --device cpu" in err[0]
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="no gpu section"):
        spec = tmp_path / "s.yaml"
        spec.write_text(yaml.safe_dump({"config": tiny_digits(), "grid": {"optim.lr": [0.1]}}))
        load_spec(spec, scale="gpu")


def test_the_gpu_scale_quick_runs_on_a_cpu_with_its_own_folder_and_aggregate_command(tmp_path, monkeypatch, capsys):
    """`vitkit sweep data_regime --scale gpu --device cpu --quick`: the GPU scale's overrides (32 px, its probes,
    untrained baselines) on the quick variant's tiny models; the table and page say how to read it again."""
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "data_regime", "--scale", "gpu", "--device", "cpu", "--quick", "--jobs", "1"]) == 0
    out = tmp_path / "runs" / "sweeps" / "data_regime_gpu_quick"
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["options"] == "--scale gpu --quick" and "attention.layer2" in doc["metrics"]
    assert len(doc["runs"]) == len(load_spec("data_regime", quick=True, scale="gpu").expand())
    cell = next(p for p in out.iterdir() if p.is_dir() and "untrained" in p.name and not p.name.endswith("finetune"))
    cfg = load_config(cell / "config.yaml")
    assert cfg.data.img_size == 32 and cfg.run.device == "cpu" and cfg.optim.lr == 0
    page = (out / "report.html").read_text()
    assert "vitkit sweep" in page and "--scale gpu --quick" in page and "--aggregate-only" in page
    assert "attention_distance.png" in page  # the 8x8-token scale's Fig. 7, on the sweep's page


def test_lists_of_cells_multiply_and_a_key_in_two_lists_is_refused(tmp_path):
    models = [{"model.depth": 1}, {"model.depth": 2, "model.width": 32}]
    budgets = [{"schedule.steps": 4}, {"schedule.steps": 8, "data.train_fraction": 0.5}, {"pretrain": "untrained"}]
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"config": tiny_digits(), "cells": [models, budgets], "seeds": [0]}))
    cells = load_spec(spec).expand()
    assert [dict(c.values) for c in cells] == [{**m, **b} for m in models for b in budgets]
    assert len({c.name for c in cells}) == 6
    spec.write_text(yaml.safe_dump({"config": tiny_digits(), "cells": [models, [{"model.depth": 3}]]}))
    with pytest.raises(UserError, match=r"cells\[1\]: keys \['model.depth'\] are in more than one"):
        load_spec(spec)


def test_an_untrained_cell_is_its_model_as_initialised_and_its_baselines_are_measured(tmp_path):
    """The untrained cell's saved weights are exactly those the trainer draws for its seed (one step at learning
    rate 0 moves nothing), and a trained cell of the same seed has moved away from them."""
    spec = tmp_path / "s.yaml"
    doc = {
        "config": tiny_digits(),
        "cells": [{"schedule.steps": 5}, {"pretrain": "untrained"}],
        "seeds": [3],
        "metrics": ["eval_top1"],
    }
    spec.write_text(yaml.safe_dump(doc))
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    assert not result.failed
    untrained = tmp_path / "out" / "pretrain-untrained_seed-3"
    cfg = load_config(untrained / "config.yaml")
    assert cfg.optim.lr == 0 and cfg.schedule.steps == 1
    _, _, info = build_datasets(cfg.data)
    torch.manual_seed(mix_seed(3, 0x1417))  # the trainer's init draw for run.seed 3 (train/setup.py)
    drawn = build_model(cfg, info, None).state_dict()
    saved = load_file(untrained / "model.safetensors")
    assert saved.keys() == drawn.keys()
    assert all(torch.equal(saved[k], drawn[k]) for k in saved)
    trained = load_file(tmp_path / "out" / "steps-5_seed-3" / "model.safetensors")
    assert not torch.equal(trained["head.weight"], drawn["head.weight"])
    row = {r.values.get("pretrain"): r for r in result.rows}
    assert row["untrained"].mean["eval_top1"] is not None


def test_the_prepared_gpu_command_records_its_table_claims_and_seeds(tmp_path):
    """benchmarks/sweep.py, the GPU scale's one command, run on a CPU through the same code path (--device cpu
    --quick): the record has the command (its time limit), the machine, the wall time, the table with its claims and
    the seeds."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep.py"
    record = tmp_path / "record.md"
    command = [sys.executable, str(script), "hybrids", "--scale", "gpu", "--device", "cpu", "--quick", "--jobs", "1"]
    done = subprocess.run([*command, "--out", str(tmp_path / "o"), "--results", str(record)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    text = record.read_text()
    assert "- command: `python benchmarks/sweep.py hybrids --scale gpu --device cpu --quick" in text
    assert "- machine: " in text and "wall time" in text and "exit status 0" in text
    assert "--device cpu --time-limit 8.5: exit status 0" in text  # stopped in time to end within a 10-minute call
    assert "## Claims" in text and "eval_top1 per seed (x 100):" in text
    table = json.loads((tmp_path / "o" / "sweep.json").read_text())
    for run in table["runs"]:
        assert f"{run['seed']}: {100 * run['eval_top1']:.1f}" in text
